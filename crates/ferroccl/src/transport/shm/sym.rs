//! Symmetric memory: when every rank of a job is on this host, each rank keeps one
//! workspace segment that every other rank maps, and the host collectives read their
//! peers' workspaces directly (the pull executor, `engine/pull.rs`, and its one-shot
//! and two-shot all-reduce) instead of streaming frames through the rings.
//!
//! Why: a frame through a ring is two copies (into the ring, out of it), and a
//! receive that reduces reads the ring's copy again; reading the peer's workspace is
//! one. An all-reduce of `S` bytes at `n = 2` then costs each rank `1.5·S` of copies
//! and `0.5·S` of reductions (two-shot: copy in, reduce its half from both
//! workspaces, copy the other half out) against the ring's `2·S` and `0.5·S` plus a
//! copy out of the ring per reduction — the memory-bandwidth law `ferroccl bench
//! --law mem` checks.
//!
//! # Set-up (collective, in [`connect`])
//!
//! Only when every rank is on this host (the `host/<rank>` keys) and this transport
//! may use it ([`crate::config::ShmOptions::symmetric`]). Each rank creates
//! `/ferroccl-<comm id>-<pid>-<rank>-<rank>-255` (the rings' name shape, so a name
//! left by a dead creator is reclaimed like theirs), holding a 4 KiB header and
//! mapped over [`RESERVE`] bytes of address space, and says its name and its cap in
//! the store (`shmsym/<rank>` = `<cap> <name>`, or `off`). The cap is what the
//! workspace may grow to: half of `/dev/shm`'s free bytes shared among the ranks, a
//! power of two from 1 MiB to 4 GiB (a container's 64 MiB `/dev/shm` gives 2 ranks
//! 16 MiB each); the job takes the least, and a larger call streams through the
//! rings, so a small `/dev/shm` costs speed, never a failed call. Every rank reads every other's: if any says `off`,
//! every rank sees it and none uses symmetric memory (the job streams over the rings
//! as before). Otherwise each maps every peer's segment, checks its magic, notes its
//! pid and counts itself in the peer's `MAPPED` word; a rank whose segment all peers
//! have mapped removes its name, so before the first collective nothing is left in
//! `/dev/shm`, and a rank killed later leaves nothing behind.
//!
//! # A call
//!
//! The workspace grows (by its creator, at [`MemPeers::begin`], every rank at the same
//! call to the same size, rounded up to a power of two) and never moves: peers map the
//! whole reservation once. A peer reads only bytes its owner has published through its
//! progress counter (`COUNTER`, stored `Release` after the bytes, loaded `Acquire`),
//! so never past what the owner holds. Copies and reductions run at once on the
//! calling thread (host memory needs no stream), so [`MemPeers::order_after`] and
//! [`MemPeers::end`] have nothing to wait for.
//!
//! # Slots
//!
//! After the header page, each workspace holds two small-message slots ([`Slots`]:
//! a stamp word and the call's frame header on one cache line, then [`SLOT_BYTES`] of
//! data), which the one-shot all-reduce of a small buffer (`engine/slot.rs`) posts to
//! and reduces from in place: no frame, no fingerprint round trip, no wait for
//! readers. They exist from the segment's creation (the data starts after them), so
//! a peer reads them without asking what the workspace holds.
//!
//! # A peer that dies
//!
//! [`MemPeers::gone`]: the peer's pid (from its header, checked visible at set-up)
//! no longer exists. The pull executor asks while it waits for a peer's progress, so a
//! rank killed inside a call is named at once by every rank waiting on it; a stopped
//! one (`SIGSTOP`) is alive, and is named at the timeout.

