//! `tools/emulated-cluster`: its argument checks (always run, they touch nothing), and
//! `ferroccl bench --law 1gbit` on 2 and 3 hosts of a cluster shaped to 1 Gbit/s (the
//! counted bytes must be the ring law's; measured/predicted times are printed), on 2
//! hosts of 2 ranks (`run --ranks-per-host 2`: auto runs the hierarchical all-reduce,
//! whose bytes per link class must be its law's), and 3 hosts of 2 ranks started by
//! `ferroccl launch` with the hierarchical all-reduce forced. That one needs root, `ip` and
//! `tc`, and a kernel with network namespaces, veth, bridge and tbf; where any is missing
//! (the script exits 77) it says why on stderr and passes without asserting. It also
//! stands aside when an emulated cluster is already up, which someone else may be using.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/emulated-cluster");
const EXE: &str = env!("CARGO_BIN_EXE_ferroccl");

/// The script's exit status for missing rights, tools or kernel features.
const CANNOT: i32 = 77;

struct Out {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Out {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }
    fn dump(&self) -> String {
        format!(
            "status {:?}\nstdout:\n{}\nstderr:\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

fn reader(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Runs the script with `args` (and `env`) to completion. Past `deadline` it is sent
/// SIGTERM (it then stops its hosts), SIGKILL 10 s later, and, when `down_on_timeout`,
/// `down` removes whatever is left in the cluster's namespaces; then this panics.
fn script(args: &[&str], env: &[(&str, &str)], deadline: Duration, down_on_timeout: bool) -> Out {
    let mut cmd = Command::new(SCRIPT);
    cmd.args(args)
        .env_remove("FCCL_SUBNET")
        .env_remove("FCCL_SHAPE_INGRESS")
        .env_remove("FCCL_STATE_FILE")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {SCRIPT}: {e}"));
    let so = reader(child.stdout.take().expect("stdout"));
    let se = reader(child.stderr.take().expect("stderr"));
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        let waited = start.elapsed();
        if waited > deadline && !timed_out {
            timed_out = true;
            // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        if waited > deadline + Duration::from_secs(10) {
            let _ = child.kill();
            break child.wait().expect("wait");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if timed_out && down_on_timeout {
        let _ = Command::new(SCRIPT).arg("down").status();
    }
    let out = Out {
        status,
        stdout: so.join().expect("stdout reader"),
        stderr: se.join().expect("stderr reader"),
    };
    assert!(
        !timed_out,
        "`emulated-cluster {}` did not finish within {deadline:?}\n{}",
        args.join(" "),
        out.dump()
    );
    out
}

/// Arguments, environment, and what the refusal must say.
type Case = (
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn script_refuses_bad_arguments_with_usage() {
    let d = Duration::from_secs(60);
    let cases: &[Case] = &[
        (&[], &[], "no command given"),
        (
            &["up", "1", "1gbit"],
            &[],
            "N must be a whole number in 2..32",
        ),
        (
            &["up", "33", "1gbit"],
            &[],
            "N must be a whole number in 2..32",
        ),
        (&["up", "two", "1gbit"], &[], "N must be a whole number"),
        (&["up", "3", "fast"], &[], "is not a tc rate"),
        (&["up", "3", "1Gbit"], &[], "is not a tc rate"),
        (&["up", "3", "0mbit"], &[], "outside 1mbit..100gbit"),
        (&["up", "3"], &[], "up takes N and RATE"),
        (&["up", "3", "1gbit", "extra"], &[], "up takes N and RATE"),
        (
            &["up", "2", "1gbit"],
            &[("FCCL_SUBNET", "8.8.8.0/24")],
            "not inside a private range",
        ),
        (
            &["up", "2", "1gbit"],
            &[("FCCL_SUBNET", "10.1.2.3/24")],
            "host bits set",
        ),
        (
            &["up", "2", "1gbit"],
            &[("FCCL_SUBNET", "10.1.2.0/28")],
            "prefix must be",
        ),
        (
            &["up", "2", "1gbit"],
            &[("FCCL_SHAPE_INGRESS", "yes")],
            "FCCL_SHAPE_INGRESS",
        ),
        (&["run", "2", "true"], &[], "run needs --"),
        (&["run", "2", "--"], &[], "needs a command after --"),
        (
            &["run", "0", "--", "true"],
            &[],
            "N must be a whole number in 1..32",
        ),
        (
            &["run", "2", "--", "true"],
            &[("MASTER_PORT", "70000")],
            "MASTER_PORT",
        ),
        (
            &["run", "2", "--", "true"],
            &[("FCCL_RUN_TIMEOUT", "soon")],
            "FCCL_RUN_TIMEOUT",
        ),
        (
            &["run", "2", "--ranks-per-host", "0", "--", "true"],
            &[],
            "ranks per host must be a whole number in 1..64",
        ),
        (
            &["run", "2", "--", "true"],
            &[("FCCL_RANKS_PER_HOST", "many")],
            "ranks per host must be",
        ),
        (&["down", "now"], &[], "down takes no arguments"),
        (&["frobnicate"], &[], "unknown command"),
    ];
    for (args, env, why) in cases {
        let out = script(args, env, d, false);
        let ctx = format!(
            "`emulated-cluster {}` with {env:?}\n{}",
            args.join(" "),
            out.dump()
        );
        assert_eq!(out.code(), Some(2), "{ctx}");
        assert!(out.stderr.contains(why), "expected {why:?}: {ctx}");
        assert!(
            out.stderr.contains("usage: emulated-cluster up N RATE"),
            "{ctx}"
        );
    }
    let help = script(&["help"], &[], d, false);
    assert_eq!(help.code(), Some(0), "{}", help.dump());
    assert!(
        help.stdout.contains("run N [--ranks-per-host K] -- CMD"),
        "{}",
        help.dump()
    );
}

/// Takes the cluster down when dropped, also when the test panics.
struct Cluster;

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = script(&["down"], &[], Duration::from_secs(60), false);
        if out.code() != Some(0) {
            eprintln!("emulated-cluster down failed:\n{}", out.dump());
        }
    }
}

/// The columns of the rows `[host 0]` printed (rank 0 prints the table): the main table
/// when `law` is false, the ring-law table (lines starting `law`) when it is true.
fn host0_rows(stdout: &str, law: bool) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[host 0] "))
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter(|l| l.starts_with("law ") == law)
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// `ferroccl bench --law 1gbit` on `ranks` hosts of the cluster that is up, over sizes
/// `lo`..`hi` (doubling; each divisible by ranks × 4 so the ring's blocks are equal).
/// Asserts results, the counted payload bytes against the ring law (exact), and busbw
/// under the shaped link; prints (does not assert) measured/predicted times.
fn law_on_cluster(ranks: usize, lo: usize, hi: usize) {
    let d = Duration::from_secs(120);
    let (b, e) = (lo.to_string(), hi.to_string());
    let n = ranks.to_string();
    let out = script(
        &[
            "run", &n, "--", EXE, "bench", "-b", &b, "-e", &e, "-f", "2", "-n", "3", "-w", "1",
            "--law", "1gbit",
        ],
        &[("FCCL_RUN_TIMEOUT", "100")],
        d,
        true,
    );
    let ctx = out.dump();
    assert_eq!(out.code(), Some(0), "{ctx}");
    assert!(
        out.stdout
            .contains("[host 0] # Out of bounds values : 0 OK"),
        "{ctx}"
    );
    // Hosts are network namespaces: the default transport (auto) must not take them
    // for one host, so every link is TCP.
    assert!(
        out.stdout.contains("[host 0] # links of rank 0: tcp to 1")
            && !out.stdout.contains("shm to"),
        "{ctx}"
    );
    let sizes: Vec<usize> = std::iter::successors(Some(lo), |s| Some(s * 2))
        .take_while(|&s| s <= hi)
        .collect();
    let rows = host0_rows(&out.stdout, false);
    assert_eq!(rows.len(), sizes.len(), "{sizes:?}: {ctx}");
    // size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong | wire algo
    for (r, &size) in rows.iter().zip(&sizes) {
        assert_eq!(r.len(), 15, "{r:?}\n{ctx}");
        assert_eq!(r[0], size.to_string(), "{r:?}\n{ctx}");
        assert_eq!(
            (r[8].as_str(), r[12].as_str()),
            ("0", "0"),
            "#wrong in {r:?}\n{ctx}"
        );
        assert_eq!(r[14], "ring", "--law forces the ring: {r:?}\n{ctx}");
        assert_eq!(
            r[13], "1.000",
            "ring rows move exactly the ring law: {r:?}\n{ctx}"
        );
        // The links are shaped: 1 Gbit/s is 0.125 GB/s. Small sizes may ride the tbf
        // bucket (250 kB), so only the large ones are held to it (with 10% slack).
        if size >= 4 << 20 {
            for busbw in [&r[7], &r[11]] {
                let b: f64 = busbw.parse().expect("busbw");
                assert!(
                    b <= 0.1375,
                    "busbw {b} GB/s above the 1 Gbit/s link: {r:?}\n{ctx}"
                );
            }
        }
    }
    // law size payload law wire meas pred meas/pred
    let law = host0_rows(&out.stdout, true);
    assert_eq!(law.len(), sizes.len(), "{ctx}");
    for (r, &size) in law.iter().zip(&sizes) {
        assert_eq!(r.len(), 8, "{r:?}\n{ctx}");
        assert_eq!(r[1], size.to_string(), "{r:?}\n{ctx}");
        // 2(n-1)/n·S bytes per rank, counted by the links, to the byte.
        let want = 2 * (ranks - 1) * size / ranks;
        assert_eq!(r[2], want.to_string(), "payload bytes: {r:?}\n{ctx}");
        assert_eq!(r[3], want.to_string(), "law bytes: {r:?}\n{ctx}");
        assert_eq!(r[4], "1.000", "{r:?}\n{ctx}");
        eprintln!(
            "n={ranks} 1gbit size {size}: meas {} us, pred {} us, meas/pred {}",
            r[5], r[6], r[7]
        );
    }
    let fit = out
        .stdout
        .lines()
        .find(|l| l.starts_with("[host 0] # fit over"))
        .unwrap_or_else(|| panic!("no fit line: {ctx}"));
    eprintln!("n={ranks} 1gbit {fit}");
}

#[test]
fn bench_law_on_2_and_3_hosts_shaped_to_1gbit() {
    let d = Duration::from_secs(120);
    let status = script(&["status"], &[], d, false);
    match status.code() {
        Some(3) => {}
        Some(CANNOT) => {
            eprintln!(
                "skipped: emulated-cluster cannot run here:\n{}",
                status.stderr
            );
            return;
        }
        _ => {
            eprintln!(
                "skipped: an emulated cluster is already up (someone may be using it):\n{}",
                status.dump()
            );
            return;
        }
    }
    let _down = Cluster;
    let up = script(&["up", "3", "1gbit"], &[], d, true);
    if up.code() == Some(CANNOT) {
        eprintln!("skipped: emulated-cluster cannot run here:\n{}", up.stderr);
        return;
    }
    assert_eq!(up.code(), Some(0), "up 3 1gbit\n{}", up.dump());
    // n = 2: 1 MiB .. 8 MiB. n = 3: 768 KiB .. 6 MiB (divisible by 3 × 4).
    law_on_cluster(2, 1 << 20, 8 << 20);
    law_on_cluster(3, 768 << 10, 6 << 20);
    hier_law_on_2_hosts_of_2(d);
    launch_per_host(d);
}

/// `run 2 --ranks-per-host 2 -- ferroccl bench COLL --law 1gbit`: one job of 4 ranks,
/// two per host (shared memory within, TCP between); auto runs the hierarchical
/// all-reduce, reduce-scatter and all-gather, and the bytes each link class carried
/// are its law's to the byte: for the all-reduce 2·1/2·S per rank within a host and
/// 2·1/2·S per host between hosts, half of each for the others.
fn hier_law_on_2_hosts_of_2(d: Duration) {
    for (coll, between) in [
        ("all_reduce", 1.0),
        ("reduce_scatter", 0.5),
        ("all_gather", 0.5),
    ] {
        hier_law_of(d, coll, between);
    }
}

/// [`hier_law_on_2_hosts_of_2`] for `coll`, whose hosts send `between`·S each.
fn hier_law_of(d: Duration, coll: &str, between: f64) {
    let (lo, hi) = (1usize << 20, 8usize << 20);
    let out = script(
        &[
            "run",
            "2",
            "--ranks-per-host",
            "2",
            "--",
            EXE,
            "bench",
            coll,
            "-b",
            &lo.to_string(),
            "-e",
            &hi.to_string(),
            "-f",
            "2",
            "-n",
            "3",
            "-w",
            "1",
            "--law",
            "1gbit",
        ],
        &[("FCCL_RUN_TIMEOUT", "100")],
        d,
        true,
    );
    let ctx = out.dump();
    assert_eq!(out.code(), Some(0), "{ctx}");
    let rank0: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[host 0 rank 0] "))
        .collect();
    assert!(rank0.contains(&"# Out of bounds values : 0 OK"), "{ctx}");
    assert!(
        rank0.iter().any(|l| l.starts_with("# links of rank 0:")
            && l.contains("shm to 1")
            && l.contains("tcp to 2")),
        "{ctx}"
    );
    let rows = |prefix: &str| -> Vec<Vec<String>> {
        rank0
            .iter()
            .filter(|l| l.starts_with(prefix))
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .collect()
    };
    // hosts size algo within law wire between law wire
    let hosts = rows("hosts ");
    assert_eq!(hosts.len(), 4, "1, 2, 4, 8 MiB: {ctx}");
    for r in &hosts {
        assert_eq!(r[2], "hier", "{r:?}\n{ctx}");
        assert_eq!(
            (r[5].as_str(), r[8].as_str()),
            ("1.000", "1.000"),
            "{r:?}\n{ctx}"
        );
        let size: f64 = r[1].parse().expect("size");
        assert_eq!(
            r[6].parse::<f64>().ok(),
            Some(between * size),
            "{coll}: {between}·S per host between hosts: {r:?}
{ctx}"
        );
    }
    // law size payload law wire meas pred meas/pred: the per-host law.
    let law = rows("law ");
    assert_eq!(law.len(), 4, "{ctx}");
    for r in &law {
        assert_eq!(r[4], "1.000", "{r:?}\n{ctx}");
        eprintln!(
            "2 hosts x 2, hier {coll}, 1gbit size {}: meas {} us, pred {} us, meas/pred {}",
            r[1], r[5], r[6], r[7]
        );
    }
    assert!(
        out.stderr
            .contains("all 4 ranks on 2 hosts exited with status 0"),
        "{ctx}"
    );
}

/// `ferroccl launch --nnodes 3 --node-rank i` on each of 3 hosts, 2 ranks each: one job
/// of 6 ranks across the namespaces, rank 0's table from host 0, with the hierarchical
/// all-reduce forced (`--algo hier`).
fn launch_per_host(d: Duration) {
    let cmd = format!(
        "FERROCCL_TOKEN=one-job-three-hosts exec {EXE} launch --nnodes 3 --node-rank \"$RANK\" \
         --master-addr \"$MASTER_ADDR\" --master-port \"$MASTER_PORT\" -n 2 -- \
         {EXE} bench -b 64K -e 1M -f 16 -n 2 -w 1 --algo hier"
    );
    let out = script(
        &["run", "3", "--", "sh", "-c", &cmd],
        &[("FCCL_RUN_TIMEOUT", "100")],
        d,
        true,
    );
    let ctx = out.dump();
    assert_eq!(out.code(), Some(0), "{ctx}");
    assert!(
        out.stdout
            .contains("[host 0] [0] # ferroccl bench: all_reduce, 6 ranks"),
        "{ctx}"
    );
    assert!(
        out.stdout
            .contains("[host 0] [0] # Out of bounds values : 0 OK"),
        "{ctx}"
    );
    // Every row ran the hierarchical all-reduce, and checked out (#wrong 0, 0).
    let rows: Vec<Vec<&str>> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[host 0] [0] "))
        .filter(|l| !l.starts_with('#') && !l.starts_with("hosts ") && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "64 KiB and 1 MiB: {ctx}");
    for r in &rows {
        assert_eq!((r[8], r[12], r[14]), ("0", "0", "hier"), "{r:?}\n{ctx}");
    }
    assert!(
        out.stderr.contains("all 3 hosts exited with status 0"),
        "{ctx}"
    );
}
