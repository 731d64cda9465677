//! The store's wire protocol: frames, limits, requests and replies, and their encoding
//! and decoding. Pure: nothing here touches a socket beyond `impl Read`.

use crate::error::Result;
use std::io::{self, Read};

/// Largest key the store accepts, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value the store accepts, in bytes.
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// First bytes of every frame: "FerroCcl RendezVous".
const MAGIC: [u8; 4] = *b"FCRV";
/// The protocol version this build speaks.
const VERSION: u16 = 1;
/// Bytes in a frame header.
const HEADER_LEN: usize = 12;
/// Largest job identity in a JOIN, in bytes.
pub const MAX_JOB_ID_LEN: usize = 256;
/// Largest error message in an ERROR frame; longer ones are truncated when sent.
const MAX_MESSAGE_LEN: usize = 16 * 1024;

/// Frame kinds.
pub(super) mod kind {
    pub const JOIN: u8 = 0x01;
    pub const SET: u8 = 0x02;
    pub const GET: u8 = 0x03;
    pub const ADD: u8 = 0x04;
    pub const AUTH: u8 = 0x05;
    pub const PROOF: u8 = 0x06;
    pub const TIME: u8 = 0x07;
    pub const WHO: u8 = 0x08;
    pub const JOINED: u8 = 0x81;
    pub const DONE: u8 = 0x82;
    pub const VALUE: u8 = 0x83;
    pub const COUNT: u8 = 0x84;
    pub const CHALLENGE: u8 = 0x85;
    pub const ERROR: u8 = 0xFF;
}

/// What an ERROR frame says went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum ErrorCode {
    /// Wrong magic, version or kind, or a body that does not parse.
    Malformed = 1,
    /// A length over the protocol's limits.
    TooLarge = 2,
    /// JOIN with a world size that differs from the store's.
    WorldSize = 3,
    /// JOIN with a rank outside `0..world_size`.
    RankRange = 4,
    /// JOIN by a rank that already joined.
    DuplicateRank = 5,
    /// GET whose key was not set before its timeout.
    Timeout = 6,
    /// ADD on a key that holds something other than a counter, or an overflow.
    NotCounter = 7,
    /// The store is stopping.
    ShuttingDown = 8,
    /// A request before authentication, or a proof that does not verify.
    Unauthorized = 9,
    /// JOIN by a rank of another job (its launcher's job identity differs).
    OtherJob = 10,
}

impl ErrorCode {
    pub(super) fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Malformed,
            2 => Self::TooLarge,
            3 => Self::WorldSize,
            4 => Self::RankRange,
            5 => Self::DuplicateRank,
            6 => Self::Timeout,
            7 => Self::NotCounter,
            8 => Self::ShuttingDown,
            9 => Self::Unauthorized,
            10 => Self::OtherJob,
            _ => return None,
        })
    }

    /// Whether the server closes the connection after sending this error.
    pub(super) fn closes_connection(self) -> bool {
        matches!(
            self,
            Self::Malformed
                | Self::TooLarge
                | Self::ShuttingDown
                | Self::Unauthorized
                | Self::OtherJob
        )
    }
}

/// A protocol-level failure: what to put in the ERROR frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct WireError {
    pub(super) code: ErrorCode,
    pub(super) message: String,
}

impl WireError {
    fn malformed(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::Malformed,
            message: message.into(),
        }
    }
    fn too_large(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::TooLarge,
            message: message.into(),
        }
    }
}

/// Why reading a frame stopped.
#[derive(Debug)]
pub(super) enum ReadError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The socket failed (including a timeout or a close in the middle of a frame).
    Io(io::Error),
    /// The bytes break the protocol.
    Wire(WireError),
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    kind: u8,
    len: u32,
}

