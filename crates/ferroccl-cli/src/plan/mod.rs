//! `ferroccl plan`: the arithmetic of a data-parallel run, shown with its formulas.
//!
//! Inputs come from flags and/or a TOML file (`--config`, the same keys in snake_case,
//! unknown keys refused); a flag overrides the file's key. Of the alternatives
//! (`throughput`/`compute_ms`, `params`/`grad_bytes`, `warmup_epochs`/`warmup_steps`,
//! `link`+`alpha_us`/`bench`), a flag also replaces the file's other choice. A relative
//! `bench` path in the file is relative to the file. The formulas live in
//! `model.rs` (pure), their report in `render.rs`, the units people type in
//! `parse.rs`, and tensor parallelism's per-layer communication in `tp.rs`; an input left
//! out skips what needs it, with the reason.

mod model;
#[cfg(test)]
mod model_tests;
mod parse;
mod render;
mod tp;

use clap::Args;
use ferroccl::{Error, Result};
pub use model::*;
pub use parse::*;
pub use render::{fmt_bytes, fmt_g, fmt_rate, fmt_time};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Arguments of `ferroccl plan`.
#[derive(Args, Debug, Clone, Default)]
pub struct PlanArgs {
    /// TOML file with the same keys as these flags (snake_case); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Data-parallel ranks (world size N).
    #[arg(short = 'n', long, allow_negative_numbers = true)]
    pub ranks: Option<usize>,
    /// Samples per rank per micro-batch.
    #[arg(long, alias = "batch", allow_negative_numbers = true)]
    pub per_rank_batch: Option<u64>,
    /// Micro-batches accumulated per optimizer step [default: 1].
    #[arg(long, alias = "accum", allow_negative_numbers = true)]
    pub accumulation_steps: Option<u64>,
    /// Training samples per epoch (suffixes K, M, G: 1.28M).
    #[arg(long, allow_negative_numbers = true)]
    pub dataset_size: Option<String>,
    /// Epochs [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub epochs: Option<u64>,
    /// Single-rank training throughput, samples/s, without mixed precision.
    #[arg(long, allow_negative_numbers = true)]
    pub throughput: Option<f64>,
    /// Or: compute time of one optimizer step on one rank (all accumulation
    /// micro-batches), milliseconds, without mixed precision.
    #[arg(long, allow_negative_numbers = true)]
    pub compute_ms: Option<f64>,
    /// Or: the whole step as measured, milliseconds, of which --comm-ms is
    /// communication (none of it hidden); compute is the rest.
    #[arg(long, allow_negative_numbers = true)]
    pub step_ms: Option<f64>,
    /// Mixed-precision speed-up of compute [default: 1, AMP off].
    #[arg(long, allow_negative_numbers = true)]
    pub amp_speedup: Option<f64>,
    /// Learning rate tuned for --base-batch; scaled linearly to the global batch.
    #[arg(long, allow_negative_numbers = true)]
    pub base_lr: Option<f64>,
    /// Global batch the base learning rate was tuned for.
    #[arg(long, allow_negative_numbers = true)]
    pub base_batch: Option<u64>,
    /// Learning-rate warmup in epochs (may be fractional).
    #[arg(long, allow_negative_numbers = true)]
    pub warmup_epochs: Option<f64>,
    /// Or: learning-rate warmup in optimizer steps.
    #[arg(long, allow_negative_numbers = true)]
    pub warmup_steps: Option<u64>,
    /// Model parameters, one gradient element each (suffixes K, M, G: 25.6M).
    #[arg(long, allow_negative_numbers = true)]
    pub params: Option<String>,
    /// Or: gradient bytes in --grad-dtype (102.4MB, 64MiB).
    #[arg(long, allow_negative_numbers = true)]
    pub grad_bytes: Option<String>,
    /// Gradient type on the wire: f32, f16 or bf16 [default: f32].
    #[arg(long)]
    pub grad_dtype: Option<String>,
    /// Link bandwidth with its unit: 10Gbit, 100Gbit/s, 1.25GB, 12.5GB/s.
    #[arg(long, allow_hyphen_values = true)]
    pub link: Option<String>,
    /// Latency α of one ring step, microseconds [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub alpha_us: Option<f64>,
    /// Or: a `ferroccl bench --json` file; its fitted α and β replace --link/--alpha-us.
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// Or, instead of a link model: communication per step as measured, milliseconds,
    /// all of it visible.
    #[arg(long, allow_negative_numbers = true)]
    pub comm_ms: Option<f64>,
    /// What communication is divided by: fp16 (or bf16: half the bytes of f32) or a
    /// compression factor ≥ 1 [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub comm_cut: Option<String>,
    /// Fraction of communication that overlaps backward compute, 0..1 [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    pub overlap: Option<f64>,
    /// Fraction of each step lost to costs not modelled (framework, input pipeline,
    /// stragglers), in [0, 1) [default: 0]. With no link model and no --comm-ms, the
    /// lump lost to communication and the rest ("about 15 % lost to communication").
    #[arg(long, allow_negative_numbers = true)]
    pub overhead: Option<f64>,
    /// The pipeline question: stages P. With --micro-batches and --stage-ms, `plan`
    /// answers with the bubble fraction and step time of P stages × M micro-batches
    /// instead of the data-parallel report.
    #[arg(long, allow_negative_numbers = true)]
    pub pipeline: Option<usize>,
    /// Micro-batches per step (M), for --pipeline.
    #[arg(long, allow_negative_numbers = true)]
    pub micro_batches: Option<usize>,
    /// Time of one micro-batch's forward and backward on a stage, milliseconds: one
    /// value for every stage, or one per stage (10,12,10,9), for --pipeline.
    #[arg(long, allow_hyphen_values = true)]
    pub stage_ms: Option<String>,
    /// The tensor-parallel question: T ranks splitting every layer. With
    /// --per-rank-batch B (sequences each tensor-parallel group processes per step)
    /// and --hidden H, `plan` answers with each layer's communication (two
    /// all-reduces of B·S·H per block) against data parallelism's over T ranks,
    /// instead of the data-parallel report (--grad-dtype sets the element type,
    /// --link and --alpha-us add times).
    #[arg(long, allow_negative_numbers = true)]
    pub tensor_parallel: Option<usize>,
    /// Tokens per sequence S, for --tensor-parallel [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub seq_len: Option<usize>,
    /// Model width H, for --tensor-parallel.
    #[arg(long, allow_negative_numbers = true)]
    pub hidden: Option<usize>,
    /// MLP hidden width F, for --tensor-parallel [default: 4 × --hidden].
    #[arg(long, allow_negative_numbers = true)]
    pub ffn: Option<usize>,
    /// Layers L, for --tensor-parallel [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    pub layers: Option<usize>,
    /// With --tensor-parallel: each layer is self-attention and an MLP (a
    /// transformer layer: four all-reduces), not an MLP block alone.
    #[arg(long)]
    pub attention: bool,
    /// Print every input and output as one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
}

