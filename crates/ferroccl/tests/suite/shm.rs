//! Every collective over shared memory (`shm`, world 1..=8) and over jobs mixing
//! shared memory and TCP (`auto` with emulated hosts of 2 ranks), against the same f64
//! references and bitwise agreement as over TCP; the hierarchical all-reduce over
//! emulated hosts of 1..4 ranks; the choice `auto` makes; and what shared-memory links
//! leave behind.

use crate::common;

use common::checks::{
    cfg, check_all_gather, check_all_gather_with, check_all_reduce, check_all_reduce_with,
    check_broadcast, check_reduce, check_reduce_scatter, check_reduce_scatter_with,
};
use common::{run, test_config, Net};
use ferroccl::rendezvous::StoreServer;
use ferroccl::testing::internals::shm_ring_prefixes;
use ferroccl::{Algorithm, AllReduceAlgo, Communicator, DataType, Error, ReduceOp, TransportKind};
use proptest::prelude::*;
use std::time::Duration;

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}
fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}
/// Shared memory only (symmetric memory, through the rings, or with every payload
/// pulled from the writer's memory), or emulated hosts of 2 ranks (shared memory
/// within, TCP between).
fn any_net() -> impl Strategy<Value = Net> {
    prop::sample::select(vec![Net::Shm, Net::ShmRings, Net::ShmPull, Net::Hosts(2)])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_over_shm(net in any_net(), n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                           op in any_op(), seg in 1usize..=8192, seed in any::<u64>(), small in any::<bool>()) {
        let r = for_dtype!(dt, check_all_reduce(net, n, count, op, seg, seed, small));
        prop_assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
    }

    #[test]
    fn reduce_scatter_over_shm(net in any_net(), n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                               op in any_op(), seg in 1usize..=8192, seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_reduce_scatter(net, n, count, op, seg, seed, v));
        prop_assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
    }

    #[test]
    fn all_gather_over_shm(net in any_net(), n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                           seg in 1usize..=8192, seed in any::<u64>(), v in any::<bool>()) {
        let r = for_dtype!(dt, check_all_gather(net, n, count, seg, seed, v));
        prop_assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
    }

    #[test]
    fn broadcast_over_shm(net in any_net(), n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                          root in 0usize..8, seg in 1usize..=8192, seed in any::<u64>()) {
        let r = for_dtype!(dt, check_broadcast(net, n, count, root % n, seg, seed, false));
        prop_assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
    }

    #[test]
    fn reduce_over_shm(net in any_net(), n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                       op in any_op(), root in 0usize..8, seg in 1usize..=8192, seed in any::<u64>()) {
        let r = for_dtype!(dt, check_reduce(net, n, count, op, root % n, seg, seed, false));
        prop_assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Hierarchical all-reduce forced on `h` emulated hosts of `k` ranks (shared memory
    /// within a host, through the rings or with payloads pulled (`pull`), TCP between):
    /// the reference, and the same bits on every rank.
    #[test]
    fn hierarchical_all_reduce_over_mixed_hosts(h in 1usize..=4, k in 1usize..=3, count in 0usize..=20_000,
                                                dt in any_dtype(), op in any_op(), seg in 1usize..=8192,
                                                seed in any::<u64>(), pull in any::<bool>()) {
        let mut c = cfg(seg, dt.size());
        c.tuning.all_reduce_algo = AllReduceAlgo::Hierarchical;
        c.transport.shm.single_copy_min = usize::from(pull);
        let r = for_dtype!(dt, check_all_reduce_with(Net::Hosts(k), h * k, count, op, &c, seed));
        prop_assert!(r.is_ok(), "{h} hosts x {k}: {}", r.unwrap_err());
    }

    /// Hierarchical reduce-scatter and all-gather forced on `h` emulated hosts of `k`
    /// ranks, equal and uneven (`v`) counts, with and without single copy within a
    /// host (`pull`): the reference on every rank.
    #[test]
    fn hierarchical_halves_over_mixed_hosts(h in 1usize..=4, k in 1usize..=3, count in 0usize..=20_000,
                                            dt in any_dtype(), op in any_op(), seg in 1usize..=8192,
                                            seed in any::<u64>(), v in any::<bool>(), pull in any::<bool>()) {
        let mut c = cfg(seg, dt.size());
        c.tuning.all_reduce_algo = AllReduceAlgo::Hierarchical;
        c.transport.shm.single_copy_min = usize::from(pull);
        let r = for_dtype!(dt, check_reduce_scatter_with(Net::Hosts(k), h * k, count, op, &c, seed, v));
        prop_assert!(r.is_ok(), "reduce_scatter {h} hosts x {k}: {}", r.unwrap_err());
        let r = for_dtype!(dt, check_all_gather_with(Net::Hosts(k), h * k, count, &c, seed, v));
        prop_assert!(r.is_ok(), "all_gather {h} hosts x {k}: {}", r.unwrap_err());
    }
}

/// Every rank reads the same host layout; `auto` picks the hierarchical all-reduce
/// for large messages on hosts of 2 ranks (recursive doubling for small ones), and the
/// ring when each host has one rank; the counted bytes follow the hierarchical law:
/// 2(k-1)/k·S per rank within a host, 2(H-1)/H·S per host between hosts.
#[test]
fn auto_chooses_hierarchical_on_hosts_of_two_and_its_bytes_follow_the_law() {
    let count = 3 * 4 * 1000; // f32, divisible by h·k
    let s = (count * 4) as u64;
    let mut cfg = test_config();
    cfg.tuning.small_message_bytes = 1024;
    for (h, k) in [(2usize, 2usize), (3, 2), (2, 3)] {
        let n = h * k;
        let out = run(n, Net::Hosts(k), &cfg, Duration::from_secs(60), move |c| {
            let hosts = c.host_layout().map(|l| l.hosts().to_vec());
            let algos = (
                c.all_reduce_algorithm(64),
                c.all_reduce_algorithm(count * 4),
            );
            let before = c.wire_stats_by_host().expect("auto knows the hosts");
            let mut v: Vec<f32> = (0..count)
                .map(|i| (i % 7) as f32 + c.rank() as f32)
                .collect();
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            let after = c.wire_stats_by_host().expect("auto knows the hosts");
            let within = after.0.since(&before.0).payload_sent;
            let between = after.1.since(&before.1).payload_sent;
            Ok((hosts, algos, v, within, between))
        })
        .unwrap();
        let want: Vec<Vec<usize>> = (0..h).map(|x| (x * k..(x + 1) * k).collect()).collect();
        for (r, (hosts, algos, v, within, _)) in out.iter().enumerate() {
            assert_eq!(hosts.as_ref(), Some(&want), "{h}x{k} rank {r}");
            assert_eq!(
                *algos,
                (Algorithm::RecursiveDoubling, Algorithm::Hierarchical)
            );
            assert_eq!(
                bytemuck::cast_slice::<f32, u8>(v),
                bytemuck::cast_slice::<f32, u8>(&out[0].2),
                "{h}x{k}: rank {r} differs bitwise from rank 0"
            );
            let ranks = n as f32;
            let sum0 = (0..n).map(|q| q as f32).sum::<f32>();
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, x)| *x == (i % 7) as f32 * ranks + sum0));
            assert_eq!(
                *within,
                2 * (k as u64 - 1) * s / k as u64,
                "{h}x{k} rank {r}"
            );
        }
        for host in &want {
            let between: u64 = host.iter().map(|&r| out[r].4).sum();
            assert_eq!(
                between,
                2 * (h as u64 - 1) * s / h as u64,
                "{h}x{k} {host:?}"
            );
        }
    }
    // Hosts of one rank: nothing to gain, the ring.
    let out = run(4, Net::Hosts(1), &cfg, Duration::from_secs(60), |c| {
        Ok(c.all_reduce_algorithm(1 << 20))
    })
    .unwrap();
    assert!(out.iter().all(|a| *a == Algorithm::Ring), "{out:?}");
}

