//! A model's tensors, found through its manifest in one of the two images that hold them: the
//! safetensors file itself, or the pool's packed, layer-major image (what a node's region holds
//! after a load or a multicast). Tensors are built by copying their bytes out of the image.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use cascade_param_pool::manifest::{Manifest, TensorEntry};

use crate::projection::blocks;
use crate::ExecError;

/// Where the image's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Image {
    /// The safetensors file: tensors at their `file_range`.
    File,
    /// The packed image: tensors at their `offset`.
    Packed,
}

/// How a stored tensor's bytes encode it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    /// Values of this dtype.
    Values(DType),
    /// A matrix `[rows, inputs]` as GGUF rows of `kind`'s blocks: a U8 tensor `[rows, blocks,
    /// bytes per block]` (`projection::blocks`).
    Blocks { kind: blocks::Kind, rows: usize, inputs: usize },
}

/// Tensors by name over an image.
pub struct Weights<'a> {
    bytes: &'a [u8],
    image: Image,
    index: HashMap<&'a str, (usize, &'a TensorEntry)>,
}

impl<'a> Weights<'a> {
    /// Tensors of the safetensors file `bytes` that `manifest` describes.
    pub fn file(manifest: &'a Manifest, bytes: &'a [u8]) -> Result<Weights<'a>, ExecError> {
        if bytes.len() as u64 != manifest.file_bytes {
            return Err(ExecError::Model(format!(
                "the file has {} bytes, its manifest {}",
                bytes.len(),
                manifest.file_bytes
            )));
        }
        Ok(Self::index(manifest, bytes, Image::File))
    }

    /// Tensors of the packed image `bytes` (a region's contents) that `manifest` describes.
    pub fn packed(manifest: &'a Manifest, bytes: &'a [u8]) -> Result<Weights<'a>, ExecError> {
        if (bytes.len() as u64) < manifest.bytes {
            return Err(ExecError::Model(format!("the image has {} bytes, the model {}", bytes.len(), manifest.bytes)));
        }
        Ok(Self::index(manifest, bytes, Image::Packed))
    }

    /// Tensors of a packed image that is still arriving: `verified` holds its first bytes, every
    /// chunk of them crc-verified on this node (what a multicast's `LayerReady` reports). A
    /// tensor past them is [`ExecError::NotResident`], never read.
    pub fn verified_prefix(manifest: &'a Manifest, verified: &'a [u8]) -> Result<Weights<'a>, ExecError> {
        if verified.len() as u64 > manifest.bytes {
            return Err(ExecError::Model(format!(
                "{} verified bytes, the model has {}",
                verified.len(),
                manifest.bytes
            )));
        }
        Ok(Self::index(manifest, verified, Image::Packed))
    }

    fn index(manifest: &'a Manifest, bytes: &'a [u8], image: Image) -> Weights<'a> {
        let index = manifest
            .layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.tensors.iter().map(move |t| (t.name.as_str(), (i, t))))
            .collect();
        Weights { bytes, image, index }
    }

    /// Whether the model has a tensor `name` (resident or not).
    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tensor `name` as an f32 CPU tensor (F16 and BF16 are widened, a matrix of GGUF blocks is
    /// dequantized to `[rows, inputs]`).
    pub fn tensor(&self, name: &str) -> Result<Tensor, ExecError> {
        match self.stored(name)? {
            (bytes, Encoding::Blocks { kind, rows, inputs }, _) => {
                let w = blocks::dequantize(kind, bytes, rows, inputs)
                    .map_err(|e| ExecError::Model(format!("tensor {name:?}: {e}")))?;
                Ok(Tensor::from_vec(w, (rows, inputs), &crate::bert::cpu())?)
            }
            (bytes, Encoding::Values(dtype), shape) => {
                Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &crate::bert::cpu())?.to_dtype(DType::F32)?)
            }
        }
    }

    /// Tensor `name`'s bytes in the image, how they encode it, and its shape, to be read without
    /// a copy in between.
    pub(crate) fn stored(&self, name: &str) -> Result<(&'a [u8], Encoding, &'a [usize]), ExecError> {
        let &(layer, t) = self.index.get(name).ok_or_else(|| ExecError::Model(format!("no tensor {name:?}")))?;
        let encoding = match (t.dtype.as_str(), blocks::kind_of(&t.shape)) {
            ("F32", _) => Encoding::Values(DType::F32),
            ("F16", _) => Encoding::Values(DType::F16),
            ("BF16", _) => Encoding::Values(DType::BF16),
            ("U8", Some((kind, rows, inputs))) => Encoding::Blocks { kind, rows, inputs },
            (other, _) => {
                return Err(ExecError::Model(format!(
                    "tensor {name:?} is {other} {:?}; F32, F16, BF16 and U8 matrices of GGUF blocks ({}) are supported",
                    t.shape,
                    blocks::KEPT
                )))
            }
        };
        let len = t.file_range.end - t.file_range.start;
        let start = match self.image {
            Image::File => t.file_range.start,
            Image::Packed => t.offset,
        };
        let end = start + len;
        if self.image == Image::Packed && end > self.bytes.len() as u64 {
            // Past the verified prefix of an arriving image: the manifest layer holding it is not
            // here yet (a full image is never shorter than the model).
            return Err(ExecError::NotResident { layer });
        }
        let bytes = self
            .bytes
            .get(start as usize..end as usize)
            .ok_or_else(|| ExecError::Model(format!("tensor {name:?} lies outside the image")))?;
        Ok((bytes, encoding, &t.shape))
    }
}
