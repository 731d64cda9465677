//! `ferroccl train`: data-parallel training of a small CNN on MNIST-format digits
//! (see the `ferroccl-candle` package), and `--scaling` reports across world sizes.

use clap::Args;
use ferroccl::ddp::{Decay, WireDtype};
use ferroccl::rendezvous::LaunchEnv;
use ferroccl::{Communicator, Config};
use ferroccl_candle::model::{Precision, TrainDevice};
use ferroccl_candle::{DataSource, Error, Result, Resume, Summary, TrainConfig, Trainer};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Data: a CSV (`.csv`/`.csv.gz`: 784 pixels then the label per row, e.g.
    /// mnist_5k from tools/fetch-mnist) or a directory with the MNIST IDX files.
    /// Without it, a built-in synthetic digit set.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Images in the synthetic set (without --data).
    #[arg(long, default_value_t = 5000)]
    synthetic: usize,
    /// Share of the data held out for test accuracy.
    #[arg(long, default_value = "0.1", value_parser = crate::args::fraction, allow_negative_numbers = true)]
    test_fraction: f64,
    /// Epochs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    epochs: u64,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Global batch: images per optimizer step over all ranks.
    #[arg(short = 'b', long, default_value_t = 64)]
    batch: usize,
    /// Gradient accumulation: backward passes per optimizer step.
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Learning rate for --base-batch; scaled linearly to the global batch.
    #[arg(long, default_value = "0.05", value_parser = crate::args::positive, allow_negative_numbers = true)]
    lr: f64,
    /// The batch --lr is tuned for.
    #[arg(long, default_value_t = 64)]
    base_batch: usize,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 20)]
    warmup: u64,
    /// Cosine decay to zero after warmup (default: constant).
    #[arg(long)]
    cosine: bool,
    /// SGD momentum.
    #[arg(long, default_value = "0.9", value_parser = crate::args::momentum, allow_negative_numbers = true)]
    momentum: f32,
    /// Weight decay.
    #[arg(long, default_value = "0", value_parser = crate::args::non_negative, allow_negative_numbers = true)]
    weight_decay: f32,
    /// Where every rank computes: cpu, or cuda (candle's CUDA backend; each rank on
    /// GPU local-rank modulo the host's GPUs, so ranks share GPUs when there are
    /// fewer). cuda needs the binary built with `--features candle-cuda`.
    #[arg(long, default_value = "cpu", value_parser = clap::builder::PossibleValuesParser::new(["cpu", "cuda"]), ignore_case = true)]
    device: String,
    /// Forward/backward precision: f32 or f16 (f32 master weights, dynamic loss
    /// scaling); bf16 is refused on the CPU (candle has no bf16 matmul there).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Initial loss scale for f16/bf16.
    #[arg(long, default_value_t = 65536.0)]
    loss_scale: f32,
    /// Gradients on the wire: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    wire: String,
    /// Bucket cap in KiB (PyTorch DDP: 25 MiB).
    #[arg(long, default_value_t = 25 * 1024)]
    bucket_kib: usize,
    /// First bucket's cap in KiB (PyTorch DDP: 1 MiB).
    #[arg(long, default_value_t = 1024)]
    first_bucket_kib: usize,
    /// Reduce gradients only after the whole backward (to measure what overlap hides).
    #[arg(long)]
    no_overlap: bool,
    /// Network width multiplier (1: LeNet-5's 6/16/120 channels).
    #[arg(long, default_value_t = 1)]
    width: usize,
    /// Random ±2-pixel translations of training images.
    #[arg(long)]
    augment: bool,
    /// Seed of everything.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory where rank 0 writes checkpoints.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (and always at the end).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Checkpoints kept.
    #[arg(long, default_value_t = 3)]
    keep: usize,
    /// Resume: from the newest checkpoint in --checkpoint-dir, or from the file given.
    #[arg(long, num_args = 0..=1, default_missing_value = "")]
    resume: Option<String>,
    /// JSON-lines metrics (per rank and mean), appended by rank 0.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Steps between metrics records.
    #[arg(long, default_value_t = 50)]
    log_every: u64,
    /// Write the run's summary as JSON here (rank 0).
    #[arg(long)]
    summary: Option<PathBuf>,
    /// Pipeline stages P. Above 1 (or with --zero 1), `train` trains an 8-layer MLP
    /// (784-512×7-10: it splits evenly into 2, 4 or 8 stages, which LeNet's three
    /// unequal segments cannot) cut into P stages × ranks/P data-parallel
    /// replicas, and prints each rank's step-time table.
    #[arg(long, default_value = "1", value_parser = crate::args::ranks)]
    pipeline: usize,
    /// Tensor-parallel ranks T: each stage's layers split over T ranks (Megatron MLP
    /// blocks: column- then row-parallel), the ranks a P × T × D layout with
    /// ranks/(P × T) data-parallel replicas. Trains the MLP (see --pipeline); T must
    /// divide its hidden size 512 and each stage must hold whole pairs of layers
    /// (P = 1, 2 or 4).
    #[arg(long, default_value = "1", value_parser = crate::args::ranks)]
    tensor_parallel: usize,
    /// Train the MLP of --pipeline and --tensor-parallel even with neither (one
    /// stage, no tensor parallelism, ranks as data-parallel replicas): their baseline.
    #[arg(long)]
    mlp: bool,
    /// Rank 0 writes the model's final weights as a ferroccl checkpoint file: LeNet's
    /// by name, or the MLP's whole model (every stage's and tensor shard's, put back
    /// together), flat. Not with --mode ssp.
    #[arg(long, value_name = "FILE")]
    save_weights: Option<PathBuf>,
    /// Micro-batches per step with --pipeline (must divide the batch per replica),
    /// 1 to 1,000,000.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    micro_batches: usize,
    /// Pipeline schedule: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b", value_parser = clap::builder::PossibleValuesParser::new(["gpipe", "1f1b"]), ignore_case = true)]
    schedule: String,
    /// ZeRO stage with --pipeline: 0 (every replica holds the optimizer state) or 1
    /// (sharded over the replicas).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    zero: u8,
    /// How replicas keep in step: `sync` (DDP: all-reduced gradients, every rank
    /// steps alike) or `ssp` (a sharded parameter server: every rank serves a shard
    /// and runs a worker that pushes gradients and pulls parameters; see
    /// --staleness).
    #[arg(long, default_value = "sync", value_parser = clap::builder::PossibleValuesParser::new(["sync", "ssp"]))]
    mode: String,
    /// With --mode ssp: a worker may start step t only once every worker has
    /// finished step t − S − 1 (0: synchronous, servers average each step's
    /// gradients as DDP; inf: fully asynchronous). 0 to 1,000,000 or inf.
    #[arg(long, value_parser = crate::args::staleness, allow_negative_numbers = true)]
    staleness: Option<crate::args::StalenessBound>,
    /// Make this rank a straggler (see --slow-factor).
    #[arg(long)]
    slow_rank: Option<usize>,
    /// The straggler's slowdown: after each step's compute it sleeps
    /// (F − 1) × that compute (1 to 1000).
    #[arg(long, default_value = "2", value_parser = crate::args::slow_factor, requires = "slow_rank", allow_negative_numbers = true)]
    slow_factor: f64,
    /// Stop after this many seconds of training (sync: the ranks agree on rank 0's
    /// clock; ssp: each worker stops on its own).
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true)]
    time_limit: Option<std::time::Duration>,
    /// Test accuracy every this many seconds of training (rank 0's weights, kept
    /// and evaluated after the run).
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true)]
    curve_every: Option<std::time::Duration>,
    /// Ranks to start when not under a launcher.
    #[arg(short = 'n', long, default_value = "1", value_parser = crate::args::ranks)]
    ranks: usize,
    /// With --ranks N (no launcher): when a rank fails or the job is preempted, start
    /// every rank again, up to this many times (see `ferroccl launch --max-restarts`);
    /// with --resume and a --checkpoint-dir the run goes on from its newest checkpoint.
    #[arg(long = "max-restarts", default_value_t = 0)]
    max_restarts: usize,
    /// Run at each of these world sizes and report throughput, speedup, efficiency
    /// and accuracy (e.g. 1,2,4); draws throughput against ranks into --plot.
    #[arg(long, value_delimiter = ',')]
    scaling: Option<Vec<usize>>,
    /// SVG for --scaling.
    #[arg(long, default_value = "scaling.svg")]
    plot: PathBuf,
    /// Seconds without progress before a collective fails.
    #[arg(long, default_value = "60", value_parser = crate::args::seconds, allow_negative_numbers = true)]
    timeout: std::time::Duration,
    /// Record every rank's flight recorder into DIR/rank-<rank>.jsonl: at the end of
    /// the run, and on a failure (with --scaling: DIR/ranks-N per world size). Read
    /// them with `ferroccl trace DIR`.
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
}