/// A count in the TOML file: an integer, a float (1.28e6) or a string with a suffix.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
enum Count {
    Int(u64),
    Float(f64),
    Text(String),
}

impl Count {
    fn text(self) -> String {
        match self {
            Count::Int(v) => v.to_string(),
            Count::Float(v) => v.to_string(),
            Count::Text(s) => s,
        }
    }
}

/// The `--config` file: the flags' keys in snake_case.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    ranks: Option<usize>,
    per_rank_batch: Option<u64>,
    accumulation_steps: Option<u64>,
    dataset_size: Option<Count>,
    epochs: Option<u64>,
    throughput: Option<f64>,
    compute_ms: Option<f64>,
    step_ms: Option<f64>,
    amp_speedup: Option<f64>,
    base_lr: Option<f64>,
    base_batch: Option<u64>,
    warmup_epochs: Option<f64>,
    warmup_steps: Option<u64>,
    params: Option<Count>,
    grad_bytes: Option<Count>,
    grad_dtype: Option<String>,
    link: Option<String>,
    alpha_us: Option<f64>,
    bench: Option<PathBuf>,
    comm_ms: Option<f64>,
    comm_cut: Option<Count>,
    overlap: Option<f64>,
    overhead: Option<f64>,
    pipeline: Option<usize>,
    micro_batches: Option<usize>,
    stage_ms: Option<Count>,
    tensor_parallel: Option<usize>,
    seq_len: Option<usize>,
    hidden: Option<usize>,
    ffn: Option<usize>,
    layers: Option<usize>,
    attention: Option<bool>,
}

