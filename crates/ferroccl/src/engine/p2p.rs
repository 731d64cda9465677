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
//! never wait on each other. A send to this rank itself is eager, as MPI's self-send:
//! it completes at once, its bytes kept (a copy) until the receive from itself that
//! it matches in order takes them; one that finds its receive posted already is
//! copied straight into it.
//!
//! A send completes when the transport holds its message (as today's blocking `send`:
//! a rank may send, then take part in a collective, then receive). The receiver
//! answers every message with a receipt once it has checked it, on a stream of its
//! own (the engine's collective channel, which point-to-point engines do not otherwise
//! use), so a receipt never waits behind data the sender has not asked for yet. A send
//! posted with `confirm` (every send of a [`crate::Communicator::p2p_batch`])
//! completes only on its receipt: two ranks whose batches disagree on a message (tag,
//! type, length) both fail in that call, the receiver with [`Error::Mismatch`] and the
//! sender with the receiver's notice, never one of them with Ok. The receipts of the
//! other sends are read as they come, to keep the stream in step. On an engine without
//! links of its own (a transport that makes no groups) there are no receipts: every
//! send completes when the transport holds it.
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

use super::pacer::p2p_frame_error;
use super::{Engine, Pacer};
use crate::algo;
use crate::error::{Error, Result};
use crate::trace::{now_ns, PeerCounts, RecHead};
use crate::transport::Channel;
use crate::wire::{find_notice, Fingerprint, FrameError, FrameHeader, InFrame, OutFrame};
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
    pub done: Done,
    /// When it was posted (ns since the Unix epoch), for the flight recorder.
    pub issued: u64,
    /// A send that completes only on its receipt (a batch's).
    pub confirm: bool,
}

/// Where an operation's outcome goes: called once; an operation dropped without an
/// outcome (its executor failed) tells [`Error::Poisoned`], so no waiter waits forever.
pub(crate) struct Done(Option<Box<dyn FnOnce(Result<()>) + Send>>);

impl Done {
    pub fn new(f: impl FnOnce(Result<()>) + Send + 'static) -> Self {
        Done(Some(Box::new(f)))
    }

    /// Tells the outcome.
    pub fn tell(mut self, r: Result<()>) {
        if let Some(f) = self.0.take() {
            f(r);
        }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(Err(Error::Poisoned(
                "internal: a point-to-point operation was dropped unfinished".into(),
            )));
        }
    }
}

/// Where the executor takes its operations from.
pub(crate) trait P2pSource {
    /// Appends the operations posted since the last call, in posting order; never
    /// blocks.
    fn take(&self, into: &mut Vec<P2pOp>);
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

/// A send whose data has left, waiting for its receipt: the operation itself when it
/// completes only then (`confirm`), else just what the receipt must say (its poster
/// has been told already).
struct Awaiting {
    fp: Fingerprint,
    op: Option<Active>,
}

/// Per peer: its sends and receives in posting order (the first of each moving), the
/// sends whose data has left and whose receipts are to come, and the receipts this
/// rank owes the peer.
#[derive(Default)]
struct Queues {
    sends: VecDeque<Active>,
    recvs: VecDeque<Active>,
    awaiting: VecDeque<Awaiting>,
    owed: VecDeque<FrameHeader>,
    /// The receipt being written, and the one being read.
    rcpt_out: Option<OutFrame>,
    rcpt_in: Option<InFrame>,
    /// This rank's own queues only: messages sent to itself that no receive has
    /// taken yet (eager: their sends have completed), in order.
    kept: VecDeque<(Fingerprint, Vec<u8>)>,
}

impl Queues {
    /// Whether something is to be told or written: what keeps the executor serving.
    fn busy(&self) -> bool {
        !self.sends.is_empty()
            || !self.recvs.is_empty()
            || !self.owed.is_empty()
            || self.awaiting.iter().any(|a| a.op.is_some())
    }

    fn idle(&self) -> bool {
        !self.busy() && self.awaiting.is_empty()
    }
}

/// The executor's state between calls (receipts still to come for sends already told).
#[derive(Default)]
pub(crate) struct P2pState {
    q: Vec<Queues>,
}

/// The step a receipt's header carries (data frames are step 0).
const RECEIPT_STEP: u32 = 1;

/// The receipt of a message `fp`: an empty frame whose header names it.
fn receipt(fp: &Fingerprint) -> FrameHeader {
    FrameHeader {
        fp: *fp,
        step: RECEIPT_STEP,
        seg: 0,
        len: 0,
    }
}

/// Where receipts travel: apart from the data.
const RECEIPTS: Channel = Channel::Collective;

/// What a round of the executor ended with.
enum Round {
    Moved,
    Idle,
    /// An operation's link failed: `(peer, send?, error)`.
    Failed(usize, bool, Error),
}

impl Engine {
    /// Runs the point-to-point operations `src` posts (see the module docs) until none
    /// is in flight and none more is posted; every operation taken is told its
    /// outcome. With nothing in flight on a poisoned communicator, it tells this
    /// engine's peers and shuts its links. `receipts`: this engine's collective
    /// channel is free for them (see the module docs).
    pub(crate) fn serve_p2p(&mut self, src: &dyn P2pSource, receipts: bool) {
        self.serve_p2p_until(src, receipts, &|| false);
    }