pub fn main(a: TrainArgs) -> crate::error::Result<bool> {
    match &a.scaling {
        Some(ns) => scaling(&a, ns)?,
        None => run(&a)?,
    }
    Ok(true)
}

fn config(a: &TrainArgs) -> Result<TrainConfig> {
    Ok(TrainConfig {
        data: match &a.data {
            Some(p) => DataSource::Path(p.clone()),
            None => DataSource::Synthetic(a.synthetic),
        },
        test_fraction: a.test_fraction,
        epochs: a.epochs,
        max_steps: a.max_steps,
        global_batch: a.batch,
        accum: a.accum,
        base_lr: a.lr,
        base_batch: a.base_batch,
        warmup_steps: a.warmup,
        decay: if a.cosine {
            Decay::Cosine
        } else {
            Decay::Constant
        },
        momentum: a.momentum,
        weight_decay: a.weight_decay,
        precision: Precision::parse(&a.precision)?,
        loss_scale: a.loss_scale,
        wire: WireDtype::parse(&a.wire)?,
        bucket_bytes: a.bucket_kib.max(1) << 10,
        first_bucket_bytes: a.first_bucket_kib.max(1) << 10,
        overlap: !a.no_overlap,
        width: a.width,
        augment: a.augment,
        seed: a.seed,
        checkpoint_dir: a.checkpoint_dir.clone(),
        checkpoint_every: a.checkpoint_every,
        keep: a.keep,
        resume: a.resume.as_ref().map(|r| {
            if r.is_empty() {
                Resume::Latest
            } else {
                Resume::File(PathBuf::from(r))
            }
        }),
        metrics: a.metrics.clone(),
        log_every: a.log_every,
        progress: a.mode == "sync",
        straggler: a.slow_rank.map(|rank| ferroccl_candle::Straggler {
            rank,
            factor: a.slow_factor,
        }),
        time_limit: a.time_limit,
        curve_every: a.curve_every,
        device: TrainDevice::parse(&a.device.to_ascii_lowercase())?,
        ..TrainConfig::default()
    })
}

