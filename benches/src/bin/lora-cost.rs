//! `lora-cost`: this machine's costs of dLoRA's two ways to serve LoRA adapters on the real
//! SmolLM2-135M (CPU): one decode iteration of the base model, merged (the adapter folded into
//! the weights), unmerged with one adapter, and unmerged with requests spread over four adapters,
//! at several batch sizes; merge and un-merge times; an adapter's load time from host memory
//! (its safetensors bytes to tensors). The adapters are seeded random tensors (test doubles) of
//! rank `--rank` on every attention projection.
//!
//! `lora-cost --model target/models/smollm2-135m/f32 --json`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use cascade_exec::llama::generate::Generator;
use cascade_exec::llama::{Llama, LoraAdapter, Proj};
use cascade_exec::weights::Weights;
use cascade_exec::{Activation, LayerExec};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Merged vs unmerged LoRA inference costs on the CPU")]
struct Cli {
    /// The model directory.
    #[arg(long, default_value = "target/models/smollm2-135m/f32")]
    model: PathBuf,
    /// Adapter rank.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Batch sizes (decode iterations of this many sequences).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    batches: Vec<usize>,
    /// Iterations timed per point (after two warm-ups); the median is reported.
    #[arg(long, default_value_t = 7)]
    iters: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of one decode iteration of `b` sequences (each with a 32-token prompt cached),
/// sequence `i` served with `adapter(i)`.
fn iteration_ms(m: &Llama, b: usize, iters: usize, adapter: impl Fn(usize) -> u32) -> anyhow::Result<f64> {
    let adapters: Vec<u32> = (0..b).map(&adapter).collect();
    let seqs: Vec<(u64, u32, Vec<u32>)> =
        (0..b).map(|i| (i as u64, 0, (0..32).map(|t| 100 + t + i as u32).collect())).collect();
    m.run(0..m.layers(), Activation::packed(&seqs)?.with_adapters(&adapters)?)?;
    let mut times = Vec::new();
    for k in 0..iters + 2 {
        let step: Vec<(u64, u32, Vec<u32>)> = (0..b).map(|i| (i as u64, 32 + k as u32, vec![200])).collect();
        let act = Activation::packed(&step)?.with_adapters(&adapters)?;
        let t = Instant::now();
        m.run(0..m.layers(), act)?;
        if k >= 2 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    for i in 0..b {
        m.free(i as u64);
    }
    Ok(median(times))
}

fn main() -> anyhow::Result<()> {
    // SAFETY: the first thing main does, before any thread exists.
    unsafe { cascade_exec::threads::settle_compute_threads() };
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    anyhow::ensure!(c.iters > 0, "--iters must be at least 1 (each point reports the median of its iterations)");
    anyhow::ensure!(!c.batches.contains(&0), "--batches are batch sizes: each at least 1");
    let g = Generator::from_dir(&c.model).with_context(|| {
        format!("loading {} (scripts/fetch-smollm2.sh, then cascade model import)", c.model.display())
    })?;
    let cfg = g.model().config().clone();
    let bytes = std::fs::read(c.model.join("model.safetensors"))?;
    let w = Weights::file(g.manifest(), &bytes)?;
    let mut m = Llama::load(cfg.clone(), &w, 0..cfg.stages())?;
    drop(g);
    let adapters: Vec<LoraAdapter> = (1..=4)
        .map(|s| LoraAdapter::seeded(&cfg, c.rank, 2.0 * c.rank as f64, &Proj::ALL, s, 0.05))
        .collect::<Result<_, _>>()?;
    // Load time from host memory: the PEFT file's bytes, already in memory, to tensors.
    let dir = std::env::temp_dir().join(format!("lora-cost-{}", std::process::id()));
    adapters[0].save(&dir)?;
    let file = std::fs::read(dir.join("adapter_model.safetensors"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut load = Vec::new();
    for _ in 0..c.iters {
        let t = Instant::now();
        let tensors = candle_core::safetensors::load_buffer(&file, &candle_core::Device::Cpu)?;
        LoraAdapter::from_tensors(adapters[0].config.clone(), tensors, &cfg)?;
        load.push(t.elapsed().as_secs_f64() * 1e3);
    }
    for (i, a) in adapters.iter().enumerate() {
        m.add_adapter(i as u32 + 1, a.clone())?;
    }
    let mut rows = Vec::new();
    for &b in &c.batches {
        let base = iteration_ms(&m, b, c.iters, |_| 0)?;
        let unmerged = iteration_ms(&m, b, c.iters, |_| 1)?;
        let mixed = iteration_ms(&m, b, c.iters, |i| (i % 4) as u32 + 1)?;
        m.merge(1)?;
        let merged = iteration_ms(&m, b, c.iters, |_| 1)?;
        m.unmerge()?;
        rows.push(serde_json::json!({"batch": b, "base_ms": base, "merged_ms": merged, "unmerged_ms": unmerged, "unmerged_4_adapters_ms": mixed}));
    }
    let (mut merge, mut unmerge) = (Vec::new(), Vec::new());
    for _ in 0..c.iters {
        let t = Instant::now();
        m.merge(2)?;
        merge.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        m.unmerge()?;
        unmerge.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let out = serde_json::json!({
        "model": "SmolLM2-135M-Instruct (f32, CPU)", "rank": c.rank, "adapter_bytes": adapters[0].bytes(),
        "threads": std::thread::available_parallelism().map_or(1, usize::from),
        "iterations": rows, "merge_ms": median(merge), "unmerge_ms": median(unmerge), "load_from_host_ms": median(load),
    });
    if c.json {
        println!("{out}");
    } else {
        println!(
            "rank {}, adapter {:.1} MB; merge {:.1} ms, un-merge {:.1} ms, load from host memory {:.1} ms",
            c.rank,
            adapters[0].bytes() as f64 / 1e6,
            out["merge_ms"].as_f64().unwrap_or(0.0),
            out["unmerge_ms"].as_f64().unwrap_or(0.0),
            out["load_from_host_ms"].as_f64().unwrap_or(0.0)
        );
        println!("| batch | base | merged | unmerged (1 adapter) | unmerged (4 adapters) |");
        println!("| --- | --- | --- | --- | --- |");
        for r in out["iterations"].as_array().into_iter().flatten() {
            println!(
                "| {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
                r["batch"],
                r["base_ms"].as_f64().unwrap_or(0.0),
                r["merged_ms"].as_f64().unwrap_or(0.0),
                r["unmerged_ms"].as_f64().unwrap_or(0.0),
                r["unmerged_4_adapters_ms"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
