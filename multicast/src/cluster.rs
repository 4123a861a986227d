//! Multicast across processes: the node side ([`serve_node`], what `cascade node` runs) and the
//! controller ([`Controller`], what `cascade multicast` and the benchmark use).
//!
//! The controller is a member of the cluster like the nodes; control messages travel as SENDs on
//! the same links as the data (JSON behind a 4-byte magic, so they never mix with chunk notices):
//!
//! ```text
//! controller -> node   Prepare{run, loc, bytes, fill}   allocate + register a region (sources fill it)
//! node -> controller   Prepared{run, loc, region, key, crcs}   (crcs: per chunk, from a source)
//! controller -> node   Start{run, loc, layout, source, children}
//! node -> controller   Report{run, ToCoord}              Done / LayerReady / ChildLost
//! controller -> node   AddChild{run, loc, child}          after a re-plan
//! controller -> node   Verify{run, loc}  ->  Verified{run, loc, crc}
//! controller -> node   Release{run}  ->  Released{run}     deregister the run's regions
//! controller -> node   Keep{run, loc, copy}  ->  Kept{..}  keep a target's region as held copy `copy`
//! ```
//!
//! Without a GPU backend a location's region is host memory on its node. A source is either
//! filled with a deterministic pseudo-random model (`Prepare{fill}`, benchmarks and tests) or is
//! a copy the node already holds (`Prepare{copy}`, the parameter pool's copies): see
//! [`HeldCopies`]. A node drops the regions of a run whose controller's link goes down, so a
//! controller that dies mid-run leaves nothing behind but the copies it asked to keep.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cascade_transport::{Endpoint, Op, Region, TransportError};
use serde::{Deserialize, Serialize};

use crate::executor::{ChildSpec, ToCoord};
use crate::layout::Layout;
use crate::topology::{Loc, NodeId};

mod controller;
mod node;

pub use controller::{Controller, RunOutcome, RunSpec};
pub use node::{chunk_crcs, serve_node, serve_node_with, Extension};

const MAGIC: &[u8; 4] = b"CSCT";

/// A control message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Control {
    /// Allocate and register a region for `loc`; with `fill`, fill it with the synthetic model of
    /// that seed and answer with the crc of each `chunk`.
    Prepare {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// Bytes of the model.
        bytes: u64,
        /// Chunk size (for the crcs of a source).
        chunk: u64,
        /// Seed of the synthetic model (sources only).
        fill: Option<u64>,
        /// Use this held copy as the source's region instead of a new one (sources only).
        #[serde(default)]
        copy: Option<u64>,
    },
    /// The region is ready.
    Prepared {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// Region id.
        region: u32,
        /// Its key.
        key: u64,
        /// Per-chunk crc32 (sources only).
        crcs: Option<Vec<u32>>,
    },
    /// Start the member.
    Start {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// What travels.
        layout: Layout,
        /// True for a source.
        source: bool,
        /// Where it sends.
        children: Vec<ChildSpec>,
    },
    /// A member's report.
    Report {
        /// Run id.
        run: u32,
        /// The report.
        msg: ToCoord,
    },
    /// A new child after a re-plan.
    AddChild {
        /// Run id.
        run: u32,
        /// The sender.
        loc: Loc,
        /// The child.
        child: ChildSpec,
    },
    /// Ask for the crc32 of a member's whole region.
    Verify {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
    },
    /// The crc32 of a member's region.
    Verified {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// crc32 of the model's bytes in the region.
        crc: u32,
    },
    /// Drop the run's regions.
    Release {
        /// Run id.
        run: u32,
    },
    /// The node dropped the run's regions.
    Released {
        /// Run id.
        run: u32,
    },
    /// Keep a completed target's region as a held copy (it outlives the run).
    Keep {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// The copy's id.
        copy: u64,
    },
    /// The region is held as `copy`.
    Kept {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// The copy's id.
        copy: u64,
    },
    /// A request failed at the node.
    Error {
        /// Run id.
        run: u32,
        /// What failed.
        message: String,
    },
}

impl Control {
    /// Encodes with the magic prefix.
    pub fn encode(&self) -> bytes::Bytes {
        let mut v = MAGIC.to_vec();
        // Serializing these plain types cannot fail.
        v.extend(serde_json::to_vec(self).unwrap_or_default());
        v.into()
    }

    /// Decodes a message that starts with the magic prefix.
    pub fn decode(b: &[u8]) -> Option<Control> {
        b.strip_prefix(MAGIC.as_slice()).and_then(|j| serde_json::from_slice(j).ok())
    }
}

pub(crate) fn send(ep: &Endpoint, to: NodeId, m: &Control) -> Result<(), TransportError> {
    // Fire and forget: the link delivers SENDs in order; a dead link is seen through PeerDown.
    let link = ep.link(to)?;
    drop(link.post(vec![Op::Send { payload: m.encode() }]));
    Ok(())
}

/// Fills `region[..bytes]` with the synthetic model of `seed` (xorshift, 8 bytes at a time).
pub fn fill_synthetic(region: &Region, bytes: u64, seed: u64) -> Result<(), TransportError> {
    let mut x = seed | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(buf.len() as u64) as usize;
        for w in buf[..n].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
        region.write_local(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Copies a node holds beyond any run: the parameter pool's model copies, by copy id. Regions in
/// here stay registered (peers may read them as multicast sources) until removed.
#[derive(Default)]
pub struct HeldCopies {
    map: Mutex<BTreeMap<u64, Region>>,
}

impl HeldCopies {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Region>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `region` as copy `id`; returns the region it replaces, if any.
    pub fn insert(&self, id: u64, region: Region) -> Option<Region> {
        self.lock().insert(id, region)
    }

    /// The region of copy `id`.
    pub fn get(&self, id: u64) -> Option<Region> {
        self.lock().get(&id).cloned()
    }

    /// Stops holding copy `id`; the caller deregisters the region.
    pub fn remove(&self, id: u64) -> Option<Region> {
        self.lock().remove(&id)
    }

    /// Ids of every held copy, ascending.
    pub fn ids(&self) -> Vec<u64> {
        self.lock().keys().copied().collect()
    }
}

#[cfg(test)]
mod tests;
