//! What a run is: [`TrainConfig`], the same on every rank, read by all three
//! trainers; which of its fields each trainer reads ([`Trainer::refuses`]); and what
//! they derive from it alike (the data, the LR schedule, rank 0's checkpoint
//! directory and the checkpoint to resume from).

use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::model::{Precision, TrainDevice};
use ferroccl::ddp::buckets::{DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
use ferroccl::ddp::checkpoint::{self, Checkpoint, CheckpointDir};
use ferroccl::ddp::{Decay, LrSchedule, TrainResult, WireDtype};
use std::path::PathBuf;
use std::time::Duration;

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
    /// [`ferroccl::ddp::TrainError::Preempted`].
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
    /// the test accuracy of each in the summary's `curve` (evaluated after the run).
    pub curve_every: Option<Duration>,
    /// Where every rank computes (its GPU: local rank modulo the host's GPUs).
    pub device: TrainDevice,
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
            device: TrainDevice::Cpu,
        }
    }
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

/// Which trainer a [`TrainConfig`] is for: each reads its own part of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trainer {
    /// Data-parallel LeNet over `Ddp` ([`super::train`]): reads every field.
    Ddp,
    /// LeNet over the parameter server ([`super::ps::train_ps`], `--mode ssp`).
    ParameterServer,
    /// The MLP on a P × T × D layout ([`super::pipeline::train_mesh`]).
    Pipeline,
}

/// A field of [`TrainConfig`] that not every trainer reads, by its `ferroccl train`
/// flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// `accum` above 1.
    Accum,
    /// `precision` other than f32.
    Precision,
    /// `checkpoint_every` above 0.
    CheckpointEvery,
    /// `metrics` set.
    Metrics,
}

impl Field {
    /// The flag that sets it.
    pub fn flag(self) -> &'static str {
        match self {
            Field::Accum => "--accum",
            Field::Precision => "--precision",
            Field::CheckpointEvery => "--checkpoint-every",
            Field::Metrics => "--metrics",
        }
    }

    /// Whether `cfg` asks for it: a trainer that does not read it would ignore it.
    pub fn is_set(self, cfg: &TrainConfig) -> bool {
        match self {
            Field::Accum => cfg.accum != 1,
            Field::Precision => cfg.precision != Precision::F32,
            Field::CheckpointEvery => cfg.checkpoint_every > 0,
            Field::Metrics => cfg.metrics.is_some(),
        }
    }
}

impl Trainer {
    /// The fields this trainer does not read, refused when set rather than ignored.
    /// The parameter server trains in f32 without accumulation, checkpoints at the end
    /// of the run and writes its summary, not metrics. The pipeline trainer reads the
    /// data, batch, LR, momentum, weight decay, seed and stopping fields and has always
    /// run with the others at any value: it refuses nothing.
    pub fn refuses(self) -> &'static [Field] {
        match self {
            Trainer::Ddp | Trainer::Pipeline => &[],
            Trainer::ParameterServer => &[
                Field::Accum,
                Field::Precision,
                Field::CheckpointEvery,
                Field::Metrics,
            ],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Trainer::Ddp => "the data-parallel trainer",
            Trainer::ParameterServer => "the parameter server (--mode ssp)",
            Trainer::Pipeline => "the pipeline trainer",
        }
    }

    /// Why it does not read what it refuses.
    fn reason(self) -> &'static str {
        match self {
            Trainer::ParameterServer => {
                "it trains in f32 without gradient accumulation, checkpoints at the end of \
                 the run only and writes no metrics (its summary: --summary)"
            }
            Trainer::Ddp | Trainer::Pipeline => "leave them at their defaults",
        }
    }
}

