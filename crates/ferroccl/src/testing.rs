//! Test support: the one rank-spawning harness (N ranks as threads over the in-process
//! transport, simulated RDMA queue pairs, or loopback TCP or shared memory with a real
//! store), with a
//! deadline on everything so that a hang fails in seconds, and small helpers for tests
//! that play a peer by hand.
//!
//! Not part of the API (hidden from the docs, no stability promise): it exists for this
//! workspace's test suites and examples.
#![allow(missing_docs, clippy::missing_panics_doc)]

use crate::rendezvous::StoreServer;
use crate::transport::memsim;
pub use crate::transport::memsim::SimMemParams;
use crate::transport::rdma::sim;
pub use crate::transport::rdma::sim::SimParams;
use crate::{Communicator, Config};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the ranks are linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// In-process pipes.
    Local,
    /// Loopback TCP with a real rendezvous store (the transport forced to `tcp`).
    Tcp,
    /// Shared memory (`shm`) with a real rendezvous store, every rank on this host:
    /// symmetric memory (the collectives read their peers' workspaces).
    Shm,
    /// [`Net::Shm`] without symmetric memory: every collective through the rings.
    ShmRings,
    /// [`Net::ShmRings`] with single copy from the smallest size it takes (a page):
    /// each reader pulls every collective payload of a page or more from its writer's
    /// memory.
    ShmPull,
    /// A real rendezvous store, the ranks split into emulated hosts of this many
    /// consecutive ranks each, with `auto` (shared memory within a host, TCP between
    /// them) unless the config asks for `shm` (which must then refuse) or `tcp`.
    Hosts(usize),
    /// Simulated RDMA queue pairs (the RDMA protocol without hardware).
    RdmaSim(SimParams),
    /// Memory peers over host memory with a GPU stream's timing (the pull executor
    /// CUDA IPC uses, without a GPU).
    MemSim(SimMemParams),
}

/// `n` communicators over simulated memory peers paced by `p`.
pub fn memsim_group(n: usize, base: &Config, p: SimMemParams) -> crate::Result<Vec<Communicator>> {
    memsim::group(n, p)?
        .into_iter()
        .enumerate()
        .map(|(r, links)| Communicator::with_links(base.for_rank(r, n), links))
        .collect()
}

/// `n` communicators over simulated RDMA queue pairs shaped by `p`.
pub fn rdma_sim_group(n: usize, base: &Config, p: SimParams) -> crate::Result<Vec<Communicator>> {
    sim::group(n, p)?
        .into_iter()
        .enumerate()
        .map(|(r, links)| Communicator::with_links(base.for_rank(r, n), links))
        .collect()
}

/// Advances `clock` (a [`crate::Clock::manual`]) by a second every 10 ms of real time
/// from when `go()` first holds until `stop()` does (or a minute has passed): collective
/// timeouts on that clock fire only then, whatever the machine's load, and a test that
/// needs a timeout gets one as soon as the ranks are where it wants them.
pub fn ticker(
    clock: crate::Clock,
    go: impl Fn() -> bool + Send + 'static,
    stop: impl Fn() -> bool + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(60);
        while !go() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        while !stop() && Instant::now() < end {
            clock.advance(Duration::from_secs(1));
            std::thread::sleep(Duration::from_millis(10));
        }
    })
}

/// A test's timeout on a manual clock: [`ManualTimeout::cfg`] carries the clock and
/// the timeout; the test raises `started` once its ranks are where it wants a timeout,
/// and `done` once it has what it waited for; a [`ticker`] advances the clock between.
pub struct ManualTimeout {
    /// `base` with the timeout, on the manual clock.
    pub cfg: Config,
    /// Raised by the test when the clock may start moving.
    pub started: Arc<AtomicBool>,
    /// Raised by the test when it is done.
    pub done: Arc<AtomicBool>,
    tick: Option<std::thread::JoinHandle<()>>,
}

impl ManualTimeout {
    /// `base` with a `timeout` measured on a fresh manual clock, and its ticker.
    pub fn new(mut base: Config, timeout: Duration) -> Self {
        let clock = crate::Clock::manual();
        base.tuning.timeout = timeout;
        base.tuning.clock = clock.clone();
        let (started, done) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (s, d) = (started.clone(), done.clone());
        let tick = ticker(
            clock,
            move || s.load(Ordering::SeqCst),
            move || d.load(Ordering::SeqCst),
        );
        ManualTimeout {
            cfg: base,
            started,
            done,
            tick: Some(tick),
        }
    }

