//! Hierarchical all-reduce for a job of `H` hosts with `k` ranks each: the ring's
//! pieces composed so that the slow links between hosts carry `2(H-1)/H·S` per host
//! instead of the flat ring's `2(N-1)/N·S` (host-major order).
//!
//! 1. Within each host, a ring reduce-scatter over the `k` local ranks: local rank `i`
//!    ends with chunk `i` (of `k` balanced chunks) reduced over its host.
//! 2. `k` rings between hosts, one per local index: ring `i` joins local rank `i` of
//!    every host (in host order) and all-reduces chunk `i` (cut into `H` sub-chunks),
//!    so each host sends `k · 2(H-1)/H · S/k` between hosts.
//! 3. Within each host, a ring all-gather of the `k` finished chunks.
//!
//! Every element is combined in one fixed order (the local ring's, then the host
//! ring's) at one rank, and every other rank receives those bytes as they are, so the
//! result is bitwise identical on every rank. Only the host ring's reduce-scatter
//! finishes the bytes (Avg divides there); with one host, the local reduce-scatter
//! does. Steps are numbered consecutively across the three phases (local ring steps
//! `0..k-1`, then the host ring's `2(H-1)`, then the local all-gather's `k-1`).
//!
//! The phases are joined frame by frame: a host-ring send waits for the last local
//! reduction of its bytes, a local all-gather send for the host-ring receive that made
//! its bytes final, and an all-gather receive (which overwrites a chunk the local
//! reduce-scatter sent) for the last send of those bytes.
//!
//! The local phases and the host ring are two [`Lanes`]: an executor moves each lane's
//! frames in order but the lanes independently, so the local all-gather takes each
//! frame as soon as the host ring has finished its bytes, rather than after the host
//! ring's last frame. (One list of frames for both, however interleaved, couples the
//! host rings of a host: a rank whose list puts a local frame first waits for the
//! slowest ring there, and its own ring's frames wait behind it. Tried with a shared
//! virtual-time order: 4 MiB on 2 × 2 emulated hosts went from 35 to 48 ms.)

use super::schedule::{self, balanced_chunks};
use super::{ring, In, Land, Lanes, Out, Plan};
use std::borrow::Cow;
use std::ops::Range;

/// Which ranks share a host: hosts in the order of their lowest rank, each host's
/// ranks ascending. The same on every rank when built from the same list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    hosts: Vec<Vec<usize>>,
}

impl HostLayout {
    /// The layout of ranks `0..host_of.len()` where rank `r` is on host `host_of[r]`
    /// (any labels: equal labels, one host).
    pub fn from_hosts<T: PartialEq>(host_of: &[T]) -> Self {
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        let mut labels: Vec<&T> = Vec::new();
        for (r, h) in host_of.iter().enumerate() {
            match labels.iter().position(|l| *l == h) {
                Some(i) => hosts[i].push(r),
                None => {
                    labels.push(h);
                    hosts.push(vec![r]);
                }
            }
        }
        HostLayout { hosts }
    }

    /// Every rank on its own host (what a job without host identities is taken to be).
    pub fn flat(n: usize) -> Self {
        HostLayout {
            hosts: (0..n).map(|r| vec![r]).collect(),
        }
    }

    /// `hosts` hosts of `k` consecutive ranks each.
    pub fn blocks(hosts: usize, k: usize) -> Self {
        HostLayout {
            hosts: (0..hosts).map(|h| (h * k..(h + 1) * k).collect()).collect(),
        }
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.hosts.iter().map(Vec::len).sum()
    }

