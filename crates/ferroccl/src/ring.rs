//! Ring reduce-scatter, all-gather and all-reduce: one schedule, one implementation.
//!
//! The schedule comes from [`crate::schedule`]: `2(n-1)` steps, at step `t` send chunk
//! `r-t-1` right and receive chunk `r-t-2` from the left, reducing for `t < n-1` and
//! copying after. Reduce-scatter runs steps `0..n-1`, all-gather `n-1..2(n-1)`,
//! all-reduce all of them. Chunks are cut into segments and streamed: a segment leaves
//! as soon as the same segment of the previous step has arrived (and been reduced), so
//! receiving segment `j+1` overlaps reducing segment `j` and sending it on, and both
//! directions of the ring move at once. In NCCL's vocabulary the sends are `send`
//! (first step), `recvReduceSend`, `recvReduceCopySend` (the owner's last reduction),
//! `recvCopySend` and finally `recv` — here they are one rule.

use crate::engine::{Dst, Engine, In, Out};
use crate::error::Result;
use crate::schedule;
use crate::transport::Channel;
use crate::wire::Fingerprint;
use std::ops::Range;

/// Steps `steps` of the ring over `buf` (elements of `esize` bytes) cut into `chunks`
/// (element ranges, one per rank). `reduce(dst, src)` combines a received segment into
/// the local one; `finish(dst)` runs once on each segment of this rank's own chunk when
/// its reduction is complete (Avg's division).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    e: &mut Engine,
    buf: &mut [u8],
    esize: usize,
    chunks: &[Range<usize>],
    steps: Range<usize>,
    fp: &Fingerprint,
    reduce: &dyn Fn(&mut [u8], &[u8]),
    finish: &dyn Fn(&mut [u8]),
) -> Result<()> {
    let n = e.world_size;
    if n == 1 || steps.is_empty() {
        return Ok(());
    }
    debug_assert_eq!(chunks.len(), n);
    debug_assert!(chunks.last().is_none_or(|c| c.end * esize <= buf.len()));
    let rank = e.rank;
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let max_chunk = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
    let seg_elems = schedule::pipeline_segment(max_chunk, esize, e.cfg.segment_bytes);
    let sends = schedule::ring_plan(chunks, rank, steps.clone(), seg_elems, true);
    let recvs = schedule::ring_plan(chunks, rank, steps.clone(), seg_elems, false);
    let first_of_step = |plan: &[schedule::Transfer]| {
        let mut v = vec![usize::MAX; steps.len()];
        for (i, f) in plan.iter().enumerate().rev() {
            v[f.step - steps.start] = i;
        }
        v
    };
    let send_start = first_of_step(&sends);
    let recv_start = first_of_step(&recvs);
    let last_rs = n - 2; // the step that completes this rank's chunk

    let outs: Vec<Out> = sends
        .iter()
        .map(|f| Out {
            peer: right,
            step: f.step as u32,
            seg: f.seg as u32,
            off: f.elems.start * esize,
            len: f.elems.len() * esize,
            // Forward what arrived at the previous step.
            after_recv: (f.step > steps.start)
                .then(|| recv_start[f.step - 1 - steps.start] + f.seg),
        })
        .collect();
    let ins: Vec<In> = recvs
        .iter()
        .map(|f| {
            let gather = f.step > last_rs;
            // An all-gather receive overwrites the chunk this rank sent at step t+1-n.
            let overwrites = (gather && f.step + 1 >= n + steps.start)
                .then(|| send_start[f.step + 1 - n - steps.start] + f.seg);
            In {
                peer: left,
                step: f.step as u32,
                seg: f.seg as u32,
                len: f.elems.len() * esize,
                dst: if gather {
                    Dst::Buf(f.elems.start * esize)
                } else {
                    Dst::Scratch
                },
                after_send: overwrites,
            }
        })
        .collect();
    let base = buf.as_mut_ptr();
    let mut on_recv = |i: usize, data: Option<&mut [u8]>| {
        let f = &recvs[i];
        if let Some(src) = data {
            // SAFETY: the segment lies in `buf`; no frame reads or writes it now (its
            // forwarding send waits for this receive).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    base.add(f.elems.start * esize),
                    f.elems.len() * esize,
                )
            };
            reduce(dst, &*src);
            if f.step == last_rs {
                finish(dst);
            }
        }
    };
    // SAFETY: every frame addresses a segment of `buf`, which outlives the call. A
    // segment is read by a send only after the receive that completes it (after_recv),
    // and an all-gather receive overwrites a segment only after the send that read it
    // (after_send); reduce-scatter receives land in scratch.
    unsafe { e.stream(Channel::Collective, fp, base, &outs, &ins, &mut on_recv) }
}
