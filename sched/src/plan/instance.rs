//! Plan files: what `epoch-plan --scenario FILE` reads (TOML).
//!
//! ```toml
//! seed = 1
//! # Either explicit models (entries with the same name are streams of one model, merged by
//! # summing their rates, as HERD does before solving) …
//! [[models]]
//! name = "ResNet50"
//! rate_rps = 120.0
//! static_mb = 170.0      # weights in GPU memory
//! dynamic_mb = 2798.0    # run-time memory (Symphony's d_i)
//! alpha_ms = 2.05        # ℓ(b) = α·b + β, for HERD's single-GPU goodput T_i
//! beta_ms = 5.378
//! slo_ms = 27.0
//! affinity = 0           # HERD affinity set (default 0)
//! # … or a generated zoo: variants of Symphony's Table 1 models (sched/data/
//! # symphony_1080ti_memory.csv), rates drawn from an exponential law (Appendix A.2).
//! [generate]
//! models = 400
//! mean_rate_rps = 100.0
//!
//! [symphony]
//! sub_clusters = 4
//! r_max_rps = 15000.0    # a dispatcher's capacity (default: unlimited)
//! s_max_mb = 40960.0     # a backend's memory
//! # w = 0.4              # default Σr / Σs
//! # c_max = 2000.0       # disruption budget, with `--previous`; default unlimited
//!
//! [herd]
//! gpus = 200
//! groups = 10
//! group_max = 40
//! gpu_mem_mb = 16384.0
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::herd::{HerdProblem, HerdStream};
use super::symphony::{SymModel, SymphonyProblem};
use crate::arrival::Rng;
use crate::profile::Profile;

/// Symphony Table 1's models with their memory, and their Table 5 profiles.
const ZOO: &str = include_str!("../../data/symphony_1080ti_memory.csv");

/// One model (or one stream of a model) in a plan file.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlanModel {
    /// Model name; entries sharing it are streams of one model.
    pub name: String,
    /// Request rate, requests per second.
    pub rate_rps: f64,
    /// Static memory (weights), MB.
    pub static_mb: f64,
    /// Dynamic (run-time) memory, MB.
    #[serde(default)]
    pub dynamic_mb: f64,
    /// α of ℓ(b) = α·b + β, ms.
    pub alpha_ms: f64,
    /// β, ms.
    pub beta_ms: f64,
    /// Latency SLO, ms.
    pub slo_ms: f64,
    /// HERD affinity set.
    #[serde(default)]
    pub affinity: u32,
}

/// A generated zoo.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generate {
    /// How many models.
    pub models: usize,
    /// Mean of the exponential law the rates are drawn from, requests per second.
    pub mean_rate_rps: f64,
}

/// Symphony's parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SymphonyParams {
    /// l.
    pub sub_clusters: usize,
    /// R_max, requests per second.
    pub r_max_rps: Option<f64>,
    /// S_max, MB.
    pub s_max_mb: f64,
    /// w; default Σr / Σs.
    pub w: Option<f64>,
    /// C_max; default unlimited.
    pub c_max: Option<f64>,
}

/// HERD's parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HerdParams {
    /// N.
    pub gpus: u32,
    /// Groups to form.
    pub groups: usize,
    /// Ḡ.
    pub group_max: u32,
    /// GPU memory for models, MB.
    pub gpu_mem_mb: f64,
}

/// A plan file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Seed of the generated zoo.
    #[serde(default)]
    pub seed: u64,
    /// Explicit models.
    #[serde(default)]
    pub models: Vec<PlanModel>,
    /// A generated zoo instead.
    pub generate: Option<Generate>,
    /// Symphony's parameters.
    pub symphony: Option<SymphonyParams>,
    /// HERD's parameters.
    pub herd: Option<HerdParams>,
}

impl PlanFile {
    /// Reads and parses a plan file.
    pub fn load(path: &Path) -> Result<PlanFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        PlanFile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses a plan file's text.
    pub fn parse(text: &str) -> Result<PlanFile, String> {
        let f: PlanFile = toml::from_str(text).map_err(|e| e.to_string())?;
        match (&f.generate, f.models.is_empty()) {
            (Some(_), false) => return Err("give either [[models]] or [generate], not both".into()),
            (None, true) => return Err("no models: give [[models]] or [generate]".into()),
            _ => {}
        }
        Ok(f)
    }

