//! The transport contract: one [`Link`] per peer, moving bytes without blocking.
//!
//! A link is a reliable, ordered, full-duplex byte stream to one peer, driven by
//! non-blocking `try_write`/`try_read` calls. The engine never blocks inside a link:
//! it pushes on every link that can move, and when none can, it sleeps in
//! [`Waiter::wait`] until one might. That is what lets a ring step send to the right
//! and receive from the left at the same time, at any message size, with no deadlock
//! and no extra thread.
//!
//! Framing (headers, fingerprints, byte accounting) is common to every transport and
//! lives in the engine; a transport only moves bytes. Algorithms see neither: they are
//! plans the engine runs.
//!
//! # The contract
//!
//! - [`Link::try_write`] / [`Link::try_read`] move a prefix of the given buffers and
//!   return how many bytes moved; `Ok(0)` means "would block, try again after the
//!   waiter". They never block. Bytes arrive in order, exactly once. A read that finds
//!   the stream closed by the peer returns [`LinkError::Closed`] (so does a write, where
//!   the transport can tell); anything else is [`LinkError::Io`].
//!   A write may go on reading the slices it was given after it returns, until it has
//!   reported their bytes as written (a later call, resuming at the same place) or the
//!   link is shut down: the shared-memory transport's single copy lets the peer read
//!   a payload straight from the writer's memory. So a caller keeps a buffer it wrote
//!   from, unchanged, until then.
//! - [`Link::shutdown`] closes both directions so the peer's next read fails fast (a
//!   poisoned communicator calls it on every link); it is idempotent, and dropping a
//!   link shuts it down too.
//! - [`Link::raw_counts`] counts every byte the link wrote and read; the engine checks
//!   its own accounting against it.
//! - [`Connector::connect`] returns the link to `peer` on a [`Channel`], waiting for
//!   the peer until the deadline; the two ends of a pair each connect once per channel
//!   and get the two ends of one stream. Collective neighbours are connected when the
//!   communicator is made, other peers on first point-to-point use.
//!   [`Connector::peer_status`] asks a peer's [`Beacon`] which operation it is in, for a
//!   timeout's message; it must work while the peer's own thread is stuck in a wait.
//! - [`Waiter::wait`] sleeps until some link made by the connector may move, or the
//!   timeout passes; returning early, even spuriously, is allowed, never sleeping past
//!   a possible event is not.
//! - A [`Transport`] makes all of that for one rank once it has joined the store
//!   ([`Transport::connect`], given a [`Joined`]: the config, the job's communicator id,
//!   a store connection to trade addresses through); [`Transport::probe`] refuses,
//!   before any rendezvous, a transport that cannot run on this machine.
//!
//! [`builtin`] names the transports of this library, and a transport of your own is
//! passed to [`crate::Communicator::init_with`] (see the `custom_transport` example, a
//! complete transport over Unix-domain sockets). Adding a transport touches no
//! algorithm and not `Communicator::init`.
//!
//! A transport whose peers can read each other's memory (CUDA IPC) offers
//! [`MemPeers`] as well ([`Links::with_memory`]); the engine then runs the same plans
//! by reading the senders' memory instead of moving bytes through links.
//!
//! Implementations: `tcp` (mio + socket2), `local` (in-process pipes, for threads in
//! one process), `rdma` (verbs; its protocol core and a simulated queue pair are always
//! built), `cuda_ipc` (feature `cuda`), and `memsim` (host memory shared by threads,
//! with the timing of a GPU stream: the pull executor's test bed).

use crate::config::Config;
use crate::reduce::{DataType, ReduceOp};
use crate::rendezvous::StoreClient;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::TransportKind;

#[cfg(feature = "cuda")]
pub(crate) mod cuda_ipc;
pub(crate) mod local;
pub(crate) mod memsim;
pub(crate) mod rdma;
pub(crate) mod shm;
pub(crate) mod tcp;

/// Why a link could not move bytes.
#[derive(Debug)]
pub enum LinkError {
    /// The peer closed the stream (it exited, crashed, or shut the link down).
    Closed,
    /// Any other I/O error.
    Io(std::io::Error),
}

