//! `serve-sim`: BlitzScale's end-to-end comparison at cluster scale (seed `004_…`, §6) on the
//! simulator in `cascade_exec::llmsim`: emulated LLM instances (a test double for GPUs, costs from
//! a profile) serving a real trace with prefill/decode disaggregation and an autoscaler, the
//! parameters loaded as each system loads them.
//!
//! `serve-sim --trace sched/data/AzureLLMInferenceTrace_code.csv --system blitz --json`
//!
//! `--system all` runs the four systems and the `instant` bound (zero-time loads) on the same
//! trace and prints a table; `--png` writes the TTFT and TBT CDFs, `--timeline-png` a
//! 1→16-instance scale-out (Figure 18's shape).

use std::path::PathBuf;

use anyhow::{bail, Context};
use cascade_exec::llmsim::{parse_trace, simulate, OverContext, Profile, SimConfig, SimOutcome, System, TraceRequest};
use clap::Parser;
use plotters::prelude::*;

#[derive(Parser)]
#[command(about = "LLM serving at cluster scale: blitz vs ServerlessLLM-like vs AllCache vs stop-the-world")]
struct Cli {
    /// The trace: TIMESTAMP,ContextTokens,GeneratedTokens (the Azure LLM inference 2023 format).
    #[arg(long, default_value = "sched/data/AzureLLMInferenceTrace_code.csv")]
    trace: PathBuf,
    /// blitz, sllm, allcache, stop, instant (a bound: loads take no time), or all.
    #[arg(long, default_value = "all")]
    system: String,
    /// llama2-7b or llama2-70b.
    #[arg(long, default_value = "llama2-7b")]
    model: String,
    /// Multiply the trace's request rate (its arrivals compressed in time).
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// A request whose prompt and output exceed the model's context window (Llama-2: 4,096
    /// tokens; 14% of the code trace's prompts are longer): `clip` its prompt to fit (its end
    /// kept), `refuse` it on arrival (counted as missing its SLO), or `keep` it whole as if the
    /// window were larger (not what Llama-2 can do; the behaviour before the window was modelled).
    #[arg(long, default_value = "clip")]
    over_context: OverContext,
    /// The load monitor's target utilisation of prefill instances, in (0, 1]: lower starts
    /// instances earlier, at more GPU time.
    #[arg(long, default_value_t = cascade_exec::llmsim::UTILISATION)]
    utilisation: f64,
    /// Keep only the first this many seconds of the (rescaled) trace.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Hosts of the simulated cluster (`--gpus-per-host` GPUs each).
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// GPUs per host: NVLink joins a host's GPUs and its host cache serves them over PCIe;
    /// between hosts there is RDMA only. 8 is cluster A's physical layout; the paper's 7B and
    /// 8B runs group 1 GPU per *logical* host ("allowing us to simulate a larger cluster with 32
    /// and 16 hosts", §6), its 70B runs 4.
    #[arg(long, default_value_t = 8)]
    gpus_per_host: usize,
    /// Print one JSON object per system.
    #[arg(long)]
    json: bool,
    /// Write the TTFT and TBT CDFs of the systems run here.
    #[arg(long)]
    png: Option<PathBuf>,
    /// Simulate a step burst that scales prefill from 1 to 16 instances under every system and
    /// the `instant` bound, and plot prefill throughput over time here.
    #[arg(long)]
    timeline_png: Option<PathBuf>,
    /// Font for the plots' text.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
}

fn config(c: &Cli, system: System) -> anyhow::Result<SimConfig> {
    let mut cfg = SimConfig::new(system, Profile::by_name(&c.model).map_err(anyhow::Error::msg)?);
    if c.hosts == 0 || c.gpus_per_host == 0 {
        bail!("--hosts and --gpus-per-host must be at least 1");
    }
    cfg.hardware.hosts = c.hosts;
    cfg.hardware.gpus_per_host = c.gpus_per_host;
    cfg.over_context = c.over_context;
    cfg.prefill_utilisation = c.utilisation;
    Ok(cfg)
}

