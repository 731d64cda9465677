//! `ferroccl._native`: the communicator for Python (the package `ferroccl` wraps it;
//! see `python/ferroccl/__init__.py`).
//!
//! A [`ferroccl::Communicator`] is used from one thread at a time: each sits behind a
//! mutex with a queue of operations in issue order and a worker thread (`Worker`). A
//! non-blocking operation is queued and returns a `Ticket`; its Python callback is
//! called, under the GIL, when it is over — the form `ferroccl.torch` completes futures
//! with. A blocking one (or a ticket's `wait()`) runs the queue up to itself on the
//! caller's thread with the GIL released. Point-to-point operations are posted in
//! order without waiting ([`Communicator::send_start`]), so a receive never holds up
//! the collectives behind it; a second thread waits for them in order.
//!
//! Buffers arrive as `(address, elements, dtype)`: the Python side checked that the
//! memory is a contiguous CPU buffer of that type and holds a reference to its owner
//! until the operation is over (the callback has run or the blocking call returned).
//! This is the only place that turns such an address into a slice (see `Buf`).

use ferroccl::half::{bf16, f16};
use ferroccl::{AbortHandle, Communicator, DataType, Element, Error, ReduceOp};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

create_exception!(
    ferroccl,
    FerrocclError,
    PyRuntimeError,
    "Any ferroccl failure."
);
create_exception!(
    ferroccl,
    InvalidArgumentError,
    FerrocclError,
    "An argument ferroccl cannot use (sizes, ranks, roots)."
);
create_exception!(
    ferroccl,
    UnsupportedError,
    FerrocclError,
    "An operation, type or transport ferroccl does not support (here)."
);
create_exception!(
    ferroccl,
    ConfigError,
    FerrocclError,
    "A configuration or launcher environment ferroccl cannot use."
);
create_exception!(
    ferroccl,
    RendezvousError,
    FerrocclError,
    "The ranks could not meet: the store, a port in use, another job, a handshake."
);
create_exception!(
    ferroccl,
    PeerClosedError,
    FerrocclError,
    "A peer's connection closed (it died or aborted)."
);
create_exception!(
    ferroccl,
    PeerFailedError,
    FerrocclError,
    "Another rank failed first; `origin` names it, `cause` says why and `cause_kind` is the root cause's kind (e.g. `Io`)."
);
create_exception!(
    ferroccl,
    ProtocolError,
    FerrocclError,
    "A peer sent something that breaks the protocol."
);
create_exception!(
    ferroccl,
    MismatchError,
    FerrocclError,
    "Ranks called different collectives (operation, size, type, root)."
);
create_exception!(
    ferroccl,
    TimeoutError,
    FerrocclError,
    "An operation made no progress within the timeout."
);
create_exception!(
    ferroccl,
    AbortedError,
    FerrocclError,
    "The communicator was aborted."
);
create_exception!(
    ferroccl,
    PoisonedError,
    FerrocclError,
    "The communicator failed earlier and can no longer be used."
);

