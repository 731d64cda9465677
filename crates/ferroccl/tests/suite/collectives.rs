//! Every collective against a sequential f64 reference, their bytes on the wire, the
//! non-blocking forms with several operations in flight, point-to-point, and misuse.

use crate::common;

use common::checks::{
    check_all_gather, check_broadcast, check_reduce, check_reduce_scatter, DEADLINE,
};
use common::{all_errors, run, run_all, test_config, Net};
use ferroccl::testing::SimMemParams;
use ferroccl::{DataType, Error, ReduceOp};
use proptest::prelude::*;
use std::time::{Duration, Instant};

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}
fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn reduce_scatter_matches_reference(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(),
                                        seg in 1usize..=4096, seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_reduce_scatter(Net::Local, n, count, op, seg, seed, v));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn all_gather_matches_reference(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                                    seg in 1usize..=4096, seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_all_gather(Net::Local, n, count, seg, seed, v));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn broadcast_matches_reference(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), root in 0usize..8,
                                   seg in 1usize..=4096, seed in any::<u64>(), tree in any::<bool>()) {
        let r = for_dtype!(dt, check_broadcast(Net::Local, n, count, root % n, seg, seed, tree));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn reduce_matches_reference(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(), root in 0usize..8,
                                seg in 1usize..=4096, seed in any::<u64>(), tree in any::<bool>()) {
        let r = for_dtype!(dt, check_reduce(Net::Local, n, count, op, root % n, seg, seed, tree));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn every_collective_over_tcp() {
    for n in [1usize, 2, 3, 5] {
        check_reduce_scatter::<f32>(Net::Tcp, n, 30_001, ReduceOp::Sum, 1000, 1, true).unwrap();
        check_reduce_scatter::<half::bf16>(Net::Tcp, n, 4096 * n, ReduceOp::Avg, 512, 2, false)
            .unwrap();
        check_all_gather::<i64>(Net::Tcp, n, 20_000, 777, 3, true).unwrap();
        for tree in [false, true] {
            check_broadcast::<u8>(Net::Tcp, n, 1 << 20, n - 1, 1 << 16, 4, tree).unwrap();
            check_reduce::<f64>(Net::Tcp, n, 9999, ReduceOp::Prod, n / 2, 1000, 5, tree).unwrap();
        }
    }
}

#[test]
fn in_place_forms() {
    let res = run(4, Net::Local, &test_config(), DEADLINE, |c| {
        let r = c.rank();
        // all_gather_in_place: block r holds this rank's contribution.
        let mut g = vec![0i32; 12];
        g[r * 3..r * 3 + 3].copy_from_slice(&[r as i32; 3]);
        c.all_gather_in_place(&mut g)?;
        // reduce_scatter_in_place: block r ends up reduced.
        let mut s: Vec<i32> = (0..12).map(|i| i + r as i32).collect();
        c.reduce_scatter_in_place(&mut s, ReduceOp::Sum)?;
        // reduce in place to root 2.
        let mut red = vec![r as f32 + 1.0; 5];
        c.reduce(&mut red, ReduceOp::Max, 2)?;
        Ok((g, s[r * 3..r * 3 + 3].to_vec(), red))
    })
    .unwrap();
    for (r, (g, s, red)) in res.iter().enumerate() {
        assert_eq!(g, &vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
        let base = (r * 3) as i32;
        assert_eq!(
            s,
            &vec![4 * base + 6, 4 * base + 10, 4 * base + 14],
            "rank {r}"
        );
        if r == 2 {
            assert_eq!(red, &vec![4.0; 5]);
        }
    }
}

// ---- bytes on the wire ----

/// Counted by the links, per rank: reduce-scatter and all-gather (n-1)/n·S; broadcast
/// S from every rank but the last of the chain; reduce S from every rank but the root;
/// all-reduce 2(n-1)/n·S (in allreduce.rs).
fn check_byte_laws(n: usize, per: usize, root: usize) -> Result<(), String> {
    let res = run(n, Net::Local, &test_config(), DEADLINE, move |c| {
        let mut out = Vec::new();
        let s0 = c.wire_stats();
        let send = vec![1.0f32; n * per];
        let mut recv = vec![0.0f32; per];
        c.reduce_scatter(&send, &mut recv, ReduceOp::Sum)?;
        let s1 = c.wire_stats();
        out.push(s1.since(&s0).payload_sent);
        let mut all = vec![0.0f32; n * per];
        c.all_gather(&recv, &mut all)?;
        let s2 = c.wire_stats();
        out.push(s2.since(&s1).payload_sent);
        let mut b = vec![2.0f32; n * per];
        c.broadcast(&mut b, root)?;
        let s3 = c.wire_stats();
        out.push(s3.since(&s2).payload_sent);
        c.reduce(&mut b, ReduceOp::Sum, root)?;
        let s4 = c.wire_stats();
        out.push(s4.since(&s3).payload_sent);
        Ok(out)
    })
    .map_err(|e| e.to_string())?;
    let s = (n * per * 4) as u64;
    let last_of_chain = (root + n - 1) % n;
    for (r, got) in res.iter().enumerate() {
        let want = [
            s * (n as u64 - 1) / n as u64,
            s * (n as u64 - 1) / n as u64,
            if r == last_of_chain || n == 1 { 0 } else { s },
            if r == root || n == 1 { 0 } else { s },
        ];
        if got[..] != want[..] {
            return Err(format!(
                "n={n} per={per} root={root} rank {r}: [reduce_scatter, all_gather, broadcast, reduce] sent {got:?}, law {want:?}"
            ));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn bytes_on_the_wire_follow_each_law(n in 1usize..=8, per in 0usize..5000, root in 0usize..8) {
        let r = check_byte_laws(n, per, root % n);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Down a binary tree (`FERROCCL_ALGO=tree`), counted by the links: a broadcast
/// reaches every rank but the root once (S received; each rank sends S per child,
/// `(n-1)·S` in all), a reduce sends S from every rank but the root; the agreement's
/// frames carry no payload.
#[test]
fn tree_broadcast_and_reduce_bytes() {
    for n in [1usize, 2, 3, 5, 8] {
        for root in [0, n / 2, n - 1] {
            let per = 1000usize;
            let cfg = common::checks::rooted_cfg(4096, 4, true);
            let res = run(n, Net::Local, &cfg, DEADLINE, move |c| {
                let algo = c.rooted_algorithm();
                let s0 = c.wire_stats();
                let mut b = vec![c.rank() as f32; per];
                c.broadcast(&mut b, root)?;
                let s1 = c.wire_stats();
                c.reduce(&mut b, ReduceOp::Sum, root)?;
                let s2 = c.wire_stats();
                Ok((algo, s1.since(&s0), s2.since(&s1), b[per - 1]))
            })
            .unwrap();
            let s = (per * 4) as u64;
            let mut sent = 0;
            for (r, (algo, bc, rd, last)) in res.iter().enumerate() {
                let want_algo = if n > 1 {
                    ferroccl::Algorithm::Tree
                } else {
                    ferroccl::Algorithm::Chain
                };
                assert_eq!(*algo, want_algo);
                let other = if r == root { 0 } else { s };
                assert_eq!(bc.payload_recv, other, "n={n} root={root} rank {r}");
                assert_eq!(rd.payload_sent, other, "n={n} root={root} rank {r}");
                sent += bc.payload_sent;
                if r == root {
                    assert_eq!(*last, (n * root) as f32, "n={n} root={root}");
                }
            }
            assert_eq!(sent, (n as u64 - 1) * s, "n={n} root={root}");
        }
    }
}

// ---- non-blocking ----

/// Several operations in flight at once, of different kinds, issued without waiting;
/// they complete in issue order with the right results, while the issuing thread goes
/// on with its own work.
#[test]
fn several_async_operations_in_flight() {
    for net in [Net::Local, Net::Tcp] {
        let res = run(4, net, &test_config(), DEADLINE, |c| {
            let r = c.rank();
            let mut a = vec![r as f32; 100_000];
            let mut b = vec![if r == 3 { 7i64 } else { 0 }; 33_333];
            let mut g = vec![0u8; 4 * 1000];
            g[r * 1000..(r + 1) * 1000].fill(r as u8 + 10);
            let mut small = vec![1.0f64; 3];
            let mut order = Vec::new();
            let out = c.scope(|s| -> ferroccl::Result<_> {
                let ha = s.all_reduce(&mut a, ReduceOp::Sum)?;
                let hb = s.broadcast(&mut b, 3)?;
                let hg = s.all_gather_in_place(&mut g)?;
                let hs = s.all_reduce(&mut small, ReduceOp::Sum)?;
                let hbar = s.barrier()?;
                // The issuing thread is free meanwhile.
                let busy: u64 = (0..100_000u64).sum();
                // The last one finishing implies the earlier ones did (issue order).
                let small = hs.wait()?;
                order.push(ha.test() && hb.test() && hg.test());
                hbar.wait()?;
                Ok((
                    ha.wait()?[99_999],
                    hb.wait()?[33_332],
                    hg.wait()?.to_vec(),
                    small[0],
                    busy,
                ))
            })?;
            Ok((out, order))
        })
        .unwrap();
        for ((a, b, g, small, busy), order) in res {
            assert_eq!(a, 6.0);
            assert_eq!(b, 7);
            assert_eq!(small, 4.0);
            assert_eq!(busy, 4_999_950_000);
            for k in 0..4 {
                assert!(g[k * 1000..(k + 1) * 1000]
                    .iter()
                    .all(|&x| x == k as u8 + 10));
            }
            assert_eq!(
                order,
                vec![true],
                "{net:?}: earlier operations complete first"
            );
        }
    }
}

/// Blocking calls made inside a scope run after the operations already issued.
#[test]
fn blocking_call_inside_a_scope_keeps_issue_order() {
    let res = run(3, Net::Local, &test_config(), DEADLINE, |c| {
        let mut a = vec![1i32; 50_000];
        let mut b = vec![c.rank() as i32; 10];
        c.scope(|s| -> ferroccl::Result<_> {
            let h = s.all_reduce(&mut a, ReduceOp::Sum)?;
            s.comm().all_reduce(&mut b, ReduceOp::Max)?;
            Ok((h.wait()?[0], b[0]))
        })
    })
    .unwrap();
    assert!(res.iter().all(|&(a, b)| a == 3 && b == 2), "{res:?}");
}

/// A failing background operation reports through its handle and poisons the rest.
#[test]
fn async_failure_reports_through_the_handle() {
    let rig = common::ManualTimeout::new(test_config(), Duration::from_millis(300));
    let (started, done) = (rig.started.clone(), rig.done.clone());
    let out = run_all(2, Net::Local, &rig.cfg, Duration::from_secs(20), move |c| {
        if c.rank() == 1 {
            // Silent (but alive) until rank 0 has its errors.
            common::ManualTimeout::wait_done(&done);
            return Ok(None);
        }
        let mut a = vec![1.0f32; 10];
        let mut b = vec![1.0f32; 10];
        let (ea, eb) = c.scope(|s| {
            let ha = s.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let hb = s.all_reduce(&mut b, ReduceOp::Sum).unwrap();
            started.store(true, std::sync::atomic::Ordering::SeqCst);
            (ha.wait().unwrap_err(), hb.wait().unwrap_err())
        });
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(Some((ea.to_string(), eb.to_string())))
    });
    rig.finish();
    let (ea, eb) = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
    assert!(
        ea.contains("timed out") && ea.contains("all_reduce #0"),
        "{ea}"
    );
    assert!(eb.contains("poisoned"), "{eb}");
}

// ---- barrier ----

#[test]
fn barrier_waits_for_the_slowest_rank() {
    // Ranks are threads of this process, so one clock orders their events: no rank
    // may leave the barrier before the last one (rank 4, which sleeps longest) entered.
    for net in [Net::Local, Net::Tcp] {
        let entered: std::sync::Arc<std::sync::Mutex<Option<Instant>>> = Default::default();
        let last_in = entered.clone();
        let res = run(5, net, &test_config(), DEADLINE, move |c| {
            std::thread::sleep(Duration::from_millis(60 * c.rank() as u64));
            if c.rank() == 4 {
                *last_in.lock().unwrap() = Some(Instant::now());
            }
            c.barrier()?;
            Ok(Instant::now())
        })
        .unwrap();
        let entered = entered.lock().unwrap().expect("rank 4 entered");
        for (r, left) in res.iter().enumerate() {
            assert!(
                *left >= entered,
                "{net:?}: rank {r} left the barrier before rank 4 entered it"
            );
        }
    }
}

// ---- point to point ----

#[test]
fn send_recv_between_any_two_ranks() {
    for net in [Net::Local, Net::Tcp] {
        let res = run(6, net, &test_config(), DEADLINE, |c| {
            let r = c.rank();
            // Rank 0 sends to every other rank (most are not ring neighbours), with
            // messages bigger than a segment; each replies with a tagged echo.
            let mut replies = Vec::new();
            if r == 0 {
                for p in 1..6 {
                    let msg: Vec<i32> = (0..300_000).map(|i| i ^ p as i32).collect();
                    c.send(&msg, p, 40 + p as u32)?;
                }
                for p in 1..6 {
                    let mut back = [0i64; 2];
                    c.recv(&mut back, p, 7)?;
                    replies.push(back);
                }
            } else {
                let mut msg = vec![0i32; 300_000];
                c.recv(&mut msg, 0, 40 + r as u32)?;
                let ok = msg
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (i as i32) ^ r as i32);
                c.send(&[r as i64, ok as i64], 0, 7)?;
            }
            // Collectives still work afterwards, and never see p2p traffic.
            let mut v = vec![1u8; 10];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((replies, v[0]))
        })
        .unwrap();
        assert_eq!(
            res[0].0,
            (1..6i64).map(|p| [p, 1]).collect::<Vec<_>>(),
            "{net:?}"
        );
        assert!(res.iter().all(|(_, v)| *v == 6));
    }
}

#[test]
fn p2p_messages_and_collectives_do_not_mix() {
    let res = run(3, Net::Tcp, &test_config(), DEADLINE, |c| {
        let r = c.rank();
        // Rank 0 sends to rank 2 first, then everyone all-reduces, then rank 2 receives:
        // the pending message waits on its own channel.
        if r == 0 {
            c.send(&[42i32; 4], 2, 9)?;
        }
        let mut v = vec![r as i32; 1000];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        let mut m = [0i32; 4];
        if r == 2 {
            c.recv(&mut m, 0, 9)?;
        }
        Ok((v[999], m))
    })
    .unwrap();
    assert!(res.iter().all(|(v, _)| *v == 3));
    assert_eq!(res[2].1, [42; 4]);
}

// ---- misuse: typed errors, never a hang ----

/// Ranks that disagree on the root fail in the same call, on every rank, with nothing
/// waiting for the timeout (it is longer than the test's deadline here): the cases
/// of the root-agreement issue — a broadcast where rank 0 says root 0 and ranks 1
/// and 2 say root 1, a reduce where every rank names itself — over in-process
/// pipes, TCP and memory peers. The ranks that see a disagreeing neighbour say
/// Mismatch naming both roots; the others fail because those ranks left the call.
#[test]
fn root_disagreements_fail_in_the_same_call_on_every_rank() {
    let mut cfg = test_config();
    cfg.tuning.timeout = Duration::from_secs(120);
    let nets = [Net::Local, Net::Tcp, Net::MemSim(SimMemParams::default())];
    // broadcast [0, 1, 1]: ranks 0 and 1 have a disagreeing left neighbour;
    // reduce [0, 1, 2]: all three do.
    check_root_disagreements(&cfg, &nets, &|case| if case == "broadcast" { 2 } else { 3 });
}

/// The same down the binary tree (`FERROCCL_ALGO=tree`): its agreement barrier comes
/// before the data, so the ranks that read a frame of the other call say Mismatch
/// (at least one), and the rest fail with them.
#[test]
fn root_disagreements_fail_in_the_same_call_down_the_tree_too() {
    let mut cfg = common::checks::rooted_cfg(4096, 1, true);
    cfg.tuning.timeout = Duration::from_secs(120);
    check_root_disagreements(&cfg, &[Net::Local, Net::Tcp], &|_| 1);
}

/// Runs both root-disagreement cases over each net: every rank fails (no timeout),
/// and at least `min_mismatches(case)` ranks say Mismatch naming both roots.
fn check_root_disagreements(
    cfg: &ferroccl::Config,
    nets: &[Net],
    min_mismatches: &dyn Fn(&str) -> usize,
) {
    for &net in nets {
        for case in ["broadcast", "reduce"] {
            let out = run_all(3, net, cfg, Duration::from_secs(30), move |c| {
                let mut buf = [c.rank() as u8 + 1; 100];
                let r = match case {
                    "broadcast" => c.broadcast(&mut buf, usize::from(c.rank() != 0)),
                    _ => c.reduce(&mut buf, ReduceOp::Sum, c.rank()),
                };
                Ok(r.err())
            });
            let errs: Vec<Error> = out
                .into_iter()
                .enumerate()
                .map(|(r, o)| {
                    let o = o.unwrap_or_else(|| panic!("{net:?} {case}: rank {r} hung"));
                    let e = o.expect("ran");
                    e.unwrap_or_else(|| panic!("{net:?} {case}: rank {r} returned Ok"))
                })
                .collect();
            let mut mismatches = 0;
            for (r, e) in errs.iter().enumerate() {
                let t = e.to_string();
                assert!(
                    !matches!(e, Error::Timeout { .. }),
                    "{net:?} {case} rank {r}: {t}"
                );
                if let Error::Mismatch { .. } = e {
                    mismatches += 1;
                    let roots = t.matches("root ").count();
                    assert_eq!(roots, 2, "{net:?} {case} rank {r} names both roots: {t}");
                    assert!(t.contains(case), "{t}");
                }
            }
            let want = min_mismatches(case);
            assert!(mismatches >= want, "{net:?} {case}: {errs:?}");
        }
    }
}

#[test]
fn a_non_member_root_is_refused_and_peers_fail_fast() {
    let t0 = Instant::now();
    let out = run_all(
        3,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            let root = if c.rank() == 1 { 7 } else { 0 };
            c.reduce(&mut [1.0f32; 10], ReduceOp::Sum, root)
        },
    );
    let errs = all_errors(out, "non-member root");
    assert!(
        matches!(&errs[1], Error::InvalidArgument(m) if m.contains("root 7")),
        "{:?}",
        errs[1]
    );
    // The others hear why from rank 1 itself, before its links close.
    for e in [&errs[0], &errs[2]] {
        assert!(
            matches!(e, Error::PeerFailed { origin: 1, cause, .. }
                if matches!(&**cause, Error::InvalidArgument(m) if m.contains("root 7"))),
            "{e}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "peers failed fast, not by timeout"
    );
}

#[test]
fn different_counts_are_a_mismatch() {
    let out = run_all(
        4,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            let per = if c.rank() == 3 { 11 } else { 10 };
            let mut all = vec![0i64; 4 * per];
            c.all_gather(&vec![1i64; per], &mut all)
        },
    );
    let errs = all_errors(out, "different counts");
    assert!(
        errs.iter().any(|e| matches!(e, Error::Mismatch { .. })),
        "{errs:?}"
    );
}

#[test]
fn bad_lengths_are_refused() {
    let out = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            let mut recv = vec![0.0f32; 3];
            c.reduce_scatter(&[1.0f32; 5], &mut recv, ReduceOp::Sum)
        },
    );
    // The error names the function called and its arguments, not the internal
    // `reduce_scatterv` and its `counts`.
    for e in all_errors(out, "bad lengths") {
        let t = e.to_string();
        assert!(matches!(&e, Error::InvalidArgument(_)), "{e}");
        assert!(t.contains("reduce_scatter: send has 5 elements"), "{t}");
        assert!(t.contains("world_size (2) blocks of recv's 3"), "{t}");
        assert!(!t.contains("scatterv") && !t.contains("counts"), "{t}");
    }
    let out = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            let mut recv = vec![0u8; 7];
            c.all_gather(&[1u8; 3], &mut recv)
        },
    );
    for e in all_errors(out, "bad all_gather lengths") {
        let t = e.to_string();
        assert!(t.contains("all_gather: recv has 7 elements"), "{t}");
        assert!(!t.contains("gatherv") && !t.contains("counts"), "{t}");
    }
}

#[test]
fn p2p_tag_mismatch_is_named() {
    let out = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            if c.rank() == 0 {
                c.send(&[1i32; 4], 1, 5)
            } else {
                c.recv(&mut [0i32; 4], 0, 6)
            }
        },
    );
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    let t = e.to_string();
    assert!(t.contains("tag 5") && t.contains("tag 6"), "{t}");
}
