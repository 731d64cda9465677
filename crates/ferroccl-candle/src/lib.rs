//! ferroccl for candle: [`ddp::Ddp`], data-parallel training for any candle model
//! (PyTorch's `DistributedDataParallel(model)` in a few lines), and the trainer behind
//! `ferroccl train` (feature `candle`), which trains a small CNN ([`model::LeNet`]) on
//! it — sharded sampling, bucketed all-reduce overlapped with a segmented backward,
//! LR scaling with warmup, mixed precision with dynamic loss scaling, gradient
//! accumulation, rank-0 checkpoints and exact resume.
//!
//! Next to it, [`ps`]: a sharded parameter server with bounded staleness (SSP), the
//! asynchronous alternative (`ferroccl train --mode ssp`); and for models that do not
//! fit, [`pipeline`] stages, [`zero`] (ZeRO-1) and [`tensor_parallel`] layers.
//!
//! Every rank calls [`train`] with the same [`TrainConfig`]; rank 0's initial weights
//! are broadcast so replicas start identical, and every optimizer step applies the
//! same averaged gradients on every rank, so they stay identical.

pub mod data;
pub mod ddp;
pub mod error;
pub mod model;
pub mod pipeline;
pub mod ps;
pub mod tensor_parallel;
pub mod zero;

/// candle, as this crate builds on it: a user's model needs no version of its own.
pub use candle_core;
/// candle's layers, losses and `VarMap`, as this crate builds on them.
pub use candle_nn;
/// The communication library, as this crate builds on it.
pub use ferroccl;

use data::{Dataset, PIXELS, SIDE};
use ddp::{Ddp, DdpConfig, Sgd};
pub use error::{Error, Result};
use ferroccl::ddp::buckets::{DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
use ferroccl::ddp::checkpoint::{self, Checkpoint, CheckpointDir};
use ferroccl::ddp::metrics::{check_same_steps, Record};
use ferroccl::ddp::{
    Decay, DistributedSampler, LossScaler, LrSchedule, Rng, TrainError, TrainResult, WireDtype,
};
use ferroccl::Communicator;
use ferroccl::ReduceOp;
use model::{LeNet, Precision};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where the images come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// The built-in synthetic digits, this many images.
    Synthetic(usize),
    /// A CSV (`.csv`/`.csv.gz`, e.g. mnist_5k) or a directory of MNIST IDX files.
    Path(PathBuf),
}

/// Which checkpoint to resume from.
#[derive(Clone, Debug, PartialEq)]
pub enum Resume {
    /// The newest in the checkpoint directory (none there: start fresh).
    Latest,
    /// This file.
    File(PathBuf),
}

