//! Element types, reduction operators, and the CPU reduction kernels.
//!
//! A collective moves bytes; this module gives them meaning. [`Element`] is implemented
//! for the seven supported types (sealed: the wire format depends on the set), and
//! [`reduce_into`] is the one kernel the algorithms call: `dst[i] = dst[i] op src[i]`.
//!
//! Semantics worth knowing:
//! - `f16`/`bf16` are widened to `f32`, combined, and rounded back once per call, so a
//!   pairwise step never loses more than one rounding.
//! - Integer `Sum` and `Prod` wrap on overflow (two's complement), as in NCCL and MPI.
//!   That makes them associative, so every rank and every ring order agree exactly.
//! - `Avg` is the sum divided by the world size, applied once by the rank that owns the
//!   fully reduced chunk, so all ranks receive the same bits. It is defined for floating
//!   types only: for integers it is refused with [`Error::UnsupportedOp`], because a
//!   wrapped sum divided by `n` is silently wrong long before the mean itself overflows.
//!   Reduce with `Sum` and divide in a wider type instead.
//! - `Min`/`Max` on floats follow IEEE `minNum`/`maxNum` (`f32::min`): a NaN loses to a number.

use crate::error::{Error, Result};
/// The 16-bit floats' Rust types, as `by_dtype!` names them.
#[doc(hidden)]
pub use half::{bf16, f16};
use std::fmt;

pub use crate::dtype::{DataType, ReduceOp};

impl ReduceOp {
    /// Parses the nccl-tests name.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" => ReduceOp::Avg,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown reduction {s:?}: expected sum, prod, min, max or avg"
                )))
            }
        })
    }
}

impl DataType {
    /// Parses nccl-tests names and the Rust ones (`float`/`f32`, `half`/`f16`, ...).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "float" | "f32" | "float32" => DataType::F32,
            "double" | "f64" | "float64" => DataType::F64,
            "half" | "f16" | "float16" => DataType::F16,
            "bfloat16" | "bf16" => DataType::BF16,
            "int32" | "i32" | "int" => DataType::I32,
            "int64" | "i64" => DataType::I64,
            "uint8" | "u8" => DataType::U8,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown data type {s:?}: expected float, double, half, bfloat16, int32, int64 or uint8"
                )))
            }
        })
    }
}

/// Checks that `op` is defined for `dtype` (today: `Avg` needs a floating type).
pub fn check_op(dtype: DataType, op: ReduceOp) -> Result<()> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(Error::UnsupportedOp {
            op,
            dtype,
            why: "integer averages are refused because a wrapped sum divided by the world size is silently wrong; reduce with Sum and divide in a wider type".into(),
        });
    }
    Ok(())
}

mod sealed {
    pub trait Sealed {}
}

/// A type a collective can carry and reduce. Implemented for `f32`, `f64`,
/// [`half::f16`], [`half::bf16`], `i32`, `i64` and `u8`; sealed because the wire
/// format names each type.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + Default + sealed::Sealed + 'static
{
    /// The tag this type has on the wire.
    const DTYPE: DataType;
    /// Exact widening (for integers beyond 2^53, the nearest f64).
    fn to_f64(self) -> f64;
    /// Rounds (floats) or wraps after truncation (integers) from f64.
    fn from_f64(v: f64) -> Self;
}

/// Runs `$body` with `$T` the Rust element type of the [`DataType`] `$dt` (`f32` …
/// `u8`, `half`'s `f16` and `bf16`); a dtype with no Rust type here — a variant added
/// after the caller was written, `DataType` being non-exhaustive — binds `$other` and
/// runs `$fallback`. The one dispatch from a dtype to a type, for the library, its
/// Python binding and its command line.
#[doc(hidden)]
#[macro_export]
macro_rules! __by_dtype {
    ($dt:expr, $T:ident => $body:expr, $other:ident => $fallback:expr) => {{
        #[allow(unreachable_patterns)]
        let out = match $dt {
            $crate::reduce::DataType::F32 => {
                type $T = f32;
                $body
            }
            $crate::reduce::DataType::F64 => {
                type $T = f64;
                $body
            }
            $crate::reduce::DataType::F16 => {
                type $T = $crate::reduce::f16;
                $body
            }
            $crate::reduce::DataType::BF16 => {
                type $T = $crate::reduce::bf16;
                $body
            }
            $crate::reduce::DataType::I32 => {
                type $T = i32;
                $body
            }
            $crate::reduce::DataType::I64 => {
                type $T = i64;
                $body
            }
            $crate::reduce::DataType::U8 => {
                type $T = u8;
                $body
            }
            $other => $fallback,
        };
        out
    }};
}
#[doc(hidden)]
pub use __by_dtype as by_dtype;

macro_rules! element {
    ($t:ty, $dt:expr, |$a:ident| $to:expr, |$v:ident| $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = $dt;
            #[inline]
            fn to_f64(self) -> f64 {
                let $a = self;
                $to
            }
            #[inline]
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f32, DataType::F32, |a| a as f64, |v| v as f32);
element!(f64, DataType::F64, |a| a, |v| v);
element!(f16, DataType::F16, |a| a.to_f64(), |v| f16::from_f64(v));
element!(bf16, DataType::BF16, |a| a.to_f64(), |v| bf16::from_f64(v));
element!(i32, DataType::I32, |a| a as f64, |v| v as i64 as i32);
element!(i64, DataType::I64, |a| a as f64, |v| v as i64);
element!(u8, DataType::U8, |a| a as f64, |v| v as i64 as u8);

/// `dst[i] = dst[i] op src[i]` for every `i`. `Avg` combines like `Sum`; the division
/// happens once, in [`finish_avg`].
///
/// # Panics
/// If the slices differ in length (an internal invariant: the algorithms size both).
pub fn reduce_into<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    let (d, s) = (
        bytemuck::cast_slice_mut::<T, u8>(dst),
        bytemuck::cast_slice::<T, u8>(src),
    );
    kernels::reduce_bytes(T::DTYPE, op, d, s);
}

