//! The crate's error: what every function of it returns, so that `?` works on candle's
//! errors, ferroccl's and a training run's alike (ferroccl's `Error` cannot convert
//! candle's itself: neither crate knows the other).
//!
//! ```
//! use ferroccl_candle::candle_core::{Device, Tensor};
//!
//! fn step() -> ferroccl_candle::error::Result<f32> {
//!     let t = Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?; // a candle error converts
//!     let s = t.sum_all()?.to_scalar::<f32>()?;
//!     if s > 10.0 {
//!         // and so does ferroccl's
//!         Err(ferroccl_candle::ferroccl::Error::InvalidArgument("too big".into()))?;
//!     }
//!     Ok(s)
//! }
//! assert_eq!(step().unwrap(), 3.0);
//! ```
//!
//! A collective that fails inside candle (a tensor-parallel boundary's forward or
//! backward runs in a candle custom op, whose error type is candle's) is kept here,
//! typed, on the calling thread (`keep`); the conversion from candle's error takes it
//! back ([`failure`]), so the caller sees the collective's own [`Error::Comm`] —
//! `PeerFailed`, `Mismatch` — and not candle's message.

use ferroccl::ddp::TrainError;
use std::cell::RefCell;
use std::path::Path;

/// A failure in a training loop: of the communication (typed, as ferroccl says it:
/// match on `Comm(ferroccl::Error::PeerFailed { .. })`), of the model's tensors, or
/// of the training run itself (diverged, preempted, a checkpoint it cannot use).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// ferroccl's error, as it was; also an argument this crate refuses
    /// (`InvalidArgument`), as ferroccl refuses its own.
    #[error(transparent)]
    Comm(#[from] ferroccl::Error),
    /// candle's error (its text may carry a backtrace after the first line).
    #[error("candle: {0}")]
    Candle(candle_core::Error),
    /// The training run's own failure: [`TrainError::Diverged`],
    /// [`TrainError::Preempted`] or [`TrainError::Checkpoint`]. Never
    /// `TrainError::Comm`: a communication error converts into [`Error::Comm`].
    #[error(transparent)]
    Train(TrainError),
}

/// `std::result::Result<T, ferroccl_candle::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<candle_core::Error> for Error {
    /// candle's error, unless it is a collective's kept by `keep`: then that
    /// collective's own error.
    fn from(e: candle_core::Error) -> Self {
        failure(&e).unwrap_or(Error::Candle(e))
    }
}

impl From<TrainError> for Error {
    fn from(e: TrainError) -> Self {
        match e {
            TrainError::Comm(e) => Error::Comm(e),
            e => Error::Train(e),
        }
    }
}

impl Error {
    /// An argument this crate refuses: ferroccl's `InvalidArgument`.
    pub fn invalid(why: impl Into<String>) -> Self {
        Error::Comm(ferroccl::Error::InvalidArgument(why.into()))
    }

    /// An I/O error, with a sentence saying what we were doing: ferroccl's `Io`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Comm(ferroccl::Error::io(context, source))
    }

    /// A checkpoint that cannot be used, and why: [`TrainError::Checkpoint`].
    pub fn checkpoint(path: &Path, why: impl Into<String>) -> Self {
        Error::Train(TrainError::checkpoint(path, why))
    }

    /// ferroccl's error, if this is one.
    pub fn comm(&self) -> Option<&ferroccl::Error> {
        match self {
            Error::Comm(e) => Some(e),
            Error::Train(e) => e.comm(),
            Error::Candle(_) => None,
        }
    }

    /// The training run's own failure, if this is one.
    pub fn train(&self) -> Option<&TrainError> {
        match self {
            Error::Train(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Error> for ferroccl::Error {
    /// Into ferroccl's error, for code whose error type is ferroccl's: a
    /// communication error as it was; a candle error or a training run's failure as
    /// `InvalidArgument` with its first line (code that needs those typed returns this
    /// crate's [`Result`]).
    fn from(e: Error) -> Self {
        match e {
            Error::Comm(e) | Error::Train(TrainError::Comm(e)) => e,
            e => {
                let text = e.to_string();
                ferroccl::Error::InvalidArgument(text.lines().next().unwrap_or_default().into())
            }
        }
    }
}

thread_local! {
    /// The last collective that failed inside candle on this thread.
    static KEPT: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// What candle's error says when a collective failed inside it.
const MARK: &str = "a tensor-parallel collective failed";

/// Keeps `e` (a collective's failure inside a candle op: its forward or backward) for
/// [`failure`], and gives candle a message naming it.
pub(crate) fn keep(e: Error) -> candle_core::Error {
    let text = format!("{MARK}: {e}");
    KEPT.with(|f| *f.borrow_mut() = Some(e));
    candle_core::Error::Msg(text)
}

/// The typed error behind `e`, when `e` is a collective's failure kept by `keep`
/// on this thread (inside a forward or a backward); `None` otherwise. Taken once.
pub fn failure(e: &candle_core::Error) -> Option<Error> {
    if e.to_string().contains(MARK) {
        KEPT.with(|f| f.borrow_mut().take())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_converts_and_stays_typed() {
        let f = || -> Result<()> {
            Err(ferroccl::Error::Mismatch {
                rank: 0,
                peer: 1,
                ours: "a".into(),
                theirs: "b".into(),
            })?
        };
        assert!(matches!(
            f().unwrap_err().comm(),
            Some(ferroccl::Error::Mismatch { peer: 1, .. })
        ));
        let g = || -> Result<candle_core::Tensor> {
            let t = candle_core::Tensor::new(&[1.0f32, 2.0], &candle_core::Device::Cpu)?;
            Ok(t.reshape((3, 1))?)
        };
        let e = g().unwrap_err();
        assert!(matches!(e, Error::Candle(_)) && e.comm().is_none(), "{e}");
        let back: ferroccl::Error = e.into();
        assert!(
            matches!(&back, ferroccl::Error::InvalidArgument(m) if m.starts_with("candle: ") && !m.contains('\n')),
            "{back}"
        );
        // A training failure stays one; the communication error inside a
        // `TrainError` is a `Comm`.
        let t: Error = TrainError::Diverged {
            step: 3,
            why: "NaN".into(),
        }
        .into();
        assert!(matches!(
            t.train(),
            Some(TrainError::Diverged { step: 3, .. })
        ));
        let c: Error = TrainError::Comm(ferroccl::Error::Poisoned("x".into())).into();
        assert!(
            matches!(c, Error::Comm(ferroccl::Error::Poisoned(_))),
            "{c}"
        );
        assert!(c.train().is_none());
    }

    #[test]
    fn a_collective_kept_inside_candle_comes_back_typed_once() {
        let inner = ferroccl::Error::Aborted {
            rank: 2,
            op: "all_reduce #4".into(),
        };
        let candle = keep(Error::Comm(inner));
        assert!(candle.to_string().contains("rank 2: all_reduce #4 aborted"));
        let back = Error::from(candle);
        assert!(
            matches!(back, Error::Comm(ferroccl::Error::Aborted { rank: 2, .. })),
            "{back}"
        );
        // Taken once: the same message again is candle's own.
        let again = Error::from(candle_core::Error::Msg(format!("{MARK}: x")));
        assert!(matches!(again, Error::Candle(_)), "{again}");
    }
}
