//! `lora-sim` scenarios (TOML) and the requests they generate.
//!
//! ```toml
//! seed = 1
//! duration_s = 120        # arrivals during this long
//! rate_rps = 6.0          # Poisson
//! adapters = 8
//! skewness = 8            # see below
//! replicas = 1
//! cost = "paper-7b"       # or "cpu-smollm2", or a [cost_model] table with every field
//! [lengths]               # ShareGPT-like, log-normal (optional)
//! input_mean = 161
//! output_mean = 338
//! [batch]                 # BatchConfig (optional): max_batch, alpha0, t_starve, …
//! max_batch = 32
//! [cluster]               # ClusterConfig (optional, for replicas > 1)
//! dispatch = "dlora"      # rr | proactive | dlora
//! ```
//!
//! **Skewness, as the paper defines it (§7.1), on a stated stand-in for its trace.** The paper
//! sorts the Azure Functions 2019/2021 traces' functions by invocation count and maps them to
//! adapters round-robin in blocks of `skewness` functions: the larger the block, the larger the
//! share of the most popular adapters. Those traces are not available offline here, so function
//! popularity is a Zipf law over `functions` functions (exponent `zipf_s`, 1.0 by default — a
//! departure, stated); the mapping is the paper's. Lengths follow ShareGPT's means as vLLM's paper
//! reports them (161 prompt and 338 output tokens), log-normal with `sigma`, scaled by `scale`
//! (Figure 11(b)'s ratio) and clamped to `max_tokens`.
//!
//! **Popularity that moves (optional `[drift]`), a second stated stand-in.** The public artifact's
//! Figure 11 runs (`ae_scripts/fig11a.sh`, `vllm/workload_generator/trace.py`) replay six hours of
//! the 2021 trace as six phases of equal request counts, each adapter's rate in a phase its
//! functions' share of that hour: about 20 s of replay per trace hour at its rates, so adapter
//! popularity shifts every ~20 s. A static Zipf law has no such shifts, and shifts are what a
//! placement made once cannot follow. Without the trace, `[drift]` draws each function's weight
//! anew every `phase_s` seconds as its Zipf weight times a log-normal factor
//! `exp(σ·z − σ²/2)` (mean 1, `z` standard normal, independent per function and phase, from the
//! seed): `sigma = 0` is the static law; larger `sigma` moves more of the popularity each phase.
//! How far the real trace's hourly shares move is not known here, so README reports several
//! `sigma`. The placement, which the paper makes from the long-term pattern (§5.1), is given
//! the mean of the phases' shares.
//!
//! ```toml
//! [drift]
//! phase_s = 20.0
//! sigma = 1.0
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::batcher::BatchConfig;
use super::dispatch::ClusterConfig;
use super::{AdapterId, CostModel};
use crate::arrival::Rng;

/// Request lengths.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Lengths {
    /// Mean prompt tokens.
    pub input_mean: f64,
    /// Mean output tokens.
    pub output_mean: f64,
    /// σ of the log-normal.
    pub sigma: f64,
    /// Multiplies both lengths.
    pub scale: f64,
    /// Longest prompt or output.
    pub max_tokens: u32,
}

impl Default for Lengths {
    fn default() -> Lengths {
        Lengths { input_mean: 161.0, output_mean: 338.0, sigma: 0.8, scale: 1.0, max_tokens: 2048 }
    }
}

/// Adapter popularity redrawn every phase (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drift {
    /// Length of one phase, s ([`Drift::DEFAULT_PHASE_S`] unless given).
    #[serde(default = "default_phase_s")]
    pub phase_s: f64,
    /// σ of each function's log-normal popularity factor, drawn anew every phase.
    pub sigma: f64,
}

impl Drift {
    /// The phase length when none is given: about what the artifact's runs replay per trace hour.
    pub const DEFAULT_PHASE_S: f64 = 20.0;
}

