//! The replay's outputs: the comparison table, JSON summary lines, per-request
//! CSV, and plots (TTFT CDF per series, exposed transfer time against KV size)
//! as SVG and PNG.

use std::io::Write;
use std::path::Path;

use anyhow::{anyhow, Context};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::json;

use super::sim::{LinkProfile, Overlap};
use super::Series;

fn round(v: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (v * m).round() / m
}

fn summary_json(s: &Series, bytes_scale: f64) -> serde_json::Value {
    let m = &s.summary;
    json!({
        "replay": "summary",
        "source": if s.live { "live" } else { "projected" },
        "series": s.name,
        "overlap": s.overlap.label(),
        "time_scale": s.time_scale,
        "requests": m.requests,
        "kv_bytes": m.kv_bytes,
        "moved_bytes": if s.live { (m.kv_bytes as f64 * bytes_scale) as u64 } else { m.kv_bytes },
        "ttft_p50_ms": round(m.ttft_p50_ms, 2),
        "ttft_p90_ms": round(m.ttft_p90_ms, 2),
        "ttft_p99_ms": round(m.ttft_p99_ms, 2),
        "exposed_p50_ms": round(m.exposed_p50_ms, 3),
        "exposed_p99_ms": round(m.exposed_p99_ms, 3),
        "queue_p50_ms": round(m.queue_p50_ms, 2),
        "transfer_share_of_ttft": round(m.transfer_share_of_ttft, 4),
        "hidden_share": round(m.hidden_share, 4),
        "gbps": round(s.moved_gbps, 3),
    })
}

/// Prints one JSON line per series and the comparison table.
pub fn print(series: &[Series], links: &[&LinkProfile], bytes_scale: f64) {
    for s in series {
        println!("{}", summary_json(s, bytes_scale));
    }
    for l in links {
        println!(
            "{}",
            json!({"replay": "link", "name": l.name, "rails": l.rails, "gbit_per_rail": round(l.gbit_per_rail, 3),
                   "latency_us": l.latency_us, "per_op_us": round(l.per_op_us, 1), "source": l.source})
        );
    }
    eprintln!();
    eprintln!(
        "{:<10} {:<18} {:<6} {:>6} {:>10} {:>10} {:>10} {:>11} {:>11} {:>8} {:>7} {:>8}",
        "source",
        "series",
        "send",
        "time",
        "TTFT p50",
        "p90",
        "p99",
        "exposed p50",
        "p99",
        "xfer %",
        "hidden",
        "GB/s"
    );
    for s in series {
        let m = &s.summary;
        eprintln!(
            "{:<10} {:<18} {:<6} {:>6} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2}ms {:>9.2}ms {:>7.2}% {:>6.1}% {:>8.2}",
            if s.live { "live" } else { "projected" },
            s.name,
            s.overlap.label(),
            format!("x{}", s.time_scale),
            m.ttft_p50_ms,
            m.ttft_p90_ms,
            m.ttft_p99_ms,
            m.exposed_p50_ms,
            m.exposed_p99_ms,
            m.transfer_share_of_ttft * 100.0,
            m.hidden_share * 100.0,
            s.moved_gbps,
        );
    }
    eprintln!("links:");
    for l in links {
        eprintln!(
            "  {:<18} {} x {:.2} Gbit/s, {} us latency, {:.1} us per push: {}",
            l.name, l.rails, l.gbit_per_rail, l.latency_us, l.per_op_us, l.source
        );
    }
    if bytes_scale < 1.0 {
        eprintln!(
            "live rows moved {bytes_scale:.4} of each block: their GB/s is what moved; TTFT and exposed time are as measured with the smaller blocks"
        );
    }
}

/// Writes `summary.json`, `requests.csv` and the plots under `dir`.
pub fn write(
    dir: &Path,
    config: &serde_json::Value,
    series: &[Series],
    links: &[&LinkProfile],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let scale = config["live_kv_scale"].as_f64().unwrap_or(1.0);
    let summary = json!({
        "config": config,
        "links": links,
        "series": series.iter().map(|s| summary_json(s, scale)).collect::<Vec<_>>(),
    });
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let mut csv = std::io::BufWriter::new(std::fs::File::create(dir.join("requests.csv"))?);
    writeln!(csv, "source,series,overlap,time_scale,index,arrival_ms,prompt_tokens,kv_bytes,queue_ms,prefill_ms,transfer_ms,exposed_ms,ttft_ms")?;
    for s in series {
        for r in &s.records {
            writeln!(
                csv,
                "{},{},{},{},{},{:.3},{},{},{:.3},{:.3},{:.3},{:.3},{:.3}",
                if s.live { "live" } else { "projected" },
                s.name,
                s.overlap.label(),
                s.time_scale,
                r.index,
                r.arrival_ms,
                r.prompt_tokens,
                r.kv_bytes,
                r.queue_ms,
                r.prefill_ms,
                r.transfer_ms,
                r.exposed_ms,
                r.ttft_ms
            )?;
        }
    }
    csv.flush()?;
    let live_json: Vec<serde_json::Value> = series
        .iter()
        .filter(|s| s.live)
        .map(|s| json!({"series": s.name, "overlap": s.overlap.label(), "records": s.records}))
        .collect();
    std::fs::write(
        dir.join("live_requests.json"),
        serde_json::to_string(&live_json)?,
    )?;
    match load_font() {
        Ok(()) => plots(dir, series)?,
        Err(e) => eprintln!("plots skipped: {e}"),
    }
    Ok(())
}

