//! `ferroccl launch -n N -- CMD ARGS`: N local ranks with the launcher environment.
//!
//! Each rank gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) plus `FERROCCL_LAUNCHED=1` and a
//! job token `FERROCCL_TOKEN` and a job identity `FERROCCL_JOB_ID` (each generated
//! unless already set), so
//! `ferroccl::rendezvous::detect_env` finds it exactly as under torchrun. Variables of
//! other launchers are removed so that a `ferroccl launch` inside an `srun` or `mpirun`
//! allocation is not mistaken for the outer job.
//!
//! Output of rank `i` is forwarded line by line with a `[i] ` prefix (stdout to stdout,
//! stderr to stderr). When one rank fails the others are stopped: SIGTERM to its process
//! group, SIGKILL after a grace period. SIGINT and SIGTERM sent to the launcher are
//! forwarded to every rank the same way. With `FERROCCL_TRACE_DIR` set, the ranks still
//! running are first asked for their flight recorders (SIGUSR1; see
//! [`ferroccl::trace`]), so that `ferroccl trace DIR` shows where a failed or
//! interrupted job stood.
//!
//! Every rank runs in its own process group (so a stop also reaches the processes it
//! started, and Ctrl-C reaches the ranks only through the launcher), with stdin from
//! `/dev/null`; on Linux it is also killed if the launcher dies (`PR_SET_PDEATHSIG`).

use clap::Args;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Arguments of `ferroccl launch`.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Number of ranks to start.
    #[arg(short = 'n', long = "nproc", value_parser = crate::args::ranks)]
    pub nproc: usize,
    /// `MASTER_ADDR` given to every rank: where rank 0 serves the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// `MASTER_PORT` given to every rank [default: a free port on 127.0.0.1].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// Hosts in the job: run one `ferroccl launch` per host, each with its `--node-rank`,
    /// the same `--master-addr` (a host all can reach, where node 0 runs) and the same
    /// `--master-port`; set the same `FERROCCL_TOKEN` on every host to authenticate.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub nnodes: u64,
    /// This host's place among the `--nnodes` hosts: its ranks are
    /// `node_rank * nproc .. (node_rank + 1) * nproc`.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u64,
    /// When a rank fails, stop the others and start all ranks again, up to this many
    /// times (each attempt gets a fresh store and communicator; `FERROCCL_RESTART_COUNT`
    /// says which attempt it is). `ferroccl train --resume` then goes on from its newest
    /// checkpoint.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// Entry point of `ferroccl launch`: runs the ranks and turns the outcome into an exit code.
pub fn main(a: LaunchArgs) -> ExitCode {
    let opts = LaunchOptions {
        master_addr: a.master_addr,
        master_port: a.master_port,
        max_restarts: a.max_restarts,
        nnodes: usize::try_from(a.nnodes).unwrap_or(usize::MAX),
        node_rank: usize::try_from(a.node_rank).unwrap_or(usize::MAX),
        ..LaunchOptions::default()
    };
    match run(a.nproc, &a.command, &opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _guard = lock_output();
            let _ = writeln!(io::stderr().lock(), "ferroccl launch: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// How [`run`] sets up the job, beyond the rank count and the command.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// `MASTER_ADDR` for every rank.
    pub master_addr: String,
    /// `MASTER_PORT` for every rank; `None` picks a free port on 127.0.0.1.
    pub master_port: Option<u16>,
    /// How long stopped ranks get between SIGTERM and SIGKILL.
    pub grace_period: Duration,
    /// A rank whose stdout is passed through without the `[rank] ` prefix (`ferroccl
    /// bench` uses it so rank 0's table reads as the tool's own output).
    pub bare_stdout_rank: Option<usize>,
    /// How many times a failed job is started again (all ranks, fresh store).
    pub max_restarts: usize,
    /// Hosts in the job (one launcher each).
    pub nnodes: usize,
    /// This launcher's host among them.
    pub node_rank: usize,
    /// What each rank needs of this host: a job this host cannot run is refused
    /// before any rank starts ([`crate::args::host_can_run`]).
    pub rank_needs: crate::args::RankNeeds,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            master_addr: Ipv4Addr::LOCALHOST.to_string(),
            master_port: None,
            grace_period: Duration::from_secs(3),
            bare_stdout_rank: None,
            max_restarts: 0,
            nnodes: 1,
            node_rank: 0,
            rank_needs: crate::args::RankNeeds::UNKNOWN,
        }
    }
}

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this status (0 is success).
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl RankExit {
    fn success(self) -> bool {
        self == RankExit::Code(0)
    }
}

