//! `clockwork-real`: the scheduler of the real Clockwork (Gujarati et al., OSDI '20) — its
//! default controller, `INFER4` — as Symphony measured it (§5: emulated GPUs, no input
//! transfer, "support for arbitrary batch sizes" added). The plain [`crate::clockwork`] is the
//! policy as the Symphony and Shepherd papers *describe* it (the earliest deadline's model, the
//! largest batch that meets it); this is the mechanism that produces what Symphony *measured*:
//! Clockwork "picks an execution candidate merely based on the deadline, not taking batch size
//! into account", so "the probability of Clockwork choosing a specific batch size is uniform"
//! (§5.3, Figure 8), and it "often dispatches small batches that are close to their deadlines".
//!
//! What the controller does, read from Clockwork's public source (`INFER4`:
//! `controller/concurrent_infer_and_load_scheduler.{h,cpp}`):
//!
//! * **Deadlines with a buffer.** A request is scheduled against `arrival + max(SLO − 5 ms,
//!   ahead + 5 ms)` (its `exec_slo`; the 5 ms `buffer` is a constant there). Goodput is still
//!   judged against the real SLO.
//! * **Strategies.** Each request brings one *strategy* per supported batch size `b`, with
//!   priority `deadline − est(b)`; every GPU keeps its own priority queue of them.
//! * **Schedule-ahead.** While a GPU's queued work ends less than `ahead` into the future
//!   (5 ms: Clockwork's documented default when the controller does not carry inputs, which
//!   Symphony removed), it pops its lowest-priority strategy and tries it: the strategy fails if
//!   its deadline cannot be met from when the GPU frees, or if fewer than `b` requests arrived
//!   from its request on; if more did, the batch grows to the largest size they allow, unless
//!   that size would miss the strategy's deadline (then it fails too). Requests ahead of it that
//!   cannot make it are dropped, and the batch takes `b` requests from the queue's front. **A
//!   popped strategy is gone**, whether it succeeded or not: the large-batch strategies of a
//!   request come first (their priority is earliest) and mostly fail for want of requests, so
//!   batches end up smaller than the queue allows.
//! * **Batch sizes** 1 to 16 (Clockwork's `max_batch` default; Symphony added the sizes in
//!   between Clockwork's compiled 1, 2, 4, 8, 16), capped by the model's own maximum.
//!   Clockwork's `max_exec` (no batch above 25 ms) is not applied: with it InceptionResNetV2
//!   (ℓ(2) = 28.5 ms) could only run batches of one, 341 r/s on 8 GPUs, below the 482 r/s
//!   Symphony measured, so Symphony cannot have run with it.
//!
//! Departures: estimates are the profile (Clockwork uses the 99th percentile of its last ten
//! measurements; emulated GPUs are exact), and a batch's start also waits for the scenario's
//! dispatch delay, as every scheduler here does. Model loading is absent (every model is on
//! every GPU). The GPUs in their window are served in the order they free, and a window is open
//! from `ahead` before the GPU frees inclusive (Clockwork polls, and starts just after it);
//! equal priorities go to the lower model index, then the smaller batch. A request whose
//! (buffered) deadline has passed can never be dispatched, so it is dropped then rather than
//! when a strategy of its model next reaches the front.
//!
//! Cost: a GPU's strategies of one model at one batch size are always a suffix of that model's
//! requests (they are popped in arrival order, and requests leave from the front), so each GPU
//! keeps per model and size a cursor, and per model one heap entry holding its lowest
//! strategy's priority, instead of an entry per request and size; a strategy that fails for its
//! deadline skips, at every size, every request that would fail the same way (the GPU only
//! frees later). A test checks these decide exactly as one entry per strategy popped one by one.
//! On `scale_64gpus.toml` at 50,000 r/s (60 s) a run takes 7.0 s; before the per-model entries
//! and the skipping it took 16 s.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::profile::Profile;
use crate::scheduler::{Decision, GpuId, Ms, Request, Scheduler};
use crate::time::{At, Delay};

/// How far ahead of a GPU's free time its next batch is chosen by default, ms.
pub const DEFAULT_AHEAD_MS: Ms = 5.0;

/// How much earlier than its SLO a request is scheduled to finish, ms (Clockwork's `buffer`).
pub const BUFFER_MS: Ms = 5.0;

/// The largest batch (Clockwork's `max_batch` default).
pub const MAX_BATCH: usize = 16;

/// A queued request with its sequence number in its model and its buffered deadline.
#[derive(Debug, Clone, Copy)]
struct Queued {
    req: Request,
    seq: u64,
    dl: Ms,
}