/// Bytes per second this CPU combines: the median of 5 timed f32 sums of `bytes`
/// bytes, after one to warm the pages (the reduction rate of the cost model that
/// `FERROCCL_COST_MODEL=measure` and `ferroccl bench --law` write).
pub fn measured_rate(bytes: usize) -> f64 {
    let n = (bytes / 4).max(1);
    let src = vec![1.0f32; n];
    let mut dst = vec![2.0f32; n];
    reduce_into(&mut dst, &src, ReduceOp::Sum);
    let mut ts: Vec<f64> = (0..5)
        .map(|_| {
            let t0 = std::time::Instant::now();
            reduce_into(&mut dst, &src, ReduceOp::Sum);
            t0.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    // A reduction too fast for the clock still gets a finite rate.
    (4 * n) as f64 / ts[2].max(1e-9)
}

/// Divides every element by `n` (the last step of `Avg`). No-op for non-float types.
pub fn finish_avg<T: Element>(dst: &mut [T], n: usize) {
    kernels::scale_bytes(T::DTYPE, bytemuck::cast_slice_mut::<T, u8>(dst), n);
}

pub(crate) mod kernels;

/// How received bytes are combined into the local buffer: the CPU kernels
/// ([`HostCombine`]), or a device's (`cuda`). The engine calls it as frames arrive;
/// a failure (a device error) ends the operation with that error.
pub(crate) trait Combine {
    /// `dst = dst op src`, elementwise over whole elements.
    fn reduce(&mut self, dst: &mut [u8], src: &[u8]) -> Result<()>;
    /// Runs once on bytes whose reduction is complete: `Avg`'s division.
    fn finish(&mut self, dst: &mut [u8]) -> Result<()>;
}

/// [`Combine`] with the CPU kernels, for `op` on elements of `dtype` over `world_size`
/// ranks.
pub(crate) struct HostCombine {
    pub dtype: DataType,
    pub op: ReduceOp,
    pub world_size: usize,
}

impl Combine for HostCombine {
    fn reduce(&mut self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        kernels::reduce_bytes(self.dtype, self.op, dst, src);
        Ok(())
    }

    fn finish(&mut self, dst: &mut [u8]) -> Result<()> {
        if self.op == ReduceOp::Avg {
            kernels::scale_bytes(self.dtype, dst, self.world_size);
        }
        Ok(())
    }
}

/// [`Combine`] for collectives that only move data (broadcast, all-gather, send/recv,
/// and the barrier, whose frames are empty): combining bytes is a bug, reported as an
/// error.
pub(crate) struct NoCombine;

impl Combine for NoCombine {
    fn reduce(&mut self, dst: &mut [u8], _: &[u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(
            "internal: a data-moving collective tried to combine".into(),
        ))
    }

    fn finish(&mut self, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_op_refuses_avg_for_every_integer_type() {
        let mut refused = Vec::new();
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                match check_op(dtype, op) {
                    Ok(()) => assert!(
                        dtype.is_float() || op != ReduceOp::Avg,
                        "{op} on {dtype} must be refused"
                    ),
                    Err(Error::UnsupportedOp {
                        op: o, dtype: d, ..
                    }) => {
                        assert_eq!((o, d), (op, dtype), "the error names the request");
                        assert_eq!(
                            op,
                            ReduceOp::Avg,
                            "only Avg is refused, not {op} on {dtype}"
                        );
                        assert!(!dtype.is_float(), "Avg on {dtype} is defined");
                        refused.push(dtype);
                    }
                    Err(e) => panic!("unexpected error for {op} on {dtype}: {e}"),
                }
            }
        }
        assert_eq!(refused, [DataType::I32, DataType::I64, DataType::U8]);
    }

    #[test]
    fn names_parse_back() {
        for dt in DataType::ALL {
            assert_eq!(DataType::parse(dt.name()).ok(), Some(dt));
            assert_eq!(DataType::parse(&dt.name().to_uppercase()).ok(), Some(dt));
            assert_eq!(dt.to_string(), dt.name());
            assert_eq!(DataType::from_code(dt.code()), Some(dt));
        }
        for (alias, dt) in [
            ("f32", DataType::F32),
            ("float32", DataType::F32),
            ("f64", DataType::F64),
            ("float64", DataType::F64),
            ("f16", DataType::F16),
            ("float16", DataType::F16),
            ("bf16", DataType::BF16),
            ("i32", DataType::I32),
            ("int", DataType::I32),
            ("i64", DataType::I64),
            ("u8", DataType::U8),
        ] {
            assert_eq!(DataType::parse(alias).ok(), Some(dt), "{alias}");
        }
        assert!(matches!(
            DataType::parse("float8"),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(DataType::from_code(DataType::ALL.len() as u8), None);
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::parse(op.name()).ok(), Some(op));
            assert_eq!(ReduceOp::parse(&op.name().to_uppercase()).ok(), Some(op));
            assert_eq!(op.to_string(), op.name());
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
        }
        assert!(matches!(
            ReduceOp::parse("mean"),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(ReduceOp::from_code(ReduceOp::ALL.len() as u8), None);
    }
}
