//! Memory peers over host memory shared by threads, with a GPU stream's timing: the
//! pull executor's test bed (what CUDA IPC runs on a GPU, this runs anywhere).
//!
//! Each rank has a workspace every other rank can read, a progress counter, and a
//! *stream*: a thread that executes the rank's enqueued copies and combines in order,
//! each after a random delay, so work completes long after it was enqueued — as on a
//! GPU. Publishing a counter value enqueues an *event record* first (as `cuEventRecord`
//! then a counter store does); ordering after a peer enqueues a wait for the peer's
//! latest record (as `cuStreamWaitEvent`). An executor that publishes before its work,
//! or reads a peer without ordering after it, reads stale bytes here and computes a
//! wrong result — which the tests check bit for bit.
//!
//! With [`SimMemParams::device_order`] the peers model stream memory operations
//! instead ([`MemPeers::device_order`]): a publish enqueues a write of the value's low
//! 32 bits into each peer's *inbox* word for this rank, run by the stream once the work
//! before it has; a wait is an operation of the stream that holds it until this rank's
//! inbox word for the peer reaches the value (compared cyclically, as a GPU's `GEQ`
//! wait does), or until [`MemPeers::release`] lets every wait pass. Nothing orders
//! through records then: a rank reads a peer only once the peer's stream has written
//! the value after the work it covers.
//!
//! [`group`] links `n` ranks: in-process pipes for fingerprints, status queries and
//! point-to-point, plus these memory peers, which read host buffers (so the host
//! collectives run on the pull executor).

use super::{local, reached, widen_progress, CallMem, Links, MemPeers, Region};
use crate::error::{Error, Result};
use crate::reduce::{kernels, ReduceOp};
use crate::sync::{lock, wait, wait_timeout_while};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How a simulated stream is paced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimMemParams {
    /// Each operation waits a random time up to this before it runs.
    pub max_delay: Duration,
    /// Seed of the delays (rank `r` uses `seed + r`).
    pub seed: u64,
    /// `(rank, how long)`: that rank stops this long at the start of its first call,
    /// after the fingerprints were exchanged and before it publishes anything (to test
    /// waits on a peer that does not come).
    pub stall: Option<(usize, Duration)>,
    /// Device order (the module docs): waits and published values run on the stream.
    pub device_order: bool,
}

impl Default for SimMemParams {
    fn default() -> Self {
        SimMemParams {
            max_delay: Duration::from_micros(200),
            seed: 1,
            stall: None,
            device_order: false,
        }
    }
}

/// One rank's shared state.
struct Slot {
    /// The workspace, as u64 words (aligned for every element type).
    ws: Mutex<Vec<u64>>,
    /// Published progress.
    counter: AtomicU64,
    /// Event records enqueued so far (the latest record's number).
    records: AtomicU64,
    /// Event records the stream has executed.
    completed: AtomicU64,
    /// Device order: what each rank last published to this one (low 32 bits).
    inbox: Vec<AtomicU32>,
    /// Device order: every wait of this rank's stream passes ([`MemPeers::release`]).
    released: AtomicBool,
}

impl Slot {
    fn new(n: usize) -> Self {
        Slot {
            ws: Mutex::default(),
            counter: AtomicU64::new(0),
            records: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            inbox: (0..n).map(|_| AtomicU32::new(0)).collect(),
            released: AtomicBool::new(false),
        }
    }
}

struct Fabric {
    slots: Vec<Slot>,
    /// Rung whenever a stream completes a record.
    bell: Mutex<u64>,
    cv: Condvar,
}

/// Where an operation's bytes are, resolved when the call starts.
#[derive(Clone, Copy)]
enum Loc {
    /// User memory (the call's input or output), by address.
    User(u64),
    /// Rank `.0`'s workspace at byte `.1`.
    Ws(usize, usize),
}

