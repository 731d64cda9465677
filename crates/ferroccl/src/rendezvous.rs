//! Who am I, and where are my peers.
//!
//! [`detect_env`] reads the launcher's environment (torchrun, Slurm, Open MPI, PMI); this
//! module is the only place in the crate that reads environment variables. The
//! [`StoreServer`] is a small TCP key-value store that rank 0 serves at
//! `MASTER_ADDR:MASTER_PORT`; every rank joins it with a [`StoreClient`], publishes its
//! listening address and looks up its peers'.
//!
//! # Wire protocol (version 1)
//!
//! Every message, both ways, is one frame: a 12-byte header then a body. Integers are
//! little-endian.
//!
//! ```text
//! offset  size  field
//!      0     4  magic, the bytes "FCRV"
//!      4     2  protocol version (1)
//!      6     1  kind (below)
//!      7     1  reserved, must be 0
//!      8     4  body length in bytes
//!     12     *  body
//! ```
//!
//! | kind   | direction | body                                                   |
//! |--------|-----------|--------------------------------------------------------|
//! | `0x01` JOIN   | request | rank `u64`, world size `u64`                     |
//! | `0x02` SET    | request | key length `u32`, key (UTF-8), value (the rest)  |
//! | `0x03` GET    | request | key length `u32`, key, timeout in ms `u64`       |
//! | `0x04` ADD    | request | key length `u32`, key, delta `i64`               |
//! | `0x81` JOINED | reply   | communicator id `u64`                            |
//! | `0x82` DONE   | reply   | empty (answers SET)                              |
//! | `0x83` VALUE  | reply   | the value (answers GET)                          |
//! | `0x84` COUNT  | reply   | new counter value `i64` (answers ADD)            |
//! | `0xFF` ERROR  | reply   | error code `u8`, message (UTF-8, the rest)       |
//!
//! Each body length is checked against the largest body its kind can have before
//! anything is allocated; keys are at most [`MAX_KEY_LEN`] bytes and values at most
//! [`MAX_VALUE_LEN`]. A peer with the wrong magic or version, an unknown kind, an
//! oversized or malformed frame gets an ERROR frame (when it can still be written) and
//! its connection is closed; everyone else is served on.
//!
//! ADD keeps its counter in the same key space as SET, as decimal ASCII, so a GET of a
//! counter returns e.g. `b"3"`.

use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// ---------------------------------------------------------------------------------------
// Launcher environment
// ---------------------------------------------------------------------------------------

/// What the launcher told this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// `MASTER_ADDR`, when set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, when set.
    pub master_port: Option<u16>,
    /// Which launcher the variables came from: `torchrun`, `openmpi`, `pmi`, `slurm`.
    pub source: &'static str,
    /// `FERROCCL_TOKEN`, the job token, when set (see [`crate::auth`]).
    pub token: Option<String>,
    /// `FERROCCL_RDMA_GID_INDEX`: the GID table index the RDMA transport routes with
    /// (RoCE v2 setups often need one other than 0; `show_gids` lists them).
    pub rdma_gid_index: Option<u8>,
}

/// The variables one launcher family sets.
struct Family {
    source: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    /// Whether the size variable without the rank variable is a contradiction. Slurm's
    /// `salloc` exports `SLURM_NTASKS` into the allocation's interactive shell, where no
    /// task exists yet, so for Slurm it only means "not started by srun".
    lone_size_is_error: bool,
}

/// Launcher families, in order of precedence.
const FAMILIES: [Family; 4] = [
    Family {
        source: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        lone_size_is_error: true,
    },
    Family {
        source: "openmpi",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        lone_size_is_error: true,
    },
    Family {
        source: "pmi",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        lone_size_is_error: true,
    },
    Family {
        source: "slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        lone_size_is_error: false,
    },
];

/// Reads the launcher environment of this process; `Ok(None)` when no launcher set one.
pub fn detect_env() -> Result<Option<LaunchEnv>> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect_env`] over any variable lookup (for tests).
///
/// The first family whose rank variable is set wins: torchrun (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`), Open MPI (`OMPI_COMM_WORLD_*`), PMI (`PMI_RANK`, `PMI_SIZE`,
/// `MPI_LOCALRANKID`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
/// `MASTER_ADDR` and `MASTER_PORT` are read whatever the family. Values are trimmed, and
/// a variable set to the empty string counts as unset. Anything incomplete or out of
/// range is an [`Error::Env`] naming the variables.
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
    let var = |name: &str| {
        get(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    for fam in &FAMILIES {
        let (rank, size) = match (var(fam.rank), var(fam.size)) {
            (Some(rank), Some(size)) => (rank, size),
            (None, None) => continue,
            (None, Some(_)) if !fam.lone_size_is_error => continue,
            (None, Some(size)) => {
                return Err(Error::Env(format!(
                "{}={size} is set but {} is not; {} sets both, so the environment is incomplete",
                fam.size, fam.rank, fam.source
            )))
            }
            (Some(rank), None) => {
                return Err(Error::Env(format!(
                "{}={rank} is set but {} is not; {} sets both, so the environment is incomplete",
                fam.rank, fam.size, fam.source
            )))
            }
        };
        let rank = parse_index(fam.rank, &rank)?;
        let world_size = parse_index(fam.size, &size)?;
        if world_size == 0 {
            return Err(Error::Env(format!(
                "{}=0: a job needs at least one rank",
                fam.size
            )));
        }
        if rank >= world_size {
            return Err(Error::Env(format!(
                "{}={rank} is out of range for {}={world_size} (ranks are 0..{world_size})",
                fam.rank, fam.size
            )));
        }
        let local_rank = match var(fam.local_rank) {
            None => None,
            Some(v) => {
                let local = parse_index(fam.local_rank, &v)?;
                if local >= world_size {
                    return Err(Error::Env(format!(
                        "{}={local} is not below {}={world_size}",
                        fam.local_rank, fam.size
                    )));
                }
                Some(local)
            }
        };
        let master_port = var("MASTER_PORT").map(|p| parse_port(&p)).transpose()?;
        let rdma_gid_index = var("FERROCCL_RDMA_GID_INDEX")
            .map(|v| {
                v.trim().parse::<u8>().map_err(|_| {
                    Error::Env(format!(
                        "FERROCCL_RDMA_GID_INDEX='{v}' is not a GID table index (0..=255)"
                    ))
                })
            })
            .transpose()?;
        return Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr: var("MASTER_ADDR"),
            master_port,
            source: fam.source,
            token: var("FERROCCL_TOKEN"),
            rdma_gid_index,
        }));
    }
    Ok(None)
}

