//! A rank's training data, step by step: its share of each global batch in the
//! sampler's order for the step's epoch, cut into micro-batches (one per accumulation
//! pass), augmented from a generator keyed by (seed, rank, step), so that a resumed run
//! draws what one that never stopped would have.

use crate::data::{Dataset, PIXELS, SIDE};
use crate::error::{Error, Result};
use ferroccl::ddp::{DistributedSampler, Rng};

/// This rank's share of the data-parallel split: `world` replicas, this one `rank`,
/// each step `accum` passes of `micro` images.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Share {
    pub(crate) world: usize,
    pub(crate) rank: usize,
    pub(crate) micro: usize,
    pub(crate) accum: usize,
}

/// The micro-batches of one rank; see the module docs.
pub(crate) struct Batches {
    train: Dataset,
    sampler: DistributedSampler,
    share: Share,
    steps_per_epoch: u64,
    augment: bool,
    /// The augmentation generator's key for this rank (the step is the other half).
    key: u64,
    /// The epoch whose order is held, and the order.
    order: Option<(u64, Vec<usize>)>,
    aug: Rng,
    /// One micro-batch, refilled in place every pass (augmentation edits it in place).
    mb: Dataset,
}

impl Batches {
    /// `train` sampled for `share` from `seed`; `augment` translates every image by up
    /// to ±2 pixels. Refuses data too small for one global batch.
    pub(crate) fn new(train: Dataset, share: Share, seed: u64, augment: bool) -> Result<Self> {
        let sampler = DistributedSampler::new(train.len(), share.world, share.rank, seed)?;
        let steps_per_epoch = (sampler.per_rank() / (share.micro * share.accum)) as u64;
        if steps_per_epoch == 0 {
            return Err(Error::invalid(format!(
                "{} training images cannot make one global batch of {} over {} replica(s)",
                train.len(),
                share.micro * share.accum * share.world,
                share.world
            )));
        }
        Ok(Batches {
            mb: Dataset {
                images: Vec::with_capacity(share.micro * PIXELS),
                labels: Vec::with_capacity(share.micro),
            },
            train,
            sampler,
            share,
            steps_per_epoch,
            augment,
            key: seed ^ (share.rank as u64).wrapping_mul(0x9e37),
            order: None,
            aug: Rng::derive(0, 0),
        })
    }

    /// Optimizer steps in an epoch.
    pub(crate) fn steps_per_epoch(&self) -> u64 {
        self.steps_per_epoch
    }

    /// Images per pass.
    pub(crate) fn micro(&self) -> usize {
        self.share.micro
    }

    /// Pass `a` of optimizer step `step` (passes in order, from 0): its micro-batch,
    /// augmented.
    pub(crate) fn pass(&mut self, step: u64, a: usize) -> &Dataset {
        let (micro, accum) = (self.share.micro, self.share.accum);
        let epoch = step / self.steps_per_epoch;
        let order = match self.order.take() {
            Some((e, o)) if e == epoch => o,
            _ => self.sampler.indices(epoch),
        };
        if a == 0 {
            self.aug = Rng::derive(self.key, step);
        }
        let first = ((step % self.steps_per_epoch) as usize * accum + a) * micro;
        self.train
            .select_into(&order[first..first + micro], &mut self.mb);
        self.order = Some((epoch, order));
        if self.augment {
            augment(&mut self.mb.images, &mut self.aug);
        }
        &self.mb
    }
}

/// Translates each image by up to ±2 pixels (zero fill), drawing from `rng`.
pub(crate) fn augment(pixels: &mut [f32], rng: &mut Rng) {
    let mut out = [0.0f32; PIXELS];
    for img in pixels.chunks_exact_mut(PIXELS) {
        let (sy, sx) = (rng.below(5) as i64 - 2, rng.below(5) as i64 - 2);
        for y in 0..SIDE as i64 {
            for x in 0..SIDE as i64 {
                let (ty, tx) = (y - sy, x - sx);
                out[(y * SIDE as i64 + x) as usize] =
                    if (0..SIDE as i64).contains(&ty) && (0..SIDE as i64).contains(&tx) {
                        img[(ty * SIDE as i64 + tx) as usize]
                    } else {
                        0.0
                    };
            }
        }
        img.copy_from_slice(&out);
    }
}
