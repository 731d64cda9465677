//! Which samples each rank trains on, epoch by epoch.
//!
//! Every epoch the dataset's indices are shuffled with a generator seeded by
//! `(seed, epoch)` — the same permutation on every rank, a different one each epoch —
//! and dealt round-robin: rank `r` of `n` takes positions `r, r + n, r + 2n, ...`.
//!
//! **Tail policy: drop.** When the dataset's length is not a multiple of the world
//! size, the last `len % n` positions of the permutation are left out of that epoch, so
//! every rank gets exactly `len / n` samples and no sample appears twice within an
//! epoch (padding, PyTorch's default, would repeat samples and weight them twice). Since
//! the permutation changes every epoch, a different handful is dropped each time, and
//! over epochs every sample is used.
//!
//! Dealing round-robin means a global batch of `B` taken as `B / n` per rank is exactly
//! the first `B` positions of the permutation, which is what a single rank with batch
//! `B` takes: n ranks then reproduce one rank step for step.

use super::rng::Rng;
use crate::error::{Error, Result};

/// Stream id of the sampler's shuffles within the run's seed.
const STREAM: u64 = 0x5a4d_504c_4552;

/// One rank's view of a dataset; see the module docs.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    seed: u64,
    shuffle: bool,
}

impl DistributedSampler {
    /// The sampler of `rank` out of `world` over a dataset of `len` samples. Errors if
    /// the rank is out of range or the dataset has fewer samples than ranks.
    pub fn new(len: usize, world: usize, rank: usize, seed: u64) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "sampler: rank {rank} is not a rank of {world}"
            )));
        }
        if len < world {
            return Err(Error::InvalidArgument(format!(
                "sampler: {len} samples cannot be shared by {world} ranks (each needs one at least)"
            )));
        }
        Ok(DistributedSampler {
            len,
            world,
            rank,
            seed,
            shuffle: true,
        })
    }

    /// Keeps the dataset's order instead of shuffling (evaluation).
    pub fn without_shuffle(mut self) -> Self {
        self.shuffle = false;
        self
    }

    /// Samples each rank gets per epoch: `len / world` (the tail is dropped).
    pub fn per_rank(&self) -> usize {
        self.len / self.world
    }

    /// Whole batches of `per_rank_batch` per epoch (an incomplete last batch is
    /// dropped, so every rank takes the same number of steps).
    pub fn batches_per_epoch(&self, per_rank_batch: usize) -> usize {
        self.per_rank() / per_rank_batch.max(1)
    }

    /// The epoch's permutation of the whole dataset, the same on every rank.
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            Rng::derive(self.seed ^ STREAM, epoch).shuffle(&mut p);
        }
        p
    }

    /// This rank's sample indices for `epoch`, in the order it takes them.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let p = self.permutation(epoch);
        (0..self.per_rank())
            .map(|i| p[i * self.world + self.rank])
            .collect()
    }

    /// This rank's `batch`-th batch of `per_rank_batch` samples in `epoch`.
    pub fn batch(&self, epoch: u64, batch: usize, per_rank_batch: usize) -> Vec<usize> {
        let idx = self.indices(epoch);
        let start = (batch * per_rank_batch).min(idx.len());
        let end = (start + per_rank_batch).min(idx.len());
        idx[start..end].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        #[test]
        fn ranks_get_equal_disjoint_slices(len in 1usize..500, world in 1usize..9, seed: u64, epoch in 0u64..4) {
            prop_assume!(len >= world);
            let all: Vec<Vec<usize>> = (0..world)
                .map(|r| DistributedSampler::new(len, world, r, seed).unwrap().indices(epoch))
                .collect();
            let mut seen = HashSet::new();
            for v in &all {
                prop_assert_eq!(v.len(), len / world);
                for &i in v {
                    prop_assert!(i < len);
                    prop_assert!(seen.insert(i), "sample {} on two ranks", i);
                }
            }
            prop_assert_eq!(seen.len(), len / world * world);
            if len % world == 0 {
                prop_assert_eq!(seen.len(), len);
            }
        }

        #[test]
        fn global_batch_is_the_single_rank_batch(len in 16usize..300, world in 1usize..5, b in 1usize..4, seed: u64) {
            let per_rank = b;
            let global = per_rank * world;
            prop_assume!(len >= global);
            let one = DistributedSampler::new(len, 1, 0, seed).unwrap().batch(0, 0, global);
            let mut union: Vec<usize> = (0..world)
                .flat_map(|r| DistributedSampler::new(len, world, r, seed).unwrap().batch(0, 0, per_rank))
                .collect();
            let mut one_sorted = one.clone();
            union.sort_unstable();
            one_sorted.sort_unstable();
            prop_assert_eq!(union, one_sorted);
        }
    }

    #[test]
    fn epochs_shuffle_differently_and_reproducibly() {
        let s = DistributedSampler::new(1000, 2, 1, 42).unwrap();
        assert_eq!(s.indices(3), s.indices(3));
        assert_ne!(s.indices(3), s.indices(4));
        let t = DistributedSampler::new(1000, 2, 1, 43).unwrap();
        assert_ne!(s.indices(3), t.indices(3));
        let u = s.clone().without_shuffle();
        assert_eq!(u.indices(0)[..3], [1, 3, 5]);
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(DistributedSampler::new(10, 2, 2, 0).is_err());
        assert!(DistributedSampler::new(10, 0, 0, 0).is_err());
        assert!(DistributedSampler::new(3, 4, 0, 0).is_err());
    }
}