/// A non-blocking byte stream to one peer.
///
/// Both calls return how many bytes moved; `Ok(0)` means "would block, try after
/// [`Waiter::wait`]". A read that finds the stream closed returns [`LinkError::Closed`].
pub trait Link: Send {
    /// The peer's rank.
    fn peer(&self) -> usize;

    /// Writes a prefix of the concatenation of `bufs`; never blocks.
    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError>;

    /// Reads into a prefix of the concatenation of `bufs`; never blocks.
    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, LinkError>;

    /// Copies into `buf` what a read would now return, up to its length, without
    /// taking it: `Ok(0)` while nothing has come, `Err` where a read would fail (the
    /// link's end). Between frames, what was written before the bytes it returns is
    /// visible to this thread once it has returned them. `None` (the default): this
    /// link cannot look ahead (only shared-memory rings can: the links beside
    /// symmetric memory's slots, whose waits look, `engine/slot.rs`).
    fn peek(&mut self, _buf: &mut [u8]) -> Option<Result<usize, LinkError>> {
        None
    }

    /// Closes both directions, so the peer's next read fails fast instead of waiting
    /// for a timeout. Idempotent.
    fn shutdown(&mut self);

    /// Bytes this link has written and read since it was made, counted at the stream
    /// level (headers and payload alike).
    fn raw_counts(&self) -> (u64, u64);

    /// What carries the bytes (`tcp`, `shm`, ...), for reports such as the bench
    /// header: with `auto` one communicator has links of several classes.
    fn class(&self) -> &'static str {
        "other"
    }
}

/// Sleeps until some link of a communicator may be able to move bytes again.
pub trait Waiter: Send {
    /// Blocks for at most `timeout`. Returning early, even spuriously, is allowed:
    /// callers retry their links and call again.
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()>;

    /// A way for another thread to end a [`Waiter::wait`] in progress (or make the
    /// next one return at once): how the point-to-point engine, asleep on its links,
    /// hears of a send or receive just posted. `None` (the default): such news waits
    /// for the wait's end, at most a millisecond there.
    fn waker(&self) -> Option<Waker> {
        None
    }
}

/// Ends a [`Waiter::wait`] early, from any thread ([`Waiter::waker`]).
#[derive(Clone)]
pub struct Waker(Arc<dyn Fn() + Send + Sync>);

impl Waker {
    /// A waker that calls `wake` (which must make the waiter's current or next wait
    /// return soon, and never block).
    pub fn new(wake: impl Fn() + Send + Sync + 'static) -> Self {
        Waker(Arc::new(wake))
    }

    /// Wakes the waiter.
    pub fn wake(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waker")
    }
}

/// A group of a connector's ranks, for the links of a sub-communicator
/// ([`Connector::group`]; `Communicator::split` and friends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The group's id: the same on every member, different from every other group of
    /// the job, never 0 (the job's own links). Handshakes carry it, so a group's links
    /// are streams of their own.
    pub id: u64,
    /// The connector's ranks that belong to the group, in the group's rank order:
    /// `members[r]` is the group's rank `r`.
    pub members: Vec<usize>,
}

impl GroupSpec {
    /// This rank's place in the group, checking the spec against a connector whose
    /// rank is `rank` of `world_size`, itself of group `parent`: an id of its own,
    /// members distinct, in range, and this rank among them.
    pub fn check(
        &self,
        rank: usize,
        world_size: usize,
        parent: u64,
    ) -> crate::error::Result<usize> {
        let bad = |why: String| {
            Err(crate::error::Error::InvalidArgument(format!(
                "group {:#x} of ranks {:?}: {why}",
                self.id, self.members
            )))
        };
        if self.id == 0 || self.id == parent {
            return bad(format!("id {:#x} is its parent's or the job's", self.id));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(&m) = self
            .members
            .iter()
            .find(|&&m| m >= world_size || !seen.insert(m))
        {
            return bad(format!(
                "rank {m} is out of range or listed twice (world size {world_size})"
            ));
        }
        match self.members.iter().position(|&m| m == rank) {
            Some(r) => Ok(r),
            None => bad(format!("rank {rank} is not a member")),
        }
    }
}

/// Which stream between two ranks. Collectives and point-to-point messages never share
/// one, so a tagged message waiting to be received can never be read by a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Collective traffic.
    Collective,
    /// Tagged send/recv.
    P2p,
    /// A one-shot question from a peer: "which operation are you in?" (answered by the
    /// transport itself, so it works while the rank's own thread is stuck).
    Status,
}

