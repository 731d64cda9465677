//! Shared-memory transport: ranks of one host move bytes through rings in shared
//! memory; ranks on other hosts (with `auto`) through TCP.
//!
//! # Who is on this host
//!
//! Every rank publishes `host/<rank>` in the store: boot id, hostname, effective user
//! and the network, IPC and mount namespaces. Two ranks are on one host when the two
//! strings are equal (so both sides always agree): ranks in different network
//! namespaces, as on `tools/emulated-cluster`, are different hosts, and so are ranks of
//! different users (their segments are `0600`).
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
//! a name whose creator died before its peer mapped it is removed by the next job's
//! ranks ([`reclaim_stale`]).
//!
//! A ring is a single-producer, single-consumer byte ring: a 4 KiB header whose
//! counters each sit on their own cache line — `head` (bytes ever written, stored by
//! the writer with `Release`), `tail` (bytes ever read, stored by the reader), the two
//! "I am asleep" flags and the two closed flags — then [`ShmOptions::ring_bytes`] of
//! data. A write copies into the free part and publishes `head`; a read copies out what
//! `head` says is there and publishes `tail`. Memory: per linked pair and channel, two
//! rings of `ring_bytes` + 4 KiB (default 8 MiB + 8 KiB; a job's collectives link each
//! rank to its ring neighbours and, for recursive doubling, its log2 n partners).
//!
//! # Single copy
//!
//! With [`ShmOptions::single_copy_min`] set (off by default: see
//! [`DEFAULT_SHM_SINGLE_COPY_MIN`] for what it measured), a collective frame's payload
//! of at least that size (and at least a page) does not go through the ring: the
//! writer posts a descriptor in the ring's header (stream position, address, length,
//! under a sequence lock) and the reader, once it has read the ring up to that
//! position, copies the bytes straight from the writer's memory into its destination
//! with `process_vm_readv` and publishes how much it pulled. The writer reports those
//! bytes as written only then, so a send completes when its receiver has it
//! (collective plans are checked to run over links that hold nothing).
//!
//! - Who may pull is proved, not assumed: the writer publishes its pid and the address
//!   and value of a random cookie; the reader reads the cookie through
//!   `process_vm_readv` once and says in the header whether it can. A reader that
//!   cannot (another user, Yama `ptrace_scope` 2 or 3, another pid namespace, single
//!   copy off on its side) gets the ring. Under `ptrace_scope` 1 a rank that offers its
//!   memory names any process its ptracer (`PR_SET_PTRACER_ANY`), as Open MPI does.
//! - A writer that fails shuts the link (closed flag, `SeqCst`) before its caller may
//!   reuse the buffer; a reader checks that flag, and the writer's pidfd, after each
//!   copy and throws the bytes away if either says so, so no rank uses bytes from a
//!   buffer its owner had already taken back, or from a process that took a dead
//!   writer's pid.
//! - Point-to-point links keep the ring: a pulled send would wait for its receive.
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
//! [`ShmOptions::single_copy_min`]: crate::config::ShmOptions::single_copy_min
//! [`DEFAULT_SHM_SINGLE_COPY_MIN`]: crate::config::DEFAULT_SHM_SINGLE_COPY_MIN

use super::tcp::{self, ConnectCtx, TcpConnector};
use super::{Channel, Connector, Joined, Link, LinkError, Links, Transport, Waiter};
use crate::error::{Error, Result};
use crate::rendezvous::StoreClient;
use crate::sync::lock;
use crate::sys::shm::{self, ShmSegment};
use mio::{Events, Poll};
use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The shared-memory transport: `strict` refuses a rank on another host (`shm`);
/// otherwise such ranks get TCP links (`auto`).
pub(crate) struct Shm {
    /// Whether every rank must be on this host.
    pub strict: bool,
}

impl Transport for Shm {
    fn name(&self) -> &str {
        if self.strict {
            "shm"
        } else {
            "auto"
        }
    }

    fn connect(&self, mut job: Joined) -> Result<Links> {
        let mut me = host_identity();
        let tag = &job.config.transport.shm.host_tag;
        if !tag.is_empty() {
            me = format!("{me} tag={tag}");
        }
        let rank = job.rank();
        let ring_bytes = job.config.transport.shm.ring_bytes;
        let single_copy_min = job.config.transport.shm.single_copy_min;
        let wait = job.config.tuning.connect_timeout;
        reclaim_stale(wait);
        if let Err(e) = probe(ring_bytes) {
            // An identity no other rank has: every peer sees another host and links
            // over TCP, and both sides of each link agree without a word; under `shm`
            // the peers refuse it by name at once instead of waiting for it.
            me = format!("{me} shm-unusable-rank={rank} ({e})");
            if self.strict {
                let _ = job.store.set(&format!("host/{rank}"), me.as_bytes());
                return Err(Error::Unavailable {
                    what: "transport shm".into(),
                    why: format!("shared memory is unusable on this host: {e}"),
                });
            }
            tracing::warn!(
                "rank {rank}: shared memory is unusable here ({e}); this rank's links \
                 within the host use TCP"
            );
        }
        job.store.set(&format!("host/{rank}"), me.as_bytes())?;
        let (rank, world_size, comm_id) = (job.rank(), job.world_size(), job.comm_id);
        let (mut tcp, poll, beacon) = tcp::endpoint_parts(ConnectCtx::of(job))?;
        // After this rank's address is out: a peer may wait for it before its own
        // host identity is published (it connects first, as over TCP).
        let hosts = job_hosts(tcp.store(), rank, world_size, wait)?;
        let pairs = Arc::new(Mutex::new(Vec::new()));
        Ok(Links::new(
            Box::new(ShmConnector {
                tcp,
                rank,
                world_size,
                comm_id,
                strict: self.strict,
                ring_bytes,
                single_copy_min,
                me,
                same_host: HashMap::new(),
                pairs: pairs.clone(),
            }),
            Box::new(ShmWaiter {
                poll,
                events: Events::with_capacity(64),
                pairs,
                seen: Vec::new(),
            }),
            beacon,
        )
        .with_hosts(hosts))
    }
}

