//! The `ferroccl` command line: `bench`, `launch`, `plan`, `plot`, `trace`, `train`.

/// `$f::<T>(args)` with `T` the Rust type of the `DataType` `$dtype`; an error for a
/// type this binary does not know.
macro_rules! with_dtype {
    ($dtype:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        ferroccl::reduce::by_dtype!($dtype, T => $f::<T>($($arg),*), other => Err(
            ferroccl::Error::InvalidArgument(format!("unsupported dtype {other}"))
        ))
    };
}

mod args;
mod bench;
mod error;
mod gpu_check;
mod launch;
mod law;
mod plan;
mod plot;
mod simulate;
mod trace;
#[cfg(feature = "candle")]
mod train;

use clap::{Parser, Subcommand};
use std::io::Write as _;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferroccl",
    version,
    about = "Collective communication: benchmarks and a local launcher"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure a collective: the nccl-tests table (time, algbw, busbw, #wrong) plus the
    /// payload bytes each rank sent against the ring law.
    Bench(bench::BenchArgs),
    /// Start N local processes with the launcher environment set (RANK, WORLD_SIZE, ...).
    Launch(launch::LaunchArgs),
    /// The arithmetic of a data-parallel run (batch, lr, throughput, epoch time, ring
    /// all-reduce cost on a link), each line with its formula.
    Plan(plan::PlanArgs),
    /// SVG plots from bench and compare-peers JSON files: busbw against size, and
    /// measured against ring-law time for `bench --law` files.
    Plot(plot::PlotArgs),
    /// Predict the all-reduce algorithms' times at any scale by playing their real plans on a model network
    Simulate(simulate::SimulateArgs),
    /// Merge the flight recorder's dumps of all ranks (DIR/rank-N.jsonl) into a
    /// Perfetto/Chrome trace, and report stragglers and, for a failed or hung job, who
    /// waited for whom.
    Trace(trace::TraceArgs),
    /// Data-parallel training of a small CNN on MNIST-format digits: sharded data,
    /// bucketed all-reduce overlapped with backward, LR scaling and warmup, mixed
    /// precision, checkpoints and resume; `--scaling 1,2,4` for a scaling report.
    #[cfg(feature = "candle")]
    Train(train::TrainArgs),
    /// GPU validation (feature `cuda`; run through tools/gpu-check on a GPU host):
    /// kernels against the CPU f64 reference, kernel vs copy bandwidth, CUDA-IPC
    /// all-reduce with 2, 4 and 8 ranks on one GPU. One table, plus JSON.
    GpuCheck(gpu_check::GpuCheckArgs),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let (name, r) = match cli.command {
        Command::Bench(a) => ("bench", bench::main(a)),
        Command::Launch(a) => ("launch", launch::main(a)),
        Command::Plan(a) => ("plan", plan::main(a)),
        Command::Plot(a) => ("plot", plot::main(a)),
        Command::Simulate(a) => ("simulate", simulate::main(a)),
        Command::Trace(a) => ("trace", trace::main(a)),
        #[cfg(feature = "candle")]
        Command::Train(a) => ("train", train::main(a)),
        Command::GpuCheck(a) => ("gpu-check", gpu_check::main(a)),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        // It ran, and found wrong results.
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            // Not in the middle of a rank's line the launcher forwards.
            let _guard = launch::lock_output();
            // Whatever stderr is (closed, a full pipe), the exit status still says it.
            let _ = writeln!(std::io::stderr().lock(), "ferroccl {name}: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: warnings).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}
