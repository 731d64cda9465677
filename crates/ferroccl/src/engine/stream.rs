//! The push executor: a plan over links that move bytes (TCP, RDMA, in-process pipes).

use super::pacer::frame_error;
use super::{Engine, Pacer, NOTICE_WAIT};
use crate::algo::{In, Land, LaneOrder, Out, Plan, MAX_LANES};
use crate::error::{Error, Result};
use crate::reduce::Combine;
use crate::transport::Channel;
use crate::wire::{Fingerprint, FrameHeader, InFrame, OutFrame};
use std::ops::Range;
use std::time::Instant;

/// The sends in progress, one per lane: `si[l]` is the position of lane `l`'s next
/// send, and `out[l]` that send (its index and frame) once it has started.
struct Sending {
    si: [usize; MAX_LANES],
    out: [Option<(usize, OutFrame)>; MAX_LANES],
}

/// The buffer an operation runs on.
pub(crate) enum Data<'a> {
    /// Frames are sent from it and land in it.
    Write(&'a mut [u8]),
    /// The plan's buffer is `[input | output]` (the direct exchanges, `algo/direct.rs`):
    /// offsets below `in_len` are the input's, sends read them; the rest are the
    /// output's (at `offset - in_len`), receives write them. `input` may be shorter
    /// than `in_len` where the plan reads none of the rest.
    Split {
        input: &'a [u8],
        in_len: usize,
        output: &'a mut [u8],
    },
}

/// A plan range outside its buffer: an internal error, never a panic.
fn out_of_bounds(r: &Range<usize>, what: &str) -> Error {
    Error::InvalidArgument(format!(
        "internal: a plan {what} bytes {r:?} outside its buffer"
    ))
}

impl Data<'_> {
    fn read(&self, r: Range<usize>) -> Result<&[u8]> {
        let got = match self {
            Data::Write(b) => b.get(r.clone()),
            Data::Split { input, in_len, .. } if r.end <= *in_len => input.get(r.clone()),
            Data::Split { in_len, output, .. } if r.start >= *in_len => {
                output.get(r.start - in_len..r.end - in_len)
            }
            Data::Split { .. } => None,
        };
        got.ok_or_else(|| out_of_bounds(&r, "reads"))
    }

    fn write(&mut self, r: Range<usize>) -> Result<&mut [u8]> {
        let got = match self {
            // (An empty range keeps the buffer's alignment: a kernel may cast it.)
            Data::Write(b) => b.get_mut(r.clone()),
            // An empty frame (a check) changes nothing.
            Data::Split { in_len, output, .. } if r.is_empty() || r.start >= *in_len => {
                if r.is_empty() {
                    Some(&mut output[..0])
                } else {
                    output.get_mut(r.start - *in_len..r.end - *in_len)
                }
            }
            Data::Split { .. } => {
                return Err(Error::InvalidArgument(
                    "internal: a plan receives into a read-only buffer".into(),
                ))
            }
        };
        got.ok_or_else(|| out_of_bounds(&r, "writes"))
    }
}

/// Applies a received frame (in `scratch` when it combines) to the buffer.
fn apply(i: &In, data: &mut Data<'_>, scratch: &mut [u8], comb: &mut dyn Combine) -> Result<()> {
    let Land::Reduce {
        theirs_first,
        finish,
    } = i.land
    else {
        return Ok(()); // a copy landed in place
    };
    let dst = data.write(i.range())?;
    let src = &mut scratch[..i.len];
    if theirs_first {
        comb.reduce(src, dst)?;
        crate::sys::mem::copy(dst, src);
    } else {
        comb.reduce(dst, src)?;
    }
    if finish {
        comb.finish(dst)?;
    }
    Ok(())
}

/// A frame's header: the call's fingerprint, with its pair's element count where each
/// pair moves its own amount (`count`, from the plan's [`crate::algo::PairCounts`]).
fn header(fp: &Fingerprint, step: u32, seg: u32, len: usize, count: Option<u64>) -> FrameHeader {
    FrameHeader {
        fp: Fingerprint {
            count: count.unwrap_or(fp.count),
            ..*fp
        },
        step,
        seg,
        len: len as u32,
    }
}

