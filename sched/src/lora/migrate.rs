//! dLoRA's reactive mechanism (§5.2): request–adapter co-migration as an ILP.
//!
//! For the requests on the replicas considered (the top-K overloaded ones; requests on the
//! underloaded ones stay and count as each replica's base load), choose a replica for each so
//! that the largest estimated replica time is smallest:
//!
//! ```text
//! time_j = base_ms_j + Σ_i (L_i + move_i·[j ≠ from_i])·x_ij + η·Σ_k y_kj + s_j / B
//! s_j ≥ base_mem_j + Σ_i M_i·x_ij + M_A·Σ_k y_kj − capacity_j,  s_j ≥ 0
//! Σ_j x_ij = 1;  x_ij ≤ y_(k(i))j  (a request only where its adapter is);  minimise max_j time_j
//! ```
//!
//! `L_i` is the request's estimated remaining execution time, `move_i` the time to move its KV
//! cache (the paper scales `L_i` by a migration factor γ; `L_i + move_i` is that product written
//! out per request). `y_kj` exists only for adapters not resident on `j` (a resident one costs
//! nothing more), so `η·Σ y` is the affinity penalty of adapters a replica gains. Memory is the
//! paper's relaxation: no GPU/host split, KV beyond a replica's capacity is charged as swapping at
//! bandwidth `B` (`s_j`), never refused.
//!
//! Solved with `good_lp` on the pure-Rust `microlp` backend within a time budget. With `relax`
//! (the paper's relaxation), `x` is continuous and each request goes where its `x` is largest.
//! A greedy plan (move the request that most lowers the objective, from the busiest replica,
//! until none does) is computed first: it bounds the ILP's objective, is the fallback when the
//! solver fails or runs out of time, and wins whenever the rounded ILP plan is not better. Every
//! plan is checked ([`MigProblem::check`]) before it is returned.

use std::time::{Duration, Instant};

use good_lp::{
    constraint, variable, variables, Expression, ResolutionError, Solution, SolverModel, Variable, WithTimeLimit,
};

use super::AdapterId;

/// Bytes to MB.
const MB: f64 = 1e-6;

/// A request that may move.
#[derive(Debug, Clone, PartialEq)]
pub struct MigRequest {
    /// Its adapter.
    pub adapter: AdapterId,
    /// Its replica now (an index into [`MigProblem::replicas`]).
    pub from: usize,
    /// Estimated remaining execution time, ms (`L_i`).
    pub exec_ms: f64,
    /// Its KV memory, bytes (`M_i`).
    pub mem_bytes: f64,
    /// Moving its KV cache to another replica, ms.
    pub move_ms: f64,
}

/// A replica of the problem.
#[derive(Debug, Clone, PartialEq)]
pub struct MigReplica {
    /// Work that stays here, ms.
    pub base_ms: f64,
    /// Memory that stays here (its other requests' KV and its adapters), bytes.
    pub base_mem: f64,
    /// Its memory, bytes.
    pub capacity: f64,
    /// Adapters resident on it.
    pub resident: Vec<AdapterId>,
}

/// One co-migration problem.
#[derive(Debug, Clone, PartialEq)]
pub struct MigProblem {
    /// The requests that may move.
    pub requests: Vec<MigRequest>,
    /// The replicas considered.
    pub replicas: Vec<MigReplica>,
    /// One adapter's memory, bytes (`M_A`).
    pub adapter_bytes: f64,
    /// Affinity penalty per adapter a replica gains, ms (η).
    pub eta_ms: f64,
    /// Swap bandwidth, bytes per ms (B).
    pub swap_bytes_per_ms: f64,
}

/// Who produced a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlanSource {
    /// The solver (rounded when relaxed).
    Ilp,
    /// The greedy plan (the solver failed, ran out of time, or did no better).
    Greedy,
}

/// A checked plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MigPlan {
    /// The replica of each request.
    pub to: Vec<usize>,
    /// Its objective, ms.
    pub objective: f64,
    /// The greedy plan's objective, ms.
    pub greedy_objective: f64,
    /// The objective with nothing moved, ms.
    pub stay_objective: f64,
    /// Who produced it.
    pub source: PlanSource,
    /// Why the solver's plan was not used, when it was not.
    pub solver_note: Option<String>,
    /// Solver time, ms.
    pub solve_ms: f64,
}

