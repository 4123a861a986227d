//! A llama-architecture decoder (SmolLM2 and its kin) on the CPU, written on `candle`'s building
//! blocks: RMSNorm, rotary position embeddings (halves rotated, as Hugging Face's layout wants),
//! grouped-query attention over a per-sequence KV cache ([`kv`]), a SwiGLU MLP, and a tied or
//! separate LM head (a tied one shares its matrix with the token embeddings). The projections keep
//! their weights packed in panels from the start and read each matrix once per product, for a
//! decode step's few tokens as for a prefill's many (`projection.rs`): `gemm` repacks at every call.
//!
//! Stages follow the pool's layers: stage 0 is the token embeddings, stage `1 + n` is block `n`,
//! and the last stage is the final norm with the LM head. As with [`crate::bert`], a stage is
//! built from its tensors only when [`Llama::load_stage`] is called, and [`LayerExec::run`]
//! refuses one that is not loaded, so a partially loaded instance runs its first layers only.
//!
//! Batches are *packed* (see [`crate::activation`]): the new tokens of several sequences one after
//! another, a [`Segment`] each. The projections and the MLP run on all the batch's tokens at once;
//! attention runs per segment against that sequence's cache, causally masked. A prefill is a
//! segment of the whole prompt at position 0; a decode step is a segment of one token. The head
//! returns the logits of each segment's last token, `[1, segments, vocabulary]`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};
use serde::{Deserialize, Serialize};

use crate::activation::Segment;
use crate::weights::Weights;
use crate::{Activation, ExecError, LayerExec};

pub mod chat;
mod few;
pub mod generate;
pub mod kv;
pub mod logprob;
pub mod lora;
pub mod multi_lora;
pub mod penalty;
pub mod sample;
pub mod stop;
pub mod text;

use crate::projection::Projection;
pub use kv::KvCache;
pub use lora::{LoraAdapter, Proj};

/// Query rows of one sequence's attention computed at once, at most ([`Llama`]'s prefill of a long
/// prompt goes in blocks of this many, fewer against a long cache: see [`SCORE_BYTES`]).
pub const ATTENTION_ROWS: usize = 256;

/// Bytes of attention scores one block of query rows holds at most (all heads), unless a single
/// row needs more: below glibc's largest threshold for serving an allocation by `mmap` (32 MiB),
/// so a block's buffers are reused rather than mapped and faulted in afresh every time (in a
/// process that did not raise the threshold: [`crate::heap::keep_freed_memory`]).
pub const SCORE_BYTES: usize = 16 << 20;

/// The hyper-parameters of a llama model (`config.json`, Hugging Face's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Always `llama`.
    pub model_type: String,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Whether the LM head is the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: u32,
    /// End-of-sequence token (generation stops there).
    pub eos_token_id: u32,
}

impl LlamaConfig {
    /// Reads `config.json`, checking that the shapes are consistent, and refusing settings that
    /// change what the model computes and are not applied here (`rope_scaling`, biases, another
    /// activation or head width).
    pub fn from_json(text: &str) -> Result<LlamaConfig, ExecError> {
        crate::check_model_type(text, "llama")?;
        let c: LlamaConfig = serde_json::from_str(text).map_err(|e| ExecError::Model(format!("config.json: {e}")))?;
        c.check()?;
        let head_dim = c.head_dim() as u64;
        crate::check_settings(
            "config.json",
            &crate::config_json(text)?,
            &[
                crate::Setting {
                    key: "hidden_act",
                    applied: &|v| v == "silu",
                    what: "an activation other than SwiGLU's SiLU",
                },
                crate::Setting { key: "rope_scaling", applied: &|_| false, what: "RoPE frequencies scaled" },
                crate::Setting {
                    key: "attention_bias",
                    applied: &|v| v == false,
                    what: "biases on the attention projections",
                },
                crate::Setting { key: "mlp_bias", applied: &|v| v == false, what: "biases on the MLP" },
                crate::Setting {
                    key: "head_dim",
                    applied: &|v| v.as_u64() == Some(head_dim),
                    what: "heads of a width other than hidden_size / num_attention_heads",
                },
            ],
        )?;
        Ok(c)
    }

