//! Shared-memory transport: ranks of one host move bytes through rings in shared
//! memory; ranks on other hosts (with `auto`) through TCP.
//!
//! The module is split by job: this file is the policy (who gets shared memory, set-up,
//! sleeping and waking, names in `/dev/shm`), `ring.rs` the rings and the link over
//! them, `single_copy.rs` the payloads a reader pulls from the writer's memory.
//!
//! # Who is on this host
//!
//! Every rank says which host it is on in the store before its transport links
//! ([`crate::rendezvous`]'s `hosts.rs`: boot id, hostname, effective user and the
//! network, IPC and mount namespaces), and the communicator gathers the job's list from
//! those keys; this transport reads a peer's when it first links to it. Two ranks are
//! on one host when their identities are equal (so both sides always agree): ranks in
//! different network namespaces, as on `tools/emulated-cluster`, are different hosts,
//! and so are ranks of different users (their segments are `0600`). Each rank also
//! says in the store whether it can make rings at all (`shm/<rank>`); a pair on one
//! host where either cannot links over TCP (`auto`), or is refused by name (`shm`).
//!
//! # Groups
//!
//! A sub-communicator's links ([`Connector::group`]) are made the same way by a
//! connector of their own: its TCP connections carry the group's id (see `tcp.rs`),
//! and its rings' names mix that id into the job's, so two ranks linked in the job
//! and in a group have two pairs of rings, each a stream of its own (a ring is one
//! producer's and one consumer's: two communicators cannot share it).
//!
//! # A link
//!
//! A link between two ranks of one host is a TCP connection made exactly as the TCP
//! transport makes it (the same handshake: communicator id, ranks, channel, job token)
//! plus two rings, one per direction, in POSIX shared-memory segments. The lower rank
//! (which dials) creates both (`/ferroccl-<comm id>-<pid>-<from>-<to>-<channel>`,
//! `O_EXCL`, `0600`) and says its pid and ring size over the TCP connection; the higher
//! rank maps them and unlinks both names at once: from then on no process can attach,
//! and nothing is left in `/dev/shm`. The lower rank never removes names its peer may
//! still map (it may finish with a link before the peer has even connected, as over
//! TCP, where sent bytes wait in the kernel), unless the peer's connection has ended;
//! a peer that goes (or closes a group) without ever taking up a link offered to it
//! reads the offer off the connection and removes its names itself; a name whose
//! creator died before its peer mapped it is removed by the next job's ranks
//! ([`reclaim_stale`]).
//!
//! A ring is a single-producer, single-consumer byte ring: a 4 KiB header whose
//! counters each sit on their own cache line — `head` (bytes ever written, stored by
//! the writer with `Release`), `tail` (bytes ever read, stored by the reader), the two
//! "I am asleep" flags and the two closed flags — then [`ShmOptions::ring_bytes`] of
//! data. A write copies into the free part and publishes `head`; a read copies out what
//! `head` says is there and publishes `tail`. Memory: per linked pair and channel, two
//! rings of `ring_bytes` + 4 KiB (default 2 MiB + 8 KiB; a job's collectives link each
//! rank to its ring neighbours and, for recursive doubling, its log2 n partners).
//!
//! # Single copy
//!
//! See `single_copy.rs`: with [`ShmOptions::single_copy_min`] set (off by default), a
//! large collective payload is read straight from the writer's memory.
//!
//! # Symmetric memory
//!
//! See `sym.rs`: when every rank of the job is on this host (and
//! [`ShmOptions::symmetric`] is on, as by default), each rank also keeps one
//! workspace that every peer maps, and the collectives read their peers' memory
//! (the pull executor: one-shot and two-shot all-reduce, the other collectives' plans)
//! instead of streaming frames through the rings; the rings then carry fingerprints,
//! point-to-point and the groups' traffic.
//!
//! # Sleeping and waking
//!
//! The engine polls its links for [`crate::config::Tuning::busy_poll`] and then sleeps
//! in the [`Waiter`]. The waiter raises its "asleep" flag in every ring it reads or
//! writes, and (after a `SeqCst` fence, paired with the one a peer issues between
//! publishing and looking at the flag) checks once more whether any ring moved since it
//! last looked; if none did it sleeps in `epoll` on the links' TCP connections. A peer
//! that publishes bytes, or frees space, while the flag is up takes the flag down and
//! writes one byte on the TCP connection: the doorbell. A rank that is not asleep costs
//! its peers nothing but a load. The TCP connection being in the same `epoll` set as
//! the TCP links of other hosts is what lets one waiter serve a job mixing both.
//!
//! # Failures
//!
//! The TCP connection is also the liveness signal: when a rank exits, is killed
//! (`kill -9`) or shuts its link down, the kernel or the rank closes the connection and
//! the peer's waiter wakes on the end of stream; the link then hands out what the ring
//! still holds (a failing rank's notice included) and reports [`LinkError::Closed`].
//! A stopped rank (`SIGSTOP`) closes nothing: its peers time out as over TCP, and the
//! status query, which goes over TCP, says it does not answer. No wait is unbounded.
//!
//! [`ShmOptions::ring_bytes`]: crate::config::ShmOptions::ring_bytes
//! [`Connector::group`]: super::Connector::group
//! [`ShmOptions::single_copy_min`]: crate::config::ShmOptions::single_copy_min
//! [`ShmOptions::symmetric`]: crate::config::ShmOptions::symmetric
//! [`DEFAULT_SHM_SINGLE_COPY_MIN`]: crate::config::DEFAULT_SHM_SINGLE_COPY_MIN

