//! The ring law and its α-β fit: pure arithmetic, no I/O.
//!
//! A ring collective over n ranks takes `steps` steps and sends, from every rank,
//! `factor × S` payload bytes for a buffer of S bytes: all-reduce 2(n−1) steps and
//! 2(n−1)/n × S (reduce-scatter, then all-gather), reduce-scatter and all-gather n−1
//! steps and (n−1)/n × S (S the full, gathered size). On links of per-step latency α and
//! per-byte time β its time is
//!
//! t = steps × α + factor × S × β,
//!
//! and on a link of rate R bytes/s, β = 1/R. [`fit`] finds α and β from measured
//! times by least squares over the sizes (the line t = c + m × S, α = c / steps,
//! β = m / factor); `ferroccl bench --law` prints it and `ferroccl plan` reads it back.
//!
//! ```text
//! use crate::law::{fit, RingLaw};
//!
//! let law = RingLaw::all_reduce(4);
//! let (alpha, beta) = (20e-6, 8e-9);
//! let points: Vec<(f64, f64)> = [1e6, 4e6, 16e6]
//!     .iter()
//!     .map(|&s| (s, law.predict_s(s, alpha, beta)))
//!     .collect();
//! let f = fit(&law, &points).unwrap();
//! assert!((f.alpha_s - alpha).abs() < 1e-12 && (f.beta_s_per_byte - beta).abs() < 1e-18);
//! ```

/// Steps and bytes of one ring collective over a fixed number of ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingLaw {
    /// Sequential send-receive steps: 2(n−1) for all-reduce, n−1 for the halves.
    pub steps: f64,
    /// Payload bytes each rank sends per byte of buffer: 2(n−1)/n or (n−1)/n.
    pub factor: f64,
}

impl RingLaw {
    /// The ring all-reduce: 2(n−1) steps, 2(n−1)/n × S bytes per rank (nothing for n ≤ 1).
    pub fn all_reduce(n: usize) -> Self {
        let m = n.saturating_sub(1) as f64;
        RingLaw {
            steps: 2.0 * m,
            factor: if n == 0 { 0.0 } else { 2.0 * m / n as f64 },
        }
    }

    /// The ring reduce-scatter or all-gather: n−1 steps, (n−1)/n × S bytes per rank
    /// (S the full buffer).
    pub fn half(n: usize) -> Self {
        let m = n.saturating_sub(1) as f64;
        RingLaw {
            steps: m,
            factor: if n == 0 { 0.0 } else { m / n as f64 },
        }
    }

    /// The hierarchical all-reduce over `h` hosts of `k` ranks, as a host's link to the
    /// others sees it: 2(k−1) local and 2(H−1) host-ring steps, and 2(H−1)/H × S
    /// bytes from each host to the others.
    pub fn hierarchical(h: usize, k: usize) -> Self {
        let (hm, km) = (h.saturating_sub(1) as f64, k.saturating_sub(1) as f64);
        RingLaw {
            steps: 2.0 * (km + hm),
            factor: if h == 0 { 0.0 } else { 2.0 * hm / h as f64 },
        }
    }

    /// The hierarchical reduce-scatter or all-gather over `h` hosts of `k` ranks, as a
    /// host's link to the others sees it: `h` local rings of k−1 steps and H−1
    /// host-ring steps, and (H−1)/H × S bytes from each host to the others.
    pub fn hierarchical_half(h: usize, k: usize) -> Self {
        let (hm, km) = (h.saturating_sub(1) as f64, k.saturating_sub(1) as f64);
        RingLaw {
            steps: h as f64 * km + hm,
            factor: if h == 0 { 0.0 } else { hm / h as f64 },
        }
    }

    /// Payload bytes each rank sends for a buffer of `bytes`.
    pub fn bytes_per_rank(&self, bytes: f64) -> f64 {
        self.factor * bytes
    }

    /// Predicted seconds: steps × α + factor × S × β.
    pub fn predict_s(&self, bytes: f64, alpha_s: f64, beta_s_per_byte: f64) -> f64 {
        self.steps * alpha_s + self.factor * bytes * beta_s_per_byte
    }
}

/// An all-reduce's bytes per link class on a job of several hosts, per byte of
/// buffer: what the busiest rank sends within its host, and what the busiest host
/// sends to other hosts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostLaw {
    /// Within a host, per rank.
    pub within: f64,
    /// Between hosts, per host (the sum over its ranks).
    pub between: f64,
}

