//! A projection `y = x · Wᵀ (+ b)` computed from `W` packed in panels: the llama blocks' and LM
//! head's (no bias), and BERT's dense layers (with one).
//!
//! A decode step multiplies one token per running sequence by every weight matrix: a product of
//! a few rows by a large `W`. `candle_nn::Linear` hands it to `gemm`, which packs (copies) the
//! strided `Wᵀ` it is given into panels at every call: for one row it streams `W` at about 25 GB/s
//! here, but for 2 to 64 rows the packing costs as much as the product (9–13 GB/s for 2–8 rows),
//! so a decode step of two sequences took 2.4 times one of a single sequence, and sixteen
//! sequences decoded hardly faster than eight (2026-12-05).
//!
//! On x86_64 with AVX2, FMA and F16C, this module packs `W` once, when the model loads, into
//! panels of [`PANEL`](kernel::PANEL) outputs (`[panel][input][PANEL]`, the last panel padded
//! with zeros; `packed.rs`) and keeps only that copy. A product runs the kernel `gemm` would run
//! on its own packing (`kernel.rs`): for a group of up to [`GROUP`](kernel::GROUP) tokens and
//! one panel, two 8-lane accumulators per token, each input's 16 weights loaded once for the
//! group and each token's input broadcast once for the panel. A thread passes every group over
//! [`CACHED_W_BYTES`](kernel::CACHED_W_BYTES) of its panels at a time, which stay in L2, so `W`
//! comes from memory once; with more than one group, the inputs go in blocks of
//! [`KC`](kernel::KC), so that a group's stay in L1. The panels are split over rayon's threads.
//! On another CPU, `Linear` computes as before. A tied LM head and the token embedding table it
//! doubles as are one packed matrix ([`Projection::rows`] looks tokens up in it).
//!
//! A model stored in f16 (`cascade model import --dtype f16`) keeps its matrices in f16 panels
//! ([`packed::Half`]), which the kernel widens to f32 as it loads them (F16C): half the memory,
//! half the bytes a decode step streams, and the products of the f32 values they widen to,
//! bit for bit — before, its matrices were widened to f32 when they loaded. Adding to such a
//! matrix (a LoRA adapter merged) widens it to f32 first, so that taking the delta away again
//! gives `W` back.
//!
//! A model imported with its GGUF blocks kept (`cascade model import --dtype quantized`) keeps
//! its Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices in panels of those blocks ([`blocks`]: 4.5 to 9
//! bits a weight),
//! dequantized as a product reads them to exactly the f32 values the f32 import holds, so its
//! products are the f32 model's bit for bit. Adding to such a matrix widens it to f32 first.
//!
//! Each output is one chain of fused multiply-adds over the inputs in order, whatever the number
//! of tokens, their place in the batch or the thread count: a sequence's logits are the same bits
//! whether it decodes alone or with 31 others (before, up to 8 tokens went through dot products
//! and more through `gemm`, whose sums run in another order). The sums differ from the `Linear`
//! path's in the last bits (below 1e-3 in the tests' products).
//!
//! One call on the 2 vCPUs here, release, distinct matrices in turn (60 of each MLP shape, 30 of
//! q/o, 3 LM heads) so that `W` comes from memory as in a step (µs, `Linear` / this; 2026-12-05):
//!
//! | `W` | 1 row | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 512 |
//! | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
//! | 1536 × 576 (gate, up) | 235 / 125 | 340 / 124 | 391 / 160 | 378 / 196 | 428 / 260 | 720 / 450 | 886 / 641 | 1,399 / 1,171 | 4,752 / 5,026 |
//! | 576 × 1536 (down) | 233 / 132 | 353 / 136 | 315 / 167 | 378 / 224 | 414 / 299 | 603 / 472 | 1,010 / 745 | 1,462 / 1,298 | 5,207 / 5,156 |
//! | 576 × 576 (q, o) | 87 / 69 | 220 / 71 | 178 / 82 | 207 / 88 | 217 / 121 | 337 / 212 | 484 / 322 | 581 / 532 | 2,200 / 1,797 |
//! | 49152 × 576 (LM head) | 5,106 / 3,744 | 9,653 / 3,179 | 9,778 / 3,812 | 11,407 / 4,919 | 13,130 / 6,945 | 17,157 / 11,580 | 24,975 / 19,432 | 42,775 / 36,445 | 171,983 / 171,197 |
//!
//! (The 8 and 16 columns after the groups became even, 6b20c7e.) Up to 8 rows this is what the
//! dot products it replaces took (they read `W` once for at most 8 tokens and left more to
//! `gemm`: 137, 140, 165, 192 µs for gate at 1–8 rows, 6.2 ms for the LM head at 8); from 16 rows
//! on it is 1.3–2 times faster than `gemm`, and level with it at 512 (a long prompt's prefill).
//! Packing costs one pass over the matrix when the model loads, straight from the image's bytes
//! ([`Projection::from_f32_le`]): the LM head of 113 MB in about 38 ms on both cores.

