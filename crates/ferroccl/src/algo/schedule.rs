//! Pure ring arithmetic: which chunk moves at which step, and how chunks are cut into
//! segments. No I/O lives here, so every rule is property-tested in isolation.
//!
//! The ring all-reduce is one loop of `2(n-1)` steps. At step `t` rank `r` sends chunk
//! `(r - t - 1) mod n` to its right neighbour and receives chunk `(r - t - 2) mod n` from
//! its left. For `t < n-1` the received chunk is reduced into the local one
//! (reduce-scatter); after step `n-2` rank `r` owns the fully reduced chunk `r`, as
//! NCCL's reduce-scatter defines it; for `t >= n-1` the received chunk is copied
//! (all-gather, which starts by sending chunk `r`). The chunk sent at step `t` is always
//! the one received at step `t-1`, which is what lets segments stream through: segment
//! `j` of step `t` can leave as soon as segment `j` of step `t-1` has arrived.
//!
//! Reduce-scatter is steps `0..n-1` of this schedule, all-gather steps `n-1..2(n-1)`,
//! all-reduce both: one schedule, one implementation. Chunks are given as a table, so
//! the same plan serves per-rank counts (`all_gatherv`, `reduce_scatterv`).

use std::ops::Range;

/// The rank before `rank` on the ring of `n` (data arrives from it).
pub fn left(rank: usize, n: usize) -> usize {
    (rank + n - 1) % n
}

/// The rank after `rank` on the ring of `n` (data goes to it).
pub fn right(rank: usize, n: usize) -> usize {
    (rank + 1) % n
}

/// The elements of chunk `c` when `count` elements are split over `n` ranks: the first
/// `count % n` chunks get one element more, so sizes differ by at most one.
pub fn chunk_range(count: usize, n: usize, c: usize) -> Range<usize> {
    assert!(n > 0 && c < n, "chunk_range: chunk {c} of {n}");
    let base = count / n;
    let rem = count % n;
    let start = c * base + c.min(rem);
    let len = base + usize::from(c < rem);
    start..start + len
}

/// Number of ring steps of an all-reduce over `n` ranks: `2(n-1)`.
pub fn allreduce_steps(n: usize) -> usize {
    2 * n.saturating_sub(1)
}

/// The chunk rank `rank` sends at step `t` of the ring.
pub fn send_chunk(n: usize, rank: usize, t: usize) -> usize {
    (rank + n * (t / n + 2) - t - 1) % n
}

/// The chunk rank `rank` receives at step `t` of the ring.
pub fn recv_chunk(n: usize, rank: usize, t: usize) -> usize {
    (rank + n * (t / n + 2) - t - 2) % n
}

/// The chunk rank `rank` holds fully reduced after the reduce-scatter half: its own.
#[cfg(test)]
pub fn owned_chunk(_n: usize, rank: usize) -> usize {
    rank
}

/// `count` elements split over `n` ranks as evenly as possible ([`chunk_range`]).
pub fn balanced_chunks(count: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|c| chunk_range(count, n, c)).collect()
}

/// Consecutive chunks of the given sizes (per-rank counts of the `v` collectives).
pub fn chunks_from_counts(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

/// Number of segments a chunk of `len` elements is cut into, with at most `seg_elems`
/// elements per segment. An empty chunk still has one (empty) segment, so every step
/// exchanges at least one frame and a peer's fingerprint is always seen.
pub fn segments(len: usize, seg_elems: usize) -> usize {
    assert!(seg_elems > 0);
    len.div_ceil(seg_elems).max(1)
}

/// Elements of segment `j` within a chunk spanning `chunk` (absolute element indices).
pub fn segment_range(chunk: &Range<usize>, seg_elems: usize, j: usize) -> Range<usize> {
    let start = (chunk.start + j * seg_elems).min(chunk.end);
    let end = (start + seg_elems).min(chunk.end);
    start..end
}

/// Smallest segment [`pipeline_segment`] picks on its own (64 KiB): below it, per-frame
/// costs outweigh what pipelining hides.
pub const MIN_AUTO_SEGMENT_BYTES: usize = 64 << 10;

/// Elements per segment for chunks of at most `chunk_elems` elements of `esize` bytes,
/// with `max_bytes` the configured segment size. A chunk travels as at least two
/// segments when that keeps segments at or above [`MIN_AUTO_SEGMENT_BYTES`], so the
/// second half is in flight while the first is reduced and forwarded; `max_bytes` is
/// always the upper bound (and is used as is when it is below the minimum).
pub fn pipeline_segment(chunk_elems: usize, esize: usize, max_bytes: usize) -> usize {
    let half = (chunk_elems * esize).div_ceil(2);
    let bytes = half.max(MIN_AUTO_SEGMENT_BYTES).min(max_bytes);
    (bytes / esize).max(1)
}

/// One frame of the ring all-reduce from one rank's point of view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Ring step, `0..2(n-1)`.
    pub step: usize,
    /// Segment index within the step's chunk.
    pub seg: usize,
    /// Chunk index.
    pub chunk: usize,
    /// Element range in the buffer.
    pub elems: Range<usize>,
}

