//! Registered memory regions.
//!
//! A [`Region`] is a fixed-size, page-aligned block of memory that remote peers may READ and WRITE
//! one-sidedly once it is registered in a [`RegionTable`]. Two kinds of backing exist:
//!
//! * **host** memory: an aligned heap allocation, optionally `mlock`ed so it never pages out;
//! * **shared** memory: a `memfd` mapped with `MAP_SHARED`, which same-host peers map as well so that a
//!   WRITE is a single `memcpy` (see the `shm` backend).
//!
//! # Concurrency contract
//! As with RDMA-registered memory, the bytes of a region change underneath the process when peers
//! write into it. The transport guarantees that a range is fully written when the operation that
//! fills it completes (the initiator's completion, or a message the writer sends after that
//! completion; a message posted before it may overtake the data).
//! Reading a range while a peer is still writing it gives unspecified bytes, and coordinating that
//! is the application's job — exactly the rule of one-sided RDMA.

use std::alloc::Layout;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Result, TransportError};
use crate::wire::Status;
use crate::NodeId;

/// Page size regions are aligned to.
pub const PAGE: usize = 4096;

/// The system's page size (4 KiB where it cannot be read).
pub(crate) fn page_size() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    })
}

/// Identifies a region within one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The secret a peer must present to access a region (random per region, like an RDMA rkey).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteKey(pub u64);

/// Everything a peer needs to address a region of another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Node that owns the region.
    pub node: NodeId,
    /// Region id on that node.
    pub id: RegionId,
    /// Access key.
    pub key: RemoteKey,
    /// Length in bytes.
    pub len: u64,
}

/// Options for allocating a host region.
#[derive(Debug, Clone, Copy, Default)]
pub struct RegionOptions {
    /// Lock the pages in RAM (`mlock`). Fails with a clear error when the memlock limit is too low.
    pub mlock: bool,
}

static NEXT_REGION: AtomicU32 = AtomicU32::new(1);

enum Backing {
    Host {
        ptr: NonNull<u8>,
        layout: Layout,
        locked: bool,
    },
    Shared {
        map: MmapRaw,
        fd: OwnedFd,
    },
    /// Memory the application owns and lent to the region (the C ABI's registration): never
    /// freed here.
    Borrowed {
        ptr: NonNull<u8>,
    },
}

struct Inner {
    id: RegionId,
    key: RemoteKey,
    len: u64,
    backing: Backing,
    /// The budget bytes this region holds, given back when it is freed.
    _reserved: Option<crate::budget::Reservation>,
}

// SAFETY: the backing memory is owned by `Inner` for its whole life and only ever accessed through
// raw pointers under the crate's documented DMA-style contract; no thread-affine state is held.
unsafe impl Send for Inner {}
// SAFETY: as above; `Inner` hands out no `&mut` to its memory from `&self` except through the
// bounds-checked raw accessors whose callers uphold the region concurrency contract.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Backing::Host { ptr, layout, locked } = &self.backing {
            if *locked {
                // SAFETY: `ptr` spans `layout.size()` bytes that we locked at allocation.
                unsafe { libc::munlock(ptr.as_ptr().cast(), layout.size()) };
            }
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is freed exactly once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

/// A registered memory region. Cloning is cheap and shares the memory.
#[derive(Clone)]
pub struct Region(Arc<Inner>);

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.0.id)
            .field("len", &self.0.len)
            .field("shared", &self.is_shared())
            .finish()
    }
}

fn random_key() -> Result<RemoteKey> {
    let mut b = [0u8; 8];
    // Without the OS RNG a key would be guessable: refuse to make the region.
    getrandom::fill(&mut b)
        .map_err(|e| TransportError::io("drawing a region key", std::io::Error::other(e.to_string())))?;
    Ok(RemoteKey(u64::from_le_bytes(b)))
}

