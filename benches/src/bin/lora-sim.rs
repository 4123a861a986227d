//! `lora-sim`: dLoRA's batching and load balancing (seed `002_…`) on emulated replicas — a test
//! double for GPUs, costs from a profile (`cascade_sched::lora`).
//!
//! `lora-sim --scenario sched/scenarios/lora_1gpu.toml --policy dlora --json`
//!
//! `--policy all` runs the four policies on the same requests; `--skewness`, `--rate`,
//! `--dispatch`, `--route-cost`, `--placement`, `--scale`, `--drift-sigma`, `--drift-phase-s` and
//! `--seed` override the scenario, so that Figures 10,
//! 11 and 14 are sweeps of one file (README).

use std::path::PathBuf;

use anyhow::Context;
use cascade_sched::lora::dispatch::{Dispatch, Placement, RouteCost};
use cascade_sched::lora::sim::{simulate, LoraReport};
use cascade_sched::lora::workload::{Drift, LoraScenario};
use cascade_sched::lora::Policy;
use clap::Parser;

#[derive(Parser)]
#[command(about = "dLoRA: merged/unmerged LoRA batching and co-migration on emulated replicas")]
struct Cli {
    /// The scenario (TOML; README's "dLoRA" section documents it).
    #[arg(long)]
    scenario: PathBuf,
    /// dlora, merged-only, unmerged-only, slora, or all.
    #[arg(long, default_value = "dlora")]
    policy: String,
    /// Override the scenario's dispatch (rr, proactive, dlora).
    #[arg(long)]
    dispatch: Option<Dispatch>,
    /// Override the scenario's skewness.
    #[arg(long)]
    skewness: Option<u32>,
    /// Override the scenario's Zipf exponent of function popularity.
    #[arg(long)]
    zipf: Option<f64>,
    /// Override the scenario's request rate, requests per second.
    #[arg(long)]
    rate: Option<f64>,
    /// Override the length scale (Figure 11(b)'s ratio).
    #[arg(long)]
    scale: Option<f64>,
    /// Override what proactive and dlora routing minimise (pending, ours; artifact, the public
    /// artifact's batch-count cost).
    #[arg(long)]
    route_cost: Option<RouteCost>,
    /// Override where adapters start (burst, the paper's burst-tolerance placement; artifact,
    /// the public artifact's workload-blind start).
    #[arg(long)]
    placement: Option<Placement>,
    /// Redraw adapter popularity every phase with this log-normal σ (the scenario's `[drift]`;
    /// 0 keeps the static law's shares per phase).
    #[arg(long)]
    drift_sigma: Option<f64>,
    /// The drift's phase length, s (20 unless the scenario says; needs a drift).
    #[arg(long)]
    drift_phase_s: Option<f64>,
    /// Override the scenario's seed (the arrivals, lengths and adapters drawn); a run is
    /// deterministic for its seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object per policy.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    let mut s = LoraScenario::load(&c.scenario).map_err(anyhow::Error::msg)?;
    if let Some(d) = c.dispatch {
        s.cluster.dispatch = d;
    }
    if let Some(k) = c.skewness {
        s.skewness = k;
    }
    if let Some(z) = c.zipf {
        s.zipf_s = z;
    }
    if let Some(r) = c.rate {
        s.rate_rps = r;
    }
    if let Some(x) = c.scale {
        s.lengths.scale = x;
    }
    if let Some(r) = c.route_cost {
        s.cluster.route_cost = r;
    }
    if let Some(p) = c.placement {
        s.cluster.placement = p;
    }
    if let Some(k) = c.seed {
        s.seed = k;
    }
    if let Some(sigma) = c.drift_sigma {
        let phase_s = s.drift.as_ref().map_or(Drift::DEFAULT_PHASE_S, |d| d.phase_s);
        s.drift = Some(Drift { phase_s, sigma });
    }
    if let Some(p) = c.drift_phase_s {
        match s.drift.as_mut() {
            Some(d) => d.phase_s = p,
            None => anyhow::bail!("--drift-phase-s needs a drift: give --drift-sigma or a [drift] table"),
        }
    }
    s.validate().map_err(anyhow::Error::msg).context("the scenario with the overrides")?;
    let policies: Vec<Policy> =
        if c.policy == "all" { Policy::ALL.to_vec() } else { vec![c.policy.parse().map_err(anyhow::Error::msg)?] };
    let mut reports: Vec<LoraReport> = Vec::new();
    for p in policies {
        let r = simulate(&s, p).map_err(anyhow::Error::msg)?;
        if c.json {
            println!("{}", serde_json::to_string(&r)?);
        }
        reports.push(r);
    }
    if !c.json {
        println!(
            "{} requests, {} adapters, skewness {} (top adapter {:.0}%{}), {} replica(s), dispatch {} \
             (route cost {}, placement {})",
            reports[0].requests,
            s.adapters,
            s.skewness,
            reports[0].top_adapter_share * 100.0,
            s.drift.as_ref().map_or(String::new(), |d| format!(
                " over the run; popularity redrawn every {} s, sigma {}",
                d.phase_s, d.sigma
            )),
            s.replicas,
            s.cluster.dispatch.name(),
            s.cluster.route_cost.name(),
            s.cluster.placement.name()
        );
        println!(
            "{:<14} {:>10} {:>10} {:>9} {:>9} {:>11} {:>9} {:>8} {:>9} {:>10}",
            "policy",
            "avg s/tok",
            "p90 s/tok",
            "e2e s",
            "queue s",
            "queue s/tok",
            "req/s",
            "switches",
            "migrated",
            "max wait"
        );
        for r in &reports {
            println!(
                "{:<14} {:>10.4} {:>10.4} {:>9.2} {:>9.2} {:>11.4} {:>9.2} {:>8} {:>9} {:>10}",
                r.policy.name(),
                r.avg_latency_s,
                r.p90_latency_s,
                r.avg_e2e_s,
                r.avg_queue_s,
                r.avg_queue_per_token_s,
                r.throughput_rps,
                r.mode_switches,
                r.migrations,
                r.max_wait_iterations
            );
        }
    }
    Ok(())
}
