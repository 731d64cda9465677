//! `ferroccl_candle::pipeline` and `ferroccl_candle::zero` through their public API:
//! P stages × M micro-batches under GPipe and 1F1B train to the weights of one process
//! running the whole model on the same global batch; ZeRO-1 with Adam ends where plain
//! `Ddp` with Adam does, holding 1/N of the optimizer state; 2 stages × 2 replicas
//! match one process too; checkpoints of sharded state resume bit for bit and refuse
//! another layout; and misuse (a stage count that does not divide the job, a batch the
//! micro-batches do not divide, a shape the next stage does not expect, a stage that
//! dies) is a typed error on every rank. Every run has a deadline.

use crate::{run, run_all};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use ferroccl::ddp::CheckpointDir;
use ferroccl::testing::{all_errors, test_config, Net};
use ferroccl::Communicator;
use ferroccl_candle::ddp::{Adam, Ddp, DdpConfig, Optimizer, Rng, Sgd};
use ferroccl_candle::pipeline::{Layout, Pipeline, PipelineConfig, Schedule};
use ferroccl_candle::zero::Zero;
use ferroccl_candle::{Error, Result};
use std::ops::Range;
use std::time::Duration;

use crate::rel_diff;

const DEADLINE: Duration = Duration::from_secs(120);
/// Widths of the 4-layer MLP: 6 → 12 → 12 → 12 → 3, tanh between.
const DIMS: [usize; 5] = [6, 12, 12, 12, 3];
const BATCH: usize = 32;
const STEPS: u64 = 50;
const LR: f64 = 0.05;

type Weights = Vec<(String, Vec<f32>)>;

/// Layers `layers` of the MLP, each a linear layer (tanh after all but the last).
struct Layers {
    fcs: Vec<(Linear, bool)>,
}

impl Module for Layers {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = x.clone();
        for (fc, act) in &self.fcs {
            x = x.apply(fc)?;
            if *act {
                x = x.tanh()?;
            }
        }
        Ok(x)
    }
}

/// The layers `layers` with fixed weights (layer i from seed i, whatever the split),
/// and their variables in forward order.
fn layers(layers: Range<usize>) -> (Layers, Vec<(String, Var)>) {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let mut fcs = Vec::new();
    let mut vars = Vec::new();
    for i in layers {
        let fc = linear(DIMS[i], DIMS[i + 1], vb.pp(format!("l{i}"))).expect("layer");
        let data = vm.data().lock().expect("varmap");
        let mut rng = Rng::derive(1234, i as u64);
        for part in ["weight", "bias"] {
            let name = format!("l{i}.{part}");
            let v = data[&name].clone();
            let n = v.elem_count();
            let bound = 1.0 / (DIMS[i] as f32).sqrt();
            let w: Vec<f32> = (0..n)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect();
            v.set(&Tensor::from_vec(w, v.dims(), &Device::Cpu).expect("t"))
                .expect("set");
            vars.push((name, v));
        }
        fcs.push((fc, i + 1 < DIMS.len() - 1));
    }
    (Layers { fcs }, vars)
}

/// Step `step`'s global batch of `BATCH` samples: rows `rows` of it.
fn batch(step: u64, rows: Range<usize>) -> (Tensor, Tensor) {
    let mut rng = Rng::derive(77, step);
    let x: Vec<f32> = (0..BATCH * DIMS[0])
        .map(|_| rng.next_f32() * 2.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..BATCH)
        .map(|k| (x[k * 6] + x[k * 6 + 1] > 0.0) as u32 + (x[k * 6 + 2] > 0.4) as u32)
        .collect();
    let n = rows.len();
    let x = Tensor::from_vec(
        x[rows.start * 6..rows.end * 6].to_vec(),
        (n, 6),
        &Device::Cpu,
    )
    .expect("x");
    let y = Tensor::from_vec(y[rows].to_vec(), n, &Device::Cpu).expect("y");
    (x, y)
}

