//! One-sided operations on links that can place bytes without the target's CPU: `shm` (memcpy into
//! a mapping of the peer's memfd) and `rdma` (RDMA WRITE/READ on an RC queue pair).
//!
//! Both follow the same protocol over the link's control stream:
//! 1. on first access to a peer region, a lookup (`MapReq` for shm, `RkeyReq` for rdma) that the
//!    owner answers only if the region exists and the key matches; the answer is cached;
//! 2. the transfer itself, bounds-checked locally against the region's true length first;
//! 3. for a WRITE, a `Written` notice: the owner re-checks region, key and bounds, verifies the
//!    crc32 when asked, and acknowledges — that ack is the WRITE's completion.
//!
//! A region the owner cannot expose this way (a plain host region over shm, say), and a READ with
//! crc verification (whose checksum must come from the owner), go through the framed protocol.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::TransportError;
use crate::link::{Completion, Done, Op, OpHandle};
use crate::rdma::RemoteMr;
use crate::region::{RegionId, RemoteKey};
use crate::shm::PeerMap;
use crate::stream::Shared;
use crate::wire::{Opcode, Status};

/// Copies at least this large run on the blocking pool, off the async workers.
const BLOCKING_COPY: u64 = 256 << 10;

/// How a peer region can be reached one-sidedly.
#[derive(Clone)]
pub(crate) enum Access {
    /// Mapped into this process (shm).
    Mapped(Arc<PeerMap>),
    /// Registered with the peer's RDMA device (only read by the `rdma` engine).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Rdma(RemoteMr),
}

/// What moves the bytes.
pub(crate) enum Engine {
    /// memcpy through mappings.
    Shm,
    /// An RC queue pair.
    #[cfg(feature = "rdma")]
    Rdma(Arc<crate::rdma::verbs::RcQp>),
}

/// Per-link one-sided state: the engine and the cache of looked-up peer regions.
pub(crate) struct OneSided {
    engine: Engine,
    cache: Mutex<HashMap<(RegionId, RemoteKey), Option<Access>>>,
}

impl OneSided {
    pub(crate) fn new(engine: Engine) -> Self {
        OneSided { engine, cache: Mutex::default() }
    }

    /// The lookup request of this engine.
    pub(crate) fn lookup_op(&self) -> Opcode {
        match self.engine {
            Engine::Shm => Opcode::MapReq,
            #[cfg(feature = "rdma")]
            Engine::Rdma(_) => Opcode::RkeyReq,
        }
    }

    fn cached(&self, k: (RegionId, RemoteKey)) -> Option<Option<Access>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&k).cloned()
    }

    fn remember(&self, k: (RegionId, RemoteKey), a: Option<Access>) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).insert(k, a);
    }
}

/// Posts one operation: one-sided when the peer region allows it, framed otherwise.
pub(crate) fn post(s: &Arc<Shared>, os: &Arc<OneSided>, op: Op) -> OpHandle {
    let remote = match &op {
        Op::Write { remote, .. } | Op::Read { remote, verify: false, .. } => *remote,
        _ => return s.post_framed(op),
    };
    if op.check_local().is_err() {
        return s.post_framed(op); // reports the local error
    }
    let k = (remote.id, remote.key);
    let (done, handle) = OpHandle::new(s.peer);
    match os.cached(k) {
        Some(None) => return s.post_framed(op),
        Some(Some(access)) => {
            tokio::spawn(transfer(s.clone(), os.clone(), op, access, done));
        }
        None => {
            let (s, os) = (s.clone(), os.clone());
            tokio::spawn(async move {
                match s.request_access(remote.id, remote.key, os.lookup_op()).await {
                    Ok(a) => {
                        os.remember(k, a.clone());
                        match a {
                            Some(access) => transfer(s, os, op, access, done).await,
                            None => {
                                let r = s.post_framed(op).await;
                                let _ = done.send(r);
                            }
                        }
                    }
                    Err(e) => s.finish_op(done, Err(e)),
                }
            });
        }
    }
    handle
}

/// The transfer itself, then (for a WRITE) the `Written` notice whose ack completes it.
async fn transfer(s: Arc<Shared>, os: Arc<OneSided>, op: Op, access: Access, done: Done) {
    let (write, local, local_offset, remote, remote_offset, len, verify) = match op {
        Op::Write { local, local_offset, remote, remote_offset, len, verify } => {
            (true, local, local_offset, remote, remote_offset, len, verify)
        }
        Op::Read { local, local_offset, remote, remote_offset, len, verify } => {
            (false, local, local_offset, remote, remote_offset, len, verify)
        }
        Op::Send { .. } => return,
    };
    let name = if write { "write" } else { "read" };
    let moved = match (&os.engine, access) {
        (Engine::Shm, Access::Mapped(map)) => {
            if remote_offset.checked_add(len).is_none_or(|end| end > map.len()) {
                Err(TransportError::Refused { peer: s.peer, op: name, status: Status::OutOfBounds })
            } else {
                let l = local.clone();
                let run = move || map.copy(write, &l, local_offset, remote_offset, len);
                if len >= BLOCKING_COPY {
                    tokio::task::spawn_blocking(run).await.map_err(|e| TransportError::Protocol {
                        peer: Some(s.peer),
                        detail: format!("copy task failed: {e}"),
                    })
                } else {
                    run();
                    Ok(())
                }
            }
        }
        #[cfg(feature = "rdma")]
        (Engine::Rdma(qp), Access::Rdma(mr)) => {
            let h = if write {
                qp.post_write(&local, local_offset, mr, remote_offset, len)
            } else {
                qp.post_read(&local, local_offset, mr, remote_offset, len)
            };
            h.await.map(drop)
        }
        _ => Err(TransportError::Protocol {
            peer: Some(s.peer),
            detail: "lookup answer does not fit the link's engine".into(),
        }),
    };
    if let Err(e) = moved {
        s.finish_op(done, Err(e));
        return;
    }
    if write {
        s.stats.tx(len);
        // SAFETY: the initiator's source range is its own for the operation (region contract).
        let crc = if verify { unsafe { local.crc32(local_offset, len) }.ok() } else { None };
        s.post_written(done, remote.id, remote.key, remote_offset, len, crc);
    } else {
        s.stats.rx(len);
        s.finish_op(done, Ok(Completion { bytes: len }));
    }
}