/// Parses a rank, size or local rank.
fn parse_index(name: &str, value: &str) -> Result<usize> {
    if let Some(digits) = value.strip_prefix('-') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Error::Env(format!(
                "{name}={value} is negative; it must be a non-negative integer"
            )));
        }
    }
    value.parse::<usize>().map_err(|e| {
        let why = match e.kind() {
            std::num::IntErrorKind::PosOverflow => "is too large",
            _ => "is not a non-negative integer",
        };
        Error::Env(format!("{name}='{value}' {why}"))
    })
}

/// Parses `MASTER_PORT`.
fn parse_port(value: &str) -> Result<u16> {
    match value.parse::<u16>() {
        Ok(0) => Err(Error::Env(
            "MASTER_PORT=0 is not usable: rank 0 serves the store on a fixed port that every \
             rank must know in advance"
                .into(),
        )),
        Ok(port) => Ok(port),
        Err(_) => Err(Error::Env(format!(
            "MASTER_PORT='{value}' is not a TCP port (1..=65535)"
        ))),
    }
}

// ---------------------------------------------------------------------------------------
// Wire format: pure encoding and decoding, no sockets
// ---------------------------------------------------------------------------------------

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
/// Largest error message in an ERROR frame; longer ones are truncated when sent.
const MAX_MESSAGE_LEN: usize = 16 * 1024;

/// Frame kinds.
mod kind {
    pub const JOIN: u8 = 0x01;
    pub const SET: u8 = 0x02;
    pub const GET: u8 = 0x03;
    pub const ADD: u8 = 0x04;
    pub const AUTH: u8 = 0x05;
    pub const PROOF: u8 = 0x06;
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
enum ErrorCode {
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
}

impl ErrorCode {
    fn from_u8(b: u8) -> Option<Self> {
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
            _ => return None,
        })
    }

    /// Whether the server closes the connection after sending this error.
    fn closes_connection(self) -> bool {
        matches!(
            self,
            Self::Malformed | Self::TooLarge | Self::ShuttingDown | Self::Unauthorized
        )
    }
}

/// A protocol-level failure: what to put in the ERROR frame.
#[derive(Clone, Debug, PartialEq, Eq)]
struct WireError {
    code: ErrorCode,
    message: String,
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
enum ReadError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The socket failed (including a timeout or a close in the middle of a frame).
    Io(io::Error),
    /// The bytes break the protocol.
    Wire(WireError),
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    kind: u8,
    len: u32,
}

/// A client's request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Request {
    Join {
        rank: u64,
        world_size: u64,
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
        nonce: [u8; crate::auth::NONCE_LEN],
    },
    /// The client's answer to the challenge.
    Proof {
        mac: [u8; crate::auth::MAC_LEN],
    },
}