impl Region {
    /// Allocates a zeroed, page-aligned host region of `len` bytes.
    pub fn alloc(len: u64, opts: RegionOptions) -> Result<Region> {
        if len == 0 {
            return Err(TransportError::Config("a region must not be empty".into()));
        }
        let size =
            usize::try_from(len).map_err(|_| TransportError::Config(format!("region of {len} bytes does not fit")))?;
        let layout = Layout::from_size_align(size, PAGE)
            .map_err(|e| TransportError::Config(format!("region of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            TransportError::io(
                format!("allocating a {len}-byte region"),
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            )
        })?;
        let mut locked = false;
        if opts.mlock {
            // SAFETY: `ptr` spans `size` bytes we own.
            if unsafe { libc::mlock(ptr.as_ptr().cast(), size) } != 0 {
                let err = std::io::Error::last_os_error();
                // SAFETY: allocated above with the same layout, not yet shared.
                unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
                return Err(TransportError::io(format!("mlock of a {len}-byte region (raise `ulimit -l`)"), err));
            }
            locked = true;
        }
        Self::wrap(len, Backing::Host { ptr, layout, locked })
    }

    /// A region over `len` bytes at `ptr` that the caller owns (a serving stack registering its
    /// own buffer). The region never frees them; peers reach them through the framed protocol
    /// (they cannot be mapped by same-host peers).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, and stay so — not freed, not
    /// unmapped, not reused for anything else — until every clone of the returned region is
    /// dropped *and* no operation that names it is still in flight (the DMA-lifetime rule of
    /// RDMA registration). Its bytes change underneath the caller when peers write them, as
    /// the region concurrency contract above says.
    pub unsafe fn from_raw(ptr: *mut u8, len: u64) -> Result<Region> {
        if len == 0 {
            return Err(TransportError::Config("a region must not be empty".into()));
        }
        let ptr =
            NonNull::new(ptr).ok_or_else(|| TransportError::Config("a region's memory must not be null".into()))?;
        if usize::try_from(len).is_err() || (ptr.as_ptr() as usize).checked_add(len as usize).is_none() {
            return Err(TransportError::Config(format!("{len} bytes at {ptr:p} wrap the address space")));
        }
        Self::wrap(len, Backing::Borrowed { ptr })
    }

    /// Allocates a zeroed region (memfd-shared when `shared`) against `budget`: refused before
    /// anything is allocated when it does not fit.
    pub fn alloc_within(len: u64, shared: bool, budget: &crate::budget::MemoryBudget) -> Result<Region> {
        Self::alloc_within_prefault(len, shared, budget, Prefault::Now)
    }

    /// As [`Region::alloc_within`], with a choice of when a shared region's pages are allocated
    /// (a host region's are allocated at once either way).
    pub fn alloc_within_prefault(
        len: u64,
        shared: bool,
        budget: &crate::budget::MemoryBudget,
        prefault: Prefault,
    ) -> Result<Region> {
        let reservation = budget.reserve(len)?;
        let mut r = if shared { Region::shared_unfaulted(len)? } else { Region::alloc(len, RegionOptions::default())? };
        match Arc::get_mut(&mut r.0) {
            Some(inner) => inner._reserved = Some(reservation),
            None => unreachable!("a region just made has one owner"),
        }
        r.prefault(prefault)?;
        Ok(r)
    }

    /// Allocates a zeroed region backed by a `memfd`, mappable by same-host peers; its pages are
    /// allocated (pre-faulted) before it is returned.
    pub fn shared(len: u64) -> Result<Region> {
        Self::shared_prefault(len, Prefault::Now)
    }

    /// As [`Region::shared`], with a choice of when the pages are allocated.
    pub fn shared_prefault(len: u64, prefault: Prefault) -> Result<Region> {
        let r = Self::shared_unfaulted(len)?;
        r.prefault(prefault)?;
        Ok(r)
    }

    /// A shared region whose pages are not allocated yet.
    fn shared_unfaulted(len: u64) -> Result<Region> {
        if len == 0 {
            return Err(TransportError::Config("a region must not be empty".into()));
        }
        let name = c"cascade-region";
        // SAFETY: `name` is a valid NUL-terminated string.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(TransportError::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let map = map_fd(&fd, len, true)?;
        Self::wrap(len, Backing::Shared { map, fd })
    }

