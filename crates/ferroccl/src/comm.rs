//! The communicator: a rank's view of the job, its links, and the collectives on them.

use crate::engine::{Dst, Engine, In, Out};
use crate::error::{Error, Result};
use crate::reduce::{self, check_op, DataType, Element, ReduceOp};
use crate::rendezvous::{self, StoreClient, StoreServer};
use crate::sync::{lock, wait};
use crate::transport::tcp::{self, ConnectCtx, TcpOptions};
use crate::transport::{local, Channel, Links, TransportKind};
use crate::wire::{Algorithm, Fingerprint, OpKind, WireStats};
use crate::{broadcast, doubling, ring, schedule};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::mem::size_of;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Default for [`Config::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Config::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Config::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: usize = 512 << 10;
/// Default for [`Config::socket_buffer`].
pub const DEFAULT_SOCKET_BUFFER: usize = 4 << 20;
/// Default for [`Config::busy_poll`].
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_millis(1);
/// Default for [`Config::small_message_bytes`].
pub const DEFAULT_SMALL_MESSAGE_BYTES: usize = 64 << 10;
/// Default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Everything a communicator needs, passed in explicitly. [`Config::from_env`] fills it
/// from a launcher's environment; tests and embedders build it by hand.
#[derive(Clone, Debug)]
pub struct Config {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host (informational; devices use it later).
    pub local_rank: usize,
    /// `host:port` of the rendezvous store (`MASTER_ADDR:MASTER_PORT`).
    pub master_addr: String,
    /// When true (the default), rank 0 serves the store at `master_addr`; when false,
    /// the store is run by someone else (a test harness, another service).
    pub serve_store: bool,
    /// Transport for data links.
    pub transport: TransportKind,
    /// The longest any collective waits without a byte moving before it fails with
    /// [`Error::Timeout`] and poisons the communicator. Default 60 s.
    pub timeout: Duration,
    /// The longest start-up may take: reaching the store while rank 0 comes up, and
    /// connecting to peers. Default 60 s.
    pub connect_timeout: Duration,
    /// Pipelining granularity: ring chunks are cut into segments of at most this many
    /// bytes, and segment `j+1` is received while segment `j` is reduced and forwarded.
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// Kernel socket buffer size for TCP links (0: leave the kernel's autotuning).
    /// Default 4 MiB.
    pub socket_buffer: usize,
    /// How long a collective keeps polling its links (yielding the CPU between polls)
    /// before it sleeps until the kernel wakes it. Waking a sleeping thread costs tens
    /// of microseconds, which dominates small messages; polling a little first avoids
    /// it. `Duration::ZERO` always sleeps. Default 1 ms (on loopback, 1 MiB all-reduce
    /// medians: 243 µs vs 314 µs with 300 µs at 2 ranks, 1349 vs 1598 µs at 4).
    pub busy_poll: Duration,
    /// All-reduces of at most this many bytes use recursive doubling (`log2 n` steps,
    /// each moving the whole buffer) instead of the ring (`2(n-1)` steps, each moving
    /// `1/n` of it): for small messages latency, not bandwidth, is the cost. 0 always
    /// uses the ring. Must be equal on every rank. Default 64 KiB, where the two cross
    /// over on loopback TCP at 2 and 4 ranks.
    pub small_message_bytes: usize,
    /// The job token (`FERROCCL_TOKEN`; `ferroccl launch` makes one): when set, every
    /// connection — to the rendezvous store and between ranks — proves it by HMAC
    /// challenge-response, and anything that cannot is refused. Never sent in clear.
    /// Must be the same on every rank. Default: none.
    pub token: Option<Vec<u8>>,
    /// GID table index for the RDMA transport (port 1): InfiniBand routes by LID and
    /// ignores it; RoCE routes by GID, and RoCE v2 often needs an index other than 0
    /// (`show_gids`). From `FERROCCL_RDMA_GID_INDEX` in [`Config::from_env`]. Default 0.
    pub rdma_gid_index: u8,
}

impl Config {
    /// A config for `rank` of `world_size` meeting at `master_addr`, with defaults.
    pub fn new(rank: usize, world_size: usize, master_addr: impl Into<String>) -> Self {
        Config {
            rank,
            world_size,
            local_rank: rank,
            master_addr: master_addr.into(),
            serve_store: true,
            transport: TransportKind::Tcp,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            busy_poll: DEFAULT_BUSY_POLL,
            small_message_bytes: DEFAULT_SMALL_MESSAGE_BYTES,
            token: None,
            rdma_gid_index: 0,
        }
    }

    /// Reads the launcher environment (torchrun, Slurm, Open MPI, PMI; see
    /// [`rendezvous::detect_env`]). `MASTER_ADDR` defaults to `127.0.0.1` and
    /// `MASTER_PORT` to 29500; `FERROCCL_TOKEN`, when set, becomes [`Config::token`], and
    /// `FERROCCL_RDMA_GID_INDEX` [`Config::rdma_gid_index`].
    pub fn from_env() -> Result<Self> {
        let env = rendezvous::detect_env()?.ok_or_else(|| {
            Error::Env(
                "no launcher environment found: set RANK and WORLD_SIZE (torchrun), or run under \
                 srun, mpirun or `ferroccl launch`"
                    .into(),
            )
        })?;
        let host = env.master_addr.unwrap_or_else(|| "127.0.0.1".into());
        let port = env.master_port.unwrap_or(DEFAULT_MASTER_PORT);
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mut c = Config::new(env.rank, env.world_size, addr);
        c.local_rank = env.local_rank.unwrap_or(0);
        c.token = env.token.map(String::into_bytes);
        c.rdma_gid_index = env.rdma_gid_index.unwrap_or(0);
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(Error::Config("world_size must be at least 1".into()));
        }
        if self.rank >= self.world_size {
            return Err(Error::Config(format!(
                "rank {} is out of range for world_size {}",
                self.rank, self.world_size
            )));
        }
        if self.segment_bytes == 0 || self.segment_bytes > (1 << 30) {
            return Err(Error::Config(format!(
                "segment_bytes {} must be in 1..=1 GiB",
                self.segment_bytes
            )));
        }
        if self.small_message_bytes > u32::MAX as usize {
            return Err(Error::Config(format!(
                "small_message_bytes {} must fit a frame (< 4 GiB)",
                self.small_message_bytes
            )));
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::Config("timeouts must be positive".into()));
        }
        Ok(())
    }
}

/// One rank's handle on a group of ranks: its links to peers and the collectives over
/// them.
///
/// Collective calls must be made in the same order on every rank with matching
/// arguments; where they are not, the ranks that notice fail with [`Error::Mismatch`]
/// naming both calls. Every call takes `&self` but the type is not `Sync`: one thread
/// issues a communicator's calls, so their order is the program's order. It is `Send`,
/// so that thread can be any thread.
///
/// Any failure of a collective — a timeout, a closed connection, a mismatch, or an
/// argument this rank cannot use (its peers would otherwise wait for it) — poisons the
/// communicator: its links are shut down, so peers fail fast too, and every later call
/// returns [`Error::Poisoned`] with the first failure's text.
///
/// Non-blocking forms live in a [`Scope`] ([`Communicator::scope`]): they return a
/// [`Handle`] at once, progress on a background thread in issue order, and the scope
/// waits for all of them before it returns.
pub struct Communicator {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    cfg: Config,
    seq: Cell<u64>,
    /// Point-to-point sequence numbers: messages sent to / received from each peer.
    p2p_seq: RefCell<(Vec<u64>, Vec<u64>)>,
    shared: Arc<Shared>,
    worker: RefCell<Option<std::thread::JoinHandle<()>>>,
    abort: Arc<AtomicBool>,
    /// Working copy for out-of-place forms that reduce in place (8-byte aligned).
    work: RefCell<Vec<u64>>,
    /// The CUDA-IPC side of the `cuda-ipc` transport (device all-reduces).
    #[cfg(feature = "cuda")]
    pub(crate) ipc: RefCell<Option<crate::transport::cuda_ipc::IpcState>>,
    // Kept alive for the communicator's lifetime: ranks may still be reading it.
    _store_server: Option<StoreServer>,
}

/// What the issuing thread and the background worker share.
struct Shared {
    engine: Mutex<Engine>,
    queue: Mutex<Queue>,
    /// Signals new jobs (to the worker) and finished jobs (to waiters).
    cv: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs submitted and not yet finished.
    pending: usize,
    shutdown: bool,
}

type JobFn = Box<dyn FnOnce(&mut Engine) -> Result<()> + Send + 'static>;

struct Job {
    run: JobFn,
    done: Arc<Completion>,
}

/// Where a background operation reports its outcome.
#[derive(Default)]
struct Completion {
    state: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Completion {
    fn set(&self, r: Result<()>) {
        *lock(&self.state) = Some(r);
        self.cv.notify_all();
    }
}

/// A raw pointer that may travel to the worker thread. The scope (or the blocking
/// caller) guarantees the memory outlives the job.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: see above; the pointee is only touched by the job.
unsafe impl Send for SendPtr {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("seq", &self.seq.get())
            .finish()
    }
}

/// The ranks a rank links to when it starts: its ring neighbours and its
/// recursive-doubling partners (at most `2 + log2 n`). Other peers are linked on first
/// point-to-point use.
fn link_peers(rank: usize, n: usize) -> Vec<usize> {
    if n == 1 {
        return vec![];
    }
    let mut v = vec![(rank + n - 1) % n, (rank + 1) % n];
    v.extend(crate::doubling::peers(rank, n));
    v.sort_unstable();
    v.dedup();
    v
}

/// The byte-level kernel combining two buffers of `T` with `op`.
fn reducer<T: Element>(op: ReduceOp) -> impl Fn(&mut [u8], &[u8]) {
    move |d: &mut [u8], s: &[u8]| reduce::kernels::reduce_bytes(T::DTYPE, op, d, s)
}

/// What runs once on a fully reduced buffer of `T`: Avg's division by `n`.
fn finisher<T: Element>(op: ReduceOp, n: usize) -> impl Fn(&mut [u8]) {
    move |d: &mut [u8]| {
        if op == ReduceOp::Avg {
            reduce::kernels::scale_bytes(T::DTYPE, d, n)
        }
    }
}

impl Communicator {
    /// Joins the job described by the launcher environment ([`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::init(Config::from_env()?)
    }

    /// Joins the job described by `cfg`: rank 0 serves the rendezvous store (unless
    /// `serve_store` is false), every rank publishes its data address there and
    /// connects to its ring neighbours and recursive-doubling partners.
    pub fn init(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        match cfg.transport {
            TransportKind::Local => {
                return Err(Error::Config(
                    "the local transport links threads of one process: use \
                     Communicator::local_group"
                        .into(),
                ))
            }
            // Before touching the store: a machine without RDMA fails at once.
            TransportKind::Rdma => {
                crate::transport::rdma::probe()?;
            }
            // Likewise a machine without a GPU.
            #[cfg(feature = "cuda")]
            TransportKind::CudaIpc => {
                crate::cuda::probe()?;
            }
            _ => {}
        }
        let server = if cfg.rank == 0 && cfg.serve_store {
            let addr = resolve(&cfg.master_addr)?;
            Some(StoreServer::bind_with_token(
                addr,
                cfg.world_size,
                cfg.token.clone(),
            )?)
        } else {
            None
        };
        let mut store = StoreClient::connect_with_token(
            &cfg.master_addr,
            cfg.connect_timeout,
            cfg.token.as_deref(),
        )?;
        let comm_id = store.join(cfg.rank, cfg.world_size)?;
        // CUDA IPC exchanges its handles through the store later (at the first device
        // all-reduce), on a connection of its own.
        #[cfg(feature = "cuda")]
        let ipc = if cfg.transport == TransportKind::CudaIpc {
            let s = StoreClient::connect_with_token(
                &cfg.master_addr,
                cfg.connect_timeout,
                cfg.token.as_deref(),
            )?;
            Some(crate::transport::cuda_ipc::IpcState::new(s, comm_id))
        } else {
            None
        };
        #[cfg(feature = "rdma")]
        if cfg.transport == TransportKind::Rdma {
            let links =
                crate::transport::rdma::verbs::endpoint(crate::transport::rdma::verbs::VerbsCtx {
                    rank: cfg.rank,
                    world_size: cfg.world_size,
                    comm_id,
                    store,
                    params: crate::transport::rdma::proto::Params::default(),
                    gid_index: cfg.rdma_gid_index,
                })?;
            return Self::assemble(cfg, links, server);
        }
        let links = tcp::endpoint(ConnectCtx {
            rank: cfg.rank,
            world_size: cfg.world_size,
            comm_id,
            store,
            opts: TcpOptions {
                socket_buffer: cfg.socket_buffer,
                connect_timeout: cfg.connect_timeout,
            },
            token: cfg.token.clone(),
        })?;
        let c = Self::assemble(cfg, links, server)?;
        #[cfg(feature = "cuda")]
        {
            *c.ipc.borrow_mut() = ipc;
        }
        tracing::debug!(rank = c.rank, world = c.world_size, "communicator ready");
        Ok(c)
    }

    /// `world_size` communicators linked by in-process pipes, one per thread-rank
    /// (element `r` is rank `r`). `base` supplies timeouts and segment size; its rank,
    /// world size and address are ignored.
    pub fn local_group(world_size: usize, base: &Config) -> Result<Vec<Self>> {
        let mut probe = base.clone();
        probe.rank = 0;
        probe.world_size = world_size;
        probe.validate()?;
        local::group(world_size, local::PIPE_CAPACITY)
            .into_iter()
            .enumerate()
            .map(|(r, links)| {
                let mut cfg = base.clone();
                cfg.rank = r;
                cfg.local_rank = r;
                cfg.world_size = world_size;
                cfg.transport = TransportKind::Local;
                Self::assemble(cfg, links, None)
            })
            .collect()
    }

    /// A communicator for rank `cfg.rank` over links made elsewhere (for example
    /// [`crate::transport::rdma::sim::group`]); it connects its neighbours now, as
    /// [`Communicator::init`] does. `cfg.master_addr` and `cfg.transport` are not used.
    pub fn with_links(cfg: Config, links: Links) -> Result<Self> {
        cfg.validate()?;
        Self::assemble(cfg, links, None)
    }

    fn assemble(cfg: Config, links: Links, server: Option<StoreServer>) -> Result<Self> {
        let mut engine = Engine::new(cfg.clone(), links);
        // Connect higher ranks first: they are the ones accepting (see transport::tcp).
        let deadline = Instant::now() + cfg.connect_timeout;
        let mut peers = link_peers(cfg.rank, cfg.world_size);
        peers.sort_by_key(|&p| (p < cfg.rank, p));
        for p in peers {
            engine.connect(Channel::Collective, p, deadline)?;
        }
        let n = cfg.world_size;
        let abort = engine.abort.clone();
        Ok(Communicator {
            abort,
            work: RefCell::new(Vec::new()),
            rank: cfg.rank,
            world_size: n,
            local_rank: cfg.local_rank,
            seq: Cell::new(0),
            p2p_seq: RefCell::new((vec![0; n], vec![0; n])),
            shared: Arc::new(Shared {
                engine: Mutex::new(engine),
                queue: Mutex::new(Queue::default()),
                cv: Condvar::new(),
            }),
            worker: RefCell::new(None),
            #[cfg(feature = "cuda")]
            ipc: RefCell::new(None),
            _store_server: server,
            cfg,
        })
    }

    /// This rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank among the processes of this host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The configuration this communicator runs with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Sequence number the next collective will carry (collectives count from 0).
    pub fn next_seq(&self) -> u64 {
        self.seq.get()
    }

    /// Bytes moved so far over all links, headers and payload counted apart. Waits for
    /// background operations to finish first.
    pub fn wire_stats(&self) -> WireStats {
        self.wait_idle();
        lock(&self.shared.engine).wire_stats()
    }

    /// Bytes the links themselves report writing and reading (for cross-checking
    /// [`Self::wire_stats`]: the two must agree).
    pub fn raw_byte_counts(&self) -> (u64, u64) {
        self.wait_idle();
        lock(&self.shared.engine).raw_byte_counts()
    }

    /// A handle that can abort this communicator from any thread (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            flag: self.abort.clone(),
        }
    }

    /// Why this communicator is unusable, if it is.
    pub fn poisoned(&self) -> Option<String> {
        lock(&self.shared.engine).poisoned.clone()
    }

    /// The algorithm an all-reduce of `bytes` bytes uses on this communicator.
    pub fn all_reduce_algorithm(&self, bytes: usize) -> Algorithm {
        if bytes <= self.cfg.small_message_bytes && self.world_size > 1 {
            Algorithm::RecursiveDoubling
        } else {
            Algorithm::Ring
        }
    }

    // ---- execution ----

    /// Blocks until every background operation has finished.
    fn wait_idle(&self) {
        let mut q = lock(&self.shared.queue);
        while q.pending > 0 {
            q = wait(&self.shared.cv, q);
        }
    }

    /// Runs a job on this thread, after any background ones.
    pub(crate) fn run_now(&self, job: impl FnOnce(&mut Engine) -> Result<()>) -> Result<()> {
        self.wait_idle();
        lock(&self.shared.engine).run(job)
    }

    /// Fails the call and poisons the communicator: this rank will not take part, so
    /// its peers must not wait for it.
    pub(crate) fn refuse(&self, e: Error) -> Error {
        self.wait_idle();
        lock(&self.shared.engine).poison(format!("rank {} refused a call: {e}", self.rank));
        e
    }

    pub(crate) fn check(&self, ok: bool, what: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.refuse(Error::InvalidArgument(what())))
        }
    }

    pub(crate) fn check_root(&self, root: usize) -> Result<()> {
        let n = self.world_size;
        self.check(root < n, || {
            format!("root {root} is not a rank of this group of {n}")
        })
    }

    pub(crate) fn check_op<T: Element>(&self, op: ReduceOp) -> Result<()> {
        check_op(T::DTYPE, op).map_err(|e| self.refuse(e))
    }

    /// Hands a job to the background worker (started on first use).
    fn submit(&self, run: JobFn) -> Arc<Completion> {
        let done = Arc::new(Completion::default());
        {
            let mut q = lock(&self.shared.queue);
            q.pending += 1;
            q.jobs.push_back(Job {
                run,
                done: done.clone(),
            });
        }
        self.shared.cv.notify_all();
        let mut w = self.worker.borrow_mut();
        if w.is_none() {
            let shared = self.shared.clone();
            let name = format!("ferroccl-rank{}", self.rank);
            match std::thread::Builder::new()
                .name(name)
                .spawn(move || worker(&shared))
            {
                Ok(h) => *w = Some(h),
                Err(e) => {
                    // No thread: run the queue here, now.
                    tracing::warn!("could not start the background worker ({e}); running inline");
                    drain_inline(&self.shared);
                }
            }
        }
        done
    }

    pub(crate) fn fingerprint(
        &self,
        kind: OpKind,
        dtype: DataType,
        op: Option<ReduceOp>,
        count: usize,
        root: Option<usize>,
        algo: Algorithm,
    ) -> Fingerprint {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        Fingerprint {
            kind,
            seq,
            dtype,
            op,
            count: count as u64,
            root: root.map(|r| r as u32),
            algo,
        }
    }

    // ---- job builders: validate, fingerprint, and capture the buffers ----
    //
    // SAFETY contract of every `job_*`: the returned job dereferences the given
    // buffers; the caller must keep them alive and untouched until the job has run
    // (`run_now` blocks; a `Scope` waits for all its jobs).

    fn job_all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        let algo = self.all_reduce_algorithm(std::mem::size_of_val(buf));
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None, algo);
        let n = self.world_size;
        Ok(job_over(buf, move |e, b| {
            let (red, fin) = (reducer::<T>(op), finisher::<T>(op, n));
            run_all_reduce(e, b, size_of::<T>(), algo, &fp, &red, &fin)
        }))
    }

    /// Reduce-scatter in place over `chunks` (element ranges of `buf`, one per rank).
    fn job_reduce_scatter<T: Element>(
        &self,
        buf: &mut [T],
        chunks: Vec<Range<usize>>,
        op: ReduceOp,
    ) -> Result<JobFn> {
        self.check_op::<T>(op)?;
        let fp = self.fingerprint(
            OpKind::ReduceScatter,
            T::DTYPE,
            Some(op),
            buf.len(),
            None,
            Algorithm::Ring,
        );
        let n = self.world_size;
        Ok(job_over(buf, move |e, b| {
            let (red, fin) = (reducer::<T>(op), finisher::<T>(op, n));
            ring::run(
                e,
                b,
                size_of::<T>(),
                &chunks,
                0..n.saturating_sub(1),
                &fp,
                &red,
                &fin,
            )
        }))
    }

    /// All-gather in place over `chunks`.
    fn job_all_gather<T: Element>(
        &self,
        buf: &mut [T],
        chunks: Vec<Range<usize>>,
    ) -> Result<JobFn> {
        let fp = self.fingerprint(
            OpKind::AllGather,
            T::DTYPE,
            None,
            buf.len(),
            None,
            Algorithm::Ring,
        );
        let n = self.world_size;
        Ok(job_over(buf, move |e, b| {
            let steps = n.saturating_sub(1)..schedule::allreduce_steps(n);
            ring::run(
                e,
                b,
                size_of::<T>(),
                &chunks,
                steps,
                &fp,
                &|_, _| {},
                &|_| {},
            )
        }))
    }

    fn job_broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<JobFn> {
        self.check_root(root)?;
        let fp = self.fingerprint(
            OpKind::Broadcast,
            T::DTYPE,
            None,
            buf.len(),
            Some(root),
            Algorithm::Chain,
        );
        Ok(job_over(buf, move |e, b| {
            broadcast::broadcast(e, b, size_of::<T>(), root, &fp)
        }))
    }

    fn job_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<JobFn> {
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
        let n = self.world_size;
        Ok(job_over(buf, move |e, b| {
            let (red, fin) = (reducer::<T>(op), finisher::<T>(op, n));
            broadcast::reduce(e, b, size_of::<T>(), root, &fp, &red, &fin)
        }))
    }

    fn job_barrier(&self) -> JobFn {
        let fp = self.fingerprint(
            OpKind::Barrier,
            DataType::U8,
            None,
            0,
            None,
            Algorithm::RecursiveDoubling,
        );
        Box::new(move |e: &mut Engine| doubling::all_reduce(e, &mut [], &fp, &|_, _| {}, &|_| {}))
    }

    // ---- collectives ----

    /// Reduces `buf` across all ranks, in place: afterwards every rank holds the same,
    /// bitwise identical, result. Messages up to [`Config::small_message_bytes`] use
    /// recursive doubling, larger ones the pipelined ring.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(3, &Config::new(0, 1, "")).unwrap();
    /// let results: Vec<Vec<f32>> = std::thread::scope(|s| {
    ///     let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || {
    ///         let mut v = vec![c.rank() as f32 + 1.0; 5];
    ///         c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///         v
    ///     })).collect();
    ///     hs.into_iter().map(|h| h.join().unwrap()).collect()
    /// });
    /// assert!(results.iter().all(|v| v == &vec![6.0; 5]));
    /// ```
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let job = self.job_all_reduce(buf, op)?;
        self.run_now(job)
    }

    /// Out-of-place all-reduce: `recv` receives the reduction of every rank's `send`.
    /// `send` and `recv` must have the same length (on this rank and on all others).
    pub fn all_reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check(send.len() == recv.len(), || {
            format!(
                "all_reduce_into: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )
        })?;
        recv.copy_from_slice(send);
        self.all_reduce(recv, op)
    }

    /// Reduce-scatter: rank `r` receives in `recv` the reduction of block `r` of every
    /// rank's `send`, where `send` holds `world_size` blocks of `recv.len()` elements.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = vec![recv.len(); self.world_size];
        self.reduce_scatterv(send, recv, &counts, op)
    }

    /// Reduce-scatter with per-rank block sizes: `send` is the concatenation of blocks
    /// of `counts[0..n]` elements, and rank `r` receives block `r` (`recv.len()` must be
    /// `counts[r]`). `counts` must be the same on every rank.
    pub fn reduce_scatterv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_counts(counts, send.len(), recv.len(), "reduce_scatterv", "send")?;
        let chunks = schedule::chunks_from_counts(counts);
        // The ring reduces in place; keep the caller's input intact by working on a
        // copy, in a buffer kept between calls (no allocation or page faults per call).
        let mut words = self.work.borrow_mut();
        let need = std::mem::size_of_val(send).div_ceil(8);
        if words.len() < need {
            words.resize(need, 0);
        }
        let bytes =
            &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..std::mem::size_of_val(send)];
        let work: &mut [T] = bytemuck::cast_slice_mut(bytes);
        work.copy_from_slice(send);
        let job = self.job_reduce_scatter(work, chunks.clone(), op)?;
        self.run_now(job)?;
        recv.copy_from_slice(&work[chunks[self.rank].clone()]);
        Ok(())
    }

    /// In-place reduce-scatter: `buf` holds `world_size` equal blocks; afterwards block
    /// `rank` holds the reduction (other blocks hold partial results).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "reduce_scatter_in_place")?;
        let job = self.job_reduce_scatter(buf, chunks, op)?;
        self.run_now(job)
    }

    /// All-gather: `recv` receives every rank's `send`, in rank order
    /// (`recv.len() == world_size * send.len()`).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let counts = vec![send.len(); self.world_size];
        self.all_gatherv(send, recv, &counts)
    }

    /// All-gather with per-rank sizes: rank `r` contributes `counts[r]` elements
    /// (`send.len()`), and `recv` receives the concatenation. `counts` must be the same
    /// on every rank.
    pub fn all_gatherv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.check_counts(counts, recv.len(), send.len(), "all_gatherv", "recv")?;
        let chunks = schedule::chunks_from_counts(counts);
        recv[chunks[self.rank].clone()].copy_from_slice(send);
        let job = self.job_all_gather(recv, chunks)?;
        self.run_now(job)
    }

    /// In-place all-gather: `buf` holds `world_size` equal blocks and this rank's block
    /// `rank` is its contribution; afterwards every block is filled.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let chunks = self.equal_blocks(buf.len(), "all_gather_in_place")?;
        let job = self.job_all_gather(buf, chunks)?;
        self.run_now(job)
    }

    /// Broadcasts `buf` from `root` to every rank, as a pipelined chain.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let job = self.job_broadcast(buf, root)?;
        self.run_now(job)
    }

    /// Reduces every rank's `buf` into `root`'s, in place, as a pipelined chain. On the
    /// other ranks `buf` is working space and holds a partial result afterwards.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let job = self.job_reduce(buf, op, root)?;
        self.run_now(job)
    }

    /// Out-of-place reduce: `root`'s `recv` receives the reduction of every rank's
    /// `send`; `send` is untouched everywhere and `recv` (same length as `send` on
    /// every rank) is working space on the others.
    pub fn reduce_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check(send.len() == recv.len(), || {
            format!(
                "reduce_into: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )
        })?;
        recv.copy_from_slice(send);
        self.reduce(recv, op, root)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let job = self.job_barrier();
        self.run_now(job)
    }

    /// `len` elements as `world_size` equal blocks, or a refusal naming `what`.
    fn equal_blocks(&self, len: usize, what: &str) -> Result<Vec<Range<usize>>> {
        let n = self.world_size;
        self.check(len.is_multiple_of(n), || {
            format!("{what}: {len} elements do not split into {n} equal blocks")
        })?;
        Ok(schedule::chunks_from_counts(&vec![len / n; n]))
    }

    fn check_counts(
        &self,
        counts: &[usize],
        total: usize,
        mine: usize,
        what: &str,
        whole: &str,
    ) -> Result<()> {
        let n = self.world_size;
        self.check(counts.len() == n, || {
            format!("{what}: {} counts for {n} ranks", counts.len())
        })?;
        let sum: usize = counts.iter().sum();
        self.check(sum == total, || {
            format!("{what}: counts sum to {sum} but {whole} has {total} elements")
        })?;
        let r = self.rank;
        self.check(counts[r] == mine, || {
            format!(
                "{what}: counts[{r}] is {} but this rank's block has {mine} elements",
                counts[r]
            )
        })
    }

    // ---- point to point ----

    /// Sends `buf` to rank `peer` with a `tag`. Messages between two ranks are matched in
    /// the order they were sent: the receiver's next `recv` from this rank must name the
    /// same tag, type and length, or both fail with [`Error::Mismatch`]. Returns once the
    /// data is handed to the transport.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        let (fp, seg) = self.p2p_start::<T>(peer, tag, buf.len(), true)?;
        let bytes: &[u8] = bytemuck::cast_slice(buf);
        let outs: Vec<Out> = p2p_frames(bytes.len(), seg)
            .map(|(j, off, len)| Out {
                peer,
                step: 0,
                seg: j,
                off,
                len,
                after_recv: None,
            })
            .collect();
        let base = bytes.as_ptr().cast_mut();
        self.run_now(|e| {
            // SAFETY: outgoing frames only read `buf`, which outlives the call.
            unsafe { e.stream(Channel::P2p, &fp, base, &outs, &[], &mut |_, _| {}) }
        })
    }

    /// Receives into `buf` the next message from rank `peer`, which must carry `tag`
    /// and exactly `buf.len()` elements of this type (see [`Self::send`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        let (fp, seg) = self.p2p_start::<T>(peer, tag, buf.len(), false)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let ins: Vec<In> = p2p_frames(bytes.len(), seg)
            .map(|(j, off, len)| In {
                peer,
                step: 0,
                seg: j,
                len,
                dst: Dst::Buf(off),
                after_send: None,
            })
            .collect();
        let base = bytes.as_mut_ptr();
        self.run_now(|e| {
            // SAFETY: frames land in disjoint parts of `buf`, which outlives the call.
            unsafe { e.stream(Channel::P2p, &fp, base, &[], &ins, &mut |_, _| {}) }
        })
    }

    /// Checks `peer`, takes the next sequence number of messages sent to it (`sending`)
    /// or received from it, and returns the message's fingerprint and segment bytes.
    fn p2p_start<T: Element>(
        &self,
        peer: usize,
        tag: u32,
        count: usize,
        sending: bool,
    ) -> Result<(Fingerprint, usize)> {
        self.check_peer(peer)?;
        let seq = {
            let mut s = self.p2p_seq.borrow_mut();
            let counter = if sending {
                &mut s.0[peer]
            } else {
                &mut s.1[peer]
            };
            *counter += 1;
            *counter - 1
        };
        let fp = Fingerprint {
            kind: OpKind::SendRecv,
            seq,
            dtype: T::DTYPE,
            op: None,
            count: count as u64,
            root: Some(tag),
            algo: Algorithm::Direct,
        };
        let seg = (self.cfg.segment_bytes / size_of::<T>()).max(1) * size_of::<T>();
        Ok((fp, seg))
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        let (n, r) = (self.world_size, self.rank);
        self.check(peer < n && peer != r, || {
            format!("rank {r} cannot exchange messages with rank {peer} (group of {n})")
        })
    }

    // ---- non-blocking ----

    /// Runs `f` with a [`Scope`] in which collectives can be started without waiting
    /// for them. Operations progress in the background, in the order they were issued,
    /// while `f` goes on; every one of them has finished when `scope` returns (even if
    /// a [`Handle`] was dropped or forgotten), so the buffers they borrow are safe.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(2, &Config::new(0, 1, "")).unwrap();
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
}

