//! An LLM serving instance on a node: the `llm` service (prefill, decode, KV moves, mutation)
//! and the `exec` service's copy control (`Lend`, `Adopt`, `LayerReady`, `Status`), so it scales
//! out by the same multicast as the encoder instances.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cascade_multicast::cluster::MulticastNode;
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Inbox, Mesh, Op, PeerEvent, Region, RemoteKey, RemoteRegion, ReplyTo, ServiceExt};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tracing::{debug, warn};

use super::kv::{KvLayout, Pages};
use super::proto::{KvGrant, LlmMsg, RegionGrant, ReqLoad, Role, Written};
use super::PdModel;
use crate::llama::generate::argmax;
use crate::llama::{Llama, LoraAdapter};
use crate::serve::compute::{Cmd, Compute, Finished};
use crate::serve::copy::Copy;
use crate::serve::{ExecMsg, ServeError, Source};
use crate::{Activation, ExecError};

/// An LLM instance's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlmConfig {
    /// Pages of the KV region (allocated and registered when the instance first decodes).
    pub kv_pages: u32,
    /// Tokens per KV page.
    pub page_tokens: u32,
    /// Longest prompt it prefills (sizes its KV staging region).
    pub max_prompt: u32,
    /// Requests decoding at once at most.
    pub max_running: usize,
    /// Limit on each KV WRITE and each call to a peer.
    pub op_timeout: Duration,
    /// Pin the compute thread to this CPU core.
    pub core: Option<usize>,
}

impl Default for LlmConfig {
    fn default() -> Self {
        LlmConfig {
            kv_pages: 256,
            page_tokens: 16,
            max_prompt: 512,
            max_running: 16,
            op_timeout: Duration::from_secs(30),
            core: None,
        }
    }
}

type Tag = oneshot::Sender<Result<Activation, ExecError>>;

/// A request decoding here.
struct Seq {
    req: u64,
    /// Position of the token fed next.
    pos: u32,
    last: u32,
    /// Tokens of the answer so far (the first included).
    generated: u32,
    max_tokens: u32,
    router: u32,
    /// Its LoRA adapter (0: the base model).
    adapter: u32,
    /// The reservation of its KV pages here.
    lease: u64,
}

/// A `Migrate` waiting for the decode loop to hand its request over between two steps.
struct Handover {
    req: u64,
    kv: KvGrant,
    reply: ReplyTo,
}

