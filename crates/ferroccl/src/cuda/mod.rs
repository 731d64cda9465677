//! CUDA support (feature `cuda`): device reduction kernels, device buffers in the
//! collectives, and the CUDA-IPC transport's device side.
//!
//! Layers, as in cudarc: `cudarc::driver::sys` (raw FFI, loaded at run time) →
//! `cudarc::driver::{result, safe}` → the types here, which turn every failure into a
//! typed [`Error`] naming the CUDA call ([`Error::Cuda`]) and never panic in `Drop`.
//!
//! - **No driver, no panic.** cudarc loads `libcuda.so` lazily and *panics* when it is
//!   missing, so every entry point here first asks [`driver_present`] (can the dynamic
//!   loader open it, cached) and returns [`Error::Unavailable`] — "no CUDA driver
//!   (libcuda.so not found)" or "no CUDA device" — instead. In a build where another
//!   crate links CUDA (candle's `cuda`), cudarc links too and the process does not start
//!   without the library; the check is then simply true.
//! - **Kernels** live in `cuda/reduce.cu`, embedded with `include_str!` and compiled by
//!   NVRTC ([`nvrtc`]) at first use for the device's own `sm_XY`; the module is cached
//!   per device ordinal for the life of the process ([`Kernels::get`]).
//! - **Headers.** The kernels include `cuda_fp16.h` and `cuda_bf16.h`. NVRTC searches
//!   the directories in `$FERROCCL_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include`,
//!   `$CUDA_PATH/include` and `/usr/local/cuda/include` (see [`nvrtc::include_dirs`]).
//!   `libnvrtc.so.13` itself is found by the dynamic loader (`LD_LIBRARY_PATH`). The
//!   pip wheels `nvidia-cuda-nvrtc==13.0.*` / `nvidia-cuda-runtime==13.0.*` put both
//!   under `site-packages/nvidia/cu13/{lib,include}`.
//! - [`DeviceReducer`] launches `kernel(dtype, op)` on a stream, grid sized from the SM
//!   count (grid-stride loops inside).
//! - `ipc`: CUDA IPC handles (memory and events), for the `cuda-ipc` transport.
//! - `staging`: device buffers over host transports (pinned staging, device combine).
//! - [`order`]: the ordering protocol ([`crate::order`]) over CUDA events, for memory a
//!   framework owns; [`DeviceBuf`] is such memory as the framework hands it over.
//!
//! The device-buffer collectives themselves (`all_reduce_device` and friends, and their
//! raw forms on [`DeviceBuf`]s) are methods of [`crate::Communicator`]. This layer
//! knows nothing of transports or communicators.

pub(crate) mod ipc;
#[doc(hidden)]
pub mod mem;
#[doc(hidden)]
pub mod nvrtc;
pub mod order;
pub(crate) mod staging;

use crate::error::{Error, Result};
use crate::reduce::{DataType, Element, ReduceOp};
use crate::sync::lock;
pub use cudarc;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, DriverError, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Threads per block of every reduction launch.
const BLOCK: u32 = 512;
/// Resident blocks per SM the grid is sized for (4 × 512 = 2048 threads, a full SM).
const BLOCKS_PER_SM: u32 = 4;

/// Maps a driver error to [`Error::Cuda`] naming `call`.
pub(crate) fn drv(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        call: call.into(),
        detail: format!("{:?}", e.0),
    }
}

/// Whether `libcuda.so` can be loaded (checked once).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| library_loads(&["libcuda.so", "libcuda.so.1"]))
}

/// Whether the dynamic loader opens one of `names` (the names cudarc tries first, so a
/// `true` here means cudarc's own loading finds it). Not cudarc's `is_culib_present`:
/// that exists only when cudarc loads at run time, not when a build links CUDA.
pub(crate) fn library_loads(names: &[&str]) -> bool {
    names.iter().any(|name| {
        let Ok(c) = std::ffi::CString::new(*name) else {
            return false;
        };
        // SAFETY: dlopen with a NUL-terminated name; the handle, if any, is closed at
        // once (the library stays loaded while cudarc or the process holds it).
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if h.is_null() {
                false
            } else {
                libc::dlclose(h);
                true
            }
        }
    })
}

/// The error for a machine without the CUDA driver library.
pub fn no_driver() -> Error {
    Error::Unavailable {
        what: "CUDA".into(),
        why: "no CUDA driver (libcuda.so not found)".into(),
    }
}

/// What [`probe`] found.
#[derive(Clone, Debug)]
pub struct Probe {
    /// Number of CUDA devices (at least 1).
    pub devices: usize,
    /// Driver version as CUDA encodes it (`13000` for 13.0).
    pub driver_version: i32,
}

