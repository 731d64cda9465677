//! CUDA IPC (feature `cuda`): ranks on one node read each other's device memory.
//!
//! The transport makes TCP links (host-buffer collectives, fingerprints, status
//! queries, point-to-point) and [`MemPeers`] over device memory, on which the engine's
//! pull executor runs the same plans as every other transport: a receive becomes a read
//! of the sender's workspace once the sender has published that the bytes are ready
//! (`engine::pull` has the rules, and `tests/suite/memsim.rs` runs them on a simulated
//! stream with random delays). Nothing is staged through host memory.
//!
//! # What is exchanged
//! Each rank owns a device *workspace* (grown to the largest call seen, the same size on
//! every rank because every rank sees the same calls), an *interprocess event*
//! (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`) and a 64-byte *progress counter*
//! in POSIX shared memory (`/dev/shm/ferroccl-<comm id>-<rank>`, `0600`, unlinked by its
//! owner). The workspace and event handles (`cuIpcGetMemHandle`, `cuIpcGetEventHandle`)
//! go through the rendezvous store under `cuda-ipc/<comm id>/<epoch>/<rank>`; a peer's
//! workspace is opened with `cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)`
//! and closed on drop, its event with `cuIpcOpenEventHandle` (`crate::cuda::ipc`).
//!
//! Nothing here refuses two ranks on one GPU: IPC between processes on the same device
//! is legal CUDA (NCCL's "Duplicate GPU detected" is its own policy), and with one rank
//! per GPU the same code reads peer memory over NVLink/PCIe.
//!
//! # Ordering across processes
//! After enqueueing work a rank records its event and then stores the new value in its
//! counter ([`MemPeers::publish`]). A rank that needs a peer's value waits (host side,
//! under the communicator's timeout and abort flag) until the counter shows it, then
//! makes its stream wait on the peer's event ([`MemPeers::order_after`]) — so it never
//! waits for an event the peer has not recorded. The event may by then carry a *later*
//! record; waiting for later work is conservative and cannot deadlock, because every
//! stream wait names a record enqueued before it.
//!
//! # Device order (`FERROCCL_CUDA_ORDER=device`, off by default)
//! The same protocol with the waits on the device ([`MemPeers::device_order`]): each
//! rank's counter segment (one page) also holds an *inbox* word per rank and a
//! *failed* word, and is registered with the driver (`cuMemHostRegister`, mapped into
//! the device's address space) in every rank's process. A publish enqueues, after the
//! work before it, `cuStreamWriteValue32` of the value's low 32 bits into the inbox
//! word for this rank in each peer's segment (the default flags fence the work's
//! writes before it); a wait is `cuStreamWaitValue32(GEQ)` on this rank's own inbox
//! word for the peer. So a call is enqueued whole, with no host round trip per step,
//! and the host only polls `cuStreamQuery` under the timeout. A failed call sets its
//! failed word and then stores a value past every pending wait into its own inbox
//! words, again each round until its stream has drained (a peer's stream may write
//! its own value over one first), so the stream does not hold up whatever
//! synchronises with the device later; every rank reads every rank's failed word before it returns
//! (`engine/pull.rs` says why). Every rank must run the same order: the mode travels
//! with the handles, and a rank that differs fails the first device call. Not yet
//! run on a GPU (the simulated stream runs the protocol in the tests); `tools/gpu-check
//! all` measures it beside host order.
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

use super::{tcp, widen_progress, CallMem, Joined, Links, MemPeers, Region, Transport};
use crate::config::Config;
use crate::cuda::ipc::{
    host_register_supported, stream_done, wait_value32, write_value32, HostRegistration, IpcEvent,
    IpcMapping, IpcMemHandle,
};
use crate::cuda::mem::{dtod, DeviceAlloc};
use crate::cuda::{Device, DeviceReducer};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::rendezvous::StoreClient;
use crate::sys::shm::ShmSegment;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `busbw_max / B` for an IPC ring all-reduce of `n` ranks on one GPU (module docs).
pub fn busbw_limit_fraction(n: usize) -> f64 {
    if n < 2 {
        return f64::INFINITY;
    }
    let n = n as f64;
    2.0 * (n - 1.0) / (n * (9.0 * n - 6.0))
}

