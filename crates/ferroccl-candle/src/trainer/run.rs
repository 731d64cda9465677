//! The data-parallel trainer: LeNet on [`Ddp`], one [`Run`] per rank.
//!
//! [`train`] is the whole loop: [`Run::start`] (data, model, rank 0's weights on every
//! rank, resume), then until the last step [`Run::step`] (the micro-batches' forward
//! and backward, the bucketed all-reduce, the optimizer step), [`Run::should_stop`]
//! (the time limit, a preemption: the same verdict on every rank), [`Run::record`]
//! (metrics, progress) and [`Run::checkpoint`] (rank 0); then [`Run::finish`] (test
//! accuracy, the summary).

use super::batches::{Batches, Share};
use super::config::{load_data, Straggler, TrainConfig, Trainer};
use super::eval::{evaluate, Curve};
use super::record::{At, Recorder};
use crate::data::Dataset;
use crate::ddp::{Ddp, DdpConfig, Sgd, StepReport};
use crate::error::{Error, Result};
use crate::model::{Forward, LeNet, Precision};
use candle_core::Tensor;
use ferroccl::ddp::checkpoint::{Checkpoint, CheckpointDir};
use ferroccl::ddp::metrics::check_same_steps;
use ferroccl::ddp::{LossScaler, LrSchedule, TrainError, TrainResult};
use ferroccl::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// What a run did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    /// Ranks.
    pub world: usize,
    /// Optimizer steps completed (including those before a resume).
    pub steps: u64,
    /// Steps this invocation ran.
    pub steps_run: u64,
    /// Images per optimizer step over all ranks.
    pub global_batch: usize,
    /// Mean training loss of the last logged window (the last `log_every` steps, or
    /// fewer at the end): it depends on `log_every`.
    pub final_loss: f64,
    /// Training loss of the final step, averaged over ranks: the same whatever
    /// `log_every`, and for a resumed run the same as for one that never stopped.
    pub step_loss: f64,
    /// Steps the `final_loss` window covers.
    pub final_loss_steps: u64,
    /// Accuracy on the held-out test set at the end.
    pub test_accuracy: f64,
    /// Images per second over the job (sum over ranks), this invocation.
    pub images_per_s: f64,
    /// Mean seconds per step of forward + backward (over ranks).
    pub compute_s: f64,
    /// Mean seconds per step waiting for gradient all-reduces after backward.
    pub comm_exposed_s: f64,
    /// Buckets per step.
    pub buckets: usize,
    /// Steps skipped for overflow (mixed precision).
    pub skipped_steps: u64,
    /// Wall seconds of this invocation's training loop.
    pub wall_s: f64,
    /// Test accuracy against wall-clock seconds (with [`TrainConfig::curve_every`];
    /// the last point is the end of the run).
    #[serde(default)]
    pub curve: Vec<(f64, f64)>,
    /// Whether every rank ended with rank 0's weights, bit for bit (their digests
    /// compared by an all-reduce after the last step).
    #[serde(default)]
    pub replicas_equal: bool,
}

/// A finished run: its summary and the final parameters (forward order).
pub struct Outcome {
    /// The summary.
    pub summary: Summary,
    /// Parameters by name and value.
    pub params: Vec<(String, Vec<f32>)>,
}

/// The resumable state, stored as a checkpoint's JSON.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct State {
    /// Optimizer steps done; the next step is this one. The sampler position is
    /// derived from it: epoch = step / steps_per_epoch, batch = step % steps_per_epoch.
    step: u64,
    epoch: u64,
    batch_in_epoch: u64,
    steps_per_epoch: u64,
    world: usize,
    global_batch: usize,
    seed: u64,
    /// Augmentation draws come from a generator keyed by (seed, rank, step): this is
    /// its key, so the stream continues exactly.
    rng_key: u64,
    scaler: LossScaler,
    lr: LrSchedule,
    width: usize,
}

