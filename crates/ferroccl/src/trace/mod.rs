//! The flight recorder: what each communicator did, kept for when something goes wrong.
//!
//! Every communicator keeps its last [`Tuning::trace_capacity`](crate::config::Tuning)
//! operations (default 2048) in a ring: the call (sequence, kind, dtype, count, op,
//! root, algorithm), when it was issued, started and ended, the bytes it moved per
//! link, and how long it waited on each peer. Recording costs a few clock reads per
//! operation; nothing is written anywhere until a dump.
//!
//! A dump writes the ring as one JSON-lines file per rank, `DIR/rank-<rank>.jsonl` (a
//! child communicator's, made by `split` or `group`, in `DIR/comm-<id>/`, so that
//! `ferroccl trace DIR/comm-<id>` reads that communicator's ranks):
//! the first line is a [`Line::Rank`] (who, where, the clock offset to rank 0's host
//! and why the dump was taken), each further line a [`Line::Op`], oldest first. Dumps
//! happen
//!
//! - automatically when an operation fails (error, timeout, abort), into
//!   `FERROCCL_TRACE_DIR` if it is set;
//! - on `SIGUSR1`, for every communicator of the process (into `FERROCCL_TRACE_DIR`,
//!   or the current directory's `ferroccl-trace/`);
//! - when a communicator is dropped or the process exits, if `FERROCCL_TRACE_DIR` is
//!   set;
//! - when asked: [`crate::Communicator::dump_trace`].
//!
//! A dump never blocks the collective path: the ring is copied under a lock the
//! operations hold only to append one record, and written afterwards.
//! `ferroccl trace DIR` merges the files of all ranks into a Perfetto/Chrome trace
//! and reports stragglers and, for a failed job, who waited for whom.

mod recorder;
mod signal;

pub(crate) use recorder::{now_ns, PeerCounts, RecHead, Recorder};
pub use recorder::{read_dir, read_file, RankTrace};

use serde::{Deserialize, Serialize};

/// The environment variable naming the directory dumps go to.
pub const TRACE_DIR_ENV: &str = "FERROCCL_TRACE_DIR";

/// One line of a rank's trace file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line {
    /// The first line: which rank wrote the file, and why.
    Rank(RankInfo),
    /// One operation, oldest first.
    Op(OpRecord),
}

/// Who wrote a trace file, where, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankInfo {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Host name of the machine the rank ran on.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// The transport the rank's links use (`tcp`, `local`, …).
    pub transport: String,
    /// This rank's clock minus the reference clock (the rendezvous store's host, where
    /// rank 0 runs), in nanoseconds: subtract it from this file's times to put them on
    /// the reference clock. 0 when not estimated.
    pub clock_offset_ns: i64,
    /// Bound on the error of `clock_offset_ns` (half the best round trip to the store),
    /// in nanoseconds; `None` when the offset was not estimated (ranks in one process
    /// share a clock and need none).
    pub clock_error_ns: Option<u64>,
    /// Why this dump was taken: `error`, `timeout`, `abort`, `signal`, `exit`, `drop`
    /// or `request`.
    pub reason: String,
    /// Operations the ring holds at most.
    pub capacity: usize,
    /// Older operations that the ring overwrote before this dump.
    pub dropped: u64,
    /// When the dump was taken, nanoseconds since the Unix epoch on this rank's clock.
    pub dumped_ns: u64,
    /// The communicator: 0 for the job's own, a child's id (`split`, `group`)
    /// otherwise. A child's dumps go to `DIR/comm-<id as 16 hex digits>/`.
    #[serde(default)]
    pub comm: u64,
    /// This rank's rank in the job, for a child communicator (`rank` is its rank in
    /// the child).
    #[serde(default)]
    pub job_rank: Option<usize>,
}

/// Bytes one operation moved on the link to one peer (headers included).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// The peer.
    pub peer: usize,
    /// Bytes sent to it.
    pub sent: u64,
    /// Bytes received from it.
    pub recv: u64,
}

/// Time one operation spent waiting on one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerWait {
    /// The peer waited on (for its data, or for it to take ours).
    pub peer: usize,
    /// Nanoseconds spent idle waiting on it.
    pub ns: u64,
}

/// One operation as the flight recorder saw it. Times are nanoseconds since the Unix
/// epoch on the recording rank's clock (see [`RankInfo::clock_offset_ns`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// The communicator's sequence number of the call (per pair of ranks for
    /// send/recv).
    pub seq: u64,
    /// `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `reduce`, `barrier`,
    /// `send/recv`.
    pub kind: String,
    /// Element type, as nccl-tests names it (`float`, `half`, `bfloat16`, …).
    pub dtype: String,
    /// Elements in the call.
    pub count: u64,
    /// Reduction, for reducing collectives.
    pub op: Option<String>,
    /// Root rank of a rooted collective (the tag of a send/recv).
    pub root: Option<u32>,
    /// How the data moved (`ring`, `recursive doubling`, `chain`, `direct`).
    pub algo: String,
    /// When the caller issued it (a non-blocking operation may start later).
    pub enqueue_ns: u64,
    /// When the engine started moving its data.
    pub start_ns: u64,
    /// When it ended; `None` if it was still running when the dump was taken.
    pub end_ns: Option<u64>,
    /// `ok`, `running`, or the error's text.
    pub outcome: String,
    /// The peer this rank was waiting on when the operation failed or the dump was
    /// taken mid-operation.
    pub waiting_on: Option<usize>,
    /// Bytes per link.
    pub links: Vec<LinkBytes>,
    /// Idle time per peer waited on.
    pub waits: Vec<PeerWait>,
}

impl OpRecord {
    /// Whether the operation finished successfully.
    pub fn ok(&self) -> bool {
        self.outcome == "ok"
    }
}