/// The [`HostLaw`] of the ring (in rank order: a rank sends all its 2(n−1)/n × S to
/// its right neighbour, on its host or not) or of the hierarchical all-reduce
/// (2(k−1)/k × S within, 2(H−1)/H × S between) over `hosts` (each host's ranks);
/// `None` for the others.
pub fn host_law(hierarchical: bool, hosts: &[Vec<usize>]) -> Option<HostLaw> {
    let n: usize = hosts.iter().map(Vec::len).sum();
    if n < 2 {
        return None;
    }
    if hierarchical {
        let (h, k) = (hosts.len() as f64, hosts[0].len() as f64);
        return Some(HostLaw {
            within: 2.0 * (k - 1.0) / k,
            between: 2.0 * (h - 1.0) / h,
        });
    }
    let ring = 2.0 * (n as f64 - 1.0) / n as f64;
    let local = |r: usize| {
        hosts
            .iter()
            .any(|h| h.contains(&r) && h.contains(&((r + 1) % n)))
    };
    let within = if (0..n).any(local) { ring } else { 0.0 };
    let between = hosts
        .iter()
        .map(|h| h.iter().filter(|&&r| !local(r)).count() as f64 * ring)
        .fold(0.0, f64::max);
    Some(HostLaw { within, between })
}

/// α and β fitted to measured times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// Per-step latency in seconds (never negative: see [`fit_line`]).
    pub alpha_s: f64,
    /// Per-byte time in seconds; 1/β is the effective link bandwidth in bytes/s.
    pub beta_s_per_byte: f64,
}

impl Fit {
    /// The effective link bandwidth 1/β in bytes/s.
    pub fn link_bytes_per_s(&self) -> f64 {
        1.0 / self.beta_s_per_byte
    }
}

/// Least-squares fit of `law` to `(bytes, seconds)` points. `None` when it cannot be
/// done: fewer than two distinct sizes, a law with no steps or bytes (one rank), a
/// non-finite point, or times that do not grow with size (β ≤ 0).
pub fn fit(law: &RingLaw, points: &[(f64, f64)]) -> Option<Fit> {
    if law.steps <= 0.0 || law.factor <= 0.0 || points.len() < 2 {
        return None;
    }
    if points
        .iter()
        .any(|&(x, y)| !(x.is_finite() && y.is_finite()))
    {
        return None;
    }
    let (c, m) = fit_line(points.iter().copied())?;
    let f = Fit {
        alpha_s: c / law.steps,
        beta_s_per_byte: m / law.factor,
    };
    (f.beta_s_per_byte.is_finite() && f.beta_s_per_byte > 0.0).then_some(f)
}

/// Least-squares line y = c + m·x with c ≥ 0 (when the free fit's intercept is
/// negative, the constrained optimum is the line through the origin). `None` when
/// every x is the same.
pub fn fit_line(points: impl Iterator<Item = (f64, f64)> + Clone) -> Option<(f64, f64)> {
    let k = points.clone().count() as f64;
    let (sx, sy) = points
        .clone()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / k, sy / k);
    let (sxx, sxy) = points.clone().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (x - mx), b + (x - mx) * (y - my))
    });
    if sxx <= 0.0 || sxx.is_nan() {
        return None;
    }
    let m = sxy / sxx;
    let c = my - m * mx;
    if c >= 0.0 {
        return Some((c, m));
    }
    let (xx, xy) = points.fold((0.0, 0.0), |(a, b), (x, y)| (a + x * x, b + x * y));
    Some((0.0, xy / xx))
}

/// The memory-bandwidth law of an all-reduce on one host's symmetric memory (the ring
/// law's twin): the bytes of buffer the busiest rank copies and reduces per byte of an
/// in-place all-reduce of `S` bytes, timed at this host's copy rate `C` and reduce rate
/// `R` (bytes of destination per second of `memcpy` and of `y op= x`):
///
/// t = copy × S / C + reduce × S / R.
///
/// - **two-shot**, `n` ranks: the chunks the others read into the workspace
///   `(n-1)/n·S`, its own chunk reduced in place with the other `n-1` (`(n-1)/n·S` of
///   reductions), that chunk into the workspace `S/n`, the other chunks copied out
///   `(n-1)/n·S`: copy `(2n-1)/n`, reduce `(n-1)/n` (at `n = 2`: 1.5 and 0.5).
/// - **one-shot**: the whole buffer into the workspace `S`, then on every rank but 0
///   the first operand copied into the output `S` and `n-1` reductions of `S`: copy 2,
///   reduce `n-1`.
///
/// No synchronisation term: at the sizes it is meant for (64 KiB and up) it is small
/// next to the copies, and `meas/pred` shows what it costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemLaw {
    /// Bytes copied per byte of buffer.
    pub copy: f64,
    /// Bytes reduced (destination bytes of `y op= x`) per byte of buffer.
    pub reduce: f64,
}