impl State {
    /// Step 0 of a run of `cfg` on `world` ranks.
    fn fresh(cfg: &TrainConfig, world: usize, steps_per_epoch: u64, total_steps: u64) -> Self {
        State {
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            steps_per_epoch,
            world,
            global_batch: cfg.global_batch,
            seed: cfg.seed,
            rng_key: 0,
            scaler: if cfg.precision == Precision::F32 {
                LossScaler::new(1.0, u32::MAX)
            } else {
                LossScaler::new(cfg.loss_scale, cfg.scale_growth_interval)
            },
            lr: cfg.lr_schedule(total_steps),
            width: cfg.width,
        }
    }

    /// One optimizer step more.
    fn advance(&mut self) {
        self.step += 1;
        self.epoch = self.step / self.steps_per_epoch;
        self.batch_in_epoch = self.step % self.steps_per_epoch;
        self.rng_key = self.step;
    }

    /// Whether a checkpoint's state `s` is one of this run's shape (on `path`).
    fn fits(&self, s: &State, path: &std::path::Path) -> TrainResult<()> {
        let bad = |why: String| Err(TrainError::checkpoint(path, why));
        if s.world != self.world || s.global_batch != self.global_batch || s.width != self.width {
            return bad(format!(
                "written by a run of {} ranks, global batch {}, width {}; this run has {}, {}, \
                 {} (resume with the same shape)",
                s.world, s.global_batch, s.width, self.world, self.global_batch, self.width
            ));
        }
        if s.steps_per_epoch != self.steps_per_epoch || s.seed != self.seed {
            return bad(format!(
                "written for other data or seed ({} steps per epoch, seed {}; this run: {}, {})",
                s.steps_per_epoch, s.seed, self.steps_per_epoch, self.seed
            ));
        }
        Ok(())
    }
}

/// What [`Run::should_stop`] decided after a step; the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Go on.
    No,
    /// That was the last step (the end of the schedule, `max_steps` or the time limit).
    End,
    /// A rank was asked to stop: checkpoint and end as [`TrainError::Preempted`].
    Preempted,
}

/// One rank's data-parallel run: the model and its `Ddp`, the data, where the run is
/// (its resumable state) and what it has measured. See the module docs for the order
/// of its calls, which every rank makes alike.
pub struct Run<'c> {
    comm: &'c Communicator,
    cfg: &'c TrainConfig,
    model: LeNet,
    ddp: Ddp<'c, Sgd>,
    batches: Batches,
    test: Dataset,
    state: State,
    /// The step after which the run ends.
    stop: u64,
    start_step: u64,
    ckdir: Option<CheckpointDir>,
    rec: Recorder,
    curve: Curve,
    t_run: Instant,
    last_step_loss: f64,
}

/// Trains on `comm`'s ranks; every rank calls it with the same config.
pub fn train(comm: &Communicator, cfg: &TrainConfig) -> Result<Outcome> {
    let mut run = Run::start(comm, cfg)?;
    while !run.done() {
        let lr = run.step()?;
        let stop = run.should_stop()?;
        run.record(lr, stop)?;
        let saved = run.checkpoint(stop)?;
        if stop == Stop::Preempted {
            return Err(run.preempted(saved));
        }
    }
    run.finish()
}

