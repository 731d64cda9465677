//! The collectives over the in-process transport: all-reduce, reduce-scatter,
//! all-gather and broadcast among 4 ranks that are threads of this process
//! (`Communicator::local_group`). Rank 0 runs in criterion's thread; ranks 1..3 are
//! worker threads told how many iterations to run, so one timed batch is `iters`
//! collectives on every rank, timed on rank 0 from start to the last rank's finish.
//!
//! Throughput is S (the buffer size; the gathered size for reduce-scatter and
//! all-gather), so criterion's rate is nccl-tests' algbw, in GiB/s (2^30 B/s, where
//! nccl-tests' GB is 1e9: multiply by 1.074); busbw = algbw × 2(n−1)/n for
//! all-reduce, × (n−1)/n for reduce-scatter and all-gather, × 1 for broadcast.
//!
//! Buffers are zeros: repeated sums of anything else would grow to infinity over the
//! iterations (BENCHMARKS.md allows zeros for exactly this); results are checked by the
//! test suite, not here. Four threads on a two-core machine are oversubscribed: compare
//! these numbers with each other, run by run, not with a real network.
//!
//! Quick pass: `cargo bench --bench collectives -- --warm-up-time 1 --measurement-time 2`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferroccl::{Communicator, Config, ReduceOp};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const RANKS: usize = 4;
const SIZES: [usize; 3] = [64 << 10, 1 << 20, 16 << 20];

#[derive(Clone, Copy, Debug)]
enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
            Coll::Broadcast => "broadcast",
        }
    }
}

/// One rank's buffers (f32, `count` elements of the whole buffer).
struct Bufs {
    send: Vec<f32>,
    recv: Vec<f32>,
}

impl Bufs {
    fn run(&mut self, c: &Communicator, coll: Coll, count: usize) -> ferroccl::Result<()> {
        if self.send.len() < count {
            self.send = vec![0.0; count];
            self.recv = vec![0.0; count];
        }
        let n = c.world_size();
        match coll {
            Coll::AllReduce => c.all_reduce(&mut self.recv[..count], ReduceOp::Sum),
            Coll::ReduceScatter => c.reduce_scatter(
                &self.send[..count],
                &mut self.recv[..count / n],
                ReduceOp::Sum,
            ),
            Coll::AllGather => c.all_gather(&self.send[..count / n], &mut self.recv[..count]),
            Coll::Broadcast => c.broadcast(&mut self.recv[..count], 0),
        }
    }
}

enum Job {
    Run {
        coll: Coll,
        count: usize,
        iters: u64,
    },
}

/// Ranks 1.. as threads waiting for jobs; rank 0 stays with the caller.
struct Group {
    rank0: Communicator,
    bufs0: Bufs,
    jobs: Vec<Sender<Job>>,
    done: Receiver<ferroccl::Result<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl Group {
    fn new() -> Self {
        let mut comms = Communicator::local_group(RANKS, &Config::new(0, 1, ""))
            .expect("local group")
            .into_iter();
        let rank0 = comms.next().expect("rank 0");
        let (done_tx, done) = channel();
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        for c in comms {
            let (tx, rx) = channel::<Job>();
            let done_tx = done_tx.clone();
            jobs.push(tx);
            threads.push(std::thread::spawn(move || {
                let mut b = Bufs {
                    send: Vec::new(),
                    recv: Vec::new(),
                };
                // Ends when the sender is dropped.
                while let Ok(Job::Run { coll, count, iters }) = rx.recv() {
                    let r = (0..iters).try_for_each(|_| b.run(&c, coll, count));
                    if done_tx.send(r).is_err() {
                        return;
                    }
                }
            }));
        }
        Group {
            rank0,
            bufs0: Bufs {
                send: Vec::new(),
                recv: Vec::new(),
            },
            jobs,
            done,
            threads,
        }
    }

    /// `iters` collectives on every rank; the time from start to the last rank's end.
    fn time(&mut self, coll: Coll, count: usize, iters: u64) -> Duration {
        let t0 = Instant::now();
        for j in &self.jobs {
            j.send(Job::Run { coll, count, iters })
                .expect("worker alive");
        }
        for _ in 0..iters {
            self.bufs0
                .run(&self.rank0, coll, count)
                .expect("rank 0 collective");
        }
        for _ in &self.jobs {
            self.done
                .recv()
                .expect("worker alive")
                .expect("worker collective");
        }
        t0.elapsed()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn collectives(c: &mut Criterion) {
    let mut g = Group::new();
    for coll in [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::AllGather,
        Coll::Broadcast,
    ] {
        let mut group = c.benchmark_group(format!("{}_local_{RANKS}ranks", coll.name()));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        for bytes in SIZES {
            group.throughput(Throughput::Bytes(bytes as u64));
            let count = bytes / 4;
            group.bench_with_input(BenchmarkId::from_parameter(bytes), &count, |b, &count| {
                b.iter_custom(|iters| g.time(coll, count, iters))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, collectives);
criterion_main!(benches);
