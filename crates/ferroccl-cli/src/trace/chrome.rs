//! The Chrome/Perfetto trace: a track per rank, each operation a slice, waits on
//! peers nested.

use super::merge::{ns, to_ref, Merged};
use serde_json::{json, Value};
// ---------------------------------------------------------------------------------
// The Chrome/Perfetto trace.

/// µs after time zero, as the trace event format wants them.
pub(super) fn us(t: i64, t0: i64) -> f64 {
    t.saturating_sub(t0) as f64 / 1e3
}

pub(super) fn chrome_trace(m: &Merged<'_>) -> Value {
    let mut ev: Vec<Value> = Vec::new();
    ev.push(json!({"ph": "M", "pid": 0, "name": "process_name",
        "args": {"name": format!("ferroccl job ({} ranks)", m.world_size)}}));
    for r in 0..m.world_size {
        let name = match m.index(r) {
            Some(i) => {
                let info = &m.traces[i].info;
                format!("rank {r} ({}, pid {})", info.host, info.pid)
            }
            None => format!("rank {r} (no trace file)"),
        };
        ev.push(
            json!({"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": name}}),
        );
        ev.push(json!({"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}}));
    }
    for (t, ops) in m.traces.iter().zip(&m.ops) {
        let r = t.info.rank;
        for o in ops {
            let rec = o.rec;
            let links: serde_json::Map<String, Value> = rec
                .links
                .iter()
                .map(|l| {
                    (
                        format!("rank {}", l.peer),
                        json!({"sent": l.sent, "recv": l.recv}),
                    )
                })
                .collect();
            let waited: serde_json::Map<String, Value> = rec
                .waits
                .iter()
                .map(|w| (format!("rank {}", w.peer), json!(w.ns as f64 / 1e3)))
                .collect();
            let mut e = json!({
                "ph": "X", "pid": 0, "tid": r, "cat": rec.kind,
                "name": o.label(),
                "ts": us(o.start, m.t0),
                "dur": o.end.saturating_sub(o.start) as f64 / 1e3,
                "args": {
                    "dtype": rec.dtype, "count": rec.count, "op": rec.op, "root": rec.root,
                    "algo": rec.algo, "outcome": rec.outcome, "waiting_on": rec.waiting_on,
                    "queued_us": o.start.saturating_sub(o.enqueue).max(0) as f64 / 1e3,
                    "bytes_per_link": links, "waited_us": waited,
                },
            });
            if o.failed() {
                e["cname"] = json!("terrible");
            } else if o.running {
                e["cname"] = json!("bad");
            }
            ev.push(e);
            // Only the total per peer is known: lay the waits end to end from the start.
            let mut at = o.start;
            for w in &rec.waits {
                let d = ns(w.ns).min(o.end.saturating_sub(at));
                if d <= 0 {
                    continue;
                }
                ev.push(json!({
                    "ph": "X", "pid": 0, "tid": r, "cat": "wait",
                    "name": format!("wait rank {}", w.peer),
                    "ts": us(at, m.t0), "dur": d as f64 / 1e3,
                    "args": {"peer": w.peer, "total_us": w.ns as f64 / 1e3,
                             "note": "total time waited on this peer; its place inside the operation is not recorded"},
                }));
                at += d;
            }
        }
        let dumped = to_ref(t.info.dumped_ns, t.info.clock_offset_ns);
        ev.push(json!({"ph": "i", "s": "t", "pid": 0, "tid": r,
            "name": format!("dump ({})", t.info.reason), "ts": us(dumped, m.t0)}));
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ns",
        "otherData": {
            "tool": "ferroccl trace",
            "world_size": m.world_size,
            "time_zero_unix_ns": m.t0,
            "clock": "reference clock (each rank's times minus its clock_offset_ns)",
        },
    })
}