/// A client's request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Request {
    Join {
        rank: u64,
        world_size: u64,
        /// The launcher's job identity (empty: none known). Clients of version 1
        /// without it send 16 bytes, which decode as none.
        job_id: String,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    /// Starts authentication with the client's nonce.
    Auth {
        nonce: [u8; super::auth::NONCE_LEN],
    },
    /// The client's answer to the challenge.
    Proof {
        mac: [u8; super::auth::MAC_LEN],
    },
    /// The store's clock (nanoseconds since the Unix epoch, as a COUNT): the flight
    /// recorder's reference clock.
    Time,
    /// Which job this store serves (a VALUE with the job identity, empty when none):
    /// answered before authentication, so that a rank 0 that finds its port taken can
    /// say whose store holds it.
    Who,
}

/// The store's reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Response {
    Joined {
        comm_id: u64,
    },
    Done,
    Value(Vec<u8>),
    Count(i64),
    /// The store's nonce and its own proof of the token.
    Challenge {
        nonce: [u8; super::auth::NONCE_LEN],
        mac: [u8; super::auth::MAC_LEN],
    },
    /// `code` is kept raw so that codes from a newer store still reach the caller.
    Error {
        code: u8,
        message: String,
    },
}

fn encode_frame(kind: u8, body: &[u8]) -> Vec<u8> {
    // Our own bodies are bounded by MAX_KEY_LEN + MAX_VALUE_LEN + a few bytes.
    assert!(body.len() <= u32::MAX as usize, "frame body too large");
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind);
    out.push(0);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn put_key(body: &mut Vec<u8>, key: &str) {
    body.extend_from_slice(&(key.len() as u32).to_le_bytes());
    body.extend_from_slice(key.as_bytes());
}

pub(super) fn encode_request(req: &Request) -> Vec<u8> {
    let mut body = Vec::new();
    let kind = match req {
        Request::Join {
            rank,
            world_size,
            job_id,
        } => {
            body.extend_from_slice(&rank.to_le_bytes());
            body.extend_from_slice(&world_size.to_le_bytes());
            body.extend_from_slice(job_id.as_bytes());
            kind::JOIN
        }
        Request::Set { key, value } => {
            put_key(&mut body, key);
            body.extend_from_slice(value);
            kind::SET
        }
        Request::Get { key, timeout_ms } => {
            put_key(&mut body, key);
            body.extend_from_slice(&timeout_ms.to_le_bytes());
            kind::GET
        }
        Request::Add { key, delta } => {
            put_key(&mut body, key);
            body.extend_from_slice(&delta.to_le_bytes());
            kind::ADD
        }
        Request::Auth { nonce } => {
            body.extend_from_slice(nonce);
            kind::AUTH
        }
        Request::Proof { mac } => {
            body.extend_from_slice(mac);
            kind::PROOF
        }
        Request::Time => kind::TIME,
        Request::Who => kind::WHO,
    };
    encode_frame(kind, &body)
}

/// The longest prefix of `s` that fits in `max` bytes without splitting a character.
fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

pub(super) fn encode_response(resp: &Response) -> Vec<u8> {
    match resp {
        Response::Joined { comm_id } => encode_frame(kind::JOINED, &comm_id.to_le_bytes()),
        Response::Done => encode_frame(kind::DONE, &[]),
        Response::Value(v) => encode_frame(kind::VALUE, v),
        Response::Count(n) => encode_frame(kind::COUNT, &n.to_le_bytes()),
        Response::Challenge { nonce, mac } => {
            let mut body = nonce.to_vec();
            body.extend_from_slice(mac);
            encode_frame(kind::CHALLENGE, &body)
        }
        Response::Error { code, message } => {
            let message = truncate_utf8(message, MAX_MESSAGE_LEN);
            let mut body = Vec::with_capacity(1 + message.len());
            body.push(*code);
            body.extend_from_slice(message.as_bytes());
            encode_frame(kind::ERROR, &body)
        }
    }
}

