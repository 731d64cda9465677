//! A LeNet-5-sized CNN in candle, cut into segments for overlapped backward.
//!
//! ```text
//! segment 0: conv 5×5, 1→c1, relu, maxpool 2      28×28 → c1×12×12
//! segment 1: conv 5×5, c1→c2, relu, maxpool 2     → c2×4×4
//! segment 2: linear c2·16→h, relu, linear h→10    → logits
//! ```
//!
//! with `(c1, c2, h) = (6, 16, 120) × width`. Parameters are candle `Var`s in f32 (their
//! master copies live in [`crate::ddp::Ddp`]); in half precision the forward pass casts them (and the input) to
//! f16/bf16 and the cast's backward brings the gradients home in f32.
//!
//! **Segmented backward.** candle has no per-parameter backward hooks, so the forward
//! pass detaches the activation at each segment boundary into a fresh leaf variable.
//! Backward then runs segment by segment from the last: the loss's backward yields the
//! last segment's parameter gradients and the gradient at its input boundary; each
//! earlier segment is backpropagated from the surrogate scalar `Σ out ⊙ g` (whose
//! gradient with respect to `out` is exactly `g`). After each segment its gradients
//! can go on the wire while the earlier segments are still being differentiated.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use ferroccl::ddp::Rng;
use std::ops::Range;

/// Arithmetic precision of forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Forward/backward in f16 with dynamic loss scaling; f32 master weights.
    F16,
    /// Forward/backward in bf16 (loss scaling is not needed for its range, but is
    /// applied the same way); f32 master weights. candle's CPU backend has no bf16
    /// matmul, so on the CPU this is refused (`ferroccl::Error::Unavailable`); bf16 gradients on
    /// the wire (`WireDtype::Bf16`) work everywhere.
    Bf16,
}

impl Precision {
    /// Parses `f32`/`fp32`, `f16`/`fp16`, `bf16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(Precision::F32),
            "f16" | "fp16" => Ok(Precision::F16),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(Error::invalid(format!(
                "unknown precision {s:?}: expected f32, f16 or bf16"
            ))),
        }
    }

    /// The candle dtype of activations.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }
}

/// Where a trainer computes: the CPU, or a GPU through candle's CUDA backend (this
/// crate's feature `candle-cuda`). Gradients still meet on the host: [`crate::ddp::Ddp`]
/// reads them into its buckets and writes the stepped master weights back, so the
/// collectives and their results are the same bytes as on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TrainDevice {
    /// candle's CPU backend.
    #[default]
    Cpu,
    /// candle's CUDA backend, one GPU per local rank (local rank modulo the GPUs the
    /// host has, so several ranks share a GPU when there are fewer GPUs than ranks).
    Cuda,
}

impl TrainDevice {
    /// Parses `cpu` or `cuda`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(TrainDevice::Cpu),
            "cuda" | "gpu" => Ok(TrainDevice::Cuda),
            _ => Err(Error::invalid(format!(
                "unknown device {s:?}: expected cpu or cuda"
            ))),
        }
    }

    /// The candle device of the rank whose local rank (on its host) is `local_rank`:
    /// the CPU, or GPU `local_rank % GPUs`. Without a GPU, or in a build without
    /// candle's CUDA backend, `ferroccl::Error::Unavailable` naming CUDA.
    pub fn candle(self, local_rank: usize) -> Result<Device> {
        match self {
            TrainDevice::Cpu => Ok(Device::Cpu),
            TrainDevice::Cuda => Ok(Device::new_cuda(local_rank % gpus()?)?),
        }
    }

    /// How many devices of this kind the host has (1 for the CPU), without making a
    /// context on any: what a launcher asks before it starts the ranks. Without a
    /// GPU, or without candle's CUDA backend in the build, the error
    /// [`TrainDevice::candle`] would give.
    pub fn count(self) -> Result<usize> {
        match self {
            TrainDevice::Cpu => Ok(1),
            TrainDevice::Cuda => gpus(),
        }
    }
}

/// The host's GPUs (at least one), or why there are none: ferroccl's probe, the same
/// typed errors ("no CUDA driver (libcuda.so not found)", "no CUDA device").
#[cfg(feature = "candle-cuda")]
fn gpus() -> Result<usize> {
    Ok(ferroccl::cuda::probe()?.devices)
}