/// One model's queue.
#[derive(Debug, Default)]
struct ModelQueue {
    q: VecDeque<Queued>,
    /// The sequence number the next arrival gets.
    next_seq: u64,
    /// `(gpu, b)` whose cursor reached `next_seq` (every request so far popped at size `b`):
    /// the next arrival gives them a strategy again.
    exhausted: Vec<(GpuId, usize)>,
}

impl ModelQueue {
    fn front_seq(&self) -> u64 {
        self.q.front().map_or(self.next_seq, |x| x.seq)
    }

    fn get(&self, seq: u64) -> Option<&Queued> {
        let i = seq.checked_sub(self.front_seq())?;
        self.q.get(usize::try_from(i).ok()?)
    }
}

/// A heap entry: a strategy's priority, and what it belongs to.
type Entry = Reverse<(At, usize, u64)>;

/// A GPU's queue of strategies: per model and batch size a cursor; per model one heap entry.
#[derive(Debug)]
struct Gpu {
    /// When the work given to it ends.
    free_at: Ms,
    /// `cursor[m][b − 1]`: the first request of model `m` whose size-`b` strategy this GPU has
    /// not popped (requests before the queue's front have left: their strategies are void).
    cursor: Vec<Vec<u64>>,
    /// `(priority, model, version)`, lowest first: per model, at most its lowest strategy's
    /// priority. That rises as cursors and the queue's front advance (an entry found too low
    /// when popped is pushed again with the right one) and falls only when an arrival gives a
    /// size its first strategy again (a lower entry is pushed then, superseding the old).
    heap: BinaryHeap<Entry>,
    /// Per model, the version of its live entry (older entries are skipped), and its priority.
    live: Vec<(u64, Option<Ms>)>,
    /// Test only (`naive`): one entry per strategy, `(priority, model, b, seq)`.
    all: BinaryHeap<Reverse<(At, usize, usize, u64)>>,
}

impl Gpu {
    fn has_work(&self) -> bool {
        !self.heap.is_empty() || !self.all.is_empty()
    }
}

/// Why a strategy failed (it is discarded either way).
#[derive(Debug, PartialEq)]
enum Tried {
    Dispatched,
    /// Its deadline cannot be met: nor can any earlier deadline, at this size or a larger one,
    /// on this GPU, now or later.
    Late,
    Failed,
}

/// The scheduler.
pub struct ClockworkReal {
    profiles: Vec<Profile>,
    /// Per model, its largest batch.
    max_b: Vec<usize>,
    models: Vec<ModelQueue>,
    gpus: Vec<Gpu>,
    delay: Delay,
    ahead_ms: Ms,
    /// The time of the last event.
    now: Ms,
    /// Test only: one heap entry per strategy, popped one by one (the reference for the cursors).
    naive: bool,
}

impl ClockworkReal {
    /// Over `gpus` GPUs, choosing each batch `ahead_ms` before its GPU frees.
    pub fn new(profiles: &[Profile], gpus: usize, delay: Delay, ahead_ms: Ms) -> ClockworkReal {
        let max_b: Vec<usize> = profiles.iter().map(|p| p.max_batch.min(MAX_BATCH)).collect();
        let models = (0..profiles.len()).map(|_| ModelQueue::default()).collect();
        let gpus = (0..gpus)
            .map(|_| Gpu {
                free_at: 0.0,
                cursor: max_b.iter().map(|&n| vec![0; n]).collect(),
                heap: BinaryHeap::new(),
                live: vec![(0, None); profiles.len()],
                all: BinaryHeap::new(),
            })
            .collect();
        ClockworkReal {
            profiles: profiles.to_vec(),
            max_b,
            models,
            gpus,
            delay,
            ahead_ms: ahead_ms.max(0.0),
            now: 0.0,
            naive: false,
        }
    }

    /// The deadline Clockwork schedules a request against.
    fn buffered_deadline(&self, r: &Request) -> Ms {
        let slo = r.deadline - r.arrival;
        r.arrival + (slo - BUFFER_MS).max(self.ahead_ms + BUFFER_MS)
    }

    /// When a batch of `b` of model `m` started on a GPU free at `exec_at` completes.
    fn completion(&self, m: usize, b: usize, exec_at: Ms, now: Ms) -> Ms {
        exec_at.max(now + self.delay.of(b)) + self.profiles[m].latency(b)
    }

