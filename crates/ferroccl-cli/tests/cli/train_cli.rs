//! `ferroccl train` end to end: real processes started by its own launcher, metrics
//! JSON lines, checkpoints, resume, `--scaling`, and its refusals. Every run has a
//! deadline.

use crate::common;

use common::proc::ferroccl;
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `ferroccl ARGS`, failing the test (with its output) unless it succeeds.
fn ok(args: &[&str]) -> common::proc::Output {
    let o = ferroccl(args, DEADLINE);
    assert!(
        o.status.success(),
        "{args:?}\nstdout:\n{}\nstderr:\n{}",
        o.stdout,
        o.stderr
    );
    o
}

const SMALL: [&str; 8] = [
    "train",
    "--synthetic",
    "400",
    "--epochs",
    "1",
    "-b",
    "16",
    "--log-every",
];

#[test]
fn two_processes_train_write_metrics_checkpoints_and_resume() {
    let d = temp_dir("run");
    let (metrics, summary, ck) = (d.join("m.jsonl"), d.join("s.json"), d.join("ck"));
    let mut args = SMALL.to_vec();
    args.extend([
        "5",
        "-n",
        "2",
        "--max-steps",
        "10",
        "--metrics",
        metrics.to_str().unwrap(),
        "--summary",
        summary.to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]);
    let o = ok(&args);
    assert!(o.stdout.contains("ranks 2  steps 10"), "{}", o.stdout);
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["steps"], 10);
    assert_eq!(s["world"], 2);
    // Two logged intervals (steps 5 and 10), each: one line per rank and the mean.
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "{lines:?}");
    let kinds: Vec<&str> = lines.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["rank", "rank", "mean", "rank", "rank", "mean"]);
    assert_eq!(lines[3]["rank"], 0);
    assert_eq!(lines[4]["rank"], 1);
    assert_eq!(lines[5]["step"], 10);
    let (l0, l1, mean) = (
        lines[3]["loss"].as_f64().unwrap(),
        lines[4]["loss"].as_f64().unwrap(),
        lines[5]["loss"].as_f64().unwrap(),
    );
    assert!((mean - (l0 + l1) / 2.0).abs() < 1e-9);
    assert!(ck.join("ckpt-0000000010.fcc").exists());

    // Resume: continues from step 10 to 20.
    let mut args = SMALL.to_vec();
    args.extend([
        "5",
        "-n",
        "2",
        "--max-steps",
        "20",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--resume",
    ]);
    let o = ok(&args);
    assert!(o.stdout.contains("steps 20 (this run 10)"), "{}", o.stdout);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn scaling_reports_each_world_size_and_draws_the_plot() {
    let d = temp_dir("scaling");
    let svg = d.join("s.svg");
    let mut args = SMALL.to_vec();
    args.extend([
        "5",
        "--max-steps",
        "4",
        "--scaling",
        "1,2",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let o = ok(&args);
    let rows: Vec<Vec<&str>> = o
        .stdout
        .lines()
        .skip_while(|l| !l.contains("images/s") || !l.trim_start().starts_with("ranks"))
        .skip(1)
        .take_while(|l| !l.starts_with("plot:"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{}", o.stdout);
    assert_eq!(rows[0][0], "1");
    assert_eq!(rows[1][0], "2");
    assert_eq!(rows[0][2], "1.00");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_parameter_server_run_with_a_straggler_reports_staleness_and_accuracy() {
    let d = temp_dir("ssp");
    let summary = d.join("s.json");
    let mut args = SMALL.to_vec();
    args.extend([
        "5",
        "-n",
        "2",
        "--max-steps",
        "6",
        "--mode",
        "ssp",
        "--staleness",
        "2",
        "--slow-rank",
        "1",
        "--slow-factor",
        "3",
        "--summary",
        summary.to_str().unwrap(),
        "--curve-every",
        "0.001",
    ]);
    let o = ok(&args);
    for want in [
        "parameter server: 2 ranks",
        "staleness 2",
        "images/s",
        "staleness histogram",
    ] {
        assert!(
            o.stdout.contains(want),
            "stdout lacks {want:?}: {}",
            o.stdout
        );
    }
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(s["steps"], serde_json::json!([6, 6]));
    let hist: Vec<u64> = s["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // 2 workers × 6 steps × 2 shards, none staler than 2.
    assert_eq!(hist.iter().sum::<u64>(), 24, "{hist:?}");
    assert!(hist.len() <= 3, "{hist:?}");
    let acc = s["test_accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc), "{acc}");
    // Accuracy against time: in order, each a share, and the last the final accuracy.
    let curve: Vec<(f64, f64)> = serde_json::from_value(s["curve"].clone()).unwrap();
    assert!(!curve.is_empty());
    assert!(curve.windows(2).all(|w| w[0].0 <= w[1].0), "{curve:?}");
    assert!(
        curve.iter().all(|p| (0.0..=1.0).contains(&p.1)),
        "{curve:?}"
    );
    assert_eq!(curve.last().unwrap().1, acc);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_runs_are_refused_clearly() {
    let d = temp_dir("bad");
    let csv = d.join("bad.csv");
    std::fs::write(&csv, "1,2,3\n").unwrap();
    let csv = csv.to_str().unwrap().to_string();
    for (args, needle) in [
        (vec!["train", "-b", "15", "-n", "2"], "multiple of ranks"),
        (vec!["train", "--precision", "f8"], "unknown precision"),
        (vec!["train", "--precision", "bf16"], "no bf16 matmul"),
        (vec!["train", "--device", "tpu"], "invalid value 'tpu'"),
        (
            vec!["train", "--wire", "int4"],
            "unknown gradient wire type",
        ),
        (
            vec!["train", "--data", "/nonexistent/mnist.csv"],
            "/nonexistent/mnist.csv",
        ),
        (vec!["train", "--data", &csv], "784 pixels then the label"),
        (
            vec!["train", "--scaling", "0,2"],
            "world sizes of 1 or more",
        ),
        // What the parameter server does not read is refused, not ignored.
        (
            vec![
                "train",
                "--mode",
                "ssp",
                "--accum",
                "2",
                "--metrics",
                "m.jsonl",
            ],
            "does not read --accum, --metrics",
        ),
    ] {
        let o = ferroccl(&args, DEADLINE);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
    }
    // Refused by the process that would start the ranks, once, before any starts (a
    // rank's lines are prefixed with its rank).
    for args in [
        &["train", "-n", "2", "--precision", "bf16"][..],
        &["train", "-n", "2", "-b", "15"][..],
    ] {
        let o = ferroccl(args, DEADLINE);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            !o.stderr.contains("[0]") && !o.stderr.contains("[1]"),
            "{args:?}: {}",
            o.stderr
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// The child processes of `pid` (all its threads' children).
fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(c.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    out
}

#[test]
fn a_preempted_rank_checkpoints_and_the_restarted_job_resumes() {
    let dir = temp_dir("preempt");
    let ck = dir.join("ck");
    let ck_s = ck.display().to_string();
    let mut cmd = std::process::Command::new(common::proc::EXE);
    // About 130 steps: the signal lands long before the end.
    cmd.args(["train", "--synthetic", "400", "--epochs", "6", "-b", "16"])
        .args(["--checkpoint-dir", &ck_s, "--checkpoint-every", "1"])
        .args(["--resume", "-n", "2", "--max-restarts", "1"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for v in common::proc::LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    let mut child = cmd.spawn().unwrap();
    let (so, se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let read = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = p.read_to_string(&mut s);
            s
        })
    };
    let (so, se) = (read(Box::new(so)), read(Box::new(se)));
    // Once the first checkpoint is on disk, SIGTERM one rank, as a scheduler would.
    let start = std::time::Instant::now();
    let ranks = loop {
        let first = std::fs::read_dir(&ck)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".fcc"))
            })
            .unwrap_or(false);
        let ranks = children(child.id());
        if first && ranks.len() == 2 {
            break ranks;
        }
        assert!(start.elapsed() < DEADLINE, "no checkpoint appeared");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the job ended before the signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // SAFETY: kill(2) on a pid of our own child's child.
    assert_eq!(unsafe { libc::kill(ranks[1], libc::SIGTERM) }, 0);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("train did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (so, se) = (so.join().unwrap(), se.join().unwrap());
    assert!(status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(se.contains("preempted: stopped after step"), "{se}");
    assert!(
        se.contains(
            "stopped for preemption, after its checkpoint (exit status 75); restarting all 2 ranks"
        ),
        "{se}"
    );
    // The second attempt resumed: it ran fewer steps than the whole run.
    let line = so
        .lines()
        .find(|l| l.starts_with("ranks 2  steps"))
        .unwrap_or_else(|| panic!("{so}"));
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (total, this_run) = (nums[1], nums[2]);
    assert!(this_run < total && this_run > 0, "{line}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_pipeline_run_prints_each_ranks_step_time_row_and_refuses_bad_layouts() {
    let d = temp_dir("pipe");
    let summary = d.join("p.json");
    let o = ok(&[
        "train",
        "--synthetic",
        "300",
        "-b",
        "8",
        "-n",
        "2",
        "--pipeline",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "gpipe",
        "--max-steps",
        "2",
        "--summary",
        summary.to_str().unwrap(),
    ]);
    assert!(
        o.stdout
            .contains("2 stages × 1 replicas, gpipe with 4 micro-batches"),
        "{}",
        o.stdout
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let rows = s["per_rank"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    // GPipe holds every micro-batch's activations on every stage.
    for r in rows {
        assert_eq!(r["peak_live"], 4, "{r}");
    }
    assert_eq!(s["textbook_bubble"], 0.2);
    let bad = ferroccl(
        &[
            "train",
            "--synthetic",
            "300",
            "-n",
            "3",
            "--pipeline",
            "2",
            "--max-steps",
            "1",
        ],
        DEADLINE,
    );
    assert!(!bad.status.success());
    assert!(
        bad.stderr
            .contains("3 ranks do not make whole pipelines of 2 stages"),
        "{}",
        bad.stderr
    );
    let bad = ferroccl(&["train", "--zero", "2", "--max-steps", "1"], DEADLINE);
    assert!(!bad.status.success());
    // Refused at the flag: ZeRO-1 is the only stage built.
    assert!(bad.stderr.contains("2 is not in 0..=1"), "{}", bad.stderr);
    let _ = std::fs::remove_dir_all(&d);
}

/// `ferroccl train ARGS` with the ring forced over TCP (so that the tensor-parallel
/// bytes cross links and follow the ring law, whatever shared memory would pick),
/// failing the test unless it succeeds.
fn ok_ring(args: &[&str]) -> common::proc::Output {
    let mut c = std::process::Command::new(common::proc::EXE);
    c.args(args)
        .env("FERROCCL_ALGO", "ring")
        .env("FERROCCL_TRANSPORT", "tcp");
    let o = common::proc::run_cmd(c, DEADLINE);
    assert!(
        o.status.success(),
        "{args:?}\nstdout:\n{}\nstderr:\n{}",
        o.stdout,
        o.stderr
    );
    o
}

/// Largest |a − b| over the largest |b|, per tensor, of two `--save-weights` files.
fn weights_distance(a: &std::path::Path, b: &std::path::Path) -> f32 {
    let (a, b) = (
        ferroccl::ddp::checkpoint::load(a).unwrap(),
        ferroccl::ddp::checkpoint::load(b).unwrap(),
    );
    assert!(!a.tensors.is_empty());
    assert_eq!(a.tensors.len(), b.tensors.len());
    a.tensors
        .iter()
        .zip(&b.tensors)
        .map(|(x, y)| {
            assert_eq!((&x.name, x.data.len()), (&y.name, y.data.len()));
            let d = x
                .data
                .iter()
                .zip(&y.data)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            d / y.data.iter().map(|q| q.abs()).fold(1e-6, f32::max)
        })
        .fold(0.0, f32::max)
}

#[test]
fn tensor_parallel_runs_end_on_the_one_process_weights_and_count_the_formulas_bytes() {
    let d = temp_dir("tp");
    let common_args = [
        "train",
        "--synthetic",
        "200",
        "-b",
        "8",
        "--max-steps",
        "5",
        "--lr",
        "0.1",
    ];
    let run = |extra: &[&str], file: &str| {
        let path = d.join(file);
        let mut args = common_args.to_vec();
        args.extend_from_slice(extra);
        args.extend(["--save-weights", path.to_str().unwrap()]);
        (ok_ring(&args), path)
    };
    let (_, one) = run(&["-n", "1", "--mlp"], "one.fcc");
    let (z, zero) = run(&["-n", "2", "--mlp", "--zero", "1"], "zero.fcc");
    assert!(
        z.stdout.contains("replicas bitwise equal: yes"),
        "{}",
        z.stdout
    );
    let (o, t2) = run(&["-n", "2", "--tensor-parallel", "2"], "t2.fcc");
    assert!(
        o.stdout
            .contains("1 stages × 2 tensor-parallel × 1 replicas (P × T × D)"),
        "{}",
        o.stdout
    );
    let (o2, p2t2) = run(
        &[
            "-n",
            "4",
            "--tensor-parallel",
            "2",
            "--pipeline",
            "2",
            "--micro-batches",
            "2",
        ],
        "p2t2.fcc",
    );
    for (what, file) in [
        ("T = 2", &t2),
        ("P = 2, T = 2", &p2t2),
        ("ZeRO-1, D = 2", &zero),
    ] {
        let dist = weights_distance(file, &one);
        eprintln!("{what}: relative {dist} from one process");
        assert!(dist <= 1e-5, "{what}: relative {dist} from one process");
    }
    // Each rank's row ends with its tensor-parallel bytes per step, counted by its
    // links and by the formula: the same.
    for out in [&o.stdout, &o2.stdout] {
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| rank"))
            .collect();
        assert!(!rows.is_empty(), "{out}");
        for r in rows {
            let cells: Vec<&str> = r.trim_matches('|').split('|').map(str::trim).collect();
            let (counted, law) = (cells[cells.len() - 2], cells[cells.len() - 1]);
            assert!(law.parse::<f64>().unwrap() > 0.0, "{r}");
            assert_eq!(counted, law, "{r}");
        }
    }
    // Refused before any rank starts: a layout that is not the job, a T that does not
    // divide the hidden size, stages that are not whole pairs of layers.
    for (args, needle) in [
        (
            vec!["-n", "3", "--tensor-parallel", "2"],
            "3 ranks are not a P × T × D layout",
        ),
        (
            vec!["-n", "3", "--tensor-parallel", "3"],
            "hidden size 512 (layer 0) does not cut into 3",
        ),
        (
            vec!["-n", "16", "--tensor-parallel", "2", "--pipeline", "8"],
            "not whole tensor-parallel blocks",
        ),
        (
            vec!["--mode", "ssp", "--save-weights", "x.fcc"],
            "--mode ssp keeps its weights",
        ),
    ] {
        let mut all = common_args.to_vec();
        all.extend(args.iter().copied());
        let bad = ferroccl(&all, DEADLINE);
        assert!(!bad.status.success(), "{args:?}");
        assert!(bad.stderr.contains(needle), "{args:?}: {}", bad.stderr);
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// LeNet data-parallel: two ranks end bitwise equal to each other (the summary's digest
/// check) and within 1e-5 of one rank with the same global batch, on the same
/// `--save-weights` files `tools/gpu-check train` compares on a GPU.
#[test]
fn two_ranks_end_as_replicas_of_one_and_near_the_one_rank_weights() {
    let d = temp_dir("lenet-weights");
    let run = |n: &str| {
        let (w, s) = (d.join(format!("w{n}.fcc")), d.join(format!("s{n}.json")));
        let mut args = SMALL.to_vec();
        args.extend(["5", "-n", n, "--max-steps", "6", "--lr", "0.05"]);
        args.extend(["--save-weights", w.to_str().unwrap()]);
        args.extend(["--summary", s.to_str().unwrap()]);
        let o = ok(&args);
        assert!(
            o.stdout.contains("replicas bitwise equal: yes"),
            "{}",
            o.stdout
        );
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&s).unwrap()).unwrap();
        assert_eq!(s["replicas_equal"], true);
        w
    };
    let (one, two) = (run("1"), run("2"));
    let names: Vec<String> = ferroccl::ddp::checkpoint::load(&two)
        .unwrap()
        .tensors
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(
        names.first().map(String::as_str),
        Some("conv1.weight"),
        "{names:?}"
    );
    let dist = weights_distance(&two, &one);
    assert!(dist <= 1e-5, "2 ranks: relative {dist} from 1 rank");
    std::fs::remove_dir_all(&d).unwrap();
}

/// `--device cuda` in a build without candle's CUDA backend (or on a machine without a
/// GPU) fails before any rank starts, with the typed error naming CUDA.
#[test]
#[cfg(not(feature = "candle-cuda"))]
fn training_on_cuda_without_it_fails_at_once_naming_cuda() {
    for args in [
        &["train", "--device", "cuda", "-n", "2"][..],
        &["train", "--device", "cuda", "--scaling", "1,2"][..],
        &["train", "--device", "CUDA", "--pipeline", "2", "-n", "2"][..],
    ] {
        let t = std::time::Instant::now();
        let o = ferroccl(args, DEADLINE);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            o.stderr.contains("CUDA is not available") && o.stderr.contains("candle-cuda"),
            "{args:?}: {}",
            o.stderr
        );
        assert!(
            !o.stderr.contains("== 1 rank"),
            "{args:?} started ranks: {}",
            o.stderr
        );
        assert!(t.elapsed() < DEADLINE);
    }
}
