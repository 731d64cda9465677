//! A simulated reliable-connected queue pair in memory, and a transport over it.
//!
//! Each link is a *wire* holding both ends' registered memory (ring, bounce buffer,
//! credit word), their posted receive requests, their in-flight writes and their
//! undelivered completions. Time is a per-wire clock that advances by one on every
//! poll of either end (and jumps ahead when a rank sleeps in its [`Waiter`], the way a
//! NIC keeps working while the CPU sleeps). Every event gets a delay of
//! `0..=max_delay` ticks from a deterministic RNG.
//!
//! # What is delayed and reordered, and why that is legal
//!
//! What verbs guarantee for one RC queue pair, and the simulator keeps:
//!
//! * Writes posted by one end are executed at the other end in posting order (RC
//!   requests carry consecutive PSNs and the responder executes them in PSN order).
//!   A write's landing is delayed, but never before an earlier write from the same end.
//! * The send completions of one end arrive in posting order; so do its receive
//!   completions. Each queue is delayed as a whole, never reordered inside itself.
//! * A receive completion is generated only after the data of its WRITE WITH
//!   IMMEDIATE is in memory; a send completion only after the write has landed (the
//!   ACK comes back after execution).
//! * A WRITE WITH IMMEDIATE with no receive request posted is a fatal error (here it
//!   fails the wire at once; real hardware would first retry on RNR NAKs). That makes
//!   running out of receive requests a test failure instead of a slowdown.
//!
//! What verbs leave open, and the simulator varies:
//!
//! * How long a landing takes, and how long after it each completion is seen. The
//!   sender may see its send completion long before or long after the receiver sees
//!   the receive completion, and the credit word may change before or after either.
//! * The interleaving of send and receive completions of one end (one CQ serves both
//!   queues and their relative order is not specified): each poll merges the due
//!   entries of the two queues in a random order.
//! * When the source of a write is read: the simulator reads the bounce buffer when
//!   the write *lands*, not when it is posted, so a sender that reused a bounce slot
//!   before its send completion would put wrong bytes on the wire and fail the tests.
//!
//! An end whose link is dropped is *gone*: its writes already posted still land (a
//! generous NIC), writes aimed at it fail with a peer-lost completion at the sender,
//! like `IBV_WC_RETRY_EXC_ERR` once the remote queue pair is destroyed.

use super::proto::{Completion, Endpoint, Params, WorkRequest};
use super::{QueuePair, RdmaLink};
use crate::sync::{lock, wait_timeout_while};
use crate::transport::{
    Beacon, Channel, Connector, GroupSpec, Link, LinkError, Links, Waiter, Waker,
};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Shape and timing of a simulated fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimParams {
    /// Ring shape of every link.
    pub ring: Params,
    /// Each landing and each completion is delayed by `0..=max_delay` ticks.
    pub max_delay: u64,
    /// Seeds the delays (each wire derives its own stream from it).
    pub seed: u64,
}

impl Default for SimParams {
    /// 8 slots of 8 KiB, credits every 2 slots, delays up to 4 polls.
    fn default() -> Self {
        SimParams {
            ring: Params {
                slots: 8,
                slot_bytes: 8 << 10,
                credit_batch: 2,
            },
            max_delay: 4,
            seed: 0x5eed,
        }
    }
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A write in flight from one end to the other.
#[derive(Debug)]
enum Write {
    Data {
        wr_id: u64,
        slot: usize,
        len: usize,
        imm: u32,
    },
    Credit {
        wr_id: u64,
        freed: u64,
    },
    Close {
        wr_id: u64,
        imm: u32,
    },
}

#[derive(Default)]
struct End {
    ring: Vec<u8>,
    bounce: Vec<u8>,
    credit_word: u64,
    recvs_posted: u64,
    /// Writes posted by this end, landing at the other end in this order.
    outgoing: VecDeque<(u64, Write)>,
    sq: VecDeque<(u64, Completion)>,
    rq: VecDeque<(u64, Completion)>,
    gone: bool,
    /// A write of this end failed: the queue pair is in the error state.
    broken: bool,
}

struct Wire {
    clock: u64,
    rng: u64,
    max_delay: u64,
    slot_bytes: usize,
    ends: [End; 2],
    /// The ranks of side 0 and side 1.
    ranks: [usize; 2],
    /// A fatal simulator-level fault (a protocol bug such as a missing receive request).
    fault: Option<String>,
}

impl Wire {
    fn delay(&mut self) -> u64 {
        if self.max_delay == 0 {
            0
        } else {
            splitmix(&mut self.rng) % (self.max_delay + 1)
        }
    }

