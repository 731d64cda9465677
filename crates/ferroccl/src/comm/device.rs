//! Collectives on device memory (feature `cuda`), in two forms on [`Communicator`]:
//! on cudarc's `CudaSlice<T>` (`all_reduce_device`, `reduce_scatter_device`,
//! `all_gather_device`, `broadcast_device`, `reduce_device`), and *raw*, on
//! [`DeviceBuf`]s — memory a framework owns, such as PyTorch's CUDA tensors
//! (`all_reduce_device_raw` and the same five, plus `all_to_all_device_raw`,
//! `gather_device_raw` and `scatter_device_raw`). The slice forms are the raw ones on
//! the slice's address.
//!
//! Over CUDA IPC (`TransportKind::CudaIpc`) the engine's pull executor runs the call on
//! the device: every rank reads its peers' device memory directly, nothing is staged.
//! An all-reduce there runs one-shot or two-shot (`engine/shot.rs`; the fewest
//! hand-overs between ranks, `algo::select::device_all_reduce`), the other collectives
//! their ring or chain plans. Over any other transport the buffer is staged through
//! pinned host memory and the ordinary host plan runs on it, reductions included
//! (`crate::cuda::staging`), a large reduction in pieces whose copies overlap the wire;
//! all-to-all, gather and scatter are always staged (they move data, and run the host
//! collectives on the pinned copies). Either way the call goes
//! through the engine's run wrapper: it is fingerprinted (a mismatched call is
//! [`crate::Error::Mismatch`]), it waits under the communicator's timeout and abort
//! handle, and a failure — a CUDA error included — poisons the communicator.
//!
//! # The raw forms' contract
//! Every [`DeviceBuf`] is device memory of its GPU's primary context, valid for its
//! elements until the call returns. The call queues its device work on
//! [`Device::shared`]`(ordinal)`'s stream and waits for it before returning (on
//! success; a failed call may leave work queued there). Work of the caller's that
//! writes or reads the buffers must be ordered around the call on that stream:
//! [`crate::order::DeviceOp`] does it with events ([`crate::cuda::order`]). Each buffer
//! is checked ([`DeviceBuf::check`]: device memory of the named GPU at both ends, all
//! buffers of a call on one GPU); a refused buffer poisons the communicator, as any
//! refused argument does, so peers do not wait for this rank.

use super::Communicator;
use crate::algo::select::{chain_segment, device_all_reduce, staged_pieces};
use crate::algo::{chain, ring, schedule, Algorithm, Plan};
use crate::cuda::mem::{dtod, dtoh, htod, DeviceAlloc};
use crate::cuda::staging::with_pinned;
use crate::cuda::{drv, Device, DeviceBuf};
use crate::engine::{Data, Engine, PullCall, Shot};
use crate::error::{Error, Result};
use crate::reduce::{check_op, DataType, Element, HostCombine, NoCombine, ReduceOp};
use crate::transport::{CallMem, Channel};
use crate::wire::{Fingerprint, OpKind};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use std::ops::Range;
use std::sync::Arc;

/// The error for a dtype with no element type in this build.
fn untyped(dt: DataType) -> Error {
    Error::InvalidArgument(format!("{dt}: no element type for it in this build"))
}

/// One staged piece's collective on its host bytes ([`Communicator::staged_reduce`]).
type PieceRun = Box<dyn FnOnce(&mut Engine, &mut [u8]) -> Result<()>>;

/// A new event recording what `stream` has queued so far.
fn cuda_event(stream: &CudaStream) -> Result<CudaEvent> {
    stream.record_event(None).map_err(drv("cuEventRecord"))
}

/// An all-to-all's `(send_counts, send_displs, recv_counts, recv_displs)`.
pub type Counts<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize]);

/// Where a pulled call's buffers are: device addresses and lengths, and the workspace
/// offsets they map to.
struct DeviceIo {
    input: (u64, usize),
    output: (u64, usize),
    bytes: usize,
    input_at: usize,
    output_at: usize,
}

impl DeviceIo {
    /// An in-place call on `bytes` at device address `d`.
    fn in_place(d: u64, bytes: usize) -> Self {
        DeviceIo {
            input: (d, bytes),
            output: (d, bytes),
            bytes,
            input_at: 0,
            output_at: 0,
        }
    }
}