impl fmt::Display for RankExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RankExit::Code(c) => write!(f, "exit status {c}"),
            RankExit::Signal(s) => write!(f, "killed by signal {s}{}", signal_suffix(s)),
        }
    }
}

/// Why a launch did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// `-n 0`: a job needs at least one rank.
    #[error("-n must be at least 1 (got {0})")]
    NoRanks(usize),
    /// `--node-rank` is not below `--nnodes`, or a multi-host job has no fixed port.
    #[error("{0}")]
    Nodes(String),
    /// This host cannot run that many ranks (CPUs, processes, open files, memory).
    #[error("this host cannot run the job: {0}")]
    Host(String),
    /// No command was given.
    #[error("no command given (usage: ferroccl launch -n N -- CMD ARGS...)")]
    EmptyCommand,
    /// `MASTER_PORT` was not given and no free port could be found.
    #[error("cannot find a free port for MASTER_PORT: {0}")]
    FreePort(#[source] io::Error),
    /// The command could not be started (not found, not executable); ranks already
    /// started were stopped.
    #[error("cannot start `{program}` for rank {rank}: {source}")]
    Spawn {
        /// The command, as given.
        program: String,
        /// The rank being started.
        rank: usize,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// Setting up the launcher itself failed (a pipe, a thread, a signal handler);
    /// ranks already started were stopped.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// A rank exited non-zero or was killed; the ranks in `stopped` were still running
    /// and were stopped because of it.
    #[error("rank {rank} failed ({status}){}", stopped_suffix(.stopped))]
    RankFailed {
        /// The first rank seen failing.
        rank: usize,
        /// How it ended.
        status: RankExit,
        /// Ranks that were still running and were stopped.
        stopped: Vec<usize>,
    },
    /// The launcher got SIGINT or SIGTERM; it forwarded the signal to the ranks in
    /// `stopped` (those still running) and waited for them.
    #[error("interrupted by signal {signal}{}{}", signal_suffix(*.signal), stopped_suffix(.stopped))]
    Interrupted {
        /// The signal the launcher received.
        signal: i32,
        /// Ranks that were still running and were stopped.
        stopped: Vec<usize>,
    },
}

impl LaunchError {
    /// The launcher's exit code: the failed rank's exit code, 128 + signal for a rank
    /// killed by a signal or an interrupted launcher, 127 for a command not found, 126
    /// for one that cannot be executed, 2 for a usage error, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            LaunchError::NoRanks(_)
            | LaunchError::EmptyCommand
            | LaunchError::Nodes(_)
            | LaunchError::Host(_) => 2,
            LaunchError::FreePort(_) | LaunchError::Io { .. } => 1,
            LaunchError::Spawn { source, .. } if source.kind() == io::ErrorKind::NotFound => 127,
            LaunchError::Spawn { .. } => 126,
            LaunchError::RankFailed {
                status: RankExit::Code(c),
                ..
            } => match u8::try_from(*c) {
                Ok(0) | Err(_) => 1,
                Ok(c) => c,
            },
            LaunchError::RankFailed {
                status: RankExit::Signal(s),
                ..
            }
            | LaunchError::Interrupted { signal: s, .. } => signal_exit_code(*s),
        }
    }
}

fn signal_exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(1)
}

fn stopped_suffix(stopped: &[usize]) -> String {
    let list: Vec<String> = stopped.iter().map(ToString::to_string).collect();
    match stopped.len() {
        0 => String::new(),
        1 => format!("; stopped rank {}", list.join(", ")),
        _ => format!("; stopped ranks {}", list.join(", ")),
    }
}

