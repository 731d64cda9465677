//! Tests of the merge, the report and the trace on synthetic dumps.

use super::chrome::chrome_trace;
use super::merge::merge;
use super::report::*;
use ferroccl::trace::{OpRecord, PeerWait, RankInfo, RankTrace};
use std::path::PathBuf;

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
