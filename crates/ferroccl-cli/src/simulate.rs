//! `ferroccl simulate`: the all-reduce algorithms' real plans played on a model
//! network ([`ferroccl::sim`]), for worlds of up to thousands of ranks, in seconds.
//!
//! Per world size and message size it prints each algorithm's predicted time (the
//! hierarchical one where `--ranks-per-host` makes hosts of 2 ranks or more), the one
//! with the least, how much faster than the ring that is, and what the closed-form cost
//! model (`FERROCCL_COST_MODEL`, [`ferroccl::sim::choose_by_model`]) would choose on the
//! same network, with its simulated time over the least.

use crate::args::size as parse_size;
use clap::Args;
use ferroccl::sim::{choose_all_reduce, choose_by_model, Network};
use ferroccl::{Algorithm, Error, Result};

/// Arguments of `ferroccl simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// World sizes, comma-separated (each 1 to 65,536: the simulation holds every
    /// rank's plan).
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4096", value_parser = crate::args::ranks)]
    pub ranks: Vec<usize>,
    /// Smallest message in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", value_parser = parse_size, default_value = "1K")]
    pub min_bytes: usize,
    /// Largest message in bytes.
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size, default_value = "256M")]
    pub max_bytes: usize,
    /// Factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub step_factor: usize,
    /// Latency per message between hosts, microseconds.
    #[arg(long = "alpha-us", default_value_t = 20.0)]
    pub alpha_us: f64,
    /// Port bandwidth between hosts (10Gbit, 100Gbit/s, 12.5GB/s; tc's 500mbit too).
    #[arg(long, default_value = "100Gbit")]
    pub link: String,
    /// Reduction speed of one rank (bytes combined per second).
    #[arg(long, default_value = "10GB/s")]
    pub reduce: String,
    /// Ranks per host (consecutive ranks share one, and the host's port between hosts);
    /// 1: every rank its own host. The hierarchical plan needs 2 or more.
    #[arg(long = "ranks-per-host", default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Latency within a host, microseconds [default: --alpha-us].
    #[arg(long = "intra-alpha-us")]
    pub intra_alpha_us: Option<f64>,
    /// Bandwidth within a host [default: --link].
    #[arg(long = "intra-link")]
    pub intra_link: Option<String>,
    /// Latency overlaps each frame's own transfer (it arrives max(α, L/β) after it
    /// left, not α + L/β): for links whose latency is the receiver waking up, as on
    /// loopback or tools/emulated-cluster, rather than the wire.
    #[arg(long = "alpha-overlaps")]
    pub alpha_overlaps: bool,
    /// Bytes a rank's port between hosts sends at once after idling: a token bucket of
    /// this size refilled at --link, as `tc tbf`'s burst on tools/emulated-cluster
    /// (250K there); calls then play back to back, as `bench` times them. 0: every
    /// byte at --link. One rank per host only.
    #[arg(long = "burst", value_parser = parse_size, default_value = "0")]
    pub burst: usize,
    /// Pipelining segment in bytes, as the engine's (Config::segment_bytes).
    #[arg(long = "segment-bytes", value_parser = parse_size, default_value = "512K")]
    pub segment_bytes: usize,
}

/// Entry point.
pub fn main(a: SimulateArgs) -> crate::error::Result<bool> {
    run(&a)?;
    Ok(true)
}

fn network(a: &SimulateArgs) -> Result<Network> {
    let rate = |flag: &str, text: &str| {
        crate::plan::parse_rate(flag, text).map_err(|e| Error::InvalidArgument(e.to_string()))
    };
    let us = |flag: &str, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(v * 1e-6)
        } else {
            Err(Error::InvalidArgument(format!(
                "{flag} must be a non-negative number of microseconds, got {v}"
            )))
        }
    };
    let beta = rate("--link", &a.link)?;
    let mut net = Network::flat(
        us("--alpha-us", a.alpha_us)?,
        beta,
        1.0 / rate("--reduce", &a.reduce)?,
    );
    if a.ranks_per_host == 0 {
        return Err(Error::InvalidArgument(
            "--ranks-per-host must be at least 1".into(),
        ));
    }
    net.ranks_per_host = a.ranks_per_host;
    net.alpha_overlaps = a.alpha_overlaps;
    net.burst = a.burst as f64;
    net.intra_alpha = us("--intra-alpha-us", a.intra_alpha_us.unwrap_or(a.alpha_us))?;
    net.intra_beta = match &a.intra_link {
        Some(l) => rate("--intra-link", l)?,
        None => beta,
    };
    Ok(net)
}

