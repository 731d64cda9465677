//! Measuring the network model ([`CostModel`]) an `auto` all-reduce chooses by, on a
//! communicator's own links.
//!
//! The model is the simulator's (`algo::sim`): a message costs `α + S/B`, combining
//! costs `S/R`. A ring all-reduce of `S` bytes on `n` ranks then takes
//! `2(n-1)·α + 2(n-1)/n·S/B + (n-1)/n·S/R`. Two ring sizes give α and B once R is
//! known, and R is timed on the CPU kernel itself. Each rank solves from its own
//! timings, then every value becomes the slowest rank's (an all-reduce of max), so
//! every rank holds the same model bit for bit and chooses alike.

use super::Communicator;
use crate::config::{AllReduceAlgo, CostModel};
use crate::error::Result;
use crate::reduce::{measured_rate, ReduceOp};
use std::time::Instant;

/// The large ring all-reduce's size: big enough that the bandwidth term dominates
/// on a 100 Gbit/s link, small enough to take milliseconds on a 1 Gbit/s one.
const LARGE_BYTES: usize = 4 << 20;
/// Elements per rank of the small ring all-reduce (one 64-byte frame per step).
const SMALL_PER_RANK: usize = 16;
/// Timed repetitions of the small all-reduce and of the large one.
const SMALL_REPS: usize = 21;
const LARGE_REPS: usize = 5;

impl Communicator {
    /// Measures α, the link rate and the reduction rate on this communicator's links and
    /// makes them its [`Tuning::cost_model`](crate::config::Tuning::cost_model), so that
    /// an `auto` all-reduce takes the least predicted time per call (see
    /// [`crate::sim::choose_by_model`]). Collective: every rank calls it;
    /// [`Communicator::init`] does when
    /// [`Tuning::measure_cost_model`](crate::config::Tuning::measure_cost_model) is set
    /// (`FERROCCL_COST_MODEL=measure`). Every rank gets the same model: each value is
    /// the slowest rank's.
    ///
    /// It runs 21 ring all-reduces of `16·n` floats, 6 of 4 MiB, and times the CPU
    /// reduction of 4 MiB 5 times: about 0.3 s on 4 ranks over 1 Gbit/s links. It
    /// measures the links this rank has, as one class: a job spanning hosts gets the
    /// slower class's α and rate. `None` on a single rank (there is nothing to choose).
    pub fn measure_cost_model(&mut self) -> Result<Option<CostModel>> {
        let n = self.world_size;
        if n == 1 {
            return Ok(None);
        }
        let algo = self.cfg.tuning.all_reduce_algo;
        self.cfg.tuning.all_reduce_algo = AllReduceAlgo::Ring;
        let timed = self.time_ring(n);
        self.cfg.tuning.all_reduce_algo = algo;
        let (t_small, t_large) = timed?;
        let large = LARGE_BYTES;
        let m = fit_ring(
            n,
            (n * SMALL_PER_RANK * 4) as f64,
            t_small,
            large as f64,
            t_large,
            measured_rate(large),
        );
        // The slowest rank's values, identical on every rank.
        let mut v = [m.alpha, 1.0 / m.bandwidth, 1.0 / m.reduce];
        self.all_reduce(&mut v, ReduceOp::Max)?;
        let m = CostModel::new(v[0], 1.0 / v[1], 1.0 / v[2])?;
        self.cfg.tuning.cost_model = Some(m);
        tracing::debug!(rank = self.rank, "measured cost model: {m}");
        Ok(Some(m))
    }

    /// Median seconds of the small and of the large ring all-reduce (f32 sum).
    fn time_ring(&self, n: usize) -> Result<(f64, f64)> {
        let mut small = vec![1.0f32; n * SMALL_PER_RANK];
        let mut large = vec![1.0f32; LARGE_BYTES / 4];
        // Warm both paths (connections, buffers) before timing.
        self.all_reduce(&mut small, ReduceOp::Sum)?;
        self.all_reduce(&mut large, ReduceOp::Sum)?;
        let time = |buf: &mut [f32], reps: usize| -> Result<f64> {
            let mut ts = Vec::with_capacity(reps);
            for _ in 0..reps {
                buf.fill(1.0);
                let t0 = Instant::now();
                self.all_reduce(buf, ReduceOp::Sum)?;
                ts.push(t0.elapsed().as_secs_f64());
            }
            Ok(median(ts))
        };
        Ok((time(&mut small, SMALL_REPS)?, time(&mut large, LARGE_REPS)?))
    }
}

