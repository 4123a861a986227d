//! `cascade llm-server`: an LLM served over HTTP with OpenAI's completions and chat completions
//! API (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`;
//! `GET /metrics`: requests by outcome, tokens, times to first token and to answer),
//! the bodies as [`crate::openai`] takes and gives them.
//!
//! The requests of every connection go to one generation loop on a thread of its own
//! ([`Generator::generate_stream`]): up to 32 decode together, a request arriving while others
//! run joins the next step, and one finished hands its slot to the next — continuous batching,
//! each with its own budget, sampling and stop strings. A request is tokenised (and its chat
//! rendered) on a blocking thread of the HTTP runtime, not on the loop; the loop's answer comes
//! back through a oneshot channel (`n` choices: the prompt queued that many times); a client that goes away (its connection closed before its
//! answer is whole) ends its generation after the next token. With `stream: true` the answer
//! comes as server-sent events,
//! a chunk of text as its tokens come (none of a stop string), as OpenAI streams it. A choice
//! without a seed of its own draws as the server's count of such choices, from `--seed`
//! (random otherwise).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use cascade_exec::llama::generate::{Generated, Generator, StreamPrompt};
use cascade_exec::llama::sample::Decoding;
use cascade_exec::llama::stop::StopStrings;
use cascade_transport::metrics::Metrics;
use clap::Args;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::openai::Defaults;

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
    /// (a request is taken only while the loop is idle).
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
}

/// A request for the generation loop: its prompt, where its answer goes, and (streamed) where
/// each token goes as it comes.
struct Job {
    prompt: StreamPrompt,
    reply: oneshot::Sender<Generated>,
    tokens: Option<tokio::sync::mpsc::UnboundedSender<u32>>,
    /// When it was queued (its time to first token is counted from there).
    queued: std::time::Instant,
}

/// A job the loop runs: where its answer and tokens go, when it was queued, whether its first
/// token came.
struct Running {
    reply: oneshot::Sender<Generated>,
    tokens: Option<tokio::sync::mpsc::UnboundedSender<u32>>,
    queued: std::time::Instant,
    first: bool,
}

