//! `ferroccl trace DIR`: the flight recorder's dumps of all ranks, merged.
//!
//! Every rank's dump (`DIR/rank-<rank>.jsonl`, see [`ferroccl::trace`]) is put on the
//! reference clock (`t - clock_offset_ns`), then
//!
//! - written as one Chrome/Perfetto trace (`--out`, default `DIR/trace.json`): a track
//!   per rank, each operation a slice with the time it waited on each peer nested in it;
//! - reported: for each collective recorded on two or more ranks (matched by kind and
//!   sequence number; send/recv numbers count per pair and are not matched) the rank
//!   that started last and how late it was against the median start of the others; per
//!   rank how often it was last; the straggler, if one rank stands out; and for a failed
//!   or hung job each rank's last operation, who waited for whom, and the ranks that are
//!   behind or left no file;
//! - drawn as an SVG timeline with `--svg`.
//!
//! `--json` prints the same report as one JSON object. `ferroccl bench --trace DIR` and
//! `ferroccl train --trace DIR` write the dumps this reads ([`record_into`], [`finish`]).

mod chrome;
mod merge;
mod record;
mod report;
mod svg;
#[cfg(test)]
mod tests;

use crate::error::Result;
use chrome::chrome_trace;
use clap::Args;
use merge::merge;
pub use record::{finish, record_into};
use report::{print_report, report};
use std::path::PathBuf;
use svg::draw_svg;

/// Arguments of `ferroccl trace`.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Directory holding the ranks' dumps (`rank-<rank>.jsonl`): written by
    /// `FERROCCL_TRACE_DIR`, `Communicator::dump_trace`, SIGUSR1, or `bench`/`train
    /// --trace DIR`.
    pub dir: PathBuf,
    /// Where to write the merged Chrome/Perfetto trace (open it in
    /// https://ui.perfetto.dev or chrome://tracing) [default: DIR/trace.json].
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Also draw the timeline as an SVG: a row per rank, operations colored by kind,
    /// failed ones red, time waiting on peers darker.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Print the report as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Collectives listed in the table of the latest operations.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub last: usize,
}

pub fn main(a: TraceArgs) -> Result<bool> {
    run(&a).map(|()| true)
}

fn run(a: &TraceArgs) -> Result<()> {
    let traces = ferroccl::trace::read_dir(&a.dir)?;
    let m = merge(&traces)?;
    let out = a.out.clone().unwrap_or_else(|| a.dir.join("trace.json"));
    let text = serde_json::to_string(&chrome_trace(&m)).map_err(|e| e.to_string())?;
    std::fs::write(&out, text).map_err(|e| format!("writing {}: {e}", out.display()))?;
    if let Some(svg) = &a.svg {
        draw_svg(svg, &m)?;
    }
    let rep = report(&m, a.last, &out, a.svg.as_deref());
    if a.json {
        let s = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
        println!("{s}");
    } else {
        print_report(&rep);
    }
    Ok(())
}
