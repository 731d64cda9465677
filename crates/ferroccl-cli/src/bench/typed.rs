//! The host bench of one element type: per size the out-of-place and in-place times,
//! the checks and the `wire` and `algo` columns, then the summary, the laws and the JSON.

use super::bufs::Bufs;
use super::check::count_wrong;
use super::report::{
    hier_shape, mem_rates, print_host_laws, print_law, print_mem_law, write_json, JsonMeta,
};
use super::{describe_links, sizes, BenchArgs, Coll, LawArg, Row};
use crate::law::RingLaw;
use ferroccl::{Communicator, DataType, Element, ReduceOp};
use std::time::Instant;

/// Seconds per operation, the same on every rank, and the bytes this rank's links
/// moved during the iterations: with `--stat avg` the mean of back-to-back iterations
/// (max over ranks); with `--stat median` each iteration timed after a barrier, the
/// max over ranks per iteration, then the median. Barriers move headers but no
/// payload, so the payload count is the operations' alone.
/// The payload bytes are also given split `(within this rank's host, to other hosts)`
/// when the communicator knows the hosts.
fn timed(
    c: &Communicator,
    a: &BenchArgs,
    iters: usize,
    mut op: impl FnMut() -> ferroccl::Result<()>,
) -> ferroccl::Result<Timed> {
    let before = (c.wire_stats(), c.wire_stats_by_host());
    let sent = |c: &Communicator| {
        let by_host = before
            .1
            .as_ref()
            .zip(c.wire_stats_by_host())
            .map(|(b, a)| (a.0.since(&b.0).payload_sent, a.1.since(&b.1).payload_sent));
        (c.wire_stats().since(&before.0), by_host)
    };
    if a.stat == "median" {
        let mut ts = Vec::with_capacity(iters.min(1 << 20));
        for _ in 0..iters {
            c.barrier()?;
            let t0 = Instant::now();
            op()?;
            ts.push(t0.elapsed().as_secs_f64());
        }
        let (wire, by_host) = sent(c);
        c.all_reduce(&mut ts, ReduceOp::Max)?;
        ts.sort_by(f64::total_cmp);
        return Ok((ts[ts.len() / 2], wire, by_host));
    }
    let t0 = Instant::now();
    for _ in 0..iters {
        op()?;
    }
    let secs = t0.elapsed().as_secs_f64() / iters as f64;
    let (wire, by_host) = sent(c);
    Ok((max_over_ranks(c, secs)?, wire, by_host))
}

/// Runs `op` the warm-up's `-w` times, and says how many timed iterations follow
/// ([`super::iters_for`]: `-n`, else from the slowest rank's warm-up pace, the same on
/// every rank).
fn warm_up(
    c: &Communicator,
    a: &BenchArgs,
    mut op: impl FnMut() -> ferroccl::Result<()>,
) -> ferroccl::Result<usize> {
    let t0 = Instant::now();
    for _ in 0..a.warmup {
        op()?;
    }
    if a.iters.is_some() || a.warmup == 0 {
        return Ok(super::iters_for(a.iters, None));
    }
    let pace = max_over_ranks(c, t0.elapsed().as_secs_f64() / a.warmup as f64)?;
    Ok(super::iters_for(None, Some(pace)))
}

/// Seconds per operation, the payload bytes this rank sent, and those split by host.
type Timed = (f64, ferroccl::WireStats, Option<(u64, u64)>);

pub(super) fn max_over_ranks(c: &Communicator, x: f64) -> ferroccl::Result<f64> {
    let mut v = [x];
    c.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

/// The columns every row repeats, and the names the JSON file gives.
struct Fixed<'a> {
    tname: &'a str,
    dtype: DataType,
    /// The `redop` column: the reduction, or `none` for a collective without one.
    op: &'static str,
    /// The `root` column: the root, or -1 for a collective without one.
    root: i64,
    /// busbw / algbw.
    factor: f64,
}

