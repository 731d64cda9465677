//! The collective checks shared by the test files: each runs one case on a chosen
//! net and compares every rank's result with the f64 reference.

use super::{close, input, reference, run, test_config, Net};
use ferroccl::{Config, Element, ReduceOp};
use std::mem::size_of;
use std::time::Duration;

/// Deadline of one case.
pub const DEADLINE: Duration = Duration::from_secs(60);

pub fn cfg(seg_elems: usize, esize: usize) -> Config {
    let mut c = test_config();
    c.tuning.segment_bytes = seg_elems * esize;
    c
}

/// [`cfg`], with broadcast and reduce down a binary tree (`FERROCCL_ALGO=tree`) when
/// `tree`, along the chain otherwise.
pub fn rooted_cfg(seg_elems: usize, esize: usize, tree: bool) -> Config {
    let mut c = cfg(seg_elems, esize);
    if tree {
        c.tuning.all_reduce_algo = ferroccl::AllReduceAlgo::Tree;
    }
    c
}

/// Per-rank block sizes for the v-variants: varied, some empty.
pub fn counts(n: usize, total: usize, seed: u64) -> Vec<usize> {
    let mut w: Vec<usize> = (0..n)
        .map(|r| (super::splitmix(seed ^ r as u64) % 5) as usize)
        .collect();
    let sum: usize = w.iter().sum::<usize>().max(1);
    let mut c: Vec<usize> = w.iter_mut().map(|x| *x * total / sum).collect();
    let rest = total - c.iter().sum::<usize>();
    c[0] += rest;
    c
}

// ---- reduce_scatter ----

pub fn check_reduce_scatter<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    seg: usize,
    seed: u64,
    v: bool,
) -> Result<(), String> {
    check_reduce_scatter_with::<T>(net, n, count, op, &cfg(seg, size_of::<T>()), seed, v)
}

/// [`check_reduce_scatter`] with the configuration `c`.
pub fn check_reduce_scatter_with<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    c: &Config,
    seed: u64,
    v: bool,
) -> Result<(), String> {
    if op == ReduceOp::Avg && !T::DTYPE.is_float() {
        return Ok(());
    }
    let cs = if v {
        counts(n, count, seed)
    } else {
        vec![count / n; n]
    };
    let total: usize = cs.iter().sum();
    let cs2 = cs.clone();
    let res = run(n, net, c, DEADLINE, move |c| {
        let send = input::<T>(seed, c.rank(), total, op);
        let mut recv = vec![T::default(); cs2[c.rank()]];
        if v {
            c.reduce_scatterv(&send, &mut recv, &cs2, op)?;
        } else {
            c.reduce_scatter(&send, &mut recv, op)?;
        }
        Ok(recv)
    })
    .map_err(|e| e.to_string())?;
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(seed, r, total, op)).collect();
    let mut start = 0;
    for (r, got) in res.iter().enumerate() {
        for (k, g) in got.iter().enumerate() {
            let i = start + k;
            let xs: Vec<f64> = inputs.iter().map(|v| v[i].to_f64()).collect();
            let (want, scale) = reference(op, &xs);
            if !close(*g, want, scale, n) {
                return Err(format!("reduce_scatter {} {op} n={n} counts={cs:?}: rank {r} element {k} is {g:?}, reference {want}", T::DTYPE));
            }
        }
        start += cs[r];
    }
    Ok(())
}

// ---- all_gather ----

pub fn check_all_gather<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    seg: usize,
    seed: u64,
    v: bool,
) -> Result<(), String> {
    check_all_gather_with::<T>(net, n, count, &cfg(seg, size_of::<T>()), seed, v)
}

/// [`check_all_gather`] with the configuration `c`.
pub fn check_all_gather_with<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    c: &Config,
    seed: u64,
    v: bool,
) -> Result<(), String> {
    let cs = if v {
        counts(n, count, seed)
    } else {
        vec![count / n; n]
    };
    let cs2 = cs.clone();
    let res = run(n, net, c, DEADLINE, move |c| {
        let send = input::<T>(seed, c.rank(), cs2[c.rank()], ReduceOp::Sum);
        let mut recv = vec![T::default(); cs2.iter().sum()];
        if v {
            c.all_gatherv(&send, &mut recv, &cs2)?;
        } else {
            c.all_gather(&send, &mut recv)?;
        }
        Ok(recv)
    })
    .map_err(|e| e.to_string())?;
    let want: Vec<T> = (0..n)
        .flat_map(|r| input::<T>(seed, r, cs[r], ReduceOp::Sum))
        .collect();
    for (r, got) in res.iter().enumerate() {
        if bytemuck::cast_slice::<T, u8>(got) != bytemuck::cast_slice::<T, u8>(&want) {
            return Err(format!(
                "all_gather {} n={n} counts={cs:?}: rank {r} differs",
                T::DTYPE
            ));
        }
    }
    Ok(())
}

