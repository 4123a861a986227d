//! `epoch-plan`: one epoch's plan for Symphony's sub-clusters (seed `001_…`, Appendix A) or
//! Shepherd's HERD groups (seed `003_…`, §4) from a plan file (`cascade_sched::plan::instance`).
//!
//! `epoch-plan --kind symphony --scenario sched/plans/symphony_400x4.toml --json`
//!
//! The plan printed is always one that passed every constraint (`feasible: true`); when no plan
//! is found the JSON says `feasible: false` with the reason and the exit status is 2.
//! `--random S` also runs the paper's random-partition baseline for S seconds (Symphony only),
//! and `--previous PLAN.json` plans the next epoch against an earlier `--json` output within the
//! file's disruption budget. `--metrics-file F` also writes the run's solver time, objectives and
//! outcome as OpenMetrics text (the format the nodes' `/metrics` serve) for a batch-job collector
//! (a Pushgateway, or a textfile collector that reads OpenMetrics), written whole or not at all.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use cascade_sched::plan::instance::PlanFile;
use cascade_sched::plan::{imbalance, Plan, SolverKind};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(about = "Epoch-scale planning: Symphony's sub-cluster MILP or Shepherd's HERD groups")]
struct Cli {
    /// symphony or herd.
    #[arg(long)]
    kind: String,
    /// The plan file (TOML; see `cascade_sched::plan::instance`).
    #[arg(long)]
    scenario: PathBuf,
    /// microlp (pure Rust) or cbc (needs a build with `--features cbc`).
    #[arg(long, default_value = "microlp")]
    solver: SolverKind,
    /// The whole planning's time budget, seconds.
    #[arg(long, default_value_t = 10.0)]
    time_limit: f64,
    /// Symphony: the previous epoch's `--json` output, for the disruption budget.
    #[arg(long)]
    previous: Option<PathBuf>,
    /// Symphony: also run the random-partition baseline for this many seconds.
    #[arg(long)]
    random: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Also write the run's metrics here (OpenMetrics text: solver time, objective, greedy
    /// objective, plans by outcome).
    #[arg(long)]
    metrics_file: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // Opens no socket: a closed stdout may end it quietly.
    cascade_benches::exit_quietly_on_closed_stdout();
    let c = Cli::parse();
    if !(c.time_limit.is_finite() && c.time_limit >= 0.0) {
        anyhow::bail!("--time-limit {} must be a number of seconds ≥ 0", c.time_limit);
    }
    if let Some(r) = c.random {
        // inf panicked converting it to a Duration; NaN and negatives ran a baseline of 0 s.
        if !(r.is_finite() && r > 0.0) {
            anyhow::bail!("--random {r} must be a positive number of seconds");
        }
    }
    if c.kind != "symphony" && (c.random.is_some() || c.previous.is_some()) {
        anyhow::bail!("--random and --previous are Symphony's (--kind symphony); HERD has neither");
    }
    let budget = Duration::from_secs_f64(c.time_limit);
    // CBC's libraries print to stdout whatever their log level; the report goes to the real
    // stdout, and fd 1 becomes stderr for the rest of the run.
    let mut report: Box<dyn Write> =
        if c.solver == SolverKind::Cbc { Box::new(stdout_to_stderr()?) } else { Box::new(std::io::stdout()) };
    let file = PlanFile::load(&c.scenario).map_err(anyhow::Error::msg)?;
    if !c.json && budget >= Duration::from_secs(1) {
        // The solver may take the whole budget with nothing to show meanwhile.
        eprintln!(
            "planning {} for {}: greedy first, then {} for up to {} s …",
            c.kind,
            c.scenario.display(),
            c.solver.name(),
            c.time_limit
        );
    }
    let out = match c.kind.as_str() {
        "symphony" => symphony(&c, &file, budget)?,
        "herd" => herd(&c, &file, budget)?,
        other => anyhow::bail!("unknown --kind {other:?}: symphony or herd"),
    };
    let feasible = out["feasible"].as_bool().unwrap_or(false);
    if let Some(path) = &c.metrics_file {
        write_metrics(path, &c, &out)?;
    }
    if c.json {
        writeln!(report, "{out}")?;
    } else {
        writeln!(report, "{}", serde_json::to_string_pretty(&out)?)?;
    }
    report.flush()?;
    if !feasible {
        std::process::exit(2);
    }
    Ok(())
}

fn common(kind: &str, c: &Cli, models: usize, groups: usize, plan: &Result<Plan, String>) -> Value {
    match plan {
        Ok(p) => json!({
            "kind": kind,
            "models": models,
            "groups": groups,
            "objective": p.objective,
            "greedy_objective": if p.greedy_objective.is_nan() { Value::Null } else { json!(p.greedy_objective) },
            "solve_seconds": p.solve_seconds,
            "feasible": true,
            "assignment": p.assignment,
            "group_sizes": p.group_sizes,
            "source": p.source,
            "note": p.note,
            "solver": c.solver.name(),
            "time_limit_s": c.time_limit,
        }),
        Err(e) => json!({
            "kind": kind,
            "models": models,
            "groups": groups,
            "objective": null,
            "greedy_objective": null,
            "solve_seconds": null,
            "feasible": false,
            "assignment": null,
            "note": e,
            "solver": c.solver.name(),
            "time_limit_s": c.time_limit,
        }),
    }
}

