//! `incast`: Symphony's incast (§5.5). One receiver READs `objects` objects of `object-bytes`
//! from each of `senders` sender processes concurrently, per round.
//!
//! `incast --senders 8 --objects 8 --object-bytes 153600 --rounds R --json` →
//! `{rounds, p50_us, p99_us, p9999_us, ...}`: percentiles of the round latency (all READs of a
//! round posted at once, the round ends when the last completes), after `--warmup` rounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_transport::{Endpoint, Link, Op};
use serde_json::{json, Value};

use crate::{percentile, BenchCluster};

/// Arguments of the `incast` benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct IncastArgs {
    /// Sender processes.
    #[arg(long, default_value_t = 8)]
    pub senders: usize,
    /// Objects read from each sender per round.
    #[arg(long, default_value_t = 8)]
    pub objects: usize,
    /// Size of one object.
    #[arg(long, default_value_t = 153_600)]
    pub object_bytes: u64,
    /// Measured rounds.
    #[arg(long, default_value_t = 10_000)]
    pub rounds: usize,
    /// Unmeasured rounds first.
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// tcp or shm.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Receiver runtime threads (1 = current-thread runtime, the lowest-jitter choice measured).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The runtime the receiver runs on: `threads` workers (1: a current-thread runtime; 0 is refused).
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        // 0 ran as 1, silently.
        0 => Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "--threads must be at least 1")),
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build(),
    }
}

/// Runs the benchmark; returns its JSON result (and prints it unless `quiet`).
pub async fn run(a: IncastArgs, quiet: bool) -> anyhow::Result<Value> {
    let shm = match a.backend.as_str() {
        "tcp" => false,
        "shm" => true,
        other => bail!("unknown backend {other:?} (tcp or shm)"),
    };
    if a.senders == 0 || a.objects == 0 || a.object_bytes == 0 || a.rounds == 0 {
        bail!("--senders, --objects, --object-bytes and --rounds must be positive");
    }
    let per_sender = a.objects as u64 * a.object_bytes;
    let exe = std::env::current_exe()?;
    let cluster = BenchCluster::start(exe.to_str().context("exe path")?, a.senders + 1, per_sender, shm, &[])?;
    let ep = Endpoint::start(cluster.config(shm)).await?;
    let rep = ep.wait_ready(Duration::from_secs(30)).await?;
    let dst = ep.register_new(per_sender * a.senders as u64)?;
    let links: Vec<Arc<dyn Link>> = (1..=a.senders as u32).map(|p| ep.link(p)).collect::<Result<_, _>>()?;
    let mut lat_us = Vec::with_capacity(a.rounds);
    let total = a.warmup + a.rounds;
    for round in 0..total {
        let t = Instant::now();
        let mut handles = Vec::with_capacity(a.senders * a.objects);
        for (s, link) in links.iter().enumerate() {
            let ops = (0..a.objects as u64)
                .map(|o| {
                    let local = s as u64 * per_sender + o * a.object_bytes;
                    Op::read(&dst, local, cluster.regions[s], o * a.object_bytes, a.object_bytes)
                })
                .collect();
            handles.extend(link.post(ops));
        }
        for h in handles {
            h.wait("read", Duration::from_secs(30)).await?;
        }
        if round >= a.warmup {
            lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    // Spot-check the bytes of the last round against the peers' fill pattern.
    // SAFETY: every READ of the last round completed above; nothing writes `dst` now.
    let probe = unsafe { dst.view(0, 1)? }[0];
    let expect = 1u8; // peer 1 fills page 0 with 0 + (1 % 4)
    if probe != expect {
        bail!("data check failed: first byte {probe}, expected {expect}");
    }
    // The slowest rounds, with their position in the run (to tell warm-up effects from noise).
    let mut slowest: Vec<(usize, f64)> = lat_us.iter().copied().enumerate().collect();
    slowest.sort_by(|a, b| b.1.total_cmp(&a.1));
    slowest.truncate(5);
    let mean = lat_us.iter().sum::<f64>() / lat_us.len() as f64;
    lat_us.sort_by(f64::total_cmp);
    let (p50, p99, p9999) = (percentile(&lat_us, 50.0), percentile(&lat_us, 99.0), percentile(&lat_us, 99.99));
    let bytes_round = per_sender * a.senders as u64;
    let out = json!({
        "backend": a.backend, "senders": a.senders, "objects": a.objects, "object_bytes": a.object_bytes,
        "rounds": a.rounds, "p50_us": p50, "p99_us": p99, "p9999_us": p9999,
        "mean_us": mean, "max_us": lat_us.last().copied().unwrap_or(f64::NAN),
        "p9999_over_p50": p9999 / p50, "gbit_per_s": bytes_round as f64 * 8.0 / (mean / 1e6) / 1e9,
        "mesh_setup_ms": rep.setup.as_secs_f64() * 1e3,
        "slowest_rounds": slowest.iter().map(|(i, us)| json!({"round": i, "us": us})).collect::<Vec<_>>(),
    });
    if quiet {
    } else if a.json {
        println!("{out}");
    } else {
        println!(
            "incast {}x{}x{} B over {}: p50 {:.0} µs, p99 {:.0} µs, p99.99 {:.0} µs ({:.2}x p50)",
            a.senders,
            a.objects,
            a.object_bytes,
            a.backend,
            p50,
            p99,
            p9999,
            p9999 / p50
        );
    }
    Ok(out)
}
