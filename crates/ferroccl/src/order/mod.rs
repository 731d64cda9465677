//! Ordering a collective on device memory with the streams of the framework that owns
//! the memory, as PyTorch's ProcessGroupNCCL does, for an executor that is driven from
//! the host.
//!
//! A framework issues a collective on its tensors from the caller's thread while
//! kernels queued on the caller's *stream* may still be writing them; ferroccl runs it
//! later, on its executor thread, on a stream of its own. [`DeviceOp`] is the protocol
//! between the two, in five steps:
//!
//! 1. **issue** (caller's thread, never blocks): record `ready` on the caller's stream;
//! 2. **run** (executor): make our stream wait for `ready` *before anything touches the
//!    buffers*, run the collective (work queued on our stream, host-driven steps
//!    between), and record `done` on our stream — also when the collective failed
//!    midway, since work it queued may still run;
//! 3. **after** (optional): more work the framework queued on our stream (copies into
//!    its outputs) moves `done` behind it;
//! 4. **wait** (caller): make the caller's current stream wait for `done`: a stream
//!    wait, the host does not block;
//! 5. **release**: the buffers go back to the framework's allocator [`Release::Now`]
//!    when `done` has completed, else [`Release::OnStream`]: the allocator must not
//!    reuse them before our stream passes `done` (torch's `Tensor.record_stream`).
//!
//! The device is behind [`Streams`] (record an event, make a stream wait for one, ask
//! whether one completed): `crate::cuda`'s implementation over CUDA events, and
//! [`sim`]'s, a simulated device whose streams run their work late and in random
//! order of time, with a caching allocator that flags any block reused while another
//! stream still has work on it and any read of a value its producer has not yet
//! written. `tests/suite/order.rs` runs the protocol on it with random delays.

pub mod sim;

use crate::error::{Error, Result};
use crate::sync::lock;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A stream, as the device layer names it (a `CUstream` handle; `0` is CUDA's legacy
/// default stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

/// What the protocol needs of a device: events on streams.
pub trait Streams: Send + Sync + 'static {
    /// A point in a stream's work.
    type Event: Send + Sync + 'static;
    /// Records the current end of `stream`'s queued work (`cuEventRecord`).
    fn record(&self, stream: StreamId) -> Result<Self::Event>;
    /// Makes `stream`'s later work wait for `event` (`cuStreamWaitEvent`); the host does
    /// not wait.
    fn wait(&self, stream: StreamId, event: &Self::Event) -> Result<()>;
    /// Whether everything before `event` has run (`cuEventQuery`); never blocks.
    fn query(&self, event: &Self::Event) -> Result<bool>;
}

/// When buffers a [`DeviceOp`] used may go back to their allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Every use of them is over.
    Now,
    /// Work on this stream may still use them: the allocator must not hand them out
    /// again before the stream has passed the point where they are released (torch:
    /// `tensor.record_stream(stream)`, then drop the tensor).
    OnStream(StreamId),
}

enum Phase<E> {
    /// Issued: the caller's stream reached `ready`.
    Issued(E),
    /// The executor has it.
    Running,
    /// Ran (or failed): our stream reaches `done` once every use of the buffers is over.
    Ran(E),
    /// Ran, but `done` could not be recorded: when its work ends is unknown.
    Lost(String),
}

/// One collective on device memory, ordered with its caller's stream (module docs).
pub struct DeviceOp<S: Streams> {
    streams: Arc<S>,
    ours: StreamId,
    caller: StreamId,
    phase: Mutex<Phase<S::Event>>,
}

impl<S: Streams> fmt::Debug for DeviceOp<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = match &*lock(&self.phase) {
            Phase::Issued(_) => "issued",
            Phase::Running => "running",
            Phase::Ran(_) => "ran",
            Phase::Lost(_) => "lost",
        };
        f.debug_struct("DeviceOp")
            .field("ours", &self.ours)
            .field("caller", &self.caller)
            .field("phase", &phase)
            .finish()
    }
}

