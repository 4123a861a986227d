//! Shepherd's HERD planner (seed `003_…`, §4): serving groups of model-streams and GPUs.
//!
//! Streams of one model are merged into one *model-stream* before solving, as §4 does ("HERD
//! complexity"); a model-stream needs n_i = rate_i / T_i GPUs at its average load, T_i being
//! the most one GPU serves of it within its SLO. HERD picks, for G groups, a size size_j ≤ Ḡ
//! (Σ size_j ≤ N) and a group per model-stream, maximising the minimum burst tolerance bt(i),
//! within GPU memory per group and one affinity set per group.
//!
//! **Departure — the burst tolerance of a shared group.** The paper defines bt(i) as "# GPUs i
//! can use for its peak load / # GPUs i needs for its average load", written Σ_j size_j·x_ij / n_i.
//! Read literally, that ratio ignores the other streams of the group: every stream of a group of
//! 12 GPUs would tolerate 12/n_i whether it shares them with one stream or a hundred, and any
//! memory-feasible assignment with the largest groups would be optimal. Here the GPUs i can use
//! at its peak are those the rest of its group leaves while at *their* average load:
//! bt(i) = (size_j − Σ_{k≠i in j} n_k) / n_i = 1 + (size_j − load_j) / n_i. It equals the paper's
//! ratio for a stream alone in its group, and it stays linear: with L_j = Σ_k n_k·x_kj,
//! t·n_i ≤ size_j − L_j + n_i + M_i·(1 − x_ij) for every i, j, and t is maximised.
//!
//! The rest is as stated: (a) Σ size_j ≤ N; (b) size_j ≤ Ḡ; (c) Σ_i mem_i·x_ij ≤ mem;
//! (d) Σ_j x_ij = 1 (a model-stream is its model, so z_kj = x_ij); (e) x_ij ≤ y_cj for the
//! stream's affinity set c, Σ_c y_cj ≤ 1. A group that serves a stream has at least one GPU.
//!
//! Two constructions come before the ILP, and the better is its warm start and fallback
//! ([`HerdProblem::heuristic`]): the greedy plan, which spreads the largest streams over the
//! groups, and sorted runs (`herd/runs.rs`), which keep streams of similar size together and
//! reach far higher minima at the paper's sizes (43.8 against greedy's 16.0 on 1,000 streams).

mod runs;

use std::time::Instant;

use good_lp::{constraint, variable, variables, Expression, Variable};

use super::{choose, decode, Milp, Plan, SolverKind, Source};

/// One model-stream.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HerdStream {
    /// The model's name.
    pub name: String,
    /// n_i: GPUs needed at the average load (rate / single-GPU goodput).
    pub gpus_needed: f64,
    /// The model's GPU memory, MB.
    pub mem_mb: f64,
    /// Its affinity set (models of similar α, β; §4's (e)).
    pub affinity: u32,
}

/// One epoch's grouping problem.
#[derive(Debug, Clone, PartialEq)]
pub struct HerdProblem {
    /// The model-streams.
    pub streams: Vec<HerdStream>,
    /// N, GPUs in the cluster.
    pub gpus: u32,
    /// How many groups may be formed.
    pub groups: usize,
    /// Ḡ, the most GPUs in one group (the online scheduler's scalability limit).
    pub group_max: u32,
    /// mem, one GPU's memory for models, MB.
    pub gpu_mem_mb: f64,
}

impl HerdProblem {
    /// Checks the inputs (not feasibility).
    pub fn validate(&self) -> Result<(), String> {
        if self.groups == 0 || self.group_max == 0 || self.gpus == 0 {
            return Err(format!(
                "groups {}, group_max {}, gpus {}: each must be at least 1",
                self.groups, self.group_max, self.gpus
            ));
        }
        if !(self.gpu_mem_mb.is_finite() && self.gpu_mem_mb >= 0.0) {
            return Err(format!("gpu_mem_mb = {}: must be finite and ≥ 0", self.gpu_mem_mb));
        }
        for s in &self.streams {
            if !(s.gpus_needed.is_finite() && s.gpus_needed > 0.0) {
                return Err(format!("stream {:?}: gpus_needed = {} must be > 0", s.name, s.gpus_needed));
            }
            if !(s.mem_mb.is_finite() && s.mem_mb >= 0.0) {
                return Err(format!("stream {:?}: mem_mb = {} must be ≥ 0", s.name, s.mem_mb));
            }
        }
        Ok(())
    }

