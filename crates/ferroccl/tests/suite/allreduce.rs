//! All-reduce correctness, byte accounting and failure behaviour, over in-process
//! pipes and loopback TCP.

use crate::common;

use common::{all_errors, eps, input, run, run_all, test_config, Net};
use ferroccl::{AllReduceAlgo, Config, DataType, Element, Error, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);

/// Checks one all-reduce case: result vs an f64 reference, and bitwise agreement.
fn check_case<T: Element>(
    net: Net,
    n: usize,
    count: usize,
    op: ReduceOp,
    seg_bytes: usize,
    seed: u64,
    algo: Algo,
) -> Result<(), String> {
    let mut cfg = test_config();
    cfg.tuning.segment_bytes = seg_bytes;
    cfg.tuning.all_reduce_algo = match algo {
        Algo::Ring => AllReduceAlgo::Ring,
        Algo::Doubling => AllReduceAlgo::RecursiveDoubling,
        Algo::Rabenseifner => AllReduceAlgo::Rabenseifner,
        Algo::Tree => AllReduceAlgo::Tree,
    };
    let results = run(n, net, &cfg, DEADLINE, move |c| {
        let mut v = input::<T>(seed, c.rank(), count, op);
        c.all_reduce(&mut v, op)?;
        Ok(v)
    })
    .map_err(|e| e.to_string())?;
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(seed, r, count, op)).collect();
    let dt = T::DTYPE;
    for i in 0..count {
        let xs: Vec<f64> = inputs.iter().map(|v| v[i].to_f64()).collect();
        let (want, scale) = match op {
            ReduceOp::Sum => (
                xs.iter().sum::<f64>(),
                xs.iter().map(|x| x.abs()).sum::<f64>(),
            ),
            ReduceOp::Avg => (
                xs.iter().sum::<f64>() / n as f64,
                xs.iter().map(|x| x.abs()).sum::<f64>() / n as f64,
            ),
            ReduceOp::Prod => {
                let p = xs.iter().product::<f64>();
                (p, p.abs())
            }
            ReduceOp::Min => (xs.iter().cloned().fold(f64::INFINITY, f64::min), 0.0),
            ReduceOp::Max => (xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max), 0.0),
            _ => unreachable!(),
        };
        let got = results[0][i].to_f64();
        let ok = if dt.is_float() {
            // n-1 pairwise roundings plus the final one (and Avg's division).
            let tol = (n as f64 + 2.0) * eps(dt) * scale.max(want.abs());
            (got - want).abs() <= tol
        } else {
            results[0][i] == T::from_f64(want)
        };
        if !ok {
            return Err(format!("{dt} {op} {algo:?} n={n} count={count} seg={seg_bytes}: element {i} is {got}, reference {want}"));
        }
    }
    for (r, v) in results.iter().enumerate() {
        if bytemuck::cast_slice::<T, u8>(v) != bytemuck::cast_slice::<T, u8>(&results[0]) {
            return Err(format!(
                "rank {r} differs bitwise from rank 0 ({dt} {op} n={n} count={count})"
            ));
        }
    }
    Ok(())
}

/// Which all-reduce algorithm a case forces.
#[derive(Clone, Copy, Debug)]
enum Algo {
    Ring,
    Doubling,
    Rabenseifner,
    Tree,
}

