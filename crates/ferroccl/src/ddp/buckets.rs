//! Gradient buckets: parameters grouped so that each group's all-reduce can start as
//! soon as its gradients exist, while backward goes on computing the rest.
//!
//! As in PyTorch DDP, parameters are taken in *reverse* order (backward produces the
//! last layers' gradients first) and packed into buckets of at most `bucket_bytes`,
//! except the first, which is capped at `first_bucket_bytes` so that communication
//! starts early. A parameter larger than the cap gets a bucket of its own.
//!
//! [`GradReducer`] owns one flat f32 buffer per bucket. Each backward pass hands it
//! gradients with [`GradReducer::grad_ready`]; they are *added* into the bucket, so
//! gradient accumulation over several passes is just several passes. In a pass begun
//! with `sync = false` (`no_sync`) nothing is communicated; in a synchronising pass,
//! a bucket's all-reduce starts ([`Communicator::all_reduce_start`]) the moment its
//! last gradient arrives, and [`GradReducer::finish_pass`] waits for them all (or
//! [`GradReducer::end_pass`] ends the pass and [`GradReducer::wait_bucket`] waits for
//! one bucket at a time, so that an optimizer can step a bucket's parameters while
//! the later buckets are still on the wire). Then [`GradReducer::grad`] holds the
//! average over ranks, and [`GradReducer::zero`] clears the buckets for the next step.
//!
//! On the wire the gradients may travel as f16 or bf16 ([`WireDtype`]): each bucket is
//! multiplied by `1/world` *before* the conversion, so the sum of the ranks'
//! contributions is the average and cannot overflow where the average does not; the
//! result is widened back into the f32 bucket (ferroccl's half-precision reduction
//! widens to f32 at every step and rounds once).

use crate::comm::{Communicator, Pending};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use half::{bf16, f16};
use std::ops::Range;
use std::time::{Duration, Instant};

/// PyTorch DDP's default bucket cap.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;
/// PyTorch DDP's default cap of the first bucket.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// The element type gradients travel in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WireDtype {
    /// Full precision.
    #[default]
    F32,
    /// IEEE half: half the bytes, 11 bits of mantissa, range ±65504.
    F16,
    /// bfloat16: half the bytes, f32's range, 8 bits of mantissa.
    Bf16,
}

impl WireDtype {
    /// Parses `f32`, `f16`/`fp16`, `bf16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(WireDtype::F32),
            "f16" | "fp16" => Ok(WireDtype::F16),
            "bf16" => Ok(WireDtype::Bf16),
            _ => Err(Error::InvalidArgument(format!(
                "unknown gradient wire type {s:?}: expected f32, f16 or bf16"
            ))),
        }
    }

    /// Bytes per element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            _ => 2,
        }
    }
}

/// One bucket: which parameters, and where each sits in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices (forward order numbering), in the order they were packed.
    pub params: Vec<usize>,
    /// Element range of each of `params` within the bucket.
    pub ranges: Vec<Range<usize>>,
    /// Elements in the bucket.
    pub len: usize,
}

/// How parameters are grouped into buckets; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// Buckets in the order their all-reduces start (last layers first).
    pub buckets: Vec<Bucket>,
    /// For each parameter: `(bucket, range within it)`.
    pub place: Vec<(usize, Range<usize>)>,
}

impl BucketPlan {
    /// Packs parameters of `param_lens` elements (listed in forward order) into
    /// buckets of at most `bucket_bytes` (`first_bucket_bytes` for the first),
    /// counting `elem_bytes` per element.
    pub fn new(
        param_lens: &[usize],
        first_bucket_bytes: usize,
        bucket_bytes: usize,
        elem_bytes: usize,
    ) -> Self {
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut place = vec![(0, 0..0); param_lens.len()];
        let mut cur = Bucket {
            params: vec![],
            ranges: vec![],
            len: 0,
        };
        for p in (0..param_lens.len()).rev() {
            let n = param_lens[p];
            let cap = if buckets.is_empty() {
                first_bucket_bytes
            } else {
                bucket_bytes
            };
            if !cur.params.is_empty() && (cur.len + n) * elem_bytes > cap {
                buckets.push(std::mem::replace(
                    &mut cur,
                    Bucket {
                        params: vec![],
                        ranges: vec![],
                        len: 0,
                    },
                ));
            }
            let r = cur.len..cur.len + n;
            place[p] = (buckets.len(), r.clone());
            cur.params.push(p);
            cur.ranges.push(r);
            cur.len += n;
        }
        if !cur.params.is_empty() {
            buckets.push(cur);
        }
        BucketPlan { buckets, place }
    }
}

enum InFlight {
    F32(Pending<f32>),
    F16(Pending<f16>),
    Bf16(Pending<bf16>),
}