/// Everything a run is; the same on every rank.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The data.
    pub data: DataSource,
    /// Share of the data held out for the test accuracy.
    pub test_fraction: f64,
    /// Epochs to train (an epoch: every rank through its share once).
    pub epochs: u64,
    /// Stop after this many optimizer steps, if sooner (the LR schedule still spans
    /// `epochs`, so a run stopped here and resumed matches one that never stopped).
    pub max_steps: Option<u64>,
    /// Images per optimizer step over all ranks and accumulation passes.
    pub global_batch: usize,
    /// Backward passes per optimizer step (gradient accumulation).
    pub accum: usize,
    /// LR for `base_batch`; scaled linearly to the global batch.
    pub base_lr: f64,
    /// The batch `base_lr` is for.
    pub base_batch: usize,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// After warmup.
    pub decay: Decay,
    /// SGD momentum.
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Forward/backward precision.
    pub precision: Precision,
    /// Initial loss scale (half precision).
    pub loss_scale: f32,
    /// Clean steps before the loss scale grows.
    pub scale_growth_interval: u32,
    /// Gradient element type on the wire.
    pub wire: WireDtype,
    /// Bucket cap in bytes.
    pub bucket_bytes: usize,
    /// First bucket's cap in bytes.
    pub first_bucket_bytes: usize,
    /// Hand each segment's gradients to the reducer as soon as they exist (else only
    /// after the whole backward: for measuring what overlap hides).
    pub overlap: bool,
    /// Network width multiplier.
    pub width: usize,
    /// Random ±2-pixel translations of training images.
    pub augment: bool,
    /// The seed of everything.
    pub seed: u64,
    /// Where rank 0 writes checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// When set, a stop request (SIGTERM, see [`ferroccl::ddp::Preemption`]) ends the
    /// run after the current step on every rank, with a checkpoint (rank 0) and
    /// [`TrainError::Preempted`].
    pub preemption: Option<ferroccl::ddp::Preemption>,
    /// Checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Resume from a checkpoint.
    pub resume: Option<Resume>,
    /// JSON-lines metrics file (rank 0 writes it).
    pub metrics: Option<PathBuf>,
    /// Steps between metrics records.
    pub log_every: u64,
    /// Progress bar on rank 0 (shown only on a terminal).
    pub progress: bool,
    /// Make one rank a straggler (it sleeps after each step's compute).
    pub straggler: Option<Straggler>,
    /// Stop once this much wall-clock time has passed (the ranks agree on the step:
    /// rank 0's clock decides, checked after every step).
    pub time_limit: Option<Duration>,
    /// Keep rank 0's weights every this many seconds of wall-clock time, and report
    /// the test accuracy of each in [`Summary::curve`] (evaluated after the run).
    pub curve_every: Option<Duration>,
}

/// One rank that takes `factor` times as long per step: after its compute it sleeps
/// `(factor − 1)` times what the compute took (a sleep frees the CPU for the others,
/// as a slower machine would).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Straggler {
    /// The slow rank.
    pub rank: usize,
    /// Its slowdown, 1 or more.
    pub factor: f64,
}

impl Straggler {
    /// Refuses a straggler outside a job of `world` ranks or a slowdown that is not a
    /// finite number of 1 or more.
    pub fn check(s: Option<Straggler>, world: usize) -> Result<()> {
        match s {
            Some(s) if s.rank >= world || !(s.factor.is_finite() && s.factor >= 1.0) => {
                Err(Error::invalid(format!(
                    "straggler: rank {} slowed {}× in a job of {world} rank(s) (a rank below \
                     {world}, a finite factor of 1 or more)",
                    s.rank, s.factor
                )))
            }
            _ => Ok(()),
        }
    }

    /// On rank `rank`, after a compute of `took`: sleeps if this is the slow rank.
    pub fn delay(s: Option<Straggler>, rank: usize, took: Duration) {
        if let Some(s) = s.filter(|s| s.rank == rank && s.factor > 1.0) {
            std::thread::sleep(took.mul_f64(s.factor - 1.0));
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: DataSource::Synthetic(5000),
            test_fraction: 0.1,
            epochs: 2,
            max_steps: None,
            global_batch: 64,
            accum: 1,
            base_lr: 0.05,
            base_batch: 64,
            warmup_steps: 20,
            decay: Decay::Constant,
            momentum: 0.9,
            weight_decay: 0.0,
            precision: Precision::F32,
            loss_scale: 65536.0,
            scale_growth_interval: 200,
            wire: WireDtype::F32,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            overlap: true,
            width: 1,
            augment: false,
            seed: 0,
            checkpoint_dir: None,
            checkpoint_every: 0,
            preemption: None,
            keep: 3,
            resume: None,
            metrics: None,
            log_every: 50,
            progress: false,
            straggler: None,
            time_limit: None,
            curve_every: None,
        }
    }
}

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
}

/// Snapshots of the weights at wall-clock times, kept on rank 0 and evaluated after
/// the run ([`TrainConfig::curve_every`]).
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

