//! RDMA transport: one reliable-connected queue pair per link, data moved by RDMA WRITE
//! into the peer's receive ring under credit-based flow control.
//!
//! The parts, from pure to hardware:
//!
//! * [`proto`]: the sans-IO protocol (slots, credits, which work requests to post,
//!   what each completion means). Always compiled; property-tested on its own.
//! * [`QueuePair`] and [`RdmaLink`]: a [`Link`] over any queue pair that can post the
//!   protocol's work requests, poll completions and expose its registered memory. The
//!   byte copying between user buffers and slots lives here, once for every backend.
//! * [`sim`]: an in-memory queue pair with RDMA-write semantics, delayed completions
//!   and the orderings RC allows, plus a [`Connector`](super::Connector) over it
//!   ([`sim::group`]). Always compiled, so every collective is tested over the RDMA
//!   protocol without hardware.
//! * `verbs` (feature `rdma`): the queue pair over ibverbs (one RC queue pair and one
//!   completion queue per link), connection data exchanged through the rendezvous
//!   store, and the connector, waiter and status queries over them. Its translations
//!   and connection record are unit-tested; **none of its verbs calls has run against
//!   RDMA hardware** (see the `verbs` module docs for the list).

use super::{Link, LinkError};
#[cfg(not(feature = "rdma"))]
use crate::error::Error;
use proto::{Completion, Endpoint, ProtoError, WorkRequest};
use std::io::{IoSlice, IoSliceMut};

pub mod proto;
pub mod sim;
#[cfg(feature = "rdma")]
pub mod verbs;

/// The error for asking for the RDMA transport in a build without the `rdma` feature.
#[cfg(not(feature = "rdma"))]
pub(crate) fn not_built(name: &str) -> Error {
    Error::Unavailable {
        what: format!("transport {name}"),
        why: "this build has no RDMA transport (it arrives with the \"rdma\" feature)".into(),
    }
}

/// The RDMA transport ([`super::builtin`]): probes for a device before the
/// rendezvous, then connects queue pairs through the store.
#[cfg(feature = "rdma")]
struct Rdma;

#[cfg(feature = "rdma")]
impl super::Transport for Rdma {
    fn name(&self) -> &str {
        "rdma"
    }

    fn probe(&self, _cfg: &crate::config::Config) -> crate::error::Result<()> {
        probe().map(|_| ())
    }

    fn connect(&self, job: super::Joined) -> crate::error::Result<super::Links> {
        verbs::endpoint(verbs::VerbsCtx {
            rank: job.rank(),
            world_size: job.world_size(),
            comm_id: job.comm_id,
            gid_index: job.config.transport.rdma.gid_index,
            store: job.store,
            params: proto::Params::default(),
        })
    }
}

/// The RDMA transport, or why this build has none.
pub(crate) fn transport() -> crate::error::Result<Box<dyn super::Transport>> {
    #[cfg(feature = "rdma")]
    {
        Ok(Box::new(Rdma))
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(not_built("rdma"))
    }
}

/// Finds and opens an RDMA device, returning its name; the error says why there is
/// none ([`crate::error::Error::Unavailable`]: not built with the `rdma` feature, no kernel
/// support, or no device).
pub fn probe() -> crate::error::Result<String> {
    #[cfg(feature = "rdma")]
    {
        verbs::probe()
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(not_built("rdma"))
    }
}

/// What [`RdmaLink`] needs from one end of a queue pair and its registered memory.
///
/// The memory is two buffers of [`proto::Params::ring_bytes`]: the *bounce* buffer the
/// local end writes from and the *ring* the peer writes into, plus the 8-byte *credit
/// word* the peer writes its freed count into.
pub trait QueuePair: Send {
    /// Posts one work request.
    fn post(&mut self, wr: &WorkRequest) -> Result<(), LinkError>;
    /// Appends the completions of this queue pair that are ready.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), LinkError>;
    /// The current value of the local credit word.
    fn credit_word(&self) -> u64;
    /// Copies `src` into the bounce buffer at `slot`, offset `off`.
    fn fill_bounce(&mut self, slot: usize, off: usize, src: &[u8]);
    /// Copies from the ring at `slot`, offset `off`, into `dst`.
    fn read_ring(&self, slot: usize, off: usize, dst: &mut [u8]);
}

