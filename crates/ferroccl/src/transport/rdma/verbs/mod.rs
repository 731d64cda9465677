//! The RDMA transport over ibverbs (feature `rdma`): device discovery, the typed
//! errors for machines without RDMA, and the queue-pair driver.
//!
//! # What exists
//!
//! * [`probe`] and the no-device errors ([`classify`]): `ibv_get_device_list` failing
//!   (`ENOSYS` where the kernel has no RDMA support) or returning an empty list both
//!   read "no RDMA device found". Tested here.
//! * [`endpoint`]: opens the first device, checks that port 1 is active, reads its LID,
//!   active MTU, link layer and the GID at [`VerbsCtx::gid_index`], allocates one
//!   protection domain for the rank, and returns [`Links`] whose connector makes one
//!   [`driver::VerbsQp`] per link, wrapped in the protocol's [`RdmaLink`].
//! * Each [`driver::VerbsQp`] owns an RC queue pair, **its own completion queue** (send
//!   and receive completions of that link only, so [`super::QueuePair::poll`] never has
//!   to hand completions to another link), a page-aligned ring + credit word registered
//!   for remote write, and a bounce buffer + credit source word registered for local
//!   use only. Data goes by RDMA WRITE WITH IMMEDIATE, credits by a plain RDMA WRITE of
//!   8 bytes sent from the registered credit source word (not inline, so devices with
//!   no inline support work; the protocol keeps at most one credit write in flight, so
//!   the word is never rewritten while the NIC may read it). Timeouts and retries
//!   follow NCCL: `timeout` 18, `retry_cnt` 7, `rnr_retry` 7, `min_rnr_timer` 12; the
//!   path MTU is the smaller of the two ports' active MTUs.
//! * Connection data goes through the rendezvous store ([`record`]): a fixed-size,
//!   versioned, length-checked binary record per link end with LID, GID, QPN, a random
//!   24-bit PSN, ring and credit addresses and rkeys, and the ring parameters, under a
//!   key holding the job's communicator id, the channel and both ranks. The peer
//!   refuses a record for another job or link, of another byte order or link layer, or
//!   with other ring parameters, with [`Error::Handshake`] naming both ranks.
//! * The handshake ([`handshake`]) is **lazy**: `connect` creates the queue pair
//!   (INIT, receive requests posted), publishes its record and a progress counter, and
//!   returns at once; the link then advances on every poll (at most once a millisecond
//!   asks the store): fetch the peer's record, go to RTR and RTS, bump the counter, and
//!   post writes once the peer's counter says its queue pair is in RTR (before that,
//!   writes are queued). Blocking in `connect` would deadlock: the communicator connects
//!   higher-ranked neighbours first, so with three ranks each would wait on a record
//!   its neighbour has not published yet. So `connect` ignores its deadline, and a
//!   refused record or failed transition surfaces as the link's I/O error in the first
//!   operation that uses it, with the text of the typed error; a peer that never
//!   connects leaves that operation without progress until the operation timeout.
//! * The [`Waiter`] **polls with backoff**: it sleeps 20 µs after any completion or
//!   credit change on this rank's links, doubling up to 1 ms while nothing happens
//!   (spurious wake-ups are allowed by the contract). A completion channel cannot
//!   replace it: credit writes are plain RDMA writes and raise no completion at their
//!   target, so a sender waiting for credits would never be woken.
//! * [`crate::transport::Connector::peer_status`] is answered **through the store**: a
//!   thread of each rank publishes its [`Beacon`] under `rdma/<comm id>/beacon/<rank>`
//!   when it changes (checked every 50 ms, so an answer may be that stale), and a
//!   status query reads the peer's key. It works while the peer's own thread is stuck,
//!   which is what the query is for.
//!
//! No registration cache for user buffers: the [`crate::transport::Link`] contract
//! hands the transport byte slices that live only for one call, and [`RdmaLink`] copies
//! them into the registered bounce buffer (and out of the ring). A cache would only
//! pay for a zero-copy path, which that contract does not allow.
//!
//! # Never run against RDMA hardware
//!
//! Every verbs call in [`driver`] — device open, port and GID query, PD, CQ, QP and MR
//! creation, the INIT/RTR/RTS transitions, `ibv_post_send`, `ibv_post_recv`,
//! `ibv_poll_cq`, and the destruction order — and so the lazy handshake and the
//! waiter as they run with a device, has never run on an RDMA device: the machines it
//! was written on have none, and no RDMA support in the kernel. What is tested without
//! hardware: the protocol and [`RdmaLink`] over the simulated queue pair
//! (`tests/suite/rdma_sim.rs`, `rdma_proto.rs`), the connection record, the
//! work-request and completion translations and the queue-pair attributes ([`record`],
//! [`post`] unit tests), the handshake's store protocol with the transitions stubbed
//! ([`handshake`] unit tests, against an in-process store), and the no-device errors
//! (the CLI suite's `rdma_device.rs`).

