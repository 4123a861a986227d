//! Serving many LoRA adapters of one real model on the CPU with dLoRA's batcher
//! (`cascade_sched::lora::Batcher`): continuous batching, each iteration's batch and mode chosen
//! by the batcher, the model merged with an adapter or un-merged as it says, unmerged batches
//! mixing adapters. What `cascade lora-serve` runs.
//!
//! Requests arrive at given iterations (a stream), each with an adapter, a prompt and a number of
//! tokens to generate (greedy, not stopped at end-of-sequence, so runs compare token for token;
//! ended early only where prompt and tokens fill the model's context window).
//! [`serve`] returns every request's tokens and the top-2 logit margin at each step, so that a
//! comparison with the same request served alone ([`serve_alone`]) can tell a real difference
//! from a near-tie broken differently by merged (`(W + BA)·x`) and unmerged (`W·x + B·A·x`)
//! arithmetic.

use cascade_sched::lora::batcher::adapters_of;
use cascade_sched::lora::{Batcher, Mode, Runnable};
use cascade_transport::metrics::{Counter, FloatGauge, Histogram};
use cascade_transport::Metrics;

use super::generate::top2;
use super::Llama;
use crate::{Activation, ExecError, LayerExec};

/// A request of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraJob {
    /// The iteration it arrives at (0 first).
    pub arrival: u64,
    /// Its adapter, numbered from 0 (the model's adapter `adapter + 1`; 0 there is the base).
    pub adapter: u32,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Tokens to generate (fewer if they fill the model's context window first; a prompt longer
    /// than the window is refused).
    pub max_tokens: usize,
}

/// One request's result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoraServed {
    /// Greedy tokens.
    pub tokens: Vec<u32>,
    /// Top-1 minus top-2 logit at each step.
    pub margins: Vec<f32>,
    /// The iteration it finished in.
    pub finished: u64,
}

/// What one serving run did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoraRunStats {
    /// Iterations.
    pub iterations: u64,
    /// Iterations run merged.
    pub merged_iterations: u64,
    /// Iterations that began with a merge or un-merge.
    pub mode_switches: u64,
    /// Iterations decided by starvation prevention.
    pub starvation_batches: u64,
    /// Largest batch.
    pub max_batch: usize,
    /// Largest number of distinct adapters in an unmerged batch.
    pub max_adapters_in_batch: usize,
    /// Wall time, s.
    pub seconds: f64,
    /// Time merging and un-merging, s.
    pub switch_seconds: f64,
}

/// A serving run's series in a metrics registry, resolved once: iterations by mode, mode
/// switches and their time, the requests waiting and finished, and the batcher's thresholds α
/// and β.
pub struct LoraMeters {
    merged: Counter,
    finished: Counter,
    unmerged: Counter,
    switches: Counter,
    switch_seconds: Histogram,
    queue: FloatGauge,
    alpha: FloatGauge,
    beta: FloatGauge,
}

impl LoraMeters {
    /// The series in `m` (registered on first use).
    pub fn new(m: &Metrics) -> LoraMeters {
        let iterations =
            |mode: &str| m.counter("cascade_lora_iterations", "Serving iterations, by mode", &[("mode", mode)]);
        let threshold = |which: &str| {
            m.gauge(
                "cascade_lora_threshold",
                "dLoRA's adaptive merge (alpha) and unmerge (beta) thresholds",
                &[("which", which)],
            )
        };
        LoraMeters {
            merged: iterations("merged"),
            unmerged: iterations("unmerged"),
            switches: m.counter("cascade_lora_mode_switches", "Iterations that began with a merge or un-merge", &[]),
            switch_seconds: m.histogram("cascade_lora_switch_seconds", "Time merging or un-merging an adapter", &[]),
            queue: m.gauge("cascade_lora_queued_requests", "Requests live in the serving queue", &[]),
            finished: m.counter("cascade_lora_finished_requests", "Requests served to their last token", &[]),
            alpha: threshold("alpha"),
            beta: threshold("beta"),
        }
    }

    /// Requests served to their last token so far (to show a long run's progress).
    pub fn finished(&self) -> u64 {
        self.finished.get()
    }
}

