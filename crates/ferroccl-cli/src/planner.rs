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

use ferroccl::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

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
fn ring_factor(n: f64) -> f64 {
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
pub fn compute(input: &PlanInput) -> Result<Plan> {
    let i = input;
    check(i)?;
    let ranks = given(i.ranks, "--ranks");
    let batch = given(i.per_rank_batch, "--per-rank-batch");
    let dataset = given(i.dataset_size, "--dataset-size");

    // Batch and schedule.
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

/// Splits `s` into its leading number and the rest.
fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .char_indices()
        .find(|&(k, c)| {
            !(c.is_ascii_digit()
                || c == '.'
                || c == '_'
                || ((c == 'e' || c == 'E')
                    && s[k + 1..]
                        .starts_with(|d: char| d.is_ascii_digit() || d == '-' || d == '+'))
                || ((c == '-' || c == '+')
                    && (k == 0 || s[..k].ends_with('e') || s[..k].ends_with('E'))))
        })
        .map_or(s.len(), |(k, _)| k);
    (&s[..end], s[end..].trim())
}

fn parse_number(flag: &str, text: &str, num: &str) -> Result<f64> {
    num.replace('_', "")
        .parse::<f64>()
        .map_err(|_| bad(format!("{flag} {text:?}: {num:?} is not a number")))
}

/// Parses a link bandwidth with an explicit unit into bytes/s.
///
/// Decimal prefixes k, M, G, T (×10³ …); bits as `bit`, `b`, `bps` (`10Gbit`,
/// `10Gbit/s`, `10Gbps`, `10Gb/s`), bytes as `B` (`1.25GB`, `1.25GB/s`, `1.25GBps`).
/// A bare number is refused: bits or bytes must be said.
pub fn parse_bandwidth(text: &str) -> Result<f64> {
    parse_rate("--link", text)
}

/// [`parse_bandwidth`] for any flag: `flag` names the input in errors. tc's spellings
/// (`500mbit`, `2.5gbit`) are accepted too: a lower-case `m` is mega, as in tc.
pub fn parse_rate(flag: &str, text: &str) -> Result<f64> {
    let t = text.trim();
    let (num, unit) = split_number(t);
    let v = parse_number(flag, text, num)?;
    let unit_help = "give a unit: 10Gbit, 10Gbit/s, 10Gbps, 1.25GB or 1.25GB/s";
    if unit.is_empty() {
        return Err(bad(format!("{flag} {text:?} has no unit; {unit_help}")));
    }
    let u = unit
        .strip_suffix("/s")
        .or_else(|| unit.strip_suffix("ps"))
        .unwrap_or(unit);
    let (scale, rest) = match u.chars().next() {
        Some('k' | 'K') => (1e3, &u[1..]),
        Some('M' | 'm') => (1e6, &u[1..]),
        Some('G' | 'g') => (1e9, &u[1..]),
        Some('T' | 't') => (1e12, &u[1..]),
        _ => (1.0, u),
    };
    let per_byte = match rest {
        "B" | "byte" | "Byte" | "bytes" => 1.0,
        "b" => 0.125,
        r if r.eq_ignore_ascii_case("bit") || r.eq_ignore_ascii_case("bits") => 0.125,
        _ => {
            return Err(bad(format!(
                "{flag} {text:?}: unknown unit {unit:?}; {unit_help}"
            )))
        }
    };
    let bytes_per_s = v * scale * per_byte;
    if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
        return Err(bad(format!(
            "{flag} must be a positive bandwidth, got {text:?}"
        )));
    }
    Ok(bytes_per_s)
}

/// Parses a count such as `25.6M`, `1281167`, `1.2e6` or `64Mi` (k/K, M, G, T decimal;
/// Ki, Mi, Gi, Ti binary), rounded to the nearest integer. With `bytes`, a trailing
/// `B` is allowed (`102.4MB`). `flag` names the input in errors.
pub fn parse_count(flag: &str, text: &str, bytes: bool) -> Result<u64> {
    let t = text.trim();
    let (num, unit) = split_number(t);
    let v = parse_number(flag, text, num)?;
    let unit = if bytes {
        unit.strip_suffix('B').unwrap_or(unit)
    } else {
        unit
    };
    let scale = match unit {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(format!(
                "{flag} {text:?}: unknown suffix {unit:?} (use K, M, G, T or Ki, Mi, Gi, Ti)"
            )))
        }
    };
    let x = (v * scale).round();
    if !(x.is_finite() && x >= 0.0 && x <= u64::MAX as f64) {
        return Err(bad(format!(
            "{flag} must be a non-negative count, got {text:?}"
        )));
    }
    Ok(x as u64)
}

#[derive(Deserialize)]
struct BenchFile {
    ranks: Option<usize>,
    rows: Option<Vec<BenchRow>>,
    fit: Option<BenchFit>,
}

#[derive(Deserialize)]
struct BenchRow {
    bytes: f64,
    ip_time_us: f64,
}

#[derive(Deserialize)]
struct BenchFit {
    alpha_s: f64,
    beta_s_per_byte: f64,
}

/// The link model from the text of a `ferroccl bench --json` file (`name` is the file,
/// for messages): its `fit` object when present, otherwise a least-squares fit of the
/// rows' in-place times (see the module docs). A file that does not parse, has no rows
/// to fit, or yields β ≤ 0 is an [`Error::Config`] naming the file and the problem.
pub fn link_from_bench_json(text: &str, name: &str) -> Result<Link> {
    let err = |what: String| Error::Config(format!("bench file {name}: {what}"));
    let file: BenchFile = serde_json::from_str(text)
        .map_err(|e| err(format!("not a `ferroccl bench --json` file: {e}")))?;
    let check = |alpha: f64, beta: f64, how: &str| -> Result<()> {
        if !(beta.is_finite() && beta > 0.0) {
            return Err(err(format!(
                "{how} gives β = {beta} s/B, which is not positive: times do not grow with size"
            )));
        }
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(err(format!("{how} gives α = {alpha} s, which is negative")));
        }
        Ok(())
    };
    if let Some(f) = file.fit {
        check(f.alpha_s, f.beta_s_per_byte, "its `fit` object")?;
        return Ok(Link {
            alpha_s: f.alpha_s,
            beta_s_per_byte: f.beta_s_per_byte,
            source: format!("bench file {name} (its fit object)"),
        });
    }
    let rows = file
        .rows
        .ok_or_else(|| err("has no `rows` and no `fit` object".into()))?;
    let n = file
        .ranks
        .ok_or_else(|| err("has no `ranks`: the fit needs the bench's world size".into()))?;
    if n < 2 {
        return Err(err(format!(
            "was measured with {n} rank(s): there is no link to fit"
        )));
    }
    if rows.len() < 2 {
        return Err(err(format!(
            "has {} row(s): fitting α and β needs at least two sizes",
            rows.len()
        )));
    }
    for (k, r) in rows.iter().enumerate() {
        if !(r.bytes.is_finite()
            && r.bytes >= 0.0
            && r.ip_time_us.is_finite()
            && r.ip_time_us >= 0.0)
        {
            return Err(err(format!(
                "row {k}: bytes {} and ip_time_us {} must be non-negative numbers",
                r.bytes, r.ip_time_us
            )));
        }
    }
    let (c, m) = crate::law::fit_line(rows.iter().map(|r| (r.bytes, r.ip_time_us * 1e-6)))
        .ok_or_else(|| {
            err("all rows have the same size: fitting needs at least two sizes".into())
        })?;
    let nf = n as f64;
    let alpha = c / (2.0 * (nf - 1.0));
    let beta = m / ring_factor(nf);
    check(alpha, beta, "the least-squares fit")?;
    Ok(Link {
        alpha_s: alpha,
        beta_s_per_byte: beta,
        source: format!(
            "bench file {name}: least-squares fit of t = 2(n-1)·α + 2(n-1)/n·S·β over {} in-place rows, n = {n}",
            rows.len()
        ),
    })
}