use super::proto::Params;
use super::RdmaLink;
use crate::error::{Error, Result};
use crate::rendezvous::StoreClient;
use crate::sync::lock;
use crate::transport::{check_peer, Beacon, Channel, Connector, Link, Links, Waiter};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod driver;
pub mod handshake;
pub mod post;
pub mod record;

/// What a rank needs to set up its RDMA links.
pub struct VerbsCtx {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The job's communicator id (from the store).
    pub comm_id: u64,
    /// The rendezvous store, for exchanging connection data.
    pub store: StoreClient,
    /// Ring shape of every link.
    pub params: Params,
    /// Index of the local GID in port 1's GID table. Routing on RoCE uses it;
    /// InfiniBand routes by LID. [`crate::Communicator::init`] passes
    /// [`crate::Config::rdma_gid_index`] (`FERROCCL_RDMA_GID_INDEX`; default 0).
    pub gid_index: u8,
}

/// The error for "no RDMA device on this machine", with the reason verbs gave.
fn no_device(why: String) -> Error {
    Error::Unavailable {
        what: "transport rdma".into(),
        why: format!("no RDMA device found ({why})"),
    }
}

/// Turns the outcome of `ibv_get_device_list` into a device count or the typed error:
/// a failure (`ENOSYS` where the kernel has no RDMA support) and an empty list both
/// mean no device.
pub fn classify(list: std::io::Result<usize>) -> Result<usize> {
    match list {
        Err(e) => Err(no_device(format!("ibv_get_device_list: {e}"))),
        Ok(0) => Err(no_device(
            "ibv_get_device_list returned an empty list".into(),
        )),
        Ok(n) => Ok(n),
    }
}

/// Lists the RDMA devices and opens the first, returning its name.
///
/// Wraps `ibv_get_device_list(3)` and `ibv_open_device(3)`.
pub fn probe() -> Result<String> {
    driver::probe()
}

/// How often the beacon thread looks for a new operation to publish.
const BEACON_PERIOD: Duration = Duration::from_millis(50);

fn beacon_key(comm_id: u64, rank: usize) -> String {
    format!("rdma/{comm_id:016x}/beacon/{rank}")
}

/// The links of one rank over RDMA: opens the device, publishes this rank's beacon and
/// starts the thread that keeps it current; links are made by the returned connector.
pub fn endpoint(ctx: VerbsCtx) -> Result<Links> {
    ctx.params.validate().map_err(Error::Config)?;
    let dev = Arc::new(driver::Device::open(ctx.gid_index)?);
    tracing::debug!(rank = ctx.rank, device = dev.name(), "rdma device open");
    let store = Arc::new(Mutex::new(ctx.store));
    let beacon = Arc::new(Beacon::default());
    let stop = Arc::new(AtomicBool::new(false));
    let key = beacon_key(ctx.comm_id, ctx.rank);
    lock(&store).set(&key, &beacon.raw().to_le_bytes())?;
    {
        let (store, beacon, stop) = (store.clone(), beacon.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("ferroccl-beacon{}", ctx.rank))
            .spawn(move || publish_beacon(&store, &key, &beacon, &stop))
            .map_err(|e| Error::io("starting the RDMA beacon thread", e))?;
    }
    let activity = Arc::new(AtomicU64::new(0));
    Ok(Links::new(
        Box::new(VerbsConnector {
            rank: ctx.rank,
            world_size: ctx.world_size,
            comm_id: ctx.comm_id,
            params: ctx.params,
            dev,
            store,
            activity: activity.clone(),
            stop,
        }),
        Box::new(VerbsWaiter {
            activity,
            seen: 0,
            backoff: MIN_BACKOFF,
        }),
        beacon,
    ))
}

