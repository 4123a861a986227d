//! `W` kept in GGUF's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), in panels of [`PANEL`]
//! outputs, and dequantized a chunk at a time into f32 panels for the kernel.
//!
//! GGUF quantizes a row in blocks of 32 weights, each with an f16 scale `d` (and, for Q4_1 and
//! Q5_1, an f16 minimum `m`): Q4_0 stores 4-bit codes `q` (the weight `(q − 8)·d`), Q4_1 4-bit
//! ones (`q·d + m`), Q5_0 and Q5_1 5-bit ones (`(q − 16)·d`, `q·d + m`; the fifth bits in a 32-bit
//! word per block), Q8_0 8-bit signed ones (`q·d`). A model imported with its blocks kept
//! ([`crate::gguf::Storage::Quantized`]) stores each such matrix as it came, `[rows, blocks,
//! bytes]` (18, 20, 22, 24 or 34 bytes a block: the last dimension says which type), and here they
//! are regrouped by panel: for panel `p` and block `b`, the 16 outputs' scales (and minima) as
//! f16, then, for each of the block's 32 inputs, the 16 outputs' codes (Q4_0 and Q4_1: output `r`
//! in the low nibble of byte `r`, output `r + 8` in its high nibble; Q5_0 as a signed byte
//! `q − 16`, Q5_1 and Q8_0 one byte each).
//!
//! A product of a few tokens (one or two groups, decoding) dequantizes each input's 16 weights
//! in registers as it multiplies them (`kernel::kernel_blocks`); one of more tokens dequantizes
//! the panels it is about to use into f32 (`[kc][PANEL]`, as
//! [`Packed<f32>`](super::packed::Packed) holds them) and runs the f32 kernel over them, so that
//! scratch is written once and read by every group. Either way the multiply-adds run in the f32
//! kernel's order. Dequantizing computes each weight as `candle`'s dequantization does (the code,
//! less its offset, times the scale, exact in f32 for a code of at most 8 bits and an f16 scale,
//! then for Q4_1 and Q5_1 plus the minimum, rounded once), so the weights are bit for bit those
//! of the f32 import of the same file and the products are bit for bit the f32 model's.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;

use super::kernel::PANEL;
use super::packed::Packed;

/// Weights per block.
pub(crate) const BLOCK: usize = 32;

/// A GGUF block type.
pub(crate) trait Block: Send + Sync + 'static {
    /// Which one, as a value.
    const KIND: Kind;
    /// Bytes of one block in a GGUF row.
    const GGUF_BYTES: usize = Self::KIND.gguf_bytes();
    /// Whether blocks carry a minimum `m` besides the scale `d`.
    const MIN: bool;
    /// How a panel holds the codes, and the multiple of the scale each stands for.
    const CODES: Codes;
    /// Bytes of codes per input of a panel (16 outputs).
    const CODE_BYTES: usize = match Self::CODES {
        Codes::Nibbles { .. } => PANEL / 2,
        Codes::Bytes { .. } => PANEL,
    };

    /// A GGUF block's scale and minimum (f16 bits; 0 without one) and its 32 codes, as a panel
    /// holds them.
    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]);

    /// The multiple of the scale that `code` stands for, as `candle` computes it before it
    /// scales.
    fn level(code: u8) -> f32 {
        match Self::CODES {
            Codes::Nibbles { offset } => (i32::from(code) - offset) as f32,
            Codes::Bytes { signed: true } => f32::from(code as i8),
            Codes::Bytes { signed: false } => f32::from(code),
        }
    }

    /// The weight of `code` under scale `d` and minimum `m`, as `candle` dequantizes it: the
    /// level times the scale (exact: at most 8 bits times an f16), plus the minimum where there
    /// is one, rounded once.
    fn value(code: u8, d: f32, m: f32) -> f32 {
        let w = Self::level(code) * d;
        if Self::MIN {
            w + m
        } else {
            w
        }
    }

    /// Writes `codes[r]` (output `r` of the panel, `r < PANEL`) into `out`, `CODE_BYTES` long.
    fn pack(codes: &[u8; PANEL], out: &mut [u8]) {
        if matches!(Self::CODES, Codes::Nibbles { .. }) {
            for (r, o) in out.iter_mut().enumerate().take(PANEL / 2) {
                *o = codes[r] | (codes[r + PANEL / 2] << 4);
            }
        } else {
            out[..PANEL].copy_from_slice(codes);
        }
    }

    /// Reads output `r`'s code back from one input's `CODE_BYTES`.
    fn unpack(codes: &[u8], r: usize) -> u8 {
        match (Self::CODES, r < PANEL / 2) {
            (Codes::Bytes { .. }, _) => codes[r],
            (Codes::Nibbles { .. }, true) => codes[r] & 0x0f,
            (Codes::Nibbles { .. }, false) => codes[r - PANEL / 2] >> 4,
        }
    }
}

