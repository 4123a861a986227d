//! Accelerator memory: where parameters finally go.
//!
//! [`DeviceMemory`] is the one trait for a kind of device memory — allocate, copy host→device,
//! device→host, device→device — with two implementations:
//! * [`cuda::CudaDevice`] (feature `cuda`): NVIDIA GPUs through `cudarc`'s driver API, loaded
//!   at run time (`dynamic-loading`), so the crate builds and runs without CUDA; asking for it
//!   without a driver or a GPU is a clear [`TransportError::Device`] error. Device→device copies
//!   between GPUs of one host go peer to peer (the NVLink path where the GPUs have it).
//! * [`EmulatedDevice`] — a **test double**: "device" memory that is host memory, for testing
//!   everything around a GPU on machines without one.
//!
//! A multicast target on a GPU lands its chunks in a host staging region (the transport's
//! regions are host memory: tcp and shm place bytes with the CPU) and each layer is copied to
//! the device once every chunk of it is crc-verified ([`upload_region`]); the device copy is
//! then verified by reading it back ([`ReadBack`], or [`verify_on_device`] for one check). This
//! is not GPUDirect RDMA (a NIC writing device memory), which needs an RDMA NIC and
//! `nvidia-peermem`.

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::error::{Result, TransportError};
use crate::region::Region;

/// A buffer in a device's memory (opaque; made by [`DeviceMemory::alloc`]).
pub struct DeviceBuffer {
    len: u64,
    inner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer").field("len", &self.len).finish_non_exhaustive()
    }
}

impl DeviceBuffer {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no bytes (never, for an allocated buffer).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransportError::Device(format!(
                "[{offset}, {offset}+{len}) is outside the {}-byte device buffer",
                self.len
            ))),
        }
    }

    fn inner<T: 'static>(&self, who: &str) -> Result<&T> {
        self.inner.downcast_ref::<T>().ok_or_else(|| TransportError::Device(format!("a buffer {who} did not allocate")))
    }
}

/// One kind of device memory.
pub trait DeviceMemory: Send + Sync + 'static {
    /// Which device, for logs and errors (`cuda:0 (NVIDIA H100 …)`, `emulated:0`).
    fn describe(&self) -> String;
    /// A zeroed buffer of `len` bytes.
    fn alloc(&self, len: u64) -> Result<DeviceBuffer>;
    /// Copies `src` to `dst[dst_offset..]` (host → device); returns when the bytes are there.
    /// A range outside the buffer is refused, never clamped, for every device.
    fn upload(&self, dst: &DeviceBuffer, dst_offset: u64, src: &[u8]) -> Result<()> {
        dst.check(dst_offset, src.len() as u64)?;
        self.upload_in_range(dst, dst_offset, src)
    }
    /// Copies `src[src_offset..][..dst.len()]` into `dst` (device → host); bounds as `upload`.
    fn download(&self, src: &DeviceBuffer, src_offset: u64, dst: &mut [u8]) -> Result<()> {
        src.check(src_offset, dst.len() as u64)?;
        self.download_in_range(src, src_offset, dst)
    }
    /// Copies `len` bytes between two buffers of this device, or from a buffer of another device
    /// of the same kind (`src_device`) — peer to peer between GPUs of one host; bounds as
    /// `upload`.
    fn copy(
        &self,
        src_device: &dyn DeviceMemory,
        src: &DeviceBuffer,
        src_offset: u64,
        dst: &DeviceBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        src.check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        self.copy_in_range(src_device, src, src_offset, dst, dst_offset, len)
    }
    /// [`DeviceMemory::upload`], its range checked.
    fn upload_in_range(&self, dst: &DeviceBuffer, dst_offset: u64, src: &[u8]) -> Result<()>;
    /// [`DeviceMemory::download`], its range checked.
    fn download_in_range(&self, src: &DeviceBuffer, src_offset: u64, dst: &mut [u8]) -> Result<()>;
    /// [`DeviceMemory::copy`], its ranges checked.
    fn copy_in_range(
        &self,
        src_device: &dyn DeviceMemory,
        src: &DeviceBuffer,
        src_offset: u64,
        dst: &DeviceBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()>;
    /// For downcasting in [`DeviceMemory::copy`].
    fn as_any(&self) -> &dyn Any;
    /// Page-locks `region` for DMA with this device until the guard drops, so copies from it go
    /// straight to the device rather than through the driver's bounce buffers. The pages stay
    /// ordinary cached memory (never write-combined: the CPU reads them for crc checks). `None`
    /// where the device needs nothing (the emulated one).
    fn pin(&self, region: &Region) -> Result<Option<PinGuard>> {
        let _ = region;
        Ok(None)
    }
}

