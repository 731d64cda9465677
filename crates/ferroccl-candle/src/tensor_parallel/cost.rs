//! What tensor parallelism sends, per block and per step, and when that pays against
//! data parallelism. Pure: `ferroccl plan --tensor-parallel` prints it, the trainer
//! reports it next to the bytes its links counted, and the tests hold the two equal.
//!
//! A block is a column-parallel layer then a row-parallel one (Megatron's MLP, or
//! self-attention) on R = B·S rows (a batch of B sequences of S tokens), input width
//! H_in, output width H_out. Its forward sums the row-parallel layer's partial outputs
//! (g: one all-reduce of R × H_out elements); its backward sums the input's partial
//! gradients (f: R × H_in), unless the input needs no gradient (the data, on the first
//! stage). A transformer's blocks have H_in = H_out = H: **two all-reduces of B·S·H
//! per block per step**, forward and backward. Over a ring of T ranks each sends
//! 2(T−1)/T of the bytes per all-reduce (exactly, when T divides the elements).
//!
//! Data parallelism over the same T ranks at the same global batch sends the
//! gradients instead: 2(T−1)/T × P × w bytes per step for P parameters of w bytes.
//! Per MLP block P = 2·H·F + F + H (F the hidden width), so tensor parallelism sends
//! less while 2·B·S·H < P, i.e. B·S < (2HF + F + H) / 2H ≈ F; with attention
//! (P = 4H² + 4H more, two all-reduces more) while B·S < P / 4H ≈ H + F/2. It also
//! holds only 1/T of the cut weights and their optimizer state, which data parallelism
//! cannot; but its all-reduces stand between one layer and the next, where data
//! parallelism's overlap the backward.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Which pass an all-reduce belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pass {
    /// g, summing a row-parallel layer's partial outputs.
    Forward,
    /// f, summing the partial gradients at a column-parallel layer's input.
    Backward,
}

/// One all-reduce of a tensor-parallel block, per micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllReduce {
    /// Forward or backward.
    pub pass: Pass,
    /// Elements summed.
    pub elements: usize,
}

/// The all-reduces of one block on `rows` rows of input width `h_in` and output
/// width `h_out` (see the module docs); the backward one only with `input_grad`.
pub fn block_all_reduces(
    rows: usize,
    h_in: usize,
    h_out: usize,
    input_grad: bool,
) -> Vec<AllReduce> {
    let mut v = vec![AllReduce {
        pass: Pass::Forward,
        elements: rows * h_out,
    }];
    if input_grad {
        v.push(AllReduce {
            pass: Pass::Backward,
            elements: rows * h_in,
        });
    }
    v
}

/// Payload bytes one rank sends in a ring all-reduce of `elements` elements of
/// `elem_bytes` over `t` ranks: 2(t − 1)/t × S (0 for one rank).
pub fn ring_bytes(elements: usize, elem_bytes: usize, t: usize) -> f64 {
    if t <= 1 {
        return 0.0;
    }
    2.0 * (t - 1) as f64 / t as f64 * (elements * elem_bytes) as f64
}

/// Payload bytes one rank sends for all of `all` over `t` ranks.
pub fn bytes_per_rank(all: &[AllReduce], elem_bytes: usize, t: usize) -> f64 {
    all.iter()
        .map(|a| ring_bytes(a.elements, elem_bytes, t))
        .sum()
}

/// The all-reduces of the trainer's MLP stage `layers` (layer i maps `widths[i]` to
/// `widths[i + 1]`; pairs of layers are blocks) on a micro-batch of `rows`: a stage
/// after the first receives an activation whose gradient it sends back, so its first
/// block's input needs a gradient; stage 0's input is the data.
pub fn mlp_stage_all_reduces(
    widths: &[usize],
    layers: Range<usize>,
    rows: usize,
) -> Result<Vec<AllReduce>> {
    check_pairs(widths, &layers)?;
    Ok(layers
        .step_by(2)
        .flat_map(|i| block_all_reduces(rows, widths[i], widths[i + 2], i > 0))
        .collect())
}

