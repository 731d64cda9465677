//! The communication's error: the one error type of the collectives, the transports
//! and the rendezvous.
//!
//! Every failure a caller of them can see is a variant here, carrying the facts needed
//! to act on it (which rank, which operation and sequence number, which peer, what was
//! expected and what arrived). Nothing that a peer, a file or a user sends can panic
//! the process: it becomes one of these. A training run's own reasons to stop
//! (divergence, preemption, a checkpoint it cannot use) are not here but in
//! [`crate::ddp::TrainError`], which carries this error beside them.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::Duration;

/// Shorthand for `std::result::Result<T, ferroccl::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferroccl's communication.
///
/// It crosses the wire itself, fields and all, when a rank tells its peers why it gave
/// up (`Error::to_wire`): serde, tagged by the variant's name (`{"kind":
/// "Mismatch", "fields": {...}}`), so a rank told of another's failure rebuilds the
/// same variant.
#[derive(Debug, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", content = "fields")]
#[non_exhaustive]
pub enum Error {
    /// An argument was wrong on this rank alone (a length, a rank number, a size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The reduction is not defined for this element type (for example `Avg` on integers).
    #[error("{op:?} is not supported for {dtype}: {why}")]
    UnsupportedOp {
        /// The requested operation.
        op: crate::dtype::ReduceOp,
        /// The element type it was asked for.
        dtype: crate::dtype::DataType,
        /// What to do instead.
        why: Cow<'static, str>,
    },

    /// The launcher environment is missing a variable or contradicts itself.
    #[error("launcher environment: {0}")]
    Env(String),

    /// A configuration value is out of range.
    #[error("configuration: {0}")]
    Config(String),

    /// Could not bind a listening socket because the address is taken.
    #[error("address {addr} is already in use ({what}); another job or program may hold the port: pick another port or stop the process holding it")]
    AddrInUse {
        /// The address we tried to bind.
        addr: SocketAddr,
        /// What the socket was for ("rendezvous store", "data listener").
        what: Cow<'static, str>,
    },

    /// The rendezvous store could not be reached before the deadline.
    #[error("rendezvous store at {addr} unreachable after {after:?}: {detail}")]
    StoreUnreachable {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// How long we kept retrying.
        after: Duration,
        /// The last connection error.
        detail: String,
    },

    /// A rank reached the rendezvous store of another job: two jobs were given one
    /// `MASTER_ADDR:MASTER_PORT`. Said by the ranks that joined the wrong store, and by
    /// a rank 0 that found the port held by the other job's store.
    #[error("another job ({theirs}) is using the store at {addr}; this process belongs to {ours}: give each job its own MASTER_PORT")]
    OtherJob {
        /// The store's address.
        addr: String,
        /// The job the store serves, as its launcher named it.
        theirs: String,
        /// This process's job.
        ours: String,
    },

    /// The rendezvous store answered with an error, or with something we did not ask for.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// A connection was refused during the handshake: wrong magic, version,
    /// communicator id or rank.
    #[error("handshake with {peer}: {detail}")]
    Handshake {
        /// Who we talked to (an address, or `rank N`).
        peer: String,
        /// What was wrong.
        detail: String,
    },

    /// A peer closed its connection (it exited or crashed).
    #[error("rank {rank}: connection to rank {peer} closed during {op}")]
    PeerClosed {
        /// This rank.
        rank: usize,
        /// The peer whose connection closed.
        peer: usize,
        /// The operation in progress, e.g. `all_reduce #17`.
        op: String,
    },