/// Checks for a driver and at least one device without panicking: the first thing
/// every CUDA path calls.
pub fn probe() -> Result<Probe> {
    if !driver_present() {
        return Err(no_driver());
    }
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let count = cudarc::driver::result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(Error::Unavailable {
            what: "CUDA".into(),
            why: "no CUDA device".into(),
        });
    }
    let mut v = 0;
    // SAFETY: a valid out-pointer; the driver is loaded and initialised.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(drv("cuDriverGetVersion"))?;
    Ok(Probe {
        devices: count as usize,
        driver_version: v,
    })
}

/// Device memory a framework hands over (a PyTorch CUDA tensor's storage): `len`
/// elements of `dtype` at device address `addr` on GPU `ordinal`, in that device's
/// primary context. The collectives' raw forms (`Communicator::all_reduce_device_raw`
/// and friends) take these; [`DeviceBuf::check`] says whether one really is device
/// memory of its GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    /// The GPU.
    pub ordinal: usize,
    /// The device address of the first element.
    pub addr: u64,
    /// Elements.
    pub len: usize,
    /// Their type.
    pub dtype: DataType,
}

impl DeviceBuf {
    /// Size in bytes (saturating: [`DeviceBuf::check`] refuses what overflows).
    pub fn bytes(&self) -> usize {
        self.len.saturating_mul(self.dtype.size())
    }

    /// Whether the byte ranges of two buffers overlap.
    pub fn overlaps(&self, other: &DeviceBuf) -> bool {
        let (a, la) = (self.addr, self.bytes() as u64);
        let (b, lb) = (other.addr, other.bytes() as u64);
        self.ordinal == other.ordinal && la > 0 && lb > 0 && a < b + lb && b < a + la
    }

    /// Checks that the buffer named `what` is aligned device memory of its GPU at both
    /// ends (`cuPointerGetAttributes`: a host address, another GPU's memory or an
    /// address the driver does not know is an [`Error::InvalidArgument`] naming it).
    pub fn check(&self, what: &str) -> Result<()> {
        let es = self.dtype.size();
        let bad = |why: String| {
            Error::InvalidArgument(format!(
                "{what}: {} elements of {} at {:#x} on GPU {}: {why}",
                self.len, self.dtype, self.addr, self.ordinal
            ))
        };
        if self.len == 0 {
            return Ok(());
        }
        let bytes = self
            .len
            .checked_mul(es)
            .filter(|&b| b <= isize::MAX as usize && self.addr.checked_add(b as u64).is_some())
            .ok_or_else(|| bad("too large".into()))?;
        if !self.addr.is_multiple_of(es as u64) {
            return Err(bad(format!("not aligned to {es} bytes")));
        }
        for at in [self.addr, self.addr + bytes as u64 - 1] {
            let (kind, ordinal) = mem::pointer_kind(at)?;
            match kind {
                mem::PointerKind::Device if ordinal == self.ordinal => {}
                mem::PointerKind::Device => {
                    return Err(bad(format!("the address {at:#x} is on GPU {ordinal}")))
                }
                mem::PointerKind::Host => {
                    return Err(bad(format!("the address {at:#x} is host memory")))
                }
                mem::PointerKind::Unknown => {
                    return Err(bad(format!(
                        "the address {at:#x} is not memory the CUDA driver knows"
                    )))
                }
            }
        }
        Ok(())
    }

    /// A copy of the buffer's elements in host memory, made on [`Device::shared`]'s
    /// stream (after what is queued there) and waited for.
    ///
    /// # Safety
    /// The buffer is device memory of its GPU valid for `len` elements of `T` (which is
    /// its `dtype`) until this returns, and nothing writes it meanwhile except work
    /// ordered before the copy on that stream.
    pub unsafe fn copy_to_host<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::InvalidArgument(format!(
                "a {} buffer read as {}",
                self.dtype,
                T::DTYPE
            )));
        }
        let dev = Device::shared(self.ordinal)?;
        dev.bind()?;
        let mut v = vec![T::default(); self.len];
        // SAFETY: `v` holds `bytes()` bytes and outlives the synchronize below; the
        // device side is the caller's contract.
        unsafe { mem::dtoh(dev.stream(), bytemuck::cast_slice_mut(&mut v), self.addr)? };
        dev.synchronize()?;
        Ok(v)
    }

    /// Writes `src` (exactly `len` elements) into the buffer on [`Device::shared`]'s
    /// stream, and waits for it.
    ///
    /// # Safety
    /// The buffer is device memory of its GPU valid for `len` elements of `T` (its
    /// `dtype`) until this returns, and nothing else uses it meanwhile except work
    /// ordered on that stream.
    pub unsafe fn copy_from_host<T: Element>(&self, src: &[T]) -> Result<()> {
        if T::DTYPE != self.dtype || src.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "{} {} elements written into a buffer of {} {}",
                src.len(),
                T::DTYPE,
                self.len,
                self.dtype
            )));
        }
        let dev = Device::shared(self.ordinal)?;
        dev.bind()?;
        // SAFETY: as above; `src` outlives the synchronize.
        unsafe { mem::htod(dev.stream(), self.addr, bytemuck::cast_slice(src))? };
        dev.synchronize()
    }
}

