//! `ferroccl plot FILE...`: SVG plots from `ferroccl bench --json` and
//! `tools/compare-peers --json` files.
//!
//! - `busbw.svg`: busbw (in place) against message size on a log2 axis, one line per
//!   bench file, and per implementation (and world size, and setting) of a
//!   compare-peers file.
//! - `law.svg`, when a bench file was run with `--law`: measured (in-place) and
//!   ring-law predicted time against size, both axes logarithmic.
//!
//! - `bubble.svg`, from a `pipeline_bench --json` file (ferroccl-candle's example):
//!   the measured pipeline bubble fraction against micro-batches, per stage count and
//!   schedule, next to the textbook (p − 1)/(m + p − 1).
//!
//! - `accuracy.svg`, from an `"accuracy-curves"` file (`tools/ps-experiment`): test
//!   accuracy against wall-clock seconds, one line per run.
//!
//! SVG is written with plotters' own text layout (no font files, no system libraries).
//! The size axis has a tick at every power of two (or every few, for wide ranges).

use crate::error::{CliError, Result};
use clap::Args;
use plotters::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Arguments of `ferroccl plot`.
#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// JSON files written by `ferroccl bench --json` or `tools/compare-peers --json`.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Directory for busbw.svg (and law.svg); created when missing.
    #[arg(short = 'o', long = "out-dir", default_value = ".")]
    pub out_dir: PathBuf,
    /// Text put before each plot's title.
    #[arg(long = "title", default_value = "ferroccl")]
    pub title: String,
}

/// One line of a plot: (bytes, value) points, sorted by bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Measured and predicted times (µs) of one `--law` bench file.
#[derive(Debug, Clone, PartialEq)]
pub struct LawSeries {
    pub name: String,
    pub meas: Vec<(f64, f64)>,
    pub pred: Vec<(f64, f64)>,
}

pub fn main(a: PlotArgs) -> Result<bool> {
    for (p, n) in run(&a)? {
        println!("wrote {} ({n} series)", p.display());
    }
    Ok(true)
}

fn run(a: &PlotArgs) -> Result<Vec<(PathBuf, usize)>> {
    let mut busbw = Vec::new();
    let mut law = Vec::new();
    let mut bubble = Vec::new();
    let mut curves = Vec::new();
    for f in &a.files {
        let text =
            std::fs::read_to_string(f).map_err(|e| format!("reading {}: {e}", f.display()))?;
        if let Some(b) = parse_bubble(&text) {
            bubble.extend(b);
            continue;
        }
        if let Some(c) = parse_curves(&text) {
            curves.extend(c);
            continue;
        }
        let (b, l) = parse_file(&text, &stem(f)).map_err(|e| format!("{}: {e}", f.display()))?;
        busbw.extend(b);
        law.extend(l);
    }
    dedup_names(&mut busbw);
    dedup_names(&mut bubble);
    dedup_names(&mut curves);
    curves.retain(|c| !c.points.is_empty());
    if busbw.iter().all(|s| s.points.is_empty()) && bubble.is_empty() && curves.is_empty() {
        return Err("no rows to plot in the given files".into());
    }
    std::fs::create_dir_all(&a.out_dir)
        .map_err(|e| format!("creating {}: {e}", a.out_dir.display()))?;
    let mut written = Vec::new();
    if !curves.is_empty() {
        let p = a.out_dir.join("accuracy.svg");
        draw_lines(
            &p,
            &format!("{}: test accuracy against wall-clock time", a.title),
            ("wall-clock seconds", "test accuracy"),
            &curves,
            SeriesLabelPosition::LowerRight,
        )?;
        written.push((p, curves.len()));
    }
    if !bubble.is_empty() {
        let p = a.out_dir.join("bubble.svg");
        draw_lines(
            &p,
            &format!("{}: pipeline bubble against micro-batches", a.title),
            ("micro-batches m", "bubble fraction (idle / step time)"),
            &bubble,
            SeriesLabelPosition::UpperRight,
        )?;
        written.push((p, bubble.len()));
    }
    if busbw.iter().all(|s| s.points.is_empty()) {
        return Ok(written);
    }
    let p = a.out_dir.join("busbw.svg");
    draw_busbw(&p, &format!("{}: busbw against size", a.title), &busbw)?;
    written.push((p, busbw.len()));
    if !law.is_empty() {
        let p = a.out_dir.join("law.svg");
        draw_law(
            &p,
            &format!("{}: measured and ring-law time", a.title),
            &law,
        )?;
        written.push((p, law.len()));
    }
    Ok(written)
}

