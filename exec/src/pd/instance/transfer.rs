//! KV and adapter transfers between LLM instances: a prefill's (or a migration's) KV, WRITTEN
//! into a decode instance's pages, the decode instance's checked take-over of it, and the
//! hand-over of a decoding request with its adapter (co-migration).

use std::ops::Range;
use std::sync::Arc;

use cascade_transport::{register_new_blocking, Mesh, NodeId, Op, Region, RemoteKey, RemoteRegion, ServiceExt};
use tracing::{debug, warn};

use super::{failed, install_adapter, lock, release, retire, with_model, Handover, Seq, Shared};
use crate::llama::LoraAdapter;
use crate::pd::proto::{KvGrant, LlmMsg, Role, Written};
use crate::serve::ServeError;
use crate::ExecError;

/// WRITEs the cached KV of sequence `seq` (a prefill's, or a decoding request's) of `blocks`
/// into its pages on the decode instance, every block's pages in one batch; the crc32 of each
/// block's pages as written, in block order.
pub(super) async fn move_kv(
    sh: &Arc<Shared>,
    seq: u64,
    blocks: Range<usize>,
    kv: &KvGrant,
) -> Result<Vec<u32>, ServeError> {
    let mut staged = stage_kv(sh, seq, blocks, kv).await?;
    let crcs = std::mem::take(&mut staged.crcs);
    staged.wait(sh).await?;
    Ok(crcs)
}

/// A sequence's KV copied out of the model's cache into a staging region of its own, ready to
/// go: the WRITEs into the decode instance's pages and each block's crc32. The region is this
/// move's alone until [`post`](StagedKv::post) has seen every WRITE complete; then it becomes
/// the instance's spare for the next move. Dropped otherwise (a failed move, a cancelled
/// task), it deregisters the region.
pub(super) struct StagedKv {
    mesh: Arc<dyn Mesh>,
    /// `None` when there is nothing to write, or once kept as the spare.
    region: Option<Region>,
    node: NodeId,
    ops: Vec<Op>,
    /// The crc32 of each block's pages as written, in block order.
    pub(super) crcs: Vec<u32>,
    started: std::time::Instant,
}

/// Copies the cached KV of sequence `seq` of `blocks` into the staging region (the model's cache
/// entry may be freed once this returns) and builds the WRITEs of it into `kv`'s pages.
pub(super) async fn stage_kv(
    sh: &Arc<Shared>,
    seq: u64,
    blocks: Range<usize>,
    kv: &KvGrant,
) -> Result<StagedKv, ServeError> {
    let started = std::time::Instant::now();
    let nb = blocks.len();
    let layout = sh.layout;
    let range = blocks.clone();
    let images = with_model(sh, move |m| -> Result<Vec<Vec<Vec<u8>>>, ExecError> {
        let cache = m.cache();
        range
            .map(|b| {
                let (k, v) = cache.get(seq, b).ok_or(ExecError::NotResident { layer: b + 1 })?;
                let tokens = k.dim(2)?;
                (0..layout.pages_for(tokens)).map(|i| layout.page_image(&k, &v, i)).collect()
            })
            .collect()
    })
    .await??;
    let per_block = images.first().map_or(0, Vec::len);
    if per_block > kv.pages.len() {
        return Err(ServeError::Input(format!("{per_block} pages of KV, {} granted", kv.pages.len())));
    }
    let bp = layout.block_page_bytes();
    // Built first, so that an error below deregisters the region it took.
    let mut staged = StagedKv {
        mesh: sh.mesh.clone(),
        region: None,
        node: kv.node,
        ops: Vec::with_capacity(nb * per_block),
        crcs: Vec::with_capacity(nb),
        started,
    };
    if nb > 0 {
        // Every block's pages at once, sized for the longest prompt in every block; a migrated
        // request's KV can be longer, and grows it.
        let need = (per_block.max(layout.pages_for(sh.cfg.max_prompt as usize)) * layout.blocks.max(nb)) as u64 * bp;
        let st = staged.region.insert(take_staging(sh, need).await?).clone();
        let remote = RemoteRegion {
            node: kv.node,
            id: cascade_transport::RegionId(kv.region),
            key: RemoteKey(kv.key),
            len: kv.len,
        };
        for (j, (b, pages)) in blocks.zip(images).enumerate() {
            if pages.len() != per_block {
                return Err(ServeError::Protocol(format!(
                    "block {b}: {} pages of KV, block 0 {per_block}",
                    pages.len()
                )));
            }
            let mut crc = crc32fast::Hasher::new();
            for (i, img) in pages.iter().enumerate() {
                crc.update(img);
                let at = (j * per_block + i) as u64 * bp;
                // SAFETY: the staging region is this move's alone: taken out of the instance's
                // spare (or new), it goes back only after every WRITE posted from it completed
                // (`StagedKv::post`; a region whose WRITEs did not all complete is discarded),
                // and no peer may write it (it is never granted to one).
                unsafe { st.write_local(at, img) }?;
                staged.ops.push(Op::write(&st, at, remote, layout.offset(kv.pages[i], b), bp));
            }
            staged.crcs.push(crc.finalize());
        }
    }
    Ok(staged)
}