/// The store's reply.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Response {
    Joined {
        comm_id: u64,
    },
    Done,
    Value(Vec<u8>),
    Count(i64),
    /// The store's nonce and its own proof of the token.
    Challenge {
        nonce: [u8; crate::auth::NONCE_LEN],
        mac: [u8; crate::auth::MAC_LEN],
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

fn encode_request(req: &Request) -> Vec<u8> {
    let mut body = Vec::new();
    let kind = match req {
        Request::Join { rank, world_size } => {
            body.extend_from_slice(&rank.to_le_bytes());
            body.extend_from_slice(&world_size.to_le_bytes());
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

fn encode_response(resp: &Response) -> Vec<u8> {
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
        kind::JOIN => Some(16),
        kind::SET => Some(4 + MAX_KEY_LEN + MAX_VALUE_LEN),
        kind::GET | kind::ADD => Some(4 + MAX_KEY_LEN + 8),
        kind::AUTH => Some(crate::auth::NONCE_LEN),
        kind::PROOF => Some(crate::auth::MAC_LEN),
        _ => None,
    }
}

/// The largest body a reply of this kind can have; `None` for an unknown kind.
fn response_body_limit(kind: u8) -> Option<usize> {
    match kind {
        kind::JOINED | kind::COUNT => Some(8),
        kind::CHALLENGE => Some(crate::auth::NONCE_LEN + crate::auth::MAC_LEN),
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
            b.finish("JOIN")?;
            Request::Join { rank, world_size }
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
            let mut nonce = [0u8; crate::auth::NONCE_LEN];
            nonce.copy_from_slice(b.take(crate::auth::NONCE_LEN, "nonce")?);
            b.finish("AUTH")?;
            Request::Auth { nonce }
        }
        kind::PROOF => {
            let mut mac = [0u8; crate::auth::MAC_LEN];
            mac.copy_from_slice(b.take(crate::auth::MAC_LEN, "proof")?);
            b.finish("PROOF")?;
            Request::Proof { mac }
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
            let mut nonce = [0u8; crate::auth::NONCE_LEN];
            nonce.copy_from_slice(b.take(crate::auth::NONCE_LEN, "nonce")?);
            let mut mac = [0u8; crate::auth::MAC_LEN];
            mac.copy_from_slice(b.take(crate::auth::MAC_LEN, "proof")?);
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

fn read_header(r: &mut impl Read) -> Result<Header, ReadError> {
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

fn read_request_body(r: &mut impl Read, header: Header) -> Result<Request, ReadError> {
    let body = read_body(r, header, request_body_limit(header.kind), "request")?;
    decode_request(header.kind, &body).map_err(ReadError::Wire)
}

/// Reads one request frame.
#[cfg(test)]
fn read_request(r: &mut impl Read) -> Result<Request, ReadError> {
    let header = read_header(r)?;
    read_request_body(r, header)
}

/// Reads one reply frame.
fn read_response(r: &mut impl Read) -> Result<Response, ReadError> {
    let header = read_header(r)?;
    let body = read_body(r, header, response_body_limit(header.kind), "reply")?;
    decode_response(header.kind, &body).map_err(ReadError::Wire)
}

// ---------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------

/// How often the accept loop looks at the shutdown flag while nobody connects.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// How long a client may take to send the rest of a frame once its header arrived.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the server waits on a client that does not read its reply.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Stack of a connection thread; it holds no large buffers on the stack.
const CONN_STACK: usize = 256 * 1024;

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    joined: HashSet<u64>,
}

/// What the accept thread, the connection threads and the owner share.
struct Shared {
    addr: SocketAddr,
    world_size: usize,
    comm_id: u64,
    /// The job token every connection must prove (see [`crate::auth`]), if any.
    token: Option<Vec<u8>>,
    shutdown: AtomicBool,
    state: Mutex<State>,
    /// Signalled whenever a key changes, and at shutdown.
    changed: Condvar,
    /// A handle on every open connection, so that dropping the server can close them.
    conns: Mutex<HashMap<u64, TcpStream>>,
}

/// The rank-0 key-value store. Dropping it stops serving.
///
/// One accept thread plus one thread per connection; a job has at most a few thousand
/// ranks, each with one connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves a job of `world_size` ranks.
    ///
    /// An address already in use is [`Error::AddrInUse`]. A fresh random communicator id
    /// is drawn here and handed to every rank that joins.
    pub fn bind(addr: SocketAddr, world_size: usize) -> Result<Self> {
        Self::bind_with_token(addr, world_size, None)
    }

    /// [`StoreServer::bind`] for a job with a token: every connection must first prove
    /// it by HMAC challenge-response (see [`crate::auth`]); anything else is refused.
    pub fn bind_with_token(
        addr: SocketAddr,
        world_size: usize,
        token: Option<Vec<u8>>,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "a rendezvous store needs a world size of at least 1".into(),
            ));
        }
        let listener = bind_listener(addr)?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading the address of the store at {addr}"), e))?;
        let shared = Arc::new(Shared {
            addr: local,
            world_size,
            comm_id: new_comm_id(local),
            token,
            shutdown: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
        });
        let for_thread = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("ferroccl-store-accept".into())
            .spawn(move || accept_loop(listener, for_thread))
            .map_err(|e| Error::io("starting the rendezvous store thread", e))?;
        tracing::debug!(addr = %local, world_size, "rendezvous store listening");
        Ok(Self {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The communicator id every rank receives from [`StoreClient::join`].
    pub fn comm_id(&self) -> u64 {
        self.shared.comm_id
    }

    /// The number of ranks this store serves.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // The accept thread sees the flag within ACCEPT_POLL and closes the listener.
        // Only it registers connections, so once it is gone the registry is complete.
        if let Some(handle) = self.accept.take() {
            if handle.join().is_err() {
                tracing::warn!(addr = %self.addr, "rendezvous store accept thread panicked");
            }
        }
        for (_, stream) in lock(&self.shared.conns).drain() {
            // Unblocks the connection thread's read; it may already be closed.
            let _ = stream.shutdown(Shutdown::Both);
        }
        // Wake GET waiters; notifying under the lock means none can miss it.
        let _state = lock(&self.shared.state);
        self.shared.changed.notify_all();
    }
}

fn bind_listener(addr: SocketAddr) -> Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let context =
        |what: &str, e| Error::io(format!("{what} for the rendezvous store at {addr}"), e);
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| context("creating a socket", e))?;
    // Lets rank 0 of the next job rebind while old connections sit in TIME_WAIT; unlike
    // SO_REUSEPORT it does not let two live listeners share the port.
    socket
        .set_reuse_address(true)
        .map_err(|e| context("setting SO_REUSEADDR", e))?;
    socket.bind(&addr.into()).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::AddrInUse {
                addr,
                what: "rendezvous store",
            }
        } else {
            context("binding", e)
        }
    })?;
    socket.listen(4096).map_err(|e| context("listening", e))?;
    let listener: TcpListener = socket.into();
    listener
        .set_nonblocking(true)
        .map_err(|e| context("making the listener non-blocking", e))?;
    Ok(listener)
}

/// A random 64-bit id, never 0, without a `rand` dependency: `RandomState` is seeded
/// from the OS, and time, pid and address make ids from different stores differ further.
fn new_comm_id(addr: SocketAddr) -> u64 {
    let mut h = RandomState::new().build_hasher();
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
        .hash(&mut h);
    std::process::id().hash(&mut h);
    addr.hash(&mut h);
    match h.finish() {
        0 => 1,
        id => id,
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id: u64 = 0;
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                next_id += 1;
                if let Err(e) = spawn_connection(&shared, stream, peer, next_id) {
                    tracing::warn!(%peer, error = %e, "rendezvous store could not serve a connection");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // E.g. out of file descriptors: keep serving those already connected.
                tracing::warn!(addr = %shared.addr, error = %e, "rendezvous store accept failed");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

fn spawn_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT))?;
    lock(&shared.conns).insert(id, stream.try_clone()?);
    let for_thread = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("ferroccl-store-conn-{id}"))
        .stack_size(CONN_STACK)
        .spawn(move || {
            serve_connection(&for_thread, stream, peer);
            lock(&for_thread.conns).remove(&id);
        });
    if let Err(e) = spawned {
        lock(&shared.conns).remove(&id);
        return Err(e);
    }
    Ok(())
}

