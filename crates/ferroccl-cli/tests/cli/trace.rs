//! `ferroccl trace DIR`: merging flight-recorder dumps. Synthetic dumps with exact
//! times (no assertion depends on how fast anything ran), then `bench --trace` end to
//! end, checked only for structure. Every run has a deadline.

use crate::common;

use common::proc::Output;
use ferroccl::trace::{Line, LinkBytes, OpRecord, PeerWait, RankInfo};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

/// Runs `ferroccl ARGS`, killing it and failing if it outlives [`DEADLINE`].
fn ferroccl(args: &[&str]) -> Output {
    common::proc::ferroccl(args, DEADLINE)
}

/// A fresh directory for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferroccl-trace-{name}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn info(rank: usize, world_size: usize) -> RankInfo {
    RankInfo {
        rank,
        world_size,
        host: "node".into(),
        pid: 1000 + rank as u32,
        transport: "tcp".into(),
        clock_offset_ns: 0,
        clock_error_ns: None,
        reason: "request".into(),
        capacity: 2048,
        dropped: 0,
        dumped_ns: 0,
        comm: 0,
        job_rank: None,
    }
}

fn op(kind: &str, seq: u64, start: u64, end: Option<u64>, outcome: &str) -> OpRecord {
    OpRecord {
        seq,
        kind: kind.into(),
        dtype: "float32".into(),
        count: 1024,
        op: Some("sum".into()),
        root: None,
        algo: "ring".into(),
        enqueue_ns: start.saturating_sub(3_000),
        start_ns: start,
        end_ns: end,
        outcome: outcome.into(),
        waiting_on: None,
        links: vec![LinkBytes {
            peer: 1,
            sent: 4096,
            recv: 4096,
        }],
        waits: vec![],
    }
}

/// Writes `dir/rank-<rank>.jsonl` as the library writes it.
fn write_rank(dir: &Path, info: &RankInfo, ops: &[OpRecord]) {
    let mut text = serde_json::to_string(&Line::Rank(info.clone())).expect("serialise");
    text.push('\n');
    for o in ops {
        text.push_str(&serde_json::to_string(&Line::Op(o.clone())).expect("serialise"));
        text.push('\n');
    }
    std::fs::write(dir.join(format!("rank-{}.jsonl", info.rank)), text).expect("write dump");
}

fn parse(o: &Output) -> Value {
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        o.stdout,
        o.stderr
    );
    serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", o.stdout))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

const BASE: u64 = 1_700_000_000_000_000_000;
const MS: u64 = 1_000_000;
const US: u64 = 1_000;

/// 4 ranks, 30 all-reduces 100 ms apart. Rank 3 starts 20 ms late in every third one
/// (and first in the others); ranks 0..2 start 0, 1 or 2 µs after the op's base time,
/// rotating. Rank 1's clock is 3 ms behind and rank 2's 5 ms ahead, both recorded as
/// offsets. Ranks 0 and 1 also have one send/recv.
fn straggler_job(dir: &Path) {
    for r in 0..4usize {
        let mut i = info(r, 4);
        let skew: i64 = match r {
            1 => -3 * MS as i64,
            2 => 5 * MS as i64,
            _ => 0,
        };
        i.clock_offset_ns = skew;
        i.clock_error_ns = (r > 0).then_some(50 * US);
        let local = |t: u64| (t as i64 + skew) as u64;
        let mut ops = Vec::new();
        for k in 0..30u64 {
            let base = BASE + k * 100 * MS;
            let late = k % 3 == 2;
            let start = if r == 3 {
                if late {
                    base + 20 * MS
                } else {
                    base
                }
            } else {
                base + ((k + r as u64) % 3) * US
            };
            let end = base + if late { 21 * MS } else { MS };
            let mut o = op("all_reduce", k, local(start), Some(local(end)), "ok");
            if late && r != 3 {
                o.waits = vec![PeerWait {
                    peer: 3,
                    ns: 19 * MS,
                }];
            }
            ops.push(o);
            if k == 10 && r < 2 {
                let t = base + 50 * MS;
                ops.push(op("send/recv", 0, local(t), Some(local(t + MS)), "ok"));
            }
        }
        i.dumped_ns = local(BASE + 30 * 100 * MS);
        write_rank(dir, &i, &ops);
    }
}

