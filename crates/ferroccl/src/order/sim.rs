//! A simulated device for the ordering protocol ([`super::DeviceOp`]): what a GPU and
//! PyTorch's caching allocator do to a collective's buffers, run anywhere.
//!
//! - **Streams** are threads that run their queued work in order, each piece after a
//!   random delay, so work completes long after it was queued (as on a GPU). Work is
//!   a [`Kernel`] (reads blocks, possibly expecting a value; writes values), an event
//!   record, a wait for an event, or a sleep.
//! - **Events** complete when their stream reaches them; a stream waiting for one
//!   stops until it has.
//! - **Memory** is blocks of one `u64` each, handed out by a caching allocator with
//!   torch's rules: a freed block goes back to the pool of the stream it was allocated
//!   on and is handed out again at once to the next allocation on that stream — unless
//!   it was used on other streams (`record_stream`), in which case it waits until those
//!   streams have passed the point where it was freed.
//!
//! What it checks, as **violations** ([`SimDevice::violations`]): a kernel that reads a
//! value other than the one it expects (it ran before its producer, or after someone
//! overwrote the block); a block handed out again while another stream still has
//! queued work on it (released early); work queued on a block its owner released, or
//! run after a later owner's work on it; a double free. Every check is exact: no violation depends on timing except
//! through the order in which work really ran.

use super::{StreamId, Streams};
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout_while};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the simulated streams are paced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimParams {
    /// Each kernel and event record waits a random time up to this before it runs.
    pub max_delay: Duration,
    /// Seed of the delays (each stream mixes in its id).
    pub seed: u64,
}

impl Default for SimParams {
    fn default() -> Self {
        SimParams {
            max_delay: Duration::from_micros(200),
            seed: 1,
        }
    }
}

/// A block of simulated device memory as one owner holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimBuf {
    id: usize,
    epoch: u64,
}

impl SimBuf {
    /// The block's index in the simulated memory (the same for every owner of it).
    pub fn block(&self) -> usize {
        self.id
    }
}

/// An event recorded on a simulated stream.
#[derive(Debug)]
pub struct SimEvent(usize);

/// Work on a simulated stream: reads (each may expect a value), then writes.
#[derive(Clone, Debug, Default)]
pub struct Kernel {
    name: String,
    reads: Vec<(SimBuf, Option<u64>)>,
    writes: Vec<(SimBuf, u64)>,
    capture: Option<Arc<Mutex<Vec<u64>>>>,
}

impl Kernel {
    /// A kernel named `name` (violations name it).
    pub fn new(name: impl Into<String>) -> Self {
        Kernel {
            name: name.into(),
            ..Kernel::default()
        }
    }

    /// Reads `b`; with `expect`, anything else is a violation.
    pub fn read(mut self, b: SimBuf, expect: Option<u64>) -> Self {
        self.reads.push((b, expect));
        self
    }

    /// Writes `value` into `b` (after the reads).
    pub fn write(mut self, b: SimBuf, value: u64) -> Self {
        self.writes.push((b, value));
        self
    }

    /// Appends the values read, in order, to `to` when the kernel runs (a copy to the
    /// host: read `to` once an event recorded after the kernel completed).
    pub fn capture(mut self, to: Arc<Mutex<Vec<u64>>>) -> Self {
        self.capture = Some(to);
        self
    }

    fn blocks(&self) -> Vec<SimBuf> {
        let mut v: Vec<SimBuf> = self.reads.iter().map(|r| r.0).collect();
        v.extend(self.writes.iter().map(|w| w.0));
        v.sort_by_key(|b| (b.id, b.epoch));
        v.dedup();
        v
    }
}

enum Op {
    Kernel(Kernel),
    Record(usize),
    Wait(usize),
    Sleep(Duration),
    Hold(Gate),
}

/// A stream stopped until the host opens the gate ([`SimDevice::hold`]): work queued
/// behind it is as late as a test wants, on any machine.
#[derive(Clone, Debug, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    /// Lets the stream go on.
    pub fn open(&self) {
        *lock(&self.0 .0) = true;
        self.0 .1.notify_all();
    }

    fn pass(&self, shared: &Shared) {
        let mut open = lock(&self.0 .0);
        while !*open && !lock(&shared.st).stop {
            open = wait_timeout_while(&self.0 .1, open, Duration::from_millis(50), |o| !*o);
        }
    }
}

