//! The pull executor — what CUDA IPC runs on a GPU — over simulated memory peers: host
//! memory shared by threads, each rank's copies and combines run late and in random
//! order of time on a simulated stream, ordered across ranks only by published counters
//! and event waits ([`ferroccl::testing::SimMemParams`]), or, in device order, by
//! waits and counter writes that run on the streams themselves. Every collective computes its
//! definition and bitwise the same bytes as the push path; a mismatched call is
//! reported; a wait on a peer that does not come is interrupted by the abort handle and
//! by the timeout.

use crate::common;

use common::checks::{
    check_all_gather, check_all_reduce, check_all_reduce_with, check_broadcast, check_reduce,
    check_reduce_scatter,
};
use common::{all_errors, input, run, run_all, test_config, Net};
use ferroccl::testing::SimMemParams;
use ferroccl::{AllReduceAlgo, Clock, DataType, Error, ReduceOp};
use proptest::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}

fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

/// Random stream delays, host or device order.
fn any_sim() -> impl Strategy<Value = SimMemParams> {
    (0u64..150, any::<u64>(), any::<bool>()).prop_map(|(us, seed, device_order)| SimMemParams {
        max_delay: Duration::from_micros(us),
        seed,
        stall: None,
        device_order,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn all_reduce_over_memory_peers(n in 1usize..=8, count in 0usize..=3000, dt in any_dtype(),
                                    op in any_op(), p in any_sim(), seed in any::<u64>()) {
        let r = for_dtype!(dt, check_all_reduce(Net::MemSim(p), n, count, op, 64, seed, false));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// One-shot and two-shot (what symmetric shared memory runs): every dtype and
    /// operator, counts not divisible by `n` and 0, bitwise the same on every rank and
    /// the reference's value.
    #[test]
    fn one_and_two_shot_all_reduce_over_memory_peers(n in 1usize..=8, count in 0usize..=3000,
                                    dt in any_dtype(), op in any_op(), p in any_sim(),
                                    seed in any::<u64>(), two in any::<bool>()) {
        let mut c = common::checks::cfg(64, dt.size());
        c.tuning.all_reduce_algo = if two { AllReduceAlgo::TwoShot } else { AllReduceAlgo::OneShot };
        let r = for_dtype!(dt, check_all_reduce_with(Net::MemSim(p), n, count, op, &c, seed));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn reduce_scatter_over_memory_peers(n in 1usize..=8, count in 0usize..=3000, dt in any_dtype(),
                                        op in any_op(), p in any_sim(), seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_reduce_scatter(Net::MemSim(p), n, count, op, 64, seed, v));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn all_gather_over_memory_peers(n in 1usize..=8, count in 0usize..=3000, dt in any_dtype(),
                                    p in any_sim(), seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_all_gather(Net::MemSim(p), n, count, 64, seed, v));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn broadcast_over_memory_peers(n in 1usize..=8, count in 0usize..=3000, dt in any_dtype(),
                                   root in 0usize..8, p in any_sim(), seed in any::<u64>()) {
        let r = for_dtype!(dt, check_broadcast(Net::MemSim(p), n, count, root % n, 64, seed, false));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn reduce_over_memory_peers(n in 1usize..=8, count in 0usize..=3000, dt in any_dtype(), op in any_op(),
                                root in 0usize..8, p in any_sim(), seed in any::<u64>()) {
        let r = for_dtype!(dt, check_reduce(Net::MemSim(p), n, count, op, root % n, 64, seed, false));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// The pull executor runs the ring's plan, so its result is the push path's, bit for
/// bit (the same operands in the same order), for the non-associative float sums too.
#[test]
fn pulled_ring_equals_pushed_ring_bitwise() {
    for n in [2, 3, 5, 8] {
        let count = 10_007;
        let mut cfg = test_config();
        cfg.tuning.small_message_bytes = 0; // the ring on the push path too
        cfg.tuning.all_reduce_algo = AllReduceAlgo::Ring; // and on memory peers
        cfg.tuning.segment_bytes = 4096;
        let body = move |c: &mut ferroccl::Communicator| {
            let mut v = input::<f32>(7, c.rank(), count, ReduceOp::Avg);
            c.all_reduce(&mut v, ReduceOp::Avg)?;
            let mut h = input::<half::bf16>(8, c.rank(), count, ReduceOp::Sum);
            c.all_reduce(&mut h, ReduceOp::Sum)?;
            Ok((v, h))
        };
        let pushed = run(n, Net::Local, &cfg, Duration::from_secs(60), body).unwrap();
        for device_order in [false, true] {
            let sim = SimMemParams {
                max_delay: Duration::from_micros(50),
                seed: n as u64,
                stall: None,
                device_order,
            };
            let pulled = run(n, Net::MemSim(sim), &cfg, Duration::from_secs(60), body).unwrap();
            same_bits(n, &pulled, &pushed, device_order);
        }
    }
}

type Sums = (Vec<f32>, Vec<half::bf16>);

fn same_bits(n: usize, pulled: &[Sums], pushed: &[Sums], device_order: bool) {
    {
        for r in 0..n {
            assert!(
                pulled[r]
                    .0
                    .iter()
                    .zip(&pushed[r].0)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n={n} rank {r} (device order {device_order}): f32 avg differs"
            );
            assert!(
                pulled[r]
                    .1
                    .iter()
                    .zip(&pushed[r].1)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n={n} rank {r} (device order {device_order}): bf16 sum differs"
            );
        }
    }
}

/// Many calls of every kind back to back: counters stay comparable across calls of
/// different lengths, and a workspace that grows mid-job is re-read correctly.
#[test]
fn mixed_calls_reuse_and_grow_the_workspace() {
    for device_order in [false, true] {
        mixed_calls(SimMemParams {
            max_delay: Duration::from_micros(30),
            seed: 3,
            stall: None,
            device_order,
        });
    }
}

fn mixed_calls(sim: SimMemParams) {
    let n = 4;
    let out = run(
        n,
        Net::MemSim(sim),
        &test_config(),
        Duration::from_secs(60),
        move |c| {
            let r = c.rank() as i64;
            let mut got = Vec::new();
            for round in 0..3usize {
                let len = 10 + round * 500; // grows every round
                let mut a = vec![r + 1; len];
                c.all_reduce(&mut a, ReduceOp::Sum)?;
                // Past one-shot's size: two-shot, then one-shot again.
                let mut e = vec![r + 1; 10_000 + round];
                c.all_reduce(&mut e, ReduceOp::Sum)?;
                assert!(e.iter().all(|&x| x == 10), "rank {r}: two-shot");
                let mut b = vec![r; len];
                c.broadcast(&mut b, round % n)?;
                let mut d = vec![r + 1; len];
                c.reduce(&mut d, ReduceOp::Prod, (round + 1) % n)?;
                let mut g = vec![-1i64; n * 3];
                c.all_gather(&[r; 3], &mut g)?;
                c.barrier()?;
                got.push((a[len - 1], b[0], d[0], g));
            }
            Ok(got)
        },
    )
    .unwrap();
    for (r, rounds) in out.iter().enumerate() {
        for (round, (a, b, d, g)) in rounds.iter().enumerate() {
            assert_eq!(*a, 10, "rank {r} round {round}: all_reduce");
            assert_eq!(*b, (round % n) as i64, "rank {r} round {round}: broadcast");
            if r == (round + 1) % n {
                assert_eq!(*d, 24, "rank {r} round {round}: reduce at the root");
            }
            let want: Vec<i64> = (0..n as i64).flat_map(|q| [q; 3]).collect();
            assert_eq!(g, &want, "rank {r} round {round}: all_gather");
        }
    }
}

/// A count or a root that differs between ranks is a mismatch naming both calls, found
/// before any rank reads another's memory.
#[test]
fn a_mismatched_call_is_reported_over_memory_peers() {
    let sim = SimMemParams::default();
    let out = run_all(
        2,
        Net::MemSim(sim),
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let mut v = vec![1.0f32; 100 + c.rank()];
            c.all_reduce(&mut v, ReduceOp::Sum)
        },
    );
    for e in all_errors(out, "different counts") {
        let t = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "{t}");
        assert!(
            t.contains("100 elements") && t.contains("101 elements"),
            "{t}"
        );
    }
    let out = run_all(
        3,
        Net::MemSim(sim),
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let mut v = vec![c.rank() as u8; 64];
            c.broadcast(&mut v, usize::from(c.rank() != 0))
        },
    );
    let errs: Vec<Error> = out.into_iter().flatten().filter_map(|r| r.err()).collect();
    assert!(!errs.is_empty(), "a root disagreement went unnoticed");
    assert!(
        errs.iter()
            .any(|e| matches!(e, Error::Mismatch { .. }) && e.to_string().contains("root 0")),
        "{errs:?}"
    );
}

/// Rank 1 stops after the fingerprints were exchanged: rank 0 waits on its progress
/// counter. The abort handle ends that wait (nothing else can: the timeout's clock
/// never moves).
#[test]
fn abort_interrupts_a_wait_on_a_peer_s_memory() {
    for device_order in [false, true] {
        abort_interrupts(SimMemParams {
            stall: Some((1, Duration::from_secs(2))),
            device_order,
            ..SimMemParams::default()
        });
    }
}

fn abort_interrupts(sim: SimMemParams) {
    let mut cfg = test_config();
    cfg.tuning.clock = Clock::manual();
    let done = Arc::new(AtomicBool::new(false));
    let out = run_all(
        2,
        Net::MemSim(sim),
        &cfg,
        Duration::from_secs(30),
        move |c| {
            if c.rank() == 0 {
                let h = c.abort_handle();
                let killer = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(100));
                    h.abort();
                });
                let e = c
                    .all_reduce(&mut vec![1.0f64; 4096], ReduceOp::Sum)
                    .unwrap_err();
                killer.join().unwrap();
                done.store(true, Ordering::SeqCst);
                return Ok(Some(e));
            }
            // Rank 1 stalls, then waits on rank 0, which has given up: abort it too once
            // rank 0 has its answer.
            let (h, done) = (c.abort_handle(), done.clone());
            let releaser = std::thread::spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                h.abort();
            });
            let r = c.all_reduce(&mut vec![1.0f64; 4096], ReduceOp::Sum);
            releaser.join().unwrap();
            Ok(r.err())
        },
    );
    let e = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
    assert!(matches!(e, Error::Aborted { .. }), "{sim:?}: {e}");
}

