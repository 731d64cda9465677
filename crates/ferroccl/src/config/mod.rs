//! Everything a communicator needs, passed in explicitly: who this rank is in which job
//! ([`Job`]), how collectives run ([`Tuning`]), and which transport links the ranks,
//! with its options ([`TransportOptions`]).
//!
//! [`Config::from_env`] fills a config from a launcher's environment (the only place
//! the library reads environment variables is [`crate::rendezvous`]); embedders and
//! tests use [`Config::builder`]:
//!
//! ```
//! use ferroccl::{Config, TransportKind};
//! use std::time::Duration;
//!
//! let cfg = Config::builder(0, 4, "10.0.0.1:29500")
//!     .timeout(Duration::from_secs(30))
//!     .segment_bytes(1 << 20)
//!     .transport(TransportKind::Tcp)
//!     .build()?;
//! assert_eq!(cfg.job.world_size, 4);
//! assert_eq!(cfg.tuning.segment_bytes, 1 << 20);
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! Every struct here is `#[non_exhaustive]`: fields can be read and changed, and new
//! ones can be added without breaking anyone who builds configs through the builder.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod cost;
mod transport;

pub use cost::{CostModel, CostModelSpec};
pub use transport::{
    CudaIpcOptions, RdmaOptions, ShmOptions, TcpCongestion, TcpOptions, TransportKind,
    TransportOptions,
};

/// Default for [`Tuning::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Tuning::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest timeout (of a wait or of the join) a [`Config`] takes: 7 days. Longer
/// ones are refused rather than overflowing a deadline.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default for [`Tuning::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: usize = 512 << 10;
/// Default for [`TcpOptions::socket_buffer`].
pub const DEFAULT_SOCKET_BUFFER: usize = 4 << 20;
/// Default for [`ShmOptions::ring_bytes`].
///
/// 1 MiB: a ring that small stays in a core's 1 MiB L2 and the shared L3 between its
/// writer and its reader, where a 4 MiB one (the first default) cycled its writes
/// through memory the caches had already let go. Measured on the 2-core development
/// machine, `ferroccl bench` with 1 MiB rings against 4 MiB, 6 interleaved pairs per
/// cell, 9 collectives × n = 2, 4 × 64 KiB / 1 MiB / 16 MiB: the median time ratio was
/// 0.64–0.99 in 48 of the 54 cells (all-to-all at n = 4 0.64 at 1 MiB and 0.72 at
/// 16 MiB, broadcast at 64 KiB 0.73–0.74, reduce 0.78–0.88), level in two and slower
/// in four, all at n = 4 on 2 CPUs: reduce-scatter 1.12 / 1.25 at 64 KiB / 1 MiB and
/// send/recv 1.09 / 1.15, where a writer that may run further ahead waits less often
/// for a reader that shares its CPU. A quarter of the shared memory, too.
pub const DEFAULT_SHM_RING_BYTES: usize = 1 << 20;
/// Default for [`ShmOptions::single_copy_min`].
///
/// Off: on the machine measured (a 2-core VM), pulling frames from the writer's memory
/// gave 0.34-0.73x the ring's all-reduce busbw at most sizes from 64 KiB to 64 MiB
/// (2 and 4 ranks), and at best the same (4 ranks, 4-16 MiB): the kernel pins the
/// writer's pages on every call, and a writer waits for its reader on every frame
/// instead of running ahead into the ring. Measure yours with `tools/ab-bench` (see the
/// book's Performance chapter) before turning it on.
pub const DEFAULT_SHM_SINGLE_COPY_MIN: usize = 0;
/// Default for [`Tuning::trace_capacity`].
pub const DEFAULT_TRACE_CAPACITY: usize = 2048;
/// Default for [`Tuning::busy_poll`].
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_millis(1);
/// Default for [`Tuning::small_message_bytes`].
pub const DEFAULT_SMALL_MESSAGE_BYTES: usize = 64 << 10;
/// Default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A communicator's configuration; see the [module docs](self).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Who this process is, in which job, and where the job meets.
    pub job: Job,
    /// How collectives run: deadlines, pipelining, algorithm thresholds.
    pub tuning: Tuning,
    /// Which transport links the ranks, and its options.
    pub transport: TransportOptions,
}

