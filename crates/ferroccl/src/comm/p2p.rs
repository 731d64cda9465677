//! Point-to-point: tagged sends and receives, blocking ([`Communicator::send`],
//! [`Communicator::recv`]), in batches that progress together
//! ([`Communicator::p2p_batch`]), and in a [`super::Scope`] (`Scope::send`,
//! `Scope::recv`), on an engine of their own (`engine/p2p.rs`).
//!
//! Messages between two ranks are matched in the order they were posted: the
//! receiver's next receive from a rank takes that rank's next send to it, which must
//! carry the same tag, type and length, or the receiver fails with [`Error::Mismatch`]
//! (and, through its notice, the sender). Tags check; they do not reorder, unlike
//! MPI's. Sends and receives to and from different ranks, and the two directions with
//! one rank, are not ordered at all: everything posted progresses at once, so any
//! order of posting between any ranks completes.
//!
//! A send completes when the transport holds the message (a message larger than the
//! link's buffer, once the peer has taken the rest), so a rank may send, take part in
//! a collective and then receive; a batch's sends complete only once their receiver
//! has them, so two ranks that disagree in a batch both fail in it.
//!
//! Who moves them: the communicator's point-to-point thread, which serves its engine
//! whenever something is posted; but a blocking call (`send`, `recv`, a batch) whose
//! engine is free serves its own messages on the caller's thread, up to the moment
//! they are done, and hands what is still in flight (another thread's started
//! operations) back to the thread. A small exchange then costs no thread switch: at
//! 1 KiB between 2 ranks on shared memory, 2.2 µs instead of 6.1.
//!
//! With itself a rank exchanges messages too, as MPI does: a send to itself is eager
//! (it completes at once, its bytes kept until the matching receive takes them), so it
//! never waits; a blocking receive from itself that no earlier send to itself can
//! satisfy is refused at once ([`Error::InvalidArgument`]), never left to time out.

use super::scope::{Completion, JobFn};
use super::Communicator;
use crate::algo::{self, Algorithm};
use crate::engine::{Done, Engine, Health, OpBuffer, P2pOp, P2pSource};
use crate::error::{Error, Result};
use crate::reduce::Element;
use crate::sync::{lock, wait};
use crate::trace::now_ns;
use crate::transport::Waker;
use crate::wire::{Fingerprint, OpKind};
use std::cell::RefCell;
use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::{Arc, Condvar, Mutex};

/// A communicator's point-to-point state: the sequence numbers of its messages per
/// peer, and where its operations run.
pub(super) struct P2p {
    /// Messages sent to / received from each peer.
    seq: RefCell<(Vec<u64>, Vec<u64>)>,
    /// The engine of its own links and the queue its thread serves; `None` where the
    /// transport makes no groups (then operations run on the collectives' engine, in
    /// turn with them, a batch at a time).
    own: Option<Arc<P2pShared>>,
    worker: RefCell<Option<std::thread::JoinHandle<()>>>,
}

/// What the posting thread and the point-to-point thread share.
pub(super) struct P2pShared {
    engine: Mutex<Engine>,
    queue: Mutex<P2pQueue>,
    /// Signals posted operations and pokes to the thread.
    cv: Condvar,
    /// Signals [`P2p::wait_idle`] that nothing is pending any more. Apart from `cv`:
    /// a finished operation wakes no thread that has nothing to do with it (every
    /// notify is a system call).
    idle: Condvar,
    /// Ends the thread's sleep on its links when something is posted.
    waker: Option<Waker>,
}

#[derive(Default)]
struct P2pQueue {
    ops: Vec<P2pOp>,
    /// Operations posted and not yet finished.
    pending: usize,
    /// The communicator was poisoned: the thread wakes to shut its links.
    poked: bool,
    shutdown: bool,
    /// The thread is asleep on `cv`, and how many threads are asleep on `idle`: a
    /// condition variable's notify is a system call whether or not anyone waits, so
    /// it is made only for a sleeper (a caller that serves its own operation, the
    /// common blocking call, wakes nobody).
    thread_asleep: bool,
    idle_waiters: usize,
}

impl P2pSource for P2pShared {
    fn take(&self, into: &mut Vec<P2pOp>) {
        into.append(&mut lock(&self.queue).ops);
    }
}