/// `x` to 6 significant digits, without trailing zeros.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{}", if x == 0.0 { 0.0 } else { x });
    }
    let r: f64 = format!("{x:.5e}").parse().unwrap_or(x);
    format!("{r}")
}

/// A duration in seconds in a readable unit (µs, ms, s; with days/hours/minutes from a
/// minute up).
pub fn fmt_time(s: f64) -> String {
    let a = s.abs();
    if s == 0.0 {
        "0 s".into()
    } else if a < 1e-3 {
        format!("{} µs", fmt_g(s * 1e6))
    } else if a < 1.0 {
        format!("{} ms", fmt_g(s * 1e3))
    } else if a < 60.0 {
        format!("{} s", fmt_g(s))
    } else {
        format!("{} s ({})", fmt_g(s), fmt_dhms(s))
    }
}

fn fmt_dhms(s: f64) -> String {
    let t = s.round() as u64;
    let (d, h, m, sec) = (t / 86400, t / 3600 % 24, t / 60 % 60, t % 60);
    if d > 0 {
        format!("{d}d {h:02}h {m:02}m {sec:02}s")
    } else if h > 0 {
        format!("{h}h {m:02}m {sec:02}s")
    } else {
        format!("{m}m {sec:02}s")
    }
}

/// Bytes in decimal units (kB, MB, GB, TB: powers of 1000).
pub fn fmt_bytes(b: f64) -> String {
    let a = b.abs();
    let (v, u) = if a >= 1e12 {
        (b / 1e12, "TB")
    } else if a >= 1e9 {
        (b / 1e9, "GB")
    } else if a >= 1e6 {
        (b / 1e6, "MB")
    } else if a >= 1e3 {
        (b / 1e3, "kB")
    } else {
        (b, "B")
    };
    format!("{} {u}", fmt_g(v))
}

/// A bandwidth in bytes/s, also in bits/s: `1.25 GB/s (10 Gbit/s)`.
pub fn fmt_rate(bytes_per_s: f64) -> String {
    let bits = bytes_per_s * 8.0;
    let (v, u) = if bits >= 1e12 {
        (bits / 1e12, "Tbit/s")
    } else if bits >= 1e9 {
        (bits / 1e9, "Gbit/s")
    } else if bits >= 1e6 {
        (bits / 1e6, "Mbit/s")
    } else {
        (bits / 1e3, "kbit/s")
    };
    format!("{}/s ({} {u})", fmt_bytes(bytes_per_s), fmt_g(v))
}

fn pct(x: f64) -> String {
    format!("{} %", fmt_g(x * 100.0))
}

impl Plan {
    /// One report line: the output's formula with its numbers, or why it is skipped.
    fn row(&self, o: &mut String, label: &str, key: &str, text: Option<String>) {
        let _ = match text {
            Some(t) => writeln!(o, "  {label:<24} = {t}"),
            None => writeln!(
                o,
                "  {label:<24}   skipped: {}",
                self.skipped.get(key).map_or("not given", String::as_str)
            ),
        };
    }

