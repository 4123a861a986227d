//! Symphony's global side (the RankThread of §4.5 and Appendix C): GPU availability, every
//! model's candidate timer, and the choice of which schedulable candidate a GPU goes to.

use std::collections::{BTreeMap, BTreeSet};

use super::model::Candidate;
use crate::scheduler::{GpuId, ModelId, Ms};
use crate::time::{At, Delay};

/// A GPU granted to a model: it is free at `free_at`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// The model.
    pub model: ModelId,
    /// The GPU.
    pub gpu: GpuId,
    /// When the GPU is free.
    pub free_at: Ms,
}

/// The rank state.
#[derive(Debug, Clone)]
pub struct Rank {
    delay: Delay,
    /// When each GPU is free; +∞ while granted to a model that has not answered yet.
    gpu_free_at: Vec<Ms>,
    /// GPUs ordered by free time.
    by_free: BTreeSet<(At, GpuId)>,
    /// Each model's timer: its candidate becomes schedulable at `exec_at − delay(bs)`.
    model_timer: BTreeMap<ModelId, (Ms, Candidate)>,
    timers: BTreeSet<(At, ModelId)>,
    /// Schedulable candidates waiting for a GPU.
    waiting: BTreeMap<ModelId, Candidate>,
    gpu_timer: Option<(Ms, GpuId)>,
}

impl Rank {
    /// `gpus` GPUs, all free at `now`.
    pub fn new(gpus: usize, delay: Delay, now: Ms) -> Rank {
        Rank {
            delay,
            gpu_free_at: vec![now; gpus],
            by_free: (0..gpus).map(|g| (At(now), g)).collect(),
            model_timer: BTreeMap::new(),
            timers: BTreeSet::new(),
            waiting: BTreeMap::new(),
            gpu_timer: None,
        }
    }

    fn earliest_gpu(&self) -> Option<(GpuId, Ms)> {
        self.by_free.first().map(|(t, g)| (*g, t.0))
    }

    fn set_free(&mut self, gpu: GpuId, free_at: Ms) {
        self.by_free.remove(&(At(self.gpu_free_at[gpu]), gpu));
        self.gpu_free_at[gpu] = free_at;
        self.by_free.insert((At(free_at), gpu));
    }

    /// `inform_candidate`: the model's candidate changed (`None`: it has none).
    pub fn inform_candidate(&mut self, m: ModelId, c: Option<Candidate>) {
        self.waiting.remove(&m);
        if let Some((t, _)) = self.model_timer.remove(&m) {
            self.timers.remove(&(At(t), m));
        }
        if let Some(c) = c {
            let t = c.exec_at - self.delay.of(c.bs);
            self.model_timer.insert(m, (t, c));
            self.timers.insert((At(t), m));
        }
        self.set_gpu_timer();
    }

    /// `inform_gpu`: the GPU is free at `free_at`.
    pub fn inform_gpu(&mut self, gpu: GpuId, free_at: Ms) {
        self.set_free(gpu, free_at);
        self.set_gpu_timer();
    }

    fn set_gpu_timer(&mut self) {
        self.gpu_timer = None;
        let Some((gpu, free_at)) = self.earliest_gpu() else { return };
        if !free_at.is_finite() {
            return;
        }
        // The waiting candidate with the longest dispatch delay must be told first.
        if let Some(bs) = self.waiting.values().map(|c| c.bs).max() {
            self.gpu_timer = Some((free_at - self.delay.of(bs), gpu));
        }
    }

