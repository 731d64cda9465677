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
    // Through the rings (on one host the collectives read symmetric memory otherwise,
    // and no payload crosses a link: `shm::symmetric_memory_runs_...` counts that).
    cmd.env("FERROCCL_SHM_SYMMETRIC", "off");
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
        (&["bench", "scan"], "unknown collective"),
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

/// Numbers out of range are refused in one line with exit status 2, naming the flag
/// and the range: no panic, no abort, no rank started, and nothing quietly rounded.
#[test]
fn bench_and_train_refuse_numbers_out_of_range() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--timeout", "inf"], "finite"),
        (&["bench", "--timeout", "1e300"], "longest allowed"),
        (
            &["bench", "--timeout", "99999999999999999999"],
            "longest allowed",
        ),
        (&["bench", "--timeout", "0"], "shortest allowed"),
        (&["bench", "--timeout", "nan"], "finite"),
        (&["bench", "--timeout", "-1"], "shortest allowed"),
        (&["bench", "--connect-timeout", "0"], "shortest allowed"),
        (&["bench", "-e", "18446744073709551615"], "largest size"),
        (&["bench", "-e", "99999999G"], "largest size"),
        (&["bench", "-e", "1024G"], "available"),
        (&["bench", "-b", "0"], "whole float elements"),
        (&["bench", "-b", "3"], "whole float elements"),
        (
            &["bench", "-b", "6", "-d", "double"],
            "whole double elements",
        ),
        (&["bench", "--ranks", "0"], "at least 1 rank"),
        (&["bench", "--ranks", "100000"], "most allowed"),
        (&["bench", "--ranks", "60000"], "CPUs"),
        (&["train", "-n", "0"], "at least 1 rank"),
        (&["bench", "-n", "18446744073709551615"], "most allowed"),
        (
            &["bench", "--busy-poll-us", "18446744073709551615"],
            "not in 0..=10000000",
        ),
        (&["simulate", "--ranks", "99999999999"], "most allowed"),
        (&["train", "--pipeline", "0"], "at least 1 rank"),
        (&["train", "--micro-batches", "0"], "not in 1..=1000000"),
        (&["train", "--schedule", "foo"], "invalid value 'foo'"),
        (&["train", "--zero", "2"], "not in 0..=1"),
        (&["train", "-n", "2", "--pipeline", "3"], "whole pipelines"),
        (
            &[
                "train",
                "-n",
                "2",
                "--pipeline",
                "2",
                "--micro-batches",
                "5",
            ],
            "equal micro-batches",
        ),
        (
            &[
                "plan",
                "--pipeline",
                "99999999999",
                "--micro-batches",
                "9",
                "--stage-ms",
                "1",
            ],
            "at most",
        ),
        (&["bench", "--split", "0"], "at least 1 rank"),
        (&["bench", "--segment-bytes", "0"], "segment_bytes"),
        (&["train", "--epochs", "0"], "not in 1.."),
        (&["train", "--lr", "nan"], "finite"),
        (&["train", "--lr", "-0.1"], "above 0"),
        (&["train", "--momentum", "1"], "up to, not including, 1"),
        (
            &["train", "--test-fraction", "2"],
            "up to, not including, 1",
        ),
        (&["train", "--timeout", "inf"], "finite"),
        (&["train", "--mode", "async"], "invalid value 'async'"),
        (
            &["train", "--mode", "ssp", "--staleness", "-1"],
            "not a staleness bound",
        ),
        (
            &["train", "--mode", "ssp", "--staleness", "2000000"],
            "most allowed",
        ),
        (&["train", "--staleness", "1"], "applies to --mode ssp"),
        (
            &["train", "--slow-rank", "0", "--slow-factor", "0.5"],
            "from 1 (not slow)",
        ),
        (
            &["train", "--slow-rank", "0", "--slow-factor", "nan"],
            "finite",
        ),
        (
            &["train", "-n", "2", "--slow-rank", "2"],
            "--slow-rank 2: the job has 2 rank(s)",
        ),
        (
            &["train", "-n", "2", "--mode", "ssp", "--pipeline", "2"],
            "no --pipeline",
        ),
        (
            &["train", "--mode", "ssp", "--checkpoint-every", "5"],
            "at the end of the run only",
        ),
        (&["launch", "-n", "0", "--", "true"], "at least 1 rank"),
    ];
    for (args, want) in cases {
        let mut cmd = Command::new(EXE);
        cmd.args(*args);
        let t0 = Instant::now();
        let out = run(cmd, Duration::from_secs(20));
        let (so, se) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {so}{se}");
        assert!(se.contains(want), "{args:?}: stderr lacks {want:?}: {se}");
        assert!(
            !se.contains("panicked") && so.is_empty(),
            "{args:?}: {so}{se}"
        );
        // One line (clap adds a blank line and a hint after its own).
        let first = se.lines().next().unwrap_or("");
        assert!(
            first.contains(want),
            "{args:?}: the first line says it: {se}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{args:?}: {:?}",
            t0.elapsed()
        );
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

#[test]
fn bare_bench_inside_an_sbatch_script_uses_its_flags_not_the_allocation() {
    // What sbatch's batch script sees for a 3-task allocation: task variables, no step.
    let mut cmd = Command::new(EXE);
    cmd.args([
        "bench", "--ranks", "2", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1",
    ])
    .env("SLURM_JOB_ID", "4242")
    .env("SLURM_PROCID", "0")
    .env("SLURM_NTASKS", "3")
    .env("SLURM_LOCALID", "0")
    .env_remove("SLURM_STEP_ID")
    .env_remove("SLURM_STEPID");
    let out = run(cmd, Duration::from_secs(60));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(so.contains("2 ranks"), "ran as --ranks says: {so}");
    assert!(so.contains("# Out of bounds values : 0 OK"), "{so}");
}

/// A torchrun that works on this machine: `FERROCCL_TORCHRUN`, else `torchrun` on the
/// PATH. Debian 12's python3-torch (1.13) ships one that fails on its own Python 3.11
/// before starting a worker (`to_map`: 'NoneType' object has no attribute 'get'), so a
/// candidate must first run `true` as its worker.
fn torchrun() -> Option<String> {
    let cand = std::env::var("FERROCCL_TORCHRUN").unwrap_or_else(|_| "torchrun".into());
    let mut probe = Command::new(&cand);
    probe.args([
        "--standalone",
        "--nproc_per_node",
        "1",
        "--no_python",
        "true",
    ]);
    probe
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let ok = probe.status().is_ok_and(|s| s.success());
    ok.then_some(cand)
}

#[test]
fn bench_runs_under_a_real_torchrun_with_its_agent_store() {
    // Run with torch 2.15.0 (PyPI): FERROCCL_TORCHRUN=/opt/torch2/bin/torchrun.
    let Some(torchrun) = torchrun() else {
        eprintln!("SKIPPED: no working torchrun (set FERROCCL_TORCHRUN)");
        return;
    };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    // The static backend: the agent serves a TCPStore on MASTER_PORT itself, which
    // rank 0 used to try to bind.
    let mut cmd = Command::new(&torchrun);
    cmd.args([
        "--nnodes",
        "1",
        "--nproc_per_node",
        "3",
        "--rdzv_backend",
        "static",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        &port,
        "--no_python",
        EXE,
        "bench",
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
    ]);
    let out = run(cmd, Duration::from_secs(120));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(
        so.contains("3 ranks") && so.contains("# Out of bounds values : 0 OK"),
        "{so}"
    );
    assert_eq!(rows(&so).len(), 3, "{so}");
    // The trainer too, with torchrun's c10d rendezvous (--standalone: agent store too).
    let mut cmd = Command::new(&torchrun);
    cmd.args([
        "--standalone",
        "--nproc_per_node",
        "2",
        "--no_python",
        EXE,
        "train",
        "--synthetic",
        "256",
        "--max-steps",
        "3",
    ]);
    let out = run(cmd, Duration::from_secs(120));
    let (so, se) = text(&out);
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    assert!(so.contains("ranks 2  steps 3"), "{so}");
}

#[test]
fn two_launchers_one_per_host_form_one_job() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let host = |node: &str| {
        let mut c = Command::new(EXE);
        c.args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            node,
            "--master-port",
            &port,
            "-n",
            "2",
            "--",
            EXE,
            "bench",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
        ])
        .env("FERROCCL_TOKEN", "shared-secret-of-both-hosts");
        c
    };
    let second = std::thread::spawn({
        let c = host("1");
        move || run(c, Duration::from_secs(90))
    });
    let first = run(host("0"), Duration::from_secs(90));
    let second = second
        .join()
        .unwrap_or_else(|_| panic!("second launcher panicked"));
    let (so, se) = text(&first);
    assert!(
        first.status.success(),
        "node 0: stdout:\n{so}\nstderr:\n{se}"
    );
    assert!(second.status.success(), "node 1: {}", second.stderr);
    assert!(
        so.contains("4 ranks") && so.contains("# Out of bounds values : 0 OK"),
        "{so}"
    );
    // Node 1's launcher runs ranks 2 and 3 (its output lines carry their numbers).
    assert!(
        !second.stdout.contains("[0]") && !second.stdout.contains("[1]"),
        "{}",
        second.stdout
    );

    // A host number out of range, and a multi-host job without a port, are usage errors.
    let out = common::proc::ferroccl(
        &[
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "-n",
            "1",
            "--",
            "true",
        ],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("--node-rank 2 is not below --nnodes 2"),
        "{}",
        out.stderr
    );
    let out = common::proc::ferroccl(
        &["launch", "--nnodes", "2", "-n", "1", "--", "true"],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--master-port"), "{}", out.stderr);
}

