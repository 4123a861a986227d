//! Generation, greedy or sampled ([`super::sample`]), over a llama model directory
//! (`model.safetensors`, `config.json`, `tokenizer.json`, as `cascade model import --gguf` writes
//! them): each step runs one packed batch of the running sequences — a starting prompt's prefill
//! (or a chunk of a long one, [`GreedyLimits::prefill_chunk`]) beside the others' decode steps —
//! and every sequence decodes one token per step until it emits end-of-sequence, reaches its
//! token budget or fills the model's context window; a prompt starts as a running one finishes
//! ([`GreedyLimits`]).
//!
//! [`greedy`] drives any step function, so the same loop runs on one executor, on a split across
//! two ([`crate::llama`] stages `[0, k)` and `[k, L)`), or through the transport.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cascade_param_pool::manifest::Manifest;
use tokenizers::Tokenizer;

use super::logprob::{logprob_of, TokenLogprob, MAX_TOP_LOGPROBS};
use super::penalty::{Penalties, Seen};
use super::sample::{Decoding, Sampler};
use super::stop::StopStrings;
use super::text::ModelText;
use super::{Llama, LlamaConfig};
use crate::weights::Weights;
use crate::{Activation, ExecError, LayerExec};

/// One prompt's continuation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Generated {
    /// The prompt's tokens.
    pub prompt_tokens: Vec<u32>,
    /// The generated tokens (ending with end-of-sequence if it was emitted).
    pub tokens: Vec<u32>,
    /// Whether generation stopped because prompt and tokens filled the model's context window
    /// (before end-of-sequence and before the token budget).
    pub at_window: bool,
    /// Whether the caller's stop check ended it (its text holds a stop string: [`super::stop`]),
    /// or its [`StreamPrompt::cancel`] flag.
    pub stopped: bool,
    /// Each generated token's log-probability, when its prompt asked ([`StreamPrompt::logprobs`]);
    /// empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
}

/// The greedy choice (the first largest logit) of every segment of a head's output.
pub fn argmax(act: &Activation) -> Result<Vec<u32>, ExecError> {
    let logits = act.hidden.as_ref().ok_or_else(|| ExecError::Input("no logits".into()))?;
    Ok(logits.squeeze(0)?.argmax(1)?.to_vec1::<u32>()?)
}

/// The next token of every segment of a head's output: for segment `k` whose `draws[k]` is
/// `Some((sampler, n))` the sampler's draw for its `n`-th token, for the others the greedy
/// choice ([`argmax`]). One entry of `draws` per segment.
pub fn choose<'a>(
    act: &Activation,
    draws: impl IntoIterator<Item = Option<(&'a mut Sampler, u64)>>,
) -> Result<Vec<u32>, ExecError> {
    let draws: Vec<_> = draws.into_iter().collect();
    if draws.iter().all(Option::is_none) {
        let greedy = argmax(act)?;
        if greedy.len() != draws.len() {
            return Err(ExecError::Input(format!("{} segments' logits for {} sequences", greedy.len(), draws.len())));
        }
        return Ok(greedy);
    }
    let rows = logit_rows(act)?;
    choose_rows(&rows.iter().map(Vec::as_slice).collect::<Vec<_>>(), draws)
}

/// [`choose`] from logits already read into rows (one per segment), some of them changed
/// (penalties).
pub fn choose_rows<'a>(
    rows: &[&[f32]],
    draws: impl IntoIterator<Item = Option<(&'a mut Sampler, u64)>>,
) -> Result<Vec<u32>, ExecError> {
    let draws: Vec<_> = draws.into_iter().collect();
    if rows.len() != draws.len() {
        return Err(ExecError::Input(format!("{} segments' logits for {} sequences", rows.len(), draws.len())));
    }
    rows.iter()
        .zip(draws)
        .map(|(row, d)| match d {
            Some((sampler, n)) => sampler.pick(row, n),
            // The first largest, as argmax.
            None => Ok(top2(row).0),
        })
        .collect()
}