    /// The human report: one line per output, each with its formula, the numbers put
    /// into it and the result, or the reason it is skipped.
    pub fn render(&self) -> String {
        let i = &self.input;
        let k = i.accumulation_steps;
        let (n, b) = (
            i.ranks.map_or("N".into(), |x| x.to_string()),
            i.per_rank_batch.map_or("b".into(), |x| x.to_string()),
        );
        let dt = i.grad_dtype;
        let mut o = String::new();
        let mut what = Vec::new();
        if let Some(r) = i.ranks {
            what.push(format!("{r} rank(s)"));
        }
        if let Some(pb) = i.per_rank_batch {
            what.push(format!("{pb} samples × {k} accumulation step(s) per rank"));
        }
        if let Some(d) = i.dataset_size {
            what.push(format!("{} epoch(s) of {d} samples", i.epochs));
        }
        if i.gradient.is_some() {
            what.push(format!("ring all-reduce of {} gradients", dt.name()));
        }
        if what.is_empty() {
            what.push("no ranks, batch, data or gradients given".into());
        }
        let _ = writeln!(o, "# ferroccl plan: {}", what.join(", "));
        if let (Some(l), Some(a), Some(beta), Some(rate)) = (
            &i.link,
            self.alpha_s,
            self.beta_s_per_byte,
            self.link_bytes_per_s,
        ) {
            let _ = writeln!(
                o,
                "# link: {}: α = {}, β = {} ns/B, 1/β = {}",
                l.source,
                fmt_time(a),
                fmt_g(beta * 1e9),
                fmt_rate(rate)
            );
        }
        let _ = writeln!(o, "batch and schedule");
        self.row(
            &mut o,
            "global batch",
            "global_batch",
            self.global_batch.map(|g| {
                format!("ranks × per-rank batch × accumulation steps = {n} × {b} × {k} = {g}")
            }),
        );
        self.row(&mut o, "steps per epoch", "steps_per_epoch", (|| {
            Some(format!(
                "floor(dataset size / global batch) = floor({} / {}) = {}  (drop_last: {} samples left out per epoch)",
                i.dataset_size?, self.global_batch?, self.steps_per_epoch?, self.dropped_samples_per_epoch?
            ))
        })());
        self.row(
            &mut o,
            "total steps",
            "total_steps",
            (|| {
                Some(format!(
                    "steps per epoch × epochs = {} × {} = {}",
                    self.steps_per_epoch?, i.epochs, self.total_steps?
                ))
            })(),
        );
        let base_batch = |g: u64, f: f64| match i.base_batch {
            Some(bb) => format!("{bb}"),
            None => format!("{} (the single-rank batch b × k)", fmt_g(g as f64 / f)),
        };
        self.row(
            &mut o,
            "lr factor",
            "lr_factor",
            (|| {
                let (g, f) = (self.global_batch?, self.lr_factor?);
                Some(format!(
                    "global batch / base batch = {g} / {} = {}  (linear scaling rule)",
                    base_batch(g, f),
                    fmt_g(f)
                ))
            })(),
        );
        self.row(
            &mut o,
            "scaled lr",
            "scaled_lr",
            (|| {
                let (g, f) = (self.global_batch?, self.lr_factor?);
                Some(format!(
                    "base lr × global batch / base batch = {} × {g} / {} = {}",
                    fmt_g(i.base_lr?),
                    base_batch(g, f),
                    fmt_g(self.scaled_lr?)
                ))
            })(),
        );
        match i.warmup {
            Some(Warmup::Epochs(e)) => self.row(
                &mut o,
                "warmup steps",
                "warmup_steps",
                (|| {
                    Some(format!(
                        "ceil(warmup epochs × steps per epoch) = ceil({} × {}) = {}",
                        fmt_g(e),
                        self.steps_per_epoch?,
                        self.warmup_steps?
                    ))
                })(),
            ),
            Some(Warmup::Steps(s)) => self.row(
                &mut o,
                "warmup steps",
                "warmup_epochs",
                (|| {
                    Some(format!(
                        "given = {s}  (= {s} / {} = {} epochs)",
                        self.steps_per_epoch?,
                        fmt_g(self.warmup_epochs?)
                    ))
                })(),
            ),
            None => {}
        }
        if let (Some(lr), Some(w)) = (self.scaled_lr, self.warmup_steps.filter(|&w| w > 0)) {
            self.row(
                &mut o,
                "lr schedule",
                "",
                Some(format!(
                    "linear warmup to {} over steps 0..{w}, then your decay",
                    fmt_g(lr)
                )),
            );
        }

        let _ = writeln!(o, "compute");
        let amp = fmt_g(i.amp_speedup);
        let ct = self.compute_s.map(fmt_time);
        let thr = self.single_rank_throughput.map(fmt_g);
        match i.compute {
            Some(Compute::Throughput(t)) => {
                self.row(
                    &mut o,
                    "single-rank throughput",
                    "",
                    Some(format!("given = {} samples/s", fmt_g(t))),
                );
                self.row(&mut o, "compute per step", "compute_s", ct.map(|c| format!(
                    "per-rank batch × accumulation / single-rank throughput / amp speed-up = {b} × {k} / {} / {amp} = {c}",
                    fmt_g(t)
                )));
            }
            Some(Compute::StepTimeS(s)) => {
                self.row(
                    &mut o,
                    "compute per step",
                    "compute_s",
                    ct.map(|c| {
                        format!(
                            "given compute time / amp speed-up = {} / {amp} = {c}",
                            fmt_time(s)
                        )
                    }),
                );
                self.row(&mut o, "single-rank throughput", "single_rank_throughput", thr.map(|t| format!(
                    "per-rank batch × accumulation / given compute time = {b} × {k} / {} = {t} samples/s",
                    fmt_time(s)
                )));
            }
            Some(Compute::MeasuredStepS(s)) => {
                self.row(
                    &mut o,
                    "compute per step",
                    "compute_s",
                    (|| {
                        Some(format!(
                            "(step − communication) / amp speed-up = ({} − {}) / {amp} = {}",
                            fmt_time(s),
                            fmt_time(i.comm_s?),
                            ct.clone()?
                        ))
                    })(),
                );
                self.row(
                    &mut o,
                    "single-rank throughput",
                    "single_rank_throughput",
                    thr.map(|t| {
                        format!(
                    "per-rank batch × accumulation / (step − communication) = {t} samples/s"
                )
                    }),
                );
            }
            None => self.row(&mut o, "compute per step", "compute_s", None),
        }

        let _ = writeln!(o, "gradients and communication");
        let cut = i.comm_cut.unwrap_or(1.0);
        if let Some(given) = i.comm_s {
            self.row(
                &mut o,
                "comm per step",
                "comm_s",
                self.comm_s.map(|c| {
                    format!(
                        "given communication / cut = {} / {} = {c}",
                        fmt_time(given),
                        fmt_g(cut),
                        c = fmt_time(c)
                    )
                }),
            );
        } else {
            let grad = match i.gradient {
                Some(Gradient::Params(p)) => self.grad_bytes.map(|s| {
                    format!(
                        "params × {} B ({}) = {p} × {} = {}",
                        dt.size(),
                        dt.name(),
                        dt.size(),
                        fmt_bytes(s)
                    )
                }),
                Some(Gradient::Bytes(s)) => self.params.map(|p| {
                    format!(
                        "given = {}  (params = S / {} B ({}) = {})",
                        fmt_bytes(s as f64),
                        dt.size(),
                        dt.name(),
                        fmt_g(p)
                    )
                }),
                None => None,
            };
            self.row(&mut o, "gradient bytes S", "grad_bytes", grad);
            self.row(
                &mut o,
                "ring bytes per rank",
                "ring_bytes_per_rank",
                (|| {
                    let n = i.ranks?;
                    Some(format!(
                        "2(N-1)/N × S = 2 × {} / {n} × {} = {}",
                        n - 1,
                        fmt_bytes(self.grad_bytes?),
                        fmt_bytes(self.ring_bytes_per_rank?)
                    ))
                })(),
            );
            let variants = [
                (
                    "comm per step, f32",
                    "comm_f32_s",
                    4.0,
                    self.comm_f32_s,
                    dt == GradDtype::F32,
                ),
                (
                    "comm per step, f16/bf16",
                    "comm_f16_s",
                    2.0,
                    self.comm_f16_s,
                    dt != GradDtype::F32,
                ),
            ];
            for (label, key, size, t, used) in variants {
                self.row(
                    &mut o,
                    label,
                    key,
                    (|| {
                        let n = i.ranks?;
                        Some(format!(
                            "2(N-1)·α + 2(N-1)/N·S·β = {} × {} + {} × {} ns/B = {}{}",
                            2 * (n - 1),
                            fmt_time(self.alpha_s?),
                            fmt_bytes(ring_factor(n as f64) * self.params? * size),
                            fmt_g(self.beta_s_per_byte? * 1e9),
                            fmt_time(t?),
                            if used { "  (used)" } else { "" }
                        ))
                    })(),
                );
            }
            if i.ranks == Some(1) && self.comm_f32_s.is_none() {
                self.row(
                    &mut o,
                    "comm per step",
                    "",
                    Some("0 s  (one rank: nothing to all-reduce)".into()),
                );
            }
            if cut != 1.0 {
                self.row(
                    &mut o,
                    "comm after cut",
                    "comm_s",
                    self.comm_s.map(|c| {
                        format!(
                            "comm / cut = {} / {} = {}",
                            fmt_time(c * cut),
                            fmt_g(cut),
                            fmt_time(c)
                        )
                    }),
                );
            }
        }
        self.row(
            &mut o,
            "hidden by overlap",
            "hidden_comm_s",
            (|| {
                let (c, h) = (self.comm_s?, self.hidden_comm_s?);
                Some(match self.compute_s {
                    Some(t) => format!(
                        "min(overlap × comm, compute) = min({} × {}, {}) = {}",
                        fmt_g(i.overlap),
                        fmt_time(c),
                        fmt_time(t),
                        fmt_time(h)
                    ),
                    None => format!(
                        "overlap × comm = {} × {} = {}  (compute unknown: not capped by it)",
                        fmt_g(i.overlap),
                        fmt_time(c),
                        fmt_time(h)
                    ),
                })
            })(),
        );
        self.row(
            &mut o,
            "visible comm",
            "visible_comm_s",
            (|| {
                Some(format!(
                    "comm − hidden = {} − {} = {}",
                    fmt_time(self.comm_s?),
                    fmt_time(self.hidden_comm_s?),
                    fmt_time(self.visible_comm_s?)
                ))
            })(),
        );

        let _ = writeln!(o, "step and run");
        let oh = fmt_g(i.overhead.unwrap_or(0.0));
        self.row(&mut o, "step time", "step_s", (|| {
            let (c, s) = (self.compute_s?, self.step_s?);
            Some(match self.visible_comm_s {
                Some(v) => format!(
                    "(compute + visible comm) / (1 − overhead) = ({} + {}) / (1 − {oh}) = {}",
                    fmt_time(c), fmt_time(v), fmt_time(s)
                ),
                None => format!(
                    "compute / (1 − overhead) = {} / (1 − {oh}) = {}  (--overhead is all that is lost to communication and the rest)",
                    fmt_time(c), fmt_time(s)
                ),
            })
        })());
        self.row(
            &mut o,
            "comm share",
            "comm_share",
            (|| {
                Some(format!(
                    "visible comm / step time = {} / {} = {}",
                    fmt_time(self.visible_comm_s?),
                    fmt_time(self.step_s?),
                    pct(self.comm_share?)
                ))
            })(),
        );
        self.row(&mut o, "throughput", "throughput", (|| Some(format!(
            "ranks × per-rank batch × accumulation / step time = {n} × {b} × {k} / {} = {} samples/s",
            fmt_time(self.step_s?),
            fmt_g(self.throughput?)
        )))());
        self.row(
            &mut o,
            "speedup",
            "speedup",
            (|| {
                Some(format!(
                    "throughput / (per-rank batch × accumulation / compute) = {} / {} = {}",
                    fmt_g(self.throughput?),
                    fmt_g(self.baseline_throughput?),
                    fmt_g(self.speedup?)
                ))
            })(),
        );
        self.row(
            &mut o,
            "efficiency",
            "efficiency",
            (|| {
                Some(format!(
                    "speedup / ranks = {} / {n} = {}",
                    fmt_g(self.speedup?),
                    pct(self.efficiency?)
                ))
            })(),
        );
        self.row(
            &mut o,
            "time per epoch",
            "epoch_s",
            (|| {
                Some(format!(
                    "steps per epoch × step time = {} × {} = {}",
                    self.steps_per_epoch?,
                    fmt_time(self.step_s?),
                    fmt_time(self.epoch_s?)
                ))
            })(),
        );
        self.row(
            &mut o,
            "total time",
            "total_s",
            (|| {
                Some(format!(
                    "time per epoch × epochs = {} × {} = {}",
                    fmt_time(self.epoch_s?),
                    i.epochs,
                    fmt_time(self.total_s?)
                ))
            })(),
        );
        o
    }

