//! Scenario files (TOML, DESIGN.md's format) and running them: one rate, or a search for the
//! goodput (the highest rate at which every model has ≥ 99% of its requests within SLO).
//!
//! ```toml
//! duration_s = 60
//! warmup_s = 5
//! seed = 1
//! gpus = 8
//! delay_ctrl_ms = 0.2      # optional: Symphony's delay(bs) = d_ctrl + d_data·bs
//! delay_data_ms = 0.01
//! [[models]]
//! name = "ResNet50"
//! alpha_ms = 1.053
//! beta_ms = 5.072
//! slo_ms = 25
//! rate_rps = 4000          # or weight = 1 (share of --rate)
//! arrival = "poisson"      # gamma:SHAPE | mmpp:L1,L2,…:DWELL_MS | trace:PATH
//! max_batch = 64           # optional
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::arrival::{Arrival, ArrivalGen};
use crate::metrics::Report;
use crate::profile::Profile;
use crate::scheduler::Scheduler;
use crate::sim::{run, SimConfig};
use crate::time::Delay;

/// One model of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name.
    pub name: String,
    /// α, ms.
    pub alpha_ms: f64,
    /// β, ms.
    pub beta_ms: f64,
    /// SLO, ms.
    pub slo_ms: f64,
    /// Rate, requests/s.
    #[serde(default)]
    pub rate_rps: Option<f64>,
    /// Share of the total rate given with `--rate`.
    #[serde(default)]
    pub weight: Option<f64>,
    /// Arrival process.
    #[serde(default = "poisson")]
    pub arrival: String,
    /// Largest batch.
    #[serde(default = "max_batch")]
    pub max_batch: usize,
}

fn poisson() -> String {
    "poisson".into()
}

fn max_batch() -> usize {
    128
}

/// A scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Simulated seconds.
    pub duration_s: f64,
    /// Seconds not measured at the start.
    #[serde(default)]
    pub warmup_s: f64,
    /// Seed.
    #[serde(default)]
    pub seed: u64,
    /// GPUs.
    pub gpus: usize,
    /// Control delay, ms.
    #[serde(default)]
    pub delay_ctrl_ms: f64,
    /// Data delay per request, ms.
    #[serde(default)]
    pub delay_data_ms: f64,
    /// Nexus: frontends.
    #[serde(default = "frontends")]
    pub nexus_frontends: usize,
    /// Nexus: seconds between re-plans.
    #[serde(default = "epoch")]
    pub nexus_epoch_s: f64,
    /// Charge each scheduler callback its measured wall time × this on the virtual clock, one
    /// dispatcher per part of a partitioned cluster ([`crate::charged`]; not deterministic).
    /// Absent: deciding costs nothing, as before.
    #[serde(default)]
    pub charge_dispatch: Option<f64>,
    /// The models.
    pub models: Vec<ModelSpec>,
}

fn frontends() -> usize {
    4
}

/// Most GPUs a scenario may simulate (the simulator keeps per-GPU state; Nexus plans over all).
pub const MAX_GPUS: usize = 65_536;
/// Most arrivals one simulation may generate (rates × duration): each pending request costs the
/// simulator on the order of 100 bytes, so this bounds its memory to about 2 GB.
pub const MAX_ARRIVALS: f64 = 20e6;

fn epoch() -> f64 {
    10.0
}

/// Why a scenario could not be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// Not valid TOML for a scenario.
    #[error("{path}: {detail}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// Inconsistent values.
    #[error("{0}")]
    Invalid(String),
    /// Unknown scheduler.
    #[error("unknown scheduler {0:?} (have {list}, or partitioned: symphony/L, flex/herd:G:GMAX)", list = crate::scheduler::SCHEDULERS.join(", "))]
    UnknownScheduler(String),
    /// The simulator refused a scheduler's decision (in the message, not a `source()`: a chain prints it once).
    #[error("simulation: {0}")]
    Sim(crate::sim::SimError),
}

impl From<crate::sim::SimError> for ScenarioError {
    fn from(e: crate::sim::SimError) -> Self {
        ScenarioError::Sim(e)
    }
}

