//! Model manifests: what a safetensors file holds, grouped into layers, with checksums.
//!
//! The file is read through a memory mapping (no copy); the `safetensors` crate validates the
//! header (length, JSON, dtype × shape against byte ranges, ranges inside and covering the data).
//! Tensors are grouped into layers by name — embeddings, numbered blocks (`model.layers.N.`,
//! `encoder.layer.N.`, `h.N.`, `blocks.N.`, …), the head (`lm_head`, final norm, pooler) and
//! anything else — and placed **layer-major**: the manifest assigns every tensor an offset in a
//! packed image where each layer is one contiguous byte range, in serving order. That image is
//! what the loader writes into a registered region and what a multicast moves, so a layer is
//! complete at a target exactly when its range is. The crc32 of every chunk of the packed image
//! and a SHA-256 of the file (the model's content identity) are recorded.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use safetensors::{SafeTensorError, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Chunk size used when none is given: 1 MiB. It is also the pool's multicast chunk (a run moves
/// the chunks its crcs describe), and a chain's pipeline fills one chunk per hop: 4 MiB chunks
/// made the demo's 6-target scale-out of MiniLM at 1 Gbit/s take 1.30 s, 1 MiB ones 1.00 s.
pub const DEFAULT_CHUNK: u64 = 1 << 20;

/// Why a model file was rejected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// The file could not be opened or mapped.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The error. Part of the message, not a `source()`, so an error chain prints it once.
        error: std::io::Error,
    },
    /// The file is not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {detail}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The file holds no tensor data.
    #[error("{path}: holds no tensor data")]
    Empty {
        /// The file.
        path: String,
    },
    /// A chunk size of zero.
    #[error("chunk size must be positive")]
    ZeroChunk,
}

fn describe(e: SafeTensorError) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => "truncated: shorter than the 8-byte header length".into(),
        SafeTensorError::InvalidHeaderLength => "the header length runs past the end of the file (truncated?)".into(),
        SafeTensorError::HeaderTooLarge => "the header length is implausibly large (over 100 MB)".into(),
        SafeTensorError::MetadataIncompleteBuffer => {
            "the tensor data does not end where the file does (truncated or trailing bytes)".into()
        }
        SafeTensorError::InvalidOffset(t) => {
            format!("tensor {t:?}: byte range out of bounds, overlapping or leaving a gap")
        }
        SafeTensorError::TensorInvalidInfo => "a tensor's byte range does not match its dtype and shape".into(),
        SafeTensorError::InvalidHeader(e) => format!("the header is not UTF-8: {e}"),
        SafeTensorError::InvalidHeaderDeserialization(e) => format!("the header is not valid JSON metadata: {e}"),
        SafeTensorError::ValidationOverflow => "tensor sizes overflow".into(),
        other => other.to_string(),
    }
}

/// What a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum LayerKind {
    /// Token/position embeddings (served first).
    Embeddings,
    /// Transformer block `n`.
    Block(u32),
    /// Final norm, LM head, pooler, classifier.
    Head,
    /// Tensors that match no known naming pattern (kept, placed last).
    Other,
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerKind::Embeddings => f.write_str("embeddings"),
            LayerKind::Block(n) => write!(f, "block.{n}"),
            LayerKind::Head => f.write_str("head"),
            LayerKind::Other => f.write_str("other"),
        }
    }
}

/// The layer a tensor belongs to, from its name.
pub fn classify(name: &str) -> LayerKind {
    let parts: Vec<&str> = name.split('.').collect();
    for w in parts.windows(2) {
        if matches!(w[0], "layers" | "layer" | "h" | "blocks" | "block") {
            if let Ok(n) = w[1].parse() {
                return LayerKind::Block(n);
            }
        }
    }
    let lower = name.to_ascii_lowercase();
    if lower.contains("embed") || parts.iter().any(|p| matches!(*p, "wte" | "wpe")) {
        return LayerKind::Embeddings;
    }
    let head_words = ["lm_head", "pooler", "classifier", "ln_f", "final_layer_norm", "score"];
    if head_words.iter().any(|w| lower.contains(w)) || matches!(parts.as_slice(), ["norm", ..] | ["model", "norm", ..])
    {
        return LayerKind::Head;
    }
    LayerKind::Other
}

