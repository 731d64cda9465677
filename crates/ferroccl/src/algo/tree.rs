//! The pipelined double binary tree all-reduce (NCCL's "tree" algorithm).
//!
//! Two binary trees span the ranks, and each carries half of the buffer: the half is
//! cut into segments, each segment is reduced up its tree to the tree's root (every
//! node combines its children's partial results with its own and passes the sum to
//! its parent) and broadcast back down, segment after segment, so that the reduction
//! of segment `j+1` overlaps the broadcast of segment `j`. A rank reaches any other in
//! `O(log n)` hops, so the latency is about `2·log2(n)` steps of a segment (the ring:
//! `2(n-1)`), for any `n`, not only powers of two.
//!
//! # The trees
//!
//! Tree 0 is an in-order binary tree over positions `0..n`: position `p > 0` with
//! lowest set bit `b` has the parent `(p ^ b) | 2b`, or `p ^ b` when that is past the
//! end; position 0 is the root. Children have lower set bits than their parents, so
//! odd positions are leaves, a path up has at most `log2(n) + 1` hops, and a node has
//! at most two children (the tests check it up to 4100 ranks). Rank `r` sits at
//! position `r` in tree 0. Tree 1 is the same tree over other positions: mirrored
//! (`n-1-r`) when `n` is even, so that the even ranks, interior in tree 0, are the
//! leaves of tree 1 and the odd ones its interior; shifted by one (`r-1`) when `n` is
//! odd (then rank 0 is interior in both). This is NCCL's double binary tree.
//!
//! # Bytes
//!
//! A rank sends a tree's half once to its parent and once to each child, and receives
//! the same: per rank, `Σ_t (children_t + [has a parent in t]) · |half_t|`, so in an
//! even world an interior rank with two children sends `3/2·S + 1/2·S = 2S` and the
//! two roots `S`. Over all ranks that is `2(n-1)·S`, the ring's total; the ring spreads
//! it evenly (`2(n-1)/n·S` a rank), the tree does not, which costs it at most
//! `S/n` more per port than the ring, and saves it `2(n-1) - 2·log2(n)` latencies.
//!
//! # Bitwise agreement, Avg
//!
//! Each element is combined in one fixed order, the tree's, and only the root of its
//! tree holds the full result: it finishes it (Avg divides there, once) and every
//! other rank copies the root's bytes on the way down, so every rank ends with the
//! same bits.
//!
//! # Order of the frames
//!
//! Executors take each list in order, so the order is the schedule. Every frame gets
//! a virtual time, in units of half a hop: a node whose position has `h` trailing
//! zeros sends segment `j` up at `j + 2h` (its children, with fewer trailing zeros,
//! sent theirs at least two units before), a node at depth `d` receives and forwards
//! segment `j` down at `j + 2(B + d)`, with `B` the bit length of `n` (more than any
//! child of the root has trailing zeros). A frame arrives two units after it leaves
//! (one unit made the tree wait on every round trip when the latency is several
//! segments' port time: up to 1.5× slower in the simulator; more than two gains
//! little and delays the broadcast). Each rank's outs and ins are sorted by time
//! (then step, segment, peer, the same on both ends of a link). Every frame depends
//! only on frames of earlier or equal times that arrive strictly later than they
//! left, so the plans never deadlock, and both trees' segments interleave at each
//! rank in the order they become ready.

//!
//! # Broadcast and reduce
//!
//! [`broadcast`] and [`reduce`] run down (up) one binary tree of the same shape, its
//! positions counted from the root, pipelined in segments: `log2 n` hops of a segment
//! instead of the chain's `n - 1`, every rank but the root receiving (sending) the
//! buffer once, an interior rank sending it to two children. Their root agreement
//! is [`super::chain::with_agreement`]'s: up to 8 ranks direct checks alongside the
//! data, beyond a barrier before it.

use super::schedule::{chunk_range, segment_range, segments};
use super::{In, Land, Out, Plan};
use std::collections::HashMap;

/// The parent of position `p > 0` in the binary tree over positions `0..n`.
fn parent_pos(p: usize, n: usize) -> usize {
    let b = 1usize << p.trailing_zeros();
    let up = (p ^ b) | (b << 1);
    if up < n {
        up
    } else {
        p ^ b
    }
}

