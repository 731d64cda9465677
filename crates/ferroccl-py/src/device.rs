//! `ferroccl._native.DeviceOp`: one collective on a framework's CUDA memory, ordered
//! with the framework's stream by the library's protocol (`ferroccl::order`: issue on
//! the caller's stream, run on ferroccl's, wait, release), over CUDA events
//! (`ferroccl::cuda::order`). A build without the `cuda` feature has the class, but
//! making one is an `UnsupportedError`.
//!
//! Python makes one per operation on the tensors' GPU with the caller's current stream
//! (`Communicator.device_op`), hands it to the collective (`device=`: the buffers'
//! addresses are then device memory of its GPU), and after the operation's report asks
//! it to order the caller's stream (`wait_stream`) and whether the tensors may go back
//! to the caching allocator now or only behind ferroccl's stream (`release_now`;
//! `record_stream` otherwise).

use crate::errors::to_py;
use ferroccl::order::{DeviceOp, StreamId};
use pyo3::prelude::*;
use std::sync::Arc;

#[cfg(feature = "cuda")]
pub(crate) type Backend = ferroccl::cuda::order::CudaStreams;
#[cfg(not(feature = "cuda"))]
pub(crate) type Backend = NoCuda;

/// Whether this build moves CUDA memory.
pub(crate) const BUILT: bool = cfg!(feature = "cuda");

/// The error of a CUDA call in a build without CUDA.
#[cfg(not(feature = "cuda"))]
pub(crate) fn not_built() -> ferroccl::Error {
    ferroccl::Error::Unavailable {
        what: "CUDA".into(),
        why: "this build of ferroccl's Python package has no CUDA support (build it with \
              the `cuda` feature)"
            .into(),
    }
}

/// The device side of a build without CUDA: every call fails.
#[cfg(not(feature = "cuda"))]
pub(crate) struct NoCuda;

#[cfg(not(feature = "cuda"))]
impl ferroccl::order::Streams for NoCuda {
    type Event = ();
    fn record(&self, _: StreamId) -> ferroccl::Result<()> {
        Err(not_built())
    }
    fn wait(&self, _: StreamId, _: &()) -> ferroccl::Result<()> {
        Err(not_built())
    }
    fn query(&self, _: &()) -> ferroccl::Result<bool> {
        Err(not_built())
    }
}

/// Step 1 of the protocol on GPU `ordinal`, for a caller whose work on the buffers is
/// queued on `stream` (a raw `CUstream`).
#[cfg(feature = "cuda")]
fn issue(ordinal: usize, stream: u64) -> ferroccl::Result<DeviceOp<Backend>> {
    ferroccl::cuda::order::issue(ordinal, stream)
}

#[cfg(not(feature = "cuda"))]
fn issue(_ordinal: usize, _stream: u64) -> ferroccl::Result<DeviceOp<Backend>> {
    Err(not_built())
}

/// Runs `f` and puts back the calling thread's current CUDA context afterwards (the
/// thread may be the framework's; the library binds the buffer's device).
#[cfg(feature = "cuda")]
pub(crate) fn keeping_context<R>(f: impl FnOnce() -> ferroccl::Result<R>) -> ferroccl::Result<R> {
    let _keep = ferroccl::cuda::order::Current::keep()?;
    f()
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn keeping_context<R>(_f: impl FnOnce() -> ferroccl::Result<R>) -> ferroccl::Result<R> {
    Err(not_built())
}

/// A collective on CUDA memory, ordered with its caller's stream (module docs).
#[pyclass(module = "ferroccl._native", name = "DeviceOp", frozen)]
pub(crate) struct PyDeviceOp {
    pub(crate) op: Arc<DeviceOp<Backend>>,
    pub(crate) ordinal: usize,
}

impl PyDeviceOp {
    /// Records the caller's `stream` on GPU `ordinal` (the GIL released meanwhile:
    /// the first call on a GPU opens it).
    pub(crate) fn new(py: Python<'_>, ordinal: usize, stream: u64) -> PyResult<Self> {
        let op = py
            .detach(|| issue(ordinal, stream))
            .map_err(|e| to_py(py, &e))?;
        Ok(PyDeviceOp {
            op: Arc::new(op),
            ordinal,
        })
    }
}

#[pymethods]
impl PyDeviceOp {
    /// The GPU.
    #[getter]
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The stream the collective runs on (ferroccl's, for `torch.cuda.ExternalStream`).
    #[getter]
    fn stream(&self) -> u64 {
        self.op.ours().0
    }

    /// The caller's stream it was issued on.
    #[getter]
    fn caller(&self) -> u64 {
        self.op.caller().0
    }

    /// Makes `stream` wait (on the device, not the host) for the operation's end;
    /// raises once the operation has not run yet.
    fn wait_stream(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        self.op.wait_on(StreamId(stream)).map_err(|e| to_py(py, &e))
    }

    /// More work that uses the buffers was queued on `stream` after the operation ran
    /// (copies into the caller's outputs): the operation's end moves behind it.
    fn after(&self, py: Python<'_>) -> PyResult<()> {
        self.op.after().map_err(|e| to_py(py, &e))
    }

    /// True once the operation ran and all of its device work is over; never blocks.
    fn query(&self, py: Python<'_>) -> PyResult<bool> {
        self.op.query().map_err(|e| to_py(py, &e))
    }

    /// True when the buffers may go back to the caching allocator as they are; False
    /// when ferroccl's stream may still use them (tie them to it with
    /// `record_stream` before dropping them). Never blocks.
    fn release_now(&self) -> bool {
        matches!(self.op.release(), ferroccl::order::Release::Now)
    }
}
