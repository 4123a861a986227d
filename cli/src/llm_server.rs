//! `cascade llm-server`: an LLM served over HTTP with OpenAI's completions and chat completions
//! API (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`;
//! `GET /metrics`: requests by outcome, tokens, times to first token and to answer),
//! the bodies as [`crate::openai`] takes and gives them.
//!
//! Where the requests are computed is a [`Backend`]: by default one generation loop on a thread
//! of this process ([`local`]: continuous batching, up to 32 sequences decoding together); with
//! `--pd`, prefill and decode instance processes behind the LLM router
//! ([`cluster`]: prefill/decode disaggregation, each request's KV moved to a decode instance).
//! A request is tokenised (and its chat rendered) on a blocking thread of the HTTP runtime; its
//! answer comes back through a oneshot channel (`n` choices: the prompt submitted that many
//! times); a client that goes away (its connection closed before its answer is whole) ends its
//! generation. With `stream: true` the answer comes as server-sent events, a chunk of text as
//! its tokens come (none of a stop string), as OpenAI streams it. A choice without a seed of its
//! own draws as the server's count of such choices, from `--seed` (random otherwise): the same
//! tokens on either backend.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use cascade_exec::llama::generate::{Generated, Generator, StreamPrompt};
use cascade_exec::llama::stop::StopStrings;
use cascade_exec::llama::text::ModelText;
use cascade_transport::metrics::Metrics;
use clap::Args;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::openai::Defaults;

mod cluster;
mod embeddings;
mod local;

#[derive(Args)]
pub(crate) struct LlmServerArgs {
    /// The model directory (`cascade model import --gguf` writes one).
    #[arg(long, default_value = crate::models::SMOLLM2)]
    model: PathBuf,
    /// The address to listen on (port 0: any free one; the address taken is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Tokens a request without max_tokens generates at most.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// The seed of the requests without one (random otherwise, and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Requests that may wait for a slot in the generation loop (32 run at once); one more is
    /// answered 429 at once, to be sent again, rather than queued without bound. 0: none waits
    /// (a request is taken only while the loop is idle). With `--pd`: requests the router holds
    /// unanswered, running or not.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Serve with prefill/decode disaggregation.
    #[command(flatten)]
    pd: cluster::PdServeArgs,
    /// Also serve `POST /v1/embeddings` with this sentence-embedding model (a directory as
    /// `cascade embed --model` takes, all-MiniLM-L6-v2's: `target/models/all-minilm-l6-v2`).
    #[arg(long, value_name = "DIR")]
    embed_model: Option<PathBuf>,
}

/// A request's choice for the backend: its prompt and settings, where its answer goes, and
/// (streamed) where each token goes as it comes.
pub(crate) struct Job {
    pub(crate) prompt: StreamPrompt,
    pub(crate) reply: oneshot::Sender<Generated>,
    pub(crate) tokens: Option<tokio::sync::mpsc::UnboundedSender<u32>>,
    /// When it was queued (its time to first token is counted from there).
    pub(crate) queued: std::time::Instant,
}

/// Why a backend did not take a request.
pub(crate) enum Refused {
    /// Too many wait already (429).
    Busy(String),
    /// It cannot be served as asked (400).
    Input(String),
    /// The server is stopping (503).
    Stopping,
}

/// Where the server's requests are computed: this process's generation loop ([`local`]), or
/// prefill and decode instances behind the LLM router ([`cluster`]).
pub(crate) trait Backend: Send + Sync {
    /// Takes the jobs of one request (its choices), all or none. A job whose answer's receiver
    /// is dropped (its client went away) is ended early.
    fn submit(&self, jobs: Vec<Job>) -> Result<(), Refused>;
    /// Takes no more jobs; returns once every job taken is answered and the backend stopped.
    fn close(&self, rt: &tokio::runtime::Runtime) -> anyhow::Result<()>;
    /// Resolves, with why, if the backend can no longer serve (an instance process exited).
    fn broken(&self) -> futures_util::future::BoxFuture<'static, anyhow::Error> {
        Box::pin(std::future::pending())
    }
    /// Metrics of its own for `/metrics` (the server's counters go there too); `None`: the server's.
    fn metrics(&self) -> Option<Arc<Metrics>> {
        None
    }
}