/// Translates each image by up to ±2 pixels (zero fill), drawing from `rng`.
pub(crate) fn augment(pixels: &mut [f32], rng: &mut Rng) {
    let mut out = [0.0f32; PIXELS];
    for img in pixels.chunks_exact_mut(PIXELS) {
        let (sy, sx) = (rng.below(5) as i64 - 2, rng.below(5) as i64 - 2);
        for y in 0..SIDE as i64 {
            for x in 0..SIDE as i64 {
                let (ty, tx) = (y - sy, x - sx);
                out[(y * SIDE as i64 + x) as usize] =
                    if (0..SIDE as i64).contains(&ty) && (0..SIDE as i64).contains(&tx) {
                        img[(ty * SIDE as i64 + tx) as usize]
                    } else {
                        0.0
                    };
            }
        }
        img.copy_from_slice(&out);
    }
}

/// Loads the run's data (the same on every rank) and splits off the test set.
pub fn load_data(cfg: &TrainConfig) -> Result<(Dataset, Dataset)> {
    let all = match &cfg.data {
        DataSource::Synthetic(n) => Dataset::synthetic(*n, cfg.seed),
        DataSource::Path(p) => Dataset::load(p)?,
    };
    Ok(all.split(cfg.test_fraction, cfg.seed))
}

