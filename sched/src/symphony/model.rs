//! Symphony's model side (the ModelThread of §4.5 and Appendix C): one model's queue, its batch
//! candidate and its arrival-rate estimate. Nothing here looks at other models or at GPUs beyond
//! the `gpu_free_at` it is given.

use std::collections::VecDeque;

use crate::profile::{best_window, largest_batch, Profile};
use crate::scheduler::{ModelId, Ms, Request};
use crate::time::Delay;

/// A batch candidate: `bs` requests to start at `exec_at`; useless after `invalid_after`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Batch size.
    pub bs: usize,
    /// When it should start executing.
    pub exec_at: Ms,
    /// Latest start at which the batch still meets its earliest deadline.
    pub invalid_after: Ms,
    /// ℓ(bs): how long the batch holds a GPU.
    pub exec_ms: Ms,
}

impl Candidate {
    /// Requests served per GPU millisecond: bs / ℓ(bs).
    pub fn efficiency(&self) -> f64 {
        if self.exec_ms > 0.0 {
            self.bs as f64 / self.exec_ms
        } else {
            f64::INFINITY
        }
    }
}

/// Online estimate of a model's arrival rate: an exponentially weighted mean of the gaps between
/// arrivals (weight 1/16 on the newest gap).
#[derive(Debug, Clone, Default)]
pub struct RateEstimate {
    last: Option<Ms>,
    mean_gap: Option<f64>,
}

impl RateEstimate {
    /// Notes an arrival at `t`.
    pub fn arrival(&mut self, t: Ms) {
        if let Some(l) = self.last {
            let gap = (t - l).max(0.0);
            self.mean_gap = Some(match self.mean_gap {
                Some(m) => m + (gap - m) / 16.0,
                None => gap,
            });
        }
        self.last = Some(t);
    }

    /// Requests per millisecond; `None` until two arrivals were seen.
    pub fn per_ms(&self) -> Option<f64> {
        self.mean_gap.map(|g| if g > 0.0 { 1.0 / g } else { f64::INFINITY })
    }
}

/// One model's scheduling state.
#[derive(Debug, Clone)]
pub struct ModelState {
    /// The model.
    pub id: ModelId,
    /// Its profile.
    pub profile: Profile,
    delay: Delay,
    work_conserving: bool,
    /// Queued requests in deadline order (one SLO per model, so arrival order).
    queue: VecDeque<Request>,
    /// The candidate batch is `queue[start..start + bs]`.
    cand: Option<Candidate>,
    start: usize,
    rate: RateEstimate,
}

impl ModelState {
    /// A model's state; `work_conserving` makes every candidate schedulable at once.
    pub fn new(id: ModelId, profile: Profile, delay: Delay, work_conserving: bool) -> ModelState {
        ModelState {
            id,
            profile,
            delay,
            work_conserving,
            queue: VecDeque::new(),
            cand: None,
            start: 0,
            rate: Default::default(),
        }
    }

    /// Queues a request (the caller then updates the candidate).
    pub fn enqueue(&mut self, req: Request) {
        self.rate.arrival(req.arrival);
        self.queue.push_back(req);
    }

    /// Requests queued.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The current candidate.
    pub fn candidate(&self) -> Option<Candidate> {
        self.cand
    }

    /// When the front request's deadline passes (the model's drop timer).
    pub fn front_deadline(&self) -> Option<Ms> {
        self.queue.front().map(|r| r.deadline)
    }

    /// β·λ: the batch size worth waiting for (§4.3); unbounded while the rate is unknown (so a
    /// model's first request waits for its `sched_at` rather than going out alone at once).
    pub fn beta_lambda(&self) -> f64 {
        self.rate.per_ms().map_or(f64::INFINITY, |l| self.profile.beta_ms * l)
    }

    /// Appendix C's `update_candidate`: drops requests that cannot finish even alone (into
    /// `dropped`), prunes the batch to the largest set of consecutive requests that can still
    /// finish together — among those, the one with the earliest deadlines — and sets
    /// the candidate's `exec_at` — at once when work-conserving or when the batch holds β·λ
    /// requests, otherwise at `dl − ℓ(bs + 1)`, the last moment one more request could join.
    ///
    /// Departures: the pseudo-code assigns `exec_at` twice, the second time unconditionally
    /// (`max(earliest, frontrun_at)`), which would ignore the β·λ rule that §4.3 states; this
    /// follows §4.3. A batch at the model's largest size counts as holding β·λ requests (it
    /// cannot grow). The paper's pruning keeps "a subset of the batch with the earliest
    /// deadlines that can still be scheduled together"; taking that subset always from the head
    /// of the queue lets a backlog of nearly expired requests force batches of one forever (the
    /// simulator showed it at 87% of capacity), so the subset is the largest window that fits,
    /// its earliest-deadline instance; the requests before it stay queued until they fit or
    /// expire.
    pub fn update(&mut self, now: Ms, gpu_free_at: Ms, dropped: &mut Vec<Request>) {
        loop {
            let Some(front) = self.queue.front().copied() else {
                self.cand = None;
                return;
            };
            if largest_batch(&self.profile, self.delay, now, gpu_free_at, front.deadline, 1) == 0 {
                self.queue.pop_front();
                dropped.push(front);
                continue;
            }
            let q = &self.queue;
            let (start, bs) = best_window(&self.profile, self.delay, now, gpu_free_at, |i| q[i].deadline, q.len());
            let p = &self.profile;
            let dl = q[start].deadline;
            self.start = start;
            let earliest = (now + self.delay.of(bs)).max(gpu_free_at);
            let frontrun_at = dl - p.latency(bs + 1);
            // A full batch cannot grow: waiting for β·λ requests beyond the largest batch
            // would only hold it back (β·λ exceeds it at high rates).
            let enough = self.beta_lambda().min(p.max_batch as f64);
            let exec_at =
                if self.work_conserving || bs as f64 >= enough { earliest } else { earliest.max(frontrun_at) };
            self.cand = Some(Candidate { bs, exec_at, invalid_after: dl - p.latency(bs), exec_ms: p.latency(bs) });
            return;
        }
    }

    /// Takes the candidate's requests out of the queue.
    pub fn take_batch(&mut self) -> Vec<Request> {
        let bs = self.cand.take().map_or(0, |c| c.bs);
        let end = (self.start + bs).min(self.queue.len());
        self.queue.drain(self.start.min(end)..end).collect()
    }

    /// The dispatch delay of a batch of `bs`.
    pub fn delay(&self, bs: usize) -> Ms {
        self.delay.of(bs)
    }
}
