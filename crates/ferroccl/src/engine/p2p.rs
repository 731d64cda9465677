//! The point-to-point executor: sends and receives posted at any time, to and from any
//! peers, all moving at once.
//!
//! A communicator's point-to-point operations run on an engine of their own (links
//! apart from its collectives', a thread apart), so they progress whatever the
//! collectives do. Operations are matched per pair of ranks and direction in the order
//! they were posted (a link is a stream: the receiver's next receive from a rank takes
//! that rank's next send to it, and the two must agree on tag, type and length, or
//! both fail with a mismatch). Between different peers and directions nothing is
//! ordered: every queue's first operation moves as far as its link allows in each
//! round, so any order of posting completes — two ranks that both send 64 MiB to each
//! other before receiving, or a ring of ranks each sending right and receiving left,
//! never wait on each other. A send or receive with this rank itself is matched with
//! its counterpart here and copied.
//!
//! A peer not linked yet is linked only once that costs no wait (the peer has dialled
//! in, or this rank dials: [`crate::transport::Connector::ready`]), so one peer that
//! has not posted anything yet holds up nobody else.
//!
//! Failures are the communicator's: a mismatch, a lost peer, a timeout (no operation
//! progressed for [`crate::config::Tuning::timeout`] while some were waiting) or an
//! abort fails the operation it happened to with that error, and poisons the
//! communicator (notices to every peer, links shut), so every other operation, now or
//! later, fails with [`Error::Poisoned`].

use super::pacer::frame_error;
use super::{Engine, Pacer};
use crate::algo;
use crate::error::{Error, Result};
use crate::trace::{now_ns, PeerCounts, RecHead};
use crate::transport::Channel;
use crate::wire::{Fingerprint, FrameHeader, InFrame, OutFrame};
use std::collections::VecDeque;
use std::time::Instant;

/// The memory of a posted operation: what it sends from or receives into. The poster
/// keeps it valid and untouched by anything else until the operation's `done` has run.
pub(crate) trait OpBuffer: Send {
    /// The bytes a send reads.
    fn read(&self) -> &[u8];
    /// The bytes a receive writes.
    fn write(&mut self) -> &mut [u8];
}

/// One posted send or receive.
pub(crate) struct P2pOp {
    /// A send (else a receive).
    pub send: bool,
    /// The peer (this rank itself: matched here).
    pub peer: usize,
    /// The message as both ranks must see it (kind `SendRecv`, the pair's sequence
    /// number, tag, dtype, count).
    pub fp: Fingerprint,
    /// Bytes per frame.
    pub seg: usize,
    pub buf: Box<dyn OpBuffer>,
    /// Told the outcome, once, when the operation is over.
    pub done: Box<dyn FnOnce(Result<()>) + Send>,
    /// When it was posted (ns since the Unix epoch), for the flight recorder.
    pub issued: u64,
}

/// Where the executor takes its operations from.
pub(crate) trait P2pSource {
    /// Appends the operations posted since the last call, in posting order; never
    /// blocks.
    fn take(&self, into: &mut Vec<P2pOp>);
    /// Called with nothing in flight: blocks until something was posted (true), or
    /// returns false when the executor is to stop.
    fn wait(&self) -> bool;
}

/// An operation in flight: its frames so far.
struct Active {
    op: P2pOp,
    /// Frames in all, and the next one to move.
    frames: u32,
    next: u32,
    out: Option<OutFrame>,
    inp: Option<InFrame>,
    start_ns: u64,
}

impl Active {
    fn new(op: P2pOp) -> Self {
        let frames = algo::schedule::segments(op.fp.count as usize * op.fp.dtype.size(), op.seg)
            .max(1) as u32;
        Active {
            op,
            frames,
            next: 0,
            out: None,
            inp: None,
            start_ns: 0,
        }
    }

    /// The bytes of frame `j` in the buffer.
    fn range(&self, j: u32) -> std::ops::Range<usize> {
        let len = self.op.fp.count as usize * self.op.fp.dtype.size();
        let start = (j as usize * self.op.seg).min(len);
        start..(start + self.op.seg).min(len)
    }