    /// Every input and output as one pretty-printed JSON object.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("writing the plan as JSON: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// |got − want| ≤ 1e-12 × |want| (or 1e-15 absolute near zero).
    #[track_caller]
    fn close(got: impl Into<Option<f64>>, want: f64) {
        let got = got.into().expect("computed, not skipped");
        let tol = 1e-12 * want.abs().max(1e-3);
        assert!(
            (got - want).abs() <= tol,
            "got {got}, want {want} (diff {})",
            got - want
        );
    }

    /// Case A: ResNet-50-ish on ImageNet, 8 ranks on a 10 Gbit/s link, no overlap.
    fn case_a() -> PlanInput {
        PlanInput {
            ranks: Some(8),
            per_rank_batch: Some(32),
            accumulation_steps: 1,
            dataset_size: Some(1_281_167),
            epochs: 90,
            compute: Some(Compute::Throughput(400.0)),
            amp_speedup: 1.0,
            base_lr: Some(0.1),
            base_batch: Some(256),
            warmup: Some(Warmup::Epochs(5.0)),
            gradient: Some(Gradient::Params(25_600_000)),
            grad_dtype: GradDtype::F32,
            link: Some(Link::from_bandwidth(1.25e9, 0.0, "10Gbit")),
            overlap: 0.0,
            overhead: Some(0.0),
            comm_s: None,
            comm_cut: None,
        }
    }

    #[test]
    fn case_a_by_hand() {
        let p = compute(&case_a()).expect("valid");
        // global batch = 8 × 32 × 1 = 256
        assert_eq!(p.global_batch, Some(256));
        // steps per epoch = floor(1281167 / 256) = 5004 (5004 × 256 = 1281024, 143 left)
        assert_eq!(p.steps_per_epoch, Some(5004));
        assert_eq!(p.dropped_samples_per_epoch, Some(143));
        // total steps = 5004 × 90 = 450360
        assert_eq!(p.total_steps, Some(450_360));
        // lr = 0.1 × 256 / 256 = 0.1; warmup = ceil(5 × 5004) = 25020
        close(p.scaled_lr.expect("lr"), 0.1);
        assert_eq!(p.warmup_steps, Some(25_020));
        close(p.warmup_epochs, 5.0);
        // compute = 32 × 1 / 400 / 1 = 0.08 s
        close(p.compute_s, 0.08);
        close(p.baseline_throughput, 400.0);
        // S = 25.6e6 × 4 = 102.4e6 B; ring bytes = 2 × 7/8 × 102.4e6 = 179.2e6 B
        close(p.grad_bytes, 102.4e6);
        close(p.ring_bytes_per_rank, 179.2e6);
        // β = 1 / 1.25e9 = 0.8 ns/B; comm = 14 × 0 + 179.2e6 × 0.8e-9 = 0.14336 s
        close(p.beta_s_per_byte, 0.8e-9);
        close(p.link_bytes_per_s, 1.25e9);
        close(p.comm_s, 0.14336);
        close(p.comm_f32_s, 0.14336);
        // f16 halves it: 89.6e6 × 0.8e-9 = 0.07168 s
        close(p.comm_f16_s, 0.07168);
        // no overlap: visible = comm; step = 0.08 + 0.14336 = 0.22336 s
        close(p.hidden_comm_s, 0.0);
        close(p.visible_comm_s, 0.14336);
        close(p.step_s, 0.22336);
        // share = 0.14336 / 0.22336 = 0.6418338...
        close(p.comm_share, 0.14336 / 0.22336);
        // throughput = 256 / 0.22336 = 1146.1318... samples/s
        close(p.throughput, 256.0 / 0.22336);
        // speedup = 1146.13 / 400 = 2.86533; efficiency = 0.08 / 0.22336 = 0.358166
        close(p.speedup, 256.0 / 0.22336 / 400.0);
        close(p.efficiency, 0.08 / 0.22336);
        // epoch = 5004 × 0.22336 = 1117.69344 s; total = 90 × that = 100592.4096 s
        close(p.epoch_s, 1117.69344);
        close(p.total_s, 100592.4096);
    }

    /// Case B: accumulation, AMP, bf16 gradients, α, partial overlap and an overhead.
    #[test]
    fn case_b_by_hand() {
        let input = PlanInput {
            ranks: Some(4),
            per_rank_batch: Some(64),
            accumulation_steps: 2,
            dataset_size: Some(100_000),
            epochs: 3,
            compute: Some(Compute::Throughput(1000.0)),
            amp_speedup: 2.0,
            base_lr: Some(0.1),
            base_batch: Some(256),
            warmup: Some(Warmup::Steps(100)),
            gradient: Some(Gradient::Params(10_000_000)),
            grad_dtype: GradDtype::BF16,
            // 100 Gbit/s = 12.5e9 B/s; α = 10 µs
            link: Some(Link::from_bandwidth(12.5e9, 10e-6, "100Gbit")),
            overlap: 0.75,
            overhead: Some(0.1),
            comm_s: None,
            comm_cut: None,
        };
        let p = compute(&input).expect("valid");
        // G = 4 × 64 × 2 = 512; steps = floor(100000 / 512) = 195 (99840, 160 left); 585 in all
        assert_eq!(p.global_batch, Some(512));
        assert_eq!(p.steps_per_epoch, Some(195));
        assert_eq!(p.dropped_samples_per_epoch, Some(160));
        assert_eq!(p.total_steps, Some(585));
        // lr = 0.1 × 512 / 256 = 0.2; warmup given: 100 steps = 100/195 epochs
        close(p.scaled_lr.expect("lr"), 0.2);
        assert_eq!(p.warmup_steps, Some(100));
        close(p.warmup_epochs, 100.0 / 195.0);
        // compute = 64 × 2 / 1000 / 2 = 0.064 s; baseline = 128 / 0.064 = 2000 samples/s
        close(p.compute_s, 0.064);
        close(p.baseline_throughput, 2000.0);
        // S = 10e6 × 2 = 20e6 B; ring = 2 × 3/4 × 20e6 = 30e6 B
        close(p.grad_bytes, 20e6);
        close(p.ring_bytes_per_rank, 30e6);
        // comm = 2·3·10e-6 + 30e6 / 12.5e9 = 60e-6 + 2.4e-3 = 2.46e-3 s
        close(p.comm_s, 2.46e-3);
        close(p.comm_f16_s, 2.46e-3);
        // f32: 60e-6 + 60e6 / 12.5e9 = 60e-6 + 4.8e-3 = 4.86e-3 s
        close(p.comm_f32_s, 4.86e-3);
        // hidden = min(0.75 × 2.46e-3, 0.064) = 1.845e-3; visible = 0.615e-3
        close(p.hidden_comm_s, 1.845e-3);
        close(p.visible_comm_s, 0.615e-3);
        // step = (0.064 + 0.000615) / 0.9 = 0.071794444... s
        close(p.step_s, 0.064615 / 0.9);
        // throughput = 512 / 0.0717944 = 460.8 / 0.064615 = 7131.47 samples/s
        close(p.throughput, 460.8 / 0.064615);
        // speedup = 7131.47 / 2000 = 3.56574; efficiency = 0.891434
        close(p.speedup, 460.8 / 0.064615 / 2000.0);
        close(p.efficiency, 460.8 / 0.064615 / 8000.0);
        // share = 0.000615 / 0.0717944 = 0.0085661
        close(p.comm_share, 0.000615 * 0.9 / 0.064615);
        // epoch = 195 × 0.0717944 = 13.99992 s; total = 3 × that = 41.99975 s
        close(p.epoch_s, 195.0 * 0.064615 / 0.9);
        close(p.total_s, 585.0 * 0.064615 / 0.9);
    }