impl<S: Streams> DeviceOp<S> {
    /// Step 1, on the caller's thread: records `ready` on `caller`, the stream whose
    /// queued work produces (or still reads) the buffers. `ours` is the stream the
    /// collective's device work runs on.
    pub fn issue(streams: Arc<S>, ours: StreamId, caller: StreamId) -> Result<Self> {
        let ready = streams.record(caller)?;
        Ok(DeviceOp {
            streams,
            ours,
            caller,
            phase: Mutex::new(Phase::Issued(ready)),
        })
    }

    /// The stream the collective runs on.
    pub fn ours(&self) -> StreamId {
        self.ours
    }

    /// The stream it was issued on.
    pub fn caller(&self) -> StreamId {
        self.caller
    }

    /// Step 2, on the executor: our stream waits for `ready`, then `op` runs (it queues
    /// its device work on [`DeviceOp::ours`]), then `done` is recorded on our stream,
    /// whether `op` succeeded or not. An op is run once.
    pub fn run<R>(&self, op: impl FnOnce() -> Result<R>) -> Result<R> {
        let ready = {
            let mut p = lock(&self.phase);
            match std::mem::replace(&mut *p, Phase::Running) {
                Phase::Issued(ready) => ready,
                other => {
                    *p = other;
                    return Err(Error::InvalidArgument(
                        "a device operation runs once".into(),
                    ));
                }
            }
        };
        let r = self.streams.wait(self.ours, &ready).and_then(|()| op());
        drop(ready);
        let recorded = self.record_done();
        match (r, recorded) {
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
            (Ok(v), Ok(())) => Ok(v),
        }
    }

    fn record_done(&self) -> Result<()> {
        let recorded = self.streams.record(self.ours);
        let mut p = lock(&self.phase);
        match recorded {
            Ok(done) => {
                *p = Phase::Ran(done);
                Ok(())
            }
            Err(e) => {
                *p = Phase::Lost(e.to_string());
                Err(e)
            }
        }
    }

    /// Step 3: the caller queued more work on our stream that uses the buffers (after
    /// the op ran); `done` moves behind it.
    pub fn after(&self) -> Result<()> {
        match &*lock(&self.phase) {
            Phase::Ran(_) => {}
            Phase::Lost(why) => {
                return Err(Error::InvalidArgument(format!(
                    "the end of a device operation is unknown: {why}"
                )))
            }
            Phase::Issued(_) | Phase::Running => {
                return Err(Error::InvalidArgument(
                    "work after a device operation that has not run".into(),
                ))
            }
        }
        self.record_done()
    }

    /// Step 4: makes `stream` (the caller's current stream) wait for the op's end; the
    /// host does not wait. Only once the op ran: a host-driven executor knows no
    /// earlier where its work ends.
    pub fn wait_on(&self, stream: StreamId) -> Result<()> {
        match &*lock(&self.phase) {
            Phase::Ran(done) => self.streams.wait(stream, done),
            Phase::Lost(why) => Err(Error::InvalidArgument(format!(
                "cannot wait for a device operation whose end is unknown: {why}"
            ))),
            Phase::Issued(_) | Phase::Running => Err(Error::InvalidArgument(
                "a stream can wait for a device operation only once it ran".into(),
            )),
        }
    }

    /// Whether the op ran and every piece of its device work is over; never blocks.
    pub fn query(&self) -> Result<bool> {
        match &*lock(&self.phase) {
            Phase::Ran(done) => self.streams.query(done),
            _ => Ok(false),
        }
    }

    /// Step 5: whether the op's buffers may go back to their allocator now, or only
    /// behind our stream (module docs). Never blocks; anything unknown (not run yet,
    /// `done` lost, a failed query) answers [`Release::OnStream`].
    pub fn release(&self) -> Release {
        match self.query() {
            Ok(true) => Release::Now,
            _ => Release::OnStream(self.ours),
        }
    }
}