/// Device order: a rank that fails lets its device run on unordered (so nothing hangs
/// on it), and what that device then publishes must not pass for data. Rank 2 stalls,
/// rank 0 is aborted while its device waits: no rank returns Ok, on the ring's plan
/// and in two-shot, and rank 0's error is the abort.
#[test]
fn a_failed_rank_s_released_device_never_passes_garbage_for_data() {
    for algo in [AllReduceAlgo::Ring, AllReduceAlgo::TwoShot] {
        let sim = SimMemParams {
            // Long against the 100 ms before the abort, so that rank 0 is still
            // waiting when it comes, however loaded the machine.
            stall: Some((2, Duration::from_secs(3))),
            device_order: true,
            ..SimMemParams::default()
        };
        let mut cfg = test_config();
        cfg.tuning.clock = Clock::manual();
        cfg.tuning.all_reduce_algo = algo;
        let out = run_all(
            3,
            Net::MemSim(sim),
            &cfg,
            Duration::from_secs(30),
            move |c| {
                let killer = (c.rank() == 0).then(|| {
                    let h = c.abort_handle();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(100));
                        h.abort();
                    })
                });
                let r = c.all_reduce(&mut vec![1.0f32; 5000], ReduceOp::Sum);
                if let Some(k) = killer {
                    k.join().unwrap();
                }
                Ok(r.err())
            },
        );
        for (rank, r) in out.iter().enumerate() {
            let e = r.as_ref().unwrap().as_ref().unwrap().as_ref();
            assert!(e.is_some(), "{algo:?}: rank {rank} returned Ok");
        }
        let e = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
        assert!(matches!(e, Error::Aborted { .. }), "{algo:?}: {e}");
    }
}