/// Every rank's host identity, in rank order, the same list on every rank: rank 0
/// reads each `host/<rank>` (within `wait` in all) and publishes the list as `hosts`
/// (one store read per rank for the others). A rank that never says is named: rank 0
/// publishes why it has no list (`!` and the reason), so every rank reports it.
fn job_hosts(
    store: &mut StoreClient,
    rank: usize,
    n: usize,
    wait: Duration,
) -> Result<Vec<String>> {
    const FAILED: u8 = b'!';
    if rank == 0 {
        let deadline = Instant::now() + wait;
        let mut all = Vec::with_capacity(n);
        for r in 0..n {
            let left = deadline.saturating_duration_since(Instant::now());
            match store.get(&format!("host/{r}"), left) {
                Ok(id) => all.push(String::from_utf8_lossy(&id).into_owned()),
                Err(e) => {
                    let why = format!(
                        "rank {r} did not publish which host it is on within {wait:?}: has it \
                         started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE?"
                    );
                    let mut note = vec![FAILED];
                    note.extend_from_slice(why.as_bytes());
                    // Best effort: the others time out on their own otherwise.
                    let _ = store.set("hosts", &note);
                    return Err(Error::Rendezvous(format!("rank 0: {why} ({e})")));
                }
            }
        }
        let list = serde_json::to_vec(&all).map_err(|e| Error::Rendezvous(e.to_string()))?;
        store.set("hosts", &list)?;
        return Ok(all);
    }
    // Rank 0 waits up to `wait` for the last rank; give it that and as long again.
    let list = store.get("hosts", 2 * wait).map_err(|e| {
        Error::Rendezvous(format!(
            "rank {rank}: rank 0 did not publish the job's host list within {:?}: has it \
             started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE? ({e})",
            2 * wait
        ))
    })?;
    if let Some(why) = list.strip_prefix(&[FAILED]) {
        return Err(Error::Rendezvous(format!(
            "rank {rank}: {} (rank 0 found)",
            String::from_utf8_lossy(why)
        )));
    }
    serde_json::from_slice::<Vec<String>>(&list)
        .ok()
        .filter(|v| v.len() == n)
        .ok_or_else(|| Error::Rendezvous(format!("rank {rank}: the job's host list is malformed")))
}

/// What makes two processes "one host" here (see the module docs).
pub(crate) fn host_identity() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|e| format!("?{e}"))
    };
    let ns = |n: &str| {
        std::fs::read_link(format!("/proc/self/ns/{n}"))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("?{e}"))
    };
    format!(
        "boot={} host={} uid={} {} {} {}",
        read("/proc/sys/kernel/random/boot_id"),
        read("/proc/sys/kernel/hostname"),
        shm::effective_uid(),
        ns("net"),
        ns("ipc"),
        ns("mnt"),
    )
}

/// Prefix of every segment name this transport makes (in `/dev/shm` without the `/`).
const PREFIX: &str = "ferroccl-";

/// The name of the ring that rank `from` writes and `to` reads on channel `ch`, made
/// by process `pid` (the reader) in job `comm_id`.
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

/// Layout of a ring segment: the header words (byte offsets; each counter on its own
/// 64-byte line), then the data from [`DATA`].
mod layout {
    pub const MAGIC: usize = 0;
    pub const CAPACITY: usize = 8;
    pub const HEAD: usize = 64;
    pub const WRITER_ASLEEP: usize = 128;
    pub const TAIL: usize = 192;
    pub const READER_ASLEEP: usize = 256;
    pub const WRITER_CLOSED: usize = 320;
    pub const READER_CLOSED: usize = 384;
    /// Single copy: the writer's pid (0: it offers none), published after the address
    /// and value of its cookie (`sys::cma::cookie`).
    pub const WRITER_PID: usize = 448;
    pub const COOKIE_ADDR: usize = 456;
    pub const COOKIE: usize = 464;
    /// The reader's verdict on reading the writer's memory: 0 (not tried yet),
    /// [`CAN_PULL`] or [`CANNOT_PULL`].
    pub const PULL: usize = 512;
    /// The writer's descriptor, under a sequence lock (`DESC_SEQ` odd while it is
    /// rewritten): once the reader has read the ring up to stream position `DESC_POS`,
    /// the next `DESC_LEN` bytes are at `DESC_ADDR` in the writer's memory; `DESC_BASE`
    /// is what `PULLED` says before them.
    pub const DESC_SEQ: usize = 576;
    pub const DESC_POS: usize = 584;
    pub const DESC_BASE: usize = 592;
    pub const DESC_LEN: usize = 600;
    pub const DESC_ADDR: usize = 608;
    /// Bytes ever pulled by the reader (stored with `Release` after the copy).
    pub const PULLED: usize = 640;
    pub const DATA: usize = 4096;
    pub const CAN_PULL: u64 = 1;
    pub const CANNOT_PULL: u64 = 2;
    /// "FCSHRNG1" as a little-endian word.
    pub const MAGIC_VALUE: u64 = u64::from_le_bytes(*b"FCSHRNG1");
}

/// One direction's ring, as mapped in this process.
struct Ring {
    seg: ShmSegment,
    cap: u64,
}

