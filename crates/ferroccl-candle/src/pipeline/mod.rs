//! Pipeline parallelism: a model cut into stages, one stage per rank of a pipeline
//! group, trained on m micro-batches per step under a [`Schedule`] (GPipe or 1F1B),
//! like PyTorch's `torch.distributed.pipelining`.
//!
//! ```no_run
//! # use candle_core::{DType, Device, Module, Tensor};
//! # use candle_nn::{VarBuilder, VarMap};
//! # use ferroccl::{Communicator, Config};
//! use ferroccl_candle::ddp::Sgd;
//! use ferroccl_candle::pipeline::{Pipeline, PipelineConfig, Schedule};
//! # fn main() -> ferroccl::Result<()> {
//! # let comm = Communicator::local_group(1, &Config::default())?.remove(0);
//! # let (x, y) = (Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap(), Tensor::zeros(8, DType::U32, &Device::Cpu).unwrap());
//! // This rank's stage: its own module over its own VarMap.
//! let vm = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
//! let stage = candle_nn::linear(4, 3, vb.pp("fc")).unwrap();
//! let cfg = PipelineConfig { schedule: Schedule::OneFOneB, micro_batches: 4, zero: false };
//! let mut pipe = Pipeline::new(&comm, None, stage, &vm, &[4], Sgd::new(0.9, 0.0), cfg)?;
//! let loss = |out: &Tensor, mb: std::ops::Range<usize>| {
//!     candle_nn::loss::cross_entropy(out, &y.narrow(0, mb.start, mb.len())?)
//! };
//! // Every stage calls step; stage 0 passes the batch, the last stage's closure computes
//! // each micro-batch's mean loss; every stage gets the batch's mean loss back.
//! let report = pipe.step(8, Some(&x), &loss, 0.1)?;
//! # let _ = report.loss; Ok(()) }
//! ```
//!
//! **A step.** Stage s runs its [`schedule::plan`] action by action. A forward takes
//! micro-batch k's input (stage 0: rows of the batch; otherwise the activation from
//! stage s − 1, as a leaf variable), runs the module and sends the output to stage
//! s + 1; a backward takes the gradient at the output (the last stage: from the loss
//! of micro-batch k times 1/m, so that the step's loss is the mean over the whole
//! batch), backpropagates through the stage, adds the parameters' gradients to the
//! accumulated ones and sends the gradient at the input to stage s − 1. Sends are
//! non-blocking (`send_start`) and the next receive in each direction is posted before
//! the current micro-batch is computed (`recv_start`), so a stage computes micro-batch
//! k + 1 while k is on the wire. After the last action the stage's optimizer steps
//! its parameters through a [`Zero`]: over the stage's data-parallel group when there
//! is one (gradients all-reduced, or reduce-scattered with ZeRO-1), and the last
//! stage's loss is broadcast so that every stage returns the same.
//!
//! **Checked at the boundary.** Every tensor crosses as a header (its shape) and its
//! f32 elements. A receiving stage compares the header with what it expects (its
//! declared per-sample input shape, or the shape of the output it sent) and fails with
//! `Mismatch` naming both; a length that differs is the library's own
//! `Mismatch`. Any failure in a step aborts the stage's communicators, so the other
//! stages fail within their timeout instead of waiting forever.
//!
//! **2-D layouts**: [`Layout::split`] cuts a job of W ranks into W/P pipelines of P
//! stages; rank r is stage r mod P of replica r / P, and the ranks holding the same
//! stage form its data-parallel group. **3-D**: [`Layout::mesh`] adds T
//! tensor-parallel ranks per stage (P × T × D, see [`crate::tensor_parallel`]), whose
//! layers a stage declares with [`Pipeline::with_tensor_group`].

pub mod mlp;
pub mod schedule;

use crate::ddp::Optimizer;
use crate::error::{Error, Result};
use crate::tensor_parallel::{Mesh, TensorGroup};
use crate::zero::Zero;
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::VarMap;
use ferroccl::Communicator;
use ferroccl::Pending;
pub use schedule::{Action, Schedule};
use serde_json::json;
use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How a pipeline runs a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineConfig {
    /// GPipe or 1F1B.
    pub schedule: Schedule,
    /// Micro-batches per step (m); must divide the batch.
    pub micro_batches: usize,
    /// Shard the optimizer state over the stage's data-parallel group (ZeRO-1).
    pub zero: bool,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: Schedule::GPipe,
            micro_batches: 1,
            zero: false,
        }
    }
}

