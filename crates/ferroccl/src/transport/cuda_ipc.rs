//! CUDA IPC (feature `cuda`): ranks on one node read each other's device memory.
//!
//! # What is exchanged
//! Each rank owns a device *workspace* (grown to the largest all-reduce seen, the same
//! size on every rank because every rank sees the same calls), an *interprocess event*
//! (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`) and a 64-byte *progress counter*
//! in POSIX shared memory (`/dev/shm/ferroccl-<comm id>-<rank>`). The workspace and
//! event handles (`cuIpcGetMemHandle`, `cuIpcGetEventHandle`) go through the rendezvous
//! store under `cuda-ipc/<comm id>/<epoch>/<rank>`; the left neighbour's workspace is
//! opened with `cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)` and closed on
//! drop ([`IpcMapping`]), the neighbours' events with `cuIpcOpenEventHandle`.
//!
//! Nothing here refuses two ranks on one GPU: IPC between processes on the same device
//! is legal CUDA (NCCL's "Duplicate GPU detected" is its own policy), and with one rank
//! per GPU the same code reads peer memory over NVLink/PCIe.
//!
//! # The ring ([`IpcRing::all_reduce`], and its halves)
//! Phase 0 copies the user buffer into the workspace. Reduce-scatter step `t`
//! (`0..n-1`) reduces chunk `c = r-t-1` as `ws[c] = ws[c] op left_ws[c]`, reading the
//! left neighbour's chunk straight from its memory; the last step runs the fused
//! receive-reduce-copy kernel, writing the result into the workspace (which the right
//! neighbour reads next — the "send slot") and into the user buffer. All-gather step
//! `g` (`0..n-1`) copies chunk `r-g` from the left workspace into both. Nothing is
//! staged through host memory. Reduce-scatter ([`IpcRing::reduce_scatter`]) runs the
//! first half with chunks shifted so that rank `r` completes block `r`; all-gather
//! ([`IpcRing::all_gather`]) copies its block in and runs `n-1` gather steps. Phase
//! numbers run on across calls of any kind. Broadcast and reduce
//! ([`plan::broadcast`], [`plan::reduce`]) are pipelined chains along the same ring
//! direction, `n` chunks deep.
//!
//! Ordering across processes: after enqueueing a phase a rank records its event and
//! then publishes the phase number in its counter. A rank that needs a neighbour's
//! phase `p` waits (host side, with the communicator's timeout) until the counter shows
//! at least `p`, then makes its stream wait on the neighbour's event — so it never waits
//! for an event the peer has not recorded. The event may by then carry a *later*
//! record; waiting for later work is conservative and cannot deadlock, because every
//! stream wait names a record enqueued before it. Needs: before step `t`, the left
//! neighbour's phase `t` (read after write); before all-gather step `g`, also the right
//! neighbour's reduce-scatter step `g` (it must have read the chunk about to be
//! overwritten — already implied by the chain of left waits around the ring, kept as
//! cheap insurance); before phase 0 of a call, the right neighbour's last phase of the
//! previous call (not implied). The schedule is a pure function ([`plan::ring`]), run
//! on threads with random delays and checked read by read in `tests/cuda_ipc_plan.rs`.
//!
//! # Bandwidth limit with n ranks on one GPU
//! Every byte moved is HBM traffic of the same GPU. Per rank and per all-reduce of `S`
//! bytes: copy-in reads and writes `S` (`2S`); each of the `n-1` reduce-scatter steps
//! reads two chunks and writes one (`3S/n`), the last one writing a second copy into
//! the user buffer (`+S/n`); each of the `n-1` all-gather steps copies a chunk from the
//! left workspace to ours and from ours to the user buffer (`4S/n`). Per rank:
//! `2S + 7(n-1)S/n + S/n`; all `n` ranks together move `T = S·(9n - 6)` bytes through
//! one memory of bandwidth `B`, so `t ≥ T/B`. With nccl-tests' busbw = `S/t · 2(n-1)/n`:
//!
//! ```text
//! busbw_max = B · 2(n-1) / (n · (9n - 6))        (n = 2: B/12, n = 4: B/20, n = 8: ≈ B/37.7)
//! ```
//!
//! `ferroccl gpu-check` measures `B` as the device-to-device copy bandwidth in the same
//! run (a copy reads and writes each byte: `B = 2·bytes/t`) and prints this limit next to
//! the measured busbw. A fused copy-to-two-places kernel for the all-gather steps would
//! lower `T` to `S·(8n - 5)`.

