//! `ferroccl bench --device cuda`: the same collectives on device buffers (cudarc
//! `CudaSlice`), over the chosen transport — staged through pinned host memory for tcp
//! and local, read directly from the neighbours' memory for `--transport cuda-ipc`.
//! Each rank uses
//! GPU `local_rank % device_count`, so several ranks may share one GPU.
//!
//! One table: in-place time, algbw, busbw and #wrong (result copied back and checked
//! against the same exact expectation as the host bench). Times are per operation,
//! each operation returning with its result on the device, max over ranks.

use super::check::{count_wrong, fill};
use super::typed::max_over_ranks;
use super::{sizes, BenchArgs, Coll};
use ferroccl::cuda::{self, cudarc::driver::DeviceRepr, Device};
use ferroccl::{Communicator, DataType, Element, ReduceOp};
use std::time::Instant;

/// Runs the device bench on this rank.
pub(super) fn rank_main(
    a: &BenchArgs,
    coll: Coll,
    dtype: DataType,
    op: ReduceOp,
    c: &Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    with_dtype!(dtype, typed(a, coll, op, c, tname))
}

fn typed<T: Element + DeviceRepr>(
    a: &BenchArgs,
    coll: Coll,
    op: ReduceOp,
    c: &Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    if !matches!(
        coll,
        Coll::AllReduce | Coll::ReduceScatter | Coll::AllGather | Coll::Broadcast | Coll::Reduce
    ) {
        return Err(ferroccl::Error::Unavailable {
            what: format!("{} on device buffers", coll.name()),
            why: "all-to-all, gather, scatter and sendrecv run on host buffers only so far".into(),
        });
    }
    let p = cuda::probe()?;
    let dev = Device::shared(c.local_rank() % p.devices)?;
    let stream = dev.stream().clone();
    let drv = |call: &'static str| {
        move |e: cuda::cudarc::driver::DriverError| ferroccl::Error::Cuda {
            call: call.into(),
            detail: format!("{:?}", e.0),
        }
    };
    let n = c.world_size();
    let rank = c.rank();
    let root = a.root;
    let esize = std::mem::size_of::<T>();
    let unit = if coll.blocked() { esize * n } else { esize };
    let sizes = sizes(a, unit);
    if rank == 0 {
        print_header(coll, &dev, n, tname);
    }
    let op_name = if coll.reduces() { op.name() } else { "none" };
    let root_col: i64 = if coll.rooted() { root as i64 } else { -1 };
    let mut total_wrong = 0u64;
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let count = bytes / esize;
        let in_count = match coll {
            Coll::AllGather => count / n,
            _ => count,
        };
        let out_count = match coll {
            Coll::ReduceScatter => count / n,
            _ => count,
        };
        let mut input = vec![T::default(); in_count];
        match coll {
            Coll::AllGather | Coll::Broadcast => fill(&mut input, ReduceOp::Sum, rank, 0),
            _ => fill(&mut input, op, rank, 0),
        }
        let mut d_in = stream.clone_htod(&input).map_err(drv("cuMemcpyHtoD"))?;
        let mut d_out = stream
            .clone_htod(&vec![T::default(); out_count])
            .map_err(drv("cuMemcpyHtoD"))?;
        let once = |d_in: &mut cuda::cudarc::driver::CudaSlice<T>,
                    d_out: &mut cuda::cudarc::driver::CudaSlice<T>|
         -> ferroccl::Result<()> {
            match coll {
                Coll::AllReduce => c.all_reduce_device(d_in, op),
                Coll::ReduceScatter => c.reduce_scatter_device(d_in, d_out, op),
                Coll::AllGather => c.all_gather_device(d_in, d_out),
                Coll::Broadcast => c.broadcast_device(d_in, root),
                Coll::Reduce => c.reduce_device(d_in, op, root),
                // Refused above.
                _ => Ok(()),
            }
        };
        for _ in 0..a.warmup {
            once(&mut d_in, &mut d_out)?;
        }
        c.barrier()?;
        // Device launches return before the work is done: a fixed count, not one
        // from the host's pace.
        let iters = super::iters_for(a.iters, None);
        let t0 = Instant::now();
        for _ in 0..iters {
            once(&mut d_in, &mut d_out)?;
        }
        dev.synchronize()?;
        let secs = max_over_ranks(c, t0.elapsed().as_secs_f64() / iters as f64)?;
        let wrong = if a.check != 0 {
            stream
                .memcpy_htod(&input, &mut d_in)
                .map_err(drv("cuMemcpyHtoD"))?;
            once(&mut d_in, &mut d_out)?;
            let res: Vec<T> = match coll {
                Coll::ReduceScatter | Coll::AllGather => stream.clone_dtoh(&d_out),
                _ => stream.clone_dtoh(&d_in),
            }
            .map_err(drv("cuMemcpyDtoH"))?;
            let mut w = [count_wrong(coll, &res, op, n, rank, root, count) as f64];
            c.all_reduce(&mut w, ReduceOp::Sum)?;
            w[0] as u64
        } else {
            0
        };
        total_wrong += wrong;
        // The all-reduce's algorithm (over CUDA IPC: one-shot, two-shot or the ring by
        // size; staged: the host's); the others run their ring or chain.
        let algo = match coll {
            Coll::AllReduce => c.device_all_reduce_algorithm(bytes).name(),
            _ => "-",
        };
        if rank == 0 {
            let algbw = bytes as f64 / secs / 1e9;
            println!(
                "{:>12} {:>12} {:>8} {:>6} {:>6}   {:>9.1} {:>8.2} {:>8.2} {:>6}  {algo}",
                bytes,
                count,
                T::DTYPE.name(),
                op_name,
                root_col,
                secs * 1e6,
                algbw,
                algbw * coll.bus_factor(n),
                wrong
            );
            rows.push(serde_json::json!({
                "bytes": bytes, "count": count, "ip_time_us": secs * 1e6,
                "ip_algbw_gbs": algbw, "ip_busbw_gbs": algbw * coll.bus_factor(n),
                "ip_wrong": wrong, "algo": algo,
            }));
        }
    }
    if let Some(path) = a.json.as_ref().filter(|_| rank == 0) {
        let meta = (coll, n, tname, T::DTYPE, op_name, root_col);
        write_json(path, meta, rows)?;
    }
    if rank == 0 {
        println!(
            "# Out of bounds values : {total_wrong} {}",
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
    }
    Ok(total_wrong == 0)
}

