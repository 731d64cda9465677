//! The direct exchanges: all-to-all(v), gather(v) and scatter(v) (plans in
//! `algo/direct.rs`). Each runs over `[input | output]`: sends read the input, receives
//! land in the output, and a rank's own block is copied here. The equal-block forms
//! lay the two out alike on every rank (gather: one block, then `n`; scatter: `n`,
//! then one), so that a transport whose peers read each other's memory runs them too
//! where the selection says it wins (`algo::select`'s `Policy::pulls`: CUDA IPC's
//! peers; on symmetric shared memory they stream through the rings, measured faster);
//! the `v` forms, whose layout only their own rank knows, stream over the links.

use super::scope::{job_over_split, JobFn};
use super::{Communicator, Handle, Scope};
use crate::algo::direct::{self, Block};
use crate::algo::select::HostCall;
use crate::algo::{self, Plan};
use crate::engine::{Data, Engine, PullCall};
use crate::error::Result;
use crate::reduce::{DataType, Element, NoCombine};
use crate::transport::{CallMem, Channel};
use crate::wire::{Fingerprint, OpKind};
use std::mem::size_of;
use std::ops::Range;
use std::sync::Arc;

/// Any rank's plan of a call (`plan_of(q)`); for the `v` forms only this rank's.
type PlanOf = Arc<dyn Fn(usize) -> Plan + Send + Sync>;

/// What a direct exchange's job needs besides its buffers.
struct Call {
    fp: Fingerprint,
    plan_of: PlanOf,
    /// Bytes of the plan's input part, and of its output part (the same on every rank
    /// for the forms that may be pulled).
    in_len: usize,
    out_len: usize,
    /// Whether it runs on memory peers (a transport reading peers' host memory, and a
    /// form every rank can plan for every other).
    pull: bool,
    dtype: DataType,
}

/// Runs `call` over `input` and `output`.
fn execute(e: &mut Engine, call: &Call, input: &[u8], output: &mut [u8]) -> Result<()> {
    if call.pull {
        let p = PullCall {
            mem: CallMem {
                space: 0,
                input: input.as_ptr() as u64,
                input_len: input.len(),
                output: output.as_mut_ptr() as u64,
                output_len: output.len(),
                dtype: call.dtype,
                op: None,
                world_size: e.world_size,
            },
            bytes: call.in_len + call.out_len,
            input_at: 0,
            output_at: call.in_len,
        };
        let plan_of = call.plan_of.clone();
        return e.pull(&call.fp, &move |q| plan_of(q), &p);
    }
    let plan = (call.plan_of)(e.rank);
    let data = Data::Split {
        input,
        in_len: call.in_len,
        output,
    };
    e.stream(Channel::Collective, &call.fp, &plan, data, &mut NoCombine)
}

/// `counts[q]` elements of `es` bytes at `displs[q]`, as byte blocks from `base`.
fn blocks(counts: &[usize], displs: &[usize], es: usize, base: usize) -> Vec<Block> {
    counts
        .iter()
        .zip(displs)
        .map(|(&c, &d)| Block {
            bytes: base + d * es..base + (d + c) * es,
            count: c,
        })
        .collect()
}

/// `n` equal blocks of `count` elements of `es` bytes, from `base`.
fn equal_blocks(n: usize, count: usize, es: usize, base: usize) -> Vec<Block> {
    (0..n)
        .map(|q| Block {
            bytes: base + q * count * es..base + (q + 1) * count * es,
            count,
        })
        .collect()
}