/// `auto` runs reduce-scatter and all-gather hierarchical on hosts of k >= 2 ranks (the
/// ring on hosts of one): each moves (k-1)/k·S per rank within a host and (H-1)/H·S per
/// host between hosts, half the hierarchical all-reduce's, and gets the reference.
#[test]
fn auto_runs_the_halves_hierarchical_on_hosts_of_two_and_their_bytes_follow_the_law() {
    let per = 3000; // f32 per rank
    let cfg = test_config();
    for (h, k) in [(2usize, 2usize), (3, 2), (2, 3)] {
        let n = h * k;
        let s = (n * per * 4) as u64;
        let out = run(n, Net::Hosts(k), &cfg, Duration::from_secs(60), move |c| {
            let algos = (c.reduce_scatter_algorithm(), c.all_gather_algorithm());
            let count = |c: &ferroccl::Communicator| {
                let (w, b) = c.wire_stats_by_host().expect("auto knows the hosts");
                (w.payload_sent, b.payload_sent)
            };
            let send: Vec<f32> = (0..n * per)
                .map(|i| (i % 5) as f32 + c.rank() as f32)
                .collect();
            let mut mine = vec![0.0f32; per];
            let t0 = count(c);
            c.reduce_scatter(&send, &mut mine, ReduceOp::Sum)?;
            let t1 = count(c);
            let mut all = vec![0.0f32; n * per];
            c.all_gather(&mine, &mut all)?;
            let t2 = count(c);
            Ok((
                algos,
                mine,
                all,
                (t1.0 - t0.0, t1.1 - t0.1),
                (t2.0 - t1.0, t2.1 - t1.1),
            ))
        })
        .unwrap();
        let sum0 = (0..n).map(|q| q as f32).sum::<f32>();
        let want: Vec<f32> = (0..n * per)
            .map(|i| (i % 5) as f32 * n as f32 + sum0)
            .collect();
        for (r, (algos, mine, all, rs, ag)) in out.iter().enumerate() {
            assert_eq!(*algos, (Algorithm::Hierarchical, Algorithm::Hierarchical));
            assert_eq!(mine[..], want[r * per..(r + 1) * per], "{h}x{k} rank {r}");
            assert_eq!(*all, want, "{h}x{k} rank {r}");
            for (what, (within, _)) in [("reduce_scatter", rs), ("all_gather", ag)] {
                assert_eq!(
                    *within,
                    (k as u64 - 1) * s / k as u64,
                    "{what} {h}x{k} rank {r}"
                );
            }
        }
        for host in 0..h {
            for (what, pick) in [("reduce_scatter", 3), ("all_gather", 4)] {
                let between: u64 = (host * k..(host + 1) * k)
                    .map(|r| if pick == 3 { out[r].3 .1 } else { out[r].4 .1 })
                    .sum();
                assert_eq!(
                    between,
                    (h as u64 - 1) * s / h as u64,
                    "{what} {h}x{k} host {host}"
                );
            }
        }
    }
    let out = run(4, Net::Hosts(1), &cfg, Duration::from_secs(60), |c| {
        Ok(c.reduce_scatter_algorithm())
    })
    .unwrap();
    assert!(out.iter().all(|a| *a == Algorithm::Ring), "{out:?}");
}

