//! The engine: a rank's links, the run wrapper every operation goes through, and the
//! executors that run an algorithm's [`Plan`](crate::algo::Plan).
//!
//! - [`Engine::run`] is the one wrapper: it refuses to start on a poisoned or aborted
//!   communicator and poisons it (shutting every link, so peers fail fast) when an
//!   operation fails. Every collective, on host or device memory, over any transport,
//!   runs inside it.
//! - [`Engine::stream`] (`stream.rs`) runs a plan over links that push bytes (TCP,
//!   RDMA, in-process pipes): it moves both frame lists (each lane's, for a plan with
//!   [`Lanes`](crate::algo::Lanes)) as far as the links allow,
//!   checks every frame header against the call's fingerprint, combines received data
//!   with a [`Combine`](crate::reduce::Combine), and sleeps only when nothing can move.
//! - [`Engine::pull`] (`pull.rs`) runs the same plan over peers whose memory this rank
//!   reads (CUDA IPC): each receive becomes a read of the sender's memory once the
//!   sender has published that the bytes are ready; [`Engine::pull_shot`] (`shot.rs`)
//!   the one-shot and two-shot all-reduces over such peers.
//! - Both wait through one [`Pacer`] (`pacer.rs`): a deadline of
//!   [`Tuning::timeout`] without progress, on [`Tuning::clock`], and the abort flag.
//!
//! The engine owns the buffers while an operation runs and hands out only slices;
//! algorithms never see a buffer, a socket or a device.

mod p2p;
mod pacer;
mod plans;
mod pull;
mod shot;
mod slot;
mod stream;

pub(crate) use p2p::{Done, OpBuffer, P2pOp, P2pSource};
pub(crate) use pacer::Pacer;
pub(crate) use plans::PlanKey;
pub(crate) use pull::PullCall;
pub(crate) use shot::Shot;
pub(crate) use stream::Data;

use crate::config::Tuning;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::trace::{PeerCounts, RecHead, Recorder};
use crate::transport::{Beacon, Channel, Connector, GroupSpec, Links, MemPeers, Waiter, Waker};
use crate::wire::{Fingerprint, OpKind, Peer, WireStats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the engines of one communicator share (its collectives' and its
/// point-to-point operations'): the abort flag, and whether (and why) the
/// communicator is poisoned. A failure in either engine poisons both: each shuts its
/// links, telling its peers why, so a rank waiting on any of them fails fast.
#[derive(Default)]
pub(crate) struct Health {
    /// Set by `AbortHandle::abort` from any thread.
    pub abort: Arc<AtomicBool>,
    /// Raised once `poison` holds a reason (read without the lock on every wait).
    poisoned: AtomicBool,
    /// Why: the message every later call fails with, the rank where the failure
    /// started and its cause there (what the notices to peers say).
    poison: Mutex<Option<Poison>>,
    /// Wakes the other engines' waits when one poisons (their waiters, and a worker
    /// idle on its queue).
    wakers: Mutex<Vec<Waker>>,
}

/// Why a communicator is poisoned.
#[derive(Clone, Debug)]
pub(crate) struct Poison {
    pub why: String,
    pub origin: usize,
    /// The origin's error as a notice carries it ([`Error::to_wire`]).
    pub cause: String,
}

impl Health {
    /// Why the communicator is poisoned, if it is.
    pub fn poisoned(&self) -> Option<Poison> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison).clone()
    }

    /// Whether it is poisoned (one atomic load).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// Records the first failure (later ones keep it) and wakes the other engines.
    fn set(&self, p: Poison) {
        {
            let mut g = lock(&self.poison);
            if g.is_some() {
                return;
            }
            *g = Some(p);
            self.poisoned.store(true, Ordering::Release);
        }
        for w in lock(&self.wakers).iter() {
            w.wake();
        }
    }

    /// Adds `w` to what a poisoning wakes.
    pub fn on_poison(&self, w: Waker) {
        lock(&self.wakers).push(w);
    }
}