/// The same wait ends with a timeout that says which rank it waited for and how far
/// that rank had got, when the (manual) clock passes the timeout: on the ring's plan
/// and in one-shot.
#[test]
fn a_wait_on_a_silent_peer_s_memory_times_out_naming_it() {
    for (algo, device_order, waiting) in [
        (
            AllReduceAlgo::Ring,
            false,
            "rank 1 to finish the data this rank reads",
        ),
        // In device order the host waits for its device, which waits on rank 1.
        (
            AllReduceAlgo::Ring,
            true,
            "rank 1 to publish progress 1, which this rank's device work waits for",
        ),
        // One-shot: the stalled rank has yet to send its fingerprint.
        (
            AllReduceAlgo::OneShot,
            false,
            "rank 1 to start the same call",
        ),
        (
            AllReduceAlgo::OneShot,
            true,
            "rank 1 to start the same call",
        ),
    ] {
        let sim = SimMemParams {
            stall: Some((1, Duration::from_secs(1))),
            device_order,
            ..SimMemParams::default()
        };
        let mut cfg = test_config();
        cfg.tuning.all_reduce_algo = algo;
        let rig = common::ManualTimeout::new(cfg, Duration::from_secs(5));
        let (started, done) = (rig.started.clone(), rig.done.clone());
        let out = run_all(
            2,
            Net::MemSim(sim),
            &rig.cfg,
            Duration::from_secs(30),
            move |c| {
                if c.rank() == 1 {
                    // Stalled in its first call, then waits on rank 0, which has given
                    // up; the ticker times it out too.
                    let _ = c.all_reduce(&mut vec![0i32; 1000], ReduceOp::Max);
                    done.store(true, Ordering::SeqCst);
                    return Ok(None);
                }
                started.store(true, Ordering::SeqCst);
                Ok(Some(
                    c.all_reduce(&mut vec![0i32; 1000], ReduceOp::Max)
                        .unwrap_err(),
                ))
            },
        );
        rig.finish();
        let e = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
        let t = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "{algo:?}: {t}");
        assert!(t.contains("all_reduce #0"), "{t}");
        assert!(t.contains(waiting), "{algo:?}: {t}");
        assert!(t.contains("rank 1 is in #0 too"), "{algo:?}: {t}");
    }
}
