//! A cluster split by an epoch plan ([`crate::plan`]): each part (Symphony's sub-cluster,
//! Shepherd's serving group) has its own GPUs, its own models and its own scheduler — one
//! dispatcher per part, as Symphony §4.7 and Shepherd §3 describe — and no part sees another's
//! requests or GPUs.
//!
//! [`Partitioned`] is itself a [`Scheduler`], so the simulator and the real-time engine drive a
//! partitioned cluster exactly as they drive one scheduler: it routes each request to its
//! model's part and each GPU event to the GPU's part, renumbering models and GPUs both ways.
//!
//! Scheduler names (`goodput --scheduler`, [`crate::Scenario::scheduler`]):
//! * `symphony/L` — Symphony's partitioning ([`crate::plan::symphony`]) of the scenario's models
//!   into L sub-clusters by request rate (scenario files carry no memory sizes, so ΔS is 0 and
//!   S_max unlimited), the GPUs shared among the sub-clusters as HERD sizes its groups
//!   (water-filling the worst burst tolerance, [`HerdProblem::sizes_for`]), each running
//!   `symphony`;
//! * `flex/herd:G:GMAX` — HERD ([`crate::plan::herd`]) into at most G groups of at most GMAX GPUs,
//!   each running `flex` on the GPUs HERD gives it.
//!
//! The plan used is the planner's *greedy* plan: the MILP's answer depends on how far the
//! solver gets within its time budget, which would make a simulation irreproducible, and for
//! HERD the greedy plan balances the groups' loads. HERD's sorted runs
//! ([`HerdProblem::heuristic`]) reach a far higher minimum burst tolerance, but with it
//! `flex/herd:4:16` on `scale_64gpus.toml` served 6,040 r/s against greedy's 9,040 (README,
//! "Epoch planning").

use crate::plan::herd::{HerdProblem, HerdStream};
use crate::plan::symphony::{SymModel, SymphonyProblem};
use crate::profile::Profile;
use crate::scheduler::{Decision, GpuId, ModelId, Ms, Request, Scheduler};

/// Several schedulers, each over its own models and GPUs.
pub struct Partitioned {
    parts: Vec<Box<dyn Scheduler>>,
    /// Global model → (part, its index there).
    model_at: Vec<(usize, ModelId)>,
    /// Per part: its models' global ids.
    models_of: Vec<Vec<ModelId>>,
    /// Global GPU → (part, its index there).
    gpu_at: Vec<(usize, GpuId)>,
    /// Per part: its first GPU's global id (its GPUs are consecutive).
    gpu_base: Vec<GpuId>,
    scratch: Vec<Decision>,
}

impl Partitioned {
    /// Splits `profiles` by `assign` (a part per model) and the GPUs by `gpus` (per part, laid
    /// out consecutively), building each part's scheduler with `make(its profiles, its GPUs,
    /// its models' global ids)`, whose errors are returned. Parts with no models get no scheduler and must get no GPU.
    pub fn new(
        profiles: &[Profile],
        assign: &[usize],
        gpus: &[usize],
        mut make: impl FnMut(&[Profile], usize, &[ModelId]) -> Result<Box<dyn Scheduler>, String>,
    ) -> Result<Partitioned, String> {
        if assign.len() != profiles.len() {
            return Err(format!("{} parts for {} models", assign.len(), profiles.len()));
        }
        if let Some(&bad) = assign.iter().find(|&&p| p >= gpus.len()) {
            return Err(format!("part {bad} of {}", gpus.len()));
        }
        let mut out = Partitioned {
            parts: Vec::new(),
            model_at: vec![(0, 0); profiles.len()],
            models_of: Vec::new(),
            gpu_at: Vec::new(),
            gpu_base: Vec::new(),
            scratch: Vec::new(),
        };
        for (p, &n) in gpus.iter().enumerate() {
            let models: Vec<ModelId> = (0..profiles.len()).filter(|&m| assign[m] == p).collect();
            match (models.is_empty(), n) {
                (true, 0) => continue,
                (true, _) => return Err(format!("part {p} has {n} GPUs and no model")),
                (false, 0) => return Err(format!("part {p} has {} models and no GPU", models.len())),
                (false, _) => {}
            }
            let k = out.parts.len();
            for (local, &m) in models.iter().enumerate() {
                out.model_at[m] = (k, local);
            }
            out.gpu_base.push(out.gpu_at.len());
            out.gpu_at.extend((0..n).map(|g| (k, g)));
            let ps: Vec<Profile> = models.iter().map(|&m| profiles[m].clone()).collect();
            out.parts.push(make(&ps, n, &models)?);
            out.models_of.push(models);
        }
        Ok(out)
    }

