//! `ferroccl trace DIR`: the flight recorder's dumps of all ranks, merged.
//!
//! Every rank's dump (`DIR/rank-<rank>.jsonl`, see [`ferroccl::trace`]) is put on the
//! reference clock (`t - clock_offset_ns`), then
//!
//! - written as one Chrome/Perfetto trace (`--out`, default `DIR/trace.json`): a track
//!   per rank, each operation a slice with the time it waited on each peer nested in it;
//! - reported: for each collective recorded on two or more ranks (matched by kind and
//!   sequence number; send/recv numbers count per pair and are not matched) the rank
//!   that started last and how late it was against the median start of the others; per
//!   rank how often it was last; the straggler, if one rank stands out; and for a failed
//!   or hung job each rank's last operation, who waited for whom, and the ranks that are
//!   behind or left no file;
//! - drawn as an SVG timeline with `--svg`.
//!
//! `--json` prints the same report as one JSON object. `ferroccl bench --trace DIR` and
//! `ferroccl train --trace DIR` write the dumps this reads ([`record_into`], [`finish`]).

use clap::Args;
use ferroccl::trace::{OpRecord, RankTrace, TRACE_DIR_ENV};
use ferroccl::{Communicator, ReduceOp};
use plotters::prelude::*;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Arguments of `ferroccl trace`.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Directory holding the ranks' dumps (`rank-<rank>.jsonl`): written by
    /// `FERROCCL_TRACE_DIR`, `Communicator::dump_trace`, SIGUSR1, or `bench`/`train
    /// --trace DIR`.
    pub dir: PathBuf,
    /// Where to write the merged Chrome/Perfetto trace (open it in
    /// https://ui.perfetto.dev or chrome://tracing) [default: DIR/trace.json].
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Also draw the timeline as an SVG: a row per rank, operations colored by kind,
    /// failed ones red, time waiting on peers darker.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Print the report as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Collectives listed in the table of the latest operations.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub last: usize,
}

pub fn main(a: TraceArgs) -> ExitCode {
    match run(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroccl trace: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(a: &TraceArgs) -> Result<(), String> {
    let traces = ferroccl::trace::read_dir(&a.dir).map_err(|e| e.to_string())?;
    let m = merge(&traces)?;
    let out = a.out.clone().unwrap_or_else(|| a.dir.join("trace.json"));
    let text = serde_json::to_string(&chrome_trace(&m)).map_err(|e| e.to_string())?;
    std::fs::write(&out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
    if let Some(svg) = &a.svg {
        draw_svg(svg, &m)?;
    }
    let rep = report(&m, a.last, &out, a.svg.as_deref());
    if a.json {
        let s = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
        println!("{s}");
    } else {
        print_report(&rep);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Writing the dumps: `bench --trace DIR`, `train --trace DIR`.

/// Makes every communicator this process creates dump into `dir` on failure, on drop
/// and at exit (through `FERROCCL_TRACE_DIR`, which ranks started as child processes
/// inherit). `fresh`: this process owns the whole job (it starts its ranks itself), so
/// dumps of an earlier run left in `dir` are removed first. Call it before any
/// communicator (and so any thread) exists: it sets an environment variable.
pub fn record_into(dir: &Path, fresh: bool) -> ferroccl::Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ferroccl::Error::io(format!("creating {}", dir.display()), e))?;
    if fresh {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| ferroccl::Error::io(format!("reading {}", dir.display()), e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("rank-") && name.ends_with(".jsonl") {
                std::fs::remove_file(e.path()).map_err(|err| {
                    ferroccl::Error::io(format!("removing {}", e.path().display()), err)
                })?;
            }
        }
    }
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    // Edition 2021: a safe fn; called while this process has no other thread.
    std::env::set_var(TRACE_DIR_ENV, abs);
    Ok(())
}

/// The end of one rank's run with `--trace DIR`: dumps its flight recorder into `dir`,
/// counts over the ranks whose dumps were written, and rank 0 says where they are.
/// Returns `r` unchanged: tracing never changes a run's outcome. After a failure
/// (`r` is an error or the communicator is poisoned) no collective is attempted.
pub fn finish<T, E>(c: &Communicator, dir: Option<&Path>, r: Result<T, E>) -> Result<T, E> {
    let Some(dir) = dir else {
        return r;
    };
    let dumped = c.dump_trace(dir);
    if let Err(e) = &dumped {
        eprintln!("rank {}: trace: {e}", c.rank());
    }
    if r.is_err() || c.poisoned().is_some() {
        return r;
    }
    let mut k = [i64::from(dumped.is_ok())];
    match c.all_reduce(&mut k, ReduceOp::Sum) {
        Ok(()) if c.rank() == 0 => {
            let n = c.world_size();
            let written = if k[0] == n as i64 {
                format!("{n} ranks")
            } else {
                format!("{} of {n} ranks", k[0])
            };
            println!(
                "trace: {written} written to {}; view with `ferroccl trace {}`",
                dir.display(),
                dir.display()
            );
        }
        Ok(()) => {}
        Err(e) => eprintln!("rank {}: trace: counting the dumps: {e}", c.rank()),
    }
    r
}

// ---------------------------------------------------------------------------------
// Merging: every time on the reference clock.

/// One operation of one rank, times on the reference clock (ns since the epoch).
struct Op<'a> {
    rec: &'a OpRecord,
    rank: usize,
    enqueue: i64,
    start: i64,
    /// Its end, or the dump's time for an operation still running.
    end: i64,
    running: bool,
}

impl Op<'_> {
    fn failed(&self) -> bool {
        !self.running && !self.rec.ok()
    }

    fn label(&self) -> String {
        format!("{} #{}", self.rec.kind, self.rec.seq)
    }
}

/// All ranks' dumps on one clock.
struct Merged<'a> {
    traces: &'a [RankTrace],
    world_size: usize,
    /// Ranks of the job that left no file.
    missing: Vec<usize>,
    /// Per trace (same order as `traces`), oldest first.
    ops: Vec<Vec<Op<'a>>>,
    /// Earliest start over all ranks (the trace's time zero), and the latest end.
    t0: i64,
    t_end: i64,
    warnings: Vec<String>,
}