#[allow(clippy::too_many_arguments)]
fn check_dyn(
    net: Net,
    dt: DataType,
    n: usize,
    count: usize,
    op: ReduceOp,
    seg_bytes: usize,
    seed: u64,
    algo: Algo,
) -> Result<(), String> {
    if op == ReduceOp::Avg && !dt.is_float() {
        return Ok(()); // refused by design; tested separately
    }
    match dt {
        DataType::F32 => check_case::<f32>(net, n, count, op, seg_bytes, seed, algo),
        DataType::F64 => check_case::<f64>(net, n, count, op, seg_bytes, seed, algo),
        DataType::F16 => check_case::<f16>(net, n, count, op, seg_bytes, seed, algo),
        DataType::BF16 => check_case::<bf16>(net, n, count, op, seg_bytes, seed, algo),
        DataType::I32 => check_case::<i32>(net, n, count, op, seg_bytes, seed, algo),
        DataType::I64 => check_case::<i64>(net, n, count, op, seg_bytes, seed, algo),
        DataType::U8 => check_case::<u8>(net, n, count, op, seg_bytes, seed, algo),
        _ => unreachable!(),
    }
}

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}
fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}
fn any_algo() -> impl Strategy<Value = Algo> {
    prop::sample::select(vec![
        Algo::Ring,
        Algo::Doubling,
        Algo::Rabenseifner,
        Algo::Tree,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// World 1..=8, count 0..=20000, every dtype and op, random segment size.
    #[test]
    fn all_reduce_matches_reference_in_process(
        n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(),
        seg_elems in 1usize..=4096, seed in any::<u64>(), algo in any_algo(),
    ) {
        let r = check_dyn(Net::Local, dt, n, count, op, seg_elems * dt.size(), seed, algo);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// Counts at and around the world size, where chunks are empty or uneven.
    #[test]
    fn small_counts_in_process(n in 1usize..=8, count in 0usize..=17, dt in any_dtype(), op in any_op(), seed in any::<u64>(), algo in any_algo()) {
        let r = check_dyn(Net::Local, dt, n, count, op, 4 * dt.size(), seed, algo);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_matches_reference_over_tcp(
        n in 1usize..=5, count in 0usize..=20_000, dt in any_dtype(), op in any_op(),
        seg_elems in 1usize..=8192, seed in any::<u64>(), algo in any_algo(),
    ) {
        let r = check_dyn(Net::Tcp, dt, n, count, op, seg_elems * dt.size(), seed, algo);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn edge_worlds_and_counts() {
    // The STYLE.md matrix: worlds 1, 2, 3, 7, 8, 16; counts 0, 1, < n, not divisible, large.
    for n in [1usize, 2, 3, 7, 8, 16] {
        for count in [0, 1, n.saturating_sub(1), 2 * n + 1, 100_003] {
            for algo in [Algo::Ring, Algo::Doubling, Algo::Rabenseifner, Algo::Tree] {
                check_dyn(
                    Net::Local,
                    DataType::F32,
                    n,
                    count,
                    ReduceOp::Sum,
                    4096,
                    7,
                    algo,
                )
                .unwrap();
            }
        }
    }
}

#[test]
fn large_message_over_tcp_pipelines_many_segments() {
    // 8 MiB of f32 across 3 ranks with 64 KiB segments: dozens of segments per step
    // through real sockets, larger than the socket buffers.
    check_dyn(
        Net::Tcp,
        DataType::F32,
        3,
        2 << 20,
        ReduceOp::Sum,
        64 << 10,
        11,
        Algo::Ring,
    )
    .unwrap();
    check_dyn(
        Net::Tcp,
        DataType::BF16,
        4,
        1 << 20,
        ReduceOp::Max,
        1 << 20,
        12,
        Algo::Ring,
    )
    .unwrap();
    // Recursive doubling with a large buffer: whole-buffer frames larger than socket buffers.
    check_dyn(
        Net::Tcp,
        DataType::F16,
        5,
        3 << 20,
        ReduceOp::Sum,
        1 << 20,
        13,
        Algo::Doubling,
    )
    .unwrap();
    // Rabenseifner with halves larger than the socket buffers, cut into segments.
    check_dyn(
        Net::Tcp,
        DataType::F32,
        6,
        3 << 20,
        ReduceOp::Sum,
        256 << 10,
        14,
        Algo::Rabenseifner,
    )
    .unwrap();
    // The tree with halves of 48 segments over 7 ranks (rank 0 interior in both trees).
    check_dyn(
        Net::Tcp,
        DataType::F32,
        7,
        3 << 20,
        ReduceOp::Avg,
        64 << 10,
        15,
        Algo::Tree,
    )
    .unwrap();
}

/// The tree's law: each rank sends each tree's half once to its parent and once to
/// each child (and receives the same); over all ranks `2(n-1)·S`, the ring's total. In
/// an even world an interior rank sends `2S` (three halves in its tree, one in the
/// other) and the two roots `S`. Counted by the links.
#[test]
fn wire_bytes_of_the_tree() {
    for n in [2usize, 3, 4, 5, 6, 8] {
        let count = 1001usize;
        let mut cfg = test_config();
        cfg.tuning.all_reduce_algo = AllReduceAlgo::Tree;
        let res = run(n, Net::Local, &cfg, DEADLINE, move |c| {
            assert_eq!(c.all_reduce_algorithm(count * 4), ferroccl::Algorithm::Tree);
            let before = c.wire_stats();
            let mut v = vec![1i32; count];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((c.wire_stats().since(&before), v[count - 1]))
        })
        .unwrap();
        let s = (count * 4) as u64;
        let mut total = 0;
        for (r, (st, last)) in res.iter().enumerate() {
            let law = ferroccl::testing::internals::tree_send_bytes(r, n, count, 4) as u64;
            assert_eq!(st.payload_sent, law, "n={n} rank {r}");
            assert_eq!(st.payload_recv, law, "n={n} rank {r}");
            assert!(law <= 2 * s + 4, "n={n} rank {r}: {law}");
            assert_eq!(*last, n as i32);
            total += st.payload_sent;
        }
        assert_eq!(total, 2 * (n as u64 - 1) * s, "n={n}: the ring's total");
        if n % 2 == 0 && n >= 4 {
            // Half of 1001 i32: 501 and 500 elements; the busiest rank sends three
            // halves of one tree and one of the other.
            let busiest = res.iter().map(|x| x.0.payload_sent).max().unwrap();
            assert!(busiest >= 3 * 500 * 4 + 500 * 4, "n={n}: {busiest}");
        }
    }
}

/// Rabenseifner's law: in a power-of-two world every rank sends the ring's
/// 2(n-1)/n·S (counted by the links, exactly when S divides into n blocks), in
/// 2·log2(n) steps; otherwise ranks p..n send S and their partners S more.
#[test]
fn wire_bytes_of_rabenseifner() {
    for n in [2usize, 3, 4, 6, 8] {
        let count = 1024usize;
        let mut cfg = test_config();
        cfg.tuning.all_reduce_algo = AllReduceAlgo::Rabenseifner;
        let res = run(n, Net::Local, &cfg, DEADLINE, move |c| {
            assert_eq!(
                c.all_reduce_algorithm(count * 4),
                ferroccl::Algorithm::Rabenseifner
            );
            let before = c.wire_stats();
            let mut v = vec![1i32; count];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((c.wire_stats().since(&before), v[count - 1]))
        })
        .unwrap();
        let p = if n.is_power_of_two() {
            n
        } else {
            n.next_power_of_two() / 2
        };
        let s = (count * 4) as u64;
        for (r, (st, last)) in res.iter().enumerate() {
            let law = 2 * (p as u64 - 1) * s / p as u64;
            let want = if r >= p {
                s
            } else {
                law + if r + p < n { s } else { 0 }
            };
            assert_eq!(st.payload_sent, want, "n={n} rank {r}");
            assert_eq!(*last, n as i32);
        }
    }
}

#[test]
fn an_algorithm_named_in_the_environment_is_parsed_or_refused() {
    for (name, want) in [
        ("ring", AllReduceAlgo::Ring),
        ("rd", AllReduceAlgo::RecursiveDoubling),
        ("Rabenseifner", AllReduceAlgo::Rabenseifner),
        ("tree", AllReduceAlgo::Tree),
        ("auto", AllReduceAlgo::Auto),
        ("hier", AllReduceAlgo::Hierarchical),
        ("Hierarchical", AllReduceAlgo::Hierarchical),
    ] {
        assert_eq!(name.parse::<AllReduceAlgo>().ok(), Some(want), "{name}");
    }
    let e = "hypercube"
        .parse::<AllReduceAlgo>()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'hypercube'") && e.contains("rabenseifner") && e.contains("tree"),
        "{e}"
    );
}

/// Recursive doubling's own law: ranks below p send log2(p)·S, plus S to their extra
/// partner when n is not a power of two; the extras send S once.
#[test]
fn wire_bytes_of_recursive_doubling() {
    for n in [2usize, 3, 4, 5, 8] {
        let count = 999usize;
        let res = run(n, Net::Local, &test_config(), DEADLINE, move |c| {
            let before = c.wire_stats();
            let mut v = vec![1i32; count];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((c.wire_stats().since(&before), v[0]))
        })
        .unwrap();
        let p = n.next_power_of_two() / if n.is_power_of_two() { 1 } else { 2 };
        let s = (count * 4) as u64;
        for (r, (st, v0)) in res.iter().enumerate() {
            let stages = p.trailing_zeros() as u64;
            let want = if r >= p {
                s
            } else {
                stages * s + if r + p < n { s } else { 0 }
            };
            assert_eq!(st.payload_sent, want, "n={n} rank {r}");
            assert_eq!(*v0, n as i32);
        }
    }
}

#[test]
fn out_of_place_leaves_input_alone() {
    let res = run(3, Net::Local, &test_config(), DEADLINE, |c| {
        let send: Vec<i64> = (0..1000).map(|i| i * (c.rank() as i64 + 1)).collect();
        let mut recv = vec![0i64; 1000];
        c.all_reduce_into(&send, &mut recv, ReduceOp::Sum)?;
        Ok((send, recv))
    })
    .unwrap();
    for (r, (send, recv)) in res.iter().enumerate() {
        assert_eq!(send[10], 10 * (r as i64 + 1), "input untouched");
        assert_eq!(recv[10], 10 * 6);
    }
}

fn ring_only() -> Config {
    let mut c = test_config();
    c.tuning.small_message_bytes = 0;
    c
}

/// The ring law, counted by the links: each rank sends 2(n-1)/n·S payload bytes
/// (within one element per chunk when S is not divisible by n, exactly when it is),
/// and the links' own byte counts equal payload plus headers.
fn check_ring_law(net: Net, n: usize, count: usize) -> Result<(), String> {
    let res = run(n, net, &ring_only(), DEADLINE, move |c| {
        let before = c.wire_stats();
        let mut v = vec![1.0f32; count];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        let s = c.wire_stats().since(&before);
        let raw = c.raw_byte_counts();
        Ok((s, raw, v[..count.min(1)].to_vec()))
    })
    .map_err(|e| e.to_string())?;
    let law = 2.0 * (n as f64 - 1.0) / n as f64 * (count * 4) as f64;
    let slack = 2.0 * (n as f64 - 1.0) * 4.0; // one element per chunk sent
    let ctx = format!("{net:?} n={n} count={count}");
    let (mut total_sent, mut total_recv) = (0, 0);
    for (r, (s, raw, v)) in res.iter().enumerate() {
        let sent = s.payload_sent as f64;
        let fail = |what: String| Err(format!("{ctx} rank {r}: {what}"));
        if (sent - law).abs() > slack || (count.is_multiple_of(n) && sent != law) {
            return fail(format!("sent {sent} payload bytes, law {law}"));
        }
        if raw.0 != s.payload_sent + s.header_sent || raw.1 != s.payload_recv + s.header_recv {
            return fail(format!("link counts {raw:?} != payload + headers {s:?}"));
        }
        if s.header_sent % ferroccl::testing::internals::HEADER_LEN as u64 != 0 {
            return fail(format!(
                "{} header bytes is not whole headers",
                s.header_sent
            ));
        }
        if count > 0 && v[0] != n as f32 {
            return fail(format!("result {} != {n}", v[0]));
        }
        total_sent += s.payload_sent;
        total_recv += s.payload_recv;
    }
    if total_sent != total_recv {
        return Err(format!(
            "{ctx}: {total_sent} bytes sent but {total_recv} received"
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn wire_bytes_follow_the_ring_law(n in 1usize..=8, count in 0usize..200_000) {
        let r = check_ring_law(Net::Local, n, count);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn wire_bytes_follow_the_ring_law_over_tcp() {
    for n in [2usize, 3, 4, 7] {
        for count in [0usize, 1, 5, 1000, 65_536, 100_001] {
            check_ring_law(Net::Tcp, n, count).unwrap();
        }
    }
}

#[test]
fn float_avg_divides_by_the_world_size() {
    let res = run(4, Net::Local, &test_config(), DEADLINE, |c| {
        let mut f = vec![c.rank() as f32; 10];
        c.all_reduce(&mut f, ReduceOp::Avg)?;
        Ok(f)
    })
    .unwrap();
    for f in res {
        assert_eq!(f, vec![1.5; 10]);
    }
}

/// Avg on integers is refused on every rank that asks, before anything is sent; the
/// refusal poisons the communicator (its peers would otherwise wait for it).
#[test]
fn avg_on_integers_is_refused() {
    let out = run_all(
        3,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            let mut ints = vec![3i32; 10];
            let refused = c.all_reduce(&mut ints, ReduceOp::Avg).unwrap_err();
            let later = c.all_reduce(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
            Ok((refused, later, ints))
        },
    );
    for o in out {
        let (refused, later, ints) = o.expect("finished").expect("ran");
        assert!(
            matches!(
                refused,
                Error::UnsupportedOp {
                    op: ReduceOp::Avg,
                    dtype: DataType::I32,
                    ..
                }
            ),
            "{refused}"
        );
        assert!(matches!(later, Error::Poisoned(_)), "{later}");
        assert_eq!(ints, vec![3; 10], "a refused call leaves the buffer alone");
    }
}

#[test]
fn many_operations_in_sequence_keep_their_order() {
    let res = run(3, Net::Tcp, &test_config(), DEADLINE, |c| {
        let mut acc = Vec::new();
        for k in 0..50u32 {
            let mut v = vec![(c.rank() as u32 + k) as i32; (k as usize * 37) % 500];
            c.all_reduce(&mut v, ReduceOp::Max)?;
            acc.push(v.first().copied());
        }
        Ok(acc)
    })
    .unwrap();
    for (k, got) in res[0].iter().enumerate() {
        let want = if (k * 37) % 500 == 0 {
            None
        } else {
            Some(2 + k as i32)
        };
        assert_eq!(*got, want, "operation {k}");
    }
}

// ---- bad input: typed errors, never a hang ----

#[test]
fn lengths_that_differ_across_ranks_are_a_mismatch() {
    for net in [Net::Local, Net::Tcp] {
        let out = run_all(3, net, &test_config(), Duration::from_secs(20), |c| {
            let mut v = vec![1.0f32; if c.rank() == 1 { 1001 } else { 1000 }];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(())
        });
        let errs = all_errors(out, "length mismatch");
        // The neighbours of rank 1 see the mismatch and name both calls; the rest fail
        // fast with the notice a failing rank sends before it shuts its links.
        let mismatches: Vec<String> = errs
            .iter()
            .filter(|e| matches!(e, Error::Mismatch { .. }))
            .map(|e| e.to_string())
            .collect();
        assert!(
            !mismatches.is_empty(),
            "{net:?}: no Mismatch among {errs:?}"
        );
        assert!(
            mismatches
                .iter()
                .any(|m| m.contains("1001 elements") && m.contains("1000 elements")),
            "{mismatches:?}"
        );
        for e in &errs {
            assert!(
                matches!(e, Error::Mismatch { .. })
                    || matches!(e, Error::PeerFailed { cause, .. } if matches!(**cause, Error::Mismatch { .. })),
                "{net:?}: unexpected error kind: {e}"
            );
        }
    }
}

#[test]
fn different_collective_arguments_are_a_mismatch() {
    let out = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            if c.rank() == 0 {
                c.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
            } else {
                c.all_reduce(&mut [1.0f32; 8], ReduceOp::Max)
            }
        },
    );
    let errs = all_errors(out, "op mismatch");
    let text = errs[0].to_string();
    assert!(text.contains("sum") && text.contains("max"), "{text}");
    let dt = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(20),
        |c| {
            if c.rank() == 0 {
                c.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
            } else {
                c.all_reduce(&mut [1i32; 8], ReduceOp::Sum)
            }
        },
    );
    let errs = all_errors(dt, "dtype mismatch");
    assert!(
        errs.iter().all(|e| matches!(e, Error::Mismatch { .. })),
        "{errs:?}"
    );
}

#[test]
fn a_silent_peer_times_out_and_poisons() {
    let rig = common::ManualTimeout::new(test_config(), Duration::from_millis(400));
    let (started, done) = (rig.started.clone(), rig.done.clone());
    let out = run_all(2, Net::Tcp, &rig.cfg, Duration::from_secs(20), move |c| {
        if c.rank() == 1 {
            // Rank 1 never calls the collective, and stays alive until rank 0 is done.
            common::ManualTimeout::wait_done(&done);
            return Ok((String::new(), String::new()));
        }
        started.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = c.all_reduce(&mut [1.0f32; 100], ReduceOp::Sum).unwrap_err();
        let again = c.all_reduce(&mut [1.0f32; 100], ReduceOp::Sum).unwrap_err();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok((e.to_string(), again.to_string()))
    });
    rig.finish();
    let (first, again) = out[0].as_ref().unwrap().as_ref().unwrap();
    assert!(
        first.contains("timed out") && first.contains("rank 1") && first.contains("all_reduce #0"),
        "{first}"
    );
    assert!(
        again.contains("poisoned") && again.contains("timed out"),
        "{again}"
    );
}

#[test]
fn a_dead_peer_is_reported_not_waited_for() {
    // The timeout is on a clock that never moves: only the closed connection can end
    // the wait.
    let mut cfg = test_config();
    cfg.tuning.clock = ferroccl::Clock::manual();
    let out = run_all(3, Net::Tcp, &cfg, Duration::from_secs(20), |c| {
        if c.rank() == 2 {
            return Ok(None); // drops its communicator: its sockets close
        }
        let e = c
            .all_reduce(&mut vec![1.0f64; 1 << 16], ReduceOp::Sum)
            .unwrap_err();
        Ok(Some(e))
    });
    for (r, o) in out.iter().take(2).enumerate() {
        let e = o.as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
        // Rank 2 itself, lost directly or through the other survivor's notice.
        assert!(
            matches!(
                e,
                Error::PeerClosed { peer: 2, .. } | Error::PeerFailed { origin: 2, .. }
            ),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn bad_config_is_rejected() {
    let mut c = Config::new(3, 2, "127.0.0.1:1");
    assert!(matches!(
        ferroccl::Communicator::init(c.clone()),
        Err(Error::Config(_))
    ));
    c.job.rank = 0;
    c.tuning.segment_bytes = 0;
    assert!(matches!(
        ferroccl::Communicator::init(c),
        Err(Error::Config(_))
    ));
}

#[test]
fn a_measured_cost_model_is_the_same_on_every_rank() {
    // Over TCP, measured by Communicator::init; the values depend on the machine,
    // what every rank holds must not.
    let mut cfg = test_config();
    cfg.tuning.measure_cost_model = true;
    let sizes = [1usize << 10, 1 << 16, 1 << 20, 1 << 24];
    let res = run(3, Net::Tcp, &cfg, DEADLINE, move |c| {
        let m = c.config().tuning.cost_model;
        let picks: Vec<_> = sizes.iter().map(|&b| c.all_reduce_algorithm(b)).collect();
        let mut v = vec![c.rank() as f32 + 1.0; 1000];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok((m, picks, v))
    })
    .unwrap();
    let m0 = res[0].0.expect("rank 0 has a measured model");
    assert!(
        m0.alpha >= 0.0 && m0.bandwidth > 0.0 && m0.reduce > 0.0,
        "{m0:?}"
    );
    for (r, (m, picks, v)) in res.iter().enumerate() {
        let m = m.expect("a measured model");
        // Bit for bit.
        assert_eq!(
            [m.alpha.to_bits(), m.bandwidth.to_bits(), m.reduce.to_bits()],
            [
                m0.alpha.to_bits(),
                m0.bandwidth.to_bits(),
                m0.reduce.to_bits()
            ],
            "rank {r}"
        );
        assert_eq!(picks, &res[0].1, "rank {r} chose differently");
        assert!(v.iter().all(|&x| x == 6.0), "rank {r}");
    }
    // Threads of one process measure by calling it themselves; one rank has nothing
    // to measure.
    let res = run(2, Net::Local, &test_config(), DEADLINE, |c| {
        let m = c.measure_cost_model()?;
        Ok((m, c.config().tuning.cost_model))
    })
    .unwrap();
    for (m, kept) in &res {
        assert!(m.is_some() && m == kept && *m == res[0].0, "{res:?}");
    }
    let one = run(1, Net::Local, &test_config(), DEADLINE, |c| {
        c.measure_cost_model()
    })
    .unwrap();
    assert_eq!(one, vec![None]);
}

#[test]
fn a_cost_model_is_read_from_a_law_fit_file() {
    let dir = std::env::temp_dir().join(format!("ferroccl-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("law.json");
    std::fs::write(
        &good,
        r#"{"tool": "ferroccl bench", "fit": {"alpha_s": 5e-4, "beta_s_per_byte": 8e-9, "link_bytes_per_s": 125000000, "rate_bytes_per_s": 125000000, "reduce_bytes_per_s": 4e9}, "rows": []}"#,
    )
    .unwrap();
    let spec = ferroccl::CostModelSpec::parse(&format!("@{}", good.display())).unwrap();
    let mut t = Config::default().tuning;
    t.measure_cost_model = true;
    spec.apply(&mut t);
    let m = t.cost_model.expect("a model");
    assert!(!t.measure_cost_model);
    assert_eq!((m.alpha, m.bandwidth, m.reduce), (5e-4, 1.0 / 8e-9, 4e9));
    assert_eq!(
        ferroccl::CostModelSpec::parse(" measure ").unwrap(),
        ferroccl::CostModelSpec::Measure
    );
    // What is wrong is named: the file, the missing key, an older bench.
    let old = dir.join("old.json");
    std::fs::write(
        &old,
        r#"{"fit": {"alpha_s": 5e-4, "beta_s_per_byte": 8e-9}}"#,
    )
    .unwrap();
    let no_fit = dir.join("nofit.json");
    std::fs::write(&no_fit, r#"{"fit": null}"#).unwrap();
    let missing = dir.join("missing.json");
    for (path, says) in [
        (&old, "reduce_bytes_per_s"),
        (&no_fit, "no \"fit\""),
        (&missing, "missing.json"),
    ] {
        let e = ferroccl::CostModelSpec::parse(&format!("@{}", path.display()))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{path:?}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cost_model_chooses_per_call_and_every_rank_chooses_alike() {
    let model: ferroccl::CostModel = "alpha_us=20,link_gbs=12.5,reduce_gbs=10".parse().unwrap();
    let mut cfg = test_config();
    cfg.tuning.cost_model = Some(model);
    let res = run(8, Net::Local, &cfg, DEADLINE, move |c| {
        let picks: Vec<_> = [1usize << 10, 1 << 18, 1 << 26]
            .iter()
            .map(|&b| c.all_reduce_algorithm(b))
            .collect();
        // And it runs: 1 MiB by whatever the model picks, checked.
        let mut v = vec![c.rank() as f32 + 1.0; 1 << 18];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok((picks, v[0], v[(1 << 18) - 1]))
    })
    .unwrap();
    for (r, (picks, first, last)) in res.iter().enumerate() {
        assert_eq!(picks, &res[0].0, "rank {r} chose differently");
        assert_eq!((*first, *last), (36.0, 36.0), "rank {r}");
    }
    // 8 ranks at α = 20 µs: 1 KiB is latency (not the ring's 14 steps); 64 MiB is
    // bandwidth (not recursive doubling's 3 whole-buffer steps).
    assert_ne!(res[0].0[0], ferroccl::Algorithm::Ring);
    assert_ne!(res[0].0[2], ferroccl::Algorithm::RecursiveDoubling);
    for bad in [
        "alpha_us=20,link_gbs=12.5",
        "alpha_us=-1,link_gbs=1,reduce_gbs=1",
        "x=1",
        "alpha_us=1,alpha_us=2,link_gbs=1,reduce_gbs=1",
        "alpha_us=1,link_gbs=1,reduce_gbs=1,host_link_gbs=5",
    ] {
        assert!(bad.parse::<ferroccl::CostModel>().is_err(), "{bad}");
    }
}

/// With a model whose links within a host are faster than between hosts, `auto` on
/// hosts of 2 ranks predicts the hierarchical all-reduce for large messages, every rank
/// alike; without that difference, the hierarchical plan's extra local steps do not
/// pay, and it keeps a flat algorithm.
#[test]
fn a_cost_model_with_fast_hosts_chooses_hierarchical_across_hosts() {
    for (model, want) in [
        (
            "alpha_us=20,link_gbs=0.125,reduce_gbs=10,host_alpha_us=1,host_link_gbs=5",
            true,
        ),
        ("alpha_us=20,link_gbs=0.125,reduce_gbs=10", false),
    ] {
        let mut cfg = test_config();
        cfg.tuning.cost_model = Some(model.parse().unwrap());
        let res = run(4, Net::Hosts(2), &cfg, DEADLINE, move |c| {
            Ok(c.all_reduce_algorithm(16 << 20))
        })
        .unwrap();
        for (r, large) in res.iter().enumerate() {
            assert_eq!(
                *large == ferroccl::Algorithm::Hierarchical,
                want,
                "{model} rank {r}: {large:?}"
            );
        }
    }
}

/// One communicator calls all-reduces of more shapes than the engine keeps plans for
/// (`engine::plans::PLANS_KEPT`), each shape again after others have displaced it,
/// with barriers between: every call is the sum of its inputs on every rank. A plan
/// kept for one shape and used for another would move the wrong bytes (a count of 7
/// run with the plan of 300 would read past the buffer, one of 300 with the plan of 7
/// would leave most of it unreduced). Three ranks, so recursive doubling has its
/// extra hand-over steps; the ring's sizes too.
#[test]
fn kept_plans_serve_only_their_own_shape() {
    let counts = [
        7usize, 300, 7, 1, 20_000, 300, 0, 9, 1, 40_000, 7, 300, 20_000,
    ];
    for net in [Net::Local, Net::Tcp, Net::ShmRings] {
        let res = run(3, net, &test_config(), DEADLINE, move |c| {
            let mut out = Vec::new();
            for (k, &count) in counts.iter().enumerate() {
                let mut v: Vec<i64> = (0..count)
                    .map(|i| ((c.rank() * 1_000 + i * 7 + k) % 1_013) as i64)
                    .collect();
                c.all_reduce(&mut v, ReduceOp::Sum)?;
                out.push(v);
                if k % 3 == 0 {
                    c.barrier()?;
                }
            }
            Ok(out)
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
        for (r, calls) in res.iter().enumerate() {
            for (k, (v, &count)) in calls.iter().zip(&counts).enumerate() {
                let want: Vec<i64> = (0..count)
                    .map(|i| {
                        (0..3)
                            .map(|q| ((q * 1_000 + i * 7 + k) % 1_013) as i64)
                            .sum()
                    })
                    .collect();
                assert_eq!(v, &want, "{net:?}: rank {r}, call {k} ({count} elements)");
            }
        }
    }
}
