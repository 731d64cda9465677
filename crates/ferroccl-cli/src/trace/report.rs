//! The report: the last-arriving rank per collective, per-rank statistics, the
//! straggler verdict, and for a failed or hung job who waited for whom.

use super::merge::{Merged, Op};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
// ---------------------------------------------------------------------------------
// The report.

#[derive(Serialize, Debug)]
pub(super) struct Report {
    pub(super) dir: String,
    pub(super) world_size: usize,
    pub(super) ranks: Vec<RankSummary>,
    pub(super) missing_ranks: Vec<usize>,
    pub(super) clock: Clock,
    pub(super) chrome_trace: String,
    pub(super) svg: Option<String>,
    /// Collectives recorded on two or more ranks.
    pub(super) collectives: usize,
    /// Of those, the ones every rank of the job recorded.
    pub(super) collectives_on_all_ranks: usize,
    /// The last `--last` of them, oldest first.
    pub(super) latest: Vec<MatchedOp>,
    /// One per rank with a file.
    pub(super) stragglers: Vec<RankStat>,
    /// The rank named the straggler, if one stands out.
    pub(super) straggler: Option<usize>,
    pub(super) verdict: String,
    pub(super) failure: Option<Failure>,
    pub(super) warnings: Vec<String>,
}

#[derive(Serialize, Debug)]
pub(super) struct RankSummary {
    pub(super) rank: usize,
    pub(super) host: String,
    pub(super) pid: u32,
    pub(super) transport: String,
    pub(super) reason: String,
    pub(super) ops: usize,
    pub(super) dropped: u64,
    pub(super) capacity: usize,
    pub(super) failed_ops: usize,
    pub(super) running_ops: usize,
    pub(super) clock_offset_ns: i64,
    pub(super) clock_error_ns: Option<u64>,
    pub(super) path: String,
}

#[derive(Serialize, Debug)]
pub(super) struct Clock {
    /// Every offset 0 and none estimated: the ranks read one clock.
    pub(super) shared: bool,
    pub(super) max_abs_offset_ns: u64,
    /// The largest error bound over the ranks; `None` when no offset was estimated.
    pub(super) error_bound_ns: Option<u64>,
    pub(super) text: String,
}

#[derive(Serialize, Debug, Clone)]
pub(super) struct MatchedOp {
    pub(super) kind: String,
    pub(super) seq: u64,
    /// Ranks that recorded it.
    pub(super) ranks: usize,
    /// The rank that started last (`None` on a tie).
    pub(super) last_rank: Option<usize>,
    /// How much later it started than the median start of the others.
    pub(super) late_ns: u64,
    /// The first start, ns after the trace's time zero.
    pub(super) first_start_ns: i64,
    /// Last start minus first start.
    pub(super) spread_ns: u64,
    /// Median duration over the ranks.
    pub(super) duration_ns: u64,
}

#[derive(Serialize, Debug, Clone)]
pub(super) struct RankStat {
    pub(super) rank: usize,
    /// Matched collectives this rank recorded.
    pub(super) ops: usize,
    /// Of those, the ones it started last.
    pub(super) last: usize,
    /// `last / ops`.
    pub(super) share: f64,
    /// Median lateness when it was last.
    pub(super) median_late_ns: Option<u64>,
    /// Summed lateness when it was last.
    pub(super) late_total_ns: u64,
    /// Its part of all ranks' summed lateness.
    pub(super) late_share: f64,
    /// Time the other ranks spent inside operations waiting on it (their recorders'
    /// idle time per peer): what a rank that stalls *inside* calls costs them, which
    /// lateness at the start of calls does not see.
    pub(super) waited_on_ns: u64,
    /// Its part of all the waiting inside operations.
    pub(super) waited_on_share: f64,
    /// `waited_on_ns` over the other ranks' summed time in operations.
    pub(super) waited_on_frac: f64,
}

