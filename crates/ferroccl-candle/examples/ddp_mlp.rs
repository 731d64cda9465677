//! DDP for a model nobody tuned for it: a user-defined MLP in plain candle, trained
//! with `ferroccl_candle::ddp::Ddp` on 1, 2 and 4 ranks (threads of this process) from
//! the same initial weights, then checked: each run's replicas are bitwise equal, and
//! n ranks × B/n samples end within floating-point tolerance of 1 rank × B after K
//! steps, with the same test accuracy within one point; 2 ranks with two
//! micro-batches through `no_sync` do too.
//!
//! ```sh
//! cargo run --release -p ferroccl-candle --example ddp_mlp
//! cargo run --release -p ferroccl-candle --example ddp_mlp -- --data data/mnist_5k.csv.gz --steps 100
//! ```

mod common;

use candle_core::{Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use std::process::ExitCode;

/// 784 → 128 → 64 → 10 with ReLUs.
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            fc1: linear(784, 128, vb.pp("fc1"))?,
            fc2: linear(128, 64, vb.pp("fc2"))?,
            fc3: linear(64, 10, vb.pp("fc3"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.flatten_from(1)?
            .apply(&self.fc1)?
            .relu()?
            .apply(&self.fc2)?
            .relu()?
            .apply(&self.fc3)
    }
}

fn main() -> ExitCode {
    // steps, global batch, peak learning rate
    common::main_for("mlp", (30, 64, 0.1), Mlp::new)
}