/// How a block type's panels hold its codes (see [`Block::CODES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codes {
    /// A code per nibble (output `r` in the low nibble of byte `r`, output `r + 8` in its high
    /// nibble), standing for `q − offset`.
    Nibbles {
        /// Subtracted from each code.
        offset: i32,
    },
    /// A code per byte, signed or not, standing for itself.
    Bytes {
        /// Whether the byte is signed.
        signed: bool,
    },
}

/// The 16 weights of one input of `B`'s panel: its codes at `ptr`, the panel's scales and
/// minima — [`Block::value`] of each, in registers.
///
/// # Safety
/// `B::CODE_BYTES` are readable at `ptr`; the CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn weights16<B: Block>(ptr: *const u8, d: &[__m256; 2], m: &[__m256; 2]) -> [__m256; 2] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract, passed on.
    let [lo, hi] = unsafe {
        match B::CODES {
            Codes::Nibbles { offset } => nibbles16(ptr, offset),
            Codes::Bytes { signed } => bytes16(ptr, signed),
        }
    };
    let (lo, hi) = (_mm256_mul_ps(lo, d[0]), _mm256_mul_ps(hi, d[1]));
    if B::MIN {
        [_mm256_add_ps(lo, m[0]), _mm256_add_ps(hi, m[1])]
    } else {
        [lo, hi]
    }
}

/// GGUF's Q4_0: 4-bit codes, `(q − 8)·d`, held in nibbles.
pub(crate) struct Q4_0;

/// GGUF's Q4_1: 4-bit codes, `q·d + m`, held in nibbles.
pub(crate) struct Q4_1;

/// GGUF's Q5_0: 5-bit codes (the fifth bit in a 32-bit word per block), `(q − 16)·d`. Its panels
/// hold `q − 16` as a signed byte, as Q8_0's hold their codes.
pub(crate) struct Q5_0;

/// GGUF's Q5_1: 5-bit codes, `q·d + m`, a byte each.
pub(crate) struct Q5_1;

/// GGUF's Q8_0: 8-bit signed codes, `q·d`.
pub(crate) struct Q8_0;

fn half(bytes: &[u8]) -> u16 {
    u16::from_le_bytes([bytes[0], bytes[1]])
}

/// A block's 32 four-bit codes from its 16 bytes: element `j < 16` is the low nibble of `qs[j]`,
/// element `j + 16` the high one (as ggml and candle read them).
fn nibbles32(qs: &[u8]) -> [u8; BLOCK] {
    std::array::from_fn(|i| if i < 16 { qs[i] & 0x0f } else { qs[i - 16] >> 4 })
}

/// A Q5 block's 32 five-bit codes: [`nibbles32`] of `qs`, with bit `i` of `qh` above element `i`.
fn codes5(qh: &[u8], qs: &[u8]) -> [u8; BLOCK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let low = nibbles32(qs);
    std::array::from_fn(|i| low[i] | ((((qh >> i) & 1) as u8) << 4))
}

impl Block for Q4_0 {
    const KIND: Kind = Kind::Q4_0;
    const MIN: bool = false;
    const CODES: Codes = Codes::Nibbles { offset: 8 };

    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]) {
        (half(block), 0, nibbles32(&block[2..18]))
    }
}

impl Block for Q4_1 {
    const KIND: Kind = Kind::Q4_1;
    const MIN: bool = true;
    const CODES: Codes = Codes::Nibbles { offset: 0 };

    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]) {
        (half(block), half(&block[2..]), nibbles32(&block[4..20]))
    }
}

impl Block for Q5_0 {
    const KIND: Kind = Kind::Q5_0;
    const MIN: bool = false;
    const CODES: Codes = Codes::Bytes { signed: true };

    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]) {
        let codes = codes5(&block[2..6], &block[6..22]);
        (half(block), 0, codes.map(|q| (i32::from(q) - 16) as i8 as u8))
    }
}

