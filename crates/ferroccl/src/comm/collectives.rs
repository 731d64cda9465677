//! The collectives on host memory: checks, fingerprints, plans, and the run.
//!
//! Each collective is built as a job (`job_*`): its arguments are checked on this rank
//! (a refusal poisons the communicator, so peers never wait for a rank that will not
//! come), it takes the next sequence number, and it captures its buffer and the plan
//! of the call. A blocking call runs the job at once; a [`super::Scope`] queues it.

use super::scope::{job_over, JobFn};
use super::Communicator;
use crate::algo::select::{chain_segment, two_shot_block, HostCall};
use crate::algo::{all_reduce_plan, chain, doubling, hier, ring, schedule, tree, Algorithm, Plan};
use crate::engine::{Data, Engine, PlanKey, PullCall, Shot};
use crate::error::Result;
use crate::reduce::{DataType, Element, HostCombine, NoCombine, ReduceOp};
use crate::transport::Channel;
use crate::wire::{Fingerprint, OpKind};
use std::ops::Range;

/// Runs the in-place collective `plan_of` on `b` (elements of `dtype`, combined with
/// `op` when it reduces): read from memory peers when the transport reads host
/// memory, streamed over the links otherwise. `plan_of(rank, pulled)` is any rank's
/// plan of the call, `pulled` asking for the shape the pull executor wants (whole
/// chunks instead of pipelining segments). `key`: the call's shape, where the plan is
/// a function of it alone (kept for the next call of that shape, [`Engine::planned`]).
#[allow(clippy::too_many_arguments)]
fn execute(
    e: &mut Engine,
    fp: &Fingerprint,
    pull: bool,
    plan_of: &dyn Fn(usize, bool) -> Plan,
    key: Option<PlanKey>,
    b: &mut [u8],
    dtype: DataType,
    op: Option<ReduceOp>,
) -> Result<()> {
    let n = e.world_size;
    if pull {
        let call = PullCall::on_host(b, dtype, op, n);
        return e.pull(fp, &|q| plan_of(q, true), &call);
    }
    let rank = e.rank;
    e.planned(
        key,
        || plan_of(rank, false),
        |e, plan| match op {
            Some(op) => e.stream(
                Channel::Collective,
                fp,
                plan,
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
                plan,
                Data::Write(b),
                &mut NoCombine,
            ),
        },
    )
}

impl Communicator {
    // ---- job builders: validate, fingerprint, and capture the buffers ----
    //
    // SAFETY contract of every `job_*`: the returned job dereferences the given
    // buffers; the caller must keep them alive and untouched until the job has run
    // (`run_now` blocks; a `Scope` and a `Pending` wait for their jobs).