/// The Python exception for `e`, with the facts it carries as attributes (`rank`,
/// `peer`, `origin`, `cause`, `op`; `kind` is the Rust variant's name).
///
/// A rank told of another's failure gets [`Error::PeerFailed`]; its class follows the
/// root cause, which it carries typed (a mismatch found by rank `origin` is a
/// [`MismatchError`] on every rank, with `origin` and `told_by` set), so that code can
/// catch the same class on every rank.
fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    let err = match e {
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        Error::UnsupportedOp { .. } | Error::Unavailable { .. } => UnsupportedError::new_err(msg),
        Error::Env(_) | Error::Config(_) => ConfigError::new_err(msg),
        Error::AddrInUse { .. }
        | Error::StoreUnreachable { .. }
        | Error::OtherJob { .. }
        | Error::Rendezvous(_)
        | Error::Handshake { .. } => RendezvousError::new_err(msg),
        Error::PeerClosed { .. } => PeerClosedError::new_err(msg),
        Error::PeerFailed { .. } if matches!(e.root_cause(), Error::Mismatch { .. }) => {
            MismatchError::new_err(msg)
        }
        Error::PeerFailed { .. } if matches!(e.root_cause(), Error::Timeout { .. }) => {
            TimeoutError::new_err(msg)
        }
        Error::PeerFailed { .. } => PeerFailedError::new_err(msg),
        Error::Protocol { .. } => ProtocolError::new_err(msg),
        Error::Mismatch { .. } => MismatchError::new_err(msg),
        Error::Timeout { .. } => TimeoutError::new_err(msg),
        Error::Aborted { .. } => AbortedError::new_err(msg),
        Error::Poisoned(_) => PoisonedError::new_err(msg),
        _ => FerrocclError::new_err(msg),
    };
    let value = err.value(py);
    let _ = value.setattr("kind", e.kind());
    let set = |k: &str, v: usize| {
        let _ = value.setattr(k, v);
    };
    match e {
        Error::PeerClosed { rank, peer, op } | Error::Protocol { rank, peer, op, .. } => {
            set("rank", *rank);
            set("peer", *peer);
            let _ = value.setattr("op", op);
        }
        Error::Mismatch { rank, peer, .. } => {
            set("rank", *rank);
            set("peer", *peer);
        }
        Error::PeerFailed {
            rank,
            peer,
            origin,
            cause,
            op,
        } => {
            set("rank", *rank);
            set("told_by", *peer);
            set("origin", *origin);
            let _ = value.setattr("cause", cause.to_string());
            let _ = value.setattr("cause_kind", e.root_cause().kind());
            let _ = value.setattr("op", op);
        }
        Error::Timeout {
            rank, op, after, ..
        } => {
            set("rank", *rank);
            let _ = value.setattr("op", op);
            let _ = value.setattr("after", after.as_secs_f64());
        }
        Error::Aborted { rank, op } => {
            set("rank", *rank);
            let _ = value.setattr("op", op);
        }
        _ => {}
    }
    err
}

fn worker_gone() -> PyErr {
    PoisonedError::new_err("the communicator is closed")
}

/// A CPU buffer handed in by Python: address, element count, element type. The Python
/// side (`ferroccl._buffer`) checked it is contiguous memory of that type, and keeps
/// its owner alive and untouched until the operation is over.
#[derive(Clone, Copy, Debug)]
struct Buf {
    addr: usize,
    len: usize,
    dt: DataType,
}

impl Buf {
    fn new((addr, len, dtype): (usize, usize, String)) -> PyResult<Self> {
        let dt = parse_dtype(&dtype)?;
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
    unsafe fn slice<'a, T: Element>(self) -> &'a mut [T] {
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
    unsafe fn to_vec<T: Element>(self) -> Vec<T> {
        // SAFETY: the caller's contract; the slice does not outlive the call.
        unsafe { self.slice::<T>() }.to_vec()
    }
}

fn parse_dtype(s: &str) -> PyResult<DataType> {
    Ok(match s {
        "float32" => DataType::F32,
        "float64" => DataType::F64,
        "float16" => DataType::F16,
        "bfloat16" => DataType::BF16,
        "int32" => DataType::I32,
        "int64" => DataType::I64,
        "uint8" => DataType::U8,
        other => {
            return Err(UnsupportedError::new_err(format!(
                "ferroccl does not support the element type {other} (it has float32, \
                 float64, float16, bfloat16, int32, int64 and uint8)"
            )))
        }
    })
}

fn parse_op(s: &str) -> PyResult<ReduceOp> {
    Ok(match s {
        "sum" => ReduceOp::Sum,
        "prod" | "product" => ReduceOp::Prod,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "avg" | "mean" => ReduceOp::Avg,
        other => {
            return Err(UnsupportedError::new_err(format!(
                "ferroccl has no reduction {other:?} (it has sum, prod, min, max and avg)"
            )))
        }
    })
}

/// Runs `$body` with `$T` the Rust type of `$dt`.
macro_rules! typed {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DataType::F32 => {
                type $T = f32;
                $body
            }
            DataType::F64 => {
                type $T = f64;
                $body
            }
            DataType::F16 => {
                type $T = f16;
                $body
            }
            DataType::BF16 => {
                type $T = bf16;
                $body
            }
            DataType::I32 => {
                type $T = i32;
                $body
            }
            DataType::I64 => {
                type $T = i64;
                $body
            }
            DataType::U8 => {
                type $T = u8;
                $body
            }
            other => Err(Error::InvalidArgument(format!(
                "ferroccl's Python binding has no element type {other}"
            ))),
        }
    };
}

/// The same type on every buffer of one call.
fn same_type(bufs: &[Buf]) -> PyResult<DataType> {
    let dt = bufs[0].dt;
    if let Some(b) = bufs.iter().find(|b| b.dt != dt) {
        return Err(InvalidArgumentError::new_err(format!(
            "the buffers of one call must have one element type ({} and {})",
            dt, b.dt
        )));
    }
    Ok(dt)
}