mod ring;
mod single_copy;
mod sym;

use super::tcp::{self, ConnectCtx, TcpConnector};
use super::{Channel, Connector, GroupSpec, Joined, Link, Links, Transport, Waiter};
use crate::error::{Error, Result};
use crate::rendezvous::hosts;
use crate::sync::lock;
use crate::sys::shm::{self, ShmSegment};
use mio::{Events, Poll};
use ring::{layout, Pair, Ring, ShmLink};
use single_copy::offer_memory;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The shared-memory transport: `strict` refuses a rank on another host (`shm`);
/// otherwise such ranks get TCP links (`auto`).
pub(crate) struct Shm {
    /// Whether every rank must be on this host.
    pub strict: bool,
}

/// What `shm/<rank>` says of a rank that can make rings.
const USABLE: &[u8] = b"ok";

impl Transport for Shm {
    fn name(&self) -> &str {
        if self.strict {
            "shm"
        } else {
            "auto"
        }
    }

    fn connect(&self, mut job: Joined) -> Result<Links> {
        let rank = job.rank();
        let ring_bytes = job.config.transport.shm.ring_bytes;
        let single_copy_min = job.config.transport.shm.single_copy_min;
        let wait = job.config.tuning.connect_timeout;
        let me = hosts::identity(&job.config.transport.shm.host_tag);
        reclaim_stale(wait);
        let usable = match probe(ring_bytes) {
            Ok(()) => true,
            Err(e) => {
                // Said in the store: peers on this host link over TCP with this rank
                // (both sides of each link agree without a word); under `shm` they
                // refuse it by name at once instead of waiting for it.
                let mut note = b"unusable: ".to_vec();
                note.extend_from_slice(e.to_string().as_bytes());
                let _ = job.store.set(&format!("shm/{rank}"), &note);
                if self.strict {
                    return Err(Error::Unavailable {
                        what: "transport shm".into(),
                        why: format!("shared memory is unusable on this host: {e}"),
                    });
                }
                tracing::warn!(
                    "rank {rank}: shared memory is unusable here ({e}); this rank's links \
                     within the host use TCP"
                );
                false
            }
        };
        if usable {
            job.store.set(&format!("shm/{rank}"), USABLE)?;
        }
        let settings = Settings {
            comm_id: job.comm_id,
            strict: self.strict,
            ring_bytes,
            single_copy_min,
            me,
            usable,
            peers: Arc::new(Mutex::new(HashMap::new())),
        };
        let n = job.world_size();
        let want = usable && job.config.transport.shm.symmetric;
        // Symmetric memory needs every rank on this host; a launcher that says how
        // many ranks this host has spares a job of many hosts the check.
        let maybe = n > 1 && job.config.job.local_world_size.is_none_or(|l| l == n);
        let mut store = if maybe {
            Some(job.store_connection()?)
        } else {
            None
        };
        let (comm_id, me) = (job.comm_id, settings.me.clone());
        let (tcp, poll, beacon) = tcp::endpoint_parts(ConnectCtx::of(job))?;
        let links = ShmConnector::links(tcp, poll, beacon, settings);
        let sym = match store.as_mut() {
            Some(s) => sym::connect(s, rank, n, comm_id, &me, want, Instant::now() + wait)?,
            None => None,
        };
        Ok(match sym {
            Some(peers) => links.with_memory(Box::new(peers)),
            None => links,
        })
    }
}

