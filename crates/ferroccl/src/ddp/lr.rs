//! The learning rate over a run: linear scaling with the global batch, linear warmup,
//! then constant or cosine decay.
//!
//! Linear scaling (Goyal et al., "Accurate, Large Minibatch SGD", 2017): a learning
//! rate `base_lr` tuned for a batch of `base_batch` becomes
//! `peak = base_lr · global_batch / base_batch` for a global batch of `global_batch`.
//! Jumping straight to a large `peak` diverges early in training, so the first
//! `warmup_steps` ramp linearly from `base_lr` to `peak`.

use serde::{Deserialize, Serialize};

/// What happens after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Decay {
    /// Stay at the peak.
    #[default]
    Constant,
    /// Half a cosine from the peak down to zero at `total_steps`.
    Cosine,
}

/// A learning-rate schedule; see the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The rate tuned for `base_batch`.
    pub base_lr: f64,
    /// The batch `base_lr` was tuned for.
    pub base_batch: usize,
    /// Samples per optimizer step over all ranks (and accumulation steps).
    pub global_batch: usize,
    /// Steps of linear warmup from `base_lr` to the peak.
    pub warmup_steps: u64,
    /// Length of the run in optimizer steps (for cosine decay).
    pub total_steps: u64,
    /// After warmup.
    pub decay: Decay,
}

impl LrSchedule {
    /// The scaled rate reached at the end of warmup.
    pub fn peak(&self) -> f64 {
        self.base_lr * self.global_batch as f64 / self.base_batch.max(1) as f64
    }

    /// The rate for optimizer step `step` (counted from 0).
    pub fn at(&self, step: u64) -> f64 {
        let peak = self.peak();
        if step < self.warmup_steps {
            let f = (step + 1) as f64 / self.warmup_steps as f64;
            return self.base_lr + (peak - self.base_lr) * f;
        }
        match self.decay {
            Decay::Constant => peak,
            Decay::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let t = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
                0.5 * peak * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(global: usize, warmup: u64, decay: Decay) -> LrSchedule {
        LrSchedule {
            base_lr: 0.1,
            base_batch: 64,
            global_batch: global,
            warmup_steps: warmup,
            total_steps: 100,
            decay,
        }
    }

    #[test]
    fn peak_scales_linearly_with_the_global_batch() {
        assert!((sched(64, 0, Decay::Constant).peak() - 0.1).abs() < 1e-12);
        assert!((sched(256, 0, Decay::Constant).peak() - 0.4).abs() < 1e-12);
        assert!((sched(256, 0, Decay::Constant).at(50) - 0.4).abs() < 1e-12);
    }

    #[test]
    fn warmup_ramps_from_base_to_peak() {
        let s = sched(256, 10, Decay::Constant);
        let lrs: Vec<f64> = (0..12).map(|t| s.at(t)).collect();
        assert!(lrs[0] > 0.1 && lrs[0] < 0.14, "{lrs:?}");
        assert!(lrs.windows(2).take(9).all(|w| w[1] > w[0]), "{lrs:?}");
        assert!((lrs[9] - 0.4).abs() < 1e-12);
        assert!((lrs[11] - 0.4).abs() < 1e-12);
    }

    #[test]
    fn cosine_decays_to_zero() {
        let s = sched(64, 10, Decay::Cosine);
        assert!((s.at(10) - 0.1).abs() < 1e-12);
        assert!((s.at(55) - 0.05).abs() < 1e-9);
        assert!(s.at(100).abs() < 1e-12);
        assert!(s.at(1000).abs() < 1e-12);
    }
}
