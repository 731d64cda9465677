//! Data-parallel training without a framework: a two-layer MLP with hand-written
//! backward, trained on 1 rank with batch 64 and on 4 ranks with batch 16 each, through
//! `ferroccl::ddp` — a sharded sampler, gradient buckets all-reduced in the background
//! while backward goes on, linear LR scaling with warmup. The 4-rank replicas end bitwise
//! equal, and equal to the 1-rank run up to floating-point rounding.
//!
//! ```sh
//! cargo run -p ferroccl --release --example ddp_buckets
//! ```

use ferroccl::ddp::{Decay, DistributedSampler, GradReducer, LrSchedule, Rng, WireDtype};
use ferroccl::{Communicator, Config};

const IN: usize = 16;
const HIDDEN: usize = 64;
const SAMPLES: usize = 4096;
const GLOBAL_BATCH: usize = 64;
const EPOCHS: u64 = 3;

/// The model: h = relu(x·W1 + b1), y = h·W2 + b2. Parameters in forward order.
#[derive(Clone)]
struct Mlp {
    params: Vec<Vec<f32>>, // W1 (IN×HIDDEN), b1 (HIDDEN), W2 (HIDDEN), b2 (1)
}

impl Mlp {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut init = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
                .collect()
        };
        Mlp {
            params: vec![
                init(IN * HIDDEN, 0.25),
                vec![0.0; HIDDEN],
                init(HIDDEN, 0.125),
                vec![0.0],
            ],
        }
    }

    fn lens(&self) -> Vec<usize> {
        self.params.iter().map(Vec::len).collect()
    }

    /// Mean squared error over `batch`; hands each gradient to `ready(param, grad)` as
    /// backward produces it — the last layer's first, as in any autograd.
    fn forward_backward(
        &self,
        x: &[[f32; IN]],
        y: &[f32],
        batch: &[usize],
        mut ready: impl FnMut(usize, &[f32]) -> ferroccl::Result<()>,
    ) -> ferroccl::Result<f32> {
        let (w1, b1, w2, b2) = (
            &self.params[0],
            &self.params[1],
            &self.params[2],
            self.params[3][0],
        );
        let b = batch.len() as f32;
        let mut h = vec![[0f32; HIDDEN]; batch.len()];
        let mut err = vec![0f32; batch.len()];
        let mut loss = 0.0;
        for (k, &i) in batch.iter().enumerate() {
            for j in 0..HIDDEN {
                let z: f32 = b1[j] + (0..IN).map(|f| x[i][f] * w1[f * HIDDEN + j]).sum::<f32>();
                h[k][j] = z.max(0.0);
            }
            let out = b2 + (0..HIDDEN).map(|j| h[k][j] * w2[j]).sum::<f32>();
            err[k] = out - y[i];
            loss += err[k] * err[k] / b;
        }
        // Backward, last layer first: dL/dout = 2·err/B.
        let d: Vec<f32> = err.iter().map(|e| 2.0 * e / b).collect();
        ready(3, &[d.iter().sum()])?;
        let gw2: Vec<f32> = (0..HIDDEN)
            .map(|j| (0..batch.len()).map(|k| h[k][j] * d[k]).sum())
            .collect();
        ready(2, &gw2)?;
        // dL/dh through the ReLU.
        let dh: Vec<[f32; HIDDEN]> = (0..batch.len())
            .map(|k| std::array::from_fn(|j| if h[k][j] > 0.0 { d[k] * w2[j] } else { 0.0 }))
            .collect();
        let gb1: Vec<f32> = (0..HIDDEN).map(|j| dh.iter().map(|r| r[j]).sum()).collect();
        ready(1, &gb1)?;
        let mut gw1 = vec![0f32; IN * HIDDEN];
        for (k, &i) in batch.iter().enumerate() {
            for f in 0..IN {
                for j in 0..HIDDEN {
                    gw1[f * HIDDEN + j] += x[i][f] * dh[k][j];
                }
            }
        }
        ready(0, &gw1)?;
        Ok(loss)
    }
}