impl<'c> Run<'c> {
    /// Collective: checks `cfg` against the job, loads the data, builds the model and
    /// its `Ddp` (rank 0's weights reach every rank) and resumes from the checkpoint
    /// `cfg` asks for (rank 0's, on every rank).
    pub fn start(comm: &'c Communicator, cfg: &'c TrainConfig) -> Result<Self> {
        let (world, rank) = (comm.world_size(), comm.rank());
        cfg.check_lenet(Trainer::Ddp, world)?;
        let micro = cfg.global_batch / (world * cfg.accum);
        let (train, test) = load_data(cfg)?;
        let share = Share {
            world,
            rank,
            micro,
            accum: cfg.accum,
        };
        let batches = Batches::new(train, share, cfg.seed, cfg.augment)?;
        let steps_per_epoch = batches.steps_per_epoch();
        // The schedule spans the whole run; --max-steps only stops it early (as a
        // preemption would), so a run stopped and resumed follows the same schedule.
        let total_steps = cfg.epochs * steps_per_epoch;
        let stop = total_steps.min(cfg.max_steps.unwrap_or(u64::MAX));
        let model = LeNet::on(cfg.width, cfg.seed, &cfg.device.candle(comm.local_rank())?)?;
        let ddp_cfg = DdpConfig {
            bucket_bytes: cfg.bucket_bytes,
            first_bucket_bytes: cfg.first_bucket_bytes,
            wire: cfg.wire,
        };
        let opt = Sgd::new(cfg.momentum, cfg.weight_decay);
        let mut ddp = Ddp::from_vars(comm, model.named_vars(), opt, ddp_cfg)?;
        let fresh = State::fresh(cfg, world, steps_per_epoch, total_steps);
        let ckdir = cfg.checkpoint_dir_on(rank)?;
        let state = resume(&mut ddp, cfg, ckdir.as_ref(), fresh)?;
        let rec = Recorder::open(
            cfg.metrics.as_deref(),
            cfg.progress,
            rank,
            (state.step, stop),
        )?;
        Ok(Run {
            comm,
            cfg,
            model,
            ddp,
            batches,
            test,
            start_step: state.step,
            state,
            stop,
            ckdir,
            rec,
            curve: Curve::new(cfg.curve_every, rank),
            t_run: Instant::now(),
            last_step_loss: f64::NAN,
        })
    }

    /// Whether the run has taken its last step.
    pub fn done(&self) -> bool {
        self.state.step >= self.stop
    }

    /// One optimizer step: every accumulation pass's forward and backward (its buckets
    /// all-reduced as backward goes), the straggler's delay, the step on the averaged
    /// gradients. Returns the step's learning rate.
    pub fn step(&mut self) -> Result<f64> {
        let t_step = Instant::now();
        let scale = self.state.scaler.scale;
        let mut step_loss = 0.0;
        for a in 0..self.cfg.accum {
            step_loss += self.pass(a, scale)? / self.cfg.accum as f64;
        }
        Straggler::delay(self.cfg.straggler, self.comm.rank(), t_step.elapsed());
        // The averaged gradients are the same on every rank, so every rank decides alike.
        let lr = self.state.lr.at(self.state.step);
        let report = self.optimizer_step(lr, step_loss)?;
        self.last_step_loss = step_loss;
        self.state.advance();
        let took = t_step.elapsed();
        let step = self.state.step;
        self.rec.step(report.buckets, took, report.exposed, step);
        let ddp = &self.ddp;
        self.curve.at(self.t_run.elapsed().as_secs_f64(), || {
            ddp.weights().into_iter().flat_map(|(_, w)| w).collect()
        });
        Ok(lr)
    }

    /// Accumulation pass `a` of this step, the loss multiplied by `scale` (and divided
    /// by the passes); returns its loss.
    fn pass(&mut self, a: usize, scale: f32) -> Result<f64> {
        let (accum, micro) = (self.cfg.accum, self.batches.micro());
        let mb = self.batches.pass(self.state.step, a);
        self.ddp.begin_pass(a + 1 == accum);
        let fwd = self.model.forward(&mb.images, micro, self.cfg.precision)?;
        let loss = self.model.loss(&fwd, &mb.labels)?;
        let lv = loss.to_scalar::<f32>()? as f64;
        self.rec.pass(lv, LeNet::correct(&fwd, &mb.labels)?, micro);
        let scaled = (loss * (scale as f64 / accum as f64))?;
        self.backward(&fwd, &scaled)?;
        self.ddp.end_pass()?;
        Ok(lv)
    }

