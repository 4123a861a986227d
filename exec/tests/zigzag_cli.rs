//! The `zigzag` binary: Figure 12's golden case as JSON; a reader that goes away ends it quietly,
//! and an output it cannot write (a full disk) is said in one line — before 2026-12-05 both
//! panicked in `println!` with a backtrace.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};

const ZIGZAG: &str = env!("CARGO_BIN_EXE_zigzag");
const FIGURE_12: [&str; 7] = ["--layers", "7", "--load-ratio", "6", "--batches", "6", "--json"];

#[test]
fn figure_12_as_json_and_an_output_that_cannot_be_written() {
    let out = Command::new(ZIGZAG).args(FIGURE_12).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["x"], serde_json::json!([0, 2, 2, 3, 4, 4]));
    assert_eq!(v["latencies"], serde_json::json!([7, 12, 17, 21, 24, 27]));
    assert_eq!((v["sum"].as_u64(), v["max"].as_u64()), (Some(108), Some(27)));

    // The reader is gone before the output is written.
    let mut child = Command::new(ZIGZAG).args(FIGURE_12).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.is_empty(), "{:?}: {err}", out.status);

    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(ZIGZAG).args(FIGURE_12).stdout(full).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), "zigzag: writing the output: No space left on device (os error 28)");
}
