//! ferroccl: collective communication for data-parallel training, in Rust.
//!
//! A [`Communicator`] is one rank's handle on a group of ranks. Its collectives —
//! [`all_reduce`](Communicator::all_reduce), [`reduce_scatter`](Communicator::reduce_scatter),
//! [`all_gather`](Communicator::all_gather), [`broadcast`](Communicator::broadcast),
//! [`reduce`](Communicator::reduce), [`barrier`](Communicator::barrier),
//! [`all_to_all`](Communicator::all_to_all), [`gather`](Communicator::gather),
//! [`scatter`](Communicator::scatter) and tagged
//! [`send`](Communicator::send)/[`recv`](Communicator::recv) — give every rank the same,
//! bitwise identical result, for `f32 f64 f16 bf16 i32 i64 u8` ([`Element`]) and
//! `Sum Prod Min Max Avg` ([`ReduceOp`]). The pages below follow a user's path.
//!
//! # 1. Threads of one process
//!
//! [`Communicator::local_group`] links `n` ranks as threads, over in-process pipes: the
//! quickest way to try the library, and how its tests run.
//!
//! ```
//! use ferroccl::{Communicator, Config, ReduceOp};
//!
//! let comms = Communicator::local_group(4, &Config::default())?;
//! std::thread::scope(|t| {
//!     for comm in comms {
//!         t.spawn(move || -> ferroccl::Result<()> {
//!             let r = comm.rank() as f32;
//!             // Every rank ends with the same, bitwise identical, sum.
//!             let mut grads = vec![r; 1000];
//!             comm.all_reduce(&mut grads, ReduceOp::Sum)?;
//!             assert_eq!(grads[0], 0.0 + 1.0 + 2.0 + 3.0);
//!             // Rank 2's buffer reaches everyone.
//!             let mut weights = vec![r; 8];
//!             comm.broadcast(&mut weights, 2)?;
//!             assert_eq!(weights, vec![2.0; 8]);
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # 2. Processes under a launcher
//!
//! One process per rank, started by the launcher you already use — `torchrun`, Slurm's
//! `srun`, Open MPI's `mpirun`, or `ferroccl launch -n N -- CMD` on one machine. Rank,
//! world size and the rendezvous address come from its environment ([`Config::from_env`];
//! [`rendezvous::detect_env`] lists the variables); rank 0 serves a small store at
//! `MASTER_ADDR:MASTER_PORT` through which the ranks find each other, and TCP links them
//! ([`TransportKind`] names the other transports).
//!
//! ```no_run
//! let comm = ferroccl::Communicator::from_env()?;
//! let mut grads = vec![comm.rank() as f32; 1 << 20];
//! comm.all_reduce(&mut grads, ferroccl::ReduceOp::Avg)?;
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! Embedders that do not want environment variables build the [`Config`] themselves
//! ([`Config::builder`]) and call [`Communicator::init`]. Failures are values of one
//! [`Error`] enum naming the rank, the operation and its sequence number: a mismatched
//! call across ranks, a dead or silent peer (a timeout says where every other rank is),
//! a port in use, an unreachable store. A failed collective poisons the communicator,
//! so every rank fails fast instead of hanging; [`AbortHandle`] unblocks one from any
//! thread.
//!
//! # 3. Non-blocking operations
//!
//! In a [`Scope`](Communicator::scope), collectives start at once and progress on a
//! background thread in issue order; each [`Handle`] is waited for when its buffer is
//! needed, and the scope waits for all of them. For a buffer that must stay in flight
//! across code that cannot sit inside a scope, [`Communicator::all_reduce_start`] takes
//! it by value and gives it back from [`Pending::wait`].
//!
//! ```
//! use ferroccl::{Communicator, Config, ReduceOp};
//! let comms = Communicator::local_group(2, &Config::default())?;
//! std::thread::scope(|t| for comm in comms {
//!     t.spawn(move || {
//!         let (mut a, mut b) = (vec![1i64; 100], vec![comm.rank() as f64; 10]);
//!         comm.scope(|s| {
//!             let ha = s.all_reduce(&mut a, ReduceOp::Sum).unwrap();
//!             let hb = s.all_reduce(&mut b, ReduceOp::Max).unwrap();
//!             // ... compute while both run ...
//!             assert_eq!(ha.wait().unwrap()[0], 2);
//!             assert_eq!(hb.wait().unwrap()[0], 1.0);
//!         });
//!     });
//! });
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # 4. Data-parallel training
//!
//! [`ddp`] is the framework-free machinery of DDP: a [`ddp::GradReducer`] packs
//! gradients into buckets (reverse order, 25 MiB, first 1 MiB, as PyTorch) and
//! all-reduces each in the background the moment its last gradient arrives, so
//! communication overlaps the rest of backward; plus a sharded sampler, LR scaling with
//! warmup, dynamic loss scaling and checkpoints. Any framework drives it the same way:
//! hand each gradient over as backward produces it, wait before the optimizer step.
//! (`ferroccl-candle` drives it for candle models.)
//!
//! ```
//! use ferroccl::ddp::{GradReducer, WireDtype};
//! use ferroccl::{Communicator, Config};
//! let comms = Communicator::local_group(2, &Config::default())?;
//! std::thread::scope(|t| {
//!     let ranks: Vec<_> = comms.into_iter().map(|comm| t.spawn(move || -> ferroccl::Result<()> {
//!         let params = [300, 10]; // two parameters' element counts, in forward order
//!         let mut red = GradReducer::new(&comm, &params, 1 << 20, 25 << 20, WireDtype::F32);
//!         red.begin_pass(true);
//!         red.grad_ready(1, &[comm.rank() as f32; 10])?; // backward: last layer first
//!         red.grad_ready(0, &[1.0; 300])?;
//!         red.finish_pass()?;
//!         assert_eq!(red.grad(1)[0], 0.5); // the average over ranks
//!         Ok(())
//!     })).collect();
//!     ranks.into_iter().try_for_each(|h| h.join().expect("a rank panicked"))
//! })?;
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # 5. Groups and point-to-point
//!
//! Beyond data parallelism a job splits: [`Communicator::split`] (as
//! `MPI_Comm_split`), [`Communicator::group`] (as `torch.distributed.new_group`) and
//! [`Communicator::split_by_host`] make child communicators, collective over the
//! parent, each with every collective, links of its own and errors that name job
//! ranks; a failure in one leaves the parent and its siblings working.
//! [`Communicator::all_to_all`] (and `all_to_allv`) routes blocks between all ranks
//! (expert parallelism); [`Communicator::p2p_batch`] posts sends and receives to any
//! peers that progress together (pipeline stages), on a thread of their own so that
//! they move while collectives run.
//!
//! ```
//! use ferroccl::{Communicator, Config, ReduceOp};
//!
//! fn rank_main(comm: Communicator) -> ferroccl::Result<()> {
//!     let r = comm.rank();
//!     // Ranks {0, 1} and {2, 3}: each pair averages its own gradients.
//!     let pair = comm.split(Some(r as u32 / 2), 0)?.expect("every rank has a pair");
//!     let mut g = vec![r as f32; 16];
//!     pair.all_reduce(&mut g, ReduceOp::Avg)?;
//!     assert_eq!(g[0], if r < 2 { 0.5 } else { 2.5 });
//!     // Stage r hands its activations to stage r + 1 and takes stage r - 1's.
//!     let (act, mut prev) = (vec![r as f32; 64], vec![0f32; 64]);
//!     comm.p2p_batch(|b| {
//!         if r + 1 < comm.world_size() {
//!             b.send(&act, r + 1, 0);
//!         }
//!         if r > 0 {
//!             b.recv(&mut prev, r - 1, 0);
//!         }
//!     })?;
//!     assert!(r == 0 || prev[0] == (r - 1) as f32);
//!     Ok(())
//! }
//!
//! let comms = Communicator::local_group(4, &Config::default())?;
//! std::thread::scope(|t| for comm in comms {
//!     t.spawn(move || rank_main(comm).unwrap());
//! });
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # 6. Writing a transport
//!
//! Algorithms never see a socket: they are plans of frames that the engine moves over
//! [`transport::Link`]s — non-blocking byte streams to one peer each. A transport is a
//! [`transport::Transport`] whose `connect` returns this rank's
//! [`transport::Links`] (a connector that makes links on demand, a waiter that sleeps
//! until one may move, a beacon peers can ask), and
//! [`Communicator::init_with`] runs the same rendezvous over it. The
//! `custom_transport` example is a complete one over Unix-domain sockets; the
//! [`transport`] module spells out the contract. A transport whose peers can read each
//! other's memory (CUDA IPC) also offers [`transport::MemPeers`], and the engine then
//! reads the senders' memory instead of moving bytes. A connector that also makes the
//! links of a group of its ranks ([`transport::Connector::group`]) lets its
//! communicators be split and run point-to-point on a thread of their own; one that
//! keeps the default refuses `split` with [`Error::Unavailable`] and runs
//! point-to-point in turn with the collectives.
//!
//! # 7. When something goes wrong
//!
//! A failed call returns an [`Error`] naming this rank, the operation and the cause;
//! the communicator is then poisoned and tells its peers why before it shuts its
//! links, so every survivor names the rank where the failure started
//! ([`Error::PeerFailed`]), not the neighbour that closed on it. Ranks that disagree
//! on a call (count, dtype, op, root, kind) fail with [`Error::Mismatch`] naming both
//! calls; a hang becomes an [`Error::Timeout`] saying where every other rank is.
//! Each communicator also keeps a flight recorder of its last operations
//! ([`trace`]): set `FERROCCL_TRACE_DIR` and every rank writes it there on a failure,
//! on `SIGUSR1` and at exit, and `ferroccl trace DIR` merges the ranks into a
//! Perfetto timeline with a straggler report.
//!
//! # Features
//!
//! Default: TCP and in-process links, no framework or CLI dependencies. `rdma`: RDMA
//! verbs links. `cuda`: device kernels, device buffers in every collective
//! (`all_reduce_device`, …), and the CUDA-IPC transport; it builds without a GPU and
//! says [`Error::Unavailable`] where one is needed. Element types name [`half`]'s
//! `f16` and `bf16`, re-exported here.
#![deny(missing_docs)]

pub(crate) mod algo;
mod comm;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ddp;
mod dtype;
mod engine;
pub mod error;
pub mod order;
pub mod reduce;
pub mod rendezvous;
mod sync;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod trace;
pub mod transport;
pub(crate) mod wire;

pub use algo::{sim, Algorithm, HostLayout};
pub use comm::{AbortHandle, Batch, Communicator, Handle, Pending, Scope};
pub use config::{
    AllReduceAlgo, Clock, Config, ConfigBuilder, CostModel, CostModelSpec, TcpCongestion,
    TransportKind,
};
pub use error::{Error, ErrorClass, Result};
pub use half;
pub use reduce::{DataType, Element, ReduceOp};
pub use wire::WireStats;