/// `" SIGKILL"` for the signals people meet, empty for others.
fn signal_suffix(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return String::new(),
    };
    format!(" {name}")
}

/// Variables of other launchers that `detect_env` would otherwise read.
const FOREIGN_VARS: &[&str] = &[
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    // An enclosing torchrun's: this launch's ranks meet at their own MASTER_PORT.
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
];
/// Prefix of Open MPI's per-process variables, all removed.
const FOREIGN_PREFIX: &str = "OMPI_COMM_WORLD_";

/// How often the wait loop looks at the ranks and at pending signals.
const POLL: Duration = Duration::from_millis(10);

/// After a rank fails, how long the others get to end on their own (and say why)
/// before they are stopped.
const SETTLE: Duration = Duration::from_millis(700);

/// How long ranks being stopped get to write their flight recorders at most.
const DUMP_WAIT: Duration = Duration::from_secs(2);
/// After every rank has exited, output forwarding is abandoned once no reader has made
/// progress for this long (something outside the job still holds the pipe open).
const DRAIN_IDLE: Duration = Duration::from_secs(1);

/// Starts `nproc` local ranks of `command` (program then arguments) with the launcher
/// environment set, forwards their output prefixed with `[rank] `, and waits for all.
///
/// Returns `Ok(())` when every rank exits 0. When one fails (non-zero exit or a signal),
/// the others are sent SIGTERM, then SIGKILL after `opts.grace_period`, and the error
/// names the rank, how it ended and which ranks were stopped. SIGINT/SIGTERM received
/// meanwhile are forwarded to the ranks and reported as [`LaunchError::Interrupted`].
/// No rank is left running when this returns. With `opts.max_restarts`, a failed rank
/// (not an interrupt) stops the others and the whole job starts again, on a fresh port
/// with `FERROCCL_RESTART_COUNT` one higher, until it succeeds or the restarts are
/// spent. `ferroccl bench` and `train` use it to re-execute themselves when no launcher
/// started them.
pub fn run(nproc: usize, command: &[OsString], opts: &LaunchOptions) -> Result<(), LaunchError> {
    if nproc == 0 {
        return Err(LaunchError::NoRanks(nproc));
    }
    let Some((program, args)) = command.split_first() else {
        return Err(LaunchError::EmptyCommand);
    };
    if opts.node_rank >= opts.nnodes {
        return Err(LaunchError::Nodes(format!(
            "--node-rank {} is not below --nnodes {} (hosts are 0..{})",
            opts.node_rank, opts.nnodes, opts.nnodes
        )));
    }
    if opts.nnodes > 1 && opts.master_port.is_none() {
        return Err(LaunchError::Nodes(
            "a job of several hosts needs --master-port: every host's launcher must give \
             its ranks the same one"
                .into(),
        ));
    }
    crate::args::host_can_run(&crate::args::Host::read(), nproc, opts.rank_needs)
        .map_err(LaunchError::Host)?;
    // The launcher holds two pipes per rank; a ferroccl rank two links per peer.
    crate::args::raise_nofile(64 + 2 * nproc as u64 + opts.rank_needs.files.unwrap_or(0));
    let signals = SignalGuard::install().map_err(|source| LaunchError::Io {
        what: "installing SIGINT/SIGTERM handlers",
        source,
    })?;
    // One identity for the job, the same on every host's launcher; each attempt is told
    // apart by its restart count.
    let job_id = std::env::var("FERROCCL_JOB_ID")
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| match opts.nnodes {
            1 => ferroccl::rendezvous::new_token()[..16].to_owned(),
            _ => format!(
                "{}-hosts-at-{}:{}",
                opts.nnodes,
                opts.master_addr,
                opts.master_port.unwrap_or_default()
            ),
        });
    let mut attempt = 0;
    let result = loop {
        let result = run_attempt(
            nproc,
            program,
            args,
            opts,
            &format!("{job_id}.{attempt}"),
            attempt,
        );
        match result {
            Err(LaunchError::RankFailed { rank, status, .. }) if attempt < opts.max_restarts => {
                attempt += 1;
                let _guard = lock_output();
                let why = if status == RankExit::Code(ferroccl::ddp::PREEMPTED_EXIT_CODE) {
                    "stopped for preemption, after its checkpoint"
                } else {
                    "failed"
                };
                let _ = writeln!(
                    io::stderr().lock(),
                    "ferroccl launch: rank {rank} {why} ({status}); restarting all {nproc} ranks \
                     (restart {attempt} of {})",
                    opts.max_restarts
                );
            }
            other => break other,
        }
    };
    drop(signals);
    result
}

