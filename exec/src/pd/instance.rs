//! An LLM serving instance on a node: the `llm` service (prefill, decode, KV moves, mutation)
//! and the `exec` service's copy control (`Lend`, `Adopt`, `LayerReady`, `Status`), so it scales
//! out by the same multicast as the encoder instances.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cascade_multicast::cluster::MulticastNode;
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Inbox, Mesh, Region, ReplyTo, ServiceExt};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tracing::debug;

mod decode;
mod grants;
mod prefill;
mod transfer;

use decode::{decode_loop, drop_lost_routers, give_up, Away, Stop};
use grants::{ensure_kv, reserve, reserve_adapter};
use prefill::prefill;
use transfer::admit;

use super::kv::{KvLayout, Pages};
use super::proto::{KvGrant, LlmMsg, ReqLoad, Role, SeqSampling};
use super::PdModel;
use crate::llama::{Llama, LoraAdapter};
use crate::serve::compute::{Cmd, Compute, Finished};
use crate::serve::copy::Copy;
use crate::serve::inbox::{next, refuse_queued};
use crate::serve::{ExecMsg, ServeError, Source};
use crate::{Activation, ExecError};

/// An LLM instance's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlmConfig {
    /// Pages of the KV region (allocated and registered when a prefill instance mutates, or at
    /// a decode instance's first reservation).
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
    /// How long a decode instance told to stop keeps decoding while its routers move its
    /// requests, with their KV, to other decode instances (`Leaving`): a scale-in that keeps
    /// the work done. Zero: its requests are aborted at once, to be redone from their prompts.
    pub drain: Duration,
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
            drain: Duration::from_secs(10),
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
    /// The router's attempt it decodes for (its tokens carry it).
    attempt: u32,
    /// Its LoRA adapter (0: the base model).
    adapter: u32,
    /// The reservation of its KV pages here.
    lease: u64,
    /// How its tokens are drawn (`None`: greedily).
    sample: Option<SeqSampling>,
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
    /// A spare staging region for the KV a move WRITEs (each move takes it, or a new one, for
    /// itself, and gives it back when its WRITEs completed).
    staging: Mutex<Option<Region>>,
    running: Mutex<Vec<Seq>>,
    wake: Notify,
    /// Migrations the decode loop hands over at its next step boundary.
    handovers: Mutex<Vec<Handover>>,
    /// Requests the decode loop stops at its next step boundary.
    stops: Mutex<Vec<Stop>>,
    /// Requests being handed over (out of `running`; locked after it, never before).
    away: Mutex<Vec<Away>>,
    /// The adapters the model serves (mirrors the compute thread's model).
    adapters: Mutex<std::collections::BTreeSet<u32>>,
    /// Regions granted for adapter images a migration brings, by adapter.
    adapter_in: Mutex<std::collections::HashMap<u32, Region>>,
    /// The last prefill's sequence id (see `prefill::prefill_seq`).
    prefills: std::sync::atomic::AtomicU64,
    /// Set to stop the instance.
    stop: watch::Sender<bool>,
    /// Set when the instance was told to stop with a drain window: it takes no new request and
    /// the decode loop sets `stop` once its requests are gone or the window is over.
    leaving: std::sync::atomic::AtomicBool,
    /// Work under way: the request loop and every prefill or admission it started hold a
    /// receiver, so `closed()` resolves once all of it is over (after a stop).
    work: watch::Sender<()>,
    /// Set once the instance has stopped: its requests answered or aborted, its regions
    /// withdrawn.
    stopped: watch::Sender<bool>,
}