impl Merged<'_> {
    /// The index in `traces` of `rank`'s file.
    fn index(&self, rank: usize) -> Option<usize> {
        self.traces.iter().position(|t| t.info.rank == rank)
    }
}

fn ns(t: u64) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

/// `t` (ns on a rank's clock) on the reference clock.
fn to_ref(t: u64, offset: i64) -> i64 {
    ns(t).saturating_sub(offset)
}

fn merge(traces: &[RankTrace]) -> Result<Merged<'_>, String> {
    let mut warnings = Vec::new();
    for t in traces {
        if t.info.rank >= t.info.world_size {
            return Err(format!(
                "{}: rank {} is not a rank of its world size {}",
                t.path.display(),
                t.info.rank,
                t.info.world_size
            ));
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

// ---------------------------------------------------------------------------------
// The report.

#[derive(Serialize, Debug)]
struct Report {
    dir: String,
    world_size: usize,
    ranks: Vec<RankSummary>,
    missing_ranks: Vec<usize>,
    clock: Clock,
    chrome_trace: String,
    svg: Option<String>,
    /// Collectives recorded on two or more ranks.
    collectives: usize,
    /// Of those, the ones every rank of the job recorded.
    collectives_on_all_ranks: usize,
    /// The last `--last` of them, oldest first.
    latest: Vec<MatchedOp>,
    /// One per rank with a file.
    stragglers: Vec<RankStat>,
    /// The rank named the straggler, if one stands out.
    straggler: Option<usize>,
    verdict: String,
    failure: Option<Failure>,
    warnings: Vec<String>,
}

#[derive(Serialize, Debug)]
struct RankSummary {
    rank: usize,
    host: String,
    pid: u32,
    transport: String,
    reason: String,
    ops: usize,
    dropped: u64,
    capacity: usize,
    failed_ops: usize,
    running_ops: usize,
    clock_offset_ns: i64,
    clock_error_ns: Option<u64>,
    path: String,
}

#[derive(Serialize, Debug)]
struct Clock {
    /// Every offset 0 and none estimated: the ranks read one clock.
    shared: bool,
    max_abs_offset_ns: u64,
    /// The largest error bound over the ranks; `None` when no offset was estimated.
    error_bound_ns: Option<u64>,
    text: String,
}

#[derive(Serialize, Debug, Clone)]
struct MatchedOp {
    kind: String,
    seq: u64,
    /// Ranks that recorded it.
    ranks: usize,
    /// The rank that started last (`None` on a tie).
    last_rank: Option<usize>,
    /// How much later it started than the median start of the others.
    late_ns: u64,
    /// The first start, ns after the trace's time zero.
    first_start_ns: i64,
    /// Last start minus first start.
    spread_ns: u64,
    /// Median duration over the ranks.
    duration_ns: u64,
}

#[derive(Serialize, Debug, Clone)]
struct RankStat {
    rank: usize,
    /// Matched collectives this rank recorded.
    ops: usize,
    /// Of those, the ones it started last.
    last: usize,
    /// `last / ops`.
    share: f64,
    /// Median lateness when it was last.
    median_late_ns: Option<u64>,
    /// Summed lateness when it was last.
    late_total_ns: u64,
    /// Its part of all ranks' summed lateness.
    late_share: f64,
    /// Time the other ranks spent inside operations waiting on it (their recorders'
    /// idle time per peer): what a rank that stalls *inside* calls costs them, which
    /// lateness at the start of calls does not see.
    waited_on_ns: u64,
    /// Its part of all the waiting inside operations.
    waited_on_share: f64,
    /// `waited_on_ns` over the other ranks' summed time in operations.
    waited_on_frac: f64,
}

#[derive(Serialize, Debug)]
struct Failure {
    /// Each rank's last operation, every rank of the job.
    last_ops: Vec<LastOp>,
    /// "rank A waited for rank B", from the last operations.
    waits: Vec<WaitEdge>,
    /// Ranks whose last collective is behind the others' (the lowest sequence number).
    behind: Vec<usize>,
    /// Where the chains of waits end: ranks waited for that wait for no one (a chain
    /// that loops ends nowhere).
    chain_ends: Vec<usize>,
    /// The ranks to look at first: missing, behind and waiting for no one, chain ends.
    suspects: Vec<usize>,
    summary: String,
}

#[derive(Serialize, Debug)]
struct LastOp {
    rank: usize,
    /// No file from this rank.
    missing: bool,
    kind: Option<String>,
    seq: Option<u64>,
    outcome: Option<String>,
    waiting_on: Option<usize>,
    /// Sequence number of its last collective (send/recv left out).
    last_collective_seq: Option<u64>,
}

#[derive(Serialize, Debug)]
struct WaitEdge {
    rank: usize,
    waited_for: usize,
    op: String,
    outcome: String,
}

fn clock(m: &Merged<'_>) -> Clock {
    let max_abs = m
        .traces
        .iter()
        .map(|t| t.info.clock_offset_ns.unsigned_abs())
        .max()
        .unwrap_or(0);
    let err = m.traces.iter().filter_map(|t| t.info.clock_error_ns).max();
    let shared = max_abs == 0 && err.is_none();
    let text = if shared {
        "ranks share one clock".to_string()
    } else {
        format!(
            "clock offsets: max |offset| {:.1} µs, error bound {}",
            max_abs as f64 / 1e3,
            match err {
                Some(e) => format!("±{:.1} µs", e as f64 / 1e3),
                None => "unknown".into(),
            }
        )
    };
    Clock {
        shared,
        max_abs_offset_ns: max_abs,
        error_bound_ns: err,
        text,
    }
}

/// Where one rank has an operation: (rank, start, end) on the reference clock.
type At = (usize, i64, i64);

/// One collective as recorded by the ranks that have it, by start.
struct Matched {
    kind: String,
    seq: u64,
    at: Vec<At>,
    last: Option<usize>,
    late: u64,
}

/// Median of a non-empty sorted slice (the mean of the middle two for an even length).
fn median_sorted(v: &[i64]) -> i64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        ((i128::from(v[n / 2 - 1]) + i128::from(v[n / 2])) / 2) as i64
    }
}

