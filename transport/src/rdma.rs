//! RDMA backend over RC queue pairs, through the `sideway` crate (cargo feature `rdma`).
//!
//! libibverbs is loaded at run time, so the feature builds on machines without RDMA; opening a
//! device there fails with [`TransportError::NoRdmaDevice`]. This module is split the way the
//! design asks:
//!
//! * always compiled, device-free and unit-tested: the connection information two queue pairs
//!   exchange ([`ConnInfo`]), the descriptor of a remotely accessible memory registration
//!   ([`RemoteMr`]), and the bookkeeping of registrations per region with the key check a peer's
//!   lookup passes ([`MrTable`]);
//! * with the feature: [`verbs`] — device, protection domain, memory registration, an RC queue
//!   pair brought to RTS from the peer's [`ConnInfo`], posted one-sided WRITE/READ, and a thread
//!   polling the completion queue. Its tests need a device and are
//!   `#[ignore = "requires an RDMA device"]`.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use std::sync::Arc;

use crate::error::{Result, TransportError};
use crate::frame::{reply, Out, Payload};
use crate::onesided::{LookupServer, OneSidedEngine};
use crate::region::{Region, RegionId, RemoteKey};
use crate::wire::{EngineTag, Header, Opcode, Status};
use crate::NodeId;

/// Gives a local region's RDMA registration (registering it on first use).
pub(crate) type RkeyResolver = Arc<dyn Fn(&Region) -> std::result::Result<RemoteMr, Status> + Send + Sync>;

/// rdma's name in lookups.
#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
pub(crate) const TAG: EngineTag = EngineTag(2);

/// The owner's side of rdma: answers a lookup with the region's registration (from the device;
/// link tests give it a stand-in resolver).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct RdmaLookups(pub(crate) RkeyResolver);

impl LookupServer for RdmaLookups {
    fn tag(&self) -> EngineTag {
        TAG
    }

    fn answer(&self, h: &Header, region: &Region) -> Out {
        let header = match (self.0)(region) {
            Ok(mr) => Header {
                offset: mr.addr,
                key: u64::from(mr.rkey),
                len: mr.len,
                ..reply(h, Opcode::LookupResp, Status::Ok)
            },
            Err(st) => reply(h, Opcode::LookupResp, st),
        };
        Out::Frame { header, payload: Payload::None, done: None }
    }
}

/// The initiator's side of rdma: RDMA WRITE/READ on the link's RC queue pair.
#[cfg(feature = "rdma")]
struct RdmaEngine(Arc<verbs::RcQp>);

#[cfg(feature = "rdma")]
impl OneSidedEngine for RdmaEngine {
    fn tag(&self) -> EngineTag {
        TAG
    }

    fn decode_answer(
        &self,
        peer: NodeId,
        h: &Header,
        _fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<crate::onesided::PeerAccess> {
        Ok(Arc::new(RemoteMr::from_answer(peer, h)?))
    }

    fn transfer<'a>(
        &'a self,
        access: &'a crate::onesided::PeerAccess,
        m: crate::onesided::Move<'a>,
    ) -> crate::mesh::BoxFuture<'a, Result<Option<u32>>> {
        // No CPU touches RDMA's bytes: no crc of them comes with the move.
        let crate::onesided::Move { peer, write, local, local_offset, remote_offset, len, crc: _ } = m;
        Box::pin(async move {
            let mr = *access.clone().downcast::<RemoteMr>().map_err(|_| TransportError::Protocol {
                peer: Some(peer),
                detail: "not an RDMA registration".into(),
            })?;
            let h = if write {
                self.0.post_write(local, local_offset, mr, remote_offset, len)
            } else {
                self.0.post_read(local, local_offset, mr, remote_offset, len)
            };
            h.await.map(|_| None)
        })
    }
}

/// What one side of an RC connection tells the other to bring its queue pair to RTR/RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    /// Queue pair number.
    pub qp_num: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port number used.
    pub port: u8,
    /// GID table index used.
    pub gid_index: u8,
    /// The GID (RoCE, or IB with GRH).
    pub gid: [u8; 16],
}

impl ConnInfo {
    /// Encoded size.
    pub const LEN: usize = 32;
    const MAGIC: [u8; 4] = *b"CSQP";

