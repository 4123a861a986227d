//! The granting side of a pairing: the activation region this instance registers for each peer
//! that hands split batches over to it, and which slots a job is reading.
//!
//! Every `Pair` gets a region of its own. A peer pairs again only when it no longer trusts its
//! pairing (a hand-over timed out, its link went, it restarted); its old region is withdrawn at
//! once, so a WRITE still in flight into it is refused and a `Finish` naming it is not computed
//! — whatever order the late messages arrive in. Jobs never read a region after their `Finish`
//! (the activation is copied out first), so withdrawing it under them is safe.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Mutex;

use cascade_transport::{Mesh, Region};

use super::lock;
use crate::serve::{ExecMsg, ServeError};
use crate::Activation;

/// Activation slots this instance granted its peers.
#[derive(Default)]
pub(super) struct Grants {
    /// Each peer's current region and the slots granted in it.
    regions: Mutex<HashMap<u32, (Region, Range<u32>)>>,
    /// (region id, slot) whose batch is being served: from its `Finish` until the answer to it.
    busy: Mutex<BTreeSet<(u32, u32)>>,
}

/// A slot whose batch is being served, to [`Grants::release`] once it is answered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    region: u32,
    slot: u32,
}

impl Grants {
    /// Grants `from` slots (`want`, at most `cap`, of `slot_bytes` each) in a new activation
    /// region, withdrawing the one it had.
    pub(super) fn grant(
        &self,
        mesh: &dyn Mesh,
        from: u32,
        want: u32,
        cap: u32,
        slot_bytes: u64,
    ) -> Result<ExecMsg, ServeError> {
        let range = 0..want.clamp(1, cap);
        // Faulted in by a thread of its own: this runs on the request loop.
        let r = mesh.register_new_background(slot_bytes * u64::from(range.end))?;
        if let Some((old, _)) = lock(&self.regions).insert(from, (r.clone(), range.clone())) {
            mesh.deregister(old.id());
        }
        Ok(ExecMsg::Paired {
            region: r.id().0,
            key: r.key().0,
            len: r.len(),
            first: range.start,
            slots: range.end - range.start,
            slot_bytes,
        })
    }

    /// The activation `from` WROTE into `slot` of `region` (`len` bytes, crc32 `crc`), copied
    /// out; the slot stays busy until [`Grants::release`].
    pub(super) fn take(
        &self,
        from: u32,
        (region, slot): (u32, u32),
        (len, crc): (u64, u32),
        slot_bytes: u64,
    ) -> Result<(Activation, Held), ServeError> {
        let r = lock(&self.regions).get(&from).map(|(r, range)| (r.clone(), range.clone()));
        let Some((r, range)) = r else {
            return Err(ServeError::Protocol(format!("node {from} holds no slots here")));
        };
        if r.id().0 != region {
            return Err(ServeError::Protocol(format!(
                "a Finish for node {from}'s region {region}, which it paired again since (now {})",
                r.id().0
            )));
        }
        if !range.contains(&slot) || len > slot_bytes {
            return Err(ServeError::Protocol(format!("slot {slot} ({len} bytes) is not node {from}'s")));
        }
        if !lock(&self.busy).insert((region, slot)) {
            return Err(ServeError::Protocol(format!("slot {slot} of node {from} is already being served")));
        }
        let held = Held { region, slot };
        match read_slot(&r, slot, slot_bytes, len, crc) {
            Ok(act) => Ok((act, held)),
            Err(e) => {
                self.release(held);
                Err(e)
            }
        }
    }

    /// The slot is no longer being served: its peer may write it again once answered.
    pub(super) fn release(&self, held: Held) {
        lock(&self.busy).remove(&(held.region, held.slot));
    }

    /// Withdraws every granted region from the peers (the instance stops); a WRITE into one is
    /// refused from now on.
    pub(super) fn withdraw(&self, mesh: &dyn Mesh) {
        for (_, (r, _)) in lock(&self.regions).drain() {
            mesh.deregister(r.id());
        }
    }
}

/// The activation a peer wrote into `slot` of its region `r` (slots of `sb` bytes), checked
/// against the crc its Finish carries.
fn read_slot(r: &Region, slot: u32, sb: u64, len: u64, crc: u32) -> Result<Activation, ServeError> {
    // SAFETY: the region is one peer's alone (one pairing's), and slot `slot` is marked busy
    // for it: that peer WRITEs the slot only between our answer to its previous Finish on it and
    // its next Finish; it posted this Finish behind its WRITE, which the link delivers after the
    // bytes are placed, and we answer only after the bytes are copied out.
    let bytes = unsafe { r.view(u64::from(slot) * sb, len) }?;
    let got = crc32fast::hash(&bytes);
    if got != crc {
        return Err(ServeError::Protocol(format!(
            "the activation in slot {slot} has crc32 {got:#010x}, not {crc:#010x}: its WRITE did not land"
        )));
    }
    Ok(Activation::from_bytes(&bytes)?)
}