/// Checks magic, version and the reserved byte.
fn decode_header(b: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
    if b[0..4] != MAGIC {
        return Err(WireError::malformed(format!(
            "bad magic {:02x?} (expected {:02x?} \"FCRV\"): not a ferroccl rendezvous peer",
            &b[0..4],
            MAGIC
        )));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(WireError::malformed(format!(
            "protocol version {version} is not supported (this side speaks version {VERSION})"
        )));
    }
    if b[7] != 0 {
        return Err(WireError::malformed(format!(
            "reserved header byte is {:#04x}, expected 0",
            b[7]
        )));
    }
    Ok(Header {
        kind: b[6],
        len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
    })
}

/// The largest body a request of this kind can have; `None` for an unknown kind.
fn request_body_limit(kind: u8) -> Option<usize> {
    match kind {
        kind::JOIN => Some(16 + MAX_JOB_ID_LEN),
        kind::SET => Some(4 + MAX_KEY_LEN + MAX_VALUE_LEN),
        kind::GET | kind::ADD => Some(4 + MAX_KEY_LEN + 8),
        kind::AUTH => Some(super::auth::NONCE_LEN),
        kind::PROOF => Some(super::auth::MAC_LEN),
        kind::TIME | kind::WHO => Some(0),
        _ => None,
    }
}

/// The largest body a reply of this kind can have; `None` for an unknown kind.
fn response_body_limit(kind: u8) -> Option<usize> {
    match kind {
        kind::JOINED | kind::COUNT => Some(8),
        kind::CHALLENGE => Some(super::auth::NONCE_LEN + super::auth::MAC_LEN),
        kind::DONE => Some(0),
        kind::VALUE => Some(MAX_VALUE_LEN),
        kind::ERROR => Some(1 + MAX_MESSAGE_LEN),
        _ => None,
    }
}

/// A bounds-checked cursor over a frame body.
struct Body<'a> {
    buf: &'a [u8],
}

impl<'a> Body<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::malformed(format!(
                "body ends before {what} ({n} bytes wanted, {} left)",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array8(&mut self, what: &str) -> Result<[u8; 8], WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(a)
    }

    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array8(what)?))
    }

    fn i64(&mut self, what: &str) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(self.array8(what)?))
    }

    fn key(&mut self) -> Result<String, WireError> {
        let mut len = [0u8; 4];
        len.copy_from_slice(self.take(4, "key length")?);
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_KEY_LEN {
            return Err(WireError::too_large(format!(
                "key of {len} bytes exceeds the limit of {MAX_KEY_LEN} bytes"
            )));
        }
        let bytes = self.take(len, "key")?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::malformed("key is not UTF-8"))
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    fn finish(&self, what: &str) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::malformed(format!(
                "{} unexpected bytes after the {what} body",
                self.buf.len()
            )))
        }
    }
}

/// Parses a request body. Pure: the network never reaches anything but this and
/// [`decode_header`].
fn decode_request(kind: u8, body: &[u8]) -> Result<Request, WireError> {
    let mut b = Body { buf: body };
    let req = match kind {
        kind::JOIN => {
            let rank = b.u64("rank")?;
            let world_size = b.u64("world size")?;
            let job_id = std::str::from_utf8(b.rest())
                .map_err(|_| WireError::malformed("job identity is not UTF-8"))?
                .to_owned();
            Request::Join {
                rank,
                world_size,
                job_id,
            }
        }
        kind::SET => {
            let key = b.key()?;
            let value = b.rest();
            if value.len() > MAX_VALUE_LEN {
                return Err(WireError::too_large(format!(
                    "value of {} bytes exceeds the limit of {MAX_VALUE_LEN} bytes",
                    value.len()
                )));
            }
            Request::Set {
                key,
                value: value.to_vec(),
            }
        }
        kind::GET => {
            let key = b.key()?;
            let timeout_ms = b.u64("timeout")?;
            b.finish("GET")?;
            Request::Get { key, timeout_ms }
        }
        kind::ADD => {
            let key = b.key()?;
            let delta = b.i64("delta")?;
            b.finish("ADD")?;
            Request::Add { key, delta }
        }
        kind::AUTH => {
            let mut nonce = [0u8; super::auth::NONCE_LEN];
            nonce.copy_from_slice(b.take(super::auth::NONCE_LEN, "nonce")?);
            b.finish("AUTH")?;
            Request::Auth { nonce }
        }
        kind::PROOF => {
            let mut mac = [0u8; super::auth::MAC_LEN];
            mac.copy_from_slice(b.take(super::auth::MAC_LEN, "proof")?);
            b.finish("PROOF")?;
            Request::Proof { mac }
        }
        kind::TIME => {
            b.finish("TIME")?;
            Request::Time
        }
        kind::WHO => {
            b.finish("WHO")?;
            Request::Who
        }
        other => {
            return Err(WireError::malformed(format!(
                "unknown request kind {other:#04x}"
            )))
        }
    };
    Ok(req)
}