struct Shared {
    mesh: Arc<dyn Mesh>,
    model: PdModel,
    cfg: LlmConfig,
    layout: KvLayout,
    compute: Compute<Tag, Llama>,
    copy: Copy,
    role: Mutex<Role>,
    /// The KV region (decode) and its pages.
    kv: Mutex<Option<(Region, Pages)>>,
    /// The staging region KV is written from (prefill), one move at a time.
    staging: tokio::sync::Mutex<Option<Region>>,
    running: Mutex<Vec<Seq>>,
    wake: Notify,
    /// Migrations the decode loop hands over at its next step boundary.
    handovers: Mutex<Vec<Handover>>,
    /// The adapters the model serves (mirrors the compute thread's model).
    adapters: Mutex<std::collections::BTreeSet<u32>>,
    /// Regions granted for adapter images a migration brings, by adapter.
    adapter_in: Mutex<std::collections::HashMap<u32, Region>>,
    /// The last prefill's sequence id (see [`prefill_seq`]).
    prefills: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running LLM instance.
pub struct LlmInstance {
    shared: Arc<Shared>,
}

impl LlmInstance {
    /// Starts the `llm` and `exec` services on `mesh` as a `role` instance of `model`, its
    /// parameters from `source` (see [`crate::serve::Source`]).
    pub fn start(
        mesh: Arc<dyn Mesh>,
        model: PdModel,
        source: Source,
        multicast: Arc<MulticastNode>,
        role: Role,
        cfg: LlmConfig,
    ) -> Result<LlmInstance, ServeError> {
        if cfg.kv_pages == 0 || cfg.page_tokens == 0 || cfg.max_prompt == 0 || cfg.max_running == 0 {
            return Err(ServeError::Config(
                "kv_pages, page_tokens, max_prompt and max_running must be positive".into(),
            ));
        }
        let llm_inbox = mesh.subscribe::<LlmMsg>(DEFAULT_INBOX)?;
        let exec_inbox = mesh.subscribe::<ExecMsg>(DEFAULT_INBOX)?;
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let llama = Llama::new(model.config.clone())?;
        let compute = Compute::start(llama, model.manifest.clone(), done_tx, format!("llm-{}", mesh.node()), cfg.core)
            .map_err(|e| ServeError::Config(format!("cannot start the compute thread: {e}")))?;
        let copy = Copy::new(source, multicast, mesh.node());
        copy.build_held(model.manifest.bytes, &compute)?;
        let layout = KvLayout::new(&model.config, cfg.page_tokens as usize);
        let shared = Arc::new(Shared {
            mesh,
            model,
            cfg,
            layout,
            compute,
            copy,
            role: Mutex::new(role),
            kv: Mutex::new(None),
            staging: tokio::sync::Mutex::new(None),
            running: Mutex::default(),
            wake: Notify::new(),
            handovers: Mutex::default(),
            adapters: Mutex::default(),
            adapter_in: Mutex::default(),
            prefills: std::sync::atomic::AtomicU64::new(0),
        });
        // The instance's KV in the node's metrics, read at each scrape.
        let weak = Arc::downgrade(&shared);
        shared.mesh.metrics().on_render(move || {
            let Some(sh) = weak.upgrade() else { return };
            let (free, requests) = lock(&sh.kv).as_ref().map_or((0, 0), |(_, p)| (p.available(), p.requests()));
            let m = sh.mesh.metrics();
            m.gauge("cascade_llm_kv_pages_free", "Free pages of the instance's KV region", &[]).set(free as f64);
            m.gauge("cascade_llm_kv_requests", "Requests holding pages of the instance's KV region", &[])
                .set(requests as f64);
        });
        tokio::spawn(route_finished(done_rx));
        tokio::spawn(serve_llm(shared.clone(), llm_inbox));
        tokio::spawn(serve_exec(shared.clone(), exec_inbox));
        tokio::spawn(decode_loop(shared.clone()));
        tokio::spawn(drop_lost_routers(shared.clone()));
        Ok(LlmInstance { shared })
    }

    /// Stages resident now.
    pub fn resident(&self) -> usize {
        self.shared.compute.resident()
    }

    /// What it does now.
    pub fn role(&self) -> Role {
        *lock(&self.shared.role)
    }

    /// Serves LoRA adapter `id` from now on (prefills and decodes of requests that name it).
    pub async fn add_adapter(&self, id: u32, adapter: LoraAdapter) -> Result<(), ServeError> {
        install_adapter(&self.shared, id, adapter).await
    }

    /// The adapters it serves.
    pub fn adapters(&self) -> Vec<u32> {
        lock(&self.shared.adapters).iter().copied().collect()
    }
}

async fn install_adapter(sh: &Shared, id: u32, adapter: LoraAdapter) -> Result<(), ServeError> {
    with_model(sh, move |m| m.add_adapter(id, adapter)).await??;
    lock(&sh.adapters).insert(id);
    Ok(())
}

async fn route_finished(mut done: mpsc::UnboundedReceiver<Finished<Tag>>) {
    while let Some(f) = done.recv().await {
        let _ = f.tag.send(f.result);
    }
}

/// Runs `act` on the compute thread up to stage `stop`.
async fn run(sh: &Shared, act: Activation, stop: usize) -> Result<Activation, ServeError> {
    let (tx, rx) = oneshot::channel();
    if !sh.compute.send(Cmd::Job { act, stop, tag: tx, urgent: false }) {
        return Err(ServeError::Config("the compute thread is gone".into()));
    }
    Ok(rx.await.map_err(|_| ServeError::Config("the compute thread is gone".into()))??)
}

/// Runs `f` with the model on the compute thread.
async fn with_model<R: Send + 'static>(
    sh: &Shared,
    f: impl FnOnce(&mut Llama) -> R + Send + 'static,
) -> Result<R, ServeError> {
    let (tx, rx) = oneshot::channel();
    let job: Box<dyn FnOnce(&mut Llama) + Send> = Box::new(move |m| {
        let _ = tx.send(f(m));
    });
    if !sh.compute.send(Cmd::With(job)) {
        return Err(ServeError::Config("the compute thread is gone".into()));
    }
    rx.await.map_err(|_| ServeError::Config("the compute thread is gone".into()))
}

