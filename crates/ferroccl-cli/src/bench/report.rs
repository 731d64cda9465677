//! What follows the table: the bytes per link class, the memory and ring laws with
//! their fits, and the JSON file.

use super::{Coll, Row};
use crate::law::{host_law, Fit, HostLaw, RingLaw};
use ferroccl::{Communicator, DataType, ReduceOp};
use std::fmt::Write as _;
use std::time::Instant;

pub(super) struct JsonMeta<'a> {
    pub(super) coll: Coll,
    pub(super) n: usize,
    pub(super) tname: &'a str,
    pub(super) dt: DataType,
    pub(super) op: &'a str,
    pub(super) root: i64,
    pub(super) factor: f64,
    pub(super) law: Option<LawReport>,
}

/// What `--law` found: the law, the link rate it was given, and the fit (if any).
pub(super) struct LawReport {
    law: RingLaw,
    rate: f64,
    fit: Option<Fit>,
    /// Bytes per second this rank's CPU combines (f32 sum): the model's third number,
    /// written next to the fit for `FERROCCL_COST_MODEL=@FILE`.
    reduce: f64,
}

impl LawReport {
    /// α used for predictions: the fitted one, 0 when there is no fit.
    fn alpha(&self) -> f64 {
        self.fit.map_or(0.0, |f| f.alpha_s)
    }

    /// Predicted seconds for `bytes`: steps × α (fitted) + factor × S / RATE.
    fn predict_s(&self, bytes: usize) -> f64 {
        self.law
            .predict_s(bytes as f64, self.alpha(), 1.0 / self.rate)
    }
}

/// `(hosts, ranks per host)` when `coll` of `bytes` runs hierarchical.
pub(super) fn hier_shape(c: &Communicator, coll: Coll, bytes: usize) -> Option<(usize, usize)> {
    let algo = match coll {
        Coll::AllReduce => c.all_reduce_algorithm(bytes),
        Coll::ReduceScatter | Coll::AllGather => c.reduce_scatter_algorithm(),
        _ => return None,
    };
    (algo == ferroccl::Algorithm::Hierarchical)
        .then(|| c.host_layout().and_then(|l| l.shape()))
        .flatten()
}

/// Prints the bytes per link class (lines starting `hosts`): within a host per rank,
/// between hosts per host, each against the law of the algorithm that ran
/// (`hier(bytes)`: the hierarchical one, else the ring's).
pub(super) fn print_host_laws(
    rows: &[Row],
    hosts: &[Vec<usize>],
    half: bool,
    hier: impl Fn(usize) -> bool,
) {
    println!(
        "# bytes per link class: within a host (busiest rank) and between hosts (busiest host, its ranks summed), per operation"
    );
    println!(
        "#{:>5} {:>11} {:>5} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7}",
        "", "size", "algo", "within", "law", "wire", "between", "law", "wire"
    );
    println!(
        "#{:>5} {:>11} {:>5} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7}",
        "", "(B)", "", "(B/rank)", "(B/rank)", "(x law)", "(B/host)", "(B/host)", "(x law)"
    );
    for r in rows {
        let Some((within, between)) = r.hosts else {
            continue;
        };
        let h = hier(r.bytes);
        let Some(HostLaw {
            within: lw,
            between: lb,
        }) = host_law(h, hosts)
        else {
            continue;
        };
        // Reduce-scatter and all-gather move half an all-reduce's bytes on every link.
        let s = r.bytes as f64 * if half { 0.5 } else { 1.0 };
        let x = |got: f64, law: f64| {
            if law > 0.0 {
                format!("{:.3}", got / law)
            } else {
                "-".into()
            }
        };
        println!(
            "hosts {:>11} {:>5} {:>12.0} {:>12.0} {:>7} {:>12.0} {:>12.0} {:>7}",
            r.bytes,
            if h { "hier" } else { "ring" },
            within,
            lw * s,
            x(within, lw * s),
            between,
            lb * s,
            x(between, lb * s)
        );
    }
    println!("#");
}

