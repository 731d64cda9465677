//! Algorithms as plans: pure functions from a call (sizes, rank, world, root) to the
//! frames this rank sends and receives, with the order between them. No algorithm
//! touches a buffer or a link; the engine runs a [`Plan`] ([`crate::engine`]), over
//! links that push bytes (TCP, RDMA, in-process pipes) or over peers whose memory it
//! reads (CUDA IPC). Because a plan is data, the same plan is run by every executor,
//! checked in tests for every rank at once, and counted for the byte laws.
//!
//! - [`schedule`]: the ring's arithmetic (which chunk moves at which step), chunking,
//!   segmenting, neighbours. Property-tested on its own.
//! - [`ring`]: reduce-scatter, all-gather and all-reduce: steps of one ring.
//! - [`doubling`]: recursive-doubling all-reduce (and the barrier) for small messages.
//! - [`halving`]: Rabenseifner's all-reduce (recursive halving, then doubling): the
//!   ring's bytes in `2·log2(n)` steps.
//! - [`tree`]: the pipelined double binary tree all-reduce: two trees, half the
//!   buffer each, about `2·log2(n)` steps for any `n`.
//! - [`hier`]: hierarchical all-reduce over hosts of `k` ranks (local ring
//!   reduce-scatter, `k` rings between hosts, local all-gather) on a [`HostLayout`].
//! - [`chain`]: broadcast and reduce as pipelined chains from a root.
//! - [`direct`]: all-to-all (pairwise exchange), gather and scatter (a star with the
//!   root agreement).
//! - [`select`]: every decision before a call runs (algorithm, segments, which peers
//!   link at start, push or pull), pure and tested on its own.
//!
//! # The plan contract
//! A plan is two ordered lists. [`Out`]s leave in order, [`In`]s arrive in order (per
//! link the order is the wire order). An out may leave only once the in it forwards has
//! been *applied* ([`Out::after_recv`]); an in may change the buffer only once the out
//! that read those bytes has *left* ([`In::after_send`]) — for the pull executor, once
//! the peer has read them. Every read and write of the same bytes by two frames is
//! ordered by these two fields; that is the whole of an algorithm's correctness
//! argument, and what the plan tests check (`check_hazards`), along with termination
//! over links that hold nothing. A plan may split its frames into [`Lanes`] that an
//! executor moves independently (each lane in list order); receives of different lanes
//! on the same bytes are then ordered by [`Lanes::after_in`].

pub(crate) mod chain;
pub(crate) mod direct;
pub(crate) mod doubling;
pub(crate) mod halving;
pub(crate) mod hier;
pub(crate) mod ring;
pub(crate) mod schedule;
pub(crate) mod select;
pub mod sim;
pub(crate) mod tree;

pub use hier::HostLayout;
use std::ops::Range;

/// How a collective moves its data. Chosen identically on every rank from the call's
/// size and the [`crate::Config`]; carried on the wire so a disagreement is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Ring: bandwidth-optimal, `2(n-1)` latency-bound steps.
    Ring,
    /// Recursive doubling: `log2(n)` steps (plus two when `n` is not a power of two),
    /// sending the whole buffer at each; latency-optimal for small messages.
    RecursiveDoubling,
    /// A pipelined chain along the ring (broadcast, reduce).
    Chain,
    /// Straight to one peer (send/recv).
    Direct,
    /// Rabenseifner: recursive-halving reduce-scatter, recursive-doubling all-gather;
    /// the ring's `2(n-1)/n·S` bytes in `2·log2(n)` steps (plus two when `n` is not a
    /// power of two).
    Rabenseifner,
    /// A pipelined double binary tree: two trees over the ranks, each reducing half
    /// of the buffer up to its root and broadcasting it back down in segments;
    /// `O(log n)` latency for any `n`, `2(n-1)·S` bytes in all as the ring.
    Tree,
    /// Hierarchical (hosts of `k` ranks each): ring reduce-scatter within each host, `k`
    /// rings between hosts each on its `1/k` share, ring all-gather within each host;
    /// `2(H-1)/H·S` bytes per host between hosts.
    Hierarchical,
    /// One-shot (symmetric memory, one host): every rank copies its buffer into its
    /// workspace and reduces all `n` workspaces itself, in rank order; one
    /// synchronisation, `(n-1)·S` read from peers.
    OneShot,
    /// Two-shot (symmetric memory, one host): rank `r` reduces chunk `r` of all `n`
    /// workspaces in rank order, then every rank copies every other chunk from its
    /// owner; the ring's `2(n-1)/n·S` in two synchronisations.
    TwoShot,
}