/// A `pipeline_bench --json` file (`"tool": "pipeline-bubble"`, rows of p, m,
/// schedule, measured, textbook): one measured series per (p, schedule) and one
/// textbook series per p, x = m. `None` for any other file.
pub fn parse_bubble(text: &str) -> Option<Vec<Series>> {
    let v: Value = serde_json::from_str(text).ok()?;
    if v.get("tool").and_then(Value::as_str) != Some("pipeline-bubble") {
        return None;
    }
    let mut out: Vec<Series> = Vec::new();
    let mut add = |name: String, x: f64, y: f64| match out.iter_mut().find(|s| s.name == name) {
        Some(s) => {
            if !s.points.iter().any(|p| p.0 == x) {
                s.points.push((x, y));
            }
        }
        None => out.push(Series {
            name,
            points: vec![(x, y)],
        }),
    };
    for r in v
        .get("rows")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(p), Some(m)) = (num(r, "p"), num(r, "m")) else {
            continue;
        };
        let sched = r.get("schedule").and_then(Value::as_str).unwrap_or("?");
        if let Some(y) = num(r, "measured") {
            add(format!("p={p} {sched} measured"), m, y);
        }
        if let Some(y) = num(r, "textbook") {
            add(format!("p={p} textbook (p-1)/(m+p-1)"), m, y);
        }
    }
    for s in &mut out {
        sort(&mut s.points);
    }
    Some(out)
}

/// An `"accuracy-curves"` file (`tools/ps-experiment`: `series` of `name` and
/// `points`, each `[seconds, accuracy]`): one series per run. `None` for any other
/// file.
pub fn parse_curves(text: &str) -> Option<Vec<Series>> {
    let v: Value = serde_json::from_str(text).ok()?;
    if v.get("tool").and_then(Value::as_str) != Some("accuracy-curves") {
        return None;
    }
    let series = v.get("series").and_then(Value::as_array)?;
    Some(
        series
            .iter()
            .map(|s| {
                let mut points: Vec<(f64, f64)> = s
                    .get("points")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|p| {
                        let (x, y) = (p.get(0)?.as_f64()?, p.get(1)?.as_f64()?);
                        (x.is_finite() && y.is_finite()).then_some((x, y))
                    })
                    .collect();
                sort(&mut points);
                Series {
                    name: s.get("name").and_then(Value::as_str).unwrap_or("?").into(),
                    points,
                }
            })
            .collect(),
    )
}

/// Lines of `series` on linear axes from 0, markers on the points.
fn draw_lines(
    path: &Path,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    series: &[Series],
    legend: SeriesLabelPosition,
) -> Result<()> {
    let err = draw_err(path);
    let all = || series.iter().flat_map(|s| s.points.iter());
    let xmax = all().fold(1.0f64, |m, p| m.max(p.0)) + 0.5;
    let ymax = all().fold(0.0f64, |m, p| m.max(p.1));
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let root = SVGBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(&err)?;
    lines_with_dots(&mut chart, series, legend, &err)?;
    root.present().map_err(&err)?;
    Ok(())
}

fn stem(p: &Path) -> String {
    p.file_stem()
        .map_or_else(|| "?".into(), |s| s.to_string_lossy().into_owned())
}