/// Forcing the hierarchical algorithm where it cannot run is an error on every rank,
/// never a quiet fallback, for all-reduce, reduce-scatter and all-gather: hosts of
/// different sizes, or links made elsewhere that do not say which ranks share a host
/// (every communicator `init` makes knows, over any transport).
#[test]
fn forced_hierarchical_on_a_layout_it_cannot_serve_is_unavailable() {
    let mut c = test_config();
    c.tuning.all_reduce_algo = AllReduceAlgo::Hierarchical;
    for (net, n, why) in [
        (Net::Hosts(2), 3, "different numbers of ranks (2, 1)"),
        (
            Net::RdmaSim(ferroccl::testing::SimParams::default()),
            2,
            "does not say which ranks share a host",
        ),
    ] {
        for coll in 0..3 {
            let out = common::run_all(n, net, &c, Duration::from_secs(30), move |c| {
                let mut v = vec![1.0f32; 1200];
                match coll {
                    0 => c.all_reduce(&mut v, ReduceOp::Sum),
                    1 => c.reduce_scatter_in_place(&mut v, ReduceOp::Sum),
                    _ => c.all_gather_in_place(&mut v),
                }
            });
            for (r, o) in out.into_iter().enumerate() {
                let e = o.expect("finished").unwrap_err();
                assert!(
                    matches!(e, Error::Unavailable { .. }),
                    "{net:?} coll {coll} rank {r}: {e}"
                );
                assert!(
                    e.to_string().contains(why),
                    "{net:?} coll {coll} rank {r}: {e}"
                );
            }
        }
    }
}

