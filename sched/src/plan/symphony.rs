//! Symphony's epoch-scale partitioning (seed `001_…`, §4.7 and Appendix A.1): models to
//! sub-clusters, each sub-cluster with its own dispatcher.
//!
//! x_ij ∈ {0, 1} puts model i on sub-cluster j. Minimise ΔR + w·ΔS subject to
//! (5) Σ_i r_i x_ij ≤ R_max, (6) Σ_i s_i x_ij + max_i d_i x_ij ≤ S_max, (7) |Σ_i r_i x_ij − R̄| ≤ ΔR,
//! (8) |Σ_i s_i x_ij − S̄| ≤ ΔS, (9) Σ_j x_ij = 1, and, against the previous epoch's X',
//! (11) Σ_ij c_ij |x_ij − x'_ij| ≤ C_max.
//!
//! Linearisation and choices (the paper gives the model, not its encoding):
//! * (6)'s max is a variable D_j ≥ d_i·x_ij for every i, j;
//! * (11) is linear as it stands, X' being data: |x_ij − x'_ij| is x_ij where x'_ij = 0 and
//!   1 − x_ij where x'_ij = 1. c_ij = c_i for every j (the paper assumes loading and unloading
//!   cost the same), so a model that moves costs 2·c_i: unloaded from its old sub-cluster,
//!   loaded on the new one;
//! * w defaults to Σr / Σs, which puts both terms in requests per second;
//! * the paper runs CPLEX for 10 s and takes its best solution; here the greedy plan below is
//!   the solver's warm start and fallback, and whatever the solver returns is checked.

use std::time::{Duration, Instant};

use good_lp::{constraint, variable, variables, Expression, Variable};

use super::{choose, decode, Milp, Plan, SolverKind};
use crate::arrival::Rng;

/// One model as the partitioner sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SymModel {
    /// Model name.
    pub name: String,
    /// Request rate r_i, requests per second.
    pub rate_rps: f64,
    /// Static memory s_i (weights), MB.
    pub static_mb: f64,
    /// Dynamic (run-time) memory d_i, MB.
    pub dynamic_mb: f64,
    /// c_i: the cost of loading (or unloading) the model on a sub-cluster; defaults to its
    /// static memory, MB moved.
    pub move_cost: f64,
}

/// One epoch's partitioning problem.
#[derive(Debug, Clone, PartialEq)]
pub struct SymphonyProblem {
    /// The models.
    pub models: Vec<SymModel>,
    /// l, the number of sub-clusters.
    pub sub_clusters: usize,
    /// R_max: what one dispatcher can handle, requests per second.
    pub r_max_rps: f64,
    /// S_max: a backend's memory, MB.
    pub s_max_mb: f64,
    /// w in ΔR + w·ΔS.
    pub w: f64,
    /// The previous epoch's assignment X', if any.
    pub previous: Option<Vec<usize>>,
    /// C_max, the disruption budget against [`SymphonyProblem::previous`] (same unit as c_i).
    pub c_max: f64,
}

/// What a plan puts on each sub-cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Loads {
    /// Σ r_i per sub-cluster, requests per second.
    pub rate_rps: Vec<f64>,
    /// Σ s_i per sub-cluster, MB.
    pub static_mb: Vec<f64>,
    /// max d_i per sub-cluster, MB.
    pub dynamic_mb: Vec<f64>,
}