    /// The hosts' ranks, in host order.
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.hosts
    }

    /// `(hosts, ranks per host)` when every host has the same number of ranks (what
    /// the hierarchical plan needs); `None` otherwise.
    pub fn shape(&self) -> Option<(usize, usize)> {
        let k = self.hosts.first()?.len();
        self.hosts
            .iter()
            .all(|h| h.len() == k)
            .then_some((self.hosts.len(), k))
    }

    /// `(host, index among the host's ranks)` of `rank`.
    pub fn place(&self, rank: usize) -> Option<(usize, usize)> {
        self.hosts
            .iter()
            .enumerate()
            .find_map(|(h, rs)| rs.iter().position(|&r| r == rank).map(|i| (h, i)))
    }

    /// Whether `a` and `b` are on one host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        matches!((self.place(a), self.place(b)), (Some((x, _)), Some((y, _))) if x == y)
    }

    /// The peers `rank` exchanges frames with in the hierarchical plan: its local
    /// ring's neighbours and its host ring's (empty when the shape is uneven).
    pub fn peers(&self, rank: usize) -> Vec<usize> {
        let (Some((h, k)), Some((host, i))) = (self.shape(), self.place(rank)) else {
            return Vec::new();
        };
        let mut v = vec![
            self.hosts[host][schedule::left(i, k)],
            self.hosts[host][schedule::right(i, k)],
            self.hosts[schedule::left(host, h)][i],
            self.hosts[schedule::right(host, h)][i],
        ];
        v.retain(|&p| p != rank);
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The index of the last of `frames` (`(offset, length)` in bytes) that overlaps
/// `bytes`, if any.
fn last_overlap(
    frames: impl DoubleEndedIterator<Item = (usize, usize)> + ExactSizeIterator,
    bytes: Range<usize>,
) -> Option<usize> {
    frames
        .enumerate()
        .rfind(|(_, (off, len))| *off < bytes.end && bytes.start < off + len)
        .map(|(i, _)| i)
}

/// Appends `part` (a plan over ring positions) to `plan`: its peers mapped through
/// `members`, its steps moved by `step_base`. A send of `part` that depends on nothing
/// in `part` waits for the last receive of `plan` that changed its bytes (receives are
/// applied in order, so then all have); a receive that depends on nothing waits for
/// the last send of `plan` that read the bytes it changes. With `finish == false` its
/// reductions do not finish the bytes.
fn append(plan: &mut Plan, part: Plan, members: &[usize], step_base: usize, finish: bool) {
    let (outs0, ins0) = (plan.outs.len(), plan.ins.len());
    let step = |s: u32| s + step_base as u32;
    for mut o in part.outs {
        o.peer = members[o.peer];
        o.step = step(o.step);
        o.after_recv = match o.after_recv {
            Some(d) => Some(d + ins0),
            None => last_overlap(
                plan.ins[..ins0].iter().map(|i| (i.off, i.len)),
                o.off..o.off + o.len,
            ),
        };
        plan.outs.push(o);
    }
    for mut i in part.ins {
        i.peer = members[i.peer];
        i.step = step(i.step);
        i.after_send = match i.after_send {
            Some(d) => Some(d + outs0),
            None => last_overlap(plan.outs[..outs0].iter().map(|o| (o.off, o.len)), i.range()),
        };
        if let Land::Reduce { finish: f, .. } = &mut i.land {
            *f &= finish;
        }
        plan.ins.push(i);
    }
}

/// `layout`, or every rank on its own host where there is none (the hierarchical
/// plans always get one from [`super::select::Policy::runnable`]; the flat layout only
/// keeps a caller without one from failing).
pub(crate) fn or_flat(layout: Option<&HostLayout>, n: usize) -> Cow<'_, HostLayout> {
    layout.map_or_else(|| Cow::Owned(HostLayout::flat(n)), Cow::Borrowed)
}

