//! Buffers handed in by Python, and all of the binding's `unsafe`.
//!
//! A buffer arrives as `(address, elements, dtype)`: the Python side
//! (`ferroccl.buffer`) checked that the memory is a contiguous CPU buffer of that type,
//! and holds a reference to its owner, untouched, until the operation is over (its
//! callback has run or the blocking call returned). This is the only place that turns
//! such an address into a slice.
//!
//! With a `DeviceOp` the same tuples are the storage of CUDA tensors on its GPU (the
//! torch backend checked them, and holds the tensors until the operation reported):
//! [`DeviceCall`] hands them to the library's raw device collectives, which check that
//! they are device memory of that GPU, and the `DeviceOp` orders the call with the
//! caller's stream.

use crate::errors::InvalidArgumentError;
use crate::worker::P2pWait;
use ferroccl::{Communicator, DataType, Element, ReduceOp};
use pyo3::prelude::*;

/// A buffer as Python hands it over: `(address, elements, dtype name)`.
pub(crate) type RawBuf = (usize, usize, String);

/// A CPU buffer handed in by Python (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buf {
    addr: usize,
    pub(crate) len: usize,
    pub(crate) dt: DataType,
}

impl Buf {
    fn new((addr, len, dtype): RawBuf) -> PyResult<Self> {
        let dt =
            DataType::parse(&dtype).map_err(|e| InvalidArgumentError::new_err(e.to_string()))?;
        let size = dt.size();
        if len > 0 && (addr == 0 || addr % size != 0) {
            return Err(InvalidArgumentError::new_err(format!(
                "a {dtype} buffer at {addr:#x} is not aligned to {size} bytes"
            )));
        }
        if len
            .checked_mul(size)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(InvalidArgumentError::new_err(format!(
                "a buffer of {len} {dtype} elements is too large"
            )));
        }
        Ok(Buf { addr, len, dt })
    }

    fn bytes(&self) -> (usize, usize) {
        (self.addr, self.len * self.dt.size())
    }

    fn overlaps(&self, other: &Buf) -> bool {
        let ((a, la), (b, lb)) = (self.bytes(), other.bytes());
        la > 0 && lb > 0 && a < b + lb && b < a + la
    }

    /// The buffer as a slice of `T`.
    ///
    /// # Safety
    /// `T` is the buffer's type, and the memory stays valid and untouched by anything
    /// else for `'a` (the contract with the Python side above). No other slice of it
    /// is alive.
    pub(crate) unsafe fn slice<'a, T: Element>(self) -> &'a mut [T] {
        debug_assert_eq!(T::DTYPE, self.dt);
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: non-null, aligned (checked in `new`), `len` elements of `T` alive
        // and exclusively ours for 'a (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }

    /// A copy of the buffer's elements.
    ///
    /// # Safety
    /// As [`Buf::slice`], for the duration of the call.
    pub(crate) unsafe fn to_vec<T: Element>(self) -> Vec<T> {
        // SAFETY: the caller's contract; the slice does not outlive the call.
        unsafe { self.slice::<T>() }.to_vec()
    }
}

/// Reads `(addr, len, dtype)` tuples into buffers.
pub(crate) fn bufs<const N: usize>(raw: [RawBuf; N]) -> PyResult<[Buf; N]> {
    let mut out = [Buf {
        addr: 0,
        len: 0,
        dt: DataType::U8,
    }; N];
    for (o, r) in out.iter_mut().zip(raw) {
        *o = Buf::new(r)?;
    }
    Ok(out)
}

/// The same type on every buffer of one call.
pub(crate) fn same_type(bufs: &[Buf]) -> PyResult<DataType> {
    let dt = bufs[0].dt;
    if let Some(b) = bufs.iter().find(|b| b.dt != dt) {
        return Err(InvalidArgumentError::new_err(format!(
            "the buffers of one call must have one element type ({} and {})",
            dt, b.dt
        )));
    }
    Ok(dt)
}