    /// When a new entry of a queue whose last entry is due at `last` is due: delayed,
    /// and never before the entry ahead of it.
    fn due_after(&mut self, last: Option<u64>) -> u64 {
        let d = self.clock + self.delay();
        last.map_or(d, |t| d.max(t))
    }

    /// Lands every write due by now, in posting order per end. Returns whether
    /// anything landed.
    fn land(&mut self) -> bool {
        let mut any = false;
        for s in 0..2 {
            while let Some((due, _)) = self.ends[s].outgoing.front() {
                if *due > self.clock || self.fault.is_some() {
                    break;
                }
                let Some((_, w)) = self.ends[s].outgoing.pop_front() else {
                    break;
                };
                self.execute(s, w);
                any = true;
            }
        }
        any
    }

    fn execute(&mut self, s: usize, w: Write) {
        let t = 1 - s;
        let wr_id = match w {
            Write::Data { wr_id, .. }
            | Write::Credit { wr_id, .. }
            | Write::Close { wr_id, .. } => wr_id,
        };
        if self.ends[t].gone {
            let at = self.due_after(self.ends[s].sq.back().map(|e| e.0));
            self.ends[s].sq.push_back((
                at,
                Completion::Failed {
                    wr_id,
                    status: "transport retry counter exceeded (remote queue pair gone)".into(),
                    peer_lost: true,
                },
            ));
            self.ends[s].broken = true;
            return;
        }
        let imm = match w {
            Write::Data { slot, len, imm, .. } => {
                let b = self.slot_bytes;
                let (src, dst) = if s == 0 {
                    let (a, z) = self.ends.split_at_mut(1);
                    (&a[0].bounce, &mut z[0].ring)
                } else {
                    let (a, z) = self.ends.split_at_mut(1);
                    (&z[0].bounce, &mut a[0].ring)
                };
                dst[slot * b..slot * b + len].copy_from_slice(&src[slot * b..slot * b + len]);
                Some(imm)
            }
            Write::Credit { freed, .. } => {
                self.ends[t].credit_word = freed;
                None
            }
            Write::Close { imm, .. } => Some(imm),
        };
        if let Some(imm) = imm {
            if self.ends[t].recvs_posted == 0 {
                self.fault = Some(format!(
                    "write with immediate {imm:#x} found no receive request posted (RNR)"
                ));
                return;
            }
            self.ends[t].recvs_posted -= 1;
            let at = self.due_after(self.ends[t].rq.back().map(|e| e.0));
            self.ends[t]
                .rq
                .push_back((at, Completion::Received { imm }));
        }
        let at = self.due_after(self.ends[s].sq.back().map(|e| e.0));
        self.ends[s].sq.push_back((at, Completion::Sent { wr_id }));
    }

    /// Whether any write is in flight or any completion is not yet due.
    fn busy(&self) -> bool {
        self.ends.iter().any(|e| {
            !e.outgoing.is_empty()
                || e.sq.iter().any(|(t, _)| *t > self.clock)
                || e.rq.iter().any(|(t, _)| *t > self.clock)
        })
    }

