//! The communicator: a rank's view of the job, and the collectives on it.
//!
//! - `mod.rs`: [`Communicator`] itself — joining a job, the operation sequence and
//!   fingerprints, refusing bad calls, and the queue through which every operation
//!   reaches the engine (on the caller's thread, or on the background worker).
//! - `collectives.rs`: the host-memory collectives.
//! - `scope.rs`: non-blocking forms ([`Scope`], [`Handle`], [`Pending`]) and
//!   [`AbortHandle`].
//! - `direct.rs`: all-to-all(v), gather(v), scatter(v).
//! - `group.rs`: sub-communicators (`split`, `group`, `split_by_host`).
//! - `p2p.rs`: tagged send/recv, blocking, in a scope, and in batches, on an engine
//!   of their own.
//! - `device.rs` (feature `cuda`): the same collectives on device memory.
//!
//! The communicator chooses the algorithm and builds the plan ([`crate::algo`]), and
//! hands it to the engine ([`crate::engine`]) inside [`Engine::run`]; it never sees a
//! link.

mod collectives;
#[cfg(feature = "cuda")]
mod device;
mod direct;
mod group;
mod meet;
mod model;
mod p2p;
mod scope;

pub use p2p::Batch;
pub use scope::{AbortHandle, Handle, Pending, Scope};

use crate::algo::select::{link_peers, Model, Policy};
use crate::algo::{Algorithm, HostLayout};
use crate::config::Config;
use crate::engine::{recorder, Engine, Health};
use crate::error::{Error, Result};
use crate::reduce::{check_op, DataType, Element, ReduceOp};
use crate::rendezvous::{hosts, Board, StoreClient, StoreServer};
use crate::sync::{lock, wait};
use crate::trace::now_ns;
use crate::transport::{self, Channel, Joined, Links, Transport, TransportKind};
use crate::wire::{Fingerprint, OpKind, WireStats};
use scope::{Completion, JobFn};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Round trips to the store at start-up for the flight recorder's clock offset.
const CLOCK_ROUNDS: usize = 5;

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
    cfg: Config,
    /// Where this communicator sits in the job (its id, its ranks' job ranks and
    /// hosts).
    family: Family,
    /// What carries its links (`tcp`, `auto`, `local`, ...), for its children.
    transport: String,
    seq: Cell<u64>,
    /// Point-to-point: sequence numbers per peer, and the engine the operations run on.
    p2p: p2p::P2p,
    shared: Arc<Shared>,
    worker: RefCell<Option<std::thread::JoinHandle<()>>>,
    /// The abort flag and the poison, shared by this communicator's engines.
    health: Arc<Health>,
    /// Working copy for out-of-place forms that reduce in place (8-byte aligned).
    work: RefCell<Vec<u64>>,
    /// Whether host-memory collectives run on the transport's memory peers (a
    /// transport whose peers read each other's host memory) instead of its links.
    host_pull: bool,
    /// Whether those memory peers are symmetric shared memory (rings beside them):
    /// each collective then reads them only where that was measured to win.
    host_sym: bool,
    /// The largest call the memory peers take ([`crate::transport::MemPeers::max_bytes`]).
    pull_max: usize,
    /// Data bytes of the memory peers' small-message slots (0: none;
    /// [`crate::transport::Slots`]).
    slot_bytes: usize,
    /// Which ranks share a host, when the transport says (`auto`, `shm`); the same on
    /// every rank.
    layout: Option<HostLayout>,
    /// Whether device-memory collectives run on the transport's memory peers (CUDA IPC).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device_pull: bool,
    // Kept alive for the communicator's lifetime (and its children's): ranks may
    // still be reading it.
    _store_server: Option<Arc<StoreServer>>,
}

/// A communicator's place in its job: the job's own (id 0), or a child of one.
#[derive(Clone, Debug)]
struct Family {
    /// On every frame: 0 for the job's communicator, a child's id otherwise.
    id: u64,
    /// What the ids of this communicator's children are derived from (the job's
    /// communicator id for the job's own; a child's id for a child), so that every
    /// member derives the same one and no two communicators of a job share one.
    base: u64,
    /// The job rank of each of this communicator's ranks.
    global: Arc<[usize]>,
    /// Each rank's host identity, if known.
    hosts: Option<Arc<[String]>>,
}

