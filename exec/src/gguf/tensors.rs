//! A GGUF file's tensors as `safetensors` writes them: each is read, dequantized, unpermuted and
//! converted only when its bytes are written, and dropped after, so an import holds one tensor at
//! a time rather than the whole dequantized model (SmolLM2-135M: 683 MB at the peak before, for a
//! 538 MB file; a 7-billion-parameter GGUF would have needed 28 GB).

use std::borrow::Cow;
use std::cell::RefCell;
use std::fs::File;
use std::io::BufReader;

use candle_core::quantized::gguf_file::Content;
use candle_core::{DType, Device};

use super::{bad, unpermute};
use crate::ExecError;

/// The source of the tensors: the GGUF file open for reading, what they are converted to, and
/// the first failure (`safetensors`' [`safetensors::View::data`] cannot return one).
pub(super) struct Source<'c, P> {
    content: &'c Content,
    reader: RefCell<BufReader<File>>,
    dtype: DType,
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
    shape: Vec<usize>,
}

impl<'c, P: FnMut(usize, usize, &str)> Source<'c, P> {
    /// Reads the tensors of `content` from `reader`, converted to `dtype`.
    pub(super) fn new(content: &'c Content, reader: BufReader<File>, dtype: DType, progress: P) -> Self {
        Self {
            content,
            reader: RefCell::new(reader),
            dtype,
            progress: RefCell::new((0, progress)),
            failure: RefCell::new(None),
        }
    }

    /// The tensor named `name` in the GGUF file, of `shape`, to be read when it is written.
    pub(super) fn tensor(&self, name: &'c str, shape: &[usize], heads: Option<usize>) -> Lazy<'_, 'c, P> {
        Lazy { source: self, name, heads, shape: shape.to_vec() }
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
        let mut w = q.dequantize(&Device::Cpu).map_err(|e| bad(format!("{name}: {e}")))?;
        drop(q);
        if let Some(h) = t.heads {
            w = unpermute(&w, h)?;
        }
        let w = w.to_dtype(self.dtype)?;
        if w.dims() != t.shape {
            return Err(bad(format!("{name} read as {:?}, its header says {:?}", w.dims(), t.shape)));
        }
        Ok(safetensors::View::data(&w).into_owned())
    }
}

impl<P: FnMut(usize, usize, &str)> safetensors::View for Lazy<'_, '_, P> {
    fn dtype(&self) -> safetensors::Dtype {
        self.source.dtype.into()
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
        self.shape.iter().product::<usize>() * self.source.dtype.size_in_bytes()
    }
}
