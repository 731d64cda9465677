//! The parameter server's pure core: the shard layout, the server's clocks and the
//! Stale Synchronous Parallel admission rule, the staleness histogram, and one shard's
//! state machine ([`ShardServer`]: pulls, pushes, updates). No I/O: the executor in
//! [`super`] only moves its messages.
//!
//! **Clocks and versions.** Steps are numbered from 0. A shard's server counts, per
//! worker, the pushes it has *applied* (`applied[w]`: worker w's clock as this server
//! sees it). The server's **version** V is the least clock over the workers still
//! running: every worker's updates of steps `0..V` are in the shard (a worker that
//! has finished no longer holds the version back). A pull answered at version V
//! hands the worker parameters that contain at least all updates of steps `< V`
//! (possibly more: the pushes of workers ahead).
//!
//! **Admission (SSP, Ho et al. 2013).** With staleness bound s, a pull for step t is
//! answered only when `t ≤ V + s`: every worker has finished step `t − s − 1`. s = 0
//! is synchronous (everyone has finished the previous step), s = ∞ never waits.
//!
//! **Staleness of an update.** A push of step t carries the version v its gradient
//! was computed on (the version of the pull that admitted it). Its staleness is
//! `t − v`: the parameters it was computed on hold every worker's updates of steps
//! `< v`, so up to `t − v` steps of the other workers' updates were missing (a
//! synchronous step t sees every update of steps `< t`: staleness 0). **Bound:** the
//! pull was admitted, so `t ≤ v + s`, hence `t − v ≤ s`. (The server's version when
//! it applies the push, V, lies between v and t, so `V − v ≤ s` as well; V is held
//! down by the slowest worker, so `t − v` is the one that shows how far ahead of the
//! slowest a fast worker computed.)
//!
//! **s = 0 aggregates.** With s = 0 a server buffers the pushes of step t and, once
//! every running worker's is in, applies their average (summed in worker order, times
//! 1/N) as one optimizer step: the same update as DDP's all-reduced average. With
//! s ≥ 1 each push is applied on arrival, as its own optimizer step, scaled by 1/N (a
//! worker's gradient is one N-th of the global batch), in arrival order.

use crate::ddp::Optimizer;
use crate::error::{Error, Result};
use std::ops::Range;

/// The staleness bound s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staleness {
    /// At most this many steps stale (0: synchronous).
    Bounded(u64),
    /// Fully asynchronous.
    Unbounded,
}

impl Staleness {
    /// Parses `0`, `1`, ... or `inf` (also `async`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "inf" | "infinity" | "async" | "∞" => Ok(Staleness::Unbounded),
            t => t.parse::<u64>().map(Staleness::Bounded).map_err(|_| {
                Error::invalid(format!(
                    "staleness {s:?}: expected a whole number of steps from 0, or inf"
                ))
            }),
        }
    }

    /// Whether a pull for `step` is admitted at server version `version`.
    pub fn admits(self, step: u64, version: u64) -> bool {
        match self {
            Staleness::Bounded(s) => step <= version.saturating_add(s),
            Staleness::Unbounded => true,
        }
    }
}

impl std::fmt::Display for Staleness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Staleness::Bounded(s) => write!(f, "{s}"),
            Staleness::Unbounded => f.write_str("inf"),
        }
    }
}

/// The shards of a flat buffer of `total` elements over `n` servers: contiguous, in
/// order, sizes differing by at most one (the first `total % n` one longer). Every
/// shard must hold an element: `n = 0` or `n > total` is an error.
pub fn shards(total: usize, n: usize) -> Result<Vec<Range<usize>>> {
    if n == 0 || n > total {
        return Err(Error::invalid(format!(
            "{total} parameters cannot make {n} non-empty shards (1 to {total} servers)"
        )));
    }
    let (q, r) = (total / n, total % n);
    let mut start = 0;
    Ok((0..n)
        .map(|j| {
            let len = q + usize::from(j < r);
            start += len;
            start - len..start
        })
        .collect())
}

/// Counts of applied updates by staleness.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Histogram {
    /// `counts[k]`: updates applied k steps stale.
    pub counts: Vec<u64>,
}

impl Histogram {
    /// Counts one update of staleness `k`.
    pub fn add(&mut self, k: u64) {
        let k = k as usize;
        if self.counts.len() <= k {
            self.counts.resize(k + 1, 0);
        }
        self.counts[k] += 1;
    }