    fn header(&self, j: u32) -> FrameHeader {
        FrameHeader {
            fp: self.op.fp,
            step: 0,
            seg: j,
            len: self.range(j).len() as u32,
        }
    }
}

/// Per peer: its sends and receives in posting order (the first of each moving).
#[derive(Default)]
struct Queues {
    sends: VecDeque<Active>,
    recvs: VecDeque<Active>,
}

/// What a round of the executor ended with.
enum Round {
    Moved,
    Idle,
    /// An operation's link failed: `(peer, send?, error)`.
    Failed(usize, bool, Error),
}

impl Engine {
    /// Runs the point-to-point operations `src` posts until it says stop (see the
    /// module docs). Every operation taken is told its outcome.
    pub(crate) fn serve_p2p(&mut self, src: &dyn P2pSource) {
        let n = self.world_size;
        let mut q: Vec<Queues> = (0..n).map(|_| Queues::default()).collect();
        let mut active = 0usize;
        let mut posted = Vec::new();
        let mut pacer: Option<Pacer> = None;
        loop {
            posted.clear();
            src.take(&mut posted);
            for op in posted.drain(..) {
                if let Err(e) = self.p2p_admissible(&op) {
                    (op.done)(Err(e));
                    continue;
                }
                let peer = op.peer;
                let mut a = Active::new(op);
                a.start_ns = now_ns();
                if a.op.send {
                    q[peer].sends.push_back(a);
                } else {
                    q[peer].recvs.push_back(a);
                }
                active += 1;
                // New work restarts the no-progress clock.
                if let Some(p) = pacer.as_mut() {
                    p.moved();
                }
            }
            if active == 0 {
                pacer = None;
                if let Some(p) = self.health.poisoned() {
                    self.shut_after(&p);
                }
                if !src.wait() {
                    return;
                }
                continue;
            }
            let pc =
                pacer.get_or_insert_with(|| Pacer::new(&self.cfg, self.health.clone(), self.spin));
            match self.p2p_round(&mut q, &mut active) {
                Round::Moved => {
                    pc.moved();
                    continue;
                }
                Round::Idle => {}
                Round::Failed(peer, send, e) => {
                    self.p2p_fail(&mut q, &mut active, Some((peer, send)), e);
                    pacer = None;
                    continue;
                }
            }
            // Nothing moved: wait for a link, or for a peer not linked yet.
            let (peer, send, waits_for_link) = self.p2p_waiting_on(&q);
            let fp = {
                let a = if send {
                    &q[peer].sends[0]
                } else {
                    &q[peer].recvs[0]
                };
                a.op.fp
            };
            self.trace_waiting(peer);
            let t0 = Instant::now();
            let what = || {
                if send {
                    format!("rank {peer} to take the message")
                } else {
                    format!("a message from rank {peer}")
                }
            };
            let r = if waits_for_link {
                // Nothing wakes this thread when a peer dials in: look again soon.
                pc.idle_poll(self.rank, &fp, what)
            } else {
                pc.idle(&mut *self.waiter, self.rank, &fp, what)
            };
            self.trace_waited(peer, t0.elapsed().as_nanos() as u64);
            if let Err(e) = r {
                let e = self.locate_on_timeout(Err(e), &fp, || vec![peer]);
                let e = e.err().unwrap_or(Error::Poisoned("timeout".into()));
                self.p2p_fail(&mut q, &mut active, Some((peer, send)), e);
                pacer = None;
            }
        }
    }