    /// A peer gave up on the job and said why before closing its links: the failure
    /// started at rank `origin` (a lost connection, a mismatch, a timeout) and reached
    /// this rank through rank `peer`. Every survivor names the same origin and cause,
    /// not the neighbour that closed on it.
    ///
    /// `cause` is the error the origin saw, typed as it was there (it crosses the wire
    /// with its fields), so code can match on the root cause on every rank:
    /// `Error::PeerFailed { cause, .. } if matches!(*cause, Error::Mismatch { .. })`.
    #[error("rank {rank}: {op} failed because rank {origin} failed first: {cause} (told by rank {peer})")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The peer whose notice arrived.
        peer: usize,
        /// The rank where the failure started.
        origin: usize,
        /// What happened there, as that rank's error (an error of a kind that does not
        /// cross the wire with its fields, such as an I/O error, arrives as
        /// [`Error::Remote`] with its text).
        cause: Box<Error>,
        /// The operation in progress here.
        op: String,
    },

    /// A peer sent bytes that break the protocol (a bad frame, a wrong tag or length).
    #[error("rank {rank}: protocol violation from rank {peer} during {op}: {detail}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer that sent the bytes.
        peer: usize,
        /// The operation in progress.
        op: String,
        /// What was wrong.
        detail: String,
    },

    /// Ranks called different collectives, or the same one with different arguments.
    #[error("rank {rank}: mismatched collective with rank {peer}: this rank called {ours}, rank {peer} called {theirs}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The peer that disagrees.
        peer: usize,
        /// What this rank called (kind, sequence number, dtype, count, op).
        ours: String,
        /// What the peer called.
        theirs: String,
    },

    /// A wait made no progress for the configured timeout.
    #[error("rank {rank}: {op} timed out after {after:?} waiting for {waiting_for}; {peers}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The operation, e.g. `all_reduce #17 (f32, 4194304 elements)`.
        op: String,
        /// How long nothing moved.
        after: Duration,
        /// What we were waiting for, e.g. `data from rank 2`.
        waiting_for: String,
        /// Where the other ranks were when asked, e.g. `rank 2 is at #16 (broadcast);
        /// rank 3 unreachable` — the answer to "which rank is hanging?".
        peers: String,
    },

    /// [`crate::comm::AbortHandle::abort`] was called while this operation ran.
    #[error("rank {rank}: {op} aborted")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The operation that was running.
        op: String,
    },

    /// An earlier failure poisoned this communicator; it must be rebuilt.
    #[error("communicator is poisoned by an earlier failure: {0}")]
    Poisoned(String),

    /// A transport or feature that is not available in this build or on this machine.
    #[error("{what} is not available: {why}")]
    Unavailable {
        /// The thing asked for, e.g. `transport cuda-ipc`.
        what: String,
        /// Why, e.g. `built without the "cuda" feature`.
        why: String,
    },

    /// A CUDA driver or NVRTC call failed (feature `cuda`).
    #[error("CUDA call {call} failed: {detail}")]
    Cuda {
        /// The API call, e.g. `cuIpcOpenMemHandle`.
        call: Cow<'static, str>,
        /// The CUDA error code and any log.
        detail: String,
    },

    /// An I/O error outside of a running collective (binding, connecting, files).
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The underlying error (across the wire: its kind and text).
        #[source]
        #[serde(with = "io_error")]
        source: std::io::Error,
    },

    /// Another rank's error of a kind that crosses the wire as text only (an I/O or CUDA
    /// error there): its kind and its message, as that rank wrote them. Only ever the
    /// `cause` of an [`Error::PeerFailed`].
    #[error("{message}")]
    Remote {
        /// The variant's name on the rank where it happened, e.g. `Io`.
        kind: String,
        /// Its message there.
        message: String,
    },
}

impl Error {
    /// Wraps an I/O error with a sentence saying what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// An I/O error as it crosses the wire: its kind's name and its text.
mod io_error {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Io {
        kind: String,
        message: String,
    }

