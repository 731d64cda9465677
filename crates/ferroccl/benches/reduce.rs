//! Throughput of the CPU reduction kernels (`ferroccl::reduce::reduce_into`), with a plain
//! `copy_from_slice` of the same bytes in every group as the memory-bandwidth baseline.
//!
//! Bytes counted (what `Throughput::Bytes` is set to):
//! - a kernel `dst = dst op src` reads dst, reads src and writes dst: 3 × the buffer size;
//! - the copy `dst.copy_from_slice(&src)` reads src and writes dst: 2 × the buffer size.
//!
//! So the reported GB/s are bytes moved per second, comparable between the two; a kernel
//! that keeps up with memory shows about the copy's GB/s (or more: it has a higher
//! read:write ratio, and reads are cheaper than writes on most machines).
//!
//! `Avg` is not benchmarked separately: it combines exactly like `Sum` (the division is
//! `finish_avg`, once per collective).
//!
//! Run a quick pass with
//! `cargo bench --bench reduce -- --warm-up-time 1 --measurement-time 2`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferroccl::reduce::{reduce_into, Element, ReduceOp};
use half::{bf16, f16};
use std::time::Duration;

/// Bytes per operand for the large (out-of-cache) runs: larger than most L2 caches.
const LARGE: usize = 16 << 20;
/// Bytes per operand for the small (in-cache) runs.
const SMALL: usize = 64 << 10;

/// The operators benchmarked (`Avg` combines like `Sum`).
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// Operand values chosen so that repeated reduction stays in the normal range (no
/// subnormals, whose slow paths would measure the FPU instead of the kernel): `dst`
/// holds values of moderate size, `src` holds ±1 for `Prod` (magnitudes never change)
/// and small values otherwise.
fn operands<T: Element>(bytes: usize, op: ReduceOp) -> (Vec<T>, Vec<T>) {
    let n = bytes / std::mem::size_of::<T>();
    let dst = (0..n)
        .map(|i| T::from_f64(((i % 61) as f64) + 1.5))
        .collect::<Vec<T>>();
    let src = (0..n)
        .map(|i| {
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            match op {
                ReduceOp::Prod => T::from_f64(sign),
                _ => T::from_f64(sign * ((i % 7) as f64 + 1.0)),
            }
        })
        .collect::<Vec<T>>();
    (dst, src)
}

fn bench_type<T: Element>(c: &mut Criterion, label: &str, bytes: usize, ops: &[ReduceOp]) {
    let mut group = c.benchmark_group(format!("reduce_{}KiB/{label}", bytes >> 10));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));

    // Kernel: reads dst and src, writes dst.
    group.throughput(Throughput::Bytes(3 * bytes as u64));
    for &op in ops {
        let (mut dst, src) = operands::<T>(bytes, op);
        group.bench_function(BenchmarkId::from_parameter(op.name()), |b| {
            b.iter(|| reduce_into(black_box(&mut dst[..]), black_box(&src[..]), op))
        });
    }

    // Baseline: reads src, writes dst.
    group.throughput(Throughput::Bytes(2 * bytes as u64));
    let (mut dst, src) = operands::<T>(bytes, ReduceOp::Sum);
    group.bench_function(BenchmarkId::from_parameter("copy"), |b| {
        b.iter(|| black_box(&mut dst[..]).copy_from_slice(black_box(&src[..])))
    });
    group.finish();
}

fn large(c: &mut Criterion) {
    bench_type::<f32>(c, "f32", LARGE, &OPS);
    bench_type::<f64>(c, "f64", LARGE, &OPS);
    bench_type::<f16>(c, "f16", LARGE, &OPS);
    bench_type::<bf16>(c, "bf16", LARGE, &OPS);
    bench_type::<i32>(c, "i32", LARGE, &OPS);
    bench_type::<i64>(c, "i64", LARGE, &OPS);
    bench_type::<u8>(c, "u8", LARGE, &OPS);
}

fn small(c: &mut Criterion) {
    bench_type::<f32>(c, "f32", SMALL, &[ReduceOp::Sum]);
    bench_type::<f16>(c, "f16", SMALL, &[ReduceOp::Sum]);
}

criterion_group!(benches, large, small);
criterion_main!(benches);
