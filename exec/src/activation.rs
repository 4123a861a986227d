//! A batch's activation between layers: the token ids and mask it started from and the hidden
//! states so far, with the index of the next layer to run. It travels between instances as bytes
//! ([`Activation::to_bytes`]): a small header, then the ids, the mask, the hidden states and the
//! segments, in little-endian order.
//!
//! An encoder batch is `[batch, seq]`, padded, with no segments. A decoder batch is *packed*:
//! `[1, tokens]` with every sequence's new tokens one after another and a [`Segment`] per sequence
//! saying where its tokens lie and at which position they start (so prefills of several prompts
//! and decode steps of running requests share one batch; see [`crate::llama`]).

use candle_core::{DType, Tensor};

use crate::ExecError;

/// One sequence's tokens in a packed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The sequence (request) whose KV cache the tokens extend.
    pub seq: u64,
    /// The position of its first token in the sequence (the tokens its cache already holds).
    pub pos: u32,
    /// Its tokens in this batch.
    pub len: u32,
    /// The LoRA adapter its request is served with (0: the base model).
    pub adapter: u32,
}

/// A batch in flight through a model's layers.
#[derive(Debug, Clone)]
pub struct Activation {
    /// Token ids, `[batch, seq]`, u32.
    pub ids: Tensor,
    /// Attention mask, `[batch, seq]`, u32 (1 = token, 0 = padding).
    pub mask: Tensor,
    /// Hidden states (f32, three dimensions) once the first layer ran: `[batch, seq, hidden]`,
    /// or after a decoder's head `[1, segments, vocabulary]` logits.
    pub hidden: Option<Tensor>,
    /// The next layer to run.
    pub next_layer: usize,
    /// A packed decoder batch's sequences, in token order; empty for an encoder batch.
    pub segments: Vec<Segment>,
}