    /// Case C: overlap cannot hide more communication than there is compute.
    #[test]
    fn case_c_overlap_capped_by_compute() {
        let input = PlanInput {
            ranks: Some(2),
            per_rank_batch: Some(16),
            accumulation_steps: 1,
            dataset_size: Some(3200),
            epochs: 2,
            compute: Some(Compute::StepTimeS(0.010)),
            amp_speedup: 1.0,
            base_lr: None,
            base_batch: None,
            warmup: None,
            gradient: Some(Gradient::Params(100_000_000)),
            grad_dtype: GradDtype::F32,
            link: Some(Link::from_bandwidth(1.25e9, 0.0, "1.25GB")),
            overlap: 0.5,
            overhead: Some(0.0),
            comm_s: None,
            comm_cut: None,
        };
        let p = compute(&input).expect("valid");
        // G = 32; steps = 3200 / 32 = 100, nothing dropped; 200 in all
        assert_eq!(
            (p.global_batch, p.steps_per_epoch, p.total_steps),
            (Some(32), Some(100), Some(200))
        );
        assert_eq!(p.dropped_samples_per_epoch, Some(0));
        assert_eq!(p.scaled_lr, None);
        assert_eq!(p.warmup_steps, Some(0));
        // single rank: 16 / 0.01 = 1600 samples/s
        close(p.single_rank_throughput, 1600.0);
        // S = 400e6 B; ring = 2 × 1/2 × 400e6 = 400e6 B; comm = 400e6 / 1.25e9 = 0.32 s
        close(p.ring_bytes_per_rank, 400e6);
        close(p.comm_s, 0.32);
        close(p.comm_f16_s, 0.16);
        // hidden = min(0.5 × 0.32, 0.01) = 0.01 (not 0.16); visible = 0.31; step = 0.32
        close(p.hidden_comm_s, 0.01);
        close(p.visible_comm_s, 0.31);
        close(p.step_s, 0.32);
        // throughput = 32 / 0.32 = 100; speedup = 100 / 1600 = 0.0625; efficiency 0.03125
        close(p.throughput, 100.0);
        close(p.speedup, 0.0625);
        close(p.efficiency, 0.03125);
        close(p.comm_share, 0.31 / 0.32);
        // epoch = 100 × 0.32 = 32 s; total = 64 s
        close(p.epoch_s, 32.0);
        close(p.total_s, 64.0);
    }

    /// Case D: gradient bytes given in f16, odd world size, full overlap, AMP on a given
    /// compute time, fractional warmup epochs.
    #[test]
    fn case_d_full_overlap_odd_ranks() {
        let input = PlanInput {
            ranks: Some(3),
            per_rank_batch: Some(10),
            accumulation_steps: 4,
            dataset_size: Some(1000),
            epochs: 2,
            compute: Some(Compute::StepTimeS(0.2)),
            amp_speedup: 1.6,
            base_lr: Some(0.4),
            base_batch: Some(480),
            warmup: Some(Warmup::Epochs(0.5)),
            gradient: Some(Gradient::Bytes(30_000_000)),
            grad_dtype: GradDtype::F16,
            // 8 Gbit/s = 1e9 B/s, α = 100 µs
            link: Some(Link::from_bandwidth(1e9, 100e-6, "8Gbit")),
            overlap: 1.0,
            overhead: Some(0.0),
            comm_s: None,
            comm_cut: None,
        };
        let p = compute(&input).expect("valid");
        // G = 3 × 10 × 4 = 120; steps = floor(1000 / 120) = 8 (960, 40 left); 16 in all
        assert_eq!(
            (
                p.global_batch,
                p.steps_per_epoch,
                p.dropped_samples_per_epoch
            ),
            (Some(120), Some(8), Some(40))
        );
        // lr = 0.4 × 120 / 480 = 0.1; warmup = ceil(0.5 × 8) = 4
        close(p.scaled_lr.expect("lr"), 0.1);
        assert_eq!(p.warmup_steps, Some(4));
        // single rank = 40 / 0.2 = 200; compute = 0.2 / 1.6 = 0.125 s; baseline 320
        close(p.single_rank_throughput, 200.0);
        close(p.compute_s, 0.125);
        close(p.baseline_throughput, 320.0);
        // params = 30e6 / 2 = 15e6; ring = 2 × 2/3 × 30e6 = 40e6 B
        close(p.params, 15e6);
        close(p.ring_bytes_per_rank, 40e6);
        // comm = 2·2·100e-6 + 40e6 × 1e-9 = 0.0004 + 0.04 = 0.0404 s
        close(p.comm_s, 0.0404);
        // f32: 0.0004 + 2 × 2/3 × 60e6 × 1e-9 = 0.0804 s
        close(p.comm_f32_s, 0.0804);
        // all of it hidden (0.0404 < 0.125): step = compute = 0.125 s
        close(p.visible_comm_s, 0.0);
        close(p.step_s, 0.125);
        // throughput = 120 / 0.125 = 960; speedup = 960 / 320 = 3 = N; efficiency 1
        close(p.throughput, 960.0);
        close(p.speedup, 3.0);
        close(p.efficiency, 1.0);
        close(p.comm_share, 0.0);
        // epoch = 8 × 0.125 = 1 s; total 2 s
        close(p.epoch_s, 1.0);
        close(p.total_s, 2.0);
    }

    #[test]
    fn one_rank_has_no_communication() {
        let mut i = case_a();
        i.ranks = Some(1);
        i.dataset_size = Some(1000);
        i.epochs = 1;
        i.warmup = None;
        i.link = Some(Link::from_bandwidth(1.25e9, 50e-6, "10Gbit")); // even with latency: a ring of one takes no steps
        i.overlap = 0.5;
        let p = compute(&i).expect("valid");
        // G = 32; floor(1000 / 32) = 31, 8 left
        assert_eq!((p.global_batch, p.steps_per_epoch), (Some(32), Some(31)));
        assert_eq!(p.dropped_samples_per_epoch, Some(8));
        assert_eq!(p.ring_bytes_per_rank, Some(0.0));
        assert_eq!(
            (p.comm_s, p.comm_f32_s, p.comm_f16_s),
            (Some(0.0), Some(0.0), Some(0.0))
        );
        assert_eq!(p.visible_comm_s, Some(0.0));
        close(p.step_s, 0.08);
        close(p.throughput, 400.0);
        close(p.speedup, 1.0);
        close(p.efficiency, 1.0);
        assert_eq!(p.comm_share, Some(0.0));
        // lr = 0.1 × 32 / 256 = 0.0125
        close(p.scaled_lr.expect("lr"), 0.0125);
    }