/// What every request's handler shares.
struct Served {
    /// The model's tokenizer and chat template.
    text: Arc<ModelText>,
    /// Where requests are computed.
    backend: Arc<dyn Backend>,
    /// The model's name in answers: its directory, as given.
    model: String,
    defaults: Defaults,
    /// Requests taken so far (a request's number).
    taken: AtomicU64,
    /// Choices drawn so far without a seed of their own: the index the next draws as.
    draws: AtomicU64,
    /// What `/metrics` shows.
    metrics: Arc<Metrics>,
    /// `/v1/embeddings`' model, if it is served.
    embeddings: Option<embeddings::Embeddings>,
}

impl Served {
    /// Counts a request answered (`outcome`: answered, refused or failed).
    fn count(&self, outcome: &str) {
        let help =
            "Requests the LLM server took, by outcome (answered, busy: a 429, refused: another 4xx, failed: a 5xx)";
        self.metrics.counter("cascade_llm_server_requests", help, &[("outcome", outcome)]).inc();
    }

    /// Counts an answer's prompt and completion tokens.
    fn tokens(&self, o: &Generated) {
        let help = "Tokens of the LLM server's answered requests, by kind (prompt, completion)";
        self.metrics
            .counter("cascade_llm_server_tokens", help, &[("kind", "prompt")])
            .inc_by(o.prompt_tokens.len() as u64);
        self.metrics
            .counter("cascade_llm_server_tokens", help, &[("kind", "completion")])
            .inc_by(o.tokens.len() as u64);
    }
}

/// An answer: its status and JSON body.
type Answer = (StatusCode, Json<Value>);

fn refused(status: StatusCode, why: &str) -> Answer {
    (status, Json(crate::openai::error(why)))
}

/// Runs the server until Ctrl-C (or SIGTERM).
pub(crate) fn run(a: LlmServerArgs) -> anyhow::Result<()> {
    if a.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    crate::models::ensure_smollm2(&a.model)?;
    let seed = crate::generate::given_or_random(a.seed)?;
    let metrics = Arc::new(Metrics::new());
    // Loaded first: a model that fails to load stops nothing started.
    let embeddings = match &a.embed_model {
        Some(dir) => {
            crate::models::ensure_minilm(dir, true)?;
            Some(embeddings::Embeddings::start(dir, a.max_waiting)?)
        }
        None => None,
    };
    let (text, backend, rt, serving): (_, Arc<dyn Backend>, _, _) = if a.pd.pd {
        let (c, rt) = cluster::Cluster::start(&a.model, &a.pd, a.max_waiting)?;
        let what = c.describe();
        (c.text(), c, rt, what)
    } else {
        let g = Arc::new(
            Generator::from_dir(&a.model).with_context(|| format!("loading the model in {}", a.model.display()))?,
        );
        let l = local::Local::start(g.clone(), metrics.clone(), a.max_waiting)?;
        (g.text().clone(), Arc::new(l), tokio::runtime::Runtime::new()?, "this process".to_string())
    };
    // A cluster's metrics are its router's node's (the router's and the transport's counters too).
    let metrics = backend.metrics().unwrap_or(metrics);
    let served = Arc::new(Served {
        text,
        backend: backend.clone(),
        model: a.model.display().to_string(),
        defaults: Defaults { max_tokens: a.max_tokens, seed },
        taken: AtomicU64::new(0),
        draws: AtomicU64::new(0),
        metrics,
        embeddings,
    });
    let app = Router::new()
        .route("/v1/completions", post(|s, body| answer(s, body, false)))
        .route("/v1/chat/completions", post(|s, body| answer(s, body, true)))
        .route("/v1/embeddings", post(embed))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .with_state(served.clone());
    let served_out = rt.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("listening on {}", a.listen))?;
        let at = listener.local_addr()?;
        let embedding = match &served.embeddings {
            Some(e) => format!(", /v1/embeddings with {}", e.model),
            None => String::new(),
        };
        println!(
            "listening on http://{at} (model {}, computed by {serving}; POST /v1/completions, /v1/chat/completions{embedding}; \
             seed {seed} for requests without one)",
            served.model
        );
        use std::io::Write;
        std::io::stdout().flush()?;
        // Ctrl-C or SIGTERM, or a backend that can no longer serve (what broke comes back).
        let (broke, why) = oneshot::channel();
        let broken = backend.broken();
        let stop = async move {
            tokio::select! {
                _ = stopped() => {}
                e = broken => drop(broke.send(e)),
            }
        };
        axum::serve(listener, app).with_graceful_shutdown(stop).await?;
        anyhow::Ok(why.await.ok())
    });
    // No new request: the backend stops once the ones it runs are answered.
    let closed = backend.close(&rt);
    if let Some(e) = &served.embeddings {
        e.close();
    }
    println!("stopped after {} requests", served.taken.load(Ordering::Relaxed));
    if let Some(e) = served_out? {
        return Err(e.context("the server stopped"));
    }
    closed
}

