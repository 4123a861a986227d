//! Multicast across processes: the node side ([`MulticastNode`], the multicast service of
//! `cascade node`) and the controller ([`Controller`], what `cascade multicast`, the benchmark and
//! the pool manager use).
//!
//! The controller is a member of the cluster like the nodes. It drives them through the
//! multicast control service (requests matched to replies by id, see [`proto`]); members report
//! to it through the multicast-report service and exchange chunk notices through the
//! multicast-notice service, all on the same links as the data:
//!
//! ```text
//! controller -> node   Prepare{run, loc, bytes, chunk, fill}  ->  Prepared{region, key, crcs}
//! controller -> node   Start{run, loc, layout, source, children}  ->  Ack
//! member -> controller Report{run, Done | LayerReady | ChildLost}    (one-way)
//! controller -> node   AddChild{run, loc, child}  ->  Ack            after a re-plan
//! controller -> node   Verify{run, loc}  ->  Verified{crc}
//! controller -> node   Release{run}  ->  Ack                          deregister the run's regions
//! ```
//!
//! Without a GPU backend a location's region is host memory on its node. A source is either
//! filled with a deterministic pseudo-random model (`Fill::Synthetic`, benchmarks and tests) or
//! is a region a higher layer on the node lent to the run ([`MulticastNode::lend`]: the
//! parameter pool's copies). A completed target's region can be taken out of the run
//! ([`MulticastNode::detach`]) before the run is released. A node drops the regions of a run
//! whose controller's link goes down, so a controller that dies mid-run leaves nothing behind.

use cascade_transport::{Region, TransportError};

mod controller;
mod node;
pub mod proto;

pub use controller::{ControlError, Controller, RunOutcome, RunSpec};
pub use node::MulticastNode;
pub use proto::{Control, Fill, Report};

/// Fills `region[..bytes]` with the synthetic model of `seed` (xorshift, 8 bytes at a time).
///
/// # Safety
/// No peer may write `region[..bytes]` while it is filled (the region concurrency contract):
/// the region is new, or every operation that could write it has completed.
pub unsafe fn fill_synthetic(region: &Region, bytes: u64, seed: u64) -> Result<(), TransportError> {
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
        // SAFETY: the caller guarantees that no peer writes the range meanwhile.
        unsafe { region.write_local(off, &buf[..n])? };
        off += n as u64;
    }
    Ok(())
}

/// crc32 of each `chunk` of `region[..bytes]` (the last one may be short).
///
/// # Safety
/// No peer may write `region[..bytes]` while it is read (the region concurrency contract).
pub unsafe fn chunk_crcs(region: &Region, bytes: u64, chunk: u64) -> Result<Vec<u32>, TransportError> {
    let chunk = chunk.max(1);
    // SAFETY: the caller guarantees that no peer writes the range meanwhile.
    (0..bytes.div_ceil(chunk)).map(|i| unsafe { region.crc32(i * chunk, chunk.min(bytes - i * chunk)) }).collect()
}

#[cfg(test)]
mod tests;
