//! Collectives on device buffers (cudarc `CudaSlice<T>`, feature `cuda`):
//! `all_reduce_device`, `reduce_scatter_device`, `all_gather_device`,
//! `broadcast_device` and `reduce_device` on [`Communicator`].
//!
//! Over CUDA IPC (`TransportKind::CudaIpc`) the engine's pull executor runs the call's
//! plan on the device: every rank reads its neighbours' device memory directly, nothing
//! is staged. Over any other transport the buffer is staged through pinned host memory
//! and the ordinary plan runs on it, every reduction on the device
//! (`crate::cuda::staging`). Either way the call goes through the engine's run
//! wrapper: it is fingerprinted (a mismatched call is [`crate::Error::Mismatch`]), it
//! waits under the communicator's timeout and abort handle, and a failure — a CUDA
//! error included — poisons the communicator.

use super::Communicator;
use crate::algo::all_reduce_plan;
use crate::algo::select::chain_segment;
use crate::algo::{chain, ring, schedule, Algorithm, Plan};
use crate::cuda::mem::{dtoh, htod};
use crate::cuda::staging::{with_pinned, DeviceCombine};
use crate::cuda::{Device, DeviceReducer};
use crate::engine::{Data, Engine, PullCall};
use crate::error::Result;
use crate::reduce::{DataType, Element, NoCombine, ReduceOp};
use crate::transport::{CallMem, Channel};
use crate::wire::{Fingerprint, OpKind};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use std::mem::size_of;
use std::sync::Arc;

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

impl Communicator {
    /// The device a buffer lives on (opened once per process, with our stream), or a
    /// refusal that poisons the communicator (the peers would wait for this rank).
    fn device_of<T>(&self, buf: &CudaSlice<T>) -> Result<Arc<Device>> {
        Device::shared(buf.context().ordinal()).map_err(|e| self.refuse(e))
    }

    /// Runs `plan_of` (any rank's plan of the call, whole chunks) on the transport's
    /// memory peers over device memory.
    #[allow(clippy::too_many_arguments)]
    fn pull_device(
        &self,
        fp: &Fingerprint,
        ordinal: usize,
        io: DeviceIo,
        dtype: DataType,
        op: Option<ReduceOp>,
        plan_of: &dyn Fn(usize) -> Plan,
    ) -> Result<()> {
        let call = PullCall {
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
        };
        self.run_now(|e| e.pull(fp, plan_of, &call))
    }

