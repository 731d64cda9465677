//! What the library's tests share: the harness of [`ferroccl::testing`], plus inputs
//! and f64 references for checking collectives.
#![allow(dead_code)]

pub mod checks;

pub use ferroccl::testing::*;
use ferroccl::{DataType, Element, ReduceOp};

// ---- inputs and references shared by the collective tests ----

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Rank `rank`'s input for a test case: values chosen so that the reference is
/// meaningful (no overflow for floats, wrapping exercised only where intended).
pub fn input<T: Element>(seed: u64, rank: usize, count: usize, op: ReduceOp) -> Vec<T> {
    (0..count)
        .map(|i| {
            let h = splitmix(seed ^ ((rank as u64) << 40) ^ i as u64);
            let u = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
            let v = match (T::DTYPE.is_float(), op) {
                (true, ReduceOp::Prod) => 0.5 + 1.5 * u,
                (true, _) => 8.0 * u - 4.0,
                (false, ReduceOp::Prod) => {
                    (h % 4) as f64 - if T::DTYPE == DataType::U8 { 0.0 } else { 1.0 }
                }
                (false, _) => (h % 61) as f64 - if T::DTYPE == DataType::U8 { 0.0 } else { 30.0 },
            };
            T::from_f64(v)
        })
        .collect()
}

pub fn eps(dt: DataType) -> f64 {
    match dt {
        DataType::F16 => 2f64.powi(-10),
        DataType::BF16 => 2f64.powi(-7),
        DataType::F32 => 2f64.powi(-23),
        DataType::F64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

/// The f64 reference of reducing `xs` (one value per rank) with `op`, and the scale
/// against which rounding is judged.
pub fn reference(op: ReduceOp, xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let abs: f64 = xs.iter().map(|x| x.abs()).sum();
    match op {
        ReduceOp::Sum => (xs.iter().sum(), abs),
        ReduceOp::Avg => (xs.iter().sum::<f64>() / n, abs / n),
        ReduceOp::Prod => {
            let p: f64 = xs.iter().product();
            (p, p.abs())
        }
        ReduceOp::Min => (xs.iter().cloned().fold(f64::INFINITY, f64::min), 0.0),
        ReduceOp::Max => (xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max), 0.0),
        _ => unreachable!("unknown op"),
    }
}

/// Whether `got` matches the reference: exactly for integers, within the rounding of
/// `n` pairwise steps (plus the final rounding and Avg's division) for floats.
pub fn close<T: Element>(got: T, want: f64, scale: f64, n: usize) -> bool {
    if T::DTYPE.is_float() {
        let tol = (n as f64 + 2.0) * eps(T::DTYPE) * scale.max(want.abs());
        (got.to_f64() - want).abs() <= tol
    } else {
        got == T::from_f64(want)
    }
}

/// Calls `$f::<T>($args)` for the element type named by `$dt` (a `DataType`).
#[macro_export]
macro_rules! for_dtype {
    ($dt:expr, $f:ident ( $($arg:expr),* )) => {
        match $dt {
            ferroccl::DataType::F32 => $f::<f32>($($arg),*),
            ferroccl::DataType::F64 => $f::<f64>($($arg),*),
            ferroccl::DataType::F16 => $f::<half::f16>($($arg),*),
            ferroccl::DataType::BF16 => $f::<half::bf16>($($arg),*),
            ferroccl::DataType::I32 => $f::<i32>($($arg),*),
            ferroccl::DataType::I64 => $f::<i64>($($arg),*),
            ferroccl::DataType::U8 => $f::<u8>($($arg),*),
            _ => unreachable!("unknown dtype"),
        }
    };
}

/// Fails the rank with a typed error (not a panic: the harness names the rank and
/// its message) unless `ok`.
pub fn ensure(ok: bool, what: impl FnOnce() -> String) -> ferroccl::Result<()> {
    if ok {
        Ok(())
    } else {
        Err(ferroccl::Error::InvalidArgument(format!(
            "check failed: {}",
            what()
        )))
    }
}
