//! The engine: a rank's links and the one progress loop every algorithm runs on.
//!
//! An algorithm describes its traffic as two ordered lists — frames to send ([`Out`])
//! and frames to receive ([`In`]) — with the dependencies between them: a frame may
//! leave only after some frame has arrived (it forwards that data), and a frame may
//! land in the buffer only after some frame has left (it overwrites that data).
//! [`Engine::stream`] moves both lists as far as the links allow, calls the algorithm
//! back as each frame arrives (to reduce it, for example), and sleeps only when nothing
//! can move. Algorithms never see a socket; transports never see a schedule.

use crate::comm::Config;
use crate::error::{Error, Result};
use crate::transport::{Beacon, Channel, Connector, LinkError, Links, Waiter};
use crate::wire::{
    Fingerprint, FrameError, FrameHeader, InFrame, OpKind, OutFrame, Peer, WireStats,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest single sleep in a wait: bounds how late an abort is noticed.
const MAX_WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a timed-out rank spends asking its peers where they are.
const STATUS_BUDGET: Duration = Duration::from_secs(2);
/// Peers asked at most, after a timeout (the ones waited on first).
const STATUS_MAX_PEERS: usize = 64;

/// A frame to send: `len` bytes at `off` in the operation's buffer.
#[derive(Clone, Debug)]
pub(crate) struct Out {
    pub peer: usize,
    pub step: u32,
    pub seg: u32,
    pub off: usize,
    pub len: usize,
    /// Index of the receive that must complete first (the data this frame forwards).
    pub after_recv: Option<usize>,
}

/// Where a received frame lands.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dst {
    /// Straight into the operation's buffer at this offset.
    Buf(usize),
    /// Into the engine's scratch; the callback consumes it before the next receive.
    Scratch,
}

/// A frame to receive.
#[derive(Clone, Debug)]
pub(crate) struct In {
    pub peer: usize,
    pub step: u32,
    pub seg: u32,
    pub len: usize,
    pub dst: Dst,
    /// Index of the send that must complete first (the bytes this frame overwrites).
    pub after_send: Option<usize>,
}

/// A rank's links, per channel, and the state shared by the operations on them.
pub(crate) struct Engine {
    pub rank: usize,
    pub world_size: usize,
    pub cfg: Config,
    links: [Vec<Option<Peer>>; 2],
    pub waiter: Box<dyn Waiter>,
    connector: Box<dyn Connector>,
    /// What this rank is doing, for peers that ask.
    beacon: Arc<Beacon>,
    /// Set by [`crate::comm::AbortHandle::abort`] from any thread.
    pub abort: Arc<AtomicBool>,
    /// Receive buffer for frames that are reduced rather than stored.
    pub scratch: Vec<u64>,
    /// A second buffer, for an algorithm that must hold a received frame past the
    /// next receive (recursive doubling); kept to avoid allocating per operation.
    pub spare: Vec<u64>,
    pub poisoned: Option<String>,
}

fn ch_index(ch: Channel) -> usize {
    match ch {
        Channel::Collective => 0,
        // Status queries never become links (the transport answers them itself).
        Channel::P2p | Channel::Status => 1,
    }
}

impl Engine {
    pub fn new(cfg: Config, links: Links) -> Self {
        let n = cfg.world_size;
        Engine {
            rank: cfg.rank,
            world_size: n,
            links: [
                (0..n).map(|_| None).collect(),
                (0..n).map(|_| None).collect(),
            ],
            waiter: links.waiter,
            connector: links.connector,
            beacon: links.beacon,
            abort: Arc::new(AtomicBool::new(false)),
            scratch: Vec::new(),
            spare: Vec::new(),
            poisoned: None,
            cfg,
        }
    }

    /// Makes the link to `peer` on `ch` now (if it does not exist yet).
    pub fn connect(&mut self, ch: Channel, peer: usize, deadline: Instant) -> Result<()> {
        if self.links[ch_index(ch)][peer].is_none() {
            let link = self.connector.connect(peer, ch, deadline)?;
            self.links[ch_index(ch)][peer] = Some(Peer {
                link,
                stats: WireStats::default(),
            });
        }
        Ok(())
    }