/// Timings of one synchronising pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassStats {
    /// Time [`GradReducer::finish_pass`] spent waiting for all-reduces: the
    /// communication backward did not hide.
    pub exposed: Duration,
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Bytes this rank put into all-reduces (before the ring's 2(n-1)/n factor).
    pub bytes: usize,
}

/// Gradient buckets of one model replica on one communicator; see the module docs.
pub struct GradReducer<'c> {
    comm: &'c Communicator,
    plan: BucketPlan,
    wire: WireDtype,
    bufs: Vec<Vec<f32>>,
    inflight: Vec<Option<InFlight>>,
    arrived: Vec<bool>,
    missing: Vec<usize>,
    sync: bool,
    launched_bytes: usize,
}

impl<'c> GradReducer<'c> {
    /// Buckets for parameters of `param_lens` elements (forward order).
    pub fn new(
        comm: &'c Communicator,
        param_lens: &[usize],
        first_bucket_bytes: usize,
        bucket_bytes: usize,
        wire: WireDtype,
    ) -> Self {
        let plan = BucketPlan::new(param_lens, first_bucket_bytes, bucket_bytes, wire.bytes());
        let bufs = plan.buckets.iter().map(|b| vec![0.0; b.len]).collect();
        let missing = plan.buckets.iter().map(|b| b.params.len()).collect();
        GradReducer {
            comm,
            inflight: plan.buckets.iter().map(|_| None).collect(),
            arrived: vec![false; param_lens.len()],
            missing,
            plan,
            wire,
            bufs,
            sync: true,
            launched_bytes: 0,
        }
    }

    /// The bucket layout.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Starts a backward pass. With `sync = false` its gradients are only accumulated
    /// (`no_sync`, for all but the last of several accumulation passes).
    pub fn begin_pass(&mut self, sync: bool) {
        self.sync = sync;
        self.arrived.iter_mut().for_each(|a| *a = false);
        for (m, b) in self.missing.iter_mut().zip(&self.plan.buckets) {
            *m = b.params.len();
        }
        self.launched_bytes = 0;
    }

    /// Adds parameter `param`'s gradient of this pass; in a synchronising pass,
    /// starts its bucket's all-reduce if it was the bucket's last.
    pub fn grad_ready(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        let Some((b, r)) = self.plan.place.get(param).cloned() else {
            return Err(Error::InvalidArgument(format!(
                "gradient for parameter {param}, but the model has {}",
                self.plan.place.len()
            )));
        };
        if grad.len() != r.len() {
            return Err(Error::InvalidArgument(format!(
                "gradient of parameter {param} has {} elements, the parameter {}",
                grad.len(),
                r.len()
            )));
        }
        if std::mem::replace(&mut self.arrived[param], true) {
            return Err(Error::InvalidArgument(format!(
                "gradient of parameter {param} given twice in one pass"
            )));
        }
        for (d, s) in self.bufs[b][r].iter_mut().zip(grad) {
            *d += s;
        }
        self.missing[b] -= 1;
        if self.missing[b] == 0 && self.sync {
            self.launch(b)?;
        }
        Ok(())
    }

    fn launch(&mut self, b: usize) -> Result<()> {
        let n = self.comm.world_size();
        let buf = std::mem::take(&mut self.bufs[b]);
        self.launched_bytes += buf.len() * self.wire.bytes();
        let inv = 1.0 / n as f32;
        let f = match self.wire {
            WireDtype::F32 => match self.comm.all_reduce_start(buf, ReduceOp::Avg) {
                Ok(p) => InFlight::F32(p),
                Err(e) => {
                    // The buffer went with the failed call: keep the layout usable.
                    self.bufs[b] = vec![0.0; self.plan.buckets[b].len];
                    return Err(e);
                }
            },
            WireDtype::F16 => {
                let h = buf.iter().map(|x| f16::from_f32(x * inv)).collect();
                self.bufs[b] = buf;
                InFlight::F16(self.comm.all_reduce_start(h, ReduceOp::Sum)?)
            }
            WireDtype::Bf16 => {
                let h = buf.iter().map(|x| bf16::from_f32(x * inv)).collect();
                self.bufs[b] = buf;
                InFlight::Bf16(self.comm.all_reduce_start(h, ReduceOp::Sum)?)
            }
        };
        self.inflight[b] = Some(f);
        Ok(())
    }

    /// Ends the pass. In a synchronising pass, waits for every bucket's all-reduce;
    /// afterwards [`GradReducer::grad`] is the average over ranks. Errors if some
    /// parameter's gradient never arrived (every rank must reduce every bucket, or
    /// the ranks' collectives would no longer line up).
    pub fn finish_pass(&mut self) -> Result<PassStats> {
        self.end_pass()?;
        let t = Instant::now();
        let buckets = self.wait_all()?;
        Ok(PassStats {
            exposed: t.elapsed(),
            buckets,
            bytes: self.launched_bytes,
        })
    }