/// `bytes` of a pinned buffer as `T`s (the pieces [`Communicator::staged`] hands out
/// start at multiples of 8 bytes of a page-aligned buffer).
fn elems<T: Element>(bytes: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::InvalidArgument(format!("internal: staging buffer as elements: {e}")))
}

fn elems_mut<T: Element>(bytes: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| Error::InvalidArgument(format!("internal: staging buffer as elements: {e}")))
}

/// The raw form of a slice of `len` `T`s at device address `addr`.
fn slice_buf<T: Element>(dev: &Device, len: usize, addr: u64) -> DeviceBuf {
    DeviceBuf {
        ordinal: dev.ordinal,
        addr,
        len,
        dtype: T::DTYPE,
    }
}

impl Communicator {
    /// The device a slice lives on (opened once per process, with our stream), or a
    /// refusal that poisons the communicator (the peers would wait for this rank).
    fn device_of<T>(&self, buf: &CudaSlice<T>) -> Result<Arc<Device>> {
        Device::shared(buf.context().ordinal()).map_err(|e| self.refuse(e))
    }

    /// Checks a call's buffers (`(buffer, its name)`: one GPU, device memory there) and
    /// opens their device; a refusal poisons the communicator.
    fn device_for(&self, what: &str, bufs: &[(&DeviceBuf, &str)]) -> Result<Arc<Device>> {
        let first = bufs[0].0.ordinal;
        if let Some((b, name)) = bufs.iter().find(|(b, _)| b.ordinal != first) {
            return Err(self.refuse(Error::InvalidArgument(format!(
                "{what}: {} is on GPU {first} but {name} on GPU {}: one call's buffers \
                 must be on one GPU",
                bufs[0].1, b.ordinal
            ))));
        }
        let dev = Device::shared(first).map_err(|e| self.refuse(e))?;
        for (b, name) in bufs {
            b.check(&format!("{what}'s {name}"))
                .map_err(|e| self.refuse(e))?;
        }
        Ok(dev)
    }

    /// `send` as a pulled call may read it: a device copy when it overlaps `recv` (an
    /// in-place all-gather), which the caller keeps until the call is over.
    fn unalias(
        &self,
        dev: &Device,
        send: DeviceBuf,
        recv: &DeviceBuf,
    ) -> Result<(DeviceBuf, Option<DeviceAlloc>)> {
        if !send.overlaps(recv) {
            return Ok((send, None));
        }
        let copy = DeviceAlloc::new(dev.context(), send.bytes())?;
        // SAFETY: both ranges are device memory of this device valid for `bytes` (the
        // copy was just allocated; `send` by the caller's contract), ordered on our
        // stream before the call's own work.
        unsafe { dtod(dev.stream(), copy.ptr(), send.addr, send.bytes())? };
        let moved = DeviceBuf {
            addr: copy.ptr(),
            ..send
        };
        Ok((moved, Some(copy)))
    }

    /// Runs `plan_of` (any rank's plan of the call, whole chunks) on the transport's
    /// memory peers over device memory.
    fn pull_device(
        &self,
        fp: &Fingerprint,
        ordinal: usize,
        io: DeviceIo,
        dtype: DataType,
        op: Option<ReduceOp>,
        plan_of: &dyn Fn(usize) -> Plan,
    ) -> Result<()> {
        let call = self.pull_call(ordinal, io, dtype, op);
        self.run_now(|e| e.pull(fp, plan_of, &call))
    }

    /// The algorithm an all-reduce of `bytes` bytes of device memory uses on this
    /// communicator: over CUDA IPC the one `algo::select` picks for device memory
    /// (one-shot for small buffers, two-shot above, or what `FERROCCL_ALGO` forces);
    /// staged through host memory, the host's for the pieces it is staged in
    /// ([`Communicator::all_reduce_algorithm`] of the first piece's size).
    pub fn device_all_reduce_algorithm(&self, bytes: usize) -> Algorithm {
        if self.device_pull {
            device_all_reduce(self.world_size, bytes, self.cfg.tuning.all_reduce_algo)
        } else {
            let piece = staged_pieces(bytes, 1).first().map_or(0, |p| p.len());
            self.all_reduce_algorithm(piece)
        }
    }

