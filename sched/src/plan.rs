//! Epoch-scale planning: which models go to which sub-cluster (Symphony, seed `001_…` §4.7 and
//! Appendix A.1) and which streams, models and GPUs form a serving group (Shepherd's HERD, seed
//! `003_…` §4).
//!
//! * [`symphony`] — the partitioning MILP: balance request rate and static memory over `l`
//!   sub-clusters within the dispatcher's rate limit, the backends' memory and a disruption
//!   budget against the previous epoch;
//! * [`herd`] — HERD's ILP: group sizes and a group per model-stream maximising the minimum burst
//!   tolerance, within the cluster size, the group-worker limit, GPU memory and affinity sets;
//! * [`instance`] — plan files (TOML): explicit models or a generated zoo, and each planner's
//!   parameters; what `epoch-plan` reads.
//!
//! Both planners work the same way, as the issue that introduced them asks: a heuristic plan
//! first — greedy; Symphony's improved by local search, HERD's the better of greedy and sorted
//! runs; it is the fallback and the solver's warm start —, then the MILP on `good_lp` within a time
//! budget (pure-Rust `microlp` by default, CBC with the `cbc` feature), and every plan a solver
//! returns is re-checked against every constraint before it is used: a solver that overruns,
//! fails or returns garbage leaves the greedy plan in place, and [`Plan::note`] says why.

pub mod herd;
pub mod instance;
pub mod symphony;
#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

use good_lp::solvers::{SolutionStatus, WithInitialSolution, WithTimeLimit};
use good_lp::{Constraint, Expression, ProblemVariables, Solution, SolverModel, Variable};

crate::named_enum! {
    /// Which MILP solver `good_lp` drives.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum SolverKind("solver") {
        /// `microlp`: pure Rust, always built.
        Microlp = "microlp",
        /// COIN-OR CBC (`coin_cbc`, Debian `coinor-libcbc-dev`): only with the `cbc` cargo feature.
        Cbc = "cbc",
    }
}

impl SolverKind {
    /// The time limit to give the solver itself so that its answer arrives within `budget`:
    /// microlp overruns by ~20% at 1 s (90% of the budget), CBC checks its clock only between
    /// branch-and-bound nodes and then spends ~2.5 s winding down on HERD 1,000 (measured: a
    /// 36 s limit answered after 38.6 s), so it gets 90% less 2.5 s, at least half the budget.
    pub fn own_limit(self, budget: Duration) -> Duration {
        let limit = budget.mul_f64(0.9);
        match self {
            SolverKind::Microlp => limit,
            SolverKind::Cbc => limit.saturating_sub(Duration::from_millis(2500)).max(budget / 2),
        }
    }
}

/// Where a plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The solver proved it optimal.
    Optimal,
    /// The solver's best plan when its time budget ran out (checked feasible, no worse than greedy).
    SolverIncumbent,
    /// The greedy plan: the solver found nothing better, failed, or returned an infeasible plan.
    Greedy,
    /// The greedy plan improved by local search (Symphony), the solver finding nothing better.
    LocalSearch,
    /// HERD's sorted-runs construction found a better plan than greedy, the solver nothing
    /// better.
    Heuristic,
}

/// A planner's answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// Group (sub-cluster) of each model, by the instance's model order.
    pub assignment: Vec<usize>,
    /// GPUs per group (HERD); empty for Symphony, whose sub-cluster sizes are not planned here.
    pub group_sizes: Vec<u32>,
    /// The objective of [`Plan::assignment`] (Symphony: ΔR + w·ΔS, lower is better; HERD: the
    /// minimum burst tolerance, higher is better).
    pub objective: f64,
    /// The greedy (constructive) plan's objective.
    pub greedy_objective: f64,
    /// Where the plan came from.
    pub source: Source,
    /// Why the solver's answer was not used, when it was not.
    pub note: Option<String>,
    /// Wall time of the whole planning (greedy, model building, solving, checking), seconds.
    pub solve_seconds: f64,
}

