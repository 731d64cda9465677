//! A hang names who is where; an abort from another thread unblocks everything.

use crate::common;

use common::{run_all, test_config, Net};
use ferroccl::{Error, ReduceOp};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sleeps until `count` reaches `n` (or 15 s pass): lets a rank stay silent exactly as
/// long as the others need to observe its silence, whatever the machine's load.
fn wait_for(count: &AtomicUsize, n: usize) {
    let end = Instant::now() + Duration::from_secs(15);
    while count.load(Ordering::SeqCst) < n && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn short_timeout() -> ferroccl::Config {
    let mut c = test_config();
    c.timeout = Duration::from_millis(500);
    c
}

/// Ranks 0 and 1 enter all_reduce #1 while rank 2 stays behind after barrier #0: the
/// timeout says rank 2 is at #0 (barrier) and rank 1 is in #1 too — asked over the
/// network, while rank 2's own thread waits for them.
#[test]
fn a_timeout_says_which_rank_is_behind_and_where() {
    for net in [Net::Local, Net::Tcp] {
        let done = Arc::new(AtomicUsize::new(0));
        let out = run_all(
            3,
            net,
            &short_timeout(),
            Duration::from_secs(30),
            move |c| {
                c.barrier()?;
                if c.rank() == 2 {
                    wait_for(&done, 2);
                    return Ok(None);
                }
                let e = c
                    .all_reduce(&mut vec![1.0f32; 100_000], ReduceOp::Sum)
                    .unwrap_err();
                done.fetch_add(1, Ordering::SeqCst);
                Ok(Some(e))
            },
        );
        let errs: Vec<Error> = out
            .into_iter()
            .take(2)
            .map(|o| o.expect("finished").expect("ran").expect("an error"))
            .collect();
        let located: Vec<String> = errs
            .iter()
            .filter(|e| matches!(e, Error::Timeout { .. }))
            .map(|e| e.to_string())
            .collect();
        assert!(!located.is_empty(), "{net:?}: no timeout among {errs:?}");
        for t in &located {
            assert!(t.contains("all_reduce #1"), "{net:?}: {t}");
            assert!(t.contains("rank 2 is at #0 (barrier)"), "{net:?}: {t}");
            assert!(t.contains("in #1 too"), "{net:?}: {t}");
        }
    }
}

#[test]
fn a_timeout_names_a_rank_that_never_started() {
    let done = Arc::new(AtomicUsize::new(0));
    let out = run_all(
        2,
        Net::Tcp,
        &short_timeout(),
        Duration::from_secs(30),
        move |c| {
            if c.rank() == 1 {
                wait_for(&done, 1);
                return Ok(None);
            }
            let e = c.all_reduce(&mut [1u8; 10], ReduceOp::Max).unwrap_err();
            done.fetch_add(1, Ordering::SeqCst);
            Ok(Some(e))
        },
    );
    let e = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
    let t = e.to_string();
    assert!(matches!(e, Error::Timeout { .. }), "{t}");
    assert!(t.contains("rank 1 has not started any operation"), "{t}");
}

/// Another thread aborts a rank stuck waiting for a peer that never comes: the call
/// returns Aborted well before its timeout, and later calls are refused.
#[test]
fn abort_from_another_thread_unblocks_a_waiting_call() {
    for net in [Net::Local, Net::Tcp] {
        let mut cfg = test_config();
        cfg.timeout = Duration::from_secs(20);
        let out = run_all(2, net, &cfg, Duration::from_secs(30), |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(None);
            }
            let h = c.abort_handle();
            let t0 = Instant::now();
            let killer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                h.abort();
            });
            let e = c
                .all_reduce(&mut vec![1.0f64; 1000], ReduceOp::Sum)
                .unwrap_err();
            let took = t0.elapsed();
            let _ = killer.join();
            let later = c.barrier().unwrap_err();
            Ok(Some((e, took, later)))
        });
        let (e, took, later) = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
        assert!(matches!(e, Error::Aborted { .. }), "{net:?}: {e}");
        assert!(e.to_string().contains("all_reduce #0"), "{e}");
        assert!(
            *took < Duration::from_secs(2),
            "{net:?}: abort took {took:?}"
        );
        assert!(matches!(later, Error::Poisoned(_)), "{net:?}: {later}");
    }
}

#[test]
fn abort_reaches_operations_in_a_scope() {
    let mut cfg = test_config();
    cfg.timeout = Duration::from_secs(20);
    let out = run_all(2, Net::Local, &cfg, Duration::from_secs(30), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(None);
        }
        let h = c.abort_handle();
        let mut a = vec![1.0f32; 10];
        let t0 = Instant::now();
        let e = c.scope(|s| {
            let ha = s.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            h.abort();
            ha.wait().unwrap_err()
        });
        Ok(Some((e, t0.elapsed(), h.is_aborted())))
    });
    let (e, took, flagged) = out[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    assert!(*took < Duration::from_secs(2), "took {took:?}");
    assert!(flagged);
}