use crate::cuda::mem::{bind, dtod, DeviceAlloc};
use crate::cuda::{drv, Device, DeviceReducer};
use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};
use crate::rendezvous::StoreClient;
use crate::schedule;
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The IPC ring's schedule, without I/O: what each phase does and which neighbour
/// phases it waits for. [`IpcRing::all_reduce`] runs it on the GPU; the tests run it on
/// threads over host memory with random delays and check every read against what the
/// neighbour had written (`tests/cuda_ipc_plan.rs`).
pub mod plan {
    /// What one phase of a rank does.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Action {
        /// Copy the user input into the workspace: every chunk (`None`), or only this
        /// rank's own chunk (all-gather; it is copied to the output too).
        CopyIn {
            /// `Some(c)`: only chunk `c`.
            chunk: Option<usize>,
        },
        /// `ws[chunk] = ws[chunk] op left_ws[chunk]`; `last`: the chunk is complete
        /// (Avg's division, and the fused copy into the user buffer).
        Reduce {
            /// Chunk index.
            chunk: usize,
            /// Last reduce-scatter step.
            last: bool,
        },
        /// `ws[chunk] = left_ws[chunk]`, and into the user buffer.
        Gather {
            /// Chunk index.
            chunk: usize,
        },
    }

    /// One phase: wait, act, then publish its number.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Phase {
        /// What it does.
        pub action: Action,
        /// The left neighbour's phase of this call that must be published first (it
        /// wrote what this phase reads).
        pub wait_left: Option<i64>,
        /// The right neighbour's phase that must be published first (it read what this
        /// phase overwrites); `-1` is its last phase of the previous call.
        pub wait_right: Option<i64>,
    }

    /// The `2(n-1) + 1` phases of rank `r` in an `n`-rank ring all-reduce: copy in,
    /// reduce-scatter finishing chunk `r+1`, all-gather.
    pub fn ring(r: usize, n: usize) -> Vec<Phase> {
        let mut v = reduce_steps(r, n, 1);
        if n < 2 {
            return v;
        }
        for g in 0..n - 1 {
            v.push(Phase {
                action: Action::Gather {
                    chunk: (r + n - g) % n,
                },
                wait_left: Some((n - 1 + g) as i64),
                wait_right: Some(1 + g as i64),
            });
        }
        v
    }

    /// Reduce-scatter: copy in, then `n-1` reduce steps finishing chunk `r` (the block
    /// rank `r` receives).
    pub fn reduce_scatter(r: usize, n: usize) -> Vec<Phase> {
        reduce_steps(r, n, 2)
    }

    /// All-gather: copy this rank's block into chunk `r`, then `n-1` steps each copying
    /// the chunk the left neighbour got at its previous step.
    pub fn all_gather(r: usize, n: usize) -> Vec<Phase> {
        let mut v = vec![Phase {
            action: Action::CopyIn { chunk: Some(r) },
            wait_left: None,
            wait_right: Some(-1),
        }];
        for g in 0..n.saturating_sub(1) {
            v.push(Phase {
                action: Action::Gather {
                    chunk: (r + 2 * n - 1 - g) % n,
                },
                wait_left: Some(g as i64),
                wait_right: None,
            });
        }
        v
    }

    /// Broadcast from `root` as a pipelined chain along the ring: each rank copies chunk
    /// `j` from its left neighbour once that neighbour has it. The root only copies in.
    pub fn broadcast(r: usize, n: usize, root: usize) -> Vec<Phase> {
        let d = (r + n - root) % n;
        chain(n, d, |j| Action::Gather { chunk: j })
    }

    /// Reduce to `root` as a pipelined chain along the ring, starting at `root + 1`:
    /// each rank adds chunk `j` of its left neighbour's partial result to its own; the
    /// root's sums are complete (`last`).
    pub fn reduce(r: usize, n: usize, root: usize) -> Vec<Phase> {
        let d = (r + 2 * n - root - 1) % n;
        chain(n, d, |j| Action::Reduce {
            chunk: j,
            last: d == n - 1,
        })
    }

    /// The most phases any rank has in a call of `plan` over `n` ranks: every rank
    /// numbers the next call's phases from there.
    pub fn span(plan: impl Fn(usize) -> Vec<Phase>, n: usize) -> usize {
        (0..n).map(|r| plan(r).len()).max().unwrap_or(1)
    }

    /// Copy in (what this rank has), then, except at the head of the chain (`d == 0`),
    /// one phase per chunk acting on the left neighbour's chunk `j` once it is there.
    fn chain(n: usize, d: usize, act: impl Fn(usize) -> Action) -> Vec<Phase> {
        let mut v = vec![Phase {
            action: Action::CopyIn { chunk: None },
            wait_left: None,
            wait_right: Some(-1),
        }];
        if d > 0 {
            for j in 0..n {
                v.push(Phase {
                    action: act(j),
                    wait_left: Some(if d == 1 { 0 } else { 1 + j as i64 }),
                    wait_right: None,
                });
            }
        }
        v
    }

    /// Copy in, then reduce step `t` on chunk `r - t - shift`.
    fn reduce_steps(r: usize, n: usize, shift: usize) -> Vec<Phase> {
        let mut v = vec![Phase {
            action: Action::CopyIn { chunk: None },
            wait_left: None,
            wait_right: Some(-1),
        }];
        for t in 0..n.saturating_sub(1) {
            v.push(Phase {
                action: Action::Reduce {
                    chunk: (r + 2 * n - t - shift) % n,
                    last: t == n - 2,
                },
                wait_left: Some(t as i64),
                wait_right: None,
            });
        }
        v
    }
}

