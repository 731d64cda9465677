//! The training error: how a run of the training machinery ends when it does not end
//! well. A training loop fails for reasons of its own — the model diverged, the job
//! was preempted, a checkpoint cannot be used — beside every failure of the
//! communication under it, which it carries as it was ([`TrainError::Comm`]).
//!
//! [`crate::Error`] stays the communication's error: these reasons are not a
//! collective's, never cross the wire in a failure notice, and no binding of the
//! communicator raises them.

use crate::error::Error;
use std::path::{Path, PathBuf};

/// Shorthand for `std::result::Result<T, TrainError>`.
pub type TrainResult<T, E = TrainError> = std::result::Result<T, E>;

/// A failed training run: a reason of the training's own, or the communication's
/// error as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The communication (or its I/O) failed: ferroccl's error, typed as it was.
    #[error(transparent)]
    Comm(#[from] Error),

    /// Training diverged: the averaged gradients (identical on every rank) hold an
    /// inf or a NaN in full-precision training, where no loss scaler can recover.
    #[error("training diverged at step {step}: {why}")]
    Diverged {
        /// The optimizer step.
        step: u64,
        /// What was found and what to try.
        why: String,
    },

    /// The job was asked to stop (SIGTERM: a scheduler's preemption; see
    /// [`super::Preemption`]) and every rank stopped after the same step, with the
    /// checkpoint of that step written. Restart it to go on
    /// ([`super::PREEMPTED_EXIT_CODE`] tells a launcher so).
    #[error("preempted: stopped after step {step}{}", match checkpoint {
        Some(p) => format!(", checkpoint {}", p.display()),
        None => " (rank 0 writes the checkpoint, when there is a checkpoint directory)".into(),
    })]
    Preempted {
        /// Steps completed.
        step: u64,
        /// The checkpoint written for it (on rank 0, with a checkpoint directory; `None`
        /// elsewhere).
        checkpoint: Option<PathBuf>,
    },

    /// A checkpoint is corrupt, truncated, from another format version, or does not
    /// fit the model it is loaded into. Nothing was changed: the model, and any other
    /// checkpoint on disk, are as they were.
    #[error("checkpoint {}: {why}", path.display())]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

impl TrainError {
    /// A checkpoint file that cannot be used, and why.
    pub fn checkpoint(path: &Path, why: impl Into<String>) -> Self {
        TrainError::Checkpoint {
            path: path.to_path_buf(),
            why: why.into(),
        }
    }

    /// The communication's error, if this is one.
    pub fn comm(&self) -> Option<&Error> {
        match self {
            TrainError::Comm(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_communication_error_stays_typed_and_the_training_reasons_say_what_happened() {
        let e: TrainError = Error::Aborted {
            rank: 1,
            op: "all_reduce #3".into(),
        }
        .into();
        assert!(matches!(e.comm(), Some(Error::Aborted { rank: 1, .. })));
        assert_eq!(e.to_string(), "rank 1: all_reduce #3 aborted");
        let c = TrainError::checkpoint(Path::new("/tmp/c"), "truncated");
        assert!(c.comm().is_none());
        assert_eq!(c.to_string(), "checkpoint /tmp/c: truncated");
        let p = TrainError::Preempted {
            step: 9,
            checkpoint: Some("/tmp/c".into()),
        };
        assert_eq!(
            p.to_string(),
            "preempted: stopped after step 9, checkpoint /tmp/c"
        );
        let p = TrainError::Preempted {
            step: 9,
            checkpoint: None,
        };
        assert!(
            p.to_string().contains("rank 0 writes the checkpoint"),
            "{p}"
        );
        let d = TrainError::Diverged {
            step: 7,
            why: "NaN".into(),
        };
        assert_eq!(d.to_string(), "training diverged at step 7: NaN");
    }
}
