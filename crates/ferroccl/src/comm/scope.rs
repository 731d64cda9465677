//! Non-blocking operations: a [`Scope`] whose operations borrow their buffers until it
//! ends, owned-buffer operations ([`Pending`]), and [`AbortHandle`].
//!
//! Operations run on the communicator's background worker, in the order they were
//! issued. This is the one place where a buffer's lifetime is erased (a job holds raw
//! parts of it while the worker runs); the scope, or the pending operation, waits for
//! the job before the buffer can be touched or freed.

use super::{Communicator, Engine};
use crate::error::Result;
use crate::reduce::{Element, ReduceOp};
use crate::sync::{lock, wait};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A job the engine runs: built by the collectives (validated, fingerprinted, with its
/// buffer captured) and run on the caller's thread or the background worker.
pub(super) type JobFn = Box<dyn FnOnce(&mut Engine) -> Result<()> + Send + 'static>;

/// Where a background operation reports its outcome.
#[derive(Default)]
pub(super) struct Completion {
    state: Mutex<Option<Result<()>>>,
    cv: Condvar,
    /// Threads asleep on `cv` (changed under `state`'s lock): an outcome nobody
    /// sleeps for is set without a notify, which is a system call (a caller that
    /// served its own operation never sleeps).
    sleepers: AtomicUsize,
}

impl Completion {
    pub(super) fn set(&self, r: Result<()>) {
        let mut st = lock(&self.state);
        *st = Some(r);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.cv.notify_all();
        }
    }

    /// Sleeps until notified, holding `st` (this completion's state) around it.
    fn sleep<'a>(
        &self,
        st: MutexGuard<'a, Option<Result<()>>>,
    ) -> MutexGuard<'a, Option<Result<()>>> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let st = wait(&self.cv, st);
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        st
    }

    /// Whether the outcome is set (and not taken yet).
    pub(super) fn is_set(&self) -> bool {
        lock(&self.state).is_some()
    }

    /// Blocks until the outcome is set and takes it (once; a second take blocks).
    pub(super) fn wait(&self) -> Result<()> {
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = st.take() {
                return r;
            }
            st = self.sleep(st);
        }
    }
}

/// A raw pointer that may travel to the worker thread. The scope (or the blocking
/// caller) guarantees the memory outlives the job.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: see above; the pointee is only touched by the job.
unsafe impl Send for SendPtr {}

/// A job running `run` over `buf` as bytes. Only the buffer's raw parts travel with
/// the job; see the SAFETY contract of the `job_*` builders.
pub(super) fn job_over<T: Element>(
    buf: &mut [T],
    run: impl FnOnce(&mut Engine, &mut [u8]) -> Result<()> + Send + 'static,
) -> JobFn {
    let (p, bytes) = (SendPtr(buf.as_mut_ptr().cast()), std::mem::size_of_val(buf));
    Box::new(move |e: &mut Engine| {
        let p = p;
        // SAFETY: the buffer outlives the job and nothing else touches it meanwhile
        // (the `job_*` contract: `run_now` blocks, a `Scope` waits).
        let b = unsafe { std::slice::from_raw_parts_mut(p.0, bytes) };
        run(e, b)
    })
}

/// A job running `run` over `input` (read) and `output` (written), as bytes: the
/// direct exchanges. Only the buffers' raw parts travel with the job; see the SAFETY
/// contract of the `job_*` builders.
pub(super) fn job_over_split<T: Element>(
    input: &[T],
    output: &mut [T],
    run: impl FnOnce(&mut Engine, &[u8], &mut [u8]) -> Result<()> + Send + 'static,
) -> JobFn {
    let i = (
        SendPtr(input.as_ptr().cast_mut().cast()),
        std::mem::size_of_val(input),
    );
    let o = (
        SendPtr(output.as_mut_ptr().cast()),
        std::mem::size_of_val(output),
    );
    Box::new(move |e: &mut Engine| {
        let (i, o) = (i, o);
        // SAFETY: both buffers outlive the job and nothing else touches them meanwhile
        // (the `job_*` contract); the input is only read, and the two do not overlap
        // (one was borrowed shared and the other exclusively).
        let (input, output) = unsafe {
            (
                std::slice::from_raw_parts(i.0 .0.cast_const(), i.1),
                std::slice::from_raw_parts_mut(o.0 .0, o.1),
            )
        };
        run(e, input, output)
    })
}