/// Publishes `beacon` under `key` whenever it changes, until `stop`.
fn publish_beacon(store: &Mutex<StoreClient>, key: &str, beacon: &Beacon, stop: &AtomicBool) {
    let mut last = beacon.raw();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(BEACON_PERIOD);
        let now = beacon.raw();
        if now != last {
            if let Err(e) = lock(store).set(key, &now.to_le_bytes()) {
                tracing::debug!("publishing the RDMA beacon failed, giving up: {e}");
                return;
            }
            last = now;
        }
    }
}

struct VerbsConnector {
    rank: usize,
    world_size: usize,
    comm_id: u64,
    params: Params,
    dev: Arc<driver::Device>,
    store: Arc<Mutex<StoreClient>>,
    activity: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Drop for VerbsConnector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Connector for VerbsConnector {
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        _deadline: Instant,
    ) -> Result<Box<dyn Link>> {
        let me = self.rank;
        check_peer(me, peer, self.world_size)?;
        let link = record::LinkId {
            comm_id: self.comm_id,
            from: me as u32,
            to: peer as u32,
            channel: channel.code(),
        };
        let qp = driver::VerbsQp::create(
            self.dev.clone(),
            self.store.clone(),
            link,
            self.params,
            self.activity.clone(),
        )?;
        Ok(Box::new(RdmaLink::new(peer, qp, self.params)))
    }

    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        check_peer(self.rank, peer, self.world_size)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let v = lock(&self.store).get(&beacon_key(self.comm_id, peer), left)?;
        let raw: [u8; 8] = v.as_slice().try_into().map_err(|_| {
            Error::Rendezvous(format!(
                "rank {peer}'s RDMA beacon is {} bytes, expected 8",
                v.len()
            ))
        })?;
        Ok(Beacon::decode(u64::from_le_bytes(raw)))
    }
}

const MIN_BACKOFF: Duration = Duration::from_micros(20);
const MAX_BACKOFF: Duration = Duration::from_millis(1);

/// Sleeps between polls: short after activity on any link, doubling while idle.
struct VerbsWaiter {
    activity: Arc<AtomicU64>,
    seen: u64,
    backoff: Duration,
}

impl Waiter for VerbsWaiter {
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()> {
        let now = self.activity.load(Ordering::Relaxed);
        self.backoff = next_backoff(self.backoff, now != self.seen);
        self.seen = now;
        std::thread::sleep(self.backoff.min(timeout));
        Ok(())
    }
}

/// The next sleep of [`VerbsWaiter`]: [`MIN_BACKOFF`] after activity, else double the
/// last, at most [`MAX_BACKOFF`].
fn next_backoff(last: Duration, active: bool) -> Duration {
    if active {
        MIN_BACKOFF
    } else {
        (last * 2).clamp(MIN_BACKOFF, MAX_BACKOFF)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_resets_on_activity_and_is_bounded() {
        let mut b = MIN_BACKOFF;
        for _ in 0..20 {
            b = next_backoff(b, false);
        }
        assert_eq!(b, MAX_BACKOFF);
        assert_eq!(next_backoff(b, true), MIN_BACKOFF);
        assert_eq!(next_backoff(MIN_BACKOFF, false), MIN_BACKOFF * 2);
    }

    #[test]
    fn beacon_keys_differ_per_rank_and_job() {
        assert_ne!(beacon_key(1, 2), beacon_key(1, 3));
        assert_ne!(beacon_key(1, 2), beacon_key(2, 2));
    }
}
