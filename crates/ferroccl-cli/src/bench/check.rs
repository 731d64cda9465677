//! The result checks: every rank's input is small integers, so the expected result of
//! every collective is exact in every type.

use super::Coll;
use ferroccl::{Element, ReduceOp};

/// Rank `r`'s input element `i`: small integers, so every reduction order gives the
/// exact same answer in every type and the check can be exact.
fn value(op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Prod => 1.0 + (i + r).is_multiple_of(7) as u8 as f64,
        _ => ((i * 7 + r * 13) % 17) as f64,
    }
}

fn expected(op: ReduceOp, n: usize, i: usize) -> f64 {
    let xs = (0..n).map(|r| value(op, r, i));
    match op {
        ReduceOp::Sum => xs.sum(),
        ReduceOp::Avg => xs.sum::<f64>() / n as f64,
        ReduceOp::Prod => xs.product(),
        ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
        _ => xs.fold(f64::NEG_INFINITY, f64::max),
    }
}

pub(super) fn fill<T: Element>(v: &mut [T], op: ReduceOp, r: usize, first: usize) {
    for (k, x) in v.iter_mut().enumerate() {
        *x = T::from_f64(value(op, r, first + k));
    }
}

fn wrong<T: Element>(x: T, want: f64) -> bool {
    let want = T::from_f64(want);
    if T::DTYPE.is_float() {
        let (g, w) = (x.to_f64(), want.to_f64());
        // Written so that a NaN result counts as wrong.
        let close = (g - w).abs() <= 1e-2 * w.abs().max(1.0);
        !close
    } else {
        x != want
    }
}

/// Wrong elements of this rank's result of `coll` over `count` elements (the whole
/// buffer's count; the rank's block for the blocked collectives is derived).
pub(super) fn count_wrong<T: Element>(
    coll: Coll,
    res: &[T],
    op: ReduceOp,
    n: usize,
    rank: usize,
    root: usize,
    count: usize,
) -> u64 {
    let block = count / n;
    let bad =
        |it: &mut dyn Iterator<Item = (T, f64)>| it.filter(|&(x, w)| wrong(x, w)).count() as u64;
    match coll {
        Coll::AllReduce => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, expected(op, n, i)))),
        Coll::ReduceScatter => bad(&mut res[..block]
            .iter()
            .enumerate()
            .map(|(k, &x)| (x, expected(op, n, rank * block + k)))),
        Coll::AllGather => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, i / block.max(1), i % block.max(1))))),
        Coll::Broadcast => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, root, i)))),
        Coll::Reduce if rank == root => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, expected(op, n, i)))),
        Coll::Reduce => 0,
        // Block q came from rank q's block for this rank.
        Coll::AllToAll => bad(&mut res[..count].iter().enumerate().map(|(i, &x)| {
            let (q, k) = (i / block.max(1), i % block.max(1));
            (x, value(ReduceOp::Sum, q, rank * block + k))
        })),
        Coll::Gather if rank == root => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, i / block.max(1), i % block.max(1))))),
        Coll::Gather => 0,
        Coll::Scatter => bad(&mut res[..block]
            .iter()
            .enumerate()
            .map(|(k, &x)| (x, value(ReduceOp::Sum, root, rank * block + k)))),
        Coll::SendRecv => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, (rank + n - 1) % n, i)))),
    }
}
