//! CUDA device paths. On a machine without a GPU (CI) these check that every entry point
//! returns the typed [`Error::Unavailable`] rather than panicking; on a GPU host they also
//! run the kernels against the CPU kernels (which `src/reduce.rs` tests against an f64
//! reference). A test that needs a GPU and finds none says `SKIPPED (no GPU)`: it did not
//! test the GPU.

use crate::common;

use ferroccl::cuda::{self, cudarc::driver::DeviceRepr, Device, DeviceReducer};
use ferroccl::reduce::{finish_avg, reduce_into};
use ferroccl::{DataType, Element, Error, ReduceOp};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

/// The device, or `None` (after saying why) when this machine has none.
fn gpu(test: &str) -> Option<std::sync::Arc<Device>> {
    match cuda::probe() {
        Ok(_) => Some(Device::open(0).expect("probe found a device but it does not open")),
        Err(e @ Error::Unavailable { .. }) => {
            eprintln!("SKIPPED {test} (no GPU): {e}");
            None
        }
        Err(e) => panic!("probe failed with an error other than Unavailable: {e}"),
    }
}

#[test]
fn no_driver_is_a_typed_error_not_a_panic() {
    let r = common::with_deadline(DEADLINE, || std::panic::catch_unwind(cuda::probe));
    let r = r.expect("cuda::probe panicked");
    if !cuda::driver_present() {
        match r {
            Err(Error::Unavailable { what, why }) => {
                assert_eq!(what, "CUDA");
                assert_eq!(why, "no CUDA driver (libcuda.so not found)");
            }
            other => panic!("expected Unavailable without libcuda, got {other:?}"),
        }
        // Every other entry point refuses the same way.
        match Device::open(0) {
            Err(Error::Unavailable { why, .. }) => assert!(why.contains("libcuda"), "{why}"),
            other => panic!("Device::open without libcuda: {other:?}"),
        }
        let msg = cuda::no_driver().to_string();
        assert_eq!(
            msg,
            "CUDA is not available: no CUDA driver (libcuda.so not found)"
        );
    } else {
        match r {
            Ok(p) => assert!(p.devices >= 1),
            Err(Error::Unavailable { why, .. }) => assert_eq!(why, "no CUDA device"),
            Err(e) => panic!("probe with a driver: {e}"),
        }
    }
}

/// Runs kernel (T, op) on `a`, `b` and compares bitwise with the CPU kernel.
fn check_kernel<T: Element + DeviceRepr>(red: &DeviceReducer, n: usize, seed: u64) -> usize {
    let dev = red.device().clone();
    let stream = dev.stream().clone();
    let mut wrong = 0;
    for op in ReduceOp::ALL {
        if ferroccl::reduce::check_op(T::DTYPE, op).is_err() {
            continue;
        }
        let a: Vec<T> = (0..n).map(|i| value::<T>(seed, i, op)).collect();
        let b: Vec<T> = (0..n).map(|i| value::<T>(seed ^ 0x9e37, i, op)).collect();
        let mut want = a.clone();
        reduce_into(&mut want, &b, op);
        if op == ReduceOp::Avg {
            finish_avg(&mut want, 3);
        }
        let mut da = stream.clone_htod(&a).expect("htod");
        let db = stream.clone_htod(&b).expect("htod");
        red.reduce(&mut da, &db, op).expect("reduce");
        if op == ReduceOp::Avg {
            red.scale(&mut da, 3.0).expect("scale");
        }
        let got: Vec<T> = stream.clone_dtoh(&da).expect("dtoh");
        for (g, w) in got.iter().zip(&want) {
            let same = bytemuck::bytes_of(g) == bytemuck::bytes_of(w)
                || (g.to_f64().is_nan() && w.to_f64().is_nan());
            if !same {
                wrong += 1;
            }
        }
    }
    wrong
}

