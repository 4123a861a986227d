//! `cascade llm-server --pd`: the server's requests computed with prefill/decode disaggregation —
//! prefill and decode instance processes (`cascade llm-instance`, each pinned to a core) on
//! loopback, this process their router ([`cascade_exec::pd::router`]): a request's prompt is
//! prefilled on a prefill instance, its KV moved page by page to a decode instance with
//! one-sided WRITEs, and its tokens streamed back to the router, which answers it.
//!
//! Each choice of a request is one router request: its budget, sampling (drawn as the index the
//! server gives it, as the local loop draws it), stop strings (the router reads the tokens' text
//! and stops the decode at one) and, streamed, its tokens as they arrive in order. A client that
//! goes away cancels its requests at the router ([`PdCmd::Cancel`]): their decodes are told to
//! stop. A request whose instance is lost is redone from its prompt on another.
//!
//! **Limits, stated.** A prompt may hold at most `--max-prompt-tokens` (2,048; the prefill
//! instances' KV staging region: a longer one is refused, 400), and a request generates at most
//! what a decode instance's KV region holds beside its prompt (`kv_pages × page_tokens`: 4,096
//! tokens; asked for more, it ends there, `finish_reason: "length"`). An instance process that
//! exits stops the server with its log's last lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_exec::llama::generate::Generated;
use cascade_exec::llama::sample::{Decoding, SeqSampling};
use cascade_exec::llama::text::ModelText;
use cascade_exec::pd::router::{self, GenAnswer, GenRequest, PdCmd, PdRouterConfig, RouterStats, TokenSink};
use cascade_exec::pd::{LlmConfig, LlmMsg, PdModel, Role};
use cascade_exec::serve::ServeError;
use cascade_transport::metrics::Metrics;
use cascade_transport::Endpoint;
use cascade_transport::{Mesh, ServiceExt};
use clap::Args;
use tokio::sync::{mpsc, oneshot};

use super::{Backend, Job, Refused};
use crate::Member;

/// `--pd` and its instances.
#[derive(Args)]
pub(crate) struct PdServeArgs {
    /// Compute the requests with prefill/decode disaggregation: prefill and decode instance
    /// processes on loopback, this process their router (instead of a generation loop here).
    #[arg(long)]
    pub(crate) pd: bool,
    /// Prefill instances (with --pd).
    #[arg(long, default_value_t = 1, requires = "pd")]
    prefill_instances: u32,
    /// Decode instances (with --pd).
    #[arg(long, default_value_t = 1, requires = "pd")]
    decode_instances: u32,
    /// Where the instances' logs and the cluster file go (with --pd).
    #[arg(long, default_value = "target/llm-server", requires = "pd")]
    logs: PathBuf,
    /// The longest prompt the prefill instances take, in tokens (with --pd; a longer one is
    /// refused, 400). Each prefill instance stages a prompt's KV: about 46 KB a token for
    /// SmolLM2-135M.
    #[arg(long, default_value_t = 2048, requires = "pd",
          value_parser = clap::value_parser!(u32).range(1..=crate::pd::MAX_PROMPT as i64))]
    max_prompt_tokens: u32,
}

/// Instances one server starts at most.
const MAX_INSTANCES: u32 = 16;

/// What waits for the router's answer to each request, by id.
type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<GenAnswer>>>>;

/// The instances, the router and what waits for its answers.
pub(crate) struct Cluster {
    text: Arc<ModelText>,
    /// The router's requests (`None` once the server stops).
    requests: Mutex<Option<mpsc::UnboundedSender<GenRequest>>>,
    cmds: mpsc::UnboundedSender<PdCmd>,
    waiting: Waiting,
    next_id: AtomicU64,
    /// Requests the router may hold unanswered.
    max_held: usize,
    /// The longest prompt, and the most tokens a prompt and its answer hold together.
    max_prompt: usize,
    room: usize,
    handle: tokio::runtime::Handle,
    routing: Mutex<Option<tokio::task::JoinHandle<Result<RouterStats, ServeError>>>>,
    children: Arc<Mutex<Vec<std::process::Child>>>,
    ep: Arc<Endpoint>,
    logs: PathBuf,
    described: String,
}