/// The logits of every segment of a head's output, as rows of f32.
fn logit_rows(act: &Activation) -> Result<Vec<Vec<f32>>, ExecError> {
    let logits = act.hidden.as_ref().ok_or_else(|| ExecError::Input("no logits".into()))?;
    Ok(logits.squeeze(0)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
}

/// The first largest logit of `row` and its margin over the next largest.
pub(crate) fn top2(row: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &x) in row.iter().enumerate() {
        if x > best.1 {
            second = best.1;
            best = (i, x);
        } else if x > second {
            second = x;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// Greedy generation: `step` runs a packed batch through every stage and returns the head's
/// output. Each prompt gets `seq_base + i` as its sequence id; generation of a prompt stops at
/// `eos`, after `max_tokens`, or when its next token would not fit the context `window` (the
/// model's positions: its last token is the one the last position predicts). A prompt longer
/// than the window is refused before anything runs.
pub fn greedy(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    seq_base: u64,
    max_tokens: usize,
    eos: u32,
    window: usize,
) -> Result<Vec<Generated>, ExecError> {
    greedy_each(step, prompts, seq_base, max_tokens, eos, window, |_, _| {})
}

/// [`greedy`], telling `on_token(i, token)` each token of prompt `i` as it is generated (to show
/// a long generation as it goes).
pub fn greedy_each(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    seq_base: u64,
    max_tokens: usize,
    eos: u32,
    window: usize,
    on_token: impl FnMut(usize, u32),
) -> Result<Vec<Generated>, ExecError> {
    greedy_running(step, prompts, GreedyLimits::all_at_once(seq_base, max_tokens, eos, window), on_token, |_, _| {})
}

/// Where a greedy generation stops, and how many sequences it runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GreedyLimits {
    /// Prompt `i` runs as sequence `seq_base + i`.
    pub seq_base: u64,
    /// Tokens generated per prompt at most.
    pub max_tokens: usize,
    /// The end-of-sequence token.
    pub eos: u32,
    /// The model's context window (its positions).
    pub window: usize,
    /// Sequences in one batch at most: the next prompt starts (its prefill packed with the
    /// others' decode steps) when one finishes. [`greedy`] runs them all at once.
    pub max_running: usize,
    /// Prompt tokens prefilled in one step at most: a later prompt waits for the next step. The
    /// activations of a step grow with its tokens (four prompts of 6,500 tokens packed in one
    /// step took 3.1 GB, one alone 1.16 GB).
    pub max_prefill_tokens: usize,
    /// A prompt's tokens fed in one step at most: a longer prompt is prefilled in chunks of this
    /// many over several steps (its first token comes after the last chunk), each attending to
    /// the cache the earlier chunks left, while the other sequences go on decoding a token per
    /// step. Chunks of one prompt give its logits of all at once, within float rounding.
    pub prefill_chunk: usize,
    /// KV positions the running sequences may reach together at most, each counted as its prompt
    /// and `max_tokens` (within the window) from its start: a prompt that would pass it waits
    /// until others finish. The KV cache grows with them (SmolLM2: 45 KiB a position).
    pub max_kv_tokens: usize,
}

impl GreedyLimits {
    /// Limits that run every prompt at once, with no budget: what [`greedy`] does.
    pub fn all_at_once(seq_base: u64, max_tokens: usize, eos: u32, window: usize) -> GreedyLimits {
        GreedyLimits {
            seq_base,
            max_tokens,
            eos,
            window,
            max_running: usize::MAX,
            max_prefill_tokens: usize::MAX,
            prefill_chunk: usize::MAX,
            max_kv_tokens: usize::MAX,
        }
    }

    /// The KV positions a sequence with a prompt of `prompt` tokens and a budget of `max_tokens`
    /// may reach.
    fn reserve(&self, prompt: usize, max_tokens: usize) -> usize {
        prompt.saturating_add(max_tokens).min(self.window)
    }
}

/// [`Generator`]'s prompt tokens prefilled in one step at most ([`GreedyLimits::max_prefill_tokens`]):
/// one window of SmolLM2.
pub const PREFILL_TOKENS: usize = 8192;

/// [`Generator`]'s prompt tokens of one sequence fed in one step at most
/// ([`GreedyLimits::prefill_chunk`]): a step's activations stay a few MB (SmolLM2's MLP holds
/// 6 KiB a token), under glibc's threshold for mapping every allocation afresh, and the other
/// sequences decode between a long prompt's chunks instead of waiting for its whole prefill.
pub const PREFILL_CHUNK: usize = 1024;

/// [`Generator`]'s KV positions held at once at most ([`GreedyLimits::max_kv_tokens`]): [`RUNNING`]
/// sequences of 2,048 positions, 2.8 GiB of SmolLM2's cache. Short prompts run [`RUNNING`] at a
/// time as before; prompts of thousands of tokens run fewer at once.
pub const KV_TOKENS: usize = RUNNING * 2048;

/// [`greedy_each`] with at most `limits.max_running` sequences at once, in prompt order, calling
/// `finished(i, generated)` as prompt `i`'s sequence (`seq_base + i`) ends — to free its KV
/// cache, or to show it — so memory is bounded by the running sequences rather than by all the
/// prompts. An empty prompt or one longer than the window is refused before anything runs.
pub fn greedy_running(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: &[Vec<u32>],
    limits: GreedyLimits,
    on_token: impl FnMut(usize, u32),
    mut finished: impl FnMut(usize, &Generated),
) -> Result<Vec<Generated>, ExecError> {
    every_result(prompts, limits.window, |each| {
        greedy_stream(step, prompts.iter().cloned(), limits, on_token, |i, g| {
            finished(i, &g);
            each(i, g);
        })
    })
}

/// Checks every prompt first (none empty, none longer than `window`), then runs `run`, keeping
/// what it hands to `each(i, generated)`: one result per prompt, in their order.
fn every_result(
    prompts: &[Vec<u32>],
    window: usize,
    run: impl FnOnce(&mut dyn FnMut(usize, Generated)) -> Result<usize, ExecError>,
) -> Result<Vec<Generated>, ExecError> {
    if let Some((i, why)) = prompts.iter().enumerate().find_map(|(i, p)| refusal(p, window).map(|why| (i, why))) {
        return Err(ExecError::Input(format!("prompt {i}: {why}")));
    }
    let mut out: Vec<Option<Generated>> = vec![None; prompts.len()];
    run(&mut |i, g| out[i] = Some(g))?;
    out.into_iter()
        .enumerate()
        .map(|(i, g)| g.ok_or_else(|| ExecError::Input(format!("prompt {i} was never finished"))))
        .collect()
}

/// Why `prompt` cannot be continued within a context `window`, if it cannot.
pub fn refusal(prompt: &[u32], window: usize) -> Option<String> {
    if prompt.is_empty() {
        Some("an empty prompt: no token to continue from".into())
    } else if prompt.len() > window {
        Some(format!("{} tokens; the model's context window is {window}", prompt.len()))
    } else {
        None
    }
}

/// Greedy generation over prompts as they come (read from a file, say): at most
/// `limits.max_running` sequences at once, the next prompt taken from `prompts` when one
/// finishes, and each result handed to `finished(i, generated)` and not kept, so memory is bounded
/// by the running sequences however many prompts there are. Returns how many prompts it took.
///
/// `prompts` is asked for the next one whenever a slot is free. `None` while sequences run means
/// "none ready yet" (a prompt still being typed or piped in): the run goes on with the running
/// ones and asks again after the next step; `None` with nothing running ends the run. An
/// ordinary iterator, which stays at `None` once it ends, needs nothing of this.
///
/// A prompt that [`refusal`] refuses ends the run with an error when it is reached (the
/// sequences then running are abandoned: their caches are the caller's to free).
pub fn greedy_stream(
    step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: impl IntoIterator<Item = Vec<u32>>,
    limits: GreedyLimits,
    on_token: impl FnMut(usize, u32),
    finished: impl FnMut(usize, Generated),
) -> Result<usize, ExecError> {
    decode_stream(step, prompts, limits, Decoding::Greedy, |_, _| false, on_token, finished)
}

/// A prompt as [`decode_stream`] takes it: its tokens and what it asks for itself, where it
/// differs from the run's — requests of one run each with their own budget, decoding and stop
/// strings (`cascade generate --batch`).
#[derive(Debug, Clone, Default)]
pub struct StreamPrompt {
    /// The prompt's tokens.
    pub tokens: Vec<u32>,
    /// The index its [`Sampler`] draws as; `None`: its place in the stream. A caller that skips
    /// some of its prompts (a line refused) keeps the others' draws those of their own places.
    pub draws_as: Option<u64>,
    /// Tokens to generate at most; `None`: the run's ([`GreedyLimits::max_tokens`]).
    pub max_tokens: Option<usize>,
    /// How its tokens are chosen; `None`: the run's.
    pub decoding: Option<Decoding>,
    /// Its stop strings; `None`: the run's (handed to `decode_stream`'s stop check as they are).
    pub stop: Option<StopStrings>,
    /// Set (by whoever waits for it — a client that went away), it ends the sequence after its
    /// next token, as a stop check would ([`Generated::stopped`]), freeing its slot and cache.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// `Some(n)`: each generated token's log-probability is computed, with the `n` most likely
    /// tokens' at its step (at most [`MAX_TOP_LOGPROBS`]), into [`Generated::logprobs`]. They are
    /// the model's, before [`StreamPrompt::penalties`], as vLLM reports them.
    pub logprobs: Option<usize>,
    /// Penalties on the tokens it has seen, applied to its logits before each choice
    /// ([`super::penalty`]); `None`: none.
    pub penalties: Option<Penalties>,
}

impl From<Vec<u32>> for StreamPrompt {
    fn from(tokens: Vec<u32>) -> StreamPrompt {
        StreamPrompt { tokens, ..StreamPrompt::default() }
    }
}

/// [`greedy_stream`] choosing each token as `decoding` says: greedily, or sampled by each
/// prompt's own seeded [`Sampler`] (prompt `i` of the stream draws its `n`-th token with
/// `Sampler::new(_, i)`'s draw `n`, or with the index its [`StreamPrompt::draws_as`] gives).
/// Greedy and sampled runs stop, batch and budget alike. After each token but end-of-sequence,
/// `stop(prompt's stop strings, tokens)` is asked whether the sequence's tokens so far end it
/// ([`Generated::stopped`]: a stop string, [`super::stop`]); `|_, _| false` asks nothing. A
/// prompt's own budget and decoding ([`StreamPrompt`]) replace `limits.max_tokens` and
/// `decoding` for it.
pub fn decode_stream<P: Into<StreamPrompt>>(
    mut step: impl FnMut(Activation) -> Result<Activation, ExecError>,
    prompts: impl IntoIterator<Item = P>,
    limits: GreedyLimits,
    decoding: Decoding,
    mut stop: impl FnMut(Option<&StopStrings>, &[u32]) -> bool,
    mut on_token: impl FnMut(usize, u32),
    mut finished: impl FnMut(usize, Generated),
) -> Result<usize, ExecError> {
    let GreedyLimits {
        seq_base,
        max_tokens,
        eos,
        window,
        max_running,
        max_prefill_tokens,
        prefill_chunk,
        max_kv_tokens,
    } = limits;
    if max_running == 0 {
        return Err(ExecError::Input("no sequence may run (max_running 0)".into()));
    }
    if prefill_chunk == 0 {
        return Err(ExecError::Input("no prompt token may be fed (prefill_chunk 0)".into()));
    }
    /// A sequence being generated: its prompt's index, the position of the next token fed, the
    /// tokens to feed, and what it has generated.
    struct Running {
        i: usize,
        pos: u32,
        fed: Vec<u32>,
        out: Generated,
        sampler: Option<Sampler>,
        max_tokens: usize,
        stop: Option<StopStrings>,
        cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
        logprobs: Option<usize>,
        /// Its penalties, with what it has seen.
        penalties: Option<(Penalties, Seen)>,
    }
    let mut waiting = prompts.into_iter().map(Into::into).enumerate();
    let mut taken = 0;
    let mut running: Vec<Running> = Vec::new();
    // A prompt taken that did not fit the step's budgets: the first to start later (FIFO).
    let mut held: Option<(usize, StreamPrompt)> = None;
    loop {
        // The chunks of the prompts still being prefilled count against the step's budget.
        let mut prefill: usize =
            running.iter().filter(|r| r.out.tokens.is_empty()).map(|r| r.fed.len().min(prefill_chunk)).sum();
        let mut kv: usize = running.iter().map(|r| limits.reserve(r.out.prompt_tokens.len(), r.max_tokens)).sum();
        while running.len() < max_running {
            let Some((i, prompt)) = held.take().or_else(|| waiting.next()) else { break };
            taken = i + 1;
            let p = &prompt.tokens;
            if let Some(why) = refusal(p, window) {
                return Err(ExecError::Input(format!("prompt {i}: {why}")));
            }
            // One sequence alone always runs, whatever the budgets.
            let budget = prompt.max_tokens.unwrap_or(max_tokens);
            let (tokens, reserve) = (p.len().min(prefill_chunk), limits.reserve(p.len(), budget));
            if !running.is_empty() && (prefill + tokens > max_prefill_tokens || kv + reserve > max_kv_tokens) {
                held = Some((i, prompt));
                break;
            }
            let StreamPrompt { tokens: p, draws_as, decoding: own, stop: stops, cancel, logprobs, penalties, .. } =
                prompt;
            let penalties = penalties.filter(|x| !x.is_neutral()).map(|x| (x, Seen::new(&p)));
            (prefill, kv) = (prefill + tokens, kv + reserve);
            let out = Generated {
                prompt_tokens: p.clone(),
                tokens: Vec::new(),
                at_window: false,
                stopped: false,
                logprobs: Vec::new(),
            };
            let logprobs = logprobs.map(|n| n.min(MAX_TOP_LOGPROBS));
            if budget == 0 {
                finished(i, out);
            } else {
                let draws = own.unwrap_or(decoding).sampling();
                let sampler = draws.map(|s| Sampler::new(s, draws_as.unwrap_or(i as u64)));
                let max_tokens = budget;
                let r =
                    Running { i, pos: 0, fed: p, out, sampler, max_tokens, stop: stops, cancel, logprobs, penalties };
                running.push(r);
            }
        }
        if running.is_empty() {
            return Ok(taken);
        }
        let batch: Vec<(u64, u32, Vec<u32>)> = running
            .iter()
            .map(|r| (seq_base + r.i as u64, r.pos, r.fed[..r.fed.len().min(prefill_chunk)].to_vec()))
            .collect();
        let out = step(Activation::packed(&batch)?)?;
        // The logits as rows, when a sequence that gives a token now wants its log-probability
        // or has penalties (applied to a copy of its row, which it chooses from).
        let gives = |r: &Running| r.fed.len() <= prefill_chunk;
        let rows = match running.iter().any(|r| gives(r) && (r.logprobs.is_some() || r.penalties.is_some())) {
            true => Some(logit_rows(&out)?),
            false => None,
        };
        let penalized: Vec<Option<Vec<f32>>> = running
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let (p, seen) = r.penalties.as_ref().filter(|_| gives(r))?;
                let mut row = rows.as_ref()?.get(k)?.clone();
                seen.apply(p, &mut row);
                Some(row)
            })
            .collect();
        // A row that ends a chunk of its prompt gives no token: nothing is drawn for it.
        let draws = running.iter_mut().map(|r| {
            let n = r.out.tokens.len() as u64;
            let gives = r.fed.len() <= prefill_chunk;
            r.sampler.as_mut().filter(|_| gives).map(|s| (s, n))
        });
        // Rows read already are chosen from (a penalised sequence from its changed copy), not read again.
        let next = match &rows {
            Some(rows) => {
                let chosen_from: Vec<&[f32]> =
                    rows.iter().zip(&penalized).map(|(raw, p)| p.as_deref().unwrap_or(raw)).collect();
                choose_rows(&chosen_from, draws)?
            }
            None => choose(&out, draws)?,
        };
        let mut still = Vec::with_capacity(running.len());
        for (k, (mut r, tok)) in running.into_iter().zip(next).enumerate() {
            if r.fed.len() > prefill_chunk {
                // A chunk of its prompt went in; what it predicts is no token yet.
                r.pos += prefill_chunk as u32;
                r.fed.drain(..prefill_chunk);
                still.push(r);
                continue;
            }
            r.out.tokens.push(tok);
            if let (Some(top), Some(row)) = (r.logprobs, rows.as_ref().and_then(|rows| rows.get(k))) {
                r.out.logprobs.push(logprob_of(row, tok, top));
            }
            if let Some((_, seen)) = r.penalties.as_mut() {
                seen.push(tok);
            }
            on_token(r.i, tok);
            let cancelled = r.cancel.as_ref().is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed));
            if tok != eos && (cancelled || stop(r.stop.as_ref(), &r.out.tokens)) {
                r.out.stopped = true;
                finished(r.i, r.out);
                continue;
            }
            // `tok` is fed next at `at`: only a position inside the window takes it.
            let at = r.pos + r.fed.len() as u32;
            let more = tok != eos && r.out.tokens.len() < r.max_tokens;
            if more && (at as usize) < window {
                still.push(Running { pos: at, fed: vec![tok], ..r });
                continue;
            }
            r.out.at_window = more;
            finished(r.i, r.out);
        }
        running = still;
    }
}

