//! `W` in panels of [`PANEL`] outputs, its weights as f32 or as the f16 a model stores.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;

use rayon::prelude::*;

use super::kernel::PANEL;

/// A weight as a panel holds it: an f32, or an f16's bits that the kernel widens to f32 as it
/// loads them (exactly: every f16 is an f32), so that a model stored in f16 streams half the
/// bytes per product and gives the products of the f32 it widens to.
pub(crate) trait Weight: Copy + Default + Send + Sync + 'static {
    /// The weight as an f32.
    fn to_f32(self) -> f32;

    /// The 16 weights at `ptr` as two vectors of 8 f32.
    ///
    /// # Safety
    /// 16 weights are readable at `ptr`, and the CPU has the features [`kernel`] is compiled
    /// for (AVX2, FMA, F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(ptr: *const Self) -> [__m256; 2];
}

impl Weight for f32 {
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load16(ptr: *const f32) -> [__m256; 2] {
        use std::arch::x86_64::_mm256_loadu_ps;
        // SAFETY: the caller's contract: 16 f32 readable at ptr.
        unsafe { [_mm256_loadu_ps(ptr), _mm256_loadu_ps(ptr.add(8))] }
    }
}

/// The bits of an f16 (IEEE 754 binary16).
#[derive(Clone, Copy, Default, Debug, PartialEq)]
#[repr(transparent)]
pub(crate) struct Half(pub(crate) u16);

impl Weight for Half {
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load16(ptr: *const Half) -> [__m256; 2] {
        use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm_loadu_si128};
        // SAFETY: the caller's contract: 16 halves (32 bytes) readable at ptr; F16C present.
        unsafe {
            let p = ptr.cast::<__m128i>();
            [_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))]
        }
    }
}

/// `W` `[n, k]` in panels: `data[(j / PANEL) · k · PANEL + i · PANEL + j % PANEL] = W[j][i]`.
pub(crate) struct Packed<W> {
    pub(super) data: Vec<W>,
    pub(super) n: usize,
    pub(super) k: usize,
}

impl<W: Weight> Packed<W> {
    /// `d`, `[n, k]` row-major, packed, each value made a weight by `weight`.
    pub(super) fn from_values<T: Sync>(d: &[T], n: usize, k: usize, weight: impl Fn(&T) -> W + Sync) -> Packed<W> {
        let mut p = Packed { data: vec![W::default(); n.div_ceil(PANEL) * k * PANEL], n, k };
        p.fill(d, |slot, v| *slot = weight(v));
        p
    }

    /// `f(slot, d[j][i])` for the packed `W[j][i]`'s slot of every `j` and `i`; `d` is `[n, k]`,
    /// row-major. The panels are split over rayon's threads.
    pub(super) fn fill<T: Sync>(&mut self, d: &[T], f: impl Fn(&mut W, &T) + Sync) {
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
    pub(super) fn row(&self, j: usize) -> impl Iterator<Item = f32> + '_ {
        let k = self.k;
        self.data[(j / PANEL) * k * PANEL..][..k * PANEL].iter().skip(j % PANEL).step_by(PANEL).map(|w| w.to_f32())
    }

    /// `W`, row-major.
    pub(super) fn unpack(&self) -> Vec<f32> {
        (0..self.n).flat_map(|j| self.row(j)).collect()
    }

    /// The same matrix with f32 weights.
    pub(super) fn widen(&self) -> Packed<f32> {
        Packed { data: self.data.par_iter().map(|w| w.to_f32()).collect(), n: self.n, k: self.k }
    }
}
