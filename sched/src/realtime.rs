//! The real-time engine: Symphony's scheduler on real threads against the wall clock (§4.5),
//! and any other scheduler as a dispatcher thread on the wall clock ([`run_any`], and one per
//! serving group with [`run_parts`]).
//!
//! * **ModelThreads** — `shards` threads, each owning a group of models' [`ModelState`]s (the
//!   same code the simulator runs): they take requests from the load generator, keep the
//!   candidates up to date, and on a grant send the batch to its GPU;
//! * **RankThread** — owns the [`Rank`] (the same code again): GPU availability and every
//!   candidate's timer; it grants GPUs when timers are due;
//! * **GPU workers** — emulated: one thread holds every GPU's running batch and completes it
//!   when ℓ(b) of wall-clock time has passed;
//! * an in-process **load generator** offers requests open-loop at a target rate.
//!
//! Every request ends executed (by a GPU) or dropped, and its sender — the generator — is told
//! which, by request id; `lost` counts requests it heard nothing (or twice) about (must be 0). Departure from the paper: a ModelThread tells the RankThread
//! about its candidates once per batch of messages it processed rather than once per request,
//! so the RankThread's load scales with batches, as §4.5 intends.

use std::collections::{BTreeSet, BinaryHeap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::profile::Profile;
use crate::scheduler::{GpuId, ModelId, Ms, Request};
use crate::symphony::model::{Candidate, ModelState};
use crate::symphony::rank::{Grant, Rank};
use crate::time::{At, Delay};

mod dispatch;

pub use dispatch::{run_any, run_parts, MakeScheduler};

/// Settings of a real-time run.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The models.
    pub profiles: Vec<Profile>,
    /// Emulated GPUs.
    pub gpus: usize,
    /// ModelThreads (models are dealt round-robin to them).
    pub shards: usize,
    /// Offered load, requests/s over all models (equal shares).
    pub rate_rps: f64,
    /// How long the generator offers load.
    pub duration: Duration,
    /// Dispatch delay model.
    pub delay: Delay,
}

/// What a real-time run did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EngineReport {
    /// Requests offered.
    pub requests: u64,
    /// Wall seconds from the first request until the last was resolved.
    pub seconds: f64,
    /// Requests executed on a GPU per second.
    pub requests_per_s: f64,
    /// Executed.
    pub executed: u64,
    /// Executed within their deadline.
    pub within_slo: u64,
    /// Reported dropped to the sender.
    pub dropped: u64,
    /// Neither (must be 0).
    pub lost: u64,
    /// Batches run.
    pub batches: u64,
    /// Grants the RankThread made.
    pub grants: u64,
}

/// Counters of the engine's own work (statistics, not request outcomes).
#[derive(Default)]
struct Results {
    batches: AtomicU64,
    grants: AtomicU64,
}

/// What the sender (the load generator) is told about its requests.
enum Outcome {
    /// A batch ran: its request ids, and how many finished within their deadline.
    Executed(Vec<u64>, u64),
    /// These requests were dropped.
    Dropped(Vec<u64>),
}

fn report_dropped(to: &Sender<Outcome>, reqs: &mut Vec<Request>) {
    if !reqs.is_empty() {
        let _ = to.send(Outcome::Dropped(reqs.drain(..).map(|r| r.id).collect()));
    }
}

enum ToShard {
    Requests(Vec<Request>),
    Grants(Vec<Grant>),
}

enum ToRank {
    Candidate(ModelId, Option<Candidate>),
    Gpu(GpuId, Ms),
}

struct Exec {
    end: Ms,
    requests: Vec<Request>,
}

fn ms_since(epoch: Instant) -> Ms {
    epoch.elapsed().as_secs_f64() * 1000.0
}

fn wait_for(next: Option<Ms>, now: Ms) -> Duration {
    match next {
        Some(t) => Duration::from_secs_f64(((t - now) / 1000.0).clamp(0.0, 0.010)),
        None => Duration::from_millis(10),
    }
}