/// A registered staging region of at least `need` bytes for one move: the instance's spare
/// when it is large enough (a smaller one is deregistered), otherwise a new one. Two moves at
/// once each get their own.
async fn take_staging(sh: &Shared, need: u64) -> Result<Region, ServeError> {
    let spare = lock(&sh.staging).take();
    match spare {
        Some(r) if r.len() >= need => Ok(r),
        small => {
            if let Some(r) = small {
                sh.mesh.deregister(r.id());
            }
            Ok(register_new_blocking(sh.mesh.clone(), need).await?)
        }
    }
}

/// Keeps `region` as the instance's spare staging region, unless the spare it has is at least as
/// large (one of the two is deregistered).
fn keep_staging(sh: &Shared, region: Region) {
    let mut spare = lock(&sh.staging);
    let (keep, other) = match spare.take() {
        Some(old) if old.len() >= region.len() => (old, Some(region)),
        old => (region, old),
    };
    *spare = Some(keep);
    if let Some(r) = other {
        sh.mesh.deregister(r.id());
    }
}

impl Drop for StagedKv {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.mesh.deregister(region.id());
        }
    }
}

impl StagedKv {
    /// Posts the WRITEs in one batch and waits for every one, even after one failed.
    pub(super) async fn wait(self, sh: &Arc<Shared>) -> Result<(), ServeError> {
        self.finish(sh, None).await.map(drop)
    }

    /// Posts the WRITEs and `msg` behind them in one batch — the decode instance takes `msg`
    /// after their bytes were placed, with no round trip between the two — and returns its
    /// answer.
    pub(super) async fn call(self, sh: &Arc<Shared>, msg: &LlmMsg) -> Result<LlmMsg, ServeError> {
        let answer = self.finish(sh, Some(msg)).await?;
        answer.ok_or_else(|| ServeError::Protocol("no answer".into()))
    }

    /// [`wait`](Self::wait), or [`call`](Self::call) with `then`. The region becomes the
    /// instance's spare only when every WRITE completed (and the answer came); after a failure
    /// it is discarded — an abandoned WRITE may still read it (the WRITE holds the memory; only
    /// the registration goes) — and the next move registers another.
    async fn finish(mut self, sh: &Arc<Shared>, then: Option<&LlmMsg>) -> Result<Option<LlmMsg>, ServeError> {
        let (ops, node, limit) = (std::mem::take(&mut self.ops), self.node, sh.cfg.op_timeout);
        let n = ops.len();
        let result = match then {
            // `call_after` waits for the WRITEs before the answer, within the time limit.
            Some(msg) if node != sh.mesh.node() => sh.mesh.call_after(node, ops, msg, limit).await.map(Some),
            _ => {
                async {
                    let mut failed = None;
                    for h in sh.mesh.link(node)?.post(ops) {
                        if let Err(e) = h.wait("KV write", limit).await {
                            failed.get_or_insert(e);
                        }
                    }
                    if let Some(e) = failed {
                        return Err(e);
                    }
                    match then {
                        Some(msg) => sh.mesh.call(node, msg, limit).await.map(Some),
                        None => Ok(None),
                    }
                }
                .await
            }
        };
        if result.is_ok() {
            if let Some(region) = self.region.take() {
                keep_staging(sh, region);
            }
        }
        // Otherwise dropping `self` deregisters the region.
        let ms = self.started.elapsed().as_secs_f64() * 1e3;
        debug!(writes = n, ms, node, with_request = then.is_some(), "KV moved");
        Ok(result?)
    }
}

