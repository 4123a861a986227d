//! `multicast-sweep`: every planner for N = 1..=max targets on one test bed; prints the README
//! table, writes the results as JSON and a PNG plot of seconds versus N.
//!
//! `multicast-sweep --netns --link-mbit 1000 --bytes 67108864 --png docs/multicast.png --json results.json`
//!
//! With `--compare-mpi`, Cascade's blitz plan and OpenMPI's `MPI_Bcast` (N+1 ranks, the
//! program in `benches/mpi/`) run alternately on the same hosts and bytes, `--reps` times each
//! per N; the table gives both medians and their ratio.

use std::path::PathBuf;

use anyhow::Context;
use cascade_benches::mpi::MpiBcast;
use cascade_benches::multicast::{run_role, Bed, BedArgs, RoleArgs};
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
    #[command(flatten)]
    bed: BedArgs,
    /// Compare with OpenMPI's MPI_Bcast on the same hosts and bytes (needs openmpi-bin and
    /// libopenmpi-dev): blitz only, alternating runs, medians.
    #[arg(long)]
    compare_mpi: bool,
    /// Runs of each side per N with --compare-mpi.
    #[arg(long, default_value_t = 3)]
    reps: usize,
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
    cascade_benches::quiet_panic_on_closed_stdout();
    cascade_benches::init_logging();
    let c = Cli::parse();
    if run_role(&c.role)? {
        return Ok(());
    }
    // Before the bed starts (--reps 0 was taken as 1 without a word).
    anyhow::ensure!(!c.compare_mpi || c.reps > 0, "--reps must be at least 1 (each N reports the median of its runs)");
    let bed = c.bed.start(c.max_targets)?;
    if c.compare_mpi {
        return compare_mpi(&c, bed);
    }
    let mut results: Vec<Value> = Vec::new();
    for p in PLANNERS {
        for n in 1..=c.max_targets {
            eprintln!("{p} to {n} targets ...");
            results.push(bed.run(p, n, c.bed.bytes)?);
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
        c.bed.bytes >> 20,
        c.bed.link_mbit,
        if c.bed.netns {
            format!(", shaped (netns + tbf, MTU {})", c.bed.mtu.unwrap_or(1500))
        } else {
            ", loopback, unshaped".into()
        }
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
        // blitz is drawn wide underneath: with one source its plan equals chain's, and both stay visible.
        let styles = [(RED, 8), (BLUE, 3), (GREEN, 3), (MAGENTA, 3)];
        let series: Vec<Series> = PLANNERS
            .iter()
            .zip(styles)
            .map(|(p, (color, width))| {
                (p.to_string(), color, width, (1..=c.max_targets).map(|n| secs(*p, n)).collect())
            })
            .collect();
        plot(path, &c, &series, bound, "")?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Cascade (blitz) and MPI_Bcast alternately, `reps` times each per N; medians and ratios.
fn compare_mpi(c: &Cli, bed: Bed) -> anyhow::Result<()> {
    let mpi = MpiBcast::build(bed.dir())?;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    for n in 1..=c.max_targets {
        let (mut ours, mut theirs, mut predicted) = (Vec::new(), Vec::new(), f64::NAN);
        for rep in 1..=c.reps {
            eprintln!("N={n}, run {rep}: cascade, then MPI_Bcast with {} ranks ...", n + 1);
            let v = bed.run(PlannerKind::Blitz, n, c.bed.bytes)?;
            ours.push(v["seconds"].as_f64().context("cascade printed no seconds")?);
            predicted = v["predicted_seconds"].as_f64().unwrap_or(f64::NAN);
            theirs.push(mpi.run(bed.net(), 1, n, c.bed.bytes)?);
        }
        let (a, b) = (median(&mut ours.clone()), median(&mut theirs.clone()));
        rows.push(serde_json::json!({
            "targets": n, "bytes": c.bed.bytes, "netns": c.bed.netns, "shm": c.bed.shm, "link_mbit": bed.link_mbit, "mtu": bed.mtu,
            "cascade_seconds": ours, "mpi_seconds": theirs, "cascade_median": a, "mpi_median": b, "ratio": a / b,
            "predicted_seconds": predicted, "link_gbps": bed.link_gbps, "machine_gbps": bed.machine_gbps,
            "chunk_overhead_s": bed.chunk_overhead_s,
        }));
    }
    let bound = bed.link_mbit.map(|b| c.bed.bytes as f64 * 8.0 / (b as f64 * 1e6));
    let links = match (c.bed.netns, c.bed.shm) {
        (true, _) => format!(
            "netns hosts, {} Mbit/s tbf, MTU {}; MPI: one rank per host, TCP, pipelined bcast (1 MiB segments)",
            c.bed.link_mbit,
            bed.mtu.unwrap_or(1500)
        ),
        (false, true) => {
            "one host, shm links; MPI: every rank on this host (OpenMPI's shared-memory transport, default bcast)"
                .into()
        }
        (false, false) => "one host, loopback tcp; MPI: every rank on this host (OpenMPI picks shared memory)".into(),
    };
    println!("{} MiB, {links}: median of {} alternating runs\n", c.bed.bytes >> 20, c.reps);
    println!(
        "| N | Cascade blitz (s) | MPI_Bcast, N+1 ranks (s) | Cascade / MPI | predicted (s) | measured / predicted |{}",
        if bound.is_some() { " Cascade / bound |" } else { "" }
    );
    println!("| --- | --- | --- | --- | --- | --- |{}", if bound.is_some() { " --- |" } else { "" });
    for r in &rows {
        let a = r["cascade_median"].as_f64().unwrap_or(f64::NAN);
        let p = r["predicted_seconds"].as_f64().unwrap_or(f64::NAN);
        print!(
            "| {} | {a:.3} | {:.3} | {:.2} | {p:.3} | {:.2} |",
            r["targets"],
            r["mpi_median"].as_f64().unwrap_or(f64::NAN),
            r["ratio"].as_f64().unwrap_or(f64::NAN),
            a / p
        );
        match bound {
            Some(b) => println!(" {:.3} |", a / b),
            None => println!(),
        }
    }
    if let Some(path) = &c.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    if let Some(path) = &c.png {
        let col = |k: &str| rows.iter().map(|r| r[k].as_f64().unwrap_or(f64::NAN)).collect::<Vec<_>>();
        let series: Vec<Series> = vec![
            ("Cascade (blitz)".into(), RED, 4, col("cascade_median")),
            ("OpenMPI MPI_Bcast".into(), BLUE, 3, col("mpi_median")),
        ];
        plot(path, c, &series, bound, " vs OpenMPI")?;
        eprintln!("plot written to {}", path.display());
    }
    drop(bed);
    Ok(())
}

/// A line of the plot: its label, colour, width and seconds for N = 1, 2, ...
type Series = (String, RGBColor, u32, Vec<f64>);

fn plot(path: &PathBuf, c: &Cli, series: &[Series], bound: Option<f64>, what: &str) -> anyhow::Result<()> {
    cascade_benches::register_font(&c.font)?;
    let ymax = series.iter().flat_map(|s| s.3.iter().copied()).chain(bound).fold(0.0f64, f64::max) * 1.1;
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let links = match (c.bed.netns, c.bed.shm) {
        (true, _) => match c.bed.mtu {
            Some(m) => format!("{} Mbit/s links, MTU {m}", c.bed.link_mbit),
            None => format!("{} Mbit/s links", c.bed.link_mbit),
        },
        (false, true) => "shared memory (one host)".into(),
        (false, false) => "loopback (unshaped)".into(),
    };
    let title = format!("Multicast of {} MiB over {links}{what}", c.bed.bytes >> 20);
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
    for (label, color, width, secs) in series {
        let (color, width) = (*color, *width);
        let pts: Vec<(f64, f64)> = secs.iter().enumerate().map(|(i, s)| ((i + 1) as f64, *s)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))?
            .label(label.clone())
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