#[derive(Serialize, Debug)]
pub(super) struct Failure {
    /// Each rank's last operation, every rank of the job.
    pub(super) last_ops: Vec<LastOp>,
    /// "rank A waited for rank B", from the last operations.
    pub(super) waits: Vec<WaitEdge>,
    /// Ranks whose last collective is behind the others' (the lowest sequence number).
    pub(super) behind: Vec<usize>,
    /// Where the chains of waits end: ranks waited for that wait for no one (a chain
    /// that loops ends nowhere).
    pub(super) chain_ends: Vec<usize>,
    /// The ranks to look at first: missing, behind and waiting for no one, chain ends.
    pub(super) suspects: Vec<usize>,
    pub(super) summary: String,
}

#[derive(Serialize, Debug)]
pub(super) struct LastOp {
    pub(super) rank: usize,
    /// No file from this rank.
    pub(super) missing: bool,
    pub(super) kind: Option<String>,
    pub(super) seq: Option<u64>,
    pub(super) outcome: Option<String>,
    pub(super) waiting_on: Option<usize>,
    /// Sequence number of its last collective (send/recv left out).
    pub(super) last_collective_seq: Option<u64>,
}

#[derive(Serialize, Debug)]
pub(super) struct WaitEdge {
    pub(super) rank: usize,
    pub(super) waited_for: usize,
    pub(super) op: String,
    pub(super) outcome: String,
}

pub(super) fn clock(m: &Merged<'_>) -> Clock {
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
pub(super) type At = (usize, i64, i64);

/// One collective as recorded by the ranks that have it, by start.
pub(super) struct Matched {
    pub(super) kind: String,
    pub(super) seq: u64,
    pub(super) at: Vec<At>,
    pub(super) last: Option<usize>,
    pub(super) late: u64,
}

/// Median of a non-empty sorted slice (the mean of the middle two for an even length).
pub(super) fn median_sorted(v: &[i64]) -> i64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        ((i128::from(v[n / 2 - 1]) + i128::from(v[n / 2])) / 2) as i64
    }
}

