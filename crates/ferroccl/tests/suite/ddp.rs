//! The framework-free gradient reducer (`ferroccl::ddp`): buckets, accumulation,
//! wire types, and what it does when its communicator fails.

use crate::common::{run, run_all, test_config, Net};
use ferroccl::ddp::{GradReducer, WireDtype};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

/// `end_pass` then `wait_bucket` one bucket at a time (what a per-bucket optimizer step
/// does) gives each bucket's average once that bucket is waited for, the same as
/// `finish_pass`; a bucket with nothing in flight answers false.
#[test]
fn buckets_can_be_waited_for_one_at_a_time() {
    let lens = [300usize, 200, 100];
    let out = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let r = c.rank() as f32;
        // 400 B per bucket: one parameter each, the last first.
        let mut red = GradReducer::new(c, &lens, 400, 1200, WireDtype::F32);
        red.begin_pass(true);
        for p in (0..lens.len()).rev() {
            red.grad_ready(p, &vec![r + p as f32; lens[p]])?;
        }
        red.end_pass()?;
        let mut seen = Vec::new();
        for b in 0..red.plan().buckets.len() {
            let waited = red.wait_bucket(b)?;
            let p = red.plan().buckets[b].params[0];
            seen.push((waited, p, red.grad(p).to_vec()));
        }
        let again = red.wait_bucket(0)?;
        Ok((seen, again))
    })
    .unwrap();
    for (seen, again) in out {
        assert!(!again, "a bucket already waited for has nothing in flight");
        let order: Vec<usize> = seen.iter().map(|s| s.1).collect();
        assert_eq!(order, vec![2, 1, 0], "buckets run from the last parameter");
        for (waited, p, g) in seen {
            assert!(waited);
            // mean over ranks 0 and 1 of r + p
            assert_eq!(g, vec![0.5 + p as f32; lens[p]], "param {p}");
        }
    }
}

#[test]
fn reducer_averages_accumulates_and_refuses_bad_gradients() {
    let lens = [3usize, 1000, 7, 20_000, 5];
    let out = run(3, Net::Local, &test_config(), DEADLINE, move |c| {
        let r = c.rank() as f32;
        // First bucket 1 KiB, then 16 KiB: several buckets.
        let mut red = GradReducer::new(c, &lens, 1024, 16 << 10, WireDtype::F32);
        let buckets = red.plan().buckets.len();
        // Pass 1 without communication, pass 2 synchronising: the sum of both,
        // averaged over ranks.
        for (pass, sync) in [(1.0f32, false), (2.0, true)] {
            red.begin_pass(sync);
            for p in (0..lens.len()).rev() {
                let g: Vec<f32> = (0..lens[p]).map(|i| pass * (r + i as f32)).collect();
                red.grad_ready(p, &g)?;
            }
            red.finish_pass()?;
        }
        let got: Vec<Vec<f32>> = (0..lens.len()).map(|p| red.grad(p).to_vec()).collect();
        red.zero();
        // Errors: wrong length, twice in a pass, missing at the end.
        red.begin_pass(true);
        let e1 = red.grad_ready(0, &[1.0]).unwrap_err();
        red.grad_ready(4, &[0.0; 5])?;
        let e2 = red.grad_ready(4, &[0.0; 5]).unwrap_err();
        let e3 = red.finish_pass().unwrap_err();
        Ok((
            buckets,
            got,
            [e1.to_string(), e2.to_string(), e3.to_string()],
        ))
    })
    .unwrap();
    let (buckets, got, errs) = &out[0];
    assert!(*buckets >= 3, "{buckets} buckets");
    for (p, g) in got.iter().enumerate() {
        for (i, x) in g.iter().enumerate() {
            // mean over ranks of 3·(r + i) = 3·(1 + i)
            let want = 3.0 * (1.0 + i as f32);
            assert!(
                (x - want).abs() <= 1e-3 * want.max(1.0),
                "param {p}[{i}] = {x}, want {want}"
            );
        }
    }
    assert!(errs[0].contains("has 1 elements"), "{}", errs[0]);
    assert!(errs[1].contains("twice"), "{}", errs[1]);
    assert!(errs[2].contains("without a gradient"), "{}", errs[2]);
    for r in &out[1..] {
        assert_eq!(r.1, *got);
    }
}

#[test]
fn reducer_stays_usable_after_its_communicator_fails() {
    let out = run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
        let mut red = GradReducer::new(c, &[4, 4], 8, 8, WireDtype::F32);
        red.begin_pass(true);
        if c.rank() == 1 {
            c.abort_handle().abort();
        }
        // Rank 1's collectives fail at once (aborted); rank 0's then see it gone.
        let r = red
            .grad_ready(1, &[1.0; 4])
            .and_then(|_| red.grad_ready(0, &[1.0; 4]));
        let r = r.and_then(|_| red.finish_pass().map(|_| ()));
        // Whatever failed, the gradients keep their shape.
        Ok((r.is_err(), red.grad(0).len(), red.grad(1).len()))
    });
    for (rank, o) in out.into_iter().enumerate() {
        let (failed, a, b) = o.expect("finished in time").expect("no panic");
        assert!(failed, "rank {rank} did not see the failure");
        assert_eq!((a, b), (4, 4));
    }
}