    /// Allocates the pages of a shared region as `prefault` says (nothing to do for host memory).
    fn prefault(&self, prefault: Prefault) -> Result<()> {
        if !matches!(self.0.backing, Backing::Shared { .. }) {
            return Ok(());
        }
        match prefault {
            Prefault::Now => self.prefault_range(0, self.0.len),
            Prefault::Background => {
                let (weak, len) = (Arc::downgrade(&self.0), self.0.len);
                std::thread::Builder::new()
                    .name("cascade-prefault".into())
                    .spawn(move || prefault_backwards(&weak, len))
                    .map_err(|e| TransportError::io("starting a pre-fault thread", e))?;
            }
        }
        Ok(())
    }

    /// Faults the pages of `[offset, offset + len)` in (see [`map_fd`] for why by slices).
    fn prefault_range(&self, offset: u64, len: u64) {
        let Backing::Shared { map, .. } = &self.0.backing else { return };
        // madvise refuses a start inside a page (EINVAL): a range that starts inside one starts
        // at that page.
        let page = page_size() as usize;
        let mut at = offset as usize / page * page;
        let end = (offset + len) as usize;
        while at < end {
            let n = POPULATE_SLICE.min(end - at);
            // SAFETY: the range lies inside the mapping (`offset + len ≤ self.len`, callers'
            // contract; `at` only moved down to its page's start); populating only faults its
            // pages in — zero-filled if new, untouched if present — and changes no contents, so
            // it may run while peers write the region.
            // A kernel without MADV_POPULATE_WRITE refuses it: the pages then fault on first use.
            let r = unsafe { libc::madvise(map.as_mut_ptr().add(at).cast(), n, libc::MADV_POPULATE_WRITE) };
            if r != 0 {
                break;
            }
            at += n;
        }
    }

    /// Faults the pages of `[offset, offset + len)` in by reading a byte of each through the
    /// mapping: a page fault takes only its area's lock, not the process's memory-map lock that
    /// `madvise` holds for a whole slice, so the process's allocations never wait behind it.
    /// The bytes are read atomically and discarded: peers may be writing them.
    fn touch_range(&self, offset: u64, len: u64) {
        let Backing::Shared { map, .. } = &self.0.backing else { return };
        let page = page_size() as usize;
        let mut at = offset as usize / page * page;
        let end = (offset + len) as usize;
        while at < end {
            // SAFETY: `at` lies inside the mapping (`offset + len ≤ self.len`, callers'
            // contract; moved down only to its page's start), which lives as long as `self`; a
            // byte has no alignment requirement. The byte may be written meanwhile — by peers
            // through their own mappings, as the region concurrency contract allows — so it is
            // read atomically, changes nothing, and its value is discarded.
            let b = unsafe { std::sync::atomic::AtomicU8::from_ptr(map.as_mut_ptr().add(at)) };
            std::hint::black_box(b.load(Ordering::Relaxed));
            at += page;
        }
    }