/// Refuses layers that are not whole pairs (column, row) of the MLP of `widths`.
pub fn check_pairs(widths: &[usize], layers: &Range<usize>) -> Result<()> {
    if layers.is_empty()
        || layers.end >= widths.len()
        || !layers.start.is_multiple_of(2)
        || !layers.len().is_multiple_of(2)
    {
        return Err(Error::invalid(format!(
            "layers {layers:?} of an MLP of {} layers are not whole tensor-parallel blocks \
             (pairs of a column- and a row-parallel layer, starting at an even layer)",
            widths.len().saturating_sub(1)
        )));
    }
    Ok(())
}

/// What [`plan`] is asked.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    /// Tensor-parallel ranks T.
    pub tensor: usize,
    /// Sequences per step that each tensor-parallel group processes (B).
    pub batch: usize,
    /// Tokens per sequence (S; 1 for an MLP on vectors).
    pub seq: usize,
    /// The model width H.
    pub hidden: usize,
    /// The MLP's hidden width F.
    pub ffn: usize,
    /// Blocks L (MLP blocks; transformer layers with `attention`).
    pub layers: usize,
    /// Each layer is self-attention and an MLP (four all-reduces), not an MLP alone.
    pub attention: bool,
    /// Bytes per element of activations and gradients (4 for f32).
    pub elem_bytes: usize,
}

/// The per-layer communication of tensor parallelism and data parallelism's over the
/// same ranks at the same global batch; bytes are per rank per step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The question.
    pub input: PlanInput,
    /// All-reduces per layer per step (2 per block: g forward, f backward).
    pub all_reduces_per_layer: usize,
    /// Elements of each: B·S·H.
    pub elements_per_all_reduce: usize,
    /// Bytes one rank sends per all-reduce: 2(T − 1)/T × B·S·H × w.
    pub bytes_per_all_reduce: f64,
    /// Per layer per step.
    pub bytes_per_layer: f64,
    /// All layers (the first layer's backward all-reduce counted: its input is an
    /// embedding's or an earlier stage's output, which needs the gradient).
    pub bytes_per_step: f64,
    /// Parameters per layer.
    pub params_per_layer: usize,
    /// Parameters each rank holds per layer under tensor parallelism (its slices and
    /// the replicated biases).
    pub params_per_rank_per_layer: usize,
    /// Data parallelism over T ranks: 2(T − 1)/T × params × w per step.
    pub data_parallel_bytes_per_step: f64,
    /// Tensor parallelism's bytes over data parallelism's.
    pub ratio: f64,
    /// The B·S below which tensor parallelism sends less.
    pub break_even_rows: f64,
}

/// Parameters of one layer, and of the part of them each of T ranks holds.
fn params(h: usize, f: usize, attention: bool, t: usize) -> (usize, usize) {
    // MLP: up (F × H + F) cut, down (H × F) cut, its bias (H) whole.
    let mut whole = 2 * h * f + f + h;
    let mut mine = (2 * h * f + f) / t + h;
    if attention {
        // Q, K, V (3H × H + 3H) cut, out (H × H) cut, its bias whole.
        whole += 4 * h * h + 4 * h;
        mine += (4 * h * h + 3 * h) / t + h;
    }
    (whole, mine)
}