impl Cluster {
    /// Starts the instances serving `model`, joins them as their router, waits until each
    /// serves; returns the backend and the runtime the router runs on.
    pub(crate) fn start(
        model: &Path,
        a: &PdServeArgs,
        max_waiting: usize,
    ) -> anyhow::Result<(Arc<Cluster>, tokio::runtime::Runtime)> {
        let (p, d) = (a.prefill_instances, a.decode_instances);
        if p == 0 || d == 0 || p + d > MAX_INSTANCES {
            bail!(
                "--prefill-instances {p} and --decode-instances {d}: at least one each, {MAX_INSTANCES} in all at most"
            );
        }
        let model_dir = std::fs::canonicalize(model).with_context(|| format!("the model in {}", model.display()))?;
        let (m, _file) =
            PdModel::from_dir(&model_dir).with_context(|| format!("reading the model in {}", model_dir.display()))?;
        let text = Arc::new(ModelText::new((*m.tokenizer).clone(), &m.config, &model_dir));
        std::fs::create_dir_all(&a.logs).with_context(|| format!("creating {}", a.logs.display()))?;
        let logs = std::fs::canonicalize(&a.logs)?;
        let addrs = cascade_devcluster::free_addrs(1 + (p + d) as usize);
        if addrs.len() != 1 + (p + d) as usize {
            bail!("could not reserve {} loopback ports", 1 + p + d);
        }
        // SIGINT/SIGTERM stop the server gracefully (its requests answered, then its instances
        // stopped); a second one kills the instances at once.
        cascade_devcluster::interrupt_gracefully();
        let cluster = crate::demo::write_cluster(&logs, &addrs, &logs)?;
        let roles: Vec<(u32, Role, bool)> =
            (1..=p + d).map(|n| (n, if n <= p { Role::Prefill } else { Role::Decode }, false)).collect();
        let args = ["--max-prompt".to_string(), a.max_prompt_tokens.to_string()];
        let children = crate::pd::spawn_instances(&cluster, &model_dir, &logs, &roles, &args)?;
        let children = Arc::new(Mutex::new(children));
        let stop = |e: anyhow::Error| {
            let c = std::mem::take(&mut *children.lock().unwrap_or_else(|e| e.into_inner()));
            crate::demo::stop_nodes(c, &logs);
            e
        };
        let rt = tokio::runtime::Runtime::new().map_err(|e| stop(e.into()))?;
        let nodes: Vec<u32> = (1..=p + d).collect();
        let ep = rt
            .block_on(async {
                let watching = crate::live::watch_nodes(&logs, || {
                    cascade_devcluster::process::first_exited_of(
                        &mut children.lock().unwrap_or_else(|e| e.into_inner()),
                        |_| true,
                    )
                });
                // The first interrupt is this process's own to handle (above): taken here too.
                tokio::select! {
                    r = ready(&cluster, &nodes) => r,
                    e = watching => Err(e),
                    _ = super::stopped() => Err(anyhow::anyhow!("interrupted while the instances started")),
                }
            })
            .map_err(stop)?;
        let kv = LlmConfig::default();
        let cfg = PdRouterConfig::new(&m, 1, (2..=p).collect(), (p + 1..=p + d).collect());
        let (req_tx, req_rx) = mpsc::unbounded_channel();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ans_tx, mut ans_rx) = mpsc::unbounded_channel::<GenAnswer>();
        let mesh: Arc<dyn Mesh> = ep.clone();
        let routing = rt.spawn(router::run(mesh, cfg, req_rx, cmd_rx, ans_tx));
        let waiting: Waiting = Arc::default();
        // The router's answers to whoever waits for them.
        let to = waiting.clone();
        rt.spawn(async move {
            while let Some(a) = ans_rx.recv().await {
                let waiter = to.lock().unwrap_or_else(|e| e.into_inner()).remove(&a.id);
                if let Some(w) = waiter {
                    let _ = w.send(a);
                }
            }
        });
        let described = format!(
            "{} and {} behind this process's router (logs in {})",
            crate::count(p as usize, "prefill instance", "prefill instances"),
            crate::count(d as usize, "decode instance", "decode instances"),
            logs.display()
        );
        let c = Cluster {
            text,
            requests: Mutex::new(Some(req_tx)),
            cmds: cmd_tx,
            waiting,
            next_id: AtomicU64::new(0),
            max_held: max_waiting.max(1),
            max_prompt: a.max_prompt_tokens as usize,
            room: ((kv.kv_pages * kv.page_tokens) as usize).min(m.config.max_position_embeddings),
            handle: rt.handle().clone(),
            routing: Mutex::new(Some(routing)),
            children,
            ep,
            logs,
            described,
        };
        Ok((Arc::new(c), rt))
    }

    /// The model's tokenizer and chat template.
    pub(crate) fn text(&self) -> Arc<ModelText> {
        self.text.clone()
    }

    /// What computes the requests, in words.
    pub(crate) fn describe(&self) -> String {
        self.described.clone()
    }

    /// Request `id`'s router request for `job`, and what is left of the job to answer.
    fn request(&self, id: u64, job: Job) -> (GenRequest, Follow) {
        let Job { prompt, reply, tokens, .. } = job;
        let n = prompt.tokens.len();
        let max_tokens = prompt.max_tokens.unwrap_or(usize::MAX).min(self.room.saturating_sub(n));
        let sample = prompt
            .decoding
            .and_then(Decoding::sampling)
            .map(|sampling| SeqSampling { sampling, index: prompt.draws_as.unwrap_or(0) });
        let follow = Follow { id, reply, prompt_tokens: prompt.tokens.clone(), room: self.room };
        let req = GenRequest {
            id,
            prompt: prompt.tokens,
            max_tokens: max_tokens.min(u32::MAX as usize) as u32,
            adapter: 0,
            sample,
            stop: prompt.stop.unwrap_or_default(),
            tokens: tokens.map(TokenSink),
        };
        (req, follow)
    }
}