    /// How many parts run a scheduler.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    fn to_global(&self, part: usize, d: Decision) -> Decision {
        let model = |m: ModelId| self.models_of[part][m];
        let req = |r: Request| Request { model: model(r.model), ..r };
        match d {
            Decision::Dispatch { gpu, model: m, requests, start } => Decision::Dispatch {
                gpu: self.gpu_base[part] + gpu,
                model: model(m),
                requests: requests.into_iter().map(req).collect(),
                start,
            },
            Decision::Drop(r) => Decision::Drop(req(r)),
            Decision::Preempt { gpu } => Decision::Preempt { gpu: self.gpu_base[part] + gpu },
        }
    }

    fn flush(&mut self, part: usize, out: &mut Vec<Decision>) {
        let ds = std::mem::take(&mut self.scratch);
        out.extend(ds.into_iter().map(|d| self.to_global(part, d)));
    }
}

impl Scheduler for Partitioned {
    fn name(&self) -> &'static str {
        "partitioned"
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        let (part, local) = self.model_at[req.model];
        self.parts[part].on_arrival(now, Request { model: local, ..req }, &mut self.scratch);
        self.flush(part, out);
    }

    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
        let (part, local) = self.gpu_at[gpu];
        self.parts[part].on_gpu_free(now, local, &mut self.scratch);
        self.flush(part, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        for part in 0..self.parts.len() {
            if self.parts[part].next_timer().is_some_and(|t| t <= now) {
                self.parts[part].on_timer(now, &mut self.scratch);
                self.flush(part, out);
            }
        }
    }

    fn next_timer(&self) -> Option<Ms> {
        self.parts.iter().filter_map(|p| p.next_timer()).min_by(f64::total_cmp)
    }

    fn queued(&self) -> usize {
        self.parts.iter().map(|p| p.queued()).sum()
    }
}

/// GPU milliseconds per request of a model at the largest batch that keeps 2·ℓ(b) within its
/// SLO (what a saturated, well-batching GPU spends on each request).
pub fn gpu_ms_per_request(p: &Profile) -> f64 {
    let b = p.max_batch_within(p.slo_ms / 2.0).max(1);
    p.latency(b) / b as f64
}

/// Symphony's partition of a scenario's models into `sub_clusters` by rate, and the GPUs per
/// sub-cluster (module docs). Returns (sub-cluster per model, GPUs per sub-cluster).
pub fn symphony_split(
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
    sub_clusters: usize,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let problem = SymphonyProblem {
        models: profiles
            .iter()
            .zip(rates)
            .map(|(p, &r)| SymModel {
                name: p.name.clone(),
                rate_rps: r,
                static_mb: 0.0,
                dynamic_mb: 0.0,
                move_cost: 0.0,
            })
            .collect(),
        sub_clusters,
        r_max_rps: f64::INFINITY,
        s_max_mb: f64::INFINITY,
        w: 0.0,
        previous: None,
        c_max: f64::INFINITY,
    };
    problem.validate()?;
    let assign = problem.greedy().ok_or("Symphony's greedy partition found no room")?;
    // GPUs as HERD sizes its groups: each sub-cluster's worst burst tolerance as high as it goes.
    let sizes = streams(profiles, rates, gpus, sub_clusters, u32::try_from(gpus).unwrap_or(u32::MAX))?
        .sizes_for(&assign)
        .ok_or_else(|| format!("{sub_clusters} sub-clusters with models for {gpus} GPUs"))?;
    Ok((assign, sizes.into_iter().map(|s| s as usize).collect()))
}

