//! The ring of operations, dumps, and reading dumps back.

use super::{Line, LinkBytes, OpRecord, PeerWait, RankInfo, TRACE_DIR_ENV};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch on this machine's clock.
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Peers whose bytes and waits an operation's record keeps inline (a ring uses 2,
/// recursive doubling `log2 n + 1`); beyond, the ones with the most bytes or waiting.
pub(crate) const PEERS_KEPT: usize = 4;

/// Up to [`PEERS_KEPT`] per-peer entries `(peer, wait µs, a, b)`, inline: recording
/// allocates nothing.
#[derive(Clone, Copy, Default)]
pub(crate) struct PeerCounts {
    len: u8,
    e: [(u32, u32, u64, u64); PEERS_KEPT],
}

impl PeerCounts {
    fn entry(&mut self, peer: usize, weight: u64) -> Option<&mut (u32, u32, u64, u64)> {
        let n = self.len as usize;
        if let Some(i) = self.e[..n].iter().position(|x| x.0 == peer as u32) {
            return Some(&mut self.e[i]);
        }
        if n < PEERS_KEPT {
            self.e[n] = (peer as u32, 0, 0, 0);
            self.len += 1;
            return Some(&mut self.e[n]);
        }
        // Full: a new peer replaces the smallest entry if it weighs more.
        let min = self
            .e
            .iter_mut()
            .min_by_key(|x| x.2 + x.3 + u64::from(x.1))?;
        if weight > min.2 + min.3 + u64::from(min.1) {
            *min = (peer as u32, 0, 0, 0);
            return Some(min);
        }
        None
    }

    /// Adds `(a, b)` to `peer`'s entry.
    pub fn add(&mut self, peer: usize, a: u64, b: u64) {
        if let Some(x) = self.entry(peer, a + b) {
            x.2 += a;
            x.3 += b;
        }
    }

    /// Adds `us` microseconds of waiting to `peer`'s entry.
    pub fn add_wait_us(&mut self, peer: usize, us: u64) {
        if let Some(x) = self.entry(peer, us) {
            x.1 = x.1.saturating_add(us.min(u32::MAX as u64) as u32);
        }
    }

    pub fn get(&self, peer: usize) -> Option<(u64, u64)> {
        self.e[..self.len as usize]
            .iter()
            .find(|x| x.0 == peer as u32)
            .map(|x| (x.2, x.3))
    }

    /// `(peer, a, b, wait µs)`.
    pub fn iter(&self) -> impl Iterator<Item = (usize, u64, u64, u64)> + '_ {
        self.e[..self.len as usize]
            .iter()
            .map(|x| (x.0 as usize, x.2, x.3, u64::from(x.1)))
    }
}

/// Turns the codes of a [`RecHead`] into names: kind, dtype, op, algorithm (the
/// engine supplies it; the recorder knows no wire format).
pub(crate) type Names = fn(
    u8,
    u8,
    u8,
    u8,
) -> (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
);

/// The call an operation made and when it started, as codes: what the recorder holds
/// while it runs (small, so that recording copies little).
#[derive(Clone, Copy)]
pub(crate) struct RecHead {
    pub seq: u64,
    pub count: u64,
    pub enqueue_ns: u64,
    pub start_ns: u64,
    /// `u32::MAX`: none.
    pub root: u32,
    pub kind: u8,
    pub dtype: u8,
    /// 255: none.
    pub op: u8,
    pub algo: u8,
}

/// One operation as recorded, turned into an [`OpRecord`] only when dumped.
#[derive(Clone)]
struct Rec {
    head: RecHead,
    /// 0 while running.
    end_ns: u64,
    /// The error's text; `None` when it succeeded (or still runs).
    error: Option<Box<str>>,
    /// `u32::MAX`: none.
    waiting_on: u32,
    /// (peer, wait µs, sent, received).
    peers: PeerCounts,
}

impl Rec {
    fn running(head: RecHead, waiting_on: u32) -> Self {
        Rec {
            head,
            end_ns: 0,
            error: None,
            waiting_on,
            peers: PeerCounts::default(),
        }
    }

    fn to_record(&self, names: Names) -> OpRecord {
        let h = &self.head;
        let (kind, dtype, op, algo) = names(h.kind, h.dtype, h.op, h.algo);
        OpRecord {
            seq: h.seq,
            kind: kind.into(),
            dtype: dtype.into(),
            count: h.count,
            op: op.map(Into::into),
            root: (h.root != u32::MAX).then_some(h.root),
            algo: algo.into(),
            enqueue_ns: h.enqueue_ns,
            start_ns: h.start_ns,
            end_ns: (self.end_ns != 0).then_some(self.end_ns),
            outcome: match (&self.error, self.end_ns) {
                (Some(e), _) => e.to_string(),
                (None, 0) => "running".into(),
                (None, _) => "ok".into(),
            },
            waiting_on: (self.waiting_on != u32::MAX).then_some(self.waiting_on as usize),
            links: self
                .peers
                .iter()
                .filter(|&(_, s, r, _)| s > 0 || r > 0)
                .map(|(peer, sent, recv, _)| LinkBytes { peer, sent, recv })
                .collect(),
            waits: self
                .peers
                .iter()
                .filter(|&(_, _, _, w)| w > 0)
                .map(|(peer, _, _, us)| PeerWait {
                    peer,
                    ns: us * 1000,
                })
                .collect(),
        }
    }
}

