//! `cascade pd` end to end at a small size: SmolLM2 in four instance processes, a burst with a
//! prefill→decode mutation and a live scale-out in its middle, then the first decode instance
//! killed with SIGKILL; every answer equal to single-process greedy, none lost or answered twice.
//! Skips, saying so, without the model.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

#[test]
fn disaggregated_serving_answers_every_request_with_the_greedy_tokens() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models/smollm2-135m");
    if !root.join("SmolLM2-135M-Instruct.Q4_1.gguf").is_file() && !root.join("f32/model.safetensors").is_file() {
        eprintln!("SKIPPED: SmolLM2-135M-Instruct not in {} (run scripts/fetch-smollm2.sh)", root.display());
        return;
    }
    let out = std::env::temp_dir().join(format!("cascade-pd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let res = Command::new(CASCADE)
        .args(["pd", "--requests", "10", "--rate", "10", "--max-tokens", "6", "--scale-after-s", "0.3"])
        .args(["--kill-decode-at-s", "0.8", "--model"])
        .arg(root.join("f32"))
        .arg("--out")
        .arg(&out)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "pd failed:\n{stdout}\n{}", String::from_utf8_lossy(&res.stderr));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(
        (r["answered"].as_u64(), r["lost"].as_u64(), r["answered_twice"].as_u64()),
        (Some(10), Some(0), Some(0))
    );
    assert_eq!(r["not_equal_to_reference"], 0);
    assert!(r["decode_killed_at_s"].as_f64().is_some_and(|t| t >= 0.8), "{}", r["decode_killed_at_s"]);
    assert!(stdout.contains("killed the decode instance"), "{stdout}");
    let rows = r["per_request"].as_array().unwrap();
    assert!(rows.iter().all(|x| x["equal_to_reference"] == true && x["ttft_ms"].as_f64().unwrap() > 0.0));
    let _ = std::fs::remove_dir_all(&out);
}
