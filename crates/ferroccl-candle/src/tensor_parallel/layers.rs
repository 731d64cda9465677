//! The tensor-parallel layers: [`ColumnParallelLinear`], [`RowParallelLinear`], and the
//! blocks made of them, [`TpMlp`] and [`TpSelfAttention`]; [`Shard`]s name their
//! parameters and how each is cut, and [`gather_whole`] reassembles the whole model.

use super::layout::{agree_declared, shard_ranges, Cut, Declared};
use super::ops::{apply, Conjugate};
use super::TensorGroup;
use crate::error::{Error, Result};
use candle_core::{Module, Tensor, Var, D};
use candle_nn::Linear;

/// How a parameter is cut across the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Its first dimension, in `blocks` blocks each cut in T (a column-parallel
    /// layer's weight and bias).
    Rows {
        /// See [`super::layout::shard_ranges`].
        blocks: usize,
    },
    /// Its second dimension (a row-parallel layer's weight).
    Cols,
    /// Not cut: every rank holds all of it, equal on every rank.
    Whole,
}

/// One parameter of a tensor-parallel layer: its name, this rank's variable, the
/// whole parameter's shape and how it is cut.
#[derive(Clone)]
pub struct Shard {
    /// Its name (`l0.weight`).
    pub name: String,
    /// This rank's part.
    pub var: Var,
    /// The whole parameter's shape.
    pub whole: Vec<usize>,
    /// How it is cut.
    pub split: Split,
}

/// The declared check, collective over the group: every rank gathers every rank's
/// declaration (a rank that could not even read its weights declares nothing) and
/// reaches the same verdict. Then this rank's own error, if it had one.
fn declare(group: &TensorGroup, mine: Result<Declared>) -> Result<Declared> {
    let words = mine.as_ref().map_or([-1i64; 4], Declared::words);
    let mut all = vec![0i64; 4 * group.size()];
    group.with(|c| c.all_gather(&words, &mut all))?;
    let mine = mine?;
    let decls: Vec<Option<Declared>> = all.chunks_exact(4).map(Declared::from_words).collect();
    debug_assert_eq!(decls.get(group.rank()).copied().flatten(), Some(mine));
    agree_declared(group.rank(), group.size(), &decls)
}

/// `(out, in)` of a whole weight, and a bias of `out` elements if there is one.
fn whole_dims(weight: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    let (out, inp) = match weight.dims() {
        [o, i] => (*o, *i),
        d => {
            return Err(Error::invalid(format!(
                "a linear layer's weight is (out, in), not {d:?}"
            )))
        }
    };
    if let Some(b) = bias.filter(|b| b.dims() != [out]) {
        return Err(Error::invalid(format!(
            "a bias of shape {:?} for a layer of {out} outputs",
            b.dims()
        )));
    }
    Ok((out, inp))
}

