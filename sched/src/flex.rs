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

use std::collections::VecDeque;

use crate::profile::{best_window, largest_batch, Profile};
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
        }
    }

    fn enqueue(&mut self, req: Request) {
        let q = &mut self.queues[req.model];
        // Arrivals come in deadline order per model; re-queued requests are put in place.
        let at = q.partition_point(|r| r.deadline <= req.deadline);
        q.insert(at, req);
    }

    /// BATCHGEN: the largest feasible batch across the queues — (model, first index, size) —
    /// ties to the earliest deadline. A queue's largest feasible batch is its largest window of
    /// consecutive requests that finish by their earliest deadline (see `best_window`).
    fn batchgen(&mut self, now: Ms, out: &mut Vec<Decision>) -> Option<(ModelId, usize, usize)> {
        let mut best: Option<(usize, Ms, ModelId, usize)> = None;
        for (m, q) in self.queues.iter_mut().enumerate() {
            let p = &self.profiles[m];
            drop_expired(p, self.delay, now, q, out);
            if q.is_empty() {
                continue;
            }
            let (i, b) = best_window(p, self.delay, now, now, |k| q[k].deadline, q.len());
            let dl = q[i].deadline;
            let better = match best {
                None => true,
                Some((bb, d, _, _)) => b > bb || (b == bb && dl < d),
            };
            if b > 0 && better {
                best = Some((b, dl, m, i));
            }
        }
        best.map(|(b, _, m, i)| (m, i, b))
    }

    fn execute(&mut self, now: Ms, gpu: GpuId, (m, i, b): (ModelId, usize, usize), out: &mut Vec<Decision>) {
        let requests: Vec<Request> = self.queues[m].drain(i..i + b).collect();
        let start = now + self.delay.of(b);
        let end = start + self.profiles[m].latency(b);
        self.running[gpu] = Some(Running { requests: requests.clone(), end });
        out.push(Decision::Dispatch { gpu, model: m, requests, start });
    }

    /// Lines 11–19 of Algorithm 1, after an arrival (or a preemption's re-queued requests).
    /// BATCHGEN does not depend on the GPU (they are alike), so it is recomputed only after the
    /// queues change.
    fn offer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        let mut cand = self.batchgen(now, out);
        let mut gpu = 0;
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
                        continue;
                    }
                }
                Some(_) => {}
            }
            gpu += 1;
        }
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
