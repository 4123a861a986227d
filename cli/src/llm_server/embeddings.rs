//! `POST /v1/embeddings` (with `--embed-model DIR`): sentence embeddings with OpenAI's
//! embeddings API, computed by [`Embedder`] (all-MiniLM-L6-v2: mean pooling, unit length, as
//! sentence-transformers gives them) on a thread of their own. The texts of the requests waiting
//! when a pass starts run together ([`Embedder::embed_counting_tokens`] batches them), each request
//! answered with its own.
//!
//! A body holds `input` (a string, or a list of at most [`MAX_INPUTS`] non-empty strings of at
//! most [`TEXT_LINE`] bytes; token arrays are refused), `model` (any string), `encoding_format`
//! (`float`, or `base64`: the little-endian f32s, as OpenAI's Python client asks by default),
//! `dimensions` (only the model's own) and `user`. `usage` counts the tokens each text was
//! embedded from (`[CLS]` and `[SEP]` included, after the model's cut of a long text).

use std::path::Path;
use std::sync::{mpsc, Mutex};

use anyhow::Context;
use axum::http::StatusCode;
use base64::Engine;
use cascade_exec::embed::Embedder;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::input::TEXT_LINE;

/// Texts one request may hold at most (OpenAI's limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// Texts one pass over waiting requests gathers, at most (more wait for the next).
const GATHER: usize = 256;

/// A request's embeddings and the tokens they were embedded from, or why not.
type Embedded = Result<(Vec<Vec<f32>>, usize), String>;

/// A request's texts, and where their embeddings go.
struct Job {
    texts: Vec<String>,
    reply: oneshot::Sender<Embedded>,
}

/// The embedding thread and its queue.
pub(crate) struct Embeddings {
    jobs: Mutex<Option<mpsc::SyncSender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The model's name in answers: its directory, as given.
    pub(crate) model: String,
    dim: usize,
    max_waiting: usize,
}

impl Embeddings {
    /// Loads the model in `dir` and starts its thread; at most `max_waiting` requests wait.
    pub(crate) fn start(dir: &Path, max_waiting: usize) -> anyhow::Result<Embeddings> {
        let e = Embedder::from_dir(dir).with_context(|| format!("loading the embedding model in {}", dir.display()))?;
        let dim = e.model().config().hidden_size;
        let (tx, rx) = mpsc::sync_channel::<Job>(max_waiting);
        let thread = std::thread::Builder::new().name("embeddings".into()).spawn(move || embedding(&e, &rx))?;
        Ok(Embeddings {
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            model: dir.display().to_string(),
            dim,
            max_waiting,
        })
    }

    /// Takes no more requests; returns once those taken are answered.
    pub(crate) fn close(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// The answer to `body`, or its status and why not.
    pub(crate) async fn answer(&self, body: &Value) -> Result<Value, (StatusCode, String)> {
        let bad = |why: String| (StatusCode::BAD_REQUEST, why);
        let Some(body) = body.as_object() else { return Err(bad("no body (an object)".into())) };
        if let Some(k) =
            body.keys().find(|k| !["input", "model", "encoding_format", "dimensions", "user"].contains(&k.as_str()))
        {
            return Err(bad(format!("body.{k} is not supported here")));
        }
        let texts = texts(body.get("input")).map_err(bad)?;
        let base64 = match body.get("encoding_format").filter(|v| !v.is_null()).map(|v| v.as_str()) {
            None | Some(Some("float")) => false,
            Some(Some("base64")) => true,
            Some(_) => return Err(bad(format!("body.encoding_format {}: float or base64", body["encoding_format"]))),
        };
        match body.get("dimensions").filter(|v| !v.is_null()) {
            None => {}
            Some(d) if d.as_u64() == Some(self.dim as u64) => {}
            Some(d) => return Err(bad(format!("body.dimensions {d}: the model's embeddings have {}", self.dim))),
        }
        let (reply, answered) = oneshot::channel();
        let sent = match self.jobs.lock() {
            Ok(q) => q.as_ref().map(|q| q.try_send(Job { texts, reply })),
            Err(_) => None,
        };
        match sent {
            Some(Ok(())) => {}
            Some(Err(mpsc::TrySendError::Full(_))) => {
                let why = format!("{} embedding requests wait already: send it again later", self.max_waiting);
                return Err((StatusCode::TOO_MANY_REQUESTS, why));
            }
            _ => return Err((StatusCode::SERVICE_UNAVAILABLE, "the server is stopping".into())),
        }
        let (vectors, tokens) = match answered.await {
            Ok(Ok(x)) => x,
            Ok(Err(why)) => return Err((StatusCode::INTERNAL_SERVER_ERROR, why)),
            Err(_) => return Err((StatusCode::INTERNAL_SERVER_ERROR, "the embedding thread stopped".into())),
        };
        let data: Vec<Value> = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let embedding = if base64 {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    json!(v)
                };
                json!({"object": "embedding", "index": i, "embedding": embedding})
            })
            .collect();
        Ok(json!({
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }))
    }
}

/// `input`'s texts: a string, or a list of strings, each non-empty and at most [`TEXT_LINE`]
/// bytes, [`MAX_INPUTS`] at most.
fn texts(input: Option<&Value>) -> Result<Vec<String>, String> {
    let texts: Vec<String> = match input {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            a.iter().filter_map(Value::as_str).map(str::to_string).collect()
        }
        Some(Value::Array(a)) if a.is_empty() => return Err("body.input: an empty list".into()),
        Some(Value::Array(_)) => return Err("body.input: strings (token arrays are not taken here)".into()),
        _ => return Err("body.input: a string or a list of strings".into()),
    };
    if texts.len() > MAX_INPUTS {
        return Err(format!("body.input: {} texts, {MAX_INPUTS} at most", texts.len()));
    }
    if let Some(k) = texts.iter().position(String::is_empty) {
        return Err(format!("body.input[{k}]: an empty string"));
    }
    if let Some(k) = texts.iter().position(|t| t.len() > TEXT_LINE) {
        return Err(format!("body.input[{k}]: longer than {}", crate::input::size(TEXT_LINE)));
    }
    Ok(texts)
}

/// The embedding thread: the requests waiting, up to [`GATHER`] texts, embedded together and
/// each answered with its own. Returns when the queue closes.
fn embedding(e: &Embedder, rx: &mpsc::Receiver<Job>) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        let mut gathered = jobs[0].texts.len();
        while gathered < GATHER {
            let Ok(j) = rx.try_recv() else { break };
            gathered += j.texts.len();
            jobs.push(j);
        }
        let texts: Vec<&str> = jobs.iter().flat_map(|j| j.texts.iter().map(String::as_str)).collect();
        let done = e.embed_counting_tokens(&texts);
        match done {
            Ok((vectors, counts)) => {
                let (mut vectors, mut counts) = (vectors.into_iter(), counts.into_iter());
                for j in jobs {
                    let n = j.texts.len();
                    let mine: Vec<Vec<f32>> = vectors.by_ref().take(n).collect();
                    let tokens: usize = counts.by_ref().take(n).sum();
                    let _ = j.reply.send(Ok((mine, tokens)));
                }
            }
            Err(err) => {
                tracing::error!(error = %err, "an embedding pass failed: its requests are answered with the error");
                for j in jobs {
                    let _ = j.reply.send(Err(format!("embedding failed: {err}")));
                }
            }
        }
    }
}
