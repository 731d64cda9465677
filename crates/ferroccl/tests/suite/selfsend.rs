//! Messages a rank sends itself: a send to itself is eager (it completes at once, as
//! MPI's self-send, whatever its size), and a blocking receive from itself that no
//! earlier send can satisfy is refused at once with a typed error. Neither ever waits
//! for the timeout: the tests' timeout is an hour, and their deadline a minute.

use crate::common::{ensure, run, run_all, test_config, Net};
use ferroccl::{Communicator, Config, Error, ReduceOp};
use std::time::Duration;

type R<T> = ferroccl::Result<T>;

/// A timeout no test reaches: a call that waited for it fails the test's deadline.
fn hour_timeout() -> Config {
    let mut c = test_config();
    c.tuning.timeout = Duration::from_secs(3600);
    c
}

const DEADLINE: Duration = Duration::from_secs(60);

/// Sends to itself before any receive (one larger than any link's buffer), a
/// collective between, then the receives in order; a receive posted before its send;
/// and a batch that receives before it sends.
fn to_itself(c: &mut Communicator) -> R<()> {
    let (r, n) = (c.rank(), c.world_size());
    let big: Vec<f32> = (0..(5usize << 20) / 4)
        .map(|i| ((i * 7 + r) % 1009) as f32)
        .collect();
    c.send(&big, r, 1)?;
    c.send(&[r as i64, -5], r, 2)?;
    let mut sum = [1i32];
    c.all_reduce(&mut sum, ReduceOp::Sum)?;
    ensure(sum[0] as usize == n, || "all-reduce between".into())?;
    let mut got = vec![0f32; big.len()];
    c.recv(&mut got, r, 1)?;
    ensure(got == big, || "the large message to itself".into())?;
    let mut small = [0i64; 2];
    c.recv(&mut small, r, 2)?;
    ensure(small == [r as i64, -5], || format!("small: {small:?}"))?;
    // A receive posted first takes the send straight.
    let p = c.recv_start(vec![0u8; 3], r, 3)?;
    c.send(&[1u8, 2, 3], r, 3)?;
    ensure(p.wait()? == vec![1, 2, 3], || "receive posted first".into())?;
    // One batch, the receive listed before the send.
    let (mut x, y) = ([0i32; 4], [9i32, 8, 7, 6]);
    c.p2p_batch(|b| {
        b.recv(&mut x, r, 4).send(&y, r, 4);
    })?;
    ensure(x == y, || format!("batch: {x:?}"))?;
    Ok(())
}

#[test]
fn sends_to_itself_complete_at_once_on_every_transport() {
    run(1, Net::Local, &hour_timeout(), DEADLINE, to_itself).unwrap();
    for net in [Net::Local, Net::Tcp, Net::Shm] {
        run(3, net, &hour_timeout(), DEADLINE, to_itself)
            .unwrap_or_else(|e| panic!("{net:?}: {e}"));
    }
}

/// A blocking receive from itself with nothing sent, and a batch that only receives
/// from itself: refused at once on every rank, naming the cause.
#[test]
fn a_receive_from_itself_that_nothing_can_satisfy_is_refused_at_once() {
    type Body = fn(&mut Communicator) -> R<()>;
    let cases: [(&str, Body); 3] = [
        ("recv", |c| c.recv(&mut [0i32; 4], c.rank(), 0)),
        ("p2p_batch", |c| {
            let mut x = [0i32; 4];
            c.p2p_batch(|b| {
                b.recv(&mut x, c.rank(), 0);
            })
        }),
        // One send to itself, two receives: the second has nothing to take.
        ("recv", |c| {
            let r = c.rank();
            c.send(&[1i32], r, 0)?;
            c.recv(&mut [0i32], r, 0)?;
            c.recv(&mut [0i32], r, 0)
        }),
    ];
    for net in [Net::Local, Net::Tcp] {
        for (what, body) in cases {
            let out = run_all(2, net, &hour_timeout(), DEADLINE, body);
            for (r, o) in out.into_iter().enumerate() {
                match o {
                    Some(Err(Error::InvalidArgument(m))) => assert!(
                        m.starts_with(what) && m.contains("from itself"),
                        "{net:?} rank {r}: {m}"
                    ),
                    other => panic!("{net:?} rank {r} {what}: {other:?}"),
                }
            }
        }
    }
}

/// A receive from itself that meets a message of another tag fails with a mismatch
/// naming both, at once.
#[test]
fn a_message_to_itself_of_another_tag_is_a_mismatch() {
    let out = run_all(1, Net::Local, &hour_timeout(), DEADLINE, |c| {
        c.send(&[1i32, 2], 0, 7)?;
        c.recv(&mut [0i32; 2], 0, 8)
    });
    match out.into_iter().next().flatten() {
        Some(Err(Error::Mismatch {
            rank: 0,
            peer: 0,
            ours,
            theirs,
        })) => {
            assert!(
                ours.contains("tag 8") && theirs.contains("tag 7"),
                "{ours} / {theirs}"
            );
        }
        other => panic!("{other:?}"),
    }
}
