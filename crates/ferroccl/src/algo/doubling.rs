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
//! only up to [`crate::config::Tuning::small_message_bytes`].

use super::{In, Land, Out, Plan};

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

/// The plan of `rank` in a recursive-doubling all-reduce of a buffer of `len` bytes
/// over `n` ranks (the barrier is the same plan with `len == 0`). Frames carry the whole
/// buffer, so `len` must fit a frame header (checked by the caller).
///
/// Steps: 0, ranks `p..n` hand their buffer to `rank - p`; `1..=log2 p`, partners
/// `r ^ 2^(k-1)` exchange and both combine `lower op higher`; `log2 p + 1`, the result
/// goes back to `p..n`. A partner's frame may arrive before this rank's own send of the
/// buffer has left (a transport that buffers less than the message, such as an RDMA
/// ring): each stage's receive is combined only after the stage's send has left
/// ([`In::after_send`]), so the send never carries partly combined bytes.
pub(crate) fn plan(rank: usize, n: usize, len: usize) -> Plan {
    let mut plan = Plan::default();
    if n == 1 {
        return plan;
    }
    let p = pow2_floor(n);
    let stages = p.trailing_zeros();
    let whole = |peer: usize, step: u32| Out {
        peer,
        step,
        seg: 0,
        off: 0,
        len,
        after_recv: None,
    };
    if rank >= p {
        // Hand our data to rank r-p, then receive the result from it.
        plan.outs.push(whole(rank - p, 0));
        plan.ins.push(In {
            peer: rank - p,
            step: stages + 1,
            seg: 0,
            off: 0,
            len,
            land: Land::Copy,
            // Landing in the buffer waits for our own send of it.
            after_send: Some(0),
        });
        return plan;
    }
    if rank + p < n {
        plan.ins.push(In {
            peer: rank + p,
            step: 0,
            seg: 0,
            off: 0,
            len,
            // We are the lower rank: ours on the left.
            land: Land::Reduce {
                theirs_first: false,
                finish: false,
            },
            after_send: None,
        });
    }
    for k in 0..stages {
        let partner = rank ^ (1 << k);
        plan.outs.push(Out {
            after_recv: plan.ins.len().checked_sub(1),
            ..whole(partner, k + 1)
        });
        plan.ins.push(In {
            peer: partner,
            step: k + 1,
            seg: 0,
            off: 0,
            len,
            // lower op higher: the partner's value goes on the left when it is lower.
            land: Land::Reduce {
                theirs_first: partner < rank,
                finish: k + 1 == stages,
            },
            after_send: Some(plan.outs.len() - 1),
        });
    }
    if rank + p < n {
        plan.outs.push(Out {
            after_recv: Some(plan.ins.len() - 1),
            ..whole(rank + p, stages + 1)
        });
    }
    plan
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

    #[test]
    fn plans_fit_and_sum() {
        use super::super::tests::{check_plans, simulate};
        for n in 1..=17 {
            let plans: Vec<Plan> = (0..n).map(|r| plan(r, n, 3 * 8)).collect();
            check_plans(&plans);
            let bufs = (0..n).map(|r| vec![r as f64, 1.0, -(r as f64)]).collect();
            let want = vec![
                (n * (n - 1) / 2) as f64,
                n as f64,
                -((n * (n - 1) / 2) as f64),
            ];
            for (r, b) in simulate(&plans, bufs).into_iter().enumerate() {
                assert_eq!(b, want, "n={n} rank {r}");
            }
            // Every rank's result is made final exactly once (or is the input, n = 1).
            for (r, p) in plans.iter().enumerate() {
                let finals = p.ins.iter().filter(|i| i.is_final()).count();
                assert_eq!(finals, usize::from(n > 1), "n={n} rank {r}");
            }
        }
    }
}
