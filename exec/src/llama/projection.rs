//! A bias-free projection `y = x · Wᵀ` whose product for a few tokens reads `W` once.
//!
//! A decode step multiplies one token per running sequence by every weight matrix: a product of
//! a few rows by a large `W`, bound by reading `W` from memory. For one row `gemm` (through
//! `candle_nn::Linear`) streams `W` at about 25 GB/s here, but for 2 to 8 rows it repacks the
//! strided `Wᵀ` first and reaches 9–13 GB/s, so a decode step of two sequences took 2.4 times one
//! of a single sequence (2026-12-05). For at most [`SKINNY_ROWS`] rows this module computes each
//! output as dot products of `W`'s row, read once, with every token's row (AVX2 and FMA, the
//! rows of `W` split over rayon's threads); more rows, or a CPU without AVX2 and FMA, go through
//! `Linear` as before. One call on the 2 vCPUs here, release, distinct matrices in turn (60 of
//! each MLP shape, 30 of q/o, 3 LM heads) so that `W` comes from memory as in a step (µs,
//! `Linear` / this; 2026-12-05):
//!
//! | `W` | 1 row | 2 | 4 | 8 |
//! | --- | --- | --- | --- | --- |
//! | 1536 × 576 (gate, up) | 155 / 128 | 291 / 113 | 294 / 145 | 367 / 223 |
//! | 576 × 1536 (down) | 144 / 121 | 378 / 116 | 256 / 238 | 370 / 355 |
//! | 576 × 576 (q, o) | 53 / 78 | 194 / 49 | 124 / 53 | 144 / 70 |
//! | 49152 × 576 (LM head) | 4,480 / 3,459 | 10,145 / 3,406 | 10,072 / 4,190 | 12,162 / 6,692 |
//!
//! The sums run in another order than `gemm`'s, so a token's logits may differ from the
//! `Linear` path's in the last bits (1e-4 at most in these products).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
use rayon::prelude::*;

/// Rows (tokens) up to which a product takes the path that reads `W` once.
pub(crate) const SKINNY_ROWS: usize = 8;

/// `y = x · Wᵀ`, `W` `[out, in]` (see the module docs).
pub(crate) struct Projection {
    lin: Linear,
}

impl Projection {
    /// From `W`, `[out, in]`.
    pub(crate) fn new(w: Tensor) -> candle_core::Result<Projection> {
        w.dims2()?;
        Ok(Projection { lin: Linear::new(w.contiguous()?, None) })
    }

    /// `W`, `[out, in]`.
    pub(crate) fn weight(&self) -> &Tensor {
        self.lin.weight()
    }

    /// `W + delta` in place of `W`.
    pub(crate) fn add(&mut self, delta: &Tensor) -> candle_core::Result<()> {
        *self = Projection::new((self.lin.weight() + delta)?)?;
        Ok(())
    }

    /// `x · Wᵀ` for `x` of any rank whose last dimension is `in`.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.few_rows(x)? {
            Some(y) => Ok(y),
            None => self.lin.forward(x),
        }
    }

    /// `x · Wᵀ` by [`product`] when `x` has at most [`SKINNY_ROWS`] rows of f32, `W` lies
    /// contiguous in f32 on the CPU, and the CPU has the instructions; `None` otherwise.
    fn few_rows(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let w = self.lin.weight();
        let (outputs, inputs) = w.dims2()?;
        let rows = x.elem_count() / inputs.max(1);
        if rows == 0 || rows > SKINNY_ROWS || x.dtype() != DType::F32 || !fast_dots() {
            return Ok(None);
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let (storage, layout) = w.storage_and_layout();
        let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(all)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        else {
            return Ok(None);
        };
        let y = product(&xs, rows, &all[start..end], outputs, inputs);
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = outputs;
        }
        Tensor::from_vec(y, dims, &Device::Cpu).map(Some)
    }
}