impl Channel {
    /// Wire code in the handshake.
    pub fn code(self) -> u32 {
        match self {
            Channel::Collective => 0,
            Channel::P2p => 1,
            Channel::Status => 2,
        }
    }
    /// Inverse of [`Channel::code`].
    pub fn from_code(c: u32) -> Option<Self> {
        match c {
            0 => Some(Channel::Collective),
            1 => Some(Channel::P2p),
            2 => Some(Channel::Status),
            _ => None,
        }
    }
}

/// The operation a rank is in, published for peers that ask ([`Channel::Status`]):
/// its sequence number and kind code, or nothing before the first operation. One
/// relaxed atomic store per operation.
#[derive(Debug, Default)]
pub struct Beacon(AtomicU64);

impl Beacon {
    /// Records that this rank entered operation `seq` of kind `kind` (a wire code).
    pub fn set(&self, seq: u64, kind: u8) {
        self.0
            .store(((seq + 1) << 8) | kind as u64, Ordering::Relaxed);
    }

    /// The operation last entered: `(seq, kind code)`, or `None` before the first.
    pub fn get(&self) -> Option<(u64, u8)> {
        Self::decode(self.0.load(Ordering::Relaxed))
    }

    /// The packed form sent on the wire.
    pub fn raw(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Unpacks [`Beacon::raw`].
    pub fn decode(v: u64) -> Option<(u64, u8)> {
        (v >> 8).checked_sub(1).map(|seq| (seq, (v & 0xff) as u8))
    }
}

/// Makes links to peers, on demand. Collectives' neighbours are connected when the
/// communicator is built; point-to-point peers when first used. Every link it makes is
/// covered by the [`Waiter`] it was created with.
pub trait Connector: Send {
    /// The link to `peer` on `channel`, waiting for the peer until `deadline`.
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> crate::error::Result<Box<dyn Link>>;

    /// Asks `peer` which operation it is in (its [`Beacon`]), giving up at `deadline`.
    /// `Ok(None)`: the peer has not started any operation.
    fn peer_status(
        &mut self,
        peer: usize,
        deadline: Instant,
    ) -> crate::error::Result<Option<(u64, u8)>>;

    /// [`Connector::peer_status`] of each of `peers`, all by the same `deadline`. A
    /// connector whose queries wait on the peer (a stopped peer answers nothing) asks
    /// them all at once, so that one silent peer does not use up the others' time.
    /// The default asks one after the other.
    fn peers_status(
        &mut self,
        peers: &[usize],
        deadline: Instant,
    ) -> Vec<crate::error::Result<Option<(u64, u8)>>> {
        peers
            .iter()
            .map(|&p| self.peer_status(p, deadline))
            .collect()
    }

    /// Whether [`Connector::connect`] to `peer` on `channel` would return without
    /// waiting for the peer (it has dialled in already, or this rank dials): the
    /// point-to-point engine links a peer only then, so a peer that has posted
    /// nothing yet holds up no other. The default says yes.
    fn ready(&mut self, peer: usize, channel: Channel) -> bool {
        let _ = (peer, channel);
        true
    }

    /// This rank is done with these links (its communicator failed, or is going):
    /// a peer that links to it from now on, or that linked through an acceptor and
    /// was not taken up yet, must see the link closed, not wait for it. The default
    /// does nothing (such peers then wait for their timeout).
    fn close(&mut self) {}

