//! # cascade-param-pool
//!
//! The global parameter pool (seed paper 004, "Global parameter pool" and "Fault tolerance").
//!
//! * [`manifest`] — model manifests from safetensors files: layers, layer-major packing, chunk
//!   crc32s and a content hash;
//! * [`files`] — opening model files without blocking, regular files only;
//! * [`loader`] — io_uring loading (O_DIRECT, buffered fallback) into a registered region;
//! * [`pool`] — the pool manager's pure core: ≥k ready copies per model on distinct nodes,
//!   balanced placement, reclaim that copies first, repair after a node dies;
//! * [`meta`] — durable metadata: the `MetaStore` trait, the embedded WAL + snapshot store, the
//!   etcd store (feature `etcd`), and `DurablePool`, which writes every event ahead and recovers
//!   the same pool after a restart;
//! * [`manager`] — the pool manager daemon: executes the pool's actions on the nodes (multicast
//!   from surviving copies, io_uring loads from the file), declares dead nodes and repairs, checks
//!   every copy's crcs, and serves `cascade pool …` over its admin interface;
//! * [`node`] — the node side of the pool (what `cascade node` serves besides multicast runs);
//! * [`synthetic`] — Llama-2-7B-structured synthetic models for demos and tests.
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod files;
pub mod loader;
pub mod manager;
pub mod manifest;
pub mod meta;
pub mod node;
pub mod pool;
pub mod synthetic;
#[cfg(test)]
mod test_util;

pub use loader::{load, load_counting, LoadError, LoadMode, LoadOptions, LoadProgress, LoadReport};
pub use manifest::{classify, LayerEntry, LayerKind, Manifest, ManifestError, TensorEntry, DEFAULT_CHUNK};
#[cfg(feature = "etcd")]
pub use meta::EtcdStore;
pub use meta::{DurablePool, EmbeddedStore, Event as PoolEvent, MetaError, MetaStore, ModelEntry, Recovered};
pub use pool::{Action as PoolAction, CopyKind, CopyState, ModelCopy, Pool, PoolError, Source, Violation};