/// Messages many times the ring (a 4 KiB ring, 4 MiB frames) wrap it thousands of
/// times, with the writer and the reader each waiting for the other to sleep and wake.
#[test]
fn messages_larger_than_the_ring_wrap_it() {
    let mut cfg = test_config();
    cfg.transport.shm.ring_bytes = 4096;
    cfg.tuning.segment_bytes = 4 << 20;
    cfg.tuning.small_message_bytes = 0;
    for n in [2usize, 3] {
        let out = run(n, Net::ShmRings, &cfg, Duration::from_secs(60), |c| {
            let mut v: Vec<f32> = (0..(1 << 20)).map(|i| (i % 1000) as f32).collect();
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        })
        .unwrap();
        for v in &out {
            for (i, x) in v.iter().enumerate() {
                assert_eq!(*x, ((i % 1000) * n) as f32, "n={n} element {i}");
            }
        }
    }
}

/// Point-to-point over shared memory: its own channel, messages larger than the ring.
#[test]
fn send_and_recv_over_shm() {
    let mut cfg = test_config();
    cfg.transport.shm.ring_bytes = 8192;
    let out = run(3, Net::Shm, &cfg, Duration::from_secs(30), |c| {
        let r = c.rank();
        let msg: Vec<i32> = (0..50_000).map(|i| i * (r as i32 + 1)).collect();
        let to = (r + 1) % 3;
        let from = (r + 2) % 3;
        let mut got = vec![0i32; 50_000];
        if r == 0 {
            c.send(&msg, to, 7)?;
            c.recv(&mut got, from, 7)?;
        } else {
            c.recv(&mut got, from, 7)?;
            c.send(&msg, to, 7)?;
        }
        Ok(got)
    })
    .unwrap();
    for (r, got) in out.iter().enumerate() {
        let from = (r + 2) % 3;
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, x)| *x == i as i32 * (from as i32 + 1)),
            "rank {r} got the wrong message"
        );
    }
}

/// `shm` refuses a job whose ranks are on different hosts, naming the rank, before
/// any collective runs; `auto` links the same job with TCP between the hosts.
#[test]
fn shm_refuses_a_rank_on_another_host_and_auto_takes_tcp() {
    let out = run(
        2,
        Net::Hosts(1),
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let mut v = vec![c.rank() as i32 + 1; 100];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v[0])
        },
    )
    .unwrap();
    assert_eq!(out, vec![3, 3], "auto across emulated hosts");
    let mut strict = test_config();
    strict.transport.kind = TransportKind::Shm;
    let out = common::run_all(2, Net::Hosts(1), &strict, Duration::from_secs(30), |c| {
        c.barrier()
    });
    for (r, o) in out.into_iter().enumerate() {
        let e = o.expect("finished").unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "rank {r}: {e}");
        let peer = 1 - r;
        assert!(
            e.to_string()
                .contains(&format!("rank {peer} is on another host")),
            "rank {r}: {e}"
        );
    }
}