/// Makes series names unique by appending " (2)", " (3)", ...
fn dedup_names(v: &mut [Series]) {
    for i in 1..v.len() {
        let mut k = 1;
        while v[..i].iter().any(|s| s.name == v[i].name) {
            k += 1;
            let base = v[i]
                .name
                .trim_end_matches(&format!(" ({})", k - 1))
                .to_owned();
            v[i].name = format!("{base} ({k})");
        }
    }
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key)?.as_f64().filter(|x| x.is_finite())
}

/// The busbw series and law series of one JSON file (`name`: the file's stem).
pub fn parse_file(text: &str, name: &str) -> Result<(Vec<Series>, Vec<LawSeries>)> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let rows = v
        .get("rows")
        .and_then(Value::as_array)
        .ok_or("has no `rows` array")?;
    match v.get("tool").and_then(Value::as_str) {
        Some("ferroccl bench") => Ok(parse_bench(&v, rows, name)),
        Some("compare-peers") => Ok((parse_peers(rows), Vec::new())),
        other => Err(CliError::Input(format!(
            "`tool` is {other:?}: expected \"ferroccl bench\" or \"compare-peers\""
        ))),
    }
}

fn parse_bench(v: &Value, rows: &[Value], name: &str) -> (Vec<Series>, Vec<LawSeries>) {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
    let label = match v.get("label").and_then(Value::as_str) {
        Some(l) => l.to_owned(),
        None => format!(
            "ferroccl {} {} n={} ({name})",
            s("collective"),
            s("transport"),
            v.get("ranks").and_then(Value::as_u64).unwrap_or(0)
        ),
    };
    let mut bus = Vec::new();
    let (mut meas, mut pred) = (Vec::new(), Vec::new());
    for r in rows {
        let Some(b) = num(r, "bytes").filter(|&b| b > 0.0) else {
            continue;
        };
        if let Some(y) = num(r, "ip_busbw_gbs") {
            bus.push((b, y));
        }
        if let (Some(m), Some(p)) = (num(r, "ip_time_us"), num(r, "pred_time_us")) {
            if m > 0.0 && p > 0.0 {
                meas.push((b, m));
                pred.push((b, p));
            }
        }
    }
    sort(&mut bus);
    let law = if meas.is_empty() {
        Vec::new()
    } else {
        sort(&mut meas);
        sort(&mut pred);
        vec![LawSeries {
            name: label.clone(),
            meas,
            pred,
        }]
    };
    (
        vec![Series {
            name: label,
            points: bus,
        }],
        law,
    )
}

/// compare-peers rows: `{"ranks", "bytes", ["setting"], IMPL: {"busbw_gbs", ...}, ...}`.
fn parse_peers(rows: &[Value]) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let (Some(b), Some(obj)) = (num(r, "bytes"), r.as_object()) else {
            continue;
        };
        let n = r.get("ranks").and_then(Value::as_u64).unwrap_or(0);
        let setting = r
            .get("setting")
            .and_then(Value::as_str)
            .map_or(String::new(), |s| format!(" {s}"));
        for (k, x) in obj {
            let Some(y) = num(x, "busbw_gbs") else {
                continue;
            };
            let name = format!("{k} n={n}{setting}");
            match out.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((b, y)),
                None => out.push(Series {
                    name,
                    points: vec![(b, y)],
                }),
            }
        }
    }
    for s in &mut out {
        sort(&mut s.points);
    }
    out
}

fn sort(p: &mut [(f64, f64)]) {
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
}

fn size_label(b: f64) -> String {
    let b = b.round() as u64;
    for (unit, sh) in [("G", 30), ("M", 20), ("K", 10)] {
        if b >= 1 << sh && b.is_multiple_of(1 << sh) {
            return format!("{}{unit}", b >> sh);
        }
    }
    b.to_string()
}