/// Takes a request's KV out of its pages into the model's cache and starts decoding it: after
/// its prefill (`Start`: the prompt's KV, the first token) or a migration (`Resume`: the KV so
/// far, and the adapter's image in its granted region when `adapter_image` is given). The KV
/// must be in the pages of reservation `seq.lease`, each block's bytes matching `crcs`, and the
/// adapter's image must match its crc.
pub(super) async fn admit(
    sh: &Arc<Shared>,
    seq: Seq,
    crcs: &[u32],
    adapter_image: Option<Written>,
) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Decode {
        return Err(ServeError::Peer("not a decode instance".into()));
    }
    if lock(&sh.running).len() >= sh.cfg.max_running {
        return Err(ServeError::Peer(format!("{} requests decoding already", sh.cfg.max_running)));
    }
    if let Some(Err(e)) = seq.sample.map(|s| s.sampling.check()) {
        return Err(ServeError::Input(e.to_string()));
    }
    let (req, lease) = (seq.req, seq.lease);
    let images = take_kv(sh, req, lease, seq.pos as usize, crcs)?;
    let started = async {
        // One sequence per request in a decode step (its cache is keyed by the request). The
        // leases already see to it: an attempt given up on that still decodes here holds its
        // pages until it stops, so no other reservation of the request is granted before.
        if lock(&sh.running).iter().any(|s| s.req == req) {
            return Err(ServeError::Protocol(format!("request {req} is decoding here already")));
        }
        if let Some(Written { bytes: n, crc }) = adapter_image {
            let region = lock(&sh.adapter_in)
                .remove(&seq.adapter)
                .ok_or_else(|| ServeError::Protocol(format!("no region was granted for adapter {}", seq.adapter)))?;
            if n > region.len() {
                return Err(ServeError::Input(format!("an adapter image of {n} bytes in {} granted", region.len())));
            }
            // SAFETY: the region was registered for this adapter's images alone and the old
            // instance's WRITE of this one completed before it sent Resume. An earlier migration's
            // writer that gave up on its WRITE may still land it (a failed migration's grant is
            // reused): the bytes are copied at once, the view dropped, and only the copy,
            // checked against the crc, is read.
            let image = unsafe { region.view(0, n) }?.to_vec();
            sh.mesh.deregister(region.id());
            let got = crc32fast::hash(&image);
            if got != crc {
                refused(sh, "adapter");
                return Err(ServeError::Peer(format!(
                    "adapter {}'s image holds other bytes than were written (crc {got:#010x}, written {crc:#010x})",
                    seq.adapter
                )));
            }
            install_adapter(sh, seq.adapter, LoraAdapter::from_image(&image, &sh.model.config)?).await?;
        }
        if seq.adapter != 0 && !lock(&sh.adapters).contains(&seq.adapter) {
            return Err(ServeError::Peer(format!("adapter {} is not served here", seq.adapter)));
        }
        let (layout, tokens) = (sh.layout, seq.pos as usize);
        with_model(sh, move |m| -> Result<(), ExecError> {
            let mut cache = m.cache();
            for (b, pages) in images.iter().enumerate() {
                let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
                let (k, v) = layout.tensors(&refs, tokens)?;
                cache.put(req, b, k, v);
            }
            Ok(())
        })
        .await??;
        Ok(())
    }
    .await;
    if let Err(e) = started {
        release(sh, req, lease);
        return Err(e);
    }
    // Under the lock the decode loop's shut-down takes the running set with: a request admitted
    // before the stop is there to be aborted; one after it is refused, its pages and cache freed.
    let stopping = {
        let mut running = lock(&sh.running);
        let stopping = *sh.stop.borrow();
        if !stopping {
            running.push(seq);
        }
        stopping
    };
    if stopping {
        retire(sh, req, lease).await;
        return Err(ServeError::Stopped);
    }
    sh.wake.notify_one();
    Ok(LlmMsg::Ack)
}