/// What one [`Pipeline::step`] did on this stage.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The step's loss: the mean over the whole batch, over every replica's share
    /// (the same on every rank).
    pub loss: f64,
    /// Time spent computing forwards and backwards.
    pub busy: Duration,
    /// Time spent waiting for activations and gradients from neighbours.
    pub waiting: Duration,
    /// From the first action to the end of the last (before the optimizer step).
    pub schedule_time: Duration,
    /// The most micro-batches whose activations this stage held at once.
    pub peak_live: usize,
}

/// The pipeline, tensor-parallel and data-parallel groups of one rank in a
/// P × T × D layout ([`Mesh`]; T = 1 is the P × D layout).
pub struct Layout {
    /// This rank's pipeline (P ranks, in stage order).
    pub pipe: Communicator,
    /// The ranks holding the same stage and tensor shard (D ranks, in replica order).
    pub data: Communicator,
    /// The ranks splitting this stage's layers (T ranks; this rank alone when T = 1).
    pub tensor: TensorGroup,
}

impl Layout {
    /// Splits `comm` (W ranks) into W / `stages` pipelines: rank r is stage r mod P of
    /// replica r / P (the P × 1 × D [`Mesh`]). Collective; W not a multiple of P is
    /// `InvalidArgument` on every rank.
    pub fn split(comm: &Communicator, stages: usize) -> Result<Layout> {
        let mesh = Mesh::for_world(comm.world_size(), stages, 1);
        Self::checked(comm, mesh)
    }

    /// Cuts `comm` into `mesh`'s groups: rank r = t + T × (s + P × d) is tensor rank t
    /// of stage s of replica d. Collective over `comm`; every rank first gathers the
    /// mesh every rank asked for, so that a mesh the ranks disagree on
    /// (`Mismatch`) or whose P × T × D is not the job's size
    /// (`InvalidArgument`) fails on every rank alike, before any group is
    /// made.
    pub fn mesh(comm: &Communicator, mesh: Mesh) -> Result<Layout> {
        Self::checked(comm, Ok(mesh))
    }

    fn checked(comm: &Communicator, mesh: Result<Mesh>) -> Result<Layout> {
        let w = comm.world_size();
        // A rank that could not even name its mesh still gathers (as zeros).
        let mine = mesh.as_ref().map_or([0; 3], Mesh::words);
        let mut all = vec![0i64; 3 * w];
        comm.all_gather(&mine, &mut all)?;
        mesh?;
        let asked: Vec<Mesh> = all.chunks_exact(3).map(Mesh::from_words).collect();
        let mesh = Mesh::agree(comm.rank(), &asked)?;
        let c = mesh.coords(comm.rank());
        let (p, t) = (mesh.pipeline, mesh.tensor);
        let color = |v: usize| {
            u32::try_from(v).map_err(|_| {
                Error::invalid(format!("a layout of {w} ranks: group {v} is beyond u32"))
            })
        };
        let missing = || Error::invalid("split left this rank out");
        let tensor = comm
            .split(Some(color(c.stage + p * c.replica)?), c.tensor as i64)?
            .ok_or_else(missing)?;
        let pipe = comm
            .split(Some(color(c.tensor + t * c.replica)?), c.stage as i64)?
            .ok_or_else(missing)?;
        let data = comm
            .split(Some(color(c.tensor + t * c.stage)?), c.replica as i64)?
            .ok_or_else(missing)?;
        Ok(Layout {
            pipe,
            data,
            tensor: TensorGroup::new(tensor),
        })
    }
}

/// Message tags: kind in the top byte, the micro-batch below (matching is in posting
/// order anyway; the tag makes a crossed message a mismatch, not a wrong tensor).
const FWD_HEAD: u32 = 1 << 24;
const FWD_DATA: u32 = 2 << 24;
const BWD_HEAD: u32 = 3 << 24;
const BWD_DATA: u32 = 4 << 24;
/// Header: rank of the shape, then up to 7 dimensions.
const HEAD: usize = 8;

fn tag(kind: u32, mb: usize) -> u32 {
    kind | (mb as u32 & 0x00ff_ffff)
}

fn header(dims: &[usize]) -> Result<Vec<i64>> {
    if dims.len() >= HEAD {
        return Err(Error::invalid(format!(
            "a pipeline carries tensors of at most {} dimensions, not {dims:?}",
            HEAD - 1
        )));
    }
    let mut h = vec![0i64; HEAD];
    h[0] = dims.len() as i64;
    for (d, &v) in h[1..].iter_mut().zip(dims) {
        *d = v as i64;
    }
    Ok(h)
}