/// Prefix of every segment name this transport makes (in `/dev/shm` without the `/`).
const PREFIX: &str = "ferroccl-";

/// The id in the names of a group's rings: the job's communicator id for the job's own
/// links, mixed with the group's id for a group's (so no two of a job's communicators
/// name a ring alike).
fn ring_id(comm_id: u64, group: u64) -> u64 {
    if group == 0 {
        return comm_id;
    }
    // splitmix64's finaliser over the two ids.
    let mut z = comm_id ^ group.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How the names of the rings of a job's communicator `comm_id` (its links in
/// `group`, 0 for the job's own) begin in `/dev/shm`.
pub(crate) fn ring_prefix(comm_id: u64, group: u64) -> String {
    format!("{PREFIX}{:016x}-", ring_id(comm_id, group))
}

/// The names of the two rings of the link between job ranks `me` and `peer` on channel
/// `ch`, made by process `pid` under `id`: the one `me` writes, then the one it reads.
fn ring_names(id: u64, pid: u32, me: usize, peer: usize, ch: Channel) -> [String; 2] {
    [
        ring_name(id, pid, me, peer, ch),
        ring_name(id, pid, peer, me, ch),
    ]
}

/// The name of the ring that job rank `from` writes and `to` reads on channel `ch`,
/// made by process `pid` (the reader) under `id` ([`ring_id`]).
fn ring_name(comm_id: u64, pid: u32, from: usize, to: usize, ch: Channel) -> String {
    format!("/{PREFIX}{comm_id:016x}-{pid}-{from}-{to}-{}", ch.code())
}

/// Removes this user's ring segments whose creator is dead and which are older than
/// `min_age` (a live job unlinks its names within a few round trips of making them; a
/// name that stays is a job that died while linking). Best effort: a name it cannot
/// read or remove is left alone.
pub(crate) fn reclaim_stale(min_age: Duration) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    let uid = shm::effective_uid();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = stale_pid(&name) else {
            continue;
        };
        let Ok(meta) = entry.metadata() else { continue };
        let old = meta
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= min_age);
        if meta.uid() == uid && old && !shm::process_alive(pid) {
            match shm::unlink_name(&format!("/{name}")) {
                Ok(()) => tracing::info!("removed the stale shared-memory ring {name}"),
                Err(e) => tracing::debug!("could not remove {name}: {e}"),
            }
        }
    }
}

/// Whether this process can make a ring of `ring_bytes`: a segment of that size made,
/// its pages reserved and removed again. What fails (no `/dev/shm`, no permission, no
/// space) is the error.
fn probe(ring_bytes: usize) -> Result<()> {
    use std::sync::atomic::AtomicU64;
    // Shaped like a ring's name (so a leftover is reclaimed like one), with an id no
    // probe of this process has used (ranks may be threads of one process, probing at
    // once); a name left by a dead process of the same pid moves on to the next id.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut tries = 0;
    loop {
        let id = u64::MAX - NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("/{PREFIX}{id:016x}-{}-0-0-0", std::process::id());
        match ShmSegment::create_new(&name, ring_bytes + layout::DATA) {
            Err(Error::Io { source, .. })
                if source.kind() == io::ErrorKind::AlreadyExists && tries < 8 =>
            {
                tries += 1;
            }
            r => return r.map(drop),
        }
    }
}