impl Algorithm {
    /// The name used in messages and bench output.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive doubling",
            Algorithm::Chain => "chain",
            Algorithm::Direct => "direct",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::Tree => "tree",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Algorithm::Ring => 0,
            Algorithm::RecursiveDoubling => 1,
            Algorithm::Chain => 2,
            Algorithm::Direct => 3,
            Algorithm::Rabenseifner => 4,
            Algorithm::Tree => 5,
            Algorithm::Hierarchical => 6,
            Algorithm::OneShot => 7,
            Algorithm::TwoShot => 8,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(Algorithm::Ring),
            1 => Some(Algorithm::RecursiveDoubling),
            2 => Some(Algorithm::Chain),
            3 => Some(Algorithm::Direct),
            4 => Some(Algorithm::Rabenseifner),
            5 => Some(Algorithm::Tree),
            6 => Some(Algorithm::Hierarchical),
            7 => Some(Algorithm::OneShot),
            8 => Some(Algorithm::TwoShot),
            _ => None,
        }
    }
}

/// A frame to send: `len` bytes at `off` in the operation's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Out {
    pub peer: usize,
    pub step: u32,
    pub seg: u32,
    pub off: usize,
    pub len: usize,
    /// Index of the receive that must be applied first (the data this frame forwards).
    pub after_recv: Option<usize>,
}

impl Out {
    /// Segment `seg` of a one-step transfer to `peer`: the bytes `bytes`, sent once the
    /// receive `after_recv` (if any) is applied.
    pub fn segment(peer: usize, seg: u32, bytes: Range<usize>, after_recv: Option<usize>) -> Self {
        Out {
            peer,
            step: 0,
            seg,
            off: bytes.start,
            len: bytes.len(),
            after_recv,
        }
    }

    /// An empty frame to `peer`: its header alone carries the call's fingerprint, for
    /// the receiver to check (root agreement, the pull executor's exchange).
    pub fn check(peer: usize, step: u32) -> Self {
        Out {
            peer,
            step,
            seg: 0,
            off: 0,
            len: 0,
            after_recv: None,
        }
    }
}

/// What a received frame does to the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Land {
    /// Its bytes replace the buffer's at `off` (they are final there).
    Copy,
    /// It is combined with the buffer's bytes at `off`: `mine op theirs`, or
    /// `theirs op mine` when `theirs_first` (so both partners of a recursive-doubling
    /// step evaluate `lower op higher` and get the same bits). `finish`: this completes
    /// the result for these bytes (Avg divides here; an executor writing results out
    /// writes them now).
    Reduce { theirs_first: bool, finish: bool },
}

/// A frame to receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct In {
    pub peer: usize,
    pub step: u32,
    pub seg: u32,
    /// Where in the operation's buffer it lands (or is combined).
    pub off: usize,
    pub len: usize,
    pub land: Land,
    /// Index of the send that must have left first (it read the bytes this frame
    /// changes).
    pub after_send: Option<usize>,
}

impl In {
    /// The receive of [`Out::segment`] from `peer`, landing as `land`.
    pub fn segment(peer: usize, seg: u32, bytes: Range<usize>, land: Land) -> Self {
        In {
            peer,
            step: 0,
            seg,
            off: bytes.start,
            len: bytes.len(),
            land,
            after_send: None,
        }
    }

    /// The empty frame [`Out::check`] sends, from `peer`.
    pub fn check(peer: usize, step: u32) -> Self {
        In {
            peer,
            step,
            seg: 0,
            off: 0,
            len: 0,
            land: Land::Copy,
            after_send: None,
        }
    }

    /// Whether applying this frame makes its bytes final on this rank.
    pub fn is_final(&self) -> bool {
        matches!(self.land, Land::Copy | Land::Reduce { finish: true, .. })
    }