    /// The links of a group of this connector's ranks (a sub-communicator): a
    /// connector numbering the group's ranks `0..members.len()`, whose links are
    /// streams of their own beside this connector's (the same two ranks may be linked
    /// in both, and in any number of groups), a waiter over them, and the group's
    /// beacon (what peers asking about the group are told). Every member calls it with
    /// the same spec; the group's connector can make groups of its own. Made through
    /// what this connector already has (addresses, store, listener): no new
    /// rendezvous. The default refuses, and a communicator over such a transport
    /// cannot be split.
    fn group(&mut self, spec: &GroupSpec) -> crate::error::Result<Links> {
        Err(crate::error::Error::Unavailable {
            what: format!("group {:#x} (a sub-communicator)", spec.id),
            why: "this transport's connector does not make groups (Connector::group)".into(),
        })
    }
}

/// Refuses a `peer` that is not another rank of a job of `world_size`, for
/// [`Connector`]s to check what they are asked to link to or ask.
/// The TCP congestion control that links made with `want` run here, and the system's
/// default (e.g. `("cubic", "bbr")` for [`crate::config::TcpCongestion::Auto`] on a host whose
/// default is BBR): what a tool prints next to its TCP links.
pub fn tcp_congestion_in_effect(
    want: &crate::config::TcpCongestion,
) -> crate::error::Result<(String, String)> {
    tcp::congestion_in_effect(want)
}

pub(crate) fn check_peer(rank: usize, peer: usize, world_size: usize) -> crate::error::Result<()> {
    if peer >= world_size || peer == rank {
        return Err(crate::error::Error::InvalidArgument(format!(
            "rank {rank} has no peer rank {peer} in a job of {world_size}"
        )));
    }
    Ok(())
}

/// A rank's way to make links, the waiter that wakes when any of them may move, the
/// beacon through which peers can ask what it is doing, and — for a transport whose
/// peers read each other's memory — its [`MemPeers`].
#[non_exhaustive]
pub struct Links {
    /// Makes links.
    pub connector: Box<dyn Connector>,
    /// Wakes when any link made by `connector` may progress.
    pub waiter: Box<dyn Waiter>,
    /// This rank's current operation, as peers see it.
    pub beacon: Arc<Beacon>,
    /// Peers whose memory this rank reads, if the transport has them.
    pub mem: Option<Box<dyn MemPeers>>,
    /// Which host each rank is on (one label per rank, equal labels: one host), the
    /// same list on every rank, if the transport knows (`shm`, `auto`): what the
    /// hierarchical all-reduce is laid out by.
    pub hosts: Option<Vec<String>>,
}

impl Links {
    /// Links made by `connector`, woken by `waiter`, answering status queries from
    /// `beacon`.
    pub fn new(
        connector: Box<dyn Connector>,
        waiter: Box<dyn Waiter>,
        beacon: Arc<Beacon>,
    ) -> Self {
        Links {
            connector,
            waiter,
            beacon,
            mem: None,
            hosts: None,
        }
    }

    /// These links with the job's host of each rank (see [`Links::hosts`]).
    pub fn with_hosts(mut self, hosts: Vec<String>) -> Self {
        self.hosts = Some(hosts);
        self
    }

    /// These links with memory peers too.
    pub fn with_memory(mut self, mem: Box<dyn MemPeers>) -> Self {
        self.mem = Some(mem);
        self
    }
}

/// A way to link the ranks of a job: what [`crate::Communicator::init_with`] asks to
/// make a rank's links once the rank has joined the job's rendezvous store.
///
/// The contract: [`Transport::connect`] returns [`Links`] whose [`Connector`] makes
/// a [`Link`] to any other rank on demand (within the deadline it is given), whose
/// [`Waiter`] wakes when any of those links may move bytes, and whose [`Beacon`] is
/// answered to peers asking this rank's current operation. Addresses are exchanged
/// through the store ([`Joined::store`]); every rank calls `connect` once.
pub trait Transport: Send + Sync {
    /// The name in messages (`tcp`, `rdma`, ...).
    fn name(&self) -> &str;

    /// Checks, before any rendezvous, that this transport can run here: a missing
    /// device or feature fails at once, without touching the store. The default
    /// accepts.
    fn probe(&self, cfg: &Config) -> crate::error::Result<()> {
        let _ = cfg;
        Ok(())
    }

    /// Makes this rank's links.
    fn connect(&self, job: Joined) -> crate::error::Result<Links>;
}

/// What a [`Transport`] gets to link a rank: the rank's config, the job's communicator
/// id (the same on every rank, fresh per job) and a connection to the store.
#[non_exhaustive]
pub struct Joined {
    /// The rank's configuration (`config.job.rank`, `config.job.world_size`, options).
    pub config: Config,
    /// The job's communicator id, for handshakes that must refuse other jobs.
    pub comm_id: u64,
    /// A connection to the job's store, for exchanging addresses. Every rank has said
    /// which host it is on there before `connect` (`host/<rank>`: see
    /// [`crate::rendezvous`]).
    pub store: StoreClient,
}

impl Joined {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.config.job.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.config.job.world_size
    }