/// Plotters draws text with a font it is given; DejaVu Sans is in Debian's
/// `fonts-dejavu-core`.
fn load_font() -> anyhow::Result<()> {
    static LOADED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
                .into_iter()
                .find(|p| Path::new(p).exists())
                .ok_or("no DejaVuSans.ttf (apt install fonts-dejavu-core)")?;
            let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{path}: not a font"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Series shown in the plots: every live run, and the projections in
/// layer-wise mode (all-at-once for TCP, as a contrast).
fn plotted(series: &[Series]) -> Vec<&Series> {
    series
        .iter()
        .filter(|s| {
            s.live
                || (s.overlap == Overlap::LayerWise && s.name != "spark-rdma-1rail")
                || (s.overlap == Overlap::AllAtOnce && s.name == "spark-tcp")
        })
        .collect()
}

fn series_label(s: &Series) -> String {
    format!(
        "{} {} ({}, time x{})",
        if s.live { "live" } else { "projected" },
        s.name,
        s.overlap.label(),
        s.time_scale
    )
}

fn plots(dir: &Path, series: &[Series]) -> anyhow::Result<()> {
    let shown = plotted(series);
    for ext in ["svg", "png"] {
        let cdf = dir.join(format!("ttft_cdf.{ext}"));
        let scatter = dir.join(format!("exposed_vs_kv.{ext}"));
        if ext == "svg" {
            ttft_cdf(
                SVGBackend::new(&cdf, (1000, 640)).into_drawing_area(),
                &shown,
            )?;
            exposed_scatter(
                SVGBackend::new(&scatter, (1000, 640)).into_drawing_area(),
                &shown,
            )?;
        } else {
            ttft_cdf(
                BitMapBackend::new(&cdf, (1000, 640)).into_drawing_area(),
                &shown,
            )?;
            exposed_scatter(
                BitMapBackend::new(&scatter, (1000, 640)).into_drawing_area(),
                &shown,
            )?;
        }
    }
    Ok(())
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

fn ttft_cdf<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    shown: &[&Series],
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(plot_err)?;
    let max = shown
        .iter()
        .flat_map(|s| s.records.iter().map(|r| r.ttft_ms / 1000.0))
        .fold(0.1f64, f64::max);
    let min = shown
        .iter()
        .flat_map(|s| s.records.iter().map(|r| r.ttft_ms / 1000.0))
        .fold(max, f64::min)
        .max(1e-3);
    let mut chart = ChartBuilder::on(&root)
        .caption("Time to first token, CDF", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((min * 0.9..max * 1.1).log_scale(), 0.0f64..1.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(plot_err)?;
    for (i, s) in shown.iter().enumerate() {
        let mut v: Vec<f64> = s.records.iter().map(|r| r.ttft_ms / 1000.0).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let color = Palette99::pick(i).to_rgba();
        let style = if s.live {
            color.stroke_width(3)
        } else {
            color.stroke_width(1)
        };
        // At most ~1000 points per line (and always the last): keeps the SVG small.
        let step = v.len().div_ceil(1000).max(1);
        let last = v.len().saturating_sub(1);
        chart
            .draw_series(LineSeries::new(
                v.iter()
                    .enumerate()
                    .filter(|(k, _)| k % step == 0 || *k == last)
                    .map(|(k, t)| (t.max(min), (k + 1) as f64 / n)),
                style,
            ))
            .map_err(plot_err)?
            .label(series_label(s))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

fn exposed_scatter<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    shown: &[&Series],
) -> anyhow::Result<()> {
    const FLOOR_MS: f64 = 0.01;
    root.fill(&WHITE).map_err(plot_err)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // Colours follow the CDF's (same index); the ideal transfer exposes nothing.
    let shown: Vec<(usize, &&Series)> = shown
        .iter()
        .enumerate()
        .filter(|(_, s)| s.name != "ideal")
        .collect();
    let max_x = shown
        .iter()
        .flat_map(|(_, s)| s.records.iter().map(|r| gib(r.kv_bytes)))
        .fold(0.01f64, f64::max);
    let max_y = shown
        .iter()
        .flat_map(|(_, s)| s.records.iter().map(|r| r.exposed_ms))
        .fold(1.0f64, f64::max);
    // At most ~2000 requests per series (every k-th): keeps the SVG small.
    let step = shown
        .iter()
        .map(|(_, s)| s.records.len().div_ceil(2000))
        .max()
        .unwrap_or(1)
        .max(1);
    let caption = if step > 1 {
        format!("Exposed KV transfer time against KV size (every {step}th request)")
    } else {
        "Exposed KV transfer time against KV size".to_string()
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0f64..max_x * 1.05, (FLOOR_MS..max_y * 1.5).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("KV bytes of the request, per rank (GiB, full size)")
        .y_desc("exposed transfer (ms, log; 0 drawn at 0.01)")
        .draw()
        .map_err(plot_err)?;
    for (i, s) in shown {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(
                s.records
                    .iter()
                    .step_by(step)
                    .filter(|r| r.kv_bytes > 0)
                    .map(|r| {
                        Circle::new(
                            (gib(r.kv_bytes), r.exposed_ms.max(FLOOR_MS)),
                            2,
                            color.mix(0.5).filled(),
                        )
                    }),
            )
            .map_err(plot_err)?
            .label(series_label(s))
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}
