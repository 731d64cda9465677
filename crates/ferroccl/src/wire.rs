//! Frames on a link: a fixed 48-byte header, then the payload.
//!
//! Every frame names the collective it belongs to (its [`Fingerprint`]: kind, sequence
//! number, dtype, op, element count, root, and the communicator: 0 for the job's own,
//! a child's id for a communicator made by `split` or `group`) and its place in it
//! (ring step, segment, payload length). The receiver knows exactly which frame it expects next, so it checks
//! the header against its own expectation: ranks that called different collectives, or
//! the same one with different lengths, get [`crate::Error::Mismatch`] naming both sides
//! instead of a hang or silently wrong data, and a frame from an older or newer
//! operation can never be taken for the current one.
//!
//! Header layout (little endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `FCCD` |
//! | 4 | kind |
//! | 5 | dtype |
//! | 6 | op (255: none) |
//! | 7 | algorithm |
//! | 8..16 | sequence number |
//! | 16..24 | element count of the collective |
//! | 24..28 | root rank (`u32::MAX`: none) |
//! | 28..32 | step |
//! | 32..36 | segment |
//! | 36..40 | payload bytes |
//! | 40..48 | communicator id (0: the job's communicator) |

use crate::algo::Algorithm;
use crate::reduce::{DataType, ReduceOp};
use crate::transport::{Link, LinkError};
use std::fmt;
use std::io::{IoSlice, IoSliceMut};

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 48;
const FRAME_MAGIC: [u8; 4] = *b"FCCD";
/// A failure notice instead of a frame: a rank that gives up tells each peer why
/// before it shuts its links (bytes 4..8: the rank where the failure started; 36..40:
/// the length of the UTF-8 cause that follows).
const NOTICE_MAGIC: [u8; 4] = *b"FCCN";
/// The longest cause a notice carries (the origin's error as JSON,
/// `Error::to_wire`, which keeps itself under this).
const NOTICE_MAX: usize = 16 << 10;

/// A failure notice for `origin`'s `cause` (cut to [`NOTICE_MAX`] bytes).
pub(crate) fn encode_notice(origin: usize, cause: &str) -> Vec<u8> {
    let mut end = cause.len().min(NOTICE_MAX);
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    let mut b = vec![0u8; HEADER_LEN];
    b[0..4].copy_from_slice(&NOTICE_MAGIC);
    b[4..8].copy_from_slice(&(origin as u32).to_le_bytes());
    b[36..40].copy_from_slice(&(end as u32).to_le_bytes());
    b.extend_from_slice(&cause.as_bytes()[..end]);
    b
}

/// If `header` starts a notice: its origin rank and cause length.
fn notice_header(header: &[u8; HEADER_LEN]) -> Option<(usize, usize)> {
    if header[0..4] != NOTICE_MAGIC {
        return None;
    }
    let u32_at =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    Some((u32_at(4) as usize, (u32_at(36) as usize).min(NOTICE_MAX)))
}