    /// The segmented backward, each segment's gradients handed to the reducer as they
    /// exist (or, without overlap, once the whole backward is done).
    fn backward(&mut self, fwd: &Forward, scaled: &Tensor) -> Result<()> {
        let ddp = &mut self.ddp;
        if self.cfg.overlap {
            return self
                .model
                .backward(fwd, scaled, |j, g| ddp.grad_ready(j, g));
        }
        let mut held: Vec<(usize, Vec<f32>)> = Vec::new();
        self.model.backward(fwd, scaled, |j, g| {
            held.push((j, g.to_vec()));
            Ok(())
        })?;
        for (j, g) in held {
            ddp.grad_ready(j, &g)?;
        }
        Ok(())
    }

    /// The optimizer step at `lr`: plain in f32 (an inf or a NaN there diverged),
    /// through the loss scaler in half precision.
    fn optimizer_step(&mut self, lr: f64, step_loss: f64) -> Result<StepReport> {
        if self.cfg.precision != Precision::F32 {
            return self.ddp.step_scaled(lr, &mut self.state.scaler);
        }
        let (step, peak) = (self.state.step, self.state.lr.peak());
        self.ddp.step(lr).map_err(|e| match e {
            Error::Train(TrainError::Diverged { why, .. }) => TrainError::Diverged {
                step,
                why: format!(
                    "{why} (loss of this step {step_loss:.4e}); lower --lr (peak {peak:.4}) \
                     or lengthen --warmup"
                ),
            }
            .into(),
            e => e,
        })
    }

    /// Collective, after a step: whether the run ends here (the last step, or the time
    /// limit by rank 0's clock) or was asked to stop (a preemption on any rank).
    pub fn should_stop(&mut self) -> Result<Stop> {
        if let Some(limit) = self.cfg.time_limit {
            // Rank 0's clock decides, so that every rank stops after the same step.
            let mut over = [u8::from(self.t_run.elapsed() >= limit)];
            self.comm.broadcast(&mut over, 0)?;
            if over[0] == 1 {
                self.stop = self.state.step;
            }
        }
        if self.state.step == self.stop {
            return Ok(Stop::End);
        }
        // Asked to stop (SIGTERM on any rank): every rank learns it after the same step.
        match &self.cfg.preemption {
            Some(p) if p.agreed(self.comm)? => Ok(Stop::Preempted),
            _ => Ok(Stop::No),
        }
    }

    /// Collective: the metrics record of the steps since the last, every `log_every`
    /// steps and at the end (`lr`: the step's).
    pub fn record(&mut self, lr: f64, stop: Stop) -> Result<()> {
        let step = self.state.step;
        if !step.is_multiple_of(self.cfg.log_every.max(1)) && stop != Stop::End {
            return Ok(());
        }
        let at = At {
            step,
            steps_per_epoch: self.state.steps_per_epoch,
            lr,
            loss_scale: self.state.scaler.scale,
        };
        self.rec.record(self.comm, &at)
    }

    /// Rank 0 writes this step's checkpoint every `checkpoint_every` steps, at the end
    /// and when preempted; returns its file (`None` elsewhere and between).
    pub fn checkpoint(&mut self, stop: Stop) -> Result<Option<PathBuf>> {
        let every = self.cfg.checkpoint_every;
        let due = every > 0 && self.state.step.is_multiple_of(every) || stop != Stop::No;
        match &self.ckdir {
            Some(d) if due => {
                let ck = snapshot(&mut self.ddp, &self.state)?;
                Ok(Some(d.save(self.state.step, &ck)?))
            }
            _ => Ok(None),
        }
    }

    /// The run stopped for a preemption after this step, its checkpoint `saved` (rank
    /// 0's): the error it ends with.
    pub fn preempted(&self, saved: Option<PathBuf>) -> Error {
        self.rec.clear();
        TrainError::Preempted {
            step: self.state.step,
            checkpoint: saved,
        }
        .into()
    }

