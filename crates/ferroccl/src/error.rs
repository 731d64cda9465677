//! The one error type of the crate.
//!
//! Every failure a caller can see is a variant here, carrying the facts needed to act
//! on it (which rank, which operation and sequence number, which peer, what was
//! expected and what arrived). Nothing that a peer, a file or a user sends can panic
//! the process: it becomes one of these.

use std::net::SocketAddr;
use std::time::Duration;

/// Shorthand for `std::result::Result<T, ferroccl::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferroccl.
#[derive(Debug, thiserror::Error)]
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
        why: &'static str,
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
        what: &'static str,
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
    #[error("rank {rank}: {op} failed because rank {origin} failed first: {cause} (told by rank {peer})")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The peer whose notice arrived.
        peer: usize,
        /// The rank where the failure started.
        origin: usize,
        /// What happened there, in that rank's words.
        cause: String,
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

    /// Training diverged: the averaged gradients (identical on every rank) hold an
    /// inf or a NaN in full-precision training, where no loss scaler can recover.
    #[error("training diverged at step {step}: {why}")]
    Diverged {
        /// The optimizer step.
        step: u64,
        /// What was found and what to try.
        why: String,
    },

    /// The job was asked to stop (SIGTERM: a scheduler's preemption; see
    /// [`crate::ddp::Preemption`]) and every rank stopped after the same step, with the
    /// checkpoint of that step written. Restart it to go on
    /// ([`crate::ddp::PREEMPTED_EXIT_CODE`] tells a launcher so).
    #[error("preempted: stopped after step {step}{}", match checkpoint {
        Some(p) => format!(", checkpoint {}", p.display()),
        None => " (rank 0 writes the checkpoint, when there is a checkpoint directory)".into(),
    })]
    Preempted {
        /// Steps completed.
        step: u64,
        /// The checkpoint written for it (on rank 0, with a checkpoint directory; `None`
        /// elsewhere).
        checkpoint: Option<std::path::PathBuf>,
    },

    /// A CUDA driver or NVRTC call failed (feature `cuda`).
    #[error("CUDA call {call} failed: {detail}")]
    Cuda {
        /// The API call, e.g. `cuIpcOpenMemHandle`.
        call: &'static str,
        /// The CUDA error code and any log.
        detail: String,
    },

    /// An I/O error outside of a running collective (binding, connecting, files).
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint is corrupt, truncated, from another format version, or does not
    /// fit the model it is loaded into. Nothing was changed: the model, and any other
    /// checkpoint on disk, are as they were.
    #[error("checkpoint {}: {why}", path.display())]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

impl Error {
    /// A checkpoint file that cannot be used, and why.
    pub fn checkpoint(path: &std::path::Path, why: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.to_path_buf(),
            why: why.into(),
        }
    }

    /// Wraps an I/O error with a sentence saying what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
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
                cause: "x".into(),
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