    /// Adds `o`'s counts.
    pub fn merge(&mut self, o: &Histogram) {
        for (k, &c) in o.counts.iter().enumerate() {
            if c > 0 {
                if self.counts.len() <= k {
                    self.counts.resize(k + 1, 0);
                }
                self.counts[k] += c;
            }
        }
    }

    /// The largest staleness counted (None: nothing counted).
    pub fn max(&self) -> Option<u64> {
        self.counts.iter().rposition(|&c| c > 0).map(|k| k as u64)
    }

    /// Updates counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Mean staleness (0 when empty).
    pub fn mean(&self) -> f64 {
        let n = self.total();
        if n == 0 {
            return 0.0;
        }
        let s: u64 = self
            .counts
            .iter()
            .enumerate()
            .map(|(k, &c)| k as u64 * c)
            .sum();
        s as f64 / n as f64
    }
}

/// One server's view of the workers: their clocks and whether they still run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clocks {
    applied: Vec<u64>,
    running: Vec<bool>,
}

impl Clocks {
    /// `clocks[w]`: the steps worker w has done (0 for a fresh run).
    pub fn new(clocks: Vec<u64>) -> Self {
        let running = vec![true; clocks.len()];
        Clocks {
            applied: clocks,
            running,
        }
    }

    /// The version V: the least clock of the running workers (all finished: the
    /// greatest clock).
    pub fn version(&self) -> u64 {
        let running = self
            .applied
            .iter()
            .zip(&self.running)
            .filter(|(_, r)| **r)
            .map(|(c, _)| *c)
            .min();
        running.unwrap_or_else(|| self.applied.iter().copied().max().unwrap_or(0))
    }

    /// Worker w's clock.
    pub fn clock(&self, w: usize) -> u64 {
        self.applied[w]
    }

    /// Every worker's clock.
    pub fn clocks(&self) -> &[u64] {
        &self.applied
    }

    /// Whether worker w still runs.
    pub fn running(&self, w: usize) -> bool {
        self.running[w]
    }

    /// Workers still running.
    pub fn running_count(&self) -> usize {
        self.running.iter().filter(|r| **r).count()
    }
}

/// A pull held back by the admission rule, answered by a later push or finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pull {
    /// The worker.
    pub worker: usize,
    /// The step it wants parameters for.
    pub step: u64,
}

/// One shard's server: its parameters and optimizer state, the clocks, the pulls
/// waiting for admission and the staleness histogram. Every method is a pure state
/// transition; a misbehaving worker (a push out of order, from the future) is a typed
/// error, not a panic.
pub struct ShardServer<O> {
    params: Vec<f32>,
    opt: O,
    clocks: Clocks,
    staleness: Staleness,
    /// s = 0: each running worker's buffered push of the current step (gradient, LR,
    /// staleness).
    buffered: Vec<Option<(Vec<f32>, f32, u64)>>,
    waiting: Vec<Pull>,
    /// s = 0: workers that finished with a push buffered; they stop running once the
    /// step it belongs to is applied.
    finishing: Vec<bool>,
    hist: Histogram,
    updates: u64,
}

impl<O: Optimizer> ShardServer<O> {
    /// A server of `params` (its shard) stepped by `opt`, for workers at `clocks`.
    pub fn new(params: Vec<f32>, mut opt: O, clocks: Vec<u64>, staleness: Staleness) -> Self {
        opt.init(&[params.len()]);
        let n = clocks.len();
        ShardServer {
            params,
            opt,
            clocks: Clocks::new(clocks),
            staleness,
            buffered: vec![None; n],
            waiting: Vec::new(),
            finishing: vec![false; n],
            hist: Histogram::default(),
            updates: 0,
        }
    }

    /// The shard's parameters.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The shard's parameters and optimizer, for checkpoints.
    pub fn parts_mut(&mut self) -> (&mut Vec<f32>, &mut O) {
        (&mut self.params, &mut self.opt)
    }

    /// The clocks.
    pub fn clocks(&self) -> &Clocks {
        &self.clocks
    }

    /// The version V (see the module docs).
    pub fn version(&self) -> u64 {
        self.clocks.version()
    }

    /// Staleness of the updates applied so far.
    pub fn histogram(&self) -> &Histogram {
        &self.hist
    }

    /// Optimizer steps applied (s = 0: one per step; else one per push).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Whether every worker has finished.
    pub fn all_finished(&self) -> bool {
        self.clocks.running_count() == 0
    }