    /// The next time the rank needs [`on_timer`](Self::on_timer).
    pub fn next_timer(&self) -> Option<Ms> {
        let m = self.timers.first().map(|(t, _)| t.0);
        let g = self.gpu_timer.map(|(t, _)| t);
        match (m, g) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the timers due at `now`; returns the first GPU it grants (the caller answers with
    /// [`inform_gpu`](Self::inform_gpu) and [`inform_candidate`](Self::inform_candidate) before
    /// calling again).
    pub fn on_timer(&mut self, now: Ms) -> Option<Grant> {
        loop {
            let m = self.timers.first().copied().filter(|(t, _)| t.0 <= now);
            let g = self.gpu_timer.filter(|(t, _)| *t <= now);
            match (m, g) {
                (Some((tm, m)), g) if g.is_none_or(|(tg, _)| tm.0 <= tg) => {
                    self.timers.remove(&(tm, m));
                    let Some((_, c)) = self.model_timer.remove(&m) else { continue };
                    if let Some(grant) = self.on_model_timer(m, c) {
                        return Some(grant);
                    }
                }
                (_, Some((_, gpu))) => {
                    self.gpu_timer = None;
                    if let Some(grant) = self.on_gpu_timer(gpu) {
                        return Some(grant);
                    }
                }
                _ => return None,
            }
        }
    }

    fn on_model_timer(&mut self, m: ModelId, c: Candidate) -> Option<Grant> {
        let (gpu, free_at) = self.earliest_gpu()?;
        if free_at <= c.exec_at {
            self.set_free(gpu, f64::INFINITY);
            self.set_gpu_timer();
            Some(Grant { model: m, gpu, free_at })
        } else {
            self.waiting.insert(m, c);
            self.set_gpu_timer();
            None
        }
    }

    fn on_gpu_timer(&mut self, gpu: GpuId) -> Option<Grant> {
        let free_at = self.gpu_free_at[gpu];
        self.waiting.retain(|_, c| free_at <= c.invalid_after);
        let pick = pick(&self.waiting, free_at);
        let grant = pick.map(|m| {
            self.waiting.remove(&m);
            self.set_free(gpu, f64::INFINITY);
            Grant { model: m, gpu, free_at }
        });
        self.set_gpu_timer();
        grant
    }
}

/// Which waiting candidate a GPU free at `free_at` goes to.
///
/// The paper's RankThread takes the earliest `exec_at` (Appendix C, `get_by_earliest_exec_at`).
/// Under overload every waiting candidate is already due — its `exec_at` has passed — and the
/// earliest is merely the one that has waited longest, however few requests it serves per GPU
/// millisecond: in the overloaded 64-GPU mixed scenario that put batches of one of models with
/// β = 10 ms ahead of full batches of cheap ones. Departure: among the candidates already due
/// at `free_at`, the one serving the most requests per GPU millisecond (bs / ℓ(bs)) wins, ties
/// to the earliest `exec_at`; when none is due yet, the earliest `exec_at`, as the paper does.
/// Below capacity at most one candidate is usually waiting and the rule changes nothing.
fn pick(waiting: &BTreeMap<ModelId, Candidate>, free_at: Ms) -> Option<ModelId> {
    let due = waiting
        .iter()
        .filter(|(_, c)| c.exec_at <= free_at)
        .max_by(|a, b| a.1.efficiency().total_cmp(&b.1.efficiency()).then(b.1.exec_at.total_cmp(&a.1.exec_at)));
    due.or_else(|| waiting.iter().min_by(|a, b| a.1.exec_at.total_cmp(&b.1.exec_at))).map(|(m, _)| *m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(bs: usize, exec_at: Ms, exec_ms: Ms) -> Candidate {
        Candidate { bs, exec_at, invalid_after: exec_at + 100.0, exec_ms }
    }

    #[test]
    fn a_free_gpu_goes_to_the_most_efficient_due_candidate() {
        // Model 0 has waited longest with a batch of one at 10.6 ms; model 1 is due with 30
        // requests at 12 ms.
        let mut w = BTreeMap::new();
        w.insert(0, cand(1, 1.0, 10.6));
        w.insert(1, cand(30, 4.0, 12.0));
        assert_eq!(pick(&w, 5.0), Some(1));
        // Before model 1 is due, the earliest exec_at, as the paper does.
        assert_eq!(pick(&w, 2.0), Some(0));
        // Equally efficient: the earliest exec_at.
        w.insert(1, cand(2, 4.0, 21.2));
        assert_eq!(pick(&w, 5.0), Some(0));
        assert_eq!(pick(&BTreeMap::new(), 5.0), None);
    }
}
