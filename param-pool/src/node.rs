//! The node side of the pool: what a `cascade node` daemon does for the pool manager besides
//! multicast runs — load a copy from its model file, drop one, checksum one, list them.
//!
//! Requests travel as SENDs behind their own 4-byte magic (`CSPL`), next to the multicast's
//! control messages:
//!
//! ```text
//! manager -> node   Load{copy, path, manifest}  ->  Loaded{copy, result}   (io_uring loader, crc-verified)
//! manager -> node   Drop{copy}                  ->  Dropped{copy}
//! manager -> node   Check{copy, bytes, chunk}   ->  Checked{copy, crcs}    (None: no such copy)
//! manager -> node   List                        ->  Listed{copies}
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cascade_multicast::cluster::{chunk_crcs, serve_node_with, Extension, HeldCopies};
use cascade_multicast::NodeId;
use cascade_transport::{Endpoint, Op};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::loader::{load, LoadOptions};
use crate::manifest::Manifest;

const MAGIC: &[u8; 4] = b"CSPL";

/// A pool request or reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeMsg {
    /// Load the model file at `path` into a new held copy.
    Load {
        /// The copy's id.
        copy: u64,
        /// The safetensors file.
        path: String,
        /// Its manifest (what to place where, and the crcs to verify).
        manifest: Box<Manifest>,
    },
    /// The outcome of a load: seconds taken, or why it failed.
    Loaded {
        /// The copy.
        copy: u64,
        /// Seconds, or the error.
        result: Result<f64, String>,
        /// The error is that the file does not exist on the node.
        #[serde(default)]
        file_missing: bool,
    },
    /// Release a held copy.
    Drop {
        /// The copy.
        copy: u64,
    },
    /// The copy is gone (or was never here).
    Dropped {
        /// The copy.
        copy: u64,
    },
    /// Checksum a held copy.
    Check {
        /// The copy.
        copy: u64,
        /// Model bytes.
        bytes: u64,
        /// Chunk size of the manifest's crcs.
        chunk: u64,
    },
    /// The crc32 of each chunk; `None` when the node holds no such copy.
    Checked {
        /// The copy.
        copy: u64,
        /// Per-chunk crc32.
        crcs: Option<Vec<u32>>,
    },
    /// List the held copies.
    List,
    /// The held copies.
    Listed {
        /// Their ids, ascending.
        copies: Vec<u64>,
    },
}

impl NodeMsg {
    /// Encodes with the magic prefix.
    pub fn encode(&self) -> Bytes {
        let mut v = MAGIC.to_vec();
        // Serializing these plain types cannot fail.
        v.extend(serde_json::to_vec(self).unwrap_or_default());
        v.into()
    }

    /// Decodes a message that starts with the magic prefix.
    pub fn decode(b: &[u8]) -> Option<NodeMsg> {
        b.strip_prefix(MAGIC.as_slice()).and_then(|j| serde_json::from_slice(j).ok())
    }
}

fn reply(ep: &Endpoint, to: NodeId, m: &NodeMsg) {
    match ep.link(to) {
        Ok(link) => drop(link.post(vec![Op::Send { payload: m.encode() }])),
        Err(e) => warn!(to, error = %e, "cannot answer the pool manager"),
    }
}

/// Handles one pool request on a node (slow work runs on a blocking thread).
fn handle(ep: &Arc<Endpoint>, held: &Arc<HeldCopies>, from: NodeId, msg: NodeMsg) {
    match msg {
        NodeMsg::Load { copy, path, manifest } => {
            let (ep, held) = (ep.clone(), held.clone());
            tokio::task::spawn_blocking(move || {
                let file_missing = !Path::new(&path).exists();
                let result = ep.register_new(manifest.bytes).map_err(|e| e.to_string()).and_then(|region| {
                    match load(&manifest, Path::new(&path), &region, LoadOptions::default()) {
                        Ok(rep) => {
                            if let Some(old) = held.insert(copy, region) {
                                ep.regions().deregister(old.id());
                            }
                            info!(copy, path, seconds = rep.seconds, mode = ?rep.mode, "loaded a copy from its file");
                            Ok(rep.seconds)
                        }
                        Err(e) => {
                            ep.regions().deregister(region.id());
                            Err(e.to_string())
                        }
                    }
                });
                reply(&ep, from, &NodeMsg::Loaded { copy, result, file_missing });
            });
        }
        NodeMsg::Drop { copy } => {
            if let Some(r) = held.remove(copy) {
                ep.regions().deregister(r.id());
                info!(copy, "dropped a copy");
            }
            reply(ep, from, &NodeMsg::Dropped { copy });
        }
        NodeMsg::Check { copy, bytes, chunk } => {
            let (ep, held) = (ep.clone(), held.clone());
            tokio::task::spawn_blocking(move || {
                let crcs = held.get(copy).and_then(|r| chunk_crcs(&r, bytes.min(r.len()), chunk).ok());
                reply(&ep, from, &NodeMsg::Checked { copy, crcs });
            });
        }
        NodeMsg::List => reply(ep, from, &NodeMsg::Listed { copies: held.ids() }),
        other => warn!(?other, "a node got a pool reply"),
    }
}

/// The extension that serves pool requests with `held` as the node's copies.
pub fn extension(ep: Arc<Endpoint>, held: Arc<HeldCopies>) -> Extension {
    Arc::new(move |from, payload: &Bytes| match NodeMsg::decode(payload) {
        Some(m) => {
            handle(&ep, &held, from, m);
            true
        }
        None => false,
    })
}

/// A node daemon's main loop: multicast runs plus the pool's requests, until the endpoint
/// shuts down.
pub async fn serve_pool_node(ep: Arc<Endpoint>, op_timeout: Duration) {
    let held: Arc<HeldCopies> = Arc::default();
    let ext = extension(ep.clone(), held.clone());
    serve_node_with(ep, op_timeout, held, Some(ext)).await
}