/// One tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Name in the file.
    pub name: String,
    /// Data type (as safetensors names it).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the file.
    pub file_range: Range<u64>,
    /// Offset in the packed, layer-major image.
    pub offset: u64,
}

/// One layer: a contiguous range of the packed image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerEntry {
    /// What it is.
    pub kind: LayerKind,
    /// Byte range in the packed image.
    pub range: Range<u64>,
    /// Its tensors, in packed order.
    pub tensors: Vec<TensorEntry>,
}

/// A model's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Model name.
    pub name: String,
    /// SHA-256 of the whole file, hex: the model's content identity.
    pub content_hash: String,
    /// File size.
    pub file_bytes: u64,
    /// Bytes of tensor data (size of the packed image).
    pub bytes: u64,
    /// Chunk size of `chunk_crcs`.
    pub chunk: u64,
    /// crc32 of each chunk of the packed image.
    pub chunk_crcs: Vec<u32>,
    /// Layers in serving order.
    pub layers: Vec<LayerEntry>,
}

impl Manifest {
    /// Reads a safetensors file through a memory mapping.
    pub fn from_file(path: &Path, name: &str, chunk: u64) -> Result<Manifest, ManifestError> {
        let shown = path.display().to_string();
        let map =
            crate::files::MappedFile::open(path).map_err(|error| ManifestError::Io { path: shown.clone(), error })?;
        Self::from_bytes(&map, name, chunk, &shown)
    }

    /// Builds the manifest of a safetensors image held in memory; `path` names it in errors.
    pub fn from_bytes(buf: &[u8], name: &str, chunk: u64, path: &str) -> Result<Manifest, ManifestError> {
        let mut m = Self::layout_of(buf, name, chunk, path)?;
        (m.content_hash, m.chunk_crcs) = m.hashes(buf);
        Ok(m)
    }

    /// [`Manifest::from_bytes`], running `work` meanwhile on this thread while another computes
    /// the content hash and the chunk crcs, which take most of the time (SHA-256 over the whole
    /// file: 0.3 s of SmolLM2-135M's 538 MB, 2026-12-05). `work` is given the manifest's layout —
    /// its layers and tensors, all a loader reads — before the hash and the crcs are filled in:
    /// they are empty in what `work` sees. Returns the whole manifest and what `work` returned.
    pub fn from_bytes_while<R>(
        buf: &[u8],
        name: &str,
        chunk: u64,
        path: &str,
        work: impl FnOnce(&Manifest) -> R,
    ) -> Result<(Manifest, R), ManifestError> {
        let mut m = Self::layout_of(buf, name, chunk, path)?;
        let (hashes, done) = std::thread::scope(|s| {
            let layout = &m;
            let hashing = s.spawn(move || layout.hashes(buf));
            let done = work(layout);
            (hashing.join(), done)
        });
        (m.content_hash, m.chunk_crcs) = hashes.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((m, done))
    }

    /// The SHA-256 of `buf` (hex) and the crcs of the packed image's chunks.
    fn hashes(&self, buf: &[u8]) -> (String, Vec<u32>) {
        (hex(&Sha256::digest(buf)), self.packed_chunk_crcs(buf))
    }

    /// The layers and tensors of `buf`, the content hash and chunk crcs left empty.
    fn layout_of(buf: &[u8], name: &str, chunk: u64, path: &str) -> Result<Manifest, ManifestError> {
        if chunk == 0 {
            return Err(ManifestError::ZeroChunk);
        }
        let fmt_err = |detail: String| ManifestError::Format { path: path.to_string(), detail };
        let (n, meta) = SafeTensors::read_metadata(buf).map_err(|e| fmt_err(describe(e)))?;
        let data_start = 8 + n as u64;
        let mut by_layer: std::collections::BTreeMap<LayerKind, Vec<TensorEntry>> = Default::default();
        for (tname, info) in meta.tensors() {
            let (a, b) = info.data_offsets;
            by_layer.entry(classify(&tname)).or_default().push(TensorEntry {
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                file_range: data_start + a as u64..data_start + b as u64,
                offset: 0,
                name: tname,
            });
        }
        let mut layers: Vec<LayerEntry> = by_layer
            .into_iter()
            .filter(|(_, t)| t.iter().any(|t| t.file_range.end > t.file_range.start))
            .map(|(kind, mut tensors)| {
                tensors.sort_by(|x, y| x.name.cmp(&y.name));
                LayerEntry { kind, range: 0..0, tensors }
            })
            .collect();
        let at = lay_out(&mut layers);
        if at == 0 {
            return Err(ManifestError::Empty { path: path.to_string() });
        }
        Ok(Manifest {
            name: name.to_string(),
            content_hash: String::new(),
            file_bytes: buf.len() as u64,
            bytes: at,
            chunk,
            chunk_crcs: Vec::new(),
            layers,
        })
    }