fn serve_connection(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    let mut auth = if shared.token.is_some() {
        AuthState::Required
    } else {
        AuthState::Open
    };
    loop {
        // Between requests a client may stay idle for the whole job: no read timeout.
        let request = read_header(&mut stream).and_then(|header| {
            if let Err(e) = stream.set_read_timeout(Some(BODY_TIMEOUT)) {
                return Err(ReadError::Io(e));
            }
            let request = read_request_body(&mut stream, header);
            if let Err(e) = stream.set_read_timeout(None) {
                return Err(ReadError::Io(e));
            }
            request
        });
        let request = match request {
            Ok(request) => request,
            Err(ReadError::Closed) => return,
            Err(ReadError::Io(e)) => {
                if !shared.shutdown.load(Ordering::SeqCst) {
                    tracing::debug!(%peer, error = %e, "rendezvous store connection failed");
                }
                return;
            }
            Err(ReadError::Wire(err)) => {
                reject(&mut stream, peer, &err);
                return;
            }
        };
        let response = match shared.authenticate(&mut auth, request, peer) {
            Ok(request) => shared.handle(request),
            Err(response) => response,
        };
        let closes = matches!(&response, Response::Error { code, .. }
            if ErrorCode::from_u8(*code).is_some_and(ErrorCode::closes_connection));
        if stream.write_all(&encode_response(&response)).is_err() || closes {
            return;
        }
    }
}

/// Tells a peer that broke the protocol why (if it can still hear) and lets it go.
fn reject(stream: &mut TcpStream, peer: SocketAddr, err: &WireError) {
    tracing::warn!(%peer, code = ?err.code, "rendezvous store rejected a connection: {}", err.message);
    let frame = encode_response(&Response::Error {
        code: err.code as u8,
        message: err.message.clone(),
    });
    if stream.write_all(&frame).is_err() || stream.shutdown(Shutdown::Write).is_err() {
        return;
    }
    // Closing with unread input would send a reset, which can destroy the error frame
    // before the peer reads it; read (and discard) a bounded amount first.
    if stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .is_err()
    {
        return;
    }
    let until = Instant::now() + Duration::from_millis(500);
    let mut buf = [0u8; 4096];
    let mut total = 0usize;
    while total < 64 * 1024 && Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}

/// Where a connection stands with the job token.
enum AuthState {
    /// The store has no token.
    Open,
    /// Nothing proven yet.
    Required,
    /// Challenge sent; waiting for the client's proof.
    Challenged {
        client: [u8; crate::auth::NONCE_LEN],
        server: [u8; crate::auth::NONCE_LEN],
    },
    /// The client proved the token.
    Proven,
}

impl Shared {
    /// Runs the authentication exchange; hands back the requests a connection may make
    /// (all of them once the token is proven, or when the store has none).
    fn authenticate(
        &self,
        st: &mut AuthState,
        request: Request,
        peer: SocketAddr,
    ) -> std::result::Result<Request, Response> {
        let refuse = |why: &str| {
            tracing::warn!(%peer, "rendezvous store refused a client: {why}");
            Self::error(ErrorCode::Unauthorized, why.to_owned())
        };
        match (&*st, request, self.token.as_deref()) {
            (AuthState::Open | AuthState::Proven, Request::Auth { .. } | Request::Proof { .. }, None) => Err(refuse(
                "this job's store uses no job token but the client sent one: is FERROCCL_TOKEN set on some ranks only?",
            )),
            (AuthState::Open | AuthState::Proven, request, _) => Ok(request),
            (AuthState::Required, Request::Auth { nonce }, Some(token)) => {
                let server = crate::auth::nonce();
                let mac = crate::auth::mac(token, "ferroccl store server", &[&nonce, &server]);
                *st = AuthState::Challenged { client: nonce, server };
                Err(Response::Challenge { nonce: server, mac })
            }
            (AuthState::Challenged { client, server }, Request::Proof { mac }, Some(token)) => {
                if crate::auth::verify(token, "ferroccl store client", &[client, server], &mac) {
                    *st = AuthState::Proven;
                    Err(Response::Done)
                } else {
                    Err(refuse("the client's proof of the job token is wrong: another job, or a different FERROCCL_TOKEN"))
                }
            }
            _ => Err(refuse(
                "this job requires a job token: authenticate first (set the same FERROCCL_TOKEN on every rank)",
            )),
        }
    }

    fn error(code: ErrorCode, message: String) -> Response {
        Response::Error {
            code: code as u8,
            message,
        }
    }

    fn handle(&self, request: Request) -> Response {
        match request {
            Request::Join { rank, world_size } => self.join(rank, world_size),
            Request::Set { key, value } => {
                lock(&self.state).kv.insert(key, value);
                self.changed.notify_all();
                Response::Done
            }
            Request::Get { key, timeout_ms } => self.get(&key, timeout_ms),
            Request::Add { key, delta } => self.add(key, delta),
            // Only reachable once authenticated; a second exchange is not expected.
            Request::Auth { .. } | Request::Proof { .. } => {
                Self::error(ErrorCode::Unauthorized, "already authenticated".into())
            }
        }
    }