/// The children of position `p` in the tree over `0..n`, ascending (at most two).
fn children_pos(p: usize, n: usize) -> Vec<usize> {
    // A child has a lower set bit than `p`: it is `p ± 2^k` with 2^k below p's.
    let limit = if p == 0 {
        n.next_power_of_two()
    } else {
        1 << p.trailing_zeros()
    };
    let mut v = Vec::new();
    let mut k = 1;
    while k < limit {
        for c in [p.wrapping_sub(k), p + k] {
            if c != 0 && c < n && parent_pos(c, n) == p && !v.contains(&c) {
                v.push(c);
            }
        }
        k <<= 1;
    }
    v.sort_unstable();
    v
}

/// Where rank `rank` sits in tree `t` of `n` ranks, and back.
fn pos_of(t: usize, rank: usize, n: usize) -> usize {
    match t {
        0 => rank,
        _ if n.is_multiple_of(2) => n - 1 - rank,
        _ => (rank + n - 1) % n,
    }
}

fn rank_at(t: usize, pos: usize, n: usize) -> usize {
    match t {
        0 => pos,
        _ if n.is_multiple_of(2) => n - 1 - pos,
        _ => (pos + 1) % n,
    }
}

/// One rank's place in tree `t`: its parent's rank and its children's ranks with the
/// trailing zeros of their positions (their virtual send times).
pub(crate) struct Place {
    pub parent: Option<usize>,
    pub children: Vec<(usize, u32)>,
    /// Trailing zeros of this rank's position (0 for the root: it never sends up).
    pub height: u32,
    /// Hops to the root.
    pub depth: u32,
}

/// Rank `rank`'s place in tree `t` (0 or 1) over `n` ranks.
pub(crate) fn place(t: usize, rank: usize, n: usize) -> Place {
    let p = pos_of(t, rank, n);
    let mut depth = 0;
    let mut q = p;
    while q != 0 {
        q = parent_pos(q, n);
        depth += 1;
    }
    Place {
        parent: (p != 0).then(|| rank_at(t, parent_pos(p, n), n)),
        children: children_pos(p, n)
            .into_iter()
            .map(|c| (rank_at(t, c, n), c.trailing_zeros()))
            .collect(),
        height: if p == 0 { 0 } else { p.trailing_zeros() },
        depth,
    }
}

/// A frame identified by (step, segment, peer): unique within one rank's list.
type Id = (u32, u32, usize);

/// The plan of `rank` in a double-binary-tree all-reduce of `count` elements of
/// `esize` bytes over `n` ranks, in frames of at most `seg_elems` elements.
pub(crate) fn plan(rank: usize, n: usize, count: usize, esize: usize, seg_elems: usize) -> Plan {
    if n == 1 {
        return Plan::default();
    }
    // Units per hop (see the module docs).
    let lam: u64 = 2;
    let b = u64::from(usize::BITS - n.leading_zeros());
    // (time, id) -> frame, with its dependency by id in the other list.
    let mut outs: Vec<(u64, Id, Out, Option<Id>)> = Vec::new();
    let mut ins: Vec<(u64, Id, In, Option<Id>)> = Vec::new();
    for t in 0..2usize {
        let half = chunk_range(count, 2, t);
        let me = place(t, rank, n);
        let (up, down) = (2 * t as u32, 2 * t as u32 + 1);
        let root = me.parent.is_none();
        // The child whose segment arrives last at the root (time, then peer order).
        let last_child = me
            .children
            .iter()
            .max_by_key(|&&(c, h)| (h, c))
            .map(|x| x.0);
        for j in 0..segments(half.len(), seg_elems) {
            let e = segment_range(&half, seg_elems, j);
            let (off, len) = (e.start * esize, e.len() * esize);
            let j64 = j as u64;
            let seg = j as u32;
            let mut reduced: Option<(u64, Id)> = None;
            for &(c, h) in &me.children {
                let time = j64 + lam * (u64::from(h) + 1);
                let id = (up, seg, c);
                ins.push((
                    time,
                    id,
                    In {
                        peer: c,
                        step: up,
                        seg,
                        off,
                        len,
                        land: Land::Reduce {
                            theirs_first: c < rank,
                            finish: root && Some(c) == last_child,
                        },
                        after_send: None,
                    },
                    None,
                ));
                reduced = reduced.max(Some((time, id)));
            }
            let last_reduce = reduced.map(|x| x.1);
            let down_time = j64 + lam * (b + u64::from(me.depth));
            let mut forward = last_reduce;
            if let Some(p) = me.parent {
                let sent = (up, seg, p);
                outs.push((
                    j64 + lam * u64::from(me.height),
                    sent,
                    Out {
                        peer: p,
                        step: up,
                        seg,
                        off,
                        len,
                        after_recv: None,
                    },
                    last_reduce,
                ));
                // The result overwrites what went up: only once it has left.
                let id = (down, seg, p);
                ins.push((
                    down_time,
                    id,
                    In {
                        peer: p,
                        step: down,
                        seg,
                        off,
                        len,
                        land: Land::Copy,
                        after_send: None,
                    },
                    Some(sent),
                ));
                forward = Some(id);
            }
            for &(c, _) in &me.children {
                outs.push((
                    down_time,
                    (down, seg, c),
                    Out {
                        peer: c,
                        step: down,
                        seg,
                        off,
                        len,
                        after_recv: None,
                    },
                    forward,
                ));
            }
        }
    }
    outs.sort_unstable_by_key(|x| (x.0, x.1));
    ins.sort_unstable_by_key(|x| (x.0, x.1));
    let out_at: HashMap<Id, usize> = outs.iter().enumerate().map(|(i, x)| (x.1, i)).collect();
    let in_at: HashMap<Id, usize> = ins.iter().enumerate().map(|(i, x)| (x.1, i)).collect();
    Plan {
        outs: outs
            .into_iter()
            .map(|(_, _, o, dep)| Out {
                after_recv: dep.map(|d| in_at[&d]),
                ..o
            })
            .collect(),
        ins: ins
            .into_iter()
            .map(|(_, _, i, dep)| In {
                after_send: dep.map(|d| out_at[&d]),
                ..i
            })
            .collect(),
        lanes: None,
        counts: None,
    }
}

