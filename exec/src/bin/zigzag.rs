//! `zigzag`: the cooperative-execution schedule while a new instance loads (BlitzScale §5.2).
//!
//! `zigzag --layers 7 --load-ratio 6 --batches 6 --policy zigzag --json`
//! → `{policy, layers, batches, load_ratio, x, latencies, sum, max, solve_ms}`.

use std::io::Write;
use std::time::Instant;

use cascade_exec::zigzag::{plan, Instance, Policy};
use clap::Parser;

/// Plan each queued batch's split between the loading instance and the old one.
#[derive(Parser)]
#[command(about = "Zigzag (or best-effort) split of queued batches while a model loads layer by layer")]
struct Cli {
    /// Layers of the model.
    #[arg(long)]
    layers: u32,
    /// One layer's load time over one layer's execution time (integer, ≥ 1).
    #[arg(long)]
    load_ratio: u32,
    /// Batches queued when the first layer is resident.
    #[arg(long)]
    batches: Option<usize>,
    /// zigzag (the exact optimum) or best-effort (the paper's baseline).
    #[arg(long, default_value = "zigzag")]
    policy: Policy,
    /// Weights of the batches (e.g. prefill tokens), comma-separated; sets the batch count.
    #[arg(long, value_delimiter = ',')]
    weights: Option<Vec<f64>>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() {
    let c = Cli::parse();
    let weights = match (c.weights, c.batches) {
        (Some(w), Some(n)) if w.len() != n => {
            eprintln!("zigzag: {} weights for {n} batches", w.len());
            std::process::exit(2);
        }
        (Some(w), _) => w,
        (None, Some(n)) => vec![1.0; n],
        (None, None) => {
            eprintln!("zigzag: give --batches N or --weights w1,w2,...");
            std::process::exit(2);
        }
    };
    let inst = Instance { layers: c.layers, load_ratio: c.load_ratio, weights };
    let t = Instant::now();
    let s = match plan(&inst, c.policy) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("zigzag: {e}");
            std::process::exit(2);
        }
    };
    let solve_ms = t.elapsed().as_secs_f64() * 1e3;
    let out = if c.json {
        let v = serde_json::json!({
            "policy": c.policy.to_string(), "layers": c.layers, "batches": inst.batches(),
            "load_ratio": c.load_ratio, "x": s.x, "latencies": s.latencies, "sum": s.sum(), "max": s.max(),
            "weighted_sum": s.weighted(&inst.weights), "solve_ms": solve_ms,
        });
        format!("{v}\n")
    } else {
        format!(
            "{} for L = {}, T = {}, {} batches (solved in {solve_ms:.2} ms)\n  x (layers on the new instance): {:?}\n  \
             latencies: {:?}  (sum {}, max {})\n",
            c.policy,
            c.layers,
            c.load_ratio,
            inst.batches(),
            s.x,
            s.latencies,
            s.sum(),
            s.max()
        )
    };
    // A reader that went away (`| head`) ends the tool quietly, as Unix tools end; any other
    // failure to write (a full disk) is said in one line, not as a panic.
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("zigzag: writing the output: {e}");
            std::process::exit(1);
        }
    }
}