impl Communicator {
    /// Runs `f` with a [`Scope`] in which collectives can be started without waiting
    /// for them. Operations progress in the background, in the order they were issued,
    /// while `f` goes on; every one of them has finished when `scope` returns (even if
    /// a [`Handle`] was dropped or forgotten), so the buffers they borrow are safe.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(2, &Config::default()).unwrap();
    /// std::thread::scope(|t| for c in comms {
    ///     t.spawn(move || {
    ///         let (mut a, mut b) = (vec![1.0f32; 1000], vec![2i64; 10]);
    ///         c.scope(|s| {
    ///             let ha = s.all_reduce(&mut a, ReduceOp::Sum).unwrap();
    ///             let hb = s.all_reduce(&mut b, ReduceOp::Max).unwrap();
    ///             // ... compute while both run ...
    ///             assert_eq!(ha.wait().unwrap()[0], 2.0);
    ///             assert_eq!(hb.wait().unwrap()[0], 2);
    ///         });
    ///     });
    /// });
    /// ```
    pub fn scope<'c, R>(&'c self, f: impl for<'s> FnOnce(&'s Scope<'s, 'c>) -> R) -> R {
        struct WaitAll<'a>(&'a Communicator);
        impl Drop for WaitAll<'_> {
            fn drop(&mut self) {
                self.0.wait_idle();
            }
        }
        let _wait = WaitAll(self);
        let scope = Scope {
            comm: self,
            _invariant: PhantomData,
        };
        f(&scope)
    }

    /// Starts an all-reduce of an owned buffer and returns at once; the buffer comes
    /// back from [`Pending::wait`]. Unlike a [`Scope`], nothing is borrowed, so the
    /// caller can keep computing (a backward pass, say) and start more operations
    /// before it waits: this is the form gradient buckets use. Operations run in the
    /// order they were started, after any already queued.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(2, &Config::default()).unwrap();
    /// std::thread::scope(|t| for c in comms {
    ///     t.spawn(move || {
    ///         let p = c.all_reduce_start(vec![1.0f32; 1000], ReduceOp::Sum).unwrap();
    ///         // ... compute while it runs ...
    ///         assert_eq!(p.wait().unwrap()[999], 2.0);
    ///     });
    /// });
    /// ```
    pub fn all_reduce_start<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Pending<T>> {
        // The job writes through the heap pointer of `buf`, which does not move when
        // the Vec itself moves into the Pending below.
        let job = self.job_all_reduce(&mut buf, op)?;
        let done = self.submit(job);
        Ok(Pending {
            done,
            buf: Some(buf),
        })
    }
}

impl Communicator {
    /// Starts a send of an owned buffer to `peer` with `tag` and returns at once (see
    /// [`Communicator::send`]); the buffer comes back from [`Pending::wait`] once the
    /// message has left. For a pipeline stage that must keep computing across code
    /// that cannot sit inside a [`Scope`].
    pub fn send_start<T: Element>(&self, buf: Vec<T>, peer: usize, tag: u32) -> Result<Pending<T>> {
        // The operation reads through the heap pointer, which does not move with the
        // Vec.
        let p = self.prepare(true, buf.as_ptr().cast_mut(), buf.len(), peer, tag)?;
        Ok(Pending {
            done: self.post_one(p, false),
            buf: Some(buf),
        })
    }