pub(crate) mod blocks;
mod kernel;
mod packed;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::vmath::simd_available;
use crate::weights::{Encoding, Weights};
use crate::ExecError;
use blocks::{AnyBlocks, Kind};
use packed::{Half, Packed};

/// `y = x · Wᵀ (+ b)`, `W` `[out, in]` (see the module docs).
pub(crate) struct Projection {
    imp: Imp,
}

enum Imp {
    /// `W` packed, and the bias added to each output row.
    Packed(Panels, Option<Vec<f32>>),
    Linear(Linear),
}

/// `W`'s panels, of f32 weights, of the f16 a model stores, or of the GGUF blocks it keeps (of
/// one kind per matrix, behind [`AnyBlocks`]: one dynamic call per product).
enum Panels {
    F32(Packed<f32>),
    F16(Packed<Half>),
    Blocks(Box<dyn AnyBlocks>),
}

impl Panels {
    /// `(n, k)`: `W` is `[n, k]`.
    fn shape(&self) -> (usize, usize) {
        match self {
            Panels::F32(p) => (p.n, p.k),
            Panels::F16(p) => (p.n, p.k),
            Panels::Blocks(p) => p.shape(),
        }
    }

    fn product(&self, x: &[f32], rows: usize) -> Vec<f32> {
        match self {
            Panels::F32(p) => kernel::product(x, rows, p),
            Panels::F16(p) => kernel::product(x, rows, p),
            Panels::Blocks(p) => p.product(x, rows),
        }
    }

    /// Row `j` of `W` (`j < n`) onto `out`.
    fn extend_row(&self, j: usize, out: &mut Vec<f32>) {
        match self {
            Panels::F32(p) => out.extend(p.row(j)),
            Panels::F16(p) => out.extend(p.row(j)),
            Panels::Blocks(p) => p.extend_row(j, out),
        }
    }

    fn unpack(&self) -> Vec<f32> {
        match self {
            Panels::F32(p) => p.unpack(),
            Panels::F16(p) => p.unpack(),
            Panels::Blocks(p) => p.unpack(),
        }
    }

    /// The same matrix with f32 weights (itself if it has them).
    fn widen(&mut self) -> &mut Packed<f32> {
        let wide = match self {
            Panels::F32(_) => None,
            Panels::F16(h) => Some(h.widen()),
            Panels::Blocks(q) => Some(q.widen()),
        };
        if let Some(w) = wide {
            *self = Panels::F32(w);
        }
        match self {
            Panels::F32(w) => w,
            _ => unreachable!("just set"),
        }
    }
}

impl Projection {
    /// From `W`, `[out, in]`.
    pub(crate) fn new(w: Tensor) -> candle_core::Result<Projection> {
        let (n, k) = w.dims2()?;
        let imp = if simd_available() {
            Imp::Packed(Panels::F32(with_f32(&w, |w| Packed::from_values(w, n, k, |v| *v))?), None)
        } else {
            Imp::Linear(Linear::new(w.contiguous()?, None))
        };
        Ok(Projection { imp })
    }

    /// From `W`, `[n, k]`, as little-endian f32 bytes (a model image's), without a tensor copied
    /// out of them first.
    pub(crate) fn from_f32_le(bytes: &[u8], n: usize, k: usize) -> candle_core::Result<Projection> {
        let (values, rest) = bytes.as_chunks::<4>();
        if values.len() != n * k || !rest.is_empty() {
            return Err(candle_core::Error::Msg(format!("{} bytes for a {n} × {k} f32 matrix", bytes.len())));
        }
        if !simd_available() {
            return Projection::new(Tensor::from_raw_buffer(bytes, DType::F32, &[n, k], &Device::Cpu)?);
        }
        Ok(Projection {
            imp: Imp::Packed(Panels::F32(Packed::from_values(values, n, k, |b| f32::from_le_bytes(*b))), None),
        })
    }

