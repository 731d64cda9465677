//! `ferroccl bench`: the nccl-tests `all_reduce_perf` table, for ferroccl.
//!
//! Under a launcher (`ferroccl launch`, `mpirun`, `srun`, `torchrun`) each process is one
//! rank and rank 0 prints. Started bare, it runs `--ranks N` local ranks itself: as
//! processes through `ferroccl launch` for `--transport tcp`, as threads for `local`.

use clap::Args;
use ferroccl::transport::TransportKind;
use ferroccl::{Communicator, Config, DataType, Element, ReduceOp};
use half::{bf16, f16};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Arguments of `ferroccl bench` (the nccl-tests flags, plus ours).
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Collective to measure (all_reduce for now).
    #[arg(default_value = "all_reduce")]
    pub collective: String,
    /// Smallest message size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest message size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step_factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Data type: float, double, half, bfloat16, int32, int64, uint8.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Root rank (rooted collectives only).
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Ranks to start when not run under a launcher.
    #[arg(long = "ranks", default_value_t = 4)]
    pub ranks: usize,
    /// Transport: tcp or local (threads in one process).
    #[arg(long = "transport", default_value = "tcp")]
    pub transport: String,
    /// Ring segment size in bytes (pipelining granularity).
    #[arg(long = "segment-bytes", value_parser = parse_size)]
    pub segment_bytes: Option<usize>,
    /// Seconds a collective may wait without progress.
    #[arg(long = "timeout", default_value_t = 60.0)]
    pub timeout: f64,
    /// Seconds start-up may take (reaching the store, connecting to peers).
    #[arg(long = "connect-timeout", default_value_t = 60.0)]
    pub connect_timeout: f64,
    /// All-reduces up to this size use recursive doubling instead of the ring (0: always ring).
    #[arg(long = "small-message-bytes", value_parser = parse_size)]
    pub small_message_bytes: Option<usize>,
    /// Microseconds a waiting rank polls its links before sleeping (see Config::busy_poll).
    #[arg(long = "busy-poll-us")]
    pub busy_poll_us: Option<u64>,
    /// Also write the rows as JSON to this file (rank 0).
    #[arg(long = "json")]
    pub json: Option<std::path::PathBuf>,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|v| v.checked_mul(mul))
        .ok_or_else(|| format!("{s:?} is not a size (bytes, or with K/M/G)"))
}

/// One line of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub bytes: usize,
    pub count: usize,
    pub oop_us: f64,
    pub oop_wrong: u64,
    pub ip_us: f64,
    pub ip_wrong: u64,
    /// Payload bytes sent per rank per operation (max over ranks).
    pub wire_bytes: f64,
    /// Header bytes sent per rank per operation (max over ranks).
    pub header_bytes: f64,
}