fn main() -> anyhow::Result<()> {
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    let systems: Vec<System> =
        if c.system == "all" { System::ALL.to_vec() } else { vec![c.system.parse().map_err(anyhow::Error::msg)?] };
    if let Some(d) = c.duration_s {
        // 0 kept the request at t = 0 and simulated it as "the first 0 seconds"; NaN and
        // negative ones ended in "an empty trace", which blamed the file.
        anyhow::ensure!(d > 0.0 && d.is_finite(), "--duration-s must be a positive number of seconds, got {d}");
    }
    let text = std::fs::read_to_string(&c.trace).with_context(|| format!("reading {}", c.trace.display()))?;
    let mut trace = parse_trace(&text, c.rate_scale)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("the trace {} at --rate-scale {}", c.trace.display(), c.rate_scale))?;
    if let Some(d) = c.duration_s {
        trace.retain(|r| r.at_ms <= d * 1e3);
    }
    let mut outs: Vec<SimOutcome> = Vec::new();
    for &s in &systems {
        let out = simulate(&config(&c, s)?, &trace).map_err(anyhow::Error::msg)?;
        if c.json {
            println!("{}", serde_json::to_string(&out.report)?);
        }
        outs.push(out);
    }
    if !c.json {
        table(&c, &trace, &outs);
    }
    if let Some(p) = &c.png {
        cascade_benches::register_font(&c.font)?;
        cdf_plot(p, &c, &mut outs)?;
    }
    if let Some(p) = &c.timeline_png {
        cascade_benches::register_font(&c.font)?;
        timeline(p, &c)?;
    }
    Ok(())
}

fn table(c: &Cli, trace: &[TraceRequest], outs: &[SimOutcome]) {
    let span = trace.last().map_or(0.0, |r| r.at_ms / 1e3);
    println!(
        "{} requests over {span:.0} s ({} ×{}), {}, {} hosts × {} GPUs",
        trace.len(),
        c.trace.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        c.rate_scale,
        c.model,
        c.hosts,
        c.gpus_per_host
    );
    println!("| system | TTFT p50 | TTFT p99 | TTFT mean | TBT p50 | TBT p99 | SLO met | GPU·s | peak GPUs | host cache (copies) | scale events (mutations) | load mean |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for o in outs {
        let r = &o.report;
        println!(
            "| {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} ms | {:.1} ms | {:.1}% | {:.0} | {} of {} | {:.1} GB ({:.2}) | {} ({}) | {:.2} s |",
            r.system.name(),
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.ttft_mean_ms,
            r.tbt_p50_ms,
            r.tbt_p99_ms,
            100.0 * r.slo_attainment,
            r.gpu_seconds,
            r.peak_gpus,
            r.gpus,
            r.host_cache_gb_avg,
            r.host_cache_copies_avg,
            r.scale_events,
            r.mutations,
            r.load_s_mean
        );
    }
    if let Some(o) = outs.first() {
        let r = &o.report;
        if r.over_context > 0 {
            println!(
                "{} requests longer than {}'s context window of {} tokens: {}",
                r.over_context,
                c.model,
                Profile::by_name(&c.model).map_or(0, |p| p.context_tokens),
                match r.over_context_policy {
                    OverContext::Clip => "prompts clipped to fit (--over-context clip)",
                    OverContext::Refuse => "refused, counted as missing the SLO (--over-context refuse)",
                    OverContext::Keep => "served whole, as if the window were larger (--over-context keep)",
                }
            );
        }
        println!(
            "TTFT floor: p99 of each prompt's own prefill, alone on an idle instance, {:.0} ms \
             (no system's TTFT p99 is below it without cooperative execution)",
            o.report.ttft_floor_p99_ms
        );
    }
}