/// The hierarchical all-reduce plan of `rank` over `layout` (which must have a
/// [`HostLayout::shape`]) for `count` elements of `esize` bytes, in frames of at most
/// `segment_bytes` (cut as the ring cuts them).
pub(crate) fn plan(
    rank: usize,
    layout: &HostLayout,
    count: usize,
    esize: usize,
    segment_bytes: usize,
) -> Plan {
    let Place {
        h,
        k,
        host,
        i,
        local,
        across,
    } = Place::of(layout, rank);
    let chunks = balanced_chunks(count, k);
    let seg_local = ring::seg_elems(&chunks, esize, segment_bytes);
    let mine: Range<usize> = chunks[i].clone();
    let sub: Vec<Range<usize>> = balanced_chunks(mine.len(), h)
        .into_iter()
        .map(|c| c.start + mine.start..c.end + mine.start)
        .collect();
    let seg_across = ring::seg_elems(&sub, esize, segment_bytes);

    // The order the host ring at this host needs the sub-chunks of a chunk reduced
    // here (the one it sends first, then each one as it receives it), and the order it
    // finishes them in. The local phases take a chunk's segments in those orders.
    let need: Vec<usize> = std::iter::once(schedule::send_chunk(h, host, 0))
        .chain((0..h.saturating_sub(1)).map(|s| schedule::recv_chunk(h, host, s)))
        .collect();
    let fin: Vec<usize> = (h.saturating_sub(2)..schedule::allreduce_steps(h))
        .map(|t| schedule::recv_chunk(h, host, t))
        .collect();

    let mut p = Plan::default();
    // 1. Local reduce-scatter: chunk i reduced over this host (final only if h == 1).
    let mut rs = ring::reduce_scatter(i, k, &chunks, esize, seg_local);
    if h > 1 {
        rs = in_sub_chunk_order(rs, k, i, &chunks, seg_local, h, &need);
    }
    append(&mut p, rs, local, 0, h == 1);
    let rs_end = (p.outs.len(), p.ins.len());
    // 2. The host ring of local index i all-reduces chunk i, each frame once its bytes
    //    are reduced here.
    let ar = ring::plan(
        host,
        h,
        &sub,
        esize,
        0..schedule::allreduce_steps(h),
        seg_across,
    );
    append(&mut p, ar, &across, k - 1, true);
    let hr_end = (p.outs.len(), p.ins.len());
    // 3. Local all-gather of the finished chunks, each frame of chunk i once its bytes
    //    are final here; its receives overwrite chunks the reduce-scatter sent.
    let mut ag = ring::all_gather(i, k, &chunks, esize, seg_local);
    if h > 1 {
        ag = in_sub_chunk_order(ag, k, i, &chunks, seg_local, h, &fin);
    }
    append(&mut p, ag, local, schedule::allreduce_steps(h), true);
    if h > 1 && k > 1 {
        p.lanes = Some(Box::new(lanes(&p, rs_end, hr_end)));
    }
    p
}

/// The hierarchical reduce-scatter over `chunks` (one element range per rank, in rank
/// order, any sizes) for `rank` on `layout` (which must have a
/// [`HostLayout::shape`]): within each host, for every host `g`, a local ring
/// reduce-scatter over `g`'s ranks' chunks, so local rank `i` holds chunk `(g, i)`
/// reduced over its host; then ring `i` between hosts reduce-scatters the chunks of
/// the ranks of local index `i`, leaving each rank its own chunk reduced over all.
/// Between hosts each host sends `(H-1)/H·S`, against the flat ring's `(N-1)/N·S`
/// across each host boundary; within a host each rank `(k-1)/k·S`. The local rings
/// run in the order the host ring needs their results, and in their own lane.
pub(crate) fn reduce_scatter(
    rank: usize,
    layout: &HostLayout,
    chunks: &[Range<usize>],
    esize: usize,
    segment_bytes: usize,
) -> Plan {
    let Place {
        h,
        k,
        host,
        i,
        local,
        across,
    } = Place::of(layout, rank);
    // Host blocks in the order the host ring needs them: the one it sends first, then
    // each one as it receives (and reduces) it; its own last.
    let need = std::iter::once(schedule::send_chunk(h, host, 0))
        .chain((0..h - 1).map(|s| schedule::recv_chunk(h, host, s)));
    let mut p = Plan::default();
    for (x, g) in need.enumerate() {
        let t = host_block(layout, chunks, g);
        let part = ring::reduce_scatter(i, k, &t, esize, ring::seg_elems(&t, esize, segment_bytes));
        append(&mut p, part, local, x * (k - 1), h == 1);
    }
    let local_end = (p.outs.len(), p.ins.len());
    let c = block_across(layout, chunks, i);
    let part = ring::reduce_scatter(
        host,
        h,
        &c,
        esize,
        ring::seg_elems(&c, esize, segment_bytes),
    );
    append(&mut p, part, &across, h * (k - 1), true);
    if h > 1 && k > 1 {
        p.lanes = Some(Box::new(lanes(&p, local_end, (p.outs.len(), p.ins.len()))));
    }
    p
}

