//! A network simulator that runs the real plans in virtual time.
//!
//! Every rank's [`Plan`] — the same frame lists the engine executes — is played on a
//! model network: a frame of `L` bytes from rank `r` leaves when its dependency allows
//! and `r`'s port is free, occupies the port for `L/β`, and arrives `α + L/β` after it
//! left; a receive is applied when its frame has arrived, the receive before it has
//! been applied and the send it waits for has left, and a combining receive then takes
//! `γ·L`. Ports are full duplex (a rank sends and receives at once) and one per rank;
//! links between ranks of one host (`ranks_per_host > 1`) have their own `α` and `β`.
//! Incast (several senders into one receiver) is not modelled: receivers never limit.
//!
//! Frames are compacted as plans are built (24 bytes each), so a ring over 4096 ranks
//! (8190 frames per rank) fits in under a gigabyte and runs in about a second.

use super::{all_reduce_plan, Algorithm, Land, Plan};
use std::collections::{HashMap, VecDeque};

/// The all-reduce algorithms the simulator compares, in the order it lists them.
pub const ALL_REDUCE: [Algorithm; 4] = [
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Rabenseifner,
    Algorithm::Tree,
];

/// Predicted seconds of an all-reduce of `count` elements of `esize` bytes over `n`
/// ranks by `algo` (its real plans, cut into frames of `segment_bytes` as the engine
/// cuts them), on `net`; `None` where the algorithm cannot run the call (recursive
/// doubling sends the whole buffer as one frame, at most 4 GiB).
pub fn all_reduce_time(
    algo: Algorithm,
    n: usize,
    count: usize,
    esize: usize,
    segment_bytes: usize,
    net: &Network,
) -> Option<f64> {
    if algo == Algorithm::RecursiveDoubling && count * esize > u32::MAX as usize {
        return None;
    }
    if !ALL_REDUCE.contains(&algo) {
        return None;
    }
    let t = simulate(
        n,
        |r| all_reduce_plan(algo, r, n, count, esize, segment_bytes),
        net,
    );
    Some(t.into_iter().fold(0.0, f64::max))
}

/// The all-reduce algorithm with the least predicted time for the call, and every
/// algorithm's prediction (in [`ALL_REDUCE`] order; `None` where it cannot run).
pub fn choose_all_reduce(
    n: usize,
    count: usize,
    esize: usize,
    segment_bytes: usize,
    net: &Network,
) -> (Algorithm, Vec<(Algorithm, Option<f64>)>) {
    let times: Vec<(Algorithm, Option<f64>)> = ALL_REDUCE
        .iter()
        .map(|&a| (a, all_reduce_time(a, n, count, esize, segment_bytes, net)))
        .collect();
    let best = least(times.iter().filter_map(|&(a, t)| t.map(|t| (a, t))));
    (best, times)
}