/// A synthetic regression task, the same on every rank.
fn data() -> (Vec<[f32; IN]>, Vec<f32>) {
    let mut rng = Rng::new(7);
    let x: Vec<[f32; IN]> = (0..SAMPLES)
        .map(|_| std::array::from_fn(|_| rng.next_f32() * 2.0 - 1.0))
        .collect();
    let y = x
        .iter()
        .map(|r| (r[0] * 3.0).sin() + r[1] * r[2] - 0.5 * r[3])
        .collect();
    (x, y)
}

/// Trains on `comm`'s rank; returns the parameters and the loss per epoch.
fn train(comm: &Communicator) -> ferroccl::Result<(Mlp, Vec<f32>)> {
    let (x, y) = data();
    let (n, r) = (comm.world_size(), comm.rank());
    let per_rank = GLOBAL_BATCH / n;
    let sampler = DistributedSampler::new(SAMPLES, n, r, 42)?;
    let steps_per_epoch = sampler.batches_per_epoch(per_rank) as u64;
    let lr = LrSchedule {
        base_lr: 0.02,
        base_batch: 32,
        global_batch: GLOBAL_BATCH,
        warmup_steps: 20,
        total_steps: steps_per_epoch * EPOCHS,
        decay: Decay::Cosine,
    };
    let mut model = Mlp::new(1);
    // Small bucket caps, so that this small model still has several buckets: the first
    // (the last layers' gradients) is all-reduced while W1's gradient is computed.
    let mut reducer = GradReducer::new(comm, &model.lens(), 256, 2048, WireDtype::F32);
    let mut losses = Vec::new();
    let mut step = 0u64;
    for epoch in 0..EPOCHS {
        let mut sum = 0.0;
        for i in 0..steps_per_epoch as usize {
            let batch = sampler.batch(epoch, i, per_rank);
            reducer.begin_pass(true);
            sum += model.forward_backward(&x, &y, &batch, |p, g| reducer.grad_ready(p, g))?;
            reducer.finish_pass()?; // waits for the buckets still in flight
            let rate = lr.at(step) as f32;
            for (p, w) in model.params.iter_mut().enumerate() {
                for (wi, gi) in w.iter_mut().zip(reducer.grad(p)) {
                    *wi -= rate * gi;
                }
            }
            reducer.zero();
            step += 1;
        }
        // Each rank saw its share of every batch: average the ranks' losses.
        let mut mean = [sum / steps_per_epoch as f32];
        comm.all_reduce(&mut mean, ferroccl::ReduceOp::Avg)?;
        losses.push(mean[0]);
    }
    if r == 0 {
        println!(
            "{n} rank(s) x batch {per_rank}: {} buckets of {:?} parameters, {steps_per_epoch} steps/epoch",
            reducer.plan().buckets.len(),
            reducer.plan().buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>()
        );
    }
    Ok((model, losses))
}

fn run(n: usize) -> ferroccl::Result<Vec<(Mlp, Vec<f32>)>> {
    let comms = Communicator::local_group(n, &Config::default())?;
    std::thread::scope(|t| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| t.spawn(move || train(&c)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

fn main() -> ferroccl::Result<()> {
    let one = run(1)?;
    let four = run(4)?;
    let (m1, l1) = &one[0];
    let (m4, l4) = &four[0];
    println!("loss per epoch, 1 rank : {l1:?}");
    println!("loss per epoch, 4 ranks: {l4:?}");
    for (r, (m, _)) in four.iter().enumerate() {
        let same = m
            .params
            .iter()
            .zip(&m4.params)
            .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(same, "rank {r}'s replica differs from rank 0's");
    }
    let (mut diff, mut scale) = (0f32, 0f32);
    for (a, b) in m1.params.iter().flatten().zip(m4.params.iter().flatten()) {
        diff = diff.max((a - b).abs());
        scale = scale.max(a.abs());
    }
    println!(
        "4 replicas bitwise equal; max |1 rank - 4 ranks| = {diff:.2e} (weights up to {scale:.2})"
    );
    assert!(
        diff <= 1e-3 * scale.max(1.0),
        "4 ranks x 16 drifted from 1 rank x 64"
    );
    assert!(l4.last() < l4.first(), "the model did not learn");
    Ok(())
}
