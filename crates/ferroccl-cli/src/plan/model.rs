//! The quick arithmetic of a data-parallel run: batch, learning rate, throughput, epoch
//! time and what the ring all-reduce of the gradients costs on a given link.
//!
//! This module is pure: [`compute`] turns a [`PlanInput`] into a [`Plan`], and
//! [`Plan::render`] / [`Plan::to_json`] format it. `ferroccl plan` reads flags, a TOML
//! file and `ferroccl bench --json` files and calls it.
//!
//! # The formulas
//!
//! With N ranks, per-rank batch b, k gradient-accumulation steps, dataset size D and
//! E epochs. A *step* is one optimizer step: every rank runs k micro-batches of b
//! samples, then the gradients are all-reduced once.
//!
//! - global batch G = N × b × k
//! - steps per epoch = floor(D / G): the `drop_last` convention, the last partial
//!   global batch of each epoch is left out (D − G × steps samples)
//! - total steps = steps per epoch × E
//! - scaled learning rate = base lr × G / base batch (linear scaling rule, base batch
//!   being the global batch the base lr was tuned for)
//! - warmup steps: given, or ceil(warmup epochs × steps per epoch)
//! - compute per step t_c = b × k / T₁ / amp, with T₁ the single-rank throughput in
//!   samples/s measured without mixed precision; or t_c = (given compute time of one
//!   step) / amp. `amp` is the mixed-precision speed-up (1 when off).
//! - gradient bytes S = P × size(dtype), P parameters; size is 4 for f32 and 2 for
//!   f16/bf16 (or S is given and P = S / size)
//! - ring all-reduce bytes sent per rank = 2(N−1)/N × S
//! - communication per step t_comm = 2(N−1) × α + 2(N−1)/N × S × β, with β = 1 / link
//!   bandwidth (s/B) and α the latency of one ring step (s); computed for the chosen
//!   dtype and shown for f32 and f16/bf16
//! - hidden communication = min(overlap × t_comm, t_c): backward can hide at most as
//!   much communication as there is compute to hide it behind
//! - visible communication t_v = t_comm − hidden (= t_comm × (1 − overlap) while the
//!   compute is long enough)
//! - step time t_s = (t_c + t_v) / (1 − overhead), overhead being the share of each step
//!   lost to costs the model does not see (framework, input pipeline, stragglers)
//! - communication share = t_v / t_s
//! - throughput X = N × b × k / t_s (samples/s)
//! - speedup = X / (b × k / t_c): over one rank at the same precision with no
//!   communication, so that efficiency = speedup / N = t_c / t_s is the scaling
//!   efficiency (AMP's gain is in t_c, not in the efficiency)
//! - time per epoch = steps per epoch × t_s; total time = time per epoch × E
//!
//! # Questions as people ask them
//!
//! Every input but the accumulation steps, epochs, AMP speed-up, overlap and dtype may
//! be left out: each output is computed when its inputs are there and otherwise
//! skipped, with the reason in one line ([`Plan::skipped`], "needs --dataset-size").
//! Errors are for impossible values and contradictions only.
//!
//! - **Lump overhead.** With no communication figure (no link model, no measured
//!   communication), `overhead` is everything lost to communication and the rest:
//!   t_s = t_c / (1 − overhead). "150 img/s at batch 128, 8 GPUs, +25 % from AMP, about
//!   15 % lost to communication" is 150 × 8 × 1.25 × 0.85 = 1275 img/s.
//! - **Learning rate without a base batch.** The lr factor G / base batch is given
//!   whenever G is; the base batch defaults to b × k, the single-rank run whose
//!   throughput was given (8 GPUs at 128 each: 8 × the single GPU's lr).
//! - **Measured communication.** `comm_s` (`--comm-ms`) is the communication of a
//!   step as measured, none of it hidden, instead of the ring model; with the whole
//!   step measured (`--step-ms`) the compute is the difference. `comm_cut` divides the
//!   communication (2 for fp16 instead of f32, or a compression factor), then overlap
//!   hides its share: "90 ms of a 400 ms step, fp16, 40 % overlap" is 90 / 2 × 0.6 =
//!   27 ms visible and a step of 400 − 90 + 27 = 337 ms.
//!
//! # Link figures from a benchmark
//!
//! [`link_from_bench_json`] reads the file `ferroccl bench --json` writes. When it has a
//! top-level `"fit": {"alpha_s": a, "beta_s_per_byte": b}` object those are used.
//! Otherwise α and β are fitted by least squares over the rows' in-place times
//! `ip_time_us`: t = 2(n−1)α + 2(n−1)/n × S × β with the bench's own n, i.e. a straight
//! line t = c + m × S with α = c / (2(n−1)) and β = m × n / (2(n−1)). When the free fit
//! puts the intercept below zero, the best fit with α ≥ 0 is α = 0 and the line through
//! the origin. Rows run with recursive doubling (small messages, see
//! `Tuning::small_message_bytes`) follow another law; run the bench with
//! `--small-message-bytes 0` for a pure ring fit.

