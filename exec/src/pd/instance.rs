//! An LLM serving instance on a node: the `llm` service (prefill, decode, KV moves, mutation)
//! and the `exec` service's copy control (`Lend`, `Adopt`, `LayerReady`, `Status`), so it scales
//! out by the same multicast as the encoder instances.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cascade_multicast::cluster::MulticastNode;
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Inbox, Mesh, Op, Region, RemoteKey, RemoteRegion, ServiceExt};
use tokio::sync::{mpsc, oneshot, Notify};
use tracing::{debug, warn};

use super::kv::{KvLayout, Pages};
use super::proto::{KvGrant, LlmMsg, Role};
use super::PdModel;
use crate::llama::generate::argmax;
use crate::llama::Llama;
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
}

async fn route_finished(mut done: mpsc::UnboundedReceiver<Finished<Tag>>) {
    while let Some(f) = done.recv().await {
        let _ = f.tag.send(f.result);
    }
}

/// Runs `act` on the compute thread up to stage `stop`.
async fn run(sh: &Shared, act: Activation, stop: usize) -> Result<Activation, ServeError> {
    let (tx, rx) = oneshot::channel();
    if !sh.compute.send(Cmd::Job { act, stop, tag: tx }) {
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
            ExecMsg::Status => {
                Some(Ok(ExecMsg::State { resident: sh.compute.resident() as u32, layers: sh.compute.layers() as u32 }))
            }
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
            LlmMsg::Reserve { req, tokens } => Some(reserve(&sh, req, tokens)),
            LlmMsg::Release { req } => {
                release(&sh, req);
                Some(Ok(LlmMsg::Ack))
            }
            LlmMsg::Mutate => {
                *lock(&sh.role) = Role::Decode;
                Some(Ok(LlmMsg::Ack))
            }
            LlmMsg::Status => Some(Ok(state(&sh))),
            msg @ (LlmMsg::Prefill { .. } | LlmMsg::Continue { .. } | LlmMsg::Start { .. }) => {
                let sh = sh.clone();
                tokio::spawn(async move {
                    let a = match msg {
                        LlmMsg::Start { req, prompt_len, first, max_tokens, router } => {
                            start(&sh, req, prompt_len, first, max_tokens, router).await
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

fn reserve(sh: &Shared, req: u64, tokens: u32) -> Result<LlmMsg, ServeError> {
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
    let got = pages
        .reserve(req, n)
        .ok_or_else(|| ServeError::Peer(format!("{n} KV pages wanted, {} free", pages.available())))?;
    let grant =
        KvGrant { node: sh.mesh.node(), region: region.id().0, key: region.key().0, len: region.len(), pages: got };
    Ok(LlmMsg::Reserved { grant })
}

fn release(sh: &Shared, req: u64) {
    if let Some((_, pages)) = lock(&sh.kv).as_mut() {
        pages.free(req);
    }
}

/// Blocks whose KV stages `stages` compute (stage `1 + b` is block `b`).
fn blocks(stages: Range<usize>, n_blocks: usize) -> Range<usize> {
    stages.start.max(1) - 1..stages.end.clamp(1, n_blocks + 1) - 1
}

async fn prefill(sh: &Arc<Shared>, msg: LlmMsg) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Prefill {
        return Err(ServeError::Peer("not a prefill instance (mutated to decode)".into()));
    }
    let layers = sh.compute.layers();
    let (req, act, max_tokens, kv, split, router) = match msg {
        LlmMsg::Prefill { req, prompt, max_tokens, kv, split, router } => {
            if prompt.is_empty() || prompt.len() > sh.cfg.max_prompt as usize {
                return Err(ServeError::Input(format!("{} prompt tokens: 1 to {}", prompt.len(), sh.cfg.max_prompt)));
            }
            (req, Activation::packed(&[(req, 0, prompt)])?, max_tokens, kv, split, router)
        }
        LlmMsg::Continue { req, act, max_tokens, kv, router } => {
            (req, Activation::from_bytes(&act)?, max_tokens, kv, None, router)
        }
        other => return Err(ServeError::Protocol(format!("not a prefill: {other:?}"))),
    };
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
        Ok(_) => move_kv(sh, req, blocks(from..stop, sh.layout.blocks), &kv).await,
        Err(_) => Ok(()),
    };
    let seq_freed = with_model(sh, move |m| m.free(req)).await;
    let out = out?;
    moved?;
    seq_freed?;
    if let Some(s) = split {
        let cont = LlmMsg::Continue { req, act: out.to_bytes()?, max_tokens, kv, router };
        return match sh.mesh.call(s.then, &cont, sh.cfg.op_timeout).await? {
            LlmMsg::Prefilled { req, first, decoding, .. } => {
                Ok(LlmMsg::Prefilled { req, first, on_first: s.layers, decoding })
            }
            LlmMsg::Failed { message, .. } => Err(ServeError::Peer(format!("node {}: {message}", s.then))),
            other => Err(ServeError::Protocol(format!("unexpected answer {other:?}"))),
        };
    }
    let first = argmax(&out)?.first().copied().ok_or_else(|| ServeError::Protocol("no logits".into()))?;
    let decoding = first != sh.model.config.eos_token_id && max_tokens > 1;
    if decoding {
        let start = LlmMsg::Start { req, prompt_len, first, max_tokens, router };
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

/// WRITEs `req`'s cached KV of `blocks` into its pages on the decode instance, block by block.
async fn move_kv(sh: &Arc<Shared>, req: u64, blocks: Range<usize>, kv: &KvGrant) -> Result<(), ServeError> {
    if blocks.is_empty() {
        return Ok(());
    }
    let layout = sh.layout;
    let range = blocks.clone();
    let images = with_model(sh, move |m| -> Result<Vec<Vec<Vec<u8>>>, ExecError> {
        let cache = m.cache();
        range
            .map(|b| {
                let (k, v) = cache.get(req, b).ok_or(ExecError::NotResident { layer: b + 1 })?;
                let tokens = k.dim(2)?;
                (0..layout.pages_for(tokens)).map(|i| layout.page_image(k, v, i)).collect()
            })
            .collect()
    })
    .await??;
    let per_block = images.first().map_or(0, Vec::len);
    if per_block > kv.pages.len() {
        return Err(ServeError::Input(format!("{per_block} pages of KV, {} granted", kv.pages.len())));
    }
    let bp = layout.block_page_bytes();
    let mut staging = sh.staging.lock().await;
    if staging.is_none() {
        let pages = layout.pages_for(sh.cfg.max_prompt as usize) as u64;
        *staging = Some(sh.mesh.register_new(pages * bp)?);
    }
    let st = staging.as_ref().ok_or_else(|| ServeError::Protocol("no staging region".into()))?;
    let remote =
        RemoteRegion { node: kv.node, id: cascade_transport::RegionId(kv.region), key: RemoteKey(kv.key), len: kv.len };
    let link = sh.mesh.link(kv.node)?;
    for (b, pages) in blocks.zip(images) {
        let mut ops = Vec::with_capacity(pages.len());
        for (i, img) in pages.iter().enumerate() {
            // SAFETY: the staging region is this task's (the mutex is held), and the WRITEs that
            // last read it completed before the previous block's loop iteration ended.
            unsafe { st.write_local(i as u64 * bp, img) }?;
            ops.push(Op::write(st, i as u64 * bp, remote, layout.offset(kv.pages[i], b), bp));
        }
        for h in link.post(ops) {
            h.wait("KV write", sh.cfg.op_timeout).await?;
        }
    }
    Ok(())
}

/// Takes `req`'s prompt KV out of its pages into the model's cache and starts decoding it.
async fn start(
    sh: &Arc<Shared>,
    req: u64,
    prompt_len: u32,
    first: u32,
    max_tokens: u32,
    router: u32,
) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Decode {
        return Err(ServeError::Peer("not a decode instance".into()));
    }
    if lock(&sh.running).len() >= sh.cfg.max_running {
        return Err(ServeError::Peer(format!("{} requests decoding already", sh.cfg.max_running)));
    }
    let layout = sh.layout;
    let tokens = prompt_len as usize;
    let per_block: Vec<(usize, Vec<bytes::Bytes>)> = {
        let kv = lock(&sh.kv);
        let (region, pages) = kv.as_ref().ok_or_else(|| ServeError::Protocol("no KV region".into()))?;
        let mine = pages.of(req).ok_or_else(|| ServeError::Protocol(format!("request {req} holds no KV pages")))?;
        let n = layout.pages_for(tokens);
        if n > mine.len() {
            return Err(ServeError::Input(format!("{tokens} tokens of KV in {} pages", mine.len())));
        }
        (0..layout.blocks)
            .map(|b| {
                let views = mine[..n]
                    .iter()
                    // SAFETY: these pages are `req`'s alone; its prefill instances WRITE them
                    // before sending Start, and their WRITEs completed before Start was sent.
                    .map(|&p| unsafe { region.view(layout.offset(p, b), layout.block_page_bytes()) })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((b, views))
            })
            .collect::<Result<_, ServeError>>()?
    };
    with_model(sh, move |m| -> Result<(), ExecError> {
        let mut cache = m.cache();
        for (b, views) in per_block {
            let refs: Vec<&[u8]> = views.iter().map(|v| &v[..]).collect();
            let (k, v) = layout.tensors(&refs, tokens)?;
            cache.put(req, b, k, v);
        }
        Ok(())
    })
    .await??;
    lock(&sh.running).push(Seq { req, pos: prompt_len, last: first, generated: 1, max_tokens, router });
    sh.wake.notify_one();
    Ok(LlmMsg::Ack)
}

/// Continuous batching: every running request decodes one token per step, in one batch; a
/// request that starts joins at the next step.
async fn decode_loop(sh: Arc<Shared>) {
    let layers = sh.compute.layers();
    let eos = sh.model.config.eos_token_id;
    loop {
        let batch: Vec<(u64, u32, Vec<u32>)> = lock(&sh.running).iter().map(|s| (s.req, s.pos, vec![s.last])).collect();
        if batch.is_empty() {
            sh.wake.notified().await;
            continue;
        }
        let result = match Activation::packed(&batch) {
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
                            finished.push(s.req);
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "a decode step failed: its requests are aborted");
                    for s in running.iter() {
                        let _ = sh.mesh.post_oneway(s.router, &LlmMsg::Abort { req: s.req, message: e.to_string() });
                        finished.push(s.req);
                    }
                }
            }
            running.retain(|s| !finished.contains(&s.req));
        }
        for req in finished {
            release(&sh, req);
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
