//! Elementwise functions of f32 tensors computed in vector registers: the exact GELU (the erf
//! form BERT uses), SiLU, and softmax over a row (plain, and causal attention's, which weighs
//! the keys past a query's position 0 without a mask tensor).
//!
//! `candle` computes them one value at a time through `libm`'s scalar `erff` and `expf`: in a
//! batch of eight short texts through all-MiniLM-L6-v2 on one thread (2026-12-06, `perf`),
//! GELU's `erff`, `erfc2` and `expf` took a fifth of the pass (15 ns a value), as much as a
//! third of the block's matrix products; in the prefill of a 1,000-word prompt through SmolLM2,
//! attention's softmax and SiLU spent 8% of the time in `expf`. Here `erf` and `exp` are
//! polynomials with no branch and no table, so the loops compile to AVX2/FMA instructions eight
//! values at a time ([`simd_available`]); on a CPU without them, `candle`'s own functions run.
//!
//! - `exp(x)`: `x = n·ln 2 + f` with `|f| ≤ ln 2 / 2` (`n` rounded to even, `ln 2` in two parts
//!   as Cody and Waite do it), `e^f` by its Taylor series to `f⁷` (truncation below 6e-9), and
//!   `2ⁿ` written into the exponent bits; arguments clamped to `[-87, 88]`, where `2ⁿ` is a
//!   normal float, and 0 below the smallest normal's logarithm (so `exp(−∞) = 0`).
//! - `erf(x)`: for `|x| ≤ 0.921875`, `x + x·q(x²)` with `q` of degree 6; above it,
//!   `1 − exp(r(|x|))` with `r` of degree 8 fitted to `ln erfc` on `[0.921875, 4]` (`erf` is 1
//!   in f32 from 3.92 on; the argument is clamped to 4), the sign restored. The coefficients are
//!   a weighted least-squares fit made near-minimax by reweighting
//!   (`exec/testdata/erf_fit.py`, numpy over Python's `math.erf`): at most 1.02 ulp from the
//!   exact `erf` over `[0, 4.5]` in that script's f32 model, against `libm`'s under 1 ulp.
//! - softmax: the row's maximum and the sum of `exp(x − max)` in eight lanes of partial results,
//!   then one multiplication by the sum's reciprocal (`candle` divides each value): within 1e-6
//!   of `candle`'s.
//!
//! GELU is `x/2 · (1 + erf(x/√2))`, `candle`'s formula; SiLU is `x / (1 + e⁻ˣ)`. Both are as
//! close to the exact functions (f64) as `candle`'s f32 path (`tests`). Every result is the same
//! bits whatever the tensor's size, a row's place in it or the thread count.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

/// Values one task of a parallel map takes (256 KB of input).
const CHUNK: usize = 1 << 16;

/// `|x|` from which `erf` takes its second form.
const ERF_BRANCH: f32 = 0.921875;
/// `q(s)`, `s = x²`, lowest power first: `erf(x) = x + x·q(x²)` below [`ERF_BRANCH`].
const ERF_SMALL: [f32; 7] =
    [0.12837917, -0.37612635, 0.11283702, -0.026859703, 0.005201716, -8.149806e-4, 8.3977946e-5];
/// `r(t)`, `t = |x|`, lowest power first: `erf(t) = 1 − exp(r(t))` above [`ERF_BRANCH`].
const ERF_BIG: [f32; 9] = [
    1.6400761e-4,
    -1.1294535,
    -0.63349855,
    -0.10807011,
    0.02494125,
    -0.004076265,
    4.0359978e-4,
    -1.5476775e-5,
    -4.3765075e-7,
];
/// `1/k!` for `k = 0..=7`: `e^f`'s Taylor series.
const EXP_TAYLOR: [f32; 8] = [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];
/// `ln 2` rounded to f32 (`LN2_HI`) and what that leaves (`LN2_LO`).
const LN2_HI: f32 = std::f32::consts::LN_2;
const LN2_LO: f32 = -1.904_654_3e-9;
/// `ln` of the smallest normal f32: `exp` is 0 below it.
const EXP_MIN: f32 = -87.336_55;
/// 1.5·2²³: added to a float under 2²², rounds it to an integer held in the low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;

/// `c[0] + c[1]·x + … ` by Horner's rule in fused multiply-adds.
#[inline(always)]
fn horner<const N: usize>(c: &[f32; N], x: f32) -> f32 {
    let mut r = c[N - 1];
    for k in (0..N - 1).rev() {
        r = r.mul_add(x, c[k]);
    }
    r
}