    /// Collective, after the last step: the test accuracy (and its curve) and the
    /// run's summary, the same on every rank, and the final weights.
    pub fn finish(self) -> Result<Outcome> {
        let (totals, (final_loss, final_loss_steps)) = self.rec.finish();
        let (comm, world) = (self.comm, self.comm.world_size());
        let wall = self.t_run.elapsed();
        check_same_steps(comm, self.state.step)?;
        let accuracy = evaluate(comm, &self.model, &self.test)?;
        let last = (wall.as_secs_f64(), accuracy);
        let curve = self.curve.evaluate(comm, &self.model, &self.test, last)?;
        let steps_run = self.state.step - self.start_step;
        let mut job = [
            totals.images as f64 / wall.as_secs_f64().max(1e-9),
            totals.compute.as_secs_f64() / steps_run.max(1) as f64,
            totals.exposed.as_secs_f64() / steps_run.max(1) as f64,
            self.last_step_loss,
        ];
        comm.all_reduce(&mut job, ReduceOp::Sum)?;
        let params = self.ddp.weights();
        let replicas_equal = replicas_agree(comm, &params)?;
        let summary = Summary {
            world,
            steps: self.state.step,
            steps_run,
            global_batch: self.cfg.global_batch,
            final_loss,
            step_loss: job[3] / world as f64,
            final_loss_steps,
            test_accuracy: accuracy,
            images_per_s: job[0],
            compute_s: job[1] / world as f64,
            comm_exposed_s: job[2] / world as f64,
            buckets: self.ddp.bucket_plan().buckets.len(),
            skipped_steps: self.state.scaler.skipped,
            wall_s: wall.as_secs_f64(),
            curve,
            replicas_equal,
        };
        Ok(Outcome { summary, params })
    }
}

/// Collective: whether every rank holds the same `params`, bit for bit. Each rank
/// digests its own (FNV-1a over the f32 bits, names and order included); the largest
/// and smallest digest over the ranks are equal exactly when all are.
pub(crate) fn replicas_agree(comm: &Communicator, params: &[(String, Vec<f32>)]) -> Result<bool> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, v) in params {
        eat(name.as_bytes());
        for x in v {
            eat(&x.to_bits().to_le_bytes());
        }
    }
    let (hi, lo) = (i64::from((h >> 32) as u32), i64::from(h as u32));
    let mut m = [hi, lo, -hi, -lo];
    comm.all_reduce(&mut m, ReduceOp::Max)?;
    Ok(m[0] == -m[2] && m[1] == -m[3])
}

/// Collective: rank 0's checkpoint (weights, momentum, state) into every rank, when
/// `cfg` asks to resume; the state the run goes on from (`fresh` when there is
/// nothing to resume).
fn resume(
    ddp: &mut Ddp<'_, Sgd>,
    cfg: &TrainConfig,
    dir: Option<&CheckpointDir>,
    fresh: State,
) -> Result<State> {
    let loaded = if ddp.comm().rank() == 0 {
        cfg.resume_from(dir).and_then(|l| match l {
            Some((path, ck)) => {
                let s: State = serde_json::from_value(ck.state.clone()).map_err(|e| {
                    TrainError::checkpoint(&path, format!("state is not a trainer state: {e}"))
                })?;
                fresh.fits(&s, &path)?;
                Ok(Some((path, ck)))
            }
            None => Ok(None),
        })
    } else {
        Ok(None)
    };
    let Some(v) = ddp.restore(loaded)? else {
        return Ok(fresh);
    };
    let mut state: State = serde_json::from_value(v)
        .map_err(|e| Error::invalid(format!("checkpoint state from rank 0: {e}")))?;
    // The schedule continues as stored, but over this run's length.
    state.lr.total_steps = fresh.lr.total_steps;
    Ok(state)
}

fn snapshot(ddp: &mut Ddp<'_, Sgd>, state: &State) -> Result<Checkpoint> {
    let state = serde_json::to_value(state)
        .map_err(|e| Error::invalid(format!("checkpoint state: {e}")))?;
    Ok(ddp.snapshot(state))
}
