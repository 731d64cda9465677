//! Four ranks as threads of this process: all-reduce, broadcast, reduce-scatter and
//! all-gather over in-process links, each result checked against its definition.
//!
//! ```sh
//! cargo run -p ferroccl --example threads
//! ```

use ferroccl::{Communicator, Config, ReduceOp};

fn main() -> ferroccl::Result<()> {
    let n = 4;
    let comms = Communicator::local_group(n, &Config::default())?;
    let results: Vec<ferroccl::Result<String>> = std::thread::scope(|t| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| t.spawn(move || rank_main(&comm)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    });
    for r in results {
        println!("{}", r?);
    }
    Ok(())
}

fn rank_main(comm: &Communicator) -> ferroccl::Result<String> {
    let (r, n) = (comm.rank(), comm.world_size());

    // Every rank contributes r+1 in every element; every rank ends with the same sum.
    let mut grads = vec![(r + 1) as f32; 1 << 20];
    comm.all_reduce(&mut grads, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    assert!(grads.iter().all(|&x| x == want));

    // Rank 0's weights reach everyone.
    let mut weights: Vec<f64> = (0..8)
        .map(|i| if r == 0 { i as f64 } else { -1.0 })
        .collect();
    comm.broadcast(&mut weights, 0)?;
    assert_eq!(weights, (0..8).map(f64::from).collect::<Vec<_>>());

    // Reduce-scatter: block q of every rank's input, summed, lands on rank q.
    let send: Vec<i64> = (0..(n * 3) as i64).collect();
    let mut mine = vec![0i64; 3];
    comm.reduce_scatter(&send, &mut mine, ReduceOp::Sum)?;
    let block = (3 * r) as i64;
    assert_eq!(
        mine,
        vec![
            n as i64 * block,
            n as i64 * (block + 1),
            n as i64 * (block + 2)
        ]
    );

    // All-gather: everyone's rank, in rank order.
    let mut all = vec![0u8; n];
    comm.all_gather(&[r as u8], &mut all)?;
    assert_eq!(all, (0..n as u8).collect::<Vec<_>>());

    Ok(format!(
        "rank {r} of {n}: all_reduce {} ok, broadcast ok, reduce_scatter {mine:?}, all_gather {all:?}",
        grads[0]
    ))
}