/// Joins the cluster as node 0 and waits until every instance in `nodes` answers that it serves
/// (each loads its copy of the model first).
async fn ready(cluster: &Path, nodes: &[u32]) -> anyhow::Result<Arc<Endpoint>> {
    let ep = crate::join(&Member::driver(cluster), true).await?;
    let mesh: Arc<dyn Mesh> = ep.clone();
    let since = Instant::now();
    for &node in nodes {
        loop {
            match mesh.call(node, &LlmMsg::Status, Duration::from_secs(10)).await {
                Ok(LlmMsg::State { .. }) => break,
                other if since.elapsed() > Duration::from_secs(120) => {
                    bail!("instance {node} did not serve within 120 s: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    Ok(ep)
}

/// A job handed to the router: where its answer goes.
struct Follow {
    id: u64,
    reply: oneshot::Sender<Generated>,
    prompt_tokens: Vec<u32>,
    /// The most tokens prompt and answer hold together.
    room: usize,
}

impl Follow {
    /// Waits for the router's answer and hands it on; if its receiver goes first (the client
    /// went away), cancels the request at the router.
    async fn run(mut self, answer: oneshot::Receiver<GenAnswer>, cmds: mpsc::UnboundedSender<PdCmd>, m: Arc<Metrics>) {
        tokio::select! {
            a = answer => match a {
                Ok(GenAnswer { result: Ok(tokens), stopped, ttft, .. }) => {
                    // From its arrival at the router, a moment after its queueing here.
                    let help = "From a request's queueing to its first token";
                    m.histogram("cascade_llm_server_first_token_seconds", help, &[]).observe(ttft.as_secs_f64());
                    let at_window = self.prompt_tokens.len() + tokens.len() >= self.room;
                    let prompt_tokens = self.prompt_tokens;
                    let logprobs = Vec::new();
                    let _ = self.reply.send(Generated { prompt_tokens, tokens, at_window, stopped, logprobs });
                }
                // Its reply dropped: the handler answers that the generation failed.
                Ok(GenAnswer { result: Err(why), .. }) => tracing::warn!(req = self.id, %why, "a request failed"),
                Err(_) => tracing::warn!(req = self.id, "the router stopped before it answered"),
            },
            _ = self.reply.closed() => {
                let _ = cmds.send(PdCmd::Cancel { id: self.id });
                let help = "Requests the LLM server stopped generating because their client went away";
                m.counter("cascade_llm_server_cancelled", help, &[]).inc();
            }
        }
    }
}

impl Backend for Cluster {
    fn submit(&self, jobs: Vec<Job>) -> Result<(), Refused> {
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = requests.as_ref() else { return Err(Refused::Stopping) };
        if let Some(n) = jobs.iter().map(|j| j.prompt.tokens.len()).find(|&n| n > self.max_prompt) {
            return Err(Refused::Input(format!(
                "a prompt of {n} tokens: the prefill instances take {} at most",
                self.max_prompt
            )));
        }
        if jobs.iter().any(|j| j.prompt.logprobs.is_some()) {
            return Err(Refused::Input(
                "body.logprobs: log-probabilities are not computed with --pd (the decode instances send tokens \
                 only)"
                    .into(),
            ));
        }
        if jobs.iter().any(|j| j.prompt.penalties.is_some()) {
            return Err(Refused::Input(
                "penalties (presence, frequency, repetition) are not applied with --pd (the instances take greedy \
                 or sampled decoding only)"
                    .into(),
            ));
        }
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.len() + jobs.len() > self.max_held {
            return Err(Refused::Busy(format!("{} requests are held already: send it again later", waiting.len())));
        }
        for job in jobs {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (req, follow) = self.request(id, job);
            let (answered, answer) = oneshot::channel();
            waiting.insert(id, answered);
            if tx.send(req).is_err() {
                waiting.remove(&id);
                return Err(Refused::Stopping);
            }
            self.handle.spawn(follow.run(answer, self.cmds.clone(), self.ep.metrics().clone()));
        }
        Ok(())
    }

    fn close(&self, rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
        // The router ends once it answered every request it holds.
        self.requests.lock().unwrap_or_else(|e| e.into_inner()).take();
        let routing = self.routing.lock().unwrap_or_else(|e| e.into_inner()).take();
        let stats = routing.map(|r| rt.block_on(r));
        rt.block_on(self.ep.leave());
        let children = std::mem::take(&mut *self.children.lock().unwrap_or_else(|e| e.into_inner()));
        crate::demo::stop_nodes(children, &self.logs);
        match stats {
            Some(Ok(Ok(s))) => {
                println!(
                    "router: {} answered, {} failed, {} cancelled, {} prefills redone",
                    s.answered, s.failed, s.cancelled, s.requeued
                );
                Ok(())
            }
            Some(Ok(Err(e))) => Err(anyhow::Error::new(e).context("the router failed")),
            Some(Err(e)) => Err(anyhow::anyhow!("the router's task failed: {e}")),
            None => Ok(()),
        }
    }

    fn broken(&self) -> futures_util::future::BoxFuture<'static, anyhow::Error> {
        let (children, logs) = (self.children.clone(), self.logs.clone());
        Box::pin(async move {
            crate::live::watch_nodes(&logs, || {
                cascade_devcluster::process::first_exited_of(
                    &mut children.lock().unwrap_or_else(|e| e.into_inner()),
                    |_| true,
                )
            })
            .await
        })
    }

    fn metrics(&self) -> Option<Arc<Metrics>> {
        Some(self.ep.metrics().clone())
    }
}