    /// Encodes for the exchange over the (already authenticated) control connection.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&Self::MAGIC);
        b[4..8].copy_from_slice(&self.qp_num.to_le_bytes());
        b[8..12].copy_from_slice(&(self.psn & 0x00ff_ffff).to_le_bytes());
        b[12..14].copy_from_slice(&self.lid.to_le_bytes());
        b[14] = self.port;
        b[15] = self.gid_index;
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    /// Decodes and validates.
    pub fn decode(b: &[u8]) -> Result<ConnInfo> {
        let bad = |d: &str| TransportError::Protocol { peer: None, detail: format!("RDMA connection info: {d}") };
        if b.len() != Self::LEN {
            return Err(bad("wrong length"));
        }
        if b[0..4] != Self::MAGIC {
            return Err(bad("bad magic"));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let psn = u32_at(8);
        if psn > 0x00ff_ffff {
            return Err(bad("PSN exceeds 24 bits"));
        }
        if b[14] == 0 {
            return Err(bad("port 0"));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Ok(ConnInfo {
            qp_num: u32_at(4),
            psn,
            lid: u16::from_le_bytes([b[12], b[13]]),
            port: b[14],
            gid_index: b[15],
            gid,
        })
    }
}

/// Where a peer may READ/WRITE a registered region: virtual address, rkey and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMr {
    /// Virtual address of the region's first byte.
    pub addr: u64,
    /// The NIC's remote key of the registration.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteMr {
    /// Decodes the answer to an rdma lookup (`offset` = address, `key` = rkey, `len` = length).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn from_answer(peer: NodeId, h: &Header) -> Result<RemoteMr> {
        let rkey = u32::try_from(h.key).map_err(|_| TransportError::Protocol {
            peer: Some(peer),
            detail: "rdma lookup answer with an rkey above 32 bits".into(),
        })?;
        Ok(RemoteMr { addr: h.offset, rkey, len: h.len })
    }

    /// The remote address of `[offset, offset+len)`, or `OutOfBounds`. A NIC enforces the same
    /// bound; checking first gives the initiator a clear error instead of a broken QP.
    pub fn address(&self, offset: u64, len: u64) -> Result<u64, Status> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(Status::OutOfBounds),
        }
    }
}

/// Registrations of regions with a protection domain, by region id. `M` is the registration
/// handle that keeps it alive (sideway's memory region; any type in tests).
#[derive(Debug)]
pub struct MrTable<M> {
    map: HashMap<RegionId, Entry<M>>,
}

#[derive(Debug)]
struct Entry<M> {
    key: RemoteKey,
    lkey: u32,
    remote: RemoteMr,
    _mr: M,
}

impl<M> Default for MrTable<M> {
    fn default() -> Self {
        MrTable { map: HashMap::new() }
    }
}

impl<M> MrTable<M> {
    /// Records a registration; replaces (and so deregisters) an older one of the same region.
    pub fn insert(&mut self, id: RegionId, key: RemoteKey, lkey: u32, remote: RemoteMr, mr: M) -> Option<M> {
        self.map.insert(id, Entry { key, lkey, remote, _mr: mr }).map(|e| e._mr)
    }

    /// Drops a registration (the handle is returned so the caller controls when it is released).
    pub fn remove(&mut self, id: RegionId) -> Option<M> {
        self.map.remove(&id).map(|e| e._mr)
    }

    /// Local key of a region registered here, for posting work requests from it.
    pub fn lkey(&self, id: RegionId) -> Option<u32> {
        self.map.get(&id).map(|e| e.lkey)
    }

    /// Answers a peer's lookup: the registration of `id` if `key` is the region's key.
    pub fn resolve(&self, id: RegionId, key: RemoteKey) -> Result<RemoteMr, Status> {
        let e = self.map.get(&id).ok_or(Status::UnknownRegion)?;
        if e.key != key {
            return Err(Status::BadKey);
        }
        Ok(e.remote)
    }