    /// [`Engine::serve_p2p`], returning early once `until` holds after a round that
    /// failed nothing: a blocking caller serves until its own operations are told,
    /// and leaves whatever else is in flight to the point-to-point thread. Returns
    /// whether something is still in flight.
    pub(crate) fn serve_p2p_until(
        &mut self,
        src: &dyn P2pSource,
        receipts: bool,
        until: &dyn Fn() -> bool,
    ) -> bool {
        let mut st = std::mem::take(&mut self.p2p_state);
        if st.q.len() != self.world_size {
            st.q = (0..self.world_size).map(|_| Queues::default()).collect();
        }
        self.serve_queues(&mut st.q, src, receipts, until);
        let left = st.q.iter().any(Queues::busy);
        self.p2p_state = st;
        left
    }

    fn serve_queues(
        &mut self,
        q: &mut [Queues],
        src: &dyn P2pSource,
        receipts: bool,
        until: &dyn Fn() -> bool,
    ) {
        let mut posted = Vec::new();
        let mut pacer: Option<Pacer> = None;
        loop {
            posted.clear();
            src.take(&mut posted);
            for op in posted.drain(..) {
                if let Err(e) = self.p2p_admissible(&op) {
                    op.done.tell(Err(e));
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
                // New work restarts the no-progress clock.
                if let Some(p) = pacer.as_mut() {
                    p.moved();
                }
            }
            let round = self.p2p_round(q, receipts);
            if !q.iter().any(Queues::busy) {
                if let Some(p) = self.health.poisoned() {
                    self.shut_after(&p);
                }
                if !matches!(round, Round::Failed(..)) {
                    return;
                }
            }
            if !matches!(round, Round::Failed(..)) && until() {
                return;
            }
            let pc =
                pacer.get_or_insert_with(|| Pacer::new(&self.cfg, self.health.clone(), self.spin));
            match round {
                Round::Moved => {
                    pc.moved();
                    continue;
                }
                Round::Idle => {}
                Round::Failed(peer, send, e) => {
                    self.p2p_fail(q, Some((peer, send)), e);
                    pacer = None;
                    continue;
                }
            }
            // Nothing moved: wait for a link, or for a peer not linked yet.
            let (peer, send, waits_for_link) = self.p2p_waiting_on(q);
            let waited = if send {
                q[peer]
                    .sends
                    .front()
                    .map(|a| a.op.fp)
                    .or(q[peer].awaiting.front().map(|a| a.fp))
            } else {
                q[peer].recvs.front().map(|a| a.op.fp)
            };
            let fp = waited.or(q[peer].owed.front().map(|h| h.fp));
            let Some(fp) = fp else {
                std::thread::yield_now();
                continue;
            };
            self.trace_waiting(peer);
            let t0 = Instant::now();
            let written = q[peer].sends.is_empty();
            let what = || match (send, written) {
                (true, true) => format!(
                    "rank {peer} to receive the message (a batch completes when every \
                     message it sent has been received: a batch whose receiver posts its \
                     receive only after this batch waits for ever)"
                ),
                (true, false) => format!("rank {peer} to take the message"),
                (false, _) => format!("a message from rank {peer}"),
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
                self.p2p_fail(q, Some((peer, send)), e);
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
            self.poison_err(&e);
            return Err(e);
        }
        Ok(())
    }

    /// The operation a wait is for: a receive that has started, else the first
    /// receive, else the first send (or one waiting for its receipt); and whether its
    /// peer is not linked yet.
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
            let p = q
                .iter()
                .position(|x| !x.sends.is_empty())
                .or_else(|| {
                    q.iter()
                        .position(|x| x.awaiting.iter().any(|a| a.op.is_some()))
                })
                .or_else(|| q.iter().position(|x| !x.owed.is_empty()))
                .unwrap_or(0);
            (p, true)
        });
        let unlinked = peer != self.rank
            && (!self.linked_now(Channel::P2p, peer)
                || (!q[peer].awaiting.is_empty() && !self.linked_now(RECEIPTS, peer)));
        (peer, send, unlinked)
    }

