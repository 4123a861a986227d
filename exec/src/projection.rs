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
//! On x86_64 with AVX2 and FMA, this module packs `W` once, when the model loads, into panels of
//! [`PANEL`] outputs (`[panel][input][PANEL]`, the last panel padded with zeros) and keeps only
//! that copy. A product runs the kernel `gemm` would run on its own packing: for a group of up
//! to [`GROUP`] tokens and one panel, two 8-lane accumulators per token, each input's 16 weights
//! loaded once for the group and each token's input broadcast once for the panel ([`kernel`]).
//! A thread passes every group over [`CACHED_W_BYTES`] of its panels at a time, which stay in L2,
//! so `W` comes from memory once; with more than one group, the inputs go in blocks of [`KC`],
//! so that a group's stay in L1. The panels are split over rayon's threads. On another CPU,
//! `Linear` computes as before. A tied LM head and the token embedding table it doubles as are
//! one packed matrix ([`Projection::rows`] looks tokens up in it).
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

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
use rayon::prelude::*;

use crate::vmath::simd_available;
use crate::weights::Weights;
use crate::ExecError;

/// Outputs per panel: two 8-lane registers.
const PANEL: usize = 16;
/// Inputs per pass where there are several groups: a group's inputs (18 KB) stay in L1 while
/// the panels pass.
const KC: usize = 768;
/// Bytes of panels a thread passes over with each group of tokens: they stay in L2 (1 MB per
/// core here), so `W` comes from memory once.
const CACHED_W_BYTES: usize = 256 << 10;
/// Tokens one kernel call computes: 12 accumulators, two weight registers and a broadcast.
const GROUP: usize = 6;

/// `y = x · Wᵀ (+ b)`, `W` `[out, in]` (see the module docs).
pub(crate) struct Projection {
    imp: Imp,
}

enum Imp {
    /// `W` packed, and the bias added to each output row.
    Packed(Packed, Option<Vec<f32>>),
    Linear(Linear),
}

/// `W` `[n, k]` in panels: `data[(j / PANEL) · k · PANEL + i · PANEL + j % PANEL] = W[j][i]`.
struct Packed {
    data: Vec<f32>,
    n: usize,
    k: usize,
}

