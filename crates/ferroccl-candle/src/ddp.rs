//! `Ddp`: data-parallel training for any candle model, in a few lines.
//!
//! ```no_run
//! # use candle_core::{DType, Device, Tensor};
//! # use candle_nn::{Module, VarBuilder, VarMap};
//! # use ferroccl::{Communicator, Config};
//! use ferroccl_candle::ddp::{Ddp, DdpConfig, Sgd};
//! # fn main() -> ferroccl::Result<()> {
//! # let comm = Communicator::local_group(1, &Config::default())?.remove(0);
//! # let (x, y) = (Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap(), Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap());
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let model = candle_nn::linear(3, 10, vb.pp("fc")).unwrap(); // your model
//! // Rank 0's initial weights reach every rank here.
//! let mut ddp = Ddp::new(&comm, &varmap, Sgd::new(0.9, 0.0), DdpConfig::default())?;
//! for _step in 0..10 {
//!     let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
//!     ddp.backward(&loss)?; // buckets all-reduced in the background
//!     ddp.step(0.1)?; // each bucket's parameters stepped as soon as it is reduced
//! }
//! # Ok(()) }
//! ```
//!
//! What it does, in PyTorch DDP's terms:
//!
//! * **Initial weights** are broadcast from rank 0 in [`Ddp::new`], so replicas start
//!   identical; every step applies the same averaged gradients everywhere, so they stay
//!   identical (bit for bit: the all-reduce gives every rank the same bytes).
//! * **Buckets** ([`ferroccl::ddp::buckets`]): parameters in reverse registration
//!   order, packed into buckets of [`DdpConfig::bucket_bytes`] (the first
//!   [`DdpConfig::first_bucket_bytes`]); PyTorch's 25 MiB / 1 MiB by default. A bucket's
//!   all-reduce starts in the background the moment its last gradient is in.
//! * **Optimizer step per bucket**: [`Ddp::step`] waits for the buckets in the order
//!   they were launched and updates each bucket's parameters as soon as that bucket is
//!   reduced, while the later buckets are still on the wire.
//! * **Overlap with backward**: candle computes all gradients in one `backward()`, so
//!   [`Ddp::backward`] launches the buckets right after it. A model that can run its
//!   backward in segments (as the trainer's `LeNet` does) hands each gradient over as
//!   it appears with [`Ddp::begin_pass`] / [`Ddp::grad_ready`] / [`Ddp::end_pass`], and
//!   the first buckets travel while the earlier layers are still differentiated.
//! * **`no_sync`**: [`Ddp::backward_no_sync`] adds the gradients into the buckets
//!   without communicating; the next [`Ddp::backward`] sends the sum.
//! * **Half-precision gradients on the wire**: [`DdpConfig::wire`] (f16/bf16).
//! * **Mixed precision**: [`Ddp::step_scaled`] with a [`LossScaler`] unscales, skips
//!   steps whose averaged gradients overflowed and adjusts the scale (the same on every
//!   rank, since every rank checks the same averaged gradients).
//! * **Checkpoints**: [`Ddp::snapshot`] (weights and optimizer state, plus your own
//!   JSON state) for rank 0 to save, and [`Ddp::restore`], which every rank calls and
//!   which gives every rank rank 0's loaded weights, optimizer state and JSON state:
//!   a resumed run continues bit for bit.
//!
//! The weights the optimizer updates are f32 master copies held here; after each step
//! they are written into the candle `Var`s the model reads. Variables must be f32 (a
//! model that computes in f16 casts them in its forward pass, as the trainer's does).
//! They may live on any candle device: on a GPU (this crate's feature `candle-cuda`) the
//! gradients are read back to the host for the buckets and the stepped weights written
//! back to the variables' device, so the collectives, the loss scaling and the
//! checkpoints are the CPU's and the replicas stay bitwise equal; the copies cost a
//! step two transfers of the model's size.
//! The sampler, LR schedule and loss scaler are `ferroccl::ddp`'s, re-exported here.

