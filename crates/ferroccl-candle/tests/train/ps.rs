//! The parameter server (`ferroccl_candle::ps`) on ranks as threads: s = 0 is DDP
//! (bit for bit on one worker, to 1e-5 on 2 and 4 after 50 steps), no update is staler
//! than the bound under random step times, a checkpointed and resumed run is the
//! uninterrupted one, and a failing worker fails every rank without a hang.

use crate::{run, run_all};
use ferroccl::ddp::Rng;
use ferroccl::testing::{all_errors, test_config, Net};
use ferroccl_candle::ddp::Sgd;
use ferroccl_candle::ps::ssp::Staleness;
use ferroccl_candle::ps::{self, Worker};
use ferroccl_candle::trainer::ps::train_ps;
use ferroccl_candle::{train, DataSource, Resume, TrainConfig};
use ferroccl_candle::{Error, Result};
use proptest::prelude::*;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

type Params = Vec<(String, Vec<f32>)>;

fn small(global_batch: usize, steps: u64) -> TrainConfig {
    TrainConfig {
        data: DataSource::Synthetic(1200),
        test_fraction: 0.1,
        epochs: 8,
        max_steps: Some(steps),
        global_batch,
        warmup_steps: 2,
        log_every: 1000,
        ..TrainConfig::default()
    }
}

fn ddp_on(n: usize, cfg: TrainConfig) -> Vec<Params> {
    run(n, Net::Local, &test_config(), DEADLINE, move |c| {
        Ok(train(c, &cfg)?.params)
    })
    .unwrap_or_else(|e| panic!("{n}-rank DDP failed: {e:?}"))
}

fn ps_on(n: usize, cfg: TrainConfig, s: Staleness) -> Vec<ferroccl_candle::trainer::ps::PsTrained> {
    run(n, Net::Local, &test_config(), DEADLINE, move |c| {
        train_ps(c, &cfg, s)
    })
    .unwrap_or_else(|e| panic!("{n}-rank parameter server failed: {e:?}"))
}

/// Largest |a − b| over the largest |b|.
fn relative(a: &Params, b: &Params) -> f32 {
    let (mut d, mut m) = (0.0f32, 0.0f32);
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len());
        for (x, y) in va.iter().zip(vb) {
            d = d.max((x - y).abs());
            m = m.max(y.abs());
        }
    }
    d / m
}

#[test]
fn one_worker_at_s0_reproduces_plain_training_bit_for_bit() {
    let cfg = TrainConfig {
        augment: true,
        weight_decay: 1e-4,
        ..small(16, 12)
    };
    let plain = ddp_on(1, cfg.clone());
    let ps = ps_on(1, cfg.clone(), Staleness::Bounded(0));
    assert_eq!(
        ps[0].params, plain[0],
        "one worker drifted from plain training"
    );
    assert_eq!(ps[0].summary.steps, vec![12]);
    assert_eq!(ps[0].summary.histogram, vec![12], "12 fresh updates");
    // The comparison can fail: fewer steps are other weights.
    assert_ne!(ddp_on(1, small(16, 11))[0], plain[0]);
}

#[test]
fn s0_matches_ddp_on_2_and_4_workers_after_50_steps() {
    for n in [2, 4] {
        let cfg = small(32, 50);
        let ddp = ddp_on(n, cfg.clone());
        let ps = ps_on(n, cfg, Staleness::Bounded(0));
        for r in 1..n {
            assert_eq!(ps[r].params, ps[0].params, "rank {r}'s result differs");
        }
        let rel = relative(&ps[0].params, &ddp[0]);
        assert!(rel <= 1e-5, "{n} workers: relative difference {rel}");
        let s = &ps[0].summary;
        assert_eq!(s.steps, vec![50; n]);
        // Every shard: one fresh update per worker and step.
        assert_eq!(s.histogram, vec![50 * n as u64 * n as u64]);
        assert_eq!(
            s.updates,
            50 * n as u64,
            "one optimizer step per shard and step"
        );
    }
}