/// x range (bytes) over all points, padded to whole powers of two.
fn x_range<'a>(pts: impl Iterator<Item = &'a (f64, f64)>) -> (f64, f64) {
    let (lo, hi) = pts.fold((f64::INFINITY, 0.0f64), |(l, h), p| {
        (l.min(p.0), h.max(p.0))
    });
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0, 2.0);
    }
    let lo = 2f64.powf(lo.log2().floor());
    let hi = 2f64.powf(hi.log2().ceil()).max(lo * 2.0);
    (lo, hi)
}

pub(crate) fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

pub(crate) fn draw_err<E: std::error::Error + Send + Sync>(
    path: &Path,
) -> impl Fn(E) -> String + '_ {
    move |e| format!("drawing {}: {e}", path.display())
}

fn draw_busbw(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let err = draw_err(path);
    let (x0, x1) = x_range(series.iter().flat_map(|s| &s.points));
    let ymax = series
        .iter()
        .flat_map(|s| &s.points)
        .fold(0.0f64, |m, p| m.max(p.1));
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let root = SVGBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d((x0..x1).log_scale().base(2.0), 0.0..ymax)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes, log scale)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| size_label(*x))
        .draw()
        .map_err(&err)?;
    lines_with_dots(&mut chart, series, SeriesLabelPosition::UpperLeft, &err)?;
    root.present().map_err(&err)?;
    Ok(())
}