    fn wrap(len: u64, backing: Backing) -> Result<Region> {
        // On error `backing` drops here and frees the memory.
        let key = random_key()?;
        let id = RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed));
        Ok(Region(Arc::new(Inner { id, key, len, backing, _reserved: None })))
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.0.id
    }

    /// The key peers must present.
    pub fn key(&self) -> RemoteKey {
        self.0.key
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Always false: regions are never empty. Present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// True when this handle is the region's only one: no operation in flight, no peer access
    /// and no view holds it (what must be true before lent memory may be given back).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }

    /// True for memfd-backed regions that same-host peers can map.
    pub fn is_shared(&self) -> bool {
        matches!(self.0.backing, Backing::Shared { .. })
    }

    /// True when the pages are locked in RAM.
    pub fn is_locked(&self) -> bool {
        matches!(self.0.backing, Backing::Host { locked: true, .. })
    }

    /// The descriptor a peer needs to address this region on `node`.
    pub fn remote(&self, node: NodeId) -> RemoteRegion {
        RemoteRegion { node, id: self.0.id, key: self.0.key, len: self.0.len }
    }

    pub(crate) fn shared_fd(&self) -> Option<&OwnedFd> {
        match &self.0.backing {
            Backing::Shared { fd, .. } => Some(fd),
            Backing::Host { .. } | Backing::Borrowed { .. } => None,
        }
    }

    /// The address of the region's first byte, for handing the memory to the kernel or a device
    /// (e.g. an io_uring read). Writing through it is `unsafe` for the caller and falls under the
    /// region concurrency contract; the pointer is valid while any clone of the region lives.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.base()
    }

    fn base(&self) -> *mut u8 {
        match &self.0.backing {
            Backing::Host { ptr, .. } | Backing::Borrowed { ptr } => ptr.as_ptr(),
            Backing::Shared { map, .. } => map.as_mut_ptr(),
        }
    }

    /// Checks that `[offset, offset+len)` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok(()),
            _ => Err(TransportError::OutOfBounds { region: self.0.id.0, offset, len, region_len: self.0.len }),
        }
    }

    /// A raw pointer to `[offset, offset+len)` after a bounds check, for copies that must not
    /// create references into memory peers may write (`ptr::copy_nonoverlapping`, a kernel or
    /// device transfer). Dereferencing it follows the region concurrency contract.
    pub fn ptr_range(&self, offset: u64, len: u64) -> Result<*mut u8> {
        self.check(offset, len)?;
        // SAFETY: `offset` is within the allocation (checked above), so the add stays in bounds.
        Ok(unsafe { self.base().add(offset as usize) })
    }

    /// Copies `data` into the region at `offset` (bounds-checked).
    ///
    /// # Safety
    /// No peer may access `[offset, offset+len)` while it is written: the region is not
    /// registered yet, or every operation that could touch the range has completed and the
    /// application grants no new one (the region concurrency contract). `data` must not be a
    /// view of the same range.
    pub unsafe fn write_local(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.ptr_range(offset, data.len() as u64)?;
        // SAFETY: bounds-checked; the caller guarantees nobody else accesses the range and that
        // `data` does not overlap it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Fills `[offset, offset+len)` with `byte`.
    ///
    /// # Safety
    /// As for [`write_local`](Self::write_local).
    pub unsafe fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<()> {
        let dst = self.ptr_range(offset, len)?;
        // SAFETY: bounds-checked; the caller guarantees nobody else accesses the range.
        unsafe { std::ptr::write_bytes(dst, byte, len as usize) };
        Ok(())
    }

    /// Copies `[offset, offset+len)` of this region to `dst[dst_offset..]` (a same-node transfer,
    /// a stand-in for a device copy), through raw pointers only.
    ///
    /// # Safety
    /// The caller owns both ranges for the copy under the region concurrency contract: no peer
    /// writes the source range, and no one else accesses the destination range.
    pub unsafe fn copy_to(&self, offset: u64, dst: &Region, dst_offset: u64, len: u64) -> Result<()> {
        let s = self.ptr_range(offset, len)?;
        let d = dst.ptr_range(dst_offset, len)?;
        // SAFETY: bounds-checked; both regions live for the call; the caller owns both ranges;
        // `ptr::copy` tolerates overlap within one region.
        unsafe { std::ptr::copy(s, d, len as usize) };
        Ok(())
    }

    /// A zero-copy view of `[offset, offset+len)`; it keeps the region alive.
    ///
    /// # Safety
    /// No peer may write the range while the view (or any clone of the `Bytes`) lives: every
    /// operation that could write it has completed and the application grants no new one.
    pub unsafe fn view(&self, offset: u64, len: u64) -> Result<Bytes> {
        self.check(offset, len)?;
        Ok(Bytes::from_owner(View { region: self.clone(), offset: offset as usize, len: len as usize }))
    }

    /// crc32 of `[offset, offset+len)`.
    ///
    /// # Safety
    /// No peer may write the range during the call (the region concurrency contract): every
    /// operation that could write it has completed, as the initiator's completion or a message
    /// the writer sends afterwards tells.
    pub unsafe fn crc32(&self, offset: u64, len: u64) -> Result<u32> {
        self.check(offset, len)?;
        // SAFETY: bounds-checked; the caller guarantees the absence of concurrent writers.
        Ok(crc32fast::hash(unsafe { self.slice(offset, len) }))
    }

    /// The raw bytes of a range.
    ///
    /// # Safety
    /// The range must be in bounds and no peer may be writing it for the lifetime of the slice
    /// (the region concurrency contract).
    pub(crate) unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        debug_assert!(self.check(offset, len).is_ok());
        // SAFETY: the caller guarantees bounds and the absence of concurrent writers.
        unsafe { std::slice::from_raw_parts(self.base().add(offset as usize), len as usize) }
    }

    /// The raw bytes of a range, for the transport to land incoming data from a socket in.
    ///
    /// # Safety
    /// The range must be in bounds and nothing else may access it for the lifetime of the slice:
    /// the transport only lands bytes of an operation the owner has exposed to that one peer.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        debug_assert!(self.check(offset, len).is_ok());
        // SAFETY: the caller guarantees bounds and exclusive access for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.base().add(offset as usize), len as usize) }
    }
}

