//! Synthetic models with Llama-2-7B's structure, scaled down: for demos, tests and benchmarks
//! on machines without the real weights.
//!
//! Llama-2-7B has 32 blocks of hidden size 4096 and MLP size 11008 (q, k, v, o, gate, up, down
//! projections and two norms per block), a 32000-token embedding, a final norm and an LM head.
//! [`llama2_like`] keeps the 32 blocks, the tensor names and the proportions between tensors
//! and scales the hidden size so the file holds about the bytes asked for (f16, as Llama-2's
//! published weights). Tensor contents are pseudo-random from a seed, so models of different
//! seeds have different content hashes.

use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Blocks of Llama-2-7B.
pub const BLOCKS: usize = 32;

/// The shape of a scaled model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Hidden size (4096 in Llama-2-7B).
    pub hidden: usize,
    /// MLP size (11008).
    pub mlp: usize,
    /// Vocabulary (32000).
    pub vocab: usize,
}

impl Shape {
    /// The largest scaled shape whose tensors take at most `bytes` (at least hidden size 8).
    pub fn for_bytes(bytes: u64) -> Shape {
        // Parameters ≈ h² · (32 · (4 + 3 · 11008/4096) + 2 · 32000/4096) at 2 bytes each.
        let per_h2 = BLOCKS as f64 * (4.0 + 3.0 * 11008.0 / 4096.0) + 2.0 * 32000.0 / 4096.0;
        let h = ((bytes as f64 / (2.0 * per_h2)).sqrt() as usize / 8 * 8).max(8);
        Shape { hidden: h, mlp: h * 11008 / 4096, vocab: h * 32000 / 4096 }
    }

    /// Every tensor's name and shape, in Llama-2's naming.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, m, v) = (self.hidden, self.mlp, self.vocab);
        let mut t = vec![
            ("model.embed_tokens.weight".to_string(), vec![v, h]),
            ("model.norm.weight".into(), vec![h]),
            ("lm_head.weight".into(), vec![v, h]),
        ];
        for b in 0..BLOCKS {
            let p = format!("model.layers.{b}.");
            for (n, s) in [
                ("self_attn.q_proj.weight", vec![h, h]),
                ("self_attn.k_proj.weight", vec![h, h]),
                ("self_attn.v_proj.weight", vec![h, h]),
                ("self_attn.o_proj.weight", vec![h, h]),
                ("mlp.gate_proj.weight", vec![m, h]),
                ("mlp.up_proj.weight", vec![m, h]),
                ("mlp.down_proj.weight", vec![h, m]),
                ("input_layernorm.weight", vec![h]),
                ("post_attention_layernorm.weight", vec![h]),
            ] {
                t.push((format!("{p}{n}"), s));
            }
        }
        t
    }
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for w in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
}

/// A safetensors image of a Llama-2-7B-structured model of about `bytes` bytes.
pub fn llama2_like(bytes: u64, seed: u64) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let shape = Shape::for_bytes(bytes);
    let tensors = shape.tensors();
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (_, s))| {
            let mut d = vec![0u8; s.iter().product::<usize>() * 2];
            fill(&mut d, seed ^ (i as u64) << 32);
            d
        })
        .collect();
    let views = tensors
        .iter()
        .zip(&data)
        .map(|((n, s), d)| Ok((n.clone(), TensorView::new(Dtype::F16, s.clone(), d)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize(views, None)
}

/// Writes [`llama2_like`] to `path` (through a temporary file, so a reader never sees half).
pub fn write_llama2_like(path: &std::path::Path, bytes: u64, seed: u64) -> std::io::Result<()> {
    let image = llama2_like(bytes, seed).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, &image)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{LayerKind, Manifest};

    #[test]
    fn scaled_models_keep_llama2s_structure_and_size() {
        let image = llama2_like(4 << 20, 1).unwrap();
        let m = Manifest::from_bytes(&image, "l", 1 << 20, "mem").unwrap();
        assert_eq!(m.blocks(), BLOCKS);
        assert!(m.layers.iter().any(|l| l.kind == LayerKind::Embeddings));
        assert!(m.bytes <= 4 << 20 && m.bytes > 3 << 20, "{} bytes", m.bytes);
        let s = Shape::for_bytes(13_476_839_424);
        assert!((4000..=4100).contains(&s.hidden), "full size scales back to about 4096: {s:?}");
        let other = Manifest::from_bytes(&llama2_like(4 << 20, 2).unwrap(), "l", 1 << 20, "mem").unwrap();
        assert_ne!(m.content_hash, other.content_hash, "seeds give different models");
    }
}
