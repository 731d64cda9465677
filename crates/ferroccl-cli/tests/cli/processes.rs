//! Real processes: `ferroccl bench` as ranks started by `ferroccl launch` (and by
//! itself), checked end to end through its own verification, plus its error paths.

use crate::common;

use common::proc::{run_cmd as run, Output, EXE};
use std::process::Command;
use std::time::{Duration, Instant};

fn text(o: &Output) -> (String, String) {
    (o.stdout.clone(), o.stderr.clone())
}

/// Data rows of a bench table: the whitespace-separated columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .map(|l| match l.strip_prefix('[') {
            // Lines forwarded by `ferroccl launch` carry a "[rank] " prefix.
            Some(rest) => rest.split_once("] ").map_or(l, |(_, t)| t),
            None => l,
        })
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[test]
fn bench_under_launch_checks_every_result() {
    let mut cmd = Command::new(EXE);
    cmd.args([
        "launch", "-n", "3", "--", EXE, "bench", "-b", "8", "-e", "256K", "-f", "8", "-n", "3",
        "-w", "1", "-d", "half",
    ]);
    let out = run(cmd, Duration::from_secs(60));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(so.contains("# Out of bounds values : 0 OK"), "{so}");
    let rows = rows(&so);
    assert_eq!(rows.len(), 6, "8 B .. 256 KiB by 8: {so}");
    for r in &rows {
        assert_eq!(r[2], "half");
        assert_eq!(r[8], "0", "out-of-place #wrong: {r:?}");
        assert_eq!(r[12], "0", "in-place #wrong: {r:?}");
    }
}

#[test]
fn bare_bench_starts_its_own_ranks_and_counts_ring_bytes() {
    let mut cmd = Command::new(EXE);
    cmd.args([
        "bench",
        "--ranks",
        "3",
        "-b",
        "96K",
        "-e",
        "3M",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "--small-message-bytes",
        "0",
    ]);
    let out = run(cmd, Duration::from_secs(60));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    // The default, `auto`, links processes of one host through shared memory; its
    // links count their bytes as TCP's do.
    assert!(so.contains("3 ranks, transport auto"), "{so}");
    assert!(so.contains("# links of rank 0: shm to 1, 2"), "{so}");
    let rows = rows(&so);
    assert_eq!(rows.len(), 4, "96K, 384K, 1536K, 3M: {so}");
    for r in &rows {
        // Sizes divisible by 3 ranks × 4 bytes: the counted bytes are the ring law exactly.
        assert_eq!(r[13], "1.000", "wire column: {r:?}");
        assert_eq!(r[14], "ring");
        assert_eq!(r[8], "0");
        assert_eq!(r[12], "0");
    }
    assert!(so.contains("# Avg bus bandwidth"), "{so}");
}

#[test]
fn bench_over_threads_writes_json() {
    let dir = std::env::temp_dir().join(format!("ferroccl-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rows.json");
    let mut cmd = Command::new(EXE);
    cmd.args([
        "bench",
        "--transport",
        "local",
        "--ranks",
        "4",
        "-b",
        "1K",
        "-e",
        "1M",
        "-f",
        "32",
        "-n",
        "2",
        "-w",
        "1",
        "-d",
        "bfloat16",
        "-o",
        "max",
        "--json",
    ]);
    cmd.arg(&path);
    let out = run(cmd, Duration::from_secs(60));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    let json = std::fs::read_to_string(&path).unwrap();
    assert!(
        json.contains("\"ranks\": 4")
            && json.contains("\"dtype\": \"bfloat16\"")
            && json.contains("\"op\": \"max\""),
        "{json}"
    );
    assert_eq!(json.matches("\"bytes\":").count(), 3, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_refuses_bad_flags_clearly() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "-d", "quad"], "unknown data type"),
        (&["bench", "-o", "xor"], "unknown reduction"),
        (
            &["bench", "-d", "int32", "-o", "avg"],
            "not supported for int32",
        ),
        (&["bench", "--transport", "rdma"], "not available"),
        (&["bench", "--transport", "cuda-ipc"], "not available"),
        (&["bench", "-b", "1M", "-e", "1K"], "larger than"),
        (&["bench", "alltoall"], "unknown collective"),
        (
            &["bench", "broadcast", "--ranks", "2", "-r", "2"],
            "not a rank",
        ),
    ];
    for (args, want) in cases {
        let mut cmd = Command::new(EXE);
        cmd.args(*args);
        let out = run(cmd, Duration::from_secs(20));
        let (so, se) = text(&out);
        assert!(!out.status.success(), "{args:?} succeeded: {so}");
        assert!(se.contains(want), "{args:?}: stderr lacks {want:?}: {se}");
    }
}

#[test]
fn inconsistent_launcher_environment_is_refused() {
    // run() clears launcher variables from our own environment; set them in a shell.
    let mut sh = Command::new("sh");
    sh.args([
        "-c",
        &format!("RANK=5 WORLD_SIZE=4 exec {EXE} bench -b 1K -e 1K"),
    ]);
    let out = run(sh, Duration::from_secs(20));
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(
        se.contains("RANK") && se.contains('5') && se.contains('4'),
        "{se}"
    );
}

#[test]
fn a_missing_rank_makes_the_others_fail_within_the_deadline() {
    // Rank 1 of 2 never starts: rank 0 serves the store and waits for it, then fails
    // with a clear error within the connect timeout instead of hanging.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut sh = Command::new("sh");
    sh.args(["-c", &format!("RANK=0 WORLD_SIZE=2 MASTER_PORT={port} exec {EXE} bench -b 1K -e 1K --connect-timeout 2")]);
    let t0 = Instant::now();
    let out = run(sh, Duration::from_secs(30));
    let (_, se) = text(&out);
    assert!(!out.status.success());
    assert!(
        se.contains("ferroccl bench:") && se.contains("rank 1 did not publish"),
        "{se}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
}

/// Every collective through the bench, over threads: each checks its own results and
/// its counted bytes sit on the collective's law (sizes divisible by ranks).
#[test]
fn bench_runs_every_collective() {
    for coll in [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce",
    ] {
        let mut cmd = Command::new(EXE);
        cmd.args([
            "bench",
            coll,
            "--transport",
            "local",
            "--ranks",
            "4",
            "-b",
            "96K",
            "-e",
            "6M",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "-r",
            "3",
            "-d",
            "bfloat16",
            "-o",
            "min",
        ]);
        let out = run(cmd, Duration::from_secs(60));
        let (so, se) = text(&out);
        assert!(out.status.success(), "{coll}: stdout:\n{so}\nstderr:\n{se}");
        assert!(
            so.contains(&format!("ferroccl bench: {coll}, 4 ranks")),
            "{so}"
        );
        let rows = rows(&so);
        assert_eq!(rows.len(), 3, "{coll}: {so}");
        for r in &rows {
            assert_eq!(r[8], "0", "{coll}: {r:?}");
            assert_eq!(r[12], "0", "{coll}: {r:?}");
            assert_eq!(r[13], "1.000", "{coll}: wire column {r:?}");
            let root = if coll == "broadcast" || coll == "reduce" {
                "3"
            } else {
                "-1"
            };
            assert_eq!(r[4], root, "{coll}: root column {r:?}");
        }
    }
}