struct View {
    region: Region,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: bounds were checked when the view was made; the region is kept alive by `self`;
        // whoever made the view (an `unsafe` call) guaranteed that no peer writes the range.
        unsafe { self.region.slice(self.offset as u64, self.len as u64) }
    }
}

/// Safe access to regions **for tests**, which touch a region only between its transfers (feature
/// `test-access`; never for product code, which states its own `# Safety` argument at each use).
#[cfg(any(test, feature = "test-access"))]
pub mod test_access {
    use bytes::Bytes;

    use super::Region;
    use crate::error::Result;

    /// [`Region::crc32`] for tests.
    pub fn crc32(r: &Region, offset: u64, len: u64) -> Result<u32> {
        // SAFETY: tests read a region only after awaiting the transfers that write it.
        unsafe { r.crc32(offset, len) }
    }

    /// [`Region::view`] for tests.
    pub fn view(r: &Region, offset: u64, len: u64) -> Result<Bytes> {
        // SAFETY: as above; the views are dropped before the next transfer.
        unsafe { r.view(offset, len) }
    }

    /// [`Region::write_local`] for tests.
    pub fn write_local(r: &Region, offset: u64, data: &[u8]) -> Result<()> {
        // SAFETY: tests write a region only before they start the transfers that read it.
        unsafe { r.write_local(offset, data) }
    }

    /// [`Region::fill`] for tests.
    pub fn fill(r: &Region, offset: u64, len: u64, byte: u8) -> Result<()> {
        // SAFETY: as above.
        unsafe { r.fill(offset, len, byte) }
    }
}

/// When a shared region's pages are allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefault {
    /// Before the region is returned: nothing faults when it is first written.
    #[default]
    Now,
    /// On a background thread, from the last page to the first, while the region is already in
    /// use: a transfer filling it from the front starts at once and meets the pre-faulting in
    /// the middle (the pages it reaches first it faults in itself). The thread stops early when
    /// the region is freed.
    Background,
}

/// The slice a populate (`madvise(MADV_POPULATE_*)`) covers at a time, here and on a peer's
/// shm mapping: short enough that the process's memory-map lock is never held for long.
pub(crate) const POPULATE_SLICE: usize = 32 << 20;

/// The slice [`Prefault::Background`]'s thread faults in between its checks that the region
/// still lives (its pages are touched one by one, [`Region::touch_range`]).
const BACKGROUND_SLICE: usize = 2 << 20;

/// [`Prefault::Background`]'s thread: slices from the end, while the region lives. It runs at
/// the default priority: at nice 19 the pages came too late for the transfer filling the
/// region, which then faulted them itself (`cascade demo`'s scale-out 0.33–0.36 s against
/// 0.30–0.33 s, 2026-11-28).
///
/// Each page is faulted in by a read of its first byte ([`Region::touch_range`]), not by
/// `madvise(MADV_POPULATE_WRITE)`: that holds the process's memory-map lock for the whole
/// slice, and a thread descheduled in the middle of one made the process's own allocations wait:
/// with 32 MiB slices `cascade demo`'s targets took 25–40 ms to answer `Start`, and with 2 MiB
/// (once the slices' starts were aligned and the thread worked at all, 2026-12-05) six such
/// threads on two cores still delayed the scale-out's start from 5–16 ms to 19–73 ms. (`fallocate` on the memfd was tried:
/// shared memory allocates such pages without clearing them, and the first write through a
/// mapping still clears each.)
fn prefault_backwards(region: &std::sync::Weak<Inner>, len: u64) {
    let mut end = len;
    while end > 0 {
        let Some(inner) = region.upgrade() else { return };
        let start = end.saturating_sub(BACKGROUND_SLICE as u64);
        Region(inner).touch_range(start, end - start);
        end = start;
    }
}

