//! A model deep enough to split: a stack of linear layers with tanh between them,
//! initialised from a seed layer by layer, so that any cut into stages holds exactly
//! the weights the whole model holds. The pipeline's example, benchmark and
//! `ferroccl train --pipeline` use it.

use crate::error::{Error, Result};
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::Linear;
use ferroccl::ddp::Rng;
use std::ops::Range;

/// Layers `first..` of an MLP: linear, then tanh unless it is the model's last layer.
pub struct MlpStage {
    layers: Vec<(Linear, bool)>,
}

impl Module for MlpStage {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = x.flatten_from(1)?;
        for (fc, act) in &self.layers {
            x = x.apply(fc)?;
            if *act {
                x = x.tanh()?;
            }
        }
        Ok(x)
    }
}

/// Layers `layers` of the MLP of `widths` (layer i maps `widths[i]` to
/// `widths[i + 1]`), with their variables `l{i}.weight`, `l{i}.bias` in forward order.
/// Layer i's weights are uniform in ±1/√fan_in drawn from `(seed, i)`: the same
/// whichever stage holds it. On the CPU; [`mlp_stage_on`] for another device.
pub fn mlp_stage(
    widths: &[usize],
    layers: Range<usize>,
    seed: u64,
) -> Result<(MlpStage, Vec<(String, Var)>)> {
    mlp_stage_on(widths, layers, seed, &Device::Cpu)
}

/// [`mlp_stage`] with its variables on `device`: the same weights on every device.
pub fn mlp_stage_on(
    widths: &[usize],
    layers: Range<usize>,
    seed: u64,
    device: &Device,
) -> Result<(MlpStage, Vec<(String, Var)>)> {
    if layers.is_empty() || layers.end >= widths.len() {
        return Err(Error::invalid(format!(
            "layers {layers:?} of an MLP of {} layers",
            widths.len().saturating_sub(1)
        )));
    }
    let mut out = Vec::new();
    let mut vars = Vec::new();
    for i in layers {
        let (fan_in, fan_out) = (widths[i], widths[i + 1]);
        let bound = 1.0 / (fan_in as f32).sqrt();
        let mut rng = Rng::derive(seed, i as u64);
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect()
        };
        let w = Var::from_tensor(&Tensor::from_vec(
            draw(fan_out * fan_in),
            (fan_out, fan_in),
            device,
        )?)?;
        let b = Var::from_tensor(&Tensor::from_vec(draw(fan_out), fan_out, device)?)?;
        out.push((
            Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())),
            i + 2 < widths.len(),
        ));
        vars.push((format!("l{i}.weight"), w));
        vars.push((format!("l{i}.bias"), b));
    }
    Ok((MlpStage { layers: out }, vars))
}

/// `layers` layers cut into `stages` contiguous runs as even as possible (the first
/// ones a layer longer); more stages than layers is `InvalidArgument`.
pub fn even_split(layers: usize, stages: usize) -> Result<Vec<Range<usize>>> {
    if stages == 0 || stages > layers {
        return Err(Error::invalid(format!(
            "{layers} layers cannot make {stages} pipeline stages"
        )));
    }
    let (base, extra) = (layers / stages, layers % stages);
    let mut start = 0;
    Ok((0..stages)
        .map(|s| {
            let n = base + usize::from(s < extra);
            start += n;
            start - n..start
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_layer_once_and_too_many_stages_are_refused() {
        assert_eq!(even_split(5, 2).unwrap(), vec![0..3, 3..5]);
        assert_eq!(even_split(4, 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert!(even_split(3, 4).is_err());
        assert!(mlp_stage(&[4, 3], 0..2, 0).is_err());
    }

    #[test]
    fn a_cut_model_computes_what_the_whole_does() {
        let widths = [5, 7, 6, 3];
        let x = Tensor::from_vec(
            (0..10).map(|v| v as f32 / 10.0).collect(),
            (2, 5),
            &Device::Cpu,
        )
        .unwrap();
        let (whole, _) = mlp_stage(&widths, 0..3, 9).unwrap();
        let (a, _) = mlp_stage(&widths, 0..1, 9).unwrap();
        let (b, _) = mlp_stage(&widths, 1..3, 9).unwrap();
        let y1 = whole
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let y2 = b
            .forward(&a.forward(&x).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(y1, y2);
    }
}