/// Ctrl-C or SIGTERM.
async fn stopped() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// `POST /v1/completions` (`chat`: `/v1/chat/completions`): the answer whole, or as server-sent
/// events (`stream: true`).
async fn answer(State(s): State<Arc<Served>>, body: axum::body::Bytes, chat: bool) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (served, t) = (s.clone(), std::time::Instant::now());
    let answer = taken(s, body, chat).await;
    let outcome = match &answer {
        Ok(_) => "answered",
        Err((StatusCode::TOO_MANY_REQUESTS, _)) => "busy",
        Err((status, _)) if status.is_client_error() => "refused",
        Err(_) => "failed",
    };
    served.count(outcome);
    if !matches!(answer, Ok(Taken::Streamed(_))) {
        let help =
            "Requests the LLM server answered whole, from arrival to answer (streamed ones: to their first event)";
        served.metrics.histogram("cascade_llm_server_request_seconds", help, &[]).observe(t.elapsed().as_secs_f64());
    }
    match answer {
        Ok(Taken::Whole(a)) | Err(a) => a.into_response(),
        Ok(Taken::Streamed(sse)) => sse.into_response(),
    }
}

/// `GET /metrics`: the server's counters in the OpenMetrics text format.
async fn metrics_text(State(s): State<Arc<Served>>) -> impl axum::response::IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        s.metrics.render(),
    )
}

/// The events of a streamed answer.
type Events = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Event, std::convert::Infallible>> + Send>>;

/// A request's answer: whole, or as server-sent events.
enum Taken {
    Whole(Answer),
    Streamed(Sse<Events>),
}