    /// The link to `peer` on `ch`, connecting it first if needed.
    pub fn link(&mut self, ch: Channel, peer: usize) -> Result<&mut Peer> {
        if self.links[ch_index(ch)][peer].is_none() {
            let deadline = Instant::now() + self.cfg.connect_timeout;
            self.connect(ch, peer, deadline)?;
        }
        self.links[ch_index(ch)][peer]
            .as_mut()
            .ok_or_else(|| Error::Config(format!("rank {} has no link to rank {peer}", self.rank)))
    }

    /// Byte counts over all links and channels.
    pub fn wire_stats(&self) -> WireStats {
        let mut s = WireStats::default();
        for p in self.links.iter().flatten().flatten() {
            s.add(&p.stats);
        }
        s
    }

    /// What the links themselves counted, written and read.
    pub fn raw_byte_counts(&self) -> (u64, u64) {
        self.links
            .iter()
            .flatten()
            .flatten()
            .map(|p| p.link.raw_counts())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Runs one operation: fails fast if poisoned, and poisons on any failure (the
    /// peers of a failed operation are out of step with this rank).
    pub fn run(&mut self, op: impl FnOnce(&mut Engine) -> Result<()>) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Poisoned(why.clone()));
        }
        if self.abort.load(Ordering::Relaxed) {
            self.poison(format!("rank {} was aborted", self.rank));
            return Err(Error::Poisoned(format!("rank {} was aborted", self.rank)));
        }
        let r = op(self);
        if let Err(e) = &r {
            self.poison(e.to_string());
        }
        r
    }

    /// Marks the engine unusable and shuts every link so peers fail fast too.
    pub fn poison(&mut self, why: String) {
        if self.poisoned.is_none() {
            // The failure is returned to the caller, who reports it; log quietly.
            tracing::debug!(rank = self.rank, "communicator poisoned: {why}");
            self.poisoned = Some(why);
        }
        self.shutdown();
    }

    /// Closes every link.
    pub fn shutdown(&mut self) {
        for p in self.links.iter_mut().flatten().flatten() {
            p.link.shutdown();
        }
    }

    /// Grows the scratch buffer to at least `bytes`.
    pub fn scratch_bytes(&mut self, bytes: usize) {
        if self.scratch.len() * 8 < bytes {
            self.scratch = vec![0u64; bytes.div_ceil(8)];
        }
    }

    /// Moves `outs` and `ins` (see the module docs) over channel `ch` for the
    /// operation `fp`, with `base` the operation's buffer. `on_recv(i, data)` runs when
    /// receive `i` completes; `data` is the frame's payload when it landed in scratch (the
    /// callback may use it as workspace).
    ///
    /// # Safety
    /// `base` must be valid for every `off..off+len` the frames name, for the whole
    /// call, and nothing else may touch those bytes meanwhile. The dependency indices
    /// must make every concurrent read and write of the same bytes ordered.
    pub unsafe fn stream(
        &mut self,
        ch: Channel,
        fp: &Fingerprint,
        base: *mut u8,
        outs: &[Out],
        ins: &[In],
        on_recv: &mut dyn FnMut(usize, Option<&mut [u8]>),
    ) -> Result<()> {
        unsafe {
            self.beacon.set(fp.seq, fp.kind.code());
            let scratch_need = ins
                .iter()
                .filter(|i| matches!(i.dst, Dst::Scratch))
                .map(|i| i.len)
                .max()
                .unwrap_or(0);
            self.scratch_bytes(scratch_need);
            let mut scratch = std::mem::take(&mut self.scratch);
            let r = self.stream_inner(ch, fp, base, outs, ins, on_recv, &mut scratch);
            self.scratch = scratch;
            match r {
                Err(Error::Timeout {
                    rank,
                    op,
                    after,
                    waiting_for,
                    ..
                }) => {
                    let waited: Vec<usize> = outs
                        .iter()
                        .map(|o| o.peer)
                        .chain(ins.iter().map(|i| i.peer))
                        .collect();
                    let peers = self.where_are_peers(fp, &waited);
                    Err(Error::Timeout {
                        rank,
                        op,
                        after,
                        waiting_for,
                        peers,
                    })
                }
                r => r,
            }
        }
    }

    /// Asks the other ranks (those this operation waits on first) which operation
    /// each is in, within a short budget, and says it in one line: the answer to
    /// "which rank is hanging?".
    fn where_are_peers(&mut self, fp: &Fingerprint, waited: &[usize]) -> String {
        let n = self.world_size;
        if n == 1 {
            return "no other ranks".into();
        }
        let mut order: Vec<usize> = Vec::new();
        for &p in waited.iter().chain((0..n).collect::<Vec<_>>().iter()) {
            if p != self.rank && !order.contains(&p) {
                order.push(p);
            }
        }
        let skipped = order.len().saturating_sub(STATUS_MAX_PEERS);
        order.truncate(STATUS_MAX_PEERS);
        let deadline = Instant::now() + STATUS_BUDGET.min(self.cfg.timeout);
        let mut same = Vec::new();
        let mut parts = Vec::new();
        for p in order {
            match self.connector.peer_status(p, deadline) {
                Ok(Some((seq, kind))) if seq == fp.seq && kind == fp.kind.code() => same.push(p),
                Ok(Some((seq, kind))) => {
                    let name = OpKind::from_code(kind).map_or("?", OpKind::name);
                    parts.push(format!("rank {p} is at #{seq} ({name})"));
                }
                Ok(None) => parts.push(format!("rank {p} has not started any operation")),
                Err(e) => {
                    tracing::debug!("status query to rank {p} failed: {e}");
                    parts.push(format!("rank {p} unreachable"));
                }
            }
        }
        if !same.is_empty() {
            let list: Vec<String> = same.iter().map(|p| p.to_string()).collect();
            let who = if same.len() == 1 { "rank" } else { "ranks" };
            let verb = if same.len() == 1 { "is" } else { "are" };
            parts.push(format!(
                "{who} {} {verb} in #{} too",
                list.join(", "),
                fp.seq
            ));
        }
        if skipped > 0 {
            parts.push(format!("{skipped} more ranks not asked"));
        }
        parts.join("; ")
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn stream_inner(
        &mut self,
        ch: Channel,
        fp: &Fingerprint,
        base: *mut u8,
        outs: &[Out],
        ins: &[In],
        on_recv: &mut dyn FnMut(usize, Option<&mut [u8]>),
        scratch: &mut [u64],
    ) -> Result<()> {
        unsafe {
            let rank = self.rank;
            let scratch_ptr: *mut u8 = scratch.as_mut_ptr().cast();
            let header = |fp: &Fingerprint, step: u32, seg: u32, len: usize| FrameHeader {
                fp: *fp,
                step,
                seg,
                len: len as u32,
            };
            let (mut si, mut ri) = (0usize, 0usize);
            let mut out: Option<OutFrame> = None;
            let mut inp: Option<InFrame> = None;
            let mut pacer = Pacer::new(&self.cfg, self.abort.clone());
            while si < outs.len() || ri < ins.len() {
                let mut progressed = false;
                while si < outs.len() {
                    let o = &outs[si];
                    if out.is_none() {
                        if o.after_recv.is_some_and(|d| ri <= d) {
                            break;
                        }
                        // SAFETY: in bounds and unaliased by the caller's contract.
                        out = Some(OutFrame::new(
                            &header(fp, o.step, o.seg, o.len),
                            base.add(o.off),
                            o.len,
                        ));
                    }
                    let Some(frame) = out.as_mut() else { break };
                    let peer = self.link(ch, o.peer)?;
                    let (moved, done) = frame
                        .progress(peer)
                        .map_err(|e| frame_error(rank, e, o.peer, fp))?;
                    progressed |= moved > 0;
                    if !done {
                        break;
                    }
                    out = None;
                    si += 1;
                    progressed = true;
                }
                while ri < ins.len() {
                    let i = &ins[ri];
                    if inp.is_none() {
                        if i.after_send.is_some_and(|d| si <= d) {
                            break;
                        }
                        let dst = match i.dst {
                            Dst::Buf(off) => base.add(off),
                            Dst::Scratch => scratch_ptr,
                        };
                        // SAFETY: `dst` has room for the frame (scratch was sized for the
                        // largest) and nothing else touches it until the frame completes.
                        inp = Some(InFrame::new(header(fp, i.step, i.seg, i.len), dst));
                    }
                    let Some(frame) = inp.as_mut() else { break };
                    let peer = self.link(ch, i.peer)?;
                    let (moved, done) = frame
                        .progress(peer)
                        .map_err(|e| frame_error(rank, e, i.peer, fp))?;
                    progressed |= moved > 0;
                    if !done {
                        break;
                    }
                    inp = None;
                    let data = match i.dst {
                        Dst::Scratch => Some(std::slice::from_raw_parts_mut(scratch_ptr, i.len)),
                        Dst::Buf(_) => None,
                    };
                    on_recv(ri, data);
                    ri += 1;
                    progressed = true;
                }
                if si == outs.len() && ri == ins.len() {
                    break;
                }
                if progressed {
                    pacer.moved();
                    continue;
                }
                pacer.idle(&mut *self.waiter, rank, fp, || {
                    if ri < ins.len() && (si == outs.len() || inp.is_some()) {
                        let i = &ins[ri];
                        format!(
                            "data from rank {} (step {}, segment {})",
                            i.peer, i.step, i.seg
                        )
                    } else {
                        let o = &outs[si.min(outs.len() - 1)];
                        format!(
                            "rank {} to take data (step {}, segment {})",
                            o.peer, o.step, o.seg
                        )
                    }
                })?;
            }
            Ok(())
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Turns a frame-level failure into the crate error naming who and what.
pub(crate) fn frame_error(rank: usize, e: FrameError, peer: usize, fp: &Fingerprint) -> Error {
    match e {
        FrameError::Link(LinkError::Closed) => Error::PeerClosed {
            rank,
            peer,
            op: fp.to_string(),
        },
        FrameError::Link(LinkError::Io(source)) => Error::io(
            format!("rank {rank}: link to rank {peer} failed during {fp}"),
            source,
        ),
        FrameError::Unexpected {
            got: Err(detail), ..
        } => Error::Protocol {
            rank,
            peer,
            op: fp.to_string(),
            detail,
        },
        FrameError::Unexpected {
            got: Ok(h),
            expected,
        } => {
            if h.fp != expected.fp {
                Error::Mismatch {
                    rank,
                    peer,
                    ours: expected.fp.to_string(),
                    theirs: h.fp.to_string(),
                }
            } else {
                Error::Protocol {
                    rank,
                    peer,
                    op: fp.to_string(),
                    detail: format!(
                        "expected step {} segment {} of {} bytes, got step {} segment {} of {} bytes",
                        expected.step, expected.seg, expected.len, h.step, h.seg, h.len
                    ),
                }
            }
        }
    }
}

/// What a progress loop does when no link moved: poll a little longer (yielding the
/// CPU), sleep in the transport's waiter, or give up with [`Error::Timeout`] once
/// [`Config::timeout`] has passed without progress.
pub(crate) struct Pacer {
    last: Instant,
    timeout: Duration,
    busy_poll: Duration,
    abort: Arc<AtomicBool>,
}

impl Pacer {
    pub fn new(cfg: &Config, abort: Arc<AtomicBool>) -> Self {
        Pacer {
            last: Instant::now(),
            timeout: cfg.timeout,
            busy_poll: cfg.busy_poll,
            abort,
        }
    }

    /// Something moved: the no-progress clock restarts.
    pub fn moved(&mut self) {
        self.last = Instant::now();
    }

    /// Nothing moved. `waiting_for` describes what is awaited, for the timeout error.
    pub fn idle(
        &mut self,
        waiter: &mut dyn Waiter,
        rank: usize,
        fp: &Fingerprint,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<()> {
        if self.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank,
                op: fp.to_string(),
            });
        }
        let idle = self.last.elapsed();
        if idle < self.busy_poll {
            std::thread::yield_now();
            return Ok(());
        }
        if idle >= self.timeout {
            return Err(Error::Timeout {
                rank,
                op: fp.to_string(),
                after: idle,
                waiting_for: waiting_for(),
                peers: String::new(),
            });
        }
        waiter
            .wait((self.timeout - idle).min(MAX_WAIT_SLICE))
            .map_err(|e| Error::io(format!("rank {rank}: waiting on links during {fp}"), e))
    }
}
