//! Tensor parallelism (Megatron-LM's, PyTorch's `ColwiseParallel`/`RowwiseParallel`):
//! single layers split across the ranks of a tensor-parallel group.
//!
//! - [`ColumnParallelLinear`] holds a slice of the output dimension (the weight's
//!   rows); its input is whole on every rank, its output split (or all-gathered).
//! - [`RowParallelLinear`] holds a slice of the input dimension (the weight's
//!   columns); each rank computes a partial sum of the whole output, all-reduced.
//! - [`TpMlp`] is the two back to back (column, activation, row): one all-reduce
//!   forward, one backward, and nothing between. [`TpSelfAttention`] splits the heads:
//!   the fused Q, K, V projection column-parallel (each rank its heads' rows of each),
//!   attention per head on its own rank, the output projection row-parallel.
//! - The collectives at the boundaries are the [`ops::Conjugate`] operators, written
//!   once: f (identity forward, all-reduce backward) and g (all-reduce forward,
//!   identity backward), gather and scatter.
//!
//! ```text
//!          x (whole on every rank)
//!          │ f: forward identity, backward all-reduce
//!   ┌──────┴──────┐
//!   x·A₀ᵀ       x·A₁ᵀ        column-parallel A = [A₀; A₁]   (rank 0 | rank 1)
//!   act         act
//!   ·B₀ᵀ        ·B₁ᵀ         row-parallel B = [B₀ B₁]
//!   └──────┬──────┘
//!          │ g: forward all-reduce, backward identity
//!          y = act(x·Aᵀ)·Bᵀ + b  (whole on every rank)
//! ```
//!
//! Every weight is cut from the whole layer every rank builds from the same seed, so
//! the ranks together hold exactly the one-process model ([`gather_whole`] puts it
//! back). Replicated parameters (a row-parallel layer's bias) get the same gradient
//! on every rank of the group (it is computed from whole tensors), so they stay equal
//! without a collective.
//!
//! **Layouts**: [`layout::Mesh`] is P × T × D (pipeline × tensor × data), rank
//! r = t + T × (s + P × d); `crate::pipeline::Layout::mesh` cuts a job into the three
//! groups with `Communicator::split`, and a pipeline stage can hold tensor-parallel
//! layers (`Pipeline::with_tensor_group`).
//!
//! **Checked on every rank**: each layer's construction gathers what every rank of the
//! group declared (the whole layer's sizes and cut, [`layout::Declared`]) and every
//! rank reaches the same verdict from them ([`layout::agree_declared`]): shards that
//! disagree are [`ferroccl::Error::Mismatch`], a size T does not divide
//! [`ferroccl::Error::InvalidArgument`] — before any weight or activation moves.
//!
//! **Counted**: [`cost`] is the per-block communication formula, which the tests hold
//! to the bytes the links counted.

pub mod cost;
pub mod layers;
pub mod layout;
pub mod ops;

pub use crate::error::failure;
pub use layers::{gather_whole, ColumnParallelLinear, RowParallelLinear, Shard, Split};
pub use layers::{TpMlp, TpSelfAttention};
pub use layout::{Coords, Mesh};
pub use ops::{apply, Conjugate};

use ferroccl::{Communicator, WireStats};
use std::sync::{Arc, Mutex, MutexGuard};

/// The ranks that split each layer (T of them), with a communicator of their own.
/// Cheap to clone: the layers and the graph nodes of their collectives share it (a
/// node's backward runs its collective when candle differentiates). Use it from one
/// thread at a time, as a communicator.
#[derive(Clone)]
pub struct TensorGroup {
    comm: Arc<Mutex<Communicator>>,
    rank: usize,
    size: usize,
}

impl TensorGroup {
    /// The group of `comm`'s ranks (for example one of `Communicator::split`'s).
    pub fn new(comm: Communicator) -> Self {
        TensorGroup {
            rank: comm.rank(),
            size: comm.world_size(),
            comm: Arc::new(Mutex::new(comm)),
        }
    }

    /// This rank's index in the group, `0..T`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// T.
    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> MutexGuard<'_, Communicator> {
        // A panic elsewhere cannot leave a communicator half-changed: its calls finish
        // or fail as a whole.
        self.comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `f` on the group's communicator.
    pub fn with<R, E>(&self, f: impl FnOnce(&Communicator) -> Result<R, E>) -> Result<R, E> {
        f(&self.lock())
    }

    /// Aborts the group's communicator (its peers fail at once instead of waiting).
    pub fn abort(&self) {
        self.lock().abort_handle().abort();
    }

    /// Bytes the group's links carried so far (see `Communicator::wire_stats`).
    pub fn wire_stats(&self) -> WireStats {
        self.lock().wire_stats()
    }
}