/// The `cuda-ipc` transport ([`super::builtin`]).
pub(crate) struct CudaIpc;

impl Transport for CudaIpc {
    fn name(&self) -> &str {
        "cuda-ipc"
    }

    /// A machine without a GPU fails before the rendezvous.
    fn probe(&self, _cfg: &Config) -> Result<()> {
        crate::cuda::probe().map(|_| ())
    }

    fn connect(&self, job: Joined) -> Result<Links> {
        // Handles are traded through the store later (at the first device call), on a
        // connection of its own.
        let store = job.store_connection()?;
        let device_order = job.config.transport.cuda_ipc.device_order;
        if device_order && job.world_size() > MAX_INBOXES {
            return Err(Error::InvalidArgument(format!(
                "FERROCCL_CUDA_ORDER=device takes at most {MAX_INBOXES} ranks, not {}",
                job.world_size()
            )));
        }
        let peers = IpcPeers {
            store,
            comm_id: job.comm_id,
            rank: job.rank(),
            world_size: job.world_size(),
            timeout: job.config.tuning.timeout,
            device_order,
            dev: None,
            call: None,
        };
        Ok(tcp::endpoint(tcp::ConnectCtx::of(job))?.with_memory(Box::new(peers)))
    }
}

/// Bytes of a progress-counter segment: one page (what the driver registers).
const COUNTER_BYTES: usize = 4096;

/// Words of a counter segment: host order's progress; device order's failed mark
/// ([`MemPeers::release`]) and, from [`INBOX_WORD`], one inbox word per rank (what
/// that rank last published to this one, in the low 32 bits).
const PROGRESS_WORD: usize = 0;
const FAILED_WORD: usize = 1;
const INBOX_WORD: usize = 8;

/// The most ranks device order takes (inbox words in a segment).
const MAX_INBOXES: usize = COUNTER_BYTES / 8 - INBOX_WORD;

// The words do not overlap.
const _: () = assert!(PROGRESS_WORD < FAILED_WORD && FAILED_WORD < INBOX_WORD);

/// Byte offset of the inbox word for rank `q` in a counter segment.
fn inbox_offset(q: usize) -> u64 {
    ((INBOX_WORD + q) * 8) as u64
}

fn counter_name(comm_id: u64, rank: usize) -> String {
    format!("/ferroccl-{comm_id:016x}-{rank}")
}

fn key(comm_id: u64, epoch: u64, rank: usize) -> String {
    format!("cuda-ipc/{comm_id:016x}/{epoch}/{rank}")
}

/// What a rank keeps of a peer it reads from or orders after.
struct Peer {
    event: IpcEvent,
    counter: ShmSegment,
    /// The peer's workspace, and the epoch it was mapped at.
    ws: Option<(u64, IpcMapping)>,
}

/// Device order's registrations and state (module docs). Dropped before the segments
/// it registers (a field of [`DeviceSide`] declared ahead of them).
struct Order {
    /// This rank's own counter segment, as the device sees it.
    own: HostRegistration,
    /// Each peer's counter segment, as the device sees it (where this rank's stream
    /// writes what it publishes to that peer).
    peers: HashMap<usize, HostRegistration>,
    /// The peers of the call in progress: where a publish goes.
    call_peers: Vec<usize>,
    /// The waits were released after a failure: no more calls.
    broken: bool,
}

/// This rank's device side, built at the first device call on the buffer's device.
struct DeviceSide {
    /// Device order, where it is on.
    order: Option<Order>,
    red: DeviceReducer,
    ws: DeviceAlloc,
    epoch: u64,
    event: IpcEvent,
    counter: ShmSegment,
    peers: HashMap<usize, Peer>,
    /// The last value published.
    published: u64,
}

/// The memory peers of the `cuda-ipc` transport.
pub(crate) struct IpcPeers {
    store: StoreClient,
    comm_id: u64,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// `FERROCCL_CUDA_ORDER=device` (module docs).
    device_order: bool,
    dev: Option<DeviceSide>,
    call: Option<CallMem>,
}

