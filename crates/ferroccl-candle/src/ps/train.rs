//! The trainer behind `ferroccl train --mode ssp --staleness S`: the data-parallel
//! trainer's LeNet, data, sampler and LR schedule ([`crate::train`]'s), with the
//! weights on the parameter server ([`super::run`]) instead of in [`crate::ddp::Ddp`].
//! Worker r trains on the sampler's share r of each global batch, as rank r does in
//! DDP, so that with s = 0 both follow the same trajectory (up to the order in which
//! the N gradients are summed). Servers step with SGD with momentum. Refused here:
//! gradient accumulation and half precision (the DDP trainer's).
//!
//! Checkpoints (rank 0, with a checkpoint directory, at the end of the run): the
//! servers' whole state ([`PsState`]: `param/ps`, `momentum/ps`, per-server counters
//! `opt/KIND.j`) and every worker's clock; a resumed run starts each server and worker
//! there.

use super::ssp::Staleness;
use super::{PsState, Worker};
use crate::data::Dataset;
use crate::ddp::{agree, broadcast_bytes, Sgd};
use crate::error::{Error, Result};
use crate::model::{LeNet, Precision};
use crate::{augment, evaluate, load_data, Curve, Resume, Straggler, TrainConfig};
use ferroccl::ddp::checkpoint::{self, Checkpoint, CheckpointDir, Tensor as CkptTensor};
use ferroccl::ddp::{DistributedSampler, LrSchedule, Rng};
use ferroccl::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
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
    train_set: &'a Dataset,
    sampler: DistributedSampler,
    rank: usize,
    micro: usize,
    steps_per_epoch: u64,
    stop: u64,
    lr: LrSchedule,
    t0: Instant,
    curve: Curve,
    images: usize,
    order: (u64, Vec<usize>),
    mb: Dataset,
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
        let (epoch, batch) = (step / self.steps_per_epoch, step % self.steps_per_epoch);
        if self.order.0 != epoch {
            self.order = (epoch, self.sampler.indices(epoch));
        }
        let first = batch as usize * self.micro;
        self.train_set
            .select_into(&self.order.1[first..first + self.micro], &mut self.mb);
        if self.cfg.augment {
            let mut aug = Rng::derive(
                self.cfg.seed ^ (self.rank as u64).wrapping_mul(0x9e37),
                step,
            );
            augment(&mut self.mb.images, &mut aug);
        }
        let fwd = self
            .model
            .forward(&self.mb.images, self.micro, Precision::F32)?;
        let loss = self.model.loss(&fwd, &self.mb.labels)?;
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
        self.images += self.micro;
        Ok((grad, self.lr.at(step) as f32))
    }
}

/// Trains LeNet over the parameter server with staleness bound `staleness`; every
/// rank calls it with the same config. `cfg.max_steps` and `cfg.time_limit` stop each
/// worker on its own (a finished worker no longer holds the others back).
pub fn train_ps(comm: &Communicator, cfg: &TrainConfig, staleness: Staleness) -> Result<PsTrained> {
    let (world, rank) = (comm.world_size(), comm.rank());
    if cfg.accum != 1 || cfg.precision != Precision::F32 {
        return Err(Error::invalid(
            "the parameter server trains in f32 without gradient accumulation \
             (--accum 1, --precision f32)",
        ));
    }
    if cfg.global_batch == 0 || !cfg.global_batch.is_multiple_of(world) {
        return Err(Error::invalid(format!(
            "global batch {} must be a positive multiple of the {world} workers",
            cfg.global_batch
        )));
    }
    Straggler::check(cfg.straggler, world)?;
    let micro = cfg.global_batch / world;
    let (train_set, test_set) = load_data(cfg)?;
    let sampler = DistributedSampler::new(train_set.len(), world, rank, cfg.seed)?;
    let steps_per_epoch = (sampler.per_rank() / micro) as u64;
    if steps_per_epoch == 0 {
        return Err(Error::invalid(format!(
            "{} training images cannot make one global batch of {} on {world} ranks",
            train_set.len(),
            cfg.global_batch
        )));
    }
    let total_steps = cfg.epochs * steps_per_epoch;
    let model = LeNet::new(cfg.width, cfg.seed)?;
    let meta = Meta {
        clocks: Vec::new(),
        world,
        global_batch: cfg.global_batch,
        width: cfg.width,
        seed: cfg.seed,
        steps_per_epoch,
    };
    let ckdir = match &cfg.checkpoint_dir {
        Some(d) if rank == 0 => Some(CheckpointDir::new(d, cfg.keep)?),
        _ => None,
    };
    let resume = load_state(comm, cfg, ckdir.as_ref(), &meta)?;
    let mut worker = LeNetWorker {
        model: &model,
        cfg,
        train_set: &train_set,
        sampler,
        rank,
        micro,
        steps_per_epoch,
        stop: total_steps.min(cfg.max_steps.unwrap_or(u64::MAX)),
        lr: LrSchedule {
            base_lr: cfg.base_lr,
            base_batch: cfg.base_batch,
            global_batch: cfg.global_batch,
            warmup_steps: cfg.warmup_steps,
            total_steps,
            decay: cfg.decay,
        },
        t0: Instant::now(),
        curve: Curve::new(cfg.curve_every, rank),
        images: 0,
        order: (u64::MAX, Vec::new()),
        mb: Dataset {
            images: Vec::with_capacity(micro * crate::data::PIXELS),
            labels: Vec::with_capacity(micro),
        },
    };
    let out = super::run(
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
    let curve = std::mem::replace(&mut worker.curve, Curve::new(None, rank));
    let curve = curve.evaluate(comm, &model, &test_set, (job[1], accuracy))?;
    if let Some(d) = &ckdir {
        let step = out.state.clocks.iter().copied().min().unwrap_or(0);
        let meta = Meta {
            clocks: out.state.clocks.clone(),
            ..meta
        };
        d.save(step, &to_checkpoint(&out.state, &meta)?)?;
    }
    let names: Vec<(String, usize)> = model
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.iter().product()))
        .collect();
    let mut at = 0;
    let params = names
        .into_iter()
        .map(|(name, n)| {
            at += n;
            (name, out.state.params[at - n..at].to_vec())
        })
        .collect();
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
        params,
        state: out.state,
    })
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
        let loaded: Result<Option<(PathBuf, Checkpoint)>> = match &cfg.resume {
            None => Ok(None),
            Some(Resume::File(p)) => checkpoint::load(p)
                .map(|c| Some((p.clone(), c)))
                .map_err(Error::from),
            Some(Resume::Latest) => match dir {
                Some(d) => d.load_latest().map_err(Error::from),
                None => Err(Error::invalid(
                    "--resume without a file needs a checkpoint directory",
                )),
            },
        };
        loaded.and_then(|l| match l {
            None => Ok(()),
            Some((path, ck)) => {
                let st = from_checkpoint(&ck, &path, fresh, total)?;
                blob = serde_json::to_vec(&st)
                    .map_err(|e| Error::checkpoint(&path, format!("does not serialise: {e}")))?;
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