/// Collectives recorded on two or more ranks, by sequence number.
fn match_collectives(m: &Merged<'_>) -> Vec<Matched> {
    let mut by: BTreeMap<(u64, &str), Vec<At>> = BTreeMap::new();
    for o in m.ops.iter().flatten() {
        if o.rec.kind == "send/recv" {
            continue;
        }
        let v = by.entry((o.rec.seq, o.rec.kind.as_str())).or_default();
        match v.iter_mut().find(|e| e.0 == o.rank) {
            Some(e) => *e = (o.rank, o.start, o.end),
            None => v.push((o.rank, o.start, o.end)),
        }
    }
    by.into_iter()
        .filter(|(_, v)| v.len() >= 2)
        .map(|((seq, kind), mut at)| {
            at.sort_by_key(|e| (e.1, e.0));
            let n = at.len();
            let (last, late) = if at[n - 1].1 == at[n - 2].1 {
                (None, 0)
            } else {
                let others: Vec<i64> = at[..n - 1].iter().map(|e| e.1).collect();
                let late = at[n - 1].1.saturating_sub(median_sorted(&others));
                (Some(at[n - 1].0), late.max(0) as u64)
            };
            Matched {
                kind: kind.to_string(),
                seq,
                at,
                last,
                late,
            }
        })
        .collect()
}

fn matched_op(x: &Matched, t0: i64) -> MatchedOp {
    let first = x.at[0].1;
    let lastt = x.at[x.at.len() - 1].1;
    let mut durs: Vec<i64> = x.at.iter().map(|e| e.2 - e.1).collect();
    durs.sort_unstable();
    MatchedOp {
        kind: x.kind.clone(),
        seq: x.seq,
        ranks: x.at.len(),
        last_rank: x.last,
        late_ns: x.late,
        first_start_ns: first.saturating_sub(t0),
        spread_ns: lastt.saturating_sub(first).max(0) as u64,
        duration_ns: median_sorted(&durs).max(0) as u64,
    }
}

fn rank_stats(m: &Merged<'_>, matched: &[Matched]) -> Vec<RankStat> {
    let total: u128 = matched.iter().map(|x| u128::from(x.late)).sum();
    // Waiting inside operations, by the rank waited on; and each rank's time in them.
    let mut waited = vec![0u128; m.world_size];
    let mut busy = vec![0u128; m.world_size];
    for ops in &m.ops {
        for o in ops {
            if let Some(b) = busy.get_mut(o.rank) {
                *b += u128::try_from(o.end.saturating_sub(o.start).max(0)).unwrap_or(0);
            }
            for w in &o.rec.waits {
                if w.peer != o.rank {
                    if let Some(x) = waited.get_mut(w.peer) {
                        *x += u128::from(w.ns);
                    }
                }
            }
        }
    }
    let all_waits: u128 = waited.iter().sum();
    let all_busy: u128 = busy.iter().sum();
    m.traces
        .iter()
        .map(|t| {
            let r = t.info.rank;
            let on_r = waited.get(r).copied().unwrap_or(0);
            let others_busy = all_busy - busy.get(r).copied().unwrap_or(0);
            let ops = matched
                .iter()
                .filter(|x| x.at.iter().any(|e| e.0 == r))
                .count();
            let mut lates: Vec<i64> = matched
                .iter()
                .filter(|x| x.last == Some(r))
                .map(|x| x.late as i64)
                .collect();
            lates.sort_unstable();
            let sum: u128 = lates.iter().map(|&l| l as u128).sum();
            RankStat {
                rank: r,
                ops,
                last: lates.len(),
                share: if ops == 0 {
                    0.0
                } else {
                    lates.len() as f64 / ops as f64
                },
                median_late_ns: (!lates.is_empty()).then(|| median_sorted(&lates) as u64),
                late_total_ns: u64::try_from(sum).unwrap_or(u64::MAX),
                late_share: if total == 0 {
                    0.0
                } else {
                    sum as f64 / total as f64
                },
                waited_on_ns: u64::try_from(on_r).unwrap_or(u64::MAX),
                waited_on_share: if all_waits == 0 {
                    0.0
                } else {
                    on_r as f64 / all_waits as f64
                },
                waited_on_frac: if others_busy == 0 {
                    0.0
                } else {
                    on_r as f64 / others_busy as f64
                },
            }
        })
        .collect()
}

/// The share of last arrivals, or of lateness, above which a rank stands out: twice
/// its fair share 1/n, or halfway from the fair share to all of it for small jobs
/// (n = 2: 75 %, n = 3: 67 %, n = 4: 50 %, n = 8: 25 %).
fn stands_out_above(world_size: usize) -> f64 {
    let n = world_size.max(1) as f64;
    (2.0 / n).min((1.0 + 1.0 / n) / 2.0)
}

/// Fewest matched collectives for naming a straggler.
const MIN_OPS: usize = 3;

/// Share of the other ranks' time in operations spent waiting on one rank, above
/// which a rank that stalls inside operations is named (with a share of all the
/// waiting above [`stands_out_above`]).
const WAITED_ON_FRAC: f64 = 0.10;

