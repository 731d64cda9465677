//! The `ferroccl` command line: `bench`, `launch`.

mod launch;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ferroccl", version, about = "Collective communication: benchmarks and a local launcher")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start N local processes with the launcher environment set (RANK, WORLD_SIZE, ...).
    Launch(launch::LaunchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Launch(a) => launch::main(a),
    }
}