use crate::error::{Error, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use ferroccl::ddp::buckets::BucketPlan;
use ferroccl::ddp::checkpoint::{Checkpoint, Tensor as CkptTensor};
use ferroccl::ddp::scaler::{all_finite, ScaleAction};
use ferroccl::ddp::{GradReducer, TrainError, TrainResult};
use ferroccl::Communicator;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use ferroccl::ddp::buckets::{DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
pub use ferroccl::ddp::{Decay, DistributedSampler, LossScaler, LrSchedule, Rng, WireDtype};

/// Bucket sizes and the gradients' type on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DdpConfig {
    /// Cap of every bucket but the first, bytes (PyTorch: 25 MiB).
    pub bucket_bytes: usize,
    /// Cap of the first bucket, bytes (PyTorch: 1 MiB), so communication starts early.
    pub first_bucket_bytes: usize,
    /// Gradient element type on the wire.
    pub wire: WireDtype,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            wire: WireDtype::F32,
        }
    }
}

/// An optimizer over f32 master weights, one parameter at a time, so that a bucket's
/// parameters can be stepped as soon as that bucket is reduced. Its state is a set of
/// per-parameter buffers (SGD: the momentum), which checkpoints save and restore.
pub trait Optimizer {
    /// Called once by [`Ddp`] with every parameter's element count (registration
    /// order) before any update.
    fn init(&mut self, param_lens: &[usize]);
    /// Updates parameter `param`'s weights `w` from its averaged gradient `g`, to be
    /// multiplied by `grad_scale` first (1 / loss scale), at learning rate `lr`.
    fn update(&mut self, param: usize, w: &mut [f32], g: &[f32], lr: f32, grad_scale: f32);
    /// The state: a name per kind of buffer (used in checkpoints as `name/param`) and
    /// one buffer per parameter, each as long as its parameter.
    fn state(&mut self) -> Vec<(&'static str, &mut Vec<Vec<f32>>)>;
    /// Called once before the updates of every step that is applied (not of a step
    /// skipped for overflow): Adam counts its steps here for the bias correction.
    fn begin_step(&mut self) {}
    /// Scalar state (Adam: the step count), saved in checkpoints as `opt/NAME`.
    fn counters(&mut self) -> Vec<(&'static str, &mut u64)> {
        Vec::new()
    }
}

/// Adam (Kingma & Ba) and AdamW (Loshchilov & Hutter), PyTorch's `torch.optim.Adam` /
/// `AdamW` update with t counted by [`Optimizer::begin_step`]:
/// g' = g × scale (+ wd × w for Adam's L2 decay); m = β1 m + (1 − β1) g';
/// v = β2 v + (1 − β2) g'²; w −= lr × (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + ε), and for
/// AdamW first w −= lr × wd × w (decoupled decay). All in f32, element by element, so
/// a shard of a flat buffer steps exactly as the whole ([`crate::zero::Zero`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Adam {
    /// β1, the first moment's decay.
    pub beta1: f32,
    /// β2, the second moment's decay.
    pub beta2: f32,
    /// ε, added to the root of the second moment.
    pub eps: f32,
    /// Weight decay: L2 (added to the gradient) for Adam, decoupled for AdamW.
    pub weight_decay: f32,
    /// AdamW's decoupled decay (true) or Adam's L2 (false).
    pub decoupled: bool,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    t: u64,
}

impl Adam {
    /// Adam with β = (0.9, 0.999), ε = 1e-8 and L2 weight decay `weight_decay`.
    pub fn new(weight_decay: f32) -> Self {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decoupled: false,
            m: Vec::new(),
            v: Vec::new(),
            t: 0,
        }
    }

    /// AdamW with β = (0.9, 0.999), ε = 1e-8 and decoupled weight decay `weight_decay`.
    pub fn adamw(weight_decay: f32) -> Self {
        Adam {
            decoupled: true,
            ..Adam::new(weight_decay)
        }
    }

    /// Steps taken (t).
    pub fn steps(&self) -> u64 {
        self.t
    }
}

impl Optimizer for Adam {
    fn init(&mut self, param_lens: &[usize]) {
        self.m = param_lens.iter().map(|&n| vec![0.0; n]).collect();
        self.v = self.m.clone();
        self.t = 0;
    }

    fn begin_step(&mut self) {
        self.t += 1;
    }

