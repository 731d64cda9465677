//! Device buffers over a host transport (TCP, local pipes, RDMA): staged through
//! page-locked host memory, reduced on the device.
//!
//! The device buffer is copied into a pinned host buffer, the ordinary host plan runs
//! on it — the same ring, recursive doubling or chain, with the same fingerprints, so
//! peers may even mix host and device calls — and the result is copied back. Every
//! *reduction* runs on the device ([`DeviceCombine`]): each time a segment arrives,
//! the local segment and the received one are copied to device scratch, combined by the
//! `cuda/reduce.cu` kernel, and the result copied back into the pinned buffer, from
//! which the plan sends it on (Avg's division likewise). Received frames land in the
//! engine's (pageable) scratch first, not directly in pinned memory; keeping the working
//! copy on the device between segments would save copies.

use super::mem::{dtoh, htod, DeviceAlloc, PinnedBuf};
use super::{Device, DeviceReducer};
use crate::error::{Error, Result};
use crate::reduce::{Combine, DataType, ReduceOp};
use std::cell::RefCell;

thread_local! {
    /// The pinned staging buffer of this thread, grown on demand and kept between
    /// calls (pinning memory is slow).
    static PINNED: RefCell<Option<PinnedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` on at least `bytes` of this thread's pinned staging buffer, with `dev`'s
/// context current.
pub(crate) fn with_pinned<R>(
    dev: &Device,
    bytes: usize,
    f: impl FnOnce(&mut [u8]) -> Result<R>,
) -> Result<R> {
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

/// [`Combine`] on the device: stage both operands up, launch the kernel, stage the
/// result back. A CUDA failure is returned, and ends the operation.
pub(crate) struct DeviceCombine<'a> {
    red: &'a DeviceReducer,
    dt: DataType,
    op: ReduceOp,
    world: usize,
    a: DeviceAlloc,
    b: DeviceAlloc,
}

impl<'a> DeviceCombine<'a> {
    /// Combines elements of `dt` with `op` on `red`'s device, over `world` ranks (Avg).
    pub fn new(red: &'a DeviceReducer, dt: DataType, op: ReduceOp, world: usize) -> Result<Self> {
        Ok(DeviceCombine {
            red,
            dt,
            op,
            world,
            a: DeviceAlloc::new(red.device().context(), 0)?,
            b: DeviceAlloc::new(red.device().context(), 0)?,
        })
    }
}

impl Combine for DeviceCombine<'_> {
    fn reduce(&mut self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        self.a.reserve(dst.len())?;
        self.b.reserve(src.len())?;
        let stream = self.red.device().stream();
        let n = dst.len() / self.dt.size();
        // SAFETY: a and b hold at least dst.len() == src.len() bytes; the host slices
        // stay borrowed until the synchronize below.
        unsafe {
            htod(stream, self.a.ptr(), dst)?;
            htod(stream, self.b.ptr(), src)?;
            self.red.reduce_raw(
                stream,
                self.dt,
                self.op,
                self.a.ptr(),
                0,
                self.a.ptr(),
                self.b.ptr(),
                n,
            )?;
            dtoh(stream, dst, self.a.ptr())?;
        }
        self.red.device().synchronize()
    }

    fn finish(&mut self, dst: &mut [u8]) -> Result<()> {
        if self.op != ReduceOp::Avg {
            return Ok(());
        }
        self.a.reserve(dst.len())?;
        let stream = self.red.device().stream();
        let n = dst.len() / self.dt.size();
        // SAFETY: as in `reduce`.
        unsafe {
            htod(stream, self.a.ptr(), dst)?;
            self.red
                .scale_raw(stream, self.dt, self.a.ptr(), n, self.world as f64)?;
            dtoh(stream, dst, self.a.ptr())?;
        }
        self.red.device().synchronize()
    }
}
