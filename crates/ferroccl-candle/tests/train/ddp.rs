//! `ferroccl_candle::ddp::Ddp` through its public API on a small candle model: rank 0's
//! weights reach every rank, buckets run from the last parameter, `no_sync`
//! accumulation equals one bigger batch, f16 on the wire stays close, checkpoints
//! resume bit for bit and refuse another model, overflowed steps are skipped and
//! non-finite gradients stop every rank. Every run has a deadline.

use crate::{run, run_all};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use ferroccl::ddp::checkpoint::{Checkpoint, Tensor as CkptTensor};
use ferroccl::ddp::CheckpointDir;
use ferroccl::testing::{all_errors, test_config, Net};
use ferroccl::Communicator;
use ferroccl_candle::ddp::{Ddp, DdpConfig, LossScaler, Rng, Sgd, WireDtype};
use ferroccl_candle::{Error, Result};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);

type Weights = Vec<(String, Vec<f32>)>;

/// 6 → 5 → 3, ReLU between.
struct Net2 {
    a: Linear,
    b: Linear,
}

impl Module for Net2 {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply(&self.a)?.relu()?.apply(&self.b)
    }
}

fn model() -> (VarMap, Net2) {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let m = Net2 {
        a: linear(6, 5, vb.pp("a")).expect("layer a"),
        b: linear(5, 3, vb.pp("b")).expect("layer b"),
    };
    (vm, m)
}

/// 64 fixed samples; `batch(step, lo, hi)` is samples lo..hi of step `step`'s 16.
fn batch(step: u64, lo: usize, hi: usize) -> (Tensor, Tensor) {
    let mut rng = Rng::derive(99, step);
    let x: Vec<f32> = (0..16 * 6).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
    let y: Vec<u32> = (0..16)
        .map(|k| (x[k * 6] > 0.0) as u32 + (x[k * 6 + 1] > 0.3) as u32)
        .collect();
    let x = Tensor::from_vec(x[lo * 6..hi * 6].to_vec(), (hi - lo, 6), &Device::Cpu).expect("x");
    let y = Tensor::from_vec(y[lo..hi].to_vec(), hi - lo, &Device::Cpu).expect("y");
    (x, y)
}

fn loss(m: &Net2, x: &Tensor, y: &Tensor) -> Tensor {
    candle_nn::loss::cross_entropy(&m.forward(x).expect("forward"), y).expect("loss")
}

/// `steps` optimizer steps of 16 samples over the communicator's ranks (each its
/// contiguous share), with `accum` micro-batches per step.
fn train(
    ddp: &mut Ddp<'_, Sgd>,
    m: &Net2,
    c: &Communicator,
    steps: std::ops::Range<u64>,
    accum: usize,
) -> Result<()> {
    let share = 16 / c.world_size();
    let micro = share / accum;
    for s in steps {
        for a in 0..accum {
            let lo = c.rank() * share + a * micro;
            let (x, y) = batch(s, lo, lo + micro);
            let l = (loss(m, &x, &y) / accum as f64).expect("scale");
            if a + 1 < accum {
                ddp.backward_no_sync(&l)?;
            } else {
                ddp.backward(&l)?;
            }
        }
        ddp.step(0.2)?;
    }
    Ok(())
}

fn max_diff(a: &Weights, b: &Weights) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// Rank 0 starts from `init` (when given), then `Ddp::new` hands its weights to all.
fn start_from<'c>(
    c: &'c Communicator,
    vm: &VarMap,
    init: Option<&Weights>,
    cfg: DdpConfig,
) -> Result<Ddp<'c, Sgd>> {
    if let (Some(w), 0) = (init, c.rank()) {
        let vars = vm.data().lock().expect("varmap lock");
        for (name, v) in w {
            let t = Tensor::from_slice(v, vars[name].dims(), &Device::Cpu).expect("tensor");
            vars[name].set(&t).expect("set");
        }
    }
    Ddp::new(c, vm, Sgd::new(0.9, 0.0), cfg)
}

