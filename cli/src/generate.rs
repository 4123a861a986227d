//! `cascade generate`: text from a real decoder LLM on the CPU, greedy or sampled, for prompts
//! given on the command line or read, one per line, from a file or standard input.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use cascade_exec::llama::generate::{Generated, Generator, StreamPrompt, RUNNING};
use cascade_exec::llama::penalty::Penalties;
use cascade_exec::llama::sample::Decoding;
use cascade_exec::llama::stop::StopStrings;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::count;
use crate::input::PROMPT_LINE;

#[derive(Args)]
#[command(group = clap::ArgGroup::new("input").required(true).multiple(true).args(["prompt", "prompt_file", "batch"]))]
pub(crate) struct GenerateArgs {
    /// The model directory (`cascade model import --gguf` writes one).
    #[arg(long, default_value = crate::models::SMOLLM2)]
    model: PathBuf,
    /// The prompt, used as given (special tokens such as <|im_start|> are recognised); repeat
    /// for several.
    #[arg(long)]
    prompt: Vec<String>,
    /// A file of prompts, one per line (`-`: standard input), after any `--prompt`. Output line N
    /// answers prompt N; prompts are read as sequences finish, so output begins before the
    /// input ends and memory stays bounded. A line over 1 MiB is refused in its place, read only
    /// in part.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Requests in OpenAI's Batch API input format, one JSON object per line (`-`: standard
    /// input): {"custom_id", "method": "POST", "url": "/v1/completions" or
    /// "/v1/chat/completions", "body": {prompt or messages, max_tokens, temperature, top_p,
    /// top_k, seed, stop, …}}, each with its own settings; answered one JSON line each, in their
    /// order, in that API's output format. --max-tokens is the budget of a request without one;
    /// --seed the seed of one without one (random otherwise). Instead of --prompt/--prompt-file.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_file", "chat", "json", "stop"])]
    batch: Option<PathBuf>,
    /// Render each prompt as a user message in the model's chat template (its Jinja, as
    /// `transformers` renders it; SmolLM2's is ChatML with a default system message), the
    /// assistant's turn opened.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (generation stops earlier at end-of-sequence). Each running
    /// prompt reserves its tokens and these in the KV cache, 65,536 positions in all: up to 32
    /// prompts run at once, fewer when they are long or this is large (8 at 8,192).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// End a prompt's generation as soon as its text holds this string, and cut the text where
    /// it begins (the tokens generated are all kept); repeat for several (at most 16).
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    /// Print one JSON object per prompt: {prompt_tokens, tokens, text, at_window} (and seed,
    /// when sampling; stop, the stop string that cut the text; logprobs with --logprobs), or
    /// {error} for a prompt that could not be generated from.
    #[arg(long)]
    json: bool,
    /// With --json: each generated token's log-probability under the model (before penalties and
    /// temperature) and the N most likely tokens' at its step (0 to 20), as "logprobs":
    /// [{token, logprob, top: [[token, logprob], …]}].
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u8).range(0..=20))]
    logprobs: Option<u8>,
    /// Penalise tokens seen: divide their positive logits by R (multiply negative ones), over the
    /// prompt's and the generated tokens (vLLM's and transformers' repetition penalty; 1: none).
    #[arg(long, default_value_t = 1.0, value_name = "R", conflicts_with = "batch")]
    repetition_penalty: f32,
    /// Subtract P from the logit of every token generated at least once (OpenAI's, −2 to 2).
    #[arg(long, default_value_t = 0.0, value_name = "P", conflicts_with = "batch", allow_hyphen_values = true)]
    presence_penalty: f32,
    /// Subtract F from a generated token's logit per time it was generated (OpenAI's, −2 to 2).
    #[arg(long, default_value_t = 0.0, value_name = "F", conflicts_with = "batch", allow_hyphen_values = true)]
    frequency_penalty: f32,
}