#[test]
fn names_the_straggler_on_the_reference_clock() {
    let dir = temp_dir("straggler");
    straggler_job(&dir);
    let out = dir.join("merged.json");
    let svg = dir.join("timeline.svg");
    let v = parse(&ferroccl(&[
        "trace",
        s(&dir),
        "--json",
        "--out",
        s(&out),
        "--svg",
        s(&svg),
    ]));
    assert_eq!(v["world_size"], 4);
    assert_eq!(v["missing_ranks"].as_array().map(Vec::len), Some(0));
    assert_eq!(u(&v["collectives"]), 30, "send/recv is not matched: {v}");
    assert_eq!(u(&v["collectives_on_all_ranks"]), 30);
    assert_eq!(u(&v["clock"]["max_abs_offset_ns"]), 5 * MS);
    assert_eq!(u(&v["clock"]["error_bound_ns"]), 50 * US);
    assert_eq!(v["straggler"], 3, "{v:#}");
    assert!(
        v["verdict"].as_str().is_some_and(|t| t.contains("rank 3")),
        "{v:#}"
    );
    assert!(v["failure"].is_null(), "{v:#}");
    let st = &v["stragglers"];
    assert_eq!(st.as_array().map(Vec::len), Some(4));
    let r3 = &st[3];
    assert_eq!(r3["rank"], 3);
    assert_eq!(u(&r3["ops"]), 30);
    assert_eq!(u(&r3["last"]), 10);
    assert!((f(&r3["share"]) - 1.0 / 3.0).abs() < 1e-9, "{r3}");
    // 20 ms after the base against the others' median start of 1 µs after it.
    assert_eq!(u(&r3["median_late_ns"]), 20 * MS - US);
    assert!(f(&r3["late_share"]) > 0.99, "{r3}");
    // Offsets removed: ranks 1 and 2 are never late by their clocks' skew (3 and 5 ms),
    // only by their 1 or 2 µs.
    for r in 0..3 {
        let m = st[r]["median_late_ns"].as_u64().unwrap_or(0);
        assert!(m <= 2 * US, "rank {r}: {}", st[r]);
        assert!(u(&st[r]["last"]) <= 10, "rank {r}: {}", st[r]);
    }
    let latest = v["latest"].as_array().expect("latest");
    assert_eq!(latest.len(), 10);
    assert_eq!(latest[9]["seq"], 29);
    assert_eq!(latest[9]["last_rank"], 3);
    assert_eq!(u(&latest[9]["late_ns"]), 20 * MS - US);
    // #28: ranks 0..2 start (28 + r) % 3 µs after the base, rank 3 at it: rank 1 last.
    assert_eq!(latest[8]["last_rank"], 1);
    assert_eq!(latest[8]["ranks"], 4);

    // The Chrome trace: one named track per rank, every operation once per rank.
    let chrome: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("--out written"))
            .expect("the trace is JSON");
    assert_eq!(chrome["displayTimeUnit"], "ns");
    let ev = chrome["traceEvents"].as_array().expect("traceEvents");
    let names: Vec<(u64, String)> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                u(&e["tid"]),
                e["args"]["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for r in 0..4u64 {
        assert!(
            names
                .iter()
                .any(|(t, n)| *t == r && n == &format!("rank {r} (node, pid {})", 1000 + r)),
            "{names:?}"
        );
    }
    for r in 0..4u64 {
        let mut ops: Vec<&str> = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == r && e["cat"] != "wait")
            .map(|e| e["name"].as_str().expect("name"))
            .collect();
        let n = ops.len();
        assert_eq!(n, if r < 2 { 31 } else { 30 }, "rank {r}");
        ops.sort_unstable();
        ops.dedup();
        assert_eq!(ops.len(), n, "rank {r}: an operation twice");
        assert!(ops.contains(&"all_reduce #12"));
    }
    // On the reference clock rank 2 starts all_reduce #0 2 µs after rank 0 (its local
    // times are 5 ms ahead); ts are µs after the first start.
    let ts = |r: u64, name: &str| {
        ev.iter()
            .find(|e| e["ph"] == "X" && e["tid"] == r && e["name"] == name)
            .map(|e| f(&e["ts"]))
            .unwrap_or_else(|| panic!("no {name} on rank {r}"))
    };
    assert!((ts(0, "all_reduce #0") - 0.0).abs() < 1e-9);
    assert!((ts(2, "all_reduce #0") - 2.0).abs() < 1e-9);
    assert!((ts(1, "all_reduce #0") - 1.0).abs() < 1e-9);
    assert!((ts(3, "all_reduce #2") - (200_000.0 + 20_000.0)).abs() < 1e-6);
    // The wait on rank 3 nests inside the late operation, from its start.
    let wait = ev
        .iter()
        .find(|e| e["tid"] == 0 && e["name"] == "wait rank 3")
        .expect("a wait slice");
    assert!((f(&wait["ts"]) - ts(0, "all_reduce #2")).abs() < 1e-9);
    assert!((f(&wait["dur"]) - 19_000.0).abs() < 1e-9);
    let x = ev
        .iter()
        .find(|e| e["tid"] == 0 && e["name"] == "all_reduce #2")
        .expect("op");
    assert_eq!(x["args"]["dtype"], "float32");
    assert_eq!(x["args"]["algo"], "ring");
    assert_eq!(x["args"]["bytes_per_link"]["rank 1"]["sent"], 4096);
    assert!((f(&x["args"]["queued_us"]) - 3.0).abs() < 1e-9);

    let svg = std::fs::read_to_string(&svg).expect("--svg written");
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    for needle in ["rank 0", "rank 3", "all_reduce", "send/recv"] {
        assert!(svg.contains(needle), "the SVG lacks {needle:?}");
    }

    // The same report as text.
    let o = ferroccl(&["trace", s(&dir)]);
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    for needle in [
        "clock offsets: max |offset| 5000.0 µs, error bound ±50.0 µs",
        "rank 3 arrived last in 33 % of 30 operations, median 20.0 ms late",
        "straggler: rank 3",
        "all_reduce #29",
        "trace.json",
    ] {
        assert!(
            o.stdout.contains(needle),
            "{needle:?} not in:\n{}",
            o.stdout
        );
    }
    assert!(dir.join("trace.json").exists(), "default --out");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_even_job_names_no_straggler() {
    // 4 ranks on one clock; the last arrival rotates, 1 µs late each time.
    let dir = temp_dir("even");
    for r in 0..4usize {
        let mut i = info(r, 4);
        i.dumped_ns = BASE + 100 * MS;
        let ops: Vec<OpRecord> = (0..40u64)
            .map(|k| {
                let base = BASE + k * MS;
                let start = base + u64::from((k as usize) % 4 == r) * US;
                op("all_reduce", k, start, Some(base + 500 * US), "ok")
            })
            .collect();
        write_rank(&dir, &i, &ops);
    }
    let v = parse(&ferroccl(&["trace", s(&dir), "--json"]));
    assert_eq!(v["clock"]["shared"], true);
    assert!(v["straggler"].is_null(), "{v:#}");
    assert!(
        v["verdict"]
            .as_str()
            .is_some_and(|t| t.contains("no rank stands out")),
        "{v:#}"
    );
    for r in 0..4 {
        assert_eq!(u(&v["stragglers"][r]["last"]), 10);
    }
    let o = ferroccl(&["trace", s(&dir)]);
    assert!(o.stdout.contains("ranks share one clock"), "{}", o.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ranks 0 and 2 of 3 finished all_reduce #0..#4 and are stuck in #5 waiting for
/// rank 1 (rank 0 still running at its dump, rank 2 timed out).
fn hung_job(dir: &Path) {
    for r in [0usize, 2] {
        let mut i = info(r, 3);
        i.reason = if r == 2 { "timeout" } else { "signal" }.into();
        i.dumped_ns = BASE + 70 * MS;
        let mut ops: Vec<OpRecord> = (0..5u64)
            .map(|k| {
                op(
                    "all_reduce",
                    k,
                    BASE + k * MS,
                    Some(BASE + k * MS + 500 * US),
                    "ok",
                )
            })
            .collect();
        let mut stuck = if r == 0 {
            op("all_reduce", 5, BASE + 5 * MS, None, "running")
        } else {
            op(
                "all_reduce",
                5,
                BASE + 5 * MS,
                Some(BASE + 65 * MS),
                "timed out after 60s: rank 1 is at #4 (all_reduce)",
            )
        };
        stuck.waiting_on = Some(1);
        stuck.waits = vec![PeerWait {
            peer: 1,
            ns: 60 * MS,
        }];
        ops.push(stuck);
        write_rank(dir, &i, &ops);
    }
}

#[test]
fn a_hung_job_points_at_the_missing_rank() {
    let dir = temp_dir("missing");
    hung_job(&dir);
    let v = parse(&ferroccl(&["trace", s(&dir), "--json"]));
    assert_eq!(v["missing_ranks"], serde_json::json!([1]));
    let fl = &v["failure"];
    assert!(fl.is_object(), "{v:#}");
    assert_eq!(fl["suspects"][0], 1, "{fl:#}");
    assert_eq!(fl["chain_ends"], serde_json::json!([1]));
    let waits: Vec<(u64, u64)> = fl["waits"]
        .as_array()
        .expect("waits")
        .iter()
        .map(|w| (u(&w["rank"]), u(&w["waited_for"])))
        .collect();
    assert_eq!(waits, [(0, 1), (2, 1)]);
    assert_eq!(fl["last_ops"][1]["missing"], true);
    assert_eq!(fl["last_ops"][0]["outcome"], "running");
    assert_eq!(fl["last_ops"][2]["seq"], 5);
    assert!(
        fl["summary"]
            .as_str()
            .is_some_and(|t| t.contains("look at rank 1 first") && t.contains("no trace file")),
        "{fl:#}"
    );
    assert_eq!(u(&v["collectives"]), 6);
    assert_eq!(u(&v["collectives_on_all_ranks"]), 0);

    // The Chrome trace names the missing rank's track and colors the failure.
    let chrome: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("trace.json")).expect("trace.json"))
            .expect("JSON");
    let ev = chrome["traceEvents"].as_array().expect("events");
    assert!(ev
        .iter()
        .any(|e| e["name"] == "thread_name" && e["args"]["name"] == "rank 1 (no trace file)"));
    let failed = ev
        .iter()
        .find(|e| e["tid"] == 2 && e["name"] == "all_reduce #5")
        .expect("the failed op");
    assert_eq!(failed["cname"], "terrible");
    assert!(failed["args"]["outcome"]
        .as_str()
        .is_some_and(|t| t.starts_with("timed out")));
    // Still running: it lasts until rank 0's dump, 65 ms after it started.
    let running = ev
        .iter()
        .find(|e| e["tid"] == 0 && e["name"] == "all_reduce #5")
        .expect("the running op");
    assert!((f(&running["dur"]) - 65_000.0).abs() < 1e-6, "{running}");

    let o = ferroccl(&["trace", s(&dir)]);
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    for needle in [
        "rank 0 waited for rank 1 (all_reduce #5)",
        "rank 2 waited for rank 1 (all_reduce #5)",
        "rank 1   no trace file",
        "look at rank 1 first",
    ] {
        assert!(
            o.stdout.contains(needle),
            "{needle:?} not in:\n{}",
            o.stdout
        );
    }

    // Now rank 1 left a file: it finished #4 and never started #5.
    let mut i = info(1, 3);
    i.dumped_ns = BASE + 70 * MS;
    let ops: Vec<OpRecord> = (0..5u64)
        .map(|k| {
            op(
                "all_reduce",
                k,
                BASE + k * MS,
                Some(BASE + k * MS + 500 * US),
                "ok",
            )
        })
        .collect();
    write_rank(&dir, &i, &ops);
    let v = parse(&ferroccl(&["trace", s(&dir), "--json"]));
    let fl = &v["failure"];
    assert_eq!(v["missing_ranks"], serde_json::json!([]));
    assert_eq!(fl["behind"], serde_json::json!([1]), "{fl:#}");
    assert_eq!(fl["suspects"], serde_json::json!([1]), "{fl:#}");
    assert!(
        fl["summary"]
            .as_str()
            .is_some_and(|t| t.contains("rank 1") && t.contains("#4, behind the others' #5")),
        "{fl:#}"
    );
    assert_eq!(u(&v["collectives_on_all_ranks"]), 5);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_one_line_naming_the_file() {
    let check = |args: &[&str], needles: &[&str]| {
        let o = ferroccl(args);
        assert!(!o.status.success(), "{args:?} succeeded:\n{}", o.stdout);
        assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
        let line = o.stderr.trim();
        assert_eq!(line.lines().count(), 1, "{args:?}: {line}");
        for n in needles {
            assert!(line.contains(n), "{args:?}: {n:?} not in {line:?}");
        }
    };
    let root = temp_dir("bad");
    let missing = root.join("nowhere");
    check(&["trace", s(&missing)], &["ferroccl trace:", s(&missing)]);

    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    check(&["trace", s(&empty)], &["no rank-*.jsonl", s(&empty)]);

    let broken = root.join("broken");
    std::fs::create_dir_all(&broken).expect("mkdir");
    write_rank(&broken, &info(0, 2), &[]);
    let header = serde_json::to_string(&Line::Rank(info(1, 2))).expect("serialise");
    std::fs::write(
        broken.join("rank-1.jsonl"),
        format!("{header}\n{{not json\n"),
    )
    .expect("write");
    check(&["trace", s(&broken)], &["rank-1.jsonl", "line 2"]);

    let empty_file = root.join("empty-file");
    std::fs::create_dir_all(&empty_file).expect("mkdir");
    std::fs::write(empty_file.join("rank-0.jsonl"), "").expect("write");
    check(&["trace", s(&empty_file)], &["rank-0.jsonl", "empty"]);

    let twice = root.join("twice");
    std::fs::create_dir_all(&twice).expect("mkdir");
    write_rank(&twice, &info(1, 2), &[]);
    std::fs::copy(twice.join("rank-1.jsonl"), twice.join("rank-01.jsonl")).expect("copy");
    check(
        &["trace", s(&twice)],
        &["rank-1.jsonl", "rank-01.jsonl", "rank 1"],
    );

    let outside = root.join("outside");
    std::fs::create_dir_all(&outside).expect("mkdir");
    write_rank(&outside, &info(4, 4), &[]);
    check(&["trace", s(&outside)], &["rank-4.jsonl", "world size 4"]);
    let _ = std::fs::remove_dir_all(&root);
}

/// Checks the report of a real, successful bench of `n` ranks.
fn check_bench_report(dir: &Path, n: usize, transport: &str) {
    let v = parse(&ferroccl(&[
        "trace",
        s(dir),
        "--json",
        "--svg",
        s(&dir.join("t.svg")),
    ]));
    assert_eq!(u(&v["world_size"]), n as u64, "{v:#}");
    let ranks = v["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), n, "{v:#}");
    assert_eq!(v["missing_ranks"], serde_json::json!([]));
    assert!(v["failure"].is_null(), "{v:#}");
    let colls = u(&v["collectives"]);
    assert!(colls > 0, "{v:#}");
    assert_eq!(u(&v["collectives_on_all_ranks"]), colls, "{v:#}");
    for (r, x) in ranks.iter().enumerate() {
        assert_eq!(u(&x["rank"]), r as u64);
        assert_eq!(x["transport"], transport);
        assert_eq!(
            u(&x["ops"]),
            colls,
            "rank {r} recorded only collectives: {x}"
        );
        assert_eq!(u(&x["failed_ops"]), 0);
        assert_eq!(u(&x["running_ops"]), 0);
    }
    for o in v["latest"].as_array().expect("latest") {
        assert_eq!(u(&o["ranks"]), n as u64, "{o}");
    }
    assert_eq!(v["stragglers"].as_array().map(Vec::len), Some(n));
    assert!(std::fs::read_to_string(dir.join("t.svg"))
        .expect("svg")
        .starts_with("<svg"));
}

#[test]
fn bench_trace_writes_every_rank() {
    let root = temp_dir("bench");
    // Threads in one process; a stale dump of an earlier run is cleared first.
    let dir = root.join("local");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("rank-7.jsonl"), "stale").expect("write");
    let o = ferroccl(&[
        "bench",
        "--transport",
        "local",
        "--ranks",
        "3",
        "-b",
        "1K",
        "-e",
        "4K",
        "-f",
        "4",
        "-n",
        "2",
        "-w",
        "1",
        "--trace",
        s(&dir),
    ]);
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains(&format!("trace: 3 ranks written to {}", dir.display())),
        "{}",
        o.stdout
    );
    check_bench_report(&dir, 3, "local");

    // Processes over loopback TCP, started by the bench itself.
    let dir = root.join("tcp");
    let o = ferroccl(&[
        "bench",
        "--ranks",
        "2",
        "-b",
        "1K",
        "-e",
        "1K",
        "-n",
        "1",
        "-w",
        "0",
        "--trace",
        s(&dir),
    ]);
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains(&format!("trace: 2 ranks written to {}", dir.display())),
        "{}",
        o.stdout
    );
    // Processes on one host, on the default transport: `auto` (shared memory here).
    check_bench_report(&dir, 2, "auto");
    let _ = std::fs::remove_dir_all(&root);
}