/// What the first local rank says when ranks of its host share the host's GPUs (the
/// ranks `-n N` starts are launched too, so it is said once per host): a GPU then
/// time-slices between the processes unless the MPS daemon merges them.
fn sharing_note(
    device: TrainDevice,
    gpus: usize,
    local_rank: Option<usize>,
    local_ranks: Option<usize>,
) -> Option<String> {
    let local = local_ranks?;
    (device == TrainDevice::Cuda && local_rank == Some(0) && local > gpus).then(|| {
        format!(
            "ferroccl train: {local} ranks share this host's {gpus} GPU(s) (local rank r on \
             GPU r % {gpus}); without MPS a GPU runs one process at a time \
             (`nvidia-cuda-mps-control -d` starts it)"
        )
    })
}

/// candle's CPU kernels use a thread pool as wide as the machine; with several ranks
/// on one machine that oversubscribes it many times over. Unless the user chose,
/// give each rank its share of the cores ([`LaunchEnv::compute_threads`]).
fn share_cores(env: &LaunchEnv) {
    if std::env::var("RAYON_NUM_THREADS").is_ok_and(|v| !v.trim().is_empty()) {
        return;
    }
    // Called before this process starts any other thread (edition 2021: safe fn).
    std::env::set_var("RAYON_NUM_THREADS", env.compute_threads().to_string());
}

