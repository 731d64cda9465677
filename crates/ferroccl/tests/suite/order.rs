//! The ordering protocol of collectives on a framework's device memory
//! ([`ferroccl::order::DeviceOp`]: what the torch backend runs for CUDA tensors) on the
//! simulated device ([`ferroccl::order::sim`]): streams that run their work late, after
//! random delays, and a caching allocator with torch's rules that flags any block
//! handed out again while another stream still has work on it.
//!
//! Ranks are threads with a real communicator each (in-process links); each issues
//! collectives on its "caller" stream, runs them on an executor thread with a stream of
//! its own — a staged all-reduce whose device copies outlive the host's knowledge —
//! copies results on after the collective, consumes them on the caller's stream and
//! releases the buffers as the protocol says, then reuses the memory at once. No value
//! may be read before its producer wrote it and no block may be reused early. The
//! simulator's own checks are shown to catch each hazard the protocol prevents.

use crate::common;

use ferroccl::order::sim::{Kernel, SimBuf, SimDevice, SimParams};
use ferroccl::order::{DeviceOp, Release, StreamId, Streams};
use ferroccl::{Communicator, Config, Error, ReduceOp};
use proptest::prelude::*;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);
/// What a later owner writes into reused memory.
const GARBAGE: u64 = 0xDEAD_BEEF;

fn caller(r: usize) -> StreamId {
    StreamId(100 + r as u64)
}

fn ours(r: usize) -> StreamId {
    StreamId(200 + r as u64)
}

fn value(seed: u64, k: usize, r: usize) -> u64 {
    common::splitmix(seed ^ ((k as u64) << 20) ^ r as u64) % 1000 + 1
}

/// How one rank's iteration goes (drawn per rank and iteration).
#[derive(Clone, Copy, Debug)]
struct Mode {
    /// The caller waits for the report before doing anything else (else it first
    /// allocates and scribbles on other memory).
    blocking: bool,
    /// The executor waits for the device at the end of the collective.
    host_sync_end: bool,
    /// A copy into a second output is queued on our stream after the collective.
    copy_back: bool,
    /// The collective fails after it queued its device work.
    fail: bool,
    /// The producer of the input is held back this long on the caller's stream.
    late_producer_us: u64,
}

fn mode(seed: u64, k: usize, r: usize) -> Mode {
    let x = common::splitmix(seed.wrapping_add(7919 * k as u64 + r as u64));
    Mode {
        blocking: x & 1 == 0,
        host_sync_end: x & 2 == 0,
        copy_back: x & 4 == 0,
        fail: x.is_multiple_of(11),
        late_producer_us: (x >> 8) % 300,
    }
}

/// What the executor is handed, and what it reports.
struct Job {
    op: Arc<DeviceOp<SimDevice>>,
    x: SimBuf,
    y: SimBuf,
    z: SimBuf,
    v_in: u64,
    mode: Mode,
}

/// The executor of one rank: runs each job's staged all-reduce on `ours`, through the
/// protocol, and reports (the sum, or the error).
fn executor(
    sim: Arc<SimDevice>,
    comm: Communicator,
    jobs: mpsc::Receiver<Job>,
    reports: mpsc::Sender<ferroccl::Result<u64>>,
) {
    let me = ours(comm.rank());
    for j in jobs {
        let r = j.op.run(|| {
            // Device to host, the host step (a real all-reduce between the ranks),
            // host to device: what staging through pinned memory does.
            let staged = Arc::new(Mutex::new(Vec::new()));
            let out = Kernel::new("stage-out")
                .read(j.x, Some(j.v_in))
                .capture(staged.clone());
            sim.launch(me, out);
            let e = sim.record(me)?;
            sim.host_wait(&e)?;
            let got = staged.lock().unwrap()[0];
            let mut v = [got as f64];
            comm.all_reduce(&mut v, ReduceOp::Sum)?;
            let sum = v[0] as u64;
            sim.launch(me, Kernel::new("stage-in").write(j.y, sum));
            if j.mode.host_sync_end {
                let e = sim.record(me)?;
                sim.host_wait(&e)?;
            }
            if j.mode.fail {
                return Err(Error::InvalidArgument("failed on purpose".into()));
            }
            Ok(sum)
        });
        let r = r.and_then(|sum| {
            if j.mode.copy_back {
                let k = Kernel::new("copy-back")
                    .read(j.y, Some(sum))
                    .write(j.z, sum);
                sim.launch(me, k);
                j.op.after()?;
            }
            Ok(sum)
        });
        if reports.send(r).is_err() {
            return;
        }
    }
}

/// Scribbles on freshly allocated memory of `stream` (a later owner), then frees it.
fn reuse(sim: &SimDevice, stream: StreamId, blocks: usize) {
    let held: Vec<SimBuf> = (0..blocks).map(|_| sim.alloc(stream)).collect();
    for &g in &held {
        sim.launch(stream, Kernel::new("later owner").write(g, GARBAGE));
    }
    for g in held {
        sim.free(g);
    }
}

