//! Shepherd's FLEX (seed paper 003, §5.2, Algorithm 1) and `flex-np`, its non-preemptive variant.
//!
//! Each model has a queue ordered by deadline. When a GPU completes a batch, it runs BATCHGEN:
//! the largest feasible batch across all queues (a queue's largest feasible batch is its
//! largest window of consecutive requests that meets its earliest deadline). When a request arrives, each GPU in turn gets the new
//! BATCHGEN if it is idle, or — FLEX only — if that batch is at least λ = 3.03 times the size of
//! the batch it runs, which is preempted; its requests that can still meet their deadlines are
//! queued again as new arrivals, the others dropped.
//!
//! Departures: preemption is immediate (Shepherd stops at the model's next exit point, a few per
//! cent of the batch's time, §6); requests that can no longer finish even alone are dropped when
//! a BATCHGEN meets them at the head of their queue.
//!
//! Cost: BATCHGEN looks at every queue, and a queue's best window depends only on its contents
//! and the time. Each queue's answer is therefore kept until the queue changes or the clock
//! moves, and so is BATCHGEN's answer, updated from the changed queues alone while the best
//! queue is not among them; a request joining its queue's back grows the kept window in place
//! (`grow_window`: one deadline read unless it grows). A burst of arrivals read at one instant
//! then costs O(1) windows each, not every queue's (without it, a dispatcher that fell behind
//! did more work per request the further it fell behind, and collapsed). Likewise a summary of
//! the running batches (whether a GPU may be idle, a lower bound on the earliest end and on the
//! smallest size) is kept, widened in O(1) as batches start and end and made exact by the scan
//! that found no GPU, so an arrival that no GPU would take (every GPU busy, no batch small
//! enough to preempt) costs no scan of the GPUs, and a light load pays no extra scan per batch.
//! The decisions are the same as recomputing every time (tested).

use std::collections::VecDeque;

use crate::profile::{best_window, grow_window, largest_batch, Profile};
use crate::scheduler::{drop_expired, Decision, GpuId, ModelId, Ms, Request, Scheduler};
use crate::time::Delay;

/// Shepherd's preemption threshold (Theorem 5.2).
pub const LAMBDA: f64 = 3.03;

#[derive(Debug, Clone)]
struct Running {
    requests: Vec<Request>,
    end: Ms,
}

/// The scheduler.
pub struct Flex {
    profiles: Vec<Profile>,
    queues: Vec<VecDeque<Request>>,
    running: Vec<Option<Running>>,
    delay: Delay,
    preempt: bool,
    /// Per queue: the time its best window was computed at, that window (first, size) and
    /// its first request's deadline (kept here: reading it from a long queue is a cache miss);
    /// `None` once the queue changed.
    windows: Vec<Option<Window>>,
    /// The last BATCHGEN's time and answer, and the queues whose windows changed since.
    best: Option<(Ms, Option<Candidate>)>,
    changed: Vec<ModelId>,
    /// The running batches' summary, never narrower than the truth (see [`Busy`]); `None`
    /// before the first scan.
    busy: Option<Busy>,
    /// Off only in the test that checks the caches and the shortcut change no decision.
    cache: bool,
}

/// A queue's best window at a time.
#[derive(Debug, Clone, Copy)]
struct Window {
    at: Ms,
    first: usize,
    size: usize,
    deadline: Ms,
}

/// A queue's best window as BATCHGEN compares them.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    size: usize,
    deadline: Ms,
    model: ModelId,
    first: usize,
}

impl Candidate {
    /// The better of two: the larger batch, then the earlier deadline, then the lower model
    /// (the first met in a pass over the queues in order).
    fn better(a: Option<Candidate>, b: Option<Candidate>) -> Option<Candidate> {
        match (a, b) {
            (Some(x), Some(y)) => {
                let y_wins = y.size > x.size
                    || (y.size == x.size
                        && (y.deadline < x.deadline || (y.deadline == x.deadline && y.model < x.model)));
                Some(if y_wins { y } else { x })
            }
            (x, None) => x,
            (None, y) => y,
        }
    }
}

/// Every GPU's batch, summarised on the safe side: `any_idle` is true if a GPU may have no
/// batch, `first_end` and `smallest` are at most the earliest end and the smallest size.
#[derive(Debug, Clone, Copy)]
struct Busy {
    any_idle: bool,
    first_end: Ms,
    smallest: usize,
}

impl Busy {
    /// The summary of no GPU.
    const NONE: Busy = Busy { any_idle: false, first_end: Ms::INFINITY, smallest: usize::MAX };

