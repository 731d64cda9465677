//! Recursive-doubling all-reduce, for small messages.
//!
//! The ring needs `2(n-1)` steps; each costs a network round of latency, which is all a
//! small message pays. Recursive doubling needs `log2(p)` steps (`p` the largest power of
//! two `<= n`), exchanging the whole buffer with partner `r XOR 2^k` at step `k`. When
//! `n` is not a power of two, ranks `p..n` first hand their data to rank `r - p` and get
//! the result back at the end (two more steps, for those pairs only).
//!
//! Bitwise agreement does not rely on the operator being commutative in floating
//! point: both partners of a step evaluate `lower op higher`, the lower rank's value on
//! the left, so they compute the same bits, and by induction every rank ends with the
//! same bytes.
//!
//! It sends `log2(p)·S` bytes per rank instead of the ring's `2(n-1)/n·S`, so it is used
//! only up to [`crate::Config::small_message_bytes`].

use crate::comm::{Communicator, Pacer};
use crate::error::{Error, Result};
use crate::reduce::{kernels, Element, ReduceOp};
use crate::wire::{Fingerprint, FrameHeader, InFrame, OutFrame};

/// Largest power of two `<= n` (`n >= 1`).
pub(crate) fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// The peers rank `rank` exchanges with in a recursive doubling over `n` ranks.
pub(crate) fn peers(rank: usize, n: usize) -> Vec<usize> {
    let p = pow2_floor(n);
    let mut v = Vec::new();
    if rank >= p {
        v.push(rank - p);
        return v;
    }
    if rank + p < n {
        v.push(rank + p);
    }
    let mut mask = 1;
    while mask < p {
        v.push(rank ^ mask);
        mask <<= 1;
    }
    v
}

/// In-place recursive-doubling all-reduce of `buf`.
pub(crate) fn all_reduce<T: Element>(
    c: &mut Communicator,
    buf: &mut [T],
    op: ReduceOp,
    fp: &Fingerprint,
) -> Result<()> {
    let n = c.world_size;
    let r = c.rank;
    if n == 1 {
        return Ok(());
    }
    let p = pow2_floor(n);
    let stages = p.trailing_zeros() as usize;
    let bytes = bytemuck::cast_slice_mut::<T, u8>(buf);
    let len = bytes.len();
    if len > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "recursive doubling moves the whole buffer in one frame; {len} bytes is too large"
        )));
    }
    if c.scratch.len() * 8 < len {
        c.scratch = vec![0u64; len.div_ceil(8)];
    }
    let mut scratch = std::mem::take(&mut c.scratch);
    let result = (|| {
        let tmp = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut scratch)[..len];
        let reduce = |dst: &mut [u8], src: &[u8]| kernels::reduce_bytes(T::DTYPE, op, dst, src);

        if r >= p {
            // Hand our data to rank r-p, then receive the result from it.
            exchange(c, fp, 0, Some((r - p, &*bytes)), None)?;
            return exchange(c, fp, stages + 1, None, Some((r - p, bytes)));
        }
        if r + p < n {
            exchange(c, fp, 0, None, Some((r + p, &mut *tmp)))?;
            reduce(bytes, tmp); // we are the lower rank
        }
        for k in 0..stages {
            let partner = r ^ (1 << k);
            exchange(
                c,
                fp,
                k + 1,
                Some((partner, &*bytes)),
                Some((partner, &mut *tmp)),
            )?;
            if partner < r {
                // lower op higher: the partner's value goes on the left.
                reduce(tmp, bytes);
                bytes.copy_from_slice(tmp);
            } else {
                reduce(bytes, tmp);
            }
        }
        if op == ReduceOp::Avg {
            kernels::scale_bytes(T::DTYPE, bytes, n);
        }
        if r + p < n {
            exchange(c, fp, stages + 1, Some((r + p, &*bytes)), None)?;
        }
        Ok(())
    })();
    c.scratch = scratch;
    result
}

/// Sends `send` (if any) and receives into `recv` (if any) at once, each as one frame
/// of step `step`, and returns when both are done.
fn exchange(
    c: &mut Communicator,
    fp: &Fingerprint,
    step: usize,
    send: Option<(usize, &[u8])>,
    recv: Option<(usize, &mut [u8])>,
) -> Result<()> {
    let header = |len: usize| FrameHeader {
        fp: *fp,
        step: step as u32,
        seg: 0,
        len: len as u32,
    };
    // SAFETY: the slices outlive the frames (both are dropped before return) and are
    // distinct buffers (`send` is the user's, `recv` the scratch or, for the final
    // hand-back, the user's buffer while nothing is being sent from it).
    let mut out = send.map(|(p, b)| {
        (p, unsafe {
            OutFrame::new(&header(b.len()), b.as_ptr(), b.len())
        })
    });
    let mut inp = recv.map(|(p, b)| (p, unsafe { InFrame::new(header(b.len()), b.as_mut_ptr()) }));
    let mut pacer = Pacer::new(&c.cfg);
    loop {
        let mut progressed = false;
        if let Some((p, frame)) = out.as_mut() {
            let peer = c.peers[*p]
                .as_mut()
                .ok_or_else(|| missing_link(c.rank, *p))?;
            let (moved, done) = frame.progress(peer).map_err(|e| c.frame_error(e, *p, fp))?;
            progressed |= moved > 0;
            if done {
                out = None;
                progressed = true;
            }
        }
        if let Some((p, frame)) = inp.as_mut() {
            let peer = c.peers[*p]
                .as_mut()
                .ok_or_else(|| missing_link(c.rank, *p))?;
            let (moved, done) = frame.progress(peer).map_err(|e| c.frame_error(e, *p, fp))?;
            progressed |= moved > 0;
            if done {
                inp = None;
                progressed = true;
            }
        }
        if out.is_none() && inp.is_none() {
            return Ok(());
        }
        if progressed {
            pacer.moved();
            continue;
        }
        let (rank, waiter) = (c.rank, &mut *c.waiter);
        let from = inp.as_ref().map(|(p, _)| *p);
        let to = out.as_ref().map(|(p, _)| *p);
        pacer.idle(waiter, rank, fp, || match (from, to) {
            (Some(p), _) => format!("data from rank {p} (step {step})"),
            (None, Some(p)) => format!("rank {p} to take data (step {step})"),
            _ => String::new(),
        })?;
    }
}

fn missing_link(rank: usize, peer: usize) -> Error {
    Error::Config(format!("rank {rank} has no link to rank {peer}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partners_are_symmetric() {
        for n in 1..=40 {
            for r in 0..n {
                for q in peers(r, n) {
                    assert!(q < n && q != r, "n={n} r={r} q={q}");
                    assert!(
                        peers(q, n).contains(&r),
                        "n={n}: {r} lists {q} but not back"
                    );
                }
            }
            assert!(pow2_floor(n) <= n && 2 * pow2_floor(n) > n);
        }
    }
}