struct Block {
    value: u64,
    epoch: u64,
    /// The stream it was allocated on (its pool).
    stream: u64,
    free: bool,
    /// Other streams it was used on (`record_stream`).
    uses: Vec<u64>,
    /// Events on those streams, recorded when it was freed: reusable once all ran.
    reuse_after: Vec<usize>,
    /// Queued, not yet run, kernels touching it, by stream.
    pending: HashMap<u64, usize>,
    /// The latest owner (epoch) whose work on it ran.
    ran_epoch: u64,
}

#[derive(Default)]
struct State {
    blocks: Vec<Block>,
    /// Per stream, its free blocks, the latest freed last.
    pools: HashMap<u64, Vec<usize>>,
    events: Vec<bool>,
    queues: HashMap<u64, VecDeque<Op>>,
    busy: HashMap<u64, bool>,
    /// Streams stopped at a gate or a wait for an event that has not completed.
    blocked: HashMap<u64, bool>,
    threads: Vec<JoinHandle<()>>,
    violations: Vec<String>,
    stop: bool,
}

struct Shared {
    st: Mutex<State>,
    cv: Condvar,
    params: SimParams,
}

/// The simulated device (module docs). Streams are made on first use.
pub struct SimDevice {
    shared: Arc<Shared>,
}

/// How long anything here waits before calling it a hang (a violation).
const HANG: Duration = Duration::from_secs(120);

impl SimDevice {
    /// A device whose streams are paced by `params`.
    pub fn new(params: SimParams) -> Arc<Self> {
        Arc::new(SimDevice {
            shared: Arc::new(Shared {
                st: Mutex::new(State::default()),
                cv: Condvar::new(),
                params,
            }),
        })
    }

    fn push(&self, stream: StreamId, op: Op) {
        let s = stream.0;
        let mut st = lock(&self.shared.st);
        if let std::collections::hash_map::Entry::Vacant(e) = st.queues.entry(s) {
            e.insert(VecDeque::new());
            let shared = self.shared.clone();
            match std::thread::Builder::new()
                .name(format!("sim-stream-{s}"))
                .spawn(move || run_stream(&shared, s))
            {
                Ok(h) => st.threads.push(h),
                Err(e) => st.violations.push(format!("cannot start stream {s}: {e}")),
            }
        }
        if let Op::Kernel(k) = &op {
            for b in k.blocks() {
                match st.blocks.get_mut(b.id) {
                    Some(blk) if blk.epoch == b.epoch && !blk.free => {
                        *blk.pending.entry(s).or_default() += 1;
                    }
                    _ => {
                        let v = format!(
                            "{} queued on stream {s} uses block {} after its owner released it",
                            k.name, b.id
                        );
                        st.violations.push(v);
                    }
                }
            }
        }
        if let Some(q) = st.queues.get_mut(&s) {
            q.push_back(op);
        }
        self.shared.cv.notify_all();
    }

    /// Queues `k` on `stream`.
    pub fn launch(&self, stream: StreamId, k: Kernel) {
        self.push(stream, Op::Kernel(k));
    }

    /// Queues a sleep of `d` on `stream` (a long kernel that touches nothing).
    pub fn sleep(&self, stream: StreamId, d: Duration) {
        self.push(stream, Op::Sleep(d));
    }

    /// Stops `stream` at this point of its queue until the returned gate is opened.
    pub fn hold(&self, stream: StreamId) -> Gate {
        let g = Gate::default();
        self.push(stream, Op::Hold(g.clone()));
        g
    }

    /// A block for work on `stream` (torch's `empty` on that stream): a freed block of
    /// its pool that may be reused, else a new one. Reusing a block that another
    /// stream still has queued work on is a violation.
    pub fn alloc(&self, stream: StreamId) -> SimBuf {
        let s = stream.0;
        let mut st = lock(&self.shared.st);
        let st = &mut *st;
        let pool = st.pools.entry(s).or_default();
        let events = &st.events;
        let pick = pool.iter().rposition(|&id| {
            st.blocks[id]
                .reuse_after
                .iter()
                .all(|&e| events.get(e).copied().unwrap_or(false))
        });
        if let Some(i) = pick {
            let id = pool.remove(i);
            let blk = &mut st.blocks[id];
            let busy: Vec<u64> = blk
                .pending
                .iter()
                .filter(|&(&q, &n)| q != s && n > 0)
                .map(|(&q, _)| q)
                .collect();
            if !busy.is_empty() {
                st.violations.push(format!(
                    "block {id} handed out again on stream {s} while stream(s) {busy:?} still \
                     have queued work on it (released early)"
                ));
            }
            blk.epoch += 1;
            blk.free = false;
            blk.uses.clear();
            blk.reuse_after.clear();
            return SimBuf {
                id,
                epoch: blk.epoch,
            };
        }
        st.blocks.push(Block {
            value: 0,
            epoch: 1,
            stream: s,
            free: false,
            uses: Vec::new(),
            reuse_after: Vec::new(),
            pending: HashMap::new(),
            ran_epoch: 0,
        });
        SimBuf {
            id: st.blocks.len() - 1,
            epoch: 1,
        }
    }

