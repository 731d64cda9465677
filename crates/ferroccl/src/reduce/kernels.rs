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
mod tests {
    use super::*;
    use super::{self as kernels, Isa};
    use proptest::prelude::*;

    /// splitmix64: a tiny deterministic generator, so a failure names a reproducible case.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Lengths that cover empty, every tail length of every vector width and block
    /// size (up to 64 lanes + 6), and long buffers with odd tails.
    fn lengths() -> impl Iterator<Item = usize> {
        (0..=70).chain([127, 128, 129, 1000, 4099, 65_557])
    }

    /// Values that matter for floats, given in f64 and rounded to the type.
    const SPECIALS: [f64; 14] = [
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1.0,
        -1.0,
        0.5,
        65504.0,   // f16::MAX
        6.0e-8,    // an f16 subnormal
        1.0e-40,   // an f32 subnormal
        3.0e38,    // near f32::MAX: sums overflow
        1.0e300,   // f64 only
        -2.5e-310, // an f64 subnormal
    ];

    /// What the kernel must produce, element by element.
    trait Case: Element {
        /// A value from 64 random bits: raw bit patterns (NaN, infinities, subnormals
        /// included), special values, and small numbers whose sums are exact or ties.
        fn random(r: &mut Rng) -> Self;
        /// The reference result of `a op b`.
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
        /// Equal bits, or both NaN (NaN payloads may differ between paths).
        fn same(a: Self, b: Self) -> bool;
    }

    /// The float min/max the module documents: a NaN loses to a number, and a tie keeps
    /// `a` (the destination).
    macro_rules! float_ref {
        ($t:ty, $min:ident, $max:ident) => {
            fn $min(a: $t, b: $t) -> $t {
                if a.is_nan() {
                    b
                } else if b.is_nan() {
                    a
                } else if b < a {
                    b
                } else {
                    a
                }
            }
            fn $max(a: $t, b: $t) -> $t {
                if a.is_nan() {
                    b
                } else if b.is_nan() {
                    a
                } else if b > a {
                    b
                } else {
                    a
                }
            }
        };
    }
    float_ref!(f32, min32, max32);
    float_ref!(f64, min64, max64);

    fn float_random<T: Element>(r: &mut Rng, raw: impl FnOnce(u64) -> T) -> T {
        match r.below(4) {
            0 => raw(r.next()),
            1 => T::from_f64(SPECIALS[r.below(SPECIALS.len() as u64) as usize]),
            _ => T::from_f64((r.below(4001) as f64 - 2000.0) / 16.0),
        }
    }

