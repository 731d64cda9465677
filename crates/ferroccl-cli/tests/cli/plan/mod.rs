//! `ferroccl plan` end to end: the real binary, its human report, `--json`, a TOML
//! config, bench files written to a temp directory, and its error paths. No network;
//! every run has a deadline.

mod bench_files;
mod questions;
mod report;

use crate::common;

use common::proc::Output;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(30);

/// Runs `ferroccl ARGS`, killing it and failing if it outlives [`DEADLINE`].
fn ferroccl(args: &[&str]) -> Output {
    common::proc::ferroccl(args, DEADLINE)
}

fn plan(args: &[&str]) -> Output {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    ferroccl(&all)
}

fn stdout(o: &Output) -> String {
    o.stdout.clone()
}

fn stderr(o: &Output) -> String {
    o.stderr.clone()
}

#[track_caller]
fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
    stdout(o)
}

#[track_caller]
fn json(o: &Output) -> serde_json::Value {
    serde_json::from_str(&ok(o)).expect("--json output parses")
}

/// Fails unless the run exited 2 with `ferroccl plan: ` and every needle on stderr.
#[track_caller]
fn fails(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "stdout:\n{}\nstderr:\n{err}",
        stdout(o)
    );
    assert!(err.starts_with("ferroccl plan: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}: {err}");
    }
}

#[track_caller]
fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[track_caller]
fn close(got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1e-12),
        "got {got}, want {want}"
    );
}

/// A fresh directory for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferroccl-plan-{name}-{}-{:?}",
        std::process::id(),
        Instant::now()
    ));
    let dir = PathBuf::from(dir.to_string_lossy().replace(
        |c: char| !(c.is_ascii_alphanumeric() || "/-_.".contains(c)),
        "_",
    ));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// The rows `ferroccl bench --json` writes, with in-place times from α and β exactly:
/// t = 2(n-1)·α + 2(n-1)/n·S·β, S = 1 KiB .. 64 MiB.
fn bench_json(n: usize, alpha: f64, beta: f64) -> String {
    let nf = n as f64;
    let factor = 2.0 * (nf - 1.0) / nf;
    let rows: Vec<String> = (0..9)
        .map(|j| {
            let bytes = 1024u64 << (2 * j);
            let t = (2.0 * (nf - 1.0) * alpha + factor * bytes as f64 * beta) * 1e6;
            format!(
                "    {{\"bytes\": {bytes}, \"count\": {}, \"oop_time_us\": {t}, \"oop_algbw_gbs\": 1.0, \"oop_busbw_gbs\": 1.0, \"oop_wrong\": 0, \"ip_time_us\": {t}, \"ip_algbw_gbs\": 1.0, \"ip_busbw_gbs\": 1.0, \"ip_wrong\": 0, \"payload_bytes_sent_per_rank\": 1.0, \"header_bytes_sent_per_rank\": 1.0}}",
                bytes / 4
            )
        })
        .collect();
    format!(
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"all_reduce\",\n  \"ranks\": {n},\n  \"transport\": \"tcp\",\n  \"dtype\": \"float\",\n  \"op\": \"sum\",\n  \"bus_factor\": {factor},\n  \"rows\": [\n{}\n  ]\n}}\n",
        rows.join(",\n")
    )
}

/// Case A of the unit tests: 8 ranks × 32, ImageNet, 90 epochs, 400 samples/s,
/// 25.6M f32 parameters on a 10 Gbit/s link.
const CASE_A: &[&str] = &[
    "--ranks",
    "8",
    "--per-rank-batch",
    "32",
    "--dataset-size",
    "1281167",
    "--epochs",
    "90",
    "--throughput",
    "400",
    "--base-lr",
    "0.1",
    "--base-batch",
    "256",
    "--warmup-epochs",
    "5",
    "--params",
    "25.6M",
    "--link",
    "10Gbit",
];
