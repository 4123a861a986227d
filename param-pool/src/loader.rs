//! The disk loader: reads a model file into a registered host region in the manifest's packed,
//! layer-major layout, with io_uring and several reads in flight.
//!
//! * **direct** (default): `O_DIRECT` reads of aligned blocks (4 MiB) bypass the page cache into
//!   page-aligned staging buffers, and the tensor pieces of each block are copied to their packed
//!   offsets as the block completes. (A safetensors header makes the tensor data start at an
//!   arbitrary file offset, so `O_DIRECT` — which needs aligned offsets, lengths and addresses —
//!   cannot land directly at packed offsets; the staging copy runs at memory speed, well above a
//!   disk's.)
//! * **buffered**: where `O_DIRECT` is refused (tmpfs, some overlay filesystems), or when asked,
//!   reads go through the page cache straight into the region at the packed offsets.
//!
//! With `verify`, every chunk's crc32 is checked against the manifest after the load.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cascade_transport::{Region, RegionOptions};
use io_uring::{opcode, types, IoUring};

use crate::manifest::Manifest;

const ALIGN: u64 = 4096;

/// How the file was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadMode {
    /// `O_DIRECT` through aligned staging buffers.
    Direct,
    /// Through the page cache, straight into the region.
    Buffered,
}

/// Settings of a load.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Reads in flight.
    pub queue_depth: u32,
    /// Bytes per read (a multiple of 4096).
    pub block: u64,
    /// Try `O_DIRECT` first (falls back to buffered when the filesystem refuses it).
    pub direct: bool,
    /// Check every chunk's crc32 against the manifest afterwards.
    pub verify: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { queue_depth: 8, block: 4 << 20, direct: true, verify: true }
    }
}

/// What a load did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LoadReport {
    /// Bytes of tensor data placed in the region.
    pub bytes: u64,
    /// Seconds reading (and placing) them.
    pub seconds: f64,
    /// Seconds verifying the chunk crcs (0 without `verify`).
    pub verify_seconds: f64,
    /// How the file was read.
    pub mode: LoadMode,
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// An I/O call failed.
    #[error("{context}: {error}")]
    Io {
        /// What was being done.
        context: String,
        /// The error. Part of the message, not a `source()`, so an error chain prints it once.
        error: io::Error,
    },
    /// The region cannot hold the model.
    #[error("region of {have} bytes cannot hold the {want}-byte model")]
    RegionTooSmall {
        /// Region length.
        have: u64,
        /// Bytes needed.
        want: u64,
    },
    /// The file is not the one the manifest describes.
    #[error("{path}: {what} (the file changed since its manifest was made?)")]
    Changed {
        /// The file.
        path: String,
        /// What differs.
        what: String,
    },
    /// Options out of range.
    #[error("invalid load options: {0}")]
    Options(&'static str),
    /// Placing bytes in the region failed (in the message, not a `source()`: a chain prints it once).
    #[error("writing the region: {0}")]
    Region(cascade_transport::TransportError),
}

