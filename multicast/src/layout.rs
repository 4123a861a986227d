//! What travels: the byte layout of the parameters — chunks with their crc32, and the layer
//! table (byte ranges) that decides when a layer is complete at a target.

use std::ops::Range;

use cascade_transport::Region;

/// Chunking and checksums of one model's parameters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// Total bytes.
    pub bytes: u64,
    /// Chunk size (the last chunk may be shorter).
    pub chunk: u64,
    /// crc32 of each chunk, from the source copy.
    pub crcs: Vec<u32>,
    /// Byte range of each layer, in order, covering `0..bytes`.
    pub layers: Vec<Range<u64>>,
}

/// Why a layout is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// Zero bytes or a zero chunk.
    #[error("empty layout or zero chunk size")]
    Empty,
    /// The layers do not tile `0..bytes` in order.
    #[error("layer {0} does not continue where the previous one ended (layers must tile 0..bytes)")]
    Gap(usize),
    /// The crc table does not have one entry per chunk.
    #[error("{got} checksums for {want} chunks")]
    Checksums {
        /// Chunks.
        want: usize,
        /// Checksums given.
        got: usize,
    },
    /// The source region is smaller than the layout.
    #[error("source region of {have} bytes is smaller than the {want}-byte layout")]
    Short {
        /// Region length.
        have: u64,
        /// Layout bytes.
        want: u64,
    },
}

impl Layout {
    /// Builds a layout from a source region's first `bytes` bytes, computing each chunk's crc32.
    ///
    /// # Safety
    /// No peer may write `source[..bytes]` meanwhile (the region concurrency contract).
    pub unsafe fn from_region(
        source: &Region,
        bytes: u64,
        chunk: u64,
        layers: Vec<Range<u64>>,
    ) -> Result<Layout, LayoutError> {
        if bytes == 0 || chunk == 0 {
            return Err(LayoutError::Empty);
        }
        if source.len() < bytes {
            return Err(LayoutError::Short { have: source.len(), want: bytes });
        }
        let n = bytes.div_ceil(chunk);
        let crcs = (0..n)
            .map(|i| {
                let off = i * chunk;
                // SAFETY: the caller guarantees that no peer writes the range.
                unsafe { source.crc32(off, chunk.min(bytes - off)) }
                    .map_err(|_| LayoutError::Short { have: source.len(), want: bytes })
            })
            .collect::<Result<_, _>>()?;
        Layout::new(bytes, chunk, crcs, layers)
    }

    /// Builds and checks a layout from its parts.
    pub fn new(bytes: u64, chunk: u64, crcs: Vec<u32>, layers: Vec<Range<u64>>) -> Result<Layout, LayoutError> {
        if bytes == 0 || chunk == 0 {
            return Err(LayoutError::Empty);
        }
        let want = bytes.div_ceil(chunk) as usize;
        if crcs.len() != want {
            return Err(LayoutError::Checksums { want, got: crcs.len() });
        }
        let layers = if layers.is_empty() { std::iter::once(0..bytes).collect() } else { layers };
        let mut at = 0;
        for (i, l) in layers.iter().enumerate() {
            if l.start != at || l.end <= l.start {
                return Err(LayoutError::Gap(i));
            }
            at = l.end;
        }
        if at != bytes {
            return Err(LayoutError::Gap(layers.len()));
        }
        Ok(Layout { bytes, chunk, crcs, layers })
    }

    /// Number of chunks.
    pub fn chunks(&self) -> u32 {
        self.crcs.len() as u32
    }

    /// Byte range of chunk `i`.
    pub fn chunk_range(&self, i: u32) -> Range<u64> {
        let start = u64::from(i) * self.chunk;
        start..(start + self.chunk).min(self.bytes)
    }

    /// Chunks that overlap layer `l`.
    pub fn chunks_of_layer(&self, l: usize) -> Range<u32> {
        let r = &self.layers[l];
        (r.start / self.chunk) as u32..r.end.div_ceil(self.chunk) as u32
    }
}
