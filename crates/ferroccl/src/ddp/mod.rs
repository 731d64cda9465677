//! Data-parallel training machinery, independent of any model framework.
//!
//! * [`sampler::DistributedSampler`]: each rank's unique, equal share of the data.
//! * [`buckets::GradReducer`]: gradients packed into buckets (reverse order, 25 MiB,
//!   first 1 MiB), each all-reduced in the background as soon as its last gradient
//!   arrives; gradient accumulation without communication; f16/bf16 on the wire.
//! * [`lr::LrSchedule`]: linear scaling with the global batch, warmup, decay.
//! * [`scaler::LossScaler`]: dynamic loss scaling for mixed precision.
//! * [`checkpoint`]: atomic, checksummed checkpoints written by one rank.
//! * [`rng::Rng`]: the seedable, serialisable generator everything random draws from.
//! * [`metrics`]: JSON-lines records and the equal-steps check.
//! * [`preempt::Preemption`]: SIGTERM turned into a collective "stop after this step",
//!   and the exit status (75) that `ferroccl launch --max-restarts` restarts on.
//! * [`TrainError`]: how a training run fails (diverged, preempted, a checkpoint it
//!   cannot use, or the communication's [`crate::Error`] as it was).
//!
//! The model side lives in the `ferroccl-candle` package, which drives these with
//! a candle CNN; another framework would drive them the same way: after each backward
//! segment hand the gradients to the reducer, before the optimizer step wait for it.

pub mod buckets;
pub mod checkpoint;
pub mod error;
pub mod lr;
pub mod metrics;
pub mod preempt;
pub mod rng;
pub mod sampler;
pub mod scaler;

pub use buckets::{BucketPlan, GradReducer, WireDtype};
pub use checkpoint::{Checkpoint, CheckpointDir};
pub use error::{TrainError, TrainResult};
pub use lr::{Decay, LrSchedule};
pub use preempt::{Preemption, PREEMPTED_EXIT_CODE};
pub use rng::Rng;
pub use sampler::DistributedSampler;
pub use scaler::LossScaler;