impl Family {
    /// The job's own communicator of `n` ranks, its children's ids derived from `base`.
    fn root(n: usize, base: u64, hosts: Option<Vec<String>>) -> Self {
        Family {
            id: 0,
            base,
            global: (0..n).collect(),
            hosts: hosts.filter(|h| h.len() == n).map(Arc::from),
        }
    }
}

/// The id of the group that carries point-to-point for a communicator whose children's
/// ids derive from `base` (the job's: its communicator id).
pub(crate) fn p2p_group_id(base: u64) -> u64 {
    group::derive(base, b"p2p", &[])
}

/// `dst.copy_from_slice(src)` for elements, dodging the C library's slow case
/// (`sys::mem`): the local copies of the out-of-place collectives.
pub(crate) fn copy_elems<T: Element>(dst: &mut [T], src: &[T]) {
    crate::sys::mem::copy(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
}

/// The base of the ids of threads' and custom links' communicators (which have no
/// store-given id): any constant will do, since their links are theirs alone.
const LOCAL_BASE: u64 = u64::from_le_bytes(*b"ferroccl");

/// What the issuing thread and the background worker share.
struct Shared {
    engine: Mutex<Engine>,
    queue: Mutex<Queue>,
    /// Signals new jobs (to the worker) and finished jobs (to waiters).
    cv: Condvar,
    /// [`Queue::pending`], also outside the lock: a blocking call sees there is no
    /// background job to wait for without taking the queue's mutex. Raised under the
    /// lock before a job is queued, lowered under it (`Release`) once the job is
    /// done; only the communicator's one caller thread queues jobs.
    pending: AtomicUsize,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs submitted and not yet finished.
    pending: usize,
    shutdown: bool,
}

struct Job {
    run: JobFn,
    done: Arc<Completion>,
    /// When it was issued, for the flight recorder.
    issued: u64,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("seq", &self.seq.get())
            .finish()
    }
}

/// Whether `local_ranks` ranks on this host share fewer CPUs than that: the CPUs this
/// process may use (affinity and cgroup quota), unless its affinity is narrower than
/// the host (a launcher that pins each rank gave the others CPUs of their own; then the
/// host's CPUs count).
fn oversubscribed(local_ranks: usize) -> bool {
    use crate::sys::cpu;
    let online = cpu::online_cpus();
    let pinned = matches!((cpu::affinity_cpus(), online), (Some(m), Some(o)) if m < o);
    let cpus = if pinned {
        online
    } else {
        std::thread::available_parallelism().ok().map(|c| c.get())
    };
    cpus.is_some_and(|c| local_ranks > c)
}

/// Binds this thread to rank `rank`'s share of its host's CPUs ([`Tuning::bind_cpus`],
/// `sys::cpu::bind_share`): its index among the ranks of its host in `hosts` (the
/// job's host list). Best effort: a mask that cannot be read or set leaves placement
/// to the scheduler, with a log line.
///
/// [`Tuning::bind_cpus`]: crate::config::Tuning::bind_cpus
fn bind_to_share(rank: usize, hosts: &[String]) {
    use crate::sys::cpu;
    let Some(me) = hosts.get(rank) else { return };
    let local = hosts.iter().filter(|h| *h == me).count();
    let index = hosts[..rank].iter().filter(|h| *h == me).count();
    let (Some(allowed), Some(online)) = (cpu::allowed_cpus(), cpu::online_cpus()) else {
        return;
    };
    if let Some(cpus) = cpu::bind_share(index, local, &allowed, online) {
        match cpu::bind_this_thread(&cpus) {
            Ok(()) => tracing::debug!("rank {rank}: bound to CPUs {cpus:?}"),
            Err(e) => tracing::warn!("rank {rank}: could not bind to CPUs {cpus:?}: {e}"),
        }
    }
}