/// The table's header (rank 0).
fn print_header(coll: Coll, dev: &Device, n: usize, tname: &str) {
    println!(
        "# ferroccl bench: {} on device buffers ({} sm_{}{}, rank 0 on GPU {}), {n} ranks, transport {tname}",
        coll.name(),
        dev.name,
        dev.cc.0,
        dev.cc.1,
        dev.ordinal
    );
    println!("# in place; busbw = algbw x bus factor (nccl-tests); #wrong checked on a fresh run");
    println!(
        "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>8} {:>8} {:>6}  algo",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    println!(
        "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>9} {:>8} {:>8} {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
}

/// `--json`: the rows and what they measured, `(collective, ranks, transport, dtype,
/// op, root)`, as the host bench writes them (in-place columns only).
fn write_json(
    path: &std::path::Path,
    (coll, n, tname, dtype, op_name, root_col): (Coll, usize, &str, DataType, &str, i64),
    rows: Vec<serde_json::Value>,
) -> ferroccl::Result<()> {
    let doc = serde_json::json!({
        "tool": "ferroccl bench", "collective": coll.name(), "ranks": n,
        "transport": tname, "device": "cuda", "dtype": dtype.name(), "op": op_name,
        "root": root_col, "bus_factor": coll.bus_factor(n), "rows": rows,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap_or_default())
        .map_err(|e| ferroccl::Error::io(format!("writing {}", path.display()), e))
}
