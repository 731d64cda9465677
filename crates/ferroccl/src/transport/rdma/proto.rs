//! The sans-IO protocol of an RDMA link: slot and credit bookkeeping, which work
//! requests to post and what each completion means. Nothing here touches verbs, a
//! clock or a thread; [`super::sim`] drives it in tests and `super::verbs` (feature
//! `rdma`) drives it over a real queue pair.
//!
//! # The protocol, one direction
//!
//! The receiver owns a *ring* of `S` slots of `B` bytes each, registered for remote
//! write. The sender owns a *bounce* buffer of the same shape, registered locally.
//! Slots are used in sequence: the `k`-th slot ever sent (its *sequence number* `k`,
//! counted from 0) lives at index `k % S` on both sides.
//!
//! * To send, the sender copies up to `B` bytes into bounce slot `k % S` and posts an
//!   RDMA WRITE WITH IMMEDIATE from it into ring slot `k % S`. The immediate carries the
//!   length and the low 7 bits of `k` ([`encode_imm`]); it consumes one receive work
//!   request at the receiver and yields one receive completion there.
//! * The receiver learns of slot `k` from its receive completion (RC delivers them in
//!   posting order, and data written by a WRITE WITH IMMEDIATE is in memory when its
//!   completion is polled). It reposts the receive work request at once (it names no
//!   memory), and hands the slot's bytes to `read` in order.
//! * When `read` has drained a slot, the slot is *freed*. The receiver tells the sender
//!   how many slots it has freed in all, `freed`, by an RDMA WRITE (inline, unsignalled
//!   at the peer: no receive request is consumed) of that 64-bit counter into the
//!   sender's *credit word*. At most one credit write is in flight; it is posted when
//!   `batch` slots have been freed since the last one, or when the receiver has nothing
//!   left to read (so a sender blocked on credits is always released).
//! * The sender may write sequence number `k` only when `k < credit_word + S` (the
//!   ring slot is free) **and** its own previous use of the bounce slot, sequence
//!   `k - S`, has completed locally (the NIC is done reading it).
//! * A close is one more WRITE WITH IMMEDIATE, with the close bit set and no data; the
//!   receiver posts `S + 1` receive requests at set-up so it always has one for it.
//!
//! # Invariants (checked by the property tests in `tests/suite/rdma_proto.rs`)
//!
//! 1. **No overwrite of unread data.** A write of sequence `k` is posted only when the
//!    receiver has freed sequence `k - S`, which is the previous occupant of the ring
//!    slot. Since `credit_word` is the receiver's own count of freed slots, and the
//!    sender checks `freed ≤ sent` on every credit it sees, credits never exceed `S`:
//!    `0 ≤ (credit_word + S) - next ≤ S`.
//! 2. **No reuse of a bounce slot in flight.** Sequence `k` is copied into the bounce
//!    buffer only after the send completion of `k - S`. For the data the peer reads this
//!    looks implied by invariant 1 (the peer freed `k - S`, so it landed), but it is not:
//!    when an ACK is lost, RC retransmits the write, the NIC re-reads the bounce slot
//!    and the responder executes the duplicate write again, into a ring slot that may
//!    hold newer data. It also bounds the send queue at `S` data writes. Completions may
//!    be seen in any order (the bookkeeping is a bitmap), which is more than RC needs.
//! 3. **In order, exactly once.** The receiver accepts only the receive completion
//!    whose tag is its next expected sequence number, at most `S` unread slots at a time
//!    (a sender that overruns its credits is a protocol error, not silent corruption);
//!    `read` hands out each byte of each slot once, slot after slot.
//! 4. **Receive requests never run out.** `S + 1` are posted at set-up; each data
//!    completion reposts one; at most `S` data writes and one close are ever unanswered.
//! 5. **No deadlock.** A sender with no credits has `S` unfreed slots at the receiver;
//!    either the reader drains them (and returns credits after `batch ≤ S` slots, or as
//!    soon as it runs dry), or the reader does not want the bytes — which is its
//!    application's business, not the transport's.
//!
//! Anything the peer controls (immediates, credit values, completion identifiers) is
//! checked and turns into a [`ProtoError`], never a panic.

use std::collections::VecDeque;

/// The largest slot size the immediate's 24-bit length field can describe.
pub const MAX_SLOT_BYTES: usize = (1 << 24) - 1;

