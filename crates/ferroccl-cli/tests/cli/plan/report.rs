//! The report itself: the formulas, `--json`, one rank, a TOML config with flags over
//! it, and the input errors.

use super::*;

#[test]
fn human_report_shows_each_formula() {
    let out = ok(&plan(CASE_A));
    for needle in [
        "ranks × per-rank batch × accumulation steps = 8 × 32 × 1 = 256",
        "floor(dataset size / global batch) = floor(1281167 / 256) = 5004",
        "(drop_last: 143 samples left out per epoch)",
        "steps per epoch × epochs = 5004 × 90 = 450360",
        "base lr × global batch / base batch = 0.1 × 256 / 256 = 0.1",
        "ceil(warmup epochs × steps per epoch) = ceil(5 × 5004) = 25020",
        // ring bytes 2·7/8·102.4e6 = 179.2e6 B; at 1.25e9 B/s: 0.14336 s; f16 halves it
        "2(N-1)/N × S = 2 × 7 / 8 × 102.4 MB = 179.2 MB",
        "2(N-1)·α + 2(N-1)/N·S·β = 14 × 0 s + 179.2 MB × 0.8 ns/B = 143.36 ms  (used)",
        "89.6 MB × 0.8 ns/B = 71.68 ms",
        "min(overlap × comm, compute) = min(0 × 143.36 ms, 80 ms) = 0 s",
        "(compute + visible comm) / (1 − overhead) = (80 ms + 143.36 ms) / (1 − 0) = 223.36 ms",
        "visible comm / step time = 143.36 ms / 223.36 ms = 64.1834 %",
        "8 × 32 × 1 / 223.36 ms = 1146.13 samples/s",
        "speedup / ranks = 2.86533 / 8 = 35.8166 %",
        "5004 × 223.36 ms = 1117.69 s (18m 38s)",
        "= 100592 s (1d 03h 56m 32s)",
        "1/β = 1.25 GB/s (10 Gbit/s)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn json_has_the_numbers() {
    let mut args = CASE_A.to_vec();
    args.push("--json");
    let v = json(&plan(&args));
    assert_eq!(v["global_batch"], 256);
    assert_eq!(v["steps_per_epoch"], 5004);
    assert_eq!(v["total_steps"], 450_360);
    assert_eq!(v["warmup_steps"], 25_020);
    assert_eq!(v["input"]["ranks"], 8);
    assert_eq!(v["input"]["link"]["source"], "--link 10Gbit");
    for (key, want) in [
        ("scaled_lr", 0.1),
        ("compute_s", 0.08),
        ("grad_bytes", 102.4e6),
        ("ring_bytes_per_rank", 179.2e6),
        ("link_bytes_per_s", 1.25e9),
        ("comm_s", 0.14336),
        ("comm_f32_s", 0.14336),
        ("comm_f16_s", 0.07168),
        ("visible_comm_s", 0.14336),
        ("step_s", 0.22336),
        ("throughput", 256.0 / 0.22336),
        ("speedup", 256.0 / 0.22336 / 400.0),
        ("efficiency", 0.08 / 0.22336),
        ("comm_share", 0.14336 / 0.22336),
        ("epoch_s", 1117.69344),
        ("total_s", 100592.4096),
    ] {
        close(num(&v, key), want, 1e-12);
    }
}

#[test]
fn json_case_b_with_accumulation_amp_bf16_and_overlap() {
    // G = 4·64·2 = 512; compute = 128 / 1000 / 2 = 0.064 s; S = 10e6 × 2 = 20e6 B;
    // comm = 2·3·10 µs + 2·3/4·20e6 / 12.5e9 = 2.46 ms; visible = 2.46 ms × 0.25 =
    // 0.615 ms; step = 0.064615 / 0.9 s; throughput = 460.8 / 0.064615 samples/s.
    let v = json(&plan(&[
        "-n",
        "4",
        "--batch",
        "64",
        "--accum",
        "2",
        "--dataset-size",
        "100K",
        "--epochs",
        "3",
        "--throughput",
        "1000",
        "--amp-speedup",
        "2",
        "--params",
        "10M",
        "--grad-dtype",
        "bf16",
        "--link",
        "12.5GB/s",
        "--alpha-us",
        "10",
        "--overlap",
        "0.75",
        "--overhead",
        "0.1",
        "--json",
    ]));
    assert_eq!(v["global_batch"], 512);
    assert_eq!(v["steps_per_epoch"], 195);
    assert!(v["scaled_lr"].is_null());
    close(num(&v, "alpha_s"), 10e-6, 1e-12);
    close(num(&v, "comm_s"), 2.46e-3, 1e-12);
    close(num(&v, "comm_f32_s"), 4.86e-3, 1e-12);
    close(num(&v, "visible_comm_s"), 0.615e-3, 1e-9);
    close(num(&v, "step_s"), 0.064615 / 0.9, 1e-12);
    close(num(&v, "throughput"), 460.8 / 0.064615, 1e-12);
    close(num(&v, "total_s"), 585.0 * 0.064615 / 0.9, 1e-12);
}

#[test]
fn one_rank_means_no_communication() {
    let v = json(&plan(&[
        "-n",
        "1",
        "--batch",
        "32",
        "--dataset-size",
        "1000",
        "--throughput",
        "400",
        "--params",
        "25.6M",
        "--link",
        "1Gbit",
        "--alpha-us",
        "50",
        "--json",
    ]));
    assert_eq!(num(&v, "comm_s"), 0.0);
    assert_eq!(num(&v, "ring_bytes_per_rank"), 0.0);
    close(num(&v, "speedup"), 1.0, 1e-12);
    close(num(&v, "efficiency"), 1.0, 1e-12);
}

#[test]
fn toml_config_and_flag_override() {
    let dir = temp_dir("toml");
    std::fs::write(dir.join("bench.json"), bench_json(4, 25e-6, 0.8e-9)).expect("write");
    let cfg = dir.join("plan.toml");
    std::fs::write(
        &cfg,
        r#"
ranks = 8
per_rank_batch = 32
dataset_size = "1.281167M"
epochs = 90
throughput = 400.0
base_lr = 0.1
base_batch = 256
warmup_epochs = 5
params = 25_600_000
grad_dtype = "f32"
link = "10Gbit"
"#,
    )
    .expect("write config");
    let c = cfg.to_str().expect("utf-8");
    let v = json(&plan(&["--config", c, "--json"]));
    assert_eq!(v["global_batch"], 256);
    assert_eq!(v["steps_per_epoch"], 5004);
    close(num(&v, "step_s"), 0.22336, 1e-12);

    // Flags win: 16 ranks, and --compute-ms replaces the file's throughput.
    // G = 512; compute = 50 ms; ring = 2·15/16·102.4e6 = 192e6 B → 0.1536 s
    let v = json(&plan(&[
        "--config",
        c,
        "-n",
        "16",
        "--compute-ms",
        "50",
        "--json",
    ]));
    assert_eq!(v["global_batch"], 512);
    close(num(&v, "compute_s"), 0.05, 1e-12);
    close(num(&v, "comm_s"), 0.1536, 1e-12);

    // --bench replaces the file's link; a relative path in a file is relative to it.
    std::fs::write(
        dir.join("bench.toml"),
        "ranks = 8\nper_rank_batch = 32\ndataset_size = 1281167\nthroughput = 400\nparams = \"25.6M\"\nbench = \"bench.json\"\n",
    )
    .expect("write");
    let v = json(&plan(&[
        "--config",
        dir.join("bench.toml").to_str().expect("utf-8"),
        "--json",
    ]));
    close(num(&v, "alpha_s"), 25e-6, 1e-6);
    let v = json(&plan(&[
        "--config",
        c,
        "--bench",
        dir.join("bench.json").to_str().expect("utf-8"),
        "--json",
    ]));
    close(num(&v, "alpha_s"), 25e-6, 1e-6);

    // Unknown keys are refused by name.
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, "ranks = 8\nbatch_size = 32\n").expect("write");
    fails(
        &plan(&["--config", typo.to_str().expect("utf-8")]),
        &["configuration: config file", "typo.toml", "batch_size"],
    );
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, "ranks = \n").expect("write");
    fails(
        &plan(&["--config", broken.to_str().expect("utf-8")]),
        &["broken.toml"],
    );
    fails(
        &plan(&["--config", dir.join("nope.toml").to_str().expect("utf-8")]),
        &["reading config file", "nope.toml"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_errors() {
    let with = |flag: &str, value: &str| {
        let mut args: Vec<&str> = CASE_A.to_vec();
        match args.iter().position(|a| *a == flag) {
            Some(k) => args[k + 1] = value,
            None => args.extend([flag, value]),
        }
        plan(&args)
    };
    fails(
        &with("--ranks", "0"),
        &["invalid argument", "--ranks must be at least 1, got 0"],
    );
    fails(
        &with("--per-rank-batch", "0"),
        &["--per-rank-batch", "got 0"],
    );
    fails(
        &with("--accumulation-steps", "0"),
        &["--accumulation-steps", "got 0"],
    );
    fails(&with("--dataset-size", "0"), &["--dataset-size", "got 0"]);
    fails(
        &with("--throughput", "0"),
        &["--throughput", "positive", "got 0"],
    );
    fails(&with("--throughput", "-3"), &["--throughput", "got -3"]);
    fails(&with("--link", "0Gbit"), &["--link", "positive", "0Gbit"]);
    fails(&with("--link", "-10Gbit"), &["--link", "positive"]);
    fails(&with("--link", "10"), &["--link", "no unit"]);
    fails(&with("--overlap", "1.5"), &["--overlap", "[0, 1]", "1.5"]);
    fails(&with("--overlap", "-0.5"), &["--overlap", "-0.5"]);
    fails(&with("--overhead", "1"), &["--overhead", "[0, 1)"]);
    fails(&with("--amp-speedup", "0"), &["--amp-speedup"]);
    fails(&with("--grad-dtype", "int8"), &["--grad-dtype", "int8"]);
    fails(&with("--params", "0"), &["--params", "got 0"]);
    fails(
        &with("--compute-ms", "50"),
        &["--throughput", "--compute-ms", "not both"],
    );
    fails(
        &with("--bench", "x.json"),
        &["--link", "--bench", "not both"],
    );
    // Contradictions and impossible values, each naming its flag.
    fails(
        &with("--comm-ms", "90"),
        &["--comm-ms", "--link 10Gbit", "give one"],
    );
    fails(
        &plan(&["--step-ms", "400", "--comm-ms", "500"]),
        &["--comm-ms 500", "--step-ms 400"],
    );
    fails(&plan(&["--comm-ms", "-5"]), &["--comm-ms", "-5"]);
    fails(
        &plan(&["--comm-ms", "90", "--comm-cut", "0.5"]),
        &["--comm-cut", "0.5"],
    );
    fails(
        &plan(&["--comm-ms", "90", "--comm-cut", "zip"]),
        &["--comm-cut", "zip"],
    );
    fails(
        &plan(&["--throughput", "100", "--step-ms", "400"]),
        &["--throughput", "--step-ms", "not both"],
    );
    fails(&plan(&["--overhead", "1"]), &["--overhead", "[0, 1)"]);
    fails(&plan(&["-n", "0"]), &["--ranks", "got 0"]);
}