impl Scenario {
    /// Reads a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ScenarioError::Parse { path: shown.clone(), detail: e.to_string() })?;
        let mut s: Scenario =
            toml::from_str(&text).map_err(|e| ScenarioError::Parse { path: shown, detail: e.to_string() })?;
        // Trace paths are relative to the scenario file.
        let dir = path.parent().unwrap_or(Path::new("."));
        for m in &mut s.models {
            if let Some(p) = m.arrival.strip_prefix("trace:") {
                if Path::new(p).is_relative() {
                    m.arrival = format!("trace:{}", dir.join(p).display());
                }
            }
        }
        s.check()?;
        Ok(s)
    }

    /// Checks the values.
    pub fn check(&self) -> Result<(), ScenarioError> {
        let bad = |s: String| Err(ScenarioError::Invalid(s));
        let finite = |v: f64| v.is_finite();
        if !(finite(self.duration_s)
            && self.duration_s > 0.0
            && self.warmup_s >= 0.0
            && self.warmup_s < self.duration_s)
        {
            return bad(format!(
                "need duration_s > warmup_s ≥ 0, finite (got {} and {})",
                self.duration_s, self.warmup_s
            ));
        }
        if self.gpus == 0 || self.models.is_empty() {
            return bad("need at least one GPU and one model".into());
        }
        if self.gpus > MAX_GPUS {
            return bad(format!("{} GPUs: at most {MAX_GPUS} can be simulated", self.gpus));
        }
        if !(self.nexus_frontends >= 1 && self.nexus_frontends <= MAX_GPUS) {
            return bad(format!("nexus_frontends must be 1 to {MAX_GPUS}"));
        }
        if !(finite(self.nexus_epoch_s) && self.nexus_epoch_s > 0.0) {
            return bad("nexus_epoch_s must be a positive number of seconds".into());
        }
        if !(finite(self.delay_ctrl_ms) && finite(self.delay_data_ms))
            || self.delay_ctrl_ms < 0.0
            || self.delay_data_ms < 0.0
        {
            return bad("delays must be finite and not negative".into());
        }
        if let Some(c) = self.charge_dispatch {
            if !(finite(c) && c >= 0.0) {
                return bad(format!("charge_dispatch = {c}: must be finite and not negative"));
            }
        }
        // Results are reported by model name: two of one name would read as one.
        for (i, m) in self.models.iter().enumerate() {
            if let Some(first) = self.models[..i].iter().position(|o| o.name == m.name) {
                return bad(format!("model {:?} is named twice (models {first} and {i}): names must differ", m.name));
            }
        }
        for m in &self.models {
            for (what, v) in [("rate_rps", m.rate_rps), ("weight", m.weight)] {
                if let Some(v) = v {
                    if !(finite(v) && v >= 0.0) {
                        return bad(format!("model {}: {what} = {v} (must be finite and not negative)", m.name));
                    }
                }
            }
            self.profile(m)?;
            let a = Arrival::parse(&m.arrival).map_err(|e| ScenarioError::Invalid(format!("model {}: {e}", m.name)))?;
            if m.rate_rps.is_none() && m.weight.is_none() && !matches!(a, Arrival::Periodic { .. }) {
                return bad(format!("model {}: give rate_rps or weight", m.name));
            }
        }
        Ok(())
    }

    fn profile(&self, m: &ModelSpec) -> Result<Profile, ScenarioError> {
        Profile::new(&m.name, m.alpha_ms, m.beta_ms, m.slo_ms, m.max_batch)
            .map_err(|e| ScenarioError::Invalid(e.to_string()))
    }

    /// The profiles, in model order.
    pub fn profiles(&self) -> Result<Vec<Profile>, ScenarioError> {
        self.models.iter().map(|m| self.profile(m)).collect()
    }

    /// The delay model.
    pub fn delay(&self) -> Delay {
        Delay { ctrl_ms: self.delay_ctrl_ms, data_ms: self.delay_data_ms }
    }

    /// Each model's rate: as given, or `total` split by weight (rates given count as weights).
    pub fn rates(&self, total: Option<f64>) -> Vec<f64> {
        let shares: Vec<f64> = self.models.iter().map(|m| m.weight.or(m.rate_rps).unwrap_or(1.0).max(0.0)).collect();
        match total {
            None => self.models.iter().zip(&shares).map(|(m, s)| m.rate_rps.unwrap_or(*s)).collect(),
            Some(t) => {
                let sum: f64 = shares.iter().sum::<f64>().max(1e-12);
                shares.iter().map(|s| t * s / sum).collect()
            }
        }
    }

    /// A fresh scheduler `name` for this scenario at `rates`: one of
    /// [`SCHEDULERS`](crate::SCHEDULERS), or a partitioned cluster (`symphony/L`,
    /// `flex/herd:G:GMAX`; see [`crate::partition`]).
    pub fn scheduler(&self, name: &str, rates: &[f64]) -> Result<Box<dyn Scheduler>, ScenarioError> {
        let p = self.profiles()?;
        if let Some((base, split)) = self.partition(name, &p, rates)? {
            let parted = crate::partition::Partitioned::of_streams(&p, &split, |ps, g, ids| {
                let sub_rates: Vec<f64> = ids.iter().map(|&(m, share)| rates[m] * share).collect();
                self.one_scheduler(base, ps, g, &sub_rates).map(|s| self.charged(s)).map_err(|e| e.to_string())
            })
            .map_err(ScenarioError::Invalid)?;
            return Ok(Box::new(parted));
        }
        self.one_scheduler(name, &p, self.gpus, rates).map(|s| self.charged(s))
    }

    /// `s` as [`Scenario::charge_dispatch`] asks: charged for its computation, or as it is.
    fn charged(&self, s: Box<dyn Scheduler>) -> Box<dyn Scheduler> {
        match self.charge_dispatch {
            Some(scale) => Box::new(crate::charged::Charged::new(s, scale)),
            None => s,
        }
    }

    /// `name`'s partition of `p` at `rates` when it names one: (the parts' scheduler, the split;
    /// see [`crate::partition::streams_by_name`]).
    pub fn partition(
        &self,
        name: &str,
        p: &[Profile],
        rates: &[f64],
    ) -> Result<Option<(&'static str, crate::partition::Split)>, ScenarioError> {
        crate::partition::streams_by_name(name, p, rates, self.gpus)
            .map_err(|why| ScenarioError::Invalid(format!("scheduler {name:?}: {why}")))
    }

    fn one_scheduler(
        &self,
        name: &str,
        p: &[Profile],
        g: usize,
        rates: &[f64],
    ) -> Result<Box<dyn Scheduler>, ScenarioError> {
        let d = self.delay();
        if name == "nexus" {
            return Ok(Box::new(crate::nexus::Nexus::new(
                p,
                g,
                d,
                rates,
                self.nexus_frontends,
                self.nexus_epoch_s * 1000.0,
            )));
        }
        scheduler_by_name(name, p, g, d).ok_or_else(|| ScenarioError::UnknownScheduler(name.to_string()))
    }

    /// Simulates `scheduler` at `total` requests/s (None: the rates in the file).
    pub fn run(&self, scheduler: &str, total: Option<f64>) -> Result<Report, ScenarioError> {
        let rates = self.rates(total);
        let arrivals: f64 = rates.iter().sum::<f64>() * self.duration_s;
        if !(arrivals.is_finite() && arrivals <= MAX_ARRIVALS) {
            return Err(ScenarioError::Invalid(format!(
                "{arrivals:.3e} arrivals (rates × duration_s) exceed the simulator's limit of {MAX_ARRIVALS:.0e} \
                 (about 2 GB of memory): lower the rate or shorten duration_s"
            )));
        }
        let arrivals = self
            .models
            .iter()
            .zip(&rates)
            .enumerate()
            .map(|(i, (m, r))| {
                let kind = Arrival::parse(&m.arrival).map_err(|e| ScenarioError::Invalid(e.to_string()))?;
                Ok(ArrivalGen::new(kind, *r, self.seed.wrapping_mul(1_000_003).wrapping_add(i as u64)))
            })
            .collect::<Result<Vec<_>, ScenarioError>>()?;
        let cfg = SimConfig {
            profiles: self.profiles()?,
            arrivals,
            gpus: self.gpus,
            duration_ms: self.duration_s * 1000.0,
            warmup_ms: self.warmup_s * 1000.0,
        };
        let mut s = self.scheduler(scheduler, &rates)?;
        Ok(run(cfg, s.as_mut())?.report())
    }

    /// Goodput (DESIGN.md): the highest total rate at which every model has ≥ 99% of its
    /// requests within SLO, by bisection on the total rate (relative precision 1%): the rate, the
    /// run at it, and every rate tried.
    ///
    /// The search assumes that passing is monotone in the rate. Near the answer it is not quite
    /// (runs at nearby rates draw different arrivals, so the 99% line is crossed more than
    /// once), and with the dispatchers charged ([`Scenario::charge_dispatch`]) one slow callback
    /// can fail a low rate and send the search far below — [`Goodput::probes`] shows where and on
    /// which model.
    pub fn max_goodput(&self, scheduler: &str) -> Result<Goodput, ScenarioError> {
        let mut probes = Vec::new();
        let mut probe = |rate: f64| -> Result<(bool, Report), ScenarioError> {
            let r = self.run(scheduler, Some(rate))?;
            let p = Probe::of(rate, &r);
            let ok = p.ok;
            probes.push(p);
            Ok((ok, r))
        };
        let start: f64 = self.rates(None).iter().sum::<f64>().max(1.0);
        // The search stays within what one simulation may generate.
        let ceiling = MAX_ARRIVALS / self.duration_s;
        let start = start.min(ceiling);
        let (mut lo, mut hi) = (0.0, start);
        let mut best: Option<(f64, Report)> = None;
        // Grow until it fails.
        loop {
            let (ok, r) = probe(hi)?;
            if !ok {
                break;
            }
            lo = hi;
            best = Some((hi, r));
            if hi >= ceiling {
                break;
            }
            hi = (hi * 2.0).min(ceiling);
        }
        while hi - lo > 0.01 * hi {
            let mid = (lo + hi) / 2.0;
            let (ok, r) = probe(mid)?;
            if ok {
                lo = mid;
                best = Some((mid, r));
            } else {
                hi = mid;
            }
        }
        let (rate_rps, report) = match best {
            Some(b) => b,
            None => (0.0, self.run(scheduler, Some(lo.max(1e-3)))?),
        };
        Ok(Goodput { rate_rps, report, probes })
    }
}