/// Each of `series` as a line with a dot on every point, and the legend at `legend`:
/// what the busbw and the bubble plots share, on whatever axes.
fn lines_with_dots<'a, DB, X, Y, F>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    series: &[Series],
    legend: SeriesLabelPosition,
    err: &F,
) -> Result<()>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
    F: Fn(DrawingAreaErrorKind<DB::ErrorType>) -> String,
{
    for (i, s) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

fn draw_law(path: &Path, title: &str, series: &[LawSeries]) -> Result<()> {
    let err = draw_err(path);
    let all = || series.iter().flat_map(|s| s.meas.iter().chain(&s.pred));
    let (x0, x1) = x_range(all());
    let (ylo, yhi) = all().fold((f64::INFINITY, 0.0f64), |(l, h), p| {
        (l.min(p.1), h.max(p.1))
    });
    let (y0, y1) = if ylo.is_finite() && ylo > 0.0 && yhi > ylo {
        (ylo / 1.5, yhi * 1.5)
    } else {
        (1.0, 10.0)
    };
    let root = SVGBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75)
        .build_cartesian_2d((x0..x1).log_scale().base(2.0), (y0..y1).log_scale())
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes, log scale)")
        .y_desc("time (us, log scale)")
        .x_label_formatter(&|x| size_label(*x))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(&err)?;
    for (i, s) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(s.meas.iter().copied(), c.stroke_width(2)))
            .map_err(&err)?
            .label(format!("{} measured", s.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(s.meas.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(&err)?;
        let light = c.mix(0.5);
        chart
            .draw_series(LineSeries::new(
                s.pred.iter().copied(),
                light.stroke_width(1),
            ))
            .map_err(&err)?
            .label(format!("{} ring law", s.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], light));
        chart
            .draw_series(
                s.pred
                    .iter()
                    .map(|&p| Cross::new(p, 4, light.stroke_width(1))),
            )
            .map_err(&err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(&err)?;
    root.present().map_err(&err)?;
    Ok(())
}

/// A line chart of `pts` (x ascending) with markers, for `ferroccl train --scaling`.
#[cfg_attr(not(feature = "candle"), allow(dead_code))]
pub fn draw_xy(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    pts: &[(f64, f64)],
) -> Result<()> {
    let err = draw_err(path);
    let xmax = pts.iter().fold(1.0f64, |m, p| m.max(p.0)) + 0.5;
    let ymax = pts.iter().fold(0.0f64, |m, p| m.max(p.1));
    let ymax = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };
    let root = SVGBackend::new(path, (800, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.5..xmax, 0.0..ymax)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(&err)?;
    let c = color(0);
    chart
        .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
        .map_err(&err)?;
    chart
        .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
        .map_err(&err)?;
    root.present().map_err(&err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_curves_are_read_sorted_and_other_files_are_not_curves() {
        let text = r#"{"tool": "accuracy-curves", "series": [
            {"name": "async", "points": [[2.0, 0.5], [1.0, 0.25], [3.0, "x"]]},
            {"name": "sync", "points": []}]}"#;
        let c = parse_curves(text).expect("a curves file");
        assert_eq!(c[0].name, "async");
        assert_eq!(c[0].points, vec![(1.0, 0.25), (2.0, 0.5)]);
        assert!(c[1].points.is_empty());
        assert!(parse_curves(r#"{"tool": "pipeline-bubble", "rows": []}"#).is_none());
        assert!(parse_curves("not json").is_none());
    }

    #[test]
    fn names_are_made_unique() {
        let s = |n: &str| Series {
            name: n.into(),
            points: vec![],
        };
        let mut v = vec![s("a"), s("a"), s("b"), s("a")];
        dedup_names(&mut v);
        let names: Vec<_> = v.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "a (2)", "b", "a (3)"]);
    }

    #[test]
    fn sizes_are_labelled_in_binary_units() {
        assert_eq!(size_label(1024.0), "1K");
        assert_eq!(size_label(64.0 * 1048576.0), "64M");
        assert_eq!(size_label(1000.0), "1000");
    }

    #[test]
    fn peers_rows_become_one_series_per_impl_and_n() {
        let text = r#"{"tool": "compare-peers", "rows": [
            {"ranks": 2, "bytes": 2048, "ferroccl": {"busbw_gbs": 2.0}, "gloo": {"busbw_gbs": 1.0}, "ratio_vs_gloo": 2.0},
            {"ranks": 2, "bytes": 1024, "ferroccl": {"busbw_gbs": 1.0}, "gloo": {"busbw_gbs": 0.5}}]}"#;
        let (b, l) = parse_file(text, "x").expect("parses");
        assert!(l.is_empty());
        assert_eq!(b.len(), 2);
        let f = b
            .iter()
            .find(|s| s.name == "ferroccl n=2")
            .expect("ferroccl");
        assert_eq!(f.points, [(1024.0, 1.0), (2048.0, 2.0)]);
    }

    #[test]
    fn pipeline_bench_rows_become_measured_and_textbook_series() {
        let text = r#"{"tool": "pipeline-bubble", "rows": [
            {"p": 2, "m": 2, "schedule": "gpipe", "measured": 0.3, "textbook": 0.333},
            {"p": 2, "m": 1, "schedule": "gpipe", "measured": 0.5, "textbook": 0.5},
            {"p": 2, "m": 1, "schedule": "1f1b", "measured": 0.49, "textbook": 0.5}]}"#;
        let s = parse_bubble(text).expect("a bubble file");
        assert_eq!(s.len(), 3);
        let g = s
            .iter()
            .find(|s| s.name == "p=2 gpipe measured")
            .expect("gpipe");
        assert_eq!(g.points, [(1.0, 0.5), (2.0, 0.3)]);
        let t = s
            .iter()
            .find(|s| s.name.contains("textbook"))
            .expect("textbook");
        assert_eq!(t.points, [(1.0, 0.5), (2.0, 0.333)]);
        assert!(parse_bubble(r#"{"tool": "ferroccl bench", "rows": []}"#).is_none());
    }

    #[test]
    fn bad_files_are_refused() {
        assert!(parse_file("nope", "x").is_err());
        assert!(parse_file(r#"{"tool": "other", "rows": []}"#, "x").is_err());
        assert!(parse_file(r#"{"tool": "ferroccl bench"}"#, "x").is_err());
    }
}