fn run(a: &TrainArgs) -> Result<()> {
    let mut tc = config(a)?;
    // No GPU, or no CUDA in this build: fail here, before any rank starts.
    let units = tc.device.count()?;
    let launch = ferroccl::rendezvous::detect_env()?;
    let launched = launch.is_some();
    let local = launch.as_ref().map(|e| (e.local_rank, e.local_world_size));
    if let Some(note) = local.and_then(|(r, n)| sharing_note(tc.device, units, r, n)) {
        eprintln!("{note}");
    }
    if let Some(dir) = &a.trace {
        // Before any communicator or thread: it sets FERROCCL_TRACE_DIR, which ranks
        // started below inherit.
        crate::trace::record_into(dir, !launched)?;
    }
    let comm = if let Some(env) = &launch {
        share_cores(env);
        let mut c = Config::from_env()?;
        c.tuning.timeout = a.timeout;
        check_pipeline(a, env.world_size)?;
        check_modes(a, &tc, env.world_size)?;
        Communicator::init(c)?
    } else if a.ranks <= 1 {
        check_pipeline(a, 1)?;
        check_modes(a, &tc, 1)?;
        let mut base = Config::new(0, 1, "");
        base.tuning.timeout = a.timeout;
        Communicator::local_group(1, &base)?.remove(0)
    } else {
        check_pipeline(a, a.ranks)?;
        check_modes(a, &tc, a.ranks)?;
        if !mlp(a) {
            // What every rank's trainer would refuse (a precision the device lacks, a
            // batch that does not split): said once, before any rank starts.
            tc.check_lenet(trainer(a), a.ranks)?;
        }
        return relaunch(a.ranks, a.max_restarts, &[], &[]);
    };
    // SIGTERM (a scheduler's preemption, or `ferroccl launch` stopping the job):
    // finish the step, checkpoint, exit 75 so that a launcher restarts the job.
    tc.preemption = Some(ferroccl::ddp::Preemption::install()?);
    match trainer(a) {
        Trainer::Pipeline => return pipeline_run(a, &comm, &tc),
        Trainer::ParameterServer => {
            let out = ps_run(a, &comm, &tc);
            return crate::trace::finish(&comm, a.trace.as_deref(), out);
        }
        Trainer::Ddp => {}
    }
    let out = ferroccl_candle::train(&comm, &tc);
    let out = crate::trace::finish(&comm, a.trace.as_deref(), out)?;
    if comm.rank() == 0 {
        let s = &out.summary;
        println!(
            "ranks {}  steps {} (this run {})  global batch {}  loss {:.4} (step {}; mean of the last {} steps {:.4})  test accuracy {:.2}%",
            s.world,
            s.steps,
            s.steps_run,
            s.global_batch,
            s.step_loss,
            s.steps,
            s.final_loss_steps,
            s.final_loss,
            100.0 * s.test_accuracy
        );
        println!(
            "throughput {:.0} images/s  compute {:.2} ms/step  exposed all-reduce {:.2} ms/step  buckets {}  skipped steps {}",
            s.images_per_s,
            1e3 * s.compute_s,
            1e3 * s.comm_exposed_s,
            s.buckets,
            s.skipped_steps
        );
        println!(
            "replicas bitwise equal: {}",
            if s.replicas_equal { "yes" } else { "NO" }
        );
        print_curve(&s.curve);
        if let Some(p) = &a.save_weights {
            save_weights(p, &out.params, serde_json::json!({"steps": s.steps}))?;
        }
        if let Some(p) = &a.summary {
            let j = serde_json::to_string_pretty(s).expect("summary serialises");
            std::fs::write(p, j).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
        }
        replicas_check(s.replicas_equal, s.steps)?;
    }
    Ok(())
}

