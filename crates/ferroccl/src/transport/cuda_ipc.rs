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

use super::{tcp, CallMem, Joined, Links, MemPeers, Region, Transport};
use crate::config::Config;
use crate::cuda::ipc::{IpcEvent, IpcMapping, IpcMemHandle};
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
        let peers = IpcPeers {
            store,
            comm_id: job.comm_id,
            rank: job.rank(),
            timeout: job.config.tuning.timeout,
            dev: None,
            call: None,
        };
        Ok(tcp::endpoint(tcp::ConnectCtx::of(job))?.with_memory(Box::new(peers)))
    }
}

/// Bytes of a progress-counter segment.
const COUNTER_BYTES: usize = 64;

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

/// This rank's device side, built at the first device call on the buffer's device.
struct DeviceSide {
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
    timeout: Duration,
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
        self.dev = Some(DeviceSide {
            ws: DeviceAlloc::new(&ctx, 0)?,
            epoch: 0,
            event: IpcEvent::new(&ctx)?,
            counter: ShmSegment::create(&counter_name(self.comm_id, self.rank), COUNTER_BYTES)?,
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
        let store = &mut self.store;
        let Some(side) = self.dev.as_mut() else {
            return Err(Error::InvalidArgument(
                "cuda-ipc: device side missing".into(),
            ));
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
            store.set(&key(comm_id, side.epoch, rank), &value)?;
        }
        for &q in peers {
            let stale = side
                .peers
                .get(&q)
                .is_none_or(|p| p.ws.as_ref().is_none_or(|w| w.0 != side.epoch));
            if !stale {
                continue;
            }
            let (mh, eh) = get_handles(store, comm_id, side.epoch, q, timeout)?;
            let mapping = IpcMapping::open(dev.context(), &mh)?;
            match side.peers.get_mut(&q) {
                Some(p) => {
                    // Dropping the old mapping first: its reads are ordered before us.
                    p.ws = None;
                    p.ws = Some((side.epoch, mapping));
                }
                None => {
                    side.peers.insert(
                        q,
                        Peer {
                            event: IpcEvent::open(dev.context(), &eh)?,
                            counter: ShmSegment::open(&counter_name(comm_id, q), COUNTER_BYTES)?,
                            ws: Some((side.epoch, mapping)),
                        },
                    );
                }
            }
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
        side.event.record(side.red.device().stream())?;
        side.counter.word(0).store(value, Ordering::Release);
        side.published = value;
        Ok(())
    }

    fn progress(&self, peer: usize) -> u64 {
        self.dev
            .as_ref()
            .and_then(|d| d.peers.get(&peer))
            .map_or(0, |p| p.counter.word(0).load(Ordering::Acquire))
    }

    fn order_after(&mut self, peer: usize) -> Result<()> {
        let side = self.side()?;
        let p = side.peers.get(&peer).ok_or_else(|| {
            Error::InvalidArgument(format!("cuda-ipc: rank {peer} is not a peer of this call"))
        })?;
        p.event.wait_on(side.red.device().stream())
    }

    fn end(&mut self) -> Result<()> {
        self.call = None;
        self.side()?.red.device().synchronize()
    }
}

impl Drop for IpcPeers {
    /// Before the workspace is freed, every peer must have finished reading it: wait
    /// (bounded by the timeout) until each has published what this rank last did, and
    /// for its work on the GPU too. Failures are logged, never raised.
    fn drop(&mut self) {
        let Some(side) = self.dev.as_ref() else {
            return;
        };
        let end = Instant::now() + self.timeout;
        for (q, p) in &side.peers {
            while p.counter.word(0).load(Ordering::Acquire) < side.published {
                if Instant::now() >= end {
                    tracing::warn!(
                        "cuda-ipc: freeing the workspace without rank {q}'s go-ahead (timeout)"
                    );
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            if let Err(e) = p.event.wait_on(side.red.device().stream()) {
                tracing::warn!("cuda-ipc: cannot order after rank {q}: {e}");
            }
        }
        if let Err(e) = side.red.device().synchronize() {
            tracing::warn!("cuda-ipc: freeing the workspace without the peers' go-ahead: {e}");
        }
    }
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
