//! Helpers of the CLI's integration tests: the binary, scratch directories, the real SmolLM2.
#![allow(clippy::unwrap_used, dead_code, unreachable_pub)]

use std::process::Command;

/// The `cascade` binary under test.
pub const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

/// A fresh, empty directory for the test `tag` (this process's own).
pub fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cascade-honest-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// SmolLM2's model directory: the one the exec tests import, or an import of the GGUF into
/// `scratch`; `None` (the test skips, saying so) without the GGUF.
pub fn smollm2(scratch: &std::path::Path) -> Option<std::path::PathBuf> {
    let gguf = match cascade_tests::models::smollm2()? {
        cascade_tests::models::Smollm2::Imported(dir) => return Some(dir),
        cascade_tests::models::Smollm2::Gguf { gguf, .. } => gguf,
    };
    let out = scratch.join("smollm2");
    let ok = Command::new(CASCADE).args(["model", "import", "--gguf"]).arg(&gguf).arg("--out").arg(&out).status();
    assert!(ok.unwrap().success(), "importing {}", gguf.display());
    Some(out)
}
