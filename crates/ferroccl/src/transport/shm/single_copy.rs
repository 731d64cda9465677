//! Single copy (off by default; [`crate::config::ShmOptions::single_copy_min`]): a
//! collective payload the reader copies straight from the writer's memory.
//!
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
use super::ring::{layout, Pair, Ring, ShmLink};
use crate::transport::LinkError;
use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{fence, Ordering};

/// The smallest slice a writer offers for pulling, whatever it is configured with.
pub(super) const PULL_FLOOR: usize = 4096;

/// A descriptor as the writer posted it (see [`layout::DESC_SEQ`]).
#[derive(Clone, Copy, Default)]
pub(super) struct Desc {
    pub(super) seq: u64,
    pub(super) pos: u64,
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) addr: u64,
}

/// The writer's descriptor out: `reported` of its `len` bytes were returned as
/// written (the reader had pulled them).
pub(super) struct Posted {
    addr: u64,
    base: u64,
    len: u64,
    reported: u64,
}

impl ShmLink {
    /// The writer: what the reader has pulled of the descriptor out since last asked,
    /// as bytes written (the descriptor is done once all are).
    pub(super) fn pulled_of_posted(&mut self, bufs: &[IoSlice<'_>]) -> u64 {
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

    /// The reader: the writer's descriptor if it has bytes not pulled yet.
    /// A new descriptor must start where the reader has pulled to, at or after where
    /// it has read the ring to, and hold bytes: anything else is a peer that broke the
    /// protocol, a typed error rather than arithmetic on its numbers.
    pub(super) fn active_desc(&mut self) -> std::result::Result<Option<Desc>, LinkError> {
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
    pub(super) fn probe_writer(&mut self) {
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
    pub(super) fn pull(
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
pub(super) fn post(p: &Pair, head: u64, offered: u64, b: &[u8]) -> Posted {
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

/// Says in the ring this rank writes who it is for single copy (its pid and cookie),
/// unless this process cannot let peers read its memory (said once).
pub(super) fn offer_memory(tx: &Ring, rank: usize) {
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

#[cfg(test)]
mod tests {
    use super::super::ring::tests::{linked, linked_with, write_all};
    use super::*;
    use crate::transport::Link;

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
}