#[cfg(not(feature = "candle-cuda"))]
fn gpus() -> Result<usize> {
    Err(ferroccl::Error::Unavailable {
        what: "CUDA".into(),
        why: "this build has no candle CUDA backend: build ferroccl-cli with \
              `--features candle-cuda` (ferroccl-candle with `candle-cuda`; tools/cuda-toolkit \
              fetches what that build needs)"
            .into(),
    }
    .into())
}

/// One parameter: its name, shape and candle variable.
pub struct Param {
    /// E.g. `conv1.weight`.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The variable the forward pass reads.
    pub var: Var,
}

/// The network; see the module docs.
pub struct LeNet {
    /// Parameters in forward order.
    pub params: Vec<Param>,
    /// Parameter index range of each segment.
    pub segments: Vec<Range<usize>>,
    device: Device,
}

/// What the forward pass keeps for the segmented backward.
pub struct Forward {
    /// Each segment's output (the last is the logits).
    outputs: Vec<Tensor>,
    /// The leaf variable each segment after the first read its input from.
    inputs: Vec<Var>,
    /// Logits in f32.
    pub logits: Tensor,
}

impl LeNet {
    /// A network of the given width, initialised from `seed` (PyTorch's default
    /// bound: uniform in ±1/√fan_in for weights and biases).
    pub fn new(width: usize, seed: u64) -> Result<Self> {
        Self::on(width, seed, &Device::Cpu)
    }

    /// [`LeNet::new`] with its parameters (and the batches it is given) on `device`:
    /// the same initial weights on every device.
    pub fn on(width: usize, seed: u64, device: &Device) -> Result<Self> {
        let w = width.max(1);
        let (c1, c2, h) = (6 * w, 16 * w, 120 * w);
        let shapes: Vec<(&str, Vec<usize>, usize)> = vec![
            ("conv1.weight", vec![c1, 1, 5, 5], 25),
            ("conv1.bias", vec![c1], 25),
            ("conv2.weight", vec![c2, c1, 5, 5], c1 * 25),
            ("conv2.bias", vec![c2], c1 * 25),
            ("fc1.weight", vec![h, c2 * 16], c2 * 16),
            ("fc1.bias", vec![h], c2 * 16),
            ("fc2.weight", vec![10, h], h),
            ("fc2.bias", vec![10], h),
        ];
        let device = device.clone();
        let mut rng = Rng::derive(seed, 0x494e_4954);
        let mut params = Vec::new();
        for (name, shape, fan_in) in shapes {
            let bound = 1.0 / (fan_in as f32).sqrt();
            let n: usize = shape.iter().product();
            let master: Vec<f32> = (0..n)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect();
            let t = Tensor::from_slice(&master, shape.as_slice(), &device)?;
            params.push(Param {
                name: name.into(),
                shape,
                var: Var::from_tensor(&t)?,
            });
        }
        Ok(LeNet {
            params,
            segments: vec![0..2, 2..4, 4..8],
            device,
        })
    }

    /// Elements of each parameter, forward order.
    pub fn param_lens(&self) -> Vec<usize> {
        self.params
            .iter()
            .map(|p| p.shape.iter().product())
            .collect()
    }