impl MemLaw {
    /// Two-shot over `n` ranks (nothing moves for `n <= 1`).
    pub fn two_shot(n: usize) -> Self {
        if n <= 1 {
            return MemLaw {
                copy: 0.0,
                reduce: 0.0,
            };
        }
        let k = n as f64;
        MemLaw {
            copy: (2.0 * k - 1.0) / k,
            reduce: (k - 1.0) / k,
        }
    }

    /// One-shot over `n` ranks.
    pub fn one_shot(n: usize) -> Self {
        if n <= 1 {
            return MemLaw {
                copy: 0.0,
                reduce: 0.0,
            };
        }
        MemLaw {
            copy: 2.0,
            reduce: (n - 1) as f64,
        }
    }

    /// Predicted seconds for `bytes` at copy rate `copy_bps` and reduce rate
    /// `reduce_bps` (bytes per second); `None` unless both rates are positive and
    /// finite.
    pub fn predict_s(&self, bytes: f64, copy_bps: f64, reduce_bps: f64) -> Option<f64> {
        let ok = |r: f64| r.is_finite() && r > 0.0;
        (ok(copy_bps) && ok(reduce_bps))
            .then(|| self.copy * bytes / copy_bps + self.reduce * bytes / reduce_bps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_law_counts_the_copies_and_reductions() {
        // n = 2, two-shot: 1.5·S copied and 0.5·S reduced (the issue's count).
        let l = MemLaw::two_shot(2);
        assert_eq!((l.copy, l.reduce), (1.5, 0.5));
        // 64 MiB at 13.9 GB/s copy and 18.8 GB/s reduce: about 9 ms.
        let t = l.predict_s(64.0 * 1048576.0, 13.9e9, 18.8e9).unwrap();
        assert!((t - 0.009_025).abs() < 1e-4, "{t}");
        // Two-shot's copies tend to 2·S and its reductions to S as n grows; one-shot's
        // reductions grow with n, so past 2 ranks it reads more than two-shot.
        for n in 2..64 {
            let (a, b) = (MemLaw::two_shot(n), MemLaw::two_shot(n + 1));
            assert!(a.copy < b.copy && b.copy < 2.0 && a.reduce < b.reduce && b.reduce < 1.0);
            let o = MemLaw::one_shot(n);
            assert_eq!(o.copy, 2.0);
            assert!(o.reduce >= a.reduce);
        }
        assert_eq!(MemLaw::one_shot(1).predict_s(1e6, 1e9, 1e9), Some(0.0));
        // Rates that are not measured give no prediction, never a division by zero.
        assert_eq!(l.predict_s(1e6, 0.0, 1e9), None);
        assert_eq!(l.predict_s(1e6, 1e9, f64::NAN), None);
    }

    #[test]
    fn host_laws_of_the_ring_and_the_hierarchical_all_reduce() {
        // 2 hosts of 2, host-major: one rank per host crosses, with 2·3/4 of S.
        let hosts = vec![vec![0, 1], vec![2, 3]];
        let ring = host_law(false, &hosts).unwrap();
        assert_eq!((ring.within, ring.between), (1.5, 1.5));
        let hier = host_law(true, &hosts).unwrap();
        assert_eq!((hier.within, hier.between), (1.0, 1.0));
        // Interleaved hosts: every ring step crosses, both ranks of a host send out.
        let ring = host_law(false, &[vec![0, 2], vec![1, 3]]).unwrap();
        assert_eq!((ring.within, ring.between), (0.0, 3.0));
        let l = RingLaw::hierarchical(2, 2);
        assert_eq!((l.steps, l.factor), (4.0, 1.0));
        // Reduce-scatter / all-gather on 3 hosts of 2: 3 local rings of one step and 2
        // host-ring steps; 2/3 of S leaves each host.
        let l = RingLaw::hierarchical_half(3, 2);
        assert_eq!(l.steps, 5.0);
        assert!((l.factor - 2.0 / 3.0).abs() < 1e-15);
        assert_eq!(host_law(true, &[vec![0]]), None);
    }

    fn rel(got: f64, want: f64, tol: f64) {
        assert!(
            (got - want).abs() <= tol * want.abs().max(1e-30),
            "got {got}, want {want}"
        );
    }

    #[test]
    fn laws_by_hand() {
        let a = RingLaw::all_reduce(4);
        assert_eq!((a.steps, a.factor), (6.0, 1.5));
        assert_eq!(a.bytes_per_rank(1024.0), 1536.0);
        let h = RingLaw::half(4);
        assert_eq!((h.steps, h.factor), (3.0, 0.75));
        let two = RingLaw::all_reduce(2);
        assert_eq!((two.steps, two.factor), (2.0, 1.0));
        // 1 MiB over 2 ranks at 1 Gbit/s (125e6 B/s) with α = 50 µs: 2·50 µs + 2^20/125e6 s.
        rel(
            two.predict_s(1048576.0, 50e-6, 1.0 / 125e6),
            100e-6 + 1048576.0 / 125e6,
            1e-12,
        );
        let one = RingLaw::all_reduce(1);
        assert_eq!((one.steps, one.factor), (0.0, 0.0));
        assert_eq!(one.predict_s(1e9, 1.0, 1.0), 0.0);
    }

    #[test]
    fn fit_recovers_hand_made_alpha_and_beta() {
        for (law, alpha, beta) in [
            (RingLaw::all_reduce(2), 40e-6, 8e-9),
            (RingLaw::all_reduce(4), 25e-6, 1.0 / 125e6),
            (RingLaw::all_reduce(3), 0.0, 1e-9),
            (RingLaw::half(8), 1e-4, 2e-10),
        ] {
            let pts: Vec<_> = (20..27)
                .map(|k| {
                    let s = (1u64 << k) as f64;
                    (s, law.predict_s(s, alpha, beta))
                })
                .collect();
            let f = fit(&law, &pts).expect("fits");
            assert!((f.alpha_s - alpha).abs() < 1e-9, "{f:?} vs α {alpha}");
            rel(f.beta_s_per_byte, beta, 1e-9);
            rel(f.link_bytes_per_s(), 1.0 / beta, 1e-9);
        }
    }

    #[test]
    fn fit_of_noisy_points_is_the_least_squares_line() {
        // y = 1 + 2x measured as 1+2x ± 0.5 alternately: the symmetric noise cancels.
        let pts = [(0.0, 0.5), (1.0, 3.5), (2.0, 4.5), (3.0, 7.5)];
        let (c, m) = fit_line(pts.iter().copied()).expect("line");
        // By hand: mean x 1.5, mean y 4.
        let (sxx, sxy) = (5.0, 11.0); // Σ(x−1.5)² = 5, Σ(x−1.5)(y−4) = 11
        rel(m, sxy / sxx, 1e-12);
        rel(c, 4.0 - m * 1.5, 1e-12);
    }

    #[test]
    fn negative_intercept_is_clamped_to_zero() {
        // A line with intercept −1: the fit with α ≥ 0 goes through the origin.
        let pts = [(1.0, 1.0), (2.0, 3.0), (3.0, 5.0)];
        let (c, m) = fit_line(pts.iter().copied()).expect("line");
        assert_eq!(c, 0.0);
        rel(m, (1.0 + 6.0 + 15.0) / 14.0, 1e-12);
    }

    #[test]
    fn impossible_fits_are_none() {
        let law = RingLaw::all_reduce(2);
        assert!(fit(&law, &[]).is_none());
        assert!(fit(&law, &[(1e6, 1e-3)]).is_none());
        assert!(fit(&law, &[(1e6, 1e-3), (1e6, 2e-3)]).is_none(), "one size");
        assert!(fit(&law, &[(1e6, 2e-3), (2e6, 1e-3)]).is_none(), "β < 0");
        assert!(fit(&law, &[(1e6, f64::NAN), (2e6, 1e-3)]).is_none());
        assert!(fit(&RingLaw::all_reduce(1), &[(1e6, 1e-3), (2e6, 2e-3)]).is_none());
    }
}
