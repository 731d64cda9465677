//! The plan as text: one line per output, each with its formula and numbers, or why
//! it is skipped; and as JSON.

use super::model::*;
use ferroccl::{Error, Result};
use std::fmt::Write as _;

impl Plan {
    /// One report line: the output's formula with its numbers, or why it is skipped.
    fn row(&self, o: &mut String, label: &str, key: &str, text: Option<String>) {
        let _ = match text {
            Some(t) => writeln!(o, "  {label:<24} = {t}"),
            None => writeln!(
                o,
                "  {label:<24}   skipped: {}",
                self.skipped.get(key).map_or("not given", String::as_str)
            ),
        };
    }

    /// The human report: one line per output, each with its formula, the numbers put
    /// into it and the result, or the reason it is skipped.
    pub fn render(&self) -> String {
        let mut o = String::new();
        self.render_header(&mut o);
        self.render_schedule(&mut o);
        self.render_compute(&mut o);
        self.render_comm(&mut o);
        self.render_run(&mut o);
        o
    }

    /// The title line and the link the plan was given.
    fn render_header(&self, o: &mut String) {
        let i = &self.input;
        let k = i.accumulation_steps;
        let dt = i.grad_dtype;
        let mut what = Vec::new();
        if let Some(r) = i.ranks {
            what.push(format!("{r} rank(s)"));
        }
        if let Some(pb) = i.per_rank_batch {
            what.push(format!("{pb} samples × {k} accumulation step(s) per rank"));
        }
        if let Some(d) = i.dataset_size {
            what.push(format!("{} epoch(s) of {d} samples", i.epochs));
        }
        if i.gradient.is_some() {
            what.push(format!("ring all-reduce of {} gradients", dt.name()));
        }
        if what.is_empty() {
            what.push("no ranks, batch, data or gradients given".into());
        }
        let _ = writeln!(o, "# ferroccl plan: {}", what.join(", "));
        if let (Some(l), Some(a), Some(beta), Some(rate)) = (
            &i.link,
            self.alpha_s,
            self.beta_s_per_byte,
            self.link_bytes_per_s,
        ) {
            let _ = writeln!(
                o,
                "# link: {}: α = {}, β = {} ns/B, 1/β = {}",
                l.source,
                fmt_time(a),
                fmt_g(beta * 1e9),
                fmt_rate(rate)
            );
        }
    }

    /// Batch, steps, learning rate and warmup.
    fn render_schedule(&self, o: &mut String) {
        let i = &self.input;
        let k = i.accumulation_steps;
        let (n, b) = (
            i.ranks.map_or("N".into(), |x| x.to_string()),
            i.per_rank_batch.map_or("b".into(), |x| x.to_string()),
        );
        let _ = writeln!(o, "batch and schedule");
        self.row(
            o,
            "global batch",
            "global_batch",
            self.global_batch.map(|g| {
                format!("ranks × per-rank batch × accumulation steps = {n} × {b} × {k} = {g}")
            }),
        );
        self.row(o, "steps per epoch", "steps_per_epoch", (|| {
            Some(format!(
                "floor(dataset size / global batch) = floor({} / {}) = {}  (drop_last: {} samples left out per epoch)",
                i.dataset_size?, self.global_batch?, self.steps_per_epoch?, self.dropped_samples_per_epoch?
            ))
        })());
        self.row(
            o,
            "total steps",
            "total_steps",
            (|| {
                Some(format!(
                    "steps per epoch × epochs = {} × {} = {}",
                    self.steps_per_epoch?, i.epochs, self.total_steps?
                ))
            })(),
        );
        let base_batch = |g: u64, f: f64| match i.base_batch {
            Some(bb) => format!("{bb}"),
            None => format!("{} (the single-rank batch b × k)", fmt_g(g as f64 / f)),
        };
        self.row(
            o,
            "lr factor",
            "lr_factor",
            (|| {
                let (g, f) = (self.global_batch?, self.lr_factor?);
                Some(format!(
                    "global batch / base batch = {g} / {} = {}  (linear scaling rule)",
                    base_batch(g, f),
                    fmt_g(f)
                ))
            })(),
        );
        self.row(
            o,
            "scaled lr",
            "scaled_lr",
            (|| {
                let (g, f) = (self.global_batch?, self.lr_factor?);
                Some(format!(
                    "base lr × global batch / base batch = {} × {g} / {} = {}",
                    fmt_g(i.base_lr?),
                    base_batch(g, f),
                    fmt_g(self.scaled_lr?)
                ))
            })(),
        );
        match i.warmup {
            Some(Warmup::Epochs(e)) => self.row(
                o,
                "warmup steps",
                "warmup_steps",
                (|| {
                    Some(format!(
                        "ceil(warmup epochs × steps per epoch) = ceil({} × {}) = {}",
                        fmt_g(e),
                        self.steps_per_epoch?,
                        self.warmup_steps?
                    ))
                })(),
            ),
            Some(Warmup::Steps(s)) => self.row(
                o,
                "warmup steps",
                "warmup_epochs",
                (|| {
                    Some(format!(
                        "given = {s}  (= {s} / {} = {} epochs)",
                        self.steps_per_epoch?,
                        fmt_g(self.warmup_epochs?)
                    ))
                })(),
            ),
            None => {}
        }
        if let (Some(lr), Some(w)) = (self.scaled_lr, self.warmup_steps.filter(|&w| w > 0)) {
            self.row(
                o,
                "lr schedule",
                "",
                Some(format!(
                    "linear warmup to {} over steps 0..{w}, then your decay",
                    fmt_g(lr)
                )),
            );
        }
    }