    /// Runs the one-shot or two-shot all-reduce `shot` on the transport's memory peers
    /// over device memory.
    fn shot_device(
        &self,
        fp: &Fingerprint,
        shot: Shot,
        ordinal: usize,
        io: DeviceIo,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let call = self.pull_call(ordinal, io, dtype, Some(op));
        self.run_now(|e| e.pull_shot(fp, shot, &call))
    }

    /// The pull executor's view of a call on device memory of GPU `ordinal`.
    fn pull_call(
        &self,
        ordinal: usize,
        io: DeviceIo,
        dtype: DataType,
        op: Option<ReduceOp>,
    ) -> PullCall {
        PullCall {
            mem: CallMem {
                space: ordinal,
                input: io.input.0,
                input_len: io.input.1,
                output: io.output.0,
                output_len: io.output.1,
                dtype,
                op,
                world_size: self.world_size,
            },
            bytes: io.bytes,
            input_at: io.input_at,
            output_at: io.output_at,
        }
    }

    /// Reduces `buf` in place over the links, staged through pinned host memory in the
    /// pieces `algo::select::staged_pieces` cuts: every piece's copy to the host is
    /// queued at once, each followed by an event; piece `k`'s host collective starts
    /// when its event has passed, and its copy back is queued behind it, so the stream
    /// moves the other pieces while the wire carries this one. `piece(c, left)` is the
    /// collective of a piece of `c` elements with `left` more after it (`None`: the
    /// buffer is one piece), fingerprinted when it is made, which runs on the pinned
    /// copy exactly as on host buffers, reductions included; with `split` false the
    /// buffer is one piece. A CUDA failure
    /// poisons the communicator (peers wait for the next piece otherwise).
    fn staged_reduce(
        &self,
        dev: &Arc<Device>,
        buf: DeviceBuf,
        split: bool,
        piece: &dyn Fn(usize, Option<usize>) -> Result<PieceRun>,
    ) -> Result<()> {
        let es = buf.dtype.size();
        let pieces = if split {
            staged_pieces(buf.len, es)
        } else {
            std::iter::once(0..buf.len).collect()
        };
        let stream = dev.stream().clone();
        let r = with_pinned(dev, buf.bytes(), |h| {
            let cuda = |r: Result<()>| r.map_err(|e| self.refuse(e));
            let mut down = Vec::with_capacity(pieces.len());
            for p in &pieces {
                let at = p.start * es..p.end * es;
                // SAFETY: `buf` holds these bytes (the contract); `h` stays untouched
                // until the piece's event has passed (below).
                cuda(unsafe { dtoh(&stream, &mut h[at.clone()], buf.addr + at.start as u64) })?;
                down.push(cuda_event(&stream).map_err(|e| self.refuse(e))?);
            }
            for (k, (p, ev)) in pieces.iter().zip(&down).enumerate() {
                let at = p.start * es..p.end * es;
                cuda(ev.synchronize().map_err(drv("cuEventSynchronize")))?;
                let left = (pieces.len() > 1).then_some(pieces.len() - 1 - k);
                let run = piece(p.len(), left)?;
                self.run_now(|e| run(e, &mut h[at.clone()]))?;
                // SAFETY: as above; `h` outlives the synchronize below.
                cuda(unsafe { htod(&stream, buf.addr + at.start as u64, &h[at]) })?;
            }
            cuda(dev.synchronize())
        });
        if r.is_err() {
            // Copies may still be queued on the pinned buffer, which the next staged
            // call of this thread reuses.
            let _ = dev.synchronize();
        }
        r
    }

