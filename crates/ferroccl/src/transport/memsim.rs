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
//! [`group`] links `n` ranks: in-process pipes for fingerprints, status queries and
//! point-to-point, plus these memory peers, which read host buffers (so the host
//! collectives run on the pull executor).

use super::{local, CallMem, Links, MemPeers, Region};
use crate::error::{Error, Result};
use crate::reduce::{kernels, ReduceOp};
use crate::sync::{lock, wait, wait_timeout_while};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl Default for SimMemParams {
    fn default() -> Self {
        SimMemParams {
            max_delay: Duration::from_micros(200),
            seed: 1,
            stall: None,
        }
    }
}

/// One rank's shared state.
#[derive(Default)]
struct Slot {
    /// The workspace, as u64 words (aligned for every element type).
    ws: Mutex<Vec<u64>>,
    /// Published progress.
    counter: AtomicU64,
    /// Event records enqueued so far (the latest record's number).
    records: AtomicU64,
    /// Event records the stream has executed.
    completed: AtomicU64,
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
    /// Signals that everything before it has run.
    Flush(Arc<(Mutex<bool>, Condvar)>),
    Stop,
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    /// The first failure of an operation (reported at the next `end`).
    failed: Option<String>,
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
        lock(q).ops.push_back(op);
        cv.notify_all();
    }
}

/// Reads `len` bytes at `l` into aligned words.
fn read(f: &Fabric, l: Loc, len: usize) -> Vec<u64> {
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
            dst.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&ws)[off..off + len]);
        }
    }
    v
}

fn write(f: &Fabric, l: Loc, src: &[u8]) {
    match l {
        Loc::User(addr) => {
            // SAFETY: as in `read`; the call's buffers are writable for its length.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, src.len()) };
            dst.copy_from_slice(src);
        }
        Loc::Ws(r, off) => {
            let mut ws = lock(&f.slots[r].ws);
            bytemuck::cast_slice_mut::<u64, u8>(&mut ws)[off..off + src.len()].copy_from_slice(src);
        }
    }
}

fn run_op(f: &Fabric, op: Op) -> std::result::Result<(), String> {
    match op {
        Op::Copy { dst, src, len } => {
            let v = read(f, src, len);
            write(f, dst, &bytemuck::cast_slice::<u64, u8>(&v)[..len]);
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
            let (mut x, y) = (read(f, a, len), read(f, b, len));
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
            write(f, dst, xb);
            if let Some(o) = also {
                write(f, o, xb);
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
        // Run by the stream loop itself, which knows its rank.
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
                if let Err(e) = run_op(&f, op) {
                    lock(&q.0).failed.get_or_insert(e);
                }
            }
        }
    }
}

impl MemPeers for SimMem {
    fn host_memory(&self) -> bool {
        true
    }

    fn begin(&mut self, mem: &CallMem, bytes: usize, _peers: &[usize]) -> Result<()> {
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
        let slot = &self.fabric.slots[self.rank];
        let id = slot.records.fetch_add(1, Ordering::AcqRel) + 1;
        self.push(Op::Record(id));
        slot.counter.store(value, Ordering::Release);
        Ok(())
    }

    fn progress(&self, peer: usize) -> u64 {
        self.fabric.slots[peer].counter.load(Ordering::Acquire)
    }

    fn order_after(&mut self, peer: usize) -> Result<()> {
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
        slots: (0..n).map(|_| Slot::default()).collect(),
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
            })))
        })
        .collect()
}