impl Ring {
    fn word(&self, off: usize) -> &AtomicU64 {
        self.seg.word(off / 8)
    }

    /// Makes (for the pair) the ring `name` of `cap` data bytes.
    fn create(name: &str, cap: usize) -> Result<Self> {
        let seg = ShmSegment::create_new(name, layout::DATA + cap)?;
        let r = Ring {
            seg,
            cap: cap as u64,
        };
        r.word(layout::CAPACITY)
            .store(cap as u64, Ordering::Relaxed);
        r.word(layout::MAGIC)
            .store(layout::MAGIC_VALUE, Ordering::Release);
        Ok(r)
    }

    /// Maps the peer's ring `name` of `cap` data bytes, checking its header says so.
    fn open(name: &str, cap: usize) -> std::result::Result<Self, String> {
        let seg = ShmSegment::open(name, layout::DATA + cap).map_err(|e| e.to_string())?;
        let r = Ring {
            seg,
            cap: cap as u64,
        };
        let (magic, c) = (
            r.word(layout::MAGIC).load(Ordering::Acquire),
            r.word(layout::CAPACITY).load(Ordering::Relaxed),
        );
        if magic != layout::MAGIC_VALUE || c != cap as u64 {
            return Err(format!(
                "shared-memory ring {name} has magic {magic:#x} and capacity {c}, \
                 expected {:#x} and {cap}",
                layout::MAGIC_VALUE
            ));
        }
        Ok(r)
    }

    /// Copies `src` into the ring at stream position `pos` (wrapping).
    fn put(&self, pos: u64, src: &[u8]) {
        let at = (pos % self.cap) as usize;
        let first = src.len().min(self.cap as usize - at);
        self.seg.write_at(layout::DATA + at, &src[..first]);
        self.seg.write_at(layout::DATA, &src[first..]);
    }

    /// Copies from the ring at stream position `pos` into `dst` (wrapping).
    fn get(&self, pos: u64, dst: &mut [u8]) {
        let at = (pos % self.cap) as usize;
        let first = dst.len().min(self.cap as usize - at);
        self.seg.read_at(layout::DATA + at, &mut dst[..first]);
        self.seg.read_at(layout::DATA, &mut dst[first..]);
    }
}

/// What a link and the waiter share: both rings, the TCP connection (doorbell and
/// liveness), and whether that connection has ended.
struct Pair {
    peer: usize,
    /// The ring this rank writes (the peer's segment).
    tx: Ring,
    /// The ring this rank reads (its own segment).
    rx: Ring,
    ctl: mio::net::TcpStream,
    /// The TCP connection ended or failed: the peer exited, was killed or shut down.
    gone: AtomicBool,
    /// On the lower rank, the rings' names until the peer says it mapped them
    /// ([`MAPPED`]); empty on the higher.
    names: Mutex<Vec<String>>,
}

impl Pair {
    /// Wakes the peer's waiter, which raised `flag` before sleeping.
    fn ring_if_asleep(&self, flag: &AtomicU64) {
        fence(Ordering::SeqCst);
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
            // A full socket buffer already holds doorbells the peer has yet to read.
            let _ = (&self.ctl).write(&[DOORBELL]);
        }
    }

    /// Reads what the connection holds (doorbells), noting its end; returns whether it
    /// has ended.
    fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        loop {
            match (&self.ctl).read(&mut buf) {
                Ok(0) => break self.gone.store(true, Ordering::Release),
                Ok(n) => {
                    if buf[..n].contains(&MAPPED) {
                        lock(&self.names).clear();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => break self.gone.store(true, Ordering::Release),
            }
        }
        self.gone.load(Ordering::Acquire)
    }
}

/// The smallest slice a writer offers for pulling, whatever it is configured with.
const PULL_FLOOR: usize = 4096;

/// A link over a [`Pair`].
struct ShmLink {
    pair: Arc<Pair>,
    /// Bytes put in `tx` (our `head` of it).
    head: u64,
    /// Bytes taken from `rx` (our `tail` of it).
    tail: u64,
    /// Bytes written and read, ring and single copy alike ([`Link::raw_counts`]).
    sent: u64,
    received: u64,
    closed: bool,
    /// Single copy ([`crate::config::ShmOptions::single_copy_min`]; 0: off): the
    /// smallest slice this rank offers for pulling, and what it knows of pulling.
    single_copy_min: usize,
    /// The writer's side: the descriptor out, and what its slices have taken in all.
    posted: Option<Posted>,
    offered: u64,
    /// The reader's side: whether it has tried to open the writer (a reader that does
    /// not pull never does: a writer posts only to a reader that said it can), what it
    /// opened, the descriptor it last read (by sequence) and what it has pulled in all.
    probed: bool,
    remote: Option<crate::sys::cma::Remote>,
    desc: Desc,
    pulled: u64,
}

/// A descriptor as the writer posted it (see [`layout::DESC_SEQ`]).
#[derive(Clone, Copy, Default)]
struct Desc {
    seq: u64,
    pos: u64,
    base: u64,
    len: u64,
    addr: u64,
}

/// The writer's descriptor out: `reported` of its `len` bytes were returned as
/// written (the reader had pulled them).
struct Posted {
    addr: u64,
    base: u64,
    len: u64,
    reported: u64,
}

impl ShmLink {
    fn new(pair: Arc<Pair>, single_copy_min: usize) -> Self {
        // Slices under a page always take the ring: frame headers and failure notices
        // live in buffers the engine lets go of before it shuts its links (a payload
        // lives until then), and a pull costs more than such a copy anyway.
        let single_copy_min = match single_copy_min {
            0 => 0,
            m => m.max(PULL_FLOOR),
        };
        ShmLink {
            pair,
            head: 0,
            tail: 0,
            sent: 0,
            received: 0,
            closed: false,
            single_copy_min,
            posted: None,
            offered: 0,
            probed: single_copy_min == 0,
            remote: None,
            desc: Desc::default(),
            pulled: 0,
        }
    }