    /// Starts a receive into an owned buffer from `peer` with `tag` (see
    /// [`Communicator::recv`]); [`Pending::wait`] hands the buffer back with the
    /// message.
    pub fn recv_start<T: Element>(
        &self,
        mut buf: Vec<T>,
        peer: usize,
        tag: u32,
    ) -> Result<Pending<T>> {
        let p = self.prepare(false, buf.as_mut_ptr(), buf.len(), peer, tag)?;
        Ok(Pending {
            done: self.post_one(p, false),
            buf: Some(buf),
        })
    }
}

/// An operation on an owned buffer in flight ([`Communicator::all_reduce_start`],
/// [`Communicator::send_start`], [`Communicator::recv_start`]).
/// Dropping it without waiting blocks until the operation is over (its buffer cannot be
/// freed while the communicator writes it); the result is then lost.
#[must_use = "a pending operation's result (and its buffer) come back from wait()"]
pub struct Pending<T> {
    done: Arc<Completion>,
    buf: Option<Vec<T>>,
}

impl<T> Pending<T> {
    fn block(&self) -> Result<()> {
        let mut st = lock(&self.done.state);
        loop {
            if let Some(r) = st.take() {
                // Leave a marker so a second look (Drop) does not wait forever.
                *st = Some(Ok(()));
                return r;
            }
            st = self.done.sleep(st);
        }
    }

    /// Blocks until the operation is done; returns the buffer, or the error.
    pub fn wait(mut self) -> Result<Vec<T>> {
        self.block()?;
        Ok(self.buf.take().unwrap_or_default())
    }

    /// True once the operation is done (successfully or not); never blocks.
    pub fn test(&self) -> bool {
        lock(&self.done.state).is_some()
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if self.buf.is_some() {
            let _ = self.block();
        }
    }
}

/// Aborts a [`Communicator`] from any thread — a watchdog, a signal handler's helper
/// thread, a supervisor that learnt a peer host died. Every operation in flight on the
/// communicator (blocking or in a [`Scope`]) fails with [`crate::Error::Aborted`] within about
/// 100 ms; the communicator is poisoned (its links shut, so its peers fail fast with
/// [`crate::Error::PeerClosed`]) and every later call returns [`crate::Error::Poisoned`].
#[derive(Clone, Debug)]
pub struct AbortHandle {
    flag: Arc<AtomicBool>,
}

impl AbortHandle {
    pub(super) fn new(flag: Arc<AtomicBool>) -> Self {
        AbortHandle { flag }
    }

    /// Aborts the communicator. Idempotent.
    pub fn abort(&self) {
        self.flag.store(true, Ordering::Relaxed);
    }

    /// Whether [`AbortHandle::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }
}

/// Where non-blocking collectives are issued; see [`Communicator::scope`]. Buffers
/// passed here stay borrowed until the scope ends; [`Handle::wait`] hands them back.
pub struct Scope<'s, 'c> {
    comm: &'c Communicator,
    _invariant: PhantomData<&'s mut &'s ()>,
}

/// A collective in flight. [`Handle::wait`] blocks until it is done and hands its
/// buffer back; [`Handle::test`] asks without blocking. Dropping it does not cancel the
/// operation (collectives cannot be cancelled on one rank alone); the scope still
/// waits for it. A barrier's handle hands back an empty slice.
#[must_use = "a handle does nothing unless waited on; the scope waits for it anyway"]
pub struct Handle<'s, T> {
    done: Arc<Completion>,
    // The buffer as raw parts: no reference to it is alive while the worker writes it.
    ptr: *mut T,
    len: usize,
    _buf: PhantomData<&'s mut [T]>,
}

impl<'s, T> Handle<'s, T> {
    /// Blocks until the operation is done; returns its buffer, or its error.
    pub fn wait(self) -> Result<&'s mut [T]> {
        let mut st = lock(&self.done.state);
        loop {
            if let Some(r) = st.take() {
                // SAFETY: `ptr..len` is the buffer borrowed for 's when the operation
                // was started; the operation is over, so nothing else touches it, and
                // this handle (consumed here) was its only holder.
                return r.map(|()| unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) });
            }
            st = self.done.sleep(st);
        }
    }

    /// True once the operation is done (successfully or not); never blocks.
    pub fn test(&self) -> bool {
        lock(&self.done.state).is_some()
    }
}