/// `busbw_max / B` for an IPC ring all-reduce of `n` ranks on one GPU (module docs).
pub fn busbw_limit_fraction(n: usize) -> f64 {
    if n < 2 {
        return f64::INFINITY;
    }
    let n = n as f64;
    2.0 * (n - 1.0) / (n * (9.0 * n - 6.0))
}

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

/// A progress counter in POSIX shared memory: written by its owner, read by the
/// neighbours. The owner unlinks the name on drop; mappings stay valid until unmapped.
struct ShmCounter {
    ptr: *mut AtomicU64,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is process-wide and the counter is atomic.
unsafe impl Send for ShmCounter {}

const SHM_BYTES: usize = 64;

impl ShmCounter {
    fn name(comm_id: u64, rank: usize) -> Result<CString> {
        CString::new(format!("/ferroccl-{comm_id:016x}-{rank}"))
            .map_err(|_| Error::InvalidArgument("shm name".into()))
    }

    fn create(comm_id: u64, rank: usize) -> Result<Self> {
        Self::map(Self::name(comm_id, rank)?, true)
    }

    fn open(comm_id: u64, rank: usize) -> Result<Self> {
        Self::map(Self::name(comm_id, rank)?, false)
    }

    fn map(name: CString, owner: bool) -> Result<Self> {
        let flags = if owner {
            libc::O_CREAT | libc::O_RDWR | libc::O_TRUNC
        } else {
            libc::O_RDWR
        };
        let what = name.to_string_lossy().into_owned();
        // SAFETY: a NUL-terminated name; the fd is closed below.
        let fd = unsafe { libc::shm_open(name.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open {what}"),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd is ours; a 64-byte object holds one counter.
        let r = if owner {
            unsafe { libc::ftruncate(fd, SHM_BYTES as libc::off_t) }
        } else {
            0
        };
        let err = std::io::Error::last_os_error();
        // SAFETY: mapping a shared object we just opened (or created and sized).
        let p = if r == 0 {
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    SHM_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            }
        } else {
            libc::MAP_FAILED
        };
        let err = if r == 0 {
            std::io::Error::last_os_error()
        } else {
            err
        };
        // SAFETY: fd is ours; the mapping does not need it open.
        unsafe { libc::close(fd) };
        if p == libc::MAP_FAILED {
            return Err(Error::io(format!("mapping {what}"), err));
        }
        Ok(ShmCounter {
            ptr: p.cast(),
            name,
            owner,
        })
    }

    fn get(&self) -> u64 {
        // SAFETY: a live, page-aligned shared mapping of at least 8 bytes.
        unsafe { (*self.ptr).load(Ordering::Acquire) }
    }

    fn set(&self, v: u64) {
        // SAFETY: as in get.
        unsafe { (*self.ptr).store(v, Ordering::Release) }
    }
}

impl Drop for ShmCounter {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once; unlinking our own name.
        unsafe {
            libc::munmap(self.ptr.cast(), SHM_BYTES);
            if self.owner {
                libc::shm_unlink(self.name.as_ptr());
            }
        }
    }
}

/// What a rank keeps of a neighbour.
struct Neighbour {
    rank: usize,
    event: IpcEvent,
    counter: ShmCounter,
    /// The neighbour's workspace (only the left one is read).
    ws: Option<IpcMapping>,
}

/// Set up by [`crate::Communicator::init`] for the `cuda-ipc` transport: a store
/// connection and the communicator id; the device side is built at the first device
/// collective, on the device of its buffer.
pub struct IpcState {
    pub(crate) store: StoreClient,
    pub(crate) comm_id: u64,
    pub(crate) ring: Option<IpcRing>,
}

impl IpcState {
    /// A state that will exchange handles through `store` under `comm_id`.
    pub fn new(store: StoreClient, comm_id: u64) -> Self {
        IpcState {
            store,
            comm_id,
            ring: None,
        }
    }
}

/// One rank's side of the IPC ring.
pub struct IpcRing {
    red: DeviceReducer,
    rank: usize,
    n: usize,
    timeout: Duration,
    ws: DeviceAlloc,
    epoch: u64,
    event: IpcEvent,
    counter: ShmCounter,
    left: Option<Neighbour>,
    right: Option<Neighbour>,
    /// Phases published so far, over all calls (each call's phases are numbered on
    /// from here, so calls of different kinds may follow each other).
    done: u64,
    /// Collectives run, for error messages.
    calls: u64,
}

impl IpcRing {
    /// This rank's side on `dev`: its event and counter (the workspace comes with the
    /// first call).
    pub fn new(
        dev: Arc<Device>,
        comm_id: u64,
        rank: usize,
        n: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let red = DeviceReducer::new(dev)?;
        red.device().bind()?;
        Ok(IpcRing {
            rank,
            n,
            timeout,
            ws: DeviceAlloc::new(red.device().context(), 0)?,
            epoch: 0,
            event: IpcEvent::new(red.device().context())?,
            counter: ShmCounter::create(comm_id, rank)?,
            left: None,
            right: None,
            done: 0,
            calls: 0,
            red,
        })
    }

