//! The real all-MiniLM-L6-v2 against reference embeddings from an independent implementation
//! (`testdata/minilm_reference.py`: numpy, its own tokenizer, float64). Skips, saying so, when the
//! model is not extracted (`.ci/run` extracts it to `target/models/all-minilm-l6-v2/`).
#![allow(clippy::unwrap_used)]

mod common;

use common::{cosine, model_dir, reference};

use cascade_exec::bert::{mean_pool_normalized, Bert};
use cascade_exec::embed::Embedder;
use cascade_exec::weights::Weights;
use cascade_exec::{Activation, ExecError, LayerExec};

/// Checks that `texts`, tokenised as one batch, give the references' ids once the padding is
/// left out; returns each text's token count.
fn assert_reference_ids(e: &Embedder, refs: &[common::Reference], texts: &[&str]) -> Vec<usize> {
    let batch = e.batch(texts).unwrap();
    let ids = batch.ids.to_vec2::<u32>().unwrap();
    let mask = batch.mask.to_vec2::<u32>().unwrap();
    refs.iter()
        .zip(ids.iter().zip(&mask))
        .map(|(r, (row, m))| {
            let n = m.iter().filter(|&&x| x == 1).count();
            assert_eq!(&row[..n], r.ids.as_slice(), "{}", r.text);
            n
        })
        .collect()
}

#[test]
fn embeddings_match_the_independent_reference() {
    let Some(dir) = model_dir() else { return };
    let e = Embedder::from_dir(&dir).unwrap();
    let refs = reference();
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();
    // Tokens: the batch's unpadded ids are the reference tokenizer's.
    assert_reference_ids(&e, &refs, &texts);
    // One batch, padded to the longest sentence: padding must not change any embedding.
    let got = e.embed(&texts).unwrap();
    for (r, g) in refs.iter().zip(&got) {
        assert_eq!(g.len(), 384);
        let c = cosine(g, &r.embedding);
        eprintln!("{:?}: cosine {c:.7} with the reference", r.text);
        assert!(c >= 0.9999, "{:?}: cosine {c}", r.text);
    }
    // Each sentence alone gives the same embedding as in the batch.
    let alone = e.embed(&texts[3..]).unwrap();
    assert!(cosine(&alone[0], &got[3]) >= 0.99999);
}

/// More texts than a batch run in batches of about equal length, in bounded memory: every
/// embedding comes back in its text's place, equal (up to float rounding) to the one from a
/// single batch, with progress after each batch; a batch of 0 is refused.
#[test]
fn many_texts_run_in_batches_and_come_back_in_their_order() {
    let Some(dir) = model_dir() else { return };
    let e = Embedder::from_dir(&dir).unwrap();
    let long = "a sentence that goes on and on ".repeat(12);
    let texts = [
        "short",
        long.as_str(),
        "Hello, world!",
        "",
        "The quick brown fox jumps over the lazy dog.",
        "x y z",
        "Cascade moves model parameters between GPUs.",
    ];
    let (one, cut_one) = e.embed_in_batches(&texts, texts.len(), |_, _| {}).unwrap();
    let mut seen = Vec::new();
    let (batched, cut) = e.embed_in_batches(&texts, 2, |done, all| seen.push((done, all))).unwrap();
    assert_eq!(seen, [(2, 7), (4, 7), (6, 7), (7, 7)]);
    assert_eq!(cut, cut_one);
    for (i, (a, b)) in one.iter().zip(&batched).enumerate() {
        let c = cosine(a, b);
        assert!(c >= 0.99999, "{:?}: cosine {c} between one batch and batches of 2", texts[i]);
    }
    // Each in its place: no two of these texts are that close.
    for (i, a) in batched.iter().enumerate() {
        for (j, b) in one.iter().enumerate() {
            if i != j {
                assert!(cosine(a, b) < 0.99, "{:?} came back where {:?} belongs", texts[i], texts[j]);
            }
        }
    }
    assert!(matches!(e.embed_in_batches(&texts, 0, |_, _| {}), Err(ExecError::Input(_))));
}

