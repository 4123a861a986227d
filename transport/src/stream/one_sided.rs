//! Posting operations one-sidedly through the link's engine (see `crate::onesided`).

use std::sync::Arc;

use super::Shared;
use crate::link::{Completion, Done, Op, OpHandle};
use crate::onesided::{Move, OneSided, PeerAccess};
use crate::region::RemoteRegion;

/// Posts a batch keeping [`Link::post`](crate::Link::post)'s order. The engine moves bytes on
/// another path than the link's frames, so a SEND that follows WRITEs in the batch is posted only
/// once those WRITEs have completed: the order holds at the cost of their round trip, which the
/// framed path does not pay. (An RDMA queue pair orders its own work requests; posting the batch
/// as one chain of them there is not done.) WRITEs themselves are posted at once, as without a
/// SEND behind them.
pub(crate) fn post_batch(s: &Arc<Shared>, os: &Arc<OneSided>, ops: Vec<Op>) -> Vec<OpHandle> {
    let first_write = ops.iter().position(|op| matches!(op, Op::Write { .. }));
    if !first_write.is_some_and(|w| ops[w..].iter().any(|op| matches!(op, Op::Send { .. }))) {
        return ops.into_iter().map(|op| post(s, os, op)).collect();
    }
    let (dones, handles): (Vec<Done>, Vec<OpHandle>) = ops.iter().map(|_| OpHandle::new(s.peer)).unzip();
    let (s, os) = (s.clone(), os.clone());
    tokio::spawn(async move {
        // WRITEs posted and not yet known complete, with where their results go.
        let mut writes: Vec<(OpHandle, Done)> = Vec::new();
        let mut others = Vec::new();
        for (op, done) in ops.into_iter().zip(dones) {
            match op {
                Op::Write { .. } => writes.push((post(&s, &os, op), done)),
                Op::Send { .. } => {
                    for (h, done) in writes.drain(..) {
                        let _ = done.send(h.await);
                    }
                    others.push((post(&s, &os, op), done));
                }
                Op::Read { .. } => others.push((post(&s, &os, op), done)),
            }
        }
        for (h, done) in writes.into_iter().chain(others) {
            let _ = done.send(h.await);
        }
    });
    handles
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
                match access(&s, &os, remote).await {
                    Ok(Some(access)) => transfer(s, os, op, access, done).await,
                    Ok(None) => {
                        let r = s.post_framed(op).await;
                        let _ = done.send(r);
                    }
                    Err(e) => s.finish_op(done, Err(e)),
                }
            });
        }
    }
    handle
}

/// Looks `remote` up (unless cached) and has the engine ready its access; a region the owner
/// does not expose one-sidedly has nothing to ready.
pub(crate) fn prepare(s: &Arc<Shared>, os: &Arc<OneSided>, remote: RemoteRegion) -> OpHandle {
    let (done, handle) = OpHandle::new(s.peer);
    let (s, os) = (s.clone(), os.clone());
    tokio::spawn(async move {
        let r = match access(&s, &os, remote).await {
            Ok(Some(a)) => os.engine.prepare(&a).await,
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        let _ = done.send(r.map(|()| Completion::moved(0)));
    });
    handle
}

/// The engine's access to `remote`: cached, or looked up from the peer and remembered
/// (`None`: the owner does not expose it one-sidedly). One lookup at a time on a link: the first
/// WRITEs of a transfer, started together, all miss the cache, and each used to look the region
/// up and map it again (four mappings of one 538 MB target in `cascade pd`'s scale-out, each
/// populated on its own).
pub(crate) async fn access(
    s: &Shared,
    os: &OneSided,
    remote: RemoteRegion,
) -> crate::error::Result<Option<PeerAccess>> {
    let k = (remote.id, remote.key);
    if let Some(a) = os.cached(k) {
        return Ok(a);
    }
    let _one = os.lookup.lock().await;
    if let Some(a) = os.cached(k) {
        return Ok(a);
    }
    let a = s.request_access(remote.id, remote.key, os.engine.clone()).await?;
    os.remember(k, a.clone());
    Ok(a)
}

/// The transfer itself, then (for a WRITE) the `Written` notice whose ack completes it.
async fn transfer(s: Arc<Shared>, os: Arc<OneSided>, op: Op, access: PeerAccess, done: Done) {
    let (write, local, local_offset, remote, remote_offset, len, verify, placed_crc) = match op {
        Op::Write { local, local_offset, remote, remote_offset, len, verify, placed_crc } => {
            (true, local, local_offset, remote, remote_offset, len, verify, placed_crc)
        }
        Op::Read { local, local_offset, remote, remote_offset, len, verify } => {
            (false, local, local_offset, remote, remote_offset, len, verify, false)
        }
        Op::Send { .. } => return,
    };
    let m = Move { peer: s.peer, write, local: &local, local_offset, remote_offset, len, crc: placed_crc };
    let placed = match os.engine.transfer(&access, m).await {
        Ok(placed) => placed,
        Err(e) => {
            s.finish_op(done, Err(e));
            return;
        }
    };
    if write {
        s.stats.tx(len);
        // SAFETY: the initiator's source range is its own for the operation (region contract).
        let crc = if verify { unsafe { local.crc32(local_offset, len) }.ok() } else { None };
        s.post_written(done, remote, remote_offset, len, crc, placed);
    } else {
        s.stats.rx(len);
        s.finish_op(done, Ok(Completion::moved(len)));
    }
}
