//! The plans of the last few call shapes, kept for the next call of the same shape.
//!
//! A plan is a pure function of the call's shape (kind, algorithm, element count and
//! size, segment) and of what the engine never changes (its rank, the world size, the
//! host layout). Building one allocates its frame lists: at 1 KiB that was a sixth of
//! a small all-reduce's fixed cost, for the same two frames every call. A training
//! loop repeats a handful of shapes (its buckets, the barrier), so a few entries, most
//! recently used first, catch them.

use crate::algo::{Algorithm, Plan};
use crate::wire::OpKind;

/// Call shapes whose plans are kept: a training step's buckets, a barrier and a
/// loss all-reduce fit.
pub(crate) const PLANS_KEPT: usize = 4;

/// What a plan depends on besides the engine's own constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlanKey {
    pub kind: OpKind,
    pub algo: Algorithm,
    /// Elements, and bytes per element.
    pub count: usize,
    pub es: usize,
    /// The configured segment bytes the plan was cut with.
    pub seg: usize,
}

/// Up to [`PLANS_KEPT`] plans, each with when it was last used. A plan in use is out
/// of the cache (a run that unwinds loses it, and the next call builds it again), and
/// a hit allocates nothing: the entries' room is reserved once.
#[derive(Default)]
pub(crate) struct PlanCache {
    kept: Vec<(PlanKey, Plan, u64)>,
    uses: u64,
}

impl PlanCache {
    /// The plan kept for `key`, taken out (give it back with [`PlanCache::keep`]).
    pub fn take(&mut self, key: &PlanKey) -> Option<Plan> {
        let i = self.kept.iter().position(|(k, _, _)| k == key)?;
        Some(self.kept.swap_remove(i).1)
    }

    /// Keeps `plan` for `key` as the most recently used: in place of a plan kept for
    /// the same key, else in a free slot, else in place of the least recently used.
    pub fn keep(&mut self, key: PlanKey, plan: Plan) {
        self.uses += 1;
        let now = self.uses;
        if let Some(slot) = self.kept.iter_mut().find(|(k, _, _)| *k == key) {
            (slot.1, slot.2) = (plan, now);
        } else if self.kept.len() < PLANS_KEPT {
            if self.kept.capacity() == 0 {
                self.kept.reserve_exact(PLANS_KEPT);
            }
            self.kept.push((key, plan, now));
        } else if let Some(slot) = self.kept.iter_mut().min_by_key(|(_, _, used)| *used) {
            *slot = (key, plan, now);
        }
    }

    /// The kept shapes' counts, the most recently used first.
    #[cfg(test)]
    fn keys(&self) -> Vec<usize> {
        let mut v: Vec<_> = self
            .kept
            .iter()
            .map(|(k, _, used)| (*used, k.count))
            .collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.into_iter().map(|(_, count)| count).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::doubling;

    fn key(count: usize) -> PlanKey {
        PlanKey {
            kind: OpKind::AllReduce,
            algo: Algorithm::RecursiveDoubling,
            count,
            es: 4,
            seg: 1 << 19,
        }
    }

    #[test]
    fn a_kept_plan_comes_back_for_its_key_only_and_the_least_recent_goes_first() {
        let mut c = PlanCache::default();
        assert!(c.take(&key(1)).is_none());
        let plan = |count: usize| doubling::plan(1, 4, count * 4);
        for count in 1..=PLANS_KEPT {
            c.keep(key(count), plan(count));
        }
        assert_eq!(c.keys(), vec![4, 3, 2, 1]);
        // Any other field of the key is another shape.
        for other in [
            PlanKey { es: 2, ..key(1) },
            PlanKey { seg: 1, ..key(1) },
            PlanKey {
                algo: Algorithm::Ring,
                ..key(1)
            },
            PlanKey {
                kind: OpKind::Barrier,
                ..key(1)
            },
        ] {
            assert!(c.take(&other).is_none(), "{other:?}");
        }
        // A hit returns the very plan kept, and becomes the most recent.
        let p = c.take(&key(2)).expect("kept");
        assert_eq!(p, plan(2));
        // Taken, it is out of the cache until it is given back.
        assert!(c.take(&key(2)).is_none());
        assert_eq!(c.keys(), vec![4, 3, 1]);
        c.keep(key(2), p);
        assert_eq!(c.keys(), vec![2, 4, 3, 1]);
        // A fifth shape drops the least recently used (1).
        c.keep(key(5), plan(5));
        assert_eq!(c.keys(), vec![5, 2, 4, 3]);
        assert!(c.take(&key(1)).is_none());
        // Keeping a key twice keeps one entry.
        c.keep(key(5), plan(5));
        assert_eq!(c.keys(), vec![5, 2, 4, 3]);
    }
}
