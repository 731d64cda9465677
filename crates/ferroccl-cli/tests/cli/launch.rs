//! End-to-end tests of `ferroccl launch`: the real binary starts real `sh` ranks.
//!
//! Every launcher run is watched: it is killed and the test fails if it has not exited
//! within [`DEADLINE`].

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const DEADLINE: Duration = Duration::from_secs(20);

struct Outcome {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    elapsed: Duration,
}

impl Outcome {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
    fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferroccl"));
    cmd.arg("launch")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Reads a pipe to its end on a thread; the result arrives on the returned channel.
fn collect(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    rx
}

/// Waits for a spawned launcher under the watchdog and collects its output.
fn finish(mut child: Child, started: Instant, what: &str) -> Outcome {
    let out = collect(child.stdout.take().unwrap());
    let err = collect(child.stderr.take().unwrap());
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`ferroccl launch {what}` still running after {DEADLINE:?}; killed it");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    let left = DEADLINE.saturating_sub(elapsed) + Duration::from_secs(1);
    let stdout = out
        .recv_timeout(left)
        .unwrap_or_else(|_| panic!("stdout of `ferroccl launch {what}` never closed"));
    let stderr = err
        .recv_timeout(left)
        .unwrap_or_else(|_| panic!("stderr of `ferroccl launch {what}` never closed"));
    Outcome {
        status,
        stdout,
        stderr,
        elapsed,
    }
}

fn run(cmd: &mut Command, what: &str) -> Outcome {
    let started = Instant::now();
    let child = cmd.spawn().unwrap();
    finish(child, started, what)
}

fn launch(args: &[&str]) -> Outcome {
    run(&mut launcher(args), &args.join(" "))
}

fn lines(s: &str) -> Vec<&str> {
    s.lines().collect()
}

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!(
        "ferroccl-launch-{name}-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The pids written as files `pid.*` into `dir`.
fn pids_in(dir: &Path) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name().to_string_lossy().starts_with("pid.") {
            let text = std::fs::read_to_string(entry.path()).unwrap();
            pids.push(text.trim().parse().unwrap());
        }
    }
    pids
}