    /// The affinity sets the streams name, ascending, each once.
    fn affinity_sets(&self) -> Vec<u32> {
        let mut sets: Vec<u32> = self.streams.iter().map(|s| s.affinity).collect();
        sets.sort_unstable();
        sets.dedup();
        sets
    }

    /// Σ n_i per group.
    pub fn loads(&self, assign: &[usize]) -> Vec<f64> {
        let mut load = vec![0.0; self.groups];
        for (s, &j) in self.streams.iter().zip(assign).filter(|(_, &j)| j < self.groups) {
            load[j] += s.gpus_needed;
        }
        load
    }

    /// bt(i) of every stream under `assign` and `sizes` (see the module docs).
    pub fn burst_tolerance(&self, assign: &[usize], sizes: &[u32]) -> Vec<f64> {
        let load = self.loads(assign);
        self.streams
            .iter()
            .zip(assign)
            .map(|(s, &j)| {
                1.0 + (f64::from(sizes.get(j).copied().unwrap_or(0)) - load.get(j).copied().unwrap_or(0.0))
                    / s.gpus_needed
            })
            .collect()
    }

    /// min_i bt(i); +∞ without streams.
    pub fn objective(&self, assign: &[usize], sizes: &[u32]) -> f64 {
        self.burst_tolerance(assign, sizes).into_iter().fold(f64::INFINITY, f64::min)
    }

    /// Checks every constraint against a plan; its objective when they hold.
    pub fn check(&self, assign: &[usize], sizes: &[u32]) -> Result<f64, String> {
        if assign.len() != self.streams.len() || sizes.len() != self.groups {
            return Err(format!(
                "{} entries for {} streams, {} sizes for {} groups",
                assign.len(),
                self.streams.len(),
                sizes.len(),
                self.groups
            ));
        }
        if let Some((i, j)) = assign.iter().enumerate().find(|(_, &j)| j >= self.groups) {
            return Err(format!("stream {i} in group {j} of {}", self.groups));
        }
        let total: u64 = sizes.iter().map(|&s| u64::from(s)).sum();
        if total > u64::from(self.gpus) {
            return Err(format!("{total} GPUs in groups, {} in the cluster", self.gpus));
        }
        let mut mem = vec![0.0; self.groups];
        let mut affinity: Vec<Option<u32>> = vec![None; self.groups];
        for (i, (s, &j)) in self.streams.iter().zip(assign).enumerate() {
            mem[j] += s.mem_mb;
            match affinity[j] {
                Some(c) if c != s.affinity => {
                    return Err(format!("group {j} mixes affinity sets {c} and {} (stream {i})", s.affinity))
                }
                _ => affinity[j] = Some(s.affinity),
            }
        }
        for j in 0..self.groups {
            if sizes[j] > self.group_max {
                return Err(format!("group {j}: {} GPUs over Ḡ = {}", sizes[j], self.group_max));
            }
            if mem[j] > self.gpu_mem_mb * (1.0 + 1e-9) + 1e-9 {
                return Err(format!("group {j}: {:.1} MB of models over {:.1} MB", mem[j], self.gpu_mem_mb));
            }
            if affinity[j].is_some() && sizes[j] == 0 {
                return Err(format!("group {j} serves streams with no GPU"));
            }
        }
        Ok(self.objective(assign, sizes))
    }

