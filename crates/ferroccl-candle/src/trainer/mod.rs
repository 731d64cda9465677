//! The trainers behind `ferroccl train`, on one config ([`TrainConfig`], the same on
//! every rank):
//!
//! - [`run`]: LeNet on [`crate::ddp::Ddp`], data-parallel ([`train`], one [`Run`]
//!   per rank, its phases `step` / `should_stop` / `record` / `checkpoint`);
//! - [`ps`]: LeNet over the parameter server, with bounded staleness (`--mode ssp`);
//! - [`pipeline`]: the MLP of [`mlp`] on a P × T × D layout (`--pipeline`,
//!   `--tensor-parallel`, `--zero`, `--mlp`).
//!
//! What they share: [`config`] (the config, which trainer reads which field, the data,
//! the LR schedule, rank 0's checkpoint directory and what to resume from), `batches`
//! (a rank's micro-batches in the sampler's order, augmented), `eval` (the test
//! accuracy and its curve over time) and `record` (metrics and progress).
//!
//! This module is the crate's top floor: it uses the others, none uses it.

mod batches;
pub mod config;
mod eval;
pub mod mlp;
pub mod pipeline;
pub mod ps;
mod record;
pub mod run;

pub use config::{load_data, DataSource, Resume, Straggler, TrainConfig, Trainer};
pub use run::{train, Outcome, Run, Stop, Summary};
