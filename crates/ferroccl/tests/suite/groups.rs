//! Sub-communicators (`split`, `group`, `split_by_host`) and the direct exchanges
//! (all-to-all(v), gather(v), scatter(v)): every result equal to its definition on
//! every rank, over threads, TCP and shared memory, and misuse as a typed error in the
//! same call. Point-to-point is in `p2p.rs`.

use crate::common::{self, ensure, run, run_all, test_config, ManualTimeout, Net, SimMemParams};
use ferroccl::{Communicator, DataType, Element, Error, ReduceOp};
use proptest::prelude::*;
use std::time::{Duration, Instant};

type R<T> = ferroccl::Result<T>;

/// Element `i` of what rank `from` sends rank `to`: exact in every element type.
pub(crate) fn val(from: usize, to: usize, i: usize) -> f64 {
    ((from * 31 + to * 7 + i * 3) % 97) as f64
}

fn block<T: Element>(from: usize, to: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| T::from_f64(val(from, to, i))).collect()
}

fn same<T: Element>(got: &[T], from: usize, to: usize) -> bool {
    got.iter()
        .enumerate()
        .all(|(i, x)| *x == T::from_f64(val(from, to, i)))
}

/// The nets of the transport matrix.
pub(crate) const NETS: [Net; 3] = [Net::Local, Net::Tcp, Net::Shm];

// ---- all-to-all ----

/// Equal blocks of `count`, out of place and in place.
fn all_to_all_case<T: Element>(c: &Communicator, count: usize) -> R<()> {
    let (n, r) = (c.world_size(), c.rank());
    let send: Vec<T> = (0..n).flat_map(|q| block::<T>(r, q, count)).collect();
    let mut recv = vec![T::default(); n * count];
    c.all_to_all(&send, &mut recv)?;
    for q in 0..n {
        ensure(same(&recv[q * count..(q + 1) * count], q, r), || {
            format!("all_to_all n={n} count={count}: block from {q}")
        })?;
    }
    let mut buf = send.clone();
    c.all_to_all_in_place(&mut buf)?;
    ensure(buf == recv, || {
        format!("all_to_all_in_place n={n} count={count}")
    })?;
    Ok(())
}

/// What rank `from` sends rank `to` in the all-to-allv case `seed`: 0 to 3 elements.
fn v_count(from: usize, to: usize, seed: usize) -> usize {
    (from * 3 + to * 5 + seed) % 4
}

/// Per-peer counts (0 included), send blocks in reverse rank order with gaps, receive
/// blocks in rank order with gaps.
fn all_to_allv_case<T: Element>(c: &Communicator, seed: usize) -> R<()> {
    let (n, r) = (c.world_size(), c.rank());
    let sc: Vec<usize> = (0..n).map(|q| v_count(r, q, seed)).collect();
    let rc: Vec<usize> = (0..n).map(|q| v_count(q, r, seed)).collect();
    let mut sd = vec![0; n];
    let mut at = 1;
    for q in (0..n).rev() {
        sd[q] = at;
        at += sc[q] + 2;
    }
    let mut send = vec![T::from_f64(255.0); at];
    for q in 0..n {
        send[sd[q]..sd[q] + sc[q]].copy_from_slice(&block::<T>(r, q, sc[q]));
    }
    let mut rd = vec![0; n];
    let mut at = 0;
    for q in 0..n {
        rd[q] = at;
        at += rc[q] + 1;
    }
    let fill = T::from_f64(250.0);
    let mut recv = vec![fill; at];
    c.all_to_allv(&send, &sc, &sd, &mut recv, &rc, &rd)?;
    for q in 0..n {
        ensure(same(&recv[rd[q]..rd[q] + rc[q]], q, r), || {
            format!("all_to_allv n={n} seed={seed}: block from {q}")
        })?;
        // The gaps are untouched.
        ensure(recv[rd[q] + rc[q]] == fill, || {
            format!("gap after block {q}")
        })?;
    }
    Ok(())
}