/// One GPU as this process uses it: its primary context and a stream for our work.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Device ordinal.
    pub ordinal: usize,
    /// Compute capability `(major, minor)`.
    pub cc: (i32, i32),
    /// Number of SMs.
    pub sm_count: u32,
    /// Marketing name.
    pub name: String,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("cc", &self.cc)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Device {
    /// Opens device `ordinal` (after [`probe`]), on a new stream.
    pub fn open(ordinal: usize) -> Result<Arc<Device>> {
        let p = probe()?;
        if ordinal >= p.devices {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist ({} present)",
                p.devices
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let cc = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute"))?;
        let sm = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))?;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        Ok(Arc::new(Device {
            ctx,
            stream,
            ordinal,
            cc,
            sm_count: sm.max(1) as u32,
            name,
        }))
    }

    /// Device `ordinal`, opened once per process and shared (the collectives use this
    /// for the device a buffer lives on).
    pub fn shared(ordinal: usize) -> Result<Arc<Device>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
        let mut map = lock(DEVICES.get_or_init(Default::default));
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Device::open(ordinal)?;
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The cudarc context (for allocating buffers to pass to the collectives).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream our kernels and copies run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes this device's context current on the calling thread (needed before raw
    /// driver calls).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    /// Waits for everything queued on [`Device::stream`].
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// `sm_XY` as NVRTC wants it: `90` for 9.0.
    pub fn arch(&self) -> u32 {
        (self.cc.0 * 10 + self.cc.1) as u32
    }
}

/// The compiled kernels of one device: every entry of `cuda/reduce.cu`, loaded.
pub struct Kernels {
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    /// The PTX they were loaded from.
    pub ptx_bytes: usize,
}

impl Kernels {
    /// The kernels for `dev`: compiled with NVRTC and loaded on the first call for this
    /// device ordinal, then shared for the life of the process.
    pub fn get(dev: &Device) -> Result<Arc<Kernels>> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        // Held across the compile so that two threads do not compile twice; a poisoned
        // lock only means another thread panicked mid-insert, and the map is still valid.
        let mut map = lock(cache);
        if let Some(k) = map.get(&dev.ordinal) {
            return Ok(k.clone());
        }
        let ptx = nvrtc::compile(dev.arch())?;
        dev.bind()?;
        let ptx_bytes = ptx.len();
        let module = dev
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv("cuModuleLoadData"))?;
        let mut funcs = HashMap::new();
        for name in nvrtc::entry_names() {
            let f = module
                .load_function(&name)
                .map_err(drv("cuModuleGetFunction"))?;
            funcs.insert(name, f);
        }
        let k = Arc::new(Kernels {
            _module: module,
            funcs,
            ptx_bytes,
        });
        map.insert(dev.ordinal, k.clone());
        Ok(k)
    }

    fn func(&self, name: Option<String>, dt: DataType, op: ReduceOp) -> Result<&CudaFunction> {
        crate::reduce::check_op(dt, op)?;
        let name = name.ok_or_else(|| {
            Error::InvalidArgument(format!("no device kernel for {op:?} on {dt}"))
        })?;
        self.funcs
            .get(&name)
            .ok_or_else(|| Error::InvalidArgument(format!("kernel {name} not loaded")))
    }
}

/// Launches the reduction kernels of one device.
#[derive(Clone)]
pub struct DeviceReducer {
    dev: Arc<Device>,
    k: Arc<Kernels>,
}

