//! Numbers with units as people type them, and link figures from a benchmark's JSON.

use super::model::{ring_factor, Link};
use ferroccl::{Error, Result};
use serde::Deserialize;

fn bad(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Splits `s` into its leading number and the rest.
fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .char_indices()
        .find(|&(k, c)| {
            !(c.is_ascii_digit()
                || c == '.'
                || c == '_'
                || ((c == 'e' || c == 'E')
                    && s[k + 1..]
                        .starts_with(|d: char| d.is_ascii_digit() || d == '-' || d == '+'))
                || ((c == '-' || c == '+')
                    && (k == 0 || s[..k].ends_with('e') || s[..k].ends_with('E'))))
        })
        .map_or(s.len(), |(k, _)| k);
    (&s[..end], s[end..].trim())
}

fn parse_number(flag: &str, text: &str, num: &str) -> Result<f64> {
    num.replace('_', "")
        .parse::<f64>()
        .map_err(|_| bad(format!("{flag} {text:?}: {num:?} is not a number")))
}

/// Parses a link bandwidth with an explicit unit into bytes/s.
///
/// Decimal prefixes k, M, G, T (×10³ …); bits as `bit`, `b`, `bps` (`10Gbit`,
/// `10Gbit/s`, `10Gbps`, `10Gb/s`), bytes as `B` (`1.25GB`, `1.25GB/s`, `1.25GBps`).
/// A bare number is refused: bits or bytes must be said.
pub fn parse_bandwidth(text: &str) -> Result<f64> {
    parse_rate("--link", text)
}

/// [`parse_bandwidth`] for any flag: `flag` names the input in errors. tc's spellings
/// (`500mbit`, `2.5gbit`) are accepted too: a lower-case `m` is mega, as in tc.
pub fn parse_rate(flag: &str, text: &str) -> Result<f64> {
    let t = text.trim();
    let (num, unit) = split_number(t);
    let v = parse_number(flag, text, num)?;
    let unit_help = "give a unit: 10Gbit, 10Gbit/s, 10Gbps, 1.25GB or 1.25GB/s";
    if unit.is_empty() {
        return Err(bad(format!("{flag} {text:?} has no unit; {unit_help}")));
    }
    let u = unit
        .strip_suffix("/s")
        .or_else(|| unit.strip_suffix("ps"))
        .unwrap_or(unit);
    let (scale, rest) = match u.chars().next() {
        Some('k' | 'K') => (1e3, &u[1..]),
        Some('M' | 'm') => (1e6, &u[1..]),
        Some('G' | 'g') => (1e9, &u[1..]),
        Some('T' | 't') => (1e12, &u[1..]),
        _ => (1.0, u),
    };
    let per_byte = match rest {
        "B" | "byte" | "Byte" | "bytes" => 1.0,
        "b" => 0.125,
        r if r.eq_ignore_ascii_case("bit") || r.eq_ignore_ascii_case("bits") => 0.125,
        _ => {
            return Err(bad(format!(
                "{flag} {text:?}: unknown unit {unit:?}; {unit_help}"
            )))
        }
    };
    let bytes_per_s = v * scale * per_byte;
    if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
        return Err(bad(format!(
            "{flag} must be a positive bandwidth, got {text:?}"
        )));
    }
    Ok(bytes_per_s)
}

/// Parses a count such as `25.6M`, `1281167`, `1.2e6` or `64Mi` (k/K, M, G, T decimal;
/// Ki, Mi, Gi, Ti binary), rounded to the nearest integer. With `bytes`, a trailing
/// `B` is allowed (`102.4MB`). `flag` names the input in errors.
pub fn parse_count(flag: &str, text: &str, bytes: bool) -> Result<u64> {
    let t = text.trim();
    let (num, unit) = split_number(t);
    let v = parse_number(flag, text, num)?;
    let unit = if bytes {
        unit.strip_suffix('B').unwrap_or(unit)
    } else {
        unit
    };
    let scale = match unit {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(format!(
                "{flag} {text:?}: unknown suffix {unit:?} (use K, M, G, T or Ki, Mi, Gi, Ti)"
            )))
        }
    };
    let x = (v * scale).round();
    if !(x.is_finite() && x >= 0.0 && x <= u64::MAX as f64) {
        return Err(bad(format!(
            "{flag} must be a non-negative count, got {text:?}"
        )));
    }
    Ok(x as u64)
}

