//! The simulator behind `lora-sim`: emulated replicas (a test double for GPUs: every iteration
//! costs what [`CostModel`] says) serving a [`LoraScenario`]'s requests with continuous batching,
//! one [`Batcher`] per replica, routed by [`super::dispatch`] and, under `dispatch = "dlora"`,
//! rebalanced by [`super::migrate`].
//!
//! Each iteration a replica asks its batcher which runnable requests to run: those whose adapter
//! is loaded, that are not being moved, and — for a request not started yet — whose prompt fits
//! the free KV cache (admission in FCFS order). A request's first iteration prefills its prompt
//! and yields its first token; each later one yields a token, its KV growing by one. When a
//! replica's KV outgrows its capacity (decode steps, or requests migrated in), the most recently
//! arrived started requests are preempted until it fits, as vLLM (on which dLoRA is built)
//! preempts by recomputation: the request's KV is freed, it waits again, and when it is admitted
//! again its prefill recomputes its prompt and the tokens it had generated (`preemptions` in the
//! report). Deterministic: no clock, no randomness beyond the scenario's.
//!
//! Metrics. `avg_latency_s` is the paper's (§7.1): the sum of end-to-end latencies over the sum
//! of output tokens, s per token; `p90_latency_s` the 90th percentile of each request's latency per
//! output token; the queueing delay of a request is its latency minus the time of the iterations
//! it ran in. `max_wait_iterations` is the most consecutive iterations any request spent in its
//! replica's FCFS window without running (the starvation bound's quantity). Requests unfinished
//! when the simulation stops (20× the arrival span, plus ten minutes) count with the latency they
//! had then — a lower bound — and are reported as `unfinished`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::arrival::Rng;

use super::batcher::{adapters_of, Batcher, Policy, Runnable};
use super::dispatch::{
    artifact_cost, place, place_artifact, route, substitute, AdapterSet, ArtifactFill, Dispatch, Placement, RouteCost,
};
use super::migrate::{MigProblem, MigReplica, MigRequest, PlanSource};
use super::workload::{LoraRequest, LoraScenario};
use super::{AdapterId, CostModel, Mode};

/// What a run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoraReport {
    /// The batching policy.
    pub policy: Policy,
    /// The dispatch across replicas.
    pub dispatch: Dispatch,
    /// Replicas.
    pub replicas: usize,
    /// Requests generated.
    pub requests: usize,
    /// Requests that finished.
    pub finished: usize,
    /// Requests still unfinished when the simulation stopped.
    pub unfinished: usize,
    /// Σ latency ÷ Σ output tokens, s per token (the paper's average latency).
    pub avg_latency_s: f64,
    /// 90th percentile of latency per output token, s.
    pub p90_latency_s: f64,
    /// Mean end-to-end latency, s.
    pub avg_e2e_s: f64,
    /// 90th percentile of end-to-end latency, s.
    pub p90_e2e_s: f64,
    /// Mean queueing delay (latency minus the iterations the request ran in), s.
    pub avg_queue_s: f64,
    /// Mean over requests of the queueing delay per output token, s: what the public artifact
    /// reports as Figure 11's queueing delay (`wait_time_per_output_token` in
    /// `vllm/engine/llm_engine.py`, averaged by `ae_scripts/parse_log.sh`).
    pub avg_queue_per_token_s: f64,
    /// Finished requests per second of simulated time.
    pub throughput_rps: f64,
    /// Iterations that began with a merge or un-merge, all replicas.
    pub mode_switches: u64,
    /// Merge and un-merge operations, all replicas.
    pub switch_ops: u64,
    /// Iterations run merged, all replicas.
    pub merged_iterations: u64,
    /// Iterations run unmerged, all replicas.
    pub unmerged_iterations: u64,
    /// Iterations decided by starvation prevention.
    pub starvation_batches: u64,
    /// Most consecutive iterations a request spent in the FCFS window without running.
    pub max_wait_iterations: u64,
    /// The policy's bound on that, if it promises one.
    pub starvation_bound: Option<u64>,
    /// Requests migrated.
    pub migrations: u64,
    /// Migration plans made (monitor triggers).
    pub migration_plans: u64,
    /// Of those, the plans the solver produced (the rest: greedy).
    pub ilp_plans: u64,
    /// Longest solve, ms.
    pub max_solve_ms: f64,
    /// Adapter loads onto replicas after the start.
    pub adapter_loads: u64,
    /// Started requests whose KV was freed because their replica's KV cache was full (to be
    /// recomputed when they run again).
    pub preemptions: u64,
    /// The most KV any replica held after an iteration, as a fraction of its capacity (above 1
    /// only when one request alone outgrows it).
    pub peak_kv_use: f64,
    /// Share of requests of the most popular adapter (the scenario's skew).
    pub top_adapter_share: f64,
    /// α and β of replica 0 at the end.
    pub final_thresholds: (f64, f64),
}

