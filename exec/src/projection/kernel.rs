//! The product of a group of tokens with `W`'s panels: AVX2/FMA, `W`'s weights widened from f16
//! (F16C) where it is stored so (see the parent module's docs).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;
use std::cell::Cell;
use std::ops::Range;

use rayon::prelude::*;

use super::blocks::{Block, Blocks, BLOCK};
use super::packed::{Packed, Weight};

/// Outputs per panel: two 8-lane registers.
pub(crate) const PANEL: usize = 16;
/// Inputs per pass where there are several groups: a group's inputs (18 KB) stay in L1 while
/// the panels pass.
pub(crate) const KC: usize = 768;
/// Bytes of panels a thread passes over with each group of tokens: they stay in L2 (1 MB per
/// core here), so `W` comes from memory once.
pub(crate) const CACHED_W_BYTES: usize = 256 << 10;
/// Tokens one kernel call computes: 12 accumulators, two weight registers and a broadcast.
pub(crate) const GROUP: usize = 6;
/// Up to how many groups a product dequantizes a block matrix in registers for each group
/// rather than once into a chunk that every group reads. Two (up to 12 tokens, a batch of
/// decode steps): eight prompts decoding together took 2.76–3.00 s of CPU against 2.95–3.25 s
/// with one; twelve and sixteen prompts measured alike with either, and three groups lost
/// (sixteen prompts 5.27–5.59 s against 5.02–5.18 s).
const DIRECT_GROUPS: usize = 2;

/// `W` as the kernel reads it: panels `[kc][PANEL]` of f32 or f16 weights, held so or
/// dequantized a chunk at a time.
pub(super) trait Source: Sync {
    /// The weights the kernel reads.
    type W: Weight;

    /// `(n, k)`: `W` is `[n, k]`.
    fn shape(&self) -> (usize, usize);

    /// Panels `ps`' weights for inputs `k0..k0 + kc`: borrowed where they are held as the kernel
    /// reads them, else written into `scratch` first.
    fn chunk<'a>(&'a self, ps: Range<usize>, k0: usize, kc: usize, scratch: &'a mut Vec<f32>) -> Chunk<'a, Self::W>;

    /// Up to how many groups of tokens a product runs [`Source::direct`] for each group rather
    /// than the kernel over a chunk.
    const DIRECT_GROUPS: usize = 0;

    /// The kernel for `o`'s tokens and inputs `k0..k0 + o.kc` run straight from panel `p`'s
    /// stored weights (`o.slice` is not read). Only called for a source whose
    /// [`Source::DIRECT_GROUPS`] is not 0.
    ///
    /// # Safety
    /// As [`kernel`]'s.
    unsafe fn direct(&self, _g: usize, _p: usize, _k0: usize, _o: &Operands<'_, Self::W>) {
        unreachable!("a source without a direct kernel")
    }
}

/// Consecutive panels' weights for one range of inputs (see [`Source::chunk`]).
pub(super) struct Chunk<'a, W> {
    data: &'a [W],
    /// From one panel's weights to the next's.
    stride: usize,
    /// From a panel's start to the range's first input.
    offset: usize,
    kc: usize,
}

impl<W> Chunk<'_, W> {
    /// The `i`-th panel's `[kc][PANEL]` weights.
    fn panel(&self, i: usize) -> &[W] {
        &self.data[i * self.stride + self.offset..][..self.kc * PANEL]
    }
}

impl<W: Weight> Source for Packed<W> {
    type W = W;

    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn chunk<'a>(&'a self, ps: Range<usize>, k0: usize, kc: usize, _: &'a mut Vec<f32>) -> Chunk<'a, W> {
        let (k, start) = (self.k, ps.start * self.k * PANEL);
        Chunk { data: &self.data[start..start + ps.len() * k * PANEL], stride: k * PANEL, offset: k0 * PANEL, kc }
    }
}

impl<B: Block> Source for Blocks<B> {
    type W = f32;

    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn chunk<'a>(&'a self, ps: Range<usize>, k0: usize, kc: usize, scratch: &'a mut Vec<f32>) -> Chunk<'a, f32> {
        scratch.resize(ps.len() * kc * PANEL, 0.0);
        for (p, out) in ps.zip(scratch.chunks_exact_mut(kc * PANEL)) {
            self.dequantize_panel(p, k0, kc, out);
        }
        Chunk { data: scratch, stride: kc * PANEL, offset: 0, kc }
    }

    /// Few groups dequantize each input's 16 weights in registers as they multiply them, rather
    /// than writing them to a chunk and reading them back: the same f32 weights, the same sums.
    const DIRECT_GROUPS: usize = DIRECT_GROUPS;