use super::PREFIX;
use crate::error::{Error, Result};
use crate::reduce::{kernels, DataType, ReduceOp};
use crate::rendezvous::StoreClient;
use crate::sys::shm::{process_alive, SymSegment};
use crate::transport::{CallMem, MemPeers, Region, Slots};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Address space each workspace reserves (not memory: pages exist only once a call
/// has grown the workspace to them).
pub(crate) const RESERVE: usize = 1 << 36;
/// The most a workspace grows to (a call of more bytes streams through the rings).
const MAX_CAP: usize = 4 << 30;
/// Below this cap (a nearly full `/dev/shm`) symmetric memory is not worth it.
const MIN_CAP: usize = 1 << 20;

/// Header words (8-byte indices into the first page); the data starts at [`DATA`].
const MAGIC: usize = 0;
const PID: usize = 1;
/// Published progress, on a cache line of its own.
const COUNTER: usize = 8;
/// Peers that have mapped this segment.
const MAPPED: usize = 16;
/// The two small-message slots ([`Slots`]), from the second page on: each a head of
/// [`SLOT_HEAD`] bytes (the stamp word, then the call's frame header) and
/// [`SLOT_BYTES`] of data, on cache lines of their own.
const SLOTS_AT: usize = 4096;
/// Data bytes of one slot: what the one-shot from slots takes at most
/// (`algo::select::slot_max`).
pub(crate) const SLOT_BYTES: usize = 32 << 10;
const SLOT_HEAD: usize = 64;
const SLOT_STRIDE: usize = SLOT_HEAD + SLOT_BYTES;
/// The workspace's data, after the slots, page-aligned.
const DATA: usize = (SLOTS_AT + 2 * SLOT_STRIDE).next_multiple_of(4096);
/// "FCSYMWS1" as a little-endian word.
const MAGIC_VALUE: u64 = u64::from_le_bytes(*b"FCSYMWS1");
/// The channel number in a workspace's name (rings use the channels' codes).
const NAME_CHANNEL: u32 = 255;

/// What a rank that does not use symmetric memory says in the store.
const OFF: &[u8] = b"off";

/// A peer's mapped workspace.
struct Peer {
    seg: SymSegment,
    /// Its process, when this process can see it (for [`MemPeers::gone`]).
    pid: Option<u32>,
}

/// This rank's memory peers over symmetric shared memory.
pub(crate) struct HostPeers {
    rank: usize,
    mine: SymSegment,
    /// The largest workspace any rank of the job may grow to (the least of the ranks'
    /// caps): larger calls stream through the rings.
    cap: usize,
    /// Data bytes this rank's workspace holds.
    held: usize,
    /// By rank; `None` for this rank.
    peers: Vec<Option<Peer>>,
    call: Option<CallMem>,
    /// The current call's workspace bytes (what every rank holds at least).
    bytes: usize,
}

/// The name of rank `rank`'s workspace, made by process `pid`.
fn name(comm_id: u64, pid: u32, rank: usize) -> String {
    format!("/{PREFIX}{comm_id:016x}-{pid}-{rank}-{rank}-{NAME_CHANNEL}")
}

/// Sets up symmetric memory for rank `rank` of `n` (see the module docs): `Ok(None)`
/// when the job does not use it (ranks on other hosts, or a rank that says `off`:
/// every rank decides alike from the same store keys). `me` is this rank's host
/// identity; `want` whether this rank may use it.
pub(crate) fn connect(
    store: &mut StoreClient,
    rank: usize,
    n: usize,
    comm_id: u64,
    me: &str,
    want: bool,
    deadline: Instant,
) -> Result<Option<HostPeers>> {
    if n < 2 {
        return Ok(None);
    }
    let left = || deadline.saturating_duration_since(Instant::now());
    for q in (0..n).filter(|&q| q != rank) {
        let theirs = crate::rendezvous::hosts::of_rank(store, rank, q, deadline)?;
        if theirs != me {
            return Ok(None);
        }
    }
    let pid = std::process::id();
    // What this rank's workspace may grow to: half of what `/dev/shm` has free now,
    // shared among the job's ranks (all on this host), a power of two, at most
    // [`MAX_CAP`]. A container's 64 MiB `/dev/shm` gives each of 2 ranks 16 MiB; calls
    // larger than the job's least cap stream through the rings.
    let cap = crate::sys::shm::shm_free_bytes()
        .map_or(0, |free| (free / 2 / n as u64).min(MAX_CAP as u64) as usize);
    let cap = if cap == 0 { 0 } else { 1usize << cap.ilog2() };
    let want = want && cap >= MIN_CAP;
    let mine = if want {
        let nm = name(comm_id, pid, rank);
        match SymSegment::create(&nm, DATA, RESERVE + DATA) {
            Ok(s) => {
                s.word(PID).store(u64::from(pid), Ordering::Relaxed);
                s.word(MAGIC).store(MAGIC_VALUE, Ordering::Release);
                store.set(&format!("shmsym/{rank}"), format!("{cap} {nm}").as_bytes())?;
                Some(s)
            }
            Err(e) => {
                tracing::warn!("rank {rank}: no symmetric memory ({e}); collectives use the rings");
                None
            }
        }
    } else {
        None
    };
    if mine.is_none() {
        store.set(&format!("shmsym/{rank}"), OFF)?;
    }
    let mut names = vec![None; n];
    for (q, slot) in names.iter_mut().enumerate().filter(|&(q, _)| q != rank) {
        let v = store.get(&format!("shmsym/{q}"), left()).map_err(|e| {
            Error::Rendezvous(format!(
                "rank {rank}: rank {q} did not say whether it uses symmetric memory within \
                 the connect timeout: has it started, with the same transport? ({e})"
            ))
        })?;
        *slot = Some(v);
    }
    let Some(mut mine) = mine else {
        return Ok(None);
    };
    if names.iter().flatten().any(|v| v.as_slice() == OFF) {
        return Ok(None);
    }
    // Every rank reads every key: the least cap is the same everywhere.
    let mut job_cap = cap;
    let mut parsed = vec![None; n];
    for (q, v) in names.iter().enumerate() {
        let Some(v) = v else { continue };
        let text = String::from_utf8_lossy(v).into_owned();
        let (c, nm) = text
            .split_once(' ')
            .and_then(|(c, nm)| Some((c.parse::<usize>().ok()?, nm.to_string())))
            .ok_or_else(|| Error::Protocol {
                rank,
                peer: q,
                op: "symmetric memory set-up".into(),
                detail: format!("shmsym/{q} says {text:?}"),
            })?;
        job_cap = job_cap.min(c);
        parsed[q] = Some(nm);
    }
    let mut peers: Vec<Option<Peer>> = (0..n).map(|_| None).collect();
    for (q, nm) in parsed.into_iter().enumerate() {
        let Some(nm) = nm else { continue };
        let seg = SymSegment::open(&nm, RESERVE + DATA)?;
        if seg.word(MAGIC).load(Ordering::Acquire) != MAGIC_VALUE {
            return Err(Error::Protocol {
                rank,
                peer: q,
                op: "symmetric memory set-up".into(),
                detail: format!("{nm} is not a ferroccl workspace"),
            });
        }
        let p = u32::try_from(seg.word(PID).load(Ordering::Relaxed)).unwrap_or(0);
        let pid = (p != 0 && process_alive(p)).then_some(p);
        seg.word(MAPPED).fetch_add(1, Ordering::AcqRel);
        peers[q] = Some(Peer { seg, pid });
    }
    // Every peer has mapped ours: its name can go.
    while mine.word(MAPPED).load(Ordering::Acquire) < (n - 1) as u64 {
        if Instant::now() >= deadline {
            return Err(Error::Rendezvous(format!(
                "rank {rank}: {} of {} peers mapped this rank's symmetric memory within the \
                 connect timeout",
                mine.word(MAPPED).load(Ordering::Acquire),
                n - 1
            )));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    mine.unlink();
    Ok(Some(HostPeers {
        rank,
        mine,
        cap: job_cap,
        held: 0,
        peers,
        call: None,
        bytes: 0,
    }))
}

impl HostPeers {
    fn call(&self) -> Result<&CallMem> {
        self.call
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("internal: no symmetric-memory call".into()))
    }

    /// The address of `len` bytes of `r`, checked against the buffer it is in.
    fn addr(&self, r: Region, len: usize) -> Result<*mut u8> {
        let call = self.call()?;
        let bad = || {
            Error::InvalidArgument(format!(
                "internal: {len} bytes at {r:?} are outside the call's memory"
            ))
        };
        let within = |off: usize, cap: usize| off.checked_add(len).is_some_and(|e| e <= cap);
        match r {
            Region::Input(off) if within(off, call.input_len) => {
                Ok((call.input + off as u64) as *mut u8)
            }
            Region::Output(off) if within(off, call.output_len) => {
                Ok((call.output + off as u64) as *mut u8)
            }
            Region::Mine(off) if within(off, self.held) => {
                self.mine.addr(DATA + off, len).ok_or_else(bad)
            }
            Region::Peer(q, off) if within(off, self.bytes) => self
                .peers
                .get(q)
                .and_then(Option::as_ref)
                .and_then(|p| p.seg.addr(DATA + off, len))
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

/// Copies `len` bytes from `src` to `dst` (distinct or equal, never partly
/// overlapping: the executors' regions are whole chunks).
///
/// # Safety
/// Both ranges are valid for `len` bytes, and the executor's protocol keeps every other
/// process and thread off `dst` (and writers off `src`) until the call publishes.
unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    if len == 0 || std::ptr::eq(dst, src) {
        return;
    }
    // SAFETY: the caller's contract; the ranges do not partly overlap.
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts_mut(dst, len),
            std::slice::from_raw_parts(src, len),
        )
    };
    crate::sys::mem::copy(d, s);
}

/// Byte offset of slot `turn` in a workspace.
fn slot_at(turn: usize) -> usize {
    SLOTS_AT + (turn & 1) * SLOT_STRIDE
}

impl HostPeers {
    /// The segment of rank `q` (this rank's own included).
    fn seg_of(&self, q: usize) -> Option<&SymSegment> {
        if q == self.rank {
            Some(&self.mine)
        } else {
            self.peers.get(q)?.as_ref().map(|p| &p.seg)
        }
    }

    /// The data bytes `..len` of rank `q`'s slot `turn`.
    fn slot_data(&self, q: usize, turn: usize, len: usize) -> Result<*mut u8> {
        self.seg_of(q)
            .filter(|_| len <= SLOT_BYTES)
            .and_then(|s| s.addr(slot_at(turn) + SLOT_HEAD, len))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "internal: {len} bytes of rank {q}'s slot {turn} (it holds {SLOT_BYTES})"
                ))
            })
    }
}