/// True when `pid` no longer runs: gone, or a zombie waiting for a reaper that is not us
/// (this container's init may not reap orphans).
fn is_gone(pid: i32) -> bool {
    // SAFETY: signal 0 only asks whether the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

fn assert_all_gone(pids: &[i32]) {
    // The launcher has exited; allow a moment for the kernel to finish tearing down.
    let until = Instant::now() + Duration::from_secs(2);
    for &pid in pids {
        while !is_gone(pid) && Instant::now() < until {
            thread::sleep(Duration::from_millis(20));
        }
        assert!(is_gone(pid), "process {pid} of the job is still running");
    }
}

/// Waits until `dir` holds `n` pid files.
fn wait_for_pids(dir: &Path, n: usize) {
    let until = Instant::now() + DEADLINE;
    while pids_in(dir).len() < n {
        assert!(Instant::now() < until, "ranks never wrote their pid files");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ranks_get_the_torchrun_environment_and_prefixed_output() {
    let script = r#"echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK lws=$LOCAL_WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT launched=$FERROCCL_LAUNCHED"; echo "err-$RANK" >&2"#;
    for n in [1usize, 3] {
        let n_arg = n.to_string();
        let o = launch(&["-n", &n_arg, "--", "sh", "-c", script]);
        assert_eq!(o.code(), Some(0), "n={n}, stderr: {}", o.stderr());
        let stdout = o.stdout();
        let out = lines(&stdout);
        assert_eq!(out.len(), n, "one line per rank, got: {stdout:?}");
        let mut ports = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for line in &out {
            let (prefix, rest) = line.split_once(' ').unwrap();
            let rank: usize = prefix
                .strip_prefix('[')
                .and_then(|p| p.strip_suffix(']'))
                .unwrap_or_else(|| panic!("line without a rank prefix: {line:?}"))
                .parse()
                .unwrap();
            assert!(seen.insert(rank), "rank {rank} printed twice: {stdout:?}");
            let port = rest
                .split(' ')
                .find_map(|kv| kv.strip_prefix("port="))
                .unwrap();
            let port: u16 = port.parse().unwrap();
            assert_ne!(port, 0);
            ports.insert(port);
            assert_eq!(
                rest,
                format!(
                    "rank={rank} world={n} local={rank} lws={n} addr=127.0.0.1 port={port} launched=1"
                )
            );
        }
        assert_eq!(seen, (0..n).collect::<BTreeSet<_>>());
        assert_eq!(ports.len(), 1, "ranks disagree on MASTER_PORT: {stdout:?}");
        let stderr = o.stderr();
        let mut err: Vec<&str> = lines(&stderr);
        err.sort_unstable();
        let want: Vec<String> = (0..n).map(|r| format!("[{r}] err-{r}")).collect();
        assert_eq!(err, want, "stderr lines go to stderr with their prefix");
    }
}

#[test]
fn master_addr_and_port_flags_are_passed_through() {
    let o = launch(&[
        "-n",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "29555",
        "--",
        "sh",
        "-c",
        r#"echo "$MASTER_ADDR:$MASTER_PORT""#,
    ]);
    assert_eq!(o.code(), Some(0), "stderr: {}", o.stderr());
    let stdout = o.stdout();
    let mut out = lines(&stdout);
    out.sort_unstable();
    assert_eq!(out, ["[0] 10.1.2.3:29555", "[1] 10.1.2.3:29555"]);
}

#[test]
fn other_launchers_variables_are_removed() {
    let o = run(
        launcher(&[
            "-n",
            "1",
            "--",
            "sh",
            "-c",
            r#"echo "${OMPI_COMM_WORLD_RANK-unset} ${OMPI_COMM_WORLD_SIZE-unset} ${PMI_RANK-unset} ${PMI_SIZE-unset} ${SLURM_PROCID-unset} ${SLURM_NTASKS-unset} ${SLURM_LOCALID-unset} $KEEP_ME""#,
        ])
        .env("OMPI_COMM_WORLD_RANK", "5")
        .env("OMPI_COMM_WORLD_SIZE", "8")
        .env("PMI_RANK", "5")
        .env("PMI_SIZE", "8")
        .env("SLURM_PROCID", "5")
        .env("SLURM_NTASKS", "8")
        .env("SLURM_LOCALID", "1")
        .env("KEEP_ME", "kept"),
        "-n 1 (foreign launcher env)",
    );
    assert_eq!(o.code(), Some(0), "stderr: {}", o.stderr());
    assert_eq!(
        o.stdout(),
        "[0] unset unset unset unset unset unset unset kept\n"
    );
}

#[test]
fn failing_rank_stops_the_others_and_sets_the_exit_code() {
    let dir = temp_dir("fail");
    // Every rank records its shell's pid and its sleep's pid; rank 1 waits until all
    // four ranks are up, then fails. The others would sleep for a minute.
    let script = r#"
        sleep 60 &
        echo $! > "$DIR/tmp.sleep.$RANK" && mv "$DIR/tmp.sleep.$RANK" "$DIR/pid.sleep.$RANK"
        echo $$ > "$DIR/tmp.sh.$RANK" && mv "$DIR/tmp.sh.$RANK" "$DIR/pid.sh.$RANK"
        if [ "$RANK" = 1 ]; then
            while [ "$(ls "$DIR" | grep -c '^pid\.')" -lt 8 ]; do sleep 0.05; done
            echo "rank 1 giving up"
            exit 3
        fi
        wait
    "#;
    let o = run(
        launcher(&["-n", "4", "--", "sh", "-c", script]).env("DIR", &dir),
        "-n 4 (rank 1 exits 3)",
    );
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(3), "stderr: {stderr}");
    assert!(
        o.elapsed < Duration::from_secs(15),
        "took {:?}: the other ranks were not stopped promptly",
        o.elapsed
    );
    assert!(
        stderr.contains("ferroccl launch: rank 1 failed (exit status 3); stopped ranks 0, 2, 3"),
        "stderr: {stderr}"
    );
    assert!(o.stdout().contains("[1] rank 1 giving up\n"));
    let pids = pids_in(&dir);
    assert_eq!(pids.len(), 8, "every rank and its sleep wrote a pid");
    assert_all_gone(&pids);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rank_killed_by_a_signal_is_reported_as_a_signal() {
    let o = launch(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60"#,
    ]);
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(128 + 9), "stderr: {stderr}");
    assert!(
        stderr.contains("ferroccl launch: rank 0 failed (killed by signal 9 SIGKILL)"),
        "stderr: {stderr}"
    );
}

#[test]
fn late_failure_after_others_succeeded_names_no_stopped_ranks() {
    let o = launch(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 2 ]; then sleep 0.3; exit 4; fi"#,
    ]);
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(4), "stderr: {stderr}");
    assert!(
        stderr.contains("ferroccl launch: rank 2 failed (exit status 4)\n"),
        "no ranks were left to stop, so none are listed; stderr: {stderr}"
    );
}