/// Collectives recorded on two or more ranks, by sequence number.
pub(super) fn match_collectives(m: &Merged<'_>) -> Vec<Matched> {
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

pub(super) fn matched_op(x: &Matched, t0: i64) -> MatchedOp {
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

pub(super) fn rank_stats(m: &Merged<'_>, matched: &[Matched]) -> Vec<RankStat> {
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
pub(super) fn stands_out_above(world_size: usize) -> f64 {
    let n = world_size.max(1) as f64;
    (2.0 / n).min((1.0 + 1.0 / n) / 2.0)
}

/// Fewest matched collectives for naming a straggler.
pub(super) const MIN_OPS: usize = 3;

/// Share of the other ranks' time in operations spent waiting on one rank, above
/// which a rank that stalls inside operations is named (with a share of all the
/// waiting above [`stands_out_above`]).
pub(super) const WAITED_ON_FRAC: f64 = 0.10;

/// The straggler, if one stands out, and the sentence that says so or why not.
/// `err_ns`: the clock error bound of one rank; two ranks' starts differ by up to twice
/// that from their clocks alone.
pub(super) fn verdict(
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

pub(super) fn failure(m: &Merged<'_>) -> Option<Failure> {
    let bad = m.ops.iter().flatten().any(|o| o.running || o.failed());
    if !bad && m.missing.is_empty() {
        return None;
    }
    let last_ops = last_ops(m);
    let waits = wait_edges(m);
    let chain_ends = chain_ends(m, &waits);
    let (behind, hi) = behind(&last_ops);
    // A rank behind that was itself waiting on another is in a chain: the chain's end
    // is the suspect, not it (when a rank dies, its ring neighbours stop one step
    // apart).
    let stalled: Vec<usize> = behind
        .iter()
        .copied()
        .filter(|&r| waits_for(m, r).is_none())
        .collect();
    let suspects = suspects(m, &stalled, &chain_ends, &last_ops);
    let why = |r: usize| why(m, r, &stalled, &waits, &last_ops, hi);
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

/// Rank `r`'s last operation, if it left a file with one.
fn last_of<'m, 'a>(m: &'m Merged<'a>, r: usize) -> Option<&'m Op<'a>> {
    m.index(r).and_then(|i| m.ops[i].last())
}

/// Whom rank `r` waits for: its last operation's peer, when it did not end well.
fn waits_for(m: &Merged<'_>, r: usize) -> Option<usize> {
    last_of(m, r)
        .filter(|o| !o.rec.ok())
        .and_then(|o| o.rec.waiting_on)
}

/// Each rank's last operation (and last collective), or that it left no file.
fn last_ops(m: &Merged<'_>) -> Vec<LastOp> {
    (0..m.world_size)
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
        .collect()
}

/// Who waits for whom.
fn wait_edges(m: &Merged<'_>) -> Vec<WaitEdge> {
    (0..m.world_size)
        .filter_map(|r| {
            let p = waits_for(m, r)?;
            let o = last_of(m, r)?;
            Some(WaitEdge {
                rank: r,
                waited_for: p,
                op: o.label(),
                outcome: o.rec.outcome.clone(),
            })
        })
        .collect()
}

/// Where each chain of waits ends: a rank that waits for no one. A chain that comes
/// back on itself (partners of a recursive-doubling step waiting for each other after
/// a third rank died) ends nowhere: it names no one.
fn chain_ends(m: &Merged<'_>, waits: &[WaitEdge]) -> Vec<usize> {
    let mut ends = Vec::new();
    for w in waits {
        let mut seen = vec![w.rank];
        let mut cur = w.waited_for;
        let mut cycle = false;
        while let Some(next) = waits_for(m, cur) {
            if seen.contains(&cur) {
                cycle = true;
                break;
            }
            seen.push(cur);
            cur = next;
        }
        if !cycle && !ends.contains(&cur) {
            ends.push(cur);
        }
    }
    ends.sort_unstable();
    ends
}

/// The ranks behind (the lowest last collective, when the ranks with files disagree),
/// and the highest last collective.
fn behind(last_ops: &[LastOp]) -> (Vec<usize>, Option<u64>) {
    let seqs: Vec<(usize, Option<u64>)> = last_ops
        .iter()
        .filter(|l| !l.missing)
        .map(|l| (l.rank, l.last_collective_seq))
        .collect();
    // `None` (no collective at all) orders below every sequence number.
    let lo = seqs.iter().map(|s| s.1).min().unwrap_or(None);
    let hi = seqs.iter().map(|s| s.1).max().unwrap_or(None);
    let behind = if seqs.len() >= 2 && lo != hi {
        seqs.iter().filter(|s| s.1 == lo).map(|s| s.0).collect()
    } else {
        Vec::new()
    };
    (behind, hi)
}

/// The ranks to look at first: those that left no file, stalled behind, or end a
/// chain of waits; failing that, those whose last operation failed.
fn suspects(
    m: &Merged<'_>,
    stalled: &[usize],
    chain_ends: &[usize],
    last_ops: &[LastOp],
) -> Vec<usize> {
    let mut suspects: Vec<usize> = Vec::new();
    for r in m.missing.iter().chain(stalled).chain(chain_ends) {
        if !suspects.contains(r) {
            suspects.push(*r);
        }
    }
    if suspects.is_empty() {
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
    suspects
}

/// Why rank `r` is a suspect, in words.
fn why(
    m: &Merged<'_>,
    r: usize,
    stalled: &[usize],
    waits: &[WaitEdge],
    last_ops: &[LastOp],
    hi: Option<u64>,
) -> String {
    let mut v = Vec::new();
    if m.missing.contains(&r) {
        v.push("it left no trace file (did it die, or dump elsewhere?)".to_string());
    }
    if stalled.contains(&r) {
        v.push(match (last_ops[r].last_collective_seq, hi) {
            (Some(s), Some(h)) => format!("its last collective is #{s}, behind the others' #{h}"),
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
}

pub(super) fn report(m: &Merged<'_>, last_n: usize, chrome: &Path, svg: Option<&Path>) -> Report {
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
pub(super) fn thousands(n: usize) -> String {
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
pub(super) fn fmt_ns(ns: f64) -> String {
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

pub(super) fn join(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn print_report(r: &Report) {
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
