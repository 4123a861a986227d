//! An instance's copy of its model's parameters, as the multicast sees it: held (complete: it can
//! be lent as a run's source) or arriving (a run fills it; its verified layers can be read).
//! Shared by every kind of instance that scales out by multicast.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cascade_multicast::cluster::MulticastNode;
use cascade_multicast::Loc;
use cascade_param_pool::manifest::Manifest;
use cascade_transport::{Mesh, Prefault, Region};
use tracing::{debug, warn};

use super::compute::{Cmd, Compute};
use super::{ServeError, Source};
use crate::Staged;

/// The copy and the node's multicast service.
pub(crate) struct Copy {
    held: Mutex<Option<Region>>,
    multicast: Arc<MulticastNode>,
    node: u32,
}

impl Copy {
    /// The copy on `mesh`'s node that `source` gives. An arriving copy of `bytes` has its region
    /// allocated now, its pages faulted in on a thread of their own while the instance waits,
    /// and set aside for the run that will fill it ([`MulticastNode::reserve_target`]); when
    /// that fails (the node's memory limit), the run allocates it as before.
    pub(crate) fn new(source: Source, multicast: Arc<MulticastNode>, mesh: &dyn Mesh, bytes: u64) -> Copy {
        let node = mesh.node();
        let held = match source {
            Source::Held(region) => Some(region),
            Source::Arriving => {
                let reserved = mesh
                    .alloc_prefault(bytes, Prefault::Background)
                    .and_then(|r| multicast.reserve_target(Loc::host(node), r));
                if let Err(e) = reserved {
                    warn!(node, bytes, error = %e, "cannot set the arriving copy's region aside; the scale-out will allocate it");
                }
                None
            }
        };
        Copy { held: Mutex::new(held), multicast, node }
    }

    /// Has `compute` build every stage at once from a held copy of `bytes` (an arriving copy's
    /// stages come with its `LayerReady` events instead).
    pub(crate) fn build_held<T: Send + 'static, M: Staged>(
        &self,
        bytes: u64,
        compute: &Compute<T, M>,
    ) -> Result<(), ServeError> {
        if let Some(image) = self.held_image(bytes)? {
            compute.send(Cmd::Verified(image));
        }
        Ok(())
    }

    fn held_lock(&self) -> std::sync::MutexGuard<'_, Option<Region>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The complete copy's first `bytes` (`None` while it arrives).
    fn held_image(&self, bytes: u64) -> Result<Option<Bytes>, ServeError> {
        match &*self.held_lock() {
            // SAFETY: a held copy is complete and only read while it serves: the pool and the
            // multicast (as a lent source) never write a copy they hold.
            Some(r) => Ok(Some(unsafe { r.view(0, bytes) }?)),
            None => Ok(None),
        }
    }

    /// Lends the complete copy to multicast run `run`, controlled by `controller`.
    pub(crate) fn lend(&self, run: u32, controller: u32) -> Result<(), ServeError> {
        let region = self.held_lock().clone().ok_or_else(|| ServeError::Protocol("no complete copy to lend".into()))?;
        self.multicast.lend(run, Loc::host(self.node), region, controller)?;
        Ok(())
    }

    /// Takes the copy run `run` filled here out of the run and holds it.
    pub(crate) fn adopt(&self, run: u32) -> Result<(), ServeError> {
        // Every LayerReady of the run came before this request on the same link: stages built
        // from the region hold views of it, which stay valid after it leaves the run.
        let region = self.multicast.detach(run, Loc::host(self.node))?;
        *self.held_lock() = Some(region);
        Ok(())
    }

    /// The arriving copy's bytes through manifest layer `layer`, every chunk of them verified
    /// (`LayerReady{run, layer}`); `None` (logged) when there is nothing to read.
    pub(crate) fn arrived(&self, manifest: &Manifest, run: u32, layer: u32) -> Option<Bytes> {
        if self.held_lock().is_some() {
            debug!(run, layer, "LayerReady for an instance whose copy is held");
            return None;
        }
        let Some(l) = manifest.layers.get(layer as usize) else {
            warn!(run, layer, "LayerReady for a layer the model does not have");
            return None;
        };
        let image = self.multicast.region(run, Loc::host(self.node)).and_then(|r| {
            // SAFETY: LayerReady{layer} means every chunk of layers 0..=layer is crc-verified on
            // this node, and the run writes a verified chunk again only to re-send the same bytes
            // after a re-plan (see the module docs of `serve`).
            unsafe { r.view(0, l.range.end) }
        });
        match image {
            Ok(b) => Some(b),
            Err(e) => {
                warn!(run, layer, error = %e, "cannot read the arriving copy");
                None
            }
        }
    }
}