/// What a dump needs besides the operations.
struct Ring {
    info: RankInfo,
    ops: VecDeque<Rec>,
    /// The operation in flight, if any.
    active: Option<RecHead>,
}

/// One communicator's flight recorder. Operations append under a lock held for one
/// push; a dump copies the ring under it and writes outside it.
pub(crate) struct Recorder {
    ring: Mutex<Ring>,
    names: Names,
    /// The peer the operation in flight waits on (`u32::MAX`: none), for a dump taken
    /// during a hang; set without the lock.
    waiting_on: AtomicU32,
}

impl Recorder {
    pub fn new(
        rank: usize,
        world_size: usize,
        transport: &str,
        capacity: usize,
        names: Names,
    ) -> Arc<Self> {
        let r = Arc::new(Recorder {
            ring: Mutex::new(Ring {
                info: RankInfo {
                    rank,
                    world_size,
                    host: hostname(),
                    pid: std::process::id(),
                    transport: transport.to_string(),
                    clock_offset_ns: 0,
                    clock_error_ns: None,
                    reason: String::new(),
                    capacity,
                    dropped: 0,
                    dumped_ns: 0,
                    comm: 0,
                    job_rank: None,
                },
                ops: VecDeque::with_capacity(capacity.min(4096)),
                active: None,
            }),
            waiting_on: AtomicU32::new(u32::MAX),
            names,
        });
        Registry::add(&r);
        r
    }

    /// Sets the clock offset to the reference clock (see [`RankInfo::clock_offset_ns`]).
    pub fn set_clock(&self, offset_ns: i64, error_ns: Option<u64>) {
        let mut g = lock(&self.ring);
        g.info.clock_offset_ns = offset_ns;
        g.info.clock_error_ns = error_ns;
    }

    /// Makes this the recorder of communicator `id` (0: the job's own), where this
    /// rank is job rank `job_rank`.
    pub fn set_group(&self, id: u64, job_rank: usize) {
        let mut g = lock(&self.ring);
        g.info.comm = id;
        g.info.job_rank = (id != 0).then_some(job_rank);
    }

    /// The operation in flight, for a dump taken while it runs. The engine says so
    /// only once an operation has waited a while (a short one ends before a dump could
    /// matter, and recording it costs no lock until it ends).
    pub fn running(&self, op: RecHead) {
        lock(&self.ring).active = Some(op);
    }

    /// The operation in flight now waits on `peer` (for a dump taken during a hang).
    pub fn waiting_on(&self, peer: usize) {
        self.waiting_on.store(peer as u32, Ordering::Relaxed);
    }

    /// The operation in flight ended: complete its record and keep it.
    pub fn end(
        &self,
        head: RecHead,
        error: Option<Box<str>>,
        waiting_on: Option<usize>,
        peers: PeerCounts,
    ) {
        let end = now_ns();
        self.waiting_on.store(u32::MAX, Ordering::Relaxed);
        let mut g = lock(&self.ring);
        g.active = None;
        let op = Rec {
            head,
            end_ns: end.max(1),
            error,
            waiting_on: waiting_on.map_or(u32::MAX, |p| p as u32),
            peers,
        };
        if g.info.capacity == 0 {
            g.info.dropped += 1;
            return;
        }
        if g.ops.len() == g.info.capacity {
            g.ops.pop_front();
            g.info.dropped += 1;
        }
        g.ops.push_back(op);
    }

    /// The ring as the lines of a trace file, oldest operation first (the one in
    /// flight, if any, last, as `running`).
    pub fn snapshot(&self, reason: &str) -> Vec<Line> {
        let g = lock(&self.ring);
        let mut info = g.info.clone();
        info.reason = reason.to_string();
        info.dumped_ns = now_ns();
        let mut lines = Vec::with_capacity(g.ops.len() + 2);
        lines.push(Line::Rank(info));
        lines.extend(g.ops.iter().map(|r| Line::Op(r.to_record(self.names))));
        if let Some(a) = g.active {
            let a = Rec::running(a, self.waiting_on.load(Ordering::Relaxed));
            lines.push(Line::Op(a.to_record(self.names)));
        }
        lines
    }

