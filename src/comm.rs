//! The communicator: a rank's view of the job, its links, and the collectives on them.

use crate::error::{Error, Result};
use crate::reduce::{check_op, Element, ReduceOp};
use crate::rendezvous::{self, StoreClient, StoreServer};
use crate::transport::tcp::{self, ConnectCtx, TcpOptions};
use crate::transport::{local, Links, TransportKind, Waiter};
use crate::wire::{Algorithm, Fingerprint, FrameError, OpKind, Peer, WireStats};
use std::net::{SocketAddr, ToSocketAddrs};
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
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(300);
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
    /// it. `Duration::ZERO` always sleeps. Default 300 µs.
    pub busy_poll: Duration,
    /// All-reduces of at most this many bytes use recursive doubling (`log2 n` steps,
    /// each moving the whole buffer) instead of the ring (`2(n-1)` steps, each moving
    /// `1/n` of it): for small messages latency, not bandwidth, is the cost. 0 always
    /// uses the ring. Must be equal on every rank. Default 64 KiB, where the two cross
    /// over on loopback TCP at 2 and 4 ranks.
    pub small_message_bytes: usize,
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
        }
    }

    /// Reads the launcher environment (torchrun, Slurm, Open MPI, PMI; see
    /// [`rendezvous::detect_env`]). `MASTER_ADDR` defaults to `127.0.0.1` and
    /// `MASTER_PORT` to 29500.
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
/// them. Calls on every rank must be made in the same order with matching arguments;
/// when they are not, the call fails with [`Error::Mismatch`] on the ranks that notice.
///
/// Any failure inside a collective (a timeout, a closed connection, a mismatch)
/// poisons the communicator: its links are shut down, so peers fail fast too, and
/// every later call returns [`Error::Poisoned`].
pub struct Communicator {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    local_rank: usize,
    pub(crate) cfg: Config,
    pub(crate) peers: Vec<Option<Peer>>,
    pub(crate) waiter: Box<dyn Waiter>,
    seq: u64,
    poisoned: Option<String>,
    pub(crate) scratch: Vec<u64>,
    // Kept alive for the communicator's lifetime: ranks may still be reading it, and
    // later features exchange more through it.
    _store_server: Option<StoreServer>,
    _store: Option<StoreClient>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("seq", &self.seq)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

/// The ranks a rank links to: its ring neighbours and its recursive-doubling partners
/// (at most `2 + log2 n` links).
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

impl Communicator {
    /// Joins the job described by the launcher environment ([`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::init(Config::from_env()?)
    }

    /// Joins the job described by `cfg`: rank 0 serves the rendezvous store (unless
    /// `serve_store` is false), every rank publishes its data address there and
    /// connects to its ring neighbours.
    pub fn init(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        match cfg.transport {
            TransportKind::Tcp => {}
            TransportKind::Local => return Err(Error::Config(
                "the local transport links threads of one process: use Communicator::local_group"
                    .into(),
            )),
        }
        let server = if cfg.rank == 0 && cfg.serve_store {
            let addr = resolve(&cfg.master_addr)?;
            Some(StoreServer::bind(addr, cfg.world_size)?)
        } else {
            None
        };
        let mut store = StoreClient::connect(&cfg.master_addr, cfg.connect_timeout)?;
        let comm_id = store.join(cfg.rank, cfg.world_size)?;
        let opts = TcpOptions {
            socket_buffer: cfg.socket_buffer,
            connect_timeout: cfg.connect_timeout,
        };
        let listener = tcp::listen(store.local_addr().ip(), &opts)?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the data listener's address", e))?;
        store.set(&format!("addr/{}", cfg.rank), addr.to_string().as_bytes())?;
        let links = tcp::connect(
            ConnectCtx {
                rank: cfg.rank,
                world_size: cfg.world_size,
                comm_id,
                store: &mut store,
                opts,
            },
            listener,
            &link_peers(cfg.rank, cfg.world_size),
        )?;
        tracing::debug!(
            rank = cfg.rank,
            world = cfg.world_size,
            "communicator ready"
        );
        Ok(Self::assemble(cfg, links, server, Some(store)))
    }