fn set_mode(model: &mut Llama, mode: Mode) -> Result<(), ExecError> {
    let want = match mode {
        Mode::Merged(a) => Some(a + 1),
        Mode::Unmerged => None,
    };
    if model.merged() != want {
        model.unmerge()?;
        if let Some(id) = want {
            model.merge(id)?;
        }
    }
    Ok(())
}

/// Serves `jobs` (sorted by arrival) on `model`, whose adapters `1..` are the jobs' `0..`, with
/// `batcher` deciding every iteration. Sequence ids `seq_base + i` are used for the KV cache and
/// freed at the end. The model is left un-merged. With `meters`, every iteration is recorded in
/// them as it happens. A stream it could not finish (no prompt, no token to generate, a prompt
/// over the context window or outside the vocabulary, an adapter not served, arrivals out of
/// order) is refused whole, naming the request, before anything runs.
pub fn serve(
    model: &mut Llama,
    batcher: &mut Batcher,
    jobs: &[LoraJob],
    seq_base: u64,
    meters: Option<&LoraMeters>,
) -> Result<(Vec<LoraServed>, LoraRunStats), ExecError> {
    check_jobs(model, jobs)?;
    let t0 = std::time::Instant::now();
    let window = model.config().max_position_embeddings;
    let mut out: Vec<LoraServed> =
        jobs.iter().map(|_| LoraServed { tokens: Vec::new(), margins: Vec::new(), finished: 0 }).collect();
    let mut stats = LoraRunStats::default();
    // Live requests in FCFS order: (job index, next position, tokens to feed).
    let mut live: Vec<(usize, u32, Vec<u32>)> = Vec::new();
    let mut next = 0;
    let mut it = 0u64;
    let result: Result<(), ExecError> = (|| {
        while next < jobs.len() || !live.is_empty() {
            while next < jobs.len() && jobs[next].arrival <= it {
                live.push((next, 0, jobs[next].prompt.clone()));
                next += 1;
            }
            if live.is_empty() {
                // Nothing runs until the next arrival: go to it. (Stepping one iteration at a
                // time spun for as long as the stream's gap: `lora-serve --per-iteration 1e-300`
                // never ended.)
                if let Some(j) = jobs.get(next) {
                    it = it.max(j.arrival);
                }
                continue;
            }
            let runnable: Vec<Runnable> = live
                .iter()
                .map(|(j, pos, feed)| Runnable {
                    adapter: jobs[*j].adapter,
                    prompt_tokens: if *pos == 0 { feed.len() as u64 } else { 0 },
                })
                .collect();
            let choice = batcher.decide(&runnable);
            let ts = std::time::Instant::now();
            set_mode(model, choice.mode)?;
            let switch_seconds = ts.elapsed().as_secs_f64();
            if choice.switch_ops > 0 {
                stats.mode_switches += 1;
                stats.switch_seconds += switch_seconds;
            }
            if let Some(m) = meters {
                if choice.switch_ops > 0 {
                    m.switches.inc();
                    m.switch_seconds.observe(switch_seconds);
                }
                match choice.mode {
                    Mode::Merged(_) => m.merged.inc(),
                    Mode::Unmerged => m.unmerged.inc(),
                };
                m.queue.set(live.len() as f64);
                let (alpha, beta) = batcher.thresholds();
                m.alpha.set(alpha);
                m.beta.set(beta);
            }
            if matches!(choice.mode, Mode::Merged(_)) {
                stats.merged_iterations += 1;
            } else {
                let distinct = adapters_of(&runnable, &choice.batch).len();
                stats.max_adapters_in_batch = stats.max_adapters_in_batch.max(distinct);
            }
            stats.starvation_batches += choice.starvation as u64;
            stats.max_batch = stats.max_batch.max(choice.batch.len());
            let seqs: Vec<(u64, u32, Vec<u32>)> =
                choice.batch.iter().map(|&k| (seq_base + live[k].0 as u64, live[k].1, live[k].2.clone())).collect();
            let adapters: Vec<u32> = choice.batch.iter().map(|&k| jobs[live[k].0].adapter + 1).collect();
            let act = Activation::packed(&seqs)?.with_adapters(&adapters)?;
            // The batcher owns the process's compute: each iteration on rayon's threads.
            let logits = crate::threads::on_compute_threads(|| model.run(0..model.layers(), act))?
                .hidden
                .ok_or_else(|| ExecError::Input("no logits".into()))?;
            let rows = logits.squeeze(0)?.to_vec2::<f32>()?;
            for (&k, row) in choice.batch.iter().zip(&rows) {
                let (tok, margin) = top2(row);
                let (j, pos, feed) = &mut live[k];
                out[*j].tokens.push(tok);
                out[*j].margins.push(margin);
                *pos += feed.len() as u32;
                *feed = vec![tok];
            }
            let mut still = Vec::with_capacity(live.len());
            for l in live.drain(..) {
                // `l.1` is where its last token would be fed: a full window ends it, as its budget does.
                if out[l.0].tokens.len() >= jobs[l.0].max_tokens || l.1 as usize >= window {
                    out[l.0].finished = it;
                    model.free(seq_base + l.0 as u64);
                    if let Some(m) = meters {
                        m.finished.inc();
                    }
                } else {
                    still.push(l);
                }
            }
            live = still;
            it = it.saturating_add(1);
            stats.iterations += 1;
        }
        Ok(())
    })();
    for (j, _, _) in &live {
        model.free(seq_base + *j as u64);
    }
    let restored = model.unmerge();
    result?;
    restored?;
    stats.seconds = t0.elapsed().as_secs_f64();
    Ok((out, stats))
}