/// A request taken and queued: its answer (`Err`: refused).
async fn taken(s: Arc<Served>, body: axum::body::Bytes, chat: bool) -> Result<Taken, Answer> {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return Err(refused(StatusCode::BAD_REQUEST, &format!("not a JSON body: {e}"))),
    };
    let n = s.taken.fetch_add(1, Ordering::Relaxed);
    let taking = {
        let s = s.clone();
        tokio::task::spawn_blocking(move || crate::openai::request(&s.text, &body, chat, &s.defaults, n))
    };
    let request = match taking.await {
        Ok(Ok(Ok(r))) => r,
        Ok(Ok(Err(why))) => return Err(refused(StatusCode::BAD_REQUEST, &why)),
        Ok(Err(e)) => return Err(refused(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())),
        Err(e) => return Err(refused(StatusCode::INTERNAL_SERVER_ERROR, &format!("taking the request: {e}"))),
    };
    // Dropped before the answer is whole (the client went away), it ends the generation.
    let mut cancel = Cancel::new();
    // Choice k draws as its own index: 0, 1, … under the request's own seed, the next of the
    // server's count of choices drawn otherwise.
    let first = if request.own_seed { 0 } else { s.draws.fetch_add(request.choices as u64, Ordering::Relaxed) };
    let (tokens, streamed) = match request.stream {
        true => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        }
        false => (None, None),
    };
    let mut answers = Vec::with_capacity(request.choices);
    let mut jobs = Vec::with_capacity(request.choices);
    for k in 0..request.choices {
        let (reply, answered) = oneshot::channel();
        let mut prompt = request.prompt.clone();
        prompt.draws_as = Some(first + k as u64);
        prompt.cancel = Some(cancel.0.clone());
        jobs.push(Job { prompt, reply, tokens: tokens.clone(), queued: std::time::Instant::now() });
        answers.push(answered);
    }
    drop(tokens);
    // Refused, the jobs queued already end at once: their flag is set as `cancel` drops.
    match s.backend.submit(jobs) {
        Ok(()) => {}
        Err(Refused::Busy(why)) => return Err(refused(StatusCode::TOO_MANY_REQUESTS, &why)),
        Err(Refused::Input(why)) => return Err(refused(StatusCode::BAD_REQUEST, &why)),
        Err(Refused::Stopping) => return Err(refused(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping")),
    }
    if let Some(rx) = streamed {
        let events = Streaming {
            s,
            n,
            chat,
            stops: request.stops,
            rx,
            answered: answers.pop(),
            cancel,
            wants_usage: request.usage,
            usage: None,
            tokens: Vec::new(),
            sent: String::new(),
            events: 0,
            over: false,
        };
        let events: Events = Box::pin(futures_util::stream::unfold(events, Streaming::next));
        return Ok(Taken::Streamed(Sse::new(events)));
    }
    let mut outs = Vec::with_capacity(answers.len());
    for answered in answers {
        let Ok(out) = answered.await else {
            return Err(refused(
                StatusCode::INTERNAL_SERVER_ERROR,
                "its generation failed (the server's log says why)",
            ));
        };
        s.tokens(&out);
        outs.push(out);
    }
    cancel.1 = true;
    match crate::openai::completion(&s.text, &s.model, crate::openai::now(), n as usize, chat, &request.stops, &outs) {
        Ok(body) => Ok(Taken::Whole((StatusCode::OK, Json(body)))),
        Err(e) => Err(refused(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())),
    }
}

/// A streamed answer between two events: the tokens so far and the text sent.
struct Streaming {
    s: Arc<Served>,
    n: u64,
    chat: bool,
    stops: StopStrings,
    rx: tokio::sync::mpsc::UnboundedReceiver<u32>,
    /// The whole answer, until it came.
    answered: Option<oneshot::Receiver<Generated>>,
    /// Ends the generation if the stream is dropped before the answer is whole.
    cancel: Cancel,
    /// Whether a last chunk gives the tokens counted (`stream_options.include_usage`), and that
    /// chunk's usage once the answer is whole.
    wants_usage: bool,
    usage: Option<Value>,
    tokens: Vec<u32>,
    sent: String,
    /// Chunks sent (the first opens the assistant's message).
    events: usize,
    /// `[DONE]` sent.
    over: bool,
}

impl Streaming {
    /// The next event: a chunk of new text as tokens come, the last chunk (the rest of the text,
    /// and why it finished) once the answer is whole, then `[DONE]`, as OpenAI streams them.
    async fn next(mut self) -> Option<(Result<Event, std::convert::Infallible>, Streaming)> {
        if self.over {
            return None;
        }
        let created = crate::openai::now();
        while let Some(tok) = self.rx.recv().await {
            self.tokens.push(tok);
            let Some(text) = crate::openai::visible(&self.s.text, &self.stops, &self.tokens) else { continue };
            if text.len() > self.sent.len() && text.starts_with(&self.sent) {
                let delta = text[self.sent.len()..].to_string();
                self.sent = text;
                return Some((Ok(self.event(created, &delta, None)), self));
            }
        }
        if let Some(usage) = self.usage.take() {
            // The last chunk before [DONE]: no choice, the tokens counted.
            let mut chunk = crate::openai::chunk(&self.s.model, created, self.n, self.chat, "", false, None);
            chunk["choices"] = json!([]);
            chunk["usage"] = usage;
            return Some((Ok(Event::default().data(chunk.to_string())), self));
        }
        let Some(answered) = self.answered.take() else {
            self.over = true;
            return Some((Ok(Event::default().data("[DONE]")), self));
        };
        let event = match answered.await {
            Ok(out) => {
                self.cancel.1 = true;
                self.s.tokens(&out);
                if self.wants_usage {
                    let (p, c) = (out.prompt_tokens.len(), out.tokens.len());
                    self.usage = Some(json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}));
                }
                let finish = crate::openai::finish_reason(&self.s.text, &out);
                // The whole answer's text: nothing held back any more.
                let text = crate::openai::answer_text(&self.s.text, &self.stops, &out.tokens).unwrap_or_default();
                let delta = text.get(self.sent.len()..).unwrap_or_default().to_string();
                self.event(created, &delta, Some(finish))
            }
            Err(_) => {
                let why = "its generation failed (the server's log says why)";
                Event::default().data(crate::openai::error(why).to_string())
            }
        };
        Some((Ok(event), self))
    }

    fn event(&mut self, created: u64, delta: &str, finish: Option<&str>) -> Event {
        let role = self.events == 0;
        self.events += 1;
        let chunk = crate::openai::chunk(&self.s.model, created, self.n, self.chat, delta, role, finish);
        Event::default().data(chunk.to_string())
    }
}

