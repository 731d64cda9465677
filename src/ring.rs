//! Ring all-reduce: reduce-scatter then all-gather, segmented and pipelined.
//!
//! The schedule comes from [`crate::schedule`]: `2(n-1)` steps, at step `t` send chunk
//! `r-t` right and receive chunk `r-t-1` from the left, reducing for `t < n-1` and
//! copying after. Chunks are cut into segments, and one loop streams them: a segment
//! leaves as soon as the same segment of the previous step has arrived (and been
//! reduced), so receiving segment `j+1` overlaps reducing segment `j` and sending it on,
//! and both directions of the ring move at once. In NCCL's vocabulary the sends are
//! `send` (t = 0), `recvReduceSend` (t < n-2), `recvReduceCopySend` (t = n-2, the
//! owner), `recvCopySend` and finally `recv` — here they are one rule.
//!
//! The loop never blocks on one link: it pushes the send side and pulls the receive
//! side until both would block, then sleeps in the transport's waiter. A wait that sees
//! no byte move for [`crate::Config::timeout`] fails naming what it waited for.

use crate::comm::{Communicator, Pacer};
use crate::error::{Error, Result};
use crate::reduce::{kernels, Element, ReduceOp};
use crate::schedule::{self, Transfer};
use crate::wire::{Fingerprint, FrameHeader, InFrame, OutFrame};

/// In-place ring all-reduce of `buf` (the caller has checked op and poisoning).
pub(crate) fn all_reduce<T: Element>(
    c: &mut Communicator,
    buf: &mut [T],
    op: ReduceOp,
    fp: &Fingerprint,
) -> Result<()> {
    let n = c.world_size;
    if n == 1 {
        // Avg over one rank is the identity.
        return Ok(());
    }
    let esize = std::mem::size_of::<T>();
    let seg_elems = (c.cfg.segment_bytes / esize).max(1);
    let bytes = bytemuck::cast_slice_mut::<T, u8>(buf);
    run_ring(
        c,
        bytes,
        esize,
        seg_elems,
        fp,
        &|dst, src| kernels::reduce_bytes(T::DTYPE, op, dst, src),
        &|dst| {
            if op == ReduceOp::Avg {
                kernels::scale_bytes(T::DTYPE, dst, n)
            }
        },
    )
}