    /// Ends the pass without waiting: the buckets stay in flight until
    /// [`GradReducer::wait_bucket`] (so the optimizer step of a bucket's parameters can
    /// start as soon as that bucket is reduced). Errors, after waiting for what was
    /// launched, if some parameter's gradient never arrived.
    pub fn end_pass(&mut self) -> Result<()> {
        if let Some(p) = self.arrived.iter().position(|a| !a) {
            // Launched buckets must still be waited for (their buffers are in flight).
            let _ = self.wait_all();
            return Err(Error::InvalidArgument(format!(
                "backward pass ended without a gradient for parameter {p}"
            )));
        }
        Ok(())
    }

    /// Bytes this pass put into all-reduces (before the ring's 2(n-1)/n factor).
    pub fn launched_bytes(&self) -> usize {
        self.launched_bytes
    }

    fn wait_all(&mut self) -> Result<usize> {
        let mut first_err = None;
        let mut count = 0;
        for b in 0..self.inflight.len() {
            match self.wait_bucket(b) {
                Ok(true) => count += 1,
                Ok(false) => {}
                Err(e) => {
                    count += 1;
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(count),
        }
    }

    /// Waits for bucket `b`'s all-reduce, if one is in flight (true then); afterwards
    /// the gradients of its parameters ([`Bucket::params`]) are the average over ranks.
    pub fn wait_bucket(&mut self, b: usize) -> Result<bool> {
        let Some(f) = self.inflight.get_mut(b).and_then(Option::take) else {
            return Ok(false);
        };
        let r = match f {
            InFlight::F32(p) => p.wait().map(|v| self.bufs[b] = v),
            InFlight::F16(p) => p.wait().map(|v| {
                for (d, s) in self.bufs[b].iter_mut().zip(v) {
                    *d = s.to_f32();
                }
            }),
            InFlight::Bf16(p) => p.wait().map(|v| {
                for (d, s) in self.bufs[b].iter_mut().zip(v) {
                    *d = s.to_f32();
                }
            }),
        };
        if r.is_err() && self.bufs[b].len() != self.plan.buckets[b].len {
            // A failed F32 bucket's buffer is gone; its values are lost either way.
            self.bufs[b] = vec![0.0; self.plan.buckets[b].len];
        }
        r.map(|()| true)
    }

    /// Bucket `b`'s gradients (all its parameters, packed), for a finiteness check.
    pub fn bucket(&self, b: usize) -> &[f32] {
        &self.bufs[b]
    }

    /// Parameter `param`'s gradient: after a synchronising pass, the average over
    /// ranks of the sums over accumulation passes.
    pub fn grad(&self, param: usize) -> &[f32] {
        let (b, r) = &self.plan.place[param];
        &self.bufs[*b][r.clone()]
    }

    /// Every bucket's gradients, for a finiteness check.
    pub fn flat(&self) -> impl Iterator<Item = &[f32]> {
        self.bufs.iter().map(|b| b.as_slice())
    }

    /// Clears the buckets for the next optimizer step.
    pub fn zero(&mut self) {
        for b in &mut self.bufs {
            b.iter_mut().for_each(|x| *x = 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_packs_in_reverse_with_a_small_first_bucket() {
        // 4 bytes per element; first cap 40 B = 10 elements, then 100 B = 25.
        let p = BucketPlan::new(&[5, 20, 3, 4, 6], 40, 100, 4);
        let params: Vec<Vec<usize>> = p.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![4, 3], vec![2, 1], vec![0]]);
        assert_eq!(p.buckets[0].len, 10);
        assert_eq!(p.place[3], (0, 6..10));
        assert_eq!(p.place[1], (1, 3..23));
        // Every parameter placed once, ranges tile each bucket.
        for b in &p.buckets {
            let total: usize = b.ranges.iter().map(|r| r.len()).sum();
            assert_eq!(total, b.len);
        }
    }

    #[test]
    fn oversized_parameter_gets_its_own_bucket() {
        let p = BucketPlan::new(&[1, 1000, 1], 16, 16, 4);
        let params: Vec<Vec<usize>> = p.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![2], vec![1], vec![0]]);
    }

    #[test]
    fn wire_names() {
        assert_eq!(WireDtype::parse("fp16").unwrap(), WireDtype::F16);
        assert_eq!(WireDtype::parse("bf16").unwrap().bytes(), 2);
        assert!(WireDtype::parse("f64").is_err());
    }
}