async fn serve_exec(sh: Arc<Shared>, mut inbox: Inbox<ExecMsg>) {
    while let Some(m) = inbox.recv().await {
        let answer = match m.msg {
            ExecMsg::LayerReady { run, layer } => {
                if let Some(b) = sh.copy.arrived(&sh.model.manifest, run, layer) {
                    sh.compute.send(Cmd::Verified(b));
                }
                None
            }
            ExecMsg::Lend { run } => Some(sh.copy.lend(run, m.from).map(|()| ExecMsg::Ack)),
            ExecMsg::Adopt { run } => Some(sh.copy.adopt(run).map(|()| ExecMsg::Ack)),
            ExecMsg::Status => Some(Ok(ExecMsg::State {
                resident: sh.compute.resident() as u32,
                layers: sh.compute.layers() as u32,
                after_entry: sh.compute.after_entry() as u32,
            })),
            other => Some(Err(ServeError::Protocol(format!("an LLM instance does not serve {other:?}")))),
        };
        if let (Some(a), Some(reply)) = (answer, m.reply_to) {
            let a = a.unwrap_or_else(|e| e.to_failed());
            let _ = sh.mesh.reply(&reply, &a);
        }
    }
}

fn failed(e: &ServeError) -> LlmMsg {
    match e.to_failed() {
        ExecMsg::Failed { message, retry } => LlmMsg::Failed { message, retry },
        _ => LlmMsg::Failed { message: e.to_string(), retry: true },
    }
}

async fn serve_llm(sh: Arc<Shared>, mut inbox: Inbox<LlmMsg>) {
    while let Some(m) = inbox.recv().await {
        let Some(reply) = m.reply_to else {
            debug!(from = m.from, msg = ?m.msg, "one-way llm message ignored");
            continue;
        };
        let now = match m.msg {
            LlmMsg::Reserve { req, tokens } => Some(reserve(&sh, m.from, req, tokens)),
            LlmMsg::Release { req, lease } => {
                release(&sh, req, lease);
                Some(Ok(LlmMsg::Ack))
            }
            LlmMsg::Mutate => {
                *lock(&sh.role) = Role::Decode;
                Some(Ok(LlmMsg::Ack))
            }
            LlmMsg::Status => Some(Ok(state(&sh))),
            LlmMsg::Load => Some(Ok(load(&sh))),
            LlmMsg::ReserveAdapter { adapter, bytes } => Some(reserve_adapter(&sh, adapter, bytes)),
            LlmMsg::Migrate { req, kv } => {
                lock(&sh.handovers).push(Handover { req, kv, reply });
                sh.wake.notify_one();
                None
            }
            msg @ (LlmMsg::Prefill { .. } | LlmMsg::Continue { .. } | LlmMsg::Start { .. } | LlmMsg::Resume { .. }) => {
                let sh = sh.clone();
                tokio::spawn(async move {
                    let a = match msg {
                        LlmMsg::Start { req, lease, crcs, prompt_len, first, max_tokens, router, adapter } => {
                            let (pos, last, generated) = (prompt_len, first, 1);
                            let seq = Seq { req, pos, last, generated, max_tokens, router, adapter, lease };
                            admit(&sh, seq, &crcs, None).await
                        }
                        LlmMsg::Resume {
                            req,
                            lease,
                            crcs,
                            pos,
                            last,
                            generated,
                            max_tokens,
                            router,
                            adapter,
                            adapter_image,
                        } => {
                            let seq = Seq { req, pos, last, generated, max_tokens, router, adapter, lease };
                            admit(&sh, seq, &crcs, adapter_image).await
                        }
                        other => prefill(&sh, other).await,
                    };
                    let _ = sh.mesh.reply(&reply, &a.unwrap_or_else(|e| failed(&e)));
                });
                None
            }
            other => Some(Err(ServeError::Protocol(format!("unexpected request {other:?}")))),
        };
        if let Some(a) = now {
            let _ = sh.mesh.reply(&reply, &a.unwrap_or_else(|e| failed(&e)));
        }
    }
}

