//! `ferroccl._native.Communicator`: a ferroccl communicator for Python. Every method
//! converts its arguments and hands the operation to the communicator's executor
//! ([`Worker`]); nothing else lives here. With `device=` (a [`PyDeviceOp`]) the
//! buffers are CUDA memory and the operation runs inside the device op's ordering.

use crate::buffer::{
    bufs, recv_device_start, same_type, send_device_start, split_io, typed, DeviceCall, RawBuf,
};
use crate::device::{keeping_context, Backend, PyDeviceOp};
use crate::errors::{to_py, InvalidArgumentError};
use crate::store::{config_for, PyBoard};
use crate::worker::{Done, P2pWait, Ticket, TicketState, Worker};
use ferroccl::order::DeviceOp;
use ferroccl::{AbortHandle, Communicator, Error, ReduceOp, TransportKind};
use pyo3::prelude::*;
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// A device op handed in by Python, and its GPU.
type Dev = (Arc<DeviceOp<Backend>>, usize);

fn dev_of(device: Option<Py<PyDeviceOp>>) -> Option<Dev> {
    device.map(|d| {
        let d = d.get();
        (d.op.clone(), d.ordinal)
    })
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
    hosts: Option<usize>,
}

/// A ferroccl communicator on its own worker thread. Operations run in the order they
/// are issued (see [`crate::worker`]).
#[pyclass(module = "ferroccl._native", name = "Communicator", frozen)]
pub(crate) struct PyCommunicator {
    facts: Facts,
    abort: AbortHandle,
    worker: Arc<Worker>,
}