impl Shared {
    /// It was told to stop and drains (see [`LlmInstance::stop`]).
    fn leaving(&self) -> bool {
        self.leaving.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Withdraws the instance's regions from its peers (it stopped): its KV region, its staging
    /// region and those granted for adapter images. WRITEs into them are refused from now on.
    fn withdraw_regions(&self) {
        let regions = [lock(&self.kv).take().map(|(r, _)| r), lock(&self.staging).take()];
        let adapters = lock(&self.adapter_in).drain().map(|(_, r)| r).collect::<Vec<_>>();
        for r in regions.into_iter().flatten().chain(adapters) {
            self.mesh.deregister(r.id());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running LLM instance. Dropping the handle stops it ([`LlmInstance::stop`]).
pub struct LlmInstance {
    shared: Arc<Shared>,
}

impl Drop for LlmInstance {
    fn drop(&mut self) {
        self.stop();
    }
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
        let copy = Copy::new(source, multicast, &*mesh, model.manifest.bytes);
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
            staging: Mutex::new(None),
            running: Mutex::default(),
            wake: Notify::new(),
            handovers: Mutex::default(),
            stops: Mutex::default(),
            away: Mutex::default(),
            adapters: Mutex::default(),
            adapter_in: Mutex::default(),
            prefills: std::sync::atomic::AtomicU64::new(0),
            stop: watch::Sender::new(false),
            leaving: std::sync::atomic::AtomicBool::new(false),
            work: watch::Sender::new(()),
            stopped: watch::Sender::new(false),
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

    /// Stops the instance. With a drain window ([`LlmConfig::drain`]) it first leaves: it
    /// takes no new request (refused, to be sent elsewhere) but starts those whose KV pages it
    /// reserved before, tells the routers whose requests it decodes (`Leaving`), and keeps
    /// decoding and migrating until they have moved those requests away (and no reservation is
    /// left) or the window is over. Then it stops: it takes no more requests (its node
    /// answers them "no such service"); those queued are refused; prefills under way finish;
    /// the requests it still decodes are aborted to their routers (which redo them elsewhere)
    /// once the step in flight and any migration out are over; then its KV, staging and adapter
    /// regions are withdrawn. The node's copy of the parameters and its multicast service stay.
    pub fn stop(&self) {
        if self.shared.cfg.drain.is_zero() {
            self.shared.stop.send_replace(true);
        } else {
            self.shared.leaving.store(true, std::sync::atomic::Ordering::Release);
        }
        self.shared.wake.notify_one();
    }

    /// Stops the instance ([`LlmInstance::stop`]) and waits until it has stopped: the prefills
    /// and admissions under way are over and answered, the requests it decoded are aborted to
    /// their routers, and its regions are withdrawn. A graceful scale-in calls this before the
    /// node leaves the cluster. Bounded by the migrations' and transfers' time limits.
    pub async fn stop_and_wait(&self) {
        self.stop();
        let mut stopped = self.shared.stopped.subscribe();
        // The sender lives in `shared`, which `self` holds: the wait cannot see it dropped.
        let _ = stopped.wait_for(|&s| s).await;
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
    let mut stop = sh.stop.subscribe();
    while let Some(m) = next(&mut inbox, &mut stop).await {
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
    refuse_queued(&*sh.mesh, inbox, &ServeError::Stopped.to_failed());
}

fn failed(e: &ServeError) -> LlmMsg {
    match e.to_failed() {
        ExecMsg::Failed { message, retry } => LlmMsg::Failed { message, retry },
        _ => LlmMsg::Failed { message: e.to_string(), retry: true },
    }
}

async fn serve_llm(sh: Arc<Shared>, mut inbox: Inbox<LlmMsg>) {
    let mut stop = sh.stop.subscribe();
    let _working = sh.work.subscribe();
    while let Some(m) = next(&mut inbox, &mut stop).await {
        let Some(reply) = m.reply_to else {
            debug!(from = m.from, msg = ?m.msg, "one-way llm message ignored");
            continue;
        };
        let now = match m.msg {
            // Leaving: no new request, no request moved here; a request whose pages were reserved
            // before still starts (its prefill is done), to be moved away with the others.
            LlmMsg::Reserve { .. }
            | LlmMsg::ReserveAdapter { .. }
            | LlmMsg::Mutate
            | LlmMsg::Prefill { .. }
            | LlmMsg::Continue { .. }
            | LlmMsg::Resume { .. }
                if sh.leaving() =>
            {
                Some(Err(ServeError::Stopped))
            }
            LlmMsg::Reserve { req, tokens } => Some(reserve(&sh, m.from, req, tokens)),
            LlmMsg::Release { req, lease } => {
                give_up(&sh, req, lease);
                Some(Ok(LlmMsg::Ack))
            }
            // A decode instance from the answer on: its KV region is allocated first.
            LlmMsg::Mutate => {
                // The KV lock goes at the end of this statement, before the role's is taken.
                let mapped = ensure_kv(&sh, &mut lock(&sh.kv)).map(drop);
                Some(mapped.map(|()| {
                    *lock(&sh.role) = Role::Decode;
                    LlmMsg::Ack
                }))
            }
            LlmMsg::Status => Some(Ok(state(&sh))),
            LlmMsg::Load => Some(Ok(load(&sh))),
            LlmMsg::ReserveAdapter { adapter, bytes } => {
                answer_later(&sh, reply, move |sh| async move { reserve_adapter(&sh, adapter, bytes).await });
                None
            }
            LlmMsg::Migrate { req, kv } => {
                lock(&sh.handovers).push(Handover { req, kv, reply });
                sh.wake.notify_one();
                None
            }
            msg @ (LlmMsg::Prefill { .. } | LlmMsg::Continue { .. } | LlmMsg::Start { .. } | LlmMsg::Resume { .. }) => {
                let sh = sh.clone();
                let working = sh.work.subscribe();
                tokio::spawn(async move {
                    let _working = working;
                    let a = match msg {
                        LlmMsg::Start {
                            req,
                            attempt,
                            lease,
                            crcs,
                            prompt_len,
                            first,
                            max_tokens,
                            router,
                            adapter,
                            sample,
                        } => {
                            let (pos, last, generated) = (prompt_len, first, 1);
                            let seq =
                                Seq { req, pos, last, generated, max_tokens, router, attempt, adapter, lease, sample };
                            admit(&sh, seq, &crcs, None).await
                        }
                        LlmMsg::Resume {
                            req,
                            attempt,
                            lease,
                            crcs,
                            pos,
                            last,
                            generated,
                            max_tokens,
                            router,
                            adapter,
                            adapter_image,
                            sample,
                        } => {
                            let seq =
                                Seq { req, pos, last, generated, max_tokens, router, attempt, adapter, lease, sample };
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
    refuse_queued(&*sh.mesh, inbox, &failed(&ServeError::Stopped));
}

/// Answers `reply` with what `work` returns, from a task of its own that holds a share of the
/// instance's work (a stop waits for it), so that the request loop goes on meanwhile.
fn answer_later<F, W>(sh: &Arc<Shared>, reply: ReplyTo, work: W)
where
    W: FnOnce(Arc<Shared>) -> F,
    F: std::future::Future<Output = Result<LlmMsg, ServeError>> + Send + 'static,
{
    let working = sh.work.subscribe();
    let answer = work(sh.clone());
    let sh = sh.clone();
    tokio::spawn(async move {
        let _working = working;
        let a = answer.await;
        let _ = sh.mesh.reply(&reply, &a.unwrap_or_else(|e| failed(&e)));
    });
}

fn state(sh: &Shared) -> LlmMsg {
    // Those being handed over count: they may come back. (Locked in the running set's order.)
    let running = {
        let running = lock(&sh.running);
        running.len() + lock(&sh.away).len()
    };
    LlmMsg::State {
        role: *lock(&sh.role),
        resident: sh.compute.resident() as u32,
        layers: sh.compute.layers() as u32,
        running: running as u32,
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
            router: s.router,
        })
        .collect();
    let (kv_pages, free_pages) = lock(&sh.kv).as_ref().map_or((0, 0), |(_, p)| (sh.cfg.kv_pages, p.available() as u32));
    LlmMsg::Loads { requests, adapters: lock(&sh.adapters).iter().copied().collect(), kv_pages, free_pages }
}

/// Frees `req`'s pages if it holds them under `lease`.
fn release(sh: &Shared, req: u64, lease: u64) {
    if let Some((_, pages)) = lock(&sh.kv).as_mut() {
        pages.release(req, lease);
    }
}

/// A request that no longer decodes here (finished, stopped, handed over): its pages under
/// `lease` and its cache entries are freed.
async fn retire(sh: &Arc<Shared>, req: u64, lease: u64) {
    release(sh, req, lease);
    let _ = with_model(sh, move |m| m.free(req)).await;
}