impl MigProblem {
    /// Each replica's estimated time under `to`.
    pub fn times(&self, to: &[usize]) -> Vec<f64> {
        let n = self.replicas.len();
        let mut ms: Vec<f64> = self.replicas.iter().map(|r| r.base_ms).collect();
        let mut mem: Vec<f64> = self.replicas.iter().map(|r| r.base_mem).collect();
        let mut gained: Vec<Vec<AdapterId>> = vec![Vec::new(); n];
        for (r, &j) in self.requests.iter().zip(to) {
            ms[j] += r.exec_ms + if j != r.from { r.move_ms } else { 0.0 };
            mem[j] += r.mem_bytes;
            if !self.replicas[j].resident.contains(&r.adapter) && !gained[j].contains(&r.adapter) {
                gained[j].push(r.adapter);
            }
        }
        (0..n)
            .map(|j| {
                let k = gained[j].len() as f64;
                let over = (mem[j] + self.adapter_bytes * k - self.replicas[j].capacity).max(0.0);
                ms[j] + self.eta_ms * k + over / self.swap_bytes_per_ms
            })
            .collect()
    }

    /// The objective (the largest replica time) of `to`.
    pub fn objective(&self, to: &[usize]) -> f64 {
        self.times(to).into_iter().fold(0.0, f64::max)
    }

    /// Checks that `to` places every request exactly once on a replica of the problem and gives
    /// a finite objective.
    pub fn check(&self, to: &[usize]) -> Result<f64, String> {
        if to.len() != self.requests.len() {
            return Err(format!("plan places {} requests, the problem has {}", to.len(), self.requests.len()));
        }
        if let Some(&j) = to.iter().find(|&&j| j >= self.replicas.len()) {
            return Err(format!("plan names replica {j} of {}", self.replicas.len()));
        }
        let obj = self.objective(to);
        if !obj.is_finite() {
            return Err(format!("plan's objective is {obj}"));
        }
        Ok(obj)
    }

    /// Nothing moved.
    pub fn stay(&self) -> Vec<usize> {
        self.requests.iter().map(|r| r.from).collect()
    }

    /// The greedy plan: from nothing moved, repeatedly apply the single move of a request on the
    /// busiest replica that lowers the objective most, until none does.
    pub fn greedy(&self) -> Vec<usize> {
        let mut to = self.stay();
        let mut best = self.objective(&to);
        for _ in 0..self.requests.len() * self.replicas.len() {
            let times = self.times(&to);
            let busiest = (0..times.len()).max_by(|&a, &b| times[a].total_cmp(&times[b])).unwrap_or(0);
            let mut step: Option<(usize, usize, f64)> = None;
            let on_busiest: Vec<usize> = (0..to.len()).filter(|&i| to[i] == busiest).collect();
            for i in on_busiest {
                for j in (0..self.replicas.len()).filter(|&j| j != busiest) {
                    to[i] = j;
                    let o = self.objective(&to);
                    to[i] = busiest;
                    if o < best - 1e-9 && step.is_none_or(|s| o < s.2) {
                        step = Some((i, j, o));
                    }
                }
            }
            let Some((i, j, o)) = step else { break };
            to[i] = j;
            best = o;
        }
        to
    }

    /// The exact optimum by enumeration (tests; `replicas ^ requests` plans).
    pub fn brute_force(&self) -> (Vec<usize>, f64) {
        let (n, r) = (self.requests.len(), self.replicas.len());
        let mut to = vec![0usize; n];
        let mut best = (to.clone(), self.objective(&to));
        loop {
            let mut i = 0;
            while i < n {
                to[i] += 1;
                if to[i] < r {
                    break;
                }
                to[i] = 0;
                i += 1;
            }
            if i == n {
                return best;
            }
            let o = self.objective(&to);
            if o < best.1 - 1e-9 {
                best = (to.clone(), o);
            }
        }
    }

