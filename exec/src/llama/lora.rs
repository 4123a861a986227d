//! LoRA adapters on the attention projections of a [`super::Llama`] (dLoRA, seed `002_…`): an
//! adapter of rank `r` adds `(α/r)·B·A` to a projection `W` (`A` is `[r, in]`, `B` is `[out, r]`).
//! Two ways to serve it:
//!
//! - **merged** — `W' = W + (α/r)·B·A` folded into the base weights ([`super::Llama::merge`]),
//!   later un-merged in place ([`super::Llama::unmerge`]): fastest, but a merged batch serves that
//!   adapter's requests only;
//! - **unmerged** — each request's segment adds `(α/r)·B_k·A_k·x` for its own adapter `k`, so any
//!   adapters batch together, each iteration slower.
//!
//! Files are PEFT's layout: `adapter_model.safetensors` with
//! `base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight` and
//! `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`; an adapter with parts
//! not applied here is refused, as `lora/peft.rs` says). [`LoraAdapter::seeded`] makes the
//! test adapters: seeded random tensors, a test double named as such.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use cascade_param_pool::manifest::Manifest;

use super::LlamaConfig;
use crate::weights::Weights;
use crate::ExecError;

mod peft;

/// An attention projection an adapter can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Proj {
    /// `q_proj`.
    Q,
    /// `k_proj`.
    K,
    /// `v_proj`.
    V,
    /// `o_proj`.
    O,
}

impl Proj {
    /// Every projection.
    pub const ALL: [Proj; 4] = [Proj::Q, Proj::K, Proj::V, Proj::O];

    /// PEFT's module name.
    pub fn module(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
        }
    }

    fn from_module(m: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.module() == m)
    }

    /// (out, in) of this projection in `cfg`.
    pub fn shape(self, cfg: &LlamaConfig) -> (usize, usize) {
        let (h, kv) = (cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim());
        match self {
            Proj::Q | Proj::O => (h, h),
            Proj::K | Proj::V => (kv, h),
        }
    }
}

/// `adapter_config.json`, the fields used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank.
    pub r: usize,
    /// Scaling numerator (the delta is `lora_alpha / r · B·A`).
    pub lora_alpha: f64,
    /// The projections it targets (PEFT also writes one string, a pattern: kept as the only
    /// item). What is served is what the tensors hold.
    #[serde(deserialize_with = "peft::one_or_many")]
    pub target_modules: Vec<String>,
    /// Rank-stabilised LoRA (PEFT's `use_rslora`): the delta is scaled by `α / √r`, not `α / r`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub use_rslora: bool,
}

impl LoraConfig {
    /// Refuses what makes the delta's scale `α / r` no number: a rank of 0, a non-finite `α`.
    fn check(&self) -> Result<(), ExecError> {
        if self.r == 0 || !self.lora_alpha.is_finite() {
            return Err(ExecError::Model(format!("rank {} and alpha {}", self.r, self.lora_alpha)));
        }
        Ok(())
    }
}

/// One adapter's tensors.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// Its configuration.
    pub config: LoraConfig,
    /// `(A, B)` by (block, projection).
    pub weights: BTreeMap<(usize, Proj), (Tensor, Tensor)>,
}

const IMAGE_MAGIC: &[u8; 4] = b"CLRA";

#[derive(Serialize, Deserialize)]
struct ImageHeader {
    config: LoraConfig,
    pairs: Vec<(usize, Proj)>,
}

fn key(block: usize, p: Proj, ab: char) -> String {
    format!("base_model.model.model.layers.{block}.self_attn.{}.lora_{ab}.weight", p.module())
}

impl LoraAdapter {
    /// The delta's scale: `α / r`, or `α / √r` for rank-stabilised LoRA (`use_rslora`), as PEFT
    /// computes it.
    pub fn scale(&self) -> f64 {
        let r = self.config.r as f64;
        self.config.lora_alpha / if self.config.use_rslora { r.sqrt() } else { r }
    }

