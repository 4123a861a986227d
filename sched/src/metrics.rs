//! What a run measured: goodput, bad rate, GPU idle fraction, batch sizes, latency and queueing
//! delay percentiles per model, and every request accounted for.

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::profile::Profile;
use crate::scheduler::{ModelId, Ms, Request};

/// The measurement window: requests arriving in `[from, to)`, GPU time inside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Start, ms.
    pub from: Ms,
    /// End, ms.
    pub to: Ms,
}

impl Window {
    fn contains(&self, t: Ms) -> bool {
        t >= self.from && t < self.to
    }

    fn overlap(&self, a: Ms, b: Ms) -> Ms {
        (b.min(self.to) - a.max(self.from)).max(0.0)
    }

    fn seconds(&self) -> f64 {
        (self.to - self.from).max(1e-9) / 1000.0
    }
}

fn hist() -> Histogram<u64> {
    // Microseconds up to an hour, 3 significant digits: valid bounds, so creation cannot fail.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds are valid")
}

struct ModelStats {
    name: String,
    arrived: u64,
    good: u64,
    late: u64,
    dropped: u64,
    batches: u64,
    batched: u64,
    latency: Histogram<u64>,
    queueing: Histogram<u64>,
}

/// Running totals of a simulated (or real-time) run.
pub struct Metrics {
    window: Window,
    gpus: usize,
    models: Vec<ModelStats>,
    busy_ms: f64,
    wasted_ms: f64,
    preemptions: u64,
    batch_sizes: Vec<u64>,
    arrivals: u64,
    completed: u64,
    dropped: u64,
    unfinished: u64,
}

/// One model's results.
#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    /// Model name.
    pub name: String,
    /// Requests measured.
    pub requests: u64,
    /// Requests within SLO per second.
    pub goodput_rps: f64,
    /// Fraction of its requests within SLO.
    pub good_fraction: f64,
    /// Completed after their deadline.
    pub late: u64,
    /// Dropped (or never run).
    pub dropped: u64,
    /// 99th percentile latency of completed requests, ms.
    pub p99_ms: f64,
    /// Queueing delay (arrival to batch start) percentiles, ms.
    pub queue_p50_ms: f64,
    /// 99th percentile queueing delay, ms.
    pub queue_p99_ms: f64,
    /// Mean batch size.
    pub mean_batch: f64,
}

/// A run's results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Offered load in the window, requests/s.
    pub offered_rps: f64,
    /// Requests within SLO per second.
    pub goodput_rps: f64,
    /// Fraction of measured requests not within SLO (late or dropped).
    pub bad_rate: f64,
    /// Fraction of GPU time in the window spent not executing.
    pub gpu_idle_fraction: f64,
    /// Mean batch size.
    pub mean_batch: f64,
    /// Batches of each size (index = size).
    pub batch_histogram: Vec<u64>,
    /// Preempted batches.
    pub preemptions: u64,
    /// GPU milliseconds thrown away by preemption.
    pub wasted_gpu_ms: f64,
    /// Requests unaccounted for (must be 0).
    pub lost: u64,
    /// Per model.
    pub per_model: Vec<ModelReport>,
}

impl Metrics {
    /// Empty totals.
    pub fn new(profiles: &[Profile], gpus: usize, window: Window) -> Metrics {
        Metrics {
            window,
            gpus,
            models: profiles
                .iter()
                .map(|p| ModelStats {
                    name: p.name.clone(),
                    arrived: 0,
                    good: 0,
                    late: 0,
                    dropped: 0,
                    batches: 0,
                    batched: 0,
                    latency: hist(),
                    queueing: hist(),
                })
                .collect(),
            busy_ms: 0.0,
            wasted_ms: 0.0,
            preemptions: 0,
            batch_sizes: Vec::new(),
            arrivals: 0,
            completed: 0,
            dropped: 0,
            unfinished: 0,
        }
    }

    /// A request arrived.
    pub fn arrived(&mut self, r: &Request) {
        self.arrivals += 1;
        if self.window.contains(r.arrival) {
            self.models[r.model].arrived += 1;
        }
    }