impl P2pShared {
    /// The thread's loop: waits (holding nothing) for posted operations or a poison,
    /// then serves them on the engine until none is in flight, until shut down.
    fn serve(&self) {
        while self.wait() {
            let mut e = lock(&self.engine);
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.serve_p2p(self, true)));
            if r.is_err() {
                // Every operation it held was told (`Done`); so are the next ones.
                e.poison("the point-to-point thread panicked".into());
            }
        }
    }

    /// Wakes the thread: for operations just posted, or (`poke`) for operations a
    /// caller left in flight on the engine, which are not in the queue any more.
    fn wake_thread(&self, poke: bool) {
        // What the thread is to see was changed under the queue's lock before this
        // (the operations posted) or is now (the poke); so a thread not asleep now
        // sees it before it next sleeps, and one asleep is notified.
        let asleep = {
            let mut q = lock(&self.queue);
            if poke {
                q.poked = true;
            }
            q.thread_asleep
        };
        if asleep {
            self.cv.notify_all();
        }
        if let Some(w) = &self.waker {
            w.wake();
        }
    }

    /// Blocks until something was posted or the communicator poisoned (true), or the
    /// communicator is going (false).
    fn wait(&self) -> bool {
        let mut q = lock(&self.queue);
        loop {
            if !q.ops.is_empty() || std::mem::take(&mut q.poked) {
                return true;
            }
            if q.shutdown {
                return false;
            }
            q.thread_asleep = true;
            q = wait(&self.cv, q);
            q.thread_asleep = false;
        }
    }
}

/// A fixed set of operations, for a transport without groups: run as one job on the
/// collectives' engine.
struct Fixed(Mutex<Vec<P2pOp>>);

impl P2pSource for Fixed {
    fn take(&self, into: &mut Vec<P2pOp>) {
        into.append(&mut lock(&self.0));
    }
}

/// A posted operation's buffer, as raw parts: the poster (a blocking call, a batch or
/// a scope) keeps the memory alive and untouched until the operation is over.
struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointee is only touched by the operation (see `RawBuf`).
unsafe impl Send for RawBuf {}

impl OpBuffer for RawBuf {
    fn read(&self) -> &[u8] {
        // SAFETY: `ptr..len` is a live buffer the poster does not touch while the
        // operation runs (the `RawBuf` contract); a send only reads it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn write(&mut self) -> &mut [u8] {
        // SAFETY: as above, and a receive's buffer was lent mutably: nothing else
        // reads or writes it while the operation runs.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl P2p {
    /// The point-to-point state of rank `n`'s communicator; `engine` runs its
    /// operations on links of their own (none: on the collectives' engine).
    pub(super) fn new(n: usize, engine: Option<Engine>, health: &Arc<Health>) -> Self {
        let own = engine.map(|e| {
            let waker = e.waker();
            let shared = Arc::new(P2pShared {
                engine: Mutex::new(e),
                queue: Mutex::new(P2pQueue::default()),
                cv: Condvar::new(),
                idle: Condvar::new(),
                waker,
            });
            // A poisoning elsewhere wakes the thread (idle, or asleep on its links) so
            // that it tells its peers and shuts its links.
            let s = Arc::downgrade(&shared);
            health.on_poison(Waker::new(move || {
                if let Some(s) = s.upgrade() {
                    s.wake_thread(true);
                }
            }));
            shared
        });
        P2p {
            seq: RefCell::new((vec![0; n], vec![0; n])),
            own,
            worker: RefCell::new(None),
        }
    }

    /// Blocks until every operation posted has finished.
    pub(super) fn wait_idle(&self) {
        if let Some(s) = &self.own {
            let mut q = lock(&s.queue);
            while q.pending > 0 {
                q.idle_waiters += 1;
                q = wait(&s.idle, q);
                q.idle_waiters -= 1;
            }
        }
    }

    /// Bytes this communicator's point-to-point links moved (see
    /// `Communicator::wire_stats`), and the links' own counts; after
    /// [`P2p::wait_idle`].
    pub(super) fn wire_stats_to(&self, to: impl Fn(usize) -> bool) -> crate::wire::WireStats {
        self.own
            .as_ref()
            .map(|s| lock(&s.engine).wire_stats_to(to))
            .unwrap_or_default()
    }

    /// The links' own byte counts (see `Communicator::raw_byte_counts`).
    pub(super) fn raw_byte_counts(&self) -> (u64, u64) {
        self.own
            .as_ref()
            .map_or((0, 0), |s| lock(&s.engine).raw_byte_counts())
    }

    /// Stops the thread (after [`P2p::wait_idle`]).
    pub(super) fn shutdown(&self) {
        if let Some(s) = &self.own {
            lock(&s.queue).shutdown = true;
            s.cv.notify_all();
            if let Some(w) = &s.waker {
                w.wake();
            }
            if let Some(h) = self.worker.borrow_mut().take() {
                let _ = h.join();
            }
            lock(&s.engine).shutdown();
        }
    }
}

/// A message checked and numbered, not posted yet.
pub(super) struct Prepared {
    send: bool,
    /// Completes on its receipt (see [`Communicator::p2p_batch`]).
    confirm: bool,
    peer: usize,
    fp: Fingerprint,
    seg: usize,
    buf: RawBuf,
}

impl Communicator {
    /// Sends `buf` to rank `peer` with `tag` (any `u32` but `u32::MAX`). Messages
    /// between two ranks are matched in the order they were posted: the receiver's
    /// next `recv` from this rank must name the same tag, type and length, or it fails
    /// with [`Error::Mismatch`] (and this rank, at the latest in its next call, with
    /// the receiver's notice). Returns once the transport holds the message (for a
    /// message larger than the link's buffer, once the peer has taken the rest). A
    /// send to this rank itself is eager, as MPI's self-send: it completes at once and
    /// its bytes are kept (a copy) until this rank's receive from itself takes them.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        let p = self.prepare(true, buf.as_ptr().cast_mut(), buf.len(), peer, tag)?;
        self.post_one(p, true).wait()
    }

