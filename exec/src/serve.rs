//! Serving on the transport: instances that embed requests with the layers resident on their
//! node, and a router that splits batches between an overloaded instance and one still loading
//! (BlitzScale §5.2, live autoscaling).
//!
//! * [`Instance`] — the exec service of a node ([`proto`]): requests and replies are typed
//!   control messages; a split batch's activation travels as a one-sided WRITE into a slot of the
//!   paired instance's registered activation region (sized from the model and the instance's
//!   limits, allocated once, reused); the instance builds each stage only from bytes the
//!   multicast verified on its node ([`Source::Arriving`], fed by `LayerReady`).
//! * [`dispatch`] — the router's decisions, sans IO: the three-step protocol and the policies.
//! * [`router`] — the router's loop over the transport: batching, dispatch, re-queueing.
//!
//! **Reading a copy as it fills.** A multicast target's region is written by the run until its
//! last chunk is verified. An instance reads only layers its `LayerReady` events reported:
//! every chunk of them is crc-verified on the node. After a re-plan (a member failed) the new
//! parent starts at the first layer the target had not reported, so reported layers are not
//! written again — except the bytes of a chunk that straddles the last reported layer's end,
//! rewritten with the same verified bytes. Stages are built (copied out into tensors) once, when
//! their layer is reported, so even that never changes what an instance computes with.

use std::path::Path;
use std::sync::Arc;

use cascade_param_pool::files::MappedFile;
use cascade_param_pool::manifest::Manifest;
use cascade_transport::{Mesh, Region, TransportError};
use tokenizers::Tokenizer;

use crate::bert::BertConfig;
use crate::prompts::Prompt;
use crate::ExecError;

pub(crate) mod compute;
pub(crate) mod copy;
pub mod dispatch;
pub(crate) mod inbox;
mod instance;
pub mod proto;
pub mod router;
mod scale;

pub use compute::allowed_cores;
pub use dispatch::{DispatchConfig, Dispatcher, LivePolicy};
pub use instance::{Instance, InstanceConfig, Source};
pub use proto::{ExecMsg, Split};
pub use scale::{scale_out, ScaleOutcome};

/// What an instance serves: the model's configuration, manifest and tokenizer (its weights come
/// from a [`Source`]).
#[derive(Clone)]
pub struct ServedModel {
    /// The encoder's configuration.
    pub config: BertConfig,
    /// How its token states become embeddings.
    pub pooling: crate::pooling::Pooling,
    /// The prompt put before every text (the model's default one, `config_sentence_transformers.json`'s
    /// `default_prompt_name`; [`crate::prompts`]).
    pub prompt: Option<Prompt>,
    /// Where each tensor lies in the packed image.
    pub manifest: Arc<Manifest>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

impl ServedModel {
    /// Reads a model directory (`model.safetensors`, `tokenizer.json`, `config.json` as
    /// sentence-transformers ships them); returns the model and the file, mapped. The packed
    /// image has the embedding table last
    /// ([`Manifest::with_embeddings_last`](cascade_param_pool::manifest::Manifest::with_embeddings_last)):
    /// a new copy's encoder blocks arrive first and serve with the entry stage run by the old
    /// instance ([`dispatch`]'s three segments).
    pub fn from_dir(dir: &Path) -> Result<(ServedModel, MappedFile), ExecError> {
        let d = crate::embed::read_dir(dir)?;
        let manifest = d.manifest.with_embeddings_last(&d.bytes);
        let model = ServedModel {
            config: d.config,
            pooling: d.pooling,
            prompt: d.prompt,
            manifest: Arc::new(manifest),
            tokenizer: Arc::new(d.tokenizer),
        };
        Ok((model, d.bytes))
    }

    /// Tokens of the longest text the model takes, special tokens included: where its tokenizer
    /// cuts (sentence-transformers' `max_seq_length`: 256 for all-MiniLM-L6-v2), at most its
    /// positions.
    pub fn max_tokens(&self) -> usize {
        let positions = self.config.max_position_embeddings;
        self.tokenizer.get_truncation().map_or(positions, |t| t.max_length.min(positions))
    }

    /// `texts` as a batch before its first layer, the prompt before each.
    pub fn batch(&self, texts: &[&str]) -> Result<crate::Activation, ExecError> {
        Prompt::applied(self.prompt.as_ref(), texts, |t| crate::embed::tokenize(&self.tokenizer, t))
    }

    /// The embeddings of a batch after its last layer (the prompt's positions left out where the
    /// pooling excludes them).
    pub fn pool(&self, act: &crate::Activation) -> Result<Vec<Vec<f32>>, ExecError> {
        self.pooling.pool(act, Prompt::skip(self.prompt.as_ref()))
    }

    /// Packs `file` (the safetensors bytes) into a new region registered on `mesh`: a held copy
    /// for [`Source::Held`], and the source of a multicast.
    pub fn load(&self, mesh: &dyn Mesh, file: &[u8]) -> Result<Region, ServeError> {
        load_packed(mesh, &self.manifest, file)
    }
}

/// Packs `file` (a model's safetensors bytes, as `manifest` describes them) into a new region
/// registered on `mesh`: a held copy, and the source of a multicast.
pub fn load_packed(mesh: &dyn Mesh, manifest: &Manifest, file: &[u8]) -> Result<Region, ServeError> {
    if file.len() as u64 != manifest.file_bytes {
        return Err(ServeError::Config(format!(
            "the file has {} bytes, the manifest {}",
            file.len(),
            manifest.file_bytes
        )));
    }
    let mut image = vec![0u8; manifest.bytes as usize];
    manifest.pack(file, &mut image);
    let region = mesh.alloc(manifest.bytes)?;
    // SAFETY: the region is new and not registered yet: no peer can reach it.
    unsafe { region.write_local(0, &image) }?;
    mesh.register(&region)?;
    Ok(region)
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A bad limit or set-up.
    #[error("configuration: {0}")]
    Config(String),
    /// The request's input is refused (retrying elsewhere cannot help).
    #[error("input: {0}")]
    Input(String),
    /// A peer broke the exec protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The paired instance failed the request.
    #[error("peer: {0}")]
    Peer(String),
    /// Computing failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The instance stopped (another may take the request).
    #[error("the instance stopped")]
    Stopped,
}

impl ServeError {
    /// The answer that reports this error.
    pub fn to_failed(&self) -> ExecMsg {
        let retry = !matches!(self, ServeError::Input(_) | ServeError::Exec(ExecError::Input(_)));
        ExecMsg::Failed { message: self.to_string(), retry }
    }
}
