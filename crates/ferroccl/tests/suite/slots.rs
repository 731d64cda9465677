//! The one-shot all-reduce of small buffers from symmetric memory's slots
//! (`engine/slot.rs`): the definition on every rank for every dtype and operator,
//! turns reused under skew between calls of every other kind, and a rank that called
//! something else — another slot call, a call over the links that sends, one that
//! only waits — failing every rank at once with a mismatch, never a timeout.

use crate::common;

use common::checks::check_all_reduce;
use common::{all_errors, run, run_all, test_config, Net};
use ferroccl::{Algorithm, DataType, Error, ReduceOp};
use proptest::prelude::*;
use std::time::Duration;

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}
fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Sizes around the slots' switch point (up to 16 KiB of 8-byte elements, so both
    /// sides of it at every world size): the f64 reference, and the same bits on every
    /// rank.
    #[test]
    fn small_all_reduces_over_symmetric_memory(n in 1usize..=8, count in 0usize..=2_100,
                                               dt in any_dtype(), op in any_op(),
                                               seed in any::<u64>()) {
        let r = for_dtype!(dt, check_all_reduce(Net::Shm, n, count, op, 8192, seed, false));
        prop_assert!(r.is_ok(), "n={n} count={count} {dt:?} {op:?}: {}", r.unwrap_err());
    }
}

/// `auto` takes one-shot from the slots for small buffers on symmetric memory (up to
/// 2 KiB at 3 ranks, 16 KiB at 5: the slots hold that much), and recursive doubling
/// over the rings above and where there are no slots.
#[test]
fn auto_takes_the_slots_for_small_buffers_on_symmetric_memory_only() {
    let (one, rd) = (Algorithm::OneShot, Algorithm::RecursiveDoubling);
    for (n, net, want) in [
        (3, Net::Shm, [one, one, rd]),
        (5, Net::Shm, [one, one, rd]),
        (3, Net::ShmRings, [rd, rd, rd]),
        (3, Net::Tcp, [rd, rd, rd]),
    ] {
        let top = if n == 3 { 2 << 10 } else { 16 << 10 };
        let algos = run(n, net, &test_config(), Duration::from_secs(30), move |c| {
            // The largest buffer the slots take, run too: it fits them.
            let mut v = vec![1.0f64; top / 8];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            ensure_all(&v, n as f64)?;
            Ok([8, top, top + 8].map(|b| c.all_reduce_algorithm(b)))
        })
        .unwrap();
        assert!(algos.iter().all(|a| *a == want), "n={n} {net:?}: {algos:?}");
    }
}

/// Every element of `v` is `want`.
fn ensure_all(v: &[f64], want: f64) -> ferroccl::Result<()> {
    match v.iter().position(|x| *x != want) {
        None => Ok(()),
        Some(i) => Err(Error::InvalidArgument(format!(
            "element {i} is {}, not {want}",
            v[i]
        ))),
    }
}

/// Many small all-reduces back to back, each rank late by turns (a sleep before some
/// calls), with calls of every other kind between some of them: each result is the
/// exact integer sum on every rank, so a turn reused before its readers were done, or
/// a result read from the wrong turn, fails here.
#[test]
fn turns_are_reused_safely_under_skew_and_between_other_calls() {
    for n in [2usize, 3, 5] {
        let out = run(
            n,
            Net::Shm,
            &test_config(),
            Duration::from_secs(60),
            move |c| {
                let (r, n) = (c.rank() as i64, c.world_size() as i64);
                for i in 0..300i64 {
                    if (i + r) % 7 == 0 {
                        std::thread::sleep(Duration::from_micros(50 * (r as u64 + 1)));
                    }
                    let len = 1 + (i as usize * 37) % 200;
                    let mut v: Vec<i64> = (0..len as i64).map(|k| k * (r + 1) + i).collect();
                    c.all_reduce(&mut v, ReduceOp::Sum)?;
                    let sum_r = n * (n + 1) / 2;
                    for (k, x) in v.iter().enumerate() {
                        let want = k as i64 * sum_r + n * i;
                        if *x != want {
                            return Err(Error::InvalidArgument(format!(
                                "call {i}: element {k} is {x}, not {want}"
                            )));
                        }
                    }
                    match i % 5 {
                        1 => c.barrier()?,
                        2 => {
                            let mut b = vec![r; 50];
                            c.broadcast(&mut b, (i as usize) % n as usize)?;
                        }
                        3 => {
                            // Two-shot on the workspace, beside the slots.
                            let mut big = vec![1i64; 40_000];
                            c.all_reduce(&mut big, ReduceOp::Sum)?;
                            if big.iter().any(|x| *x != n) {
                                return Err(Error::InvalidArgument(format!("call {i}: two-shot")));
                            }
                        }
                        _ => {}
                    }
                }
                Ok(())
            },
        );
        out.unwrap_or_else(|e| panic!("n={n}: {e}"));
    }
}

