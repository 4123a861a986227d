//! LoRA adapters on the real SmolLM2-135M (dLoRA's merged and unmerged inference). The adapters
//! are seeded random tensors — test doubles, named as such. Skips, saying so, without the model.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::Tensor;
use cascade_exec::llama::generate::Generator;
use cascade_exec::llama::{Llama, LlamaConfig, LoraAdapter, Proj};
use cascade_exec::weights::Weights;
use cascade_exec::{Activation, LayerExec};
use common::{llm_reference, smollm2_dir};

fn model() -> Option<(Llama, LlamaConfig)> {
    let dir = smollm2_dir()?;
    let g = Generator::from_dir(&dir).unwrap();
    let cfg = g.model().config().clone();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let w = Weights::file(g.manifest(), &bytes).unwrap();
    Some((Llama::load(cfg.clone(), &w, 0..cfg.stages()).unwrap(), cfg))
}

fn adapter(cfg: &LlamaConfig, seed: u64) -> LoraAdapter {
    LoraAdapter::seeded(cfg, 8, 16.0, &Proj::ALL, seed, 0.05).unwrap()
}

/// The model serving test adapters `1..=n` (adapter `k` seeded with `k`).
fn model_with_adapters(n: u32) -> Option<(Llama, LlamaConfig)> {
    let (mut m, cfg) = model()?;
    for k in 1..=n {
        m.add_adapter(k, adapter(&cfg, k as u64)).unwrap();
    }
    Some((m, cfg))
}

