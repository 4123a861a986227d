//! The request and answer bodies of OpenAI's completions and chat completions API, as
//! `cascade generate --batch` and `cascade llm-server` take and give them.
//!
//! What a body may hold: `model` (any string: the model served is the one loaded), `prompt` (a
//! string, or a list of one) or `messages` (`system`/`user`/`assistant` messages with string
//! content, rendered by the model's chat template with the assistant's turn opened),
//! `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `top_k` (as vLLM takes it),
//! `seed`, `stop` (a string or a list of at most 16), `stream` (the server sends the answer as
//! server-sent events; a batch refuses it) with `stream_options.include_usage`, `n` (up to 16
//! choices, each drawn as its own index; one when streamed or in a batch), `logprobs` (a chat
//! completion's `true` with `top_logprobs` 0–20, a completion's 0–5: each answer token's
//! log-probability under the model, before temperature, with that many alternatives; not
//! streamed), `presence_penalty` and `frequency_penalty` (−2 to 2) and vLLM's
//! `repetition_penalty` ([`Penalties`]), and `user`. A message's content is a string or a list of
//! text parts. Fields clients send with their defaults (`logit_bias` {}, `echo` false, …:
//! [`NEUTRAL`]) are accepted with those values; any other field or value is refused, naming it,
//! rather than ignored (logit biases and tools are not computed here).
//!
//! Where this departs from OpenAI's defaults: a request without `max_tokens` gets the server's
//! (or run's) `--max-tokens` (OpenAI: 16 for completions, none for chat), so that each reserves
//! a bounded part of the KV cache. As OpenAI, a request without `temperature` samples at 1. A
//! request with a `seed` draws its `n`-th token from the seed and `n` alone — the same body and
//! seed give the same text wherever and whenever it comes; one without draws from the run's
//! seed and the index it is given.

use cascade_exec::llama::chat::Message;
use cascade_exec::llama::generate::{Generated, StreamPrompt};
use cascade_exec::llama::penalty::Penalties;
use cascade_exec::llama::sample::Decoding;
use cascade_exec::llama::stop::StopStrings;
use cascade_exec::llama::text::ModelText;
use cascade_exec::ExecError;
use serde_json::{json, Map, Value};

/// The body fields a request may hold.
const FIELDS: [&str; 19] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
];

/// Whether a field's value asks for nothing beyond the default.
type AsksNothing = fn(&Value) -> bool;

/// Fields clients send with a value that asks for nothing (OpenAI's defaults): accepted with that
/// value, refused with any other, naming it. `null` is always accepted.
const NEUTRAL: [(&str, AsksNothing); 5] = [
    ("logit_bias", |v| v.as_object().is_some_and(Map::is_empty)),
    ("echo", |v| v == &Value::Bool(false)),
    ("best_of", |v| v.as_u64() == Some(1)),
    ("response_format", |v| v.get("type").and_then(Value::as_str) == Some("text")),
    ("parallel_tool_calls", |v| v.is_boolean()),
];

/// What the run gives a request that does not say.
pub(crate) struct Defaults {
    /// Tokens to generate at most.
    pub(crate) max_tokens: usize,
    /// The seed of a request without one.
    pub(crate) seed: u64,
}

