//! The pipeline measured against the textbook (a benchmark, not a test; it asserts
//! nothing and its numbers depend on the machine):
//!
//! 1. **Bubble fraction** on threads, p = 2 and 4, m = 1..16, GPipe and 1F1B: each
//!    stage's idle time over the step's schedule time (mean over stages), next to
//!    (p − 1)/(m + p − 1). The stages' compute is *synthetic*: a custom candle op that
//!    sleeps 2 ms in forward and 4 ms in backward per micro-batch, so that the
//!    schedule, the executor and the messages are measured, not this shared 2-core
//!    machine's arithmetic (sleeping stages do not compete for the cores).
//! 2. **Peak live activations** per stage (micro-batches held at once), p = 4, m = 8.
//! 3. **Optimizer-state bytes per rank** with ZeRO-1 and Adam at N = 1, 2, 4.
//! 4. **Step time against micro-batches** for a 2-stage split of a real MLP (real
//!    compute: two stages share the two cores), with one process running the whole
//!    model on the same batch in the same run.
//!
//! ```sh
//! cargo run --release -p ferroccl-candle --example pipeline_bench -- --json pipe.json
//! ferroccl plot pipe.json   # bubble.svg
//! ```

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Module, Shape, Tensor};
use ferroccl::{Communicator, Config, Error, Result};
use ferroccl_candle::ddp::{Adam, Ddp, DdpConfig, Sgd};
use ferroccl_candle::pipeline::mlp::{even_split, mlp_stage, MlpStage};
use ferroccl_candle::pipeline::schedule::textbook_bubble;
use ferroccl_candle::pipeline::{Pipeline, PipelineConfig, Schedule, StepReport};
use ferroccl_candle::zero::Zero;
use std::time::{Duration, Instant};

fn ce(e: candle_core::Error) -> Error {
    Error::InvalidArgument(e.to_string())
}

/// The identity, sleeping `fwd` in forward and `bwd` in backward.
struct Sleep {
    fwd: Duration,
    bwd: Duration,
}

impl CustomOp1 for Sleep {
    fn name(&self) -> &'static str {
        "sleep"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        std::thread::sleep(self.fwd);
        let CpuStorage::F32(v) = s else {
            candle_core::bail!("sleep: f32 only")
        };
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("sleep: contiguous only".into()))?;
        Ok((CpuStorage::F32(v[a..b].to_vec()), l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        std::thread::sleep(self.bwd);
        Ok(Some(g.clone()))
    }
}

/// A stage of synthetic compute: a small linear layer, then the sleep.
struct SleepStage {
    fc: MlpStage,
}

impl Module for SleepStage {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)?.apply_op1(Sleep {
            fwd: Duration::from_millis(2),
            bwd: Duration::from_millis(4),
        })
    }
}

/// Runs `f` on `n` ranks (threads), returning every rank's result.
fn on_threads<R: Send>(n: usize, f: impl Fn(&Communicator) -> Result<R> + Sync) -> Result<Vec<R>> {
    let comms = Communicator::local_group(n, &Config::default())?;
    std::thread::scope(|t| {
        let f = &f;
        let hs: Vec<_> = comms.into_iter().map(|c| t.spawn(move || f(&c))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::InvalidArgument("panicked".into())))
            })
            .collect()
    })
}

/// `steps` steps (after one warm-up) of a pipeline of `p` stages built by `stage`;
/// each rank's reports.
fn pipeline_steps<M: Module>(
    p: usize,
    cfg: PipelineConfig,
    batch: usize,
    widths: &[usize],
    steps: usize,
    stage: impl Fn(usize) -> Result<(M, Vec<(String, candle_core::Var)>)> + Sync,
) -> Result<Vec<Vec<StepReport>>> {
    on_threads(p, |c| {
        let (module, vars) = stage(c.rank())?;
        let width = widths[c.rank()];
        let mut pl = Pipeline::from_vars(c, None, module, vars, &[width], Sgd::new(0.0, 0.0), cfg)?;
        let x = Tensor::ones((batch, width), candle_core::DType::F32, &Device::Cpu).map_err(ce)?;
        let loss = |out: &Tensor, _: std::ops::Range<usize>| out.sqr()?.mean_all();
        let mut out = Vec::new();
        for i in 0..=steps {
            let r = pl.step(batch, (c.rank() == 0).then_some(&x), &loss, 1e-3)?;
            if i > 0 {
                out.push(r);
            }
        }
        Ok(out)
    })
}