    /// The bytes of the buffer it changes.
    pub fn range(&self) -> Range<usize> {
        self.off..self.off + self.len
    }
}

/// One rank's part of a collective: what it sends and receives, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub outs: Vec<Out>,
    pub ins: Vec<In>,
    /// Independent lanes, when the plan has more than one ([`Lanes`]).
    pub lanes: Option<Box<Lanes>>,
    /// What each pair of ranks exchanges, for plans whose pairs each move their own
    /// amount ([`PairCounts`]).
    pub counts: Option<Box<PairCounts>>,
}

/// Per peer, the elements this rank sends to it and receives from it, for plans whose
/// pairs each move their own amount (all-to-all(v), gather(v), scatter(v)): a frame's
/// header carries its pair's count instead of the call's, so two ranks that disagree
/// on what they exchange fail on the first frame between them (with segments cut
/// alike, the frames would otherwise fit until the shorter message ended, and its
/// receiver return with the first part of the longer one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PairCounts {
    /// `send[q]`: elements this rank sends to rank `q`.
    pub send: Vec<u64>,
    /// `recv[q]`: elements this rank expects from rank `q`.
    pub recv: Vec<u64>,
}

/// Lanes of a plan: each frame belongs to one, and an executor that keeps a cursor per
/// lane moves each lane's sends (and receives) in list order but the lanes
/// independently, so a frame on a fast link never waits behind one on a slow link that
/// it does not depend on (the hierarchical plan: links within a host, and between
/// hosts). What lanes no longer order is ordered by the dependencies alone, plus
/// [`Lanes::after_in`] between receives of different lanes that touch the same bytes.
///
/// Lanes only relax the order: the lists run in order remain a valid schedule (every
/// dependency, `after_in` included, points to an earlier frame), which is how an
/// executor without lanes runs them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lanes {
    /// The lane of each send (`outs[i]`) and receive (`ins[i]`).
    pub outs: Vec<u8>,
    pub ins: Vec<u8>,
    /// Per receive: the receive of another lane that must be applied before it (the
    /// last earlier one that touches its bytes), if any.
    pub after_in: Vec<Option<usize>>,
}

/// The most lanes a plan has.
pub(crate) const MAX_LANES: usize = 2;

/// A plan's frames per lane, for executors that keep a cursor per lane: which send
/// (receive) is at position `pos` of lane `l`, and whether a frame is done given the
/// cursors. For a plan without [`Lanes`] it allocates nothing: one lane, the lists.
pub(crate) struct LaneOrder<'p> {
    plan: &'p Plan,
    /// Per lane, the indices of its sends and receives, in list order (empty without
    /// lanes).
    outs: Vec<Vec<usize>>,
    ins: Vec<Vec<usize>>,
    /// Per send and receive: its lane and position in the lane (empty without lanes).
    out_at: Vec<(u8, usize)>,
    in_at: Vec<(u8, usize)>,
    lanes: usize,
}

impl<'p> LaneOrder<'p> {
    pub fn of(plan: &'p Plan) -> Self {
        let mut order = LaneOrder {
            plan,
            outs: Vec::new(),
            ins: Vec::new(),
            out_at: Vec::new(),
            in_at: Vec::new(),
            lanes: 1,
        };
        let Some(l) = &plan.lanes else {
            return order;
        };
        debug_assert_eq!(l.outs.len(), plan.outs.len());
        debug_assert_eq!(l.ins.len(), plan.ins.len());
        let lanes = l
            .outs
            .iter()
            .chain(&l.ins)
            .map(|&x| x as usize + 1)
            .max()
            .unwrap_or(1);
        assert!(lanes <= MAX_LANES, "a plan has at most {MAX_LANES} lanes");
        let split = |of: &[u8]| {
            let mut lists = vec![Vec::new(); lanes];
            let at = of
                .iter()
                .enumerate()
                .map(|(x, &lane)| {
                    lists[lane as usize].push(x);
                    (lane, lists[lane as usize].len() - 1)
                })
                .collect();
            (lists, at)
        };
        (order.outs, order.out_at) = split(&l.outs);
        (order.ins, order.in_at) = split(&l.ins);
        order.lanes = lanes;
        order
    }

    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// The send at position `pos` of lane `l`.
    pub fn out(&self, l: usize, pos: usize) -> Option<usize> {
        if self.out_at.is_empty() {
            (pos < self.plan.outs.len()).then_some(pos)
        } else {
            self.outs[l].get(pos).copied()
        }
    }

