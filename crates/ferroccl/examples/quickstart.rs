//! The book's first program (docs/book/src/library/collectives.md includes it, and the
//! README shows the same lines; a test keeps them equal): a blocking all-reduce and a
//! non-blocking one, on every rank a launcher starts. CI runs it under
//! `ferroccl launch -n 2`.
//!
//! ```sh
//! ferroccl launch -n 2 -- cargo run -p ferroccl --example quickstart
//! ```

// ANCHOR: quickstart
use ferroccl::{Communicator, ReduceOp};

fn main() -> ferroccl::Result<()> {
    let comm = Communicator::from_env()?; // rank, world size, rendezvous: the launcher's
    let mut grads = vec![comm.rank() as f32; 1 << 20];
    comm.all_reduce(&mut grads, ReduceOp::Avg)?; // blocking: every rank has the mean
    let mut bucket = vec![1.5f32; 4096];
    comm.scope(|s| {
        // Non-blocking: the backward pass of the next layers runs here meanwhile.
        let pending = s.all_reduce(&mut bucket, ReduceOp::Sum)?;
        pending.wait().map(|_| ())
    })?;
    let (rank, n) = (comm.rank(), comm.world_size());
    println!("rank {rank}/{n}: mean {}, sum {}", grads[0], bucket[0]);
    check(&comm, &grads, &bucket)
}
// ANCHOR_END: quickstart

/// Every rank ends with the same bits: the mean of the ranks' numbers, and n times 1.5.
fn check(comm: &Communicator, grads: &[f32], bucket: &[f32]) -> ferroccl::Result<()> {
    let n = comm.world_size() as f32;
    assert!(grads.iter().all(|&x| x == (n - 1.0) / 2.0), "mean");
    assert!(bucket.iter().all(|&x| x == 1.5 * n), "sum");
    Ok(())
}
