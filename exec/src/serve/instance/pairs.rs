//! The asking side of a pairing: the slots this instance holds in its peers' activation regions,
//! and the hand-over of a split batch's activation into one of them.
//!
//! A pairing is renewed when it can no longer be trusted: the peer refused a WRITE into its
//! region (it restarted, or renewed the pairing itself), the link to it went, or every slot was
//! taken out of use by hand-overs that failed. Renewing asks the peer again; it answers with a
//! new region and withdraws the old one ([`super::grants`]), so hand-overs still in flight on
//! the old pairing can neither land in nor be computed from the new one. Before, a pair that
//! had lost its slots made every later split batch wait for a slot forever, and one whose peer
//! restarted failed every split batch for good.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cascade_transport::wire::Status;
use cascade_transport::{Mesh, Op, Region, RemoteKey, RemoteRegion, ServiceExt, TransportError};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::lock;
use crate::serve::{ExecMsg, ServeError};

/// Slots held in one peer's activation region: one pairing.
struct PeerSlots {
    remote: RemoteRegion,
    /// The local region the activations are written from, one slot per granted slot.
    staging: Region,
    first: u32,
    slots: u32,
    slot_bytes: u64,
    free: Mutex<Vec<u32>>,
    /// One permit per usable slot: a hand-over holds one from taking its slot until it gives
    /// it back. Closed when the pairing is no longer trusted (stale): no hand-over waits on it,
    /// and the next one renews it.
    permits: Semaphore,
    /// Slots out of use after a hand-over that failed but may still be landing.
    retired: AtomicU32,
}

impl PeerSlots {
    fn go_stale(&self) {
        self.permits.close();
    }

    fn is_stale(&self) -> bool {
        self.permits.is_closed()
    }
}

type Cell = Arc<tokio::sync::Mutex<Option<Arc<PeerSlots>>>>;

/// This instance's pairings, by peer.
#[derive(Default)]
pub(super) struct Pairs {
    by_peer: Mutex<HashMap<u32, Cell>>,
    /// Set when the instance stops: no pairing is made any more.
    closed: AtomicBool,
}

/// What a hand-over asks of [`Pairs`].
pub(super) struct Ask {
    /// The peer.
    pub(super) then: u32,
    /// Slots to ask for when pairing.
    pub(super) slots: u32,
    /// Limit on each call and WRITE.
    pub(super) limit: Duration,
}

impl Pairs {
    /// The pairing with `ask.then`: the one held, or a new one (renewing a stale one).
    async fn get(&self, mesh: &dyn Mesh, ask: &Ask) -> Result<Arc<PeerSlots>, ServeError> {
        let cell = lock(&self.by_peer).entry(ask.then).or_default().clone();
        let mut held = cell.lock().await;
        if let Some(p) = held.as_ref().filter(|p| !p.is_stale()) {
            return Ok(p.clone());
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(ServeError::Stopped);
        }
        if let Some(old) = held.take() {
            // Hand-overs still on the old pairing fail on their own: the peer withdraws its
            // region when it answers the new Pair. Their WRITEs read the staging region locally.
            mesh.deregister(old.staging.id());
            debug!(peer = ask.then, "pairing renewed");
        }
        let answer = mesh.call(ask.then, &ExecMsg::Pair { slots: ask.slots }, ask.limit).await?;
        let ExecMsg::Paired { region, key, len, first, slots, slot_bytes } = answer else {
            return Err(ServeError::Protocol(format!("pairing with node {}: {answer:?}", ask.then)));
        };
        let slots = slots.min(ask.slots);
        if slots == 0 {
            return Err(ServeError::Protocol(format!("node {} granted no slot", ask.then)));
        }
        let staging = mesh.register_new_background(slot_bytes * u64::from(slots))?;
        let remote = RemoteRegion { node: ask.then, id: cascade_transport::RegionId(region), key: RemoteKey(key), len };
        let p = Arc::new(PeerSlots {
            remote,
            staging,
            first,
            slots,
            slot_bytes,
            free: Mutex::new((first..first + slots).rev().collect()),
            permits: Semaphore::new(slots as usize),
            retired: AtomicU32::new(0),
        });
        *held = Some(p.clone());
        Ok(p)
    }