/// A request's cancel flag, set when this is dropped before the answer is whole (`.1`): the
/// handler's future or the event stream dropped because the client went away.
struct Cancel(Arc<std::sync::atomic::AtomicBool>, bool);

impl Cancel {
    fn new() -> Cancel {
        Cancel(Arc::new(std::sync::atomic::AtomicBool::new(false)), false)
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// `GET /v1/models`: the one model served.
async fn models(State(s): State<Arc<Served>>) -> Json<Value> {
    let model = |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "cascade"});
    let mut data = vec![model(&s.model)];
    data.extend(s.embeddings.as_ref().map(|e| model(&e.model)));
    Json(json!({"object": "list", "data": data}))
}

/// `POST /v1/embeddings` ([`embeddings`]), counted by outcome.
async fn embed(State(s): State<Arc<Served>>, body: axum::body::Bytes) -> Answer {
    let answer = match (&s.embeddings, serde_json::from_slice::<Value>(&body)) {
        (None, _) => Err((
            StatusCode::NOT_FOUND,
            "no embedding model is served: start the server with --embed-model DIR".to_string(),
        )),
        (Some(_), Err(e)) => Err((StatusCode::BAD_REQUEST, format!("not a JSON body: {e}"))),
        (Some(e), Ok(body)) => e.answer(&body).await,
    };
    let outcome = match &answer {
        Ok(_) => "answered",
        Err((StatusCode::TOO_MANY_REQUESTS, _)) => "busy",
        Err((status, _)) if status.is_client_error() => "refused",
        Err(_) => "failed",
    };
    let help = "Embedding requests the LLM server took, by outcome (answered, busy: a 429, refused: another 4xx, \
                failed: a 5xx)";
    s.metrics.counter("cascade_llm_server_embedding_requests", help, &[("outcome", outcome)]).inc();
    match answer {
        Ok(body) => (StatusCode::OK, Json(body)),
        Err((status, why)) => refused(status, &why),
    }
}