/// This host's copy and reduce rates (bytes per second) at each row's size: every rank
/// times a `memcpy` and an f32 `y += x` over buffers of that size at once (after a
/// barrier), the median of several runs, and the slowest rank's time counts.
pub(super) fn mem_rates(c: &Communicator, rows: &[Row]) -> ferroccl::Result<Vec<(f64, f64)>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let len = (r.bytes / 4).max(1);
        // Both page-aligned: glibc's `rep movsb` copy runs many times slower when the
        // destination sits a few bytes past the source modulo a page (see the
        // library's `sys/mem.rs`), which would measure the allocator, not the memory.
        let (sbuf, mut dbuf) = (vec![1.0f32; len + 1024], vec![0.0f32; len + 1024]);
        let page = |v: &[f32]| (4096 - (v.as_ptr() as usize % 4096)) % 4096 / 4;
        let (so, d_o) = (page(&sbuf), page(&dbuf));
        let src = &sbuf[so..so + len];
        let dst = &mut dbuf[d_o..d_o + len];
        // Enough repetitions to time a few ms, at least 5.
        let reps = (((8usize << 20) / (len * 4)).clamp(5, 2000)) | 1;
        let mut time = |f: &mut dyn FnMut(&mut [f32])| -> ferroccl::Result<f64> {
            f(dst);
            c.barrier()?;
            let mut ts: Vec<f64> = (0..reps)
                .map(|_| {
                    let t0 = Instant::now();
                    f(dst);
                    t0.elapsed().as_secs_f64()
                })
                .collect();
            ts.sort_by(f64::total_cmp);
            let mut t = [ts[reps / 2]];
            c.all_reduce(&mut t, ReduceOp::Max)?;
            Ok(t[0])
        };
        let copy = time(&mut |d| d.copy_from_slice(std::hint::black_box(src)))?;
        let reduce = time(&mut |d| {
            ferroccl::reduce::reduce_into(d, std::hint::black_box(src), ReduceOp::Sum)
        })?;
        let b = (len * 4) as f64;
        out.push((b / copy, b / reduce));
    }
    Ok(out)
}

/// Prints the memory-bandwidth law's table (lines starting `mem`): per size the bytes
/// the algorithm that ran copies and reduces, the rates measured, the predicted time
/// and measured (in-place) over predicted.
pub(super) fn print_mem_law(c: &Communicator, rows: &[Row], rates: &[(f64, f64)]) {
    use crate::law::MemLaw;
    let n = c.world_size();
    println!(
        "# memory law, n = {n}: t = copy·S/C + reduce·S/R, C and R this host's memcpy and f32 y += x rates at that size, every rank at once (slowest rank, median); meas = in-place time"
    );
    println!(
        "#{:>3} {:>11} {:>6} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10} {:>9}",
        "", "size", "algo", "copied", "reduced", "C", "R", "meas", "pred", "meas/pred"
    );
    println!(
        "#{:>3} {:>11} {:>6} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10} {:>9}",
        "", "(B)", "", "(B/rank)", "(B/rank)", "(GB/s)", "(GB/s)", "(us)", "(us)", ""
    );
    for (r, &(cr, rr)) in rows.iter().zip(rates) {
        let (name, law) = match c.all_reduce_algorithm(r.bytes) {
            ferroccl::Algorithm::OneShot => ("1shot", Some(MemLaw::one_shot(n))),
            ferroccl::Algorithm::TwoShot => ("2shot", Some(MemLaw::two_shot(n))),
            _ => ("other", None),
        };
        let s = r.bytes as f64;
        let pred = law.and_then(|l| l.predict_s(s, cr, rr));
        let (copied, reduced) = law.map_or(("-".into(), "-".into()), |l| {
            (format!("{:.0}", l.copy * s), format!("{:.0}", l.reduce * s))
        });
        println!(
            "mem {:>11} {:>6} {:>12} {:>12} {:>8.2} {:>8.2} {:>10.2} {:>10} {:>9}",
            r.bytes,
            name,
            copied,
            reduced,
            cr * 1e-9,
            rr * 1e-9,
            r.ip_us,
            pred.map_or("-".into(), |p| format!("{:.2}", p * 1e6)),
            pred.map_or("-".into(), |p| format!("{:.3}", r.ip_us / (p * 1e6)))
        );
    }
    if rows.iter().any(|r| {
        !matches!(
            c.all_reduce_algorithm(r.bytes),
            ferroccl::Algorithm::OneShot | ferroccl::Algorithm::TwoShot
        )
    }) {
        println!("# the memory law counts one-shot and two-shot, which run on symmetric memory (every rank on this host over shm or auto, FERROCCL_SHM_SYMMETRIC not off); other rows say '-'");
    }
    println!("#");
}

