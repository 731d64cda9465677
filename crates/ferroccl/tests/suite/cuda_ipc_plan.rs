//! The CUDA-IPC ring's schedule ([`plan::ring`]) run on threads over host memory: each
//! rank a thread, each workspace chunk tagged with the phase that last wrote it (a
//! seqlock), waits on per-rank progress counters as the GPU ring waits on its
//! neighbours' counters and events. Every read of a neighbour's chunk checks, before
//! and after, that it holds exactly what the schedule says it holds — so a missing
//! wait (read-after-write or write-after-read, within a call or across calls) is
//! caught — and the results are checked. Random delays shuffle the interleavings. No
//! GPU needed; the GPU path runs the same plan (`IpcRing::all_reduce`).

use ferroccl::transport::cuda_ipc::plan::{self, Action, Phase};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Elements per chunk.
const E: usize = 3;
const DEADLINE: Duration = Duration::from_secs(20);

struct Rank {
    ws: Vec<AtomicU64>,
    /// Per chunk: 2·(phase id) when written by that phase, odd while being written.
    tag: Vec<AtomicU64>,
    counter: AtomicU64,
}

fn input(call: usize, r: usize, i: usize) -> u64 {
    ((i * 7 + r * 13 + call * 5) % 17) as u64
}

/// Which collective a simulated call runs (the plans `IpcRing` runs for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    /// From this root.
    Broadcast(usize),
    /// To this root.
    Reduce(usize),
}

impl Kind {
    fn plan(self, r: usize, n: usize) -> Vec<Phase> {
        match self {
            Kind::AllReduce => plan::ring(r, n),
            Kind::ReduceScatter => plan::reduce_scatter(r, n),
            Kind::AllGather => plan::all_gather(r, n),
            Kind::Broadcast(root) => plan::broadcast(r, n, root),
            Kind::Reduce(root) => plan::reduce(r, n, root),
        }
    }
    /// The same call with its root taken modulo `n` (so one list serves every n).
    fn for_ranks(self, n: usize) -> Self {
        match self {
            Kind::Broadcast(root) => Kind::Broadcast(root % n),
            Kind::Reduce(root) => Kind::Reduce(root % n),
            k => k,
        }
    }
    /// Phases every rank counts for one call (the longest plan).
    fn span(self, n: usize) -> usize {
        plan::span(|q| self.plan(q, n), n)
    }
    /// In place: the output starts as the input.
    fn in_place(self) -> bool {
        !matches!(self, Kind::ReduceScatter | Kind::AllGather)
    }
    /// Where workspace chunk `c` is in rank `r`'s input / output (element offsets).
    fn input_at(self, r: usize, c: usize) -> Option<usize> {
        match self {
            Kind::AllGather => (c == r).then_some(0),
            Kind::Broadcast(root) if r != root => None,
            _ => Some(c * E),
        }
    }
    fn output_at(self, r: usize, c: usize) -> Option<usize> {
        match self {
            Kind::ReduceScatter => (c == r).then_some(0),
            Kind::Broadcast(root) if r == root => None,
            Kind::Reduce(root) if r != root => None,
            _ => Some(c * E),
        }
    }
    fn input(self, k: usize, r: usize, n: usize) -> Vec<u64> {
        let len = if self == Kind::AllGather { E } else { n * E };
        (0..len).map(|i| input(k, r, i)).collect()
    }
    fn expected(self, k: usize, r: usize, n: usize) -> Vec<u64> {
        let sum = |i: usize| (0..n).map(|q| input(k, q, i)).sum::<u64>();
        match self {
            Kind::AllReduce => (0..n * E).map(sum).collect(),
            Kind::ReduceScatter => (0..E).map(|e| sum(r * E + e)).collect(),
            Kind::AllGather => (0..n * E).map(|i| input(k, i / E, i % E)).collect(),
            Kind::Broadcast(root) => (0..n * E).map(|i| input(k, root, i)).collect(),
            Kind::Reduce(root) if r == root => (0..n * E).map(sum).collect(),
            Kind::Reduce(_) => (0..n * E).map(|i| input(k, r, i)).collect(),
        }
    }
}