    /// A test double: an adapter of rank `r` on `targets` of every block of `cfg`, its tensors
    /// seeded random (`A` uniform in ±1/√in, `B` uniform in ±`b_scale`; PEFT initialises `B` to
    /// zero, which would make every adapter the base model). Refuses a rank of 0, a non-finite
    /// `alpha`, no target, and a rank above a target's min(out, in).
    pub fn seeded(
        cfg: &LlamaConfig,
        r: usize,
        alpha: f64,
        targets: &[Proj],
        seed: u64,
        b_scale: f32,
    ) -> Result<LoraAdapter, ExecError> {
        let target_modules = targets.iter().map(|p| p.module().to_string()).collect();
        let config = LoraConfig { r, lora_alpha: alpha, target_modules, use_rslora: false };
        config.check()?;
        if targets.is_empty() {
            return Err(ExecError::Model("an adapter targets at least one projection".into()));
        }
        // LoRA's rank is r ≤ min(out, in) of the projection it adapts: a larger one is no
        // low-rank delta, and its tensors outgrow the projection itself (rank 100,000 on
        // SmolLM2 would be 46 GB of test double, allocated before anything said no).
        for &p in targets {
            let (out, inn) = p.shape(cfg);
            if r > out.min(inn) {
                return Err(ExecError::Model(format!(
                    "rank {r} exceeds {}'s min(out, in) = {}: LoRA's rank is at most that",
                    p.module(),
                    out.min(inn)
                )));
            }
        }
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut uniform = move |n: usize, bound: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
                })
                .collect()
        };
        let mut weights = BTreeMap::new();
        for b in 0..cfg.num_hidden_layers {
            for &p in targets {
                let (out, inn) = p.shape(cfg);
                let a = Tensor::from_vec(uniform(r * inn, 1.0 / (inn as f32).sqrt()), (r, inn), &Device::Cpu)?;
                let bm = Tensor::from_vec(uniform(out * r, b_scale), (out, r), &Device::Cpu)?;
                weights.insert((b, p), (a, bm));
            }
        }
        Ok(LoraAdapter { config, weights })
    }

    /// An adapter from its configuration and named tensors (PEFT names), checked against `cfg`.
    pub fn from_tensors(
        config: LoraConfig,
        tensors: HashMap<String, Tensor>,
        cfg: &LlamaConfig,
    ) -> Result<LoraAdapter, ExecError> {
        config.check()?;
        peft::refuse_unserved(tensors.keys())?;
        let mut weights = BTreeMap::new();
        for (name, a) in &tensors {
            let Some((block, p, 'A')) = peft::lora_key(name) else { continue };
            let b = tensors
                .get(&key(block, p, 'B'))
                .ok_or_else(|| ExecError::Model(format!("{name} without its lora_B")))?;
            let (out, inn) = p.shape(cfg);
            if block >= cfg.num_hidden_layers || a.dims() != [config.r, inn] || b.dims() != [out, config.r] {
                return Err(ExecError::Model(format!(
                    "{name}: A {:?} and B {:?} do not fit block {block} of the model at rank {}",
                    a.dims(),
                    b.dims(),
                    config.r
                )));
            }
            weights.insert((block, p), (a.to_dtype(candle_core::DType::F32)?, b.to_dtype(candle_core::DType::F32)?));
        }
        if weights.is_empty() {
            return Err(ExecError::Model("no lora_A/lora_B pair on an attention projection".into()));
        }
        if let Some(b) =
            tensors.keys().find(|n| matches!(peft::lora_key(n), Some((k, p, 'B')) if !weights.contains_key(&(k, p))))
        {
            return Err(ExecError::Model(format!("{b} without its lora_A")));
        }
        Ok(LoraAdapter { config, weights })
    }

    /// An adapter from the tensors of a model the parameter pool holds — an adapter is an
    /// ordinary model there (registered, replicated, multicast and loaded like any other): its
    /// manifest names the tensors and `w` reads them from the file or the packed image.
    pub fn from_pool(
        config: LoraConfig,
        manifest: &Manifest,
        w: &Weights<'_>,
        cfg: &LlamaConfig,
    ) -> Result<LoraAdapter, ExecError> {
        let mut tensors = HashMap::new();
        for t in manifest.layers.iter().flat_map(|l| &l.tensors) {
            tensors.insert(t.name.clone(), w.tensor(&t.name)?);
        }
        Self::from_tensors(config, tensors, cfg)
    }

    /// Its configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The adapter as one byte image, for a WRITE to another instance (co-migration):
    /// `"CLRA"`, the length of a JSON header (little-endian u32), the header (configuration and the
    /// (block, projection) of every pair in order), then each pair's `A` and `B` as little-endian
    /// f32, row-major. [`LoraAdapter::from_image`] reads it back.
    pub fn to_image(&self) -> Result<Vec<u8>, ExecError> {
        let pairs: Vec<(usize, Proj)> = self.weights.keys().copied().collect();
        let header = serde_json::to_vec(&ImageHeader { config: self.config.clone(), pairs })
            .map_err(|e| ExecError::Model(format!("adapter header: {e}")))?;
        let mut out = Vec::with_capacity(8 + header.len() + self.bytes());
        out.extend_from_slice(IMAGE_MAGIC);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        for (a, b) in self.weights.values() {
            for t in [a, b] {
                for x in t.flatten_all()?.to_vec1::<f32>()? {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(out)
    }

    /// Reads [`LoraAdapter::to_image`]'s bytes, checking every shape against `cfg` and the
    /// length exactly.
    pub fn from_image(image: &[u8], cfg: &LlamaConfig) -> Result<LoraAdapter, ExecError> {
        let bad = |why: &str| ExecError::Model(format!("adapter image: {why}"));
        let rest = image.strip_prefix(IMAGE_MAGIC.as_slice()).ok_or_else(|| bad("no CLRA magic"))?;
        let (len, rest) = rest.split_first_chunk::<4>().ok_or_else(|| bad("truncated header length"))?;
        let len = u32::from_le_bytes(*len) as usize;
        let header = rest.get(..len).ok_or_else(|| bad("truncated header"))?;
        let h: ImageHeader = serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
        let mut data = &rest[len..];
        let mut tensors = HashMap::new();
        for &(block, p) in &h.pairs {
            let (out, inn) = p.shape(cfg);
            for (ab, dims) in [('A', (h.config.r, inn)), ('B', (out, h.config.r))] {
                let n = dims.0 * dims.1;
                let raw = data.get(..4 * n).ok_or_else(|| bad("truncated tensors"))?;
                let v: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                tensors.insert(key(block, p, ab), Tensor::from_vec(v, dims, &Device::Cpu)?);
                data = &data[4 * n..];
            }
        }
        if !data.is_empty() {
            return Err(bad(&format!("{} bytes after the tensors", data.len())));
        }
        Self::from_tensors(h.config, tensors, cfg)
    }

    /// What [`bytes`](Self::bytes) will be for a [`seeded`](Self::seeded) adapter of rank `r` on
    /// `targets` of every block of `cfg`, known before building it (saturating).
    pub fn seeded_bytes(cfg: &LlamaConfig, r: usize, targets: &[Proj]) -> u64 {
        let per_block: u64 = targets.iter().map(|p| p.shape(cfg)).map(|(out, inn)| (out + inn) as u64).sum();
        per_block.saturating_mul(4).saturating_mul(r as u64).saturating_mul(cfg.num_hidden_layers as u64)
    }

    /// Bytes of its tensors.
    pub fn bytes(&self) -> usize {
        self.weights.values().map(|(a, b)| 4 * (a.elem_count() + b.elem_count())).sum()
    }

    /// The delta `(α/r)·B·A` of one projection, `[out, in]`.
    pub fn delta(&self, block: usize, p: Proj) -> Result<Option<Tensor>, ExecError> {
        match self.weights.get(&(block, p)) {
            Some((a, b)) => Ok(Some((b.matmul(a)? * self.scale())?)),
            None => Ok(None),
        }
    }

    /// `(α/r)·B·A·x` for `x` `[1, n, in]`, when it targets (block, p).
    pub fn apply(&self, block: usize, p: Proj, x: &Tensor) -> Result<Option<Tensor>, ExecError> {
        match self.weights.get(&(block, p)) {
            Some((a, b)) => Ok(Some((x.broadcast_matmul(&a.t()?)?.broadcast_matmul(&b.t()?)? * self.scale())?)),
            None => Ok(None),
        }
    }
}
