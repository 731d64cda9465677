//! The data-parallel trainer: n ranks reproduce one, stop + resume reproduces an
//! uninterrupted run, bad checkpoints are refused without loss, every rank ends on
//! the same step.

use crate::{run, run_all};
use ferroccl::ddp::metrics::check_same_steps;
use ferroccl::ddp::WireDtype;
use ferroccl::testing::{all_errors, test_config, Net};
use ferroccl_candle::model::Precision;
use ferroccl_candle::Error;
use ferroccl_candle::{train, DataSource, Resume, TrainConfig};
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

fn small(global_batch: usize, steps: u64) -> TrainConfig {
    TrainConfig {
        data: DataSource::Synthetic(480),
        test_fraction: 0.1,
        epochs: 3,
        max_steps: Some(steps),
        global_batch,
        warmup_steps: 2,
        log_every: 1000,
        ..TrainConfig::default()
    }
}

type Params = Vec<(String, Vec<f32>)>;

fn train_on(n: usize, cfg: TrainConfig) -> Vec<Params> {
    run(n, Net::Local, &test_config(), DEADLINE, move |c| {
        Ok(train(c, &cfg)?.params)
    })
    .unwrap_or_else(|e| panic!("{n}-rank training failed: {e:?}"))
}

fn max_diff(a: &Params, b: &Params) -> (f32, f32) {
    let (mut d, mut m) = (0.0f32, 0.0f32);
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            d = d.max((x - y).abs());
            m = m.max(x.abs());
        }
    }
    (d, m)
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-ddp-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn n_ranks_with_batch_over_n_reproduce_one_rank_with_batch_b() {
    let one = train_on(1, small(32, 6));
    for n in [2, 4] {
        let many = train_on(n, small(32, 6));
        // Replicas are bitwise identical to each other...
        for r in 1..n {
            assert_eq!(many[r], many[0], "rank {r} drifted from rank 0");
        }
        // ...and match the single rank up to summation order.
        let (d, m) = max_diff(&one[0], &many[0]);
        assert!(
            d <= 1e-4 * m.max(1.0),
            "{n} ranks vs 1: max |diff| {d} (max |w| {m})"
        );
        assert_ne!(
            one[0],
            train_on(1, small(32, 5))[0],
            "steps must change the weights"
        );
    }
}

#[test]
fn accumulation_and_half_wire_match_plain_steps() {
    let plain = train_on(2, small(32, 4));
    let accum = train_on(
        2,
        TrainConfig {
            accum: 2,
            ..small(32, 4)
        },
    );
    let (d, m) = max_diff(&plain[0], &accum[0]);
    assert!(d <= 1e-4 * m.max(1.0), "accumulation: {d}");
    for wire in [WireDtype::F16, WireDtype::Bf16] {
        let half = train_on(
            2,
            TrainConfig {
                wire,
                ..small(32, 4)
            },
        );
        assert_eq!(half[0], half[1]);
        let (d, m) = max_diff(&plain[0], &half[0]);
        assert!(d > 0.0 && d <= 2e-2 * m.max(1.0), "{wire:?} wire: {d}");
    }
}

