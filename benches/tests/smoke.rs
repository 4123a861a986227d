//! Smoke test of the benchmark binaries: small runs that must print the JSON fields DESIGN.md
//! promises (other tools parse them).
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin).args(args).output().unwrap();
    assert!(out.status.success(), "{bin} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{bin} printed {line:?}: {e}"))
}

/// Runs `bin` with `args`, which it must refuse with a message containing `says`.
fn refused(bin: &str, args: &[&str], says: &str) {
    let out = Command::new(bin).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(says), "{bin} {args:?}: {stderr}");
}

#[test]
fn p2p_prints_the_contract_fields() {
    for backend in ["tcp", "shm"] {
        let v = run(
            env!("CARGO_BIN_EXE_p2p"),
            &["--backend", backend, "--bytes", "1048576", "--iters", "2", "--verify", "--json"],
        );
        for k in ["backend", "bytes", "seconds", "gbit_per_s"] {
            assert!(!v[k].is_null(), "{backend}: missing {k} in {v}");
        }
        assert_eq!(v["backend"], backend);
        assert_eq!(v["link"], backend, "the link must really use the backend asked for");
        assert_eq!(v["bytes"], 1048576);
        assert!(v["gbit_per_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn incast_prints_the_contract_fields() {
    let v = run(
        env!("CARGO_BIN_EXE_incast"),
        &["--senders", "3", "--objects", "2", "--object-bytes", "4096", "--rounds", "50", "--warmup", "5", "--json"],
    );
    for k in ["rounds", "p50_us", "p99_us", "p9999_us"] {
        assert!(v[k].as_f64().is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["rounds"], 50);
    assert!(v["p50_us"].as_f64().unwrap() <= v["p9999_us"].as_f64().unwrap());
}

#[test]
fn bad_arguments_are_refused_clearly() {
    refused(env!("CARGO_BIN_EXE_p2p"), &["--backend", "carrier-pigeon", "--json"], "unknown backend");
    refused(env!("CARGO_BIN_EXE_incast"), &["--threads", "0", "--rounds", "1"], "--threads must be at least 1");
    // No batch measures nothing (it printed 0.00x for every k).
    let coop = env!("CARGO_BIN_EXE_coop-throughput");
    refused(
        coop,
        &["--executor", "emulated", "--batches", "0", "--json"],
        "--batches and --batch-size must be at least 1",
    );
    refused(coop, &["--executor", "emulated", "--batch-size", "0", "--json"], "must be at least 1");
    let st = env!("CARGO_BIN_EXE_sched-throughput");
    refused(st, &["--sub-clusters", "0", "--seconds", "0.1"], "--sub-clusters must be at least 1");
    refused(st, &["--sub-clusters", "5", "--models", "4", "--seconds", "0.1"], "--sub-clusters 5 exceeds --models 4");
    refused(st, &["--gpus", "100000000", "--seconds", "0.1"], "are at most 65536 each");
    refused(st, &["--models", "100000000", "--seconds", "0.1"], "are at most 65536 each");
    refused(st, &["--sub-clusters", "4", "--scheduler", "flex", "--seconds", "0.1"], "partitions Symphony's engine");
    let plan = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/plans/symphony_400x4.toml");
    let herd = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/plans/herd_200x10.toml");
    let ep = env!("CARGO_BIN_EXE_epoch-plan");
    for r in ["inf", "NaN", "-1", "0"] {
        let arg = format!("--random={r}");
        refused(ep, &["--kind", "symphony", "--scenario", plan, &arg], "must be a positive number of seconds");
    }
    refused(ep, &["--kind", "herd", "--scenario", herd, "--random", "1"], "are Symphony's");
    // No iteration had no median to report (an index out of bounds), no sequence no iteration.
    let cost = env!("CARGO_BIN_EXE_lora-cost");
    refused(cost, &["--iters", "0"], "--iters must be at least 1");
    refused(cost, &["--batches", "4,0"], "each at least 1");
    // No run of either side had no median (it was taken as one run without a word); refused
    // before any node starts.
    let sweep = env!("CARGO_BIN_EXE_multicast-sweep");
    refused(sweep, &["--compare-mpi", "--reps", "0"], "--reps must be at least 1");
    // A synthetic model larger than memory (it was built in memory first).
    let load = env!("CARGO_BIN_EXE_load");
    let file = std::env::temp_dir().join(format!("cascade-load-refused-{}.safetensors", std::process::id()));
    refused(load, &["--file", file.to_str().unwrap(), "--make-synthetic", "1099511627776"], "more than the");
    assert!(!file.exists(), "a file was written");
}

#[test]
fn multicast_prints_the_contract_fields() {
    // Loopback, unshaped: link_mbit and bound_seconds are null by design.
    let v =
        run(env!("CARGO_BIN_EXE_multicast"), &["--targets", "3", "--bytes", "4194304", "--planner", "blitz", "--json"]);
    for k in ["planner", "targets", "bytes", "link_mbit", "seconds", "bound_seconds"] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["planner"], "blitz");
    assert_eq!(v["targets"], 3);
    assert_eq!(v["verified"], 3, "every target holds the source's bytes");
    assert!(v["link_mbit"].is_null() && v["bound_seconds"].is_null(), "{v}");
    assert!(v["seconds"].as_f64().unwrap() > 0.0);
}

#[test]
fn goodput_prints_the_contract_fields() {
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/scenarios/table4_resnet50.toml");
    for sched in ["symphony", "clockwork", "clockwork-real", "nexus", "flex"] {
        let v = run(
            env!("CARGO_BIN_EXE_goodput"),
            &["--scenario", scenario, "--scheduler", sched, "--rate", "3000", "--json"],
        );
        for k in ["scheduler", "offered_rps", "goodput_rps", "bad_rate", "gpu_idle_fraction", "mean_batch", "per_model"]
        {
            assert!(!v[k].is_null(), "{sched}: missing {k} in {v}");
        }
        for k in ["name", "goodput_rps", "p99_ms", "mean_batch"] {
            assert!(!v["per_model"][0][k].is_null(), "{sched}: per_model lacks {k}");
        }
        assert_eq!(v["lost"], 0);
    }
    // --seed replaces the file's seed (1): other arrivals, and the same ones again for the same seed.
    let seeded = |seed: &str| {
        run(
            env!("CARGO_BIN_EXE_goodput"),
            &["--scenario", scenario, "--scheduler", "symphony", "--rate", "3000", "--seed", seed, "--json"],
        )
    };
    let (one, two, again) = (seeded("1"), seeded("2"), seeded("2"));
    assert_eq!((one["seed"].as_u64(), two["seed"].as_u64()), (Some(1), Some(2)));
    assert_ne!(one["offered_rps"], two["offered_rps"], "seed 2 draws other arrivals");
    assert_eq!(two["offered_rps"], again["offered_rps"]);
    assert_eq!(two["goodput_rps"], again["goodput_rps"]);
    refused(env!("CARGO_BIN_EXE_goodput"), &["--scenario", scenario, "--scheduler", "fifo"], "unknown scheduler");
    for t in ["-1", "NaN", "1"] {
        let arg = format!("--bad-threshold={t}");
        refused(env!("CARGO_BIN_EXE_goodput"), &["--scenario", scenario, "--scheduler", "symphony", &arg], "in [0, 1)");
    }
}

#[test]
fn lora_sim_prints_the_contract_fields_and_takes_a_seed_route_cost_placement_and_drift() {
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/scenarios/lora_8gpu.toml");
    let sim = |extra: &[&str]| {
        let mut args = vec!["--scenario", scenario, "--dispatch", "proactive", "--rate", "20", "--json"];
        args.extend_from_slice(extra);
        run(env!("CARGO_BIN_EXE_lora-sim"), &args)
    };
    let one = sim(&["--seed", "1"]);
    for k in ["policy", "requests", "avg_latency_s", "p90_latency_s", "throughput_rps", "mode_switches", "migrations"] {
        assert!(!one[k].is_null(), "missing {k} in {one}");
    }
    assert!(!one["max_wait_iterations"].is_null() && !one["avg_queue_s"].is_null());
    assert!(one["avg_queue_per_token_s"].as_f64().unwrap() < one["avg_queue_s"].as_f64().unwrap());
    // --seed replaces the file's (1): other requests, and the same ones again for the same seed.
    let (two, again) = (sim(&["--seed", "2"]), sim(&["--seed", "2"]));
    assert_ne!(one["requests"], two["requests"], "seed 2 draws other arrivals");
    assert_eq!(two, again, "a run is deterministic for its seed");
    assert_eq!(sim(&[]), one, "the file's seed is 1");
    // The artifact's routing cost piles each adapter's requests on its first holder.
    let piled = sim(&["--seed", "1", "--route-cost", "artifact"]);
    let (ours, art) = (one["avg_queue_s"].as_f64().unwrap(), piled["avg_queue_s"].as_f64().unwrap());
    assert!(art > 2.0 * ours, "artifact routing {art} s against ours {ours} s");
    refused(env!("CARGO_BIN_EXE_lora-sim"), &["--scenario", scenario, "--route-cost", "shortest"], "pending, artifact");
    // The artifact's blind placement leaves the hot adapter one holder, which round-robin swamps.
    let rr = |placement: &str| {
        let args = ["--scenario", scenario, "--dispatch", "rr", "--rate", "20", "--placement", placement, "--json"];
        run(env!("CARGO_BIN_EXE_lora-sim"), &args)["avg_queue_s"].as_f64().unwrap()
    };
    let (aware, blind) = (rr("burst"), rr("artifact"));
    assert!(blind > 10.0 * aware, "blind placement {blind} s against burst tolerance {aware} s");
    refused(env!("CARGO_BIN_EXE_lora-sim"), &["--scenario", scenario, "--placement", "random"], "burst, artifact");
    // --drift-sigma redraws the adapters' popularity every phase: the same arrivals, other adapters.
    let drifted = sim(&["--seed", "1", "--drift-sigma", "1.5"]);
    assert_eq!(drifted["requests"], one["requests"]);
    assert_ne!(drifted["avg_queue_s"], one["avg_queue_s"]);
    refused(env!("CARGO_BIN_EXE_lora-sim"), &["--scenario", scenario, "--drift-phase-s", "10"], "needs a drift");
    refused(env!("CARGO_BIN_EXE_lora-sim"), &["--scenario", scenario, "--drift-sigma=-1"], "sigma");
}

#[test]
fn sched_throughput_prints_the_contract_fields() {
    let v = run(
        env!("CARGO_BIN_EXE_sched-throughput"),
        &["--models", "8", "--gpus", "32", "--rate", "100000", "--seconds", "0.3", "--json"],
    );
    for k in ["requests", "seconds", "requests_per_s", "lost"] {
        assert!(v[k].as_f64().is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["lost"], 0);
}

#[test]
fn serve_sim_prints_the_contract_fields() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/data/AzureLLMInferenceTrace_code.csv");
    for system in ["blitz", "sllm", "allcache", "stop"] {
        let v = run(
            env!("CARGO_BIN_EXE_serve-sim"),
            &["--trace", trace, "--system", system, "--duration-s", "120", "--json"],
        );
        for k in [
            "requests",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tbt_p50_ms",
            "tbt_p99_ms",
            "slo_attainment",
            "gpu_seconds",
            "host_cache_gb_avg",
            "scale_events",
            "over_context",
        ] {
            assert!(v[k].as_f64().is_some(), "{system}: missing {k} in {v}");
        }
        assert_eq!(v["system"], system);
        assert_eq!(v["requests"], 63, "the trace's first two minutes");
    }
    refused(env!("CARGO_BIN_EXE_serve-sim"), &["--system", "vllm", "--json"], "unknown system");
    refused(env!("CARGO_BIN_EXE_serve-sim"), &["--over-context", "truncate", "--json"], "clip, refuse, keep");
    for d in ["0", "-1", "NaN"] {
        let arg = format!("--duration-s={d}");
        refused(env!("CARGO_BIN_EXE_serve-sim"), &[&arg, "--json"], "--duration-s must be a positive number");
    }
}

#[test]
fn lora_cost_prints_its_fields() {
    let model = match cascade_tests::models::smollm2() {
        None => return,
        Some(cascade_tests::models::Smollm2::Imported(dir)) => dir,
        Some(cascade_tests::models::Smollm2::Gguf { gguf, dir }) => {
            cascade_exec::gguf::import_into_place(&gguf, &dir).unwrap();
            dir
        }
    };
    let model = model.to_str().unwrap();
    let v = run(env!("CARGO_BIN_EXE_lora-cost"), &["--model", model, "--batches", "2", "--iters", "1", "--json"]);
    for k in ["merge_ms", "unmerge_ms", "load_from_host_ms", "adapter_bytes"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "missing {k} in {v}");
    }
    let it = &v["iterations"][0];
    for k in ["base_ms", "merged_ms", "unmerged_ms", "unmerged_4_adapters_ms"] {
        assert!(it[k].as_f64().is_some_and(|x| x > 0.0), "missing {k} in {it}");
    }
    // A rank above the projections' own (k_proj is 192 × 576) is refused before its tensors are
    // built (rank 100,000 was killed for memory).
    refused(
        env!("CARGO_BIN_EXE_lora-cost"),
        &["--model", model, "--rank", "100000", "--batches", "1", "--iters", "1"],
        "rank 100000 exceeds",
    );
}

/// A simulator whose reader goes away (`| head`) ends quietly, killed by SIGPIPE as Unix tools
/// are, instead of panicking in `println!` ("failed printing to stdout: Broken pipe").
#[test]
fn a_simulator_whose_reader_goes_away_ends_without_a_panic() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/data/AzureLLMInferenceTrace_code.csv");
    let runs: [(&str, &[&str]); 2] = [
        (env!("CARGO_BIN_EXE_serve-sim"), &["--trace", trace, "--system", "all", "--duration-s", "120"]),
        (
            env!("CARGO_BIN_EXE_sched-throughput"),
            &["--models", "8", "--gpus", "32", "--rate", "100000", "--seconds", "0.3"],
        ),
    ];
    for (bin, args) in runs {
        let mut child = Command::new(bin).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take()); // the reader is gone before the first line
        let mut err = String::new();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        let st = child.wait().unwrap();
        assert!(!err.contains("panicked"), "{bin}: {err}");
        assert_eq!(st.signal(), Some(libc::SIGPIPE), "{bin} ended with {st}: {err}");
    }
}

