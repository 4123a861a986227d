//! `cascade generate --batch FILE`: requests in the input format of OpenAI's Batch API, one JSON
//! object per line — `{"custom_id", "method": "POST", "url": "/v1/completions" or
//! "/v1/chat/completions", "body": {…}}` — each with its own prompt or messages, budget, sampling
//! and stop strings ([`crate::openai`] says what a body may hold), answered one JSON object per
//! line in their order in the shape of that API's output (`{"id", "custom_id", "response":
//! {"status_code", "request_id", "body"}, "error"}`). A request without a seed draws as its line's
//! index.

use std::io::Write;

use cascade_exec::llama::generate::{Generated, Generator, StreamPrompt};
use cascade_exec::llama::stop::StopStrings;
use cascade_exec::ExecError;
use serde_json::{json, Value};

use crate::openai::Defaults;

/// What a request's answer needs of it besides its tokens.
pub(crate) struct Asked {
    /// Its line (from 0).
    line: usize,
    /// Its `custom_id`, when the line had one.
    custom_id: Option<String>,
    /// A chat completion (`/v1/chat/completions`) rather than a text one.
    chat: bool,
    /// Where its text is cut.
    stops: StopStrings,
}

impl Asked {
    /// A line that could not be read as a request (the model failed on it): answered by line.
    pub(crate) fn unread(line: usize) -> Asked {
        Asked { line, custom_id: None, chat: false, stops: StopStrings::default() }
    }
}

/// Line `line` of a batch file (`cut`: longer than what is read): what its answer needs, and
/// the prompt to generate from, or why it cannot be served. `Err` only when the model's
/// tokenizer or template fails.
pub(crate) fn parse(
    g: &Generator,
    text: &str,
    cut: bool,
    line: usize,
    defaults: &Defaults,
) -> Result<(Asked, Result<StreamPrompt, String>), ExecError> {
    let mut asked = Asked::unread(line);
    if cut {
        return Ok((asked, Err(crate::input::Line::cut_refusal(crate::input::PROMPT_LINE))));
    }
    let request: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Ok((asked, Err(format!("not a JSON request: {e}")))),
    };
    asked.custom_id = request.get("custom_id").and_then(Value::as_str).map(str::to_string);
    if asked.custom_id.is_none() {
        return Ok((asked, Err("no custom_id (a string) to answer it under".into())));
    }
    if let Some(m) = request.get("method").filter(|m| m.as_str() != Some("POST")) {
        return Ok((asked, Err(format!("method {m}: only POST"))));
    }
    asked.chat = match request.get("url").and_then(Value::as_str) {
        Some("/v1/completions") => false,
        Some("/v1/chat/completions") => true,
        other => return Ok((asked, Err(format!("url {other:?}: /v1/completions or /v1/chat/completions")))),
    };
    let body = request.get("body").unwrap_or(&Value::Null);
    let taken = crate::openai::request(g.text(), body, asked.chat, defaults, line as u64)?.and_then(|r| {
        if r.stream {
            return Err("body.stream: a batch's answers come whole (false)".into());
        }
        if r.choices > 1 {
            return Err(format!("body.n {}: one choice per line in a batch", r.choices));
        }
        asked.stops = r.stops;
        Ok(r.prompt)
    });
    Ok((asked, taken))
}

/// Writes the answer to `asked`'s request: its completion, or the error that refused it, as
/// OpenAI's Batch API output line (`created` in Unix seconds; `model` the model served).
pub(crate) fn show(
    out: &mut impl Write,
    g: &Generator,
    model: &str,
    created: u64,
    asked: &Asked,
    o: Result<&Generated, &str>,
) -> anyhow::Result<()> {
    let request_id = format!("req_{}", asked.line);
    let response = match o {
        Err(why) => json!({"status_code": 400, "request_id": request_id, "body": crate::openai::error(why)}),
        Ok(o) => {
            let one = std::slice::from_ref(o);
            let body = crate::openai::completion(g.text(), model, created, asked.line, asked.chat, &asked.stops, one)?;
            json!({"status_code": 200, "request_id": request_id, "body": body})
        }
    };
    let line = json!({
        "id": format!("batch_req_{}", asked.line),
        "custom_id": asked.custom_id,
        "response": response,
        "error": null,
    });
    writeln!(out, "{line}")?;
    Ok(out.flush()?)
}