impl IpcPeers {
    fn side(&self) -> Result<&DeviceSide> {
        self.dev
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("cuda-ipc: no device call in progress".into()))
    }

    /// Where region `r` is, as a device address.
    fn addr(&self, r: Region) -> Result<u64> {
        let call = self
            .call
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("cuda-ipc: no call in progress".into()))?;
        let side = self.side()?;
        Ok(match r {
            Region::Input(off) => call.input + off as u64,
            Region::Output(off) => call.output + off as u64,
            Region::Mine(off) => side.ws.ptr() + off as u64,
            Region::Peer(q, off) => {
                let m = side
                    .peers
                    .get(&q)
                    .and_then(|p| p.ws.as_ref())
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("cuda-ipc: rank {q}'s memory is not mapped"))
                    })?;
                m.1.ptr() + off as u64
            }
        })
    }

    /// Builds this rank's device side on device `ordinal` (or checks it is that one).
    fn ensure_device(&mut self, ordinal: usize) -> Result<()> {
        if let Some(d) = &self.dev {
            let have = d.red.device().ordinal;
            if have != ordinal {
                return Err(Error::InvalidArgument(format!(
                    "cuda-ipc: this rank's memory is on device {have}, the buffer is on device {ordinal}"
                )));
            }
            return Ok(());
        }
        let red = DeviceReducer::new(Device::shared(ordinal)?)?;
        red.device().bind()?;
        let ctx = red.device().context().clone();
        let counter = ShmSegment::create(&counter_name(self.comm_id, self.rank), COUNTER_BYTES)?;
        let order = if self.device_order {
            if !host_register_supported(ordinal)? {
                return Err(Error::Cuda {
                    call: "cuDeviceGetAttribute(HOST_REGISTER_SUPPORTED)".into(),
                    detail: format!(
                        "GPU {ordinal} cannot map host memory, which FERROCCL_CUDA_ORDER=device \
                         needs (unset it for host order)"
                    ),
                });
            }
            Some(Order {
                // SAFETY: the segment's mapping is COUNTER_BYTES long and outlives the
                // registration (`order` drops first, module docs of `Order`).
                own: unsafe { HostRegistration::new(&ctx, counter.as_mut_ptr(), COUNTER_BYTES)? },
                peers: HashMap::new(),
                call_peers: Vec::new(),
                broken: false,
            })
        } else {
            None
        };
        self.dev = Some(DeviceSide {
            order,
            ws: DeviceAlloc::new(&ctx, 0)?,
            epoch: 0,
            event: IpcEvent::new(&ctx)?,
            counter,
            peers: HashMap::new(),
            published: 0,
            red,
        });
        Ok(())
    }
}

impl MemPeers for IpcPeers {
    fn host_memory(&self) -> bool {
        false
    }