/// How `generate` and `pd` choose each token: greedily, or sampled.
#[derive(Args)]
pub(crate) struct SamplingArgs {
    /// Sample each token instead of taking the most likely one: the logits divided by this
    /// temperature, then cut by --top-k and --top-p (Hugging Face's order). 0, the default, is
    /// greedy.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    temperature: f32,
    /// With --temperature: only the K most likely tokens are drawn from (0: every token).
    #[arg(long, default_value_t = 0, value_name = "K")]
    top_k: usize,
    /// With --temperature: only the most likely tokens whose probabilities sum to at least P are
    /// drawn from (1: every token).
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    top_p: f32,
    /// With --temperature: the seed; the same seed, model and prompts give the same text (the
    /// n-th token of prompt or request N is drawn from the seed, N and n alone, whatever runs
    /// beside it). Without it, a random seed, printed so that the run can be repeated.
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// How tokens are chosen (the seed drawn here when sampling without one).
    pub(crate) fn decoding(&self) -> anyhow::Result<Decoding> {
        if self.temperature == 0.0 {
            let set = [(self.top_k != 0, "--top-k"), (self.top_p != 1.0, "--top-p"), (self.seed.is_some(), "--seed")];
            if let Some((_, name)) = set.iter().find(|(given, _)| *given) {
                bail!("{name} applies to sampling: give --temperature above 0 as well (0, the default, is greedy)");
            }
        }
        let seed = if self.temperature != 0.0 { given_or_random(self.seed)? } else { 0 };
        Ok(Decoding::new(self.temperature, self.top_k, self.top_p, seed)?)
    }
}

/// The seed given, or a random one (printed by the caller, so that a run can be repeated).
pub(crate) fn given_or_random(seed: Option<u64>) -> anyhow::Result<u64> {
    match seed {
        Some(s) => Ok(s),
        None => getrandom::u64().context("drawing a random seed"),
    }
}

/// Text generated so far and shown (escaped as `{:?}` shows it, without the quotes).
#[derive(Default)]
struct Streamed {
    tokens: Vec<u32>,
    text: String,
}

impl Streamed {
    /// Takes `tok` and prints the text it completes: a token may end in the middle of a
    /// character, whose bytes then wait for the next one, and text that may begin a stop string
    /// waits until it is known not to (a stop string is never shown).
    fn push(&mut self, g: &Generator, stops: &StopStrings, tok: u32) {
        self.tokens.push(tok);
        // (End of sequence, which `visible` leaves out, is printed with the rest by `show`.)
        let Some(text) = crate::openai::visible(g.text(), stops, &self.tokens) else { return };
        if !text.starts_with(&self.text) {
            return;
        }
        print!("{}", escaped(&text[self.text.len()..]));
        let _ = std::io::stdout().flush();
        self.text = text;
    }
}

/// `text` escaped as `{:?}` shows it, without the quotes (it escapes character by character, so
/// pieces escaped one by one read as the whole would).
fn escaped(text: &str) -> String {
    let quoted = format!("{text:?}");
    quoted[1..quoted.len() - 1].to_string()
}

/// What a line of input asked for, as its answer shows it.
enum Given {
    /// A prompt (`--prompt`, a line of `--prompt-file`).
    Prompt(String),
    /// A request of a `--batch` file.
    Request(crate::batch::Asked),
}

/// What became of one prompt.
enum Outcome {
    /// Generated from.
    Done(Generated),
    /// Not generated from, and why.
    Refused(String),
}

