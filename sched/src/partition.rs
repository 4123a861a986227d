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
//!   each running `flex` on the GPUs HERD gives it. In the simulator a model whose load needs
//!   more than half a group is split over several groups ([`herd_streams`], a departure the
//!   function's docs explain); the real-time engine runs whole models ([`split_by_name`]).
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
    /// Global model → where its requests go: one route, or one per part its load is split over.
    model_at: Vec<Vec<Route>>,
    /// Per part: its models' global ids.
    models_of: Vec<Vec<ModelId>>,
    /// Global GPU → (part, its index there).
    gpu_at: Vec<(usize, GpuId)>,
    /// Per part: its first GPU's global id (its GPUs are consecutive).
    gpu_base: Vec<GpuId>,
    scratch: Vec<Decision>,
}

/// One part a model's requests go to, and its share of them (smooth weighted round robin:
/// each arrival goes to the route with the most credit, deterministic and in proportion).
#[derive(Debug, Clone, Copy)]
struct Route {
    part: usize,
    local: ModelId,
    share: f64,
    credit: f64,
}

/// A cluster split into parts: the model-streams (a model's whole load, or a share of it),
/// the part each stream is on, and each part's GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// Each stream's model and its share of that model's requests (a model's shares sum to 1).
    pub streams: Vec<(ModelId, f64)>,
    /// The part each stream is on.
    pub part_of_stream: Vec<usize>,
    /// GPUs per part.
    pub gpus: Vec<usize>,
}

impl Split {
    /// One stream per model: model `m` wholly on part `assign[m]`.
    pub fn whole(assign: Vec<usize>, gpus: Vec<usize>) -> Split {
        Split { streams: (0..assign.len()).map(|m| (m, 1.0)).collect(), part_of_stream: assign, gpus }
    }

    /// Each model's parts and its share on each (for reports).
    pub fn parts_of_model(&self) -> Vec<Vec<(usize, f64)>> {
        let n = self.streams.iter().map(|&(m, _)| m + 1).max().unwrap_or(0);
        let mut out = vec![Vec::new(); n];
        for (&(m, share), &p) in self.streams.iter().zip(&self.part_of_stream) {
            out[m].push((p, share));
        }
        out
    }
}

impl Partitioned {
    /// Splits `profiles` by `assign` (a part per model) and the GPUs by `gpus` (per part, laid
    /// out consecutively), building each part's scheduler with `make(its profiles, its GPUs,
    /// its models' global ids with the share of each model's requests it gets)`, whose errors
    /// are returned. Parts with no models get no scheduler and must get no GPU.
    pub fn new(
        profiles: &[Profile],
        assign: &[usize],
        gpus: &[usize],
        make: impl FnMut(&[Profile], usize, &[(ModelId, f64)]) -> Result<Box<dyn Scheduler>, String>,
    ) -> Result<Partitioned, String> {
        if assign.len() != profiles.len() {
            return Err(format!("{} parts for {} models", assign.len(), profiles.len()));
        }
        Partitioned::of_streams(profiles, &Split::whole(assign.to_vec(), gpus.to_vec()), make)
    }