/// Whether this CPU has the instructions [`dots`] is compiled for.
fn fast_dots() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` `[rows, k]` times `w` `[n, k]` transposed: `[rows, n]`. Only called when [`fast_dots`].
fn product(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    // Output row j of W first ([n, rows]): each W row's results are contiguous, so the blocks of
    // W rows the threads take write disjoint slices.
    let mut by_w_row = vec![0f32; n * rows];
    let threads = rayon::current_num_threads();
    let block = n.div_ceil(threads * 4).max(16);
    let run = |(out, w): (&mut [f32], &[f32])| {
        for (o, wj) in out.chunks_exact_mut(rows).zip(w.chunks_exact(k)) {
            let mut i = 0;
            while i < rows {
                let r = (rows - i).min(4);
                // SAFETY: `product` runs only where `fast_dots` found AVX2 and FMA, the features
                // `dots` is compiled for.
                unsafe { dots(&x[i * k..(i + r) * k], r, wj, &mut o[i..i + r]) };
                i += r;
            }
        }
    };
    if threads > 1 {
        by_w_row.par_chunks_mut(block * rows).zip(w.par_chunks(block * k)).for_each(run);
    } else {
        by_w_row.chunks_mut(block * rows).zip(w.chunks(block * k)).for_each(run);
    }
    let mut y = vec![0f32; rows * n];
    for (j, o) in by_w_row.chunks_exact(rows).enumerate() {
        for (i, v) in o.iter().enumerate() {
            y[i * n + j] = *v;
        }
    }
    y
}

/// `out[r] = x[r] · w` for the `r ≤ 4` rows of `x` (each `w.len()` long), reading `w` once.
/// Callable (unsafely) only where the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dots(x: &[f32], r: usize, w: &[f32], out: &mut [f32]) {
    match r {
        1 => dots_n::<1>(x, w, out),
        2 => dots_n::<2>(x, w, out),
        3 => dots_n::<3>(x, w, out),
        _ => dots_n::<4>(x, w, out),
    }
}

/// Never called: [`fast_dots`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dots(_: &[f32], _: usize, _: &[f32], _: &mut [f32]) {
    unreachable!("fast_dots is false off x86_64")
}

/// [`dots`] for `R` rows: two 8-lane accumulators per row, each 16 values of `w` loaded once
/// for all the rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn dots_n<const R: usize>(x: &[f32], w: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let k = w.len();
    assert!(x.len() >= R * k && out.len() >= R, "dots: {} values for {R} rows of {k}", x.len());
    let chunks = k / 16;
    let mut lo: [__m256; R] = [_mm256_setzero_ps(); R];
    let mut hi: [__m256; R] = [_mm256_setzero_ps(); R];
    for c in 0..chunks {
        let at = c * 16;
        // SAFETY: at + 16 <= chunks · 16 <= k = w.len(); unaligned loads take any address.
        let (w0, w1) = unsafe { (_mm256_loadu_ps(w.as_ptr().add(at)), _mm256_loadu_ps(w.as_ptr().add(at + 8))) };
        for r in 0..R {
            // SAFETY: row r's values at..at + 16 lie in x, which holds R rows of k (asserted
            // above), and at + 16 <= k.
            let (x0, x1) = unsafe {
                let xr = x.as_ptr().add(r * k + at);
                (_mm256_loadu_ps(xr), _mm256_loadu_ps(xr.add(8)))
            };
            lo[r] = _mm256_fmadd_ps(x0, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(x1, w1, hi[r]);
        }
    }
    for r in 0..R {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds the 8 floats stored.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(lo[r], hi[r])) };
        let tail = chunks * 16..k;
        out[r] = x[r * k + tail.start..(r + 1) * k]
            .iter()
            .zip(&w[tail])
            .fold(lanes.iter().sum(), |s, (a, b)| a.mul_add(*b, s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same products as `Linear` over `W` (up to f32 summation order) for every number of
    /// rows either side of [`SKINNY_ROWS`], widths that are and are not multiples of 16, one
    /// thread or several; `add` equals adding to `W`.
    #[test]
    fn products_equal_linears_at_every_row_count_and_width() {
        let dev = Device::Cpu;
        for (out, inp) in [(48, 40), (7, 16), (130, 577), (64, 1536)] {
            let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
            let lin = Linear::new(w.clone(), None);
            let p = Projection::new(w.clone()).unwrap();
            for rows in 1..=SKINNY_ROWS + 2 {
                let x = Tensor::randn(0f32, 1.0, (1, rows, inp), &dev).unwrap();
                let want = lin.forward(&x).unwrap();
                let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                for got in [p.forward(&x).unwrap(), one.install(|| p.forward(&x)).unwrap()] {
                    assert_eq!(got.dims(), want.dims());
                    let err = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert!(err < 1e-3, "{out}x{inp}, {rows} rows: off by {err}");
                }
            }
        }
        let w = Tensor::randn(0f32, 1.0, (48, 40), &dev).unwrap();
        let d = Tensor::randn(0f32, 1.0, (48, 40), &dev).unwrap();
        let mut p = Projection::new(w.clone()).unwrap();
        p.add(&d).unwrap();
        let err =
            (p.weight() - (w + d).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(err, 0.0);
    }

    /// On a CPU with AVX2 and FMA the few-row path is the one taken (its sums differ from
    /// `gemm`'s in the last bits), so the test above compares the two paths, not one with itself.
    #[test]
    fn the_few_row_path_is_taken_where_the_cpu_has_it() {
        if !fast_dots() {
            eprintln!("skipped: this CPU lacks AVX2 or FMA, so every product goes through Linear");
            return;
        }
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (256, 576), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1, 2, 576), &dev).unwrap();
        let y =
            Projection::new(w.clone()).unwrap().forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ws = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y, product(&xs, 2, &ws, 256, 576));
    }
}
