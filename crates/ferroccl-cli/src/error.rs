//! The CLI's one error: what a subcommand failed with, and the exit status that says so.
//!
//! Every subcommand's `run` returns [`Result`]: `Ok(true)` when it did what was asked,
//! `Ok(false)` when it ran but found wrong results (a benchmark's check), or an error.
//! `main` prints the error once, as `ferroccl <command>: <error>`, and exits with
//! [`CliError::exit_code`].

use crate::launch::LaunchError;

/// Shorthand for the CLI's results.
pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// Why a subcommand failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The library failed or refused an argument (a dead peer, a mismatched call, a
    /// port in use, a bad value).
    #[error(transparent)]
    Comm(#[from] ferroccl::Error),
    /// The launcher could not start or finish the job.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A file or a value this command cannot use, and why.
    #[error("{0}")]
    Input(String),
}

impl From<String> for CliError {
    fn from(why: String) -> Self {
        CliError::Input(why)
    }
}

impl From<&str> for CliError {
    fn from(why: &str) -> Self {
        CliError::Input(why.to_string())
    }
}

impl CliError {
    /// The exit status: the launcher's own (a rank's signal, 126 or 127 for a command
    /// that cannot run), else 2.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Launch(e) => e.exit_code(),
            CliError::Comm(_) | CliError::Input(_) => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_keeps_its_text_and_its_exit_status() {
        let e: CliError = ferroccl::Error::InvalidArgument("x".into()).into();
        assert_eq!(
            (e.to_string().as_str(), e.exit_code()),
            ("invalid argument: x", 2)
        );
        let e: CliError = "no rows".into();
        assert_eq!((e.to_string().as_str(), e.exit_code()), ("no rows", 2));
        let e: CliError = LaunchError::EmptyCommand.into();
        assert_eq!(e.exit_code(), LaunchError::EmptyCommand.exit_code());
        assert!(e.to_string().contains("no command given"), "{e}");
    }
}