    /// Receives into `buf` the next message from rank `peer`, which must carry `tag`
    /// and exactly `buf.len()` elements of this type (see [`Self::send`]). A receive
    /// from this rank itself with no send to itself posted before it for it to take
    /// is refused at once with [`Error::InvalidArgument`]: while it blocks, nothing
    /// could send that message (post it with [`Self::recv_start`], in a scope or in a
    /// [`Self::p2p_batch`] to send it afterwards).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        let p = self.prepare(false, buf.as_mut_ptr(), buf.len(), peer, tag)?;
        self.check_self_recvs("recv")?;
        self.post_one(p, true).wait()
    }

    /// Refuses a blocking `what` (a receive, or a batch) that leaves a receive from
    /// this rank itself without a send to itself posted to match it: no send could be
    /// posted while it blocks. Called after the receives are numbered.
    fn check_self_recvs(&self, what: &str) -> Result<()> {
        let r = self.rank;
        let (sent, received) = {
            let s = self.p2p.seq.borrow();
            (s.0[r], s.1[r])
        };
        self.check(received <= sent, || {
            format!(
                "{what}: rank {r} would wait for ever on a message from itself: {received} \
                 receive(s) from itself but only {sent} send(s) to itself posted before \
                 this blocking call returns (sends to itself are eager: send first, or post \
                 the receive with recv_start)"
            )
        })
    }

    /// Posts every send and receive `f` adds to the [`Batch`] at once, and returns when
    /// all are done: they progress together, so any order of sends and receives
    /// between any ranks completes (`ncclGroupStart`/`ncclGroupEnd`,
    /// `torch.distributed.batch_isend_irecv`). Each operation is matched as
    /// [`Self::send`] says, and a batch's send is done only once its receiver has the
    /// message and found it to be the one it expected (a receipt comes back): two
    /// ranks whose batches disagree on a message both fail in that call. So a batch
    /// must not send to a rank that receives the message only after this batch is
    /// over (post the two directions together). A send to this rank itself is eager
    /// (see [`Self::send`]), and a receive from itself needs its send posted before
    /// the batch or in it, or the batch is refused at once. Returns Ok, or the failure that
    /// started it (a mismatch, a lost peer) rather than the poison it left on the
    /// batch's other operations.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config};
    /// let comms = Communicator::local_group(4, &Config::default())?;
    /// std::thread::scope(|t| {
    ///     let ranks: Vec<_> = comms.into_iter().map(|comm| t.spawn(move || -> ferroccl::Result<()> {
    ///         // Everyone sends to the right and receives from the left, at any size.
    ///         let (r, n) = (comm.rank(), comm.world_size());
    ///         let out = vec![r as u8; 1 << 20];
    ///         let mut got = vec![0u8; 1 << 20];
    ///         comm.p2p_batch(|b| {
    ///             b.send(&out, (r + 1) % n, 0).recv(&mut got, (r + n - 1) % n, 0);
    ///         })?;
    ///         assert_eq!(got[0] as usize, (r + n - 1) % n);
    ///         Ok(())
    ///     })).collect();
    ///     ranks.into_iter().try_for_each(|h| h.join().expect("a rank panicked"))
    /// })?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn p2p_batch<'b>(&'b self, f: impl FnOnce(&mut Batch<'b>)) -> Result<()> {
        let mut b = Batch {
            comm: self,
            ops: Vec::new(),
            refused: None,
            _bufs: PhantomData,
        };
        f(&mut b);
        let Batch {
            mut ops, refused, ..
        } = b;
        if let Some(e) = refused {
            return Err(e);
        }
        self.check_self_recvs("p2p_batch")?;
        for op in &mut ops {
            op.confirm = true;
        }
        let done = self.post(ops, true);
        // The buffers are the caller's until every operation is over. Of the failures,
        // the cause (the mismatch, the lost peer) rather than the poison it left on the
        // others.
        let mut first: Result<()> = Ok(());
        for d in done {
            match (d.wait(), &first) {
                (Err(e), Ok(())) => first = Err(e),
                (Err(e), Err(Error::Poisoned(_))) if !matches!(e, Error::Poisoned(_)) => {
                    first = Err(e)
                }
                _ => {}
            }
        }
        first
    }

    /// Checks a message (peer, tag), takes its sequence number and describes it.
    pub(super) fn prepare<T: Element>(
        &self,
        send: bool,
        ptr: *mut T,
        len: usize,
        peer: usize,
        tag: u32,
    ) -> Result<Prepared> {
        let (n, r) = (self.world_size, self.rank);
        let what = if send { "send" } else { "recv" };
        self.check(peer < n, || {
            format!("{what}: rank {r} cannot exchange messages with rank {peer} (a group of {n})")
        })?;
        self.check(tag != u32::MAX, || {
            format!("{what}: tag {tag} is reserved (tags are 0..{})", u32::MAX)
        })?;
        let seq = {
            let mut s = self.p2p.seq.borrow_mut();
            let counter = if send { &mut s.0[peer] } else { &mut s.1[peer] };
            *counter += 1;
            *counter - 1
        };
        let fp = Fingerprint {
            kind: OpKind::SendRecv,
            seq,
            dtype: T::DTYPE,
            op: None,
            count: len as u64,
            root: Some(tag),
            algo: Algorithm::Direct,
            comm: self.family.id,
        };
        Ok(Prepared {
            send,
            confirm: false,
            peer,
            fp,
            seg: algo::segment_bytes(self.cfg.tuning.segment_bytes, size_of::<T>()),
            buf: RawBuf {
                ptr: ptr.cast(),
                len: len * size_of::<T>(),
            },
        })
    }

    /// Posts `ops` together, in order; each one's completion is returned. With
    /// `blocking` (the caller waits for them next: `send`, `recv`, a batch), the
    /// caller serves them itself when the point-to-point engine is free, instead of
    /// waking the thread and sleeping until it is told: two thread switches less per
    /// call ([`Communicator::serve_own`]).
    ///
    /// SAFETY contract: every buffer stays alive and untouched by the caller until
    /// its completion is set (the caller waits for them all: a batch before it
    /// returns, a scope before it ends).
    pub(super) fn post(&self, ops: Vec<Prepared>, blocking: bool) -> Vec<Arc<Completion>> {
        let issued = now_ns();
        let mut done = Vec::with_capacity(ops.len());
        let mut posted = Vec::with_capacity(ops.len());
        let own = self.p2p.own.clone();
        for p in ops {
            let c = Arc::new(Completion::default());
            done.push(c.clone());
            let tell = match &own {
                Some(s) => {
                    let s = s.clone();
                    Done::new(move |r| {
                        c.set(r);
                        let mut q = lock(&s.queue);
                        q.pending -= 1;
                        if q.pending == 0 && q.idle_waiters > 0 {
                            s.idle.notify_all();
                        }
                    })
                }
                None => Done::new(move |r| c.set(r)),
            };
            posted.push(P2pOp {
                confirm: p.confirm,
                send: p.send,
                peer: p.peer,
                fp: p.fp,
                seg: p.seg,
                buf: Box::new(p.buf),
                done: tell,
                issued,
            });
        }
        match own {
            Some(s) => {
                {
                    let mut q = lock(&s.queue);
                    q.pending += posted.len();
                    q.ops.append(&mut posted);
                }
                self.start_p2p_worker(&s);
                if !(blocking && self.serve_own(&s, &done)) {
                    s.wake_thread(false);
                }
            }
            None => {
                // One job on the collectives' engine: the batch progresses together, in
                // turn with the collectives.
                let src = Fixed(Mutex::new(posted));
                let job: JobFn = Box::new(move |e: &mut Engine| {
                    e.serve_p2p(&src, false);
                    Ok(())
                });
                let _ = self.submit(job);
            }
        }
        done
    }

    /// Serves the point-to-point engine on the caller's thread until every one of
    /// `done` is told, if no one else holds the engine (false: the thread serves
    /// them). What is still in flight then (other posters' operations, receipts
    /// owed) is handed back to the thread.
    fn serve_own(&self, s: &Arc<P2pShared>, done: &[Arc<Completion>]) -> bool {
        let Ok(mut e) = s.engine.try_lock() else {
            return false;
        };
        let told = || done.iter().all(|c| c.is_set());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            e.serve_p2p_until(&**s, true, &told)
        }));
        let left = r.unwrap_or_else(|_| {
            // As on the thread: every operation it held was told; so are the next.
            e.poison("point-to-point serving panicked".into());
            true
        });
        drop(e);
        if left || !lock(&s.queue).ops.is_empty() {
            s.wake_thread(true);
        }
        true
    }

    /// Posts one operation (see [`Self::post`]).
    pub(super) fn post_one(&self, op: Prepared, blocking: bool) -> Arc<Completion> {
        match self.post(vec![op], blocking).pop() {
            Some(c) => c,
            // `post` returns one completion per operation.
            None => {
                let c = Arc::new(Completion::default());
                c.set(Err(Error::InvalidArgument(
                    "internal: nothing posted".into(),
                )));
                c
            }
        }
    }

    /// Starts the point-to-point thread on first use.
    fn start_p2p_worker(&self, s: &Arc<P2pShared>) {
        let mut w = self.p2p.worker.borrow_mut();
        if w.is_some() {
            return;
        }
        let shared = s.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("ferroccl-p2p{}", self.rank))
            .spawn(move || shared.serve());
        match spawned {
            Ok(h) => *w = Some(h),
            Err(e) => {
                // No thread: fail what was posted, and poison (its peers wait for it).
                tracing::warn!("could not start the point-to-point thread ({e})");
                let mut ops = std::mem::take(&mut lock(&s.queue).ops);
                let why = format!("rank {}: no point-to-point thread: {e}", self.rank);
                lock(&self.shared.engine).poison(why.clone());
                for op in ops.drain(..) {
                    op.done.tell(Err(Error::Poisoned(why.clone())));
                }
            }
        }
    }
}