/// What a round that moved nothing waits for (named by the timeout error).
#[derive(Clone, Copy)]
enum Awaited<'p> {
    /// The empty frame that only compares fingerprints (`In::check`) from this rank.
    Fingerprint(usize),
    Data(&'p In),
    /// A peer to take a send.
    Take(&'p Out),
    /// Only held receives remain (their sends out of reach): the first lane's peer.
    Turn(usize),
}

impl Awaited<'_> {
    fn peer(&self) -> usize {
        match *self {
            Awaited::Fingerprint(p) | Awaited::Turn(p) => p,
            Awaited::Data(i) => i.peer,
            Awaited::Take(o) => o.peer,
        }
    }
}

impl std::fmt::Display for Awaited<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Awaited::Fingerprint(p) => {
                write!(f, "rank {p} to start the same call (its fingerprint)")
            }
            Awaited::Data(i) => write!(
                f,
                "data from rank {} (step {}, segment {})",
                i.peer, i.step, i.seg
            ),
            Awaited::Take(o) => write!(
                f,
                "rank {} to take data (step {}, segment {})",
                o.peer, o.step, o.seg
            ),
            Awaited::Turn(p) => write!(f, "rank {p} (a receive waits for its turn)"),
        }
    }
}

/// What a stuck round of [`Engine::run_plan`] waits for: a receive that has started
/// or has no send before it in its lane, else the next send, else the first lane's
/// held receive (`rank` itself when there is none).
fn awaited<'p>(
    plan: &'p Plan,
    order: &LaneOrder<'_>,
    st: &Sending,
    ai: &[usize; MAX_LANES],
    held: &[Option<usize>; MAX_LANES],
    inp: &[Option<InFrame>; MAX_LANES],
    rank: usize,
) -> Awaited<'p> {
    let lanes = order.lanes();
    let recv = (0..lanes).find_map(|l| {
        let x = order.inp(l, ai[l])?;
        let sends_done = order.out(l, st.si[l]).is_none();
        (held[l].is_none() && (sends_done || inp[l].is_some())).then_some(x)
    });
    let send = (0..lanes).find_map(|l| order.out(l, st.si[l]));
    match (recv, send) {
        (Some(x), _) if plan.ins[x].step == u32::MAX && plan.ins[x].len == 0 => {
            Awaited::Fingerprint(plan.ins[x].peer)
        }
        (Some(x), _) => Awaited::Data(&plan.ins[x]),
        (None, Some(x)) => Awaited::Take(&plan.outs[x]),
        (None, None) => Awaited::Turn(
            held.iter()
                .flatten()
                .next()
                .map_or(rank, |&x| plan.ins[x].peer),
        ),
    }
}

/// The wait in progress in [`Engine::run_plan`]: its peer and since when. A wait is
/// timed from its first idle round to the progress that ends it, not round by round:
/// two clock reads per round slowed the spin that a peer on shared memory answers
/// within. Once the pacer yields, each round is accounted as it ends, so a dump taken
/// during a hang still sees the wait.
#[derive(Default)]
struct WaitClock(Option<(usize, Instant)>);

impl WaitClock {
    /// The start of this round's wait on `peer` (the wait in progress, if on it; a
    /// wait on another peer ends here).
    fn start(&mut self, e: &mut Engine, peer: usize) -> Instant {
        match self.0.take() {
            Some((p, t0)) if p == peer => t0,
            other => {
                self.0 = other;
                self.end(e);
                Instant::now()
            }
        }
    }

    /// After an idle round that began waiting at `t0`: still spinning, the wait goes
    /// on untimed; else it is accounted now.
    fn after_idle(&mut self, e: &mut Engine, peer: usize, t0: Instant, spinning: bool) {
        if spinning {
            self.0 = Some((peer, t0));
        } else {
            e.trace_waited(peer, t0.elapsed().as_nanos() as u64);
        }
    }

    /// The wait in progress, if any, ends: accounted to its peer.
    fn end(&mut self, e: &mut Engine) {
        if let Some((peer, t0)) = self.0.take() {
            e.trace_waited(peer, t0.elapsed().as_nanos() as u64);
        }
    }
}

/// Idle rounds past the spin between two looks at the peers' slot stamps
/// ([`Engine::slot_clash`]) while the rounds are short (yields); once the wait sleeps,
/// every round looks.
const SLOT_CLASH_EVERY: u32 = 32;