/// The reference: one process, the whole model, the whole batch, plain `Ddp`.
fn reference<O: Optimizer + Send + 'static>(
    opt: impl Fn() -> O + Send + Sync + 'static,
) -> Weights {
    run(1, Net::Local, &test_config(), DEADLINE, move |c| {
        let (model, vars) = layers(0..DIMS.len() - 1);
        let mut ddp = Ddp::from_vars(c, vars, opt(), DdpConfig::default())?;
        for s in 0..STEPS {
            let (x, y) = batch(s, 0..BATCH);
            let l =
                candle_nn::loss::cross_entropy(&model.forward(&x).expect("fwd"), &y).expect("loss");
            ddp.backward(&l)?;
            ddp.step(LR)?;
        }
        Ok(ddp.weights())
    })
    .expect("reference")
    .remove(0)
}

fn loss_fn(
    step: u64,
    offset: usize,
) -> impl Fn(&Tensor, Range<usize>) -> candle_core::Result<Tensor> {
    move |out: &Tensor, rows: Range<usize>| {
        let (_, y) = batch(step, offset + rows.start..offset + rows.end);
        candle_nn::loss::cross_entropy(out, &y)
    }
}

/// This rank's stage of a `stages`-stage split (layers divided evenly).
fn stage_of(stage: usize, stages: usize) -> (Layers, Vec<(String, Var)>, usize) {
    let per = (DIMS.len() - 1) / stages;
    let (m, v) = layers(stage * per..(stage + 1) * per);
    (m, v, DIMS[stage * per])
}

/// Trains `STEPS` steps on a pipeline of `comm`'s ranks (each replica of a 2-D layout
/// on its share of the batch), checking each step's peak of live activations; returns
/// this rank's stage weights, tagged by stage.
fn train_pipeline<O: Optimizer>(
    pipe: &Communicator,
    data: Option<&Communicator>,
    cfg: PipelineConfig,
    opt: O,
) -> Result<(usize, Weights)> {
    let (s, p) = (pipe.rank(), pipe.world_size());
    let (module, vars, width) = stage_of(s, p);
    let mut pl = Pipeline::from_vars(pipe, data, module, vars, &[width], opt, cfg)?;
    let (replicas, replica) = data.map_or((1, 0), |d| (d.world_size(), d.rank()));
    let share = BATCH / replicas;
    let rows = replica * share..(replica + 1) * share;
    for step in 0..STEPS {
        let (x, _) = batch(step, rows.clone());
        let input = (s == 0).then_some(&x);
        let r = pl.step(share, input, &loss_fn(step, rows.start), LR)?;
        // GPipe holds every micro-batch; 1F1B at most p − s of them.
        let m = cfg.micro_batches;
        let want = match cfg.schedule {
            Schedule::GPipe => m,
            Schedule::OneFOneB => (p - s).min(m),
        };
        if r.peak_live != want {
            return Err(Error::invalid(format!(
                "{:?} stage {s}: {} live micro-batches at most, not {want}",
                cfg.schedule, r.peak_live
            )));
        }
    }
    Ok((s, pl.weights()))
}

fn gather_stages(out: Vec<(usize, Weights)>, stages: usize) -> Weights {
    (0..stages)
        .flat_map(|s| {
            out.iter()
                .find(|(t, _)| *t == s)
                .expect("every stage reported")
                .1
                .clone()
        })
        .collect()
}

fn sgd() -> Sgd {
    Sgd::new(0.9, 1e-4)
}