/// A loaded llama model with its text side (tokenizer, chat template: [`ModelText`]).
pub struct Generator {
    text: Arc<ModelText>,
    model: Llama,
    manifest: Manifest,
    next_seq: AtomicU64,
}

impl Generator {
    /// Loads `dir` (every stage).
    ///
    /// The model loads while the manifest's SHA-256 and chunk crcs are computed on another
    /// thread: `cascade generate`'s start took 0.8 s, 0.3 s of it that hash, before 2026-12-05.
    pub fn from_dir(dir: &Path) -> Result<Generator, ExecError> {
        let (files, loaded) = crate::embed::read_files_while(dir, |f| -> Result<_, ExecError> {
            let cfg = LlamaConfig::from_json(
                f.config.ok_or_else(|| ExecError::Model(format!("{}: no config.json", dir.display())))?,
            )?;
            let stages = 0..cfg.stages();
            Llama::load(cfg, &Weights::file(f.layout, f.bytes)?, stages)
        })?;
        let model = loaded?;
        let text = Arc::new(ModelText::new(files.tokenizer, model.config(), dir));
        Ok(Generator { text, model, manifest: files.manifest, next_seq: AtomicU64::new(1) })
    }

    /// The model's text side: tokenizer, chat template, end of sequence, window.
    pub fn text(&self) -> &Arc<ModelText> {
        &self.text
    }