/// A new variable holding `t`'s ranges `ranges` of dimension `dim`, in order.
fn cut(t: &Tensor, dim: usize, ranges: &[std::ops::Range<usize>]) -> Result<Var> {
    let parts = ranges
        .iter()
        .map(|r| t.detach().narrow(dim, r.start, r.len()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let t = Tensor::cat(&parts, dim).and_then(|t| t.contiguous())?;
    Ok(Var::from_tensor(&t)?)
}

/// A linear layer whose output dimension is cut across the group: rank t holds rows
/// t of the weight and bias (per block). Its input must be whole on every rank; f
/// sums the input's gradient over the group in backward.
pub struct ColumnParallelLinear {
    group: TensorGroup,
    weight: Var,
    bias: Option<Var>,
    linear: Linear,
    blocks: usize,
    gather_output: bool,
}

impl ColumnParallelLinear {
    /// This rank's rows of the whole layer (`weight` of shape (out, in), `bias` of
    /// out), every rank passing the same. The output dimension is read as `blocks`
    /// blocks, each cut in T (3 for a fused Q, K, V). With `gather_output` the output
    /// is all-gathered (whole on every rank), else each rank keeps its slice.
    /// Collective over the group: see the module docs of
    /// [`crate::tensor_parallel`] for the check.
    pub fn from_whole(
        group: &TensorGroup,
        weight: &Tensor,
        bias: Option<&Tensor>,
        blocks: usize,
        gather_output: bool,
    ) -> Result<Self> {
        let local = whole_dims(weight, bias).and_then(|(out, inp)| {
            if gather_output && blocks > 1 {
                return Err(Error::invalid(format!(
                    "a column-parallel layer in {blocks} blocks cannot gather its output \
                     (the blocks' slices would interleave)"
                )));
            }
            Ok(Declared {
                cut: Cut::Column { blocks },
                in_features: inp,
                out_features: out,
            })
        });
        let d = declare(group, local)?;
        let rows = shard_ranges(d.out_features, blocks, group.rank(), group.size())?;
        let w = cut(weight, 0, &rows)?;
        let b = bias.map(|b| cut(b, 0, &rows)).transpose()?;
        Ok(ColumnParallelLinear {
            group: group.clone(),
            linear: Linear::new(
                w.as_tensor().clone(),
                b.as_ref().map(|b| b.as_tensor().clone()),
            ),
            weight: w,
            bias: b,
            blocks,
            gather_output,
        })
    }

    /// This rank's parameters, named `{name}.weight` and `{name}.bias`.
    pub fn shards(&self, name: &str) -> Vec<Shard> {
        let (out, inp) = self.weight.as_tensor().dims2().unwrap_or((0, 0));
        let out = out * self.group.size();
        let split = Split::Rows {
            blocks: self.blocks,
        };
        let mut v = vec![Shard {
            name: format!("{name}.weight"),
            var: self.weight.clone(),
            whole: vec![out, inp],
            split,
        }];
        if let Some(b) = &self.bias {
            v.push(Shard {
                name: format!("{name}.bias"),
                var: b.clone(),
                whole: vec![out],
                split,
            });
        }
        v
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = apply(&self.group, Conjugate::Copy, x)?;
        let y = self.linear.forward(&x)?;
        if self.gather_output {
            apply(&self.group, Conjugate::Gather, &y)
        } else {
            Ok(y)
        }
    }
}

/// A linear layer whose input dimension is cut across the group: rank t holds
/// columns t of the weight; each rank's product is a partial sum of the whole output,
/// which g all-reduces before the bias (whole on every rank) is added.
pub struct RowParallelLinear {
    group: TensorGroup,
    weight: Var,
    bias: Option<Var>,
    linear: Linear,
    input_is_parallel: bool,
}

impl RowParallelLinear {
    /// This rank's columns of the whole layer (`weight` of shape (out, in), `bias` of
    /// out, kept whole), every rank passing the same. With `input_is_parallel` the
    /// input is already this rank's slice (a column-parallel layer's output); else it
    /// is whole and scattered here. Collective over the group.
    pub fn from_whole(
        group: &TensorGroup,
        weight: &Tensor,
        bias: Option<&Tensor>,
        input_is_parallel: bool,
    ) -> Result<Self> {
        let local = whole_dims(weight, bias).map(|(out, inp)| Declared {
            cut: Cut::Row,
            in_features: inp,
            out_features: out,
        });
        let d = declare(group, local)?;
        let cols = shard_ranges(d.in_features, 1, group.rank(), group.size())?;
        let w = cut(weight, 1, &cols)?;
        let b = bias.map(|b| Var::from_tensor(&b.detach())).transpose()?;
        Ok(RowParallelLinear {
            group: group.clone(),
            linear: Linear::new(w.as_tensor().clone(), None),
            weight: w,
            bias: b,
            input_is_parallel,
        })
    }

    /// This rank's parameters, named `{name}.weight` (its columns) and `{name}.bias`
    /// (whole).
    pub fn shards(&self, name: &str) -> Vec<Shard> {
        let (out, inp) = self.weight.as_tensor().dims2().unwrap_or((0, 0));
        let mut v = vec![Shard {
            name: format!("{name}.weight"),
            var: self.weight.clone(),
            whole: vec![out, inp * self.group.size()],
            split: Split::Cols,
        }];
        if let Some(b) = &self.bias {
            v.push(Shard {
                name: format!("{name}.bias"),
                var: b.clone(),
                whole: vec![out],
                split: Split::Whole,
            });
        }
        v
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if self.input_is_parallel {
            x.clone()
        } else {
            apply(&self.group, Conjugate::Scatter, x)?
        };
        let partial = self.linear.forward(&x)?;
        let y = apply(&self.group, Conjugate::Reduce, &partial)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b.as_tensor()),
            None => Ok(y),
        }
    }
}

