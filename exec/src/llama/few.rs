//! Attention for a few query rows — decode steps — read straight from the KV cache.
//!
//! A decode step multiplies one query row per head by all the sequence's cached keys, then its
//! probabilities by all the cached values. Through `matmul` each product packs (copies) the
//! strided keys or values of every head first: at 4,000 cached tokens a step of SmolLM2 packed
//! 180 MB, and attention took 56% of a step of 143 ms (`perf`, 2026-12-06). Here each key/value
//! head's cache is read once, in place, for all the query rows of its heads: every key's dot
//! products with those rows, the rows' softmax over the keys each may see (the same vectorised
//! softmax as the longer path's), and the values weighted by it, in eight-lane sums (AVX2/FMA).
//! The sums run in another order than `gemm`'s, so the result differs from the longer path's in
//! the last bits, as `gemm`'s own results do between shapes.

use candle_core::{CpuStorage, Storage, Tensor};
use rayon::prelude::*;

/// Query rows per sequence up to which [`attend`] reads the cache in place (a decode step has 1).
pub(crate) const FEW: usize = 4;

/// A cached key or value tensor `[1, kv_heads, s, d]` as it lies: its f32 storage, where head
/// `h`'s row `j` starts (`start + h · head + j · d`).
struct Cached<'a> {
    all: &'a [f32],
    start: usize,
    head: usize,
}

impl Cached<'_> {
    fn row(&self, h: usize, j: usize, d: usize) -> &[f32] {
        &self.all[self.start + h * self.head + j * d..][..d]
    }
}

/// `f` on `t`'s storage as [`Cached`], where `t` is `[1, heads, s, d]` f32 on the CPU with rows of
/// `d` contiguous values one after another within a head (the cache and its views); `None` else.
fn with_cached<R>(t: &Tensor, f: impl FnOnce(Cached<'_>) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(all)) = &*storage else { return None };
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 4 || dims[0] != 1 || stride[3] != 1 || stride[2] != dims[3] {
        return None;
    }
    let (heads, s, d) = (dims[1], dims[2], dims[3]);
    let start = layout.start_offset();
    if heads > 0 && s > 0 && start + (heads - 1) * stride[1] + s * d > all.len() {
        return None;
    }
    Some(f(Cached { all, start, head: stride[1] }))
}

/// Attention of `q` `[1, heads, n, d]` (scaled; positions `pos..pos + n`, `n ≤ FEW`) over the
/// cached keys and values `[1, kv_heads, s, d]`, query head `h` reading key/value head
/// `h / (heads / kv_heads)` and row `i` the keys `0..=pos + i`: `[n, heads · d]`, or `None` where
/// this path does not apply (another dtype or device, a layout not the cache's, no AVX2/FMA).
pub(crate) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> candle_core::Result<Option<Tensor>> {
    let (_, heads, n, d) = q.dims4()?;
    let (_, kv_heads, s, _) = k.dims4()?;
    if n > FEW || !crate::vmath::simd_available() || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Ok(None);
    }
    let rep = heads / kv_heads;
    let q = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; n * heads * d];
    let done = with_cached(k, |k| {
        with_cached(v, |v| {
            // Each key/value head's rows of the output: its `rep` query heads × n rows.
            let per_head: Vec<Vec<f32>> = (0..kv_heads)
                .into_par_iter()
                .map(|g| {
                    let rows = &q[g * rep * n * d..(g + 1) * rep * n * d];
                    // Row r is query row r % n of its head, at position pos + r % n.
                    let seen: Vec<usize> = (0..rep * n).map(|r| (pos + r % n + 1).min(s)).collect();
                    // SAFETY: `simd_available` found AVX2 and FMA, the features it is compiled for.
                    unsafe { head(rows, &seen, &k, &v, g, d) }
                })
                .collect();
            for (g, o) in per_head.iter().enumerate() {
                for (r, row) in o.chunks_exact(d).enumerate() {
                    let (h, i) = (g * rep + r / n, r % n);
                    out[i * heads * d + h * d..][..d].copy_from_slice(row);
                }
            }
        })
    });
    if done.flatten().is_none() {
        return Ok(None);
    }
    Ok(Some(Tensor::from_vec(out, (n, heads * d), &candle_core::Device::Cpu)?))
}