/// The hierarchical all-gather over `chunks` (see [`reduce_scatter`]): ring `i`
/// between hosts gathers the chunks of the ranks of local index `i`, then within each
/// host a local ring all-gather per host block, each block as soon as the host ring
/// has brought it (this host's own first), in its own lane.
pub(crate) fn all_gather(
    rank: usize,
    layout: &HostLayout,
    chunks: &[Range<usize>],
    esize: usize,
    segment_bytes: usize,
) -> Plan {
    let Place {
        h,
        k,
        host,
        i,
        local,
        across,
    } = Place::of(layout, rank);
    let mut p = Plan::default();
    let c = block_across(layout, chunks, i);
    let part = ring::all_gather(
        host,
        h,
        &c,
        esize,
        ring::seg_elems(&c, esize, segment_bytes),
    );
    append(&mut p, part, &across, 0, true);
    let host_end = (p.outs.len(), p.ins.len());
    // Host blocks in the order they arrive: this host's, then the host ring's receives.
    let arrive = std::iter::once(host)
        .chain((h - 1..schedule::allreduce_steps(h)).map(|t| schedule::recv_chunk(h, host, t)));
    for (x, g) in arrive.enumerate() {
        let t = host_block(layout, chunks, g);
        let part = ring::all_gather(i, k, &t, esize, ring::seg_elems(&t, esize, segment_bytes));
        append(
            &mut p,
            part,
            local,
            schedule::allreduce_steps(h) + x * (k - 1),
            true,
        );
    }
    if h > 1 && k > 1 {
        p.lanes = Some(Box::new(lanes_host_first(&p, host_end)));
    }
    p
}

/// Where a rank sits in a layout with a [`HostLayout::shape`].
struct Place<'a> {
    /// Hosts, and ranks per host.
    h: usize,
    k: usize,
    /// The rank's host and its index there.
    host: usize,
    i: usize,
    /// Its host's ranks (its local ring), and the ranks of local index `i` in host
    /// order (its host ring).
    local: &'a [usize],
    across: Vec<usize>,
}

impl<'a> Place<'a> {
    /// `rank`'s place in `layout`. Its callers hold the invariants it expects: the
    /// communicator keeps a host list only when it has one entry per rank (so every rank
    /// has a place) and refuses a layout without a shape with `Unavailable` before it
    /// plans (`Communicator::hierarchical_choice`); the simulator builds only shaped
    /// layouts (`sim::hierarchical_layout`).
    fn of(layout: &'a HostLayout, rank: usize) -> Self {
        let (h, k) = layout
            .shape()
            .expect("hierarchical plan: every host must have the same number of ranks");
        let (host, i) = layout
            .place(rank)
            .expect("hierarchical plan: the rank is in the layout");
        Place {
            h,
            k,
            host,
            i,
            local: &layout.hosts[host],
            across: layout.hosts.iter().map(|rs| rs[i]).collect(),
        }
    }
}

/// The chunks of host `g`'s ranks, in local order: a local ring's table.
fn host_block(layout: &HostLayout, chunks: &[Range<usize>], g: usize) -> Vec<Range<usize>> {
    layout.hosts[g].iter().map(|&r| chunks[r].clone()).collect()
}

