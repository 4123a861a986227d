//! `sched-throughput --models M --gpus G [--scheduler S] --json` → `requests, seconds,
//! requests_per_s, lost`: Symphony's real-time engine (ModelThreads, a RankThread, emulated GPUs
//! on wall-clock timers), or another scheduler as a dispatcher thread on the wall clock (HERD's
//! groups each with its own), fed by an in-process open-loop load generator. Models take, in turn, the A100 profiles of
//! Symphony's table with α ≤ 0.5 ms (16 models, with their SLOs), so that 1000 GPUs can carry
//! millions of requests per second and the figure measures the scheduler, not GPU capacity.

use std::time::Duration;

use anyhow::bail;
use cascade_sched::partition::{parts, split_by_name, symphony_split};
use cascade_sched::profile::{parse_table, Profile, TABLES};
use cascade_sched::realtime::{run, run_any, run_parts, run_sub_clusters, EngineConfig, MakeScheduler};
use cascade_sched::scenario::scheduler_by_name;
use cascade_sched::time::Delay;
use cascade_sched::Scheduler;
use clap::Parser;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Scheduled requests per second of the real-time Symphony engine")]
struct Cli {
    /// Models.
    #[arg(long, default_value_t = 64)]
    models: usize,
    /// Emulated GPUs.
    #[arg(long, default_value_t = 1000)]
    gpus: usize,
    /// Offered load, requests/s.
    #[arg(long, default_value_t = 1_500_000.0)]
    rate: f64,
    /// Seconds of offered load.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// ModelThreads.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Symphony's sub-clusters (§4.7): the models partitioned by the epoch planner, each part
    /// with its own engine and RankThread (1: one dispatcher for the whole cluster).
    #[arg(long, default_value_t = 1)]
    sub_clusters: usize,
    /// The scheduler: `symphony` (its engine: ModelThreads and a RankThread), or `flex`,
    /// `flex-np`, `clockwork`, `clockwork-real` (a dispatcher thread on the wall clock), or `flex/herd:G:GMAX`
    /// (HERD's groups, at most G of at most GMAX GPUs, a FLEX dispatcher thread each).
    #[arg(long, default_value = "symphony")]
    scheduler: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A dispatcher's scheduler by name.
fn one(name: &str, delay: Delay) -> anyhow::Result<Box<MakeScheduler<'static>>> {
    let name = name.to_string();
    if !["flex", "flex-np", "clockwork", "clockwork-real"].contains(&name.as_str()) {
        bail!("unknown scheduler {name:?}: symphony, flex, flex-np, clockwork, clockwork-real or flex/herd:G:GMAX");
    }
    Ok(Box::new(move |ps: &[Profile], g: usize, _: &[usize]| -> Result<Box<dyn Scheduler>, String> {
        scheduler_by_name(&name, ps, g, delay).ok_or_else(|| format!("unknown scheduler {name:?}"))
    }))
}

fn main() -> anyhow::Result<()> {
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if c.models == 0 || c.gpus == 0 || c.shards == 0 || !positive(c.rate) || !positive(c.seconds) {
        bail!("--models, --gpus, --shards, --rate and --seconds must be positive");
    }
    // The engine's state is per GPU and per model, built up front: 10⁸ models took 10 GB in
    // 30 s before anything was scheduled, 10⁸ GPUs 9.5 s and 2 GB (and a 0.1 s run then
    // scheduled nothing).
    let most = cascade_sched::scenario::MAX_GPUS;
    if c.gpus > most || c.models > most {
        bail!("--gpus and --models are at most {most} each (the simulators' bound)");
    }
    // Both ran one dispatcher while the report said otherwise ("sub_clusters": 0, or 4 beside
    // a flex run that has no sub-clusters).
    if c.sub_clusters == 0 {
        bail!("--sub-clusters must be at least 1 (1: one dispatcher for the whole cluster)");
    }
    // More parts than models left some without a model or a dispatcher, while the report said
    // it ran them all ("sub_clusters": 100 beside 4 dispatchers).
    if c.sub_clusters > c.models {
        bail!("--sub-clusters {} exceeds --models {}: each sub-cluster needs a model", c.sub_clusters, c.models);
    }
    if c.sub_clusters > 1 && c.scheduler != "symphony" {
        bail!(
            "--sub-clusters partitions Symphony's engine, not {:?} (HERD's groups are --scheduler flex/herd:G:GMAX)",
            c.scheduler
        );
    }
    let (name, text) = TABLES[1];
    let rows: Vec<_> = parse_table(name, text)?.into_iter().filter(|r| r.alpha_ms <= 0.5).collect();
    let profiles = (0..c.models)
        .map(|i| {
            let r = &rows[i % rows.len()];
            Profile::new(&format!("{}#{i}", r.model), r.alpha_ms, r.beta_ms, r.slo_ms.unwrap_or(50.0), 128)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = EngineConfig {
        profiles,
        gpus: c.gpus,
        shards: c.shards,
        rate_rps: c.rate,
        duration: Duration::from_secs_f64(c.seconds),
        delay: Delay::default(),
    };
    let rates = vec![c.rate / c.models as f64; c.models];
    // HERD's groups by their simulator name (`symphony/L` is --sub-clusters here).
    let herd = if c.scheduler.starts_with("flex/herd:") {
        split_by_name(&c.scheduler, &cfg.profiles, &rates, c.gpus).map_err(anyhow::Error::msg)?
    } else {
        None
    };
    let r = if let Some((base, (part, gpus))) = herd {
        run_parts(&cfg, &parts(&part, &gpus), &*one(base, cfg.delay)?).map_err(anyhow::Error::msg)?
    } else if c.scheduler != "symphony" {
        run_any(&cfg, &*one(&c.scheduler, cfg.delay)?).map_err(anyhow::Error::msg)?
    } else if c.sub_clusters > 1 {
        let (part, gpus) = symphony_split(&cfg.profiles, &rates, c.gpus, c.sub_clusters).map_err(anyhow::Error::msg)?;
        run_sub_clusters(&cfg, &parts(&part, &gpus)).map_err(anyhow::Error::msg)?
    } else {
        run(&cfg)
    };
    if c.json {
        println!(
            "{}",
            json!({
                "requests": r.requests, "seconds": r.seconds, "requests_per_s": r.requests_per_s, "lost": r.lost,
                "executed": r.executed, "within_slo": r.within_slo, "dropped": r.dropped, "batches": r.batches,
                "grants": r.grants, "models": c.models, "gpus": c.gpus, "offered_rps": c.rate, "shards": c.shards,
                "sub_clusters": c.sub_clusters, "scheduler": c.scheduler,
            })
        );
    } else {
        println!(
            "{} requests offered at {:.0}/s to {} models on {} GPUs: {:.0} executed/s ({} executed, {} within SLO, {} dropped, {} lost) in {:.2} s; {} batches",
            r.requests, c.rate, c.models, c.gpus, r.requests_per_s, r.executed, r.within_slo, r.dropped, r.lost, r.seconds, r.batches
        );
    }
    if r.lost != 0 {
        bail!("{} requests lost", r.lost);
    }
    Ok(())
}