// ---- broadcast ----

pub fn check_broadcast<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    root: usize,
    seg: usize,
    seed: u64,
    tree: bool,
) -> Result<(), String> {
    let res = run(
        n,
        net,
        &rooted_cfg(seg, size_of::<T>(), tree),
        DEADLINE,
        move |c| {
            let mut buf = input::<T>(seed, c.rank(), count, ReduceOp::Sum);
            c.broadcast(&mut buf, root)?;
            Ok(buf)
        },
    )
    .map_err(|e| e.to_string())?;
    let want = input::<T>(seed, root, count, ReduceOp::Sum);
    for (r, got) in res.iter().enumerate() {
        if bytemuck::cast_slice::<T, u8>(got) != bytemuck::cast_slice::<T, u8>(&want) {
            return Err(format!(
                "broadcast {} n={n} count={count} root={root} tree={tree}: rank {r} differs",
                T::DTYPE
            ));
        }
    }
    Ok(())
}

// ---- reduce ----

#[allow(clippy::too_many_arguments)]
pub fn check_reduce<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    root: usize,
    seg: usize,
    seed: u64,
    tree: bool,
) -> Result<(), String> {
    if op == ReduceOp::Avg && !T::DTYPE.is_float() {
        return Ok(());
    }
    let res = run(
        n,
        net,
        &rooted_cfg(seg, size_of::<T>(), tree),
        DEADLINE,
        move |c| {
            let send = input::<T>(seed, c.rank(), count, op);
            let mut recv = vec![T::default(); count];
            c.reduce_into(&send, &mut recv, op, root)?;
            // The input is untouched on every rank.
            assert!(send == input::<T>(seed, c.rank(), count, op));
            Ok(recv)
        },
    )
    .map_err(|e| e.to_string())?;
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(seed, r, count, op)).collect();
    for i in 0..count {
        let xs: Vec<f64> = inputs.iter().map(|v| v[i].to_f64()).collect();
        let (want, scale) = reference(op, &xs);
        let g = res[root][i];
        if !close(g, want, scale, n) {
            return Err(format!(
                "reduce {} {op} n={n} root={root} tree={tree}: element {i} is {g:?}, reference {want}",
                T::DTYPE
            ));
        }
    }
    Ok(())
}

// ---- all_reduce ----

/// All-reduce of `count` elements: every rank matches the reference and rank 0
/// bitwise. `small` forces recursive doubling (true) or the ring (false).
pub fn check_all_reduce<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    seg: usize,
    seed: u64,
    small: bool,
) -> Result<(), String> {
    if op == ReduceOp::Avg && !T::DTYPE.is_float() {
        return Ok(());
    }
    let mut c = cfg(seg, size_of::<T>());
    c.tuning.small_message_bytes = if small { u32::MAX as usize } else { 0 };
    check_all_reduce_with::<T>(net, n, count, op, &c, seed)
}

/// [`check_all_reduce`] with the configuration `c` (an algorithm forced, say).
pub fn check_all_reduce_with<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    c: &Config,
    seed: u64,
) -> Result<(), String> {
    if op == ReduceOp::Avg && !T::DTYPE.is_float() {
        return Ok(());
    }
    let res = run(n, net, c, DEADLINE, move |c| {
        let mut v = input::<T>(seed, c.rank(), count, op);
        c.all_reduce(&mut v, op)?;
        Ok(v)
    })
    .map_err(|e| e.to_string())?;
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(seed, r, count, op)).collect();
    for i in 0..count {
        let xs: Vec<f64> = inputs.iter().map(|v| v[i].to_f64()).collect();
        let (want, scale) = reference(op, &xs);
        let g = res[0][i];
        if !close(g, want, scale, n) {
            return Err(format!(
                "all_reduce {} {op} n={n} count={count}: element {i} is {g:?}, reference {want}",
                T::DTYPE
            ));
        }
    }
    for (r, v) in res.iter().enumerate() {
        if bytemuck::cast_slice::<T, u8>(v) != bytemuck::cast_slice::<T, u8>(&res[0]) {
            return Err(format!("all_reduce: rank {r} differs bitwise from rank 0"));
        }
    }
    Ok(())
}