/// The ordered list of frames rank `rank` sends (`sending = true`) or receives in a
/// ring all-reduce of `count` elements with segments of at most `seg_elems` elements.
/// Both lists are in the order frames travel on the link.
#[cfg(test)]
pub fn allreduce_plan(
    count: usize,
    n: usize,
    rank: usize,
    seg_elems: usize,
    sending: bool,
) -> Vec<Transfer> {
    ring_plan(
        &balanced_chunks(count, n),
        rank,
        0..allreduce_steps(n),
        seg_elems,
        sending,
    )
}

/// The frames of steps `steps` of the ring over chunk table `chunks` (one chunk per
/// rank), in link order, from rank `rank`'s side: what it sends, or what it receives.
pub fn ring_plan(
    chunks: &[Range<usize>],
    rank: usize,
    steps: Range<usize>,
    seg_elems: usize,
    sending: bool,
) -> Vec<Transfer> {
    let n = chunks.len();
    let mut out = Vec::new();
    for step in steps {
        let chunk = if sending {
            send_chunk(n, rank, step)
        } else {
            recv_chunk(n, rank, step)
        };
        let range = chunks[chunk].clone();
        for seg in 0..segments(range.len(), seg_elems) {
            out.push(Transfer {
                step,
                seg,
                chunk,
                elems: segment_range(&range, seg_elems, seg),
            });
        }
    }
    out
}