/// What the solver returned: the values of the variables asked for and how it ended.
pub(crate) struct Solved {
    pub(crate) values: Vec<f64>,
    pub(crate) status: SolutionStatus,
}

/// A MILP built on `good_lp`'s types, independent of the solver that will run it.
pub(crate) struct Milp {
    pub(crate) vars: ProblemVariables,
    pub(crate) objective: Expression,
    pub(crate) maximise: bool,
    pub(crate) constraints: Vec<Constraint>,
    /// A feasible assignment of every variable (the greedy plan), for the solver's warm start.
    pub(crate) warm: Vec<(Variable, f64)>,
}

impl Milp {
    /// Solves within `budget`, returning the values of `read`.
    ///
    /// Solvers overrun their own time limits (microlp by ~20% at 1 s, CBC by most of a second
    /// while it sets up), so the solver runs on its own thread with 90% of the budget as its
    /// limit, and is abandoned — left to stop at its own limit — if it has not answered when the
    /// budget is spent: the planner's latency is the budget, whatever the solver does.
    pub(crate) fn solve(self, solver: SolverKind, budget: Duration, read: &[Variable]) -> Result<Solved, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let read = read.to_vec();
        let started = Instant::now();
        std::thread::Builder::new()
            .name(format!("{}-milp", solver.name()))
            .spawn(move || {
                let _ = tx.send(self.solve_here(solver, solver.own_limit(budget), &read));
            })
            .map_err(|e| format!("cannot start the solver's thread: {e}"))?;
        match rx.recv_timeout(budget) {
            Ok(r) => r,
            Err(_) => Err(format!(
                "{} gave no answer within the {:.2} s budget ({:.2} s elapsed); abandoned",
                solver.name(),
                budget.as_secs_f64(),
                started.elapsed().as_secs_f64()
            )),
        }
    }

    fn solve_here(self, solver: SolverKind, budget: Duration, read: &[Variable]) -> Result<Solved, String> {
        let Milp { vars, objective, maximise, constraints, warm } = self;
        let problem = if maximise { vars.maximise(objective) } else { vars.minimise(objective) };
        match solver {
            SolverKind::Microlp => run(problem.using(good_lp::microlp), constraints, warm, budget, read),
            #[cfg(feature = "cbc")]
            SolverKind::Cbc => {
                let mut model = problem.using(good_lp::coin_cbc);
                model.set_parameter("log", "0");
                model.set_parameter("slogLevel", "0");
                // CBC 2.10.8 (Debian) crashes in CglPreProcess::postProcess when its time limit
                // stops a search on HERD's 200-stream ILP; without preprocessing it does not.
                model.set_parameter("preprocess", "off");
                run(model, constraints, warm, budget, read)
            }
            #[cfg(not(feature = "cbc"))]
            SolverKind::Cbc => Err("this build has no CBC: rebuild with `--features cbc`".into()),
        }
    }
}

fn run<M>(
    model: M,
    constraints: Vec<Constraint>,
    warm: Vec<(Variable, f64)>,
    budget: Duration,
    read: &[Variable],
) -> Result<Solved, String>
where
    M: SolverModel + WithTimeLimit + WithInitialSolution,
    M::Error: std::fmt::Display,
{
    let model = model.with_all(constraints).with_time_limit(budget.as_secs_f64()).with_initial_solution(warm);
    let sol = model.solve().map_err(|e| e.to_string())?;
    Ok(Solved { values: read.iter().map(|&v| sol.value(v)).collect(), status: sol.status() })
}