#[test]
fn gpipe_and_1f1b_match_one_process_and_repeat_bit_for_bit() {
    let want = reference(sgd);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for p in [2usize, 4] {
            for m in [1usize, 4, 8] {
                let cfg = PipelineConfig {
                    schedule,
                    micro_batches: m,
                    zero: false,
                };
                let go = || {
                    let out = run(p, Net::Local, &test_config(), DEADLINE, move |c| {
                        train_pipeline(c, None, cfg, sgd())
                    })
                    .expect("pipeline");
                    gather_stages(out, p)
                };
                let got = go();
                let d = rel_diff(&got, &want);
                assert!(d <= 1e-5, "{schedule:?} p={p} m={m}: relative {d}");
                assert_eq!(go(), got, "{schedule:?} p={p} m={m}: a second run differs");
            }
        }
    }
}

#[test]
fn two_stages_by_two_replicas_with_zero_match_one_process() {
    let want = reference(sgd);
    for (schedule, zero) in [(Schedule::OneFOneB, true), (Schedule::GPipe, false)] {
        let cfg = PipelineConfig {
            schedule,
            micro_batches: 4,
            zero,
        };
        let go = || {
            run(4, Net::Local, &test_config(), DEADLINE, move |c| {
                let l = Layout::split(c, 2)?;
                train_pipeline(&l.pipe, Some(&l.data), cfg, sgd())
            })
            .expect("2 x 2")
        };
        let out = go();
        // Ranks 0, 1 are replica 0's stages; 2, 3 replica 1's: replicas agree bitwise.
        assert_eq!(out[0].1, out[2].1, "stage 0's replicas differ");
        assert_eq!(out[1].1, out[3].1, "stage 1's replicas differ");
        let got = gather_stages(out, 2);
        let d = rel_diff(&got, &want);
        assert!(d <= 1e-5, "2 x 2 {schedule:?} zero={zero}: relative {d}");
        assert_eq!(
            gather_stages(go(), 2),
            got,
            "2 x 2 {schedule:?}: a second run differs"
        );
    }
}

/// `steps` of data-parallel training on `c` with Adam: each rank its share of 32.
fn zero_or_ddp(
    c: &Communicator,
    zero: Option<bool>,
    steps: Range<u64>,
) -> Result<(Weights, usize)> {
    let n = c.world_size();
    let share = BATCH / n;
    let (model, vars) = layers(0..DIMS.len() - 1);
    let rows = |s: u64| batch(s, c.rank() * share..(c.rank() + 1) * share);
    let loss = |s: u64| {
        let (x, y) = rows(s);
        candle_nn::loss::cross_entropy(&model.forward(&x).expect("fwd"), &y).expect("loss")
    };
    match zero {
        Some(sharded) => {
            let mut z = Zero::new(Some(c), vars, Adam::adamw(1e-2), sharded)?;
            for s in steps {
                z.backward(&loss(s))?;
                z.step(1e-3)?;
            }
            Ok((z.weights(), z.optimizer_state_bytes()))
        }
        None => {
            let mut d = Ddp::from_vars(c, vars, Adam::adamw(1e-2), DdpConfig::default())?;
            for s in steps {
                d.backward(&loss(s))?;
                d.step(1e-3)?;
            }
            Ok((d.weights(), 0))
        }
    }
}