impl Block for Q5_1 {
    const KIND: Kind = Kind::Q5_1;
    const MIN: bool = true;
    const CODES: Codes = Codes::Bytes { signed: false };

    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]) {
        (half(block), half(&block[2..]), codes5(&block[4..8], &block[8..24]))
    }
}

impl Block for Q8_0 {
    const KIND: Kind = Kind::Q8_0;
    const MIN: bool = false;
    const CODES: Codes = Codes::Bytes { signed: true };

    fn parse(block: &[u8]) -> (u16, u16, [u8; BLOCK]) {
        (half(block), 0, std::array::from_fn(|i| block[2 + i]))
    }
}

/// The 16 nibbles at `ptr` ([`Codes::Nibbles`]' layout) less `offset`, as f32: outputs 0–7, 8–15.
///
/// # Safety
/// 8 bytes are readable at `ptr`; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles16(ptr: *const u8, offset: i32) -> [__m256; 2] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: 8 bytes readable at ptr.
    let v = unsafe { _mm_loadl_epi64(ptr.cast::<__m128i>()) };
    let mask = _mm_set1_epi8(0x0f);
    let off = _mm256_set1_epi32(offset);
    let lo = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(v, mask)), off);
    let hi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)), off);
    [_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)]
}

/// The 16 bytes at `ptr` (one a code, outputs 0–15), signed or not, as f32: outputs 0–7, 8–15.
///
/// # Safety
/// 16 bytes are readable at `ptr`; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bytes16(ptr: *const u8, signed: bool) -> [__m256; 2] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: 16 bytes readable at ptr.
    let v = unsafe { _mm_loadu_si128(ptr.cast::<__m128i>()) };
    let high = _mm_srli_si128(v, 8);
    let (lo, hi) = if signed {
        (_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(high))
    } else {
        (_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(high))
    };
    [_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)]
}

/// Which block type a stored tensor of `shape` (`[rows, blocks, bytes per block]`, U8) holds, with
/// its matrix's `(rows, inputs)`.
pub(crate) fn kind_of(shape: &[usize]) -> Option<(Kind, usize, usize)> {
    match *shape {
        [n, b, bytes] => Kind::ALL.into_iter().find(|k| k.gguf_bytes() == bytes).map(|k| (k, n, b * BLOCK)),
        _ => None,
    }
}

/// A block type, as a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
}

/// The block types kept as blocks, as a person reads them.
pub(crate) const KEPT: &str = "Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0";

impl Kind {
    /// Every block type kept as blocks.
    pub(crate) const ALL: [Kind; 5] = [Kind::Q4_0, Kind::Q4_1, Kind::Q5_0, Kind::Q5_1, Kind::Q8_0];

    /// Bytes of one block in a GGUF row: the scale (and minimum) as f16, the fifth bits of Q5's
    /// codes, then the codes. Each type's is its own: a stored tensor's last dimension says which.
    pub(crate) const fn gguf_bytes(self) -> usize {
        match self {
            Kind::Q4_0 => 2 + BLOCK / 2,
            Kind::Q4_1 => 4 + BLOCK / 2,
            Kind::Q5_0 => 2 + 4 + BLOCK / 2,
            Kind::Q5_1 => 4 + 4 + BLOCK / 2,
            Kind::Q8_0 => 2 + BLOCK,
        }
    }

    /// The block type of a GGUF tensor's type, if it is one kept as blocks.
    pub(crate) fn of_ggml(t: candle_core::quantized::GgmlDType) -> Option<Kind> {
        use candle_core::quantized::GgmlDType;
        match t {
            GgmlDType::Q4_0 => Some(Kind::Q4_0),
            GgmlDType::Q4_1 => Some(Kind::Q4_1),
            GgmlDType::Q5_0 => Some(Kind::Q5_0),
            GgmlDType::Q5_1 => Some(Kind::Q5_1),
            GgmlDType::Q8_0 => Some(Kind::Q8_0),
            _ => None,
        }
    }

    /// `n` GGUF rows of `k` weights in these blocks as panels (see the module docs).
    pub(super) fn panels(self, gguf: &[u8], n: usize, k: usize) -> Result<Box<dyn AnyBlocks>, String> {
        fn boxed<B: Block>(gguf: &[u8], n: usize, k: usize) -> Result<Box<dyn AnyBlocks>, String> {
            Ok(Box::new(Blocks::<B>::from_gguf(gguf, n, k)?))
        }
        match self {
            Kind::Q4_0 => boxed::<Q4_0>(gguf, n, k),
            Kind::Q4_1 => boxed::<Q4_1>(gguf, n, k),
            Kind::Q5_0 => boxed::<Q5_0>(gguf, n, k),
            Kind::Q5_1 => boxed::<Q5_1>(gguf, n, k),
            Kind::Q8_0 => boxed::<Q8_0>(gguf, n, k),
        }
    }