    /// GPU `g`'s lowest strategy of model `m`: `(priority, b, seq)`, ties to the smaller `b`.
    fn lowest(&self, g: GpuId, m: usize) -> Option<(Ms, usize, u64)> {
        let mq = &self.models[m];
        let front = mq.front_seq();
        let mut best: Option<(Ms, usize, u64)> = None;
        for (i, &c) in self.gpus[g].cursor[m].iter().enumerate() {
            let c = c.max(front);
            if let Some(x) = mq.get(c) {
                let p = x.dl - self.profiles[m].latency(i + 1);
                if best.is_none_or(|(q, ..)| p < q) {
                    best = Some((p, i + 1, c));
                }
            }
        }
        best
    }

    /// Makes GPU `g`'s entry for model `m` the priority `p` (or none).
    fn set_live(&mut self, g: GpuId, m: usize, p: Option<Ms>) {
        let gpu = &mut self.gpus[g];
        let v = gpu.live[m].0 + 1;
        gpu.live[m] = (v, p);
        if let Some(p) = p {
            gpu.heap.push(Reverse((At(p), m, v)));
        }
    }

    /// Drops the requests at the front of model `m`'s queue while `drop` holds for them.
    fn drop_front_while(&mut self, m: usize, out: &mut Vec<Decision>, drop: impl Fn(&Queued) -> bool) {
        let q = &mut self.models[m].q;
        while let Some(x) = q.front().filter(|x| drop(x)) {
            out.push(Decision::Drop(x.req));
            q.pop_front();
        }
    }

    /// Clockwork's `try_dequeue` of the size-`b` strategy of request `seq` on GPU `g`.
    fn try_strategy(&mut self, g: GpuId, m: usize, b: usize, seq: u64, now: Ms, out: &mut Vec<Decision>) -> Tried {
        let exec_at = self.gpus[g].free_at.max(now);
        let Some(&Queued { mut dl, .. }) = self.models[m].get(seq) else {
            return Tried::Failed;
        };
        let mut completion = self.completion(m, b, exec_at, now);
        if dl <= completion {
            return Tried::Late;
        }
        // Requests that cannot even start in time.
        self.drop_front_while(m, out, |x| x.dl < exec_at);
        let mq = &self.models[m];
        if mq.q.len() < b {
            return Tried::Failed;
        }
        let mut seq = seq;
        let mut available = mq.next_seq - seq;
        if available < b as u64 {
            // Clockwork's fallback: count back from the newest request while its deadline is not
            // after the completion (it rarely finds any).
            let mut n = 0;
            let mut found = None;
            for x in mq.q.iter().rev() {
                if x.dl > completion {
                    break;
                }
                n += 1;
                if n == b {
                    found = Some((x.dl, x.seq));
                    break;
                }
            }
            let Some((d, s)) = found else {
                return Tried::Failed;
            };
            (dl, seq, available) = (d, s, b as u64);
        }
        // Grow to what arrived, if that still meets this strategy's deadline; else give up.
        let candidate = usize::try_from(available).unwrap_or(usize::MAX).min(self.max_b[m]);
        let mut b = b;
        if candidate > b {
            let c = self.completion(m, candidate, exec_at, now);
            if c > dl {
                return Tried::Failed;
            }
            (b, completion) = (candidate, c);
        }
        // Requests ahead of this one that cannot be included.
        self.drop_front_while(m, out, |x| x.seq != seq && x.dl < completion);
        let q = &mut self.models[m].q;
        if q.len() < b {
            return Tried::Failed;
        }
        let requests: Vec<Request> = q.drain(..b).map(|x| x.req).collect();
        let start = exec_at.max(now + self.delay.of(b));
        self.gpus[g].free_at = start + self.profiles[m].latency(b);
        out.push(Decision::Dispatch { gpu: g, model: m, requests, start });
        Tried::Dispatched
    }

    /// Moves GPU `g`'s size-`b` cursor of model `m` to `to` (if that is forward).
    fn advance(&mut self, g: GpuId, m: usize, b: usize, to: u64) {
        let c = &mut self.gpus[g].cursor[m][b - 1];
        let end = self.models[m].next_seq;
        if to > *c {
            if *c < end && to >= end {
                self.models[m].exhausted.push((g, b));
            }
            *c = to;
        }
    }

    /// A strategy of model `m` failed for its deadline on GPU `g`: so does, at every size, every
    /// request whose deadline a batch of that size started when `g` frees would miss — now and
    /// later, as the GPU only frees later. Their strategies are skipped.
    fn skip_late(&mut self, g: GpuId, m: usize, now: Ms) {
        let exec_at = self.gpus[g].free_at.max(now);
        let front = self.models[m].front_seq();
        for b in 1..=self.max_b[m] {
            let completion = self.completion(m, b, exec_at, now);
            let late = self.models[m].q.partition_point(|x| x.dl <= completion) as u64;
            self.advance(g, m, b, front + late);
        }
    }

