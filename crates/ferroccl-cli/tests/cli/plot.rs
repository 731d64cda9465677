//! `ferroccl plot`: SVG files from fixture bench (`--law`) and compare-peers JSON, and
//! its refusals. No network; every run has a deadline.

use crate::common;

use common::proc::Output;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(30);

/// Runs `ferroccl ARGS`, killing it and failing if it outlives [`DEADLINE`].
fn ferroccl(args: &[&str]) -> Output {
    common::proc::ferroccl(args, DEADLINE)
}

/// A fresh directory for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferroccl-plot-{name}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A `bench --law` file for n = 2 at 1 Gbit/s: in-place times 1.05 × the law.
fn law_json() -> String {
    let rows: Vec<String> = (20..24)
        .map(|k| {
            let b = 1u64 << k;
            let pred = b as f64 / 125e6 * 1e6;
            let t = pred * 1.05;
            format!(
                "    {{\"pred_time_us\": {pred}, \"meas_over_pred\": 1.05, \"bytes\": {b}, \"count\": {}, \"oop_time_us\": {t}, \"ip_time_us\": {t}, \"ip_busbw_gbs\": {}, \"oop_busbw_gbs\": 0.1}}",
                b / 4,
                b as f64 / t / 1e3
            )
        })
        .collect();
    format!(
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"all_reduce\",\n  \"ranks\": 2,\n  \"transport\": \"tcp\",\n  \"law\": {{\"rate_bytes_per_s\": 125000000, \"steps\": 2, \"factor\": 1}},\n  \"fit\": {{\"alpha_s\": 1e-5, \"beta_s_per_byte\": 8.4e-9, \"link_bytes_per_s\": 119047619, \"rate_bytes_per_s\": 125000000}},\n  \"rows\": [\n{}\n  ]\n}}\n",
        rows.join(",\n")
    )
}

const PEERS: &str = r#"{"tool": "compare-peers", "reps": 1, "rows": [
 {"setting": "loopback", "ranks": 2, "bytes": 1024, "ferroccl": {"time_us": 20, "busbw_gbs": 0.05}, "gloo": {"time_us": 400, "busbw_gbs": 0.0025}, "mpi-tcp": {"time_us": 8, "busbw_gbs": 0.12}, "ratio_vs_gloo": 20, "wire_ratio": "1.000"},
 {"setting": "loopback", "ranks": 2, "bytes": 1048576, "ferroccl": {"time_us": 300, "busbw_gbs": 3.5}, "gloo": {"time_us": 1100, "busbw_gbs": 0.95}, "mpi-tcp": {"time_us": 220, "busbw_gbs": 4.7}, "ratio_vs_gloo": 3.7, "wire_ratio": "1.000"}
]}"#;

#[test]
fn plots_bench_law_and_peers_files() {
    let dir = temp_dir("ok");
    let law = dir.join("law-n2.json");
    let peers = dir.join("peers.json");
    std::fs::write(&law, law_json()).expect("write law fixture");
    std::fs::write(&peers, PEERS).expect("write peers fixture");
    let out_dir = dir.join("out");
    let o = ferroccl(&[
        "plot",
        law.to_str().expect("utf-8"),
        peers.to_str().expect("utf-8"),
        "-o",
        out_dir.to_str().expect("utf-8"),
        "--title",
        "fixture",
    ]);
    let stdout = o.stdout.as_str();
    let stderr = o.stderr.as_str();
    assert!(o.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("busbw.svg (4 series)"), "{stdout}");
    assert!(stdout.contains("law.svg (1 series)"), "{stdout}");

    let busbw = std::fs::read_to_string(out_dir.join("busbw.svg")).expect("busbw.svg");
    assert!(
        busbw.starts_with("<svg"),
        "{}",
        &busbw[..busbw.len().min(200)]
    );
    for name in [
        "ferroccl all_reduce tcp n=2 (law-n2)",
        "ferroccl n=2 loopback",
        "gloo n=2 loopback",
        "mpi-tcp n=2 loopback",
        "fixture: busbw against size",
        "1K",
        "1M",
    ] {
        assert!(busbw.contains(name), "busbw.svg lacks {name:?}");
    }
    assert!(
        busbw.matches("<polyline").count() >= 4,
        "one line per series"
    );

    let lawsvg = std::fs::read_to_string(out_dir.join("law.svg")).expect("law.svg");
    for name in [
        "ferroccl all_reduce tcp n=2 (law-n2) measured",
        "ferroccl all_reduce tcp n=2 (law-n2) ring law",
    ] {
        assert!(lawsvg.contains(name), "law.svg lacks {name:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn refuses_missing_and_foreign_files() {
    let dir = temp_dir("bad");
    let foreign = dir.join("foreign.json");
    std::fs::write(&foreign, r#"{"tool": "nccl-tests", "rows": []}"#).expect("write");
    let broken = dir.join("broken.json");
    std::fs::write(&broken, "{ not json").expect("write");
    let empty = dir.join("empty.json");
    std::fs::write(&empty, r#"{"tool": "ferroccl bench", "rows": []}"#).expect("write");
    let out = dir.join("out");
    let o_s = out.to_str().expect("utf-8");
    for (file, needle) in [
        (dir.join("missing.json"), "reading"),
        (foreign, "expected \"ferroccl bench\""),
        (broken, "not JSON"),
        (empty, "no rows to plot"),
    ] {
        let o = ferroccl(&["plot", file.to_str().expect("utf-8"), "-o", o_s]);
        let err = o.stderr.as_str();
        assert_eq!(o.status.code(), Some(2), "{file:?}: {err}");
        assert!(
            err.contains(needle),
            "{file:?} should say {needle:?}: {err}"
        );
    }
    assert!(!out.join("busbw.svg").exists(), "nothing drawn on errors");
    let _ = std::fs::remove_dir_all(&dir);
}