    /// Solves the problem (see the module docs): the solver's plan when it is valid and no worse
    /// than the greedy one, else the greedy plan.
    pub fn solve(&self, relax: bool, budget: Duration) -> MigPlan {
        let greedy = self.greedy();
        let greedy_objective = self.objective(&greedy);
        let stay_objective = self.objective(&self.stay());
        let t = Instant::now();
        let solved = self.ilp(relax, budget, greedy_objective);
        let solve_ms = t.elapsed().as_secs_f64() * 1e3;
        let (to, source, solver_note) = match solved.and_then(|to| self.check(&to).map(|o| (to, o))) {
            Ok((to, o)) if o <= greedy_objective + 1e-9 => (to, PlanSource::Ilp, None),
            Ok((_, o)) => {
                (greedy.clone(), PlanSource::Greedy, Some(format!("rounded plan {o:.3} ms worse than greedy")))
            }
            Err(e) => (greedy.clone(), PlanSource::Greedy, Some(e)),
        };
        let objective = self.objective(&to);
        MigPlan { to, objective, greedy_objective, stay_objective, source, solver_note, solve_ms }
    }

    fn ilp(&self, relax: bool, budget: Duration, bound: f64) -> Result<Vec<usize>, String> {
        let (n, m) = (self.requests.len(), self.replicas.len());
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut vars = variables!();
        let z = vars.add(variable().min(0.0));
        let x: Vec<Vec<Variable>> = (0..n)
            .map(|_| {
                (0..m)
                    .map(|_| vars.add(if relax { variable().min(0.0).max(1.0) } else { variable().binary() }))
                    .collect()
            })
            .collect();
        let s: Vec<Variable> = (0..m).map(|_| vars.add(variable().min(0.0))).collect();
        // y for (adapter, replica) pairs where the adapter is not resident.
        let mut adapters: Vec<AdapterId> = self.requests.iter().map(|r| r.adapter).collect();
        adapters.sort_unstable();
        adapters.dedup();
        let mut y: Vec<Vec<Option<Variable>>> = vec![vec![None; m]; adapters.len()];
        for (row, &a) in y.iter_mut().zip(&adapters) {
            for (cell, rep) in row.iter_mut().zip(&self.replicas) {
                if !rep.resident.contains(&a) {
                    *cell = Some(vars.add(variable().binary()));
                }
            }
        }
        let mut model = vars.minimise(z).using(good_lp::microlp).with_time_limit(budget.as_secs_f64());
        model = model.with(constraint!(z <= bound + 1e-6));
        for row in &x {
            let sum: Expression = row.iter().copied().sum();
            model = model.with(constraint!(sum == 1.0));
        }
        for (i, r) in self.requests.iter().enumerate() {
            let k = adapters.binary_search(&r.adapter).map_err(|_| "adapter index".to_string())?;
            for j in 0..m {
                if let Some(yv) = y[k][j] {
                    model = model.with(constraint!(x[i][j] <= yv));
                }
            }
        }
        for j in 0..m {
            let rep = &self.replicas[j];
            let gained: Expression = y.iter().filter_map(|row| row[j]).sum();
            // Memory in MB inside the model, so that its coefficients stay near the times'.
            let mut mem =
                Expression::from((rep.base_mem - rep.capacity) * MB) + gained.clone() * (self.adapter_bytes * MB);
            let mut time =
                Expression::from(rep.base_ms) + gained * self.eta_ms + s[j] * (1.0 / (self.swap_bytes_per_ms * MB));
            for (i, r) in self.requests.iter().enumerate() {
                mem += x[i][j] * (r.mem_bytes * MB);
                time += x[i][j] * (r.exec_ms + if j != r.from { r.move_ms } else { 0.0 });
            }
            model = model.with(constraint!(s[j] >= mem));
            model = model.with(constraint!(z >= time));
        }
        let sol = model.solve().map_err(|e: ResolutionError| format!("microlp: {e}"))?;
        Ok(x.iter()
            .map(|row| {
                (0..m).max_by(|&a, &b| sol.value(row[a]).total_cmp(&sol.value(row[b])).then(b.cmp(&a))).unwrap_or(0)
            })
            .collect())
    }
}
