//! LLM serving with prefill/decode disaggregation on the transport (BlitzScale §5.2 "Coping with
//! LLM", §6): prefill instances and decode instances as separate processes; a request's KV cache
//! moves from prefill to decode layer by layer with one-sided WRITEs into pages of the decode
//! instance's registered KV region ([`kv`]); a new prefill instance serves cooperatively while its
//! copy arrives by multicast (the first `x` stages on it, the rest on an old one, zigzag planned
//! with each request weighted by its prompt tokens), and both halves of the KV go to the decode
//! instance; a prefill instance can mutate into a decode one, keeping its parameters.
//!
//! * [`LlmInstance`] — the `llm` service of a node ([`proto`]), plus the `exec` service's copy
//!   control so [`crate::serve::scale_out`] scales it out like an encoder instance.
//! * [`router`] — the router: KV reservation on a decode instance, dispatch of prefills (the
//!   [`crate::serve::Dispatcher`], weighted), the token streams, mutation and live scaling.
//! * [`migrate`] — dLoRA's request–adapter co-migration between decode instances serving LoRA
//!   adapters: the monitor's trigger and ILP plan, and the moves (KV and adapter by WRITEs).
//!
//! **Departures, stated.** The decode instance copies a request's KV out of its pages into its
//! model's cache when decoding starts (attention does not read the pages in place); the pages
//! stay reserved until the request finishes, so they bound what an instance admits. A split
//! prefill's activation goes to the old instance inside its `Continue` message, not as a WRITE.
//! The first token reaches the router once the KV has moved and decoding started, so TTFT here
//! includes the KV transfer.

use std::path::Path;
use std::sync::Arc;

use cascade_param_pool::files::MappedFile;
use cascade_param_pool::manifest::Manifest;
use tokenizers::Tokenizer;

use crate::llama::LlamaConfig;
use crate::ExecError;

mod instance;
pub mod kv;
pub mod migrate;
pub mod proto;
pub mod router;

pub use instance::{LlmConfig, LlmInstance};
pub use proto::{KvGrant, LlmMsg, Role};

/// What an LLM instance serves: the model's configuration and manifest (its weights come from a
/// [`crate::serve::Source`]), and the tokenizer for the router.
#[derive(Clone)]
pub struct PdModel {
    /// The decoder's configuration.
    pub config: LlamaConfig,
    /// Where each tensor lies in the packed image.
    pub manifest: Arc<Manifest>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

impl PdModel {
    /// Reads a model directory (`cascade model import --gguf` writes one); returns the model and
    /// the safetensors file, mapped.
    pub fn from_dir(dir: &Path) -> Result<(PdModel, MappedFile), ExecError> {
        let f = crate::embed::read_files(dir)?;
        let text = f.config.ok_or_else(|| ExecError::Model(format!("{}: no config.json", dir.display())))?;
        let config = LlamaConfig::from_json(&text)?;
        Ok((PdModel { config, manifest: Arc::new(f.manifest), tokenizer: Arc::new(f.tokenizer) }, f.bytes))
    }
}