    /// Runs GPU `g`'s schedule-ahead loop.
    fn run_gpu(&mut self, g: GpuId, now: Ms, out: &mut Vec<Decision>) {
        while self.gpus[g].free_at.max(now) <= now + self.ahead_ms {
            if self.naive {
                let Some(Reverse((_, m, b, seq))) = self.gpus[g].all.pop() else {
                    return;
                };
                if seq >= self.models[m].front_seq() {
                    self.try_strategy(g, m, b, seq, now, out);
                }
                continue;
            }
            let Some(Reverse((At(p), m, v))) = self.gpus[g].heap.pop() else {
                return;
            };
            if self.gpus[g].live[m].0 != v {
                continue; // superseded
            }
            let Some((q, b, seq)) = self.lowest(g, m) else {
                self.set_live(g, m, None);
                continue;
            };
            if q > p {
                self.set_live(g, m, Some(q)); // its requests left: the lowest is later now
                continue;
            }
            match self.try_strategy(g, m, b, seq, now, out) {
                Tried::Late => self.skip_late(g, m, now),
                Tried::Dispatched | Tried::Failed => self.advance(g, m, b, seq + 1),
            }
            let lowest = self.lowest(g, m).map(|(q, ..)| q);
            self.set_live(g, m, lowest);
        }
    }

    fn dispatch(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.now = now;
        for m in 0..self.models.len() {
            self.drop_front_while(m, out, |x| x.dl <= now);
        }
        let mut open: Vec<GpuId> = (0..self.gpus.len())
            .filter(|&g| self.gpus[g].has_work() && self.gpus[g].free_at - self.ahead_ms <= now)
            .collect();
        open.sort_by(|&a, &b| self.gpus[a].free_at.total_cmp(&self.gpus[b].free_at));
        for g in open {
            self.run_gpu(g, now, out);
        }
    }

    /// Gives every GPU the strategies of model `m`'s request `seq` (just queued), where they
    /// lower the GPU's entry for the model.
    fn arrived(&mut self, m: usize, seq: u64, dl: Ms) {
        let exhausted = std::mem::take(&mut self.models[m].exhausted);
        if self.naive {
            for gpu in &mut self.gpus {
                for b in 1..=self.max_b[m] {
                    gpu.all.push(Reverse((At(dl - self.profiles[m].latency(b)), m, b, seq)));
                }
            }
            return;
        }
        let lower = |me: &mut Self, g: GpuId, p: Ms| {
            if me.gpus[g].live[m].1.is_none_or(|q| p < q) {
                me.set_live(g, m, Some(p));
            }
        };
        if self.models[m].q.len() == 1 {
            // The queue was empty: every GPU's cursors are at this request, so its lowest
            // strategy is the same on every GPU.
            if let Some((p, ..)) = (!self.gpus.is_empty()).then(|| self.lowest(0, m)).flatten() {
                for g in 0..self.gpus.len() {
                    lower(self, g, p);
                }
            }
        } else {
            for (g, b) in exhausted {
                lower(self, g, dl - self.profiles[m].latency(b));
            }
        }
    }
}

impl Scheduler for ClockworkReal {
    fn name(&self) -> &'static str {
        "clockwork-real"
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        let m = req.model;
        let dl = self.buffered_deadline(&req);
        let seq = self.models[m].next_seq;
        self.models[m].q.push_back(Queued { req, seq, dl });
        self.models[m].next_seq += 1;
        self.arrived(m, seq, dl);
        self.dispatch(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, _gpu: GpuId, out: &mut Vec<Decision>) {
        self.dispatch(now, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.dispatch(now, out);
    }

    fn next_timer(&self) -> Option<Ms> {
        // The next GPU with strategies to enter its window, and the next queued request to run
        // out of time (so that it is reported when it does).
        let window =
            self.gpus.iter().filter(|g| g.has_work()).map(|g| g.free_at - self.ahead_ms).filter(|&t| t > self.now);
        let expiry = self.models.iter().filter_map(|mq| mq.q.front()).map(|x| x.dl).filter(|&t| t > self.now);
        window.chain(expiry).min_by(f64::total_cmp)
    }

    fn queued(&self) -> usize {
        self.models.iter().map(|mq| mq.q.len()).sum()
    }
}

#[cfg(test)]
mod tests;