    /// A batch ran from `start` to `end`.
    pub fn batch_done(&mut self, model: ModelId, start: Ms, end: Ms, reqs: &[Request]) {
        self.busy_ms += self.window.overlap(start, end);
        if self.window.contains(start) {
            let m = &mut self.models[model];
            m.batches += 1;
            m.batched += reqs.len() as u64;
            if self.batch_sizes.len() <= reqs.len() {
                self.batch_sizes.resize(reqs.len() + 1, 0);
            }
            self.batch_sizes[reqs.len()] += 1;
        }
        for r in reqs {
            self.completed += 1;
            if !self.window.contains(r.arrival) {
                continue;
            }
            let m = &mut self.models[r.model];
            if end <= r.deadline + 1e-9 {
                m.good += 1;
            } else {
                m.late += 1;
            }
            let _ = m.latency.record(((end - r.arrival) * 1000.0).max(1.0) as u64);
            let _ = m.queueing.record(((start - r.arrival) * 1000.0).max(1.0) as u64);
        }
    }

    /// A request was dropped.
    pub fn dropped(&mut self, r: &Request) {
        self.dropped += 1;
        if self.window.contains(r.arrival) {
            self.models[r.model].dropped += 1;
        }
    }

    /// A batch started at `start` was preempted at `now`.
    pub fn preempted(&mut self, start: Ms, now: Ms) {
        self.preemptions += 1;
        let used = self.window.overlap(start, now);
        self.busy_ms += used;
        self.wasted_ms += used;
    }

    /// The run ended with `queued` requests still held by the scheduler.
    pub fn finish(&mut self, queued: u64) {
        self.unfinished = queued;
    }

    /// Requests within SLO, measured, per model.
    pub fn good_fractions(&self) -> Vec<f64> {
        self.models.iter().map(|m| if m.arrived == 0 { 1.0 } else { m.good as f64 / m.arrived as f64 }).collect()
    }

    /// The results.
    pub fn report(&self) -> Report {
        let secs = self.window.seconds();
        let requests: u64 = self.models.iter().map(|m| m.arrived).sum();
        let good: u64 = self.models.iter().map(|m| m.good).sum();
        let batches: u64 = self.models.iter().map(|m| m.batches).sum();
        let batched: u64 = self.models.iter().map(|m| m.batched).sum();
        let ms = |h: &Histogram<u64>, q: f64| if h.is_empty() { 0.0 } else { h.value_at_quantile(q) as f64 / 1000.0 };
        Report {
            offered_rps: requests as f64 / secs,
            goodput_rps: good as f64 / secs,
            bad_rate: if requests == 0 { 0.0 } else { 1.0 - good as f64 / requests as f64 },
            // Busy time is a sum of many float overlaps: a GPU busy all the window can come out
            // a few ulps over it, which printed as "idle -0.000".
            gpu_idle_fraction: (1.0
                - self.busy_ms / (self.gpus as f64 * (self.window.to - self.window.from).max(1e-9)))
            .max(0.0),
            mean_batch: if batches == 0 { 0.0 } else { batched as f64 / batches as f64 },
            batch_histogram: self.batch_sizes.clone(),
            preemptions: self.preemptions,
            wasted_gpu_ms: self.wasted_ms,
            lost: self.arrivals.saturating_sub(self.completed + self.dropped + self.unfinished),
            per_model: self
                .models
                .iter()
                .map(|m| ModelReport {
                    name: m.name.clone(),
                    requests: m.arrived,
                    goodput_rps: m.good as f64 / secs,
                    good_fraction: if m.arrived == 0 { 1.0 } else { m.good as f64 / m.arrived as f64 },
                    late: m.late,
                    dropped: m.arrived.saturating_sub(m.good + m.late),
                    p99_ms: ms(&m.latency, 0.99),
                    queue_p50_ms: ms(&m.queueing, 0.5),
                    queue_p99_ms: ms(&m.queueing, 0.99),
                    mean_batch: if m.batches == 0 { 0.0 } else { m.batched as f64 / m.batches as f64 },
                })
                .collect(),
        }
    }
}
