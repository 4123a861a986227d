//! `cascade pd` end to end at a small size: SmolLM2 in four instance processes, a burst with a
//! prefill→decode mutation and a live scale-out in its middle, then the first decode instance
//! killed with SIGKILL — or stopped with SIGTERM, a scale-in whose requests move with their KV;
//! every answer equal to single-process greedy, none lost or answered twice. Skips, saying so,
//! without the model.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

/// Where SmolLM2's model directory is (or goes: `cascade pd` imports the GGUF there when it is
/// missing), or `None`, said on stderr, without the model.
fn model_dir() -> Option<PathBuf> {
    Some(match cascade_tests::models::smollm2()? {
        cascade_tests::models::Smollm2::Imported(dir) | cascade_tests::models::Smollm2::Gguf { dir, .. } => dir,
    })
}

/// Runs `cascade pd` with `args` into a directory of its own (`tag`); its report, its stdout
/// and the directory (node logs), or `None` without the model.
fn pd(tag: &str, args: &[&str]) -> Option<(serde_json::Value, String, PathBuf)> {
    let model = model_dir()?;
    let out = std::env::temp_dir().join(format!("cascade-pd-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let res = Command::new(CASCADE)
        .args(["pd", "--requests", "10", "--rate", "10", "--scale-after-s", "0.3"])
        .args(args)
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
    assert!(res.status.success(), "pd failed:\n{stdout}\n{}", String::from_utf8_lossy(&res.stderr));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(
        (r["answered"].as_u64(), r["lost"].as_u64(), r["answered_twice"].as_u64()),
        (Some(10), Some(0), Some(0))
    );
    assert_eq!(r["not_equal_to_reference"], 0);
    let rows = r["per_request"].as_array().unwrap();
    assert!(rows.iter().all(|x| x["equal_to_reference"] == true && x["ttft_ms"].as_f64().unwrap() > 0.0));
    Some((r, stdout, out))
}

/// With the user's prompts (`--prompt-file`: the burst cycles through the file's lines), and a
/// stop string (`" a"`) that ends the first line's answer after five of its six tokens: the
/// router ends those requests there, as the reference does.
#[test]
fn disaggregated_serving_answers_every_request_with_the_greedy_tokens() {
    let prompts = std::env::temp_dir().join(format!("cascade-pd-prompts-{}.txt", std::process::id()));
    std::fs::write(&prompts, "Rust is a language that\nThe largest planet is\n<|im_start|>user\nHi!<|im_end|>\n")
        .unwrap();
    let args =
        ["--max-tokens", "6", "--kill-decode-at-s", "0.8", "--prompt-file", prompts.to_str().unwrap(), "--stop", " a"];
    let Some((r, stdout, out)) = pd("kill", &args) else { return };
    let _ = std::fs::remove_file(&prompts);
    assert_eq!(r["prompts"], 4, "the file's four lines");
    let stopped = r["per_request"].as_array().unwrap().iter().filter(|x| x["stopped"] == true).count();
    assert!(stopped > 0 && r["stopped_at_a_stop_string"] == stopped, "{stopped} stopped:\n{stdout}");
    assert!(stdout.contains("ended at a stop string"), "{stdout}");
    assert!(r["decode_killed_at_s"].as_f64().is_some_and(|t| t >= 0.8), "{}", r["decode_killed_at_s"]);
    assert!(stdout.contains("killed the decode instance"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

/// SIGTERM to the decode instance while it decodes (at 5 s, or once it decodes a request: in a
/// loaded debug run the first tokens may come after 14 s; 24 tokens each): it leaves, the router moves its requests with their KV to the mutated
/// instance, and the process exits once they are gone. The requests are sampled (`--temperature`):
/// a moved one draws on where it went as it would have where it was, and every answer equals
/// what one process draws for the same request.
#[test]
fn a_decode_instance_told_to_terminate_hands_its_requests_over_with_their_kv() {
    let args =
        ["--max-tokens", "24", "--stop-decode-at-s", "5", "--temperature", "0.9", "--top-p", "0.95", "--seed", "3"];
    let Some((r, stdout, out)) = pd("stop", &args) else { return };
    assert_eq!(r["decoding"], "sampled at temperature 0.9, top-p 0.95, seed 3");
    assert!(stdout.contains("0 not equal to single-process sampled at temperature 0.9"), "{stdout}");
    assert!(r["decode_stopped_at_s"].as_f64().is_some_and(|t| t >= 5.0), "{}", r["decode_stopped_at_s"]);
    assert!(stdout.contains("stopped the decode instance"), "{stdout}");
    assert_eq!(r["decode_left"], 1, "the router heard it leave:\n{stdout}");
    assert!(r["drain_moved"].as_u64().is_some_and(|n| n > 0), "nothing moved:\n{stdout}");
    let log = std::fs::read_to_string(out.join("node-3.log")).unwrap();
    assert!(log.contains("node 3: instance stopped in"), "{log}");
    eprintln!("{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

/// An instance that exits on its own during the run (killed here with SIGKILL from outside, as
/// the kernel's OOM killer would) ends the run at once, naming the node, how it exited and the
/// end of its log. Before 2026-12-05 one that exited before the mesh formed left the router
/// waiting out its 120 s mesh timeout, and one that exited in the burst failed it with only
/// "no connection to node 1".
#[test]
fn an_instance_that_exits_on_its_own_ends_the_run_saying_which() {
    let Some(model) = model_dir() else { return };
    let out = std::env::temp_dir().join(format!("cascade-pd-exits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = Command::new(CASCADE)
        .args(["pd", "--requests", "10", "--rate", "10", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env_remove("RUST_BACKTRACE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Node 1 up (after the single-process reference), then killed.
    let log = out.join("node-1.log");
    let t = std::time::Instant::now();
    while !std::fs::read_to_string(&log).is_ok_and(|l| l.contains("endpoint listening")) {
        assert!(t.elapsed() < std::time::Duration::from_secs(300), "node 1 never started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pattern = format!("llm-instance --cluster {} --node 1 --", out.join("cluster.toml").display());
    let pid = Command::new("pgrep").args(["-f", &pattern]).output().unwrap();
    let pid = String::from_utf8_lossy(&pid.stdout).trim().to_string();
    assert!(Command::new("kill").args(["-KILL", &pid]).status().unwrap().success(), "no node 1 ({pid:?})");
    let t = std::time::Instant::now();
    let res = child.wait_with_output().unwrap();
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(err.contains("node 1 exited") && err.contains("SIGKILL") && err.contains("node-1.log"), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}: {err}");
    let _ = std::fs::remove_dir_all(&out);
}
