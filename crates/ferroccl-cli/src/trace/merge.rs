//! Every rank's dump on the reference clock (`t - clock_offset_ns`).

use crate::error::Result;
use ferroccl::trace::{OpRecord, RankTrace};
// ---------------------------------------------------------------------------------
// Merging: every time on the reference clock.

/// One operation of one rank, times on the reference clock (ns since the epoch).
pub(super) struct Op<'a> {
    pub(super) rec: &'a OpRecord,
    pub(super) rank: usize,
    pub(super) enqueue: i64,
    pub(super) start: i64,
    /// Its end, or the dump's time for an operation still running.
    pub(super) end: i64,
    pub(super) running: bool,
}

impl Op<'_> {
    pub(super) fn failed(&self) -> bool {
        !self.running && !self.rec.ok()
    }

    pub(super) fn label(&self) -> String {
        format!("{} #{}", self.rec.kind, self.rec.seq)
    }
}

/// All ranks' dumps on one clock.
pub(super) struct Merged<'a> {
    pub(super) traces: &'a [RankTrace],
    pub(super) world_size: usize,
    /// Ranks of the job that left no file.
    pub(super) missing: Vec<usize>,
    /// Per trace (same order as `traces`), oldest first.
    pub(super) ops: Vec<Vec<Op<'a>>>,
    /// Earliest start over all ranks (the trace's time zero), and the latest end.
    pub(super) t0: i64,
    pub(super) t_end: i64,
    pub(super) warnings: Vec<String>,
}

impl Merged<'_> {
    /// The index in `traces` of `rank`'s file.
    pub(super) fn index(&self, rank: usize) -> Option<usize> {
        self.traces.iter().position(|t| t.info.rank == rank)
    }
}

pub(super) fn ns(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

/// `t` (ns on a rank's clock) on the reference clock.
pub(super) fn to_ref(t: u64, offset: i64) -> i64 {
    ns(t).saturating_sub(offset)
}

pub(super) fn merge(traces: &[RankTrace]) -> Result<Merged<'_>> {
    let mut warnings = Vec::new();
    for t in traces {
        if t.info.rank >= t.info.world_size {
            return Err(crate::error::CliError::Input(format!(
                "{}: rank {} is not a rank of its world size {}",
                t.path.display(),
                t.info.rank,
                t.info.world_size
            )));
        }
    }
    let world_size = traces.iter().map(|t| t.info.world_size).max().unwrap_or(0);
    if traces.iter().any(|t| t.info.world_size != world_size) {
        let sizes: Vec<String> = traces
            .iter()
            .map(|t| format!("rank {}: {}", t.info.rank, t.info.world_size))
            .collect();
        warnings.push(format!(
            "the files disagree on the world size ({}): are they from one job?",
            sizes.join(", ")
        ));
    }
    let missing = (0..world_size)
        .filter(|r| !traces.iter().any(|t| t.info.rank == *r))
        .collect();
    let mut ops = Vec::with_capacity(traces.len());
    let (mut t0, mut t_end) = (i64::MAX, i64::MIN);
    for t in traces {
        let off = t.info.clock_offset_ns;
        let dumped = to_ref(t.info.dumped_ns, off);
        let v: Vec<Op<'_>> = t
            .ops
            .iter()
            .map(|o| {
                let start = to_ref(o.start_ns, off);
                let running = o.end_ns.is_none() || o.outcome == "running";
                let end = match o.end_ns {
                    Some(e) => to_ref(e, off),
                    None => dumped,
                }
                .max(start);
                Op {
                    rec: o,
                    rank: t.info.rank,
                    enqueue: to_ref(o.enqueue_ns, off),
                    start,
                    end,
                    running,
                }
            })
            .collect();
        for o in &v {
            t0 = t0.min(o.start);
            t_end = t_end.max(o.end);
        }
        ops.push(v);
    }
    if t0 == i64::MAX {
        // No operation at all: time zero is the first dump.
        t0 = traces
            .iter()
            .map(|t| to_ref(t.info.dumped_ns, t.info.clock_offset_ns))
            .min()
            .unwrap_or(0);
        t_end = t0;
    }
    Ok(Merged {
        traces,
        world_size,
        missing,
        ops,
        t0,
        t_end,
        warnings,
    })
}