    /// Sleeps until `done` is raised (or a minute passes): for a rank that must stay
    /// silent, and alive, while the others time out.
    pub fn wait_done(done: &AtomicBool) {
        let end = Instant::now() + Duration::from_secs(60);
        while !done.load(Ordering::SeqCst) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Raises `done` and waits for the ticker.
    pub fn finish(mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.tick.take() {
            let _ = t.join();
        }
    }
}

/// A config suited to tests: short timeouts so a hang fails in seconds.
pub fn test_config() -> Config {
    let mut c = Config::new(0, 1, "127.0.0.1:0");
    c.tuning.timeout = Duration::from_secs(10);
    c.tuning.connect_timeout = Duration::from_secs(10);
    c
}

/// What went wrong in a run: the first rank to fail and its error, or a hang.
#[derive(Debug)]
pub struct RunError {
    pub rank: Option<usize>,
    pub message: String,
    pub error: Option<Box<crate::Error>>,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(r) => write!(f, "rank {r}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

type Outcomes<R> = mpsc::Receiver<(usize, crate::Result<R>)>;

/// Starts `n` rank threads linked by `net`, each running `body`; every rank reports
/// `(rank, outcome)` on the returned channel. The store (TCP) must live as long as the
/// ranks: the caller keeps the returned handle.
fn spawn_ranks<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    body: F,
) -> crate::Result<(Outcomes<R>, Option<StoreServer>)>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> crate::Result<R> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    let mut store = None;
    match net {
        Net::Local | Net::RdmaSim(_) | Net::MemSim(_) => {
            let comms = match net {
                Net::RdmaSim(p) => rdma_sim_group(n, base, p),
                Net::MemSim(p) => memsim_group(n, base, p),
                _ => Communicator::local_group(n, base),
            }?;
            for mut c in comms {
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let r = body(&mut c);
                    let _ = tx.send((c.rank(), r));
                });
            }
        }
        Net::Tcp | Net::Shm | Net::ShmRings | Net::ShmPull | Net::Hosts(_) => {
            let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), n)?;
            let addr = server.local_addr().to_string();
            store = Some(server);
            for r in 0..n {
                let mut cfg = base.for_rank(r, n);
                cfg.job.master_addr = addr.clone();
                cfg.job.serve_store = false;
                match net {
                    Net::Tcp => cfg.transport.kind = crate::TransportKind::Tcp,
                    Net::Shm => cfg.transport.kind = crate::TransportKind::Shm,
                    Net::ShmRings => {
                        cfg.transport.kind = crate::TransportKind::Shm;
                        cfg.transport.shm.symmetric = false;
                    }
                    Net::ShmPull => {
                        cfg.transport.kind = crate::TransportKind::Shm;
                        cfg.transport.shm.symmetric = false;
                        cfg.transport.shm.single_copy_min = 1;
                    }
                    Net::Hosts(k) => {
                        if !matches!(
                            cfg.transport.kind,
                            crate::TransportKind::Shm | crate::TransportKind::Tcp
                        ) {
                            cfg.transport.kind = crate::TransportKind::Auto;
                        }
                        cfg.transport.shm.host_tag = format!("emulated-host-{}", r / k.max(1));
                    }
                    _ => {}
                }
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let out = Communicator::init(cfg).and_then(|mut c| body(&mut c));
                    let _ = tx.send((r, out));
                });
            }
        }
    }
    Ok((rx, store))
}