    /// Refuses an inconsistent configuration.
    pub fn check(&self) -> Result<(), ExecError> {
        let bad = |why: String| Err(ExecError::Model(format!("config: {why}")));
        if self.model_type != "llama" {
            return bad(format!("model type {:?} is not llama", self.model_type));
        }
        let (h, q, kv) = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads);
        if q == 0 || kv == 0 || !h.is_multiple_of(q) || !q.is_multiple_of(kv) || !(h / q).is_multiple_of(2) {
            return bad(format!("hidden {h} with {q} query and {kv} key/value heads"));
        }
        Ok(())
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The model's stages: embeddings, the blocks, the head.
    pub fn stages(&self) -> usize {
        self.num_hidden_layers + 2
    }
}

/// One block.
struct Block {
    attn_norm: RmsNorm,
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    mlp_norm: RmsNorm,
    gate: Projection,
    up: Projection,
    down: Projection,
}

/// The final norm and the LM head.
struct Head {
    norm: RmsNorm,
    lm_head: Arc<Projection>,
}

/// The token embedding table.
enum TokenTable {
    /// A table of its own.
    Own(Embedding),
    /// The LM head's matrix (tied embeddings), held once for both.
    Tied(Arc<Projection>),
}

enum Stage {
    Embed(TokenTable),
    Block(Box<Block>),
    Head(Head),
}

/// A llama decoder whose stages are loaded one by one (see the module docs).
pub struct Llama {
    cfg: LlamaConfig,
    stages: Vec<Option<Stage>>,
    /// RoPE cos and sin, `[max_position_embeddings, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    kv: Mutex<KvCache>,
    /// LoRA adapters by id (never 0, the base model).
    adapters: HashMap<u32, Arc<LoraAdapter>>,
    /// The adapter folded into the base weights, if any.
    merged: Option<u32>,
}

impl Llama {
    /// A model with no stage loaded yet.
    pub fn new(cfg: LlamaConfig) -> Result<Llama, ExecError> {
        cfg.check()?;
        let d = cfg.head_dim();
        let inv: Vec<f64> = (0..d / 2).map(|i| cfg.rope_theta.powf(-((2 * i) as f64) / d as f64)).collect();
        let n = cfg.max_position_embeddings;
        let angles = |f: fn(f64) -> f64| -> Vec<f32> {
            (0..n).flat_map(|p| inv.iter().map(move |w| f(p as f64 * w) as f32)).collect()
        };
        let dev = Device::Cpu;
        let cos = Tensor::from_vec(angles(f64::cos), (n, d / 2), &dev)?;
        let sin = Tensor::from_vec(angles(f64::sin), (n, d / 2), &dev)?;
        let stages = (0..cfg.stages()).map(|_| None).collect();
        Ok(Llama { cfg, stages, cos, sin, kv: Mutex::default(), adapters: HashMap::new(), merged: None })
    }