    /// From `W`, `[n, k]`, as little-endian f16 bytes (a model stored in f16): kept in f16 where
    /// the packed kernel runs, half the bytes of f32 to hold and stream, the products of the f32
    /// values they widen to; widened to f32 (`Linear`) elsewhere.
    pub(crate) fn from_f16_le(bytes: &[u8], n: usize, k: usize) -> candle_core::Result<Projection> {
        let (values, rest) = bytes.as_chunks::<2>();
        if values.len() != n * k || !rest.is_empty() {
            return Err(candle_core::Error::Msg(format!("{} bytes for a {n} × {k} f16 matrix", bytes.len())));
        }
        if !simd_available() {
            let w = Tensor::from_raw_buffer(bytes, DType::F16, &[n, k], &Device::Cpu)?.to_dtype(DType::F32)?;
            return Projection::new(w);
        }
        let p = Packed::from_values(values, n, k, |b| Half(u16::from_le_bytes(*b)));
        Ok(Projection { imp: Imp::Packed(Panels::F16(p), None) })
    }

    /// From `W`, `[n, k]`, as GGUF rows of `kind`'s blocks (a model imported with its blocks
    /// kept): kept in those blocks where the packed kernel runs (in memory, bits a weight: Q4_0
    /// 4.5, Q4_1 5, Q8_0 8.5, and Q5_0 8.5 and Q5_1 9, whose panels hold a byte a code), the
    /// products of the f32 values they dequantize to, bit for bit; dequantized to f32 (`Linear`)
    /// elsewhere.
    pub(crate) fn from_gguf_blocks(bytes: &[u8], kind: Kind, n: usize, k: usize) -> candle_core::Result<Projection> {
        if !simd_available() {
            let w = blocks::dequantize(kind, bytes, n, k).map_err(candle_core::Error::Msg)?;
            return Projection::new(Tensor::from_vec(w, (n, k), &Device::Cpu)?);
        }
        let panels = Panels::Blocks(kind.panels(bytes, n, k).map_err(candle_core::Error::Msg)?);
        Ok(Projection { imp: Imp::Packed(panels, None) })
    }

    /// Tensor `name` of `w` (`[out, in]`): an f32 or f16 matrix, or one of GGUF blocks, packed
    /// straight from the image's bytes (one copy, not two), another dtype (bf16) widened to f32
    /// first.
    pub(crate) fn load(w: &Weights<'_>, name: &str) -> Result<Projection, ExecError> {
        Ok(match w.stored(name)? {
            (bytes, Encoding::Values(DType::F32), &[n, k]) => Projection::from_f32_le(bytes, n, k)?,
            (bytes, Encoding::Values(DType::F16), &[n, k]) => Projection::from_f16_le(bytes, n, k)?,
            (bytes, Encoding::Blocks { kind, rows, inputs }, _) => {
                Projection::from_gguf_blocks(bytes, kind, rows, inputs)?
            }
            _ => Projection::new(w.tensor(name)?)?,
        })
    }

    /// The same, plus `bias` (`[out]`) on every output.
    pub(crate) fn with_bias(self, bias: Tensor) -> candle_core::Result<Projection> {
        let imp = match self.imp {
            Imp::Linear(l) => Imp::Linear(Linear::new(l.weight().clone(), Some(bias.to_dtype(DType::F32)?))),
            Imp::Packed(p, _) => {
                let b = bias.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if b.len() != p.shape().0 {
                    return Err(candle_core::Error::Msg(format!("a bias of {} for {} outputs", b.len(), p.shape().0)));
                }
                Imp::Packed(p, Some(b))
            }
        };
        Ok(Projection { imp })
    }

    /// `W`, `[out, in]` (a copy where it is packed).
    pub(crate) fn weight(&self) -> candle_core::Result<Tensor> {
        match &self.imp {
            Imp::Linear(l) => Ok(l.weight().clone()),
            Imp::Packed(p, _) => Tensor::from_vec(p.unpack(), p.shape(), &Device::Cpu),
        }
    }

