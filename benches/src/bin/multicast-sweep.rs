//! `multicast-sweep`: every planner for N = 1..=max targets on one test bed; prints the README
//! table, writes the results as JSON and a PNG plot of seconds versus N.
//!
//! `multicast-sweep --netns --link-mbit 1000 --bytes 67108864 --png docs/multicast.png --json results.json`

use std::path::PathBuf;

use anyhow::Context;
use cascade_benches::multicast::{run_role, Bed, RoleArgs};
use cascade_multicast::PlannerKind;
use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

/// Sweep planners and target counts; table, JSON and plot.
#[derive(Parser)]
#[command(about = "Multicast time vs number of targets for every planner")]
struct Cli {
    /// Largest number of targets.
    #[arg(long, default_value_t = 8)]
    max_targets: usize,
    /// Model bytes.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: u64,
    /// Link rate (shaped with --netns).
    #[arg(long, default_value_t = 1000)]
    link_mbit: u64,
    /// Namespaced hosts with shaped links (needs root).
    #[arg(long)]
    netns: bool,
    /// Link the nodes (one host) by shared memory instead of loopback tcp.
    #[arg(long)]
    shm: bool,
    /// Measure the executor's per-chunk overhead (and on shm the hop rate) first and plan with
    /// them instead of the defaults (experimental: on this 2-core machine the larger chunks it
    /// picks for shm are slower, see README).
    #[arg(long)]
    calibrate: bool,
    /// Write the plot here.
    #[arg(long)]
    png: Option<PathBuf>,
    /// Write every result here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Font for the plot's text.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    #[command(flatten)]
    role: RoleArgs,
}

const PLANNERS: [PlannerKind; 4] = [PlannerKind::Blitz, PlannerKind::Chain, PlannerKind::Tree, PlannerKind::Star];

fn main() -> anyhow::Result<()> {
    cascade_benches::init_logging();
    let c = Cli::parse();
    if run_role(&c.role)? {
        return Ok(());
    }
    let mut bed = Bed::start_with(c.netns, c.shm, c.max_targets, c.link_mbit)?;
    if c.calibrate {
        // The planner is told this bed's measured per-chunk overhead (and, on shm, hop rate).
        let o = bed.calibrate()?;
        eprintln!("calibrated: link {:.1} Gbit/s, chunk overhead {:.0} µs", bed.link_gbps, o * 1e6);
    }
    let mut results: Vec<Value> = Vec::new();
    for p in PLANNERS {
        for n in 1..=c.max_targets {
            eprintln!("{p} to {n} targets ...");
            results.push(bed.run(p, n, c.bytes)?);
        }
    }
    drop(bed);
    let secs = |p: PlannerKind, n: usize| {
        results
            .iter()
            .find(|v| v["planner"] == serde_json::json!(p) && v["targets"] == serde_json::json!(n))
            .and_then(|v| v["seconds"].as_f64())
            .unwrap_or(f64::NAN)
    };
    let bound = results.first().and_then(|v| v["bound_seconds"].as_f64());
    println!(
        "{} MiB, link {} Mbit/s{}: seconds until every target holds every byte (crc32-verified)\n",
        c.bytes >> 20,
        c.link_mbit,
        if c.netns { ", shaped (netns + tbf)" } else { ", loopback, unshaped" }
    );
    print!("| N |");
    for p in PLANNERS {
        print!(" {p} |");
    }
    println!("{}", if bound.is_some() { " blitz / bound |" } else { "" });
    println!("|{}", " --- |".repeat(PLANNERS.len() + 1 + usize::from(bound.is_some())));
    for n in 1..=c.max_targets {
        print!("| {n} |");
        for p in PLANNERS {
            print!(" {:.3} |", secs(p, n));
        }
        match bound {
            Some(b) => println!(" {:.3} |", secs(PlannerKind::Blitz, n) / b),
            None => println!(),
        }
    }
    if let Some(b) = bound {
        println!("\nbound = S·8/B = {b:.3} s");
    }
    if let Some(path) = &c.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
    }
    if let Some(path) = &c.png {
        plot(path, &c, &secs, bound)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

fn plot(path: &PathBuf, c: &Cli, secs: &dyn Fn(PlannerKind, usize) -> f64, bound: Option<f64>) -> anyhow::Result<()> {
    let font = std::fs::read(&c.font)
        .with_context(|| format!("reading font {} (apt-get install fonts-dejavu-core)", c.font.display()))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{} is not a usable font", c.font.display()))?;
    let ymax = PLANNERS.iter().flat_map(|p| (1..=c.max_targets).map(|n| secs(*p, n))).fold(0.0f64, f64::max) * 1.1;
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "Multicast of {} MiB over {} Mbit/s links{}",
        c.bytes >> 20,
        c.link_mbit,
        if c.netns { "" } else { " (loopback, unshaped)" }
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5f64..(c.max_targets as f64 + 0.5), 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc("targets N")
        .y_desc("seconds")
        .x_labels(c.max_targets)
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .label_style(("sans-serif", 16))
        .draw()?;
    // blitz is drawn wide underneath: with one source its plan equals chain's, and both stay visible.
    let styles = [(RED, 8), (BLUE, 3), (GREEN, 3), (MAGENTA, 3)];
    for (p, (color, width)) in PLANNERS.iter().zip(styles) {
        let pts: Vec<(f64, f64)> = (1..=c.max_targets).map(|n| (n as f64, secs(*p, n))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))?
            .label(p.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width)));
        chart.draw_series(pts.iter().map(|&xy| Circle::new(xy, 4, color.filled())))?;
    }
    if let Some(b) = bound {
        chart
            .draw_series(LineSeries::new(vec![(0.5, b), (c.max_targets as f64 + 0.5, b)], BLACK.stroke_width(1)))?
            .label("bound S/B")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present()?;
    Ok(())
}
