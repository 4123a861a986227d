//! A serving simulator for LLMs at cluster scale (BlitzScale, seed `004_…`, §6): emulated
//! instances — a test double for GPUs, with costs from a profile — serving a real trace with
//! prefill/decode disaggregation and an autoscaler, under four ways of loading parameters:
//!
//! - **blitz**: the pool keeps one host copy of the model; new instances are loaded by network
//!   multicast from every GPU that holds the model and the pool copy, planned by the real planner
//!   (`cascade_multicast::planner`, BlitzScale's Algorithm 1); a new prefill instance serves
//!   cooperatively with a running one while it loads (live scaling); decode capacity is added
//!   first by mutating a spare prefill instance into a decode one (no load).
//! - **stop**: blitz's network loading, stop-the-world (no live scaling, no mutation).
//! - **sllm** (ServerlessLLM-like): a host keeps a model in its DRAM cache for 5 minutes after its
//!   last use there; a new instance loads from the cache over PCIe on a hit, from SSD on a miss,
//!   stop-the-world.
//! - **allcache**: every host caches every model; PCIe loads, stop-the-world.
//!
//! A request longer than the model's context window is clipped, refused or kept whole, as
//! [`OverContext`] says (the trace was recorded on models with longer windows than Llama-2's).
//!
//! Deterministic: no clock, no randomness (the trace is the input). See [`Profile`] for the cost
//! model and its sources, `autoscale` for the load monitor's rule, [`SimReport`] for the metrics.
//!
//! **Departures from the paper, stated.** Cooperative execution is modelled by its throughput, not
//! layer by layer: while a new prefill instance has a fraction `f` of its layers, it and its
//! paired old instance process the old one's batches as a two-stage pipeline, so the pair's
//! batches take `1 − min(f, ½)` of the time (Figure 7(d)'s pipeline; the real zigzag schedule is
//! `crate::zigzag` and `crate::serve`). Decode instances are not live-scaled (mutation covers
//! them). KV transfer after prefill is charged at the RDMA rate. Tensor-parallel instances load
//! each GPU's shard as its own multicast.

mod autoscale;
mod context;
mod engine;
mod report;
#[cfg(test)]
mod tests;

pub use autoscale::UTILISATION;
pub use context::OverContext;
pub use report::{Histogram, SimReport, TimelinePoint};

cascade_sched::named_enum! {
    /// How a system loads parameters and whether it scales live (see the module docs); `ALL` is
    /// the report order.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
    #[serde(rename_all = "lowercase")]
    pub enum System("system") {
        /// Network multicast from the pool, live scaling, P→D mutation.
        Blitz = "blitz",
        /// ServerlessLLM-like: host cache with keep-alive, SSD on a miss.
        Sllm = "sllm",
        /// Every host caches every model.
        Allcache = "allcache",
        /// Blitz's network loading, stop-the-world.
        Stop = "stop",
        /// A bound, not a system: every load takes no time and an instance needs no start-up,
        /// under the same load monitor — what an infinitely fast data plane would give. The gap
        /// between a system and it is what loading costs that system; what is left is the
        /// monitor's and the cluster's.
        Instant = "instant",
    }
}

/// A model's serving costs on one instance.
///
/// Sources: Llama-2-7B on one A100-class GPU — prefill from the roofline (14 GFLOP per token at
/// about half of the A100's 312 TFLOP/s dense fp16: 0.09 ms per token) plus a fixed 15 ms;
/// a decode iteration of 15 ms at small batches (dLoRA, seed `002_…`, Llama-7B's measured merged
/// iteration) growing 0.12 ms per running sequence; KV 0.5 MiB per token (2 · 32 layers · 4096 ·
/// fp16). Llama-2-70B on 4 GPUs (tensor parallel, the paper's minimum): 30 ms plus 0.16 ms per
/// prompt token, decode 40 ms plus 0.3 ms per sequence, 140 GB of fp16 parameters, KV 0.31 MiB per token
/// (GQA, 8 KV heads · 128 · 80 layers · 2 · fp16). Both have Llama-2's context window of 4,096
/// tokens (`max_position_embeddings` in their configs), prompt and output together. SLOs are
/// the issue's: 450 ms TTFT / 150 ms TBT (7B), 1250 / 200 ms (70B).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Profile {
    /// Its name on the command line.
    pub name: &'static str,
    /// Parameter bytes of the whole model.
    pub param_bytes: u64,
    /// GPUs per instance (tensor parallelism).
    pub gpus_per_instance: usize,
    /// Fixed cost of a prefill batch, ms.
    pub prefill_base_ms: f64,
    /// Cost per prompt token of a prefill batch, ms.
    pub prefill_per_token_ms: f64,
    /// Fixed cost of a decode iteration, ms.
    pub decode_base_ms: f64,
    /// Cost per running sequence of a decode iteration, ms.
    pub decode_per_seq_ms: f64,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: u64,
    /// KV-cache tokens one instance holds.
    pub kv_capacity_tokens: u64,
    /// The context window: prompt and output tokens of one request together.
    pub context_tokens: u64,
    /// Largest prefill batch, tokens.
    pub max_prefill_tokens: u64,
    /// Largest decode batch, sequences.
    pub max_decode_batch: usize,
    /// TTFT SLO, ms.
    pub ttft_slo_ms: f64,
    /// TBT SLO, ms.
    pub tbt_slo_ms: f64,
}