#[test]
fn rank0_weights_reach_every_rank_and_replicas_stay_equal() {
    let out = run(3, Net::Local, &test_config(), DEADLINE, |c| {
        let (vm, m) = model();
        let before: Vec<f32> = vm
            .all_vars()
            .iter()
            .flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect();
        // Elements: a.bias 5, a.weight 30, b.bias 3, b.weight 15. The first bucket (60 B =
        // 15 elements) holds b.weight alone; the next (140 B = 35) b.bias and a.weight
        // (33) but not a.bias too (38).
        let cfg = DdpConfig {
            first_bucket_bytes: 60,
            bucket_bytes: 140,
            wire: WireDtype::F32,
        };
        let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 1e-4), cfg)?;
        let plan: Vec<Vec<usize>> = ddp
            .bucket_plan()
            .buckets
            .iter()
            .map(|b| b.params.clone())
            .collect();
        let start = ddp.weights();
        train(&mut ddp, &m, c, 0..4, 1)?;
        Ok((before, start, ddp.weights(), plan))
    })
    .expect("3 ranks");
    // Names sorted: a.bias, a.weight, b.bias, b.weight; buckets from the last.
    assert_eq!(out[0].3, vec![vec![3], vec![2, 1], vec![0]]);
    assert_ne!(out[1].0, out[0].0, "candle's random init differs per rank");
    for r in 1..3 {
        assert_eq!(
            out[r].1, out[0].1,
            "rank {r} did not start from rank 0's weights"
        );
        assert_eq!(out[r].2, out[0].2, "rank {r} drifted from rank 0");
    }
    assert_ne!(out[0].2, out[0].1, "steps must change the weights");
}

/// 2 ranks × 8 samples, 4 ranks × 4, and 2 ranks × (2 micro-batches of 4 through
/// no_sync) all reproduce 1 rank × 16 from the same start.
#[test]
fn n_ranks_and_no_sync_reproduce_one_rank() {
    let go = move |n: usize, accum: usize, init: Option<Weights>| {
        run(n, Net::Local, &test_config(), DEADLINE, move |c| {
            let (vm, m) = model();
            let mut ddp = start_from(c, &vm, init.as_ref(), DdpConfig::default())?;
            let w0 = ddp.weights();
            train(&mut ddp, &m, c, 0..6, accum)?;
            Ok((w0, ddp.weights()))
        })
        .expect("run")
        .remove(0)
    };
    let (w0, one) = go(1, 1, None);
    for (n, accum) in [(2, 1), (4, 1), (2, 2)] {
        let (s, w) = go(n, accum, Some(w0.clone()));
        assert_eq!(s, w0);
        let d = max_diff(&one, &w);
        assert!(d <= 1e-5, "{n} ranks × {accum} micro-batches: {d}");
    }
    let (_, fewer) = go(1, 1, Some(w0.clone()));
    assert_eq!(
        fewer, one,
        "one rank twice from the same start is bitwise the same"
    );
}