    /// Number of registrations.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Exchanges queue-pair information over the link's (already authenticated) control stream:
/// each side writes its [`ConnInfo`] — all zeroes when it declines RDMA — and reads the peer's.
/// `Ok(None)` when either side declined; an error leaves the stream unusable.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    mine: Option<ConnInfo>,
    limit: Duration,
) -> Result<Option<ConnInfo>> {
    let io = |e: std::io::Error| TransportError::io("exchanging RDMA connection information", e);
    let out = mine.map(|c| c.encode()).unwrap_or([0; ConnInfo::LEN]);
    let mut theirs = [0u8; ConnInfo::LEN];
    tokio::time::timeout(limit, async {
        s.write_all(&out).await?;
        s.flush().await?;
        s.read_exact(&mut theirs).await.map(drop)
    })
    .await
    .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
    .map_err(io)?;
    if mine.is_none() || theirs == [0; ConnInfo::LEN] {
        return Ok(None);
    }
    ConnInfo::decode(&theirs).map(Some)
}

/// A node's RDMA device as the endpoint uses it. Only constructible with the `rdma` feature and
/// an openable device.
pub(crate) struct RdmaCtx {
    #[cfg(feature = "rdma")]
    dev: std::sync::Arc<verbs::Device>,
    #[cfg(not(feature = "rdma"))]
    never: std::convert::Infallible,
}

impl RdmaCtx {
    /// Opens the first device.
    pub(crate) fn open() -> Result<RdmaCtx> {
        #[cfg(feature = "rdma")]
        return Ok(RdmaCtx { dev: verbs::Device::open(None)? });
        #[cfg(not(feature = "rdma"))]
        return Err(TransportError::NoRdmaDevice { detail: "built without the `rdma` feature".into() });
    }

    /// Registers a region so peers can reach it.
    pub(crate) fn register(&self, region: &Region) -> Result<()> {
        #[cfg(feature = "rdma")]
        return self.dev.register(region).map(drop);
        #[cfg(not(feature = "rdma"))]
        match (self.never, region) {}
    }

    /// Withdraws a region's registration: the device may no longer touch its memory.
    pub(crate) fn deregister(&self, id: crate::RegionId) {
        #[cfg(feature = "rdma")]
        self.dev.deregister(id);
        #[cfg(not(feature = "rdma"))]
        match (self.never, id) {}
    }

    /// Answers peers' lookups, registering a region on first use.
    pub(crate) fn lookups(&self) -> Arc<dyn LookupServer> {
        #[cfg(feature = "rdma")]
        {
            let dev = self.dev.clone();
            Arc::new(RdmaLookups(Arc::new(move |r: &Region| {
                dev.resolve(r.id(), r.key()).or_else(|_| dev.register(r).map_err(|_| Status::Internal))
            })))
        }
        #[cfg(not(feature = "rdma"))]
        match self.never {}
    }

    /// Connects an RC queue pair to `peer` over the control stream. `Ok(None)` when either side
    /// declined or could not set up its queue pair (the link then stays plain tcp).
    pub(crate) async fn upgrade<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        s: &mut S,
        peer: NodeId,
        limit: Duration,
    ) -> Result<Option<Arc<dyn OneSidedEngine>>> {
        #[cfg(feature = "rdma")]
        {
            let qp = verbs::RcQp::create(&self.dev, peer)
                .inspect_err(|e| tracing::warn!(peer, error = %e, "cannot create a queue pair; link stays tcp"))
                .ok();
            let Some(theirs) = exchange(s, qp.as_ref().map(verbs::RcQp::local_info), limit).await? else {
                return Ok(None);
            };
            let Some(qp) = qp else { return Ok(None) };
            match qp.connect(&theirs) {
                Ok(()) => Ok(Some(Arc::new(RdmaEngine(Arc::new(qp))))),
                Err(e) => {
                    // The peer may have reached RTS; its one-sided operations will then fail with
                    // a work-completion error rather than hang.
                    tracing::warn!(peer, error = %e, "queue pair did not connect; link stays tcp");
                    Ok(None)
                }
            }
        }
        #[cfg(not(feature = "rdma"))]
        match (self.never, s, peer, limit) {}
    }
}

/// Checks that an RDMA device can be opened (always `NoRdmaDevice` without the `rdma` feature).
pub fn probe() -> Result<()> {
    RdmaCtx::open().map(drop)
}

#[cfg(feature = "rdma")]
pub mod verbs;

#[cfg(test)]
mod tests;
