//! `Zero`: a sharded optimizer (ZeRO stage 1, PyTorch's `ZeroRedundancyOptimizer`) for
//! any candle model, and the flat parameter store the pipeline's stages step with.
//!
//! The parameters are laid end to end in one flat f32 buffer, padded to a multiple of
//! the data-parallel group's size N and cut into N contiguous shards ([`partition`]).
//! Rank r owns shard r's optimizer state, 1/N of the whole. A step reduce-scatters the
//! accumulated gradients (each rank receives the average of its shard), steps its shard
//! with the [`Optimizer`] (which sees the shard as one parameter: Adam and SGD work
//! element by element, so a shard steps exactly as the whole would), and all-gathers
//! the parameters. Unsharded ([`Zero::new`] with `sharded = false`) it is plain data
//! parallelism on the same buffer: one all-reduce, every rank stepping everything.
//!
//! Gradients and parameters stay whole on every rank (that is ZeRO-1; ZeRO-2 would
//! also free the gradients outside the shard after the reduce-scatter, which candle's
//! one-shot backward gives no moment to do).
//!
//! **Checkpoints** hold the whole, unsharded state in [`crate::ddp::Ddp`]'s names
//! (`param/NAME`, `KIND/NAME`, `opt/KIND`) plus a layout: [`Zero::snapshot`] gathers
//! the shards to rank 0, [`Zero::restore`] hands each rank its shard of what rank 0
//! loaded. A checkpoint written on N ranks resumes bit for bit on N ranks, and on any
//! other N too (the state is re-cut; only the order in which later gradients are summed
//! changes with N). A checkpoint of another layout (another pipeline stage, another
//! stage count, other parameters) is a [`TrainError::Checkpoint`](ferroccl::ddp::TrainError::Checkpoint) and changes nothing.

use crate::ddp::{
    agree, broadcast_bytes, counter_tensors, read_counter, read_vars, stored, Optimizer,
};
use crate::error::{Error, Result};
use crate::tensor_parallel::TensorGroup;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use ferroccl::ddp::checkpoint::{Checkpoint, Tensor as CkptTensor};
use ferroccl::ddp::TrainResult;
use ferroccl::{Communicator, ReduceOp};
use serde_json::json;
use std::ops::Range;
use std::path::PathBuf;

/// The shards of a flat buffer of `total` elements over `ranks` ranks: contiguous,
/// equal (`ceil(total / ranks)` elements each, the last ones running past `total` into
/// padding), in rank order.
pub fn partition(total: usize, ranks: usize) -> Vec<Range<usize>> {
    let n = ranks.max(1);
    let len = total.div_ceil(n);
    (0..n).map(|r| r * len..(r + 1) * len).collect()
}

struct Param {
    name: String,
    shape: Vec<usize>,
    var: Var,
    range: Range<usize>,
}

/// Parameters in a flat buffer with a (possibly sharded) optimizer over a
/// data-parallel group; see the module docs.
pub struct Zero<'c, O> {
    comm: Option<&'c Communicator>,
    params: Vec<Param>,
    master: Vec<f32>,
    grad: Vec<f32>,
    shard: Range<usize>,
    sharded: bool,
    opt: O,
    layout: serde_json::Value,
    /// Ranks that must all load their checkpoints for any to (a pipeline's stages).
    together: Option<&'c Communicator>,
    /// And the tensor-parallel ranks splitting these parameters with this one.
    tensor: Option<TensorGroup>,
    steps: u64,
}

impl<'c, O: Optimizer> Zero<'c, O> {
    /// The parameters `vars` (named, forward order) over the data-parallel group
    /// `comm` (`None`: this process alone), with the optimizer state sharded over it
    /// when `sharded` (ZeRO-1), else whole on every rank. Collective over `comm`: rank
    /// 0's weights become every rank's.
    pub fn new(
        comm: Option<&'c Communicator>,
        vars: Vec<(String, Var)>,
        mut opt: O,
        sharded: bool,
    ) -> Result<Self> {
        let mut params: Vec<Param> = Vec::with_capacity(vars.len());
        let mut master = Vec::new();
        for (name, var, v) in read_vars(vars)? {
            let start = master.len();
            master.extend_from_slice(&v);
            params.push(Param {
                name,
                shape: var.dims().to_vec(),
                var,
                range: start..master.len(),
            });
        }
        let n = comm.map_or(1, Communicator::world_size);
        let rank = comm.map_or(0, Communicator::rank);
        let shards = partition(master.len(), n);
        master.resize(shards[n - 1].end, 0.0);
        let shard = if sharded {
            shards[rank].clone()
        } else {
            0..master.len()
        };
        opt.init(&[shard.len()]);
        let mut z = Zero {
            comm,
            grad: vec![0.0; master.len()],
            params,
            master,
            shard,
            sharded,
            opt,
            layout: json!({"stage": 0, "stages": 1}),
            together: None,
            tensor: None,
            steps: 0,
        };
        if let Some(c) = comm {
            c.broadcast(&mut z.master, 0)?;
        }
        z.write_vars()?;
        Ok(z)
    }