impl Engine {
    /// Runs `plan` over channel `ch` for the operation `fp` on `data`, combining with
    /// `comb`. Both frame lists move as far as the links allow at once, so a ring step
    /// sends right and receives left together, at any message size.
    ///
    /// A frame that combines is received into the engine's scratch buffer and applied
    /// once its [`In::after_send`] has left; the next receive starts only then (the
    /// scratch buffer holds one frame). A frame that copies lands in place, so it starts
    /// only once its `after_send` has left.
    pub(crate) fn stream(
        &mut self,
        ch: Channel,
        fp: &Fingerprint,
        plan: &Plan,
        mut data: Data<'_>,
        comb: &mut dyn Combine,
    ) -> Result<()> {
        self.beacon.set(fp.seq, fp.kind.code());
        self.trace_begin(fp);
        let scratch_need = plan
            .ins
            .iter()
            .filter(|i| matches!(i.land, Land::Reduce { .. }))
            .map(|i| i.len)
            .max()
            .unwrap_or(0);
        let order = LaneOrder::of(plan);
        // One frame of scratch per lane, each starting on an 8-byte boundary.
        let per_lane = scratch_need.div_ceil(8) * 8;
        self.scratch_bytes(per_lane * order.lanes());
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut st = Sending {
            si: [0; MAX_LANES],
            out: [None, None],
        };
        let r = self.run_plan(
            ch,
            fp,
            plan,
            &order,
            &mut data,
            comb,
            bytemuck::cast_slice_mut(&mut scratch),
            per_lane,
            &mut st,
        );
        self.scratch = scratch;
        if r.is_err() {
            self.finish_half_sent(ch, plan, &data, &mut st);
        }
        self.locate_on_timeout(r, fp, || plan.peers())
    }