/// Prints one prompt's result: its JSON line, the rest of its streamed text (`streamed`: what was
/// shown as it came), its `"prompt" → "text"` line, or why it was not generated from; and a note
/// if it filled the context window.
fn show(
    out: &mut impl Write,
    run: &InOrder,
    given: &Given,
    o: &Outcome,
    streamed: Option<&String>,
) -> anyhow::Result<()> {
    let InOrder { a, seed, stops, g, created, .. } = *run;
    let prompt = match given {
        Given::Prompt(p) => p,
        Given::Request(asked) => {
            // The model's directory as given, as vLLM names a model served without another name.
            let model = a.model.display().to_string();
            let o = match o {
                Outcome::Done(o) => Ok(o),
                Outcome::Refused(why) => Err(why.as_str()),
            };
            return crate::batch::show(out, g, &model, created, asked, o);
        }
    };
    let o = match o {
        Outcome::Done(o) => o,
        Outcome::Refused(why) if a.json => {
            writeln!(out, "{}", serde_json::json!({ "error": why }))?;
            return Ok(out.flush()?);
        }
        Outcome::Refused(why) => {
            writeln!(out, "{:?} → not generated: {why}", crate::shorten(prompt))?;
            return Ok(out.flush()?);
        }
    };
    let mut text = g.decode(&o.tokens)?;
    // Cut where its first stop string begins (one that ended it, or one the last token completed
    // beside end-of-sequence or the budget).
    let stop = stops.cut(&text).map(|(at, stop)| {
        text.truncate(at);
        stop
    });
    if a.json {
        let mut v = serde_json::json!({"prompt_tokens": o.prompt_tokens, "tokens": o.tokens, "text": text, "at_window": o.at_window});
        if let Some(seed) = seed {
            v["seed"] = seed.into();
        }
        if let Some(stop) = stop {
            v["stop"] = stop.into();
        }
        if a.logprobs.is_some() {
            let each: Vec<serde_json::Value> = o
                .tokens
                .iter()
                .zip(&o.logprobs)
                .map(|(t, l)| serde_json::json!({"token": t, "logprob": l.logprob, "top": l.top}))
                .collect();
            v["logprobs"] = each.into();
        }
        writeln!(out, "{v}")?;
    } else if let Some(shown) = streamed {
        writeln!(out, "{}\"", escaped(text.get(shown.len()..).unwrap_or_default()))?;
    } else {
        writeln!(out, "{:?} → {text:?}", crate::shorten(prompt))?;
    }
    if o.at_window {
        eprintln!(
            "note: {:?} stopped after {} tokens: with its {} prompt tokens they fill the model's context window of {}",
            crate::shorten(prompt),
            o.tokens.len(),
            o.prompt_tokens.len(),
            g.model().config().max_position_embeddings
        );
    }
    // Seen at once when piped too (stdout is buffered there).
    Ok(out.flush()?)
}

/// The prompts' results, printed in the prompts' order as they come in any order.
struct InOrder<'a> {
    a: &'a GenerateArgs,
    /// The seed, when tokens are sampled.
    seed: Option<u64>,
    stops: &'a StopStrings,
    g: &'a Generator,
    /// When the run started, in Unix seconds (a `--batch` answer's `created`).
    created: u64,
    bar: Option<ProgressBar>,
    /// With one prompt shown as it is generated: what was shown, which its result line ends.
    streamed: Option<&'a RefCell<Streamed>>,
    /// Finished prompts waiting for an earlier one: index → (what it asked, outcome).
    waiting: BTreeMap<usize, (Given, Outcome)>,
    /// The next prompt to print.
    next: usize,
    /// Prompts generated from, and their tokens.
    generated: (usize, usize),
    /// Prompts refused: (index, why), the first few.
    refused: Vec<(usize, String)>,
    refused_count: usize,
    /// The first failure to print (a closed stdout), which ends the run.
    failed: Option<anyhow::Error>,
}