    fn join(&self, rank: u64, world_size: u64) -> Response {
        if world_size != self.world_size as u64 {
            return Self::error(
                ErrorCode::WorldSize,
                format!(
                    "rank {rank} has WORLD_SIZE={world_size} but the store at {} serves a job \
                     of {} ranks",
                    self.addr, self.world_size
                ),
            );
        }
        if rank >= world_size {
            return Self::error(
                ErrorCode::RankRange,
                format!(
                    "rank {rank} is out of range for a job of {world_size} ranks (ranks are \
                     0..{world_size})"
                ),
            );
        }
        if !lock(&self.state).joined.insert(rank) {
            return Self::error(
                ErrorCode::DuplicateRank,
                format!(
                    "rank {rank} joined twice: two processes of this job were launched with \
                     rank {rank}"
                ),
            );
        }
        tracing::debug!(rank, world_size, store = %self.addr, "rank joined the rendezvous store");
        Response::Joined {
            comm_id: self.comm_id,
        }
    }

    fn get(&self, key: &str, timeout_ms: u64) -> Response {
        let timeout = Duration::from_millis(timeout_ms);
        // A timeout too long to represent waits until the key is set or the store stops.
        let deadline = Instant::now().checked_add(timeout);
        let mut state = lock(&self.state);
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Self::error(ErrorCode::ShuttingDown, "the store is shutting down".into());
            }
            if let Some(value) = state.kv.get(key) {
                return Response::Value(value.clone());
            }
            state = match deadline {
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Self::error(
                            ErrorCode::Timeout,
                            format!("key '{key}' was not set within {timeout:?}"),
                        );
                    }
                    self.changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }

    fn add(&self, key: String, delta: i64) -> Response {
        let mut state = lock(&self.state);
        let current = match state.kv.get(&key) {
            None => 0,
            Some(v) => match std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
            {
                Some(n) => n,
                None => {
                    return Self::error(
                        ErrorCode::NotCounter,
                        format!("key '{key}' holds a value that is not a counter"),
                    )
                }
            },
        };
        let Some(new) = current.checked_add(delta) else {
            return Self::error(
                ErrorCode::NotCounter,
                format!("counter '{key}' would overflow: {current} + {delta}"),
            );
        };
        state.kv.insert(key, new.to_string().into_bytes());
        drop(state);
        self.changed.notify_all();
        Response::Count(new)
    }
}

// ---------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------

/// First pause between connection attempts; it doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long a JOIN, SET or ADD may wait for its reply, and any request for its send.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How much longer than its own timeout a GET waits for the reply.
const GET_MARGIN: Duration = Duration::from_secs(5);

