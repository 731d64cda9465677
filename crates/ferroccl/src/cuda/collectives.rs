//! Collectives on device buffers (cudarc `CudaSlice<T>`) over a host transport (TCP,
//! local pipes; RDMA when it lands): `all_reduce_device`, `reduce_scatter_device`,
//! `all_gather_device`, `broadcast_device` and `reduce_device` on
//! [`Communicator`].
//!
//! **How the data moves (staged).** The device buffer is copied into a page-locked
//! (pinned) host buffer, the ordinary host algorithm runs on it — the same ring,
//! recursive doubling or chain as for host buffers, with the same fingerprints, so
//! peers may even mix host and device calls — and the result is copied back. Every
//! *reduction* runs on the device: each time a segment arrives, the local segment and
//! the received one are copied to device scratch, combined by the `cuda/reduce.cu`
//! kernel, and the result copied back into the pinned buffer, from which the algorithm
//! sends it on (Avg's division likewise). Received frames land in the engine's
//! (pageable) scratch first, not directly in pinned memory; doing that, and keeping the
//! working copy on the device between segments, would save copies — see the issue
//! note. Collectives without a reduction (all-gather, broadcast) only stage.
//!
//! Over CUDA IPC ([`crate::transport::cuda_ipc`]) every one of these reads the
//! neighbours' device memory directly and nothing is staged.
//!
//! **Failures.** A CUDA error inside a collective aborts this communicator (its links
//! close) and is returned as [`Error::Cuda`]; as for any mid-operation failure, the
//! communicator is poisoned afterwards.

use super::mem::{dtoh, htod, DeviceAlloc, PinnedBuf};
use super::{Device, DeviceReducer};
use crate::comm::Communicator;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};
use crate::transport::cuda_ipc::{IpcRing, IpcState};
use crate::wire::{Algorithm, OpKind};
use crate::{broadcast, ring, schedule, Element};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

