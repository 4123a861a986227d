//! PEFT's adapter files (`adapter_config.json`, `adapter_model.safetensors`): read, written, and
//! refused where they hold what this server would not apply.
//!
//! A LoRA adapter is served here on the attention projections only, as the dLoRA paper's are.
//! PEFT can make adapters that do more — LoRA on the MLP's projections or the embeddings, fully
//! trained modules (`modules_to_save`), DoRA's magnitude vectors, trained biases, per-module
//! ranks and scales, weights stored transposed. Served without those parts, such an adapter
//! would answer every request subtly wrong, so [`LoraAdapter::load`] refuses it and says which
//! part. Rank-stabilised LoRA (`use_rslora`: the delta scaled by `α / √r`) is applied.

use std::path::Path;

use candle_core::Device;
use serde::Deserialize;

use super::{key, LoraAdapter, LoraConfig, Proj};
use crate::llama::LlamaConfig;
use crate::ExecError;

/// PEFT's `target_modules`: a list of module names, or one string (a pattern), kept as the only
/// item.
pub(super) fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// The block, projection and matrix (`'A'` or `'B'`) a PEFT tensor name holds, if it is one of
/// LoRA's matrices on an attention projection.
pub(super) fn lora_key(name: &str) -> Option<(usize, Proj, char)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let parts: Vec<&str> = rest.split('.').collect();
    let [block, "self_attn", module, ab, "weight"] = parts.as_slice() else { return None };
    let ab = match *ab {
        "lora_A" => 'A',
        "lora_B" => 'B',
        _ => return None,
    };
    Some((block.parse().ok()?, Proj::from_module(module)?, ab))
}

/// Refuses tensors other than LoRA's matrices on the attention projections, naming them.
pub(super) fn refuse_unserved<'n>(names: impl Iterator<Item = &'n String>) -> Result<(), ExecError> {
    let mut other: Vec<&str> = names.filter(|n| lora_key(n).is_none()).map(String::as_str).collect();
    if other.is_empty() {
        return Ok(());
    }
    other.sort_unstable();
    let shown = other.iter().take(3).copied().collect::<Vec<_>>().join(", ");
    let more = if other.len() > 3 { format!(" and {} more", other.len() - 3) } else { String::new() };
    Err(ExecError::Model(format!(
        "{} tensor(s) that are not LoRA's A and B on an attention projection ({shown}{more}): only \
         q_proj, k_proj, v_proj and o_proj are adapted here, and an adapter served without its \
         other parts would answer wrongly",
        other.len()
    )))
}

/// Refuses the PEFT options that change what an adapter computes in ways not applied here.
fn refuse_unserved_options(config: &serde_json::Value) -> Result<(), ExecError> {
    // An option is off as `false`, `{}` or `[]` (null passes too); `bias` also as "none".
    let off = |v: &serde_json::Value| {
        *v == false || v.as_object().is_some_and(serde_json::Map::is_empty) || v.as_array().is_some_and(Vec::is_empty)
    };
    let bias_off = |v: &serde_json::Value| off(v) || v == "none";
    let setting = |key, what| crate::Setting { key, applied: &off, what };
    crate::check_settings(
        "adapter_config.json",
        config,
        &[
            setting("use_dora", "DoRA's magnitude vectors"),
            setting("fan_in_fan_out", "weights stored transposed"),
            setting("rank_pattern", "ranks per module"),
            setting("alpha_pattern", "scales per module"),
            crate::Setting { key: "bias", applied: &bias_off, what: "trained biases" },
            setting("lora_bias", "a bias on lora_B"),
            setting("modules_to_save", "fully trained modules"),
            setting("layer_replication", "replicated layers"),
            setting("trainable_token_indices", "trained token embeddings"),
        ],
    )?;
    match config.get("peft_type").and_then(|t| t.as_str()) {
        None | Some("LORA") => Ok(()),
        Some(other) => Err(ExecError::Model(format!("adapter_config.json: peft_type {other:?}, not LORA"))),
    }
}

impl LoraAdapter {
    /// Reads PEFT's `adapter_config.json` and `adapter_model.safetensors` from `dir`, checking
    /// every tensor's shape against `cfg`. An adapter with parts not applied here (see the
    /// module's docs) is refused, naming them.
    pub fn load(dir: &Path, cfg: &LlamaConfig) -> Result<LoraAdapter, ExecError> {
        let bad = |why: String| ExecError::Model(format!("{}: {why}", dir.display()));
        let text = std::fs::read_to_string(dir.join("adapter_config.json"))
            .map_err(|e| bad(format!("adapter_config.json: {e}")))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("adapter_config.json: {e}")))?;
        refuse_unserved_options(&value).map_err(|e| bad(e.to_string()))?;
        let config = LoraConfig::deserialize(&value).map_err(|e| bad(format!("adapter_config.json: {e}")))?;
        let bytes = std::fs::read(dir.join("adapter_model.safetensors"))
            .map_err(|e| bad(format!("adapter_model.safetensors: {e}")))?;
        Self::from_tensors(config, candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?, cfg)
            .map_err(|e| bad(e.to_string()))
    }

    /// Writes PEFT's two files into `dir` (created).
    pub fn save(&self, dir: &Path) -> Result<(), ExecError> {
        let bad = |e: &dyn std::fmt::Display| ExecError::Model(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(|e| bad(&e))?;
        let mut tensors = std::collections::HashMap::new();
        for (&(block, p), (a, b)) in &self.weights {
            tensors.insert(key(block, p, 'A'), a.clone());
            tensors.insert(key(block, p, 'B'), b.clone());
        }
        candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors"))?;
        let mut cfg = serde_json::to_value(&self.config).map_err(|e| bad(&e))?;
        cfg["peft_type"] = "LORA".into();
        std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).map_err(|e| bad(&e))
    }
}