    /// The receive at position `pos` of lane `l`.
    pub fn inp(&self, l: usize, pos: usize) -> Option<usize> {
        if self.in_at.is_empty() {
            (pos < self.plan.ins.len()).then_some(pos)
        } else {
            self.ins[l].get(pos).copied()
        }
    }

    /// Whether lane `l` has nothing left to send or receive, its cursors at `si`, `ai`.
    pub fn lane_done(&self, l: usize, si: &[usize], ai: &[usize]) -> bool {
        self.out(l, si[l]).is_none() && self.inp(l, ai[l]).is_none()
    }

    /// Whether send `x` has left, the send cursors being at `si`.
    pub fn sent(&self, x: usize, si: &[usize]) -> bool {
        match self.out_at.get(x) {
            Some(&(l, pos)) => si[l as usize] > pos,
            None => si[0] > x,
        }
    }

    /// Whether receive `x` has been applied, the receive cursors being at `ai`.
    pub fn applied(&self, x: usize, ai: &[usize]) -> bool {
        match self.in_at.get(x) {
            Some(&(l, pos)) => ai[l as usize] > pos,
            None => ai[0] > x,
        }
    }

    /// Whether receive `x` may be applied: what it waits for has left or been
    /// applied.
    pub fn may_apply(&self, x: usize, si: &[usize], ai: &[usize]) -> bool {
        let after_in = self.plan.lanes.as_ref().and_then(|l| l.after_in[x]);
        self.plan.ins[x].after_send.is_none_or(|s| self.sent(s, si))
            && after_in.is_none_or(|y| self.applied(y, ai))
    }
}

impl Plan {
    /// Payload bytes this rank sends.
    #[cfg(test)]
    pub fn send_bytes(&self) -> usize {
        self.outs.iter().map(|o| o.len).sum()
    }

    /// The peers this rank exchanges frames with, sorted, once each.
    pub fn peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .outs
            .iter()
            .map(|o| o.peer)
            .chain(self.ins.iter().map(|i| i.peer))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The index of the send of `self` that `theirs` (the plan of rank `peer`) receives as
    /// its in `i`: the one to `theirs`' rank with the same step and segment.
    pub fn matching_out(&self, to: usize, step: u32, seg: u32) -> Option<usize> {
        self.outs
            .iter()
            .position(|o| o.peer == to && o.step == step && o.seg == seg)
    }

    /// The index of the in of `self` that receives the frame `(step, seg)` from `from`.
    pub fn matching_in(&self, from: usize, step: u32, seg: u32) -> Option<usize> {
        self.ins
            .iter()
            .position(|i| i.peer == from && i.step == step && i.seg == seg)
    }
}

/// The all-reduce plan of `rank` by `algo`: the one dispatch host and device buffers
/// (and the simulator) share. `segment_bytes` is the pipelining segment; `layout` says
/// which ranks share a host (the hierarchical plan needs an even [`HostLayout::shape`]).
pub(crate) fn all_reduce_plan(
    algo: Algorithm,
    rank: usize,
    n: usize,
    count: usize,
    esize: usize,
    segment_bytes: usize,
    layout: Option<&HostLayout>,
) -> Plan {
    match algo {
        Algorithm::Hierarchical => {
            let layout = hier::or_flat(layout, n);
            debug_assert_eq!(layout.world_size(), n);
            hier::plan(rank, &layout, count, esize, segment_bytes)
        }
        Algorithm::RecursiveDoubling => doubling::plan(rank, n, count * esize),
        Algorithm::Rabenseifner => {
            let seg = self::segment_bytes(segment_bytes, esize) / esize;
            halving::plan(rank, n, count, esize, seg)
        }
        Algorithm::Tree => {
            let seg = tree::seg_elems(count, esize, segment_bytes);
            tree::plan(rank, n, count, esize, seg)
        }
        _ => {
            let chunks = schedule::balanced_chunks(count, n);
            let seg = ring::seg_elems(&chunks, esize, segment_bytes);
            ring::plan(
                rank,
                n,
                &chunks,
                esize,
                0..schedule::allreduce_steps(n),
                seg,
            )
        }
    }
}

