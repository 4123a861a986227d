//! A GGUF file's tensors as `safetensors` writes them: each is read, dequantized, unpermuted and
//! converted only when its bytes are written, and dropped after, so an import holds one tensor at
//! a time rather than the whole dequantized model (SmolLM2-135M: 683 MB at the peak before, for a
//! 538 MB file; a 7-billion-parameter GGUF would have needed 28 GB).
//!
//! With [`Storage::Quantized`] a Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 matrix is written as its GGUF
//! blocks, unchanged but for the Q/K rows' order: U8 `[rows, blocks, bytes per block]`, which
//! [`crate::projection::blocks`] reads.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fs::File;
use std::io::BufReader;

use candle_core::quantized::gguf_file::Content;
use candle_core::{DType, Device, Tensor};

use super::{bad, unpermute, Storage};
use crate::projection::blocks::{Kind, BLOCK};
use crate::ExecError;

/// The source of the tensors: the GGUF file open for reading, what they are converted to, and
/// the first failure (`safetensors`' [`safetensors::View::data`] cannot return one).
pub(super) struct Source<'c, P> {
    content: &'c Content,
    reader: RefCell<BufReader<File>>,
    storage: Storage,
    /// Tensors written so far, and whom to tell.
    progress: RefCell<(usize, P)>,
    failure: RefCell<Option<ExecError>>,
}

/// One tensor of [`Source`], not yet read.
pub(super) struct Lazy<'s, 'c, P> {
    source: &'s Source<'c, P>,
    /// Its name in the GGUF file.
    name: &'c str,
    /// The heads whose rows llama.cpp permuted (Q and K projections).
    heads: Option<usize>,
    /// Its shape in the GGUF file.
    gguf_shape: Vec<usize>,
    /// How it is written: a dtype, or its GGUF blocks.
    stored: Stored,
    /// The shape written: the GGUF's, or `[rows, blocks, bytes per block]`.
    shape: Vec<usize>,
}

/// How one tensor is written.
#[derive(Clone, Copy)]
enum Stored {
    Values(DType),
    Blocks(Kind),
}

impl<P> Lazy<'_, '_, P> {
    /// Whether it is written as its GGUF blocks.
    pub(super) fn as_blocks(&self) -> bool {
        matches!(self.stored, Stored::Blocks(_))
    }
}

impl<'c, P: FnMut(usize, usize, &str)> Source<'c, P> {
    /// Reads the tensors of `content` from `reader`, to be stored as `storage` says.
    pub(super) fn new(content: &'c Content, reader: BufReader<File>, storage: Storage, progress: P) -> Self {
        Self {
            content,
            reader: RefCell::new(reader),
            storage,
            progress: RefCell::new((0, progress)),
            failure: RefCell::new(None),
        }
    }

    /// The tensor named `name` in the GGUF file, of `shape`, to be read when it is written.
    pub(super) fn tensor(&self, name: &'c str, shape: &[usize], heads: Option<usize>) -> Lazy<'_, 'c, P> {
        let kind = self.content.tensor_infos.get(name).and_then(|i| Kind::of_ggml(i.ggml_dtype));
        let (stored, written) = match (self.storage, kind, shape) {
            (Storage::F16, ..) => (Stored::Values(DType::F16), shape.to_vec()),
            (Storage::Quantized, Some(kind), &[n, k]) if k.is_multiple_of(BLOCK) => {
                (Stored::Blocks(kind), vec![n, k / BLOCK, kind.gguf_bytes()])
            }
            _ => (Stored::Values(DType::F32), shape.to_vec()),
        };
        Lazy { source: self, name, heads, gguf_shape: shape.to_vec(), stored, shape: written }
    }

    /// The first failure while the tensors were written, if any: the file written is then not
    /// to be used.
    pub(super) fn failure(&self) -> Option<ExecError> {
        self.failure.borrow_mut().take()
    }

    fn bytes(&self, t: &Lazy<'_, 'c, P>) -> Result<Vec<u8>, ExecError> {
        let name = t.name;
        let q = self
            .content
            .tensor(&mut *self.reader.borrow_mut(), name, &Device::Cpu)
            .map_err(|e| bad(format!("{name}: {e}")))?;
        if q.shape().dims() != t.gguf_shape {
            return Err(bad(format!("{name} read as {:?}, its header says {:?}", q.shape().dims(), t.gguf_shape)));
        }
        let dtype = match t.stored {
            Stored::Values(dtype) => dtype,
            Stored::Blocks(kind) => {
                // The blocks as they are; Q and K rows put back in Hugging Face's order whole.
                let raw = q.data().map_err(|e| bad(format!("{name}: {e}")))?;
                let (n, k) = (t.gguf_shape[0], t.gguf_shape[1]);
                kind.check(raw.len(), n, k).map_err(|e| bad(format!("{name}: {e}")))?;
                let Some(h) = t.heads else { return Ok(raw.into_owned()) };
                let rows = Tensor::from_raw_buffer(&raw, DType::U8, &[n, raw.len() / n], &Device::Cpu)?;
                return Ok(unpermute(&rows, h)?.flatten_all()?.to_vec1::<u8>()?);
            }
        };
        let mut w = q.dequantize(&Device::Cpu).map_err(|e| bad(format!("{name}: {e}")))?;
        drop(q);
        if let Some(h) = t.heads {
            w = unpermute(&w, h)?;
        }
        let w = w.to_dtype(dtype)?;
        Ok(safetensors::View::data(&w).into_owned())
    }
}