    /// The question as people pose it: "one GPU does 150 img/s at batch 128; on 8 GPUs
    /// with +25 % from mixed precision and about 15 % lost to communication, what global
    /// batch, steps per epoch, throughput, epoch time and learning rate?" No link, no
    /// gradient size: --overhead 0.15 is the lump lost to communication and the rest.
    fn question_one() -> PlanInput {
        PlanInput {
            ranks: Some(8),
            per_rank_batch: Some(128),
            accumulation_steps: 1,
            dataset_size: None,
            epochs: 1,
            compute: Some(Compute::Throughput(150.0)),
            amp_speedup: 1.25,
            base_lr: None,
            base_batch: None,
            warmup: None,
            gradient: None,
            grad_dtype: GradDtype::F32,
            link: None,
            comm_s: None,
            comm_cut: None,
            overlap: 0.0,
            overhead: Some(0.15),
        }
    }

    #[test]
    fn question_one_by_hand() {
        let p = compute(&question_one()).expect("answers without a link");
        // global batch = 8 × 128 = 1024
        assert_eq!(p.global_batch, Some(1024));
        // one GPU: 150 img/s; AMP: 150 × 1.25 = 187.5 img/s, so a step of 128 takes
        // 128 / 187.5 = 0.682667 s of compute
        close(p.compute_s, 128.0 / 187.5);
        close(p.baseline_throughput, 187.5);
        // 15 % of each step lost: step = 0.682667 / 0.85 = 0.803137 s
        close(p.step_s, 128.0 / 187.5 / 0.85);
        // throughput = 150 × 8 × 1.25 × (1 − 0.15) = 1275 img/s (= 1024 / 0.803137)
        close(p.throughput, 1275.0);
        // speedup 1275 / 187.5 = 6.8 over one AMP GPU: 85 % efficiency
        close(p.speedup, 6.8);
        close(p.efficiency, 0.85);
        // learning rate, linear scaling from the single GPU's batch: 1024 / 128 = 8 × its lr
        close(p.lr_factor, 8.0);
        assert_eq!(p.scaled_lr, None);
        assert_eq!(p.skipped["scaled_lr"], "needs --base-lr");
        // no dataset size: steps and epoch time are skipped, saying so
        assert_eq!(p.steps_per_epoch, None);
        assert_eq!(p.epoch_s, None);
        assert_eq!(p.skipped["steps_per_epoch"], "needs --dataset-size");
        assert_eq!(p.skipped["epoch_s"], "needs --dataset-size");
        // communication itself is not modelled: it is inside the 15 %
        assert_eq!(p.comm_s, None);
        assert_eq!(p.comm_share, None);
        assert!(p.skipped["comm_s"].contains("--link"));

        // With ImageNet's 1,281,167 images and lr 0.1 for batch 256 (Goyal et al.):
        // steps = floor(1281167 / 1024) = 1251 (143 left over); epoch = 1251 × 0.803137
        // = 1004.72 s = 1281024 / 1275; lr = 0.1 × 1024 / 256 = 0.4
        let mut i = question_one();
        i.dataset_size = Some(1_281_167);
        i.base_lr = Some(0.1);
        i.base_batch = Some(256);
        let p = compute(&i).expect("valid");
        assert_eq!(p.steps_per_epoch, Some(1251));
        assert_eq!(p.dropped_samples_per_epoch, Some(143));
        close(p.epoch_s, 1251.0 * 1024.0 / 1275.0);
        close(p.lr_factor, 4.0);
        close(p.scaled_lr, 0.4);
        // With only the base lr (tuned on the one GPU at 128): 8 × 0.1 = 0.8
        i.base_batch = None;
        close(compute(&i).expect("valid").scaled_lr, 0.8);

        // Without the 15 % (and no link): no communication figure, so no step time
        // rather than a silent perfect scaling; what needs no step time is still there.
        i.overhead = None;
        let p = compute(&i).expect("valid");
        assert_eq!(p.step_s, None);
        assert_eq!(p.throughput, None);
        assert!(
            p.skipped["step_s"].contains("--overhead"),
            "{}",
            p.skipped["step_s"]
        );
        assert_eq!(p.global_batch, Some(1024));
        close(p.compute_s, 128.0 / 187.5);
    }

    /// "Communication is 90 ms of a 400 ms step; if fp16 halves it and overlap hides
    /// 40 % of the rest, what is left visible and what is the step time?" The 90 ms are
    /// in the 400 ms and none of them hidden, so compute is 400 − 90 = 310 ms.
    #[test]
    fn question_two_by_hand() {
        let i = PlanInput {
            ranks: None,
            per_rank_batch: None,
            dataset_size: None,
            compute: Some(Compute::MeasuredStepS(0.400)),
            gradient: None,
            link: None,
            comm_s: Some(0.090),
            comm_cut: Some(2.0),
            overlap: 0.4,
            overhead: None,
            amp_speedup: 1.0,
            ..question_one()
        };
        let p = compute(&i).expect("answers without ranks or a link");
        // compute = 400 − 90 = 310 ms
        close(p.compute_s, 0.310);
        // fp16 halves it: 90 / 2 = 45 ms
        close(p.comm_s, 0.045);
        // overlap hides 40 % of that: 18 ms; visible 45 − 18 = 27 ms (= 90 × 0.5 × 0.6)
        close(p.hidden_comm_s, 0.018);
        close(p.visible_comm_s, 0.027);
        // step = 310 + 27 = 337 ms
        close(p.step_s, 0.337);
        close(p.comm_share, 27.0 / 337.0);
        // nothing needing ranks or a batch is made up
        assert_eq!(p.throughput, None);
        assert_eq!(p.skipped["throughput"], "needs --ranks");
        assert_eq!(p.comm_f32_s, None);
        assert_eq!(p.skipped["comm_f32_s"], "communication given by --comm-ms");
        // --step-ms alone cannot be split into compute and communication
        let p = compute(&PlanInput { comm_s: None, ..i }).expect("valid");
        assert_eq!(p.compute_s, None);
        assert!(p.skipped["compute_s"].contains("--comm-ms"));
    }

    #[test]
    fn nothing_given_skips_everything_with_a_reason() {
        let i = PlanInput {
            ranks: None,
            per_rank_batch: None,
            compute: None,
            overhead: None,
            ..question_one()
        };
        let p = compute(&i).expect("an empty plan is not an error");
        let v: serde_json::Value =
            serde_json::from_str(&p.to_json().expect("json")).expect("parses");
        let outputs = v.as_object().expect("object");
        let mut nulls = 0;
        for (k, x) in outputs {
            if x.is_null() {
                nulls += 1;
                let why = &p.skipped[k.as_str()];
                assert!(
                    why.starts_with("needs ") && !why.contains('\n'),
                    "{k}: {why}"
                );
            }
        }
        // every output but the warmup (0 steps: none asked for)
        assert_eq!(nulls, 28, "{v}");
        assert_eq!(p.warmup_steps, Some(0));
        let text = p.render();
        assert!(text.contains("step time                  skipped: needs --throughput"));
    }

    #[track_caller]
    fn rejects(i: PlanInput, needles: &[&str]) {
        match compute(&i) {
            Err(Error::InvalidArgument(m)) => {
                for n in needles {
                    assert!(m.contains(n), "{m:?} should mention {n:?}");
                }
            }
            other => panic!("expected InvalidArgument mentioning {needles:?}, got {other:?}"),
        }
    }