/// Runs `$body` with `$T` the Rust type of `$dt` (the library's dispatch), an error
/// for a dtype the binding has no type for.
macro_rules! typed {
    ($dt:expr, $T:ident => $body:expr) => {
        ::ferroccl::reduce::by_dtype!($dt, $T => $body, other => Err(::ferroccl::Error::InvalidArgument(
            format!("ferroccl's Python binding has no element type {other}")
        )))
    };
}
pub(crate) use typed;

/// The input of a call with an input and an output: read in place when the two do
/// not overlap, else first copied out (an in-place all-gather, an all-to-all of a
/// tensor with itself).
pub(crate) enum Input<'a, T> {
    Borrowed(&'a [T]),
    Copied(Vec<T>),
}

impl<T> std::ops::Deref for Input<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Input::Borrowed(s) => s,
            Input::Copied(v) => v,
        }
    }
}

/// `input` and `output` as slices of `T`.
///
/// # Safety
/// As [`Buf::slice`] for both, for `'a`.
pub(crate) unsafe fn split_io<'a, T: Element>(
    input: Buf,
    output: Buf,
) -> (Input<'a, T>, &'a mut [T]) {
    // SAFETY: the caller's contract; an input overlapping the output is copied (and
    // its slice dropped) before the output's slice is made.
    unsafe {
        let i = if input.overlaps(&output) {
            Input::Copied(input.to_vec())
        } else {
            Input::Borrowed(input.slice::<T>())
        };
        (i, output.slice::<T>())
    }
}

/// A collective on device memory: Python's buffers (checked as above, but device
/// addresses of one GPU: the `DeviceOp` handed in with them says which) and the call's
/// arguments.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum DeviceCall {
    AllReduce(Buf, ReduceOp),
    Broadcast(Buf, usize),
    Reduce(Buf, ReduceOp, usize),
    AllGather(Buf, Buf),
    ReduceScatter(Buf, Buf, ReduceOp),
    /// With counts: `(send_counts, send_displs, recv_counts, recv_displs)`.
    AllToAll(Buf, Buf, Option<Counts>),
    Gather(Buf, Buf, usize),
    Scatter(Buf, Buf, usize),
}

/// An all-to-all's counts and displacements, as [`DeviceCall::AllToAll`] keeps them.
pub(crate) type Counts = (Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>);

#[cfg(feature = "cuda")]
impl Buf {
    /// The buffer as device memory of GPU `ordinal`.
    fn on(self, ordinal: usize) -> ferroccl::cuda::DeviceBuf {
        ferroccl::cuda::DeviceBuf {
            ordinal,
            addr: self.addr as u64,
            len: self.len,
            dtype: self.dt,
        }
    }
}

impl DeviceCall {
    /// Runs the call on GPU `ordinal`'s memory (the library checks that every buffer
    /// is device memory there).
    ///
    /// # Safety
    /// The Python side's contract for device memory: the buffers are storage of CUDA
    /// tensors on GPU `ordinal`, held by Python until the operation's report, and the
    /// call runs inside its `DeviceOp` (ferroccl's stream waits for the caller's work
    /// on them first).
    #[cfg(feature = "cuda")]
    pub(crate) unsafe fn run(self, c: &Communicator, ordinal: usize) -> ferroccl::Result<()> {
        // SAFETY: the caller's contract is the library's raw forms' contract.
        unsafe {
            match self {
                DeviceCall::AllReduce(b, op) => c.all_reduce_device_raw(b.on(ordinal), op),
                DeviceCall::Broadcast(b, root) => c.broadcast_device_raw(b.on(ordinal), root),
                DeviceCall::Reduce(b, op, root) => c.reduce_device_raw(b.on(ordinal), op, root),
                DeviceCall::AllGather(s, r) => {
                    c.all_gather_device_raw(s.on(ordinal), r.on(ordinal))
                }
                DeviceCall::ReduceScatter(s, r, op) => {
                    c.reduce_scatter_device_raw(s.on(ordinal), r.on(ordinal), op)
                }
                DeviceCall::AllToAll(s, r, counts) => {
                    let counts = counts
                        .as_ref()
                        .map(|(a, b, c, d)| (&a[..], &b[..], &c[..], &d[..]));
                    c.all_to_all_device_raw(s.on(ordinal), r.on(ordinal), counts)
                }
                DeviceCall::Gather(s, r, root) => {
                    c.gather_device_raw(s.on(ordinal), r.on(ordinal), root)
                }
                DeviceCall::Scatter(s, r, root) => {
                    c.scatter_device_raw(s.on(ordinal), r.on(ordinal), root)
                }
            }
        }
    }