    /// Counts one more GPU, running `r`.
    fn add(&mut self, r: Option<&Running>) {
        match r {
            None => self.any_idle = true,
            Some(r) => {
                self.first_end = self.first_end.min(r.end);
                self.smallest = self.smallest.min(r.requests.len());
            }
        }
    }
}

impl Flex {
    /// FLEX (with `preempt`) or FLEX-NP over `gpus` GPUs.
    pub fn new(profiles: &[Profile], gpus: usize, delay: Delay, preempt: bool) -> Flex {
        Flex {
            profiles: profiles.to_vec(),
            queues: vec![VecDeque::new(); profiles.len()],
            running: vec![None; gpus],
            delay,
            preempt,
            windows: vec![None; profiles.len()],
            best: None,
            changed: Vec::new(),
            busy: None,
            cache: true,
        }
    }

    fn enqueue(&mut self, req: Request) {
        let m = req.model;
        let q = &mut self.queues[m];
        // Arrivals come in deadline order per model, so they go to the back without a search
        // (a search of a long queue costs a cache miss per step); re-queued requests are put in
        // place.
        if q.back().is_none_or(|r| r.deadline <= req.deadline) {
            q.push_back(req);
            // A request joining the back can only grow the kept window (at the time it was
            // computed), by one, and so only improve BATCHGEN's kept answer at that time.
            if let Some(w) = self.windows[m].filter(|_| self.cache) {
                let p = &self.profiles[m];
                let fits = |k: usize| largest_batch(p, self.delay, w.at, w.at, q[k].deadline, usize::MAX);
                let (first, size) = grow_window(fits, p.max_batch, q.len(), (w.first, w.size));
                if size != w.size {
                    let grown = Window { at: w.at, first, size, deadline: q[first].deadline };
                    self.windows[m] = Some(grown);
                    let cand = Candidate { size, deadline: grown.deadline, model: m, first };
                    match &mut self.best {
                        Some((at, best)) if *at == w.at => *best = Candidate::better(*best, Some(cand)),
                        _ => self.changed.push(m),
                    }
                }
            }
        } else {
            let at = q.partition_point(|r| r.deadline <= req.deadline);
            q.insert(at, req);
            self.changed(m);
        }
    }

    /// BATCHGEN: the largest feasible batch across the queues — (model, first index, size) —
    /// ties to the earliest deadline. A queue's largest feasible batch is its largest window of
    /// consecutive requests that finish by their earliest deadline (see `best_window`).
    fn batchgen(&mut self, now: Ms, out: &mut Vec<Decision>) -> Option<(ModelId, usize, usize)> {
        let mut changed = std::mem::take(&mut self.changed);
        changed.sort_unstable();
        changed.dedup();
        let best = match self.best {
            // Since the last full pass at this instant only the changed queues' windows moved,
            // and the best one then is not among them: it is still at least every other.
            Some((at, best))
                if self.cache && at == now && best.is_none_or(|c| changed.binary_search(&c.model).is_err()) =>
            {
                changed.iter().fold(best, |best, &m| Candidate::better(best, self.window(m, now, out)))
            }
            _ => (0..self.queues.len()).fold(None, |best, m| Candidate::better(best, self.window(m, now, out))),
        };
        changed.clear();
        self.changed = changed;
        self.best = Some((now, best));
        best.map(|c| (c.model, c.first, c.size))
    }

    /// Queue `m`'s best window at `now`, as a candidate (`None`: not even one request fits),
    /// recomputed only if the queue changed or the clock moved since it was kept.
    fn window(&mut self, m: ModelId, now: Ms, out: &mut Vec<Decision>) -> Option<Candidate> {
        let w = match self.windows[m] {
            Some(w) if self.cache && w.at == now => w,
            _ => {
                let (p, q) = (&self.profiles[m], &mut self.queues[m]);
                drop_expired(p, self.delay, now, q, out);
                let (first, size) = best_window(p, self.delay, now, now, |k| q[k].deadline, q.len());
                let deadline = q.get(first).map_or(Ms::INFINITY, |r| r.deadline);
                let w = Window { at: now, first, size, deadline };
                self.windows[m] = Some(w);
                w
            }
        };
        (w.size > 0).then_some(Candidate { size: w.size, deadline: w.deadline, model: m, first: w.first })
    }

    /// Forgets queue `m`'s kept window.
    fn changed(&mut self, m: ModelId) {
        self.windows[m] = None;
        self.changed.push(m);
    }