/// An activation between the two layers of an MLP (`Tensor::tanh`, `Tensor::gelu`).
pub type Activation = fn(&Tensor) -> candle_core::Result<Tensor>;

/// Megatron's MLP block: a column-parallel layer (hidden size F cut in T), the
/// activation on each rank's slice, a row-parallel layer back to the output width,
/// all-reduced once. Forward: one all-reduce (g); backward: one (f), of the input's
/// gradient.
pub struct TpMlp {
    up: ColumnParallelLinear,
    act: Activation,
    down: RowParallelLinear,
}

impl TpMlp {
    /// From the whole block: `up` (F, H) with its bias, `down` (H', F) with its
    /// bias, every rank passing the same. Collective over the group.
    pub fn from_whole(
        group: &TensorGroup,
        up: (&Tensor, Option<&Tensor>),
        act: Activation,
        down: (&Tensor, Option<&Tensor>),
    ) -> Result<Self> {
        Ok(TpMlp {
            up: ColumnParallelLinear::from_whole(group, up.0, up.1, 1, false)?,
            act,
            down: RowParallelLinear::from_whole(group, down.0, down.1, true)?,
        })
    }

    /// This rank's parameters: the up layer's named `up`, the down layer's `down`.
    pub fn shards(&self, up: &str, down: &str) -> Vec<Shard> {
        let mut v = self.up.shards(up);
        v.extend(self.down.shards(down));
        v
    }
}

impl Module for TpMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (self.act)(&self.up.forward(x)?)?;
        self.down.forward(&h)
    }
}

/// Self-attention (no mask) over inputs of shape (batch, sequence, H), its heads split
/// across the group: the fused Q, K, V projection (3H, H) column-parallel in three
/// blocks, so that rank t holds the rows of Q, K and V of heads t × n/T.., computes
/// their attention alone, and projects with its columns of the output projection
/// (row-parallel, all-reduced). Two all-reduces per step, as the MLP.
pub struct TpSelfAttention {
    qkv: ColumnParallelLinear,
    out: RowParallelLinear,
    heads: usize,
    head_dim: usize,
}

impl TpSelfAttention {
    /// From the whole block of `heads` heads: `qkv` (3H, H) as rows [Q; K; V] with
    /// its bias, `out` (H, H) with its bias, every rank passing the same. A head count
    /// that does not divide H, or that T does not divide, is refused on every rank.
    /// Collective over the group.
    pub fn from_whole(
        group: &TensorGroup,
        heads: usize,
        qkv: (&Tensor, Option<&Tensor>),
        out: (&Tensor, Option<&Tensor>),
    ) -> Result<Self> {
        let hidden = out.0.dims().last().copied().unwrap_or(0);
        let d = declare(
            group,
            Ok(Declared {
                cut: Cut::Heads,
                in_features: hidden,
                out_features: heads,
            }),
        )?;
        let qkv = ColumnParallelLinear::from_whole(group, qkv.0, qkv.1, 3, false)?;
        let out = RowParallelLinear::from_whole(group, out.0, out.1, true)?;
        Ok(TpSelfAttention {
            qkv,
            out,
            heads: heads / group.size(),
            head_dim: d.in_features / heads,
        })
    }

    /// This rank's parameters: `{name}.qkv.*` and `{name}.out.*`.
    pub fn shards(&self, name: &str) -> Vec<Shard> {
        let mut v = self.qkv.shards(&format!("{name}.qkv"));
        v.extend(self.out.shards(&format!("{name}.out")));
        v
    }
}