/// One attempt of a job: starts the ranks and waits for them.
fn run_attempt(
    nproc: usize,
    program: &OsString,
    args: &[OsString],
    opts: &LaunchOptions,
    job_id: &str,
    attempt: usize,
) -> Result<(), LaunchError> {
    // A fresh port per attempt unless one was given: the last attempt's store may
    // still be closing.
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port().map_err(LaunchError::FreePort)?,
    };
    let mut job = Job::new(Arc::new(Forwarding {
        bare_stdout_rank: opts.bare_stdout_rank,
        ..Forwarding::default()
    }));
    let env = AttemptEnv {
        master_addr: &opts.master_addr,
        port,
        job_id,
        attempt,
        nnodes: opts.nnodes,
        node_rank: opts.node_rank,
    };
    let result = job.start(nproc, program, args, &env);
    let result = match result {
        Ok(()) => job.wait(opts.grace_period),
        Err(e) => {
            job.stop(opts.grace_period);
            Err(e)
        }
    };
    job.reap_and_drain();
    if let Err(LaunchError::RankFailed { .. } | LaunchError::Interrupted { .. }) = &result {
        job.print_last_words();
    }
    result
}

/// What differs between the attempts of one job.
struct AttemptEnv<'a> {
    master_addr: &'a str,
    port: u16,
    job_id: &'a str,
    attempt: usize,
    nnodes: usize,
    node_rank: usize,
}

/// Binds 127.0.0.1:0 and releases it, as torchrun does: the port is free now and is very
/// likely still free when rank 0 binds it a moment later.
fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// One started rank.
struct Rank {
    child: Child,
    /// Its pid, which is also its process group id.
    pid: libc::pid_t,
    /// How it ended, once seen (it stays unreaped until [`Job::reap_and_drain`], so its
    /// pid and process group id cannot be reused while we may still signal them).
    exit: Option<RankExit>,
    /// Reaped already (only when `waitid` was unavailable).
    reaped: bool,
}

struct Job {
    ranks: Vec<Rank>,
    readers: Vec<JoinHandle<()>>,
    fwd: Arc<Forwarding>,
    /// The job-wide rank of `ranks[0]` (this host's first).
    first_rank: usize,
}

impl Job {
    fn new(fwd: Arc<Forwarding>) -> Self {
        Self {
            ranks: Vec::new(),
            readers: Vec::new(),
            fwd,
            first_rank: 0,
        }
    }