impl TrainConfig {
    /// Refuses the fields `trainer` does not read ([`Trainer::refuses`]) when they are
    /// set; pure, so that a launcher can refuse a run before any rank starts.
    pub fn refuse_unread(&self, trainer: Trainer) -> Result<()> {
        let set: Vec<&str> = trainer
            .refuses()
            .iter()
            .filter(|f| f.is_set(self))
            .map(|f| f.flag())
            .collect();
        if set.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "{} does not read {}: {}",
            trainer.name(),
            set.join(", "),
            trainer.reason()
        )))
    }

    /// The LeNet trainers' checks against a job of `world` ranks: the fields `trainer`
    /// does not read, a global batch of whole micro-batches on every rank, a precision
    /// the device computes in (no bf16 on the CPU), the straggler.
    pub fn check_lenet(&self, trainer: Trainer, world: usize) -> Result<()> {
        self.refuse_unread(trainer)?;
        if self.accum == 0
            || self.global_batch == 0
            || !self.global_batch.is_multiple_of(world * self.accum)
        {
            return Err(Error::invalid(format!(
                "global batch {} must be a positive multiple of ranks × accumulation steps \
                 ({world} × {})",
                self.global_batch, self.accum
            )));
        }
        if self.precision == Precision::Bf16 && self.device == TrainDevice::Cpu {
            return Err(ferroccl::Error::Unavailable {
                what: "bf16 compute".into(),
                why: "candle's CPU backend has no bf16 matmul; train in f16 or f32, and use \
                      bf16 for the gradients on the wire (--wire bf16) if you want"
                    .into(),
            }
            .into());
        }
        Straggler::check(self.straggler, world)
    }

    /// The LR schedule of a run of `total_steps`: `base_lr` scaled linearly to the
    /// global batch, warmup, decay.
    pub fn lr_schedule(&self, total_steps: u64) -> LrSchedule {
        LrSchedule {
            base_lr: self.base_lr,
            base_batch: self.base_batch,
            global_batch: self.global_batch,
            warmup_steps: self.warmup_steps,
            total_steps,
            decay: self.decay,
        }
    }

    /// Rank 0's checkpoint directory, created (`None` on the other ranks and without
    /// one).
    pub fn checkpoint_dir_on(&self, rank: usize) -> Result<Option<CheckpointDir>> {
        match &self.checkpoint_dir {
            Some(d) if rank == 0 => Ok(Some(CheckpointDir::new(d, self.keep)?)),
            _ => Ok(None),
        }
    }

    /// On rank 0: the checkpoint [`TrainConfig::resume`] asks for, from `dir` (rank 0's
    /// checkpoint directory) for the newest; `None` when there is nothing to resume.
    pub fn resume_from(
        &self,
        dir: Option<&CheckpointDir>,
    ) -> TrainResult<Option<(PathBuf, Checkpoint)>> {
        match &self.resume {
            None => Ok(None),
            Some(Resume::File(p)) => Ok(Some((p.clone(), checkpoint::load(p)?))),
            Some(Resume::Latest) => match dir {
                Some(d) => d.load_latest(),
                None => Err(ferroccl::Error::InvalidArgument(
                    "--resume without a file needs a checkpoint directory".into(),
                )
                .into()),
            },
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trainer_refuses_the_fields_it_does_not_read_and_only_those() {
        let ps = TrainConfig {
            accum: 2,
            metrics: Some("m.jsonl".into()),
            ..TrainConfig::default()
        };
        let e = ps
            .refuse_unread(Trainer::ParameterServer)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--mode ssp") && e.contains("--accum, --metrics"),
            "{e}"
        );
        assert!(!e.contains("--precision"), "{e}");
        for t in [Trainer::Ddp, Trainer::Pipeline] {
            assert!(ps.refuse_unread(t).is_ok(), "{t:?}");
        }
        assert!(TrainConfig::default()
            .refuse_unread(Trainer::ParameterServer)
            .is_ok());
        // Every field a trainer refuses is one a default config leaves unset.
        for t in [Trainer::Ddp, Trainer::ParameterServer, Trainer::Pipeline] {
            for f in t.refuses() {
                assert!(!f.is_set(&TrainConfig::default()), "{f:?}");
            }
        }
    }
}