/// A request's prompt and stop strings, from its body (`chat`: a chat completion's, with
/// `messages`), or why it cannot be served. `index` is the index a request without a seed draws
/// as (a request with one draws as 0: its seed alone decides). `Err` only when the model's
/// tokenizer or template fails.
pub(crate) fn request(
    g: &ModelText,
    body: &Value,
    chat: bool,
    defaults: &Defaults,
    index: u64,
) -> Result<Result<Request, String>, ExecError> {
    let refuse = |why: String| Ok(Err(why));
    let Some(body) = body.as_object() else {
        return refuse("no body (an object)".into());
    };
    for (k, v) in body {
        let neutral =
            NEUTRAL.iter().find(|(name, _)| name == k).map(|(_, asks_nothing)| v.is_null() || asks_nothing(v));
        match neutral {
            Some(true) => {}
            Some(false) => return refuse(format!("body.{k} {v} is not supported here (only its default)")),
            None if !FIELDS.contains(&k.as_str()) => return refuse(format!("body.{k} is not supported here")),
            None => {}
        }
    }
    let settings = match Settings::of(body, chat, defaults) {
        Ok(s) => s,
        Err(why) => return refuse(why),
    };
    let text = match (chat, body.get("prompt"), body.get("messages")) {
        (false, Some(p), None) => match p {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
            _ => return refuse("body.prompt: a string (or a list of one)".into()),
        },
        (true, None, Some(m)) => match conversation(g, m)? {
            Ok(text) => text,
            Err(why) => return refuse(why),
        },
        (false, ..) => return refuse("a completion's body needs a prompt (and no messages)".into()),
        (true, ..) => return refuse("a chat completion's body needs messages (and no prompt)".into()),
    };
    let tokens = match g.prompt(&text)? {
        Ok(t) => t,
        Err(why) => return refuse(why),
    };
    let prompt = StreamPrompt {
        tokens,
        // A seed of its own: its draws are its own, wherever it comes.
        draws_as: Some(if settings.own_seed { 0 } else { index }),
        max_tokens: Some(settings.max_tokens),
        decoding: Some(settings.decoding),
        stop: Some(settings.stops.clone()),
        cancel: None,
        logprobs: settings.logprobs,
        penalties: settings.penalties,
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let usage = match body.get("stream_options").filter(|o| !o.is_null()) {
        None => false,
        Some(_) if !stream => return refuse("body.stream_options applies to a streamed answer (stream: true)".into()),
        Some(o) => match o.get("include_usage") {
            Some(Value::Bool(b)) if o.as_object().is_some_and(|m| m.len() == 1) => *b,
            _ => return refuse(format!("body.stream_options {o}: only include_usage (true or false)")),
        },
    };
    if settings.logprobs.is_some() && stream {
        return refuse("body.logprobs with stream: log-probabilities come with whole answers here".into());
    }
    if settings.choices > 1 && stream {
        return refuse(format!("body.n {}: one choice when streamed", settings.choices));
    }
    Ok(Ok(Request {
        prompt,
        stops: settings.stops,
        stream,
        usage,
        choices: settings.choices,
        own_seed: settings.own_seed,
    }))
}

/// A request taken: the prompt to generate from, where its text is cut, and how it is answered.
pub(crate) struct Request {
    /// Its tokens and settings.
    pub(crate) prompt: StreamPrompt,
    /// Its stop strings.
    pub(crate) stops: StopStrings,
    /// Whether its answer is sent as it is generated (`stream: true`).
    pub(crate) stream: bool,
    /// Streamed, whether a last chunk gives the tokens counted (`stream_options.include_usage`).
    pub(crate) usage: bool,
    /// Choices asked for (`n`): the prompt generated from that many times, choice `k` drawing
    /// as its own index.
    pub(crate) choices: usize,
    /// Whether it gave its own seed (its choices draw as 0, 1, …).
    pub(crate) own_seed: bool,
}

/// Choices one request may ask for at most (`n`).
pub(crate) const MAX_CHOICES: u64 = 16;

/// The body of a completion's answer (`chat`: a chat completion's) to request number `n`:
/// each choice's text (without end-of-sequence, cut at its first stop string) and why it
/// finished, and the tokens counted.
pub(crate) fn completion(
    g: &ModelText,
    model: &str,
    created: u64,
    n: usize,
    chat: bool,
    stops: &StopStrings,
    choices: &[Generated],
) -> Result<Value, ExecError> {
    let mut each = Vec::with_capacity(choices.len());
    for (k, o) in choices.iter().enumerate() {
        let text = answer_text(g, stops, &o.tokens)?;
        let finish = finish_reason(g, o);
        let logprobs = logprobs(g, o, &text, chat)?;
        each.push(if chat {
            json!({"index": k, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish})
        });
    }
    // The prompt counted once, as OpenAI counts it for several choices.
    let p = choices.first().map_or(0, |o| o.prompt_tokens.len());
    let c: usize = choices.iter().map(|o| o.tokens.len()).sum();
    Ok(json!({
        "id": format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": model,
        "choices": each,
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
    }))
}

/// A choice's `logprobs` (`null` unless its request asked): for each token of its answer whose
/// text begins before the answer's `text` ends (cut at a stop string; end of sequence not among
/// them), the token, its log-probability and the most likely alternatives' — a chat
/// completion's `{"content": [{token, logprob, bytes, top_logprobs}]}`, a completion's
/// `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets in characters of prompt and
/// answer together, as OpenAI's legacy API counts them).
fn logprobs(g: &ModelText, o: &Generated, text: &str, chat: bool) -> Result<Value, ExecError> {
    if o.logprobs.is_empty() {
        return Ok(Value::Null);
    }
    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    // Characters begun in `b`: its bytes that are not continuation bytes.
    let chars = |b: &[u8]| b.iter().filter(|&&x| x & 0xC0 != 0x80).count();
    let mut at = (0usize, chars(g.decode(&o.prompt_tokens)?.as_bytes()));
    let (mut content, mut tokens, mut token_lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![], vec![]);
    for (&tok, lp) in o.tokens.iter().zip(&o.logprobs) {
        if tok == g.eos() || at.0 >= text.len() {
            break;
        }
        let bytes = g.token_bytes(tok);
        if chat {
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(t, l)| {
                    let b = g.token_bytes(t);
                    json!({"token": lossy(&b), "logprob": l, "bytes": b})
                })
                .collect();
            content.push(json!({"token": lossy(&bytes), "logprob": lp.logprob, "bytes": bytes, "top_logprobs": top}));
        } else {
            let top: Map<String, Value> = lp.top.iter().map(|&(t, l)| (lossy(&g.token_bytes(t)), json!(l))).collect();
            tokens.push(lossy(&bytes));
            token_lps.push(lp.logprob);
            tops.push(top);
            offsets.push(at.1);
        }
        at = (at.0 + bytes.len(), at.1 + chars(&bytes));
    }
    Ok(if chat {
        json!({"content": content, "refusal": null})
    } else {
        json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
    })
}