fn state(sh: &Shared) -> LlmMsg {
    LlmMsg::State {
        role: *lock(&sh.role),
        resident: sh.compute.resident() as u32,
        layers: sh.compute.layers() as u32,
        running: lock(&sh.running).len() as u32,
        free_pages: lock(&sh.kv).as_ref().map_or(0, |(_, p)| p.available() as u32),
    }
}

fn load(sh: &Shared) -> LlmMsg {
    let requests = lock(&sh.running)
        .iter()
        .map(|s| ReqLoad {
            req: s.req,
            adapter: s.adapter,
            tokens: s.pos,
            remaining: s.max_tokens.saturating_sub(s.generated),
        })
        .collect();
    let (kv_pages, free_pages) = lock(&sh.kv).as_ref().map_or((0, 0), |(_, p)| (sh.cfg.kv_pages, p.available() as u32));
    LlmMsg::Loads { requests, adapters: lock(&sh.adapters).iter().copied().collect(), kv_pages, free_pages }
}

/// Room for adapter `adapter`'s image, unless it is served here already (`Ack`).
fn reserve_adapter(sh: &Shared, adapter: u32, bytes: u64) -> Result<LlmMsg, ServeError> {
    if adapter == 0 || lock(&sh.adapters).contains(&adapter) {
        return Ok(LlmMsg::Ack);
    }
    if bytes == 0 || bytes > 1 << 30 {
        return Err(ServeError::Input(format!("an adapter image of {bytes} bytes")));
    }
    let mut granted = lock(&sh.adapter_in);
    // A grant no migration used yet (one that failed) is reused when large enough.
    let reuse = granted.get(&adapter).is_some_and(|r| r.len() >= bytes);
    if !reuse {
        if let Some(old) = granted.insert(adapter, sh.mesh.register_new(bytes)?) {
            sh.mesh.deregister(old.id());
        }
    }
    let region = granted.get(&adapter).ok_or_else(|| ServeError::Protocol("no adapter region".into()))?;
    let grant = RegionGrant { node: sh.mesh.node(), region: region.id().0, key: region.key().0, len: region.len() };
    Ok(LlmMsg::AdapterGrant { grant })
}

/// Reserves `req`'s pages for `from` (its router: when its link fails they are freed, see
/// [`drop_lost_routers`]).
fn reserve(sh: &Shared, from: u32, req: u64, tokens: u32) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Decode {
        return Err(ServeError::Peer("not a decode instance".into()));
    }
    let mut kv = lock(&sh.kv);
    if kv.is_none() {
        let region = sh.mesh.register_new(sh.layout.page_bytes() * u64::from(sh.cfg.kv_pages))?;
        *kv = Some((region, Pages::new(sh.cfg.kv_pages)));
    }
    let (region, pages) = kv.as_mut().ok_or_else(|| ServeError::Protocol("no KV region".into()))?;
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

/// Frees `req`'s pages if it holds them under `lease`.
fn release(sh: &Shared, req: u64, lease: u64) {
    if let Some((_, pages)) = lock(&sh.kv).as_mut() {
        pages.release(req, lease);
    }
}

/// Blocks whose KV stages `stages` compute (stage `1 + b` is block `b`).
fn blocks(stages: Range<usize>, n_blocks: usize) -> Range<usize> {
    stages.start.max(1) - 1..stages.end.clamp(1, n_blocks + 1) - 1
}