    /// `world_size` communicators linked by in-process pipes, one per thread-rank
    /// (element `r` is rank `r`). `base` supplies timeouts and segment size; its rank,
    /// world size and address are ignored.
    pub fn local_group(world_size: usize, base: &Config) -> Result<Vec<Self>> {
        let mut probe = base.clone();
        probe.rank = 0;
        probe.world_size = world_size;
        probe.validate()?;
        let groups = local::group(world_size, local::PIPE_CAPACITY, |r| {
            link_peers(r, world_size)
        });
        Ok(groups
            .into_iter()
            .enumerate()
            .map(|(r, links)| {
                let mut cfg = base.clone();
                cfg.rank = r;
                cfg.local_rank = r;
                cfg.world_size = world_size;
                cfg.transport = TransportKind::Local;
                Self::assemble(cfg, links, None, None)
            })
            .collect())
    }

    fn assemble(
        cfg: Config,
        links: Links,
        server: Option<StoreServer>,
        store: Option<StoreClient>,
    ) -> Self {
        let peers = links
            .links
            .into_iter()
            .map(|l| {
                l.map(|link| Peer {
                    link,
                    stats: WireStats::default(),
                })
            })
            .collect();
        Communicator {
            rank: cfg.rank,
            world_size: cfg.world_size,
            local_rank: cfg.local_rank,
            peers,
            waiter: links.waiter,
            seq: 0,
            poisoned: None,
            scratch: Vec::new(),
            _store_server: server,
            _store: store,
            cfg,
        }
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
        self.seq
    }

    /// Bytes moved so far over all links, headers and payload counted apart.
    pub fn wire_stats(&self) -> WireStats {
        let mut s = WireStats::default();
        for p in self.peers.iter().flatten() {
            s.add(&p.stats);
        }
        s
    }

    /// Bytes the links themselves report writing and reading (for cross-checking
    /// [`Self::wire_stats`]: the two must agree).
    pub fn raw_byte_counts(&self) -> (u64, u64) {
        self.peers
            .iter()
            .flatten()
            .map(|p| p.link.raw_counts())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Why this communicator is unusable, if it is.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    /// Sums (or otherwise reduces) `buf` across all ranks, in place: afterwards every
    /// rank holds the same, bitwise identical, result.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(3, &Config::new(0, 1, "")).unwrap();
    /// let results: Vec<Vec<f32>> = std::thread::scope(|s| {
    ///     let hs: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || {
    ///         let mut v = vec![c.rank() as f32 + 1.0; 5];
    ///         c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///         v
    ///     })).collect();
    ///     hs.into_iter().map(|h| h.join().unwrap()).collect()
    /// });
    /// assert!(results.iter().all(|v| v == &vec![6.0; 5]));
    /// ```
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_usable()?;
        check_op(T::DTYPE, op)?;
        let algo = self.all_reduce_algorithm(std::mem::size_of_val(buf));
        let fp = self.begin(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None, algo)?;
        let r = match algo {
            Algorithm::RecursiveDoubling => crate::doubling::all_reduce(self, buf, op, &fp),
            _ => crate::ring::all_reduce(self, buf, op, &fp),
        };
        self.finish(r)
    }

    /// The algorithm an all-reduce of `bytes` bytes uses on this communicator.
    pub fn all_reduce_algorithm(&self, bytes: usize) -> Algorithm {
        if bytes <= self.cfg.small_message_bytes && self.world_size > 1 {
            Algorithm::RecursiveDoubling
        } else {
            Algorithm::Ring
        }
    }