/// Prints the ring-law table (lines starting `law`) and the α-β fit, from the rows'
/// in-place times. `per_host`: the law counts the bytes each host sends to the
/// others (the hierarchical all-reduce), not each rank's.
pub(super) fn print_law(
    rows: &[Row],
    law: RingLaw,
    rate: f64,
    n: usize,
    per_host: bool,
) -> LawReport {
    let points: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.bytes as f64, r.ip_us * 1e-6))
        .collect();
    let rep = LawReport {
        law,
        rate,
        fit: crate::law::fit(&law, &points),
        reduce: ferroccl::reduce::measured_rate(4 << 20),
    };
    let (steps, fac) = (law.steps, law.factor);
    let (name, unit) = if per_host {
        ("hierarchical law, per host's link", "(B/host)")
    } else {
        ("ring law", "(B/rank)")
    };
    println!(
        "# {name}, n = {n}: t = {steps}·α + {fac:.4}·S/R with R = {:.4} Gbit/s and α the fitted α below{}; meas = in-place time",
        rate * 8e-9,
        if rep.fit.is_none() { " (no fit: α = 0)" } else { "" }
    );
    println!(
        "#{:>3} {:>11} {:>12} {:>12} {:>7} {:>12} {:>12} {:>9}",
        "", "size", "payload", "law", "wire", "meas", "pred", "meas/pred"
    );
    println!(
        "#{:>3} {:>11} {:>12} {:>12} {:>7} {:>12} {:>12} {:>9}",
        "", "(B)", unit, unit, "(x law)", "(us)", "(us)", ""
    );
    for r in rows {
        let lb = law.bytes_per_rank(r.bytes as f64);
        let pred_us = rep.predict_s(r.bytes) * 1e6;
        let payload = match r.hosts {
            Some((_, between)) if per_host => between,
            _ => r.wire_bytes,
        };
        println!(
            "law {:>11} {:>12.0} {:>12.0} {:>7} {:>12.2} {:>12.2} {:>9.3}",
            r.bytes,
            payload,
            lb,
            if lb > 0.0 {
                format!("{:.3}", payload / lb)
            } else {
                "-".into()
            },
            r.ip_us,
            pred_us,
            r.ip_us / pred_us
        );
    }
    match rep.fit {
        Some(f) => println!(
            "# fit over {} sizes (least squares, α >= 0): alpha = {:.2} us, beta = {:.4} ns/B, 1/beta = {:.4} Gbit/s = {:.4} of RATE",
            rows.len(),
            f.alpha_s * 1e6,
            f.beta_s_per_byte * 1e9,
            f.link_bytes_per_s() * 8e-9,
            f.link_bytes_per_s() / rate
        ),
        None => println!(
            "# fit: not possible over these {} size(s) (needs two sizes and times that grow with size)",
            rows.len()
        ),
    }
    println!(
        "# reduce (this CPU, f32 sum): {:.3} GB/s; with --json FILE, FERROCCL_COST_MODEL=@FILE chooses all-reduces by this fit",
        rep.reduce * 1e-9
    );
    println!("#");
    rep
}

pub(super) fn write_json(
    path: &std::path::Path,
    m: &JsonMeta<'_>,
    rows: &[Row],
) -> ferroccl::Result<()> {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"{}\",\n  \"ranks\": {},\n  \"transport\": \"{}\",\n  \"dtype\": \"{}\",\n  \"op\": \"{}\",\n  \"root\": {},\n  \"bus_factor\": {},\n",
        m.coll.name(),
        m.n,
        m.tname,
        m.dt.name(),
        m.op,
        m.root,
        m.factor
    );
    if let Some(l) = &m.law {
        let _ = writeln!(
            s,
            "  \"law\": {{\"rate_bytes_per_s\": {}, \"steps\": {}, \"factor\": {}, \"meas\": \"ip_time_us\"}},",
            l.rate, l.law.steps, l.law.factor
        );
        match l.fit {
            Some(f) => {
                let _ = writeln!(
                    s,
                    "  \"fit\": {{\"alpha_s\": {:e}, \"beta_s_per_byte\": {:e}, \"link_bytes_per_s\": {}, \"rate_bytes_per_s\": {}, \"reduce_bytes_per_s\": {}}},",
                    f.alpha_s,
                    f.beta_s_per_byte,
                    f.link_bytes_per_s(),
                    l.rate,
                    l.reduce
                );
            }
            None => s.push_str("  \"fit\": null,\n"),
        }
    }
    s.push_str("  \"rows\": [\n");
    for (i, r) in rows.iter().enumerate() {
        let gb = |us: f64| r.bytes as f64 / (us * 1e-6) / 1e9;
        if let Some(l) = &m.law {
            let pred_us = l.predict_s(r.bytes) * 1e6;
            let _ = write!(
                s,
                "    {{\"pred_time_us\": {:.3}, \"meas_over_pred\": {:.6}, ",
                pred_us,
                r.ip_us / pred_us
            );
        } else {
            s.push_str("    {");
        }
        let _ = writeln!(
            s,
            "\"bytes\": {}, \"count\": {}, \"oop_time_us\": {:.3}, \"oop_algbw_gbs\": {:.6}, \"oop_busbw_gbs\": {:.6}, \"oop_wrong\": {}, \"ip_time_us\": {:.3}, \"ip_algbw_gbs\": {:.6}, \"ip_busbw_gbs\": {:.6}, \"ip_wrong\": {}, \"payload_bytes_sent_per_rank\": {:.1}, \"header_bytes_sent_per_rank\": {:.1}, \"wire_law_bytes\": {:.1}}}{}",
            r.bytes,
            r.count,
            r.oop_us,
            gb(r.oop_us),
            gb(r.oop_us) * m.factor,
            r.oop_wrong,
            r.ip_us,
            gb(r.ip_us),
            gb(r.ip_us) * m.factor,
            r.ip_wrong,
            r.wire_bytes,
            r.header_bytes,
            m.coll.wire_law(m.n, r.bytes),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("  ]\n}\n");
    std::fs::write(path, s)
        .map_err(|e| ferroccl::Error::io(format!("writing {}", path.display()), e))
}