/// The straggler, if one stands out, and the sentence that says so or why not.
/// `err_ns`: the clock error bound of one rank; two ranks' starts differ by up to twice
/// that from their clocks alone.
fn verdict(
    stats: &[RankStat],
    collectives: usize,
    world_size: usize,
    err_ns: u64,
) -> (Option<usize>, String) {
    if collectives == 0 {
        return (
            None,
            "no collective was recorded on two or more ranks: nothing to compare".into(),
        );
    }
    if collectives < MIN_OPS {
        return (
            None,
            format!("only {collectives} collective(s) on two or more ranks: too few to name a straggler"),
        );
    }
    let thr = stands_out_above(world_size);
    // A rank the others wait on inside their operations: it arrives on time but
    // stalls in them (descheduled, stopped, slow memory), which lateness at entry
    // does not show.
    let inside = stats
        .iter()
        .max_by(|a, b| a.waited_on_share.total_cmp(&b.waited_on_share))
        .filter(|w| w.waited_on_share > thr && w.waited_on_frac > WAITED_ON_FRAC);
    let inside_words = |w: &RankStat| {
        format!(
            "the others spent {} waiting on it inside collectives, {:.0} % of all the waiting and {:.0} % of their time in collectives",
            fmt_ns(w.waited_on_ns as f64),
            100.0 * w.waited_on_share,
            100.0 * w.waited_on_frac
        )
    };
    let Some(c) = stats.iter().filter(|s| s.last > 0).max_by(|a, b| {
        a.late_share
            .total_cmp(&b.late_share)
            .then(a.share.total_cmp(&b.share))
    }) else {
        if let Some(w) = inside {
            return (
                Some(w.rank),
                format!(
                    "straggler: rank {} — it stalls inside operations: {}",
                    w.rank,
                    inside_words(w)
                ),
            );
        }
        return (None, "no rank ever started last (every start tied)".into());
    };
    let med = c.median_late_ns.unwrap_or(0);
    let bound = err_ns.saturating_mul(2);
    let fair = 100.0 / world_size.max(1) as f64;
    let often = c.share > thr || c.late_share > thr;
    match inside {
        Some(w) if !(often && med > bound) => {
            return (
                Some(w.rank),
                format!(
                    "straggler: rank {} — it starts on time but stalls inside operations: {}",
                    w.rank,
                    inside_words(w)
                ),
            );
        }
        _ => {}
    }
    if often && med > bound {
        (
            Some(c.rank),
            format!(
                "straggler: rank {} — it started last in {:.0} % of its {} collectives, {} late (median), and caused {:.0} % of all the lateness (a fair share is {fair:.0} %)",
                c.rank,
                100.0 * c.share,
                thousands(c.ops),
                fmt_ns(med as f64),
                100.0 * c.late_share
            ),
        )
    } else if often {
        (
            None,
            format!(
                "no rank stands out: rank {} starts last most often, but its median lateness {} is within the clocks' error (±{})",
                c.rank,
                fmt_ns(med as f64),
                fmt_ns(bound as f64)
            ),
        )
    } else {
        (
            None,
            format!(
                "no rank stands out: the last arrival moves between ranks (the most, rank {}, caused {:.0} % of the lateness; a fair share is {fair:.0} %)",
                c.rank,
                100.0 * c.late_share
            ),
        )
    }
}

fn failure(m: &Merged<'_>) -> Option<Failure> {
    let bad = m.ops.iter().flatten().any(|o| o.running || o.failed());
    if !bad && m.missing.is_empty() {
        return None;
    }
    let last_of = |r: usize| -> Option<&Op<'_>> { m.index(r).and_then(|i| m.ops[i].last()) };
    let last_ops: Vec<LastOp> = (0..m.world_size)
        .map(|r| {
            let Some(i) = m.index(r) else {
                return LastOp {
                    rank: r,
                    missing: true,
                    kind: None,
                    seq: None,
                    outcome: None,
                    waiting_on: None,
                    last_collective_seq: None,
                };
            };
            let last = m.ops[i].last();
            LastOp {
                rank: r,
                missing: false,
                kind: last.map(|o| o.rec.kind.clone()),
                seq: last.map(|o| o.rec.seq),
                outcome: last.map(|o| o.rec.outcome.clone()),
                waiting_on: last.and_then(|o| o.rec.waiting_on),
                last_collective_seq: m.ops[i]
                    .iter()
                    .rev()
                    .find(|o| o.rec.kind != "send/recv")
                    .map(|o| o.rec.seq),
            }
        })
        .collect();
    // Who waits for whom: the last operation's peer, when it did not end well.
    let waits_for = |r: usize| -> Option<usize> {
        last_of(r)
            .filter(|o| !o.rec.ok())
            .and_then(|o| o.rec.waiting_on)
    };
    let waits: Vec<WaitEdge> = (0..m.world_size)
        .filter_map(|r| {
            let p = waits_for(r)?;
            let o = last_of(r)?;
            Some(WaitEdge {
                rank: r,
                waited_for: p,
                op: o.label(),
                outcome: o.rec.outcome.clone(),
            })
        })
        .collect();
    // Follow each chain of waits to a rank that waits for no one. A chain that comes
    // back on itself (partners of a recursive-doubling step waiting for each other
    // after a third rank died) ends nowhere: it names no one.
    let mut chain_ends = Vec::new();
    for w in &waits {
        let mut seen = vec![w.rank];
        let mut cur = w.waited_for;
        let mut cycle = false;
        while let Some(next) = waits_for(cur) {
            if seen.contains(&cur) {
                cycle = true;
                break;
            }
            seen.push(cur);
            cur = next;
        }
        if !cycle && !chain_ends.contains(&cur) {
            chain_ends.push(cur);
        }
    }
    chain_ends.sort_unstable();
    // Behind: the lowest last collective, when the ranks with files disagree.
    let seqs: Vec<(usize, Option<u64>)> = last_ops
        .iter()
        .filter(|l| !l.missing)
        .map(|l| (l.rank, l.last_collective_seq))
        .collect();
    // `None` (no collective at all) orders below every sequence number.
    let lo = seqs.iter().map(|s| s.1).min().unwrap_or(None);
    let hi = seqs.iter().map(|s| s.1).max().unwrap_or(None);
    let behind: Vec<usize> = if seqs.len() >= 2 && lo != hi {
        seqs.iter().filter(|s| s.1 == lo).map(|s| s.0).collect()
    } else {
        Vec::new()
    };
    // A rank behind that was itself waiting on another is in a chain: the chain's end
    // is the suspect, not it (when a rank dies, its ring neighbours stop one step
    // apart).
    let stalled: Vec<usize> = behind
        .iter()
        .copied()
        .filter(|&r| waits_for(r).is_none())
        .collect();
    let mut suspects: Vec<usize> = Vec::new();
    for r in m.missing.iter().chain(&stalled).chain(&chain_ends) {
        if !suspects.contains(r) {
            suspects.push(*r);
        }
    }
    if suspects.is_empty() {
        // Nobody behind or waited for: the ranks whose last operation failed.
        suspects = last_ops
            .iter()
            .filter(|l| {
                l.outcome
                    .as_deref()
                    .is_some_and(|o| o != "ok" && o != "running")
            })
            .map(|l| l.rank)
            .collect();
    }
    let why = |r: usize| -> String {
        let mut v = Vec::new();
        if m.missing.contains(&r) {
            v.push("it left no trace file (did it die, or dump elsewhere?)".to_string());
        }
        if stalled.contains(&r) {
            let l = &last_ops[r];
            v.push(match (l.last_collective_seq, hi) {
                (Some(s), Some(h)) => {
                    format!("its last collective is #{s}, behind the others' #{h}")
                }
                _ => "it recorded no collective while the others did".to_string(),
            });
        }
        let waiters: Vec<String> = waits
            .iter()
            .filter(|w| w.waited_for == r)
            .map(|w| w.rank.to_string())
            .collect();
        if !waiters.is_empty() {
            v.push(format!(
                "rank{} {} waited for it",
                if waiters.len() > 1 { "s" } else { "" },
                waiters.join(", ")
            ));
        }
        if let Some(o) = last_ops[r]
            .outcome
            .as_deref()
            .filter(|o| *o != "ok" && *o != "running")
        {
            v.push(format!("its last operation failed: {o}"));
        }
        v.join("; ")
    };
    let summary = match suspects.as_slice() {
        [] => "no rank stands out: every rank's last operation ended well".to_string(),
        [r] => format!("look at rank {r} first: {}", why(*r)),
        rs => {
            let parts: Vec<String> = rs
                .iter()
                .map(|r| format!("rank {r}: {}", why(*r)))
                .collect();
            format!("look at ranks {} first — {}", join(rs), parts.join(" — "))
        }
    };
    Some(Failure {
        last_ops,
        waits,
        behind,
        chain_ends,
        suspects,
        summary,
    })
}