/// The longest single sleep in a wait: bounds how late an abort is noticed.
const MAX_WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a timed-out rank spends asking its peers where they are (all at once):
/// the margin by which a timeout's error comes after the timeout itself.
pub const STATUS_BUDGET: Duration = Duration::from_millis(500);
/// Idle time after which an operation in flight is shown to the flight recorder (so
/// that a dump taken during a hang has it); shorter ones are recorded when they end.
const SHOW_AFTER_NS: u64 = 1_000_000;
/// How long a failing rank tries at most to get its notices onto full links, and how
/// long it waits for a peer to take more of a half-sent frame before giving up on it.
pub(super) const NOTICE_WAIT: Duration = Duration::from_millis(50);
/// Peers asked at most, after a timeout (the ones waited on first).
const STATUS_MAX_PEERS: usize = 64;

/// A rank's links, per channel, and the state shared by the operations on them.
pub(crate) struct Engine {
    pub rank: usize,
    pub world_size: usize,
    pub cfg: Tuning,
    links: [Vec<Option<Peer>>; 2],
    /// The links that exist, as (channel index, peer), in the order they were made.
    linked: Vec<(usize, usize)>,
    pub waiter: Box<dyn Waiter>,
    connector: Box<dyn Connector>,
    /// What this rank is doing, for peers that ask.
    beacon: Arc<Beacon>,
    /// The abort flag and the poison, shared with the communicator's other engine.
    pub health: Arc<Health>,
    /// Whether this engine has told its peers of the poison and shut its links.
    shut: bool,
    /// Receive buffer for frames that are reduced rather than stored.
    pub scratch: Vec<u64>,
    /// Peers whose memory this rank reads, for the pull executor.
    mem: Option<Box<dyn MemPeers>>,
    /// The pull executor's state between calls.
    pull: pull::PullState,
    /// The point-to-point executor's state between calls.
    p2p_state: p2p::P2pState,
    /// The plans of recent call shapes ([`Engine::planned`]).
    plans: plans::PlanCache,
    /// The flight recorder, and what it is told about the operation in flight.
    pub rec: Arc<Recorder>,
    track: Option<OpTrack>,
    /// When the operation now running was issued (ns since the Unix epoch).
    enqueued_ns: u64,
    /// When it started, where the caller knows (issued and started at once): the
    /// recorder then reads no clock of its own (a clock read is a tenth of a small
    /// all-reduce's fixed cost).
    started_ns: Option<u64>,
    /// Whether a wait spins a little before it yields the CPU: not where this host
    /// runs more ranks than it gives them CPUs (set by the communicator).
    pub spin: bool,
    /// For a child communicator: its id and the job rank of each of its ranks, which
    /// its errors name beside its own ranks.
    group: Option<(u64, Arc<[usize]>)>,
}

/// The flight recorder's view of the operation in flight, kept by the engine so that
/// recording costs no lock and no allocation per frame.
struct OpTrack {
    seq: u64,
    kind: OpKind,
    head: RecHead,
    /// Idle time so far, and whether the recorder has been shown the operation.
    waited_ns: u64,
    shown: bool,
    /// Bytes each link had moved when the operation started: (peer, sent, received);
    /// `None` for an operation that moves nothing over links (a slot call), whose end
    /// then reads no link either.
    start: Option<PeerCounts>,
    /// Idle nanoseconds per peer waited on.
    waits: PeerCounts,
    /// The peer waited on last, and whether the recorder has been told.
    waiting_on: Option<usize>,
    told: Option<usize>,
}

/// Names of a recorded operation's codes, for the flight recorder's dumps.
fn names(
    kind: u8,
    dtype: u8,
    op: u8,
    algo: u8,
) -> (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
) {
    (
        OpKind::from_code(kind).map_or("?", OpKind::name),
        crate::reduce::DataType::from_code(dtype).map_or("?", |d| d.name()),
        crate::reduce::ReduceOp::from_code(op).map(|o| o.name()),
        crate::algo::Algorithm::from_code(algo).map_or("?", |a| a.name()),
    )
}

