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
use std::collections::{HashMap, VecDeque};
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
    /// Moves the bytes of `m` between the local region and the peer region `access` reaches;
    /// with `m.crc`, also the crc32 of the bytes as placed, if the engine computes it while it
    /// moves them (`None` otherwise).
    fn transfer<'a>(&'a self, access: &'a PeerAccess, m: Move<'a>) -> BoxFuture<'a, Result<Option<u32>>>;
    /// Readies `access` for transfers, so that the first ones do not pay for it (a mapping's
    /// page tables, say). Nothing by default.
    fn prepare<'a>(&'a self, _access: &'a PeerAccess) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }
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
    /// Compute the crc32 of the bytes as placed, if the engine can as part of the move.
    pub(crate) crc: bool,
}

/// The owner's side of a one-sided engine: answers a peer's lookup of a local region whose id
/// and key were already checked.
pub(crate) trait LookupServer: Send + Sync + 'static {
    /// The engine whose lookups it answers.
    fn tag(&self) -> EngineTag;
    /// The answer to request `h` for `region`.
    fn answer(&self, h: &Header, region: &Region) -> Out;
}

/// Most peer regions a link keeps looked up; the oldest goes first beyond it.
pub(crate) const CACHE_LIMIT: usize = 64;

/// Per-link one-sided state: the engine and the cache of looked-up peer regions.
///
/// A cached access can pin the peer's memory (a shm mapping keeps its memfd's pages alive), so
/// an entry is dropped when the owner withdraws the region (its `Forget` frame) and the cache
/// holds at most [`CACHE_LIMIT`] entries. A transfer in flight holds its own clone of the access.
pub(crate) struct OneSided {
    pub(crate) engine: Arc<dyn OneSidedEngine>,
    cache: Mutex<Cache>,
    /// Held while a peer region is looked up: accesses that find nothing cached wait for the
    /// lookup in flight instead of each making one (each shm answer is a mapping of its own).
    pub(crate) lookup: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Cache {
    map: HashMap<(RegionId, RemoteKey), Option<PeerAccess>>,
    order: VecDeque<(RegionId, RemoteKey)>,
}

impl OneSided {
    pub(crate) fn new(engine: Arc<dyn OneSidedEngine>) -> Self {
        OneSided { engine, cache: Mutex::default(), lookup: tokio::sync::Mutex::new(()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn cached(&self, k: (RegionId, RemoteKey)) -> Option<Option<PeerAccess>> {
        self.lock().map.get(&k).cloned()
    }

    pub(crate) fn remember(&self, k: (RegionId, RemoteKey), a: Option<PeerAccess>) {
        let mut c = self.lock();
        if c.map.insert(k, a).is_none() {
            c.order.push_back(k);
        }
        while c.map.len() > CACHE_LIMIT {
            let Some(old) = c.order.pop_front() else { break };
            c.map.remove(&old);
        }
    }

    /// Drops what is cached for the peer's region `id` (it was withdrawn).
    pub(crate) fn forget(&self, id: RegionId) {
        let mut c = self.lock();
        c.map.retain(|(r, _), _| *r != id);
        c.order.retain(|(r, _)| *r != id);
    }

    /// Peer regions cached now.
    #[cfg(test)]
    pub(crate) fn cached_len(&self) -> usize {
        self.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    impl OneSidedEngine for Nothing {
        fn tag(&self) -> EngineTag {
            EngineTag(99)
        }
        fn decode_answer(&self, _: NodeId, _: &Header, _: Option<OwnedFd>) -> Result<PeerAccess> {
            Ok(Arc::new(()))
        }
        fn transfer<'a>(&'a self, _: &'a PeerAccess, _: Move<'a>) -> BoxFuture<'a, Result<Option<u32>>> {
            Box::pin(async { Ok(None) })
        }
    }

    #[test]
    fn the_cache_is_bounded_and_forgets_withdrawn_regions() {
        let os = OneSided::new(Arc::new(Nothing));
        for i in 0..(CACHE_LIMIT as u32 + 10) {
            os.remember((RegionId(i), RemoteKey(1)), Some(Arc::new(())));
        }
        assert_eq!(os.cached_len(), CACHE_LIMIT);
        assert!(os.cached((RegionId(0), RemoteKey(1))).is_none(), "the oldest went first");
        os.forget(RegionId(CACHE_LIMIT as u32 + 9));
        assert_eq!(os.cached_len(), CACHE_LIMIT - 1);
        assert!(os.cached((RegionId(CACHE_LIMIT as u32 + 9), RemoteKey(1))).is_none());
    }
}
