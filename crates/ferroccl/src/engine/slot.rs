//! The one-shot all-reduce of a small buffer from the memory peers' slots
//! ([`Slots`]: symmetric shared memory's), and what keeps a call that disagrees with it
//! from waiting for the timeout.
//!
//! A call: this rank's buffer and the call's frame header go into its slot of this
//! turn (turns alternate between the two slots, call by call), then the stamp
//! `seq + 1`; once every peer's stamp in the same turn is that, and its head is this
//! call's, the output is `d0 op d1 op … op d(n-1)` read from the slots in rank order
//! (bit for bit the same on every rank, as one-shot's definition). Nothing else: no
//! fingerprint round trip (the head is the fingerprint), no wait for readers (a turn
//! comes back two slot calls later, after every peer has published the call between,
//! which it does only once it has read the call before), no frame. At 1 KiB on two
//! ranks that is a write of the slot, one cache-line hand-over each way and a read.
//!
//! A rank that called something else is found without waiting for the timeout:
//!
//! - a peer in another slot call: its head differs (same turn and sequence number), or
//!   its stamp in this turn is past this call's;
//! - a peer in a call over the links: such a call sends to a ring neighbour before it
//!   waits (the root agreement, `algo/chain.rs`, keeps that for the rooted
//!   collectives), and a rank waiting on a slot looks at its links, which a slot call
//!   never sends on, without taking anything ([`Engine::slot_links`]): a frame of this
//!   sequence number or an earlier one is a mismatch, a notice a failure that travels
//!   on from rank to rank;
//! - and every rank of such a call that waits: its wait ([`Engine::slot_clash`], from
//!   the stream executor's idle rounds) sees this rank's stamp for its sequence number
//!   in a slot and fails with a mismatch naming both calls, without depending on a
//!   notice that must cross ranks that are waiting themselves (at 5 ranks, with rank 4
//!   in a slot call and the others in a broadcast, one of them waited for the timeout
//!   without it).

use super::pacer::frame_error;
use super::{Engine, Pacer};
use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};
use crate::transport::{Channel, LinkError, Slots};
use crate::wire::{look_ahead, Ahead, Fingerprint, FrameError, FrameHeader, InFrame, HEADER_LEN};

/// The step a slot's head says: none that a plan's frame carries, so a frame of this
/// call on a link could never be taken for its head.
const SLOT_STEP: u32 = u32::MAX - 1;

/// How often a wait on a slot asks whether its peer's process still exists (a system
/// call), in idle rounds past the spin.
const GONE_EVERY: u32 = 16;

/// The head of a slot call: the frame header of a frame no plan sends.
fn head_of(fp: &Fingerprint, len: usize) -> FrameHeader {
    FrameHeader {
        fp: *fp,
        step: SLOT_STEP,
        seg: 0,
        len: len as u32,
    }
}

/// The call `peer`'s slot `turn` holds, read with its stamp (`None`: a torn read, or
/// a head that does not decode).
fn head_in(slots: &dyn Slots, peer: usize, turn: usize) -> Option<(u64, FrameHeader)> {
    let stamp = slots.stamp(peer, turn);
    let mut b = [0u8; HEADER_LEN];
    slots.head(peer, turn, &mut b);
    let h = FrameHeader::decode(&b).ok()?;
    (slots.stamp(peer, turn) == stamp).then_some((stamp, h))
}

impl Engine {
    /// All-reduces `buf` (elements of `dtype`, at most the slots' data bytes) in
    /// place from the slots: see the module docs.
    pub(crate) fn slot_all_reduce(
        &mut self,
        fp: &Fingerprint,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        self.beacon.set(fp.seq, fp.kind.code());
        // Nothing crosses a link: the recorder counts none (`on_memory`'s begin is then
        // this one's).
        self.trace_begin_on(fp, false);
        self.on_memory(
            fp,
            |e, mem| {
                let slots = mem.slots().ok_or_else(|| {
                    Error::InvalidArgument("internal: these memory peers have no slots".into())
                })?;
                e.slot_call(slots, fp, buf, dtype, op)
            },
            || (0..n).filter(|&q| q != rank).collect(),
        )
    }

    fn slot_call(
        &mut self,
        slots: &mut dyn Slots,
        fp: &Fingerprint,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let turn = (self.pull.slot_calls & 1) as usize;
        self.pull.slot_calls += 1;
        let stamp = fp.seq + 1;
        let head = head_of(fp, buf.len());
        let bytes = head.encode();
        slots.post(turn, &bytes, buf, stamp)?;
        let mut pacer = Pacer::new(&self.cfg, self.health.clone(), self.spin);
        let (rank, n) = (self.rank, self.world_size);
        // A peer whose head differs fails the call, but only once every peer has
        // posted: no rank leaves a call its peers are still joining (ranks that
        // disagree among themselves would otherwise be gone, their rendezvous store
        // with them, while a third still sets up).
        let mut differs = None;
        for q in (0..n).filter(|&q| q != rank) {
            if let Err(e) = self.slot_wait(slots, &mut pacer, (&head, &bytes), q, turn, stamp) {
                match e {
                    Error::Mismatch { .. } if differs.is_none() => differs = Some(e),
                    Error::Mismatch { .. } => {}
                    e => return Err(e),
                }
            }
            pacer.moved();
        }
        if let Some(e) = differs {
            return Err(e);
        }
        slots.reduce(turn, dtype, op, buf)
    }