/// The text of `tokens` (a sequence so far) that can be shown while more may come: none while
/// it ends inside a character (its last bytes wait for the next token), cut where a stop string
/// begins, and short of an end that could begin one (a stop string is never shown). End of
/// sequence is not text.
pub(crate) fn visible(g: &ModelText, stops: &StopStrings, tokens: &[u32]) -> Option<String> {
    let mut text = answer_text(g, stops, tokens).ok()?;
    if text.ends_with('\u{FFFD}') {
        return None;
    }
    // Cut already where a stop string begins; otherwise short of what could begin one.
    if stops.cut(&text).is_none() {
        text.truncate(text.len() - stops.held_back(&text));
    }
    Some(text)
}

/// The text of a finished sequence's `tokens` as its answer gives it: without end of sequence,
/// cut where its first stop string begins. (A streamed answer's chunks add up to it.)
pub(crate) fn answer_text(g: &ModelText, stops: &StopStrings, tokens: &[u32]) -> Result<String, ExecError> {
    let eos = g.eos();
    let mut text = g.decode(tokens.strip_suffix(&[eos]).unwrap_or(tokens))?;
    if let Some((at, _)) = stops.cut(&text) {
        text.truncate(at);
    }
    Ok(text)
}

/// One event of a streamed answer to request number `n`: `delta`, the text since the last, and
/// (with the last) why it finished — a `text_completion` chunk, or a `chat.completion.chunk`
/// (`role`: the first, opening the assistant's message).
pub(crate) fn chunk(
    model: &str,
    created: u64,
    n: u64,
    chat: bool,
    delta: &str,
    role: bool,
    finish: Option<&str>,
) -> Value {
    let choice = if chat {
        let mut d = json!({"content": delta});
        if role {
            d["role"] = "assistant".into();
        }
        json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
    } else {
        json!({"index": 0, "text": delta, "logprobs": null, "finish_reason": finish})
    };
    json!({
        "id": format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
        "created": created,
        "model": model,
        "choices": [choice],
    })
}

/// Why a finished sequence finished: `"stop"` at end of sequence or a stop string, `"length"`
/// at its budget or the context window.
pub(crate) fn finish_reason(g: &ModelText, o: &Generated) -> &'static str {
    if o.tokens.last() == Some(&g.eos()) || o.stopped {
        "stop"
    } else {
        "length"
    }
}

/// The body of an error answer, as OpenAI's API gives one.
pub(crate) fn error(why: &str) -> Value {
    json!({"error": {"message": why, "type": "invalid_request_error", "param": null, "code": null}})
}

/// Now, in Unix seconds (a completion's `created`).
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A request's settings, checked.
struct Settings {
    max_tokens: usize,
    decoding: Decoding,
    own_seed: bool,
    stops: StopStrings,
    choices: usize,
    /// Log-probabilities asked for: with this many alternatives at each token.
    logprobs: Option<usize>,
    /// Penalties on tokens seen (`None`: none).
    penalties: Option<Penalties>,
}