/// Refuses, before anything runs, a stream [`serve`] could not finish: a request with no prompt
/// or no token to generate, a prompt longer than the context window or with a token outside the
/// vocabulary, an adapter the model does not serve, arrivals out of order. (Checked as each
/// request arrived, these failed the run in its middle, every answer computed so far lost.)
fn check_jobs(model: &Llama, jobs: &[LoraJob]) -> Result<(), ExecError> {
    let (window, vocab) = (model.config().max_position_embeddings, model.config().vocab_size);
    let mut last = 0;
    for (i, j) in jobs.iter().enumerate() {
        let bad = |why: String| -> Result<(), ExecError> { Err(ExecError::Input(format!("request {i}: {why}"))) };
        if j.max_tokens == 0 {
            return bad("no token to generate (max_tokens 0)".into());
        }
        if let Some(why) = super::generate::refusal(&j.prompt, window) {
            return bad(why);
        }
        if let Some(t) = j.prompt.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("token {t} is outside the vocabulary of {vocab}"));
        }
        if j.adapter.checked_add(1).and_then(|id| model.adapter(id)).is_none() {
            let served: Vec<u32> = model.adapter_ids().iter().filter_map(|id| id.checked_sub(1)).collect();
            return bad(format!("adapter {} is not served (the model serves adapters {served:?})", j.adapter));
        }
        if j.arrival < last {
            return bad(format!("arrives at iteration {} after a request arriving at {last}", j.arrival));
        }
        last = j.arrival;
    }
    Ok(())
}

/// `job` served alone, unmerged, from its first iteration: the reference a batched response is
/// compared with.
pub fn serve_alone(model: &mut Llama, job: &LoraJob, seq: u64) -> Result<LoraServed, ExecError> {
    let mut b = Batcher::new(
        cascade_sched::lora::Policy::UnmergedOnly,
        cascade_sched::lora::BatchConfig::default(),
        cascade_sched::lora::CostModel::cpu_smollm2(),
    );
    let alone = LoraJob { arrival: 0, ..job.clone() };
    let (mut out, _) = serve(model, &mut b, std::slice::from_ref(&alone), seq, None)?;
    Ok(out.remove(0))
}

/// Where a batched response first differs from the same request served alone, if it does:
/// `(step, smaller of the two runs' top-2 margins at that step)`.
pub fn first_difference(batched: &LoraServed, alone: &LoraServed) -> Option<(usize, f32)> {
    let step = batched.tokens.iter().zip(&alone.tokens).position(|(a, b)| a != b)?;
    Some((step, batched.margins[step].min(alone.margins[step])))
}
