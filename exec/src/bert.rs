//! A BERT encoder (all-MiniLM-L6-v2 and its kin) on the CPU, written on `candle`'s building blocks
//! (`LayerNorm`, `Embedding`, its products), its dense layers on the crate's packed projections
//! and GELU and softmax vectorised (`exec/src/vmath.rs`), with sentence-transformers' mean pooling
//! and L2 normalisation on top: real sentence embeddings.
//!
//! The model is cut into the stages the pool moves as layers: stage 0 is the embeddings, stage
//! `1 + n` is transformer block `n` (the pooler head is not used by sentence embeddings). A stage
//! is built from its tensors only when [`Bert::load_stage`] is called — by the serving node once
//! the stage's chunks are verified in its region — and [`Bert::run`] refuses a stage that is not
//! loaded: nothing is ever computed on bytes that did not arrive.

use std::ops::Range;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, LayerNorm};
use serde::Deserialize;

use crate::projection::Projection;
use crate::weights::Weights;
use crate::{Activation, ExecError, LayerExec};

/// The hyper-parameters of a BERT model (`config.json`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Attention heads per block.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Longest input, in tokens.
    pub max_position_embeddings: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
    /// Activation of the feed-forward layer (only `gelu`, the exact one, is supported).
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// What the weights' tensor names start with: empty, or `bert.` for a checkpoint saved from
    /// a `BertFor…` model (as `transformers` loads it into the bare encoder). Not in
    /// `config.json`: the model directory's reader finds it in the weights.
    #[serde(skip)]
    pub tensor_prefix: String,
}

fn gelu() -> String {
    "gelu".into()
}

impl BertConfig {
    /// all-MiniLM-L6-v2's configuration.
    pub fn minilm_l6() -> BertConfig {
        BertConfig {
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            layer_norm_eps: 1e-12,
            hidden_act: gelu(),
            tensor_prefix: String::new(),
        }
    }

    /// Reads `config.json`.
    pub fn from_json(text: &str) -> Result<BertConfig, ExecError> {
        crate::check_model_type(text, "bert")?;
        let c: BertConfig = serde_json::from_str(text).map_err(|e| ExecError::Model(format!("config.json: {e}")))?;
        crate::check_settings(
            "config.json",
            &crate::config_json(text)?,
            &[crate::Setting {
                key: "position_embedding_type",
                applied: &|v| v == "absolute",
                what: "relative position embeddings",
            }],
        )?;
        if c.hidden_act != "gelu" {
            return Err(ExecError::Model(format!("activation {:?} is not supported (only gelu)", c.hidden_act)));
        }
        if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return Err(ExecError::Model(format!(
                "hidden size {} is not a multiple of {} heads",
                c.hidden_size, c.num_attention_heads
            )));
        }
        Ok(c)
    }
}

/// Stage 0: word + position + token-type embeddings, then layer norm.
struct Embeddings {
    words: Embedding,
    positions: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
}

/// One transformer block.
struct Block {
    query: Projection,
    key: Projection,
    value: Projection,
    attn_out: Projection,
    attn_norm: LayerNorm,
    up: Projection,
    down: Projection,
    out_norm: LayerNorm,
}

enum Stage {
    Embeddings(Embeddings),
    Block(Box<Block>),
}

/// A BERT encoder whose stages are loaded one by one (see the module docs).
pub struct Bert {
    cfg: BertConfig,
    stages: Vec<Option<Stage>>,
}

impl Bert {
    /// A model with no stage loaded yet.
    pub fn new(cfg: BertConfig) -> Bert {
        let stages = (0..cfg.num_hidden_layers + 1).map(|_| None).collect();
        Bert { cfg, stages }
    }