/// Runs one call of each of `kinds` in turn (integer sums) over `n` ranks with
/// `plan_of(kind, rank, n)` as the schedule, sleeping `delay(rank, call, phase)`
/// before each phase. Err: what went wrong first.
fn simulate(
    n: usize,
    kinds: &[Kind],
    plan_of: impl Fn(Kind, usize, usize) -> Vec<Phase> + Sync,
    delay: impl Fn(usize, usize, usize) -> Duration + Sync,
) -> Result<(), String> {
    let ranks: Vec<Rank> = (0..n)
        .map(|_| Rank {
            ws: (0..n * E).map(|_| AtomicU64::new(0)).collect(),
            tag: (0..n).map(|_| AtomicU64::new(0)).collect(),
            counter: AtomicU64::new(0),
        })
        .collect();
    let failed = AtomicBool::new(false);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (ranks, failed, plan_of, delay) = (&ranks, &failed, &plan_of, &delay);
                s.spawn(move || -> Result<(), String> {
                    let me = &ranks[r];
                    let left = &ranks[(r + n - 1) % n];
                    let right = &ranks[(r + 1) % n];
                    let start = Instant::now();
                    let wait = |who: &Rank, id: i64| -> Result<(), String> {
                        while (who.counter.load(Ordering::Acquire) as i64) < id {
                            if failed.load(Ordering::Relaxed) {
                                return Err("another rank failed".into());
                            }
                            if start.elapsed() > DEADLINE {
                                return Err(format!("rank {r}: deadlock waiting for phase id {id}"));
                            }
                            std::thread::yield_now();
                        }
                        Ok(())
                    };
                    let fail = |m: String| {
                        failed.store(true, Ordering::Relaxed);
                        Err(m)
                    };
                    // Phases published so far, over all calls.
                    let mut done = 0i64;
                    for (k, &kind) in kinds.iter().enumerate() {
                        let kind = kind.for_ranks(n);
                        let user = kind.input(k, r, n);
                        let want = kind.expected(k, r, n);
                        let mut out = if kind.in_place() {
                            user.clone()
                        } else {
                            vec![u64::MAX; want.len()]
                        };
                        if n == 1 {
                            // IpcRing::run copies input to output and exchanges nothing.
                            if let (Some(i), Some(o)) = (kind.input_at(0, 0), kind.output_at(0, 0)) {
                                out[o..o + E].copy_from_slice(&user[i..i + E]);
                            }
                        }
                        let plan = plan_of(kind, r, n);
                        let base = done + 1;
                        for (p, ph) in plan.iter().enumerate() {
                            std::thread::sleep(delay(r, k, p));
                            if let Some(w) = ph.wait_right {
                                wait(right, base + w)?;
                            }
                            if let Some(w) = ph.wait_left {
                                wait(left, base + w)?;
                            }
                            let id = (base + p as i64) as u64;
                            // Reads left's chunk c, which must be exactly what left's phase
                            // `wait_left` of this call wrote, for the whole read.
                            let read_left = |c: usize| -> Result<Vec<u64>, String> {
                                let want = 2 * (base + ph.wait_left.unwrap_or(0)) as u64;
                                let before = left.tag[c].load(Ordering::Acquire);
                                let v: Vec<u64> = (0..E)
                                    .map(|e| left.ws[c * E + e].load(Ordering::Relaxed))
                                    .collect();
                                std::thread::yield_now();
                                let after = left.tag[c].load(Ordering::Acquire);
                                if before != want || after != want {
                                    return Err(format!(
                                        "rank {r} call {k} ({kind:?}) phase {p} ({:?}): left's chunk {c} tagged {before}/{after}, expected {want}",
                                        ph.action
                                    ));
                                }
                                Ok(v)
                            };
                            let write = |c: usize, v: &[u64]| {
                                me.tag[c].store(2 * id + 1, Ordering::Release);
                                for (e, x) in v.iter().enumerate() {
                                    me.ws[c * E + e].store(*x, Ordering::Relaxed);
                                }
                                std::thread::yield_now();
                                me.tag[c].store(2 * id, Ordering::Release);
                            };
                            let mine = |c: usize| -> Vec<u64> {
                                (0..E).map(|e| me.ws[c * E + e].load(Ordering::Relaxed)).collect()
                            };
                            let mut output = |c: usize, v: &[u64]| {
                                if let Some(o) = kind.output_at(r, c) {
                                    out[o..o + E].copy_from_slice(v);
                                }
                            };
                            match ph.action {
                                Action::CopyIn { chunk } => {
                                    for c in (0..n).filter(|&c| chunk.is_none_or(|only| only == c)) {
                                        let Some(i) = kind.input_at(r, c) else { continue };
                                        write(c, &user[i..i + E]);
                                        if chunk.is_some() {
                                            output(c, &user[i..i + E]);
                                        }
                                    }
                                }
                                Action::Reduce { chunk: c, last } => {
                                    let theirs = match read_left(c) {
                                        Ok(v) => v,
                                        Err(m) => return fail(m),
                                    };
                                    let sum: Vec<u64> =
                                        mine(c).iter().zip(&theirs).map(|(a, b)| a + b).collect();
                                    write(c, &sum);
                                    if last {
                                        output(c, &sum);
                                    }
                                }
                                Action::Gather { chunk: c } => {
                                    let theirs = match read_left(c) {
                                        Ok(v) => v,
                                        Err(m) => return fail(m),
                                    };
                                    write(c, &theirs);
                                    output(c, &theirs);
                                }
                            }
                            me.counter.store(id, Ordering::Release);
                        }
                        // As IpcRing::run: a shorter plan still publishes the call's end.
                        let span = kind.span(n) as i64;
                        me.counter.store((base + span - 1) as u64, Ordering::Release);
                        done += span;
                        if out != want {
                            return fail(format!("rank {r} call {k} ({kind:?}): got {out:?}, expected {want:?}"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    // The first real failure, not a rank that stopped because another failed.
    let errs: Vec<String> = results.into_iter().filter_map(|r| r.err()).collect();
    match errs.iter().find(|e| *e != "another rank failed") {
        Some(e) => Err(e.clone()),
        None => errs.into_iter().next().map_or(Ok(()), Err),
    }
}

fn jitter(seed: u64) -> impl Fn(usize, usize, usize) -> Duration + Sync {
    move |r, k, p| {
        let mut x = seed ^ ((r as u64) << 40) ^ ((k as u64) << 20) ^ p as u64;
        x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^= x >> 31;
        Duration::from_micros(x % 300)
    }
}

#[test]
fn the_plans_are_correct_under_random_interleavings() {
    use Kind::*;
    // Each kind repeated, and the kinds mixed (phase numbers run on across calls).
    let seqs: [&[Kind]; 4] = [
        &[AllReduce, AllReduce, AllReduce],
        &[ReduceScatter, ReduceScatter],
        &[AllGather, AllGather],
        &[
            AllReduce,
            ReduceScatter,
            AllGather,
            AllReduce,
            AllGather,
            ReduceScatter,
        ],
    ];
    for n in [1usize, 2, 3, 4, 5, 7, 8] {
        for (i, seq) in seqs.iter().enumerate() {
            for seed in 0..3 {
                simulate(n, seq, Kind::plan, jitter(seed + 10 * i as u64))
                    .unwrap_or_else(|e| panic!("n = {n}, {seq:?}, seed {seed}: {e}"));
            }
        }
    }
}

#[test]
fn the_plan_has_the_documented_shape() {
    for n in [2usize, 3, 8] {
        for r in 0..n {
            let p = plan::ring(r, n);
            assert_eq!(p.len(), 2 * (n - 1) + 1);
            assert_eq!(p[0].action, Action::CopyIn { chunk: None });
            // Every chunk is completed by exactly one last reduce, and gathered n-1 times
            // in all: each rank ends with every chunk.
            let last: Vec<usize> = p
                .iter()
                .filter_map(|ph| match ph.action {
                    Action::Reduce { chunk, last: true } => Some(chunk),
                    _ => None,
                })
                .collect();
            assert_eq!(last, vec![(r + 1) % n]);
            let mut have: Vec<usize> = p
                .iter()
                .filter_map(|ph| match ph.action {
                    Action::Gather { chunk } => Some(chunk),
                    _ => None,
                })
                .chain(last)
                .collect();
            have.sort_unstable();
            assert_eq!(have, (0..n).collect::<Vec<_>>());
        }
    }
}

/// The checker has teeth: without the copy-in's wait for the right neighbour, a fast
/// rank overwrites its workspace for the next call while its slow right neighbour is
/// still to gather from it, and the simulation says so.
#[test]
fn a_missing_cross_call_wait_is_caught() {
    let without = |kind: Kind, r: usize, n: usize| {
        let mut p = kind.plan(r, n);
        p[0].wait_right = None;
        p
    };
    // Rank 1 is slow before its all-gather phases; rank 0 races into the next call.
    let slow = |r: usize, _k: usize, p: usize| {
        if r == 1 && p >= 2 {
            Duration::from_millis(30)
        } else {
            Duration::ZERO
        }
    };
    let calls = [Kind::AllReduce; 3];
    let e =
        simulate(2, &calls, without, slow).expect_err("a write-after-read hazard must be caught");
    assert!(e.contains("tagged"), "{e}");
    // With the wait, the same timing is fine.
    simulate(2, &calls, Kind::plan, slow).unwrap();
}

/// Likewise without a reduce's wait for the left neighbour: a read before the left
/// neighbour has written is caught.
#[test]
fn a_missing_read_after_write_wait_is_caught() {
    let without = |kind: Kind, r: usize, n: usize| {
        let mut p = kind.plan(r, n);
        if let Some(ph) = p.get_mut(1) {
            ph.wait_left = None;
        }
        p
    };
    let slow = |r: usize, _k: usize, p: usize| {
        if r == 0 && p == 0 {
            Duration::from_millis(30)
        } else {
            Duration::ZERO
        }
    };
    for kind in [
        Kind::AllReduce,
        Kind::ReduceScatter,
        Kind::AllGather,
        Kind::Broadcast(0),
        Kind::Reduce(1),
    ] {
        let e = simulate(2, &[kind], without, slow)
            .expect_err("a read-after-write hazard must be caught");
        assert!(e.contains("tagged"), "{kind:?}: {e}");
        simulate(2, &[kind], Kind::plan, slow).unwrap();
    }
}
