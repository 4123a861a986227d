//! What a simulation measured.

use super::System;

/// Samples of a latency, for percentiles and CDFs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    sorted: Vec<f64>,
    dirty: bool,
}

impl Histogram {
    /// Adds a sample.
    pub fn push(&mut self, v: f64) {
        self.sorted.push(v);
        self.dirty = true;
    }

    fn sort(&mut self) {
        if self.dirty {
            self.sorted.sort_by(f64::total_cmp);
            self.dirty = false;
        }
    }

    /// The `q`-quantile (nearest rank), 0 when empty.
    pub fn quantile(&mut self, q: f64) -> f64 {
        self.sort();
        if self.sorted.is_empty() {
            return 0.0;
        }
        let i = ((q * self.sorted.len() as f64).ceil() as usize).clamp(1, self.sorted.len()) - 1;
        self.sorted[i]
    }

    /// The mean, 0 when empty.
    pub fn mean(&self) -> f64 {
        if self.sorted.is_empty() {
            0.0
        } else {
            self.sorted.iter().sum::<f64>() / self.sorted.len() as f64
        }
    }

    /// Samples.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The sorted samples (for a CDF).
    pub fn samples(&mut self) -> &[f64] {
        self.sort();
        &self.sorted
    }
}

/// One bin of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TimelinePoint {
    /// End of the bin, seconds.
    pub t_s: f64,
    /// Prompt tokens prefilled per second in the bin.
    pub prefill_tokens_per_s: f64,
    /// Tokens decoded per second in the bin.
    pub decode_tokens_per_s: f64,
    /// Prefill instances serving (loaded) at the bin's end.
    pub prefill_instances: usize,
    /// Decode instances serving at the bin's end.
    pub decode_instances: usize,
    /// Instances loading at the bin's end.
    pub loading: usize,
}

/// The outcome of one simulation (`serve-sim --json` prints its fields).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimReport {
    /// The system.
    pub system: System,
    /// The model profile.
    pub model: String,
    /// Requests served: the trace's, less those refused for the context window
    /// ([`OverContext::Refuse`](super::OverContext)).
    pub requests: usize,
    /// Requests whose prompt and output exceed the model's context window: clipped, refused or
    /// kept whole, as [`over_context_policy`](Self::over_context_policy) says.
    pub over_context: usize,
    /// What became of them.
    pub over_context_policy: super::OverContext,
    /// The load monitor's target utilisation of prefill instances.
    pub prefill_utilisation: f64,
    /// Time to first token, median, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, 99th percentile, ms.
    pub ttft_p99_ms: f64,
    /// Time to first token, mean, ms.
    pub ttft_mean_ms: f64,
    /// The 99th percentile of each request's own prefill time, alone on an idle instance: no
    /// queueing, no batch shared with others, no cooperative speed-up. Without cooperative
    /// execution no system's TTFT p99 is below it (a request's TTFT is at least its own prefill);
    /// cooperation can at most halve a prefill while its partner loads.
    pub ttft_floor_p99_ms: f64,
    /// Time between tokens (every gap after the first token), median, ms.
    pub tbt_p50_ms: f64,
    /// Time between tokens, 99th percentile, ms.
    pub tbt_p99_ms: f64,
    /// Time between tokens, mean, ms.
    pub tbt_mean_ms: f64,
    /// Requests whose TTFT and mean TBT both met the SLOs, as a fraction of the requests that
    /// arrived (a refused one counts as missing them).
    pub slo_attainment: f64,
    /// GPU time held by instances (loading or serving), seconds.
    pub gpu_seconds: f64,
    /// The most GPUs held at once (loading or serving) over a stretch of time. The paper rescales
    /// each trace "such that the peak incoming rate can be handled by all the instances" (§6.1):
    /// with that rescaling the peak is near [`gpus`](Self::gpus).
    pub peak_gpus: usize,
    /// GPUs in the cluster.
    pub gpus: usize,
    /// Host memory used to cache the model, time-averaged, GB.
    pub host_cache_gb_avg: f64,
    /// Host memory used to cache the model, time-averaged, in copies of the model.
    pub host_cache_copies_avg: f64,
    /// Instances started or mutated.
    pub scale_events: usize,
    /// Prefill instances mutated into decode instances.
    pub mutations: usize,
    /// Instances loaded while a paired instance served with them (live scaling).
    pub live_scales: usize,
    /// Mean load time of a new instance, seconds.
    pub load_s_mean: f64,
    /// Loads from a host cache (sllm, allcache) or that missed it (sllm: SSD).
    pub cache_hits: usize,
    /// Loads that went to SSD.
    pub cache_misses: usize,
    /// Simulated time, seconds.
    pub duration_s: f64,
}