/// The scenario's models as HERD model-streams (no memory limit, one affinity set).
fn streams(
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
    groups: usize,
    group_max: u32,
) -> Result<HerdProblem, String> {
    let problem = HerdProblem {
        streams: profiles
            .iter()
            .zip(rates)
            .map(|(p, &r)| HerdStream {
                name: p.name.clone(),
                gpus_needed: (r * gpu_ms_per_request(p) / 1e3).max(1e-6),
                mem_mb: 0.0,
                affinity: 0,
            })
            .collect(),
        gpus: u32::try_from(gpus).map_err(|_| format!("{gpus} GPUs"))?,
        groups,
        group_max,
        gpu_mem_mb: 0.0,
    };
    problem.validate()?;
    Ok(problem)
}

/// HERD's groups for a scenario's models: at most `groups` groups of at most `group_max` GPUs,
/// no memory limit (scenario files carry no sizes; Shepherd's evaluation fits every model in
/// GPU memory), one affinity set (as its evaluation does). Returns (group per model, GPUs per
/// group).
pub fn herd_split(
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
    groups: usize,
    group_max: u32,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let problem = streams(profiles, rates, gpus, groups, group_max)?;
    let (assign, sizes) = problem.greedy().ok_or("HERD's greedy grouping found no plan")?;
    Ok((assign, sizes.into_iter().map(|s| s as usize).collect()))
}

/// Each part's models and GPUs, from a part per model (`assign`) and the GPUs per part: what
/// the real-time engine's [`run_sub_clusters`](crate::realtime::run_sub_clusters) and
/// [`run_parts`](crate::realtime::run_parts) take.
pub fn parts(assign: &[usize], gpus: &[usize]) -> Vec<(Vec<ModelId>, usize)> {
    gpus.iter().enumerate().map(|(j, &g)| ((0..assign.len()).filter(|&m| assign[m] == j).collect(), g)).collect()
}