impl PlanFile {
    fn read(path: &Path) -> Result<PlanArgs> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading config file {}", path.display()), e))?;
        let f: PlanFile = toml::from_str(&text)
            .map_err(|e| Error::Config(format!("config file {}: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new(""));
        Ok(PlanArgs {
            config: None,
            ranks: f.ranks,
            per_rank_batch: f.per_rank_batch,
            accumulation_steps: f.accumulation_steps,
            dataset_size: f.dataset_size.map(Count::text),
            epochs: f.epochs,
            throughput: f.throughput,
            compute_ms: f.compute_ms,
            step_ms: f.step_ms,
            amp_speedup: f.amp_speedup,
            base_lr: f.base_lr,
            base_batch: f.base_batch,
            warmup_epochs: f.warmup_epochs,
            warmup_steps: f.warmup_steps,
            params: f.params.map(Count::text),
            grad_bytes: f.grad_bytes.map(Count::text),
            grad_dtype: f.grad_dtype,
            link: f.link,
            alpha_us: f.alpha_us,
            bench: f.bench.map(|b| dir.join(b)),
            comm_ms: f.comm_ms,
            comm_cut: f.comm_cut.map(Count::text),
            overlap: f.overlap,
            overhead: f.overhead,
            pipeline: f.pipeline,
            micro_batches: f.micro_batches,
            stage_ms: f.stage_ms.map(Count::text),
            tensor_parallel: f.tensor_parallel,
            seq_len: f.seq_len,
            hidden: f.hidden,
            ffn: f.ffn,
            layers: f.layers,
            attention: f.attention.unwrap_or(false),
            json: false,
        })
    }
}

/// The flags over the file: each key from the flags when given there. Where a flag
/// picks one of two alternatives, the file's other alternative is dropped.
fn merge(flags: PlanArgs, mut file: PlanArgs) -> PlanArgs {
    if flags.throughput.is_some() || flags.compute_ms.is_some() || flags.step_ms.is_some() {
        file.throughput = None;
        file.compute_ms = None;
        file.step_ms = None;
    }
    if flags.params.is_some() {
        file.grad_bytes = None;
    }
    if flags.grad_bytes.is_some() {
        file.params = None;
    }
    if flags.warmup_epochs.is_some() {
        file.warmup_steps = None;
    }
    if flags.warmup_steps.is_some() {
        file.warmup_epochs = None;
    }
    if flags.link.is_some() || flags.alpha_us.is_some() {
        file.bench = None;
        file.comm_ms = None;
    }
    if flags.bench.is_some() {
        file.link = None;
        file.alpha_us = None;
        file.comm_ms = None;
    }
    if flags.comm_ms.is_some() {
        file.link = None;
        file.alpha_us = None;
        file.bench = None;
    }
    PlanArgs {
        config: flags.config,
        ranks: flags.ranks.or(file.ranks),
        per_rank_batch: flags.per_rank_batch.or(file.per_rank_batch),
        accumulation_steps: flags.accumulation_steps.or(file.accumulation_steps),
        dataset_size: flags.dataset_size.or(file.dataset_size),
        epochs: flags.epochs.or(file.epochs),
        throughput: flags.throughput.or(file.throughput),
        compute_ms: flags.compute_ms.or(file.compute_ms),
        step_ms: flags.step_ms.or(file.step_ms),
        amp_speedup: flags.amp_speedup.or(file.amp_speedup),
        base_lr: flags.base_lr.or(file.base_lr),
        base_batch: flags.base_batch.or(file.base_batch),
        warmup_epochs: flags.warmup_epochs.or(file.warmup_epochs),
        warmup_steps: flags.warmup_steps.or(file.warmup_steps),
        params: flags.params.or(file.params),
        grad_bytes: flags.grad_bytes.or(file.grad_bytes),
        grad_dtype: flags.grad_dtype.or(file.grad_dtype),
        link: flags.link.or(file.link),
        alpha_us: flags.alpha_us.or(file.alpha_us),
        bench: flags.bench.or(file.bench),
        comm_ms: flags.comm_ms.or(file.comm_ms),
        comm_cut: flags.comm_cut.or(file.comm_cut),
        overlap: flags.overlap.or(file.overlap),
        overhead: flags.overhead.or(file.overhead),
        pipeline: flags.pipeline.or(file.pipeline),
        micro_batches: flags.micro_batches.or(file.micro_batches),
        stage_ms: flags.stage_ms.or(file.stage_ms),
        tensor_parallel: flags.tensor_parallel.or(file.tensor_parallel),
        seq_len: flags.seq_len.or(file.seq_len),
        hidden: flags.hidden.or(file.hidden),
        ffn: flags.ffn.or(file.ffn),
        layers: flags.layers.or(file.layers),
        attention: flags.attention || file.attention,
        json: flags.json,
    }
}

fn both(a: &str, b: &str) -> Error {
    Error::InvalidArgument(format!("give {a} or {b}, not both"))
}

/// `--comm-cut`: fp16/f16/bf16/half (2: half the bytes of f32) or a factor.
fn comm_cut(text: &str) -> Result<f64> {
    match text.trim().to_ascii_lowercase().as_str() {
        "fp16" | "f16" | "bf16" | "half" => Ok(2.0),
        t => t.parse::<f64>().map_err(|_| {
            Error::InvalidArgument(format!(
                "--comm-cut {text:?} is neither fp16 nor a factor (2, 4.5)"
            ))
        }),
    }
}

/// Turns merged arguments into a [`PlanInput`], checked by `compute` (reading a
/// bench file). Inputs left out stay `None`; two ways of giving one input are refused.
fn input(a: PlanArgs) -> Result<PlanInput> {
    let dataset_size = a
        .dataset_size
        .map(|d| parse_count("--dataset-size", &d, false))
        .transpose()?;
    let compute = match (a.throughput, a.compute_ms, a.step_ms) {
        (Some(t), None, None) => Some(Compute::Throughput(t)),
        (None, Some(ms), None) => Some(Compute::StepTimeS(ms / 1e3)),
        (None, None, Some(ms)) => Some(Compute::MeasuredStepS(ms / 1e3)),
        (None, None, None) => None,
        (Some(_), Some(_), _) => return Err(both("--throughput", "--compute-ms")),
        (Some(_), None, Some(_)) => return Err(both("--throughput", "--step-ms")),
        (None, Some(_), Some(_)) => return Err(both("--compute-ms", "--step-ms")),
    };
    let warmup = match (a.warmup_epochs, a.warmup_steps) {
        (Some(e), None) => Some(Warmup::Epochs(e)),
        (None, Some(s)) => Some(Warmup::Steps(s)),
        (Some(_), Some(_)) => return Err(both("--warmup-epochs", "--warmup-steps")),
        (None, None) => None,
    };
    let gradient = match (a.params, a.grad_bytes) {
        (Some(p), None) => Some(Gradient::Params(parse_count("--params", &p, false)?)),
        (None, Some(b)) => Some(Gradient::Bytes(parse_count("--grad-bytes", &b, true)?)),
        (Some(_), Some(_)) => return Err(both("--params", "--grad-bytes")),
        (None, None) => None,
    };
    let grad_dtype = match a.grad_dtype {
        Some(s) => GradDtype::parse(&s)?,
        None => GradDtype::F32,
    };
    let link = match (a.link, a.alpha_us, a.bench) {
        (Some(l), alpha_us, None) => {
            let bytes_per_s = parse_bandwidth(&l)?;
            let alpha_us = alpha_us.unwrap_or(0.0);
            Some(Link::from_bandwidth(
                bytes_per_s,
                alpha_us / 1e6,
                format!("--link {l}"),
            ))
        }
        (None, _, Some(path)) => {
            if a.alpha_us.is_some() {
                return Err(both("--alpha-us", "--bench (which gives α)"));
            }
            let name = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::io(format!("reading bench file {name}"), e))?;
            Some(link_from_bench_json(&text, &name)?)
        }
        (Some(_), _, Some(_)) => return Err(both("--link", "--bench")),
        (None, Some(_), None) => {
            return Err(Error::InvalidArgument(
                "--alpha-us is the latency of a link: give --link with it".into(),
            ))
        }
        (None, None, None) => None,
    };
    Ok(PlanInput {
        ranks: a.ranks,
        per_rank_batch: a.per_rank_batch,
        accumulation_steps: a.accumulation_steps.unwrap_or(1),
        dataset_size,
        epochs: a.epochs.unwrap_or(1),
        compute,
        amp_speedup: a.amp_speedup.unwrap_or(1.0),
        base_lr: a.base_lr,
        base_batch: a.base_batch,
        warmup,
        gradient,
        grad_dtype,
        link,
        comm_s: a.comm_ms.map(|ms| ms / 1e3),
        comm_cut: a.comm_cut.as_deref().map(comm_cut).transpose()?,
        overlap: a.overlap.unwrap_or(0.0),
        overhead: a.overhead,
    })
}

fn run(flags: PlanArgs) -> Result<String> {
    let json = flags.json;
    let args = match &flags.config {
        Some(path) => {
            let file = PlanFile::read(path)?;
            merge(flags, file)
        }
        None => flags,
    };
    if args.pipeline.is_some() {
        return pipeline(&args);
    }
    if args.tensor_parallel.is_some() {
        return tp::tensor_parallel(&args, json);
    }
    let p = compute(&input(args)?)?;
    if json {
        p.to_json()
    } else {
        Ok(p.render())
    }
}

/// A pipeline of per-stage times `t[s]` (forward + backward of one micro-batch) and m
/// micro-batches, GPipe or 1F1B (the same): each phase is a flow shop of identical
/// jobs, so the step takes Σ t + (m − 1) × max t, and the stages are busy m × Σ t of
/// p × that. With equal stages: (m + p − 1) × t and a bubble of (p − 1)/(m + p − 1).
pub fn pipeline_step(t: &[f64], m: usize) -> (f64, f64) {
    let sum: f64 = t.iter().sum();
    let max = t.iter().copied().fold(0.0, f64::max);
    let step = sum + (m as f64 - 1.0) * max;
    let busy = m as f64 * sum;
    let bubble = if step > 0.0 {
        1.0 - busy / (t.len() as f64 * step)
    } else {
        0.0
    };
    (step, bubble)
}

/// The pipeline question: bubble fraction and step time from per-stage time, p, m.
fn pipeline(a: &PlanArgs) -> Result<String> {
    let p = a.pipeline.unwrap_or(0);
    let need = |what: &str| Error::InvalidArgument(format!("--pipeline needs {what}"));
    let m = a.micro_batches.ok_or_else(|| need("--micro-batches M"))?;
    let text = a.stage_ms.as_deref().ok_or_else(|| need("--stage-ms T"))?;
    if p == 0 || m == 0 {
        return Err(Error::InvalidArgument(format!(
            "--pipeline {p} --micro-batches {m}: both must be at least 1"
        )));
    }
    if p > crate::args::MAX_RANKS || m > 1_000_000 {
        return Err(Error::InvalidArgument(format!(
            "--pipeline {p} --micro-batches {m}: at most {} stages and 1,000,000 micro-batches",
            crate::args::MAX_RANKS
        )));
    }
    let mut t: Vec<f64> = text
        .split(',')
        .map(|v| match v.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(Error::InvalidArgument(format!(
                "--stage-ms {text:?}: each time must be a positive number of milliseconds"
            ))),
        })
        .collect::<Result<_>>()?;
    if t.len() == 1 {
        t = vec![t[0]; p];
    }
    if t.len() != p {
        return Err(Error::InvalidArgument(format!(
            "--stage-ms gives {} times for {p} stages",
            t.len()
        )));
    }
    let (step, bubble) = pipeline_step(&t, m);
    let max = t.iter().copied().fold(0.0, f64::max);
    let textbook = (p as f64 - 1.0) / (m + p - 1) as f64;
    let ideal: f64 = m as f64 * t.iter().sum::<f64>() / p as f64;
    // The smallest m with a bubble under 10 % (equal stages: 9 (p − 1)).
    let m10 = (1..=1_000_000)
        .find(|&k| pipeline_step(&t, k).1 < 0.10 - 1e-12)
        .unwrap_or(0);
    let out = serde_json::json!({
        "stages": p, "micro_batches": m, "stage_ms": t,
        "step_ms": step, "bubble_fraction": bubble, "textbook_bubble": textbook,
        "ideal_step_ms": ideal, "peak_live_gpipe": m, "peak_live_1f1b": p.min(m),
        "micro_batches_for_10pct_bubble": m10,
    });
    if a.json {
        return serde_json::to_string_pretty(&out)
            .map_err(|e| Error::InvalidArgument(format!("json: {e}")));
    }
    Ok(format!(
        "pipeline: p = {p} stages, m = {m} micro-batches (GPipe and 1F1B alike)\n\
         \x20 step time      = Σ t + (m − 1) × max t = {sum:.3} + {mm} × {max:.3} = {step:.3} ms\n\
         \x20                  (no bubble: m × Σ t / p = {ideal:.3} ms)\n\
         \x20 bubble         = 1 − m × Σ t / (p × step) = {b:.1} %\n\
         \x20 textbook       = (p − 1)/(m + p − 1) = {p1}/{mp1} = {tb:.1} % (equal stages)\n\
         \x20 live activations per stage: GPipe m = {m}; 1F1B at most min(p, m) = {pl} (stage s: min(p − s, m))\n\
         \x20 micro-batches for a bubble under 10 %: m ≥ {m10}\n",
        sum = t.iter().sum::<f64>(),
        mm = m - 1,
        b = bubble * 100.0,
        p1 = p - 1,
        mp1 = m + p - 1,
        tb = textbook * 100.0,
        pl = p.min(m),
    ))
}

