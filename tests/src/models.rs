//! Where the real models the tests use lie (`.ci/run` fetches them into `target/models/`), for
//! tests that skip, saying so, without them.

use std::path::PathBuf;

/// The real all-MiniLM-L6-v2's directory, or `None` after saying on stderr that the test skips.
pub fn minilm() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models/all-minilm-l6-v2");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    eprintln!("SKIPPED: all-MiniLM-L6-v2 not at {} (run .ci/run or scripts/fetch-minilm.sh)", dir.display());
    None
}