    /// Marks `b` as used on `stream` (torch's `record_stream`): when freed, it is not
    /// handed out again before `stream` has passed that point.
    pub fn record_stream(&self, b: SimBuf, stream: StreamId) {
        let mut st = lock(&self.shared.st);
        let blk = &mut st.blocks[b.id];
        if blk.epoch == b.epoch && blk.stream != stream.0 && !blk.uses.contains(&stream.0) {
            blk.uses.push(stream.0);
        }
    }

    /// Gives `b` back to the allocator (the owner drops its tensor).
    pub fn free(&self, b: SimBuf) {
        let uses = {
            let mut st = lock(&self.shared.st);
            let blk = &st.blocks[b.id];
            if blk.epoch != b.epoch || blk.free {
                let v = format!("block {} freed twice (or by a former owner)", b.id);
                st.violations.push(v);
                return;
            }
            blk.uses.clone()
        };
        let after: Vec<usize> = uses
            .into_iter()
            .map(|s| self.record_raw(StreamId(s)))
            .collect();
        let mut st = lock(&self.shared.st);
        let blk = &mut st.blocks[b.id];
        blk.reuse_after = after;
        blk.free = true;
        let pool = blk.stream;
        st.pools.entry(pool).or_default().push(b.id);
    }

    fn record_raw(&self, stream: StreamId) -> usize {
        let id = {
            let mut st = lock(&self.shared.st);
            st.events.push(false);
            st.events.len() - 1
        };
        self.push(stream, Op::Record(id));
        id
    }

    /// Blocks the host until `e` completed (a violation after two minutes).
    pub fn host_wait(&self, e: &SimEvent) -> Result<()> {
        let st = lock(&self.shared.st);
        let start = Instant::now();
        let mut st = wait_timeout_while(&self.shared.cv, st, HANG, |st| {
            !st.events.get(e.0).copied().unwrap_or(true) && !st.stop
        });
        if !st.events.get(e.0).copied().unwrap_or(true) {
            let v = format!("the host waited {:?} for event {}", start.elapsed(), e.0);
            st.violations.push(v.clone());
            return Err(Error::Timeout {
                rank: 0,
                op: "sim host wait".into(),
                after: start.elapsed(),
                waiting_for: v,
                peers: String::new(),
            });
        }
        Ok(())
    }

    /// Waits until every stream has run everything queued on it.
    pub fn drain(&self) {
        let st = lock(&self.shared.st);
        let mut st = wait_timeout_while(&self.shared.cv, st, HANG, |st| {
            !st.stop && (st.queues.values().any(|q| !q.is_empty()) || st.busy.values().any(|&b| b))
        });
        if st.queues.values().any(|q| !q.is_empty()) {
            st.violations
                .push("the streams did not drain within two minutes".into());
        }
    }

    /// Waits until `stream` has nothing left it can run now: its queue is empty, or it
    /// is stopped at a gate or a wait for an event that has not completed.
    pub fn quiesce(&self, stream: StreamId) {
        let s = stream.0;
        let st = lock(&self.shared.st);
        drop(wait_timeout_while(&self.shared.cv, st, HANG, |st| {
            let idle = st.queues.get(&s).is_none_or(|q| q.is_empty())
                && !st.busy.get(&s).copied().unwrap_or(false);
            !st.stop && !idle && !st.blocked.get(&s).copied().unwrap_or(false)
        }));
    }

    /// Every violation seen so far (module docs).
    pub fn violations(&self) -> Vec<String> {
        lock(&self.shared.st).violations.clone()
    }
}

impl Streams for SimDevice {
    type Event = SimEvent;

