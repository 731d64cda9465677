//! Direct exchanges: all-to-all(v), gather(v) and scatter(v), where every pair of ranks
//! moves its own block, once, with no rank in between.
//!
//! The buffer of these plans is the call's input followed by its output (`[input |
//! output]`, offsets in bytes): sends read the input, receives land in the output, so
//! no frame ever waits for another on this rank. A rank's block to or from itself is
//! the caller's local copy, not a frame. Every pair that exchanges anything exchanges
//! at least one frame, empty for an empty block, and each frame's header carries its
//! pair's element count ([`PairCounts`]): two ranks that disagree on what they
//! exchange fail on the first frame between them, never with part of a block.
//!
//! # All-to-all: pairwise exchange
//!
//! In step `k` (`1..n`) rank `r` sends its block for `r + k` and receives the block of
//! `r - k` (mod `n`), in segments. Every step is a permutation: each rank sends to one
//! rank and receives from one, so every link carries one stream in each direction and
//! no rank is the target of two senders at once; the push executor moves a rank's
//! sends and receives together, so step `k + 1`'s send starts while step `k`'s
//! receive lands. `n - 1` steps of `S/n` each: `(n-1)/n·S` bytes out of every rank,
//! the least an all-to-all can move.
//!
//! With per-peer counts (all-to-allv) a rank hears only from its own pairs whether
//! they agree, so the plan ends with an empty frame from every rank to every other,
//! sent once all its receives are in (`agree`): a rank returns Ok only once every rank
//! has had everything it expected, and a pair that disagrees fails every rank in the
//! call (the pair's receiver on the header, everyone else waiting for its last frame,
//! through its notice). Equal blocks need none: every pair's first frame carries the
//! count both ranks called with, so a rank whose call differs from anyone's is seen by
//! everyone it exchanges with, which is everyone.
//!
//! What the others do: NCCL posts all `n - 1` sends and receives of every rank at once
//! inside one group call and lets its channels progress them (its all-to-all is
//! grouped point-to-point); MPICH and Open MPI's tuned component use Bruck's algorithm
//! for small blocks (`log2 n` rounds, each block forwarded up to `log2 n` times),
//! posted nonblocking send/receive pairs for medium ones and this pairwise exchange
//! for large ones. On the transports here a frame to a peer is a copy into that link
//! (a shared-memory ring or a socket) and every rank has one thread: all-at-once
//! would have each rank push into `n - 1` links and every receiver drain `n - 1` at
//! once, in whatever order its links fill, and the engine's in-order receive lists
//! would wait on whichever is slowest; the pairwise order keeps exactly one stream per
//! link direction busy, which is what the link-bound cases need. Bruck trades bytes
//! for fewer rounds and pays off only where a message costs much more than its bytes
//! (tiny blocks on many ranks); it is not implemented.
//!
//! # Gather and scatter: a star, with the root agreement
//!
//! Gather: every rank but the root sends its block to the root; the root receives them
//! interleaved by segment (rank `root + 1`'s first segment, `root + 2`'s, ..., then
//! the second segments), so that every sender moves at once. Scatter is the mirror.
//! The root's link carries `(n-1)/n·S` either way, the least possible. A rank must not
//! return Ok unless every rank named the same root (a rank that names another would
//! send its block to a rank that does not wait for it, and return): the frames go
//! through [`super::chain::with_agreement`], as the tree's broadcast and reduce do —
//! up to 8 ranks an empty check frame from every rank to every other, read before any
//! data; beyond, a recursive-doubling barrier before the data.

use super::chain::with_agreement;
use super::{frames, In, Land, Out, PairCounts, Plan};
use std::ops::Range;

/// A block: where it is in the plan's buffer (bytes), and its element count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub bytes: Range<usize>,
    pub count: usize,
}

/// The step of the frames that end an all-to-allv (data frames are steps `1..n`).
const DONE_STEP: u32 = u32::MAX - 1;