    /// Every parameter's values end to end, forward order.
    pub fn flat(&self) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for p in &self.params {
            let v = p.var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            out.extend_from_slice(&v);
        }
        Ok(out)
    }

    /// Sets every parameter from `flat` (forward order, end to end, as
    /// [`LeNet::flat`]).
    pub fn set_flat(&self, flat: &[f32]) -> Result<()> {
        let total: usize = self.param_lens().iter().sum();
        if flat.len() != total {
            return Err(Error::invalid(format!(
                "{} values for a network of {total} parameters",
                flat.len()
            )));
        }
        let mut at = 0;
        for p in &self.params {
            let n: usize = p.shape.iter().product();
            let t = Tensor::from_slice(&flat[at..at + n], p.shape.as_slice(), &self.device)?;
            p.var.set(&t)?;
            at += n;
        }
        Ok(())
    }

    /// The parameters by name, forward order: what [`crate::ddp::Ddp::from_vars`]
    /// takes.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.var.clone()))
            .collect()
    }

    fn segment(&self, i: usize, x: &Tensor, dt: DType) -> candle_core::Result<Tensor> {
        let p = |j: usize| -> candle_core::Result<Tensor> {
            let t = self.params[j].var.as_tensor();
            if dt == DType::F32 {
                Ok(t.clone())
            } else {
                t.to_dtype(dt)
            }
        };
        let conv = |x: &Tensor, w: usize| -> candle_core::Result<Tensor> {
            let b = p(w + 1)?.reshape((1, (), 1, 1))?;
            x.conv2d(&p(w)?, 0, 1, 1, 1)?
                .broadcast_add(&b)?
                .relu()?
                .max_pool2d(2)
        };
        match i {
            0 => conv(x, 0),
            1 => conv(x, 2),
            _ => {
                let x = x.flatten_from(1)?;
                let x = x.matmul(&p(4)?.t()?)?.broadcast_add(&p(5)?)?.relu()?;
                x.matmul(&p(6)?.t()?)?.broadcast_add(&p(7)?)
            }
        }
    }

    /// The forward pass over `n` images (`n * 784` pixels in [0, 1]).
    pub fn forward(&self, pixels: &[f32], n: usize, prec: Precision) -> Result<Forward> {
        let f = || -> candle_core::Result<Forward> {
            let dt = prec.dtype();
            let mut x = Tensor::from_slice(pixels, (n, 1, 28, 28), &self.device)?;
            if dt != DType::F32 {
                x = x.to_dtype(dt)?;
            }
            let mut outputs = Vec::new();
            let mut inputs = Vec::new();
            for i in 0..self.segments.len() {
                let inp = if i == 0 {
                    x.clone()
                } else {
                    let v = Var::from_tensor(&outputs.last().map(Tensor::detach).expect("i > 0"))?;
                    let t = v.as_tensor().clone();
                    inputs.push(v);
                    t
                };
                outputs.push(self.segment(i, &inp, dt)?);
            }
            let logits = outputs.last().expect("segments").to_dtype(DType::F32)?;
            Ok(Forward {
                outputs,
                inputs,
                logits,
            })
        };
        Ok(f()?)
    }

    /// Backward from `loss` (a scalar computed from `fwd.logits`), segment by segment
    /// from the last; after each segment `ready(param, grad)` receives its parameters'
    /// gradients, last parameter first.
    pub fn backward(
        &self,
        fwd: &Forward,
        loss: &Tensor,
        mut ready: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let k = self.segments.len();
        let mut grads = loss.backward()?;
        for i in (0..k).rev() {
            if i < k - 1 {
                // Gradient at this segment's output = at the next segment's input leaf.
                let g = grads
                    .get(fwd.inputs[i].as_tensor())
                    .ok_or_else(|| Error::invalid("backward: no gradient at a segment boundary"))?
                    .to_dtype(DType::F32)?;
                let out = fwd.outputs[i].to_dtype(DType::F32)?;
                grads = (out * g)?.sum_all()?.backward()?;
            }
            for j in self.segments[i].clone().rev() {
                let p = &self.params[j];
                let g = match grads.get(p.var.as_tensor()) {
                    Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                    // A parameter the loss does not depend on has a zero gradient.
                    None => vec![0.0; p.shape.iter().product()],
                };
                ready(j, &g)?;
            }
        }
        Ok(())
    }

    /// Cross-entropy of `fwd`'s logits against `labels`, mean over the batch.
    pub fn loss(&self, fwd: &Forward, labels: &[u8]) -> Result<Tensor> {
        let t: Vec<u32> = labels.iter().map(|&l| l as u32).collect();
        let t = Tensor::from_vec(t, labels.len(), &self.device)?;
        Ok(candle_nn::loss::cross_entropy(&fwd.logits, &t)?)
    }

    /// How many of `fwd`'s predictions match `labels`.
    pub fn correct(fwd: &Forward, labels: &[u8]) -> Result<usize> {
        let pred: Vec<u32> = fwd.logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        Ok(pred
            .iter()
            .zip(labels)
            .filter(|(p, l)| **p == **l as u32)
            .count())
    }
}