    pub(super) fn serialize<S: Serializer>(e: &std::io::Error, s: S) -> Result<S::Ok, S::Error> {
        Io {
            kind: format!("{:?}", e.kind()),
            message: e.to_string(),
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<std::io::Error, D::Error> {
        let io = Io::deserialize(d)?;
        let kind = [
            std::io::ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied,
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::AddrInUse,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::OutOfMemory,
        ]
        .into_iter()
        .find(|k| format!("{k:?}") == io.kind)
        .unwrap_or(std::io::ErrorKind::Other);
        Ok(std::io::Error::new(kind, io.message))
    }
}

/// The variant's name (e.g. `"Mismatch"`).
fn variant_name(e: &Error) -> &'static str {
    match e {
        Error::UnsupportedOp { .. } => "UnsupportedOp",
        Error::AddrInUse { .. } => "AddrInUse",
        Error::StoreUnreachable { .. } => "StoreUnreachable",
        Error::OtherJob { .. } => "OtherJob",
        Error::Cuda { .. } => "Cuda",
        Error::Io { .. } => "Io",
        Error::InvalidArgument(_) => "InvalidArgument",
        Error::Env(_) => "Env",
        Error::Config(_) => "Config",
        Error::Rendezvous(_) => "Rendezvous",
        Error::Poisoned(_) => "Poisoned",
        Error::Handshake { .. } => "Handshake",
        Error::PeerClosed { .. } => "PeerClosed",
        Error::PeerFailed { .. } => "PeerFailed",
        Error::Protocol { .. } => "Protocol",
        Error::Mismatch { .. } => "Mismatch",
        Error::Timeout { .. } => "Timeout",
        Error::Aborted { .. } => "Aborted",
        Error::Unavailable { .. } => "Unavailable",
        Error::Remote { .. } => "Remote",
    }
}

impl Error {
    /// This error as a failure notice carries it to the peers (JSON, fields and all).
    pub(crate) fn to_wire(&self) -> String {
        /// Longer than this (a timeout's census of a large job), the cause goes as its
        /// text, cut: a notice is bounded (`wire::NOTICE_MAX`).
        const MAX: usize = 8 << 10;
        let typed = serde_json::to_string(self).unwrap_or_default();
        if !typed.is_empty() && typed.len() <= MAX {
            return typed;
        }
        let mut message = self.to_string();
        let mut end = message.len().min(MAX / 2);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        let kind = match self {
            Error::Remote { kind, .. } => kind.clone(),
            e => variant_name(e).to_string(),
        };
        serde_json::to_string(&Error::Remote { kind, message }).unwrap_or_default()
    }

    /// The error a notice carried: the same variant with the same fields; text that
    /// is not a notice's JSON (cut short, from a peer that only sent words) is kept
    /// as [`Error::Remote`].
    pub(crate) fn from_wire(text: &str) -> Error {
        serde_json::from_str(text).unwrap_or_else(|_| Error::Remote {
            kind: "Error".into(),
            message: text.to_string(),
        })
    }

    /// The variant's name, e.g. `"Mismatch"` (for bindings and logs that classify
    /// errors by kind).
    pub fn kind(&self) -> &'static str {
        variant_name(self)
    }

    /// The root cause: for [`Error::PeerFailed`], the error at the rank where the
    /// failure started (followed through notices passed on); otherwise `self`.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::PeerFailed { cause, .. } => cause.root_cause(),
            e => e,
        }
    }
}