/// The input of a call with an input and an output: read in place when the two do
/// not overlap, else first copied out (an in-place all-gather, an all-to-all of a
/// tensor with itself).
enum Input<'a, T> {
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
unsafe fn split_io<'a, T: Element>(input: Buf, output: Buf) -> (Input<'a, T>, &'a mut [T]) {
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

type Task = Box<dyn FnOnce(&Communicator) + Send>;

/// A started point-to-point operation: waits, then (a receive) copies the message into
/// the caller's buffer and reports.
type P2pWait = Box<dyn FnOnce() -> ferroccl::Result<()> + Send>;

/// Every worker this process started, for [`shutdown`].
static WORKERS: Mutex<Vec<(Arc<Worker>, AbortHandle)>> = Mutex::new(Vec::new());

/// Seconds from Python as a duration in `0..=max`: NaN and negatives are 0, infinity
/// is `max` (`Duration::from_secs_f64` would panic on them).
fn secs(s: f64, max: f64) -> Duration {
    Duration::from_secs_f64(if s.is_nan() { 0.0 } else { s.clamp(0.0, max) })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(PoisonError::into_inner)
}

/// Ends every worker before the interpreter finalises (`atexit`): a worker that called
/// into Python during finalisation would be torn down mid-call. Each gets `grace` to
/// finish what it was given, then is aborted (its operations fail at once).
#[pyfunction]
#[pyo3(signature = (grace=2.0))]
fn shutdown(py: Python<'_>, grace: f64) {
    let all = std::mem::take(&mut *lock(&WORKERS));
    for (w, _) in &all {
        w.close();
    }
    let grace = secs(grace, 3600.0);
    py.detach(move || {
        let start = std::time::Instant::now();
        for (w, abort) in &all {
            while lock(&w.threads).iter().any(|t| !t.is_finished()) {
                if start.elapsed() > grace {
                    abort.abort();
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            for t in std::mem::take(&mut *lock(&w.threads)) {
                let _ = t.join();
            }
        }
    });
}

/// What a communicator's threads and its callers share.
///
/// Operations are queued in issue order and run by whoever holds `comm`: the worker
/// thread, or a caller that waits for an operation (a blocking call, `Ticket.wait()`
/// without a timeout) and runs the queue up to it itself instead of sleeping while
/// the worker wakes up — two thread switches per call saved, which is most of a small
/// message's cost. Tasks are taken from the queue only by a holder of `comm`, so they
/// run in order whoever runs them. `comm` must only be locked with the GIL released
/// (a task's callback takes the GIL).
struct Worker {
    comm: Mutex<Option<Communicator>>,
    queue: Mutex<Queue>,
    wake: Condvar,
    p2p: Mutex<Option<mpsc::Sender<(P2pWait, Done)>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    closed: bool,
}

impl Worker {
    fn push(&self, t: Task) -> PyResult<()> {
        let mut q = lock(&self.queue);
        if q.closed {
            return Err(worker_gone());
        }
        q.tasks.push_back(t);
        self.wake.notify_one();
        Ok(())
    }

    /// Takes the communicator and runs the queued tasks in order until `enough()` or
    /// the queue is empty; returns the communicator still held. Without the GIL.
    fn run_queue(&self, enough: impl Fn() -> bool) -> MutexGuard<'_, Option<Communicator>> {
        let comm = lock(&self.comm);
        while !enough() {
            let Some(task) = lock(&self.queue).tasks.pop_front() else {
                break;
            };
            if let Some(c) = comm.as_ref() {
                task(c);
            }
        }
        comm
    }

    /// The worker thread: runs tasks as they come; once closed and empty, drops the
    /// communicator (its links close).
    fn serve(&self) {
        loop {
            {
                let mut q = lock(&self.queue);
                while q.tasks.is_empty() && !q.closed {
                    q = wait(&self.wake, q);
                }
                if q.tasks.is_empty() {
                    break;
                }
            }
            let comm = lock(&self.comm);
            let task = lock(&self.queue).tasks.pop_front();
            if let (Some(task), Some(c)) = (task, comm.as_ref()) {
                task(c);
            }
        }
        drop(lock(&self.comm).take());
    }

    /// Lets the threads end once the operations given are over.
    fn close(&self) {
        lock(&self.queue).closed = true;
        self.wake.notify_all();
        drop(lock(&self.p2p).take());
    }
}

/// Whether an operation is over (its callback has run).
#[derive(Default)]
struct TicketState {
    done: Mutex<bool>,
    cv: Condvar,
}

impl TicketState {
    fn set(&self) {
        *lock(&self.done) = true;
        self.cv.notify_all();
    }
    fn is_done(&self) -> bool {
        *lock(&self.done)
    }
}

/// A non-blocking operation's handle: `wait()` returns once its callback has run.
#[pyclass(module = "ferroccl._native", name = "Ticket", frozen)]
struct Ticket {
    state: Arc<TicketState>,
    worker: Arc<Worker>,
}

#[pymethods]
impl Ticket {
    /// True once the operation is over (its callback has run); never blocks.
    fn done(&self) -> bool {
        self.state.is_done()
    }

    /// Waits until the operation is over; False if `timeout` seconds passed first.
    /// Without a timeout, the waiting thread runs the queue up to this operation
    /// itself (so it cannot be interrupted mid-operation; ferroccl's own timeout
    /// applies); with one, it only waits.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let (state, worker) = (self.state.clone(), self.worker.clone());
        py.detach(move || {
            let mut done = match timeout {
                None => {
                    drop(worker.run_queue(|| state.is_done()));
                    lock(&state.done)
                }
                Some(_) => lock(&state.done),
            };
            let deadline = timeout.map(|t| std::time::Instant::now() + secs(t, 1e9));
            while !*done {
                match deadline {
                    None => done = wait(&state.cv, done),
                    Some(d) => {
                        let left = d.saturating_duration_since(std::time::Instant::now());
                        if left.is_zero() {
                            return false;
                        }
                        done = state
                            .cv
                            .wait_timeout(done, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                }
            }
            true
        })
    }
}

/// How a non-blocking operation reports: its Python callback (under the GIL), then
/// its ticket.
struct Done {
    callback: Py<PyAny>,
    ticket: Arc<TicketState>,
}

impl Done {
    fn finish(self, r: ferroccl::Result<()>) {
        Python::attach(|py| {
            let arg: Py<PyAny> = match &r {
                Ok(()) => py.None(),
                Err(e) => to_py(py, e).into_value(py).into_any(),
            };
            if let Err(e) = self.callback.call1(py, (arg,)) {
                e.write_unraisable(py, None);
            }
        });
        self.ticket.set();
    }
}

/// The communicator's facts, read without a trip to its worker.
#[derive(Clone)]
struct Facts {
    rank: usize,
    world_size: usize,
    id: u64,
    job_ranks: Vec<usize>,
    local_rank: usize,
    transport: String,
}

/// A ferroccl communicator on its own worker thread. Operations run in the order they
/// are issued (see the module docs).
#[pyclass(module = "ferroccl._native", name = "Communicator", frozen)]
struct PyCommunicator {
    facts: Facts,
    abort: AbortHandle,
    worker: Arc<Worker>,
}

impl PyCommunicator {
    /// Moves `comm` behind a worker thread of its own.
    fn spawn(comm: Communicator) -> PyResult<Self> {
        let facts = Facts {
            rank: comm.rank(),
            world_size: comm.world_size(),
            id: comm.id(),
            job_ranks: comm.job_ranks().to_vec(),
            local_rank: comm.local_rank(),
            transport: comm
                .link_classes()
                .first()
                .map_or("local", |(_, c)| c)
                .to_owned(),
        };
        let abort = comm.abort_handle();
        let (ptx, prx) = mpsc::channel::<(P2pWait, Done)>();
        let worker = Arc::new(Worker {
            comm: Mutex::new(Some(comm)),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            p2p: Mutex::new(Some(ptx)),
            threads: Mutex::new(Vec::new()),
        });
        let name = format!("ferroccl-py-{}-r{}", facts.id, facts.rank);
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| FerrocclError::new_err(format!("cannot start a thread: {e}")))
        };
        let w = worker.clone();
        let t1 = spawn(name.clone(), Box::new(move || w.serve()))?;
        let t2 = spawn(
            format!("{name}-p2p"),
            Box::new(move || {
                while let Ok((wait, done)) = prx.recv() {
                    done.finish(wait());
                }
            }),
        )?;
        lock(&worker.threads).extend([t1, t2]);
        let mut all = lock(&WORKERS);
        all.retain(|(w, _)| lock(&w.threads).iter().any(|t| !t.is_finished()));
        all.push((worker.clone(), abort.clone()));
        drop(all);
        Ok(PyCommunicator {
            facts,
            abort,
            worker,
        })
    }

    fn ticket(&self, state: Arc<TicketState>) -> Ticket {
        Ticket {
            state,
            worker: self.worker.clone(),
        }
    }

    /// Runs `op` in issue order: without a callback, on this thread once the queue
    /// before it has run (the GIL released), raising its error; with one, queued, and
    /// `callback(None | exception)` is called when it is over (returns its ticket).
    fn submit(
        &self,
        py: Python<'_>,
        callback: Option<Py<PyAny>>,
        op: impl FnOnce(&Communicator) -> ferroccl::Result<()> + Send + 'static,
    ) -> PyResult<Option<Ticket>> {
        match callback {
            Some(callback) => {
                let ticket = Arc::new(TicketState::default());
                let done = Done {
                    callback,
                    ticket: ticket.clone(),
                };
                self.worker.push(Box::new(move |c| done.finish(op(c))))?;
                Ok(Some(self.ticket(ticket)))
            }
            None => {
                let r = self.call(py, op)?;
                r.map(|()| None).map_err(|e| to_py(py, &e))
            }
        }
    }

    /// Runs `op` on this thread once the queue before it has run, the GIL released.
    fn call<R: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&Communicator) -> ferroccl::Result<R> + Send,
    ) -> PyResult<ferroccl::Result<R>> {
        let worker = &self.worker;
        py.detach(|| {
            let comm = worker.run_queue(|| false);
            comm.as_ref().map(op)
        })
        .ok_or_else(worker_gone)
    }

    /// A point-to-point operation: `start` posts it (in issue order, returning at
    /// once) and hands back what waits for it. Blocking: both here. Non-blocking: the
    /// start is queued, and the p2p thread waits, in order, and reports.
    fn p2p(
        &self,
        py: Python<'_>,
        callback: Option<Py<PyAny>>,
        start: impl FnOnce(&Communicator) -> ferroccl::Result<P2pWait> + Send + 'static,
    ) -> PyResult<Option<Ticket>> {
        let Some(callback) = callback else {
            let waiter = self.call(py, start)?.map_err(|e| to_py(py, &e))?;
            return py.detach(waiter).map(|()| None).map_err(|e| to_py(py, &e));
        };
        let ticket = Arc::new(TicketState::default());
        let done = Done {
            callback,
            ticket: ticket.clone(),
        };
        let p2p = lock(&self.worker.p2p).clone().ok_or_else(worker_gone)?;
        self.worker.push(Box::new(move |c| match start(c) {
            Ok(wait) => {
                if let Err(mpsc::SendError((_, done))) = p2p.send((wait, done)) {
                    done.finish(Err(Error::Poisoned("the communicator is closed".into())));
                }
            }
            Err(e) => done.finish(Err(e)),
        }))?;
        Ok(Some(self.ticket(ticket)))
    }
}