/// A tool whose output cannot be written (here to `/dev/full`, as on a full disk) says so in one
/// line and exits non-zero; before 2026-12-05 `println!` panicked with a backtrace.
#[test]
fn a_tool_that_cannot_write_its_output_says_so_in_one_line() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../sched/data/AzureLLMInferenceTrace_code.csv");
    let runs: [(&str, &[&str]); 2] = [
        (env!("CARGO_BIN_EXE_serve-sim"), &["--trace", trace, "--system", "blitz", "--duration-s", "60", "--json"]),
        (env!("CARGO_BIN_EXE_p2p"), &["--backend", "tcp", "--bytes", "1048576", "--iters", "2", "--json"]),
    ];
    for (bin, args) in runs {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = Command::new(bin).args(args).stdout(full).env_remove("RUST_BACKTRACE").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bin}: {err}");
        assert!(err.contains("cannot write the output: No space left on device"), "{bin}: {err}");
        assert!(!err.contains("panicked") && !err.contains("backtrace"), "{bin}: {err}");
    }
}

/// A benchmark that opens sockets keeps SIGPIPE ignored (the transport expects EPIPE from a
/// reset peer), so a closed stdout makes `println!` panic: that panic ends it quietly, without
/// a message, and its peers and temporary directory go with it.
#[test]
fn a_socket_benchmark_whose_reader_goes_away_ends_quietly_and_cleans_up() {
    use std::io::Read;
    use std::process::Stdio;
    let bin = env!("CARGO_BIN_EXE_p2p");
    let mut child = Command::new(bin)
        .args(["--backend", "tcp", "--bytes", "1048576", "--iters", "2", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader is gone before the first line
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let st = child.wait().unwrap();
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
    assert_eq!(st.code(), Some(101), "ended with {st}: {err}");
    let dir = std::env::temp_dir().join(format!("cascade-bench{}", child.id()));
    assert!(!dir.exists(), "{} was left behind", dir.display());
}
