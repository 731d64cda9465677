//! The trainer behind `ferroccl train --pipeline P --tensor-parallel T --micro-batches
//! M --schedule S --zero 1`: a deep MLP on the digits, cut into P stages, each stage's
//! layers split over T tensor-parallel ranks, over a P × T × D layout of the job's
//! ranks (D = ranks / (P × T) data-parallel replicas), SGD with momentum stepped
//! through [`Zero`](crate::zero::Zero) (sharded over the replicas with `zero`).
//!
//! The model is [`WIDTHS`]: 784 → 512 → 512 → 512 → 512 → 512 → 512 → 512 → 10, eight
//! linear layers with tanh between. LeNet (the data-parallel trainer's CNN) has three
//! segments of very unequal cost, so it cannot make 4 or 8 stages; these eight layers
//! split evenly into 1, 2, 4 or 8 stages, seven of them of the same cost (the first is
//! wider in, 784 × 512; the last narrower, 512 × 10, so the last stage is the lightest
//! and idles most). With T > 1 a stage's layers pair up into Megatron MLP blocks
//! ([`super::mlp`]), so a stage holds whole pairs: P = 1, 2 or 4.
//!
//! Of the [`TrainConfig`] it reads the data, global batch, base LR (linearly scaled,
//! no warmup or decay here), momentum, weight decay, seed and max steps (default: the
//! epochs).

use super::batches::{Batches, Share};
use super::config::{load_data, TrainConfig, Trainer};
use super::mlp::{tp_mlp_stage, WIDTHS};
use super::run::replicas_agree;
use crate::ddp::Sgd;
use crate::error::{Error, Result};
use crate::pipeline::mlp::{even_split, mlp_stage_on};
use crate::pipeline::schedule::textbook_bubble;
use crate::pipeline::{Layout, Pipeline, PipelineConfig, StepReport};
use crate::tensor_parallel::cost::{bytes_per_rank, mlp_stage_all_reduces};
use crate::tensor_parallel::{gather_whole, Mesh, Shard};
use candle_core::{Module, Tensor};
use ferroccl::ddp::TrainError;
use ferroccl::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One stage's measurements (medians over the steps after the first).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StageStats {
    /// Stage index.
    pub stage: usize,
    /// Replica index.
    pub replica: usize,
    /// Step time (schedule and optimizer step), milliseconds.
    pub step_ms: f64,
    /// Of which computing, milliseconds.
    pub busy_ms: f64,
    /// Idle share of the schedule: 1 − busy / the longest stage's schedule time.
    pub bubble: f64,
    /// Most micro-batches held at once.
    pub peak_live: usize,
    /// Optimizer-state bytes on this rank.
    pub optimizer_bytes: usize,
    /// Tensor-parallel rank.
    #[serde(default)]
    pub tensor: usize,
    /// Payload bytes this rank's tensor-parallel links sent per step, as counted.
    #[serde(default)]
    pub tensor_bytes_per_step: f64,
    /// The same by the formula ([`crate::tensor_parallel::cost`]).
    #[serde(default)]
    pub tensor_law_bytes_per_step: f64,
}

/// What a pipeline run did; the same on every rank.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PipelineSummary {
    /// Stages P.
    pub stages: usize,
    /// Data-parallel replicas D.
    pub replicas: usize,
    /// Tensor-parallel ranks T.
    #[serde(default)]
    pub tensor: usize,
    /// Micro-batches M.
    pub micro_batches: usize,
    /// Steps run.
    pub steps: u64,
    /// Loss of the last step (mean over the global batch).
    pub final_loss: f64,
    /// The textbook bubble (P − 1)/(M + P − 1).
    pub textbook_bubble: f64,
    /// Every rank's stage measurements, in job-rank order.
    pub per_rank: Vec<StageStats>,
    /// The whole model's final weights by name, in forward order (every stage's,
    /// tensor shards put back together), as one process would hold them.
    #[serde(skip)]
    pub weights: Vec<(String, Vec<f32>)>,
    /// Whether every stage's (and tensor rank's) data-parallel replicas ended with the
    /// same weights, bit for bit (digests compared within each replica group).
    #[serde(default)]
    pub replicas_equal: bool,
}

/// Trains the MLP as a pipeline; every rank calls it with the same arguments.
/// `cfg`'s data, global batch, base LR (linearly scaled, no warmup or decay here),
/// momentum, weight decay, seed and max steps (default: one epoch) apply.
pub fn train_pipeline(
    comm: &Communicator,
    cfg: &TrainConfig,
    pcfg: PipelineConfig,
    stages: usize,
) -> Result<PipelineSummary> {
    train_mesh(comm, cfg, pcfg, stages, 1)
}