    /// Runs `plan` over the links on `buf` in place, staged through pinned host memory,
    /// combining on the device with `op`.
    fn staged_reduce<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        fp: &Fingerprint,
        plan: impl FnOnce(&Engine) -> Plan,
    ) -> Result<()> {
        let dev = self.device_of(buf)?;
        let red = DeviceReducer::new(dev.clone()).map_err(|e| self.refuse(e))?;
        let bytes = buf.len() * size_of::<T>();
        let stream = dev.stream().clone();
        let (d, _guard) = buf.device_ptr_mut(&stream);
        let n = self.world_size;
        with_pinned(&dev, bytes, |h| {
            // SAFETY: `d` is the slice's allocation of `bytes`; synchronized before use.
            unsafe { dtoh(&stream, h, d)? };
            dev.synchronize()?;
            self.run_now(|e| {
                let plan = plan(e);
                let mut comb = DeviceCombine::new(&red, T::DTYPE, op, n)?;
                e.stream(Channel::Collective, fp, &plan, Data::Write(h), &mut comb)
            })?;
            // SAFETY: as above; `h` outlives the synchronize.
            unsafe { htod(&stream, d, h)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::all_reduce`] on device memory.
    pub fn all_reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_op::<T>(op)?;
        let (n, count, es) = (self.world_size, buf.len(), size_of::<T>());
        let bytes = count * es;
        if self.device_pull {
            let fp = self.fingerprint(
                OpKind::AllReduce,
                T::DTYPE,
                Some(op),
                count,
                None,
                Algorithm::Ring,
            );
            let dev = self.device_of(buf)?;
            let (d, _g) = buf.device_ptr_mut(dev.stream());
            let io = DeviceIo::in_place(d, bytes);
            return self.pull_device(&fp, dev.ordinal, io, T::DTYPE, Some(op), &|q| {
                ring::all_reduce(q, n, count, es, count.max(1))
            });
        }
        let (algo, layout) = self.all_reduce_choice(bytes)?;
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), count, None, algo);
        let seg = self.cfg.tuning.segment_bytes;
        self.staged_reduce(buf, op, &fp, |e| {
            all_reduce_plan(algo, e.rank, n, count, es, seg, &layout)
        })
    }

    /// [`Communicator::reduce_scatter`] on device memory: `send` holds `world_size`
    /// blocks of `recv.len()` elements; rank `r` receives the reduction of block `r`.
    pub fn reduce_scatter_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, rank, es) = (self.world_size, self.rank, size_of::<T>());
        self.check(send.len() == recv.len() * n, || {
            format!(
                "reduce_scatter_device: send has {} elements but must hold world_size ({n}) \
                 blocks of recv's {} elements",
                send.len(),
                recv.len()
            )
        })?;
        self.check_op::<T>(op)?;
        let fp = self.fingerprint(
            OpKind::ReduceScatter,
            T::DTYPE,
            Some(op),
            send.len(),
            None,
            Algorithm::Ring,
        );
        let per = recv.len();
        let chunks = schedule::chunks_from_counts(&vec![per; n]);
        let dev = self.device_of(send)?;
        let stream = dev.stream().clone();
        if self.device_pull {
            let (s, _gs) = send.device_ptr(&stream);
            let (r, _gr) = recv.device_ptr_mut(&stream);
            let io = DeviceIo {
                input: (s, send.len() * es),
                output: (r, per * es),
                bytes: send.len() * es,
                input_at: 0,
                output_at: chunks[rank].start * es,
            };
            let whole = per.max(1);
            return self.pull_device(&fp, dev.ordinal, io, T::DTYPE, Some(op), &|q| {
                ring::reduce_scatter(q, n, &chunks, es, whole)
            });
        }
        let red = DeviceReducer::new(dev.clone()).map_err(|e| self.refuse(e))?;
        let seg = self.cfg.tuning.segment_bytes;
        let (s, _gs) = send.device_ptr(&stream);
        let (r, _gr) = recv.device_ptr_mut(&stream);
        with_pinned(&dev, send.len() * es, |h| {
            // SAFETY: `s` holds h.len() bytes; synchronized before use.
            unsafe { dtoh(&stream, h, s)? };
            dev.synchronize()?;
            self.run_now(|e| {
                let plan =
                    ring::reduce_scatter(rank, n, &chunks, es, ring::seg_elems(&chunks, es, seg));
                let mut comb = DeviceCombine::new(&red, T::DTYPE, op, n)?;
                e.stream(Channel::Collective, &fp, &plan, Data::Write(h), &mut comb)
            })?;
            let mine = &h[chunks[rank].start * es..chunks[rank].end * es];
            // SAFETY: `r` holds recv.len() elements == this chunk.
            unsafe { htod(&stream, r, mine)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::all_gather`] on device memory
    /// (`recv.len() == world_size * send.len()`).
    pub fn all_gather_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let (n, rank, es) = (self.world_size, self.rank, size_of::<T>());
        self.check(recv.len() == send.len() * n, || {
            format!(
                "all_gather_device: recv has {} elements but must hold world_size ({n}) \
                 blocks of send's {} elements",
                recv.len(),
                send.len()
            )
        })?;
        let fp = self.fingerprint(
            OpKind::AllGather,
            T::DTYPE,
            None,
            recv.len(),
            None,
            Algorithm::Ring,
        );
        let chunks = schedule::chunks_from_counts(&vec![send.len(); n]);
        let dev = self.device_of(send)?;
        let stream = dev.stream().clone();
        let (s, _gs) = send.device_ptr(&stream);
        let recv_bytes = recv.len() * es;
        let (r, _gr) = recv.device_ptr_mut(&stream);
        if self.device_pull {
            let io = DeviceIo {
                input: (s, send.len() * es),
                output: (r, recv_bytes),
                bytes: recv_bytes,
                input_at: chunks[rank].start * es,
                output_at: 0,
            };
            let whole = send.len().max(1);
            return self.pull_device(&fp, dev.ordinal, io, T::DTYPE, None, &|q| {
                ring::all_gather(q, n, &chunks, es, whole)
            });
        }
        let seg = self.cfg.tuning.segment_bytes;
        with_pinned(&dev, recv_bytes, |h| {
            let mine = chunks[rank].start * es..chunks[rank].end * es;
            // SAFETY: `s` holds exactly this chunk's bytes; synchronized before use.
            unsafe { dtoh(&stream, &mut h[mine], s)? };
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
            // SAFETY: `r` holds h.len() bytes.
            unsafe { htod(&stream, r, h)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::broadcast`] on device memory.
    pub fn broadcast_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        self.check_root("broadcast_device", root)?;
        let fp = self.fingerprint(
            OpKind::Broadcast,
            T::DTYPE,
            None,
            buf.len(),
            Some(root),
            Algorithm::Chain,
        );
        let (n, rank, es) = (self.world_size, self.rank, size_of::<T>());
        let bytes = buf.len() * es;
        let dev = self.device_of(buf)?;
        let stream = dev.stream().clone();
        let (d, _g) = buf.device_ptr_mut(&stream);
        if self.device_pull {
            let io = DeviceIo::in_place(d, bytes);
            return self.pull_device(&fp, dev.ordinal, io, T::DTYPE, None, &|q| {
                chain::broadcast(q, n, root, bytes, chain_segment(true, bytes, n, es, 0))
            });
        }
        let seg = chain_segment(false, bytes, n, es, self.cfg.tuning.segment_bytes);
        with_pinned(&dev, bytes, |h| {
            if rank == root {
                // SAFETY: `d` holds h.len() bytes; synchronized before use.
                unsafe { dtoh(&stream, h, d)? };
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
                unsafe { htod(&stream, d, h)? };
                dev.synchronize()?;
            }
            Ok(())
        })
    }

    /// [`Communicator::reduce`] on device memory: `root`'s `buf` receives the
    /// reduction; elsewhere `buf` is working space.
    pub fn reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_op::<T>(op)?;
        self.check_root("reduce_device", root)?;
        let fp = self.fingerprint(
            OpKind::Reduce,
            T::DTYPE,
            Some(op),
            buf.len(),
            Some(root),
            Algorithm::Chain,
        );
        let (n, es) = (self.world_size, size_of::<T>());
        let bytes = buf.len() * es;
        if self.device_pull {
            let dev = self.device_of(buf)?;
            let (d, _g) = buf.device_ptr_mut(dev.stream());
            let io = DeviceIo::in_place(d, bytes);
            return self.pull_device(&fp, dev.ordinal, io, T::DTYPE, Some(op), &|q| {
                chain::reduce(q, n, root, bytes, chain_segment(true, bytes, n, es, 0))
            });
        }
        let seg = chain_segment(false, bytes, n, es, self.cfg.tuning.segment_bytes);
        self.staged_reduce(buf, op, &fp, |e| chain::reduce(e.rank, n, root, bytes, seg))
    }
}
