//! ferroccl: collective communication for data-parallel training, in Rust.
#![deny(missing_docs)]

mod broadcast;
pub mod comm;
mod doubling;
mod engine;
pub mod error;
pub mod plan;
pub mod reduce;
pub mod rendezvous;
mod ring;
pub mod schedule;
pub mod transport;
pub mod wire;

pub use comm::{Communicator, Config, Handle, Scope};
pub use error::{Error, Result};
pub use reduce::{DataType, Element, ReduceOp};
pub use wire::{Algorithm, WireStats};