impl DeviceReducer {
    /// The reducer for `dev`, compiling the kernels on first use.
    pub fn new(dev: Arc<Device>) -> Result<Self> {
        let k = Kernels::get(&dev)?;
        Ok(DeviceReducer { dev, k })
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Grid for `n` elements of `esize` bytes: enough blocks to fill every SM, fewer
    /// when there is less work (the kernels are grid-stride loops).
    pub fn launch_config(&self, n: usize, esize: usize) -> LaunchConfig {
        let vectors = n.div_ceil((16 / esize).max(1)) as u64;
        let want = vectors.div_ceil(BLOCK as u64).max(1);
        let cap = (self.dev.sm_count * BLOCKS_PER_SM) as u64;
        LaunchConfig {
            grid_dim: (want.min(cap) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Queues `dst[i] = a[i] op b[i]` (and `dst2[i]` too when `dst2 != 0`) for `n`
    /// elements of `dt` on `stream`.
    ///
    /// # Safety
    /// The four addresses must be device memory (or IPC-mapped memory) of this device's
    /// context valid for `n` elements until the stream passes this launch; `dst`/`dst2`
    /// may equal `a` but must not partially overlap `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_raw(
        &self,
        stream: &CudaStream,
        dt: DataType,
        op: ReduceOp,
        dst: u64,
        dst2: u64,
        a: u64,
        b: u64,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let cfg = self.launch_config(n, dt.size());
        let n64 = n as u64;
        let mut lb;
        if dst2 == 0 {
            let f = self.k.func(nvrtc::reduce_name(dt, op), dt, op)?;
            lb = stream.launch_builder(f);
            lb.arg(&dst).arg(&a).arg(&b).arg(&n64);
        } else {
            let f = self.k.func(nvrtc::reduce_copy_name(dt, op), dt, op)?;
            lb = stream.launch_builder(f);
            lb.arg(&dst).arg(&dst2).arg(&a).arg(&b).arg(&n64);
        }
        // SAFETY: argument types match the kernel signature (four/five u64 pointers and
        // a u64 count); the memory contract is the caller's.
        unsafe { lb.launch(cfg) }
            .map(|_| ())
            .map_err(drv("cuLaunchKernel"))
    }

    /// Queues `dst[i] /= divisor` for `n` elements (Avg's last step; no-op for integers).
    ///
    /// # Safety
    /// `dst` must be device memory valid for `n` elements of `dt` until the stream
    /// passes this launch.
    pub unsafe fn scale_raw(
        &self,
        stream: &CudaStream,
        dt: DataType,
        dst: u64,
        n: usize,
        divisor: f64,
    ) -> Result<()> {
        let Some(name) = nvrtc::scale_name(dt) else {
            return Ok(());
        };
        if n == 0 {
            return Ok(());
        }
        let f = self.k.func(Some(name), dt, ReduceOp::Sum)?;
        let cfg = self.launch_config(n, dt.size());
        let n64 = n as u64;
        let mut lb = stream.launch_builder(f);
        lb.arg(&dst).arg(&n64).arg(&divisor);
        // SAFETY: (u64 pointer, u64 count, f64) is the kernel's signature.
        unsafe { lb.launch(cfg) }
            .map(|_| ())
            .map_err(drv("cuLaunchKernel"))
    }

    /// `dst[i] = dst[i] op src[i]` on the device, on the reducer's stream. Avg combines
    /// like Sum (divide with [`DeviceReducer::scale`]), as on the CPU.
    pub fn reduce<T: crate::reduce::Element + DeviceRepr>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::InvalidArgument(format!(
                "device reduce: dst has {} elements, src {}",
                dst.len(),
                src.len()
            )));
        }
        let stream = self.dev.stream.clone();
        let n = dst.len();
        let (s, _gs) = src.device_ptr(&stream);
        let (d, _gd) = dst.device_ptr_mut(&stream);
        // SAFETY: both slices are live allocations of n elements, distinct (one is
        // borrowed mutably), and the guards order the launch against their other uses.
        unsafe { self.reduce_raw(&stream, T::DTYPE, op, d, 0, d, s, n) }
    }

    /// `dst[i] /= divisor` on the device (float types; no-op for integers).
    pub fn scale<T: crate::reduce::Element + DeviceRepr>(
        &self,
        dst: &mut CudaSlice<T>,
        divisor: f64,
    ) -> Result<()> {
        let stream = self.dev.stream.clone();
        let n = dst.len();
        let (d, _gd) = dst.device_ptr_mut(&stream);
        // SAFETY: a live allocation of n elements, ordered by its guard.
        unsafe { self.scale_raw(&stream, T::DTYPE, d, n, divisor) }
    }
}

#[cfg(test)]
mod tests {
    use super::library_loads;

    #[test]
    fn cuda_libraries_are_found_by_the_loader_or_not_at_all() {
        // What every Linux process has, then what no machine has, then a name dlopen
        // cannot take: the check answers each without panicking.
        assert!(library_loads(&["libc.so.6"]));
        assert!(!library_loads(&["libferroccl-no-such-library.so.99"]));
        assert!(!library_loads(&["lib\0cuda.so"]));
        assert!(library_loads(&[
            "libferroccl-no-such-library.so.99",
            "libc.so.6"
        ]));
    }
}