/// A `lora-sim` scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraScenario {
    /// Seed of every random draw.
    #[serde(default = "one")]
    pub seed: u64,
    /// Arrivals happen during this long, s.
    pub duration_s: f64,
    /// Poisson arrival rate, requests per second.
    pub rate_rps: f64,
    /// Adapters of the base model.
    pub adapters: u32,
    /// Functions per round-robin block (the paper's skewness).
    pub skewness: u32,
    /// Functions of the synthetic trace.
    #[serde(default = "functions")]
    pub functions: u32,
    /// Zipf exponent of function popularity: finite and ≥ 0 (0: every function equally popular).
    #[serde(default = "one_f")]
    pub zipf_s: f64,
    /// Replicas (GPUs) serving the base model.
    #[serde(default = "one_usize")]
    pub replicas: usize,
    /// A named cost profile.
    #[serde(default = "paper")]
    pub cost: String,
    /// Or every cost given (wins over `cost`).
    #[serde(default)]
    pub cost_model: Option<CostModel>,
    /// Popularity that moves during the run (absent: the static law).
    #[serde(default)]
    pub drift: Option<Drift>,
    /// Request lengths.
    #[serde(default)]
    pub lengths: Lengths,
    /// Batching parameters.
    #[serde(default)]
    pub batch: BatchConfig,
    /// Dispatch and migration across replicas.
    #[serde(default)]
    pub cluster: ClusterConfig,
}

fn one() -> u64 {
    1
}
fn one_f() -> f64 {
    1.0
}
fn one_usize() -> usize {
    1
}
fn functions() -> u32 {
    1024
}
fn default_phase_s() -> f64 {
    Drift::DEFAULT_PHASE_S
}
fn paper() -> String {
    "paper-7b".into()
}

/// One request of a scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRequest {
    /// Its number, in arrival order.
    pub id: u64,
    /// Its adapter.
    pub adapter: AdapterId,
    /// Arrival, ms.
    pub arrival_ms: f64,
    /// Prompt tokens.
    pub input: u32,
    /// Output tokens.
    pub output: u32,
}

