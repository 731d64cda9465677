//! ferroccl for candle: [`ddp::Ddp`], data-parallel training for any candle model
//! (PyTorch's `DistributedDataParallel(model)` in a few lines), and the trainers
//! behind `ferroccl train` (feature `candle`) in [`trainer`]: a small CNN
//! ([`model::LeNet`]) trained on it — sharded sampling, bucketed all-reduce overlapped
//! with a segmented backward, LR scaling with warmup, mixed precision with dynamic
//! loss scaling, gradient accumulation, rank-0 checkpoints and exact resume.
//!
//! Next to it, [`ps`]: a sharded parameter server with bounded staleness (SSP), the
//! asynchronous alternative (`ferroccl train --mode ssp`); and for models that do not
//! fit, [`pipeline`] stages, [`zero`] (ZeRO-1) and [`tensor_parallel`] layers.
//!
//! Every rank calls [`train`] with the same [`TrainConfig`]; rank 0's initial weights
//! are broadcast so replicas start identical, and every optimizer step applies the
//! same averaged gradients on every rank, so they stay identical. Every function
//! returns this crate's [`Error`]: candle's, ferroccl's and a training run's errors
//! alike, so that `?` works on all three.
//!
//! The modules, bottom up (each uses only those before it; `tests/suite/layers.rs` of
//! the `ferroccl` package checks it): [`error`]; [`data`], [`model`], [`ddp`];
//! [`tensor_parallel`]; [`zero`]; [`pipeline`]; [`ps`]; [`trainer`].

pub mod data;
pub mod ddp;
pub mod error;
pub mod model;
pub mod pipeline;
pub mod ps;
pub mod tensor_parallel;
pub mod trainer;
pub mod zero;

/// candle, as this crate builds on it: a user's model needs no version of its own.
pub use candle_core;
/// candle's layers, losses and `VarMap`, as this crate builds on them.
pub use candle_nn;
/// The communication library, as this crate builds on it.
pub use ferroccl;

pub use error::{Error, Result};
pub use trainer::{load_data, train, DataSource, Outcome, Resume, Straggler, Summary};
pub use trainer::{TrainConfig, Trainer};