    fn begin(&mut self, mem: &CallMem, bytes: usize, peers: &[usize]) -> Result<()> {
        self.ensure_device(mem.space)?;
        let (comm_id, rank, timeout) = (self.comm_id, self.rank, self.timeout);
        let mode = u8::from(self.device_order);
        // Device order maps every rank: a publish writes into the call's peers, and
        // every rank's failed word is read before a call returns.
        let all: Vec<usize> = (0..self.world_size).filter(|&q| q != rank).collect();
        let store = &mut self.store;
        let Some(side) = self.dev.as_mut() else {
            return Err(Error::InvalidArgument(
                "cuda-ipc: device side missing".into(),
            ));
        };
        if side.order.as_ref().is_some_and(|o| o.broken) {
            return Err(Error::InvalidArgument(
                "cuda-ipc: an earlier call failed with device waits released; these memory \
                 peers take no more calls"
                    .into(),
            ));
        }
        let mapped = if side.order.is_some() {
            &all[..]
        } else {
            peers
        };
        let dev = side.red.device().clone();
        dev.bind()?;
        if side.epoch == 0 || side.ws.len() < bytes {
            // Every rank grows at the same call. Readers of the old workspace are
            // ordered before this point (the executor ordered after them); finish that
            // before freeing it.
            dev.synchronize()?;
            let cap = bytes.next_power_of_two().max(1 << 20);
            side.ws = DeviceAlloc::new(dev.context(), 0)?;
            side.ws = DeviceAlloc::new(dev.context(), cap)?;
            side.epoch += 1;
            let mut value = IpcMemHandle::of(side.ws.ptr())?.0.to_vec();
            value.extend_from_slice(&side.event.handle()?);
            value.push(mode);
            store.set(&key(comm_id, side.epoch, rank), &value)?;
        }
        for &q in mapped {
            let stale = side
                .peers
                .get(&q)
                .is_none_or(|p| p.ws.as_ref().is_none_or(|w| w.0 != side.epoch));
            if !stale {
                continue;
            }
            let (mh, eh) = get_handles(store, comm_id, side.epoch, q, timeout, mode)?;
            let mapping = IpcMapping::open(dev.context(), &mh)?;
            match side.peers.get_mut(&q) {
                Some(p) => {
                    // Dropping the old mapping first: its reads are ordered before us.
                    p.ws = None;
                    p.ws = Some((side.epoch, mapping));
                }
                None => {
                    let counter = ShmSegment::open(&counter_name(comm_id, q), COUNTER_BYTES)?;
                    if let Some(o) = side.order.as_mut() {
                        // SAFETY: the peer's segment is mapped COUNTER_BYTES long here
                        // and outlives the registration (`order` drops first).
                        let reg = unsafe {
                            HostRegistration::new(
                                dev.context(),
                                counter.as_mut_ptr(),
                                COUNTER_BYTES,
                            )?
                        };
                        o.peers.insert(q, reg);
                    }
                    side.peers.insert(
                        q,
                        Peer {
                            event: IpcEvent::open(dev.context(), &eh)?,
                            counter,
                            ws: Some((side.epoch, mapping)),
                        },
                    );
                }
            }
        }
        if let Some(o) = side.order.as_mut() {
            o.call_peers = peers.to_vec();
        }
        self.call = Some(mem.clone());
        Ok(())
    }

    fn copy(&mut self, dst: Region, src: Region, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (d, s) = (self.addr(dst)?, self.addr(src)?);
        if d == s {
            return Ok(());
        }
        let side = self.side()?;
        // SAFETY: both ranges lie in live allocations — the workspaces hold the call's
        // bytes, the user buffers are the caller's (`CallMem`) — and the executor has
        // ordered this copy after every peer access to them.
        unsafe { dtod(side.red.device().stream(), d, s, len) }
    }

    fn combine(
        &mut self,
        dst: Region,
        also: Option<Region>,
        a: Region,
        b: Region,
        len: usize,
        finish: bool,
    ) -> Result<()> {
        let call = self
            .call
            .clone()
            .ok_or_else(|| Error::InvalidArgument("cuda-ipc: no call in progress".into()))?;
        let op = call.op.ok_or_else(|| {
            Error::InvalidArgument("cuda-ipc: combine without an operator".into())
        })?;
        if len == 0 {
            return Ok(());
        }
        let (d, a, b) = (self.addr(dst)?, self.addr(a)?, self.addr(b)?);
        let also = also.map(|r| self.addr(r)).transpose()?;
        let side = self.side()?;
        let (red, stream) = (&side.red, side.red.device().stream());
        let n = len / call.dtype.size();
        let avg = finish && op == ReduceOp::Avg;
        // SAFETY: as in `copy`; `dst` equals `a` or `b` exactly, never partly.
        unsafe {
            match also {
                // Fused receive-reduce-copy: the result goes to the workspace (read next
                // by the consumer) and to the user's output at once.
                Some(o) if !avg => red.reduce_raw(stream, call.dtype, op, d, o, a, b, n),
                _ => {
                    red.reduce_raw(stream, call.dtype, op, d, 0, a, b, n)?;
                    if avg {
                        red.scale_raw(stream, call.dtype, d, n, call.world_size as f64)?;
                    }
                    match also {
                        Some(o) => dtod(stream, o, d, len),
                        None => Ok(()),
                    }
                }
            }
        }
    }

