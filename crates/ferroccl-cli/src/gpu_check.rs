//! `ferroccl gpu-check`: validation on a GPU host (wrapped by `tools/gpu-check`).
//!
//! 1. **Kernels**: every dtype × op of `cuda/reduce.cu` on random data at sizes from one
//!    element to `--max-bytes` (default 256 MiB), against the CPU f64 reference (integer
//!    types: against the CPU kernels, whose wrapping is the defined semantics). The
//!    output is poisoned (0xFF bytes) first and 64 elements past the end are checked to
//!    stay poisoned; wrong elements are counted. A float result is right when it is the
//!    reference rounded to the type or within 2 units in the last place of it (the
//!    device rounds f16/bf16 once from f32, the reference once from f64).
//! 2. **Bandwidth**: each dtype's sum kernel (`dst = a + b`: 3 bytes moved per output
//!    byte) next to a device-to-device copy (2 bytes per byte) of the same size,
//!    measured in the same run; target: fp16 sum ≥ 90% of the copy.
//! 3. **CUDA-IPC all-reduce** with 2, 4 and 8 ranks as processes on one GPU: exact
//!    results (small integers in f32), busbw, and the limit the GPU's memory bandwidth
//!    implies: `busbw_max = B·2(n-1)/(n·(9n-6))` with `B` the copy bandwidth measured in
//!    step 2 (derivation: [`ferroccl::transport::cuda_ipc`]; it is the ring's, which
//!    one-shot and two-shot — what `auto` runs on device memory — can pass). Each
//!    algorithm of `--ipc-algos` is a run of its own, the table naming the one that
//!    ran. Reduce-scatter, all-gather, broadcast and reduce over the same IPC ring are
//!    checked and timed too (no limit derived for them). `--ipc-only` skips steps 1
//!    and 2 but for the copy bandwidth (a second pass under MPS, say).
//!
//! Prints one table and writes the same rows as JSON (`--json`). Exit status 0 only if
//! nothing was wrong (bandwidth targets are reported, not enforced).

use clap::Args;
use std::path::PathBuf;

/// Arguments of `ferroccl gpu-check`.
#[derive(Args, Debug, Clone)]
pub struct GpuCheckArgs {
    /// Where to write the results as JSON.
    #[arg(long, default_value = "gpu-check.json")]
    pub json: PathBuf,
    /// Largest kernel and all-reduce size in bytes (suffixes K, M, G).
    #[arg(long = "max-bytes", default_value = "256M", value_parser = crate::args::size)]
    pub max_bytes: usize,
    /// Rank counts for the CUDA-IPC all-reduce, all on one GPU (comma-separated; empty: skip).
    #[arg(long = "ipc-ranks", default_value = "2,4,8")]
    pub ipc_ranks: String,
    /// GPU to use.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Timed iterations per bandwidth and all-reduce measurement.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// All-reduce algorithms for the CUDA-IPC check, each a run of its own
    /// (comma-separated: auto, ring, one-shot, two-shot; as `FERROCCL_ALGO`). The
    /// other collectives run with the first only.
    #[arg(long = "ipc-algos", default_value = "auto")]
    pub ipc_algos: String,
    /// Only the CUDA-IPC check (and the copy bandwidth its limit needs): no kernel
    /// check, no kernel bandwidth. For a second pass under MPS, say.
    #[arg(long = "ipc-only")]
    pub ipc_only: bool,
    /// Internal: run as one rank of the CUDA-IPC all-reduce check (under `ferroccl
    /// launch`), rank 0 writing its rows as JSON here.
    #[arg(long = "ipc-worker", hide = true)]
    pub ipc_worker: Option<PathBuf>,
    /// Internal: the worker runs its all-reduces only.
    #[arg(long = "ipc-all-reduce-only", hide = true)]
    pub ipc_all_reduce_only: bool,
}