/// Deterministic values spread over a useful range (small for Prod, so it stays finite).
fn value<T: Element>(seed: u64, i: usize, op: ReduceOp) -> T {
    let mut x = seed
        .wrapping_add(i as u64)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    let u = (x % 2001) as f64 / 1000.0 - 1.0; // [-1, 1]
    let v = if op == ReduceOp::Prod {
        1.0 + u / 4.0
    } else {
        u * 100.0
    };
    if T::DTYPE.is_float() {
        T::from_f64(v)
    } else {
        T::from_f64((x % 200) as f64)
    }
}

#[test]
fn kernels_match_the_cpu_on_a_gpu() {
    let Some(dev) = gpu("kernels_match_the_cpu_on_a_gpu") else {
        return;
    };
    common::with_deadline(DEADLINE, move || {
        let red = DeviceReducer::new(dev).expect("kernels compile and load");
        for n in [0usize, 1, 7, 8, 9, 1000, 4097, 1 << 20] {
            let wrong = check_kernel::<f32>(&red, n, 1)
                + check_kernel::<f64>(&red, n, 2)
                + check_kernel::<half::f16>(&red, n, 3)
                + check_kernel::<half::bf16>(&red, n, 4)
                + check_kernel::<i32>(&red, n, 5)
                + check_kernel::<i64>(&red, n, 6)
                + check_kernel::<u8>(&red, n, 7);
            assert_eq!(wrong, 0, "{wrong} wrong elements at n = {n}");
        }
    });
}

#[test]
fn kernel_names_cover_every_float_type() {
    for dt in [DataType::F16, DataType::BF16, DataType::F32, DataType::F64] {
        assert!(cuda::nvrtc::scale_name(dt).is_some());
    }
}

/// Every device collective over the in-process transport (the staged path TCP takes),
/// against the host collectives on the same data: 3 ranks (odd), uneven sizes.
#[test]
fn device_collectives_match_host_ones_on_a_gpu() {
    let Some(dev) = gpu("device_collectives_match_host_ones_on_a_gpu") else {
        return;
    };
    common::with_deadline(DEADLINE, move || {
        let n = 3;
        let comms =
            ferroccl::Communicator::local_group(n, &ferroccl::Config::new(0, 1, "")).unwrap();
        std::thread::scope(|s| {
            for comm in comms {
                let dev = dev.clone();
                s.spawn(move || {
                    let stream = dev.stream().clone();
                    let r = comm.rank();
                    for len in [0usize, 1, 5, 1000, 100_003] {
                        let host: Vec<f32> = (0..len).map(|i| (i % 17) as f32 + r as f32).collect();
                        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                            let mut want = host.clone();
                            comm.all_reduce(&mut want, op).unwrap();
                            let mut d = stream.clone_htod(&host).unwrap();
                            comm.all_reduce_device(&mut d, op).unwrap();
                            let got: Vec<f32> = stream.clone_dtoh(&d).unwrap();
                            assert_eq!(got, want, "all_reduce_device {op:?} len {len}");
                        }
                        // bf16 sum: the device kernel rounds like the CPU one.
                        let hb: Vec<half::bf16> = host
                            .iter()
                            .map(|&x| half::bf16::from_f32(x * 0.37))
                            .collect();
                        let mut want = hb.clone();
                        comm.all_reduce(&mut want, ReduceOp::Sum).unwrap();
                        let mut d = stream.clone_htod(&hb).unwrap();
                        comm.all_reduce_device(&mut d, ReduceOp::Sum).unwrap();
                        assert_eq!(stream.clone_dtoh(&d).unwrap(), want);
                        // reduce-scatter / all-gather
                        let send: Vec<f32> = (0..len * n)
                            .map(|i| (i % 7) as f32 * (r + 1) as f32)
                            .collect();
                        let mut want = vec![0f32; len];
                        comm.reduce_scatter(&send, &mut want, ReduceOp::Sum)
                            .unwrap();
                        let ds = stream.clone_htod(&send).unwrap();
                        let mut dr = stream.clone_htod(&vec![0f32; len]).unwrap();
                        comm.reduce_scatter_device(&ds, &mut dr, ReduceOp::Sum)
                            .unwrap();
                        assert_eq!(stream.clone_dtoh(&dr).unwrap(), want);
                        let mut want = vec![0f32; len * n];
                        comm.all_gather(&host, &mut want).unwrap();
                        let dh = stream.clone_htod(&host).unwrap();
                        let mut dg = stream.clone_htod(&vec![0f32; len * n]).unwrap();
                        comm.all_gather_device(&dh, &mut dg).unwrap();
                        assert_eq!(stream.clone_dtoh(&dg).unwrap(), want);
                        // broadcast / reduce from rank 2
                        let mut want = host.clone();
                        comm.broadcast(&mut want, 2).unwrap();
                        let mut db = stream.clone_htod(&host).unwrap();
                        comm.broadcast_device(&mut db, 2).unwrap();
                        assert_eq!(stream.clone_dtoh(&db).unwrap(), want);
                        let mut want = host.clone();
                        comm.reduce(&mut want, ReduceOp::Prod, 2).unwrap();
                        let mut dd = stream.clone_htod(&host).unwrap();
                        comm.reduce_device(&mut dd, ReduceOp::Prod, 2).unwrap();
                        if r == 2 {
                            assert_eq!(stream.clone_dtoh(&dd).unwrap(), want);
                        }
                    }
                });
            }
        });
    });
}