    /// The f32 step that f16 and bf16 are defined by.
    fn combine32(op: ReduceOp, x: f32, y: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Min => min32(x, y),
            ReduceOp::Max => max32(x, y),
        }
    }

    impl Case for f32 {
        fn random(r: &mut Rng) -> Self {
            float_random(r, |b| f32::from_bits(b as u32))
        }
        // The f64 oracle: f64 has more than 2 * 24 + 2 bits, so rounding the exact-ish
        // f64 result to f32 equals the f32 operation.
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            let (x, y) = (a as f64, b as f64);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => (x + y) as f32,
                ReduceOp::Prod => (x * y) as f32,
                ReduceOp::Min => min32(a, b),
                ReduceOp::Max => max32(a, b),
            }
        }
        fn same(a: Self, b: Self) -> bool {
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
        }
    }

    impl Case for f64 {
        fn random(r: &mut Rng) -> Self {
            float_random(r, f64::from_bits)
        }
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min => min64(a, b),
                ReduceOp::Max => max64(a, b),
            }
        }
        fn same(a: Self, b: Self) -> bool {
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
        }
    }

    impl Case for f16 {
        fn random(r: &mut Rng) -> Self {
            float_random(r, |b| f16::from_bits(b as u16))
        }
        // The documented semantics, per element: widen, combine in f32, round once.
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            f16::from_f32(combine32(op, a.to_f32(), b.to_f32()))
        }
        fn same(a: Self, b: Self) -> bool {
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
        }
    }

    impl Case for bf16 {
        fn random(r: &mut Rng) -> Self {
            float_random(r, |b| bf16::from_bits(b as u16))
        }
        fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
            bf16::from_f32(combine32(op, a.to_f32(), b.to_f32()))
        }
        fn same(a: Self, b: Self) -> bool {
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
        }
    }

    /// Integers: the reference computes in i128 and truncates, which is wrapping.
    macro_rules! int_case {
        ($($t:ty),*) => {$(
            impl Case for $t {
                fn random(r: &mut Rng) -> Self {
                    match r.below(4) {
                        0 => <$t>::MAX - r.below(3) as $t,
                        1 => <$t>::MIN.wrapping_add(r.below(3) as $t),
                        _ => r.next() as $t,
                    }
                }
                fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                    let (x, y) = (a as i128, b as i128);
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => (x + y) as $t,
                        ReduceOp::Prod => (x * y) as $t,
                        ReduceOp::Min => x.min(y) as $t,
                        ReduceOp::Max => x.max(y) as $t,
                    }
                }
                fn same(a: Self, b: Self) -> bool {
                    a == b
                }
            }
        )*};
    }
    int_case!(i32, i64, u8);

    /// Runs the kernel copy `isa` on `dst`/`src` and checks every element.
    fn check_slices<T: Case>(isa: Isa, op: ReduceOp, dst: &mut [T], src: &[T], what: &str) {
        let before = dst.to_vec();
        kernels::reduce_with(
            isa,
            T::DTYPE,
            op,
            bytemuck::cast_slice_mut(dst),
            bytemuck::cast_slice(src),
        );
        for (i, ((&a, &b), &got)) in before.iter().zip(src).zip(dst.iter()).enumerate() {
            let want = T::reference(op, a, b);
            assert!(
                T::same(got, want),
                "{what}: {isa:?} {} {op}, len {}, [{i}]: {a:?} op {b:?} gave {got:?}, want {want:?}",
                T::DTYPE,
                dst.len(),
            );
        }
    }

    /// Random operands of every length, at offsets 0 and 1 so vector bodies start at
    /// unaligned addresses too.
    fn sweep<T: Case>(seed: u64) {
        let mut r = Rng(seed);
        for isa in Isa::available() {
            for op in ReduceOp::ALL {
                for len in lengths() {
                    for off in 0..2 {
                        let mut dst: Vec<T> = (0..len + off).map(|_| T::random(&mut r)).collect();
                        let src: Vec<T> = (0..len + off).map(|_| T::random(&mut r)).collect();
                        check_slices(isa, op, &mut dst[off..], &src[off..], "sweep");
                    }
                }
            }
        }
    }

    #[test]
    fn f32_matches_f64_oracle() {
        sweep::<f32>(1);
    }
    #[test]
    fn f64_matches_scalar_reference() {
        sweep::<f64>(2);
    }
    #[test]
    fn f16_matches_per_element_formula() {
        sweep::<f16>(3);
    }
    #[test]
    fn bf16_matches_per_element_formula() {
        sweep::<bf16>(4);
    }
    #[test]
    fn i32_matches_wrapping_reference() {
        sweep::<i32>(5);
    }
    #[test]
    fn i64_matches_wrapping_reference() {
        sweep::<i64>(6);
    }
    #[test]
    fn u8_matches_wrapping_reference() {
        sweep::<u8>(7);
    }

    /// The public entry point (default kernel copy) on a few lengths.
    fn public_path<T: Case>(seed: u64) {
        let mut r = Rng(seed);
        for op in ReduceOp::ALL {
            for len in [0, 1, 7, 33, 1000] {
                let mut dst: Vec<T> = (0..len).map(|_| T::random(&mut r)).collect();
                let src: Vec<T> = (0..len).map(|_| T::random(&mut r)).collect();
                let want: Vec<T> = dst
                    .iter()
                    .zip(&src)
                    .map(|(&a, &b)| T::reference(op, a, b))
                    .collect();
                reduce_into(&mut dst, &src, op);
                for (i, (&got, &want)) in dst.iter().zip(&want).enumerate() {
                    assert!(
                        T::same(got, want),
                        "reduce_into {} {op} len {len} [{i}]: {got:?} != {want:?}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    #[test]
    fn reduce_into_runs_the_same_kernels() {
        public_path::<f32>(11);
        public_path::<f64>(12);
        public_path::<f16>(13);
        public_path::<bf16>(14);
        public_path::<i32>(15);
        public_path::<i64>(16);
        public_path::<u8>(17);
    }

    #[test]
    #[should_panic(expected = "length mismatch")]
    fn reduce_into_refuses_different_lengths() {
        let mut dst = [1.0f32; 3];
        reduce_into(&mut dst, &[1.0f32; 4], ReduceOp::Sum);
    }

    /// Every 16-bit pattern against a permutation of every pattern, for both halves.
    fn all_patterns<T: Case>(from_bits: fn(u16) -> T) {
        for isa in Isa::available() {
            for op in ReduceOp::ALL {
                for mult in [40_503u32, 1] {
                    let mut dst: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
                    // An odd multiplier permutes 0..65536; `1` pairs each value with itself.
                    let src: Vec<T> = (0..=u16::MAX as u32)
                        .map(|i| from_bits((i.wrapping_mul(mult) ^ 0x5555) as u16))
                        .collect();
                    check_slices(isa, op, &mut dst, &src, "all patterns");
                }
            }
        }
    }

    #[test]
    fn f16_every_bit_pattern_is_bit_exact() {
        all_patterns::<f16>(f16::from_bits);
    }

    #[test]
    fn bf16_every_bit_pattern_is_bit_exact() {
        all_patterns::<bf16>(bf16::from_bits);
    }

    #[test]
    fn bf16_narrowing_matches_half_bit_for_bit() {
        let check = |x: u32| {
            let f = f32::from_bits(x);
            let (got, want) = (kernels::f32_to_bf16(f), bf16::from_f32(f));
            assert_eq!(got.to_bits(), want.to_bits(), "f32 bits {x:#010x}");
        };
        // Every sign/exponent/upper mantissa, with the low half at each rounding case:
        // exact, just above zero, just below the tie, the tie, just above, all ones.
        for hi in 0..=u16::MAX as u32 {
            for lo in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                check(hi << 16 | lo);
            }
        }
        let mut r = Rng(99);
        for _ in 0..1_000_000 {
            check(r.next() as u32);
        }
    }

    #[test]
    fn bf16_widening_is_exact() {
        for bits in 0..=u16::MAX {
            let (got, want) = (
                kernels::bf16_to_f32(bf16::from_bits(bits)),
                bf16::from_bits(bits).to_f32(),
            );
            // `half` sets the quiet bit when widening a NaN; we leave it to the f32
            // operation (which quiets) and to the narrowing (which sets it again).
            assert!(
                f32::same(got, want),
                "bf16 bits {bits:#06x}: {got:?} != {want:?}"
            );
            assert_eq!(
                got.to_bits() >> 16,
                bits as u32,
                "the low half must be zero"
            );
        }
    }

    /// NaN on either side, both sides, infinities and signed zeros, at every lane
    /// position of a 37-element buffer (vector body plus tail).
    /// `v` is `[nan, 1, 2, -3, +inf, -inf, +0, -0]` in the type.
    fn min_max_cases<T: Case>(v: [T; 8]) {
        let [nan, one, two, m3, inf, ninf, pz, nz] = v;
        // (dst, src, min, max); a tie keeps dst.
        let cases = [
            (nan, one, one, one),
            (one, nan, one, one),
            (nan, nan, nan, nan),
            (ninf, nan, ninf, ninf),
            (nan, inf, inf, inf),
            (two, m3, m3, two),
            (m3, two, m3, two),
            (ninf, inf, ninf, inf),
            (pz, nz, pz, pz),
            (nz, pz, nz, nz),
        ];
        for isa in Isa::available() {
            for len in [1, 10, 37, 101] {
                for shift in 0..cases.len() {
                    let pick = |i: usize| cases[(i + shift) % cases.len()];
                    for (op, col) in [(ReduceOp::Min, 2), (ReduceOp::Max, 3)] {
                        let mut dst: Vec<T> = (0..len).map(|i| pick(i).0).collect();
                        let src: Vec<T> = (0..len).map(|i| pick(i).1).collect();
                        kernels::reduce_with(
                            isa,
                            T::DTYPE,
                            op,
                            bytemuck::cast_slice_mut(&mut dst),
                            bytemuck::cast_slice(&src),
                        );
                        for (i, &got) in dst.iter().enumerate() {
                            let c = pick(i);
                            let want = if col == 2 { c.2 } else { c.3 };
                            assert!(T::same(got, want), "{isa:?} {} {op} len {len} [{i}]: {:?} op {:?} gave {got:?}, want {want:?}", T::DTYPE, c.0, c.1);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn float_min_max_nan_loses_to_a_number() {
        min_max_cases::<f32>([
            f32::NAN,
            1.0,
            2.0,
            -3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        min_max_cases::<f64>([
            f64::NAN,
            1.0,
            2.0,
            -3.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        let h = f16::from_f32;
        min_max_cases::<f16>([
            f16::NAN,
            h(1.0),
            h(2.0),
            h(-3.0),
            f16::INFINITY,
            f16::NEG_INFINITY,
            f16::ZERO,
            f16::NEG_ZERO,
        ]);
        let b = bf16::from_f32;
        min_max_cases::<bf16>([
            bf16::NAN,
            b(1.0),
            b(2.0),
            b(-3.0),
            bf16::INFINITY,
            bf16::NEG_INFINITY,
            bf16::ZERO,
            bf16::NEG_ZERO,
        ]);
    }

    #[test]
    fn float_min_max_agree_with_std_on_values() {
        // The module doc promises `f32::min`/`f32::max`; std leaves the sign of a zero
        // tie open, so compare as values (where +0 == -0) and NaN as NaN.
        let mut r = Rng(21);
        for isa in Isa::available() {
            for (op, std_op) in [
                (ReduceOp::Min, f32::min as fn(f32, f32) -> f32),
                (ReduceOp::Max, f32::max),
            ] {
                let mut dst: Vec<f32> = (0..999).map(|_| f32::random(&mut r)).collect();
                let src: Vec<f32> = (0..999).map(|_| f32::random(&mut r)).collect();
                let want: Vec<f32> = dst.iter().zip(&src).map(|(&a, &b)| std_op(a, b)).collect();
                kernels::reduce_with(
                    isa,
                    DataType::F32,
                    op,
                    bytemuck::cast_slice_mut(&mut dst),
                    bytemuck::cast_slice(&src),
                );
                for (i, (&got, &want)) in dst.iter().zip(&want).enumerate() {
                    assert!(
                        got == want || (got.is_nan() && want.is_nan()),
                        "{isa:?} {op} [{i}]: {got} vs std {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn integer_sum_and_prod_wrap() {
        let mut a = [i32::MAX, i32::MIN, 70_000];
        reduce_into(&mut a, &[1, -1, 70_000], ReduceOp::Sum);
        assert_eq!(a, [i32::MIN, i32::MAX, 140_000]);
        reduce_into(&mut a, &[1, 1, 70_000], ReduceOp::Prod);
        assert_eq!(a, [i32::MIN, i32::MAX, 140_000i32.wrapping_mul(70_000)]);
        let mut b = [i64::MAX; 9];
        reduce_into(&mut b, &[2; 9], ReduceOp::Prod);
        assert_eq!(b, [-2; 9]);
        let mut c: Vec<u8> = vec![200; 77];
        reduce_into(&mut c, &[100; 77], ReduceOp::Sum);
        assert_eq!(c, vec![44; 77]);
        reduce_into(&mut c, &[7; 77], ReduceOp::Prod);
        assert_eq!(c, vec![52; 77]); // 308 mod 256
    }

    /// `Avg` over three "ranks": combine like `Sum`, then divide once; bit for bit the
    /// per-element formula (for f16/bf16, each pairwise step rounds once).
    fn avg_of_three<T: Case>(seed: u64, div: impl Fn(T, usize) -> T) {
        let mut r = Rng(seed);
        for isa in Isa::available() {
            for len in lengths() {
                let ranks: Vec<Vec<T>> = (0..3)
                    .map(|_| (0..len).map(|_| T::random(&mut r)).collect())
                    .collect();
                let mut acc = ranks[0].clone();
                for rank in &ranks[1..] {
                    kernels::reduce_with(
                        isa,
                        T::DTYPE,
                        ReduceOp::Avg,
                        bytemuck::cast_slice_mut(&mut acc),
                        bytemuck::cast_slice(rank),
                    );
                }
                kernels::scale_with(isa, T::DTYPE, bytemuck::cast_slice_mut(&mut acc), 3);
                for (i, &got) in acc.iter().enumerate() {
                    let sum = T::reference(
                        ReduceOp::Sum,
                        T::reference(ReduceOp::Sum, ranks[0][i], ranks[1][i]),
                        ranks[2][i],
                    );
                    let want = div(sum, 3);
                    assert!(
                        T::same(got, want),
                        "{isa:?} {} avg len {len} [{i}]: {got:?} != {want:?}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    #[test]
    fn avg_combines_like_sum_and_divides_once() {
        avg_of_three::<f32>(31, |x, n| x / n as f32);
        avg_of_three::<f64>(32, |x, n| x / n as f64);
        avg_of_three::<f16>(33, |x, n| f16::from_f32(x.to_f32() / n as f32));
        avg_of_three::<bf16>(34, |x, n| bf16::from_f32(x.to_f32() / n as f32));
    }

    #[test]
    fn finish_avg_divides_every_element() {
        for n in [1usize, 2, 3, 7, 8] {
            let mut a: Vec<f32> = (0..67).map(|i| i as f32 * 1.5).collect();
            finish_avg(&mut a, n);
            for (i, &x) in a.iter().enumerate() {
                assert_eq!(x, i as f32 * 1.5 / n as f32, "f32 /{n} [{i}]");
            }
            let mut h: Vec<f16> = (0..67).map(|i| f16::from_f32(i as f32)).collect();
            finish_avg(&mut h, n);
            for (i, &x) in h.iter().enumerate() {
                assert_eq!(x, f16::from_f32(i as f32 / n as f32), "f16 /{n} [{i}]");
            }
            let mut b: Vec<bf16> = (0..67).map(|i| bf16::from_f32(i as f32)).collect();
            finish_avg(&mut b, n);
            for (i, &x) in b.iter().enumerate() {
                assert_eq!(x, bf16::from_f32(i as f32 / n as f32), "bf16 /{n} [{i}]");
            }
        }
        let mut d = [3.0f64, -9.0];
        finish_avg(&mut d, 3);
        assert_eq!(d, [1.0, -3.0]);
        // Integers are never averaged (check_op refuses): finish_avg leaves them alone.
        let mut i = [7i32, -7];
        finish_avg(&mut i, 2);
        assert_eq!(i, [7, -7]);
        let mut u = [9u8; 5];
        finish_avg(&mut u, 3);
        assert_eq!(u, [9; 5]);
    }

    #[test]
    fn kernel_choice_is_detected_once_and_matches_the_cpu() {
        let first = kernels::isa();
        assert_eq!(kernels::isa(), first, "the cached answer is stable");
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
            assert_eq!(first == Isa::Avx2, avx2);
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(first, Isa::Portable);
        assert_eq!(Isa::available().first(), Some(&Isa::Portable));
    }

    fn op_strategy() -> impl Strategy<Value = ReduceOp> {
        (0..ReduceOp::ALL.len()).prop_map(|i| ReduceOp::ALL[i])
    }

    /// Arbitrary bit patterns through every kernel copy.
    fn prop_check<T: Case>(op: ReduceOp, pairs: &[(T, T)]) {
        for isa in Isa::available() {
            let mut dst: Vec<T> = pairs.iter().map(|p| p.0).collect();
            let src: Vec<T> = pairs.iter().map(|p| p.1).collect();
            check_slices(isa, op, &mut dst, &src, "proptest");
        }
    }

    proptest! {
        #[test]
        fn prop_f16(op in op_strategy(), bits in proptest::collection::vec(any::<(u16, u16)>(), 0..300)) {
            let pairs: Vec<_> = bits.iter().map(|&(a, b)| (f16::from_bits(a), f16::from_bits(b))).collect();
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_bf16(op in op_strategy(), bits in proptest::collection::vec(any::<(u16, u16)>(), 0..300)) {
            let pairs: Vec<_> = bits.iter().map(|&(a, b)| (bf16::from_bits(a), bf16::from_bits(b))).collect();
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_f32(op in op_strategy(), bits in proptest::collection::vec(any::<(u32, u32)>(), 0..300)) {
            let pairs: Vec<_> = bits.iter().map(|&(a, b)| (f32::from_bits(a), f32::from_bits(b))).collect();
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_f64(op in op_strategy(), pairs in proptest::collection::vec(any::<(f64, f64)>(), 0..300)) {
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_i64(op in op_strategy(), pairs in proptest::collection::vec(any::<(i64, i64)>(), 0..300)) {
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_u8(op in op_strategy(), pairs in proptest::collection::vec(any::<(u8, u8)>(), 0..300)) {
            prop_check(op, &pairs);
        }

        #[test]
        fn prop_bf16_narrowing(x in any::<u32>()) {
            let f = f32::from_bits(x);
            prop_assert_eq!(kernels::f32_to_bf16(f).to_bits(), bf16::from_f32(f).to_bits());
        }
    }
}