    fn start(
        &mut self,
        nproc: usize,
        program: &OsString,
        args: &[OsString],
        env: &AttemptEnv<'_>,
    ) -> Result<(), LaunchError> {
        let foreign: Vec<OsString> = std::env::vars_os()
            .map(|(k, _)| k)
            .filter(|k| {
                let k = k.to_string_lossy();
                k.starts_with(FOREIGN_PREFIX) || FOREIGN_VARS.contains(&k.as_ref())
            })
            .collect();
        // One job token for all ranks (kept if the caller set one): every connection
        // of the job proves it, so a stranger or a process of another job is refused.
        let token = std::env::var("FERROCCL_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(ferroccl::rendezvous::new_token);
        self.first_rank = env.node_rank * nproc;
        for local in 0..nproc {
            let rank = self.first_rank + local;
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", (env.nnodes * nproc).to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("GROUP_RANK", env.node_rank.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("MASTER_ADDR", env.master_addr)
                .env("MASTER_PORT", env.port.to_string())
                .env("FERROCCL_LAUNCHED", "1")
                .env("FERROCCL_TOKEN", &token)
                // The job's identity, in every rank's JOIN: a rank of another job (or
                // of an earlier attempt) that reaches this store is refused by name.
                .env("FERROCCL_JOB_ID", env.job_id)
                .env("FERROCCL_RESTART_COUNT", env.attempt.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            for k in &foreign {
                cmd.env_remove(k);
            }
            die_with_parent(&mut cmd);
            let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
                program: program.to_string_lossy().into_owned(),
                rank,
                source,
            })?;
            let pid = libc::pid_t::try_from(child.id()).unwrap_or(libc::pid_t::MAX);
            let out = child.stdout.take();
            let err = child.stderr.take();
            self.ranks.push(Rank {
                child,
                pid,
                exit: None,
                reaped: false,
            });
            if let Some(out) = out {
                self.forward(rank, out, Stream::Stdout)?;
            }
            if let Some(err) = err {
                self.forward(rank, err, Stream::Stderr)?;
            }
            // Starting many ranks takes a while: a signal, or a rank that failed
            // already, stops the start-up here (the caller stops those started).
            let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
            if sig != 0 {
                return Err(LaunchError::Interrupted {
                    signal: sig,
                    stopped: self.running(),
                });
            }
            if local % 8 == 7 || local + 1 == nproc {
                if let Some((rank, status)) = self.poll() {
                    return Err(LaunchError::RankFailed {
                        rank,
                        status,
                        stopped: self.running(),
                    });
                }
            }
        }
        Ok(())
    }

    fn forward(
        &mut self,
        rank: usize,
        pipe: impl Read + Send + 'static,
        stream: Stream,
    ) -> Result<(), LaunchError> {
        let fwd = Arc::clone(&self.fwd);
        fwd.live.fetch_add(1, Ordering::SeqCst);
        let spawned = thread::Builder::new()
            .name(format!("rank{rank}-{stream:?}"))
            .spawn(move || forward_lines(rank, pipe, stream, &fwd));
        match spawned {
            Ok(h) => {
                self.readers.push(h);
                Ok(())
            }
            Err(source) => {
                self.fwd.live.fetch_sub(1, Ordering::SeqCst);
                Err(LaunchError::Io {
                    what: "starting an output-forwarding thread",
                    source,
                })
            }
        }
    }

    /// Looks for ranks that ended; returns the first failure seen in this pass.
    fn poll(&mut self) -> Option<(usize, RankExit)> {
        let mut failed = None;
        for (i, r) in self.ranks.iter_mut().enumerate() {
            if r.exit.is_some() {
                continue;
            }
            if let Some(st) = poll_exit(r) {
                r.exit = Some(st);
                if failed.is_none() && !st.success() {
                    failed = Some((self.first_rank + i, st));
                }
            }
        }
        failed
    }