    unsafe fn direct(&self, g: usize, p: usize, k0: usize, o: &Operands<'_, f32>) {
        // SAFETY: the caller's contract, passed on; k0 is a multiple of 32 (the inputs of a
        // block matrix are, and so are KC and the chunks), so the units start at its block.
        unsafe { kernel_blocks::<B>(g, &self.panel_units(p)[k0 / BLOCK * Blocks::<B>::UNIT..], o) };
    }
}

thread_local! {
    /// The dequantized chunk of [`Source::chunk`], kept between products (up to
    /// [`CACHED_W_BYTES`]).
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `x` `[rows, k]` times `W`ᵀ: `[rows, n]`. Only called where
/// [`crate::vmath::simd_available`].
pub(super) fn product<S: Source>(x: &[f32], rows: usize, w: &S) -> Vec<f32> {
    let (n, k) = w.shape();
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
        // Taken, not borrowed: nothing here calls back into a product on this thread, but a
        // scratch of its own would be right even then.
        let mut scratch = SCRATCH.take();
        for k0 in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - k0);
            let cached = (CACHED_W_BYTES / (kc * PANEL * std::mem::size_of::<S::W>())).max(1);
            for p0 in (first..last).step_by(cached) {
                let mine = p0..last.min(p0 + cached);
                // Dequantized weights for few groups are best computed in registers, once per
                // group, than written to a chunk and read back.
                let chunk = if groups.len() > S::DIRECT_GROUPS {
                    Some(w.chunk(mine.clone(), k0, kc, &mut scratch))
                } else {
                    None
                };
                for &(g0, g) in &groups {
                    let xs = &x[g0 * k + k0..(g0 + g - 1) * k + k0 + kc];
                    for p in mine.clone() {
                        let o = Operands {
                            x: xs,
                            stride: k,
                            slice: chunk.as_ref().map_or(&[], |c| c.panel(p - mine.start)),
                            kc,
                            acc: out.at(g0, p * PANEL),
                            acc_stride: width,
                            first: k0 == 0,
                        };
                        // SAFETY: `product` runs only where `simd_available` found AVX2, FMA and F16C,
                        // the features `kernel` is compiled for. The sums are rows g0..g0 + g <= rows
                        // of y, columns 16·p..16·p + 16 <= width: inside y, which outlives the
                        // loop; panel p is this task's alone (the tasks' panel ranges are
                        // disjoint) and nothing else touches y until every task has ended.
                        unsafe {
                            match chunk {
                                Some(_) => kernel(g, &o),
                                None => w.direct(g, p, k0, &o),
                            }
                        };
                    }
                }
            }
        }
        SCRATCH.set(scratch);
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
pub(super) struct Operands<'a, W> {
    /// The group's inputs: token t's `kc` lie at `x[t · stride..]`.
    x: &'a [f32],
    stride: usize,
    /// The panel's weights for those inputs, `[kc][PANEL]`.
    slice: &'a [W],
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
/// The CPU has AVX2, FMA and F16C, and `o.acc + t · o.acc_stride .. + PANEL` is valid for reads and
/// writes and not otherwise accessed during the call for every `t < g`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<W: Weight>(g: usize, o: &Operands<'_, W>) {
    // SAFETY: the caller's contract, passed on (every arm).
    unsafe {
        match g {
            1 => kernel_n::<1, W>(o),
            2 => kernel_n::<2, W>(o),
            3 => kernel_n::<3, W>(o),
            4 => kernel_n::<4, W>(o),
            5 => kernel_n::<5, W>(o),
            _ => kernel_n::<6, W>(o),
        }
    }
}

/// Never called: [`crate::vmath::simd_available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<W: Weight>(_: usize, _: &Operands<'_, W>) {
    unreachable!("simd_available is false off x86_64")
}

/// [`kernel`] for `G` tokens (the same safety contract).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kernel_n<const G: usize, W: Weight>(o: &Operands<'_, W>) {
    let &Operands { x, stride, slice, kc, .. } = o;
    use std::arch::x86_64::{_mm256_broadcast_ss, _mm256_fmadd_ps};
    assert!(
        kc > 0 && x.len() > (G - 1) * stride + kc - 1 && slice.len() >= kc * PANEL,
        "kernel: {G} tokens of {kc} inputs (stride {stride}) in {}, a slice of {}",
        x.len(),
        slice.len(),
    );
    // SAFETY: the caller's contract.
    let mut sums = unsafe { load_sums::<G, W>(o) };
    for i in 0..kc {
        // SAFETY: i < kc and the slice holds kc · PANEL weights (asserted above); the CPU has
        // the features, as this function's contract says.
        let [w0, w1] = unsafe { W::load16(slice.as_ptr().add(i * PANEL)) };
        for (t, s) in sums.iter_mut().enumerate() {
            // SAFETY: t · stride + i <= (G − 1) · stride + kc − 1 < x.len() (asserted above).
            let xb = unsafe { _mm256_broadcast_ss(&*x.as_ptr().add(t * stride + i)) };
            s[0] = _mm256_fmadd_ps(xb, w0, s[0]);
            s[1] = _mm256_fmadd_ps(xb, w1, s[1]);
        }
    }
    // SAFETY: the caller's contract.
    unsafe { store_sums(o, &sums) };
}