/// The closed-form time of an all-reduce of `count` elements of `esize` bytes over `n`
/// ranks by `algo` on `net`, taken as flat (its between-hosts `alpha`, `beta`,
/// `gamma`), with the ring cut into the engine's segments of at most
/// `segment_bytes`: what a communicator consults per call to choose
/// ([`crate::config::Tuning::cost_model`]); `None` where the algorithm cannot run it.
/// Exact for recursive doubling and Rabenseifner over powers of two, close when ranks
/// fold in; the ring's pipelining is approximated (the largest of its port time, its
/// first segment's latency plus the rest, and a latency-bound reduce-scatter followed
/// by a port-bound all-gather); the tree's as its deepest path (`2·log2 n` hops, the
/// busiest port's frames on the way) plus the other segments through its busiest port
/// or reduction. The tests hold it to [`simulate`] on the real plans.
pub fn predict_all_reduce(
    algo: Algorithm,
    n: usize,
    count: usize,
    esize: usize,
    segment_bytes: usize,
    net: &Network,
) -> Option<f64> {
    let (alpha, beta, gamma) = (net.alpha, net.beta, net.gamma);
    if n <= 1 {
        return Some(0.0);
    }
    let bytes = count * esize;
    let s = bytes as f64;
    let p = super::doubling::pow2_floor(n);
    let stages = p.trailing_zeros() as f64;
    let share = (p as f64 - 1.0) / p as f64 * s;
    // Ranks beyond the power of two hand their data in (`fold_in`) and get the result
    // back (`back`); 0 for a power of two.
    let (fold_in, back) = if p < n {
        (alpha + s / beta + gamma * s, alpha + s / beta)
    } else {
        (0.0, 0.0)
    };
    Some(match algo {
        Algorithm::Ring => {
            let chunk = count.div_ceil(n);
            let seg =
                super::schedule::pipeline_segment(chunk, esize, segment_bytes).min(chunk.max(1));
            let (c, g) = ((chunk * esize) as f64, (seg * esize) as f64);
            let k = (chunk.max(1)).div_ceil(seg) as f64;
            let steps = 2.0 * (n as f64 - 1.0);
            // The port idles where the all-gather starts only while the first finished
            // segment is still on its way (it left a chunk's port time earlier).
            let turn = (alpha + g / beta + gamma * g - c / beta).max(0.0);
            let port = steps * c / beta + alpha + turn;
            let latency = steps * (alpha + g / beta)
                + (n as f64 - 1.0) * gamma * g
                + (k - 1.0) * (g / beta).max(gamma * g);
            // Reductions make a reduce-scatter step slower than an all-gather step:
            // the first half can be bound by its latency or by the reduction of a
            // chunk while the second is bound by the port.
            let rs_step = (alpha + g / beta + gamma * g).max(gamma * c);
            let mixed = (n as f64 - 1.0) * (rs_step + c / beta);
            port.max(latency).max(mixed)
        }
        Algorithm::RecursiveDoubling if bytes <= u32::MAX as usize => {
            // Two paths after the fold: through the partners, a full message per
            // stage; or on a folded rank, whose unfolded partners' frames are already
            // there (no α for those stages), then the way back.
            let stage = alpha + s / beta + gamma * s;
            // Stages whose partner folded too pay their α: log2 of the folded count.
            let both = ((n - p) as f64).log2().ceil().max(0.0);
            let folded = stages * (s / beta + gamma * s) + both * alpha + back;
            fold_in + (stages * stage).max(if p < n { folded } else { 0.0 })
        }
        // Its all-gather waits for the folded ranks' halves: the fold delays the
        // whole chain, and the way back follows it.
        Algorithm::Rabenseifner => {
            fold_in + 2.0 * stages * alpha + 2.0 * share / beta + gamma * share + back
        }
        Algorithm::Tree => {
            let w = super::tree::Widest::of(n);
            let half = count.div_ceil(2);
            let seg = super::tree::seg_elems(count, esize, segment_bytes).min(half.max(1));
            let g = (seg * esize) as f64;
            let k = half.max(1).div_ceil(seg) as f64;
            let d = w.depth as f64;
            // Each further segment: the busiest port's frames or the busiest reduction.
            let slot = (w.edges as f64 * g / beta).max(w.children as f64 * gamma * g);
            // The first: up the deepest path and down again, each hop down sending to
            // both children (trees of up to three ranks are chains).
            let fan = if n <= 3 { 1.0 } else { 2.0 };
            2.0 * d * alpha + (1.0 + fan) * d * g / beta + d * gamma * g + (k - 1.0) * slot
        }
        _ => return None,
    })
}

/// The algorithm of [`ALL_REDUCE`] with the least [`predict_all_reduce`] time.
pub fn choose_by_model(
    n: usize,
    count: usize,
    esize: usize,
    segment_bytes: usize,
    net: &Network,
) -> Algorithm {
    least(ALL_REDUCE.iter().filter_map(|&a| {
        predict_all_reduce(a, n, count, esize, segment_bytes, net).map(|t| (a, t))
    }))
}

/// The algorithm with the least time (the first of equals; the ring when none can run).
fn least(times: impl Iterator<Item = (Algorithm, f64)>) -> Algorithm {
    times
        .fold(None, |best: Option<(Algorithm, f64)>, (a, t)| match best {
            Some((_, bt)) if bt <= t => best,
            _ => Some((a, t)),
        })
        .map_or(Algorithm::Ring, |(a, _)| a)
}

/// The model network.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Network {
    /// Seconds from a frame leaving to its first byte arriving, between hosts.
    pub alpha: f64,
    /// Bytes per second of a rank's port, between hosts.
    pub beta: f64,
    /// Seconds per byte a combining receive takes (the reduction).
    pub gamma: f64,
    /// Ranks per host (consecutive ranks share a host); 1: every rank its own.
    pub ranks_per_host: usize,
    /// `alpha` between ranks of one host.
    pub intra_alpha: f64,
    /// `beta` between ranks of one host.
    pub intra_beta: f64,
}