#[test]
fn half_precision_on_the_wire_is_close_to_f32() {
    let go = |wire: WireDtype, init: Option<Weights>| {
        run(2, Net::Local, &test_config(), DEADLINE, move |c| {
            let (vm, m) = model();
            let cfg = DdpConfig {
                wire,
                ..DdpConfig::default()
            };
            let mut ddp = start_from(c, &vm, init.as_ref(), cfg)?;
            let w0 = ddp.weights();
            train(&mut ddp, &m, c, 0..4, 1)?;
            Ok((w0, ddp.weights()))
        })
        .expect("run")
        .remove(0)
    };
    let (w0, full) = go(WireDtype::F32, None);
    let moved = max_diff(&w0, &full);
    for wire in [WireDtype::F16, WireDtype::Bf16] {
        let (s, half) = go(wire, Some(w0.clone()));
        assert_eq!(s, w0);
        let d = max_diff(&full, &half);
        // Rounded on the wire, so not equal, but far closer than the distance moved.
        // bf16 keeps 8 bits of mantissa (f16 11): its rounding, over four steps from
        // an unseeded start, has come to 5.1% of the distance moved (0.0197 of 0.386).
        let bound = if wire == WireDtype::Bf16 { 0.1 } else { 0.05 };
        assert!(
            d > 0.0 && d <= bound * moved,
            "{wire:?}: {d} (moved {moved})"
        );
    }
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-candle-ddp-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn checkpoint_and_restore_resume_bit_for_bit() {
    let dir = tempdir("resume");
    let d2 = dir.clone();
    let out = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let (vm, m) = model();
        let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 1e-3), DdpConfig::default())?;
        let start = ddp.weights();
        train(&mut ddp, &m, c, 0..3, 1)?;
        let ck = ddp.snapshot(serde_json::json!({"step": 3}));
        if c.rank() == 0 {
            CheckpointDir::new(&d2, 2)?.save(3, &ck)?;
        }
        train(&mut ddp, &m, c, 3..6, 1)?;
        let straight = ddp.weights();
        c.barrier()?;

        // A fresh replica (other random weights, zero momentum) resumes at step 3.
        let (vm2, m2) = model();
        let mut again = Ddp::new(c, &vm2, Sgd::new(0.9, 1e-3), DdpConfig::default())?;
        let loaded = if c.rank() == 0 {
            CheckpointDir::new(&d2, 2)?.load_latest()
        } else {
            Ok(None)
        };
        let state = again.restore(loaded)?;
        train(&mut again, &m2, c, 3..6, 1)?;
        Ok((start, straight, again.weights(), state))
    })
    .expect("2 ranks");
    for (r, (start, straight, resumed, state)) in out.iter().enumerate() {
        assert_eq!(
            state.as_ref().map(|s| s["step"].clone()),
            Some(serde_json::json!(3)),
            "rank {r}"
        );
        assert_eq!(resumed, straight, "rank {r}: the resumed run differs");
        assert_ne!(straight, start);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restore_refuses_another_model_on_every_rank_and_changes_nothing() {
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let (vm, _m) = model();
            let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 0.0), DdpConfig::default())?;
            let before = ddp.weights();
            let mut ck: Checkpoint = ddp.snapshot(serde_json::json!({}));
            ck.tensors[0] = CkptTensor {
                name: ck.tensors[0].name.clone(),
                shape: vec![7],
                data: vec![0.0; 7],
            };
            let loaded = Ok((c.rank() == 0).then(|| ("other.ckpt".into(), ck)));
            let r = ddp.restore(loaded);
            assert_eq!(
                ddp.weights(),
                before,
                "a refused checkpoint changed the weights"
            );
            r.map(|_| ())
        }),
        "a checkpoint of another shape",
    );
    let (path, why) = crate::refused_on_rank0(&errs);
    assert!(
        path.ends_with("other.ckpt") && why.contains("shape [7]"),
        "{why}"
    );
}