/// `eˣ` (see the module docs).
#[inline(always)]
fn exp(x_in: f32) -> f32 {
    let x = x_in.clamp(-87.0, 88.0);
    // x·log₂e + 1.5·2²³ rounds x·log₂e to the nearest integer n (ties to even) and holds it in
    // its low mantissa bits: n as a float and 2ⁿ's exponent field come out of it without a
    // float-to-integer conversion, which would not vectorise (Rust's saturating `as`).
    let shifted = x.mul_add(std::f32::consts::LOG2_E, ROUNDER);
    let n = shifted - ROUNDER;
    let f = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    // n is in [-126, 127]: 2ⁿ is a normal float.
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUNDER.to_bits()).wrapping_add(127) << 23);
    let e = horner(&EXP_TAYLOR, f) * two_n;
    // Below the smallest normal's logarithm, 0: a masked score (−∞) weighs nothing.
    if x_in < EXP_MIN {
        0.0
    } else {
        e
    }
}

/// `erf(x)` (see the module docs).
#[inline(always)]
fn erf(x: f32) -> f32 {
    let t = x.abs();
    let small = horner(&ERF_SMALL, x * x).mul_add(x, x);
    let big = (1.0 - exp(horner(&ERF_BIG, t.min(4.0)))).copysign(x);
    if t > ERF_BRANCH {
        big
    } else {
        small
    }
}

/// GELU, erf form.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    (erf(x * std::f32::consts::FRAC_1_SQRT_2) + 1.0) * 0.5 * x
}

/// SiLU, `x·σ(x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Whether this CPU has AVX2 and FMA, which the vector loops are compiled for, and F16C, which
/// the packed projections' kernel also uses (every CPU with AVX2 has it).
pub(crate) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The functions this module maps over a tensor.
#[derive(Clone, Copy)]
enum Func {
    Gelu,
    Silu,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn map_simd(func: Func, x: &[f32], y: &mut [f32]) {
    // One loop per function, each a straight line of vector code.
    match func {
        Func::Gelu => y.iter_mut().zip(x).for_each(|(y, &x)| *y = gelu(x)),
        Func::Silu => y.iter_mut().zip(x).for_each(|(y, &x)| *y = silu(x)),
    }
}

/// `y`, of `x`'s shape, filled by `fill(c, x_c, y_c)` for chunks `c` of `chunk` values of `x`
/// (row-major) and `y`, in parallel; `None` where the vector loops do not apply (another dtype
/// or device, or a CPU without [`simd_available`]'s features), and `fill` is never called.
fn simd_map(
    x: &Tensor,
    chunk: usize,
    fill: impl Fn(usize, &[f32], &mut [f32]) + Sync,
) -> candle_core::Result<Option<Tensor>> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() || !simd_available() {
        return Ok(None);
    }
    let y = crate::projection::with_f32(x, |x| {
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).enumerate().for_each(|(c, (y, x))| fill(c, x, y));
        y
    })?;
    Ok(Some(Tensor::from_vec(y, x.shape(), &Device::Cpu)?))
}