impl Network {
    /// Every rank on its own host, behind links of `alpha` seconds and `beta` bytes/s.
    pub fn flat(alpha: f64, beta: f64, gamma: f64) -> Self {
        Self {
            alpha,
            beta,
            gamma,
            ranks_per_host: 1,
            intra_alpha: alpha,
            intra_beta: beta,
        }
    }

    fn link(&self, a: usize, b: usize) -> (f64, f64) {
        let k = self.ranks_per_host.max(1);
        if a / k == b / k {
            (self.intra_alpha, self.intra_beta)
        } else {
            (self.alpha, self.beta)
        }
    }
}

/// A frame, compacted: peer, bytes, dependency (`u32::MAX`: none), combining.
#[derive(Clone, Copy)]
struct Frame {
    peer: u32,
    len: u64,
    dep: u32,
    reduce: bool,
}

const NONE: u32 = u32::MAX;

fn compact(p: &Plan) -> (Vec<Frame>, Vec<Frame>) {
    let dep = |d: Option<usize>| d.map_or(NONE, |d| d as u32);
    let outs = p
        .outs
        .iter()
        .map(|o| Frame {
            peer: o.peer as u32,
            len: o.len as u64,
            dep: dep(o.after_recv),
            reduce: false,
        })
        .collect();
    let ins = p
        .ins
        .iter()
        .map(|i| Frame {
            peer: i.peer as u32,
            len: i.len as u64,
            dep: dep(i.after_send),
            reduce: matches!(i.land, Land::Reduce { .. }),
        })
        .collect();
    (outs, ins)
}