/// Runs `body` on `n` ranks linked by `net`, each rank in its own thread, and returns
/// every rank's result in rank order. Fails with the first error (by time; but see
/// `root_cause`) or when the deadline passes.
pub fn run<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> Result<Vec<R>, RunError>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> crate::Result<R> + Send + Sync + 'static,
{
    let (rx, _store) = spawn_ranks(n, net, base, body).map_err(|e| RunError {
        rank: None,
        message: e.to_string(),
        error: Some(Box::new(e)),
    })?;
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let mut done = 0;
    while done < n {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((r, Ok(v))) => {
                out[r] = Some(v);
                done += 1;
            }
            Ok((r, Err(e))) => return Err(root_cause(&rx, r, e)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let pending: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                return Err(RunError {
                    rank: None,
                    message: format!(
                        "deadline of {deadline:?} passed; ranks {pending:?} still running"
                    ),
                    error: None,
                });
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let pending: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                return Err(RunError {
                    rank: None,
                    message: format!("ranks {pending:?} panicked"),
                    error: None,
                });
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect())
}

/// How long [`run`] waits, after the first error, for the other ranks' outcomes.
const ROOT_CAUSE_WAIT: Duration = Duration::from_secs(3);

/// The error to report once rank `r` failed with `e`: a rank whose peer failed often
/// reports first (the failing rank shuts its links before it returns), so the others'
/// errors are gathered for a moment and the first that is not a consequence of
/// another rank's failure (a closed connection, a notice, a poisoned communicator) is
/// reported, with the first seen alongside.
fn root_cause<R>(
    rx: &mpsc::Receiver<(usize, crate::Result<R>)>,
    r: usize,
    e: crate::Error,
) -> RunError {
    let secondary = |e: &crate::Error| {
        matches!(
            e,
            crate::Error::PeerClosed { .. }
                | crate::Error::PeerFailed { .. }
                | crate::Error::Poisoned(_)
        )
    };
    let first = format!("rank {r}: {e}");
    let mut chosen = (r, e);
    let end = Instant::now() + ROOT_CAUSE_WAIT;
    while secondary(&chosen.1) {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((q, Err(e))) if !secondary(&e) => chosen = (q, e),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let (rank, e) = chosen;
    let mut message = e.to_string();
    if rank != r {
        message = format!("{message} (first reported: {first})");
    }
    RunError {
        rank: Some(rank),
        message,
        error: Some(Box::new(e)),
    }
}

/// Like [`run`] but collects every rank's outcome, errors included, waiting until
/// all have reported or the deadline passes (for tests where all ranks must fail).
pub fn run_all<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> Vec<Option<crate::Result<R>>>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> crate::Result<R> + Send + Sync + 'static,
{
    let (rx, _store) = spawn_ranks(n, net, base, body).expect("ranks start");
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<crate::Result<R>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((r, v)) => out[r] = Some(v),
            Err(_) => break,
        }
    }
    out
}

/// Runs `f` on a thread and fails the test if it panics or has not finished within
/// `limit` (for single calls that could hang: a driver load, a connect).
pub fn with_deadline<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("did not finish within {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("panicked (see above)"),
    }
}

/// Every rank's error from a [`run_all`], failing the test if a rank succeeded or did
/// not finish in time (for tests where every rank must fail; whatever the error type).
pub fn all_errors<R: std::fmt::Debug, E>(out: Vec<Option<Result<R, E>>>, what: &str) -> Vec<E> {
    out.into_iter()
        .enumerate()
        .map(|(r, o)| match o {
            Some(Err(e)) => e,
            Some(Ok(v)) => panic!("{what}: rank {r} succeeded: {v:?}"),
            None => panic!("{what}: rank {r} did not finish in time"),
        })
        .collect()
}

/// Accepts one connection on `listener` within `limit`, or panics saying so (a fake
/// peer must never block a test forever when the real rank never dials).
pub fn accept_within(listener: &std::net::TcpListener, limit: Duration) -> std::net::TcpStream {
    listener
        .set_nonblocking(true)
        .expect("non-blocking listener");
    let end = Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).expect("blocking stream");
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("no connection within {limit:?}: {e}"),
        }
    }
}

/// Internals that the workspace's tests, benches and the CLI's `gpu-check` reach into:
/// wire formats (to play a peer by hand), the RDMA protocol core and its simulated
/// queue pair.
pub mod internals {
    pub use crate::algo::tree::send_bytes as tree_send_bytes;
    #[cfg(feature = "cuda")]
    pub use crate::transport::cuda_ipc::busbw_limit_fraction;
    #[cfg(feature = "rdma")]
    pub use crate::transport::rdma::verbs as rdma_verbs;
    pub use crate::transport::rdma::{probe as rdma_probe, proto as rdma_proto, sim as rdma_sim};
    pub use crate::transport::tcp::{Hello, FLAG_AUTH, PROTOCOL_VERSION};
    pub use crate::wire::{Fingerprint, FrameHeader, OpKind, HEADER_LEN};

    /// How the names of a job's shared-memory rings begin in `/dev/shm` (without the
    /// `/`), given the id its store hands out ([`crate::rendezvous::StoreServer::comm_id`]):
    /// those of the collectives' links, then those of point-to-point's.
    pub fn shm_ring_prefixes(comm_id: u64) -> [String; 2] {
        use crate::transport::shm::ring_prefix;
        [
            ring_prefix(comm_id, 0),
            ring_prefix(comm_id, crate::comm::p2p_group_id(comm_id)),
        ]
    }
}
