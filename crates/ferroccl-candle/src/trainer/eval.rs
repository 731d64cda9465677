//! The test accuracy, at the end of a run and against wall-clock time.

use crate::data::Dataset;
use crate::error::Result;
use crate::model::{LeNet, Precision};
use ferroccl::{Communicator, ReduceOp};
use std::time::Duration;

/// Accuracy on the test set, each rank evaluating every `world`-th image.
pub(crate) fn evaluate(comm: &Communicator, model: &LeNet, test: &Dataset) -> Result<f64> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let mine: Vec<usize> = (rank..test.len()).step_by(world).collect();
    let mut counts = [0.0f64, mine.len() as f64];
    for chunk in mine.chunks(256) {
        let d = test.select(chunk);
        let fwd = model.forward(&d.images, d.len(), Precision::F32)?;
        counts[0] += LeNet::correct(&fwd, &d.labels)? as f64;
    }
    comm.all_reduce(&mut counts, ReduceOp::Sum)?;
    Ok(if counts[1] > 0.0 {
        counts[0] / counts[1]
    } else {
        0.0
    })
}

/// Snapshots of the weights at wall-clock times, kept on rank 0 and evaluated after
/// the run ([`super::TrainConfig::curve_every`]).
pub(crate) struct Curve {
    every: Option<f64>,
    keep: bool,
    snaps: Vec<(f64, Vec<f32>)>,
}

impl Curve {
    pub(crate) fn new(every: Option<Duration>, rank: usize) -> Self {
        Curve {
            every: every.map(|d| d.as_secs_f64()).filter(|s| *s > 0.0),
            keep: rank == 0,
            snaps: Vec::new(),
        }
    }

    /// At `t` seconds into the run: keeps `weights()` if a snapshot is due.
    pub(crate) fn at(&mut self, t: f64, weights: impl FnOnce() -> Vec<f32>) {
        if let (Some(e), true) = (self.every, self.keep) {
            if t >= e * (self.snaps.len() + 1) as f64 {
                self.snaps.push((t, weights()));
            }
        }
    }

    /// Collective: each of rank 0's snapshots loaded into `model` and evaluated on
    /// `test` by every rank; then `last` (the run's end, whose weights `model` holds
    /// again). The same on every rank.
    pub(crate) fn evaluate(
        self,
        comm: &Communicator,
        model: &LeNet,
        test: &Dataset,
        last: (f64, f64),
    ) -> Result<Vec<(f64, f64)>> {
        let mut count = [self.snaps.len() as i64];
        comm.broadcast(&mut count, 0)?;
        if count[0] == 0 {
            return Ok(vec![last]);
        }
        let end = model.flat()?;
        let mut out = Vec::new();
        for k in 0..count[0] as usize {
            let (mut t, mut w) = match self.snaps.get(k) {
                Some((t, w)) => ([*t], w.clone()),
                None => ([0.0], vec![0.0; end.len()]),
            };
            comm.broadcast(&mut t, 0)?;
            comm.broadcast(&mut w, 0)?;
            model.set_flat(&w)?;
            out.push((t[0], evaluate(comm, model, test)?));
        }
        model.set_flat(&end)?;
        out.push(last);
        Ok(out)
    }
}
