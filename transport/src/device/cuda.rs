//! NVIDIA GPU memory through `cudarc`'s driver API (feature `cuda`). The CUDA driver library is
//! loaded when a device is first opened, so this builds and starts on machines without one;
//! [`CudaDevice::open`] then fails with a [`TransportError::Device`] saying why.
//!
//! A multicast target's staging region is page-locked for the device ([`DeviceMemory::pin`],
//! `cuMemHostRegister`, portable, cached — never write-combined, since the CPU reads it back for
//! crc checks), so its layers go to the device by DMA; other host memory is copied pageable (the
//! driver stages it). Every copy is synchronised before it returns.

use std::any::Any;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DriverError};

use super::{DeviceBuffer, DeviceMemory, PinGuard};
use crate::error::{Result, TransportError};
use crate::region::Region;

/// One GPU of this host.
pub struct CudaDevice {
    index: u32,
    name: String,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("index", &self.index).field("name", &self.name).finish()
    }
}

fn err(what: &str, e: DriverError) -> TransportError {
    TransportError::Device(format!("{what}: {e:?}"))
}

type Mem = Mutex<CudaSlice<u8>>;

fn mem(b: &DeviceBuffer) -> Result<std::sync::MutexGuard<'_, CudaSlice<u8>>> {
    Ok(b.inner::<Mem>("a CUDA device")?.lock().unwrap_or_else(|e| e.into_inner()))
}

impl CudaDevice {
    /// Opens GPU `index`: fails, saying why, when the CUDA driver library is missing, there is
    /// no such GPU, or the driver refuses.
    pub fn open(index: u32) -> Result<CudaDevice> {
        // SAFETY: only probes for the driver library (dlopen); loading it runs its initialisers,
        // which is what any CUDA program does.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(TransportError::Device(format!(
                "cuda:{index}: the CUDA driver library (libcuda.so) is not installed on this machine"
            )));
        }
        let count = CudaContext::device_count().map_err(|e| err("counting CUDA devices", e))?;
        if i64::from(index) >= i64::from(count) {
            return Err(TransportError::Device(format!("cuda:{index}: this machine has {count} CUDA device(s)")));
        }
        let ctx = CudaContext::new(index as usize).map_err(|e| err(&format!("opening cuda:{index}"), e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(CudaDevice { index, name, stream: ctx.default_stream() })
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| err("synchronising the stream", e))
    }
}

impl DeviceMemory for CudaDevice {
    fn describe(&self) -> String {
        format!("cuda:{} ({})", self.index, self.name)
    }

    fn alloc(&self, len: u64) -> Result<DeviceBuffer> {
        let n = usize::try_from(len).map_err(|_| TransportError::Device(format!("{len} bytes do not fit")))?;
        let s = self.stream.alloc_zeros::<u8>(n).map_err(|e| err(&format!("allocating {len} bytes"), e))?;
        self.sync()?;
        Ok(DeviceBuffer { len, inner: Box::new(Mem::new(s)) })
    }

    fn upload_in_range(&self, dst: &DeviceBuffer, dst_offset: u64, src: &[u8]) -> Result<()> {
        let o = dst_offset as usize;
        let mut d = mem(dst)?;
        let mut view = d.slice_mut(o..o + src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(|e| err("copying host to device", e))?;
        self.sync()
    }

    fn download_in_range(&self, src: &DeviceBuffer, src_offset: u64, dst: &mut [u8]) -> Result<()> {
        let o = src_offset as usize;
        let s = mem(src)?;
        let view = s.slice(o..o + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(|e| err("copying device to host", e))?;
        self.sync()
    }

    fn copy_in_range(
        &self,
        src_device: &dyn DeviceMemory,
        src: &DeviceBuffer,
        src_offset: u64,
        dst: &DeviceBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        let from = src_device
            .as_any()
            .downcast_ref::<CudaDevice>()
            .ok_or_else(|| TransportError::Device("a CUDA device copies only from CUDA devices".into()))?;
        let (s, d, n) = (src_offset as usize, dst_offset as usize, len as usize);
        if std::ptr::eq(src, dst) {
            return Err(TransportError::Device("a copy within one buffer is not supported".into()));
        }
        let sbuf = mem(src)?;
        let mut dbuf = mem(dst)?;
        let view = sbuf.slice(s..s + n);
        let mut out = dbuf.slice_mut(d..d + n);
        // Across two GPUs of one host cudarc issues a peer copy (NVLink or PCIe peer to peer).
        self.stream.memcpy_dtod(&view, &mut out).map_err(|e| err("copying device to device", e))?;
        from.sync()?;
        self.sync()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn pin(&self, region: &Region) -> Result<Option<PinGuard>> {
        let ctx = self.stream.context().clone();
        ctx.bind_to_thread().map_err(|e| err("binding the context", e))?;
        let (ptr, len) = (region.as_mut_ptr(), region.len() as usize);
        // SAFETY: `ptr` spans the region's `len` bytes, kept alive by the clone the guard holds
        // until it unregisters them. PORTABLE: pinned for every context; no DEVICEMAP or
        // write-combining flag, so the pages stay ordinary cached memory.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(TransportError::Device(format!("pinning a {len}-byte region: {r:?}")));
        }
        let held = region.clone();
        Ok(Some(PinGuard::new(move || {
            let _ = ctx.bind_to_thread();
            // SAFETY: the same pointer registered above, still alive (`held`), unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(held.as_mut_ptr().cast()) };
        })))
    }
}