    /// That `len` bytes are `n` GGUF rows of `k` weights in these blocks.
    pub(crate) fn check(self, len: usize, n: usize, k: usize) -> Result<(), String> {
        if !k.is_multiple_of(BLOCK) || len != n * (k / BLOCK) * self.gguf_bytes() {
            return Err(format!("{len} bytes for a {n} × {k} {self:?} matrix"));
        }
        Ok(())
    }
}

/// `W` `[n, k]` dequantized from GGUF rows (`gguf` is `n` rows of `k / 32` blocks), row-major.
pub(crate) fn dequantize(kind: Kind, gguf: &[u8], n: usize, k: usize) -> Result<Vec<f32>, String> {
    fn rows<B: Block>(gguf: &[u8], n: usize, k: usize) -> Result<Vec<f32>, String> {
        B::KIND.check(gguf.len(), n, k)?;
        let mut out = Vec::with_capacity(n * k);
        for block in gguf.chunks_exact(B::GGUF_BYTES) {
            let (d, m, codes) = B::parse(block);
            let (d, m) = (half::f16::from_bits(d).to_f32(), half::f16::from_bits(m).to_f32());
            out.extend(codes.iter().map(|&q| B::value(q, d, m)));
        }
        Ok(out)
    }
    match kind {
        Kind::Q4_0 => rows::<Q4_0>(gguf, n, k),
        Kind::Q4_1 => rows::<Q4_1>(gguf, n, k),
        Kind::Q5_0 => rows::<Q5_0>(gguf, n, k),
        Kind::Q5_1 => rows::<Q5_1>(gguf, n, k),
        Kind::Q8_0 => rows::<Q8_0>(gguf, n, k),
    }
}

/// A matrix of GGUF blocks of one kind, whichever: what a projection holds.
pub(super) trait AnyBlocks: Send + Sync {
    /// `(n, k)`: `W` is `[n, k]`.
    fn shape(&self) -> (usize, usize);
    /// `x · Wᵀ` for `rows` rows of `x`.
    fn product(&self, x: &[f32], rows: usize) -> Vec<f32>;
    /// Row `j` of `W` onto `out`.
    fn extend_row(&self, j: usize, out: &mut Vec<f32>);
    /// `W`, row-major.
    fn unpack(&self) -> Vec<f32>;
    /// The same matrix with f32 weights.
    fn widen(&self) -> Packed<f32>;
}

impl<B: Block> AnyBlocks for Blocks<B> {
    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn product(&self, x: &[f32], rows: usize) -> Vec<f32> {
        super::kernel::product(x, rows, self)
    }

    fn extend_row(&self, j: usize, out: &mut Vec<f32>) {
        out.extend(self.row(j));
    }

    fn unpack(&self) -> Vec<f32> {
        Blocks::unpack(self)
    }

    fn widen(&self) -> Packed<f32> {
        Blocks::widen(self)
    }
}

/// `W` `[n, k]` in panels of GGUF blocks (see the module docs).
pub(crate) struct Blocks<B> {
    /// Per panel, per block: the scales (and minima) as f16 bits, then the codes.
    data: Vec<u8>,
    pub(super) n: usize,
    pub(super) k: usize,
    _block: std::marker::PhantomData<B>,
}

impl<B: Block> Blocks<B> {
    /// Bytes of one panel's block: `PANEL` scales, `PANEL` minima if any, 32 inputs' codes.
    pub(super) const UNIT: usize = PANEL * 2 * (1 + B::MIN as usize) + BLOCK * B::CODE_BYTES;
    /// Offset of the codes in a unit.
    pub(super) const CODES: usize = PANEL * 2 * (1 + B::MIN as usize);