    /// The layout written into checkpoints and required of those restored.
    /// A pipeline stage's: its `layout`, and the pipeline group, all of whose stages
    /// must load their checkpoints for any to.
    pub(crate) fn set_layout(&mut self, layout: serde_json::Value, pipe: &'c Communicator) {
        self.layout = layout;
        self.together = Some(pipe);
    }

    /// The tensor-parallel group these parameters are shards over: a checkpoint
    /// loads on all its ranks or on none.
    pub(crate) fn set_tensor(&mut self, tensor: TensorGroup) {
        self.tensor = Some(tensor);
    }

    /// Elements of all parameters (without padding).
    pub fn len(&self) -> usize {
        self.params.last().map_or(0, |p| p.range.end)
    }

    /// True when there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The data-parallel group, if any.
    pub fn comm(&self) -> Option<&'c Communicator> {
        self.comm
    }

    /// This rank's shard of the flat buffer (everything when unsharded).
    pub fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes of optimizer state this rank holds (its buffers and counters).
    pub fn optimizer_state_bytes(&mut self) -> usize {
        let bufs: usize = self
            .opt
            .state()
            .iter()
            .map(|(_, b)| b.iter().map(Vec::len).sum::<usize>() * 4)
            .sum();
        bufs + self.opt.counters().len() * 8
    }

    /// Every parameter's name and weights, in forward order.
    pub fn weights(&self) -> Vec<(String, Vec<f32>)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), self.master[p.range.clone()].to_vec()))
            .collect()
    }

    fn write_vars(&self) -> Result<()> {
        for p in &self.params {
            let t = Tensor::from_slice(
                &self.master[p.range.clone()],
                p.shape.as_slice(),
                p.var.device(),
            )?;
            p.var.set(&t)?;
        }
        Ok(())
    }

    /// Adds the gradients of every parameter found in `grads` (a backward's result)
    /// to the accumulated ones; parameters the loss does not reach add nothing.
    pub fn accumulate(&mut self, grads: &GradStore) -> Result<()> {
        for p in &self.params {
            if let Some(g) = grads.get(p.var.as_tensor()) {
                let g = g
                    .to_dtype(DType::F32)
                    .and_then(|g| g.flatten_all())
                    .and_then(|g| g.to_vec1::<f32>())?;
                for (a, b) in self.grad[p.range.clone()].iter_mut().zip(&g) {
                    *a += b;
                }
            }
        }
        Ok(())
    }

    /// Backward from `loss`, its gradients added to the accumulated ones (scale each
    /// micro-batch's loss by its share of the batch).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.accumulate(&grads)
    }

    /// The optimizer step at learning rate `lr` with the gradients accumulated since
    /// the last step, averaged over the data-parallel group; collective over it.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let lr = lr as f32;
        match (self.comm, self.sharded) {
            (Some(c), true) => {
                let mut mine = vec![0.0f32; self.shard.len()];
                c.reduce_scatter(&self.grad, &mut mine, ReduceOp::Avg)?;
                self.opt.begin_step();
                self.opt
                    .update(0, &mut self.master[self.shard.clone()], &mine, lr, 1.0);
                let send = self.master[self.shard.clone()].to_vec();
                c.all_gather(&send, &mut self.master)?;
            }
            (c, _) => {
                if let Some(c) = c {
                    c.all_reduce(&mut self.grad, ReduceOp::Avg)?;
                }
                self.opt.begin_step();
                self.opt.update(0, &mut self.master, &self.grad, lr, 1.0);
            }
        }
        self.grad.fill(0.0);
        self.steps += 1;
        self.write_vars()
    }

    /// One kind of optimizer state, whole (gathered from every shard); collective.
    fn gathered(&mut self, kind: usize) -> Result<Vec<f32>> {
        let comm = self.comm;
        let sharded = self.sharded;
        let total = self.master.len();
        let mut st = self.opt.state();
        let mine = st[kind].1[0].clone();
        drop(st.drain(..));
        match comm {
            Some(c) if sharded => {
                let mut all = vec![0.0; total];
                c.all_gather(&mine, &mut all)?;
                Ok(all)
            }
            _ => Ok(mine),
        }
    }

    /// A checkpoint of the weights, the whole optimizer state and `state` (your own
    /// JSON), on rank 0 of the data-parallel group (`None` elsewhere). Collective over
    /// the group: the shards are gathered to every rank.
    pub fn snapshot(&mut self, state: serde_json::Value) -> Result<Option<Checkpoint>> {
        let kinds: Vec<&'static str> = self.opt.state().iter().map(|(k, _)| *k).collect();
        let mut whole = Vec::with_capacity(kinds.len());
        for k in 0..kinds.len() {
            whole.push(self.gathered(k)?);
        }
        if self.comm.is_some_and(|c| c.rank() != 0) {
            return Ok(None);
        }
        let mut tensors = counter_tensors(&mut self.opt);
        for p in &self.params {
            tensors.push(CkptTensor {
                name: format!("param/{}", p.name),
                shape: p.shape.clone(),
                data: self.master[p.range.clone()].to_vec(),
            });
            for (kind, buf) in kinds.iter().zip(&whole) {
                tensors.push(CkptTensor {
                    name: format!("{kind}/{}", p.name),
                    shape: p.shape.clone(),
                    data: buf[p.range.clone()].to_vec(),
                });
            }
        }
        Ok(Some(Checkpoint {
            state: json!({"layout": self.layout, "state": state}),
            tensors,
        }))
    }

    /// Rank 0's checkpoint into every rank of the data-parallel group, each keeping its
    /// shard of the optimizer state. Collective: rank 0 passes what it loaded
    /// (`Ok(None)`: nothing to resume), the others `Ok(None)`. A checkpoint of another
    /// layout or model changes nothing and is a `TrainError::Checkpoint` (on the other
    /// ranks, an error naming rank 0's failure). Returns your JSON state on every rank.
    pub fn restore(
        &mut self,
        loaded: TrainResult<Option<(PathBuf, Checkpoint)>>,
    ) -> Result<Option<serde_json::Value>> {
        let rank = self.comm.map_or(0, Communicator::rank);
        let kinds: Vec<&'static str> = self.opt.state().iter().map(|(k, _)| *k).collect();
        let total = self.master.len();
        let mut master = vec![0.0f32; total];
        let mut whole = vec![vec![0.0f32; total]; kinds.len()];
        let mut counters: Vec<i64> = vec![0; self.opt.counters().len()];
        let mut blob = Vec::new();
        let r = if rank == 0 {
            loaded.map_err(Error::from).and_then(|ck| match ck {
                None => Ok(()),
                Some((path, ck)) => {
                    let bad = |why: String| Error::checkpoint(&path, why);
                    let layout = &ck.state["layout"];
                    if *layout != self.layout {
                        return Err(bad(format!(
                            "written by the layout {layout}; this run is {} (resume with the \
                             same pipeline stages)",
                            self.layout
                        )));
                    }
                    for p in &self.params {
                        for (kind, dst) in std::iter::once("param")
                            .chain(kinds.iter().copied())
                            .zip(std::iter::once(&mut master).chain(whole.iter_mut()))
                        {
                            let name = format!("{kind}/{}", p.name);
                            let t = stored(&ck, &name, &p.shape, &path)?;
                            dst[p.range.clone()].copy_from_slice(t);
                        }
                    }
                    for ((k, _), c) in self.opt.counters().iter().zip(counters.iter_mut()) {
                        *c = read_counter(&ck, k, &path)? as i64;
                    }
                    blob = serde_json::to_vec(&ck.state["state"])
                        .map_err(|e| bad(format!("state does not serialise: {e}")))?;
                    Ok(())
                }
            })
        } else {
            Ok(())
        };
        let r = match self.comm {
            Some(c) => agree(c, r, "to load the checkpoint"),
            None => r,
        };
        // Every tensor rank and every stage of a pipeline loads, or none does: no
        // half-restored model (the tensor group first, so that the pipeline's vote
        // carries it to the other stages).
        let mut ok = [i32::from(r.is_ok())];
        if let Some(t) = &self.tensor {
            t.with(|c| c.all_reduce(&mut ok, ReduceOp::Min))?;
        }
        if let Some(p) = self.together {
            p.all_reduce(&mut ok, ReduceOp::Min)?;
        }
        if ok[0] == 0 {
            r?;
            return Err(Error::invalid(
                "another pipeline stage or tensor-parallel rank failed to load its checkpoint \
                 (its error says why); nothing was loaded",
            ));
        }
        r?;
        if let Some(c) = self.comm {
            broadcast_bytes(c, &mut blob)?;
        }
        if blob.is_empty() {
            return Ok(None);
        }
        let state = serde_json::from_slice(&blob)
            .map_err(|e| Error::invalid(format!("checkpoint state from rank 0: {e}")))?;
        if let Some(c) = self.comm {
            c.broadcast(&mut master, 0)?;
            for w in &mut whole {
                c.broadcast(w, 0)?;
            }
            c.broadcast(&mut counters, 0)?;
        }
        self.master = master;
        let shard = self.shard.clone();
        for ((_, bufs), w) in self.opt.state().into_iter().zip(&whole) {
            bufs[0].copy_from_slice(&w[shard.clone()]);
        }
        for ((_, c), v) in self.opt.counters().into_iter().zip(counters) {
            *c = v as u64;
        }
        self.write_vars()?;
        Ok(Some(state))
    }
}

#[cfg(test)]
mod tests {
    use super::partition;

    #[test]
    fn shards_are_contiguous_equal_and_cover_everything() {
        for total in [0usize, 1, 5, 7, 64, 1001] {
            for n in [1usize, 2, 3, 4, 7, 8] {
                let s = partition(total, n);
                assert_eq!(s.len(), n);
                assert_eq!(s[0].start, 0);
                for w in s.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert_eq!(w[0].len(), w[1].len());
                }
                let end = s[n - 1].end;
                assert!(end >= total && end - total < n, "{total} over {n}: {end}");
            }
        }
    }
}