impl Communicator {
    /// Starts an all-reduce of an owned buffer and returns at once; the buffer comes
    /// back from [`Pending::wait`]. Unlike a [`Scope`], nothing is borrowed, so the
    /// caller can keep computing (a backward pass, say) and start more operations
    /// before it waits: this is the form gradient buckets use. Operations run in the
    /// order they were started, after any already queued.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(2, &Config::new(0, 1, "")).unwrap();
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

/// An operation on an owned buffer in flight ([`Communicator::all_reduce_start`]).
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
            st = wait(&self.done.cv, st);
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
/// communicator (blocking or in a [`Scope`]) fails with [`Error::Aborted`] within about
/// 100 ms; the communicator is poisoned (its links shut, so its peers fail fast with
/// [`Error::PeerClosed`]) and every later call returns [`Error::Poisoned`].
#[derive(Clone, Debug)]
pub struct AbortHandle {
    flag: Arc<AtomicBool>,
}

impl AbortHandle {
    /// Aborts the communicator. Idempotent.
    pub fn abort(&self) {
        self.flag.store(true, Ordering::Relaxed);
    }

    /// Whether [`AbortHandle::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }
}

/// A job running `run` over `buf` as bytes. Only the buffer's raw parts travel with
/// the job; see the SAFETY contract of the `job_*` builders.
fn job_over<T: Element>(
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

/// An all-reduce of `b` (elements of `esize` bytes) by `algo`, combining with `red` and
/// finishing with `fin`: the one dispatch host and device buffers share.
pub(crate) fn run_all_reduce(
    e: &mut Engine,
    b: &mut [u8],
    esize: usize,
    algo: Algorithm,
    fp: &Fingerprint,
    red: &dyn Fn(&mut [u8], &[u8]),
    fin: &dyn Fn(&mut [u8]),
) -> Result<()> {
    match algo {
        Algorithm::RecursiveDoubling => doubling::all_reduce(e, b, fp, red, fin),
        _ => {
            let n = e.world_size;
            let chunks = schedule::balanced_chunks(b.len() / esize, n);
            let steps = 0..schedule::allreduce_steps(n);
            ring::run(e, b, esize, &chunks, steps, fp, red, fin)
        }
    }
}

/// Frames of a point-to-point message: `(segment, offset, length)` in bytes.
fn p2p_frames(len: usize, seg: usize) -> impl Iterator<Item = (u32, usize, usize)> {
    let whole = 0..len;
    (0..schedule::segments(len, seg)).map(move |j| {
        let r = schedule::segment_range(&whole, seg, j);
        (j as u32, r.start, r.len())
    })
}

fn worker(shared: &Shared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                q = wait(&shared.cv, q);
            }
        };
        run_job(shared, job);
    }
}

fn drain_inline(shared: &Shared) {
    loop {
        let Some(job) = lock(&shared.queue).jobs.pop_front() else {
            return;
        };
        run_job(shared, job);
    }
}

fn run_job(shared: &Shared, job: Job) {
    let Job { run, done } = job;
    let r = {
        let mut e = lock(&shared.engine);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.run(run)));
        r.unwrap_or_else(|_| {
            e.poison("a background operation panicked".into());
            Err(Error::Poisoned("a background operation panicked".into()))
        })
    };
    done.set(r);
    lock(&shared.queue).pending -= 1;
    shared.cv.notify_all();
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.wait_idle();
        lock(&self.shared.queue).shutdown = true;
        self.shared.cv.notify_all();
        if let Some(h) = self.worker.get_mut().take() {
            let _ = h.join();
        }
        lock(&self.shared.engine).shutdown();
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
            st = wait(&self.done.cv, st);
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
    fn start<T>(
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
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve master address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("master address {addr:?} resolves to nothing")))
}