/// What [`Scenario::max_goodput`] found.
#[derive(Debug, Clone)]
pub struct Goodput {
    /// The goodput: the highest total rate found at which every model has ≥ 99% of its
    /// requests within SLO (0 when none passed), requests/s.
    pub rate_rps: f64,
    /// The run at that rate.
    pub report: Report,
    /// Every rate the search tried, in order.
    pub probes: Vec<Probe>,
}

/// One rate the goodput search tried.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    /// Total offered rate, requests/s.
    pub rate_rps: f64,
    /// Whether every model had ≥ 99% of its requests within SLO.
    pub ok: bool,
    /// The model with the smallest fraction of its requests within SLO (what fails first).
    pub worst_model: String,
    /// That model's fraction within SLO.
    pub worst_good_fraction: f64,
}

impl Probe {
    fn of(rate_rps: f64, r: &Report) -> Probe {
        let measured = r.per_model.iter().filter(|m| m.requests > 0);
        let worst = measured.min_by(|a, b| a.good_fraction.total_cmp(&b.good_fraction));
        Probe {
            rate_rps,
            ok: worst.is_none_or(|m| m.good_fraction >= 0.99),
            worst_model: worst.map(|m| m.name.clone()).unwrap_or_default(),
            worst_good_fraction: worst.map_or(1.0, |m| m.good_fraction),
        }
    }
}