/// A ring segment left by a job that died while linking (its creator is gone and the
/// name is old) is removed by the next job's ranks; a fresh one, or a live creator's,
/// is left alone.
#[test]
fn a_new_job_reclaims_a_dead_jobs_segments() {
    let dead = {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    };
    let live = std::process::id();
    let path = |pid: u32, tag: u32| format!("/dev/shm/ferroccl-00000000{tag:08x}-{pid}-0-1-0");
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    let old_dead = path(dead, 0xdead);
    let old_live = path(live, 0x11fe);
    let new_dead = path(dead, 0xf5e5);
    for p in [&old_dead, &old_live, &new_dead] {
        std::fs::write(p, b"x").unwrap();
    }
    for p in [&old_dead, &old_live] {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(hour_ago).unwrap();
    }
    run(2, Net::Shm, &test_config(), Duration::from_secs(30), |c| {
        c.barrier()
    })
    .unwrap();
    let exists = |p: &str| std::path::Path::new(p).exists();
    let (a, b, c) = (exists(&old_dead), exists(&old_live), exists(&new_dead));
    for p in [&old_dead, &old_live, &new_dead] {
        let _ = std::fs::remove_file(p);
    }
    assert!(!a, "a dead job's old segment is reclaimed");
    assert!(b, "a live process's segment is left alone");
    assert!(
        c,
        "a segment younger than the connect timeout is left alone"
    );
}

/// The rings a lower rank makes for a link its peer never takes up (point-to-point
/// sends the peer never receives: the peer makes no link on that channel) leave
/// nothing in `/dev/shm`, whichever rank's communicator goes first: the maker removes
/// them when it sees the peer gone, and the peer removes those offered to it when it
/// goes first. Each job's names carry its communicator id, so other tests' rings do
/// not count.
#[test]
fn rings_of_a_link_the_peer_never_took_up_leave_nothing_behind() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    for symmetric in [true, false] {
        for maker_first in [true, false] {
            let what = format!("symmetric {symmetric}, maker first {maker_first}");
            let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
            let prefixes = shm_ring_prefixes(server.comm_id());
            // 1: rank 0 has sent; 2: the first rank's communicator is gone.
            let stage = Arc::new(AtomicUsize::new(0));
            let (tx, rx) = mpsc::channel();
            for r in 0..2 {
                let mut cfg = test_config().for_rank(r, 2);
                cfg.job.master_addr = server.local_addr().to_string();
                cfg.job.serve_store = false;
                cfg.transport.kind = TransportKind::Shm;
                cfg.transport.shm.symmetric = symmetric;
                let (tx, stage) = (tx.clone(), stage.clone());
                std::thread::spawn(move || {
                    let first = (r == 0) == maker_first;
                    let out = Communicator::init(cfg).and_then(|c| {
                        if r == 0 {
                            c.send(&[1.0f32; 16], 1, 7)?;
                            stage.fetch_max(1, Ordering::SeqCst);
                        }
                        let want = if first { 1 } else { 2 };
                        let end = std::time::Instant::now() + Duration::from_secs(20);
                        while stage.load(Ordering::SeqCst) < want {
                            assert!(std::time::Instant::now() < end, "rank {r} waited too long");
                            std::thread::sleep(Duration::from_millis(2));
                        }
                        drop(c);
                        if first {
                            stage.store(2, Ordering::SeqCst);
                        }
                        Ok(())
                    });
                    let _ = tx.send((r, out));
                });
            }
            for _ in 0..2 {
                let (r, out) = rx
                    .recv_timeout(Duration::from_secs(30))
                    .unwrap_or_else(|_| panic!("{what}: a rank did not finish"));
                out.unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            }
            let left: Vec<String> = std::fs::read_dir("/dev/shm")
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
                .collect();
            for n in &left {
                let _ = std::fs::remove_file(format!("/dev/shm/{n}"));
            }
            assert!(left.is_empty(), "{what}: left in /dev/shm: {left:?}");
        }
    }
}