    /// From GGUF rows: `n` rows of `k / 32` blocks of `B`.
    pub(crate) fn from_gguf(gguf: &[u8], n: usize, k: usize) -> Result<Blocks<B>, String> {
        B::KIND.check(gguf.len(), n, k)?;
        let blocks = k / BLOCK;
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0u8; panels * blocks * Self::UNIT];
        let row = blocks * B::GGUF_BYTES;
        for (p, panel) in data.chunks_exact_mut(blocks * Self::UNIT).enumerate() {
            for (b, unit) in panel.chunks_exact_mut(Self::UNIT).enumerate() {
                // Outputs past n (the last panel's padding) keep scale 0, minimum 0, code 0.
                let mut codes = [[0u8; PANEL]; BLOCK];
                for r in 0..PANEL.min(n - p * PANEL) {
                    let j = p * PANEL + r;
                    let (d, m, q) = B::parse(&gguf[j * row + b * B::GGUF_BYTES..][..B::GGUF_BYTES]);
                    unit[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                    if B::MIN {
                        unit[2 * (PANEL + r)..2 * (PANEL + r) + 2].copy_from_slice(&m.to_le_bytes());
                    }
                    for (i, c) in q.iter().enumerate() {
                        codes[i][r] = *c;
                    }
                }
                for (i, c) in codes.iter().enumerate() {
                    B::pack(c, &mut unit[Self::CODES + i * B::CODE_BYTES..][..B::CODE_BYTES]);
                }
            }
        }
        Ok(Blocks { data, n, k, _block: std::marker::PhantomData })
    }

    fn unit(&self, p: usize, b: usize) -> &[u8] {
        &self.data[(p * (self.k / BLOCK) + b) * Self::UNIT..][..Self::UNIT]
    }

    /// Panel `p`'s units, one per block of inputs.
    pub(super) fn panel_units(&self, p: usize) -> &[u8] {
        let len = self.k / BLOCK * Self::UNIT;
        &self.data[p * len..][..len]
    }

    /// A unit's 16 scales and 16 minima (zero without them) as f32.
    ///
    /// # Safety
    /// `unit` is a whole unit of `B`, and the CPU has AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn scales(unit: &[u8]) -> ([__m256; 2], [__m256; 2]) {
        use std::arch::x86_64::_mm256_setzero_ps;
        assert!(unit.len() >= Self::CODES);
        let at = unit.as_ptr();
        // SAFETY: the scales (and minima) are the unit's first 32 (64) bytes, asserted there.
        unsafe {
            let d = [halves8(at), halves8(at.add(16))];
            let m = if B::MIN { [halves8(at.add(32)), halves8(at.add(48))] } else { [_mm256_setzero_ps(); 2] };
            (d, m)
        }
    }

    /// `W[j][i]`.
    fn at(&self, j: usize, i: usize) -> f32 {
        let u = self.unit(j / PANEL, i / BLOCK);
        let r = j % PANEL;
        let d = half::f16::from_bits(half(&u[2 * r..])).to_f32();
        let m = if B::MIN { half::f16::from_bits(half(&u[2 * (PANEL + r)..])).to_f32() } else { 0.0 };
        let code = B::unpack(&u[Self::CODES + (i % BLOCK) * B::CODE_BYTES..], r);
        B::value(code, d, m)
    }

    /// Row `j` of `W` (`j < n`).
    pub(super) fn row(&self, j: usize) -> impl Iterator<Item = f32> + '_ {
        (0..self.k).map(move |i| self.at(j, i))
    }

    /// `W`, row-major.
    pub(super) fn unpack(&self) -> Vec<f32> {
        (0..self.n).flat_map(|j| self.row(j)).collect()
    }

    /// The same matrix with f32 weights.
    pub(super) fn widen(&self) -> Packed<f32> {
        Packed::from_values(&self.unpack(), self.n, self.k, |v| *v)
    }

    /// Panel `p`'s weights for inputs `k0..k0 + kc` (multiples of 32) as f32, `[kc][PANEL]`,
    /// into `out`. Only called where [`crate::vmath::simd_available`].
    pub(super) fn dequantize_panel(&self, p: usize, k0: usize, kc: usize, out: &mut [f32]) {
        assert!(
            k0.is_multiple_of(BLOCK) && kc.is_multiple_of(BLOCK) && k0 + kc <= self.k && out.len() >= kc * PANEL,
            "dequantize_panel: inputs {k0}..+{kc} of {}, {} out",
            self.k,
            out.len()
        );
        for (b, out) in (k0 / BLOCK..(k0 + kc) / BLOCK).zip(out.chunks_exact_mut(BLOCK * PANEL)) {
            let unit = self.unit(p, b);
            // SAFETY: `unit` is one whole unit (UNIT bytes: the scales, minima and 32 inputs' codes
            // that `decode_unit` reads) and `out` holds BLOCK · PANEL values; the caller runs this
            // only where `simd_available` found AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                decode_unit::<B>(unit, out)
            };
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = (unit, out);
                unreachable!("simd_available is false off x86_64");
            }
        }
    }
}