/// Payload elements rank `rank` sends in a ring all-reduce of `count` elements: the sum
/// of the sizes of the chunks it sends, `2(n-1)/n · count` up to one element per chunk.
#[cfg(test)]
pub fn allreduce_send_elems(count: usize, n: usize, rank: usize) -> usize {
    (0..allreduce_steps(n))
        .map(|t| chunk_range(count, n, send_chunk(n, rank, t)).len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_tile_the_buffer(count in 0usize..10_000, n in 1usize..40) {
            let mut next = 0;
            for c in 0..n {
                let r = chunk_range(count, n, c);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() == count / n || r.len() == count / n + 1);
                next = r.end;
            }
            prop_assert_eq!(next, count);
        }

        #[test]
        fn neighbours_agree(n in 1usize..33, r in 0usize..32, t in 0usize..64) {
            let r = r % n;
            let left = left(r, n);
            prop_assert_eq!(right(left, n), r);
            // What I receive at step t is what my left neighbour sends at step t.
            prop_assert_eq!(recv_chunk(n, r, t), send_chunk(n, left, t));
            // What I send at step t+1 is what I received at step t.
            prop_assert_eq!(send_chunk(n, r, t + 1), recv_chunk(n, r, t));
        }

        #[test]
        fn reduce_scatter_visits_every_rank_once(n in 1usize..33, c in 0usize..32) {
            // Follow chunk c through the reduce-scatter half: the ranks that send it, plus
            // the final owner, are all n ranks exactly once.
            let c = c % n;
            let mut seen = vec![0u32; n];
            for t in 0..n.saturating_sub(1) {
                for (r, s) in seen.iter_mut().enumerate() {
                    if send_chunk(n, r, t) == c { *s += 1; }
                }
            }
            let owner = (0..n).find(|&r| owned_chunk(n, r) == c).unwrap();
            seen[owner] += 1;
            prop_assert!(seen.iter().all(|&s| s == 1), "{:?}", seen);
            // The owner received c at the last reduce-scatter step (n >= 2).
            if n >= 2 { prop_assert_eq!(recv_chunk(n, owner, n - 2), c); }
        }

        #[test]
        fn plan_segments_cover_each_chunk(count in 0usize..5000, n in 1usize..9, seg in 1usize..700, r in 0usize..8) {
            let r = r % n;
            for sending in [true, false] {
                let plan = allreduce_plan(count, n, r, seg, sending);
                for step in 0..allreduce_steps(n) {
                    let frames: Vec<_> = plan.iter().filter(|f| f.step == step).collect();
                    let chunk = frames[0].chunk;
                    let range = chunk_range(count, n, chunk);
                    let mut next = range.start;
                    for (j, f) in frames.iter().enumerate() {
                        prop_assert_eq!(f.seg, j);
                        prop_assert_eq!(f.elems.start, next);
                        prop_assert!(f.elems.len() <= seg);
                        next = f.elems.end;
                    }
                    prop_assert_eq!(next, range.end);
                }
            }
            // The sender's plan and its right neighbour's receive plan are the same frames.
            let right = right(r, n);
            let sent: Vec<_> = allreduce_plan(count, n, r, seg, true).into_iter().map(|f| (f.step, f.seg, f.elems)).collect();
            let got: Vec<_> = allreduce_plan(count, n, right, seg, false).into_iter().map(|f| (f.step, f.seg, f.elems)).collect();
            prop_assert_eq!(sent, got);
        }

        #[test]
        fn send_volume_is_the_ring_law(count in 0usize..100_000, n in 1usize..17, r in 0usize..16) {
            let r = r % n;
            let sent = allreduce_send_elems(count, n, r);
            // 2(n-1)/n · count, within one element per chunk sent.
            let law = 2.0 * (n as f64 - 1.0) / n as f64 * count as f64;
            prop_assert!((sent as f64 - law).abs() <= allreduce_steps(n) as f64, "sent {} law {}", sent, law);
            if count % n == 0 { prop_assert_eq!(sent as f64, law); }
        }
    }

    #[test]
    fn large_chunks_are_cut_in_two_small_ones_are_not() {
        // 1 MiB over 2 ranks: 512 KiB chunks travel as two 256 KiB segments.
        assert_eq!(pipeline_segment(131_072, 4, 512 << 10), 65_536);
        // Huge chunks: the configured size caps the segment.
        assert_eq!(pipeline_segment(1 << 24, 4, 512 << 10), 131_072);
        // Small chunks stay whole (one 64 KiB-or-less segment).
        assert_eq!(segments(10_000, pipeline_segment(10_000, 4, 512 << 10)), 1);
        // A small configured size is honoured as is.
        assert_eq!(pipeline_segment(1 << 20, 2, 6), 3);
    }

    proptest! {
        #[test]
        fn pipeline_segment_is_within_bounds(chunk in 0usize..1 << 26, es in prop::sample::select(vec![1usize, 2, 4, 8]), max in 1usize..1 << 22) {
            let seg = pipeline_segment(chunk, es, max);
            prop_assert!(seg >= 1);
            prop_assert!(seg * es <= max.max(es));
            // Two segments at most per chunk unless the cap forces more.
            if max >= MIN_AUTO_SEGMENT_BYTES && chunk * es >= 2 * MIN_AUTO_SEGMENT_BYTES {
                prop_assert!(segments(chunk, seg) >= 2);
            }
        }
    }

    #[test]
    fn world_of_one_has_no_steps() {
        assert_eq!(allreduce_steps(1), 0);
        assert!(allreduce_plan(10, 1, 0, 4, true).is_empty());
        assert_eq!(chunk_range(10, 1, 0), 0..10);
    }

    #[test]
    fn empty_chunks_still_have_one_frame() {
        // 2 elements over 4 ranks: chunks 2 and 3 are empty.
        assert_eq!(chunk_range(2, 4, 3), 2..2);
        assert_eq!(segments(0, 8), 1);
        let plan = allreduce_plan(2, 4, 0, 8, true);
        assert_eq!(plan.len(), 6);
    }
}