    /// Out-of-place all-reduce: `recv` receives the reduction of every rank's `send`.
    /// `send` and `recv` must have the same length (on this rank and on all others).
    pub fn all_reduce_into<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            self.check_usable()?;
            return Err(Error::InvalidArgument(format!(
                "all_reduce_into: send has {} elements but recv has {}",
                send.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(send);
        self.all_reduce(recv, op)
    }

    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Checks the communicator is usable and allocates the next sequence number.
    fn begin(
        &mut self,
        kind: OpKind,
        dtype: crate::DataType,
        op: Option<ReduceOp>,
        count: usize,
        root: Option<usize>,
        algo: Algorithm,
    ) -> Result<Fingerprint> {
        self.check_usable()?;
        let fp = Fingerprint {
            kind,
            seq: self.seq,
            dtype,
            op,
            count: count as u64,
            root: root.map(|r| r as u32),
            algo,
        };
        self.seq += 1;
        Ok(fp)
    }

    /// Poisons the communicator if `r` is a failure that leaves peers out of step.
    fn finish(&mut self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            if !matches!(e, Error::InvalidArgument(_) | Error::UnsupportedOp { .. }) {
                self.poison(e.to_string());
            }
        }
        r
    }

    fn poison(&mut self, why: String) {
        if self.poisoned.is_none() {
            tracing::error!(rank = self.rank, "communicator poisoned: {why}");
            self.poisoned = Some(why);
        }
        for p in self.peers.iter_mut().flatten() {
            p.link.shutdown();
        }
    }

    /// Turns a frame-level failure into the crate error naming who and what.
    pub(crate) fn frame_error(&self, e: FrameError, peer: usize, fp: &Fingerprint) -> Error {
        use crate::transport::LinkError;
        match e {
            FrameError::Link(LinkError::Closed) => Error::PeerClosed {
                rank: self.rank,
                peer,
                op: fp.to_string(),
            },
            FrameError::Link(LinkError::Io(source)) => Error::io(
                format!("rank {}: link to rank {peer} failed during {fp}", self.rank),
                source,
            ),
            FrameError::Unexpected {
                got: Err(detail), ..
            } => Error::Protocol {
                rank: self.rank,
                peer,
                op: fp.to_string(),
                detail,
            },
            FrameError::Unexpected {
                got: Ok(h),
                expected,
            } => {
                if h.fp != expected.fp {
                    Error::Mismatch {
                        rank: self.rank,
                        peer,
                        ours: expected.fp.to_string(),
                        theirs: h.fp.to_string(),
                    }
                } else {
                    Error::Protocol {
                        rank: self.rank,
                        peer,
                        op: fp.to_string(),
                        detail: format!(
                            "expected step {} segment {} of {} bytes, got step {} segment {} of {} bytes",
                            expected.step, expected.seg, expected.len, h.step, h.seg, h.len
                        ),
                    }
                }
            }
        }
    }
}

/// What a collective's progress loop does when no link moved: poll a little longer
/// (yielding the CPU), sleep in the transport's waiter, or give up with
/// [`Error::Timeout`] once [`Config::timeout`] has passed without progress.
pub(crate) struct Pacer {
    last: Instant,
    timeout: Duration,
    busy_poll: Duration,
}

impl Pacer {
    pub fn new(cfg: &Config) -> Self {
        Pacer {
            last: Instant::now(),
            timeout: cfg.timeout,
            busy_poll: cfg.busy_poll,
        }
    }

    /// Something moved: the no-progress clock restarts.
    pub fn moved(&mut self) {
        self.last = Instant::now();
    }

    /// Nothing moved. `waiting_for` describes what is awaited, for the timeout error.
    pub fn idle(
        &mut self,
        waiter: &mut dyn Waiter,
        rank: usize,
        fp: &Fingerprint,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<()> {
        let idle = self.last.elapsed();
        if idle < self.busy_poll {
            std::thread::yield_now();
            return Ok(());
        }
        if idle >= self.timeout {
            return Err(Error::Timeout {
                rank,
                op: fp.to_string(),
                after: idle,
                waiting_for: waiting_for(),
            });
        }
        waiter
            .wait((self.timeout - idle).min(Duration::from_millis(500)))
            .map_err(|e| Error::io(format!("rank {rank}: waiting on links during {fp}"), e))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            p.link.shutdown();
        }
    }
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve master address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("master address {addr:?} resolves to nothing")))
}