use super::render::fmt_g;
use ferroccl::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// Element type of the gradients as they are all-reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GradDtype {
    /// 32-bit float, 4 bytes.
    F32,
    /// IEEE half, 2 bytes.
    F16,
    /// bfloat16, 2 bytes.
    BF16,
}

impl GradDtype {
    /// Parses `f32`/`float`/`fp32`, `f16`/`half`/`fp16`, `bf16`/`bfloat16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" | "fp32" => Ok(GradDtype::F32),
            "f16" | "half" | "float16" | "fp16" => Ok(GradDtype::F16),
            "bf16" | "bfloat16" => Ok(GradDtype::BF16),
            _ => Err(Error::InvalidArgument(format!(
                "--grad-dtype {s:?} is not a gradient type: use f32, f16 or bf16"
            ))),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GradDtype::F32 => 4,
            GradDtype::F16 | GradDtype::BF16 => 2,
        }
    }

    /// Short name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            GradDtype::F32 => "f32",
            GradDtype::F16 => "f16",
            GradDtype::BF16 => "bf16",
        }
    }
}

/// Where the compute time of a step comes from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Compute {
    /// Single-rank training throughput in samples/s, without mixed precision.
    Throughput(f64),
    /// Compute time of one optimizer step on one rank (forward and backward of all k
    /// accumulation micro-batches) in seconds, without mixed precision.
    StepTimeS(f64),
    /// The whole step as measured, seconds, without mixed precision: compute plus the
    /// given communication ([`PlanInput::comm_s`]), none of it hidden.
    MeasuredStepS(f64),
}

/// How long the learning-rate warmup lasts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Warmup {
    /// In epochs (may be fractional); converted with ceil(epochs × steps per epoch).
    Epochs(f64),
    /// In optimizer steps.
    Steps(u64),
}

/// How big the gradients are.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gradient {
    /// Number of parameters (one gradient element each).
    Params(u64),
    /// Bytes of gradient in the chosen dtype.
    Bytes(u64),
}

/// The α-β model of the link: a ring step of s bytes costs α + s × β.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Link {
    /// Latency of one ring step, seconds.
    pub alpha_s: f64,
    /// Seconds per byte: 1 / bandwidth.
    pub beta_s_per_byte: f64,
    /// Where the figures come from, for the reader (`--link 10Gbit`, a bench file).
    pub source: String,
}

impl Link {
    /// A link of `bytes_per_s` with per-step latency `alpha_s`.
    pub fn from_bandwidth(bytes_per_s: f64, alpha_s: f64, source: impl Into<String>) -> Self {
        Link {
            alpha_s,
            beta_s_per_byte: 1.0 / bytes_per_s,
            source: source.into(),
        }
    }
}

