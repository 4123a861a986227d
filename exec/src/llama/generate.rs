//! Greedy generation over a llama model directory (`model.safetensors`, `config.json`,
//! `tokenizer.json`, as `cascade model import --gguf` writes them): the prompts are prefilled as
//! one packed batch, then every running sequence decodes one token per step in one batch until it
//! emits end-of-sequence or reaches its token budget.
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
}

/// The greedy choice (the first largest logit) of every segment of a head's output.
pub fn argmax(act: &Activation) -> Result<Vec<u32>, ExecError> {
    let logits = act.hidden.as_ref().ok_or_else(|| ExecError::Input("no logits".into()))?;
    Ok(logits.squeeze(0)?.argmax(1)?.to_vec1::<u32>()?)
}

/// Greedy generation: `step` runs a packed batch through every stage and returns the head's
/// output. Each prompt gets `seq_base + i` as its sequence id; generation of a prompt stops at
/// `eos` or after `max_tokens`.
pub fn greedy(
    mut step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    seq_base: u64,
    max_tokens: usize,
    eos: u32,
) -> Result<Vec<Generated>, ExecError> {
    let mut out: Vec<Generated> =
        prompts.iter().map(|p| Generated { prompt_tokens: p.clone(), tokens: Vec::new() }).collect();
    if max_tokens == 0 {
        return Ok(out);
    }
    // (index, position of the next token, the tokens to feed).
    let mut running: Vec<(usize, u32, Vec<u32>)> =
        prompts.iter().cloned().enumerate().map(|(i, p)| (i, 0, p)).collect();
    while !running.is_empty() {
        let batch: Vec<(u64, u32, Vec<u32>)> =
            running.iter().map(|(i, pos, t)| (seq_base + *i as u64, *pos, t.clone())).collect();
        let next = argmax(&step(Activation::packed(&batch)?)?)?;
        let mut still = Vec::with_capacity(running.len());
        for ((i, pos, fed), tok) in running.into_iter().zip(next) {
            out[i].tokens.push(tok);
            if tok != eos && out[i].tokens.len() < max_tokens {
                still.push((i, pos + fed.len() as u32, vec![tok]));
            }
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

    /// Greedy continuations of `prompts`, batched; their caches are freed afterwards.
    pub fn generate(&self, prompts: &[Vec<u32>], max_tokens: usize) -> Result<Vec<Generated>, ExecError> {
        if prompts.iter().any(Vec::is_empty) {
            return Err(ExecError::Input("an empty prompt".into()));
        }
        let base = self.next_seq.fetch_add(prompts.len() as u64, Ordering::Relaxed);
        let layers = self.model.layers();
        let out = greedy(|a| self.model.run(0..layers, a), prompts, base, max_tokens, self.model.config().eos_token_id);
        for i in 0..prompts.len() as u64 {
            self.model.free(base + i);
        }
        out
    }
}

/// `text`'s tokens with `tokenizer` (nothing added around them).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ExecError> {
    let enc = tokenizer.encode(text, false).map_err(|e| ExecError::Input(format!("tokenising: {e}")))?;
    Ok(enc.get_ids().to_vec())
}