    fn update(&mut self, param: usize, w: &mut [f32], g: &[f32], lr: f32, grad_scale: f32) {
        let t = self.t.clamp(1, i32::MAX as u64) as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let (m, v) = (&mut self.m[param], &mut self.v[param]);
        for (((w, &gi), mi), vi) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let mut d = gi * grad_scale;
            if self.decoupled {
                *w -= lr * self.weight_decay * *w;
            } else {
                d += self.weight_decay * *w;
            }
            *mi = b1 * *mi + (1.0 - b1) * d;
            *vi = b2 * *vi + (1.0 - b2) * d * d;
            *w -= lr * (*mi / c1) / ((*vi / c2).sqrt() + self.eps);
        }
    }

    fn state(&mut self) -> Vec<(&'static str, &mut Vec<Vec<f32>>)> {
        vec![("exp_avg", &mut self.m), ("exp_avg_sq", &mut self.v)]
    }

    fn counters(&mut self) -> Vec<(&'static str, &mut u64)> {
        vec![("step", &mut self.t)]
    }
}

/// The optimizer's counters as checkpoint tensors `opt/NAME`: two f32 holding 24 bits
/// each (exact below 2^48).
pub(crate) fn counter_tensors(opt: &mut impl Optimizer) -> Vec<CkptTensor> {
    opt.counters()
        .into_iter()
        .map(|(name, v)| CkptTensor {
            name: format!("opt/{name}"),
            shape: vec![2],
            data: vec![(*v & 0xff_ffff) as f32, (*v >> 24) as f32],
        })
        .collect()
}

/// The elements of `ck`'s tensor `name`, which must have `shape`; else a typed error
/// naming `source`.
pub(crate) fn stored<'a>(
    ck: &'a Checkpoint,
    name: &str,
    shape: &[usize],
    source: &Path,
) -> Result<&'a [f32]> {
    let t = ck
        .tensor(name)
        .ok_or_else(|| Error::checkpoint(source, format!("no tensor {name}")))?;
    if t.shape != shape {
        return Err(Error::checkpoint(
            source,
            format!("{name} has shape {:?}, the model {shape:?}", t.shape),
        ));
    }
    Ok(&t.data)
}

/// Every variable of `varmap`, in the order of their names.
pub(crate) fn sorted_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|_| Error::invalid("the VarMap's lock is poisoned"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(vars)
}

/// Checks that `vars` are f32 with distinct names, and reads their values.
pub(crate) fn read_vars(vars: Vec<(String, Var)>) -> Result<Vec<(String, Var, Vec<f32>)>> {
    let mut out: Vec<(String, Var, Vec<f32>)> = Vec::with_capacity(vars.len());
    for (name, var) in vars {
        if var.dtype() != DType::F32 {
            return Err(Error::invalid(format!(
                "variable {name} is {:?}: the optimizer keeps f32 variables (cast to half \
                 precision in the forward pass)",
                var.dtype()
            )));
        }
        if out.iter().any(|p| p.0 == name) {
            return Err(Error::invalid(format!("variable name {name} given twice")));
        }
        let v = var
            .as_tensor()
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())?;
        out.push((name, var, v));
    }
    Ok(out)
}

/// The counter `opt/NAME` of `ck`, or a typed error naming `source`.
pub(crate) fn read_counter(ck: &Checkpoint, name: &str, source: &Path) -> Result<u64> {
    let t = ck
        .tensor(&format!("opt/{name}"))
        .ok_or_else(|| Error::checkpoint(source, format!("no tensor opt/{name}")))?;
    match t.data.as_slice() {
        [lo, hi] if lo.fract() == 0.0 && hi.fract() == 0.0 && *lo >= 0.0 && *hi >= 0.0 => {
            Ok(*lo as u64 | (*hi as u64) << 24)
        }
        _ => Err(Error::checkpoint(
            source,
            format!("opt/{name} is not a step counter"),
        )),
    }
}

/// SGD with momentum and L2 weight decay (PyTorch's `torch.optim.SGD` update):
/// d = g × scale + wd × w; m = μ × m + d; w −= lr × m.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sgd {
    /// Momentum μ (0: plain SGD).
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    bufs: Vec<Vec<f32>>,
}

impl Sgd {
    /// SGD with momentum `momentum` and weight decay `weight_decay`.
    pub fn new(momentum: f32, weight_decay: f32) -> Self {
        Sgd {
            momentum,
            weight_decay,
            bufs: Vec::new(),
        }
    }
}

impl Optimizer for Sgd {
    fn init(&mut self, param_lens: &[usize]) {
        self.bufs = param_lens.iter().map(|&n| vec![0.0; n]).collect();
    }

