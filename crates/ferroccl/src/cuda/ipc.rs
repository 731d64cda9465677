//! CUDA IPC handles: device memory and events of one process, opened in another
//! (the safe layer over `cuIpcGetMemHandle`/`cuIpcOpenMemHandle` and
//! `cuIpcGetEventHandle`/`cuIpcOpenEventHandle`). Every wrapper binds its context in
//! `Drop` and logs, never panics, when the driver refuses.

use super::drv;
use super::mem::bind;
use crate::error::Result;
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::sync::Arc;

/// An IPC handle for device memory (`cuIpcGetMemHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle(pub [u8; 64]);

impl IpcMemHandle {
    /// The handle of the allocation at `ptr` (the base of a `cuMemAlloc` allocation);
    /// the device's context must be current.
    pub fn of(ptr: sys::CUdeviceptr) -> Result<Self> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: a valid out-pointer; `ptr` is checked by the driver.
        unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }
            .result()
            .map_err(drv("cuIpcGetMemHandle"))?;
        Ok(IpcMemHandle(h.reserved.map(|c| c as u8)))
    }
}

/// Another process's device memory, opened in this context; closed on drop.
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl IpcMapping {
    /// Opens `h` (`cuIpcOpenMemHandle` with lazy peer access, so it also works across
    /// GPUs). Fails for a handle from this same process (a CUDA rule).
    pub fn open(ctx: &Arc<CudaContext>, h: &IpcMemHandle) -> Result<Self> {
        bind(ctx)?;
        let handle = sys::CUipcMemHandle {
            reserved: h.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the handle is plain data checked by the driver.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(drv("cuIpcOpenMemHandle"))?;
        Ok(IpcMapping {
            ctx: ctx.clone(),
            ptr,
        })
    }

    /// The mapped address in this process.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            tracing::warn!("not closing an IPC mapping: {e}");
            return;
        }
        // SAFETY: opened by cuIpcOpenMemHandle, closed once.
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result() {
            tracing::warn!("cuIpcCloseMemHandle failed: {e:?}");
        }
    }
}

/// A CUDA event: either our own interprocess event or one opened from a peer's handle.
/// Destroyed on drop.
pub struct IpcEvent {
    ctx: Arc<CudaContext>,
    ev: sys::CUevent,
}

// SAFETY: CUDA events may be used from any thread of the process.
unsafe impl Send for IpcEvent {}

impl IpcEvent {
    /// A new interprocess event (timing disabled, as CUDA requires for IPC).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        bind(ctx)?;
        let mut ev = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer.
        unsafe { sys::cuEventCreate(&mut ev, flags) }
            .result()
            .map_err(drv("cuEventCreate"))?;
        Ok(IpcEvent {
            ctx: ctx.clone(),
            ev,
        })
    }

    /// Its IPC handle.
    pub fn handle(&self) -> Result<[u8; 64]> {
        let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer and a live interprocess event.
        unsafe { sys::cuIpcGetEventHandle(&mut h, self.ev) }
            .result()
            .map_err(drv("cuIpcGetEventHandle"))?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Opens a peer's event from its handle.
    pub fn open(ctx: &Arc<CudaContext>, h: &[u8; 64]) -> Result<Self> {
        bind(ctx)?;
        let handle = sys::CUipcEventHandle {
            reserved: h.map(|b| b as std::ffi::c_char),
        };
        let mut ev = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle is checked by the driver.
        unsafe { sys::cuIpcOpenEventHandle(&mut ev, handle) }
            .result()
            .map_err(drv("cuIpcOpenEventHandle"))?;
        Ok(IpcEvent {
            ctx: ctx.clone(),
            ev,
        })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { sys::cuEventRecord(self.ev, stream.cu_stream()) }
            .result()
            .map_err(drv("cuEventRecord"))
    }

    /// Makes `stream` wait for the event's latest record.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), self.ev, 0) }
            .result()
            .map_err(drv("cuStreamWaitEvent"))
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            tracing::warn!("not destroying a CUDA event: {e}");
            return;
        }
        // SAFETY: created or opened by us, destroyed once.
        if let Err(e) = unsafe { sys::cuEventDestroy_v2(self.ev) }.result() {
            tracing::warn!("cuEventDestroy failed: {e:?}");
        }
    }
}