    /// The device ordinal this ring runs on.
    pub fn ordinal(&self) -> usize {
        self.red.device().ordinal
    }

    /// The counter value meaning "phase `p` of the current call is enqueued and
    /// recorded" (`p = -1`: the previous call's last phase).
    fn id(&self, p: i64) -> u64 {
        (self.done as i64 + 1 + p).max(0) as u64
    }

    /// Grows the workspace to `bytes` (every rank does so at the same call) and
    /// exchanges handles for the new epoch.
    fn ensure(&mut self, store: &mut StoreClient, comm_id: u64, bytes: usize) -> Result<()> {
        if self.left.is_some() && self.ws.len() >= bytes {
            return Ok(());
        }
        let dev = self.red.device().clone();
        dev.bind()?;
        // Before freeing the old workspace: the right neighbour has finished every read
        // of it (its last phase of the previous call), and so have we of the left one.
        if self.done > 0 {
            self.wait_for(false, self.done, "to finish the previous collective")?;
            if let Some(r) = &self.right {
                r.event.wait_on(dev.stream())?;
            }
            dev.synchronize()?;
        }
        if let Some(l) = self.left.as_mut() {
            l.ws = None;
        }
        let cap = bytes.next_power_of_two().max(1 << 20);
        self.ws = DeviceAlloc::new(dev.context(), 0)?;
        self.ws = DeviceAlloc::new(dev.context(), cap)?;
        self.epoch += 1;
        let mut value = IpcMemHandle::of(self.ws.ptr())?.0.to_vec();
        value.extend_from_slice(&self.event.handle()?);
        store.set(&key(comm_id, self.epoch, self.rank), &value)?;
        let (l, r) = ((self.rank + self.n - 1) % self.n, (self.rank + 1) % self.n);
        let lv = get_handles(store, comm_id, self.epoch, l, self.timeout)?;
        let rv = get_handles(store, comm_id, self.epoch, r, self.timeout)?;
        let mapping = IpcMapping::open(dev.context(), &lv.0)?;
        match self.left.as_mut() {
            Some(left) => left.ws = Some(mapping),
            None => {
                self.left = Some(Neighbour {
                    rank: l,
                    event: IpcEvent::open(dev.context(), &lv.1)?,
                    counter: ShmCounter::open(comm_id, l)?,
                    ws: Some(mapping),
                })
            }
        }
        if self.right.is_none() {
            self.right = Some(Neighbour {
                rank: r,
                event: IpcEvent::open(dev.context(), &rv.1)?,
                counter: ShmCounter::open(comm_id, r)?,
                ws: None,
            });
        }
        Ok(())
    }

