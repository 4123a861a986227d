//! Symphony's non-work-conserving centralized scheduler (seed paper 001, §4.3 and Appendix C),
//! and `symphony-wc`, the same with a work-conserving schedulability rule.
//!
//! The state is split as §4.5 splits it across threads: [`model::ModelState`] (a ModelThread's:
//! one model's queue, candidate and rate estimate) and [`rank::Rank`] (the RankThread's: GPU
//! availability and candidate timers). [`Symphony`] drives both in one thread for the
//! simulator; the real-time engine runs the same two parts on separate threads.
//!
//! Per model there is one candidate batch, the earliest-deadline prefix of its queue that can
//! still finish in time; its `sched_at = dl(reqs) − ℓ(|reqs| + 1)`. A candidate is schedulable
//! when it holds β·λ requests or when `sched_at` has come (work-conserving: at once). A free GPU
//! goes to the schedulable candidate with the earliest execution time; a candidate that can no
//! longer make its deadline on the GPU it would get is pruned to the prefix that can.

pub mod model;
pub mod rank;

use std::collections::BTreeSet;

use crate::profile::Profile;
use crate::scheduler::{Decision, GpuId, ModelId, Ms, Request, Scheduler};
use crate::time::{At, Delay};
use model::ModelState;
use rank::{Grant, Rank};

/// The scheduler.
pub struct Symphony {
    models: Vec<ModelState>,
    rank: Rank,
    /// Each model's drop timer: its front request's deadline.
    drops: BTreeSet<(At, ModelId)>,
    drop_at: Vec<Option<Ms>>,
    work_conserving: bool,
    dropped: Vec<Request>,
}

impl Symphony {
    /// Symphony over `gpus` GPUs for `profiles` (model i is `profiles[i]`).
    pub fn new(profiles: &[Profile], gpus: usize, delay: Delay, work_conserving: bool) -> Symphony {
        Symphony {
            models: profiles
                .iter()
                .enumerate()
                .map(|(i, p)| ModelState::new(i, p.clone(), delay, work_conserving))
                .collect(),
            rank: Rank::new(gpus, delay, 0.0),
            drops: BTreeSet::new(),
            drop_at: vec![None; profiles.len()],
            work_conserving,
            dropped: Vec::new(),
        }
    }

    fn refresh_drop_timer(&mut self, m: ModelId) {
        if let Some(t) = self.drop_at[m].take() {
            self.drops.remove(&(At(t), m));
        }
        if let Some(t) = self.models[m].front_deadline() {
            self.drop_at[m] = Some(t);
            self.drops.insert((At(t), m));
        }
    }

    /// Updates model `m`'s candidate with no GPU in view and tells the rank.
    fn update(&mut self, now: Ms, m: ModelId, out: &mut Vec<Decision>) {
        self.models[m].update(now, f64::NEG_INFINITY, &mut self.dropped);
        out.extend(self.dropped.drain(..).map(Decision::Drop));
        self.refresh_drop_timer(m);
        self.rank.inform_candidate(m, self.models[m].candidate());
    }

    /// Appendix C's `granted_gpu`.
    fn granted(&mut self, now: Ms, g: Grant, out: &mut Vec<Decision>) {
        let ms = &mut self.models[g.model];
        ms.update(now, g.free_at, &mut self.dropped);
        out.extend(self.dropped.drain(..).map(Decision::Drop));
        let free_at = match ms.candidate() {
            None => now.max(g.free_at),
            Some(c) => {
                let requests = ms.take_batch();
                let end = c.exec_at + ms.profile.latency(requests.len());
                out.push(Decision::Dispatch { gpu: g.gpu, model: g.model, requests, start: c.exec_at });
                end
            }
        };
        self.rank.inform_gpu(g.gpu, free_at);
        self.update(now, g.model, out);
    }

    fn run_timers(&mut self, now: Ms, out: &mut Vec<Decision>) {
        loop {
            if let Some(&(t, m)) = self.drops.first() {
                if t.0 <= now {
                    self.drops.remove(&(t, m));
                    self.drop_at[m] = None;
                    self.update(now, m, out);
                    continue;
                }
            }
            match self.rank.on_timer(now) {
                Some(g) => self.granted(now, g, out),
                None => return,
            }
        }
    }
}

impl Scheduler for Symphony {
    fn name(&self) -> &'static str {
        if self.work_conserving {
            "symphony-wc"
        } else {
            "symphony"
        }
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        self.models[req.model].enqueue(req);
        self.update(now, req.model, out);
        self.run_timers(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, _gpu: GpuId, out: &mut Vec<Decision>) {
        // The rank knows when each GPU frees (it computed it at dispatch).
        self.run_timers(now, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.run_timers(now, out);
    }

    fn next_timer(&self) -> Option<Ms> {
        let d = self.drops.first().map(|(t, _)| t.0);
        match (d, self.rank.next_timer()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn queued(&self) -> usize {
        self.models.iter().map(ModelState::queued).sum()
    }
}
