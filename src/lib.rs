//! ferroccl: collective communication for data-parallel training, in Rust.
#![deny(missing_docs)]

pub mod error;
pub mod reduce;
pub mod rendezvous;
pub mod schedule;
pub mod transport;

pub use error::{Error, Result};
pub use reduce::{DataType, Element, ReduceOp};