    /// One round: every queue's first operation moves as far as its link allows.
    fn p2p_round(&mut self, q: &mut [Queues], receipts: bool) -> Round {
        let mut moved = false;
        let me = self.rank;
        match self.p2p_with_itself(&mut q[me]) {
            Ok(m) => moved |= m,
            Err(e) => return Round::Failed(me, false, e),
        }
        for (peer, qs) in q.iter_mut().enumerate() {
            if peer == me || qs.idle() {
                continue;
            }
            if !qs.sends.is_empty() || !qs.recvs.is_empty() {
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
                match self.p2p_sends(qs, peer, receipts) {
                    Ok(m) => moved |= m,
                    Err(e) => return Round::Failed(peer, true, e),
                }
                match self.p2p_recvs(qs, peer, receipts) {
                    Ok(m) => moved |= m,
                    Err(e) => return Round::Failed(peer, false, e),
                }
            }
            if qs.owed.is_empty() && qs.awaiting.is_empty() {
                continue;
            }
            if !self.linked_now(RECEIPTS, peer) {
                if !self.connector.ready(peer, RECEIPTS) {
                    continue;
                }
                if let Err(e) = self.link(RECEIPTS, peer) {
                    match self.receipts_lost(qs, peer, e) {
                        Some(e) => return Round::Failed(peer, true, e),
                        None => {
                            moved = true;
                            continue;
                        }
                    }
                }
                moved = true;
            }
            match self.p2p_receipts(qs, peer) {
                Ok(m) => moved |= m,
                Err(e) => match self.receipts_lost(qs, peer, e) {
                    Some(e) => return Round::Failed(peer, true, e),
                    None => moved = true,
                },
            }
        }
        if moved {
            Round::Moved
        } else {
            Round::Idle
        }
    }

    /// Messages to this rank itself (its own queues `qs`), eager: a receive takes the
    /// oldest kept message, else the oldest send (copied straight across); a send that
    /// no receive takes is kept (copied) and completes. A receive that meets a message
    /// of another tag, type or length is left at the front and its mismatch returned
    /// (the message's send has completed: only the receive fails). Whether anything
    /// moved.
    fn p2p_with_itself(&mut self, qs: &mut Queues) -> Result<bool> {
        let me = self.rank;
        let mut moved = false;
        while let Some(mut r) = qs.recvs.pop_front() {
            let from_kept = !qs.kept.is_empty();
            let fp = match (qs.kept.front(), qs.sends.front()) {
                (Some((fp, _)), _) => *fp,
                (None, Some(s)) => s.op.fp,
                (None, None) => {
                    qs.recvs.push_front(r);
                    break;
                }
            };
            moved = true;
            if fp != r.op.fp {
                qs.recvs.push_front(r);
                return Err(Error::Mismatch {
                    rank: me,
                    peer: me,
                    ours: qs.recvs[0].op.fp.to_string(),
                    theirs: fp.to_string(),
                });
            }
            let dst = r.op.buf.write();
            if from_kept {
                if let Some((_, bytes)) = qs.kept.pop_front() {
                    crate::sys::mem::copy(dst, &bytes);
                }
            } else if let Some(s) = qs.sends.pop_front() {
                crate::sys::mem::copy(dst, s.op.buf.read());
                self.p2p_record(&s, None);
                s.op.done.tell(Ok(()));
            }
            self.p2p_record(&r, None);
            r.op.done.tell(Ok(()));
        }
        while let Some(s) = qs.sends.pop_front() {
            moved = true;
            qs.kept.push_back((s.op.fp, s.op.buf.read().to_vec()));
            self.p2p_record(&s, None);
            s.op.done.tell(Ok(()));
        }
        Ok(moved)
    }

    /// The receipts with `peer` cannot move (`e`): the peer failed or is gone. Only a
    /// send that waits for its receipt fails for it (with the notice the peer left on
    /// its data link, if any); receipts owed to a gone sender, or to come for sends
    /// already told, are let go.
    fn receipts_lost(&mut self, qs: &mut Queues, peer: usize, e: Error) -> Option<Error> {
        qs.owed.clear();
        qs.rcpt_out = None;
        let confirmed = qs.awaiting.iter().find_map(|a| a.op.as_ref().map(|_| a.fp));
        match confirmed {
            Some(fp) => Some(self.notice_of(peer, &fp).unwrap_or(e)),
            None => {
                tracing::debug!(rank = self.rank, "receipts with rank {peer} let go: {e}");
                qs.awaiting.clear();
                qs.rcpt_in = None;
                None
            }
        }
    }