pub use crate::algo::select::AllReduceAlgo;

/// An on/off setting as a user writes it: `on`, `1`, `true` or `off`, `0`, `false`.
fn on_off(v: &str) -> std::result::Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(format!("{v:?} is neither `on` nor `off`")),
    }
}

impl std::str::FromStr for AllReduceAlgo {
    type Err = Error;
    /// `auto`, `ring`, `rd` (or `recursive-doubling`), `rabenseifner`, `tree`, `hier`
    /// (or `hierarchical`), `one-shot`, `two-shot`; anything else is an error naming them, never a fallback.
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "ring" => Self::Ring,
            "rd" | "recursive-doubling" | "doubling" => Self::RecursiveDoubling,
            "rabenseifner" | "rab" => Self::Rabenseifner,
            "tree" => Self::Tree,
            "hier" | "hierarchical" => Self::Hierarchical,
            "one-shot" | "oneshot" => Self::OneShot,
            "two-shot" | "twoshot" => Self::TwoShot,
            other => {
                return Err(Error::Config(format!(
                    "unknown all-reduce algorithm '{other}': use auto, ring, rd, rabenseifner, \
                     tree, hier, one-shot or two-shot"
                )))
            }
        })
    }
}

/// This process's place in a job: rank, size, and the rendezvous.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Job {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host (which GPU a rank uses, for example).
    pub local_rank: usize,
    /// How many ranks run on this host, when the launcher says
    /// ([`crate::rendezvous::LaunchEnv::local_world_size`]): where the transport does
    /// not know the hosts (TCP), it tells whether they outnumber the CPUs (see
    /// [`Tuning::busy_poll`]). Default: none.
    pub local_world_size: Option<usize>,
    /// `host:port` of the rendezvous store (`MASTER_ADDR:MASTER_PORT`).
    pub master_addr: String,
    /// When true (the default), rank 0 serves the store at `master_addr`; when false,
    /// the store is run by someone else (a test harness, another service).
    pub serve_store: bool,
    /// The job token (`FERROCCL_TOKEN`; `ferroccl launch` makes one): when set, every
    /// connection — to the rendezvous store and between ranks — proves it by HMAC
    /// challenge-response, and anything that cannot is refused. Never sent in clear.
    /// Must be the same on every rank. Default: none.
    pub token: Option<Vec<u8>>,
    /// The launcher's name for this job (`ferroccl launch`'s id, torchrun's run id, the
    /// Slurm job and step, Open MPI's job; see [`crate::rendezvous::LaunchEnv::job_id`]).
    /// Rank 0's store refuses a rank that names another job, and both jobs' ranks say
    /// "another job (…) is using the store at host:port" instead of failing on each
    /// other's ranks. Default: none (no check).
    pub job_id: Option<String>,
    /// `master_addr` is a PyTorch `TCPStore` that torchrun's agent serves
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0 serves ferroccl's store on a free
    /// port instead and publishes its address there, and the others read it there (see
    /// [`crate::rendezvous::TorchStore`]). Default: false.
    pub agent_store: bool,
}

