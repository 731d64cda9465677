//! Two jobs given one `MASTER_PORT`, and rendezvous through torchrun's agent store (a
//! real PyTorch `TCPStore`, where this machine has PyTorch).
//!
//! Every test runs under a deadline; a hang fails in seconds.

use ferroccl::rendezvous::{StoreClient, StoreServer, TorchProtocol, TorchStore};
use ferroccl::{Communicator, Config, Error, ReduceOp};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|e| panic!("test body did not finish within {limit:?}: {e}"))
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    l.local_addr()
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"))
}

fn config(rank: usize, n: usize, addr: &str, job: Option<&str>) -> Config {
    let b = Config::builder(rank, n, addr)
        .timeout(Duration::from_secs(20))
        .connect_timeout(Duration::from_secs(20));
    let b = match job {
        Some(j) => b.job_id(j),
        None => b,
    };
    b.build().unwrap_or_else(|e| panic!("config: {e}"))
}

/// All-reduces `rank + 1` over a communicator and returns the sum it got.
fn sum_of_ranks(c: &Communicator) -> f32 {
    let mut v = vec![c.rank() as f32 + 1.0; 16];
    c.all_reduce(&mut v, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("rank {}: all_reduce: {e}", c.rank()));
    assert!(v.iter().all(|&x| x == v[0]), "elements differ: {v:?}");
    v[0]
}

#[test]
fn a_rank_of_another_job_is_refused_by_name_and_the_job_goes_on() {
    within(Duration::from_secs(60), || {
        let addr = format!("127.0.0.1:{}", free_port());
        let a0 = {
            let addr = addr.clone();
            std::thread::spawn(move || Communicator::init(config(0, 2, &addr, Some("job A"))))
        };
        // Job B's rank 1 reaches A's store first (it retries until the store is up).
        let intruder = Communicator::init(config(1, 2, &addr, Some("job B")));
        match intruder {
            Err(Error::OtherJob {
                theirs,
                ours,
                addr: at,
            }) => {
                assert_eq!((theirs.as_str(), ours.as_str()), ("job A", "job B"));
                assert_eq!(at, addr);
            }
            other => panic!("expected OtherJob, got {:?}", other.map(|_| ())),
        }
        // Job B's rank 0 finds the port taken, and asks who holds it.
        match Communicator::init(config(0, 2, &addr, Some("job B"))) {
            Err(e @ Error::OtherJob { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("another job (job A) is using the store at")
                        && msg.contains("job B"),
                    "{msg}"
                );
            }
            other => panic!("expected OtherJob, got {:?}", other.map(|_| ())),
        }
        // Job A lost nothing: its rank 1 joins and the job computes.
        let a1 = Communicator::init(config(1, 2, &addr, Some("job A")))
            .unwrap_or_else(|e| panic!("job A rank 1: {e}"));
        let a0 = a0
            .join()
            .unwrap_or_else(|_| panic!("rank 0 panicked"))
            .unwrap_or_else(|e| panic!("job A rank 0: {e}"));
        let t = std::thread::spawn(move || sum_of_ranks(&a0));
        assert_eq!(sum_of_ranks(&a1), 3.0);
        assert_eq!(t.join().ok(), Some(3.0));
    });
}

#[test]
fn without_identities_the_errors_say_another_job_may_hold_the_port() {
    within(Duration::from_secs(30), || {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2)
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = server.local_addr().to_string();
        let mut c = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
        c.join(1, 2).unwrap();
        let mut twin = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
        let msg = twin.join(1, 2).unwrap_err().to_string();
        assert!(
            msg.contains("joined twice") && msg.contains("another job"),
            "{msg}"
        );
        // A store without identity answers WHO with none; binding its port is AddrInUse.
        assert_eq!(c.who().ok(), Some(None));
        match StoreServer::bind(server.local_addr(), 2) {
            Err(e @ Error::AddrInUse { .. }) => {
                assert!(e.to_string().contains("another job"), "{e}")
            }
            other => panic!("expected AddrInUse, got {:?}", other.map(|_| ())),
        }
        // A named store says its name to anyone, even before the job token.
        let named = StoreServer::bind_job(
            "127.0.0.1:0".parse().unwrap(),
            2,
            Some(b"secret".to_vec()),
            Some("Slurm job 7 step 0".into()),
        )
        .unwrap();
        let mut stranger =
            StoreClient::connect(&named.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        assert_eq!(
            stranger.who().ok().flatten().as_deref(),
            Some("Slurm job 7 step 0")
        );
        // ...but nothing else.
        assert!(stranger.join(0, 2).is_err());
    });
}

