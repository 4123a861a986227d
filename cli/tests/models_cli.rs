//! The CLI with the real models (all-MiniLM-L6-v2, SmolLM2-135M-Instruct): `embed`,
//! `generate` and `lora-serve` answer in order, stream, stop where they must and say why;
//! `model import` is bounded in memory and never leaves a partial model. Tests skip, saying so,
//! without the models.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};

use common::{scratch, smollm2, CASCADE};

/// `cascade embed` says which texts were longer than the model takes (embedded from their first
/// 256 tokens, as sentence-transformers does), in its text and JSON output. Skips without the
/// real model (`.ci/run` extracts it).
#[test]
fn embed_says_when_a_text_was_cut() {
    let Some(dir) = cascade_tests::models::minilm() else { return };
    let long = "cascade ".repeat(300);
    let run = |json: bool| {
        let mut c = Command::new(CASCADE);
        c.args(["embed", "--model"]).arg(&dir).args(["--text", "A short sentence.", "--text", &long]);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let rows: Vec<serde_json::Value> = run(true).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["truncated"], false);
    assert_eq!(rows[1]["truncated"], true);
    assert_eq!(rows[1]["dim"], 384);
    let text = run(false);
    assert_eq!(text.matches("embedded from its first 256 tokens").count(), 1, "{text}");
}