/// Texts longer than `tokenizer.json`'s cut (128) are embedded from their first 256 tokens, as
/// sentence-transformers does with this model (`sentence_bert_config.json`), and match the
/// independent reference cut the same way; the one past 256 is reported as cut.
#[test]
fn long_texts_are_cut_where_sentence_transformers_cuts_them() {
    let Some(dir) = model_dir() else { return };
    assert!(
        dir.join("sentence_bert_config.json").is_file(),
        "{} lacks sentence_bert_config.json: run scripts/fetch-minilm.sh (or .ci/run) again",
        dir.display()
    );
    let e = Embedder::from_dir(&dir).unwrap();
    assert_eq!(e.max_tokens(), Some(256));
    let refs = common::reference_long();
    let texts: Vec<&str> = refs.iter().map(|r| r.text.as_str()).collect();
    // The reference's tokens, cut at the same place, past tokenizer.json's own cut.
    for n in assert_reference_ids(&e, &refs, &texts) {
        assert!(n > 128, "longer than tokenizer.json's own cut: {n} tokens");
    }
    assert_eq!(e.truncated(&texts).unwrap(), [false, true]);
    let (vectors, cut) = e.embed_noting_cuts(&texts).unwrap();
    assert_eq!(cut, [false, true]);
    assert_eq!(vectors, e.embed(&texts).unwrap());
    for (r, g) in refs.iter().zip(vectors) {
        let c = cosine(&g, &r.embedding);
        eprintln!("{} tokens: cosine {c:.7} with the reference", r.ids.len());
        assert!(c >= 0.9999, "cosine {c}");
    }
}

#[test]
fn a_split_run_is_bit_identical_to_the_whole_run() {
    let Some(dir) = model_dir() else { return };
    let e = Embedder::from_dir(&dir).unwrap();
    let texts = ["Cascade moves model parameters between GPUs.", "Hello, world!"];
    let m = e.model();
    let whole = mean_pool_normalized(&m.run(0..m.layers(), e.batch(&texts).unwrap()).unwrap()).unwrap();
    for k in 1..m.layers() {
        let first = m.run(0..k, e.batch(&texts).unwrap()).unwrap();
        // Across the wire format, as between two instances.
        let moved = Activation::from_bytes(&first.to_bytes().unwrap()).unwrap();
        assert_eq!(moved.next_layer, k);
        let rest = m.run(k..m.layers(), moved).unwrap();
        let split = mean_pool_normalized(&rest).unwrap();
        let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&split), bits(&whole), "split at {k}");
    }
}

#[test]
fn layers_run_only_once_resident_and_from_the_packed_image() {
    let Some(dir) = model_dir() else { return };
    let e = Embedder::from_dir(&dir).unwrap();
    let file = std::fs::read(dir.join("model.safetensors")).unwrap();
    // The pool's packed, layer-major image, as a region holds it after a load or a multicast.
    let manifest = e.manifest();
    let mut image = vec![0u8; manifest.bytes as usize];
    manifest.pack(&file, &mut image);
    let w = Weights::packed(manifest, &image).unwrap();
    let mut m = Bert::new(e.model().config().clone());
    for s in 0..3 {
        m.load_stage(s, &w).unwrap();
    }
    let texts = ["Hello, world!"];
    let part = m.run(0..3, e.batch(&texts).unwrap()).unwrap();
    match m.run(3..m.layers(), part.clone()) {
        Err(ExecError::NotResident { layer: 3 }) => {}
        other => panic!("ran a layer that is not resident: {other:?}"),
    }
    for s in 3..m.layers() {
        m.load_stage(s, &w).unwrap();
    }
    let from_image = mean_pool_normalized(&m.run(3..m.layers(), part).unwrap()).unwrap();
    assert_eq!(from_image, e.embed(&texts).unwrap());
    // Out of order, or past the end: refused.
    assert!(matches!(m.run(2..4, e.batch(&texts).unwrap()), Err(ExecError::OutOfOrder { .. })));
    assert!(m.run(0..99, e.batch(&texts).unwrap()).is_err());
}

