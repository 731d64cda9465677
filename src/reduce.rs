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
use half::{bf16, f16};
use std::fmt;

/// A reduction operator, as in NCCL (`ncclSum`, ...) and MPI (`MPI_SUM`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise product.
    Prod,
    /// Elementwise minimum.
    Min,
    /// Elementwise maximum.
    Max,
    /// Sum divided by the world size (floating types only).
    Avg,
}

impl ReduceOp {
    /// Every operator, for tests and sweeps.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

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

    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        Self::ALL.get(c as usize).copied()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type of a buffer, carried on the wire so ranks can check they agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DataType {
    /// Every type, for tests and sweeps.
    pub const ALL: [DataType; 7] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::BF16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 => 4,
            DataType::F64 | DataType::I64 => 8,
            DataType::F16 | DataType::BF16 => 2,
            DataType::U8 => 1,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F64 | DataType::F16 | DataType::BF16
        )
    }

    /// The name nccl-tests prints (`float`, `double`, `half`, `bfloat16`, `int32`, `int64`, `uint8`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::F16 => "half",
            DataType::BF16 => "bfloat16",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::U8 => "uint8",
        }
    }

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

    pub(crate) fn code(self) -> u8 {
        match self {
            DataType::F32 => 0,
            DataType::F64 => 1,
            DataType::F16 => 2,
            DataType::BF16 => 3,
            DataType::I32 => 4,
            DataType::I64 => 5,
            DataType::U8 => 6,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        Self::ALL.get(c as usize).copied()
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Checks that `op` is defined for `dtype` (today: `Avg` needs a floating type).
pub fn check_op(dtype: DataType, op: ReduceOp) -> Result<()> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(Error::UnsupportedOp {
            op,
            dtype,
            why: "integer averages are refused because a wrapped sum divided by the world size is silently wrong; reduce with Sum and divide in a wider type",
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

/// Divides every element by `n` (the last step of `Avg`). No-op for non-float types.
pub fn finish_avg<T: Element>(dst: &mut [T], n: usize) {
    kernels::scale_bytes(T::DTYPE, bytemuck::cast_slice_mut::<T, u8>(dst), n);
}

/// The same kernels addressed by [`DataType`] on byte slices, for code that has only
/// bytes in hand (the ring works on byte ranges). Slices must be aligned for the type
/// and a whole number of elements.
pub(crate) mod kernels {
    use super::*;

    /// `dst = dst op src` over raw bytes of type `dt`.
    pub fn reduce_bytes(dt: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "reduce_bytes: length mismatch");
        match dt {
            DataType::F32 => float::<f32>(op, cast_mut(dst), cast(src)),
            DataType::F64 => float::<f64>(op, cast_mut(dst), cast(src)),
            DataType::F16 => half_f16(op, cast_mut(dst), cast(src)),
            DataType::BF16 => half_bf16(op, cast_mut(dst), cast(src)),
            DataType::I32 => int_i32(op, cast_mut(dst), cast(src)),
            DataType::I64 => int_i64(op, cast_mut(dst), cast(src)),
            DataType::U8 => int_u8(op, dst, src),
        }
    }

    /// Divides each element of type `dt` by `n`.
    pub fn scale_bytes(dt: DataType, dst: &mut [u8], n: usize) {
        match dt {
            DataType::F32 => {
                let inv = n as f32;
                for x in cast_mut::<f32>(dst) {
                    *x /= inv;
                }
            }
            DataType::F64 => {
                let inv = n as f64;
                for x in cast_mut::<f64>(dst) {
                    *x /= inv;
                }
            }
            DataType::F16 => {
                for x in cast_mut::<f16>(dst) {
                    *x = f16::from_f32(x.to_f32() / n as f32);
                }
            }
            DataType::BF16 => {
                for x in cast_mut::<bf16>(dst) {
                    *x = bf16::from_f32(x.to_f32() / n as f32);
                }
            }
            _ => {}
        }
    }

    fn cast_mut<T: bytemuck::Pod>(b: &mut [u8]) -> &mut [T] {
        bytemuck::cast_slice_mut(b)
    }
    fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
        bytemuck::cast_slice(b)
    }

    trait Float: Copy + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
        fn min(self, o: Self) -> Self;
        fn max(self, o: Self) -> Self;
    }
    impl Float for f32 {
        fn min(self, o: Self) -> Self {
            f32::min(self, o)
        }
        fn max(self, o: Self) -> Self {
            f32::max(self, o)
        }
    }
    impl Float for f64 {
        fn min(self, o: Self) -> Self {
            f64::min(self, o)
        }
        fn max(self, o: Self) -> Self {
            f64::max(self, o)
        }
    }

    fn float<T: Float>(op: ReduceOp, d: &mut [T], s: &[T]) {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(a, b)| *a = *a + *b),
            ReduceOp::Prod => d.iter_mut().zip(s).for_each(|(a, b)| *a = *a * *b),
            ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, b)| *a = a.min(*b)),
            ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, b)| *a = a.max(*b)),
        }
    }

    fn half_f16(op: ReduceOp, d: &mut [f16], s: &[f16]) {
        for (a, b) in d.iter_mut().zip(s) {
            let (x, y) = (a.to_f32(), b.to_f32());
            *a = f16::from_f32(combine(op, x, y));
        }
    }

    fn half_bf16(op: ReduceOp, d: &mut [bf16], s: &[bf16]) {
        for (a, b) in d.iter_mut().zip(s) {
            let (x, y) = (a.to_f32(), b.to_f32());
            *a = bf16::from_f32(combine(op, x, y));
        }
    }

    #[inline]
    fn combine(op: ReduceOp, x: f32, y: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Min => x.min(y),
            ReduceOp::Max => x.max(y),
        }
    }

    macro_rules! int_kernel {
        ($name:ident, $t:ty) => {
            fn $name(op: ReduceOp, d: &mut [$t], s: &[$t]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => d
                        .iter_mut()
                        .zip(s)
                        .for_each(|(a, b)| *a = a.wrapping_add(*b)),
                    ReduceOp::Prod => d
                        .iter_mut()
                        .zip(s)
                        .for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                    ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).min(*b)),
                    ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).max(*b)),
                }
            }
        };
    }
    int_kernel!(int_i32, i32);
    int_kernel!(int_i64, i64);
    int_kernel!(int_u8, u8);
}