fn symphony(c: &Cli, file: &PlanFile, budget: Duration) -> anyhow::Result<Value> {
    let previous = match &c.previous {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
            let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
            let a: Vec<usize> = serde_json::from_value(v["assignment"].clone())
                .with_context(|| format!("{}: no assignment array", path.display()))?;
            Some(a)
        }
    };
    let p = file.symphony(previous).map_err(anyhow::Error::msg)?;
    let plan = p.solve(c.solver, budget);
    let mut out = common("symphony", c, p.models.len(), p.sub_clusters, &plan);
    if let Ok(plan) = &plan {
        let loads = p.loads(&plan.assignment);
        out["rate_imbalance"] = json!(imbalance(&loads.rate_rps));
        out["memory_imbalance"] = json!(imbalance(&loads.static_mb));
        out["disruption"] = json!(p.disruption(&plan.assignment));
        out["loads"] = serde_json::to_value(&loads)?;
    }
    if let Some(secs) = c.random {
        let r = p.random(Duration::from_secs_f64(secs), file.seed);
        out["random"] = match r {
            Some((a, o)) => {
                let loads = p.loads(&a);
                json!({"objective": o, "seconds": secs, "rate_imbalance": imbalance(&loads.rate_rps),
                       "memory_imbalance": imbalance(&loads.static_mb)})
            }
            None => json!({"objective": null, "seconds": secs, "note": "no feasible random partition"}),
        };
    }
    Ok(out)
}

fn herd(c: &Cli, file: &PlanFile, budget: Duration) -> anyhow::Result<Value> {
    let p = file.herd().map_err(anyhow::Error::msg)?;
    let plan = p.solve(c.solver, budget);
    let mut out = common("herd", c, p.streams.len(), p.groups, &plan);
    if let Ok(plan) = &plan {
        out["loads_gpus"] = json!(p.loads(&plan.assignment));
        out["gpus_needed"] = json!(p.streams.iter().map(|s| s.gpus_needed).sum::<f64>());
        out["upper_bound"] = json!(p.upper_bound());
    }
    Ok(out)
}

/// The run as metrics: `cascade_epoch_solve_seconds{kind,solver}` (histogram),
/// `cascade_epoch_objective` and `cascade_epoch_greedy_objective{kind}` (gauges, when a plan was
/// found) and `cascade_epoch_plans_total{kind,result}`; written to a temporary file beside
/// `path` and renamed over it, so a collector never reads half a file.
fn write_metrics(path: &std::path::Path, c: &Cli, out: &Value) -> anyhow::Result<()> {
    let m = cascade_transport::metrics::Metrics::new();
    let kind = c.kind.as_str();
    let feasible = out["feasible"].as_bool().unwrap_or(false);
    let result = if feasible { "feasible" } else { "infeasible" };
    m.counter("cascade_epoch_plans", "Epoch plans computed, by outcome", &[("kind", kind), ("result", result)]).inc();
    if let Some(secs) = out["solve_seconds"].as_f64() {
        m.histogram(
            "cascade_epoch_solve_seconds",
            "Time to compute an epoch plan (greedy, solver and checks)",
            &[("kind", kind), ("solver", c.solver.name())],
        )
        .observe(secs);
    }
    for (name, field, help) in [
        ("cascade_epoch_objective", "objective", "The epoch plan's objective"),
        ("cascade_epoch_greedy_objective", "greedy_objective", "The greedy plan's objective (the solver's fallback)"),
    ] {
        if let Some(v) = out[field].as_f64() {
            m.gauge(name, help, &[("kind", kind)]).set(v);
        }
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let name = path.file_name().with_context(|| format!("--metrics-file {}: not a file name", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, m.render()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// A handle on the process's stdout, with fd 1 pointed at stderr from now on.
fn stdout_to_stderr() -> anyhow::Result<File> {
    use std::io::Write as _;
    std::io::stdout().flush()?;
    // SAFETY: dup and dup2 on the process's own standard descriptors; no Rust object owns fd 1
    // exclusively (std's Stdout writes to it by number), and it stays open throughout.
    let saved = unsafe { libc::dup(1) };
    if saved < 0 {
        anyhow::bail!("dup(1): {}", std::io::Error::last_os_error());
    }
    // SAFETY: as above; fd 2 is open for the process's whole life.
    if unsafe { libc::dup2(2, 1) } < 0 {
        anyhow::bail!("dup2(2, 1): {}", std::io::Error::last_os_error());
    }
    // SAFETY: `saved` is a fresh descriptor from dup, owned by nothing else.
    Ok(unsafe { File::from_raw_fd(saved) })
}
