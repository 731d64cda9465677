//! A compact sweep of every collective, element type and operator over the in-process
//! transports (pipes, and simulated memory peers for the pull executor), small enough to
//! run under valgrind memcheck in CI (`.ci/run` runs `inprocess::` under it): every
//! path through the engine, the kernels and the non-blocking queue, with zero memory
//! errors.

use crate::common;

use common::checks::{
    check_all_gather, check_all_reduce, check_broadcast, check_reduce, check_reduce_scatter,
};
use common::{run, test_config, Net};
use ferroccl::testing::SimMemParams;
use ferroccl::{DataType, ReduceOp};
use std::time::Duration;

fn nets() -> [Net; 3] {
    let sim = SimMemParams {
        max_delay: Duration::from_micros(20),
        seed: 5,
        stall: None,
        device_order: false,
    };
    [
        Net::Local,
        Net::MemSim(sim),
        Net::MemSim(SimMemParams {
            device_order: true,
            ..sim
        }),
    ]
}

#[test]
fn every_collective_type_and_op_in_process() {
    for net in nets() {
        for dt in DataType::ALL {
            for (i, op) in ReduceOp::ALL.into_iter().enumerate() {
                let (n, seed) = (2 + i % 2, 100 + i as u64);
                // 37 elements: uneven chunks; 2-element segments: many frames.
                for small in [false, true] {
                    let r = for_dtype!(dt, check_all_reduce(net, n, 37, op, 2, seed, small));
                    assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
                }
                let r = for_dtype!(
                    dt,
                    check_reduce_scatter(net, n, 12 * n, op, 2, seed, i % 2 == 0)
                );
                assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
                let r = for_dtype!(dt, check_reduce(net, 3, 29, op, i % 3, 4, seed, false));
                assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
            }
            let r = for_dtype!(dt, check_all_gather(net, 3, 21, 2, 9, true));
            assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
            let r = for_dtype!(dt, check_broadcast(net, 3, 33, 1, 4, 9, false));
            assert!(r.is_ok(), "{net:?}: {}", r.unwrap_err());
        }
    }
}

#[test]
fn non_blocking_and_point_to_point_in_process() {
    let out = run(
        3,
        Net::Local,
        &test_config(),
        Duration::from_secs(60),
        |c| {
            let r = c.rank();
            let (mut a, mut b) = (vec![r as f32; 100], vec![1u8; 7]);
            let (sa, sb) = c.scope(|s| -> ferroccl::Result<(f32, u8)> {
                let ha = s.all_reduce(&mut a, ReduceOp::Sum)?;
                let hb = s.broadcast(&mut b, 2)?;
                Ok((ha.wait()?[99], hb.wait()?[0]))
            })?;
            let p = c.all_reduce_start(vec![1i64; 50], ReduceOp::Sum)?;
            let mut got = [0i32; 5];
            let (right, left) = ((r + 1) % 3, (r + 2) % 3);
            if r == 0 {
                c.send(&[r as i32; 5], right, 3)?;
                c.recv(&mut got, left, 3)?;
            } else {
                c.recv(&mut got, left, 3)?;
                c.send(&[r as i32; 5], right, 3)?;
            }
            Ok((sa, sb, p.wait()?[49], got[0]))
        },
    )
    .unwrap();
    for (r, &(sa, sb, p, got)) in out.iter().enumerate() {
        assert_eq!((sa, sb, p), (3.0, 1, 3), "rank {r}");
        assert_eq!(got, ((r + 2) % 3) as i32, "rank {r}");
    }
}