impl<'s, 'c> Scope<'s, 'c> {
    /// The communicator, for blocking calls made inside the scope (they run after the
    /// operations already issued).
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// Builds a job over `buf` with `make` and queues it. The buffer's pointer is taken
    /// once; the job and the handle both derive from it, and no reference to the
    /// buffer outlives this call (the worker writes through the job's pointer).
    pub(super) fn start<T>(
        &self,
        buf: &'s mut [T],
        make: impl FnOnce(&mut [T]) -> Result<JobFn>,
    ) -> Result<Handle<'s, T>> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: a reborrow of the caller's buffer through `ptr`, used only to build
        // the job; it ends before anything else touches the buffer.
        let job = make(unsafe { std::slice::from_raw_parts_mut(ptr, len) })?;
        let done = self.comm.submit(job);
        Ok(Handle {
            done,
            ptr,
            len,
            _buf: PhantomData,
        })
    }

    /// Non-blocking [`Communicator::all_reduce`].
    pub fn all_reduce<T: Element>(&self, buf: &'s mut [T], op: ReduceOp) -> Result<Handle<'s, T>> {
        self.start(buf, |b| self.comm.job_all_reduce(b, op))
    }

    /// Non-blocking [`Communicator::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element>(
        &self,
        buf: &'s mut [T],
        op: ReduceOp,
    ) -> Result<Handle<'s, T>> {
        let chunks = self
            .comm
            .equal_blocks(buf.len(), "reduce_scatter_in_place")?;
        self.start(buf, |b| self.comm.job_reduce_scatter(b, chunks, op))
    }

    /// Non-blocking [`Communicator::all_gather_in_place`].
    pub fn all_gather_in_place<T: Element>(&self, buf: &'s mut [T]) -> Result<Handle<'s, T>> {
        let chunks = self.comm.equal_blocks(buf.len(), "all_gather_in_place")?;
        self.start(buf, |b| self.comm.job_all_gather(b, chunks))
    }

    /// Non-blocking [`Communicator::broadcast`].
    pub fn broadcast<T: Element>(&self, buf: &'s mut [T], root: usize) -> Result<Handle<'s, T>> {
        self.start(buf, |b| self.comm.job_broadcast(b, root))
    }

    /// Non-blocking [`Communicator::reduce`].
    pub fn reduce<T: Element>(
        &self,
        buf: &'s mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<Handle<'s, T>> {
        self.start(buf, |b| self.comm.job_reduce(b, op, root))
    }

    /// Non-blocking [`Communicator::barrier`].
    pub fn barrier(&self) -> Result<Handle<'s, ()>> {
        self.start(&mut [], |_| Ok(self.comm.job_barrier()))
    }

    /// Non-blocking [`Communicator::send`]: posted at once, it progresses with every
    /// other send and receive posted (in this scope or not), apart from the
    /// collectives; its handle hands back an empty slice.
    pub fn send<T: Element>(&self, buf: &'s [T], peer: usize, tag: u32) -> Result<Handle<'s, ()>> {
        let p = self
            .comm
            .prepare(true, buf.as_ptr().cast_mut(), buf.len(), peer, tag)?;
        Ok(Handle {
            done: self.comm.post_one(p, false),
            ptr: std::ptr::NonNull::dangling().as_ptr(),
            len: 0,
            _buf: PhantomData,
        })
    }

    /// Non-blocking [`Communicator::recv`] (see [`Scope::send`]); its handle hands back
    /// the buffer with the message.
    pub fn recv<T: Element>(
        &self,
        buf: &'s mut [T],
        peer: usize,
        tag: u32,
    ) -> Result<Handle<'s, T>> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let p = self.comm.prepare(false, ptr, len, peer, tag)?;
        Ok(Handle {
            done: self.comm.post_one(p, false),
            ptr,
            len,
            _buf: PhantomData,
        })
    }
}
