//! The ring of operations, dumps, and reading dumps back.

use super::{Line, LinkBytes, OpRecord, PeerWait, RankInfo, TRACE_DIR_ENV};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch on this machine's clock.
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// What a dump needs besides the operations.
struct Ring {
    info: RankInfo,
    ops: VecDeque<OpRecord>,
    /// The operation in flight, if any.
    active: Option<OpRecord>,
}

/// One communicator's flight recorder. Operations append under a lock held for one
/// push; a dump copies the ring under it and writes outside it.
pub(crate) struct Recorder {
    ring: Mutex<Ring>,
}

impl Recorder {
    pub fn new(rank: usize, world_size: usize, transport: &str, capacity: usize) -> Arc<Self> {
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
                },
                ops: VecDeque::with_capacity(capacity.min(4096)),
                active: None,
            }),
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

    /// An operation started.
    pub fn begin(&self, op: OpRecord) {
        lock(&self.ring).active = Some(op);
    }

    /// The operation in flight now waits on `peer` (for a dump taken during a hang).
    pub fn waiting_on(&self, peer: usize) {
        if let Some(a) = lock(&self.ring).active.as_mut() {
            a.waiting_on = Some(peer);
        }
    }

    /// The operation in flight ended: complete its record and keep it.
    pub fn end(
        &self,
        outcome: String,
        waiting_on: Option<usize>,
        links: Vec<LinkBytes>,
        waits: Vec<PeerWait>,
    ) {
        let end = now_ns();
        let mut g = lock(&self.ring);
        let Some(mut op) = g.active.take() else {
            return;
        };
        op.end_ns = Some(end);
        op.outcome = outcome;
        op.waiting_on = waiting_on;
        op.links = links;
        op.waits = waits;
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
        lines.extend(g.ops.iter().cloned().map(Line::Op));
        if let Some(a) = &g.active {
            let mut a = a.clone();
            a.outcome = "running".into();
            lines.push(Line::Op(a));
        }
        lines
    }

    /// Writes the ring to `dir/rank-<rank>.jsonl` (atomically: a temporary file renamed
    /// into place). Returns the path.
    pub fn dump(&self, dir: &Path, reason: &str) -> Result<PathBuf> {
        let lines = self.snapshot(reason);
        let rank = match &lines[0] {
            Line::Rank(i) => i.rank,
            Line::Op(_) => 0,
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
