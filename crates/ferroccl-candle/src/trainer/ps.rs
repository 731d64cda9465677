//! The trainer behind `ferroccl train --mode ssp --staleness S`: the data-parallel
//! trainer's LeNet, data, sampler and LR schedule ([`super::train`]'s), with the
//! weights on the parameter server ([`crate::ps::run`]) instead of in
//! [`crate::ddp::Ddp`]. Worker r trains on the sampler's share r of each global batch,
//! as rank r does in DDP, so that with s = 0 both follow the same trajectory (up to
//! the order in which the N gradients are summed). Servers step with SGD with
//! momentum. Refused here ([`Trainer::refuses`]): gradient accumulation, half
//! precision, checkpoints every N steps and metrics (the DDP trainer's).
//!
//! Checkpoints (rank 0, with a checkpoint directory, at the end of the run): the
//! servers' whole state ([`PsState`]: `param/ps`, `momentum/ps`, per-server counters
//! `opt/KIND.j`) and every worker's clock; a resumed run starts each server and worker
//! there.

use super::batches::{Batches, Share};
use super::config::{load_data, Straggler, TrainConfig, Trainer};
use super::eval::{evaluate, Curve};
use crate::ddp::{agree, broadcast_bytes, Sgd};
use crate::error::{Error, Result};
use crate::model::{LeNet, Precision};
use crate::ps::ssp::Staleness;
use crate::ps::{PsState, Worker};
use ferroccl::ddp::checkpoint::{Checkpoint, CheckpointDir, Tensor as CkptTensor};
use ferroccl::ddp::LrSchedule;
use ferroccl::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Instant;

/// What a parameter-server run did; the same on every rank.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PsSummary {
    /// Ranks (each a worker and a server).
    pub world: usize,
    /// The staleness bound (`inf`: asynchronous).
    pub staleness: String,
    /// Each worker's steps at the end (including those before a resume).
    pub steps: Vec<u64>,
    /// Images per step over all workers (each worker's share: this over `world`).
    pub global_batch: usize,
    /// Images per second over the job (every worker's images / the run's wall time).
    pub images_per_s: f64,
    /// Accuracy on the held-out test set of the servers' final weights.
    pub test_accuracy: f64,
    /// `histogram[k]`: updates applied k steps stale, over all servers.
    pub histogram: Vec<u64>,
    /// Optimizer steps the servers applied (s = 0: one per shard and step).
    pub updates: u64,
    /// Wall seconds of this invocation (the slowest rank's).
    pub wall_s: f64,
    /// Test accuracy against wall-clock seconds (`TrainConfig::curve_every`: worker
    /// 0's pulled weights; the last point is the servers' final weights).
    pub curve: Vec<(f64, f64)>,
}

/// A finished parameter-server run.
pub struct PsTrained {
    /// The summary.
    pub summary: PsSummary,
    /// The final weights by name (forward order).
    pub params: Vec<(String, Vec<f32>)>,
    /// The servers' final state.
    pub state: PsState,
}

/// The checkpoint's JSON state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Meta {
    clocks: Vec<u64>,
    world: usize,
    global_batch: usize,
    width: usize,
    seed: u64,
    steps_per_epoch: u64,
}

struct LeNetWorker<'a> {
    model: &'a LeNet,
    cfg: &'a TrainConfig,
    batches: Batches,
    rank: usize,
    stop: u64,
    lr: LrSchedule,
    t0: Instant,
    curve: Curve,
    images: usize,
}