impl From<cascade_transport::TransportError> for LoadError {
    fn from(e: cascade_transport::TransportError) -> Self {
        LoadError::Region(e)
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> LoadError {
    let context = context.into();
    move |error| LoadError::Io { context, error }
}

/// One tensor's bytes: where they are in the file and where they go in the region.
#[derive(Debug, Clone, Copy)]
struct Piece {
    file: u64,
    end: u64,
    dst: u64,
}

/// Loads `path` (described by `manifest`) into `region`. It returns only once no read is in
/// flight, on success and on every error.
///
/// # Safety
/// Nobody else may access `region[..manifest.bytes]` during the load (the kernel and this
/// function write it): load into a region before registering it, or one no peer can reach.
pub unsafe fn load(
    manifest: &Manifest,
    path: &Path,
    region: &Region,
    opts: LoadOptions,
) -> Result<LoadReport, LoadError> {
    // SAFETY: the caller's promise, passed on.
    unsafe { load_counting(manifest, path, region, opts, &LoadProgress::default()) }
}

/// How far a load is, readable from another thread while it runs: bytes of tensor data placed
/// in the region, then bytes whose crcs were verified.
#[derive(Debug, Default)]
pub struct LoadProgress {
    /// Bytes placed so far (`manifest.bytes` once every read is done).
    pub placed: AtomicU64,
    /// Bytes verified against the manifest's chunk crcs so far.
    pub verified: AtomicU64,
}

/// [`load`], counting its progress into `progress` as it goes.
///
/// # Safety
/// As for [`load`].
pub unsafe fn load_counting(
    manifest: &Manifest,
    path: &Path,
    region: &Region,
    opts: LoadOptions,
    progress: &LoadProgress,
) -> Result<LoadReport, LoadError> {
    if opts.queue_depth == 0 || opts.block == 0 || !opts.block.is_multiple_of(ALIGN) || opts.block > (1 << 30) {
        return Err(LoadError::Options("queue depth > 0 and block a multiple of 4096 up to 1 GiB"));
    }
    if region.len() < manifest.bytes {
        return Err(LoadError::RegionTooSmall { have: region.len(), want: manifest.bytes });
    }
    let shown = path.display().to_string();
    let len = std::fs::metadata(path).map_err(io_err(format!("stat {shown}")))?.len();
    if len != manifest.file_bytes {
        return Err(LoadError::Changed {
            path: shown,
            what: format!("{len} bytes, manifest says {}", manifest.file_bytes),
        });
    }
    let mut pieces: Vec<Piece> = manifest
        .layers
        .iter()
        .flat_map(|l| &l.tensors)
        .map(|t| Piece { file: t.file_range.start, end: t.file_range.end, dst: t.offset })
        .filter(|p| p.end > p.file)
        .collect();
    pieces.sort_by_key(|p| p.file);
    let started = Instant::now();
    let direct = if opts.direct {
        match crate::files::open_regular(path, libc::O_DIRECT) {
            Ok(f) => Some(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None, // filesystem refuses O_DIRECT
            Err(e) => return Err(io_err(format!("opening {shown}"))(e)),
        }
    } else {
        None
    };
    let mode = match direct {
        Some(f) => {
            // SAFETY: the caller keeps everyone else off the region.
            unsafe { load_direct(&f, &pieces, region, opts, &shown, &progress.placed)? };
            LoadMode::Direct
        }
        None => {
            let f = crate::files::open_regular(path, 0).map_err(io_err(format!("opening {shown}")))?;
            // SAFETY: as above.
            unsafe { load_buffered(&f, &pieces, region, opts, &shown, &progress.placed)? };
            LoadMode::Buffered
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let t = Instant::now();
    if opts.verify {
        for (i, want) in manifest.chunk_crcs.iter().enumerate() {
            let off = i as u64 * manifest.chunk;
            let n = manifest.chunk.min(manifest.bytes - off);
            // SAFETY: the reads completed (the rings are gone) and the caller keeps peers off.
            let got = unsafe { region.crc32(off, n)? };
            progress.verified.fetch_add(n, Ordering::Relaxed);
            if got != *want {
                return Err(LoadError::Changed {
                    path: shown,
                    what: format!("chunk {i} has crc32 {got:#010x}, manifest {want:#010x}"),
                });
            }
        }
    }
    Ok(LoadReport {
        bytes: manifest.bytes,
        seconds,
        verify_seconds: if opts.verify { t.elapsed().as_secs_f64() } else { 0.0 },
        mode,
    })
}

/// Copies the parts of `pieces` inside file range `[start, start+n)` from `buf` into the region;
/// returns how many bytes it placed.
///
/// # Safety
/// Nobody else may access the region's destination ranges meanwhile.
unsafe fn scatter(pieces: &[Piece], start: u64, buf: &[u8], region: &Region) -> Result<u64, LoadError> {
    let end = start + buf.len() as u64;
    let first = pieces.partition_point(|p| p.end <= start);
    let mut placed = 0;
    for p in pieces[first..].iter().take_while(|p| p.file < end) {
        let (a, b) = (p.file.max(start), p.end.min(end));
        // SAFETY: the caller keeps everyone else off the region.
        unsafe { region.write_local(p.dst + (a - p.file), &buf[(a - start) as usize..(b - start) as usize])? };
        placed += b - a;
    }
    Ok(placed)
}

thread_local! {
    /// Reads in flight in this thread's rings (a load runs on one thread; checked by the tests).
    static IN_FLIGHT: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
}

/// An io_uring whose reads keep their target regions alive and are always reaped: the ring never
/// goes away, and so no load returns, while the kernel may still write into a buffer.
struct Ring {
    ring: IoUring,
    /// The region each in-flight read writes into, by tag: held until its completion is reaped.
    targets: std::collections::HashMap<u64, Region>,
    /// Test hook: the n-th completion (counting from 0) reports EIO instead of its result.
    #[cfg(test)]
    fail_at: Option<u32>,
    #[cfg(test)]
    reaped: u32,
}

impl Ring {
    fn new(depth: u32) -> Result<Ring, LoadError> {
        Ok(Ring {
            ring: IoUring::new(depth.next_power_of_two()).map_err(io_err("creating an io_uring"))?,
            targets: std::collections::HashMap::new(),
            #[cfg(test)]
            fail_at: FAIL_AT.with(|f| f.get()),
            #[cfg(test)]
            reaped: 0,
        })
    }

    fn inflight(&self) -> usize {
        self.targets.len()
    }

    /// Queues a read of `len` bytes at file `offset` into `region[at..at+len]`; the ring holds
    /// the region until the read's completion is reaped.
    ///
    /// # Safety
    /// Nothing else may access `region[at..at+len]` until the completion is reaped (the kernel
    /// writes it meanwhile); `tag` must not be in flight already.
    unsafe fn read(
        &mut self,
        fd: i32,
        region: &Region,
        at: u64,
        len: u32,
        offset: u64,
        tag: u64,
    ) -> Result<(), LoadError> {
        let dst = region.ptr_range(at, u64::from(len))?;
        let e = opcode::Read::new(types::Fd(fd), dst, len).offset(offset).build().user_data(tag);
        // SAFETY: the range is bounds-checked and kept alive by the clone stored below until the
        // completion is reaped (by `reap` or by `Drop`); the caller keeps everyone else off it;
        // the ring has room because no more reads are queued than its depth.
        unsafe { self.ring.submission().push(&e) }.map_err(|_| LoadError::Io {
            context: "io_uring submission queue full".into(),
            error: io::ErrorKind::Other.into(),
        })?;
        debug_assert!(!self.targets.contains_key(&tag), "tag {tag} is in flight already");
        self.targets.insert(tag, region.clone());
        IN_FLIGHT.with(|n| n.set(n.get() + 1));
        Ok(())
    }

    /// Submits queued reads without waiting.
    fn submit(&mut self) -> Result<(), LoadError> {
        self.ring.submit().map(drop).map_err(io_err("io_uring submit"))
    }

    /// Submits and waits for at least one completion; returns (tag, result) pairs.
    fn reap(&mut self) -> Result<Vec<(u64, i32)>, LoadError> {
        self.ring.submit_and_wait(1).map_err(io_err("io_uring submit"))?;
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        let mut out = Vec::with_capacity(done.len());
        for (tag, res) in done {
            if self.targets.remove(&tag).is_some() {
                IN_FLIGHT.with(|n| n.set(n.get() - 1));
            }
            #[cfg(test)]
            let res = {
                self.reaped += 1;
                if self.fail_at == Some(self.reaped - 1) {
                    -libc::EIO
                } else {
                    res
                }
            };
            out.push((tag, res));
        }
        Ok(out)
    }
}

impl Drop for Ring {
    /// Waits for every read still in flight (an early return on an error leaves some), so that no
    /// buffer is released while the kernel writes into it.
    fn drop(&mut self) {
        while self.inflight() > 0 {
            if let Err(e) = self.reap() {
                // The ring cannot be waited on: keep the buffers (leak them) rather than free
                // memory the kernel may still write.
                tracing::error!(error = %e, reads = self.inflight(), "cannot reap io_uring reads; leaking their buffers");
                std::mem::forget(std::mem::take(&mut self.targets));
                return;
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Test hook for the rings this thread creates (see `Ring::fail_at`).
    static FAIL_AT: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// # Safety
/// As for [`load`].
unsafe fn load_direct(
    f: &File,
    pieces: &[Piece],
    region: &Region,
    opts: LoadOptions,
    path: &str,
    placed: &AtomicU64,
) -> Result<(), LoadError> {
    let (Some(first), Some(last)) = (pieces.first(), pieces.iter().map(|p| p.end).max()) else { return Ok(()) };
    // Blocks on block-size boundaries of the file, as a plain sequential reader issues them.
    let start = first.file / opts.block * opts.block;
    let blocks = (last - start).div_ceil(opts.block);
    let depth = opts.queue_depth.min(blocks as u32).max(1);
    // Page-aligned staging buffers (a Region is page-aligned memory, private to this load).
    let staging: Vec<Region> =
        (0..depth).map(|_| Region::alloc(opts.block, RegionOptions::default())).collect::<Result<_, _>>().map_err(
            |e| LoadError::Io { context: "allocating staging buffers".into(), error: io::Error::other(e.to_string()) },
        )?;
    let mut ring = Ring::new(depth)?;
    let fd = f.as_raw_fd();
    let mut next = 0u64;
    let mut done = 0u64;
    // Queues the next block into staging buffer `b`, if any block is left.
    let mut refill = |ring: &mut Ring, b: usize| -> Result<(), LoadError> {
        if next < blocks {
            let off = start + next * opts.block;
            // SAFETY: staging buffer `b` is private to this load and not touched again until its
            // completion is reaped.
            unsafe { ring.read(fd, &staging[b], 0, opts.block as u32, off, (next << 16) | b as u64)? };
            next += 1;
        }
        Ok(())
    };
    for b in 0..depth as usize {
        refill(&mut ring, b)?;
    }
    while done < blocks {
        for (tag, res) in ring.reap()? {
            let (block, b) = (tag >> 16, (tag & 0xffff) as usize);
            let off = start + block * opts.block;
            if res < 0 {
                return Err(LoadError::Io {
                    context: format!("O_DIRECT read of {path} at {off}"),
                    error: io::Error::from_raw_os_error(-res),
                });
            }
            let n = res as u64;
            if n < opts.block && off + n < last {
                return Err(LoadError::Changed { path: path.into(), what: format!("short read at {off} ({n} bytes)") });
            }
            // SAFETY: the kernel filled `n` bytes of staging buffer `b`, which is private to this
            // load; no read is in flight into it until `refill` below.
            let buf = unsafe { staging[b].view(0, n)? };
            // SAFETY: `load`'s caller keeps everyone else off the region.
            let now = unsafe { scatter(pieces, off, &buf, region)? };
            placed.fetch_add(now, Ordering::Relaxed);
            drop(buf);
            done += 1;
            // Keep the device busy: the buffer goes straight back into the ring.
            refill(&mut ring, b)?;
            ring.submit()?;
        }
    }
    Ok(())
}

/// # Safety
/// As for [`load`].
unsafe fn load_buffered(
    f: &File,
    pieces: &[Piece],
    region: &Region,
    opts: LoadOptions,
    path: &str,
    placed: &AtomicU64,
) -> Result<(), LoadError> {
    // Split every tensor into reads of at most one block, straight to its packed offset.
    let mut queue: std::collections::VecDeque<(u64, u64, u64)> = std::collections::VecDeque::new(); // (file, len, dst)
    for p in pieces {
        let mut at = p.file;
        while at < p.end {
            let n = (p.end - at).min(opts.block);
            queue.push_back((at, n, p.dst + (at - p.file)));
            at += n;
        }
    }
    let mut ring = Ring::new(opts.queue_depth)?;
    let fd = f.as_raw_fd();
    // Reads in flight, by tag (slot index).
    let mut slots: Vec<Option<(u64, u64, u64)>> = vec![None; opts.queue_depth as usize];
    while !queue.is_empty() || ring.inflight() > 0 {
        while let Some(slot) = slots.iter().position(Option::is_none) {
            let Some((off, n, dst)) = queue.pop_front() else { break };
            // SAFETY: reads in flight cover disjoint ranges of the region, and `load`'s caller
            // keeps everyone else off it.
            unsafe { ring.read(fd, region, dst, n as u32, off, slot as u64)? };
            slots[slot] = Some((off, n, dst));
        }
        for (tag, res) in ring.reap()? {
            let Some((off, n, dst)) = slots.get_mut(tag as usize).and_then(Option::take) else { continue };
            if res < 0 {
                return Err(LoadError::Io {
                    context: format!("reading {path} at {off}"),
                    error: io::Error::from_raw_os_error(-res),
                });
            }
            let got = res as u64;
            if got == 0 {
                return Err(LoadError::Changed { path: path.into(), what: format!("unexpected end of file at {off}") });
            }
            if got < n {
                queue.push_front((off + got, n - got, dst + got)); // short read: the rest again
            }
            placed.fetch_add(got.min(n), Ordering::Relaxed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