/// The all-to-all plan of `rank` of `n`: `send[q]` is its block for rank `q` (in the
/// input part of the buffer), `recv[q]` where rank `q`'s block for it lands (in the
/// output part), both indexed by rank; segments of at most `seg` bytes. `agree`: end
/// with the frames that vouch for every pair (the module docs).
pub(crate) fn all_to_all(
    rank: usize,
    n: usize,
    send: &[Block],
    recv: &[Block],
    seg: usize,
    agree: bool,
) -> Plan {
    let mut plan = Plan::default();
    if n <= 1 {
        return plan;
    }
    debug_assert!(send.len() == n && recv.len() == n);
    for k in 1..n {
        let (to, from) = ((rank + k) % n, (rank + n - k) % n);
        let step = k as u32;
        let (s, r) = (&send[to], &recv[from]);
        plan.outs
            .extend(frames(s.bytes.len(), seg).map(|(j, b)| Out {
                step,
                ..Out::segment(to, j, shift(b, s.bytes.start), None)
            }));
        plan.ins.extend(frames(r.bytes.len(), seg).map(|(j, b)| In {
            step,
            ..In::segment(from, j, shift(b, r.bytes.start), Land::Copy)
        }));
    }
    if agree {
        let last = plan.ins.len().checked_sub(1);
        for k in 1..n {
            let (to, from) = ((rank + k) % n, (rank + n - k) % n);
            plan.outs.push(Out {
                after_recv: last,
                ..Out::check(to, DONE_STEP)
            });
            plan.ins.push(In::check(from, DONE_STEP));
        }
    }
    plan.counts = Some(Box::new(PairCounts {
        send: send.iter().map(|b| b.count as u64).collect(),
        recv: recv.iter().map(|b| b.count as u64).collect(),
    }));
    plan
}

/// The gather plan of `rank` of `n` to `root`: a rank other than the root sends
/// `mine` (its block, in the input part); the root receives rank `q`'s block into
/// `slots[q]` (in the output part; `slots` is read at the root only).
pub(crate) fn gather(
    rank: usize,
    n: usize,
    root: usize,
    mine: &Block,
    slots: &[Block],
    seg: usize,
) -> Plan {
    star(rank, n, root, mine, slots, seg, true)
}

/// The scatter plan of `rank` of `n` from `root`: the root sends `slots[q]` (in the
/// input part; read at the root only) to rank `q`; every other rank receives its
/// block into `mine` (in the output part).
pub(crate) fn scatter(
    rank: usize,
    n: usize,
    root: usize,
    mine: &Block,
    slots: &[Block],
    seg: usize,
) -> Plan {
    star(rank, n, root, mine, slots, seg, false)
}

/// Gather (`inward`) or scatter: the root's side moves `slots` (every rank's block
/// but its own), the others' their one block `mine`; with the root agreement.
fn star(
    rank: usize,
    n: usize,
    root: usize,
    mine: &Block,
    slots: &[Block],
    seg: usize,
    inward: bool,
) -> Plan {
    let mut data = Plan::default();
    if n <= 1 {
        return data;
    }
    let mut counts = PairCounts {
        send: vec![0; n],
        recv: vec![0; n],
    };
    // What the root moves per peer, and what every other rank moves with the root.
    let (root_side, other_side) = if inward {
        (&mut counts.recv, &mut counts.send)
    } else {
        (&mut counts.send, &mut counts.recv)
    };
    if rank == root {
        debug_assert_eq!(slots.len(), n);
        *root_side = slots.iter().map(|b| b.count as u64).collect();
        root_side[root] = 0;
        if inward {
            data.ins = interleaved(root, n, slots, seg, |q, j, b| {
                In::segment(q, j, b, Land::Copy)
            });
        } else {
            data.outs = interleaved(root, n, slots, seg, |q, j, b| Out::segment(q, j, b, None));
        }
    } else {
        other_side[root] = mine.count as u64;
        let frames = frames(mine.bytes.len(), seg).map(|(j, b)| (j, shift(b, mine.bytes.start)));
        if inward {
            data.outs = frames
                .map(|(j, b)| Out::segment(root, j, b, None))
                .collect();
        } else {
            data.ins = frames
                .map(|(j, b)| In::segment(root, j, b, Land::Copy))
                .collect();
        }
    }
    let mut plan = with_agreement(rank, n, data);
    plan.counts = Some(Box::new(counts));
    plan
}

/// The frames of every rank's slot but the root's, interleaved by segment (all first
/// segments in rank order from the root's right, then all second ones...), made by
/// `frame(peer, segment, bytes)`.
fn interleaved<F>(
    root: usize,
    n: usize,
    slots: &[Block],
    seg: usize,
    frame: impl Fn(usize, u32, Range<usize>) -> F,
) -> Vec<F> {
    let per: Vec<Vec<(u32, Range<usize>)>> = (0..n)
        .map(|q| {
            if q == root {
                Vec::new()
            } else {
                frames(slots[q].bytes.len(), seg)
                    .map(|(j, b)| (j, shift(b, slots[q].bytes.start)))
                    .collect()
            }
        })
        .collect();
    let most = per.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = Vec::new();
    for j in 0..most {
        for k in 1..n {
            let q = (root + k) % n;
            if let Some((s, b)) = per[q].get(j) {
                out.push(frame(q, *s, b.clone()));
            }
        }
    }
    out
}

