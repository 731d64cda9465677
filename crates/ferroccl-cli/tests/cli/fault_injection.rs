//! Fault injection, deterministic and bounded in time: real rank processes running
//! `ferroccl bench`, one of which is killed (-9) or stalled at seeded points of every
//! collective; and a fake peer that completes the handshake and then lies. Every
//! surviving rank must fail with a typed error within the deadline; none may hang or
//! panic.

use crate::common;

use ferroccl::rendezvous::{StoreClient, StoreServer};
use ferroccl::testing::internals::{Hello, HEADER_LEN, PROTOCOL_VERSION};
use ferroccl::{Communicator, Error, ReduceOp};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::proc::EXE;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The transports the process fault tests run over, with their environment: TCP,
/// shared memory through the rings, shared memory with single copy (every payload of
/// 4 KiB or more pulled from the writer's memory), and symmetric memory (the default
/// on one host: every rank reads its peers' workspaces; one-shot and two-shot).
const TRANSPORTS: [(&str, &[(&str, &str)]); 4] = [
    ("tcp", &[]),
    (
        "shm",
        &[
            ("FERROCCL_SHM_SINGLE_COPY", "off"),
            ("FERROCCL_SHM_SYMMETRIC", "off"),
        ],
    ),
    (
        "shm",
        &[
            ("FERROCCL_SHM_SINGLE_COPY", "4K"),
            ("FERROCCL_SHM_SYMMETRIC", "off"),
        ],
    ),
    ("shm", &[]),
];

