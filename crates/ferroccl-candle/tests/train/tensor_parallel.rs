//! `ferroccl_candle::tensor_parallel` through its public API: a small transformer
//! (self-attention with its heads split, then an MLP block, each with a residual, and a
//! replicated classifier) trained with T = 2 and 4 tensor-parallel ranks alone, and in
//! P × T × D layouts of pipeline stages and replicas (with ZeRO-1 on the replicas),
//! ends within 1e-5 of one process training the whole model in plain candle, and
//! bitwise equal across two runs. Every run has a deadline.

use crate::run;
use candle_core::{Device, Module, Tensor, Var, D};
use candle_nn::Linear;
use ferroccl::testing::{test_config, Net};
use ferroccl::Communicator;
use ferroccl_candle::ddp::{Rng, Sgd};
use ferroccl_candle::pipeline::{Layout, Pipeline, PipelineConfig, Schedule};
use ferroccl_candle::tensor_parallel::{
    gather_whole, Mesh, Shard, Split, TensorGroup, TpMlp, TpSelfAttention,
};
use ferroccl_candle::zero::Zero;
use ferroccl_candle::Result;
use std::ops::Range;
use std::time::Duration;

use crate::rel_diff;

pub(crate) const DEADLINE: Duration = Duration::from_secs(120);
pub(crate) const BATCH: usize = 16;
pub(crate) const SEQ: usize = 4;
pub(crate) const HIDDEN: usize = 8;
pub(crate) const HEADS: usize = 4;
pub(crate) const FFN: usize = 16;
const CLASSES: usize = 3;
const STEPS: u64 = 50;
const LR: f64 = 0.05;

pub(crate) type Weights = Vec<(String, Vec<f32>)>;

/// The whole model's parameters, in forward order: (name, shape, fan-in).
fn shapes() -> Vec<(&'static str, Vec<usize>, usize)> {
    let (h, f) = (HIDDEN, FFN);
    vec![
        ("attn.qkv.weight", vec![3 * h, h], h),
        ("attn.qkv.bias", vec![3 * h], h),
        ("attn.out.weight", vec![h, h], h),
        ("attn.out.bias", vec![h], h),
        ("mlp.up.weight", vec![f, h], h),
        ("mlp.up.bias", vec![f], h),
        ("mlp.down.weight", vec![h, f], f),
        ("mlp.down.bias", vec![h], f),
        ("head.weight", vec![CLASSES, h], h),
        ("head.bias", vec![CLASSES], h),
    ]
}

/// The whole model's weights, drawn from a seed (uniform in ±1/√fan-in), as tensors.
pub(crate) fn whole() -> Vec<Tensor> {
    shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (_, shape, fan_in))| {
            let mut rng = Rng::derive(4321, i as u64);
            let bound = 1.0 / (fan_in as f32).sqrt();
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu).expect("weights")
        })
        .collect()
}

/// Step `step`'s batch: inputs (BATCH, SEQ, HIDDEN) and labels, rows `rows` of it.
pub(crate) fn batch(step: u64, rows: Range<usize>) -> (Tensor, Tensor) {
    let mut rng = Rng::derive(77, step);
    let per = SEQ * HIDDEN;
    let x: Vec<f32> = (0..BATCH * per)
        .map(|_| rng.next_f32() * 2.0 - 1.0)
        .collect();
    let y: Vec<u32> = (0..BATCH)
        .map(|b| {
            let s = &x[b * per..];
            (s[0] + s[HIDDEN + 1] > 0.0) as u32 + (s[2 * HIDDEN + 2] > 0.4) as u32
        })
        .collect();
    let n = rows.len();
    let x = Tensor::from_vec(
        x[rows.start * per..rows.end * per].to_vec(),
        (n, SEQ, HIDDEN),
        &Device::Cpu,
    )
    .expect("x");
    let y = Tensor::from_vec(y[rows].to_vec(), n, &Device::Cpu).expect("y");
    (x, y)
}