/// A flight recorder for rank `rank` of `world_size` over `transport`, keeping
/// `capacity` operations; the engines of one communicator share it.
pub(crate) fn recorder(
    rank: usize,
    world_size: usize,
    transport: &str,
    capacity: usize,
) -> Arc<Recorder> {
    Recorder::new(rank, world_size, transport, capacity, names)
}

fn ch_index(ch: Channel) -> usize {
    match ch {
        Channel::Collective => 0,
        // Status queries never become links (the transport answers them itself).
        Channel::P2p | Channel::Status => 1,
    }
}

impl Engine {
    pub fn new(
        rank: usize,
        world_size: usize,
        cfg: Tuning,
        links: Links,
        rec: Arc<Recorder>,
        health: Arc<Health>,
    ) -> Self {
        let n = world_size;
        Engine {
            rank,
            world_size: n,
            links: [
                (0..n).map(|_| None).collect(),
                (0..n).map(|_| None).collect(),
            ],
            linked: Vec::new(),
            waiter: links.waiter,
            connector: links.connector,
            beacon: links.beacon,
            health,
            shut: false,
            scratch: Vec::new(),
            mem: links.mem,
            pull: pull::PullState::default(),
            p2p_state: p2p::P2pState::default(),
            plans: plans::PlanCache::default(),
            rec,
            track: None,
            enqueued_ns: 0,
            started_ns: None,
            spin: true,
            group: None,
            cfg,
        }
    }

    /// Bytes sent and received per peer over both channels, headers included.
    fn link_bytes(&self) -> PeerCounts {
        let mut v = PeerCounts::default();
        for &(c, q) in &self.linked {
            if let Some(p) = &self.links[c][q] {
                let s = &p.stats;
                v.add(
                    q,
                    s.payload_sent + s.header_sent,
                    s.payload_recv + s.header_recv,
                );
            }
        }
        v
    }

    /// The executors call this when an operation starts moving data (again for the
    /// same operation: ignored).
    pub(crate) fn trace_begin(&mut self, fp: &Fingerprint) {
        self.trace_begin_on(fp, true);
    }

    /// [`Engine::trace_begin`], for an operation that moves data over its links or
    /// (`links` false) moves none there.
    pub(crate) fn trace_begin_on(&mut self, fp: &Fingerprint, links: bool) {
        if self.cfg.trace_capacity == 0
            || self
                .track
                .as_ref()
                .is_some_and(|t| t.seq == fp.seq && t.kind == fp.kind)
        {
            return;
        }
        let start_ns = self.started_ns.take().unwrap_or_else(crate::trace::now_ns);
        let head = RecHead {
            seq: fp.seq,
            kind: fp.kind.code(),
            dtype: fp.dtype.code(),
            op: fp.op.map_or(255, |o| o.code()),
            count: fp.count,
            root: fp.root.unwrap_or(u32::MAX),
            algo: fp.algo.code(),
            enqueue_ns: self.enqueued_ns.min(start_ns),
            start_ns,
        };
        self.track = Some(OpTrack {
            seq: fp.seq,
            kind: fp.kind,
            head,
            waited_ns: 0,
            shown: false,
            start: links.then(|| self.link_bytes()),
            waits: PeerCounts::default(),
            waiting_on: None,
            told: None,
        });
    }

    /// The operation in flight is about to wait on `peer`.
    pub(crate) fn trace_waiting(&mut self, peer: usize) {
        if let Some(t) = self.track.as_mut() {
            t.waiting_on = Some(peer);
        }
    }