#[test]
fn checkpoint_and_resume_at_s0_reproduces_an_uninterrupted_run() {
    let dir = std::env::temp_dir().join(format!("ferroccl-ps-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = TrainConfig {
        augment: true,
        ..small(32, 8)
    };
    let straight = ps_on(2, base.clone(), Staleness::Bounded(0));
    let first = TrainConfig {
        max_steps: Some(5),
        checkpoint_dir: Some(dir.clone()),
        ..base.clone()
    };
    let half = ps_on(2, first, Staleness::Bounded(0));
    assert_eq!(half[0].summary.steps, vec![5, 5]);
    let second = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        resume: Some(Resume::Latest),
        ..base
    };
    let resumed = ps_on(2, second, Staleness::Bounded(0));
    assert_eq!(resumed[0].summary.steps, vec![8, 8]);
    assert_eq!(
        resumed[0].state, straight[0].state,
        "servers' state after resume"
    );
    assert_ne!(half[0].state.params, straight[0].state.params);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A worker whose steps take random times (seeded per rank): its gradient is the
/// parameters themselves plus its rank, a step of a quadratic.
struct Sleepy {
    rng: Rng,
    steps: u64,
    max_ms: u64,
    fail_at: Option<u64>,
}

impl Worker for Sleepy {
    fn wants(&mut self, step: u64) -> bool {
        step < self.steps
    }

    fn gradient(&mut self, step: u64, params: &[f32]) -> Result<(Vec<f32>, f32)> {
        if self.fail_at == Some(step) {
            return Err(Error::invalid("this worker gives up"));
        }
        std::thread::sleep(Duration::from_micros(self.rng.below(self.max_ms * 1000)));
        Ok((params.iter().map(|p| p + 1.0).collect(), 0.01))
    }
}

fn sleepy_run(n: usize, s: Staleness, seed: u64, steps: u64) -> Vec<ps::PsOutcome> {
    run(n, Net::Local, &test_config(), DEADLINE, move |c| {
        let mut w = Sleepy {
            rng: Rng::derive(seed, c.rank() as u64),
            steps,
            // Rank 0 is a straggler, often by far.
            max_ms: if c.rank() == 0 { 6 } else { 2 },
            fail_at: None,
        };
        ps::run(c, vec![1.0; 37], Sgd::new(0.9, 0.0), s, None, &mut w)
    })
    .unwrap_or_else(|e| panic!("{n} workers at staleness {s}: {e:?}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Random step times on threads: no applied update is staler than k, every
    /// worker's every push is applied, and every rank ends with the same state.
    #[test]
    fn no_applied_update_is_staler_than_k_under_random_step_times(
        n in 2usize..5,
        k in 0u64..3,
        seed in any::<u64>(),
    ) {
        let steps = 12;
        let out = sleepy_run(n, Staleness::Bounded(k), seed, steps);
        for o in &out[1..] {
            prop_assert_eq!(o, &out[0]);
        }
        let h = &out[0].histogram;
        prop_assert_eq!(h.total(), n as u64 * steps * n as u64, "pushes applied");
        prop_assert!(h.max().unwrap_or(0) <= k, "histogram {:?} over the bound {}", h.counts, k);
        prop_assert_eq!(&out[0].state.clocks, &vec![steps; n]);
    }
}

#[test]
fn asynchronous_runs_apply_every_push_and_count_stale_ones() {
    let out = sleepy_run(3, Staleness::Unbounded, 7, 20);
    let h = &out[0].histogram;
    assert_eq!(h.total(), 3 * 20 * 3);
    assert_eq!(out[0].updates, 3 * 20 * 3, "one optimizer step per push");
    assert_eq!(out[0].state.clocks, vec![20; 3]);
}

#[test]
fn a_failing_worker_fails_every_rank_and_nothing_hangs() {
    for s in [
        Staleness::Bounded(0),
        Staleness::Bounded(2),
        Staleness::Unbounded,
    ] {
        let errs = all_errors(
            run_all(3, Net::Local, &test_config(), DEADLINE, move |c| {
                let mut w = Sleepy {
                    rng: Rng::derive(1, c.rank() as u64),
                    steps: 1000,
                    max_ms: 1,
                    fail_at: (c.rank() == 1).then_some(3),
                };
                ps::run(c, vec![0.0; 10], Sgd::new(0.0, 0.0), s, None, &mut w)
            }),
            "a worker fails",
        );
        assert!(
            errs[1].to_string().contains("this worker gives up"),
            "{}",
            errs[1]
        );
        for r in [0, 2] {
            let e = errs[r].to_string();
            assert!(e.contains("rank 1"), "staleness {s}: rank {r}: {e}");
        }
    }
}

#[test]
fn shard_counts_that_do_not_fit_are_refused_on_every_rank() {
    let errs = all_errors(
        run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
            let mut w = Sleepy {
                rng: Rng::derive(1, 0),
                steps: 1,
                max_ms: 1,
                fail_at: None,
            };
            ps::run(
                c,
                vec![0.0; 3],
                Sgd::new(0.0, 0.0),
                Staleness::Bounded(0),
                None,
                &mut w,
            )
        }),
        "3 parameters on 4 servers",
    );
    for e in errs {
        assert!(
            e.to_string()
                .contains("3 parameters cannot make 4 non-empty shards"),
            "{e}"
        );
    }
}

#[test]
fn a_straggler_outside_the_job_or_not_slow_is_refused_by_both_trainers() {
    use ferroccl_candle::Straggler;
    for (rank, factor) in [(2, 2.0), (0, 0.5), (1, f64::NAN)] {
        let cfg = TrainConfig {
            straggler: Some(Straggler { rank, factor }),
            ..small(32, 2)
        };
        let ddp_cfg = cfg.clone();
        let ps_errs = all_errors(
            run_all(2, Net::Local, &test_config(), DEADLINE, move |c| {
                train_ps(c, &cfg, Staleness::Bounded(1)).map(|o| o.summary.steps)
            }),
            "a bad straggler, parameter server",
        );
        let ddp_errs = all_errors(
            run_all(2, Net::Local, &test_config(), DEADLINE, move |c| {
                train(c, &ddp_cfg).map(|o| o.summary.steps)
            }),
            "a bad straggler, DDP",
        );
        for e in ps_errs.iter().chain(&ddp_errs) {
            assert!(
                e.to_string().contains(&format!("straggler: rank {rank}")),
                "{e}"
            );
        }
    }
}
