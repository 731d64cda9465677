//! One error type for a training loop that calls both candle and ferroccl, so that `?`
//! works on either (ferroccl's `Error` cannot convert candle's itself: neither crate
//! knows the other).
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

/// A failure in a training loop: of the communication (typed, as ferroccl says it:
/// match on `Comm(ferroccl::Error::PeerFailed { .. })`) or of the model's tensors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// ferroccl's error, as it was.
    #[error(transparent)]
    Comm(#[from] ferroccl::Error),
    /// candle's error (its text may carry a backtrace after the first line).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// `std::result::Result<T, ferroccl_candle::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// ferroccl's error, if this is one.
    pub fn comm(&self) -> Option<&ferroccl::Error> {
        match self {
            Error::Comm(e) => Some(e),
            Error::Candle(_) => None,
        }
    }
}

impl From<Error> for ferroccl::Error {
    /// Into ferroccl's error: a candle failure becomes `InvalidArgument` with its
    /// first line (for code whose error type is ferroccl's), unless it was a
    /// tensor-parallel collective's, which is that collective's own error.
    fn from(e: Error) -> Self {
        match e {
            Error::Comm(e) => e,
            Error::Candle(e) => {
                if let Some(failed) = crate::tensor_parallel::failure(&e) {
                    return failed;
                }
                let text = e.to_string();
                ferroccl::Error::InvalidArgument(format!(
                    "candle: {}",
                    text.lines().next().unwrap_or_default()
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_errors_convert_and_stay_typed() {
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
    }
}