    /// Writes the ring to `dir/rank-<rank>.jsonl` (a child communicator's to
    /// `dir/comm-<id>/rank-<rank>.jsonl`; atomically: a temporary file renamed into
    /// place). Returns the path.
    pub fn dump(&self, dir: &Path, reason: &str) -> Result<PathBuf> {
        let lines = self.snapshot(reason);
        let (rank, comm) = match &lines[0] {
            Line::Rank(i) => (i.rank, i.comm),
            Line::Op(_) => (0, 0),
        };
        let sub;
        let dir = if comm == 0 {
            dir
        } else {
            sub = dir.join(format!("comm-{comm:016x}"));
            &sub
        };
        let mut text = String::new();
        for l in &lines {
            // Serialising these plain records cannot fail.
            text.push_str(&serde_json::to_string(l).unwrap_or_default());
            text.push('\n');
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating trace directory {}", dir.display()), e))?;
        let path = dir.join(format!("rank-{rank}.jsonl"));
        // Unique per dump: a failure dump and a signal dump of one rank may overlap.
        static DUMPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let k = DUMPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".rank-{rank}.jsonl.{}.{k}.tmp", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| Error::io(format!("writing trace {}", path.display()), e))?;
        Ok(path)
    }

    /// Dumps into `FERROCCL_TRACE_DIR` if it is set (failures are logged, not
    /// returned: a dump must never change what the caller sees).
    pub fn dump_to_env_dir(&self, reason: &str) {
        if let Some(dir) = env_dir() {
            match self.dump(&dir, reason) {
                Ok(p) => tracing::debug!("flight recorder dumped to {}", p.display()),
                Err(e) => tracing::warn!("flight recorder dump failed: {e}"),
            }
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        Registry::prune();
    }
}

/// `FERROCCL_TRACE_DIR`, if set and not empty.
pub(crate) fn env_dir() -> Option<PathBuf> {
    std::env::var_os(TRACE_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Every live recorder of the process, for dumps on a signal and at exit.
pub(crate) struct Registry;

static REGISTRY: Mutex<Vec<Weak<Recorder>>> = Mutex::new(Vec::new());

impl Registry {
    fn add(r: &Arc<Recorder>) {
        lock(&REGISTRY).push(Arc::downgrade(r));
        super::signal::install();
    }

    fn prune() {
        if let Ok(mut g) = REGISTRY.try_lock() {
            g.retain(|w| w.strong_count() > 0);
        }
    }

    /// Dumps every live recorder into `dir`; returns how many were written.
    pub fn dump_all(dir: &Path, reason: &str) -> usize {
        let live: Vec<Arc<Recorder>> = lock(&REGISTRY).iter().filter_map(Weak::upgrade).collect();
        let mut written = 0;
        for r in live {
            match r.dump(dir, reason) {
                Ok(_) => written += 1,
                Err(e) => tracing::warn!("flight recorder dump failed: {e}"),
            }
        }
        written
    }
}

/// One rank's trace file, read back.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    /// The file's first line.
    pub info: RankInfo,
    /// Its operations, oldest first.
    pub ops: Vec<OpRecord>,
    /// Where it was read from.
    pub path: PathBuf,
}

/// Reads one rank's trace file. A malformed line is an error naming the file and line.
pub fn read_file(path: &Path) -> Result<RankTrace> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading trace {}", path.display()), e))?;
    let bad = |line: usize, what: String| {
        Error::InvalidArgument(format!("trace {} line {line}: {what}", path.display()))
    };
    let mut info = None;
    let mut ops = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(l).map_err(|e| bad(i + 1, e.to_string()))?;
        match (line, &info) {
            (Line::Rank(r), None) => info = Some(r),
            (Line::Rank(_), Some(_)) => return Err(bad(i + 1, "a second rank header".into())),
            (Line::Op(_), None) => {
                return Err(bad(i + 1, "an operation before the rank header".into()))
            }
            (Line::Op(o), Some(_)) => ops.push(o),
        }
    }
    let info = info.ok_or_else(|| bad(1, "empty file (no rank header)".into()))?;
    Ok(RankTrace {
        info,
        ops,
        path: path.to_path_buf(),
    })
}

/// Reads every `rank-*.jsonl` in `dir`, sorted by rank. Two files of one rank, or no
/// file at all, are errors.
pub fn read_dir(dir: &Path) -> Result<Vec<RankTrace>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("reading trace directory {}", dir.display()), e))?;
    let mut out: Vec<RankTrace> = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("rank-") && name.ends_with(".jsonl") {
            out.push(read_file(&e.path())?);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "no rank-*.jsonl trace files in {}",
            dir.display()
        )));
    }
    out.sort_by_key(|t| t.info.rank);
    for w in out.windows(2) {
        if w[0].info.rank == w[1].info.rank {
            return Err(Error::InvalidArgument(format!(
                "{} and {} are both rank {}",
                w[0].path.display(),
                w[1].path.display(),
                w[0].info.rank
            )));
        }
    }
    Ok(out)
}
