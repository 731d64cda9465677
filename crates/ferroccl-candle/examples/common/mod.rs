//! What the DDP examples share: the arguments, the data, the training loop of one
//! rank (the code the book's "DDP in your candle model" shows), ranks as threads, and the checks that n ranks of
//! B/n samples reproduce one rank of B.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use ferroccl::{Communicator, Config, Error, Result};
use ferroccl_candle::data::Dataset;
use ferroccl_candle::ddp::{Ddp, DdpConfig, Decay, DistributedSampler, LrSchedule, Rng, Sgd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Parameters by name with their values.
pub type Weights = Vec<(String, Vec<f32>)>;

/// A run's shape: `--data PATH` (mnist_5k's CSV, e.g. `data/mnist_5k.csv.gz` from
/// tools/fetch-mnist; default: the built-in synthetic digits, no download),
/// `--steps K`, `--batch B` (global), `--ranks 1,2,4`, `--lr`.
#[derive(Clone, Debug)]
pub struct Args {
    /// The digits: a CSV file, or `None` for synthetic ones.
    pub data: Option<PathBuf>,
    /// Optimizer steps per run.
    pub steps: u64,
    /// Global batch B: samples per optimizer step over all ranks.
    pub global_batch: usize,
    /// World sizes to train with; the first is the reference.
    pub ranks: Vec<usize>,
    /// Peak learning rate (for the global batch; linear warmup over 5 steps).
    pub lr: f64,
    /// Micro-batches per optimizer step: all but the last go through `no_sync`.
    pub accum: usize,
}

impl Args {
    /// The command line over the defaults `steps`, `global_batch`, `lr`.
    pub fn parse(steps: u64, global_batch: usize, lr: f64) -> Result<Args> {
        let mut a = Args {
            data: None,
            steps,
            global_batch,
            ranks: vec![1, 2, 4],
            lr,
            accum: 1,
        };
        let mut it = std::env::args().skip(1);
        let bad = |what: String| Error::InvalidArgument(what);
        while let Some(flag) = it.next() {
            let v = it
                .next()
                .ok_or_else(|| bad(format!("{flag} needs a value")))?;
            let num = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| bad(format!("{flag} {v:?}: not a count")))
            };
            match flag.as_str() {
                "--data" => a.data = Some(v.into()),
                "--steps" => a.steps = num(&v)?,
                "--batch" => a.global_batch = num(&v)? as usize,
                "--ranks" => {
                    a.ranks = v
                        .split(',')
                        .map(|r| num(r).map(|r| r as usize))
                        .collect::<Result<_>>()?
                }
                "--lr" => {
                    a.lr = v
                        .parse()
                        .map_err(|_| bad(format!("--lr {v:?}: not a number")))?
                }
                _ => return Err(bad(format!("unknown flag {flag}"))),
            }
        }
        Ok(a)
    }
}

/// The training and test digits (a tenth held out, the same split on every rank).
pub fn data(args: &Args) -> Result<(Dataset, Dataset)> {
    let all = match &args.data {
        Some(p) => Dataset::load(p)?,
        None => Dataset::synthetic(2000, 7),
    };
    Ok(all.split(0.1, 7))
}

fn ce(e: candle_core::Error) -> Error {
    let text = e.to_string();
    Error::InvalidArgument(text.lines().next().unwrap_or_default().to_string())
}

/// Images `idx` of `d` as a `(n, 1, 28, 28)` tensor and their labels.
pub fn batch(d: &Dataset, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let s = d.select(idx);
    let x = Tensor::from_vec(s.images, (idx.len(), 1, 28, 28), &Device::Cpu).map_err(ce)?;
    let labels: Vec<u32> = s.labels.iter().map(|&l| u32::from(l)).collect();
    let y = Tensor::from_vec(labels, idx.len(), &Device::Cpu).map_err(ce)?;
    Ok((x, y))
}

/// What one rank ends with.
pub struct RankRun {
    /// The weights after the last step.
    pub weights: Weights,
    /// Loss on the test digits before the first step (this rank's weights before
    /// `Ddp::new`: rank 0's is the run's) and after the last.
    pub first_loss: f64,
    /// See `first_loss`.
    pub last_loss: f64,
    /// Accuracy on the test digits.
    pub accuracy: f64,
}