    /// The writer: what the reader has pulled of the descriptor out since last asked,
    /// as bytes written (the descriptor is done once all are).
    fn pulled_of_posted(&mut self, bufs: &[IoSlice<'_>]) -> u64 {
        let Some(d) = &mut self.posted else { return 0 };
        let pulled = self.pair.tx.word(layout::PULLED).load(Ordering::Acquire);
        let done = pulled.saturating_sub(d.base).min(d.len);
        let new = done - d.reported;
        debug_assert!(
            new == 0
                || bufs
                    .iter()
                    .find(|b| !b.is_empty())
                    .is_some_and(|b| b.as_ptr() as u64 == d.addr + d.reported),
            "a write resumed elsewhere than where its descriptor was"
        );
        d.reported = done;
        if done == d.len {
            self.offered = d.base + d.len;
            self.posted = None;
        }
        new
    }

    /// Whether the reader of `tx` has gone (closed its end, or its connection ended).
    fn peer_closed(&self) -> bool {
        let p = &*self.pair;
        p.gone.load(Ordering::Acquire)
            || p.tx.word(layout::READER_CLOSED).load(Ordering::Acquire) != 0
    }

    /// The reader: the writer's descriptor if it has bytes not pulled yet.
    /// A new descriptor must start where the reader has pulled to, at or after where
    /// it has read the ring to, and hold bytes: anything else is a peer that broke the
    /// protocol, a typed error rather than arithmetic on its numbers.
    fn active_desc(&mut self) -> std::result::Result<Option<Desc>, LinkError> {
        let rx = &self.pair.rx;
        let seq = rx.word(layout::DESC_SEQ).load(Ordering::Acquire);
        if seq != self.desc.seq && seq.is_multiple_of(2) {
            let d = Desc {
                seq,
                pos: rx.word(layout::DESC_POS).load(Ordering::Relaxed),
                base: rx.word(layout::DESC_BASE).load(Ordering::Relaxed),
                len: rx.word(layout::DESC_LEN).load(Ordering::Relaxed),
                addr: rx.word(layout::DESC_ADDR).load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            // A torn read (the writer rewrote it meanwhile) is read again next call.
            if rx.word(layout::DESC_SEQ).load(Ordering::Relaxed) == seq {
                if d.base != self.pulled || d.pos < self.tail || d.len == 0 {
                    return Err(LinkError::Io(io::Error::other(format!(
                        "rank {}'s single-copy descriptor is inconsistent: {} bytes at \
                         stream {} after {} pulled, where this rank has pulled {} and \
                         read the ring to {}",
                        self.pair.peer, d.len, d.pos, d.base, self.pulled, self.tail
                    ))));
                }
                self.desc = d;
            }
        }
        let d = self.desc;
        // `pulled` starts at `base` (checked) and grows by at most `len`: neither
        // subtraction here or in `pull` wraps.
        Ok((d.seq != 0 && self.pulled - d.base < d.len).then_some(d))
    }

    /// The reader, once the writer has said who it is: whether this process can read
    /// its memory, told to the writer through [`layout::PULL`].
    fn probe_writer(&mut self) {
        let rx = &self.pair.rx;
        let pid = rx.word(layout::WRITER_PID).load(Ordering::Acquire);
        if pid == 0 {
            return;
        }
        self.probed = true;
        let (addr, value) = (
            rx.word(layout::COOKIE_ADDR).load(Ordering::Relaxed),
            rx.word(layout::COOKIE).load(Ordering::Relaxed),
        );
        match crate::sys::cma::Remote::open(pid as u32, addr, value) {
            Ok(r) => {
                self.remote = Some(r);
                rx.word(layout::PULL)
                    .store(layout::CAN_PULL, Ordering::Release);
            }
            Err(e) => {
                tracing::info!(
                    "rank {}'s memory cannot be read from here ({e}): its frames come \
                     through the ring",
                    self.pair.peer
                );
                rx.word(layout::PULL)
                    .store(layout::CANNOT_PULL, Ordering::Release);
            }
        }
    }

    /// The reader: pulls what `bufs` take of descriptor `d` (whose stream position
    /// the ring has reached) from the writer's memory.
    fn pull(
        &mut self,
        d: Desc,
        bufs: &mut [IoSliceMut<'_>],
    ) -> std::result::Result<u64, LinkError> {
        let p = &*self.pair;
        let revoked = || {
            p.gone.load(Ordering::Acquire)
                || p.rx.word(layout::WRITER_CLOSED).load(Ordering::SeqCst) != 0
        };
        let Some(remote) = &self.remote else {
            return Err(LinkError::Io(io::Error::other(
                "the peer offered its memory to a reader that cannot read it",
            )));
        };
        if revoked() {
            return Err(LinkError::Closed);
        }
        let mut want = d.len - (self.pulled - d.base);
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            if want == 0 {
                break;
            }
            let take = (b.len() as u64).min(want) as usize;
            if take > 0 {
                slices.push(IoSliceMut::new(&mut b[..take]));
                want -= take as u64;
            }
        }
        if slices.is_empty() {
            return Ok(0);
        }
        let n = match remote.read(d.addr.wrapping_add(self.pulled - d.base), &mut slices) {
            Ok(n) if n > 0 => n as u64,
            Ok(_) | Err(_) if remote.exited() => return Err(LinkError::Closed),
            Ok(_) => {
                return Err(LinkError::Io(io::Error::other(
                    "the peer's offered memory ended before its descriptor did",
                )))
            }
            Err(e) => return Err(LinkError::Io(e)),
        };
        // Bytes the writer took back meanwhile (it failed, and its caller may have
        // reused the buffer), or from a process that died (its pid may name another
        // one now), are thrown away: the writer's `SeqCst` close before it lets go of
        // the buffer is seen here if any byte could have changed under the copy.
        fence(Ordering::SeqCst);
        if revoked() || remote.exited() {
            return Err(LinkError::Closed);
        }
        self.pulled += n;
        p.rx.word(layout::PULLED)
            .store(self.pulled, Ordering::Release);
        p.ring_if_asleep(p.rx.word(layout::WRITER_ASLEEP));
        Ok(n)
    }
}

/// The writer: offers `b` (all of it) for the reader to pull from stream position
/// `head`, after `offered` bytes offered before.
fn post(p: &Pair, head: u64, offered: u64, b: &[u8]) -> Posted {
    let tx = &p.tx;
    let seq = tx.word(layout::DESC_SEQ).load(Ordering::Relaxed);
    tx.word(layout::DESC_SEQ).store(seq + 1, Ordering::Relaxed);
    fence(Ordering::Release);
    tx.word(layout::DESC_POS).store(head, Ordering::Relaxed);
    tx.word(layout::DESC_BASE).store(offered, Ordering::Relaxed);
    tx.word(layout::DESC_LEN)
        .store(b.len() as u64, Ordering::Relaxed);
    tx.word(layout::DESC_ADDR)
        .store(b.as_ptr() as u64, Ordering::Relaxed);
    tx.word(layout::DESC_SEQ).store(seq + 2, Ordering::Release);
    p.ring_if_asleep(tx.word(layout::READER_ASLEEP));
    Posted {
        addr: b.as_ptr() as u64,
        base: offered,
        len: b.len() as u64,
        reported: 0,
    }
}

impl Link for ShmLink {
    fn peer(&self) -> usize {
        self.pair.peer
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::result::Result<usize, LinkError> {
        if self.posted.is_some() && !self.closed {
            // What the reader pulled counts as written even if it has closed since (it
            // may be done with this link); nothing after the descriptor's bytes may go
            // before they are all pulled.
            let n = self.pulled_of_posted(bufs);
            self.sent += n;
            return match n {
                0 if self.peer_closed() => Err(LinkError::Closed),
                n => Ok(n as usize),
            };
        }
        if self.closed || self.peer_closed() {
            return Err(LinkError::Closed);
        }
        let p = &*self.pair;
        let pull = self.single_copy_min > 0
            && p.tx.word(layout::PULL).load(Ordering::Acquire) == layout::CAN_PULL;
        let tail = p.tx.word(layout::TAIL).load(Ordering::Acquire);
        let mut room = p.tx.cap - (self.head - tail);
        let mut pos = self.head;
        for b in bufs {
            if pull && b.len() >= self.single_copy_min {
                if pos == self.head {
                    self.posted = Some(post(p, self.head, self.offered, b));
                }
                break;
            }
            if room == 0 {
                break;
            }
            let take = (b.len() as u64).min(room);
            p.tx.put(pos, &b[..take as usize]);
            pos += take;
            room -= take;
        }
        let n = pos - self.head;
        if n > 0 {
            self.head = pos;
            self.sent += n;
            p.tx.word(layout::HEAD).store(pos, Ordering::Release);
            p.ring_if_asleep(p.tx.word(layout::READER_ASLEEP));
        }
        Ok(n as usize)
    }

    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> std::result::Result<usize, LinkError> {
        if !self.probed {
            self.probe_writer();
        }
        // Descriptors come only to a reader that proved it can pull (the default path
        // reads no header word of them).
        let desc = if self.remote.is_some() {
            self.active_desc()?
        } else {
            None
        };
        let p = &*self.pair;
        let mut head = p.rx.word(layout::HEAD).load(Ordering::Acquire);
        if head == self.tail && desc.is_none() {
            if !(self.closed
                || p.gone.load(Ordering::Acquire)
                || p.rx.word(layout::WRITER_CLOSED).load(Ordering::Acquire) != 0)
            {
                return Ok(0);
            }
            // Closed: but bytes published before the close are still to be read.
            head = p.rx.word(layout::HEAD).load(Ordering::Acquire);
            if head == self.tail {
                return Err(LinkError::Closed);
            }
        }
        // The ring's bytes come first, up to where a descriptor's bytes go.
        let limit = desc.map_or(head, |d| d.pos.min(head));
        let mut pos = self.tail;
        let mut used = 0; // bufs filled completely
        let mut part = 0; // bytes of bufs[used] filled
        for b in bufs.iter_mut() {
            if pos == limit {
                break;
            }
            let take = (b.len() as u64).min(limit - pos) as usize;
            p.rx.get(pos, &mut b[..take]);
            pos += take as u64;
            if take == b.len() {
                used += 1;
            } else {
                part = take;
                break;
            }
        }
        let mut n = pos - self.tail;
        if n > 0 {
            self.tail = pos;
            p.rx.word(layout::TAIL).store(pos, Ordering::Release);
            p.ring_if_asleep(p.rx.word(layout::WRITER_ASLEEP));
        }
        if let Some(d) = desc.filter(|d| d.pos == self.tail) {
            let rest = &mut bufs[used..];
            let r = match rest.split_first_mut() {
                None => Ok(0),
                Some((first, others)) if part > 0 => {
                    let mut v: Vec<IoSliceMut<'_>> = Vec::with_capacity(others.len() + 1);
                    v.push(IoSliceMut::new(&mut first[part..]));
                    v.extend(others.iter_mut().map(|b| IoSliceMut::new(&mut b[..])));
                    self.pull(d, &mut v)
                }
                Some(_) => self.pull(d, rest),
            };
            match r {
                Ok(m) => n += m,
                // Ring bytes read before it are this call's; the error comes next call.
                Err(_) if n > 0 => {}
                Err(e) => return Err(e),
            }
        }
        self.received += n;
        Ok(n as usize)
    }

    fn shutdown(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let p = &*self.pair;
        // On the lower rank, ring names the peer has not mapped yet stay for it to map
        // and remove, unless its connection says it never will.
        let gone = p.drain();
        let mut names = lock(&p.names);
        if gone && !names.is_empty() {
            unlink_names(&names);
            names.clear();
        }
        drop(names);
        // `SeqCst`: a reader pulling from a descriptor of ours sees this before this
        // rank's caller may reuse the buffer (see `ShmLink::pull`).
        p.tx.word(layout::WRITER_CLOSED).store(1, Ordering::SeqCst);
        p.rx.word(layout::READER_CLOSED).store(1, Ordering::Release);
        // The end of stream wakes the peer wherever it sleeps.
        let _ = p.ctl.shutdown(std::net::Shutdown::Both);
    }

    fn raw_counts(&self) -> (u64, u64) {
        (self.sent, self.received)
    }

    fn class(&self) -> &'static str {
        "shm"
    }
}

impl Drop for ShmLink {
    /// Shuts the link down; the waiter forgets the pair at its next wait.
    fn drop(&mut self) {
        self.shutdown();
    }
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
}

/// Makes shared-memory links to ranks of this host and TCP links to the others.
struct ShmConnector {
    tcp: TcpConnector,
    rank: usize,
    world_size: usize,
    comm_id: u64,
    strict: bool,
    ring_bytes: usize,
    /// [`crate::config::ShmOptions::single_copy_min`].
    single_copy_min: usize,
    /// This rank's [`host_identity`].
    me: String,
    /// Whether each peer asked about so far is on this host.
    same_host: HashMap<usize, bool>,
    pairs: Arc<Mutex<Vec<Arc<Pair>>>>,
}

/// Says in the ring this rank writes who it is for single copy (its pid and cookie),
/// unless this process cannot let peers read its memory (said once).
fn offer_memory(tx: &Ring, rank: usize) {
    static ALLOWED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    match ALLOWED.get_or_init(crate::sys::cma::allow_peers) {
        Ok(()) => {
            let (addr, value) = crate::sys::cma::cookie();
            tx.word(layout::COOKIE_ADDR).store(addr, Ordering::Relaxed);
            tx.word(layout::COOKIE).store(value, Ordering::Relaxed);
            tx.word(layout::WRITER_PID)
                .store(u64::from(std::process::id()), Ordering::Release);
        }
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::info!("rank {rank}: no single copy within the host ({e}); frames go through the rings")
            });
        }
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
    /// Whether `peer` is on this host (asked through the store once).
    fn same_host(&mut self, peer: usize, deadline: Instant) -> Result<bool> {
        if let Some(&s) = self.same_host.get(&peer) {
            return Ok(s);
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let theirs = self
            .tcp
            .store()
            .get(&format!("host/{peer}"), wait)
            .map_err(|e| {
                Error::Rendezvous(format!(
                    "rank {}: rank {peer} did not publish which host it is on within {wait:?}: \
                     has it started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE? ({e})",
                    self.rank
                ))
            })?;
        let same = theirs == self.me.as_bytes();
        if !same && self.strict {
            return Err(Error::Unavailable {
                what: "transport shm".into(),
                why: format!(
                    "rank {peer} is on another host (it says {:?}; rank {} is on {:?}): \
                     use --transport auto or tcp",
                    String::from_utf8_lossy(&theirs),
                    self.rank,
                    self.me
                ),
            });
        }
        self.same_host.insert(peer, same);
        Ok(same)
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
        let me = self.rank;
        if peer > me {
            let pid = std::process::id();
            let mut tx =
                Ring::create(&ring_name(self.comm_id, pid, me, peer, ch), self.ring_bytes)?;
            let mut rx =
                Ring::create(&ring_name(self.comm_id, pid, peer, me, ch), self.ring_bytes)?;
            // From here the names are the peer's to remove once it has mapped them
            // (even if this rank is done with the link first), or ours when the peer is
            // known never to (`ShmLink::drop`).
            tx.seg.disown();
            rx.seg.disown();
            let mut offer = [0u8; OFFER_LEN];
            offer[..4].copy_from_slice(&OFFER_MAGIC);
            offer[4..8].copy_from_slice(&pid.to_le_bytes());
            offer[8..16].copy_from_slice(&(self.ring_bytes as u64).to_le_bytes());
            s.write_all(&offer)
                .map_err(|e| io("sending the offer", e))?;
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
        let (tx_name, rx_name) = (
            ring_name(self.comm_id, pid, me, peer, ch),
            ring_name(self.comm_id, pid, peer, me, ch),
        );
        let rings = Ring::open(&tx_name, cap).and_then(|tx| Ok((tx, Ring::open(&rx_name, cap)?)));
        // Mapped or not, the names go: nobody else may attach, nothing is left behind.
        unlink_names(&[tx_name, rx_name]);
        let rings = rings.map_err(hs)?;
        // Best effort: a lower rank that already finished and left reads nothing more.
        let _ = s.write_all(&[MAPPED]);
        Ok(rings)
    }
}

impl Connector for ShmConnector {
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> Result<Box<dyn Link>> {
        super::check_peer(self.rank, peer, self.world_size)?;
        if !self.same_host(peer, deadline)? {
            return self.tcp.connect(peer, channel, deadline);
        }
        let mut s = self.tcp.stream(peer, channel, deadline)?;
        let (tx, rx) = self.link_rings(&mut s, peer, channel, deadline)?;
        let ctl = self.tcp.register(s, peer, channel)?;
        let names = if peer > self.rank {
            let pid = std::process::id();
            vec![
                ring_name(self.comm_id, pid, self.rank, peer, channel),
                ring_name(self.comm_id, pid, peer, self.rank, channel),
            ]
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
            Channel::Collective => self.single_copy_min,
            _ => 0,
        };
        if min > 0 {
            offer_memory(&pair.tx, self.rank);
        }
        Ok(Box::new(ShmLink::new(pair, min)))
    }

    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        self.tcp.peer_status(peer, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_host_identity_names_the_namespaces() {
        let id = host_identity();
        assert!(id.contains("net:["), "{id}");
        assert!(id.contains("ipc:["), "{id}");
        assert_eq!(id, host_identity(), "stable");
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

    /// Two links of one process joined by two rings of `cap` bytes and a loopback TCP
    /// connection, each offering its memory for single copy from `min` bytes (0: off).
    fn linked(cap: usize, min: usize) -> (ShmLink, ShmLink) {
        linked_with(cap, min, min)
    }

    /// [`linked`] with single copy from `a_min` bytes on the first link and `b_min` on
    /// the second.
    fn linked_with(cap: usize, a_min: usize, b_min: usize) -> (ShmLink, ShmLink) {
        use std::sync::atomic::AtomicU64;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = |d: &str| format!("/ferroccl-test-pull-{}-{id}-{d}", std::process::id());
        let (ab, ba) = (name("ab"), name("ba"));
        let (ab_w, ba_w) = (
            Ring::create(&ab, cap).unwrap(),
            Ring::create(&ba, cap).unwrap(),
        );
        let (ab_r, ba_r) = (Ring::open(&ab, cap).unwrap(), Ring::open(&ba, cap).unwrap());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a_ctl = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let b_ctl = l.accept().unwrap().0;
        let ctl = |s: TcpStream| {
            s.set_nonblocking(true).unwrap();
            mio::net::TcpStream::from_std(s)
        };
        let pair = |peer, tx, rx, s| {
            Arc::new(Pair {
                peer,
                tx,
                rx,
                ctl: ctl(s),
                gone: AtomicBool::new(false),
                names: Mutex::new(Vec::new()),
            })
        };
        let (a, b) = (pair(1, ab_w, ba_r, a_ctl), pair(0, ba_w, ab_r, b_ctl));
        if a_min > 0 {
            offer_memory(&a.tx, 0);
        }
        if b_min > 0 {
            offer_memory(&b.tx, 1);
        }
        (ShmLink::new(a, a_min), ShmLink::new(b, b_min))
    }

    /// Writes all of `bufs` (retrying while the reader pulls, `read` called between
    /// tries), returning what each call moved.
    fn write_all(w: &mut ShmLink, bufs: &[&[u8]], mut read: impl FnMut()) -> Vec<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let (mut done, mut moves) = (0, Vec::new());
        while done < total {
            // Each round the reader takes what it can: a stall is a failure, not a hang.
            assert!(
                moves.len() < 100_000,
                "the write stalled at {done} of {total}"
            );
            let mut skip = done;
            let slices: Vec<IoSlice<'_>> = bufs
                .iter()
                .filter_map(|b| {
                    let k = skip.min(b.len());
                    skip -= k;
                    (k < b.len()).then(|| IoSlice::new(&b[k..]))
                })
                .collect();
            let n = w.try_write(&slices).unwrap();
            done += n;
            moves.push(n);
            read();
        }
        moves
    }

    #[test]
    fn a_large_slice_is_pulled_from_the_writers_memory_in_order_with_the_ring_bytes() {
        let (mut w, mut r) = linked(4096, 1000);
        let head: Vec<u8> = (0..40u8).collect();
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let tail = b"after".to_vec();
        let mut got = Vec::new();
        // The reader takes what comes in pieces of 7000 bytes split over two buffers.
        let read = |r: &mut ShmLink, got: &mut Vec<u8>| {
            let (mut x, mut y) = ([0u8; 3000], [0u8; 4000]);
            let n = r
                .try_read(&mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)])
                .unwrap();
            got.extend_from_slice(&x[..n.min(3000)]);
            got.extend_from_slice(&y[..n.saturating_sub(3000)]);
        };
        // The first read finds the writer's pid and proves it can read its memory.
        read(&mut r, &mut got);
        assert_eq!(
            r.pair.rx.word(layout::PULL).load(Ordering::Acquire),
            layout::CAN_PULL
        );
        let moves = write_all(&mut w, &[&head, &body, &tail], || read(&mut r, &mut got));
        for _ in 0..1000 {
            if got.len() >= 300_045 {
                break;
            }
            read(&mut r, &mut got);
        }
        let mut want = head.clone();
        want.extend_from_slice(&body);
        want.extend_from_slice(&tail);
        assert!(got == want, "the stream arrives whole and in order");
        // 40 ring bytes, then the body in pulls of at most 7000 bytes, then the tail.
        assert_eq!(moves[0], 40);
        assert!(moves.iter().all(|&m| m <= 7000 || m == 40), "{moves:?}");
        assert_eq!(
            r.pair.rx.word(layout::PULLED).load(Ordering::Acquire),
            300_000
        );
        assert_eq!(r.pair.rx.word(layout::HEAD).load(Ordering::Acquire), 45);
        assert_eq!(w.raw_counts(), (300_045, 0));
        assert_eq!(r.raw_counts(), (0, 300_045));
    }

    #[test]
    fn a_writer_that_shuts_down_takes_back_what_is_not_pulled() {
        let (mut w, mut r) = linked(4096, 1000);
        let mut buf = [0u8; 64];
        assert_eq!(r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
        let body = vec![9u8; 100_000];
        assert_eq!(w.try_write(&[IoSlice::new(b"abc")]).unwrap(), 3);
        assert_eq!(
            w.try_write(&[IoSlice::new(&body)]).unwrap(),
            0,
            "posted, not pulled"
        );
        // The writer fails (its caller may then reuse the buffer): bytes before the
        // descriptor still arrive, the descriptor's never do.
        w.shutdown();
        let mut big = vec![0u8; 200_000];
        assert_eq!(
            r.try_read(&mut [IoSliceMut::new(&mut big[..3])]).unwrap(),
            3
        );
        assert_eq!(&big[..3], b"abc");
        assert!(matches!(
            r.try_read(&mut [IoSliceMut::new(&mut big)]),
            Err(LinkError::Closed)
        ));
        assert_eq!(r.pair.rx.word(layout::PULLED).load(Ordering::Acquire), 0);
        assert!(big
            .iter()
            .all(|&b| b == 0 || b == b'a' || b == b'b' || b == b'c'));
    }

    #[test]
    fn a_descriptor_that_breaks_the_protocol_is_a_typed_error() {
        // Descriptors a writer could not have posted: bytes the reader has not reached
        // yet (base ahead of what it pulled), a position behind what it has read, no
        // bytes at all. Each is an error naming the peer, never arithmetic on them.
        for (pos, base, len) in [(0u64, 12_345u64, 100u64), (0, 0, 0), (0, u64::MAX, 2)] {
            let (mut w, mut r) = linked(4096, 1000);
            let mut buf = [0u8; 64];
            assert_eq!(r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
            assert_eq!(
                r.pair.rx.word(layout::PULL).load(Ordering::Acquire),
                layout::CAN_PULL
            );
            let tx = &w.pair.tx;
            tx.word(layout::DESC_POS).store(pos, Ordering::Relaxed);
            tx.word(layout::DESC_BASE).store(base, Ordering::Relaxed);
            tx.word(layout::DESC_LEN).store(len, Ordering::Relaxed);
            tx.word(layout::DESC_ADDR).store(8, Ordering::Relaxed);
            tx.word(layout::DESC_SEQ).store(2, Ordering::Release);
            match r.try_read(&mut [IoSliceMut::new(&mut buf)]) {
                Err(LinkError::Io(e)) => {
                    assert!(e.to_string().contains("inconsistent"), "{e}")
                }
                other => panic!("({pos}, {base}, {len}): {other:?}"),
            }
            w.shutdown();
        }
        // Behind what the reader has read: 3 ring bytes read, then a descriptor at 0.
        let (mut w, mut r) = linked(4096, 1000);
        let mut buf = [0u8; 64];
        assert_eq!(r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
        assert_eq!(w.try_write(&[IoSlice::new(b"abc")]).unwrap(), 3);
        assert_eq!(r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 3);
        let tx = &w.pair.tx;
        tx.word(layout::DESC_LEN).store(100, Ordering::Relaxed);
        tx.word(layout::DESC_SEQ).store(2, Ordering::Release);
        assert!(matches!(
            r.try_read(&mut [IoSliceMut::new(&mut buf)]),
            Err(LinkError::Io(_))
        ));
    }

    #[test]
    fn a_reader_that_cannot_read_the_writers_memory_gets_the_ring() {
        let (mut w, mut r) = linked(1 << 20, 1000);
        // A cookie that is not the writer's: the reader's proof fails.
        let c = r.pair.rx.word(layout::COOKIE);
        c.store(c.load(Ordering::Relaxed) ^ 4, Ordering::Relaxed);
        let mut buf = vec![0u8; 50_000];
        assert_eq!(r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
        assert_eq!(
            r.pair.rx.word(layout::PULL).load(Ordering::Acquire),
            layout::CANNOT_PULL
        );
        let body: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
        assert_eq!(
            w.try_write(&[IoSlice::new(&body)]).unwrap(),
            50_000,
            "through the ring"
        );
        assert_eq!(
            r.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(),
            50_000
        );
        assert!(buf == body);
        // Single copy off on the reader's side: the writer offers, the reader never
        // says it can pull, and the writer's large slice goes through the ring.
        let (mut w2, mut r2) = linked_with(1 << 20, 1000, 0);
        assert_ne!(
            r2.pair.rx.word(layout::WRITER_PID).load(Ordering::Acquire),
            0
        );
        assert_eq!(r2.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
        assert_ne!(
            r2.pair.rx.word(layout::PULL).load(Ordering::Acquire),
            layout::CAN_PULL
        );
        assert_eq!(
            w2.try_write(&[IoSlice::new(&body)]).unwrap(),
            50_000,
            "through the ring"
        );
        buf.fill(0);
        assert_eq!(
            r2.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(),
            50_000
        );
        assert!(buf == body);
    }

    #[test]
    fn a_ring_wraps_and_keeps_order() {
        let name = format!("/ferroccl-test-ring-{}", std::process::id());
        let a = Ring::create(&name, 4096).unwrap();
        let b = Ring::open(&name, 4096).unwrap();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        b.put(3000, &data);
        let mut back = vec![0u8; 3000];
        a.get(3000, &mut back);
        assert_eq!(back, data, "a write across the end reads back");
        assert!(Ring::open(&name, 8192).is_err(), "a size it is not");
    }
}