    /// Moves the clock past every pending event and lands every write.
    fn fast_forward(&mut self) {
        while self.busy() && self.fault.is_none() {
            let last = self
                .ends
                .iter()
                .flat_map(|e| {
                    e.outgoing
                        .iter()
                        .map(|(t, _)| *t)
                        .chain(e.sq.iter().map(|(t, _)| *t))
                        .chain(e.rq.iter().map(|(t, _)| *t))
                })
                .max()
                .unwrap_or(self.clock);
            self.clock = self.clock.max(last);
            self.land();
        }
    }
}

/// A rank's doorbell, as in [`crate::transport::local`].
#[derive(Default)]
struct Bell {
    generation: Mutex<u64>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        let mut g = lock(&self.generation);
        *g = g.wrapping_add(1);
        self.cv.notify_all();
    }
}

type WireMap = HashMap<(u64, usize, usize, Channel), Arc<Mutex<Wire>>>;

struct Fabric {
    /// Each rank's current operation per group (0: the job's own links), read
    /// directly by its peers' status queries.
    beacons: Mutex<HashMap<(u64, usize), Arc<Beacon>>>,
    params: SimParams,
    bells: Vec<Arc<Bell>>,
    wires: Mutex<WireMap>,
    /// The wires each rank has an end of.
    of_rank: Vec<Mutex<Vec<Arc<Mutex<Wire>>>>>,
    /// `(group, rank)`s closed ([`Connector::close`]): their ends, made before or
    /// after, are gone.
    closed: Mutex<std::collections::HashSet<(u64, usize)>>,
}

/// One end of a simulated queue pair.
pub struct SimQp {
    wire: Arc<Mutex<Wire>>,
    side: usize,
    bells: [Arc<Bell>; 2],
    rng: u64,
}

impl SimQp {
    fn fault(w: &Wire) -> Result<(), LinkError> {
        match &w.fault {
            Some(f) => Err(LinkError::Io(std::io::Error::other(format!(
                "simulated queue pair: {f}"
            )))),
            None => Ok(()),
        }
    }

    fn ring_both(&self) {
        self.bells[0].ring();
        self.bells[1].ring();
    }
}

impl QueuePair for SimQp {
    fn post(&mut self, wr: &WorkRequest) -> Result<(), LinkError> {
        let mut w = lock(&self.wire);
        Self::fault(&w)?;
        if w.ends[self.side].broken {
            // As verbs do on a queue pair in the error state: the request is accepted
            // and completes at once with a flush error.
            if let WorkRequest::WriteData { wr_id, .. }
            | WorkRequest::WriteCredit { wr_id, .. }
            | WorkRequest::WriteClose { wr_id, .. } = *wr
            {
                let last = w.ends[self.side].sq.back().map(|e| e.0);
                let at = w.due_after(last);
                w.ends[self.side].sq.push_back((
                    at,
                    Completion::Failed {
                        wr_id,
                        status: "work request flushed (queue pair in error state)".into(),
                        peer_lost: true,
                    },
                ));
            }
            return Ok(());
        }
        let write = match *wr {
            WorkRequest::PostRecv { .. } => {
                w.ends[self.side].recvs_posted += 1;
                return Ok(());
            }
            WorkRequest::WriteData {
                wr_id,
                slot,
                len,
                imm,
            } => {
                let b = w.slot_bytes;
                if len == 0 || len > b || (slot + 1) * b > w.ends[self.side].bounce.len() {
                    return Err(LinkError::Io(std::io::Error::other(format!(
                        "write of {len} bytes at slot {slot} is outside the registered memory"
                    ))));
                }
                Write::Data {
                    wr_id,
                    slot,
                    len,
                    imm,
                }
            }
            WorkRequest::WriteCredit { wr_id, freed } => Write::Credit { wr_id, freed },
            WorkRequest::WriteClose { wr_id, imm } => Write::Close { wr_id, imm },
        };
        let last = w.ends[self.side].outgoing.back().map(|e| e.0);
        let at = w.due_after(last);
        w.ends[self.side].outgoing.push_back((at, write));
        drop(w);
        self.bells[1 - self.side].ring();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), LinkError> {
        let mut w = lock(&self.wire);
        w.clock += 1;
        let landed = w.land();
        Self::fault(&w)?;
        let now = w.clock;
        let e = &mut w.ends[self.side];
        if e.broken {
            // The queue pair went to the error state after these receive completions
            // were generated: a real CQ already holds them, ahead of the error.
            out.extend(e.rq.drain(..).map(|(_, c)| c));
        }
        loop {
            let sq = e.sq.front().is_some_and(|(t, _)| *t <= now);
            let rq = e.rq.front().is_some_and(|(t, _)| *t <= now);
            let take_sq = match (sq, rq) {
                (false, false) => break,
                (true, true) => splitmix(&mut self.rng) & 1 == 0,
                (s, _) => s,
            };
            let q = if take_sq { &mut e.sq } else { &mut e.rq };
            if let Some((_, c)) = q.pop_front() {
                out.push(c);
            }
        }
        drop(w);
        if landed {
            self.ring_both();
        }
        Ok(())
    }

