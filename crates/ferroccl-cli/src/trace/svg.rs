//! The SVG timeline: a row per rank, operations colored by kind.

use super::merge::{Merged, Op};
use super::report::thousands;
use crate::error::Result;
use plotters::prelude::*;
use std::path::Path;
// ---------------------------------------------------------------------------------
// The SVG timeline.

pub(super) fn draw_svg(path: &Path, m: &Merged<'_>) -> Result<()> {
    let err = crate::plot::draw_err(path);
    let ws = m.world_size.max(1);
    let span = m.t_end.saturating_sub(m.t0).max(1) as f64;
    let (scale, unit) = if span >= 2e9 {
        (1e9, "s")
    } else if span >= 2e6 {
        (1e6, "ms")
    } else {
        (1e3, "µs")
    };
    let xmax = span / scale * 1.01;
    // Narrower than a pixel would not show: every bar gets about one.
    let min_w = xmax / 1300.0;
    let x = |t: i64| t.saturating_sub(m.t0) as f64 / scale;
    // Rank 0 on top.
    let y = |r: usize| (ws - 1 - r) as f64;
    let height = (150 + 34 * ws as u32).clamp(280, 2400);
    let root = SVGBackend::new(path, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let (top, strip) = root.split_vertically(height - 34);
    let per_rank = m.ops.iter().map(Vec::len).max().unwrap_or(0);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "ferroccl trace: {} ranks, up to {} operations per rank",
                m.world_size,
                thousands(per_rank)
            ),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(110)
        .build_cartesian_2d(0.0..xmax, -0.6..(ws as f64 - 0.4))
        .map_err(&err)?;
    let missing = &m.missing;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .y_labels(ws + 1)
        .y_label_formatter(&|v| {
            let k = v.round();
            if (v - k).abs() > 1e-6 || k < 0.0 || k as usize >= ws {
                return String::new();
            }
            let r = ws - 1 - k as usize;
            if missing.contains(&r) {
                format!("rank {r} (no file)")
            } else {
                format!("rank {r}")
            }
        })
        .x_desc(format!(
            "time ({unit}) on the reference clock, from the first start"
        ))
        .draw()
        .map_err(&err)?;
    let mut kinds: Vec<&str> = Vec::new();
    for o in m.ops.iter().flatten() {
        if !kinds.contains(&o.rec.kind.as_str()) {
            kinds.push(&o.rec.kind);
        }
    }
    // The palette without its red, which marks failures.
    let kind_color = |k: &str| {
        let i = kinds.iter().position(|x| *x == k).unwrap_or(0);
        crate::plot::color(if i >= 3 { i + 1 } else { i })
    };
    let red = RGBColor(214, 39, 40);
    let orange = RGBColor(255, 140, 0);
    let dark = |c: RGBColor| RGBColor(c.0 / 2, c.1 / 2, c.2 / 2);
    let mut bars = Vec::new();
    let mut waits = Vec::new();
    for o in m.ops.iter().flatten() {
        let (x0, yc) = (x(o.start), y(o.rank));
        let x1 = x(o.end).max(x0 + min_w);
        let c = if o.failed() {
            red
        } else if o.running {
            orange
        } else {
            kind_color(&o.rec.kind)
        };
        bars.push(Rectangle::new(
            [(x0, yc - 0.32), (x1, yc + 0.32)],
            c.filled(),
        ));
        // Only the total per peer is known: drawn from the start, as in the trace.
        let waited: u64 = o.rec.waits.iter().map(|w| w.ns).sum();
        if waited > 0 {
            let w = (waited as f64 / scale).min(x1 - x0);
            waits.push(Rectangle::new(
                [(x0, yc - 0.32), (x0 + w, yc + 0.32)],
                dark(c).filled(),
            ));
        }
    }
    chart.draw_series(bars).map_err(&err)?;
    chart.draw_series(waits).map_err(&err)?;
    // The legend, in a strip under the chart: a swatch and a name per entry.
    let mut legend: Vec<(String, RGBColor)> = kinds
        .iter()
        .map(|k| (k.to_string(), kind_color(k)))
        .collect();
    legend.push((
        "darker: waiting on a peer".into(),
        dark(crate::plot::color(0)),
    ));
    if m.ops.iter().flatten().any(Op::failed) {
        legend.push(("failed".into(), red));
    }
    if m.ops.iter().flatten().any(|o| o.running) {
        legend.push(("running at the dump".into(), orange));
    }
    let mut px = 125;
    for (name, c) in &legend {
        strip
            .draw(&Rectangle::new([(px, 8), (px + 14, 20)], c.filled()))
            .map_err(&err)?;
        strip
            .draw(&Text::new(
                name.clone(),
                (px + 20, 7),
                ("sans-serif", 14).into_font(),
            ))
            .map_err(&err)?;
        px += 40 + 7 * name.chars().count() as i32;
    }
    root.present().map_err(&err)?;
    Ok(())
}