/// Everything a plan is computed from. [`compute`] checks it. An input left out
/// (`None`) skips the outputs that need it; the plan says which and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanInput {
    /// World size N (data-parallel ranks).
    pub ranks: Option<usize>,
    /// Samples per rank per micro-batch.
    pub per_rank_batch: Option<u64>,
    /// Micro-batches accumulated per optimizer step (1: no accumulation).
    pub accumulation_steps: u64,
    /// Training samples in one epoch.
    pub dataset_size: Option<u64>,
    /// Epochs to train.
    pub epochs: u64,
    /// Compute cost of a step on one rank.
    pub compute: Option<Compute>,
    /// Mixed-precision speed-up of compute (1: AMP off).
    pub amp_speedup: f64,
    /// Learning rate tuned for `base_batch`; `None` skips the scaled learning rate
    /// (the scaling factor is still given).
    pub base_lr: Option<f64>,
    /// Global batch that `base_lr` was tuned for; `None`: the single-rank batch b × k
    /// (the run the single-rank figures describe).
    pub base_batch: Option<u64>,
    /// Learning-rate warmup, if any.
    pub warmup: Option<Warmup>,
    /// Gradient size.
    pub gradient: Option<Gradient>,
    /// Gradient element type on the wire.
    pub grad_dtype: GradDtype,
    /// Link model.
    pub link: Option<Link>,
    /// Communication per step as measured (seconds, all of it visible), instead of a
    /// link model.
    pub comm_s: Option<f64>,
    /// Factor that communication is cut by (2 for fp16 instead of f32 gradients, or a
    /// compression ratio), ≥ 1.
    pub comm_cut: Option<f64>,
    /// Fraction of communication that can overlap backward compute, in [0, 1].
    pub overlap: f64,
    /// Fraction of each step lost to costs the model does not see, in [0, 1). With no
    /// communication figure (no link model, no `comm_s`) it is the lump lost to
    /// communication and everything else.
    pub overhead: Option<f64>,
}

/// The outputs, every one a number a script can read (see the module docs for the
/// formulas), or `None` with the reason in [`Plan::skipped`]. Times in seconds, sizes
/// in bytes, throughputs in samples/s.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The input this plan was computed from.
    pub input: PlanInput,
    /// N × b × k.
    pub global_batch: Option<u64>,
    /// floor(D / G).
    pub steps_per_epoch: Option<u64>,
    /// D − G × steps per epoch: samples left out of each epoch (drop_last).
    pub dropped_samples_per_epoch: Option<u64>,
    /// steps per epoch × epochs.
    pub total_steps: Option<u64>,
    /// G / base batch: what the learning rate tuned for the base batch is multiplied by.
    pub lr_factor: Option<f64>,
    /// base lr × G / base batch, when a base lr was given.
    pub scaled_lr: Option<f64>,
    /// Warmup in optimizer steps (0 without warmup).
    pub warmup_steps: Option<u64>,
    /// Warmup in epochs: warmup steps / steps per epoch.
    pub warmup_epochs: Option<f64>,
    /// T₁ as given, or b × k / given compute time (no AMP).
    pub single_rank_throughput: Option<f64>,
    /// t_c: compute time of one step, after the AMP speed-up.
    pub compute_s: Option<f64>,
    /// b × k / t_c: one rank at the chosen precision, no communication.
    pub baseline_throughput: Option<f64>,
    /// P, the number of gradient elements.
    pub params: Option<f64>,
    /// S = P × size(dtype).
    pub grad_bytes: Option<f64>,
    /// 2(N−1)/N × S.
    pub ring_bytes_per_rank: Option<f64>,
    /// α of the link model.
    pub alpha_s: Option<f64>,
    /// β of the link model.
    pub beta_s_per_byte: Option<f64>,
    /// 1 / β.
    pub link_bytes_per_s: Option<f64>,
    /// t_comm: communication per step (ring model for the chosen dtype, or as given),
    /// divided by the cut.
    pub comm_s: Option<f64>,
    /// Ring-model t_comm with f32 gradients.
    pub comm_f32_s: Option<f64>,
    /// Ring-model t_comm with f16/bf16 gradients.
    pub comm_f16_s: Option<f64>,
    /// min(overlap × t_comm, t_c) (overlap × t_comm when t_c is unknown).
    pub hidden_comm_s: Option<f64>,
    /// t_comm − hidden.
    pub visible_comm_s: Option<f64>,
    /// (t_c + t_v) / (1 − overhead).
    pub step_s: Option<f64>,
    /// t_v / t_s.
    pub comm_share: Option<f64>,
    /// N × b × k / t_s.
    pub throughput: Option<f64>,
    /// throughput / baseline throughput.
    pub speedup: Option<f64>,
    /// speedup / N.
    pub efficiency: Option<f64>,
    /// steps per epoch × t_s.
    pub epoch_s: Option<f64>,
    /// epoch time × epochs.
    pub total_s: Option<f64>,
    /// Each output left out, by its JSON name, with the reason in one line.
    pub skipped: BTreeMap<String, String>,
}