    fn update(&mut self, param: usize, w: &mut [f32], g: &[f32], lr: f32, grad_scale: f32) {
        let m = &mut self.bufs[param];
        for ((w, &gi), mi) in w.iter_mut().zip(g).zip(m.iter_mut()) {
            let d = gi * grad_scale + self.weight_decay * *w;
            *mi = self.momentum * *mi + d;
            *w -= lr * *mi;
        }
    }

    fn state(&mut self) -> Vec<(&'static str, &mut Vec<Vec<f32>>)> {
        vec![("momentum", &mut self.bufs)]
    }
}

/// One parameter: the candle variable the model reads and the f32 master copy the
/// optimizer updates.
struct Param {
    name: String,
    shape: Vec<usize>,
    var: Var,
    master: Vec<f32>,
}

/// What one [`Ddp::step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Whether the optimizer step was applied (false: skipped for overflow).
    pub applied: bool,
    /// Time spent waiting for all-reduces: the communication backward did not hide.
    pub exposed: Duration,
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Bytes this rank put into the all-reduces (before the ring's 2(n−1)/n factor).
    pub bytes: usize,
}

/// Data-parallel training of one model replica on one communicator; see the module
/// docs.
pub struct Ddp<'c, O> {
    comm: &'c Communicator,
    params: Vec<Param>,
    reducer: GradReducer<'c>,
    opt: O,
    steps: u64,
    in_pass: bool,
    /// Set by a pass that only accumulated (`no_sync`), cleared by a synchronising
    /// one: stepping in between would apply this rank's own gradients only.
    local_only: bool,
}

impl<'c, O: Optimizer> Ddp<'c, O> {
    /// DDP over every variable of `varmap`. A `VarMap` does not keep the order the
    /// variables were created in, so they are taken in the order of their names
    /// (`fc1.weight` before `fc2.weight`): name layers so that this is the forward
    /// order, or give the order with [`Ddp::from_vars`]. Collective: every rank calls
    /// it; rank 0's weights become every rank's.
    pub fn new(comm: &'c Communicator, varmap: &VarMap, opt: O, cfg: DdpConfig) -> Result<Self> {
        Self::from_vars(comm, sorted_vars(varmap)?, opt, cfg)
    }