impl Settings {
    fn of(body: &Map<String, Value>, chat: bool, defaults: &Defaults) -> Result<Settings, String> {
        let number = |k: &str| -> Result<Option<f64>, String> {
            body.get(k)
                .filter(|v| !v.is_null())
                .map(|v| v.as_f64().ok_or(format!("body.{k} {v}: a number")))
                .transpose()
        };
        let count = |k: &str| -> Result<Option<u64>, String> {
            body.get(k)
                .filter(|v| !v.is_null())
                .map(|v| v.as_u64().ok_or(format!("body.{k} {v}: a whole number, 0 or more")))
                .transpose()
        };
        let choices = match count("n")? {
            None => 1,
            Some(n @ 1..=MAX_CHOICES) => n as usize,
            Some(n) => return Err(format!("body.n {n}: from 1 to {MAX_CHOICES} choices")),
        };
        if body.get("stream").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
            return Err("body.stream: true or false".into());
        }
        if !chat && body.contains_key("max_completion_tokens") {
            return Err("body.max_completion_tokens is a chat completion's; a completion's is max_tokens".into());
        }
        let budget = match (count("max_tokens")?, count("max_completion_tokens")?) {
            (Some(_), Some(_)) => return Err("body.max_tokens and body.max_completion_tokens: one of them".into()),
            (m, c) => m.or(c),
        };
        let max_tokens = match budget {
            Some(0) => return Err("body.max_tokens 0: at least 1".into()),
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => defaults.max_tokens,
        };
        let temperature = number("temperature")?.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(format!("body.temperature {temperature}: from 0 to 2"));
        }
        let top_p = number("top_p")?.unwrap_or(1.0);
        let top_k = count("top_k")?.unwrap_or(0);
        let seed = match body.get("seed").filter(|v| !v.is_null()) {
            None => None,
            // OpenAI's seed is a signed 64-bit integer: its bits.
            Some(v) => Some(v.as_i64().map(|s| s as u64).or(v.as_u64()).ok_or(format!("body.seed {v}: an integer"))?),
        };
        let decoding = Decoding::new(
            temperature as f32,
            usize::try_from(top_k).unwrap_or(usize::MAX),
            top_p as f32,
            seed.unwrap_or(defaults.seed),
        )
        .map_err(|e| format!("body: {e}"))?;
        let stops = match body.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
                a.iter().filter_map(Value::as_str).map(str::to_string).collect()
            }
            Some(v) => return Err(format!("body.stop {v}: a string or a list of strings")),
        };
        let stops = StopStrings::new(stops).map_err(|e| format!("body.stop: {e}"))?;
        let logprobs = Settings::logprobs(body, chat)?;
        let penalties = Penalties::new(
            number("presence_penalty")?.unwrap_or(0.0) as f32,
            number("frequency_penalty")?.unwrap_or(0.0) as f32,
            number("repetition_penalty")?.unwrap_or(1.0) as f32,
        )
        .map_err(|e| format!("body: {e}"))?;
        let penalties = (!penalties.is_neutral()).then_some(penalties);
        Ok(Settings { max_tokens, decoding, own_seed: seed.is_some(), stops, choices, logprobs, penalties })
    }

    /// A chat completion's `logprobs: true` with `top_logprobs` alternatives (0 to 20), or a
    /// completion's `logprobs` alternatives (0 to 5), as OpenAI takes them; `None`: not asked.
    fn logprobs(body: &Map<String, Value>, chat: bool) -> Result<Option<usize>, String> {
        let get = |k: &str| body.get(k).filter(|v| !v.is_null());
        let top = get("top_logprobs");
        if chat {
            let asked = match get("logprobs") {
                None | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(v) => return Err(format!("body.logprobs {v}: true or false")),
            };
            let n = match top.map(|v| (v, v.as_u64())) {
                None => 0,
                Some((_, Some(n @ 0..=20))) if asked => n as usize,
                Some((v, Some(0..=20))) => return Err(format!("body.top_logprobs {v} needs logprobs: true")),
                Some((v, _)) => return Err(format!("body.top_logprobs {v}: from 0 to 20")),
            };
            return Ok(asked.then_some(n));
        }
        if top.is_some() {
            return Err("body.top_logprobs is a chat completion's; a completion's is logprobs, a number".into());
        }
        match get("logprobs") {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n @ 0..=5) => Ok(Some(n as usize)),
                _ => Err(format!("body.logprobs {v}: from 0 to 5 (the alternatives at each token)")),
            },
        }
    }
}

/// `messages` rendered by the model's chat template, the assistant's turn opened.
fn conversation(g: &ModelText, messages: &Value) -> Result<Result<String, String>, ExecError> {
    let Some(list) = messages.as_array().filter(|l| !l.is_empty()) else {
        return Ok(Err("body.messages: a list of at least one message".into()));
    };
    let mut each = Vec::with_capacity(list.len());
    for (k, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        // A string, or a list of parts (as newer clients send it) of which only text is read.
        let content = match m.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Ok(Err(format!(
                            "body.messages[{k}].content[{j}]: a part of type {kind:?}; only text parts are read here"
                        )))
                        }
                    }
                }
                Some(text)
            }
            _ => None,
        };
        match (role, content) {
            (Some(role @ ("system" | "user" | "assistant")), Some(content)) => each.push((role, content)),
            _ => return Ok(Err(format!("body.messages[{k}]: a role (system, user or assistant) and text content"))),
        }
    }
    let template = match g.chat_template() {
        Ok(t) => t,
        Err(e) => return Ok(Err(format!("a chat completion, and the model has no usable chat template: {e}"))),
    };
    let messages: Vec<Message<'_>> = each.iter().map(|(role, content)| Message { role, content }).collect();
    Ok(template.render(&messages, true).map_err(|e| e.to_string()))
}
