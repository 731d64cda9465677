//! The conjugate operators, written once: each [`Conjugate`] does one collective
//! forward and its conjugate's backward (Megatron-LM's `mappings.py`: f is identity
//! forward and an all-reduce backward, g the reverse; gather and scatter along the
//! last dimension likewise). [`apply`] computes the forward here, outside candle, and
//! joins the result to candle's graph through a custom op whose backward runs the
//! conjugate's forward on the gradient.
//!
//! candle's `Module::forward` and `backward` speak candle's error type, so a failed
//! collective inside them is kept, typed, on the calling thread and candle gets a
//! message (`crate::error::keep`); the crate's error takes the typed error back when
//! it converts candle's ([`crate::error::failure`]), so `Pipeline` and the trainer
//! report [`ferroccl::Error`]s as the collective raised them, `PeerFailed` and
//! `Mismatch` included.

use super::TensorGroup;
use crate::error::{keep, Error, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};
use ferroccl::ReduceOp;
use std::sync::Mutex;

/// A boundary between a tensor-parallel region (each rank holds a part) and a
/// replicated one (every rank holds the same), as a forward collective and its
/// conjugate backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conjugate {
    /// f, into a column-parallel layer: identity forward, all-reduce (sum) of the
    /// input's partial gradients backward.
    Copy,
    /// g, out of a row-parallel layer: all-reduce (sum) of the partial outputs
    /// forward, identity backward.
    Reduce,
    /// A column-parallel output made whole: all-gather along the last dimension
    /// forward, this rank's slice of the gradient backward.
    Gather,
    /// A whole input into a row-parallel layer: this rank's slice of the last
    /// dimension forward, all-gather of the gradient backward.
    Scatter,
}

impl Conjugate {
    /// The operator whose forward is this one's backward (and the reverse).
    pub fn conjugate(self) -> Conjugate {
        match self {
            Conjugate::Copy => Conjugate::Reduce,
            Conjugate::Reduce => Conjugate::Copy,
            Conjugate::Gather => Conjugate::Scatter,
            Conjugate::Scatter => Conjugate::Gather,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Conjugate::Copy => "tensor-parallel f (copy)",
            Conjugate::Reduce => "tensor-parallel g (reduce)",
            Conjugate::Gather => "tensor-parallel gather",
            Conjugate::Scatter => "tensor-parallel scatter",
        }
    }

    /// The forward of this operator on `x` (a tensor outside any graph), typed errors.
    fn forward(self, group: &TensorGroup, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != DType::F32 {
            return Err(Error::invalid(format!(
                "{}: tensor-parallel collectives carry f32, not {:?}",
                self.name(),
                x.dtype()
            )));
        }
        let dims = x.dims().to_vec();
        let (t, tp) = (group.rank(), group.size());
        let last = dims.last().copied().unwrap_or(1);
        match self {
            Conjugate::Copy => Ok(x.clone()),
            Conjugate::Reduce => {
                let mut v = x.flatten_all()?.to_vec1::<f32>()?;
                group.with(|c| c.all_reduce(&mut v, ReduceOp::Sum))?;
                Ok(Tensor::from_vec(v, dims, x.device())?)
            }
            Conjugate::Gather => {
                let v = x.flatten_all()?.to_vec1::<f32>()?;
                let mut all = vec![0.0f32; v.len() * tp];
                group.with(|c| c.all_gather(&v, &mut all))?;
                // Rank-major [T, rows, last] to [rows, T × last].
                let rows = v.len() / last.max(1);
                let mut out = dims;
                if let Some(l) = out.last_mut() {
                    *l *= tp;
                }
                Ok(Tensor::from_vec(all, (tp, rows, last), x.device())?
                    .transpose(0, 1)?
                    .contiguous()?
                    .reshape(out)?)
            }
            Conjugate::Scatter => {
                if dims.is_empty() || !last.is_multiple_of(tp) {
                    return Err(Error::invalid(format!(
                        "{}: a last dimension of {last} does not cut into {tp} equal \
                         tensor-parallel shards",
                        self.name()
                    )));
                }
                let part = last / tp;
                Ok(x.narrow(D::Minus1, t * part, part)?.contiguous()?)
            }
        }
    }
}

/// `op` on `x`: its forward collective now, its conjugate on the gradient in
/// backward. Collective over `group` (every rank applies the same operators in the
/// same order, as the model's forward and backward do).
pub fn apply(group: &TensorGroup, op: Conjugate, x: &Tensor) -> candle_core::Result<Tensor> {
    let y = op.forward(group, &x.detach()).map_err(keep)?;
    if !x.track_op() {
        return Ok(y);
    }
    let values = y.flatten_all()?.to_vec1::<f32>()?;
    x.apply_op1(Boundary {
        op,
        group: group.clone(),
        out: Mutex::new(Some((values, y.shape().clone()))),
    })
}

/// The graph node of an [`apply`]: its forward hands over the values computed there.
struct Boundary {
    op: Conjugate,
    group: TensorGroup,
    out: Mutex<Option<(Vec<f32>, Shape)>>,
}

impl CustomOp1 for Boundary {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let taken = self
            .out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let (v, shape) = taken.ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: its forward ran twice", self.op.name()))
        })?;
        Ok((CpuStorage::F32(v), shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad.detach().to_dtype(DType::F32)?;
        let back = self.op.conjugate().forward(&self.group, &g).map_err(keep)?;
        Ok(Some(back))
    }
}
