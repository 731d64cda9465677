//! The same kernels addressed by [`DataType`] on byte slices, for code that has only
//! bytes in hand (the ring works on byte ranges). Slices must be aligned for the type
//! and a whole number of elements.
//!
//! How they are built: every kernel body is a plain loop over typed slices, written so
//! that LLVM vectorises it and marked `#[inline(always)]`. Each body is compiled twice:
//! once for the baseline target (SSE2 on x86_64, NEON on aarch64) and, on x86_64, once
//! more inside `#[target_feature(enable = "avx2")]` functions (`avx2,f16c` for f16). The
//! copy to run is picked by [`isa`], which detects the CPU once and caches the answer.
//! `f16` is widened and narrowed 8 lanes at a time with F16C (`vcvtph2ps` /
//! `vcvtps2ph`, round to nearest even) on the AVX2 path, and in blocks through `half`'s
//! slice conversions otherwise; `bf16` is widened and rounded with integer bit operations
//! that vectorise on every target. In the AVX2 copy, float and i64 `Min`/`Max` are
//! written with intrinsics so that LLVM cannot turn them into masked stores (see the
//! `x86` module). The tests run every copy this CPU supports against the reference.

use super::*;
use half::slice::HalfFloatSliceExt;
use std::ops::Div;

/// Which compiled copy of the kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    /// The baseline target features; runs on every CPU of the target architecture.
    Portable,
    /// x86_64 with AVX2 and F16C. Only [`isa`] (and the tests, after detection) make
    /// this value, so holding it means the CPU has both features.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// Every copy this CPU can run, best last (tests compare them all).
    #[cfg(test)]
    pub(super) fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        if isa() != Isa::Portable {
            all.push(isa());
        }
        all
    }
}

/// The best copy for this CPU. Detection runs once; later calls are one relaxed load.
pub(super) fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::atomic::{AtomicU8, Ordering};
        const UNKNOWN: u8 = 0;
        const PORTABLE: u8 = 1;
        const AVX2: u8 = 2;
        static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);
        match DETECTED.load(Ordering::Relaxed) {
            PORTABLE => Isa::Portable,
            AVX2 => Isa::Avx2,
            _ => {
                let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
                DETECTED.store(if avx2 { AVX2 } else { PORTABLE }, Ordering::Relaxed);
                if avx2 {
                    Isa::Avx2
                } else {
                    Isa::Portable
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

/// Runs `$body` with the type alias `$O` naming the operator type of `$op`
/// (`Avg` combines like `Sum`).
macro_rules! by_op {
    ($op:expr, $O:ident => $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                type $O = Sum;
                $body
            }
            ReduceOp::Prod => {
                type $O = Prod;
                $body
            }
            ReduceOp::Min => {
                type $O = Min;
                $body
            }
            ReduceOp::Max => {
                type $O = Max;
                $body
            }
        }
    };
}

/// `dst = dst op src` over raw bytes of type `dt`.
pub fn reduce_bytes(dt: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_with(isa(), dt, op, dst, src);
}

/// [`reduce_bytes`] on a chosen copy of the kernels.
pub(super) fn reduce_with(isa: Isa, dt: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_bytes: length mismatch");
    match dt {
        DataType::F32 => by_op!(op, O => zip::<f32, O>(isa, cast_mut(dst), cast(src))),
        DataType::F64 => by_op!(op, O => zip::<f64, O>(isa, cast_mut(dst), cast(src))),
        DataType::F16 => by_op!(op, O => f16_zip::<O>(isa, cast_mut(dst), cast(src))),
        DataType::BF16 => by_op!(op, O => bf16_zip::<O>(isa, cast_mut(dst), cast(src))),
        DataType::I32 => by_op!(op, O => zip::<i32, O>(isa, cast_mut(dst), cast(src))),
        DataType::I64 => by_op!(op, O => zip::<i64, O>(isa, cast_mut(dst), cast(src))),
        DataType::U8 => by_op!(op, O => zip::<u8, O>(isa, dst, src)),
    }
}

/// Divides each element of type `dt` by `n`.
pub fn scale_bytes(dt: DataType, dst: &mut [u8], n: usize) {
    scale_with(isa(), dt, dst, n);
}

/// [`scale_bytes`] on a chosen copy of the kernels. Divides (rather than multiplying
/// by `1/n`) so the result is the correctly rounded quotient.
pub(super) fn scale_with(isa: Isa, dt: DataType, dst: &mut [u8], n: usize) {
    match dt {
        DataType::F32 => div::<f32>(isa, cast_mut(dst), n as f32),
        DataType::F64 => div::<f64>(isa, cast_mut(dst), n as f64),
        DataType::F16 => f16_div(isa, cast_mut(dst), n as f32),
        DataType::BF16 => bf16_div(isa, cast_mut(dst), n as f32),
        DataType::I32 | DataType::I64 | DataType::U8 => {}
    }
}

fn cast_mut<T: bytemuck::Pod>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}
fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}