    /// Every stage in `stages` loaded from `w`.
    pub fn load(cfg: LlamaConfig, w: &Weights<'_>, stages: Range<usize>) -> Result<Llama, ExecError> {
        let mut m = Llama::new(cfg)?;
        for s in stages {
            m.load_stage(s, w)?;
        }
        Ok(m)
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Whether stage `s` is loaded.
    pub fn is_loaded(&self, s: usize) -> bool {
        self.stages.get(s).is_some_and(Option::is_some)
    }

    /// Builds stage `s` from its tensors in `w`. A tied head shares the embedding stage's matrix
    /// when that stage is loaded here.
    pub fn load_stage(&mut self, s: usize, w: &Weights<'_>) -> Result<(), ExecError> {
        let eps = self.cfg.rms_norm_eps;
        let norm = |name: &str| -> Result<RmsNorm, ExecError> { Ok(RmsNorm::new(w.tensor(name)?, eps)) };
        let linear = |name: &str| Projection::load(w, name);
        let last = self.cfg.num_hidden_layers + 1;
        let stage = match s {
            0 => Stage::Embed(if w.has("lm_head.weight") {
                TokenTable::Own(Embedding::new(w.tensor("model.embed_tokens.weight")?, self.cfg.hidden_size))
            } else {
                TokenTable::Tied(Arc::new(linear("model.embed_tokens.weight")?))
            }),
            s if s < last => {
                let p = format!("model.layers.{}", s - 1);
                Stage::Block(Box::new(Block {
                    attn_norm: norm(&format!("{p}.input_layernorm.weight"))?,
                    q: linear(&format!("{p}.self_attn.q_proj.weight"))?,
                    k: linear(&format!("{p}.self_attn.k_proj.weight"))?,
                    v: linear(&format!("{p}.self_attn.v_proj.weight"))?,
                    o: linear(&format!("{p}.self_attn.o_proj.weight"))?,
                    mlp_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                    gate: linear(&format!("{p}.mlp.gate_proj.weight"))?,
                    up: linear(&format!("{p}.mlp.up_proj.weight"))?,
                    down: linear(&format!("{p}.mlp.down_proj.weight"))?,
                }))
            }
            s if s == last => {
                let lm_head = if w.has("lm_head.weight") {
                    Arc::new(linear("lm_head.weight")?)
                } else if let Some(Stage::Embed(TokenTable::Tied(t))) = &self.stages[0] {
                    t.clone()
                } else {
                    Arc::new(linear("model.embed_tokens.weight")?)
                };
                Stage::Head(Head { norm: norm("model.norm.weight")?, lm_head })
            }
            _ => return Err(ExecError::NoSuchLayer { layer: s, layers: self.stages.len() }),
        };
        self.stages[s] = Some(stage);
        // A block that arrives while an adapter is merged gets it too.
        if let Some(a) = self.merged.and_then(|m| self.adapters.get(&m).cloned()) {
            if (1..last).contains(&s) {
                self.fold_block(&a, s - 1, 1.0)?;
            }
        }
        Ok(())
    }

    /// Serves LoRA adapter `id` (unmerged until [`Llama::merge`]); replaces one of the same id
    /// unless that one is merged.
    pub fn add_adapter(&mut self, id: u32, adapter: LoraAdapter) -> Result<(), ExecError> {
        if id == 0 || self.merged == Some(id) {
            return Err(ExecError::Input(format!("adapter id {id}: 0 is the base model, a merged one stays")));
        }
        self.adapters.insert(id, Arc::new(adapter));
        Ok(())
    }

    /// Adapter `id`, if served.
    pub fn adapter(&self, id: u32) -> Option<Arc<LoraAdapter>> {
        self.adapters.get(&id).cloned()
    }

    /// The adapters served, by id.
    pub fn adapter_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.adapters.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Stops serving adapter `id` (not while merged); whether it was there.
    pub fn remove_adapter(&mut self, id: u32) -> Result<bool, ExecError> {
        if self.merged == Some(id) {
            return Err(ExecError::Input(format!("adapter {id} is merged: un-merge it first")));
        }
        Ok(self.adapters.remove(&id).is_some())
    }

    /// Block `block`'s projection `p` as it is now (with a merged adapter folded in), if loaded.
    pub fn projection(&self, block: usize, p: Proj) -> Result<Option<Tensor>, ExecError> {
        let Some(Some(Stage::Block(b))) = self.stages.get(block + 1) else { return Ok(None) };
        Ok(Some(
            match p {
                Proj::Q => &b.q,
                Proj::K => &b.k,
                Proj::V => &b.v,
                Proj::O => &b.o,
            }
            .weight()?,
        ))
    }

    /// The adapter merged into the base weights.
    pub fn merged(&self) -> Option<u32> {
        self.merged
    }

    /// Folds adapter `id` into the loaded blocks' weights: `W' = W + (α/r)·B·A`. From now on a
    /// batch serves only that adapter's requests, at the base model's cost.
    pub fn merge(&mut self, id: u32) -> Result<(), ExecError> {
        if let Some(m) = self.merged {
            return Err(ExecError::Input(format!("adapter {m} is merged: un-merge it first")));
        }
        let a = self.adapters.get(&id).cloned().ok_or_else(|| ExecError::Input(format!("no adapter {id}")))?;
        self.fold(&a, 1.0)?;
        self.merged = Some(id);
        Ok(())
    }

    /// Takes the merged adapter out of the weights again, in place (`W = W' − (α/r)·B·A`,
    /// exact up to f32 rounding); which one it was.
    pub fn unmerge(&mut self) -> Result<Option<u32>, ExecError> {
        let Some(id) = self.merged else { return Ok(None) };
        let a = self.adapters.get(&id).cloned().ok_or_else(|| ExecError::Input(format!("no adapter {id}")))?;
        self.fold(&a, -1.0)?;
        self.merged = None;
        Ok(Some(id))
    }

    fn fold(&mut self, a: &LoraAdapter, sign: f64) -> Result<(), ExecError> {
        for block in 0..self.cfg.num_hidden_layers {
            self.fold_block(a, block, sign)?;
        }
        Ok(())
    }

    /// Adds `sign · (α/r)·B·A` to block `block`'s targeted projections, if the block is loaded.
    fn fold_block(&mut self, a: &LoraAdapter, block: usize, sign: f64) -> Result<(), ExecError> {
        for p in Proj::ALL {
            let Some(Some(Stage::Block(b))) = self.stages.get_mut(block + 1) else { return Ok(()) };
            let lin = match p {
                Proj::Q => &mut b.q,
                Proj::K => &mut b.k,
                Proj::V => &mut b.v,
                Proj::O => &mut b.o,
            };
            let Some(d) = a.delta(block, p)? else { continue };
            lin.add(&(d * sign)?)?;
        }
        Ok(())
    }

    /// The adapter a segment is served with in unmerged form (none for the base model and for
    /// the merged adapter, which is in the weights).
    fn unmerged_adapter(&self, g: &Segment) -> Option<&LoraAdapter> {
        (g.adapter != 0 && self.merged != Some(g.adapter))
            .then(|| self.adapters.get(&g.adapter).map(|a| &**a))
            .flatten()
    }

    /// `lin` on every token, plus each segment's own adapter delta where it has one.
    fn project(
        &self,
        lin: &Projection,
        block: usize,
        p: Proj,
        x: &Tensor,
        segments: &[Segment],
    ) -> Result<Tensor, ExecError> {
        let y = lin.forward(x)?;
        if segments.iter().all(|g| self.unmerged_adapter(g).is_none()) {
            return Ok(y);
        }
        let mut parts = Vec::with_capacity(segments.len());
        let mut off = 0;
        for g in segments {
            let n = g.len as usize;
            let ys = y.narrow(1, off, n)?;
            let d = match self.unmerged_adapter(g) {
                Some(a) => a.apply(block, p, &x.narrow(1, off, n)?)?,
                None => None,
            };
            parts.push(match d {
                Some(d) => (ys + d)?,
                None => ys,
            });
            off += n;
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// Refuses a batch naming an adapter not served here, or, while one is merged, any other.
    fn check_adapters(&self, segments: &[Segment]) -> Result<(), ExecError> {
        for g in segments {
            if g.adapter != 0 && !self.adapters.contains_key(&g.adapter) {
                return Err(ExecError::Input(format!("sequence {}: no adapter {}", g.seq, g.adapter)));
            }
            if let Some(m) = self.merged.filter(|&m| m != g.adapter) {
                return Err(ExecError::Input(format!(
                    "sequence {} wants adapter {} but {m} is merged: a merged batch serves its adapter only",
                    g.seq, g.adapter
                )));
            }
        }
        Ok(())
    }

    /// Drops `seq`'s KV cache (a finished or moved request); whether it had one.
    pub fn free(&self, seq: u64) -> bool {
        self.cache().free(seq)
    }

    /// The KV cache (for moving a sequence's cache between instances).
    pub fn cache(&self) -> std::sync::MutexGuard<'_, KvCache> {
        self.kv.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks a batch's segments against the cache of `block` before anything is appended, so a
    /// refused batch leaves every cache as it was.
    fn check_segments(&self, act: &Activation, block: Option<usize>) -> Result<(), ExecError> {
        let tokens = act.ids.dims2()?.1;
        let total: usize = act.segments.iter().map(|g| g.len as usize).sum();
        if act.segments.is_empty() || total != tokens {
            return Err(ExecError::Input(format!("segments cover {total} of the batch's {tokens} tokens")));
        }
        let cache = self.cache();
        for g in &act.segments {
            let end = g.pos as usize + g.len as usize;
            if end > self.cfg.max_position_embeddings {
                return Err(ExecError::Input(format!(
                    "sequence {}: {end} tokens, the model takes at most {}",
                    g.seq, self.cfg.max_position_embeddings
                )));
            }
            if let Some(b) = block.filter(|&b| cache.len(g.seq, b) != g.pos as usize) {
                return Err(ExecError::Input(format!(
                    "sequence {}: block {b} holds {} tokens, the batch continues at {}",
                    g.seq,
                    cache.len(g.seq, b),
                    g.pos
                )));
            }
        }
        Ok(())
    }

    fn block(&self, b: &Block, block: usize, x: &Tensor, segments: &[Segment]) -> Result<Tensor, ExecError> {
        let (_, t, _) = x.dims3()?;
        let (heads, kv_heads, d) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim());
        let h = b.attn_norm.forward(x)?;
        let q = self.project(&b.q, block, Proj::Q, &h, segments)?.reshape((t, heads, d))?;
        let k = self.project(&b.k, block, Proj::K, &h, segments)?.reshape((t, kv_heads, d))?;
        let v = self.project(&b.v, block, Proj::V, &h, segments)?.reshape((t, kv_heads, d))?;
        let mut outs = Vec::with_capacity(segments.len());
        let mut off = 0;
        for g in segments {
            let (pos, n) = (g.pos as usize, g.len as usize);
            let part = |x: &Tensor| -> candle_core::Result<Tensor> {
                x.narrow(0, off, n)?.transpose(0, 1)?.unsqueeze(0)?.contiguous()
            };
            let (cos, sin) = (self.cos.narrow(0, pos, n)?, self.sin.narrow(0, pos, n)?);
            let qs = candle_nn::rotary_emb::rope(&part(&q)?, &cos, &sin)?;
            let ks = candle_nn::rotary_emb::rope(&part(&k)?, &cos, &sin)?;
            let (kall, vall) = self.cache().append(g.seq, block, pos, ks, part(&v)?)?;
            outs.push(self.attend(&qs, &kall, &vall, pos)?);
            off += n;
        }
        let att = Tensor::cat(&outs, 0)?.unsqueeze(0)?;
        let x = (x + self.project(&b.o, block, Proj::O, &att, segments)?)?;
        let h = b.mlp_norm.forward(&x)?;
        let mlp = b.down.forward(&(crate::vmath::silu_tensor(&b.gate.forward(&h)?)? * b.up.forward(&h)?)?)?;
        Ok((x + mlp)?)
    }

    /// Attention of one sequence's new queries `[1, heads, n, d]` (at positions `pos..pos+n`)
    /// over its cached keys and values `[1, kv_heads, S, d]`; returns `[n, heads·d]`.
    ///
    /// Grouped-query attention without copies: query head `h` reads key/value head `h / rep`, so
    /// the `rep` query heads of one key/value head are stacked as the rows of one matrix and
    /// multiplied against that head's keys as they lie in the cache. (Before 2026-12-05 the keys
    /// and values were widened to every query head first: copies of `rep` times the cache, per
    /// block and per decoded token.)
    ///
    /// The queries go in blocks of rows, each against only the keys its rows may see (up to its
    /// last position): a long prompt's prefill holds one block's scores, not all n × S of them,
    /// and skips the masked half. A block holds at most [`ATTENTION_ROWS`] rows and
    /// [`SCORE_BYTES`] of scores; larger buffers cost page faults at every allocation (a prompt
    /// of 8,189 tokens spent 52 of its 76 s prefill in the kernel with 256-row blocks of 75 MB).
    /// Rows are independent, so the result is the same.
    ///
    /// Up to [`few::FEW`] rows (decode steps) read the cache in place instead ([`few::attend`]):
    /// `matmul` would pack every head's keys and values first.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        let (_, heads, n, d) = q.dims4()?;
        let (_, kv_heads, s, _) = k.dims4()?;
        let rep = heads / kv_heads;
        let q = (q * (1.0 / (d as f64).sqrt()))?;
        if let Some(out) = few::attend(&q, k, v, pos)? {
            return Ok(out);
        }
        let per_row = heads * s * std::mem::size_of::<f32>();
        let step = (SCORE_BYTES / per_row).clamp(1, ATTENTION_ROWS);
        let mut blocks = Vec::with_capacity(n.div_ceil(step));
        for start in (0..n).step_by(step) {
            let rows = step.min(n - start);
            // Row i (position pos + i) sees keys 0..=pos + i: this block, keys up to its last row's.
            let seen = (pos + start + rows).min(s);
            let (kb, vb) = (k.narrow(2, 0, seen)?, v.narrow(2, 0, seen)?);
            // [1, heads, rows, d] is [1, kv_heads, rep·rows, d]: each key/value head's queries.
            let qb = q.narrow(2, start, rows)?.contiguous()?.reshape((1, kv_heads, rep * rows, d))?;
            let scores = qb.matmul(&kb.t()?)?.reshape((1, heads, rows, seen))?;
            let probs = crate::vmath::causal_softmax(&scores, pos + start)?.reshape((1, kv_heads, rep * rows, seen))?;
            blocks.push(probs.matmul(&vb)?.reshape((1, heads, rows, d))?);
        }
        let out = if blocks.len() == 1 { blocks.remove(0) } else { Tensor::cat(&blocks, 2)? };
        out.transpose(1, 2)?.reshape((n, heads * d))
    }

    fn head(&self, h: &Head, x: &Tensor, segments: &[Segment]) -> candle_core::Result<Tensor> {
        let mut at = 0u32;
        let last: Vec<u32> = segments
            .iter()
            .map(|g| {
                at += g.len;
                at - 1
            })
            .collect();
        let n = last.len();
        let x = x.index_select(&Tensor::from_vec(last, n, x.device())?, 1)?;
        h.lm_head.forward(&h.norm.forward(&x)?)
    }
}

impl LayerExec for Llama {
    fn layers(&self) -> usize {
        self.stages.len()
    }