/// `ferroccl launch` with `FERROCCL_TRACE_DIR` set: when a rank is killed, the
/// survivors are asked for their flight recorders (SIGUSR1) before they are stopped,
/// and the report points at the killed rank.
#[test]
fn launch_collects_the_survivors_flight_recorders() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    let dir = temp_dir("launch");
    let script = format!(
        r#"echo $$ > "{d}/pid-$RANK"; exec "{exe}" bench -b 1K -e 32M -f 32768 -n 20 -w 1 -c 0 --timeout 60"#,
        d = dir.display(),
        exe = common::proc::EXE
    );
    let mut cmd = Command::new(common::proc::EXE);
    cmd.args(["launch", "-n", "3", "--", "sh", "-c", &script])
        .env("FERROCCL_TRACE_DIR", &dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in common::proc::LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    let mut child = cmd.spawn().expect("spawn the launcher");
    let (tx, rx) = mpsc::channel();
    let out = BufReader::new(child.stdout.take().expect("piped"));
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut err = child.stderr.take().expect("piped");
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let end = Instant::now() + DEADLINE;
    // Rank 0 prints the 1 KiB row once every rank has run its operations; the 32 MiB
    // size after it runs long enough (42 operations of 32 MiB) to be killed in.
    let mut started = false;
    while let Ok(l) = rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
        let row = l.split_once("] ").map_or(l.as_str(), |(_, t)| t);
        if row.split_whitespace().next() == Some("1024") {
            started = true;
            break;
        }
    }
    if !started {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the job did not start within {DEADLINE:?}");
    }
    let pid: i32 = std::fs::read_to_string(dir.join("pid-1"))
        .expect("rank 1's pid")
        .trim()
        .parse()
        .expect("a pid");
    // SAFETY: plain syscall; rank 1 is a process this test started (through the
    // launcher), and the launcher does not reap it before it ends.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the launcher did not stop the job within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stderr = errs.join().unwrap_or_default();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("rank 1 failed"), "{stderr}");

    let v = parse(&ferroccl(&["trace", s(&dir), "--json"]));
    assert_eq!(v["missing_ranks"], serde_json::json!([1]), "{v:#}");
    for r in [0, 1] {
        let x = &v["ranks"][r];
        assert!(u(&x["ops"]) >= 1, "{x}");
    }
    assert_eq!(v["failure"]["suspects"][0], 1, "{v:#}");
    let _ = std::fs::remove_dir_all(&dir);
}