#[test]
fn missing_command_is_named_and_exits_127() {
    let o = launch(&["-n", "2", "--", "ferroccl-no-such-command-xyz", "arg"]);
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(127), "stderr: {stderr}");
    assert!(
        stderr.contains("ferroccl-no-such-command-xyz"),
        "stderr: {stderr}"
    );
    assert!(o.stdout.is_empty());
}

#[test]
fn zero_ranks_is_an_error() {
    let o = launch(&["-n", "0", "--", "true"]);
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("at least 1 rank"), "stderr: {stderr}");
}

#[test]
fn partial_last_line_is_printed_with_its_prefix() {
    let o = launch(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        r#"printf 'first\nno-newline-%s' "$RANK"; printf 'err-no-newline-%s' "$RANK" >&2"#,
    ]);
    assert_eq!(o.code(), Some(0), "stderr: {}", o.stderr());
    let stdout = o.stdout();
    let mut out = lines(&stdout);
    out.sort_unstable();
    assert_eq!(
        out,
        [
            "[0] first",
            "[0] no-newline-0",
            "[1] first",
            "[1] no-newline-1"
        ]
    );
    assert!(stdout.ends_with('\n'));
    let stderr = o.stderr();
    let mut err = lines(&stderr);
    err.sort_unstable();
    assert_eq!(err, ["[0] err-no-newline-0", "[1] err-no-newline-1"]);
}

#[test]
fn non_utf8_output_passes_through() {
    let o = launch(&["-n", "1", "--", "sh", "-c", r"printf '\377\376x\n'"]);
    assert_eq!(o.code(), Some(0), "stderr: {}", o.stderr());
    assert_eq!(o.stdout, b"[0] \xff\xfex\n");
}

#[test]
fn lines_of_different_ranks_never_interleave() {
    let body = "abcdefghij".repeat(30);
    let script = format!(
        r#"i=0; while [ $i -lt 1000 ]; do echo "$RANK:{body}"; echo "$RANK:{body}" >&2; i=$((i+1)); done"#
    );
    let o = launch(&["-n", "4", "--", "sh", "-c", &script]);
    assert_eq!(o.code(), Some(0));
    for (name, text) in [("stdout", o.stdout()), ("stderr", o.stderr())] {
        let mut count = [0usize; 4];
        for line in text.lines() {
            let rank: usize = line[1..2].parse().unwrap();
            assert_eq!(
                line,
                format!("[{rank}] {rank}:{body}"),
                "mangled {name} line"
            );
            count[rank] += 1;
        }
        assert_eq!(count, [1000; 4], "{name} line counts per rank");
    }
}