/// Symmetric memory: a job of every rank on one host over `shm` runs the smallest
/// all-reduces one-shot from the slots, streams small ones over the rings (recursive
/// doubling) and runs larger ones two-shot (the
/// payload never crosses a link), and one-shot when forced, and a workspace that grows
/// call after call is re-read correctly; the broadcasts between stream through the
/// rings (measured faster there, `algo::select::sym_pull_min`); the same job with
/// `symmetric` off streams everything through the rings and gets the same bits.
#[test]
fn symmetric_memory_runs_two_shot_and_one_shot_with_the_rings_bits() {
    let n = 3;
    let lens = [1usize, 100, 3_000, 40_000, 300_000, 10];
    let body = move |c: &mut ferroccl::Communicator| {
        let mut out = Vec::new();
        // Bytes the all-reduces sent over the links.
        let mut sent = 0;
        for len in lens {
            let mut v: Vec<i64> = (0..len as i64).map(|i| i * (c.rank() as i64 + 1)).collect();
            let before = c.raw_byte_counts().0;
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            sent += c.raw_byte_counts().0 - before;
            out.push((c.all_reduce_algorithm(len * 8), v));
            let mut b = vec![c.rank() as i64; len];
            c.broadcast(&mut b, len % 3)?;
            out.push((Algorithm::Chain, b));
        }
        Ok((out, sent))
    };
    let mut one_shot = test_config();
    one_shot.tuning.all_reduce_algo = AllReduceAlgo::OneShot;
    let sym = run(n, Net::Shm, &test_config(), Duration::from_secs(60), body).unwrap();
    let one = run(n, Net::Shm, &one_shot, Duration::from_secs(60), body).unwrap();
    let rings = run(
        n,
        Net::ShmRings,
        &test_config(),
        Duration::from_secs(60),
        body,
    )
    .unwrap();
    for r in 0..n {
        let algos = |x: &[(Algorithm, Vec<i64>)]| -> Vec<Algorithm> {
            x.iter().step_by(2).map(|a| a.0).collect()
        };
        let rd = Algorithm::RecursiveDoubling;
        let (two, one_a) = (Algorithm::TwoShot, Algorithm::OneShot);
        assert_eq!(
            algos(&sym[r].0),
            [one_a, one_a, rd, two, two, one_a],
            "rank {r}"
        );
        assert_eq!(algos(&one[r].0), [one_a; 6], "rank {r}");
        for (i, (a, b)) in sym[r].0.iter().zip(&rings[r].0).enumerate() {
            assert_eq!(
                a.1, b.1,
                "rank {r} call {i}: symmetric memory and the rings differ"
            );
        }
        for (i, (a, b)) in one[r].0.iter().zip(&rings[r].0).enumerate() {
            assert_eq!(a.1, b.1, "rank {r} call {i}: one-shot and the rings differ");
        }
        let big = &sym[r].0[8].1;
        assert!(big.iter().enumerate().all(|(i, &x)| x == 6 * i as i64));
        // 2.7 MB reduced: the rings carried 2(n-1)/n of the 2.4 MB all-reduce alone;
        // symmetric memory only the small all-reduces and headers.
        assert!(
            sym[r].1 < 256 << 10,
            "rank {r} sent {} bytes over its links",
            sym[r].1
        );
        assert!(
            one[r].1 < 64 << 10,
            "rank {r} (one-shot) sent {} bytes",
            one[r].1
        );
        assert!(
            rings[r].1 > 3 << 20,
            "rank {r} (rings) sent {} bytes",
            rings[r].1
        );
    }
}