    /// After a failure: finishes the frame that was half sent, while its peer keeps
    /// taking bytes (giving up after [`NOTICE_WAIT`] without any), so that the notice
    /// the communicator sends next lands between frames, where the peer reads it (a peer
    /// that reads half a frame and then a closed link can only blame this rank). The rest of the frame is the bytes it
    /// started with: no receive has changed them (that waits for the frame to leave), so
    /// the peer gets what it would have got.
    fn finish_half_sent(&mut self, ch: Channel, plan: &Plan, data: &Data<'_>, st: &mut Sending) {
        for (x, frame) in st.out.iter_mut().flatten() {
            let o = &plan.outs[*x];
            let Ok(peer) = self.link(ch, o.peer) else {
                continue;
            };
            // Give up after NOTICE_WAIT without progress (not in all: a loaded machine
            // may drain a large frame slowly, and the notice is worth the wait).
            let mut last = Instant::now();
            let Ok(bytes) = data.read(o.off..o.off + o.len) else {
                continue;
            };
            while let Ok((moved, false)) = frame.progress(peer, bytes) {
                if moved > 0 {
                    last = Instant::now();
                } else if last.elapsed() >= NOTICE_WAIT {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }

    /// The loop of [`Engine::stream`]; `st` holds the sends in progress when it fails.
    /// Each lane of `order` has its own send and receive cursor (a plan without lanes
    /// has one); `scratch` holds `per_lane` bytes for each lane's combining receive.
    #[allow(clippy::too_many_arguments)]
    fn run_plan(
        &mut self,
        ch: Channel,
        fp: &Fingerprint,
        plan: &Plan,
        order: &LaneOrder<'_>,
        data: &mut Data<'_>,
        comb: &mut dyn Combine,
        scratch: &mut [u8],
        per_lane: usize,
        st: &mut Sending,
    ) -> Result<()> {
        let (outs, ins) = (&plan.outs, &plan.ins);
        let lanes = order.lanes();
        let rank = self.rank;
        let counts = plan.counts.as_deref();
        let sent_count = |peer: usize| counts.and_then(|c| c.send.get(peer).copied());
        let recv_count = |peer: usize| counts.and_then(|c| c.recv.get(peer).copied());
        // Per lane: `ai`, the position of the next receive, which is applied once
        // complete (or held in the lane's scratch, `held` its index, until what it
        // waits for has left or been applied); `inp`, that receive's frame once it has
        // started.
        let mut ai = [0usize; MAX_LANES];
        let mut held: [Option<usize>; MAX_LANES] = [None; MAX_LANES];
        let mut inp: [Option<InFrame>; MAX_LANES] = [None, None];
        let mut pacer = Pacer::new(&self.cfg, self.health.clone(), self.spin);
        let done = |st: &Sending, ai: &[usize; MAX_LANES]| {
            (0..lanes).all(|l| order.lane_done(l, &st.si, ai))
        };
        let mut clock = WaitClock::default();
        let mut idle_rounds = 0u32;
        while !done(st, &ai) {
            let mut progressed = false;
            // A frame waits for a peer that has yet to dial in (nothing wakes the
            // waiter for that: look again soon).
            let mut unlinked = false;
            for l in 0..lanes {
                while let Some(x) = order.out(l, st.si[l]) {
                    let o = &outs[x];
                    if st.out[l].is_none() {
                        if o.after_recv.is_some_and(|d| !order.applied(d, &ai)) {
                            break;
                        }
                        st.out[l] = Some((
                            x,
                            OutFrame::new(&header(fp, o.step, o.seg, o.len, sent_count(o.peer))),
                        ));
                    }
                    let Some((_, frame)) = st.out[l].as_mut() else {
                        break;
                    };
                    let Some(peer) = self.try_link(ch, o.peer)? else {
                        unlinked = true;
                        break;
                    };
                    let bytes = data.read(o.off..o.off + o.len)?;
                    let (moved, sent) = frame
                        .progress(peer, bytes)
                        .map_err(|e| frame_error(rank, e, peer, o.peer, fp))?;
                    progressed |= moved > 0;
                    if !sent {
                        break;
                    }
                    st.out[l] = None;
                    st.si[l] += 1;
                    progressed = true;
                }
            }
            for l in 0..lanes {
                let scratch = &mut scratch[l * per_lane..(l + 1) * per_lane];
                if let Some(x) = held[l].filter(|&x| order.may_apply(x, &st.si, &ai)) {
                    apply(&ins[x], data, scratch, comb)?;
                    held[l] = None;
                    ai[l] += 1;
                    progressed = true;
                }
                while held[l].is_none() {
                    let Some(x) = order.inp(l, ai[l]) else {
                        break;
                    };
                    let i = &ins[x];
                    let lands_in_place = matches!(i.land, Land::Copy);
                    if inp[l].is_none() {
                        if lands_in_place && !order.may_apply(x, &st.si, &ai) {
                            break;
                        }
                        inp[l] = Some(InFrame::new(header(
                            fp,
                            i.step,
                            i.seg,
                            i.len,
                            recv_count(i.peer),
                        )));
                    }
                    let Some(frame) = inp[l].as_mut() else { break };
                    let dst = if lands_in_place {
                        data.write(i.range())?
                    } else {
                        &mut scratch[..i.len]
                    };
                    let Some(peer) = self.try_link(ch, i.peer)? else {
                        unlinked = true;
                        break;
                    };
                    let (moved, got) = frame
                        .progress(peer, dst)
                        .map_err(|e| frame_error(rank, e, peer, i.peer, fp))?;
                    progressed |= moved > 0;
                    if !got {
                        break;
                    }
                    inp[l] = None;
                    progressed = true;
                    if !order.may_apply(x, &st.si, &ai) {
                        held[l] = Some(x);
                        break;
                    }
                    apply(i, data, scratch, comb)?;
                    ai[l] += 1;
                }
            }
            if progressed {
                clock.end(self);
                pacer.moved();
                continue;
            }
            if done(st, &ai) {
                break;
            }
            let awaited = awaited(plan, order, st, &ai, &held, &inp, rank);
            let peer = awaited.peer();
            self.trace_waiting(peer);
            let t0 = clock.start(self, peer);
            let what = || awaited.to_string();
            if unlinked {
                pacer.idle_poll(rank, fp, what)?;
            } else {
                pacer.idle(&mut *self.waiter, rank, fp, what)?;
            }
            if !pacer.spinning() {
                // A peer in a slot call of this sequence number waits on no link: a
                // look at its stamps now and then (with ranks that share CPUs every
                // idle round is past the spin), every round once they sleep.
                idle_rounds = idle_rounds.wrapping_add(1);
                if idle_rounds.is_multiple_of(SLOT_CLASH_EVERY) || pacer.slept() {
                    if let Some(e) = self.slot_clash(ch, fp) {
                        return Err(e);
                    }
                }
            }
            clock.after_idle(self, peer, t0, pacer.spinning());
        }
        clock.end(self);
        Ok(())
    }
}