    /// The model's chat template ([`ModelText::chat_template`]).
    pub fn chat_template(&self) -> Result<&super::chat::ChatTemplate, ExecError> {
        self.text.chat_template()
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model, to change (adapters, merging).
    pub fn model_mut(&mut self) -> &mut Llama {
        &mut self.model
    }

    /// The model's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.text.tokenizer()
    }

    /// `text`'s tokens ([`ModelText::encode`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ExecError> {
        self.text.encode(text)
    }

    /// `text`'s tokens as a prompt, or why it cannot be continued ([`ModelText::prompt`]).
    pub fn prompt(&self, text: &str) -> Result<Result<Vec<u32>, String>, ExecError> {
        self.text.prompt(text)
    }

    /// `tokens` as text (special tokens kept).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, ExecError> {
        self.text.decode(tokens)
    }

    /// Greedy continuations of `prompts`, [`RUNNING`] sequences at a time (in prompt order);
    /// each one's cache is freed when it finishes.
    pub fn generate(&self, prompts: &[Vec<u32>], max_tokens: usize) -> Result<Vec<Generated>, ExecError> {
        self.generate_each(prompts, max_tokens, |_, _| {}, |_, _| {})
    }

    /// [`Generator::generate`], telling `on_token(i, token)` each token of prompt `i` as it is
    /// generated and `on_done(i, generated)` when prompt `i` is done. An empty prompt or one
    /// longer than the context window is refused before anything runs.
    pub fn generate_each(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        on_token: impl FnMut(usize, u32),
        mut on_done: impl FnMut(usize, &Generated),
    ) -> Result<Vec<Generated>, ExecError> {
        every_result(prompts, self.model.config().max_position_embeddings, |each| {
            let none = StopStrings::default();
            self.generate_stream(prompts.iter().cloned(), max_tokens, Decoding::Greedy, &none, on_token, |i, g| {
                on_done(i, &g);
                each(i, g);
            })
        })
    }

    /// Continuations of prompts as they come ([`decode_stream`]: [`RUNNING`] sequences at a
    /// time, the next prompt taken as one finishes; each token chosen as `decoding` says, prompt
    /// `i` sampling from its own seeded generator, or as its [`StreamPrompt::draws_as`] says; a
    /// sequence whose text comes to hold one of `stops` ended there, [`Generated::stopped`]), each
    /// handed to `on_done(i, generated)` and not kept, its cache freed: memory stays bounded
    /// however many prompts there are. Returns
    /// how many prompts it took. A prompt [`refusal`] refuses ends the run with an error when it
    /// is reached; the caches of the sequences then running are freed.
    ///
    /// One run takes sequence ids from a range of 2⁴⁰ of its own, so runs on one generator never
    /// share a cache.
    pub fn generate_stream<P: Into<StreamPrompt>>(
        &self,
        prompts: impl IntoIterator<Item = P>,
        max_tokens: usize,
        decoding: Decoding,
        stops: &StopStrings,
        on_token: impl FnMut(usize, u32),
        mut on_done: impl FnMut(usize, Generated),
    ) -> Result<usize, ExecError> {
        const RANGE: u64 = 1 << 40;
        let base = self.next_seq.fetch_add(RANGE, Ordering::Relaxed);
        let taken = std::cell::Cell::new(0u64);
        let prompts = prompts.into_iter().inspect(|_| taken.set(taken.get() + 1));
        let layers = self.model.layers();
        let cfg = self.model.config();
        let limits = GreedyLimits {
            seq_base: base,
            max_tokens,
            eos: cfg.eos_token_id,
            window: cfg.max_position_embeddings,
            max_running: RUNNING,
            max_prefill_tokens: PREFILL_TOKENS,
            prefill_chunk: PREFILL_CHUNK,
            max_kv_tokens: KV_TOKENS,
        };
        let out = decode_stream(
            // The loop owns the process's compute: each step on rayon's threads.
            |a| crate::threads::on_compute_threads(|| self.model.run(0..layers, a)),
            prompts,
            limits,
            decoding,
            |own, tokens| own.unwrap_or(stops).ended(self.text.tokenizer(), tokens),
            on_token,
            |i, g| {
                self.model.free(base + i as u64);
                on_done(i, g);
            },
        );
        if out.is_err() {
            for i in 0..taken.get() {
                self.model.free(base + i);
            }
        }
        out
    }
}