/// How collectives run. Values that shape the traffic (`segment_bytes`,
/// `small_message_bytes`) must be equal on every rank; a disagreement is reported as
/// [`Error::Mismatch`], never silently wrong data.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Tuning {
    /// The longest any collective waits without progress before it fails with
    /// [`Error::Timeout`] and poisons the communicator. Default 60 s.
    pub timeout: Duration,
    /// The longest start-up may take: reaching the store while rank 0 comes up, and
    /// connecting to peers. Default 60 s.
    pub connect_timeout: Duration,
    /// Pipelining granularity: ring chunks are cut into segments of at most this many
    /// bytes, and segment `j+1` is received while segment `j` is reduced and forwarded.
    /// Broadcast and reduce chains over 3 ranks or more cut finer, down to 64 KiB, where
    /// that shortens the pipeline's fill (see `comm::collectives::chain_segment`).
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// How long a collective keeps polling its links (yielding the CPU between polls)
    /// before it sleeps until the kernel wakes it. Waking a sleeping thread costs tens
    /// of microseconds, which dominates small messages; polling a little first avoids
    /// it. `Duration::ZERO` always sleeps. Default 1 ms (on loopback, 1 MiB all-reduce
    /// medians: 243 µs vs 314 µs with 300 µs at 2 ranks, 1349 vs 1598 µs at 4). Each
    /// wait first spins a few microseconds without yielding, unless the transport
    /// knows this host runs more ranks than the CPUs they may use (then the peer a
    /// rank waits for often needs its CPU).
    pub busy_poll: Duration,
    /// Bind each rank (the thread that makes the communicator, and every thread it
    /// starts afterwards: the communicator's own, a compute pool made later) to its own
    /// even share of this host's CPUs, when the ranks of this host do not outnumber
    /// them and nothing placed the process already (its affinity mask is the whole
    /// host). Without it the scheduler sometimes keeps two ranks that wake each other on
    /// one CPU for a whole run, while the other idles: on the 2-core development
    /// machine a 1 KiB all-reduce at 2 ranks then took 20–30 µs instead of 2–3 µs, in
    /// some runs and not others. Default on; `FERROCCL_BIND=off` leaves placement to
    /// the scheduler (or to `taskset`, `numactl`, Slurm).
    pub bind_cpus: bool,
    /// All-reduces of at most this many bytes use recursive doubling (`log2 n` steps,
    /// each moving the whole buffer) instead of the ring (`2(n-1)` steps, each moving
    /// `1/n` of it): for small messages latency, not bandwidth, is the cost. 0 always
    /// uses the ring. Default 64 KiB, where the two cross over on loopback TCP at 2 and
    /// 4 ranks.
    pub small_message_bytes: usize,
    /// Which all-reduce algorithm runs: chosen by size ([`AllReduceAlgo::Auto`], the
    /// default) or forced (`FERROCCL_ALGO=ring|rd|rabenseifner|tree|hier` in
    /// [`Config::from_env`], `ferroccl bench --algo`). Must be the same on every rank
    /// (a disagreement is a [`Error::Mismatch`]).
    pub all_reduce_algo: AllReduceAlgo,
    /// A model of the network, for [`AllReduceAlgo::Auto`] to choose per call the
    /// algorithm with the least predicted time (ring, recursive doubling,
    /// Rabenseifner, tree) instead of the size rule. `FERROCCL_COST_MODEL` in
    /// [`Config::from_env`], `ferroccl bench --cost-model`. Must be the same on every
    /// rank. Default: none.
    pub cost_model: Option<CostModel>,
    /// Measure [`Tuning::cost_model`] on the communicator's links when it is made
    /// ([`crate::Communicator::measure_cost_model`]: a few ring all-reduces, about
    /// 0.1–1 s); `FERROCCL_COST_MODEL=measure`. Must be the same on every rank.
    /// Default: false.
    pub measure_cost_model: bool,
    /// The clock [`Tuning::timeout`] is measured on: the system's, or a [`Clock::manual`]
    /// one that tests advance by hand so that a timeout fires exactly when they say.
    pub clock: Clock,
    /// Operations the flight recorder keeps ([`crate::trace`]): the last this many, for
    /// dumps on failure, on `SIGUSR1` and at exit. 0 records nothing. Default 2048
    /// (`FERROCCL_TRACE_CAPACITY` in [`Config::from_env`]).
    pub trace_capacity: usize,
}

/// The clock collective timeouts are measured on.
///
/// [`Clock::system`] (the default) is the monotonic system clock. [`Clock::manual`]
/// stands still until [`Clock::advance`] moves it, so a test can make a collective time
/// out at an exact moment instead of racing a wall-clock sleep. Only deadlines read it:
/// how long a rank polls before it sleeps ([`Tuning::busy_poll`]) is always real time.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<Arc<Manual>>);