#[test]
fn sigint_to_the_launcher_is_forwarded_to_the_ranks() {
    let dir = temp_dir("sigint");
    let script = r#"
        trap 'echo "rank $RANK got SIGINT"; exit 5' INT
        echo $$ > "$DIR/tmp.$RANK" && mv "$DIR/tmp.$RANK" "$DIR/pid.$RANK"
        sleep 60 & wait
    "#;
    let started = Instant::now();
    let child = launcher(&["-n", "2", "--", "sh", "-c", script])
        .env("DIR", &dir)
        .spawn()
        .unwrap();
    let launcher_pid = i32::try_from(child.id()).unwrap();
    wait_for_pids(&dir, 2);
    // SAFETY: signals the launcher this test started.
    assert_eq!(unsafe { libc::kill(launcher_pid, libc::SIGINT) }, 0);
    let o = finish(child, started, "-n 2 (SIGINT)");
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(128 + 2), "stderr: {stderr}");
    assert!(
        stderr.contains("ferroccl launch: interrupted by signal 2 SIGINT; stopped ranks 0, 1"),
        "stderr: {stderr}"
    );
    let stdout = o.stdout();
    assert!(
        stdout.contains("[0] rank 0 got SIGINT\n"),
        "stdout: {stdout}"
    );
    assert!(
        stdout.contains("[1] rank 1 got SIGINT\n"),
        "stdout: {stdout}"
    );
    assert_all_gone(&pids_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn launch_gives_every_rank_the_same_fresh_token() {
    let exe = env!("CARGO_BIN_EXE_ferroccl");
    let run = || {
        let mut child = std::process::Command::new(exe)
            .args([
                "launch",
                "-n",
                "2",
                "--",
                "sh",
                "-c",
                "echo TOKEN=$FERROCCL_TOKEN",
            ])
            .env_remove("FERROCCL_TOKEN")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Watchdog: a hung launcher fails the test in seconds instead of hanging it.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > end {
                let _ = child.kill();
                panic!("ferroccl launch did not finish within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let tokens: Vec<String> = text
            .lines()
            .filter_map(|l| l.split_once("TOKEN=").map(|(_, t)| t.to_owned()))
            .collect();
        assert_eq!(tokens.len(), 2, "{text}");
        assert_eq!(tokens[0], tokens[1], "same token on every rank");
        assert_eq!(tokens[0].len(), 64, "32 random bytes as hex: {}", tokens[0]);
        tokens[0].clone()
    };
    assert_ne!(run(), run(), "a fresh token per launch");
}

#[test]
fn a_failed_rank_restarts_the_whole_job_until_the_restarts_are_spent() {
    // Rank 1 fails in the first attempt only; the second attempt succeeds.
    let script = r#"if [ "$FERROCCL_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 3; fi
echo "ok rank=$RANK attempt=$FERROCCL_RESTART_COUNT job=$FERROCCL_JOB_ID port=$MASTER_PORT""#;
    let out = launch(&["-n", "2", "--max-restarts", "2", "--", "sh", "-c", script]);
    let (so, se) = (out.stdout(), out.stderr());
    assert_eq!(out.code(), Some(0), "stdout:\n{so}\nstderr:\n{se}");
    assert!(
        se.contains("rank 1 failed (exit status 3); restarting all 2 ranks (restart 1 of 2)"),
        "{se}"
    );
    // (Rank 0 of the first attempt may have finished before rank 1 failed.)
    let oks: Vec<&str> = lines(&so)
        .into_iter()
        .filter(|l| l.contains("ok rank=") && l.contains("attempt=1"))
        .collect();
    assert_eq!(oks.len(), 2, "each rank once in the second attempt: {so}");
    // Both ranks of the attempt share one job identity, which names the attempt.
    let field = |l: &str, k: &str| -> String {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k} in {l}"))
            .to_owned()
    };
    let jobs: BTreeSet<String> = oks.iter().map(|l| field(l, "job=")).collect();
    assert_eq!(jobs.len(), 1, "{so}");
    assert!(
        jobs.iter().all(|j| j.ends_with(".1") && j.len() > 2),
        "{jobs:?}"
    );

    // Always failing: the first attempt plus one restart, then the rank's own error.
    let out = launch(&[
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "[ \"$RANK\" = 0 ] || exit 5",
    ]);
    let se = out.stderr();
    assert_eq!(out.code(), Some(5), "{se}");
    assert_eq!(se.matches("restarting all 2 ranks").count(), 1, "{se}");
    assert!(
        se.contains("ferroccl launch: rank 1 failed (exit status 5)"),
        "{se}"
    );
}

#[test]
fn a_preempted_rank_restarts_the_job_and_is_named_so() {
    // Exit status 75 is ferroccl::ddp::PREEMPTED_EXIT_CODE: stopped after a checkpoint.
    let script = r#"[ "$FERROCCL_RESTART_COUNT" != 0 ] || exit 75"#;
    let out = launch(&["-n", "2", "--max-restarts", "1", "--", "sh", "-c", script]);
    let se = out.stderr();
    assert_eq!(out.code(), Some(0), "{se}");
    assert!(
        se.contains(
            "stopped for preemption, after its checkpoint (exit status 75); restarting all 2 ranks"
        ),
        "{se}"
    );
    // Without restarts left, the launcher exits 75 itself, for a requeueing wrapper.
    let out = launch(&["-n", "1", "--", "sh", "-c", "exit 75"]);
    assert_eq!(out.code(), Some(75), "{}", out.stderr());
}

/// A rank count this host cannot run is refused before anything starts, saying which
/// limit it breaks.
#[test]
fn a_rank_count_the_host_cannot_run_is_refused_up_front() {
    let o = launch(&["-n", "65536", "--", "true"]);
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("this host cannot run the job") && stderr.contains("CPUs"),
        "stderr: {stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(o.stdout.is_empty());
}

/// A script for ranks that record their pid, then sleep (as `exec`, so the pid is
/// the sleeping process's).
const SLEEPER: &str =
    r#"echo $$ > "$DIR/tmp.$RANK" && mv "$DIR/tmp.$RANK" "$DIR/pid.$RANK"; exec sleep 30"#;

/// SIGTERM while ranks are still being started: the start-up stops there, every rank
/// started is stopped and reaped, and the launcher exits 128 + 15 within a second or
/// two (it used to go on starting ranks and ignore the signal).
#[test]
fn sigterm_during_start_up_stops_everything_at_once() {
    let dir = temp_dir("term-start");
    let started = Instant::now();
    let child = launcher(&["-n", "60", "--", "sh", "-c", SLEEPER])
        .env("DIR", &dir)
        .spawn()
        .unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    // As soon as the first rank is up: the others are being started.
    wait_for_pids(&dir, 1);
    // SAFETY: signals the launcher this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let signalled = Instant::now();
    let o = finish(child, started, "-n 60 (SIGTERM while starting)");
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(128 + 15), "stderr: {stderr}");
    assert!(
        stderr.contains("interrupted by signal 15 SIGTERM"),
        "{stderr}"
    );
    // Generous for a loaded machine: the launcher polls every 10 ms, ranks die on
    // SIGTERM at once, and stragglers are killed after the 3 s grace period.
    assert!(
        signalled.elapsed() < Duration::from_secs(8),
        "took {:?} after SIGTERM",
        signalled.elapsed()
    );
    assert_all_gone(&pids_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank that fails while the others are still being started stops the start-up.
#[test]
fn a_failure_during_start_up_stops_the_start() {
    let dir = temp_dir("fail-start");
    let script = r#"if [ "$RANK" = 0 ]; then exit 4; fi
echo $$ > "$DIR/tmp.$RANK" && mv "$DIR/tmp.$RANK" "$DIR/pid.$RANK"; exec sleep 30"#;
    let o = run(
        launcher(&["-n", "60", "--", "sh", "-c", script]).env("DIR", &dir),
        "-n 60 (rank 0 exits 4 at once)",
    );
    let stderr = o.stderr();
    assert_eq!(o.code(), Some(4), "stderr: {stderr}");
    assert!(stderr.contains("rank 0 failed (exit status 4)"), "{stderr}");
    assert_all_gone(&pids_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// When one rank fails, the others' own last words (their errors) reach the output:
/// they get a moment to end on their own before being stopped, and the launcher
/// repeats every rank's last stderr line at the end.
#[test]
fn every_ranks_last_line_reaches_the_output() {
    let dir = temp_dir("last-words");
    // Rank 1 fails once all are up; the others notice (as ferroccl ranks notice a
    // failed peer) and say so on stderr before exiting; rank 2 says nothing and
    // sleeps, so it is stopped.
    let script = r#"
        echo $$ > "$DIR/tmp.$RANK" && mv "$DIR/tmp.$RANK" "$DIR/pid.$RANK"
        while [ "$(ls "$DIR" | grep -c '^pid\.')" -lt 4 ]; do sleep 0.02; done
        case "$RANK" in
        1) echo "progress line" >&2; echo "rank 1: the disk is full" >&2; touch "$DIR/failed"; exit 3 ;;
        2) exec sleep 30 ;;
        *) # Stopped before they noticed (a slow machine), they say it all the same.
           trap 'echo "rank $RANK: peer 1 failed first" >&2; exit 1' TERM
           while [ ! -e "$DIR/failed" ]; do sleep 0.02; done
           echo "rank $RANK: peer 1 failed first" >&2; exit 1 ;;
        esac
    "#;
    let o = run(
        launcher(&["-n", "4", "--", "sh", "-c", script]).env("DIR", &dir),
        "-n 4 (last words)",
    );
    let stderr = o.stderr();
    // Rank 1 fails first, but the others may end within the same look of the
    // launcher (every 10 ms), so the failure it names may be theirs: the exit code is
    // that rank's. What must hold is that every rank's own words are there.
    assert!(matches!(o.code(), Some(1 | 3)), "stderr: {stderr}");
    let summary = stderr
        .split_once("ferroccl launch: each rank's last line on stderr:\n")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no summary: {stderr}"));
    assert!(
        summary.contains("  [1] (exit status 3) rank 1: the disk is full\n"),
        "{summary}"
    );
    assert!(
        summary.contains("  [0] (exit status 1) rank 0: peer 1 failed first\n"),
        "{summary}"
    );
    assert!(
        summary.contains("  [3] (exit status 1) rank 3: peer 1 failed first\n"),
        "{summary}"
    );
    assert!(
        summary.contains("  [2] (killed by signal 15 SIGTERM) nothing on stderr\n"),
        "{summary}"
    );
    // Rank 2 never ends on its own: it is stopped (ranks 0 and 3 too, on a machine
    // too slow for them to notice within the launcher's 0.7 s).
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("failed (exit status")
            && last.contains("; stopped rank")
            && last
                .split("; stopped rank")
                .nth(1)
                .is_some_and(|l| l.contains('2')),
        "{stderr}"
    );
    assert_all_gone(&pids_in(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}