/// Sequences [`Generator::generate`] runs at once; later prompts start as earlier ones finish.
/// All at once, 300 prompts of ~150 tokens took 5.2 GB here.
pub const RUNNING: usize = 32;

/// `text`'s tokens with `tokenizer`, with what its post-processor adds around a text (a
/// beginning-of-sequence token for a model whose GGUF says `add_bos_token`; nothing for SmolLM2).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ExecError> {
    let enc = tokenizer.encode(text, true).map_err(|e| ExecError::Input(format!("tokenising: {e}")))?;
    Ok(enc.get_ids().to_vec())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    const VOCAB: usize = 50;
    const EOS: u32 = 49;

    /// A stand-in for a model's stages: each segment's next token is `(pos + len) % 40` (never
    /// `EOS`), or `EOS` for sequence 99. Records the furthest position any batch reaches.
    fn step(reach: &mut u32) -> impl FnMut(Activation) -> Result<Activation, ExecError> + '_ {
        move |a: Activation| {
            let mut rows = vec![0f32; a.segments.len() * VOCAB];
            for (k, g) in a.segments.iter().enumerate() {
                *reach = (*reach).max(g.pos + g.len);
                let tok = if g.seq == 99 { EOS as usize } else { (g.pos + g.len) as usize % 40 };
                rows[k * VOCAB + tok] = 1.0;
            }
            a_with(a, rows)
        }
    }

    #[test]
    fn generation_stops_where_the_context_window_is_full_and_keeps_its_tokens() {
        let window = 10;
        let mut reach = 0;
        let prompts = [vec![1; 7], vec![1; 2], vec![1; 10]];
        let out = greedy(step(&mut reach), &prompts, 1, 100, EOS, window).unwrap();
        // A prompt of p tokens leaves positions p..window for w − p fed tokens: w − p + 1 generated
        // (the last one predicted by the window's last position).
        let got: Vec<(usize, bool)> = out.iter().map(|o| (o.tokens.len(), o.at_window)).collect();
        assert_eq!(got, [(4, true), (9, true), (1, true)]);
        assert!(reach as usize <= window, "a batch reached position {reach} of a {window}-token window");
        assert_eq!(out[0].tokens, [7, 8, 9, 10]);
        // Each token is told as it comes, to its prompt, in order.
        let mut told: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let each = greedy_each(step(&mut reach), &prompts, 1, 100, EOS, window, |i, t| told[i].push(t)).unwrap();
        assert_eq!(told, each.iter().map(|o| o.tokens.clone()).collect::<Vec<_>>());

        // The budget or end-of-sequence first: not at the window.
        let out = greedy(step(&mut reach), &[vec![1; 2]], 1, 5, EOS, window).unwrap();
        assert_eq!((out[0].tokens.len(), out[0].at_window), (5, false));
        let out = greedy(step(&mut reach), &[vec![1; 2]], 99, 5, EOS, window).unwrap();
        assert_eq!((out[0].tokens.clone(), out[0].at_window), (vec![EOS], false));
    }

    /// A stop check ends only the sequence it is true of, after the token that made it true,
    /// and the sequences beside it go on as without it; a stopped one has its cache freed like
    /// any other (its slot taken by the next prompt).
    #[test]
    fn a_stop_check_ends_the_sequence_it_is_true_of() {
        let window = 40;
        let mut reach = 0;
        // The stand-in's token is its position mod 40: a prompt of 2 generates 2, 3, 4, …
        let prompts = [vec![1; 2], vec![1; 5], vec![1; 8]];
        let run = |stop: &mut dyn FnMut(Option<&StopStrings>, &[u32]) -> bool, reach: &mut u32| {
            let mut out = vec![None; prompts.len()];
            let limits = GreedyLimits { max_running: 2, ..GreedyLimits::all_at_once(1, 10, EOS, window) };
            decode_stream(
                step(reach),
                prompts.clone(),
                limits,
                Decoding::Greedy,
                stop,
                |_, _| {},
                |i, g| out[i] = Some(g),
            )
            .unwrap();
            out.into_iter().map(Option::unwrap).collect::<Vec<_>>()
        };
        let plain = run(&mut |_, _| false, &mut reach);
        // Ends once a sequence has generated a 6: the first after 2, 3, 4, 5, 6; the second at
        // once; the third (8, 9, …) never.
        let stopped = run(&mut |_, t| t.last() == Some(&6), &mut reach);
        assert_eq!(stopped[0].tokens, [2, 3, 4, 5, 6]);
        assert_eq!(stopped[1].tokens, [5, 6]);
        assert_eq!(stopped[2].tokens, plain[2].tokens, "a stop of others changed the third");
        assert_eq!(stopped.iter().map(|g| g.stopped).collect::<Vec<_>>(), [true, true, false]);
        assert!(plain.iter().all(|g| !g.stopped && g.tokens.len() == 10));
    }

    /// A prompt that asks for log-probabilities gets one per generated token — the token its
    /// step chose, first among the alternatives — and one that does not gets none; asking
    /// changes no token.
    #[test]
    fn log_probabilities_come_for_the_prompts_that_ask() {
        let mut reach = 0;
        let asks = StreamPrompt { tokens: vec![1; 2], logprobs: Some(3), ..StreamPrompt::default() };
        let prompts = vec![asks, StreamPrompt::from(vec![1; 5])];
        let mut out = vec![None; 2];
        let limits = GreedyLimits::all_at_once(1, 6, EOS, 40);
        decode_stream(
            step(&mut reach),
            prompts,
            limits,
            Decoding::Greedy,
            |_, _| false,
            |_, _| {},
            |i, g| out[i] = Some(g),
        )
        .unwrap();
        let [Some(asked), Some(plain)] = <[Option<Generated>; 2]>::try_from(out).unwrap() else {
            panic!("not every prompt answered")
        };
        assert_eq!((asked.tokens.clone(), plain.tokens.clone()), (vec![2, 3, 4, 5, 6, 7], vec![5, 6, 7, 8, 9, 10]));
        assert!(plain.logprobs.is_empty());
        assert_eq!(asked.logprobs.len(), 6);
        // The stand-in's rows: 1 at the token, 0 elsewhere among 50.
        let want = 1.0 - (1f64.exp() + 49.0).ln();
        for (lp, &tok) in asked.logprobs.iter().zip(&asked.tokens) {
            assert_eq!((lp.top.len(), lp.top[0].0), (3, tok));
            assert!((f64::from(lp.logprob) - want).abs() < 1e-6 && lp.top[0].1 == lp.logprob, "{lp:?}");
        }
    }

    /// Penalties change only the sequences that have them, each by its own tokens: the stand-in
    /// favours token 5 (logit 1) over 6 (0.9); presence 0.5 lets 6 through once, frequency 0.2
    /// alternates them, repetition 2 with 5 in the prompt starts with 6.
    #[test]
    fn penalties_steer_only_their_own_sequence() {
        let favour = |a: Activation| {
            let mut rows = vec![0f32; a.segments.len() * VOCAB];
            for k in 0..a.segments.len() {
                rows[k * VOCAB + 5] = 1.0;
                rows[k * VOCAB + 6] = 0.9;
            }
            a_with(a, rows)
        };
        let with = |tokens: Vec<u32>, p: Option<(f32, f32, f32)>| StreamPrompt {
            tokens,
            penalties: p.map(|(a, b, c)| super::Penalties::new(a, b, c).unwrap()),
            logprobs: Some(0),
            ..StreamPrompt::default()
        };
        let prompts = vec![
            with(vec![1, 1], None),
            with(vec![1, 1], Some((0.5, 0.0, 1.0))),
            with(vec![1, 1], Some((0.0, 0.2, 1.0))),
            with(vec![5], Some((0.0, 0.0, 2.0))),
            with(vec![1, 1], Some((0.0, 0.0, 1.0))),
        ];
        let mut out = vec![Vec::new(); prompts.len()];
        let mut lps = vec![Vec::new(); prompts.len()];
        let limits = GreedyLimits::all_at_once(1, 4, EOS, 40);
        decode_stream(
            favour,
            prompts,
            limits,
            Decoding::Greedy,
            |_, _| false,
            |_, _| {},
            |i, g| {
                lps[i] = g.logprobs.iter().map(|l| l.logprob).collect();
                out[i] = g.tokens;
            },
        )
        .unwrap();
        assert_eq!(out, [vec![5, 5, 5, 5], vec![5, 6, 5, 5], vec![5, 6, 5, 6], vec![6, 5, 5, 5], vec![5, 5, 5, 5]]);
        // Log-probabilities are the model's, before the penalties: 6's is below 5's.
        assert!(lps[3][0] < lps[3][1], "{:?}", lps[3]);
    }

    /// With at most two sequences running, five prompts give what they give all at once; no
    /// batch holds more than two, later prompts start as earlier ones finish, and each sequence
    /// is reported finished once, when its last token is out.
    #[test]
    fn a_bounded_run_gives_the_same_tokens_with_at_most_its_bound_running() {
        let window = 20;
        let prompts = [vec![1; 7], vec![1; 2], vec![1; 10], vec![1; 3], vec![1; 1]];
        let mut reach = 0;
        let all = greedy(step(&mut reach), &prompts, 1, 6, EOS, window).unwrap();
        let mut widest = 0;
        let mut reach2 = 0;
        let mut inner = step(&mut reach2);
        let counting = |a: Activation| {
            widest = widest.max(a.segments.len());
            inner(a)
        };
        let limits = GreedyLimits { max_running: 2, ..GreedyLimits::all_at_once(1, 6, EOS, window) };
        let mut done = Vec::new();
        let mut tokens_at_finish = Vec::new();
        let told = std::cell::RefCell::new(vec![0usize; prompts.len()]);
        let bounded = greedy_running(
            counting,
            &prompts,
            limits,
            |i, _| told.borrow_mut()[i] += 1,
            |i, g| {
                done.push(i);
                tokens_at_finish.push((told.borrow()[i], g.tokens.len()));
            },
        )
        .unwrap();
        assert_eq!(bounded, all);
        assert_eq!(widest, 2);
        let mut sorted = done.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3, 4], "each finished once: {done:?}");
        assert!(tokens_at_finish.iter().all(|&n| n == (6, 6)), "finished before its last token: {tokens_at_finish:?}");
        let limits = GreedyLimits { max_running: 0, ..limits };
        assert!(greedy_running(step(&mut reach), &prompts, limits, |_, _| {}, |_, _| {}).is_err());
    }

    /// A stand-in whose logits spread over the vocabulary (a different spread at each position
    /// and sequence length): sampling has choices to make.
    fn spread(a: Activation) -> Result<Activation, ExecError> {
        let mut rows = vec![0f32; a.segments.len() * VOCAB];
        for (k, g) in a.segments.iter().enumerate() {
            for (t, l) in rows[k * VOCAB..(k + 1) * VOCAB - 1].iter_mut().enumerate() {
                *l = ((t as u32 * 7 + g.pos + g.len) % 11) as f32 * 0.3;
            }
        }
        a_with(a, rows)
    }

    fn a_with(mut a: Activation, rows: Vec<f32>) -> Result<Activation, ExecError> {
        a.hidden = Some(Tensor::from_vec(rows, (1, a.segments.len(), VOCAB), &Device::Cpu)?);
        Ok(a)
    }

    /// Sampled tokens depend on the seed and each prompt's index, not on what runs beside it:
    /// all at once, two at a time, or with prompts prefilled in chunks of 2, the same tokens. A
    /// temperature of 0 is greedy.
    #[test]
    fn sampled_tokens_do_not_depend_on_batching_or_chunking() {
        let window = 40;
        let prompts: Vec<Vec<u32>> = (0..5).map(|k| vec![1; 1 + 2 * k]).collect();
        let run = |limits: GreedyLimits, d: Decoding| {
            let mut out = vec![None; prompts.len()];
            decode_stream(spread, prompts.clone(), limits, d, |_, _| false, |_, _| {}, |i, g| out[i] = Some(g))
                .unwrap();
            out.into_iter().map(|g| g.unwrap().tokens).collect::<Vec<_>>()
        };
        let all = GreedyLimits::all_at_once(1, 12, EOS, window);
        let sampled = |seed| Decoding::new(1.0, 0, 0.9, seed).unwrap();
        let at_once = run(all, sampled(5));
        assert_eq!(run(GreedyLimits { max_running: 2, ..all }, sampled(5)), at_once);
        assert_eq!(run(GreedyLimits { prefill_chunk: 2, ..all }, sampled(5)), at_once);
        assert_ne!(run(all, sampled(6)), at_once, "another seed, the same tokens");
        let greedy = run(all, Decoding::Greedy);
        assert_ne!(at_once, greedy);
        assert_eq!(run(all, Decoding::new(0.0, 0, 0.9, 5).unwrap()), greedy);
        // Prompts 1 and 2 are not alike, and draw from different generators: a prompt's tokens
        // vary across its steps rather than repeating the greedy choice.
        assert!(at_once.iter().any(|t| t.windows(2).any(|w| w[0] != w[1])));
        // Prompt 2 left out: the others, drawn as their own indices, draw what they drew; drawn as
        // their places in the shorter stream, the ones after it do not.
        let skipped = |draws_as: bool| {
            let rest = [0, 1, 3, 4].map(|k| StreamPrompt {
                tokens: prompts[k].clone(),
                draws_as: draws_as.then_some(k as u64),
                ..Default::default()
            });
            let mut out = vec![Vec::new(); rest.len()];
            decode_stream(spread, rest, all, sampled(5), |_, _| false, |_, _| {}, |i, g| out[i] = g.tokens).unwrap();
            out
        };
        let kept = [0, 1, 3, 4].map(|k| at_once[k].clone());
        assert_eq!(skipped(true), kept);
        assert_ne!(skipped(false)[2..], kept[2..]);
    }

    /// A prompt's own budget, decoding and stop strings replace the run's for it alone: in a
    /// greedy run of 12 tokens, one prompt sampled gives what it gives in a sampled run, one of
    /// 3 tokens the first 3 of its greedy answer, and the stop check is handed a prompt's own
    /// strings (none: the run's, `None`). A prompt cancelled ends after its next token.
    #[test]
    fn a_prompt_asks_for_its_own_budget_decoding_and_stop_strings() {
        let prompts: Vec<Vec<u32>> = (0..4).map(|k| vec![1; 1 + 2 * k]).collect();
        let all = GreedyLimits::all_at_once(1, 12, EOS, 40);
        let sampled = Decoding::new(1.0, 0, 0.9, 5).unwrap();
        let run = |prompts: Vec<StreamPrompt>, d: Decoding| {
            let mut out = vec![Vec::new(); prompts.len()];
            let mut asked = Vec::new();
            decode_stream(
                spread,
                prompts,
                GreedyLimits { max_running: 2, ..all },
                d,
                |own, _| {
                    // What the check was handed; the sequences stop only by their budgets.
                    asked.push(own.cloned());
                    false
                },
                |_, _| {},
                |i, g| out[i] = g.tokens,
            )
            .unwrap();
            (out, asked)
        };
        let plain = |d| run(prompts.iter().cloned().map(StreamPrompt::from).collect(), d).0;
        let (greedy, drawn) = (plain(Decoding::Greedy), plain(sampled));
        let stop = StopStrings::new(vec!["x".into()]).unwrap();
        let mixed: Vec<StreamPrompt> = vec![
            prompts[0].clone().into(),
            StreamPrompt { tokens: prompts[1].clone(), decoding: Some(sampled), ..Default::default() },
            StreamPrompt { tokens: prompts[2].clone(), max_tokens: Some(3), ..Default::default() },
            StreamPrompt { tokens: prompts[3].clone(), stop: Some(stop.clone()), ..Default::default() },
        ];
        let (out, asked) = run(mixed, Decoding::Greedy);
        assert_eq!(out[0], greedy[0]);
        assert_eq!(out[1], drawn[1], "its own sampling");
        assert_ne!(drawn[1], greedy[1]);
        assert_eq!(out[2], greedy[2][..3], "its own budget");
        assert_eq!(out[3], greedy[3]);
        // A prompt whose flag is set ends after its first token, the others as before.
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let cancelled = vec![
            StreamPrompt { tokens: prompts[0].clone(), cancel: Some(flag), ..Default::default() },
            prompts[1].clone().into(),
        ];
        let (cut, _) = run(cancelled, Decoding::Greedy);
        assert_eq!((cut[0].len(), &cut[1]), (1, &greedy[1]));
        // Asked once per token but end-of-sequence: prompt 3's with its own strings.
        let own = asked.iter().filter(|a| a.as_ref() == Some(&stop)).count();
        assert_eq!(own, out[3].iter().filter(|&&t| t != EOS).count());
        assert!(asked.contains(&None));
    }

    /// Prompts taken from an iterator are taken only as slots free (never more than the bound
    /// ahead of the finished ones), give what they give all at once, and are not kept; an
    /// empty prompt reached mid-stream ends the run with its index, after the ones before it
    /// were handed over.
    #[test]
    fn a_stream_takes_prompts_as_slots_free_and_keeps_none() {
        let window = 20;
        let prompts: Vec<Vec<u32>> = (0..9).map(|k| vec![1; 1 + k % 4]).collect();
        let mut reach = 0;
        let all = greedy(step(&mut reach), &prompts, 1, 5, EOS, window).unwrap();
        let limits = GreedyLimits { max_running: 3, ..GreedyLimits::all_at_once(1, 5, EOS, window) };
        let taken = std::cell::Cell::new(0usize);
        let finished = std::cell::RefCell::new(Vec::new());
        let lazily = prompts.iter().cloned().inspect(|_| {
            let ahead = taken.get() - finished.borrow().len();
            assert!(ahead < 3, "a prompt taken with {ahead} running");
            taken.set(taken.get() + 1);
        });
        let n = greedy_stream(step(&mut reach), lazily, limits, |_, _| {}, |i, g| finished.borrow_mut().push((i, g)))
            .unwrap();
        assert_eq!(n, prompts.len());
        let mut got = finished.into_inner();
        got.sort_by_key(|(i, _)| *i);
        assert_eq!(got.into_iter().map(|(_, g)| g).collect::<Vec<_>>(), all);

        let mut with_empty = prompts.clone();
        with_empty[5] = Vec::new();
        let mut handed = Vec::new();
        let e = greedy_stream(step(&mut reach), with_empty, limits, |_, _| {}, |i, _| handed.push(i)).unwrap_err();
        assert_eq!(e.to_string(), "input: prompt 5: an empty prompt: no token to continue from");
        assert!(handed.len() >= 2 && handed.iter().all(|&i| i < 5), "{handed:?}");
    }

    /// A step prefills at most `max_prefill_tokens` prompt tokens, and the running sequences
    /// reserve at most `max_kv_tokens` positions (prompt + `max_tokens` each); a prompt over
    /// either waits, in order, and one alone always runs. The tokens are those of all at once.
    #[test]
    fn prompts_wait_for_the_prefill_and_kv_budgets_and_give_the_same_tokens() {
        let window = 40;
        let prompts: Vec<Vec<u32>> = [6, 3, 9, 2, 12, 1].iter().map(|&n| vec![1; n]).collect();
        let mut reach = 0;
        let all = greedy(step(&mut reach), &prompts, 1, 4, EOS, window).unwrap();
        for (prefill, kv) in [(8, usize::MAX), (usize::MAX, 20), (5, 16), (1, 1)] {
            let limits = GreedyLimits {
                max_running: 4,
                max_prefill_tokens: prefill,
                max_kv_tokens: kv,
                ..GreedyLimits::all_at_once(1, 4, EOS, window)
            };
            let mut steps: Vec<Vec<(u64, u32, u32)>> = Vec::new();
            let mut reach = 0;
            let mut inner = step(&mut reach);
            let recording = |a: Activation| {
                steps.push(a.segments.iter().map(|g| (g.seq, g.pos, g.len)).collect());
                inner(a)
            };
            let got = greedy_running(recording, &prompts, limits, |_, _| {}, |_, _| {}).unwrap();
            assert_eq!(got, all, "budgets {prefill}, {kv}");
            let mut started = Vec::new();
            for s in &steps {
                // A prefill is a segment at position 0.
                let new: Vec<u32> = s.iter().filter(|g| g.1 == 0).map(|g| g.2).collect();
                started.extend(s.iter().filter(|g| g.1 == 0).map(|g| g.0));
                let alone = s.len() == 1;
                assert!(alone || new.iter().sum::<u32>() as usize <= prefill, "{prefill}, {kv}: step {s:?}");
                let reserved: usize = s.iter().map(|g| (prompts[(g.0 - 1) as usize].len() + 4).min(window)).sum();
                assert!(alone || reserved <= kv, "{prefill}, {kv}: step {s:?} reserves {reserved}");
            }
            assert_eq!(started, (1..=6).collect::<Vec<u64>>(), "{prefill}, {kv}: in their order");
        }
    }

    /// A prompt longer than `prefill_chunk` goes in chunks over several steps, each continuing
    /// where the last ended, while the others decode beside it, and every prompt gives what it
    /// gives all at once (no token before its last chunk, none missing). A chunk of 0 is refused.
    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_while_the_others_decode() {
        let window = 40;
        let prompts: Vec<Vec<u32>> = [7, 2, 10, 3].iter().map(|&n| vec![1; n]).collect();
        let mut reach = 0;
        let all = greedy(step(&mut reach), &prompts, 1, 4, EOS, window).unwrap();
        let limits = GreedyLimits { max_running: 3, prefill_chunk: 3, ..GreedyLimits::all_at_once(1, 4, EOS, window) };
        let mut steps: Vec<Vec<(u64, u32, u32)>> = Vec::new();
        let mut inner = step(&mut reach);
        let recording = |a: Activation| {
            steps.push(a.segments.iter().map(|g| (g.seq, g.pos, g.len)).collect());
            inner(a)
        };
        let got = greedy_running(recording, &prompts, limits, |_, _| {}, |_, _| {}).unwrap();
        assert_eq!(got, all);
        // Each sequence's segments, in order: consecutive, none over the chunk.
        for (i, p) in prompts.iter().enumerate() {
            let mine: Vec<(u32, u32)> =
                steps.iter().flatten().filter(|g| g.0 == 1 + i as u64).map(|g| (g.1, g.2)).collect();
            assert!(mine.iter().all(|&(_, len)| len <= 3), "prompt {i}: {mine:?}");
            assert!(mine.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "prompt {i}: {mine:?}");
            let prefill: u32 = mine.iter().take_while(|&&(pos, _)| (pos as usize) < p.len()).map(|g| g.1).sum();
            assert_eq!(prefill as usize, p.len(), "prompt {i}: {mine:?}");
        }
        // Prompt 2 (10 tokens: chunks of 3, 3, 3 and 1) overlaps the decode steps of the others.
        let chunked: Vec<usize> =
            steps.iter().enumerate().filter(|(_, s)| s.iter().any(|g| g.0 == 3 && g.1 < 10)).map(|(k, _)| k).collect();
        assert_eq!(chunked.len(), 4, "{steps:?}");
        assert!(
            chunked.iter().any(|&k| steps[k].iter().any(|g| g.0 != 3 && g.2 == 1)),
            "nothing decoded beside its chunks: {steps:?}"
        );
        let limits = GreedyLimits { prefill_chunk: 0, ..limits };
        let mut reach = 0;
        assert!(greedy_running(step(&mut reach), &prompts, limits, |_, _| {}, |_, _| {}).is_err());
    }

    #[test]
    fn a_prompt_longer_than_the_window_is_refused_before_anything_runs() {
        let mut reach = 0;
        let e = greedy(step(&mut reach), &[vec![1; 3], vec![1; 11]], 1, 4, EOS, 10).unwrap_err();
        assert_eq!(e.to_string(), "input: prompt 1: 11 tokens; the model's context window is 10");
        assert_eq!(reach, 0, "nothing ran");
    }
}