/// One rank: `iters` collectives through the protocol; returns the sums it consumed.
fn rank_main(
    sim: Arc<SimDevice>,
    comm: Communicator,
    iters: usize,
    seed: u64,
) -> ferroccl::Result<Vec<u64>> {
    let (r, n) = (comm.rank(), comm.world_size());
    let c = caller(r);
    let (jtx, jrx) = mpsc::channel();
    let (rtx, rrx) = mpsc::channel();
    let s2 = sim.clone();
    let exec = std::thread::spawn(move || executor(s2, comm, jrx, rtx));
    let mut sums = Vec::new();
    for k in 0..iters {
        let m = mode(seed, k, r);
        let v_in = value(seed, k, r);
        let want: u64 = (0..n).map(|q| value(seed, k, q)).sum();
        let (x, y, z) = (sim.alloc(c), sim.alloc(c), sim.alloc(c));
        let gate = sim.hold(c);
        sim.launch(c, Kernel::new("produce").write(x, v_in));
        // The collective's input is issued while its producer is still queued.
        let op = Arc::new(DeviceOp::issue(sim.clone(), ours(r), c)?);
        let job = Job {
            op: op.clone(),
            x,
            y,
            z,
            v_in,
            mode: m,
        };
        jtx.send(job).expect("the executor is running");
        std::thread::sleep(Duration::from_micros(m.late_producer_us));
        gate.open();
        if !m.blocking {
            reuse(&sim, c, 2);
        }
        let report = rrx.recv().expect("the executor reports");
        match &report {
            Ok(sum) => {
                assert_eq!(*sum, want, "rank {r} iteration {k}: the host's sum");
                op.wait_on(c)?;
                let mut use_it = Kernel::new("consume").read(y, Some(want));
                if m.copy_back {
                    use_it = use_it.read(z, Some(want));
                }
                sim.launch(c, use_it);
                sums.push(*sum);
            }
            Err(e) => assert!(m.fail, "rank {r} iteration {k}: {e}"),
        }
        match op.release() {
            Release::Now => assert!(op.query()?, "released Now before its end"),
            Release::OnStream(s) => {
                assert_eq!(s, ours(r));
                for b in [x, y, z] {
                    sim.record_stream(b, s);
                }
            }
        }
        for b in [x, y, z] {
            sim.free(b);
        }
        reuse(&sim, c, 4);
    }
    drop(jtx);
    exec.join().expect("the executor panicked");
    Ok(sums)
}