#[test]
fn activation_bytes_reject_garbage() {
    let a = Activation::new(vec![vec![101, 7592, 102]], vec![vec![1, 1, 1]]).unwrap();
    let b = a.to_bytes().unwrap();
    assert_eq!(Activation::from_bytes(&b).unwrap().ids.to_vec2::<u32>().unwrap(), vec![vec![101, 7592, 102]]);
    assert!(Activation::from_bytes(&b[..b.len() - 1]).is_err());
    assert!(Activation::from_bytes(b"CACT").is_err());
    let mut huge = b.clone();
    huge[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(Activation::from_bytes(&huge).is_err());
    assert!(Activation::new(vec![], vec![]).is_err());
    assert!(Activation::new(vec![vec![1, 2]], vec![vec![1]]).is_err());
}

/// Layers `[0, k)` on one endpoint, `[k, L)` on another: the activation's bytes travel as a WRITE
/// into the second node's registered region over a real TCP link. Bit-identical to one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_across_the_transport_is_bit_identical() {
    use cascade_transport::{test_access as ta, Op};
    let Some(dir) = model_dir() else { return };
    let e = std::sync::Arc::new(Embedder::from_dir(&dir).unwrap());
    let eps = cascade_tests::loopback::endpoints(2, "split", |_| {}).await.unwrap();
    let texts = ["The quick brown fox jumps over the lazy dog.", "Hello, world!"];
    let m = e.model();
    let whole = mean_pool_normalized(&m.run(0..m.layers(), e.batch(&texts).unwrap()).unwrap()).unwrap();
    let k = 3;
    let first = m.run(0..k, e.batch(&texts).unwrap()).unwrap().to_bytes().unwrap();
    // Node 0 stages the bytes in a region of its own and WRITEs them into node 1's.
    let len = first.len() as u64;
    let src = eps[0].register_new(len).unwrap();
    ta::write_local(&src, 0, &first).unwrap();
    let dst = eps[1].register_new(len).unwrap();
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, len).verified()]).await.unwrap();
    assert_eq!(r[0].as_ref().unwrap().bytes, len);
    // Node 1 runs the rest from what landed.
    let landed = Activation::from_bytes(&ta::view(&dst, 0, len).unwrap()).unwrap();
    let rest = mean_pool_normalized(&m.run(k..m.layers(), landed).unwrap()).unwrap();
    let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&whole));
    for ep in &eps {
        ep.shutdown();
    }
}

/// A checkpoint saved from a `BertFor…` model (its encoder's tensors named `bert.…`, a head
/// beside them) embeds exactly as the bare encoder's: the prefix is found in the weights, as
/// `transformers` finds it. Before 2026-12-05 it was refused ("no tensor
/// embeddings.word_embeddings.weight").
#[test]
fn a_checkpoint_with_the_bert_prefix_embeds_as_the_bare_encoder() {
    let Some(dir) = model_dir() else { return };
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut prefixed: std::collections::HashMap<String, candle_core::Tensor> =
        tensors.into_iter().map(|(k, v)| (format!("bert.{k}"), v)).collect();
    let head = candle_core::Tensor::zeros(30522, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    prefixed.insert("cls.predictions.bias".into(), head);
    let out = std::env::temp_dir().join(format!("cascade-bert-prefix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    candle_core::safetensors::save(&prefixed, out.join("model.safetensors")).unwrap();
    for f in ["tokenizer.json", "config.json", "sentence_bert_config.json"] {
        std::os::unix::fs::symlink(std::fs::canonicalize(dir.join(f)).unwrap(), out.join(f)).unwrap();
    }
    let texts: Vec<String> = reference().into_iter().map(|r| r.text).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let want = Embedder::from_dir(&dir).unwrap().embed(&texts).unwrap();
    let got = Embedder::from_dir(&out).unwrap().embed(&texts).unwrap();
    assert_eq!(got, want);
    std::fs::remove_dir_all(&out).unwrap();
}
