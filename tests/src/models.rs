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

/// Where SmolLM2-135M-Instruct lies: a model directory already imported from its GGUF, or the GGUF
/// file itself with the directory to import it into (each test crate imports its own way).
#[derive(Debug, Clone)]
pub enum Smollm2 {
    /// `target/models/smollm2-135m/f32`, with its weights, tokenizer and config.
    Imported(PathBuf),
    /// The GGUF (`scripts/fetch-smollm2.sh` puts it there) and where its import belongs.
    Gguf {
        /// The GGUF file.
        gguf: PathBuf,
        /// The model directory an import of it makes.
        dir: PathBuf,
    },
}

/// SmolLM2-135M-Instruct, imported or not, or `None` after saying on stderr that the test skips.
pub fn smollm2() -> Option<Smollm2> {
    let dir = smollm2_root().join("f32");
    if ["model.safetensors", "tokenizer.json", "config.json"].iter().all(|f| dir.join(f).is_file()) {
        return Some(Smollm2::Imported(dir));
    }
    Some(Smollm2::Gguf { gguf: smollm2_gguf()?, dir })
}

fn smollm2_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models/smollm2-135m")
}

/// SmolLM2's GGUF file, or `None` after saying on stderr that the test skips.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let gguf = smollm2_root().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.is_file() {
        return Some(gguf);
    }
    eprintln!("SKIPPED: SmolLM2-135M-Instruct not at {} (run scripts/fetch-smollm2.sh)", gguf.display());
    None
}