/// A run whose replicas ended with different weights fails, after its summary: the
/// same averaged gradients on every rank must leave every replica the same.
fn replicas_check(equal: bool, steps: u64) -> Result<()> {
    if equal {
        return Ok(());
    }
    Err(ferroccl::ddp::TrainError::Diverged {
        step: steps,
        why: "the replicas ended with different weights (their digests differ after the last \
              step)"
            .into(),
    }
    .into())
}

/// Whether this run trains the MLP (pipeline, tensor parallelism, ZeRO) rather than
/// LeNet.
fn mlp(a: &TrainArgs) -> bool {
    a.pipeline > 1 || a.zero > 0 || a.tensor_parallel > 1 || a.mlp
}

/// The trainer this run's flags choose.
fn trainer(a: &TrainArgs) -> Trainer {
    match (mlp(a), a.mode.as_str()) {
        (true, _) => Trainer::Pipeline,
        (false, "ssp") => Trainer::ParameterServer,
        _ => Trainer::Ddp,
    }
}

/// The pipeline and tensor-parallel flags against a job of `world` ranks, before any
/// rank starts (each rank would otherwise say it, once per rank).
fn check_pipeline(a: &TrainArgs, world: usize) -> Result<()> {
    if !mlp(a) {
        return Ok(());
    }
    let bad = |why: String| Err(Error::invalid(why));
    if !world.is_multiple_of(a.pipeline) {
        return bad(format!(
            "--pipeline {}: {world} ranks do not make whole pipelines of {} stages",
            a.pipeline, a.pipeline
        ));
    }
    let (p, t) = (a.pipeline, a.tensor_parallel);
    if !world.is_multiple_of(p.saturating_mul(t)) {
        return bad(format!(
            "--pipeline {p} --tensor-parallel {t}: {world} ranks are not a P × T × D \
             layout ({p} × {t} = {} does not divide {world})",
            p.saturating_mul(t)
        ));
    }
    ferroccl_candle::trainer::mlp::check_mlp(&ferroccl_candle::trainer::mlp::WIDTHS, p, t)?;
    let replicas = world / (p * t);
    if !a.batch.is_multiple_of(replicas) || !(a.batch / replicas).is_multiple_of(a.micro_batches) {
        return bad(format!(
            "--micro-batches {}: the batch {} over {replicas} replica(s) does not cut into {} equal micro-batches",
            a.micro_batches, a.batch, a.micro_batches
        ));
    }
    Ok(())
}

/// --mode, --staleness and the straggler against a job of `world` ranks, and the
/// fields of `tc` the mode's trainer does not read, before any rank starts.
fn check_modes(a: &TrainArgs, tc: &TrainConfig, world: usize) -> Result<()> {
    let bad = |why: String| Err(Error::invalid(why));
    if a.mode == "sync" && a.staleness.is_some() {
        return bad("--staleness applies to --mode ssp (sync is DDP: staleness 0)".into());
    }
    if a.mode == "ssp" && a.save_weights.is_some() {
        return bad("--save-weights: --mode ssp keeps its weights on the servers' shards".into());
    }
    if a.mode == "ssp" && mlp(a) {
        return bad(
            "--mode ssp trains LeNet on a parameter server: no --pipeline, --tensor-parallel, \
             --zero or --mlp"
                .into(),
        );
    }
    // What the chosen trainer does not read is refused, not ignored.
    tc.refuse_unread(trainer(a))?;
    if let Some(r) = a.slow_rank.filter(|&r| r >= world) {
        return bad(format!(
            "--slow-rank {r}: the job has {world} rank(s), 0 to {}",
            world - 1
        ));
    }
    Ok(())
}