impl<P: FnMut(usize, usize, &str)> safetensors::View for Lazy<'_, '_, P> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.stored {
            Stored::Values(dtype) => dtype.into(),
            Stored::Blocks(_) => safetensors::Dtype::U8,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let s = self.source;
        {
            let mut progress = s.progress.borrow_mut();
            let (done, tell) = &mut *progress;
            tell(*done, s.content.tensor_infos.len(), self.name);
            *done += 1;
        }
        if s.failure.borrow().is_some() {
            // The file is void already: the rest is not read.
            return Cow::Borrowed(&[]);
        }
        match s.bytes(self) {
            Ok(bytes) => Cow::Owned(bytes),
            Err(e) => {
                *s.failure.borrow_mut() = Some(e);
                Cow::Borrowed(&[])
            }
        }
    }

    fn data_len(&self) -> usize {
        let size = match self.stored {
            Stored::Values(dtype) => dtype.size_in_bytes(),
            Stored::Blocks(_) => 1,
        };
        self.shape.iter().product::<usize>() * size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::projection::blocks::dequantize;
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};

    /// A quantized import writes Q4_1 and Q8_0 matrices as their blocks (U8 `[rows, blocks,
    /// bytes]`, a Q projection's rows un-permuted whole) and every other tensor — another block
    /// type (Q4_K here), an f32 norm — dequantized to f32; each holds the values the f32 import
    /// would write, bit for bit.
    #[test]
    fn a_quantized_import_keeps_q4_1_and_q8_0_blocks_and_dequantizes_the_rest() {
        let dev = Device::Cpu;
        let w = |rows: usize, cols: usize| Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap();
        let tensors = [
            ("blk.0.attn_q.weight", QTensor::quantize(&w(64, 256), GgmlDType::Q4_1).unwrap(), Some(2)),
            ("token_embd.weight", QTensor::quantize(&w(32, 256), GgmlDType::Q8_0).unwrap(), None),
            ("blk.0.ffn_up.weight", QTensor::quantize(&w(16, 256), GgmlDType::Q4K).unwrap(), None),
            (
                "blk.0.attn_norm.weight",
                QTensor::quantize(&w(1, 256).squeeze(0).unwrap(), GgmlDType::F32).unwrap(),
                None,
            ),
        ];
        let path = std::env::temp_dir().join(format!("cascade-tensors-{}.gguf", std::process::id()));
        {
            let mut f = File::create(&path).unwrap();
            let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q, _)| (*n, q)).collect();
            gguf_file::write(&mut f, &[], &named).unwrap();
        }
        let mut r = BufReader::new(File::open(&path).unwrap());
        let content = Content::read(&mut r).unwrap();
        let source = Source::new(&content, r, Storage::Quantized, |_, _, _| {});
        let lazy: Vec<_> =
            tensors.iter().map(|(n, q, heads)| (n.to_string(), source.tensor(n, q.shape().dims(), *heads))).collect();
        let blocks: Vec<bool> = lazy.iter().map(|(_, t)| t.as_blocks()).collect();
        assert_eq!(blocks, [true, true, false, false], "Q4_1 and Q8_0 as blocks, Q4_K and f32 not");
        let bytes = safetensors::serialize(lazy, None).unwrap();
        assert!(source.failure().is_none());
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (name, q, heads) in &tensors {
            let view = st.tensor(name).unwrap();
            let mut want = q.dequantize(&dev).unwrap();
            if let Some(h) = heads {
                want = unpermute(&want, *h).unwrap();
            }
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let dims = q.shape().dims();
            let got = match q.dtype() {
                GgmlDType::Q4_1 | GgmlDType::Q8_0 => {
                    let kind = Kind::of_ggml(q.dtype()).unwrap();
                    let bytes = if q.dtype() == GgmlDType::Q4_1 { 20 } else { 34 };
                    assert_eq!(kind.gguf_bytes(), bytes);
                    assert_eq!(view.dtype(), safetensors::Dtype::U8, "{name}");
                    assert_eq!(view.shape(), [dims[0], dims[1] / 32, bytes], "{name}");
                    dequantize(kind, view.data(), dims[0], dims[1]).unwrap()
                }
                _ => {
                    assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
                    assert_eq!(view.shape(), dims, "{name}");
                    view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
                }
            };
            assert_eq!(bits(&got), bits(&want), "{name}");
        }
        let _ = std::fs::remove_file(&path);
    }
}
