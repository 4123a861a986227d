//! Greedy generation over a llama model directory (`model.safetensors`, `config.json`,
//! `tokenizer.json`, as `cascade model import --gguf` writes them): the prompts are prefilled as
//! one packed batch, then every running sequence decodes one token per step in one batch until it
//! emits end-of-sequence, reaches its token budget or fills the model's context window.
//!
//! [`greedy`] drives any step function, so the same loop runs on one executor, on a split across
//! two ([`crate::llama`] stages `[0, k)` and `[k, L)`), or through the transport.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use cascade_param_pool::manifest::Manifest;
use tokenizers::Tokenizer;

use super::{Llama, LlamaConfig};
use crate::weights::Weights;
use crate::{Activation, ExecError, LayerExec};

/// One prompt's greedy continuation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Generated {
    /// The prompt's tokens.
    pub prompt_tokens: Vec<u32>,
    /// The generated tokens (ending with end-of-sequence if it was emitted).
    pub tokens: Vec<u32>,
    /// Whether generation stopped because prompt and tokens filled the model's context window
    /// (before end-of-sequence and before the token budget).
    pub at_window: bool,
}

/// The greedy choice (the first largest logit) of every segment of a head's output.
pub fn argmax(act: &Activation) -> Result<Vec<u32>, ExecError> {
    let logits = act.hidden.as_ref().ok_or_else(|| ExecError::Input("no logits".into()))?;
    Ok(logits.squeeze(0)?.argmax(1)?.to_vec1::<u32>()?)
}

/// Greedy generation: `step` runs a packed batch through every stage and returns the head's
/// output. Each prompt gets `seq_base + i` as its sequence id; generation of a prompt stops at
/// `eos`, after `max_tokens`, or when its next token would not fit the context `window` (the
/// model's positions: its last token is the one the last position predicts). A prompt longer
/// than the window is refused before anything runs.
pub fn greedy(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    seq_base: u64,
    max_tokens: usize,
    eos: u32,
    window: usize,
) -> Result<Vec<Generated>, ExecError> {
    greedy_each(step, prompts, seq_base, max_tokens, eos, window, |_, _| {})
}

/// [`greedy`], telling `on_token(i, token)` each token of prompt `i` as it is generated (to show
/// a long generation as it goes).
pub fn greedy_each(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    seq_base: u64,
    max_tokens: usize,
    eos: u32,
    window: usize,
    on_token: impl FnMut(usize, u32),
) -> Result<Vec<Generated>, ExecError> {
    let limits = GreedyLimits { seq_base, max_tokens, eos, window, max_running: usize::MAX };
    greedy_running(step, prompts, limits, on_token, |_, _| {})
}

/// Where a greedy generation stops, and how many sequences it runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GreedyLimits {
    /// Prompt `i` runs as sequence `seq_base + i`.
    pub seq_base: u64,
    /// Tokens generated per prompt at most.
    pub max_tokens: usize,
    /// The end-of-sequence token.
    pub eos: u32,
    /// The model's context window (its positions).
    pub window: usize,
    /// Sequences in one batch at most: the next prompt starts (its prefill packed with the
    /// others' decode steps) when one finishes. [`greedy`] runs them all at once.
    pub max_running: usize,
}

/// [`greedy_each`] with at most `limits.max_running` sequences at once, in prompt order, calling
/// `finished(i, generated)` as prompt `i`'s sequence (`seq_base + i`) ends — to free its KV
/// cache, or to show it — so memory is bounded by the running sequences rather than by all the
/// prompts.
pub fn greedy_running(
    mut step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    limits: GreedyLimits,
    mut on_token: impl FnMut(usize, u32),
    mut finished: impl FnMut(usize, &Generated),
) -> Result<Vec<Generated>, ExecError> {
    let GreedyLimits { seq_base, max_tokens, eos, window, max_running } = limits;
    if max_running == 0 {
        return Err(ExecError::Input("no sequence may run (max_running 0)".into()));
    }
    if let Some((i, p)) = prompts.iter().enumerate().find(|(_, p)| p.len() > window) {
        return Err(ExecError::Input(format!(
            "prompt {i}: {} tokens; the model's context window is {window}",
            p.len()
        )));
    }
    let mut out: Vec<Generated> =
        prompts.iter().map(|p| Generated { prompt_tokens: p.clone(), tokens: Vec::new(), at_window: false }).collect();
    if max_tokens == 0 {
        return Ok(out);
    }
    let mut waiting = prompts.iter().cloned().enumerate();
    // (index, position of the next token, the tokens to feed).
    let mut running: Vec<(usize, u32, Vec<u32>)> = Vec::new();
    loop {
        running.extend(waiting.by_ref().take(max_running - running.len()).map(|(i, p)| (i, 0, p)));
        if running.is_empty() {
            break;
        }
        let batch: Vec<(u64, u32, Vec<u32>)> =
            running.iter().map(|(i, pos, t)| (seq_base + *i as u64, *pos, t.clone())).collect();
        let next = argmax(&step(Activation::packed(&batch)?)?)?;
        let mut still = Vec::with_capacity(running.len());
        for ((i, pos, fed), tok) in running.into_iter().zip(next) {
            out[i].tokens.push(tok);
            on_token(i, tok);
            // `tok` is fed next at `at`: only a position inside the window takes it.
            let at = pos + fed.len() as u32;
            if tok != eos && out[i].tokens.len() < max_tokens && (at as usize) < window {
                still.push((i, at, vec![tok]));
                continue;
            }
            if tok != eos && out[i].tokens.len() < max_tokens {
                out[i].at_window = true;
            }
            finished(i, &out[i]);
        }
        running = still;
    }
    Ok(out)
}

