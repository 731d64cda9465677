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
//!
//! # Root agreement
//!
//! A rank may return Ok from a broadcast or reduce only once every rank is known to
//! have made the same call, root included: otherwise ranks that disagree on the root
//! would return different data, or wait for data nobody sends (a reduce where every
//! rank names itself the root). Every frame's header carries the call's fingerprint,
//! checked on arrival, and a data frame leaves a rank only once the frames before it
//! on that rank checked out, so the data a rank receives from its left neighbour tells
//! it that every rank *before* it in the chain made its call. What it must still hear
//! is the ranks after it, and a disagreement must never leave a rank waiting for data
//! nobody sends. So each plan adds empty check frames, all sent first, depending on
//! nothing:
//!
//! - every rank except the chain's first sends one to its right neighbour (the first
//!   sends its data there at once), and every rank reads its left neighbour's frame
//!   before anything else: of any two neighbours that disagree, the right one sees it
//!   at once, whatever else is waiting.
//! - up to [`FULL_CHECK_MAX`] ranks, every rank also sends one to each rank before it
//!   in the chain, read there after the data: a rank hears from all after it
//!   directly, and from all before it through its data.
//! - beyond, after the data, the frames of a recursive-doubling barrier instead: its
//!   last frame reaches a rank only after every rank has checked its left neighbour,
//!   `log2 n` rounds.
//!
//! A rank that sees a disagreement fails with a mismatch naming both calls; the others
//! learn of it through the notice it sends before closing its links. Nobody waits for
//! the timeout, and no rank returns Ok unless every rank called the same thing.
//!
//! The tree's broadcast and reduce ([`super::tree`]) keep the same guarantee with
//! frames arranged otherwise ([`with_agreement`]): their data does not follow the
//! ring, so it vouches for no neighbour. Up to [`FULL_CHECK_MAX`] ranks every rank
//! sends an empty frame to every other first and reads them all before any data;
//! beyond, the recursive-doubling barrier comes first and no data leaves a rank before
//! it is complete, so no rank ever waits for data from a rank that saw the call
//! differently. The plan model finds the deadlock if the data goes first there (two
//! roots' trees, each root waiting for the other as its child).
//!
//! Cost, up to [`FULL_CHECK_MAX`] ranks: a broadcast root sends nothing but its data
//! and reads one check from each other rank; a reduce root reads its data and sends
//! the checks. Over two ranks that is one empty frame per call, from the chain's last
//! rank to its first.

use super::schedule::{left, right};
use super::{frames, In, Land, Out, Plan};

/// The step number of the check frames sent first (data frames are step 0).
const CHECK_STEP: u32 = 1;
/// The first step number of the agreement barrier after the data (large worlds).
const AGREE_STEP: u32 = 2;
/// Worlds up to this size check every pair of ranks directly.
pub(crate) const FULL_CHECK_MAX: usize = 8;

/// The frames of a chain over `len` bytes in segments of `seg` bytes, from the side of
/// the rank at `pos` (0 starts, `n-1` ends). Everyone but the first receives each
/// segment from the left (landing as `land`), everyone but the last forwards it to the
/// right once it has arrived; the check frames are described in the module docs.
fn chain(rank: usize, n: usize, pos: usize, len: usize, seg: usize, land: Land) -> Plan {
    let mut plan = Plan::default();
    if n == 1 {
        return plan;
    }
    let full = n <= FULL_CHECK_MAX;
    // The rank at chain position `p`.
    let at = |p: usize| (rank + n + p - pos) % n;
    // Checks out: to the right unless the data goes there at once; to every rank before
    // this one (which includes the right neighbour when this rank is last).
    if pos > 0 && (pos < n - 1 || !full) {
        plan.outs.push(Out::check(right(rank, n), CHECK_STEP));
    }
    if full {
        plan.outs
            .extend((0..pos).map(|p| Out::check(at(p), CHECK_STEP)));
    }
    // The left neighbour's frame first: its check (it sends one unless it is first)...
    if pos != 1 {
        plan.ins.push(In::check(left(rank, n), CHECK_STEP));
    }
    let checks = plan.ins.len();
    for (i, (j, r)) in frames(len, seg).enumerate() {
        if pos > 0 {
            // ...or its data.
            plan.ins
                .push(In::segment(left(rank, n), j, r.clone(), land));
        }
        if pos < n - 1 {
            let after = (pos > 0).then_some(checks + i);
            plan.outs.push(Out::segment(right(rank, n), j, r, after));
        }
    }
    if full {
        // The checks of the ranks after this one, after the data (so forwarding never
        // waits for them); the last one, the left neighbour of the first, came first.
        let last = if pos == 0 { n - 1 } else { n };
        plan.ins
            .extend((pos + 1..last).map(|p| In::check(at(p), CHECK_STEP)));
    } else {
        agreement_barrier(rank, n, &mut plan);
    }
    plan
}

