//! The collectives on host memory: checks, fingerprints, plans, and the run.
//!
//! Each collective is built as a job (`job_*`): its arguments are checked on this rank
//! (a refusal poisons the communicator, so peers never wait for a rank that will not
//! come), it takes the next sequence number, and it captures its buffer and the plan
//! of the call. A blocking call runs the job at once; a [`super::Scope`] queues it.

use super::scope::{job_over, JobFn};
use super::Communicator;
use crate::algo::{
    self, all_reduce_plan, chain, doubling, hier, ring, schedule, tree, Algorithm, Plan,
};
use crate::engine::{Data, Engine, PullCall};
use crate::error::Result;
use crate::reduce::{DataType, Element, HostCombine, NoCombine, ReduceOp};
use crate::transport::{CallMem, Channel};
use crate::wire::{Fingerprint, OpKind};
use std::mem::size_of;
use std::ops::Range;

/// Runs the in-place collective `plan_of` on `b` (elements of `dtype`, combined with
/// `op` when it reduces): read from memory peers when the transport reads host
/// memory, streamed over the links otherwise. `plan_of(rank, pulled)` is any rank's
/// plan of the call, `pulled` asking for the shape the pull executor wants (whole
/// chunks instead of pipelining segments).
fn execute(
    e: &mut Engine,
    fp: &Fingerprint,
    pull: bool,
    plan_of: &dyn Fn(usize, bool) -> Plan,
    b: &mut [u8],
    dtype: DataType,
    op: Option<ReduceOp>,
) -> Result<()> {
    let n = e.world_size;
    if pull {
        let len = b.len();
        let addr = b.as_mut_ptr() as u64;
        let call = PullCall {
            mem: CallMem {
                space: 0,
                input: addr,
                input_len: len,
                output: addr,
                output_len: len,
                dtype,
                op,
                world_size: n,
            },
            bytes: len,
            input_at: 0,
            output_at: 0,
        };
        return e.pull(fp, &|q| plan_of(q, true), &call);
    }
    let plan = plan_of(e.rank, false);
    match op {
        Some(op) => e.stream(
            Channel::Collective,
            fp,
            &plan,
            Data::Write(b),
            &mut HostCombine {
                dtype,
                op,
                world_size: n,
            },
        ),
        None => e.stream(
            Channel::Collective,
            fp,
            &plan,
            Data::Write(b),
            &mut NoCombine,
        ),
    }
}

/// What a frame's fixed cost (its header, a system call, a wake-up) is worth in bytes
/// on the links a chain is cut for: about 5 µs at 12.5 GB/s.
const CHAIN_FRAME_COST_BYTES: f64 = 64.0 * 1024.0;

/// Segment bytes of a chain over `len` bytes on `n` ranks.
///
/// Cut in `k` segments of `g` bytes, a chain takes `k + n - 2` segment times plus `k`
/// frames' fixed cost `E`: `S/B + (n-2)·g/B + (S/g)·E/B`, least at
/// `g = sqrt(S·E/(n-2))` (with `E` = [`CHAIN_FRAME_COST_BYTES`]), kept between 64 KiB
/// (`MIN_AUTO_SEGMENT_BYTES`, the auto-sized segments' floor elsewhere too; or the
/// configured segment, if smaller) and the configured segment. Two ranks have
/// no rank in between to fill, and take the configured segment. With the configured
/// 512 KiB alone, a 1 MiB broadcast over 8 ranks was 2 segments taking 8 segment
/// times, 4x `S/B`; this cuts it in 10 (1.6x). Pulled, it is `n` segments, so that the
/// chain is `n` deep.
pub(super) fn chain_segment(
    pulled: bool,
    len: usize,
    n: usize,
    esize: usize,
    configured: usize,
) -> usize {
    if pulled {
        return algo::segment_bytes(len.div_ceil(n).max(esize), esize);
    }
    if n <= 2 {
        return algo::segment_bytes(configured, esize);
    }
    let best = (len as f64 * CHAIN_FRAME_COST_BYTES / (n - 2) as f64).sqrt();
    let floor = algo::schedule::MIN_AUTO_SEGMENT_BYTES.min(configured);
    // Whole elements in `k` even segments, none above the configured segment nor below
    // the floor; of the counts around the continuous optimum, the one the model
    // prefers (the floor can leave a short last segment).
    let es = esize.max(1);
    let elems = len.div_ceil(es);
    let fewest = elems.div_ceil((configured / es).max(1)).max(1);
    let segment =
        |k: usize| (elems.div_ceil(k.max(fewest)) * es).clamp(floor, configured.max(floor));
    let x = len as f64 / best;
    let at_floor = len / floor.max(1);
    [
        x.floor() as usize,
        x.ceil() as usize,
        fewest,
        at_floor,
        at_floor + 1,
    ]
    .into_iter()
    .map(segment)
    .min_by(|&a, &b| chain_cost(len, n, a).total_cmp(&chain_cost(len, n, b)))
    .map_or(configured, |g| algo::segment_bytes(g, esize))
}