/// Keeps a region pinned for a device; unpins it when dropped.
pub struct PinGuard(Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl PinGuard {
    /// A guard that runs `unpin` when dropped.
    pub fn new(unpin: impl FnOnce() + Send + 'static) -> PinGuard {
        PinGuard(Mutex::new(Some(Box::new(unpin))))
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(f) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            f();
        }
    }
}

impl std::fmt::Debug for PinGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinGuard")
    }
}

/// A device name's kind and index: `cuda:N` or `emulated:N` (`cuda` alone is `cuda:0`).
fn parse(spec: &str) -> Result<(&str, u32)> {
    let bad = || TransportError::Config(format!("device {spec:?}: expected cuda:N or emulated:N"));
    let (kind, index) = spec.split_once(':').unwrap_or((spec, "0"));
    let index: u32 = index.parse().map_err(|_| bad())?;
    match kind {
        "cuda" | "emulated" => Ok((kind, index)),
        _ => Err(bad()),
    }
}

/// Checks a device name's form (`cuda:N` or `emulated:N`) without opening the device: a
/// misspelt name is a mistake to refuse, where a device that cannot be opened (no GPU, a build
/// without CUDA) may be one to fall back from.
pub fn check_spec(spec: &str) -> Result<()> {
    parse(spec).map(drop)
}

/// Opens a device by name: `cuda:N` (feature `cuda`) or `emulated:N` (the test double).
pub fn open(spec: &str) -> Result<Arc<dyn DeviceMemory>> {
    let (kind, index) = parse(spec)?;
    match kind {
        "emulated" => Ok(Arc::new(EmulatedDevice::new(index))),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Arc::new(cuda::CudaDevice::open(index)?)),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(TransportError::Device(format!(
            "{spec}: this build has no CUDA support (build with `--features cuda`)"
        ))),
        _ => Err(TransportError::Config(format!("device {spec:?}: expected cuda:N or emulated:N"))),
    }
}

/// Copies `len` bytes of `region` at `offset` to `dst[dst_offset..]` on `dev`.
///
/// # Safety
/// No peer may write `region[offset..offset + len]` during the call (the region concurrency
/// contract): for a multicast target, the range's chunks are verified and never written again.
pub unsafe fn upload_region(
    dev: &dyn DeviceMemory,
    dst: &DeviceBuffer,
    dst_offset: u64,
    region: &Region,
    offset: u64,
    len: u64,
) -> Result<()> {
    region.check(offset, len)?;
    // SAFETY: bounds-checked above (`upload` checks the device side); the caller guarantees no
    // concurrent writer.
    let bytes = unsafe { region.slice(offset, len) };
    dev.upload(dst, dst_offset, bytes)
}

/// Reads `ranges` of `buf` back from the device and checks each against its crc32: the device
/// copy is what was verified on the host. Returns the index of the first range that differs.
/// (One call; [`ReadBack`] keeps its host buffer for many.)
pub fn verify_on_device(
    dev: &dyn DeviceMemory,
    buf: &DeviceBuffer,
    ranges: impl IntoIterator<Item = (std::ops::Range<u64>, u32)>,
) -> Result<std::result::Result<(), usize>> {
    ReadBack::new(dev, READ_BACK_PIECE)?.verify(dev, buf, ranges)
}

/// The host buffer [`verify_on_device`] reads back through, in pieces of at most this size.
const READ_BACK_PIECE: u64 = 8 << 20;

