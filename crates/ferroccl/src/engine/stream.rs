//! The push executor: a plan over links that move bytes (TCP, RDMA, in-process pipes).

use super::pacer::frame_error;
use super::{Engine, Pacer, NOTICE_WAIT};
use crate::algo::{In, Land, Plan};
use crate::error::{Error, Result};
use crate::reduce::Combine;
use crate::transport::Channel;
use crate::wire::{Fingerprint, FrameHeader, InFrame, OutFrame};
use std::ops::Range;
use std::time::Instant;

/// The send in progress: `out` is outs[`si`] once it has started.
struct Sending {
    si: usize,
    out: Option<OutFrame>,
}

/// The buffer an operation runs on: read-only for one that only sends.
pub(crate) enum Data<'a> {
    /// Frames are only sent from it.
    Read(&'a [u8]),
    /// Frames are sent from it and land in it.
    Write(&'a mut [u8]),
}

impl Data<'_> {
    fn read(&self, r: Range<usize>) -> &[u8] {
        match self {
            Data::Read(b) => &b[r],
            Data::Write(b) => &b[r],
        }
    }

    fn write(&mut self, r: Range<usize>) -> Result<&mut [u8]> {
        match self {
            Data::Write(b) => Ok(&mut b[r]),
            // An empty frame (a check) changes nothing.
            Data::Read(_) if r.is_empty() => Ok(&mut []),
            Data::Read(_) => Err(Error::InvalidArgument(
                "internal: a plan receives into a read-only buffer".into(),
            )),
        }
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
        dst.copy_from_slice(src);
    } else {
        comb.reduce(dst, src)?;
    }
    if finish {
        comb.finish(dst)?;
    }
    Ok(())
}

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
        self.scratch_bytes(scratch_need);
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut st = Sending { si: 0, out: None };
        let r = self.run_plan(
            ch,
            fp,
            plan,
            &mut data,
            comb,
            bytemuck::cast_slice_mut(&mut scratch),
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
        let (Some(frame), Some(o)) = (st.out.as_mut(), plan.outs.get(st.si)) else {
            return;
        };
        let Ok(peer) = self.link(ch, o.peer) else {
            return;
        };
        // Give up after NOTICE_WAIT without progress (not in all: a loaded machine may
        // drain a large frame slowly, and the notice is worth the wait).
        let mut last = Instant::now();
        while let Ok((moved, false)) = frame.progress(peer, data.read(o.off..o.off + o.len)) {
            if moved > 0 {
                last = Instant::now();
            } else if last.elapsed() >= NOTICE_WAIT {
                break;
            }
            std::thread::yield_now();
        }
    }

    /// The loop of [`Engine::stream`]; `st` holds the send in progress when it fails.
    #[allow(clippy::too_many_arguments)]
    fn run_plan(
        &mut self,
        ch: Channel,
        fp: &Fingerprint,
        plan: &Plan,
        data: &mut Data<'_>,
        comb: &mut dyn Combine,
        scratch: &mut [u8],
        st: &mut Sending,
    ) -> Result<()> {
        let (outs, ins) = (&plan.outs, &plan.ins);
        let rank = self.rank;
        let header = |step: u32, seg: u32, len: usize| FrameHeader {
            fp: *fp,
            step,
            seg,
            len: len as u32,
        };
        // `st.si`: next send (`st.out` once it has started); `ai`: next receive, which is
        // applied once complete (or held in scratch, `held`, until its send dependency
        // has left).
        let mut ai = 0usize;
        let mut held = false;
        let mut inp: Option<InFrame> = None;
        let mut pacer = Pacer::new(&self.cfg, self.abort.clone());
        while st.si < outs.len() || ai < ins.len() {
            let mut progressed = false;
            while st.si < outs.len() {
                let o = &outs[st.si];
                if st.out.is_none() {
                    if o.after_recv.is_some_and(|d| ai <= d) {
                        break;
                    }
                    st.out = Some(OutFrame::new(&header(o.step, o.seg, o.len)));
                }
                let Some(frame) = st.out.as_mut() else { break };
                let peer = self.link(ch, o.peer)?;
                let (moved, done) = frame
                    .progress(peer, data.read(o.off..o.off + o.len))
                    .map_err(|e| frame_error(rank, e, peer, o.peer, fp))?;
                progressed |= moved > 0;
                if !done {
                    break;
                }
                st.out = None;
                st.si += 1;
                progressed = true;
            }
            if held && ins[ai].after_send.is_none_or(|s| st.si > s) {
                apply(&ins[ai], data, scratch, comb)?;
                held = false;
                ai += 1;
                progressed = true;
            }
            while !held && ai < ins.len() {
                let i = &ins[ai];
                let lands_in_place = matches!(i.land, Land::Copy);
                if inp.is_none() {
                    if lands_in_place && i.after_send.is_some_and(|s| st.si <= s) {
                        break;
                    }
                    inp = Some(InFrame::new(header(i.step, i.seg, i.len)));
                }
                let Some(frame) = inp.as_mut() else { break };
                let dst = if lands_in_place {
                    data.write(i.range())?
                } else {
                    &mut scratch[..i.len]
                };
                let peer = self.link(ch, i.peer)?;
                let (moved, done) = frame
                    .progress(peer, dst)
                    .map_err(|e| frame_error(rank, e, peer, i.peer, fp))?;
                progressed |= moved > 0;
                if !done {
                    break;
                }
                inp = None;
                progressed = true;
                if i.after_send.is_some_and(|s| st.si <= s) {
                    held = true;
                    break;
                }
                apply(i, data, scratch, comb)?;
                ai += 1;
            }
            if st.si == outs.len() && ai == ins.len() {
                break;
            }
            if progressed {
                pacer.moved();
                continue;
            }
            // Waiting for a receive, or for a peer to take a send.
            let recv_wait = ai < ins.len() && !held && (st.si == outs.len() || inp.is_some());
            let peer = if recv_wait {
                ins[ai].peer
            } else {
                outs[st.si.min(outs.len() - 1)].peer
            };
            self.trace_waiting(peer);
            let t0 = Instant::now();
            pacer.idle(&mut *self.waiter, rank, fp, || {
                if recv_wait {
                    let i = &ins[ai];
                    format!(
                        "data from rank {} (step {}, segment {})",
                        i.peer, i.step, i.seg
                    )
                } else {
                    let o = &outs[st.si.min(outs.len() - 1)];
                    format!(
                        "rank {} to take data (step {}, segment {})",
                        o.peer, o.step, o.seg
                    )
                }
            })?;
            self.trace_waited(peer, t0.elapsed().as_nanos() as u64);
        }
        Ok(())
    }
}