    /// `W + delta` in place of `W`.
    pub(crate) fn add(&mut self, delta: &Tensor) -> candle_core::Result<()> {
        match &mut self.imp {
            Imp::Linear(l) => *l = Linear::new((l.weight() + delta)?.contiguous()?, l.bias().cloned()),
            Imp::Packed(p, _) => {
                if delta.dims2()? != p.shape() {
                    return Err(candle_core::Error::ShapeMismatchBinaryOp {
                        lhs: p.shape().into(),
                        rhs: delta.shape().clone(),
                        op: "add",
                    });
                }
                // A sum rounded back to f16 (or to a block's codes) would not give W back when the
                // delta is taken away again (a LoRA adapter merged and unmerged): the weights are
                // widened to f32 first.
                let w = p.widen();
                with_f32(delta, |d| w.fill(d, |slot, v| *slot += v))?;
            }
        }
        Ok(())
    }

    /// Rows `ids` of `W`, `[ids' dims…, in]`: the lookup of a token embedding table that is
    /// also the LM head (tied), so that the model holds it once.
    pub(crate) fn rows(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let p = match &self.imp {
            Imp::Linear(l) => {
                let k = l.weight().dim(1)?;
                return candle_nn::Embedding::new(l.weight().clone(), k).forward(ids);
            }
            Imp::Packed(p, _) => p,
        };
        let (n, k) = p.shape();
        let mut dims = ids.dims().to_vec();
        dims.push(k);
        let ids = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        let mut out: Vec<f32> = Vec::with_capacity(ids.len() * k);
        for &j in &ids {
            let j = j as usize;
            if j >= n {
                return Err(candle_core::Error::Msg(format!("row {j} of a table of {n} rows")));
            }
            p.extend_row(j, &mut out);
        }
        Tensor::from_vec(out, dims, &Device::Cpu)
    }

    /// `x · Wᵀ (+ b)` for `x` of any rank whose last dimension is `in`.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (p, bias) = match &self.imp {
            Imp::Linear(l) => return l.forward(x),
            Imp::Packed(p, bias) => (p, bias),
        };
        let dims = x.dims();
        let (n, k) = p.shape();
        if dims.last() != Some(&k) {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x.shape().clone(),
                rhs: (n, k).into(),
                op: "projection",
            });
        }
        let rows = x.elem_count() / k.max(1);
        let mut y = with_f32(x, |x| p.product(x, rows))?;
        if let Some(b) = bias {
            for row in y.chunks_exact_mut(n) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = n;
        }
        Tensor::from_vec(y, out, &Device::Cpu)?.to_dtype(x.dtype())
    }
}