    /// Waits (host side) until the left (`left == true`) or right neighbour's counter
    /// reaches `at_least`, then makes our stream wait on its event.
    fn wait_for(&self, left: bool, at_least: u64, what: &str) -> Result<()> {
        let Some(nb) = (if left { &self.left } else { &self.right }) else {
            return Ok(());
        };
        let start = Instant::now();
        let mut spins = 0u32;
        while nb.counter.get() < at_least {
            if start.elapsed() >= self.timeout {
                return Err(Error::Timeout {
                    rank: self.rank,
                    op: format!("cuda-ipc collective #{}", self.calls),
                    after: start.elapsed(),
                    waiting_for: format!("rank {} {what} (phase {at_least})", nb.rank),
                    peers: format!("rank {} is at phase {}", nb.rank, nb.counter.get()),
                });
            }
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        nb.event.wait_on(self.red.device().stream())
    }

    fn publish(&self, p: i64) -> Result<()> {
        self.event.record(self.red.device().stream())?;
        self.counter.set(self.id(p));
        Ok(())
    }

    /// All-reduce of `count` elements of `dt` at device address `buf` (in this ring's
    /// context), through the neighbours' mapped workspaces. Returns when the result is
    /// in `buf`.
    ///
    /// # Safety
    /// `buf` must be device memory of this context valid for `count` elements, not used
    /// by anything else until this returns.
    pub unsafe fn all_reduce(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        buf: sys::CUdeviceptr,
        count: usize,
        dt: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        crate::reduce::check_op(dt, op)?;
        let n = self.n;
        let chunks = schedule::balanced_chunks(count, n);
        let at = offsets(&chunks, dt);
        let io = Io {
            input: buf,
            input_at: at.clone(),
            output: buf,
            output_at: at,
        };
        let plan = plan::ring(self.rank, n);
        let span = plan.len();
        // SAFETY: the caller's contract; `io` addresses `buf` within `count` elements.
        unsafe { self.run(store, comm_id, &plan, span, &chunks, &io, dt, Some(op)) }
    }

    /// Reduce-scatter: `send` holds `n` blocks of `count` elements; `recv` (`count`
    /// elements) receives the reduction of block `rank`.
    ///
    /// # Safety
    /// Both must be device memory of this context valid for their sizes, not used by
    /// anything else until this returns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dt: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        crate::reduce::check_op(dt, op)?;
        let n = self.n;
        let chunks = schedule::chunks_from_counts(&vec![count; n]);
        let io = Io {
            input: send,
            input_at: offsets(&chunks, dt),
            output: recv,
            output_at: (0..n).map(|c| (c == self.rank).then_some(0)).collect(),
        };
        let plan = plan::reduce_scatter(self.rank, n);
        let span = plan.len();
        // SAFETY: the caller's contract; `io` stays within `send` and `recv`.
        unsafe { self.run(store, comm_id, &plan, span, &chunks, &io, dt, Some(op)) }
    }

    /// All-gather: `recv` (`n × count` elements) receives every rank's `send` (`count`
    /// elements) in rank order.
    ///
    /// # Safety
    /// As [`IpcRing::reduce_scatter`].
    pub unsafe fn all_gather(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dt: DataType,
    ) -> Result<()> {
        let n = self.n;
        let chunks = schedule::chunks_from_counts(&vec![count; n]);
        let io = Io {
            input: send,
            input_at: (0..n).map(|c| (c == self.rank).then_some(0)).collect(),
            output: recv,
            output_at: offsets(&chunks, dt),
        };
        let plan = plan::all_gather(self.rank, n);
        let span = plan.len();
        // SAFETY: the caller's contract; `io` stays within `send` and `recv`.
        unsafe { self.run(store, comm_id, &plan, span, &chunks, &io, dt, None) }
    }

