//! `anyccl bench --plot FILE.svg`: latency and bandwidth against message size, one line per algorithm and `auto`,
//! drawn with the `plotters` crate (SVG backend; PNG would need a font stack, so it is refused with a clear error).

use std::path::Path;

use plotters::prelude::*;

use crate::bench::{BenchReport, Cell};
use anyccl::core::{Error, Result};

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// (bytes, latency µs, bandwidth GB/s).
type Point = (f64, f64, f64);

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "plot".into(), call: "draw".into(), code: None, message: e.to_string() }
}

/// A compact axis label: 3 significant digits at most.
fn short(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Checks that `path` names an SVG file (before a sweep is run for nothing).
pub fn check_path(path: &Path) -> Result<()> {
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => Ok(()),
        other => Err(Error::Parse {
            what: "plot file",
            input: path.display().to_string(),
            expected: format!("a .svg file (got {}; PNG is not supported)", other.unwrap_or("no extension")),
        }),
    }
}

/// Draws `report` into the SVG file at `path`.
pub fn plot(report: &BenchReport, path: &Path) -> Result<()> {
    check_path(path)?;
    let bw_name = if report.world > 1 { "bus bandwidth (GB/s)" } else { "algorithm bandwidth (GB/s)" };
    let bw = |c: &Cell| if report.world > 1 { c.busbw_gbps } else { c.algbw_gbps };
    // Series: every measured algorithm, then auto.
    let mut series: Vec<(String, Vec<Point>)> = report
        .algorithms
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let pts = report
                .rows
                .iter()
                .filter_map(|r| r.out_of_place.cells.get(i))
                .zip(&report.rows)
                .filter(|(c, _)| c.median_us.is_finite())
                .map(|(c, r)| (r.bytes as f64, c.median_us, bw(c)))
                .collect();
            (a.name().to_owned(), pts)
        })
        .collect();
    series.push((
        "auto".into(),
        report.rows.iter().map(|r| (r.bytes as f64, r.out_of_place.auto.median_us, bw(&r.out_of_place.auto))).collect(),
    ));
    let all: Vec<&Point> = series.iter().flat_map(|(_, p)| p).collect();
    if all.is_empty() {
        return Err(plot_err("nothing was measured"));
    }
    let span = |f: &dyn Fn(&Point) -> f64| {
        let lo = all.iter().map(|p| f(p)).filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        let hi = all.iter().map(|p| f(p)).fold(0.0f64, f64::max);
        if lo.is_finite() && hi > 0.0 {
            (lo / 1.5, hi * 1.5)
        } else {
            (1e-3, 1.0)
        }
    };
    let (x0, x1) = span(&|p| p.0);
    let (l0, l1) = span(&|p| p.1);
    let (b0, b1) = span(&|p| p.2);

    // Drawn into memory, then written whole (a failure leaves an existing file as it was).
    let mut svg = String::new();
    draw(&mut svg, report, &series, bw_name, [(x0, x1), (l0, l1), (b0, b1)])?;
    crate::output::write_atomically(path, svg.as_bytes(), "--plot", "the plot")
}

/// Draws the two charts (latency, bandwidth) of `series` into `svg`; `spans` are the x, latency and bandwidth
/// axis ranges.
fn draw(
    svg: &mut String,
    report: &BenchReport,
    series: &[(String, Vec<Point>)],
    bw_name: &str,
    spans: [(f64, f64); 3],
) -> Result<()> {
    let [(x0, x1), (l0, l1), (b0, b1)] = spans;
    let root = SVGBackend::with_string(svg, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!(
        "anyccl all-reduce: backend {}, world {}, {} {}",
        report.backend, report.world, report.dtype, report.op
    );
    let root = root.titled(&title, ("sans-serif", 18)).map_err(plot_err)?;
    let (left, right) = root.split_horizontally(600);
    for (area, is_latency) in [(left, true), (right, false)] {
        let (y0, y1, desc) = if is_latency { (l0, l1, "median latency (us)") } else { (b0, b1, bw_name) };
        let mut chart = ChartBuilder::on(&area)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc(desc)
            .x_label_formatter(&|v| anyccl::core::units::format_bytes(*v as u64))
            .y_label_formatter(&|v| short(*v))
            .draw()
            .map_err(plot_err)?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let data: Vec<(f64, f64)> =
                pts.iter().map(|p| (p.0, if is_latency { p.1 } else { p.2 })).filter(|p| p.1 > 0.0).collect();
            chart
                .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
                .map_err(plot_err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(data.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(plot_err)?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)
}