    /// Compute per step.
    fn render_compute(&self, o: &mut String) {
        let i = &self.input;
        let k = i.accumulation_steps;
        let (_n, b) = (
            i.ranks.map_or("N".into(), |x| x.to_string()),
            i.per_rank_batch.map_or("b".into(), |x| x.to_string()),
        );
        let _ = writeln!(o, "compute");
        let amp = fmt_g(i.amp_speedup);
        let ct = self.compute_s.map(fmt_time);
        let thr = self.single_rank_throughput.map(fmt_g);
        match i.compute {
            Some(Compute::Throughput(t)) => {
                self.row(
                    o,
                    "single-rank throughput",
                    "",
                    Some(format!("given = {} samples/s", fmt_g(t))),
                );
                self.row(o, "compute per step", "compute_s", ct.map(|c| format!(
                    "per-rank batch × accumulation / single-rank throughput / amp speed-up = {b} × {k} / {} / {amp} = {c}",
                    fmt_g(t)
                )));
            }
            Some(Compute::StepTimeS(s)) => {
                self.row(
                    o,
                    "compute per step",
                    "compute_s",
                    ct.map(|c| {
                        format!(
                            "given compute time / amp speed-up = {} / {amp} = {c}",
                            fmt_time(s)
                        )
                    }),
                );
                self.row(o, "single-rank throughput", "single_rank_throughput", thr.map(|t| format!(
                    "per-rank batch × accumulation / given compute time = {b} × {k} / {} = {t} samples/s",
                    fmt_time(s)
                )));
            }
            Some(Compute::MeasuredStepS(s)) => {
                self.row(
                    o,
                    "compute per step",
                    "compute_s",
                    (|| {
                        Some(format!(
                            "(step − communication) / amp speed-up = ({} − {}) / {amp} = {}",
                            fmt_time(s),
                            fmt_time(i.comm_s?),
                            ct.clone()?
                        ))
                    })(),
                );
                self.row(
                    o,
                    "single-rank throughput",
                    "single_rank_throughput",
                    thr.map(|t| {
                        format!(
                    "per-rank batch × accumulation / (step − communication) = {t} samples/s"
                )
                    }),
                );
            }
            None => self.row(o, "compute per step", "compute_s", None),
        }
    }