    fn execute(&mut self, now: Ms, gpu: GpuId, (m, i, b): (ModelId, usize, usize), out: &mut Vec<Decision>) {
        self.changed(m);
        let requests: Vec<Request> = self.queues[m].drain(i..i + b).collect();
        let start = now + self.delay.of(b);
        let end = start + self.profiles[m].latency(b);
        self.running[gpu] = Some(Running { requests: requests.clone(), end });
        if let Some(busy) = &mut self.busy {
            busy.add(self.running[gpu].as_ref());
        }
        out.push(Decision::Dispatch { gpu, model: m, requests, start });
    }

    /// Lines 11–19 of Algorithm 1, after an arrival (or a preemption's re-queued requests).
    /// BATCHGEN does not depend on the GPU (they are alike), so it is recomputed only after the
    /// queues change.
    fn offer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        let mut cand = self.batchgen(now, out);
        if let Some(c) = cand.filter(|_| self.cache) {
            if !self.some_gpu_takes(now, c.2) {
                return;
            }
        }
        let mut gpu = 0;
        // The GPUs already passed, after their turn: exact if the scan ends with a batch left.
        let mut passed = Busy::NONE;
        while gpu < self.running.len() {
            let Some(c) = cand else { return };
            let current = self.running[gpu].as_ref().filter(|r| r.end > now).map(|r| r.requests.len());
            match current {
                None => {
                    self.execute(now, gpu, c, out);
                    cand = self.batchgen(now, out);
                }
                Some(n) if self.preempt && c.2 as f64 >= LAMBDA * n as f64 => {
                    let old = self.running[gpu].take().map(|r| r.requests).unwrap_or_default();
                    out.push(Decision::Preempt { gpu });
                    self.execute(now, gpu, c, out);
                    // Treat the preempted requests as new arrivals: those that can still make it.
                    let mut requeued = false;
                    for r in old {
                        if largest_batch(&self.profiles[r.model], self.delay, now, now, r.deadline, 1) == 1 {
                            self.enqueue(r);
                            requeued = true;
                        } else {
                            out.push(Decision::Drop(r));
                        }
                    }
                    cand = self.batchgen(now, out);
                    if requeued {
                        gpu = 0;
                        passed = Busy::NONE;
                        continue;
                    }
                }
                Some(_) => {}
            }
            passed.add(self.running[gpu].as_ref());
            gpu += 1;
        }
        if cand.is_some() {
            // The scan ended with a batch no GPU took, and has seen every GPU as it is now.
            self.busy = Some(passed);
        }
    }

    /// Whether a GPU would take a batch of `size` at `now`: one is idle, or (FLEX) runs a batch
    /// small enough to preempt. False means the scan of the GPUs in [`Flex::offer`] would do
    /// nothing.
    fn some_gpu_takes(&mut self, now: Ms, size: usize) -> bool {
        let busy = match self.busy {
            Some(b) => b,
            None => {
                let mut b = Busy::NONE;
                self.running.iter().for_each(|r| b.add(r.as_ref()));
                self.busy = Some(b);
                b
            }
        };
        busy.any_idle || busy.first_end <= now || (self.preempt && size as f64 >= LAMBDA * busy.smallest as f64)
    }
}

impl Scheduler for Flex {
    fn name(&self) -> &'static str {
        if self.preempt {
            "flex"
        } else {
            "flex-np"
        }
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        self.enqueue(req);
        self.offer(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
        if self.running[gpu].as_ref().is_some_and(|r| r.end <= now) {
            self.running[gpu] = None;
            if let Some(busy) = &mut self.busy {
                busy.any_idle = true;
            }
        }
        if self.running[gpu].is_none() {
            if let Some(c) = self.batchgen(now, out) {
                self.execute(now, gpu, c, out);
            }
        }
    }

    fn on_timer(&mut self, _now: Ms, _out: &mut Vec<Decision>) {}

    fn next_timer(&self) -> Option<Ms> {
        None
    }

    fn queued(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::scheduler::testing::{events, profiles, same_decisions, DELAY};

    proptest! {
        /// Keeping each queue's best window, BATCHGEN's answer and the GPU summary makes
        /// exactly the decisions that recomputing everything at every BATCHGEN and scanning
        /// every GPU makes.
        #[test]
        fn cached_windows_make_the_same_decisions(events in events(4), preempt in any::<bool>()) {
            let ps = profiles();
            let mut cached = Flex::new(&ps, 4, DELAY, preempt);
            let mut fresh = Flex::new(&ps, 4, DELAY, preempt);
            fresh.cache = false;
            same_decisions(&mut cached, &mut fresh, &ps, events)?;
        }
    }
}
