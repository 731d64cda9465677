//! The flight recorder: every operation once per rank, in order, with its bytes and
//! outcome; a failure is recorded with its error and the peer waited on; dumps read
//! back exactly; the ring keeps the last N. No assertion depends on timing.

use crate::common;

use common::{run, run_all, test_config, Net};
use ferroccl::trace::{read_dir, read_file, Line};
use ferroccl::ReduceOp;
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

/// A fresh directory under the system temp dir, unique to this test and process.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroccl-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn every_operation_is_recorded_once_per_rank_with_its_bytes() {
    for net in [Net::Local, Net::Tcp] {
        let dir = scratch(&format!("ops-{net:?}"));
        let d = dir.clone();
        run(3, net, &test_config(), DEADLINE, move |c| {
            let mut v = vec![1.0f32; 1000];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            c.broadcast(&mut v, 2)?;
            c.barrier()?;
            c.scope(|s| {
                let h = s.all_reduce(&mut v, ReduceOp::Max)?;
                h.wait().map(|_| ())
            })?;
            c.dump_trace(&d)?;
            Ok(())
        })
        .unwrap();
        let ranks = read_dir(&dir).unwrap();
        assert_eq!(ranks.len(), 3);
        for (r, t) in ranks.iter().enumerate() {
            assert_eq!((t.info.rank, t.info.world_size), (r, 3));
            assert_eq!(t.info.reason, "request");
            let kinds: Vec<(&str, u64)> = t.ops.iter().map(|o| (o.kind.as_str(), o.seq)).collect();
            assert_eq!(
                kinds,
                [
                    ("all_reduce", 0),
                    ("broadcast", 1),
                    ("barrier", 2),
                    ("all_reduce", 3)
                ],
                "{net:?} rank {r}"
            );
            for o in &t.ops {
                assert!(o.ok(), "{o:?}");
                let end = o.end_ns.expect("ended");
                assert!(o.enqueue_ns <= o.start_ns && o.start_ns <= end, "{o:?}");
                assert_eq!(o.waiting_on, None);
            }
            let ar = &t.ops[0];
            assert_eq!(
                (ar.dtype.as_str(), ar.count, ar.op.as_deref()),
                ("float", 1000, Some("sum"))
            );
            // A ring all-reduce of 4000 bytes over 3 ranks sends 2/3 of it (plus
            // headers) to the right neighbour only.
            let sent: u64 = ar.links.iter().map(|l| l.sent).sum();
            assert!(sent >= 2 * 4000 / 3, "{ar:?}");
            assert_eq!(t.ops[1].root, Some(2));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_failed_operation_is_recorded_with_its_error() {
    let dir = scratch("failed");
    let d = dir.clone();
    let out = run_all(2, Net::Local, &test_config(), DEADLINE, move |c| {
        c.barrier()?;
        let n = if c.rank() == 0 { 10 } else { 11 };
        let e = c.all_reduce(&mut vec![0u8; n], ReduceOp::Sum).err();
        c.dump_trace(&d)?;
        Ok(e)
    });
    for o in out {
        assert!(o.expect("finished").expect("dumped").is_some());
    }
    for t in read_dir(&dir).unwrap() {
        let last = t.ops.last().expect("ops");
        assert_eq!((last.kind.as_str(), last.seq), ("all_reduce", 1));
        assert!(!last.ok());
        assert!(
            last.outcome.contains("mismatched") || last.outcome.contains("failed first"),
            "{last:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ring_keeps_the_last_operations_and_counts_the_rest() {
    let dir = scratch("ring");
    let d = dir.clone();
    let mut cfg = test_config();
    cfg.tuning.trace_capacity = 4;
    run(2, Net::Local, &cfg, DEADLINE, move |c| {
        for _ in 0..10 {
            c.barrier()?;
        }
        c.dump_trace(&d)?;
        Ok(())
    })
    .unwrap();
    for t in read_dir(&dir).unwrap() {
        let seqs: Vec<u64> = t.ops.iter().map(|o| o.seq).collect();
        assert_eq!(seqs, [6, 7, 8, 9]);
        assert_eq!((t.info.capacity, t.info.dropped), (4, 6));
    }
    // A file that is not a trace is refused with its name and line.
    let bad = dir.join("rank-7.jsonl");
    std::fs::write(&bad, "{\"type\":\"op\"}\n").unwrap();
    let e = read_file(&bad).unwrap_err().to_string();
    assert!(e.contains("rank-7.jsonl") && e.contains("line 1"), "{e}");
    let e = read_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("rank-7.jsonl"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trace_lines_round_trip() {
    let dir = scratch("lines");
    let d = dir.clone();
    run(1, Net::Local, &test_config(), DEADLINE, move |c| {
        c.barrier()?;
        c.dump_trace(&d).map(|_| ())
    })
    .unwrap();
    let text = std::fs::read_to_string(dir.join("rank-0.jsonl")).unwrap();
    for l in text.lines() {
        let line: Line = serde_json::from_str(l).unwrap();
        assert_eq!(serde_json::to_string(&line).unwrap(), l);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