/// Runs `ferroccl plan`; errors go to stderr as `ferroccl plan: <error>` with exit code 2.
pub fn main(a: PlanArgs) -> crate::error::Result<bool> {
    let out = run(a)?;
    print!("{out}");
    if !out.ends_with('\n') {
        println!();
    }
    Ok(true)
}

#[cfg(all(test, feature = "candle"))]
mod tests {
    use super::pipeline_step;
    use ferroccl_candle::pipeline::schedule::{plan, simulate, Schedule};
    use proptest::prelude::*;

    proptest! {
        /// The closed form is the schedules' own timing, played in virtual time, for
        /// any per-stage times (forward a third, backward two thirds of each).
        #[test]
        fn the_closed_form_is_what_the_schedules_take(
            t in proptest::collection::vec(0.5f64..20.0, 1..8), m in 1usize..24
        ) {
            let (step, bubble) = pipeline_step(&t, m);
            let f: Vec<f64> = t.iter().map(|x| x / 3.0).collect();
            let b: Vec<f64> = t.iter().map(|x| x * 2.0 / 3.0).collect();
            let sim = simulate(&plan(Schedule::GPipe, t.len(), m).unwrap(), &f, &b).unwrap();
            prop_assert!((sim.makespan - step).abs() < 1e-9 * step, "{} vs {}", sim.makespan, step);
            prop_assert!((sim.bubble_fraction() - bubble).abs() < 1e-9);
        }
    }
}