    /// DDP over `vars`, named and in registration (forward) order: buckets are packed
    /// from the last. Collective: every rank calls it with the same names and shapes;
    /// rank 0's weights become every rank's.
    pub fn from_vars(
        comm: &'c Communicator,
        vars: Vec<(String, Var)>,
        mut opt: O,
        cfg: DdpConfig,
    ) -> Result<Self> {
        let params: Vec<Param> = read_vars(vars)?
            .into_iter()
            .map(|(name, var, master)| Param {
                name,
                shape: var.dims().to_vec(),
                var,
                master,
            })
            .collect();
        let lens: Vec<usize> = params.iter().map(|p| p.master.len()).collect();
        opt.init(&lens);
        let reducer = GradReducer::new(
            comm,
            &lens,
            cfg.first_bucket_bytes,
            cfg.bucket_bytes,
            cfg.wire,
        );
        let mut ddp = Ddp {
            comm,
            params,
            reducer,
            opt,
            steps: 0,
            in_pass: false,
            local_only: false,
        };
        // Broadcast fails with a typed mismatch if ranks disagree on a size.
        for p in &mut ddp.params {
            comm.broadcast(&mut p.master, 0)?;
        }
        ddp.write_vars(0..ddp.params.len())?;
        Ok(ddp)
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// The bucket layout.
    pub fn bucket_plan(&self) -> &BucketPlan {
        self.reducer.plan()
    }

    /// Optimizer steps this `Ddp` has taken (applied or skipped).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Every parameter's name and master weights, in registration order.
    pub fn weights(&self) -> Vec<(String, Vec<f32>)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.master.clone()))
            .collect()
    }

    fn write_vars(&self, which: impl IntoIterator<Item = usize>) -> Result<()> {
        for j in which {
            let p = &self.params[j];
            let t = Tensor::from_slice(&p.master, p.shape.as_slice(), p.var.device())?;
            p.var.set(&t)?;
        }
        Ok(())
    }

    /// Starts a backward pass whose gradients come through [`Ddp::grad_ready`]; with
    /// `sync = false` they are only accumulated (`no_sync`).
    pub fn begin_pass(&mut self, sync: bool) {
        self.reducer.begin_pass(sync);
        self.in_pass = true;
        self.local_only = !sync;
    }

    /// Parameter `param`'s gradient of this pass (registration order); its bucket's
    /// all-reduce starts when it is the bucket's last.
    pub fn grad_ready(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        Ok(self.reducer.grad_ready(param, grad)?)
    }

    /// Ends the pass begun by [`Ddp::begin_pass`]; the buckets stay in flight until
    /// [`Ddp::step`]. Errors if a parameter's gradient is missing.
    pub fn end_pass(&mut self) -> Result<()> {
        self.in_pass = false;
        Ok(self.reducer.end_pass()?)
    }

    fn pass(&mut self, loss: &Tensor, sync: bool) -> Result<()> {
        let grads = loss.backward()?;
        self.begin_pass(sync);
        for j in (0..self.params.len()).rev() {
            let p = &self.params[j];
            let g = match grads.get(p.var.as_tensor()) {
                Some(g) => g
                    .to_dtype(DType::F32)
                    .and_then(|g| g.flatten_all())
                    .and_then(|g| g.to_vec1::<f32>())?,
                // A parameter the loss does not depend on has a zero gradient.
                None => vec![0.0; p.master.len()],
            };
            self.reducer.grad_ready(j, &g)?;
        }
        self.end_pass()
    }

    /// Backward from `loss` and the all-reduce of the gradients (added to any
    /// accumulated by [`Ddp::backward_no_sync`]), in the background: the buckets are
    /// launched last parameter first. Call [`Ddp::step`] next.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.pass(loss, true)
    }

    /// Backward from `loss` with the gradients only added into the buckets, nothing
    /// communicated (PyTorch's `no_sync()`): for all but the last micro-batch of a
    /// gradient-accumulation step. Scale each micro-batch's loss by 1 / micro-batches.
    pub fn backward_no_sync(&mut self, loss: &Tensor) -> Result<()> {
        self.pass(loss, false)
    }

    fn check_finite(&self, b: usize) -> Result<()> {
        if all_finite(self.reducer.bucket(b)) {
            return Ok(());
        }
        let names: Vec<&str> = self.reducer.plan().buckets[b]
            .params
            .iter()
            .map(|&j| self.params[j].name.as_str())
            .collect();
        Err(TrainError::Diverged {
            step: self.steps,
            why: format!(
                "the averaged gradients of {} hold inf or NaN",
                names.join(", ")
            ),
        }
        .into())
    }

    fn apply_bucket(&mut self, b: usize, lr: f32, grad_scale: f32) -> Result<()> {
        let which = self.reducer.plan().buckets[b].params.clone();
        for &j in &which {
            let g = self.reducer.grad(j);
            self.opt
                .update(j, &mut self.params[j].master, g, lr, grad_scale);
        }
        self.write_vars(which)
    }

    fn finish_step(&mut self, waited: Duration, applied: bool) -> StepReport {
        let report = StepReport {
            applied,
            exposed: waited,
            buckets: self.reducer.plan().buckets.len(),
            bytes: self.reducer.launched_bytes(),
        };
        self.reducer.zero();
        self.steps += 1;
        report
    }

    fn ready_to_step(&self) -> Result<()> {
        if self.in_pass {
            return Err(Error::invalid(
                "step during a backward pass: call end_pass first",
            ));
        }
        if self.local_only {
            return Err(Error::invalid(
                "step after backward_no_sync: the gradients are this rank's alone until a \
                 synchronising backward sends them",
            ));
        }
        Ok(())
    }

    /// The optimizer step at learning rate `lr` with the averaged gradients: each
    /// bucket's parameters are updated as soon as that bucket's all-reduce is done.
    /// Gradients holding inf or NaN are [`TrainError::Diverged`] on every rank alike (the
    /// buckets before the one that held them have been stepped; training is over).
    pub fn step(&mut self, lr: f64) -> Result<StepReport> {
        self.ready_to_step()?;
        self.opt.begin_step();
        let mut waited = Duration::ZERO;
        for b in 0..self.reducer.plan().buckets.len() {
            let w = Instant::now();
            let r = self.reducer.wait_bucket(b).map_err(Error::from);
            waited += w.elapsed();
            if let Err(e) = r.and_then(|_| self.check_finite(b)) {
                self.drain();
                return Err(e);
            }
            self.apply_bucket(b, lr as f32, 1.0)?;
        }
        Ok(self.finish_step(waited, true))
    }

    /// The optimizer step for a loss multiplied by `scaler.scale` before backward: waits
    /// for every bucket, and if all averaged gradients are finite applies them divided
    /// by the scale; otherwise skips the step. Either way the scaler learns of it.
    pub fn step_scaled(&mut self, lr: f64, scaler: &mut LossScaler) -> Result<StepReport> {
        self.ready_to_step()?;
        let mut waited = Duration::ZERO;
        let nb = self.reducer.plan().buckets.len();
        for b in 0..nb {
            let w = Instant::now();
            let r = self.reducer.wait_bucket(b);
            waited += w.elapsed();
            if let Err(e) = r {
                self.drain();
                return Err(e.into());
            }
        }
        let finite = (0..nb).all(|b| all_finite(self.reducer.bucket(b)));
        let unscale = 1.0 / scaler.scale;
        let applied = scaler.update(finite) == ScaleAction::Apply;
        if applied {
            self.opt.begin_step();
            for b in 0..nb {
                self.apply_bucket(b, lr as f32, unscale)?;
            }
        }
        Ok(self.finish_step(waited, applied))
    }

    /// After a failed step: waits for what is still in flight, clears the buckets.
    fn drain(&mut self) {
        for b in 0..self.reducer.plan().buckets.len() {
            let _ = self.reducer.wait_bucket(b);
        }
        self.reducer.zero();
    }

    /// A checkpoint of the weights (`param/NAME`), the optimizer state (`KIND/NAME`)
    /// and `state`, your own JSON (step, schedule, sampler position). Rank 0 saves it
    /// (`ferroccl::ddp::CheckpointDir`); the replicas are identical.
    pub fn snapshot(&mut self, state: serde_json::Value) -> Checkpoint {
        let mut tensors = counter_tensors(&mut self.opt);
        let kinds = self.opt.state();
        for (j, p) in self.params.iter().enumerate() {
            tensors.push(CkptTensor {
                name: format!("param/{}", p.name),
                shape: p.shape.clone(),
                data: p.master.clone(),
            });
            for (kind, bufs) in &kinds {
                tensors.push(CkptTensor {
                    name: format!("{kind}/{}", p.name),
                    shape: p.shape.clone(),
                    data: bufs[j].clone(),
                });
            }
        }
        Checkpoint { state, tensors }
    }

    /// Rank 0's checkpoint into every rank. Collective: rank 0 passes what it loaded
    /// (what `CheckpointDir::load_latest` returns: `Ok(None)` is nothing to resume;
    /// `Err` is a failed load), the other ranks pass `Ok(None)` (what they pass is not
    /// read). A checkpoint whose tensors do not fit the model changes nothing and is an
    /// [`TrainError::Checkpoint`]; on the other ranks rank 0's failure is an error too.
    /// Returns the checkpoint's JSON state on every rank (`None`: starting fresh);
    /// afterwards weights and optimizer state are rank 0's everywhere.
    pub fn restore(
        &mut self,
        loaded: TrainResult<Option<(PathBuf, Checkpoint)>>,
    ) -> Result<Option<serde_json::Value>> {
        let mut blob = Vec::new();
        let r = if self.comm.rank() == 0 {
            loaded.map_err(Error::from).and_then(|ck| match ck {
                Some((path, ck)) => {
                    self.load(&ck, &path)?;
                    blob = serde_json::to_vec(&ck.state).map_err(|e| {
                        Error::checkpoint(&path, format!("state does not serialise: {e}"))
                    })?;
                    Ok(())
                }
                None => Ok(()),
            })
        } else {
            Ok(())
        };
        agree(self.comm, r, "to load the checkpoint")?;
        broadcast_bytes(self.comm, &mut blob)?;
        if blob.is_empty() {
            return Ok(None);
        }
        let state = serde_json::from_slice(&blob)
            .map_err(|e| Error::invalid(format!("checkpoint state from rank 0: {e}")))?;
        for p in &mut self.params {
            self.comm.broadcast(&mut p.master, 0)?;
        }
        for (_, bufs) in self.opt.state() {
            for b in bufs.iter_mut() {
                self.comm.broadcast(b, 0)?;
            }
        }
        for (_, c) in self.opt.counters() {
            let mut v = [*c as i64];
            self.comm.broadcast(&mut v, 0)?;
            *c = v[0] as u64;
        }
        self.write_vars(0..self.params.len())?;
        Ok(Some(state))
    }

    /// Loads `ck` into the masters and the optimizer state, checking everything first.
    fn load(&mut self, ck: &Checkpoint, source: &Path) -> Result<()> {
        let kinds: Vec<&'static str> = self.opt.state().iter().map(|(k, _)| *k).collect();
        // Per parameter: its weights, then one buffer per kind of optimizer state.
        let mut found: Vec<(Vec<f32>, Vec<Vec<f32>>)> = Vec::new();
        for p in &self.params {
            let take = |kind: &str| {
                stored(ck, &format!("{kind}/{}", p.name), &p.shape, source).map(<[f32]>::to_vec)
            };
            let weights = take("param")?;
            let state = kinds.iter().map(|k| take(k)).collect::<Result<Vec<_>>>()?;
            found.push((weights, state));
        }
        let counters = self
            .opt
            .counters()
            .iter()
            .map(|(k, _)| read_counter(ck, k, source))
            .collect::<Result<Vec<u64>>>()?;
        for ((_, c), v) in self.opt.counters().into_iter().zip(counters) {
            *c = v;
        }
        let mut states = self.opt.state();
        for (j, (p, (weights, state))) in self.params.iter_mut().zip(found).enumerate() {
            p.master = weights;
            for ((_, bufs), data) in states.iter_mut().zip(state) {
                bufs[j] = data;
            }
        }
        Ok(())
    }
}