impl LoraScenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<LoraScenario, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let s: LoraScenario = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        s.validate().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(s)
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.duration_s > 0.0 && self.duration_s.is_finite() && self.rate_rps > 0.0 && self.rate_rps.is_finite()) {
            return Err("duration_s and rate_rps must be > 0".into());
        }
        // The requests are drawn up front, into one vector, and each one simulated: a rate or a
        // duration without bound took memory until none was left (`lora-sim --rate 1e9` on a
        // 300 s scenario: 3·10¹¹ requests, some 10 TB).
        let arrivals = self.rate_rps * self.duration_s;
        if arrivals > crate::scenario::MAX_ARRIVALS {
            return Err(format!(
                "{arrivals:.3e} arrivals (rate_rps × duration_s) exceed the simulator's limit of {:.0e} \
                 (about 2 GB of memory): lower the rate or shorten duration_s",
                crate::scenario::MAX_ARRIVALS
            ));
        }
        if self.adapters == 0 || self.skewness == 0 || self.functions == 0 || self.replicas == 0 {
            return Err("adapters, skewness, functions and replicas must be ≥ 1".into());
        }
        if let Some(d) = &self.drift {
            if !(d.phase_s > 0.0 && d.phase_s.is_finite() && d.sigma >= 0.0 && d.sigma.is_finite()) {
                return Err(format!("drift: need phase_s > 0 and sigma ≥ 0, got {} and {}", d.phase_s, d.sigma));
            }
        }
        if !(self.zipf_s >= 0.0 && self.zipf_s.is_finite()) {
            // NaN made every weight NaN (all requests on one adapter, silently); ∞ did the same.
            return Err(format!(
                "zipf_s must be finite and ≥ 0 (0: every function equally popular), got {}",
                self.zipf_s
            ));
        }
        let l = &self.lengths;
        let finite = [l.input_mean, l.output_mean, l.sigma, l.scale].iter().all(|x| x.is_finite());
        if !(finite
            && l.input_mean >= 1.0
            && l.output_mean >= 1.0
            && l.sigma >= 0.0
            && l.scale > 0.0
            && l.max_tokens >= 1)
        {
            // An infinite scale or mean made every request max_tokens long, silently.
            return Err("lengths: need finite means ≥ 1, sigma ≥ 0, scale > 0, and max_tokens ≥ 1".into());
        }
        self.cost_model()?.validate()?;
        self.batch.validate()?;
        self.cluster.validate()
    }

    /// The cost model in force.
    pub fn cost_model(&self) -> Result<CostModel, String> {
        match &self.cost_model {
            Some(c) => Ok(c.clone()),
            None => CostModel::by_name(&self.cost),
        }
    }

    /// Each adapter's share of the requests: functions ranked by Zipf popularity, mapped to
    /// adapters in blocks of `skewness`; with `[drift]`, the mean of the phases' shares.
    pub fn adapter_shares(&self) -> Vec<f64> {
        let phases = self.phase_shares();
        let n = phases.len() as f64;
        (0..self.adapters as usize).map(|a| phases.iter().map(|p| p[a]).sum::<f64>() / n).collect()
    }

    /// The phases of the run: one without `[drift]`, else one per `phase_s` of `duration_s`.
    pub fn phase_count(&self) -> usize {
        match &self.drift {
            Some(d) => ((self.duration_s / d.phase_s).ceil() as usize).max(1),
            None => 1,
        }
    }

    /// Each phase's adapter shares (one phase without `[drift]`).
    pub fn phase_shares(&self) -> Vec<Vec<f64>> {
        let zipf: Vec<f64> = (1..=self.functions).map(|r| 1.0 / (r as f64).powf(self.zipf_s)).collect();
        let Some(d) = &self.drift else {
            return vec![self.shares_of(&zipf)];
        };
        (0..self.phase_count())
            .map(|p| {
                // Its own generator per phase, so the arrivals' draws are those of the static law.
                let mut rng = Rng::new(self.seed ^ 0xd21f_7a5e ^ (p as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let moved: Vec<f64> =
                    zipf.iter().map(|w| w * (d.sigma * rng.normal() - d.sigma * d.sigma / 2.0).exp()).collect();
                self.shares_of(&moved)
            })
            .collect()
    }

    /// Function weights (rank order) mapped to adapters in blocks of `skewness`, normalised.
    fn shares_of(&self, weights: &[f64]) -> Vec<f64> {
        let mut share = vec![0.0; self.adapters as usize];
        let total: f64 = weights.iter().sum();
        for (f, w) in weights.iter().enumerate() {
            share[(f as u32 / self.skewness % self.adapters) as usize] += w / total;
        }
        share
    }

    /// The requests, in arrival order (deterministic from `seed`).
    pub fn requests(&self) -> Vec<LoraRequest> {
        let mut rng = Rng::new(self.seed);
        let cdfs: Vec<Vec<f64>> = self
            .phase_shares()
            .iter()
            .map(|shares| {
                let mut acc = 0.0;
                shares
                    .iter()
                    .map(|s| {
                        acc += s;
                        acc
                    })
                    .collect()
            })
            .collect();
        let phase_ms = self.drift.as_ref().map_or(f64::INFINITY, |d| d.phase_s * 1000.0);
        let l = &self.lengths;
        let draw = |rng: &mut Rng, mean: f64| {
            let mu = (mean * l.scale).ln() - l.sigma * l.sigma / 2.0;
            ((mu + l.sigma * rng.normal()).exp().round() as u32).clamp(1, l.max_tokens)
        };
        let mut out = Vec::new();
        let mut t = 0.0;
        let end = self.duration_s * 1000.0;
        loop {
            t += rng.exp(1000.0 / self.rate_rps);
            if t >= end {
                break;
            }
            let cdf = &cdfs[((t / phase_ms) as usize).min(cdfs.len() - 1)];
            let acc = cdf.last().copied().unwrap_or(1.0);
            let u = rng.unit() * acc;
            let adapter = cdf.iter().position(|&c| u <= c).unwrap_or(cdf.len() - 1) as AdapterId;
            let input = draw(&mut rng, l.input_mean);
            let output = draw(&mut rng, l.output_mean);
            out.push(LoraRequest { id: out.len() as u64, adapter, arrival_ms: t, input, output });
        }
        out
    }
}