    /// crc32 of each chunk of the packed image, streaming over the tensors in packed order.
    fn packed_chunk_crcs(&self, file: &[u8]) -> Vec<u32> {
        let mut crcs = Vec::with_capacity(self.bytes.div_ceil(self.chunk) as usize);
        let mut h = crc32fast::Hasher::new();
        let mut filled = 0u64;
        for t in self.layers.iter().flat_map(|l| &l.tensors) {
            let mut data = &file[t.file_range.start as usize..t.file_range.end as usize];
            while !data.is_empty() {
                let take = ((self.chunk - filled) as usize).min(data.len());
                h.update(&data[..take]);
                data = &data[take..];
                filled += take as u64;
                if filled == self.chunk {
                    crcs.push(std::mem::take(&mut h).finalize());
                    filled = 0;
                }
            }
        }
        if filled > 0 {
            crcs.push(h.finalize());
        }
        crcs
    }

    /// The same model packed with its embedding layer last (after the head): for serving where a
    /// new copy's blocks should arrive before an embedding table that another instance can
    /// apply for it (a BERT encoder's table is half its bytes and almost none of its compute;
    /// see `cascade_exec::serve`). Offsets and chunk crcs are recomputed from `file` (the same
    /// safetensors image); the content hash is the file's and does not change.
    pub fn with_embeddings_last(&self, file: &[u8]) -> Manifest {
        let (entry, rest): (Vec<LayerEntry>, Vec<LayerEntry>) =
            self.layers.iter().cloned().partition(|l| l.kind == LayerKind::Embeddings);
        let mut m =
            Manifest { layers: rest.into_iter().chain(entry).collect(), chunk_crcs: Vec::new(), ..self.clone() };
        lay_out(&mut m.layers);
        m.chunk_crcs = m.packed_chunk_crcs(file);
        m
    }

    /// Copies the tensors of `file` (the same safetensors image) into `dst` in packed order —
    /// the reference the loader is checked against.
    pub fn pack(&self, file: &[u8], dst: &mut [u8]) {
        for t in self.layers.iter().flat_map(|l| &l.tensors) {
            let len = (t.file_range.end - t.file_range.start) as usize;
            dst[t.offset as usize..t.offset as usize + len]
                .copy_from_slice(&file[t.file_range.start as usize..t.file_range.end as usize]);
        }
    }

    /// The multicast layout of the packed image: its chunks, their crcs and the layer ranges.
    pub fn layout(&self) -> cascade_multicast::Layout {
        cascade_multicast::Layout {
            bytes: self.bytes,
            chunk: self.chunk,
            crcs: self.chunk_crcs.clone(),
            layers: self.layers.iter().map(|l| l.range.clone()).collect(),
        }
    }

    /// Number of transformer blocks.
    pub fn blocks(&self) -> usize {
        self.layers.iter().filter(|l| matches!(l.kind, LayerKind::Block(_))).count()
    }
}

/// Places `layers`' tensors one after another in their order (each layer's range, each tensor's
/// offset); returns the packed image's size.
fn lay_out(layers: &mut [LayerEntry]) -> u64 {
    let mut at = 0u64;
    for l in layers {
        let start = at;
        for t in &mut l.tensors {
            t.offset = at;
            at += t.file_range.end - t.file_range.start;
        }
        l.range = start..at;
    }
    at
}

/// Lower-case hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests;