    /// Refuses an operation the communicator can no longer run (poisoned, aborted).
    fn p2p_admissible(&mut self, op: &P2pOp) -> Result<()> {
        if let Some(p) = self.health.poisoned() {
            self.shut_after(&p);
            return Err(Error::Poisoned(p.why));
        }
        if self.health.abort.load(std::sync::atomic::Ordering::Relaxed) {
            let e = Error::Aborted {
                rank: self.rank,
                op: format!("{} (abort() came before it started)", op.fp),
            };
            self.poison(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// The operation a wait is for: a receive that has started, else the first
    /// receive, else the first send; and whether its peer is not linked yet.
    fn p2p_waiting_on(&mut self, q: &[Queues]) -> (usize, bool, bool) {
        let mut pick = None;
        for (p, qs) in q.iter().enumerate() {
            if let Some(a) = qs.recvs.front() {
                if a.inp.is_some() || pick.is_none() {
                    pick = Some((p, false));
                    if a.inp.is_some() {
                        break;
                    }
                }
            }
        }
        let (peer, send) = pick.unwrap_or_else(|| {
            let p = q.iter().position(|x| !x.sends.is_empty()).unwrap_or(0);
            (p, true)
        });
        let unlinked = peer != self.rank && !self.linked_now(Channel::P2p, peer);
        (peer, send, unlinked)
    }

    /// One round: every queue's first operation moves as far as its link allows.
    fn p2p_round(&mut self, q: &mut [Queues], active: &mut usize) -> Round {
        let mut moved = false;
        let me = self.rank;
        // With itself: a send and a receive, matched in order, copied.
        while let (Some(_), Some(_)) = (q[me].sends.front(), q[me].recvs.front()) {
            let (Some(s), Some(mut r)) = (q[me].sends.pop_front(), q[me].recvs.pop_front()) else {
                break;
            };
            *active -= 2;
            moved = true;
            if s.op.fp != r.op.fp {
                let e = Error::Mismatch {
                    rank: me,
                    peer: me,
                    ours: r.op.fp.to_string(),
                    theirs: s.op.fp.to_string(),
                };
                self.p2p_record(&s, Some(&e));
                (s.op.done)(Err(Error::Poisoned(e.to_string())));
                q[me].recvs.push_front(r);
                *active += 1;
                return Round::Failed(me, false, e);
            }
            let (src, dst) = (s.op.buf.read(), r.op.buf.write());
            if src.len() == dst.len() {
                dst.copy_from_slice(src);
            }
            self.p2p_record(&s, None);
            self.p2p_record(&r, None);
            (s.op.done)(Ok(()));
            (r.op.done)(Ok(()));
        }
        for (peer, qs) in q.iter_mut().enumerate() {
            if peer == me || (qs.sends.is_empty() && qs.recvs.is_empty()) {
                continue;
            }
            if !self.linked_now(Channel::P2p, peer) {
                if !self.connector.ready(peer, Channel::P2p) {
                    continue;
                }
                if let Err(e) = self.link(Channel::P2p, peer) {
                    let send = qs.recvs.is_empty();
                    return Round::Failed(peer, send, e);
                }
                moved = true;
            }
            match self.p2p_sends(qs, peer, active) {
                Ok(m) => moved |= m,
                Err(e) => return Round::Failed(peer, true, e),
            }
            match self.p2p_recvs(qs, peer, active) {
                Ok(m) => moved |= m,
                Err(e) => return Round::Failed(peer, false, e),
            }
        }
        if moved {
            Round::Moved
        } else {
            Round::Idle
        }
    }

    /// Moves `peer`'s sends in order as far as its link takes them.
    fn p2p_sends(&mut self, qs: &mut Queues, peer: usize, active: &mut usize) -> Result<bool> {
        let rank = self.rank;
        let mut moved = false;
        while let Some(a) = qs.sends.front_mut() {
            if a.next == 0 && a.out.is_none() {
                self.beacon.set(a.op.fp.seq, a.op.fp.kind.code());
            }
            while a.next < a.frames {
                let j = a.next;
                let r = a.range(j);
                let h = a.header(j);
                let frame = a.out.get_or_insert_with(|| OutFrame::new(&h));
                let link = self.link(Channel::P2p, peer)?;
                let bytes = a.op.buf.read();
                let (m, sent) = frame
                    .progress(link, &bytes[r])
                    .map_err(|e| frame_error(rank, e, link, peer, &a.op.fp))?;
                moved |= m > 0;
                if !sent {
                    return Ok(moved);
                }
                a.out = None;
                a.next += 1;
                moved = true;
            }
            let Some(a) = qs.sends.pop_front() else { break };
            *active -= 1;
            self.p2p_record(&a, None);
            (a.op.done)(Ok(()));
        }
        Ok(moved)
    }

    /// Moves `peer`'s receives in order as far as its link brings them.
    fn p2p_recvs(&mut self, qs: &mut Queues, peer: usize, active: &mut usize) -> Result<bool> {
        let rank = self.rank;
        let mut moved = false;
        while let Some(a) = qs.recvs.front_mut() {
            if a.next == 0 && a.inp.is_none() {
                self.beacon.set(a.op.fp.seq, a.op.fp.kind.code());
            }
            while a.next < a.frames {
                let j = a.next;
                let r = a.range(j);
                let h = a.header(j);
                let frame = a.inp.get_or_insert_with(|| InFrame::new(h));
                let link = self.link(Channel::P2p, peer)?;
                let bytes = a.op.buf.write();
                let (m, got) = frame
                    .progress(link, &mut bytes[r])
                    .map_err(|e| frame_error(rank, e, link, peer, &a.op.fp))?;
                moved |= m > 0;
                if !got {
                    return Ok(moved);
                }
                a.inp = None;
                a.next += 1;
                moved = true;
            }
            let Some(a) = qs.recvs.pop_front() else { break };
            *active -= 1;
            self.p2p_record(&a, None);
            (a.op.done)(Ok(()));
        }
        Ok(moved)
    }

    /// A failure: the operation it happened to (`at`: peer and direction) gets `e`,
    /// the communicator is poisoned (peers told, links shut), every other operation in
    /// flight fails with [`Error::Poisoned`].
    fn p2p_fail(
        &mut self,
        q: &mut [Queues],
        active: &mut usize,
        at: Option<(usize, bool)>,
        e: Error,
    ) {
        let e = self.in_group(e);
        let (origin, cause) = self.origin_of(&e);
        self.poison_with(origin, &cause, e.to_string());
        let why = self.poisoned().unwrap_or_else(|| e.to_string());
        let mut first = at.and_then(|(p, send)| {
            if send {
                q[p].sends.pop_front()
            } else {
                q[p].recvs.pop_front()
            }
        });
        if let Some(a) = first.take() {
            *active -= 1;
            self.p2p_record(&a, Some(&e));
            (a.op.done)(Err(e));
        }
        for qs in q.iter_mut() {
            for a in qs.sends.drain(..).chain(qs.recvs.drain(..)) {
                *active -= 1;
                let e = Error::Poisoned(why.clone());
                self.p2p_record(&a, Some(&e));
                (a.op.done)(Err(e));
            }
        }
        let r: Result<()> = Err(Error::Poisoned(why));
        self.trace_end(&r);
    }

    /// Keeps an operation's record in the flight recorder.
    fn p2p_record(&mut self, a: &Active, e: Option<&Error>) {
        if self.cfg.trace_capacity == 0 {
            return;
        }
        let fp = &a.op.fp;
        let head = RecHead {
            seq: fp.seq,
            kind: fp.kind.code(),
            dtype: fp.dtype.code(),
            op: 255,
            count: fp.count,
            root: fp.root.unwrap_or(u32::MAX),
            algo: fp.algo.code(),
            enqueue_ns: a.op.issued.min(a.start_ns),
            start_ns: a.start_ns,
        };
        let mut peers = PeerCounts::default();
        let bytes = a.op.buf_len() as u64;
        let moved = a.frames as u64 * crate::wire::HEADER_LEN as u64 + bytes;
        if a.op.send {
            peers.add(a.op.peer, moved, 0);
        } else {
            peers.add(a.op.peer, 0, moved);
        }
        self.rec.end(
            head,
            e.map(|e| e.to_string().into_boxed_str()),
            e.map(|_| a.op.peer),
            peers,
        );
    }
}

impl P2pOp {
    /// Payload bytes of the message.
    fn buf_len(&self) -> usize {
        self.fp.count as usize * self.fp.dtype.size()
    }
}
