//! Tensor parallel: a 2-block MLP on digits (784 → 256 → 128 → 64 → 10, tanh), its
//! layers in Megatron pairs — column-parallel, tanh, row-parallel — split over T
//! ranks, trained from the same initial weights on the same batches as one process
//! running the whole model in plain candle. Ranks are threads of this process. It
//! fails unless T = 2 and T = 4 end on the one-process weights (1e-5 relative) and
//! every rank holds the same whole weights when the shards are put back together.
//!
//! ```sh
//! cargo run --release -p ferroccl-candle --example tensor_parallel
//! ```

use candle_core::{Device, Module, Tensor, Var};
use ferroccl::{Communicator, Config, Error, Result};
use ferroccl_candle::data::{Dataset, PIXELS};
use ferroccl_candle::ddp::{Rng, Sgd};
use ferroccl_candle::pipeline::Layout;
use ferroccl_candle::tensor_parallel::{gather_whole, Mesh, TpMlp};
use ferroccl_candle::zero::Zero;
use std::process::ExitCode;

const WIDTHS: [usize; 5] = [PIXELS, 256, 128, 64, 10];
const BATCH: usize = 64;
const STEPS: usize = 30;
const LR: f64 = 0.05;

type Weights = Vec<(String, Vec<f32>)>;

fn ce(e: candle_core::Error) -> Error {
    ferroccl_candle::error::Error::from(e).into()
}

/// Layer i's whole weight and bias (uniform in ±1/√fan-in from seed i).
fn whole_layer(i: usize) -> Result<(Tensor, Tensor)> {
    let (fan_in, fan_out) = (WIDTHS[i], WIDTHS[i + 1]);
    let mut rng = Rng::derive(7, i as u64);
    let bound = 1.0 / (fan_in as f32).sqrt();
    let mut draw = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
            .collect()
    };
    let w =
        Tensor::from_vec(draw(fan_out * fan_in), (fan_out, fan_in), &Device::Cpu).map_err(ce)?;
    let b = Tensor::from_vec(draw(fan_out), fan_out, &Device::Cpu).map_err(ce)?;
    Ok((w, b))
}

/// Step `step`'s batch (the data in order, wrapping round).
fn batch(data: &Dataset, step: usize) -> Result<(Tensor, Tensor)> {
    let idx: Vec<usize> = (0..BATCH)
        .map(|r| (step * BATCH + r) % data.len())
        .collect();
    let d = data.select(&idx);
    let x = Tensor::from_vec(d.images, (BATCH, PIXELS), &Device::Cpu).map_err(ce)?;
    let y: Vec<u32> = d.labels.iter().map(|&l| l as u32).collect();
    Ok((x, Tensor::from_vec(y, BATCH, &Device::Cpu).map_err(ce)?))
}

/// The reference: the whole model in plain candle, one process.
fn one_process(data: &Dataset) -> Result<Weights> {
    let mut vars = Vec::new();
    for i in 0..WIDTHS.len() - 1 {
        let (w, b) = whole_layer(i)?;
        vars.push((format!("l{i}.weight"), Var::from_tensor(&w).map_err(ce)?));
        vars.push((format!("l{i}.bias"), Var::from_tensor(&b).map_err(ce)?));
    }
    let t: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
    let mut z = Zero::new(None, vars, Sgd::new(0.9, 0.0), false)?;
    for step in 0..STEPS {
        let (x, y) = batch(data, step)?;
        let mut h = x;
        for i in 0..WIDTHS.len() - 1 {
            h = h
                .matmul(&t[2 * i].t().map_err(ce)?)
                .and_then(|h| h.broadcast_add(&t[2 * i + 1]))
                .map_err(ce)?;
            if i + 2 < WIDTHS.len() {
                h = h.tanh().map_err(ce)?;
            }
        }
        z.backward(&candle_nn::loss::cross_entropy(&h, &y).map_err(ce)?)?;
        z.step(LR)?;
    }
    Ok(z.weights())
}

/// One rank of T: what the book shows (docs/book/src/training/tensor-parallel.md). Returns the whole model's weights.
fn tensor_rank(comm: &Communicator, data: &Dataset) -> Result<Weights> {
    let (l0, l1, l2, l3) = (
        whole_layer(0)?,
        whole_layer(1)?,
        whole_layer(2)?,
        whole_layer(3)?,
    );
    // ANCHOR: book
    // T tensor-parallel ranks, no pipeline, no replicas: the mesh 1 × T × 1.
    let t = comm.world_size();
    let layout = Layout::mesh(comm, Mesh::for_world(t, 1, t)?)?;
    // Every rank passes the whole layers (drawn from one seed) and keeps its shard: rows
    // of the column-parallel layer (l0, l2), columns of the row-parallel one (l1, l3).
    let block = |up: &(Tensor, Tensor), down: &(Tensor, Tensor)| {
        TpMlp::from_whole(
            &layout.tensor,
            (&up.0, Some(&up.1)),
            Tensor::tanh,
            (&down.0, Some(&down.1)),
        )
    };
    let (b0, b1) = (block(&l0, &l1)?, block(&l2, &l3)?);
    let mut shards = b0.shards("l0", "l1");
    shards.extend(b1.shards("l2", "l3"));
    let vars = shards.iter().map(|s| (s.name.clone(), s.var.clone()));
    let mut params = Zero::new(None, vars.collect(), Sgd::new(0.9, 0.0), false)?;
    for step in 0..STEPS {
        let (x, y) = batch(data, step)?;
        // Each block: one all-reduce forward (g), one backward (f, in candle's backward).
        let h = b0.forward(&x).and_then(|h| h.tanh()).map_err(ce)?;
        let logits = b1.forward(&h).map_err(ce)?;
        params.backward(&candle_nn::loss::cross_entropy(&logits, &y).map_err(ce)?)?;
        params.step(LR)?;
    }
    // The shards put back together: the one-process model's weights, on every rank.
    let whole = gather_whole(&layout.tensor, &shards)?;
    // ANCHOR_END: book
    Ok(whole)
}

fn rel_diff(a: &Weights, b: &Weights) -> f32 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            d / y.iter().map(|q| q.abs()).fold(1e-6, f32::max)
        })
        .fold(0.0, f32::max)
}

fn run() -> Result<bool> {
    let data = Dataset::synthetic(2048, 7);
    let want = one_process(&data)?;
    let mut ok = true;
    for t in [2usize, 4] {
        let comms = Communicator::local_group(t, &Config::default())?;
        let out: Vec<Result<Weights>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let data = &data;
                    s.spawn(move || tensor_rank(&c, data))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::InvalidArgument("a rank panicked".into())))
                })
                .collect()
        });
        let out: Vec<Weights> = out.into_iter().collect::<Result<_>>()?;
        let same = out.iter().all(|w| *w == out[0]);
        let d = rel_diff(&out[0], &want);
        println!(
            "T = {t}: largest relative difference from 1 process after {STEPS} steps {d:.1e}; \
             every rank holds the same whole weights: {same}"
        );
        ok &= same && d <= 1e-5;
    }
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("tensor_parallel: the runs disagree (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("tensor_parallel: {e}");
            ExitCode::FAILURE
        }
    }
}