/// Trains the model `build` makes on this rank's share of the data. With `init`,
/// rank 0 starts from those weights (so that runs with different world sizes can be
/// compared); every rank starts from rank 0's.
pub fn train_rank<M: Module>(
    comm: &Communicator,
    args: &Args,
    (train, test): &(Dataset, Dataset),
    init: Option<&Weights>,
    build: impl FnOnce(VarBuilder) -> candle_core::Result<M>,
) -> Result<RankRun> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let varmap = VarMap::new();
    let model = build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).map_err(ce)?;
    if let (Some(w), 0) = (init, rank) {
        let vars = varmap.data().lock().map_err(|_| ce_lock())?;
        for (name, v) in w {
            let var = vars
                .get(name)
                .ok_or_else(|| Error::InvalidArgument(format!("no variable {name}")))?;
            let t = Tensor::from_slice(v, var.dims(), &Device::Cpu).map_err(ce)?;
            var.set(&t).map_err(ce)?;
        }
    }
    let micro = args.global_batch / (world * args.accum);
    // Rank 0's, before its weights are every rank's.
    let first_loss = test_loss(&model, test)?;
    // Rank 0's weights reach every rank; the optimizer steps on f32 master weights.
    let mut ddp = Ddp::new(comm, &varmap, Sgd::new(0.9, 0.0), DdpConfig::default())?;
    let sampler = DistributedSampler::new(train.len(), world, rank, 7)?;
    let lr = LrSchedule {
        base_lr: args.lr,
        base_batch: args.global_batch,
        global_batch: args.global_batch,
        warmup_steps: 5,
        total_steps: args.steps,
        decay: Decay::Constant,
    };
    let per_epoch = (sampler.batches_per_epoch(micro) / args.accum) as u64;
    for step in 0..args.steps {
        let (epoch, b) = (step / per_epoch, (step % per_epoch) as usize);
        for a in 0..args.accum {
            let (x, y) = batch(train, &sampler.batch(epoch, b * args.accum + a, micro))?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x).map_err(ce)?, &y)
                .and_then(|l| l / args.accum as f64)
                .map_err(ce)?;
            if a + 1 < args.accum {
                ddp.backward_no_sync(&loss)?; // gradients accumulate, nothing sent
            } else {
                ddp.backward(&loss)?; // buckets all-reduced in the background
            }
        }
        ddp.step(lr.at(step))?; // each bucket's parameters stepped once it is reduced
    }
    Ok(RankRun {
        weights: ddp.weights(),
        first_loss,
        last_loss: test_loss(&model, test)?,
        accuracy: accuracy(&model, test)?,
    })
}

fn ce_lock() -> Error {
    Error::InvalidArgument("the VarMap's lock is poisoned".into())
}

/// The mean cross-entropy of `model` on `test`.
pub fn test_loss<M: Module>(model: &M, test: &Dataset) -> Result<f64> {
    let all: Vec<usize> = (0..test.len()).collect();
    let (x, y) = batch(test, &all)?;
    let l = candle_nn::loss::cross_entropy(&model.forward(&x).map_err(ce)?, &y).map_err(ce)?;
    Ok(l.to_scalar::<f32>().map_err(ce)? as f64)
}

/// The share of `test` that `model` labels right.
pub fn accuracy<M: Module>(model: &M, test: &Dataset) -> Result<f64> {
    let all: Vec<usize> = (0..test.len()).collect();
    let mut right = 0usize;
    for chunk in all.chunks(256) {
        let (x, y) = batch(test, chunk)?;
        let pred = model
            .forward(&x)
            .and_then(|l| l.argmax(D::Minus1))
            .and_then(|p| p.eq(&y))
            .and_then(|m| m.to_dtype(DType::U32))
            .and_then(|m| m.sum_all())
            .and_then(|s| s.to_scalar::<u32>())
            .map_err(ce)?;
        right += pred as usize;
    }
    Ok(right as f64 / test.len().max(1) as f64)
}

/// Runs `f` on `n` ranks, threads of this process over in-process links, and returns
/// each rank's result in rank order. A rank stuck for 20 s without progress in a
/// collective fails it (and so every rank); a run that has not finished after
/// `deadline` is an error, not a hang.
pub fn on_ranks<T: Send + 'static>(
    n: usize,
    deadline: Duration,
    f: impl Fn(&Communicator) -> Result<T> + Send + Sync + 'static,
) -> std::result::Result<Vec<T>, String> {
    let mut cfg = Config::default();
    cfg.tuning.timeout = Duration::from_secs(20);
    let comms = Communicator::local_group(n, &cfg).map_err(|e| e.to_string())?;
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for comm in comms {
        let (f, tx) = (Arc::clone(&f), tx.clone());
        std::thread::spawn(move || {
            let r = f(&comm);
            let _ = tx.send((comm.rank(), r));
        });
    }
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (rank, r) = rx
            .recv_timeout(deadline)
            .map_err(|_| format!("{n} ranks did not finish within {deadline:?}"))?;
        out[rank] = Some(r.map_err(|e| format!("rank {rank} of {n}: {e}"))?);
    }
    Ok(out.into_iter().flatten().collect())
}