impl Communicator {
    /// Joins the job described by the launcher environment ([`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::init(Config::from_env()?)
    }

    /// Joins the job described by `cfg` over the transport it names
    /// ([`crate::config::TransportOptions::kind`]): rank 0 serves the rendezvous store
    /// (unless `serve_store` is false), every rank joins it, and the transport links
    /// this rank to its ring neighbours and recursive-doubling partners.
    pub fn init(cfg: Config) -> Result<Self> {
        let t = transport::builtin(cfg.transport.kind)?;
        Self::init_with(cfg, &*t)
    }

    /// [`Communicator::init`] over a transport of your own (see the `custom_transport`
    /// example and [`Transport`]): the rendezvous is the same, and `transport` makes the
    /// links.
    pub fn init_with(cfg: Config, transport: &dyn Transport) -> Result<Self> {
        Self::init_meeting(cfg, transport, None)
    }

    /// [`Communicator::init`] for a job whose ranks meet on a key-value store of
    /// someone else's (a [`Board`]: the store `torch.distributed` hands a backend, a
    /// cluster service): rank 0 serves ferroccl's store on a free port of every
    /// interface and publishes `advertise:port` on the board, and the other ranks
    /// read it there. `cfg.job.master_addr` and `agent_store` are not used; the rest
    /// of `cfg` (the token and job identity included) is as for `init`.
    pub fn init_on_board(cfg: Config, board: &mut dyn Board, advertise: &str) -> Result<Self> {
        let t = transport::builtin(cfg.transport.kind)?;
        Self::init_meeting(cfg, &*t, Some((board, advertise)))
    }

    fn init_meeting(
        cfg: Config,
        transport: &dyn Transport,
        board: Option<(&mut dyn Board, &str)>,
    ) -> Result<Self> {
        cfg.validate()?;
        // Before touching the store: a machine without the transport's device fails
        // at once.
        transport.probe(&cfg)?;
        let (server, store_addr) = match board {
            Some((board, advertise)) => meet::on_board(&cfg, board, advertise)?,
            None => meet::meet(&cfg)?,
        };
        let mut cfg = cfg;
        // From here on the job's store is ferroccl's own, wherever it was found.
        cfg.job.master_addr = store_addr;
        cfg.job.agent_store = false;
        let j = &cfg.job;
        // The join, answers included, within the connect timeout.
        let join_end = Instant::now() + cfg.tuning.connect_timeout;
        let mut store = StoreClient::connect_with_token(
            &j.master_addr,
            cfg.tuning.connect_timeout,
            j.token.as_deref(),
        )?;
        let comm_id = store.join_job_within(
            j.rank,
            j.world_size,
            j.job_id.as_deref(),
            join_end
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(50)),
        )?;
        // The flight recorder's clock offset to the store's host (rank 0's); a store
        // that cannot say leaves it unknown.
        let clock = if server.is_some() {
            Some((0, 0)) // the store runs in this process: one clock
        } else {
            // An offset within its own error bound (ranks on the store's host) is
            // indistinguishable from none.
            store.clock_offset(CLOCK_ROUNDS).ok().map(|(o, e)| {
                if o.unsigned_abs() <= e {
                    (0, e)
                } else {
                    (o, e)
                }
            })
        };
        // Which host every rank is on, the same list on every rank, whatever the
        // transport: the hierarchical algorithms, `split_by_host` and the waits'
        // spinning rule go by it, and the transport may link by it (`auto`, `shm`
        // read their peers' as they link). Said before the transport links, and
        // gathered after (its address is out by then, so no peer waits on it).
        let me = hosts::identity(&cfg.transport.shm.host_tag);
        hosts::publish(&mut store, j.rank, &me)?;
        let (rank, n) = (j.rank, j.world_size);
        let mut hosts_store = StoreClient::connect_with_token(
            &j.master_addr,
            cfg.tuning.connect_timeout,
            j.token.as_deref(),
        )?;
        let links = transport.connect(Joined {
            config: cfg.clone(),
            comm_id,
            store,
        })?;
        let host_list = hosts::collect(&mut hosts_store, rank, n, cfg.tuning.connect_timeout)?;
        drop(hosts_store);
        if cfg.tuning.bind_cpus {
            // Before the communicator starts its threads, so they inherit it.
            bind_to_share(rank, &host_list);
        }
        let family = Family::root(cfg.job.world_size, comm_id, Some(host_list));
        let server = server.map(Arc::new);
        let mut c = Self::assemble(cfg, links, server, transport.name(), family)?;
        if let Some((offset, err)) = clock {
            lock(&c.shared.engine).rec.set_clock(offset, Some(err));
        }
        if c.cfg.tuning.measure_cost_model {
            c.measure_cost_model()?;
        }
        tracing::debug!(
            rank = c.rank,
            world = c.world_size,
            transport = transport.name(),
            "communicator ready"
        );
        Ok(c)
    }

    /// `world_size` communicators linked by in-process pipes, one per thread-rank
    /// (element `r` is rank `r`). `base` supplies the tuning (timeouts, segment size);
    /// its rank, world size and address are ignored, so `&Config::default()` will do.
    /// The threads are one host ([`Communicator::host_layout`]).
    pub fn local_group(world_size: usize, base: &Config) -> Result<Vec<Self>> {
        base.for_rank(0, world_size).validate()?;
        let host = hosts::identity(&base.transport.shm.host_tag);
        transport::local::group(world_size, transport::local::PIPE_CAPACITY)
            .into_iter()
            .enumerate()
            .map(|(r, links)| {
                let mut cfg = base.for_rank(r, world_size);
                cfg.transport.kind = TransportKind::Local;
                let family =
                    Family::root(world_size, LOCAL_BASE, Some(vec![host.clone(); world_size]));
                Self::assemble(cfg, links, None, "local", family)
            })
            .collect()
    }

    /// A communicator for rank `cfg.job.rank` over links made elsewhere (a transport of
    /// your own, or a test fabric); it connects its neighbours now, as
    /// [`Communicator::init`] does. The store address and transport kind of `cfg` are
    /// not used; which ranks share a host is what the links say
    /// ([`Links::hosts`](crate::transport::Links)), if they do.
    pub fn with_links(cfg: Config, links: Links) -> Result<Self> {
        cfg.validate()?;
        let family = Family::root(cfg.job.world_size, LOCAL_BASE, links.hosts.clone());
        Self::assemble(cfg, links, None, "custom", family)
    }

    /// A communicator of rank `cfg.job.rank` of `cfg.job.world_size` over `links`, in
    /// `family`: its engines (collectives', and point-to-point's on links of their own
    /// where the transport makes groups), its recorder, and its first links.
    fn assemble(
        cfg: Config,
        mut links: Links,
        server: Option<Arc<StoreServer>>,
        transport: &str,
        family: Family,
    ) -> Result<Self> {
        let (rank, n) = (cfg.job.rank, cfg.job.world_size);
        let host_pull = links.mem.as_ref().is_some_and(|m| m.host_memory());
        let host_sym = host_pull && links.mem.as_ref().is_some_and(|m| m.symmetric());
        let pull_max = links.mem.as_ref().map_or(usize::MAX, |m| m.max_bytes());
        let slot_bytes = match links.mem.as_mut().and_then(|m| m.slots()) {
            Some(s) if host_sym => s.slot_bytes(),
            _ => 0,
        };
        let device_pull = links.mem.as_ref().is_some_and(|m| !m.host_memory());
        let layout = family.hosts.as_ref().map(|h| HostLayout::from_hosts(h));
        // Ranks of this host: from the host list, else as the launcher says.
        let local_ranks = match &family.hosts {
            Some(h) => Some(h.iter().filter(|x| **x == h[rank]).count()),
            None => cfg.job.local_world_size,
        };
        let health = Arc::new(Health::default());
        let rec = recorder(rank, n, transport, cfg.tuning.trace_capacity);
        rec.set_group(family.id, family.global[rank]);
        // Point-to-point runs on links of its own (a group of the same ranks), so that
        // it progresses whatever the collectives do; a transport that cannot make
        // groups runs it on the collectives' engine, in turn with them.
        let spec = transport::GroupSpec {
            id: p2p_group_id(family.base),
            members: (0..n).collect(),
        };
        let p2p_links = match links.connector.group(&spec) {
            Ok(l) => Some(l),
            Err(Error::Unavailable { .. }) => None,
            Err(e) => return Err(e),
        };
        let spin = !local_ranks.is_some_and(oversubscribed);
        let mut engine = Engine::new(
            rank,
            n,
            cfg.tuning.clone(),
            links,
            rec.clone(),
            health.clone(),
        );
        engine.spin = spin;
        engine.set_group(family.id, family.global.clone());
        let p2p = p2p::P2p::new(
            n,
            p2p_links.map(|l| {
                let mut e = Engine::new(rank, n, cfg.tuning.clone(), l, rec, health.clone());
                e.spin = spin;
                e.set_group(family.id, family.global.clone());
                e
            }),
            &health,
        );
        // Connect higher ranks first: they are the ones accepting (see transport::tcp).
        let deadline = Instant::now() + cfg.tuning.connect_timeout;
        let mut peers = link_peers(rank, n, layout.as_ref());
        peers.sort_by_key(|&p| (family.global[p] < family.global[rank], p));
        for p in peers {
            engine.connect(Channel::Collective, p, deadline)?;
        }
        Ok(Communicator {
            work: RefCell::new(Vec::new()),
            rank,
            world_size: n,
            family,
            transport: transport.to_string(),
            seq: Cell::new(0),
            p2p,
            shared: Arc::new(Shared {
                engine: Mutex::new(engine),
                queue: Mutex::new(Queue::default()),
                cv: Condvar::new(),
                pending: AtomicUsize::new(0),
            }),
            worker: RefCell::new(None),
            health,
            host_pull,
            host_sym,
            pull_max,
            slot_bytes,
            layout,
            device_pull,
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
        self.cfg.job.local_rank
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
        let mut s = lock(&self.shared.engine).wire_stats();
        s.add(&self.p2p.wire_stats_to(|_| true));
        s
    }

    /// [`Self::wire_stats`] split by where the peer is: `(within this host, between
    /// hosts)`, by [`Self::host_layout`]; `None` when the transport does not say which
    /// ranks share a host.
    pub fn wire_stats_by_host(&self) -> Option<(WireStats, WireStats)> {
        let l = self.layout.as_ref()?;
        self.wait_idle();
        let me = self.rank;
        let (mut within, mut between) = {
            let e = lock(&self.shared.engine);
            (
                e.wire_stats_to(|p| l.same_host(me, p)),
                e.wire_stats_to(|p| !l.same_host(me, p)),
            )
        };
        within.add(&self.p2p.wire_stats_to(|p| l.same_host(me, p)));
        between.add(&self.p2p.wire_stats_to(|p| !l.same_host(me, p)));
        Some((within, between))
    }

    /// Bytes the links themselves report writing and reading (for cross-checking
    /// [`Self::wire_stats`]: the two must agree).
    pub fn raw_byte_counts(&self) -> (u64, u64) {
        self.wait_idle();
        let (a, b) = lock(&self.shared.engine).raw_byte_counts();
        let (c, d) = self.p2p.raw_byte_counts();
        (a + c, b + d)
    }

    /// This rank's collective links made so far, `(peer, class)` by peer: what carries
    /// them (`shm`, `tcp`, ...; with `auto`, shared memory within a host and TCP
    /// between hosts).
    pub fn link_classes(&self) -> Vec<(usize, &'static str)> {
        self.wait_idle();
        lock(&self.shared.engine).link_classes()
    }

    /// A handle that can abort this communicator from any thread (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle::new(self.health.abort.clone())
    }

    /// Writes this rank's flight recorder ([`crate::trace`]) to `dir/rank-<rank>.jsonl`
    /// and returns the path: the last [`Tuning::trace_capacity`](crate::config::Tuning)
    /// operations, as `ferroccl trace DIR` reads them. Waits for background
    /// operations first.
    pub fn dump_trace(&self, dir: impl AsRef<std::path::Path>) -> Result<std::path::PathBuf> {
        self.wait_idle();
        let rec = lock(&self.shared.engine).rec.clone();
        rec.dump(dir.as_ref(), "request")
    }

    /// Why this communicator is unusable, if it is.
    pub fn poisoned(&self) -> Option<String> {
        self.health.poisoned().map(|p| p.why)
    }

    /// Which ranks share a host, as every rank of this communicator sees it (every
    /// communicator made by [`Communicator::init`] or [`Communicator::local_group`],
    /// and their children, knows); `None` for links made elsewhere that do not say.
    pub fn host_layout(&self) -> Option<&HostLayout> {
        self.layout.as_ref()
    }

    /// The decisions of this communicator's calls ([`crate::algo`]'s `select.rs`):
    /// its shape, links and tuning, as every rank has them alike.
    pub(super) fn policy(&self) -> Policy<'_> {
        let t = &self.cfg.tuning;
        Policy {
            world_size: self.world_size,
            host_pull: self.host_pull,
            pull_max: self.pull_max,
            sym: self.host_sym,
            slot_bytes: self.slot_bytes,
            layout: self.layout.as_ref(),
            forced: t.all_reduce_algo,
            small_message_bytes: t.small_message_bytes,
            segment_bytes: t.segment_bytes,
            model: t.cost_model.map(|m| Model {
                alpha: m.alpha,
                bandwidth: m.bandwidth,
                reduce: m.reduce,
                within_host: m.within_host,
            }),
        }
    }

    /// The algorithm an all-reduce of `bytes` bytes of host memory uses on this
    /// communicator. Forced [`AllReduceAlgo::Hierarchical`](crate::config::AllReduceAlgo)
    /// is reported as such even where it cannot run (the call then fails).
    pub fn all_reduce_algorithm(&self, bytes: usize) -> Algorithm {
        self.policy().all_reduce(bytes)
    }

    /// The algorithm a broadcast or reduce uses on this communicator: a pipelined
    /// binary tree from the root when [`Tuning::all_reduce_algo`](crate::config::Tuning)
    /// is [`AllReduceAlgo::Tree`](crate::config::AllReduceAlgo::Tree)
    /// (`FERROCCL_ALGO=tree`) and the buffers are streamed over links, the chain
    /// otherwise. Both keep the root agreement (`algo/chain.rs`).
    pub fn rooted_algorithm(&self) -> Algorithm {
        self.policy().rooted()
    }

    /// The algorithm a reduce-scatter or all-gather of host memory uses on this
    /// communicator: the hierarchical one (a local ring per host block, then rings
    /// between hosts; see the `algo` module) where `auto` finds hosts of k ≥ 2 ranks,
    /// at least two of them, all alike, and wherever
    /// [`AllReduceAlgo::Hierarchical`](crate::config::AllReduceAlgo) is forced (the call
    /// then fails where it cannot run); the ring otherwise. It moves `(H-1)/H·S` over
    /// each host's link instead of the flat ring's `(N-1)/N·S`, so it is taken at every
    /// size.
    pub fn reduce_scatter_algorithm(&self) -> Algorithm {
        self.policy().reduce_scatter()
    }

    /// The algorithm an all-gather uses: as [`Self::reduce_scatter_algorithm`].
    pub fn all_gather_algorithm(&self) -> Algorithm {
        self.reduce_scatter_algorithm()
    }

    /// [`Self::all_reduce_algorithm`], refusing the call (and poisoning, as every rank
    /// does alike: the layout is the same everywhere) when it is the hierarchical one
    /// and the hosts cannot run it.
    fn all_reduce_choice(&self, bytes: usize) -> Result<(Algorithm, Option<HostLayout>)> {
        self.hierarchical_choice(self.all_reduce_algorithm(bytes), "hierarchical all-reduce")
    }

    /// `(algo, the layout it runs on)`, refusing the hierarchical algorithm (for `what`)
    /// where the hosts cannot run it.
    pub(super) fn hierarchical_choice(
        &self,
        algo: Algorithm,
        what: &str,
    ) -> Result<(Algorithm, Option<HostLayout>)> {
        self.policy().runnable(algo).map_err(|why| {
            self.refuse(Error::Unavailable {
                what: what.into(),
                why,
            })
        })
    }

    // ---- execution ----

    /// Blocks until every background operation has finished.
    fn wait_idle(&self) {
        {
            let mut q = lock(&self.shared.queue);
            while q.pending > 0 {
                q = wait(&self.shared.cv, q);
            }
        }
        self.p2p.wait_idle();
    }

    /// Blocks until every background collective has finished (not point-to-point
    /// operations, which run apart); whether there were any.
    fn wait_collectives(&self) -> bool {
        // None queued (this thread queues them all), none running: nothing to wait
        // for, and what the last one did is visible (`Acquire`).
        if self.shared.pending.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut q = lock(&self.shared.queue);
        let waited = q.pending > 0;
        while q.pending > 0 {
            q = wait(&self.shared.cv, q);
        }
        waited
    }

    /// Runs a job on this thread, after any background ones, inside the engine's run
    /// wrapper (poison check before, poisoning on failure).
    fn run_now(&self, job: impl FnOnce(&mut Engine) -> Result<()>) -> Result<()> {
        let issued = now_ns();
        if self.wait_collectives() {
            lock(&self.shared.engine).run(issued, job)
        } else {
            lock(&self.shared.engine).run_started(issued, job)
        }
    }

    /// Fails the call and poisons the communicator: this rank will not take part, so
    /// its peers must not wait for it.
    fn refuse(&self, e: Error) -> Error {
        self.wait_idle();
        let rank = self.rank;
        lock(&self.shared.engine).poison_with(
            rank,
            &e.to_wire(),
            format!("rank {rank} refused a call: {e}"),
        );
        e
    }

    fn check(&self, ok: bool, what: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.refuse(Error::InvalidArgument(what())))
        }
    }

    fn check_root(&self, what: &str, root: usize) -> Result<()> {
        let n = self.world_size;
        self.check(root < n, || {
            format!("{what}: root {root} is not a rank of this group of {n}")
        })
    }

    fn check_op<T: Element>(&self, op: ReduceOp) -> Result<()> {
        check_op(T::DTYPE, op).map_err(|e| self.refuse(e))
    }

    /// Hands a job to the background worker (started on first use).
    fn submit(&self, run: JobFn) -> Arc<Completion> {
        let done = Arc::new(Completion::default());
        {
            let mut q = lock(&self.shared.queue);
            q.pending += 1;
            self.shared.pending.fetch_add(1, Ordering::Relaxed);
            q.jobs.push_back(Job {
                run,
                done: done.clone(),
                issued: now_ns(),
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

    /// The fingerprint of the next collective (taking its sequence number).
    fn fingerprint(
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
            comm: self.family.id,
        }
    }
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
    let Job { run, done, issued } = job;
    let r = {
        let mut e = lock(&shared.engine);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.run(issued, run)));
        r.unwrap_or_else(|_| {
            e.poison("a background operation panicked".into());
            Err(Error::Poisoned("a background operation panicked".into()))
        })
    };
    done.set(r);
    {
        let mut q = lock(&shared.queue);
        q.pending -= 1;
        shared.pending.fetch_sub(1, Ordering::Release);
    }
    shared.cv.notify_all();
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.wait_idle();
        self.p2p.shutdown();
        lock(&self.shared.queue).shutdown = true;
        self.shared.cv.notify_all();
        if let Some(h) = self.worker.get_mut().take() {
            let _ = h.join();
        }
        let mut e = lock(&self.shared.engine);
        e.shutdown();
        e.rec.dump_to_env_dir("drop");
    }
}

#[cfg(test)]
mod tests {
    use super::oversubscribed;

    #[test]
    fn one_rank_never_oversubscribes_a_host_and_more_ranks_than_cpus_always_do() {
        assert!(!oversubscribed(1));
        let host = crate::sys::cpu::online_cpus().expect("online CPUs");
        assert!(
            oversubscribed(host + 1),
            "{} ranks on {host} CPUs",
            host + 1
        );
    }
}
