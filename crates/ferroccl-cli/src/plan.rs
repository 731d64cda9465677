//! `ferroccl plan`: the arithmetic of a data-parallel run, shown with its formulas.
//!
//! Inputs come from flags and/or a TOML file (`--config`, the same keys in snake_case,
//! unknown keys refused); a flag overrides the file's key. Of the alternatives
//! (`throughput`/`compute_ms`, `params`/`grad_bytes`, `warmup_epochs`/`warmup_steps`,
//! `link`+`alpha_us`/`bench`), a flag also replaces the file's other choice. A relative
//! `bench` path in the file is relative to the file. The formulas live in
//! `planner.rs`; an input left out skips what needs it, with the reason.

use crate::planner::{self as plan, Compute, GradDtype, Gradient, Link, PlanInput, Warmup};
use clap::Args;
use ferroccl::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

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

/// Turns merged arguments into a [`PlanInput`], checked by `plan::compute` (reading a
/// bench file). Inputs left out stay `None`; two ways of giving one input are refused.
fn input(a: PlanArgs) -> Result<PlanInput> {
    let dataset_size = a
        .dataset_size
        .map(|d| plan::parse_count("--dataset-size", &d, false))
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
        (Some(p), None) => Some(Gradient::Params(plan::parse_count("--params", &p, false)?)),
        (None, Some(b)) => Some(Gradient::Bytes(plan::parse_count(
            "--grad-bytes",
            &b,
            true,
        )?)),
        (Some(_), Some(_)) => return Err(both("--params", "--grad-bytes")),
        (None, None) => None,
    };
    let grad_dtype = match a.grad_dtype {
        Some(s) => GradDtype::parse(&s)?,
        None => GradDtype::F32,
    };
    let link = match (a.link, a.alpha_us, a.bench) {
        (Some(l), alpha_us, None) => {
            let bytes_per_s = plan::parse_bandwidth(&l)?;
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
            Some(plan::link_from_bench_json(&text, &name)?)
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
    let p = plan::compute(&input(args)?)?;
    if json {
        p.to_json()
    } else {
        Ok(p.render())
    }
}

/// Runs `ferroccl plan`; errors go to stderr as `ferroccl plan: <error>` with exit code 2.
pub fn main(a: PlanArgs) -> ExitCode {
    match run(a) {
        Ok(out) => {
            print!("{out}");
            if !out.ends_with('\n') {
                println!();
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ferroccl plan: {e}");
            ExitCode::from(2)
        }
    }
}