    /// As [`Partitioned::new`] for a [`Split`] whose models may be spread over several parts:
    /// each arrival of such a model goes to one of them in proportion to their shares. Streams
    /// of one model on one part are one model there.
    pub fn of_streams(
        profiles: &[Profile],
        split: &Split,
        mut make: impl FnMut(&[Profile], usize, &[(ModelId, f64)]) -> Result<Box<dyn Scheduler>, String>,
    ) -> Result<Partitioned, String> {
        let Split { streams, part_of_stream, gpus } = split;
        if streams.len() != part_of_stream.len() {
            return Err(format!("{} parts for {} streams", part_of_stream.len(), streams.len()));
        }
        if let Some(&bad) = part_of_stream.iter().find(|&&p| p >= gpus.len()) {
            return Err(format!("part {bad} of {}", gpus.len()));
        }
        if let Some(&(m, share)) =
            streams.iter().find(|&&(m, share)| m >= profiles.len() || !(share > 0.0 && share.is_finite()))
        {
            return Err(format!("a stream of model {m} ({} models) with share {share}", profiles.len()));
        }
        let mut shares = vec![vec![0.0f64; gpus.len()]; profiles.len()];
        for (&(m, share), &p) in streams.iter().zip(part_of_stream) {
            shares[m][p] += share;
        }
        if let Some(m) = shares.iter().position(|s| s.iter().all(|&x| x == 0.0)) {
            return Err(format!("model {m} is on no part"));
        }
        let mut out = Partitioned {
            parts: Vec::new(),
            model_at: vec![Vec::new(); profiles.len()],
            models_of: Vec::new(),
            gpu_at: Vec::new(),
            gpu_base: Vec::new(),
            scratch: Vec::new(),
        };
        for (p, &n) in gpus.iter().enumerate() {
            let models: Vec<ModelId> = (0..profiles.len()).filter(|&m| shares[m][p] > 0.0).collect();
            match (models.is_empty(), n) {
                (true, 0) => continue,
                (true, _) => return Err(format!("part {p} has {n} GPUs and no model")),
                (false, 0) => return Err(format!("part {p} has {} models and no GPU", models.len())),
                (false, _) => {}
            }
            let k = out.parts.len();
            for (local, &m) in models.iter().enumerate() {
                out.model_at[m].push(Route { part: k, local, share: shares[m][p], credit: 0.0 });
            }
            out.gpu_base.push(out.gpu_at.len());
            out.gpu_at.extend((0..n).map(|g| (k, g)));
            let ps: Vec<Profile> = models.iter().map(|&m| profiles[m].clone()).collect();
            let shared: Vec<(ModelId, f64)> = models.iter().map(|&m| (m, shares[m][p])).collect();
            out.parts.push(make(&ps, n, &shared)?);
            out.models_of.push(models);
        }
        Ok(out)
    }