/// Runs `script` in a private mount namespace (`unshare -m`), where it may mount over
/// `/dev/shm` without touching the machine's; `None` when this machine cannot (no
/// root, no `unshare`), said on stderr.
fn in_mount_namespace(script: &str) -> Option<Output> {
    let probe = run(
        {
            let mut c = Command::new("unshare");
            c.args(["-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt && echo ok"]);
            c
        },
        Duration::from_secs(20),
    );
    if !probe.stdout.contains("ok") {
        eprintln!(
            "skipped: no private mount namespace here (needs root and unshare): {}",
            probe.stderr
        );
        return None;
    }
    let mut c = Command::new("unshare");
    c.args(["-m", "sh", "-c", script]);
    Some(run(c, Duration::from_secs(60)))
}

#[test]
fn an_unusable_dev_shm_falls_back_to_tcp_or_fails_typed_when_shm_is_asked_for() {
    let bench = format!("{EXE} bench --ranks 2 -b 256K -e 256K -n 2 -w 1");
    // Full (64 KiB of tmpfs cannot hold a 4 MiB ring), then read-only, then missing. `auto` links over TCP, checks its results, and each rank says why
    // once; `shm` fails naming the cause.
    for (setup, cause) in [
        ("mount -t tmpfs -o size=64k tmpfs /dev/shm", "No space left"),
        ("mount -t tmpfs -o ro tmpfs /dev/shm", "Read-only"),
        (
            // A /dev of its own with only what a process needs, and no shm.
            "d=/tmp/ferroccl-dev-$$ && mkdir -p $d && mount -t tmpfs tmpfs $d && \
             for f in null zero urandom random; do touch $d/$f && mount --bind /dev/$f $d/$f; done && \
             mount --move $d /dev && rmdir $d",
            "no /dev/shm",
        ),
    ] {
        let Some(out) = in_mount_namespace(&format!(
            "{setup} && {bench} && echo AUTO-OK; {bench} --transport shm; echo SHM-RC=$?"
        )) else {
            return;
        };
        let (so, se) = text(&out);
        let ctx = format!("{setup}\nstdout:\n{so}\nstderr:\n{se}");
        assert!(so.contains("AUTO-OK"), "auto failed: {ctx}");
        assert!(so.contains("# links of rank 0: tcp to 1"), "{ctx}");
        assert!(so.contains("# Out of bounds values : 0 OK"), "{ctx}");
        for r in 0..2 {
            let said = se
                .lines()
                .filter(|l| l.contains(&format!("rank {r}: shared memory is unusable here")))
                .collect::<Vec<_>>();
            assert_eq!(said.len(), 1, "rank {r} says it once: {ctx}");
            assert!(said[0].contains(cause), "{ctx}");
        }
        assert!(!so.contains("SHM-RC=0"), "shm must fail: {ctx}");
        assert!(
            se.contains("transport shm is not available: shared memory is unusable on this host")
                && se.contains(cause),
            "{ctx}"
        );
    }
}
