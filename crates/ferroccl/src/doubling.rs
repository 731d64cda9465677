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

use crate::engine::{Dst, Engine, In, Out};
use crate::error::{Error, Result};
use crate::transport::Channel;
use crate::wire::Fingerprint;

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

/// In-place recursive-doubling all-reduce of `buf` (elements of the kernel's type).
/// `reduce(dst, src)` is `dst = dst op src`; `finish` runs once at the end (Avg).
pub(crate) fn all_reduce(
    e: &mut Engine,
    buf: &mut [u8],
    fp: &Fingerprint,
    reduce: &dyn Fn(&mut [u8], &[u8]),
    finish: &dyn Fn(&mut [u8]),
) -> Result<()> {
    let n = e.world_size;
    let r = e.rank;
    if n == 1 {
        return Ok(());
    }
    let p = pow2_floor(n);
    let stages = p.trailing_zeros() as usize;
    if buf.len() > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "recursive doubling moves the whole buffer in one frame; {} bytes is too large",
            buf.len()
        )));
    }
    if r >= p {
        // Hand our data to rank r-p, then receive the result from it.
        exchange(e, fp, 0, buf, Some(r - p), None, &mut |_, _| {})?;
        return exchange(
            e,
            fp,
            stages + 1,
            buf,
            None,
            Some((r - p, false)),
            &mut |_, _| {},
        );
    }
    let base = buf.as_mut_ptr();
    let len = buf.len();
    // SAFETY (all callbacks below): `base..base+len` is `buf`, and no frame is reading
    // or writing it while a callback runs (each exchange's send has completed or
    // reads the same bytes unchanged; its receive went to scratch).
    let own = || unsafe { std::slice::from_raw_parts_mut(base, len) };
    if r + p < n {
        exchange(e, fp, 0, buf, None, Some((r + p, true)), &mut |_, data| {
            if let Some(d) = data {
                reduce(own(), d); // we are the lower rank
            }
        })?;
    }
    // The partner's frame may arrive before our own send of `buf` has left (a transport
    // that buffers less than the message, such as an RDMA ring): reducing into `buf`
    // then would send partly reduced data. So each stage keeps the frame and reduces
    // once both directions are done, in a buffer the engine keeps between calls (u64
    // words: the reduction kernels need the element type's alignment).
    let mut held = std::mem::take(&mut e.spare);
    if held.len() * 8 < len {
        held.resize(len.div_ceil(8), 0);
    }
    for k in 0..stages {
        let partner = r ^ (1 << k);
        let mut got = false;
        exchange(
            e,
            fp,
            k + 1,
            buf,
            Some(partner),
            Some((partner, true)),
            &mut |_, data| {
                if let Some(d) = data {
                    bytemuck::cast_slice_mut::<u64, u8>(&mut held)[..d.len()].copy_from_slice(d);
                    got = true;
                }
            },
        )?;
        if got {
            let d = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut held)[..len];
            if partner < r {
                // lower op higher: the partner's value goes on the left.
                reduce(d, own());
                own().copy_from_slice(d);
            } else {
                reduce(own(), d);
            }
        }
    }
    e.spare = held;
    finish(own());
    if r + p < n {
        exchange(e, fp, stages + 1, buf, Some(r + p), None, &mut |_, _| {})?;
    }
    Ok(())
}

/// Sends `buf` to `to` (if any) and receives a frame of the same size from `from` (if
/// any; into scratch when its flag is true, else into `buf`), both as step `step`.
fn exchange(
    e: &mut Engine,
    fp: &Fingerprint,
    step: usize,
    buf: &mut [u8],
    to: Option<usize>,
    from: Option<(usize, bool)>,
    on_recv: &mut dyn FnMut(usize, Option<&mut [u8]>),
) -> Result<()> {
    let len = buf.len();
    let outs: Vec<Out> = to
        .map(|peer| Out {
            peer,
            step: step as u32,
            seg: 0,
            off: 0,
            len,
            after_recv: None,
        })
        .into_iter()
        .collect();
    let ins: Vec<In> = from
        .map(|(peer, scratch)| In {
            peer,
            step: step as u32,
            seg: 0,
            len,
            dst: if scratch { Dst::Scratch } else { Dst::Buf(0) },
            // Landing in `buf` must wait for our own send of it to finish.
            after_send: (!scratch && to.is_some()).then_some(0),
        })
        .into_iter()
        .collect();
    // SAFETY: both frames address `buf` (or scratch), which outlives the call.
    unsafe {
        e.stream(
            Channel::Collective,
            fp,
            buf.as_mut_ptr(),
            &outs,
            &ins,
            on_recv,
        )
    }
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