#[derive(Debug)]
struct Manual {
    start: Instant,
    /// Nanoseconds advanced so far.
    offset: AtomicU64,
}

impl Clock {
    /// The system's monotonic clock.
    pub fn system() -> Self {
        Clock(None)
    }

    /// A clock that moves only when [`Clock::advance`] is called. Clones share it.
    pub fn manual() -> Self {
        Clock(Some(Arc::new(Manual {
            start: Instant::now(),
            offset: AtomicU64::new(0),
        })))
    }

    /// The current time.
    pub fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.start + Duration::from_nanos(m.offset.load(Ordering::Acquire)),
        }
    }

    /// Moves a manual clock forward by `by` (every clone sees it); a no-op on the
    /// system clock.
    pub fn advance(&self, by: Duration) {
        if let Some(m) = &self.0 {
            let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
            m.offset.fetch_add(ns, Ordering::AcqRel);
        }
    }

    /// Whether this is a manual clock.
    pub fn is_manual(&self) -> bool {
        self.0.is_some()
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            busy_poll: DEFAULT_BUSY_POLL,
            bind_cpus: true,
            small_message_bytes: DEFAULT_SMALL_MESSAGE_BYTES,
            all_reduce_algo: AllReduceAlgo::Auto,
            cost_model: None,
            measure_cost_model: false,
            clock: Clock::system(),
            trace_capacity: DEFAULT_TRACE_CAPACITY,
        }
    }
}

impl Default for Config {
    /// Rank 0 of a job of one, meeting at `127.0.0.1:29500`, with every default: the
    /// base [`crate::Communicator::local_group`] takes.
    fn default() -> Self {
        Config::new(0, 1, format!("127.0.0.1:{DEFAULT_MASTER_PORT}"))
    }
}

impl Config {
    /// A config for `rank` of `world_size` meeting at `master_addr`, with defaults
    /// (checked when the communicator is made; [`Config::builder`] checks at `build`).
    pub fn new(rank: usize, world_size: usize, master_addr: impl Into<String>) -> Self {
        Config {
            job: Job {
                rank,
                world_size,
                local_rank: rank,
                local_world_size: None,
                master_addr: master_addr.into(),
                serve_store: true,
                token: None,
                job_id: None,
                agent_store: false,
            },
            tuning: Tuning::default(),
            transport: TransportOptions::default(),
        }
    }

    /// A builder for `rank` of `world_size` meeting at `master_addr`.
    pub fn builder(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
    ) -> ConfigBuilder {
        ConfigBuilder(Config::new(rank, world_size, master_addr))
    }