impl Module for TpSelfAttention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let (n, d) = (self.heads, self.head_dim);
        let h = n * d;
        let qkv = self.qkv.forward(x)?;
        // (b, s, h) → (b, n, s, d): this rank's heads.
        let heads = |i: usize| {
            qkv.narrow(D::Minus1, i * h, h)?
                .reshape((b, s, n, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
        let att = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?;
        let att = att.transpose(1, 2)?.contiguous()?.reshape((b, s, h))?;
        self.out.forward(&att)
    }
}

/// The whole parameter from every rank's part (`parts[t]`, rank order) of a parameter
/// of shape `whole` cut by `split` over `parts.len()` ranks. Pure.
pub fn assemble(whole: &[usize], split: Split, parts: &[&[f32]]) -> Result<Vec<f32>> {
    let tp = parts.len();
    let n: usize = whole.iter().product();
    let bad = || {
        Error::invalid(format!(
            "{tp} shard(s) of lengths {:?} do not make a parameter of shape {whole:?} cut by \
             {split:?}",
            parts.iter().map(|p| p.len()).collect::<Vec<_>>()
        ))
    };
    let fits = |p: &&[f32]| match split {
        Split::Whole => p.len() == n,
        _ => p.len() * tp == n,
    };
    if tp == 0 || !parts.iter().all(fits) {
        return Err(bad());
    }
    let rows = whole.first().copied().unwrap_or(1).max(1);
    let cols = n / rows;
    let mut out = vec![0.0f32; n];
    match split {
        Split::Whole => out.copy_from_slice(parts[0]),
        Split::Rows { blocks } => {
            for (t, p) in parts.iter().enumerate() {
                let mut at = 0;
                for r in shard_ranges(rows, blocks, t, tp).map_err(|_| bad())? {
                    let len = r.len() * cols;
                    out[r.start * cols..r.end * cols].copy_from_slice(&p[at..at + len]);
                    at += len;
                }
            }
        }
        Split::Cols => {
            if whole.len() != 2 || !cols.is_multiple_of(tp) {
                return Err(bad());
            }
            let part = cols / tp;
            for (t, p) in parts.iter().enumerate() {
                for r in 0..rows {
                    out[r * cols + t * part..r * cols + (t + 1) * part]
                        .copy_from_slice(&p[r * part..(r + 1) * part]);
                }
            }
        }
    }
    Ok(out)
}

/// Every parameter of `shards`, whole, by name, on every rank of the group (a
/// tensor-parallel model's weights as the one-process model holds them). Collective
/// over the group: one all-gather per cut parameter.
pub fn gather_whole(group: &TensorGroup, shards: &[Shard]) -> Result<Vec<(String, Vec<f32>)>> {
    let tp = group.size();
    let mut out = Vec::with_capacity(shards.len());
    for s in shards {
        let mine = s.var.flatten_all().and_then(|t| t.to_vec1::<f32>())?;
        let whole = if s.split == Split::Whole {
            mine
        } else {
            let mut all = vec![0.0f32; mine.len() * tp];
            group.with(|c| c.all_gather(&mine, &mut all))?;
            let parts: Vec<&[f32]> = all.chunks(mine.len().max(1)).take(tp).collect();
            assemble(&s.whole, s.split, &parts)?
        };
        out.push((s.name.clone(), whole));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_put_back_are_the_whole() {
        // A 6 × 4 weight: rows in 3 blocks over 2 ranks, columns over 2, whole.
        let w: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let rows = |t: usize| -> Vec<f32> {
            shard_ranges(6, 3, t, 2)
                .unwrap()
                .into_iter()
                .flat_map(|r| w[r.start * 4..r.end * 4].to_vec())
                .collect()
        };
        let (r0, r1) = (rows(0), rows(1));
        assert_eq!(&r0[..4], &w[..4]);
        let back = assemble(&[6, 4], Split::Rows { blocks: 3 }, &[&r0, &r1]).unwrap();
        assert_eq!(back, w);
        let cols = |t: usize| -> Vec<f32> {
            (0..6)
                .flat_map(|r| w[r * 4 + t * 2..r * 4 + t * 2 + 2].to_vec())
                .collect()
        };
        let (c0, c1) = (cols(0), cols(1));
        assert_eq!(assemble(&[6, 4], Split::Cols, &[&c0, &c1]).unwrap(), w);
        assert_eq!(assemble(&[6, 4], Split::Whole, &[&w]).unwrap(), w);
        // A bias cut by rows: 1-D.
        let b: Vec<f32> = (0..4).map(|v| v as f32).collect();
        assert_eq!(
            assemble(&[4], Split::Rows { blocks: 1 }, &[&b[..2], &b[2..]]).unwrap(),
            b
        );
        assert!(assemble(&[6, 4], Split::Cols, &[&c0]).is_err());
        assert!(assemble(&[6, 4], Split::Rows { blocks: 4 }, &[&r0, &r1]).is_err());
        assert!(assemble(&[6, 4], Split::Whole, &[]).is_err());
    }
}