/// Seeded initial weights for the model `build` makes: uniform in ±1/√fan_in (what
/// candle's and PyTorch's layers draw), so that a run is the same every time (candle's
/// CPU generator cannot be seeded).
pub fn seeded_init<M>(
    build: fn(VarBuilder) -> candle_core::Result<M>,
    seed: u64,
) -> Result<Weights> {
    let varmap = VarMap::new();
    build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).map_err(ce)?;
    let vars = varmap.data().lock().map_err(|_| ce_lock())?;
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut rng = Rng::derive(seed, 0x1417);
    let mut out = Weights::new();
    for name in names {
        // A bias takes its weight's fan-in.
        let w = name.strip_suffix("bias").map(|p| format!("{p}weight"));
        let dims = w.and_then(|w| vars.get(&w)).unwrap_or(&vars[name]).dims();
        let fan_in: usize = dims.iter().skip(1).product::<usize>().max(1);
        let bound = 1.0 / (fan_in as f32).sqrt();
        let n = vars[name].elem_count();
        let v = (0..n)
            .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
            .collect();
        out.push((name.clone(), v));
    }
    Ok(out)
}

fn max_diff(a: &Weights, b: &Weights) -> (f32, f32) {
    let (mut d, mut m) = (0.0f32, 0.0f32);
    for ((_, va), (_, vb)) in a.iter().zip(b) {
        for (x, y) in va.iter().zip(vb) {
            d = d.max((x - y).abs());
            m = m.max(x.abs());
        }
    }
    (d, m)
}

/// Trains with each world size of `args.ranks` (and, with 2 ranks, once more with two
/// accumulation micro-batches through `no_sync`), all from the same seeded initial
/// weights, and checks: replicas bitwise equal; weights within `tol` (relative to the
/// largest weight) of the first run's after K steps; test accuracy within 1 point of
/// it; the loss fell. Returns one line per run.
pub fn check_equivalence<M: Module + 'static>(
    name: &str,
    args: &Args,
    tol: f32,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> std::result::Result<Vec<String>, String> {
    let deadline = Duration::from_secs(600);
    let data = Arc::new(data(args).map_err(|e| e.to_string())?);
    let run = |n: usize, accum: usize, init: Option<Weights>| {
        let (data, args) = (
            Arc::clone(&data),
            Args {
                accum,
                ..args.clone()
            },
        );
        on_ranks(n, deadline, move |c| {
            train_rank(c, &args, &data, init.as_ref(), build)
        })
    };
    let mut plan: Vec<(usize, usize)> = args.ranks.iter().map(|&n| (n, 1)).collect();
    if args.ranks.contains(&2) && args.global_batch.is_multiple_of(4) {
        plan.push((2, 2));
    }
    let init = seeded_init(build, 7).map_err(|e| e.to_string())?;
    let mut reference: Option<(Weights, f64)> = None;
    let mut lines = Vec::new();
    for (n, accum) in plan {
        let ranks = run(n, accum, Some(init.clone()))?;
        let r0 = &ranks[0];
        for (r, other) in ranks.iter().enumerate().skip(1) {
            if other.weights != r0.weights {
                return Err(format!(
                    "{name}: {n} ranks: rank {r}'s weights differ from rank 0's"
                ));
            }
        }
        if r0.last_loss >= r0.first_loss || r0.last_loss.is_nan() {
            return Err(format!(
                "{name}: {n} ranks: the loss did not fall ({} → {})",
                r0.first_loss, r0.last_loss
            ));
        }
        let (d, m, acc_gap) = match &reference {
            None => (0.0, 0.0, 0.0),
            Some((fin, acc)) => {
                let (d, m) = max_diff(fin, &r0.weights);
                (d, m, (r0.accuracy - acc).abs())
            }
        };
        if d > tol * m.max(1.0) {
            return Err(format!(
                "{name}: {n} ranks × accum {accum}: weights differ from the first run by {d:e} (max |w| {m})"
            ));
        }
        if acc_gap > 0.01 {
            return Err(format!(
                "{name}: {n} ranks: accuracy {:.4} is more than a point from the first run's",
                r0.accuracy
            ));
        }
        let gap = match reference {
            None => "the reference".to_string(),
            Some(_) => format!("max |w − w_ref| {d:.3e} (max |w| {m:.3})"),
        };
        lines.push(format!(
            "{name}: {n} rank(s) × {} samples × {accum} micro-batch(es), {} steps: test loss {:.4} → {:.4}, accuracy {:.2} %, {gap}",
            args.global_batch / (n * accum),
            args.steps,
            r0.first_loss,
            r0.last_loss,
            r0.accuracy * 100.0
        ));
        if reference.is_none() {
            reference = Some((r0.weights.clone(), r0.accuracy));
        }
    }
    Ok(lines)
}

/// An example's `main`: the command line over the defaults, [`check_equivalence`], one
/// line per run; exit 2 for a bad command line, 1 for a failed check.
pub fn main_for<M: Module + 'static>(
    name: &str,
    (steps, global_batch, lr): (u64, usize, f64),
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> ExitCode {
    let args = match Args::parse(steps, global_batch, lr) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ddp_{name}: {e}");
            return ExitCode::from(2);
        }
    };
    match check_equivalence(name, &args, 1e-4, build) {
        Ok(lines) => {
            lines.iter().for_each(|l| println!("{l}"));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ddp_{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