/// `func` of every value of `x` (see [`simd_map`] for `None`).
fn map(func: Func, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    #[cfg(target_arch = "x86_64")]
    {
        simd_map(x, CHUNK, |_, x, y| {
            // SAFETY: `simd_map` calls this only where `simd_available` found AVX2 and FMA on
            // this CPU, the features `map_simd` is compiled for.
            unsafe { map_simd(func, x, y) }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = func;
        simd_map(x, CHUNK, |_, _, _| unreachable!("simd_available is false off x86_64"))
    }
}

/// GELU of every value, the erf form (`candle`'s `gelu_erf`), vectorised where it can be.
pub(crate) fn gelu_erf(x: &Tensor) -> candle_core::Result<Tensor> {
    match map(Func::Gelu, x)? {
        Some(y) => Ok(y),
        None => x.gelu_erf(),
    }
}

/// SiLU of every value (`candle`'s `silu`), vectorised where it can be.
pub(crate) fn silu_tensor(x: &Tensor) -> candle_core::Result<Tensor> {
    match map(Func::Silu, x)? {
        Some(y) => Ok(y),
        None => x.silu(),
    }
}

/// Softmax over the last dimension of `x` (f32, `[…, rows, width]`), where row `i` of each
/// `[rows, width]` matrix sees only its first `visible(i)` values (at least one): the others
/// weigh 0, as if masked with −∞. `max`, `exp(x − max)`, their sum and the division by it, in
/// vector registers; `None` where they do not apply (see [`simd_map`]).
fn softmax_visible(x: &Tensor, visible: impl Fn(usize) -> usize + Sync) -> candle_core::Result<Option<Tensor>> {
    if x.rank() < 2 || x.dim(x.rank() - 1)? == 0 {
        return Ok(None);
    }
    let (rows, width) = (x.dim(x.rank() - 2)?, x.dim(x.rank() - 1)?);
    let per_task = (CHUNK / width).max(1);
    #[cfg(target_arch = "x86_64")]
    {
        simd_map(x, per_task * width, |c, x, y| {
            for (r, (y, x)) in y.chunks_exact_mut(width).zip(x.chunks_exact(width)).enumerate() {
                let seen = visible((c * per_task + r) % rows).clamp(1, width);
                // SAFETY: `simd_map` calls this only where `simd_available` found AVX2 and FMA
                // on this CPU, the features `softmax_row` is compiled for.
                unsafe { softmax_row(&x[..seen], &mut y[..seen]) }
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (visible, rows);
        simd_map(x, per_task * width, |_, _, _| unreachable!("simd_available is false off x86_64"))
    }
}

/// `y = softmax(x)`, one row; eight lanes of partial maxima and sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn softmax_row(x: &[f32], y: &mut [f32]) {
    const L: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; L];
    let (body, tail) = x.as_chunks::<L>();
    for c in body {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let max = tail.iter().fold(lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), |a, &b| a.max(b));
    let mut sums = [0f32; L];
    let (ybody, ytail) = y.as_chunks_mut::<L>();
    for (yc, xc) in ybody.iter_mut().zip(body) {
        for ((s, yv), &v) in sums.iter_mut().zip(yc.iter_mut()).zip(xc) {
            *yv = exp(v - max);
            *s += *yv;
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for (yv, &v) in ytail.iter_mut().zip(tail) {
        *yv = exp(v - max);
        sum += *yv;
    }
    let inv = 1.0 / sum;
    y.iter_mut().for_each(|v| *v *= inv);
}

/// Softmax over the last dimension (`candle_nn::ops::softmax_last_dim`), vectorised where it can
/// be.
pub(crate) fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    match softmax_visible(x, |_| usize::MAX)? {
        Some(y) => Ok(y),
        None => candle_nn::ops::softmax_last_dim(x),
    }
}

/// Causal attention's softmax: `scores` `[…, rows, keys]` for queries at positions `first`,
/// `first + 1`, …, row `i` seeing keys `0..=first + i` (the rest weigh 0).
pub(crate) fn causal_softmax(scores: &Tensor, first: usize) -> candle_core::Result<Tensor> {
    if let Some(y) = softmax_visible(scores, |i| first + i + 1)? {
        return Ok(y);
    }
    let (rows, keys) = (scores.dim(scores.rank() - 2)?, scores.dim(scores.rank() - 1)?);
    let mut mask = vec![0f32; rows * keys];
    for (i, row) in mask.chunks_exact_mut(keys.max(1)).enumerate() {
        row[(first + i + 1).min(keys)..].fill(f32::NEG_INFINITY);
    }
    let mask = Tensor::from_vec(mask, (rows, keys), scores.device())?.to_dtype(scores.dtype())?;
    candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance from `got` to `want` in units of the last place of `want` as an f32.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    /// `n` points over `[lo, hi]` and the exact function there (candle's f64 path).
    fn exact(lo: f64, hi: f64, n: usize, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> (Vec<f32>, Vec<f64>) {
        let xs: Vec<f32> = (0..n).map(|i| (lo + (hi - lo) * i as f64 / (n - 1) as f64) as f32).collect();
        let x64 = Tensor::from_vec(xs.iter().map(|&x| x as f64).collect::<Vec<_>>(), n, &Device::Cpu).unwrap();
        (xs, f(&x64).unwrap().to_vec1::<f64>().unwrap())
    }

    #[test]
    fn exp_is_within_two_ulp() {
        if !simd_available() {
            return eprintln!("skipped: no AVX2/FMA, the vector loops do not run");
        }
        let (xs, want) = exact(-87.0, 88.0, 400_001, |t| t.exp());
        let worst = xs.iter().zip(&want).map(|(&x, &w)| ulps(exp(x), w)).fold(0.0, f64::max);
        assert!(worst <= 2.0, "exp: {worst} ulp");
    }

    /// The exact GELU and SiLU (f64) against the vector loops over `[-12, 12]`: within 3 ulp from
    /// −1 up (2.2 and 1.8 at most, as `candle`'s f32 path); below, where `1 + erf` and `1 + eˣ`
    /// lose bits to cancellation or the value is tiny, within 1.5e-7 (8.3e-8 and 3.7e-8, as
    /// `candle`'s). A coefficient off by 1e-5 fails it.
    #[test]
    fn gelu_and_silu_match_the_exact_functions() {
        if !simd_available() {
            return eprintln!("skipped: no AVX2/FMA, the vector loops do not run");
        }
        for (name, ours, exact_f) in [
            ("gelu", gelu_erf as fn(&Tensor) -> candle_core::Result<Tensor>, Tensor::gelu_erf as fn(&Tensor) -> _),
            ("silu", silu_tensor, Tensor::silu),
        ] {
            let (xs, want) = exact(-12.0, 12.0, 240_001, exact_f);
            let got = ours(&Tensor::new(xs.as_slice(), &Device::Cpu).unwrap()).unwrap().to_vec1::<f32>().unwrap();
            for ((&x, &w), &g) in xs.iter().zip(&want).zip(&got) {
                if x >= -1.0 {
                    assert!(ulps(g, w) <= 3.0, "{name}({x}) = {g}, exact {w}: {} ulp", ulps(g, w));
                } else {
                    assert!((g as f64 - w).abs() <= 1.5e-7, "{name}({x}) = {g}, exact {w}");
                }
            }
        }
    }

    /// Against `candle`'s softmax (after a −∞ mask where causal): every probability within
    /// 1e-6 of its own and of the exact one relative to the row's largest, masked ones exactly
    /// 0, rows of every width from 1 (a tail without a full vector) to several chunks.
    #[test]
    fn softmax_matches_candles_and_masks_exactly() {
        if !simd_available() {
            return eprintln!("skipped: no AVX2/FMA, the vector loops do not run");
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        for (rows, width) in [(1, 1), (3, 7), (5, 8), (4, 9), (6, 100), (2, 1_000), (70, 1_100)] {
            let x = Tensor::randn(0f32, 4.0, (2, rows, width), &Device::Cpu).unwrap();
            let want = candle_nn::ops::softmax_last_dim(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = softmax_last_dim(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-6, "{rows} x {width}: {g} against {w}");
            }
            for first in [0, width / 2, width] {
                let got = causal_softmax(&x, first).unwrap().to_vec3::<f32>().unwrap();
                let mut mask = vec![0f32; rows * width];
                for (i, row) in mask.chunks_exact_mut(width).enumerate() {
                    row[(first + i + 1).min(width)..].fill(f32::NEG_INFINITY);
                }
                let masked = x.broadcast_add(&Tensor::from_vec(mask, (rows, width), &Device::Cpu).unwrap()).unwrap();
                let want = candle_nn::ops::softmax_last_dim(&masked).unwrap().to_vec3::<f32>().unwrap();
                for (gm, wm) in got.iter().zip(&want) {
                    for (i, (gr, wr)) in gm.iter().zip(wm).enumerate() {
                        let sum: f32 = gr.iter().sum();
                        assert!((sum - 1.0).abs() < 1e-5, "row sums to {sum}");
                        for (j, (g, w)) in gr.iter().zip(wr).enumerate() {
                            if j > first + i {
                                assert_eq!(*g, 0.0, "masked key {j} of row {i} (first {first})");
                            }
                            assert!((g - w).abs() <= 1e-6, "{rows} x {width}, first {first}: {g} against {w}");
                        }
                    }
                }
            }
        }
    }

    /// Large tensors run in parallel chunks: the same bits as one value at a time, in place.
    #[test]
    fn a_large_tensor_gives_each_value_its_own_result() {
        if !simd_available() {
            return eprintln!("skipped: no AVX2/FMA, the vector loops do not run");
        }
        let xs: Vec<f32> = (0..3 * CHUNK + 18).map(|i| ((i * 7919) % 20_000) as f32 / 1_000.0 - 10.0).collect();
        let t = Tensor::from_vec(xs.clone(), (3, xs.len() / 3), &Device::Cpu).unwrap();
        let y = gelu_erf(&t).unwrap();
        assert_eq!(y.dims(), t.dims());
        let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, g) in xs.iter().zip(&y) {
            assert_eq!(g.to_bits(), gelu(*x).to_bits());
        }
        // Not f32, or not on the CPU: candle's own.
        let t64 = Tensor::new(&[1.0f64, -0.5], &Device::Cpu).unwrap();
        assert_eq!(
            gelu_erf(&t64).unwrap().to_vec1::<f64>().unwrap(),
            t64.gelu_erf().unwrap().to_vec1::<f64>().unwrap()
        );
    }
}