    /// Runs `f` on host copies of device buffers, in one pinned staging buffer: `ins`
    /// (and `outs` too when `load_outs`: parts `f` does not write keep their bytes)
    /// are copied to the host first, `f` gets the buffer and each one's byte range,
    /// then `outs` are copied back.
    fn staged(
        &self,
        dev: &Device,
        ins: &[DeviceBuf],
        outs: &[DeviceBuf],
        load_outs: bool,
        f: impl FnOnce(&mut [u8], &[Range<usize>], &[Range<usize>]) -> Result<()>,
    ) -> Result<()> {
        let mut at = 0;
        let mut place = |b: &DeviceBuf| {
            let r = at..at + b.bytes();
            at = r.end.next_multiple_of(8);
            r
        };
        let ri: Vec<Range<usize>> = ins.iter().map(&mut place).collect();
        let ro: Vec<Range<usize>> = outs.iter().map(&mut place).collect();
        let stream = dev.stream().clone();
        with_pinned(dev, at, |h| {
            let loads = ins.iter().zip(&ri);
            let loads = loads.chain(outs.iter().zip(&ro).filter(|_| load_outs));
            for (b, r) in loads {
                // SAFETY: `b` holds r.len() bytes (the contract); synchronized below.
                unsafe { dtoh(&stream, &mut h[r.clone()], b.addr)? };
            }
            dev.synchronize()?;
            f(h, &ri, &ro)?;
            for (b, r) in outs.iter().zip(&ro) {
                // SAFETY: as above; `h` outlives the synchronize.
                unsafe { htod(&stream, b.addr, &h[r.clone()])? };
            }
            dev.synchronize()
        })
    }

