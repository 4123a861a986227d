//! A Clockwork-like scheduler, as the Symphony and Shepherd papers describe Clockwork's policy:
//! centralized and work-conserving; whenever a GPU is free it takes the queued request with the
//! earliest deadline and runs the largest batch of that request's model that still meets that
//! deadline. Requests that cannot finish even alone are dropped.
//!
//! Departure: Clockwork itself also profiles and admits requests per worker with its own
//! latency predictions; here every GPU runs every model and the profile is exact.
//!
//! Cost: a lower bound on the earliest time a GPU frees is kept (made exact by a scan that
//! found no free GPU; starting a batch only raises the true earliest time), so an arrival while
//! every GPU is busy costs no scan of the GPUs (on real threads at 1,000 GPUs that scan was most
//! of the dispatcher's work under overload), and a light load pays no extra scan per batch. The
//! decisions are the same as scanning every time (tested).

use std::collections::VecDeque;

use crate::profile::{largest_batch, Profile};
use crate::scheduler::{drop_expired, Decision, GpuId, Ms, Request, Scheduler};
use crate::time::Delay;

/// The scheduler.
pub struct Clockwork {
    profiles: Vec<Profile>,
    queues: Vec<VecDeque<Request>>,
    free_at: Vec<Ms>,
    /// At most the earliest of `free_at`.
    next_free: Ms,
    delay: Delay,
    /// Off only in the test that checks the shortcut changes no decision.
    shortcut: bool,
}

impl Clockwork {
    /// Clockwork over `gpus` GPUs.
    pub fn new(profiles: &[Profile], gpus: usize, delay: Delay) -> Clockwork {
        Clockwork {
            profiles: profiles.to_vec(),
            queues: vec![VecDeque::new(); profiles.len()],
            free_at: vec![0.0; gpus],
            next_free: 0.0,
            delay,
            shortcut: true,
        }
    }

    fn dispatch(&mut self, now: Ms, out: &mut Vec<Decision>) {
        loop {
            if self.shortcut && self.next_free > now {
                return;
            }
            // The first free GPU; a scan that finds none has seen every free time.
            let mut earliest = Ms::INFINITY;
            let mut free = None;
            for (g, &t) in self.free_at.iter().enumerate() {
                if t <= now {
                    free = Some(g);
                    break;
                }
                earliest = earliest.min(t);
            }
            let Some(gpu) = free else {
                self.next_free = earliest;
                return;
            };
            let Some((dl, m)) = earliest_deadline(&self.profiles, &mut self.queues, self.delay, now, out) else {
                return;
            };
            let q = &mut self.queues[m];
            let p = &self.profiles[m];
            let b = largest_batch(p, self.delay, now, now, dl, q.len()).max(1);
            let requests: Vec<Request> = q.drain(..b).collect();
            let start = now + self.delay.of(b);
            self.free_at[gpu] = start + p.latency(b);
            out.push(Decision::Dispatch { gpu, model: m, requests, start });
        }
    }
}

/// Drops every queue's fronts that cannot finish even alone, started now, and returns the
/// earliest deadline left at a queue's front and its model (Clockwork's next model).
fn earliest_deadline(
    profiles: &[Profile],
    queues: &mut [VecDeque<Request>],
    delay: Delay,
    now: Ms,
    out: &mut Vec<Decision>,
) -> Option<(Ms, usize)> {
    let mut best: Option<(Ms, usize)> = None;
    for (m, q) in queues.iter_mut().enumerate() {
        drop_expired(&profiles[m], delay, now, q, out);
        if let Some(r) = q.front() {
            if best.is_none_or(|(d, _)| r.deadline < d) {
                best = Some((r.deadline, m));
            }
        }
    }
    best
}

impl Scheduler for Clockwork {
    fn name(&self) -> &'static str {
        "clockwork"
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        self.queues[req.model].push_back(req);
        self.dispatch(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
        // The GPU's free time is known from the dispatch (a batch dispatched at this very
        // instant may already occupy it).
        let _ = gpu;
        self.dispatch(now, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.dispatch(now, out);
    }

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
        /// Skipping the scan while no GPU is free (by the kept earliest free time) makes exactly
        /// the decisions that scanning every time makes.
        #[test]
        fn the_shortcut_makes_the_same_decisions(events in events(3)) {
            let ps = profiles();
            let mut fast = Clockwork::new(&ps, 3, DELAY);
            let mut full = Clockwork::new(&ps, 3, DELAY);
            full.shortcut = false;
            same_decisions(&mut fast, &mut full, &ps, events)?;
        }
    }
}