/// Reads the rest of a notice whose first `have` cause bytes are in `first`: what the
/// link has now (the notice is written in one piece just before the link closes, so
/// it has normally arrived whole). A cut-off cause is kept as far as it came.
fn finish_notice(peer: &mut Peer, origin: usize, len: usize, first: &[u8]) -> FrameError {
    let mut text = first[..first.len().min(len)].to_vec();
    while text.len() < len {
        let mut buf = vec![0u8; len - text.len()];
        match peer.link.try_read(&mut [IoSliceMut::new(&mut buf)]) {
            Ok(n) if n > 0 => text.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    FrameError::Notice {
        origin,
        cause: String::from_utf8_lossy(&text).into_owned(),
    }
}

/// What the next bytes on a link are, looked at without taking them
/// ([`look_ahead`]).
pub(crate) enum Ahead {
    /// Nothing yet, or not a whole header; or a link that cannot look ahead.
    Nothing,
    /// A frame.
    Frame(FrameHeader),
    /// A notice, or bytes that are no header: what reading them says.
    Failure,
    /// The link's end, with nothing left to read.
    Closed,
}

/// The header the peer's next bytes start, between frames, without taking them.
pub(crate) fn look_ahead(peer: &mut Peer) -> Ahead {
    if peer.in_mid {
        return Ahead::Nothing;
    }
    let mut h = [0u8; HEADER_LEN];
    match peer.link.peek(&mut h) {
        None => Ahead::Nothing,
        Some(Err(_)) => Ahead::Closed,
        Some(Ok(n)) if n < HEADER_LEN => Ahead::Nothing,
        Some(Ok(_)) if h[0..4] == NOTICE_MAGIC => Ahead::Failure,
        Some(Ok(_)) => FrameHeader::decode(&h).map_or(Ahead::Failure, Ahead::Frame),
    }
}

/// [`read_notice`] for a peer that is gone while this rank waited on its memory, or
/// whose point-to-point messages may be queued ahead of its notice: frames of any call
/// are skipped, only a notice is returned.
pub(crate) fn find_notice(peer: &mut Peer) -> Option<FrameError> {
    read_notice(peer, None)
}

/// After a link failed: what the peer left on it before it closed, if this side was
/// between frames (so the next bytes are a header): a notice saying why it gave up,
/// or, with `fp`, a frame of a call other than `fp` (a mismatch it saw first, or that
/// this rank would have seen had its own write not failed first). Frames of `fp`
/// itself are skipped, a bounded number of them ([`of_call`]: whatever pair count they
/// carry); with `None`, frames of any call.
pub(crate) fn read_notice(peer: &mut Peer, fp: Option<&Fingerprint>) -> Option<FrameError> {
    if peer.in_mid {
        return None;
    }
    // A call leaves a few frames of its own; skipping any call's, what a closed link
    // still holds can be many messages (a point-to-point sender far ahead). Either
    // way finite: only a closed link is read, and an empty read ends the search.
    let most = if fp.is_some() { 64 } else { 1 << 16 };
    for _ in 0..most {
        let mut header = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            match peer
                .link
                .try_read(&mut [IoSliceMut::new(&mut header[got..])])
            {
                Ok(n) if n > 0 => got += n,
                _ => return None,
            }
        }
        if let Some((origin, len)) = notice_header(&header) {
            return Some(finish_notice(peer, origin, len, &[]));
        }
        let h = FrameHeader::decode(&header).ok()?;
        if let Some(fp) = fp.filter(|fp| !of_call(&h.fp, fp)) {
            return Some(FrameError::Unexpected {
                got: Ok(h),
                expected: FrameHeader { fp: *fp, ..h },
            });
        }
        // One of this call's frames: skip its payload.
        let mut left = h.len as usize;
        let mut buf = [0u8; 4096];
        while left > 0 {
            let k = left.min(buf.len());
            match peer.link.try_read(&mut [IoSliceMut::new(&mut buf[..k])]) {
                Ok(n) if n > 0 => left -= n,
                _ => return None,
            }
        }
    }
    None
}

/// Whether a frame fingerprinted `h` belongs to the call `fp`: the same fingerprint,
/// but for the count where frames carry their pair's ([`OpKind::counts_per_pair`]: a
/// scatter root's call says what it sends each rank, the frames a rank sends it say
/// 0). A dead peer's last frames, left on its link, are then not taken for a call of
/// its own (it was reported as a mismatch naming two counts).
pub(crate) fn of_call(h: &Fingerprint, fp: &Fingerprint) -> bool {
    if fp.kind.counts_per_pair() {
        Fingerprint {
            count: fp.count,
            ..*h
        } == *fp
    } else {
        h == fp
    }
}

/// Which collective a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// All-reduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast from a root.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// Barrier.
    Barrier,
    /// A tagged point-to-point message (sequence numbers count per pair of ranks and
    /// the tag travels in the root field).
    SendRecv,
    /// All-to-all (and all-to-allv): every rank sends a block to every other. A frame
    /// carries the count of its own pair of ranks.
    AllToAll,
    /// Gather (and gatherv) to a root; a frame carries its pair's count.
    Gather,
    /// Scatter (and scatterv) from a root; a frame carries its pair's count.
    Scatter,
    /// `Communicator::split`: every rank's color and key, gathered by all.
    Split,
}

impl OpKind {
    /// The name used in messages (`all_reduce`).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Barrier => "barrier",
            OpKind::SendRecv => "send/recv",
            OpKind::AllToAll => "all_to_all",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::Split => "split",
        }
    }

    /// Whether a frame's count is its pair of ranks' (what the two exchange), not the
    /// call's: the collectives whose every pair moves its own amount.
    pub fn counts_per_pair(self) -> bool {
        matches!(self, OpKind::AllToAll | OpKind::Gather | OpKind::Scatter)
    }

    // New kinds go at the end: a kind's code is its place here.
    const ALL: [OpKind; 11] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Barrier,
        OpKind::SendRecv,
        OpKind::AllToAll,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::Split,
    ];
    pub(crate) fn code(self) -> u8 {
        Self::ALL.iter().position(|&k| k == self).unwrap_or(0) as u8 + 1
    }
    pub(crate) fn from_code(c: u8) -> Option<Self> {
        Self::ALL.get((c as usize).checked_sub(1)?).copied()
    }
}