/// A chain's time under the model [`chain_segment`] minimises, in byte-times: `k`
/// segments of `g` bytes over `n` ranks take `k + n - 2` segment times plus `k` frames'
/// fixed cost.
fn chain_cost(len: usize, n: usize, g: usize) -> f64 {
    let k = len.div_ceil(g.max(1)) as f64;
    (k + n as f64 - 2.0) * g as f64 + k * CHAIN_FRAME_COST_BYTES
}

impl Communicator {
    // ---- job builders: validate, fingerprint, and capture the buffers ----
    //
    // SAFETY contract of every `job_*`: the returned job dereferences the given
    // buffers; the caller must keep them alive and untouched until the job has run
    // (`run_now` blocks; a `Scope` and a `Pending` wait for their jobs).

    pub(super) fn job_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        let (algo, layout) = self.all_reduce_choice(std::mem::size_of_val(buf))?;
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None, algo);
        let (n, seg, pull) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            self.host_pull,
        );
        let (count, es) = (buf.len(), size_of::<T>());
        Ok(job_over(buf, move |e, b| {
            let plan_of = move |q: usize, pulled: bool| {
                if pulled {
                    ring::all_reduce(q, n, count, es, count.max(1))
                } else {
                    all_reduce_plan(algo, q, n, count, es, seg, &layout)
                }
            };
            execute(e, &fp, pull, &plan_of, b, T::DTYPE, Some(op))
        }))
    }

    /// Reduce-scatter in place over `chunks` (element ranges of `buf`, one per rank).
    pub(super) fn job_reduce_scatter<T: Element>(
        &self,
        buf: &mut [T],
        chunks: Vec<Range<usize>>,
        op: ReduceOp,
    ) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        self.job_ring_half(buf, chunks, Some(op))
    }

    /// All-gather in place over `chunks`.
    pub(super) fn job_all_gather<T: Element>(
        &self,
        buf: &mut [T],
        chunks: Vec<Range<usize>>,
    ) -> Result<JobFn> {
        self.job_ring_half(buf, chunks, None)
    }

    /// One half of the ring over `chunks`: the reduce-scatter half when `op` is given,
    /// the all-gather half otherwise.
    fn job_ring_half<T: Element>(
        &self,
        buf: &mut [T],
        chunks: Vec<Range<usize>>,
        op: Option<ReduceOp>,
    ) -> Result<JobFn> {
        let (kind, what) = if op.is_some() {
            (OpKind::ReduceScatter, "hierarchical reduce-scatter")
        } else {
            (OpKind::AllGather, "hierarchical all-gather")
        };
        let (algo, layout) = self.hierarchical_choice(self.reduce_scatter_algorithm(), what)?;
        let fp = self.fingerprint(kind, T::DTYPE, op, buf.len(), None, algo);
        let (n, seg, pull, es) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            self.host_pull,
            size_of::<T>(),
        );
        Ok(job_over(buf, move |e, b| {
            let whole = chunks.iter().map(|c| c.len()).max().unwrap_or(0).max(1);
            let plan_of = |q: usize, pulled: bool| {
                let s = if pulled {
                    whole
                } else {
                    ring::seg_elems(&chunks, es, seg)
                };
                match (algo, op.is_some()) {
                    (Algorithm::Hierarchical, true) if !pulled => {
                        hier::reduce_scatter(q, &layout, &chunks, es, seg)
                    }
                    (Algorithm::Hierarchical, false) if !pulled => {
                        hier::all_gather(q, &layout, &chunks, es, seg)
                    }
                    (_, true) => ring::reduce_scatter(q, n, &chunks, es, s),
                    (_, false) => ring::all_gather(q, n, &chunks, es, s),
                }
            };
            execute(e, &fp, pull, &plan_of, b, T::DTYPE, op)
        }))
    }

    pub(super) fn job_broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<JobFn> {
        self.check_root("broadcast", root)?;
        let algo = self.rooted_algorithm();
        let fp = self.fingerprint(
            OpKind::Broadcast,
            T::DTYPE,
            None,
            buf.len(),
            Some(root),
            algo,
        );
        let (n, seg, pull, es) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            self.host_pull,
            size_of::<T>(),
        );
        Ok(job_over(buf, move |e, b| {
            let len = b.len();
            let plan_of = |q: usize, pulled: bool| {
                let s = chain_segment(pulled, len, n, es, seg);
                match algo {
                    Algorithm::Tree => tree::broadcast(q, n, root, len, s),
                    _ => chain::broadcast(q, n, root, len, s),
                }
            };
            execute(e, &fp, pull, &plan_of, b, T::DTYPE, None)
        }))
    }

    pub(super) fn job_reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        self.check_root("reduce", root)?;
        let algo = self.rooted_algorithm();
        let fp = self.fingerprint(
            OpKind::Reduce,
            T::DTYPE,
            Some(op),
            buf.len(),
            Some(root),
            algo,
        );
        let (n, seg, pull, es) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            self.host_pull,
            size_of::<T>(),
        );
        Ok(job_over(buf, move |e, b| {
            let len = b.len();
            let plan_of = |q: usize, pulled: bool| {
                let s = chain_segment(pulled, len, n, es, seg);
                match algo {
                    Algorithm::Tree => tree::reduce(q, n, root, len, s),
                    _ => chain::reduce(q, n, root, len, s),
                }
            };
            execute(e, &fp, pull, &plan_of, b, T::DTYPE, Some(op))
        }))
    }

    pub(super) fn job_barrier(&self) -> JobFn {
        let fp = self.fingerprint(
            OpKind::Barrier,
            DataType::U8,
            None,
            0,
            None,
            Algorithm::RecursiveDoubling,
        );
        // No data: always over the links, whatever the transport reads.
        Box::new(move |e: &mut Engine| {
            let plan = doubling::plan(e.rank, e.world_size, 0);
            e.stream(
                Channel::Collective,
                &fp,
                &plan,
                Data::Write(&mut []),
                &mut NoCombine,
            )
        })
    }

    // ---- collectives ----

    /// Reduces `buf` across all ranks, in place: afterwards every rank holds the same,
    /// bitwise identical, result. Messages up to
    /// [`Tuning::small_message_bytes`](crate::config::Tuning::small_message_bytes) use
    /// recursive doubling, larger ones the pipelined ring, unless
    /// [`Tuning::all_reduce_algo`](crate::config::Tuning::all_reduce_algo) forces one
    /// (ring, recursive doubling, Rabenseifner, tree) or a
    /// [`Tuning::cost_model`](crate::config::Tuning::cost_model) chooses per call
    /// ([`Communicator::all_reduce_algorithm`] says which).
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(3, &Config::default()).unwrap();
    /// let results: Vec<Vec<f32>> = std::thread::scope(|s| {
    ///     let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || {
    ///         let mut v = vec![c.rank() as f32 + 1.0; 5];
    ///         c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///         v
    ///     })).collect();
    ///     hs.into_iter().map(|h| h.join().unwrap()).collect()
    /// });
    /// assert!(results.iter().all(|v| v == &vec![6.0; 5]));
    /// ```
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let job = self.job_all_reduce(buf, op)?;
        self.run_now(job)
    }

    /// Out-of-place all-reduce: `recv` receives the reduction of every rank's `send`.
    /// `send` and `recv` must have the same length (on this rank and on all others).
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check(send.len() == recv.len(), || {
            format!(
                "all_reduce_into: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )
        })?;
        recv.copy_from_slice(send);
        self.all_reduce(recv, op)
    }

    /// Reduce-scatter: rank `r` receives in `recv` the reduction of block `r` of every
    /// rank's `send`, where `send` holds `world_size` blocks of `recv.len()` elements.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.world_size;
        self.check(send.len() == n * recv.len(), || {
            format!(
                "reduce_scatter: send has {} elements but must hold world_size ({n}) blocks of \
                 recv's {} elements ({})",
                send.len(),
                recv.len(),
                n * recv.len()
            )
        })?;
        let counts = vec![recv.len(); n];
        self.reduce_scatter_counts(send, recv, &counts, op)
    }

    /// Reduce-scatter with per-rank block sizes: `send` is the concatenation of blocks
    /// of `counts[0..n]` elements, and rank `r` receives block `r` (`recv.len()` must be
    /// `counts[r]`). `counts` must be the same on every rank.
    pub fn reduce_scatterv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_counts(counts, send.len(), recv.len(), "reduce_scatterv", "send")?;
        self.reduce_scatter_counts(send, recv, counts, op)
    }

    fn reduce_scatter_counts<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let chunks = schedule::chunks_from_counts(counts);
        // The ring reduces in place; keep the caller's input intact by working on a
        // copy, in a buffer kept between calls (no allocation or page faults per call).
        let mut words = self.work.borrow_mut();
        let need = std::mem::size_of_val(send).div_ceil(8);
        if words.len() < need {
            words.resize(need, 0);
        }
        let bytes =
            &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..std::mem::size_of_val(send)];
        let work: &mut [T] = bytemuck::cast_slice_mut(bytes);
        work.copy_from_slice(send);
        let job = self.job_reduce_scatter(work, chunks.clone(), op)?;
        self.run_now(job)?;
        recv.copy_from_slice(&work[chunks[self.rank].clone()]);
        Ok(())
    }

    /// In-place reduce-scatter: `buf` holds `world_size` equal blocks; afterwards block
    /// `rank` holds the reduction (other blocks hold partial results).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "reduce_scatter_in_place")?;
        let job = self.job_reduce_scatter(buf, chunks, op)?;
        self.run_now(job)
    }

    /// All-gather: `recv` receives every rank's `send`, in rank order
    /// (`recv.len() == world_size * send.len()`).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.world_size;
        self.check(recv.len() == n * send.len(), || {
            format!(
                "all_gather: recv has {} elements but must hold world_size ({n}) blocks of \
                 send's {} elements ({})",
                recv.len(),
                send.len(),
                n * send.len()
            )
        })?;
        let counts = vec![send.len(); n];
        self.all_gather_counts(send, recv, &counts)
    }

    /// All-gather with per-rank sizes: rank `r` contributes `counts[r]` elements
    /// (`send.len()`), and `recv` receives the concatenation. `counts` must be the same
    /// on every rank.
    pub fn all_gatherv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.check_counts(counts, recv.len(), send.len(), "all_gatherv", "recv")?;
        self.all_gather_counts(send, recv, counts)
    }

    fn all_gather_counts<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let chunks = schedule::chunks_from_counts(counts);
        recv[chunks[self.rank].clone()].copy_from_slice(send);
        let job = self.job_all_gather(recv, chunks)?;
        self.run_now(job)
    }

    /// In-place all-gather: `buf` holds `world_size` equal blocks and this rank's block
    /// `rank` is its contribution; afterwards every block is filled.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "all_gather_in_place")?;
        let job = self.job_all_gather(buf, chunks)?;
        self.run_now(job)
    }

    /// Broadcasts `buf` from `root` to every rank, as a pipelined chain (or a pipelined
    /// binary tree when [`Tuning::all_reduce_algo`](crate::config::Tuning::all_reduce_algo)
    /// is `Tree`; [`Communicator::rooted_algorithm`] says which).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let job = self.job_broadcast(buf, root)?;
        self.run_now(job)
    }

    /// Reduces every rank's `buf` into `root`'s, in place, as a pipelined chain (or tree,
    /// as [`Communicator::broadcast`]). On the other ranks `buf` is working space and
    /// holds a partial result afterwards.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let job = self.job_reduce(buf, op, root)?;
        self.run_now(job)
    }

    /// Out-of-place reduce: `root`'s `recv` receives the reduction of every rank's
    /// `send`; `send` is untouched everywhere and `recv` (same length as `send` on
    /// every rank) is working space on the others.
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check(send.len() == recv.len(), || {
            format!(
                "reduce_into: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )
        })?;
        recv.copy_from_slice(send);
        self.reduce(recv, op, root)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let job = self.job_barrier();
        self.run_now(job)
    }

    /// `len` elements as `world_size` equal blocks, or a refusal naming `what`.
    pub(super) fn equal_blocks(&self, len: usize, what: &str) -> Result<Vec<Range<usize>>> {
        let n = self.world_size;
        self.check(len.is_multiple_of(n), || {
            format!("{what}: {len} elements do not split into world_size ({n}) equal blocks")
        })?;
        Ok(schedule::chunks_from_counts(&vec![len / n; n]))
    }

    fn check_counts(
        &self,
        counts: &[usize],
        total: usize,
        mine: usize,
        what: &str,
        whole: &str,
    ) -> Result<()> {
        let n = self.world_size;
        self.check(counts.len() == n, || {
            format!("{what}: {} counts for world_size ({n}) ranks", counts.len())
        })?;
        let sum: usize = counts.iter().sum();
        self.check(sum == total, || {
            format!("{what}: counts sum to {sum} but {whole} has {total} elements")
        })?;
        let r = self.rank;
        self.check(counts[r] == mine, || {
            format!(
                "{what}: counts[{r}] is {} but this rank's block has {mine} elements",
                counts[r]
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_segments_shorten_the_fill_and_stay_in_bounds() {
        let configured = crate::config::DEFAULT_SEGMENT_BYTES;
        for n in [2usize, 3, 4, 5, 7, 8, 16, 33, 64, 1000] {
            for shift in 10..=28 {
                for len in [1usize << shift, (1 << shift) + 24, 3 << (shift - 2)] {
                    // The best segment in bounds under the model.
                    let min = algo::schedule::MIN_AUTO_SEGMENT_BYTES;
                    let best = (1..=len.div_ceil(min))
                        .map(|k| chain_cost(len, n, len.div_ceil(k).clamp(min, configured)))
                        .fold(f64::INFINITY, f64::min);
                    for es in [1usize, 2, 8] {
                        let g = chain_segment(false, len, n, es, configured);
                        assert_eq!(g % es, 0, "n {n} len {len} es {es}: {g}");
                        if n == 2 {
                            assert_eq!(g, configured, "two ranks keep the configured segment");
                            continue;
                        }
                        assert!((min..=configured).contains(&g), "n {n} len {len}: {g}");
                        // Never worse than the configured segment under the model, and
                        // within 3% of the best segment in bounds.
                        let got = chain_cost(len, n, g);
                        assert!(got <= chain_cost(len, n, configured) * (1.0 + 1e-9));
                        assert!(got <= best * 1.03, "n {n} len {len}: {got} vs {best}");
                    }
                }
            }
        }
        // The case that was 4x S/B: 1 MiB over 8 ranks in 2 segments of 512 KiB took
        // 8 segment times; now its segment times add up to less than half of that.
        let g = chain_segment(false, 1 << 20, 8, 4, configured);
        let k = (1usize << 20).div_ceil(g);
        assert!(2 * (k + 6) * g < 8 * configured, "{k} segments of {g}");
        // A configured segment below the floor is kept; pulled chains are `n` deep.
        assert_eq!(chain_segment(false, 1 << 20, 8, 4, 4096), 4096);
        assert_eq!(chain_segment(true, 1 << 20, 8, 4, configured), 1 << 17);
    }
}
