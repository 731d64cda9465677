//! Ring reduce-scatter, all-gather and all-reduce: one schedule, one plan.
//!
//! The schedule comes from [`super::schedule`]: `2(n-1)` steps, at step `t` send chunk
//! `r-t-1` right and receive chunk `r-t-2` from the left, reducing for `t < n-1` and
//! copying after. Reduce-scatter runs steps `0..n-1`, all-gather `n-1..2(n-1)`,
//! all-reduce all of them. Chunks are cut into segments and streamed: a segment leaves
//! as soon as the same segment of the previous step has arrived (and been reduced), so
//! receiving segment `j+1` overlaps reducing segment `j` and sending it on, and both
//! directions of the ring move at once. In NCCL's vocabulary the sends are `send`
//! (first step), `recvReduceSend`, `recvReduceCopySend` (the owner's last reduction),
//! `recvCopySend` and finally `recv` — here they are one rule.

use super::schedule::{self, Transfer};
use super::{In, Land, Out, Plan};
use std::ops::Range;

/// Steps `steps` of the ring for `rank` of `n`, over a buffer of elements of `esize`
/// bytes cut into `chunks` (element ranges, one per rank), each chunk in segments of at
/// most `seg_elems` elements.
pub(crate) fn plan(
    rank: usize,
    n: usize,
    chunks: &[Range<usize>],
    esize: usize,
    steps: Range<usize>,
    seg_elems: usize,
) -> Plan {
    if n == 1 || steps.is_empty() {
        return Plan::default();
    }
    debug_assert_eq!(chunks.len(), n);
    let (left, right) = (schedule::left(rank, n), schedule::right(rank, n));
    let sends = schedule::ring_plan(chunks, rank, steps.clone(), seg_elems, true);
    let recvs = schedule::ring_plan(chunks, rank, steps.clone(), seg_elems, false);
    let first_of_step = |plan: &[Transfer]| {
        let mut v = vec![usize::MAX; steps.len()];
        for (i, f) in plan.iter().enumerate().rev() {
            v[f.step - steps.start] = i;
        }
        v
    };
    let send_start = first_of_step(&sends);
    let recv_start = first_of_step(&recvs);
    let last_rs = n - 2; // the step that completes this rank's chunk

    let outs = sends
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
    let ins = recvs
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
                off: f.elems.start * esize,
                len: f.elems.len() * esize,
                land: if gather {
                    Land::Copy
                } else {
                    Land::Reduce {
                        theirs_first: false,
                        finish: f.step == last_rs,
                    }
                },
                after_send: overwrites,
            }
        })
        .collect();
    Plan {
        outs,
        ins,
        lanes: None,
        counts: None,
    }
}

/// The all-reduce of `count` elements: every step, balanced chunks.
pub(crate) fn all_reduce(
    rank: usize,
    n: usize,
    count: usize,
    esize: usize,
    seg_elems: usize,
) -> Plan {
    let chunks = schedule::balanced_chunks(count, n);
    plan(
        rank,
        n,
        &chunks,
        esize,
        0..schedule::allreduce_steps(n),
        seg_elems,
    )
}

/// Reduce-scatter over `chunks`: steps `0..n-1`; rank `r` ends with chunk `r` reduced.
pub(crate) fn reduce_scatter(
    rank: usize,
    n: usize,
    chunks: &[Range<usize>],
    esize: usize,
    seg_elems: usize,
) -> Plan {
    plan(rank, n, chunks, esize, 0..n.saturating_sub(1), seg_elems)
}

/// All-gather over `chunks`: steps `n-1..2(n-1)`, starting from chunk `r` on rank `r`.
pub(crate) fn all_gather(
    rank: usize,
    n: usize,
    chunks: &[Range<usize>],
    esize: usize,
    seg_elems: usize,
) -> Plan {
    let steps = n.saturating_sub(1)..schedule::allreduce_steps(n);
    plan(rank, n, chunks, esize, steps, seg_elems)
}

/// Elements per segment for the ring over `chunks` with segments of at most
/// `max_bytes` (see [`schedule::pipeline_segment`]).
pub(crate) fn seg_elems(chunks: &[Range<usize>], esize: usize, max_bytes: usize) -> usize {
    let max_chunk = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
    schedule::pipeline_segment(max_chunk, esize, max_bytes)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_plans, simulate};
    use super::*;
    use proptest::prelude::*;

    fn inputs(n: usize, count: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|r| (0..count).map(|i| (r * 1000 + i) as f64).collect())
            .collect()
    }

    proptest! {
        #[test]
        fn all_reduce_plans_fit_and_sum(n in 1usize..9, count in 0usize..200, seg in 1usize..40) {
            let plans: Vec<Plan> = (0..n).map(|r| all_reduce(r, n, count, 8, seg)).collect();
            check_plans(&plans);
            let out = simulate(&plans, inputs(n, count));
            for (r, b) in out.iter().enumerate() {
                for (i, x) in b.iter().enumerate() {
                    let want: f64 = (0..n).map(|q| (q * 1000 + i) as f64).sum();
                    prop_assert_eq!(*x, want, "rank {} element {}", r, i);
                }
            }
        }

        #[test]
        fn halves_compute_their_part(n in 1usize..9, per in 0usize..30, seg in 1usize..9) {
            let chunks = schedule::chunks_from_counts(&vec![per; n]);
            let rs: Vec<Plan> = (0..n).map(|r| reduce_scatter(r, n, &chunks, 8, seg)).collect();
            check_plans(&rs);
            let out = simulate(&rs, inputs(n, n * per));
            for (r, b) in out.iter().enumerate() {
                for i in chunks[r].clone() {
                    let want: f64 = (0..n).map(|q| (q * 1000 + i) as f64).sum();
                    prop_assert_eq!(b[i], want);
                }
            }
            let ag: Vec<Plan> = (0..n).map(|r| all_gather(r, n, &chunks, 8, seg)).collect();
            check_plans(&ag);
            let mine: Vec<Vec<f64>> = (0..n)
                .map(|r| (0..n * per).map(|i| if chunks[r].contains(&i) { i as f64 } else { -1.0 }).collect())
                .collect();
            for b in simulate(&ag, mine) {
                prop_assert_eq!(b, (0..n * per).map(|i| i as f64).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn plans_send_the_ring_law() {
        // Counted on the plans: each rank sends 2(n-1)/n of the buffer (to one element
        // per chunk), the same bytes the schedule's law predicts.
        for n in 1..9 {
            for count in [0, 1, 7, 100, 1000] {
                for r in 0..n {
                    let p = all_reduce(r, n, count, 4, 13);
                    assert_eq!(
                        p.send_bytes(),
                        4 * schedule::allreduce_send_elems(count, n, r)
                    );
                }
            }
        }
    }

    #[test]
    fn every_byte_of_the_result_is_final_once() {
        // The pull executor writes results out when an in is final: for the all-reduce,
        // every chunk must be made final exactly once on every rank.
        for n in 2..7 {
            for r in 0..n {
                let p = all_reduce(r, n, 100, 4, 7);
                let mut covered = vec![0u32; 400];
                for i in p.ins.iter().filter(|i| i.is_final()) {
                    for b in i.range() {
                        covered[b] += 1;
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "n={n} r={r}");
            }
        }
    }
}
