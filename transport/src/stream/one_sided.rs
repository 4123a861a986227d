//! Posting operations one-sidedly through the link's engine (see `crate::onesided`).

use std::sync::Arc;

use super::Shared;
use crate::link::{Completion, Done, Op, OpHandle};
use crate::onesided::{Move, OneSided, PeerAccess};

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
                match s.request_access(remote.id, remote.key, os.engine.clone()).await {
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
async fn transfer(s: Arc<Shared>, os: Arc<OneSided>, op: Op, access: PeerAccess, done: Done) {
    let (write, local, local_offset, remote, remote_offset, len, verify) = match op {
        Op::Write { local, local_offset, remote, remote_offset, len, verify } => {
            (true, local, local_offset, remote, remote_offset, len, verify)
        }
        Op::Read { local, local_offset, remote, remote_offset, len, verify } => {
            (false, local, local_offset, remote, remote_offset, len, verify)
        }
        Op::Send { .. } => return,
    };
    let m = Move { peer: s.peer, write, local: &local, local_offset, remote_offset, len };
    let moved = os.engine.transfer(&access, m).await;
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
