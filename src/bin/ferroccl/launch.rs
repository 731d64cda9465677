//! `ferroccl launch -n N -- CMD ARGS`: N local ranks with the launcher environment.

use clap::Args;
use std::process::ExitCode;

/// Arguments of `ferroccl launch`.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Number of ranks to start.
    #[arg(short = 'n', long = "nproc")]
    pub nproc: usize,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<std::ffi::OsString>,
}

pub fn main(_a: LaunchArgs) -> ExitCode {
    eprintln!("ferroccl launch: not yet implemented");
    ExitCode::FAILURE
}

/// Placeholder until the launcher lands.
pub fn run_quiet_rank0(_n: usize, _cmd: &[std::ffi::OsString]) -> Result<(), String> {
    Err("launch not yet implemented".into())
}