fn shift(r: Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_hazards, check_plans, run_views, End};
    use super::*;

    /// Equal blocks of `count` f64 each: the send blocks in the input (`n·count`
    /// elements) and the receive blocks in the output that follows it.
    fn equal(n: usize, count: usize) -> (Vec<Block>, Vec<Block>) {
        let b = |base: usize, q: usize| Block {
            bytes: base + q * count * 8..base + (q + 1) * count * 8,
            count,
        };
        (
            (0..n).map(|q| b(0, q)).collect(),
            (0..n).map(|q| b(n * count * 8, q)).collect(),
        )
    }

    /// Runs `plans` with the simulator on buffers `[input | output]` of f64 where rank
    /// `r`'s input element `i` is `1000r + i`, the output NaN; returns the outputs.
    fn run(plans: &[Plan], in_len: usize, out_len: usize) -> Vec<Vec<f64>> {
        let bufs = (0..plans.len())
            .map(|r| {
                (0..in_len)
                    .map(|i| (1000 * r + i) as f64)
                    .chain(std::iter::repeat_n(f64::NAN, out_len))
                    .collect()
            })
            .collect();
        let views = vec![0; plans.len()];
        run_views(plans, &views, bufs)
            .into_iter()
            .map(|e| match e {
                End::Ok(b) => b[in_len..].to_vec(),
                e => panic!("{e:?}"),
            })
            .collect()
    }

    #[test]
    fn all_to_all_moves_every_block_to_its_rank_once() {
        for n in 1..=9 {
            for count in [0usize, 1, 3, 70] {
                for seg in [8usize, 24, 1 << 20] {
                    let (send, recv) = equal(n, count);
                    let plans: Vec<Plan> = (0..n)
                        .map(|r| all_to_all(r, n, &send, &recv, seg, seg == 24))
                        .collect();
                    check_plans(&plans);
                    for (r, p) in plans.iter().enumerate() {
                        check_hazards(p, &format!("n={n} rank {r}"));
                        // (n-1)/n of the buffer out of every rank, nothing else.
                        assert_eq!(p.send_bytes(), (n - 1) * count * 8);
                    }
                    let out = run(&plans, n * count, n * count);
                    for (r, o) in out.iter().enumerate() {
                        for q in (0..n).filter(|&q| q != r) {
                            let want: Vec<f64> = (0..count)
                                .map(|i| (1000 * q + r * count + i) as f64)
                                .collect();
                            assert_eq!(o[q * count..(q + 1) * count], want, "n={n} {r}<-{q}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_step_of_all_to_all_is_a_permutation() {
        let n = 7;
        let (send, recv) = equal(n, 2);
        let plans: Vec<Plan> = (0..n)
            .map(|r| all_to_all(r, n, &send, &recv, 16, false))
            .collect();
        for k in 1..n as u32 {
            let mut targets: Vec<usize> = plans
                .iter()
                .map(|p| p.outs.iter().find(|o| o.step == k).unwrap().peer)
                .collect();
            targets.sort_unstable();
            assert_eq!(targets, (0..n).collect::<Vec<_>>(), "step {k}");
        }
    }

    #[test]
    fn uneven_blocks_and_counts_reach_their_rank() {
        // Rank r sends (r + q) % 3 elements to q, at scattered displacements.
        let n = 5;
        let c = |from: usize, to: usize| (from + to) % 3;
        let plans: Vec<Plan> = (0..n)
            .map(|r| {
                let mut at = 0;
                let send: Vec<Block> = (0..n)
                    .map(|q| {
                        let b = Block {
                            bytes: at * 8..(at + c(r, q)) * 8,
                            count: c(r, q),
                        };
                        at += c(r, q) + 1;
                        b
                    })
                    .collect();
                let base = 64 * 8;
                let mut at = 0;
                let recv: Vec<Block> = (0..n)
                    .map(|q| {
                        let b = Block {
                            bytes: base + at * 8..base + (at + c(q, r)) * 8,
                            count: c(q, r),
                        };
                        at += c(q, r);
                        b
                    })
                    .collect();
                all_to_all(r, n, &send, &recv, 8, true)
            })
            .collect();
        check_plans(&plans);
        let out = run(&plans, 64, 64);
        for r in 0..n {
            for q in (0..n).filter(|&q| q != r) {
                let i = plans[r].ins.iter().find(|i| i.peer == q).unwrap();
                let got = &out[r][(i.off - 64 * 8) / 8..];
                let sent = plans[q].outs.iter().find(|o| o.peer == r).unwrap();
                for (e, v) in got.iter().take(c(q, r)).enumerate() {
                    assert_eq!(*v, (1000 * q + sent.off / 8 + e) as f64);
                }
            }
        }
    }

    #[test]
    fn gather_and_scatter_reach_the_root_and_back_from_any_root() {
        for n in 1..=10 {
            for root in 0..n {
                let count = 5;
                let (blocks, _) = equal(n, count);
                let mine = |_r: usize| Block {
                    bytes: 0..count * 8,
                    count,
                };
                // Gather: input = this rank's block, output = n blocks at the root.
                let out_base = count * 8;
                let slots_g: Vec<Block> = (0..n)
                    .map(|q| Block {
                        bytes: out_base + q * count * 8..out_base + (q + 1) * count * 8,
                        count,
                    })
                    .collect();
                let plans: Vec<Plan> = (0..n)
                    .map(|r| gather(r, n, root, &mine(r), &slots_g, 16))
                    .collect();
                check_plans(&plans);
                let out = run(&plans, count, n * count);
                for q in (0..n).filter(|&q| q != root) {
                    let want: Vec<f64> = (0..count).map(|i| (1000 * q + i) as f64).collect();
                    assert_eq!(
                        out[root][q * count..(q + 1) * count],
                        want,
                        "n={n} root {root}"
                    );
                }
                // Scatter: input = n blocks at the root, output = this rank's block.
                let mine_s = |_r: usize| Block {
                    bytes: n * count * 8..(n + 1) * count * 8,
                    count,
                };
                let plans: Vec<Plan> = (0..n)
                    .map(|r| scatter(r, n, root, &mine_s(r), &blocks, 16))
                    .collect();
                check_plans(&plans);
                let out = run(&plans, n * count, count);
                for q in (0..n).filter(|&q| q != root) {
                    let want: Vec<f64> = (0..count)
                        .map(|i| (1000 * root + q * count + i) as f64)
                        .collect();
                    assert_eq!(out[q], want, "n={n} root {root} to {q}");
                }
            }
        }
    }

    /// Ranks that name different roots never return Ok and never wait forever: every
    /// assignment of roots over 4 ranks, and random ones over 12.
    #[test]
    fn rooted_disagreements_fail_everywhere_without_a_hang() {
        let count = 3;
        let check = |roots: &[usize]| {
            let n = roots.len();
            let (blocks, _) = equal(n, count);
            for scatter_it in [false, true] {
                let plans: Vec<Plan> = (0..n)
                    .map(|r| {
                        let mine = Block {
                            bytes: 0..count * 8,
                            count,
                        };
                        if scatter_it {
                            scatter(r, n, roots[r], &mine, &blocks, 8)
                        } else {
                            gather(r, n, roots[r], &mine, &blocks, 8)
                        }
                    })
                    .collect();
                let bufs = vec![vec![0.0; n * count + count]; n];
                let ends = run_views(&plans, roots, bufs);
                let agree = roots.iter().all(|&x| x == roots[0]);
                for (r, e) in ends.iter().enumerate() {
                    assert_eq!(
                        matches!(e, End::Ok(_)),
                        agree,
                        "roots {roots:?} rank {r}: {e:?}"
                    );
                }
            }
        };
        for a in 0..4 {
            for b in 0..4 {
                for c in 0..4 {
                    for d in 0..4 {
                        check(&[a, b, c, d]);
                    }
                }
            }
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..40 {
            let roots: Vec<usize> = (0..12)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 3) as usize
                })
                .collect();
            check(&roots);
        }
    }

    #[test]
    fn frames_carry_their_pairs_counts() {
        let (send, recv) = equal(3, 4);
        let p = all_to_all(1, 3, &send, &recv, 8, false);
        let c = p.counts.expect("pair counts");
        assert_eq!((c.send, c.recv), (vec![4, 4, 4], vec![4, 4, 4]));
        let mine = Block {
            bytes: 0..16,
            count: 2,
        };
        let g = gather(2, 3, 0, &mine, &send, 8).counts.expect("counts");
        assert_eq!((g.send, g.recv), (vec![2, 0, 0], vec![0, 0, 0]));
    }
}