    /// Every stage loaded from `w`.
    pub fn load(cfg: BertConfig, w: &Weights<'_>) -> Result<Bert, ExecError> {
        let mut b = Bert::new(cfg);
        for s in 0..b.stages.len() {
            b.load_stage(s, w)?;
        }
        Ok(b)
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// Builds stage `s` from its tensors in `w` (a copy of them: `candle` tensors, packed panels).
    pub fn load_stage(&mut self, s: usize, w: &Weights<'_>) -> Result<(), ExecError> {
        let eps = self.cfg.layer_norm_eps;
        let tensor = |name: &str| w.tensor(&format!("{}{name}", self.cfg.tensor_prefix));
        let norm = |p: &str| -> Result<LayerNorm, ExecError> {
            Ok(LayerNorm::new(tensor(&format!("{p}.weight"))?, tensor(&format!("{p}.bias"))?, eps))
        };
        let linear = |p: &str| -> Result<Projection, ExecError> {
            let weight = format!("{}{p}.weight", self.cfg.tensor_prefix);
            Ok(Projection::load(w, &weight)?.with_bias(tensor(&format!("{p}.bias"))?)?)
        };
        let stage = match s {
            0 => Stage::Embeddings(Embeddings {
                words: Embedding::new(tensor("embeddings.word_embeddings.weight")?, self.cfg.hidden_size),
                positions: tensor("embeddings.position_embeddings.weight")?,
                token_type: tensor("embeddings.token_type_embeddings.weight")?,
                norm: norm("embeddings.LayerNorm")?,
            }),
            s if s <= self.cfg.num_hidden_layers => {
                let p = format!("encoder.layer.{}", s - 1);
                Stage::Block(Box::new(Block {
                    query: linear(&format!("{p}.attention.self.query"))?,
                    key: linear(&format!("{p}.attention.self.key"))?,
                    value: linear(&format!("{p}.attention.self.value"))?,
                    attn_out: linear(&format!("{p}.attention.output.dense"))?,
                    attn_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                    up: linear(&format!("{p}.intermediate.dense"))?,
                    down: linear(&format!("{p}.output.dense"))?,
                    out_norm: norm(&format!("{p}.output.LayerNorm"))?,
                }))
            }
            _ => return Err(ExecError::NoSuchLayer { layer: s, layers: self.stages.len() }),
        };
        self.stages[s] = Some(stage);
        Ok(())
    }

    /// Whether stage `s` is loaded.
    pub fn is_loaded(&self, s: usize) -> bool {
        self.stages.get(s).is_some_and(Option::is_some)
    }

    fn embed(&self, e: &Embeddings, act: &Activation) -> candle_core::Result<Tensor> {
        let (_, seq) = act.ids.dims2()?;
        let words = e.words.forward(&act.ids)?;
        let pos = e.positions.narrow(0, 0, seq)?.unsqueeze(0)?;
        // Every token is of type 0 (single sentences).
        let ty = e.token_type.narrow(0, 0, 1)?.unsqueeze(0)?;
        e.norm.forward(&words.broadcast_add(&pos)?.broadcast_add(&ty)?)
    }

    fn block(&self, b: &Block, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (batch, seq, hidden) = x.dims3()?;
        let heads = self.cfg.num_attention_heads;
        let d = hidden / heads;
        let split = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((batch, seq, heads, d))?.transpose(1, 2)?.contiguous()
        };
        let q = split(b.query.forward(x)?)?;
        let k = split(b.key.forward(x)?)?;
        let v = split(b.value.forward(x)?)?;
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        // Padding: -10000 added to the scores of masked keys, as BERT of the model's era does.
        let bias = ((mask.to_dtype(DType::F32)? - 1.0)? * 10000.0)?.reshape((batch, 1, 1, seq))?;
        let probs = crate::vmath::softmax_last_dim(&scores.broadcast_add(&bias)?)?;
        let ctx = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((batch, seq, hidden))?;
        let attn = b.attn_norm.forward(&(b.attn_out.forward(&ctx)? + x)?)?;
        let inner = crate::vmath::gelu_erf(&b.up.forward(&attn)?)?;
        b.out_norm.forward(&(b.down.forward(&inner)? + attn)?)
    }
}

impl LayerExec for Bert {
    fn layers(&self) -> usize {
        self.stages.len()
    }

    fn run(&self, layers: Range<usize>, mut act: Activation) -> Result<Activation, ExecError> {
        crate::check_run(self.stages.len(), &layers, &act)?;
        for s in layers {
            let stage = self.stages[s].as_ref().ok_or(ExecError::NotResident { layer: s })?;
            act.hidden = Some(match stage {
                Stage::Embeddings(e) => {
                    if act.ids.dims2()?.1 > self.cfg.max_position_embeddings {
                        return Err(ExecError::Input(format!(
                            "{} tokens: the model takes at most {}",
                            act.ids.dims2()?.1,
                            self.cfg.max_position_embeddings
                        )));
                    }
                    self.embed(e, &act)?
                }
                Stage::Block(b) => {
                    let x = act.hidden.as_ref().ok_or(ExecError::OutOfOrder { have: s, want: 0 })?;
                    self.block(b, x, &act.mask)?
                }
            });
            act.next_layer = s + 1;
        }
        Ok(act)
    }
}

/// all-MiniLM-L6-v2's pooling (sentence-transformers' mean of the token states the mask keeps,
/// L2-normalised): one embedding per sentence. Other models' come from their directory:
/// [`crate::pooling::Pooling::from_dir`].
pub fn mean_pool_normalized(act: &Activation) -> Result<Vec<Vec<f32>>, ExecError> {
    crate::pooling::Pooling::default().pool(act, 0)
}

/// The CPU device every stage runs on.
pub(crate) fn cpu() -> Device {
    Device::Cpu
}