    /// [`Communicator::all_reduce`] on device memory a framework owns.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn all_reduce_device_raw(&self, buf: DeviceBuf, op: ReduceOp) -> Result<()> {
        check_op(buf.dtype, op).map_err(|e| self.refuse(e))?;
        let dev = self.device_for("all_reduce", &[(&buf, "buffer")])?;
        let (n, count, es) = (self.world_size, buf.len, buf.dtype.size());
        let bytes = buf.bytes();
        if self.device_pull {
            let algo = self.device_all_reduce_algorithm(bytes);
            let fp = self.fingerprint(OpKind::AllReduce, buf.dtype, Some(op), count, None, algo);
            let io = DeviceIo::in_place(buf.addr, bytes);
            let shot = match algo {
                Algorithm::OneShot => Shot::One,
                // One block: each block is two more hand-overs between ranks.
                Algorithm::TwoShot => Shot::Two { block: 0 },
                _ => {
                    return self.pull_device(&fp, dev.ordinal, io, buf.dtype, Some(op), &|q| {
                        ring::all_reduce(q, n, count, es, count.max(1))
                    })
                }
            };
            return self.shot_device(&fp, shot, dev.ordinal, io, buf.dtype, op);
        }
        // Each piece is an all-reduce of its own, by the algorithm for its size; a
        // buffer of several pieces says so in each one's fingerprint (a buffer of one
        // is fingerprinted as host buffers are, so peers may pass either).
        self.staged_reduce(&dev, buf, true, &|c, left| {
            let run: PieceRun = Box::new(self.all_reduce_bytes(buf.dtype, c, op, left)?);
            Ok(run)
        })
    }

    /// [`Communicator::reduce_scatter`] on device memory a framework owns: `send` holds
    /// `world_size` blocks of `recv.len` elements; rank `r` receives the reduction of
    /// block `r`.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn reduce_scatter_device_raw(
        &self,
        send: DeviceBuf,
        recv: DeviceBuf,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, rank, es) = (self.world_size, self.rank, send.dtype.size());
        self.check(send.dtype == recv.dtype && send.len == recv.len * n, || {
            format!(
                "reduce_scatter: send has {} {} elements but must hold world_size ({n}) \
                     blocks of recv's {} {} elements",
                send.len, send.dtype, recv.len, recv.dtype
            )
        })?;
        check_op(send.dtype, op).map_err(|e| self.refuse(e))?;
        let dev = self.device_for("reduce_scatter", &[(&send, "send"), (&recv, "recv")])?;
        let fp = self.fingerprint(
            OpKind::ReduceScatter,
            send.dtype,
            Some(op),
            send.len,
            None,
            Algorithm::Ring,
        );
        let per = recv.len;
        let chunks = schedule::chunks_from_counts(&vec![per; n]);
        if self.device_pull {
            let (send, _copy) = self.unalias(&dev, send, &recv)?;
            let io = DeviceIo {
                input: (send.addr, send.bytes()),
                output: (recv.addr, recv.bytes()),
                bytes: send.bytes(),
                input_at: 0,
                output_at: chunks[rank].start * es,
            };
            let whole = per.max(1);
            return self.pull_device(&fp, dev.ordinal, io, send.dtype, Some(op), &|q| {
                ring::reduce_scatter(q, n, &chunks, es, whole)
            });
        }
        let seg = self.cfg.tuning.segment_bytes;
        let stream = dev.stream().clone();
        with_pinned(&dev, send.bytes(), |h| {
            // SAFETY: `send` holds h.len() bytes; synchronized before use.
            unsafe { dtoh(&stream, h, send.addr)? };
            dev.synchronize()?;
            self.run_now(|e| {
                let plan =
                    ring::reduce_scatter(rank, n, &chunks, es, ring::seg_elems(&chunks, es, seg));
                let mut comb = HostCombine {
                    dtype: send.dtype,
                    op,
                    world_size: n,
                };
                e.stream(Channel::Collective, &fp, &plan, Data::Write(h), &mut comb)
            })?;
            let mine = &h[chunks[rank].start * es..chunks[rank].end * es];
            // SAFETY: `recv` holds exactly this chunk's bytes.
            unsafe { htod(&stream, recv.addr, mine)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::all_gather`] on device memory a framework owns
    /// (`recv.len == world_size * send.len`; `send` may be `recv`'s own block).
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn all_gather_device_raw(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<()> {
        let (n, rank, es) = (self.world_size, self.rank, send.dtype.size());
        self.check(send.dtype == recv.dtype && recv.len == send.len * n, || {
            format!(
                "all_gather: recv has {} {} elements but must hold world_size ({n}) \
                     blocks of send's {} {} elements",
                recv.len, recv.dtype, send.len, send.dtype
            )
        })?;
        let dev = self.device_for("all_gather", &[(&send, "send"), (&recv, "recv")])?;
        let fp = self.fingerprint(
            OpKind::AllGather,
            send.dtype,
            None,
            recv.len,
            None,
            Algorithm::Ring,
        );
        let chunks = schedule::chunks_from_counts(&vec![send.len; n]);
        if self.device_pull {
            let (send, _copy) = self.unalias(&dev, send, &recv)?;
            let io = DeviceIo {
                input: (send.addr, send.bytes()),
                output: (recv.addr, recv.bytes()),
                bytes: recv.bytes(),
                input_at: chunks[rank].start * es,
                output_at: 0,
            };
            let whole = send.len.max(1);
            return self.pull_device(&fp, dev.ordinal, io, send.dtype, None, &|q| {
                ring::all_gather(q, n, &chunks, es, whole)
            });
        }
        let seg = self.cfg.tuning.segment_bytes;
        let stream = dev.stream().clone();
        with_pinned(&dev, recv.bytes(), |h| {
            let mine = chunks[rank].start * es..chunks[rank].end * es;
            // SAFETY: `send` holds exactly this chunk's bytes; synchronized before use.
            unsafe { dtoh(&stream, &mut h[mine], send.addr)? };
            dev.synchronize()?;
            self.run_now(|e| {
                let plan =
                    ring::all_gather(rank, n, &chunks, es, ring::seg_elems(&chunks, es, seg));
                e.stream(
                    Channel::Collective,
                    &fp,
                    &plan,
                    Data::Write(h),
                    &mut NoCombine,
                )
            })?;
            // SAFETY: `recv` holds h.len() bytes.
            unsafe { htod(&stream, recv.addr, h)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::broadcast`] on device memory a framework owns.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn broadcast_device_raw(&self, buf: DeviceBuf, root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let dev = self.device_for("broadcast", &[(&buf, "buffer")])?;
        let fp = self.fingerprint(
            OpKind::Broadcast,
            buf.dtype,
            None,
            buf.len,
            Some(root),
            Algorithm::Chain,
        );
        let (n, rank, es) = (self.world_size, self.rank, buf.dtype.size());
        let bytes = buf.bytes();
        if self.device_pull {
            let io = DeviceIo::in_place(buf.addr, bytes);
            return self.pull_device(&fp, dev.ordinal, io, buf.dtype, None, &|q| {
                chain::broadcast(q, n, root, bytes, chain_segment(true, bytes, n, es, 0))
            });
        }
        let seg = chain_segment(false, bytes, n, es, self.cfg.tuning.segment_bytes);
        let stream = dev.stream().clone();
        with_pinned(&dev, bytes, |h| {
            if rank == root {
                // SAFETY: `buf` holds h.len() bytes; synchronized before use.
                unsafe { dtoh(&stream, h, buf.addr)? };
                dev.synchronize()?;
            }
            self.run_now(|e| {
                let plan = chain::broadcast(rank, n, root, bytes, seg);
                e.stream(
                    Channel::Collective,
                    &fp,
                    &plan,
                    Data::Write(h),
                    &mut NoCombine,
                )
            })?;
            if rank != root {
                // SAFETY: as above.
                unsafe { htod(&stream, buf.addr, h)? };
                dev.synchronize()?;
            }
            Ok(())
        })
    }

    /// [`Communicator::reduce`] on device memory a framework owns: `root`'s `buf`
    /// receives the reduction; elsewhere `buf` is working space.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn reduce_device_raw(
        &self,
        buf: DeviceBuf,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        check_op(buf.dtype, op).map_err(|e| self.refuse(e))?;
        self.check_root("reduce", root)?;
        let dev = self.device_for("reduce", &[(&buf, "buffer")])?;
        let fp = || {
            self.fingerprint(
                OpKind::Reduce,
                buf.dtype,
                Some(op),
                buf.len,
                Some(root),
                Algorithm::Chain,
            )
        };
        let (n, es) = (self.world_size, buf.dtype.size());
        let bytes = buf.bytes();
        if self.device_pull {
            let io = DeviceIo::in_place(buf.addr, bytes);
            return self.pull_device(&fp(), dev.ordinal, io, buf.dtype, Some(op), &|q| {
                chain::reduce(q, n, root, bytes, chain_segment(true, bytes, n, es, 0))
            });
        }
        // One piece: the root's place in the fingerprint is taken, and a reduce to
        // one rank is not what staging is measured by.
        let cfg_seg = self.cfg.tuning.segment_bytes;
        self.staged_reduce(&dev, buf, false, &|c, _| {
            let (b, fp) = (c * es, fp());
            let seg = chain_segment(false, b, n, es, cfg_seg);
            let mut comb = HostCombine {
                dtype: buf.dtype,
                op,
                world_size: n,
            };
            let run: PieceRun = Box::new(move |e, h| {
                let plan = chain::reduce(e.rank, n, root, b, seg);
                e.stream(Channel::Collective, &fp, &plan, Data::Write(h), &mut comb)
            });
            Ok(run)
        })
    }

    /// A data-moving collective `what` from `send` into `recv`, staged through pinned
    /// host memory: `f` runs the host collective on the two host copies (`recv`'s
    /// loaded first when `load_recv`, so parts `f` does not write keep their bytes).
    fn staged_move(
        &self,
        what: &str,
        send: DeviceBuf,
        recv: DeviceBuf,
        load_recv: bool,
        f: impl FnOnce(&[u8], &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.check(send.dtype == recv.dtype, || {
            format!("{what}: send is {}, recv {}", send.dtype, recv.dtype)
        })?;
        let dev = self.device_for(what, &[(&send, "send"), (&recv, "recv")])?;
        self.staged(&dev, &[send], &[recv], load_recv, |h, ri, ro| {
            let (a, b) = h.split_at_mut(ro[0].start);
            f(&a[ri[0].clone()], &mut b[..ro[0].len()])
        })
    }

    /// [`Communicator::all_to_all`] on device memory a framework owns, or with
    /// `counts` = `(send_counts, send_displs, recv_counts, recv_displs)`
    /// [`Communicator::all_to_allv`]; staged through pinned host memory. Parts of `recv`
    /// no block lands in keep their bytes.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn all_to_all_device_raw(
        &self,
        send: DeviceBuf,
        recv: DeviceBuf,
        counts: Option<Counts<'_>>,
    ) -> Result<()> {
        self.staged_move("all_to_all", send, recv, true, |s, r| {
            crate::reduce::by_dtype!(send.dtype, T => {
                let (s, r) = (elems::<T>(s)?, elems_mut::<T>(r)?);
                match counts {
                    None => self.all_to_all(s, r),
                    Some((sc, sd, rc, rd)) => self.all_to_allv(s, sc, sd, r, rc, rd),
                }
            }, other => Err(untyped(other)))
        })
    }

    /// [`Communicator::gather`] on device memory a framework owns (`recv` may be empty
    /// off the root); staged through pinned host memory.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn gather_device_raw(
        &self,
        send: DeviceBuf,
        recv: DeviceBuf,
        root: usize,
    ) -> Result<()> {
        self.staged_move("gather", send, recv, false, |s, r| {
            crate::reduce::by_dtype!(send.dtype, T => self.gather(elems::<T>(s)?, elems_mut::<T>(r)?, root),
                other => Err(untyped(other)))
        })
    }

    /// [`Communicator::scatter`] on device memory a framework owns (`send` may be empty
    /// off the root); staged through pinned host memory.
    ///
    /// # Safety
    /// The module docs' contract.
    pub unsafe fn scatter_device_raw(
        &self,
        send: DeviceBuf,
        recv: DeviceBuf,
        root: usize,
    ) -> Result<()> {
        self.staged_move("scatter", send, recv, false, |s, r| {
            crate::reduce::by_dtype!(send.dtype, T => self.scatter(elems::<T>(s)?, elems_mut::<T>(r)?, root),
                other => Err(untyped(other)))
        })
    }

    /// Runs `f` on the raw form of `buf` (cudarc's guard orders its other uses).
    fn on_slice<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        f: impl FnOnce(DeviceBuf) -> Result<()>,
    ) -> Result<()> {
        let dev = self.device_of(buf)?;
        let len = buf.len();
        let (d, _g) = buf.device_ptr_mut(dev.stream());
        f(slice_buf::<T>(&dev, len, d))
    }

    /// Runs `f` on the raw forms of `send` and `recv`.
    fn on_slices<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        f: impl FnOnce(DeviceBuf, DeviceBuf) -> Result<()>,
    ) -> Result<()> {
        let dev = self.device_of(send)?;
        let stream = dev.stream().clone();
        let (ls, lr) = (send.len(), recv.len());
        let (s, _gs) = send.device_ptr(&stream);
        let (r, _gr) = recv.device_ptr_mut(&stream);
        f(slice_buf::<T>(&dev, ls, s), slice_buf::<T>(&dev, lr, r))
    }

    // The slice forms. SAFETY (each): a cudarc slice is a live allocation of its
    // elements in its device's primary context, and the guards order cudarc's other
    // uses of it around our stream: the raw forms' contract.

    /// [`Communicator::all_reduce`] on device memory.
    pub fn all_reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: see "The slice forms" above.
        self.on_slice(buf, |b| unsafe { self.all_reduce_device_raw(b, op) })
    }

    /// [`Communicator::reduce_scatter`] on device memory: `send` holds `world_size`
    /// blocks of `recv.len()` elements; rank `r` receives the reduction of block `r`.
    pub fn reduce_scatter_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: see "The slice forms" above.
        self.on_slices(send, recv, |s, r| unsafe {
            self.reduce_scatter_device_raw(s, r, op)
        })
    }

    /// [`Communicator::all_gather`] on device memory
    /// (`recv.len() == world_size * send.len()`).
    pub fn all_gather_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        // SAFETY: see "The slice forms" above.
        self.on_slices(send, recv, |s, r| unsafe {
            self.all_gather_device_raw(s, r)
        })
    }

    /// [`Communicator::broadcast`] on device memory.
    pub fn broadcast_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        // SAFETY: see "The slice forms" above.
        self.on_slice(buf, |b| unsafe { self.broadcast_device_raw(b, root) })
    }

    /// [`Communicator::reduce`] on device memory: `root`'s `buf` receives the
    /// reduction; elsewhere `buf` is working space.
    pub fn reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        // SAFETY: see "The slice forms" above.
        self.on_slice(buf, |b| unsafe { self.reduce_device_raw(b, op, root) })
    }
}