    #[test]
    fn bad_inputs_are_named() {
        let with = |f: &dyn Fn(&mut PlanInput)| {
            let mut i = case_a();
            f(&mut i);
            i
        };
        rejects(with(&|i| i.ranks = Some(0)), &["--ranks", "0"]);
        rejects(
            with(&|i| i.per_rank_batch = Some(0)),
            &["--per-rank-batch", "0"],
        );
        rejects(
            with(&|i| i.accumulation_steps = 0),
            &["--accumulation-steps", "0"],
        );
        rejects(
            with(&|i| i.dataset_size = Some(0)),
            &["--dataset-size", "0"],
        );
        rejects(
            with(&|i| i.dataset_size = Some(255)),
            &["--dataset-size", "255", "256"],
        );
        rejects(with(&|i| i.epochs = 0), &["--epochs", "0"]);
        rejects(
            with(&|i| i.compute = Some(Compute::Throughput(0.0))),
            &["--throughput", "0"],
        );
        rejects(
            with(&|i| i.compute = Some(Compute::Throughput(-5.0))),
            &["--throughput", "-5"],
        );
        rejects(
            with(&|i| i.compute = Some(Compute::Throughput(f64::NAN))),
            &["--throughput", "NaN"],
        );
        rejects(
            with(&|i| i.compute = Some(Compute::StepTimeS(0.0))),
            &["--compute-ms"],
        );
        rejects(with(&|i| i.amp_speedup = 0.0), &["--amp-speedup", "0"]);
        rejects(
            with(&|i| i.overlap = -0.1),
            &["--overlap", "-0.1", "[0, 1]"],
        );
        rejects(with(&|i| i.overlap = 1.5), &["--overlap", "1.5"]);
        rejects(
            with(&|i| i.overhead = Some(1.0)),
            &["--overhead", "1", "[0, 1)"],
        );
        rejects(with(&|i| i.overhead = Some(-0.2)), &["--overhead", "-0.2"]);
        rejects(
            with(&|i| i.link = Some(Link::from_bandwidth(0.0, 0.0, "--link 0Gbit"))),
            &["β", "--link 0Gbit"],
        );
        rejects(
            with(&|i| i.link = Some(Link::from_bandwidth(-1.0, 0.0, "--link -1GB"))),
            &["β", "--link -1GB"],
        );
        rejects(
            with(&|i| i.link = Some(Link::from_bandwidth(1e9, -1e-6, "x"))),
            &["--alpha-us"],
        );
        rejects(
            with(&|i| i.comm_s = Some(0.09)),
            &["--comm-ms", "10Gbit", "give one"],
        );
        rejects(
            with(&|i| {
                i.link = None;
                i.comm_s = Some(-0.001);
            }),
            &["--comm-ms", "-1"],
        );
        rejects(
            with(&|i| {
                i.link = None;
                i.comm_s = Some(0.5);
                i.compute = Some(Compute::MeasuredStepS(0.4));
            }),
            &["--comm-ms 500", "--step-ms 400"],
        );
        rejects(
            with(&|i| i.compute = Some(Compute::MeasuredStepS(-0.4))),
            &["--step-ms", "-400"],
        );
        rejects(with(&|i| i.comm_cut = Some(0.5)), &["--comm-cut", "0.5"]);
        rejects(with(&|i| i.base_lr = Some(0.0)), &["--base-lr", "0"]);
        rejects(with(&|i| i.base_batch = Some(0)), &["--base-batch", "0"]);
        rejects(
            with(&|i| i.warmup = Some(Warmup::Epochs(-1.0))),
            &["--warmup-epochs", "-1"],
        );
        rejects(
            with(&|i| i.warmup = Some(Warmup::Epochs(91.0))),
            &["warmup", "450360"],
        );
        rejects(
            with(&|i| i.warmup = Some(Warmup::Steps(450_361))),
            &["warmup", "450361"],
        );
        rejects(
            with(&|i| i.gradient = Some(Gradient::Params(0))),
            &["--params", "0"],
        );
        rejects(
            with(&|i| i.gradient = Some(Gradient::Bytes(0))),
            &["--grad-bytes", "0"],
        );
    }