    /// Steps worker w has pushed (applied or, with s = 0, buffered): the clock its
    /// next pull and its finish must carry.
    pub fn pushed(&self, w: usize) -> u64 {
        self.clocks.applied[w] + u64::from(self.buffered[w].is_some())
    }

    fn check_worker(&self, w: usize, what: &str) -> Result<()> {
        if w >= self.clocks.applied.len() || !self.clocks.running[w] || self.finishing[w] {
            return Err(Error::invalid(format!(
                "parameter server: {what} from worker {w}, which is not a running worker"
            )));
        }
        Ok(())
    }

    /// Worker w asks for the parameters of `step` (its clock). Returns the version to
    /// answer with if admitted now; otherwise the pull waits (see [`Self::admitted`]).
    pub fn pull(&mut self, w: usize, step: u64) -> Result<Option<u64>> {
        self.check_worker(w, "a pull")?;
        if step != self.pushed(w) {
            return Err(Error::invalid(format!(
                "parameter server: worker {w} pulls for step {step} at clock {}",
                self.clocks.applied[w]
            )));
        }
        if self.buffered[w].is_none() && self.staleness.admits(step, self.version()) {
            return Ok(Some(self.version()));
        }
        self.waiting.push(Pull { worker: w, step });
        Ok(None)
    }

    /// The waiting pulls admitted now, each with the version to answer with; they
    /// stop waiting.
    pub fn admitted(&mut self) -> Vec<(Pull, u64)> {
        let v = self.version();
        let (s, buffered) = (self.staleness, &self.buffered);
        let mut out = Vec::new();
        self.waiting.retain(|p| {
            let ok = buffered[p.worker].is_none() && s.admits(p.step, v);
            if ok {
                out.push((*p, v));
            }
            !ok
        });
        out
    }

    /// Worker w's gradient of `step`, computed on `version`, to be applied at `lr`.
    /// s ≥ 1: applied now, its staleness counted. s = 0: buffered until every running
    /// worker's push of this step is in, then applied as their average.
    pub fn push(
        &mut self,
        w: usize,
        step: u64,
        version: u64,
        lr: f32,
        grad: Vec<f32>,
    ) -> Result<()> {
        self.check_worker(w, "a push")?;
        let v_now = self.version();
        if step != self.clocks.applied[w] || self.buffered[w].is_some() {
            return Err(Error::invalid(format!(
                "parameter server: worker {w} pushes step {step} at clock {}",
                self.clocks.applied[w]
            )));
        }
        if version > v_now || version > step || grad.len() != self.params.len() {
            return Err(Error::invalid(format!(
                "parameter server: worker {w}'s push of step {step} claims version {version} \
                 (the server is at {v_now}) with {} elements (the shard has {})",
                grad.len(),
                self.params.len()
            )));
        }
        if self.staleness == Staleness::Bounded(0) {
            self.buffered[w] = Some((grad, lr, step - version));
            return self.apply_step_if_complete();
        }
        self.hist.add(step - version);
        let n = self.clocks.applied.len() as f32;
        self.opt.begin_step();
        self.opt.update(0, &mut self.params, &grad, lr, 1.0 / n);
        self.updates += 1;
        self.clocks.applied[w] += 1;
        Ok(())
    }

    /// s = 0: once every running worker's push is buffered, applies their average.
    fn apply_step_if_complete(&mut self) -> Result<()> {
        let running: Vec<usize> = (0..self.buffered.len())
            .filter(|&w| self.clocks.running[w])
            .collect();
        if running.is_empty() || running.iter().any(|&w| self.buffered[w].is_none()) {
            return Ok(());
        }
        let mut sum: Option<(Vec<f32>, f32)> = None;
        for &w in &running {
            let (g, lr, stale) = self.buffered[w].take().expect("checked above");
            self.hist.add(stale);
            match &mut sum {
                None => sum = Some((g, lr)),
                Some((s, _)) => s.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
            }
            self.clocks.applied[w] += 1;
            if self.finishing[w] {
                self.finishing[w] = false;
                self.clocks.running[w] = false;
            }
        }
        let (g, lr) = sum.expect("at least one running worker");
        let n = running.len() as f32;
        self.opt.begin_step();
        self.opt.update(0, &mut self.params, &g, lr, 1.0 / n);
        self.updates += 1;
        Ok(())
    }