    fn credit_word(&self) -> u64 {
        lock(&self.wire).ends[self.side].credit_word
    }

    fn fill_bounce(&mut self, slot: usize, off: usize, src: &[u8]) {
        let mut w = lock(&self.wire);
        let at = slot * w.slot_bytes + off;
        w.ends[self.side].bounce[at..at + src.len()].copy_from_slice(src);
    }

    fn read_ring(&self, slot: usize, off: usize, dst: &mut [u8]) {
        let w = lock(&self.wire);
        let at = slot * w.slot_bytes + off;
        dst.copy_from_slice(&w.ends[self.side].ring[at..at + dst.len()]);
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        lock(&self.wire).ends[self.side].gone = true;
        self.ring_both();
    }
}

struct SimWaiter {
    rank: usize,
    fabric: Arc<Fabric>,
    seen: u64,
}

impl Waiter for SimWaiter {
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()> {
        // While the CPU sleeps the NIC works: finish every write and completion in
        // flight on this rank's wires; if there were any, there is news to poll.
        let wires = lock(&self.fabric.of_rank[self.rank]).clone();
        let mut woken = Vec::new();
        for wire in wires {
            let mut w = lock(&wire);
            if w.busy() {
                w.fast_forward();
                woken.extend(w.ranks);
            }
        }
        if !woken.is_empty() {
            for r in woken {
                self.fabric.bells[r].ring();
            }
            return Ok(());
        }
        let bell = &self.fabric.bells[self.rank];
        let g = lock(&bell.generation);
        let seen = self.seen;
        let g = wait_timeout_while(&bell.cv, g, timeout, |g| *g == seen);
        self.seen = *g;
        Ok(())
    }

    fn waker(&self) -> Option<Waker> {
        let bell = self.fabric.bells[self.rank].clone();
        Some(Waker::new(move || bell.ring()))
    }
}

struct SimConnector {
    /// This rank, in this connector's order.
    rank: usize,
    /// The fabric rank of each of this connector's ranks.
    members: Arc<[usize]>,
    /// Its group (0: the job's own links): each group's queue pairs are their own.
    group: u64,
    fabric: Arc<Fabric>,
}

impl Fabric {
    fn beacon(&self, group: u64, rank: usize) -> Arc<Beacon> {
        lock(&self.beacons)
            .entry((group, rank))
            .or_default()
            .clone()
    }
}

impl SimConnector {
    fn links(fabric: &Arc<Fabric>, group: u64, members: Arc<[usize]>, rank: usize) -> Links {
        let me = members[rank];
        Links::new(
            Box::new(SimConnector {
                rank,
                members,
                group,
                fabric: fabric.clone(),
            }),
            Box::new(SimWaiter {
                rank: me,
                fabric: fabric.clone(),
                seen: 0,
            }),
            fabric.beacon(group, me),
        )
    }
}