/// Maps `len` bytes of `fd` shared (read-write).
///
/// The mapping is not populated here: the owner's region pre-faults it (see [`Prefault`]) and a
/// peer's mapping populates what it writes (`shm::PeerMap`).
///
/// Pre-faulting goes slice by slice (`MADV_POPULATE_WRITE`, 32 MiB at a time) rather than with
/// `MAP_POPULATE`: one populate of a whole GiB holds the process's memory-map lock for its
/// whole duration, and every thread that maps memory meanwhile (an allocation, a message
/// buffer) waits — on a loaded host long enough for the node's links to miss their keepalives.
pub(crate) fn map_fd(fd: &OwnedFd, len: u64, resize: bool) -> Result<MmapRaw> {
    let file = File::from(fd.try_clone().map_err(|e| TransportError::io("dup of memfd", e))?);
    if resize {
        file.set_len(len).map_err(|e| TransportError::io(format!("sizing a {len}-byte memfd"), e))?;
    }
    let actual = file.metadata().map_err(|e| TransportError::io("fstat of memfd", e))?.len();
    if actual < len {
        return Err(TransportError::Protocol {
            peer: None,
            detail: format!("shared region is {actual} bytes, {len} announced"),
        });
    }
    let map = MmapOptions::new()
        .len(len as usize)
        .map_raw(file.as_raw_fd())
        .map_err(|e| TransportError::io(format!("mmap of a {len}-byte shared region"), e))?;
    Ok(map)
}

/// The node's table of regions that peers may access, checked on every remote operation.
#[derive(Clone)]
pub struct RegionTable {
    map: Arc<RwLock<HashMap<RegionId, Region>>>,
    /// Ids of withdrawn regions, for the links that tell peers to drop their mappings.
    withdrawn: tokio::sync::broadcast::Sender<RegionId>,
}

impl Default for RegionTable {
    fn default() -> Self {
        RegionTable { map: Arc::default(), withdrawn: tokio::sync::broadcast::channel(1024).0 }
    }
}

impl RegionTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Exposes `region` to peers.
    pub fn register(&self, region: &Region) {
        self.write_map().insert(region.id(), region.clone());
    }

    /// Withdraws a region; later remote accesses are refused with `UnknownRegion`.
    pub fn deregister(&self, id: RegionId) -> Option<Region> {
        let r = self.write_map().remove(&id);
        if r.is_some() {
            let _ = self.withdrawn.send(id);
        }
        r
    }

    /// Ids of regions withdrawn from now on.
    pub(crate) fn withdrawn(&self) -> tokio::sync::broadcast::Receiver<RegionId> {
        self.withdrawn.subscribe()
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.read_map().len()
    }

    /// True when no region is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Looks up a region by id (no key check: local use).
    pub fn get(&self, id: RegionId) -> Option<Region> {
        self.read_map().get(&id).cloned()
    }

    /// The check every remote access passes: region known, key right, range inside.
    pub fn access(&self, id: RegionId, key: RemoteKey, offset: u64, len: u64) -> Result<Region, Status> {
        let region = self.get(id).ok_or(Status::UnknownRegion)?;
        if region.key() != key {
            return Err(Status::BadKey);
        }
        region.check(offset, len).map_err(|_| Status::OutOfBounds)?;
        Ok(region)
    }

    fn read_map(&self) -> std::sync::RwLockReadGuard<'_, HashMap<RegionId, Region>> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_map(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<RegionId, Region>> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests;
