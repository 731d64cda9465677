//! DDP for a small residual CNN in plain candle (a stem convolution, two residual
//! blocks, global pooling and a linear head), trained with
//! `ferroccl_candle::ddp::Ddp` on 1, 2 and 4 ranks from the same initial weights and
//! checked as `ddp_mlp` is: replicas bitwise equal, n ranks × B/n within
//! floating-point tolerance of 1 rank × B after K steps, accuracy within one point.
//!
//! ```sh
//! cargo run --release -p ferroccl-candle --example ddp_resnet
//! cargo run --release -p ferroccl-candle --example ddp_resnet -- --data data/mnist_5k.csv.gz --steps 100
//! ```

mod common;

use candle_core::{Module, Tensor};
use candle_nn::{conv2d, linear, Conv2d, Conv2dConfig, Linear, VarBuilder};
use std::process::ExitCode;

const CH: usize = 8;

/// x + conv(relu(conv(x))), then relu: the basic residual block (no batch norm,
/// whose running statistics would need their own synchronisation).
struct Block {
    conv1: Conv2d,
    conv2: Conv2d,
}

impl Block {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let same = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(Block {
            conv1: conv2d(CH, CH, 3, same, vb.pp("conv1"))?,
            conv2: conv2d(CH, CH, 3, same, vb.pp("conv2"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.apply(&self.conv1)?.relu()?.apply(&self.conv2)?;
        (x + y)?.relu()
    }
}

/// 1×28×28 → stem (4×4 patches, stride 4) → 8×7×7 → two residual blocks → linear
/// → 10. Layers are named in forward order (`l1_…` to `l4_…`): a
/// `VarMap` forgets the order variables were made in, and `Ddp::new` takes them by
/// name to pack the gradient buckets from the last layer.
struct ResNet {
    stem: Conv2d,
    block1: Block,
    block2: Block,
    head: Linear,
}

impl ResNet {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let patches = Conv2dConfig {
            stride: 4,
            ..Default::default()
        };
        Ok(ResNet {
            stem: conv2d(1, CH, 4, patches, vb.pp("l1_stem"))?,
            block1: Block::new(vb.pp("l2_block"))?,
            block2: Block::new(vb.pp("l3_block"))?,
            head: linear(CH * 7 * 7, 10, vb.pp("l4_head"))?,
        })
    }
}

impl Module for ResNet {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply(&self.stem)?
            .relu()?
            .apply(&self.block1)?
            .apply(&self.block2)?
            .flatten_from(1)?
            .apply(&self.head)
    }
}

fn main() -> ExitCode {
    // steps, global batch, peak learning rate
    common::main_for("resnet", (30, 32, 0.05), ResNet::new)
}