impl Slots for HostPeers {
    fn slot_bytes(&self) -> usize {
        SLOT_BYTES
    }

    fn gone(&self, peer: usize) -> bool {
        MemPeers::gone(self, peer)
    }

    fn post(&mut self, turn: usize, head: &[u8], data: &[u8], stamp: u64) -> Result<()> {
        let at = slot_at(turn);
        let (h, d) = (
            self.mine
                .addr(at + 8, head.len())
                .filter(|_| head.len() <= SLOT_HEAD - 8),
            self.slot_data(self.rank, turn, data.len())?,
        );
        let h = h.ok_or_else(|| {
            Error::InvalidArgument(format!("internal: a slot head of {} bytes", head.len()))
        })?;
        // SAFETY: both inside this rank's slot (checked); no peer reads it until the
        // stamp below says so, and none still reads it (the slot's previous call was
        // two slot calls ago: see `Slots`).
        unsafe {
            copy(h, head.as_ptr(), head.len());
            copy(d, data.as_ptr(), data.len());
        }
        self.mine.word_at(at, DATA).store(stamp, Ordering::Release);
        Ok(())
    }

    fn stamp(&self, peer: usize, turn: usize) -> u64 {
        self.seg_of(peer).map_or(0, |s| {
            s.word_at(slot_at(turn), DATA).load(Ordering::Acquire)
        })
    }