enum Op {
    Copy {
        dst: Loc,
        src: Loc,
        len: usize,
    },
    Combine {
        dst: Loc,
        also: Option<Loc>,
        a: Loc,
        b: Loc,
        len: usize,
        finish: bool,
        call: CallMem,
    },
    Record(u64),
    Wait {
        peer: usize,
        record: u64,
    },
    /// Device order: `value` into the inbox word for this rank of each of `to`.
    WriteValue {
        to: Vec<usize>,
        value: u32,
    },
    /// Device order: holds the stream until this rank's inbox word for `peer` reaches
    /// `at_least` (or the waits are released).
    WaitValue {
        peer: usize,
        at_least: u64,
    },
    /// Signals that everything before it has run.
    Flush(Arc<(Mutex<bool>, Condvar)>),
    Stop,
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    /// The first failure of an operation (reported at the next `end`).
    failed: Option<String>,
    /// Operations enqueued, and run by the stream: equal once it has drained.
    pushed: u64,
    ran: u64,
}

/// One rank's memory peers over the simulated fabric.
pub(crate) struct SimMem {
    rank: usize,
    fabric: Arc<Fabric>,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    stream: Option<std::thread::JoinHandle<()>>,
    call: Option<CallMem>,
    /// A stall still to come at the next `begin`.
    stall: Option<Duration>,
    /// Device order (module docs).
    device: bool,
    /// Device order: the peers of the call in progress (where a publish goes).
    peers: Vec<usize>,
    /// Device order: the last value published (anchors peers' 32-bit progress).
    published: u64,
    /// Device order: the waits were released; every later call is refused.
    broken: bool,
}

impl SimMem {
    fn loc(&self, r: Region) -> Result<Loc> {
        let call = self
            .call
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("memsim: no call in progress".into()))?;
        Ok(match r {
            Region::Input(off) => Loc::User(call.input + off as u64),
            Region::Output(off) => Loc::User(call.output + off as u64),
            Region::Mine(off) => Loc::Ws(self.rank, off),
            Region::Peer(q, off) => Loc::Ws(q, off),
        })
    }

    fn push(&self, op: Op) {
        let (q, cv) = &*self.queue;
        let mut g = lock(q);
        g.ops.push_back(op);
        g.pushed += 1;
        drop(g);
        cv.notify_all();
    }
}

/// Workspace bytes `off..off + len` of `ws`, or why not (a stream that reads a peer's
/// workspace before the peer has grown it: after a release, or an executor's bug).
fn ws_range(
    ws: &[u64],
    r: usize,
    off: usize,
    len: usize,
) -> std::result::Result<Range<usize>, String> {
    let have = ws.len() * 8;
    match off.checked_add(len) {
        Some(end) if end <= have => Ok(off..end),
        _ => Err(format!(
            "memsim: bytes {off}..+{len} of rank {r}'s workspace, which holds {have}"
        )),
    }
}

/// Reads `len` bytes at `l` into aligned words.
fn read(f: &Fabric, l: Loc, len: usize) -> std::result::Result<Vec<u64>, String> {
    let mut v = vec![0u64; len.div_ceil(8)];
    let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..len];
    match l {
        Loc::User(addr) => {
            // SAFETY: user addresses come from the call's buffers, which the caller
            // keeps valid and untouched until `end` has seen this operation run.
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            dst.copy_from_slice(src);
        }
        Loc::Ws(r, off) => {
            let ws = lock(&f.slots[r].ws);
            let at = ws_range(&ws, r, off, len)?;
            dst.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&ws)[at]);
        }
    }
    Ok(v)
}

fn write(f: &Fabric, l: Loc, src: &[u8]) -> std::result::Result<(), String> {
    match l {
        Loc::User(addr) => {
            // SAFETY: as in `read`; the call's buffers are writable for its length.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, src.len()) };
            dst.copy_from_slice(src);
        }
        Loc::Ws(r, off) => {
            let mut ws = lock(&f.slots[r].ws);
            let at = ws_range(&ws, r, off, src.len())?;
            bytemuck::cast_slice_mut::<u64, u8>(&mut ws)[at].copy_from_slice(src);
        }
    }
    Ok(())
}