const IMM_CLOSE: u32 = 1 << 31;
const IMM_TAG_SHIFT: u32 = 24;
const IMM_TAG_MASK: u64 = 0x7f;
const IMM_LEN_MASK: u32 = (1 << 24) - 1;

const KIND_SHIFT: u32 = 62;
const KIND_DATA: u64 = 0;
const KIND_CREDIT: u64 = 1;
const KIND_CLOSE: u64 = 2;
const KIND_RECV: u64 = 3;
const ID_MASK: u64 = (1 << KIND_SHIFT) - 1;

/// The shape of a link's rings, equal on both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Slots in the receive ring (`S`), at least 1.
    pub slots: usize,
    /// Bytes per slot (`B`), `1..=MAX_SLOT_BYTES`.
    pub slot_bytes: usize,
    /// Freed slots the receiver gathers before it returns credits, `1..=slots` (it also
    /// returns them whenever it has nothing left to read).
    pub credit_batch: usize,
}

impl Params {
    /// Checks the ranges documented on the fields.
    pub fn validate(&self) -> Result<(), String> {
        if self.slots == 0 || self.slots > (1 << 20) {
            return Err(format!("rdma ring of {} slots: need 1..=2^20", self.slots));
        }
        if self.slot_bytes == 0 || self.slot_bytes > MAX_SLOT_BYTES {
            return Err(format!(
                "rdma slot of {} bytes: need 1..={MAX_SLOT_BYTES}",
                self.slot_bytes
            ));
        }
        if self.credit_batch == 0 || self.credit_batch > self.slots {
            return Err(format!(
                "rdma credit batch {} must be in 1..={}",
                self.credit_batch, self.slots
            ));
        }
        Ok(())
    }

    /// Bytes of one ring (and of one bounce buffer): `slots * slot_bytes`.
    pub fn ring_bytes(&self) -> usize {
        self.slots * self.slot_bytes
    }
}

impl Default for Params {
    /// 16 slots of 128 KiB, credits returned every 4 slots.
    fn default() -> Self {
        Params {
            slots: 16,
            slot_bytes: 128 << 10,
            credit_batch: 4,
        }
    }
}

/// What the driver must post on the queue pair, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkRequest {
    /// RDMA WRITE WITH IMMEDIATE of `len` bytes from local bounce slot `slot` to the
    /// peer's ring slot `slot`, signalled.
    WriteData {
        /// Identifies the send completion.
        wr_id: u64,
        /// Slot index on both sides.
        slot: usize,
        /// Bytes, `1..=slot_bytes`.
        len: usize,
        /// The immediate ([`encode_imm`]).
        imm: u32,
    },
    /// RDMA WRITE (inline, signalled) of the 8 bytes of `freed` (native endian) into
    /// the peer's credit word.
    WriteCredit {
        /// Identifies the send completion.
        wr_id: u64,
        /// Slots of the peer's stream this end has freed, in all.
        freed: u64,
    },
    /// RDMA WRITE WITH IMMEDIATE of no bytes with the close bit set: the peer's reads
    /// end after the data before it.
    WriteClose {
        /// Identifies the send completion.
        wr_id: u64,
        /// The immediate.
        imm: u32,
    },
    /// A receive work request with no scatter list (a WRITE WITH IMMEDIATE consumes one).
    PostRecv {
        /// Identifies the receive completion (unused: receive completions are matched
        /// by order and immediate).
        wr_id: u64,
    },
}

/// What the driver polled from the completion queue, for this queue pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A signalled send work request finished successfully.
    Sent {
        /// The request's identifier.
        wr_id: u64,
    },
    /// A WRITE WITH IMMEDIATE from the peer landed.
    Received {
        /// Its immediate.
        imm: u32,
    },
    /// A work request finished in error (the queue pair is now in the error state).
    Failed {
        /// The request's identifier.
        wr_id: u64,
        /// The status, in words.
        status: String,
        /// Whether the status means the peer is unreachable or gone (retries exhausted,
        /// remote queue pair destroyed) rather than a local fault.
        peer_lost: bool,
    },
}

/// A protocol violation, or a failed work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtoError {
    /// The peer broke the protocol (bad immediate, credits beyond what was sent, a write
    /// beyond its credits).
    Violation(String),
    /// A work request failed for a local reason.
    Failed(String),
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProtoError::Violation(s) => write!(f, "rdma protocol violation: {s}"),
            ProtoError::Failed(s) => write!(f, "rdma work request failed: {s}"),
        }
    }
}