thread_local! {
    /// The pinned staging buffer of this thread, grown on demand and kept between
    /// calls (pinning memory is slow).
    static PINNED: RefCell<Option<PinnedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` on at least `bytes` of this thread's pinned staging buffer, with `dev`'s
/// context current.
fn with_pinned<R>(dev: &Device, bytes: usize, f: impl FnOnce(&mut [u8]) -> Result<R>) -> Result<R> {
    dev.bind()?;
    PINNED.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|p| p.len() < bytes) {
            *slot = None;
            *slot = Some(PinnedBuf::new(dev.context(), bytes)?);
        }
        let Some(buf) = slot.as_mut() else {
            return Err(Error::InvalidArgument(
                "pinned staging buffer missing".into(),
            ));
        };
        f(&mut buf.as_mut_slice()[..bytes])
    })
}

/// Combines host segments on the device (stage both operands up, launch, stage the
/// result back). Used as the ring's `reduce` and `finish` callbacks, which cannot
/// return errors: the first error is kept, the communicator's abort flag raised (so the
/// algorithm stops waiting), and the error returned after the algorithm.
struct DeviceCombine<'a> {
    red: &'a DeviceReducer,
    dt: DataType,
    op: ReduceOp,
    world: usize,
    a: RefCell<DeviceAlloc>,
    b: RefCell<DeviceAlloc>,
    err: RefCell<Option<Error>>,
    abort: Arc<AtomicBool>,
}

impl<'a> DeviceCombine<'a> {
    fn new(red: &'a DeviceReducer, dt: DataType, op: ReduceOp, e: &Engine) -> Result<Self> {
        Ok(DeviceCombine {
            red,
            dt,
            op,
            world: e.world_size,
            a: RefCell::new(DeviceAlloc::new(red.device().context(), 0)?),
            b: RefCell::new(DeviceAlloc::new(red.device().context(), 0)?),
            err: RefCell::new(None),
            abort: e.abort.clone(),
        })
    }

    fn fail(&self, e: Error) {
        let mut slot = self.err.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
            self.abort.store(true, Ordering::Relaxed);
        }
    }

    fn combine(&self, dst: &mut [u8], src: &[u8]) {
        if self.err.borrow().is_none() {
            if let Err(e) = self.try_combine(dst, src) {
                self.fail(e);
            }
        }
    }

    fn try_combine(&self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        let (mut a, mut b) = (self.a.borrow_mut(), self.b.borrow_mut());
        a.reserve(dst.len())?;
        b.reserve(src.len())?;
        let stream = self.red.device().stream();
        let n = dst.len() / self.dt.size();
        // SAFETY: a and b hold at least dst.len() == src.len() bytes; the host slices
        // stay borrowed until the synchronize below.
        unsafe {
            htod(stream, a.ptr(), dst)?;
            htod(stream, b.ptr(), src)?;
            self.red
                .reduce_raw(stream, self.dt, self.op, a.ptr(), 0, a.ptr(), b.ptr(), n)?;
            dtoh(stream, dst, a.ptr())?;
        }
        self.red.device().synchronize()
    }

    fn finish(&self, dst: &mut [u8]) {
        if self.op != ReduceOp::Avg || self.err.borrow().is_some() {
            return;
        }
        let r = (|| {
            let mut a = self.a.borrow_mut();
            a.reserve(dst.len())?;
            let stream = self.red.device().stream();
            let n = dst.len() / self.dt.size();
            // SAFETY: as in try_combine.
            unsafe {
                htod(stream, a.ptr(), dst)?;
                self.red
                    .scale_raw(stream, self.dt, a.ptr(), n, self.world as f64)?;
                dtoh(stream, dst, a.ptr())?;
            }
            self.red.device().synchronize()
        })();
        if let Err(e) = r {
            self.fail(e);
        }
    }

    fn into_result(self) -> Result<()> {
        match self.err.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The device a slice lives on, with our stream and kernels.
fn reducer_for<T>(buf: &CudaSlice<T>) -> Result<DeviceReducer> {
    let dev = Device::shared(buf.context().ordinal())?;
    DeviceReducer::new(dev)
}

impl Communicator {
    fn refuse_device(&self, what: &str, ok: bool, why: impl FnOnce() -> String) -> Result<()> {
        self.check(ok, || format!("{what}: {}", why()))
    }

    /// [`Communicator::all_reduce`] on device memory: staged through pinned host memory,
    /// reduced on the device (see the [module docs](crate::cuda::collectives)).
    pub fn all_reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_op::<T>(op)?;
        if self.ipc.borrow().is_some() {
            return self.all_reduce_ipc(buf, op);
        }
        let algo = self.all_reduce_algorithm(buf.len() * size_of::<T>());
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None, algo);
        self.staged_reduce(buf, op, |e, h, red, fin| {
            crate::comm::run_all_reduce(e, h, size_of::<T>(), algo, &fp, red, fin)
        })
    }

    /// Runs a reduction `alg` over `buf` in place: staged down to pinned host memory,
    /// run on this rank's engine with `op` combined on the device, staged back.
    fn staged_reduce<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        alg: impl FnOnce(
            &mut Engine,
            &mut [u8],
            &dyn Fn(&mut [u8], &[u8]),
            &dyn Fn(&mut [u8]),
        ) -> Result<()>,
    ) -> Result<()> {
        let red = reducer_for(buf).map_err(|e| self.refuse(e))?;
        let bytes = buf.len() * size_of::<T>();
        let stream = red.device().stream().clone();
        let (d, _guard) = buf.device_ptr_mut(&stream);
        with_pinned(red.device(), bytes, |h| {
            // SAFETY: `d` is the slice's allocation of `bytes`; synchronized before use.
            unsafe { dtoh(&stream, h, d)? };
            red.device().synchronize()?;
            self.run_now(|e| {
                let c = DeviceCombine::new(&red, T::DTYPE, op, e)?;
                let red_f = |dst: &mut [u8], src: &[u8]| c.combine(dst, src);
                let fin_f = |dst: &mut [u8]| c.finish(dst);
                let r = alg(e, h, &red_f, &fin_f);
                c.into_result().and(r)
            })?;
            // SAFETY: as above; `h` outlives the synchronize.
            unsafe { htod(&stream, d, h)? };
            red.device().synchronize()
        })
    }

    /// Runs `f` on this rank's CUDA-IPC ring (built on first use, on `ordinal`), with
    /// the store connection and communicator id it exchanges handles through. A
    /// failure aborts the communicator: the neighbours are out of step with it.
    fn with_ipc_ring(
        &self,
        ordinal: usize,
        f: impl FnOnce(&mut IpcRing, &mut crate::rendezvous::StoreClient, u64) -> Result<()>,
    ) -> Result<()> {
        let mut guard = self.ipc.borrow_mut();
        let Some(st) = guard.as_mut() else {
            return Err(Error::InvalidArgument("cuda-ipc state missing".into()));
        };
        if let Some(r) = st.ring.as_ref().filter(|r| r.ordinal() != ordinal) {
            let why = format!(
                "cuda-ipc: this rank's ring runs on device {}, the buffer is on device {ordinal}",
                r.ordinal()
            );
            return Err(self.refuse(Error::InvalidArgument(why)));
        }
        if st.ring.is_none() {
            let dev = Device::shared(ordinal).map_err(|e| self.refuse(e))?;
            let cfg = self.config();
            let ring = IpcRing::new(dev, st.comm_id, self.rank(), self.world_size(), cfg.timeout)
                .map_err(|e| self.refuse(e))?;
            st.ring = Some(ring);
        }
        let IpcState {
            store,
            comm_id,
            ring,
        } = st;
        let Some(ring) = ring.as_mut() else {
            return Err(Error::InvalidArgument("cuda-ipc ring missing".into()));
        };
        f(ring, store, *comm_id).inspect_err(|_| self.abort_handle().abort())
    }

    /// Runs `f` on the IPC ring with the device addresses of `send` and `recv` (both
    /// borrowed, and ordered against their other uses, until it returns).
    fn ipc_send_recv<T: DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        f: impl FnOnce(&mut IpcRing, &mut crate::rendezvous::StoreClient, u64, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let ordinal = send.context().ordinal();
        let stream = Device::shared(ordinal)?.stream().clone();
        let (s, _gs) = send.device_ptr(&stream);
        let (r, _gr) = recv.device_ptr_mut(&stream);
        self.with_ipc_ring(ordinal, |ring, store, id| f(ring, store, id, s, r))
    }

    /// The `cuda-ipc` transport's all-reduce: the neighbours' device memory is read
    /// directly ([`crate::transport::cuda_ipc`]); nothing is staged.
    fn all_reduce_ipc<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        // Counted like any all-reduce, so later operations' fingerprints still agree.
        let _ = self.fingerprint(
            OpKind::AllReduce,
            T::DTYPE,
            Some(op),
            buf.len(),
            None,
            Algorithm::Ring,
        );
        let count = buf.len();
        self.ipc_in_place(buf, |ring, store, id, d| {
            // SAFETY: `d` is the slice's allocation of `count` elements, mutably
            // borrowed (so unused by anything else) until this returns synchronized.
            unsafe { ring.all_reduce(store, id, d, count, T::DTYPE, op) }
        })
    }

    /// Runs `f` on the IPC ring with the device address of `buf` (borrowed, and
    /// ordered against its other uses, until it returns).
    fn ipc_in_place<T: DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        f: impl FnOnce(&mut IpcRing, &mut crate::rendezvous::StoreClient, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let ordinal = buf.context().ordinal();
        let stream = Device::shared(ordinal)?.stream().clone();
        let (d, _g) = buf.device_ptr_mut(&stream);
        self.with_ipc_ring(ordinal, |ring, store, id| f(ring, store, id, d))
    }

    /// [`Communicator::reduce_scatter`] on device memory: `send` holds `world_size`
    /// blocks of `recv.len()` elements; rank `r` receives the reduction of block `r`.
    pub fn reduce_scatter_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.world_size();
        self.refuse_device(
            "reduce_scatter_device",
            send.len() == recv.len() * n,
            || {
                format!(
                    "send has {} elements, expected world_size ({n}) × recv ({})",
                    send.len(),
                    recv.len()
                )
            },
        )?;
        self.check_op::<T>(op)?;
        let fp = self.fingerprint(
            OpKind::ReduceScatter,
            T::DTYPE,
            Some(op),
            send.len(),
            None,
            Algorithm::Ring,
        );
        if self.ipc.borrow().is_some() {
            let count = recv.len();
            return self.ipc_send_recv(send, recv, |ring, store, id, s, r| {
                // SAFETY: `s` holds n × count elements and `r` count, both borrowed
                // until this returns synchronized.
                unsafe { ring.reduce_scatter(store, id, s, r, count, T::DTYPE, op) }
            });
        }
        let red = reducer_for(send).map_err(|e| self.refuse(e))?;
        let esize = size_of::<T>();
        let chunks = schedule::chunks_from_counts(&vec![recv.len(); n]);
        let rank = self.rank();
        let stream = red.device().stream().clone();
        let (s, _gs) = send.device_ptr(&stream);
        let (r, _gr) = recv.device_ptr_mut(&stream);
        with_pinned(red.device(), send.len() * esize, |h| {
            // SAFETY: `s` holds h.len() bytes; synchronized before use.
            unsafe { dtoh(&stream, h, s)? };
            red.device().synchronize()?;
            self.run_now(|e| {
                let c = DeviceCombine::new(&red, T::DTYPE, op, e)?;
                let red_f = |dst: &mut [u8], src: &[u8]| c.combine(dst, src);
                let fin_f = |dst: &mut [u8]| c.finish(dst);
                let steps = 0..n.saturating_sub(1);
                let r = ring::run(e, h, esize, &chunks, steps, &fp, &red_f, &fin_f);
                c.into_result().and(r)
            })?;
            let mine = &h[chunks[rank].start * esize..chunks[rank].end * esize];
            // SAFETY: `r` holds recv.len() elements == this chunk.
            unsafe { htod(&stream, r, mine)? };
            red.device().synchronize()
        })
    }

    /// [`Communicator::all_gather`] on device memory
    /// (`recv.len() == world_size * send.len()`), staged through pinned host memory.
    pub fn all_gather_device<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let n = self.world_size();
        self.refuse_device("all_gather_device", recv.len() == send.len() * n, || {
            format!(
                "recv has {} elements, expected world_size ({n}) × send ({})",
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
        if self.ipc.borrow().is_some() {
            let count = send.len();
            return self.ipc_send_recv(send, recv, |ring, store, id, s, r| {
                // SAFETY: `s` holds count elements and `r` n × count, both borrowed
                // until this returns synchronized.
                unsafe { ring.all_gather(store, id, s, r, count, T::DTYPE) }
            });
        }
        let dev = Device::shared(send.context().ordinal()).map_err(|e| self.refuse(e))?;
        let esize = size_of::<T>();
        let chunks = schedule::chunks_from_counts(&vec![send.len(); n]);
        let rank = self.rank();
        let stream = dev.stream().clone();
        let (s, _gs) = send.device_ptr(&stream);
        let recv_bytes = recv.len() * esize;
        let (r, _gr) = recv.device_ptr_mut(&stream);
        with_pinned(&dev, recv_bytes, |h| {
            let mine = chunks[rank].start * esize..chunks[rank].end * esize;
            // SAFETY: `s` holds exactly this chunk's bytes; synchronized before use.
            unsafe { dtoh(&stream, &mut h[mine], s)? };
            dev.synchronize()?;
            self.run_now(|e| {
                let steps = n.saturating_sub(1)..schedule::allreduce_steps(n);
                ring::run(e, h, esize, &chunks, steps, &fp, &|_, _| {}, &|_| {})
            })?;
            // SAFETY: `r` holds h.len() bytes.
            unsafe { htod(&stream, r, h)? };
            dev.synchronize()
        })
    }

    /// [`Communicator::broadcast`] on device memory, staged through pinned host memory.
    pub fn broadcast_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(
            OpKind::Broadcast,
            T::DTYPE,
            None,
            buf.len(),
            Some(root),
            Algorithm::Chain,
        );
        if self.ipc.borrow().is_some() {
            let count = buf.len();
            return self.ipc_in_place(buf, |ring, store, id, d| {
                // SAFETY: `d` holds `count` elements, borrowed until this returns
                // synchronized.
                unsafe { ring.broadcast(store, id, d, count, T::DTYPE, root) }
            });
        }
        let dev = Device::shared(buf.context().ordinal()).map_err(|e| self.refuse(e))?;
        let esize = size_of::<T>();
        let is_root = self.rank() == root;
        let stream = dev.stream().clone();
        let bytes = buf.len() * esize;
        let (d, _g) = buf.device_ptr_mut(&stream);
        with_pinned(&dev, bytes, |h| {
            if is_root {
                // SAFETY: `d` holds h.len() bytes; synchronized before use.
                unsafe { dtoh(&stream, h, d)? };
                dev.synchronize()?;
            }
            self.run_now(|e| broadcast::broadcast(e, h, esize, root, &fp))?;
            if !is_root {
                // SAFETY: as above.
                unsafe { htod(&stream, d, h)? };
                dev.synchronize()?;
            }
            Ok(())
        })
    }

    /// [`Communicator::reduce`] on device memory: `root`'s `buf` receives the
    /// reduction (reduced on the device); elsewhere `buf` is working space.
    pub fn reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_op::<T>(op)?;
        self.check_root(root)?;
        let fp = self.fingerprint(
            OpKind::Reduce,
            T::DTYPE,
            Some(op),
            buf.len(),
            Some(root),
            Algorithm::Chain,
        );
        if self.ipc.borrow().is_some() {
            let count = buf.len();
            return self.ipc_in_place(buf, |ring, store, id, d| {
                // SAFETY: `d` holds `count` elements, borrowed until this returns
                // synchronized.
                unsafe { ring.reduce(store, id, d, count, T::DTYPE, op, root) }
            });
        }
        let esize = size_of::<T>();
        self.staged_reduce(buf, op, |e, h, red, fin| {
            broadcast::reduce(e, h, esize, root, &fp, red, fin)
        })
    }
}