/// What kind of failure an [`Error`] is: one class per way a caller reacts to it, for
/// bindings that give each its own exception type (the Python package's
/// `ferroccl.MismatchError`, `PeerClosedError`, ...).
///
/// Deliberately not `#[non_exhaustive]`, and [`Error::class`] matches every variant
/// by name: a new [`Error`] variant fails to compile there until it has a class, and a
/// new class fails to compile in each binding's exhaustive `match` until it has an
/// exception there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// [`Error::InvalidArgument`].
    InvalidArgument,
    /// [`Error::UnsupportedOp`], [`Error::Unavailable`].
    Unsupported,
    /// [`Error::Env`], [`Error::Config`].
    Config,
    /// The ranks could not meet: [`Error::AddrInUse`], [`Error::StoreUnreachable`],
    /// [`Error::OtherJob`], [`Error::Rendezvous`], [`Error::Handshake`].
    Rendezvous,
    /// [`Error::PeerClosed`].
    PeerClosed,
    /// [`Error::PeerFailed`] (and [`Error::Remote`], which is only ever its cause).
    PeerFailed,
    /// [`Error::Protocol`].
    Protocol,
    /// [`Error::Mismatch`].
    Mismatch,
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::Aborted`].
    Aborted,
    /// [`Error::Poisoned`].
    Poisoned,
    /// [`Error::Cuda`].
    Cuda,
    /// [`Error::Io`].
    Io,
}

impl Error {
    /// This error's [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::InvalidArgument(_) => ErrorClass::InvalidArgument,
            Error::UnsupportedOp { .. } | Error::Unavailable { .. } => ErrorClass::Unsupported,
            Error::Env(_) | Error::Config(_) => ErrorClass::Config,
            Error::AddrInUse { .. }
            | Error::StoreUnreachable { .. }
            | Error::OtherJob { .. }
            | Error::Rendezvous(_)
            | Error::Handshake { .. } => ErrorClass::Rendezvous,
            Error::PeerClosed { .. } => ErrorClass::PeerClosed,
            Error::PeerFailed { .. } | Error::Remote { .. } => ErrorClass::PeerFailed,
            Error::Protocol { .. } => ErrorClass::Protocol,
            Error::Mismatch { .. } => ErrorClass::Mismatch,
            Error::Timeout { .. } => ErrorClass::Timeout,
            Error::Aborted { .. } => ErrorClass::Aborted,
            Error::Poisoned(_) => ErrorClass::Poisoned,
            Error::Cuda { .. } => ErrorClass::Cuda,
            Error::Io { .. } => ErrorClass::Io,
        }
    }
}

/// `e`, raised on a child communicator (`split`, `group`) of id `id` whose rank `r` is
/// job rank `global[r]`, naming the job rank beside every rank it names: the ranks in
/// its fields stay the child's (what the caller numbers by), and its text says which
/// processes they are.
pub(crate) fn in_group(e: Error, id: u64, global: &[usize]) -> Error {
    let job = |r: usize| global.get(r).map_or("?".to_string(), |g| g.to_string());
    let pair = |a: usize, b: usize| {
        format!(
            " [communicator {id:#018x}: rank {a} is job rank {}, rank {b} is job rank {}]",
            job(a),
            job(b)
        )
    };
    let all = || {
        const SHOWN: usize = 16;
        let mut list: Vec<String> = global.iter().take(SHOWN).map(|g| g.to_string()).collect();
        if global.len() > SHOWN {
            list.push(format!("... ({} in all)", global.len()));
        }
        format!(
            " [communicator {id:#018x}: its ranks are job ranks {}]",
            list.join(", ")
        )
    };
    match e {
        Error::PeerClosed { rank, peer, op } => Error::PeerClosed {
            rank,
            peer,
            op: op + &pair(rank, peer),
        },
        Error::PeerFailed {
            rank,
            peer,
            origin,
            cause,
            op,
        } => Error::PeerFailed {
            rank,
            peer,
            origin,
            cause,
            op: format!(
                "{op}{} (rank {origin} is job rank {})",
                pair(rank, peer),
                job(origin)
            ),
        },
        Error::Protocol {
            rank,
            peer,
            op,
            detail,
        } => Error::Protocol {
            rank,
            peer,
            op: op + &pair(rank, peer),
            detail,
        },
        Error::Mismatch {
            rank,
            peer,
            ours,
            theirs,
        } => Error::Mismatch {
            rank,
            peer,
            ours: ours + &pair(rank, peer),
            theirs,
        },
        Error::Timeout {
            rank,
            op,
            after,
            waiting_for,
            peers,
        } => Error::Timeout {
            rank,
            op: op + &all(),
            after,
            waiting_for,
            peers,
        },
        Error::Aborted { rank, op } => Error::Aborted {
            rank,
            op: format!(
                "{op} [communicator {id:#018x}: rank {rank} is job rank {}]",
                job(rank)
            ),
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every error crosses a notice and comes back as the same variant with the same
    /// fields (so the same text): every variant is listed, and `variant_name` below
    /// matches them all, so a new one is noticed here.
    #[test]
    fn errors_cross_the_wire_typed() {
        let cases = vec![
            Error::InvalidArgument("root 7 is not a rank".into()),
            Error::UnsupportedOp {
                op: crate::dtype::ReduceOp::Avg,
                dtype: crate::dtype::DataType::I32,
                why: "reduce with Sum".into(),
            },
            Error::Env("RANK=x".into()),
            Error::Config("segment 0".into()),
            Error::AddrInUse {
                addr: "127.0.0.1:29500".parse().unwrap(),
                what: "rendezvous store".into(),
            },
            Error::StoreUnreachable {
                addr: "h:1".into(),
                after: Duration::from_millis(1500),
                detail: "refused".into(),
            },
            Error::OtherJob {
                addr: "h:1".into(),
                theirs: "job a".into(),
                ours: "job b".into(),
            },
            Error::Rendezvous("bad reply".into()),
            Error::Handshake {
                peer: "rank 3".into(),
                detail: "wrong magic".into(),
            },
            Error::Protocol {
                rank: 1,
                peer: 2,
                op: "all_reduce #1".into(),
                detail: "frame of 3 bytes".into(),
            },
            Error::Mismatch {
                rank: 2,
                peer: 0,
                ours: "all_reduce #3 (f32, 999 elements)".into(),
                theirs: "all_reduce #3 (f32, 1000 elements)".into(),
            },
            Error::Timeout {
                rank: 1,
                op: "barrier #0".into(),
                after: Duration::from_millis(5001),
                waiting_for: "data from rank 2".into(),
                peers: "rank 2 is stopped".into(),
            },
            Error::PeerClosed {
                rank: 0,
                peer: 3,
                op: "broadcast #1".into(),
            },
            Error::Aborted {
                rank: 0,
                op: "x".into(),
            },
            Error::Poisoned("rank 1 failed".into()),
            Error::Unavailable {
                what: "CUDA".into(),
                why: "no driver".into(),
            },
            Error::Cuda {
                call: "cuMemAlloc".into(),
                detail: "out of memory".into(),
            },
            Error::io(
                "reading x",
                std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
            ),
            Error::Remote {
                kind: "Io".into(),
                message: "disk gone".into(),
            },
            Error::PeerFailed {
                rank: 0,
                peer: 1,
                origin: 2,
                cause: Box::new(Error::Config("bad".into())),
                op: "y".into(),
            },
        ];
        let mut seen = std::collections::HashSet::new();
        for e in cases {
            let back = Error::from_wire(&e.to_wire());
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(variant_name(&back), variant_name(&e), "{e}");
            assert_eq!(back.class(), e.class(), "{e}");
            seen.insert(variant_name(&e));
        }
        assert_eq!(
            seen.len(),
            20,
            "a variant is missing from the cases: {seen:?}"
        );
        // An I/O error keeps its kind.
        let io = Error::io("x", std::io::Error::new(std::io::ErrorKind::TimedOut, "t"));
        match Error::from_wire(&io.to_wire()) {
            Error::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::TimedOut),
            e => panic!("{e:?}"),
        }
        // A cause too long for a notice is cut, not lost; text that is not a notice's
        // JSON is kept as it came.
        let long = Error::InvalidArgument("z".repeat(100_000));
        let w = long.to_wire();
        assert!(w.len() < 16 << 10, "{}", w.len());
        assert!(
            matches!(Error::from_wire(&w), Error::Remote { kind, .. } if kind == "InvalidArgument")
        );
        assert!(
            matches!(Error::from_wire("{\"kind\":\"Mism"), Error::Remote { message, .. } if message.contains("Mism"))
        );
        // The root cause is followed through notices passed on.
        let told = Error::PeerFailed {
            rank: 0,
            peer: 1,
            origin: 2,
            cause: Box::new(Error::from_wire(
                &Error::Mismatch {
                    rank: 2,
                    peer: 3,
                    ours: "a".into(),
                    theirs: "b".into(),
                }
                .to_wire(),
            )),
            op: "z".into(),
        };
        assert!(matches!(told.root_cause(), Error::Mismatch { rank: 2, .. }));
    }

    #[test]
    fn a_childs_errors_name_the_job_ranks_too() {
        let e = in_group(
            Error::PeerClosed {
                rank: 1,
                peer: 0,
                op: "all_reduce #3".into(),
            },
            0xab,
            &[2, 5],
        );
        let t = e.to_string();
        assert!(
            matches!(
                e,
                Error::PeerClosed {
                    rank: 1,
                    peer: 0,
                    ..
                }
            ),
            "{t}"
        );
        assert!(
            t.contains("rank 1 is job rank 5, rank 0 is job rank 2"),
            "{t}"
        );
        let e = in_group(
            Error::PeerFailed {
                rank: 0,
                peer: 1,
                origin: 2,
                cause: Box::new(Error::Config("x".into())),
                op: "barrier #0".into(),
            },
            1,
            &[4, 6, 8],
        );
        assert!(e.to_string().contains("rank 2 is job rank 8"), "{e}");
        let t = in_group(
            Error::Timeout {
                rank: 0,
                op: "x".into(),
                after: std::time::Duration::from_secs(1),
                waiting_for: "y".into(),
                peers: "z".into(),
            },
            1,
            &(0..20).collect::<Vec<_>>(),
        )
        .to_string();
        assert!(
            t.contains("job ranks 0, 1, 2") && t.contains("(20 in all)"),
            "{t}"
        );
        // Errors that name no peer are left alone.
        let e = in_group(Error::InvalidArgument("z".into()), 1, &[0]);
        assert_eq!(e.to_string(), "invalid argument: z");
    }
}