/// A sequence id for one prefill in the model's KV cache: this node in the top 16 bits, a count
/// below. Two prefills of one request — one the router gave up on while it ran on, and the one
/// that redoes it — never share cache entries, here or on the instance that continues a split
/// prefill (which keeps the id it is given). Decode instances key their caches by request.
fn prefill_seq(sh: &Shared) -> u64 {
    let n = sh.prefills.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    (u64::from(sh.mesh.node()) << 48) | (n & ((1 << 48) - 1))
}

async fn prefill(sh: &Arc<Shared>, msg: LlmMsg) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Prefill {
        return Err(ServeError::Peer("not a prefill instance (mutated to decode)".into()));
    }
    let layers = sh.compute.layers();
    let (req, seq, act, max_tokens, kv, split, router, mut crcs) = match msg {
        LlmMsg::Prefill { req, prompt, max_tokens, kv, split, router, adapter } => {
            if prompt.is_empty() || prompt.len() > sh.cfg.max_prompt as usize {
                return Err(ServeError::Input(format!("{} prompt tokens: 1 to {}", prompt.len(), sh.cfg.max_prompt)));
            }
            if adapter != 0 && !lock(&sh.adapters).contains(&adapter) {
                return Err(ServeError::Peer(format!("adapter {adapter} is not served here")));
            }
            let seq = prefill_seq(sh);
            let act = Activation::packed(&[(seq, 0, prompt)])?.with_adapters(&[adapter])?;
            (req, seq, act, max_tokens, kv, split, router, Vec::new())
        }
        LlmMsg::Continue { req, act, max_tokens, kv, router, crcs } => {
            let act = Activation::from_bytes(&act)?;
            let seq = act.segments.first().ok_or_else(|| ServeError::Input("an activation of no sequence".into()))?.seq;
            (req, seq, act, max_tokens, kv, None, router, crcs)
        }
        other => return Err(ServeError::Protocol(format!("not a prefill: {other:?}"))),
    };
    let adapter = act.segments.first().map_or(0, |g| g.adapter);
    let from = act.next_layer;
    let prompt_len = act.ids.dims2().map_err(ExecError::from)?.1 as u32;
    let stop = match split {
        Some(s) if s.layers == 0 || s.layers as usize >= layers => {
            return Err(ServeError::Input(format!("a split after {} of {layers} stages", s.layers)))
        }
        Some(s) => s.layers as usize,
        None => layers,
    };
    let out = run(sh, act, stop).await;
    let moved = match &out {
        Ok(_) => move_kv(sh, seq, blocks(from..stop, sh.layout.blocks), &kv).await,
        Err(_) => Ok(Vec::new()),
    };
    let seq_freed = with_model(sh, move |m| m.free(seq)).await;
    let out = out?;
    crcs.extend(moved?);
    seq_freed?;
    if let Some(s) = split {
        let cont = LlmMsg::Continue { req, act: out.to_bytes()?, max_tokens, kv, router, crcs };
        return match sh.mesh.call(s.then, &cont, sh.cfg.op_timeout).await? {
            LlmMsg::Prefilled { req, first, decoding, .. } => {
                Ok(LlmMsg::Prefilled { req, first, on_first: s.layers, decoding })
            }
            other => Err(other.unexpected_from(s.then)),
        };
    }
    let first = argmax(&out)?.first().copied().ok_or_else(|| ServeError::Protocol("no logits".into()))?;
    let decoding = first != sh.model.config.eos_token_id && max_tokens > 1;
    if decoding {
        let start = LlmMsg::Start { req, lease: kv.lease, crcs, prompt_len, first, max_tokens, router, adapter };
        match sh.mesh.call(kv.node, &start, sh.cfg.op_timeout).await? {
            LlmMsg::Ack => {}
            LlmMsg::Failed { message, .. } => {
                return Err(ServeError::Peer(format!("decode node {}: {message}", kv.node)))
            }
            other => return Err(ServeError::Protocol(format!("unexpected answer {other:?}"))),
        }
    }
    Ok(LlmMsg::Prefilled { req, first, on_first: 0, decoding })
}