/// `G` tokens' sums: zero where they start, else read from `o.acc`.
///
/// # Safety
/// As [`kernel`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_sums<const G: usize, W>(o: &Operands<'_, W>) -> [[__m256; 2]; G] {
    use std::arch::x86_64::{_mm256_loadu_ps, _mm256_setzero_ps};
    let mut sums: [[__m256; 2]; G] = [[_mm256_setzero_ps(); 2]; G];
    if !o.first {
        for (t, s) in sums.iter_mut().enumerate() {
            // SAFETY: the caller's contract: token t's PANEL sums at acc + t · acc_stride.
            *s = unsafe {
                let at = o.acc.add(t * o.acc_stride);
                [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
            };
        }
    }
    sums
}

/// Writes `G` tokens' sums to `o.acc`.
///
/// # Safety
/// As [`kernel`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_sums<const G: usize, W>(o: &Operands<'_, W>, sums: &[[__m256; 2]; G]) {
    use std::arch::x86_64::_mm256_storeu_ps;
    for (t, s) in sums.iter().enumerate() {
        // SAFETY: the caller's contract: token t's PANEL sums at acc + t · acc_stride.
        unsafe {
            let at = o.acc.add(t * o.acc_stride);
            _mm256_storeu_ps(at, s[0]);
            _mm256_storeu_ps(at.add(8), s[1]);
        }
    }
}

/// `acc[t] = x[t] · W` for the `g ≤ GROUP` tokens of `o` and one panel's weights in GGUF blocks,
/// `units` (all `o.kc` inputs; `o.slice` is not read).
///
/// # Safety
/// As [`kernel`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel_blocks<B: Block>(g: usize, units: &[u8], o: &Operands<'_, f32>) {
    // SAFETY: the caller's contract, passed on (every arm).
    unsafe {
        match g {
            1 => kernel_blocks_n::<1, B>(units, o),
            2 => kernel_blocks_n::<2, B>(units, o),
            3 => kernel_blocks_n::<3, B>(units, o),
            4 => kernel_blocks_n::<4, B>(units, o),
            5 => kernel_blocks_n::<5, B>(units, o),
            _ => kernel_blocks_n::<6, B>(units, o),
        }
    }
}

/// Never called: [`crate::vmath::simd_available`] is false off x86_64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel_blocks<B: Block>(_: usize, _: &[u8], _: &Operands<'_, f32>) {
    unreachable!("simd_available is false off x86_64")
}

/// [`kernel_blocks`] for `G` tokens (the same safety contract).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kernel_blocks_n<const G: usize, B: Block>(units: &[u8], o: &Operands<'_, f32>) {
    use std::arch::x86_64::{_mm256_broadcast_ss, _mm256_fmadd_ps};
    let &Operands { x, stride, kc, .. } = o;
    let unit = Blocks::<B>::UNIT;
    assert!(
        kc > 0 && kc.is_multiple_of(BLOCK) && x.len() > (G - 1) * stride + kc - 1 && units.len() >= kc / BLOCK * unit,
        "kernel_blocks: {G} tokens of {kc} inputs (stride {stride}) in {}, {} bytes of units",
        x.len(),
        units.len(),
    );
    // SAFETY: the caller's contract.
    let mut sums = unsafe { load_sums::<G, f32>(o) };
    for (b, u) in units.chunks_exact(unit).take(kc / BLOCK).enumerate() {
        // SAFETY: `u` is a whole unit (its scales, minima and 32 inputs' codes); the CPU has the
        // features, as this function's contract says.
        let (d, m) = unsafe { Blocks::<B>::scales(u) };
        for j in 0..BLOCK {
            let i = b * BLOCK + j;
            // SAFETY: as above; input j's codes lie inside the unit.
            let [w0, w1] = unsafe {
                super::blocks::weights16::<B>(u.as_ptr().add(Blocks::<B>::CODES + j * B::CODE_BYTES), &d, &m)
            };
            for (t, s) in sums.iter_mut().enumerate() {
                // SAFETY: t · stride + i <= (G − 1) · stride + kc − 1 < x.len() (asserted above).
                let xb = unsafe { _mm256_broadcast_ss(&*x.as_ptr().add(t * stride + i)) };
                s[0] = _mm256_fmadd_ps(xb, w0, s[0]);
                s[1] = _mm256_fmadd_ps(xb, w1, s[1]);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { store_sums(o, &sums) };
}