/// A [`Link`] over a [`QueuePair`], driven by the [`proto::Endpoint`].
pub struct RdmaLink<Q: QueuePair> {
    peer: usize,
    qp: Q,
    ep: Endpoint,
    slot_bytes: usize,
    completions: Vec<Completion>,
    closed: bool,
    sent: u64,
    received: u64,
}

fn proto_err(e: ProtoError) -> LinkError {
    LinkError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        e.to_string(),
    ))
}

impl<Q: QueuePair> RdmaLink<Q> {
    /// A link to `peer` over `qp`, whose `S + 1` initial receive requests
    /// ([`Endpoint::initial_recvs`]) are already posted.
    pub fn new(peer: usize, qp: Q, params: proto::Params) -> Self {
        RdmaLink {
            peer,
            qp,
            ep: Endpoint::new(params),
            slot_bytes: params.slot_bytes,
            completions: Vec::new(),
            closed: false,
            sent: 0,
            received: 0,
        }
    }

    /// Polls completions and the credit word into the protocol.
    fn progress(&mut self) -> Result<(), LinkError> {
        self.completions.clear();
        self.qp.poll(&mut self.completions)?;
        for c in self.completions.drain(..) {
            self.ep.on_completion(c).map_err(proto_err)?;
        }
        let w = self.qp.credit_word();
        self.ep.on_credit(w).map_err(proto_err)?;
        self.flush()
    }

    /// Posts what the protocol wants posted.
    fn flush(&mut self) -> Result<(), LinkError> {
        while let Some(wr) = self.ep.poll_transmit() {
            self.qp.post(&wr)?;
        }
        Ok(())
    }
}

impl<Q: QueuePair> Link for RdmaLink<Q> {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        if self.closed {
            return Err(LinkError::Closed);
        }
        self.progress()?;
        if self.ep.rx.peer_closed() || self.ep.lost().is_some() {
            return Err(LinkError::Closed);
        }
        let mut n = 0;
        let (mut bi, mut bo) = (0usize, 0usize); // position in bufs
        'slots: while let Some(slot) = self.ep.writable() {
            let mut filled = 0;
            while filled < self.slot_bytes {
                while bi < bufs.len() && bo == bufs[bi].len() {
                    bi += 1;
                    bo = 0;
                }
                if bi == bufs.len() {
                    break;
                }
                let take = (bufs[bi].len() - bo).min(self.slot_bytes - filled);
                self.qp.fill_bounce(slot, filled, &bufs[bi][bo..bo + take]);
                bo += take;
                filled += take;
            }
            if filled == 0 {
                break 'slots;
            }
            self.ep.commit(filled);
            n += filled;
        }
        self.flush()?;
        self.sent += n as u64;
        Ok(n)
    }

    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, LinkError> {
        self.progress()?;
        let mut n = 0;
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() {
                let Some((slot, at, avail)) = self.ep.readable() else {
                    break;
                };
                let take = avail.min(b.len() - off);
                self.qp.read_ring(slot, at, &mut b[off..off + take]);
                self.ep.consume(take);
                off += take;
            }
            n += off;
            if off < b.len() {
                break;
            }
        }
        self.flush()?;
        self.received += n as u64;
        if n == 0 && (self.ep.rx.peer_closed() || self.ep.lost().is_some() || self.closed) {
            return Err(LinkError::Closed);
        }
        Ok(n)
    }

    fn shutdown(&mut self) {
        if !self.closed {
            self.closed = true;
            self.ep.close();
            // Best effort: a broken queue pair has nothing left to tell the peer.
            let _ = self.flush();
        }
    }

    fn raw_counts(&self) -> (u64, u64) {
        (self.sent, self.received)
    }

    fn class(&self) -> &'static str {
        "rdma"
    }
}

/// How long dropping a link waits for its writes to complete.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

impl<Q: QueuePair> Drop for RdmaLink<Q> {
    /// Closes the link and waits (up to 2 s) until every write posted has
    /// completed: destroying a queue pair with writes in flight may lose them, and the
    /// peer may still be reading the bytes this rank counted as sent.
    fn drop(&mut self) {
        self.shutdown();
        let end = std::time::Instant::now() + DRAIN_TIMEOUT;
        while !self.ep.quiet()
            && self.ep.lost().is_none()
            && self.ep.failed().is_none()
            && std::time::Instant::now() < end
        {
            if self.progress().is_err() {
                break;
            }
            std::thread::yield_now();
        }
    }
}