/// Parses a reply body.
fn decode_response(kind: u8, body: &[u8]) -> Result<Response, WireError> {
    let mut b = Body { buf: body };
    let resp = match kind {
        kind::JOINED => {
            let comm_id = b.u64("communicator id")?;
            b.finish("JOINED")?;
            Response::Joined { comm_id }
        }
        kind::DONE => {
            b.finish("DONE")?;
            Response::Done
        }
        kind::VALUE => {
            if body.len() > MAX_VALUE_LEN {
                return Err(WireError::too_large(format!(
                    "value of {} bytes exceeds the limit of {MAX_VALUE_LEN} bytes",
                    body.len()
                )));
            }
            Response::Value(body.to_vec())
        }
        kind::COUNT => {
            let n = b.i64("count")?;
            b.finish("COUNT")?;
            Response::Count(n)
        }
        kind::CHALLENGE => {
            let mut nonce = [0u8; super::auth::NONCE_LEN];
            nonce.copy_from_slice(b.take(super::auth::NONCE_LEN, "nonce")?);
            let mut mac = [0u8; super::auth::MAC_LEN];
            mac.copy_from_slice(b.take(super::auth::MAC_LEN, "proof")?);
            b.finish("CHALLENGE")?;
            Response::Challenge { nonce, mac }
        }
        kind::ERROR => {
            let code = b.take(1, "error code")?[0];
            let message = String::from_utf8_lossy(b.rest()).into_owned();
            Response::Error { code, message }
        }
        other => {
            return Err(WireError::malformed(format!(
                "unknown reply kind {other:#04x}"
            )))
        }
    };
    Ok(resp)
}

/// Fills `buf`; [`ReadError::Closed`] if the peer closed before sending any byte of it.
fn read_exact_or_closed(r: &mut impl Read, buf: &mut [u8]) -> Result<(), ReadError> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Err(ReadError::Closed),
            Ok(0) => {
                return Err(ReadError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame header",
                )))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

pub(super) fn read_header(r: &mut impl Read) -> Result<Header, ReadError> {
    let mut b = [0u8; HEADER_LEN];
    read_exact_or_closed(r, &mut b)?;
    decode_header(&b).map_err(ReadError::Wire)
}