/// As [`train_pipeline`], each stage's layers split over `tensor` tensor-parallel
/// ranks too: the P × T × D [`Mesh`] of the job (T = 1 is the pipeline alone).
pub fn train_mesh(
    comm: &Communicator,
    cfg: &TrainConfig,
    pcfg: PipelineConfig,
    stages: usize,
    tensor: usize,
) -> Result<PipelineSummary> {
    cfg.refuse_unread(Trainer::Pipeline)?;
    // The same arguments on every rank: a mesh that is not the job fails on every
    // rank here, before any traffic.
    let layout = Layout::mesh(comm, Mesh::for_world(comm.world_size(), stages, tensor)?)?;
    let replicas = layout.data.world_size();
    if cfg.global_batch == 0
        || !cfg
            .global_batch
            .is_multiple_of(replicas * pcfg.micro_batches)
    {
        return Err(Error::invalid(format!(
            "global batch {} must be a positive multiple of replicas × micro-batches \
             ({replicas} × {})",
            cfg.global_batch, pcfg.micro_batches
        )));
    }
    let layers = even_split(WIDTHS.len() - 1, stages)?.swap_remove(layout.pipe.rank());
    let width = WIDTHS[layers.start];
    let opt = Sgd::new(cfg.momentum, cfg.weight_decay);
    let (pipe, data) = (&layout.pipe, Some(&layout.data));
    let device = cfg.device.candle(comm.local_rank())?;
    if tensor == 1 {
        let (module, vars) = mlp_stage_on(&WIDTHS, layers.clone(), cfg.seed, &device)?;
        let p = Pipeline::from_vars(pipe, data, module, vars, &[width], opt, pcfg)?;
        return run(comm, cfg, &layout, p, layers, None);
    }
    let (module, shards) =
        tp_mlp_stage(&WIDTHS, layers.clone(), cfg.seed, &layout.tensor, &device)?;
    let vars = shards
        .iter()
        .map(|s| (s.name.clone(), s.var.clone()))
        .collect();
    let p = Pipeline::from_vars(pipe, data, module, vars, &[width], opt, pcfg)?
        .with_tensor_group(&layout.tensor);
    run(comm, cfg, &layout, p, layers, Some(shards))
}