/// A connection to the store.
///
/// Every call has a deadline. After an I/O or protocol failure the connection is
/// broken and later calls fail at once; connect again to go on.
pub struct StoreClient {
    stream: TcpStream,
    local: SocketAddr,
    addr: String,
    broken: Option<String>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("local", &self.local)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Why one connection attempt failed.
enum Attempt {
    /// Worth retrying (refused, unreachable, name not resolvable yet).
    Retry(String),
    /// Retrying cannot help (the address is malformed).
    Fatal(Error),
}

fn try_connect(addr: &str, timeout: Duration) -> std::result::Result<TcpStream, Attempt> {
    let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(it) => it.collect(),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
            return Err(Attempt::Fatal(Error::InvalidArgument(format!(
                "rendezvous store address '{addr}' is not host:port: {e}"
            ))))
        }
        Err(e) => return Err(Attempt::Retry(format!("resolving {addr}: {e}"))),
    };
    let mut last = format!("{addr} resolved to no addresses");
    for sa in resolved {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = format!("connecting to {sa}: {e}"),
        }
    }
    Err(Attempt::Retry(last))
}

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying until `deadline` passes.
    ///
    /// Refused or unreachable connections are retried with a backoff from 10 ms to
    /// 250 ms while rank 0 comes up; when `deadline` has passed the result is
    /// [`Error::StoreUnreachable`] with the last error. A malformed address is
    /// [`Error::InvalidArgument`] at once.
    pub fn connect(addr: &str, deadline: Duration) -> Result<Self> {
        Self::connect_with_token(addr, deadline, None)
    }

    /// [`StoreClient::connect`], then proves the job `token` to the store and checks
    /// that the store knows it too (HMAC challenge-response; the token never travels).
    pub fn connect_with_token(
        addr: &str,
        deadline: Duration,
        token: Option<&[u8]>,
    ) -> Result<Self> {
        let mut c = Self::connect_plain(addr, deadline)?;
        if let Some(token) = token {
            c.prove(token)?;
        }
        Ok(c)
    }

    fn prove(&mut self, token: &[u8]) -> Result<()> {
        let what = "authenticating with the job token";
        let client = crate::auth::nonce();
        let (server, mac) =
            match self.call(what, &Request::Auth { nonce: client }, REPLY_TIMEOUT)? {
                Response::Challenge { nonce, mac } => (nonce, mac),
                other => return Err(self.unexpected(what, &other)),
            };
        if !crate::auth::verify(token, "ferroccl store server", &[&client, &server], &mac) {
            let message = format!(
                "the store at {} could not prove the job token: a store of another job, or a different FERROCCL_TOKEN",
                self.addr
            );
            self.broken = Some(message.clone());
            return Err(Error::Rendezvous(message));
        }
        let proof = crate::auth::mac(token, "ferroccl store client", &[&client, &server]);
        match self.call(what, &Request::Proof { mac: proof }, REPLY_TIMEOUT)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(what, &other)),
        }
    }

    fn connect_plain(addr: &str, deadline: Duration) -> Result<Self> {
        let start = Instant::now();
        let mut backoff = INITIAL_BACKOFF;
        loop {
            let remaining = deadline.saturating_sub(start.elapsed());
            let per_attempt = remaining.max(Duration::from_millis(10));
            let detail = match try_connect(addr, per_attempt) {
                Ok(stream) => return Self::from_stream(addr, stream),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(detail)) => detail,
            };
            let elapsed = start.elapsed();
            if elapsed >= deadline {
                return Err(Error::StoreUnreachable {
                    addr: addr.to_owned(),
                    after: elapsed,
                    detail,
                });
            }
            tracing::trace!(addr, %detail, "rendezvous store not reachable yet; retrying");
            std::thread::sleep(backoff.min(deadline - elapsed));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn from_stream(addr: &str, stream: TcpStream) -> Result<Self> {
        let context =
            |what: &str, e| Error::io(format!("{what} to the rendezvous store at {addr}"), e);
        stream
            .set_nodelay(true)
            .map_err(|e| context("setting TCP_NODELAY on the connection", e))?;
        stream
            .set_write_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| context("setting a write timeout on the connection", e))?;
        let local = stream
            .local_addr()
            .map_err(|e| context("reading the local address of the connection", e))?;
        Ok(Self {
            stream,
            local,
            addr: addr.to_owned(),
            broken: None,
        })
    }

    /// Joins as `rank` of `world_size`; returns the communicator id of the job.
    ///
    /// A `world_size` that differs from the store's is [`Error::Env`] (the launcher
    /// environments of the ranks disagree); an out-of-range or duplicate rank is
    /// [`Error::Rendezvous`].
    pub fn join(&mut self, rank: usize, world_size: usize) -> Result<u64> {
        let what = format!("JOIN as rank {rank} of {world_size}");
        let request = Request::Join {
            rank: rank as u64,
            world_size: world_size as u64,
        };
        match self.call(&what, &request, REPLY_TIMEOUT)? {
            Response::Joined { comm_id } => Ok(comm_id),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Publishes `value` under `key`, replacing any earlier value.
    ///
    /// A key over [`MAX_KEY_LEN`] or a value over [`MAX_VALUE_LEN`] bytes is
    /// [`Error::InvalidArgument`], and nothing is sent.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(Error::InvalidArgument(format!(
                "value of {} bytes for key '{key}' exceeds the store's limit of {MAX_VALUE_LEN} bytes",
                value.len()
            )));
        }
        let what = format!("SET '{key}'");
        let request = Request::Set {
            key: key.to_owned(),
            value: value.to_vec(),
        };
        match self.call(&what, &request, REPLY_TIMEOUT)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Returns the value of `key`, waiting up to `timeout` for some rank to set it.
    ///
    /// The store does the waiting; a key still unset at `timeout` is
    /// [`Error::Rendezvous`].
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let what = format!("GET '{key}'");
        let request = Request::Get {
            key: key.to_owned(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        match self.call(&what, &request, timeout.saturating_add(GET_MARGIN))? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new
    /// value. Atomic across ranks, so it can count arrivals at a barrier.
    ///
    /// The counter is stored as decimal ASCII, so [`get`](Self::get) reads it too; a key
    /// holding anything else, or an overflow, is [`Error::Rendezvous`].
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let what = format!("ADD '{key}'");
        let request = Request::Add {
            key: key.to_owned(),
            delta,
        };
        match self.call(&what, &request, REPLY_TIMEOUT)? {
            Response::Count(n) => Ok(n),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// The local address of the connection: the interface through which this host
    /// reaches the store, and so the one to publish for peers.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends one request and reads its reply, turning ERROR replies into errors.
    fn call(&mut self, what: &str, request: &Request, reply_timeout: Duration) -> Result<Response> {
        if let Some(why) = &self.broken {
            return Err(Error::Rendezvous(format!(
                "{what}: the connection to the store at {} broke earlier ({why}); connect again",
                self.addr
            )));
        }
        let response = match self.exchange(what, request, reply_timeout) {
            Ok(response) => response,
            Err(e) => {
                self.broken = Some(e.to_string());
                return Err(e);
            }
        };
        let Response::Error { code, message } = response else {
            return Ok(response);
        };
        let code = ErrorCode::from_u8(code);
        if code.is_none_or(ErrorCode::closes_connection) {
            self.broken = Some(message.clone());
        }
        Err(match code {
            Some(ErrorCode::WorldSize) => Error::Env(message),
            _ => Error::Rendezvous(format!("{what}: {message}")),
        })
    }

    fn exchange(
        &mut self,
        what: &str,
        request: &Request,
        reply_timeout: Duration,
    ) -> Result<Response> {
        let addr = &self.addr;
        self.stream
            .set_read_timeout(Some(reply_timeout))
            .map_err(|e| Error::io(format!("{what}: setting a read timeout"), e))?;
        self.stream
            .write_all(&encode_request(request))
            .map_err(|e| Error::io(format!("{what}: sending to the store at {addr}"), e))?;
        read_response(&mut self.stream).map_err(|e| match e {
            ReadError::Closed => Error::Rendezvous(format!(
                "{what}: the store at {addr} closed the connection (did rank 0 exit?)"
            )),
            ReadError::Io(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Error::Rendezvous(format!(
                    "{what}: the store at {addr} did not answer within {reply_timeout:?}"
                ))
            }
            ReadError::Io(e) => Error::io(
                format!("{what}: reading the reply of the store at {addr}"),
                e,
            ),
            ReadError::Wire(w) => Error::Rendezvous(format!(
                "{what}: the store at {addr} sent a bad reply: {}",
                w.message
            )),
        })
    }

    fn unexpected(&mut self, what: &str, response: &Response) -> Error {
        let kind = match response {
            Response::Joined { .. } => "JOINED",
            Response::Done => "DONE",
            Response::Value(_) => "VALUE",
            Response::Count(_) => "COUNT",
            Response::Challenge { .. } => "CHALLENGE",
            Response::Error { .. } => "ERROR",
        };
        let message = format!(
            "{what}: the store at {} answered with an unexpected {kind} reply",
            self.addr
        );
        self.broken = Some(message.clone());
        Error::Rendezvous(message)
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "key of {} bytes exceeds the store's limit of {MAX_KEY_LEN} bytes",
            key.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::mpsc;

    // ---- environment ------------------------------------------------------------------

    type Vars = Vec<(&'static str, &'static str)>;

    fn detect(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect_from(|k| map.get(k).cloned())
    }

    fn env(
        source: &'static str,
        rank: usize,
        world_size: usize,
        local_rank: Option<usize>,
    ) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr: None,
            master_port: None,
            source,
            token: None,
            rdma_gid_index: None,
        }
    }

    #[test]
    fn rdma_gid_index_is_read_and_checked() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let get = |extra: &[(&str, &str)]| {
            let map: HashMap<String, String> = base
                .iter()
                .chain(extra)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            detect_from(|k| map.get(k).cloned())
        };
        assert_eq!(get(&[]).unwrap().unwrap().rdma_gid_index, None);
        let e = get(&[("FERROCCL_RDMA_GID_INDEX", "3")]).unwrap().unwrap();
        assert_eq!(e.rdma_gid_index, Some(3));
        let bad = get(&[("FERROCCL_RDMA_GID_INDEX", "300")]).unwrap_err();
        assert!(
            bad.to_string().contains("FERROCCL_RDMA_GID_INDEX='300'"),
            "{bad}"
        );
    }

    #[test]
    fn env_detects_each_family_in_order_of_precedence() {
        let torch = [("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")];
        let ompi = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ];
        let pmi = [
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "6"),
            ("MPI_LOCALRANKID", "2"),
        ];
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "3"),
        ];
        let all: Vec<_> = [&torch[..], &ompi, &pmi, &slurm].concat();
        let cases: Vec<(Vars, Option<LaunchEnv>)> = vec![
            (vec![], None),
            (torch.to_vec(), Some(env("torchrun", 1, 4, Some(1)))),
            (ompi.to_vec(), Some(env("openmpi", 2, 8, Some(0)))),
            (pmi.to_vec(), Some(env("pmi", 3, 6, Some(2)))),
            (slurm.to_vec(), Some(env("slurm", 5, 7, Some(3)))),
            (all.clone(), Some(env("torchrun", 1, 4, Some(1)))),
            (all[3..].to_vec(), Some(env("openmpi", 2, 8, Some(0)))),
            (all[6..].to_vec(), Some(env("pmi", 3, 6, Some(2)))),
            // PMI without MPI_LOCALRANKID, torchrun without LOCAL_RANK.
            (pmi[..2].to_vec(), Some(env("pmi", 3, 6, None))),
            (torch[..2].to_vec(), Some(env("torchrun", 1, 4, None))),
            // Values are trimmed; an empty variable counts as unset.
            (
                vec![("RANK", " 0 "), ("WORLD_SIZE", "1\n")],
                Some(env("torchrun", 0, 1, None)),
            ),
            (vec![("RANK", ""), ("WORLD_SIZE", "")], None),
            // salloc exports SLURM_NTASKS without a task id: not a launch.
            (vec![("SLURM_NTASKS", "4")], None),
            // A local rank from another family is not mixed in.
            (
                vec![("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("SLURM_LOCALID", "1")],
                Some(env("pmi", 0, 2, None)),
            ),
        ];
        for (vars, want) in cases {
            let got = detect(&vars);
            assert_eq!(got.as_ref().ok(), Some(&want), "for {vars:?} got {got:?}");
        }
    }

    #[test]
    fn env_reads_master_whatever_the_family() {
        for family in [
            [("RANK", "0"), ("WORLD_SIZE", "2")],
            [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
            [("PMI_RANK", "0"), ("PMI_SIZE", "2")],
            [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
        ] {
            let mut vars = family.to_vec();
            vars.push(("MASTER_ADDR", "node17.cluster"));
            vars.push(("MASTER_PORT", "29500"));
            let got = detect(&vars).ok().flatten();
            let got = got.unwrap_or_else(|| panic!("nothing detected from {vars:?}"));
            assert_eq!(got.master_addr.as_deref(), Some("node17.cluster"));
            assert_eq!(got.master_port, Some(29500));
        }
    }

    #[test]
    fn env_errors_name_the_variables() {
        // (variables, substrings the Error::Env message must contain)
        let cases: Vec<(Vars, Vec<&str>)> = vec![
            (vec![("RANK", "0")], vec!["RANK=0", "WORLD_SIZE"]),
            (vec![("WORLD_SIZE", "4")], vec!["WORLD_SIZE=4", "RANK"]),
            // torchrun's contradiction is reported even when Slurm variables are set.
            (
                vec![
                    ("WORLD_SIZE", "4"),
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "4"),
                ],
                vec!["WORLD_SIZE=4", "RANK"],
            ),
            (
                vec![("OMPI_COMM_WORLD_RANK", "1")],
                vec!["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"],
            ),
            (
                vec![("OMPI_COMM_WORLD_SIZE", "2")],
                vec!["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"],
            ),
            (vec![("PMI_SIZE", "2")], vec!["PMI_SIZE", "PMI_RANK"]),
            (vec![("PMI_RANK", "2")], vec!["PMI_RANK", "PMI_SIZE"]),
            (
                vec![("SLURM_PROCID", "2")],
                vec!["SLURM_PROCID", "SLURM_NTASKS"],
            ),
            (
                vec![("RANK", "abc"), ("WORLD_SIZE", "4")],
                vec!["RANK='abc'", "integer"],
            ),
            (
                vec![("RANK", "1.5"), ("WORLD_SIZE", "4")],
                vec!["RANK='1.5'"],
            ),
            (
                vec![("RANK", "-1"), ("WORLD_SIZE", "4")],
                vec!["RANK=-1", "negative"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "-4")],
                vec!["WORLD_SIZE=-4", "negative"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "99999999999999999999999")],
                vec!["WORLD_SIZE", "too large"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "0")],
                vec!["WORLD_SIZE=0"],
            ),
            (
                vec![("RANK", "4"), ("WORLD_SIZE", "4")],
                vec!["RANK=4", "WORLD_SIZE=4"],
            ),
            (
                vec![("SLURM_PROCID", "9"), ("SLURM_NTASKS", "3")],
                vec!["SLURM_PROCID=9", "SLURM_NTASKS=3"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "4")],
                vec!["LOCAL_RANK=4", "WORLD_SIZE=4"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "x")],
                vec!["LOCAL_RANK='x'"],
            ),
            (
                vec![
                    ("PMI_RANK", "0"),
                    ("PMI_SIZE", "2"),
                    ("MPI_LOCALRANKID", "-1"),
                ],
                vec!["MPI_LOCALRANKID=-1"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "http")],
                vec!["MASTER_PORT='http'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "70000")],
                vec!["MASTER_PORT='70000'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "-1")],
                vec!["MASTER_PORT='-1'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "0")],
                vec!["MASTER_PORT=0"],
            ),
        ];
        for (vars, needles) in cases {
            match detect(&vars) {
                Err(Error::Env(msg)) => {
                    for needle in needles {
                        assert!(msg.contains(needle), "{vars:?}: '{msg}' lacks '{needle}'");
                    }
                }
                other => panic!("{vars:?}: expected Error::Env, got {other:?}"),
            }
        }
    }

    // ---- wire format ------------------------------------------------------------------

    fn header(kind: u8, len: u32) -> Vec<u8> {
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&[kind, 0]);
        h.extend_from_slice(&len.to_le_bytes());
        h
    }

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
            },
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
        // Trailing bytes and non-UTF-8 keys are refused.
        let mut join = 0u64.to_le_bytes().to_vec();
        join.extend_from_slice(&1u64.to_le_bytes());
        join.push(0);
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
            (any::<u64>(), any::<u64>())
                .prop_map(|(rank, world_size)| Request::Join { rank, world_size }),
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

    // ---- strangers on a live server ----------------------------------------------------

    /// Runs `f` on a thread and fails the test if it does not finish within `limit`.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(limit) {
            Ok(v) => v,
            Err(e) => panic!("test body did not finish within {limit:?}: {e}"),
        }
    }

    fn loopback_server(world_size: usize) -> StoreServer {
        match StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), world_size) {
            Ok(s) => s,
            Err(e) => panic!("bind: {e}"),
        }
    }

    /// Sends `bytes` on a raw connection and returns the reply frame, if any.
    fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> Option<Response> {
        let mut s = TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
        s.write_all(bytes).ok()?;
        read_response(&mut s).ok()
    }

    fn assert_serves_a_proper_client(addr: SocketAddr) {
        let mut c = StoreClient::connect(&addr.to_string(), Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connect: {e}"));
        c.set("after-stranger", b"ok")
            .unwrap_or_else(|e| panic!("set: {e}"));
        let v = c.get("after-stranger", Duration::from_secs(1));
        assert_eq!(v.ok().as_deref(), Some(&b"ok"[..]));
    }

    #[test]
    fn strangers_are_rejected_and_the_server_serves_on() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(2);
            let addr = server.local_addr();
            let mut wrong_version = header(kind::JOIN, 16);
            wrong_version[4..6].copy_from_slice(&2u16.to_le_bytes());
            wrong_version.extend_from_slice(&[0; 16]);
            let strangers: [(&[u8], &str); 3] = [
                (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
                (&[0xde, 0xad, 0xbe, 0xef, 1, 0, 1, 0, 0, 0, 0, 0], "magic"),
                (&wrong_version, "version 2"),
            ];
            for (bytes, needle) in strangers {
                match raw_exchange(addr, bytes) {
                    Some(Response::Error { code, message }) => {
                        assert_eq!(code, ErrorCode::Malformed as u8);
                        assert!(message.contains(needle), "{message}");
                    }
                    other => panic!("stranger {bytes:?} got {other:?}"),
                }
            }
            // A stranger that sends a few bytes and hangs up must not hurt either.
            if let Ok(mut s) = TcpStream::connect(addr) {
                let _ = s.write_all(b"FC");
            }
            assert_serves_a_proper_client(addr);
        });
    }

    #[test]
    fn oversize_value_is_refused_without_reading_it() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(2);
            let addr = server.local_addr();
            // Claims a 4 GiB SET but sends only a few bytes of it: the error must come
            // back at once, which it cannot if the server waited for (or allocated) the body.
            let mut bytes = header(kind::SET, u32::MAX);
            bytes.extend_from_slice(&1u32.to_le_bytes());
            bytes.push(b'k');
            let started = Instant::now();
            match raw_exchange(addr, &bytes) {
                Some(Response::Error { code, message }) => {
                    assert_eq!(code, ErrorCode::TooLarge as u8);
                    assert!(message.contains("exceeds"), "{message}");
                }
                other => panic!("got {other:?}"),
            }
            assert!(started.elapsed() < Duration::from_secs(2));
            assert_serves_a_proper_client(addr);
        });
    }

    #[test]
    fn a_dropped_server_wakes_waiting_clients() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(1);
            let addr = server.local_addr().to_string();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r = StoreClient::connect(&addr, Duration::from_secs(2))
                    .and_then(|mut c| c.get("never", Duration::from_secs(60)));
                let _ = tx.send(r);
            });
            std::thread::sleep(Duration::from_millis(200));
            let started = Instant::now();
            drop(server);
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "drop took {:?}",
                started.elapsed()
            );
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Err(Error::Rendezvous(_))) | Ok(Err(Error::Io { .. })) => {}
                other => panic!("expected an error once the store is gone, got {other:?}"),
            }
        });
    }
}