#[test]
fn zero1_with_adam_ends_where_ddp_with_adam_does_on_a_shard_of_the_state() {
    let total: usize = (0..DIMS.len() - 1)
        .map(|i| DIMS[i] * DIMS[i + 1] + DIMS[i + 1])
        .sum();
    for n in [2usize, 4] {
        let go = move |zero: Option<bool>| {
            run(n, Net::Local, &test_config(), DEADLINE, move |c| {
                zero_or_ddp(c, zero, 0..STEPS)
            })
            .expect("run")
        };
        let ddp = go(None);
        let zero = go(Some(true));
        let whole = go(Some(false));
        for r in 0..n {
            let d = rel_diff(&zero[r].0, &ddp[0].0);
            assert!(d <= 1e-6, "ZeRO-1 n={n} rank {r}: relative {d} from Ddp");
            assert_eq!(zero[r].0, zero[0].0, "rank {r} differs");
            // Two moments of f32 over the shard, plus the step counter.
            assert_eq!(zero[r].1, total.div_ceil(n) * 8 + 8, "n={n} rank {r}");
            assert_eq!(whole[r].1, total.div_ceil(n) * n * 8 + 8);
        }
    }
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-candle-pipe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn sharded_checkpoints_resume_bit_for_bit_on_n_ranks_and_on_another_n() {
    let dir = tempdir("zero");
    let d2 = dir.clone();
    // 2 ranks: 5 steps, checkpoint, 5 more.
    let straight = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let (model, vars) = layers(0..DIMS.len() - 1);
        let mut z = Zero::new(Some(c), vars, Adam::new(0.0), true)?;
        let train = |z: &mut Zero<'_, Adam>, steps: Range<u64>| -> Result<()> {
            for s in steps {
                let (x, y) = batch(s, c.rank() * 16..(c.rank() + 1) * 16);
                z.backward(
                    &candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap(),
                )?;
                z.step(1e-2)?;
            }
            Ok(())
        };
        train(&mut z, 0..5)?;
        if let Some(ck) = z.snapshot(serde_json::json!({"step": 5}))? {
            CheckpointDir::new(&d2, 2)?.save(5, &ck)?;
        }
        train(&mut z, 5..10)?;
        let straight = z.weights();
        c.barrier()?;
        // A fresh one (zero moments, step 0) resumes at step 5.
        let (model2, vars2) = layers(0..DIMS.len() - 1);
        let mut again = Zero::new(Some(c), vars2, Adam::new(0.0), true)?;
        let loaded = if c.rank() == 0 {
            CheckpointDir::new(&d2, 2)?.load_latest()
        } else {
            Ok(None)
        };
        let state = again.restore(loaded)?;
        assert_eq!(again.optimizer().steps(), 5);
        for s in 5..10 {
            let (x, y) = batch(s, c.rank() * 16..(c.rank() + 1) * 16);
            again.backward(
                &candle_nn::loss::cross_entropy(&model2.forward(&x).unwrap(), &y).unwrap(),
            )?;
            again.step(1e-2)?;
        }
        Ok((straight, again.weights(), state))
    })
    .expect("2 ranks");
    for (r, (straight, resumed, state)) in out_iter(&straight) {
        assert_eq!(resumed, straight, "rank {r}: resumed differs");
        assert_eq!(
            state.as_ref().map(|s| s["step"].clone()),
            Some(serde_json::json!(5))
        );
    }
    // The same checkpoint on 4 ranks: the state is re-cut, and the run goes on close
    // to the 2-rank one (only the order of the gradient sums differs).
    let d3 = dir.clone();
    let four = run(4, Net::Local, &test_config(), DEADLINE, move |c| {
        let (model, vars) = layers(0..DIMS.len() - 1);
        let mut z = Zero::new(Some(c), vars, Adam::new(0.0), true)?;
        let loaded = if c.rank() == 0 {
            CheckpointDir::new(&d3, 2)?.load_latest()
        } else {
            Ok(None)
        };
        z.restore(loaded)?;
        for s in 5..10 {
            let (x, y) = batch(s, c.rank() * 8..(c.rank() + 1) * 8);
            z.backward(&candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap())?;
            z.step(1e-2)?;
        }
        Ok(z.weights())
    })
    .expect("4 ranks");
    let d = rel_diff(&four[0], &straight[0].0);
    assert!(d <= 1e-5, "resumed on 4 ranks: relative {d}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn out_iter<A, B, C>(v: &[(A, B, C)]) -> impl Iterator<Item = (usize, (&A, &B, &C))> {
    v.iter().enumerate().map(|(r, (a, b, c))| (r, (a, b, c)))
}