    /// A build without CUDA runs no device call.
    ///
    /// # Safety
    /// None needed; unsafe as the CUDA build's.
    #[cfg(not(feature = "cuda"))]
    pub(crate) unsafe fn run(self, _c: &Communicator, _ordinal: usize) -> ferroccl::Result<()> {
        Err(crate::device::not_built())
    }
}

/// Starts sending device buffer `b` of GPU `ordinal` to `peer`: its bytes are copied
/// to the host now (on ferroccl's stream), and the send is posted.
///
/// # Safety
/// As [`DeviceCall::run`].
#[cfg(feature = "cuda")]
pub(crate) unsafe fn send_device_start(
    c: &Communicator,
    b: Buf,
    ordinal: usize,
    peer: usize,
    tag: u32,
) -> ferroccl::Result<P2pWait> {
    let d = b.on(ordinal);
    d.check("send's buffer")?;
    typed!(b.dt, T => {
        // SAFETY: the caller's contract.
        let v = unsafe { d.copy_to_host::<T>() }?;
        let p = c.send_start(v, peer, tag)?;
        Ok(Box::new(move || p.wait().map(drop)) as P2pWait)
    })
}

/// Posts a receive into device buffer `b` of GPU `ordinal` from `peer`; what waits for
/// it copies the message in (on ferroccl's stream, the calling thread's CUDA context
/// kept) and then runs `then` (the `DeviceOp`'s `after`).
///
/// # Safety
/// As [`DeviceCall::run`], until the returned wait has run.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn recv_device_start(
    c: &Communicator,
    b: Buf,
    ordinal: usize,
    peer: usize,
    tag: u32,
    then: impl FnOnce() -> ferroccl::Result<()> + Send + 'static,
) -> ferroccl::Result<P2pWait> {
    let d = b.on(ordinal);
    d.check("recv's buffer")?;
    typed!(b.dt, T => {
        let p = c.recv_start(vec![T::default(); b.len], peer, tag)?;
        Ok(Box::new(move || {
            let v = p.wait()?;
            // SAFETY: the caller's contract: the buffer is held until this ran.
            crate::device::keeping_context(|| unsafe { d.copy_from_host(&v) })?;
            then()
        }) as P2pWait)
    })
}

/// A build without CUDA sends no device memory.
///
/// # Safety
/// None needed; unsafe as the CUDA build's.
#[cfg(not(feature = "cuda"))]
pub(crate) unsafe fn send_device_start(
    _c: &Communicator,
    _b: Buf,
    _ordinal: usize,
    _peer: usize,
    _tag: u32,
) -> ferroccl::Result<P2pWait> {
    Err(crate::device::not_built())
}

/// A build without CUDA receives into no device memory.
///
/// # Safety
/// None needed; unsafe as the CUDA build's.
#[cfg(not(feature = "cuda"))]
pub(crate) unsafe fn recv_device_start(
    _c: &Communicator,
    _b: Buf,
    _ordinal: usize,
    _peer: usize,
    _tag: u32,
    _then: impl FnOnce() -> ferroccl::Result<()> + Send + 'static,
) -> ferroccl::Result<P2pWait> {
    Err(crate::device::not_built())
}