    fn publish(&mut self, value: u64) -> Result<()> {
        let Some(side) = self.dev.as_mut() else {
            return Err(Error::InvalidArgument(
                "cuda-ipc: no device call in progress".into(),
            ));
        };
        side.published = value;
        let stream = side.red.device().stream();
        if let Some(o) = &side.order {
            for q in &o.call_peers {
                let reg = o.peers.get(q).ok_or_else(|| {
                    Error::InvalidArgument(format!("cuda-ipc: rank {q}'s counters are not mapped"))
                })?;
                // SAFETY: a registered page, 4-byte aligned inside it; registrations
                // outlive the stream's work (`Drop` synchronises first).
                unsafe {
                    write_value32(
                        stream,
                        reg.dev_ptr() + inbox_offset(self.rank),
                        value as u32,
                    )?
                };
            }
            return Ok(());
        }
        side.event.record(stream)?;
        side.counter
            .word(PROGRESS_WORD)
            .store(value, Ordering::Release);
        Ok(())
    }

    fn progress(&self, peer: usize) -> u64 {
        let Some(side) = self.dev.as_ref() else {
            return 0;
        };
        if side.order.is_some() {
            let low = side.counter.word(INBOX_WORD + peer).load(Ordering::Acquire) as u32;
            return widen_progress(side.published, low);
        }
        side.peers
            .get(&peer)
            .map_or(0, |p| p.counter.word(PROGRESS_WORD).load(Ordering::Acquire))
    }

    fn order_after(&mut self, peer: usize) -> Result<()> {
        let side = self.side()?;
        if side.order.is_some() {
            // A value a peer's stream wrote covers its work already.
            return Ok(());
        }
        let p = side.peers.get(&peer).ok_or_else(|| {
            Error::InvalidArgument(format!("cuda-ipc: rank {peer} is not a peer of this call"))
        })?;
        p.event.wait_on(side.red.device().stream())
    }

    fn end(&mut self) -> Result<()> {
        self.call = None;
        if self
            .dev
            .as_ref()
            .and_then(|d| d.order.as_ref())
            .is_some_and(|o| o.broken)
        {
            self.drain_released()?;
        }
        self.side()?.red.device().synchronize()
    }

    fn device_order(&self) -> bool {
        self.device_order
    }

    fn wait_for(&mut self, peer: usize, at_least: u64) -> Result<()> {
        let side = self.side()?;
        let o = side.order.as_ref().ok_or_else(|| {
            Error::InvalidArgument("cuda-ipc: a device wait without device order".into())
        })?;
        let addr = o.own.dev_ptr() + inbox_offset(peer);
        // SAFETY: as in `publish`; this rank's own registered page.
        unsafe { wait_value32(side.red.device().stream(), addr, at_least as u32) }
    }

    fn done(&mut self) -> Result<bool> {
        let side = self.side()?;
        side.red.device().bind()?;
        stream_done(side.red.device().stream())
    }

    fn release(&mut self) {
        let Some(side) = self.dev.as_mut() else {
            return;
        };
        let Some(o) = side.order.as_mut() else {
            return;
        };
        o.broken = true;
        // Failed first: what this stream publishes from here on covers unordered work.
        side.counter.word(FAILED_WORD).store(1, Ordering::SeqCst);
        self.pass_every_wait();
    }

    fn failed(&self, peer: usize) -> bool {
        self.dev
            .as_ref()
            .and_then(|d| d.peers.get(&peer))
            .is_some_and(|p| p.counter.word(FAILED_WORD).load(Ordering::Acquire) != 0)
    }
}

impl IpcPeers {
    /// Stores into each of this rank's inbox words a value past every wait still
    /// pending (each within a call of `published`), in the device's cyclic comparison.
    fn pass_every_wait(&self) {
        let Some(side) = self.dev.as_ref() else {
            return;
        };
        let past = u64::from((side.published as u32).wrapping_add(1 << 30));
        for q in 0..self.world_size {
            side.counter
                .word(INBOX_WORD + q)
                .store(past, Ordering::SeqCst);
        }
    }