    /// Gradient bytes and their all-reduce.
    fn render_comm(&self, o: &mut String) {
        let i = &self.input;
        let dt = i.grad_dtype;
        let _ = writeln!(o, "gradients and communication");
        let cut = i.comm_cut.unwrap_or(1.0);
        if let Some(given) = i.comm_s {
            self.row(
                o,
                "comm per step",
                "comm_s",
                self.comm_s.map(|c| {
                    format!(
                        "given communication / cut = {} / {} = {c}",
                        fmt_time(given),
                        fmt_g(cut),
                        c = fmt_time(c)
                    )
                }),
            );
        } else {
            let grad = match i.gradient {
                Some(Gradient::Params(p)) => self.grad_bytes.map(|s| {
                    format!(
                        "params × {} B ({}) = {p} × {} = {}",
                        dt.size(),
                        dt.name(),
                        dt.size(),
                        fmt_bytes(s)
                    )
                }),
                Some(Gradient::Bytes(s)) => self.params.map(|p| {
                    format!(
                        "given = {}  (params = S / {} B ({}) = {})",
                        fmt_bytes(s as f64),
                        dt.size(),
                        dt.name(),
                        fmt_g(p)
                    )
                }),
                None => None,
            };
            self.row(o, "gradient bytes S", "grad_bytes", grad);
            self.row(
                o,
                "ring bytes per rank",
                "ring_bytes_per_rank",
                (|| {
                    let n = i.ranks?;
                    Some(format!(
                        "2(N-1)/N × S = 2 × {} / {n} × {} = {}",
                        n - 1,
                        fmt_bytes(self.grad_bytes?),
                        fmt_bytes(self.ring_bytes_per_rank?)
                    ))
                })(),
            );
            let variants = [
                (
                    "comm per step, f32",
                    "comm_f32_s",
                    4.0,
                    self.comm_f32_s,
                    dt == GradDtype::F32,
                ),
                (
                    "comm per step, f16/bf16",
                    "comm_f16_s",
                    2.0,
                    self.comm_f16_s,
                    dt != GradDtype::F32,
                ),
            ];
            for (label, key, size, t, used) in variants {
                self.row(
                    o,
                    label,
                    key,
                    (|| {
                        let n = i.ranks?;
                        Some(format!(
                            "2(N-1)·α + 2(N-1)/N·S·β = {} × {} + {} × {} ns/B = {}{}",
                            2 * (n - 1),
                            fmt_time(self.alpha_s?),
                            fmt_bytes(ring_factor(n as f64) * self.params? * size),
                            fmt_g(self.beta_s_per_byte? * 1e9),
                            fmt_time(t?),
                            if used { "  (used)" } else { "" }
                        ))
                    })(),
                );
            }
            if i.ranks == Some(1) && self.comm_f32_s.is_none() {
                self.row(
                    o,
                    "comm per step",
                    "",
                    Some("0 s  (one rank: nothing to all-reduce)".into()),
                );
            }
            if cut != 1.0 {
                self.row(
                    o,
                    "comm after cut",
                    "comm_s",
                    self.comm_s.map(|c| {
                        format!(
                            "comm / cut = {} / {} = {}",
                            fmt_time(c * cut),
                            fmt_g(cut),
                            fmt_time(c)
                        )
                    }),
                );
            }
        }
        self.row(
            o,
            "hidden by overlap",
            "hidden_comm_s",
            (|| {
                let (c, h) = (self.comm_s?, self.hidden_comm_s?);
                Some(match self.compute_s {
                    Some(t) => format!(
                        "min(overlap × comm, compute) = min({} × {}, {}) = {}",
                        fmt_g(i.overlap),
                        fmt_time(c),
                        fmt_time(t),
                        fmt_time(h)
                    ),
                    None => format!(
                        "overlap × comm = {} × {} = {}  (compute unknown: not capped by it)",
                        fmt_g(i.overlap),
                        fmt_time(c),
                        fmt_time(h)
                    ),
                })
            })(),
        );
        self.row(
            o,
            "visible comm",
            "visible_comm_s",
            (|| {
                Some(format!(
                    "comm − hidden = {} − {} = {}",
                    fmt_time(self.comm_s?),
                    fmt_time(self.hidden_comm_s?),
                    fmt_time(self.visible_comm_s?)
                ))
            })(),
        );
    }