fn report(m: &Merged<'_>, last_n: usize, chrome: &Path, svg: Option<&Path>) -> Report {
    let clock = clock(m);
    let matched = match_collectives(m);
    let stats = rank_stats(m, &matched);
    let (straggler, verdict) = verdict(
        &stats,
        matched.len(),
        m.world_size,
        clock.error_bound_ns.unwrap_or(0),
    );
    let ranks = m
        .traces
        .iter()
        .zip(&m.ops)
        .map(|(t, ops)| RankSummary {
            rank: t.info.rank,
            host: t.info.host.clone(),
            pid: t.info.pid,
            transport: t.info.transport.clone(),
            reason: t.info.reason.clone(),
            ops: ops.len(),
            dropped: t.info.dropped,
            capacity: t.info.capacity,
            failed_ops: ops.iter().filter(|o| o.failed()).count(),
            running_ops: ops.iter().filter(|o| o.running).count(),
            clock_offset_ns: t.info.clock_offset_ns,
            clock_error_ns: t.info.clock_error_ns,
            path: t.path.display().to_string(),
        })
        .collect();
    let mut warnings = m.warnings.clone();
    if !clock.shared && clock.error_bound_ns.is_none() {
        warnings.push(
            "clock offsets are set but their error is unknown: small lateness may be clock error"
                .into(),
        );
    }
    Report {
        dir: m
            .traces
            .first()
            .and_then(|t| t.path.parent())
            .map_or_else(String::new, |p| p.display().to_string()),
        world_size: m.world_size,
        ranks,
        missing_ranks: m.missing.clone(),
        clock,
        chrome_trace: chrome.display().to_string(),
        svg: svg.map(|p| p.display().to_string()),
        collectives: matched.len(),
        collectives_on_all_ranks: matched
            .iter()
            .filter(|x| x.at.len() == m.world_size)
            .count(),
        latest: matched[matched.len().saturating_sub(last_n)..]
            .iter()
            .map(|x| matched_op(x, m.t0))
            .collect(),
        stragglers: stats,
        straggler,
        verdict,
        failure: failure(m),
        warnings,
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Nanoseconds in the unit that reads best.
fn fmt_ns(ns: f64) -> String {
    let a = ns.abs();
    if a >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if a >= 1e6 {
        format!("{:.1} ms", ns / 1e6)
    } else if a >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn join(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_report(r: &Report) {
    println!(
        "ferroccl trace: {} of {} ranks from {}",
        r.ranks.len(),
        r.world_size,
        r.dir
    );
    for s in &r.ranks {
        println!(
            "  rank {:<3} {}  pid {}  {}  {} ops{}  dump: {}",
            s.rank,
            s.host,
            s.pid,
            s.transport,
            thousands(s.ops),
            if s.dropped > 0 {
                format!(
                    " (and {} older ones overwritten)",
                    thousands(s.dropped as usize)
                )
            } else {
                String::new()
            },
            s.reason
        );
    }
    if !r.missing_ranks.is_empty() {
        println!("  no file from rank(s) {}", join(&r.missing_ranks));
    }
    for w in &r.warnings {
        println!("warning: {w}");
    }
    println!("{}", r.clock.text);
    println!(
        "chrome trace: {} (open in https://ui.perfetto.dev or chrome://tracing)",
        r.chrome_trace
    );
    if let Some(s) = &r.svg {
        println!("timeline: {s}");
    }
    println!();
    if r.collectives > 0 {
        println!(
            "last {} of {} collectives on two or more ranks (times on the reference clock; late: the last start against the median start of the others)",
            r.latest.len(),
            thousands(r.collectives)
        );
        println!(
            "  {:<24} {:>5} {:>12} {:>6} {:>11} {:>11} {:>11}",
            "operation", "ranks", "start", "last", "late", "spread", "duration"
        );
        for o in &r.latest {
            println!(
                "  {:<24} {:>5} {:>12} {:>6} {:>11} {:>11} {:>11}",
                format!("{} #{}", o.kind, o.seq),
                format!("{}/{}", o.ranks, r.world_size),
                fmt_ns(o.first_start_ns as f64),
                o.last_rank.map_or("tie".into(), |x| x.to_string()),
                fmt_ns(o.late_ns as f64),
                fmt_ns(o.spread_ns as f64),
                fmt_ns(o.duration_ns as f64)
            );
        }
        println!();
        println!("who started last:");
        let mut stats = r.stragglers.clone();
        if stats.len() > 16 {
            // Many ranks: the ones that caused the most lateness.
            stats.sort_by(|a, b| b.late_share.total_cmp(&a.late_share));
            stats.truncate(16);
        }
        for s in &stats {
            match s.median_late_ns {
                Some(med) => println!(
                    "  rank {} arrived last in {:.0} % of {} operations, median {} late ({:.0} % of all lateness)",
                    s.rank,
                    100.0 * s.share,
                    thousands(s.ops),
                    fmt_ns(med as f64),
                    100.0 * s.late_share
                ),
                None => println!(
                    "  rank {} arrived last in none of {} operations",
                    s.rank,
                    thousands(s.ops)
                ),
            }
        }
    }
    println!("{}", r.verdict);
    if let Some(f) = &r.failure {
        println!();
        println!("the job failed or hung; each rank's last operation:");
        for l in &f.last_ops {
            if l.missing {
                println!("  rank {:<3} no trace file", l.rank);
                continue;
            }
            match (&l.kind, l.seq, &l.outcome) {
                (Some(k), Some(s), Some(o)) => println!(
                    "  rank {:<3} {:<20} {}{}",
                    l.rank,
                    format!("{k} #{s}"),
                    o,
                    l.waiting_on
                        .map_or(String::new(), |p| format!(" (waiting on rank {p})"))
                ),
                _ => println!("  rank {:<3} no operation recorded", l.rank),
            }
        }
        for w in &f.waits {
            println!(
                "rank {} waited for rank {} ({})",
                w.rank, w.waited_for, w.op
            );
        }
        if !f.behind.is_empty() {
            let at: Vec<String> = f
                .behind
                .iter()
                .map(|&r| match f.last_ops[r].last_collective_seq {
                    Some(s) => format!("rank {r} (at #{s})"),
                    None => format!("rank {r} (no collective)"),
                })
                .collect();
            println!("behind the others: {}", at.join(", "));
        }
        println!("{}", f.summary);
    }
}

// ---------------------------------------------------------------------------------
// The Chrome/Perfetto trace.

/// µs after time zero, as the trace event format wants them.
fn us(t: i64, t0: i64) -> f64 {
    t.saturating_sub(t0) as f64 / 1e3
}

fn chrome_trace(m: &Merged<'_>) -> Value {
    let mut ev: Vec<Value> = Vec::new();
    ev.push(json!({"ph": "M", "pid": 0, "name": "process_name",
        "args": {"name": format!("ferroccl job ({} ranks)", m.world_size)}}));
    for r in 0..m.world_size {
        let name = match m.index(r) {
            Some(i) => {
                let info = &m.traces[i].info;
                format!("rank {r} ({}, pid {})", info.host, info.pid)
            }
            None => format!("rank {r} (no trace file)"),
        };
        ev.push(
            json!({"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": name}}),
        );
        ev.push(json!({"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}}));
    }
    for (t, ops) in m.traces.iter().zip(&m.ops) {
        let r = t.info.rank;
        for o in ops {
            let rec = o.rec;
            let links: serde_json::Map<String, Value> = rec
                .links
                .iter()
                .map(|l| {
                    (
                        format!("rank {}", l.peer),
                        json!({"sent": l.sent, "recv": l.recv}),
                    )
                })
                .collect();
            let waited: serde_json::Map<String, Value> = rec
                .waits
                .iter()
                .map(|w| (format!("rank {}", w.peer), json!(w.ns as f64 / 1e3)))
                .collect();
            let mut e = json!({
                "ph": "X", "pid": 0, "tid": r, "cat": rec.kind,
                "name": o.label(),
                "ts": us(o.start, m.t0),
                "dur": o.end.saturating_sub(o.start) as f64 / 1e3,
                "args": {
                    "dtype": rec.dtype, "count": rec.count, "op": rec.op, "root": rec.root,
                    "algo": rec.algo, "outcome": rec.outcome, "waiting_on": rec.waiting_on,
                    "queued_us": o.start.saturating_sub(o.enqueue).max(0) as f64 / 1e3,
                    "bytes_per_link": links, "waited_us": waited,
                },
            });
            if o.failed() {
                e["cname"] = json!("terrible");
            } else if o.running {
                e["cname"] = json!("bad");
            }
            ev.push(e);
            // Only the total per peer is known: lay the waits end to end from the start.
            let mut at = o.start;
            for w in &rec.waits {
                let d = ns(w.ns).min(o.end.saturating_sub(at));
                if d <= 0 {
                    continue;
                }
                ev.push(json!({
                    "ph": "X", "pid": 0, "tid": r, "cat": "wait",
                    "name": format!("wait rank {}", w.peer),
                    "ts": us(at, m.t0), "dur": d as f64 / 1e3,
                    "args": {"peer": w.peer, "total_us": w.ns as f64 / 1e3,
                             "note": "total time waited on this peer; its place inside the operation is not recorded"},
                }));
                at += d;
            }
        }
        let dumped = to_ref(t.info.dumped_ns, t.info.clock_offset_ns);
        ev.push(json!({"ph": "i", "s": "t", "pid": 0, "tid": r,
            "name": format!("dump ({})", t.info.reason), "ts": us(dumped, m.t0)}));
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ns",
        "otherData": {
            "tool": "ferroccl trace",
            "world_size": m.world_size,
            "time_zero_unix_ns": m.t0,
            "clock": "reference clock (each rank's times minus its clock_offset_ns)",
        },
    })
}

// ---------------------------------------------------------------------------------
// The SVG timeline.

fn draw_svg(path: &Path, m: &Merged<'_>) -> Result<(), String> {
    let err = crate::plot::draw_err(path);
    let ws = m.world_size.max(1);
    let span = m.t_end.saturating_sub(m.t0).max(1) as f64;
    let (scale, unit) = if span >= 2e9 {
        (1e9, "s")
    } else if span >= 2e6 {
        (1e6, "ms")
    } else {
        (1e3, "µs")
    };
    let xmax = span / scale * 1.01;
    // Narrower than a pixel would not show: every bar gets about one.
    let min_w = xmax / 1300.0;
    let x = |t: i64| t.saturating_sub(m.t0) as f64 / scale;
    // Rank 0 on top.
    let y = |r: usize| (ws - 1 - r) as f64;
    let height = (150 + 34 * ws as u32).clamp(280, 2400);
    let root = SVGBackend::new(path, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let (top, strip) = root.split_vertically(height - 34);
    let per_rank = m.ops.iter().map(Vec::len).max().unwrap_or(0);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "ferroccl trace: {} ranks, up to {} operations per rank",
                m.world_size,
                thousands(per_rank)
            ),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(110)
        .build_cartesian_2d(0.0..xmax, -0.6..(ws as f64 - 0.4))
        .map_err(&err)?;
    let missing = &m.missing;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .y_labels(ws + 1)
        .y_label_formatter(&|v| {
            let k = v.round();
            if (v - k).abs() > 1e-6 || k < 0.0 || k as usize >= ws {
                return String::new();
            }
            let r = ws - 1 - k as usize;
            if missing.contains(&r) {
                format!("rank {r} (no file)")
            } else {
                format!("rank {r}")
            }
        })
        .x_desc(format!(
            "time ({unit}) on the reference clock, from the first start"
        ))
        .draw()
        .map_err(&err)?;
    let mut kinds: Vec<&str> = Vec::new();
    for o in m.ops.iter().flatten() {
        if !kinds.contains(&o.rec.kind.as_str()) {
            kinds.push(&o.rec.kind);
        }
    }
    // The palette without its red, which marks failures.
    let kind_color = |k: &str| {
        let i = kinds.iter().position(|x| *x == k).unwrap_or(0);
        crate::plot::color(if i >= 3 { i + 1 } else { i })
    };
    let red = RGBColor(214, 39, 40);
    let orange = RGBColor(255, 140, 0);
    let dark = |c: RGBColor| RGBColor(c.0 / 2, c.1 / 2, c.2 / 2);
    let mut bars = Vec::new();
    let mut waits = Vec::new();
    for o in m.ops.iter().flatten() {
        let (x0, yc) = (x(o.start), y(o.rank));
        let x1 = x(o.end).max(x0 + min_w);
        let c = if o.failed() {
            red
        } else if o.running {
            orange
        } else {
            kind_color(&o.rec.kind)
        };
        bars.push(Rectangle::new(
            [(x0, yc - 0.32), (x1, yc + 0.32)],
            c.filled(),
        ));
        // Only the total per peer is known: drawn from the start, as in the trace.
        let waited: u64 = o.rec.waits.iter().map(|w| w.ns).sum();
        if waited > 0 {
            let w = (waited as f64 / scale).min(x1 - x0);
            waits.push(Rectangle::new(
                [(x0, yc - 0.32), (x0 + w, yc + 0.32)],
                dark(c).filled(),
            ));
        }
    }
    chart.draw_series(bars).map_err(&err)?;
    chart.draw_series(waits).map_err(&err)?;
    // The legend, in a strip under the chart: a swatch and a name per entry.
    let mut legend: Vec<(String, RGBColor)> = kinds
        .iter()
        .map(|k| (k.to_string(), kind_color(k)))
        .collect();
    legend.push((
        "darker: waiting on a peer".into(),
        dark(crate::plot::color(0)),
    ));
    if m.ops.iter().flatten().any(Op::failed) {
        legend.push(("failed".into(), red));
    }
    if m.ops.iter().flatten().any(|o| o.running) {
        legend.push(("running at the dump".into(), orange));
    }
    let mut px = 125;
    for (name, c) in &legend {
        strip
            .draw(&Rectangle::new([(px, 8), (px + 14, 20)], c.filled()))
            .map_err(&err)?;
        strip
            .draw(&Text::new(
                name.clone(),
                (px + 20, 7),
                ("sans-serif", 14).into_font(),
            ))
            .map_err(&err)?;
        px += 40 + 7 * name.chars().count() as i32;
    }
    root.present().map_err(&err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroccl::trace::{PeerWait, RankInfo};

    fn info(rank: usize, n: usize) -> RankInfo {
        RankInfo {
            rank,
            world_size: n,
            host: "h".into(),
            pid: 1,
            transport: "local".into(),
            clock_offset_ns: 0,
            clock_error_ns: None,
            reason: "request".into(),
            capacity: 16,
            dropped: 0,
            dumped_ns: 10_000,
            comm: 0,
            job_rank: None,
        }
    }

    fn op(
        seq: u64,
        start: u64,
        end: Option<u64>,
        outcome: &str,
        waiting_on: Option<usize>,
    ) -> OpRecord {
        OpRecord {
            seq,
            kind: "all_reduce".into(),
            dtype: "float32".into(),
            count: 4,
            op: Some("sum".into()),
            root: None,
            algo: "ring".into(),
            enqueue_ns: start,
            start_ns: start,
            end_ns: end,
            outcome: outcome.into(),
            waiting_on,
            links: vec![],
            waits: vec![PeerWait { peer: 0, ns: 5 }],
        }
    }

    fn trace(rank: usize, n: usize, ops: Vec<OpRecord>) -> RankTrace {
        RankTrace {
            info: info(rank, n),
            ops,
            path: PathBuf::from(format!("rank-{rank}.jsonl")),
        }
    }

    #[test]
    fn thresholds_and_formats() {
        assert_eq!(stands_out_above(2), 0.75);
        assert_eq!(stands_out_above(4), 0.5);
        assert_eq!(stands_out_above(8), 0.25);
        assert_eq!(thousands(2000), "2,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(fmt_ns(12_100_000.0), "12.1 ms");
        assert_eq!(median_sorted(&[1, 3]), 2);
        assert_eq!(median_sorted(&[1, 3, 10]), 3);
    }

    /// A rank that arrives on time but stalls inside operations (SIGSTOP a moment
    /// every second): the others' recorders hold their idle time on it, and the
    /// verdict names it though it is never the last to start.
    #[test]
    fn a_rank_that_stalls_inside_operations_is_named() {
        let n = 3;
        let mut traces = Vec::new();
        for r in 0..n {
            let ops = (0..10u64)
                .map(|k| {
                    // Starts move between ranks (rank k % 3 is last, by 1 µs); each
                    // op takes 1 ms, of which the others wait 400 µs on rank 2.
                    let start = k * 10_000_000 + u64::from((k % 3) as usize == r) * 1_000;
                    let mut o = op(k, start, Some(start + 1_000_000), "ok", None);
                    o.waits = match r {
                        2 => vec![PeerWait { peer: 0, ns: 1_000 }],
                        _ => vec![PeerWait {
                            peer: 2,
                            ns: 400_000,
                        }],
                    };
                    o
                })
                .collect();
            traces.push(trace(r, n, ops));
        }
        let m = merge(&traces).expect("merges");
        let matched = match_collectives(&m);
        let stats = rank_stats(&m, &matched);
        let (who, words) = verdict(&stats, matched.len(), n, 0);
        assert_eq!(who, Some(2), "{words}");
        assert!(words.contains("stalls inside operations"), "{words}");
        assert!(
            stats[2].waited_on_frac > 0.35 && stats[2].waited_on_frac < 0.45,
            "{stats:?}"
        );
        // The same job without the stall names nobody.
        for t in &mut traces {
            for o in &mut t.ops {
                o.waits = vec![PeerWait { peer: 0, ns: 1_000 }];
            }
        }
        let m = merge(&traces).expect("merges");
        let matched = match_collectives(&m);
        let (who, words) = verdict(&rank_stats(&m, &matched), matched.len(), n, 0);
        assert_eq!(who, None, "{words}");
    }

    #[test]
    fn ties_name_no_last_rank() {
        let t = vec![
            trace(0, 2, vec![op(0, 100, Some(200), "ok", None)]),
            trace(1, 2, vec![op(0, 100, Some(200), "ok", None)]),
        ];
        let m = merge(&t).expect("merges");
        let x = match_collectives(&m);
        assert_eq!(x.len(), 1);
        assert_eq!(x[0].last, None);
    }

    #[test]
    fn a_wait_chain_ends_at_the_rank_everyone_waits_for() {
        // 0 waits for 2, 2 waits for 1, 1 finished #0 and never started #1.
        let t = vec![
            trace(
                0,
                3,
                vec![
                    op(0, 0, Some(1), "ok", None),
                    op(1, 2, None, "running", Some(2)),
                ],
            ),
            trace(1, 3, vec![op(0, 0, Some(1), "ok", None)]),
            trace(
                2,
                3,
                vec![
                    op(0, 0, Some(1), "ok", None),
                    op(1, 2, Some(9), "timed out", Some(1)),
                ],
            ),
        ];
        let m = merge(&t).expect("merges");
        let f = failure(&m).expect("a failure");
        assert_eq!(f.chain_ends, [1]);
        assert_eq!(f.behind, [1]);
        assert_eq!(f.suspects, [1]);
        assert_eq!(f.waits.len(), 2);
    }

    #[test]
    fn a_wait_cycle_names_only_the_missing_rank() {
        // Ranks 0 and 2 of 3 wait for each other; rank 1 left no file.
        let t = vec![
            trace(0, 3, vec![op(7, 2, Some(9), "closed", Some(2))]),
            trace(2, 3, vec![op(7, 2, Some(9), "closed", Some(0))]),
        ];
        let m = merge(&t).expect("merges");
        let f = failure(&m).expect("a failure");
        assert!(f.chain_ends.is_empty(), "{:?}", f.chain_ends);
        assert_eq!(f.suspects, [1]);
    }

    #[test]
    fn waits_never_outgrow_their_operation() {
        let mut o = op(0, 1000, Some(1010), "ok", None);
        o.waits = vec![PeerWait { peer: 1, ns: 8 }, PeerWait { peer: 2, ns: 8 }];
        let t = vec![trace(0, 1, vec![o])];
        let m = merge(&t).expect("merges");
        let v = chrome_trace(&m);
        let ev = v["traceEvents"].as_array().expect("events");
        let waits: Vec<f64> = ev
            .iter()
            .filter(|e| e["cat"] == "wait")
            .map(|e| e["dur"].as_f64().expect("dur"))
            .collect();
        assert_eq!(waits, [0.008, 0.002]);
    }
}