/// The immediate of a data write: `len` in the low 24 bits, the low 7 bits of the
/// sequence number above them, and the close bit (31) clear.
pub fn encode_imm(seq: u64, len: usize) -> u32 {
    debug_assert!(len <= MAX_SLOT_BYTES);
    (((seq & IMM_TAG_MASK) as u32) << IMM_TAG_SHIFT) | (len as u32 & IMM_LEN_MASK)
}

/// The immediate of a close.
pub fn close_imm() -> u32 {
    IMM_CLOSE
}

/// The sending half: which bounce/ring slots it may fill, and what its completions free.
#[derive(Debug)]
pub struct Sender {
    p: Params,
    /// Sequence number of the next slot to send.
    next: u64,
    /// May send sequence numbers below this: the peer's freed count plus `S`.
    limit: u64,
    /// Every sequence below this has completed locally.
    done_below: u64,
    /// Completion flags of sequences `done_below..next`.
    done: VecDeque<bool>,
    close_posted: bool,
}

impl Sender {
    fn new(p: Params) -> Self {
        Sender {
            p,
            next: 0,
            limit: p.slots as u64,
            done_below: 0,
            done: VecDeque::new(),
            close_posted: false,
        }
    }

    /// Slots this sender may still fill before it hears of more freed ones.
    pub fn credits(&self) -> u64 {
        self.limit - self.next
    }

    /// Sequence number of the next slot to send.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// The slot index the next write goes to, if both the peer's ring slot and the local
    /// bounce slot are free.
    pub fn writable(&self) -> Option<usize> {
        let s = self.p.slots as u64;
        if self.close_posted || self.next >= self.limit || self.next >= self.done_below + s {
            return None;
        }
        Some((self.next % s) as usize)
    }

    /// The driver has copied `len` bytes into bounce slot [`Sender::writable`]: the write
    /// that sends them.
    fn commit(&mut self, len: usize) -> WorkRequest {
        assert!(self.writable().is_some(), "commit without a writable slot");
        assert!(len >= 1 && len <= self.p.slot_bytes, "slot length {len}");
        let seq = self.next;
        self.next += 1;
        self.done.push_back(false);
        WorkRequest::WriteData {
            wr_id: (KIND_DATA << KIND_SHIFT) | seq,
            slot: (seq % self.p.slots as u64) as usize,
            len,
            imm: encode_imm(seq, len),
        }
    }

    fn on_sent(&mut self, seq: u64) -> Result<(), ProtoError> {
        if seq < self.done_below || seq >= self.next {
            return Err(ProtoError::Violation(format!(
                "send completion for slot #{seq}, outstanding are #{}..#{}",
                self.done_below, self.next
            )));
        }
        let i = (seq - self.done_below) as usize;
        if self.done[i] {
            return Err(ProtoError::Violation(format!(
                "second send completion for slot #{seq}"
            )));
        }
        self.done[i] = true;
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.done_below += 1;
        }
        Ok(())
    }

    /// The peer says it has freed `freed` slots of this stream in all. Stale (smaller)
    /// values are ignored; a value beyond what was sent is a violation.
    pub fn on_credit(&mut self, freed: u64) -> Result<(), ProtoError> {
        if freed > self.next {
            return Err(ProtoError::Violation(format!(
                "peer freed {freed} slots but only {} were sent",
                self.next
            )));
        }
        self.limit = self.limit.max(freed + self.p.slots as u64);
        Ok(())
    }

    /// Whether every write posted so far has completed locally.
    pub fn idle(&self) -> bool {
        self.done_below == self.next
    }
}

/// The receiving half: which ring bytes are readable, and when credits go back.
#[derive(Debug)]
pub struct Receiver {
    p: Params,
    /// Data completions seen (the next expected sequence number).
    arrived: u64,
    /// Lengths of slots `freed..arrived`.
    ready: VecDeque<usize>,
    /// Bytes of the head slot already read.
    head_off: usize,
    /// Slots drained by `read`.
    freed: u64,
    /// The `freed` value most recently posted in a credit write.
    returned: u64,
    credit_in_flight: bool,
    peer_closed: bool,
}

impl Receiver {
    fn new(p: Params) -> Self {
        Receiver {
            p,
            arrived: 0,
            ready: VecDeque::new(),
            head_off: 0,
            freed: 0,
            returned: 0,
            credit_in_flight: false,
            peer_closed: false,
        }
    }