    /// An upper bound on the optimum (to state a plan's gap): the largest stream's group holds at
    /// most Ḡ GPUs and all of that stream's load, so t ≤ Ḡ / n_max. And if t ≥ 1, every group's
    /// spare GPUs are at least (t − 1)·n of its largest stream, in at least ⌈Σn / Ḡ⌉ and
    /// ⌈Σmem / mem⌉ groups, so N − Σn ≥ (t − 1)·(n_max + (g − 1)·n_min); otherwise t < 1. So
    /// t ≤ max(1, that pooled bound). (The pooled bound alone is wrong for an overloaded cluster:
    /// with fewer GPUs than Σn no plan reaches t = 1, and the group count argument fails.)
    pub fn upper_bound(&self) -> f64 {
        let n: Vec<f64> = self.streams.iter().map(|s| s.gpus_needed).collect();
        let (total, n_max, n_min) = (
            n.iter().sum::<f64>(),
            n.iter().copied().fold(0.0, f64::max),
            n.iter().copied().fold(f64::INFINITY, f64::min),
        );
        if n.is_empty() {
            return f64::INFINITY;
        }
        let mem: f64 = self.streams.iter().map(|s| s.mem_mb).sum();
        let g = (total / f64::from(self.group_max))
            .ceil()
            .max(if self.gpu_mem_mb > 0.0 { (mem / self.gpu_mem_mb).ceil() } else { 1.0 })
            .max(1.0);
        let pooled = 1.0 + (f64::from(self.gpus) - total) / (n_max + (g - 1.0) * n_min);
        (f64::from(self.group_max) / n_max).min(pooled.max(1.0))
    }

    /// Gives the cluster's GPUs to the groups that serve streams — one each, then one at a time
    /// to the group whose worst stream tolerates least (water-filling, which is optimal for a
    /// fixed assignment since each group's worst bt only grows with its size). `None` when
    /// there are more such groups than GPUs.
    pub fn sizes_for(&self, assign: &[usize]) -> Option<Vec<u32>> {
        let load = self.loads(assign);
        // The group's worst bt is that of its largest stream when it has spare GPUs, its
        // smallest when it is short: keep both.
        let mut big = vec![0.0f64; self.groups];
        let mut small = vec![f64::INFINITY; self.groups];
        for (s, &j) in self.streams.iter().zip(assign) {
            big[j] = big[j].max(s.gpus_needed);
            small[j] = small[j].min(s.gpus_needed);
        }
        let used: Vec<usize> = (0..self.groups).filter(|&j| big[j] > 0.0).collect();
        let mut sizes = vec![0u32; self.groups];
        if used.len() as u64 > u64::from(self.gpus) {
            return None;
        }
        for &j in &used {
            sizes[j] = 1;
        }
        let worst = |j: usize, size: u32| {
            let spare = f64::from(size) - load[j];
            1.0 + spare / if spare >= 0.0 { big[j] } else { small[j] }
        };
        let mut left = self.gpus - used.len() as u32;
        while left > 0 {
            let Some(j) = used
                .iter()
                .copied()
                .filter(|&j| sizes[j] < self.group_max)
                .min_by(|&a, &b| worst(a, sizes[a]).total_cmp(&worst(b, sizes[b])).then(a.cmp(&b)))
            else {
                break;
            };
            sizes[j] += 1;
            left -= 1;
        }
        Some(sizes)
    }