/// A ModelThread: its models, their drop timers, the candidates it last told the rank.
/// Where a ModelThread sends things.
struct ShardLinks {
    rank: Sender<Vec<ToRank>>,
    gpus: Sender<Vec<Exec>>,
    outcomes: Sender<Outcome>,
    results: Arc<Results>,
    closing: Arc<AtomicBool>,
}

fn model_thread(models: Vec<ModelState>, inbox: Receiver<ToShard>, links: ShardLinks, epoch: Instant) {
    let ShardLinks { rank, gpus, outcomes, results, closing } = links;
    let base: Vec<ModelId> = models.iter().map(|m| m.id).collect();
    let mut models = models;
    let index = |id: ModelId| base.iter().position(|b| *b == id);
    let mut drops: BTreeSet<(At, usize)> = BTreeSet::new();
    let mut drop_at: Vec<Option<Ms>> = vec![None; models.len()];
    let mut dirty = vec![false; models.len()];
    let mut dropped = Vec::new();
    let mut to_rank = Vec::new();
    let mut to_gpus = Vec::new();
    loop {
        // Closing is read before the inbox is drained: every request sent before the flag was
        // set is in the inbox by then.
        let closing_now = closing.load(Ordering::Acquire);
        let now = ms_since(epoch);
        let msg = match inbox.recv_timeout(wait_for(drops.first().map(|d| d.0 .0), now)) {
            Ok(m) => Some(m),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => None,
        };
        let now = ms_since(epoch);
        let mut msgs: Vec<ToShard> = msg.into_iter().collect();
        msgs.extend(inbox.try_iter());
        for m in msgs {
            match m {
                ToShard::Requests(rs) => {
                    for r in rs {
                        if let Some(i) = index(r.model) {
                            models[i].enqueue(r);
                            dirty[i] = true;
                        }
                    }
                }
                ToShard::Grants(gs) => {
                    for g in gs {
                        let Some(i) = index(g.model) else { continue };
                        let ms = &mut models[i];
                        ms.update(now, g.free_at, &mut dropped);
                        let free_at = match ms.candidate() {
                            None => now.max(g.free_at),
                            Some(c) => {
                                let requests = ms.take_batch();
                                let end = c.exec_at + ms.profile.latency(requests.len());
                                results.batches.fetch_add(1, Ordering::Relaxed);
                                to_gpus.push(Exec { end, requests });
                                end
                            }
                        };
                        to_rank.push(ToRank::Gpu(g.gpu, free_at));
                        dirty[i] = true;
                    }
                }
            }
        }
        while let Some(&(t, i)) = drops.first() {
            if t.0 > now {
                break;
            }
            drops.remove(&(t, i));
            drop_at[i] = None;
            dirty[i] = true;
        }
        for i in 0..models.len() {
            if !std::mem::take(&mut dirty[i]) {
                continue;
            }
            models[i].update(now, f64::NEG_INFINITY, &mut dropped);
            if let Some(t) = drop_at[i].take() {
                drops.remove(&(At(t), i));
            }
            if let Some(t) = models[i].front_deadline() {
                drop_at[i] = Some(t);
                drops.insert((At(t), i));
            }
            to_rank.push(ToRank::Candidate(models[i].id, models[i].candidate()));
        }
        report_dropped(&outcomes, &mut dropped);
        if !to_gpus.is_empty() {
            let _ = gpus.send(std::mem::take(&mut to_gpus));
        }
        if !to_rank.is_empty() {
            let _ = rank.send(std::mem::take(&mut to_rank));
        }
        if closing_now {
            // Shutting down: whatever is still queued is reported dropped to its sender.
            for m in inbox.try_iter() {
                if let ToShard::Requests(rs) = m {
                    dropped.extend(rs);
                }
            }
            for m in models.iter_mut() {
                m.update(f64::INFINITY, f64::NEG_INFINITY, &mut dropped);
            }
            report_dropped(&outcomes, &mut dropped);
            return;
        }
    }
}

