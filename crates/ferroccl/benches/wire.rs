//! What the per-frame fingerprint costs: encoding a 48-byte header, and decoding plus
//! comparing it with the expected one on receipt. Set against a 1 KiB all-reduce
//! (one frame per step) to see the fingerprint's share of small-message latency.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use ferroccl::testing::internals::{Fingerprint, FrameHeader, OpKind};
use ferroccl::{Algorithm, DataType, ReduceOp};

fn header() -> FrameHeader {
    FrameHeader {
        fp: Fingerprint {
            kind: OpKind::AllReduce,
            seq: 123_456,
            dtype: DataType::F32,
            op: Some(ReduceOp::Sum),
            count: 256,
            root: None,
            algo: Algorithm::RecursiveDoubling,
            comm: 0,
        },
        step: 1,
        seg: 0,
        len: 1024,
    }
}

fn fingerprint(c: &mut Criterion) {
    let h = header();
    let bytes = h.encode();
    let mut g = c.benchmark_group("frame_header");
    g.bench_function("encode", |b| b.iter(|| black_box(black_box(&h).encode())));
    g.bench_function("decode_and_check", |b| {
        b.iter(|| {
            let got = FrameHeader::decode(black_box(&bytes));
            black_box(got.as_ref() == Ok(black_box(&h)))
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2));
    targets = fingerprint
}
criterion_main!(benches);
