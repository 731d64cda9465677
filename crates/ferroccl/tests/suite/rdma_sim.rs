//! Every collective over the RDMA protocol on simulated queue pairs (delayed landings
//! and completions, random ring shapes), against the same references as over TCP and
//! in-process pipes; and the link-level behaviour (close, a dead peer) over them.

use crate::common;

use common::checks::{
    check_all_gather, check_all_reduce, check_broadcast, check_reduce, check_reduce_scatter,
};
use common::{run_all, test_config, Net};
use ferroccl::testing::internals::rdma_proto::Params;
use ferroccl::testing::internals::rdma_sim::{self as sim, SimParams};
use ferroccl::transport::{Channel, LinkError};
use ferroccl::{DataType, Error, ReduceOp};
use proptest::prelude::*;
use std::io::{IoSlice, IoSliceMut};
use std::time::{Duration, Instant};

fn any_dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}
fn any_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

/// Ring shapes from stop-and-wait (one slot) up, slots small enough that messages
/// wrap the ring many times, credits returned in every batch size, delays 0..=8 polls.
fn any_sim() -> impl Strategy<Value = SimParams> {
    (1usize..=8, 32usize..=4096, 0u64..=8, any::<u64>())
        .prop_flat_map(|(slots, slot_bytes, max_delay, seed)| {
            (Just((slots, slot_bytes, max_delay, seed)), 1usize..=slots)
        })
        .prop_map(
            |((slots, slot_bytes, max_delay, seed), credit_batch)| SimParams {
                ring: Params {
                    slots,
                    slot_bytes,
                    credit_batch,
                },
                max_delay,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_over_rdma_sim(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(),
                                seg in 1usize..=4096, seed in any::<u64>(), small in any::<bool>(), p in any_sim()) {
        let r = for_dtype!(dt, check_all_reduce(Net::RdmaSim(p), n, count, op, seg, seed, small));
        prop_assert!(r.is_ok(), "{:?}: {}", p, r.unwrap_err());
    }

    #[test]
    fn reduce_scatter_over_rdma_sim(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(),
                                    seg in 1usize..=4096, seed in any::<u64>(), v in any::<bool>(), p in any_sim()) {
        let r = for_dtype!(dt, check_reduce_scatter(Net::RdmaSim(p), n, count, op, seg, seed, v));
        prop_assert!(r.is_ok(), "{:?}: {}", p, r.unwrap_err());
    }

    #[test]
    fn all_gather_over_rdma_sim(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(),
                                seg in 1usize..=4096, seed in any::<u64>(), v in any::<bool>(), p in any_sim()) {
        let r = for_dtype!(dt, check_all_gather(Net::RdmaSim(p), n, count, seg, seed, v));
        prop_assert!(r.is_ok(), "{:?}: {}", p, r.unwrap_err());
    }

    #[test]
    fn broadcast_over_rdma_sim(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), root in 0usize..8,
                               seg in 1usize..=4096, seed in any::<u64>(), p in any_sim()) {
        let r = for_dtype!(dt, check_broadcast(Net::RdmaSim(p), n, count, root % n, seg, seed, false));
        prop_assert!(r.is_ok(), "{:?}: {}", p, r.unwrap_err());
    }

    #[test]
    fn reduce_over_rdma_sim(n in 1usize..=8, count in 0usize..=20_000, dt in any_dtype(), op in any_op(), root in 0usize..8,
                            seg in 1usize..=4096, seed in any::<u64>(), p in any_sim()) {
        let r = for_dtype!(dt, check_reduce(Net::RdmaSim(p), n, count, op, root % n, seg, seed, false));
        prop_assert!(r.is_ok(), "{:?}: {}", p, r.unwrap_err());
    }
}

/// The edges by hand: world sizes 1, 2, 3, 7, 8 with one-slot rings and the defaults.
#[test]
fn edge_worlds_over_rdma_sim() {
    let one_slot = SimParams {
        ring: Params {
            slots: 1,
            slot_bytes: 100,
            credit_batch: 1,
        },
        max_delay: 3,
        seed: 9,
    };
    for p in [one_slot, SimParams::default()] {
        for n in [1usize, 2, 3, 7, 8] {
            let net = Net::RdmaSim(p);
            check_all_reduce::<f32>(net, n, 10_007, ReduceOp::Sum, 1000, 1, false).unwrap();
            check_all_reduce::<i64>(net, n, 5, ReduceOp::Max, 64, 2, true).unwrap();
            check_reduce_scatter::<half::bf16>(net, n, 333 * n, ReduceOp::Avg, 77, 3, false)
                .unwrap();
            check_all_gather::<u8>(net, n, 4099, 500, 4, true).unwrap();
            check_broadcast::<f64>(net, n, 3000, n - 1, 256, 5, false).unwrap();
            check_reduce::<i32>(net, n, 1001, ReduceOp::Prod, n / 2, 300, 6, false).unwrap();
        }
    }
}

/// A link over the simulated queue pair: a write larger than the ring moves only what
/// credits allow, the rest after the reader drains; a close ends the reader's stream
/// after the data before it; writing to a closed peer fails.
#[test]
fn sim_link_flow_control_and_close() {
    let p = SimParams {
        ring: Params {
            slots: 2,
            slot_bytes: 5,
            credit_batch: 2,
        },
        max_delay: 2,
        seed: 1,
    };
    let mut g = sim::group(2, p).unwrap();
    let mut b = g.pop().unwrap();
    let mut a = g.pop().unwrap();
    let far = Instant::now() + Duration::from_secs(1);
    let mut la = a.connector.connect(1, Channel::Collective, far).unwrap();
    let mut lb = b.connector.connect(0, Channel::Collective, far).unwrap();
    let msg: Vec<u8> = (0..64u8).collect();
    let n = la.try_write(&[IoSlice::new(&msg)]).unwrap();
    assert_eq!(n, 10, "two slots of five bytes: the ring holds ten");
    assert_eq!(la.try_write(&[IoSlice::new(&msg[n..])]).unwrap(), 0);
    let mut got = Vec::new();
    let mut sent = n;
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < msg.len() {
        assert!(Instant::now() < deadline, "stalled at {} bytes", got.len());
        let mut buf = [0u8; 7];
        let k = lb.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap();
        got.extend_from_slice(&buf[..k]);
        if sent < msg.len() {
            sent += la.try_write(&[IoSlice::new(&msg[sent..])]).unwrap();
        }
        if k == 0 {
            a.waiter.wait(Duration::from_millis(10)).unwrap();
        }
    }
    assert_eq!(got, msg);
    assert_eq!(la.raw_counts().0, 64);
    assert_eq!(lb.raw_counts().1, 64);
    // Close: B's next read ends the stream once the close lands.
    la.try_write(&[IoSlice::new(b"tail")]).unwrap();
    la.shutdown();
    let mut tail = Vec::new();
    let end = loop {
        assert!(Instant::now() < deadline, "close never arrived");
        let mut buf = [0u8; 8];
        match lb.try_read(&mut [IoSliceMut::new(&mut buf)]) {
            Ok(k) => tail.extend_from_slice(&buf[..k]),
            Err(e) => break e,
        }
        b.waiter.wait(Duration::from_millis(10)).unwrap();
    };
    assert!(matches!(end, LinkError::Closed), "{end:?}");
    assert_eq!(tail, b"tail", "data before the close is delivered first");
    assert!(matches!(
        lb.try_write(&[IoSlice::new(b"x")]),
        Err(LinkError::Closed)
    ));
}

/// A rank that drops its communicator is reported by its neighbours as closed, not
/// waited for.
#[test]
fn a_dead_peer_is_reported_over_rdma_sim() {
    let mut frozen = test_config();
    frozen.tuning.clock = ferroccl::Clock::manual();
    let out = run_all(
        3,
        Net::RdmaSim(SimParams::default()),
        &frozen,
        Duration::from_secs(20),
        |c| {
            if c.rank() == 2 {
                return Ok(None);
            }
            let e = c
                .all_reduce(&mut vec![1.0f64; 1 << 16], ReduceOp::Sum)
                .unwrap_err();
            Ok(Some(e))
        },
    );
    // The timeout's clock never moves: only the closed link can end the wait.
    for (r, o) in out.iter().take(2).enumerate() {
        let e = o.as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
        // Every survivor names rank 2: the neighbour that lost it directly, the other
        // through the notice that neighbour sent (after finishing the frame it was
        // half way through, so the notice lands where the survivor reads it).
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
fn bad_ring_shapes_are_config_errors() {
    for (slots, slot_bytes, credit_batch) in [(0, 8, 1), (4, 0, 1), (4, 8, 5), (4, 8, 0)] {
        let p = SimParams {
            ring: Params {
                slots,
                slot_bytes,
                credit_batch,
            },
            ..SimParams::default()
        };
        assert!(
            matches!(sim::group(2, p), Err(Error::Config(_))),
            "{slots} {slot_bytes} {credit_batch}"
        );
    }
}

/// Recursive doubling on a transport that buffers less than the message: the partner's
/// frame can arrive before this rank's own send of the buffer has left, and reducing
/// into the buffer at once used to send partly reduced data (found by the simulator).
#[test]
fn doubling_waits_for_its_own_send_before_reducing() {
    let tiny = SimParams {
        ring: Params {
            slots: 1,
            slot_bytes: 80,
            credit_batch: 1,
        },
        max_delay: 6,
        seed: 8637498011089302421,
    };
    for seed in [107837811475875163, 1, 2, 3] {
        for n in [2usize, 4, 5] {
            check_all_reduce::<f32>(Net::RdmaSim(tiny), n, 4131, ReduceOp::Avg, 1, seed, true)
                .unwrap();
        }
    }
}