/// Broadcasts rank 0's answer to "did it work?"; on other ranks a failure on rank 0
/// becomes an error naming it.
pub(crate) fn agree(comm: &Communicator, r: Result<()>, what: &str) -> Result<()> {
    let mut ok = [u8::from(r.is_ok())];
    comm.broadcast(&mut ok, 0)?;
    match (r, ok[0]) {
        (Err(e), _) => Err(e),
        (Ok(()), 0) => Err(Error::invalid(format!(
            "rank 0 failed {what} (its error says why)"
        ))),
        _ => Ok(()),
    }
}

/// Sends rank 0's bytes to every rank.
pub(crate) fn broadcast_bytes(comm: &Communicator, bytes: &mut Vec<u8>) -> Result<()> {
    let mut len = [bytes.len() as i64];
    comm.broadcast(&mut len, 0)?;
    bytes.resize(len[0] as usize, 0);
    Ok(comm.broadcast(bytes, 0)?)
}

#[cfg(test)]
mod tests {
    use super::{Adam, Optimizer};

    #[test]
    fn adams_first_step_moves_each_weight_by_lr_against_its_gradient() {
        // With bias correction, step 1 is w −= lr × g / (|g| + ε): about lr × sign(g).
        let mut a = Adam::new(0.0);
        a.init(&[3]);
        a.begin_step();
        let mut w = [1.0f32, 1.0, 1.0];
        a.update(0, &mut w, &[0.5, -2.0, 1e-3], 0.1, 1.0);
        for (wi, want) in w.iter().zip([0.9f32, 1.1, 0.9]) {
            assert!((wi - want).abs() < 1e-4, "{w:?}");
        }
        assert_eq!(a.steps(), 1);
    }

    #[test]
    fn adamw_decays_the_weights_apart_from_the_gradient_and_adam_through_it() {
        // A zero gradient: AdamW still shrinks w by lr × wd × w; Adam's L2 decay turns
        // into a gradient of wd × w, normalised to a step of about lr.
        let (mut w1, mut w2) = ([2.0f32], [2.0f32]);
        let mut aw = Adam::adamw(0.5);
        aw.init(&[1]);
        aw.begin_step();
        aw.update(0, &mut w1, &[0.0], 0.1, 1.0);
        assert!((w1[0] - 1.9).abs() < 1e-6, "{w1:?}");
        let mut a = Adam::new(0.5);
        a.init(&[1]);
        a.begin_step();
        a.update(0, &mut w2, &[0.0], 0.1, 1.0);
        assert!((w2[0] - 1.9).abs() < 1e-4, "{w2:?}");
        // The second moment holds (wd × w)² × (1 − β2) for Adam, nothing for AdamW.
        assert!(a.state()[1].1[0][0] > 0.0);
        assert_eq!(aw.state()[1].1[0][0], 0.0);
    }
}