impl SymphonyProblem {
    /// Checks the inputs (not feasibility): finite non-negative numbers, at least one sub-cluster,
    /// a previous assignment of the right shape.
    pub fn validate(&self) -> Result<(), String> {
        if self.sub_clusters == 0 {
            return Err("at least one sub-cluster is needed".into());
        }
        for (what, v) in
            [("r_max_rps", self.r_max_rps), ("s_max_mb", self.s_max_mb), ("w", self.w), ("c_max", self.c_max)]
        {
            if v.is_nan() || v < 0.0 {
                return Err(format!("{what} = {v}: must be ≥ 0"));
            }
        }
        for m in &self.models {
            for (what, v) in [
                ("rate_rps", m.rate_rps),
                ("static_mb", m.static_mb),
                ("dynamic_mb", m.dynamic_mb),
                ("move_cost", m.move_cost),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(format!("model {:?}: {what} = {v}: must be finite and ≥ 0", m.name));
                }
            }
        }
        if let Some(p) = &self.previous {
            if p.len() != self.models.len() {
                return Err(format!(
                    "the previous assignment has {} models, this epoch {}",
                    p.len(),
                    self.models.len()
                ));
            }
            if let Some(bad) = p.iter().find(|&&j| j >= self.sub_clusters) {
                return Err(format!("the previous assignment names sub-cluster {bad} of {}", self.sub_clusters));
            }
        }
        Ok(())
    }

    /// R̄ and S̄: the per-sub-cluster averages.
    pub fn averages(&self) -> (f64, f64) {
        let l = self.sub_clusters.max(1) as f64;
        (
            self.models.iter().map(|m| m.rate_rps).sum::<f64>() / l,
            self.models.iter().map(|m| m.static_mb).sum::<f64>() / l,
        )
    }

    /// What `assign` puts on each sub-cluster (entries out of range are skipped).
    pub fn loads(&self, assign: &[usize]) -> Loads {
        let l = self.sub_clusters;
        let mut out = Loads { rate_rps: vec![0.0; l], static_mb: vec![0.0; l], dynamic_mb: vec![0.0; l] };
        for (m, &j) in self.models.iter().zip(assign).filter(|(_, &j)| j < l) {
            out.rate_rps[j] += m.rate_rps;
            out.static_mb[j] += m.static_mb;
            out.dynamic_mb[j] = out.dynamic_mb[j].max(m.dynamic_mb);
        }
        out
    }

    /// ΔR + w·ΔS of per-sub-cluster sums.
    fn objective_of(&self, rates: &[f64], statics: &[f64]) -> f64 {
        let (rbar, sbar) = self.averages();
        max_deviation(rates, rbar) + self.w * max_deviation(statics, sbar)
    }

    /// ΔR + w·ΔS of `assign` (constraints not checked).
    pub fn objective(&self, assign: &[usize]) -> f64 {
        let loads = self.loads(assign);
        self.objective_of(&loads.rate_rps, &loads.static_mb)
    }

    /// Σ_ij c_ij |x_ij − x'_ij| of `assign` (0 without a previous epoch).
    pub fn disruption(&self, assign: &[usize]) -> f64 {
        match &self.previous {
            None => 0.0,
            Some(p) => self
                .models
                .iter()
                .zip(assign.iter().zip(p))
                .filter(|(_, (a, b))| a != b)
                .map(|(m, _)| 2.0 * m.move_cost)
                .sum(),
        }
    }

    /// Checks every constraint of the MILP against `assign`; its objective when it holds.
    pub fn check(&self, assign: &[usize]) -> Result<f64, String> {
        if assign.len() != self.models.len() {
            return Err(format!("{} entries for {} models", assign.len(), self.models.len()));
        }
        if let Some((i, j)) = assign.iter().enumerate().find(|(_, &j)| j >= self.sub_clusters) {
            return Err(format!("model {i} on sub-cluster {j} of {}", self.sub_clusters));
        }
        let loads = self.loads(assign);
        for j in 0..self.sub_clusters {
            if loads.rate_rps[j] > self.r_max_rps * (1.0 + 1e-9) + 1e-9 {
                return Err(format!("sub-cluster {j}: {:.3} r/s over R_max {:.3}", loads.rate_rps[j], self.r_max_rps));
            }
            let mem = loads.static_mb[j] + loads.dynamic_mb[j];
            if mem > self.s_max_mb * (1.0 + 1e-9) + 1e-9 {
                return Err(format!("sub-cluster {j}: {mem:.1} MB over S_max {:.1}", self.s_max_mb));
            }
        }
        let d = self.disruption(assign);
        if d > self.c_max * (1.0 + 1e-9) + 1e-9 {
            return Err(format!("disruption {d:.1} over C_max {:.1}", self.c_max));
        }
        Ok(self.objective_of(&loads.rate_rps, &loads.static_mb))
    }

    /// The greedy plan: the previous epoch's assignment when there is one, else largest-first
    /// placement on the least-loaded sub-cluster (rate and memory, each relative to its average,
    /// where it fits); then a local search of moves and swaps (the private `descend`).
    /// `None` when largest-first finds no room.
    pub fn greedy(&self) -> Option<Vec<usize>> {
        let mut assign = self.construct()?;
        self.descend(&mut assign, None);
        Some(assign)
    }

    /// The constructive step alone: the previous epoch's assignment, or largest-first.
    pub fn construct(&self) -> Option<Vec<usize>> {
        let (l, (rbar, sbar)) = (self.sub_clusters, self.averages());
        let norm = |m: &SymModel| m.rate_rps / rbar.max(1e-12) + m.static_mb / sbar.max(1e-12);
        let assign = match &self.previous {
            Some(p) => p.clone(),
            None => {
                let mut order: Vec<usize> = (0..self.models.len()).collect();
                order.sort_by(|&a, &b| norm(&self.models[b]).total_cmp(&norm(&self.models[a])).then(a.cmp(&b)));
                let mut assign = vec![usize::MAX; self.models.len()];
                let mut loads = Loads { rate_rps: vec![0.0; l], static_mb: vec![0.0; l], dynamic_mb: vec![0.0; l] };
                for i in order {
                    let m = &self.models[i];
                    let fits = |j: usize| {
                        loads.rate_rps[j] + m.rate_rps <= self.r_max_rps
                            && loads.static_mb[j] + m.static_mb + loads.dynamic_mb[j].max(m.dynamic_mb) <= self.s_max_mb
                    };
                    let level = |j: usize| loads.rate_rps[j] / rbar.max(1e-12) + loads.static_mb[j] / sbar.max(1e-12);
                    let j = (0..l).filter(|&j| fits(j)).min_by(|&a, &b| level(a).total_cmp(&level(b)))?;
                    assign[i] = j;
                    loads.rate_rps[j] += m.rate_rps;
                    loads.static_mb[j] += m.static_mb;
                    loads.dynamic_mb[j] = loads.dynamic_mb[j].max(m.dynamic_mb);
                }
                assign
            }
        };
        Some(assign)
    }

    /// Local search from `assign`: moves of one model and swaps of two, each keeping every
    /// constraint, taking the best improvement until none is left (or `deadline`). The objective
    /// is a maximum, so only moves touching an extreme sub-cluster (one with the largest
    /// deviation in rate or in memory, above or below the mean) can lower it; they are the only
    /// ones tried. Ties on the objective are broken by the sum of squared deviations, so the
    /// search crosses plateaus where several sub-clusters share the maximum.
    fn descend(&self, assign: &mut [usize], deadline: Option<Instant>) {
        if self.check(assign).is_err() {
            return;
        }
        let (l, m) = (self.sub_clusters, self.models.len());
        let (rbar, sbar) = self.averages();
        let score = |r: &[f64], st: &[f64]| {
            let sq: f64 = r.iter().map(|x| (x - rbar).powi(2)).sum::<f64>()
                + self.w * self.w * st.iter().map(|x| (x - sbar).powi(2)).sum::<f64>();
            (self.objective_of(r, st), sq)
        };
        let better =
            |a: (f64, f64), b: (f64, f64)| a.0 < b.0 - 1e-9 || (a.0 <= b.0 + 1e-9 && a.1 < b.1 * (1.0 - 1e-12) - 1e-9);
        let fits = |x: f64, cap: f64| x <= cap * (1.0 + 1e-9) + 1e-9;
        let home = |i: usize| self.previous.as_ref().map(|p| p[i]);
        // Disruption change when model i goes from a to b.
        let moved = |i: usize, a: usize, b: usize| match home(i) {
            Some(h) if h == a => 2.0 * self.models[i].move_cost,
            Some(h) if h == b => -2.0 * self.models[i].move_cost,
            _ => 0.0,
        };
        for _ in 0..20 * m.max(1) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            let loads = self.loads(assign);
            let disruption = self.disruption(assign);
            let current = score(&loads.rate_rps, &loads.static_mb);
            // The two largest dynamic memories per sub-cluster, to know a group's after a removal.
            let mut top2 = vec![(0.0f64, 0.0f64); l];
            for (i, &j) in assign.iter().enumerate() {
                let d = self.models[i].dynamic_mb;
                let t = &mut top2[j];
                if d > t.0 {
                    *t = (d, t.0);
                } else if d > t.1 {
                    t.1 = d;
                }
            }
            let dyn_without = |j: usize, d: f64| if d < top2[j].0 { top2[j].0 } else { top2[j].1 };
            let extreme = |v: &[f64], avg: f64| {
                let hi = (0..l).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap_or(0);
                let lo = (0..l).min_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap_or(0);
                if (v[hi] - avg).abs() >= (v[lo] - avg).abs() {
                    [hi, lo]
                } else {
                    [lo, hi]
                }
            };
            let mut focus: Vec<usize> =
                extreme(&loads.rate_rps, rbar).into_iter().chain(extreme(&loads.static_mb, sbar)).collect();
            focus.sort_unstable();
            focus.dedup();
            // (new score, model, its new group, optional swap partner)
            let mut best: Option<Step> = None;
            let (mut r, mut st) = (loads.rate_rps.clone(), loads.static_mb.clone());
            for i in (0..m).filter(|&i| focus.contains(&assign[i])) {
                let (a, mi) = (assign[i], &self.models[i]);
                for b in (0..l).filter(|&b| b != a) {
                    // Move i to b.
                    let (rb, sb, db) = (r[b] + mi.rate_rps, st[b] + mi.static_mb, top2[b].0.max(mi.dynamic_mb));
                    if fits(rb, self.r_max_rps)
                        && fits(sb + db, self.s_max_mb)
                        && fits(disruption + moved(i, a, b), self.c_max)
                    {
                        let (ra, sa) = (r[a], st[a]);
                        r[a] -= mi.rate_rps;
                        st[a] -= mi.static_mb;
                        let (rb0, sb0) = (r[b], st[b]);
                        r[b] = rb;
                        st[b] = sb;
                        let sc = score(&r, &st);
                        if better(sc, current) && best.as_ref().is_none_or(|x| better(sc, x.0)) {
                            best = Some(Step(sc, i, b, None));
                        }
                        (r[a], st[a], r[b], st[b]) = (ra, sa, rb0, sb0);
                    }
                    // Swap i with each model k of b.
                    for k in (0..m).filter(|&k| assign[k] == b) {
                        let mk = &self.models[k];
                        let (ra, sa) = (r[a] - mi.rate_rps + mk.rate_rps, st[a] - mi.static_mb + mk.static_mb);
                        let (rb, sb) = (r[b] - mk.rate_rps + mi.rate_rps, st[b] - mk.static_mb + mi.static_mb);
                        let da = dyn_without(a, mi.dynamic_mb).max(mk.dynamic_mb);
                        let db = dyn_without(b, mk.dynamic_mb).max(mi.dynamic_mb);
                        let d = disruption + moved(i, a, b) + moved(k, b, a);
                        if !(fits(ra, self.r_max_rps)
                            && fits(rb, self.r_max_rps)
                            && fits(sa + da, self.s_max_mb)
                            && fits(sb + db, self.s_max_mb)
                            && fits(d, self.c_max))
                        {
                            continue;
                        }
                        let (ra0, sa0, rb0, sb0) = (r[a], st[a], r[b], st[b]);
                        (r[a], st[a], r[b], st[b]) = (ra, sa, rb, sb);
                        let sc = score(&r, &st);
                        if better(sc, current) && best.as_ref().is_none_or(|x| better(sc, x.0)) {
                            best = Some(Step(sc, i, b, Some(k)));
                        }
                        (r[a], st[a], r[b], st[b]) = (ra0, sa0, rb0, sb0);
                    }
                }
            }
            let Some(Step(_, i, b, partner)) = best else { return };
            if let Some(k) = partner {
                assign[k] = assign[i];
            }
            assign[i] = b;
        }
    }

    /// The paper's random baseline (Appendix A.2): random partitions for `budget`, keeping the
    /// feasible one with the lowest objective.
    pub fn random(&self, budget: Duration, seed: u64) -> Option<(Vec<usize>, f64)> {
        let (mut rng, t, mut best): (_, _, Option<(Vec<usize>, f64)>) = (Rng::new(seed), Instant::now(), None);
        let mut tries = 0u64;
        while t.elapsed() < budget || (best.is_none() && tries < 1_000) {
            tries += 1;
            let a: Vec<usize> =
                (0..self.models.len()).map(|_| (rng.next_u64() % self.sub_clusters as u64) as usize).collect();
            if let Ok(o) = self.check(&a) {
                if best.as_ref().is_none_or(|b| o < b.1) {
                    best = Some((a, o));
                }
            }
        }
        best
    }

    /// Plans the epoch: greedy, then the MILP within `budget` warm-started from it (see the module
    /// docs). `Err` when neither finds a feasible plan.
    pub fn solve(&self, solver: SolverKind, budget: Duration) -> Result<Plan, String> {
        self.validate()?;
        let started = Instant::now();
        // The constructive plan, then the local search within half the budget; the solver,
        // warm-started from the searched plan, gets the rest.
        let constructed = self.construct().and_then(|g| self.check(&g).ok().map(|o| (g, o)));
        let searched = constructed.clone().map(|(mut g, o0)| {
            self.descend(&mut g, Some(started + budget / 2));
            let o = self.check(&g).unwrap_or(o0);
            (g, o)
        });
        let remaining = budget.saturating_sub(started.elapsed());
        let solved = self.milp(searched.as_ref().map(|g| g.0.as_slice())).and_then(|(milp, x)| {
            let s = milp.solve(solver, remaining, &x)?;
            Ok((decode(&s.values, self.models.len(), self.sub_clusters)?, Vec::new(), s.status))
        });
        let o0 = constructed.map(|(_, o)| o);
        let mut plan = choose(
            searched.map(|(g, o)| (g, Vec::new(), o)),
            solved,
            |a, _| self.check(a),
            |a, b| a < b - 1e-9,
            started,
        )?;
        if let Some(o0) = o0 {
            if plan.source == super::Source::Greedy && plan.objective < o0 - 1e-9 {
                plan.source = super::Source::LocalSearch;
            }
            plan.greedy_objective = o0;
        }
        Ok(plan)
    }

    /// The MILP, warm-started from `warm` when given; also the x variables, row by row.
    fn milp(&self, warm: Option<&[usize]>) -> Result<(Milp, Vec<Variable>), String> {
        let (m, l) = (self.models.len(), self.sub_clusters);
        let (rbar, sbar) = self.averages();
        let mut vars = variables!();
        let x: Vec<Variable> = (0..m * l).map(|_| vars.add(variable().binary())).collect();
        let dr = vars.add(variable().min(0.0));
        let ds = vars.add(variable().min(0.0));
        let dmax: Vec<Variable> = (0..l).map(|_| vars.add(variable().min(0.0))).collect();
        let mut cs = Vec::new();
        for i in 0..m {
            let row: Expression = (0..l).map(|j| x[i * l + j]).sum();
            cs.push(constraint!(row == 1.0));
        }
        for j in 0..l {
            let rate: Expression = (0..m).map(|i| self.models[i].rate_rps * x[i * l + j]).sum();
            let stat: Expression = (0..m).map(|i| self.models[i].static_mb * x[i * l + j]).sum();
            cs.push(constraint!(rate.clone() <= self.r_max_rps));
            cs.push(constraint!(stat.clone() + dmax[j] <= self.s_max_mb));
            cs.push(constraint!(rate.clone() - rbar <= dr));
            cs.push(constraint!(rbar - rate <= dr));
            cs.push(constraint!(stat.clone() - sbar <= ds));
            cs.push(constraint!(sbar - stat <= ds));
            for i in 0..m {
                if self.models[i].dynamic_mb > 0.0 {
                    cs.push(constraint!(self.models[i].dynamic_mb * x[i * l + j] <= dmax[j]));
                }
            }
        }
        if let Some(p) = &self.previous {
            let mut change = Expression::from(0.0);
            for i in 0..m {
                for j in 0..l {
                    let c = self.models[i].move_cost;
                    if p[i] == j {
                        change += c - c * x[i * l + j];
                    } else {
                        change += c * x[i * l + j];
                    }
                }
            }
            cs.push(constraint!(change <= self.c_max));
        }
        let mut warm_values = Vec::new();
        if let Some(a) = warm {
            let loads = self.loads(a);
            for i in 0..m {
                for j in 0..l {
                    warm_values.push((x[i * l + j], if a[i] == j { 1.0 } else { 0.0 }));
                }
            }
            warm_values.push((dr, max_deviation(&loads.rate_rps, rbar)));
            warm_values.push((ds, max_deviation(&loads.static_mb, sbar)));
            warm_values.extend(dmax.iter().zip(&loads.dynamic_mb).map(|(&v, &d)| (v, d)));
        }
        let objective = dr + self.w * ds;
        Ok((Milp { vars, objective, maximise: false, constraints: cs, warm: warm_values }, x))
    }
}

/// max_j |v_j − avg|: ΔR or ΔS of per-sub-cluster sums.
fn max_deviation(v: &[f64], avg: f64) -> f64 {
    v.iter().map(|x| (x - avg).abs()).fold(0.0, f64::max)
}

/// A local-search step: its (objective, squared deviations), the model moved, its new
/// sub-cluster, and the model it swaps with, if any.
struct Step((f64, f64), usize, usize, Option<usize>);