/// What a collective call was, as every participating rank must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// The collective.
    pub kind: OpKind,
    /// Per-communicator sequence number, from 0.
    pub seq: u64,
    /// Element type.
    pub dtype: DataType,
    /// Reduction, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// Elements in the call.
    pub count: u64,
    /// Root rank, for rooted collectives.
    pub root: Option<u32>,
    /// How the data moves.
    pub algo: Algorithm,
    /// The communicator: 0 for the job's own, a child's id otherwise (never 0), so a
    /// frame of one communicator can never be taken for another's.
    pub comm: u64,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} #{} ({}, {} elements",
            self.kind.name(),
            self.seq,
            self.dtype,
            self.count
        )?;
        if self.kind.counts_per_pair() {
            f.write_str(" between the two ranks")?;
        }
        if let Some(op) = self.op {
            write!(f, ", {op}")?;
        }
        match (self.kind, self.root) {
            (OpKind::SendRecv, Some(tag)) => write!(f, ", tag {tag}")?,
            (OpKind::AllReduce, Some(left)) => {
                write!(f, ", a staged piece with {left} more after it")?
            }
            (_, Some(root)) => write!(f, ", root {root}")?,
            _ => {}
        }
        write!(f, ", {})", self.algo.name())?;
        if self.comm != 0 {
            write!(f, " on communicator {:#018x}", self.comm)?;
        }
        Ok(())
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The collective this frame belongs to.
    pub fp: Fingerprint,
    /// Ring step.
    pub step: u32,
    /// Segment within the step.
    pub seg: u32,
    /// Payload bytes that follow.
    pub len: u32,
}

impl FrameHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        b[4] = self.fp.kind.code();
        b[5] = self.fp.dtype.code();
        b[6] = self.fp.op.map_or(255, ReduceOp::code);
        b[7] = self.fp.algo.code();
        b[8..16].copy_from_slice(&self.fp.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.fp.count.to_le_bytes());
        b[24..28].copy_from_slice(&self.fp.root.unwrap_or(u32::MAX).to_le_bytes());
        b[28..32].copy_from_slice(&self.step.to_le_bytes());
        b[32..36].copy_from_slice(&self.seg.to_le_bytes());
        b[36..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..48].copy_from_slice(&self.fp.comm.to_le_bytes());
        b
    }

    /// Parses a header; any malformed field is an error message, never a panic.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if b[0..4] != FRAME_MAGIC {
            return Err(format!(
                "bad frame magic {:02x?} (expected {:02x?}): not a ferroccl peer, or the stream lost its framing",
                &b[0..4],
                FRAME_MAGIC
            ));
        }
        let kind =
            OpKind::from_code(b[4]).ok_or_else(|| format!("unknown collective kind {}", b[4]))?;
        let dtype = DataType::from_code(b[5]).ok_or_else(|| format!("unknown dtype {}", b[5]))?;
        let op = match b[6] {
            255 => None,
            c => Some(ReduceOp::from_code(c).ok_or_else(|| format!("unknown reduce op {c}"))?),
        };
        let algo =
            Algorithm::from_code(b[7]).ok_or_else(|| format!("unknown algorithm {}", b[7]))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let root = match u32_at(24) {
            u32::MAX => None,
            r => Some(r),
        };
        Ok(FrameHeader {
            fp: Fingerprint {
                kind,
                seq: u64_at(8),
                dtype,
                op,
                count: u64_at(16),
                root,
                algo,
                comm: u64_at(40),
            },
            step: u32_at(28),
            seg: u32_at(32),
            len: u32_at(36),
        })
    }
}

/// Bytes a link has carried, split into frame headers and payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireStats {
    /// Payload bytes sent.
    pub payload_sent: u64,
    /// Header bytes sent.
    pub header_sent: u64,
    /// Payload bytes received.
    pub payload_recv: u64,
    /// Header bytes received.
    pub header_recv: u64,
}