    /// Another connection to the job's store, for a transport that exchanges more
    /// later (CUDA IPC trades memory handles at its first device call).
    pub fn store_connection(&self) -> crate::error::Result<StoreClient> {
        StoreClient::connect_with_token(
            &self.config.job.master_addr,
            self.config.tuning.connect_timeout,
            self.config.job.token.as_deref(),
        )
    }
}

/// The transport of this library named `kind`, or [`crate::error::Error::Unavailable`] when
/// this build lacks it (`rdma`, `cuda-ipc` are cargo features) and a configuration
/// error for `local`, which links threads ([`crate::Communicator::local_group`]).
pub fn builtin(kind: TransportKind) -> crate::error::Result<Box<dyn Transport>> {
    match kind {
        TransportKind::Auto => Ok(Box::new(shm::Shm { strict: false })),
        TransportKind::Tcp => Ok(Box::new(tcp::Tcp)),
        TransportKind::Shm => Ok(Box::new(shm::Shm { strict: true })),
        TransportKind::Local => Err(crate::error::Error::Config(
            "the local transport links threads of one process: use Communicator::local_group"
                .into(),
        )),
        TransportKind::Rdma => rdma::transport(),
        #[cfg(feature = "cuda")]
        TransportKind::CudaIpc => Ok(Box::new(cuda_ipc::CudaIpc)),
        #[cfg(not(feature = "cuda"))]
        TransportKind::CudaIpc => Err(crate::error::Error::Unavailable {
            what: "transport cuda-ipc".into(),
            why: "this build has no CUDA IPC transport (it arrives with the \"cuda\" feature)"
                .into(),
        }),
    }
}

/// A region of memory a [`MemPeers`] operation names, by byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// The call's input buffer.
    Input(usize),
    /// The call's output buffer.
    Output(usize),
    /// This rank's workspace.
    Mine(usize),
    /// Rank `.0`'s workspace, as mapped here.
    Peer(usize, usize),
}

/// The user buffers of one call on memory peers, as addresses in the memory space the
/// transport works in (device pointers for CUDA IPC, host addresses for a host-memory
/// transport). The caller keeps them valid, and untouched by anything else, until the
/// call returns.
#[derive(Clone, Debug)]
pub struct CallMem {
    /// Which memory the addresses are in (the CUDA device ordinal; 0 for host memory).
    pub space: usize,
    /// The input buffer.
    pub input: u64,
    /// Its length in bytes.
    pub input_len: usize,
    /// The output buffer (may equal `input`).
    pub output: u64,
    /// Its length in bytes.
    pub output_len: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction, for calls that combine.
    pub op: Option<ReduceOp>,
    /// Ranks in the job (Avg divides by it).
    pub world_size: usize,
}

/// Peers whose memory this rank reads directly: the contract of the pull executor.
///
/// Operations are *enqueued* (a GPU runs them later, in order, on one stream); only
/// [`MemPeers::end`] waits for them. Ordering across ranks is explicit: a rank
/// [`publish`](MemPeers::publish)es a counter value after enqueueing work, its peers
/// read it with [`progress`](MemPeers::progress) and, once it is high enough, call
/// [`order_after`](MemPeers::order_after) so that their later work runs after the
/// published work has completed. An implementation must never let a peer observe a
/// counter value before the work enqueued ahead of it can be ordered after.
pub trait MemPeers: Send {
    /// Whether the call buffers are host memory (host collectives then run here too).
    fn host_memory(&self) -> bool;

    /// Starts a call on `mem`: this rank's workspace holds at least `bytes`, and the
    /// workspaces of `peers` are mapped. Every rank calls it at the same call with the
    /// same `bytes` (growing may trade handles through the store).
    fn begin(&mut self, mem: &CallMem, bytes: usize, peers: &[usize]) -> crate::error::Result<()>;

    /// Enqueues `dst = src` for `len` bytes.
    fn copy(&mut self, dst: Region, src: Region, len: usize) -> crate::error::Result<()>;

