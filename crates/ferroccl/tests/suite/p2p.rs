//! Point-to-point (batches, scopes, owned buffers, blocking calls served on the
//! caller's thread): every message the one sent, in any posting order, over threads,
//! TCP and shared memory.

use crate::common::{self, ensure, run, test_config, Net};
use crate::groups::{val, NETS};
use ferroccl::{Communicator, ReduceOp};
use proptest::prelude::*;
use std::time::Duration;

type R<T> = ferroccl::Result<T>;

/// Everyone sends 64 MiB to the right and receives from the left in one batch: no
/// deadlock over threads, TCP or shared memory, and the bytes are right.
#[test]
fn the_ring_shift_of_64_mib_completes_in_a_batch() {
    for net in NETS {
        run(3, net, &test_config(), Duration::from_secs(120), |c| {
            let (r, n) = (c.rank(), c.world_size());
            let len = 16 << 20; // f32: 64 MiB
            let out: Vec<f32> = (0..len).map(|i| (r * 7 + i % 1000) as f32).collect();
            let mut got = vec![0f32; len];
            c.p2p_batch(|b| {
                b.send(&out, (r + 1) % n, 1)
                    .recv(&mut got, (r + n - 1) % n, 1);
            })?;
            let l = (r + n - 1) % n;
            ensure(
                got.iter()
                    .enumerate()
                    .all(|(i, &x)| x == (l * 7 + i % 1000) as f32),
                || "ring shift data".into(),
            )
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}

/// The message rank `from` sends rank `to` as its `k`-th: a length and a tag from the
/// seed, contents from `val`.
fn message(seed: u64, from: usize, to: usize, k: usize) -> (Vec<i32>, u32) {
    let h = common::splitmix(seed ^ ((from as u64) << 32) ^ ((to as u64) << 16) ^ k as u64);
    let len = [0usize, 1, 7, 300, 5000][(h % 5) as usize];
    let data = (0..len).map(|i| val(from, to, i + k) as i32).collect();
    (data, (h >> 8) as u32 % 1000)
}

/// How many messages `from` sends `to` (self included).
fn messages(seed: u64, from: usize, to: usize) -> usize {
    (common::splitmix(seed ^ ((from * 131 + to) as u64)) % 3) as usize
}

/// Every rank posts its sends and receives (to and from every rank, itself included)
/// in a random order, all in one batch, or one by one in a scope waiting in another
/// random order: everything completes and every message is the one sent.
fn random_p2p(c: &Communicator, seed: u64, scoped: bool) -> R<()> {
    let (n, r) = (c.world_size(), c.rank());
    let mut outs = Vec::new();
    let mut ins = Vec::new();
    for q in 0..n {
        for k in 0..messages(seed, r, q) {
            let (d, tag) = message(seed, r, q, k);
            outs.push((q, tag, d));
        }
        for k in 0..messages(seed, q, r) {
            let (d, tag) = message(seed, q, r, k);
            ins.push((q, tag, k, vec![0i32; d.len()]));
        }
    }
    // A random interleaving that keeps each peer's sends (and receives) in order.
    let mut order: Vec<(bool, usize)> = (0..outs.len())
        .map(|i| (true, i))
        .chain((0..ins.len()).map(|i| (false, i)))
        .collect();
    let mut x = common::splitmix(seed ^ r as u64);
    for i in (1..order.len()).rev() {
        x = common::splitmix(x);
        order.swap(i, x as usize % (i + 1));
    }
    // Restore per-peer order among the sends and among the receives.
    let fix = |order: &mut Vec<(bool, usize)>, send: bool, len: usize| {
        let slots: Vec<usize> = (0..order.len()).filter(|&i| order[i].0 == send).collect();
        debug_assert_eq!(slots.len(), len);
        for (k, s) in slots.into_iter().enumerate() {
            order[s] = (send, k);
        }
    };
    fix(&mut order, true, outs.len());
    fix(&mut order, false, ins.len());
    let meta = ins_meta(seed, r, n);
    let mut bufs: Vec<Option<&mut Vec<i32>>> = ins.iter_mut().map(|i| Some(&mut i.3)).collect();
    if scoped {
        c.scope(|s| -> R<()> {
            let mut waits: Vec<Box<dyn FnOnce() -> R<()> + '_>> = Vec::new();
            for &(send, i) in &order {
                if send {
                    let (q, tag, d) = &outs[i];
                    let h = s.send(d, *q, *tag)?;
                    waits.push(Box::new(move || h.wait().map(|_| ())));
                } else if let Some(buf) = bufs[i].take() {
                    let h = s.recv(buf, meta[i].0, meta[i].1)?;
                    waits.push(Box::new(move || h.wait().map(|_| ())));
                }
            }
            // Waited for in reverse order.
            for w in waits.into_iter().rev() {
                w()?;
            }
            Ok(())
        })?;
    } else {
        c.p2p_batch(|b| {
            for &(send, i) in &order {
                if send {
                    let (q, tag, d) = &outs[i];
                    b.send(d, *q, *tag);
                } else if let Some(buf) = bufs[i].take() {
                    b.recv(buf, meta[i].0, meta[i].1);
                }
            }
        })?;
    }
    drop(bufs);
    for (q, _, k, got) in &ins {
        let (want, _) = message(seed, *q, r, *k);
        ensure(*got == want, || format!("message {k} from {q}"))?;
    }
    Ok(())
}

/// `(peer, tag)` of every receive of rank `r`, in the order `random_p2p` lists them.
fn ins_meta(seed: u64, r: usize, n: usize) -> Vec<(usize, u32)> {
    (0..n)
        .flat_map(|q| (0..messages(seed, q, r)).map(move |k| (q, message(seed, q, r, k).1)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Random messages between every pair (and to itself), posted in random orders, in
    /// one batch per rank or one by one in a scope: all complete, all right.
    #[test]
    fn p2p_in_random_orders_completes(n in 1usize..=5, seed in any::<u64>(), scoped in any::<bool>()) {
        let out = run(n, Net::Local, &test_config(), Duration::from_secs(60), move |c| {
            random_p2p(c, seed, scoped)
        });
        prop_assert!(out.is_ok(), "{}", out.err().map(|e| e.to_string()).unwrap_or_default());
    }
}

/// The same over TCP and shared memory (fewer cases: processes of ranks link for
/// real).
#[test]
fn p2p_in_random_orders_over_tcp_and_shared_memory() {
    for net in [Net::Tcp, Net::Shm] {
        for (n, seed, scoped) in [(3, 11, false), (4, 12, true), (2, 13, true)] {
            run(n, net, &test_config(), Duration::from_secs(60), move |c| {
                random_p2p(c, seed, scoped)
            })
            .unwrap_or_else(|e| panic!("{net:?} n={n}: {e}"));
        }
    }
}

/// Owned-buffer sends and receives (`send_start`, `recv_start`) overlap with
/// collectives; a message is sent to oneself too.
#[test]
fn owned_p2p_overlaps_collectives() {
    run(
        3,
        Net::Local,
        &test_config(),
        Duration::from_secs(30),
        |c| {
            let (r, n) = (c.rank(), c.world_size());
            let rx = c.recv_start(vec![0i64; 100], (r + n - 1) % n, 5)?;
            let me = c.recv_start(vec![0i64; 3], r, 6)?;
            let tx = c.send_start(vec![r as i64; 100], (r + 1) % n, 5)?;
            c.send(&[7i64; 3], r, 6)?;
            let mut v = [1.0f64; 10];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            ensure(v[0] == 3.0, || "all-reduce".into())?;
            let got = rx.wait()?;
            tx.wait()?;
            ensure(me.wait()? == vec![7; 3], || "to itself".into())?;
            ensure(got.iter().all(|&x| x as usize == (r + n - 1) % n), || {
                "ring".into()
            })
        },
    )
    .unwrap();
}

/// A blocking call serves its own messages on the caller's thread, and returns once
/// they are done even while another operation is in flight that only a later message
/// of this rank lets finish: the point-to-point thread takes that one over (had the
/// caller stayed until everything was done, both ranks would wait for ever). Then
/// the same with the thread busy first (the caller leaves its messages to it).
#[test]
fn a_blocking_call_returns_with_other_operations_left_to_the_thread() {
    for net in [Net::Local, Net::Tcp, Net::Shm] {
        run(2, net, &test_config(), Duration::from_secs(30), |c| {
            for round in 0..20i64 {
                if c.rank() == 0 {
                    let rx = c.recv_start(vec![0i64; 64], 1, 1)?;
                    let out = [round; 8];
                    c.p2p_batch(|b| {
                        b.send(&out, 1, 2);
                    })?;
                    c.send(&[round; 4], 1, 3)?;
                    ensure(rx.wait()? == vec![round; 64], || "in flight".into())?;
                } else {
                    let mut a = [0i64; 8];
                    c.recv(&mut a, 0, 2)?;
                    let mut b = [0i64; 4];
                    c.recv(&mut b, 0, 3)?;
                    ensure(a == [round; 8] && b == [round; 4], || "blocking".into())?;
                    c.send(&[round; 64], 0, 1)?;
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
        // A receive from rank 2 that the thread waits on (holding the engine), blocking
        // exchanges between ranks 0 and 1 meanwhile, then rank 2's message.
        run(3, net, &test_config(), Duration::from_secs(30), |c| {
            let r = c.rank();
            if r == 2 {
                c.barrier()?;
                c.send(&vec![7u8; 1 << 16], 0, 9)?;
                return c.send(&vec![7u8; 1 << 16], 1, 9);
            }
            let peer = 1 - r;
            let late = c.recv_start(vec![0u8; 1 << 16], 2, 9)?;
            for i in 0..50i32 {
                let (out, mut got) = ([i, r as i32], [0i32; 2]);
                c.p2p_batch(|b| {
                    b.send(&out, peer, 4).recv(&mut got, peer, 4);
                })?;
                ensure(got == [i, peer as i32], || format!("exchange {i}"))?;
            }
            c.barrier()?;
            ensure(late.wait()?.iter().all(|&x| x == 7), || {
                "the late one".into()
            })
        })
        .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}