pub fn main(a: BenchArgs) -> ExitCode {
    match run(a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("ferroccl bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn config_for(a: &BenchArgs, base: Config) -> Config {
    let mut c = base;
    if let Some(s) = a.segment_bytes {
        c.segment_bytes = s;
    }
    c.timeout = Duration::from_secs_f64(a.timeout.max(0.001));
    c.connect_timeout = Duration::from_secs_f64(a.connect_timeout.max(0.001));
    if let Some(b) = a.small_message_bytes {
        c.small_message_bytes = b;
    }
    if let Some(us) = a.busy_poll_us {
        c.busy_poll = Duration::from_micros(us);
    }
    c
}

/// Returns whether every result checked out.
fn run(a: BenchArgs) -> ferroccl::Result<bool> {
    if a.collective != "all_reduce" && a.collective != "allreduce" {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "unknown collective {:?}: this build benchmarks all_reduce",
            a.collective
        )));
    }
    let dtype = DataType::parse(&a.dtype)?;
    let op = ReduceOp::parse(&a.op)?;
    ferroccl::reduce::check_op(dtype, op)?;
    let transport = TransportKind::parse(&a.transport)?;
    if a.step_factor < 2 && a.min_bytes != a.max_bytes {
        return Err(ferroccl::Error::InvalidArgument(
            "-f must be at least 2".into(),
        ));
    }
    if a.min_bytes > a.max_bytes {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "-b {} is larger than -e {}",
            a.min_bytes, a.max_bytes
        )));
    }
    if a.iters == 0 {
        return Err(ferroccl::Error::InvalidArgument(
            "-n must be at least 1".into(),
        ));
    }

    if let Some(_env) = ferroccl::rendezvous::detect_env()? {
        let cfg = config_for(&a, Config::from_env()?);
        let mut comm = Communicator::init(cfg)?;
        return rank_main(&a, dtype, op, &mut comm, transport.name());
    }
    if a.ranks == 0 {
        return Err(ferroccl::Error::InvalidArgument(
            "--ranks must be at least 1".into(),
        ));
    }
    match transport {
        TransportKind::Local => {
            let base = config_for(&a, Config::new(0, 1, ""));
            let comms = Communicator::local_group(a.ranks, &base)?;
            let results: Vec<ferroccl::Result<bool>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|mut c| {
                        let a = &a;
                        s.spawn(move || rank_main(a, dtype, op, &mut c, "local"))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(ferroccl::Error::InvalidArgument(
                                "a rank thread panicked".into(),
                            ))
                        })
                    })
                    .collect()
            });
            let mut ok = true;
            for r in results {
                ok &= r?;
            }
            Ok(ok)
        }
        _ => {
            // Re-run this very command once per rank under our own launcher.
            let exe = std::env::current_exe()
                .map_err(|e| ferroccl::Error::io("locating the ferroccl binary", e))?;
            let mut cmd: Vec<std::ffi::OsString> = vec![exe.into_os_string()];
            cmd.extend(std::env::args_os().skip(1));
            let opts = crate::launch::LaunchOptions {
                bare_stdout_rank: Some(0),
                ..Default::default()
            };
            match crate::launch::run(a.ranks, &cmd, &opts) {
                Ok(()) => Ok(true),
                Err(e) => {
                    eprintln!("ferroccl bench: {e}");
                    Ok(false)
                }
            }
        }
    }
}

fn sizes(a: &BenchArgs, esize: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes.max(esize);
    loop {
        v.push(s / esize * esize);
        if s >= a.max_bytes || a.step_factor < 2 {
            break;
        }
        s = s.saturating_mul(a.step_factor).min(a.max_bytes);
    }
    v.dedup();
    v
}

fn rank_main(
    a: &BenchArgs,
    dtype: DataType,
    op: ReduceOp,
    c: &mut Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    match dtype {
        DataType::F32 => bench_typed::<f32>(a, op, c, tname),
        DataType::F64 => bench_typed::<f64>(a, op, c, tname),
        DataType::F16 => bench_typed::<f16>(a, op, c, tname),
        DataType::BF16 => bench_typed::<bf16>(a, op, c, tname),
        DataType::I32 => bench_typed::<i32>(a, op, c, tname),
        DataType::I64 => bench_typed::<i64>(a, op, c, tname),
        DataType::U8 => bench_typed::<u8>(a, op, c, tname),
        _ => Err(ferroccl::Error::InvalidArgument(format!(
            "unsupported dtype {dtype}"
        ))),
    }
}

/// Rank `r`'s input element `i`: small integers, so every reduction order gives the
/// exact same answer in every type and the check can be exact.
fn value(op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Prod => 1.0 + (i + r).is_multiple_of(7) as u8 as f64,
        _ => ((i * 7 + r * 13) % 17) as f64,
    }
}

fn expected(op: ReduceOp, n: usize, i: usize) -> f64 {
    let xs = (0..n).map(|r| value(op, r, i));
    match op {
        ReduceOp::Sum => xs.sum(),
        ReduceOp::Avg => xs.sum::<f64>() / n as f64,
        ReduceOp::Prod => xs.product(),
        ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
        _ => xs.fold(f64::NEG_INFINITY, f64::max),
    }
}