/// Logits of the next token after `prompt`, each sequence with its adapter, in one batch.
fn logits(m: &Llama, prompts: &[(u64, Vec<u32>, u32)]) -> Vec<Vec<f32>> {
    let seqs: Vec<(u64, u32, Vec<u32>)> = prompts.iter().map(|(s, p, _)| (*s, 0, p.clone())).collect();
    let adapters: Vec<u32> = prompts.iter().map(|p| p.2).collect();
    let act = Activation::packed(&seqs).unwrap().with_adapters(&adapters).unwrap();
    let out = m.run(0..m.layers(), act).unwrap().hidden.unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
    for (s, _, _) in prompts {
        m.free(*s);
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

#[test]
fn merge_then_unmerge_restores_the_weights_and_merged_equals_unmerged() {
    let Some((mut m, cfg)) = model() else { return };
    let prompts: Vec<Vec<u32>> = llm_reference().into_iter().take(2).map(|r| r.prompt_tokens).collect();
    let base: Vec<Vec<f32>> = prompts.iter().map(|p| logits(&m, &[(1, p.clone(), 0)]).remove(0)).collect();
    m.add_adapter(1, adapter(&cfg, 1)).unwrap();
    let w0 = m.projection(7, Proj::Q).unwrap().unwrap();
    let unmerged: Vec<Vec<f32>> = prompts.iter().map(|p| logits(&m, &[(1, p.clone(), 1)]).remove(0)).collect();
    // The test adapter really changes the model.
    let changed = base.iter().zip(&unmerged).map(|(a, b)| max_diff(a, b)).fold(0.0, f32::max);
    assert!(changed > 0.5, "the adapter changes the logits by {changed} only");
    m.merge(1).unwrap();
    assert_eq!(m.merged(), Some(1));
    let w1 = m.projection(7, Proj::Q).unwrap().unwrap();
    assert!(max_diff(&flat(&w0), &flat(&w1)) > 1e-3, "merging changes W");
    for (p, u) in prompts.iter().zip(&unmerged) {
        let merged = logits(&m, &[(1, p.clone(), 1)]).remove(0);
        assert!(max_diff(&merged, u) < 2e-3, "merged vs unmerged: {}", max_diff(&merged, u));
        assert_eq!(argmax(&merged), argmax(u));
    }
    // A merged batch serves its adapter only.
    let refused = Activation::packed(&[(5, 0, prompts[0].clone())]).unwrap().with_adapters(&[0]).unwrap();
    assert!(m.run(0..m.layers(), refused).unwrap_err().to_string().contains("merged"));
    assert!(m.merge(1).is_err() && m.remove_adapter(1).is_err());
    assert_eq!(m.unmerge().unwrap(), Some(1));
    assert_eq!(m.unmerge().unwrap(), None);
    // W is restored up to f32 rounding: |W + Δ − Δ − W| ≤ a few ulps of the larger of |W|, |Δ|.
    let (a, b) = (flat(&w0), flat(&m.projection(7, Proj::Q).unwrap().unwrap()));
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / x.abs().max(0.05)).fold(0.0, f32::max);
    assert!(worst < 1e-5, "un-merge left a relative error of {worst}");
    for (p, b0) in prompts.iter().zip(&base) {
        assert!(max_diff(&logits(&m, &[(1, p.clone(), 0)]).remove(0), b0) < 1e-3);
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn an_unmerged_batch_mixing_adapters_equals_each_request_alone() {
    let Some((m, _)) = model_with_adapters(3) else { return };
    let prompts: Vec<Vec<u32>> = llm_reference().into_iter().map(|r| r.prompt_tokens).collect();
    let batch: Vec<(u64, Vec<u32>, u32)> =
        prompts.iter().enumerate().map(|(i, p)| (i as u64 + 10, p.clone(), i as u32)).collect();
    let together = logits(&m, &batch);
    for (b, t) in batch.iter().zip(&together) {
        let alone = logits(&m, std::slice::from_ref(b)).remove(0);
        assert!(max_diff(&alone, t) < 1e-3, "adapter {}: {}", b.2, max_diff(&alone, t));
    }
    // Different adapters answer differently.
    let p = &prompts[3];
    let per: Vec<Vec<f32>> = (0..=3).map(|a| logits(&m, &[(1, p.clone(), a)]).remove(0)).collect();
    for i in 0..4 {
        for j in i + 1..4 {
            assert!(max_diff(&per[i], &per[j]) > 0.1, "adapters {i} and {j} agree");
        }
    }
    // An adapter not served here is refused.
    let act = Activation::packed(&[(9, 0, vec![1, 2])]).unwrap().with_adapters(&[7]).unwrap();
    assert!(m.run(0..m.layers(), act).unwrap_err().to_string().contains("no adapter 7"));
}

#[test]
fn peft_files_round_trip_and_a_block_loaded_after_a_merge_gets_it() {
    let Some(dir) = smollm2_dir() else { return };
    let g = Generator::from_dir(&dir).unwrap();
    let cfg = g.model().config().clone();
    let a = LoraAdapter::seeded(&cfg, 16, 32.0, &[Proj::Q, Proj::V], 9, 0.05).unwrap();
    let out = std::env::temp_dir().join(format!("cascade-lora-{}", std::process::id()));
    a.save(&out).unwrap();
    let b = LoraAdapter::load(&out, &cfg).unwrap();
    assert_eq!(b.config, a.config);
    assert_eq!(b.weights.len(), 2 * cfg.num_hidden_layers);
    for (k, (x, y)) in &a.weights {
        let (x2, y2) = &b.weights[k];
        assert_eq!((flat(x), flat(y)), (flat(x2), flat(y2)));
    }
    // An adapter for another model's shapes is refused.
    let mut small = cfg.clone();
    small.hidden_size = 64;
    small.num_attention_heads = 1;
    small.num_key_value_heads = 1;
    assert!(LoraAdapter::load(&out, &small).is_err());
    std::fs::remove_dir_all(&out).unwrap();

    // Stages arriving after a merge are merged as they load.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let w = Weights::file(g.manifest(), &bytes).unwrap();
    let mut early = Llama::load(cfg.clone(), &w, 0..10).unwrap();
    early.add_adapter(4, a.clone()).unwrap();
    early.merge(4).unwrap();
    for s in 10..cfg.stages() {
        early.load_stage(s, &w).unwrap();
    }
    let mut full = Llama::load(cfg.clone(), &w, 0..cfg.stages()).unwrap();
    full.add_adapter(4, a).unwrap();
    full.merge(4).unwrap();
    for block in [3, 20] {
        assert_eq!(
            flat(&early.projection(block, Proj::V).unwrap().unwrap()),
            flat(&full.projection(block, Proj::V).unwrap().unwrap())
        );
    }
}

/// dLoRA's batcher driving the real model: a skewed stream over four adapters switches between
/// merged and unmerged iterations, and every response equals the same request served alone
/// (unmerged) — or differs only after a near-tie, which merged arithmetic may break differently.
#[test]
fn dlora_batching_on_the_real_model_switches_modes_and_answers_as_alone() {
    use cascade_exec::llama::multi_lora::{first_difference, serve, serve_alone, LoraJob, LoraMeters};
    use cascade_sched::lora::{BatchConfig, Batcher, CostModel, Policy};
    let Some((mut m, _)) = model_with_adapters(4) else { return };
    let prompts: Vec<Vec<u32>> = llm_reference().into_iter().map(|r| r.prompt_tokens).collect();
    // Adapter 0 dominates; the others arrive among its requests.
    let adapters = [0, 0, 1, 0, 0, 2, 0, 3, 0, 0];
    let jobs: Vec<LoraJob> = adapters
        .iter()
        .enumerate()
        .map(|(i, &a)| LoraJob {
            arrival: i as u64 / 2,
            adapter: a,
            prompt: prompts[i % prompts.len()].clone(),
            max_tokens: 5,
        })
        .collect();
    let bc = BatchConfig { max_batch: 6, alpha0: 0.6, break_iters: 4, ..BatchConfig::default() };
    let mut b = Batcher::new(Policy::Dlora, bc, CostModel::cpu_smollm2());
    let registry = cascade_transport::Metrics::new();
    let meters = LoraMeters::new(&registry);
    let (served, stats) = serve(&mut m, &mut b, &jobs, 500, Some(&meters)).unwrap();
    assert!(stats.merged_iterations > 0 && stats.mode_switches >= 2, "{stats:?}");
    // The metrics say what the run's statistics say.
    let text = registry.render();
    let unmerged = stats.iterations - stats.merged_iterations;
    for line in [
        format!("cascade_lora_mode_switches_total{{}} {}", stats.mode_switches),
        format!("cascade_lora_iterations_total{{mode=\"merged\"}} {}", stats.merged_iterations),
        format!("cascade_lora_iterations_total{{mode=\"unmerged\"}} {unmerged}"),
        format!("cascade_lora_switch_seconds_count{{}} {}", stats.mode_switches),
        format!("cascade_lora_finished_requests_total{{}} {}", jobs.len()),
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    let (alpha, beta) = b.thresholds();
    assert!(text.contains(&format!("cascade_lora_threshold{{which=\"alpha\"}} {alpha}")), "{text}");
    assert!(text.contains(&format!("cascade_lora_threshold{{which=\"beta\"}} {beta}")), "{text}");
    assert!(stats.max_adapters_in_batch >= 2, "no unmerged batch mixed adapters: {stats:?}");
    assert_eq!(m.merged(), None, "left merged");
    for (i, (job, s)) in jobs.iter().zip(&served).enumerate() {
        assert_eq!(s.tokens.len(), 5);
        let alone = serve_alone(&mut m, job, 900 + i as u64).unwrap();
        if let Some((step, margin)) = first_difference(s, &alone) {
            assert!(
                margin < 0.01,
                "request {i} differs at step {step} with margin {margin}: {:?} vs {:?}",
                s.tokens,
                alone.tokens
            );
        }
    }
    assert_eq!(m.cache().sequences(), 0, "KV cache not freed");
}

/// A request whose prompt and tokens fill the model's context window ends there with its tokens
/// while the request batched with it goes on, and a prompt longer than the window is refused.
/// The real SmolLM2 weights under a window of 24 positions (its RoPE tables come from the
/// configuration), so the window fills in a few steps; before 2026-12-04 the step past it failed
/// the whole run.
#[test]
fn lora_serving_ends_a_request_at_the_context_window_and_refuses_a_longer_prompt() {
    use cascade_exec::llama::multi_lora::{serve, serve_alone, LoraJob};
    use cascade_sched::lora::{BatchConfig, Batcher, CostModel, Policy};
    let Some(dir) = smollm2_dir() else { return };
    let Some((mut full, cfg)) = model_with_adapters(1) else { return };
    let window = 24;
    let small = LlamaConfig { max_position_embeddings: window, ..cfg.clone() };
    let g = Generator::from_dir(&dir).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mut m = Llama::load(small.clone(), &Weights::file(g.manifest(), &bytes).unwrap(), 0..small.stages()).unwrap();
    m.add_adapter(1, adapter(&cfg, 1)).unwrap();
    let prompt = llm_reference().into_iter().map(|r| r.prompt_tokens).min_by_key(Vec::len).unwrap();
    assert!(prompt.len() + 4 < window, "{} prompt tokens", prompt.len());
    let job = |prompt: Vec<u32>, max_tokens| LoraJob { arrival: 0, adapter: 0, prompt, max_tokens };
    let jobs = [job(prompt.clone(), 100), job(prompt[..3].to_vec(), 4)];
    let batcher = || Batcher::new(Policy::UnmergedOnly, BatchConfig::default(), CostModel::cpu_smollm2());
    let (served, _) = serve(&mut m, &mut batcher(), &jobs, 1, None).unwrap();
    // Positions prompt..window take window − prompt fed tokens: one more is generated.
    assert_eq!(served[0].tokens.len(), window - prompt.len() + 1);
    assert_eq!(served[1].tokens.len(), 4);
    // Up to the window, the tokens the model with its whole window gives.
    let whole = serve_alone(&mut full, &job(prompt.clone(), served[0].tokens.len()), 50).unwrap();
    assert_eq!(served[0].tokens, whole.tokens);
    assert_eq!(m.cache().sequences(), 0, "KV cache not freed");
    let long = serve(&mut m, &mut batcher(), &[job(vec![1; window + 1], 2)], 60, None).unwrap_err();
    assert!(long.to_string().contains("context window is 24"), "{long}");
}

/// A stream `serve` could not finish is refused whole before anything runs, naming the request:
/// before 2026-12-04 each request was checked only when it arrived (and an unknown adapter only
/// when its batch ran), so a bad request late in a stream failed the run after every earlier
/// answer had been computed — and lost.
#[test]
fn a_lora_stream_with_a_bad_request_is_refused_before_anything_runs() {
    use cascade_exec::llama::multi_lora::{serve, LoraJob, LoraMeters};
    use cascade_sched::lora::{BatchConfig, Batcher, CostModel, Policy};
    let Some((mut m, cfg)) = model_with_adapters(2) else { return };
    let good = |arrival| LoraJob { arrival, adapter: 1, prompt: vec![100, 200, 300], max_tokens: 3 };
    let vocab = cfg.vocab_size as u32;
    let cases = [
        (LoraJob { adapter: 2, ..good(5) }, "request 1: adapter 2 is not served (the model serves adapters [0, 1])"),
        (LoraJob { adapter: u32::MAX, ..good(5) }, "adapter 4294967295 is not served"),
        (LoraJob { prompt: vec![1, vocab], ..good(5) }, &*format!("token {vocab} is outside the vocabulary")),
        (LoraJob { prompt: vec![], ..good(5) }, "request 1: an empty prompt: no token to continue from"),
        (LoraJob { max_tokens: 0, ..good(5) }, "request 1: no token to generate (max_tokens 0)"),
        (LoraJob { prompt: vec![1; cfg.max_position_embeddings + 1], ..good(5) }, "the model's context window is"),
        (good(0), "request 1: arrives at iteration 0 after a request arriving at 3"),
    ];
    for (bad, says) in cases {
        let registry = cascade_transport::Metrics::new();
        let meters = LoraMeters::new(&registry);
        let mut b = Batcher::new(Policy::Dlora, BatchConfig::default(), CostModel::cpu_smollm2());
        let e = serve(&mut m, &mut b, &[good(3), bad], 1, Some(&meters)).unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
        let text = registry.render();
        assert!(
            text.lines().filter(|l| l.starts_with("cascade_lora_iterations_total")).all(|l| l.ends_with(" 0")),
            "an iteration ran before the refusal:\n{text}"
        );
        assert_eq!(m.cache().sequences(), 0);
    }
}

/// A stream with long gaps between arrivals is served in the time its work takes: idle
/// iterations are skipped to the next arrival. Before 2026-12-04 the loop stepped through every
/// idle iteration (`lora-serve --per-iteration 1e-300` never ended), and an arrival at the last
/// iteration overflowed the counter.
#[test]
fn a_stream_with_long_gaps_is_served_without_stepping_through_them() {
    use cascade_exec::llama::multi_lora::{serve, LoraJob};
    use cascade_sched::lora::{BatchConfig, Batcher, CostModel, Policy};
    let Some((mut m, _)) = model_with_adapters(1) else { return };
    let job = |arrival| LoraJob { arrival, adapter: 0, prompt: vec![100, 200, 300], max_tokens: 2 };
    let jobs = [job(0), job(1 << 40), job(u64::MAX)];
    let mut b = Batcher::new(Policy::Dlora, BatchConfig::default(), CostModel::cpu_smollm2());
    let t = std::time::Instant::now();
    let (served, stats) = serve(&mut m, &mut b, &jobs, 1, None).unwrap();
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(served.iter().all(|s| s.tokens.len() == 2), "{served:?}");
    assert_eq!(stats.iterations, 6, "two iterations a request, none idle");
    assert!(served[1].finished > 1 << 40 && served[2].finished == u64::MAX, "{served:?}");
}

/// An adapter is an ordinary model to the parameter pool: its PEFT file has a manifest with the
/// model's 30 blocks, packs layer-major like any model (what the loader and the multicast move),
/// and the adapter read back from the packed image is the one written.
#[test]
fn an_adapter_is_an_ordinary_pool_model() {
    use cascade_param_pool::manifest::Manifest;
    let Some((_, cfg)) = model() else { return };
    let a = adapter(&cfg, 11);
    let dir = std::env::temp_dir().join(format!("cascade-lora-pool-{}", std::process::id()));
    a.save(&dir).unwrap();
    let file = dir.join("adapter_model.safetensors");
    let m = Manifest::from_file(&file, "adapter-11", cascade_param_pool::DEFAULT_CHUNK).unwrap();
    assert_eq!(m.blocks(), cfg.num_hidden_layers, "an adapter's layers are the model's blocks");
    assert_eq!(m.bytes as usize, a.bytes());
    let bytes = std::fs::read(&file).unwrap();
    let mut image = vec![0u8; m.bytes as usize];
    m.pack(&bytes, &mut image);
    let back = LoraAdapter::from_pool(a.config().clone(), &m, &Weights::packed(&m, &image).unwrap(), &cfg).unwrap();
    for (block, p) in [(0, Proj::Q), (17, Proj::V), (29, Proj::O)] {
        let (x, y) = (a.delta(block, p).unwrap().unwrap(), back.delta(block, p).unwrap().unwrap());
        assert_eq!(flat(&x), flat(&y), "block {block} {p:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A small llama configuration (no weights needed: adapters only take their shapes from it).
fn small_config() -> LlamaConfig {
    LlamaConfig {
        model_type: "llama".into(),
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 1e4,
        vocab_size: 100,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
        bos_token_id: 1,
        eos_token_id: 2,
    }
}

/// An adapter whose scale α/r is no number — rank 0, a non-finite α — or that targets nothing is
/// refused, the seeded test double like a PEFT file (a rank-0 double once served every token as
/// token 0: its delta was NaN).
#[test]
fn an_adapter_of_rank_zero_or_no_finite_alpha_is_refused() {
    let cfg = small_config();
    for (r, alpha, targets) in [(0, 16.0, &Proj::ALL[..]), (8, f64::NAN, &Proj::ALL[..]), (8, 16.0, &[][..])] {
        let e = LoraAdapter::seeded(&cfg, r, alpha, targets, 1, 0.05).unwrap_err();
        assert!(e.to_string().contains("rank") || e.to_string().contains("at least one projection"), "{e}");
    }
    // A PEFT configuration of rank 0 likewise, whatever its tensors.
    let ok = LoraAdapter::seeded(&cfg, 4, 8.0, &[Proj::Q], 1, 0.05).unwrap();
    let config = cascade_exec::llama::lora::LoraConfig { r: 0, ..ok.config().clone() };
    let e = LoraAdapter::from_tensors(config, Default::default(), &cfg).unwrap_err();
    assert!(e.to_string().contains("rank 0"), "{e}");
}

/// A seeded adapter's rank is at most each target's min(out, in) — LoRA's bound — and is refused
/// above it before its tensors are allocated (`lora-cost --rank 100000` was killed for memory
/// building 46 GB of test double).
#[test]
fn a_seeded_adapter_above_its_targets_rank_is_refused() {
    let cfg = small_config();
    let (out, inn) = Proj::K.shape(&cfg);
    let most = out.min(inn);
    assert!(most < Proj::Q.shape(&cfg).0, "K is the narrow projection of this config");
    LoraAdapter::seeded(&cfg, most, 8.0, &[Proj::K], 1, 0.05).unwrap();
    LoraAdapter::seeded(&cfg, most + 1, 8.0, &[Proj::Q], 1, 0.05).unwrap();
    let e = LoraAdapter::seeded(&cfg, most + 1, 8.0, &Proj::ALL, 1, 0.05).unwrap_err();
    assert!(e.to_string().contains(&format!("rank {} exceeds k_proj's min(out, in) = {most}", most + 1)), "{e}");
    let e = LoraAdapter::seeded(&cfg, usize::MAX / 8, 8.0, &[Proj::Q], 1, 0.05).unwrap_err();
    assert!(e.to_string().contains("exceeds q_proj"), "{e}");
    // Its size is known before it is built.
    for (r, targets) in [(4, &Proj::ALL[..]), (most, &[Proj::K, Proj::O][..])] {
        let a = LoraAdapter::seeded(&cfg, r, 8.0, targets, 1, 0.05).unwrap();
        assert_eq!(LoraAdapter::seeded_bytes(&cfg, r, targets), a.bytes() as u64);
    }
}

#[test]
fn an_adapter_image_round_trips_exactly_and_a_damaged_one_is_refused() {
    let cfg = small_config();
    let a = LoraAdapter::seeded(&cfg, 4, 8.0, &[Proj::Q, Proj::V], 9, 0.05).unwrap();
    let image = a.to_image().unwrap();
    let b = LoraAdapter::from_image(&image, &cfg).unwrap();
    assert_eq!(a.config, b.config);
    assert_eq!(a.weights.keys().collect::<Vec<_>>(), b.weights.keys().collect::<Vec<_>>());
    for (k, (xa, xb)) in &a.weights {
        let (ya, yb) = &b.weights[k];
        assert_eq!(xa.to_vec2::<f32>().unwrap(), ya.to_vec2::<f32>().unwrap());
        assert_eq!(xb.to_vec2::<f32>().unwrap(), yb.to_vec2::<f32>().unwrap());
    }
    assert!(LoraAdapter::from_image(&image[..image.len() - 4], &cfg).is_err(), "truncated");
    let mut longer = image.clone();
    longer.push(0);
    assert!(LoraAdapter::from_image(&longer, &cfg).unwrap_err().to_string().contains("after the tensors"));
    assert!(LoraAdapter::from_image(&image[1..], &cfg).unwrap_err().to_string().contains("magic"));
    let other = LlamaConfig { hidden_size: 32, ..cfg };
    assert!(LoraAdapter::from_image(&image, &other).is_err(), "shapes checked against the model");
}

/// A PEFT adapter with parts that are not applied here — PEFT options (DoRA, transposed weights,
/// per-module ranks, trained biases, fully trained modules) or tensors beyond LoRA's A and B on
/// the attention projections (here a pair on the MLP's gate_proj), or a lora_B without its A — is
/// refused, naming the part; before 2026-12-05 those were skipped and the adapter served without
/// them. Rank-stabilised LoRA is applied (`α / √r`), and `target_modules` may be one pattern.
#[test]
fn a_peft_adapter_with_parts_not_applied_is_refused_and_rslora_is_scaled() {
    use serde_json::json;
    let cfg = small_config();
    let a = LoraAdapter::seeded(&cfg, 4, 8.0, &[Proj::Q, Proj::V], 3, 0.05).unwrap();
    let dir = std::env::temp_dir().join(format!("cascade-peft-{}", std::process::id()));
    a.save(&dir).unwrap();
    let config_path = dir.join("adapter_config.json");
    let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let with = |changes: &[(&str, serde_json::Value)]| {
        let mut c = base.clone();
        for (k, v) in changes {
            c[*k] = v.clone();
        }
        std::fs::write(&config_path, c.to_string()).unwrap();
        LoraAdapter::load(&dir, &cfg)
    };
    for (key, value) in [
        ("use_dora", json!(true)),
        ("fan_in_fan_out", json!(true)),
        ("rank_pattern", json!({"q_proj": 8})),
        ("alpha_pattern", json!({"v_proj": 32})),
        ("bias", json!("lora_only")),
        ("modules_to_save", json!(["lm_head"])),
    ] {
        let e = with(&[(key, value)]).unwrap_err().to_string();
        assert!(e.contains(&format!("sets {key} = ")) && e.contains("not applied here"), "{e}");
    }
    let e = with(&[("peft_type", json!("IA3"))]).unwrap_err().to_string();
    assert!(e.contains("not LORA"), "{e}");
    // The same options at their neutral values, as PEFT writes them, and a pattern as the targets.
    let neutral = [
        ("use_dora", json!(false)),
        ("bias", json!("none")),
        ("rank_pattern", json!({})),
        ("modules_to_save", serde_json::Value::Null),
        ("target_modules", json!("q_proj|v_proj")),
    ];
    let b = with(&neutral).unwrap();
    assert_eq!(b.config().target_modules, ["q_proj|v_proj"]);
    assert_eq!((a.scale(), b.scale()), (2.0, 2.0));
    let rs = with(&[("use_rslora", json!(true))]).unwrap();
    assert_eq!(rs.scale(), 4.0, "α / √r = 8 / 2");
    let (d, d_rs) = (a.delta(0, Proj::Q).unwrap().unwrap(), rs.delta(0, Proj::Q).unwrap().unwrap());
    assert!(max_diff(&flat(&(d * 2.0).unwrap()), &flat(&d_rs)) < 1e-6);

    // Tensors: an MLP pair beside the attention ones, then a lora_B whose A is missing.
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu).unwrap();
    let mut more = tensors.clone();
    let (f, h) = (cfg.intermediate_size, cfg.hidden_size);
    let mlp = "base_model.model.model.layers.0.mlp.gate_proj.lora_";
    more.insert(
        format!("{mlp}A.weight"),
        Tensor::zeros((4, h), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    );
    more.insert(
        format!("{mlp}B.weight"),
        Tensor::zeros((f, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    );
    let e = LoraAdapter::from_tensors(a.config().clone(), more, &cfg).unwrap_err().to_string();
    assert!(e.contains("2 tensor(s)") && e.contains("mlp.gate_proj.lora_A.weight"), "{e}");
    let mut lone = tensors;
    lone.remove("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight").unwrap();
    let e = LoraAdapter::from_tensors(a.config().clone(), lone, &cfg).unwrap_err().to_string();
    assert!(e.contains("layers.1.self_attn.v_proj.lora_B.weight without its lora_A"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
