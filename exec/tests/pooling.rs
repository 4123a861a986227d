//! sentence-transformers' pooling modes on the real all-MiniLM-L6-v2, against
//! `testdata/minilm_pooling_reference.json` (`testdata/minilm_reference.py`: numpy, float64, each
//! text alone). The model directory is the real one, linked, with a `modules.json` and a
//! `1_Pooling/config.json` as sentence-transformers writes them. Skips, saying so, without the
//! model.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use cascade_exec::embed::Embedder;
use cascade_exec::pooling::{PoolMode, Pooling};
use common::{cosine, model_dir};

/// Each mode: its key in the reference, itself, and its field in `1_Pooling/config.json`.
const MODES: [(&str, PoolMode, &str); 6] = [
    ("cls", PoolMode::Cls, "pooling_mode_cls_token"),
    ("max", PoolMode::Max, "pooling_mode_max_tokens"),
    ("mean", PoolMode::Mean, "pooling_mode_mean_tokens"),
    ("mean_sqrt_len", PoolMode::MeanSqrtLen, "pooling_mode_mean_sqrt_len_tokens"),
    ("weightedmean", PoolMode::WeightedMean, "pooling_mode_weightedmean_tokens"),
    ("lasttoken", PoolMode::LastToken, "pooling_mode_lasttoken"),
];

/// The model's files linked into a fresh directory `name`, with `modules` as its
/// `modules.json` and `pooling` as `1_Pooling/config.json`.
fn with_modules(model: &Path, name: &str, modules: &serde_json::Value, pooling: &serde_json::Value) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cascade-pooling-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("1_Pooling")).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "config.json", "sentence_bert_config.json"] {
        std::os::unix::fs::symlink(std::fs::canonicalize(model.join(f)).unwrap(), d.join(f)).unwrap();
    }
    std::fs::write(d.join("modules.json"), modules.to_string()).unwrap();
    std::fs::write(d.join("1_Pooling/config.json"), pooling.to_string()).unwrap();
    d
}

fn modules(normalize: bool) -> serde_json::Value {
    let mut m = vec![
        serde_json::json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
        serde_json::json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}),
    ];
    if normalize {
        m.push(serde_json::json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    serde_json::Value::Array(m)
}

fn pooling_config(modes: &[&str]) -> serde_json::Value {
    let mut c = serde_json::json!({"word_embedding_dimension": 384, "include_prompt": true});
    for (key, _, field) in MODES {
        c[field] = modes.contains(&key).into();
    }
    c
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
}

/// Each mode alone, the texts in one padded batch: every embedding matches the reference's (same
/// direction and length), so padding is masked out of each; and two modes with `Normalize` give
/// the two references concatenated, then normalised.
#[test]
fn each_pooling_mode_matches_the_independent_reference() {
    let Some(model) = model_dir() else { return };
    let refs: serde_json::Value =
        serde_json::from_str(include_str!("../testdata/minilm_pooling_reference.json")).unwrap();
    let refs = refs["sentences"].as_array().unwrap();
    let texts: Vec<&str> = refs.iter().map(|r| r["text"].as_str().unwrap()).collect();
    let vector = |r: &serde_json::Value, key: &str| -> Vec<f32> {
        r[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    };
    for (key, mode, _) in MODES {
        let dir = with_modules(&model, key, &modules(false), &pooling_config(&[key]));
        assert_eq!(Pooling::from_dir(&dir, 384).unwrap(), Pooling { modes: vec![mode], normalize: false });
        let e = Embedder::from_dir(&dir).unwrap();
        let got = e.embed(&texts).unwrap();
        for (r, g) in refs.iter().zip(&got) {
            let want = vector(r, key);
            let (c, ratio) = (cosine(g, &want), norm(g) / norm(&want));
            assert!(
                c >= 0.9999 && (ratio - 1.0).abs() < 1e-3,
                "{key} {:?}: cosine {c}, length ratio {ratio}",
                r["text"]
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let dir = with_modules(&model, "cls-mean", &modules(true), &pooling_config(&["mean", "cls"]));
    let got = Embedder::from_dir(&dir).unwrap().embed(&texts).unwrap();
    for (r, g) in refs.iter().zip(&got) {
        let want: Vec<f32> = vector(r, "cls").into_iter().chain(vector(r, "mean")).collect();
        assert_eq!(g.len(), 768);
        assert!((norm(g) - 1.0).abs() < 1e-5 && cosine(g, &want) >= 0.9999, "{:?}", r["text"]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A module that is not applied here (a `Dense` layer), no pooling mode, no Pooling module, or a
/// pooling width that is not the model's is refused, naming it; without `modules.json` the
/// model gets all-MiniLM-L6-v2's mean and normalisation. Before 2026-12-05 every directory got
/// the mean, normalised, whatever its modules said.
#[test]
fn modules_not_applied_here_are_refused() {
    let Some(model) = model_dir() else { return };
    let mut dense = modules(true);
    dense.as_array_mut().unwrap().insert(
        2,
        serde_json::json!({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}),
    );
    let dir = with_modules(&model, "dense", &dense, &pooling_config(&["mean"]));
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("sentence_transformers.models.Dense") && e.contains("not applied here"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = with_modules(&model, "none", &modules(true), &pooling_config(&[]));
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("no pooling mode"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    let mut wide = pooling_config(&["mean"]);
    wide["word_embedding_dimension"] = 768.into();
    let dir = with_modules(&model, "wide", &modules(true), &wide);
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("word_embedding_dimension 768"), "{e}");

    let only =
        serde_json::json!([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]);
    std::fs::write(dir.join("modules.json"), only.to_string()).unwrap();
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("no Pooling module"), "{e}");

    std::fs::remove_file(dir.join("modules.json")).unwrap();
    assert_eq!(Pooling::from_dir(&dir, 384).unwrap(), Pooling::default());
    std::fs::remove_dir_all(&dir).unwrap();
}
