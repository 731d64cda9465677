//! One process per rank, under whatever launcher started it: `torchrun`, `srun`,
//! `mpirun`, `ferroccl launch`. Run bare, it plays the launcher itself: it starts four
//! copies of itself with the variables torchrun sets (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and waits for them.
//!
//! ```sh
//! cargo run -p ferroccl --example launcher                 # 4 local ranks
//! ferroccl launch -n 3 -- target/debug/examples/launcher   # any launcher
//! torchrun --nproc-per-node 2 --no-python target/debug/examples/launcher
//! ```

use ferroccl::{Communicator, ReduceOp};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    match ferroccl::rendezvous::detect_env() {
        Ok(Some(_)) => match rank_main() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rank failed: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(None) => launch(4),
        Err(e) => {
            eprintln!("the launcher's environment is inconsistent: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What each rank runs.
fn rank_main() -> ferroccl::Result<()> {
    let comm = Communicator::from_env()?;
    let (r, n) = (comm.rank(), comm.world_size());
    let mut grads = vec![r as f32; 1 << 18];
    comm.all_reduce(&mut grads, ReduceOp::Avg)?;
    let want = (n - 1) as f32 / 2.0;
    if grads.iter().any(|&x| x != want) {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "rank {r}: all_reduce gave {}, expected {want}",
            grads[0]
        )));
    }
    comm.barrier()?;
    println!(
        "rank {r} of {n} (local rank {}): average of the ranks = {}",
        comm.local_rank(),
        grads[0]
    );
    Ok(())
}

/// Starts `n` copies of this program as the ranks of one job on this machine.
fn launch(n: usize) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot find this program: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A free port for rank 0's store: bind, read, release.
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("no free port: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("no launcher found: starting {n} ranks of this program (MASTER_PORT={port})");
    let token = ferroccl::rendezvous::new_token();
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("FERROCCL_TOKEN", &token)
                .spawn()
        })
        .collect();
    let mut ok = true;
    for (r, c) in children.into_iter().enumerate() {
        match c.and_then(|mut c| c.wait()) {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("rank {r} exited with {s}");
                ok = false;
            }
            Err(e) => {
                eprintln!("rank {r} could not run: {e}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