/// Counts a `Start` or `Resume` refused for `reason`: `stale` (a lease the request no longer
/// holds), `foreign` (KV pages holding other bytes than were written), `adapter` (the same of an
/// adapter's image).
fn refused(sh: &Shared, reason: &str) {
    let help = "Starts and resumes refused: a stale lease, or bytes other than the writer wrote";
    sh.mesh.metrics().counter("cascade_llm_kv_refused", help, &[("reason", reason)]).inc();
}

/// Starts reservation `lease` of `req` and copies its KV for `tokens` tokens out of its pages,
/// every block's pages, checked against the writer's `crcs`. The reservation is released when
/// the bytes do not match: foreign bytes (an abandoned writer's late WRITE into a page freed and
/// granted again) make the start fail, to be redone, instead of being decoded from.
fn take_kv(sh: &Shared, req: u64, lease: u64, tokens: usize, crcs: &[u32]) -> Result<Vec<Vec<Vec<u8>>>, ServeError> {
    let layout = sh.layout;
    if crcs.len() != layout.blocks {
        return Err(ServeError::Protocol(format!("{} block crcs for {} blocks", crcs.len(), layout.blocks)));
    }
    // The copy and its check run outside the KV lock (the metrics' scrape takes it too).
    let started = {
        let mut kv = lock(&sh.kv);
        let (region, pages) = kv.as_mut().ok_or_else(|| ServeError::Protocol("no KV region".into()))?;
        pages.start(req, lease).map(|mine| (region.clone(), mine))
    };
    let (region, mine) = started.map_err(|e| {
        refused(sh, "stale");
        ServeError::Peer(e.to_string())
    })?;
    let n = layout.pages_for(tokens);
    let mut foreign = false;
    let copied = (|| {
        if n > mine.len() {
            return Err(ServeError::Input(format!("{tokens} tokens of KV in {} pages", mine.len())));
        }
        let mut images = Vec::with_capacity(layout.blocks);
        for (b, &want) in crcs.iter().enumerate() {
            let mut crc = crc32fast::Hasher::new();
            let block = mine[..n]
                .iter()
                .map(|&p| {
                    // SAFETY: the writer of reservation `lease` WROTE these pages and its WRITEs
                    // completed before it sent Start or Resume. A writer of an abandoned
                    // reservation may still WRITE a page freed and granted again: the bytes
                    // (plain f32 data, any value valid) are copied at once, the view dropped,
                    // and only the copy, checked against the crc, is used.
                    let page = unsafe { region.view(layout.offset(p, b), layout.block_page_bytes()) }?.to_vec();
                    crc.update(&page);
                    Ok(page)
                })
                .collect::<Result<Vec<_>, ServeError>>()?;
            let got = crc.finalize();
            if got != want {
                foreign = true;
                return Err(ServeError::Peer(format!(
                    "request {req}: block {b}'s KV pages hold other bytes than were written (crc {got:#010x}, \
                     written {want:#010x})"
                )));
            }
            images.push(block);
        }
        Ok(images)
    })();
    if copied.is_err() {
        release(sh, req, lease);
        if foreign {
            refused(sh, "foreign");
        }
    }
    copied
}