impl Projection {
    /// From `W`, `[out, in]`.
    pub(crate) fn new(w: Tensor) -> candle_core::Result<Projection> {
        let (n, k) = w.dims2()?;
        let imp = if simd_available() {
            Imp::Packed(with_f32(&w, |w| Packed::from_le(native_bytes(w), n, k))?, None)
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
        Ok(Projection { imp: Imp::Packed(Packed::from_le(values, n, k), None) })
    }

    /// Tensor `name` of `w` (`[out, in]`): an f32 matrix packed straight from the image's bytes
    /// (one copy, not two), another dtype widened first.
    pub(crate) fn load(w: &Weights<'_>, name: &str) -> Result<Projection, ExecError> {
        Ok(match w.f32_bytes(name)? {
            Some((bytes, &[n, k])) => Projection::from_f32_le(bytes, n, k)?,
            _ => Projection::new(w.tensor(name)?)?,
        })
    }

    /// The same, plus `bias` (`[out]`) on every output.
    pub(crate) fn with_bias(self, bias: Tensor) -> candle_core::Result<Projection> {
        let imp = match self.imp {
            Imp::Linear(l) => Imp::Linear(Linear::new(l.weight().clone(), Some(bias.to_dtype(DType::F32)?))),
            Imp::Packed(p, _) => {
                let b = bias.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if b.len() != p.n {
                    return Err(candle_core::Error::Msg(format!("a bias of {} for {} outputs", b.len(), p.n)));
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
            Imp::Packed(p, _) => Tensor::from_vec(p.unpack(), (p.n, p.k), &Device::Cpu),
        }
    }

    /// `W + delta` in place of `W`.
    pub(crate) fn add(&mut self, delta: &Tensor) -> candle_core::Result<()> {
        match &mut self.imp {
            Imp::Linear(l) => *l = Linear::new((l.weight() + delta)?.contiguous()?, l.bias().cloned()),
            Imp::Packed(p, _) => {
                let (n, k) = delta.dims2()?;
                if (n, k) != (p.n, p.k) {
                    return Err(candle_core::Error::ShapeMismatchBinaryOp {
                        lhs: (p.n, p.k).into(),
                        rhs: delta.shape().clone(),
                        op: "add",
                    });
                }
                with_f32(delta, |d| p.fill(d, |slot, v| *slot += v))?;
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
        let k = p.k;
        let mut dims = ids.dims().to_vec();
        dims.push(k);
        let ids = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        let mut out: Vec<f32> = Vec::with_capacity(ids.len() * k);
        for &j in &ids {
            let j = j as usize;
            if j >= p.n {
                return Err(candle_core::Error::Msg(format!("row {j} of a table of {} rows", p.n)));
            }
            out.extend(p.row(j));
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
        if dims.last() != Some(&p.k) {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x.shape().clone(),
                rhs: (p.n, p.k).into(),
                op: "projection",
            });
        }
        let rows = x.elem_count() / p.k.max(1);
        let mut y = with_f32(x, |x| product(x, rows, p))?;
        if let Some(b) = bias {
            for row in y.chunks_exact_mut(p.n) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = p.n;
        }
        Tensor::from_vec(y, out, &Device::Cpu)?.to_dtype(x.dtype())
    }
}

impl Packed {
    /// `d`, `[n, k]` little-endian f32, row-major, packed.
    fn from_le(d: &[[u8; 4]], n: usize, k: usize) -> Packed {
        let mut p = Packed { data: vec![0f32; n.div_ceil(PANEL) * k * PANEL], n, k };
        p.fill(d, |slot, v| *slot = f32::from_le_bytes(*v));
        p
    }

    /// `f(slot, d[j][i])` for the packed `W[j][i]`'s slot of every `j` and `i`; `d` is `[n, k]`,
    /// row-major. The panels are split over rayon's threads.
    fn fill<T: Sync>(&mut self, d: &[T], f: impl Fn(&mut f32, &T) + Sync) {
        let (n, k) = (self.n, self.k);
        if k == 0 {
            return;
        }
        self.data.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
            let rows: Vec<&[T]> = d[p * PANEL * k..n.min((p + 1) * PANEL) * k].chunks_exact(k).collect();
            // 64 inputs at a time: their 4 KB of the panel stay in L1 while the rows fill them.
            for (b, block) in panel.chunks_mut(64 * PANEL).enumerate() {
                let inputs = b * 64..b * 64 + block.len() / PANEL;
                for (c, row) in rows.iter().enumerate() {
                    for (slot, v) in block[c..].iter_mut().step_by(PANEL).zip(&row[inputs.clone()]) {
                        f(slot, v);
                    }
                }
            }
        });
    }

    /// Row `j` of `W` (`j < n`), read from its panel.
    fn row(&self, j: usize) -> impl Iterator<Item = f32> + '_ {
        let k = self.k;
        self.data[(j / PANEL) * k * PANEL..][..k * PANEL].iter().skip(j % PANEL).step_by(PANEL).copied()
    }

    /// `W`, row-major.
    fn unpack(&self) -> Vec<f32> {
        (0..self.n).flat_map(|j| self.row(j)).collect()
    }
}

/// `v`'s values as their bytes in memory: little-endian f32 where this module packs (x86_64).
fn native_bytes(v: &[f32]) -> &[[u8; 4]] {
    // SAFETY: `[u8; 4]` has f32's size, alignment 1 and no invalid values; the slice covers the
    // same memory, borrowed for the same lifetime.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<[u8; 4]>(), v.len()) }
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

/// `x` `[rows, k]` times `W`ᵀ: `[rows, n]`. Only called when [`simd_available`].
fn product(x: &[f32], rows: usize, w: &Packed) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    let panels = n.div_ceil(PANEL);
    let width = panels * PANEL;
    let mut y = vec![0f32; rows * width];
    if rows == 0 || k == 0 {
        y.truncate(rows * n);
        return y;
    }
    assert!(x.len() >= rows * k, "product: {} values for {rows} rows of {k}", x.len());
    let out = Columns { ptr: y.as_mut_ptr(), width };
    let threads = rayon::current_num_threads();
    let block = panels.div_ceil(threads * 4).max(1);
    // One group's inputs fit L1 whole; more pass in blocks of KC, so that each panel streams
    // from memory in one pass when there is one group (decoding).
    let kc_max = if rows <= GROUP { k } else { KC };
    // Groups as even as they can be (8 tokens: 4 and 4, not 6 and 2): a group of few tokens has
    // too few accumulators to hide the FMA's latency.
    let count = rows.div_ceil(GROUP);
    let groups: Vec<(usize, usize)> =
        (0..count).map(|i| (i * rows / count, (i + 1) * rows / count - i * rows / count)).collect();
    // Panels first..last, their sums into y's columns 16·first..16·last.
    let run = |first: usize| {
        let last = panels.min(first + block);
        for k0 in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - k0);
            let cached = (CACHED_W_BYTES / (kc * PANEL * 4)).max(1);
            for p0 in (first..last).step_by(cached) {
                let mine = p0..last.min(p0 + cached);
                for &(g0, g) in &groups {
                    let xs = &x[g0 * k + k0..(g0 + g - 1) * k + k0 + kc];
                    for p in mine.clone() {
                        let slice = &w.data[p * k * PANEL + k0 * PANEL..][..kc * PANEL];
                        // SAFETY: `product` runs only where `simd_available` found AVX2 and FMA, the
                        // features `kernel` is compiled for. The sums are rows g0..g0 + g <= rows
                        // of y, columns 16·p..16·p + 16 <= width: inside y, which outlives the
                        // loop; panel p is this task's alone (the tasks' panel ranges are
                        // disjoint) and nothing else touches y until every task has ended.
                        unsafe {
                            kernel(
                                g,
                                &Operands {
                                    x: xs,
                                    stride: k,
                                    slice,
                                    kc,
                                    acc: out.at(g0, p * PANEL),
                                    acc_stride: width,
                                    first: k0 == 0,
                                },
                            )
                        };
                    }
                }
            }
        }
    };
    if threads > 1 {
        (0..panels).into_par_iter().step_by(block).for_each(run);
    } else {
        (0..panels).step_by(block).for_each(run);
    }
    if width != n {
        for r in 0..rows {
            y.copy_within(r * width..r * width + n, r * n);
        }
        y.truncate(rows * n);
    }
    y
}