/// The creator's pid in a ring segment's name, or `None` for a name that is not one.
fn stale_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let mut f = rest.split('-');
    let id = f.next()?;
    let pid = f.next()?.parse().ok()?;
    let nums = f
        .map(|x| x.parse::<u64>().ok())
        .collect::<Option<Vec<_>>>()?;
    (id.len() == 16 && u64::from_str_radix(id, 16).is_ok() && nums.len() == 3).then_some(pid)
}

/// Sleeps in `epoll` over the links' TCP connections (and, with `auto`, the TCP links
/// to other hosts), after raising the "asleep" flags; see the module docs.
struct ShmWaiter {
    poll: Poll,
    events: Events,
    pairs: Arc<Mutex<Vec<Arc<Pair>>>>,
    /// What each pair's counters were when last looked at (rx head and descriptor
    /// sequence, tx tail and bytes pulled), by index into `pairs`.
    seen: Vec<[u64; 4]>,
    /// Ends a sleep in `poll` from another thread.
    waker: Option<Arc<mio::Waker>>,
}

impl Waiter for ShmWaiter {
    fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        let mut pairs = lock(&self.pairs);
        // A pair only this list holds belongs to a dropped link.
        let mut i = 0;
        while i < pairs.len() {
            if Arc::strong_count(&pairs[i]) == 1 {
                pairs.swap_remove(i);
                if i < self.seen.len() {
                    self.seen.swap_remove(i);
                }
            } else {
                i += 1;
            }
        }
        self.seen.resize(pairs.len(), [0; 4]);
        let mut moved = false;
        for p in pairs.iter() {
            moved |= p.drain();
            p.rx.word(layout::READER_ASLEEP).store(1, Ordering::Relaxed);
            p.tx.word(layout::WRITER_ASLEEP).store(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        for (p, seen) in pairs.iter().zip(self.seen.iter_mut()) {
            let now = [
                p.rx.word(layout::HEAD).load(Ordering::Acquire),
                p.rx.word(layout::DESC_SEQ).load(Ordering::Acquire),
                p.tx.word(layout::TAIL).load(Ordering::Acquire),
                p.tx.word(layout::PULLED).load(Ordering::Acquire),
            ];
            let closed = p.rx.word(layout::WRITER_CLOSED).load(Ordering::Acquire) != 0
                || p.tx.word(layout::READER_CLOSED).load(Ordering::Acquire) != 0;
            moved |= now != *seen || closed;
            *seen = now;
        }
        let r = if moved {
            Ok(())
        } else {
            let pairs_held = std::mem::take(&mut *pairs);
            drop(pairs);
            let r = match self.poll.poll(&mut self.events, Some(timeout)) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
                r => r,
            };
            pairs = lock(&self.pairs);
            let added = std::mem::replace(&mut *pairs, pairs_held);
            pairs.extend(added);
            r
        };
        for p in pairs.iter() {
            p.rx.word(layout::READER_ASLEEP).store(0, Ordering::Relaxed);
            p.tx.word(layout::WRITER_ASLEEP).store(0, Ordering::Relaxed);
        }
        r
    }

    fn waker(&self) -> Option<super::Waker> {
        let w = self.waker.clone()?;
        Some(super::Waker::new(move || {
            let _ = w.wake();
        }))
    }
}

/// Makes shared-memory links to ranks of this host and TCP links to the others, for
/// the job or for one of its groups.
struct ShmConnector {
    tcp: TcpConnector,
    /// What the job's connector and its groups' share.
    s: Settings,
    pairs: Arc<Mutex<Vec<Arc<Pair>>>>,
}

/// A rank's shared-memory settings and what it learnt of its peers, the same for the
/// job's connector and its groups'.
#[derive(Clone)]
struct Settings {
    /// The job's communicator id.
    comm_id: u64,
    strict: bool,
    ring_bytes: usize,
    /// [`crate::config::ShmOptions::single_copy_min`].
    single_copy_min: usize,
    /// This rank's host identity.
    me: String,
    /// Whether this rank can make rings.
    usable: bool,
    /// Whether each job rank asked about so far gets shared memory (on this host,
    /// and able to make rings).
    peers: Arc<Mutex<HashMap<usize, bool>>>,
}