impl Profile {
    /// Llama-2-7B on one A100-class GPU.
    pub fn llama2_7b() -> Profile {
        Profile {
            name: "llama2-7b",
            param_bytes: 13_476_839_424,
            gpus_per_instance: 1,
            prefill_base_ms: 15.0,
            prefill_per_token_ms: 0.09,
            decode_base_ms: 15.0,
            decode_per_seq_ms: 0.12,
            kv_bytes_per_token: 512 << 10,
            kv_capacity_tokens: 120_000,
            context_tokens: 4096,
            max_prefill_tokens: 4096,
            max_decode_batch: 128,
            ttft_slo_ms: 450.0,
            tbt_slo_ms: 150.0,
        }
    }

    /// Llama-2-70B on four A100-class GPUs.
    pub fn llama2_70b() -> Profile {
        Profile {
            name: "llama2-70b",
            param_bytes: 137_953_296_384,
            gpus_per_instance: 4,
            prefill_base_ms: 30.0,
            prefill_per_token_ms: 0.16,
            decode_base_ms: 40.0,
            decode_per_seq_ms: 0.3,
            kv_bytes_per_token: 320 << 10,
            kv_capacity_tokens: 400_000,
            context_tokens: 4096,
            max_prefill_tokens: 4096,
            max_decode_batch: 128,
            ttft_slo_ms: 1250.0,
            tbt_slo_ms: 200.0,
        }
    }

    /// A profile by name.
    pub fn by_name(name: &str) -> Result<Profile, String> {
        match name {
            "llama2-7b" => Ok(Profile::llama2_7b()),
            "llama2-70b" => Ok(Profile::llama2_70b()),
            _ => Err(format!("unknown model {name:?} (llama2-7b, llama2-70b)")),
        }
    }

    fn prefill_ms(&self, tokens: u64) -> f64 {
        self.prefill_base_ms + self.prefill_per_token_ms * tokens as f64
    }

    fn decode_ms(&self, batch: usize) -> f64 {
        self.decode_base_ms + self.decode_per_seq_ms * batch as f64
    }

    /// Prompt tokens per second one instance prefills at full batches.
    pub fn prefill_capacity(&self) -> f64 {
        self.max_prefill_tokens as f64 / self.prefill_ms(self.max_prefill_tokens) * 1e3
    }

    /// The largest decode batch whose iterations stay within 80% of the TBT SLO.
    pub fn decode_target_batch(&self) -> usize {
        let fit = ((0.8 * self.tbt_slo_ms - self.decode_base_ms) / self.decode_per_seq_ms).floor().max(1.0) as usize;
        fit.min(self.max_decode_batch)
    }
}

/// The cluster's hardware (the paper's Table 1, cluster A, with the 200 Gbit/s RDMA).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Hardware {
    /// Hosts.
    pub hosts: usize,
    /// GPUs per host.
    pub gpus_per_host: usize,
    /// NVLink within a host, Gbit/s.
    pub nvlink_gbps: f64,
    /// RDMA per GPU between hosts, Gbit/s.
    pub rdma_gbps: f64,
    /// Host memory to GPU (PCIe), Gbit/s.
    pub pcie_gbps: f64,
    /// SSD to GPU, Gbit/s per GPU.
    pub ssd_gbps: f64,
    /// Fixed start-up of a new instance (process, CUDA context, graph capture), ms.
    pub startup_ms: f64,
}

impl Default for Hardware {
    fn default() -> Self {
        Hardware {
            hosts: 4,
            gpus_per_host: 8,
            nvlink_gbps: 1600.0,
            rdma_gbps: 200.0,
            pcie_gbps: 128.0,
            ssd_gbps: 10.0,
            startup_ms: 200.0,
        }
    }
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub at_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens to generate (at least 1).
    pub output_tokens: u64,
}

