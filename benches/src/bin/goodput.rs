//! `goodput --scenario FILE --scheduler NAME [--rate R | --max-goodput] --json`: simulates a
//! scenario (DESIGN.md's TOML format; see `cascade_sched::scenario`) under one scheduler and
//! reports `scheduler, offered_rps, goodput_rps, bad_rate, gpu_idle_fraction, mean_batch,
//! per_model[{name, goodput_rps, p99_ms, mean_batch}]` plus batch sizes, queueing delays and
//! Symphony's autoscaling advice; with `--max-goodput`, `search`: every rate tried `{rate_rps, ok,
//! worst_model, worst_good_fraction}`. `--charge-dispatch SCALE` charges the schedulers' own
//! computation to the virtual clock (`cascade_sched::charged`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use cascade_sched::{autoscale, Scenario};
use clap::Parser;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Simulate a serving scenario under a batching scheduler")]
struct Cli {
    /// Scenario file (TOML).
    #[arg(long)]
    scenario: PathBuf,
    /// symphony, symphony-wc, clockwork, clockwork-real, nexus, flex or flex-np (or a
    /// partitioned cluster: symphony/L, flex/herd:G:GMAX).
    #[arg(long)]
    scheduler: String,
    /// Total offered rate, requests/s, split by the models' weights (default: the file's rates).
    #[arg(long, conflicts_with = "max_goodput")]
    rate: Option<f64>,
    /// Search for the goodput: the highest rate with ≥ 99% of every model's requests in SLO.
    #[arg(long)]
    max_goodput: bool,
    /// Charge each scheduler callback its measured wall time × this on the virtual clock (one
    /// dispatcher per part of a partitioned cluster; results then vary slightly run to run).
    #[arg(long)]
    charge_dispatch: Option<f64>,
    /// The arrivals' seed (default: the file's `seed`); a run is deterministic for its seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Bad rate (a fraction of requests, in [0, 1)) above which the autoscaling advice adds GPUs.
    #[arg(long, default_value_t = 0.01)]
    bad_threshold: f64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    let mut s = Scenario::load(&c.scenario).with_context(|| format!("scenario {}", c.scenario.display()))?;
    if let Some(seed) = c.seed {
        s.seed = seed;
    }
    if c.charge_dispatch.is_some() {
        s.charge_dispatch = c.charge_dispatch;
        s.check()?;
    }
    if !(0.0..1.0).contains(&c.bad_threshold) {
        // A negative threshold gave advice that neither adds nor releases a GPU; NaN or ≥ 1, one
        // that can never add any.
        bail!("--bad-threshold is a fraction of requests in [0, 1), got {}", c.bad_threshold);
    }
    if let Some(r) = c.rate {
        if !(r >= 0.0 && r.is_finite()) {
            bail!("--rate must be a non-negative number");
        }
    }
    let t = Instant::now();
    let (rate, rep, probes) = if c.max_goodput {
        let g = s.max_goodput(&c.scheduler)?;
        (Some(g.rate_rps), g.report, g.probes)
    } else {
        (c.rate, s.run(&c.scheduler, c.rate)?, Vec::new())
    };
    let wall = t.elapsed().as_secs_f64();
    let advice = autoscale::advise(s.gpus, rep.bad_rate, rep.gpu_idle_fraction, c.bad_threshold);
    let goodput = if c.max_goodput { rate.unwrap_or(0.0) } else { rep.goodput_rps };
    // A partitioned cluster (`symphony/L`, `flex/herd:G:GMAX`): each model's parts with its share
    // on each, and each part's GPUs, as planned at the file's rates.
    let partition = s
        .partition(&c.scheduler, &s.profiles()?, &s.rates(None))?
        .map(|(_, split)| json!({"parts_of_model": split.parts_of_model(), "gpus_per_part": split.gpus}));
    if c.json {
        println!(
            "{}",
            json!({
                "scheduler": c.scheduler, "offered_rps": rep.offered_rps, "goodput_rps": goodput,
                "bad_rate": rep.bad_rate, "gpu_idle_fraction": rep.gpu_idle_fraction, "mean_batch": rep.mean_batch,
                "per_model": rep.per_model, "batch_histogram": rep.batch_histogram, "preemptions": rep.preemptions,
                "lost": rep.lost, "autoscale": advice, "max_goodput_search": c.max_goodput, "wall_seconds": wall,
                "charge_dispatch": s.charge_dispatch, "seed": s.seed,
                "partition": partition, "search": probes,
            })
        );
    } else {
        if c.max_goodput {
            println!("{}: goodput {:.0} requests/s (≥ 99% of every model's requests within SLO)", c.scheduler, goodput);
            for p in &probes {
                println!(
                    "  tried {:>10.0} rps: {}  (worst: {} {:.4} within SLO)",
                    p.rate_rps,
                    if p.ok { "pass" } else { "fail" },
                    p.worst_model,
                    p.worst_good_fraction
                );
            }
        }
        println!(
            "{}: offered {:.0} rps, within SLO {:.0} rps, bad rate {:.4}, GPU idle {:.3}, mean batch {:.2}, lost {} ({:.2} s wall)",
            c.scheduler, rep.offered_rps, rep.goodput_rps, rep.bad_rate, rep.gpu_idle_fraction, rep.mean_batch, rep.lost, wall
        );
        for m in &rep.per_model {
            println!(
                "  {:<20} {:>9.0} rps good {:.4}  p99 {:>7.2} ms  queue p50/p99 {:.2}/{:.2} ms  mean batch {:.2}",
                m.name, m.goodput_rps, m.good_fraction, m.p99_ms, m.queue_p50_ms, m.queue_p99_ms, m.mean_batch
            );
        }
        println!("  autoscale: add {:.2} GPUs, release {:.2}", advice.add_gpus, advice.release_gpus);
        if let Some(p) = &partition {
            println!("  partition: {p}");
        }
    }
    if rep.lost != 0 {
        bail!("{} requests unaccounted for", rep.lost);
    }
    Ok(())
}