/// The streaming loop over a byte buffer of `esize`-byte elements.
///
/// `reduce(dst, src)` combines a received segment into the local one; `finish(dst)` is
/// applied once to each segment of the owned chunk when it is complete (Avg's division).
fn run_ring(
    c: &mut Communicator,
    buf: &mut [u8],
    esize: usize,
    seg_elems: usize,
    fp: &Fingerprint,
    reduce: &dyn Fn(&mut [u8], &[u8]),
    finish: &dyn Fn(&mut [u8]),
) -> Result<()> {
    let n = c.world_size;
    let rank = c.rank;
    let count = buf.len() / esize;
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let rs_steps = n - 1;

    let sends = schedule::allreduce_plan(count, n, rank, seg_elems, true);
    let recvs = schedule::allreduce_plan(count, n, rank, seg_elems, false);
    let first_of_step = |plan: &[Transfer]| {
        let mut v = vec![0usize; schedule::allreduce_steps(n) + 1];
        for (i, f) in plan.iter().enumerate().rev() {
            v[f.step] = i;
        }
        v[schedule::allreduce_steps(n)] = plan.len();
        v
    };
    let send_start = first_of_step(&sends);
    let recv_start = first_of_step(&recvs);

    let scratch_bytes = seg_elems * esize;
    if c.scratch.len() * 8 < scratch_bytes {
        c.scratch = vec![0u64; scratch_bytes.div_ceil(8)];
    }
    let scratch: *mut u8 = c.scratch.as_mut_ptr().cast();
    let base: *mut u8 = buf.as_mut_ptr();

    let header = |f: &Transfer| FrameHeader {
        fp: *fp,
        step: f.step as u32,
        seg: f.seg as u32,
        len: (f.elems.len() * esize) as u32,
    };

    let mut si = 0; // next send frame
    let mut ri = 0; // next receive frame
    let mut out: Option<OutFrame> = None;
    let mut inp: Option<InFrame> = None;
    let mut pacer = Pacer::new(&c.cfg);

    while si < sends.len() || ri < recvs.len() {
        let mut progressed = false;

        // Send side: frames leave in order; frame (t, j) needs frame (t-1, j) received.
        while si < sends.len() {
            if out.is_none() {
                let f = &sends[si];
                if f.step > 0 && ri <= recv_start[f.step - 1] + f.seg {
                    break;
                }
                let off = f.elems.start * esize;
                let len = f.elems.len() * esize;
                // SAFETY: `off..off+len` lies in `buf`, which outlives the frame. No
                // receive writes these bytes while the frame is in flight: the next
                // write to this chunk is receive (t+1, j) during reduce-scatter (which
                // only starts after this send's dependency chain) or the all-gather
                // receive that waits for this frame to finish (below).
                out = Some(unsafe { OutFrame::new(&header(f), base.add(off), len) });
            }
            let Some(frame) = out.as_mut() else { break };
            let Some(peer) = c.peers[right].as_mut() else {
                return Err(missing_link(rank, right));
            };
            let (moved, done) = frame
                .progress(peer)
                .map_err(|e| c.frame_error(e, right, fp))?;
            progressed |= moved > 0;
            if !done {
                break;
            }
            out = None;
            si += 1;
            progressed = true;
        }

        // Receive side.
        while ri < recvs.len() {
            let f = &recvs[ri];
            if inp.is_none() {
                let allgather = f.step >= rs_steps;
                if allgather {
                    // This chunk was sent at step t+1-n; its bytes are overwritten
                    // here, so that frame must be gone first.
                    let prior = send_start[f.step + 1 - n] + f.seg;
                    if si <= prior {
                        break;
                    }
                }
                let dst = if allgather {
                    // SAFETY: in-bounds; the only other user of these bytes (the send
                    // at step t+1-n) has completed.
                    unsafe { base.add(f.elems.start * esize) }
                } else {
                    scratch
                };
                // SAFETY: `dst` has room for the frame (scratch holds a whole segment),
                // outlives it, and nothing else touches it until the frame completes.
                inp = Some(unsafe { InFrame::new(header(f), dst) });
            }
            let Some(frame) = inp.as_mut() else { break };
            let Some(peer) = c.peers[left].as_mut() else {
                return Err(missing_link(rank, left));
            };
            let (moved, done) = frame
                .progress(peer)
                .map_err(|e| c.frame_error(e, left, fp))?;
            progressed |= moved > 0;
            if !done {
                break;
            }
            inp = None;
            if f.step < rs_steps {
                let off = f.elems.start * esize;
                let len = f.elems.len() * esize;
                // SAFETY: scratch holds the `len` bytes just received; `buf[off..off+len]`
                // is not in flight (see the send side's argument).
                let (dst, src) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(base.add(off), len),
                        std::slice::from_raw_parts(scratch.cast_const(), len),
                    )
                };
                reduce(dst, src);
                if f.step == rs_steps - 1 {
                    finish(dst);
                }
            }
            ri += 1;
            progressed = true;
        }

        if si == sends.len() && ri == recvs.len() {
            break;
        }
        if progressed {
            pacer.moved();
            continue;
        }
        pacer.idle(&mut *c.waiter, rank, fp, || {
            if ri < recvs.len() && (si == sends.len() || inp.is_some()) {
                let f = &recvs[ri];
                format!("data from rank {left} (step {}, segment {})", f.step, f.seg)
            } else {
                let f = &sends[si.min(sends.len() - 1)];
                format!(
                    "rank {right} to take data (step {}, segment {})",
                    f.step, f.seg
                )
            }
        })?;
    }
    Ok(())
}

fn missing_link(rank: usize, peer: usize) -> Error {
    Error::Config(format!("rank {rank} has no link to rank {peer}"))
}