#[test]
fn a_checkpoint_of_another_stage_is_refused_and_changes_nothing() {
    let dir = tempdir("layout");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let d2 = dir.clone();
    let out = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let (s, p) = (c.rank(), c.world_size());
        let (module, vars, width) = stage_of(s, p);
        let cfg = PipelineConfig::default();
        let mut pl = Pipeline::from_vars(c, None, module, vars, &[width], sgd(), cfg)?;
        let ck = pl
            .snapshot(serde_json::json!({}))?
            .expect("no data group: rank 0 of it");
        ferroccl::ddp::checkpoint::save(&d2.join(format!("stage{s}.ckpt")), &ck)?;
        c.barrier()?;
        let before = pl.weights();
        // Each stage offered the other stage's file.
        let other = d2.join(format!("stage{}.ckpt", 1 - s));
        let r = pl.restore(ferroccl::ddp::checkpoint::load(&other).map(|ck| Some((other, ck))));
        let unchanged = before == pl.weights();
        // Stage 0 offered its own (good) file, stage 1 stage 0's: neither loads.
        let file = d2.join("stage0.ckpt");
        let r2 = pl.restore(ferroccl::ddp::checkpoint::load(&file).map(|ck| Some((file, ck))));
        Ok((
            r.map(|_| ()),
            unchanged,
            r2.map(|_| ()),
            before == pl.weights(),
        ))
    });
    let out = out.expect("2 ranks");
    for (s, (r, unchanged, r2, still)) in out.into_iter().enumerate() {
        match r {
            Err(Error::Train(ferroccl::ddp::TrainError::Checkpoint { why, .. })) => {
                assert!(why.contains("layout"), "{why}")
            }
            other => panic!("stage {s}: {other:?}"),
        }
        assert!(
            unchanged,
            "stage {s}: a refused checkpoint changed the weights"
        );
        match (s, r2) {
            (0, Err(Error::Comm(ferroccl::Error::InvalidArgument(w)))) => {
                assert!(w.contains("another pipeline stage"), "{w}")
            }
            (1, Err(Error::Train(ferroccl::ddp::TrainError::Checkpoint { why, .. }))) => {
                assert!(why.contains("layout"), "{why}")
            }
            (s, other) => panic!("stage {s}, second restore: {other:?}"),
        }
        assert!(still, "stage {s}: a half-restored pipeline");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stage_count_that_does_not_divide_the_job_is_refused_everywhere() {
    let errs = all_errors(
        run_all(3, Net::Local, &test_config(), DEADLINE, |c| {
            Layout::split(c, 2).map(|_| ())
        }),
        "3 ranks, 2 stages",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("do not divide")),
            "{e}"
        );
    }
}

#[test]
fn micro_batches_that_do_not_divide_the_batch_are_refused() {
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let (module, vars, width) = stage_of(c.rank(), 2);
            let cfg = PipelineConfig {
                micro_batches: 3,
                ..PipelineConfig::default()
            };
            let mut pl = Pipeline::from_vars(c, None, module, vars, &[width], sgd(), cfg)?;
            let (x, _) = batch(0, 0..BATCH);
            pl.step(BATCH, Some(&x), &loss_fn(0, 0), LR).map(|_| ())
        }),
        "m=3, batch 32",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("do not divide the batch")),
            "{e}"
        );
    }
}

#[test]
fn a_shape_the_next_stage_does_not_expect_is_a_mismatch() {
    let out = run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
        let (module, vars, width) = stage_of(c.rank(), 2);
        // Stage 1 says it reads 3 × 4 per sample; stage 0 sends 12.
        let in_shape: Vec<usize> = if c.rank() == 1 {
            vec![3, 4]
        } else {
            vec![width]
        };
        let mut pl = Pipeline::from_vars(
            c,
            None,
            module,
            vars,
            &in_shape,
            sgd(),
            PipelineConfig::default(),
        )?;
        let (x, _) = batch(0, 0..BATCH);
        pl.step(BATCH, Some(&x), &loss_fn(0, 0), LR).map(|_| ())
    });
    let errs = all_errors(out, "shape mismatch");
    match &errs[1] {
        Error::Comm(ferroccl::Error::Mismatch { ours, theirs, .. }) => {
            assert!(ours.contains("[32, 3, 4]"), "{ours}");
            assert!(theirs.contains("[32, 12]"), "{theirs}");
        }
        e => panic!("stage 1: {e}"),
    }
    // Stage 0 fails too (stage 1 aborted), rather than waiting for gradients: with a
    // communication error, not a refusal (nor candle's message).
    assert!(
        matches!(&errs[0], Error::Comm(e) if !matches!(e, ferroccl::Error::InvalidArgument(_))),
        "{}",
        errs[0]
    );
}