fn direct_cases<T: Element>(c: &Communicator) -> R<()> {
    for count in [0, 1, 3, 70] {
        all_to_all_case::<T>(c, count)?;
        for root in [0, c.world_size() - 1] {
            gather_scatter_case::<T>(c, count, root)?;
        }
    }
    for seed in 0..3 {
        all_to_allv_case::<T>(c, seed)?;
        gatherv_scatterv_case::<T>(c, seed, seed % c.world_size())?;
    }
    Ok(())
}

/// Every dtype, world sizes 1 to 8, counts 0, 1, uneven, over threads.
#[test]
fn direct_exchanges_equal_their_definitions_for_every_dtype_and_world() {
    for n in 1..=8 {
        for dt in DataType::ALL {
            run(
                n,
                Net::Local,
                &test_config(),
                Duration::from_secs(60),
                move |c| for_dtype!(dt, direct_cases(c)),
            )
            .unwrap_or_else(|e| panic!("n={n} {dt}: {e}"));
        }
    }
}

/// The same over TCP, shared memory, simulated RDMA, and (the equal-block forms, read
/// from the peers' memory) the pull executor.
#[test]
fn direct_exchanges_over_every_transport_and_executor() {
    let nets = [
        Net::Tcp,
        Net::Shm,
        Net::Hosts(2),
        Net::RdmaSim(common::SimParams::default()),
        Net::MemSim(SimMemParams::default()),
    ];
    for net in nets {
        for n in [1, 2, 3, 5] {
            for dt in [DataType::F32, DataType::U8, DataType::BF16] {
                run(n, net, &test_config(), Duration::from_secs(60), move |c| {
                    for_dtype!(dt, direct_cases(c))
                })
                .unwrap_or_else(|e| panic!("{net:?} n={n} {dt}: {e}"));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// On symmetric shared memory (where the direct exchanges stream through the
    /// rings, measured faster) and on the rings alone: every dtype, worlds 1 to 8,
    /// counts 0, 1, uneven and per-peer; every byte where its definition puts it.
    #[test]
    fn direct_exchanges_over_shared_memory(n in 1usize..=8, dt in prop::sample::select(DataType::ALL.to_vec()),
                                           rings in any::<bool>()) {
        let net = if rings { Net::ShmRings } else { Net::Shm };
        let r = run(n, net, &test_config(), Duration::from_secs(60), move |c| {
            for_dtype!(dt, direct_cases(c))
        });
        prop_assert!(r.is_ok(), "{net:?} n={n} {dt}: {}", r.err().map(|e| e.to_string()).unwrap_or_default());
    }
}

// ---- gather and scatter ----

fn gather_scatter_case<T: Element>(c: &Communicator, count: usize, root: usize) -> R<()> {
    let (n, r) = (c.world_size(), c.rank());
    let ctx = || format!("n={n} count={count} root={root}");
    // Gather: the root gets every rank's block, in rank order.
    let mine = block::<T>(r, root, count);
    let mut all = vec![T::default(); if r == root { n * count } else { 0 }];
    c.gather(&mine, &mut all, root)?;
    if r == root {
        for q in 0..n {
            ensure(same(&all[q * count..(q + 1) * count], q, root), || {
                format!("gather {}: block {q}", ctx())
            })?;
        }
    }
    // In place: block r of every rank's buffer.
    let mut buf = vec![T::from_f64(1.0); n * count];
    buf[r * count..(r + 1) * count].copy_from_slice(&mine);
    let before = buf.clone();
    c.gather_in_place(&mut buf, root)?;
    if r == root {
        ensure(buf == all, || format!("gather_in_place {}", ctx()))?;
    } else {
        ensure(buf == before, || {
            format!("gather_in_place changed rank {r}")
        })?;
    }
    // Scatter: rank q gets the root's block q.
    let blocks: Vec<T> = (0..n).flat_map(|q| block::<T>(root, q, count)).collect();
    let send = if r == root {
        blocks.clone()
    } else {
        Vec::new()
    };
    let mut got = vec![T::default(); count];
    c.scatter(&send, &mut got, root)?;
    ensure(same(&got, root, r), || format!("scatter {}", ctx()))?;
    let mut buf = if r == root {
        blocks.clone()
    } else {
        vec![T::from_f64(2.0); n * count]
    };
    c.scatter_in_place(&mut buf, root)?;
    ensure(same(&buf[r * count..(r + 1) * count], root, r), || {
        format!("scatter_in_place {}", ctx())
    })?;
    if r == root {
        ensure(buf == blocks, || "scatter_in_place changed the root".into())?;
    }
    Ok(())
}

fn gatherv_scatterv_case<T: Element>(c: &Communicator, seed: usize, root: usize) -> R<()> {
    let (n, r) = (c.world_size(), c.rank());
    let counts: Vec<usize> = (0..n).map(|q| v_count(q, root, seed)).collect();
    // Blocks in reverse rank order, one element apart.
    let mut displs = vec![0; n];
    let mut at = 0;
    for q in (0..n).rev() {
        displs[q] = at;
        at += counts[q] + 1;
    }
    let mine = block::<T>(r, root, counts[r]);
    let (cs, ds): (&[usize], &[usize]) = if r == root {
        (&counts, &displs)
    } else {
        (&[], &[])
    };
    let mut all = vec![T::from_f64(99.0); if r == root { at } else { 0 }];
    c.gatherv(&mine, &mut all, cs, ds, root)?;
    if r == root {
        for q in 0..n {
            ensure(
                same(&all[displs[q]..displs[q] + counts[q]], q, root),
                || format!("gatherv n={n} seed={seed}: block {q}"),
            )?;
        }
    }
    let mut send = vec![T::default(); at];
    for q in 0..n {
        send[displs[q]..displs[q] + counts[q]].copy_from_slice(&block::<T>(root, q, counts[q]));
    }
    let mut got = vec![T::default(); counts[r]];
    let send = if r == root { send } else { Vec::new() };
    c.scatterv(&send, cs, ds, &mut got, root)?;
    ensure(same(&got, root, r), || {
        format!("scatterv n={n} seed={seed}")
    })
}

// ---- splits ----

/// What `split` must make, computed here: the members of `colors[r]`'s child in
/// order of `(key, rank)`, or `None`.
fn expected_child(colors: &[Option<u32>], keys: &[i64], r: usize) -> Option<Vec<usize>> {
    let c = colors[r]?;
    let mut m: Vec<usize> = (0..colors.len())
        .filter(|&q| colors[q] == Some(c))
        .collect();
    m.sort_by_key(|&q| (keys[q], q));
    Some(m)
}

/// Checks a child against its definition: ranks, job ranks, and a collective on it.
fn check_child(child: &Communicator, parent: &Communicator, members: &[usize]) -> R<()> {
    let me = members
        .iter()
        .position(|&q| q == parent.rank())
        .expect("a member");
    ensure(
        child.rank() == me && child.world_size() == members.len(),
        || {
            format!(
                "rank {} of {} in the child, expected {me} of {}",
                child.rank(),
                child.world_size(),
                members.len()
            )
        },
    )?;
    let job: Vec<usize> = members.iter().map(|&q| parent.job_ranks()[q]).collect();
    ensure(child.job_ranks() == job.as_slice(), || {
        format!("job ranks {:?}, expected {job:?}", child.job_ranks())
    })?;
    ensure(child.job_rank() == parent.job_rank(), || "job rank".into())?;
    // Every member has the same id, and a collective on the child sums its members.
    let id = child.id();
    let mut ids = [id as i64, -(id as i64)];
    child.all_reduce(&mut ids, ReduceOp::Max)?;
    ensure(
        ids[0] == id as i64 && ids[1] == -(id as i64) && id != 0,
        || "members disagree on the child's id".into(),
    )?;
    let mut v = vec![child.job_rank() as i64; 5];
    child.all_reduce(&mut v, ReduceOp::Sum)?;
    let want: usize = job.iter().sum();
    ensure(v.iter().all(|&x| x == want as i64), || {
        format!("child all-reduce {v:?}, expected {want}")
    })
}

/// Splits of five ranks — two colors, reverse keys, one rank left out — then a split
/// of a child and a group of the parent, over threads, TCP and shared memory; every
/// child is what its definition says and computes right.
#[test]
fn splits_groups_and_nested_children_on_every_transport() {
    for net in NETS {
        run(5, net, &test_config(), Duration::from_secs(60), |c| {
            let n = c.world_size();
            let colors: Vec<Option<u32>> =
                (0..n).map(|r| (r < 4).then_some(r as u32 % 2)).collect();
            let keys: Vec<i64> = (0..n).map(|r| -(r as i64)).collect();
            let r = c.rank();
            let child = c.split(colors[r], keys[r])?;
            match (expected_child(&colors, &keys, r), &child) {
                (Some(m), Some(ch)) => {
                    check_child(ch, c, &m)?;
                    // A child of the child: halves by the child's rank.
                    let grand = ch.split(Some(ch.rank() as u32 % 2), 0)?.expect("member");
                    let gm: Vec<usize> = (0..ch.world_size())
                        .filter(|q| q % 2 == ch.rank() % 2)
                        .collect();
                    check_child(&grand, ch, &gm)?;
                }
                (None, None) => {}
                (want, got) => {
                    return Err(Error::InvalidArgument(format!(
                        "rank {r}: expected {want:?}, got a child: {}",
                        got.is_some()
                    )))
                }
            }
            // A group of the parent, listed out of order.
            let list = [3, 1, 0];
            match c.group(&list)? {
                Some(g) => check_child(&g, c, &list)?,
                None => ensure(!list.contains(&r), || "a listed rank got no group".into())?,
            }
            // The parent still computes.
            let mut v = [1u8; 3];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            ensure(v == [n as u8; 3], || "the parent after the splits".into())
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}

/// `group_of_members`: only the listed ranks call it (torch.distributed's new_group),
/// the others go on with the parent; the child is ranked as listed, two of the same
/// list are told apart by the nonce, and the parent keeps computing. Over threads, TCP
/// and shared memory.
#[test]
fn members_alone_make_a_group() {
    for net in NETS {
        run(5, net, &test_config(), Duration::from_secs(60), |c| {
            let list = [4, 1, 3];
            let r = c.rank();
            if list.contains(&r) {
                let g = c.group_of_members(&list, 0)?;
                check_child(&g, c, &list)?;
                let again = c.group_of_members(&list, 1)?;
                check_child(&again, c, &list)?;
                ensure(again.id() != g.id(), || "two groups of one list share an id".into())?;
            } else {
                let refused = c.group_of_members(&list, 0);
                ensure(
                    matches!(refused, Err(Error::InvalidArgument(ref m)) if m.contains("only members")),
                    || format!("a non-member's call: {refused:?}"),
                )?;
            }
            // The parent still computes (the refusal did not poison it).
            let mut v = [1i32; 4];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            ensure(v == [5; 4], || format!("the parent after the groups: {v:?}"))
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}

/// A key-value board in memory: what a framework's store is to `init_on_board`.
type Pairs = std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>;
#[derive(Clone, Default)]
struct MemBoard(std::sync::Arc<(Pairs, std::sync::Condvar)>);

impl ferroccl::rendezvous::Board for MemBoard {
    fn set(&mut self, key: &str, value: &[u8]) -> R<()> {
        let (m, cv) = &*self.0;
        m.lock().unwrap().insert(key.to_owned(), value.to_vec());
        cv.notify_all();
        Ok(())
    }
    fn wait_get(&mut self, key: &str, timeout: Duration) -> R<Vec<u8>> {
        let (m, cv) = &*self.0;
        let (map, _) = cv
            .wait_timeout_while(m.lock().unwrap(), timeout, |map| !map.contains_key(key))
            .unwrap();
        map.get(key)
            .cloned()
            .ok_or_else(|| Error::Rendezvous(format!("no key {key:?} after {timeout:?}")))
    }
}

/// Ranks meet on a board of someone else's (rank 0 serves ferroccl's store on a free
/// port and publishes it there), over TCP, with a job token; a rank whose board never
/// hears from rank 0 fails with a rendezvous error that says so.
#[test]
fn ranks_meet_on_a_board() {
    let n = 3;
    let board = MemBoard::default();
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let mut board = board.clone();
            std::thread::spawn(move || -> R<f32> {
                let mut cfg = test_config().for_rank(r, n);
                cfg.transport.kind = ferroccl::TransportKind::Tcp;
                cfg.job.token = Some(b"a token for this job".to_vec());
                cfg.job.job_id = Some("board-test".into());
                let c = Communicator::init_on_board(cfg, &mut board, "127.0.0.1")?;
                let mut v = [c.rank() as f32 + 1.0; 5];
                c.all_reduce(&mut v, ReduceOp::Sum)?;
                Ok(v[4])
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let got = h.join().expect("no panic");
        assert_eq!(got.unwrap_or_else(|e| panic!("rank {r}: {e}")), 6.0);
    }
    let mut lonely = MemBoard::default();
    let mut cfg = test_config().for_rank(1, 2);
    cfg.tuning.connect_timeout = Duration::from_millis(200);
    match Communicator::init_on_board(cfg, &mut lonely, "127.0.0.1") {
        Err(Error::Rendezvous(m)) => assert!(m.contains("rank 0 did not publish"), "{m}"),
        other => panic!(
            "expected a rendezvous error, got {:?}",
            other.map(|c| c.rank())
        ),
    }
}

/// The ranks of a host form one child: two emulated hosts of two, over `auto` and
/// over TCP alone (every communicator knows its hosts), and threads (one host).
#[test]
fn split_by_host_follows_the_hosts() {
    let mut tcp = test_config();
    tcp.transport.kind = ferroccl::TransportKind::Tcp;
    for cfg in [test_config(), tcp] {
        run(4, Net::Hosts(2), &cfg, Duration::from_secs(60), |c| {
            let h = c.split_by_host()?;
            let base = c.rank() / 2 * 2;
            check_child(&h, c, &[base, base + 1])
        })
        .unwrap();
    }
    run(
        3,
        Net::Local,
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let h = c.split_by_host()?;
            check_child(&h, c, &[0, 1, 2])
        },
    )
    .unwrap();
}

/// Collectives on the parent and on the children in flight together: each rank starts
/// a large all-reduce on the parent in a scope, then (in an order that differs between
/// even and odd ranks) a non-blocking all-reduce on its child and a blocking
/// broadcast on it, and waits for them in another order; all are right.
#[test]
fn parent_and_children_in_flight_together_in_any_order() {
    for net in NETS {
        run(4, net, &test_config(), Duration::from_secs(60), |c| {
            let r = c.rank();
            let child = c.split(Some(r as u32 % 2), 0)?.expect("member");
            let mut big = vec![1.0f32; 1 << 18];
            let mut small = vec![r as i64; 1000];
            let mut bc = vec![r as u8; 4096];
            c.scope(|ps| -> R<()> {
                let hp = ps.all_reduce(&mut big, ReduceOp::Sum)?;
                child.scope(|cs| -> R<()> {
                    if r % 2 == 0 {
                        let hc = cs.all_reduce(&mut small, ReduceOp::Sum)?;
                        cs.comm().broadcast(&mut bc, 1)?;
                        let s = hc.wait()?;
                        ensure(s[0] == (r % 2 + r % 2 + 2) as i64, || format!("{s:?}"))?;
                    } else {
                        let hb = cs.broadcast(&mut bc, 1)?;
                        let hc = cs.all_reduce(&mut small, ReduceOp::Sum)?;
                        ensure(hc.wait()?[0] == (1 + 3) as i64, || "child sum".into())?;
                        hb.wait()?;
                    }
                    Ok(())
                })?;
                let b = hp.wait()?;
                ensure(b.iter().all(|&x| x == 4.0), || "parent sum".into())
            })?;
            // The child's rank 1 is job rank 2 (even) or 3 (odd).
            ensure(bc.iter().all(|&x| x as usize == 2 + r % 2), || {
                "child broadcast".into()
            })
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random splits (colors, keys, ranks left out), a split of each child, and a
    /// random group, with collectives and a point-to-point ring on every child, over
    /// threads: every child is its definition and computes right.
    #[test]
    fn random_splits_are_their_definitions(
        n in 1usize..=6,
        colors in proptest::collection::vec(proptest::option::weighted(0.8, 0u32..3), 6),
        keys in proptest::collection::vec(-3i64..3, 6),
        sub in proptest::collection::vec(0u32..2, 6),
        list_seed in any::<u64>(),
    ) {
        let (colors, keys) = (colors[..n].to_vec(), keys[..n].to_vec());
        // A group: a random subset of the ranks, in a random order.
        let mut list: Vec<usize> = (0..n).filter(|&q| (list_seed >> q) & 1 == 1).collect();
        let rot = (list_seed >> 8) as usize % list.len().max(1);
        list.rotate_left(rot);
        let out = run(n, Net::Local, &test_config(), Duration::from_secs(60), move |c| {
            let r = c.rank();
            let child = c.split(colors[r], keys[r])?;
            let want = expected_child(&colors, &keys, r);
            ensure(want.is_some() == child.is_some(), || "membership".into())?;
            if let (Some(m), Some(ch)) = (want, child) {
                check_child(&ch, c, &m)?;
                // A ring of messages on the child.
                let (cr, cn) = (ch.rank(), ch.world_size());
                let out = vec![cr as i32; 17];
                let mut got = vec![0i32; 17];
                ch.p2p_batch(|b| {
                    b.send(&out, (cr + 1) % cn, 3).recv(&mut got, (cr + cn - 1) % cn, 3);
                })?;
                ensure(got[0] as usize == (cr + cn - 1) % cn, || "child ring".into())?;
                let gc = ch.split(Some(sub[r]), 0)?.expect("member");
                let gm: Vec<usize> = (0..cn).filter(|&q| sub[m[q]] == sub[r]).collect();
                check_child(&gc, &ch, &gm)?;
            }
            match c.group(&list)? {
                Some(g) => check_child(&g, c, &list),
                None => ensure(!list.contains(&r), || "group membership".into()),
            }
        });
        prop_assert!(out.is_ok(), "{}", out.err().map(|e| e.to_string()).unwrap_or_default());
    }
}

// ---- misuse: typed errors in the same call ----

/// Lists that disagree fail on every rank with a mismatch, and the parent stays
/// usable (every rank made the same exchange); a list naming a rank twice is refused.
#[test]
fn group_lists_that_disagree_are_a_mismatch_on_every_rank() {
    for net in [Net::Local, Net::Tcp] {
        let out = run_all(3, net, &test_config(), Duration::from_secs(30), |c| {
            let list: &[usize] = if c.rank() == 2 { &[0, 1] } else { &[0, 1, 2] };
            let e = c.group(list).err();
            let mut v = [1i32];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok((e, v[0]))
        });
        for (r, o) in out.into_iter().enumerate() {
            let (e, sum) = o.expect("finished").expect("the parent works after");
            let e = e.unwrap_or_else(|| panic!("{net:?} rank {r} returned a group"));
            assert!(matches!(e, Error::Mismatch { .. }), "{net:?} rank {r}: {e}");
            assert!(e.to_string().contains("group #"), "{e}");
            assert_eq!(sum, 3);
        }
    }
    let out = run_all(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(30),
        |c| c.group(&[1, 1]),
    );
    for o in out {
        let e = o.expect("finished").expect_err("refused");
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("twice")),
            "{e}"
        );
    }
}

/// All-to-allv counts that disagree between a pair: every rank fails in that call
/// (the pair's receiver with a mismatch naming both counts), none by the timeout.
#[test]
fn all_to_allv_counts_that_disagree_fail_every_rank() {
    let mut cfg = test_config();
    cfg.tuning.timeout = Duration::from_secs(120);
    for net in [Net::Local, Net::Tcp, Net::Shm] {
        let t0 = Instant::now();
        let out = run_all(3, net, &cfg, Duration::from_secs(60), |c| {
            let (n, r) = (c.world_size(), c.rank());
            // Rank 0 sends 5 elements to rank 1, which expects 4; all else is 4.
            let sc: Vec<usize> = (0..n)
                .map(|q| if (r, q) == (0, 1) { 5 } else { 4 })
                .collect();
            let rc = vec![4; n];
            let sd: Vec<usize> = (0..n).map(|q| q * 5).collect();
            let rd: Vec<usize> = (0..n).map(|q| q * 4).collect();
            let mut recv = vec![0f32; 4 * n];
            c.all_to_allv(&vec![1f32; 5 * n], &sc, &sd, &mut recv, &rc, &rd)
        });
        let errs = common::all_errors(out, "all_to_allv counts");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{net:?}: by the timeout"
        );
        let m = errs[1].to_string();
        assert!(matches!(errs[1], Error::Mismatch { .. }), "{net:?}: {m}");
        assert!(m.contains("5 elements") && m.contains("4 elements"), "{m}");
        for e in &errs {
            assert!(!matches!(e, Error::Timeout { .. }), "{net:?}: {e}");
        }
    }
}

/// Ranks that name different roots for a gather or a scatter all fail in that call,
/// at least one with a mismatch naming both roots; none returns Ok.
#[test]
fn gather_and_scatter_roots_that_disagree_fail_every_rank() {
    let mut cfg = test_config();
    cfg.tuning.timeout = Duration::from_secs(120);
    for net in [Net::Local, Net::Tcp] {
        for scatter in [false, true] {
            let out = run_all(3, net, &cfg, Duration::from_secs(60), move |c| {
                let root = usize::from(c.rank() != 0);
                let mut buf = vec![1u8; 30];
                if scatter {
                    c.scatter_in_place(&mut buf, root)
                } else {
                    c.gather_in_place(&mut buf, root)
                }
            });
            let errs = common::all_errors(out, "root disagreement");
            let mismatches: Vec<String> = errs
                .iter()
                .filter(|e| matches!(e, Error::Mismatch { .. }))
                .map(|e| e.to_string())
                .collect();
            assert!(!mismatches.is_empty(), "{net:?}: {errs:?}");
            assert!(
                mismatches.iter().all(|m| m.matches("root ").count() == 2),
                "{mismatches:?}"
            );
            assert!(
                errs.iter().all(|e| !matches!(e, Error::Timeout { .. })),
                "{errs:?}"
            );
        }
    }
}

/// In a batch, a peer that posts another length: the receiver fails with a mismatch
/// naming both, the sender (whose send completes only on its receipt) fails in the
/// same call with the receiver's notice; neither returns Ok.
#[test]
fn a_p2p_batch_whose_peer_posts_another_length_fails_both_sides() {
    let mut cfg = test_config();
    cfg.tuning.timeout = Duration::from_secs(120);
    for net in [Net::Local, Net::Tcp, Net::Shm] {
        let out = run_all(2, net, &cfg, Duration::from_secs(60), |c| {
            let r = c.rank();
            let out = vec![1i32; 10];
            let mut got = vec![0i32; if r == 1 { 12 } else { 10 }];
            c.p2p_batch(|b| {
                b.send(&out, 1 - r, 4).recv(&mut got, 1 - r, 4);
            })
        });
        let errs = common::all_errors(out, "p2p length");
        let t = errs[1].to_string();
        assert!(matches!(errs[1], Error::Mismatch { .. }), "{net:?}: {t}");
        assert!(
            t.contains("10 elements") && t.contains("12 elements"),
            "{t}"
        );
        assert!(
            matches!(
                errs[0],
                Error::PeerFailed { origin: 1, .. }
                    | Error::Mismatch { .. }
                    | Error::PeerClosed { .. }
            ),
            "{net:?}: {}",
            errs[0]
        );
    }
}

/// A blocking send completes when the transport holds the message: two ranks that
/// each send (a small message) to the other before receiving both complete. A batch
/// completes only once its messages are received: two ranks whose batches only send
/// to each other, each receiving after, wait for each other until a timeout that says
/// so, never a hang; the two directions in one batch complete.
#[test]
fn blocking_sends_are_eager_and_batches_are_confirmed() {
    run(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let r = c.rank();
            c.send(&[r as u8; 8], 1 - r, 0)?;
            let mut got = [0u8; 8];
            c.recv(&mut got, 1 - r, 0)?;
            ensure(got == [(1 - r) as u8; 8], || "eager".into())
        },
    )
    .unwrap();
    let mt = ManualTimeout::new(test_config(), Duration::from_secs(3));
    let started = mt.started.clone();
    let out = run_all(2, Net::Local, &mt.cfg, Duration::from_secs(30), move |c| {
        started.store(true, std::sync::atomic::Ordering::SeqCst);
        let r = c.rank();
        let out = [r as u8; 8];
        c.p2p_batch(|b| {
            b.send(&out, 1 - r, 0);
        })?;
        c.recv(&mut [0u8; 8], 1 - r, 0)
    });
    mt.finish();
    let errs = common::all_errors(out, "batches that only send");
    assert!(
        errs.iter().any(|e| matches!(e, Error::Timeout { .. })),
        "{errs:?}"
    );
    for e in errs {
        // The first to time out tells the other.
        let t = e.to_string();
        assert!(
            t.contains("timed out") && t.contains("a batch completes"),
            "{t}"
        );
    }
    run(
        2,
        Net::Local,
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let r = c.rank();
            let (out, mut got) = ([r as u8; 8], [0u8; 8]);
            c.p2p_batch(|b| {
                b.send(&out, 1 - r, 0).recv(&mut got, 1 - r, 0);
            })?;
            ensure(got == [(1 - r) as u8; 8], || "batch".into())
        },
    )
    .unwrap();
}

/// A rank left out of a split that calls a collective of the parent the members do
/// not join times out with a typed error saying where they are (their last call on
/// the parent was the split), while the members' child computes.
#[test]
fn a_rank_left_out_does_not_disturb_the_children() {
    let mt = ManualTimeout::new(test_config(), Duration::from_secs(3));
    let (started, done) = (mt.started.clone(), mt.done.clone());
    let left_out_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let out = run_all(3, Net::Local, &mt.cfg, Duration::from_secs(30), move |c| {
        let r = c.rank();
        let child = c.split((r < 2).then_some(0), 0)?;
        match child {
            Some(ch) => {
                let mut v = [1i32; 4];
                ch.all_reduce(&mut v, ReduceOp::Sum)?;
                // Stay (links open) until the left-out rank has its answer.
                let end = Instant::now() + Duration::from_secs(20);
                while !left_out_done.load(std::sync::atomic::Ordering::SeqCst)
                    && Instant::now() < end
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(v[0])
            }
            None => {
                started.store(true, std::sync::atomic::Ordering::SeqCst);
                // The members never join this one.
                let r = c.all_reduce(&mut [1i32], ReduceOp::Sum).map(|()| -1);
                left_out_done.store(true, std::sync::atomic::Ordering::SeqCst);
                r
            }
        }
    });
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    mt.finish();
    let mut out = out.into_iter();
    for _ in 0..2 {
        assert_eq!(out.next().flatten().map(|r| r.ok()), Some(Some(2)));
    }
    let e = out
        .next()
        .flatten()
        .expect("finished")
        .expect_err("timed out");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("(split)"), "{e}");
}