    /// The operation in flight waited `ns` nanoseconds on `peer`.
    pub(crate) fn trace_waited(&mut self, peer: usize, ns: u64) {
        let Some(t) = self.track.as_mut() else {
            return;
        };
        t.waits.add(peer, ns, 0);
        t.waited_ns += ns;
        if !t.shown && t.waited_ns >= SHOW_AFTER_NS {
            // Waiting long enough that a dump may be taken meanwhile (a hang, SIGUSR1).
            t.shown = true;
            self.rec.running(t.head);
        }
        if t.told != Some(peer) {
            // Once per change of peer: a dump taken during a hang names the peer.
            t.told = Some(peer);
            self.rec.waiting_on(peer);
        }
    }

    /// The operation in flight ended with `r`: its record is completed and kept, and a
    /// failure dumps the recorder (into `FERROCCL_TRACE_DIR`, when set).
    fn trace_end(&mut self, r: &Result<()>) {
        if let Some(t) = self.track.take() {
            let mut peers = PeerCounts::default();
            if let Some(start) = &t.start {
                for (peer, sent, recv, _) in self.link_bytes().iter() {
                    let (s0, r0) = start.get(peer).unwrap_or((0, 0));
                    peers.add(peer, sent - s0, recv - r0);
                }
            }
            for (peer, ns, _, _) in t.waits.iter() {
                peers.add_wait_us(peer, ns.div_ceil(1000));
            }
            let (error, waiting_on) = match r {
                Ok(()) => (None, None),
                Err(e) => (Some(e.to_string().into_boxed_str()), t.waiting_on),
            };
            self.rec.end(t.head, error, waiting_on, peers);
        }
        if let Err(e) = r {
            let reason = match e {
                Error::Timeout { .. } => "timeout",
                Error::Aborted { .. } => "abort",
                _ => "error",
            };
            self.rec.dump_to_env_dir(reason);
        }
    }

    /// Makes the link to `peer` on `ch` now (if it does not exist yet).
    pub fn connect(&mut self, ch: Channel, peer: usize, deadline: Instant) -> Result<()> {
        if self.links[ch_index(ch)][peer].is_none() {
            let link = self.connector.connect(peer, ch, deadline)?;
            self.links[ch_index(ch)][peer] = Some(Peer::new(link));
            self.linked.push((ch_index(ch), peer));
        }
        Ok(())
    }

    /// Whether the link to `peer` on `ch` exists.
    pub fn linked_now(&self, ch: Channel, peer: usize) -> bool {
        self.links[ch_index(ch)][peer].is_some()
    }

    /// The link to `peer` on `ch`, made now if that costs no wait for the peer
    /// ([`crate::transport::Connector::ready`]); `None` while the peer has yet to dial
    /// in. An executor that waits for one link keeps moving the others, so a peer
    /// that failed before it linked never holds up the notices of the rest.
    pub fn try_link(&mut self, ch: Channel, peer: usize) -> Result<Option<&mut Peer>> {
        if !self.linked_now(ch, peer) && !self.connector.ready(peer, ch) {
            return Ok(None);
        }
        self.link(ch, peer).map(Some)
    }

    /// The link to `peer` on `ch`, connecting it first if needed.
    pub fn link(&mut self, ch: Channel, peer: usize) -> Result<&mut Peer> {
        if self.links[ch_index(ch)][peer].is_none() {
            let deadline = Instant::now() + self.cfg.connect_timeout;
            self.connect(ch, peer, deadline)?;
        }
        self.links[ch_index(ch)][peer]
            .as_mut()
            .ok_or_else(|| Error::Config(format!("rank {} has no link to rank {peer}", self.rank)))
    }

    /// Byte counts over all links and channels.
    pub fn wire_stats(&self) -> WireStats {
        self.wire_stats_to(|_| true)
    }

    /// Byte counts over the links (all channels) to the peers `to` admits.
    pub fn wire_stats_to(&self, to: impl Fn(usize) -> bool) -> WireStats {
        let mut s = WireStats::default();
        for ch in &self.links {
            for (peer, p) in ch.iter().enumerate() {
                if let Some(p) = p.as_ref().filter(|_| to(peer)) {
                    s.add(&p.stats);
                }
            }
        }
        s
    }