/// Reads a 0/1 assignment matrix (`x[i][j]`, flattened row by row over `groups`) back into one
/// group per item, refusing values that are not integral or rows that do not pick exactly one
/// group — what a solver returning garbage looks like.
pub(crate) fn decode(values: &[f64], items: usize, groups: usize) -> Result<Vec<usize>, String> {
    if values.len() != items * groups {
        return Err(format!("{} values for {items} × {groups} variables", values.len()));
    }
    let mut out = Vec::with_capacity(items);
    for (i, row) in values.chunks(groups).enumerate() {
        if let Some(v) = row.iter().find(|v| !v.is_finite() || (**v - v.round()).abs() > 1e-4) {
            return Err(format!("x[{i}] holds {v}, not 0 or 1"));
        }
        let ones: Vec<usize> = (0..groups).filter(|&j| row[j] > 0.5).collect();
        match ones.as_slice() {
            [j] => out.push(*j),
            _ => return Err(format!("item {i} is in {} groups", ones.len())),
        }
    }
    Ok(out)
}

/// Picks between the greedy plan and the solver's: the solver's when it is feasible (`check`
/// returns its objective) and better than greedy, or as good and proved optimal; `better(a, b)`
/// is "a is strictly better". Without a greedy plan, the solver's if it is feasible; `Err` when
/// neither is.
pub(crate) fn choose(
    greedy: Option<(Vec<usize>, Vec<u32>, f64)>,
    solved: Result<(Vec<usize>, Vec<u32>, SolutionStatus), String>,
    check: impl Fn(&[usize], &[u32]) -> Result<f64, String>,
    better: impl Fn(f64, f64) -> bool,
    started: Instant,
) -> Result<Plan, String> {
    let source = |status: &SolutionStatus| {
        if matches!(status, SolutionStatus::Optimal) {
            Source::Optimal
        } else {
            Source::SolverIncumbent
        }
    };
    let Some((g_assign, g_sizes, g_obj)) = greedy else {
        let (a, s, status) = solved.map_err(|e| format!("greedy found no feasible plan, and the solver: {e}"))?;
        let o =
            check(&a, &s).map_err(|e| format!("greedy found no feasible plan, and the solver's is infeasible: {e}"))?;
        return Ok(Plan {
            assignment: a,
            group_sizes: s,
            objective: o,
            greedy_objective: f64::NAN,
            source: source(&status),
            note: Some("greedy found no feasible plan".into()),
            solve_seconds: started.elapsed().as_secs_f64(),
        });
    };
    let fallback = |note: String| Plan {
        assignment: g_assign.clone(),
        group_sizes: g_sizes.clone(),
        objective: g_obj,
        greedy_objective: g_obj,
        source: Source::Greedy,
        note: Some(note),
        solve_seconds: started.elapsed().as_secs_f64(),
    };
    Ok(match solved {
        Err(e) => fallback(format!("solver: {e}")),
        Ok((a, s, status)) => match check(&a, &s) {
            Err(e) => fallback(format!("the solver's plan is infeasible ({e}); greedy kept")),
            Ok(o) if better(g_obj, o) => fallback(format!("the solver's plan ({o:.6}) is worse than greedy")),
            // A tie counts for the solver only when it proved the plan optimal.
            Ok(o) if !better(o, g_obj) && !matches!(status, SolutionStatus::Optimal) => {
                fallback(format!("the solver found nothing better ({o:.6}) within its budget"))
            }
            Ok(o) => Plan {
                assignment: a,
                group_sizes: s,
                objective: o,
                greedy_objective: g_obj,
                source: source(&status),
                note: None,
                solve_seconds: started.elapsed().as_secs_f64(),
            },
        },
    })
}

/// The imbalance factor of Symphony's Figure 15: (max − min) / mean over the groups.
pub fn imbalance(per_group: &[f64]) -> f64 {
    let n = per_group.len().max(1) as f64;
    let mean = per_group.iter().sum::<f64>() / n;
    let max = per_group.iter().copied().fold(f64::MIN, f64::max);
    let min = per_group.iter().copied().fold(f64::MAX, f64::min);
    if mean > 0.0 {
        (max - min) / mean
    } else {
        0.0
    }
}