fn short(algo: Algorithm) -> &'static str {
    match algo {
        Algorithm::Ring => "ring",
        Algorithm::RecursiveDoubling => "rd",
        Algorithm::Rabenseifner => "rab",
        Algorithm::Tree => "tree",
        Algorithm::Hierarchical => "hier",
        _ => "?",
    }
}

/// Seconds as microseconds to the nanosecond, without trailing zeros: `20` for the
/// flag's 20, `120` where `--alpha-us 120` came back as 119.99999999999999.
fn us(seconds: f64) -> String {
    let s = format!("{:.3}", seconds * 1e6);
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn run(a: &SimulateArgs) -> Result<()> {
    let net = network(a)?;
    if a.ranks.is_empty() || a.ranks.contains(&0) {
        return Err(Error::InvalidArgument(
            "--ranks must list world sizes of at least 1".into(),
        ));
    }
    if a.min_bytes == 0 || a.min_bytes > a.max_bytes || a.step_factor < 2 {
        return Err(Error::InvalidArgument(
            "sizes: need 0 < --minbytes <= --maxbytes and --stepfactor >= 2".into(),
        ));
    }
    if a.segment_bytes < 4 {
        return Err(Error::InvalidArgument(
            "--segment-bytes must be at least 4".into(),
        ));
    }
    println!(
        "# ferroccl simulate: all_reduce of float32, alpha {} us, link {:.3} GB/s, reduce {:.3} GB/s, {} rank(s) per host (within: alpha {} us, {:.3} GB/s), segment {} B",
        us(net.alpha),
        net.beta / 1e9,
        1.0 / net.gamma / 1e9,
        net.ranks_per_host,
        us(net.intra_alpha),
        net.intra_beta / 1e9,
        a.segment_bytes
    );
    println!(
        "# the real plans of each algorithm in virtual time; times in microseconds; '-' cannot run"
    );
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>7} {:>9} {:>6} {:>10}",
        "ranks",
        "size(B)",
        "ring",
        "rd",
        "rab",
        "tree",
        "hier",
        "chosen",
        "ring/best",
        "model",
        "model/best"
    );
    for &n in &a.ranks {
        let mut size = a.min_bytes;
        while size <= a.max_bytes {
            let count = (size / 4).max(1);
            let (best, times) = choose_all_reduce(n, count, 4, a.segment_bytes, &net);
            let col = |t: Option<f64>| t.map_or("-".to_owned(), |t| format!("{:.1}", t * 1e6));
            let of = |algo: Algorithm| times.iter().find(|(x, _)| *x == algo).and_then(|x| x.1);
            let ring = of(Algorithm::Ring);
            let over = |t: Option<f64>| match (t, of(best)) {
                (Some(r), Some(b)) if b > 0.0 => format!("{:.2}", r / b),
                _ => "-".into(),
            };
            let model = choose_by_model(n, count, 4, a.segment_bytes, &net);
            println!(
                "{:>6} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>7} {:>9} {:>6} {:>10}",
                n,
                count * 4,
                col(ring),
                col(of(Algorithm::RecursiveDoubling)),
                col(of(Algorithm::Rabenseifner)),
                col(of(Algorithm::Tree)),
                col(of(Algorithm::Hierarchical)),
                short(best),
                over(ring),
                short(model),
                over(of(model))
            );
            size = size.saturating_mul(a.step_factor);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::us;

    #[test]
    fn microseconds_print_without_float_noise() {
        assert_eq!(us(20e-6), "20");
        assert_eq!(us(119.99999999999999e-6), "120");
        assert_eq!(us(0.5e-6), "0.5");
        assert_eq!(us(100e-6), "100");
        assert_eq!(us(0.0), "0");
    }
}