/// The bench of one element type on this rank: the table (rank 0 prints it), then the
/// summary, the laws and the JSON file. Returns whether every result checked out.
pub(super) fn bench_typed<T: Element>(
    a: &BenchArgs,
    coll: Coll,
    op: ReduceOp,
    c: &Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    let n = c.world_size();
    if a.law.is_some() && n < 2 {
        // One rank sends nothing: there is no link whose law could be checked.
        return Err(ferroccl::Error::InvalidArgument(
            "--law needs at least 2 ranks".into(),
        ));
    }
    let rank = c.rank();
    let esize = std::mem::size_of::<T>();
    let unit = if coll.blocked() { esize * n } else { esize };
    let sizes = sizes(a, unit);
    let max_count = sizes.iter().max().copied().unwrap_or(0) / esize;
    let mut bufs = Bufs {
        send: vec![T::default(); max_count],
        recv: vec![T::default(); max_count],
    };
    let printer = rank == 0;
    let fixed = Fixed {
        tname,
        dtype: T::DTYPE,
        op: if coll.reduces() { op.name() } else { "none" },
        root: if coll.rooted() { a.root as i64 } else { -1 },
        factor: coll.bus_factor(n),
    };
    if printer {
        print_header(a, coll, c, tname)?;
    }
    // On several hosts of several ranks, all_reduce's bytes are also counted per link
    // class (within a host, between hosts).
    let hosts_of: Option<Vec<Vec<usize>>> = c
        .host_layout()
        .filter(|l| {
            matches!(
                coll,
                Coll::AllReduce | Coll::ReduceScatter | Coll::AllGather
            ) && l.shape().is_some_and(|(h, k)| h >= 2 && k >= 2)
        })
        .map(|l| l.hosts().to_vec());
    let mut rows = Vec::new();
    let mut total_wrong = 0u64;
    for &bytes in &sizes {
        let row = measure(a, coll, op, c, &mut bufs, bytes, hosts_of.as_deref())?;
        total_wrong += row.oop_wrong + row.ip_wrong;
        if printer {
            print_row(a, coll, c, &row, &fixed);
        }
        rows.push(row);
    }
    finish(a, coll, c, &rows, total_wrong, hosts_of.as_deref(), &fixed)?;
    Ok(total_wrong == 0)
}

/// Rank 0's lines above the table: the run, the links, the flags, what busbw and
/// `wire` mean, the law or the algorithm, and the column heads.
fn print_header(a: &BenchArgs, coll: Coll, c: &Communicator, tname: &str) -> ferroccl::Result<()> {
    let n = c.world_size();
    println!(
        "# ferroccl bench: {}, {n} ranks, transport {tname}, segment {} B, busy-poll {:?}, timeout {:?}",
        coll.name(),
        c.config().tuning.segment_bytes,
        c.config().tuning.busy_poll,
        c.config().tuning.timeout
    );
    let links = c.link_classes();
    println!("# links of rank 0: {}", describe_links(&links));
    if links.iter().any(|(_, class)| *class == "tcp") {
        let want = &c.config().transport.tcp.congestion;
        let (now, system) = ferroccl::transport::tcp_congestion_in_effect(want)?;
        println!("# tcp congestion control: {now} (system default {system})");
    }
    println!(
        "# minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {} timing: {}",
        a.min_bytes,
        a.max_bytes,
        a.step_factor,
        a.warmup,
        a.iters.map_or_else(
            || format!("auto (>= {}, >= {:?} per size)", super::MIN_ITERS, super::AUTO_TIME),
            |n| n.to_string()
        ),
        a.check,
        a.stat
    );
    println!("#");
    println!(
        "# busbw = algbw x {}; wire: payload bytes the busiest rank sent per operation, counted by its links, over {}",
        coll.factor_text(),
        match coll {
            Coll::AllReduce if c.host_layout().and_then(|l| l.shape()).is_some_and(|(h, k)| h >= 2 && k >= 2) =>
                "the ring law 2(n-1)/n*S (hier: 2(k-1)/k*S + 2(H-1)/H*S/k, H hosts of k ranks)",
            c => c.law_text(),
        }
    );
    if coll == Coll::SendRecv {
        println!("# in-place: the same exchange from the other buffer (a batch borrows its send and receive buffers apart)");
    }
    print_algo(a, coll, c);
    print_column_heads();
    Ok(())
}

