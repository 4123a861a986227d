//! A Nexus-like scheduler, as the Symphony paper describes Nexus (§2, §5): every epoch, models are
//! allocated to GPUs from their average rates by squishy bin packing; frontends dispatch each
//! request round-robin to a GPU holding its model; each GPU runs round-robin duty cycles over its
//! models, work-conserving, with the batch sizes the plan chose.
//!
//! Squishy bin packing (Nexus, SOSP '19, §6.1): a model whose rate fills whole GPUs at its largest
//! batch b with 2·ℓ(b) ≤ SLO (a request may wait one full cycle, then run) gets those GPUs; its
//! residual rate becomes a session with duty cycle d and batch r·d, where d + ℓ(r·d) ≤ SLO.
//! Residual sessions are merged best-fit onto GPUs while the sum of their batch latencies fits
//! the smallest duty cycle. Departures: rates come from the scenario for the first epoch and from
//! the arrivals of the previous epoch afterwards; sessions that do not fit the GPUs left share the
//! least-loaded GPUs (over-committed) rather than being refused.

use std::collections::VecDeque;

use crate::profile::{largest_batch, Profile};
use crate::scheduler::{drop_expired, Decision, GpuId, ModelId, Ms, Request, Scheduler};
use crate::time::Delay;

/// A model's share of one GPU: batches of up to `batch`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Session {
    model: ModelId,
    batch: usize,
}

/// A GPU's residual sessions (model, duty cycle, batch) and their common duty cycle.
type Bin = (Vec<(ModelId, f64, usize)>, f64);

/// The scheduler.
pub struct Nexus {
    profiles: Vec<Profile>,
    delay: Delay,
    frontends: usize,
    epoch_ms: Ms,
    next_epoch: Ms,
    /// Arrivals per model in the current epoch.
    seen: Vec<u64>,
    /// Sessions of each GPU, served round-robin.
    plan: Vec<Vec<Session>>,
    /// Next session each GPU serves.
    turn: Vec<usize>,
    /// Per GPU, per model queue.
    queues: Vec<Vec<VecDeque<Request>>>,
    /// GPUs holding each model.
    hosts: Vec<Vec<GpuId>>,
    /// Per frontend, per model round-robin pointer.
    rr: Vec<Vec<usize>>,
    free_at: Vec<Ms>,
}

impl Nexus {
    /// Nexus over `gpus` GPUs with `frontends` frontends, planned from `rates_rps` and re-planned
    /// every `epoch_ms`.
    pub fn new(
        profiles: &[Profile],
        gpus: usize,
        delay: Delay,
        rates_rps: &[f64],
        frontends: usize,
        epoch_ms: Ms,
    ) -> Nexus {
        let n = profiles.len();
        let mut s = Nexus {
            profiles: profiles.to_vec(),
            delay,
            frontends: frontends.max(1),
            epoch_ms,
            next_epoch: epoch_ms,
            seen: vec![0; n],
            plan: Vec::new(),
            turn: vec![0; gpus],
            queues: vec![vec![VecDeque::new(); n]; gpus],
            hosts: vec![Vec::new(); n],
            rr: vec![vec![0; n]; frontends.max(1)],
            free_at: vec![0.0; gpus],
        };
        s.replan(rates_rps);
        s
    }

