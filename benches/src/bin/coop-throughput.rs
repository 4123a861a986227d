//! `coop-throughput`: BlitzScale Figure 7(d) — the throughput of cooperative execution while a
//! new instance holds `k` of a model's `L` layers, against one instance alone. Each batch runs
//! `min(k, L/2)` layers on the new instance and the rest on the old one, the two on threads of
//! their own; the model predicts `L / (L − min(k, L/2))` times one instance.
//!
//! `coop-throughput --executor bert --model target/models/all-minilm-l6-v2 --batches 24`
//! (real MiniLM layers on the CPU: each instance computes single-threaded, standing for one GPU)
//! or `--executor emulated` (the test double: 8 layers of 5 ms).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use cascade_exec::coop::{run_cooperative, Residency};
use cascade_exec::embed::Embedder;
use cascade_exec::emulated::Emulated;
use cascade_exec::{Activation, LayerExec};
use clap::Parser;

/// Cooperative throughput with k of L layers resident.
#[derive(Parser)]
#[command(about = "Cooperative execution's throughput vs resident layers (BlitzScale Fig. 7(d))")]
struct Cli {
    /// bert (real MiniLM layers on the CPU) or emulated (test double).
    #[arg(long, default_value = "bert")]
    executor: String,
    /// The model directory (bert).
    #[arg(long, default_value = "target/models/all-minilm-l6-v2")]
    model: PathBuf,
    /// Batches queued.
    #[arg(long, default_value_t = 24)]
    batches: usize,
    /// Sentences per batch (bert).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    // One core per instance: candle's matrix products would otherwise spread over every core.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: set before any thread exists (the first thing main does).
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    // No batch measures nothing: a ratio of zero times would read as a result.
    anyhow::ensure!(c.batches > 0 && c.batch_size > 0, "--batches and --batch-size must be at least 1");
    let (embedder, emulated);
    let (exec, first): (&dyn LayerExec, Activation) = match c.executor.as_str() {
        "bert" => {
            embedder = Embedder::from_dir(&c.model).with_context(|| format!("loading {}", c.model.display()))?;
            let texts: Vec<String> = (0..c.batch_size)
                .map(|i| {
                    format!("Sentence {i}: a serving cluster scales a model to new instances while its layers arrive.")
                })
                .collect();
            let t: Vec<&str> = texts.iter().map(String::as_str).collect();
            (embedder.model(), embedder.batch(&t)?)
        }
        "emulated" => {
            emulated = Emulated::uniform(8, Duration::from_millis(5));
            (&emulated, Activation::new(vec![vec![1]], vec![vec![1]])?)
        }
        other => anyhow::bail!("unknown executor {other:?} (bert or emulated)"),
    };
    let batch = || -> anyhow::Result<Activation> { Ok(first.clone()) };
    let l = exec.layers();
    let n = c.batches;
    // Warm-up (allocator, caches); then for each k, one instance alone (every layer of every
    // batch on one thread) and the cooperative run, alternately, so that drift in the machine's
    // speed falls on both.
    exec.run(0..l, batch()?)?;
    let mut rows = Vec::new();
    let mut singles = Vec::new();
    for k in 0..=l {
        let t = Instant::now();
        for _ in 0..n {
            exec.run(0..l, batch()?)?;
        }
        let single = t.elapsed().as_secs_f64();
        singles.push(single);
        let split = k.min(l / 2) as u32;
        let batches = (0..n).map(|_| batch()).collect::<anyhow::Result<Vec<_>>>()?;
        let t = Instant::now();
        run_cooperative(exec, exec, batches, &vec![split; n], Residency::First(k))?;
        let took = t.elapsed().as_secs_f64();
        let (got, model) = (single / took, l as f64 / (l - split as usize) as f64);
        rows.push(serde_json::json!({"resident": k, "layers": l, "speedup": got, "model": model, "seconds": took, "single_seconds": single}));
        if !c.json {
            println!("k = {k} of {l} resident: {got:.2}x one instance (model {model:.2}x)");
        }
    }
    let single = singles.iter().sum::<f64>() / singles.len() as f64;
    if c.json {
        println!(
            "{}",
            serde_json::json!({"executor": c.executor, "batches": n, "single_seconds": single, "rows": rows})
        );
    } else {
        println!("(one instance alone: {n} batches in {single:.2} s on average)");
    }
    Ok(())
}