    fn head(&self, peer: usize, turn: usize, into: &mut [u8]) {
        let len = into.len().min(SLOT_HEAD - 8);
        if let Some(p) = self
            .seg_of(peer)
            .and_then(|s| s.addr(slot_at(turn) + 8, len))
        {
            // SAFETY: inside the peer's slot head; a concurrent write there can only
            // tear the copy, which the trait's contract lets the caller detect.
            unsafe { copy(into.as_mut_ptr(), p, len) };
        }
    }

    fn reduce(&mut self, turn: usize, dtype: DataType, op: ReduceOp, out: &mut [u8]) -> Result<()> {
        let (len, n) = (out.len(), self.peers.len());
        for q in 0..n {
            if q == 0 && self.rank == 0 {
                // `out` holds rank 0's own data already (the trait's contract).
                continue;
            }
            let p = self.slot_data(q, turn, len)?;
            // SAFETY: `len` bytes of rank q's slot (checked), published with the
            // call's stamp and left alone by their owner until this rank's next slot
            // call (see `Slots`); `out` is the caller's, distinct from every slot.
            let d = unsafe { std::slice::from_raw_parts(p, len) };
            if q == 0 {
                out.copy_from_slice(d);
            } else {
                kernels::reduce_bytes(dtype, op, out, d);
            }
        }
        if op == ReduceOp::Avg {
            kernels::scale_bytes(dtype, out, n);
        }
        Ok(())
    }
}