/// The header's line on the law `--law RATE` checks, or on the algorithm all_reduce
/// runs at each size.
fn print_algo(a: &BenchArgs, coll: Coll, c: &Communicator) {
    if let Some(rate) = a.law_rate() {
        println!(
            "# law: ring on links of {:.4} Gbit/s ({} B/s){}",
            rate * 8e-9,
            rate,
            match (coll, c.config().tuning.all_reduce_algo) {
                (Coll::AllReduce, ferroccl::AllReduceAlgo::Auto) => {
                    "; all_reduce forced onto the ring for every size (small_message_bytes = 0; hierarchical on hosts of 2 or more ranks)"
                }
                (Coll::AllReduce, _) => "; all_reduce runs what --algo names",
                _ => "",
            }
        );
    } else if coll == Coll::AllReduce {
        let t = &c.config().tuning;
        match (t.all_reduce_algo, t.cost_model) {
            (ferroccl::AllReduceAlgo::Auto, Some(m)) => println!(
                "# algo: per size, the least time predicted on {m}{} (rab: Rabenseifner, tree: double binary tree)",
                if t.measure_cost_model { " (measured on these links)" } else { "" }
            ),
            (ferroccl::AllReduceAlgo::Auto, None)
                if c.all_reduce_algorithm(1 << 20) == ferroccl::Algorithm::TwoShot =>
            {
                // Symmetric memory: the largest power of two of each algorithm.
                let last = |a: ferroccl::Algorithm| {
                    (0..40)
                        .map(|k| 1usize << k)
                        .filter(|&b| c.all_reduce_algorithm(b) == a)
                        .last()
                        .unwrap_or(0)
                };
                let (one, rd, two) = (
                    last(ferroccl::Algorithm::OneShot),
                    last(ferroccl::Algorithm::RecursiveDoubling),
                    last(ferroccl::Algorithm::TwoShot),
                );
                let slots = if one > 0 {
                    format!("1shot from the slots up to {one} B (each rank reduces every rank's buffer from its slot), ")
                } else {
                    String::new()
                };
                println!(
                    "# algo: every rank on this host, symmetric memory: {slots}rd (recursive doubling over the rings) up to {rd} B, 2shot up to {two} B (each rank reduces 1/n of all the ranks' memory, then copies the rest; wire 'mem': no payload crossed a link), ring through the rings above"
                )
            }
            (ferroccl::AllReduceAlgo::Auto, None) => println!(
                "# algo: ring (hier on hosts of 2 or more ranks each), or rd (recursive doubling) for messages up to {} B: fewer steps, more bytes",
                t.small_message_bytes
            ),
            (forced, _) => println!(
                "# algo: {forced:?} for every size (rab: Rabenseifner, recursive halving then doubling; tree: double binary tree)"
            ),
        }
    }
}