    /// Broadcast of `count` elements at `buf` from `root`, in place.
    ///
    /// # Safety
    /// As [`IpcRing::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn broadcast(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        buf: sys::CUdeviceptr,
        count: usize,
        dt: DataType,
        root: usize,
    ) -> Result<()> {
        let n = self.n;
        let chunks = schedule::balanced_chunks(count, n);
        let at = offsets(&chunks, dt);
        let is_root = self.rank == root;
        let io = Io {
            input: buf,
            input_at: if is_root { at.clone() } else { vec![None; n] },
            output: buf,
            output_at: if is_root { vec![None; n] } else { at },
        };
        let plan = plan::broadcast(self.rank, n, root);
        let span = plan::span(|q| plan::broadcast(q, n, root), n);
        // SAFETY: the caller's contract; `io` addresses `buf` within `count` elements.
        unsafe { self.run(store, comm_id, &plan, span, &chunks, &io, dt, None) }
    }

    /// Reduce of `count` elements at `buf` into `root`'s `buf`, in place; elsewhere
    /// `buf` is left as it was.
    ///
    /// # Safety
    /// As [`IpcRing::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        buf: sys::CUdeviceptr,
        count: usize,
        dt: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        crate::reduce::check_op(dt, op)?;
        let n = self.n;
        let chunks = schedule::balanced_chunks(count, n);
        let at = offsets(&chunks, dt);
        let io = Io {
            input: buf,
            input_at: at.clone(),
            output: buf,
            output_at: if self.rank == root { at } else { vec![None; n] },
        };
        let plan = plan::reduce(self.rank, n, root);
        let span = plan::span(|q| plan::reduce(q, n, root), n);
        // SAFETY: the caller's contract; `io` addresses `buf` within `count` elements.
        unsafe { self.run(store, comm_id, &plan, span, &chunks, &io, dt, Some(op)) }
    }

    /// Runs `plan` over workspace chunks `chunks` (element ranges), reading the user's
    /// input and writing the output as `io` maps chunks to addresses.
    ///
    /// # Safety
    /// Every address `io` yields must be device memory of this context valid for its
    /// chunk, untouched by anything else until this returns.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &mut self,
        store: &mut StoreClient,
        comm_id: u64,
        plan: &[plan::Phase],
        span: usize,
        chunks: &[std::ops::Range<usize>],
        io: &Io,
        dt: DataType,
        op: Option<ReduceOp>,
    ) -> Result<()> {
        let n = self.n;
        let es = dt.size();
        let bytes = chunks.last().map_or(0, |c| c.end) * es;
        if n == 1 {
            // Nothing to exchange: the output is the input where they differ.
            let dev = self.red.device().clone();
            dev.bind()?;
            if let (Some(i), Some(o)) = (io.input_at[0], io.output_at[0]) {
                if io.input + i != io.output + o {
                    // SAFETY: the caller's contract.
                    unsafe {
                        dtod(
                            dev.stream(),
                            io.output + o,
                            io.input + i,
                            chunks[0].len() * es,
                        )?
                    };
                }
            }
            return dev.synchronize();
        }
        self.ensure(store, comm_id, bytes)?;
        let dev = self.red.device().clone();
        dev.bind()?;
        let stream = dev.stream().clone();
        let ws = self.ws.ptr();
        let lws = self
            .left
            .as_ref()
            .and_then(|l| l.ws.as_ref())
            .map(|m| m.ptr())
            .ok_or_else(|| Error::InvalidArgument("cuda-ipc: left workspace not mapped".into()))?;
        let at = |c: usize| (chunks[c].start * es) as u64;
        let op = op.unwrap_or(ReduceOp::Sum);
        for (p, ph) in plan.iter().enumerate() {
            // Waits are phase numbers of this call; -1 is the previous call's last.
            if let Some(w) = ph.wait_right {
                self.wait_for(false, self.id(w), "to finish reading this rank's chunk")?;
            }
            if let Some(w) = ph.wait_left {
                self.wait_for(true, self.id(w), "to finish the chunk this rank reads")?;
            }
            // SAFETY (every unsafe block below): each range lies in a live allocation —
            // our workspace and the left one hold at least `bytes`, the user buffers are
            // the caller's (`io`); cross-rank ordering is given by the waits above, and
            // this rank's own phases are ordered by its stream.
            match ph.action {
                plan::Action::CopyIn { chunk } => {
                    for c in (0..n).filter(|&c| chunk.is_none_or(|only| only == c)) {
                        let len = chunks[c].len() * es;
                        let Some(i) = io.input_at[c] else { continue };
                        // SAFETY: see above.
                        unsafe { dtod(&stream, ws + at(c), io.input + i, len)? };
                        if chunk.is_some() {
                            if let Some(o) = io.output_at[c] {
                                // SAFETY: see above.
                                unsafe { dtod(&stream, io.output + o, io.input + i, len)? };
                            }
                        }
                    }
                }
                plan::Action::Reduce { chunk: c, last } => {
                    let len = chunks[c].len();
                    let (mine, theirs) = (ws + at(c), lws + at(c));
                    let out = if last {
                        io.output_at[c].map(|o| io.output + o)
                    } else {
                        None
                    };
                    // SAFETY: see above.
                    unsafe {
                        match out {
                            // Fused receive-reduce-copy: the result goes to the send slot
                            // (our workspace, read next by the right neighbour) and to the
                            // user's output.
                            Some(o) if op != ReduceOp::Avg => self
                                .red
                                .reduce_raw(&stream, dt, op, mine, o, mine, theirs, len)?,
                            _ => {
                                self.red
                                    .reduce_raw(&stream, dt, op, mine, 0, mine, theirs, len)?;
                                if last && op == ReduceOp::Avg {
                                    self.red.scale_raw(&stream, dt, mine, len, n as f64)?;
                                }
                                if let Some(o) = out {
                                    dtod(&stream, o, mine, len * es)?;
                                }
                            }
                        }
                    }
                }
                plan::Action::Gather { chunk: c } => {
                    let len = chunks[c].len() * es;
                    // SAFETY: see above.
                    unsafe {
                        dtod(&stream, ws + at(c), lws + at(c), len)?;
                        if let Some(o) = io.output_at[c] {
                            dtod(&stream, io.output + o, ws + at(c), len)?;
                        }
                    }
                }
            }
            self.publish(p as i64)?;
        }
        // A rank with fewer phases than the longest (the head of a chain) still
        // publishes the call's last number, which the next call waits for.
        if plan.len() < span {
            self.publish(span as i64 - 1)?;
        }
        dev.synchronize()?;
        self.done += span as u64;
        self.calls += 1;
        Ok(())
    }
}