    /// Waits until `peer` has posted this call (`head`, encoded too, and `stamp`) in
    /// its slot `turn`.
    fn slot_wait(
        &mut self,
        slots: &mut dyn Slots,
        pacer: &mut Pacer,
        (head, bytes): (&FrameHeader, &[u8; HEADER_LEN]),
        peer: usize,
        turn: usize,
        stamp: u64,
    ) -> Result<()> {
        let (rank, fp) = (self.rank, &head.fp);
        let mut rounds = 0u32;
        let mut waited: Option<std::time::Instant> = None;
        loop {
            let seen = slots.stamp(peer, turn);
            if seen >= stamp {
                if seen == stamp {
                    // The peer is held off its slot until this rank's next slot call:
                    // its head is stable, and the same bytes as this call's if it is
                    // this call.
                    let mut theirs = [0u8; HEADER_LEN];
                    slots.head(peer, turn, &mut theirs);
                    if theirs == *bytes {
                        break;
                    }
                }
                let theirs = head_in(slots, peer, turn);
                return Err(Error::Mismatch {
                    rank,
                    peer,
                    ours: fp.to_string(),
                    theirs: theirs.map_or_else(
                        || format!("a call whose slot holds stamp {seen}"),
                        |(_, h)| h.fp.to_string(),
                    ),
                });
            }
            if waited.is_none() {
                self.trace_waiting(peer);
            }
            pacer.idle_poll(rank, fp, || {
                format!("rank {peer} to post {fp} in its slot (its stamp there is {seen})")
            })?;
            if pacer.spinning() {
                continue;
            }
            let t0 = *waited.get_or_insert_with(std::time::Instant::now);
            rounds = rounds.wrapping_add(1);
            self.slot_links(fp, |q| slots.stamp(q, turn) == stamp)?;
            if rounds.is_multiple_of(GONE_EVERY)
                && slots.gone(peer)
                && slots.stamp(peer, turn) != stamp
            {
                return Err(self.gone_peer(peer, fp));
            }
            let now = std::time::Instant::now();
            self.trace_waited(peer, now.duration_since(t0).as_nanos() as u64);
            waited = Some(now);
        }
        Ok(())
    }

    /// Looks at what the peers have sent on their collective links (those linked:
    /// every rank is linked to its ring neighbours, so a failure anywhere travels
    /// here) while this rank waits in a slot call, which sends on none: a frame of a
    /// later call is a peer's that has finished this one (left for that call); a frame
    /// of this call's sequence number or an earlier one is another call (a mismatch);
    /// a notice, bytes that are no frame or a closed link end the wait as reading them
    /// says — from a peer that has not `posted` this call (one that has may be done
    /// with it, and gone, or failed in its next call).
    fn slot_links(&mut self, fp: &Fingerprint, posted: impl Fn(usize) -> bool) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        for q in (0..n).filter(|&q| q != rank) {
            let Some(link) = self.links[super::ch_index(Channel::Collective)][q].as_mut() else {
                continue;
            };
            match look_ahead(link) {
                Ahead::Nothing => {}
                Ahead::Frame(h) if h.fp.seq > fp.seq => {}
                Ahead::Frame(h) => {
                    return Err(Error::Mismatch {
                        rank,
                        peer: q,
                        ours: fp.to_string(),
                        theirs: h.fp.to_string(),
                    })
                }
                // A peer that has posted this call takes no further part in it:
                // what it says now (its end, or a notice of a failure after it) is
                // for its next call. If this call cannot complete, another peer's
                // stamp or head says so.
                Ahead::Closed | Ahead::Failure if posted(q) => {}
                Ahead::Failure | Ahead::Closed => {
                    let mut frame = InFrame::new(head_of(fp, 0));
                    let e = match frame.progress(link, &mut []) {
                        Err(e) => e,
                        Ok(_) => FrameError::Link(LinkError::Closed),
                    };
                    return Err(frame_error(rank, e, link, q, fp));
                }
            }
        }
        Ok(())
    }

    /// For a call over the links that has waited past its spin: a peer whose slot
    /// holds a slot call of this sequence number called something else (see the
    /// module docs). `None` where there are no slots, or for a call of another
    /// channel (whose sequence numbers are not the collectives').
    pub(super) fn slot_clash(&mut self, ch: Channel, fp: &Fingerprint) -> Option<Error> {
        if ch != Channel::Collective {
            return None;
        }
        let (rank, n) = (self.rank, self.world_size);
        let slots = self.mem.as_mut()?.slots()?;
        (0..n).filter(|&q| q != rank).find_map(|q| {
            (0..2).find_map(|turn| {
                // The stamp first: a head is read only for this sequence number.
                if slots.stamp(q, turn) != fp.seq + 1 {
                    return None;
                }
                let (stamp, h) = head_in(slots, q, turn)?;
                (stamp == fp.seq + 1 && h.fp != *fp).then(|| Error::Mismatch {
                    rank,
                    peer: q,
                    ours: fp.to_string(),
                    theirs: h.fp.to_string(),
                })
            })
        })
    }
}
