//! The pull executor: a plan over peers whose memory this rank reads (CUDA IPC, or a
//! host-memory transport), instead of links that carry bytes.
//!
//! Every rank keeps a workspace the size of the plan's buffer, which its peers map.
//! The plan is the one the push executor runs; each of its receives becomes a read of
//! the sender's workspace:
//!
//! - **Ready to read.** The sender's out `o` carries final bytes once the sender has
//!   applied the receive `o` forwards ([`Out::after_recv`]), or from its copy-in when it
//!   forwards nothing. Every rank publishes a progress counter: `base + 1` after its
//!   copy-in, `base + 2 + i` after its receive `i`. A receive waits until the sender's
//!   counter shows the needed value, then orders its reads after the sender's work
//!   ([`MemPeers::order_after`]: on a GPU, a stream wait on the sender's event).
//! - **Safe to overwrite.** A receive with [`In::after_send`] overwrites bytes this rank
//!   sent; in a pull, "sent" means "read by the receiver": it waits until the receiver
//!   has applied the matching receive. Before a call's copy-in, every peer that read
//!   this workspace in the previous call must have finished that call.
//! - **Same call.** Before touching shared memory, every rank exchanges the call's
//!   fingerprint with both ring neighbours over its links (an empty frame each way), so
//!   a mismatched call — another count, dtype, operator, kind or root — is
//!   [`crate::Error::Mismatch`] and never a read of a peer's memory in the wrong shape.
//!   (The memory peers' plans only ever read ring neighbours.)
//!
//! - **Device order.** Where the peers order on the device
//!   ([`MemPeers::device_order`]: stream memory operations), each of those waits is one
//!   enqueued [`MemPeers::wait_for`] instead ([`Engine::after`]): the host enqueues the
//!   whole plan without waiting on any peer, then polls for completion under the
//!   deadline, and a timeout names the first wait not met ([`Engine::finish`]). Only
//!   the previous call's readers are still awaited on the host, before the workspace
//!   may grow. A call that fails lets its device's waits pass, so nothing hangs on
//!   them, marking its rank failed first ([`MemPeers::release`]); a device that a
//!   failed rank let through computes garbage and publishes it on, so before it
//!   returns every rank looks at every rank's mark, not only those it waited on.
//!
//! Every rank's counter advances by the same `span` per call (the longest plan of the
//! call, plus its copy-in), so counters stay comparable across calls of any kind.
//! Waits go through the [`Pacer`]: the communicator's timeout on its clock, and the
//! abort flag, interrupt them.
//!
//! A plan whose combining receive must wait for its own send to be read (recursive
//! doubling's exchange) cannot be pulled — both partners would wait for the other to
//! read first — and is refused.

use super::{Data, Engine, Pacer};
use crate::algo::{schedule, In, Land, Out, Plan};
use crate::error::{Error, Result};
use crate::reduce::NoCombine;
use crate::transport::{CallMem, Channel, MemPeers, Region};
use crate::wire::Fingerprint;
use std::collections::HashMap;
use std::ops::Range;

/// A call for the pull executor: the user's buffers and where they sit in the
/// workspace.
pub(crate) struct PullCall {
    /// The user's buffers, element type and operator.
    pub mem: CallMem,
    /// Bytes of the workspace the plan addresses.
    pub bytes: usize,
    /// Workspace offset of the input's first byte.
    pub input_at: usize,
    /// Workspace offset of the output's first byte.
    pub output_at: usize,
}

impl PullCall {
    /// An in-place call on host buffer `b` of `world_size` ranks.
    pub fn on_host(
        b: &mut [u8],
        dtype: crate::reduce::DataType,
        op: Option<crate::reduce::ReduceOp>,
        world_size: usize,
    ) -> Self {
        let (addr, len) = (b.as_mut_ptr() as u64, b.len());
        PullCall {
            mem: CallMem {
                space: 0,
                input: addr,
                input_len: len,
                output: addr,
                output_len: len,
                dtype,
                op,
                world_size,
            },
            bytes: len,
            input_at: 0,
            output_at: 0,
        }
    }

    fn input(&self) -> Range<usize> {
        self.input_at..self.input_at + self.mem.input_len
    }

    fn output(&self) -> Range<usize> {
        self.output_at..self.output_at + self.mem.output_len
    }