    /// Slots drained so far.
    pub fn freed(&self) -> u64 {
        self.freed
    }

    /// Data slots received so far.
    pub fn arrived(&self) -> u64 {
        self.arrived
    }

    /// Whether the peer's close arrived.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The head of the readable data: `(slot index, offset in slot, bytes left in it)`.
    pub fn readable(&self) -> Option<(usize, usize, usize)> {
        let len = *self.ready.front()?;
        let slot = (self.freed % self.p.slots as u64) as usize;
        Some((slot, self.head_off, len - self.head_off))
    }

    /// `n` bytes of the head slot were read (at most what [`Receiver::readable`] said).
    fn consume(&mut self, n: usize) {
        let Some(&len) = self.ready.front() else {
            assert_eq!(n, 0, "consumed bytes that were not readable");
            return;
        };
        assert!(self.head_off + n <= len, "consumed past the slot");
        self.head_off += n;
        if self.head_off == len {
            self.ready.pop_front();
            self.head_off = 0;
            self.freed += 1;
        }
    }

    fn on_received(&mut self, imm: u32) -> Result<Option<WorkRequest>, ProtoError> {
        if self.peer_closed {
            return Err(ProtoError::Violation(format!(
                "a write (immediate {imm:#x}) arrived after the peer's close"
            )));
        }
        if imm & IMM_CLOSE != 0 {
            self.peer_closed = true;
            return Ok(None);
        }
        let tag = (imm >> IMM_TAG_SHIFT) as u64 & IMM_TAG_MASK;
        let len = (imm & IMM_LEN_MASK) as usize;
        if tag != self.arrived & IMM_TAG_MASK {
            return Err(ProtoError::Violation(format!(
                "expected slot #{} (tag {}), the immediate says tag {tag}",
                self.arrived,
                self.arrived & IMM_TAG_MASK
            )));
        }
        if len == 0 || len > self.p.slot_bytes {
            return Err(ProtoError::Violation(format!(
                "slot #{} of {len} bytes; slots hold 1..={}",
                self.arrived, self.p.slot_bytes
            )));
        }
        if self.arrived - self.freed >= self.p.slots as u64 {
            return Err(ProtoError::Violation(format!(
                "slot #{} written while {} slots are unread: the sender overran its credits",
                self.arrived,
                self.arrived - self.freed
            )));
        }
        self.ready.push_back(len);
        self.arrived += 1;
        Ok(Some(WorkRequest::PostRecv {
            wr_id: (KIND_RECV << KIND_SHIFT) | (self.arrived & ID_MASK),
        }))
    }

    /// A credit write, when one is due and none is in flight.
    fn credit(&mut self) -> Option<WorkRequest> {
        if self.credit_in_flight || self.freed == self.returned {
            return None;
        }
        if self.freed - self.returned < self.p.credit_batch as u64 && !self.ready.is_empty() {
            return None;
        }
        self.returned = self.freed;
        self.credit_in_flight = true;
        Some(WorkRequest::WriteCredit {
            wr_id: (KIND_CREDIT << KIND_SHIFT) | (self.freed & ID_MASK),
            freed: self.freed,
        })
    }
}

/// Both halves of one end of a link, and the work requests they want posted.
///
/// The driver loop: feed every polled [`Completion`] to [`Endpoint::on_completion`] and
/// the current credit word to [`Endpoint::on_credit`]; fill slots with
/// [`Endpoint::writable`] + [`Endpoint::commit`]; drain with [`Endpoint::readable`] +
/// [`Endpoint::consume`]; then post everything [`Endpoint::poll_transmit`] returns.
/// Before the peer may write, the driver posts `S + 1` receive requests
/// ([`Endpoint::initial_recvs`]).
#[derive(Debug)]
pub struct Endpoint {
    /// The outgoing stream.
    pub tx: Sender,
    /// The incoming stream.
    pub rx: Receiver,
    out: VecDeque<WorkRequest>,
    close_done: bool,
    failed: Option<ProtoError>,
    /// The peer is gone: nothing more can be sent, but what already arrived can still
    /// be read.
    lost: Option<String>,
}

impl Endpoint {
    /// A fresh end of a link with rings shaped by `p` (already validated).
    pub fn new(p: Params) -> Self {
        Endpoint {
            tx: Sender::new(p),
            rx: Receiver::new(p),
            out: VecDeque::new(),
            close_done: false,
            failed: None,
            lost: None,
        }
    }