impl InOrder<'_> {
    fn finish(&mut self, i: usize, prompt: Given, o: Outcome) {
        match &o {
            Outcome::Done(g) => {
                self.generated.0 += 1;
                self.generated.1 += g.tokens.len();
            }
            Outcome::Refused(why) => {
                self.refused_count += 1;
                if self.refused.len() < 5 {
                    self.refused.push((i, why.clone()));
                }
            }
        }
        self.waiting.insert(i, (prompt, o));
        while let Some((prompt, o)) = self.waiting.remove(&self.next) {
            self.next += 1;
            if self.failed.is_some() {
                continue;
            }
            let mut stdout = std::io::stdout().lock();
            let streamed = self.streamed.map(|s| s.borrow().text.clone());
            let shown = match &self.bar {
                Some(b) => b.suspend(|| show(&mut stdout, self, &prompt, &o, streamed.as_ref())),
                None => show(&mut stdout, self, &prompt, &o, streamed.as_ref()),
            };
            self.failed = shown.err();
        }
        if let Some(b) = &self.bar {
            b.set_position(self.next as u64);
            b.set_message(format!("{} tokens", self.generated.1));
        }
    }
}

pub(crate) fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    // A batch's requests say how each is decoded; the run gives a seed to those that do not.
    let batch = match &a.batch {
        Some(_) => Some(batch_defaults(&a)?),
        None => None,
    };
    let decoding = if batch.is_some() { Decoding::Greedy } else { a.sampling.decoding()? };
    let seed = decoding.sampling().map(|s| s.seed);
    let stops = StopStrings::new(a.stop.clone()).context("--stop")?;
    let penalties = Penalties::new(a.presence_penalty, a.frequency_penalty, a.repetition_penalty)
        .context("--presence-penalty, --frequency-penalty, --repetition-penalty")?;
    let penalties = (!penalties.is_neutral()).then_some(penalties);
    let input = match &a.batch {
        Some(file) => crate::input::given_then_lines(Vec::new(), Some(file.clone()), "--batch", PROMPT_LINE)?,
        None => crate::input::given_then_lines(a.prompt.clone(), a.prompt_file.clone(), "--prompt-file", PROMPT_LINE)?,
    };
    // Read ahead, so that a prompt typed or piped in while others run starts as soon as a slot
    // is free, and one alone is answered without waiting for more.
    let rx = crate::input::read_ahead(input, 4 * RUNNING);
    crate::models::ensure_smollm2(&a.model)?;
    let t = Instant::now();
    let g = Generator::from_dir(&a.model).with_context(|| format!("loading the model in {}", a.model.display()))?;
    if a.chat {
        // Before any prompt is read: without a template, none could be served.
        g.chat_template().with_context(|| format!("--chat with the model in {}", a.model.display()))?;
    }
    let loaded = t.elapsed();
    // One prompt as text is shown token by token as it is generated (a long one takes minutes);
    // with several, each is shown once it and every prompt before it are done, in their order.
    let stream = !a.json && a.prompt.len() == 1 && a.prompt_file.is_none();
    // Progress on stderr when prompts may queue (indicatif draws nothing when it is no terminal).
    let bar = (a.prompt_file.is_some() || a.batch.is_some() || a.prompt.len() > RUNNING).then(|| {
        let style = ProgressStyle::with_template("generating: {pos} prompts done, {msg}, {elapsed} {spinner}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        ProgressBar::new_spinner().with_style(style)
    });
    let shown = RefCell::new(Streamed::default());
    let order = RefCell::new(InOrder {
        a: &a,
        seed,
        stops: &stops,
        g: &g,
        created: crate::openai::now(),
        bar,
        streamed: stream.then_some(&shown),
        waiting: BTreeMap::new(),
        next: 0,
        generated: (0, 0),
        refused: Vec::new(),
        refused_count: 0,
        failed: None,
    });
    // The prompts handed to the generator, by its index: (their index among all, the prompt).
    let handed: RefCell<HashMap<usize, (usize, Given)>> = RefCell::new(HashMap::new());
    let mut read_failed: Option<anyhow::Error> = None;
    let (mut read, mut given, mut ended) = (0usize, 0usize, false);
    let prompts = std::iter::from_fn(|| loop {
        if ended || order.borrow().failed.is_some() {
            return None;
        }
        // While prompts handed over run, one not yet read is not waited for.
        let next = if !handed.borrow().is_empty() {
            match rx.try_recv() {
                Ok(next) => Some(next),
                Err(std::sync::mpsc::TryRecvError::Empty) => return None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
            }
        } else {
            rx.recv().ok()
        };
        let line = match next {
            Some(Ok(line)) => line,
            Some(Err(e)) => {
                read_failed = Some(e);
                ended = true;
                return None;
            }
            None => {
                ended = true;
                return None;
            }
        };
        let i = read;
        read += 1;
        let (asked, prompt) = match &batch {
            Some(defaults) => match crate::batch::parse(&g, &line.text, line.cut, i, defaults) {
                Ok((asked, prompt)) => (Given::Request(asked), prompt),
                Err(e) => (Given::Request(crate::batch::Asked::unread(i)), Err(e.to_string())),
            },
            None => {
                let tokens = line_prompt(&g, &line, a.chat).map_err(|e| e.to_string()).and_then(|t| t);
                // Drawn as its line's index: a refused line before it changes none of its draws.
                let (logprobs, penalties) = (a.logprobs.map(usize::from), penalties);
                let prompt = tokens.map(|tokens| StreamPrompt {
                    tokens,
                    draws_as: Some(i as u64),
                    logprobs,
                    penalties,
                    ..Default::default()
                });
                (Given::Prompt(line.text), prompt)
            }
        };
        match prompt {
            Ok(prompt) => {
                handed.borrow_mut().insert(given, (i, asked));
                given += 1;
                return Some(prompt);
            }
            Err(why) => order.borrow_mut().finish(i, asked, Outcome::Refused(why)),
        }
    });
    let t = Instant::now();
    g.generate_stream(
        prompts,
        a.max_tokens,
        decoding,
        &stops,
        |_, tok| {
            if stream {
                let mut shown = shown.borrow_mut();
                if shown.tokens.is_empty() {
                    print!("{:?} → \"", crate::shorten(&a.prompt[0]));
                }
                shown.push(&g, &stops, tok);
            }
        },
        |k, o| {
            let Some((i, prompt)) = handed.borrow_mut().remove(&k) else { return };
            order.borrow_mut().finish(i, prompt, Outcome::Done(o));
        },
    )?;
    let ran = t.elapsed();
    let order = order.into_inner();
    if let Some(b) = &order.bar {
        b.finish_and_clear();
    }
    if let Some(e) = order.failed {
        return Err(e);
    }
    if let Some(e) = read_failed {
        return Err(e.context(format!("after {} prompts", count(order.next, "prompt", "prompts"))));
    }
    if read == 0 {
        if let Some(file) = &a.batch {
            bail!("--batch {} holds no line: nothing to generate", file.display());
        }
        let path = a.prompt_file.as_deref().unwrap_or(std::path::Path::new("-"));
        bail!("--prompt-file {} holds no line, and no --prompt was given: nothing to generate", path.display());
    }
    let (prompts, generated) = order.generated;
    if let (Some(defaults), true) = (&batch, prompts > 0) {
        // Standard output holds the answers alone.
        eprintln!(
            "({} answered in {:.2} s, {generated} tokens, {:.1} tokens/s; seed {} for requests without one)",
            count(prompts, "request", "requests"),
            ran.as_secs_f64(),
            generated as f64 / ran.as_secs_f64().max(1e-9),
            defaults.seed
        );
    } else if !a.json && prompts > 0 {
        let how = described(decoding);
        println!(
            "({} stages on the CPU; model loaded in {:.1} s; {} tokens generated ({how}) for {} in {:.2} s, {:.1} tokens/s)",
            g.model().config().stages(),
            loaded.as_secs_f64(),
            generated,
            count(prompts, "prompt", "prompts"),
            ran.as_secs_f64(),
            generated as f64 / ran.as_secs_f64().max(1e-9)
        );
    }
    if order.refused_count > 0 {
        let (one, many) = if batch.is_some() { ("request", "requests") } else { ("prompt", "prompts") };
        let first: Vec<String> = order.refused.iter().map(|(i, why)| format!("{one} {}: {why}", i + 1)).collect();
        bail!(
            "{} not generated (of {read}): {}{}",
            count(order.refused_count, one, many),
            first.join("; "),
            if order.refused_count > first.len() { "; …" } else { "" }
        );
    }
    Ok(())
}

