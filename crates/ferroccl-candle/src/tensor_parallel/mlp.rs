//! The trainer's MLP (`crate::pipeline::mlp`) with its layers in tensor-parallel
//! pairs: layer 2i column-parallel, tanh on each rank's slice, layer 2i + 1
//! row-parallel, then tanh unless it is the model's last layer — Megatron's MLP block
//! four times over for `ferroccl train --tensor-parallel T`. The weights are cut from
//! the whole model's ([`crate::pipeline::mlp::mlp_stage`], drawn from the same seed),
//! so every layout holds the one-process model.

use super::cost::check_pairs;
use super::layers::{Shard, TpMlp};
use super::TensorGroup;
use crate::pipeline::mlp::mlp_stage;
use candle_core::{Module, Tensor};
use ferroccl::{Error, Result};
use std::ops::Range;

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
/// parameters (`l{i}.weight`, `l{i}.bias`, forward order). Collective over the group.
pub fn tp_mlp_stage(
    widths: &[usize],
    layers: Range<usize>,
    seed: u64,
    group: &TensorGroup,
) -> Result<(TpMlpStage, Vec<Shard>)> {
    check_pairs(widths, &layers)?;
    let (_, vars) = mlp_stage(widths, layers.clone(), seed)?;
    let mut blocks = Vec::new();
    let mut shards = Vec::new();
    for (k, i) in layers.step_by(2).enumerate() {
        let v = |j: usize| {
            vars.get(4 * k + j)
                .map(|(_, v)| v.as_tensor())
                .ok_or_else(|| Error::InvalidArgument(format!("layer {i}: no weights")))
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