impl Connector for SimConnector {
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        _deadline: Instant,
    ) -> crate::error::Result<Box<dyn Link>> {
        let f = &self.fabric;
        let n = self.members.len();
        if peer >= n || peer == self.rank {
            return Err(crate::error::Error::InvalidArgument(format!(
                "rank {} cannot link to rank {peer} in a group of {n}",
                self.rank
            )));
        }
        let (me, p) = (self.members[self.rank], self.members[peer]);
        let (lo, hi) = (me.min(p), me.max(p));
        let side = usize::from(me > p);
        let p = f.params.ring;
        let mut seed = f.params.seed
            ^ ((lo as u64) << 40)
            ^ ((hi as u64) << 20)
            ^ u64::from(channel.code()) << 60
            ^ self.group;
        let wire = lock(&f.wires)
            .entry((self.group, lo, hi, channel))
            .or_insert_with(|| {
                let end = || End {
                    ring: vec![0; p.ring_bytes()],
                    bounce: vec![0; p.ring_bytes()],
                    // Set-up posts S + 1 receive requests before the peer may write.
                    recvs_posted: Endpoint::initial_recvs(&p).len() as u64,
                    ..End::default()
                };
                Arc::new(Mutex::new(Wire {
                    clock: 0,
                    rng: splitmix(&mut seed),
                    max_delay: f.params.max_delay,
                    slot_bytes: p.slot_bytes,
                    ends: [end(), end()],
                    ranks: [lo, hi],
                    fault: None,
                }))
            })
            .clone();
        {
            // A closed peer's end is gone, whenever the wire was made.
            let closed = lock(&f.closed);
            let mut w = lock(&wire);
            for (end, r) in [(0, lo), (1, hi)] {
                if closed.contains(&(self.group, r)) {
                    w.ends[end].gone = true;
                }
            }
        }
        lock(&f.of_rank[me]).push(wire.clone());
        // Side 0 is the lower rank.
        let bells = [f.bells[lo].clone(), f.bells[hi].clone()];
        let qp = SimQp {
            wire,
            side,
            bells,
            rng: splitmix(&mut seed) ^ side as u64,
        };
        Ok(Box::new(RdmaLink::new(peer, qp, p)))
    }

    fn peer_status(
        &mut self,
        peer: usize,
        _deadline: Instant,
    ) -> crate::error::Result<Option<(u64, u8)>> {
        match self.members.get(peer) {
            Some(&p) => Ok(self.fabric.beacon(self.group, p).get()),
            None => Err(crate::error::Error::InvalidArgument(format!(
                "no rank {peer} in this group"
            ))),
        }
    }

    fn close(&mut self) {
        let f = &self.fabric;
        let me = self.members[self.rank];
        lock(&f.closed).insert((self.group, me));
        // Wires this rank has an end of go when their links drop (after their writes
        // drain); the ones a peer made and this rank never took up go now.
        let mine = lock(&f.of_rank[me]).clone();
        for ((g, lo, hi, _), wire) in lock(&f.wires).iter() {
            if *g == self.group
                && (*lo == me || *hi == me)
                && !mine.iter().any(|w| Arc::ptr_eq(w, wire))
            {
                lock(wire).ends[usize::from(*hi == me)].gone = true;
            }
        }
        for b in &f.bells {
            b.ring();
        }
    }

    fn group(&mut self, spec: &GroupSpec) -> crate::error::Result<Links> {
        let rank = spec.check(self.rank, self.members.len(), self.group)?;
        let members: Arc<[usize]> = spec.members.iter().map(|&m| self.members[m]).collect();
        Ok(SimConnector::links(&self.fabric, spec.id, members, rank))
    }
}

/// Builds the connectors and waiters of `n` ranks in one process linked by simulated
/// RDMA queue pairs, rank order (like the in-process transport).
pub fn group(n: usize, params: SimParams) -> crate::error::Result<Vec<Links>> {
    params
        .ring
        .validate()
        .map_err(crate::error::Error::Config)?;
    let fabric = Arc::new(Fabric {
        params,
        bells: (0..n).map(|_| Arc::new(Bell::default())).collect(),
        beacons: Mutex::new(HashMap::new()),
        wires: Mutex::new(HashMap::new()),
        of_rank: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
        closed: Mutex::new(Default::default()),
    });
    let members: Arc<[usize]> = (0..n).collect();
    Ok((0..n)
        .map(|r| SimConnector::links(&fabric, 0, members.clone(), r))
        .collect())
}
