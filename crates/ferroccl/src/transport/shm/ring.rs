//! The rings of a shared-memory link and the link over them (see the module docs in
//! `mod.rs`): a single-producer, single-consumer byte ring per direction, and the TCP
//! connection that carries doorbells and says when the peer is gone.

use super::{unlink_names, DOORBELL, MAPPED};
use crate::error::Result;
use crate::sync::lock;
use crate::sys::shm::ShmSegment;
use crate::transport::{Link, LinkError};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::single_copy::{post, Desc, Posted, PULL_FLOOR};

/// Layout of a ring segment: the header words (byte offsets; each counter on its own
/// 64-byte line), then the data from [`DATA`].
pub(super) mod layout {
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
pub(super) struct Ring {
    pub(super) seg: ShmSegment,
    pub(super) cap: u64,
}

impl Ring {
    pub(super) fn word(&self, off: usize) -> &AtomicU64 {
        self.seg.word(off / 8)
    }

    /// Makes (for the pair) the ring `name` of `cap` data bytes.
    pub(super) fn create(name: &str, cap: usize) -> Result<Self> {
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
    pub(super) fn open(name: &str, cap: usize) -> std::result::Result<Self, String> {
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
    pub(super) fn put(&self, pos: u64, src: &[u8]) {
        let at = (pos % self.cap) as usize;
        let first = src.len().min(self.cap as usize - at);
        self.seg.write_at(layout::DATA + at, &src[..first]);
        self.seg.write_at(layout::DATA, &src[first..]);
    }

    /// Copies from the ring at stream position `pos` into `dst` (wrapping).
    pub(super) fn get(&self, pos: u64, dst: &mut [u8]) {
        let at = (pos % self.cap) as usize;
        let first = dst.len().min(self.cap as usize - at);
        self.seg.read_at(layout::DATA + at, &mut dst[..first]);
        self.seg.read_at(layout::DATA, &mut dst[first..]);
    }
}

/// What a link and the waiter share: both rings, the TCP connection (doorbell and
/// liveness), and whether that connection has ended.
pub(super) struct Pair {
    pub(super) peer: usize,
    /// The ring this rank writes (the peer's segment).
    pub(super) tx: Ring,
    /// The ring this rank reads (its own segment).
    pub(super) rx: Ring,
    pub(super) ctl: mio::net::TcpStream,
    /// The TCP connection ended or failed: the peer exited, was killed or shut down.
    pub(super) gone: AtomicBool,
    /// On the lower rank, the rings' names until the peer says it mapped them
    /// ([`MAPPED`]); empty on the higher.
    pub(super) names: Mutex<Vec<String>>,
}

impl Pair {
    /// Wakes the peer's waiter, which raised `flag` before sleeping.
    pub(super) fn ring_if_asleep(&self, flag: &AtomicU64) {
        fence(Ordering::SeqCst);
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
            // A full socket buffer already holds doorbells the peer has yet to read.
            let _ = (&self.ctl).write(&[DOORBELL]);
        }
    }

    /// Reads what the connection holds (doorbells), noting its end; returns whether it
    /// has ended.
    pub(super) fn drain(&self) -> bool {
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

/// A link over a [`Pair`].
pub(super) struct ShmLink {
    pub(super) pair: Arc<Pair>,
    /// Bytes put in `tx` (our `head` of it).
    pub(super) head: u64,
    /// Bytes taken from `rx` (our `tail` of it).
    pub(super) tail: u64,
    /// Bytes written and read, ring and single copy alike ([`Link::raw_counts`]).
    pub(super) sent: u64,
    pub(super) received: u64,
    pub(super) closed: bool,
    /// Single copy ([`crate::config::ShmOptions::single_copy_min`]; 0: off): the
    /// smallest slice this rank offers for pulling, and what it knows of pulling.
    pub(super) single_copy_min: usize,
    /// The writer's side: the descriptor out, and what its slices have taken in all.
    pub(super) posted: Option<Posted>,
    pub(super) offered: u64,
    /// The reader's side: whether it has tried to open the writer (a reader that does
    /// not pull never does: a writer posts only to a reader that said it can), what it
    /// opened, the descriptor it last read (by sequence) and what it has pulled in all.
    pub(super) probed: bool,
    pub(super) remote: Option<crate::sys::cma::Remote>,
    pub(super) desc: Desc,
    pub(super) pulled: u64,
}

impl ShmLink {
    pub(super) fn new(pair: Arc<Pair>, single_copy_min: usize) -> Self {
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

    /// Whether the reader of `tx` has gone (closed its end, or its connection ended).
    pub(super) fn peer_closed(&self) -> bool {
        let p = &*self.pair;
        p.gone.load(Ordering::Acquire)
            || p.tx.word(layout::READER_CLOSED).load(Ordering::Acquire) != 0
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

    fn peek(&mut self, buf: &mut [u8]) -> Option<std::result::Result<usize, LinkError>> {
        // Between frames the next bytes are in the ring: a frame's header (or a
        // notice) never goes by single copy.
        let p = &*self.pair;
        let head = p.rx.word(layout::HEAD).load(Ordering::Acquire);
        let n = buf.len().min((head - self.tail) as usize);
        if n > 0 {
            p.rx.get(self.tail, &mut buf[..n]);
            return Some(Ok(n));
        }
        let closed = self.closed
            || p.gone.load(Ordering::Acquire)
            || p.rx.word(layout::WRITER_CLOSED).load(Ordering::Acquire) != 0;
        // Closed: bytes published before the close are still to be read.
        let head = p.rx.word(layout::HEAD).load(Ordering::Acquire);
        Some(if closed && head == self.tail {
            Err(LinkError::Closed)
        } else {
            Ok(0)
        })
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

#[cfg(test)]
pub(super) mod tests {
    use super::super::single_copy::offer_memory;
    use super::*;
    use std::net::TcpStream;

    /// Two links of one process joined by two rings of `cap` bytes and a loopback TCP
    /// connection, each offering its memory for single copy from `min` bytes (0: off).
    pub(in crate::transport::shm) fn linked(cap: usize, min: usize) -> (ShmLink, ShmLink) {
        linked_with(cap, min, min)
    }

    /// [`linked`] with single copy from `a_min` bytes on the first link and `b_min` on
    /// the second.
    pub(in crate::transport::shm) fn linked_with(
        cap: usize,
        a_min: usize,
        b_min: usize,
    ) -> (ShmLink, ShmLink) {
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
    pub(in crate::transport::shm) fn write_all(
        w: &mut ShmLink,
        bufs: &[&[u8]],
        mut read: impl FnMut(),
    ) -> Vec<usize> {
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

    /// A peek returns what a read would, across the ring's end, and takes nothing;
    /// nothing written is `Ok(0)`, and a closed writer with nothing left is `Closed`.
    #[test]
    fn a_peek_takes_nothing() {
        let (mut a, mut b) = linked(4096, 0);
        let mut head = [0u8; 8];
        assert_eq!(b.peek(&mut head).unwrap().unwrap(), 0);
        // Past the ring's end: 3000 written and read, then 2000 more.
        let first = vec![1u8; 3000];
        write_all(&mut a, &[&first], || {});
        let mut sink = vec![0u8; 3000];
        assert_eq!(b.try_read(&mut [IoSliceMut::new(&mut sink)]).unwrap(), 3000);
        let data: Vec<u8> = (0..2000u32).map(|i| (i * 13) as u8).collect();
        write_all(&mut a, &[&data], || {});
        for _ in 0..2 {
            assert_eq!(b.peek(&mut head).unwrap().unwrap(), 8);
            assert_eq!(head[..], data[..8]);
        }
        let mut all = vec![0u8; 4000];
        assert_eq!(b.peek(&mut all).unwrap().unwrap(), 2000, "what there is");
        assert_eq!(all[..2000], data[..]);
        let mut back = vec![0u8; 2000];
        assert_eq!(b.try_read(&mut [IoSliceMut::new(&mut back)]).unwrap(), 2000);
        assert_eq!(back, data, "the peeks took nothing");
        assert_eq!(b.peek(&mut head).unwrap().unwrap(), 0);
        a.shutdown();
        assert!(matches!(b.peek(&mut head), Some(Err(LinkError::Closed))));
    }
}