/// Byte offsets of `chunks` (element ranges of `dt`), every chunk present.
fn offsets(chunks: &[std::ops::Range<usize>], dt: DataType) -> Vec<Option<u64>> {
    chunks
        .iter()
        .map(|c| Some((c.start * dt.size()) as u64))
        .collect()
}

/// Where a collective's user buffers are, per workspace chunk (byte offsets; `None`:
/// this chunk has no input / output on this rank).
struct Io {
    input: sys::CUdeviceptr,
    input_at: Vec<Option<u64>>,
    output: sys::CUdeviceptr,
    output_at: Vec<Option<u64>>,
}

impl Drop for IpcRing {
    /// Before the workspace is freed, the right neighbour must have finished reading
    /// it: wait (bounded by the timeout) for its last phase, on the GPU too. Failures
    /// are logged, never raised.
    fn drop(&mut self) {
        if self.done == 0 || self.right.is_none() {
            return;
        }
        let r = self
            .wait_for(false, self.done, "to finish reading this rank's workspace")
            .and_then(|()| self.red.device().synchronize());
        if let Err(e) = r {
            tracing::warn!("cuda-ipc: freeing the workspace without the neighbour's go-ahead: {e}");
        }
    }
}

fn key(comm_id: u64, epoch: u64, rank: usize) -> String {
    format!("cuda-ipc/{comm_id:016x}/{epoch}/{rank}")
}

fn get_handles(
    store: &mut StoreClient,
    comm_id: u64,
    epoch: u64,
    rank: usize,
    timeout: Duration,
) -> Result<(IpcMemHandle, [u8; 64])> {
    let v = store.get(&key(comm_id, epoch, rank), timeout)?;
    if v.len() != 128 {
        return Err(Error::Rendezvous(format!(
            "cuda-ipc handles of rank {rank}: expected 128 bytes, got {}",
            v.len()
        )));
    }
    let mut m = [0u8; 64];
    let mut e = [0u8; 64];
    m.copy_from_slice(&v[..64]);
    e.copy_from_slice(&v[64..]);
    Ok((IpcMemHandle(m), e))
}