    /// The model-streams: explicit entries merged by name (rates summed; their other fields
    /// must agree), or the generated zoo.
    pub fn model_streams(&self) -> Result<Vec<PlanModel>, String> {
        if let Some(g) = &self.generate {
            return generate(g, self.seed);
        }
        let mut merged: BTreeMap<&str, PlanModel> = BTreeMap::new();
        let mut order = Vec::new();
        for m in &self.models {
            Profile::new(&m.name, m.alpha_ms, m.beta_ms, m.slo_ms, usize::MAX).map_err(|e| e.to_string())?;
            if !(m.rate_rps.is_finite() && m.rate_rps >= 0.0) {
                return Err(format!("model {:?}: rate_rps = {}", m.name, m.rate_rps));
            }
            match merged.get_mut(m.name.as_str()) {
                None => {
                    order.push(m.name.as_str());
                    merged.insert(&m.name, m.clone());
                }
                Some(prev) => {
                    let same = PlanModel { rate_rps: prev.rate_rps, ..m.clone() };
                    if &same != prev {
                        return Err(format!("streams of model {:?} disagree on its profile or memory", m.name));
                    }
                    prev.rate_rps += m.rate_rps;
                }
            }
        }
        Ok(order.into_iter().filter_map(|n| merged.remove(n)).collect())
    }

    /// Symphony's problem, with the previous epoch's assignment if any.
    pub fn symphony(&self, previous: Option<Vec<usize>>) -> Result<SymphonyProblem, String> {
        let p = self.symphony.as_ref().ok_or("the plan file has no [symphony] table")?;
        let models: Vec<SymModel> = self
            .model_streams()?
            .into_iter()
            .map(|m| SymModel {
                name: m.name,
                rate_rps: m.rate_rps,
                static_mb: m.static_mb,
                dynamic_mb: m.dynamic_mb,
                move_cost: m.static_mb,
            })
            .collect();
        let (r, s): (f64, f64) = models.iter().fold((0.0, 0.0), |(r, s), m| (r + m.rate_rps, s + m.static_mb));
        let problem = SymphonyProblem {
            models,
            sub_clusters: p.sub_clusters,
            r_max_rps: p.r_max_rps.unwrap_or(f64::INFINITY),
            s_max_mb: p.s_max_mb,
            w: p.w.unwrap_or(if s > 0.0 { r / s } else { 1.0 }),
            previous,
            c_max: p.c_max.unwrap_or(f64::INFINITY),
        };
        problem.validate()?;
        Ok(problem)
    }

    /// HERD's problem.
    pub fn herd(&self) -> Result<HerdProblem, String> {
        let p = self.herd.as_ref().ok_or("the plan file has no [herd] table")?;
        let streams = self
            .model_streams()?
            .into_iter()
            .map(|m| {
                let t = single_gpu_goodput(&m)?;
                Ok(HerdStream {
                    gpus_needed: (m.rate_rps / t).max(1e-6),
                    mem_mb: m.static_mb,
                    affinity: m.affinity,
                    name: m.name,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let problem =
            HerdProblem { streams, gpus: p.gpus, groups: p.groups, group_max: p.group_max, gpu_mem_mb: p.gpu_mem_mb };
        problem.validate()?;
        Ok(problem)
    }
}

/// T_i: the most requests per second one GPU serves of a model within its SLO — batches of the
/// largest b with 2·ℓ(b) ≤ SLO (a request may wait for one whole batch before its own starts).
pub fn single_gpu_goodput(m: &PlanModel) -> Result<f64, String> {
    let p = Profile::new(&m.name, m.alpha_ms, m.beta_ms, m.slo_ms, usize::MAX).map_err(|e| e.to_string())?;
    Ok(1e3 / crate::partition::gpu_ms_per_request(&p))
}

fn generate(g: &Generate, seed: u64) -> Result<Vec<PlanModel>, String> {
    if !(g.mean_rate_rps.is_finite() && g.mean_rate_rps > 0.0) {
        return Err(format!("generate.mean_rate_rps = {}: must be > 0", g.mean_rate_rps));
    }
    let zoo = zoo()?;
    let mut rng = Rng::new(seed);
    Ok((0..g.models)
        .map(|i| {
            let base = &zoo[(rng.next_u64() % zoo.len() as u64) as usize];
            PlanModel { name: format!("{}-v{i}", base.name), rate_rps: rng.exp(g.mean_rate_rps), ..base.clone() }
        })
        .collect())
}

/// Symphony Table 1's six models (`sched/data/symphony_1080ti_memory.csv`).
pub fn zoo() -> Result<Vec<PlanModel>, String> {
    let mut lines = ZOO.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().ok_or("empty zoo table")?.split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).ok_or(format!("zoo table lacks {n}"));
    let (name, a, b, slo, s, d) =
        (col("model")?, col("alpha_ms")?, col("beta_ms")?, col("slo_ms")?, col("static_mb")?, col("dynamic_mb")?);
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let num = |c: usize| -> Result<f64, String> {
                f.get(c).and_then(|v| v.parse().ok()).ok_or(format!("zoo row {l:?}: column {c}"))
            };
            Ok(PlanModel {
                name: f.get(name).ok_or("zoo row without a name")?.to_string(),
                rate_rps: 0.0,
                static_mb: num(s)?,
                dynamic_mb: num(d)?,
                alpha_ms: num(a)?,
                beta_ms: num(b)?,
                slo_ms: num(slo)?,
                affinity: 0,
            })
        })
        .collect()
}
