//! # cascade-param-pool
//!
//! The global parameter pool (seed paper 004, "Global parameter pool" and "Fault tolerance").
//!
//! * [`manifest`] — model manifests from safetensors files: layers, layer-major packing, chunk
//!   crc32s and a content hash;
//! * [`loader`] — io_uring loading (O_DIRECT, buffered fallback) into a registered region;
//! * [`pool`] — the pool manager's pure core: ≥k ready copies per model on distinct nodes,
//!   balanced placement, reclaim that copies first, repair after a node dies;
//! * [`meta`] — durable metadata: the `MetaStore` trait, the embedded WAL + snapshot store, and
//!   `DurablePool`, which writes every event ahead and recovers the same pool after a restart.
//!
//! **Status:** the etcd store, the pool manager's daemon side (executing its actions through the
//! loader and the multicast), `cascade pool` and `cascade demo` are not implemented yet (tracked
//! by the parameter-pool issue).
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod loader;
pub mod manager;
pub mod manifest;
pub mod meta;
pub mod node;
pub mod pool;
pub mod synthetic;

pub use loader::{load, LoadError, LoadMode, LoadOptions, LoadReport};
pub use manifest::{classify, LayerEntry, LayerKind, Manifest, ManifestError, TensorEntry, DEFAULT_CHUNK};
#[cfg(feature = "etcd")]
pub use meta::EtcdStore;
pub use meta::{DurablePool, EmbeddedStore, Event as PoolEvent, MetaError, MetaStore, ModelEntry, Recovered};
pub use pool::{Action as PoolAction, Copy, CopyKind, CopyState, Pool, PoolError, Source, Violation};
