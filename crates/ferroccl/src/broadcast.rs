//! Pipelined chains: broadcast from a root, and reduce to a root.
//!
//! Both cut the buffer into segments that flow along the ring, so a rank forwards
//! segment `j` while segment `j+1` is still arriving: time ≈ S/B + (n-2)·seg/B instead
//! of (n-1)·S/B for a naive relay. Every rank except the chain's last sends S bytes.
//!
//! - Broadcast: the chain starts at the root and runs right; the rank left of the root
//!   is last.
//! - Reduce: the chain starts right of the root and ends at the root; each rank combines
//!   what arrives with its own data and passes it on, the root keeps the result.

use crate::engine::{Dst, Engine, In, Out};
use crate::error::Result;
use crate::schedule::{segment_range, segments};
use crate::transport::Channel;
use crate::wire::Fingerprint;

/// Frames of one segmented buffer: `(seg index, byte offset, byte length)`.
fn frames(len: usize, seg: usize) -> Vec<(u32, usize, usize)> {
    let whole = 0..len;
    (0..segments(len, seg))
        .map(|j| {
            let r = segment_range(&whole, seg, j);
            (j as u32, r.start, r.len())
        })
        .collect()
}

/// The frames of a chain, from one rank's side: `pos` is its place in the chain (0
/// starts, `n-1` ends). Everyone but the first receives each segment from the left
/// (landing at `dst(offset)`), everyone but the last forwards it to the right once it
/// has arrived.
fn chain(
    n: usize,
    pos: usize,
    left: usize,
    right: usize,
    fr: &[(u32, usize, usize)],
    dst: impl Fn(usize) -> Dst,
) -> (Vec<Out>, Vec<In>) {
    let ins = if pos == 0 {
        Vec::new()
    } else {
        fr.iter()
            .map(|&(j, off, len)| In {
                peer: left,
                step: 0,
                seg: j,
                len,
                dst: dst(off),
                after_send: None,
            })
            .collect()
    };
    let outs = if pos == n - 1 {
        Vec::new()
    } else {
        fr.iter()
            .enumerate()
            .map(|(i, &(j, off, len))| Out {
                peer: right,
                step: 0,
                seg: j,
                off,
                len,
                after_recv: (pos > 0).then_some(i),
            })
            .collect()
    };
    (outs, ins)
}

/// Broadcasts `buf` from `root` to every rank, in place.
pub(crate) fn broadcast(
    e: &mut Engine,
    buf: &mut [u8],
    esize: usize,
    root: usize,
    fp: &Fingerprint,
) -> Result<()> {
    let n = e.world_size;
    if n == 1 {
        return Ok(());
    }
    let pos = (e.rank + n - root) % n;
    let right = (e.rank + 1) % n;
    let left = (e.rank + n - 1) % n;
    let seg = (e.cfg.segment_bytes / esize).max(1) * esize;
    let fr = frames(buf.len(), seg);
    let (outs, ins) = chain(n, pos, left, right, &fr, Dst::Buf);
    // SAFETY: frames address disjoint segments of `buf`; a segment is forwarded only
    // after it has arrived.
    unsafe {
        e.stream(
            Channel::Collective,
            fp,
            buf.as_mut_ptr(),
            &outs,
            &ins,
            &mut |_, _| {},
        )
    }
}

/// Reduces every rank's `buf` into the root's `buf`. On other ranks `buf` is used as
/// the working buffer and holds a partial result afterwards.
pub(crate) fn reduce(
    e: &mut Engine,
    buf: &mut [u8],
    esize: usize,
    root: usize,
    fp: &Fingerprint,
    reduce: &dyn Fn(&mut [u8], &[u8]),
    finish: &dyn Fn(&mut [u8]),
) -> Result<()> {
    let n = e.world_size;
    if n == 1 {
        return Ok(());
    }
    let pos = (e.rank + n - root - 1) % n; // the root is last (n-1)
    let right = (e.rank + 1) % n;
    let left = (e.rank + n - 1) % n;
    let seg = (e.cfg.segment_bytes / esize).max(1) * esize;
    let fr = frames(buf.len(), seg);
    let (outs, ins) = chain(n, pos, left, right, &fr, |_| Dst::Scratch);
    let base = buf.as_mut_ptr();
    let is_root = pos == n - 1;
    let mut on_recv = |i: usize, data: Option<&mut [u8]>| {
        if let Some(src) = data {
            let (_, off, len) = fr[i];
            // SAFETY: segment `i` of `buf`; its send (if any) waits for this receive.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(off), len) };
            reduce(dst, &*src);
            if is_root {
                finish(dst);
            }
        }
    };
    // SAFETY: as for broadcast; received segments land in scratch and are reduced into
    // `buf` before that segment is sent on.
    unsafe { e.stream(Channel::Collective, fp, base, &outs, &ins, &mut on_recv) }
}