/// Simulates the plans of all `n` ranks of one call (`plan_of(rank)`), returning when
/// each rank finished, in seconds from a common start. Panics if the plans deadlock
/// (they never do when they fit each other; see the plan tests).
pub(crate) fn simulate(n: usize, plan_of: impl Fn(usize) -> Plan, net: &Network) -> Vec<f64> {
    let plans: Vec<(Vec<Frame>, Vec<Frame>)> = (0..n).map(|r| compact(&plan_of(r))).collect();
    // Per rank: next out, next in, port free at, when each out left / in was applied.
    let mut si = vec![0usize; n];
    let mut ai = vec![0usize; n];
    let mut port = vec![0.0f64; n];
    let mut left: Vec<Vec<f64>> = plans
        .iter()
        .map(|(o, _)| Vec::with_capacity(o.len()))
        .collect();
    let mut applied: Vec<Vec<f64>> = plans
        .iter()
        .map(|(_, i)| Vec::with_capacity(i.len()))
        .collect();
    // Arrival times of frames in flight, per (from, to).
    let mut wires: HashMap<(u32, u32), VecDeque<f64>> = HashMap::new();
    let mut done = vec![false; n];
    let mut remaining = n;
    while remaining > 0 {
        let mut moved = false;
        for r in 0..n {
            if done[r] {
                continue;
            }
            let (outs, ins) = &plans[r];
            loop {
                let mut step = false;
                if let Some(o) = outs.get(si[r]) {
                    let dep = o.dep as usize;
                    if o.dep == NONE || dep < applied[r].len() {
                        let ready = if o.dep == NONE { 0.0 } else { applied[r][dep] };
                        let (a, b) = net.link(r, o.peer as usize);
                        let start = ready.max(port[r]);
                        let busy = o.len as f64 / b;
                        port[r] = start + busy;
                        left[r].push(start + busy);
                        wires
                            .entry((r as u32, o.peer))
                            .or_default()
                            .push_back(start + a + busy);
                        si[r] += 1;
                        step = true;
                    }
                }
                if let Some(i) = ins.get(ai[r]) {
                    let dep = i.dep as usize;
                    let sent = i.dep == NONE || dep < left[r].len();
                    let arrived = wires.get_mut(&(i.peer, r as u32)).and_then(|q| {
                        if sent {
                            q.pop_front()
                        } else {
                            None
                        }
                    });
                    if let Some(at) = arrived {
                        let after = if i.dep == NONE { 0.0 } else { left[r][dep] };
                        let prev = applied[r].last().copied().unwrap_or(0.0);
                        let cost = if i.reduce {
                            net.gamma * i.len as f64
                        } else {
                            0.0
                        };
                        applied[r].push(at.max(after).max(prev) + cost);
                        ai[r] += 1;
                        step = true;
                    }
                }
                if !step {
                    break;
                }
                moved = true;
            }
            if si[r] == outs.len() && ai[r] == ins.len() {
                done[r] = true;
                remaining -= 1;
                moved = true;
            }
        }
        assert!(
            moved,
            "simulated plans deadlock: sent {si:?}, applied {ai:?}"
        );
    }
    (0..n)
        .map(|r| {
            let a = applied[r].last().copied().unwrap_or(0.0);
            let l = left[r].last().copied().unwrap_or(0.0);
            a.max(l)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{doubling, halving, ring, schedule};
    use super::*;

    fn ring_plan(r: usize, n: usize, count: usize, seg: usize) -> Plan {
        let chunks = schedule::balanced_chunks(count, n);
        ring::plan(r, n, &chunks, 4, 0..schedule::allreduce_steps(n), seg)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
    }

    #[test]
    fn unsegmented_ring_takes_the_textbook_time() {
        // One segment per chunk: 2(n-1) steps of α + (S/n)/β, plus γ·S/n per reducing step.
        let net = Network::flat(10e-6, 1e9, 0.5e-9);
        for n in [2usize, 3, 8] {
            let count = 1200 * n;
            let t = simulate(n, |r| ring_plan(r, n, count, count), &net);
            let chunk = (count / n * 4) as f64;
            let want = 2.0 * (n - 1) as f64 * (net.alpha + chunk / net.beta)
                + (n - 1) as f64 * net.gamma * chunk;
            for (r, &got) in t.iter().enumerate() {
                assert!(close(got, want), "n={n} rank {r}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn doubling_takes_log_steps_of_the_whole_buffer() {
        let net = Network::flat(20e-6, 1e9, 0.0);
        let bytes = 4096usize;
        for n in [2usize, 4, 16] {
            let t = simulate(n, |r| doubling::plan(r, n, bytes), &net);
            let want = (n.trailing_zeros() as f64) * (net.alpha + bytes as f64 / net.beta);
            assert!(t.iter().all(|&x| close(x, want)), "n={n}: {t:?} vs {want}");
        }
    }

    #[test]
    fn rabenseifner_beats_the_ring_at_scale_and_not_on_bandwidth() {
        // Latency-bound: 256 ranks, 1 MiB, α = 20 µs: 16 steps against 510.
        let net = Network::flat(20e-6, 12.5e9, 0.0);
        let n = 256;
        let count = 1 << 18;
        let ring_t = simulate(n, |r| ring_plan(r, n, count, count), &net)[0];
        let rab_t = simulate(n, |r| halving::plan(r, n, count, 4, count), &net)[0];
        assert!(rab_t * 10.0 < ring_t, "rab {rab_t} ring {ring_t}");
        // Bandwidth-bound (α = 0): both move 2(n-1)/n·S per rank, so they tie.
        let net = Network::flat(0.0, 1e9, 0.0);
        let ring_t = simulate(8, |r| ring_plan(r, 8, 1 << 16, 1 << 16), &net)[0];
        let rab_t = simulate(8, |r| halving::plan(r, 8, 1 << 16, 4, 1 << 16), &net)[0];
        assert!(close(ring_t, rab_t), "{ring_t} vs {rab_t}");
    }

    #[test]
    fn the_choice_is_the_least_predicted_time() {
        let net = Network::flat(20e-6, 12.5e9, 0.1e-9);
        for (n, count) in [(8usize, 256usize), (8, 1 << 22), (64, 1 << 16), (6, 1000)] {
            let (best, times) = choose_all_reduce(n, count, 4, 512 << 10, &net);
            let least = times
                .iter()
                .filter_map(|&(_, t)| t)
                .fold(f64::INFINITY, f64::min);
            let chosen = times.iter().find(|(a, _)| *a == best).and_then(|x| x.1);
            assert_eq!(chosen, Some(least), "n={n} count={count}: {times:?}");
        }
        // Small messages on many ranks: not the ring; huge ones: not recursive doubling.
        assert_ne!(
            choose_all_reduce(64, 64, 4, 512 << 10, &net).0,
            Algorithm::Ring
        );
        assert_ne!(
            choose_all_reduce(8, 1 << 24, 4, 512 << 10, &net).0,
            Algorithm::RecursiveDoubling
        );
    }

    #[test]
    fn closed_forms_are_the_plans_critical_paths() {
        let net = Network::flat(15e-6, 2e9, 0.3e-9);
        for n in [2usize, 3, 5, 8, 12, 16] {
            let p = doubling::pow2_floor(n);
            // Divisible by n and p, so every block is equal.
            let count = 240 * n * p;
            let bytes = count * 4;
            for algo in [Algorithm::RecursiveDoubling, Algorithm::Rabenseifner] {
                let sim = simulate(n, |r| all_reduce_plan(algo, r, n, count, 4, bytes), &net)
                    .into_iter()
                    .fold(0.0, f64::max);
                let f = predict_all_reduce(algo, n, count, 4, bytes, &net).unwrap();
                if n.is_power_of_two() {
                    assert!(
                        close(sim, f),
                        "{algo:?} n={n}: simulated {sim}, formula {f}"
                    );
                } else {
                    assert!(
                        (f - sim).abs() <= 0.05 * sim,
                        "{algo:?} n={n}: simulated {sim}, formula {f}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_model_choice_is_within_5_percent_of_the_best_simulated() {
        // The criterion, on the real (segmented) plans, for the worlds a debug
        // test can afford; `ferroccl simulate` prints the same for thousands of ranks.
        for net in [
            Network::flat(20e-6, 12.5e9, 0.1e-9),
            Network::flat(2e-6, 1.25e9, 0.5e-9),
        ] {
            for n in [2usize, 5, 8, 12, 64, 100] {
                let mut bytes = 1024usize;
                while bytes <= 64 << 20 {
                    let count = bytes / 4;
                    let (_, times) = choose_all_reduce(n, count, 4, 512 << 10, &net);
                    let best = times
                        .iter()
                        .filter_map(|x| x.1)
                        .fold(f64::INFINITY, f64::min);
                    let pick = choose_by_model(n, count, 4, 512 << 10, &net);
                    let got = times
                        .iter()
                        .find(|x| x.0 == pick)
                        .and_then(|x| x.1)
                        .unwrap();
                    assert!(
                        got <= 1.05 * best,
                        "n={n} {bytes} B: {pick:?} {got} vs best {best}: {times:?}"
                    );
                    bytes *= 16;
                }
            }
        }
    }

    #[test]
    fn the_trees_closed_form_follows_its_plans() {
        // Within 5 % once a half travels as 64 segments (the bandwidth-bound calls,
        // where the tree competes); within 25 % while the pipeline is filling (one or
        // two segments, where recursive doubling or Rabenseifner win anyway).
        for net in [
            Network::flat(20e-6, 12.5e9, 0.1e-9),
            Network::flat(2e-6, 1.25e9, 0.5e-9),
            Network::flat(15e-6, 2e9, 0.3e-9),
        ] {
            for n in [2usize, 3, 5, 6, 8, 12, 16, 33, 64, 100] {
                let mut bytes = 1024usize;
                while bytes <= 64 << 20 {
                    let count = bytes / 4;
                    let sim = all_reduce_time(Algorithm::Tree, n, count, 4, 512 << 10, &net);
                    let f = predict_all_reduce(Algorithm::Tree, n, count, 4, 512 << 10, &net);
                    let (sim, f) = (sim.unwrap(), f.unwrap());
                    let seg = super::super::tree::seg_elems(count, 4, 512 << 10);
                    let k = count.div_ceil(2).div_ceil(seg);
                    let tol = if k >= 64 { 0.05 } else { 0.25 };
                    assert!(
                        (f - sim).abs() <= tol * sim,
                        "n={n} {bytes} B ({k} segments): simulated {sim}, formula {f}"
                    );
                    bytes *= 4;
                }
            }
        }
    }

    #[test]
    fn links_within_a_host_use_their_own_rate() {
        // Two ranks on one host with a 10x faster link than between hosts.
        let mut net = Network::flat(10e-6, 1e9, 0.0);
        let slow = simulate(2, |r| doubling::plan(r, 2, 1 << 20), &net)[0];
        net.ranks_per_host = 2;
        net.intra_alpha = 1e-6;
        net.intra_beta = 1e10;
        let fast = simulate(2, |r| doubling::plan(r, 2, 1 << 20), &net)[0];
        assert!(close(slow, 10e-6 + (1 << 20) as f64 / 1e9), "{slow}");
        assert!(close(fast, 1e-6 + (1 << 20) as f64 / 1e10), "{fast}");
    }
}