    /// Pairs with `ask.then` now, before a split batch needs it.
    pub(super) async fn pair(&self, mesh: &dyn Mesh, ask: &Ask) -> Result<(), ServeError> {
        self.get(mesh, ask).await.map(|_| ())
    }

    /// WRITEs `bytes` (a split batch's activation) into a free slot of `ask.then`'s and, behind
    /// it, asks `ask.then` to go on with the `Finish` that `finish` makes for that (region,
    /// slot); the answer. A WRITE the peer refused (it lost the pairing) is tried once more on a
    /// renewed one.
    pub(super) async fn hand_over(
        &self,
        mesh: &dyn Mesh,
        ask: &Ask,
        bytes: &[u8],
        finish: impl Fn(u32, u32) -> ExecMsg,
    ) -> Result<ExecMsg, ServeError> {
        let mut refused_once = false;
        // A pairing found stale between its lookup and its use costs a turn; three are plenty.
        for _ in 0..3 {
            let peer = self.get(mesh, ask).await?;
            if bytes.len() as u64 > peer.slot_bytes {
                return Err(ServeError::Input(format!("an activation of {} bytes exceeds a slot", bytes.len())));
            }
            let Ok(permit) = peer.permits.acquire().await else { continue };
            let Some(slot) = lock(&peer.free).pop() else {
                peer.go_stale();
                continue;
            };
            let msg = finish(peer.remote.id.0, slot);
            match write_and_finish(mesh, &peer, slot, bytes, &msg, ask.limit).await {
                Ok(answer) => {
                    lock(&peer.free).push(slot);
                    return Ok(answer);
                }
                Err(e) => {
                    let refused =
                        matches!(e, TransportError::Refused { status: Status::UnknownRegion | Status::BadKey, .. });
                    // A WRITE or Finish that failed may still be landing or being read on the peer:
                    // the slot is not written again on this pairing.
                    permit.forget();
                    let retired = peer.retired.fetch_add(1, Ordering::AcqRel) + 1;
                    if refused || !mesh.connected_to(ask.then) || retired >= peer.slots {
                        peer.go_stale();
                        warn!(peer = ask.then, error = %e, "hand-over failed; the pairing will be renewed");
                    } else {
                        warn!(peer = ask.then, slot, retired, error = %e, "activation slot retired after a failed hand-over");
                    }
                    if refused && !refused_once {
                        refused_once = true;
                        continue;
                    }
                    return Err(e.into());
                }
            }
        }
        Err(ServeError::Peer(format!("no usable pairing with node {}", ask.then)))
    }

    /// Withdraws the staging regions of every pairing and makes no more (the instance stops).
    /// A pairing being made now is waited for (its call's time limit at most), then withdrawn;
    /// hand-overs on a pairing already made go on (their WRITEs read the staging region
    /// locally).
    pub(super) async fn withdraw(&self, mesh: &dyn Mesh) {
        self.closed.store(true, Ordering::Release);
        let cells: Vec<Cell> = lock(&self.by_peer).drain().map(|(_, c)| c).collect();
        for cell in cells {
            if let Some(p) = cell.lock().await.take() {
                mesh.deregister(p.staging.id());
            }
        }
    }
}

async fn write_and_finish(
    mesh: &dyn Mesh,
    peer: &PeerSlots,
    slot: u32,
    bytes: &[u8],
    finish: &ExecMsg,
    limit: Duration,
) -> Result<ExecMsg, TransportError> {
    let idx = u64::from(slot - peer.first);
    let local_off = idx * peer.slot_bytes;
    // SAFETY: staging slot `idx` is this task's (it took the slot from the free list), and the
    // WRITE that last read it completed before the slot went back on the list.
    unsafe { peer.staging.write_local(local_off, bytes) }?;
    let len = bytes.len() as u64;
    let op = Op::write(&peer.staging, local_off, peer.remote, u64::from(slot) * peer.slot_bytes, len);
    let t0 = std::time::Instant::now();
    // The WRITE and, right behind its bytes, the request to finish the batch: one round trip.
    let answer = mesh.call_after(peer.remote.node, vec![op], finish, limit).await?;
    debug!(peer = peer.remote.node, len, ms = t0.elapsed().as_secs_f64() * 1e3, "hand-over");
    Ok(answer)
}
