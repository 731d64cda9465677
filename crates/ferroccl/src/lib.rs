//! ferroccl: collective communication for data-parallel training, in Rust.
//!
//! A [`Communicator`] is one rank's handle on a group of ranks. Its collectives —
//! [`all_reduce`](Communicator::all_reduce), [`reduce_scatter`](Communicator::reduce_scatter),
//! [`all_gather`](Communicator::all_gather), [`broadcast`](Communicator::broadcast),
//! [`reduce`](Communicator::reduce), [`barrier`](Communicator::barrier) and tagged
//! [`send`](Communicator::send)/[`recv`](Communicator::recv) — run over TCP between
//! processes (ranks found through the launcher's environment, see [`rendezvous`]) or
//! over in-process pipes between threads. Non-blocking forms live in a
//! [`Scope`](Communicator::scope).
//!
//! ```
//! use ferroccl::{Communicator, Config, ReduceOp};
//!
//! // Four ranks as threads of this process; under a launcher each process would call
//! // `Communicator::from_env()` instead.
//! let comms = Communicator::local_group(4, &Config::default()).unwrap();
//! std::thread::scope(|t| {
//!     for comm in comms {
//!         t.spawn(move || -> ferroccl::Result<()> {
//!             let r = comm.rank() as f32;
//!             // Every rank ends with the same, bitwise identical, sum.
//!             let mut grads = vec![r; 1000];
//!             comm.all_reduce(&mut grads, ReduceOp::Sum)?;
//!             assert_eq!(grads[0], 0.0 + 1.0 + 2.0 + 3.0);
//!
//!             // Rank 2's buffer reaches everyone.
//!             let mut weights = vec![r; 8];
//!             comm.broadcast(&mut weights, 2)?;
//!             assert_eq!(weights, vec![2.0; 8]);
//!
//!             // Two all-reduces in flight while this thread does other work.
//!             let (mut a, mut b) = (vec![1i64; 100], vec![r as f64; 10]);
//!             comm.scope(|s| -> ferroccl::Result<()> {
//!                 let ha = s.all_reduce(&mut a, ReduceOp::Sum)?;
//!                 let hb = s.all_reduce(&mut b, ReduceOp::Max)?;
//!                 assert_eq!(ha.wait()?[0], 4);
//!                 assert_eq!(hb.wait()?[0], 3.0);
//!                 Ok(())
//!             })
//!         });
//!     }
//! });
//! ```
//!
//! Failures are values of one [`Error`] enum that name the rank, the operation and its
//! sequence number; see [`Communicator`] for how a failure poisons a communicator.
#![deny(missing_docs)]

pub(crate) mod algo;
mod comm;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ddp;
mod engine;
pub mod error;
pub mod reduce;
pub mod rendezvous;
mod sync;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod transport;
pub(crate) mod wire;

pub use algo::Algorithm;
pub use comm::{AbortHandle, Communicator, Handle, Pending, Scope};
pub use config::{Clock, Config, ConfigBuilder, TransportKind};
pub use error::{Error, Result};
pub use half;
pub use reduce::{DataType, Element, ReduceOp};
pub use wire::WireStats;