/// The RankThread.
fn rank_thread(
    mut rank: Rank,
    inbox: Receiver<Vec<ToRank>>,
    shards: Vec<Sender<ToShard>>,
    shard_of: Vec<usize>,
    results: Arc<Results>,
    epoch: Instant,
) {
    loop {
        let now = ms_since(epoch);
        match inbox.recv_timeout(wait_for(rank.next_timer(), now)) {
            Ok(batch) => {
                for m in batch.into_iter().chain(inbox.try_iter().flatten()) {
                    match m {
                        ToRank::Candidate(model, c) => rank.inform_candidate(model, c),
                        ToRank::Gpu(g, t) => rank.inform_gpu(g, t),
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = ms_since(epoch);
        let mut grants: Vec<Vec<Grant>> = vec![Vec::new(); shards.len()];
        while let Some(g) = rank.on_timer(now) {
            results.grants.fetch_add(1, Ordering::Relaxed);
            grants[shard_of[g.model]].push(g);
        }
        for (s, gs) in grants.into_iter().enumerate() {
            if !gs.is_empty() {
                let _ = shards[s].send(ToShard::Grants(gs));
            }
        }
    }
}

/// The emulated GPUs: each batch completes when its end time has passed on the wall clock.
fn gpu_thread(inbox: Receiver<Vec<Exec>>, outcomes: Sender<Outcome>, epoch: Instant) {
    let mut running: BinaryHeap<std::cmp::Reverse<(At, u64)>> = BinaryHeap::new();
    let mut batches: std::collections::HashMap<u64, Vec<Request>> = Default::default();
    let mut seq = 0u64;
    let mut open = true;
    while open || !running.is_empty() {
        let now = ms_since(epoch);
        let next = running.peek().map(|r| r.0 .0 .0);
        match inbox.recv_timeout(wait_for(next, now)) {
            Ok(e) => {
                for e in e.into_iter().chain(inbox.try_iter().flatten()) {
                    seq += 1;
                    running.push(std::cmp::Reverse((At(e.end), seq)));
                    batches.insert(seq, e.requests);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => open = false,
        }
        let now = ms_since(epoch);
        while let Some(std::cmp::Reverse((end, s))) = running.peek().copied() {
            if end.0 > now && open {
                break;
            }
            running.pop();
            if let Some(reqs) = batches.remove(&s) {
                let good = reqs.iter().filter(|r| end.0 <= r.deadline + 1e-6).count() as u64;
                let _ = outcomes.send(Outcome::Executed(reqs.iter().map(|r| r.id).collect(), good));
            }
        }
    }
}

/// The generator's tally of outcomes; a request reported twice would be a bug (counted as lost).
#[derive(Default)]
struct Heard {
    executed: u64,
    within_slo: u64,
    dropped: u64,
    twice: u64,
    seen: Vec<u64>,
}

impl Heard {
    fn mark(&mut self, id: u64) {
        let (word, bit) = ((id / 64) as usize, id % 64);
        if self.seen.len() <= word {
            self.seen.resize(word + 1, 0);
        }
        if self.seen[word] & (1 << bit) != 0 {
            self.twice += 1;
        }
        self.seen[word] |= 1 << bit;
    }

    fn take(&mut self, rx: &Receiver<Outcome>) {
        for o in rx.try_iter() {
            self.hear(o);
        }
    }

    fn hear(&mut self, o: Outcome) {
        match o {
            Outcome::Executed(ids, good) => {
                self.executed += ids.len() as u64;
                self.within_slo += good;
                ids.into_iter().for_each(|id| self.mark(id));
            }
            Outcome::Dropped(ids) => {
                self.dropped += ids.len() as u64;
                ids.into_iter().for_each(|id| self.mark(id));
            }
        }
    }

    /// The report of a run that offered `sent` requests.
    fn report(&self, sent: u64, seconds: f64, batches: u64, grants: u64) -> EngineReport {
        EngineReport {
            requests: sent,
            seconds,
            requests_per_s: self.executed as f64 / seconds,
            executed: self.executed,
            within_slo: self.within_slo,
            dropped: self.dropped,
            lost: sent.saturating_sub(self.executed + self.dropped) + self.twice,
            batches,
            grants,
        }
    }
}

/// The load generator: open loop, every 0.5 ms the requests due since the last tick (`rate_rps`
/// in all, the models in turn: equal shares), handed to `emit` (possibly none); stops after
/// `duration` or when `emit` says so. The number of requests made.
fn generate(
    profiles: &[Profile],
    rate_rps: f64,
    duration: Duration,
    epoch: Instant,
    mut emit: impl FnMut(Vec<Request>) -> bool,
) -> u64 {
    let n = profiles.len();
    let mut sent = 0u64;
    let per_ms = rate_rps / 1000.0;
    let end = duration.as_secs_f64() * 1000.0;
    let mut next_model = 0usize;
    loop {
        let now = ms_since(epoch);
        if now >= end {
            return sent;
        }
        let due = ((now * per_ms) as u64).saturating_sub(sent);
        let mut batch = Vec::with_capacity(due as usize);
        for _ in 0..due {
            let m = next_model;
            next_model = (next_model + 1) % n.max(1);
            batch.push(Request { id: sent, model: m, arrival: now, deadline: now + profiles[m].slo_ms });
            sent += 1;
        }
        if !emit(batch) {
            return sent;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Runs the engine for `cfg.duration` of offered load and until every request is resolved.
pub fn run(cfg: &EngineConfig) -> EngineReport {
    let epoch = Instant::now();
    let results = Arc::new(Results::default());
    let n = cfg.profiles.len();
    let shards = cfg.shards.clamp(1, n.max(1));
    let shard_of: Vec<usize> = (0..n).map(|m| m % shards).collect();
    let (rank_tx, rank_rx) = mpsc::channel::<Vec<ToRank>>();
    let (gpu_tx, gpu_rx) = mpsc::channel::<Vec<Exec>>();
    let (out_tx, out_rx) = mpsc::channel::<Outcome>();
    let mut shard_txs = Vec::new();
    let mut handles = Vec::new();
    let closing = Arc::new(AtomicBool::new(false));
    for s in 0..shards {
        let (tx, rx) = mpsc::channel::<ToShard>();
        shard_txs.push(tx);
        let models: Vec<ModelState> = (0..n)
            .filter(|m| shard_of[*m] == s)
            .map(|m| ModelState::new(m, cfg.profiles[m].clone(), cfg.delay, false))
            .collect();
        let links = ShardLinks {
            rank: rank_tx.clone(),
            gpus: gpu_tx.clone(),
            outcomes: out_tx.clone(),
            results: results.clone(),
            closing: closing.clone(),
        };
        handles.push(std::thread::spawn(move || model_thread(models, rx, links, epoch)));
    }
    drop(rank_tx);
    drop(gpu_tx);
    let rank = Rank::new(cfg.gpus, cfg.delay, 0.0);
    let rank_handle = {
        let (txs, so, res) = (shard_txs.clone(), shard_of.clone(), results.clone());
        std::thread::spawn(move || rank_thread(rank, rank_rx, txs, so, res, epoch))
    };
    let gpu_handle = {
        let otx = out_tx.clone();
        std::thread::spawn(move || gpu_thread(gpu_rx, otx, epoch))
    };
    drop(out_tx);
    // What the sender hears back: each request once, executed or dropped.
    let mut heard = Heard::default();
    // The load generator, each tick's requests sent to each shard in one message.
    let mut buffers: Vec<Vec<Request>> = vec![Vec::new(); shards];
    let sent = generate(&cfg.profiles, cfg.rate_rps, cfg.duration, epoch, |due| {
        for r in due {
            buffers[shard_of[r.model]].push(r);
        }
        for (s, b) in buffers.iter_mut().enumerate() {
            if !b.is_empty() {
                let _ = shard_txs[s].send(ToShard::Requests(std::mem::take(b)));
            }
        }
        heard.take(&out_rx);
        true
    });
    // Shut down: shards drain (dropping what is left), then the rank and the GPUs finish.
    closing.store(true, Ordering::Release);
    drop(shard_txs);
    for h in handles {
        let _ = h.join();
    }
    let _ = rank_handle.join();
    let _ = gpu_handle.join();
    heard.take(&out_rx);
    heard.report(
        sent,
        epoch.elapsed().as_secs_f64(),
        results.batches.load(Ordering::Relaxed),
        results.grants.load(Ordering::Relaxed),
    )
}

/// Symphony's sub-clusters on real threads (§4.7): each part — its models and its GPUs — is a
/// whole engine of its own (ModelThreads, its own RankThread as the part's dispatcher, its GPU
/// worker and its share of the load generator: the models' equal shares of `cfg.rate_rps`),
/// all running at once; the report sums them (`seconds` is the longest part's). `parts` come
/// from an epoch plan ([`crate::partition::symphony_split`]): every model in exactly one part,
/// at most `cfg.gpus` GPUs in all.
pub fn run_sub_clusters(cfg: &EngineConfig, parts: &[(Vec<ModelId>, usize)]) -> Result<EngineReport, String> {
    each_part(cfg, parts, |sub, _| Ok(run(sub)))
}

/// Checks `parts` ([`check_parts`]), runs `run_part(its config, its models' global ids)` for
/// every part with models, each on its own thread and all at once, and sums the reports; a part
/// that fails or panics fails the whole run.
fn each_part(
    cfg: &EngineConfig,
    parts: &[(Vec<ModelId>, usize)],
    run_part: impl Fn(&EngineConfig, &[ModelId]) -> Result<EngineReport, String> + Sync,
) -> Result<EngineReport, String> {
    check_parts(cfg, parts)?;
    let run_part = &run_part;
    let reports: Vec<Result<EngineReport, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .iter()
            .filter(|(m, _)| !m.is_empty())
            .map(|(models, g)| {
                let sub = sub_config(cfg, models, *g);
                s.spawn(move || run_part(&sub, models))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a part's thread panicked".into()))).collect()
    });
    Ok(sum_reports(&reports.into_iter().collect::<Result<Vec<_>, _>>()?))
}

/// Every model in exactly one part, at most `cfg.gpus` GPUs in all, a GPU for every part with
/// models.
fn check_parts(cfg: &EngineConfig, parts: &[(Vec<ModelId>, usize)]) -> Result<(), String> {
    let n = cfg.profiles.len();
    let mut seen = vec![false; n];
    for (models, _) in parts {
        for &m in models {
            match seen.get_mut(m) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(format!("model {m} is in two parts")),
                None => return Err(format!("no model {m} ({n} models)")),
            }
        }
    }
    if let Some(m) = seen.iter().position(|s| !s) {
        return Err(format!("model {m} is in no part"));
    }
    let gpus: usize = parts.iter().map(|p| p.1).sum();
    if gpus > cfg.gpus {
        return Err(format!("the parts hold {gpus} GPUs of {}", cfg.gpus));
    }
    if let Some((models, _)) = parts.iter().find(|(m, g)| !m.is_empty() && *g == 0) {
        return Err(format!("a part of {} models has no GPU", models.len()));
    }
    Ok(())
}

/// A part's engine: its models, its GPUs, its models' equal shares of the offered load.
fn sub_config(cfg: &EngineConfig, models: &[ModelId], gpus: usize) -> EngineConfig {
    EngineConfig {
        profiles: models.iter().map(|&m| cfg.profiles[m].clone()).collect(),
        gpus,
        shards: cfg.shards,
        rate_rps: cfg.rate_rps * models.len() as f64 / cfg.profiles.len().max(1) as f64,
        duration: cfg.duration,
        delay: cfg.delay,
    }
}

/// The parts' reports summed; `seconds` is the longest part's.
fn sum_reports(reports: &[EngineReport]) -> EngineReport {
    let mut out = EngineReport::default();
    for r in reports {
        out.requests += r.requests;
        out.seconds = out.seconds.max(r.seconds);
        out.executed += r.executed;
        out.within_slo += r.within_slo;
        out.dropped += r.dropped;
        out.lost += r.lost;
        out.batches += r.batches;
        out.grants += r.grants;
    }
    out.requests_per_s = if out.seconds > 0.0 { out.executed as f64 / out.seconds } else { 0.0 };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Six equal models on 12 GPUs, one shard, 300 ms of load at `rate_rps`.
    fn six_models_on_12_gpus(rate_rps: f64) -> EngineConfig {
        EngineConfig {
            profiles: (0..6).map(|i| Profile::new(&format!("m{i}"), 0.1, 2.0, 30.0, 64).unwrap()).collect(),
            gpus: 12,
            shards: 1,
            rate_rps,
            duration: Duration::from_millis(300),
            delay: Delay::default(),
        }
    }

    #[test]
    fn sub_clusters_each_run_their_own_engine_and_resolve_every_request() {
        let cfg = six_models_on_12_gpus(30_000.0);
        let r = run_sub_clusters(&cfg, &[(vec![0, 2, 4], 6), (vec![1, 3, 5], 6)]).unwrap();
        assert_eq!(r.lost, 0, "{r:?}");
        assert!(r.requests > 5_000, "{r:?}");
        assert!(r.executed as f64 > 0.9 * r.requests as f64, "{r:?}");
        assert!(run_sub_clusters(&cfg, &[(vec![0, 1, 2], 6), (vec![2, 3, 4, 5], 6)]).is_err(), "model 2 twice");
        assert!(run_sub_clusters(&cfg, &[(vec![0, 1, 2], 6), (vec![3, 4], 6)]).is_err(), "model 5 nowhere");
        assert!(run_sub_clusters(&cfg, &[(vec![0, 1, 2], 8), (vec![3, 4, 5], 8)]).is_err(), "16 GPUs of 12");
    }

    fn flex(ps: &[Profile], g: usize, _: &[ModelId]) -> Result<Box<dyn crate::scheduler::Scheduler>, String> {
        Ok(Box::new(crate::flex::Flex::new(ps, g, Delay::default(), true)))
    }

    #[test]
    fn flex_runs_on_the_wall_clock_and_resolves_every_request() {
        let cfg = six_models_on_12_gpus(20_000.0);
        let r = run_any(&cfg, &flex).unwrap();
        assert_eq!(r.lost, 0, "{r:?}");
        assert!(r.requests > 3_000, "{r:?}");
        assert!(r.executed as f64 > 0.9 * r.requests as f64, "a light load is executed: {r:?}");
        assert!(r.within_slo as f64 > 0.9 * r.executed as f64, "{r:?}");
        assert!(r.batches > 0 && r.executed / r.batches > 2, "requests are batched: {r:?}");
        // HERD's groups, one FLEX dispatcher thread each.
        let rates = vec![cfg.rate_rps / 6.0; 6];
        let (assign, gpus) = crate::partition::herd_split(&cfg.profiles, &rates, cfg.gpus, 3, 6).unwrap();
        let parts = crate::partition::parts(&assign, &gpus);
        assert!(parts.iter().filter(|p| !p.0.is_empty()).count() > 1, "{parts:?}");
        let r = run_parts(&cfg, &parts, &flex).unwrap();
        assert_eq!(r.lost, 0, "{r:?}");
        assert!(r.executed as f64 > 0.9 * r.requests as f64, "{r:?}");
        assert!(run_parts(&cfg, &[(vec![0, 1, 2], 6), (vec![3, 4], 6)], &flex).is_err(), "model 5 nowhere");
        let refuse = |_: &[Profile], _: usize, _: &[ModelId]| -> Result<Box<dyn crate::scheduler::Scheduler>, String> {
            Err("no".into())
        };
        assert_eq!(run_any(&cfg, &refuse).unwrap_err(), "no");
    }

    /// A test double that, like FLEX, predicts when its GPUs free up (start + ℓ(b)) and
    /// dispatches on that prediction; it counts the batches it was not yet told had ended. It is
    /// slow to take in a free GPU, so the clock moves on between the dispatcher's events.
    struct Predicting {
        p: Profile,
        free_at: Vec<f64>,
        untold: Vec<u32>,
        inconsistent: std::sync::Arc<AtomicU64>,
    }

    impl crate::scheduler::Scheduler for Predicting {
        fn name(&self) -> &'static str {
            "predicting"
        }
        fn on_arrival(&mut self, now: f64, req: Request, out: &mut Vec<crate::scheduler::Decision>) {
            match (0..self.free_at.len()).find(|&g| self.free_at[g] <= now) {
                Some(g) => {
                    if self.untold[g] > 0 {
                        self.inconsistent.fetch_add(1, Ordering::Relaxed);
                    }
                    self.untold[g] += 1;
                    self.free_at[g] = now + self.p.latency(1);
                    out.push(crate::scheduler::Decision::Dispatch {
                        gpu: g,
                        model: 0,
                        requests: vec![req],
                        start: now,
                    });
                }
                None => out.push(crate::scheduler::Decision::Drop(req)),
            }
        }
        fn on_gpu_free(&mut self, _: f64, gpu: GpuId, _: &mut Vec<crate::scheduler::Decision>) {
            self.untold[gpu] -= 1;
            // Slow to take a free GPU in: the clock moves on while the dispatcher works.
            std::thread::sleep(Duration::from_micros(300));
        }
        fn on_timer(&mut self, _: f64, _: &mut Vec<crate::scheduler::Decision>) {}
        fn next_timer(&self) -> Option<f64> {
            None
        }
        fn queued(&self) -> usize {
            0
        }
    }

    #[test]
    fn a_scheduler_hears_of_every_batch_that_ended_before_anything_later() {
        let p = Profile::new("m", 0.05, 0.05, 30.0, 8).unwrap();
        let inconsistent = std::sync::Arc::new(AtomicU64::new(0));
        let cfg = EngineConfig {
            profiles: vec![p.clone()],
            gpus: 4,
            shards: 1,
            rate_rps: 60_000.0,
            duration: Duration::from_millis(300),
            delay: Delay::default(),
        };
        let seen = inconsistent.clone();
        let make =
            move |_: &[Profile], g: usize, _: &[ModelId]| -> Result<Box<dyn crate::scheduler::Scheduler>, String> {
                Ok(Box::new(Predicting {
                    p: p.clone(),
                    free_at: vec![0.0; g],
                    untold: vec![0; g],
                    inconsistent: seen.clone(),
                }))
            };
        let r = run_any(&cfg, &make).unwrap();
        assert_eq!(inconsistent.load(Ordering::Relaxed), 0, "a dispatch onto a GPU whose end was not yet told");
        assert_eq!(r.lost, 0, "{r:?}");
        assert!(r.executed > 100, "{r:?}");
    }

    #[test]
    fn the_engine_resolves_every_request_on_real_threads() {
        let profiles: Vec<Profile> =
            (0..8).map(|i| Profile::new(&format!("m{i}"), 0.1, 2.0, 30.0, 64).unwrap()).collect();
        let cfg = EngineConfig {
            profiles,
            gpus: 16,
            shards: 2,
            rate_rps: 50_000.0,
            duration: Duration::from_millis(400),
            delay: Delay::default(),
        };
        let r = run(&cfg);
        assert_eq!(r.lost, 0, "{r:?}");
        assert!(r.requests > 10_000, "{r:?}");
        assert!(r.executed as f64 > 0.9 * r.requests as f64, "a light load is executed: {r:?}");
        assert!(r.within_slo as f64 > 0.9 * r.executed as f64, "{r:?}");
        assert!(r.batches > 0 && r.executed / r.batches > 2, "requests are batched: {r:?}");
    }
}