impl Worker for LeNetWorker<'_> {
    fn wants(&mut self, step: u64) -> bool {
        step < self.stop && self.cfg.time_limit.is_none_or(|l| self.t0.elapsed() < l)
    }

    fn gradient(&mut self, step: u64, params: &[f32]) -> Result<(Vec<f32>, f32)> {
        self.curve
            .at(self.t0.elapsed().as_secs_f64(), || params.to_vec());
        let t = Instant::now();
        self.model.set_flat(params)?;
        let micro = self.batches.micro();
        let mb = self.batches.pass(step, 0);
        let fwd = self.model.forward(&mb.images, micro, Precision::F32)?;
        let loss = self.model.loss(&fwd, &mb.labels)?;
        // As the DDP trainer scales its loss (by 1 in f32 without accumulation), so
        // that one worker reproduces it bit for bit.
        let scaled = (loss * 1.0f64)?;
        let lens = self.model.param_lens();
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0, |at, n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        let mut grad = vec![0.0f32; params.len()];
        self.model.backward(&fwd, &scaled, |j, g| {
            grad[offsets[j]..offsets[j] + lens[j]].copy_from_slice(g);
            Ok(())
        })?;
        Straggler::delay(self.cfg.straggler, self.rank, t.elapsed());
        self.images += micro;
        Ok((grad, self.lr.at(step) as f32))
    }
}

/// Trains LeNet over the parameter server with staleness bound `staleness`; every
/// rank calls it with the same config. `cfg.max_steps` and `cfg.time_limit` stop each
/// worker on its own (a finished worker no longer holds the others back).
pub fn train_ps(comm: &Communicator, cfg: &TrainConfig, staleness: Staleness) -> Result<PsTrained> {
    let (world, rank) = (comm.world_size(), comm.rank());
    cfg.check_lenet(Trainer::ParameterServer, world)?;
    let micro = cfg.global_batch / world;
    let (train_set, test_set) = load_data(cfg)?;
    let share = Share {
        world,
        rank,
        micro,
        accum: 1,
    };
    let batches = Batches::new(train_set, share, cfg.seed, cfg.augment)?;
    let steps_per_epoch = batches.steps_per_epoch();
    let total_steps = cfg.epochs * steps_per_epoch;
    let model = LeNet::on(cfg.width, cfg.seed, &cfg.device.candle(comm.local_rank())?)?;
    let meta = Meta {
        clocks: Vec::new(),
        world,
        global_batch: cfg.global_batch,
        width: cfg.width,
        seed: cfg.seed,
        steps_per_epoch,
    };
    let ckdir = cfg.checkpoint_dir_on(rank)?;
    let resume = load_state(comm, cfg, ckdir.as_ref(), &meta)?;
    let mut worker = LeNetWorker {
        model: &model,
        cfg,
        batches,
        rank,
        stop: total_steps.min(cfg.max_steps.unwrap_or(u64::MAX)),
        lr: cfg.lr_schedule(total_steps),
        t0: Instant::now(),
        curve: Curve::new(cfg.curve_every, rank),
        images: 0,
    };
    let out = crate::ps::run(
        comm,
        model.flat()?,
        Sgd::new(cfg.momentum, cfg.weight_decay),
        staleness,
        resume.as_ref(),
        &mut worker,
    )?;
    let wall = worker.t0.elapsed().as_secs_f64();
    let mut job = [worker.images as f64, wall];
    comm.all_reduce(&mut job[..1], ReduceOp::Sum)?;
    comm.all_reduce(&mut job[1..], ReduceOp::Max)?;
    model.set_flat(&out.state.params)?;
    let accuracy = evaluate(comm, &model, &test_set)?;
    let curve = worker
        .curve
        .evaluate(comm, &model, &test_set, (job[1], accuracy))?;
    if let Some(d) = &ckdir {
        let step = out.state.clocks.iter().copied().min().unwrap_or(0);
        let meta = Meta {
            clocks: out.state.clocks.clone(),
            ..meta
        };
        d.save(step, &to_checkpoint(&out.state, &meta)?)?;
    }
    Ok(PsTrained {
        summary: PsSummary {
            world,
            staleness: staleness.to_string(),
            steps: out.state.clocks.clone(),
            global_batch: cfg.global_batch,
            images_per_s: job[0] / job[1].max(1e-9),
            test_accuracy: accuracy,
            histogram: out.histogram.counts.clone(),
            updates: out.updates,
            wall_s: job[1],
            curve,
        },
        params: by_name(&model, &out.state.params),
        state: out.state,
    })
}