/// The sends and receives of one [`Communicator::p2p_batch`], posted together when the
/// closure returns. Buffers stay borrowed until the batch is over.
pub struct Batch<'b> {
    comm: &'b Communicator,
    ops: Vec<Prepared>,
    /// The first refused argument: the batch fails with it and posts nothing.
    refused: Option<Error>,
    _bufs: PhantomData<&'b mut [u8]>,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("ops", &self.ops.len())
            .finish()
    }
}

impl<'b> Batch<'b> {
    /// Adds a send of `buf` to `peer` with `tag` (see [`Communicator::send`]).
    pub fn send<T: Element>(&mut self, buf: &'b [T], peer: usize, tag: u32) -> &mut Self {
        // A send only reads its buffer (`OpBuffer::read`).
        self.add(true, buf.as_ptr().cast_mut(), buf.len(), peer, tag)
    }

    /// Adds a receive into `buf` from `peer` with `tag` (see [`Communicator::recv`]).
    pub fn recv<T: Element>(&mut self, buf: &'b mut [T], peer: usize, tag: u32) -> &mut Self {
        self.add(false, buf.as_mut_ptr(), buf.len(), peer, tag)
    }

    fn add<T: Element>(
        &mut self,
        send: bool,
        ptr: *mut T,
        len: usize,
        peer: usize,
        tag: u32,
    ) -> &mut Self {
        if self.refused.is_none() {
            match self.comm.prepare(send, ptr, len, peer, tag) {
                Ok(p) => self.ops.push(p),
                Err(e) => self.refused = Some(e),
            }
        }
        self
    }
}
