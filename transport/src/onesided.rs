//! One-sided operations on links that can place bytes without the target's CPU: `shm` (memcpy into
//! a mapping of the peer's memfd) and `rdma` (RDMA WRITE/READ on an RC queue pair).
//!
//! Every engine follows the same protocol over the link's control stream:
//! 1. on first access to a peer region, a `LookupReq` naming the engine by its [`EngineTag`],
//!    which the owner's server for that tag answers only if the region exists and the key
//!    matches; the answer is cached;
//! 2. the transfer itself, bounds-checked locally against the region's true length first;
//! 3. for a WRITE, a `Written` notice: the owner re-checks region, key and bounds, verifies the
//!    crc32 when asked, and acknowledges — that ack is the WRITE's completion.
//!
//! An engine is one [`OneSidedEngine`] (the initiator's side: its lookup, decoding the answer,
//! moving bytes) and one [`LookupServer`] (the owner's side: answering lookups), each in the
//! engine's own file (`shm.rs`, `rdma.rs`); the link engine (`stream`, which posts operations
//! one-sidedly through them) and the wire format know them only through these traits and the
//! tag. A new engine is its file (tag, engine, server) plus its registration in `endpoint`: the
//! line that adds its server to [`crate::endpoint`]'s list and the one that installs its engine
//! on the links that have its fabric.
//!
//! A region the owner cannot expose this way (a plain host region over shm, say), and a READ with
//! crc verification (whose checksum must come from the owner), go through the framed protocol.

use std::any::Any;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::frame::Out;
use crate::mesh::BoxFuture;
use crate::region::{Region, RegionId, RemoteKey};
use crate::wire::{EngineTag, Header};
use crate::NodeId;

/// A peer region as one engine reaches it (a mapping, a remote memory key): opaque to the link,
/// downcast by the engine that made it.
pub(crate) type PeerAccess = Arc<dyn Any + Send + Sync>;

/// The initiator's side of a one-sided engine.
pub(crate) trait OneSidedEngine: Send + Sync + 'static {
    /// The engine's name in its lookups (the owner answers with the server of the same tag).
    fn tag(&self) -> EngineTag;
    /// Decodes the owner's (successful) answer to a lookup; `fd` is a descriptor that came with
    /// it, if any. An error closes the link (the peer broke the protocol).
    fn decode_answer(&self, peer: NodeId, h: &Header, fd: Option<OwnedFd>) -> Result<PeerAccess>;
    /// Moves the bytes of `m` between the local region and the peer region `access` reaches.
    fn transfer<'a>(&'a self, access: &'a PeerAccess, m: Move<'a>) -> BoxFuture<'a, Result<()>>;
}

/// One transfer of an engine: `len` bytes between `local[local_offset..]` and the peer region at
/// `remote_offset` (into the peer when `write`). The local range was bounds-checked; the engine
/// checks the remote range against what its lookup answered.
#[derive(Clone, Copy)]
pub(crate) struct Move<'a> {
    /// The peer.
    pub(crate) peer: NodeId,
    /// Into the peer (WRITE) or out of it (READ).
    pub(crate) write: bool,
    /// The local region.
    pub(crate) local: &'a Region,
    /// Offset in the local region.
    pub(crate) local_offset: u64,
    /// Offset in the peer region.
    pub(crate) remote_offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// The owner's side of a one-sided engine: answers a peer's lookup of a local region whose id
/// and key were already checked.
pub(crate) trait LookupServer: Send + Sync + 'static {
    /// The engine whose lookups it answers.
    fn tag(&self) -> EngineTag;
    /// The answer to request `h` for `region`.
    fn answer(&self, h: &Header, region: &Region) -> Out;
}

/// Per-link one-sided state: the engine and the cache of looked-up peer regions.
pub(crate) struct OneSided {
    pub(crate) engine: Arc<dyn OneSidedEngine>,
    cache: Mutex<HashMap<(RegionId, RemoteKey), Option<PeerAccess>>>,
}

impl OneSided {
    pub(crate) fn new(engine: Arc<dyn OneSidedEngine>) -> Self {
        OneSided { engine, cache: Mutex::default() }
    }

    pub(crate) fn cached(&self, k: (RegionId, RemoteKey)) -> Option<Option<PeerAccess>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&k).cloned()
    }

    pub(crate) fn remember(&self, k: (RegionId, RemoteKey), a: Option<PeerAccess>) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).insert(k, a);
    }
}