/// Fills the fields of a child's [`Config`](ferroccl::Config) lookup: the rank and
/// size the caller was told, the `FERROCCL_*` settings and the launcher's identity
/// from the environment.
fn env_lookup(rank: usize, world_size: usize) -> impl Fn(&str) -> Option<String> {
    move |k: &str| match k {
        "RANK" => Some(rank.to_string()),
        "WORLD_SIZE" => Some(world_size.to_string()),
        // Another family's variables would take precedence over the values given.
        k if k.starts_with("OMPI_COMM_WORLD_")
            || k.starts_with("PMI_")
            || k.starts_with("SLURM_")
            || k == "MPI_LOCALRANKID" =>
        {
            None
        }
        k => std::env::var(k).ok(),
    }
}

/// The store `torch.distributed` hands its backend (any object with `set(key, bytes)`
/// and `get(key) -> bytes`, and `wait([key], timedelta)`), as a [`ferroccl::rendezvous::Board`].
struct PyBoard {
    store: Py<PyAny>,
}

impl ferroccl::rendezvous::Board for PyBoard {
    fn set(&mut self, key: &str, value: &[u8]) -> ferroccl::Result<()> {
        Python::attach(|py| {
            self.store
                .call_method1(py, "set", (key, pyo3::types::PyBytes::new(py, value)))
                .map(drop)
                .map_err(|e| {
                    ferroccl::Error::Rendezvous(format!("setting {key:?} on the store: {e}"))
                })
        })
    }