    /// The route of model `m`'s next arrival (smooth weighted round robin over its parts).
    fn route(&mut self, m: ModelId) -> (usize, ModelId) {
        let routes = &mut self.model_at[m];
        if let [only] = routes.as_slice() {
            return (only.part, only.local);
        }
        let total: f64 = routes.iter().map(|r| r.share).sum();
        for r in routes.iter_mut() {
            r.credit += r.share;
        }
        // The most credit; the first such on a tie.
        let best = (0..routes.len())
            .max_by(|&a, &b| routes[a].credit.total_cmp(&routes[b].credit).then(b.cmp(&a)))
            .unwrap_or(0);
        routes[best].credit -= total;
        (routes[best].part, routes[best].local)
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
        let (part, local) = self.route(req.model);
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

/// HERD's groups as [`herd_split`] makes them, except that a model whose load needs more than
/// half a group (n_i > Ḡ/2 GPUs) is first split into the fewest equal model-streams that each
/// need at most that (but never more than G of them), placed like any other stream: a model may
/// then be served by several groups, each arrival going to one of them in proportion.
///
/// **Departure.** Shepherd §4 merges the streams of one model into one model-stream before
/// solving, and each stream goes to one group. A merged stream that needs more GPUs than a
/// group may hold (Ḡ) then fits no group — its burst tolerance is below 1 wherever it goes — and
/// the whole cluster's goodput stops at that model's share of Ḡ GPUs (on
/// `scale_400gpus.toml`, EfficientNetV2L in one group of 40). The paper's own ILP lets a model
/// be in several groups (its z_kj) for its several streams; this split gives a heavy model such
/// streams. Half a group is this implementation's choice: each share alone leaves its group
/// room for a burst twice its load.
pub fn herd_streams(
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
    groups: usize,
    group_max: u32,
) -> Result<Split, String> {
    let whole = streams(profiles, rates, gpus, groups, group_max)?;
    let cap = f64::from(group_max) / 2.0;
    let mut problem = HerdProblem { streams: Vec::new(), ..whole.clone() };
    let mut of = Vec::new();
    for (m, s) in whole.streams.iter().enumerate() {
        let k = ((s.gpus_needed / cap).ceil() as usize).clamp(1, groups);
        for i in 0..k {
            let name = if k == 1 { s.name.clone() } else { format!("{}#{i}", s.name) };
            problem.streams.push(HerdStream { name, gpus_needed: s.gpus_needed / k as f64, ..s.clone() });
            of.push((m, 1.0 / k as f64));
        }
    }
    problem.validate()?;
    let (assign, sizes) = problem.greedy().ok_or("HERD's greedy grouping found no plan")?;
    Ok(Split { streams: of, part_of_stream: assign, gpus: sizes.into_iter().map(|s| s as usize).collect() })
}

/// Each part's models and GPUs, from a part per model (`assign`) and the GPUs per part: what
/// the real-time engine's [`run_sub_clusters`](crate::realtime::run_sub_clusters) and
/// [`run_parts`](crate::realtime::run_parts) take.
pub fn parts(assign: &[usize], gpus: &[usize]) -> Vec<(Vec<ModelId>, usize)> {
    gpus.iter().enumerate().map(|(j, &g)| ((0..assign.len()).filter(|&m| assign[m] == j).collect(), g)).collect()
}

/// The name's parts: `symphony/L` → (L, None), `flex/herd:G:GMAX` → (G, Some(GMAX)); `None`
/// for another name.
fn parse_name(name: &str) -> Result<Option<(usize, Option<u32>)>, String> {
    if let Some(l) = name.strip_prefix("symphony/") {
        let l: usize = l.parse().map_err(|_| "symphony/L wants a number of sub-clusters".to_string())?;
        return Ok(Some((l, None)));
    }
    if let Some(spec) = name.strip_prefix("flex/herd:") {
        let (g, gmax) = spec.split_once(':').ok_or("flex/herd:G:GMAX")?;
        let g: usize = g.parse().map_err(|_| "G is not a number".to_string())?;
        let gmax: u32 = gmax.parse().map_err(|_| "GMAX is not a number".to_string())?;
        return Ok(Some((g, Some(gmax))));
    }
    Ok(None)
}

/// A partitioned cluster named `symphony/L` or `flex/herd:G:GMAX` with every model wholly in one
/// part (what the real-time engine runs): (the parts' scheduler, (part per model, GPUs per
/// part)) of `profiles` at `rates` on `gpus` GPUs; `None` for another name.
#[allow(clippy::type_complexity)]
pub fn split_by_name(
    name: &str,
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
) -> Result<Option<(&'static str, (Vec<usize>, Vec<usize>))>, String> {
    Ok(match parse_name(name)? {
        None => None,
        Some((l, None)) => Some(("symphony", symphony_split(profiles, rates, gpus, l)?)),
        Some((g, Some(gmax))) => Some(("flex", herd_split(profiles, rates, gpus, g, gmax)?)),
    })
}

/// As [`split_by_name`], with HERD's heavy models split over groups ([`herd_streams`]): what
/// the simulator runs.
pub fn streams_by_name(
    name: &str,
    profiles: &[Profile],
    rates: &[f64],
    gpus: usize,
) -> Result<Option<(&'static str, Split)>, String> {
    Ok(match parse_name(name)? {
        None => None,
        Some((l, None)) => {
            let (assign, g) = symphony_split(profiles, rates, gpus, l)?;
            Some(("symphony", Split::whole(assign, g)))
        }
        Some((g, Some(gmax))) => Some(("flex", herd_streams(profiles, rates, gpus, g, gmax)?)),
    })
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
            seen.push((ps.iter().map(|p| p.name.clone()).collect::<Vec<_>>(), g, ids.iter().map(|i| i.0).collect()));
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
        let ok = |_: &[Profile], _: usize, _: &[(ModelId, f64)]| -> Result<Box<dyn Scheduler>, String> {
            Ok(Box::new(Immediate))
        };
        assert!(Partitioned::new(&profiles(2), &[0, 1], &[1, 0], ok).is_err(), "models without GPUs");
        assert!(Partitioned::new(&profiles(2), &[0, 0], &[1, 1], ok).is_err(), "GPUs without models");
        assert!(Partitioned::new(&profiles(2), &[0, 2], &[1, 1], ok).is_err(), "no such part");
    }

    #[test]
    fn a_model_split_over_parts_is_routed_in_proportion() {
        // Model 0: three quarters on part 0 (GPUs 0..2), a quarter on part 1 (GPUs 2..5), as two
        // streams there that are one model; model 1 wholly on part 1.
        let split = Split {
            streams: vec![(0, 0.75), (1, 1.0), (0, 0.125), (0, 0.125)],
            part_of_stream: vec![0, 1, 1, 1],
            gpus: vec![2, 3],
        };
        assert_eq!(split.parts_of_model(), vec![vec![(0, 0.75), (1, 0.125), (1, 0.125)], vec![(1, 1.0)]]);
        let mut seen = Vec::new();
        let mut p = Partitioned::of_streams(&profiles(2), &split, |_, g, ids| {
            seen.push((g, ids.to_vec()));
            Ok(Box::new(Immediate))
        })
        .unwrap();
        assert_eq!(seen, vec![(2, vec![(0, 0.75)]), (3, vec![(0, 0.25), (1, 1.0)])]);
        let mut out = Vec::new();
        for id in 0..8 {
            p.on_arrival(0.0, Request { id, model: 0, arrival: 0.0, deadline: 50.0 }, &mut out);
        }
        let on = |gpu| out.iter().filter(|d| matches!(d, Decision::Dispatch { gpu: g, .. } if *g == gpu)).count();
        assert_eq!((on(0), on(2)), (6, 2), "{out:?}");
        // Evenly spread, not in runs: never two quarter-share arrivals in a row.
        let parts: Vec<GpuId> =
            out.iter().filter_map(|d| if let Decision::Dispatch { gpu, .. } = d { Some(*gpu) } else { None }).collect();
        assert!(parts.windows(2).all(|w| w != [2, 2]), "{parts:?}");
        out.clear();
        p.on_arrival(0.0, Request { id: 9, model: 1, arrival: 0.0, deadline: 50.0 }, &mut out);
        assert!(matches!(out[..], [Decision::Dispatch { gpu: 2, model: 1, .. }]), "{out:?}");
        let whole = Split::whole(vec![1, 0], vec![1, 1]);
        assert_eq!(whole.parts_of_model(), vec![vec![(1, 1.0)], vec![(0, 1.0)]]);
        let ok = |_: &[Profile], _: usize, _: &[(ModelId, f64)]| -> Result<Box<dyn Scheduler>, String> {
            Ok(Box::new(Immediate))
        };
        let bad = Split { streams: vec![(0, 1.0), (1, 0.0)], part_of_stream: vec![0, 0], gpus: vec![1] };
        assert!(Partitioned::of_streams(&profiles(2), &bad, ok).is_err(), "a stream with no share");
        let bad = Split { streams: vec![(0, 1.0)], part_of_stream: vec![0], gpus: vec![1] };
        assert!(Partitioned::of_streams(&profiles(2), &bad, ok).is_err(), "a model on no part");
    }

    #[test]
    fn herd_splits_a_model_that_needs_more_than_half_a_group() {
        // Three light models and one that needs 15 GPUs: with groups of at most 8, merged it
        // fits none; split, each share needs at most 4.
        let ps: Vec<Profile> = (0..4).map(|i| Profile::new(&format!("m{i}"), 1.0, 2.0, 50.0, 64).unwrap()).collect();
        let per = gpu_ms_per_request(&ps[0]);
        let rates = [1e3, 2e3, 1e3, 15.0 * 1e3 / per];
        let (assign, _) = herd_split(&ps, &rates, 32, 4, 8).unwrap();
        assert_eq!(assign.len(), 4, "whole models: one part each");
        let split = herd_streams(&ps, &rates, 32, 4, 8).unwrap();
        let parts = split.parts_of_model();
        assert_eq!(parts[..3].iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 1], "{parts:?}");
        assert_eq!(parts[3].len(), 4, "15 GPUs in shares of at most 4: {parts:?}");
        for (m, on) in parts.iter().enumerate() {
            let total: f64 = on.iter().map(|&(_, share)| share).sum();
            assert!((total - 1.0).abs() < 1e-12, "model {m}: {on:?}");
            assert!(on.iter().all(|&(_, share)| rates[m] * share * per / 1e3 <= 4.0 + 1e-9), "model {m}: {on:?}");
        }
        assert!(split.gpus.iter().all(|&g| g <= 8) && split.gpus.iter().sum::<usize>() <= 32, "{:?}", split.gpus);
        // Never more shares than groups: 19 GPUs over 4 groups are four shares of 4.75.
        let more = [1e3, 2e3, 1e3, 19.0 * 1e3 / per];
        assert_eq!(herd_streams(&ps, &more, 32, 4, 8).unwrap().parts_of_model()[3].len(), 4);
        // The scenario runs it, and every model is served.
        let s = scenario();
        let r = s.run("flex/herd:3:2", None).unwrap();
        assert_eq!(r.lost, 0);
        assert!(r.per_model.iter().all(|m| m.requests > 0), "{r:?}");
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
