//! The regions an instance grants its peers: its KV pages (a decode instance) and room for the
//! adapter images migrations bring.
//!
//! No region's pages are faulted in on the runtime's workers: pre-faulting the KV region (188 MB
//! for SmolLM2 at the defaults) held a worker for 1.8–3 s on the 2-core development machine, the
//! node's links sent no keepalive meanwhile, and its peers declared it down — the router then
//! redid every request the instance held. The KV region is mapped at once and pre-faulted on a
//! thread of its own while it is already granted (`Mesh::register_new_background`: pages are
//! reserved from the front and faulted from the back), so a mutation is answered without
//! waiting for it; adapter rooms are allocated whole on a blocking thread
//! ([`register_new_blocking`]).

use std::sync::Arc;

use cascade_transport::{register_new_blocking, Region};

use super::{lock, Shared};
use crate::pd::kv::Pages;
use crate::pd::proto::{KvGrant, LlmMsg, RegionGrant, Role};
use crate::serve::ServeError;

/// The KV region and its pages in `slot` (the instance's `kv`, locked), allocated there first
/// unless they exist. Quick: the region is mapped, not faulted in (see the module's docs).
pub(super) fn ensure_kv<'a>(
    sh: &Shared,
    slot: &'a mut Option<(Region, Pages)>,
) -> Result<&'a mut (Region, Pages), ServeError> {
    match slot {
        Some(kv) => Ok(kv),
        None => {
            let len = sh.layout.page_bytes() * u64::from(sh.cfg.kv_pages);
            let region = sh.mesh.register_new_background(len)?;
            Ok(slot.insert((region, Pages::new(sh.cfg.kv_pages))))
        }
    }
}

/// Reserves `req`'s pages for `from` (its router: when its link fails they are freed, see
/// `decode::drop_lost_routers`).
pub(super) fn reserve(sh: &Shared, from: u32, req: u64, tokens: u32) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Decode {
        return Err(ServeError::Peer("not a decode instance".into()));
    }
    // A request whose prompt and output would pass the model's positions is refused here, for
    // itself: admitted, it would fail the decode step of every request batched with it there.
    // Its last output token is never fed back, so `tokens − 1` positions are needed.
    let window = sh.model.config.max_position_embeddings;
    if tokens as usize > window + 1 {
        return Err(ServeError::Input(format!(
            "{tokens} tokens of prompt and output need {} positions; the model's context window is {window}",
            tokens - 1
        )));
    }
    // A decode instance from the start maps its region at its first reservation.
    let mut kv = lock(&sh.kv);
    let (region, pages) = ensure_kv(sh, &mut kv)?;
    if pages.requests() >= sh.cfg.max_running {
        return Err(ServeError::Peer(format!("{} requests hold KV here already", sh.cfg.max_running)));
    }
    let n = sh.layout.pages_for(tokens as usize);
    if n > sh.cfg.kv_pages as usize {
        return Err(ServeError::Input(format!(
            "{tokens} tokens need {n} KV pages; an instance has {}",
            sh.cfg.kv_pages
        )));
    }
    let (lease, got) = pages.reserve(req, from, n).ok_or_else(|| match pages.lease_of(req) {
        Some(_) => ServeError::Peer(format!("request {req} holds KV pages here already")),
        None => ServeError::Peer(format!("{n} KV pages wanted, {} free", pages.available())),
    })?;
    let (node, region, key, len) = (sh.mesh.node(), region.id().0, region.key().0, region.len());
    Ok(LlmMsg::Reserved { grant: KvGrant { node, region, key, len, pages: got, lease } })
}

/// Room for adapter `adapter`'s image, unless it is served here already (`Ack`). A grant no
/// migration used yet (one that failed) is reused when large enough.
pub(super) async fn reserve_adapter(sh: &Arc<Shared>, adapter: u32, bytes: u64) -> Result<LlmMsg, ServeError> {
    if adapter == 0 || lock(&sh.adapters).contains(&adapter) {
        return Ok(LlmMsg::Ack);
    }
    if bytes == 0 || bytes > 1 << 30 {
        return Err(ServeError::Input(format!("an adapter image of {bytes} bytes")));
    }
    let fits = |granted: &std::collections::HashMap<u32, cascade_transport::Region>| {
        granted.get(&adapter).filter(|r| r.len() >= bytes).map(|r| grant_of(sh, r))
    };
    if let Some(grant) = fits(&lock(&sh.adapter_in)) {
        return Ok(LlmMsg::AdapterGrant { grant });
    }
    let new = register_new_blocking(sh.mesh.clone(), bytes).await?;
    let mut granted = lock(&sh.adapter_in);
    // Another reservation of the same adapter may have been granted meanwhile.
    if let Some(grant) = fits(&granted) {
        sh.mesh.deregister(new.id());
        return Ok(LlmMsg::AdapterGrant { grant });
    }
    let grant = grant_of(sh, &new);
    if let Some(old) = granted.insert(adapter, new) {
        sh.mesh.deregister(old.id());
    }
    Ok(LlmMsg::AdapterGrant { grant })
}

/// The grant a peer WRITEs an adapter image into `r` with.
fn grant_of(sh: &Shared, r: &cascade_transport::Region) -> RegionGrant {
    RegionGrant { node: sh.mesh.node(), region: r.id().0, key: r.key().0, len: r.len() }
}