    /// Reads the launcher environment (torchrun, Slurm, Open MPI, PMI; see
    /// [`crate::rendezvous::detect_env`]). `MASTER_ADDR` defaults to `127.0.0.1` and
    /// `MASTER_PORT` to 29500; the launcher's job identity becomes [`Job::job_id`],
    /// `TORCHELASTIC_USE_AGENT_STORE` [`Job::agent_store`]; `FERROCCL_TOKEN`, when set,
    /// becomes [`Job::token`], and
    /// `FERROCCL_RDMA_GID_INDEX` [`RdmaOptions::gid_index`], `FERROCCL_TRACE_CAPACITY`
    /// [`Tuning::trace_capacity`], `FERROCCL_BUSY_POLL_US` [`Tuning::busy_poll`] (in
    /// microseconds), `FERROCCL_TRANSPORT` [`TransportOptions::kind`],
    /// `FERROCCL_TCP_CONGESTION` [`TcpOptions::congestion`], `FERROCCL_CUDA_ORDER`
    /// (`host` or `device`) [`CudaIpcOptions::device_order`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Config::from_env`] over any variable lookup: for a caller that knows some of
    /// the values itself (a framework's backend is told its rank and world size, and
    /// reads the `FERROCCL_*` settings from the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let env = crate::rendezvous::detect_from(get)?.ok_or_else(|| {
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
        c.job.local_rank = env.local_rank.unwrap_or(0);
        c.job.local_world_size = env.local_world_size;
        c.job.token = env.token.map(String::into_bytes);
        c.job.job_id = env.job_id;
        c.job.agent_store = env.agent_store;
        c.transport.rdma.gid_index = env.rdma_gid_index.unwrap_or(0);
        if let Some(n) = env.trace_capacity {
            c.tuning.trace_capacity = n;
        }
        if let Some(us) = env.busy_poll_us {
            c.tuning.busy_poll = Duration::from_micros(us);
        }
        if let Some(a) = &env.algo {
            c.tuning.all_reduce_algo = a
                .parse()
                .map_err(|e: Error| Error::Env(format!("FERROCCL_ALGO: {e}")))?;
        }
        if let Some(m) = &env.cost_model {
            CostModelSpec::parse(m)
                .map_err(|e| Error::Env(format!("FERROCCL_COST_MODEL: {e}")))?
                .apply(&mut c.tuning);
        }
        if let Some(t) = &env.transport {
            c.transport.kind = TransportKind::parse(t)
                .map_err(|e| Error::Env(format!("FERROCCL_TRANSPORT: {e}")))?;
        }
        if let Some(v) = &env.shm_single_copy {
            c.transport.shm.single_copy_min = ShmOptions::parse_single_copy(v)
                .map_err(|e| Error::Env(format!("FERROCCL_SHM_SINGLE_COPY: {e}")))?;
        }
        if let Some(v) = &env.bind {
            c.tuning.bind_cpus =
                on_off(v).map_err(|e| Error::Env(format!("FERROCCL_BIND: {e}")))?;
        }
        if let Some(v) = &env.shm_symmetric {
            c.transport.shm.symmetric =
                on_off(v).map_err(|e| Error::Env(format!("FERROCCL_SHM_SYMMETRIC: {e}")))?;
        }
        if let Some(v) = &env.cuda_order {
            c.transport.cuda_ipc.device_order = match v.as_str() {
                "device" => true,
                "host" => false,
                _ => {
                    return Err(Error::Env(format!(
                        "FERROCCL_CUDA_ORDER: {v:?}: expected host or device"
                    )))
                }
            };
        }
        if let Some(t) = &env.tcp_congestion {
            c.transport.tcp.congestion = TcpCongestion::parse(t)
                .map_err(|e| Error::Env(format!("FERROCCL_TCP_CONGESTION: {e}")))?;
        }
        Ok(c)
    }

    /// This config with rank `rank` of `world_size` (local rank `rank` too): for making
    /// one rank's config out of a job-wide base.
    pub fn for_rank(&self, rank: usize, world_size: usize) -> Config {
        let mut c = self.clone();
        c.job.rank = rank;
        c.job.local_rank = rank;
        c.job.world_size = world_size;
        c
    }

    /// Checks every value; what [`crate::Communicator::init`] and
    /// [`ConfigBuilder::build`] call.
    pub fn validate(&self) -> Result<()> {
        let (j, t) = (&self.job, &self.tuning);
        if j.world_size == 0 {
            return Err(Error::Config("world_size must be at least 1".into()));
        }
        if j.rank >= j.world_size {
            return Err(Error::Config(format!(
                "rank {} is out of range for world_size {}",
                j.rank, j.world_size
            )));
        }
        if t.segment_bytes == 0 || t.segment_bytes > (1 << 30) {
            return Err(Error::Config(format!(
                "segment_bytes {} must be in 1..=1 GiB",
                t.segment_bytes
            )));
        }
        if t.small_message_bytes > u32::MAX as usize {
            return Err(Error::Config(format!(
                "small_message_bytes {} must fit a frame (< 4 GiB)",
                t.small_message_bytes
            )));
        }
        let ring = self.transport.shm.ring_bytes;
        if !(4096..=1 << 30).contains(&ring) {
            return Err(Error::Config(format!(
                "shm ring_bytes {ring} must be in 4 KiB..=1 GiB"
            )));
        }
        if t.timeout.is_zero() || t.connect_timeout.is_zero() {
            return Err(Error::Config("timeouts must be positive".into()));
        }
        if t.timeout > MAX_TIMEOUT || t.connect_timeout > MAX_TIMEOUT {
            return Err(Error::Config(format!(
                "timeouts must be at most {} s (7 days); got {:?} and a connect timeout of {:?}",
                MAX_TIMEOUT.as_secs(),
                t.timeout,
                t.connect_timeout
            )));
        }
        Ok(())
    }
}