fn dims_of(h: &[i64]) -> Vec<i64> {
    let n = (h[0].max(0) as usize).min(HEAD - 1);
    h[1..=n].to_vec()
}

/// A receive posted ahead: the header and the elements.
struct Incoming {
    head: Pending<i64>,
    data: Pending<f32>,
}

/// A step's operations in flight: sends not yet confirmed and the receives posted
/// ahead.
#[derive(Default)]
struct InFlight {
    sends: Vec<Pending<f32>>,
    heads: Vec<Pending<i64>>,
    next_fwd: Option<Incoming>,
    next_bwd: Option<(usize, Incoming)>,
}

/// What a forward keeps for its backward.
struct Live {
    input: Option<Var>,
    output: Tensor,
}

/// One step's way through this stage's plan.
struct Progress {
    /// Samples per micro-batch.
    mb: usize,
    /// What each micro-batch's forward keeps until its backward.
    live: Vec<Option<Live>>,
    /// Micro-batches held, and the most held at once.
    n_live: usize,
    peak: usize,
    rep: StepReport,
    /// The last stage's micro-batch losses, summed.
    loss_sum: f64,
    /// The micro-batches in the order their forwards, and their backwards, run.
    fwd_order: Vec<usize>,
    bwd_order: Vec<usize>,
    /// Forwards whose activations were taken; backwards whose gradients were.
    fi: usize,
    bi: usize,
}

/// One stage of a pipeline; see the module docs.
pub struct Pipeline<'c, M, O> {
    pipe: &'c Communicator,
    module: M,
    params: Zero<'c, O>,
    in_shape: Vec<usize>,
    cfg: PipelineConfig,
    plan: Vec<Action>,
    tensor: Option<TensorGroup>,
    /// Where the stage's variables live, and so where what it receives is put.
    device: candle_core::Device,
}

impl<'c, M: Module, O: Optimizer> Pipeline<'c, M, O> {
    /// Stage `pipe.rank()` of a pipeline of `pipe.world_size()` stages: `module` over
    /// the variables of `varmap` (taken in name order), reading inputs of per-sample
    /// shape `in_shape` (the batch dimension comes first and is not part of it),
    /// stepped by `opt` over the stage's data-parallel group `data` (`None`: no data
    /// parallelism). Collective over `data`: its rank 0's weights become every
    /// replica's.
    pub fn new(
        pipe: &'c Communicator,
        data: Option<&'c Communicator>,
        module: M,
        varmap: &VarMap,
        in_shape: &[usize],
        opt: O,
        cfg: PipelineConfig,
    ) -> Result<Self> {
        let vars = crate::ddp::sorted_vars(varmap)?;
        Self::from_vars(pipe, data, module, vars, in_shape, opt, cfg)
    }

    /// As [`Pipeline::new`], with the stage's variables named and in order.
    pub fn from_vars(
        pipe: &'c Communicator,
        data: Option<&'c Communicator>,
        module: M,
        vars: Vec<(String, Var)>,
        in_shape: &[usize],
        opt: O,
        cfg: PipelineConfig,
    ) -> Result<Self> {
        let (p, s) = (pipe.world_size(), pipe.rank());
        let plan = schedule::plan(cfg.schedule, p, cfg.micro_batches)?.swap_remove(s);
        let device = vars
            .first()
            .map_or(candle_core::Device::Cpu, |(_, v)| v.device().clone());
        let mut params = Zero::new(data, vars, opt, cfg.zero)?;
        params.set_layout(json!({"stage": s, "stages": p}), pipe);
        Ok(Pipeline {
            pipe,
            module,
            params,
            in_shape: in_shape.to_vec(),
            cfg,
            plan,
            tensor: None,
            device,
        })
    }

    /// Declares that this stage's layers are split over `tensor` (tensor-parallel
    /// layers built on it, their variables this rank's shards): the tensor rank joins
    /// the checkpoint layout, a failed step aborts the group too (so that the stage's
    /// other tensor ranks fail rather than wait), and a checkpoint loads on every
    /// tensor rank or on none.
    pub fn with_tensor_group(mut self, tensor: &TensorGroup) -> Self {
        let (s, p) = (self.pipe.rank(), self.pipe.world_size());
        let layout =
            json!({"stage": s, "stages": p, "tensor": tensor.rank(), "tensors": tensor.size()});
        self.params.set_layout(layout, self.pipe);
        self.params.set_tensor(tensor.clone());
        self.tensor = Some(tensor.clone());
        self
    }