    fn wait_get(&mut self, key: &str, timeout: Duration) -> ferroccl::Result<Vec<u8>> {
        Python::attach(|py| {
            let delta = pyo3::types::PyDelta::new(
                py,
                0,
                i32::try_from(timeout.as_secs()).unwrap_or(i32::MAX),
                timeout.subsec_micros() as i32,
                true,
            )
            .map_err(|e| ferroccl::Error::Rendezvous(e.to_string()))?;
            let keys =
                PyList::new(py, [key]).map_err(|e| ferroccl::Error::Rendezvous(e.to_string()))?;
            self.store
                .call_method1(py, "wait", (keys, delta))
                .map_err(|e| {
                    ferroccl::Error::Rendezvous(format!(
                        "waiting {timeout:?} for {key:?} on the store: {e}"
                    ))
                })?;
            let v = self
                .store
                .call_method1(py, "get", (key,))
                .and_then(|v| v.extract::<Vec<u8>>(py))
                .map_err(|e| {
                    ferroccl::Error::Rendezvous(format!("reading {key:?} from the store: {e}"))
                })?;
            Ok(v)
        })
    }
}

/// Reads `(addr, len, dtype)` tuples into buffers.
fn bufs<const N: usize>(raw: [(usize, usize, String); N]) -> PyResult<[Buf; N]> {
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

type RawBuf = (usize, usize, String);

#[pymethods]
impl PyCommunicator {
    /// Joins the job the launcher environment describes (torchrun, Slurm, mpirun,
    /// `ferroccl launch`; `FERROCCL_*` settings apply).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Self> {
        let c = py
            .detach(Communicator::from_env)
            .map_err(|e| to_py(py, &e))?;
        Self::spawn(c)
    }

    /// `world_size` communicators linked in-process, one per Python thread (tests).
    #[staticmethod]
    fn local_group(py: Python<'_>, world_size: usize) -> PyResult<Vec<Self>> {
        let cs = py
            .detach(|| Communicator::local_group(world_size, &ferroccl::Config::default()))
            .map_err(|e| to_py(py, &e))?;
        cs.into_iter().map(Self::spawn).collect()
    }

    /// Rank `rank` of `world_size` meeting on `store` (an object with `set`, `get` and
    /// `wait`, as a `torch.distributed.Store`): rank 0 serves ferroccl's store on a
    /// free port and publishes `advertise:port` there. `token` and `job_id` must be the
    /// same on every rank; the other settings come from `FERROCCL_*` variables.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, advertise, token, job_id, timeout=None, local_rank=None))]
    #[allow(clippy::too_many_arguments)]
    fn on_store(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        advertise: String,
        token: String,
        job_id: String,
        timeout: Option<f64>,
        local_rank: Option<usize>,
    ) -> PyResult<Self> {
        let mut cfg = ferroccl::Config::from_lookup(env_lookup(rank, world_size))
            .map_err(|e| to_py(py, &e))?;
        cfg.job.agent_store = false;
        cfg.job.serve_store = true;
        cfg.job.token = Some(token.into_bytes());
        cfg.job.job_id = Some(job_id);
        if let Some(l) = local_rank {
            cfg.job.local_rank = l;
        }
        if let Ok(v) = std::env::var("FERROCCL_BUSY_POLL_US") {
            let us: u64 = v.trim().parse().map_err(|_| {
                ConfigError::new_err(format!(
                    "FERROCCL_BUSY_POLL_US={v:?} is not a number of microseconds"
                ))
            })?;
            cfg.tuning.busy_poll = Duration::from_micros(us);
        }
        if let Some(t) = timeout {
            if !(t.is_finite() && t > 0.0 && t < 1e9) {
                return Err(InvalidArgumentError::new_err(format!(
                    "timeout must be a positive number of seconds, not {t}"
                )));
            }
            cfg.tuning.timeout = Duration::from_secs_f64(t);
            cfg.tuning.connect_timeout = Duration::from_secs_f64(t);
        }
        let mut board = PyBoard { store };
        let c = py
            .detach(|| Communicator::init_on_board(cfg, &mut board, &advertise))
            .map_err(|e| to_py(py, &e))?;
        Self::spawn(c)
    }

    #[getter]
    fn rank(&self) -> usize {
        self.facts.rank
    }
    #[getter]
    fn world_size(&self) -> usize {
        self.facts.world_size
    }
    #[getter]
    fn local_rank(&self) -> usize {
        self.facts.local_rank
    }
    /// 0 for the job's communicator, a child's id otherwise.
    #[getter]
    fn id(&self) -> u64 {
        self.facts.id
    }
    /// The job rank of each rank of this communicator.
    #[getter]
    fn job_ranks(&self) -> Vec<usize> {
        self.facts.job_ranks.clone()
    }
    /// What carries the links to the first peer (`tcp`, `shm`, `local`, ...).
    #[getter]
    fn transport(&self) -> String {
        self.facts.transport.clone()
    }

    /// Fails every operation in flight with `AbortedError` and poisons the
    /// communicator (its peers fail fast); from any thread.
    fn abort(&self) {
        self.abort.abort();
    }

    /// Stops the worker after the operations already issued, and drops the
    /// communicator (its links close). Later calls raise `PoisonedError`.
    fn close(&self, py: Python<'_>) {
        self.worker.close();
        let threads = std::mem::take(&mut *lock(&self.worker.threads));
        py.detach(|| {
            for t in threads {
                // Called from a callback on the worker itself: it ends on its own.
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
        });
    }

    /// The first failure's text once the communicator failed, else None.
    fn poisoned(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.call(py, |c| Ok(c.poisoned()))
            .map(|r| r.ok().flatten())
    }

    /// Writes the flight recorder under `dir`; returns the file's path.
    fn dump_trace(&self, py: Python<'_>, dir: String) -> PyResult<String> {
        let r = self.call(py, move |c| c.dump_trace(&dir))?;
        r.map(|p| p.display().to_string())
            .map_err(|e| to_py(py, &e))
    }

    #[pyo3(signature = (buf, op, callback=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        op: &str,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        let op = parse_op(op)?;
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.all_reduce(unsafe { b.slice::<T>() }, op))
        })
    }

    #[pyo3(signature = (buf, root, callback=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.broadcast(unsafe { b.slice::<T>() }, root))
        })
    }

    #[pyo3(signature = (buf, op, root, callback=None))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        op: &str,
        root: usize,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        let op = parse_op(op)?;
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.reduce(unsafe { b.slice::<T>() }, op, root))
        })
    }

    /// `recv` (world_size × `send`) receives every rank's `send` in rank order.
    #[pyo3(signature = (send, recv, callback=None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        self.submit(py, callback, move |c| {
            typed!(s.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs).
                let (i, o) = unsafe { split_io::<T>(s, r) };
                c.all_gather(&i, o)
            })
        })
    }

    /// `recv` receives this rank's block of the reduction of every rank's `send`
    /// (world_size × `recv`).
    #[pyo3(signature = (send, recv, op, callback=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        op: &str,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        let op = parse_op(op)?;
        self.submit(py, callback, move |c| {
            typed!(s.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs).
                let (i, o) = unsafe { split_io::<T>(s, r) };
                c.reduce_scatter(&i, o, op)
            })
        })
    }

    /// Block `q` of `send` goes to rank `q`; block `q` of `recv` comes from rank `q`
    /// (equal blocks), or, with counts, `send_counts[q]` and `recv_counts[q]`
    /// elements packed in rank order.
    #[pyo3(signature = (send, recv, send_counts=None, recv_counts=None, callback=None))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        let counts = match (send_counts, recv_counts) {
            (None, None) => None,
            (Some(sc), Some(rc)) => {
                let displs = |c: &[usize]| {
                    c.iter()
                        .scan(0usize, |acc, &x| {
                            let d = *acc;
                            *acc += x;
                            Some(d)
                        })
                        .collect::<Vec<_>>()
                };
                let (sd, rd) = (displs(&sc), displs(&rc));
                Some((sc, sd, rc, rd))
            }
            _ => {
                return Err(InvalidArgumentError::new_err(
                    "all_to_all: give both send_counts and recv_counts, or neither",
                ))
            }
        };
        self.submit(py, callback, move |c| {
            typed!(s.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs).
                let (i, o) = unsafe { split_io::<T>(s, r) };
                match &counts {
                    None => c.all_to_all(&i, o),
                    Some((sc, sd, rc, rd)) => c.all_to_allv(&i, sc, sd, o, rc, rd),
                }
            })
        })
    }

    /// `root`'s `recv` (world_size × `send`) receives every rank's `send` in rank
    /// order; elsewhere `recv` may be empty.
    #[pyo3(signature = (send, recv, root, callback=None))]
    fn gather(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        self.submit(py, callback, move |c| {
            typed!(s.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs).
                let (i, o) = unsafe { split_io::<T>(s, r) };
                c.gather(&i, o, root)
            })
        })
    }

    /// Rank `q`'s `recv` receives block `q` of `root`'s `send` (world_size × `recv`);
    /// elsewhere `send` may be empty.
    #[pyo3(signature = (send, recv, root, callback=None))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        self.submit(py, callback, move |c| {
            typed!(s.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs).
                let (i, o) = unsafe { split_io::<T>(s, r) };
                c.scatter(&i, o, root)
            })
        })
    }

    #[pyo3(signature = (callback=None))]
    fn barrier(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<Option<Ticket>> {
        self.submit(py, callback, |c| c.barrier())
    }

    /// Sends `buf` to `peer` with `tag`; it may be reused once the call returns (or
    /// the callback ran).
    #[pyo3(signature = (buf, peer, tag=0, callback=None))]
    fn send(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        peer: usize,
        tag: u32,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        self.p2p(py, callback, move |c| {
            typed!(b.dt, T => {
                // SAFETY: the Python side's buffer contract (module docs); the copy is
                // made now, on the worker, while the buffer is still held.
                let p = c.send_start(unsafe { b.to_vec::<T>() }, peer, tag)?;
                Ok(Box::new(move || p.wait().map(drop)) as P2pWait)
            })
        })
    }

    /// Receives a message of exactly `buf`'s size from `peer` with `tag` into `buf`.
    #[pyo3(signature = (buf, peer, tag=0, callback=None))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        peer: usize,
        tag: u32,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        self.p2p(py, callback, move |c| {
            typed!(b.dt, T => {
                let p = c.recv_start(vec![T::default(); b.len], peer, tag)?;
                Ok(Box::new(move || {
                    let v = p.wait()?;
                    // SAFETY: the Python side's buffer contract (module docs): the
                    // buffer is held until this operation reports.
                    unsafe { b.slice::<T>() }.copy_from_slice(&v);
                    Ok(())
                }) as P2pWait)
            })
        })
    }

    /// MPI's `comm_split`: the ranks passing the same color form a child, ranked by
    /// (key, rank); `None` joins none and gets None. Collective.
    #[pyo3(signature = (color, key=0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i64) -> PyResult<Option<Self>> {
        let r = self.call(py, move |c| c.split(color, key))?;
        r.map_err(|e| to_py(py, &e))?.map(Self::spawn).transpose()
    }

    /// The child of the ranks listed, in that order; None on the others. Collective.
    fn group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<Option<Self>> {
        let r = self.call(py, move |c| c.group(&ranks))?;
        r.map_err(|e| to_py(py, &e))?.map(Self::spawn).transpose()
    }

    /// The child of the ranks listed, made by the members alone (each passes the same
    /// list and nonce): `torch.distributed.new_group`'s form.
    fn group_of_members(&self, py: Python<'_>, ranks: Vec<usize>, nonce: u64) -> PyResult<Self> {
        let r = self.call(py, move |c| c.group_of_members(&ranks, nonce))?;
        Self::spawn(r.map_err(|e| to_py(py, &e))?)
    }

    /// The child of the ranks on this host. Collective.
    fn split_by_host(&self, py: Python<'_>) -> PyResult<Self> {
        let r = self.call(py, |c| c.split_by_host())?;
        Self::spawn(r.map_err(|e| to_py(py, &e))?)
    }
}

impl Drop for PyCommunicator {
    fn drop(&mut self) {
        // Without joining: the worker may be waiting for the GIL this thread holds.
        // It ends once the operations issued are over, and drops the communicator;
        // `shutdown` joins it before the interpreter finalises.
        self.worker.close();
    }
}

/// A fresh random job token (64 hex digits).
#[pyfunction]
fn new_token() -> String {
    ferroccl::rendezvous::new_token()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyCommunicator>()?;
    m.add_class::<Ticket>()?;
    m.add_function(wrap_pyfunction!(new_token, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add("FerrocclError", py.get_type::<FerrocclError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RendezvousError", py.get_type::<RendezvousError>())?;
    m.add("PeerClosedError", py.get_type::<PeerClosedError>())?;
    m.add("PeerFailedError", py.get_type::<PeerFailedError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("PoisonedError", py.get_type::<PoisonedError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