    /// After [`MemPeers::release`]: waits until the stream has run everything, storing
    /// the passing values again each round, because a peer's stream may still write
    /// its own (smaller) value over one before this stream's wait has read it. Bounded
    /// by the timeout (a stream stuck in a kernel, not a wait, would never finish).
    fn drain_released(&mut self) -> Result<()> {
        let end = Instant::now() + self.timeout;
        loop {
            self.pass_every_wait();
            if self.done()? {
                return Ok(());
            }
            if Instant::now() >= end {
                return Err(Error::Cuda {
                    call: "cuStreamQuery".into(),
                    detail: format!(
                        "rank {}: the device still has work queued {:?} after its waits were \
                         released",
                        self.rank, self.timeout
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for IpcPeers {
    /// Before the workspace is freed, every peer must have finished reading it: wait
    /// (bounded by the timeout) until each has published what this rank last did, and
    /// for its work on the GPU too. Failures are logged, never raised. In device order
    /// only the last call's peers publish to this rank (the others' inbox words stay
    /// where their last common call left them), and only they can have read it.
    fn drop(&mut self) {
        let Some(side) = self.dev.as_ref() else {
            return;
        };
        let end = Instant::now() + self.timeout;
        for (q, p) in &side.peers {
            if side
                .order
                .as_ref()
                .is_some_and(|o| !o.call_peers.contains(q))
            {
                continue;
            }
            while self.progress(*q) < side.published {
                if Instant::now() >= end {
                    tracing::warn!(
                        "cuda-ipc: freeing the workspace without rank {q}'s go-ahead (timeout)"
                    );
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            if side.order.is_none() {
                if let Err(e) = p.event.wait_on(side.red.device().stream()) {
                    tracing::warn!("cuda-ipc: cannot order after rank {q}: {e}");
                }
            }
        }
        if let Err(e) = side.red.device().synchronize() {
            tracing::warn!("cuda-ipc: freeing the workspace without the peers' go-ahead: {e}");
        }
    }
}

/// Rank `rank`'s workspace and event handles at `epoch`, checking that it runs the
/// same order (`mode`: 1 for device order) as this rank.
fn get_handles(
    store: &mut StoreClient,
    comm_id: u64,
    epoch: u64,
    rank: usize,
    timeout: Duration,
    mode: u8,
) -> Result<(IpcMemHandle, [u8; 64])> {
    parse_handles(&store.get(&key(comm_id, epoch, rank), timeout)?, rank, mode)
}

/// What rank `rank` stored: its workspace handle, its event handle and its order.
fn parse_handles(v: &[u8], rank: usize, mode: u8) -> Result<(IpcMemHandle, [u8; 64])> {
    if v.len() != 129 {
        return Err(Error::Rendezvous(format!(
            "cuda-ipc handles of rank {rank}: expected 129 bytes, got {}",
            v.len()
        )));
    }
    if v[128] != mode {
        let name = |m: u8| if m == 1 { "device" } else { "host" };
        return Err(Error::Config(format!(
            "rank {rank} runs cuda-ipc with FERROCCL_CUDA_ORDER={}, this rank with {}: every \
             rank must set the same",
            name(v[128]),
            name(mode)
        )));
    }
    let mut m = [0u8; 64];
    let mut e = [0u8; 64];
    m.copy_from_slice(&v[..64]);
    e.copy_from_slice(&v[64..128]);
    Ok((IpcMemHandle(m), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handles come back as stored; a rank in the other order, or a record of
    /// another length (an older binary's), is refused naming what differs.
    #[test]
    fn handles_carry_the_order_and_a_disagreement_is_refused() {
        let mut v: Vec<u8> = (0..128).map(|i| i as u8).collect();
        v.push(1);
        let (m, e) = parse_handles(&v, 3, 1).unwrap();
        assert_eq!((m.0[5], e[5]), (5, 69));
        let err = parse_handles(&v, 3, 0).unwrap_err().to_string();
        assert!(
            err.contains("rank 3")
                && err.contains("FERROCCL_CUDA_ORDER=device")
                && err.contains("this rank with host"),
            "{err}"
        );
        let err = parse_handles(&v[..128], 3, 0).unwrap_err().to_string();
        assert!(err.contains("expected 129 bytes, got 128"), "{err}");
    }

    /// Inbox words fit the page, one per rank up to the limit.
    #[test]
    fn inboxes_fit_one_page() {
        assert_eq!(inbox_offset(0), (INBOX_WORD * 8) as u64);
        assert!(inbox_offset(MAX_INBOXES - 1) + 8 <= COUNTER_BYTES as u64);
    }
}