/// Appends the agreement barrier (after the data on every link) to `plan`.
fn agreement_barrier(rank: usize, n: usize, plan: &mut Plan) {
    let (outs0, ins0) = (plan.outs.len(), plan.ins.len());
    let barrier = super::doubling::plan(rank, n, 0);
    plan.outs.extend(barrier.outs.into_iter().map(|o| Out {
        step: AGREE_STEP + o.step,
        after_recv: o.after_recv.map(|i| ins0 + i),
        ..o
    }));
    plan.ins.extend(barrier.ins.into_iter().map(|i| In {
        step: AGREE_STEP + i.step,
        land: Land::Copy,
        after_send: i.after_send.map(|s| outs0 + s),
        ..i
    }));
}

/// `data` (the frames of a broadcast or reduce along another shape than the chain, at
/// steps other than the agreement's) with an agreement that vouches for every rank's
/// call. Its frames are the same whatever root a rank names, so they fit across a
/// disagreement; a rank that reads a frame of another call fails, and its partners
/// fail with it through its closed links.
///
/// - Up to [`FULL_CHECK_MAX`] ranks: an empty check frame from every rank to every
///   other, sent first, and read before any data. A rank that returns has read every
///   other rank's call; of any two ranks that disagree every rank sees one, since it
///   differs from at least one of them. The data need not wait: every link carries
///   its check before its data, and the checks depend on nothing, so nothing waits
///   for data a disagreeing rank will not send. One hop, alongside the data.
/// - Beyond: the chain's agreement barrier first (`log2 n` rounds), and no data leaves
///   a rank (every data send waits for the barrier's last frame) until all agree, so
///   data frames are never awaited from a rank that saw the call differently. With
///   the data first, two roots' trees can wait for each other.
pub(crate) fn with_agreement(rank: usize, n: usize, data: Plan) -> Plan {
    if n == 1 {
        return data;
    }
    let mut plan = Plan::default();
    let direct = n <= FULL_CHECK_MAX;
    if direct {
        for q in (0..n).filter(|&q| q != rank) {
            plan.outs.push(Out::check(q, AGREE_STEP));
            plan.ins.push(In::check(q, AGREE_STEP));
        }
    } else {
        agreement_barrier(rank, n, &mut plan);
    }
    let (outs0, ins0) = (plan.outs.len(), plan.ins.len());
    let agreed = if direct { None } else { ins0.checked_sub(1) };
    plan.outs.extend(data.outs.into_iter().map(|o| Out {
        after_recv: o.after_recv.map(|i| ins0 + i).or(agreed),
        ..o
    }));
    plan.ins.extend(data.ins.into_iter().map(|i| In {
        after_send: i.after_send.map(|s| outs0 + s),
        ..i
    }));
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
pub(crate) mod tests {
    use super::super::tests::{check_plans, run_views, simulate, End};
    use super::*;

    #[test]
    fn checks_leave_first_and_every_rank_hears_from_every_other() {
        for n in 2..=12 {
            for root in 0..n {
                for rank in 0..n {
                    let plans = [
                        (broadcast(rank, n, root, 64, 16), (rank + n - root) % n),
                        (reduce(rank, n, root, 64, 16), (rank + 2 * n - root - 1) % n),
                    ];
                    for (plan, pos) in plans {
                        // Checks go out before any data and depend on nothing.
                        let data_out = plan.outs.iter().position(|o| o.step == 0);
                        let last_check = plan.outs.iter().rposition(|o| o.step == CHECK_STEP);
                        if let (Some(d), Some(c)) = (data_out, last_check) {
                            assert!(c < d);
                        }
                        assert!(plan
                            .outs
                            .iter()
                            .filter(|o| o.step == CHECK_STEP)
                            .all(|o| o.after_recv.is_none() && o.len == 0));
                        // The first frame to the right neighbour depends on nothing,
                        // and the first frame read is the left neighbour's.
                        let first_right = plan.outs.iter().find(|o| o.peer == right(rank, n));
                        assert!(first_right.is_some_and(|o| o.after_recv.is_none()));
                        assert_eq!(plan.ins[0].peer, left(rank, n));
                        // Up to FULL_CHECK_MAX ranks, each rank hears directly from
                        // every rank after it in the chain, and from those before it
                        // through its left neighbour's data.
                        if n <= FULL_CHECK_MAX {
                            let mut heard: Vec<usize> = plan.ins.iter().map(|i| i.peer).collect();
                            heard.extend((0..pos).map(|p| (rank + n + p - pos) % n));
                            heard.sort_unstable();
                            heard.dedup();
                            assert_eq!(heard.len(), n - 1, "n={n} rank={rank}");
                        }
                    }
                }
            }
        }
    }

    /// Ranks that disagree on the root: for every assignment of roots in worlds of 2 to
    /// 5, and for random ones in worlds past [`FULL_CHECK_MAX`], no rank waits
    /// forever, some rank reports the mismatch, and no rank returns Ok.
    #[test]
    fn root_disagreements_fail_fast_on_every_rank() {
        each_root_assignment(&broadcast, &reduce);
    }

    /// A rooted plan: `(rank, n, root, len, seg)`.
    pub type Rooted = dyn Fn(usize, usize, usize, usize, usize) -> Plan;

    /// Runs `broadcast` and `reduce` plans of every assignment of roots in worlds of 2
    /// to 5, and random ones up to 16, through the executor's model: no rank waits
    /// forever, some rank reports a mismatch exactly when the roots differ, no rank
    /// returns Ok unless all agree, and an Ok rank holds the definition.
    pub fn each_root_assignment(broadcast: &Rooted, reduce: &Rooted) {
        let mut cases: Vec<Vec<usize>> = Vec::new();
        for n in 2..=5usize {
            for code in 0..n.pow(n as u32) {
                cases.push((0..n).map(|r| code / n.pow(r as u32) % n).collect());
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in [9usize, 12, 13, 16] {
            for _ in 0..200 {
                // Mostly one root, a few ranks naming another: the hard cases.
                let base = (x >> 7) as usize % n;
                let roots = (0..n)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        if (x >> 60) < 3 {
                            (x >> 20) as usize % n
                        } else {
                            base
                        }
                    })
                    .collect();
                cases.push(roots);
            }
            cases.push(vec![0; n]);
        }
        for roots in cases {
            let n = roots.len();
            {
                let agree = roots.iter().all(|&x| x == roots[0]);
                let bufs = || (0..n).map(|r| vec![r as f64 + 1.0; 4]).collect::<Vec<_>>();
                let b: Vec<Plan> = (0..n).map(|r| broadcast(r, n, roots[r], 32, 8)).collect();
                let ends = run_views(&b, &roots, bufs());
                for (r, e) in ends.iter().enumerate() {
                    if let End::Ok(v) = e {
                        assert_eq!(
                            v,
                            &vec![roots[r] as f64 + 1.0; 4],
                            "roots {roots:?} rank {r}"
                        );
                    }
                }
                let p: Vec<Plan> = (0..n).map(|r| reduce(r, n, roots[r], 32, 8)).collect();
                let rends = run_views(&p, &roots, bufs());
                let sum = (n * (n + 1) / 2) as f64;
                for (r, e) in rends.iter().enumerate() {
                    if let (End::Ok(v), true) = (e, roots[r] == r) {
                        assert_eq!(v, &vec![sum; 4], "roots {roots:?} rank {r}");
                    }
                }
                for ends in [&ends, &rends] {
                    let mismatches = ends.iter().filter(|e| **e == End::Mismatch).count();
                    assert_eq!(mismatches == 0, agree, "roots {roots:?}: {ends:?}");
                    // Every rank returns Ok when all agree, and none does otherwise.
                    let oks = ends.iter().filter(|e| matches!(e, End::Ok(_))).count();
                    assert_eq!(oks, if agree { n } else { 0 }, "roots {roots:?}: {ends:?}");
                }
            }
        }
    }

    #[test]
    fn broadcast_and_reduce_compute_their_definition() {
        for n in 1..=9 {
            for root in 0..n {
                check_rooted(&broadcast, &reduce, n, root);
            }
        }
    }

    /// `broadcast` and `reduce` plans of every rank from `root`, over a few lengths and
    /// segments: they fit, compute their definition, only the root's receives of data
    /// are final, every rank but the root sends the buffer once in a reduce and
    /// receives it once in a broadcast.
    pub fn check_rooted(broadcast: &Rooted, reduce: &Rooted, n: usize, root: usize) {
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
            for (r, plan) in p.iter().enumerate() {
                let data = plan.ins.iter().filter(|i| i.len > 0);
                assert!(data.clone().all(|i| i.is_final() == (r == root)));
                let once = if r == root { 0 } else { len };
                assert_eq!(plan.send_bytes(), once, "n={n} root={root} rank {r}");
                let got: usize = b[r].ins.iter().map(|i| i.len).sum();
                assert_eq!(got, once, "n={n} root={root} rank {r}");
            }
        }
    }
}