/// The training loop and its report, for this rank's stage `pipe` (layers `layers`,
/// tensor-parallel `shards` if split).
fn run<M: Module>(
    comm: &Communicator,
    cfg: &TrainConfig,
    layout: &Layout,
    mut pipe: Pipeline<'_, M, Sgd>,
    layers: Range<usize>,
    shards: Option<Vec<Shard>>,
) -> Result<PipelineSummary> {
    let (stage, replica) = (layout.pipe.rank(), layout.data.rank());
    let device = pipe.device().clone();
    let (stages, replicas) = (layout.pipe.world_size(), layout.data.world_size());
    let m = pipe.micro_batches();
    let share = cfg.global_batch / replicas;
    let (train_set, _) = load_data(cfg)?;
    let mine = Share {
        world: replicas,
        rank: replica,
        micro: share,
        accum: 1,
    };
    let mut batches = Batches::new(train_set, mine, cfg.seed, false)?;
    let steps = cfg
        .max_steps
        .unwrap_or(batches.steps_per_epoch() * cfg.epochs.max(1));
    let lr = cfg.base_lr * cfg.global_batch as f64 / cfg.base_batch.max(1) as f64;
    let mut reports: Vec<(StepReport, f64)> = Vec::new();
    let mut last = f64::NAN;
    let sent_before = layout.tensor.wire_stats().payload_sent;
    for step in 0..steps {
        let d = batches.pass(step, 0);
        let x = Tensor::from_slice(&d.images, (share, WIDTHS[0]), &device)?;
        let y: Vec<u32> = d.labels.iter().map(|&l| l as u32).collect();
        let y = Tensor::from_vec(y, share, &device)?;
        let loss = |out: &Tensor, rows: std::ops::Range<usize>| {
            candle_nn::loss::cross_entropy(out, &y.narrow(0, rows.start, rows.len())?)
        };
        let t = std::time::Instant::now();
        let r = pipe.step(share, (stage == 0).then_some(&x), &loss, lr)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        last = r.loss;
        if !last.is_finite() {
            return Err(TrainError::Diverged {
                step,
                why: format!("loss {last}; lower --lr"),
            }
            .into());
        }
        reports.push((r, ms));
    }
    let tp = layout.tensor.size();
    let counted = (layout.tensor.wire_stats().payload_sent - sent_before) as f64;
    let law = bytes_per_rank(
        &mlp_stage_all_reduces(&WIDTHS, layers.clone(), share / m).unwrap_or_default(),
        4,
        tp,
    ) * m as f64;
    let mut per_rank = stage_stats(
        comm,
        layout,
        &reports,
        pipe.params_mut().optimizer_state_bytes(),
    )?;
    let mine = [counted / steps.max(1) as f64, law];
    let mut all = vec![0.0f64; 2 * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    for (s, b) in per_rank.iter_mut().zip(all.chunks_exact(2)) {
        s.tensor_bytes_per_step = if tp > 1 { b[0] } else { 0.0 };
        s.tensor_law_bytes_per_step = b[1];
    }
    let stage_whole = match &shards {
        Some(sh) => gather_whole(&layout.tensor, sh)?,
        None => pipe.weights(),
    };
    // Each replica group agrees or not; the job's answer is whether all of them do.
    let mut equal = [u8::from(replicas_agree(&layout.data, &stage_whole)?)];
    comm.all_reduce(&mut equal, ReduceOp::Min)?;
    Ok(PipelineSummary {
        stages,
        replicas,
        tensor: tp,
        micro_batches: m,
        steps,
        final_loss: last,
        textbook_bubble: textbook_bubble(stages, m),
        per_rank,
        weights: whole_model(&layout.pipe, &stage_whole)?,
        replicas_equal: equal[0] == 1,
    })
}

/// Every rank's row of the step-time table (medians over the steps after the first).
fn stage_stats(
    comm: &Communicator,
    layout: &Layout,
    reports: &[(StepReport, f64)],
    optimizer_bytes: usize,
) -> Result<Vec<StageStats>> {
    // Medians over the steps after the first (which warms up).
    let tail = if reports.len() > 1 {
        &reports[1..]
    } else {
        reports
    };
    let med = |f: &dyn Fn(&(StepReport, f64)) -> f64| {
        let mut v: Vec<f64> = tail.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    // The step's schedule time is the longest stage's: gather them per step.
    let mut sched: Vec<f64> = tail
        .iter()
        .map(|(r, _)| r.schedule_time.as_secs_f64())
        .collect();
    layout.pipe.all_reduce(&mut sched, ReduceOp::Max)?;
    let mut bubbles: Vec<f64> = tail
        .iter()
        .zip(&sched)
        .map(|((r, _), s)| 1.0 - r.busy.as_secs_f64() / s.max(1e-12))
        .collect();
    bubbles.sort_by(f64::total_cmp);
    let mine = [
        layout.pipe.rank() as f64,
        layout.data.rank() as f64,
        med(&|(_, ms)| *ms),
        med(&|(r, _)| r.busy.as_secs_f64() * 1e3),
        bubbles.get(bubbles.len() / 2).copied().unwrap_or(0.0),
        tail.iter().map(|(r, _)| r.peak_live).max().unwrap_or(0) as f64,
        optimizer_bytes as f64,
        layout.tensor.rank() as f64,
    ];
    let mut all = vec![0.0f64; mine.len() * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    Ok(all
        .chunks_exact(mine.len())
        .map(|v| StageStats {
            stage: v[0] as usize,
            replica: v[1] as usize,
            step_ms: v[2],
            busy_ms: v[3],
            bubble: v[4],
            peak_live: v[5] as usize,
            optimizer_bytes: v[6] as usize,
            tensor: v[7] as usize,
            ..StageStats::default()
        })
        .collect())
}

/// The whole model from every stage's whole weights (`mine`, this stage's), on every
/// rank of the pipeline: the stages' flat weights all-gathered (padded to the
/// longest), then cut by the MLP's layer shapes. Collective over the pipeline.
fn whole_model(
    pipe: &Communicator,
    mine: &[(String, Vec<f32>)],
) -> Result<Vec<(String, Vec<f32>)>> {
    let p = pipe.world_size();
    let mut flat: Vec<f32> = mine.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    let mut lens = vec![0i64; p];
    pipe.all_gather(&[flat.len() as i64], &mut lens)?;
    let longest = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    flat.resize(longest, 0.0);
    let mut all = vec![0.0f32; longest * p];
    pipe.all_gather(&flat, &mut all)?;
    let mut out = Vec::new();
    for (s, layers) in even_split(WIDTHS.len() - 1, p)?.into_iter().enumerate() {
        let want: usize = layers
            .clone()
            .map(|i| (WIDTHS[i] + 1) * WIDTHS[i + 1])
            .sum();
        if lens[s] != want as i64 {
            return Err(Error::invalid(format!(
                "stage {s} holds {} weights, not the {want} of layers {layers:?}",
                lens[s]
            )));
        }
        let mut at = s * longest;
        for i in layers {
            for (part, n) in [
                ("weight", WIDTHS[i] * WIDTHS[i + 1]),
                ("bias", WIDTHS[i + 1]),
            ] {
                out.push((format!("l{i}.{part}"), all[at..at + n].to_vec()));
                at += n;
            }
        }
    }
    Ok(out)
}