const COLORS: [RGBColor; 5] = [
    RGBColor(200, 40, 40),
    RGBColor(40, 90, 200),
    RGBColor(40, 150, 60),
    RGBColor(150, 100, 30),
    RGBColor(120, 120, 120),
];

/// One line per named series, coloured by its place (the systems keep their colours from plot to
/// plot when they come in `System::ALL`'s order), with a legend.
fn draw_lines<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    series: Vec<(String, Vec<(f64, f64)>)>,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate<From = (f64, f64)>,
{
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let col = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, col.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn cdf_plot(path: &PathBuf, c: &Cli, outs: &mut [SimOutcome]) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    for (area, what) in [(left, "TTFT"), (right, "TBT")] {
        let curves: Vec<(String, Vec<(f64, f64)>)> = outs
            .iter_mut()
            .map(|o| {
                let name = o.report.system.name().to_string();
                let h = if what == "TTFT" { &mut o.ttft } else { &mut o.tbt };
                let s = h.samples();
                let n = s.len().max(1) as f64;
                let step = (s.len() / 2000).max(1);
                let pts = s
                    .iter()
                    .enumerate()
                    .step_by(step)
                    .map(|(i, &v)| ((v / 1e3).max(1e-3), (i + 1) as f64 / n))
                    .collect();
                (name, pts)
            })
            .collect();
        let xmax = curves.iter().flat_map(|(_, p)| p.iter().map(|x| x.0)).fold(0.01f64, f64::max);
        let mut chart = ChartBuilder::on(&area)
            .caption(format!("{what} CDF — {} ×{} rate, {}", c.model, c.rate_scale, "code trace"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((1e-3..xmax * 1.2).log_scale(), 0.0..1.0)?;
        chart.configure_mesh().x_desc(format!("{what} (s, log)")).y_desc("fraction of samples").draw()?;
        draw_lines(&mut chart, curves)?;
    }
    root.present()?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// A step burst: 60 s at a rate one prefill instance handles, then 60 s at 16 instances' worth
/// (prompts of 2,048 tokens, 28 generated, evenly spaced), on `--hosts` hosts; 1 s bins.
fn timeline(path: &PathBuf, c: &Cli) -> anyhow::Result<()> {
    let p = Profile::by_name(&c.model).map_err(anyhow::Error::msg)?;
    let cap = p.prefill_capacity() / 2048.0 * 0.8;
    let mut trace = Vec::new();
    let mut t = 0.0;
    while t < 120_000.0 {
        let rate = if t < 60_000.0 { 0.8 * cap } else { 16.0 * cap };
        trace.push(TraceRequest { at_ms: t, prompt_tokens: 2048, output_tokens: 28 });
        t += 1e3 / rate;
    }
    let mut series = Vec::new();
    for s in System::ALL {
        let mut cfg = config(c, s)?;
        cfg.timeline_bin_ms = 1000.0;
        let out = simulate(&cfg, &trace).map_err(anyhow::Error::msg)?;
        let pts: Vec<(f64, f64)> = out
            .timeline
            .iter()
            .filter(|x| (55.0..=105.0).contains(&x.t_s))
            .map(|x| (x.t_s - 60.0, x.prefill_tokens_per_s / 1e3))
            .collect();
        eprintln!(
            "timeline {}: TTFT p99 {:.0} ms over the burst, {} scale events",
            s.name(),
            out.report.ttft_p99_ms,
            out.report.scale_events
        );
        series.push((s.name().to_string(), pts));
    }
    let ymax = series.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).fold(1.0f64, f64::max) * 1.1;
    let root = BitMapBackend::new(path, (960, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Prefill throughput, 1 → 16 instances at t = 0 ({})", c.model), ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-5.0..45.0, 0.0..ymax)?;
    chart.configure_mesh().x_desc("seconds after the burst began").y_desc("prompt tokens/s (thousands)").draw()?;
    draw_lines(&mut chart, series)?;
    root.present()?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