impl ShmConnector {
    /// The links of a connector over `tcp` (whose links `poll` waits on), answering
    /// status queries from `beacon`.
    fn links(tcp: TcpConnector, poll: Poll, beacon: Arc<super::Beacon>, s: Settings) -> Links {
        let pairs = Arc::new(Mutex::new(Vec::new()));
        let waker = tcp::poll_waker(&poll);
        Links::new(
            Box::new(ShmConnector {
                tcp,
                s,
                pairs: pairs.clone(),
            }),
            Box::new(ShmWaiter {
                poll,
                events: Events::with_capacity(64),
                pairs,
                seen: Vec::new(),
                waker,
            }),
            beacon,
        )
    }
}

/// Removes ring names (best effort: one already gone is fine).
fn unlink_names(names: &[String]) {
    for n in names {
        if let Err(e) = shm::unlink_name(n) {
            tracing::debug!("unlinking {n}: {e}");
        }
    }
}

/// Bytes on a link's TCP connection after the set-up: a doorbell, and (once, from
/// the higher rank) "I have mapped the rings and removed their names".
const DOORBELL: u8 = 1;
const MAPPED: u8 = 2;

/// What the lower rank of a link says after the TCP handshake: `FCSM`, its pid, and
/// the size of the two rings it made.
const OFFER_LEN: usize = 16;
const OFFER_MAGIC: [u8; 4] = *b"FCSM";

impl ShmConnector {
    /// This rank's job rank, and the job rank of this connector's rank `peer`.
    fn job_ranks(&self, peer: usize) -> (usize, usize) {
        let m = self.tcp.members();
        (m[self.tcp.rank()], m[peer])
    }

    /// Whether this connector's rank `peer` gets a shared-memory link: on this host,
    /// and both ranks able to make rings (asked of the store once per job rank).
    fn same_host(&mut self, peer: usize, deadline: Instant) -> Result<bool> {
        let (me, p) = self.job_ranks(peer);
        if let Some(&ok) = lock(&self.s.peers).get(&p) {
            return Ok(ok);
        }
        let theirs = hosts::of_rank(&mut self.tcp.store(), me, p, deadline)?;
        if theirs != self.s.me {
            if self.s.strict {
                return Err(Error::Unavailable {
                    what: "transport shm".into(),
                    why: format!(
                        "rank {p} is on another host (it says {theirs:?}; rank {me} is on \
                         {:?}): use --transport auto or tcp",
                        self.s.me
                    ),
                });
            }
            lock(&self.s.peers).insert(p, false);
            return Ok(false);
        }
        let ok = self.s.usable && {
            let wait = deadline.saturating_duration_since(Instant::now());
            let said = self
                .tcp
                .store()
                .get(&format!("shm/{p}"), wait)
                .map_err(|e| {
                    Error::Rendezvous(format!(
                        "rank {me}: rank {p} did not say whether it can use shared memory \
                     within {wait:?}: has it started, with the same transport? ({e})"
                    ))
                })?;
            if said != USABLE && self.s.strict {
                return Err(Error::Unavailable {
                    what: "transport shm".into(),
                    why: format!(
                        "rank {p} cannot use shared memory: {}",
                        String::from_utf8_lossy(&said)
                    ),
                });
            }
            said == USABLE
        };
        lock(&self.s.peers).insert(p, ok);
        Ok(ok)
    }