/// WRITEs the cached KV of sequence `seq` (a prefill's, or a decoding request's) of `blocks`
/// into its pages on the decode instance, every block's pages in one batch; the crc32 of each
/// block's pages as written, in block order.
async fn move_kv(sh: &Arc<Shared>, seq: u64, blocks: Range<usize>, kv: &KvGrant) -> Result<Vec<u32>, ServeError> {
    if blocks.is_empty() {
        return Ok(Vec::new());
    }
    let t0 = std::time::Instant::now();
    let nb = blocks.len();
    let layout = sh.layout;
    let range = blocks.clone();
    let images = with_model(sh, move |m| -> Result<Vec<Vec<Vec<u8>>>, ExecError> {
        let cache = m.cache();
        range
            .map(|b| {
                let (k, v) = cache.get(seq, b).ok_or(ExecError::NotResident { layer: b + 1 })?;
                let tokens = k.dim(2)?;
                (0..layout.pages_for(tokens)).map(|i| layout.page_image(k, v, i)).collect()
            })
            .collect()
    })
    .await??;
    let t1 = std::time::Instant::now();
    let per_block = images.first().map_or(0, Vec::len);
    if per_block > kv.pages.len() {
        return Err(ServeError::Input(format!("{per_block} pages of KV, {} granted", kv.pages.len())));
    }
    let bp = layout.block_page_bytes();
    let mut staging = sh.staging.lock().await;
    // Every block's pages at once, sized for the longest prompt in every block; a migrated
    // request's KV can be longer, and grows it.
    let need = (per_block.max(layout.pages_for(sh.cfg.max_prompt as usize)) * layout.blocks.max(nb)) as u64 * bp;
    if staging.as_ref().is_none_or(|r| r.len() < need) {
        *staging = Some(sh.mesh.register_new(need)?);
    }
    let st = staging.as_ref().ok_or_else(|| ServeError::Protocol("no staging region".into()))?;
    let remote =
        RemoteRegion { node: kv.node, id: cascade_transport::RegionId(kv.region), key: RemoteKey(kv.key), len: kv.len };
    let link = sh.mesh.link(kv.node)?;
    // One batch of WRITEs for every block, waited for once: no round trip between blocks.
    let mut ops = Vec::with_capacity(nb * per_block);
    let mut crcs = Vec::with_capacity(nb);
    for (j, (b, pages)) in blocks.zip(images).enumerate() {
        if pages.len() != per_block {
            return Err(ServeError::Protocol(format!("block {b}: {} pages of KV, block 0 {per_block}", pages.len())));
        }
        let mut crc = crc32fast::Hasher::new();
        for (i, img) in pages.iter().enumerate() {
            crc.update(img);
            let at = (j * per_block + i) as u64 * bp;
            // SAFETY: the staging region is this task's (the mutex is held), and every WRITE that
            // read it before completed before the call that posted it returned (a region whose
            // WRITEs did not all complete is dropped, below).
            unsafe { st.write_local(at, img) }?;
            ops.push(Op::write(st, at, remote, layout.offset(kv.pages[i], b), bp));
        }
        crcs.push(crc.finalize());
    }
    // Every WRITE is waited for, even after one failed; after a failure the staging region is
    // not used again (an abandoned WRITE may still read it), the next move registers another.
    let mut failed = None;
    for h in link.post(ops) {
        if let Err(e) = h.wait("KV write", sh.cfg.op_timeout).await {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        *staging = None;
        return Err(e.into());
    }
    let (ms, write_ms) = (t0.elapsed().as_secs_f64() * 1e3, t1.elapsed().as_secs_f64() * 1e3);
    debug!(seq, blocks = nb, pages = per_block, ms, write_ms, node = kv.node, "KV moved");
    Ok(crcs)
}

/// Takes a request's KV out of its pages into the model's cache and starts decoding it: after
/// its prefill (`Start`: the prompt's KV, the first token) or a migration (`Resume`: the KV so
/// far, and the adapter's image in its granted region when `adapter_image` is given). The KV
/// must be in the pages of reservation `seq.lease`, each block's bytes matching `crcs`, and the
/// adapter's image must match its crc.
async fn admit(sh: &Arc<Shared>, seq: Seq, crcs: &[u32], adapter_image: Option<Written>) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Decode {
        return Err(ServeError::Peer("not a decode instance".into()));
    }
    if lock(&sh.running).len() >= sh.cfg.max_running {
        return Err(ServeError::Peer(format!("{} requests decoding already", sh.cfg.max_running)));
    }
    let (req, lease) = (seq.req, seq.lease);
    let images = take_kv(sh, req, lease, seq.pos as usize, crcs)?;
    let started = async {
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
    lock(&sh.running).push(seq);
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
    let mut kv = lock(&sh.kv);
    let (region, pages) = kv.as_mut().ok_or_else(|| ServeError::Protocol("no KV region".into()))?;
    let mine = pages.start(req, lease).map_err(|e| {
        refused(sh, "stale");
        ServeError::Peer(e.to_string())
    })?;
    let n = layout.pages_for(tokens);
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
                refused(sh, "foreign");
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
        pages.release(req, lease);
    }
    copied
}

