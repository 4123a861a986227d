//! The serving simulator: virtual time, emulated GPUs that run one batch at a time for ℓ(b),
//! arrivals from each model's process, and a [`Scheduler`] deciding. Deterministic for a seed.
//!
//! Every request ends exactly one way — completed (in time or late), dropped by the scheduler,
//! or still queued when the run ends (counted as dropped) — and the run checks it: `lost` is the
//! number of requests it could not account for (must be 0).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::arrival::ArrivalGen;
use crate::metrics::{Metrics, Window};
use crate::profile::Profile;
use crate::scheduler::{Decision, GpuId, ModelId, Ms, Request, Scheduler};
use crate::time::At;

/// A simulated run's settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The models.
    pub profiles: Vec<Profile>,
    /// Each model's arrivals (same order).
    pub arrivals: Vec<ArrivalGen>,
    /// GPUs.
    pub gpus: usize,
    /// Arrivals stop at this time, ms.
    pub duration_ms: Ms,
    /// Requests arriving before this are not measured, ms.
    pub warmup_ms: Ms,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A model's next arrival.
    Arrival(ModelId),
    /// A GPU's batch `seq` completes.
    Finish(GpuId, u64),
}

/// A batch on a GPU: sequence number, start, end, model, requests.
type Batch = (u64, Ms, Ms, ModelId, Vec<Request>);

struct Gpu {
    /// Batches dispatched and not finished, in start order (a scheduler may dispatch the next
    /// batch before the running one ends, to start when it does).
    batches: std::collections::VecDeque<Batch>,
}

/// A scheduler's decision the simulator could not carry out (a scheduler bug).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("at {at:.3} ms: {detail}")]
pub struct SimError {
    /// When.
    pub at: Ms,
    /// What.
    pub detail: String,
}

/// Runs `sched` over `cfg`; returns what was measured.
pub fn run(cfg: SimConfig, sched: &mut dyn Scheduler) -> Result<Metrics, SimError> {
    let SimConfig { profiles, mut arrivals, gpus, duration_ms, warmup_ms } = cfg;
    let mut heap: BinaryHeap<Reverse<(At, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<Reverse<(At, u64, Ev)>>, t: Ms, e: Ev| {
        seq += 1;
        heap.push(Reverse((At(t), seq, e)));
    };
    let mut pending: Vec<Option<Ms>> = Vec::with_capacity(arrivals.len());
    for (m, a) in arrivals.iter_mut().enumerate() {
        let t = a.next_arrival().filter(|t| *t < duration_ms);
        pending.push(t);
        if let Some(t) = t {
            push(&mut heap, t, Ev::Arrival(m));
        }
    }
    let mut gpu: Vec<Gpu> = (0..gpus).map(|_| Gpu { batches: Default::default() }).collect();
    let mut metrics = Metrics::new(&profiles, gpus, Window { from: warmup_ms, to: duration_ms });
    let mut out = Vec::new();
    let mut next_id = 0u64;
    let mut batch_seq = 0u64;
    let mut now: Ms = 0.0;
    loop {
        let ev_t = heap.peek().map(|Reverse((t, _, _))| t.0);
        let timer = sched.next_timer();
        let (t, ev) = match (ev_t, timer) {
            (None, None) => break,
            (Some(e), Some(tm)) if tm < e => (tm, None),
            (None, Some(tm)) => {
                // Only timers left: stop once nothing is queued or running.
                if sched.queued() == 0 && gpu.iter().all(|g| g.batches.is_empty()) {
                    break;
                }
                (tm, None)
            }
            (Some(e), _) => (e, heap.pop().map(|Reverse((_, _, ev))| ev)),
        };
        now = now.max(t);
        match ev {
            None => sched.on_timer(now, &mut out),
            Some(Ev::Arrival(m)) => {
                let req = Request { id: next_id, model: m, arrival: now, deadline: now + profiles[m].slo_ms };
                next_id += 1;
                metrics.arrived(&req);
                pending[m] = arrivals[m].next_arrival().filter(|t| *t < duration_ms);
                if let Some(t) = pending[m] {
                    push(&mut heap, t, Ev::Arrival(m));
                }
                sched.on_arrival(now, req, &mut out);
            }
            Some(Ev::Finish(g, s)) => {
                let done = match gpu[g].batches.front() {
                    Some((rs, ..)) if *rs == s => gpu[g].batches.pop_front(),
                    _ => None, // preempted meanwhile
                };
                if let Some((_, start, end, model, reqs)) = done {
                    metrics.batch_done(model, start, end, &reqs);
                    sched.on_gpu_free(now, g, &mut out);
                }
            }
        }
        for d in out.drain(..) {
            match d {
                Decision::Drop(r) => metrics.dropped(&r),
                Decision::Preempt { gpu: g } => {
                    let Some(r) = gpu.get_mut(g).and_then(|x| x.batches.pop_front()) else {
                        return Err(SimError { at: now, detail: format!("preempt of idle GPU {g}") });
                    };
                    metrics.preempted(r.1, now);
                }
                Decision::Dispatch { gpu: g, model, requests, start } => {
                    if g >= gpus || requests.is_empty() || start < now - 1e-9 {
                        return Err(SimError { at: now, detail: format!("bad dispatch to GPU {g} at {start}") });
                    }
                    if let Some((_, _, end, ..)) = gpu[g].batches.back() {
                        if *end > start + 1e-6 {
                            return Err(SimError {
                                at: now,
                                detail: format!(
                                    "GPU {g} is busy until {end:.3} ms; batch dispatched to start at {start:.3}"
                                ),
                            });
                        }
                    }
                    let end = start + profiles[model].latency(requests.len());
                    batch_seq += 1;
                    gpu[g].batches.push_back((batch_seq, start, end, model, requests));
                    push(&mut heap, end, Ev::Finish(g, batch_seq));
                }
            }
        }
    }
    metrics.finish(sched.queued() as u64);
    Ok(metrics)
}