    /// The receive requests to post before the connection data is published: `S + 1`.
    pub fn initial_recvs(p: &Params) -> Vec<WorkRequest> {
        (0..=p.slots as u64)
            .map(|i| WorkRequest::PostRecv {
                wr_id: (KIND_RECV << KIND_SHIFT) | (i & ID_MASK),
            })
            .collect()
    }

    /// The first failure seen, if any: the link is unusable after it.
    pub fn failed(&self) -> Option<&ProtoError> {
        self.failed.as_ref()
    }

    /// Why the peer is gone, if a work request failed because of it. Writes are over;
    /// data that arrived before can still be read.
    pub fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }

    fn fail(&mut self, e: ProtoError) -> ProtoError {
        self.failed.get_or_insert(e).clone()
    }

    /// Applies one completion of this queue pair.
    pub fn on_completion(&mut self, c: Completion) -> Result<(), ProtoError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.lost.is_some() {
            // The queue pair is in the error state: what it flushes means nothing, but
            // data that landed before still counts.
            return match c {
                Completion::Received { imm } => self.rx.on_received(imm).map(|_| ()),
                _ => Ok(()),
            }
            .map_err(|e| self.fail(e));
        }
        let r = match c {
            Completion::Sent { wr_id } => match wr_id >> KIND_SHIFT {
                KIND_DATA => self.tx.on_sent(wr_id & ID_MASK),
                KIND_CREDIT if self.rx.credit_in_flight => {
                    self.rx.credit_in_flight = false;
                    Ok(())
                }
                KIND_CLOSE if self.tx.close_posted && !self.close_done => {
                    self.close_done = true;
                    Ok(())
                }
                _ => Err(ProtoError::Violation(format!(
                    "unexpected send completion {wr_id:#x}"
                ))),
            },
            Completion::Received { imm } => self.rx.on_received(imm).map(|wr| {
                if let Some(wr) = wr {
                    self.out.push_back(wr);
                }
            }),
            Completion::Failed {
                wr_id,
                status,
                peer_lost,
            } => {
                let s = format!("work request {wr_id:#x}: {status}");
                if peer_lost {
                    self.lost = Some(s);
                    Ok(())
                } else {
                    Err(ProtoError::Failed(s))
                }
            }
        };
        r.map_err(|e| self.fail(e))
    }

    /// Applies the value of the local credit word (written by the peer).
    pub fn on_credit(&mut self, freed: u64) -> Result<(), ProtoError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.tx.on_credit(freed).map_err(|e| self.fail(e))
    }

    /// The bounce slot the next outgoing bytes go to, if a write may be posted.
    pub fn writable(&self) -> Option<usize> {
        if self.failed.is_some() || self.lost.is_some() || self.rx.peer_closed {
            return None;
        }
        self.tx.writable()
    }

    /// `len` bytes were copied into the bounce slot [`Endpoint::writable`] named: queue
    /// the write that sends them.
    pub fn commit(&mut self, len: usize) {
        let wr = self.tx.commit(len);
        self.out.push_back(wr);
    }

    /// See [`Receiver::readable`].
    pub fn readable(&self) -> Option<(usize, usize, usize)> {
        self.rx.readable()
    }

    /// `n` bytes of the readable head were copied out.
    pub fn consume(&mut self, n: usize) {
        self.rx.consume(n);
    }

    /// Queues the close write (once). The peer's reads end after the bytes sent before.
    pub fn close(&mut self) {
        if !self.tx.close_posted && self.failed.is_none() {
            self.tx.close_posted = true;
            self.out.push_back(WorkRequest::WriteClose {
                wr_id: KIND_CLOSE << KIND_SHIFT,
                imm: close_imm(),
            });
        }
    }

    /// The next work request to post (credits are computed here, so call it after
    /// reading).
    pub fn poll_transmit(&mut self) -> Option<WorkRequest> {
        if self.failed.is_some() || self.lost.is_some() {
            return None;
        }
        if let Some(wr) = self.out.pop_front() {
            return Some(wr);
        }
        self.rx.credit()
    }

    /// Whether nothing is queued or in flight on the send side (data, credit, close).
    pub fn quiet(&self) -> bool {
        self.out.is_empty()
            && self.tx.idle()
            && !self.rx.credit_in_flight
            && (!self.tx.close_posted || self.close_done)
    }
}
