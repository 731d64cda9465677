//! The trainer behind `ferroccl train --pipeline P --micro-batches M --schedule S
//! --zero 1`: a deep MLP on the digits, cut into P stages over a P × D layout of the
//! job's ranks (D = ranks / P data-parallel replicas), SGD with momentum stepped
//! through [`Zero`](crate::zero::Zero) (sharded over the replicas with `zero`).
//!
//! The model is [`WIDTHS`]: 784 → 512 → 512 → 512 → 512 → 512 → 512 → 512 → 10, eight
//! linear layers with tanh between. LeNet (the data-parallel trainer's CNN) has three
//! segments of very unequal cost, so it cannot make 4 or 8 stages; these eight layers
//! split evenly into 1, 2, 4 or 8 stages, seven of them of the same cost (the first is
//! wider in, 784 × 512; the last narrower, 512 × 10, so the last stage is the lightest
//! and idles most).

use super::mlp::{even_split, mlp_stage};
use super::{Layout, Pipeline, PipelineConfig, StepReport};
use crate::ddp::{DistributedSampler, Sgd};
use crate::model::ce;
use crate::{load_data, TrainConfig};
use candle_core::{Device, Tensor};
use ferroccl::{Communicator, Error, ReduceOp, Result};
use serde::{Deserialize, Serialize};

/// The MLP's widths.
pub const WIDTHS: [usize; 9] = [784, 512, 512, 512, 512, 512, 512, 512, 10];

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
}

/// What a pipeline run did; the same on every rank.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PipelineSummary {
    /// Stages P.
    pub stages: usize,
    /// Data-parallel replicas D.
    pub replicas: usize,
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
    let layout = Layout::split(comm, stages)?;
    let (stage, replica) = (layout.pipe.rank(), layout.data.rank());
    let replicas = layout.data.world_size();
    let share = cfg.global_batch / replicas;
    if cfg.global_batch == 0
        || !cfg
            .global_batch
            .is_multiple_of(replicas * pcfg.micro_batches)
    {
        return Err(Error::InvalidArgument(format!(
            "global batch {} must be a positive multiple of replicas × micro-batches \
             ({replicas} × {})",
            cfg.global_batch, pcfg.micro_batches
        )));
    }
    let layers = even_split(WIDTHS.len() - 1, stages)?.swap_remove(stage);
    let width = WIDTHS[layers.start];
    let (module, vars) = mlp_stage(&WIDTHS, layers, cfg.seed)?;
    let mut pipe = Pipeline::from_vars(
        &layout.pipe,
        Some(&layout.data),
        module,
        vars,
        &[width],
        Sgd::new(cfg.momentum, cfg.weight_decay),
        pcfg,
    )?;
    let (train_set, _) = load_data(cfg)?;
    let sampler = DistributedSampler::new(train_set.len(), replicas, replica, cfg.seed)?;
    let per_epoch = (sampler.per_rank() / share) as u64;
    if per_epoch == 0 {
        return Err(Error::InvalidArgument(format!(
            "{} training images cannot make one global batch of {}",
            train_set.len(),
            cfg.global_batch
        )));
    }
    let steps = cfg.max_steps.unwrap_or(per_epoch * cfg.epochs.max(1));
    let lr = cfg.base_lr * cfg.global_batch as f64 / cfg.base_batch.max(1) as f64;
    let mut reports: Vec<(StepReport, f64)> = Vec::new();
    let mut order = (u64::MAX, Vec::new());
    let mut last = f64::NAN;
    for step in 0..steps {
        let epoch = step / per_epoch;
        if order.0 != epoch {
            order = (epoch, sampler.indices(epoch));
        }
        let first = (step % per_epoch) as usize * share;
        let d = train_set.select(&order.1[first..first + share]);
        let x =
            Tensor::from_vec(d.images, (share, WIDTHS[0]), &Device::Cpu).map_err(ce("batch"))?;
        let y: Vec<u32> = d.labels.iter().map(|&l| l as u32).collect();
        let y = Tensor::from_vec(y, share, &Device::Cpu).map_err(ce("labels"))?;
        let loss = |out: &Tensor, rows: std::ops::Range<usize>| {
            candle_nn::loss::cross_entropy(out, &y.narrow(0, rows.start, rows.len())?)
        };
        let t = std::time::Instant::now();
        let r = pipe.step(share, (stage == 0).then_some(&x), &loss, lr)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        last = r.loss;
        if !last.is_finite() {
            return Err(Error::Diverged {
                step,
                why: format!("loss {last}; lower --lr"),
            });
        }
        reports.push((r, ms));
    }
    // Medians over the steps after the first (which warms up).
    let tail = if reports.len() > 1 {
        &reports[1..]
    } else {
        &reports[..]
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
        stage as f64,
        replica as f64,
        med(&|(_, ms)| *ms),
        med(&|(r, _)| r.busy.as_secs_f64() * 1e3),
        bubbles.get(bubbles.len() / 2).copied().unwrap_or(0.0),
        tail.iter().map(|(r, _)| r.peak_live).max().unwrap_or(0) as f64,
        pipe.params_mut().optimizer_state_bytes() as f64,
    ];
    let mut all = vec![0.0f64; mine.len() * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    let per_rank = all
        .chunks_exact(mine.len())
        .map(|v| StageStats {
            stage: v[0] as usize,
            replica: v[1] as usize,
            step_ms: v[2],
            busy_ms: v[3],
            bubble: v[4],
            peak_live: v[5] as usize,
            optimizer_bytes: v[6] as usize,
        })
        .collect();
    Ok(PipelineSummary {
        stages,
        replicas,
        micro_batches: pcfg.micro_batches,
        steps,
        final_loss: last,
        textbook_bubble: super::schedule::textbook_bubble(stages, pcfg.micro_batches),
        per_rank,
    })
}