fn bad(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn positive(flag: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(bad(format!("{flag} must be a positive number, got {v}")))
    }
}

fn at_least_one(flag: &str, v: u64) -> Result<u64> {
    if v >= 1 {
        Ok(v)
    } else {
        Err(bad(format!("{flag} must be at least 1, got {v}")))
    }
}

/// Ring all-reduce time of `bytes` over `n` ranks: 2(n−1)α + 2(n−1)/n × S × β.
pub fn ring_allreduce_s(n: usize, bytes: f64, alpha_s: f64, beta_s_per_byte: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = n as f64;
    2.0 * (n - 1.0) * alpha_s + ring_factor(n) * bytes * beta_s_per_byte
}

/// The ring all-reduce bus factor 2(n−1)/n (0 for one rank).
pub(super) fn ring_factor(n: f64) -> f64 {
    if n <= 1.0 {
        0.0
    } else {
        2.0 * (n - 1.0) / n
    }
}

/// An output, or why it is skipped.
type Got<T> = std::result::Result<T, String>;

/// `v`, or "needs `what`" when it was not given.
fn given<T>(v: Option<T>, what: &str) -> Got<T> {
    v.ok_or_else(|| format!("needs {what}"))
}

/// Checks every given input (impossible values and contradictions are errors naming
/// the flag), then computes every output whose inputs are there.
fn check(i: &PlanInput) -> Result<()> {
    if i.ranks == Some(0) {
        return Err(bad("--ranks must be at least 1, got 0".into()));
    }
    if let Some(b) = i.per_rank_batch {
        at_least_one("--per-rank-batch", b)?;
    }
    at_least_one("--accumulation-steps", i.accumulation_steps)?;
    if let Some(d) = i.dataset_size {
        at_least_one("--dataset-size", d)?;
    }
    at_least_one("--epochs", i.epochs)?;
    positive("--amp-speedup", i.amp_speedup)?;
    if !(0.0..=1.0).contains(&i.overlap) {
        return Err(bad(format!(
            "--overlap must be a fraction in [0, 1], got {}",
            i.overlap
        )));
    }
    if let Some(o) = i.overhead {
        if !(0.0..1.0).contains(&o) {
            return Err(bad(format!(
                "--overhead must be a fraction in [0, 1), got {o}"
            )));
        }
    }
    if let Some(link) = &i.link {
        let beta = link.beta_s_per_byte;
        if !(beta.is_finite() && beta > 0.0) {
            return Err(bad(format!(
                "link: β must be positive (a positive bandwidth), got {beta} s/B from {}",
                link.source
            )));
        }
        let alpha = link.alpha_s;
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(bad(format!(
                "--alpha-us must be zero or positive, got α = {alpha} s from {}",
                link.source
            )));
        }
    }
    if let Some(c) = i.comm_s {
        if !(c.is_finite() && c >= 0.0) {
            return Err(bad(format!(
                "--comm-ms must be zero or positive, got {}",
                c * 1e3
            )));
        }
        if let Some(link) = &i.link {
            return Err(bad(format!(
                "--comm-ms gives the communication time and {} models it: give one",
                link.source
            )));
        }
    }
    if let Some(cut) = i.comm_cut {
        if !(cut.is_finite() && cut >= 1.0) {
            return Err(bad(format!(
                "--comm-cut must be fp16 or a factor ≥ 1 that communication is divided by, got {cut}"
            )));
        }
    }
    match i.compute {
        Some(Compute::Throughput(t)) => {
            positive("--throughput", t)?;
        }
        Some(Compute::StepTimeS(s)) => {
            positive("--compute-ms", s * 1e3)?;
        }
        Some(Compute::MeasuredStepS(s)) => {
            positive("--step-ms", s * 1e3)?;
            if let Some(c) = i.comm_s {
                if c > s {
                    return Err(bad(format!(
                        "--comm-ms {} is longer than the whole step, --step-ms {}",
                        fmt_g(c * 1e3),
                        fmt_g(s * 1e3)
                    )));
                }
            }
        }
        None => {}
    }
    if let Some(lr) = i.base_lr {
        positive("--base-lr", lr)?;
    }
    if let Some(bb) = i.base_batch {
        at_least_one("--base-batch", bb)?;
    }
    if let Some(Warmup::Epochs(e)) = i.warmup {
        if !(e.is_finite() && e >= 0.0) {
            return Err(bad(format!(
                "--warmup-epochs must be zero or positive, got {e}"
            )));
        }
    }
    match i.gradient {
        Some(Gradient::Params(p)) => {
            at_least_one("--params", p)?;
        }
        Some(Gradient::Bytes(b)) => {
            at_least_one("--grad-bytes", b)?;
        }
        None => {}
    }
    Ok(())
}