/// A loaded llama model with its tokenizer.
pub struct Generator {
    tokenizer: Tokenizer,
    model: Llama,
    manifest: Manifest,
    next_seq: AtomicU64,
}

impl Generator {
    /// Loads `dir` (every stage).
    pub fn from_dir(dir: &Path) -> Result<Generator, ExecError> {
        let files = crate::embed::read_files(dir)?;
        let cfg = LlamaConfig::from_json(
            &files.config.ok_or_else(|| ExecError::Model(format!("{}: no config.json", dir.display())))?,
        )?;
        let stages = 0..cfg.stages();
        let model = Llama::load(cfg, &Weights::file(&files.manifest, &files.bytes)?, stages)?;
        Ok(Generator { tokenizer: files.tokenizer, model, manifest: files.manifest, next_seq: AtomicU64::new(1) })
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model, to change (adapters, merging).
    pub fn model_mut(&mut self) -> &mut Llama {
        &mut self.model
    }

    /// The model's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// `text`'s tokens (special tokens such as `<|im_start|>` recognised, nothing added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ExecError> {
        encode(&self.tokenizer, text)
    }

    /// `tokens` as text (special tokens kept).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, ExecError> {
        self.tokenizer.decode(tokens, false).map_err(|e| ExecError::Input(format!("decoding: {e}")))
    }

    /// Greedy continuations of `prompts`, [`RUNNING`] sequences at a time (in prompt order);
    /// each one's cache is freed when it finishes.
    pub fn generate(&self, prompts: &[Vec<u32>], max_tokens: usize) -> Result<Vec<Generated>, ExecError> {
        self.generate_each(prompts, max_tokens, |_, _| {}, |_, _| {})
    }

    /// [`Generator::generate`], telling `on_token(i, token)` each token of prompt `i` as it is
    /// generated and `on_done(i, generated)` when prompt `i` is done.
    pub fn generate_each(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        on_token: impl FnMut(usize, u32),
        mut on_done: impl FnMut(usize, &Generated),
    ) -> Result<Vec<Generated>, ExecError> {
        if prompts.iter().any(Vec::is_empty) {
            return Err(ExecError::Input("an empty prompt".into()));
        }
        let base = self.next_seq.fetch_add(prompts.len() as u64, Ordering::Relaxed);
        let layers = self.model.layers();
        let cfg = self.model.config();
        let limits = GreedyLimits {
            seq_base: base,
            max_tokens,
            eos: cfg.eos_token_id,
            window: cfg.max_position_embeddings,
            max_running: RUNNING,
        };
        let out = greedy_running(
            |a| self.model.run(0..layers, a),
            prompts,
            limits,
            on_token,
            |i, g| {
                self.model.free(base + i as u64);
                on_done(i, g);
            },
        );
        // After a failure too.
        for i in 0..prompts.len() as u64 {
            self.model.free(base + i);
        }
        out
    }
}

/// Sequences [`Generator::generate`] runs at once; later prompts start as earlier ones finish.
/// All at once, 300 prompts of ~150 tokens took 5.2 GB here.
pub const RUNNING: usize = 32;