/// Hands `seq` (taken out of the running set between two steps) to the instance that granted
/// `h.kv`: its KV so far by WRITEs; its adapter's image by a WRITE into a region that instance
/// grants when it does not serve the adapter; then `Resume` there. On failure the request
/// decodes here again and nothing of it is lost.
async fn hand_over(sh: Arc<Shared>, seq: Seq, h: Handover) {
    let (req, generated) = (seq.req, seq.generated);
    let result = async {
        let blocks = 0..sh.layout.blocks;
        let crcs = move_kv(&sh, req, blocks, &h.kv).await?;
        let adapter_image = bring_adapter(&sh, seq.adapter, h.kv.node).await?;
        let resume = LlmMsg::Resume {
            req,
            lease: h.kv.lease,
            crcs,
            pos: seq.pos,
            last: seq.last,
            generated,
            max_tokens: seq.max_tokens,
            router: seq.router,
            adapter: seq.adapter,
            adapter_image,
        };
        match sh.mesh.call(h.kv.node, &resume, sh.cfg.op_timeout).await? {
            LlmMsg::Ack => Ok(()),
            other => Err(other.unexpected_from(h.kv.node)),
        }
    }
    .await;
    let answer = match result {
        Ok(()) => {
            release(&sh, req, seq.lease);
            let _ = with_model(&sh, move |m| m.free(req)).await;
            LlmMsg::Migrated { req, tokens: generated }
        }
        Err(e) => {
            warn!(req, to = h.kv.node, error = %e, "migration failed: the request decodes here again");
            lock(&sh.running).push(seq);
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
    let staging = sh.mesh.register_new(n)?;
    // SAFETY: the region was just registered by this task and no operation uses it yet.
    unsafe { staging.write_local(0, &image) }?;
    let remote =
        RemoteRegion { node: g.node, id: cascade_transport::RegionId(g.region), key: RemoteKey(g.key), len: g.len };
    for h in sh.mesh.link(g.node)?.post(vec![Op::write(&staging, 0, remote, 0, n)]) {
        h.wait("adapter write", sh.cfg.op_timeout).await?;
    }
    sh.mesh.deregister(staging.id());
    Ok(Some(Written { bytes: n, crc: crc32fast::hash(&image) }))
}

/// A router whose link failed cannot take its requests' tokens, and it redoes them elsewhere
/// (see [`super::router`]): the requests decoding here for it stop, and their KV pages are freed
/// at once instead of after every token they had left; so are the pages it reserved for
/// prefills that have not started here (a `Start` for one of them is refused: it holds no pages).
async fn drop_lost_routers(sh: Arc<Shared>) {
    let mut events = sh.mesh.peer_events();
    loop {
        let peer = match events.recv().await {
            Ok(PeerEvent::Down { peer, .. }) => peer,
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let lost: Vec<(u64, u64)> = {
            let mut running = lock(&sh.running);
            let lost = running.iter().filter(|s| s.router == peer).map(|s| (s.req, s.lease)).collect();
            running.retain(|s| s.router != peer);
            lost
        };
        // Pages it reserved, those of prefills that have not started here among them (their
        // Start is refused).
        let reserved = lock(&sh.kv).as_ref().map_or_else(Vec::new, |(_, pages)| pages.reserved_by(peer));
        if !lost.is_empty() || !reserved.is_empty() {
            warn!(
                router = peer,
                decoding = lost.len(),
                holding_pages = reserved.len(),
                "the router's link failed: its requests here stop"
            );
        }
        for (req, lease) in reserved {
            release(&sh, req, lease);
        }
        // Their pages went with the reservations above, unless another node reserved them.
        for (req, lease) in lost {
            release(&sh, req, lease);
            let _ = with_model(&sh, move |m| m.free(req)).await;
        }
    }
}

/// Continuous batching: every running request decodes one token per step, in one batch; a
/// request that starts joins at the next step.
async fn decode_loop(sh: Arc<Shared>) {
    let layers = sh.compute.layers();
    let eos = sh.model.config.eos_token_id;
    loop {
        // Between two steps: hand over the requests a migration asked for.
        let handovers: Vec<Handover> = std::mem::take(&mut *lock(&sh.handovers));
        for h in handovers {
            let seq = {
                let mut running = lock(&sh.running);
                running.iter().position(|s| s.req == h.req).map(|i| running.remove(i))
            };
            match seq {
                Some(seq) => {
                    tokio::spawn(hand_over(sh.clone(), seq, h));
                }
                None => {
                    let e = ServeError::Peer(format!("request {} is not decoding here", h.req));
                    let _ = sh.mesh.reply(&h.reply, &failed(&e));
                }
            }
        }
        let (batch, adapters): (Vec<_>, Vec<u32>) =
            lock(&sh.running).iter().map(|s| ((s.req, s.pos, vec![s.last]), s.adapter)).unzip();
        if batch.is_empty() {
            sh.wake.notified().await;
            continue;
        }
        let result = match Activation::packed(&batch).and_then(|a| a.with_adapters(&adapters)) {
            Ok(act) => run(&sh, act, layers).await.and_then(|a| Ok(argmax(&a)?)),
            Err(e) => Err(e.into()),
        };
        let mut finished = Vec::new();
        {
            let mut running = lock(&sh.running);
            match result {
                Ok(tokens) => {
                    for ((req, _, _), tok) in batch.iter().zip(tokens) {
                        let Some(s) = running.iter_mut().find(|s| s.req == *req) else { continue };
                        s.generated += 1;
                        s.pos += 1;
                        s.last = tok;
                        let done = tok == eos || s.generated >= s.max_tokens;
                        let msg = LlmMsg::Token { req: s.req, index: s.generated - 1, token: tok, done };
                        if let Err(e) = sh.mesh.post_oneway(s.router, &msg) {
                            warn!(req = s.req, error = %e, "cannot stream a token");
                        }
                        if done {
                            finished.push((s.req, s.lease));
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "a decode step failed: its requests are aborted");
                    for s in running.iter() {
                        let _ = sh.mesh.post_oneway(s.router, &LlmMsg::Abort { req: s.req, message: e.to_string() });
                        finished.push((s.req, s.lease));
                    }
                }
            }
            running.retain(|s| !finished.contains(&(s.req, s.lease)));
        }
        for (req, lease) in finished {
            release(&sh, req, lease);
            let _ = with_model(&sh, move |m| m.free(req)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_map_to_blocks() {
        assert_eq!(blocks(0..32, 30), 0..30);
        assert_eq!(blocks(0..5, 30), 0..4);
        assert_eq!(blocks(5..32, 30), 4..30);
        assert_eq!(blocks(0..1, 30), 0..0);
        assert_eq!(blocks(31..32, 30), 30..30);
    }
}