    /// Step time, throughput, scaling and the run's length.
    fn render_run(&self, o: &mut String) {
        let i = &self.input;
        let k = i.accumulation_steps;
        let (n, b) = (
            i.ranks.map_or("N".into(), |x| x.to_string()),
            i.per_rank_batch.map_or("b".into(), |x| x.to_string()),
        );
        let _ = writeln!(o, "step and run");
        let oh = fmt_g(i.overhead.unwrap_or(0.0));
        self.row(o, "step time", "step_s", (|| {
            let (c, s) = (self.compute_s?, self.step_s?);
            Some(match self.visible_comm_s {
                Some(v) => format!(
                    "(compute + visible comm) / (1 − overhead) = ({} + {}) / (1 − {oh}) = {}",
                    fmt_time(c), fmt_time(v), fmt_time(s)
                ),
                None => format!(
                    "compute / (1 − overhead) = {} / (1 − {oh}) = {}  (--overhead is all that is lost to communication and the rest)",
                    fmt_time(c), fmt_time(s)
                ),
            })
        })());
        self.row(
            o,
            "comm share",
            "comm_share",
            (|| {
                Some(format!(
                    "visible comm / step time = {} / {} = {}",
                    fmt_time(self.visible_comm_s?),
                    fmt_time(self.step_s?),
                    pct(self.comm_share?)
                ))
            })(),
        );
        self.row(o, "throughput", "throughput", (|| Some(format!(
            "ranks × per-rank batch × accumulation / step time = {n} × {b} × {k} / {} = {} samples/s",
            fmt_time(self.step_s?),
            fmt_g(self.throughput?)
        )))());
        self.row(
            o,
            "speedup",
            "speedup",
            (|| {
                Some(format!(
                    "throughput / (per-rank batch × accumulation / compute) = {} / {} = {}",
                    fmt_g(self.throughput?),
                    fmt_g(self.baseline_throughput?),
                    fmt_g(self.speedup?)
                ))
            })(),
        );
        self.row(
            o,
            "efficiency",
            "efficiency",
            (|| {
                Some(format!(
                    "speedup / ranks = {} / {n} = {}",
                    fmt_g(self.speedup?),
                    pct(self.efficiency?)
                ))
            })(),
        );
        self.row(
            o,
            "time per epoch",
            "epoch_s",
            (|| {
                Some(format!(
                    "steps per epoch × step time = {} × {} = {}",
                    self.steps_per_epoch?,
                    fmt_time(self.step_s?),
                    fmt_time(self.epoch_s?)
                ))
            })(),
        );
        self.row(
            o,
            "total time",
            "total_s",
            (|| {
                Some(format!(
                    "time per epoch × epochs = {} × {} = {}",
                    fmt_time(self.epoch_s?),
                    i.epochs,
                    fmt_time(self.total_s?)
                ))
            })(),
        );
    }

    /// Every input and output as one pretty-printed JSON object.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("writing the plan as JSON: {e}")))
    }
}

/// `x` to 6 significant digits, without trailing zeros.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{}", if x == 0.0 { 0.0 } else { x });
    }
    let r: f64 = format!("{x:.5e}").parse().unwrap_or(x);
    format!("{r}")
}

/// A duration in seconds in a readable unit (µs, ms, s; with days/hours/minutes from a
/// minute up).
pub fn fmt_time(s: f64) -> String {
    let a = s.abs();
    if s == 0.0 {
        "0 s".into()
    } else if a < 1e-3 {
        format!("{} µs", fmt_g(s * 1e6))
    } else if a < 1.0 {
        format!("{} ms", fmt_g(s * 1e3))
    } else if a < 60.0 {
        format!("{} s", fmt_g(s))
    } else {
        format!("{} s ({})", fmt_g(s), fmt_dhms(s))
    }
}

fn fmt_dhms(s: f64) -> String {
    let t = s.round() as u64;
    let (d, h, m, sec) = (t / 86400, t / 3600 % 24, t / 60 % 60, t % 60);
    if d > 0 {
        format!("{d}d {h:02}h {m:02}m {sec:02}s")
    } else if h > 0 {
        format!("{h}h {m:02}m {sec:02}s")
    } else {
        format!("{m}m {sec:02}s")
    }
}

/// Bytes in decimal units (kB, MB, GB, TB: powers of 1000).
pub fn fmt_bytes(b: f64) -> String {
    let a = b.abs();
    let (v, u) = if a >= 1e12 {
        (b / 1e12, "TB")
    } else if a >= 1e9 {
        (b / 1e9, "GB")
    } else if a >= 1e6 {
        (b / 1e6, "MB")
    } else if a >= 1e3 {
        (b / 1e3, "kB")
    } else {
        (b, "B")
    };
    format!("{} {u}", fmt_g(v))
}

/// A bandwidth in bytes/s, also in bits/s: `1.25 GB/s (10 Gbit/s)`.
pub fn fmt_rate(bytes_per_s: f64) -> String {
    let bits = bytes_per_s * 8.0;
    let (v, u) = if bits >= 1e12 {
        (bits / 1e12, "Tbit/s")
    } else if bits >= 1e9 {
        (bits / 1e9, "Gbit/s")
    } else if bits >= 1e6 {
        (bits / 1e6, "Mbit/s")
    } else {
        (bits / 1e3, "kbit/s")
    };
    format!("{}/s ({} {u})", fmt_bytes(bytes_per_s), fmt_g(v))
}

fn pct(x: f64) -> String {
    format!("{} %", fmt_g(x * 100.0))
}