impl WireStats {
    /// Field-wise sum.
    pub fn add(&mut self, o: &WireStats) {
        self.payload_sent += o.payload_sent;
        self.header_sent += o.header_sent;
        self.payload_recv += o.payload_recv;
        self.header_recv += o.header_recv;
    }

    /// Field-wise difference `self - earlier` (for measuring one operation).
    pub fn since(&self, earlier: &WireStats) -> WireStats {
        WireStats {
            payload_sent: self.payload_sent - earlier.payload_sent,
            header_sent: self.header_sent - earlier.header_sent,
            payload_recv: self.payload_recv - earlier.payload_recv,
            header_recv: self.header_recv - earlier.header_recv,
        }
    }
}

/// A link plus its byte accounting.
pub(crate) struct Peer {
    pub link: Box<dyn Link>,
    pub stats: WireStats,
    /// A frame has been partly written (a notice now would break the framing).
    pub out_mid: bool,
    /// A frame has been partly read (the next bytes are not a header).
    pub in_mid: bool,
}

impl Peer {
    pub fn new(link: Box<dyn Link>) -> Self {
        Peer {
            link,
            stats: WireStats::default(),
            out_mid: false,
            in_mid: false,
        }
    }
}

/// What went wrong while moving a frame.
pub(crate) enum FrameError {
    /// The link failed.
    Link(LinkError),
    /// The header that arrived is not the one expected.
    Unexpected {
        got: Result<FrameHeader, String>,
        expected: FrameHeader,
    },
    /// The peer gave up and sent a notice instead of the frame.
    Notice { origin: usize, cause: String },
}

impl From<LinkError> for FrameError {
    fn from(e: LinkError) -> Self {
        FrameError::Link(e)
    }
}

/// A frame being written: header then payload, resumable after a partial write. The
/// payload is handed in at every call (the same bytes each time), so the frame holds
/// no reference into the buffer between calls.
pub(crate) struct OutFrame {
    header: [u8; HEADER_LEN],
    hdr_done: usize,
    len: usize,
    done: usize,
}

impl OutFrame {
    /// A frame with header `h` (whose `len` is the payload's).
    pub fn new(h: &FrameHeader) -> Self {
        OutFrame {
            header: h.encode(),
            hdr_done: 0,
            len: h.len as usize,
            done: 0,
        }
    }

    /// Writes what the link takes of the header and `payload` (the frame's whole
    /// payload). Returns `(bytes moved, complete)`.
    pub fn progress(
        &mut self,
        peer: &mut Peer,
        payload: &[u8],
    ) -> Result<(usize, bool), FrameError> {
        debug_assert_eq!(payload.len(), self.len);
        let mut moved = 0;
        loop {
            if self.hdr_done == HEADER_LEN && self.done == self.len {
                peer.out_mid = false;
                return Ok((moved, true));
            }
            let bufs = [
                IoSlice::new(&self.header[self.hdr_done..]),
                IoSlice::new(&payload[self.done..]),
            ];
            let n = peer.link.try_write(&bufs)?;
            if n == 0 {
                return Ok((moved, false));
            }
            peer.out_mid = true;
            moved += n;
            let h = n.min(HEADER_LEN - self.hdr_done);
            self.hdr_done += h;
            self.done += n - h;
            peer.stats.header_sent += h as u64;
            peer.stats.payload_sent += (n - h) as u64;
        }
    }
}

/// A frame being read into a known place, checked against the header we expect.
pub(crate) struct InFrame {
    expected: FrameHeader,
    header: [u8; HEADER_LEN],
    hdr_done: usize,
    checked: bool,
    len: usize,
    done: usize,
}

impl InFrame {
    /// A frame expected to carry header `expected`.
    pub fn new(expected: FrameHeader) -> Self {
        InFrame {
            expected,
            header: [0; HEADER_LEN],
            hdr_done: 0,
            checked: false,
            len: expected.len as usize,
            done: 0,
        }
    }

