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

use super::schedule::{left, right};
use super::{frames, In, Land, Out, Plan};

/// The frames of a chain over `len` bytes in segments of `seg` bytes, from the side of
/// the rank at `pos` (0 starts, `n-1` ends). Everyone but the first receives each
/// segment from the left (landing as `land`), everyone but the last forwards it to the
/// right once it has arrived.
fn chain(rank: usize, n: usize, pos: usize, len: usize, seg: usize, land: Land) -> Plan {
    let mut plan = Plan::default();
    if n == 1 {
        return plan;
    }
    for (i, (j, r)) in frames(len, seg).enumerate() {
        if pos > 0 {
            plan.ins.push(In {
                peer: left(rank, n),
                step: 0,
                seg: j,
                off: r.start,
                len: r.len(),
                land,
                after_send: None,
            });
        }
        if pos < n - 1 {
            plan.outs.push(Out {
                peer: right(rank, n),
                step: 0,
                seg: j,
                off: r.start,
                len: r.len(),
                after_recv: (pos > 0).then_some(i),
            });
        }
    }
    plan
}

/// Broadcast of `len` bytes from `root`, in place, in segments of `seg` bytes.
pub(crate) fn broadcast(rank: usize, n: usize, root: usize, len: usize, seg: usize) -> Plan {
    let pos = (rank + n - root) % n;
    chain(rank, n, pos, len, seg, Land::Copy)
}

/// Reduce of `len` bytes into `root`, in place, in segments of `seg` bytes. On the
/// other ranks the buffer is working space and holds a partial result afterwards.
pub(crate) fn reduce(rank: usize, n: usize, root: usize, len: usize, seg: usize) -> Plan {
    let pos = (rank + n - root - 1) % n; // the root is last (n-1)
    let land = Land::Reduce {
        theirs_first: false,
        finish: pos == n - 1,
    };
    chain(rank, n, pos, len, seg, land)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_plans, simulate};
    use super::*;

    #[test]
    fn broadcast_and_reduce_compute_their_definition() {
        for n in 1..=9 {
            for root in 0..n {
                for (len, seg) in [(0, 8), (8, 8), (80, 16), (80, 24)] {
                    let b: Vec<Plan> = (0..n).map(|r| broadcast(r, n, root, len, seg)).collect();
                    check_plans(&b);
                    let bufs = (0..n).map(|r| vec![r as f64; len / 8]).collect();
                    for out in simulate(&b, bufs) {
                        assert_eq!(out, vec![root as f64; len / 8], "n={n} root={root}");
                    }
                    let p: Vec<Plan> = (0..n).map(|r| reduce(r, n, root, len, seg)).collect();
                    check_plans(&p);
                    let bufs = (0..n).map(|r| vec![r as f64 + 1.0; len / 8]).collect();
                    let out = simulate(&p, bufs);
                    let want = (n * (n + 1) / 2) as f64;
                    assert_eq!(out[root], vec![want; len / 8], "n={n} root={root}");
                    // Only the root's receives are final.
                    for (r, plan) in p.iter().enumerate() {
                        assert!(plan.ins.iter().all(|i| i.is_final() == (r == root)));
                    }
                }
            }
        }
    }
}