/// The chunks of the ranks of local index `i`, in host order: the host ring's table.
fn block_across(layout: &HostLayout, chunks: &[Range<usize>], i: usize) -> Vec<Range<usize>> {
    layout
        .hosts
        .iter()
        .map(|rs| chunks[rs[i]].clone())
        .collect()
}

/// Lanes of a plan whose host ring comes first (`..host_end`, sends and receives) and
/// local rings after: the host ring in lane 1, the local rings in lane 0. The local
/// rings receive only chunks of other local indices, which the host ring never
/// touches, so no receive needs an `after_in`.
fn lanes_host_first(p: &Plan, host_end: (usize, usize)) -> Lanes {
    Lanes {
        outs: (0..p.outs.len())
            .map(|x| u8::from(x < host_end.0))
            .collect(),
        ins: (0..p.ins.len()).map(|x| u8::from(x < host_end.1)).collect(),
        after_in: vec![None; p.ins.len()],
    }
}

/// `part` (steps of the local ring of `k` over `chunks`, for local index `i`,
/// each step's frames one segment of one chunk, in segment order) with each step's
/// segments in the order of `subs`: by the sub-chunk (of `h` per chunk) holding the
/// segment's first element, in the order `subs` lists them, then by position. So the
/// local reduce-scatter finishes first what the host ring sends first, and the local
/// all-gather forwards segments in the order the host ring finishes them (segment
/// order would stall its lane on one host in two). The ring's dependencies link the
/// same segment of consecutive steps, and both ends of a link reorder alike, so the
/// steps stay in order and every dependency still points to an earlier frame.
#[allow(clippy::too_many_arguments)]
fn in_sub_chunk_order(
    part: Plan,
    k: usize,
    i: usize,
    chunks: &[Range<usize>],
    seg_local: usize,
    h: usize,
    subs: &[usize],
) -> Plan {
    let mut rank_of = vec![0; h];
    for (at, &q) in subs.iter().enumerate() {
        rank_of[q] = at;
    }
    // The new order of one step's frames (their segment indices) on chunk `c`.
    let perm = |c: usize, segs: &[u32]| -> Vec<usize> {
        let chunk = &chunks[c];
        let sub = balanced_chunks(chunk.len(), h);
        let sub_of = |j: u32| {
            let e = (j as usize * seg_local).min(chunk.len().saturating_sub(1));
            sub.iter().position(|q| q.contains(&e)).unwrap_or(0)
        };
        let mut order: Vec<usize> = (0..segs.len()).collect();
        order.sort_by_key(|&x| (rank_of[sub_of(segs[x])], segs[x]));
        order
    };
    // New position of every frame, list by list; steps are contiguous runs.
    let reorder = |steps: Vec<(u32, u32)>, chunk_of: &dyn Fn(usize) -> usize| {
        let mut place = vec![0; steps.len()];
        let mut at = 0;
        while at < steps.len() {
            let step = steps[at].0;
            let end = at + steps[at..].iter().take_while(|f| f.0 == step).count();
            let segs: Vec<u32> = steps[at..end].iter().map(|f| f.1).collect();
            for (new, old) in perm(chunk_of(step as usize), &segs).into_iter().enumerate() {
                place[at + old] = at + new;
            }
            at = end;
        }
        place
    };
    let out_place = reorder(part.outs.iter().map(|o| (o.step, o.seg)).collect(), &|t| {
        schedule::send_chunk(k, i, t)
    });
    let in_place = reorder(part.ins.iter().map(|f| (f.step, f.seg)).collect(), &|t| {
        schedule::recv_chunk(k, i, t)
    });
    // Each frame to its new place, its dependency renumbered alike.
    let mut outs: Vec<(usize, Out)> = part
        .outs
        .into_iter()
        .enumerate()
        .map(|(old, o)| {
            let after_recv = o.after_recv.map(|d| in_place[d]);
            (out_place[old], Out { after_recv, ..o })
        })
        .collect();
    let mut ins: Vec<(usize, In)> = part
        .ins
        .into_iter()
        .enumerate()
        .map(|(old, f)| {
            let after_send = f.after_send.map(|d| out_place[d]);
            (in_place[old], In { after_send, ..f })
        })
        .collect();
    outs.sort_unstable_by_key(|x| x.0);
    ins.sort_unstable_by_key(|x| x.0);
    Plan {
        outs: outs.into_iter().map(|x| x.1).collect(),
        ins: ins.into_iter().map(|x| x.1).collect(),
        lanes: None,
        counts: None,
    }
}