fn run(n: usize, params: SimParams, iters: usize, seed: u64) -> Result<(), String> {
    common::with_deadline(DEADLINE, move || {
        let sim = SimDevice::new(params);
        let comms = Communicator::local_group(n, &Config::default()).map_err(|e| e.to_string())?;
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let sim = sim.clone();
                std::thread::spawn(move || rank_main(sim, c, iters, seed))
            })
            .collect();
        for (r, h) in ranks.into_iter().enumerate() {
            let sums = h
                .join()
                .map_err(|_| format!("rank {r} panicked"))?
                .map_err(|e| format!("rank {r}: {e}"))?;
            let fails = (0..iters).filter(|&k| mode(seed, k, r).fail).count();
            if sums.len() != iters - fails {
                return Err(format!("rank {r}: {} sums for {iters} calls", sums.len()));
            }
        }
        sim.drain();
        match sim.violations().as_slice() {
            [] => Ok(()),
            v => Err(format!("{} violation(s): {v:#?}", v.len())),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    /// Random delays on every stream, random modes per rank and call: every value is
    /// read after its producer, no block is reused early.
    #[test]
    fn device_ops_are_ordered_with_the_callers_stream(n in 1usize..=4, us in 0u64..300,
                                                      seed in any::<u64>()) {
        let r = run(n, SimParams { max_delay: Duration::from_micros(us), seed }, 12, seed);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Slow streams and many calls on one rank pair, the case most likely to expose an
/// early release: the copies into the outputs are still queued when the host learns
/// the collective is over.
#[test]
fn slow_streams_never_see_a_buffer_reused_early() {
    let p = SimParams {
        max_delay: Duration::from_millis(2),
        seed: 99,
    };
    run(2, p, 30, 5).unwrap();
}

fn no_delay() -> Arc<SimDevice> {
    SimDevice::new(SimParams {
        max_delay: Duration::ZERO,
        seed: 1,
    })
}

/// Runs `stream` up to now (host side).
fn settle(sim: &SimDevice, stream: StreamId) {
    let e = sim.record(stream).unwrap();
    sim.host_wait(&e).unwrap();
}

fn has(sim: &SimDevice, what: &str) -> bool {
    sim.violations().iter().any(|v| v.contains(what))
}

/// The simulator catches a collective that reads its input without waiting for the
/// caller's stream — what `DeviceOp::run`'s first step prevents.
#[test]
fn a_read_before_the_producer_is_caught_and_the_protocol_prevents_it() {
    let (c, o) = (caller(0), ours(0));
    let sim = no_delay();
    let x = sim.alloc(c);
    let gate = sim.hold(c);
    sim.launch(c, Kernel::new("produce").write(x, 7));
    sim.launch(o, Kernel::new("collective").read(x, Some(7)));
    settle(&sim, o);
    gate.open();
    sim.drain();
    assert!(
        has(&sim, "collective on stream 200 read 0"),
        "{:?}",
        sim.violations()
    );

    let sim = no_delay();
    let x = sim.alloc(c);
    let gate = sim.hold(c);
    sim.launch(c, Kernel::new("produce").write(x, 7));
    let op = DeviceOp::issue(sim.clone(), o, c).unwrap();
    op.run(|| {
        sim.launch(o, Kernel::new("collective").read(x, Some(7)));
        Ok(())
    })
    .unwrap();
    // Our stream runs what it can: it stops at the wait for the held producer.
    sim.quiesce(o);
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert!(!op.query().unwrap(), "done before the held producer ran");
    assert_eq!(op.release(), Release::OnStream(o));
    gate.open();
    sim.drain();
    assert!(op.query().unwrap());
    assert_eq!(op.release(), Release::Now);
    assert_eq!(sim.violations(), Vec::<String>::new());
}

/// Freeing a buffer that our stream still uses, without tying it to our stream, lets
/// the allocator hand it out again: caught at once. With `record_stream` it is not
/// reused until our stream is past it.
#[test]
fn an_early_release_is_caught_and_record_stream_prevents_it() {
    let (c, o) = (caller(0), ours(0));
    let sim = no_delay();
    let x = sim.alloc(c);
    let gate = sim.hold(o);
    sim.launch(o, Kernel::new("collective").read(x, None));
    sim.free(x);
    let again = sim.alloc(c);
    assert!(has(&sim, "released early"), "{:?}", sim.violations());
    assert_eq!(
        again.block(),
        x.block(),
        "the allocator reuses the freed block"
    );
    gate.open();
    sim.drain();

    let sim = no_delay();
    let x = sim.alloc(c);
    let gate = sim.hold(o);
    sim.launch(o, Kernel::new("collective").read(x, None));
    sim.record_stream(x, o);
    sim.free(x);
    let other = sim.alloc(c);
    sim.launch(c, Kernel::new("later owner").write(other, GARBAGE));
    gate.open();
    sim.drain();
    assert_eq!(sim.violations(), Vec::<String>::new());
    // Once our stream passed the release, the block is reused.
    sim.free(other);
    let _ = sim.alloc(c);
    let _ = sim.alloc(c);
    assert_eq!(sim.violations(), Vec::<String>::new());
}

/// A consumer on the caller's stream that does not wait for the collective's end reads
/// the output before it was written; `wait_on` orders it.
#[test]
fn a_consumer_that_does_not_wait_is_caught_and_wait_on_orders_it() {
    let (c, o) = (caller(0), ours(0));
    let sim = no_delay();
    let y = sim.alloc(c);
    let gate = sim.hold(o);
    sim.launch(o, Kernel::new("collective").write(y, 5));
    sim.launch(c, Kernel::new("consume").read(y, Some(5)));
    settle(&sim, c);
    gate.open();
    sim.drain();
    assert!(
        has(&sim, "consume on stream 100 read 0"),
        "{:?}",
        sim.violations()
    );

    let sim = no_delay();
    let y = sim.alloc(c);
    let op = DeviceOp::issue(sim.clone(), o, c).unwrap();
    let gate = sim.hold(o);
    op.run(|| {
        sim.launch(o, Kernel::new("collective").write(y, 5));
        Ok(())
    })
    .unwrap();
    op.wait_on(c).unwrap();
    sim.launch(c, Kernel::new("consume").read(y, Some(5)));
    gate.open();
    sim.drain();
    assert_eq!(sim.violations(), Vec::<String>::new());
}

/// A collective that fails after queueing device work still records its end: its
/// buffers are released behind our stream, and a stream can still be ordered after it.
/// Waiting for an op that has not run, or running one twice, is refused.
#[test]
fn a_failed_op_keeps_its_buffers_until_its_queued_work_is_over() {
    let (c, o) = (caller(0), ours(0));
    let sim = no_delay();
    let y = sim.alloc(c);
    let op = DeviceOp::issue(sim.clone(), o, c).unwrap();
    assert!(op.wait_on(c).is_err(), "a wait before the op ran");
    assert_eq!(op.release(), Release::OnStream(o));
    let gate = sim.hold(o);
    let r: ferroccl::Result<()> = op.run(|| {
        sim.launch(o, Kernel::new("half a collective").write(y, 1));
        Err(Error::InvalidArgument("a peer failed".into()))
    });
    assert!(r.is_err());
    assert!(op.run(|| Ok(())).is_err(), "an op ran twice");
    assert_eq!(op.release(), Release::OnStream(o));
    sim.record_stream(y, o);
    sim.free(y);
    reuse(&sim, c, 3);
    op.wait_on(c).unwrap();
    gate.open();
    sim.drain();
    assert!(op.query().unwrap());
    assert_eq!(sim.violations(), Vec::<String>::new());
}