    /// Worker w has finished: it no longer holds the version back (s = 0: a step it
    /// will not push completes without it; a push of its own still buffered is
    /// applied with its step first).
    pub fn finish(&mut self, w: usize) -> Result<()> {
        self.check_worker(w, "a finish")?;
        self.waiting.retain(|p| p.worker != w);
        if self.buffered[w].is_some() {
            self.finishing[w] = true;
            return Ok(());
        }
        self.clocks.running[w] = false;
        if self.staleness == Staleness::Bounded(0) {
            self.apply_step_if_complete()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::Sgd;
    use proptest::prelude::*;

    fn server(n: usize, s: Staleness) -> ShardServer<Sgd> {
        ShardServer::new(vec![1.0; 3], Sgd::new(0.0, 0.0), vec![0; n], s)
    }

    #[test]
    fn shards_are_balanced_contiguous_and_non_empty() {
        assert_eq!(shards(10, 3).unwrap(), vec![0..4, 4..7, 7..10]);
        assert_eq!(shards(3, 3).unwrap(), vec![0..1, 1..2, 2..3]);
        for (t, n) in [(3, 4), (0, 1), (5, 0)] {
            let e = shards(t, n).unwrap_err().to_string();
            assert!(e.contains("non-empty shards"), "{e}");
        }
    }

    #[test]
    fn staleness_parses_numbers_and_inf_and_refuses_the_rest() {
        assert_eq!(Staleness::parse("0").unwrap(), Staleness::Bounded(0));
        assert_eq!(Staleness::parse("inf").unwrap(), Staleness::Unbounded);
        for bad in ["-1", "x", "1.5", ""] {
            assert!(Staleness::parse(bad).is_err(), "{bad}");
        }
        assert!(Staleness::Bounded(2).admits(5, 3));
        assert!(!Staleness::Bounded(1).admits(5, 3));
        assert!(Staleness::Unbounded.admits(u64::MAX, 0));
    }

    #[test]
    fn s0_buffers_a_step_and_applies_the_average_once() {
        let mut s = server(2, Staleness::Bounded(0));
        assert_eq!(s.pull(0, 0).unwrap(), Some(0));
        assert_eq!(s.pull(1, 0).unwrap(), Some(0));
        s.push(0, 0, 0, 1.0, vec![1.0, 2.0, 3.0]).unwrap();
        // Worker 0 asks for step 1 before worker 1 has pushed step 0: it waits.
        assert_eq!(s.pull(0, 1).unwrap(), None);
        assert_eq!(s.params(), &[1.0, 1.0, 1.0]);
        assert!(s.admitted().is_empty());
        s.push(1, 0, 0, 1.0, vec![3.0, 2.0, 1.0]).unwrap();
        // Average (2, 2, 2) at lr 1.
        assert_eq!(s.params(), &[-1.0, -1.0, -1.0]);
        assert_eq!(s.admitted(), vec![(Pull { worker: 0, step: 1 }, 1)]);
        assert_eq!(s.updates(), 1);
        assert_eq!(s.histogram().counts, vec![2]);
    }

    #[test]
    fn bounded_staleness_holds_a_fast_worker_and_counts_stale_updates() {
        let mut s = server(2, Staleness::Bounded(1));
        for step in 0..2 {
            assert!(s.pull(0, step).unwrap().is_some(), "step {step}");
            s.push(0, step, 0, 0.1, vec![0.0; 3]).unwrap();
        }
        // Worker 0 is 2 steps ahead of worker 1 (still at 0): step 2 must wait.
        assert_eq!(s.pull(0, 2).unwrap(), None);
        assert_eq!(s.pull(1, 0).unwrap(), Some(0));
        s.push(1, 0, 0, 0.1, vec![0.0; 3]).unwrap();
        assert_eq!(s.admitted(), vec![(Pull { worker: 0, step: 2 }, 1)]);
        // Worker 0's step 1 was computed on version 0: one step stale.
        assert_eq!(s.histogram().counts, vec![2, 1]);
        s.push(0, 2, 1, 0.1, vec![0.0; 3]).unwrap();
        assert_eq!(s.histogram().counts, vec![2, 2]);
        assert_eq!(s.histogram().max(), Some(1));
    }

    #[test]
    fn a_finished_worker_releases_the_others() {
        let mut s = server(2, Staleness::Bounded(0));
        s.pull(0, 0).unwrap();
        s.push(0, 0, 0, 1.0, vec![1.0; 3]).unwrap();
        assert_eq!(s.pull(0, 1).unwrap(), None);
        s.finish(1).unwrap();
        // The step completes with worker 0's gradient alone.
        assert_eq!(s.params(), &[0.0, 0.0, 0.0]);
        assert_eq!(s.admitted().len(), 1);
        s.finish(0).unwrap();
        assert!(s.all_finished());
    }

    #[test]
    fn misbehaving_workers_are_typed_errors() {
        let mut s = server(2, Staleness::Bounded(1));
        assert!(
            s.push(0, 1, 0, 0.1, vec![0.0; 3]).is_err(),
            "a step skipped"
        );
        assert!(
            s.push(0, 0, 5, 0.1, vec![0.0; 3]).is_err(),
            "a future version"
        );
        assert!(
            s.push(0, 0, 0, 0.1, vec![0.0; 2]).is_err(),
            "a short gradient"
        );
        assert!(s.pull(2, 0).is_err(), "no such worker");
        assert!(s.pull(1, 3).is_err(), "a pull from the future");
        s.finish(1).unwrap();
        assert!(
            s.push(1, 0, 0, 0.1, vec![0.0; 3]).is_err(),
            "after finishing"
        );
    }

    #[test]
    fn a_histogram_counts_merges_and_summarises() {
        let mut h = Histogram::default();
        assert_eq!((h.max(), h.mean()), (None, 0.0));
        h.add(2);
        h.add(0);
        let mut g = Histogram::default();
        g.add(4);
        h.merge(&g);
        assert_eq!(h.counts, vec![1, 0, 1, 0, 1]);
        assert_eq!((h.max(), h.total(), h.mean()), (Some(4), 3, 2.0));
    }

    proptest! {
        #[test]
        fn shards_cover_the_buffer_once(total in 1usize..5000, n in 1usize..64) {
            prop_assume!(n <= total);
            let sh = shards(total, n).unwrap();
            prop_assert_eq!(sh.len(), n);
            prop_assert_eq!(sh[0].start, 0);
            prop_assert_eq!(sh[n - 1].end, total);
            for w in sh.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let (lo, hi) = (sh.iter().map(|r| r.len()).min().unwrap(), sh.iter().map(|r| r.len()).max().unwrap());
            prop_assert!(lo >= 1 && hi - lo <= 1);
        }

        /// Any interleaving of N workers (a random schedule of who moves next) under
        /// bound s: no applied update is staler than s, a pull is answered only when
        /// admitted, and every worker gets through all its steps (no deadlock).
        #[test]
        fn no_update_is_staler_than_the_bound(
            n in 1usize..5,
            s in 0u64..4,
            steps in 1u64..12,
            picks in proptest::collection::vec(0usize..64, 400),
        ) {
            let mut srv = server(n, Staleness::Bounded(s));
            // Per worker: Some(version) once its pull is answered, and its clock.
            let mut have: Vec<Option<u64>> = vec![None; n];
            let mut asked = vec![false; n];
            let mut clock = vec![0u64; n];
            let mut done = vec![false; n];
            let mut picks = picks.into_iter().cycle();
            for _ in 0..100_000 {
                if done.iter().all(|d| *d) { break; }
                let live: Vec<usize> = (0..n).filter(|&w| !done[w] && (have[w].is_some() || !asked[w])).collect();
                prop_assert!(!live.is_empty(), "deadlock: every worker waits");
                let w = live[picks.next().unwrap() % live.len()];
                if clock[w] == steps {
                    srv.finish(w).unwrap();
                    done[w] = true;
                } else if let Some(v) = have[w].take() {
                    srv.push(w, clock[w], v, 0.01, vec![0.5; 3]).unwrap();
                    clock[w] += 1;
                    asked[w] = false;
                } else {
                    asked[w] = true;
                    if let Some(v) = srv.pull(w, clock[w]).unwrap() {
                        prop_assert!(clock[w] <= v + s);
                        have[w] = Some(v);
                    }
                }
                for (p, v) in srv.admitted() {
                    prop_assert!(p.step <= v + s);
                    have[p.worker] = Some(v);
                }
            }
            prop_assert!(done.iter().all(|d| *d));
            let h = srv.histogram();
            prop_assert_eq!(h.total(), n as u64 * steps);
            prop_assert!(h.max().unwrap_or(0) <= s, "histogram {:?} over bound {}", h.counts, s);
        }
    }
}