/// Byte ranges of `len` bytes cut into frames of at most `seg` bytes: `(index, range)`.
/// An empty range still has one (empty) frame, so every step exchanges at least one
/// frame and a peer's fingerprint is always seen.
pub(crate) fn frames(len: usize, seg: usize) -> impl Iterator<Item = (u32, Range<usize>)> {
    let whole = 0..len;
    (0..schedule::segments(len, seg))
        .map(move |j| (j as u32, schedule::segment_range(&whole, seg, j)))
}

/// Segment size in bytes for frames of elements of `esize` bytes: the configured size
/// rounded down to whole elements (at least one).
pub(crate) fn segment_bytes(configured: usize, esize: usize) -> usize {
    (configured / esize).max(1) * esize
}

#[cfg(test)]
pub(crate) mod tests {
    //! Checks every rank's plan of one call against the others': what `r` sends to `q`
    //! is exactly what `q` expects from `r`, in the same order and size, every
    //! dependency index is in range, and — run as a simple all-at-once simulation —
    //! the plans terminate and compute the definition.
    use super::*;

    /// Fails unless the plans of all ranks of one call fit each other.
    pub fn check_plans(plans: &[Plan]) {
        let n = plans.len();
        for (r, p) in plans.iter().enumerate() {
            for o in &p.outs {
                assert!(o.peer < n && o.peer != r, "rank {r} sends to {}", o.peer);
                if let Some(d) = o.after_recv {
                    assert!(d < p.ins.len(), "rank {r}: after_recv {d} out of range");
                }
            }
            for i in &p.ins {
                assert!(i.peer < n && i.peer != r);
                if let Some(s) = i.after_send {
                    assert!(s < p.outs.len(), "rank {r}: after_send {s} out of range");
                }
            }
            for (q, theirs) in plans.iter().enumerate() {
                let sent: Vec<_> = p
                    .outs
                    .iter()
                    .filter(|o| o.peer == q)
                    .map(|o| (o.step, o.seg, o.len))
                    .collect();
                let got: Vec<_> = theirs
                    .ins
                    .iter()
                    .filter(|i| i.peer == r)
                    .map(|i| (i.step, i.seg, i.len))
                    .collect();
                assert_eq!(sent, got, "frames {r} -> {q}");
            }
        }
    }

