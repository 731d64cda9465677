//! What a data-parallel run measures and reports as it goes: per-interval sums
//! (loss, accuracy, images, compute and exposed communication time), rank 0's
//! JSON-lines metrics (every rank's record and their mean) and its progress bar.

use crate::error::{Error, Result};
use ferroccl::ddp::metrics::Record;
use ferroccl::Communicator;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Duration;

/// Sums over the steps since the last record.
#[derive(Default)]
pub(crate) struct Interval {
    loss: f64,
    passes: usize,
    correct: usize,
    pub(crate) images: usize,
    steps: u64,
    buckets: usize,
    pub(crate) compute: Duration,
    pub(crate) exposed: Duration,
    wall: Duration,
}

impl Interval {
    fn absorb(&mut self, o: &Interval) {
        self.images += o.images;
        self.steps += o.steps;
        self.compute += o.compute;
        self.exposed += o.exposed;
    }
}

/// Where a step is in the run, for its record.
pub(crate) struct At {
    pub(crate) step: u64,
    pub(crate) steps_per_epoch: u64,
    pub(crate) lr: f64,
    pub(crate) loss_scale: f32,
}

/// One rank's measurements, metrics file (rank 0) and progress bar (rank 0).
pub(crate) struct Recorder {
    metrics: Option<BufWriter<File>>,
    bar: Option<indicatif::ProgressBar>,
    interval: Interval,
    totals: Interval,
    /// Mean loss of the last record, and the steps it covers.
    last: (f64, u64),
}

impl Recorder {
    /// On rank `rank` of a run at `step` of `stop`: opens the metrics file (appended)
    /// and the bar where asked, on rank 0.
    pub(crate) fn open(
        metrics: Option<&Path>,
        progress: bool,
        rank: usize,
        (step, stop): (u64, u64),
    ) -> Result<Self> {
        let metrics = match (metrics, rank) {
            (Some(p), 0) => Some(BufWriter::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| Error::io(format!("opening {}", p.display()), e))?,
            )),
            _ => None,
        };
        let bar = (progress && rank == 0).then(|| {
            let b = indicatif::ProgressBar::new(stop);
            b.set_position(step);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:40}] {pos}/{len} steps {msg}",
                )
                .expect("template")
                .progress_chars("=> "),
            );
            b
        });
        Ok(Recorder {
            metrics,
            bar,
            interval: Interval::default(),
            totals: Interval::default(),
            last: (f64::NAN, 0),
        })
    }

    /// One backward pass: its loss, correct predictions and images.
    pub(crate) fn pass(&mut self, loss: f64, correct: usize, images: usize) {
        self.interval.loss += loss;
        self.interval.passes += 1;
        self.interval.correct += correct;
        self.interval.images += images;
    }

    /// One optimizer step of `buckets` buckets that took `took`, `exposed` of it
    /// waiting for all-reduces; then the bar's position `step`.
    pub(crate) fn step(&mut self, buckets: usize, took: Duration, exposed: Duration, step: u64) {
        let i = &mut self.interval;
        i.buckets = i.buckets.max(buckets);
        i.compute += took.saturating_sub(exposed);
        i.exposed += exposed;
        i.steps += 1;
        i.wall += took;
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.set_message(format!("loss {:.4}", i.loss / i.passes.max(1) as f64));
        }
    }

    /// Collective: the interval's record, every rank's gathered to rank 0, which
    /// writes them and their mean; a new interval begins.
    pub(crate) fn record(&mut self, comm: &Communicator, at: &At) -> Result<()> {
        let rec = self.rank_record(comm, at);
        self.last = (
            write(comm, &rec, self.metrics.as_mut())?.loss,
            self.interval.steps,
        );
        self.totals.absorb(&self.interval);
        self.interval = Interval::default();
        Ok(())
    }

    fn rank_record(&self, comm: &Communicator, at: &At) -> Record {
        let i = &self.interval;
        let steps = i.steps.max(1) as f64;
        Record {
            kind: "rank".into(),
            rank: comm.rank(),
            world: comm.world_size(),
            step: at.step,
            epoch: (at.step - 1) / at.steps_per_epoch,
            loss: i.loss / i.passes.max(1) as f64,
            accuracy: i.correct as f64 / i.images.max(1) as f64,
            images_per_s: i.images as f64 / i.wall.as_secs_f64().max(1e-9),
            lr: at.lr,
            loss_scale: at.loss_scale as f64,
            comm_exposed_s: i.exposed.as_secs_f64() / steps,
            compute_s: i.compute.as_secs_f64() / steps,
        }
    }

    /// Clears the bar (a run that stops early).
    pub(crate) fn clear(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    /// The end of the run: the bar cleared, the metrics flushed; the run's totals and
    /// the last record's mean loss and steps.
    pub(crate) fn finish(mut self) -> (Interval, (f64, u64)) {
        self.clear();
        self.totals.absorb(&self.interval);
        if let Some(m) = self.metrics.as_mut() {
            let _ = m.flush();
        }
        (self.totals, self.last)
    }
}

/// Gathers every rank's record to rank 0, which writes them and their mean.
fn write(comm: &Communicator, rec: &Record, out: Option<&mut impl Write>) -> Result<Record> {
    let mine = [
        rec.loss,
        rec.accuracy,
        rec.images_per_s,
        rec.comm_exposed_s,
        rec.compute_s,
    ];
    let mut all = vec![0.0f64; 5 * comm.world_size()];
    comm.all_gather(&mine, &mut all)?;
    let mean = rec.reduce(comm)?;
    if let Some(w) = out {
        let io = |e| Error::io("writing metrics", e);
        for (r, v) in all.chunks_exact(5).enumerate() {
            Record {
                rank: r,
                loss: v[0],
                accuracy: v[1],
                images_per_s: v[2],
                comm_exposed_s: v[3],
                compute_s: v[4],
                ..rec.clone()
            }
            .write(w)
            .map_err(io)?;
        }
        mean.write(w).map_err(io)?;
        w.flush().map_err(io)?;
    }
    Ok(mean)
}