    #[test]
    fn bandwidth_units() {
        for (s, want) in [
            ("10Gbit", 1.25e9),
            ("10Gbit/s", 1.25e9),
            ("10 Gbit/s", 1.25e9),
            ("10Gbps", 1.25e9),
            ("10Gb/s", 1.25e9),
            ("100gbit", 12.5e9),
            ("400Mbit", 50e6),
            ("500mbit", 62.5e6),
            ("2.5gbit", 312.5e6),
            ("1.25GB", 1.25e9),
            ("1.25GB/s", 1.25e9),
            ("1.25GBps", 1.25e9),
            ("25GB/s", 25e9),
            ("3.2TB/s", 3.2e12),
            ("1e3MB", 1e9),
            ("800bit/s", 100.0),
        ] {
            close(parse_bandwidth(s).expect(s), want);
        }
        for (s, needle) in [
            ("10", "no unit"),
            ("10G", "unknown unit"),
            ("10Gfoo", "unknown unit"),
            ("fast", "not a number"),
            ("0Gbit", "positive"),
            ("-1GB", "positive"),
        ] {
            match parse_bandwidth(s) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains("--link") && m.contains(needle), "{s}: {m}")
                }
                other => panic!("{s}: {other:?}"),
            }
        }
    }

    #[test]
    fn counts_with_suffixes() {
        assert_eq!(
            parse_count("--params", "25.6M", false).expect("ok"),
            25_600_000
        );
        assert_eq!(
            parse_count("--params", "1281167", false).expect("ok"),
            1_281_167
        );
        assert_eq!(
            parse_count("--params", "1.28e6", false).expect("ok"),
            1_280_000
        );
        assert_eq!(
            parse_count("--params", "7G", false).expect("ok"),
            7_000_000_000
        );
        assert_eq!(parse_count("--params", "1_000", false).expect("ok"), 1000);
        assert_eq!(
            parse_count("--grad-bytes", "102.4MB", true).expect("ok"),
            102_400_000
        );
        assert_eq!(
            parse_count("--grad-bytes", "64MiB", true).expect("ok"),
            64 << 20
        );
        assert_eq!(parse_count("--grad-bytes", "1Ki", true).expect("ok"), 1024);
        assert!(parse_count("--params", "100B", false).is_err());
        assert!(parse_count("--params", "-5", false).is_err());
        assert!(parse_count("--params", "lots", false).is_err());
        assert!(parse_count("--params", "3X", false).is_err());
    }

    #[test]
    fn grad_dtypes() {
        assert_eq!(GradDtype::parse("float").expect("ok"), GradDtype::F32);
        assert_eq!(GradDtype::parse("FP16").expect("ok"), GradDtype::F16);
        assert_eq!(GradDtype::parse("bfloat16").expect("ok"), GradDtype::BF16);
        assert_eq!(GradDtype::BF16.size(), 2);
        assert!(matches!(
            GradDtype::parse("int8"),
            Err(Error::InvalidArgument(m)) if m.contains("--grad-dtype")
        ));
    }

    /// A bench file as `ferroccl bench --json` writes it, with in-place times from a
    /// known α and β, printed to full precision.
    fn bench_json(n: usize, alpha: f64, beta: f64, fit: Option<(f64, f64)>) -> String {
        let nf = n as f64;
        let factor = 2.0 * (nf - 1.0) / nf;
        let rows: Vec<String> = (0..9)
            .map(|j| {
                let bytes = 1024u64 << (2 * j); // 1 KiB .. 64 MiB
                let t_us = (2.0 * (nf - 1.0) * alpha + factor * bytes as f64 * beta) * 1e6;
                format!(
                    "    {{\"bytes\": {bytes}, \"count\": {}, \"oop_time_us\": {t_us}, \"oop_algbw_gbs\": 1.0, \"oop_busbw_gbs\": 1.0, \"oop_wrong\": 0, \"ip_time_us\": {t_us}, \"ip_algbw_gbs\": 1.0, \"ip_busbw_gbs\": 1.0, \"ip_wrong\": 0, \"payload_bytes_sent_per_rank\": 1.0, \"header_bytes_sent_per_rank\": 1.0}}",
                    bytes / 4
                )
            })
            .collect();
        let fit = fit.map_or(String::new(), |(a, b)| {
            format!("  \"fit\": {{\"alpha_s\": {a}, \"beta_s_per_byte\": {b}}},\n")
        });
        format!(
            "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"all_reduce\",\n  \"ranks\": {n},\n  \"transport\": \"tcp\",\n  \"dtype\": \"float\",\n  \"op\": \"sum\",\n  \"bus_factor\": {factor},\n{fit}  \"rows\": [\n{}\n  ]\n}}\n",
            rows.join(",\n")
        )
    }

    #[track_caller]
    fn rel(got: f64, want: f64, tol: f64) {
        assert!(((got - want) / want).abs() <= tol, "got {got}, want {want}");
    }

    #[test]
    fn bench_fit_recovers_alpha_and_beta() {
        for (n, alpha, beta) in [(4, 25e-6, 0.8e-9), (2, 3e-6, 1.0 / 12.5e9), (8, 1e-4, 1e-9)] {
            let link =
                link_from_bench_json(&bench_json(n, alpha, beta, None), "b.json").expect("fits");
            rel(link.alpha_s, alpha, 1e-6);
            rel(link.beta_s_per_byte, beta, 1e-6);
            assert!(link.source.contains("b.json") && link.source.contains("9 in-place rows"));
        }
    }

    #[test]
    fn bench_fit_object_wins() {
        // The rows say α = 25 µs, β = 0.8 ns/B; the fit object says otherwise and is used.
        let text = bench_json(4, 25e-6, 0.8e-9, Some((5e-6, 1e-10)));
        let link = link_from_bench_json(&text, "f.json").expect("fit object");
        assert_eq!((link.alpha_s, link.beta_s_per_byte), (5e-6, 1e-10));
        assert!(link.source.contains("fit object"));
    }

    #[test]
    fn bench_fit_with_negative_intercept_goes_through_origin() {
        // t = -10 µs + S × 1e-9 s/B (n = 2: factor 1): the free fit's α would be
        // negative, so α = 0 and β = Σ S·t / Σ S², slightly under 1e-9.
        let rows: Vec<String> = [1e6, 2e6, 4e6]
            .iter()
            .map(|s: &f64| {
                format!(
                    "{{\"bytes\": {s}, \"ip_time_us\": {}}}",
                    (s * 1e-9 - 10e-6) * 1e6
                )
            })
            .collect();
        let text = format!("{{\"ranks\": 2, \"rows\": [{}]}}", rows.join(","));
        let link = link_from_bench_json(&text, "neg.json").expect("fits");
        assert_eq!(link.alpha_s, 0.0);
        let (sxt, sxx) = [1e6f64, 2e6, 4e6].iter().fold((0.0, 0.0), |(a, b), s| {
            (a + s * (s * 1e-9 - 10e-6), b + s * s)
        });
        rel(link.beta_s_per_byte, sxt / sxx, 1e-9);
    }

    #[test]
    fn bad_bench_files_are_config_errors_naming_the_file() {
        let row = |b: u64, t: f64| format!("{{\"bytes\": {b}, \"ip_time_us\": {t}}}");
        let cases = [
            (
                "{not json".to_string(),
                "not a `ferroccl bench --json` file",
            ),
            (
                "[1, 2, 3]".to_string(),
                "not a `ferroccl bench --json` file",
            ),
            (
                r#"{"ranks": 4, "rows": [{"bytes": "big"}]}"#.to_string(),
                "not a",
            ),
            (r#"{"ranks": 4}"#.to_string(), "no `rows`"),
            (r#"{"rows": []}"#.to_string(), "no `ranks`"),
            (r#"{"ranks": 4, "rows": []}"#.to_string(), "0 row(s)"),
            (
                format!(r#"{{"ranks": 4, "rows": [{}]}}"#, row(1024, 10.0)),
                "1 row(s)",
            ),
            (
                format!(
                    r#"{{"ranks": 1, "rows": [{}, {}]}}"#,
                    row(1024, 10.0),
                    row(2048, 20.0)
                ),
                "1 rank(s)",
            ),
            (
                format!(
                    r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                    row(1024, 10.0),
                    row(1024, 20.0)
                ),
                "same size",
            ),
            (
                // time falls with size: β < 0
                format!(
                    r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                    row(1024, 30.0),
                    row(4096, 20.0)
                ),
                "not positive",
            ),
            (
                format!(
                    r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                    row(1024, -1.0),
                    row(4096, 20.0)
                ),
                "non-negative",
            ),
            (
                r#"{"fit": {"alpha_s": 1e-6, "beta_s_per_byte": 0}}"#.to_string(),
                "not positive",
            ),
            (
                r#"{"fit": {"alpha_s": -1e-6, "beta_s_per_byte": 1e-9}}"#.to_string(),
                "negative",
            ),
        ];
        for (text, needle) in cases {
            match link_from_bench_json(&text, "runs/bench.json") {
                Err(Error::Config(m)) => assert!(
                    m.contains("bench file runs/bench.json") && m.contains(needle),
                    "{text}: {m}"
                ),
                other => panic!("{text}: expected Config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn formatting_helpers() {
        assert_eq!(fmt_g(0.14336000000000002), "0.14336");
        assert_eq!(fmt_g(256.0 / 0.22336), "1146.13");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_time(0.14336), "143.36 ms");
        assert_eq!(fmt_time(25e-6), "25 µs");
        assert_eq!(fmt_time(2.5), "2.5 s");
        assert_eq!(fmt_time(100592.4096), "100592 s (1d 03h 56m 32s)");
        assert_eq!(fmt_time(3725.0), "3725 s (1h 02m 05s)");
        assert_eq!(fmt_bytes(179.2e6), "179.2 MB");
        assert_eq!(fmt_bytes(512.0), "512 B");
        assert_eq!(fmt_rate(1.25e9), "1.25 GB/s (10 Gbit/s)");
    }

    #[test]
    fn report_shows_formulas_and_json_has_every_output() {
        let p = compute(&case_a()).expect("valid");
        let text = p.render();
        for needle in [
            "global batch             = ranks × per-rank batch × accumulation steps = 8 × 32 × 1 = 256",
            "floor(dataset size / global batch) = floor(1281167 / 256) = 5004",
            "base lr × global batch / base batch = 0.1 × 256 / 256 = 0.1",
            "ceil(warmup epochs × steps per epoch) = ceil(5 × 5004) = 25020",
            "32 × 1 / 400 / 1 = 80 ms",
            "params × 4 B (f32) = 25600000 × 4 = 102.4 MB",
            "2(N-1)/N × S = 2 × 7 / 8 × 102.4 MB = 179.2 MB",
            "14 × 0 s + 179.2 MB × 0.8 ns/B = 143.36 ms  (used)",
            "14 × 0 s + 89.6 MB × 0.8 ns/B = 71.68 ms",
            "(80 ms + 143.36 ms) / (1 − 0) = 223.36 ms",
            "= 1146.13 samples/s",
            "speedup / ranks = 2.86533 / 8 = 35.8166 %",
            "5004 × 223.36 ms = 1117.69 s",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        let v: serde_json::Value =
            serde_json::from_str(&p.to_json().expect("json")).expect("parses");
        assert_eq!(v["global_batch"], 256);
        assert_eq!(v["input"]["ranks"], 8);
        assert_eq!(v["input"]["grad_dtype"], "f32");
        close(v["comm_f32_s"].as_f64().expect("f64"), 0.14336);
        close(v["step_s"].as_f64().expect("f64"), 0.22336);
    }
}