/// Names in `/dev/shm` made by any of `pids` (every segment this library makes names
/// its maker's pid: `ferroccl-<id>-<pid>-…`).
fn segments_of(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.starts_with("ferroccl-")
                        && pids
                            .iter()
                            .any(|p| n.split('-').nth(2) == Some(p.to_string().as_str()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Starts `n` ranks of `ferroccl bench ARGS` with the torchrun environment and the
/// extra variables `env`; rank 0's stdout is piped.
fn spawn_ranks_env(n: usize, args: &[&str], env: &[(&str, &str)]) -> Vec<Child> {
    spawn_ranks_printing(n, args, env, |r| r == 0)
}

/// [`spawn_ranks_env`], with the stdout of the ranks `piped` says piped.
fn spawn_ranks_printing(
    n: usize,
    args: &[&str],
    env: &[(&str, &str)],
    piped: impl Fn(usize) -> bool,
) -> Vec<Child> {
    let mut full = vec!["bench"];
    full.extend_from_slice(args);
    spawn_command(n, &full, env, piped)
}

/// Starts `n` ranks of `ferroccl ARGS` with the torchrun environment and the extra
/// variables `env`, with the stdout of the ranks `piped` says piped.
fn spawn_command(
    n: usize,
    args: &[&str],
    env: &[(&str, &str)],
    piped: impl Fn(usize) -> bool,
) -> Vec<Child> {
    let port = free_port().to_string();
    (0..n)
        .map(|r| {
            let mut c = Command::new(EXE);
            c.args(args);
            for v in common::proc::LAUNCHER_VARS {
                c.env_remove(v);
            }
            c.env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(env.iter().copied())
                .stdout(if piped(r) {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect()
}

/// Waits for `child` until `deadline`; kills it and returns None if it is still running.
fn finish(mut child: Child, deadline: Instant) -> Option<(i32, String)> {
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            return Some((st.code().unwrap_or(-1), err));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// The typed errors a survivor may report, as `ferroccl bench` prints them.
fn is_typed_failure(stderr: &str) -> bool {
    stderr.contains("ferroccl bench:")
        && [
            "closed during",
            "timed out",
            "poisoned",
            "protocol violation",
            "mismatched",
            "unreachable",
            "did not publish",
            "handshake",
            "rendezvous:",
            "failed during",
        ]
        .iter()
        .any(|k| stderr.contains(k))
}

/// Whether a survivor's error names `victim` as where the failure started: it lost the
/// connection to it, or a neighbour's notice says so, or (killed before it joined) the
/// rendezvous or a timeout names it, or (killed while the links were being made) the
/// handshake with it failed.
fn names_the_victim(stderr: &str, victim: usize) -> bool {
    [
        format!("handshake with rank {victim} at"),
        format!("connection to rank {victim} closed"),
        format!("rank {victim} failed first"),
        format!("rank {victim} lost"),
        format!("rank {victim} did not"),
        format!("rank {victim} unreachable"),
        format!("rank {victim} has not"),
        format!("link to rank {victim} failed"),
    ]
    .iter()
    .any(|k| stderr.contains(k.as_str()))
}

/// 5 collectives × 4 kill points, and 2 in each of all-to-all, gather, scatter and
/// sendrecv: 28 injections of `kill -9` into a 3-rank job, over
/// TCP, over shared memory (where the killed rank's rings stay mapped and only its
/// TCP connection's end tells the others), and over shared memory with single copy
/// (where a survivor may be reading the killed rank's memory when it dies).
#[test]
fn kill_minus_nine_at_random_points_of_every_collective() {
    for (transport, env) in TRANSPORTS {
        kill_minus_nine(transport, env);
    }
}

fn kill_minus_nine(transport: &str, env: &[(&str, &str)]) {
    let mut seed = 0x5eed_u64;
    let mut injections = 0;
    // Four kills in each collective, two in the direct exchanges (which take the
    // rings on symmetric memory too: a kill there is one in the rings' path).
    for (coll, kills, min) in [
        ("all_reduce", 4, "4K"),
        // Small all-reduces only: one-shot from symmetric memory's slots (where a
        // survivor waits on the killed rank's stamp).
        ("all_reduce", 2, "1K"),
        ("reduce_scatter", 4, "4K"),
        ("all_gather", 4, "4K"),
        ("broadcast", 4, "4K"),
        ("reduce", 4, "4K"),
        ("all_to_all", 2, "4K"),
        ("gather", 2, "4K"),
        ("scatter", 2, "4K"),
        // Point-to-point batches, served on the caller's thread while its engine is
        // free: a kill there is one in that path.
        ("sendrecv", 2, "4K"),
    ] {
        let max = if min == "1K" { "2K" } else { "4M" };
        for k in 0..kills {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let delay = Duration::from_millis(150 + (seed >> 33) % 600);
            let victim = ((seed >> 20) % 3) as usize;
            // Long enough that the kill lands mid-run however fast the machine: more
            // iterations than any run gets through before its kill (400 were not, once
            // all-gather took the rings on symmetric memory), sizes up to 4 MiB.
            let mut ranks = spawn_ranks_env(
                3,
                &[
                    coll,
                    "-b",
                    min,
                    "-e",
                    max,
                    "-f",
                    "4",
                    "-n",
                    "100000",
                    "-w",
                    "1",
                    "-c",
                    "0",
                    "--timeout",
                    "5",
                    "--connect-timeout",
                    "10",
                    "--transport",
                    transport,
                ],
                env,
            );
            let pids: Vec<u32> = ranks.iter().map(Child::id).collect();
            std::thread::sleep(delay);
            signal(&ranks[victim], libc::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(20);
            let victim_child = ranks.remove(victim);
            let _ = finish(victim_child, deadline);
            for (i, child) in ranks.into_iter().enumerate() {
                let rank = if i >= victim { i + 1 } else { i };
                let ctx = format!(
                    "{transport} {env:?}: {coll} injection {k}: rank {victim} killed after {delay:?}; rank {rank}"
                );
                let (code, err) = finish(child, deadline).unwrap_or_else(|| panic!("{ctx} hung"));
                assert!(!err.contains("panicked"), "{ctx} panicked: {err}");
                assert_ne!(code, 0, "{ctx} exited 0 although a peer died: {err}");
                assert!(
                    is_typed_failure(&err),
                    "{ctx}: no typed error on stderr: {err}"
                );
                assert!(
                    names_the_victim(&err, victim),
                    "{ctx}: the error does not name rank {victim}: {err}"
                );
            }
            // Whatever the ranks made in /dev/shm went with them: a rank removes its
            // names once its peers have mapped them, before any collective.
            let left = segments_of(&pids);
            assert!(
                left.is_empty(),
                "{transport} {env:?}: {coll} injection {k}: left in /dev/shm: {left:?}"
            );
            injections += 1;
        }
    }
    assert_eq!(injections, 30);
}

/// A stalled rank (SIGSTOP): the others time out, and say the stalled rank does not
/// answer; nobody hangs past the deadline. Over TCP and over shared memory (where a
/// stopped peer closes nothing, and no wait on its ring may sleep past the timeout),
/// with and without single copy (where a writer waits for its stopped reader to pull).
///
/// Whichever rank is stalled — rank 0 holds the store, so a survivor cannot look up
/// addresses it does not know yet — every survivor names only it: a live rank is
/// never called unreachable or silent.
#[test]
fn a_stalled_rank_is_named_by_the_timeout() {
    for (transport, env) in TRANSPORTS {
        stalled_rank(transport, env, 1);
    }
    for victim in [0, 2] {
        stalled_rank("tcp", &[], victim);
    }
}

fn stalled_rank(transport: &str, env: &[(&str, &str)], victim: usize) {
    let mut ranks = spawn_ranks_env(
        3,
        &[
            "all_reduce",
            "-b",
            "64K",
            "-e",
            "1M",
            "-n",
            "2000",
            "-w",
            "1",
            "-c",
            "0",
            "--timeout",
            "1",
            "--transport",
            transport,
        ],
        env,
    );
    std::thread::sleep(Duration::from_millis(400));
    signal(&ranks[victim], libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(20);
    let stalled = ranks.remove(victim);
    for (i, child) in ranks.into_iter().enumerate() {
        let rank = if i >= victim { i + 1 } else { i };
        let transport = format!("{transport} {env:?}, rank {victim} stopped");
        let (code, err) =
            finish(child, deadline).unwrap_or_else(|| panic!("{transport}: rank {rank} hung"));
        assert_ne!(code, 0, "{transport}");
        assert!(!err.contains("panicked"), "{transport}: {err}");
        assert!(is_typed_failure(&err), "{transport}: rank {rank}: {err}");
        // The stalled rank's acceptor is stopped too: the status query gets no answer
        // (or, for the store's rank, no address to ask at).
        assert!(
            err.contains("timed out")
                && (err.contains(&format!("rank {victim} did not answer"))
                    || err.contains("the job's store did not answer")
                    || err.contains(&format!("from rank {victim}"))),
            "{transport}: rank {rank}: {err}"
        );
        // Nobody calls a live rank unreachable. (Whether a live rank answers within
        // the probe's 500 ms depends on the machine's load: tools/stall-check
        // measures that on a quiet one.)
        assert!(
            !err.contains("unreachable"),
            "{transport}: rank {rank}: {err}"
        );
    }
    signal(&stalled, libc::SIGKILL);
    let _ = finish(stalled, Instant::now() + Duration::from_secs(5));
}

/// A fake rank 1 that completes the handshake with rank 0, reads rank 0's first
/// frame header, and then misbehaves with `act`. Returns rank 0's error.
fn lying_peer(act: fn(&mut std::net::TcpStream)) -> Error {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let mut client =
        StoreClient::connect(&store.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    let comm_id = client.join(1, 2).unwrap();
    // Rank 0 waits for every rank's host before it links.
    client.set("host/1", b"the fake rank's host").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    client
        .set(
            "addr/1",
            listener.local_addr().unwrap().to_string().as_bytes(),
        )
        .unwrap();
    let fake = std::thread::spawn(move || {
        let mut s = common::accept_within(&listener, Duration::from_secs(20));
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 40];
        s.read_exact(&mut b).unwrap();
        let h = Hello::decode(&b).unwrap();
        let reply = Hello {
            version: PROTOCOL_VERSION,
            status: 0,
            comm_id,
            rank: 1,
            world_size: 2,
            to_rank: 0,
            channel: h.channel,
            flags: 0,
            group: h.group,
        };
        s.write_all(&reply.encode()).unwrap();
        let mut hdr = [0u8; HEADER_LEN];
        let _ = s.read_exact(&mut hdr);
        act(&mut s);
        // Keep the socket open a while so only the act itself is the fault.
        std::thread::sleep(Duration::from_millis(300));
    });
    let mut cfg = ferroccl::Config::new(0, 2, store.local_addr().to_string());
    cfg.job.serve_store = false;
    cfg.tuning.timeout = Duration::from_secs(3);
    // The fake rank 1 speaks TCP (`auto` would wait for it to say which host it is on).
    cfg.transport.kind = ferroccl::TransportKind::Tcp;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = Communicator::init(cfg)
            .and_then(|c| c.all_reduce(&mut vec![1.0f32; 1 << 18], ReduceOp::Sum));
        let _ = tx.send(r);
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("rank 0 returned within the deadline");
    let _ = fake.join();
    r.expect_err("rank 0 must fail")
}

#[test]
fn a_peer_that_sends_garbage_is_a_protocol_error() {
    let e = lying_peer(|s| {
        let _ = s.write_all(&[0x5a; 4096]);
    });
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    assert!(e.to_string().contains("magic"), "{e}");
}

#[test]
fn a_short_frame_then_close_is_a_closed_peer() {
    let e = lying_peer(|s| {
        let _ = s.write_all(b"FCCD\x01\x00");
        let _ = s.shutdown(std::net::Shutdown::Both);
    });
    assert!(matches!(e, Error::PeerClosed { peer: 1, .. }), "{e}");
}

#[test]
fn a_socket_closed_mid_payload_is_a_closed_peer() {
    let e = lying_peer(|s| {
        // A well-formed header for a big frame, half its payload, then hang up.
        let mut hdr = ferroccl::testing::internals::FrameHeader {
            fp: ferroccl::testing::internals::Fingerprint {
                kind: ferroccl::testing::internals::OpKind::AllReduce,
                seq: 0,
                dtype: ferroccl::DataType::F32,
                op: Some(ReduceOp::Sum),
                count: 1 << 18,
                root: None,
                algo: ferroccl::Algorithm::Ring,
                comm: 0,
            },
            step: 0,
            seg: 0,
            len: 1 << 19,
        }
        .encode();
        hdr[0..4].copy_from_slice(b"FCCD");
        let _ = s.write_all(&hdr);
        let _ = s.write_all(&vec![0u8; 1 << 18]);
        let _ = s.shutdown(std::net::Shutdown::Both);
    });
    // The header says the call rank 0 made, with twice the bytes rank 0 expects in
    // that segment: the same call split otherwise (a mismatch naming both lengths), or
    // the hang-up seen first.
    assert!(
        matches!(
            e,
            Error::PeerClosed { peer: 1, .. } | Error::Protocol { .. } | Error::Mismatch { .. }
        ),
        "{e}"
    );
    if let Error::Mismatch { .. } = e {
        let t = e.to_string();
        assert!(
            t.contains("262144 bytes") && t.contains("524288 bytes"),
            "{t}"
        );
    }
}

/// The store dies during rendezvous: a rank still looking for its peers fails with a
/// typed error within its connect timeout.
#[test]
fn the_store_dying_during_rendezvous_is_a_typed_error() {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 3).unwrap();
    let addr = store.local_addr().to_string();
    let (tx, rx) = mpsc::channel();
    // Rank 1 joins and waits for rank 2's address, which never comes.
    let mut cfg = ferroccl::Config::new(1, 3, addr);
    cfg.job.serve_store = false;
    cfg.tuning.connect_timeout = Duration::from_secs(4);
    std::thread::spawn(move || {
        let _ = tx.send(Communicator::init(cfg).map(|_| ()));
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(store);
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("returned within the deadline");
    let e = r.expect_err("rendezvous cannot succeed without the store");
    assert!(
        matches!(
            e,
            Error::Rendezvous(_) | Error::StoreUnreachable { .. } | Error::Handshake { .. }
        ),
        "{e}"
    );
}

/// Waits (at most 30 s, else the test fails) until rank 0 prints its bench header:
/// its communicator exists, so the job is running and SIGUSR1 has its handler.
fn wait_until_running(rank0: &mut Child) {
    wait_for_line(rank0, |l| l.contains("# ferroccl bench"));
}

/// Waits (at most 30 s, else the test fails) for a line of rank 0's stdout that
/// `matches`. The stdout keeps being drained afterwards so the rank never blocks on a
/// full pipe.
fn wait_for_line(rank0: &mut Child, matches: fn(&str) -> bool) {
    let out = rank0.stdout.take().expect("rank 0's stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(out);
        let mut line = String::new();
        let mut told = false;
        while std::io::BufRead::read_line(&mut r, &mut line).unwrap_or(0) > 0 {
            if !told && matches(&line) {
                let _ = tx.send(());
                told = true;
            }
            line.clear();
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("rank 0 printed the awaited line within 30 s");
}

/// A fresh directory for trace files.
fn trace_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-cli-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// With `FERROCCL_TRACE_DIR` set, a rank killed mid-job leaves every survivor's flight
/// recorder on disk, and each survivor's last operation failed naming the killed rank.
#[test]
fn survivors_dump_their_flight_recorder_naming_the_killed_rank() {
    let dir = trace_dir("kill");
    let d = dir.to_string_lossy().into_owned();
    let mut ranks = spawn_ranks_env(
        3,
        &[
            "all_reduce",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "64",
            "-n",
            "100000",
            "-w",
            "1",
            "-c",
            "0",
            "--timeout",
            "10",
        ],
        &[("FERROCCL_TRACE_DIR", &d)],
    );
    // Killed once the 1 KiB row is out: the ranks have recorded operations and are in
    // the 64 KiB ones (an event, not a sleep).
    wait_for_line(&mut ranks[0], |l| !l.starts_with('#') && l.contains("1024"));
    signal(&ranks[1], libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    let victim = ranks.remove(1);
    let _ = finish(victim, deadline);
    for child in ranks {
        let (code, err) = finish(child, deadline).expect("survivor finished");
        assert_ne!(code, 0, "{err}");
    }
    for r in [0, 2] {
        let t = ferroccl::trace::read_file(&dir.join(format!("rank-{r}.jsonl")))
            .unwrap_or_else(|e| panic!("rank {r} left no trace: {e}"));
        let last = t.ops.last().expect("operations recorded");
        assert!(!last.ok(), "rank {r}: {last:?}");
        assert!(
            names_the_victim(&last.outcome, 1),
            "rank {r}: {}",
            last.outcome
        );
        assert!(
            t.ops.len() > 1,
            "rank {r} recorded the operations before the failure"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGUSR1 dumps a running rank's flight recorder without stopping it.
#[test]
fn sigusr1_dumps_a_running_rank() {
    let dir = trace_dir("usr1");
    let d = dir.to_string_lossy().into_owned();
    let mut ranks = spawn_ranks_env(
        2,
        &[
            "all_reduce",
            "-b",
            "1K",
            "-e",
            "1K",
            "-n",
            "5000000",
            "-w",
            "1",
            "-c",
            "0",
        ],
        &[("FERROCCL_TRACE_DIR", &d)],
    );
    wait_until_running(&mut ranks[0]);
    let file = dir.join("rank-0.jsonl");
    let deadline = Instant::now() + Duration::from_secs(20);
    // The handler is installed before the header is printed; signal until the dump
    // has landed (the first signal normally suffices).
    while !file.exists() && Instant::now() < deadline {
        signal(&ranks[0], libc::SIGUSR1);
        std::thread::sleep(Duration::from_millis(200));
    }
    let t = ferroccl::trace::read_file(&file).expect("a dump on SIGUSR1");
    assert_eq!(t.info.reason, "signal");
    assert_eq!(t.info.rank, 0);
    // Still running: the signal did not stop it.
    assert!(
        ranks[0].try_wait().expect("try_wait").is_none(),
        "SIGUSR1 ended rank 0"
    );
    for c in &ranks {
        signal(c, libc::SIGKILL);
    }
    for c in ranks {
        let _ = finish(c, Instant::now() + Duration::from_secs(10));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rank `r`'s stdout lines as they come, each with when it came.
fn lines_of(child: &mut Child) -> mpsc::Receiver<(Instant, String)> {
    let out = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(out);
        let mut line = String::new();
        while std::io::BufRead::read_line(&mut r, &mut line).unwrap_or(0) > 0 {
            let _ = tx.send((Instant::now(), line.clone()));
            line.clear();
        }
    });
    rx
}

/// Whether a bench output line is a data row.
fn is_row(l: &str) -> bool {
    !l.starts_with('#') && l.split_whitespace().count() > 10
}

/// A rank killed (-9) in one half of a split: the other rank of that half fails
/// within the timeout with an error naming it by its job rank; the other half goes on
/// and finishes its table (rows of at least 100 all-reduces each after the kill), and
/// exits 0: a dead rank poisons the communicators it belongs to, and only those.
#[test]
fn a_rank_killed_in_one_half_of_a_split_fails_that_half_only() {
    for (transport, env) in TRANSPORTS.into_iter().take(2) {
        let args = [
            "all_reduce",
            "--split",
            "2",
            "-b",
            "16K",
            "-e",
            "1M",
            "-f",
            "4",
            "-n",
            "50",
            "-w",
            "1",
            "--timeout",
            "20",
            "--transport",
            transport,
        ];
        // Each half's first rank (job ranks 0 and 2) prints its table.
        let mut ranks = spawn_ranks_printing(4, &args, env, |r| r % 2 == 0);
        let (out0, out2) = (lines_of(&mut ranks[0]), lines_of(&mut ranks[2]));
        // Once the second half has printed its first row, kill its second rank.
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (_, l) = out2
                .recv_timeout(end.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("{transport}: job rank 2 printed no row in 60 s"));
            if is_row(&l) {
                break;
            }
        }
        signal(&ranks[3], libc::SIGKILL);
        let killed = Instant::now();
        let victim = ranks.remove(3);
        let deadline = Instant::now() + Duration::from_secs(60);
        let done: Vec<Option<(i32, String)>> =
            ranks.into_iter().map(|c| finish(c, deadline)).collect();
        let _ = finish(victim, deadline);
        // The second half: its survivor names the dead rank by its job rank, in time.
        let (code, err) = done[2].clone().expect("job rank 2 finished");
        assert_ne!(code, 0, "{transport}: job rank 2 went on: {err}");
        assert!(is_typed_failure(&err), "{transport}: {err}");
        assert!(err.contains("is job rank 3"), "{transport}: {err}");
        assert!(!err.contains("panicked"), "{transport}: {err}");
        // The first half: done, all right, with rows finished after the kill.
        for (r, d) in done.iter().enumerate().take(2) {
            let (code, err) = d.clone().expect("finished");
            assert_eq!(code, 0, "{transport}: job rank {r} failed: {err}");
        }
        let lines: Vec<(Instant, String)> = out0.try_iter().collect();
        let rows_after = lines
            .iter()
            .filter(|(t, l)| is_row(l) && *t > killed)
            .count();
        assert!(
            lines
                .iter()
                .any(|(_, l)| l.contains("# Out of bounds values : 0 OK")),
            "{transport}: {lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|(_, l)| l.contains("# group 0 of 2: job ranks [0, 1]")),
            "{transport}: {lines:?}"
        );
        assert!(
            rows_after >= 1,
            "{transport}: no row after the kill: {lines:?}"
        );
    }
}

/// A parameter-server job (`train --mode ssp`) of 3 ranks, each a worker and a shard's
/// server, with a straggler; the server of shard 1 is killed (-9) once training runs.
/// Every survivor fails within the deadline, and its error names rank 1.
#[test]
fn a_killed_parameter_server_is_named_by_every_worker() {
    for s in ["0", "2", "inf"] {
        let args = [
            "train",
            "--mode",
            "ssp",
            "--staleness",
            s,
            "--synthetic",
            "600",
            "--epochs",
            "1000",
            "-b",
            "12",
            "--slow-rank",
            "2",
            "--slow-factor",
            "2",
            "--timeout",
            "10",
        ];
        let mut ranks = spawn_command(3, &args, &[("RAYON_NUM_THREADS", "1")], |r| r == 0);
        wait_for_line(&mut ranks[0], |l| {
            l.starts_with("parameter server: training")
        });
        // Let a few steps go by (their count does not matter: a kill at any point must
        // be named).
        std::thread::sleep(Duration::from_millis(500));
        signal(&ranks[1], libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(45);
        for (r, child) in ranks.into_iter().enumerate() {
            let got = finish(child, deadline);
            if r == 1 {
                continue;
            }
            let (code, err) = got.unwrap_or_else(|| panic!("staleness {s}: rank {r} hung"));
            assert_ne!(code, 0, "staleness {s}: rank {r} succeeded: {err}");
            assert!(
                err.contains("ferroccl train:") && names_the_victim(&err, 1),
                "staleness {s}: rank {r} does not name rank 1: {err}"
            );
        }
    }
}
