//! `cascade llm-server` over HTTP with the real SmolLM2: OpenAI's completions and chat
//! completions answered as `cascade generate` answers the same prompts, requests from several
//! connections at once each answered alike, streamed answers whose chunks make the same text,
//! bad requests refused with their reasons, and a SIGTERM ending the server cleanly; the same
//! with `--pd` (prefill and decode instance processes behind the router). Skips, saying so,
//! without the model.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use common::{scratch, smollm2, CASCADE};
use serde_json::{json, Value};

/// One HTTP/1.1 request to `addr` (`host:port`), the connection closed after: its status and
/// JSON body (`Value::Null` for a body that is not JSON).
fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    // A request never answered fails the test rather than hanging it.
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// A streamed chat request of 4,000 tokens (minutes of generation), read up to its first event:
/// the connection, open.
fn long_stream(addr: &str) -> BufReader<TcpStream> {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let messages = json!([{"role": "user", "content": "Tell me a story about a cat."}]);
    let long =
        json!({"messages": messages, "max_tokens": 4000, "temperature": 0, "stream": true, "stop": "never said"})
            .to_string();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let mut lines = BufReader::new(c);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(lines.read_line(&mut line).unwrap() > 0, "the stream ended before its first event");
    }
    lines
}

/// With no request allowed to wait (`--max-waiting 0`), one sent while another runs is answered
/// 429 at once, saying so, and counted; once the running one is gone, a request is served.
#[test]
fn a_request_beyond_the_waiting_bound_is_answered_429() {
    let d = scratch("llm-server-busy");
    let Some(model) = smollm2(&d) else { return };
    let (_server, addr) = start(&model, &["--max-waiting", "0"]);
    let running = long_stream(&addr);
    let short = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let (status, body) = call(&addr, "POST", "/v1/completions", Some(&short));
    assert_eq!(status, 429, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("0 requests wait already"), "{body}");
    assert!(call_text(&addr, "/metrics").contains("cascade_llm_server_requests_total{outcome=\"busy\"} 1"));
    drop(running);
    let t = std::time::Instant::now();
    loop {
        let (status, body) = call(&addr, "POST", "/v1/completions", Some(&short));
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{body}");
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "never served after the running one left");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `GET path`: the whole response as text (status line, headers, body).
fn call_text(addr: &str, path: &str) -> String {
    let mut m = TcpStream::connect(addr).unwrap();
    m.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    write!(m, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    m.read_to_string(&mut text).unwrap();
    text
}

/// A streamed answer's events: the `data:` of each, from a chunked HTTP/1.1 response to `body`.
fn events(addr: &str, path: &str, body: &Value) -> Vec<String> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).unwrap();
    let text = String::from_utf8(reply).unwrap();
    let (head, mut rest) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200") && head.contains("text/event-stream"), "{head}");
    // Undo the chunked transfer encoding.
    let mut stream = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        stream.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    stream.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// The server's process, killed if the test fails before it stops it (a server left running
/// would hold the test's output open, and `cargo test` would wait for it).
struct Server(Option<Child>);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // Two SIGTERMs: a server with instance processes (`--pd`) kills them at the second;
            // SIGKILL would leave them serving.
            for _ in 0..2 {
                let _ = Command::new("kill").arg(c.id().to_string()).status();
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            let t = std::time::Instant::now();
            while c.try_wait().ok().flatten().is_none() && t.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The server on a free port (with `extra` arguments), and its address.
fn start(model: &std::path::Path, extra: &[&str]) -> (Server, String) {
    let mut child = Command::new(CASCADE)
        .args(["llm-server", "--listen", "127.0.0.1:0", "--model"])
        .arg(model)
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string();
    (Server(Some(child)), addr)
}

/// What `cascade generate --json` answers `extra`'s prompts: their texts.
fn generated(model: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let out = Command::new(CASCADE).args(["generate", "--json", "--model"]).arg(model).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn the_server_answers_completions_as_generate_does_from_several_connections_at_once() {
    let d = scratch("llm-server");
    let Some(model) = smollm2(&d) else { return };
    let prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are", "Water boils at"];
    let story = "Tell me a story about a cat.";
    let mut args: Vec<&str> = vec!["--max-tokens", "8"];
    prompts.iter().for_each(|p| args.extend(["--prompt", p]));
    let want = generated(&model, &args);
    let chat = generated(&model, &["--chat", "--max-tokens", "12", "--prompt", story]);

    let (mut server, addr) = start(&model, &[]);
    // Four connections at once: each answered with its own prompt's greedy text.
    let texts: Vec<(u16, Value)> = std::thread::scope(|s| {
        let each: Vec<_> = prompts
            .iter()
            .map(|p| {
                let addr = &addr;
                s.spawn(move || {
                    call(
                        addr,
                        "POST",
                        "/v1/completions",
                        Some(&json!({"prompt": p, "max_tokens": 8, "temperature": 0})),
                    )
                })
            })
            .collect();
        each.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((status, body), want) in texts.iter().zip(&want) {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["text"], want.as_str(), "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 8);
    }
    let messages = json!([{"role": "user", "content": story}]);
    let (status, body) = call(
        &addr,
        "POST",
        "/v1/chat/completions",
        Some(&json!({"messages": messages, "max_tokens": 12, "temperature": 0})),
    );
    assert_eq!((status, body["object"].as_str()), (200, Some("chat.completion")), "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], chat[0].trim_end_matches("<|im_end|>"));
    // One seed, one text, whenever it comes — three choices (n), each its own draw, the prompt
    // counted once.
    let seeded = json!({"messages": messages, "max_tokens": 12, "seed": 3, "temperature": 1.0, "n": 3});
    let first = call(&addr, "POST", "/v1/chat/completions", Some(&seeded)).1;
    let again = call(&addr, "POST", "/v1/chat/completions", Some(&seeded)).1;
    assert_eq!(first["choices"], again["choices"]);
    let texts: Vec<&Value> = (0..3).map(|k| &first["choices"][k]["message"]["content"]).collect();
    assert!(texts[0] != texts[1] && texts[1] != texts[2], "{first}");
    assert_eq!(
        (first["choices"][2]["index"].as_u64(), first["usage"]["completion_tokens"].as_u64()),
        (Some(2), Some(36))
    );
    assert_eq!(first["usage"]["prompt_tokens"], body["usage"]["prompt_tokens"]);

    // Streamed: chunks whose text makes the whole answer's, the first opening the assistant's
    // message, the last saying why it finished, then [DONE]; a stop string spanning tokens is
    // never sent.
    let whole = chat[0].trim_end_matches("<|im_end|>");
    // Sent as clients send it: the content as text parts, the defaults said outright, and the
    // tokens counted asked for in a last chunk.
    let as_clients_send = json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": story}]}], "max_tokens": 12,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}, "n": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": false, "logit_bias": {}, "top_p": 1
    });
    let mut streamed = events(&addr, "/v1/chat/completions", &as_clients_send);
    assert_eq!(streamed.pop().as_deref(), Some("[DONE]"), "{streamed:?}");
    let usage: Value = serde_json::from_str(&streamed.pop().unwrap()).unwrap();
    assert_eq!((&usage["choices"], &usage["usage"]["completion_tokens"]), (&json!([]), &json!(12)), "{usage}");
    let chunks: Vec<Value> = streamed.iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.len() > 2, "{chunks:?}");
    let text: String = chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(text, whole);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let finish: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).collect();
    assert!(
        finish[..finish.len() - 1].iter().all(|f| f.is_null()) && finish.last().unwrap() == &"length",
        "{finish:?}"
    );
    let words: Vec<&str> = whole.split_whitespace().collect();
    let stop = format!(" {} {}", words[words.len() / 2], words[words.len() / 2 + 1]);
    let cut = &whole[..whole.find(&stop).unwrap()];
    let streamed = events(
        &addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "stream": true, "stop": stop}),
    );
    let chunks: Vec<Value> = streamed[..streamed.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!((text.as_str(), chunks.last().unwrap()["choices"][0]["finish_reason"].as_str()), (cut, Some("stop")));
    // A stop string the answer's end only begins (held back while more might come) is sent with
    // the last chunk once the answer is whole: the chunks still make the whole text.
    let tail: String = whole.chars().rev().take(3).collect::<Vec<_>>().into_iter().rev().collect();
    let begun = format!("{tail}never");
    let streamed = events(
        &addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "stream": true, "stop": begun}),
    );
    let chunks: Vec<Value> = streamed[..streamed.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
    assert_eq!(
        (text.as_str(), chunks.last().unwrap()["choices"][0]["finish_reason"].as_str()),
        (whole, Some("length"))
    );

    for (body, why) in [
        (json!({"prompt": "x", "logprobs": 7}), "body.logprobs 7: from 0 to 5"),
        (json!({"prompt": "x", "stream": "yes"}), "body.stream"),
        (json!({"prompt": "x", "presence_penalty": 3}), "presence penalty 3: from -2 to 2"),
        (json!({"messages": messages}), "needs a prompt"),
        (json!({"prompt": ""}), "an empty prompt"),
    ] {
        let (status, answer) = call(&addr, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer["error"]["message"].as_str().unwrap().contains(why), "{body}: {answer}");
    }
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{{x}}")
        .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 400") && reply.contains("not a JSON body"), "{reply}");
    assert_eq!(call(&addr, "GET", "/nothing", None).0, 404);
    let (status, listed) = call(&addr, "GET", "/v1/models", None);
    assert_eq!((status, listed["data"][0]["id"].as_str()), (200, model.to_str()));

    // What /metrics counted: ten answered (three streamed), six refused (one no JSON), a first
    // token timed for each choice of the answered ones (two of them of three choices).
    let metrics = call_text(&addr, "/metrics");
    for line in [
        "cascade_llm_server_requests_total{outcome=\"answered\"} 10",
        "cascade_llm_server_requests_total{outcome=\"refused\"} 6",
        "cascade_llm_server_first_token_seconds_count{} 14",
    ] {
        assert!(metrics.contains(line), "{line} not in:\n{metrics}");
    }

    // A client that goes away mid-stream: its generation ends (4,000 tokens would take minutes).
    drop(long_stream(&addr));
    let gone = std::time::Instant::now();
    loop {
        let metrics = call_text(&addr, "/metrics");
        if metrics.contains("cascade_llm_server_cancelled_total{} 1") {
            break;
        }
        assert!(gone.elapsed() < std::time::Duration::from_secs(60), "still generating for a client gone:\n{metrics}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    eprintln!("generation for a client gone ended {:?} after it left", gone.elapsed());

    // SIGTERM: the server stops, saying how many requests it took.
    let mut server = server.0.take().unwrap();
    assert!(Command::new("kill").arg(server.id().to_string()).status().unwrap().success());
    let status = server.wait().unwrap();
    let mut rest = String::new();
    server.stdout.take().unwrap().read_to_string(&mut rest).unwrap();
    assert!(status.success() && rest.contains("stopped after 16 requests"), "{status:?}: {rest}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Waits (60 s at most) until `/metrics` holds `line`; how long it took.
fn metric_reaches(addr: &str, line: &str) -> std::time::Duration {
    let t = std::time::Instant::now();
    loop {
        let metrics = call_text(addr, "/metrics");
        if metrics.contains(line) {
            return t.elapsed();
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "{line} never came:\n{metrics}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// With `--pd` the answers come from a prefill and a decode instance process behind the router:
/// the same texts as `cascade generate`'s (greedy, and sampled from a request's seed, choice by
/// choice), from several connections at once; streamed, cut at a stop string; a client that goes
/// away cancels its request at the router; SIGTERM answers the request in flight, then stops
/// the instances and the server.
#[test]
fn the_pd_server_answers_as_generate_does_cancels_and_stops_gracefully() {
    let d = scratch("llm-server-pd");
    let Some(model) = smollm2(&d) else { return };
    let prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"];
    let mut args: Vec<&str> = vec!["--max-tokens", "8"];
    prompts.iter().for_each(|p| args.extend(["--prompt", p]));
    let want = generated(&model, &args);
    let story = "Once upon a time";
    let sampled = generated(
        &model,
        &["--max-tokens", "10", "--temperature", "0.9", "--seed", "5", "--prompt", story, "--prompt", story],
    );
    let logs = d.join("logs");
    let (mut server, addr) = start(&model, &["--pd", "--logs", logs.to_str().unwrap()]);
    let texts: Vec<(u16, Value)> = std::thread::scope(|s| {
        let each: Vec<_> = prompts
            .iter()
            .map(|p| {
                let addr = &addr;
                let body = json!({"prompt": p, "max_tokens": 8, "temperature": 0});
                s.spawn(move || call(addr, "POST", "/v1/completions", Some(&body)))
            })
            .collect();
        each.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((status, body), want) in texts.iter().zip(&want) {
        assert_eq!((*status, body["choices"][0]["text"].as_str()), (200, Some(want.as_str())), "{body}");
    }
    let seeded = json!({"prompt": story, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 2});
    let (status, body) = call(&addr, "POST", "/v1/completions", Some(&seeded));
    assert_eq!(status, 200, "{body}");
    let got: Vec<&str> = (0..2).map(|k| body["choices"][k]["text"].as_str().unwrap()).collect();
    assert_eq!(got, sampled.iter().map(String::as_str).collect::<Vec<_>>(), "{body}");
    let (status, body) = call(&addr, "POST", "/v1/completions", Some(&json!({"prompt": story, "logprobs": 1})));
    assert!(status == 400 && body["error"]["message"].as_str().unwrap().contains("not computed with --pd"), "{body}");
    // A prompt past the instances' default 512 tokens is prefilled (the server raises it to
    // 2,048); one past 2,048 is refused before it reaches the router.
    let sentence = "The pool keeps k copies of every model and repairs itself when a node dies. ";
    let (status, body) =
        call(&addr, "POST", "/v1/completions", Some(&json!({"prompt": sentence.repeat(40), "max_tokens": 2})));
    assert!(status == 200 && body["usage"]["prompt_tokens"].as_u64().unwrap() > 512, "{body}");
    let (status, body) = call(&addr, "POST", "/v1/completions", Some(&json!({"prompt": sentence.repeat(160)})));
    assert!(status == 400 && body["error"]["message"].as_str().unwrap().contains("take 2048 at most"), "{body}");
    let penalised = json!({"prompt": story, "frequency_penalty": 1});
    let (status, body) = call(&addr, "POST", "/v1/completions", Some(&penalised));
    assert!(status == 400 && body["error"]["message"].as_str().unwrap().contains("not applied with --pd"), "{body}");
    // Streamed with a stop string in the middle of the greedy answer: the text up to it.
    let whole = &want[0];
    let words: Vec<&str> = whole.split_whitespace().collect();
    let stop = format!(" {}", words[words.len() / 2]);
    let cut = &whole[..whole.find(&stop).unwrap()];
    let streamed = events(
        &addr,
        "/v1/completions",
        &json!({"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "stream": true, "stop": stop}),
    );
    let chunks: Vec<Value> = streamed[..streamed.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!((text.as_str(), chunks.last().unwrap()["choices"][0]["finish_reason"].as_str()), (cut, Some("stop")));

    // A client gone mid-stream: the router cancels its request and stops its decode.
    drop(long_stream(&addr));
    let took = metric_reaches(&addr, "cascade_llm_router_requests_total{outcome=\"cancelled\"} 1");
    eprintln!("the router cancelled the request of a client gone {took:?} after it left");

    // SIGTERM with a request in flight: it is answered, then everything stops.
    let in_flight = std::thread::spawn({
        let addr = addr.clone();
        move || call(&addr, "POST", "/v1/completions", Some(&json!({"prompt": "The sky is", "max_tokens": 16})))
    });
    metric_reaches(&addr, "cascade_llm_router_pending{} 1");
    let mut server = server.0.take().unwrap();
    assert!(Command::new("kill").arg(server.id().to_string()).status().unwrap().success());
    let (status, body) = in_flight.join().unwrap();
    assert_eq!((status, body["usage"]["completion_tokens"].as_u64()), (200, Some(16)), "{body}");
    let exited = server.wait().unwrap();
    let mut rest = String::new();
    server.stdout.take().unwrap().read_to_string(&mut rest).unwrap();
    assert!(exited.success() && rest.contains("1 cancelled") && rest.contains("stopped after 11 requests"), "{rest}");
    // No instance of this server runs any more.
    assert!(instances(&logs).is_empty(), "{:?}", instances(&logs));
    let _ = std::fs::remove_dir_all(&d);
}

/// The command lines of the processes running with the cluster file in `logs` (a `--pd`
/// server's instances; zombies not reaped yet have none).
fn instances(logs: &std::path::Path) -> Vec<String> {
    let cluster = std::fs::canonicalize(logs).unwrap().join("cluster.toml");
    let cluster = cluster.to_str().unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            Some((e.file_name().to_str()?.parse::<u32>().ok()?, std::fs::read(e.path().join("cmdline")).ok()?))
        })
        .map(|(pid, c)| format!("{pid}: {}", String::from_utf8_lossy(&c).replace('\0', " ")))
        .filter(|c| c.contains(cluster))
        .collect()
}

/// A `--pd` server killed outright (SIGKILL: no handler runs) takes its instance processes with
/// it: the kernel sends them SIGTERM as it dies.
#[test]
fn a_killed_pd_server_leaves_no_instance_serving() {
    let d = scratch("llm-server-pd-killed");
    let Some(model) = smollm2(&d) else { return };
    let logs = d.join("logs");
    let (mut server, _addr) = start(&model, &["--pd", "--decode-instances", "2", "--logs", logs.to_str().unwrap()]);
    assert_eq!(instances(&logs).len(), 3, "{:?}", instances(&logs));
    let mut server = server.0.take().unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    let t = std::time::Instant::now();
    while !instances(&logs).is_empty() {
        if t.elapsed() > std::time::Duration::from_secs(30) {
            let left = instances(&logs);
            for pid in left.iter().filter_map(|l| l.split(':').next()) {
                let _ = Command::new("kill").arg(pid).status();
            }
            panic!("left serving: {left:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    eprintln!("the instances were gone {:?} after the server was killed", t.elapsed());
    let _ = std::fs::remove_dir_all(&d);
}

/// Log-probabilities (`logprobs`) against the independent reference (`exec/testdata`: numpy over
/// the GGUF's weights): the gap between the two most likely tokens' log-probabilities is the gap
/// between their logits, the reference's margin, at every step up to its first near-tie; each
/// greedy token's is the largest; a chat completion gives the same numbers in its own shape, with
/// each token's bytes making the answer's text; streamed they are refused (with --pd: the pd
/// test).
#[test]
fn log_probabilities_match_the_independent_references_margins() {
    let d = scratch("llm-server-logprobs");
    let Some(model) = smollm2(&d) else { return };
    let (_server, addr) = start(&model, &[]);
    let reference: Value = serde_json::from_str(include_str!("../../exec/testdata/smollm2_reference.json")).unwrap();
    for r in reference["prompts"].as_array().unwrap().iter().take(2) {
        let margins: Vec<f64> = r["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect();
        let steps = margins.iter().position(|&m| m < 0.3).unwrap() + 1;
        let body = json!({"prompt": r["prompt"], "max_tokens": steps, "temperature": 0, "logprobs": 2});
        let (status, answer) = call(&addr, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{answer}");
        let lp = &answer["choices"][0]["logprobs"];
        let tops = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(tops.len(), steps, "{lp}");
        for (k, (top, margin)) in tops.iter().zip(&margins).enumerate() {
            let mut v: Vec<f64> = top.as_object().unwrap().values().map(|x| x.as_f64().unwrap()).collect();
            v.sort_by(|a, b| b.total_cmp(a));
            assert!(
                ((v[0] - v[1]) - margin).abs() < 0.05,
                "{}: step {k}: gap {} against {margin}",
                r["prompt"],
                v[0] - v[1]
            );
            assert!(v[0] <= 0.0 && v[0] == lp["token_logprobs"][k].as_f64().unwrap(), "{lp}");
        }
        let text: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(text, answer["choices"][0]["text"].as_str().unwrap());
    }
    let messages = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let body = json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let (status, answer) = call(&addr, "POST", "/v1/chat/completions", Some(&body));
    assert_eq!(status, 200, "{answer}");
    let content = answer["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let bytes: Vec<u8> =
        content.iter().flat_map(|c| c["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), answer["choices"][0]["message"]["content"].as_str().unwrap());
    for c in content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!((top.len(), &top[0]["token"], &top[0]["logprob"]), (3, &c["token"], &c["logprob"]), "{c}");
    }
    for (body, why) in [
        (json!({"messages": messages, "logprobs": true, "stream": true}), "log-probabilities come with whole answers"),
        (json!({"messages": messages, "top_logprobs": 2}), "needs logprobs: true"),
        (json!({"messages": messages, "logprobs": true, "top_logprobs": 21}), "from 0 to 20"),
    ] {
        let (status, answer) = call(&addr, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer["error"]["message"].as_str().unwrap().contains(why), "{body}: {answer}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `/v1/embeddings` (`--embed-model`) against the independent numpy reference
/// (`exec/testdata/minilm_reference.json`): each sentence's embedding within cosine 0.9999 and the
/// tokens counted as the reference's; base64 the same floats; two requests at once each answered
/// with its own texts' embeddings; bad bodies refused with their reasons.
#[test]
fn embeddings_match_the_independent_reference() {
    use base64::Engine;
    let d = scratch("llm-server-embeddings");
    let (Some(model), Some(minilm)) = (smollm2(&d), cascade_tests::models::minilm()) else { return };
    let (_server, addr) = start(&model, &["--embed-model", minilm.to_str().unwrap()]);
    let reference: Value = serde_json::from_str(include_str!("../../exec/testdata/minilm_reference.json")).unwrap();
    let sentences = reference["sentences"].as_array().unwrap();
    let texts: Vec<&str> = sentences.iter().map(|s| s["text"].as_str().unwrap()).collect();
    let floats = |v: &Value| -> Vec<f64> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let (status, body) = call(&addr, "POST", "/v1/embeddings", Some(&json!({"input": texts, "model": "x"})));
    assert_eq!(status, 200, "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), texts.len());
    for (k, (got, want)) in data.iter().zip(sentences).enumerate() {
        assert_eq!((got["index"].as_u64(), got["object"].as_str()), (Some(k as u64), Some("embedding")));
        let (a, b) = (floats(&got["embedding"]), floats(&want["embedding"]));
        let dot: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let cosine = dot / (norm(&a) * norm(&b));
        assert!(cosine >= 0.9999, "{:?}: cosine {cosine}", texts[k]);
    }
    let tokens: usize = sentences.iter().map(|s| s["ids"].as_array().unwrap().len()).sum();
    assert_eq!(body["usage"]["prompt_tokens"].as_u64(), Some(tokens as u64), "{}", body["usage"]);
    // base64: the same floats, little-endian f32.
    let b64 = json!({"input": texts[0], "encoding_format": "base64"});
    let (status, encoded) = call(&addr, "POST", "/v1/embeddings", Some(&b64));
    assert_eq!(status, 200, "{encoded}");
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(encoded["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    // The JSON floats are the f32s' shortest decimals: read back as f32, the same values.
    let as_f32: Vec<f32> = floats(&data[0]["embedding"]).iter().map(|&x| x as f32).collect();
    assert!(decoded == as_f32, "base64 and float embeddings differ");
    // Two requests at once, each its own texts.
    let both: Vec<(u16, Value)> = std::thread::scope(|s| {
        let each: Vec<_> = [&texts[..2], &texts[2..]]
            .into_iter()
            .map(|part| {
                let addr = &addr;
                s.spawn(move || call(addr, "POST", "/v1/embeddings", Some(&json!({"input": part}))))
            })
            .collect();
        each.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((status, got), from) in both.iter().zip([0, 2]) {
        assert_eq!(*status, 200, "{got}");
        for (k, e) in got["data"].as_array().unwrap().iter().enumerate() {
            let (a, b) = (floats(&e["embedding"]), floats(&data[from + k]["embedding"]));
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5), "text {}", from + k);
        }
    }
    for (body, why) in [
        (json!({"input": ""}), "body.input[0]: an empty string"),
        (json!({"input": [1, 2, 3]}), "token arrays are not taken"),
        (json!({"input": "x", "dimensions": 12}), "the model's embeddings have 384"),
        (json!({"input": "x", "encoding_format": "hex"}), "float or base64"),
        (json!({"text": "x"}), "body.text is not supported"),
    ] {
        let (status, answer) = call(&addr, "POST", "/v1/embeddings", Some(&body));
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer["error"]["message"].as_str().unwrap().contains(why), "{body}: {answer}");
    }
    let (_, listed) = call(&addr, "GET", "/v1/models", None);
    assert_eq!(listed["data"][1]["id"].as_str(), minilm.to_str());
    assert!(
        call_text(&addr, "/metrics").contains("cascade_llm_server_embedding_requests_total{outcome=\"answered\"} 4")
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Penalties on tokens seen: on a prompt greedy decoding loops on (" dog, cat," over and over),
/// a frequency penalty of 1 or a repetition penalty of 1.3 breaks the loop — fewer "dog"s — and
/// neutral ones change nothing (with --pd they are refused: the pd test).
#[test]
fn penalties_break_a_greedy_loop() {
    let d = scratch("llm-server-penalties");
    let Some(model) = smollm2(&d) else { return };
    let (_server, addr) = start(&model, &[]);
    let text = |extra: Value| -> String {
        let mut body =
            json!({"prompt": "List of animals: dog, cat, dog, cat, dog, cat,", "max_tokens": 24, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, answer) = call(&addr, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{answer}");
        answer["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let plain = text(json!({}));
    let dogs = |s: &str| s.matches("dog").count();
    assert!(dogs(&plain) >= 5, "{plain:?}");
    assert_eq!(text(json!({"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1})), plain);
    for extra in [json!({"frequency_penalty": 1.0}), json!({"repetition_penalty": 1.3})] {
        let steered = text(extra.clone());
        assert!(dogs(&steered) < dogs(&plain), "{extra}: {steered:?} against {plain:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
