//! The ordering protocol's CUDA side: [`crate::order::Streams`] over CUDA events, for
//! collectives on memory a framework owns (PyTorch's tensors).
//!
//! A framework's tensors live in the device's *primary* context, the one cudarc (and so
//! [`Device::shared`]) retains too, so their addresses are valid on our stream and an
//! event recorded on the framework's stream can order ours. Its streams arrive as raw
//! `CUstream` handles (`torch.cuda.current_stream().cuda_stream`; `0` is the legacy
//! default stream *of the current context*), so every call here makes the device's
//! context current for its own duration ([`Current`]) and puts back what the calling
//! thread had: that thread may be the framework's, whose notion of the current device
//! is its current context.
//!
//! Events are created per record (`CU_EVENT_DISABLE_TIMING`) and destroyed when the
//! last holder drops them; a stream wait captures the event's state when it is queued,
//! so dropping an event after queueing a wait on it is safe (CUDA's rule).

use super::{drv, Device};
use crate::error::{Error, Result};
use crate::order::{DeviceOp, StreamId, Streams};
use crate::sync::lock;
use cudarc::driver::{sys, CudaContext};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Makes a context current on this thread until dropped, then puts back the one that
/// was current before (module docs).
pub struct Current {
    prev: sys::CUcontext,
    changed: bool,
}

impl Current {
    /// Makes `ctx` current (the driver must be initialised: after [`probe`]).
    pub fn of(ctx: &CudaContext) -> Result<Self> {
        let mut prev = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        unsafe { sys::cuCtxGetCurrent(&mut prev) }
            .result()
            .map_err(drv("cuCtxGetCurrent"))?;
        let want = ctx.cu_ctx();
        if prev == want {
            return Ok(Current {
                prev,
                changed: false,
            });
        }
        // SAFETY: a live context (held by `ctx`).
        unsafe { sys::cuCtxSetCurrent(want) }
            .result()
            .map_err(drv("cuCtxSetCurrent"))?;
        Ok(Current {
            prev,
            changed: true,
        })
    }

    /// Remembers the calling thread's current context, to put it back when dropped
    /// whatever is made current meanwhile (opening a device binds its context).
    pub fn keep() -> Result<Self> {
        if !super::driver_present() {
            return Err(super::no_driver());
        }
        cudarc::driver::result::init().map_err(drv("cuInit"))?;
        let mut prev = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver is loaded and initialised.
        unsafe { sys::cuCtxGetCurrent(&mut prev) }
            .result()
            .map_err(drv("cuCtxGetCurrent"))?;
        Ok(Current {
            prev,
            changed: true,
        })
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        if !self.changed {
            return;
        }
        // SAFETY: `prev` was current on this thread (or null: none); contexts that
        // were current stay alive while any thread may make them current again.
        if let Err(e) = unsafe { sys::cuCtxSetCurrent(self.prev) }.result() {
            tracing::warn!("cannot restore the thread's CUDA context: {e:?}");
        }
    }
}

/// A CUDA event of one device (timing disabled), destroyed on drop.
pub struct CudaEvent {
    ctx: Arc<CudaContext>,
    ev: sys::CUevent,
}

// SAFETY: CUDA events may be used and destroyed from any thread of the process.
unsafe impl Send for CudaEvent {}
// SAFETY: every call on an event takes it by handle; the driver serialises them.
unsafe impl Sync for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let _cur = match Current::of(&self.ctx) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("not destroying a CUDA event: {e}");
                return;
            }
        };
        // SAFETY: created by `CudaStreams::record`, destroyed once.
        if let Err(e) = unsafe { sys::cuEventDestroy_v2(self.ev) }.result() {
            tracing::warn!("cuEventDestroy failed: {e:?}");
        }
    }
}

/// One device's streams, as the protocol sees them.
#[derive(Debug)]
pub struct CudaStreams {
    dev: Arc<Device>,
}

impl CudaStreams {
    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
}

impl Streams for CudaStreams {
    type Event = CudaEvent;

    fn record(&self, stream: StreamId) -> Result<CudaEvent> {
        let ctx = self.dev.context();
        let _cur = Current::of(ctx)?;
        let mut ev = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: a valid out-pointer, in the context made current above.
        unsafe { sys::cuEventCreate(&mut ev, flags) }
            .result()
            .map_err(drv("cuEventCreate"))?;
        let event = CudaEvent {
            ctx: ctx.clone(),
            ev,
        };
        // SAFETY: a live event; `stream` is a stream of this context by the caller's
        // word (a framework's stream handle, or ours), 0 its legacy default stream.
        unsafe { sys::cuEventRecord(ev, stream.0 as sys::CUstream) }
            .result()
            .map_err(drv("cuEventRecord"))?;
        Ok(event)
    }

    fn wait(&self, stream: StreamId, event: &CudaEvent) -> Result<()> {
        let _cur = Current::of(self.dev.context())?;
        // SAFETY: a live event and a stream of this context (as in `record`).
        unsafe { sys::cuStreamWaitEvent(stream.0 as sys::CUstream, event.ev, 0) }
            .result()
            .map_err(drv("cuStreamWaitEvent"))
    }

    fn query(&self, event: &CudaEvent) -> Result<bool> {
        let _cur = Current::of(self.dev.context())?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(event.ev) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(Error::Cuda {
                call: "cuEventQuery".into(),
                detail: format!("{e:?}"),
            }),
        }
    }
}

/// Device `ordinal`'s streams for the protocol, and the stream ferroccl's device
/// collectives on it run on ([`Device::shared`]'s). Opened once per process; the
/// calling thread's current context is left as it was.
pub fn streams(ordinal: usize) -> Result<(Arc<CudaStreams>, StreamId)> {
    static ALL: OnceLock<Mutex<HashMap<usize, Arc<CudaStreams>>>> = OnceLock::new();
    let mut all = lock(ALL.get_or_init(Default::default));
    let s = match all.get(&ordinal) {
        Some(s) => s.clone(),
        None => {
            // Opening the device binds its context on this thread: put it back.
            let _keep = Current::keep()?;
            let s = Arc::new(CudaStreams {
                dev: Device::shared(ordinal)?,
            });
            all.insert(ordinal, s.clone());
            s
        }
    };
    let ours = StreamId(s.dev.stream().cu_stream() as u64);
    Ok((s, ours))
}

/// Step 1 of the protocol for a collective on device `ordinal`, issued by a framework
/// whose work on the buffers is queued on `caller` (a raw `CUstream`; see the module
/// docs): records `ready` there.
pub fn issue(ordinal: usize, caller: u64) -> Result<DeviceOp<CudaStreams>> {
    let (s, ours) = streams(ordinal)?;
    DeviceOp::issue(s, ours, StreamId(caller))
}