    /// Moves `peer`'s sends in order as far as its link takes them; a send whose data
    /// has left waits for its receipt (a confirmed one before it is done).
    fn p2p_sends(&mut self, qs: &mut Queues, peer: usize, receipts: bool) -> Result<bool> {
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
                    .map_err(|e| p2p_frame_error(rank, e, link, peer, &a.op.fp))?;
                moved |= m > 0;
                if !sent {
                    return Ok(moved);
                }
                a.out = None;
                a.next += 1;
                moved = true;
            }
            let Some(a) = qs.sends.pop_front() else { break };
            let fp = a.op.fp;
            let op = if receipts && a.op.confirm {
                Some(a)
            } else {
                self.p2p_record(&a, None);
                a.op.done.tell(Ok(()));
                None
            };
            if receipts {
                qs.awaiting.push_back(Awaiting { fp, op });
            }
        }
        Ok(moved)
    }

    /// Writes the receipts owed to `peer` and reads the ones it owes, in order; a
    /// confirmed send whose receipt came is done.
    fn p2p_receipts(&mut self, qs: &mut Queues, peer: usize) -> Result<bool> {
        let rank = self.rank;
        let mut moved = false;
        while let Some(h) = qs.owed.front() {
            let frame = qs.rcpt_out.get_or_insert_with(|| OutFrame::new(h));
            let link = self.link(RECEIPTS, peer)?;
            let (m, sent) = frame
                .progress(link, &[])
                .map_err(|e| p2p_frame_error(rank, e, link, peer, &h.fp))?;
            moved |= m > 0;
            if !sent {
                break;
            }
            qs.rcpt_out = None;
            qs.owed.pop_front();
            moved = true;
        }
        while let Some(a) = qs.awaiting.front() {
            let fp = a.fp;
            let frame = qs.rcpt_in.get_or_insert_with(|| InFrame::new(receipt(&fp)));
            let link = self.link(RECEIPTS, peer)?;
            let (m, got) = frame
                .progress(link, &mut [])
                .map_err(|e| p2p_frame_error(rank, e, link, peer, &fp))?;
            moved |= m > 0;
            if !got {
                break;
            }
            qs.rcpt_in = None;
            if let Some(a) = qs.awaiting.pop_front().and_then(|w| w.op) {
                self.p2p_record(&a, None);
                a.op.done.tell(Ok(()));
            }
            moved = true;
        }
        Ok(moved)
    }

    /// The notice `peer` left on its data link before it closed it, as the error of
    /// `fp` here (only once the peer is known to have failed: it reads the link).
    fn notice_of(&mut self, peer: usize, fp: &Fingerprint) -> Option<Error> {
        let rank = self.rank;
        let data = self.try_link(Channel::P2p, peer).ok()??;
        match find_notice(data)? {
            FrameError::Notice { origin, cause } => Some(Error::PeerFailed {
                rank,
                peer,
                origin,
                cause: Box::new(Error::from_wire(&cause)),
                op: fp.to_string(),
            }),
            _ => None,
        }
    }

    /// Moves `peer`'s receives in order as far as its link brings them; a receive done
    /// owes its sender a receipt (with `receipts`).
    fn p2p_recvs(&mut self, qs: &mut Queues, peer: usize, receipts: bool) -> Result<bool> {
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
                    .map_err(|e| p2p_frame_error(rank, e, link, peer, &a.op.fp))?;
                moved |= m > 0;
                if !got {
                    return Ok(moved);
                }
                a.inp = None;
                a.next += 1;
                moved = true;
            }
            let Some(a) = qs.recvs.pop_front() else { break };
            if receipts {
                qs.owed.push_back(receipt(&a.op.fp));
            }
            self.p2p_record(&a, None);
            a.op.done.tell(Ok(()));
        }
        Ok(moved)
    }

    /// A failure: the operation it happened to (`at`: peer and direction) gets `e`,
    /// the communicator is poisoned (peers told, links shut), every other operation in
    /// flight fails with [`Error::Poisoned`].
    fn p2p_fail(&mut self, q: &mut [Queues], at: Option<(usize, bool)>, e: Error) {
        let e = self.in_group(e);
        let (origin, cause) = self.origin_of(&e);
        self.poison_with(origin, &cause, e.to_string());
        let why = self.poisoned().unwrap_or_else(|| e.to_string());
        let first = at.and_then(|(p, send)| {
            if send {
                q[p].sends
                    .pop_front()
                    .or_else(|| q[p].awaiting.iter_mut().find_map(|a| a.op.take()))
            } else {
                q[p].recvs.pop_front()
            }
        });
        if let Some(a) = first {
            self.p2p_record(&a, Some(&e));
            a.op.done.tell(Err(e));
        }
        for qs in q.iter_mut() {
            qs.owed.clear();
            qs.kept.clear();
            let (_, _) = (qs.rcpt_out.take(), qs.rcpt_in.take());
            let waiting = qs.awaiting.drain(..).filter_map(|w| w.op);
            let all: Vec<Active> = qs
                .sends
                .drain(..)
                .chain(qs.recvs.drain(..))
                .chain(waiting)
                .collect();
            for a in all {
                let e = Error::Poisoned(why.clone());
                self.p2p_record(&a, Some(&e));
                a.op.done.tell(Err(e));
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
