//! A batch's activation between layers: the token ids and mask it started from and the hidden
//! states so far, with the index of the next layer to run. It travels between instances as bytes
//! ([`Activation::to_bytes`]): a small header, then the ids, the mask and the hidden states in
//! little-endian order.

use candle_core::{DType, Tensor};

use crate::ExecError;

/// A batch in flight through a model's layers.
#[derive(Debug, Clone)]
pub struct Activation {
    /// Token ids, `[batch, seq]`, u32.
    pub ids: Tensor,
    /// Attention mask, `[batch, seq]`, u32 (1 = token, 0 = padding).
    pub mask: Tensor,
    /// Hidden states `[batch, seq, hidden]` (f32) once the first layer ran.
    pub hidden: Option<Tensor>,
    /// The next layer to run.
    pub next_layer: usize,
}

const MAGIC: &[u8; 4] = b"CACT";

impl Activation {
    /// A batch before its first layer.
    pub fn new(ids: Vec<Vec<u32>>, mask: Vec<Vec<u32>>) -> Result<Activation, ExecError> {
        let (b, s) = (ids.len(), ids.first().map_or(0, Vec::len));
        if b == 0 || s == 0 {
            return Err(ExecError::Input("an empty batch".into()));
        }
        if ids.iter().chain(&mask).any(|r| r.len() != s) || mask.len() != b {
            return Err(ExecError::Input("ids and mask must be [batch, seq] alike".into()));
        }
        let dev = crate::bert::cpu();
        let ids = Tensor::from_vec(ids.concat(), (b, s), &dev)?;
        let mask = Tensor::from_vec(mask.concat(), (b, s), &dev)?;
        Ok(Activation { ids, mask, hidden: None, next_layer: 0 })
    }

    /// Bytes of [`Activation::to_bytes`] for `batch` sequences of `tokens` with hidden states of
    /// `width`: what a slot must hold.
    pub fn wire_len(batch: usize, tokens: usize, width: usize) -> usize {
        36 + batch * tokens * (8 + 4 * width)
    }

    /// The activation as bytes for the wire.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ExecError> {
        let (b, s) = self.ids.dims2()?;
        let hidden = match &self.hidden {
            Some(h) => h.flatten_all()?.to_vec1::<f32>()?,
            None => Vec::new(),
        };
        let width = hidden.len().checked_div(b * s).unwrap_or(0);
        let mut out = Vec::with_capacity(4 + 8 * 4 + 8 * b * s + 4 * hidden.len());
        out.extend_from_slice(MAGIC);
        for v in [b as u64, s as u64, width as u64, self.next_layer as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for t in [&self.ids, &self.mask] {
            for v in t.flatten_all()?.to_vec1::<u32>()? {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        for v in hidden {
            out.extend_from_slice(&v.to_le_bytes());
        }
        Ok(out)
    }

    /// Reads [`Activation::to_bytes`]'s format back.
    pub fn from_bytes(buf: &[u8]) -> Result<Activation, ExecError> {
        let bad = |why: &str| ExecError::Input(format!("activation bytes: {why}"));
        if buf.len() < 36 || &buf[..4] != MAGIC {
            return Err(bad("no header"));
        }
        let word = |i: usize| u64::from_le_bytes(buf[4 + 8 * i..12 + 8 * i].try_into().unwrap_or_default()) as usize;
        let (b, s, width, next) = (word(0), word(1), word(2), word(3));
        let n = b.checked_mul(s).ok_or_else(|| bad("size overflows"))?;
        let want = n
            .checked_mul(8)
            .and_then(|x| x.checked_add(n.checked_mul(width)?.checked_mul(4)?))
            .and_then(|x| x.checked_add(36))
            .ok_or_else(|| bad("size overflows"))?;
        if buf.len() != want || n == 0 {
            return Err(bad(&format!("{} bytes, {want} expected", buf.len())));
        }
        let u32s = |from: usize, count: usize| -> Vec<u32> {
            buf[from..from + 4 * count].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let dev = crate::bert::cpu();
        let ids = Tensor::from_vec(u32s(36, n), (b, s), &dev)?;
        let mask = Tensor::from_vec(u32s(36 + 4 * n, n), (b, s), &dev)?;
        let hidden = if width == 0 {
            None
        } else {
            let f: Vec<f32> =
                buf[36 + 8 * n..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Some(Tensor::from_vec(f, (b, s, width), &dev)?.to_dtype(DType::F32)?)
        };
        Ok(Activation { ids, mask, hidden, next_layer: next })
    }
}