#[test]
fn overflowed_scaled_steps_are_skipped_and_nonfinite_plain_steps_stop_every_rank() {
    let out = run(2, Net::Local, &test_config(), DEADLINE, |c| {
        let (vm, m) = model();
        let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 0.0), DdpConfig::default())?;
        let before = ddp.weights();
        let mut scaler = LossScaler::new(65536.0, 100);
        let (x, y) = batch(0, c.rank() * 8, c.rank() * 8 + 8);
        // An overflow on rank 1 only: the averaged gradients overflow on both.
        let blow_up = if c.rank() == 1 { f64::INFINITY } else { 1.0 };
        ddp.backward(&(loss(&m, &x, &y) * blow_up).expect("scale"))?;
        let skipped = ddp.step_scaled(0.1, &mut scaler)?;
        let after_skip = ddp.weights();
        ddp.backward(&(loss(&m, &x, &y) * scaler.scale as f64).expect("scale"))?;
        let applied = ddp.step_scaled(0.1, &mut scaler)?;
        Ok((
            skipped.applied,
            after_skip == before,
            applied.applied,
            scaler.scale,
            scaler.skipped,
            ddp.weights() != before,
        ))
    })
    .expect("2 ranks");
    for o in &out {
        assert_eq!(*o, (false, true, true, 32768.0, 1, true));
    }
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let (vm, m) = model();
            let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 0.0), DdpConfig::default())?;
            let (x, y) = batch(0, 0, 8);
            ddp.backward(&(loss(&m, &x, &y) * f64::INFINITY).expect("scale"))?;
            ddp.step(0.1).map(|_| ())
        }),
        "infinite gradients",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Train(ferroccl::ddp::TrainError::Diverged { step: 0, why }) if why.contains("inf or NaN")),
            "{e}"
        );
    }
}

/// Stepping on gradients that were only accumulated would move each replica its own
/// way: refused, and the step after the synchronising backward goes through.
#[test]
fn a_step_after_no_sync_alone_is_refused() {
    let out = run(2, Net::Local, &test_config(), DEADLINE, |c| {
        let (vm, m) = model();
        let mut ddp = Ddp::new(c, &vm, Sgd::new(0.9, 0.0), DdpConfig::default())?;
        let (x, y) = batch(0, c.rank() * 8, c.rank() * 8 + 8);
        ddp.backward_no_sync(&loss(&m, &x, &y))?;
        let refused = ddp.step(0.1).map(|_| ()).unwrap_err().to_string();
        ddp.backward(&loss(&m, &x, &y))?;
        ddp.step(0.1)?;
        Ok((refused, ddp.weights()))
    })
    .expect("2 ranks");
    assert!(out[0].0.contains("backward_no_sync"), "{}", out[0].0);
    assert_eq!(out[0].1, out[1].1);
}

/// The book's "DDP in your candle model" page shows examples/my_trainer.rs from its
/// first `use` to its end (the region `tools/book-crate` builds as a new crate), and its
/// Cargo.toml names only ferroccl-candle. The examples' shared loop is the same loop.
#[test]
fn the_book_shows_the_examples_code() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let body = crate::book_shows("training/ddp.md", "examples/my_trainer.rs", "program");
    let program =
        std::fs::read_to_string(root.join("examples/my_trainer.rs")).expect("my_trainer.rs");
    assert!(body.starts_with("use ferroccl_candle"), "{body}");
    assert!(
        program.trim_end().ends_with("// ANCHOR_END: program"),
        "my_trainer.rs goes on after the program the book shows"
    );
    let page = std::fs::read_to_string(root.join("../../docs/book/src/training/ddp.md"))
        .expect("the page");
    let toml = page
        .split_once("<!-- book-crate: Cargo.toml -->\n```toml\n")
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .map(|(b, _)| b)
        .expect("the page's Cargo.toml block");
    assert!(
        toml.contains(
            "[dependencies]\nferroccl-candle = { path = \"../ferroccl/crates/ferroccl-candle\" }\n"
        ),
        "{toml}"
    );
    // The examples' loop (examples/common) is the book's, but for the names the
    // examples take from their arguments.
    let src =
        std::fs::read_to_string(root.join("examples/common/mod.rs")).expect("examples/common");
    for line in [
        "let mut ddp = Ddp::new(",
        "ddp.backward_no_sync(&loss)?; // gradients accumulate, nothing sent",
        "ddp.backward(&loss)?; // buckets all-reduced in the background",
        "ddp.step(lr.at(step))?; // each bucket's parameters stepped once it is reduced",
    ] {
        assert!(src.contains(line) && body.contains(line), "{line}");
    }
}
