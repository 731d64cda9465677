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

mod error;
mod job;
mod output;
mod signals;
#[cfg(test)]
mod tests;

use clap::Args;
pub use error::{LaunchError, RankExit};
use job::*;
pub(crate) use output::lock_output;
use output::*;
use signals::*;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
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
pub fn main(a: LaunchArgs) -> crate::error::Result<bool> {
    let opts = LaunchOptions {
        master_addr: a.master_addr,
        master_port: a.master_port,
        max_restarts: a.max_restarts,
        nnodes: usize::try_from(a.nnodes).unwrap_or(usize::MAX),
        node_rank: usize::try_from(a.node_rank).unwrap_or(usize::MAX),
        ..LaunchOptions::default()
    };
    run(a.nproc, &a.command, &opts)?;
    Ok(true)
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

/// Variables of other launchers that `detect_env` would otherwise read.
pub(super) const FOREIGN_VARS: &[&str] = &[
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
pub(super) const FOREIGN_PREFIX: &str = "OMPI_COMM_WORLD_";

/// How often the wait loop looks at the ranks and at pending signals.
pub(super) const POLL: Duration = Duration::from_millis(10);

/// After a rank fails, how long the others get to end on their own (and say why)
/// before they are stopped.
pub(super) const SETTLE: Duration = Duration::from_millis(700);

/// How long ranks being stopped get to write their flight recorders at most.
pub(super) const DUMP_WAIT: Duration = Duration::from_secs(2);
/// After every rank has exited, output forwarding is abandoned once no reader has made
/// progress for this long (something outside the job still holds the pipe open).
pub(super) const DRAIN_IDLE: Duration = Duration::from_secs(1);

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
pub(super) fn run_attempt(
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
pub(super) struct AttemptEnv<'a> {
    pub(super) master_addr: &'a str,
    pub(super) port: u16,
    pub(super) job_id: &'a str,
    pub(super) attempt: usize,
    pub(super) nnodes: usize,
    pub(super) node_rank: usize,
}

/// Binds 127.0.0.1:0 and releases it, as torchrun does: the port is free now and is very
/// likely still free when rank 0 binds it a moment later.
pub(super) fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}
