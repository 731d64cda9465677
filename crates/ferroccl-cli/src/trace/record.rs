//! Writing the dumps: `bench --trace DIR`, `train --trace DIR`.

use ferroccl::trace::TRACE_DIR_ENV;
use ferroccl::{Communicator, ReduceOp};
use std::path::Path;
// ---------------------------------------------------------------------------------
// Writing the dumps: `bench --trace DIR`, `train --trace DIR`.

/// Makes every communicator this process creates dump into `dir` on failure, on drop
/// and at exit (through `FERROCCL_TRACE_DIR`, which ranks started as child processes
/// inherit). `fresh`: this process owns the whole job (it starts its ranks itself), so
/// dumps of an earlier run left in `dir` are removed first. Call it before any
/// communicator (and so any thread) exists: it sets an environment variable.
pub fn record_into(dir: &Path, fresh: bool) -> ferroccl::Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ferroccl::Error::io(format!("creating {}", dir.display()), e))?;
    if fresh {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| ferroccl::Error::io(format!("reading {}", dir.display()), e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("rank-") && name.ends_with(".jsonl") {
                std::fs::remove_file(e.path()).map_err(|err| {
                    ferroccl::Error::io(format!("removing {}", e.path().display()), err)
                })?;
            }
        }
    }
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    // Edition 2021: a safe fn; called while this process has no other thread.
    std::env::set_var(TRACE_DIR_ENV, abs);
    Ok(())
}

/// The end of one rank's run with `--trace DIR`: dumps its flight recorder into `dir`,
/// counts over the ranks whose dumps were written, and rank 0 says where they are.
/// Returns `r` unchanged: tracing never changes a run's outcome. After a failure
/// (`r` is an error or the communicator is poisoned) no collective is attempted.
pub fn finish<T, E>(c: &Communicator, dir: Option<&Path>, r: Result<T, E>) -> Result<T, E> {
    let Some(dir) = dir else {
        return r;
    };
    let dumped = c.dump_trace(dir);
    if let Err(e) = &dumped {
        eprintln!("rank {}: trace: {e}", c.rank());
    }
    if r.is_err() || c.poisoned().is_some() {
        return r;
    }
    let mut k = [i64::from(dumped.is_ok())];
    match c.all_reduce(&mut k, ReduceOp::Sum) {
        Ok(()) if c.rank() == 0 => {
            let n = c.world_size();
            let written = if k[0] == n as i64 {
                format!("{n} ranks")
            } else {
                format!("{} of {n} ranks", k[0])
            };
            println!(
                "trace: {written} written to {}; view with `ferroccl trace {}`",
                dir.display(),
                dir.display()
            );
        }
        Ok(()) => {}
        Err(e) => eprintln!("rank {}: trace: counting the dumps: {e}", c.rank()),
    }
    r
}