    /// Fails unless every two frames of `p` that touch the same bytes, a send and a
    /// receive or two receives, are ordered: one happens before the other through the
    /// order of their lane's list (sends leave in order, receives apply in order) and
    /// the dependencies (`after_recv`, `after_send`, [`Lanes::after_in`]).
    pub fn check_hazards(p: &Plan, ctx: &str) {
        let (no, ni) = (p.outs.len(), p.ins.len());
        let nv = no + ni;
        let lane_o = |x: usize| p.lanes.as_ref().map_or(0, |l| l.outs[x]);
        let lane_i = |x: usize| p.lanes.as_ref().map_or(0, |l| l.ins[x]);
        // Nodes: sends 0..no (leaving), receives no.. (applied).
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); nv];
        let mut last_o = [None; MAX_LANES];
        for x in 0..no {
            if let Some(y) = last_o[lane_o(x) as usize].replace(x) {
                succ[y].push(x);
            }
            if let Some(d) = p.outs[x].after_recv {
                succ[no + d].push(x);
            }
        }
        let mut last_i = [None; MAX_LANES];
        for x in 0..ni {
            if let Some(y) = last_i[lane_i(x) as usize].replace(x) {
                succ[no + y].push(no + x);
            }
            if let Some(s) = p.ins[x].after_send {
                succ[s].push(no + x);
            }
            if let Some(y) = p.lanes.as_ref().and_then(|l| l.after_in[x]) {
                assert!(y < x, "{ctx}: after_in {y} of receive {x} is not earlier");
                succ[no + y].push(no + x);
            }
        }
        // Reachability, in reverse topological order.
        let mut indeg = vec![0usize; nv];
        for v in succ.iter().flatten() {
            indeg[*v] += 1;
        }
        let mut topo: Vec<usize> = (0..nv).filter(|&v| indeg[v] == 0).collect();
        let mut at = 0;
        while at < topo.len() {
            for &w in &succ[topo[at]] {
                indeg[w] -= 1;
                if indeg[w] == 0 {
                    topo.push(w);
                }
            }
            at += 1;
        }
        assert_eq!(topo.len(), nv, "{ctx}: the plan's order has a cycle");
        let words = nv.div_ceil(64);
        let mut reach = vec![vec![0u64; words]; nv];
        for &v in topo.iter().rev() {
            reach[v][v / 64] |= 1 << (v % 64);
            for &w in &succ[v] {
                let (rv, rw) = if v < w {
                    let (a, b) = reach.split_at_mut(w);
                    (&mut a[v], &b[0])
                } else {
                    let (a, b) = reach.split_at_mut(v);
                    (&mut b[0], &a[w])
                };
                rv.iter_mut().zip(rw).for_each(|(x, y)| *x |= y);
            }
        }
        let ordered = |a: usize, b: usize| {
            reach[a][b / 64] & (1 << (b % 64)) != 0 || reach[b][a / 64] & (1 << (a % 64)) != 0
        };
        let touch = |o1: usize, l1: usize, o2: usize, l2: usize| {
            l1 > 0 && l2 > 0 && o1 < o2 + l2 && o2 < o1 + l1
        };
        for (y, i) in p.ins.iter().enumerate() {
            for (x, o) in p.outs.iter().enumerate() {
                if touch(o.off, o.len, i.off, i.len) {
                    assert!(
                        ordered(x, no + y),
                        "{ctx}: send {x} {o:?} and receive {y} {i:?} touch the same bytes unordered"
                    );
                }
            }
            for (z, j) in p.ins.iter().enumerate().take(y) {
                if touch(j.off, j.len, i.off, i.len) {
                    assert!(
                        ordered(no + z, no + y),
                        "{ctx}: receives {z} {j:?} and {y} {i:?} touch the same bytes unordered"
                    );
                }
            }
        }
        // A link is never split between lanes (frames from one peer arrive in order).
        if let Some(l) = &p.lanes {
            let mut lane_of = std::collections::HashMap::new();
            for (o, &lane) in p.outs.iter().zip(&l.outs) {
                assert_eq!(*lane_of.entry((0, o.peer)).or_insert(lane), lane, "{ctx}");
            }
            for (i, &lane) in p.ins.iter().zip(&l.ins) {
                assert_eq!(*lane_of.entry((1, i.peer)).or_insert(lane), lane, "{ctx}");
            }
        }
    }

    /// Fails unless the all-reduce plans of all ranks fit each other and, simulated on
    /// `count` f64 elements per rank (rank `r`'s element `i` is `100r + i`), leave
    /// every rank with the sum. `ctx` is added to the failure message.
    pub fn check_all_reduce(plans: &[Plan], count: usize, ctx: &str) {
        check_plans(plans);
        for (r, p) in plans.iter().enumerate() {
            check_hazards(p, &format!("{ctx} rank {r}"));
        }
        let n = plans.len();
        let bufs: Vec<Vec<f64>> = (0..n)
            .map(|r| (0..count).map(|i| (r * 100 + i) as f64).collect())
            .collect();
        let want: Vec<f64> = (0..count)
            .map(|i| (0..n).map(|r| (r * 100 + i) as f64).sum())
            .collect();
        for (r, b) in simulate(plans, bufs.clone()).into_iter().enumerate() {
            assert_eq!(b, want, "n={n} count={count} {ctx} rank {r}");
        }
        // Links that hold nothing (and one frame): the plans still finish.
        for cap in [0, 1] {
            for (r, b) in simulate_links(plans, bufs.clone(), cap)
                .into_iter()
                .enumerate()
            {
                assert_eq!(b, want, "n={n} count={count} {ctx} cap={cap} rank {r}");
            }
        }
    }

    /// Runs the plans of all ranks on `bufs` (one buffer of f64 per rank, reduced with
    /// `+`), as a push executor with unbounded links would: sends copy the bytes out
    /// when they leave. Panics on a deadlock. Returns the buffers.
    pub fn simulate(plans: &[Plan], bufs: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        simulate_links(plans, bufs, usize::MAX)
    }

    /// How a call ends on one rank in [`run_views`].
    #[derive(Debug, PartialEq)]
    pub enum End {
        Ok(Vec<f64>),
        /// A frame's sender saw the call differently (the executor's mismatch).
        Mismatch,
        /// The peer it waited on failed first and closed its links.
        Closed,
    }

    /// [`simulate`] where rank `r` made the call as it sees it, `views[r]` (the plans
    /// of ranks with different views may not fit each other): a frame whose sender's
    /// view differs fails the receiver with a mismatch, as its header would; a failed
    /// rank's links close (frames it sent before stay readable). Panics if any rank
    /// would wait forever.
    pub fn run_views(plans: &[Plan], views: &[usize], bufs: Vec<Vec<f64>>) -> Vec<End> {
        run_links(plans, views, bufs, usize::MAX)
    }

    /// [`simulate`] over links that hold at most `cap` frames each way. With `cap ==
    /// 0` a link holds nothing: a send completes only straight into a receive that
    /// takes it now, as a frame larger than every buffer on its way would. Receives
    /// behave as the push executor's: a combining one is taken into scratch at once and
    /// held there until its `after_send` has left; one that lands in place is taken only
    /// then. Panics on a deadlock.
    pub fn simulate_links(plans: &[Plan], bufs: Vec<Vec<f64>>, cap: usize) -> Vec<Vec<f64>> {
        let views = vec![0; plans.len()];
        run_links(plans, &views, bufs, cap)
            .into_iter()
            .enumerate()
            .map(|(r, e)| match e {
                End::Ok(b) => b,
                e => panic!("rank {r} ended {e:?} although every rank made the same call"),
            })
            .collect()
    }

    fn run_links(plans: &[Plan], views: &[usize], mut bufs: Vec<Vec<f64>>, cap: usize) -> Vec<End> {
        use std::collections::VecDeque;
        let n = plans.len();
        let orders: Vec<LaneOrder> = plans.iter().map(LaneOrder::of).collect();
        // Per rank and lane: position of the next send and receive, and a combining
        // receive taken into scratch, waiting for what it must follow.
        let mut si = vec![[0usize; MAX_LANES]; n];
        let mut ai = vec![[0usize; MAX_LANES]; n];
        // A held receive: its index, and the data taken into scratch.
        type Held = Option<(usize, Vec<f64>)>;
        let mut held: Vec<[Held; MAX_LANES]> = (0..n).map(|_| [None, None]).collect();
        let mut end: Vec<Option<End>> = (0..n).map(|_| None).collect();
        // wires[r][q]: frames r sent q not yet received (step, seg, sender's view, data).
        type Wire = VecDeque<(u32, u32, usize, Vec<f64>)>;
        let mut wires: Vec<Vec<Wire>> = (0..n)
            .map(|_| (0..n).map(|_| VecDeque::new()).collect())
            .collect();
        let apply = |dst: &mut [f64], i: &In, data: &[f64]| match i.land {
            Land::Copy => dst.copy_from_slice(data),
            Land::Reduce { .. } => dst.iter_mut().zip(data).for_each(|(d, s)| *d += s),
        };
        loop {
            let mut moved = false;
            for r in 0..n {
                if end[r].is_some() {
                    continue;
                }
                let (p, ord) = (&plans[r], &orders[r]);
                for l in 0..ord.lanes() {
                    while let Some(x) = ord.out(l, si[r][l]) {
                        let o = &p.outs[x];
                        if o.after_recv.is_some_and(|d| !ord.applied(d, &ai[r])) {
                            break;
                        }
                        let q = o.peer;
                        // With no room on the link, only a receive that takes the
                        // frame now lets it leave.
                        let takes = |ql: usize| {
                            held[q][ql].is_none()
                                && orders[q].inp(ql, ai[q][ql]).is_some_and(|y| {
                                    let i = &plans[q].ins[y];
                                    i.peer == r
                                        && i.step == o.step
                                        && i.seg == o.seg
                                        && (matches!(i.land, Land::Reduce { .. })
                                            || orders[q].may_apply(y, &si[q], &ai[q]))
                                })
                        };
                        let room = wires[r][q].len() < cap
                            || (wires[r][q].is_empty()
                                && end[q].is_none()
                                && (0..orders[q].lanes()).any(takes));
                        if !room {
                            break;
                        }
                        let data = bufs[r][o.off / 8..(o.off + o.len) / 8].to_vec();
                        wires[r][q].push_back((o.step, o.seg, views[r], data));
                        si[r][l] += 1;
                        moved = true;
                    }
                }
                for l in 0..ord.lanes() {
                    if let Some((x, data)) = &held[r][l] {
                        let x = *x;
                        if ord.may_apply(x, &si[r], &ai[r]) {
                            let i = &p.ins[x];
                            apply(&mut bufs[r][i.off / 8..(i.off + i.len) / 8], i, data);
                            held[r][l] = None;
                            ai[r][l] += 1;
                            moved = true;
                        }
                    }
                    while held[r][l].is_none() {
                        let Some(x) = ord.inp(l, ai[r][l]) else {
                            break;
                        };
                        let i = &p.ins[x];
                        let reduces = matches!(i.land, Land::Reduce { .. });
                        if !reduces && !ord.may_apply(x, &si[r], &ai[r]) {
                            break;
                        }
                        // Frames from one peer arrive in its order: the next one must
                        // be this receive's (lanes never split a link).
                        let Some((step, seg, view, data)) = wires[i.peer][r].pop_front() else {
                            if matches!(end[i.peer], Some(End::Mismatch | End::Closed)) {
                                end[r] = Some(End::Closed);
                                moved = true;
                            }
                            break;
                        };
                        moved = true;
                        if view != views[r] {
                            end[r] = Some(End::Mismatch);
                            break;
                        }
                        assert_eq!((step, seg), (i.step, i.seg), "rank {r} from {}", i.peer);
                        assert_eq!(data.len() * 8, i.len, "rank {r} from {}", i.peer);
                        if !ord.may_apply(x, &si[r], &ai[r]) {
                            held[r][l] = Some((x, data));
                            break;
                        }
                        apply(&mut bufs[r][i.off / 8..(i.off + i.len) / 8], i, &data);
                        ai[r][l] += 1;
                    }
                    if end[r].is_some() {
                        break;
                    }
                }
                let finished = (0..ord.lanes()).all(|l| ord.lane_done(l, &si[r], &ai[r]));
                if end[r].is_none() && finished {
                    end[r] = Some(End::Ok(bufs[r].clone()));
                    moved = true;
                }
            }
            if end.iter().all(Option::is_some) {
                return end.into_iter().flatten().collect();
            }
            assert!(
                moved,
                "plans deadlock (views {views:?}, links of {cap} frames): sent {si:?}, applied {ai:?}"
            );
        }
    }

    #[test]
    fn frames_cover_the_range_in_order() {
        let f: Vec<_> = frames(10, 4).collect();
        assert_eq!(f, vec![(0, 0..4), (1, 4..8), (2, 8..10)]);
        assert_eq!(frames(0, 4).collect::<Vec<_>>(), vec![(0, 0..0)]);
        assert_eq!(segment_bytes(10, 4), 8);
        assert_eq!(segment_bytes(3, 4), 4);
    }

    #[test]
    fn algorithm_codes_round_trip() {
        for a in [
            Algorithm::Ring,
            Algorithm::RecursiveDoubling,
            Algorithm::Chain,
            Algorithm::Direct,
            Algorithm::Rabenseifner,
            Algorithm::Tree,
            Algorithm::Hierarchical,
        ] {
            assert_eq!(Algorithm::from_code(a.code()), Some(a));
        }
        assert_eq!(Algorithm::from_code(9), None);
    }
}