/// The three lines of column heads.
fn print_column_heads() {
    let blank = ["", "", "", "", ""];
    println!(
        "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
        blank[0], blank[1], blank[2], blank[3], blank[4], "out-of-place", "", "", "", "in-place", "", "", "", "", ""
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

/// Times one size out of place and in place, checks both results, and counts the
/// bytes sent: the size's row, the same on every rank (every rank takes part).
fn measure<T: Element>(
    a: &BenchArgs,
    coll: Coll,
    op: ReduceOp,
    c: &Communicator,
    bufs: &mut Bufs<T>,
    bytes: usize,
    hosts_of: Option<&[Vec<usize>]>,
) -> ferroccl::Result<Row> {
    let (n, rank, root) = (c.world_size(), c.rank(), a.root);
    let count = bytes / std::mem::size_of::<T>();
    bufs.prepare(coll, op, n, rank, count);
    let iters = warm_up(c, a, || bufs.out_of_place(c, coll, op, root, count))?;
    c.barrier()?;
    let (oop, wire, by_host) = timed(c, a, iters, || bufs.out_of_place(c, coll, op, root, count))?;
    let oop_wrong = if a.check != 0 {
        count_wrong(coll, &bufs.recv, op, n, rank, root, count)
    } else {
        0
    };

    // In place: the buffer is reduced again each iteration; it is refilled and
    // run once more for the check.
    bufs.reset_in_place(coll, n, rank, count);
    let ip_iters = warm_up(c, a, || bufs.in_place(c, coll, op, root, count))?;
    c.barrier()?;
    let (ip, _, _) = timed(c, a, ip_iters, || bufs.in_place(c, coll, op, root, count))?;
    let ip_wrong = if a.check != 0 {
        bufs.reset_in_place(coll, n, rank, count);
        bufs.in_place(c, coll, op, root, count)?;
        let res = bufs.in_place_result(coll, n, rank, count);
        count_wrong(coll, &res, op, n, rank, root, count)
    } else {
        0
    };

    let wire_bytes = max_over_ranks(c, wire.payload_sent as f64 / iters as f64)?;
    let header_bytes = max_over_ranks(c, wire.header_sent as f64 / iters as f64)?;
    // Every rank has the same layout, so every rank takes part or none does.
    let hosts = match (hosts_of, by_host) {
        (Some(hosts), Some((within, between))) => {
            let within = max_over_ranks(c, within as f64 / iters as f64)?;
            let mut per = vec![0.0f64; n];
            per[rank] = between as f64 / iters as f64;
            c.all_reduce(&mut per, ReduceOp::Sum)?;
            let busiest = hosts
                .iter()
                .map(|h| h.iter().map(|&r| per[r]).sum::<f64>())
                .fold(0.0, f64::max);
            Some((within, busiest))
        }
        _ => None,
    };
    let mut w = [oop_wrong as f64, ip_wrong as f64];
    c.all_reduce(&mut w, ReduceOp::Sum)?;
    Ok(Row {
        bytes,
        count,
        oop_us: oop * 1e6,
        oop_wrong: w[0] as u64,
        ip_us: ip * 1e6,
        ip_wrong: w[1] as u64,
        wire_bytes,
        header_bytes,
        hosts,
    })
}

/// Rank 0's line of the table for one size.
fn print_row(a: &BenchArgs, coll: Coll, c: &Communicator, row: &Row, f: &Fixed<'_>) {
    let bytes = row.bytes;
    let wire_col = wire_col(coll, c, row);
    let algo = algo_col(coll, c, bytes);
    let gb = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
    let wrong_col = |w: u64| {
        if a.check != 0 {
            w.to_string()
        } else {
            "N/A".into()
        }
    };
    println!(
        "{:>12} {:>12} {:>8} {:>6} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6} {:>7} {:>5}",
        bytes,
        row.count,
        f.dtype.name(),
        f.op,
        f.root,
        row.oop_us,
        gb(row.oop_us),
        gb(row.oop_us) * f.factor,
        wrong_col(row.oop_wrong),
        row.ip_us,
        gb(row.ip_us),
        gb(row.ip_us) * f.factor,
        wrong_col(row.ip_wrong),
        wire_col,
        algo
    );
}

/// The `wire` column: the payload bytes the busiest rank sent over the law of the
/// algorithm that ran, `mem` where the ranks read each other's memory, `-` where the
/// law is 0 bytes.
fn wire_col(coll: Coll, c: &Communicator, row: &Row) -> String {
    let (n, bytes) = (c.world_size(), row.bytes);
    let law = match hier_shape(c, coll, bytes) {
        // Per rank: 2(k-1)/k·S within its host and 2(H-1)/H·S/k to the others
        // (all-reduce); half of each for reduce-scatter and all-gather.
        Some((h, k)) => {
            let (h, k) = (h as f64, k as f64);
            let half = if coll == Coll::AllReduce { 1.0 } else { 0.5 };
            half * (2.0 * (k - 1.0) / k + 2.0 * (h - 1.0) / (h * k)) * bytes as f64
        }
        None => coll.wire_law(n, bytes),
    };
    let on_memory = coll == Coll::AllReduce
        && matches!(
            c.all_reduce_algorithm(bytes),
            ferroccl::Algorithm::OneShot | ferroccl::Algorithm::TwoShot
        );
    if on_memory {
        // Read from the peers' memory: nothing crosses a link.
        "mem".into()
    } else if law > 0.0 {
        format!("{:.3}", row.wire_bytes / law)
    } else {
        "-".into()
    }
}

/// The `algo` column: the algorithm that ran at `bytes`.
fn algo_col(coll: Coll, c: &Communicator, bytes: usize) -> &'static str {
    match coll {
        Coll::AllReduce => match c.all_reduce_algorithm(bytes) {
            ferroccl::Algorithm::Ring => "ring",
            ferroccl::Algorithm::Rabenseifner => "rab",
            ferroccl::Algorithm::Tree => "tree",
            ferroccl::Algorithm::Hierarchical => "hier",
            ferroccl::Algorithm::OneShot => "1shot",
            ferroccl::Algorithm::TwoShot => "2shot",
            _ => "rd",
        },
        Coll::ReduceScatter | Coll::AllGather => match c.reduce_scatter_algorithm() {
            ferroccl::Algorithm::Hierarchical => "hier",
            _ => "ring",
        },
        Coll::AllToAll => "pair",
        Coll::Gather | Coll::Scatter => "star",
        Coll::SendRecv => "p2p",
        _ if c.rooted_algorithm() == ferroccl::Algorithm::Tree => "tree",
        _ => "chain",
    }
}

/// After the table: the memory law (every rank measures), then on rank 0 the summary,
/// the bytes per link class, the ring law and the JSON file.
fn finish(
    a: &BenchArgs,
    coll: Coll,
    c: &Communicator,
    rows: &[Row],
    total_wrong: u64,
    hosts_of: Option<&[Vec<usize>]>,
    f: &Fixed<'_>,
) -> ferroccl::Result<()> {
    let n = c.world_size();
    let printer = c.rank() == 0;
    // Every rank measures the memory at once (the law's rates are what the ranks get
    // while they all copy); rank 0 prints.
    let mem_rates = if a.law == Some(LawArg::Mem) {
        Some(mem_rates(c, rows)?)
    } else {
        None
    };
    if let (true, Some(rates)) = (printer, &mem_rates) {
        print_mem_law(c, rows, rates);
    }
    if printer {
        let avg_busbw = rows
            .iter()
            .map(|r| r.bytes as f64 / (r.ip_us * 1e-6) / 1e9 * f.factor)
            .sum::<f64>()
            / rows.len().max(1) as f64;
        println!(
            "# Out of bounds values : {} {}",
            total_wrong,
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {avg_busbw:.4} ");
        println!("#");
        if let Some(hosts) = hosts_of {
            print_host_laws(rows, hosts, coll != Coll::AllReduce, |b| {
                hier_shape(c, coll, b).is_some()
            });
        }
        // The hierarchical all-reduce is held to its own law, on each host's link.
        let largest = rows.last().map_or(0, |r| r.bytes);
        let law = match (a.law_rate(), coll.ring_law(n), hier_shape(c, coll, largest)) {
            (Some(rate), Some(_), Some((h, k))) if coll == Coll::AllReduce => {
                Some(print_law(rows, RingLaw::hierarchical(h, k), rate, n, true))
            }
            (Some(rate), Some(_), Some((h, k))) => Some(print_law(
                rows,
                RingLaw::hierarchical_half(h, k),
                rate,
                n,
                true,
            )),
            (Some(rate), Some(law), _) => Some(print_law(rows, law, rate, n, false)),
            _ => None,
        };
        if let Some(path) = &a.json {
            let meta = JsonMeta {
                coll,
                n,
                tname: f.tname,
                dt: f.dtype,
                op: f.op,
                root: f.root,
                factor: f.factor,
                law,
            };
            write_json(path, &meta, rows)?;
        }
    }
    Ok(())
}
