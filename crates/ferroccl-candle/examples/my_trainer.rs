//! The book's "DDP in your candle model" program, whole (docs/book/src/training/ddp.md
//! includes it from its first `use` on): what a user pastes into `src/main.rs` of a new
//! crate (with the page's Cargo.toml) and runs under a launcher. `tools/book-crate`
//! builds it as such a crate and runs it on 2 ranks.
//!
//! ```sh
//! ferroccl launch -n 2 -- cargo run --release -p ferroccl-candle --example my_trainer
//! ```

// ANCHOR: program
use ferroccl_candle::candle_core::{self, DType, Device, Module, Tensor, D};
use ferroccl_candle::candle_nn::{linear, loss, Linear, VarBuilder, VarMap};
use ferroccl_candle::data::Dataset;
use ferroccl_candle::ddp::{Ddp, DdpConfig, Decay, DistributedSampler, LrSchedule, Sgd};
use ferroccl_candle::error::Result; // candle's and ferroccl's errors both convert with `?`
use ferroccl_candle::ferroccl::Communicator;

/// Your model: any candle `Module` built from a `VarMap`.
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.flatten_from(1)?
            .apply(&self.fc1)?
            .relu()?
            .apply(&self.fc2)
    }
}

/// Images `idx` of `d` as an `(n, 784)` tensor and their labels.
fn batch(d: &Dataset, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let s = d.select(idx);
    let x = Tensor::from_vec(s.images, (idx.len(), 784), &Device::Cpu)?;
    let labels: Vec<u32> = s.labels.iter().map(|&l| u32::from(l)).collect();
    Ok((x, Tensor::from_vec(labels, idx.len(), &Device::Cpu)?))
}

fn main() -> Result<()> {
    // Rank, world size and the store's address come from the launcher (ferroccl
    // launch, torchrun, srun, mpirun).
    let comm = Communicator::from_env()?;
    let (world, rank) = (comm.world_size(), comm.rank());
    let (train, test) = Dataset::synthetic(2000, 7).split(0.1, 7);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Mlp {
        fc1: linear(784, 64, vb.pp("fc1"))?,
        fc2: linear(64, 10, vb.pp("fc2"))?,
    };
    let (global_batch, steps, accum) = (64, 40, 2);
    let micro = global_batch / (world * accum);

    // Rank 0's weights reach every rank; the optimizer steps on f32 master weights.
    let mut ddp = Ddp::new(&comm, &varmap, Sgd::new(0.9, 0.0), DdpConfig::default())?;
    let sampler = DistributedSampler::new(train.len(), world, rank, 7)?;
    let lr = LrSchedule {
        base_lr: 0.1,
        base_batch: global_batch,
        global_batch,
        warmup_steps: 5,
        total_steps: steps,
        decay: Decay::Constant,
    };
    let per_epoch = (sampler.batches_per_epoch(micro) / accum) as u64;
    for step in 0..steps {
        let (epoch, b) = (step / per_epoch, (step % per_epoch) as usize);
        for a in 0..accum {
            let (x, y) = batch(&train, &sampler.batch(epoch, b * accum + a, micro))?;
            let loss = (loss::cross_entropy(&model.forward(&x)?, &y)? / accum as f64)?;
            if a + 1 < accum {
                ddp.backward_no_sync(&loss)?; // gradients accumulate, nothing sent
            } else {
                ddp.backward(&loss)?; // buckets all-reduced in the background
            }
        }
        ddp.step(lr.at(step))?; // each bucket's parameters stepped once it is reduced
    }

    // Every replica holds the same weights: so the same test accuracy.
    let all: Vec<usize> = (0..test.len()).collect();
    let (x, y) = batch(&test, &all)?;
    let right = model.forward(&x)?.argmax(D::Minus1)?.eq(&y)?;
    let right = right.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    println!(
        "rank {rank} of {world}: {steps} steps, test accuracy {:.1}%",
        100.0 * right / test.len() as f32
    );
    Ok(())
}
// ANCHOR_END: program