/// Two lanes for the plan `p` whose host ring's frames are `rs_end..hr_end` (sends,
/// receives): the local phases (lane 0) and the host ring (lane 1), so the local
/// all-gather takes each frame as soon as the host ring has finished its bytes, and the
/// host ring's sends never wait behind a local one. A host-ring receive combines into
/// bytes the local reduce-scatter reduced: it is applied after the last local receive
/// on them (`after_in`), so every element is still combined in one order. The local
/// all-gather writes chunks other than this rank's, which the host ring never touches,
/// so its receives need no `after_in`.
fn lanes(p: &Plan, rs_end: (usize, usize), hr_end: (usize, usize)) -> Lanes {
    let lane = |x: usize, lo: usize, hi: usize| u8::from((lo..hi).contains(&x));
    let after_in = (0..p.ins.len())
        .map(|x| {
            if !(rs_end.1..hr_end.1).contains(&x) {
                return None;
            }
            last_overlap(
                p.ins[..rs_end.1].iter().map(|i| (i.off, i.len)),
                p.ins[x].range(),
            )
        })
        .collect();
    Lanes {
        outs: (0..p.outs.len())
            .map(|x| lane(x, rs_end.0, hr_end.0))
            .collect(),
        ins: (0..p.ins.len())
            .map(|x| lane(x, rs_end.1, hr_end.1))
            .collect(),
        after_in,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::check_all_reduce;
    use super::*;

    fn plans(layout: &HostLayout, count: usize, seg: usize) -> Vec<Plan> {
        (0..layout.world_size())
            .map(|r| plan(r, layout, count, 8, seg))
            .collect()
    }

    /// Layouts of `h` hosts of `k` ranks: consecutive, and interleaved (rank r on host
    /// r % h), so that host order and rank order differ.
    fn layouts(h: usize, k: usize) -> Vec<HostLayout> {
        let n = h * k;
        let inter: Vec<usize> = (0..n).map(|r| r % h).collect();
        vec![HostLayout::blocks(h, k), HostLayout::from_hosts(&inter)]
    }

    #[test]
    fn plans_fit_and_sum_for_every_layout_and_uneven_counts() {
        for h in 1..=4 {
            for k in 1..=4 {
                let n = h * k;
                for layout in layouts(h, k) {
                    for count in [0, 1, 3, n, 2 * n + 1, 37, 64] {
                        for seg in [8, 16, 8000] {
                            let ps = plans(&layout, count, seg);
                            let what = format!("{h}x{k} {layout:?} count={count} seg={seg}");
                            check_all_reduce(&ps, count, &what);
                            // Every element is made final exactly once on every rank
                            // (Avg divides there once; the pull executor writes then).
                            for (r, p) in ps.iter().enumerate() {
                                let mut fin = vec![0u32; count];
                                for i in p.ins.iter().filter(|i| i.is_final()) {
                                    for c in &mut fin[i.off / 8..(i.off + i.len) / 8] {
                                        *c += 1;
                                    }
                                }
                                let once = if n > 1 { 1 } else { 0 };
                                assert!(
                                    fin.iter().all(|&c| c == once),
                                    "{h}x{k} count={count} rank {r}: {fin:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn halves_compute_their_part_for_every_layout_and_uneven_counts() {
        use super::super::tests::{check_hazards, check_plans, simulate_links};
        for h in 1..=4 {
            for k in 1..=4 {
                let n = h * k;
                for layout in layouts(h, k) {
                    for counts in [
                        vec![3; n],
                        (0..n).map(|r| (r * 7) % 5).collect(),
                        vec![0; n],
                    ] {
                        let chunks = schedule::chunks_from_counts(&counts);
                        let total: usize = counts.iter().sum();
                        for seg in [8, 16, 8000] {
                            let what = format!("{h}x{k} {layout:?} counts={counts:?} seg={seg}");
                            let rs: Vec<Plan> = (0..n)
                                .map(|r| reduce_scatter(r, &layout, &chunks, 8, seg))
                                .collect();
                            let ag: Vec<Plan> = (0..n)
                                .map(|r| all_gather(r, &layout, &chunks, 8, seg))
                                .collect();
                            check_plans(&rs);
                            check_plans(&ag);
                            for (r, (a, b)) in rs.iter().zip(&ag).enumerate() {
                                check_hazards(a, &format!("{what} rs rank {r}"));
                                check_hazards(b, &format!("{what} ag rank {r}"));
                            }
                            let inputs: Vec<Vec<f64>> = (0..n)
                                .map(|r| (0..total).map(|i| (r * 1000 + i) as f64).collect())
                                .collect();
                            let mine: Vec<Vec<f64>> = (0..n)
                                .map(|r| {
                                    (0..total)
                                        .map(|i| {
                                            if chunks[r].contains(&i) {
                                                i as f64
                                            } else {
                                                -1.0
                                            }
                                        })
                                        .collect()
                                })
                                .collect();
                            for cap in [usize::MAX, 0, 1] {
                                let out = simulate_links(&rs, inputs.clone(), cap);
                                for (r, b) in out.iter().enumerate() {
                                    for i in chunks[r].clone() {
                                        let want: f64 = (0..n).map(|q| (q * 1000 + i) as f64).sum();
                                        assert_eq!(
                                            b[i], want,
                                            "{what} cap={cap} rank {r} element {i}"
                                        );
                                    }
                                }
                                for b in simulate_links(&ag, mine.clone(), cap) {
                                    let want: Vec<f64> = (0..total).map(|i| i as f64).collect();
                                    assert_eq!(b, want, "{what} cap={cap}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn halves_send_their_law_per_link_class() {
        // Reduce-scatter and all-gather each: (k-1)/k·S per rank within a host, and
        // (H-1)/H·S per host between hosts (chunks all equal).
        for h in 1..=4 {
            for k in 1..=4 {
                let n = h * k;
                let layout = HostLayout::blocks(h, k);
                let chunks = schedule::chunks_from_counts(&vec![6; n]);
                let s = 6 * n * 8;
                for half in 0..2 {
                    let ps: Vec<Plan> = (0..n)
                        .map(|r| {
                            if half == 0 {
                                reduce_scatter(r, &layout, &chunks, 8, 24)
                            } else {
                                all_gather(r, &layout, &chunks, 8, 24)
                            }
                        })
                        .collect();
                    for ranks in layout.hosts() {
                        let mut between = 0;
                        for &r in ranks {
                            let (within, across): (Vec<_>, Vec<_>) =
                                ps[r].outs.iter().partition(|o| layout.same_host(r, o.peer));
                            assert_eq!(
                                within.iter().map(|o| o.len).sum::<usize>(),
                                (k - 1) * s / k
                            );
                            between += across.iter().map(|o| o.len).sum::<usize>();
                        }
                        assert_eq!(between, (h - 1) * s / h, "{h}x{k} half {half}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_element_is_combined_in_one_order() {
        // Over all ranks, every element is combined n-1 times: each contribution is
        // folded in once (h·(k-1) times within hosts, h-1 between), and every other
        // receive of it is a copy of the finished bytes.
        for (h, k) in [(2, 2), (3, 2), (2, 3), (4, 4)] {
            let layout = HostLayout::blocks(h, k);
            let count = 50;
            let ps = plans(&layout, count, 16);
            let mut reduced = vec![0usize; count];
            for p in &ps {
                for i in p
                    .ins
                    .iter()
                    .filter(|i| matches!(i.land, Land::Reduce { .. }))
                {
                    for c in &mut reduced[i.off / 8..(i.off + i.len) / 8] {
                        *c += 1;
                    }
                }
            }
            // A combining receive folds one more contribution in: n-1 per element.
            assert!(
                reduced.iter().all(|&c| c == h * k - 1),
                "{h}x{k}: {reduced:?}"
            );
        }
    }

    #[test]
    fn hosts_send_the_hierarchical_law_between_hosts() {
        // Between hosts, per host: 2(H-1)/H·S; within a host, per rank: 2(k-1)/k·S
        // (counts divisible by h·k, so every chunk is equal).
        for h in 1..=4 {
            for k in 1..=4 {
                let layout = HostLayout::blocks(h, k);
                let count = 12 * h * k;
                let s = count * 8;
                let ps = plans(&layout, count, 24);
                for (host, ranks) in layout.hosts().iter().enumerate() {
                    let mut between = 0;
                    for &r in ranks {
                        let within: usize = ps[r]
                            .outs
                            .iter()
                            .filter(|o| layout.same_host(r, o.peer))
                            .map(|o| o.len)
                            .sum();
                        assert_eq!(within, 2 * (k - 1) * s / k, "{h}x{k} rank {r}");
                        between += ps[r]
                            .outs
                            .iter()
                            .filter(|o| !layout.same_host(r, o.peer))
                            .map(|o| o.len)
                            .sum::<usize>();
                    }
                    assert_eq!(between, 2 * (h - 1) * s / h, "{h}x{k} host {host}");
                }
            }
        }
    }

    #[test]
    fn local_phases_take_segments_in_the_order_the_host_ring_needs_and_finishes_them() {
        // 2 hosts x 2 ranks, 32 elements: chunks of 16 in 4 local segments, 2 per
        // sub-chunk. Host 0's host ring sends sub-chunk 1 first and finishes sub-chunk
        // 0 first; host 1's the other way round.
        let layout = HostLayout::blocks(2, 2);
        let segs = |p: &Plan, local: usize, outs: bool| -> Vec<u32> {
            if outs {
                let v: Vec<_> = p.outs.iter().filter(|o| o.peer == local).collect();
                v.iter().map(|o| o.seg).collect()
            } else {
                let v: Vec<_> = p.ins.iter().filter(|i| i.peer == local).collect();
                v.iter().map(|i| i.seg).collect()
            }
        };
        let p0 = plan(0, &layout, 32, 8, 32);
        let p2 = plan(2, &layout, 32, 8, 32);
        // Reduce-scatter receives (chunk 0), then all-gather sends (chunk 0).
        assert_eq!(segs(&p0, 1, false)[..4], [2, 3, 0, 1]);
        assert_eq!(segs(&p0, 1, true)[4..], [0, 1, 2, 3]);
        assert_eq!(segs(&p2, 3, false)[..4], [0, 1, 2, 3]);
        assert_eq!(segs(&p2, 3, true)[4..], [2, 3, 0, 1]);
    }

    #[test]
    fn layouts_group_ranks_by_host_label() {
        let l = HostLayout::from_hosts(&["b", "a", "b", "a"]);
        assert_eq!(l.hosts(), &[vec![0, 2], vec![1, 3]]);
        assert_eq!(l.shape(), Some((2, 2)));
        assert_eq!(l.place(3), Some((1, 1)));
        assert!(l.same_host(0, 2) && !l.same_host(0, 1));
        assert_eq!(l.peers(0), vec![1, 2]);
        assert_eq!(HostLayout::from_hosts(&[0, 0, 1]).shape(), None);
        assert_eq!(HostLayout::flat(3).shape(), Some((3, 1)));
        assert_eq!(HostLayout::blocks(2, 3).peers(4), vec![1, 3, 5]);
    }
}
