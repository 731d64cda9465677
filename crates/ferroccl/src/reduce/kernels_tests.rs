//! The CPU kernels' unit tests.

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