/// `text`'s tokens with `tokenizer` (nothing added around them).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ExecError> {
    let enc = tokenizer.encode(text, false).map_err(|e| ExecError::Input(format!("tokenising: {e}")))?;
    Ok(enc.get_ids().to_vec())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    const VOCAB: usize = 50;
    const EOS: u32 = 49;

    /// A stand-in for a model's stages: each segment's next token is `(pos + len) % 40` (never
    /// `EOS`), or `EOS` for sequence 99. Records the furthest position any batch reaches.
    fn step(reach: &mut u32) -> impl FnMut(Activation) -> Result<Activation, ExecError> + '_ {
        move |mut a: Activation| {
            let mut rows = vec![0f32; a.segments.len() * VOCAB];
            for (k, g) in a.segments.iter().enumerate() {
                *reach = (*reach).max(g.pos + g.len);
                let tok = if g.seq == 99 { EOS as usize } else { (g.pos + g.len) as usize % 40 };
                rows[k * VOCAB + tok] = 1.0;
            }
            a.hidden = Some(Tensor::from_vec(rows, (1, a.segments.len(), VOCAB), &Device::Cpu)?);
            Ok(a)
        }
    }

    #[test]
    fn generation_stops_where_the_context_window_is_full_and_keeps_its_tokens() {
        let window = 10;
        let mut reach = 0;
        let prompts = [vec![1; 7], vec![1; 2], vec![1; 10]];
        let out = greedy(step(&mut reach), &prompts, 1, 100, EOS, window).unwrap();
        // A prompt of p tokens leaves positions p..window for w − p fed tokens: w − p + 1 generated
        // (the last one predicted by the window's last position).
        let got: Vec<(usize, bool)> = out.iter().map(|o| (o.tokens.len(), o.at_window)).collect();
        assert_eq!(got, [(4, true), (9, true), (1, true)]);
        assert!(reach as usize <= window, "a batch reached position {reach} of a {window}-token window");
        assert_eq!(out[0].tokens, [7, 8, 9, 10]);
        // Each token is told as it comes, to its prompt, in order.
        let mut told: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let each = greedy_each(step(&mut reach), &prompts, 1, 100, EOS, window, |i, t| told[i].push(t)).unwrap();
        assert_eq!(told, each.iter().map(|o| o.tokens.clone()).collect::<Vec<_>>());

        // The budget or end-of-sequence first: not at the window.
        let out = greedy(step(&mut reach), &[vec![1; 2]], 1, 5, EOS, window).unwrap();
        assert_eq!((out[0].tokens.len(), out[0].at_window), (5, false));
        let out = greedy(step(&mut reach), &[vec![1; 2]], 99, 5, EOS, window).unwrap();
        assert_eq!((out[0].tokens.clone(), out[0].at_window), (vec![EOS], false));
    }

    /// With at most two sequences running, five prompts give what they give all at once; no
    /// batch holds more than two, later prompts start as earlier ones finish, and each sequence
    /// is reported finished once, when its last token is out.
    #[test]
    fn a_bounded_run_gives_the_same_tokens_with_at_most_its_bound_running() {
        let window = 20;
        let prompts = [vec![1; 7], vec![1; 2], vec![1; 10], vec![1; 3], vec![1; 1]];
        let mut reach = 0;
        let all = greedy(step(&mut reach), &prompts, 1, 6, EOS, window).unwrap();
        let mut widest = 0;
        let mut reach2 = 0;
        let mut inner = step(&mut reach2);
        let counting = |a: Activation| {
            widest = widest.max(a.segments.len());
            inner(a)
        };
        let limits = GreedyLimits { seq_base: 1, max_tokens: 6, eos: EOS, window, max_running: 2 };
        let mut done = Vec::new();
        let mut tokens_at_finish = Vec::new();
        let told = std::cell::RefCell::new(vec![0usize; prompts.len()]);
        let bounded = greedy_running(
            counting,
            &prompts,
            limits,
            |i, _| told.borrow_mut()[i] += 1,
            |i, g| {
                done.push(i);
                tokens_at_finish.push((told.borrow()[i], g.tokens.len()));
            },
        )
        .unwrap();
        assert_eq!(bounded, all);
        assert_eq!(widest, 2);
        let mut sorted = done.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3, 4], "each finished once: {done:?}");
        assert!(tokens_at_finish.iter().all(|&n| n == (6, 6)), "finished before its last token: {tokens_at_finish:?}");
        let limits = GreedyLimits { max_running: 0, ..limits };
        assert!(greedy_running(step(&mut reach), &prompts, limits, |_, _| {}, |_, _| {}).is_err());
    }

    #[test]
    fn a_prompt_longer_than_the_window_is_refused_before_anything_runs() {
        let mut reach = 0;
        let e = greedy(step(&mut reach), &[vec![1; 3], vec![1; 11]], 1, 4, EOS, 10).unwrap_err();
        assert_eq!(e.to_string(), "input: prompt 1: 11 tokens; the model's context window is 10");
        assert_eq!(reach, 0, "nothing ran");
    }
}
