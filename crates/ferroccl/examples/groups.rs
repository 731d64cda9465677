//! Groups and point-to-point: four ranks laid out as a 2 × 2 grid, the layout of a
//! job that is data-parallel one way and something else the other.
//!
//! ```text
//!            column 0   column 1
//!   row 0    rank 0     rank 1      all-reduce over each row
//!   row 1    rank 2     rank 3      (the row's data-parallel replicas)
//!            all-to-all over each column (an expert-parallel exchange),
//!            and a pipeline down each column: row 0 is stage 0, row 1 stage 1
//! ```
//!
//! Every rank checks what it gets. Run it as threads, or as processes under a
//! launcher (`ferroccl launch -n 4 -- target/release/examples/groups`):
//!
//! ```sh
//! cargo run --release -p ferroccl --example groups
//! ```

use ferroccl::{Communicator, Config, Error, ReduceOp, Result};

/// Micro-batches each column's pipeline moves, and the elements of one.
const MICRO: usize = 4;
const WIDTH: usize = 1 << 16;

fn rank_main(world: &Communicator) -> Result<String> {
    if world.world_size() != 4 {
        return Err(Error::InvalidArgument(format!(
            "the grid is 2 x 2: run 4 ranks, not {}",
            world.world_size()
        )));
    }
    let r = world.rank();
    let (row_of, col_of) = (r / 2, r % 2);
    // ANCHOR: splits
    // Collective over the world: every rank makes both splits, in the same order.
    let row = world
        .split(Some(row_of as u32), col_of as i64)?
        .expect("every rank has a row");
    let col = world
        .split(Some(col_of as u32), row_of as i64)?
        .expect("and a column");

    // 1. Over each row: average "gradients" (the row's replicas agree afterwards).
    let mut grads = vec![r as f32; 1000];
    row.all_reduce(&mut grads, ReduceOp::Avg)?;
    let want = (2 * row_of) as f32 + 0.5;
    assert!(grads.iter().all(|&g| g == want), "row all-reduce");

    // 2. Over each column: every rank sends block q to column rank q.
    let n = col.world_size();
    let tokens: Vec<i64> = (0..n * 8).map(|i| (100 * r + i / 8) as i64).collect();
    let mut routed = vec![0i64; n * 8];
    col.all_to_all(&tokens, &mut routed)?;
    for q in 0..n {
        let from = col.job_ranks()[q];
        let want = (100 * from + col.rank()) as i64;
        assert!(
            routed[q * 8..(q + 1) * 8].iter().all(|&x| x == want),
            "column all-to-all"
        );
    }
    // ANCHOR_END: splits

    // 3. A pipeline down each column: stage 0 sends micro-batch k's activations to
    //    stage 1 and receives its gradients back; stage 1 sends back micro-batch k's
    //    gradients while it receives micro-batch k + 1's activations, in one batch, so
    //    the two transfers overlap and neither stage waits on the other's order.
    let (stage, peer) = (col.rank(), 1 - col.rank());
    let act = |k: usize| vec![(k * 10 + col_of) as f32; WIDTH];
    let mut checked = 0;
    if stage == 0 {
        for k in 0..MICRO {
            let out = act(k);
            let mut grad = vec![0f32; WIDTH];
            col.p2p_batch(|b| {
                b.send(&out, peer, 2 * k as u32)
                    .recv(&mut grad, peer, 2 * k as u32 + 1);
            })?;
            assert!(grad.iter().zip(&out).all(|(g, a)| *g == -a), "gradient {k}");
            checked += 1;
        }
    } else {
        let mut cur = vec![0f32; WIDTH];
        col.recv(&mut cur, peer, 0)?;
        for k in 0..MICRO {
            assert!(cur == act(k), "activation {k}");
            let back: Vec<f32> = cur.iter().map(|&a| -a).collect();
            let mut next = vec![0f32; WIDTH];
            col.p2p_batch(|b| {
                b.send(&back, peer, 2 * k as u32 + 1);
                if k + 1 < MICRO {
                    b.recv(&mut next, peer, 2 * (k + 1) as u32);
                }
            })?;
            cur = next;
            checked += 1;
        }
    }
    Ok(format!(
        "rank {r} (row {row_of}, column {col_of}): row all-reduce {want}, column all-to-all \
         from ranks {:?}, {checked} micro-batches through the pipeline as stage {stage}",
        col.job_ranks()
    ))
}

fn main() -> Result<()> {
    if ferroccl::rendezvous::detect_env()?.is_some() {
        // Under a launcher: one process per rank.
        let comm = Communicator::from_env()?;
        println!("{}", rank_main(&comm)?);
        return Ok(());
    }
    let comms = Communicator::local_group(4, &Config::default())?;
    let out: Vec<Result<String>> = std::thread::scope(|t| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| t.spawn(move || rank_main(&c)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::InvalidArgument("a rank panicked".into())))
            })
            .collect()
    });
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}