/// Per step: the step time is the longest stage's schedule time (the stages start
/// together, released by the previous step's loss broadcast), and a stage's idle time
/// is the step time less its busy time; the bubble is the mean idle share.
fn bubbles(reps: &[Vec<StepReport>]) -> Vec<f64> {
    (0..reps[0].len())
        .map(|i| {
            let step = reps
                .iter()
                .map(|r| r[i].schedule_time.as_secs_f64())
                .fold(0.0, f64::max);
            reps.iter()
                .map(|r| 1.0 - r[i].busy.as_secs_f64() / step)
                .sum::<f64>()
                / reps.len() as f64
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(json: Option<&str>) -> Result<()> {
    let mut rows = Vec::new();
    println!(
        "## Bubble fraction (synthetic stages: 2 ms forward, 4 ms backward per micro-batch)\n"
    );
    println!("| p | m | textbook | GPipe measured | 1F1B measured |");
    println!("|---|---|---|---|---|");
    for p in [2usize, 4] {
        for m in 1..=16usize {
            let mut cells = Vec::new();
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let cfg = PipelineConfig {
                    schedule,
                    micro_batches: m,
                    zero: false,
                };
                let reps = pipeline_steps(p, cfg, 4 * m, &[16; 4], 3, |s| {
                    let (fc, vars) = mlp_stage(&[16, 16], 0..1, s as u64)?;
                    Ok((SleepStage { fc }, vars))
                })?;
                let b = median(bubbles(&reps));
                rows.push(serde_json::json!({
                    "p": p, "m": m, "schedule": schedule.name(),
                    "measured": b, "textbook": textbook_bubble(p, m),
                }));
                cells.push(b);
            }
            println!(
                "| {p} | {m} | {:.1} % | {:.1} % | {:.1} % |",
                textbook_bubble(p, m) * 100.0,
                cells[0] * 100.0,
                cells[1] * 100.0
            );
        }
    }

    println!("\n## Peak live activations per stage (p = 4, m = 8; micro-batches held at once)\n");
    println!("| schedule | stage 0 | stage 1 | stage 2 | stage 3 |");
    println!("|---|---|---|---|---|");
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let cfg = PipelineConfig {
            schedule,
            micro_batches: 8,
            zero: false,
        };
        let reps = pipeline_steps(4, cfg, 32, &[16; 4], 1, |s| {
            Ok(mlp_stage(&[16, 16], 0..1, s as u64)?)
        })?;
        let peaks: Vec<String> = reps.iter().map(|r| r[0].peak_live.to_string()).collect();
        println!("| {} | {} |", schedule.name(), peaks.join(" | "));
    }

    println!(
        "\n## Optimizer-state bytes per rank, Adam, MLP 784-512-256-128-10 (535,818 parameters)\n"
    );
    println!("| N | plain (Zero unsharded) | ZeRO-1 | ratio |");
    println!("|---|---|---|---|");
    let widths = [784, 512, 256, 128, 10];
    for n in [1usize, 2, 4] {
        let bytes = |sharded: bool| -> Result<usize> {
            let v = on_threads(n, |c| {
                let (_, vars) = mlp_stage(&widths, 0..4, 0)?;
                let mut z = Zero::new(Some(c), vars, Adam::new(0.0), sharded)?;
                Ok(z.optimizer_state_bytes())
            })?;
            Ok(v.into_iter().max().unwrap_or(0))
        };
        let (whole, shard) = (bytes(false)?, bytes(true)?);
        println!(
            "| {n} | {whole} | {shard} | {:.3} |",
            shard as f64 / whole as f64
        );
    }

    println!("\n## Step time against micro-batches, 2-stage split (real compute, MLP 784-1024x3-10, batch 256)\n");
    let widths = [784, 1024, 1024, 1024, 10];
    let split = even_split(4, 2)?;
    let one = on_threads(1, |c| {
        let (model, vars) = mlp_stage(&widths, 0..4, 0)?;
        let mut ddp = Ddp::from_vars(c, vars, Sgd::new(0.0, 0.0), DdpConfig::default())?;
        let x = Tensor::ones((256, 784), candle_core::DType::F32, &Device::Cpu).map_err(ce)?;
        let mut t = Vec::new();
        for i in 0..6 {
            let s = Instant::now();
            let l = model
                .forward(&x)
                .and_then(|o| o.sqr()?.mean_all())
                .map_err(ce)?;
            ddp.backward(&l)?;
            ddp.step(1e-3)?;
            if i > 0 {
                t.push(s.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(median(t))
    })?[0];
    println!("one process, whole model: {one:.1} ms per step\n");
    println!(
        "| m | GPipe ms | 1F1B ms | GPipe / one process | measured bubble (GPipe) | textbook |"
    );
    println!("|---|---|---|---|---|---|");
    for m in [1usize, 2, 4, 8, 16] {
        let mut cells = Vec::new();
        let mut bubble = 0.0;
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let cfg = PipelineConfig {
                schedule,
                micro_batches: m,
                zero: false,
            };
            let ins = [widths[split[0].start], widths[split[1].start]];
            let reps = pipeline_steps(2, cfg, 256, &ins, 5, |s| {
                Ok(mlp_stage(&widths, split[s].clone(), 0)?)
            })?;
            let t: Vec<f64> = (0..reps[0].len())
                .map(|i| {
                    reps.iter()
                        .map(|r| r[i].schedule_time.as_secs_f64())
                        .fold(0.0, f64::max)
                        * 1e3
                })
                .collect();
            if schedule == Schedule::GPipe {
                bubble = median(bubbles(&reps));
            }
            cells.push(median(t));
        }
        println!(
            "| {m} | {:.1} | {:.1} | {:.2} | {:.1} % | {:.1} % |",
            cells[0],
            cells[1],
            cells[0] / one,
            bubble * 100.0,
            textbook_bubble(2, m) * 100.0
        );
    }
    if let Some(path) = json {
        let v = serde_json::json!({"tool": "pipeline-bubble", "rows": rows});
        std::fs::write(
            path,
            serde_json::to_vec_pretty(&v).map_err(|e| Error::InvalidArgument(e.to_string()))?,
        )
        .map_err(|e| Error::io(format!("writing {path}"), e))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1));
    match run(json.map(String::as_str)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline_bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