/// `0: 12, 1: 3, ...`, the first 8 staleness values one by one and the rest as one
/// count, with the mean and the largest.
fn histogram_line(h: &[u64]) -> String {
    let mut parts: Vec<String> = h
        .iter()
        .enumerate()
        .take(8)
        .filter(|(_, c)| **c > 0)
        .map(|(k, c)| format!("{k}: {c}"))
        .collect();
    let rest: u64 = h.iter().skip(8).sum();
    if rest > 0 {
        parts.push(format!("8 or more: {rest}"));
    }
    let total: u64 = h.iter().sum();
    let mean = h
        .iter()
        .enumerate()
        .map(|(k, c)| k as f64 * *c as f64)
        .sum::<f64>()
        / total.max(1) as f64;
    format!(
        "{}  (mean {mean:.2}, max {})",
        parts.join(", "),
        h.len().saturating_sub(1)
    )
}

fn print_curve(curve: &[(f64, f64)]) {
    if curve.len() > 1 {
        let pts: Vec<String> = curve
            .iter()
            .map(|(t, acc)| format!("{t:.1}s {:.1}%", 100.0 * acc))
            .collect();
        println!("test accuracy over time: {}", pts.join(", "));
    }
}

/// `--mode ssp`: LeNet over the parameter server.
fn ps_run(a: &TrainArgs, comm: &Communicator, tc: &TrainConfig) -> Result<()> {
    use ferroccl_candle::ps::ssp::Staleness;
    let s = match a
        .staleness
        .unwrap_or(crate::args::StalenessBound(Some(0)))
        .0
    {
        Some(k) => Staleness::Bounded(k),
        None => Staleness::Unbounded,
    };
    if comm.rank() == 0 {
        println!(
            "parameter server: training on {} ranks, staleness {s}",
            comm.world_size()
        );
    }
    let out = ferroccl_candle::trainer::ps::train_ps(comm, tc, s)?;
    if comm.rank() == 0 {
        let s = &out.summary;
        println!(
            "parameter server: {} ranks (each a worker and a shard's server), staleness {}, global batch {}  steps per worker {:?}  test accuracy {:.2}%",
            s.world,
            s.staleness,
            s.global_batch,
            s.steps,
            100.0 * s.test_accuracy
        );
        println!(
            "throughput {:.0} images/s  wall {:.1} s  updates {}",
            s.images_per_s, s.wall_s, s.updates
        );
        println!(
            "staleness histogram (steps: updates): {}",
            histogram_line(&s.histogram)
        );
        print_curve(&s.curve);
        if let Some(p) = &a.summary {
            let j = serde_json::to_string_pretty(s)
                .map_err(|e| Error::invalid(format!("the summary as JSON: {e}")))?;
            std::fs::write(p, j).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
        }
    }
    Ok(())
}