    /// Whether workspace bytes `r` are the same memory in the input and the output (an
    /// in-place call), so copying one to the other is a no-op.
    fn in_place(&self, r: &Range<usize>) -> bool {
        self.mem.input == self.mem.output && self.input_at == self.output_at && !r.is_empty()
    }
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

/// `whole` minus the union of `parts`, as sorted ranges.
fn uncovered(whole: Range<usize>, mut parts: Vec<Range<usize>>) -> Vec<Range<usize>> {
    parts.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = whole.start;
    for p in parts {
        let p = intersect(&p, &whole);
        if p.is_empty() {
            continue;
        }
        if p.start > at {
            out.push(at..p.start);
        }
        at = at.max(p.end);
    }
    if at < whole.end {
        out.push(at..whole.end);
    }
    out
}

/// A pulled call's start on this rank: its input copied into its workspace where the
/// plan reads it before anything arrives (what it sends without forwarding a receive,
/// and what receives combine with), and the bytes no receive changes written to the
/// output. (A broadcast's non-roots copy nothing in: every byte they send arrived
/// first.)
fn copy_in(mem: &mut dyn MemPeers, me: &Plan, call: &PullCall) -> Result<()> {
    let mut read: Vec<Range<usize>> = me
        .outs
        .iter()
        .filter(|o| o.after_recv.is_none())
        .map(|o| o.off..o.off + o.len)
        .chain(
            me.ins
                .iter()
                .filter(|i| matches!(i.land, Land::Reduce { .. }))
                .map(In::range),
        )
        .collect();
    read.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in read.into_iter().filter(|r| !r.is_empty()) {
        match merged.last_mut() {
            Some(m) if r.start <= m.end => m.end = m.end.max(r.end),
            _ => merged.push(r),
        }
    }
    for r in merged {
        let w = intersect(&r, &call.input());
        if !w.is_empty() {
            mem.copy(
                Region::Mine(w.start),
                Region::Input(w.start - call.input_at),
                w.len(),
            )?;
        }
    }
    // Write out what is final already (bytes no receive changes).
    let finals: Vec<Range<usize>> = me
        .ins
        .iter()
        .filter(|i| i.is_final())
        .map(In::range)
        .collect();
    for r in uncovered(call.output(), finals) {
        let from = intersect(&r, &call.input());
        if from.is_empty() || call.in_place(&from) {
            continue;
        }
        mem.copy(
            Region::Output(from.start - call.output_at),
            Region::Input(from.start - call.input_at),
            from.len(),
        )?;
    }
    Ok(())
}

/// Idle rounds of a progress wait between two looks at whether the peer still exists
/// ([`MemPeers::gone`]).
const GONE_EVERY: u32 = 64;

/// How long a rank whose device a failed peer let through waits for that peer's
/// notice (sent right after it released its device) before it names the peer alone.
const RELEASE_NOTICE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// State the pull executor keeps between calls.
#[derive(Default)]
pub(crate) struct PullState {
    /// Counter units used by the calls so far (equal on every rank).
    pub base: u64,
    /// Peers that read this rank's workspace in the previous call.
    pub consumers: Vec<usize>,
    /// Slot calls so far (`slot.rs`: their turns alternate; equal on every rank).
    pub slot_calls: u64,
    /// Device order: the waits enqueued in the call so far, `(peer, progress)`, to
    /// say which one the device is stuck on.
    pub device_waits: Vec<(usize, u64)>,
}

impl Engine {
    /// Runs the plan of this rank (`plan_of(rank)`) over the transport's memory peers;
    /// `plan_of(q)` gives any rank's plan of the same call, to know when a sender's
    /// bytes are ready and when a receiver has read ours.
    pub(crate) fn pull(
        &mut self,
        fp: &Fingerprint,
        plan_of: &dyn Fn(usize) -> Plan,
        call: &PullCall,
    ) -> Result<()> {
        let rank = self.rank;
        self.on_memory(
            fp,
            |e, mem| e.pull_inner(mem, fp, plan_of, call),
            || plan_of(rank).peers(),
        )
    }