    /// The two rings of a fresh link to `peer`, over its handshaken TCP connection
    /// `s`. The lower rank (the one that dialled) makes both and says so on `s` at once;
    /// the higher reads that, maps both and removes the names. Neither waits for the
    /// other's main thread (the lower rank's dial is answered by the higher's acceptor),
    /// so ranks connecting to their neighbours in any order cannot deadlock.
    fn link_rings(
        &self,
        s: &mut TcpStream,
        peer: usize,
        ch: Channel,
        deadline: Instant,
    ) -> Result<(Ring, Ring)> {
        let who = format!("rank {peer}");
        let hs = |detail: String| Error::Handshake {
            peer: who.clone(),
            detail,
        };
        let io = |what: &str, e: io::Error| hs(format!("shared-memory set-up: {what}: {e}"));
        let (me, peer) = self.job_ranks(peer);
        let id = ring_id(self.s.comm_id, self.tcp.group_id());
        if peer > me {
            let pid = std::process::id();
            let names = ring_names(id, pid, me, peer, ch);
            let mut tx = Ring::create(&names[0], self.s.ring_bytes)?;
            let mut rx = Ring::create(&names[1], self.s.ring_bytes)?;
            // From here the names are the peer's to remove once it has mapped them
            // (even if this rank is done with the link first), or ours when the peer is
            // known never to (`ShmLink::drop`).
            tx.seg.disown();
            rx.seg.disown();
            let mut offer = [0u8; OFFER_LEN];
            offer[..4].copy_from_slice(&OFFER_MAGIC);
            offer[4..8].copy_from_slice(&pid.to_le_bytes());
            offer[8..16].copy_from_slice(&(self.s.ring_bytes as u64).to_le_bytes());
            if let Err(e) = s.write_all(&offer) {
                // The peer can never map them: nobody else will remove the names.
                unlink_names(&names);
                return Err(io("sending the offer", e));
            }
            return Ok((tx, rx));
        }
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))
            .map_err(|e| io("read timeout", e))?;
        let mut offer = [0u8; OFFER_LEN];
        s.read_exact(&mut offer)
            .map_err(|e| io("reading the offer", e))?;
        if offer[..4] != OFFER_MAGIC {
            return Err(hs(format!(
                "expected a shared-memory offer, got {:02x?}",
                &offer[..4]
            )));
        }
        let pid = u32::from_le_bytes([offer[4], offer[5], offer[6], offer[7]]);
        let mut cap = [0u8; 8];
        cap.copy_from_slice(&offer[8..16]);
        let cap = u64::from_le_bytes(cap);
        let cap = usize::try_from(cap)
            .ok()
            .filter(|c| (4096..=1 << 30).contains(c))
            .ok_or_else(|| hs(format!("offered rings of {cap} bytes")))?;
        let names = ring_names(id, pid, me, peer, ch);
        let rings = Ring::open(&names[0], cap).and_then(|tx| Ok((tx, Ring::open(&names[1], cap)?)));
        // Mapped or not, the names go: nobody else may attach, nothing is left behind.
        unlink_names(&names);
        let rings = rings.map_err(hs)?;
        // Best effort: a lower rank that already finished and left reads nothing more.
        let _ = s.write_all(&[MAPPED]);
        Ok(rings)
    }
}

impl ShmConnector {
    /// Removes the ring names offered on connections that lower ranks made to this
    /// rank and that this rank never took up (a link only they used, such as
    /// point-to-point sends this rank never received): their makers leave the names
    /// to this rank while its connection is open ([`ShmLink`]'s shutdown), so without
    /// this they would stay in `/dev/shm` for as long as the makers live. An offer not
    /// yet on the connection is its maker's to remove: it sees the connection end.
    fn forget_unclaimed(&self) {
        let id = ring_id(self.s.comm_id, self.tcp.group_id());
        let me = self.tcp.members()[self.tcp.rank()];
        for (from, ch, s) in self.tcp.take_unclaimed() {
            if let Some(pid) = offer_now(&s) {
                unlink_names(&ring_names(id, pid, me, from, ch));
            }
        }
    }
}