/// A lanewise operator `a op b`, simple enough for LLVM to vectorise.
pub(super) trait Binary<T: Copy>: Sized {
    fn apply(a: T, b: T) -> T;

    /// `d = d op s` in the AVX2 copy. The default compiles the portable loop with
    /// AVX2 enabled; operators whose vector form is a select override it (see
    /// `x86::min_max_ps`).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn zip_avx2(d: &mut [T], s: &[T]) {
        // SAFETY: this function's contract: the CPU has the features it is compiled for.
        unsafe { x86::zip::<T, Self>(d, s) }
    }
}
/// `a + b` (wrapping for integers).
pub(super) struct Sum;
/// `a * b` (wrapping for integers).
pub(super) struct Prod;
/// The smaller; for floats `f32::min`, where a NaN loses to a number.
pub(super) struct Min;
/// The larger; for floats `f32::max`, where a NaN loses to a number.
pub(super) struct Max;

macro_rules! sum_prod {
    ($($t:ty: $add:ident, $mul:ident);*) => {$(
        impl Binary<$t> for Sum {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                a.$add(b)
            }
        }
        impl Binary<$t> for Prod {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                a.$mul(b)
            }
        }
    )*};
}
use std::ops::{Add, Mul};
sum_prod!(
    f32: add, mul;
    f64: add, mul;
    i32: wrapping_add, wrapping_mul;
    i64: wrapping_add, wrapping_mul;
    u8: wrapping_add, wrapping_mul
);

// Float min/max: `f32::min` semantics (a NaN loses to a number) written as a compare
// and a select, which both vectorisers turn into `cmpps` + `blendvps`, and which
// keeps `a` when the two compare equal (`min(+0, -0)` is `+0`, `min(-0, +0)` is
// `-0`) on every path and target, so all ranks agree bit for bit. (`a.min(b)` itself
// becomes a call to `fminf` per element once the f16 block loop is unrolled, and
// that call keeps `b` on a tie where the vector code keeps `a`.)
macro_rules! min_max_float {
    ($($t:ty: $avx2:ident),*) => {$(
        impl Binary<$t> for Min {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                if b < a || a.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[cfg(target_arch = "x86_64")]
            #[inline]
            unsafe fn zip_avx2(d: &mut [$t], s: &[$t]) {
                // SAFETY: this function's contract: the CPU has the features it is compiled for.
                unsafe { x86::$avx2::<false>(d, s) }
            }
        }
        impl Binary<$t> for Max {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                if b > a || a.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[cfg(target_arch = "x86_64")]
            #[inline]
            unsafe fn zip_avx2(d: &mut [$t], s: &[$t]) {
                // SAFETY: this function's contract: the CPU has the features it is compiled for.
                unsafe { x86::$avx2::<true>(d, s) }
            }
        }
    )*};
}
min_max_float!(f32: min_max_ps, f64: min_max_pd);

