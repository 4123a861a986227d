//! Any [`Scheduler`] against the wall clock: the same sans-IO schedulers the simulator drives
//! (`flex`, `clockwork`, `nexus`, …), run as a dispatcher thread on real time, fed by the same
//! open-loop load generator as Symphony's engine on its own thread. It is how Shepherd's serving
//! groups run in real time: each HERD group is a dispatcher thread of its own
//! ([`run_parts`]), as Shepherd §3 describes one scheduler per group.
//!
//! The dispatcher thread owns its scheduler and its part's emulated GPUs (a test double: a batch
//! occupies its GPU for ℓ(b) of wall-clock time from its start). It wakes on the first of: new
//! requests, the scheduler's timer, a batch's end — and hands each to the scheduler at the time
//! it reads from the clock, so the scheduler's own computing time counts as it would in a real
//! dispatcher. Unlike Symphony's engine there is no split into ModelThreads and a RankThread:
//! these schedulers are one state machine each.

use std::collections::VecDeque;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Instant;

use super::{ms_since, wait_for, EngineConfig, EngineReport, Heard, Outcome};
use crate::profile::Profile;
use crate::scheduler::{Decision, ModelId, Request, Scheduler};

/// Builds a part's scheduler from its profiles, its GPUs and its models' global ids.
pub type MakeScheduler<'a> = dyn Fn(&[Profile], usize, &[ModelId]) -> Result<Box<dyn Scheduler>, String> + Sync + 'a;

/// One batch on an emulated GPU.
struct Batch {
    end: f64,
    requests: Vec<Request>,
}

/// Runs the scheduler `make` builds for the whole of `cfg` on the wall clock, for
/// `cfg.duration` of offered load and until every request is resolved.
pub fn run_any(cfg: &EngineConfig, make: &MakeScheduler<'_>) -> Result<EngineReport, String> {
    let ids: Vec<ModelId> = (0..cfg.profiles.len()).collect();
    let sched = make(&cfg.profiles, cfg.gpus, &ids)?;
    Ok(drive(cfg, sched))
}

/// Each part of `parts` — its models and its GPUs — run by its own dispatcher thread with the
/// scheduler `make` builds for it, all at once; the report sums them (see
/// [`super::run_sub_clusters`] for the checks on `parts`).
pub fn run_parts(
    cfg: &EngineConfig,
    parts: &[(Vec<ModelId>, usize)],
    make: &MakeScheduler<'_>,
) -> Result<EngineReport, String> {
    super::each_part(cfg, parts, |sub, models| Ok(drive(sub, make(&sub.profiles, sub.gpus, models)?)))
}

/// The dispatcher loop on this thread; the load generator on another.
fn drive(cfg: &EngineConfig, mut sched: Box<dyn Scheduler>) -> EngineReport {
    let epoch = Instant::now();
    let (tx, rx) = mpsc::channel::<Vec<Request>>();
    let generator = {
        let (profiles, rate, duration) = (cfg.profiles.clone(), cfg.rate_rps, cfg.duration);
        std::thread::spawn(move || {
            super::generate(&profiles, rate, duration, epoch, |b| b.is_empty() || tx.send(b).is_ok())
        })
    };
    let mut heard = Heard::default();
    let mut gpus: Vec<VecDeque<Batch>> = (0..cfg.gpus).map(|_| VecDeque::new()).collect();
    let (mut batches, mut offered, mut out, mut open) = (0u64, 0u64, Vec::new(), true);
    loop {
        let now = ms_since(epoch);
        finish_due(cfg, now, &mut *sched, &mut out, &mut gpus, &mut heard, &mut batches);
        if sched.next_timer().is_some_and(|t| t <= now) {
            sched.on_timer(now, &mut out);
            apply(cfg, now, &mut out, &mut gpus, &mut heard, &mut batches);
        }
        let busy = gpus.iter().any(|q| !q.is_empty());
        if !open && !busy && sched.queued() == 0 {
            break;
        }
        let next_end = gpus.iter().filter_map(|q| q.front().map(|b| b.end)).reduce(f64::min);
        let next = [next_end, sched.next_timer()].into_iter().flatten().reduce(f64::min);
        if !open {
            // No more arrivals: sleep until the next event, or stop when none is coming.
            match next {
                Some(_) => std::thread::sleep(wait_for(next, ms_since(epoch))),
                None => break,
            }
            continue;
        }
        match rx.recv_timeout(wait_for(next, ms_since(epoch))) {
            Ok(reqs) => {
                // The scheduler hears of every batch that ended before it hears of anything
                // later, as in the simulator's event order.
                let now = ms_since(epoch);
                finish_due(cfg, now, &mut *sched, &mut out, &mut gpus, &mut heard, &mut batches);
                for r in reqs.into_iter().chain(rx.try_iter().flatten()) {
                    offered += 1;
                    sched.on_arrival(now, r, &mut out);
                    apply(cfg, now, &mut out, &mut gpus, &mut heard, &mut batches);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => open = false,
        }
    }
    let sent = generator.join().unwrap_or(offered);
    heard.report(sent, epoch.elapsed().as_secs_f64(), batches, 0)
}

/// Every batch that ended by `now`: its requests executed, its GPU free (the scheduler told).
fn finish_due(
    cfg: &EngineConfig,
    now: f64,
    sched: &mut dyn Scheduler,
    out: &mut Vec<Decision>,
    gpus: &mut [VecDeque<Batch>],
    heard: &mut Heard,
    batches: &mut u64,
) {
    for g in 0..gpus.len() {
        while gpus[g].front().is_some_and(|b| b.end <= now) {
            if let Some(b) = gpus[g].pop_front() {
                let good = b.requests.iter().filter(|r| b.end <= r.deadline).count() as u64;
                heard.hear(Outcome::Executed(b.requests.iter().map(|r| r.id).collect(), good));
                sched.on_gpu_free(now, g, out);
                apply(cfg, now, out, gpus, heard, batches);
            }
        }
    }
}

/// Carries out the scheduler's decisions at `now`.
fn apply(
    cfg: &EngineConfig,
    now: f64,
    out: &mut Vec<Decision>,
    gpus: &mut [VecDeque<Batch>],
    heard: &mut Heard,
    batches: &mut u64,
) {
    for d in out.drain(..) {
        match d {
            Decision::Drop(r) => heard.hear(Outcome::Dropped(vec![r.id])),
            Decision::Preempt { gpu } => {
                // The batch stops; its requests are the scheduler's again (as in the simulator).
                gpus.get_mut(gpu).and_then(VecDeque::pop_front);
            }
            Decision::Dispatch { gpu, model, requests, start } => {
                let Some(q) = gpus.get_mut(gpu) else {
                    heard.hear(Outcome::Dropped(requests.iter().map(|r| r.id).collect()));
                    continue;
                };
                let start = start.max(now).max(q.back().map_or(0.0, |b| b.end));
                let end = start + cfg.profiles[model].latency(requests.len());
                *batches += 1;
                q.push_back(Batch { end, requests });
            }
        }
    }
}