    fn running(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&i| self.ranks[i].exit.is_none())
            .map(|i| self.first_rank + i)
            .collect()
    }

    /// Sends `sig` to the process group of every unreaped rank (those already exited
    /// too: that reaches processes they left behind).
    fn signal_all(&self, sig: i32) {
        for r in &self.ranks {
            if r.reaped || r.pid <= 0 {
                continue;
            }
            // SAFETY: plain syscall; the pid is an unreaped child of ours, so neither
            // it nor its process group id can belong to an unrelated process.
            unsafe {
                if libc::kill(-r.pid, sig) != 0 {
                    libc::kill(r.pid, sig);
                }
                // A stopped rank (SIGSTOP, a debugger let go) acts on a stop signal
                // only once it runs again: wake it, or only SIGKILL would end it.
                if sig != libc::SIGKILL && libc::kill(-r.pid, libc::SIGCONT) != 0 {
                    libc::kill(r.pid, libc::SIGCONT);
                }
            }
        }
    }

    /// With `FERROCCL_TRACE_DIR` set (the ranks inherit it), asks every running rank
    /// for its flight recorder before it is stopped: SIGUSR1, which ferroccl answers by
    /// dumping into that directory. Waits until each running rank's `rank-<i>.jsonl`
    /// there is fresh, the rank has ended, or [`DUMP_WAIT`] has passed, whichever is
    /// first (a second signal to the launcher cuts it short).
    fn request_dumps(&mut self) {
        let Some(dir) = std::env::var_os(ferroccl::trace::TRACE_DIR_ENV).filter(|d| !d.is_empty())
        else {
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        // File times come from a coarse clock: allow for it (a dump taken a moment
        // before the request, at the failure, is as good).
        let asked = std::time::SystemTime::now() - Duration::from_millis(100);
        let running = self.running();
        for &i in &running {
            let r = &self.ranks[i];
            if r.reaped || r.pid <= 0 {
                continue;
            }
            // SAFETY: plain syscall to an unreaped child of ours (so the pid is not
            // reused); to the rank itself only, not to processes it started, which may
            // not handle SIGUSR1.
            unsafe { libc::kill(r.pid, libc::SIGUSR1) };
        }
        let fresh = |i: usize| {
            std::fs::metadata(dir.join(format!("rank-{i}.jsonl")))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= asked)
        };
        let since = Instant::now();
        while since.elapsed() < DUMP_WAIT && PENDING_SIGNAL.load(Ordering::SeqCst) == 0 {
            self.poll();
            if running
                .iter()
                .all(|&i| self.ranks[i].exit.is_some() || fresh(i))
            {
                break;
            }
            thread::sleep(POLL);
        }
    }

    /// The wait loop: returns when every rank has ended.
    ///
    /// When a rank fails, the others get [`SETTLE`] to end on their own first: a
    /// ferroccl rank told of the failure errors within milliseconds and says why on
    /// stderr, words a SIGTERM would cut off. Those still running then are stopped.
    fn wait(&mut self, grace: Duration) -> Result<(), LaunchError> {
        let mut outcome: Option<LaunchError> = None;
        let mut stopping_since: Option<Instant> = None;
        let mut settle_until: Option<Instant> = None;
        let mut killed = false;
        loop {
            let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
            if sig != 0 {
                if outcome.is_none() || settle_until.is_some() {
                    // A signal stops the job now, also while a failure settles.
                    settle_until = None;
                    let stopped = self.running();
                    outcome = Some(match outcome.take() {
                        Some(LaunchError::RankFailed { rank, status, .. }) => {
                            LaunchError::RankFailed {
                                rank,
                                status,
                                stopped,
                            }
                        }
                        _ => LaunchError::Interrupted {
                            signal: sig,
                            stopped,
                        },
                    });
                    self.request_dumps();
                    self.signal_all(sig);
                    stopping_since = Some(Instant::now());
                } else if !killed {
                    // A second signal while stopping: do not wait for the grace period.
                    self.signal_all(libc::SIGKILL);
                    killed = true;
                }
            }
            if let Some((rank, status)) = self.poll() {
                if outcome.is_none() {
                    outcome = Some(LaunchError::RankFailed {
                        rank,
                        status,
                        stopped: Vec::new(),
                    });
                    settle_until = Some(Instant::now() + SETTLE);
                }
            }
            if let Some(until) = settle_until {
                let all_ended = self.ranks.iter().all(|r| r.exit.is_some());
                if all_ended || Instant::now() >= until {
                    settle_until = None;
                    let still = self.running();
                    if let Some(LaunchError::RankFailed { stopped, .. }) = &mut outcome {
                        *stopped = still;
                    }
                    if !all_ended {
                        self.request_dumps();
                        self.signal_all(libc::SIGTERM);
                        stopping_since = Some(Instant::now());
                    }
                }
            }
            if self.ranks.iter().all(|r| r.exit.is_some()) {
                break;
            }
            if let Some(since) = stopping_since {
                if !killed && since.elapsed() >= grace {
                    self.signal_all(libc::SIGKILL);
                    killed = true;
                }
            }
            thread::sleep(POLL);
        }
        match outcome {
            Some(e) => {
                // Leftovers in the ranks' process groups (children that ignored SIGTERM).
                self.signal_all(libc::SIGKILL);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Stops every started rank (SIGTERM, SIGKILL after `grace`) and waits for them.
    fn stop(&mut self, grace: Duration) {
        self.signal_all(libc::SIGTERM);
        let since = Instant::now();
        loop {
            self.poll();
            if self.ranks.iter().all(|r| r.exit.is_some()) || since.elapsed() >= grace {
                break;
            }
            thread::sleep(POLL);
        }
        self.signal_all(libc::SIGKILL);
    }

    /// After a failed or interrupted job: every started rank's last line on stderr
    /// (its own error, usually), in rank order, so that no rank's word is lost among
    /// the others' output.
    fn print_last_words(&self) {
        let words = self
            .fwd
            .last_words
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let _guard = lock_output();
        let mut err = io::stderr().lock();
        let _ = writeln!(err, "ferroccl launch: each rank's last line on stderr:");
        for (i, r) in self.ranks.iter().enumerate() {
            let rank = self.first_rank + i;
            let how = r
                .exit
                .map_or("not seen ending".to_string(), |e| e.to_string());
            let _ = match words.get(&rank) {
                Some(w) => writeln!(err, "  [{rank}] ({how}) {w}"),
                None => writeln!(err, "  [{rank}] ({how}) nothing on stderr"),
            };
        }
    }

    /// Reaps every rank, then waits for the forwarders to reach end of output.
    fn reap_and_drain(&mut self) {
        for r in &mut self.ranks {
            if !r.reaped {
                let _ = r.child.wait();
                r.reaped = true;
            }
        }
        let mut last = self.fwd.progress.load(Ordering::SeqCst);
        let mut idle_since = Instant::now();
        while self.fwd.live.load(Ordering::SeqCst) > 0 {
            let now = self.fwd.progress.load(Ordering::SeqCst);
            if now != last || self.fwd.writing.load(Ordering::SeqCst) > 0 {
                last = now;
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= DRAIN_IDLE {
                // Something outside the job holds a pipe open; leave its reader behind.
                self.readers.clear();
                return;
            }
            thread::sleep(POLL);
        }
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Whether the rank has ended, without reaping it (so its pid stays ours to signal).
#[cfg(target_os = "linux")]
fn poll_exit(r: &mut Rank) -> Option<RankExit> {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value and waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let id = libc::id_t::try_from(r.pid).unwrap_or(0);
    // SAFETY: `info` is a valid, writable siginfo_t.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            id,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return try_wait_exit(r);
    }
    // SAFETY: waitid filled the SIGCHLD fields (or left the zeroed struct: si_pid 0).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return None;
    }
    match info.si_code {
        libc::CLD_EXITED => Some(RankExit::Code(status)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some(RankExit::Signal(status)),
        _ => None,
    }
}

#[cfg(not(target_os = "linux"))]
fn poll_exit(r: &mut Rank) -> Option<RankExit> {
    try_wait_exit(r)
}

/// Fallback that reaps: the rank is then no longer signalled.
fn try_wait_exit(r: &mut Rank) -> Option<RankExit> {
    match r.child.try_wait() {
        Ok(Some(st)) => {
            r.reaped = true;
            Some(match (st.code(), st.signal()) {
                (Some(c), _) => RankExit::Code(c),
                (None, Some(s)) => RankExit::Signal(s),
                (None, None) => RankExit::Code(1),
            })
        }
        Ok(None) => None,
        Err(_) => {
            // Not our child any more (cannot happen unless someone else reaped it).
            r.reaped = true;
            Some(RankExit::Code(1))
        }
    }
}

/// On Linux, have the kernel SIGKILL the rank if the launcher dies, so a killed launcher
/// leaves no orphans.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure only makes async-signal-safe syscalls (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // The launcher died before prctl took effect.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

#[derive(Clone, Copy, Debug)]
enum Stream {
    Stdout,
    Stderr,
}

/// Shared state of the output forwarders, watched by [`Job::reap_and_drain`].
#[derive(Default)]
struct Forwarding {
    /// Forwarders not yet at end of output.
    live: AtomicUsize,
    /// Forwarders inside a write to our stdout/stderr (a slow reader is not a hang).
    writing: AtomicUsize,
    /// Lines read so far, all ranks together.
    progress: AtomicU64,
    /// The rank whose stdout lines get no prefix.
    bare_stdout_rank: Option<usize>,
    /// Each rank's last non-empty stderr line.
    last_words: Mutex<std::collections::BTreeMap<usize, String>>,
}

/// Held while writing a line to stdout or stderr, so that lines of different ranks (and of
/// stdout and stderr sharing a terminal) never interleave.
static OUTPUT: Mutex<()> = Mutex::new(());

fn lock_output() -> std::sync::MutexGuard<'static, ()> {
    OUTPUT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies `pipe` to our `stream` line by line with a `[rank] ` prefix. Bytes pass
/// through as they are; a last line without a newline gets one. If our own output is
/// closed the pipe is still drained, so the rank never blocks on a full pipe.
fn forward_lines(rank: usize, pipe: impl Read, stream: Stream, fwd: &Forwarding) {
    let bare = matches!(stream, Stream::Stdout) && fwd.bare_stdout_rank == Some(rank);
    let prefix = if bare {
        String::new()
    } else {
        format!("[{rank}] ")
    };
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line: Vec<u8> = Vec::new();
    let mut output_ok = true;
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        fwd.progress.fetch_add(1, Ordering::SeqCst);
        if matches!(stream, Stream::Stderr) {
            let words = String::from_utf8_lossy(&line[prefix.len()..]);
            let words = words.trim();
            if !words.is_empty() {
                fwd.last_words
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rank, words.to_string());
            }
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if output_ok {
            fwd.writing.fetch_add(1, Ordering::SeqCst);
            output_ok = write_line(stream, &line).is_ok();
            fwd.writing.fetch_sub(1, Ordering::SeqCst);
        }
    }
    fwd.live.fetch_sub(1, Ordering::SeqCst);
}

fn write_line(stream: Stream, line: &[u8]) -> io::Result<()> {
    let _guard = lock_output();
    match stream {
        Stream::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(line)?;
            out.flush()
        }
        Stream::Stderr => {
            let mut err = io::stderr().lock();
            err.write_all(line)?;
            err.flush()
        }
    }
}

/// The last SIGINT/SIGTERM the launcher received and has not yet forwarded (0: none).
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn record_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`PENDING_SIGNAL`] while a job runs; restores the
/// previous handlers on drop.
struct SignalGuard {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    fn install() -> io::Result<Self> {
        PENDING_SIGNAL.store(0, Ordering::SeqCst);
        let mut guard = SignalGuard {
            previous: Vec::new(),
        };
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: sigaction is plain data; the handler only stores to an atomic, which
            // is async-signal-safe.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) != 0 {
                    return Err(io::Error::last_os_error());
                }
                guard.previous.push((sig, old));
            }
        }
        Ok(guard)
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: restores an action the OS gave us.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_exit_codes() {
        let e = LaunchError::RankFailed {
            rank: 1,
            status: RankExit::Code(3),
            stopped: vec![0, 2, 3],
        };
        assert_eq!(
            e.to_string(),
            "rank 1 failed (exit status 3); stopped ranks 0, 2, 3"
        );
        assert_eq!(e.exit_code(), 3);
        let e = LaunchError::RankFailed {
            rank: 0,
            status: RankExit::Signal(libc::SIGKILL),
            stopped: vec![1],
        };
        assert_eq!(
            e.to_string(),
            "rank 0 failed (killed by signal 9 SIGKILL); stopped rank 1"
        );
        assert_eq!(e.exit_code(), 137);
        let e = LaunchError::RankFailed {
            rank: 2,
            status: RankExit::Signal(64),
            stopped: vec![],
        };
        assert_eq!(e.to_string(), "rank 2 failed (killed by signal 64)");
        let e = LaunchError::Interrupted {
            signal: libc::SIGINT,
            stopped: vec![0, 1],
        };
        assert_eq!(
            e.to_string(),
            "interrupted by signal 2 SIGINT; stopped ranks 0, 1"
        );
        assert_eq!(e.exit_code(), 130);
        assert_eq!(LaunchError::NoRanks(0).exit_code(), 2);
    }
}