/// What `--batch` gives a request that does not say: `--max-tokens`, and `--seed` or a random
/// seed; the other sampling flags are the requests' own to set.
fn batch_defaults(a: &GenerateArgs) -> anyhow::Result<crate::openai::Defaults> {
    let s = &a.sampling;
    if s.temperature != 0.0 || s.top_k != 0 || s.top_p != 1.0 {
        bail!("--batch: each request's body sets its temperature, top_k and top_p (--seed seeds those without a seed)");
    }
    Ok(crate::openai::Defaults { max_tokens: a.max_tokens, seed: given_or_random(s.seed)? })
}

/// "greedy", or "sampled at temperature T, top-k K, top-p P, seed S" (the cuts when set).
pub(crate) fn described(decoding: Decoding) -> String {
    match decoding {
        Decoding::Greedy => "greedy".to_string(),
        Decoding::Sample(s) => format!(
            "sampled at temperature {}{}{}, seed {}",
            s.temperature,
            if s.top_k > 0 { format!(", top-k {}", s.top_k) } else { String::new() },
            if s.top_p < 1.0 { format!(", top-p {}", s.top_p) } else { String::new() },
            s.seed
        ),
    }
}

/// `line`'s tokens as a prompt (with `chat`, a user message in the model's chat template, the
/// assistant's turn opened), or why it cannot be one ([`Generator::prompt`]'s reasons, the
/// template's refusal, or a line cut at [`PROMPT_LINE`] bytes: generated from, its start would
/// be taken for the prompt).
fn line_prompt(
    g: &Generator,
    line: &crate::input::Line,
    chat: bool,
) -> Result<Result<Vec<u32>, String>, cascade_exec::ExecError> {
    if line.cut {
        return Ok(Err(crate::input::Line::cut_refusal(PROMPT_LINE)));
    }
    if !chat {
        return g.prompt(&line.text);
    }
    match g.chat_template()?.user_turn(&line.text) {
        Ok(text) => g.prompt(&text),
        Err(e) => Ok(Err(e.to_string())),
    }
}

/// The prompts a request stream cycles through (`cascade lora-serve`, `cascade pd`), tokenised:
/// the lines of `file`, or `builtin`. A line that could never be served (empty, over the context
/// window, over [`PROMPT_LINE`] bytes) is refused here, naming it: the stream's own check
/// would name a request, which is no line of the file.
pub(crate) fn prompts_to_cycle(
    file: Option<&std::path::Path>,
    builtin: &[&str],
    g: &Generator,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let Some(path) = file else {
        return Ok(builtin.iter().map(|p| g.encode(p)).collect::<Result<_, _>>()?);
    };
    let mut out = Vec::new();
    let lines = crate::input::given_then_lines(Vec::new(), Some(path.to_path_buf()), "--prompt-file", PROMPT_LINE)?;
    for (n, line) in lines.enumerate() {
        let line = line?;
        let where_ = || format!("line {} of --prompt-file {}", n + 1, path.display());
        match line_prompt(g, &line, false)? {
            Ok(tokens) => out.push(tokens),
            Err(why) => anyhow::bail!("{}: {why}", where_()),
        }
    }
    if out.is_empty() {
        anyhow::bail!("--prompt-file {} holds no line: no prompt to serve", path.display());
    }
    Ok(out)
}
