//! `cascade live`, the README's main job, end to end at a small size: the real MiniLM served
//! while its copy arrives, under the three policies — in shaped network namespaces when they can
//! be made (root; CI runs as root; there at two link rates, the sweep `--link-mbit 300,400`), on
//! loopback otherwise. Skips, saying so, without the model.
#![allow(clippy::unwrap_used)]

use std::process::Command;

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

#[test]
fn live_scaling_serves_every_request_with_the_reference_embedding() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let out = std::env::temp_dir().join(format!("cascade-live-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let netns = cascade_tests::netns::Netns::unavailable().is_none();
    let mut cmd = Command::new(CASCADE);
    cmd.args(["live", "--burst-s", "4", "--burst", "1.3", "--scale-after-s", "0.5", "--model"]).arg(&model);
    cmd.arg("--out").arg(&out);
    if netns {
        cmd.args(["--netns", "--link-mbit", "300,400"]);
    }
    let res = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "live failed:\n{stdout}\n{}", String::from_utf8_lossy(&res.stderr));
    let dirs = if netns {
        // One comparison per rate, each in its own directory, and the table of them.
        let sweep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
        let rates: Vec<u64> =
            sweep["rates"].as_array().unwrap().iter().map(|r| r["link_mbit"].as_u64().unwrap()).collect();
        assert_eq!(rates, [300, 400]);
        assert!(sweep["rates"][0]["p99_zigzag_over_best_effort"].as_f64().is_some_and(|x| x > 0.0), "{sweep:#}");
        vec![out.join("300mbit"), out.join("400mbit")]
    } else {
        vec![out.clone()]
    };
    for dir in dirs {
        check_report(&dir, netns);
    }
    eprintln!("{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

/// One comparison's report: every policy served every request with the reference embedding, on
/// the same burst; with shaped links the live policies split batches and stop-the-world did not.
fn check_report(dir: &std::path::Path, netns: bool) {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let policies = r["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 3);
    assert_eq!(r["copy_source"], "pool", "the default source of the copy");
    // One burst per round: the round's first run sets it, the others replay the same arrivals.
    let sent: Vec<u64> = policies.iter().map(|p| p["rounds"][0]["requests"].as_u64().unwrap()).collect();
    assert!(sent.iter().all(|&n| n == sent[0]), "bursts differ within the round: {sent:?}");
    for p in policies {
        assert_eq!(p["requests_lost"], 0, "{p:#}");
        assert_eq!(p["embeddings_off_reference"], 0, "{p:#}");
        let round = &p["rounds"][0];
        assert!(round["requests"].as_u64().unwrap() > 0);
        if netns {
            // The load takes long enough here to tell the policies apart: the live ones split
            // batches with the new node while its copy arrives; stop-the-world never does, and
            // its new node serves only once the copy is complete.
            let split = round["requests_split"].as_u64().unwrap();
            match p["policy"].as_str().unwrap() {
                "stop-the-world" => {
                    let helped = round["first_request_helped_by_new_after_s"].as_f64().unwrap();
                    let load = round["loaded_at_s"].as_f64().unwrap() - round["scale_out_at_s"].as_f64().unwrap();
                    assert!(split == 0 && helped >= load, "{p:#}");
                }
                _ => assert!(split > 0, "{p:#}"),
            }
        }
    }
    assert!(dir.join("live.png").is_file());
}

/// A node process that exits at its start (here every instance, whose activation region for
/// batches of 100,000 texts could never be allocated) ends the run at once, with what the node
/// said. Before 2026-12-04 the driver waited out its mesh timeout (120 s) and reported only
/// "nodes [1, 2, 3] did not connect within 120s". On loopback (the failure is the same in
/// namespaces, watched the same way).
#[test]
fn a_node_that_exits_at_its_start_ends_the_run_at_once_saying_why() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let out = std::env::temp_dir().join(format!("cascade-live-exit-{}", std::process::id()));
    let t = std::time::Instant::now();
    let err = live_fails(&model, &out, &["--max-batch", "100000"]);
    let took = t.elapsed();
    assert!(err.contains("exited") && err.contains("an activation region of 16 slots"), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}: {err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// `cascade live --policies zigzag` on loopback with `extra`, which must fail: what it said.
fn live_fails(model: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> String {
    let res = Command::new(CASCADE)
        .args(["live", "--policies", "zigzag", "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .args(extra)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&res.stderr).into_owned();
    assert!(!res.status.success(), "{extra:?} did not fail: {err}");
    err
}

/// A burst with no request, or more than ten million, is refused once the instance's speed is
/// known: `--burst 1e-9` ran and reported p50 and p99 as NaN, `--burst 1e12` drew 3·10¹⁵
/// arrival times into memory before anything ran. On loopback.
#[test]
fn a_burst_of_no_request_or_too_many_is_refused() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let out = std::env::temp_dir().join(format!("cascade-live-burst-{}", std::process::id()));
    for (burst, says) in [("1e-9", "holds no request; raise --burst"), ("1e12", "at most 10000000; lower --burst")] {
        let err = live_fails(&model, &out, &["--burst", burst]);
        assert!(err.contains(says), "--burst {burst}: {err}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The same-host sockets (`*.sock`) under `dir`: a run's nodes keep theirs in its directories,
/// and the tests point the driver's (`XDG_RUNTIME_DIR`) under it too.
fn sockets(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(sockets(&p));
        } else if p.extension().is_some_and(|x| x == "sock") {
            found.push(p);
        }
    }
    found
}

/// Ctrl-C in the middle of a run in namespaces (SIGINT to the whole process group, as a
/// terminal sends it) ends it with status 130 and leaves no namespace behind. Before
/// 2026-12-05 every interrupted run left its five namespaces, with their veth pairs and bridge.
#[test]
fn an_interrupted_run_in_namespaces_leaves_none_behind() {
    use std::os::unix::process::CommandExt;
    let Some(model) = cascade_tests::models::minilm() else { return };
    if let Some(why) = cascade_tests::netns::Netns::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let out = std::env::temp_dir().join(format!("cascade-live-int-{}", std::process::id()));
    let runtime = out.join("runtime");
    std::fs::create_dir_all(&runtime).unwrap();
    let mut child = Command::new(CASCADE)
        .args(["live", "--netns", "--policies", "zigzag", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .env("XDG_RUNTIME_DIR", &runtime)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // Its namespaces are named after its pid (devcluster's `Netns`).
    let prefix = format!("c{:x}", child.id() & 0xfffff);
    let ours = || -> Vec<String> {
        let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&list.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&prefix))
            .map(str::to_string)
            .collect()
    };
    let t = std::time::Instant::now();
    // All five (four hosts and the switch), and its nodes starting in them.
    while ours().len() < 5 {
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "no namespaces appeared");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let group = format!("-{}", child.id());
    assert!(Command::new("kill").args(["-INT", "--", &group]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(ours().is_empty(), "left behind: {:?}", ours());
    assert_eq!(sockets(&out), Vec::<std::path::PathBuf>::new(), "same-host sockets left behind");
    let _ = std::fs::remove_dir_all(&out);
}

/// SIGTERM to `cascade live` alone (what `timeout` or a job scheduler sends) in the middle of a
/// run on loopback ends it with status 143 and takes its instance processes with it. Before
/// 2026-12-05 they went on serving for good.
#[test]
fn a_terminated_run_on_loopback_leaves_no_instance_serving() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let out = std::env::temp_dir().join(format!("cascade-live-term-{}", std::process::id()));
    let runtime = out.join("runtime");
    std::fs::create_dir_all(&runtime).unwrap();
    let mut child = Command::new(CASCADE)
        .args(["live", "--policies", "zigzag", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .env("XDG_RUNTIME_DIR", &runtime)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Its instances name their cluster file, which lies under `out`.
    let instances = || {
        let o = Command::new("pgrep").args(["-f", &format!("instance --cluster {}", out.display())]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).lines().count()
    };
    let t = std::time::Instant::now();
    while instances() < 3 {
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "no instances appeared");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "{status:?}");
    let t = std::time::Instant::now();
    while instances() > 0 {
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{} instances still serving", instances());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(sockets(&out), Vec::<std::path::PathBuf>::new(), "same-host sockets left behind");
    let _ = std::fs::remove_dir_all(&out);
}