    /// The collective links made so far: `(peer, class)`, by peer.
    pub fn link_classes(&self) -> Vec<(usize, &'static str)> {
        let ch = ch_index(Channel::Collective);
        (0..self.links[ch].len())
            .filter_map(|p| self.links[ch][p].as_ref().map(|l| (p, l.link.class())))
            .collect()
    }

    /// What the links themselves counted, written and read.
    pub fn raw_byte_counts(&self) -> (u64, u64) {
        self.links
            .iter()
            .flatten()
            .flatten()
            .map(|p| p.link.raw_counts())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Runs `run` over the plan of a call of shape `key`: the one kept from an earlier
    /// call of that shape, else `make`'s, kept afterwards. Without a key (a plan that
    /// depends on more than its shape), `make`'s, not kept.
    pub(crate) fn planned(
        &mut self,
        key: Option<PlanKey>,
        make: impl FnOnce() -> crate::algo::Plan,
        run: impl FnOnce(&mut Engine, &crate::algo::Plan) -> Result<()>,
    ) -> Result<()> {
        let plan = key.and_then(|k| self.plans.take(&k)).unwrap_or_else(make);
        let r = run(self, &plan);
        if let Some(k) = key {
            self.plans.keep(k, plan);
        }
        r
    }

    /// Runs one operation: fails fast if poisoned, and poisons on any failure (the
    /// peers of a failed operation are out of step with this rank).
    /// `enqueued_ns` is when the caller issued it (for the flight recorder).
    pub fn run(
        &mut self,
        enqueued_ns: u64,
        op: impl FnOnce(&mut Engine) -> Result<()>,
    ) -> Result<()> {
        self.enqueued_ns = enqueued_ns;
        let r = self.run_op(op);
        self.started_ns = None;
        r
    }

    /// [`Engine::run`] for an operation issued at `ns` and starting at once (its
    /// caller waited for nothing in between).
    pub fn run_started(
        &mut self,
        ns: u64,
        op: impl FnOnce(&mut Engine) -> Result<()>,
    ) -> Result<()> {
        self.started_ns = Some(ns);
        self.run(ns, op)
    }

    fn run_op(&mut self, op: impl FnOnce(&mut Engine) -> Result<()>) -> Result<()> {
        if let Some(p) = self.health.poisoned() {
            self.shut_after(&p);
            return Err(Error::Poisoned(p.why));
        }
        if self.health.abort.load(Ordering::Relaxed) {
            // Aborted before this operation started: the same event for the caller as an
            // abort during it.
            let e = Error::Aborted {
                rank: self.rank,
                op: "this call (abort() came before it started)".into(),
            };
            self.poison_err(&e);
            return Err(e);
        }
        let r = op(self).map_err(|e| self.in_group(e));
        if let Err(e) = &r {
            let (origin, cause) = self.origin_of(e);
            self.poison_with(origin, &cause, e.to_string());
        }
        self.trace_end(&r);
        r
    }

    /// Where a failure started, and the cause to tell the peers (as the wire carries
    /// it): a notice received is passed on as it came; a lost peer is named as the
    /// origin (the cause is the lost connection, as this rank saw it); the poison of
    /// the communicator's other engine keeps its origin; anything else started here.
    fn origin_of(&self, e: &Error) -> (usize, String) {
        if let (Error::Poisoned(_), Some(p)) = (e, self.health.poisoned()) {
            return (p.origin, p.cause);
        }
        match e {
            Error::PeerFailed { origin, cause, .. } => (*origin, cause.to_wire()),
            Error::PeerClosed { peer, .. } => (*peer, e.to_wire()),
            e => (self.rank, e.to_wire()),
        }
    }

    /// Before this rank shuts its links after a failure: tells every peer whose link
    /// is between frames why (a [`FrameError::Notice`](crate::wire::FrameError) that
    /// the peer reports as [`Error::PeerFailed`]), without waiting for any of them.
    fn notify_peers(&mut self, origin: usize, cause: &str) {
        if self.shut {
            return; // told them already
        }
        let notice = crate::wire::encode_notice(origin, cause);
        // A link whose buffer is full (an RDMA ring the peer has not drained) gets a
        // moment for the peer to read on; never longer than NOTICE_WAIT in all.
        let end = Instant::now() + NOTICE_WAIT;
        for p in self.links.iter_mut().flatten().flatten() {
            if p.out_mid || p.link.peer() == origin {
                continue;
            }
            let mut done = 0;
            while done < notice.len() {
                match p.link.try_write(&[std::io::IoSlice::new(&notice[done..])]) {
                    Ok(n) if n > 0 => done += n,
                    Ok(_) if Instant::now() < end => std::thread::yield_now(),
                    _ => break,
                }
            }
        }
    }

    /// Marks the engine unusable and shuts every link so peers fail fast too, telling
    /// them first that the failure started here.
    pub fn poison(&mut self, why: String) {
        let cause = Error::Remote {
            kind: "Error".into(),
            message: why.clone(),
        };
        self.poison_with(self.rank, &cause.to_wire(), why);
    }

    /// [`Engine::poison`] for this rank's own error `e` (the peers are told it typed).
    pub fn poison_err(&mut self, e: &Error) {
        self.poison_with(self.rank, &e.to_wire(), e.to_string());
    }

    /// [`Engine::poison`] for a failure that started at rank `origin` with `cause`.
    pub(crate) fn poison_with(&mut self, origin: usize, cause: &str, why: String) {
        self.notify_peers(origin, cause);
        if !self.health.is_poisoned() {
            // The failure is returned to the caller, who reports it; log quietly.
            tracing::debug!(rank = self.rank, "communicator poisoned: {why}");
        }
        self.health.set(Poison {
            why,
            origin,
            cause: cause.to_string(),
        });
        self.shut = true;
        self.shutdown();
    }

    /// The communicator was poisoned elsewhere (its other engine): tells this engine's
    /// peers why and shuts its links, once.
    pub fn shut_after(&mut self, p: &Poison) {
        if !self.shut {
            self.notify_peers(p.origin, &p.cause);
            self.shut = true;
            self.shutdown();
        }
    }

    /// Makes this the engine of communicator `id` (0: the job's own, whose ranks are
    /// the job's) whose rank `r` is job rank `global[r]`.
    pub fn set_group(&mut self, id: u64, global: Arc<[usize]>) {
        self.group = (id != 0).then_some((id, global));
    }

    /// `e` naming the job ranks of the ranks it names, on a child communicator.
    fn in_group(&self, e: Error) -> Error {
        match &self.group {
            Some((id, global)) => crate::error::in_group(e, *id, global),
            None => e,
        }
    }

    /// Why the communicator is poisoned, if it is.
    pub fn poisoned(&self) -> Option<String> {
        self.health.poisoned().map(|p| p.why)
    }

    /// The links of a group of this engine's ranks ([`crate::transport::Connector::group`]).
    pub fn group_links(&mut self, spec: &GroupSpec) -> Result<Links> {
        self.connector.group(spec)
    }

    /// A waker for this engine's waiter, if its transport has one.
    pub fn waker(&self) -> Option<Waker> {
        self.waiter.waker()
    }

    /// Closes every link, and the connector's (so that a peer linking to this rank
    /// now, or linked through an acceptor but not taken up yet, sees it closed).
    pub fn shutdown(&mut self) {
        for p in self.links.iter_mut().flatten().flatten() {
            p.link.shutdown();
        }
        self.connector.close();
    }

    /// Grows the scratch buffer to at least `bytes`.
    pub fn scratch_bytes(&mut self, bytes: usize) {
        if self.scratch.len() * 8 < bytes {
            self.scratch = vec![0u64; bytes.div_ceil(8)];
        }
    }

    /// Adds to a timeout where the other ranks are ([`Engine::where_are_peers`]),
    /// asking the peers of the operation, `waited()`, first (computed only then).
    pub(crate) fn locate_on_timeout(
        &mut self,
        r: Result<()>,
        fp: &Fingerprint,
        waited: impl FnOnce() -> Vec<usize>,
    ) -> Result<()> {
        match r {
            Err(Error::Timeout {
                rank,
                op,
                after,
                waiting_for,
                ..
            }) => {
                let peers = self.where_are_peers(fp, &waited());
                Err(Error::Timeout {
                    rank,
                    op,
                    after,
                    waiting_for,
                    peers,
                })
            }
            r => r,
        }
    }

    /// Asks the other ranks (those this operation waits on first) which operation
    /// each is in, within a short budget, and says it in one line: the answer to
    /// "which rank is hanging?".
    fn where_are_peers(&mut self, fp: &Fingerprint, waited: &[usize]) -> String {
        let n = self.world_size;
        if n == 1 {
            return "no other ranks".into();
        }
        let mut order: Vec<usize> = Vec::new();
        for &p in waited.iter().chain((0..n).collect::<Vec<_>>().iter()) {
            if p != self.rank && !order.contains(&p) {
                order.push(p);
            }
        }
        let skipped = order.len().saturating_sub(STATUS_MAX_PEERS);
        order.truncate(STATUS_MAX_PEERS);
        let budget = STATUS_BUDGET.min(self.cfg.timeout);
        let deadline = Instant::now() + budget;
        let mut same = Vec::new();
        let mut parts = Vec::new();
        // Peers whose address this rank never learnt, when the store that would say it
        // is silent too: counted, not named (nothing is known of them).
        let mut unasked = 0usize;
        let answers = self.connector.peers_status(&order, deadline);
        for (p, answer) in order.into_iter().zip(answers) {
            match answer {
                Ok(Some((seq, kind))) if seq == fp.seq && kind == fp.kind.code() => same.push(p),
                Ok(Some((seq, kind))) => {
                    let name = OpKind::from_code(kind).map_or("?", OpKind::name);
                    parts.push(format!("rank {p} is at #{seq} ({name})"));
                }
                Ok(None) => parts.push(format!("rank {p} has not started any operation")),
                // A peer that took the whole budget is there but silent (stopped, or
                // starved of CPU); one that failed sooner could not be reached.
                Err(e @ Error::Timeout { .. }) => {
                    tracing::debug!("status query to rank {p}: no answer: {e}");
                    parts.push(format!(
                        "rank {p} did not answer within {budget:?} (stopped or starved?)"
                    ));
                }
                Err(e @ Error::Rendezvous(_)) => {
                    tracing::debug!("status query to rank {p}: no address: {e}");
                    unasked += 1;
                }
                Err(e) => {
                    tracing::debug!("status query to rank {p} failed: {e}");
                    parts.push(format!("rank {p} unreachable ({e})"));
                }
            }
        }
        if !same.is_empty() {
            let list: Vec<String> = same.iter().map(|p| p.to_string()).collect();
            let who = if same.len() == 1 { "rank" } else { "ranks" };
            let verb = if same.len() == 1 { "is" } else { "are" };
            parts.push(format!(
                "{who} {} {verb} in #{} too",
                list.join(", "),
                fp.seq
            ));
        }
        if unasked > 0 {
            let (n, verb) = match unasked {
                1 => ("1 rank".to_string(), "was"),
                n => (format!("{n} ranks"), "were"),
            };
            parts.push(format!(
                "the job's store did not answer within {budget:?}, so {n} whose address this rank never needed {verb} not asked"
            ));
        }
        if skipped > 0 {
            parts.push(format!("{skipped} more ranks not asked"));
        }
        parts.join("; ")
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