fn run_op(f: &Fabric, rank: usize, op: Op) -> std::result::Result<(), String> {
    match op {
        Op::Copy { dst, src, len } => {
            let v = read(f, src, len)?;
            write(f, dst, &bytemuck::cast_slice::<u64, u8>(&v)[..len])?;
        }
        Op::Combine {
            dst,
            also,
            a,
            b,
            len,
            finish,
            call,
        } => {
            let op = call.op.ok_or("memsim: combine without an operator")?;
            let (mut x, y) = (read(f, a, len)?, read(f, b, len)?);
            let xb = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut x)[..len];
            kernels::reduce_bytes(
                call.dtype,
                op,
                xb,
                &bytemuck::cast_slice::<u64, u8>(&y)[..len],
            );
            if finish && op == ReduceOp::Avg {
                kernels::scale_bytes(call.dtype, xb, call.world_size);
            }
            write(f, dst, xb)?;
            if let Some(o) = also {
                write(f, o, xb)?;
            }
        }
        Op::Wait { peer, record } => {
            let g = lock(&f.bell);
            drop(wait_timeout_while(
                &f.cv,
                g,
                Duration::from_secs(3600),
                |_| f.slots[peer].completed.load(Ordering::Acquire) < record,
            ));
        }
        Op::WriteValue { to, value } => {
            for q in to {
                f.slots[q].inbox[rank].store(value, Ordering::Release);
            }
            *lock(&f.bell) += 1;
            f.cv.notify_all();
        }
        Op::WaitValue { peer, at_least } => {
            let me = &f.slots[rank];
            let g = lock(&f.bell);
            drop(wait_timeout_while(
                &f.cv,
                g,
                Duration::from_secs(3600),
                |_| {
                    !me.released.load(Ordering::Acquire)
                        && !reached(me.inbox[peer].load(Ordering::Acquire), at_least)
                },
            ));
        }
        // Run by the stream loop itself.
        Op::Record(_) | Op::Flush(_) | Op::Stop => {}
    }
    Ok(())
}

