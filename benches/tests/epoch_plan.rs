//! `epoch-plan`: every plan it prints is feasible. The constraints are re-verified here from the
//! printed JSON and the plan file's inputs, with sums computed in this test — not by the
//! planner's own `check`.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use cascade_sched::plan::instance::{single_gpu_goodput, PlanFile};
use serde_json::Value;

fn plan(args: &[&str]) -> (bool, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_epoch-plan")).args(args).arg("--json").output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let v: Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!("epoch-plan {args:?} printed {text:?} ({e}); stderr {}", String::from_utf8_lossy(&out.stderr))
    });
    for k in ["kind", "models", "groups", "objective", "greedy_objective", "solve_seconds", "feasible", "assignment"] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    (out.status.success(), v)
}

fn shipped(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../sched/plans").join(name)
}

fn assignment(v: &Value) -> Vec<usize> {
    v["assignment"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect()
}

/// Re-verifies Symphony's constraints (5), (6), (9) and the objective (4) from the JSON.
fn verify_symphony(file: &Path, v: &Value) -> Vec<usize> {
    let f = PlanFile::load(file).unwrap();
    let params = f.symphony.clone().unwrap();
    let models = f.model_streams().unwrap();
    let a = assignment(v);
    let l = params.sub_clusters;
    assert_eq!(a.len(), models.len(), "one sub-cluster per model");
    assert_eq!(v["models"], models.len());
    assert_eq!(v["groups"], l);
    let (mut rate, mut stat, mut dynm) = (vec![0.0; l], vec![0.0; l], vec![0.0f64; l]);
    for (m, &j) in models.iter().zip(&a) {
        assert!(j < l, "sub-cluster {j} of {l}");
        rate[j] += m.rate_rps;
        stat[j] += m.static_mb;
        dynm[j] = dynm[j].max(m.dynamic_mb);
    }
    let r_max = params.r_max_rps.unwrap_or(f64::INFINITY);
    for j in 0..l {
        assert!(rate[j] <= r_max * (1.0 + 1e-9), "sub-cluster {j}: {} r/s over R_max {r_max}", rate[j]);
        assert!(stat[j] + dynm[j] <= params.s_max_mb * (1.0 + 1e-9), "sub-cluster {j}: memory {}", stat[j] + dynm[j]);
    }
    let (rbar, sbar) = (rate.iter().sum::<f64>() / l as f64, stat.iter().sum::<f64>() / l as f64);
    let w = params.w.unwrap_or(rate.iter().sum::<f64>() / stat.iter().sum::<f64>());
    let dev = |x: &[f64], avg: f64| x.iter().map(|v| (v - avg).abs()).fold(0.0, f64::max);
    let objective = dev(&rate, rbar) + w * dev(&stat, sbar);
    let printed = v["objective"].as_f64().unwrap();
    assert!(
        (objective - printed).abs() <= 1e-6 * objective.max(1.0),
        "objective {printed} printed, {objective} recomputed"
    );
    if let Some(g) = v["greedy_objective"].as_f64() {
        assert!(printed <= g + 1e-9, "the plan ({printed}) is worse than greedy ({g})");
    }
    a
}

/// Re-verifies HERD's constraints (a)–(e) and its objective from the JSON.
fn verify_herd(file: &Path, v: &Value) {
    let f = PlanFile::load(file).unwrap();
    let params = f.herd.clone().unwrap();
    let models = f.model_streams().unwrap();
    let a = assignment(v);
    let sizes: Vec<u32> = v["group_sizes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let g = params.groups;
    assert_eq!((a.len(), sizes.len()), (models.len(), g));
    assert!(sizes.iter().sum::<u32>() <= params.gpus, "(a) cluster size");
    assert!(sizes.iter().all(|&s| s <= params.group_max), "(b) group-worker limit");
    let (mut mem, mut load, mut set) = (vec![0.0; g], vec![0.0; g], vec![None; g]);
    let n: Vec<f64> = models.iter().map(|m| m.rate_rps / single_gpu_goodput(m).unwrap()).collect();
    for ((m, &j), &ni) in models.iter().zip(&a).zip(&n) {
        mem[j] += m.static_mb;
        load[j] += ni;
        assert!(set[j].is_none_or(|c| c == m.affinity), "(e) group {j} mixes affinity sets");
        set[j] = Some(m.affinity);
    }
    for j in 0..g {
        assert!(mem[j] <= params.gpu_mem_mb * (1.0 + 1e-9), "(c) group {j}: {} MB", mem[j]);
        assert!(set[j].is_none() || sizes[j] > 0, "group {j} serves streams with no GPU");
    }
    let min_bt =
        a.iter().zip(&n).map(|(&j, &ni)| 1.0 + (f64::from(sizes[j]) - load[j]) / ni).fold(f64::INFINITY, f64::min);
    let printed = v["objective"].as_f64().unwrap();
    assert!((min_bt - printed).abs() <= 1e-6 * min_bt.abs().max(1.0), "min bt {printed} printed, {min_bt} recomputed");
    assert!(printed <= v["upper_bound"].as_f64().unwrap() + 1e-9);
}

#[test]
fn symphony_plans_are_feasible_and_chain_epochs_within_the_disruption_budget() {
    let file = shipped("symphony_400x4.toml");
    let (ok, v) =
        plan(&["--kind", "symphony", "--scenario", file.to_str().unwrap(), "--time-limit", "2", "--random", "0.5"]);
    assert!(ok && v["feasible"] == true, "{v}");
    let first = verify_symphony(&file, &v);
    assert!(v["solve_seconds"].as_f64().unwrap() < 2.5, "the budget holds: {}", v["solve_seconds"]);
    let (mine, random) = (v["objective"].as_f64().unwrap(), v["random"]["objective"].as_f64().unwrap());
    assert!(mine < random, "the plan ({mine}) beats random partitions ({random})");

    // The next epoch: other rates (another seed), a budget of moving 2,000 MB.
    let dir = std::env::temp_dir().join(format!("epoch-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prev = dir.join("epoch1.json");
    std::fs::write(&prev, v.to_string()).unwrap();
    let next = dir.join("epoch2.toml");
    let text = std::fs::read_to_string(&file).unwrap().replace("seed = 1", "seed = 11") + "c_max = 2000.0\n";
    std::fs::write(&next, text).unwrap();
    let (ok, v2) = plan(&[
        "--kind",
        "symphony",
        "--scenario",
        next.to_str().unwrap(),
        "--time-limit",
        "2",
        "--previous",
        prev.to_str().unwrap(),
    ]);
    assert!(ok, "{v2}");
    let second = verify_symphony(&next, &v2);
    let models = PlanFile::load(&next).unwrap().model_streams().unwrap();
    let moved: f64 =
        models.iter().zip(first.iter().zip(&second)).filter(|(_, (a, b))| a != b).map(|(m, _)| 2.0 * m.static_mb).sum();
    assert!(moved <= 2000.0 + 1e-6, "moved {moved} MB over C_max");
    assert!((v2["disruption"].as_f64().unwrap() - moved).abs() < 1e-6);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The one sample of `series` (its full name with labels) in OpenMetrics text.
fn sample(text: &str, series: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// `epoch-plan --kind K --scenario F --time-limit 1 --metrics-file P`: the plan and the metrics'
/// text.
fn plan_with_metrics(kind: &str, file: &Path, prom: &Path) -> (bool, Value, String) {
    let (ok, v) = plan(&[
        "--kind",
        kind,
        "--scenario",
        file.to_str().unwrap(),
        "--time-limit",
        "1",
        "--metrics-file",
        prom.to_str().unwrap(),
    ]);
    (ok, v, std::fs::read_to_string(prom).unwrap())
}

/// The plan, and with `--metrics-file` the same run's solver time, objectives and outcome as
/// metrics.
#[test]
fn herd_plans_are_feasible_and_their_metrics_match_the_plan() {
    let file = shipped("herd_200x10.toml");
    let dir = std::env::temp_dir().join(format!("epoch-plan-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ok, v, text) = plan_with_metrics("herd", &file, &dir.join("epoch.prom"));
    assert!(ok && v["feasible"] == true, "{v}");
    verify_herd(&file, &v);
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert_eq!(sample(&text, r#"cascade_epoch_plans_total{kind="herd",result="feasible"}"#), 1.0);
    let labels = r#"{kind="herd",solver="microlp"}"#;
    assert_eq!(sample(&text, &format!("cascade_epoch_solve_seconds_count{labels}")), 1.0);
    let secs = sample(&text, &format!("cascade_epoch_solve_seconds_sum{labels}"));
    assert!((secs - v["solve_seconds"].as_f64().unwrap()).abs() < 1e-9, "{secs} vs {v}");
    let objective = sample(&text, r#"cascade_epoch_objective{kind="herd"}"#);
    assert!((objective - v["objective"].as_f64().unwrap()).abs() < 1e-9);
    let greedy = sample(&text, r#"cascade_epoch_greedy_objective{kind="herd"}"#);
    assert!((greedy - v["greedy_objective"].as_f64().unwrap()).abs() < 1e-9);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_instance_with_no_plan_says_so_and_fails() {
    let dir = std::env::temp_dir().join(format!("epoch-plan-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tight.toml");
    // Backends of 1 GB cannot hold VGG16's 6.2 GB of dynamic memory.
    std::fs::write(
        &file,
        "seed = 1\n[generate]\nmodels = 20\nmean_rate_rps = 10.0\n[symphony]\nsub_clusters = 2\ns_max_mb = 1000.0\n",
    )
    .unwrap();
    let (ok, v, text) = plan_with_metrics("symphony", &file, &dir.join("epoch.prom"));
    assert!(!ok);
    assert_eq!(sample(&text, r#"cascade_epoch_plans_total{kind="symphony",result="infeasible"}"#), 1.0);
    assert!(!text.contains("cascade_epoch_objective{"), "no objective without a plan: {text}");
    assert_eq!(v["feasible"], false);
    assert!(v["assignment"].is_null());
    assert!(v["note"].as_str().unwrap().contains("no feasible plan"), "{v}");
    std::fs::remove_dir_all(&dir).unwrap();
}