    /// Reads what the link has into `dst` (the frame's whole payload destination).
    /// Returns `(bytes moved, complete)`.
    ///
    /// Header and payload are read with one vectored call, so a small frame costs one
    /// system call; the header is checked as soon as it is complete, before the frame
    /// counts as received.
    pub fn progress(
        &mut self,
        peer: &mut Peer,
        dst: &mut [u8],
    ) -> Result<(usize, bool), FrameError> {
        debug_assert_eq!(dst.len(), self.len);
        let mut moved = 0;
        loop {
            if self.hdr_done == HEADER_LEN && !self.checked {
                if let Some((origin, len)) = notice_header(&self.header) {
                    // Cause bytes may already have landed in `dst`.
                    let first = dst[..self.done].to_vec();
                    peer.in_mid = false;
                    return Err(finish_notice(peer, origin, len, &first));
                }
                let got = FrameHeader::decode(&self.header);
                if got.as_ref() != Ok(&self.expected) {
                    return Err(FrameError::Unexpected {
                        got,
                        expected: self.expected,
                    });
                }
                self.checked = true;
            }
            if self.checked && self.done == self.len {
                peer.in_mid = false;
                return Ok((moved, true));
            }
            let mut bufs = [
                IoSliceMut::new(&mut self.header[self.hdr_done..]),
                IoSliceMut::new(&mut dst[self.done..]),
            ];
            let n = peer.link.try_read(&mut bufs)?;
            if n == 0 {
                return Ok((moved, false));
            }
            peer.in_mid = true;
            moved += n;
            let h = n.min(HEADER_LEN - self.hdr_done);
            self.hdr_done += h;
            self.done += n - h;
            peer.stats.header_recv += h as u64;
            peer.stats.payload_recv += (n - h) as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> FrameHeader {
        FrameHeader {
            fp: Fingerprint {
                kind: OpKind::AllReduce,
                seq: 17,
                dtype: DataType::BF16,
                op: Some(ReduceOp::Max),
                count: 1 << 40,
                root: None,
                algo: Algorithm::Ring,
                comm: 0,
            },
            step: 3,
            seg: 9,
            len: 4096,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = header();
        assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        let mut r = h;
        r.fp.root = Some(5);
        r.fp.op = None;
        r.fp.algo = Algorithm::RecursiveDoubling;
        r.fp.comm = 0x0123_4567_89ab_cdef;
        assert_eq!(FrameHeader::decode(&r.encode()), Ok(r));
    }

    #[test]
    fn a_frame_of_the_call_is_one_whatever_its_pair_count() {
        let call = header().fp;
        let mut other = call;
        other.count = 3;
        // All-reduce frames carry the call's count: another count is another call.
        assert!(of_call(&call, &call) && !of_call(&other, &call));
        for kind in [OpKind::AllToAll, OpKind::Gather, OpKind::Scatter] {
            let call = Fingerprint { kind, ..call };
            let pair = Fingerprint { count: 0, ..call };
            assert!(of_call(&pair, &call), "{kind:?}");
            // Anything else that differs is another call.
            for h in [
                Fingerprint { seq: 18, ..pair },
                Fingerprint {
                    root: Some(1),
                    ..pair
                },
                Fingerprint {
                    dtype: DataType::F32,
                    ..pair
                },
                Fingerprint {
                    kind: OpKind::Broadcast,
                    ..pair
                },
                Fingerprint { comm: 9, ..pair },
            ] {
                assert!(!of_call(&h, &call), "{kind:?} {h}");
            }
        }
    }

    #[test]
    fn bad_magic_is_named() {
        let mut b = header().encode();
        b[0] = b'X';
        let e = FrameHeader::decode(&b).unwrap_err();
        assert!(e.contains("magic"), "{e}");
    }

    #[test]
    fn fingerprint_reads_like_a_call() {
        assert_eq!(
            header().fp.to_string(),
            "all_reduce #17 (bfloat16, 1099511627776 elements, max, ring)"
        );
        let mut child = header().fp;
        child.comm = 0xab;
        assert_eq!(
            child.to_string(),
            "all_reduce #17 (bfloat16, 1099511627776 elements, max, ring) on communicator \
             0x00000000000000ab"
        );
        // A piece of a staged device all-reduce differs from a whole host call.
        let mut piece = header().fp;
        piece.root = Some(2);
        assert_ne!(piece, header().fp);
        assert_eq!(
            piece.to_string(),
            "all_reduce #17 (bfloat16, 1099511627776 elements, max, a staged piece with 2 \
             more after it, ring)"
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform32(any::<u8>()), tail in any::<[u8; 16]>()) {
            let mut b = [0u8; HEADER_LEN];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&tail);
            if let Ok(h) = FrameHeader::decode(&b) {
                // Whatever decodes re-encodes to the same bytes.
                prop_assert_eq!(h.encode(), b);
            }
        }
    }
}