/// Trains on `comm`'s ranks; every rank calls it with the same config.
pub fn train(comm: &Communicator, cfg: &TrainConfig) -> Result<Outcome> {
    let (world, rank) = (comm.world_size(), comm.rank());
    if cfg.accum == 0
        || cfg.global_batch == 0
        || !cfg.global_batch.is_multiple_of(world * cfg.accum)
    {
        return Err(Error::invalid(format!(
            "global batch {} must be a positive multiple of ranks × accumulation steps ({world} × {})",
            cfg.global_batch, cfg.accum
        )));
    }
    if cfg.precision == Precision::Bf16 {
        return Err(ferroccl::Error::Unavailable {
            what: "bf16 compute".into(),
            why: "candle's CPU backend has no bf16 matmul; train in f16 or f32, and use \
                  bf16 for the gradients on the wire (--wire bf16) if you want"
                .into(),
        }
        .into());
    }
    Straggler::check(cfg.straggler, world)?;
    let micro = cfg.global_batch / (world * cfg.accum);
    let (train_set, test_set) = load_data(cfg)?;
    let sampler = DistributedSampler::new(train_set.len(), world, rank, cfg.seed)?;
    let steps_per_epoch = (sampler.per_rank() / (micro * cfg.accum)) as u64;
    if steps_per_epoch == 0 {
        return Err(Error::invalid(format!(
            "{} training images cannot make one global batch of {} on {world} ranks",
            train_set.len(),
            cfg.global_batch
        )));
    }
    // The schedule spans the whole run; --max-steps only stops it early (as a
    // preemption would), so a run stopped and resumed follows the same schedule.
    let total_steps = cfg.epochs * steps_per_epoch;
    let mut stop = total_steps.min(cfg.max_steps.unwrap_or(u64::MAX));
    let model = LeNet::new(cfg.width, cfg.seed)?;
    // Rank 0's fresh weights reach every rank here.
    let mut ddp = Ddp::from_vars(
        comm,
        model.named_vars(),
        Sgd::new(cfg.momentum, cfg.weight_decay),
        DdpConfig {
            bucket_bytes: cfg.bucket_bytes,
            first_bucket_bytes: cfg.first_bucket_bytes,
            wire: cfg.wire,
        },
    )?;
    let mut state = State {
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
        lr: LrSchedule {
            base_lr: cfg.base_lr,
            base_batch: cfg.base_batch,
            global_batch: cfg.global_batch,
            warmup_steps: cfg.warmup_steps,
            total_steps,
            decay: cfg.decay,
        },
        width: cfg.width,
    };
    let ckdir = match &cfg.checkpoint_dir {
        Some(d) if rank == 0 => Some(CheckpointDir::new(d, cfg.keep)?),
        _ => None,
    };

    // Resume: rank 0's checkpoint (weights, momentum, state) reaches every rank.
    let loaded = if rank == 0 {
        load_on_rank0(cfg, ckdir.as_ref(), &state)
    } else {
        Ok(None)
    };
    if let Some(v) = ddp.restore(loaded)? {
        state = serde_json::from_value(v)
            .map_err(|e| Error::invalid(format!("checkpoint state from rank 0: {e}")))?;
        // The schedule continues as stored, but over this run's length.
        state.lr.total_steps = total_steps;
    }

    let mut metrics = match (&cfg.metrics, rank) {
        (Some(p), 0) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| Error::io(format!("opening {}", p.display()), e))?,
        )),
        _ => None,
    };
    let bar = (cfg.progress && rank == 0).then(|| {
        let b = indicatif::ProgressBar::new(stop);
        b.set_position(state.step);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} steps {msg}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        b
    });

    let start_step = state.step;
    let t_run = Instant::now();
    let mut interval = Interval::default();
    let mut totals = Interval::default();
    let mut last_loss = f64::NAN;
    let (mut last_step_loss, mut last_window) = (f64::NAN, 0u64);
    let mut epoch_cache: Option<(u64, Vec<usize>)> = None;
    let mut curve = Curve::new(cfg.curve_every, rank);
    // One micro-batch, refilled in place every pass (augmentation edits it in place).
    let mut mb = Dataset {
        images: Vec::with_capacity(micro * PIXELS),
        labels: Vec::with_capacity(micro),
    };
    while state.step < stop {
        let epoch = state.step / steps_per_epoch;
        let batch = state.step % steps_per_epoch;
        if epoch_cache.as_ref().is_none_or(|(e, _)| *e != epoch) {
            epoch_cache = Some((epoch, sampler.indices(epoch)));
        }
        let order = &epoch_cache.as_ref().expect("set above").1;
        let mut aug = Rng::derive(cfg.seed ^ (rank as u64).wrapping_mul(0x9e37), state.step);
        let t_step = Instant::now();
        let scale = state.scaler.scale;
        let mut step_loss = 0.0;
        for a in 0..cfg.accum {
            let first = (batch as usize * cfg.accum + a) * micro;
            let idx = &order[first..first + micro];
            train_set.select_into(idx, &mut mb);
            if cfg.augment {
                augment(&mut mb.images, &mut aug);
            }
            ddp.begin_pass(a + 1 == cfg.accum);
            let fwd = model.forward(&mb.images, micro, cfg.precision)?;
            let loss = model.loss(&fwd, &mb.labels)?;
            let lv = loss.to_scalar::<f32>()? as f64;
            interval.loss += lv;
            step_loss += lv / cfg.accum as f64;
            interval.passes += 1;
            interval.correct += LeNet::correct(&fwd, &mb.labels)?;
            interval.images += micro;
            let scaled = (loss * (scale as f64 / cfg.accum as f64))?;
            if cfg.overlap {
                model.backward(&fwd, &scaled, |j, g| ddp.grad_ready(j, g))?;
            } else {
                let mut held: Vec<(usize, Vec<f32>)> = Vec::new();
                model.backward(&fwd, &scaled, |j, g| {
                    held.push((j, g.to_vec()));
                    Ok(())
                })?;
                for (j, g) in held {
                    ddp.grad_ready(j, &g)?;
                }
            }
            ddp.end_pass()?;
        }
        Straggler::delay(cfg.straggler, rank, t_step.elapsed());
        // The averaged gradients are the same on every rank, so every rank decides alike.
        let lr = state.lr.at(state.step);
        let report = if cfg.precision == Precision::F32 {
            ddp.step(lr).map_err(|e| match e {
                Error::Train(TrainError::Diverged { why, .. }) => {
                    Error::Train(TrainError::Diverged {
                        step: state.step,
                        why: format!(
                            "{why} (loss of this step {step_loss:.4e}); lower --lr (peak {:.4}) \
                         or lengthen --warmup",
                            state.lr.peak()
                        ),
                    })
                }
                e => e,
            })?
        } else {
            ddp.step_scaled(lr, &mut state.scaler)?
        };
        let exposed = report.exposed;
        interval.buckets = interval.buckets.max(report.buckets);
        let dt = t_step.elapsed();
        interval.compute += dt.saturating_sub(exposed);
        interval.exposed += exposed;
        interval.steps += 1;
        interval.wall += dt;
        last_step_loss = step_loss;
        state.step += 1;
        state.epoch = state.step / steps_per_epoch;
        state.batch_in_epoch = state.step % steps_per_epoch;
        state.rng_key = state.step;
        curve.at(t_run.elapsed().as_secs_f64(), || {
            ddp.weights().into_iter().flat_map(|(_, w)| w).collect()
        });
        if let Some(limit) = cfg.time_limit {
            // Rank 0's clock decides, so that every rank stops after the same step.
            let mut over = [u8::from(t_run.elapsed() >= limit)];
            comm.broadcast(&mut over, 0)?;
            if over[0] == 1 {
                stop = state.step;
            }
        }
        if let Some(b) = &bar {
            b.set_position(state.step);
            b.set_message(format!(
                "loss {:.4}",
                interval.loss / interval.passes.max(1) as f64
            ));
        }

        let end = state.step == stop;
        if state.step.is_multiple_of(cfg.log_every.max(1)) || end {
            let rec = interval.record(rank, world, &state, lr);
            last_loss = log(comm, &rec, metrics.as_mut())?.loss;
            last_window = interval.steps;
            totals.absorb(&interval);
            interval = Interval::default();
        }
        let mut saved = None;
        if cfg.checkpoint_every > 0 && state.step.is_multiple_of(cfg.checkpoint_every) || end {
            if let Some(d) = &ckdir {
                saved = Some(d.save(state.step, &snapshot(&mut ddp, &state)?)?);
            }
        }
        // Asked to stop (SIGTERM on any rank): every rank learns it after the same step;
        // rank 0 writes that step's checkpoint, and the run ends as Preempted.
        if let Some(p) = &cfg.preemption {
            if !end && p.agreed(comm)? {
                if saved.is_none() {
                    if let Some(d) = &ckdir {
                        saved = Some(d.save(state.step, &snapshot(&mut ddp, &state)?)?);
                    }
                }
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                return Err(TrainError::Preempted {
                    step: state.step,
                    checkpoint: saved,
                }
                .into());
            }
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    totals.absorb(&interval);
    let wall = t_run.elapsed();
    check_same_steps(comm, state.step)?;
    let accuracy = evaluate(comm, &model, &test_set)?;
    let curve = curve.evaluate(comm, &model, &test_set, (wall.as_secs_f64(), accuracy))?;
    let steps_run = state.step - start_step;
    let mut job = [
        totals.images as f64 / wall.as_secs_f64().max(1e-9),
        totals.compute.as_secs_f64() / steps_run.max(1) as f64,
        totals.exposed.as_secs_f64() / steps_run.max(1) as f64,
        last_step_loss,
    ];
    comm.all_reduce(&mut job, ReduceOp::Sum)?;
    let summary = Summary {
        world,
        steps: state.step,
        steps_run,
        global_batch: cfg.global_batch,
        final_loss: last_loss,
        step_loss: job[3] / world as f64,
        final_loss_steps: last_window,
        test_accuracy: accuracy,
        images_per_s: job[0],
        compute_s: job[1] / world as f64,
        comm_exposed_s: job[2] / world as f64,
        buckets: ddp.bucket_plan().buckets.len(),
        skipped_steps: state.scaler.skipped,
        wall_s: wall.as_secs_f64(),
        curve,
    };
    if let Some(m) = metrics.as_mut() {
        let _ = m.flush();
    }
    Ok(Outcome {
        summary,
        params: ddp.weights(),
    })
}

#[derive(Default)]
struct Interval {
    loss: f64,
    passes: usize,
    correct: usize,
    images: usize,
    steps: u64,
    buckets: usize,
    compute: Duration,
    exposed: Duration,
    wall: Duration,
}

impl Interval {
    fn record(&self, rank: usize, world: usize, s: &State, lr: f64) -> Record {
        let steps = self.steps.max(1) as f64;
        Record {
            kind: "rank".into(),
            rank,
            world,
            step: s.step,
            epoch: (s.step - 1) / s.steps_per_epoch,
            loss: self.loss / self.passes.max(1) as f64,
            accuracy: self.correct as f64 / self.images.max(1) as f64,
            images_per_s: self.images as f64 / self.wall.as_secs_f64().max(1e-9),
            lr,
            loss_scale: s.scaler.scale as f64,
            comm_exposed_s: self.exposed.as_secs_f64() / steps,
            compute_s: self.compute.as_secs_f64() / steps,
        }
    }

    fn absorb(&mut self, o: &Interval) {
        self.images += o.images;
        self.steps += o.steps;
        self.compute += o.compute;
        self.exposed += o.exposed;
    }
}

/// Gathers every rank's record to rank 0, which writes them and their mean.
fn log(comm: &Communicator, rec: &Record, out: Option<&mut impl Write>) -> Result<Record> {
    let mine = [
        rec.loss,
        rec.accuracy,
        rec.images_per_s,
        rec.comm_exposed_s,
        rec.compute_s,
    ];
    let mut all = vec![0.0f64; 5 * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    let mean = rec.reduce(comm)?;
    if let Some(w) = out {
        let io = |e| Error::io("writing metrics", e);
        for (r, v) in all.chunks_exact(5).enumerate() {
            Record {
                rank: r,
                loss: v[0],
                accuracy: v[1],
                images_per_s: v[2],
                comm_exposed_s: v[3],
                compute_s: v[4],
                ..rec.clone()
            }
            .write(w)
            .map_err(io)?;
        }
        mean.write(w).map_err(io)?;
        w.flush().map_err(io)?;
    }
    Ok(mean)
}

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

fn snapshot(ddp: &mut Ddp<'_, Sgd>, state: &State) -> Result<Checkpoint> {
    let state = serde_json::to_value(state)
        .map_err(|e| Error::invalid(format!("checkpoint state: {e}")))?;
    Ok(ddp.snapshot(state))
}

/// On rank 0: loads the checkpoint `cfg.resume` asks for and checks that it is one of
/// this run's shape (the tensors are checked by [`Ddp::restore`]); `None` when there
/// is nothing to resume.
fn load_on_rank0(
    cfg: &TrainConfig,
    dir: Option<&CheckpointDir>,
    fresh: &State,
) -> TrainResult<Option<(PathBuf, Checkpoint)>> {
    let (path, ck) = match &cfg.resume {
        None => return Ok(None),
        Some(Resume::File(p)) => (p.clone(), checkpoint::load(p)?),
        Some(Resume::Latest) => {
            let Some(d) = dir else {
                return Err(ferroccl::Error::InvalidArgument(
                    "--resume without a file needs a checkpoint directory".into(),
                )
                .into());
            };
            match d.load_latest()? {
                Some(x) => x,
                None => return Ok(None),
            }
        }
    };
    let bad = |why: String| TrainError::checkpoint(&path, why);
    let s: State = serde_json::from_value(ck.state.clone())
        .map_err(|e| bad(format!("state is not a trainer state: {e}")))?;
    if s.world != fresh.world || s.global_batch != fresh.global_batch || s.width != fresh.width {
        return Err(bad(format!(
            "written by a run of {} ranks, global batch {}, width {}; this run has {}, {}, {} \
             (resume with the same shape)",
            s.world, s.global_batch, s.width, fresh.world, fresh.global_batch, fresh.width
        )));
    }
    if s.steps_per_epoch != fresh.steps_per_epoch || s.seed != fresh.seed {
        return Err(bad(format!(
            "written for other data or seed ({} steps per epoch, seed {}; this run: {}, {})",
            s.steps_per_epoch, s.seed, fresh.steps_per_epoch, fresh.seed
        )));
    }
    Ok(Some((path, ck)))
}