    pub(super) fn job_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        let run = self.all_reduce_bytes(T::DTYPE, buf.len(), op, None)?;
        Ok(job_over(buf, run))
    }

    /// An in-place all-reduce of `count` elements of `dtype` as bytes, as host buffers
    /// run it: the algorithm for its size, its fingerprint, read from the memory peers
    /// or streamed over the links. Staged device buffers run their pieces through it
    /// too, each piece's fingerprint saying how many pieces follow it (`piece_of`, in
    /// the root's place, which an all-reduce has no use for), so that calls of
    /// different lengths, or a piece against a whole host buffer, fail as mismatched at
    /// their first piece, never match piece by piece.
    pub(super) fn all_reduce_bytes(
        &self,
        dtype: DataType,
        count: usize,
        op: ReduceOp,
        piece_of: Option<usize>,
    ) -> Result<impl FnOnce(&mut Engine, &mut [u8]) -> Result<()> + Send + 'static> {
        let es = dtype.size();
        let bytes = count * es;
        let (algo, layout) = self.all_reduce_choice(bytes)?;
        let fp = self.fingerprint(OpKind::AllReduce, dtype, Some(op), count, piece_of, algo);
        let policy = self.policy();
        let (n, seg, pull, slots) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            policy.all_reduce_pulls(algo, bytes),
            policy.all_reduce_slots(algo, bytes),
        );
        let shot = match algo {
            Algorithm::OneShot => Some(Shot::One),
            Algorithm::TwoShot => Some(Shot::Two {
                block: two_shot_block(n, es, seg),
            }),
            _ => None,
        };
        Ok(move |e: &mut Engine, b: &mut [u8]| {
            if slots {
                return e.slot_all_reduce(&fp, b, dtype, op);
            }
            if let Some(shot) = shot.filter(|_| pull) {
                let call = PullCall::on_host(b, dtype, Some(op), n);
                return e.pull_shot(&fp, shot, &call);
            }
            let plan_of = move |q: usize, pulled: bool| {
                if pulled {
                    ring::all_reduce(q, n, count, es, count.max(1))
                } else {
                    all_reduce_plan(algo, q, n, count, es, seg, layout.as_ref())
                }
            };
            // The hierarchical plan also depends on the host layout: not kept.
            let key = (algo != Algorithm::Hierarchical).then_some(PlanKey {
                kind: OpKind::AllReduce,
                algo,
                count,
                es,
                seg,
            });
            execute(e, &fp, pull, &plan_of, key, b, dtype, Some(op))
        })
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
        let (kind, what, call) = if op.is_some() {
            (
                OpKind::ReduceScatter,
                "hierarchical reduce-scatter",
                HostCall::ReduceScatter,
            )
        } else {
            (
                OpKind::AllGather,
                "hierarchical all-gather",
                HostCall::AllGather,
            )
        };
        let (algo, layout) = self.hierarchical_choice(self.reduce_scatter_algorithm(), what)?;
        let fp = self.fingerprint(kind, T::DTYPE, op, buf.len(), None, algo);
        let (n, seg, pull, es) = (
            self.world_size,
            self.cfg.tuning.segment_bytes,
            self.policy().pulls(call, std::mem::size_of_val(buf)),
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
                    (Algorithm::Hierarchical, true) if !pulled => hier::reduce_scatter(
                        q,
                        &hier::or_flat(layout.as_ref(), n),
                        &chunks,
                        es,
                        seg,
                    ),
                    (Algorithm::Hierarchical, false) if !pulled => {
                        hier::all_gather(q, &hier::or_flat(layout.as_ref(), n), &chunks, es, seg)
                    }
                    (_, true) => ring::reduce_scatter(q, n, &chunks, es, s),
                    (_, false) => ring::all_gather(q, n, &chunks, es, s),
                }
            };
            execute(e, &fp, pull, &plan_of, None, b, T::DTYPE, op)
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
            self.policy()
                .pulls(HostCall::Broadcast, std::mem::size_of_val(buf)),
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
            execute(e, &fp, pull, &plan_of, None, b, T::DTYPE, None)
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
            self.policy()
                .pulls(HostCall::Reduce, std::mem::size_of_val(buf)),
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
            execute(e, &fp, pull, &plan_of, None, b, T::DTYPE, Some(op))
        }))
    }

    pub(super) fn job_barrier(&self) -> JobFn {
        let algo = self.policy().barrier();
        let fp = self.fingerprint(OpKind::Barrier, DataType::U8, None, 0, None, algo);
        if algo == Algorithm::OneShot {
            // A stamp in the slots, where there are some.
            return Box::new(move |e: &mut Engine| {
                e.slot_all_reduce(&fp, &mut [], DataType::U8, ReduceOp::Sum)
            });
        }
        // No data: over the links, whatever else the transport reads.
        let key = PlanKey {
            kind: OpKind::Barrier,
            algo: Algorithm::RecursiveDoubling,
            count: 0,
            es: 0,
            seg: 0,
        };
        Box::new(move |e: &mut Engine| {
            let (rank, n) = (e.rank, e.world_size);
            e.planned(
                Some(key),
                || doubling::plan(rank, n, 0),
                |e, plan| {
                    e.stream(
                        Channel::Collective,
                        &fp,
                        plan,
                        Data::Write(&mut []),
                        &mut NoCombine,
                    )
                },
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
        super::copy_elems(recv, send);
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
        super::copy_elems(work, send);
        let job = self.job_reduce_scatter(work, chunks.clone(), op)?;
        self.run_now(job)?;
        super::copy_elems(recv, &work[chunks[self.rank].clone()]);
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
        super::copy_elems(&mut recv[chunks[self.rank].clone()], send);
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
        super::copy_elems(recv, send);
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