/// The subcommand: `Ok(false)` when a check found wrong results.
pub fn main(a: GpuCheckArgs) -> crate::error::Result<bool> {
    Ok(imp::run(a)?)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub fn run(_: super::GpuCheckArgs) -> ferroccl::Result<bool> {
        Err(ferroccl::Error::Unavailable {
            what: "gpu-check".into(),
            why: "this build has no CUDA support (build with --features cuda)".into(),
        })
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::GpuCheckArgs;
    use ferroccl::config::AllReduceAlgo;
    use ferroccl::cuda::cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
    use ferroccl::cuda::{self, mem, nvrtc, Device, DeviceReducer};
    use ferroccl::reduce::{check_op, finish_avg, reduce_into};
    use ferroccl::testing::internals::busbw_limit_fraction;
    use ferroccl::transport::TransportKind;
    use ferroccl::{Communicator, Config, DataType, Element, Error, ReduceOp, Result};
    use serde_json::json;
    use std::sync::Arc;
    use std::time::Instant;

    /// Elements past the end that must stay poisoned.
    const PAD: usize = 64;
    /// Divisor for the Avg checks (as if 3 ranks).
    const AVG_N: f64 = 3.0;

    fn drv(call: &'static str) -> impl Fn(ferroccl::cuda::cudarc::driver::DriverError) -> Error {
        move |e| Error::Cuda {
            call: call.into(),
            detail: format!("{:?}", e.0),
        }
    }

    pub fn run(a: GpuCheckArgs) -> Result<bool> {
        if let Some(out) = a.ipc_worker.clone() {
            return ipc_worker(&a, &out);
        }
        let p = cuda::probe()?;
        let dev = Device::open(a.gpu)?;
        let (vmaj, vmin) = nvrtc::version()?;
        println!(
            "# ferroccl gpu-check: GPU {} {} (sm_{}{}, {} SMs), driver {}.{}, NVRTC {vmaj}.{vmin}, {} GPU(s)",
            dev.ordinal,
            dev.name,
            dev.cc.0,
            dev.cc.1,
            dev.sm_count,
            p.driver_version / 1000,
            (p.driver_version % 1000) / 10,
            p.devices
        );
        let t0 = Instant::now();
        let red = DeviceReducer::new(dev.clone())?;
        println!(
            "# kernels compiled and loaded in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
        let mut ok = true;
        let mut rows = Vec::new();
        let copy_gbs = if a.ipc_only {
            let bytes = a.max_bytes.max(1 << 20);
            let copy_gbs = copy_bandwidth(&dev, bytes, a.iters)?;
            println!("#");
            println!("# device-to-device copy at {bytes} B: {copy_gbs:.1} GB/s");
            copy_gbs
        } else {
            ok &= check_kernels(&a, &red, &mut rows)?;
            check_bandwidth(&a, &dev, &red, &mut rows)?
        };
        ok &= check_ipc(&a, &dev, copy_gbs, &mut rows)?;
        let doc = json!({
            "device": {"ordinal": dev.ordinal, "name": dev.name, "cc": [dev.cc.0, dev.cc.1],
                       "sm_count": dev.sm_count, "driver_version": p.driver_version},
            "nvrtc": [vmaj, vmin],
            "copy_gbs": copy_gbs,
            "ipc_limit_formula": "busbw_max = B * 2(n-1) / (n (9n - 6)), B = device-to-device copy bandwidth",
            "ok": ok,
            "rows": rows,
        });
        std::fs::write(&a.json, serde_json::to_vec_pretty(&doc).unwrap_or_default())
            .map_err(|e| Error::io(format!("writing {}", a.json.display()), e))?;
        println!(
            "# {} ; JSON in {}",
            if ok { "OK" } else { "FAILED" },
            a.json.display()
        );
        Ok(ok)
    }

    /// Step 1, kernel correctness: every dtype × op against the CPU reference, one row
    /// each. Returns whether no element was wrong.
    fn check_kernels(
        a: &GpuCheckArgs,
        red: &DeviceReducer,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let mut ok = true;
        println!("#");
        println!("# 1. kernels vs the CPU f64 reference (output poisoned; {PAD} elements past the end checked)");
        println!(
            "#{:>8} {:>6} {:>40} {:>14}",
            "type", "op", "sizes (elements)", "#wrong"
        );
        for dt in nvrtc::DTYPES {
            let counts = counts_for(dt, a.max_bytes);
            for op in ReduceOp::ALL {
                if check_op(dt, op).is_err() {
                    continue;
                }
                let mut wrong = 0u64;
                for (i, &n) in counts.iter().enumerate() {
                    // Odd sizes also run one element in, so the scalar head path runs.
                    let offset = usize::from(i % 2 == 1);
                    wrong += by_dtype(dt, red, n, offset, op, 0x5eed + i as u64)?;
                }
                ok &= wrong == 0;
                println!(
                    "{:>9} {:>6} {:>40} {:>14}",
                    dt.name(),
                    op.name(),
                    summary(&counts),
                    wrong
                );
                rows.push(
                    json!({"check": "kernel", "dtype": dt.name(), "op": op.name(),
                    "counts": counts, "wrong": wrong}),
                );
            }
        }
        Ok(ok)
    }

    /// Step 2, bandwidth: each float type's sum kernel next to a device-to-device copy
    /// of the same size. Returns the copy bandwidth (GB/s), the IPC limit's `B`.
    fn check_bandwidth(
        a: &GpuCheckArgs,
        dev: &Arc<Device>,
        red: &DeviceReducer,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<f64> {
        let bytes = a.max_bytes.max(1 << 20);
        let copy_gbs = copy_bandwidth(dev, bytes, a.iters)?;
        println!("#");
        println!(
            "# 2. bandwidth at {} B: dst = a + b moves 3 B per output byte, a copy 2",
            bytes
        );
        println!(
            "#{:>8} {:>12} {:>12} {:>9} {:>8}",
            "type", "kernel GB/s", "copy GB/s", "vs copy", "target"
        );
        for dt in [DataType::F16, DataType::BF16, DataType::F32, DataType::F64] {
            let k = kernel_bandwidth(red, dt, bytes, a.iters)?;
            let target = if dt == DataType::F16 { ">=0.90" } else { "-" };
            println!(
                "{:>9} {:>12.1} {:>12.1} {:>9.3} {:>8}{}",
                dt.name(),
                k,
                copy_gbs,
                k / copy_gbs,
                target,
                if dt == DataType::F16 && k / copy_gbs < 0.9 {
                    "  MISSED"
                } else {
                    ""
                }
            );
            rows.push(
                json!({"check": "bandwidth", "dtype": dt.name(), "op": "sum", "bytes": bytes,
                "kernel_gbs": k, "copy_gbs": copy_gbs, "ratio": k / copy_gbs}),
            );
        }
        Ok(copy_gbs)
    }

    /// Step 3, CUDA-IPC all-reduce: n ranks on this one GPU, for each n of
    /// `--ipc-ranks`. Returns whether every run started and every result was right.
    fn check_ipc(
        a: &GpuCheckArgs,
        dev: &Device,
        copy_gbs: f64,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let mut ok = true;
        let ranks: Vec<usize> = a
            .ipc_ranks
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::InvalidArgument(format!("--ipc-ranks: {e}")))?;
        let algos: Vec<String> = a
            .ipc_algos
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        for algo in &algos {
            algo.parse::<AllReduceAlgo>()
                .map_err(|e| Error::InvalidArgument(format!("--ipc-algos: {e}")))?;
        }
        if !ranks.is_empty() {
            println!("#");
            println!(
                "# 3. CUDA-IPC all-reduce (float sum), n ranks as processes on GPU {}",
                dev.ordinal
            );
            println!(
                "#    limit = B * 2(n-1)/(n(9n-6)), B = copy bandwidth above = {copy_gbs:.1} GB/s"
            );
            println!(
                "#{:>3} {:>15} {:>15} {:>12} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7}",
                "n",
                "collective",
                "algorithm",
                "size (B)",
                "time (us)",
                "algbw",
                "busbw",
                "limit",
                "of lim",
                "#wrong"
            );
        }
        for n in ranks {
            for (i, algo) in algos.iter().enumerate() {
                ok &= ipc_ranks(a, dev, n, algo, i > 0, copy_gbs, rows)?;
            }
        }
        Ok(ok)
    }

    /// Runs the IPC workers as `n` processes under `ferroccl launch`, all-reduce
    /// algorithm `algo` (the all-reduces alone when `all_reduce_only`), and prints
    /// their rows, each all-reduce row against the limit. Returns whether they ran and
    /// every result was right.
    #[allow(clippy::too_many_arguments)]
    fn ipc_ranks(
        a: &GpuCheckArgs,
        dev: &Device,
        n: usize,
        algo: &str,
        all_reduce_only: bool,
        copy_gbs: f64,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let mut ok = true;
        let dir =
            std::env::temp_dir().join(format!("ferroccl-gpu-check-{}-{n}", std::process::id()));
        let out = dir.with_extension("json");
        let exe =
            std::env::current_exe().map_err(|e| Error::io("locating the ferroccl binary", e))?;
        let mut cmd: Vec<std::ffi::OsString> = vec![
            exe.into_os_string(),
            "gpu-check".into(),
            "--ipc-worker".into(),
            out.clone().into_os_string(),
            "--gpu".into(),
            dev.ordinal.to_string().into(),
            "--max-bytes".into(),
            a.max_bytes.to_string().into(),
            "--iters".into(),
            a.iters.to_string().into(),
            "--ipc-algos".into(),
            algo.into(),
        ];
        if all_reduce_only {
            cmd.push("--ipc-all-reduce-only".into());
        }
        let opts = crate::launch::LaunchOptions::default();
        if let Err(e) = crate::launch::run(n, &cmd, &opts) {
            println!("{n:>4} CUDA-IPC all-reduce ({algo}) failed: {e}");
            rows.push(json!({"check": "ipc_all_reduce", "ranks": n, "algo": algo, "error": e.to_string()}));
            return Ok(false);
        }
        let text = std::fs::read_to_string(&out)
            .map_err(|e| Error::io(format!("reading {}", out.display()), e))?;
        let _ = std::fs::remove_file(&out);
        let worker_rows: Vec<serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("worker JSON: {e}")))?;
        let limit = copy_gbs * busbw_limit_fraction(n);
        for mut r in worker_rows {
            let busbw = r["busbw_gbs"].as_f64().unwrap_or(0.0);
            let wrong = r["wrong"].as_u64().unwrap_or(u64::MAX);
            let coll = r["coll"].as_str().unwrap_or("?").to_string();
            ok &= wrong == 0;
            // The limit is derived for the all-reduce ring only.
            let (lim, of) = if coll == "all_reduce" {
                r["limit_gbs"] = json!(limit);
                (format!("{limit:.2}"), format!("{:.2}", busbw / limit))
            } else {
                ("-".to_string(), "-".to_string())
            };
            println!(
                "{:>4} {:>15} {:>15} {:>12} {:>10.1} {:>9.2} {:>9.2} {:>9} {:>7} {:>7}",
                n,
                coll,
                r["ran"].as_str().unwrap_or("-"),
                r["bytes"].as_u64().unwrap_or(0),
                r["time_us"].as_f64().unwrap_or(0.0),
                r["algbw_gbs"].as_f64().unwrap_or(0.0),
                busbw,
                lim,
                of,
                wrong
            );
            r["check"] = json!(format!("ipc_{coll}"));
            rows.push(r);
        }
        Ok(ok)
    }

    /// 1 element up to `max_bytes`, with awkward sizes between.
    fn counts_for(dt: DataType, max_bytes: usize) -> Vec<usize> {
        let max = (max_bytes / dt.size()).max(1);
        let mut v: Vec<usize> = [1, 2, 7, 8, 9, 15, 16, 17, 1000, 4097, 65_537, (1 << 20) + 3]
            .into_iter()
            .filter(|&c| c <= max)
            .collect();
        v.push(max);
        v.dedup();
        v
    }

    fn summary(c: &[usize]) -> String {
        format!("{} sizes, {}..{}", c.len(), c[0], c[c.len() - 1])
    }

    fn by_dtype(
        dt: DataType,
        red: &DeviceReducer,
        n: usize,
        off: usize,
        op: ReduceOp,
        seed: u64,
    ) -> Result<u64> {
        with_dtype!(dt, check_kernel(red, n, off, op, seed))
    }

    fn splitmix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Random inputs: [-100, 100] (Prod: [0.5, 2], so products stay finite); integers
    /// over their whole range (wrapping is part of the semantics).
    fn random<T: Element>(n: usize, seed: u64, op: ReduceOp) -> Vec<T> {
        (0..n)
            .map(|i| {
                let r = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
                if T::DTYPE.is_float() {
                    let u = (r >> 11) as f64 / (1u64 << 53) as f64;
                    T::from_f64(if op == ReduceOp::Prod {
                        0.5 + 1.5 * u
                    } else {
                        200.0 * u - 100.0
                    })
                } else {
                    bytemuck::pod_read_unaligned::<T>(&r.to_le_bytes()[..std::mem::size_of::<T>()])
                }
            })
            .collect()
    }

    fn ulp(dt: DataType) -> f64 {
        match dt {
            DataType::F16 => 2f64.powi(-10),
            DataType::BF16 => 2f64.powi(-7),
            DataType::F32 => 2f64.powi(-23),
            _ => 2f64.powi(-52),
        }
    }

    fn reference(op: ReduceOp, x: f64, y: f64) -> f64 {
        match op {
            ReduceOp::Prod => x * y,
            ReduceOp::Min => x.min(y),
            ReduceOp::Max => x.max(y),
            ReduceOp::Avg => (x + y) / AVG_N,
            _ => x + y,
        }
    }

    /// Runs kernel (T, op) out of place on `n` random elements at element offset `off`
    /// of each buffer; returns the wrong elements (including overwritten padding).
    fn check_kernel<T: Element + DeviceRepr>(
        red: &DeviceReducer,
        n: usize,
        off: usize,
        op: ReduceOp,
        seed: u64,
    ) -> Result<u64> {
        let dev = red.device().clone();
        let stream: Arc<CudaStream> = dev.stream().clone();
        let a: Vec<T> = random(n + off, seed, op);
        let b: Vec<T> = random(n + off, seed ^ 0xabcdef, op);
        let da = stream.clone_htod(&a).map_err(drv("cuMemcpyHtoD"))?;
        let db = stream.clone_htod(&b).map_err(drv("cuMemcpyHtoD"))?;
        // SAFETY: uninitialised device memory, poisoned right below before any read.
        let dout: CudaSlice<T> =
            unsafe { stream.alloc::<T>(n + off + PAD) }.map_err(drv("cuMemAlloc"))?;
        let es = std::mem::size_of::<T>() as u64;
        {
            let (pa, _ga) = da.device_ptr(&stream);
            let (pb, _gb) = db.device_ptr(&stream);
            let (po, _go) = dout.device_ptr(&stream);
            // SAFETY: every range lies inside its allocation (offset + n elements, and
            // the padding); the stream orders the poison, kernel and scale.
            unsafe {
                result::memset_d8_async(
                    po,
                    0xff,
                    (n + off + PAD) * es as usize,
                    stream.cu_stream(),
                )
                .map_err(drv("cuMemsetD8Async"))?;
                let o = off as u64 * es;
                red.reduce_raw(&stream, T::DTYPE, op, po + o, 0, pa + o, pb + o, n)?;
                if op == ReduceOp::Avg {
                    red.scale_raw(&stream, T::DTYPE, po + o, n, AVG_N)?;
                }
            }
        }
        let got: Vec<T> = stream.clone_dtoh(&dout).map_err(drv("cuMemcpyDtoH"))?;
        let poison = bytemuck::pod_read_unaligned::<T>(&[0xffu8; 8][..std::mem::size_of::<T>()]);
        let mut wrong = got[n + off..]
            .iter()
            .filter(|x| bytemuck::bytes_of(*x) != bytemuck::bytes_of(&poison))
            .count() as u64;
        let (a, b, got) = (&a[off..], &b[off..], &got[off..off + n]);
        if T::DTYPE.is_float() {
            let u = ulp(T::DTYPE);
            for i in 0..n {
                let want = reference(op, a[i].to_f64(), b[i].to_f64());
                let g = got[i].to_f64();
                let rounded = T::from_f64(want).to_f64();
                let ok = g == rounded || (g - want).abs() <= 2.0 * u * want.abs();
                wrong += u64::from(!ok);
            }
        } else {
            let mut want = a.to_vec();
            reduce_into(&mut want, b, op);
            if op == ReduceOp::Avg {
                finish_avg(&mut want, AVG_N as usize);
            }
            wrong += got.iter().zip(&want).filter(|(g, w)| g != w).count() as u64;
        }
        Ok(wrong)
    }

    fn time_gbs(
        dev: &Device,
        bytes_moved: f64,
        iters: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        dev.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..iters.max(1) {
            f()?;
        }
        dev.synchronize()?;
        Ok(bytes_moved * iters.max(1) as f64 / t0.elapsed().as_secs_f64() / 1e9)
    }

    fn copy_bandwidth(dev: &Arc<Device>, bytes: usize, iters: usize) -> Result<f64> {
        dev.bind()?;
        let src = mem::DeviceAlloc::new(dev.context(), bytes)?;
        let dst = mem::DeviceAlloc::new(dev.context(), bytes)?;
        let stream = dev.stream().clone();
        // SAFETY: both allocations hold `bytes`; ordered on one stream.
        time_gbs(dev, 2.0 * bytes as f64, iters, || unsafe {
            mem::dtod(&stream, dst.ptr(), src.ptr(), bytes)
        })
    }

    fn kernel_bandwidth(
        red: &DeviceReducer,
        dt: DataType,
        bytes: usize,
        iters: usize,
    ) -> Result<f64> {
        let dev = red.device().clone();
        dev.bind()?;
        let a = mem::DeviceAlloc::new(dev.context(), bytes)?;
        let b = mem::DeviceAlloc::new(dev.context(), bytes)?;
        let d = mem::DeviceAlloc::new(dev.context(), bytes)?;
        let stream = dev.stream().clone();
        for x in [&a, &b] {
            // SAFETY: zeroing whole allocations (finite inputs).
            unsafe { result::memset_d8_async(x.ptr(), 0, bytes, stream.cu_stream()) }
                .map_err(drv("cuMemsetD8Async"))?;
        }
        let n = bytes / dt.size();
        // SAFETY: three allocations of `bytes`; ordered on one stream.
        time_gbs(&dev, 3.0 * (n * dt.size()) as f64, iters, || unsafe {
            red.reduce_raw(&stream, dt, ReduceOp::Sum, d.ptr(), 0, a.ptr(), b.ptr(), n)
        })
    }

    /// A result row for a ring collective with bus factor (n-1)/n; `wrong` summed over
    /// ranks.
    fn row(
        comm: &Communicator,
        coll: &str,
        bytes: usize,
        secs: f64,
        wrong: usize,
    ) -> Result<serde_json::Value> {
        let n = comm.world_size();
        let mut w = [wrong as f64];
        comm.all_reduce(&mut w, ReduceOp::Sum)?;
        let algbw = bytes as f64 / secs / 1e9;
        Ok(
            json!({"coll": coll, "ranks": n, "bytes": bytes, "dtype": "float", "op": "sum",
            "time_us": secs * 1e6, "algbw_gbs": algbw,
            "busbw_gbs": algbw * (n as f64 - 1.0) / n as f64, "wrong": w[0] as u64}),
        )
    }

    /// One rank of the IPC all-reduce check: f32 sums of small integers (exact), sizes
    /// 4 KiB .. max, plus an uneven count; rank 0 writes the rows to `out`.
    fn ipc_worker(a: &GpuCheckArgs, out: &std::path::Path) -> Result<bool> {
        let mut cfg = Config::from_env()?;
        cfg.transport.kind = TransportKind::CudaIpc;
        cfg.tuning.all_reduce_algo = a
            .ipc_algos
            .parse()
            .map_err(|e| Error::InvalidArgument(format!("--ipc-algos: {e}")))?;
        let comm = Communicator::init(cfg)?;
        let dev = Device::shared(a.gpu)?;
        let stream = dev.stream().clone();
        let (n, r) = (comm.world_size(), comm.rank());
        let mut rows = Vec::new();
        let mut ok = ipc_all_reduce(a, &comm, &stream, &mut rows)?;
        if a.ipc_all_reduce_only {
            return write_rows(r, out, &rows).map(|()| ok);
        }
        // Reduce-scatter and all-gather over the same IPC ring: exact results and
        // busbw (factor (n-1)/n, S the full gathered size), at 1 MiB-ish per rank
        // (uneven) and at the largest size.
        let mut per_rank: Vec<usize> = vec![(1 << 18) + 3];
        if a.max_bytes / 4 / n > per_rank[0] {
            per_rank.push(a.max_bytes / 4 / n);
        }
        for count in per_rank {
            let total = count * n;
            let send: Vec<f32> = (0..total).map(|i| ((i * 7 + r * 13) % 17) as f32).collect();
            let iters = a.iters.clamp(1, 5);
            ok &= ipc_reduce_scatter(&comm, &stream, &send, count, iters, &mut rows)?;
            ok &= ipc_all_gather(&comm, &stream, count, iters, &mut rows)?;
            ok &= ipc_chains(&comm, &stream, &send, iters, &mut rows)?;
        }
        write_rows(r, out, &rows)?;
        Ok(ok)
    }

    /// Rank 0 writes the worker's rows to `out`.
    fn write_rows(rank: usize, out: &std::path::Path, rows: &[serde_json::Value]) -> Result<()> {
        if rank == 0 {
            std::fs::write(out, serde_json::to_vec(rows).unwrap_or_default())
                .map_err(|e| Error::io(format!("writing {}", out.display()), e))?;
        }
        Ok(())
    }

    /// The worker's all-reduces, one row per size. Returns whether every result was
    /// right.
    fn ipc_all_reduce(
        a: &GpuCheckArgs,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let (n, r) = (comm.world_size(), comm.rank());
        let mut sizes: Vec<usize> = vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];
        sizes.retain(|&s| s <= a.max_bytes);
        sizes.push(4 * ((1 << 20) + 3)); // not divisible by n
        let mut ok = true;
        for bytes in sizes {
            let count = bytes / 4;
            let input: Vec<f32> = (0..count).map(|i| ((i * 7 + r * 13) % 17) as f32).collect();
            let mut d = stream.clone_htod(&input).map_err(drv("cuMemcpyHtoD"))?;
            for _ in 0..2 {
                comm.all_reduce_device(&mut d, ReduceOp::Sum)?;
            }
            let iters = if bytes >= 64 << 20 {
                a.iters.min(5)
            } else {
                a.iters
            };
            let t = per_call(comm, iters, || {
                comm.all_reduce_device(&mut d, ReduceOp::Sum)
            })?;
            stream
                .memcpy_htod(&input, &mut d)
                .map_err(drv("cuMemcpyHtoD"))?;
            comm.all_reduce_device(&mut d, ReduceOp::Sum)?;
            let got: Vec<f32> = stream.clone_dtoh(&d).map_err(drv("cuMemcpyDtoH"))?;
            let wrong = got
                .iter()
                .enumerate()
                .filter(|&(i, &g)| {
                    let want: usize = (0..n).map(|q| (i * 7 + q * 13) % 17).sum();
                    g != want as f32
                })
                .count();
            let mut w = [wrong as f64];
            comm.all_reduce(&mut w, ReduceOp::Sum)?;
            ok &= w[0] == 0.0;
            let algbw = bytes as f64 / t / 1e9;
            rows.push(
                json!({"coll": "all_reduce", "ranks": n, "bytes": bytes, "dtype": "float", "op": "sum",
                "algo": a.ipc_algos, "ran": comm.device_all_reduce_algorithm(bytes).name(),
                "time_us": t * 1e6, "algbw_gbs": algbw,
                "busbw_gbs": algbw * 2.0 * (n as f64 - 1.0) / n as f64, "wrong": w[0] as u64}),
            );
        }
        Ok(ok)
    }

    /// Seconds per call of `run`, called `iters` times (at least once) after a barrier:
    /// the slowest rank's.
    fn per_call(
        comm: &Communicator,
        iters: usize,
        mut run: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let iters = iters.max(1);
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            run()?;
        }
        let mut t = [t0.elapsed().as_secs_f64() / iters as f64];
        comm.all_reduce(&mut t, ReduceOp::Max)?;
        Ok(t[0])
    }

    /// The worker's reduce-scatter of `send` (`count` elements per rank), one row.
    /// Returns whether its result was right.
    fn ipc_reduce_scatter(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        send: &[f32],
        count: usize,
        iters: usize,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let (n, r) = (comm.world_size(), comm.rank());
        let total = count * n;
        let ds = stream.clone_htod(send).map_err(drv("cuMemcpyHtoD"))?;
        let mut dr = stream
            .clone_htod(&vec![0f32; count])
            .map_err(drv("cuMemcpyHtoD"))?;
        comm.reduce_scatter_device(&ds, &mut dr, ReduceOp::Sum)?;
        let t = per_call(comm, iters, || {
            comm.reduce_scatter_device(&ds, &mut dr, ReduceOp::Sum)
        })?;
        let got: Vec<f32> = stream.clone_dtoh(&dr).map_err(drv("cuMemcpyDtoH"))?;
        let wrong = got
            .iter()
            .enumerate()
            .filter(|&(k, &g)| {
                let i = r * count + k;
                let want: usize = (0..n).map(|q| (i * 7 + q * 13) % 17).sum();
                g != want as f32
            })
            .count();
        rows.push(row(comm, "reduce_scatter", total * 4, t, wrong)?);
        Ok(rows.last().and_then(|v| v["wrong"].as_u64()) == Some(0))
    }

    /// The worker's all-gather of `count` elements per rank, one row. Returns whether
    /// its result was right.
    fn ipc_all_gather(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        count: usize,
        iters: usize,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let (n, r) = (comm.world_size(), comm.rank());
        let total = count * n;
        let mine: Vec<f32> = (0..count).map(|k| ((k * 3 + r * 5) % 11) as f32).collect();
        let dm = stream.clone_htod(&mine).map_err(drv("cuMemcpyHtoD"))?;
        let mut dg = stream
            .clone_htod(&vec![0f32; total])
            .map_err(drv("cuMemcpyHtoD"))?;
        comm.all_gather_device(&dm, &mut dg)?;
        let t = per_call(comm, iters, || comm.all_gather_device(&dm, &mut dg))?;
        let got: Vec<f32> = stream.clone_dtoh(&dg).map_err(drv("cuMemcpyDtoH"))?;
        let wrong = got
            .iter()
            .enumerate()
            .filter(|&(i, &g)| g != ((i % count * 3 + i / count * 5) % 11) as f32)
            .count();
        rows.push(row(comm, "all_gather", total * 4, t, wrong)?);
        Ok(rows.last().and_then(|v| v["wrong"].as_u64()) == Some(0))
    }

    /// The worker's broadcast and reduce (chains), root n-1, of the whole `send`, one
    /// row each. Returns whether both results were right.
    fn ipc_chains(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        send: &[f32],
        iters: usize,
        rows: &mut Vec<serde_json::Value>,
    ) -> Result<bool> {
        let (n, r) = (comm.world_size(), comm.rank());
        let total = send.len();
        let mut ok = true;
        // Broadcast and reduce (chains), root n-1, of the whole `total` elements.
        let root = n - 1;
        for coll in ["broadcast", "reduce"] {
            let mut db = stream.clone_htod(send).map_err(drv("cuMemcpyHtoD"))?;
            let run = |db: &mut cuda::cudarc::driver::CudaSlice<f32>| match coll {
                "broadcast" => comm.broadcast_device(db, root),
                _ => comm.reduce_device(db, ReduceOp::Sum, root),
            };
            let t = per_call(comm, iters, || run(&mut db))?;
            stream
                .memcpy_htod(send, &mut db)
                .map_err(drv("cuMemcpyHtoD"))?;
            run(&mut db)?;
            let got: Vec<f32> = stream.clone_dtoh(&db).map_err(drv("cuMemcpyDtoH"))?;
            let wrong = if coll == "broadcast" {
                got.iter()
                    .enumerate()
                    .filter(|&(i, &g)| g != ((i * 7 + root * 13) % 17) as f32)
                    .count()
            } else if r == root {
                got.iter()
                    .enumerate()
                    .filter(|&(i, &g)| {
                        let want: usize = (0..n).map(|q| (i * 7 + q * 13) % 17).sum();
                        g != want as f32
                    })
                    .count()
            } else {
                0
            };
            rows.push(row(comm, coll, total * 4, t, wrong)?);
            ok &= rows.last().and_then(|v| v["wrong"].as_u64()) == Some(0);
        }
        Ok(ok)
    }
}