/// Reads an Azure LLM inference trace (`TIMESTAMP,ContextTokens,GeneratedTokens`), its arrivals
/// divided by `rate_scale` (2 = twice the rate), sorted, from 0.
pub fn parse_trace(text: &str, rate_scale: f64) -> Result<Vec<TraceRequest>, String> {
    if !(rate_scale.is_finite() && rate_scale > 0.0) {
        return Err(format!("rate scale {rate_scale} must be positive"));
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.iter().all(|x| x.is_empty()) {
            continue;
        }
        let row = match f.as_slice() {
            [t, p, o, ..] => {
                cascade_sched::arrival::timestamp_s(t).zip(p.parse::<u64>().ok()).zip(o.parse::<u64>().ok())
            }
            _ => None,
        };
        match row {
            Some(((t, p), o)) => {
                out.push(TraceRequest { at_ms: t * 1e3, prompt_tokens: p.max(1), output_tokens: o.max(1) })
            }
            None if i == 0 => continue, // the header
            None => return Err(format!("line {}: {line:?} is not TIMESTAMP,ContextTokens,GeneratedTokens", i + 1)),
        }
    }
    if out.is_empty() {
        return Err("the trace has no requests".into());
    }
    out.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let t0 = out[0].at_ms;
    for r in &mut out {
        r.at_ms = (r.at_ms - t0) / rate_scale;
    }
    Ok(out)
}

/// One simulation's set-up.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimConfig {
    /// The system.
    pub system: System,
    /// The model's costs.
    pub profile: Profile,
    /// The cluster.
    pub hardware: Hardware,
    /// sllm: how long a host keeps the model cached after its last use there, seconds.
    pub keep_alive_s: f64,
    /// How long an instance must be idle before the autoscaler releases it, seconds.
    pub scale_in_idle_s: f64,
    /// Instances loaded at the start: (prefill, decode).
    pub initial: (usize, usize),
    /// Width of the timeline's bins, ms.
    pub timeline_bin_ms: f64,
    /// What becomes of a request longer than the model's context window.
    pub over_context: OverContext,
    /// The load monitor's target utilisation of prefill instances, in (0, 1] (`autoscale`).
    pub prefill_utilisation: f64,
}

impl SimConfig {
    /// The defaults for `system` and `profile`: the paper's cluster A, a 5-minute keep-alive,
    /// release after 30 s idle, one prefill and one decode instance at the start, 1 s bins,
    /// prompts longer than the context window clipped, prefill instances wanted at
    /// [`UTILISATION`].
    pub fn new(system: System, profile: Profile) -> SimConfig {
        SimConfig {
            system,
            profile,
            hardware: Hardware::default(),
            keep_alive_s: 300.0,
            scale_in_idle_s: 30.0,
            initial: (1, 1),
            timeline_bin_ms: 1000.0,
            over_context: OverContext::Clip,
            prefill_utilisation: UTILISATION,
        }
    }
}

/// What [`simulate`] returns: the report, the timeline, and the TTFT and TBT samples (ms).
pub struct SimOutcome {
    /// The figures.
    pub report: SimReport,
    /// Throughput and instances per bin.
    pub timeline: Vec<TimelinePoint>,
    /// Every request's time to first token, ms.
    pub ttft: Histogram,
    /// Every gap between tokens, ms.
    pub tbt: Histogram,
}

/// Serves `trace` under `cfg` to the last token of the last request.
pub fn simulate(cfg: &SimConfig, trace: &[TraceRequest]) -> Result<SimOutcome, String> {
    if trace.is_empty() {
        return Err("an empty trace".into());
    }
    let u = cfg.prefill_utilisation;
    if !(u.is_finite() && u > 0.0 && u <= 1.0) {
        return Err(format!("a prefill utilisation of {u}: it must be in (0, 1]"));
    }
    let (trace, over_context) = context::fit(trace, cfg.profile.context_tokens, cfg.over_context);
    if trace.is_empty() {
        return Err(format!("every request is longer than {}'s context window", cfg.profile.name));
    }
    let cap = cfg.profile.kv_capacity_tokens;
    if let Some((i, r)) = trace.iter().enumerate().find(|(_, r)| r.prompt_tokens + r.output_tokens > cap) {
        return Err(format!(
            "request {i} needs {} KV tokens; an instance of {} holds {cap}",
            r.prompt_tokens + r.output_tokens,
            cfg.profile.name
        ));
    }
    let (report, timeline, ttft, tbt) = engine::Sim::new(cfg, &trace, over_context)?.run();
    Ok(SimOutcome { report, timeline, ttft, tbt })
}