/// Host memory (a shared-memory segment's mapping) registered with the driver and
/// mapped into the device's address space (`cuMemHostRegister` with `DEVICEMAP |
/// PORTABLE`): the device writes and waits on it with stream memory operations, the
/// host reads and writes it as plain memory. Unregistered on drop.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    host: *mut std::ffi::c_void,
    dev: sys::CUdeviceptr,
}

// SAFETY: the pointer is only handed to the driver, which takes it from any thread.
unsafe impl Send for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `host` in `ctx`.
    ///
    /// # Safety
    /// `host..host + len` is a live mapping of this process that stays mapped until the
    /// registration is dropped.
    pub unsafe fn new(ctx: &Arc<CudaContext>, host: *mut u8, len: usize) -> Result<Self> {
        bind(ctx)?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        let host = host.cast::<std::ffi::c_void>();
        // SAFETY: the caller's promise on the range.
        unsafe { sys::cuMemHostRegister_v2(host, len, flags) }
            .result()
            .map_err(drv("cuMemHostRegister"))?;
        let mut dev = 0;
        // SAFETY: a valid out-pointer and a range registered just above.
        let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }.result();
        if let Err(e) = got {
            // SAFETY: registered above, unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(host) };
            return Err(drv("cuMemHostGetDevicePointer")(e));
        }
        Ok(HostRegistration {
            ctx: ctx.clone(),
            host,
            dev,
        })
    }

    /// The registered memory's first byte, as a device address.
    pub fn dev_ptr(&self) -> sys::CUdeviceptr {
        self.dev
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Err(e) = bind(&self.ctx) {
            tracing::warn!("not unregistering host memory: {e}");
            return;
        }
        // SAFETY: registered by `new`, unregistered once.
        if let Err(e) = unsafe { sys::cuMemHostUnregister(self.host) }.result() {
            tracing::warn!("cuMemHostUnregister failed: {e:?}");
        }
    }
}

/// Whether device `ordinal` can map registered host memory, which
/// [`HostRegistration`] needs.
pub fn host_register_supported(ordinal: usize) -> Result<bool> {
    let mut dev = 0;
    // SAFETY: a valid out-pointer; the driver checks the ordinal.
    unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) }
        .result()
        .map_err(drv("cuDeviceGet"))?;
    let mut v = 0;
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED;
    // SAFETY: a valid out-pointer and device.
    unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) }
        .result()
        .map_err(drv("cuDeviceGetAttribute"))?;
    Ok(v != 0)
}

/// Enqueues on `stream` a write of `value` to the 4 bytes at device address `addr`,
/// run once the work before it has completed and after a system-wide memory fence
/// (`cuStreamWriteValue32`, default flags): whoever reads the value sees that work's
/// writes.
///
/// # Safety
/// `addr` is a live, 4-byte aligned device address (registered host memory here) for
/// as long as the stream may run the write.
pub unsafe fn write_value32(stream: &CudaStream, addr: sys::CUdeviceptr, value: u32) -> Result<()> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: a live stream; the caller's promise on `addr`.
    unsafe { sys::cuStreamWriteValue32_v2(stream.cu_stream(), addr, value, flags) }
        .result()
        .map_err(drv("cuStreamWriteValue32"))
}

/// Enqueues on `stream` a wait until the 4 bytes at `addr`, as `x`, satisfy
/// `(int32_t)(x - value) >= 0` (`cuStreamWaitValue32` with `GEQ`: cyclic, as
/// [`crate::transport::reached`]); the work after it runs once that holds.
///
/// # Safety
/// As [`write_value32`].
pub unsafe fn wait_value32(stream: &CudaStream, addr: sys::CUdeviceptr, value: u32) -> Result<()> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: a live stream; the caller's promise on `addr`.
    unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), addr, value, flags) }
        .result()
        .map_err(drv("cuStreamWaitValue32"))
}

/// Whether everything enqueued on `stream` has completed (`cuStreamQuery`, which
/// never blocks).
pub fn stream_done(stream: &CudaStream) -> Result<bool> {
    // SAFETY: a live stream.
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(drv("cuStreamQuery")(cudarc::driver::DriverError(e))),
    }
}