/// `cascade embed` with a model whose `config_sentence_transformers.json` makes `"query: "` the
/// default prompt: a text is embedded as `"query: " + text` (as the plain model embeds that
/// text), a note on stderr says so; `--prompt-name passage` takes another of its prompts,
/// `--prompt ""` none, and a name it does not have is refused naming those it has. Skips without
/// the real model.
#[test]
fn embed_puts_the_models_default_prompt_before_each_text() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let d = scratch("embed-prompt");
    let dir = d.join("with-prompts");
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&model).unwrap() {
        let f = f.unwrap().path();
        std::os::unix::fs::symlink(std::fs::canonicalize(&f).unwrap(), dir.join(f.file_name().unwrap())).unwrap();
    }
    let prompts = r#"{"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}"#;
    std::fs::write(dir.join("config_sentence_transformers.json"), prompts).unwrap();
    let embed = |dir: &std::path::Path, args: &[&str]| {
        let out = Command::new(CASCADE).args(["embed", "--json", "--model"]).arg(dir).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["embedding"].clone(), stderr)
    };
    let (prompted, note) = embed(&dir, &["--text", "a cat"]);
    assert!(note.contains("default prompt \"query\""), "{note}");
    assert_eq!(prompted, embed(&model, &["--text", "query: a cat"]).0);
    assert_eq!(
        embed(&dir, &["--text", "a cat", "--prompt-name", "passage"]).0,
        embed(&model, &["--text", "passage: a cat"]).0
    );
    let (none, note) = embed(&dir, &["--text", "a cat", "--prompt", ""]);
    assert_eq!(none, embed(&model, &["--text", "a cat"]).0);
    assert!(!note.contains("prompt"), "{note}");
    let out = Command::new(CASCADE)
        .args(["embed", "--model"])
        .arg(&dir)
        .args(["--text", "a cat", "--prompt-name", "document"])
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no prompt named \"document\": the model's are passage, query"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// `cascade embed --text-file`: texts one per line (`-` reads standard input), after any
/// `--text`, every line a text and the output in the input's order — more texts than `--batch`
/// too, which run in batches sorted by length. An empty input or a missing file is refused,
/// saying which. Skips without the real model.
#[test]
fn embed_reads_texts_from_a_file_or_stdin_in_their_order() {
    use std::io::Write;
    let Some(dir) = cascade_tests::models::minilm() else { return };
    let lines = ["one two three", "", &"a longer line of words ".repeat(20), "Hello, world!", "x"];
    let embed = |extra: &[&str], stdin: Option<&str>| {
        let mut c = Command::new(CASCADE);
        c.args(["embed", "--json", "--model"]).arg(&dir).args(extra);
        c.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
        drop(input);
        child.wait_with_output().unwrap()
    };
    let texts_of = |out: &std::process::Output| -> Vec<String> {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(rows.iter().all(|r| r["dim"] == 384));
        rows.iter().map(|r| r["text"].as_str().unwrap().to_string()).collect()
    };
    let piped = lines.join("\n") + "\n";
    let want: Vec<String> = std::iter::once("first").chain(lines).map(String::from).collect();
    let out = embed(&["--text", "first", "--text-file", "-", "--batch", "2"], Some(&piped));
    assert_eq!(texts_of(&out), want);
    let d = scratch("embed-file");
    let file = d.join("texts.txt");
    std::fs::write(&file, &piped).unwrap();
    let out = embed(&["--text", "first", "--text-file", file.to_str().unwrap()], None);
    assert_eq!(texts_of(&out), want);
    // A line that is not UTF-8 is read with U+FFFD in its bad bytes' place, and said; the lines
    // around it are embedded (it failed the run, and with it every line of its block).
    let bad = d.join("bad.txt");
    std::fs::write(&bad, b"before\nbad \xff\xfe bytes\r\nafter\n").unwrap();
    let out = embed(&["--text-file", bad.to_str().unwrap()], None);
    assert_eq!(texts_of(&out), ["before", "bad \u{FFFD}\u{FFFD} bytes", "after"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("line 2 of --text-file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A byte-order mark at the file's start is no part of its first text (one later is kept).
    let bom = d.join("bom.txt");
    std::fs::write(&bom, b"\xef\xbb\xbffirst\r\n\xef\xbb\xbfsecond\n").unwrap();
    let out = embed(&["--text-file", bom.to_str().unwrap()], None);
    assert_eq!(texts_of(&out), ["first", "\u{feff}second"]);
    // One text with standard input left open: its embedding comes before the input ends.
    let mut c = Command::new(CASCADE);
    c.args(["embed", "--json", "--text-file", "-", "--model"]).arg(&dir);
    let (first, status) = first_line_with_stdin_open(c, "one two three", 60);
    assert!(status.success());
    let first: serde_json::Value = serde_json::from_str(&first.expect("no embedding while stdin was open")).unwrap();
    assert_eq!(first["text"], "one two three");
    // Refused: nothing to embed, a file that is not there, no input at all.
    let out = embed(&["--text-file", "-"], Some(""));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no line"), "{}", String::from_utf8_lossy(&out.stderr));
    let missing = d.join("absent.txt");
    let out = embed(&["--text-file", missing.to_str().unwrap()], None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(missing.to_str().unwrap()));
    assert!(!embed(&[], None).status.success());
    let _ = std::fs::remove_dir_all(&d);
}

/// Runs `c` with `line` on its standard input, left open: the first line it prints within
/// `secs` seconds (`None` if none came), and, once standard input is closed, how it exited.
fn first_line_with_stdin_open(mut c: Command, line: &str, secs: u64) -> (Option<String>, std::process::ExitStatus) {
    use std::io::{BufRead, Write};
    let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{line}").unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut first = String::new();
        let _ = stdout.read_line(&mut first);
        let _ = tx.send(first);
    });
    let first = rx.recv_timeout(std::time::Duration::from_secs(secs)).ok();
    drop(stdin);
    (first, child.wait().unwrap())
}

/// `model`'s weights and tokenizer linked into `dir` (created) beside its `config.json` changed
/// by `edit`: the real model under another configuration.
fn linked_model(
    model: &std::path::Path,
    dir: &std::path::Path,
    edit: impl FnOnce(&mut serde_json::Value),
) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::os::unix::fs::symlink(std::fs::canonicalize(model.join(f)).unwrap(), dir.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir.to_path_buf()
}

/// `cascade generate` on a model whose context window fills: it stops there with the tokens it
/// has, says so (`at_window` in the JSON, a note on stderr), and a prompt longer than the window
/// is refused with one clear line (its JSON line an `error`). The real SmolLM2 under a 40-position window (its config.json
/// changed; the weights and tokenizer linked). Before 2026-12-04 the step past the window failed
/// and every generated token was lost.
#[test]
fn generation_that_fills_the_context_window_stops_there_and_says_so() {
    let d = scratch("window");
    let Some(model) = smollm2(&d) else { return };
    let small = linked_model(&model, &d.join("window-40"), |config| config["max_position_embeddings"] = 40.into());
    let generate = |prompt: &str| {
        Command::new(CASCADE)
            .args(["generate", "--model"])
            .arg(&small)
            .args(["--prompt", prompt, "--max-tokens", "100", "--json"])
            .output()
            .unwrap()
    };
    let out = generate("Once upon a time, in a land far away,");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (prompt, tokens) = (v["prompt_tokens"].as_array().unwrap().len(), v["tokens"].as_array().unwrap().len());
    assert_eq!(prompt + tokens, 41, "{v}");
    assert_eq!(v["at_window"], true, "{v}");
    assert!(err.contains("fill the model's context window of 40"), "{err}");

    let out = generate(&"word ".repeat(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().ends_with("tokens; the model's context window is 40"), "{v}");
    assert!(err.contains("tokens; the model's context window is 40") && !err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// One prompt's text is shown as it is generated (a long generation took minutes in silence),
/// and reads as the batch's `"prompt" → "text"` line, escapes included.
#[test]
fn one_prompt_is_shown_as_it_is_generated() {
    use std::io::Read;
    let d = scratch("stream");
    let Some(model) = smollm2(&d) else { return };
    let prompt = "Once upon a time";
    let args = |c: &mut Command| {
        c.args(["generate", "--model"]).arg(&model).args(["--prompt", prompt, "--max-tokens", "120"]);
    };
    let mut c = Command::new(CASCADE);
    args(&mut c);
    let mut child = c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let head = format!("{prompt:?} → \"");
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    // The head, and the first generated character.
    while seen.len() <= head.len() {
        assert_eq!(stdout.read(&mut byte).unwrap(), 1, "stdout ended after {:?}", String::from_utf8_lossy(&seen));
        seen.push(byte[0]);
    }
    assert!(seen.starts_with(head.as_bytes()), "{:?}", String::from_utf8_lossy(&seen));
    let first_shown = std::time::Instant::now();
    stdout.read_to_end(&mut seen).unwrap();
    // The rest follows over the time it takes to generate (at 100 tokens/s, 1.2 s); printed at
    // the end, it all came at once.
    let rest = first_shown.elapsed();
    assert!(rest > std::time::Duration::from_millis(500), "the text came at once ({rest:?} from first to last)");
    assert!(child.wait().unwrap().success());
    let mut c = Command::new(CASCADE);
    args(&mut c);
    let json = c.arg("--json").output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let text = v["text"].as_str().unwrap();
    let first = String::from_utf8(seen).unwrap();
    assert_eq!(first.lines().next().unwrap(), format!("{prompt:?} → {text:?}"));
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade generate --chat` renders the model's own chat template: SmolLM2's (kept in its
/// config.json by the import) answers "Paris"; the same weights with another template (a
/// `chat_template.jinja`, no template in config.json) get that one's prompt, the tokens it
/// renders to; with no template at all, or one that does not compile, `--chat` is refused before
/// any prompt is read (and the model still serves plain prompts). Before
/// 2026-12-05 `--chat` wrapped every model's prompts in SmolLM2's ChatML turn.
#[test]
fn chat_renders_the_models_own_template() {
    let d = scratch("chat");
    let Some(model) = smollm2(&d) else { return };
    let other = linked_model(&model, &d.join("other-template"), |config| {
        config.as_object_mut().unwrap().remove("chat_template");
    });
    let generate = |dir: &std::path::Path, chat: bool| {
        let mut c = Command::new(CASCADE);
        c.args(["generate", "--json", "--max-tokens", "1", "--prompt", "Hello", "--model"]).arg(dir);
        if chat {
            c.arg("--chat");
        }
        c.env_remove("RUST_BACKTRACE").output().unwrap()
    };
    let prompt_tokens = |out: &std::process::Output| -> Vec<u64> {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["prompt_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    };
    let out = generate(&other, true);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no chat template"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A template that does not compile fails `--chat`, not the model's loading.
    std::fs::write(other.join("chat_template.jinja"), "{% if %}").unwrap();
    let out = generate(&other, true);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not compile"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!prompt_tokens(&generate(&other, false)).is_empty());
    std::fs::write(other.join("chat_template.jinja"), "Question: {{ messages[0]['content'] }}").unwrap();
    let rendered = prompt_tokens(&generate(&other, true));
    // The same text given as the prompt itself: the template's rendering was what was generated from.
    let mut c = Command::new(CASCADE);
    c.args(["generate", "--json", "--max-tokens", "1", "--prompt", "Question: Hello", "--model"]).arg(&other);
    assert_eq!(rendered, prompt_tokens(&c.output().unwrap()));
    let smollm2 = prompt_tokens(&generate(&model, true));
    assert!(smollm2.len() > rendered.len() + 10, "SmolLM2's turn has its system message: {smollm2:?}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Several prompts are shown in their order although a later one finishes first (its answer
/// ends at end-of-sequence after 8 tokens, the first runs to its 12): each is printed once it
/// and every prompt before it are done.
#[test]
fn several_prompts_are_shown_in_their_order_whichever_finishes_first() {
    let d = scratch("order");
    let Some(model) = smollm2(&d) else { return };
    let story = "Write a long story about a dragon who loves tea.";
    let out = Command::new(CASCADE)
        .args(["generate", "--chat", "--json", "--max-tokens", "12", "--model"])
        .arg(&model)
        .args(["--prompt", story, "--prompt", "What is the capital of France?"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    let tokens = |r: &serde_json::Value| r["tokens"].as_array().unwrap().len();
    assert_eq!(tokens(&rows[0]), 12, "{}", rows[0]);
    assert!(tokens(&rows[1]) < 12 && rows[1]["text"].as_str().unwrap().contains("Paris"), "{}", rows[1]);
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade generate --temperature`: sampled text from the real model. One seed gives one text
/// (the same prompt twice in a run draws twice, from two generators: prompt N's own); another
/// seed another; top-k 1 is the greedy text whatever the temperature; JSON says the seed, and a
/// random one is drawn and said when none is given. Sampling settings without a temperature are
/// refused. Skips without the model.
#[test]
fn generate_samples_reproducibly_from_a_seed() {
    let d = scratch("sampling");
    let Some(model) = smollm2(&d) else { return };
    let story = "Tell me a story about a cat.";
    let run = |extra: &[&str]| {
        let out = Command::new(CASCADE)
            .args(["generate", "--chat", "--json", "--max-tokens", "16", "--model"])
            .arg(&model)
            .args(["--prompt", story, "--prompt", story])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<serde_json::Value>>()
    };
    let texts =
        |rows: &[serde_json::Value]| rows.iter().map(|r| r["text"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    let sampled = run(&["--temperature", "1.2", "--seed", "11"]);
    assert_eq!(texts(&sampled), texts(&run(&["--temperature", "1.2", "--seed", "11"])), "one seed, two texts");
    assert_ne!(texts(&sampled)[0], texts(&sampled)[1], "two prompts drew the same tokens");
    assert_ne!(texts(&sampled), texts(&run(&["--temperature", "1.2", "--seed", "12"])), "two seeds, one text");
    assert!(sampled.iter().all(|r| r["seed"] == 11), "{sampled:?}");
    let greedy = run(&[]);
    assert!(greedy.iter().all(|r| r.get("seed").is_none()), "{greedy:?}");
    assert_ne!(texts(&sampled), texts(&greedy));
    assert_eq!(texts(&run(&["--temperature", "3", "--top-k", "1", "--seed", "5"])), texts(&greedy));
    let drawn = run(&["--temperature", "0.7"]);
    assert!(drawn[0]["seed"].as_u64().is_some() && drawn[0]["seed"] == drawn[1]["seed"], "{drawn:?}");
    // A prompt draws as its own place among them: one refused before it (an empty one, not
    // chat-templated) changes nothing it draws.
    let third = |middle: &str| {
        let out = Command::new(CASCADE)
            .args(["generate", "--json", "--max-tokens", "16", "--temperature", "1.2", "--seed", "11"])
            .args(["--prompt", story, "--prompt", middle, "--prompt", story, "--model"])
            .arg(&model)
            .output()
            .unwrap();
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(rows.len(), 3, "{rows:?}");
        (out.status.success(), rows[2]["text"].as_str().unwrap().to_string())
    };
    let (answered, after_a_prompt) = third("Name a colour.");
    let (refused, after_a_refusal) = third("");
    assert!(answered && !refused);
    assert_eq!(after_a_refusal, after_a_prompt, "a refused prompt moved the draws of the one after it");

    for bad in
        [&["--top-p", "0.9"][..], &["--seed", "3"], &["--temperature=-1"], &["--temperature", "1", "--top-p", "0"]]
    {
        let out = Command::new(CASCADE)
            .args(["generate", "--prompt", "x", "--model"])
            .arg(&model)
            .args(bad)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && (err.contains("temperature") || err.contains("top-p")), "{bad:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade generate --stop`: a prompt's generation ends at the token that completes a stop
/// string, its text cut where the string begins, its tokens those the unstopped run began with;
/// the JSON line names the string, and one prompt streamed never shows it. A prompt without the
/// string is answered as without `--stop`; an empty stop string is refused.
#[test]
fn generate_stops_at_a_stop_string_and_cuts_the_text_there() {
    let d = scratch("stop");
    let Some(model) = smollm2(&d) else { return };
    let (cat, sky) = ("Tell me a story about a cat.", "Why is the sky blue?");
    let run = |prompts: &[&str], extra: &[&str]| {
        let mut c = Command::new(CASCADE);
        c.args(["generate", "--chat", "--max-tokens", "40", "--model"]).arg(&model);
        for p in prompts {
            c.args(["--prompt", p]);
        }
        let out = c.args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let rows = |out: String| out.lines().map(|l| serde_json::from_str(l).unwrap()).collect::<Vec<serde_json::Value>>();
    let full = rows(run(&[cat, sky], &["--json"]));
    let text = full[0]["text"].as_str().unwrap();
    // Two words from the middle of the cat story, with their spaces (more than one token: the
    // first may not be shown until the second shows it is no stop); absent from the sky's answer.
    let words: Vec<&str> = text.split_whitespace().collect();
    let stop = format!(" {} {}", words[words.len() / 2], words[words.len() / 2 + 1]);
    let cut = &text[..text.find(&stop).unwrap()];
    assert!(!full[1]["text"].as_str().unwrap().contains(&stop), "pick another word: {full:?}");

    let stopped = rows(run(&[cat, sky], &["--json", "--stop", &stop, "--stop", "never said"]));
    assert_eq!(stopped[0]["text"], cut);
    assert_eq!(stopped[0]["stop"], stop.as_str());
    let (all, some) = (full[0]["tokens"].as_array().unwrap(), stopped[0]["tokens"].as_array().unwrap());
    assert!(some.len() < all.len() && all.starts_with(some), "{some:?} is not where {all:?} began");
    assert_eq!(stopped[1], full[1], "a prompt without the stop string changed");

    let shown = run(&[cat], &["--stop", &stop]);
    let line = shown.lines().next().unwrap();
    assert!(line.ends_with(&format!("→ {cut:?}")), "{line:?} is not {cut:?}");

    let out = Command::new(CASCADE)
        .args(["generate", "--prompt", "x", "--stop", "", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--stop") && err.contains("empty"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `generate --json --logprobs N` gives each token's log-probability, the greedy token first
/// among its step's N alternatives, without changing a token; `--repetition-penalty` and
/// `--frequency-penalty` break a greedy loop; a penalty out of range is refused naming it.
#[test]
fn generate_gives_log_probabilities_and_applies_penalties() {
    let d = scratch("logprobs-penalties");
    let Some(model) = smollm2(&d) else { return };
    let animals = "List of animals: dog, cat, dog, cat, dog, cat,";
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = Command::new(CASCADE)
            .args(["generate", "--json", "--max-tokens", "16", "--prompt", animals, "--model"])
            .arg(&model)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = run(&[]);
    let logged = run(&["--logprobs", "3"]);
    assert_eq!(logged["tokens"], plain["tokens"]);
    let lps = logged["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), plain["tokens"].as_array().unwrap().len());
    for (lp, tok) in lps.iter().zip(plain["tokens"].as_array().unwrap()) {
        assert_eq!((&lp["token"], &lp["top"][0][0], &lp["top"][0][1]), (tok, tok, &lp["logprob"]), "{lp}");
        assert_eq!(lp["top"].as_array().unwrap().len(), 3);
    }
    let dogs = |v: &serde_json::Value| v["text"].as_str().unwrap().matches("dog").count();
    assert!(dogs(&plain) >= 3, "{plain}");
    for extra in [["--repetition-penalty", "1.3"], ["--frequency-penalty", "1"]] {
        let steered = run(&extra);
        assert!(dogs(&steered) < dogs(&plain), "{extra:?}: {steered} against {plain}");
    }
    let out = Command::new(CASCADE)
        .args(["generate", "--prompt", "x", "--presence-penalty", "-3", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("presence penalty -3: from -2 to 2"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade generate --batch`: requests in OpenAI's Batch API input format, each with its own
/// settings, answered in their order in that API's output format: a greedy completion and chat
/// completion say what `--prompt` (and `--chat`) generate, a stop string cuts the text and
/// finishes it with "stop", one seed gives one text on any line, and a request that cannot be
/// served is answered with a 400 and its reason while the others are served (the run exits
/// non-zero naming it).
#[test]
fn generate_answers_a_batch_file_in_openai_batch_format() {
    let d = scratch("batch");
    let Some(model) = smollm2(&d) else { return };
    let (story, colors) = ("Tell me a story about a cat.", "The three primary colors are");
    let plain = |extra: &[&str]| {
        let out =
            Command::new(CASCADE).args(["generate", "--json", "--model"]).arg(&model).args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["text"].as_str().unwrap().to_string()
    };
    let chat = plain(&["--chat", "--prompt", story, "--max-tokens", "16"]);
    let text = plain(&["--prompt", colors, "--max-tokens", "10"]);
    let seeded = serde_json::json!({"messages": [{"role": "user", "content": story}], "max_tokens": 12, "seed": 7});
    let lines = [
        serde_json::json!({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "any", "messages": [{"role": "user", "content": story}], "max_tokens": 16, "temperature": 0}}),
        serde_json::json!({"custom_id": "text", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": colors, "max_tokens": 10, "temperature": 0}}),
        serde_json::json!({"custom_id": "seeded", "method": "POST", "url": "/v1/chat/completions", "body": seeded}),
        serde_json::json!({"custom_id": "cut", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": colors, "max_tokens": 10, "temperature": 0, "stop": [" colors", "never"]}}),
        serde_json::json!({"custom_id": "bias", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": colors, "logit_bias": {"42": 5}}}),
        serde_json::json!({"custom_id": "two", "method": "POST", "url": "/v1/completions", "body": {"prompt": colors, "n": 2}}),
        serde_json::json!({"custom_id": "seeded again", "method": "POST", "url": "/v1/chat/completions", "body": seeded}),
    ];
    let mut file: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    file.insert(5, "not json".into());
    let path = d.join("batch.jsonl");
    std::fs::write(&path, file.join("\n") + "\n").unwrap();
    let out =
        Command::new(CASCADE).args(["generate", "--batch"]).arg(&path).arg("--model").arg(&model).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("3 requests not generated (of 8)"), "{err}");
    assert!(err.contains("request 5: body.logit_bias {\"42\":5} is not supported here"), "{err}");
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ids: Vec<Option<&str>> = rows.iter().map(|r| r["custom_id"].as_str()).collect();
    let want = [Some("chat"), Some("text"), Some("seeded"), Some("cut"), Some("bias"), None, Some("two")];
    assert_eq!(ids, [&want[..], &[Some("seeded again")]].concat());
    let body = |k: usize| &rows[k]["response"]["body"];
    let choice = |k: usize| &body(k)["choices"][0];
    assert_eq!(rows[0]["response"]["status_code"], 200);
    assert_eq!(body(0)["object"], "chat.completion");
    assert_eq!(choice(0)["message"]["content"], chat.trim_end_matches("<|im_end|>"));
    assert_eq!(body(1)["object"], "text_completion");
    assert_eq!(choice(1)["text"], text.as_str());
    assert_eq!(
        (choice(1)["finish_reason"].as_str(), body(1)["usage"]["completion_tokens"].as_u64()),
        (Some("length"), Some(10))
    );
    assert_eq!(choice(2)["message"]["content"], choice(7)["message"]["content"], "one seed, two texts");
    assert_ne!(
        choice(2)["message"]["content"],
        choice(0)["message"]["content"],
        "a seeded request drew the greedy text"
    );
    let cut = &text[..text.find(" colors").expect("the greedy text names the colors")];
    assert_eq!((choice(3)["text"].as_str(), choice(3)["finish_reason"].as_str()), (Some(cut), Some("stop")));
    for (k, why) in [(4, "logit_bias"), (5, "not a JSON request"), (6, "one choice per line in a batch")] {
        assert_eq!(rows[k]["response"]["status_code"], 400, "{}", rows[k]);
        assert!(body(k)["error"]["message"].as_str().unwrap().contains(why), "{}", rows[k]);
    }

    let refused = |extra: &[&str]| {
        let out = Command::new(CASCADE)
            .args(["generate", "--batch"])
            .arg(&path)
            .arg("--model")
            .arg(&model)
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(refused(&["--prompt", "x"]).contains("cannot be used with"));
    assert!(refused(&["--temperature", "1"]).contains("each request's body sets"));
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade generate --prompt-file`: prompts from a file or standard input, after any
/// `--prompt`, answered in their order, each as `--prompt` answers it; an empty line is answered
/// in its place with its error while the others are generated, and the run exits non-zero naming
/// it. A prompt piped in alone is answered while standard input stays open (prompts are read as
/// slots free, not all before the first step).
#[test]
fn generate_reads_prompts_from_a_file_or_stdin_in_their_order() {
    use std::io::Write;
    let d = scratch("prompt-file");
    let Some(model) = smollm2(&d) else { return };
    let lines = ["The capital of France is", "", "def fibonacci(n):", "Water boils at"];
    let command = |extra: &[&str]| {
        let mut c = Command::new(CASCADE);
        c.args(["generate", "--json", "--max-tokens", "6", "--model"]).arg(&model).args(extra);
        c.env_remove("RUST_BACKTRACE").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let run = |extra: &[&str], stdin: &str| {
        let mut child = command(extra).spawn().unwrap();
        child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    let rows = |out: &std::process::Output| -> Vec<serde_json::Value> {
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let mut given = vec![];
    for p in ["Once upon a time"].iter().chain(lines.iter().filter(|l| !l.is_empty())) {
        given.extend(["--prompt", p]);
    }
    let alone = run(&given, "");
    assert!(alone.status.success(), "{}", String::from_utf8_lossy(&alone.stderr));
    let mut want = rows(&alone);
    want.insert(2, serde_json::json!({"error": "an empty prompt: no token to continue from"}));

    let piped = lines.join("\n") + "\n";
    let file = d.join("prompts.txt");
    std::fs::write(&file, &piped).unwrap();
    for (extra, stdin) in [(["--prompt-file", "-"], piped.as_str()), (["--prompt-file", file.to_str().unwrap()], "")] {
        let out = run(&[&["--prompt", "Once upon a time"][..], &extra[..]].concat(), stdin);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(rows(&out), want, "{err}");
        assert!(
            !out.status.success() && err.contains("1 prompt not generated (of 5): prompt 3: an empty prompt"),
            "{err}"
        );
    }

    // One prompt with standard input left open: its answer comes before the input ends.
    let (first, status) = first_line_with_stdin_open(command(&["--prompt-file", "-"]), lines[0], 120);
    let first = first.expect("no answer while standard input was open");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&first).unwrap(), want[1]);
    assert!(status.success());

    // Nothing to generate, a file that is not there.
    let out = run(&["--prompt-file", "-"], "");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("holds no line"));
    let missing = d.join("absent.txt");
    let out = run(&["--prompt-file", missing.to_str().unwrap()], "");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains(missing.to_str().unwrap()));
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade ARGS` run in a memory cgroup of `mib` MiB (and as much swap), its output; `None`
/// (the caller skips, as this says) where no cgroup can be made: it needs root and cgroup v1's
/// memory controller.
fn in_memory_cgroup(mib: u64, args: &[&std::ffi::OsStr]) -> Option<std::process::Output> {
    static GROUPS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = GROUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let group = std::path::PathBuf::from(format!("/sys/fs/cgroup/memory/cascade-honest-{}-{n}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&group) {
        eprintln!("skipping: no memory cgroup could be made at {} ({e}): needs root and cgroup v1", group.display());
        return None;
    }
    let limit = (mib << 20).to_string();
    std::fs::write(group.join("memory.limit_in_bytes"), &limit).unwrap();
    // With swap accounting, swap is held to the same bound.
    let _ = std::fs::write(group.join("memory.memsw.limit_in_bytes"), &limit);
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {}/cgroup.procs && exec \"$@\"", group.display()))
        .args(["sh", CASCADE])
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&group);
    Some(out)
}

/// A model file is mapped, not read into memory: `cascade generate` with SmolLM2 (538 MB of f32
/// tensors) runs in a memory cgroup of 700 MB. Reading the file into memory and building the
/// tensors from it held the model twice: it took 1.1 GB (killed at 1,000 MB, 2026-12-05). Needs
/// root and cgroup v1's memory controller (skips, saying so, without them).
#[test]
fn a_model_is_loaded_in_little_more_memory_than_its_tensors() {
    let d = scratch("cgroup");
    let Some(model) = smollm2(&d) else { return };
    let args = ["generate", "--max-tokens", "2", "--prompt", "The capital of France is", "--model"];
    let mut args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    args.push(model.as_os_str());
    let out = in_memory_cgroup(700, &args);
    let _ = std::fs::remove_dir_all(&d);
    let Some(out) = out else { return };
    assert!(out.status.success(), "{:?} in 700 MB: {}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"));
}

/// `cascade model import` holds one dequantized tensor at a time, not the model: SmolLM2's
/// import (a 538 MB f32 file) runs in a memory cgroup of 400 MB, and writes what the exec tests'
/// import wrote. It took 685 MB before 2026-12-05 (killed at 400 MB). Needs root and cgroup v1's
/// memory controller (skips, saying so, without them).
#[test]
fn a_model_import_holds_one_tensor_at_a_time() {
    let Some(gguf) = cascade_tests::models::smollm2_gguf() else { return };
    let d = scratch("import-memory");
    let out = d.join("model");
    let args = [
        std::ffi::OsStr::new("model"),
        "import".as_ref(),
        "--gguf".as_ref(),
        gguf.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ];
    let Some(run) = in_memory_cgroup(400, &args) else { return };
    assert!(run.status.success(), "{:?} in 400 MB: {}", run.status, String::from_utf8_lossy(&run.stderr));
    let imported = std::fs::metadata(out.join("model.safetensors")).unwrap().len();
    assert!(imported > 500 << 20, "{imported} bytes");
    if let Some(cascade_tests::models::Smollm2::Imported(dir)) = cascade_tests::models::smollm2() {
        let same = |f: &str| std::fs::read(dir.join(f)).unwrap() == std::fs::read(out.join(f)).unwrap();
        assert!(same("model.safetensors") && same("config.json") && same("tokenizer.json"));
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade model import --dtype quantized` keeps the GGUF's blocks: a model directory under a
/// fifth of the f32 import's size whose `generate` prints, byte for byte, what the f32 import's
/// prints. Skips without the model.
#[test]
fn a_quantized_import_generates_what_the_f32_import_generates() {
    let Some(gguf) = cascade_tests::models::smollm2_gguf() else { return };
    let d = scratch("import-quantized");
    let Some(f32_dir) = smollm2(&d) else { return };
    let out = d.join("quantized");
    let import = Command::new(CASCADE)
        .args(["model", "import", "--dtype", "quantized", "--gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(import.status.success(), "{}", String::from_utf8_lossy(&import.stderr));
    let size = |dir: &std::path::Path| std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    assert!(size(&out) < size(&f32_dir) / 5, "{} against {}", size(&out), size(&f32_dir));
    let generate = |dir: &std::path::Path| {
        let run = Command::new(CASCADE)
            .args(["generate", "--json", "--chat", "--max-tokens", "24", "--model"])
            .arg(dir)
            .args(["--prompt", "What is the capital of France?", "--prompt", "Write a haiku about the sea."])
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        String::from_utf8(run.stdout).unwrap()
    };
    let (q, f) = (generate(&out), generate(&f32_dir));
    assert!(q.contains("Paris"), "{q}");
    assert_eq!(q, f);
    let _ = std::fs::remove_dir_all(&d);
}

/// An import that fails while it writes (here a file-size limit of 64 MiB: the 538 MB
/// `model.safetensors` stops with EFBIG, as on a full disk) says so and leaves the directory's
/// previous model whole, with no partial file behind, in the directory or beside it: the import
/// is written into a directory beside it, removed on failure (since 2026-12-05; before, the
/// files were written in place, only `safetensors`' own temporary file keeping the model whole).
#[test]
fn a_failed_import_leaves_the_previous_model_whole() {
    use std::os::unix::process::CommandExt;
    let Some(gguf) = cascade_tests::models::smollm2_gguf() else { return };
    let d = scratch("import");
    let out = d.join("model");
    std::fs::create_dir_all(&out).unwrap();
    let before = [("model.safetensors", "the previous model"), ("config.json", "{}"), ("tokenizer.json", "{}")];
    for (f, text) in before {
        std::fs::write(out.join(f), text).unwrap();
    }
    let mut c = Command::new(CASCADE);
    c.args(["model", "import", "--gguf"]).arg(&gguf).arg("--out").arg(&out).env_remove("RUST_BACKTRACE");
    // SAFETY: between fork and exec the child only calls setrlimit and signal, both
    // async-signal-safe, on values of its own stack.
    unsafe {
        c.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 64 << 20, rlim_max: 64 << 20 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // A write past the limit then fails with EFBIG instead of killing the process.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let run = c.output().unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "the import did not fail: {err}");
    assert!(err.contains("model.safetensors") && !err.contains("panicked"), "{err}");
    for (f, text) in before {
        assert_eq!(std::fs::read_to_string(out.join(f)).unwrap(), text, "{f} changed");
    }
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 3, "partial files left behind: {left:?}");
    let beside: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(beside, ["model"], "a staging directory left behind");
    let _ = std::fs::remove_dir_all(&d);
}

/// `lora-serve` refuses more adapters than the machine's memory holds, after loading the model
/// and before building any (100 million of rank 8 on SmolLM2 are 369 TB; not run without the check:
/// it would take the machine's memory until the OOM killer ended it).
#[test]
fn lora_serve_refuses_adapters_beyond_the_machines_memory() {
    let d = scratch("lora-memory");
    let Some(model) = smollm2(&d) else { return };
    let out =
        Command::new(CASCADE).args(["lora-serve", "--adapters", "100000000", "--model"]).arg(&model).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("100000000 adapters of rank 8 take 368640.0 GB"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `lora-serve --adapter DIR` serves PEFT adapter directories (here two seeded adapters saved in
/// PEFT's layout: test doubles, but read from disk as a user's would be) with the prompts of
/// `--prompt-file`, every response equal to its request served alone; a directory that holds no
/// adapter is refused naming it, `--adapter` beside `--adapters` is refused, and a prompt file
/// with an empty line is refused naming the line.
#[test]
fn lora_serve_serves_peft_adapter_directories() {
    use cascade_exec::llama::{LlamaConfig, LoraAdapter, Proj};
    let d = scratch("lora-peft");
    let Some(model) = smollm2(&d) else { return };
    let cfg = LlamaConfig::from_json(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let dirs: Vec<std::path::PathBuf> = (1..=2)
        .map(|seed| {
            let dir = d.join(format!("adapter-{seed}"));
            LoraAdapter::seeded(&cfg, 8, 16.0, &Proj::ALL, seed, 0.05).unwrap().save(&dir).unwrap();
            dir
        })
        .collect();
    let serve = |extra: &[&std::ffi::OsStr]| {
        let mut c = Command::new(CASCADE);
        c.args(["lora-serve", "--requests", "6", "--max-tokens", "2", "--json", "--model"]).arg(&model).args(extra);
        c.env_remove("RUST_BACKTRACE").output().unwrap()
    };
    let flag = std::ffi::OsStr::new("--adapter");
    // The user's prompts, too (`--prompt-file`): every line served.
    let prompts = d.join("prompts.txt");
    std::fs::write(&prompts, "Tell me a joke about cats\nThe tallest mountain is\n").unwrap();
    let prompt_file = [std::ffi::OsStr::new("--prompt-file"), prompts.as_os_str()];
    let out = serve(&[&[flag, dirs[0].as_os_str(), flag, dirs[1].as_os_str()][..], &prompt_file[..]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["adapter_dirs"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["prompt_file"], prompts.to_str().unwrap(), "{v}");
    let per: Vec<u64> = v["requests_per_adapter"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!((per.len(), per.iter().sum::<u64>()), (2, 6), "{v}");
    assert!(v["differences"].as_array().unwrap().is_empty(), "{v}");
    assert!(err.contains("adapter 1: ") && err.contains("(rank 8, "), "{err}");

    let missing = d.join("no-adapter");
    std::fs::create_dir_all(&missing).unwrap();
    let out = serve(&[flag, missing.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("loading --adapter") && err.contains("adapter_config.json"), "{err}");
    let out = serve(&[flag, dirs[0].as_os_str(), std::ffi::OsStr::new("--adapters"), std::ffi::OsStr::new("3")]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    // A prompt file with an empty line is refused naming the line.
    std::fs::write(&prompts, "fine\n\nalso fine\n").unwrap();
    let out = serve(&prompt_file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("line 2 of --prompt-file") && err.contains("an empty prompt"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `lora-serve --rank 0` is refused before anything loads (it used to serve every token as token 0:
/// a rank-0 adapter's scale α/r is no number).
#[test]
fn lora_serve_refuses_a_rank_of_zero() {
    let out = Command::new(CASCADE).args(["lora-serve", "--rank", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--rank must be at least 1"), "{err}");
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    // A stream of more than a million requests, too (before the model loads).
    let out = Command::new(CASCADE).args(["lora-serve", "--requests", "100000000"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--requests 100000000: at most 1000000"), "{err}");
}

/// A line of several MiB (a file with few newlines, a stray binary) is read as its first 64 KiB
/// (`embed`) or 1 MiB (a prompt), said on stderr, and the rest of it skipped: `embed` embeds it
/// from its start — the same
/// embedding as of its first words, since the model takes 256 tokens — and `generate` refuses
/// it in its place; the lines after it are answered. Before 2026-12-05 the line was read and
/// tokenised whole: a 50 MB line took 33 s and 3.4 GB to embed, 10 MB took 1.5 GB to refuse,
/// and a file without a newline was read until memory ran out.
#[test]
fn a_line_of_megabytes_is_read_from_its_start_and_the_rest_skipped() {
    let Some(minilm) = cascade_tests::models::minilm() else { return };
    let d = scratch("long-line");
    let words = ["alpha", "beta", "gamma", "delta", "serving", "cluster"];
    let long: String = (0..700_000).map(|i| words[(i * 7 + i / 3) % 6]).collect::<Vec<_>>().join(" ");
    assert!(long.len() > 3 << 20);
    let start = &long[..long[..12_000].rfind(' ').unwrap()];
    let file = d.join("long.txt");
    std::fs::write(&file, format!("{long}\nThe capital of France is\n{start}\n")).unwrap();
    let run = |args: &[&str], model: &std::path::Path, kept: &str| {
        let out =
            Command::new(CASCADE).args(args).arg(&file).arg("--model").arg(model).args(["--json"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let note = format!("longer than {kept}: only its first {kept} is read");
        assert!(err.contains("line 1 of") && err.contains(&note), "{err}");
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (out.status, rows, err)
    };
    let (status, rows, err) = run(&["embed", "--text-file"], &minilm, "64 KiB");
    assert!(status.success(), "{err}");
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["text"].as_str().unwrap().len(), 64 << 10);
    assert_eq!(rows[0]["truncated"], true);
    assert_eq!(rows[0]["embedding"], rows[2]["embedding"], "the cut line embeds as its first words do");
    let Some(smollm2) = smollm2(&d) else { return };
    std::fs::write(&file, format!("{long}\nThe capital of France is\n")).unwrap();
    let (status, rows, err) = run(&["generate", "--max-tokens", "2", "--prompt-file"], &smollm2, "1 MiB");
    assert!(!status.success() && err.contains("1 prompt not generated (of 2)"), "{err}");
    assert!(rows[0]["error"].as_str().unwrap().contains("longer than 1 MiB"), "{}", rows[0]);
    assert!(rows[1]["text"].is_string(), "{}", rows[1]);
    let _ = std::fs::remove_dir_all(&d);
}