/// `--pipeline P` / `--tensor-parallel T` / `--zero 1` / `--mlp`: the MLP on a
/// P × T × D layout, and the step-time table.
fn pipeline_run(a: &TrainArgs, comm: &Communicator, tc: &TrainConfig) -> Result<()> {
    use ferroccl_candle::pipeline::{PipelineConfig, Schedule};
    // --zero is 0 or 1 (the flag's parser): ZeRO-1 is the only stage built.
    let pcfg = PipelineConfig {
        schedule: Schedule::parse(&a.schedule)?,
        micro_batches: a.micro_batches,
        zero: a.zero == 1,
    };
    let s = ferroccl_candle::trainer::pipeline::train_mesh(
        comm,
        tc,
        pcfg,
        a.pipeline.max(1),
        a.tensor_parallel.max(1),
    )?;
    if comm.rank() != 0 {
        return Ok(());
    }
    let layout = if s.tensor > 1 {
        format!(
            "{} stages × {} tensor-parallel × {} replicas (P × T × D)",
            s.stages, s.tensor, s.replicas
        )
    } else {
        format!("{} stages × {} replicas", s.stages, s.replicas)
    };
    println!(
        "pipeline: {layout}, {} with {} micro-batches{}, MLP {:?}: {} steps, loss {:.4}",
        pcfg.schedule.name(),
        s.micro_batches,
        if pcfg.zero { ", ZeRO-1" } else { "" },
        ferroccl_candle::trainer::mlp::WIDTHS,
        s.steps,
        s.final_loss
    );
    println!(
        "replicas bitwise equal: {}",
        if s.replicas_equal { "yes" } else { "NO" }
    );
    print_stage_table(&s);
    if let Some(p) = &a.summary {
        let j = serde_json::to_string_pretty(&s)
            .map_err(|e| Error::invalid(format!("the summary as JSON: {e}")))?;
        std::fs::write(p, j).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    if let Some(p) = &a.save_weights {
        let state = serde_json::json!({
            "steps": s.steps, "stages": s.stages, "tensor": s.tensor, "replicas": s.replicas,
        });
        save_weights(p, &s.weights, state)?;
    }
    replicas_check(s.replicas_equal, s.steps)
}

/// `--save-weights`: `weights` (name, values), each flat, and `state`, as a ferroccl
/// checkpoint file.
fn save_weights(
    p: &std::path::Path,
    weights: &[(String, Vec<f32>)],
    state: serde_json::Value,
) -> Result<()> {
    let tensors = weights
        .iter()
        .map(|(name, v)| ferroccl::ddp::checkpoint::Tensor {
            name: name.clone(),
            shape: vec![v.len()],
            data: v.clone(),
        })
        .collect();
    ferroccl::ddp::checkpoint::save(p, &ferroccl::ddp::Checkpoint { state, tensors })?;
    Ok(())
}

/// Each rank's row: stage, replica, step and busy time, bubble, peak live
/// micro-batches, optimizer bytes; with tensor parallelism its tensor rank and the
/// payload bytes its tensor-parallel links sent per step, counted and by the formula.
fn print_stage_table(s: &ferroccl_candle::trainer::pipeline::PipelineSummary) {
    let tp = s.tensor > 1;
    let (head, rule) = if tp {
        (
            " tensor | tensor bytes/step (counted) | (formula) |",
            "---|---|---|",
        )
    } else {
        ("", "")
    };
    println!("| rank | stage | replica | step ms | busy ms | bubble | textbook | peak live | optimizer bytes |{head}");
    println!("|---|---|---|---|---|---|---|---|---|{rule}");
    for (r, x) in s.per_rank.iter().enumerate() {
        let extra = if tp {
            format!(
                " {} | {:.0} | {:.0} |",
                x.tensor, x.tensor_bytes_per_step, x.tensor_law_bytes_per_step
            )
        } else {
            String::new()
        };
        println!(
            "| {r} | {} | {} | {:.1} | {:.1} | {:.1} % | {:.1} % | {} | {} |{extra}",
            x.stage,
            x.replica,
            x.step_ms,
            x.busy_ms,
            100.0 * x.bubble,
            100.0 * s.textbook_bubble,
            x.peak_live,
            x.optimizer_bytes
        );
    }
}

/// Re-runs this command under our own launcher with `n` ranks, without the options
/// in `drop` (and their values), with `extra` arguments appended.
fn relaunch(n: usize, max_restarts: usize, drop: &[&str], extra: &[String]) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("locating the ferroccl binary", e))?;
    let mut cmd: Vec<std::ffi::OsString> = vec![exe.into_os_string()];
    let mut skip = false;
    for arg in std::env::args_os().skip(1) {
        if skip {
            skip = false;
            continue;
        }
        let s = arg.to_string_lossy();
        if drop.iter().any(|d| s == *d) {
            skip = true;
            continue;
        }
        if drop.iter().any(|d| s.starts_with(&format!("{d}="))) {
            continue;
        }
        cmd.push(arg);
    }
    cmd.extend(extra.iter().map(Into::into));
    let opts = crate::launch::LaunchOptions {
        bare_stdout_rank: Some(0),
        max_restarts,
        // The model, its gradients and optimizer state, candle's buffers: 256 MiB.
        rank_needs: crate::args::RankNeeds::ferroccl(n, 256 << 20),
        ..Default::default()
    };
    crate::launch::run(n, &cmd, &opts).map_err(|e| Error::invalid(e.to_string()))
}