/// What every request's handler shares.
struct Served {
    g: Arc<Generator>,
    /// The model's name in answers: its directory, as given.
    model: String,
    defaults: Defaults,
    /// Requests taken so far (a request's number).
    taken: AtomicU64,
    /// Choices drawn so far without a seed of their own: the index the next draws as.
    draws: AtomicU64,
    /// The generation loop's queue (`None` once the server stops).
    jobs: Mutex<Option<mpsc::SyncSender<Job>>>,
    /// What `/metrics` shows.
    metrics: Arc<Metrics>,
    /// Requests that may wait for the loop at most.
    max_waiting: usize,
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
    let g =
        Arc::new(Generator::from_dir(&a.model).with_context(|| format!("loading the model in {}", a.model.display()))?);
    let seed = crate::generate::given_or_random(a.seed)?;
    let (tx, rx) = mpsc::sync_channel::<Job>(a.max_waiting);
    let metrics = Arc::new(Metrics::new());
    let looping = {
        let (g, metrics) = (g.clone(), metrics.clone());
        std::thread::Builder::new().name("generation".into()).spawn(move || generation(&g, &rx, &metrics))?
    };
    let served = Arc::new(Served {
        g,
        model: a.model.display().to_string(),
        defaults: Defaults { max_tokens: a.max_tokens, seed },
        taken: AtomicU64::new(0),
        draws: AtomicU64::new(0),
        jobs: Mutex::new(Some(tx)),
        metrics,
        max_waiting: a.max_waiting,
    });
    let app = Router::new()
        .route("/v1/completions", post(|s, body| answer(s, body, false)))
        .route("/v1/chat/completions", post(|s, body| answer(s, body, true)))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .with_state(served.clone());
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("listening on {}", a.listen))?;
        let at = listener.local_addr()?;
        println!(
            "listening on http://{at} (model {}; POST /v1/completions, /v1/chat/completions; seed {seed} for requests \
             without one)",
            served.model
        );
        use std::io::Write;
        std::io::stdout().flush()?;
        axum::serve(listener, app).with_graceful_shutdown(stopped()).await?;
        anyhow::Ok(())
    })?;
    // No new request: the loop ends once the ones it runs are answered.
    served.jobs.lock().map_err(|_| anyhow::anyhow!("the queue's lock was poisoned"))?.take();
    drop(rt);
    looping.join().map_err(|_| anyhow::anyhow!("the generation loop panicked"))?;
    println!("stopped after {} requests", served.taken.load(Ordering::Relaxed));
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn stopped() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// The generation loop: jobs as they come, batched by [`Generator::generate_stream`], each
/// answer sent back when its sequence ends (a streamed one's tokens as they come). Returns when
/// the queue closes.
fn generation(g: &Generator, rx: &mpsc::Receiver<Job>, metrics: &Metrics) {
    let none = StopStrings::default();
    let ttft = metrics.histogram(
        "cascade_llm_server_first_token_seconds",
        "From a request's queueing to its first token in the LLM server's generation loop",
        &[],
    );
    loop {
        let replies = std::cell::RefCell::new(std::collections::HashMap::new());
        let mut closed = false;
        let mut k = 0usize;
        let jobs = std::iter::from_fn(|| {
            // While sequences run, a job not yet sent is not waited for; with none, the loop waits.
            let job = if replies.borrow().is_empty() {
                let j = rx.recv().ok();
                closed = j.is_none();
                j?
            } else {
                rx.try_recv().ok()?
            };
            let running = Running { reply: job.reply, tokens: job.tokens, queued: job.queued, first: false };
            replies.borrow_mut().insert(k, running);
            k += 1;
            Some(job.prompt)
        });
        let on_token = |i, tok| {
            let mut replies = replies.borrow_mut();
            let Some(r) = replies.get_mut(&i) else { return };
            if !r.first {
                r.first = true;
                ttft.observe(r.queued.elapsed().as_secs_f64());
            }
            if let Some(tokens) = &r.tokens {
                let _ = tokens.send(tok);
            }
        };
        // Its token channel closes as its answer is sent: every token came before.
        let on_done = |i, out| {
            if let Some(r) = replies.borrow_mut().remove(&i) {
                if r.reply.send(out).is_err() {
                    let help = "Requests the LLM server stopped generating because their client went away";
                    metrics.counter("cascade_llm_server_cancelled", help, &[]).inc();
                }
            }
        };
        if let Err(e) = g.generate_stream(jobs, usize::MAX, Decoding::Greedy, &none, on_token, on_done) {
            // The requests it ran are answered with errors (their senders dropped); the loop goes on.
            tracing::error!(error = %e, "a generation step failed: the requests running are answered with an error");
        }
        if closed {
            return;
        }
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
        tokio::task::spawn_blocking(move || crate::openai::request(&s.g, &body, chat, &s.defaults, n))
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
    // Whether every choice was queued (`Some(true)`), or the queue was full (`Some(false)`: those
    // queued end at once, their flag set as `cancel` drops).
    let sent = match s.jobs.lock() {
        Ok(queue) => queue.as_ref().and_then(|q| {
            jobs.into_iter()
                .map(|job| match q.try_send(job) {
                    Ok(()) => Some(true),
                    Err(mpsc::TrySendError::Full(_)) => Some(false),
                    Err(mpsc::TrySendError::Disconnected(_)) => None,
                })
                .find(|sent| sent != &Some(true))
                .unwrap_or(Some(true))
        }),
        Err(_) => None,
    };
    match sent {
        Some(true) => {}
        Some(false) => {
            let why = format!("{} requests wait already: send it again later", s.max_waiting);
            return Err(refused(StatusCode::TOO_MANY_REQUESTS, &why));
        }
        None => return Err(refused(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping")),
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
    match crate::openai::completion(&s.g, &s.model, crate::openai::now(), n as usize, chat, &request.stops, &outs) {
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
            let Some(text) = crate::openai::visible(&self.s.g, &self.stops, &self.tokens) else { continue };
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
                let finish = crate::openai::finish_reason(&self.s.g, &out);
                // The whole answer's text: nothing held back any more.
                let text = crate::openai::answer_text(&self.s.g, &self.stops, &out.tokens).unwrap_or_default();
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
    Json(json!({"object": "list", "data": [{"id": s.model, "object": "model", "created": 0, "owned_by": "cascade"}]}))
}