/// `f` on `t`'s values as f32, row-major: borrowed where `t` holds them so, else copied.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let t = t.to_dtype(DType::F32)?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(all)), Some((start, end))) =
        (&*storage, layout.contiguous_offsets())
    {
        return Ok(f(&all[start..end]));
    }
    drop(storage);
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    fn rows_of(t: &Tensor) -> Vec<Vec<u32>> {
        let d = *t.dims().last().unwrap();
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .chunks(d)
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// The same products as `Linear` over `W` (up to f32 summation order) for one token to more
    /// than a hundred, inputs within one [`KC`](kernel::KC) block and across several, outputs that
    /// do and do not fill their last [`PANEL`](kernel::PANEL), one thread or several.
    #[test]
    fn products_equal_linears_at_every_shape() {
        let dev = Device::Cpu;
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for (out, inp) in [(48, 40), (7, 16), (130, 577), (64, 1536), (1, 3)] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
            let lin = Linear::new(w.clone(), None);
            let p = Projection::new(w.clone()).unwrap();
            for rows in (1..=14).chain([31, 203]) {
                let x = Tensor::randn(0f32, 1.0, (1, rows, inp), &dev).unwrap();
                let want = lin.forward(&x).unwrap();
                for got in [p.forward(&x).unwrap(), one.install(|| p.forward(&x)).unwrap()] {
                    assert_eq!(got.dims(), want.dims());
                    let err = max_diff(&got, &want);
                    assert!(err < 1e-3, "{out}x{inp}, {rows} rows: off by {err}");
                }
            }
        }
    }

    /// A token's outputs are the same bits whether it is computed alone or at any place in a
    /// batch of any size, on one thread or several: a sequence's logits do not depend on what it
    /// decodes with.
    #[test]
    fn a_tokens_outputs_do_not_depend_on_its_batch() {
        let dev = Device::Cpu;
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (out, inp) = (100, 600);
        let p = Projection::new(Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap()).unwrap();
        let rows = 203;
        let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev).unwrap();
        let batched = rows_of(&p.forward(&x).unwrap());
        assert_eq!(rows_of(&one.install(|| p.forward(&x)).unwrap()), batched);
        assert_eq!(rows_of(&three.install(|| p.forward(&x)).unwrap()), batched);
        for i in [0, 1, 5, 6, 7, 100, 101, rows - 1] {
            let alone = rows_of(&p.forward(&x.narrow(0, i, 1).unwrap()).unwrap());
            assert_eq!(alone[0], batched[i], "token {i}");
            let few = rows_of(&p.forward(&x.narrow(0, i.saturating_sub(2), 3).unwrap()).unwrap());
            assert_eq!(few[i - i.saturating_sub(2)], batched[i], "token {i} among three");
        }
    }

    /// `weight` gives back `W` exactly, and `add` equals adding to `W`, in place.
    #[test]
    fn the_weight_is_kept_exactly_and_add_adds_to_it() {
        let dev = Device::Cpu;
        for (out, inp) in [(48, 40), (17, 5)] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
            let d = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
            let mut p = Projection::new(w.clone()).unwrap();
            assert_eq!(max_diff(&p.weight().unwrap(), &w), 0.0);
            p.add(&d).unwrap();
            assert_eq!(max_diff(&p.weight().unwrap(), &(&w + &d).unwrap()), 0.0);
            let x = Tensor::randn(0f32, 1.0, (3, inp), &dev).unwrap();
            let want = Linear::new((&w + &d).unwrap(), None).forward(&x).unwrap();
            assert!(max_diff(&p.forward(&x).unwrap(), &want) < 1e-3);
            assert!(p.add(&Tensor::zeros((out, inp + 1), DType::F32, &dev).unwrap()).is_err());
        }
    }

    /// A matrix packed from an image's little-endian bytes is the matrix; a wrong length is
    /// refused.
    #[test]
    fn a_matrix_from_its_bytes_is_the_matrix() {
        let w = Tensor::randn(0f32, 1.0, (19, 33), &Device::Cpu).unwrap();
        let bytes: Vec<u8> =
            w.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
        let p = Projection::from_f32_le(&bytes, 19, 33).unwrap();
        assert_eq!(max_diff(&p.weight().unwrap(), &w), 0.0);
        assert!(Projection::from_f32_le(&bytes[1..], 19, 33).is_err());
        assert!(Projection::from_f32_le(&bytes, 19, 32).is_err());
    }

    /// A matrix from f16 bytes gives, bit for bit, what the f32 matrix its values widen to gives:
    /// products of 1 to 203 tokens with and without a bias, its weight, its rows; it is held
    /// in f16 where the packed kernel runs; adding to it (and taking it away) does what it does to
    /// the widened values;
    /// a wrong length is refused.
    #[test]
    fn a_matrix_from_f16_bytes_computes_as_its_widened_values() {
        let dev = Device::Cpu;
        let (out, inp) = (37, 600);
        let w16 = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap().to_dtype(DType::F16).unwrap();
        let wide = w16.to_dtype(DType::F32).unwrap();
        let bytes: Vec<u8> =
            w16.flatten_all().unwrap().to_vec1::<half::f16>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
        let half_p = Projection::from_f16_le(&bytes, out, inp).unwrap();
        let full_p = Projection::new(wide.clone()).unwrap();
        if simd_available() {
            assert!(matches!(half_p.imp, Imp::Packed(Panels::F16(_), _)));
        }
        assert_eq!(max_diff(&half_p.weight().unwrap(), &wide), 0.0);
        for rows in [1, 2, 6, 7, 13, 203] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev).unwrap();
            assert_eq!(rows_of(&half_p.forward(&x).unwrap()), rows_of(&full_p.forward(&x).unwrap()), "{rows} rows");
        }
        let bias = Tensor::randn(0f32, 1.0, out, &dev).unwrap();
        let (hb, fb) = (
            Projection::from_f16_le(&bytes, out, inp).unwrap().with_bias(bias.clone()).unwrap(),
            Projection::new(wide.clone()).unwrap().with_bias(bias).unwrap(),
        );
        let x = Tensor::randn(0f32, 1.0, (9, inp), &dev).unwrap();
        assert_eq!(rows_of(&hb.forward(&x).unwrap()), rows_of(&fb.forward(&x).unwrap()));
        let ids = Tensor::new(&[0u32, 36, 5], &dev).unwrap();
        assert_eq!(max_diff(&half_p.rows(&ids).unwrap(), &full_p.rows(&ids).unwrap()), 0.0);
        let d = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
        let (mut h, mut f) = (half_p, full_p);
        h.add(&d).unwrap();
        f.add(&d).unwrap();
        assert_eq!(max_diff(&h.weight().unwrap(), &f.weight().unwrap()), 0.0);
        h.add(&d.neg().unwrap()).unwrap();
        f.add(&d.neg().unwrap()).unwrap();
        assert_eq!(max_diff(&h.weight().unwrap(), &f.weight().unwrap()), 0.0, "merged and unmerged");
        assert!(max_diff(&h.weight().unwrap(), &wide) < 1e-6, "W is back, up to f32 rounding");
        assert!(Projection::from_f16_le(&bytes[1..], out, inp).is_err());
        assert!(Projection::from_f16_le(&bytes, out, inp - 1).is_err());
    }

    /// A model file's f16 matrix loads into f16 panels and its f32 one into f32 panels (where the
    /// packed kernel runs), each computing what its values give.
    #[test]
    fn a_matrix_loads_in_the_precision_it_is_stored_in() {
        use safetensors::tensor::TensorView;
        let (n, k) = (20, 12);
        let values: Vec<f32> = (0..n * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
        let h: Vec<u8> = values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let f: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let views = [
            ("h", TensorView::new(safetensors::Dtype::F16, vec![n, k], &h).unwrap()),
            ("f", TensorView::new(safetensors::Dtype::F32, vec![n, k], &f).unwrap()),
        ];
        let bytes = safetensors::serialize(views, None).unwrap();
        let manifest = cascade_param_pool::manifest::Manifest::from_bytes(&bytes, "t", 1 << 20, "memory").unwrap();
        let w = Weights::file(&manifest, &bytes).unwrap();
        let (ph, pf) = (Projection::load(&w, "h").unwrap(), Projection::load(&w, "f").unwrap());
        if simd_available() {
            assert!(matches!(ph.imp, Imp::Packed(Panels::F16(_), _)));
            assert!(matches!(pf.imp, Imp::Packed(Panels::F32(_), _)));
        }
        // These values are exact in f16: both give the same products.
        let x = Tensor::randn(0f32, 1.0, (3, k), &Device::Cpu).unwrap();
        assert_eq!(rows_of(&ph.forward(&x).unwrap()), rows_of(&pf.forward(&x).unwrap()));
    }

    /// A matrix of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) gives, bit for bit, what the f32 matrix it
    /// dequantizes to gives: products of 1 to 203 tokens on one thread and several, with and
    /// without a bias, its weight, its rows; it is held in blocks where the packed kernel runs;
    /// adding to it (and taking it away) does what it does to the f32 values; a matrix loads from
    /// a model file's U8 `[rows, blocks, bytes]` tensor, and a U8 tensor of another shape is
    /// refused.
    #[test]
    fn a_matrix_of_gguf_blocks_computes_as_its_dequantized_values() {
        let dev = Device::Cpu;
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (out, inp) = (37, 608);
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
        for (dtype, kind) in blocks::tests::KINDS {
            let (gguf, values) = blocks::tests::gguf_of(&w, dtype);
            let wide = Tensor::from_vec(values, (out, inp), &dev).unwrap();
            let q = Projection::from_gguf_blocks(&gguf, kind, out, inp).unwrap();
            let f = Projection::new(wide.clone()).unwrap();
            if simd_available() {
                assert!(matches!(q.imp, Imp::Packed(Panels::Blocks(_), _)));
            }
            assert_eq!(max_diff(&q.weight().unwrap(), &wide), 0.0);
            for rows in (1..=14).chain([31, 203]) {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev).unwrap();
                let want = rows_of(&f.forward(&x).unwrap());
                assert_eq!(rows_of(&q.forward(&x).unwrap()), want, "{kind:?}, {rows} rows");
                assert_eq!(rows_of(&one.install(|| q.forward(&x)).unwrap()), want, "{kind:?}, {rows} rows, one thread");
            }
            let bias = Tensor::randn(0f32, 1.0, out, &dev).unwrap();
            let qb = Projection::from_gguf_blocks(&gguf, kind, out, inp).unwrap().with_bias(bias.clone()).unwrap();
            let fb = Projection::new(wide.clone()).unwrap().with_bias(bias).unwrap();
            let x = Tensor::randn(0f32, 1.0, (9, inp), &dev).unwrap();
            assert_eq!(rows_of(&qb.forward(&x).unwrap()), rows_of(&fb.forward(&x).unwrap()));
            let ids = Tensor::new(&[0u32, 36, 5, 16], &dev).unwrap();
            assert_eq!(max_diff(&q.rows(&ids).unwrap(), &f.rows(&ids).unwrap()), 0.0);
            let d = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
            let mut q = q;
            q.add(&d).unwrap();
            assert_eq!(max_diff(&q.weight().unwrap(), &(&wide + &d).unwrap()), 0.0);
            q.add(&d.neg().unwrap()).unwrap();
            assert!(max_diff(&q.weight().unwrap(), &wide) < 1e-5, "W is back, up to f32 rounding");
            assert!(Projection::from_gguf_blocks(&gguf[1..], kind, out, inp).is_err());
            assert!(Projection::from_gguf_blocks(&gguf, kind, out, inp - 32).is_err());

            use safetensors::tensor::TensorView;
            let per_block = gguf.len() / (out * inp / 32);
            let views = [
                ("q", TensorView::new(safetensors::Dtype::U8, vec![out, inp / 32, per_block], &gguf).unwrap()),
                ("bad", TensorView::new(safetensors::Dtype::U8, vec![out, gguf.len() / out], &gguf).unwrap()),
            ];
            let bytes = safetensors::serialize(views, None).unwrap();
            let manifest = cascade_param_pool::manifest::Manifest::from_bytes(&bytes, "t", 1 << 20, "memory").unwrap();
            let weights = Weights::file(&manifest, &bytes).unwrap();
            let loaded = Projection::load(&weights, "q").unwrap();
            assert_eq!(rows_of(&loaded.forward(&x).unwrap()), rows_of(&f.forward(&x).unwrap()));
            assert_eq!(max_diff(&weights.tensor("q").unwrap(), &wide), 0.0);
            let e = Projection::load(&weights, "bad").err().unwrap().to_string();
            assert!(e.contains("GGUF") && e.contains("\"bad\""), "{e}");
        }
    }

    /// `rows` looks up `W`'s rows as an embedding table over `W` does, for ids of any shape, and
    /// refuses an id past the table.
    #[test]
    fn rows_are_an_embedding_lookup() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (37, 20), &dev).unwrap();
        let p = Projection::new(w.clone()).unwrap();
        let table = candle_nn::Embedding::new(w, 20);
        let ids = Tensor::new(&[[0u32, 36, 15], [16, 17, 0]], &dev).unwrap();
        let (got, want) = (p.rows(&ids).unwrap(), table.forward(&ids).unwrap());
        assert_eq!(got.dims(), &[2, 3, 20]);
        assert_eq!(max_diff(&got, &want), 0.0);
        assert!(p.rows(&Tensor::new(&[37u32], &dev).unwrap()).is_err());
    }

    /// On a CPU with AVX2 and FMA the packed path is the one taken (its sums differ from
    /// `gemm`'s in the last bits), so the tests above compare the two paths, not one with itself.
    #[test]
    fn the_packed_path_is_taken_where_the_cpu_has_it() {
        let p = Projection::new(Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap()).unwrap();
        if !simd_available() {
            assert!(matches!(p.imp, Imp::Linear(_)));
            eprintln!("skipped: this CPU lacks AVX2 or FMA, so every product goes through Linear");
            return;
        }
        assert!(matches!(p.imp, Imp::Packed(..)));
    }
}
