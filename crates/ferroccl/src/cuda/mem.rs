//! Raw device and pinned host allocations with checked calls and non-panicking `Drop`,
//! and the copies between them. The collectives use these for staging; users pass
//! cudarc's `CudaSlice<T>`.

use super::drv;
use crate::error::Result;
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::Arc;

/// What an address is, to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    /// Device memory (or managed memory) of some GPU.
    Device,
    /// Host memory the driver knows (pinned or registered).
    Host,
    /// An address the driver does not know (plain host memory, or nothing).
    Unknown,
}

/// What `addr` is, and the GPU it belongs to (`cuPointerGetAttributes`: needs no
/// current context, and answers for unknown addresses instead of failing).
pub fn pointer_kind(addr: sys::CUdeviceptr) -> Result<(PointerKind, usize)> {
    if !super::driver_present() {
        return Err(super::no_driver());
    }
    result::init().map_err(drv("cuInit"))?;
    let mut memtype: u32 = 0;
    let mut ordinal: i32 = -1;
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    ];
    let mut data: [*mut std::ffi::c_void; 2] = [
        (&mut memtype as *mut u32).cast(),
        (&mut ordinal as *mut i32).cast(),
    ];
    // SAFETY: two attributes, each with an out-pointer of the type the driver writes
    // for it (CUmemorytype, a 32-bit enum; int).
    unsafe { sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), addr) }
        .result()
        .map_err(drv("cuPointerGetAttributes"))?;
    let kind = match memtype {
        x if x == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
            || x == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 =>
        {
            PointerKind::Device
        }
        x if x == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => PointerKind::Host,
        _ => PointerKind::Unknown,
    };
    Ok((kind, usize::try_from(ordinal).unwrap_or(usize::MAX)))
}

/// Makes `ctx` current on this thread, for a raw driver call.
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
}

/// A device allocation (`cuMemAlloc`, so it can be exported through CUDA IPC), freed on
/// drop — on whichever thread, with its context made current first.
pub struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceAlloc {
    /// `bytes` of uninitialised device memory in `ctx` (nothing for 0).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let ctx = ctx.clone();
        if bytes == 0 {
            return Ok(DeviceAlloc { ctx, ptr: 0, bytes });
        }
        bind(&ctx)?;
        // SAFETY: plain allocation in the context just made current.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(drv("cuMemAlloc"))?;
        Ok(DeviceAlloc { ctx, ptr, bytes })
    }

    /// The device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for a zero-byte allocation.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Makes sure at least `bytes` are allocated (contents are not kept).
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.bytes < bytes {
            let ctx = self.ctx.clone();
            *self = DeviceAlloc::new(&ctx, 0)?;
            *self = DeviceAlloc::new(&ctx, bytes)?;
        }
        Ok(())
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.ptr != 0 {
            if let Err(e) = bind(&self.ctx) {
                tracing::warn!("leaking {} B of device memory: {e}", self.bytes);
                return;
            }
            // SAFETY: allocated by cuMemAlloc in this context and freed once.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!("cuMemFree failed: {e:?}");
            }
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, portable to every context), freed on drop.
pub struct PinnedBuf {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain host memory owned by this value; no thread affinity.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    /// `bytes` of zeroed pinned memory, allocated in `ctx` (nothing for 0).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let ctx = ctx.clone();
        if bytes == 0 {
            return Ok(PinnedBuf {
                ctx,
                ptr: std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
                bytes,
            });
        }
        bind(&ctx)?;
        // SAFETY: plain allocation; PORTABLE makes it pinned for every context.
        let p = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(drv("cuMemHostAlloc"))?;
        let ptr = p.cast::<u8>();
        // SAFETY: `bytes` writable bytes were just allocated at `ptr`.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(PinnedBuf { ctx, ptr, bytes })
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` initialised bytes owned by self (or a dangling, aligned
        // pointer with length 0).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.bytes != 0 {
            if let Err(e) = bind(&self.ctx) {
                tracing::warn!("leaking {} B of pinned memory: {e}", self.bytes);
                return;
            }
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
                tracing::warn!("cuMemFreeHost failed: {e:?}");
            }
        }
    }
}

/// Queues a copy of `src` to device address `dst`.
///
/// # Safety
/// `dst` must be valid for `src.len()` bytes, and `src` must stay alive and unchanged
/// until the stream passes the copy.
pub unsafe fn htod(stream: &CudaStream, dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
        .map_err(drv("cuMemcpyHtoDAsync"))
}

/// Queues a copy from device address `src` into `dst`.
///
/// # Safety
/// `src` must be valid for `dst.len()` bytes, and `dst` must stay alive and untouched
/// until the stream passes the copy.
pub unsafe fn dtoh(stream: &CudaStream, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
        .map_err(drv("cuMemcpyDtoHAsync"))
}

/// Queues a device-to-device copy of `bytes` (either side may be IPC-mapped memory).
///
/// # Safety
/// Both ranges must be valid device memory until the stream passes the copy.
pub unsafe fn dtod(
    stream: &CudaStream,
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
        .map_err(drv("cuMemcpyDtoDAsync"))
}
