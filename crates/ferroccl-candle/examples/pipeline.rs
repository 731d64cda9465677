//! When the model does not fit: a 4-layer MLP on digits, cut into pipeline stages and
//! trained three ways from the same initial weights on the same global batches —
//! one process with plain `Ddp`; 4 stages under GPipe with 8 micro-batches; and
//! 2 stages × 2 data-parallel replicas under 1F1B with 4 micro-batches and the
//! optimizer state sharded over the replicas (ZeRO-1). Ranks are threads of this
//! process. It fails unless the pipelines end on the one-process weights (1e-4
//! relative) and the replicas of a stage agree bit for bit.
//!
//! ```sh
//! cargo run --release -p ferroccl-candle --example pipeline
//! ```

use candle_core::{Device, Module, Tensor};
use ferroccl::{Communicator, Config, Error, Result};
use ferroccl_candle::data::{Dataset, PIXELS};
use ferroccl_candle::ddp::{Ddp, DdpConfig, Sgd};
use ferroccl_candle::pipeline::mlp::{even_split, mlp_stage};
use ferroccl_candle::pipeline::{Layout, Pipeline, PipelineConfig, Schedule};
use std::process::ExitCode;

const WIDTHS: [usize; 5] = [PIXELS, 128, 64, 64, 10];
const BATCH: usize = 64;
const STEPS: usize = 30;
const LR: f64 = 0.05;
const SEED: u64 = 7;

type Weights = Vec<(String, Vec<f32>)>;
/// One rank's result: stage, replica, the stage's weights, last loss, peak live.
type RankOut = (usize, usize, Weights, f64, usize);

fn ce(e: candle_core::Error) -> Error {
    Error::InvalidArgument(e.to_string())
}

/// Rows `rows` of step `step`'s global batch (the data in order, wrapping round).
fn batch(data: &Dataset, step: usize, rows: std::ops::Range<usize>) -> Result<(Tensor, Tensor)> {
    let idx: Vec<usize> = rows.map(|r| (step * BATCH + r) % data.len()).collect();
    let d = data.select(&idx);
    let x = Tensor::from_vec(d.images, (idx.len(), PIXELS), &Device::Cpu).map_err(ce)?;
    let y: Vec<u32> = d.labels.iter().map(|&l| l as u32).collect();
    let y = Tensor::from_vec(y, idx.len(), &Device::Cpu).map_err(ce)?;
    Ok((x, y))
}

/// The reference: the whole model in one process.
fn one_process(data: &Dataset) -> Result<(Weights, f64)> {
    let comm = Communicator::local_group(1, &Config::default())?.remove(0);
    let (model, vars) = mlp_stage(&WIDTHS, 0..WIDTHS.len() - 1, SEED)?;
    let mut ddp = Ddp::from_vars(&comm, vars, Sgd::new(0.9, 0.0), DdpConfig::default())?;
    let mut last = 0.0;
    for step in 0..STEPS {
        let (x, y) = batch(data, step, 0..BATCH)?;
        let loss =
            candle_nn::loss::cross_entropy(&model.forward(&x).map_err(ce)?, &y).map_err(ce)?;
        last = loss.to_scalar::<f32>().map_err(ce)? as f64;
        ddp.backward(&loss)?;
        ddp.step(LR)?;
    }
    Ok((ddp.weights(), last))
}

/// One rank of a `stages`-stage pipeline (times the job's ranks / stages replicas):
/// what the book shows (docs/book/src/training/large-models.md). Returns (stage, replica, weights, last loss, peak live).
fn pipeline_rank(
    comm: &Communicator,
    data: &Dataset,
    stages: usize,
    cfg: PipelineConfig,
) -> Result<RankOut> {
    // ANCHOR: book
    let layout = Layout::split(comm, stages)?;
    let (stage, replica) = (layout.pipe.rank(), layout.data.rank());
    let layers = even_split(WIDTHS.len() - 1, stages)?.swap_remove(stage);
    let width = WIDTHS[layers.start];
    let (module, vars) = mlp_stage(&WIDTHS, layers, SEED)?;
    let mut pipe = Pipeline::from_vars(
        &layout.pipe,
        Some(&layout.data),
        module,
        vars,
        &[width],
        Sgd::new(0.9, 0.0),
        cfg,
    )?;
    // Each replica takes its share of the global batch.
    let share = BATCH / layout.data.world_size();
    let rows = replica * share..(replica + 1) * share;
    let (mut last, mut peak) = (0.0, 0);
    for step in 0..STEPS {
        let (x, y) = batch(data, step, rows.clone())?;
        let loss = |out: &Tensor, mb: std::ops::Range<usize>| {
            candle_nn::loss::cross_entropy(out, &y.narrow(0, mb.start, mb.len())?)
        };
        let report = pipe.step(share, (stage == 0).then_some(&x), &loss, LR)?;
        last = report.loss;
        peak = peak.max(report.peak_live);
    }
    // ANCHOR_END: book
    Ok((stage, replica, pipe.weights(), last, peak))
}

fn on_threads(
    ranks: usize,
    stages: usize,
    cfg: PipelineConfig,
    data: &Dataset,
) -> Result<Vec<RankOut>> {
    let comms = Communicator::local_group(ranks, &Config::default())?;
    std::thread::scope(|t| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| t.spawn(move || pipeline_rank(&c, data, stages, cfg)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::InvalidArgument("a rank panicked".into())))
            })
            .collect()
    })
}

fn rel_diff(a: &Weights, b: &Weights) -> f32 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            d / y.iter().map(|q| q.abs()).fold(1e-6, f32::max)
        })
        .fold(0.0, f32::max)
}

fn run() -> Result<bool> {
    let data = Dataset::synthetic(2048, SEED);
    let (want, loss1) = one_process(&data)?;
    println!("1 process, whole model: loss after {STEPS} steps {loss1:.4}");
    let mut ok = true;
    for (ranks, stages, schedule, m, zero) in [
        (4, 4, Schedule::GPipe, 8, false),
        (4, 2, Schedule::OneFOneB, 4, true),
    ] {
        let cfg = PipelineConfig {
            schedule,
            micro_batches: m,
            zero,
        };
        let out = on_threads(ranks, stages, cfg, &data)?;
        let mut got: Weights = Vec::new();
        for s in 0..stages {
            let mine: Vec<_> = out.iter().filter(|o| o.0 == s).collect();
            ok &= mine.iter().all(|o| o.2 == mine[0].2);
            got.extend(mine[0].2.clone());
        }
        let d = rel_diff(&got, &want);
        let peak: Vec<usize> = (0..stages)
            .map(|s| out.iter().find(|o| o.0 == s && o.1 == 0).map_or(0, |o| o.4))
            .collect();
        println!(
            "{stages} stages x {} replicas, {} m={m}{}: loss {:.4}, largest relative difference \
             from 1 process {d:.1e}, peak live micro-batches per stage {peak:?}",
            ranks / stages,
            schedule.name(),
            if zero { ", ZeRO-1" } else { "" },
            out[0].3
        );
        ok &= d <= 1e-4;
    }
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("pipeline: the runs disagree (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("pipeline: {e}");
            ExitCode::FAILURE
        }
    }
}