/// A partitioned cluster named `symphony/L` or `flex/herd:G:GMAX`: (the parts' scheduler, (part
/// per model, GPUs per part)) of `profiles` at `rates` on `gpus` GPUs; `None` for another name.
#[allow(clippy::type_complexity)]
pub fn split_by_name(
    name: &str,
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
) -> Result<Option<(&'static str, (Vec<usize>, Vec<usize>))>, String> {
    if let Some(l) = name.strip_prefix("symphony/") {
        let l: usize = l.parse().map_err(|_| "symphony/L wants a number of sub-clusters".to_string())?;
        return Ok(Some(("symphony", symphony_split(profiles, rates, gpus, l)?)));
    }
    if let Some(spec) = name.strip_prefix("flex/herd:") {
        let (g, gmax) = spec.split_once(':').ok_or("flex/herd:G:GMAX")?;
        let g: usize = g.parse().map_err(|_| "G is not a number".to_string())?;
        let gmax: u32 = gmax.parse().map_err(|_| "GMAX is not a number".to_string())?;
        return Ok(Some(("flex", herd_split(profiles, rates, gpus, g, gmax)?)));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test double: runs each request alone on its part's GPU 0 at once.
    struct Immediate;

    impl Scheduler for Immediate {
        fn name(&self) -> &'static str {
            "immediate"
        }
        fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
            out.push(Decision::Dispatch { gpu: 0, model: req.model, requests: vec![req], start: now });
        }
        fn on_gpu_free(&mut self, _: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
            out.push(Decision::Preempt { gpu });
        }
        fn on_timer(&mut self, _: Ms, _: &mut Vec<Decision>) {}
        fn next_timer(&self) -> Option<Ms> {
            None
        }
        fn queued(&self) -> usize {
            0
        }
    }

    fn profiles(n: usize) -> Vec<Profile> {
        (0..n).map(|i| Profile::new(&format!("m{i}"), 1.0, 2.0, 50.0, 64).unwrap()).collect()
    }

    #[test]
    fn models_and_gpus_are_renumbered_both_ways() {
        // Models 0 and 2 on part 1 (GPUs 3..5), model 1 on part 0 (GPUs 0..3); part 2 is empty.
        let mut seen = Vec::new();
        let mut p = Partitioned::new(&profiles(3), &[1, 0, 1], &[3, 2, 0], |ps, g, ids| {
            seen.push((ps.iter().map(|p| p.name.clone()).collect::<Vec<_>>(), g, ids.to_vec()));
            Ok(Box::new(Immediate))
        })
        .unwrap();
        assert_eq!(p.parts(), 2);
        assert_eq!(seen[0], (vec!["m1".to_string()], 3, vec![1]));
        assert_eq!(seen[1], (vec!["m0".to_string(), "m2".to_string()], 2, vec![0, 2]));
        let mut out = Vec::new();
        let r = Request { id: 7, model: 2, arrival: 1.0, deadline: 51.0 };
        p.on_arrival(1.0, r, &mut out);
        assert_eq!(out, vec![Decision::Dispatch { gpu: 3, model: 2, requests: vec![r], start: 1.0 }]);
        out.clear();
        p.on_gpu_free(2.0, 4, &mut out);
        assert_eq!(out, vec![Decision::Preempt { gpu: 4 }], "part 1's GPU 1 is global GPU 4");
    }

    #[test]
    fn bad_partitions_are_refused() {
        let ok =
            |_: &[Profile], _: usize, _: &[ModelId]| -> Result<Box<dyn Scheduler>, String> { Ok(Box::new(Immediate)) };
        assert!(Partitioned::new(&profiles(2), &[0, 1], &[1, 0], ok).is_err(), "models without GPUs");
        assert!(Partitioned::new(&profiles(2), &[0, 0], &[1, 1], ok).is_err(), "GPUs without models");
        assert!(Partitioned::new(&profiles(2), &[0, 2], &[1, 1], ok).is_err(), "no such part");
    }

    fn scenario() -> crate::Scenario {
        let mut text = String::from("duration_s = 5.0\nwarmup_s = 1.0\nseed = 3\ngpus = 6\n");
        for (i, (a, b, slo, r)) in
            [(1.0, 5.0, 40.0, 300.0), (2.0, 3.0, 30.0, 200.0), (0.5, 8.0, 50.0, 500.0)].iter().enumerate()
        {
            text += &format!(
                "[[models]]\nname = \"m{i}\"\nalpha_ms = {a}\nbeta_ms = {b}\nslo_ms = {slo}\nrate_rps = {r}\narrival = \"gamma:0.5\"\n"
            );
        }
        toml::from_str(&text).unwrap()
    }

    #[test]
    fn one_part_is_the_scheduler_itself() {
        let s = scenario();
        let whole = s.run("symphony", None).unwrap();
        let one = s.run("symphony/1", None).unwrap();
        assert_eq!(format!("{whole:?}"), format!("{one:?}"));
        let flex = s.run("flex", None).unwrap();
        let herd = s.run("flex/herd:1:6", None).unwrap();
        assert_eq!(format!("{flex:?}"), format!("{herd:?}"));
    }

    #[test]
    fn partitioned_runs_serve_every_model() {
        let s = scenario();
        for name in ["symphony/2", "symphony/3", "flex/herd:3:4"] {
            let r = s.run(name, None).unwrap();
            assert!(r.per_model.iter().all(|m| m.requests > 0 && m.good_fraction > 0.5), "{name}: {r:?}");
        }
        assert!(s.run("symphony/x", None).is_err());
        assert!(s.run("flex/herd:3", None).is_err());
        assert!(s.run("symphony/0", None).is_err());
        // More sub-clusters than models: the empty ones get no GPU.
        assert!(s.run("symphony/7", None).is_ok());
    }

    /// Charged dispatchers (one per part): at this machine's speed the run serves as before;
    /// a dispatcher a million times slower falls behind, its requests are served late or
    /// dropped — and every request is still accounted for.
    #[test]
    fn charged_dispatchers_fall_behind_and_lose_nothing() {
        let mut s = scenario();
        for name in ["flex/herd:3:4", "symphony"] {
            s.charge_dispatch = Some(1.0);
            let fast = s.run(name, None).unwrap();
            s.charge_dispatch = Some(1e6);
            let slow = s.run(name, None).unwrap();
            assert_eq!((fast.lost, slow.lost), (0, 0), "{name}");
            assert!(fast.per_model.iter().all(|m| m.good_fraction > 0.5), "{name}: {fast:?}");
            assert!(slow.goodput_rps < fast.goodput_rps / 2.0, "{name}: {} vs {}", slow.goodput_rps, fast.goodput_rps);
        }
        s.charge_dispatch = Some(f64::NAN);
        assert!(s.check().is_err());
    }
}
