//! Why a launch did not succeed, and the exit status that says so.

use super::*;

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this status (0 is success).
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl RankExit {
    pub(super) fn success(self) -> bool {
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

pub(super) fn signal_exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(1)
}

pub(super) fn stopped_suffix(stopped: &[usize]) -> String {
    let list: Vec<String> = stopped.iter().map(ToString::to_string).collect();
    match stopped.len() {
        0 => String::new(),
        1 => format!("; stopped rank {}", list.join(", ")),
        _ => format!("; stopped ranks {}", list.join(", ")),
    }
}

/// `" SIGKILL"` for the signals people meet, empty for others.
pub(super) fn signal_suffix(sig: i32) -> String {
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