/// Checks `input` and computes every output whose inputs are given; the others are
/// `None` with the reason in [`Plan::skipped`]. Errors are [`Error::InvalidArgument`]
/// naming the flag and the value: impossible values and contradictions only.
/// The batch and schedule figures of a plan (each, or why it is skipped).
struct Schedule {
    micro: Got<u64>,
    global_batch: Got<u64>,
    steps_per_epoch: Got<u64>,
    dropped: Got<u64>,
    total_steps: Got<u64>,
    lr_factor: Got<f64>,
    scaled_lr: Got<f64>,
    warmup_steps: Got<u64>,
    warmup_epochs: Got<f64>,
}

/// Batch, steps, learning rate and warmup; an error for contradictions (a dataset
/// smaller than the global batch, a warmup longer than the run).
fn schedule(i: &PlanInput, ranks: &Got<usize>) -> Result<Schedule> {
    let batch = given(i.per_rank_batch, "--per-rank-batch");
    let dataset = given(i.dataset_size, "--dataset-size");
    let micro: Got<u64> = match batch.clone() {
        Ok(b) => Ok(b
            .checked_mul(i.accumulation_steps)
            .ok_or_else(|| bad("--per-rank-batch × --accumulation-steps overflows".into()))?),
        Err(e) => Err(e),
    };
    let global_batch: Got<u64> = match (ranks.clone(), micro.clone()) {
        (Ok(n), Ok(m)) => Ok(m
            .checked_mul(n as u64)
            .ok_or_else(|| bad("global batch (ranks × batch × accumulation) overflows".into()))?),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let steps_per_epoch: Got<u64> = match (dataset.clone(), global_batch.clone()) {
        (Ok(d), Ok(g)) if d < g => {
            return Err(bad(format!(
                "--dataset-size {d} is smaller than the global batch {g}: no full step per epoch"
            )))
        }
        (Ok(d), Ok(g)) => Ok(d / g),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let dropped = (|| Ok(dataset.clone()? - steps_per_epoch.clone()? * global_batch.clone()?))();
    let total_steps: Got<u64> = match steps_per_epoch.clone() {
        Ok(s) => Ok(s
            .checked_mul(i.epochs)
            .ok_or_else(|| bad("total steps overflow".into()))?),
        Err(e) => Err(e),
    };
    let base_batch: Got<u64> = match i.base_batch {
        Some(bb) => Ok(bb),
        None => micro.clone(),
    };
    let lr_factor = (|| Ok(global_batch.clone()? as f64 / base_batch.clone()? as f64))();
    let scaled_lr = (|| Ok(given(i.base_lr, "--base-lr")? * lr_factor.clone()?))();
    let warmup_steps: Got<u64> = match i.warmup {
        None => Ok(0),
        Some(Warmup::Steps(s)) => Ok(s),
        Some(Warmup::Epochs(e)) => steps_per_epoch
            .clone()
            .map(|s| (e * s as f64).ceil() as u64),
    };
    if let (Ok(w), Ok(t)) = (&warmup_steps, &total_steps) {
        if w > t {
            return Err(bad(format!(
                "warmup of {w} steps is longer than the whole run ({t} steps)"
            )));
        }
    }
    let warmup_epochs = (|| Ok(warmup_steps.clone()? as f64 / steps_per_epoch.clone()? as f64))();
    Ok(Schedule {
        micro,
        global_batch,
        steps_per_epoch,
        dropped,
        total_steps,
        lr_factor,
        scaled_lr,
        warmup_steps,
        warmup_epochs,
    })
}

pub fn compute(input: &PlanInput) -> Result<Plan> {
    let i = input;
    check(i)?;
    let ranks = given(i.ranks, "--ranks");
    let Schedule {
        micro,
        global_batch,
        steps_per_epoch,
        dropped,
        total_steps,
        lr_factor,
        scaled_lr,
        warmup_steps,
        warmup_epochs,
    } = schedule(i, &ranks)?;

    // Compute.
    let no_compute = "needs --throughput, --compute-ms, or --step-ms with --comm-ms";
    let (single_rank_throughput, raw_compute): (Got<f64>, Got<f64>) = match i.compute {
        None => (Err(no_compute.into()), Err(no_compute.into())),
        Some(Compute::Throughput(t)) => (Ok(t), micro.clone().map(|m| m as f64 / t)),
        Some(Compute::StepTimeS(s)) => (micro.clone().map(|m| m as f64 / s), Ok(s)),
        Some(Compute::MeasuredStepS(s)) => match i.comm_s {
            Some(c) => (micro.clone().map(|m| m as f64 / (s - c)), Ok(s - c)),
            None => {
                let why = "needs --comm-ms: the part of --step-ms that is communication";
                (Err(why.into()), Err(why.into()))
            }
        },
    };
    let compute_s = raw_compute.map(|c| c / i.amp_speedup);
    let baseline_throughput = (|| Ok(micro.clone()? as f64 / compute_s.clone()?))();

    // Gradients and communication.
    let from_comm_ms = "communication given by --comm-ms";
    let size = i.grad_dtype.size() as f64;
    let params: Got<f64> = match (i.gradient, i.comm_s) {
        (Some(Gradient::Params(p)), _) => Ok(p as f64),
        (Some(Gradient::Bytes(b)), _) => Ok(b as f64 / size),
        (None, Some(_)) => Err(from_comm_ms.into()),
        (None, None) => Err("needs --params or --grad-bytes".into()),
    };
    let grad_bytes = params.clone().map(|p| p * size);
    let ring_bytes_per_rank = (|| Ok(ring_factor(ranks.clone()? as f64) * grad_bytes.clone()?))();
    let link: Got<&Link> = match (&i.link, i.comm_s) {
        (Some(l), _) => Ok(l),
        (None, Some(_)) => Err(from_comm_ms.into()),
        (None, None) => Err("needs --link or --bench".into()),
    };
    let ring = |bytes_per_param: f64| -> Got<f64> {
        let l = link.clone()?;
        Ok(ring_allreduce_s(
            ranks.clone()?,
            params.clone()? * bytes_per_param,
            l.alpha_s,
            l.beta_s_per_byte,
        ))
    };
    let comm_f32_s = ring(4.0);
    let comm_f16_s = ring(2.0);
    let cut = i.comm_cut.unwrap_or(1.0);
    let comm_s: Got<f64> = match (i.comm_s, ranks.clone()) {
        (Some(c), _) => Ok(c / cut),
        (None, Ok(1)) => Ok(0.0),
        (None, _) => ring(size).map(|c| c / cut),
    };
    let hidden_comm_s = comm_s.clone().map(|c| match &compute_s {
        Ok(t) => (i.overlap * c).min(*t),
        Err(_) => i.overlap * c,
    });
    let visible_comm_s = (|| Ok(comm_s.clone()? - hidden_comm_s.clone()?))();

    // Step and run. Without a communication figure, --overhead is the lump lost to it.
    let overhead = i.overhead.unwrap_or(0.0);
    let step_visible: Got<f64> = match (&visible_comm_s, i.overhead) {
        (Ok(v), _) => Ok(*v),
        (Err(_), Some(_)) => Ok(0.0),
        (Err(_), None) => Err("needs --link or --bench with --params, or --comm-ms, or \
             --overhead (the share lost to communication and the rest)"
            .into()),
    };
    let step_s = (|| Ok((compute_s.clone()? + step_visible.clone()?) / (1.0 - overhead)))();
    let comm_share = (|| Ok(visible_comm_s.clone()? / step_s.clone()?))();
    let throughput = (|| Ok(global_batch.clone()? as f64 / step_s.clone()?))();
    let speedup = (|| Ok(throughput.clone()? / baseline_throughput.clone()?))();
    let efficiency = (|| Ok(speedup.clone()? / ranks.clone()? as f64))();
    let epoch_s = (|| Ok(steps_per_epoch.clone()? as f64 * step_s.clone()?))();
    let total_s = epoch_s.clone().map(|e| e * i.epochs as f64);

    let mut skipped = BTreeMap::new();
    let mut out = |name: &str, g: Got<f64>| -> Option<f64> {
        g.map_err(|e| skipped.insert(name.to_string(), e)).ok()
    };
    let (alpha_s, beta_s_per_byte) = match link.clone() {
        Ok(l) => (Ok(l.alpha_s), Ok(l.beta_s_per_byte)),
        Err(e) => (Err(e.clone()), Err(e)),
    };
    let link_bytes_per_s = beta_s_per_byte.clone().map(|b| 1.0 / b);
    let mut plan = Plan {
        input: input.clone(),
        global_batch: None,
        steps_per_epoch: None,
        dropped_samples_per_epoch: None,
        total_steps: None,
        lr_factor: out("lr_factor", lr_factor),
        scaled_lr: out("scaled_lr", scaled_lr),
        warmup_steps: None,
        warmup_epochs: out("warmup_epochs", warmup_epochs),
        single_rank_throughput: out("single_rank_throughput", single_rank_throughput),
        compute_s: out("compute_s", compute_s),
        baseline_throughput: out("baseline_throughput", baseline_throughput),
        params: out("params", params),
        grad_bytes: out("grad_bytes", grad_bytes),
        ring_bytes_per_rank: out("ring_bytes_per_rank", ring_bytes_per_rank),
        alpha_s: out("alpha_s", alpha_s),
        beta_s_per_byte: out("beta_s_per_byte", beta_s_per_byte),
        link_bytes_per_s: out("link_bytes_per_s", link_bytes_per_s),
        comm_s: out("comm_s", comm_s),
        comm_f32_s: out("comm_f32_s", comm_f32_s),
        comm_f16_s: out("comm_f16_s", comm_f16_s),
        hidden_comm_s: out("hidden_comm_s", hidden_comm_s),
        visible_comm_s: out("visible_comm_s", visible_comm_s),
        step_s: out("step_s", step_s),
        comm_share: out("comm_share", comm_share),
        throughput: out("throughput", throughput),
        speedup: out("speedup", speedup),
        efficiency: out("efficiency", efficiency),
        epoch_s: out("epoch_s", epoch_s),
        total_s: out("total_s", total_s),
        skipped: BTreeMap::new(),
    };
    let mut count = |name: &str, g: Got<u64>| -> Option<u64> {
        g.map_err(|e| skipped.insert(name.to_string(), e)).ok()
    };
    plan.global_batch = count("global_batch", global_batch);
    plan.steps_per_epoch = count("steps_per_epoch", steps_per_epoch);
    plan.dropped_samples_per_epoch = count("dropped_samples_per_epoch", dropped);
    plan.total_steps = count("total_steps", total_steps);
    plan.warmup_steps = count("warmup_steps", warmup_steps);
    plan.skipped = skipped;
    Ok(plan)
}