#[derive(Deserialize)]
struct BenchFile {
    ranks: Option<usize>,
    rows: Option<Vec<BenchRow>>,
    fit: Option<BenchFit>,
}

#[derive(Deserialize)]
struct BenchRow {
    bytes: f64,
    ip_time_us: f64,
}

#[derive(Deserialize)]
struct BenchFit {
    alpha_s: f64,
    beta_s_per_byte: f64,
}

/// The link model from the text of a `ferroccl bench --json` file (`name` is the file,
/// for messages): its `fit` object when present, otherwise a least-squares fit of the
/// rows' in-place times (see the module docs). A file that does not parse, has no rows
/// to fit, or yields β ≤ 0 is an [`Error::Config`] naming the file and the problem.
pub fn link_from_bench_json(text: &str, name: &str) -> Result<Link> {
    let err = |what: String| Error::Config(format!("bench file {name}: {what}"));
    let file: BenchFile = serde_json::from_str(text)
        .map_err(|e| err(format!("not a `ferroccl bench --json` file: {e}")))?;
    let check = |alpha: f64, beta: f64, how: &str| -> Result<()> {
        if !(beta.is_finite() && beta > 0.0) {
            return Err(err(format!(
                "{how} gives β = {beta} s/B, which is not positive: times do not grow with size"
            )));
        }
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(err(format!("{how} gives α = {alpha} s, which is negative")));
        }
        Ok(())
    };
    if let Some(f) = file.fit {
        check(f.alpha_s, f.beta_s_per_byte, "its `fit` object")?;
        return Ok(Link {
            alpha_s: f.alpha_s,
            beta_s_per_byte: f.beta_s_per_byte,
            source: format!("bench file {name} (its fit object)"),
        });
    }
    let rows = file
        .rows
        .ok_or_else(|| err("has no `rows` and no `fit` object".into()))?;
    let n = file
        .ranks
        .ok_or_else(|| err("has no `ranks`: the fit needs the bench's world size".into()))?;
    if n < 2 {
        return Err(err(format!(
            "was measured with {n} rank(s): there is no link to fit"
        )));
    }
    if rows.len() < 2 {
        return Err(err(format!(
            "has {} row(s): fitting α and β needs at least two sizes",
            rows.len()
        )));
    }
    for (k, r) in rows.iter().enumerate() {
        if !(r.bytes.is_finite()
            && r.bytes >= 0.0
            && r.ip_time_us.is_finite()
            && r.ip_time_us >= 0.0)
        {
            return Err(err(format!(
                "row {k}: bytes {} and ip_time_us {} must be non-negative numbers",
                r.bytes, r.ip_time_us
            )));
        }
    }
    let (c, m) = crate::law::fit_line(rows.iter().map(|r| (r.bytes, r.ip_time_us * 1e-6)))
        .ok_or_else(|| {
            err("all rows have the same size: fitting needs at least two sizes".into())
        })?;
    let nf = n as f64;
    let alpha = c / (2.0 * (nf - 1.0));
    let beta = m / ring_factor(nf);
    check(alpha, beta, "the least-squares fit")?;
    Ok(Link {
        alpha_s: alpha,
        beta_s_per_byte: beta,
        source: format!(
            "bench file {name}: least-squares fit of t = 2(n-1)·α + 2(n-1)/n·S·β over {} in-place rows, n = {n}",
            rows.len()
        ),
    })
}