fn parse_op(op: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(op).map_err(|e| InvalidArgumentError::new_err(e.to_string()))
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
            hosts: comm.host_layout().map(|l| l.hosts().len()),
        };
        let abort = comm.abort_handle();
        let name = format!("ferroccl-py-{}-r{}", facts.id, facts.rank);
        let worker = Worker::start(comm, name)?;
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
        let Some(callback) = callback else {
            let r = self.call(py, op)?;
            return r.map(|()| None).map_err(|e| to_py(py, &e));
        };
        let ticket = Arc::new(TicketState::default());
        let done = Done {
            callback,
            ticket: ticket.clone(),
        };
        self.worker.push(Box::new(move |c| {
            let r = op(c);
            let ticket = done.ticket.clone();
            ticket.mark_ran();
            ticket
                .route(Box::new(move || done.finish(r)))
                .unwrap_or_else(|| Box::new(|| ()))
        }))?;
        Ok(Some(self.ticket(ticket)))
    }

    /// A collective on device memory: `call` runs inside `dev`'s ordering (our stream
    /// waits for the caller's, `done` is recorded after it), blocking or not as
    /// [`Self::submit`]; a blocking one then makes the caller's stream wait for it.
    fn submit_device(
        &self,
        py: Python<'_>,
        callback: Option<Py<PyAny>>,
        dev: Dev,
        call: DeviceCall,
    ) -> PyResult<Option<Ticket>> {
        let (op, ordinal) = dev;
        let waits = callback.is_none();
        let run = op.clone();
        let ticket = self.submit(py, callback, move |c| {
            // SAFETY: the Python side's contract for device memory (`buffer.rs`); the
            // call runs inside its device op.
            run.run(|| keeping_context(|| unsafe { call.run(c, ordinal) }))
        })?;
        if waits {
            op.wait_on(op.caller()).map_err(|e| to_py(py, &e))?;
        }
        Ok(ticket)
    }

    /// Runs `op` on this thread once the queue before it has run, the GIL released.
    fn call<R: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&Communicator) -> ferroccl::Result<R> + Send,
    ) -> PyResult<ferroccl::Result<R>> {
        let worker = &self.worker;
        py.detach(|| worker.call(op))
            .ok_or_else(crate::errors::closed)
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
        let p2p = self.worker.p2p()?;
        self.worker.push(Box::new(move |c| {
            let started = start(c);
            done.ticket.mark_ran();
            match started {
                Ok(wait) => match p2p.send((wait, done)) {
                    Ok(()) => Box::new(|| ()),
                    Err(mpsc::SendError((_, done))) => {
                        done.failed(Error::Poisoned("the communicator is closed".into()))
                    }
                },
                Err(e) => done.failed(e),
            }
        }))?;
        Ok(Some(self.ticket(ticket)))
    }
}

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
    #[pyo3(signature = (store, rank, world_size, advertise, token, job_id, timeout=None, local_rank=None, transport=None))]
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
        transport: Option<String>,
    ) -> PyResult<Self> {
        let mut cfg = config_for(rank, world_size).map_err(|e| to_py(py, &e))?;
        if let Some(t) = transport {
            cfg.transport.kind = TransportKind::parse(&t).map_err(|e| to_py(py, &e))?;
        }
        cfg.job.agent_store = false;
        cfg.job.serve_store = true;
        cfg.job.token = Some(token.into_bytes());
        cfg.job.job_id = Some(job_id);
        if let Some(l) = local_rank {
            cfg.job.local_rank = l;
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
    /// How many hosts the ranks are on, as every rank sees it; None where the links
    /// do not say (ranks as threads).
    #[getter]
    fn hosts(&self) -> Option<usize> {
        self.facts.hosts
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
        py.detach(|| self.worker.join());
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

    #[pyo3(signature = (buf, op, callback=None, device=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        op: &str,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        let op = parse_op(op)?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::AllReduce(b, op));
        }
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.all_reduce(unsafe { b.slice::<T>() }, op))
        })
    }

    #[pyo3(signature = (buf, root, callback=None, device=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::Broadcast(b, root));
        }
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.broadcast(unsafe { b.slice::<T>() }, root))
        })
    }

    #[pyo3(signature = (buf, op, root, callback=None, device=None))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        op: &str,
        root: usize,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        let op = parse_op(op)?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::Reduce(b, op, root));
        }
        self.submit(py, callback, move |c| {
            // SAFETY: the Python side's buffer contract (module docs).
            typed!(b.dt, T => c.reduce(unsafe { b.slice::<T>() }, op, root))
        })
    }

    /// `recv` (world_size × `send`) receives every rank's `send` in rank order.
    #[pyo3(signature = (send, recv, callback=None, device=None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::AllGather(s, r));
        }
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
    #[pyo3(signature = (send, recv, op, callback=None, device=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        op: &str,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        let op = parse_op(op)?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::ReduceScatter(s, r, op));
        }
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
    #[pyo3(signature = (send, recv, send_counts=None, recv_counts=None, callback=None, device=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
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
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::AllToAll(s, r, counts));
        }
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
    #[pyo3(signature = (send, recv, root, callback=None, device=None))]
    fn gather(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::Gather(s, r, root));
        }
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
    #[pyo3(signature = (send, recv, root, callback=None, device=None))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: RawBuf,
        recv: RawBuf,
        root: usize,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [s, r] = bufs([send, recv])?;
        same_type(&[s, r])?;
        if let Some(d) = dev_of(device) {
            return self.submit_device(py, callback, d, DeviceCall::Scatter(s, r, root));
        }
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
    /// the callback ran). With `device`, `buf` is CUDA memory, copied to the host
    /// after the caller's stream's work on it.
    #[pyo3(signature = (buf, peer, tag=0, callback=None, device=None))]
    fn send(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        peer: usize,
        tag: u32,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        if let Some((op, ordinal)) = dev_of(device) {
            let (waits, run) = (callback.is_none(), op.clone());
            let t = self.p2p(py, callback, move |c| {
                run.run(|| {
                    // SAFETY: the Python side's contract for device memory
                    // (`buffer.rs`), inside the device op.
                    keeping_context(|| unsafe { send_device_start(c, b, ordinal, peer, tag) })
                })
            })?;
            if waits {
                op.wait_on(op.caller()).map_err(|e| to_py(py, &e))?;
            }
            return Ok(t);
        }
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
    /// With `device`, `buf` is CUDA memory, written on ferroccl's stream once the
    /// message is in (the device op's end moves behind that copy).
    #[pyo3(signature = (buf, peer, tag=0, callback=None, device=None))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: RawBuf,
        peer: usize,
        tag: u32,
        callback: Option<Py<PyAny>>,
        device: Option<Py<PyDeviceOp>>,
    ) -> PyResult<Option<Ticket>> {
        let [b] = bufs([buf])?;
        if let Some((op, ordinal)) = dev_of(device) {
            let (waits, run, after) = (callback.is_none(), op.clone(), op.clone());
            let t = self.p2p(py, callback, move |c| {
                run.run(|| {
                    keeping_context(|| {
                        // SAFETY: the Python side's contract for device memory
                        // (`buffer.rs`): the buffer is held until this op reports.
                        unsafe {
                            recv_device_start(c, b, ordinal, peer, tag, move || after.after())
                        }
                    })
                })
            })?;
            if waits {
                op.wait_on(op.caller()).map_err(|e| to_py(py, &e))?;
            }
            return Ok(t);
        }
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

    /// A device op for a collective on CUDA memory of GPU `ordinal`, issued by a
    /// caller whose work on the buffers is queued on `stream` (a raw `CUstream`:
    /// `torch.cuda.current_stream().cuda_stream`); pass it as `device=`.
    fn device_op(&self, py: Python<'_>, ordinal: usize, stream: u64) -> PyResult<PyDeviceOp> {
        PyDeviceOp::new(py, ordinal, stream)
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