    fn record(&self, stream: StreamId) -> Result<SimEvent> {
        Ok(SimEvent(self.record_raw(stream)))
    }

    fn wait(&self, stream: StreamId, event: &SimEvent) -> Result<()> {
        self.push(stream, Op::Wait(event.0));
        Ok(())
    }

    fn query(&self, event: &SimEvent) -> Result<bool> {
        Ok(lock(&self.shared.st)
            .events
            .get(event.0)
            .copied()
            .unwrap_or(false))
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        let threads = {
            let mut st = lock(&self.shared.st);
            st.stop = true;
            std::mem::take(&mut st.threads)
        };
        self.shared.cv.notify_all();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Runs kernel `k` (queued on stream `s`) against the memory. Work of a former owner
/// that runs after a later owner's work on the same block is a violation (work of the
/// former owner on the block's own stream runs before the later owner's by stream
/// order; on another stream it was already flagged when the block was handed out).
fn execute(st: &mut State, s: u64, k: Kernel) {
    for b in k.blocks() {
        let blk = &mut st.blocks[b.id];
        if blk.ran_epoch > b.epoch {
            let v = format!(
                "{} on stream {s} touched block {} after a later owner's work on it ran",
                k.name, b.id
            );
            st.violations.push(v);
        }
        blk.ran_epoch = blk.ran_epoch.max(b.epoch);
        if let Some(n) = blk.pending.get_mut(&s) {
            *n = n.saturating_sub(1);
        }
    }
    let mut read = Vec::with_capacity(k.reads.len());
    for (b, expect) in &k.reads {
        let value = st.blocks[b.id].value;
        if let Some(want) = expect {
            if value != *want {
                let v = format!(
                    "{} on stream {s} read {value} from block {}, expected {want} (it ran \
                     before the value's producer, or after it was overwritten)",
                    k.name, b.id
                );
                st.violations.push(v);
            }
        }
        read.push(value);
    }
    for (b, value) in &k.writes {
        st.blocks[b.id].value = *value;
    }
    if let Some(to) = k.capture {
        lock(&to).extend(read);
    }
}

/// The thread of stream `s`: runs its queue in order, each kernel and record after a
/// random delay.
fn run_stream(shared: &Shared, s: u64) {
    let p = shared.params;
    let mut rng = (p.seed ^ s.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    loop {
        let op = {
            let mut st = lock(&shared.st);
            loop {
                if st.stop {
                    return;
                }
                if let Some(op) = st.queues.get_mut(&s).and_then(|q| q.pop_front()) {
                    st.busy.insert(s, true);
                    break op;
                }
                st = wait_timeout_while(&shared.cv, st, Duration::from_millis(100), |st| {
                    !st.stop && st.queues.get(&s).is_none_or(|q| q.is_empty())
                });
            }
        };
        if matches!(op, Op::Kernel(_) | Op::Record(_)) && !p.max_delay.is_zero() {
            // xorshift64*: a delay in 0..max_delay.
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            let r = rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
            std::thread::sleep(Duration::from_nanos(
                r % p.max_delay.as_nanos().max(1) as u64,
            ));
        }
        let mut st = lock(&shared.st);
        match op {
            Op::Kernel(k) => execute(&mut st, s, k),
            Op::Record(e) => st.events[e] = true,
            Op::Sleep(d) => {
                drop(st);
                std::thread::sleep(d);
                st = lock(&shared.st);
            }
            Op::Hold(g) => {
                st.blocked.insert(s, true);
                shared.cv.notify_all();
                drop(st);
                g.pass(shared);
                st = lock(&shared.st);
                st.blocked.insert(s, false);
            }
            Op::Wait(e) => {
                let start = Instant::now();
                let done = |st: &State| st.events.get(e).copied().unwrap_or(true);
                if !done(&st) {
                    st.blocked.insert(s, true);
                    shared.cv.notify_all();
                }
                st = wait_timeout_while(&shared.cv, st, HANG, |st| {
                    !st.stop && !st.events.get(e).copied().unwrap_or(true)
                });
                if !st.stop && !st.events.get(e).copied().unwrap_or(true) {
                    let v = format!(
                        "stream {s} waited {:?} for event {e}, which never completed",
                        start.elapsed()
                    );
                    st.violations.push(v);
                }
                st.blocked.insert(s, false);
            }
        }
        st.busy.insert(s, false);
        shared.cv.notify_all();
    }
}
