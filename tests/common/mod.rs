//! The one rank-spawning harness: N ranks as threads over the in-process transport or
//! over loopback TCP. It never hangs (every run has a deadline) and reports the first
//! rank's error, in the order errors happened.
#![allow(dead_code)]

use ferroccl::rendezvous::StoreServer;
use ferroccl::{Communicator, Config};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the ranks are linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// In-process pipes.
    Local,
    /// Loopback TCP with a real rendezvous store.
    Tcp,
}

/// A config suited to tests: short timeouts so a hang fails in seconds.
pub fn test_config() -> Config {
    let mut c = Config::new(0, 1, "127.0.0.1:0");
    c.timeout = Duration::from_secs(10);
    c.connect_timeout = Duration::from_secs(10);
    c
}

/// What went wrong in a run: the first rank to fail and its error, or a hang.
#[derive(Debug)]
pub struct RunError {
    pub rank: Option<usize>,
    pub message: String,
    pub error: Option<ferroccl::Error>,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(r) => write!(f, "rank {r}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Runs `body` on `n` ranks linked by `net`, each rank in its own thread, and returns
/// every rank's result in rank order. Fails with the first error (by time) or when the
/// deadline passes.
pub fn run<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> Result<Vec<R>, RunError>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> ferroccl::Result<R> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel::<(usize, ferroccl::Result<R>)>();
    // Keep the store alive for the whole run.
    let mut _store: Option<StoreServer> = None;
    match net {
        Net::Local => {
            let comms = Communicator::local_group(n, base).map_err(|e| RunError {
                rank: None,
                message: e.to_string(),
                error: Some(e),
            })?;
            for mut c in comms {
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let r = body(&mut c);
                    let _ = tx.send((c.rank(), r));
                });
            }
        }
        Net::Tcp => {
            let store =
                StoreServer::bind("127.0.0.1:0".parse().unwrap(), n).map_err(|e| RunError {
                    rank: None,
                    message: e.to_string(),
                    error: Some(e),
                })?;
            let addr = store.local_addr().to_string();
            _store = Some(store);
            for r in 0..n {
                let mut cfg = base.clone();
                cfg.rank = r;
                cfg.local_rank = r;
                cfg.world_size = n;
                cfg.master_addr = addr.clone();
                cfg.serve_store = false;
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let r2 = Communicator::init(cfg).and_then(|mut c| body(&mut c));
                    let _ = tx.send((r, r2));
                });
            }
        }
    }
    drop(tx);
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let mut done = 0;
    while done < n {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((r, Ok(v))) => {
                out[r] = Some(v);
                done += 1;
            }
            Ok((r, Err(e))) => {
                return Err(RunError {
                    rank: Some(r),
                    message: e.to_string(),
                    error: Some(e),
                })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let pending: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                return Err(RunError {
                    rank: None,
                    message: format!(
                        "deadline of {deadline:?} passed; ranks {pending:?} still running"
                    ),
                    error: None,
                });
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let pending: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                return Err(RunError {
                    rank: None,
                    message: format!("ranks {pending:?} panicked"),
                    error: None,
                });
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect())
}

/// Like [`run`] but collects every rank's outcome, errors included, waiting until
/// all have reported or the deadline passes (for tests where all ranks must fail).
pub fn run_all<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> Vec<Option<ferroccl::Result<R>>>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> ferroccl::Result<R> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel::<(usize, ferroccl::Result<R>)>();
    let mut _store: Option<StoreServer> = None;
    match net {
        Net::Local => {
            for mut c in Communicator::local_group(n, base).expect("local group") {
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let r = body(&mut c);
                    let _ = tx.send((c.rank(), r));
                });
            }
        }
        Net::Tcp => {
            let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), n).expect("store");
            let addr = store.local_addr().to_string();
            _store = Some(store);
            for r in 0..n {
                let mut cfg = base.clone();
                cfg.rank = r;
                cfg.world_size = n;
                cfg.master_addr = addr.clone();
                cfg.serve_store = false;
                let (tx, body) = (tx.clone(), body.clone());
                std::thread::spawn(move || {
                    let r2 = Communicator::init(cfg).and_then(|mut c| body(&mut c));
                    let _ = tx.send((r, r2));
                });
            }
        }
    }
    drop(tx);
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<ferroccl::Result<R>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((r, v)) => out[r] = Some(v),
            Err(_) => break,
        }
    }
    out
}
