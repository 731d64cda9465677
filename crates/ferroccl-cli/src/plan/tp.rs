//! `ferroccl plan --tensor-parallel T`: the per-layer communication of tensor
//! parallelism and data parallelism's over the same ranks, with the formulas. The
//! arithmetic is `ferroccl_candle::tensor_parallel::cost` (the tests there hold it to
//! the bytes the links count); this file reads the flags and prints.

use crate::plan::PlanArgs;
use ferroccl::{Error, Result};

/// The report (or its JSON) for `a`'s tensor-parallel question.
#[cfg(feature = "candle")]
pub fn tensor_parallel(a: &PlanArgs, json: bool) -> Result<String> {
    use crate::plan::{self as planner, fmt_bytes, fmt_g, fmt_time, GradDtype};
    use ferroccl_candle::tensor_parallel::cost::{plan, PlanInput};
    let need = |what: &str| Error::InvalidArgument(format!("--tensor-parallel needs {what}"));
    let hidden = a
        .hidden
        .ok_or_else(|| need("--hidden H (the model width)"))?;
    let batch = a.per_rank_batch.ok_or_else(|| {
        need("--per-rank-batch B (sequences each tensor-parallel group processes per step)")
    })?;
    let dtype = match &a.grad_dtype {
        Some(d) => GradDtype::parse(d)?,
        None => GradDtype::F32,
    };
    let i = PlanInput {
        tensor: a.tensor_parallel.unwrap_or(0),
        batch: usize::try_from(batch).map_err(|_| need("a --per-rank-batch that fits"))?,
        seq: a.seq_len.unwrap_or(1),
        hidden,
        ffn: a.ffn.unwrap_or(hidden.saturating_mul(4)),
        layers: a.layers.unwrap_or(1),
        attention: a.attention,
        elem_bytes: dtype.size(),
    };
    if i.tensor > crate::args::MAX_RANKS {
        return Err(Error::InvalidArgument(format!(
            "--tensor-parallel {}: at most {} ranks",
            i.tensor,
            crate::args::MAX_RANKS
        )));
    }
    let p = plan(i)?;
    // Times on a link, when one is given: each all-reduce a ring of T ranks.
    let link = match (&a.link, a.alpha_us) {
        (Some(l), alpha) => Some((planner::parse_bandwidth(l)?, alpha.unwrap_or(0.0) / 1e6)),
        (None, Some(_)) => return Err(need("--link with --alpha-us")),
        (None, None) => None,
    };
    let t = i.tensor;
    let time = |bytes: f64, calls: f64| {
        link.map(|(bw, alpha)| calls * 2.0 * (t as f64 - 1.0) * alpha + bytes / bw)
    };
    let per_step_calls = (p.all_reduces_per_layer * i.layers) as f64;
    let tp_time = time(p.bytes_per_step, per_step_calls);
    let dp_time = time(p.data_parallel_bytes_per_step, 1.0);
    if json {
        let mut j =
            serde_json::to_value(&p).map_err(|e| Error::InvalidArgument(format!("json: {e}")))?;
        j["tensor_parallel_step_s"] = serde_json::json!(tp_time);
        j["data_parallel_step_s"] = serde_json::json!(dp_time);
        return serde_json::to_string_pretty(&j)
            .map_err(|e| Error::InvalidArgument(format!("json: {e}")));
    }
    let kind = if i.attention {
        "transformer layer(s): self-attention and an MLP block"
    } else {
        "MLP block(s)"
    };
    let w = i.elem_bytes;
    let factor = 2.0 * (t as f64 - 1.0) / t as f64;
    let mut o = format!(
        "tensor parallel: T = {t} ranks split each layer; B·S = {} × {} = {} rows, H = {}, F = {}, \
         {} {kind}, {}\n",
        i.batch,
        i.seq,
        i.batch * i.seq,
        i.hidden,
        i.ffn,
        i.layers,
        dtype.name()
    );
    o += &format!(
        "  all-reduces per layer per step = {} (per block: g forward, f backward)\n\
         \x20 each of B·S·H = {} elements; per rank, ring: 2(T − 1)/T × B·S·H × {w} = {} × {} = {}\n\
         \x20 per layer per step = {} × {} = {}; per step ({} layer(s)) = {}\n",
        p.all_reduces_per_layer,
        p.elements_per_all_reduce,
        fmt_g(factor),
        fmt_bytes((p.elements_per_all_reduce * w) as f64),
        fmt_bytes(p.bytes_per_all_reduce),
        p.all_reduces_per_layer,
        fmt_bytes(p.bytes_per_all_reduce),
        fmt_bytes(p.bytes_per_layer),
        i.layers,
        fmt_bytes(p.bytes_per_step),
    );
    o += &format!(
        "  parameters per layer = {}; per rank = {} (its 1/T of each cut matrix, the biases after g whole)\n",
        p.params_per_layer, p.params_per_rank_per_layer
    );
    o += &format!(
        "data parallelism over the same {t} ranks at the same global batch:\n\
         \x20 gradient all-reduce per step = 2(T − 1)/T × {} params × {} layer(s) × {w} = {}\n\
         \x20 tensor parallel / data parallel bytes = {}: tensor parallelism sends less while \
         B·S < params per layer / ({} × H) = {} rows\n",
        p.params_per_layer,
        i.layers,
        fmt_bytes(p.data_parallel_bytes_per_step),
        fmt_g(p.ratio),
        p.all_reduces_per_layer,
        fmt_g(p.break_even_rows),
    );
    if let (Some(tt), Some(dt), Some((bw, alpha))) = (tp_time, dp_time, link) {
        o += &format!(
            "  on a link of {}, α {}: tensor parallel {} per step ({} all-reduces, each \
             2(T − 1)α + S/B), data parallel {} (one all-reduce)\n",
            planner::fmt_rate(bw),
            fmt_time(alpha),
            fmt_time(tt),
            per_step_calls,
            fmt_time(dt),
        );
    }
    o += "  (tensor parallelism's all-reduces stand between layers, on the critical path; \
          data parallelism's overlap the backward. What tensor parallelism buys is memory: \
          each rank holds 1/T of the weights and their optimizer state.)\n";
    Ok(o)
}

/// Without candle the formula is not built in.
#[cfg(not(feature = "candle"))]
pub fn tensor_parallel(_: &PlanArgs, _: bool) -> Result<String> {
    Err(Error::Unavailable {
        what: "plan --tensor-parallel".into(),
        why: "built without the \"candle\" feature (the formula is ferroccl-candle's)".into(),
    })
}