    /// Where this stage's variables live (the device of its first variable; the CPU
    /// for a stage without any): inputs and losses it is given must be there too.
    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    /// This stage's index.
    pub fn stage(&self) -> usize {
        self.pipe.rank()
    }

    /// This stage's parameters and optimizer.
    pub fn params(&self) -> &Zero<'c, O> {
        &self.params
    }

    /// As [`Pipeline::params`], mutable (for the optimizer-state size).
    pub fn params_mut(&mut self) -> &mut Zero<'c, O> {
        &mut self.params
    }

    /// Micro-batches per step.
    pub fn micro_batches(&self) -> usize {
        self.cfg.micro_batches
    }

    /// The stage's weights by name.
    pub fn weights(&self) -> Vec<(String, Vec<f32>)> {
        self.params.weights()
    }

    /// One training step on a batch of `batch` samples (every stage passes the same):
    /// stage 0 passes the batch as `input` (its first dimension `batch`), the last
    /// stage's `loss(output, rows)` gives micro-batch `rows`' mean loss; then the
    /// optimizer step at `lr`. Collective over the pipeline and the data-parallel
    /// group. On any error this stage's communicators are aborted, so that every other
    /// stage fails too rather than waiting.
    pub fn step(
        &mut self,
        batch: usize,
        input: Option<&Tensor>,
        loss: &dyn Fn(&Tensor, Range<usize>) -> candle_core::Result<Tensor>,
        lr: f64,
    ) -> Result<StepReport> {
        let m = self.cfg.micro_batches;
        if batch == 0 || !batch.is_multiple_of(m) {
            return Err(Error::invalid(format!(
                "{m} micro-batches do not divide the batch of {batch}"
            )));
        }
        if self.stage() == 0 {
            match input {
                Some(x) if x.dims().first() == Some(&batch) => {}
                Some(x) => {
                    return Err(Error::invalid(format!(
                        "stage 0's input has shape {:?}, not a batch of {batch}",
                        x.dims()
                    )))
                }
                None => return Err(Error::invalid("stage 0 needs the batch as input")),
            }
        }
        let mut flight = InFlight::default();
        let r = self.run(batch / m, input, loss, lr, &mut flight);
        if r.is_err() {
            // Before the operations still in flight are dropped (a drop waits for its
            // operation): aborted, they end at once instead of at the timeout.
            self.pipe.abort_handle().abort();
            if let Some(c) = self.params.comm() {
                c.abort_handle().abort();
            }
            if let Some(t) = &self.tensor {
                t.abort();
            }
        }
        drop(flight);
        r
    }

    /// The step's plan, action by action, then the optimizer step.
    fn run(
        &mut self,
        mb: usize,
        input: Option<&Tensor>,
        loss: &dyn Fn(&Tensor, Range<usize>) -> candle_core::Result<Tensor>,
        lr: f64,
        fl: &mut InFlight,
    ) -> Result<StepReport> {
        let (p, s, m) = (self.pipe.world_size(), self.stage(), self.cfg.micro_batches);
        let last = s + 1 == p;
        let mut pr = Progress {
            mb,
            live: (0..m).map(|_| None).collect(),
            n_live: 0,
            peak: 0,
            rep: StepReport::default(),
            loss_sum: 0.0,
            fwd_order: schedule::order(&self.plan, true),
            bwd_order: schedule::order(&self.plan, false),
            fi: 0,
            bi: 0,
        };
        let t0 = Instant::now();
        // The next receive of each direction, posted one micro-batch ahead.
        fl.next_fwd = self.post_fwd(&pr, 0)?;
        for &a in &self.plan.clone() {
            match a {
                Action::Forward(k) => self.forward(k, input, &mut pr, fl)?,
                Action::Backward(k) => self.backward(k, loss, &mut pr, fl)?,
            }
            // Once the next backward's forward is done, its gradient's receive is
            // posted, so it lands while this stage computes.
            if !last && fl.next_bwd.is_none() {
                self.post_next_bwd(&pr, fl)?;
            }
        }
        let w = Instant::now();
        for h in fl.heads.drain(..) {
            h.wait()?;
        }
        for d in fl.sends.drain(..) {
            d.wait()?;
        }
        pr.rep.waiting += w.elapsed();
        pr.rep.schedule_time = t0.elapsed();
        pr.rep.peak_live = pr.peak;
        self.params.step(lr)?;
        let mut l = [pr.loss_sum / m as f64];
        self.pipe.broadcast(&mut l, p - 1)?;
        if let Some(c) = self.params.comm() {
            // Each replica had its share of the batch: the loss of the whole.
            c.all_reduce(&mut l, ferroccl::ReduceOp::Avg)?;
        }
        pr.rep.loss = l[0];
        Ok(pr.rep)
    }

    /// The receive of the `i`-th forward's activations from the stage before (none on
    /// stage 0, or past the last).
    fn post_fwd(&self, pr: &Progress, i: usize) -> Result<Option<Incoming>> {
        let s = self.stage();
        let in_len: usize = pr.mb * self.in_shape.iter().product::<usize>();
        match pr.fwd_order.get(i) {
            Some(&k) if s > 0 => Ok(Some(Incoming {
                head: self
                    .pipe
                    .recv_start(vec![0i64; HEAD], s - 1, tag(FWD_HEAD, k))?,
                data: self
                    .pipe
                    .recv_start(vec![0f32; in_len], s - 1, tag(FWD_DATA, k))?,
            })),
            _ => Ok(None),
        }
    }

    /// The receive of the next backward's gradient from the stage after, once its
    /// forward is done.
    fn post_next_bwd(&self, pr: &Progress, fl: &mut InFlight) -> Result<()> {
        if let Some(&k1) = pr.bwd_order.get(pr.bi) {
            if let Some(o) = pr.live[k1].as_ref() {
                fl.next_bwd = Some((k1, self.post_bwd(k1, o.output.dims())?));
            }
        }
        Ok(())
    }

    /// Action `Forward(k)`: micro-batch `k`'s input (stage 0's slice of the batch, or
    /// the activations received), its forward, its output sent on.
    fn forward(
        &mut self,
        k: usize,
        input: Option<&Tensor>,
        pr: &mut Progress,
        fl: &mut InFlight,
    ) -> Result<()> {
        let (s, mb) = (self.stage(), pr.mb);
        let last = s + 1 == self.pipe.world_size();
        let x = if s == 0 {
            input
                .ok_or_else(|| out_of_plan("stage 0 has no input batch"))?
                .narrow(0, k * mb, mb)?
        } else {
            let inc = fl
                .next_fwd
                .take()
                .ok_or_else(|| out_of_plan("a forward with no receive posted"))?;
            pr.fi += 1;
            fl.next_fwd = self.post_fwd(pr, pr.fi)?;
            let mut want = vec![mb];
            want.extend_from_slice(&self.in_shape);
            let w = Instant::now();
            let t = self.take(inc, &want, s - 1, k, "activations")?;
            pr.rep.waiting += w.elapsed();
            t
        };
        let c = Instant::now();
        let (inp, x) = if s == 0 {
            (None, x)
        } else {
            let v = Var::from_tensor(&x)?;
            let t = v.as_tensor().clone();
            (Some(v), t)
        };
        let out = self.module.forward(&x)?;
        if out.dtype() != DType::F32 {
            return Err(Error::invalid(format!(
                "stage {s} produced {:?} activations; pipelines carry f32",
                out.dtype()
            )));
        }
        if !last {
            let h = header(out.dims())?;
            let data = flat(&out)?;
            fl.heads
                .push(self.pipe.send_start(h, s + 1, tag(FWD_HEAD, k))?);
            fl.sends
                .push(self.pipe.send_start(data, s + 1, tag(FWD_DATA, k))?);
        }
        pr.live[k] = Some(Live {
            input: inp,
            output: out,
        });
        pr.n_live += 1;
        pr.peak = pr.peak.max(pr.n_live);
        pr.rep.busy += c.elapsed();
        Ok(())
    }

    /// Action `Backward(k)`: micro-batch `k`'s gradients (from its loss on the last
    /// stage, from the gradient received elsewhere) into the parameters' sums, its
    /// input's gradient sent back.
    fn backward(
        &mut self,
        k: usize,
        loss: &dyn Fn(&Tensor, Range<usize>) -> candle_core::Result<Tensor>,
        pr: &mut Progress,
        fl: &mut InFlight,
    ) -> Result<()> {
        let (s, m, mb) = (self.stage(), self.cfg.micro_batches, pr.mb);
        let last = s + 1 == self.pipe.world_size();
        let Live { input: inp, output } = pr
            .live
            .get_mut(k)
            .and_then(Option::take)
            .ok_or_else(|| out_of_plan("a backward before its forward"))?;
        let grads = if last {
            let c = Instant::now();
            let l = loss(&output, k * mb..(k + 1) * mb)?;
            pr.loss_sum += l.to_scalar::<f32>()? as f64;
            let l = (l * (1.0 / m as f64))?;
            let g = l.backward()?;
            pr.rep.busy += c.elapsed();
            g
        } else {
            let (k0, inc) = match fl.next_bwd.take() {
                Some(x) => x,
                None => (k, self.post_bwd(k, output.dims())?),
            };
            debug_assert_eq!(k0, k);
            pr.bi += 1;
            // The next gradient's receive goes out before this one is used.
            self.post_next_bwd(pr, fl)?;
            let w = Instant::now();
            let g = self.take(inc, output.dims(), s + 1, k, "gradients")?;
            pr.rep.waiting += w.elapsed();
            let c = Instant::now();
            let sur = (&output * &g).and_then(|t| t.sum_all())?;
            let g = sur.backward()?;
            pr.rep.busy += c.elapsed();
            g
        };
        let c = Instant::now();
        self.params.accumulate(&grads)?;
        if let Some(v) = inp {
            let gi = grads.get(v.as_tensor()).ok_or_else(|| {
                Error::invalid(format!("stage {s}'s output does not depend on its input"))
            })?;
            let h = header(gi.dims())?;
            let data = flat(gi)?;
            fl.heads
                .push(self.pipe.send_start(h, s - 1, tag(BWD_HEAD, k))?);
            fl.sends
                .push(self.pipe.send_start(data, s - 1, tag(BWD_DATA, k))?);
        }
        pr.n_live -= 1;
        pr.rep.busy += c.elapsed();
        Ok(())
    }

    fn post_bwd(&self, k: usize, dims: &[usize]) -> Result<Incoming> {
        let s = self.stage();
        let n: usize = dims.iter().product();
        Ok(Incoming {
            head: self
                .pipe
                .recv_start(vec![0i64; HEAD], s + 1, tag(BWD_HEAD, k))?,
            data: self
                .pipe
                .recv_start(vec![0f32; n], s + 1, tag(BWD_DATA, k))?,
        })
    }

    /// Waits for a posted receive and checks its header against `want`.
    fn take(
        &self,
        inc: Incoming,
        want: &[usize],
        peer: usize,
        k: usize,
        what: &str,
    ) -> Result<Tensor> {
        let s = self.stage();
        let head = inc.head.wait()?;
        let got = dims_of(&head);
        let want_i: Vec<i64> = want.iter().map(|&d| d as i64).collect();
        if got != want_i {
            // Let the elements' receive finish or fail before reporting.
            drop(inc.data);
            return Err(ferroccl::Error::Mismatch {
                rank: self.pipe.rank(),
                peer,
                ours: format!("stage {s} expects {what} of shape {want:?} f32 for micro-batch {k}"),
                theirs: format!("stage {peer} sent shape {got:?}"),
            }
            .into());
        }
        let data = inc.data.wait()?;
        Ok(Tensor::from_vec(data, want, &self.device)?)
    }

    /// A checkpoint of this stage (weights, optimizer state, the layout) and `state`,
    /// on rank 0 of the stage's data-parallel group; collective over that group.
    pub fn snapshot(
        &mut self,
        state: serde_json::Value,
    ) -> Result<Option<ferroccl::ddp::Checkpoint>> {
        self.params.snapshot(state)
    }

    /// Restores this stage from a checkpoint (see [`Zero::restore`]); one written by
    /// another stage or another stage count is [`TrainError::Checkpoint`](ferroccl::ddp::TrainError::Checkpoint). Collective over
    /// the data-parallel group and the pipeline: when any stage fails to load, every
    /// stage fails and none changes.
    pub fn restore(
        &mut self,
        loaded: ferroccl::ddp::TrainResult<Option<(PathBuf, ferroccl::ddp::Checkpoint)>>,
    ) -> Result<Option<serde_json::Value>> {
        self.params.restore(loaded)
    }
}

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// A schedule that broke its own plan's rules (plans are validated, so this is a bug
/// in this module): an error, not a panic in the middle of a step.
fn out_of_plan(what: &str) -> Error {
    Error::invalid(format!(
        "pipeline executor: {what} (the schedule's plan broke its rules)"
    ))
}