/// Broadcast of `len` bytes from `root` down one binary tree (tree 0's shape, positions
/// counted from the root), pipelined in segments of `seg` bytes, with the root
/// agreement of [`super::chain::with_agreement`].
pub(crate) fn broadcast(rank: usize, n: usize, root: usize, len: usize, seg: usize) -> Plan {
    super::chain::with_agreement(rank, n, rooted(rank, n, root, len, seg, false))
}

/// Reduce of `len` bytes up one binary tree into `root` (the shape of [`broadcast`]),
/// in place; on the other ranks the buffer holds a partial result afterwards.
pub(crate) fn reduce(rank: usize, n: usize, root: usize, len: usize, seg: usize) -> Plan {
    super::chain::with_agreement(rank, n, rooted(rank, n, root, len, seg, true))
}

/// The data frames of a rooted tree collective: each segment from the parent to the
/// children (broadcast), or from the children, combined, to the parent (reduce).
fn rooted(rank: usize, n: usize, root: usize, len: usize, seg: usize, up: bool) -> Plan {
    let mut plan = Plan::default();
    if n == 1 {
        return plan;
    }
    let pos = (rank + n - root) % n;
    let at = |p: usize| (p + root) % n;
    let parent = (pos != 0).then(|| at(parent_pos(pos, n)));
    let children: Vec<usize> = children_pos(pos, n).into_iter().map(at).collect();
    for (j, r) in super::frames(len, seg) {
        let frame_in = |peer: usize, land: Land| In::segment(peer, j, r.clone(), land);
        let frame_out = |peer: usize, after: Option<usize>| Out::segment(peer, j, r.clone(), after);
        if up {
            for (i, &c) in children.iter().enumerate() {
                let finish = parent.is_none() && i + 1 == children.len();
                let land = Land::Reduce {
                    theirs_first: false,
                    finish,
                };
                plan.ins.push(frame_in(c, land));
            }
            if let Some(p) = parent {
                let after = (!children.is_empty()).then(|| plan.ins.len() - 1);
                plan.outs.push(frame_out(p, after));
            }
        } else {
            if let Some(p) = parent {
                plan.ins.push(frame_in(p, Land::Copy));
            }
            let after = parent.map(|_| plan.ins.len() - 1);
            for &c in &children {
                plan.outs.push(frame_out(c, after));
            }
        }
    }
    plan
}

