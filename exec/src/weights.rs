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
        let (bytes, dtype, shape) = self.stored(name)?;
        if dtype == DType::U8 {
            let (kind, n, k) = blocks::kind_of(shape)
                .ok_or_else(|| ExecError::Model(format!("tensor {name:?}: U8 {shape:?} is no GGUF block matrix")))?;
            let w =
                blocks::dequantize(kind, bytes, n, k).map_err(|e| ExecError::Model(format!("tensor {name:?}: {e}")))?;
            return Ok(Tensor::from_vec(w, (n, k), &crate::bert::cpu())?);
        }
        Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &crate::bert::cpu())?.to_dtype(DType::F32)?)
    }

    /// Tensor `name`'s bytes in the image, its dtype and its shape, to be read without a copy
    /// in between.
    pub(crate) fn stored(&self, name: &str) -> Result<(&'a [u8], DType, &'a [usize]), ExecError> {
        let &(layer, t) = self.index.get(name).ok_or_else(|| ExecError::Model(format!("no tensor {name:?}")))?;
        let dtype = match t.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            // A matrix of GGUF blocks, `[rows, blocks, bytes per block]` (`projection::blocks`).
            "U8" if blocks::kind_of(&t.shape).is_some() => DType::U8,
            other => {
                return Err(ExecError::Model(format!(
                    "tensor {name:?} is {other} {:?}; F32, F16, BF16 and U8 matrices of GGUF Q4_1 or Q8_0 blocks are supported",
                    t.shape
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
        Ok((bytes, dtype, &t.shape))
    }
}