/// The plan for `i`; sizes that T does not divide, or zeros, are
/// `InvalidArgument` naming the value.
pub fn plan(i: PlanInput) -> Result<Plan> {
    let bad = |what: String| Err(Error::invalid(what));
    let named = [
        ("--tensor-parallel", i.tensor),
        ("--batch", i.batch),
        ("--seq-len", i.seq),
        ("--hidden", i.hidden),
        ("--ffn", i.ffn),
        ("--layers", i.layers),
        ("element bytes", i.elem_bytes),
    ];
    if let Some((flag, _)) = named.iter().find(|(_, v)| *v == 0) {
        return bad(format!("{flag} must be at least 1"));
    }
    for (flag, v) in [("--ffn", i.ffn), ("--hidden", i.hidden)] {
        if !v.is_multiple_of(i.tensor) {
            return bad(format!(
                "{flag} {v} does not cut into {} equal tensor-parallel shards",
                i.tensor
            ));
        }
    }
    let t = i.tensor;
    let rows = i.batch.checked_mul(i.seq);
    let elements = rows.and_then(|r| r.checked_mul(i.hidden));
    let Some(elements) = elements.filter(|e| e.checked_mul(i.elem_bytes).is_some()) else {
        return bad("--batch × --seq-len × --hidden is too large".into());
    };
    let per = if i.attention { 4 } else { 2 };
    let one = ring_bytes(elements, i.elem_bytes, t);
    let (whole, mine) = params(i.hidden, i.ffn, i.attention, t);
    let dp = ring_bytes(whole, i.elem_bytes, t) * i.layers as f64;
    let step = one * per as f64 * i.layers as f64;
    Ok(Plan {
        input: i,
        all_reduces_per_layer: per,
        elements_per_all_reduce: elements,
        bytes_per_all_reduce: one,
        bytes_per_layer: one * per as f64,
        bytes_per_step: step,
        params_per_layer: whole,
        params_per_rank_per_layer: mine,
        data_parallel_bytes_per_step: dp,
        ratio: if dp > 0.0 { step / dp } else { f64::INFINITY },
        break_even_rows: whole as f64 / (per * i.hidden) as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_mlp_block_sends_two_all_reduces_of_bsh() {
        let b = block_all_reduces(32, 512, 512, true);
        assert_eq!(b.len(), 2);
        assert!(b.iter().all(|a| a.elements == 32 * 512));
        assert_eq!(block_all_reduces(32, 784, 512, false).len(), 1);
        // Over 4 ranks each sends 2 × 3/4 of the bytes.
        assert_eq!(ring_bytes(1000, 4, 4), 6000.0);
        assert_eq!(ring_bytes(1000, 4, 1), 0.0);
        assert_eq!(bytes_per_rank(&b, 4, 2), 2.0 * 32.0 * 512.0 * 4.0);
    }

    #[test]
    fn the_trainers_stages_are_pairs_and_stage_zero_skips_the_data_gradient() {
        let w = [784, 512, 512, 512, 10];
        let s0 = mlp_stage_all_reduces(&w, 0..4, 8).unwrap();
        assert_eq!(
            s0.iter().map(|a| (a.pass, a.elements)).collect::<Vec<_>>(),
            vec![
                (Pass::Forward, 8 * 512),
                (Pass::Forward, 8 * 10),
                (Pass::Backward, 8 * 512)
            ]
        );
        let s1 = mlp_stage_all_reduces(&w, 2..4, 8).unwrap();
        assert_eq!(s1.len(), 2);
        for bad in [1..3, 0..1, 0..0, 2..6] {
            assert!(
                mlp_stage_all_reduces(&w, bad.clone(), 8).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_plan_by_hand() {
        let i = PlanInput {
            tensor: 4,
            batch: 8,
            seq: 1024,
            hidden: 4096,
            ffn: 16384,
            layers: 2,
            attention: false,
            elem_bytes: 2,
        };
        let p = plan(i).unwrap();
        assert_eq!(p.elements_per_all_reduce, 8 * 1024 * 4096);
        assert_eq!(p.bytes_per_all_reduce, 1.5 * (8 * 1024 * 4096 * 2) as f64);
        assert_eq!(p.bytes_per_step, 4.0 * p.bytes_per_all_reduce);
        assert_eq!(p.params_per_layer, 2 * 4096 * 16384 + 16384 + 4096);
        assert_eq!(
            p.params_per_rank_per_layer,
            (2 * 4096 * 16384 + 16384) / 4 + 4096
        );
        // B·S = 8192 rows against a break-even of about F = 16384: TP sends half.
        assert!(
            (p.break_even_rows - 16386.5).abs() < 1e-9,
            "{}",
            p.break_even_rows
        );
        assert!((p.ratio - 8192.0 / 16386.5).abs() < 1e-12, "{}", p.ratio);
        let a = plan(PlanInput {
            attention: true,
            ..i
        })
        .unwrap();
        assert_eq!(a.all_reduces_per_layer, 4);
        assert!(
            (a.break_even_rows - 3.0 * 4096.0).abs() < 3.0,
            "{}",
            a.break_even_rows
        );
        for bad in [
            PlanInput { tensor: 0, ..i },
            PlanInput {
                ffn: 1000,
                tensor: 3,
                ..i
            },
            PlanInput { hidden: 0, ..i },
            PlanInput {
                batch: usize::MAX,
                ..i
            },
        ] {
            assert!(plan(bad).is_err(), "{bad:?}");
        }
    }
}