/// `flat` (the whole parameter vector, forward order) cut into `model`'s parameters,
/// by name.
fn by_name(model: &LeNet, flat: &[f32]) -> Vec<(String, Vec<f32>)> {
    let mut at = 0;
    model
        .params
        .iter()
        .map(|p| {
            let n: usize = p.shape.iter().product();
            at += n;
            (p.name.clone(), flat[at - n..at].to_vec())
        })
        .collect()
}

fn to_checkpoint(st: &PsState, meta: &Meta) -> Result<Checkpoint> {
    let mut tensors = vec![CkptTensor {
        name: "param/ps".into(),
        shape: vec![st.params.len()],
        data: st.params.clone(),
    }];
    for (kind, b) in &st.opt {
        tensors.push(CkptTensor {
            name: format!("{kind}/ps"),
            shape: vec![b.len()],
            data: b.clone(),
        });
    }
    for (kind, per_server) in &st.counters {
        for (j, &v) in per_server.iter().enumerate() {
            // Two f32 of 24 bits each, as the DDP checkpoints' counters.
            tensors.push(CkptTensor {
                name: format!("opt/{kind}.{j}"),
                shape: vec![2],
                data: vec![(v & 0xff_ffff) as f32, (v >> 24) as f32],
            });
        }
    }
    let state =
        serde_json::to_value(meta).map_err(|e| Error::invalid(format!("checkpoint state: {e}")))?;
    Ok(Checkpoint { state, tensors })
}

fn from_checkpoint(ck: &Checkpoint, path: &Path, fresh: &Meta, total: usize) -> Result<PsState> {
    let bad = |why: String| Error::checkpoint(path, why);
    let meta: Meta = serde_json::from_value(ck.state.clone())
        .map_err(|e| bad(format!("not a parameter-server checkpoint: {e}")))?;
    if (
        meta.world,
        meta.global_batch,
        meta.width,
        meta.seed,
        meta.steps_per_epoch,
    ) != (
        fresh.world,
        fresh.global_batch,
        fresh.width,
        fresh.seed,
        fresh.steps_per_epoch,
    ) || meta.clocks.len() != fresh.world
    {
        return Err(bad(format!(
            "written by a run of {} ranks, global batch {}, width {}, seed {}; this run has \
             {}, {}, {}, {} (resume with the same shape and data)",
            meta.world,
            meta.global_batch,
            meta.width,
            meta.seed,
            fresh.world,
            fresh.global_batch,
            fresh.width,
            fresh.seed
        )));
    }
    let params = crate::ddp::stored(ck, "param/ps", &[total], path)?.to_vec();
    let momentum = crate::ddp::stored(ck, "momentum/ps", &[total], path)?.to_vec();
    Ok(PsState {
        params,
        opt: vec![("momentum".into(), momentum)],
        counters: Vec::new(),
        clocks: meta.clocks,
    })
}

/// Rank 0 loads the checkpoint `cfg.resume` asks for; every rank gets its state
/// (`None`: starting fresh). A checkpoint that does not fit fails on every rank.
fn load_state(
    comm: &Communicator,
    cfg: &TrainConfig,
    dir: Option<&CheckpointDir>,
    fresh: &Meta,
) -> Result<Option<PsState>> {
    let total: usize = LeNet::new(cfg.width, cfg.seed)?.param_lens().iter().sum();
    let mut blob = Vec::new();
    let r = if comm.rank() == 0 {
        cfg.resume_from(dir)
            .map_err(Error::from)
            .and_then(|l| match l {
                None => Ok(()),
                Some((path, ck)) => {
                    let st = from_checkpoint(&ck, &path, fresh, total)?;
                    blob = serde_json::to_vec(&st).map_err(|e| {
                        Error::checkpoint(&path, format!("does not serialise: {e}"))
                    })?;
                    Ok(())
                }
            })
    } else {
        Ok(())
    };
    agree(comm, r, "to load the checkpoint")?;
    broadcast_bytes(comm, &mut blob)?;
    if blob.is_empty() {
        return Ok(None);
    }
    let s: PsState = serde_json::from_slice(&blob)
        .map_err(|e| Error::invalid(format!("checkpoint state from rank 0: {e}")))?;
    Ok(Some(s))
}