/// The one-process model in plain candle, from its whole weights `w`.
fn reference_forward(w: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
    let lin = |x: &Tensor, i: usize| x.broadcast_matmul(&w[i].t()?)?.broadcast_add(&w[i + 1]);
    let (b, s, h) = x.dims3()?;
    let d = h / HEADS;
    let qkv = lin(x, 0)?;
    let heads = |i: usize| {
        qkv.narrow(D::Minus1, i * h, h)?
            .reshape((b, s, HEADS, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
    let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    let att = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?;
    let att = att.transpose(1, 2)?.contiguous()?.reshape((b, s, h))?;
    let a = (x + lin(&att, 2)?)?;
    let m = lin(&lin(&a, 4)?.tanh()?, 6)?;
    let y = (a + m)?;
    lin(&y.mean(1)?, 8)
}

/// One process, the whole model, the whole batch, SGD: the weights after `STEPS`.
pub(crate) fn reference() -> Weights {
    let out = run(1, Net::Local, &test_config(), DEADLINE, |_| {
        let vars: Vec<(String, Var)> = shapes()
            .iter()
            .zip(whole())
            .map(|((n, _, _), t)| (n.to_string(), Var::from_tensor(&t).expect("var")))
            .collect();
        let w: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
        let mut z = Zero::new(None, vars, sgd(), false)?;
        for s in 0..STEPS {
            let (x, y) = batch(s, 0..BATCH);
            let out = reference_forward(&w, &x).expect("forward");
            z.backward(&candle_nn::loss::cross_entropy(&out, &y).expect("loss"))?;
            z.step(LR)?;
        }
        Ok(z.weights())
    })
    .expect("reference")
    .remove(0);
    // Training moved every tensor: agreeing with it is not agreeing with the start.
    let start: Weights = shapes()
        .iter()
        .zip(whole())
        .map(|((n, _, _), t)| (n.to_string(), t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    for ((n, a), (_, b)) in out.iter().zip(&start) {
        let moved = rel_diff(&[(n.clone(), a.clone())], &[(n.clone(), b.clone())]);
        assert!(moved > 1e-3, "{n} moved only {moved} in {STEPS} steps");
    }
    out
}

pub(crate) fn sgd() -> Sgd {
    Sgd::new(0.9, 1e-4)
}

/// Stage 0: x + attention(x).
pub(crate) struct AttnStage(pub(crate) TpSelfAttention);

impl Module for AttnStage {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x + self.0.forward(x)?
    }
}

/// Stage 1: y = x + mlp(x), then the classifier on y's mean over the sequence.
pub(crate) struct MlpHead(pub(crate) TpMlp, Linear);

impl Module for MlpHead {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = (x + self.0.forward(x)?)?;
        self.1.forward(&y.mean(1)?)
    }
}

/// The model's stages held by this rank.
pub(crate) enum Model {
    Attn(AttnStage),
    Rest(MlpHead),
    Whole(AttnStage, MlpHead),
}

impl Module for Model {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Model::Attn(a) => a.forward(x),
            Model::Rest(r) => r.forward(x),
            Model::Whole(a, r) => r.forward(&a.forward(x)?),
        }
    }
}

/// Stage `stage` of `stages` (1 or 2) over `group`, and its parameters' shards.
pub(crate) fn build(
    group: &TensorGroup,
    stage: usize,
    stages: usize,
) -> Result<(Model, Vec<Shard>)> {
    let w = whole();
    let attn = || -> Result<(AttnStage, Vec<Shard>)> {
        let a =
            TpSelfAttention::from_whole(group, HEADS, (&w[0], Some(&w[1])), (&w[2], Some(&w[3])))?;
        let s = a.shards("attn");
        Ok((AttnStage(a), s))
    };
    let rest = || -> Result<(MlpHead, Vec<Shard>)> {
        let m = TpMlp::from_whole(
            group,
            (&w[4], Some(&w[5])),
            Tensor::tanh,
            (&w[6], Some(&w[7])),
        )?;
        let mut s = m.shards("mlp.up", "mlp.down");
        let head: Vec<Var> = [8, 9]
            .iter()
            .map(|&i| Var::from_tensor(&w[i]).expect("var"))
            .collect();
        for (v, name) in head.iter().zip(["head.weight", "head.bias"]) {
            s.push(Shard {
                name: name.into(),
                var: v.clone(),
                whole: v.dims().to_vec(),
                split: Split::Whole,
            });
        }
        let fc = Linear::new(
            head[0].as_tensor().clone(),
            Some(head[1].as_tensor().clone()),
        );
        Ok((MlpHead(m, fc), s))
    };
    Ok(match (stage, stages) {
        (0, 1) => {
            let ((a, mut s), (r, s2)) = (attn()?, rest()?);
            s.extend(s2);
            (Model::Whole(a, r), s)
        }
        (0, _) => {
            let (a, s) = attn()?;
            (Model::Attn(a), s)
        }
        _ => {
            let (r, s) = rest()?;
            (Model::Rest(r), s)
        }
    })
}

fn named(shards: &[Shard]) -> Vec<(String, Var)> {
    shards
        .iter()
        .map(|s| (s.name.clone(), s.var.clone()))
        .collect()
}

/// T tensor-parallel ranks alone, no pipeline: the whole model on each rank, its
/// layers split; the whole weights (gathered) on every rank.
fn tensor_alone(c: &Communicator) -> Result<Weights> {
    let t = c.world_size();
    let layout = Layout::mesh(
        c,
        Mesh {
            pipeline: 1,
            tensor: t,
            data: 1,
        },
    )?;
    let (model, shards) = build(&layout.tensor, 0, 1)?;
    let mut z = Zero::new(None, named(&shards), sgd(), false)?;
    for s in 0..STEPS {
        let (x, y) = batch(s, 0..BATCH);
        let out = model.forward(&x)?;
        let loss = candle_nn::loss::cross_entropy(&out, &y).expect("loss");
        z.backward(&loss)?;
        z.step(LR)?;
    }
    gather_whole(&layout.tensor, &shards)
}

#[test]
fn tensor_parallel_alone_matches_one_process_and_repeats_bit_for_bit() {
    let want = reference();
    for t in [2usize, 4] {
        let go =
            || run(t, Net::Local, &test_config(), DEADLINE, |c| tensor_alone(c)).expect("T ranks");
        let got = go();
        for (r, w) in got.iter().enumerate() {
            assert_eq!(w, &got[0], "T={t}: rank {r} holds other whole weights");
        }
        let d = rel_diff(&got[0], &want);
        eprintln!("T={t}: relative {d}");
        assert!(d <= 1e-5, "T={t}: relative {d} from one process");
        assert!(d > 0.0 || t == 1, "T={t}: no rounding at all is suspicious");
        assert_eq!(go()[0], got[0], "T={t}: a second run differs");
    }
}

/// One rank of a P × T × D layout: trains `STEPS` steps as a pipeline of tensor-
/// parallel stages (each replica its share of the batch); returns its coordinates and
/// its stage's whole weights.
fn train_layout(
    c: &Communicator,
    mesh: Mesh,
    cfg: PipelineConfig,
) -> Result<((usize, usize, usize), Weights)> {
    let l = Layout::mesh(c, mesh)?;
    let (s, p) = (l.pipe.rank(), l.pipe.world_size());
    let (model, shards) = build(&l.tensor, s, p)?;
    let mut pl = Pipeline::from_vars(
        &l.pipe,
        Some(&l.data),
        model,
        named(&shards),
        &[SEQ, HIDDEN],
        sgd(),
        cfg,
    )?
    .with_tensor_group(&l.tensor);
    let share = BATCH / l.data.world_size();
    let rows = l.data.rank() * share..(l.data.rank() + 1) * share;
    for step in 0..STEPS {
        let (x, _) = batch(step, rows.clone());
        let offset = rows.start;
        let loss = move |out: &Tensor, r: Range<usize>| {
            let (_, y) = batch(step, offset + r.start..offset + r.end);
            candle_nn::loss::cross_entropy(out, &y)
        };
        pl.step(share, (s == 0).then_some(&x), &loss, LR)?;
    }
    Ok((
        (s, l.tensor.rank(), l.data.rank()),
        gather_whole(&l.tensor, &shards)?,
    ))
}

#[test]
fn p_by_t_by_d_layouts_match_one_process_with_and_without_zero() {
    let want = reference();
    let layouts = [
        // (P, T, D), ZeRO-1 on the replicas, schedule
        ((2, 2, 1), false, Schedule::OneFOneB),
        ((2, 1, 2), true, Schedule::GPipe),
        ((1, 2, 2), false, Schedule::GPipe),
        ((1, 2, 2), true, Schedule::OneFOneB),
        ((2, 2, 2), true, Schedule::OneFOneB),
    ];
    for ((p, t, d), zero, schedule) in layouts {
        let mesh = Mesh {
            pipeline: p,
            tensor: t,
            data: d,
        };
        let cfg = PipelineConfig {
            schedule,
            micro_batches: 2,
            zero,
        };
        let go = || {
            run(
                mesh.size(),
                Net::Local,
                &test_config(),
                DEADLINE,
                move |c| train_layout(c, mesh, cfg),
            )
            .expect("layout")
        };
        let out = go();
        // Every tensor rank and replica of a stage ends on the same whole weights.
        for ((s, tr, r), w) in &out {
            let first = &out.iter().find(|(k, _)| k.0 == *s).expect("stage").1;
            assert_eq!(
                w, first,
                "{p}×{t}×{d}: stage {s} tensor {tr} replica {r} differs"
            );
        }
        let got: Weights = (0..p)
            .flat_map(|s| out.iter().find(|(k, _)| k.0 == s).expect("stage").1.clone())
            .collect();
        let dist = rel_diff(&got, &want);
        eprintln!("{p}×{t}×{d} zero={zero}: relative {dist}");
        assert!(dist <= 1e-5, "{p}×{t}×{d} zero={zero}: relative {dist}");
        let again = go();
        assert!(
            again.iter().zip(&out).all(|(a, b)| a == b),
            "{p}×{t}×{d} zero={zero}: a second run differs"
        );
    }
}

/// The trainer's MLP (784 → 512 × 7 → 10) on a few steps: `--tensor-parallel 2` on 2
/// ranks and `--tensor-parallel 2 --pipeline 2` on 4 end on the weights one process
/// ends on, and count the formula's bytes when the ring is forced.
#[test]
fn the_trainer_with_tensor_parallel_ends_on_the_one_process_weights() {
    use ferroccl_candle::trainer::pipeline::train_mesh;
    use ferroccl_candle::{DataSource, TrainConfig};
    let tc = TrainConfig {
        data: DataSource::Synthetic(200),
        global_batch: 8,
        max_steps: Some(6),
        base_lr: 0.1,
        base_batch: 8,
        ..TrainConfig::default()
    };
    let pcfg = PipelineConfig {
        schedule: Schedule::OneFOneB,
        micro_batches: 2,
        zero: false,
    };
    let mut cfg = test_config();
    cfg.tuning.all_reduce_algo = ferroccl::AllReduceAlgo::Ring;
    let go = |n: usize, p: usize, t: usize| {
        let tc = tc.clone();
        run(n, Net::Local, &cfg, DEADLINE, move |c| {
            train_mesh(c, &tc, pcfg, p, t)
        })
        .expect("train")
    };
    let one = go(1, 1, 1).remove(0);
    assert_eq!(one.weights.len(), 16);
    for (n, p, t) in [(2, 1, 2), (4, 2, 2)] {
        let out = go(n, p, t);
        for s in &out {
            assert_eq!(s.weights, out[0].weights, "{p} × {t}: ranks disagree");
        }
        let d = rel_diff(&out[0].weights, &one.weights);
        eprintln!("trainer {p} × {t}: relative {d}");
        assert!(d <= 1e-5, "{p} × {t}: relative {d}");
        for r in &out[0].per_rank {
            assert!(r.tensor_law_bytes_per_step > 0.0);
            assert_eq!(
                r.tensor_bytes_per_step, r.tensor_law_bytes_per_step,
                "{r:?}"
            );
        }
    }
}

#[test]
fn the_book_shows_the_tensor_parallel_examples_code() {
    crate::book_shows(
        "training/tensor-parallel.md",
        "examples/tensor_parallel.rs",
        "book",
    );
}