/// Elements per segment of a tree all-reduce of `count` elements: each half in up to
/// [`TREE_SEGMENTS`] segments, but none smaller than 64 KiB
/// ([`super::schedule::MIN_AUTO_SEGMENT_BYTES`]) nor larger than `max_bytes` (which
/// wins when it is below 64 KiB). The tree's pipeline fills in about `2·log2(n)` hops
/// of a segment (the ring's in two), so it wants more, smaller segments than the ring.
pub(crate) fn seg_elems(count: usize, esize: usize, max_bytes: usize) -> usize {
    let half = count.div_ceil(2) * esize;
    let bytes = half
        .div_ceil(TREE_SEGMENTS)
        .max(super::schedule::MIN_AUTO_SEGMENT_BYTES)
        .min(max_bytes);
    (bytes / esize).max(1)
}

/// Segments per half [`seg_elems`] aims at.
pub(crate) const TREE_SEGMENTS: usize = 64;

/// The busiest rank of a tree all-reduce over `n` ranks, and the deepest path: what
/// the closed form of [`super::sim::predict_all_reduce`] needs, without walking the
/// trees (the tests hold it to them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Widest {
    /// Most frames a rank sends per segment index, both trees together.
    pub edges: usize,
    /// Most frames a rank combines per segment index.
    pub children: usize,
    /// Most hops from a rank to its tree's root: position 1's path in tree 0, up
    /// through every power of two below `n`.
    pub depth: usize,
}

impl Widest {
    pub(crate) fn of(n: usize) -> Self {
        let depth = (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize;
        let (edges, children) = match n {
            0 | 1 => (0, 0),
            2 => (2, 1),
            3 => (3, 2),
            _ => (4, 2),
        };
        Widest {
            edges,
            children,
            depth,
        }
    }
}

/// Bytes rank `rank` sends (and receives) in a tree all-reduce of `count` elements of
/// `esize` bytes over `n` ranks: the tree's byte law (each tree's half once to the
/// parent and once to each child). Over all ranks: `2(n-1)·count·esize`.
pub fn send_bytes(rank: usize, n: usize, count: usize, esize: usize) -> usize {
    if n == 1 {
        return 0;
    }
    (0..2)
        .map(|t| {
            let p = place(t, rank, n);
            let edges = p.children.len() + usize::from(p.parent.is_some());
            edges * chunk_range(count, 2, t).len() * esize
        })
        .sum()
}

/// The element range of tree `t`'s half.
#[cfg(test)]
fn half(count: usize, t: usize) -> std::ops::Range<usize> {
    chunk_range(count, 2, t)
}

#[cfg(test)]
mod tests {
    use super::super::tests::check_all_reduce;
    use super::*;

    #[test]
    fn both_trees_span_every_rank_with_at_most_two_children() {
        for n in (1usize..=70).chain([100, 127, 128, 129, 1000, 4095, 4096, 4100]) {
            let bits = usize::BITS - n.leading_zeros();
            for t in 0..2 {
                let mut parents = vec![0usize; n];
                let mut roots = 0;
                for r in 0..n {
                    let p = place(t, r, n);
                    assert!(p.children.len() <= 2, "n={n} tree {t} rank {r}");
                    assert!(
                        p.depth <= bits,
                        "n={n} tree {t} rank {r}: depth {}",
                        p.depth
                    );
                    for &(c, h) in &p.children {
                        assert_eq!(place(t, c, n).parent, Some(r), "n={n} t={t}");
                        assert!(h < p.height || p.parent.is_none(), "n={n} t={t}");
                        assert!(h + 1 < bits + 1);
                    }
                    match p.parent {
                        Some(q) => parents[q] += 1,
                        None => roots += 1,
                    }
                }
                assert_eq!(roots, 1, "n={n} tree {t}");
                for (r, &kids) in parents.iter().enumerate() {
                    assert_eq!(kids, place(t, r, n).children.len(), "n={n} t={t}");
                }
            }
            // In an even world every rank is a leaf in one of the trees.
            if n % 2 == 0 {
                for r in 0..n {
                    let leaf = (0..2).any(|t| place(t, r, n).children.is_empty());
                    assert!(leaf, "n={n} rank {r} is interior in both trees");
                }
            }
        }
    }