    /// The greedy plan: groups shared among the affinity sets in proportion to their load (at
    /// least one each), largest model-stream first into the least-loaded group of its set that
    /// has memory for it, water-filled sizes; then moves of the worst stream to another group
    /// while that raises the minimum. `None` when it finds no room.
    pub fn greedy(&self) -> Option<(Vec<usize>, Vec<u32>)> {
        let sets = self.affinity_sets();
        if sets.len() > self.groups {
            return None;
        }
        let set_load: Vec<f64> = sets
            .iter()
            .map(|&c| self.streams.iter().filter(|s| s.affinity == c).map(|s| s.gpus_needed).sum())
            .collect();
        let total: f64 = set_load.iter().sum();
        // Groups per set: one each, the rest by largest remainder of the load share.
        let mut count = vec![1usize; sets.len()];
        let spare = self.groups - sets.len();
        let share: Vec<f64> = set_load.iter().map(|l| spare as f64 * l / total.max(1e-12)).collect();
        for (c, s) in count.iter_mut().zip(&share) {
            *c += s.floor() as usize;
        }
        let mut rest: Vec<usize> = (0..sets.len()).collect();
        rest.sort_by(|&a, &b| (share[b] - share[b].floor()).total_cmp(&(share[a] - share[a].floor())));
        let left = self.groups - count.iter().sum::<usize>();
        for &c in rest.iter().cycle().take(left) {
            count[c] += 1;
        }
        let mut owner = Vec::with_capacity(self.groups);
        for (c, &n) in count.iter().enumerate() {
            owner.extend(std::iter::repeat_n(sets[c], n));
        }
        let mut order: Vec<usize> = (0..self.streams.len()).collect();
        order.sort_by(|&a, &b| self.streams[b].gpus_needed.total_cmp(&self.streams[a].gpus_needed).then(a.cmp(&b)));
        let mut assign = vec![0usize; self.streams.len()];
        let (mut load, mut mem) = (vec![0.0f64; self.groups], vec![0.0f64; self.groups]);
        for i in order {
            let s = &self.streams[i];
            let j = (0..self.groups)
                .filter(|&j| owner[j] == s.affinity && mem[j] + s.mem_mb <= self.gpu_mem_mb)
                .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))?;
            assign[i] = j;
            load[j] += s.gpus_needed;
            mem[j] += s.mem_mb;
        }
        let mut sizes = self.sizes_for(&assign)?;
        let mut best = self.check(&assign, &sizes).ok()?;
        for _ in 0..self.streams.len() {
            let bt = self.burst_tolerance(&assign, &sizes);
            let Some(worst) = (0..bt.len()).min_by(|&a, &b| bt[a].total_cmp(&bt[b])) else { break };
            let from = assign[worst];
            let mut improved = None;
            for j in (0..self.groups).filter(|&j| j != from) {
                assign[worst] = j;
                if let Some(sz) = self.sizes_for(&assign) {
                    if let Ok(o) = self.check(&assign, &sz) {
                        if o > best + 1e-9 && improved.as_ref().is_none_or(|(_, _, b)| o > *b) {
                            improved = Some((j, sz, o));
                        }
                    }
                }
                assign[worst] = from;
            }
            let Some((j, sz, o)) = improved else { break };
            assign[worst] = j;
            sizes = sz;
            best = o;
        }
        Some((assign, sizes))
    }

    /// The better of HERD's two constructions by the minimum burst tolerance: the greedy plan
    /// ([`HerdProblem::greedy`]) and the sorted-runs plan (`plan/herd/runs.rs`) with water-filled
    /// sizes, its bisection stopped after `budget`; greedy on a tie. `None` when neither finds a
    /// plan. (Sorted runs take 0.21 s on 1,000 streams in 10 groups, release.)
    ///
    /// What the simulator's partitions use is the greedy plan, not this one: a plan with a higher
    /// minimum burst tolerance is not one with more goodput when every rate grows (see the
    /// README's epoch-planning section, measured on `scale_64gpus.toml`).
    pub fn heuristic(&self, budget: std::time::Duration) -> Option<(Vec<usize>, Vec<u32>)> {
        self.or_runs(self.checked_greedy(), budget).map(|(a, s, _)| (a, s))
    }

    /// The greedy plan with its objective, when it is feasible.
    fn checked_greedy(&self) -> Option<(Vec<usize>, Vec<u32>, f64)> {
        self.greedy().and_then(|(a, s)| self.check(&a, &s).ok().map(|o| (a, s, o)))
    }

    /// [`HerdProblem::heuristic`] from a greedy plan already made: it, or the sorted-runs plan
    /// when that is strictly better; with its objective.
    fn or_runs(
        &self,
        greedy: Option<(Vec<usize>, Vec<u32>, f64)>,
        budget: std::time::Duration,
    ) -> Option<(Vec<usize>, Vec<u32>, f64)> {
        let runs = self
            .runs(Instant::now() + budget)
            .and_then(|a| self.sizes_for(&a).map(|s| (a, s)))
            .and_then(|(a, s)| self.check(&a, &s).ok().map(|o| (a, s, o)));
        match (greedy, runs) {
            (Some(g), Some(r)) if r.2 > g.2 + 1e-9 => Some(r),
            (g @ Some(_), _) => g,
            (None, r) => r,
        }
    }

    /// Plans the epoch: the heuristic plan ([`HerdProblem::heuristic`], within half the
    /// budget), then the ILP within the rest, warm-started from it. `Err` when neither finds a
    /// feasible plan. `greedy_objective` stays the greedy plan's; `source` is
    /// [`Source::Heuristic`] when the sorted runs beat it and the solver found nothing better.
    pub fn solve(&self, solver: SolverKind, budget: std::time::Duration) -> Result<Plan, String> {
        self.validate()?;
        let started = Instant::now();
        let greedy = self.checked_greedy();
        let greedy_objective = greedy.as_ref().map(|g| g.2);
        // The constructions get half the budget, as Symphony's local search does; the solver
        // the rest.
        let heuristic = self.or_runs(greedy, budget / 2);
        let remaining = budget.saturating_sub(started.elapsed());
        let solved =
            self.milp(heuristic.as_ref().map(|(a, s, _)| (a.as_slice(), s.as_slice()))).and_then(|(milp, x, size)| {
                let mut read = x.clone();
                read.extend(&size);
                let s = milp.solve(solver, remaining, &read)?;
                let (xs, ss) = s.values.split_at(x.len());
                let sizes = ss
                    .iter()
                    .map(|&v| {
                        if v.is_finite() && (v - v.round()).abs() < 1e-4 && v > -0.5 {
                            Ok(v.round() as u32)
                        } else {
                            Err(format!("a group size of {v}"))
                        }
                    })
                    .collect::<Result<Vec<u32>, String>>()?;
                Ok((decode(xs, self.streams.len(), self.groups)?, sizes, s.status))
            });
        let mut plan = choose(heuristic, solved, |a, s| self.check(a, s), |g, o| g > o + 1e-9, started)?;
        match greedy_objective {
            Some(g) => {
                if plan.source == Source::Greedy && plan.objective > g + 1e-9 {
                    plan.source = Source::Heuristic;
                }
                plan.greedy_objective = g;
            }
            None => {
                if plan.source == Source::Greedy {
                    plan.source = Source::Heuristic;
                }
                plan.greedy_objective = f64::NAN;
            }
        }
        plan.solve_seconds = started.elapsed().as_secs_f64();
        Ok(plan)
    }

    /// The linearised ILP (module docs), warm-started from `warm`; also the x variables (row by
    /// row) and the group sizes.
    #[allow(clippy::type_complexity)]
    fn milp(&self, warm: Option<(&[usize], &[u32])>) -> Result<(Milp, Vec<Variable>, Vec<Variable>), String> {
        let (m, g) = (self.streams.len(), self.groups);
        let total: f64 = self.streams.iter().map(|s| s.gpus_needed).sum();
        let n_min = self.streams.iter().map(|s| s.gpus_needed).fold(f64::INFINITY, f64::min);
        if m == 0 {
            return Err("no streams".into());
        }
        // bt ≤ the upper bound (≤ 1 + Ḡ / n_min), and ≥ 1 − total / n_min (a group of 0 GPUs
        // with every stream); with a warm start, only plans at least as good are of interest.
        // Tight bounds on t keep the big-M coefficients small: with t ranging up to 1 + Ḡ/n_min
        // (10⁶ for a stream needing 10⁻⁴ of a GPU), Clp's root LP did not finish in a minute on
        // HERD 1,000.
        let t_hi = (1.0 + f64::from(self.group_max) / n_min).min(self.upper_bound());
        let t_lo = warm.map_or(1.0 - total / n_min, |(a, sz)| self.objective(a, sz).min(t_hi));
        // With t ≥ 1 no group is short of GPUs (size_j ≥ load_j), which bounds load − size by 0.
        let spare_ok = t_lo >= 1.0;
        let mut vars = variables!();
        let x: Vec<Variable> = (0..m * g).map(|_| vars.add(variable().binary())).collect();
        let size: Vec<Variable> =
            (0..g).map(|_| vars.add(variable().integer().min(0.0).max(f64::from(self.group_max)))).collect();
        let load: Vec<Variable> = (0..g).map(|_| vars.add(variable().min(0.0))).collect();
        let t = vars.add(variable().min(t_lo).max(t_hi));
        let sets = self.affinity_sets();
        let y: Vec<Vec<Variable>> = if sets.len() > 1 {
            sets.iter().map(|_| (0..g).map(|_| vars.add(variable().binary())).collect()).collect()
        } else {
            Vec::new()
        };
        let mut cs = Vec::new();
        let all: Expression = size.iter().copied().sum();
        cs.push(constraint!(all <= f64::from(self.gpus)));
        for i in 0..m {
            let row: Expression = (0..g).map(|j| x[i * g + j]).sum();
            cs.push(constraint!(row == 1.0));
        }
        // Each affinity set's streams, for the per-group affinity rows.
        let members_of: Vec<Vec<usize>> =
            sets.iter().map(|&c| (0..m).filter(|&i| self.streams[i].affinity == c).collect()).collect();
        for j in 0..g {
            let l: Expression = (0..m).map(|i| self.streams[i].gpus_needed * x[i * g + j]).sum();
            cs.push(constraint!(l == load[j]));
            let mem: Expression = (0..m).map(|i| self.streams[i].mem_mb * x[i * g + j]).sum();
            cs.push(constraint!(mem <= self.gpu_mem_mb));
            // A group that serves a stream has a GPU; a stream's group is of its affinity set.
            // Aggregated over the group (one row per group and set, not one per stream): the
            // same integer solutions with a third of the rows.
            let members: Expression = (0..m).map(|i| x[i * g + j]).sum();
            cs.push(constraint!(members <= (m as f64) * size[j]));
            if !y.is_empty() {
                let one: Expression = y.iter().map(|row| row[j]).sum();
                cs.push(constraint!(one <= 1.0));
                for (inside, row) in members_of.iter().zip(&y) {
                    let of_set: Expression = inside.iter().map(|&i| x[i * g + j]).sum();
                    cs.push(constraint!(of_set <= (inside.len() as f64) * row[j]));
                }
            }
            if spare_ok {
                cs.push(constraint!(load[j] <= size[j]));
            }
            for i in 0..m {
                let s = &self.streams[i];
                let big = (t_hi - 1.0) * s.gpus_needed + if spare_ok { 0.0 } else { total };
                let xij = x[i * g + j];
                cs.push(constraint!(s.gpus_needed * t - size[j] + load[j] + big * xij <= big + s.gpus_needed));
            }
        }
        let mut warm_values = Vec::new();
        if let Some((a, sz)) = warm {
            let loads = self.loads(a);
            for i in 0..m {
                for j in 0..g {
                    warm_values.push((x[i * g + j], if a[i] == j { 1.0 } else { 0.0 }));
                }
            }
            warm_values.extend(size.iter().zip(sz).map(|(&v, &s)| (v, f64::from(s))));
            warm_values.extend(load.iter().zip(&loads).map(|(&v, &l)| (v, l)));
            warm_values.push((t, self.objective(a, sz)));
            for (c, row) in sets.iter().zip(&y) {
                for (j, &v) in row.iter().enumerate() {
                    let on = self.streams.iter().zip(a).any(|(s, &aj)| aj == j && s.affinity == *c);
                    warm_values.push((v, if on { 1.0 } else { 0.0 }));
                }
            }
        }
        Ok((Milp { vars, objective: t.into(), maximise: true, constraints: cs, warm: warm_values }, x, size))
    }
}