fn median(mut ts: Vec<f64>) -> f64 {
    ts.sort_by(f64::total_cmp);
    ts[ts.len() / 2]
}

/// The model under which ring all-reduces of `small` and `large` bytes on `n` ranks
/// take `t_small` and `t_large` seconds, combining at `reduce` bytes/s:
/// `t(S) = 2(n-1)·α + 2(n-1)/n·S/B + (n-1)/n·S/R`, two equations in α and 1/B. Noise
/// that makes either negative is clamped: α to 0, and 1/B to what the large
/// all-reduce alone implies.
pub(crate) fn fit_ring(
    n: usize,
    small: f64,
    t_small: f64,
    large: f64,
    t_large: f64,
    reduce: f64,
) -> CostModel {
    let steps = 2.0 * (n as f64 - 1.0);
    let k = (n as f64 - 1.0) / n as f64;
    // Time left for latency and links once the combining is taken out.
    let u_small = (t_small - k * small / reduce).max(0.0);
    let u_large = (t_large - k * large / reduce).max(f64::MIN_POSITIVE);
    let mut inv_b = (u_large - u_small) / (2.0 * k * (large - small));
    if inv_b.is_nan() || inv_b <= 0.0 {
        inv_b = u_large / (2.0 * k * large);
    }
    let alpha = ((u_small - 2.0 * k * small * inv_b) / steps).max(0.0);
    // Finite by construction: u_large > 0, reduce > 0.
    CostModel {
        alpha,
        bandwidth: 1.0 / inv_b.max(1e-18),
        reduce,
        within_host: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_time(n: usize, s: f64, m: &CostModel) -> f64 {
        let k = (n as f64 - 1.0) / n as f64;
        2.0 * (n as f64 - 1.0) * m.alpha + 2.0 * k * s / m.bandwidth + k * s / m.reduce
    }

    #[test]
    fn fit_recovers_the_model_from_synthetic_timings() {
        for n in [2, 3, 4, 8, 64] {
            for (alpha, bw, red) in [
                (20e-6, 12.5e9, 10e9),
                (500e-6, 0.125e9, 4e9),
                (0.0, 1e9, 1e9),
            ] {
                let m = CostModel::new(alpha, bw, red).unwrap();
                let small = (n * 64) as f64;
                let large = (4 << 20) as f64;
                let f = fit_ring(
                    n,
                    small,
                    ring_time(n, small, &m),
                    large,
                    ring_time(n, large, &m),
                    red,
                );
                assert!((f.alpha - alpha).abs() < 1e-12, "n {n}: {f:?} vs {m:?}");
                assert!(
                    (f.bandwidth / bw - 1.0).abs() < 1e-9,
                    "n {n}: {f:?} vs {m:?}"
                );
                assert_eq!(f.reduce, red);
            }
        }
    }

    #[test]
    fn fit_clamps_noise_to_a_usable_model() {
        // The small all-reduce slower than the large one: no positive slope.
        let f = fit_ring(4, 256.0, 5e-3, 4e6, 1e-3, 1e10);
        assert!(
            f.alpha >= 0.0 && f.bandwidth.is_finite() && f.bandwidth > 0.0,
            "{f:?}"
        );
        // Combining "slower" than the whole all-reduce.
        let f = fit_ring(4, 256.0, 1e-5, 4e6, 1e-4, 1e6);
        assert!(
            f.alpha >= 0.0 && f.bandwidth.is_finite() && f.bandwidth > 0.0,
            "{f:?}"
        );
        assert!(CostModel::new(f.alpha, f.bandwidth, f.reduce).is_ok());
    }
}
