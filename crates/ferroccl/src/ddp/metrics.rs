//! Training metrics as JSON lines, per rank and averaged over ranks, and the check
//! that every rank ran the same number of steps.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use serde::{Deserialize, Serialize};
use std::io::Write;

/// One logged interval of training, as one JSON object per line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `"rank"` (one rank's figures) or `"mean"` (averaged over ranks; throughput summed).
    pub kind: String,
    /// The rank (0 for `"mean"` records, which rank 0 writes).
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Optimizer steps done.
    pub step: u64,
    /// Epoch of the last step.
    pub epoch: u64,
    /// Mean training loss over the interval.
    pub loss: f64,
    /// Training accuracy over the interval.
    pub accuracy: f64,
    /// Images per second (this rank's; the job's for `"mean"`).
    pub images_per_s: f64,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Loss scale (1 without mixed precision).
    pub loss_scale: f64,
    /// Seconds per step spent waiting for gradient all-reduces after backward.
    pub comm_exposed_s: f64,
    /// Seconds per step of forward + backward.
    pub compute_s: f64,
}

impl Record {
    /// The job-wide record: loss, accuracy and timings averaged over ranks,
    /// throughput summed. Every rank must call it (it is a collective).
    pub fn reduce(&self, comm: &Communicator) -> Result<Record> {
        let n = comm.world_size() as f64;
        let mut v = [
            self.loss,
            self.accuracy,
            self.images_per_s,
            self.comm_exposed_s,
            self.compute_s,
        ];
        comm.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(Record {
            kind: "mean".into(),
            rank: 0,
            loss: v[0] / n,
            accuracy: v[1] / n,
            images_per_s: v[2],
            comm_exposed_s: v[3] / n,
            compute_s: v[4] / n,
            ..self.clone()
        })
    }

    /// Appends this record as one line of JSON.
    pub fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *w, self)?;
        w.write_all(b"\n")
    }
}

/// Fails unless every rank has done `steps` steps: a rank that took a different
/// number would have paired its all-reduces with the wrong ones of its peers.
pub fn check_same_steps(comm: &Communicator, steps: u64) -> Result<()> {
    let mut lo = [steps as i64];
    let mut hi = [steps as i64];
    comm.all_reduce(&mut lo, ReduceOp::Min)?;
    comm.all_reduce(&mut hi, ReduceOp::Max)?;
    if lo[0] != hi[0] {
        return Err(Error::InvalidArgument(format!(
            "ranks ended on different steps: between {} and {} (rank {} did {steps})",
            lo[0],
            hi[0],
            comm.rank()
        )));
    }
    Ok(())
}