/// `--transport cuda-ipc` parses in this build, and a communicator asked for it on a
/// machine without CUDA fails at once with the typed error (before reaching the store).
#[test]
fn cuda_ipc_without_a_gpu_is_refused_with_the_typed_error() {
    use ferroccl::transport::TransportKind;
    assert_eq!(
        TransportKind::parse("cuda-ipc").unwrap(),
        TransportKind::CudaIpc
    );
    assert_eq!(TransportKind::CudaIpc.name(), "cuda-ipc");
    if cuda::probe().is_ok() {
        eprintln!("SKIPPED cuda_ipc_without_a_gpu_is_refused_with_the_typed_error: this machine has a GPU");
        return;
    }
    let mut cfg = ferroccl::Config::new(1, 2, "127.0.0.1:9");
    cfg.transport.kind = TransportKind::CudaIpc;
    cfg.tuning.connect_timeout = Duration::from_secs(2);
    let r = common::with_deadline(DEADLINE, move || {
        ferroccl::Communicator::init(cfg).map(|_| ())
    });
    match r {
        Err(Error::Unavailable { what, why }) => {
            assert_eq!(what, "CUDA");
            assert!(why.starts_with("no CUDA"), "{why}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn ipc_busbw_limit_formula() {
    use ferroccl::testing::internals::busbw_limit_fraction;
    assert!((busbw_limit_fraction(2) - 1.0 / 12.0).abs() < 1e-12);
    assert!((busbw_limit_fraction(4) - 1.0 / 20.0).abs() < 1e-12);
    assert!((busbw_limit_fraction(8) - 14.0 / 528.0).abs() < 1e-12);
}

/// The raw entry points a framework calls (PyTorch's CUDA tensors) on a machine
/// without CUDA: typed `Unavailable` errors, never a panic, and the refusal poisons the
/// communicator (its peers must not wait for this rank).
#[test]
fn raw_device_buffers_without_a_gpu_are_typed_errors() {
    use ferroccl::cuda::{order, DeviceBuf};
    if cuda::probe().is_ok() {
        eprintln!(
            "SKIPPED raw_device_buffers_without_a_gpu_are_typed_errors: this machine has a GPU"
        );
        return;
    }
    common::with_deadline(DEADLINE, || {
        let buf = DeviceBuf {
            ordinal: 0,
            addr: 0x7f00_0000_0000,
            len: 16,
            dtype: DataType::F32,
        };
        let unavailable = |e: Error| match e {
            Error::Unavailable { what, why } => what == "CUDA" && why.starts_with("no CUDA"),
            _ => false,
        };
        assert!(unavailable(buf.check("x").unwrap_err()));
        assert!(unavailable(order::issue(0, 0).unwrap_err()));
        assert!(unavailable(order::streams(0).unwrap_err()));
        let comm = ferroccl::Communicator::local_group(1, &ferroccl::Config::new(0, 1, ""))
            .unwrap()
            .remove(0);
        // SAFETY: refused before the address is touched (no driver).
        let e = unsafe { comm.all_reduce_device_raw(buf, ReduceOp::Sum) }.unwrap_err();
        assert!(unavailable(e));
        let mut host = vec![1f32; 4];
        match comm.all_reduce(&mut host, ReduceOp::Sum) {
            Err(Error::Poisoned(why)) => assert!(why.contains("refused a call"), "{why}"),
            other => panic!("expected the refusal to poison the communicator: {other:?}"),
        }
        // The checks before the device: a mismatched pair of buffers names both.
        let comm = ferroccl::Communicator::local_group(2, &ferroccl::Config::new(0, 2, ""))
            .unwrap()
            .remove(0);
        let recv = DeviceBuf { len: 3, ..buf };
        // SAFETY: refused before any address is touched.
        let e = unsafe { comm.all_gather_device_raw(buf, recv) }.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidArgument(_)), "{msg}");
        assert!(
            msg.contains("world_size (2)") && msg.contains("16"),
            "{msg}"
        );
    });
}

/// The ordering protocol over CUDA events on a GPU: a collective issued on one stream
/// right after the kernel that fills its buffer (still running), run on ferroccl's
/// stream, read on the caller's stream after `wait_on`, and its buffer released as the
/// protocol says.
#[test]
fn device_ops_order_with_a_callers_stream_on_a_gpu() {
    use ferroccl::cuda::cudarc::driver::DevicePtrMut;
    use ferroccl::cuda::{order, DeviceBuf};
    use ferroccl::order::{DeviceOp, Release, StreamId};
    let Some(dev) = gpu("device_ops_order_with_a_callers_stream_on_a_gpu") else {
        return;
    };
    common::with_deadline(DEADLINE, move || {
        let n = 2;
        let comms =
            ferroccl::Communicator::local_group(n, &ferroccl::Config::new(0, 1, "")).unwrap();
        std::thread::scope(|s| {
            for comm in comms {
                let dev = dev.clone();
                s.spawn(move || {
                    let caller = dev.context().new_stream().unwrap();
                    let len = 1 << 20;
                    let host: Vec<f32> = vec![comm.rank() as f32 + 1.0; len];
                    let mut d = caller.clone_htod(&host).unwrap();
                    let (addr, guard) = d.device_ptr_mut(&caller);
                    let buf = DeviceBuf {
                        ordinal: dev.ordinal,
                        addr,
                        len,
                        dtype: DataType::F32,
                    };
                    let cs = StreamId(caller.cu_stream() as u64);
                    let op: DeviceOp<_> = order::issue(dev.ordinal, cs.0).unwrap();
                    // SAFETY: `d` lives until the end of this closure; the protocol
                    // orders our stream after the caller's copy into it.
                    op.run(|| unsafe { comm.all_reduce_device_raw(buf, ReduceOp::Sum) })
                        .unwrap();
                    op.wait_on(cs).unwrap();
                    drop(guard);
                    let got: Vec<f32> = caller.clone_dtoh(&d).unwrap();
                    assert!(got.iter().all(|&x| x == 3.0), "{:?}", &got[..4]);
                    caller.synchronize().unwrap();
                    assert!(op.query().unwrap());
                    assert_eq!(op.release(), Release::Now);
                });
            }
        });
    });
}