const MAGIC: &[u8; 4] = b"CAC2";
const HEADER: usize = 4 + 8 * 7;
const SEGMENT: usize = 20;

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
        Ok(Activation { ids, mask, hidden: None, next_layer: 0, segments: Vec::new() })
    }

    /// A packed decoder batch before its first layer: per sequence, its id, the position its new
    /// tokens start at, and those tokens.
    pub fn packed(seqs: &[(u64, u32, Vec<u32>)]) -> Result<Activation, ExecError> {
        if seqs.is_empty() || seqs.iter().any(|(_, _, t)| t.is_empty()) {
            return Err(ExecError::Input("an empty batch or sequence".into()));
        }
        let ids: Vec<u32> = seqs.iter().flat_map(|(_, _, t)| t.iter().copied()).collect();
        let n = ids.len();
        let dev = crate::bert::cpu();
        let segments = seqs
            .iter()
            .map(|(seq, pos, t)| Segment { seq: *seq, pos: *pos, len: t.len() as u32, adapter: 0 })
            .collect();
        Ok(Activation {
            ids: Tensor::from_vec(ids, (1, n), &dev)?,
            mask: Tensor::ones((1, n), DType::U32, &dev)?,
            hidden: None,
            next_layer: 0,
            segments,
        })
    }

    /// Sets each segment's LoRA adapter, in order (0: the base model).
    pub fn with_adapters(mut self, adapters: &[u32]) -> Result<Activation, ExecError> {
        if adapters.len() != self.segments.len() {
            return Err(ExecError::Input(format!("{} adapters for {} segments", adapters.len(), self.segments.len())));
        }
        for (g, &a) in self.segments.iter_mut().zip(adapters) {
            g.adapter = a;
        }
        Ok(self)
    }

    /// Bytes of [`Activation::to_bytes`] for `batch` sequences of `tokens` with hidden states of
    /// `width` and `segments` segments: what a slot must hold.
    pub fn wire_len(batch: usize, tokens: usize, width: usize, segments: usize) -> usize {
        HEADER + batch * tokens * (8 + 4 * width) + SEGMENT * segments
    }

    /// The activation as bytes for the wire.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ExecError> {
        let (b, s) = self.ids.dims2()?;
        let (dims, hidden) = match &self.hidden {
            Some(h) => (h.dims3()?, h.flatten_all()?.to_vec1::<f32>()?),
            None => ((0, 0, 0), Vec::new()),
        };
        let mut out = Vec::with_capacity(HEADER + 8 * b * s + 4 * hidden.len() + SEGMENT * self.segments.len());
        out.extend_from_slice(MAGIC);
        for v in [b, s, dims.0, dims.1, dims.2, self.next_layer, self.segments.len()] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for t in [&self.ids, &self.mask] {
            for v in t.flatten_all()?.to_vec1::<u32>()? {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        for v in hidden {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for g in &self.segments {
            out.extend_from_slice(&g.seq.to_le_bytes());
            out.extend_from_slice(&g.pos.to_le_bytes());
            out.extend_from_slice(&g.len.to_le_bytes());
            out.extend_from_slice(&g.adapter.to_le_bytes());
        }
        Ok(out)
    }

    /// Reads [`Activation::to_bytes`]'s format back.
    pub fn from_bytes(buf: &[u8]) -> Result<Activation, ExecError> {
        let bad = |why: &str| ExecError::Input(format!("activation bytes: {why}"));
        if buf.len() < HEADER || &buf[..4] != MAGIC {
            return Err(bad("no header"));
        }
        let word = |i: usize| u64::from_le_bytes(buf[4 + 8 * i..12 + 8 * i].try_into().unwrap_or_default()) as usize;
        let (b, s, hx, hy, width, next, segs) = (word(0), word(1), word(2), word(3), word(4), word(5), word(6));
        let overflow = || bad("size overflows");
        let n = b.checked_mul(s).ok_or_else(overflow)?;
        let h = hx.checked_mul(hy).and_then(|x| x.checked_mul(width)).ok_or_else(overflow)?;
        let want = [n.checked_mul(8), h.checked_mul(4), segs.checked_mul(SEGMENT)]
            .into_iter()
            .try_fold(HEADER, |acc, x| acc.checked_add(x?))
            .ok_or_else(overflow)?;
        if buf.len() != want || n == 0 {
            return Err(bad(&format!("{} bytes, {want} expected", buf.len())));
        }
        let u32s = |from: usize, count: usize| -> Vec<u32> {
            buf[from..from + 4 * count].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let dev = crate::bert::cpu();
        let ids = Tensor::from_vec(u32s(HEADER, n), (b, s), &dev)?;
        let mask = Tensor::from_vec(u32s(HEADER + 4 * n, n), (b, s), &dev)?;
        let at = HEADER + 8 * n;
        let hidden = if h == 0 {
            None
        } else {
            let f: Vec<f32> =
                buf[at..at + 4 * h].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Some(Tensor::from_vec(f, (hx, hy, width), &dev)?)
        };
        let segments = buf[at + 4 * h..]
            .chunks_exact(SEGMENT)
            .map(|c| {
                let w = u32s_at(c);
                Segment { seq: u64::from(w[0]) | (u64::from(w[1]) << 32), pos: w[2], len: w[3], adapter: w[4] }
            })
            .collect();
        Ok(Activation { ids, mask, hidden, next_layer: next, segments })
    }
}

fn u32s_at(c: &[u8]) -> [u32; 5] {
    std::array::from_fn(|i| u32::from_le_bytes([c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_batch_round_trips_through_bytes() {
        let mut a = Activation::packed(&[(7, 0, vec![1, 2, 3]), (u64::MAX - 1, 41, vec![9])])
            .unwrap()
            .with_adapters(&[0, 5])
            .unwrap();
        assert_eq!(a.ids.dims2().unwrap(), (1, 4));
        a.hidden = Some(Tensor::arange(0f32, 24.0, &crate::bert::cpu()).unwrap().reshape((1, 2, 12)).unwrap());
        a.next_layer = 31;
        let bytes = a.to_bytes().unwrap();
        assert_eq!(bytes.len(), HEADER + 8 * 4 + 4 * 24 + SEGMENT * 2);
        assert!(Activation::packed(&[(1, 0, vec![1])]).unwrap().with_adapters(&[1, 2]).is_err());
        let b = Activation::from_bytes(&bytes).unwrap();
        assert_eq!(b.segments, a.segments);
        assert_eq!(b.next_layer, 31);
        assert_eq!(b.ids.to_vec2::<u32>().unwrap(), vec![vec![1, 2, 3, 9]]);
        assert_eq!(b.hidden.unwrap().to_vec3::<f32>().unwrap(), a.hidden.unwrap().to_vec3::<f32>().unwrap());
        assert!(Activation::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        assert!(Activation::packed(&[]).is_err() && Activation::packed(&[(1, 0, vec![])]).is_err());
        assert_eq!(Activation::wire_len(1, 4, 6, 2), bytes.len());
    }
}
