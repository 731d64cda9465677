//! The transport contract: one [`Link`] per peer, moving bytes without blocking.
//!
//! A link is a reliable, ordered, full-duplex byte stream to one peer, driven by
//! non-blocking `try_write`/`try_read` calls. The algorithms never block inside a link:
//! they push on every link that can move, and when none can, they sleep in
//! [`Waiter::wait`] until one might. That is what lets a ring step send to the right
//! and receive from the left at the same time, at any message size, with no deadlock
//! and no extra thread.
//!
//! Framing (headers, tags, fingerprints, byte accounting) is common to every transport
//! and lives in [`crate::wire`]; a transport only moves bytes. Algorithms see neither:
//! they see a [`crate::Communicator`].
//!
//! Implementations: [`tcp`] (mio + socket2) and [`local`] (in-process pipes, for tests
//! and threads in one process).

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
pub mod cuda_ipc;
pub mod local;
pub mod rdma;
pub mod tcp;

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

    /// Closes both directions, so the peer's next read fails fast instead of waiting
    /// for a timeout. Idempotent.
    fn shutdown(&mut self);

    /// Bytes this link has written and read since it was made, counted at the stream
    /// level (headers and payload alike).
    fn raw_counts(&self) -> (u64, u64);
}

/// Sleeps until some link of a communicator may be able to move bytes again.
pub trait Waiter: Send {
    /// Blocks for at most `timeout`. Returning early, even spuriously, is allowed:
    /// callers retry their links and call again.
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()>;
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
    ) -> crate::Result<Box<dyn Link>>;

    /// Asks `peer` which operation it is in (its [`Beacon`]), giving up at `deadline`.
    /// `Ok(None)`: the peer has not started any operation.
    fn peer_status(&mut self, peer: usize, deadline: Instant) -> crate::Result<Option<(u64, u8)>>;
}

/// Refuses a `peer` that is not another rank of a job of `world_size`, for
/// [`Connector`]s to check what they are asked to link to or ask.
pub(crate) fn check_peer(rank: usize, peer: usize, world_size: usize) -> crate::Result<()> {
    if peer >= world_size || peer == rank {
        return Err(crate::Error::InvalidArgument(format!(
            "rank {rank} has no peer rank {peer} in a job of {world_size}"
        )));
    }
    Ok(())
}

/// A rank's way to make links, the waiter that wakes when any of them may move, and
/// the beacon through which peers can ask what it is doing.
pub struct Links {
    /// Makes links.
    pub connector: Box<dyn Connector>,
    /// Wakes when any link made by `connector` may progress.
    pub waiter: Box<dyn Waiter>,
    /// This rank's current operation, as peers see it.
    pub beacon: Arc<Beacon>,
}

/// Which transport a communicator uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TransportKind {
    /// TCP sockets (the default), one connection per neighbour.
    #[default]
    Tcp,
    /// In-process pipes: only for ranks that are threads of one process
    /// ([`crate::Communicator::local_group`]).
    Local,
    /// RDMA verbs ([`rdma`]): needs the `rdma` feature and an RDMA device; without
    /// either, [`crate::Communicator::init`] says which is missing.
    Rdma,
    /// CUDA IPC ([`cuda_ipc`], feature `cuda`): the device-buffer collectives read the
    /// neighbours' GPU memory directly; host-buffer ones run over TCP links, which this
    /// transport also makes. Ranks must share one node (one GPU or several).
    #[cfg(feature = "cuda")]
    CudaIpc,
}

impl TransportKind {
    /// Parses a CLI name: `tcp`, `local`, and `rdma` in builds with the `rdma` feature;
    /// names of transports not built in are refused with [`crate::Error::Unavailable`].
    pub fn parse(s: &str) -> crate::Result<Self> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "local" => Ok(TransportKind::Local),
            #[cfg(feature = "rdma")]
            "rdma" | "ibverbs" => Ok(TransportKind::Rdma),
            #[cfg(not(feature = "rdma"))]
            "rdma" | "ibverbs" => Err(rdma::not_built(s)),
            #[cfg(feature = "cuda")]
            "cuda-ipc" | "cuda_ipc" => Ok(TransportKind::CudaIpc),
            #[cfg(not(feature = "cuda"))]
            "cuda-ipc" | "cuda_ipc" => Err(crate::Error::Unavailable {
                what: format!("transport {s}"),
                why: "this build has no CUDA IPC transport (it arrives with the \"cuda\" feature)"
                    .into(),
            }),
            _ => Err(crate::Error::InvalidArgument(format!(
                "unknown transport {s:?}: expected tcp or local"
            ))),
        }
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Local => "local",
            TransportKind::Rdma => "rdma",
            #[cfg(feature = "cuda")]
            TransportKind::CudaIpc => "cuda-ipc",
        }
    }
}