/// `y` as the tasks of [`product`] write it: each its own panels' columns of every row.
struct Columns {
    ptr: *mut f32,
    width: usize,
}

impl Columns {
    /// Where row `row`'s column `col` lies (valid to write only as `product` says).
    fn at(&self, row: usize, col: usize) -> *mut f32 {
        self.ptr.wrapping_add(row * self.width + col)
    }
}

// SAFETY: the tasks sharing a `Columns` write disjoint columns of `y` (see `product`).
unsafe impl Sync for Columns {}

/// One call of [`kernel`]: a group of tokens and a panel's slice of inputs.
struct Operands<'a> {
    /// The group's inputs: token t's `kc` lie at `x[t · stride..]`.
    x: &'a [f32],
    stride: usize,
    /// The panel's weights for those inputs, `[kc][PANEL]`.
    slice: &'a [f32],
    kc: usize,
    /// Token t's `PANEL` sums lie at `acc + t · acc_stride`.
    acc: *mut f32,
    acc_stride: usize,
    /// Whether the sums start here (overwritten) or go on (added to).
    first: bool,
}

/// `acc[t] (+)= x[t] · slice` for the `g ≤ GROUP` tokens of `o`.
///
/// # Safety
/// The CPU has AVX2 and FMA, and `o.acc + t · o.acc_stride .. + PANEL` is valid for reads and
/// writes and not otherwise accessed during the call for every `t < g`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel(g: usize, o: &Operands<'_>) {
    // SAFETY: the caller's contract, passed on (every arm).
    unsafe {
        match g {
            1 => kernel_n::<1>(o),
            2 => kernel_n::<2>(o),
            3 => kernel_n::<3>(o),
            4 => kernel_n::<4>(o),
            5 => kernel_n::<5>(o),
            _ => kernel_n::<6>(o),
        }
    }
}

/// Never called: [`simd_available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: usize, _: &Operands<'_>) {
    unreachable!("simd_available is false off x86_64")
}

/// [`kernel`] for `G` tokens (the same safety contract).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn kernel_n<const G: usize>(o: &Operands<'_>) {
    let &Operands { x, stride, slice, kc, acc, acc_stride, first } = o;
    use std::arch::x86_64::{
        __m256, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    assert!(
        kc > 0 && x.len() > (G - 1) * stride + kc - 1 && slice.len() >= kc * PANEL,
        "kernel: {G} tokens of {kc} inputs (stride {stride}) in {}, a slice of {}",
        x.len(),
        slice.len(),
    );
    let mut sums: [[__m256; 2]; G] = [[_mm256_setzero_ps(); 2]; G];
    if !first {
        for (t, s) in sums.iter_mut().enumerate() {
            // SAFETY: the caller's contract: token t's PANEL sums at acc + t · acc_stride.
            *s = unsafe {
                let at = acc.add(t * acc_stride);
                [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
            };
        }
    }
    for i in 0..kc {
        // SAFETY: i < kc and the slice holds kc · PANEL floats (asserted above).
        let (w0, w1) = unsafe {
            (_mm256_loadu_ps(slice.as_ptr().add(i * PANEL)), _mm256_loadu_ps(slice.as_ptr().add(i * PANEL + 8)))
        };
        for (t, s) in sums.iter_mut().enumerate() {
            // SAFETY: t · stride + i <= (G − 1) · stride + kc − 1 < x.len() (asserted above).
            let xb = unsafe { _mm256_broadcast_ss(&*x.as_ptr().add(t * stride + i)) };
            s[0] = _mm256_fmadd_ps(xb, w0, s[0]);
            s[1] = _mm256_fmadd_ps(xb, w1, s[1]);
        }
    }
    for (t, s) in sums.iter().enumerate() {
        // SAFETY: the caller's contract, as above.
        unsafe {
            let at = acc.add(t * acc_stride);
            _mm256_storeu_ps(at, s[0]);
            _mm256_storeu_ps(at.add(8), s[1]);
        }
    }
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
    /// than a hundred, inputs within one [`KC`] block and across several, outputs that
    /// do and do not fill their last [`PANEL`], one thread or several.
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