/// A fresh scheduler `name` that needs nothing but the profiles, the GPUs and the dispatch
/// delay: `symphony`, `symphony-wc`, `clockwork`, `clockwork-real`, `flex` or `flex-np` (not
/// `nexus`, which plans from the rates). `None` for any other name.
pub fn scheduler_by_name(name: &str, p: &[Profile], g: usize, d: Delay) -> Option<Box<dyn Scheduler>> {
    Some(match name {
        "symphony" => Box::new(crate::symphony::Symphony::new(p, g, d, false)),
        "symphony-wc" => Box::new(crate::symphony::Symphony::new(p, g, d, true)),
        "clockwork" => Box::new(crate::clockwork::Clockwork::new(p, g, d)),
        "clockwork-real" => {
            Box::new(crate::clockwork_real::ClockworkReal::new(p, g, d, crate::clockwork_real::DEFAULT_AHEAD_MS))
        }
        "flex" => Box::new(crate::flex::Flex::new(p, g, d, true)),
        "flex-np" => Box::new(crate::flex::Flex::new(p, g, d, false)),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(gpus: &str, model: &str) -> Result<Scenario, ScenarioError> {
        let text = format!(
            "duration_s = 10.0\ngpus = {gpus}\n[[models]]\nname = \"a\"\nalpha_ms = 5.0\nbeta_ms = 1.0\nslo_ms = 100.0\n{model}\n"
        );
        let s: Scenario = toml::from_str(&text).map_err(|e| ScenarioError::Invalid(e.to_string()))?;
        s.check().map(|_| s)
    }

    #[test]
    fn rates_must_be_finite_and_not_negative() {
        for bad in ["-100.0", "nan", "inf"] {
            let err = scenario("2", &format!("rate_rps = {bad}")).unwrap_err().to_string();
            assert!(err.contains("rate_rps"), "{bad}: {err}");
        }
        assert!(scenario("2", "weight = -1.0").is_err());
        scenario("2", "rate_rps = 100.0").unwrap();
    }

    /// Results are reported by model name, so two models of one name are refused.
    #[test]
    fn a_model_name_given_twice_is_refused() {
        let twice =
            "rate_rps = 1.0\n[[models]]\nname = \"a\"\nalpha_ms = 5.0\nbeta_ms = 1.0\nslo_ms = 100.0\nrate_rps = 1.0";
        let err = scenario("2", twice).unwrap_err().to_string();
        assert!(err.contains(r#"model "a" is named twice (models 0 and 1)"#), "{err}");
    }

    #[test]
    fn sizes_beyond_the_stated_limits_are_refused_before_anything_is_allocated() {
        let err = scenario("2", "rate_rps = 1e12").unwrap().run("symphony", None).unwrap_err().to_string();
        assert!(err.contains("exceed the simulator's limit"), "{err}");
        let err = scenario("2", "rate_rps = 100.0").unwrap().run("symphony", Some(f64::INFINITY)).unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        let err = scenario("100000000", "rate_rps = 1.0").unwrap_err().to_string();
        assert!(err.contains("at most 65536"), "{err}");
    }

    #[test]
    fn the_goodput_search_reports_every_rate_it_tried() {
        let text = "duration_s = 5.0\ngpus = 2\n\
            [[models]]\nname = \"loose\"\nalpha_ms = 1.0\nbeta_ms = 1.0\nslo_ms = 200.0\nrate_rps = 50.0\n\
            [[models]]\nname = \"tight\"\nalpha_ms = 1.0\nbeta_ms = 8.0\nslo_ms = 20.0\nrate_rps = 50.0\n";
        let s: Scenario = toml::from_str(text).unwrap();
        s.check().unwrap();
        let g = s.max_goodput("clockwork").unwrap();
        assert!(g.probes.len() >= 3, "{:?}", g.probes);
        // The answer is the highest rate that passed, within 1% of the lowest that failed.
        let passed = g.probes.iter().filter(|p| p.ok).map(|p| p.rate_rps).fold(0.0, f64::max);
        let failed = g.probes.iter().filter(|p| !p.ok).map(|p| p.rate_rps).fold(f64::INFINITY, f64::min);
        assert_eq!(g.rate_rps, passed);
        assert!(failed > passed && failed - passed <= 0.01 * failed, "{passed} passed, {failed} failed");
        // Each probe names the model furthest from its SLO, and passes exactly when it is ≥ 99%.
        for p in &g.probes {
            assert!(["loose", "tight"].contains(&p.worst_model.as_str()), "{p:?}");
            assert_eq!(p.ok, p.worst_good_fraction >= 0.99, "{p:?}");
        }
        let at = Probe::of(g.rate_rps, &g.report);
        let min = g.report.per_model.iter().map(|m| m.good_fraction).fold(1.0, f64::min);
        assert!(at.ok && at.worst_good_fraction == min, "{at:?}");
        assert_eq!(g.probes.iter().find(|p| p.rate_rps == g.rate_rps), Some(&at));
    }
}
