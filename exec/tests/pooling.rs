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
        assert_eq!(
            Pooling::from_dir(&dir, 384).unwrap(),
            Pooling { modes: vec![mode], normalize: false, include_prompt: true }
        );
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

/// The prompt reference's sentences and, for `key` (`include_prompt` or `exclude_prompt`), their
/// embeddings; and the plain reference's embeddings of the same sentences.
fn prompt_reference(key: &str) -> (Vec<String>, Vec<Vec<f32>>) {
    let refs: serde_json::Value =
        serde_json::from_str(include_str!("../testdata/minilm_prompt_reference.json")).unwrap();
    assert_eq!(refs["prompt"], "query: ");
    let rows = refs["sentences"].as_array().unwrap();
    let texts = rows.iter().map(|r| r["text"].as_str().unwrap().to_string()).collect();
    let vectors =
        rows.iter().map(|r| r[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
    (texts, vectors)
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let c = cosine(g, w);
        assert!(c >= 0.9999, "{what}, text {i}: cosine {c}");
    }
}

/// A model directory whose `config_sentence_transformers.json` names prompts and a default one:
/// every text gets the default prompt before it, as sentence-transformers' `encode` does, pooled
/// with the text's tokens (`include_prompt` true, the default) or without them (false); both
/// match the independent reference (`minilm_prompt_reference.json`: "query: " put before each
/// sentence). An instance's batch and pooling (`ServedModel`) do the same. Another prompt is
/// chosen by name, an empty one puts none. Before 2026-12-05 the prompts were not read: every
/// text was embedded without its model's default prompt.
#[test]
fn the_default_prompt_goes_before_every_text_and_is_pooled_as_the_model_says() {
    let Some(model) = model_dir() else { return };
    let prompts = serde_json::json!({
        "prompts": {"query": "query: ", "passage": "passage: "},
        "default_prompt_name": "query",
        "similarity_fn_name": "cosine",
    });
    for (include, key) in [(true, "include_prompt"), (false, "exclude_prompt")] {
        let mut pooling = pooling_config(&["mean"]);
        pooling["include_prompt"] = include.into();
        let dir = with_modules(&model, key, &modules(true), &pooling);
        std::fs::write(dir.join("config_sentence_transformers.json"), prompts.to_string()).unwrap();
        let (texts, want) = prompt_reference(key);
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let mut e = Embedder::from_dir(&dir).unwrap();
        assert_eq!(e.prompt().map(|p| p.text.as_str()), Some("query: "));
        assert_close(&e.embed(&texts).unwrap(), &want, key);

        // The serving instances' path: their batch, the layers, their pooling.
        let (served, _) = cascade_exec::serve::ServedModel::from_dir(&dir).unwrap();
        let act = served.batch(&texts).unwrap();
        let stages = cascade_exec::LayerExec::layers(e.model());
        let act = cascade_exec::LayerExec::run(e.model(), 0..stages, act).unwrap();
        assert_close(&served.pool(&act).unwrap(), &want, &format!("{key}, served"));

        // "passage: " is another text: not the query's embeddings.
        e.use_prompt_named("passage").unwrap();
        assert!(cosine(&e.embed(&texts[..1]).unwrap()[0], &want[0]) < 0.999);
        let err = e.use_prompt_named("document").unwrap_err().to_string();
        assert!(err.contains("no prompt named \"document\"") && err.contains("passage, query"), "{err}");
        // No prompt: the plain reference.
        e.use_prompt("").unwrap();
        assert!(e.prompt().is_none());
        let plain: serde_json::Value = serde_json::from_str(include_str!("../testdata/minilm_reference.json")).unwrap();
        let plain: Vec<Vec<f32>> = plain["sentences"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect();
        assert_close(&e.embed(&texts).unwrap(), &plain, "no prompt");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A default prompt name that names no prompt, or an `include_prompt` that is not a boolean, is
/// refused when the model is read, saying which.
#[test]
fn a_default_prompt_that_is_not_there_is_refused() {
    let Some(model) = model_dir() else { return };
    let dir = with_modules(&model, "no-default", &modules(true), &pooling_config(&["mean"]));
    let prompts = serde_json::json!({"prompts": {"query": "query: "}, "default_prompt_name": "retrieval"});
    std::fs::write(dir.join("config_sentence_transformers.json"), prompts.to_string()).unwrap();
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("default_prompt_name") && e.contains("\"retrieval\""), "{e}");

    std::fs::remove_file(dir.join("config_sentence_transformers.json")).unwrap();
    let mut pooling = pooling_config(&["mean"]);
    pooling["include_prompt"] = "no".into();
    std::fs::write(dir.join("1_Pooling/config.json"), pooling.to_string()).unwrap();
    let e = Embedder::from_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("include_prompt is \"no\""), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
