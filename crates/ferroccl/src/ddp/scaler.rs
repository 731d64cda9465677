//! Dynamic loss scaling for half-precision training.
//!
//! Small gradients underflow in fp16, so the loss is multiplied by a scale before
//! backward and the gradients divided by it before the optimizer step. When a step's
//! gradients contain an inf or a NaN the scale was too large: the step is skipped and
//! the scale halved. After `growth_interval` clean steps in a row the scale doubles.
//!
//! In data-parallel training the check runs on the gradients *after* the all-reduce,
//! which are identical on every rank, so every rank skips the same steps and the
//! replicas never drift apart.

use serde::{Deserialize, Serialize};

/// What to do with this step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleAction {
    /// Finite: unscale and apply them.
    Apply,
    /// Overflowed: skip the optimizer step (the scale has been lowered).
    Skip,
}

/// The loss scaler's state; see the module docs. Serialisable into checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f32,
    /// Clean steps before the scale grows.
    pub growth_interval: u32,
    /// Clean steps since the last overflow or growth.
    pub clean: u32,
    /// Steps skipped so far.
    pub skipped: u64,
    /// The scale never goes below this.
    pub min_scale: f32,
    /// Nor above this.
    pub max_scale: f32,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new(65536.0, 2000)
    }
}

impl LossScaler {
    /// A scaler starting at `scale`, growing after `growth_interval` clean steps.
    pub fn new(scale: f32, growth_interval: u32) -> Self {
        LossScaler {
            scale,
            growth_interval: growth_interval.max(1),
            clean: 0,
            skipped: 0,
            min_scale: 1.0 / 65536.0,
            max_scale: 16_777_216.0,
        }
    }

    /// Records whether this step's gradients were all finite and says what to do.
    pub fn update(&mut self, all_finite: bool) -> ScaleAction {
        if !all_finite {
            self.scale = (self.scale * 0.5).max(self.min_scale);
            self.clean = 0;
            self.skipped += 1;
            return ScaleAction::Skip;
        }
        self.clean += 1;
        if self.clean >= self.growth_interval {
            self.scale = (self.scale * 2.0).min(self.max_scale);
            self.clean = 0;
        }
        ScaleAction::Apply
    }
}

/// True when every value is finite.
pub fn all_finite(v: &[f32]) -> bool {
    // Summing is branch-free and vectorises; any inf or NaN makes the sum non-finite,
    // but so can an overflow of finite values, so confirm with a scan when it is not.
    let s: f32 = v.iter().map(|x| x * 0.0).sum();
    s == 0.0 || v.iter().all(|x| x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_halves_clean_steps_grow() {
        let mut s = LossScaler::new(1024.0, 3);
        assert_eq!(s.update(false), ScaleAction::Skip);
        assert_eq!(s.scale, 512.0);
        assert_eq!(s.update(true), ScaleAction::Apply);
        assert_eq!(s.update(true), ScaleAction::Apply);
        assert_eq!(s.scale, 512.0);
        assert_eq!(s.update(true), ScaleAction::Apply);
        assert_eq!(s.scale, 1024.0);
        // An overflow resets the clean count.
        s.update(true);
        s.update(false);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale, 512.0);
        assert_eq!(s.skipped, 2);
    }

    #[test]
    fn scale_stays_within_bounds() {
        let mut s = LossScaler::new(1.0, 1);
        for _ in 0..100 {
            s.update(false);
        }
        assert_eq!(s.scale, s.min_scale);
        for _ in 0..100 {
            s.update(true);
        }
        assert_eq!(s.scale, s.max_scale);
    }

    #[test]
    fn finiteness_check() {
        assert!(all_finite(&[1.0, -2.0, 3e38, 3e38]));
        assert!(!all_finite(&[1.0, f32::INFINITY]));
        assert!(!all_finite(&[f32::NAN, 1.0]));
        assert!(all_finite(&[]));
    }
}