/// Hands `seq` (taken out of the running set between two steps) to the instance that granted
/// `h.kv`: its KV so far by WRITEs; its adapter's image by a WRITE into a region that instance
/// grants when it does not serve the adapter; then `Resume` there. On failure the request
/// decodes here again and nothing of it is lost — unless a stop named it meanwhile (its router
/// gave up on it or was lost): then it ends here, as it would have between two steps.
pub(super) async fn hand_over(sh: Arc<Shared>, seq: Seq, h: Handover) {
    let (req, generated) = (seq.req, seq.generated);
    let result = async {
        let blocks = 0..sh.layout.blocks;
        let crcs = move_kv(&sh, req, blocks, &h.kv).await?;
        let adapter_image = bring_adapter(&sh, seq.adapter, h.kv.node).await?;
        let resume = LlmMsg::Resume {
            req,
            attempt: seq.attempt,
            lease: h.kv.lease,
            crcs,
            pos: seq.pos,
            last: seq.last,
            generated,
            max_tokens: seq.max_tokens,
            router: seq.router,
            adapter: seq.adapter,
            adapter_image,
            sample: seq.sample,
        };
        match sh.mesh.call(h.kv.node, &resume, sh.cfg.op_timeout).await? {
            LlmMsg::Ack => Ok(()),
            other => Err(other.unexpected_from(h.kv.node)),
        }
    }
    .await;
    // Back in the running set unless it moved or a stop named it meanwhile (under the running
    // set's lock, as the decode loop applies stops: none falls between the two).
    let (moved, lease) = (result.is_ok(), seq.lease);
    let stopped = {
        let mut running = lock(&sh.running);
        let mut away = lock(&sh.away);
        let stopped = away.iter().any(|a| a.req == req && a.lease == lease && a.stopped);
        away.retain(|a| !(a.req == req && a.lease == lease));
        if !moved && !stopped {
            running.push(seq);
        }
        stopped
    };
    let answer = match result {
        Ok(()) => {
            retire(&sh, req, lease).await;
            LlmMsg::Migrated { req, tokens: generated }
        }
        Err(e) if stopped => {
            warn!(req, to = h.kv.node, error = %e, "migration failed, and the request was stopped meanwhile");
            retire(&sh, req, lease).await;
            failed(&e)
        }
        Err(e) => {
            warn!(req, to = h.kv.node, error = %e, "migration failed: the request decodes here again");
            sh.wake.notify_one();
            failed(&e)
        }
    };
    let _ = sh.mesh.reply(&h.reply, &answer);
}

/// Brings adapter `id` to node `to` unless it serves it: asks `to` for a region, WRITEs the
/// adapter's image into it; what was written, or `None` when nothing had to move.
async fn bring_adapter(
    sh: &Arc<Shared>,
    id: u32,
    to: cascade_transport::NodeId,
) -> Result<Option<Written>, ServeError> {
    if id == 0 {
        return Ok(None);
    }
    let image = with_model(sh, move |m| -> Result<Vec<u8>, ExecError> {
        m.adapter(id).ok_or_else(|| ExecError::Input(format!("no adapter {id}")))?.to_image()
    })
    .await??;
    let n = image.len() as u64;
    let g = match sh.mesh.call(to, &LlmMsg::ReserveAdapter { adapter: id, bytes: n }, sh.cfg.op_timeout).await? {
        LlmMsg::Ack => return Ok(None),
        LlmMsg::AdapterGrant { grant } => grant,
        other => return Err(other.unexpected_from(to)),
    };
    if n > g.len || g.node != to {
        return Err(ServeError::Protocol(format!("a grant of {} bytes on node {} for {n} on {to}", g.len, g.node)));
    }
    let staging = register_new_blocking(sh.mesh.clone(), n).await?;
    // SAFETY: the region was just registered by this task and no operation uses it yet.
    unsafe { staging.write_local(0, &image) }?;
    let remote =
        RemoteRegion { node: g.node, id: cascade_transport::RegionId(g.region), key: RemoteKey(g.key), len: g.len };
    let written = async {
        for h in sh.mesh.link(g.node)?.post(vec![Op::write(&staging, 0, remote, 0, n)]) {
            h.wait("adapter write", sh.cfg.op_timeout).await?;
        }
        Ok::<(), cascade_transport::TransportError>(())
    }
    .await;
    // Deregistered whether or not the WRITE completed (an abandoned one holds the memory it
    // reads; only the registration goes), so a failed migration leaves no region behind.
    sh.mesh.deregister(staging.id());
    written?;
    Ok(Some(Written { bytes: n, crc: crc32fast::hash(&image) }))
}
