//! The pipeline trainer's MLP ([`WIDTHS`], built by `crate::pipeline::mlp`), and the
//! same with its layers in tensor-parallel pairs: layer 2i column-parallel, tanh on
//! each rank's slice, layer 2i + 1 row-parallel, then tanh unless it is the model's
//! last layer — Megatron's MLP block four times over for `ferroccl train
//! --tensor-parallel T`. The weights are cut from the whole model's
//! ([`crate::pipeline::mlp::mlp_stage`], drawn from the same seed), so every layout
//! holds the one-process model.

use crate::error::{Error, Result};
use crate::pipeline::mlp::{even_split, mlp_stage_on};
use crate::tensor_parallel::cost::check_pairs;
use crate::tensor_parallel::layout::shard_ranges;
use crate::tensor_parallel::{Shard, TensorGroup, TpMlp};
use candle_core::{Device, Module, Tensor};
use std::ops::Range;

/// The MLP's widths: 784 → 512 × 7 → 10.
pub const WIDTHS: [usize; 9] = [784, 512, 512, 512, 512, 512, 512, 512, 10];

/// Layers `layers` of the MLP as tensor-parallel blocks; see the module docs.
pub struct TpMlpStage {
    blocks: Vec<(TpMlp, bool)>,
}

impl Module for TpMlpStage {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = x.flatten_from(1)?;
        for (block, act) in &self.blocks {
            x = block.forward(&x)?;
            if *act {
                x = x.tanh()?;
            }
        }
        Ok(x)
    }
}

/// Layers `layers` (whole pairs, starting at an even layer) of the MLP of `widths`
/// from `seed`, as this rank's part of tensor-parallel blocks over `group`, and its
/// parameters (`l{i}.weight`, `l{i}.bias`, forward order), on `device`. Collective
/// over the group.
pub fn tp_mlp_stage(
    widths: &[usize],
    layers: Range<usize>,
    seed: u64,
    group: &TensorGroup,
    device: &Device,
) -> Result<(TpMlpStage, Vec<Shard>)> {
    check_pairs(widths, &layers)?;
    let (_, vars) = mlp_stage_on(widths, layers.clone(), seed, device)?;
    let mut blocks = Vec::new();
    let mut shards = Vec::new();
    for (k, i) in layers.step_by(2).enumerate() {
        let v = |j: usize| {
            vars.get(4 * k + j)
                .map(|(_, v)| v.as_tensor())
                .ok_or_else(|| Error::invalid(format!("layer {i}: no weights")))
        };
        let block = TpMlp::from_whole(
            group,
            (v(0)?, Some(v(1)?)),
            Tensor::tanh,
            (v(2)?, Some(v(3)?)),
        )?;
        shards.extend(block.shards(&format!("l{i}"), &format!("l{}", i + 1)));
        blocks.push((block, i + 3 < widths.len()));
    }
    Ok((TpMlpStage { blocks }, shards))
}

/// Whether the MLP of `widths`, cut evenly into `stages` pipeline stages, can have
/// each stage's layers split over `tensor` ranks: every stage whole pairs of layers,
/// every pair's hidden width a multiple of T. Pure, so that a launcher can refuse a
/// layout before any rank starts; the ranks check it again, together, when they
/// build the layers.
pub fn check_mlp(widths: &[usize], stages: usize, tensor: usize) -> Result<()> {
    if tensor <= 1 {
        return Ok(());
    }
    for layers in even_split(widths.len().saturating_sub(1), stages)? {
        check_pairs(widths, &layers).map_err(|e| {
            Error::invalid(format!(
                "{stages} pipeline stage(s) with tensor parallelism: {e}"
            ))
        })?;
        for i in layers.step_by(2) {
            shard_ranges(widths[i + 1], 1, 0, tensor).map_err(|_| {
                Error::invalid(format!(
                    "the MLP's hidden size {} (layer {i}) does not cut into {tensor} equal \
                     tensor-parallel shards",
                    widths[i + 1]
                ))
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_mlp;

    #[test]
    fn stages_must_hold_whole_pairs_and_t_must_divide_the_hidden_size() {
        let w = [784, 512, 512, 512, 512, 512, 512, 512, 10];
        for (p, t) in [(1, 2), (2, 2), (4, 2), (1, 4), (2, 8), (8, 1), (1, 512)] {
            assert!(check_mlp(&w, p, t).is_ok(), "{p} {t}");
        }
        let e = check_mlp(&w, 8, 2).unwrap_err().to_string();
        assert!(e.contains("not whole tensor-parallel blocks"), "{e}");
        let e = check_mlp(&w, 1, 3).unwrap_err().to_string();
        assert!(
            e.contains("hidden size 512") && e.contains("3 equal"),
            "{e}"
        );
        assert!(check_mlp(&w, 3, 2).is_err());
        assert!(
            check_mlp(&w, 9, 1).is_ok(),
            "T = 1 is the pipeline's own business"
        );
    }
}