fn fill<T: Element>(v: &mut [T], op: ReduceOp, r: usize) {
    for (i, x) in v.iter_mut().enumerate() {
        *x = T::from_f64(value(op, r, i));
    }
}

fn count_wrong<T: Element>(v: &[T], op: ReduceOp, n: usize) -> u64 {
    v.iter()
        .enumerate()
        .filter(|(i, x)| {
            let want = T::from_f64(expected(op, n, *i));
            if T::DTYPE.is_float() {
                let (g, w) = (x.to_f64(), want.to_f64());
                // Written so that a NaN result counts as wrong.
                let close = (g - w).abs() <= 1e-2 * w.abs().max(1.0);
                !close
            } else {
                **x != want
            }
        })
        .count() as u64
}

fn max_over_ranks(c: &mut Communicator, x: f64) -> ferroccl::Result<f64> {
    let mut v = [x];
    c.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

fn bench_typed<T: Element>(
    a: &BenchArgs,
    op: ReduceOp,
    c: &mut Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    let n = c.world_size();
    let esize = std::mem::size_of::<T>();
    let sizes = sizes(a, esize);
    let max_count = sizes.iter().max().copied().unwrap_or(0) / esize;
    let mut send = vec![T::default(); max_count];
    let mut recv = vec![T::default(); max_count];
    fill(&mut send, op, c.rank());
    let printer = c.rank() == 0;
    if printer {
        println!(
            "# ferroccl bench: all_reduce, {n} ranks, transport {tname}, segment {} B, busy-poll {:?}, timeout {:?}",
            c.config().segment_bytes,
            c.config().busy_poll,
            c.config().timeout
        );
        println!(
            "# minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {}",
            a.min_bytes, a.max_bytes, a.step_factor, a.warmup, a.iters, a.check
        );
        println!("#");
        println!("# wire: payload bytes each rank sent per operation, counted by its links, over the ring law 2(n-1)/n*S");
        println!(
            "# algo: ring, or rd (recursive doubling) for messages up to {} B: fewer steps, more bytes",
            c.config().small_message_bytes
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            "", "", "", "", "", "out-of-place", "", "", "", "in-place", "", "", "", "", ""
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "wire", "algo"
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(x law)", ""
        );
    }
    let factor = if n > 1 {
        2.0 * (n as f64 - 1.0) / n as f64
    } else {
        0.0
    };
    let mut rows = Vec::new();
    let mut total_wrong = 0u64;
    for &bytes in &sizes {
        let count = bytes / esize;
        // Out of place: recv = allreduce(send).
        for _ in 0..a.warmup {
            c.all_reduce_into(&send[..count], &mut recv[..count], op)?;
        }
        max_over_ranks(c, 0.0)?; // barrier
        let before = c.wire_stats();
        let t0 = Instant::now();
        for _ in 0..a.iters {
            c.all_reduce_into(&send[..count], &mut recv[..count], op)?;
        }
        let oop = t0.elapsed().as_secs_f64() / a.iters as f64;
        let wire = c.wire_stats().since(&before);
        let oop_wrong = if a.check != 0 {
            count_wrong(&recv[..count], op, n)
        } else {
            0
        };

        // In place: the buffer is reduced again each iteration; it is refilled and
        // reduced once more for the check.
        recv[..count].copy_from_slice(&send[..count]);
        for _ in 0..a.warmup {
            c.all_reduce(&mut recv[..count], op)?;
        }
        max_over_ranks(c, 0.0)?;
        let t0 = Instant::now();
        for _ in 0..a.iters {
            c.all_reduce(&mut recv[..count], op)?;
        }
        let ip = t0.elapsed().as_secs_f64() / a.iters as f64;
        let ip_wrong = if a.check != 0 {
            recv[..count].copy_from_slice(&send[..count]);
            c.all_reduce(&mut recv[..count], op)?;
            count_wrong(&recv[..count], op, n)
        } else {
            0
        };

        let oop = max_over_ranks(c, oop)?;
        let ip = max_over_ranks(c, ip)?;
        let wire_bytes = max_over_ranks(c, wire.payload_sent as f64 / a.iters as f64)?;
        let header_bytes = max_over_ranks(c, wire.header_sent as f64 / a.iters as f64)?;
        let mut wrong = [oop_wrong as f64, ip_wrong as f64];
        c.all_reduce(&mut wrong, ReduceOp::Sum)?;
        let row = Row {
            bytes,
            count,
            oop_us: oop * 1e6,
            oop_wrong: wrong[0] as u64,
            ip_us: ip * 1e6,
            ip_wrong: wrong[1] as u64,
            wire_bytes,
            header_bytes,
        };
        total_wrong += row.oop_wrong + row.ip_wrong;
        if printer {
            let law = factor * bytes as f64;
            let wire_col = if law > 0.0 {
                format!("{:.3}", row.wire_bytes / law)
            } else {
                "-".into()
            };
            let gb = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
            println!(
                "{:>12} {:>12} {:>8} {:>6} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6} {:>7} {:>5}",
                bytes,
                count,
                T::DTYPE.name(),
                op.name(),
                -1,
                row.oop_us,
                gb(row.oop_us),
                gb(row.oop_us) * factor,
                if a.check != 0 { row.oop_wrong.to_string() } else { "N/A".into() },
                row.ip_us,
                gb(row.ip_us),
                gb(row.ip_us) * factor,
                if a.check != 0 { row.ip_wrong.to_string() } else { "N/A".into() },
                wire_col,
                match c.all_reduce_algorithm(bytes) {
                    ferroccl::Algorithm::Ring => "ring",
                    _ => "rd",
                }
            );
        }
        rows.push(row);
    }
    if printer {
        let avg_busbw = rows
            .iter()
            .map(|r| r.bytes as f64 / (r.ip_us * 1e-6) / 1e9 * factor)
            .sum::<f64>()
            / rows.len().max(1) as f64;
        println!(
            "# Out of bounds values : {} {}",
            total_wrong,
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {avg_busbw:.4} ");
        println!("#");
        if let Some(path) = &a.json {
            write_json(path, n, tname, T::DTYPE, op, factor, &rows)?;
        }
    }
    Ok(total_wrong == 0)
}

fn write_json(
    path: &std::path::Path,
    n: usize,
    tname: &str,
    dt: DataType,
    op: ReduceOp,
    factor: f64,
    rows: &[Row],
) -> ferroccl::Result<()> {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"all_reduce\",\n  \"ranks\": {n},\n  \"transport\": \"{tname}\",\n  \"dtype\": \"{}\",\n  \"op\": \"{}\",\n  \"bus_factor\": {factor},\n  \"rows\": [\n",
        dt.name(),
        op.name()
    );
    for (i, r) in rows.iter().enumerate() {
        let gb = |us: f64| r.bytes as f64 / (us * 1e-6) / 1e9;
        let _ = writeln!(
            s,
            "    {{\"bytes\": {}, \"count\": {}, \"oop_time_us\": {:.3}, \"oop_algbw_gbs\": {:.6}, \"oop_busbw_gbs\": {:.6}, \"oop_wrong\": {}, \"ip_time_us\": {:.3}, \"ip_algbw_gbs\": {:.6}, \"ip_busbw_gbs\": {:.6}, \"ip_wrong\": {}, \"payload_bytes_sent_per_rank\": {:.1}, \"header_bytes_sent_per_rank\": {:.1}}}{}",
            r.bytes,
            r.count,
            r.oop_us,
            gb(r.oop_us),
            gb(r.oop_us) * factor,
            r.oop_wrong,
            r.ip_us,
            gb(r.ip_us),
            gb(r.ip_us) * factor,
            r.ip_wrong,
            r.wire_bytes,
            r.header_bytes,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("  ]\n}\n");
    std::fs::write(path, s)
        .map_err(|e| ferroccl::Error::io(format!("writing {}", path.display()), e))
}