/// A PyTorch `TCPStore` server in a Python child process.
struct TorchServer {
    child: Child,
    port: u16,
    version: String,
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a TCPStore server with `python`, or `None` when that Python has no torch.
fn torch_server(python: &str) -> Option<TorchServer> {
    let script = "import datetime, sys, time, torch, torch.distributed as d\n\
                  s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, \
                  timeout=datetime.timedelta(seconds=60))\n\
                  print(s.port, torch.__version__, flush=True)\n\
                  sys.stdin.read()\n";
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut line = String::new();
    let out = child.stdout.take()?;
    BufReader::new(out).read_line(&mut line).ok()?;
    let mut it = line.split_whitespace();
    let (Some(port), Some(version)) = (it.next().and_then(|p| p.parse().ok()), it.next()) else {
        let _ = child.kill();
        let _ = child.wait();
        return None;
    };
    Some(TorchServer {
        child,
        port,
        version: version.to_owned(),
    })
}

/// The Pythons to test against: Debian's python3-torch (PyTorch 1.13) at
/// `/usr/bin/python3`, plus any listed in `FERROCCL_TORCH_PYTHONS` (colon-separated).
/// Run once with PyTorch 2.15.0 from PyPI (`FERROCCL_TORCH_PYTHONS=/opt/torch2/bin/python`,
/// both the libuv and the classic server answer the probe alike). With
/// `FERROCCL_REQUIRE_TORCH=1` (CI, which installs python3-torch) a missing torch fails.
fn torch_servers() -> Vec<TorchServer> {
    let mut pythons = vec!["/usr/bin/python3".to_owned()];
    if let Ok(more) = std::env::var("FERROCCL_TORCH_PYTHONS") {
        pythons.extend(more.split(':').filter(|p| !p.is_empty()).map(str::to_owned));
    }
    let servers: Vec<TorchServer> = pythons.iter().filter_map(|p| torch_server(p)).collect();
    if servers.is_empty() {
        assert!(
            std::env::var("FERROCCL_REQUIRE_TORCH").as_deref() != Ok("1"),
            "FERROCCL_REQUIRE_TORCH=1 but none of {pythons:?} has PyTorch"
        );
        eprintln!("SKIPPED: no Python with PyTorch among {pythons:?}");
    }
    servers
}

#[test]
fn ranks_meet_through_torchruns_agent_store() {
    within(Duration::from_secs(120), || {
        for server in torch_servers() {
            let agent = format!("127.0.0.1:{}", server.port);
            let want = if server.version.starts_with("1.") {
                TorchProtocol::V1
            } else {
                TorchProtocol::V2
            };
            let probe = TorchStore::connect(&agent, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("torch {}: {e}", server.version));
            assert_eq!(probe.protocol(), want, "torch {}", server.version);
            // Two attempts of one torchrun job on the same agent store: a restarted
            // job must not read the store address of the attempt before it.
            for attempt in 0..2 {
                let n = 3;
                let job = format!("torchrun run t attempt {attempt}");
                let handles: Vec<_> = (0..n)
                    .map(|r| {
                        let (agent, job) = (agent.clone(), job.clone());
                        std::thread::spawn(move || {
                            let mut cfg = config(r, n, &agent, Some(&job));
                            cfg.job.agent_store = true;
                            let c =
                                Communicator::init(cfg).unwrap_or_else(|e| panic!("rank {r}: {e}"));
                            // ferroccl's store is its own, not the agent's port.
                            assert_ne!(c.config().job.master_addr, agent);
                            sum_of_ranks(&c)
                        })
                    })
                    .collect();
                for h in handles {
                    assert_eq!(h.join().ok(), Some(6.0), "torch {}", server.version);
                }
            }
            // The agent store still serves (the 1.13 probe left it intact).
            let mut after = TorchStore::connect(&agent, Duration::from_secs(10)).unwrap();
            after.set("after", b"ok").unwrap();
            assert_eq!(
                after
                    .wait_get("after", Duration::from_secs(10))
                    .ok()
                    .as_deref(),
                Some(&b"ok"[..])
            );
        }
    });
}

#[test]
fn a_rank_whose_rank_0_never_publishes_times_out_naming_the_agent_store() {
    within(Duration::from_secs(60), || {
        for server in torch_servers() {
            let agent = format!("127.0.0.1:{}", server.port);
            let mut cfg = config(1, 2, &agent, Some("torchrun run lonely attempt 0"));
            cfg.job.agent_store = true;
            // Long enough to reach the agent on a loaded machine; then the wait for the
            // key that never comes fails.
            cfg.tuning.connect_timeout = Duration::from_secs(2);
            let msg = match Communicator::init(cfg) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("joined a job whose rank 0 never came"),
            };
            assert!(
                msg.contains("agent store") && msg.contains("rank 0 did not publish"),
                "torch {}: {msg}",
                server.version
            );
        }
    });
}