    fn check(n: usize, count: usize, seg: usize) {
        let plans: Vec<Plan> = (0..n).map(|r| plan(r, n, count, 8, seg)).collect();
        check_all_reduce(&plans, count, &format!("seg={seg}"));
        for (r, p) in plans.iter().enumerate() {
            // Every element is made final exactly once on every rank (n > 1): on the
            // root of its tree by the last combine, elsewhere by the copy down.
            let mut finals = vec![0u32; count];
            for i in p.ins.iter().filter(|i| i.is_final()) {
                finals[i.off / 8..(i.off + i.len) / 8]
                    .iter_mut()
                    .for_each(|f| *f += 1);
            }
            let want = u32::from(n > 1);
            assert!(
                finals.iter().all(|&f| f == want),
                "n={n} count={count} rank {r}"
            );
            // The byte law, both ways.
            let recvd: usize = p.ins.iter().map(|i| i.len).sum();
            assert_eq!(p.send_bytes(), send_bytes(r, n, count, 8), "n={n} rank {r}");
            assert_eq!(recvd, send_bytes(r, n, count, 8), "n={n} rank {r}");
        }
        let total: usize = plans.iter().map(Plan::send_bytes).sum();
        assert_eq!(total, 2 * (n - 1) * count * 8, "n={n}: the ring's total");
    }

    #[test]
    fn plans_fit_and_sum_for_every_world_and_uneven_counts() {
        for n in 1usize..=16 {
            for count in [0, 1, 3, n.saturating_sub(1), n, 2 * n + 1, 37, 64] {
                for seg in [1, 2, 5, 1000] {
                    check(n, count, seg);
                }
            }
        }
    }

    #[test]
    fn larger_worlds_fit_and_sum() {
        for n in [17, 33, 64, 100] {
            for (count, seg) in [(0, 4), (n / 2, 1), (3 * n + 5, 7), (400, 1000)] {
                check(n, count, seg);
            }
        }
    }

    #[test]
    fn avg_divides_once_at_each_root() {
        // The combine that finishes an element is on the root of the element's tree.
        for n in 2..=12 {
            for r in 0..n {
                let p = plan(r, n, 10, 4, 2);
                for i in &p.ins {
                    let fin = matches!(i.land, Land::Reduce { finish: true, .. });
                    let t = if half(10, 0).contains(&(i.off / 4)) {
                        0
                    } else {
                        1
                    };
                    if fin {
                        assert!(place(t, r, n).parent.is_none(), "n={n} rank {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_widest_rank_is_what_the_closed_form_assumes() {
        for n in (1usize..=300).chain([1000, 1023, 1025, 4096]) {
            let places: Vec<[Place; 2]> =
                (0..n).map(|r| [place(0, r, n), place(1, r, n)]).collect();
            let edges = places
                .iter()
                .map(|p| {
                    p.iter()
                        .map(|t| t.children.len() + usize::from(t.parent.is_some()))
                        .sum::<usize>()
                })
                .max()
                .unwrap();
            let children = places
                .iter()
                .map(|p| p.iter().map(|t| t.children.len()).sum::<usize>())
                .max()
                .unwrap();
            let depth = places
                .iter()
                .flat_map(|p| p.iter().map(|t| t.depth as usize))
                .max()
                .unwrap();
            let w = Widest::of(n);
            assert_eq!(
                (edges, children, depth),
                (w.edges, w.children, w.depth),
                "n={n}"
            );
        }
    }

    #[test]
    fn broadcast_and_reduce_compute_their_definition() {
        for n in (1usize..=16).chain([33, 100]) {
            let roots: Vec<usize> = if n <= 16 {
                (0..n).collect()
            } else {
                vec![0, n / 3, n - 1]
            };
            for root in roots {
                super::super::chain::tests::check_rooted(&broadcast, &reduce, n, root);
            }
        }
    }

    /// The chain's root-disagreement model (`chain.rs`), on the trees: every
    /// assignment of roots for n <= 5, random ones up to 16: no rank waits forever,
    /// some rank reports the mismatch, no rank returns Ok unless all agree.
    #[test]
    fn root_disagreements_fail_fast_on_every_rank() {
        super::super::chain::tests::each_root_assignment(&broadcast, &reduce);
    }

    #[test]
    fn steps_grow_with_log_n() {
        // Hops from any rank to its root: at most the bit length of n, in both trees.
        for n in [8usize, 64, 1000, 4096] {
            let deepest = (0..n)
                .flat_map(|r| (0..2).map(move |t| place(t, r, n).depth))
                .max()
                .unwrap();
            assert!(
                deepest <= usize::BITS - n.leading_zeros(),
                "n={n}: {deepest}"
            );
            assert!(
                deepest + 2 >= usize::BITS - n.leading_zeros(),
                "n={n}: {deepest}"
            );
        }
    }
}