#[test]
fn a_stage_that_dies_mid_step_fails_every_other_stage() {
    let out = run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
        let (s, p) = (c.rank(), c.world_size());
        let (module, vars, width) = stage_of(s, p);
        let cfg = PipelineConfig {
            schedule: Schedule::OneFOneB,
            micro_batches: 4,
            zero: false,
        };
        let mut pl = Pipeline::from_vars(c, None, module, vars, &[width], sgd(), cfg)?;
        for step in 0..3 {
            let (x, _) = batch(step, 0..BATCH);
            if s == 2 && step == 2 {
                // Stage 2 dies at the start of step 2: its links go with it.
                c.abort_handle().abort();
                return Err(Error::invalid("stage 2 died"));
            }
            pl.step(BATCH, Some(&x), &loss_fn(step, 0), LR)?;
        }
        Ok(())
    });
    let errs = all_errors(out, "a dead stage");
    // Its neighbours saw its links close; stage 0, two hops away, is told the root.
    for s in [0, 1, 3] {
        let e = errs[s].to_string();
        assert!(e.contains("rank 2"), "stage {s} does not name rank 2: {e}");
    }
}

#[test]
fn the_book_shows_the_pipeline_examples_code() {
    crate::book_shows("training/large-models.md", "examples/pipeline.rs", "book");
}

#[test]
fn ddp_with_adam_checkpoints_its_step_count_and_resumes_bit_for_bit() {
    let dir = tempdir("adam");
    let d2 = dir.clone();
    let out = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let (model, vars) = layers(0..DIMS.len() - 1);
        let opt = || Adam::adamw(1e-2);
        let mut ddp = Ddp::from_vars(c, vars, opt(), DdpConfig::default())?;
        let step = |ddp: &mut Ddp<'_, Adam>, m: &Layers, s: u64| -> Result<()> {
            let (x, y) = batch(s, c.rank() * 16..(c.rank() + 1) * 16);
            let l = candle_nn::loss::cross_entropy(&m.forward(&x).expect("fwd"), &y).expect("loss");
            ddp.backward(&l)?;
            ddp.step(1e-2).map(|_| ())
        };
        for s in 0..4 {
            step(&mut ddp, &model, s)?;
        }
        let ck = ddp.snapshot(serde_json::json!({"step": 4}));
        if c.rank() == 0 {
            CheckpointDir::new(&d2, 2)?.save(4, &ck)?;
        }
        for s in 4..8 {
            step(&mut ddp, &model, s)?;
        }
        let straight = ddp.weights();
        c.barrier()?;
        let (model2, vars2) = layers(0..DIMS.len() - 1);
        let mut again = Ddp::from_vars(c, vars2, opt(), DdpConfig::default())?;
        let loaded = if c.rank() == 0 {
            CheckpointDir::new(&d2, 2)?.load_latest()
        } else {
            Ok(None)
        };
        again.restore(loaded)?;
        let t = again.optimizer().steps();
        for s in 4..8 {
            step(&mut again, &model2, s)?;
        }
        Ok((straight, again.weights(), t))
    })
    .expect("2 ranks");
    for (r, (straight, resumed, t)) in out.iter().enumerate() {
        assert_eq!(*t, 4, "rank {r}: Adam's step count was not restored");
        assert_eq!(resumed, straight, "rank {r}: the resumed run differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