macro_rules! min_max_int {
    ($($t:ty),*) => {$(
        impl Binary<$t> for Min {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
        }
        impl Binary<$t> for Max {
            #[inline(always)]
            fn apply(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
        }
    )*};
}
// i32 and u8 have native vector min/max (`vpminsd`, `vpminub`).
min_max_int!(i32, u8);

// AVX2 has no 64-bit integer min/max, so i64 gets a compare and a select; the AVX2
// copy is written by hand for the reason given at `x86::min_max_ps`.
impl Binary<i64> for Min {
    #[inline(always)]
    fn apply(a: i64, b: i64) -> i64 {
        Ord::min(a, b)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn zip_avx2(d: &mut [i64], s: &[i64]) {
        // SAFETY: this function's contract: the CPU has the features it is compiled for.
        unsafe { x86::min_max_epi64::<false>(d, s) }
    }
}
impl Binary<i64> for Max {
    #[inline(always)]
    fn apply(a: i64, b: i64) -> i64 {
        Ord::max(a, b)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn zip_avx2(d: &mut [i64], s: &[i64]) {
        // SAFETY: this function's contract: the CPU has the features it is compiled for.
        unsafe { x86::min_max_epi64::<true>(d, s) }
    }
}

// ---- Kernel bodies: compiled into each copy below. ----

#[inline(always)]
fn zip_body<T: Copy, O: Binary<T>>(d: &mut [T], s: &[T]) {
    for (a, &b) in d.iter_mut().zip(s) {
        *a = O::apply(*a, b);
    }
}

#[inline(always)]
fn div_body<T: Copy + Div<Output = T>>(d: &mut [T], n: T) {
    for a in d {
        *a = *a / n;
    }
}

/// Exact widening: a bf16 is the top half of an f32.
#[inline(always)]
pub(super) fn bf16_to_f32(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// Rounds to nearest, ties to even, bit for bit like `bf16::from_f32`: overflow goes
/// to infinity and a NaN stays a NaN with its upper payload and the quiet bit set.
/// Branch-free (adding `0x7fff + lsb` carries into the kept half exactly when RNE
/// rounds up), so it vectorises.
#[inline(always)]
pub(super) fn f32_to_bf16(x: f32) -> bf16 {
    let x = x.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x0040;
    let is_nan = x & 0x7fff_ffff > 0x7f80_0000;
    bf16::from_bits((if is_nan { quiet_nan } else { rounded }) as u16)
}

#[inline(always)]
fn bf16_zip_body<O: Binary<f32>>(d: &mut [bf16], s: &[bf16]) {
    for (a, &b) in d.iter_mut().zip(s) {
        *a = f32_to_bf16(O::apply(bf16_to_f32(*a), bf16_to_f32(b)));
    }
}

#[inline(always)]
fn bf16_div_body(d: &mut [bf16], n: f32) {
    for a in d {
        *a = f32_to_bf16(bf16_to_f32(*a) / n);
    }
}

/// f16 elements converted per block on the portable path (two 256-byte buffers).
const F16_BLOCK: usize = 64;

/// Portable f16: widen a block of each operand to f32 (`half` uses F16C or the
/// aarch64 fp16 instructions when it finds them), combine, round the block back.
fn f16_zip_portable<O: Binary<f32>>(d: &mut [f16], s: &[f16]) {
    let (mut a, mut b) = ([0f32; F16_BLOCK], [0f32; F16_BLOCK]);
    for (dc, sc) in d.chunks_mut(F16_BLOCK).zip(s.chunks(F16_BLOCK)) {
        let (a, b) = (&mut a[..dc.len()], &mut b[..sc.len()]);
        dc.convert_to_f32_slice(a);
        sc.convert_to_f32_slice(b);
        zip_body::<f32, O>(a, b);
        dc.convert_from_f32_slice(a);
    }
}

fn f16_div_portable(d: &mut [f16], n: f32) {
    let mut a = [0f32; F16_BLOCK];
    for dc in d.chunks_mut(F16_BLOCK) {
        let a = &mut a[..dc.len()];
        dc.convert_to_f32_slice(a);
        div_body(a, n);
        dc.convert_from_f32_slice(a);
    }
}

// ---- Dispatch: one `match` on the cached `Isa` per call. ----

fn zip<T: Copy, O: Binary<T>>(isa: Isa, d: &mut [T], s: &[T]) {
    match isa {
        // SAFETY: an `Isa::Avx2` exists only on a CPU with AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { O::zip_avx2(d, s) },
        Isa::Portable => zip_body::<T, O>(d, s),
    }
}

fn div<T: Copy + Div<Output = T>>(isa: Isa, d: &mut [T], n: T) {
    match isa {
        // SAFETY: as in `zip`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::div(d, n) },
        Isa::Portable => div_body(d, n),
    }
}

fn bf16_zip<O: Binary<f32>>(isa: Isa, d: &mut [bf16], s: &[bf16]) {
    match isa {
        // SAFETY: as in `zip`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::bf16_zip::<O>(d, s) },
        Isa::Portable => bf16_zip_body::<O>(d, s),
    }
}

fn bf16_div(isa: Isa, d: &mut [bf16], n: f32) {
    match isa {
        // SAFETY: as in `zip`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::bf16_div(d, n) },
        Isa::Portable => bf16_div_body(d, n),
    }
}

fn f16_zip<O: Binary<f32>>(isa: Isa, d: &mut [f16], s: &[f16]) {
    match isa {
        // SAFETY: as in `zip`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::f16_zip::<O>(d, s) },
        Isa::Portable => f16_zip_portable::<O>(d, s),
    }
}

fn f16_div(isa: Isa, d: &mut [f16], n: f32) {
    match isa {
        // SAFETY: as in `zip`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::f16_div(d, n) },
        Isa::Portable => f16_div_portable(d, n),
    }
}

/// The kernel bodies compiled a second time for AVX2 (+ F16C). Every function is
/// `unsafe` for one reason only: the CPU must have those features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    #![allow(unused_unsafe)] // intrinsics are safe to call here on newer compilers

    use super::*;
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_blendv_epi8, _mm256_blendv_pd, _mm256_blendv_ps, _mm256_cmp_pd,
        _mm256_cmp_ps, _mm256_cmpgt_epi64, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_lddqu_si256,
        _mm256_loadu_pd, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_max_pd, _mm256_max_ps,
        _mm256_min_pd, _mm256_min_ps, _mm256_storeu_pd, _mm256_storeu_ps, _mm256_storeu_si256,
        _mm_loadu_si128, _mm_storeu_si128, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
    };

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn zip<T: Copy, O: Binary<T>>(d: &mut [T], s: &[T]) {
        zip_body::<T, O>(d, s)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn div<T: Copy + Div<Output = T>>(d: &mut [T], n: T) {
        div_body(d, n)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_zip<O: Binary<f32>>(d: &mut [bf16], s: &[bf16]) {
        bf16_zip_body::<O>(d, s)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_div(d: &mut [bf16], n: f32) {
        bf16_div_body(d, n)
    }

    // Why float and i64 min/max are written out here: the natural loop computes
    // `select(b < a, b, a)` and stores it back to `a`'s address, and LLVM (since
    // 2025) folds `store(select(m, x, load p), p)` into a masked store
    // (`vmaskmovps` / `vpmaskmovq`), which is microcoded and very slow on AMD Zen 1-3
    // (llvm/llvm-project#213195). It also writes only the changed lanes, which makes
    // benchmarks look better than real data. Here the select's other arm is never a
    // plain load of the destination: floats use `vminps`/`vmaxps` (opaque to that
    // fold) and fix up a NaN in `a` with a blend; i64 reads `a` with `vlddqu`.

    /// Runs `step` on blocks of `N` elements of `d` and `s`; a short tail goes
    /// through a zero-padded block, so it takes the same instructions as the body.
    #[inline(always)]
    fn padded_blocks<T: Copy + Default, const N: usize>(
        d: &mut [T],
        s: &[T],
        mut step: impl FnMut(&mut [T], &[T]),
    ) {
        let mut dc = d.chunks_exact_mut(N);
        let mut sc = s.chunks_exact(N);
        for (a, b) in (&mut dc).zip(&mut sc) {
            step(a, b);
        }
        let (ta, tb) = (dc.into_remainder(), sc.remainder());
        if !ta.is_empty() {
            let (mut pa, mut pb) = ([T::default(); N], [T::default(); N]);
            pa[..ta.len()].copy_from_slice(ta);
            pb[..tb.len()].copy_from_slice(tb);
            step(&mut pa, &pb);
            ta.copy_from_slice(&pa[..ta.len()]);
        }
    }

    /// Float min/max, 4 vectors per block; `MAX` picks the operator. Same result
    /// as [`Min`]/[`Max`]: `vminps(b, a)` is `b < a ? b : a`, so a NaN in `b` or a
    /// tie keeps `a`, and the blend takes `b` where `a` is NaN.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn min_max_ps<const MAX: bool>(d: &mut [f32], s: &[f32]) {
        padded_blocks::<f32, 32>(d, s, |a, b| {
            for (a, b) in a.chunks_exact_mut(8).zip(b.chunks_exact(8)) {
                // SAFETY: both chunks hold exactly 8 elements.
                unsafe {
                    let x = _mm256_loadu_ps(a.as_ptr());
                    let y = _mm256_loadu_ps(b.as_ptr());
                    let m = if MAX {
                        _mm256_max_ps(y, x)
                    } else {
                        _mm256_min_ps(y, x)
                    };
                    let r = _mm256_blendv_ps(m, y, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
                    _mm256_storeu_ps(a.as_mut_ptr(), r);
                }
            }
        })
    }

    /// As [`min_max_ps`], for f64.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn min_max_pd<const MAX: bool>(d: &mut [f64], s: &[f64]) {
        padded_blocks::<f64, 16>(d, s, |a, b| {
            for (a, b) in a.chunks_exact_mut(4).zip(b.chunks_exact(4)) {
                // SAFETY: both chunks hold exactly 4 elements.
                unsafe {
                    let x = _mm256_loadu_pd(a.as_ptr());
                    let y = _mm256_loadu_pd(b.as_ptr());
                    let m = if MAX {
                        _mm256_max_pd(y, x)
                    } else {
                        _mm256_min_pd(y, x)
                    };
                    let r = _mm256_blendv_pd(m, y, _mm256_cmp_pd::<_CMP_UNORD_Q>(x, x));
                    _mm256_storeu_pd(a.as_mut_ptr(), r);
                }
            }
        })
    }

    /// i64 min/max, 4 vectors per block: `vpcmpgtq` and a blend, with `a` read by
    /// `vlddqu` (as fast as `vmovdqu`) so the blend is not folded into a masked
    /// store.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn min_max_epi64<const MAX: bool>(d: &mut [i64], s: &[i64]) {
        padded_blocks::<i64, 16>(d, s, |a, b| {
            for (a, b) in a.chunks_exact_mut(4).zip(b.chunks_exact(4)) {
                // SAFETY: both chunks hold exactly 4 elements.
                unsafe {
                    let x = _mm256_lddqu_si256(a.as_ptr().cast::<__m256i>());
                    let y = _mm256_loadu_si256(b.as_ptr().cast::<__m256i>());
                    let take_b = if MAX {
                        _mm256_cmpgt_epi64(y, x)
                    } else {
                        _mm256_cmpgt_epi64(x, y)
                    };
                    let r = _mm256_blendv_epi8(x, y, take_b);
                    _mm256_storeu_si256(a.as_mut_ptr().cast::<__m256i>(), r);
                }
            }
        })
    }

    /// f16 elements per block: widened into two 256-byte f32 buffers, combined by the
    /// loop vectoriser (which handles `minnum`/`maxnum`; the SLP vectoriser does not
    /// for 8 lanes), rounded back.
    const BLOCK: usize = 64;

    /// Widens a block of f16 (exact, `vcvtph2ps`), 8 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen(src: &[f16], dst: &mut [f32; BLOCK]) {
        for (h, f) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
            // SAFETY: both chunks hold exactly 8 elements.
            unsafe {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast::<__m128i>()));
                _mm256_storeu_ps(f.as_mut_ptr(), v);
            }
        }
    }

    /// Rounds a block to f16, to nearest with ties to even (`vcvtps2ph` with the
    /// rounding mode in the immediate, so MXCSR does not matter).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn narrow(src: &[f32; BLOCK], dst: &mut [f16]) {
        for (f, h) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
            // SAFETY: both chunks hold exactly 8 elements.
            unsafe {
                let v = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(f.as_ptr()));
                _mm_storeu_si128(h.as_mut_ptr().cast::<__m128i>(), v);
            }
        }
    }

    /// One block of `d = d op s`; both slices hold `BLOCK` elements.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn zip_block<O: Binary<f32>>(d: &mut [f16], s: &[f16]) {
        let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
        // SAFETY: this function's contract: the CPU has the features it is compiled for.
        unsafe {
            widen(d, &mut x);
            widen(s, &mut y);
            zip_body::<f32, O>(&mut x, &y);
            narrow(&x, d);
        }
    }

    /// One block of `d = d / n`; `d` holds `BLOCK` elements.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn div_block(d: &mut [f16], n: f32) {
        let mut x = [0f32; BLOCK];
        // SAFETY: this function's contract: the CPU has the features it is compiled for.
        unsafe {
            widen(d, &mut x);
            div_body(&mut x, n);
            narrow(&x, d);
        }
    }

    /// f16 `d = d op s`, a block at a time.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_zip<O: Binary<f32>>(d: &mut [f16], s: &[f16]) {
        // SAFETY: the blocks hold `BLOCK` elements; the CPU has F16C (our contract).
        padded_blocks::<f16, BLOCK>(d, s, |a, b| unsafe { zip_block::<O>(a, b) })
    }

    /// f16 `d = d / n`, as [`f16_zip`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_div(d: &mut [f16], n: f32) {
        let mut dc = d.chunks_exact_mut(BLOCK);
        for a in &mut dc {
            // SAFETY: this function's contract: the CPU has the features it is compiled for.
            unsafe { div_block(a, n) };
        }
        let ta = dc.into_remainder();
        if !ta.is_empty() {
            let mut pa = [f16::ZERO; BLOCK];
            pa[..ta.len()].copy_from_slice(ta);
            // SAFETY: this function's contract: the CPU has the features it is compiled for.
            unsafe { div_block(&mut pa, n) };
            ta.copy_from_slice(&pa[..ta.len()]);
        }
    }
}

#[cfg(test)]
#[path = "kernels_tests.rs"]
mod tests;