    /// Enqueues `dst = a op b` for `len` bytes (the call's dtype and op; `Avg` combines
    /// as `Sum`), then, when `finish`, `Avg`'s division of `dst`, then `also = dst`.
    fn combine(
        &mut self,
        dst: Region,
        also: Option<Region>,
        a: Region,
        b: Region,
        len: usize,
        finish: bool,
    ) -> crate::error::Result<()>;

    /// Publishes `value` as this rank's progress, ordered after everything enqueued.
    fn publish(&mut self, value: u64) -> crate::error::Result<()>;

    /// `peer`'s published progress (0 before its first call).
    fn progress(&self, peer: usize) -> u64;

    /// Orders this rank's later work after the work `peer` had enqueued when it
    /// published the value last seen.
    fn order_after(&mut self, peer: usize) -> crate::error::Result<()>;

    /// Waits until everything enqueued has completed.
    fn end(&mut self) -> crate::error::Result<()>;

    /// The largest call (workspace bytes) these peers take, the same on every rank;
    /// larger calls stream over the links.
    fn max_bytes(&self) -> usize {
        usize::MAX
    }

    /// Whether these are symmetric shared memory with shared-memory rings beside them
    /// (`shm/sym.rs`): the selection (`algo::select`) then reads them only for the
    /// collectives and sizes measured to win there. `false`: peers that take every
    /// call of data they can (CUDA IPC's, and their simulation).
    fn symmetric(&self) -> bool {
        false
    }

    /// Whether `peer` is known to be gone (its process has exited): a wait on its
    /// progress then fails at once instead of at the timeout. `false` where the
    /// transport cannot tell.
    fn gone(&self, _peer: usize) -> bool {
        false
    }

    /// The small-message slots beside the workspaces, where these peers have them
    /// (symmetric shared memory's); `None` (the default) where they do not.
    fn slots(&mut self) -> Option<&mut dyn Slots> {
        None
    }

    /// Whether ordering across ranks runs on the device (*device order*, stream memory
    /// operations): [`MemPeers::publish`] then enqueues, after the work before it, a
    /// write of the value into the memory of each peer of the call ([`MemPeers::begin`]'s
    /// `peers`), which [`MemPeers::progress`] reads there; and the executor, instead of
    /// waiting on the host and ordering by events, enqueues [`MemPeers::wait_for`], so a
    /// call is enqueued whole with no host round trip per step, then polls
    /// [`MemPeers::done`] under its deadline. `false` (the default): host waits.
    fn device_order(&self) -> bool {
        false
    }

    /// Device order: enqueues a wait until `peer`'s published progress reaches
    /// `at_least`; this rank's later work runs after the work `peer` had enqueued
    /// before publishing it.
    fn wait_for(&mut self, peer: usize, at_least: u64) -> crate::error::Result<()> {
        Err(crate::error::Error::InvalidArgument(format!(
            "internal: memory peers without device order asked to wait for rank {peer} \
             ({at_least}) on the device"
        )))
    }

    /// Device order: whether everything enqueued so far has completed (never blocks).
    fn done(&mut self) -> crate::error::Result<bool> {
        Ok(true)
    }

    /// Device order, after a call failed with waits enqueued that may never be met
    /// (a peer gone, a timeout, an abort): lets every one of them pass, so that the
    /// stream drains instead of hanging whatever later synchronises with it. What the
    /// rest of the call computes is garbage (the call fails), the counters no longer
    /// mean anything, and these peers refuse every later call. It marks this rank
    /// [`failed`](MemPeers::failed) first: the values its stream still publishes cover
    /// unordered work, and a peer whose device they let through must fail too.
    fn release(&mut self) {}

    /// Device order: whether `peer` has released its waits ([`MemPeers::release`]).
    fn failed(&self, _peer: usize) -> bool {
        false
    }
}

/// Where a peer's published progress is, from the low 32 bits of it (what a device
/// writes and waits on: 32-bit stream memory operations, compared cyclically as the
/// device does) and `anchor`, a full value within 2^31 of it: this rank's own last
/// published value. A peer is never more than a call ahead of it, and what the peer
/// last published to this rank is at most a call behind, unless the two ranks met in
/// no call for 2^31 counter units (some hundred million calls).
pub fn widen_progress(anchor: u64, low: u32) -> u64 {
    let delta = low.wrapping_sub(anchor as u32) as i32;
    anchor.wrapping_add_signed(i64::from(delta))
}