impl Communicator {
    /// All-to-all: `send` holds `world_size` equal blocks, block `q` for rank `q`;
    /// afterwards block `q` of `recv` holds rank `q`'s block for this rank (MPI's
    /// `MPI_Alltoall`, `torch.distributed.all_to_all_single` with equal splits). `send`
    /// and `recv` have the same length, a multiple of `world_size`, on every rank.
    /// Pairwise exchange: `n - 1` steps, each a permutation of the ranks
    /// (see the `algo` module's `direct.rs`).
    ///
    /// ```
    /// use ferroccl::{Communicator, Config};
    /// let comms = Communicator::local_group(3, &Config::default())?;
    /// std::thread::scope(|t| {
    ///     let ranks: Vec<_> = comms.into_iter().map(|comm| t.spawn(move || -> ferroccl::Result<()> {
    ///         let r = comm.rank() as i32;
    ///         // Block q (two elements) goes to rank q.
    ///         let send: Vec<i32> = (0..3).flat_map(|q| [10 * r + q; 2]).collect();
    ///         let mut recv = vec![0; 6];
    ///         comm.all_to_all(&send, &mut recv)?;
    ///         // Block q came from rank q.
    ///         assert_eq!(recv, (0..3).flat_map(|q| [10 * q + r; 2]).collect::<Vec<_>>());
    ///         Ok(())
    ///     })).collect();
    ///     ranks.into_iter().try_for_each(|h| h.join().expect("a rank panicked"))
    /// })?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let job = self.job_all_to_all(send, recv)?;
        self.run_now(job)
    }

    /// In-place [`Communicator::all_to_all`]: `buf` holds the blocks to send and
    /// receives the blocks sent (through a working copy of it).
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let mut words = std::mem::take(&mut *self.work.borrow_mut());
        let bytes = std::mem::size_of_val(buf);
        words.resize(words.len().max(bytes.div_ceil(8)), 0);
        let copy: &mut [T] =
            bytemuck::cast_slice_mut(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes]);
        super::copy_elems(copy, buf);
        let r = self
            .job_all_to_all(copy, buf)
            .and_then(|job| self.run_now(job));
        *self.work.borrow_mut() = words;
        r
    }

    /// All-to-all with per-peer counts and displacements (`MPI_Alltoallv`,
    /// `all_to_all_single` with splits): this rank sends `send_counts[q]` elements at
    /// `send_displs[q]` of `send` to rank `q`, and receives rank `q`'s
    /// `recv_counts[q]` elements at `recv_displs[q]` of `recv`. Blocks may be empty;
    /// receive blocks must not overlap. Every pair must agree (`send_counts[q]` here
    /// is `recv_counts[this rank]` at `q`): a pair that does not fails in this call
    /// with [`Error::Mismatch`](crate::Error::Mismatch) naming both counts, and the
    /// others fail with it.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_allv<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<()> {
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        let what = "all_to_allv";
        self.check_blocks(what, "send", send_counts, send_displs, send.len(), false)?;
        self.check_blocks(what, "recv", recv_counts, recv_displs, recv.len(), true)?;
        self.check(send_counts[r] == recv_counts[r], || {
            format!(
                "{what}: this rank sends itself {} elements but expects {}",
                send_counts[r], recv_counts[r]
            )
        })?;
        let (in_len, out_len) = (std::mem::size_of_val(send), std::mem::size_of_val(recv));
        let sb = blocks(send_counts, send_displs, es, 0);
        let rb = blocks(recv_counts, recv_displs, es, in_len);
        super::copy_elems(
            &mut recv[recv_displs[r]..recv_displs[r] + recv_counts[r]],
            &send[send_displs[r]..send_displs[r] + send_counts[r]],
        );
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| direct::all_to_all(q, n, &sb, &rb, seg, true));
        let call =
            self.direct_call::<T>(OpKind::AllToAll, 0, None, plan_of, in_len, out_len, false);
        self.run_now(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    /// Gather to `root`: `root`'s `recv` receives every rank's `send` in rank order
    /// (`recv.len() == world_size * send.len()` at the root; elsewhere `recv` is not
    /// used and may be empty). Every rank names the same root and sends as many
    /// elements; a rank returns Ok only once every rank is known to have made the same
    /// call (as broadcast and reduce).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let job = self.job_gather(send, recv, root, false)?;
        self.run_now(job)
    }

    /// In-place [`Communicator::gather`]: `buf` holds `world_size` equal blocks on
    /// every rank, this rank's contribution in block `rank`; afterwards the root's
    /// holds every rank's (the others' are unchanged).
    pub fn gather_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "gather_in_place")?;
        let job = if self.rank == root {
            self.job_gather(&[], buf, root, true)?
        } else {
            let mine = &buf[chunks[self.rank].clone()];
            self.job_gather(mine, &mut [], root, true)?
        };
        self.run_now(job)
    }

    /// Gather with per-rank counts (`MPI_Gatherv`): rank `q` sends its `send`, which
    /// lands at `displs[q]` of the root's `recv`, `counts[q]` elements (`counts` and
    /// `displs` are read at the root only: elsewhere pass `&[]`). Receive blocks must
    /// not overlap.
    pub fn gatherv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        displs: &[usize],
        root: usize,
    ) -> Result<()> {
        self.check_root("gatherv", root)?;
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        let in_len = std::mem::size_of_val(send);
        let slots = if r == root {
            self.check_blocks("gatherv", "recv", counts, displs, recv.len(), true)?;
            self.check(counts[r] == send.len(), || {
                format!(
                    "gatherv: counts[{r}] is {} but the root sends {} elements",
                    counts[r],
                    send.len()
                )
            })?;
            super::copy_elems(&mut recv[displs[r]..displs[r] + counts[r]], send);
            blocks(counts, displs, es, in_len)
        } else {
            Vec::new()
        };
        let mine = Block {
            bytes: 0..in_len,
            count: send.len(),
        };
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| direct::gather(q, n, root, &mine, &slots, seg));
        let out_len = if r == root {
            std::mem::size_of_val(recv)
        } else {
            0
        };
        let recv = if r == root { recv } else { &mut [] };
        let call = self.direct_call::<T>(
            OpKind::Gather,
            0,
            Some(root),
            plan_of,
            in_len,
            out_len,
            false,
        );
        self.run_now(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    /// Scatter from `root`: the root's `send` holds `world_size` equal blocks, and
    /// rank `q`'s `recv` receives block `q` (`send.len() == world_size * recv.len()` at
    /// the root; elsewhere `send` is not used and may be empty). Every rank names the
    /// same root and receives as many elements; a rank returns Ok only once every rank
    /// is known to have made the same call.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let job = self.job_scatter(send, recv, root, false)?;
        self.run_now(job)
    }

    /// In-place [`Communicator::scatter`]: `buf` holds `world_size` equal blocks on
    /// every rank; afterwards block `rank` holds the root's block for this rank (the
    /// root's buffer is unchanged).
    pub fn scatter_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "scatter_in_place")?;
        let job = if self.rank == root {
            self.job_scatter(buf, &mut [], root, true)?
        } else {
            let mine = &mut buf[chunks[self.rank].clone()];
            self.job_scatter(&[], mine, root, true)?
        };
        self.run_now(job)
    }

    /// Scatter with per-rank counts (`MPI_Scatterv`): rank `q`'s `recv` receives the
    /// root's `counts[q]` elements at `displs[q]` of `send` (`counts` and `displs`
    /// are read at the root only: elsewhere pass `&[]`).
    pub fn scatterv<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        displs: &[usize],
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root("scatterv", root)?;
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        let in_len = if r == root {
            std::mem::size_of_val(send)
        } else {
            0
        };
        let slots = if r == root {
            self.check_blocks("scatterv", "send", counts, displs, send.len(), false)?;
            self.check(counts[r] == recv.len(), || {
                format!(
                    "scatterv: counts[{r}] is {} but the root receives {} elements",
                    counts[r],
                    recv.len()
                )
            })?;
            super::copy_elems(recv, &send[displs[r]..displs[r] + counts[r]]);
            blocks(counts, displs, es, 0)
        } else {
            Vec::new()
        };
        let out_len = std::mem::size_of_val(recv);
        let mine = Block {
            bytes: in_len..in_len + out_len,
            count: recv.len(),
        };
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| direct::scatter(q, n, root, &mine, &slots, seg));
        let send = if r == root { send } else { &[] };
        let call = self.direct_call::<T>(
            OpKind::Scatter,
            0,
            Some(root),
            plan_of,
            in_len,
            out_len,
            false,
        );
        self.run_now(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    // ---- jobs of the equal-block forms (also started in a scope) ----

    pub(super) fn job_all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<JobFn> {
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        self.check(send.len() == recv.len(), || {
            format!(
                "all_to_all: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )
        })?;
        let chunks = self.equal_blocks(send.len(), "all_to_all")?;
        let count = send.len() / n;
        super::copy_elems(&mut recv[chunks[r].clone()], &send[chunks[r].clone()]);
        let bytes = std::mem::size_of_val(send);
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| {
            let sb = equal_blocks(n, count, es, 0);
            let rb = equal_blocks(n, count, es, bytes);
            direct::all_to_all(q, n, &sb, &rb, seg, false)
        });
        let call = self.direct_call::<T>(
            OpKind::AllToAll,
            count as u64,
            None,
            plan_of,
            bytes,
            bytes,
            true,
        );
        Ok(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    /// Gather of equal blocks. `in_place`: at the root `send` is empty and its block
    /// is in `recv` already; elsewhere `recv` is empty.
    fn job_gather<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
        in_place: bool,
    ) -> Result<JobFn> {
        self.check_root("gather", root)?;
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        let count = if in_place {
            (send.len() + recv.len()) / if r == root { n } else { 1 }
        } else {
            send.len()
        };
        let recv: &mut [T] = if r == root {
            self.check(recv.len() == n * count, || {
                format!(
                    "gather: the root's recv has {} elements but must hold world_size ({n}) \
                     blocks of {count}",
                    recv.len()
                )
            })?;
            if !in_place {
                super::copy_elems(&mut recv[r * count..(r + 1) * count], send);
            }
            recv
        } else {
            &mut []
        };
        let send = if r == root { &[] } else { send };
        // Every rank: one block of input, then `n` of output.
        let block = count * es;
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| {
            let mine = Block {
                bytes: 0..block,
                count,
            };
            direct::gather(q, n, root, &mine, &equal_blocks(n, count, es, block), seg)
        });
        let call = self.direct_call::<T>(
            OpKind::Gather,
            count as u64,
            Some(root),
            plan_of,
            block,
            n * block,
            true,
        );
        Ok(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    /// Scatter of equal blocks. `in_place`: at the root `recv` is empty and its block
    /// stays in `send`; elsewhere `send` is empty.
    fn job_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
        in_place: bool,
    ) -> Result<JobFn> {
        self.check_root("scatter", root)?;
        let (n, r, es) = (self.world_size, self.rank, size_of::<T>());
        let count = if in_place && r == root {
            send.len() / n
        } else {
            recv.len()
        };
        let send: &[T] = if r == root {
            self.check(send.len() == n * count, || {
                format!(
                    "scatter: the root's send has {} elements but must hold world_size ({n}) \
                     blocks of {count}",
                    send.len()
                )
            })?;
            if !in_place {
                super::copy_elems(recv, &send[r * count..(r + 1) * count]);
            }
            send
        } else {
            &[]
        };
        let recv = if r == root { &mut [] } else { recv };
        // Every rank: `n` blocks of input, then one of output.
        let block = count * es;
        let seg = self.direct_segment(es);
        let plan_of: PlanOf = Arc::new(move |q| {
            let mine = Block {
                bytes: n * block..(n + 1) * block,
                count,
            };
            direct::scatter(q, n, root, &mine, &equal_blocks(n, count, es, 0), seg)
        });
        let call = self.direct_call::<T>(
            OpKind::Scatter,
            count as u64,
            Some(root),
            plan_of,
            n * block,
            block,
            true,
        );
        Ok(job_over_split(send, recv, move |e, i, o| {
            execute(e, &call, i, o)
        }))
    }

    /// Segment bytes of a direct exchange's frames: the configured segment (there is
    /// no pipeline to fill; it bounds a frame), whole elements.
    fn direct_segment(&self, es: usize) -> usize {
        algo::segment_bytes(self.cfg.tuning.segment_bytes, es)
    }

    /// Fingerprints the call (taking its sequence number) and decides how it runs.
    #[allow(clippy::too_many_arguments)]
    fn direct_call<T: Element>(
        &self,
        kind: OpKind,
        count: u64,
        root: Option<usize>,
        plan_of: PlanOf,
        in_len: usize,
        out_len: usize,
        pullable: bool,
    ) -> Call {
        let algo = self.policy().direct();
        let fp = self.fingerprint(kind, T::DTYPE, None, count as usize, root, algo);
        let call = match kind {
            OpKind::Gather => HostCall::Gather,
            OpKind::Scatter => HostCall::Scatter,
            _ => HostCall::AllToAll,
        };
        Call {
            fp,
            plan_of,
            in_len,
            out_len,
            pull: pullable && self.policy().pulls(call, in_len + out_len),
            dtype: T::DTYPE,
        }
    }

    /// Refuses per-rank blocks (`counts`, `displs`, one per rank) that do not fit in
    /// `len` elements, or, for receive blocks (`disjoint`), that overlap.
    fn check_blocks(
        &self,
        what: &str,
        name: &str,
        counts: &[usize],
        displs: &[usize],
        len: usize,
        disjoint: bool,
    ) -> Result<()> {
        let n = self.world_size;
        self.check(counts.len() == n && displs.len() == n, || {
            format!(
                "{what}: {} {name} counts and {} displacements for world_size ({n}) ranks",
                counts.len(),
                displs.len()
            )
        })?;
        let mut spans: Vec<(Range<usize>, usize)> = Vec::with_capacity(n);
        for q in 0..n {
            let end = displs[q].checked_add(counts[q]);
            self.check(end.is_some_and(|e| e <= len), || {
                format!(
                    "{what}: {name} block {q} ({} elements at {}) does not fit in {name}'s {len}",
                    counts[q], displs[q]
                )
            })?;
            if counts[q] > 0 {
                spans.push((displs[q]..displs[q] + counts[q], q));
            }
        }
        if disjoint {
            spans.sort_by_key(|(s, _)| s.start);
            for w in spans.windows(2) {
                let ((a, p), (b, q)) = (&w[0], &w[1]);
                self.check(a.end <= b.start, || {
                    format!("{what}: {name} blocks {p} ({a:?}) and {q} ({b:?}) overlap")
                })?;
            }
        }
        Ok(())
    }
}

impl<'s, 'c> Scope<'s, 'c> {
    /// Non-blocking [`Communicator::all_to_all`]: its handle hands back `recv`.
    pub fn all_to_all<T: Element>(
        &self,
        send: &'s [T],
        recv: &'s mut [T],
    ) -> Result<Handle<'s, T>> {
        self.start(recv, |r| self.comm().job_all_to_all(send, r))
    }
}
