//! The questions `plan` answers as asked (visible communication, pipeline bubble,
//! tensor parallelism) and `ferroccl simulate`'s rows.

use super::*;

/// Question one, as asked: "one GPU does 150 img/s at batch 128; on 8 GPUs with +25 %
/// from mixed precision and about 15 % lost to communication, what global batch, steps
/// per epoch, throughput, epoch time and learning rate?" By hand: global batch 8 × 128
/// = 1024; throughput 150 × 8 × 1.25 × (1 − 0.15) = 1275 img/s; lr × 1024 / 128 = 8 ×
/// the single GPU's. No dataset size was given, so steps per epoch and epoch time are
/// skipped with the reason; with ImageNet (1,281,167): floor(1281167 / 1024) = 1251
/// steps, 1251 × 1024 / 1275 = 1004.72 s per epoch; with lr 0.1 per 256: 0.4.
#[test]
fn question_one_answers_without_a_link() {
    let q = [
        "--ranks",
        "8",
        "--per-rank-batch",
        "128",
        "--throughput",
        "150",
        "--amp-speedup",
        "1.25",
        "--overhead",
        "0.15",
    ];
    let out = ok(&plan(&q));
    for needle in [
        "global batch             = ranks × per-rank batch × accumulation steps = 8 × 128 × 1 = 1024",
        "steps per epoch            skipped: needs --dataset-size",
        "time per epoch             skipped: needs --dataset-size",
        "lr factor                = global batch / base batch = 1024 / 128 (the single-rank batch b × k) = 8",
        "scaled lr                  skipped: needs --base-lr",
        "compute / (1 − overhead) = 682.667 ms / (1 − 0.15) = 803.137 ms",
        "= 8 × 128 × 1 / 803.137 ms = 1275 samples/s",
        "efficiency               = speedup / ranks = 6.8 / 8 = 85 %",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
    let mut args = q.to_vec();
    args.extend([
        "--dataset-size",
        "1281167",
        "--base-lr",
        "0.1",
        "--base-batch",
        "256",
        "--json",
    ]);
    let v = json(&plan(&args));
    assert_eq!(v["global_batch"], 1024);
    assert_eq!(v["steps_per_epoch"], 1251);
    close(num(&v, "throughput"), 1275.0, 1e-12);
    close(num(&v, "epoch_s"), 1251.0 * 1024.0 / 1275.0, 1e-12);
    close(num(&v, "scaled_lr"), 0.4, 1e-12);
    assert!(v["comm_s"].is_null());
    assert!(v["skipped"]["comm_s"]
        .as_str()
        .expect("reason")
        .contains("--link"));
}

/// Question two: "communication is 90 ms of a 400 ms step; if fp16 halves it and
/// overlap hides 40 % of the rest, what is left visible and what is the step time?"
/// By hand: 90 / 2 = 45 ms; 40 % of 45 hidden = 18; visible 27 ms (= 90 × 0.5 × 0.6);
/// the step's other 400 − 90 = 310 ms stay, so the step is 310 + 27 = 337 ms.
#[test]
fn question_two_visible_communication() {
    let q = [
        "--comm-ms",
        "90",
        "--step-ms",
        "400",
        "--comm-cut",
        "fp16",
        "--overlap",
        "0.4",
    ];
    let out = ok(&plan(&q));
    for needle in [
        "compute per step         = (step − communication) / amp speed-up = (400 ms − 90 ms) / 1 = 310 ms",
        "comm per step            = given communication / cut = 90 ms / 2 = 45 ms",
        "min(0.4 × 45 ms, 310 ms) = 18 ms",
        "visible comm             = comm − hidden = 45 ms − 18 ms = 27 ms",
        "(310 ms + 27 ms) / (1 − 0) = 337 ms",
        "throughput                 skipped: needs --ranks",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
    let mut args = q.to_vec();
    args.push("--json");
    let v = json(&plan(&args));
    close(num(&v, "visible_comm_s"), 0.027, 1e-12);
    close(num(&v, "step_s"), 0.337, 1e-12);
    // A compression factor instead of fp16: 90 / 3 = 30; 40 % hidden: 18 visible; 328 ms
    let v = json(&plan(&[
        "--comm-ms",
        "90",
        "--step-ms",
        "400",
        "--comm-cut",
        "3",
        "--overlap",
        "0.4",
        "--json",
    ]));
    close(num(&v, "visible_comm_s"), 0.018, 1e-12);
    close(num(&v, "step_s"), 0.328, 1e-12);
}

/// Question two from a TOML file, keys as the flags; a flag overrides the file's cut,
/// and a file's `link` gives way to a `--comm-ms` flag.
#[test]
fn toml_config_takes_the_visible_communication_keys() {
    let dir = temp_dir("tomlcomm");
    let cfg = dir.join("q2.toml");
    std::fs::write(
        &cfg,
        "comm_ms = 90\nstep_ms = 400\ncomm_cut = \"fp16\"\noverlap = 0.4\n",
    )
    .expect("write config");
    let c = cfg.to_str().expect("utf-8");
    let v = json(&plan(&["--config", c, "--json"]));
    close(num(&v, "step_s"), 0.337, 1e-12);
    // 90 / 3 = 30 ms; 40 % hidden: 18 ms visible; 310 + 18 = 328 ms
    let v = json(&plan(&["--config", c, "--comm-cut", "3", "--json"]));
    close(num(&v, "step_s"), 0.328, 1e-12);
    let linked = dir.join("linked.toml");
    std::fs::write(
        &linked,
        "ranks = 2\nper_rank_batch = 8\nstep_ms = 400\nlink = \"10Gbit\"\nparams = \"1M\"\n",
    )
    .expect("write config");
    let v = json(&plan(&[
        "--config",
        linked.to_str().expect("utf-8"),
        "--comm-ms",
        "90",
        "--json",
    ]));
    close(num(&v, "step_s"), 0.4, 1e-12);
    assert!(v["input"]["link"].is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every row of `ferroccl simulate` chooses the least of its times ('-': cannot run),
/// and the cost model's pick is within 5 % of it.
fn check_least(rows: &[Vec<String>]) {
    for r in rows {
        let t: Vec<f64> = r[2..7]
            .iter()
            .map(|x| x.parse().unwrap_or(f64::INFINITY))
            .collect();
        let best = t.iter().cloned().fold(f64::INFINITY, f64::min);
        let chosen = match r[7].as_str() {
            "ring" => t[0],
            "rd" => t[1],
            "rab" => t[2],
            "tree" => t[3],
            "hier" => t[4],
            other => panic!("chosen {other}"),
        };
        assert_eq!(chosen, best, "{r:?}");
        // The cost model's pick, within 5 % of the least simulated time.
        let model: f64 = r[10].parse().unwrap();
        assert!((1.0..=1.05).contains(&model), "{r:?}");
    }
}

/// `ferroccl simulate ARGS`: its rows (the lines that are not comments or the header),
/// split into columns, and its output for messages.
fn simulate_rows(args: &[&str]) -> (Vec<Vec<String>>, String) {
    let mut all = vec!["simulate"];
    all.extend_from_slice(args);
    let out = common::proc::ferroccl(&all, std::time::Duration::from_secs(60));
    assert!(out.status.success(), "{}", out.stderr);
    let rows = out
        .stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim_start().starts_with("ranks"))
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect();
    (rows, out.stdout)
}

#[test]
fn simulate_prints_every_algorithm_and_the_least() {
    let (rows, stdout) = simulate_rows(&[
        "--ranks",
        "4,64",
        "-b",
        "1K",
        "-e",
        "4M",
        "-f",
        "64",
        "--alpha-us",
        "20",
        "--link",
        "100Gbit",
    ]);
    assert_eq!(rows.len(), 6, "2 worlds x 3 sizes:\n{stdout}");
    check_least(&rows);
    // 64 ranks, 1 KiB: latency-bound, the ring's 126 steps lose.
    assert_ne!(rows[3][7], "ring", "{:?}", rows[3]);
    // One rank per host: no hierarchical column.
    assert!(rows.iter().all(|r| r[6] == "-"), "{stdout}");
    // Hosts of 2 ranks behind a 1 Gbit/s port, 10 Gbit/s within: the hierarchical
    // plan carries 2(H-1)/H·S across a host's port instead of 2(N-1)/N·S.
    let (rows, stdout) = simulate_rows(&[
        "--ranks",
        "4,8",
        "-b",
        "16M",
        "-e",
        "16M",
        "--link",
        "1Gbit",
        "--ranks-per-host",
        "2",
        "--intra-link",
        "10Gbit",
    ]);
    assert_eq!(rows.len(), 2, "{stdout}");
    check_least(&rows);
    // Across a host's port the ring sends 2(n-1)/n·S, the hierarchical plan
    // 2(H-1)/H·S: 1.5x less at 2 hosts of 2, 1.17x at 4 hosts of 2 (the local steps
    // take some of it back).
    for (r, least) in rows.iter().zip([1.3, 1.0]) {
        assert_eq!(r[7], "hier", "{r:?}");
        let ratio: f64 = r[8].parse().unwrap();
        assert!(ratio > least, "{r:?}");
    }
    // The emulated cluster's shaper: a 250 kB bucket lets the tree's idle ports burst
    // (64 KiB on 8 hosts) and leaves a rate-bound ring alone (16 MiB on 2 hosts).
    for (ranks, size, col, faster) in [("8", "64K", 5, true), ("2", "16M", 2, false)] {
        let base = [
            "--ranks",
            ranks,
            "-b",
            size,
            "-e",
            size,
            "--alpha-us",
            "149",
            "--link",
            "1Gbit",
        ];
        let (plain, _) = simulate_rows(&base);
        let (bucket, stdout) = simulate_rows(&[&base[..], &["--burst", "250K"]].concat());
        let (p, b): (f64, f64) = (
            plain[0][col].parse().unwrap(),
            bucket[0][col].parse().unwrap(),
        );
        if faster {
            assert!(b < 0.7 * p, "{p} without the bucket, {b} with:\n{stdout}");
        } else {
            assert!(
                (b / p - 1.0).abs() < 0.01,
                "{p} without the bucket, {b} with:\n{stdout}"
            );
        }
    }
    let bad = common::proc::ferroccl(
        &["simulate", "--ranks", "0"],
        std::time::Duration::from_secs(20),
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(bad.stderr.contains("--ranks"), "{}", bad.stderr);
}

#[test]
fn the_pipeline_question_gets_the_textbook_bubble_and_step_time() {
    let text = ok(&plan(&[
        "--pipeline",
        "4",
        "--micro-batches",
        "8",
        "--stage-ms",
        "10",
    ]));
    assert!(text.contains("= 110.000 ms"), "{text}");
    assert!(text.contains("3/11 = 27.3 %"), "{text}");
    assert!(text.contains("m ≥ 28"), "{text}");
    let v = json(&plan(&[
        "--pipeline",
        "2",
        "--micro-batches",
        "4",
        "--stage-ms",
        "10,20",
        "--json",
    ]));
    // Σ t + (m − 1) max t = 30 + 3 × 20; busy 4 × 30 of 2 × 90.
    assert_eq!(num(&v, "step_ms"), 90.0);
    assert!((num(&v, "bubble_fraction") - (1.0 - 120.0 / 180.0)).abs() < 1e-12);
    fails(
        &plan(&[
            "--pipeline",
            "3",
            "--micro-batches",
            "4",
            "--stage-ms",
            "1,2",
        ]),
        &["2 times for 3 stages"],
    );
    fails(
        &plan(&["--pipeline", "3", "--stage-ms", "1"]),
        &["--micro-batches"],
    );
}

#[cfg(feature = "candle")]
#[test]
fn the_tensor_parallel_question_gets_the_per_layer_all_reduces_against_data_parallel() {
    let text = ok(&plan(&[
        "--tensor-parallel",
        "4",
        "--per-rank-batch",
        "8",
        "--seq-len",
        "1024",
        "--hidden",
        "4096",
        "--layers",
        "2",
        "--grad-dtype",
        "bf16",
        "--link",
        "100Gbit",
    ]));
    // B·S·H = 8 × 1024 × 4096 elements of 2 bytes, 2(T − 1)/T = 1.5 of them per rank.
    assert!(
        text.contains("all-reduces per layer per step = 2"),
        "{text}"
    );
    assert!(text.contains("B·S·H = 33554432 elements"), "{text}");
    assert!(text.contains("1.5 × 67.1089 MB = 100.663 MB"), "{text}");
    assert!(
        text.contains("per step (2 layer(s)) = 402.653 MB"),
        "{text}"
    );
    // Data parallelism sends twice that: B·S = 8192 is half of F's break-even.
    assert!(text.contains("= 0.499924"), "{text}");
    assert!(
        text.contains("B·S < params per layer / (2 × H) = 16386.5 rows"),
        "{text}"
    );
    let v = json(&plan(&[
        "--tensor-parallel",
        "2",
        "--per-rank-batch",
        "16",
        "--seq-len",
        "4",
        "--hidden",
        "8",
        "--ffn",
        "16",
        "--attention",
        "--json",
    ]));
    // What the counted-bytes test in ferroccl-candle holds to the links: a layer of
    // attention and MLP, 4 all-reduces of 16 × 4 × 8 f32, each rank sending
    // 2(T − 1)/T of each.
    assert_eq!(num(&v, "all_reduces_per_layer"), 4.0);
    assert_eq!(
        num(&v, "bytes_per_step"),
        4.0 * (2.0 * 1.0 / 2.0) * 512.0 * 4.0
    );
    fails(
        &plan(&[
            "--tensor-parallel",
            "3",
            "--per-rank-batch",
            "8",
            "--hidden",
            "512",
        ]),
        &["does not cut into 3 equal tensor-parallel shards"],
    );
    fails(
        &plan(&["--tensor-parallel", "2", "--hidden", "512"]),
        &["--per-rank-batch"],
    );
    // The same question from a TOML file, a flag overriding its T.
    let dir = temp_dir("tp");
    let cfg = dir.join("tp.toml");
    std::fs::write(
        &cfg,
        "tensor_parallel = 4\nper_rank_batch = 16\nseq_len = 4\nhidden = 8\nffn = 16\nattention = true\n",
    )
    .expect("write config");
    let c = cfg.to_str().unwrap();
    let v = json(&plan(&["--config", c, "--tensor-parallel", "2", "--json"]));
    assert_eq!(
        num(&v, "bytes_per_step"),
        4.0 * (2.0 * 1.0 / 2.0) * 512.0 * 4.0
    );
    let v = json(&plan(&["--config", c, "--json"]));
    assert_eq!(
        num(&v, "bytes_per_step"),
        4.0 * (2.0 * 3.0 / 4.0) * 512.0 * 4.0
    );
    fails(
        &plan(&[
            "--tensor-parallel",
            "0",
            "--per-rank-batch",
            "8",
            "--hidden",
            "512",
        ]),
        &["--tensor-parallel must be at least 1"],
    );
}