    /// Squishy bin packing of `rates_rps` onto the GPUs.
    fn replan(&mut self, rates_rps: &[f64]) {
        let gpus = self.free_at.len();
        // Nexus sizes the cluster to the load; here the cluster is given, so every model's rate
        // is scaled up until the plan fills it (spare GPUs become headroom for every model).
        let need: f64 = self
            .profiles
            .iter()
            .enumerate()
            .map(|(m, p)| {
                let b = p.max_batch_within(p.slo_ms / 2.0).max(1);
                rates_rps.get(m).copied().unwrap_or(0.0).max(0.0) / 1000.0 / (b as f64 / p.latency(b))
            })
            .sum();
        let fill = if need > 0.0 && need < gpus as f64 { gpus as f64 / need * 0.999 } else { 1.0 };
        let rates_rps: Vec<f64> = rates_rps.iter().map(|r| r * fill).collect();
        let mut plan: Vec<Vec<Session>> = vec![Vec::new(); gpus];
        let mut used = 0;
        // (model, duty cycle, batch, occupancy) of residual sessions.
        let mut residual: Vec<(ModelId, f64, usize, f64)> = Vec::new();
        for (m, p) in self.profiles.iter().enumerate() {
            let r = rates_rps.get(m).copied().unwrap_or(0.0).max(0.0) / 1000.0; // per ms
            let b = p.max_batch_within(p.slo_ms / 2.0).max(1);
            let per_gpu = b as f64 / p.latency(b);
            let mut full = (r / per_gpu).floor() as usize;
            while full > 0 && used < gpus {
                plan[used].push(Session { model: m, batch: b });
                used += 1;
                full -= 1;
            }
            let rest = r - (r / per_gpu).floor() * per_gpu;
            if rest > 0.0 || (r == 0.0 && self.hosts[m].is_empty()) {
                // Largest duty cycle d with d + ℓ(rest·d) ≤ SLO: d ≤ (SLO − β) / (1 + α·rest).
                let d = ((p.slo_ms - p.beta_ms) / (1.0 + p.alpha_ms * rest)).max(p.latency(1));
                let batch = ((rest * d).ceil() as usize).clamp(1, b);
                residual.push((m, d, batch, p.latency(batch) / d));
            }
        }
        // Best-fit decreasing by occupancy onto the GPUs left.
        residual.sort_by(|a, b| b.3.total_cmp(&a.3));
        let mut bins: Vec<Bin> = Vec::new();
        for (m, d, batch, _) in residual {
            let fits = |bin: &Bin| {
                let dc = bin.1.min(d);
                let load: f64 = bin.0.iter().map(|(mm, _, bb)| self.profiles[*mm].latency(*bb)).sum::<f64>()
                    + self.profiles[m].latency(batch);
                load <= dc
            };
            let best = (0..bins.len()).filter(|i| fits(&bins[*i])).min_by(|a, b| {
                let slack = |i: usize| {
                    bins[i].1 - bins[i].0.iter().map(|(mm, _, bb)| self.profiles[*mm].latency(*bb)).sum::<f64>()
                };
                slack(*a).total_cmp(&slack(*b))
            });
            match best {
                Some(i) => {
                    bins[i].0.push((m, d, batch));
                    bins[i].1 = bins[i].1.min(d);
                }
                None => bins.push((vec![(m, d, batch)], d)),
            }
        }
        for (i, (sessions, _)) in bins.into_iter().enumerate() {
            // More bins than GPUs left: share the least-loaded GPUs.
            let g = if used + i < gpus { used + i } else { (used + i) % gpus.max(1) };
            plan[g].extend(sessions.into_iter().map(|(model, _, batch)| Session { model, batch }));
        }
        self.hosts = vec![Vec::new(); self.profiles.len()];
        for (g, sessions) in plan.iter().enumerate() {
            for s in sessions {
                self.hosts[s.model].push(g);
            }
        }
        for (m, h) in self.hosts.iter_mut().enumerate() {
            if h.is_empty() {
                // Not in the plan (no rate seen): the least-loaded GPU serves it.
                let g = (0..gpus).min_by_key(|g| plan[*g].len()).unwrap_or(0);
                plan[g].push(Session {
                    model: m,
                    batch: self.profiles[m].max_batch_within(self.profiles[m].slo_ms / 2.0).max(1),
                });
                h.push(g);
            }
        }
        self.plan = plan;
        self.turn = vec![0; gpus];
    }

    fn route(&mut self, req: Request) {
        let f = (req.id % self.frontends as u64) as usize;
        let hosts = &self.hosts[req.model];
        let i = self.rr[f][req.model] % hosts.len();
        self.rr[f][req.model] = i + 1;
        self.queues[hosts[i]][req.model].push_back(req);
    }

    fn epoch(&mut self, now: Ms) {
        if now < self.next_epoch {
            return;
        }
        let rates: Vec<f64> = self.seen.iter().map(|n| *n as f64 * 1000.0 / self.epoch_ms).collect();
        self.seen.iter_mut().for_each(|n| *n = 0);
        while self.next_epoch <= now {
            self.next_epoch += self.epoch_ms;
        }
        self.replan(&rates);
        // Queued requests follow their model to its new GPUs.
        let queued: Vec<Request> =
            self.queues.iter_mut().flat_map(|qs| qs.iter_mut().flat_map(|q| q.drain(..))).collect();
        let mut queued = queued;
        queued.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
        for r in queued {
            self.route(r);
        }
    }

    /// Serves every free GPU: its next session (round-robin) with queued requests.
    fn serve(&mut self, now: Ms, out: &mut Vec<Decision>) {
        for g in 0..self.free_at.len() {
            if self.free_at[g] > now || self.plan[g].is_empty() {
                continue;
            }
            let n = self.plan[g].len();
            for k in 0..n {
                let s = self.plan[g][(self.turn[g] + k) % n];
                let p = &self.profiles[s.model];
                let q = &mut self.queues[g][s.model];
                drop_expired(p, self.delay, now, q, out);
                let Some(front) = q.front() else { continue };
                let b = largest_batch(p, self.delay, now, now, front.deadline, q.len().min(s.batch)).max(1);
                let requests: Vec<Request> = q.drain(..b).collect();
                let start = now + self.delay.of(b);
                self.free_at[g] = start + p.latency(b);
                self.turn[g] = (self.turn[g] + k + 1) % n;
                out.push(Decision::Dispatch { gpu: g, model: s.model, requests, start });
                break;
            }
        }
    }
}

impl Scheduler for Nexus {
    fn name(&self) -> &'static str {
        "nexus"
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        self.epoch(now);
        self.seen[req.model] += 1;
        self.route(req);
        self.serve(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
        // The GPU's free time is known from the dispatch (a batch dispatched at this very
        // instant may already occupy it).
        let _ = gpu;
        self.epoch(now);
        self.serve(now, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.epoch(now);
        self.serve(now, out);
    }

    fn next_timer(&self) -> Option<Ms> {
        Some(self.next_epoch)
    }

    fn queued(&self) -> usize {
        self.queues.iter().flat_map(|qs| qs.iter()).map(VecDeque::len).sum()
    }
}