/// Builds a [`Config`]; [`ConfigBuilder::build`] checks it.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until build() is called"]
pub struct ConfigBuilder(Config);

impl ConfigBuilder {
    /// [`Job::local_rank`].
    pub fn local_rank(mut self, r: usize) -> Self {
        self.0.job.local_rank = r;
        self
    }
    /// [`Job::serve_store`].
    pub fn serve_store(mut self, yes: bool) -> Self {
        self.0.job.serve_store = yes;
        self
    }
    /// [`Job::token`].
    pub fn token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.0.job.token = Some(token.into());
        self
    }
    /// [`Job::job_id`].
    pub fn job_id(mut self, id: impl Into<String>) -> Self {
        self.0.job.job_id = Some(id.into());
        self
    }
    /// [`Job::agent_store`].
    pub fn agent_store(mut self, yes: bool) -> Self {
        self.0.job.agent_store = yes;
        self
    }
    /// [`Tuning::timeout`].
    pub fn timeout(mut self, d: Duration) -> Self {
        self.0.tuning.timeout = d;
        self
    }
    /// [`Tuning::connect_timeout`].
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.0.tuning.connect_timeout = d;
        self
    }
    /// [`Tuning::segment_bytes`].
    pub fn segment_bytes(mut self, n: usize) -> Self {
        self.0.tuning.segment_bytes = n;
        self
    }
    /// [`Tuning::busy_poll`].
    pub fn busy_poll(mut self, d: Duration) -> Self {
        self.0.tuning.busy_poll = d;
        self
    }
    /// [`Tuning::all_reduce_algo`].
    pub fn all_reduce_algo(mut self, a: AllReduceAlgo) -> Self {
        self.0.tuning.all_reduce_algo = a;
        self
    }
    /// [`Tuning::small_message_bytes`].
    pub fn small_message_bytes(mut self, n: usize) -> Self {
        self.0.tuning.small_message_bytes = n;
        self
    }
    /// [`Tuning::trace_capacity`].
    pub fn trace_capacity(mut self, n: usize) -> Self {
        self.0.tuning.trace_capacity = n;
        self
    }
    /// [`Tuning::clock`].
    pub fn clock(mut self, c: Clock) -> Self {
        self.0.tuning.clock = c;
        self
    }
    /// [`TransportOptions::kind`].
    pub fn transport(mut self, kind: TransportKind) -> Self {
        self.0.transport.kind = kind;
        self
    }
    /// [`TcpOptions::socket_buffer`].
    pub fn socket_buffer(mut self, bytes: usize) -> Self {
        self.0.transport.tcp.socket_buffer = bytes;
        self
    }

    /// [`TcpOptions::congestion`].
    pub fn tcp_congestion(mut self, c: TcpCongestion) -> Self {
        self.0.transport.tcp.congestion = c;
        self
    }

    /// [`ShmOptions::ring_bytes`].
    pub fn shm_ring_bytes(mut self, bytes: usize) -> Self {
        self.0.transport.shm.ring_bytes = bytes;
        self
    }

    /// [`ShmOptions::single_copy_min`] (0: off).
    pub fn shm_single_copy_min(mut self, bytes: usize) -> Self {
        self.0.transport.shm.single_copy_min = bytes;
        self
    }
    /// [`RdmaOptions::gid_index`].
    pub fn rdma_gid_index(mut self, i: u8) -> Self {
        self.0.transport.rdma.gid_index = i;
        self
    }
    /// The config, if every value is valid.
    pub fn build(self) -> Result<Config> {
        self.0.validate()?;
        Ok(self.0)
    }
}

#[cfg(test)]
mod tests;