#[derive(Debug, Clone)]
struct Live {
    req: LoraRequest,
    generated: u32,
    started: bool,
    kv: u64,
    service_ms: f64,
    streak: u64,
    ready_ms: f64,
}

impl Live {
    /// Tokens its next prefill computes: the prompt, and after a preemption the tokens it had
    /// generated too.
    fn prefill_tokens(&self) -> u64 {
        if self.started {
            0
        } else {
            u64::from(self.req.input) + u64::from(self.generated)
        }
    }
}

#[derive(Debug)]
struct Rep {
    batcher: Batcher,
    queue: Vec<Live>,
    busy_until: Option<f64>,
    running: Vec<u64>,
    iter_ms: f64,
    adapters: AdapterSet,
    kv_used: u64,
    wake: Option<f64>,
}

impl Rep {
    fn needed(&self) -> Vec<AdapterId> {
        let mut v: Vec<AdapterId> = self.queue.iter().map(|l| l.req.adapter).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

struct Sim<'a> {
    s: &'a LoraScenario,
    cost: CostModel,
    reps: Vec<Rep>,
    now: f64,
    placement: Vec<Vec<AdapterId>>,
    rr_next: Vec<usize>,
    token_ms: f64,
    out_mean: f64,
    done: Vec<(f64, u32, f64)>,
    max_wait: u64,
    migrations: u64,
    plans: u64,
    ilp_plans: u64,
    max_solve_ms: f64,
    adapter_loads: u64,
    preemptions: u64,
    peak_kv: u64,
}

/// Runs `s` under `policy` on every replica.
pub fn simulate(s: &LoraScenario, policy: Policy) -> Result<LoraReport, String> {
    s.validate()?;
    let cost = s.cost_model()?;
    let shares = s.adapter_shares();
    let out_mean = s.lengths.output_mean * s.lengths.scale;
    let mean_tokens = s.lengths.input_mean * s.lengths.scale + out_mean;
    let placement = if s.replicas == 1 {
        if s.adapters as usize > s.cluster.max_adapters_per_replica {
            return Err(format!("{} adapters exceed one replica's {}", s.adapters, s.cluster.max_adapters_per_replica));
        }
        vec![(0..s.adapters).collect()]
    } else {
        let cap = s.cluster.max_adapters_per_replica;
        match s.cluster.placement {
            Placement::Burst => place(&shares, s.replicas, cap, &cost, mean_tokens)?,
            Placement::Artifact => {
                let fill = if s.cluster.dispatch == Dispatch::Dlora {
                    // The artifact draws the adapter with Python's `random`; here from the seed.
                    let mut rng = Rng::new(s.seed ^ 0x5eed_a11a);
                    ArtifactFill::Spread((rng.next_u64() % u64::from(s.adapters)) as AdapterId)
                } else {
                    ArtifactFill::Sequential
                };
                place_artifact(s.adapters as usize, s.replicas, cap, fill)?
            }
        }
    };
    let reps = placement
        .iter()
        .map(|on| Rep {
            batcher: Batcher::new(policy, s.batch.clone(), cost.clone()),
            queue: Vec::new(),
            busy_until: None,
            running: Vec::new(),
            iter_ms: 0.0,
            adapters: AdapterSet::new(s.cluster.max_adapters_per_replica, on),
            kv_used: 0,
            wake: None,
        })
        .collect();
    let mb = s.batch.max_batch;
    let mut sim = Sim {
        s,
        token_ms: cost.iteration_ms(Mode::Unmerged, mb, 0, 1) / mb as f64,
        cost,
        reps,
        now: 0.0,
        placement,
        rr_next: vec![0; s.adapters as usize],
        out_mean,
        done: Vec::new(),
        max_wait: 0,
        migrations: 0,
        plans: 0,
        ilp_plans: 0,
        max_solve_ms: 0.0,
        adapter_loads: 0,
        preemptions: 0,
        peak_kv: 0,
    };
    let reqs = s.requests();
    let horizon = s.duration_s * 1000.0 * 20.0 + 600_000.0;
    let migrating = s.replicas > 1 && s.cluster.dispatch == Dispatch::Dlora;
    let mut next = 0;
    let mut next_monitor = s.cluster.monitor_ms;
    loop {
        let ta = reqs.get(next).map_or(f64::INFINITY, |r| r.arrival_ms);
        let (tj, j) = sim.first(|r| r.busy_until);
        let (tw, w) = sim.first(|r| r.wake);
        let work = next < reqs.len() || sim.reps.iter().any(|r| !r.queue.is_empty());
        let tm = if migrating && work { next_monitor } else { f64::INFINITY };
        let t = ta.min(tj).min(tw).min(tm);
        if !t.is_finite() || t > horizon {
            break;
        }
        sim.now = t;
        if tj == t {
            sim.end_iteration(j);
        } else if ta == t {
            sim.arrive(reqs[next].clone());
            next += 1;
        } else if tw == t {
            sim.reps[w].wake = None;
        } else {
            sim.monitor();
            next_monitor += s.cluster.monitor_ms;
        }
        for j in 0..sim.reps.len() {
            sim.start_iteration(j);
        }
    }
    Ok(sim.report(policy, reqs.len(), &shares))
}

impl Sim<'_> {
    fn first(&self, f: impl Fn(&Rep) -> Option<f64>) -> (f64, usize) {
        self.reps
            .iter()
            .enumerate()
            .filter_map(|(j, r)| f(r).map(|t| (t, j)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .unwrap_or((f64::INFINITY, 0))
    }

    /// Estimated remaining execution time of a request, ms.
    fn remaining_ms(&self, l: &Live) -> f64 {
        l.prefill_tokens() as f64 * self.cost.per_prefill_token_ms
            + (self.out_mean - l.generated as f64).max(1.0) * self.token_ms
    }

    /// Estimated time until replica `j` has done its queued work, ms.
    fn pending_ms(&self, j: usize) -> f64 {
        let r = &self.reps[j];
        let current = r.busy_until.map_or(0.0, |t| t - self.now);
        current + r.queue.iter().map(|l| self.remaining_ms(l)).sum::<f64>()
    }

    /// The artifact's routing cost of replica `j` (`RouteCost::Artifact`).
    fn artifact_cost(&self, j: usize) -> f64 {
        let mut counts: BTreeMap<AdapterId, usize> = BTreeMap::new();
        for l in &self.reps[j].queue {
            *counts.entry(l.req.adapter).or_default() += 1;
        }
        artifact_cost(counts.into_values(), self.s.batch.max_batch)
    }

    /// Round-robin over the replicas the placement preloaded with `a` (`rr`, our routing).
    fn rotate(&mut self, a: AdapterId) -> usize {
        let holders: Vec<usize> = (0..self.reps.len()).filter(|&j| self.placement[j].contains(&a)).collect();
        let k = self.rr_next[a as usize];
        self.rr_next[a as usize] += 1;
        holders[k % holders.len()]
    }

    /// The replica with the shortest estimated pending time for a request of `a`, its load time
    /// counted where it is not resident (`proactive`, `dlora`, our routing).
    fn pending_route(&self, a: AdapterId) -> usize {
        let pending: Vec<f64> = (0..self.reps.len()).map(|j| self.pending_ms(j)).collect();
        let resident: Vec<bool> = self.reps.iter().map(|r| r.adapters.contains(a)).collect();
        let loadable: Vec<bool> = self
            .reps
            .iter()
            .map(|r| {
                let needed = r.needed();
                r.adapters.can_load(|k| needed.binary_search(&k).is_ok())
            })
            .collect();
        route(&pending, &resident, &loadable, self.cost.adapter_load_ms)
            .unwrap_or_else(|| (0..pending.len()).min_by(|&x, &y| pending[x].total_cmp(&pending[y])).unwrap_or(0))
    }

    /// The artifact's `select_engine` for a request of `a` (module docs of `dispatch`): its cost
    /// over the holders (which counts batches, and the load time in seconds); under `proactive`
    /// also the replicas where an adapter can be swapped out for it (done here when one is
    /// chosen); with no candidate, the replica with fewest requests. Under this routing `rr` is
    /// the artifact's dispatch-only mode, the one its Figure 11 ran as RR.
    fn artifact_route(&mut self, a: AdapterId) -> usize {
        let n = self.reps.len();
        let cost: Vec<f64> = (0..n).map(|j| self.artifact_cost(j)).collect();
        let resident: Vec<bool> = self.reps.iter().map(|r| r.adapters.contains(a)).collect();
        let swap: Vec<Option<AdapterId>> = if self.s.cluster.dispatch == Dispatch::Proactive {
            let on: Vec<Vec<AdapterId>> = self.reps.iter().map(|r| r.adapters.adapters()).collect();
            let needed: Vec<Vec<AdapterId>> = self.reps.iter().map(Rep::needed).collect();
            (0..n).map(|j| if resident[j] { None } else { substitute(&on, &needed, j, a) }).collect()
        } else {
            vec![None; n]
        };
        let loadable: Vec<bool> = swap.iter().map(Option::is_some).collect();
        match route(&cost, &resident, &loadable, self.cost.adapter_load_ms / 1000.0) {
            Some(j) => {
                if let Some(b) = swap[j] {
                    self.reps[j].adapters.remove(b);
                }
                j
            }
            None => (0..n).min_by_key(|&j| (self.reps[j].queue.len(), j)).unwrap_or(0),
        }
    }

    fn load_adapter(&mut self, j: usize, a: AdapterId) {
        let rep = &mut self.reps[j];
        if rep.adapters.contains(a) {
            return;
        }
        let needed = rep.needed();
        rep.adapters.load(a, self.now, self.now + self.cost.adapter_load_ms, |k| needed.binary_search(&k).is_ok());
        self.adapter_loads += 1;
    }

    fn arrive(&mut self, req: LoraRequest) {
        let a = req.adapter;
        let j = if self.reps.len() == 1 {
            0
        } else {
            match (self.s.cluster.route_cost, self.s.cluster.dispatch) {
                (RouteCost::Artifact, _) => self.artifact_route(a),
                (RouteCost::Pending, Dispatch::Rr) => self.rotate(a),
                (RouteCost::Pending, Dispatch::Proactive | Dispatch::Dlora) => self.pending_route(a),
            }
        };
        self.load_adapter(j, a);
        self.reps[j].queue.push(Live {
            req,
            generated: 0,
            started: false,
            kv: 0,
            service_ms: 0.0,
            streak: 0,
            ready_ms: self.now,
        });
    }

    fn start_iteration(&mut self, j: usize) {
        let now = self.now;
        let cap = self.cost.kv_capacity_tokens;
        let max_batch = self.s.batch.max_batch;
        let rep = &mut self.reps[j];
        if rep.busy_until.is_some() {
            return;
        }
        let mut idx = Vec::new();
        let mut runnable = Vec::new();
        let mut used = rep.kv_used;
        let mut wake = f64::INFINITY;
        for (qi, l) in rep.queue.iter().enumerate() {
            let ready = l.ready_ms.max(rep.adapters.ready_at(l.req.adapter).unwrap_or(f64::INFINITY));
            if ready > now {
                wake = wake.min(ready);
                continue;
            }
            let mut prompt = 0;
            if !l.started {
                let need = l.prefill_tokens();
                let alone = rep.kv_used == 0 && runnable.is_empty();
                if used + need > cap && !alone {
                    continue;
                }
                used += need;
                prompt = need;
            }
            idx.push(qi);
            runnable.push(Runnable { adapter: l.req.adapter, prompt_tokens: prompt });
        }
        if runnable.is_empty() {
            rep.wake = wake.is_finite().then_some(wake);
            return;
        }
        let choice = rep.batcher.decide(&runnable);
        let window = runnable.len().min(max_batch);
        for (k, &qi) in idx.iter().enumerate() {
            let served = choice.batch.binary_search(&k).is_ok();
            let l = &mut rep.queue[qi];
            if served || k >= window {
                l.streak = 0;
            } else {
                l.streak += 1;
                self.max_wait = self.max_wait.max(l.streak);
            }
        }
        let dur =
            choice.switch_ops as f64 * self.cost.switch_ms + self.cost.batch_ms(choice.mode, &runnable, &choice.batch);
        for a in adapters_of(&runnable, &choice.batch) {
            rep.adapters.touch(a, now);
        }
        rep.running = choice.batch.iter().map(|&k| rep.queue[idx[k]].req.id).collect();
        rep.iter_ms = dur;
        rep.busy_until = Some(now + dur);
    }

    fn end_iteration(&mut self, j: usize) {
        let now = self.now;
        let rep = &mut self.reps[j];
        rep.busy_until = None;
        for id in std::mem::take(&mut rep.running) {
            let Some(qi) = rep.queue.iter().position(|l| l.req.id == id) else { continue };
            let l = &mut rep.queue[qi];
            l.service_ms += rep.iter_ms;
            let grow = if l.started { 1 } else { l.prefill_tokens() };
            l.started = true;
            l.kv += grow;
            rep.kv_used += grow;
            l.generated += 1;
            if l.generated >= l.req.output {
                let l = rep.queue.remove(qi);
                rep.kv_used -= l.kv;
                self.done.push((now - l.req.arrival_ms, l.req.output, l.service_ms));
            }
        }
        self.preempt(j);
        self.peak_kv = self.peak_kv.max(self.reps[j].kv_used);
    }

    /// Frees the KV of replica `j`'s most recently arrived started requests until its KV fits
    /// its capacity (vLLM's preemption by recomputation; the oldest started request is kept, so a
    /// replica always makes progress, and requests in the iteration running now are kept).
    fn preempt(&mut self, j: usize) {
        let cap = self.cost.kv_capacity_tokens;
        let rep = &mut self.reps[j];
        if rep.kv_used <= cap {
            return;
        }
        // The oldest started request stays; so does any in the iteration running now.
        let Some(oldest) = rep.queue.iter().position(|l| l.started) else { return };
        let mut qi = rep.queue.len();
        while rep.kv_used > cap && qi > oldest + 1 {
            qi -= 1;
            let l = &mut rep.queue[qi];
            if !l.started || rep.running.contains(&l.req.id) {
                continue;
            }
            rep.kv_used -= l.kv;
            l.kv = 0;
            l.started = false;
            self.preemptions += 1;
        }
    }

    /// The monitor (§5.2): on a trigger, a co-migration plan between the top-K overloaded and
    /// top-K underloaded replicas, applied at once (moved requests become runnable on their new
    /// replica after their KV cache and, if needed, their adapter arrive).
    fn monitor(&mut self) {
        let c = &self.s.cluster;
        let n = self.reps.len();
        let cap = self.cost.kv_capacity_tokens as f64;
        let kvf: Vec<f64> = self.reps.iter().map(|r| r.kv_used as f64 / cap).collect();
        let qlen: Vec<f64> = self.reps.iter().map(|r| r.queue.len() as f64).collect();
        let mean_q = qlen.iter().sum::<f64>() / n as f64;
        let kv_max = kvf.iter().copied().fold(0.0, f64::max);
        let kv_min = kvf.iter().copied().fold(f64::INFINITY, f64::min);
        let q_max = qlen.iter().copied().fold(0.0, f64::max);
        if !((kv_max >= c.kv_trigger && kv_min < c.kv_trigger) || q_max - mean_q >= c.queue_trigger as f64) {
            return;
        }
        let pend: Vec<f64> = (0..n).map(|j| self.pending_ms(j)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| pend[b].total_cmp(&pend[a]).then(a.cmp(&b)));
        let k = c.top_k.min(n / 2).max(1);
        let over: Vec<usize> = order[..k].to_vec();
        let under: Vec<usize> = order[n - k..].to_vec();
        let members: Vec<usize> = over.iter().chain(&under).copied().collect();
        let kvb = self.cost.kv_bytes_per_token as f64;
        let mut requests = Vec::new();
        let mut ids = Vec::new();
        let mut replicas = Vec::new();
        for (pi, &j) in members.iter().enumerate() {
            let rep = &self.reps[j];
            let mut base_ms = rep.busy_until.map_or(0.0, |t| t - self.now);
            let mut base_mem = 0.0;
            // Movable: not running now, on an overloaded replica; the most recent 64 of each.
            let movable: Vec<usize> = if over.contains(&j) {
                let v: Vec<usize> =
                    (0..rep.queue.len()).filter(|&q| !rep.running.contains(&rep.queue[q].req.id)).collect();
                v[v.len().saturating_sub(64)..].to_vec()
            } else {
                Vec::new()
            };
            for (q, l) in rep.queue.iter().enumerate() {
                let mem = l.kv.max(l.req.input as u64) as f64 * kvb;
                if movable.contains(&q) {
                    requests.push(MigRequest {
                        adapter: l.req.adapter,
                        from: pi,
                        exec_ms: self.remaining_ms(l),
                        mem_bytes: mem,
                        move_ms: self.cost.migrate_ms(l.kv),
                    });
                    ids.push((j, l.req.id));
                } else {
                    base_ms += self.remaining_ms(l);
                    base_mem += mem;
                }
            }
            replicas.push(MigReplica { base_ms, base_mem, capacity: cap * kvb, resident: rep.adapters.adapters() });
        }
        let problem = MigProblem {
            requests,
            replicas,
            adapter_bytes: self.cost.adapter_bytes as f64,
            eta_ms: c.eta_ms.unwrap_or(self.cost.adapter_load_ms),
            swap_bytes_per_ms: c.swap_bytes_per_ms,
        };
        let plan = problem.solve(c.relax, Duration::from_millis(c.solve_budget_ms));
        self.plans += 1;
        self.ilp_plans += (plan.source == PlanSource::Ilp) as u64;
        self.max_solve_ms = self.max_solve_ms.max(plan.solve_ms);
        for (i, &to) in plan.to.iter().enumerate() {
            let (src, id) = ids[i];
            let dst = members[to];
            if dst == src {
                continue;
            }
            let Some(q) = self.reps[src].queue.iter().position(|l| l.req.id == id) else { continue };
            let mut l = self.reps[src].queue.remove(q);
            self.reps[src].kv_used -= l.kv;
            l.ready_ms = self.now + self.cost.migrate_ms(l.kv);
            l.streak = 0;
            self.load_adapter(dst, l.req.adapter);
            let d = &mut self.reps[dst];
            d.kv_used += l.kv;
            let at = d.queue.partition_point(|x| (x.req.arrival_ms, x.req.id) < (l.req.arrival_ms, l.req.id));
            d.queue.insert(at, l);
            self.migrations += 1;
        }
        // Only the plan's replicas gained requests.
        for j in members {
            self.preempt(j);
        }
    }

    fn report(&self, policy: Policy, requests: usize, shares: &[f64]) -> LoraReport {
        // Unfinished requests count with the latency they had (a lower bound).
        let mut all: Vec<(f64, u32, f64)> = self.done.clone();
        for r in &self.reps {
            for l in &r.queue {
                all.push((self.now - l.req.arrival_ms, l.req.output, l.service_ms));
            }
        }
        let mut per_token: Vec<f64> = all.iter().map(|d| d.0 / 1e3 / d.1 as f64).collect();
        let mut e2e: Vec<f64> = all.iter().map(|d| d.0 / 1e3).collect();
        let p90 = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(((v.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
        };
        let n = all.len().max(1) as f64;
        let tokens: f64 = all.iter().map(|d| d.1 as f64).sum();
        let stats: Vec<_> = self.reps.iter().map(|r| r.batcher.stats().clone()).collect();
        let sum = |f: fn(&super::batcher::BatcherStats) -> u64| stats.iter().map(f).sum::<u64>();
        LoraReport {
            policy,
            dispatch: self.s.cluster.dispatch,
            replicas: self.reps.len(),
            requests,
            finished: self.done.len(),
            unfinished: all.len() - self.done.len(),
            avg_latency_s: all.iter().map(|d| d.0 / 1e3).sum::<f64>() / tokens.max(1.0),
            p90_latency_s: p90(&mut per_token),
            avg_e2e_s: e2e.iter().sum::<f64>() / n,
            p90_e2e_s: p90(&mut e2e),
            avg_queue_s: all.iter().map(|d| (d.0 - d.2) / 1e3).sum::<f64>() / n,
            avg_queue_per_token_s: all.iter().map(|d| (d.0 - d.2) / 1e3 / f64::from(d.1.max(1))).sum::<f64>() / n,
            throughput_rps: self.done.len() as f64 / (self.now / 1e3).max(1e-9),
            mode_switches: sum(|s| s.mode_switches),
            switch_ops: sum(|s| s.switch_ops),
            merged_iterations: sum(|s| s.merged_iterations),
            unmerged_iterations: sum(|s| s.unmerged_iterations),
            starvation_batches: sum(|s| s.starvation_batches),
            max_wait_iterations: self.max_wait,
            starvation_bound: self.reps[0].batcher.starvation_bound(),
            migrations: self.migrations,
            migration_plans: self.plans,
            ilp_plans: self.ilp_plans,
            max_solve_ms: self.max_solve_ms,
            adapter_loads: self.adapter_loads,
            preemptions: self.preemptions,
            peak_kv_use: self.peak_kv as f64 / self.cost.kv_capacity_tokens as f64,
            top_adapter_share: shares.iter().copied().fold(0.0, f64::max),
            final_thresholds: self.reps[0].batcher.thresholds(),
        }
    }
}