fn scaling(a: &TrainArgs, ns: &[usize]) -> Result<()> {
    if ns.is_empty() || ns.contains(&0) {
        return Err(Error::invalid(
            "--scaling takes world sizes of 1 or more, e.g. 1,2,4",
        ));
    }
    let device = config(a)?.device;
    let units = device.count()?;
    let tmp = std::env::temp_dir().join(format!("ferroccl-scaling-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("creating a temporary directory", e))?;
    let mut rows: Vec<Summary> = Vec::new();
    for &n in ns {
        let file = tmp.join(format!("summary-{n}.json"));
        eprintln!("== {n} rank(s)");
        let mut extra = vec![
            "--ranks".into(),
            n.to_string(),
            "--summary".into(),
            file.display().to_string(),
        ];
        if let Some(dir) = &a.trace {
            extra.push("--trace".into());
            extra.push(dir.join(format!("ranks-{n}")).display().to_string());
        }
        relaunch(
            n,
            0,
            &[
                "--scaling",
                "--plot",
                "--summary",
                "--ranks",
                "-n",
                "--trace",
            ],
            &extra,
        )?;
        let text = std::fs::read_to_string(&file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        rows.push(
            serde_json::from_str(&text)
                .map_err(|e| Error::invalid(format!("summary of the {n}-rank run: {e}")))?,
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let base = &rows[0];
    let on = match device {
        TrainDevice::Cpu => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            format!("{cores} cores")
        }
        TrainDevice::Cuda => format!("{units} GPU(s)"),
    };
    println!(
        "scaling on {on}, global batch {} (per rank: batch / ranks)",
        a.batch
    );
    println!(
        "{:>5} {:>12} {:>9} {:>11} {:>14} {:>16} {:>13}",
        "ranks",
        "images/s",
        "speedup",
        "efficiency",
        "test accuracy",
        "exposed ms/step",
        "compute ms/step"
    );
    let mut pts = Vec::new();
    for r in &rows {
        let speedup = r.images_per_s / base.images_per_s;
        let eff = speedup * base.world as f64 / r.world as f64;
        println!(
            "{:>5} {:>12.0} {:>9.2} {:>10.0}% {:>13.2}% {:>16.2} {:>13.2}",
            r.world,
            r.images_per_s,
            speedup,
            100.0 * eff,
            100.0 * r.test_accuracy,
            1e3 * r.comm_exposed_s,
            1e3 * r.compute_s
        );
        pts.push((r.world as f64, r.images_per_s));
    }
    crate::plot::draw_xy(
        &a.plot,
        "ferroccl train: throughput against ranks",
        "ranks",
        "images/s (job)",
        &pts,
    )
    .map_err(|e| Error::invalid(e.to_string()))?;
    println!("plot: {}", a.plot.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_local_rank_alone_says_when_ranks_share_gpus() {
        let cuda = TrainDevice::Cuda;
        let note = sharing_note(cuda, 1, Some(0), Some(2)).expect("2 ranks on 1 GPU");
        assert!(
            note.contains("2 ranks share this host's 1 GPU(s)"),
            "{note}"
        );
        assert_eq!(sharing_note(cuda, 1, Some(1), Some(2)), None, "not rank 0");
        assert_eq!(sharing_note(cuda, 2, Some(0), Some(2)), None, "a GPU each");
        assert_eq!(sharing_note(cuda, 1, Some(0), None), None, "size unknown");
        assert_eq!(sharing_note(TrainDevice::Cpu, 1, Some(0), Some(4)), None);
    }

    #[test]
    fn replicas_that_ended_apart_fail_the_run() {
        assert!(replicas_check(true, 7).is_ok());
        let e = replicas_check(false, 7).expect_err("different replicas must fail");
        let msg = e.to_string();
        assert!(
            msg.contains("at step 7") && msg.contains("replicas ended with different weights"),
            "{msg}"
        );
    }
}