/// One unit's 32 inputs × 16 outputs into `out`.
///
/// # Safety
/// `unit` is a whole unit of `B`, and the CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_unit<B: Block>(unit: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::_mm256_storeu_ps;
    assert!(out.len() >= BLOCK * PANEL && unit.len() >= Blocks::<B>::UNIT);
    // SAFETY: the caller's contract: a whole unit, whose codes lie CODE_BYTES per input from
    // CODES on; out has room for BLOCK · PANEL values (asserted).
    unsafe {
        let (d, m) = Blocks::<B>::scales(unit);
        let codes = unit.as_ptr().add(Blocks::<B>::CODES);
        for i in 0..BLOCK {
            let [w0, w1] = weights16::<B>(codes.add(i * B::CODE_BYTES), &d, &m);
            _mm256_storeu_ps(out.as_mut_ptr().add(i * PANEL), w0);
            _mm256_storeu_ps(out.as_mut_ptr().add(i * PANEL + 8), w1);
        }
    }
}

/// The 8 f16 at `ptr` as f32.
///
/// # Safety
/// 16 bytes are readable at `ptr`, and the CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halves8(ptr: *const u8) -> __m256 {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm_loadu_si128};
    // SAFETY: the caller's contract.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast::<__m128i>())) }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// GGUF rows of `w` in `dtype`, and what `candle` dequantizes them to.
    pub(crate) fn gguf_of(w: &Tensor, dtype: GgmlDType) -> (Vec<u8>, Vec<f32>) {
        let q = QTensor::quantize(w, dtype).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (q.data().unwrap().into_owned(), deq)
    }

    /// Every block type kept, with the GGUF type candle quantizes to.
    pub(crate) const KINDS: [(GgmlDType, Kind); 5] = [
        (GgmlDType::Q4_0, Kind::Q4_0),
        (GgmlDType::Q4_1, Kind::Q4_1),
        (GgmlDType::Q5_0, Kind::Q5_0),
        (GgmlDType::Q5_1, Kind::Q5_1),
        (GgmlDType::Q8_0, Kind::Q8_0),
    ];

    /// Every block type dequantizes to `candle`'s values bit for bit, from GGUF rows and from the
    /// panels, for outputs that do and do not fill their last panel; wrong lengths are refused.
    #[test]
    fn blocks_dequantize_to_candles_values_bit_for_bit() {
        assert_eq!(KINDS.map(|(_, k)| k), Kind::ALL);
        for (n, k) in [(37, 64), (16, 32), (5, 96)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            for (dtype, kind) in KINDS {
                assert_eq!(Kind::of_ggml(dtype), Some(kind));
                let (gguf, want) = gguf_of(&w, dtype);
                assert_eq!(gguf.len(), n * k / BLOCK * kind.gguf_bytes(), "{kind:?}");
                assert_eq!(bits(&dequantize(kind, &gguf, n, k).unwrap()), bits(&want), "{kind:?} {n}×{k}");
                let unpacked = kind.panels(&gguf, n, k).unwrap().unpack();
                assert_eq!(bits(&unpacked), bits(&want), "{kind:?} {n}×{k} from panels");
                assert!(dequantize(kind, &gguf[1..], n, k).is_err());
                assert!(dequantize(kind, &gguf, n + 1, k).is_err());
                assert!(Blocks::<Q4_1>::from_gguf(&gguf, n, k + 32).is_err());
            }
        }
        assert_eq!(kind_of(&[7, 3, 20]), Some((Kind::Q4_1, 7, 96)));
        assert_eq!(kind_of(&[7, 3, 34]), Some((Kind::Q8_0, 7, 96)));
        assert_eq!(kind_of(&[7, 3, 18]), Some((Kind::Q4_0, 7, 96)));
        assert_eq!(kind_of(&[7, 3, 22]), Some((Kind::Q5_0, 7, 96)));
        assert_eq!(kind_of(&[7, 3, 24]), Some((Kind::Q5_1, 7, 96)));
        assert_eq!(kind_of(&[7, 60]), None);
        assert_eq!(kind_of(&[7, 3, 19]), None);
    }
}