impl MemPeers for HostPeers {
    fn host_memory(&self) -> bool {
        true
    }

    fn symmetric(&self) -> bool {
        true
    }

    fn begin(&mut self, mem: &CallMem, bytes: usize, _peers: &[usize]) -> Result<()> {
        if mem.space != 0 {
            return Err(Error::InvalidArgument(format!(
                "symmetric memory: memory space {} is not host memory",
                mem.space
            )));
        }
        if bytes > self.cap {
            return Err(Error::InvalidArgument(format!(
                "internal: a call of {bytes} bytes on symmetric memory of at most {}",
                self.cap
            )));
        }
        if bytes > self.held {
            let want = bytes.next_power_of_two().min(self.cap).max(bytes);
            self.mine.grow(DATA + want)?;
            self.held = want;
        }
        self.bytes = bytes;
        self.call = Some(mem.clone());
        Ok(())
    }

    fn copy(&mut self, dst: Region, src: Region, len: usize) -> Result<()> {
        let (d, s) = (self.addr(dst, len)?, self.addr(src, len)?);
        // SAFETY: both checked against their buffers; the pull executor's protocol
        // gives this rank `dst` alone and keeps `src`'s writer off it.
        unsafe { copy(d, s, len) };
        Ok(())
    }

    fn combine(
        &mut self,
        dst: Region,
        also: Option<Region>,
        a: Region,
        b: Region,
        len: usize,
        finish: bool,
    ) -> Result<()> {
        let call = self.call()?.clone();
        let op = call.op.ok_or_else(|| {
            Error::InvalidArgument("internal: combine without an operator".into())
        })?;
        let (d, pa, pb) = (self.addr(dst, len)?, self.addr(a, len)?, self.addr(b, len)?);
        if len == 0 {
            return Ok(());
        }
        // `dst = a op b`: the operators are commutative (bit for bit), so `dst = b op
        // a` when `dst` is `b`.
        let other = if std::ptr::eq(d, pb) {
            pa
        } else {
            // SAFETY: as in `copy` (a no-op when `dst` is `a`).
            unsafe { copy(d, pa, len) };
            pb
        };
        // SAFETY: checked addresses of `len` bytes; `dst` is this rank's alone and
        // distinct from `other` (a combine never reads its destination as both).
        let (ds, os) = unsafe {
            (
                std::slice::from_raw_parts_mut(d, len),
                std::slice::from_raw_parts(other, len),
            )
        };
        kernels::reduce_bytes(call.dtype, op, ds, os);
        if finish && op == ReduceOp::Avg {
            kernels::scale_bytes(call.dtype, ds, call.world_size);
        }
        if let Some(also) = also {
            let pa = self.addr(also, len)?;
            // SAFETY: as in `copy`.
            unsafe { copy(pa, d, len) };
        }
        Ok(())
    }

    fn publish(&mut self, value: u64) -> Result<()> {
        self.mine.word(COUNTER).store(value, Ordering::Release);
        Ok(())
    }

    fn progress(&self, peer: usize) -> u64 {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .map_or(0, |p| p.seg.word(COUNTER).load(Ordering::Acquire))
    }

    fn order_after(&mut self, _peer: usize) -> Result<()> {
        // The `Acquire` load that saw the counter ordered this thread's reads.
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        self.call = None;
        Ok(())
    }

    fn max_bytes(&self) -> usize {
        self.cap
    }

    fn gone(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .and_then(|p| p.pid)
            .is_some_and(|pid| pid != std::process::id() && !process_alive(pid))
    }

    fn slots(&mut self) -> Option<&mut dyn Slots> {
        Some(self)
    }
}