/// The pid in the ring offer already waiting on `s`, if a whole one is; reads without
/// waiting.
fn offer_now(mut s: &TcpStream) -> Option<u32> {
    s.set_nonblocking(true).ok()?;
    let mut offer = [0u8; OFFER_LEN];
    let mut got = 0;
    while got < OFFER_LEN {
        match s.read(&mut offer[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    (offer[..4] == OFFER_MAGIC)
        .then(|| u32::from_le_bytes([offer[4], offer[5], offer[6], offer[7]]))
}

impl Drop for ShmConnector {
    fn drop(&mut self) {
        self.forget_unclaimed();
    }
}

impl Connector for ShmConnector {
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> Result<Box<dyn Link>> {
        super::check_peer(self.tcp.rank(), peer, self.tcp.members().len())?;
        if !self.same_host(peer, deadline)? {
            return self.tcp.connect(peer, channel, deadline);
        }
        let mut s = self.tcp.stream(peer, channel, deadline)?;
        let (tx, rx) = self.link_rings(&mut s, peer, channel, deadline)?;
        let ctl = self.tcp.register(s, peer, channel)?;
        let (me, p) = self.job_ranks(peer);
        let names = if p > me {
            let (pid, id) = (
                std::process::id(),
                ring_id(self.s.comm_id, self.tcp.group_id()),
            );
            ring_names(id, pid, me, p, channel).to_vec()
        } else {
            Vec::new()
        };
        let pair = Arc::new(Pair {
            peer,
            tx,
            rx,
            ctl,
            gone: AtomicBool::new(false),
            names: Mutex::new(names),
        });
        lock(&self.pairs).push(pair.clone());
        // Single copy for collectives only: a pulled frame's send completes when the
        // peer receives it (collective plans are checked to run over links that hold
        // nothing), while point-to-point sends keep the ring's buffering.
        let min = match channel {
            Channel::Collective => self.s.single_copy_min,
            _ => 0,
        };
        if min > 0 {
            offer_memory(&pair.tx, self.tcp.rank());
        }
        Ok(Box::new(ShmLink::new(pair, min)))
    }

    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        self.tcp.peer_status(peer, deadline)
    }

    fn peers_status(
        &mut self,
        peers: &[usize],
        deadline: Instant,
    ) -> Vec<Result<Option<(u64, u8)>>> {
        self.tcp.peers_status(peers, deadline)
    }

    fn ready(&mut self, peer: usize, channel: Channel) -> bool {
        self.tcp.ready_now(peer, channel)
    }

    fn close(&mut self) {
        self.forget_unclaimed();
        self.tcp.close_group();
    }

    fn group(&mut self, spec: &GroupSpec) -> Result<Links> {
        let (tcp, poll, beacon) = self.tcp.subgroup(spec)?;
        Ok(ShmConnector::links(tcp, poll, beacon, self.s.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::LinkError;
    use std::io::{IoSlice, IoSliceMut};

    #[test]
    fn stale_names_are_recognised_and_others_left_alone() {
        assert_eq!(
            stale_pid("ferroccl-00000000deadbeef-1234-0-1-0"),
            Some(1234)
        );
        for other in [
            "ferroccl-test-77",
            "ferroccl-deadbeef-1234-0-1-0",
            "ferroccl-00000000deadbeef-x-0-1-0",
            "ferroccl-00000000deadbeef-12-0-1",
            "sem.ferroccl-00000000deadbeef-1234-0-1-0",
        ] {
            assert_eq!(stale_pid(other), None, "{other}");
        }
        let name = ring_name(0xdead_beef, 1234, 0, 1, Channel::P2p);
        assert_eq!(stale_pid(&name[1..]), Some(1234));
    }

    #[test]
    fn probes_of_ranks_that_are_threads_of_one_process_do_not_collide() {
        // Ranks in one process probe at once: each needs a name of its own (the first
        // version named them by the clock, and two threads drew the same one).
        let ok = std::thread::scope(|s| {
            let hs: Vec<_> = (0..16).map(|_| s.spawn(|| probe(4096))).collect();
            hs.into_iter()
                .map(|h| h.join().expect("probe thread"))
                .collect::<Vec<_>>()
        });
        for r in &ok {
            assert!(r.is_ok(), "{r:?}");
        }
    }

    #[test]
    fn groups_name_their_rings_apart_from_the_job_and_each_other() {
        let job = 0x1234_5678_9abc_def0;
        assert_eq!(ring_id(job, 0), job);
        let ids: std::collections::HashSet<u64> = (0..1000).map(|g| ring_id(job, g)).collect();
        assert_eq!(ids.len(), 1000);
        assert_ne!(ring_id(job, 7), ring_id(job + 1, 7));
    }

    /// Two ranks' links over a real store: rank 0 sleeps in its waiter with a wait far
    /// longer than the test's deadline; the doorbell of rank 1's write must wake it, and
    /// later the end of rank 1's connection (its links dropped without a word, as a
    /// killed process's are closed by the kernel). Bytes written before the end are
    /// still read, then `Closed`.
    #[test]
    fn a_sleeping_waiter_wakes_for_bytes_and_for_a_peer_that_left() {
        // A lost wakeup would sleep for an hour: the deadline fails it in 30 s. (The
        // layer rules keep `crate::testing` out of transport/, so the deadline is here.)
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            sleeper_wakes();
            let _ = tx.send(());
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(()) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("no wakeup within 30 s"),
            Err(_) => panic!("the sleeper panicked (see above)"),
        }
    }

    fn sleeper_wakes() {
        use crate::config::Config;
        use crate::rendezvous::{StoreClient, StoreServer};
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = server.local_addr().to_string();
        let join = move |rank: usize| {
            let mut config = Config::new(rank, 2, addr.clone());
            config.job.serve_store = false;
            config.transport.shm.ring_bytes = 4096;
            let mut store =
                StoreClient::connect_with_token(&addr, Duration::from_secs(10), None).unwrap();
            let comm_id = store.join(rank, 2).unwrap();
            crate::rendezvous::hosts::publish(
                &mut store,
                rank,
                &crate::rendezvous::hosts::identity(""),
            )
            .unwrap();
            Shm { strict: true }
                .connect(Joined {
                    config,
                    comm_id,
                    store,
                })
                .unwrap()
        };
        /// Reads until `want` bytes came, sleeping in the waiter (for an hour: only a
        /// wakeup ends it) whenever nothing is there.
        fn read_all(l: &mut Box<dyn Link>, w: &mut Box<dyn Waiter>, want: usize) -> Vec<u8> {
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            while got.len() < want {
                match l.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap() {
                    0 => w.wait(Duration::from_secs(3600)).unwrap(),
                    n => got.extend_from_slice(&buf[..n]),
                }
            }
            got
        }
        let j1 = join.clone();
        let peer = std::thread::spawn(move || {
            let mut links = j1(1);
            let far = Instant::now() + Duration::from_secs(10);
            let mut l = links
                .connector
                .connect(0, Channel::Collective, far)
                .unwrap();
            // Give rank 0 time to fall asleep (if it has not, its wait returns at
            // once, which is allowed: the test only requires that it returns).
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(l.try_write(&[IoSlice::new(b"ding")]).unwrap(), 4);
            // Only rank 0's doorbell can wake this wait: the link stays open.
            assert_eq!(read_all(&mut l, &mut links.waiter, 4), b"dong");
            assert_eq!(l.try_write(&[IoSlice::new(b"bye")]).unwrap(), 3);
            drop(l);
            drop(links);
        });
        let mut links = join(0);
        let far = Instant::now() + Duration::from_secs(10);
        let mut l = links
            .connector
            .connect(1, Channel::Collective, far)
            .unwrap();
        // Only rank 1's doorbell can wake this wait: rank 1 keeps the link open.
        assert_eq!(read_all(&mut l, &mut links.waiter, 4), b"ding");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(l.try_write(&[IoSlice::new(b"dong")]).unwrap(), 4);
        // Then the end of rank 1's connection wakes it: the bytes before it are read,
        // then Closed.
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        let closed = loop {
            match l.try_read(&mut [IoSliceMut::new(&mut buf)]) {
                Ok(0) => links.waiter.wait(Duration::from_secs(3600)).unwrap(),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        assert_eq!(got, b"bye", "every byte before the end is read");
        assert!(matches!(closed, LinkError::Closed), "{closed:?}");
        peer.join().unwrap();
    }
}