    fn pull_inner(
        &mut self,
        mem: &mut dyn MemPeers,
        fp: &Fingerprint,
        plan_of: &dyn Fn(usize) -> Plan,
        call: &PullCall,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        let me = plan_of(rank);
        if me
            .ins
            .iter()
            .any(|i| matches!(i.land, Land::Reduce { .. }) && i.after_send.is_some())
        {
            return Err(Error::InvalidArgument(format!(
                "internal: {fp} cannot run on memory peers (a combining receive waits for its own send)"
            )));
        }
        let peers = me.peers();
        // Same call everywhere before any shared memory is touched. The exchange is
        // with both ring neighbours whatever the plan (a rank whose root differs has a
        // different plan, and must still meet its neighbours), so any disagreement
        // between ranks is one between some pair of neighbours.
        let mut meet = peers.clone();
        if n > 1 {
            meet.extend([schedule::left(rank, n), schedule::right(rank, n)]);
        }
        meet.sort_unstable();
        meet.dedup();
        self.exchange_fingerprints(fp, &meet)?;
        self.beacon.set(fp.seq, fp.kind.code());

        let mut plans: HashMap<usize, Plan> = HashMap::new();
        let mut plan = |q: usize| -> Plan { plans.entry(q).or_insert_with(|| plan_of(q)).clone() };
        let span = (0..n).map(|q| plan(q).ins.len() + 1).max().unwrap_or(1) as u64;
        let base = self.pull.base;
        let mut pacer = Pacer::new(&self.cfg, self.health.clone(), self.spin);

        // Whoever read our workspace last call has finished that call.
        let prev = self.previous_readers_done(mem, &mut pacer, fp, base)?;
        mem.begin(&call.mem, call.bytes, &peers)?;
        for &q in &prev {
            mem.order_after(q)?;
        }

        copy_in(mem, &me, call)?;
        mem.publish(base + 1)?;

        for (idx, i) in me.ins.iter().enumerate() {
            let p = i.peer;
            let sender = plan(p);
            let o = sender
                .matching_out(rank, i.step, i.seg)
                .map(|o| sender.outs[o].clone())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "internal: rank {p} sends nothing for step {} segment {}",
                        i.step, i.seg
                    ))
                })?;
            let ready = base + 1 + o.after_recv.map_or(0, |d| d as u64 + 1);
            self.after(mem, &mut pacer, fp, p, ready, || {
                format!(
                    "rank {p} to finish the data this rank reads (step {}, segment {})",
                    i.step, i.seg
                )
            })?;
            if let Some(s) = i.after_send {
                let sent: &Out = &me.outs[s];
                let q = sent.peer;
                let j = plan(q)
                    .matching_in(rank, sent.step, sent.seg)
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "internal: rank {q} receives nothing for step {} segment {}",
                            sent.step, sent.seg
                        ))
                    })?;
                self.after(mem, &mut pacer, fp, q, base + 2 + j as u64, || {
                    format!(
                        "rank {q} to read what this rank sent (step {}, segment {})",
                        sent.step, sent.seg
                    )
                })?;
            }
            // Final bytes go to the output too: fused with the combine when the whole
            // frame is output, copied after it when only part is.
            let w = if i.is_final() {
                intersect(&i.range(), &call.output())
            } else {
                0..0
            };
            let fused = !w.is_empty() && w == i.range();
            let out = fused.then(|| Region::Output(w.start - call.output_at));
            match i.land {
                Land::Copy => {
                    mem.copy(Region::Mine(i.off), Region::Peer(p, o.off), i.len)?;
                    if let Some(out) = out {
                        mem.copy(out, Region::Mine(i.off), i.len)?;
                    }
                }
                Land::Reduce {
                    theirs_first,
                    finish,
                } => {
                    let (mine, theirs) = (Region::Mine(i.off), Region::Peer(p, o.off));
                    let (a, b) = if theirs_first {
                        (theirs, mine)
                    } else {
                        (mine, theirs)
                    };
                    mem.combine(Region::Mine(i.off), out, a, b, i.len, finish)?;
                }
            }
            if !fused && !w.is_empty() {
                mem.copy(
                    Region::Output(w.start - call.output_at),
                    Region::Mine(w.start),
                    w.len(),
                )?;
            }
            mem.publish(base + 2 + idx as u64)?;
            pacer.moved();
        }
        // A rank with a shorter plan still ends the call at the same counter value.
        if (me.ins.len() as u64) + 1 < span {
            mem.publish(base + span)?;
        }
        self.finish(mem, &mut pacer, fp)?;
        self.pull.base = base + span;
        let mut consumers: Vec<usize> = me.outs.iter().map(|o| o.peer).collect();
        consumers.sort_unstable();
        consumers.dedup();
        self.pull.consumers = consumers;
        Ok(())
    }

    /// Runs `run` on the memory peers (taken out of the engine meanwhile) as operation
    /// `fp`; a timeout is located among `peers`.
    pub(super) fn on_memory(
        &mut self,
        fp: &Fingerprint,
        run: impl FnOnce(&mut Self, &mut dyn MemPeers) -> Result<()>,
        peers: impl FnOnce() -> Vec<usize>,
    ) -> Result<()> {
        let mut mem = self.mem.take().ok_or_else(|| {
            Error::InvalidArgument("internal: this transport has no memory peers".into())
        })?;
        self.trace_begin(fp);
        let r = run(self, &mut *mem);
        if r.is_err() && mem.device_order() {
            // Waits the device may never see met (a peer gone, the deadline passed, an
            // abort): let them pass, so that the stream drains rather than hangs
            // whatever synchronises with it later. Always, and marking this rank
            // failed: what its stream published may come from a failed peer's garbage,
            // and the engine is poisoned after any failure anyway.
            mem.release();
            if let Err(e) = mem.end() {
                tracing::warn!(
                    "rank {}: draining the device after {fp} failed: {e}",
                    self.rank
                );
            }
        }
        self.pull.device_waits.clear();
        self.mem = Some(mem);
        self.locate_on_timeout(r, fp, peers)
    }

    /// An empty frame each way with every peer of the call: their headers carry the
    /// fingerprints, so a rank that called something else fails with a mismatch here.
    pub(super) fn exchange_fingerprints(
        &mut self,
        fp: &Fingerprint,
        peers: &[usize],
    ) -> Result<()> {
        let plan = Plan {
            outs: peers.iter().map(|&q| Out::check(q, u32::MAX)).collect(),
            ins: peers.iter().map(|&q| In::check(q, u32::MAX)).collect(),
            lanes: None,
            counts: None,
        };
        self.stream(
            Channel::Collective,
            fp,
            &plan,
            Data::Write(&mut []),
            &mut NoCombine,
        )
    }

    /// The error for `peer`, whose process is gone while this rank waited on its
    /// memory: the notice it left on its link if it failed first (a peer that saw
    /// someone else die says whom), else its connection closed.
    pub(super) fn gone_peer(&mut self, peer: usize, fp: &Fingerprint) -> Error {
        let rank = self.rank;
        match self.links[super::ch_index(Channel::Collective)][peer].as_mut() {
            Some(link) => {
                let e = crate::wire::find_notice(link).unwrap_or(crate::wire::FrameError::Link(
                    crate::transport::LinkError::Closed,
                ));
                super::pacer::frame_error(rank, e, link, peer, fp)
            }
            None => Error::PeerClosed {
                rank,
                peer,
                op: fp.to_string(),
            },
        }
    }

    /// Waits until every rank that read this rank's workspace in the previous call
    /// has finished that call (published `base`), and returns them.
    pub(super) fn previous_readers_done(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
        base: u64,
    ) -> Result<Vec<usize>> {
        let prev = std::mem::take(&mut self.pull.consumers);
        for &q in &prev {
            self.wait_progress(mem, pacer, fp, q, base, || {
                format!("rank {q} to finish reading this rank's memory (previous call)")
            })?;
        }
        Ok(prev)
    }

    /// Orders this rank's later work after `peer`'s progress `at_least`: a wait on the
    /// host, then [`MemPeers::order_after`]; in device order one enqueued
    /// [`MemPeers::wait_for`], remembered for [`Engine::finish`]. `what` describes it
    /// for a timeout on the host.
    pub(super) fn after(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
        peer: usize,
        at_least: u64,
        what: impl Fn() -> String,
    ) -> Result<()> {
        if mem.device_order() {
            self.pull.device_waits.push((peer, at_least));
            return mem.wait_for(peer, at_least);
        }
        self.wait_progress(mem, pacer, fp, peer, at_least, what)?;
        mem.order_after(peer)
    }

    /// Ends a call on the memory peers once everything enqueued has completed. In
    /// device order the host polls [`MemPeers::done`] first, under the call's deadline
    /// and abort flag, and a timeout names the first enqueued wait whose peer has not
    /// published its value: where the device is stuck.
    pub(super) fn finish(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
    ) -> Result<()> {
        if mem.device_order() {
            self.await_device(mem, pacer, fp)?;
        }
        mem.end()
    }

    fn await_device(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
    ) -> Result<()> {
        let total = |mem: &dyn MemPeers, waits: &[(usize, u64)]| -> u64 {
            waits
                .iter()
                .fold(0u64, |s, &(q, _)| s.wrapping_add(mem.progress(q)))
        };
        // Any rank, not only those waited on: garbage travels. A rank whose device a
        // failed rank let through publishes what it computed from it before its own
        // host knows; the failed rank marked itself before any of that.
        let (rank, n) = (self.rank, self.world_size);
        let failed = |mem: &dyn MemPeers| (0..n).find(|&q| q != rank && mem.failed(q));
        let mut seen = total(mem, &self.pull.device_waits);
        let mut rounds = 0u32;
        loop {
            // A peer that failed let its device run on unordered: whatever of it this
            // rank's device has read may be garbage, done or not.
            if let Some(q) = failed(mem) {
                return Err(self.released_peer(q, fp));
            }
            if mem.done()? {
                break;
            }
            let stuck = self
                .pull
                .device_waits
                .iter()
                .copied()
                .find(|&(q, v)| mem.progress(q) < v);
            rounds = rounds.wrapping_add(1);
            if let Some((q, v)) = stuck {
                if rounds.is_multiple_of(GONE_EVERY) && mem.gone(q) && mem.progress(q) < v {
                    return Err(self.gone_peer(q, fp));
                }
                self.trace_waiting(q);
            }
            let t0 = std::time::Instant::now();
            let m: &dyn MemPeers = mem;
            pacer.idle_poll(self.rank, fp, || match stuck {
                Some((q, v)) => format!(
                    "rank {q} to publish progress {v}, which this rank's device work waits \
                     for (its progress is {})",
                    m.progress(q)
                ),
                None => "this rank's device work to complete".into(),
            })?;
            // The flight recorder counts the time against the peer the device waits
            // on, as a host wait's.
            if let Some((q, _)) = stuck {
                self.trace_waited(q, t0.elapsed().as_nanos() as u64);
            }
            let now = total(mem, &self.pull.device_waits);
            if now != seen {
                pacer.moved();
                seen = now;
            }
        }
        // Its release comes before the values that let this device through.
        if let Some(q) = failed(mem) {
            return Err(self.released_peer(q, fp));
        }
        self.pull.device_waits.clear();
        Ok(())
    }

    /// The error for `peer`, which failed in this call and let its device run on
    /// ([`MemPeers::release`]): the notice it sends right after, once it is there (a
    /// moment), else a failure that names it.
    fn released_peer(&mut self, peer: usize, fp: &Fingerprint) -> Error {
        let rank = self.rank;
        let end = std::time::Instant::now() + RELEASE_NOTICE_WAIT;
        if let Some(link) = self.links[super::ch_index(Channel::Collective)][peer].as_mut() {
            loop {
                if let Some(e) = crate::wire::find_notice(link) {
                    return super::pacer::frame_error(rank, e, link, peer, fp);
                }
                if std::time::Instant::now() >= end {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        Error::PeerFailed {
            rank,
            peer,
            origin: peer,
            cause: Box::new(Error::Remote {
                kind: "Unknown".into(),
                message: format!(
                    "rank {peer} failed during {fp} with device work left, and let it run \
                     unordered (its notice did not come)"
                ),
            }),
            op: fp.to_string(),
        }
    }

    /// Waits until `peer`'s published progress reaches `at_least`.
    pub(super) fn wait_progress(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
        peer: usize,
        at_least: u64,
        what: impl Fn() -> String,
    ) -> Result<()> {
        let mut seen = mem.progress(peer);
        if seen < at_least {
            self.trace_waiting(peer);
        }
        let mut rounds = 0u32;
        while seen < at_least {
            let t0 = std::time::Instant::now();
            pacer.idle_poll(self.rank, fp, || {
                format!("{} (its progress is {seen}, needed {at_least})", what())
            })?;
            // Whether the peer still exists: a system call, so not every round.
            rounds = rounds.wrapping_add(1);
            if rounds.is_multiple_of(GONE_EVERY) && mem.gone(peer) && mem.progress(peer) < at_least
            {
                return Err(self.gone_peer(peer, fp));
            }
            self.trace_waited(peer, t0.elapsed().as_nanos() as u64);
            let now = mem.progress(peer);
            if now != seen {
                pacer.moved();
                seen = now;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncovered_is_the_complement() {
        assert_eq!(uncovered(0..10, vec![2..4, 6..8]), vec![0..2, 4..6, 8..10]);
        let everything: Vec<Range<usize>> = std::iter::once(0..10).collect();
        assert_eq!(uncovered(0..10, everything), Vec::<Range<usize>>::new());
        let left_gap = uncovered(4..8, vec![0..5, 7..20]);
        assert_eq!((left_gap.len(), left_gap.first()), (1, Some(&(5..7))));
        assert_eq!(uncovered(0..0, vec![]), Vec::<Range<usize>>::new());
        assert!(intersect(&(0..4), &(6..9)).is_empty());
    }
}