/// The stream of rank `rank`: runs operations in order, each after a random delay.
fn stream(rank: usize, f: Arc<Fabric>, q: Arc<(Mutex<Queue>, Condvar)>, p: SimMemParams) {
    let mut rng = p
        .seed
        .wrapping_add(rank as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        | 1;
    loop {
        let op = {
            let mut g = lock(&q.0);
            loop {
                if let Some(op) = g.ops.pop_front() {
                    break op;
                }
                g = wait(&q.1, g);
            }
        };
        // xorshift64*: a delay in 0..max_delay.
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        let r = rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let max = p.max_delay.as_nanos() as u64;
        if max > 0 {
            std::thread::sleep(Duration::from_nanos(r % max));
        }
        match op {
            Op::Stop => return,
            Op::Flush(done) => {
                *lock(&done.0) = true;
                done.1.notify_all();
            }
            Op::Record(id) => {
                f.slots[rank].completed.fetch_max(id, Ordering::AcqRel);
                *lock(&f.bell) += 1;
                f.cv.notify_all();
            }
            op => {
                if let Err(e) = run_op(&f, rank, op) {
                    lock(&q.0).failed.get_or_insert(e);
                }
            }
        }
        lock(&q.0).ran += 1;
    }
}

impl MemPeers for SimMem {
    fn host_memory(&self) -> bool {
        true
    }

    fn begin(&mut self, mem: &CallMem, bytes: usize, peers: &[usize]) -> Result<()> {
        if self.broken {
            return Err(Error::InvalidArgument(
                "memsim: an earlier call failed with device waits released; these memory \
                 peers take no more calls"
                    .into(),
            ));
        }
        if mem.space != 0 {
            return Err(Error::InvalidArgument(format!(
                "memsim: memory space {} is not host memory",
                mem.space
            )));
        }
        if let Some(d) = self.stall.take() {
            std::thread::sleep(d);
        }
        let words = bytes.div_ceil(8);
        let grow = lock(&self.fabric.slots[self.rank].ws).len() < words;
        if grow {
            // Readers of the old workspace are ordered before this point (the executor
            // ordered after them); let the stream reach it before reallocating.
            self.drain()?;
            lock(&self.fabric.slots[self.rank].ws).resize(words, 0);
        }
        self.call = Some(mem.clone());
        self.peers = peers.to_vec();
        Ok(())
    }

    fn copy(&mut self, dst: Region, src: Region, len: usize) -> Result<()> {
        let (dst, src) = (self.loc(dst)?, self.loc(src)?);
        if len > 0 {
            self.push(Op::Copy { dst, src, len });
        }
        Ok(())
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
            .ok_or_else(|| Error::InvalidArgument("memsim: no call in progress".into()))?;
        let op = Op::Combine {
            dst: self.loc(dst)?,
            also: also.map(|r| self.loc(r)).transpose()?,
            a: self.loc(a)?,
            b: self.loc(b)?,
            len,
            finish,
            call,
        };
        if len > 0 {
            self.push(op);
        }
        Ok(())
    }

    fn publish(&mut self, value: u64) -> Result<()> {
        if self.device {
            self.published = value;
            self.push(Op::WriteValue {
                to: self.peers.clone(),
                value: value as u32,
            });
            return Ok(());
        }
        let slot = &self.fabric.slots[self.rank];
        let id = slot.records.fetch_add(1, Ordering::AcqRel) + 1;
        self.push(Op::Record(id));
        slot.counter.store(value, Ordering::Release);
        Ok(())
    }

    fn progress(&self, peer: usize) -> u64 {
        if self.device {
            let low = self.fabric.slots[self.rank].inbox[peer].load(Ordering::Acquire);
            return widen_progress(self.published, low);
        }
        self.fabric.slots[peer].counter.load(Ordering::Acquire)
    }

    fn order_after(&mut self, peer: usize) -> Result<()> {
        if self.device {
            // A value a peer's stream wrote covers its work already.
            return Ok(());
        }
        // Read after the counter the caller has seen: at least the record published
        // with it.
        let record = self.fabric.slots[peer].records.load(Ordering::Acquire);
        self.push(Op::Wait { peer, record });
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        self.drain()?;
        self.call = None;
        Ok(())
    }

    fn device_order(&self) -> bool {
        self.device
    }

    fn wait_for(&mut self, peer: usize, at_least: u64) -> Result<()> {
        self.push(Op::WaitValue { peer, at_least });
        Ok(())
    }

    fn done(&mut self) -> Result<bool> {
        let g = lock(&self.queue.0);
        Ok(g.ran == g.pushed)
    }

    fn failed(&self, peer: usize) -> bool {
        self.fabric.slots[peer].released.load(Ordering::Acquire)
    }

    fn release(&mut self) {
        self.broken = true;
        self.fabric.slots[self.rank]
            .released
            .store(true, Ordering::Release);
        *lock(&self.fabric.bell) += 1;
        self.fabric.cv.notify_all();
    }
}

impl SimMem {
    /// Waits until the stream has run everything enqueued; reports its first failure.
    fn drain(&mut self) -> Result<()> {
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        self.push(Op::Flush(done.clone()));
        let mut g = lock(&done.0);
        while !*g {
            g = wait(&done.1, g);
        }
        match lock(&self.queue.0).failed.take() {
            Some(e) => Err(Error::InvalidArgument(e)),
            None => Ok(()),
        }
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        self.push(Op::Stop);
        if let Some(h) = self.stream.take() {
            let _ = h.join();
        }
    }
}

/// Links for `n` ranks as threads: in-process pipes, plus memory peers over host
/// memory paced by `p`.
pub fn group(n: usize, p: SimMemParams) -> Result<Vec<Links>> {
    let fabric = Arc::new(Fabric {
        slots: (0..n).map(|_| Slot::new(n)).collect(),
        bell: Mutex::new(0),
        cv: Condvar::new(),
    });
    local::group(n, local::PIPE_CAPACITY)
        .into_iter()
        .enumerate()
        .map(|(r, links)| {
            let queue = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
            let (f, q) = (fabric.clone(), queue.clone());
            let stream = std::thread::Builder::new()
                .name(format!("memsim-stream{r}"))
                .spawn(move || stream(r, f, q, p))
                .map_err(|e| Error::io("starting a simulated stream", e))?;
            Ok(links.with_memory(Box::new(SimMem {
                rank: r,
                fabric: fabric.clone(),
                queue,
                stream: Some(stream),
                call: None,
                stall: p.stall.filter(|&(rank, _)| rank == r).map(|(_, d)| d),
                device: p.device_order,
                peers: Vec::new(),
                published: 0,
                broken: false,
            })))
        })
        .collect()
}