/// Whether progress `low` (32 bits, as [`widen_progress`]) has reached `at_least`, as a
/// device's `GEQ` wait compares: `(int32_t)(low - at_least) >= 0`.
pub fn reached(low: u32, at_least: u64) -> bool {
    low.wrapping_sub(at_least as u32) as i32 >= 0
}

/// Small-message slots beside memory peers' workspaces (symmetric shared memory's,
/// `shm/sym.rs`): each rank owns two, used by turns, each holding a head (the call's
/// frame header), a stamp, and up to [`Slots::slot_bytes`] of data that every peer
/// reduces from in place. The one-shot all-reduce of a buffer that fits one
/// (`engine/slot.rs`) needs no fingerprint round trip and no wait for readers: a
/// rank's head says which call its data belongs to, and a rank reuses a turn only two
/// slot calls later, after every peer has published the call between them — which a
/// peer does only once it has finished reading the call before.
///
/// Host memory only: what is posted is visible to every peer once its stamp is.
pub trait Slots {
    /// Data bytes one slot holds, the same on every rank.
    fn slot_bytes(&self) -> usize;

    /// [`MemPeers::gone`].
    fn gone(&self, peer: usize) -> bool;

    /// Writes `head` and `data` into this rank's slot `turn` (0 or 1), then publishes
    /// `stamp` there (ordered after them).
    fn post(
        &mut self,
        turn: usize,
        head: &[u8],
        data: &[u8],
        stamp: u64,
    ) -> crate::error::Result<()>;

    /// The stamp `peer` published last in its slot `turn` (0 before its first), with
    /// everything it posted before it visible to this rank.
    fn stamp(&self, peer: usize, turn: usize) -> u64;

    /// The first `into.len()` bytes of the head in `peer`'s slot `turn`. Stable only
    /// while the peer is held off that slot (a diagnosis may read it torn: read the
    /// stamp again after).
    fn head(&self, peer: usize, turn: usize, into: &mut [u8]);

    /// `out = d(0) op d(1) op … op d(n-1)`, left to right, where `d(q)` is the first
    /// `out.len()` data bytes of rank `q`'s slot `turn` (this rank's own included),
    /// and `Avg` divides by `n` at the end: the same bytes on every rank. Every peer
    /// must have published the call's stamp there, and `out` must hold what this
    /// rank posted (the call is in place).
    fn reduce(
        &mut self,
        turn: usize,
        dtype: DataType,
        op: ReduceOp,
        out: &mut [u8],
    ) -> crate::error::Result<()>;
}

#[cfg(test)]
mod progress_tests {
    use super::{reached, widen_progress};

    /// A peer's 32-bit progress read back as the full value it stands for, ahead of
    /// the anchor or behind it, across the wrap of the low 32 bits too.
    #[test]
    fn progress_widens_across_the_32_bit_wrap() {
        let wrap = 1u64 << 32;
        for anchor in [0u64, 5, 1 << 20, wrap - 3, wrap, wrap + 7, 7 * wrap - 1] {
            for d in [-1000i64, -3, -1, 0, 1, 2, 9, 1000] {
                let Some(v) = anchor.checked_add_signed(d) else {
                    continue;
                };
                assert_eq!(widen_progress(anchor, v as u32), v, "{anchor} {d}");
            }
        }
    }

    /// The device's cyclic `GEQ`: reached at and past the value, not before it, across
    /// the wrap.
    #[test]
    fn reached_compares_as_the_device_does() {
        let wrap = 1u64 << 32;
        for at in [1u64, 100, wrap - 2, wrap, wrap + 1, 3 * wrap + 5] {
            assert!(reached(at as u32, at));
            assert!(reached((at + 1) as u32, at));
            assert!(reached((at + 1000) as u32, at));
            assert!(!reached(at.wrapping_sub(1) as u32, at));
            assert!(!reached(at.wrapping_sub(1000) as u32, at), "{at}");
        }
    }
}