#[test]
fn stop_and_resume_reproduces_an_uninterrupted_run() {
    let dir = tempdir("resume");
    let base = TrainConfig {
        augment: true,
        weight_decay: 1e-4,
        ..small(32, 8)
    };
    let straight = train_on(2, base.clone());
    let first = TrainConfig {
        max_steps: Some(4),
        checkpoint_dir: Some(dir.clone()),
        ..base.clone()
    };
    train_on(2, first);
    let second = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        resume: Some(Resume::Latest),
        ..base
    };
    let resumed = train_on(2, second);
    assert_eq!(
        resumed[0], straight[0],
        "resumed run differs from the straight one"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_checkpoint_is_refused_and_the_older_one_survives() {
    let dir = tempdir("corrupt");
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        checkpoint_every: 2,
        ..small(32, 4)
    };
    train_on(2, cfg.clone());
    let newest = dir.join("ckpt-0000000004.fcc");
    let older = dir.join("ckpt-0000000002.fcc");
    let mut b = std::fs::read(&newest).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0xff;
    std::fs::write(&newest, &b).unwrap();
    let resume = TrainConfig {
        resume: Some(Resume::Latest),
        max_steps: Some(6),
        ..cfg.clone()
    };
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, move |c| {
            train(c, &resume).map(|o| o.summary.steps)
        }),
        "resume from a corrupt checkpoint",
    );
    let (path, why) = crate::refused_on_rank0(&errs);
    assert_eq!(path, newest);
    assert!(
        why.contains("checksum") && why.contains("ckpt-0000000002.fcc"),
        "{why}"
    );
    // The older checkpoint is still there, and resuming from it works.
    assert!(older.exists());
    let explicit = TrainConfig {
        resume: Some(Resume::File(older)),
        max_steps: Some(6),
        checkpoint_dir: None,
        ..cfg
    };
    let steps = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        Ok(train(c, &explicit)?.summary.steps)
    })
    .unwrap();
    assert_eq!(steps, vec![6, 6]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_of_another_shape_is_refused() {
    let dir = tempdir("shape");
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        ..small(32, 2)
    };
    train_on(1, cfg.clone());
    let wider = TrainConfig {
        width: 2,
        resume: Some(Resume::Latest),
        ..cfg
    };
    let e = run(1, Net::Local, &test_config(), DEADLINE, move |c| {
        train(c, &wider).map(|_| ())
    })
    .unwrap_err();
    assert!(
        e.message.contains("width 1") && e.message.contains("same shape"),
        "{}",
        e.message
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_ending_on_different_steps_are_caught() {
    let errs = all_errors(
        run_all(3, Net::Local, &test_config(), DEADLINE, |c| {
            let r = c.rank() as u64;
            Ok(check_same_steps(c, 10 + r / 2)?)
        }),
        "unequal steps",
    );
    assert!(
        errs[0].to_string().contains("between 10 and 11"),
        "{}",
        errs[0]
    );
    let ok = run(3, Net::Local, &test_config(), DEADLINE, |c| {
        Ok(check_same_steps(c, 7)?)
    })
    .unwrap();
    assert_eq!(ok.len(), 3);
}

#[test]
fn every_rank_ends_on_the_same_step_and_learns() {
    let out = run(2, Net::Local, &test_config(), DEADLINE, |c| {
        let cfg = TrainConfig {
            epochs: 6,
            max_steps: None,
            base_lr: 0.1,
            ..small(32, 0)
        };
        Ok(train(c, &cfg)?.summary)
    })
    .unwrap();
    // 432 training images, 216 per rank, 16 per rank per step: 13 steps an epoch.
    // Chance is 10%; this run reaches about 85%.
    assert_eq!(out[0].steps, 78);
    assert_eq!(out[1].steps, 78);
    assert!(
        out[0].test_accuracy > 0.4,
        "accuracy {}",
        out[0].test_accuracy
    );
    assert!(out[0].images_per_s > 0.0);
}

#[test]
fn fp16_overflow_skips_steps_and_lowers_the_scale() {
    let out = run(2, Net::Local, &test_config(), DEADLINE, |c| {
        let cfg = TrainConfig {
            precision: Precision::F16,
            // f16 tops out at 65504 and the logits' gradient is about scale / 16
            // here: 2^24 overflows, and a few halvings later steps apply.
            loss_scale: 16_777_216.0,
            ..small(32, 12)
        };
        let o = train(c, &cfg)?;
        Ok((o.summary, o.params))
    })
    .unwrap();
    let (s, p) = &out[0];
    assert!(s.skipped_steps >= 1, "no step was skipped: {s:?}");
    assert!(s.skipped_steps < 12, "every step was skipped: {s:?}");
    assert_eq!(out[1].1, *p, "ranks skipped different steps");
    assert!(p.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
}

#[test]
fn divergence_stops_every_rank_with_a_clear_error() {
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let cfg = TrainConfig {
                base_lr: 1e30,
                warmup_steps: 0,
                ..small(32, 20)
            };
            train(c, &cfg).map(|o| o.summary.steps)
        }),
        "a learning rate of 1e30",
    );
    for e in errs {
        match e {
            Error::Train(ferroccl::ddp::TrainError::Diverged { step, why }) => {
                assert!(step < 20);
                assert!(why.contains("lower --lr"), "{why}");
            }
            e => panic!("{e}"),
        }
    }
}

/// The loss a run ends with is its final step's, the same whatever `log_every` (the
/// logged window's mean is reported beside it, with the steps it covers).
#[test]
fn the_final_loss_does_not_depend_on_log_every() {
    let summary = |log_every: u64| {
        let cfg = TrainConfig {
            log_every,
            ..small(32, 6)
        };
        run(2, Net::Local, &test_config(), DEADLINE, move |c| {
            Ok(train(c, &cfg)?.summary)
        })
        .unwrap_or_else(|e| panic!("training failed: {e:?}"))
        .remove(0)
    };
    let (a, b) = (summary(1), summary(4));
    assert!(
        a.step_loss.is_finite() && a.step_loss > 0.0,
        "{}",
        a.step_loss
    );
    assert_eq!(a.step_loss.to_bits(), b.step_loss.to_bits());
    assert_eq!((a.final_loss_steps, b.final_loss_steps), (1, 2));
    // The windows differ (one step vs the mean of the last two).
    assert_ne!(a.final_loss.to_bits(), b.final_loss.to_bits());
    assert_eq!(a.final_loss.to_bits(), a.step_loss.to_bits());
}