/// A call of the others', given the communicator and the world size.
type Call = fn(&ferroccl::Communicator, usize) -> ferroccl::Result<()>;

/// What the others call while one rank calls a small all-reduce (from the slots).
const OTHERS: [(&str, Call); 8] = [
    // A small all-reduce of another length (from the slots too).
    ("slot of another length", |c, _| {
        c.all_reduce(&mut [1.0f32; 65], ReduceOp::Sum)
    }),
    ("broadcast from rank 0", |c, _| {
        c.broadcast(&mut [0u8; 64], 0)
    }),
    ("broadcast from rank 1", |c, _| {
        c.broadcast(&mut [0u8; 64], 1)
    }),
    // Recursive doubling over the rings: at 5 ranks, rank 4 only sends to rank 0 and
    // waits, and rank 0 waits on rank 4 first.
    ("barrier", |c, _| c.barrier()),
    // Large enough for two-shot (its fingerprint exchange sends).
    ("two-shot", |c, _| {
        c.all_reduce(&mut vec![1.0f32; 100_000], ReduceOp::Sum)
    }),
    ("all-gather", |c, n| {
        c.all_gather(&[1i32; 16], &mut vec![0i32; 16 * n])
    }),
    ("scatter from rank 0", |c, n| {
        let send = if c.rank() == 0 {
            vec![0i32; 16 * n]
        } else {
            vec![]
        };
        c.scatter(&send, &mut [0i32; 16], 0)
    }),
    ("gather to rank 1", |c, n| {
        let mut all = if c.rank() == 1 {
            vec![0i32; 16 * n]
        } else {
            vec![]
        };
        c.gather(&[1i32; 16], &mut all, 1)
    }),
];

/// One rank calls a small all-reduce while the others call something else: every
/// rank fails, none by the timeout (10 s here; the test's deadline is 30 s), and at
/// least one says Mismatch naming the small all-reduce (the others fail with it: told
/// by a notice, or refused by a rank that has closed). The odd rank is rank 0, or at
/// 5 ranks rank 4 (recursive doubling's extra rank, which no partner sends to before
/// it has heard from it).
#[test]
fn a_rank_that_called_something_else_fails_every_rank_at_once() {
    for (n, odd) in [(2usize, 0usize), (3, 0), (5, 4)] {
        for (other, call) in OTHERS {
            let out = run_all(
                n,
                Net::Shm,
                &test_config(),
                Duration::from_secs(30),
                move |c| {
                    if c.rank() == odd {
                        c.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum)
                    } else {
                        call(c, n)
                    }
                },
            );
            let what = format!("n={n}, rank {odd} in the slots, the others: {other}");
            let errs = all_errors(out, &what);
            for (r, e) in errs.iter().enumerate() {
                assert!(
                    !matches!(e.root_cause(), Error::Timeout { .. }),
                    "{what}: rank {r}: {e}"
                );
            }
            let named = errs.iter().any(|e| {
                matches!(e, Error::Mismatch { .. })
                    && e.to_string().contains("all_reduce #0 (float, 64 elements")
            });
            assert!(
                named,
                "{what}: no rank names the small all-reduce: {errs:?}"
            );
        }
    }
}

/// A rank that leaves (its communicator dropped, every link closed) while the others
/// wait in a small all-reduce on its slot: every survivor names it, through its closed
/// link or a neighbour's notice, long before the timeout.
#[test]
fn a_rank_that_leaves_during_a_slot_call_is_named() {
    let out = run_all(3, Net::Shm, &test_config(), Duration::from_secs(30), |c| {
        c.barrier()?;
        if c.rank() == 1 {
            return Ok(None);
        }
        Ok(c.all_reduce(&mut vec![1i64; 32], ReduceOp::Sum).err())
    });
    for (r, o) in out.into_iter().enumerate() {
        let e = o.unwrap_or_else(|| panic!("rank {r} hung")).expect("ran");
        if r == 1 {
            continue;
        }
        let e = e.unwrap_or_else(|| panic!("rank {r} succeeded without rank 1"));
        let origin = match &e {
            Error::PeerClosed { peer, .. } => Some(*peer),
            Error::PeerFailed { origin, .. } => Some(*origin),
            _ => None,
        };
        assert_eq!(origin, Some(1), "rank {r}: {e}");
    }
}