/// Reads a body of `header.len` bytes after checking it against `limit`, so that a
/// length from the wire never drives an allocation past the protocol's bounds.
fn read_body(
    r: &mut impl Read,
    header: Header,
    limit: Option<usize>,
    side: &str,
) -> Result<Vec<u8>, ReadError> {
    let Some(limit) = limit else {
        return Err(ReadError::Wire(WireError::malformed(format!(
            "unknown {side} kind {:#04x}",
            header.kind
        ))));
    };
    let len = usize::try_from(header.len).unwrap_or(usize::MAX);
    if len > limit {
        return Err(ReadError::Wire(WireError::too_large(format!(
            "a {side} of kind {:#04x} with a {len}-byte body exceeds the limit of {limit} bytes \
             (keys are at most {MAX_KEY_LEN} bytes, values at most {MAX_VALUE_LEN})",
            header.kind
        ))));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(ReadError::Io)?;
    Ok(body)
}

pub(super) fn read_request_body(r: &mut impl Read, header: Header) -> Result<Request, ReadError> {
    let body = read_body(r, header, request_body_limit(header.kind), "request")?;
    decode_request(header.kind, &body).map_err(ReadError::Wire)
}

/// Reads one request frame.
#[cfg(test)]
fn read_request(r: &mut impl Read) -> Result<Request, ReadError> {
    let header = read_header(r)?;
    read_request_body(r, header)
}

/// A frame header of `kind` announcing a `len`-byte body, for tests that forge frames.
#[cfg(test)]
pub(super) fn header(kind: u8, len: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&[kind, 0]);
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// Reads one reply frame.
pub(super) fn read_response(r: &mut impl Read) -> Result<Response, ReadError> {
    let header = read_header(r)?;
    let body = read_body(r, header, response_body_limit(header.kind), "reply")?;
    decode_response(header.kind, &body).map_err(ReadError::Wire)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn wire_code(r: Result<Request, ReadError>) -> ErrorCode {
        match r {
            Err(ReadError::Wire(w)) => w.code,
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    #[test]
    fn requests_round_trip() {
        let cases = [
            Request::Join {
                rank: 3,
                world_size: 8,
                job_id: String::new(),
            },
            Request::Join {
                rank: 1,
                world_size: 2,
                job_id: "Slurm job 77 step 3".into(),
            },
            Request::Who,
            Request::Set {
                key: "addr/3".into(),
                value: b"10.0.0.3:4000".to_vec(),
            },
            Request::Set {
                key: String::new(),
                value: vec![],
            },
            Request::Get {
                key: "addr/1".into(),
                timeout_ms: u64::MAX,
            },
            Request::Add {
                key: "barrier".into(),
                delta: -7,
            },
        ];
        for req in cases {
            let bytes = encode_request(&req);
            assert_eq!(read_request(&mut &bytes[..]).ok(), Some(req));
        }
    }

    #[test]
    fn header_checks_magic_version_and_reserved_byte() {
        let mut bad_magic = header(kind::JOIN, 16);
        bad_magic[0] = b'G';
        let mut bad_version = header(kind::JOIN, 16);
        bad_version[4] = 9;
        let mut bad_reserved = header(kind::JOIN, 16);
        bad_reserved[7] = 1;
        for (bytes, needle) in [
            (bad_magic, "magic"),
            (bad_version, "version 9"),
            (bad_reserved, "reserved"),
        ] {
            match read_request(&mut &bytes[..]) {
                Err(ReadError::Wire(w)) => {
                    assert_eq!(w.code, ErrorCode::Malformed);
                    assert!(w.message.contains(needle), "{}", w.message);
                }
                other => panic!("expected a protocol error, got {other:?}"),
            }
        }
        let unknown = header(0x42, 0);
        assert_eq!(
            wire_code(read_request(&mut &unknown[..])),
            ErrorCode::Malformed
        );
    }

    #[test]
    fn oversize_lengths_are_refused_before_reading_the_body() {
        // Only the header is there: an attempt to read (or allocate) the 4 GiB body would
        // be an I/O error (unexpected EOF), not a TooLarge protocol error.
        for kind in [kind::JOIN, kind::SET, kind::GET, kind::ADD] {
            let bytes = header(kind, u32::MAX);
            assert_eq!(
                wire_code(read_request(&mut &bytes[..])),
                ErrorCode::TooLarge
            );
        }
        let just_over = header(kind::SET, (4 + MAX_KEY_LEN + MAX_VALUE_LEN + 1) as u32);
        assert_eq!(
            wire_code(read_request(&mut &just_over[..])),
            ErrorCode::TooLarge
        );
        // The same on the client side for replies.
        let reply = encode_frame(kind::VALUE, &[]);
        let mut big = reply[..8].to_vec();
        big.extend_from_slice(&((MAX_VALUE_LEN + 1) as u32).to_le_bytes());
        assert!(matches!(
            read_response(&mut &big[..]),
            Err(ReadError::Wire(WireError {
                code: ErrorCode::TooLarge,
                ..
            }))
        ));
    }

    #[test]
    fn key_and_value_limits_inside_the_body() {
        // A key length over the limit inside a small body.
        let mut body = ((MAX_KEY_LEN + 1) as u32).to_le_bytes().to_vec();
        body.extend_from_slice(&[0; 8]);
        assert_eq!(
            decode_request(kind::GET, &body).map_err(|e| e.code),
            Err(ErrorCode::TooLarge)
        );
        // A key length that runs past the end of the body.
        let mut body = 100u32.to_le_bytes().to_vec();
        body.extend_from_slice(b"short");
        assert_eq!(
            decode_request(kind::SET, &body).map_err(|e| e.code),
            Err(ErrorCode::Malformed)
        );
        // A value over the limit that still fits the SET body limit (short key).
        let mut body = 1u32.to_le_bytes().to_vec();
        body.push(b'k');
        body.resize(body.len() + MAX_VALUE_LEN + 1, 7);
        assert!(body.len() <= request_body_limit(kind::SET).unwrap_or(0));
        assert_eq!(
            decode_request(kind::SET, &body).map_err(|e| e.code),
            Err(ErrorCode::TooLarge)
        );
        // The largest legal key and value are accepted.
        let req = Request::Set {
            key: "k".repeat(MAX_KEY_LEN),
            value: vec![1; MAX_VALUE_LEN],
        };
        let bytes = encode_request(&req);
        assert_eq!(read_request(&mut &bytes[..]).ok(), Some(req));
        // A job identity that is not UTF-8, and non-UTF-8 keys, are refused.
        let mut join = 0u64.to_le_bytes().to_vec();
        join.extend_from_slice(&1u64.to_le_bytes());
        join.push(0xff);
        assert!(decode_request(kind::JOIN, &join).is_err());
        let mut bad_key = 2u32.to_le_bytes().to_vec();
        bad_key.extend_from_slice(&[0xff, 0xfe]);
        bad_key.extend_from_slice(&0i64.to_le_bytes());
        assert!(decode_request(kind::ADD, &bad_key).is_err());
    }

    #[test]
    fn error_messages_are_truncated_on_a_char_boundary() {
        let long = "é".repeat(MAX_MESSAGE_LEN); // 2 bytes each
        let frame = encode_response(&Response::Error {
            code: 1,
            message: long,
        });
        match read_response(&mut &frame[..]) {
            Ok(Response::Error { code: 1, message }) => {
                assert!(message.len() <= MAX_MESSAGE_LEN);
                assert!(message.chars().all(|c| c == 'é'));
            }
            other => panic!("{other:?}"),
        }
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        let key = "[a-z0-9/_.-]{0,40}";
        prop_oneof![
            (any::<u64>(), any::<u64>(), "[ -~]{0,40}").prop_map(|(rank, world_size, job_id)| {
                Request::Join {
                    rank,
                    world_size,
                    job_id,
                }
            }),
            (key, proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(key, value)| Request::Set { key, value }),
            (key, any::<u64>()).prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
            (key, any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            // Read frames until the stream fails, as a server connection would.
            let mut r = &bytes[..];
            for _ in 0..64 {
                if read_request(&mut r).is_err() { break; }
            }
            let mut r = &bytes[..];
            for _ in 0..64 {
                if read_response(&mut r).is_err() { break; }
            }
            if let Some((&kind, body)) = bytes.split_first() {
                let _ = decode_request(kind, body);
                let _ = decode_response(kind, body);
            }
        }

        #[test]
        fn valid_header_with_arbitrary_body_never_panics(
            kind in prop_oneof![Just(kind::JOIN), Just(kind::SET), Just(kind::GET), Just(kind::ADD), any::<u8>()],
            len in any::<u32>(),
            body in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut bytes = header(kind, len);
            bytes.extend_from_slice(&body);
            let _ = read_request(&mut &bytes[..]);
        }

        #[test]
        fn encoded_requests_decode_to_themselves(req in arb_request()) {
            let bytes = encode_request(&req);
            prop_assert_eq!(read_request(&mut &bytes[..]).ok(), Some(req));
        }
    }
}