/// A host buffer for reading device memory back to check it, page-locked for the device where
/// the device pins ([`DeviceMemory::pin`]), so the reads go by DMA at the link's rate rather than
/// through the driver's bounce buffers; made once and reused. Ranges longer than the buffer are
/// read and checksummed in pieces.
pub struct ReadBack {
    region: Region,
    _pin: Option<PinGuard>,
}

impl std::fmt::Debug for ReadBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadBack").field("len", &self.region.len()).field("pinned", &self._pin.is_some()).finish()
    }
}

impl ReadBack {
    /// A buffer of `len` bytes (at least one page), pinned for `dev` where it pins.
    pub fn new(dev: &dyn DeviceMemory, len: u64) -> Result<ReadBack> {
        let region = Region::alloc(len.max(4096), Default::default())?;
        let pin = dev.pin(&region)?;
        Ok(ReadBack { region, _pin: pin })
    }

    /// Reads `ranges` of `buf` back from `dev` and checks each against its crc32; returns the
    /// index of the first range that differs.
    pub fn verify(
        &mut self,
        dev: &dyn DeviceMemory,
        buf: &DeviceBuffer,
        ranges: impl IntoIterator<Item = (std::ops::Range<u64>, u32)>,
    ) -> Result<std::result::Result<(), usize>> {
        let piece = self.region.len();
        // SAFETY: the region is this buffer's own, never registered with a peer nor handed out
        // (the pin guard only unregisters it), and `&mut self` makes this its one user.
        let scratch = unsafe { std::slice::from_raw_parts_mut(self.region.as_mut_ptr(), piece as usize) };
        for (i, (r, crc)) in ranges.into_iter().enumerate() {
            let mut h = crc32fast::Hasher::new();
            let mut at = r.start;
            while at < r.end {
                let n = (r.end - at).min(piece) as usize;
                dev.download(buf, at, &mut scratch[..n])?;
                h.update(&scratch[..n]);
                at += n as u64;
            }
            if h.finalize() != crc {
                return Ok(Err(i));
            }
        }
        Ok(Ok(()))
    }
}

/// **Test double**: "device" memory that is host memory, with the same interface and checks as
/// a real device, for testing what sits around a GPU where there is none.
#[derive(Debug)]
pub struct EmulatedDevice {
    index: u32,
}

impl EmulatedDevice {
    /// Emulated device `index`.
    pub fn new(index: u32) -> EmulatedDevice {
        EmulatedDevice { index }
    }
}

type EmuMem = Mutex<Vec<u8>>;

fn emu(b: &DeviceBuffer) -> Result<std::sync::MutexGuard<'_, Vec<u8>>> {
    Ok(b.inner::<EmuMem>("the emulated device")?.lock().unwrap_or_else(|e| e.into_inner()))
}

impl DeviceMemory for EmulatedDevice {
    fn describe(&self) -> String {
        format!("emulated:{} (host memory, a test double)", self.index)
    }
    fn alloc(&self, len: u64) -> Result<DeviceBuffer> {
        let n = usize::try_from(len).map_err(|_| TransportError::Device(format!("{len} bytes do not fit")))?;
        Ok(DeviceBuffer { len, inner: Box::new(EmuMem::new(vec![0; n])) })
    }
    fn upload_in_range(&self, dst: &DeviceBuffer, dst_offset: u64, src: &[u8]) -> Result<()> {
        let o = dst_offset as usize;
        emu(dst)?[o..o + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn download_in_range(&self, src: &DeviceBuffer, src_offset: u64, dst: &mut [u8]) -> Result<()> {
        let o = src_offset as usize;
        dst.copy_from_slice(&emu(src)?[o..o + dst.len()]);
        Ok(())
    }
    fn copy_in_range(
        &self,
        _src_device: &dyn DeviceMemory,
        src: &DeviceBuffer,
        src_offset: u64,
        dst: &DeviceBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        let (s, d) = (src_offset as usize, dst_offset as usize);
        let bytes = emu(src)?[s..s + len as usize].to_vec();
        emu(dst)?[d..d + len as usize].copy_from_slice(&bytes);
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(test)]
mod tests;