/// One key/value head `g`: query rows `q` (`[rows, d]`), row `r` seeing keys `0..seen[r]`;
/// returns `[rows, d]`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head(q: &[f32], seen: &[usize], k: &Cached<'_>, v: &Cached<'_>, g: usize, d: usize) -> Vec<f32> {
    let rows = seen.len();
    let s = seen.iter().copied().max().unwrap_or(0);
    let mut scores = vec![0f32; rows * s];
    for j in 0..s {
        let key = k.row(g, j, d);
        for (r, &m) in seen.iter().enumerate() {
            if j < m {
                scores[r * s + j] = dot(&q[r * d..][..d], key);
            }
        }
    }
    let mut probs = vec![0f32; s];
    let mut out = vec![0f32; rows * d];
    for (r, &m) in seen.iter().enumerate() {
        crate::vmath::softmax_row(&scores[r * s..r * s + m], &mut probs[..m]);
        let o = &mut out[r * d..][..d];
        for (j, &p) in probs[..m].iter().enumerate() {
            for (o, &x) in o.iter_mut().zip(v.row(g, j, d)) {
                *o = p.mul_add(x, *o);
            }
        }
    }
    out
}

/// Never called: [`crate::vmath::simd_available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn head(_: &[f32], _: &[usize], _: &Cached<'_>, _: &Cached<'_>, _: usize, _: usize) -> Vec<f32> {
    unreachable!("simd_available is false off x86_64")
}

/// `a · b` in eight lanes of partial sums.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let mut lanes = [0f32; L];
    let (ab, at) = a.as_chunks::<L>();
    let (bb, bt) = b.as_chunks::<L>();
    for (x, y) in ab.iter().zip(bb) {
        for ((s, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *s = x.mul_add(y, *s);
        }
    }
    let tail: f32 = at.iter().zip(bt).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};

    /// Attention as it is defined: every query head against its key/value head's keys up to its
    /// position, softmax, values; `[n, heads · d]`.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> Tensor {
        let (_, heads, n, d) = q.dims4().unwrap();
        let (_, kv_heads, s, _) = k.dims4().unwrap();
        let rep = heads / kv_heads;
        let mut rows = Vec::new();
        for i in 0..n {
            let mut row = Vec::new();
            for h in 0..heads {
                let seen = (pos + i + 1).min(s);
                let qh = q.narrow(1, h, 1).unwrap().narrow(2, i, 1).unwrap().reshape((1, d)).unwrap();
                let kh = k.narrow(1, h / rep, 1).unwrap().narrow(2, 0, seen).unwrap().reshape((seen, d)).unwrap();
                let vh = v.narrow(1, h / rep, 1).unwrap().narrow(2, 0, seen).unwrap().reshape((seen, d)).unwrap();
                let p = candle_nn::ops::softmax(&qh.matmul(&kh.t().unwrap()).unwrap(), D::Minus1).unwrap();
                row.push(p.matmul(&vh).unwrap());
            }
            rows.push(Tensor::cat(&row, 1).unwrap());
        }
        Tensor::cat(&rows, 0).unwrap()
    }

    /// One to four query rows over keys and values laid out as the cache holds them (a view of
    /// the first `s` of a larger capacity), grouped-query heads, every position from the first
    /// to the last: what attention is, up to float rounding; more rows, or another dtype, are
    /// left to the longer path.
    #[test]
    fn a_few_rows_attend_as_attention_is_defined() {
        if !crate::vmath::simd_available() {
            eprintln!("skipped: this CPU lacks AVX2 or FMA, so the longer path computes every row");
            return;
        }
        let dev = Device::Cpu;
        let (heads, kv_heads, d, cap) = (6, 2, 24, 50);
        let k_all = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap();
        let v_all = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap();
        for (n, s) in [(1, 1), (1, 37), (2, 37), (3, 9), (4, 40), (1, 50)] {
            let (k, v) = (k_all.narrow(2, 0, s).unwrap(), v_all.narrow(2, 0, s).unwrap());
            let q = Tensor::randn(0f32, 1.0, (1, heads, n, d), &dev).unwrap();
            let pos = s - n;
            let got = attend(&q, &k, &v, pos).unwrap().expect("the few-row path applies");
            let want = reference(&q, &k, &v, pos);
            assert_eq!(got.dims(), &[n, heads * d]);
            let err = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-5, "{n} rows over {s} keys: off by {err}");
        }
        let q = Tensor::randn(0f32, 1.0, (1, heads, FEW + 1, d), &dev).unwrap();
        assert!(attend(&q, &k_all, &v_all, cap - FEW - 1).unwrap().is_none());
        let q = Tensor::randn(0f32, 1.0, (1, heads, 1, d), &dev).unwrap();
        let half = (k_all.to_dtype(DType::F16).unwrap(), v_all.to_dtype(DType::F16).unwrap());
        assert!(attend(&q, &half.0, &half.1, cap - 1).unwrap().is_none());
    }
}