    fn run(&self, layers: Range<usize>, mut act: Activation) -> Result<Activation, ExecError> {
        crate::check_run(self.stages.len(), &layers, &act)?;
        for s in layers {
            let stage = self.stages[s].as_ref().ok_or(ExecError::NotResident { layer: s })?;
            let hidden = match stage {
                Stage::Embed(e) => {
                    self.check_segments(&act, None)?;
                    self.check_adapters(&act.segments)?;
                    if act
                        .ids
                        .max_keepdim(1)?
                        .flatten_all()?
                        .to_vec1::<u32>()?
                        .iter()
                        .any(|&t| t as usize >= self.cfg.vocab_size)
                    {
                        return Err(ExecError::Input(format!(
                            "a token id past the vocabulary of {}",
                            self.cfg.vocab_size
                        )));
                    }
                    match e {
                        TokenTable::Own(e) => e.forward(&act.ids)?,
                        TokenTable::Tied(t) => t.rows(&act.ids)?,
                    }
                }
                Stage::Block(b) => {
                    let x = act.hidden.as_ref().ok_or(ExecError::OutOfOrder { have: s, want: 0 })?;
                    self.check_segments(&act, Some(s - 1))?;
                    self.check_adapters(&act.segments)?;
                    self.block(b, s - 1, x, &act.segments)?
                }
                Stage::Head(h) => {
                    let x = act.hidden.as_ref().ok_or(ExecError::OutOfOrder { have: s, want: 0 })?;
                    self.head(h, x, &act.segments)?
                }
            };
            act.hidden = Some(hidden.to_dtype(DType::F32)?);
            act.next_layer = s + 1;
        }
        Ok(act)
    }
}
