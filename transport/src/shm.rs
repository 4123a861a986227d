//! Same-host backend: a WRITE (or READ) is one `memcpy` into (or out of) the peer's shared mapping.
//!
//! Control runs over a unix socket with the framed protocol of [`crate::stream`]. The first access
//! to a peer region sends a lookup `{region, key}`; the owner checks the key and answers with the
//! region's memfd (SCM_RIGHTS), which the initiator maps; the rest of the protocol is the one of
//! [`crate::onesided`]. This module holds the engine ([`ShmEngine`], [`ShmLookups`]), the
//! descriptor passing and the mappings.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use memmap2::MmapRaw;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Result, TransportError};
use crate::frame::{reply, FrameSink, FrameSource, Out, Payload};
use crate::mesh::BoxFuture;
use crate::onesided::{LookupServer, Move, OneSidedEngine, PeerAccess};
use crate::region::{map_fd, Region};
use crate::wire::{EngineTag, Header, Opcode, Status};
use crate::NodeId;

/// The block of a copy that computes the crc32 of what it placed: small enough to be read back
/// from L2.
const CRC_BLOCK: usize = 64 << 10;

/// How much of a peer mapping [`ShmEngine::prepare`] populates at a time.
const PREPARE_SLICE: u64 = crate::region::POPULATE_SLICE as u64;

/// Copies at least this large run on the blocking pool, off the async workers.
const BLOCKING_COPY: u64 = 256 << 10;

/// shm's name in lookups.
pub(crate) const TAG: EngineTag = EngineTag(1);

/// The initiator's side of shm: maps the peer's memfd and copies through the mapping.
pub(crate) struct ShmEngine;

impl OneSidedEngine for ShmEngine {
    fn tag(&self) -> EngineTag {
        TAG
    }

    fn decode_answer(&self, peer: NodeId, h: &Header, fd: Option<OwnedFd>) -> Result<PeerAccess> {
        let fd = fd.ok_or_else(|| TransportError::Protocol {
            peer: Some(peer),
            detail: "shm lookup answer arrived without a descriptor".into(),
        })?;
        Ok(Arc::new(PeerMap::open(fd, h.len)?))
    }

    fn transfer<'a>(&'a self, access: &'a PeerAccess, m: Move<'a>) -> BoxFuture<'a, Result<Option<u32>>> {
        let Move { peer, write, local, local_offset, remote_offset, len, crc } = m;
        Box::pin(async move {
            let protocol = |detail: String| TransportError::Protocol { peer: Some(peer), detail };
            let map = access.clone().downcast::<PeerMap>().map_err(|_| protocol("not a shm mapping".into()))?;
            if remote_offset.checked_add(len).is_none_or(|end| end > map.len()) {
                let op = if write { "write" } else { "read" };
                return Err(TransportError::Refused { peer, op, status: Status::OutOfBounds });
            }
            let l = local.clone();
            let run = move || map.copy(write, &l, local_offset, remote_offset, len, crc && write);
            if len >= BLOCKING_COPY {
                tokio::task::spawn_blocking(run).await.map_err(|e| protocol(format!("copy task failed: {e}")))
            } else {
                Ok(run())
            }
        })
    }

    fn prepare<'a>(&'a self, access: &'a PeerAccess) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let map = access
                .clone()
                .downcast::<PeerMap>()
                .map_err(|_| TransportError::Protocol { peer: None, detail: "not a shm mapping".into() })?;
            // Slice by slice, as the owner's pre-faulting (`map_fd`): one populate of a whole
            // GiB would hold the process's memory-map lock throughout.
            let populate = move || {
                let mut at = 0;
                while at < map.len() {
                    let n = PREPARE_SLICE.min(map.len() - at);
                    map.populate(at, n);
                    at += n;
                }
            };
            tokio::task::spawn_blocking(populate)
                .await
                .map_err(|e| TransportError::Protocol { peer: None, detail: format!("populate task failed: {e}") })
        })
    }
}

/// The owner's side of shm: answers a lookup with the region's memfd.
pub(crate) struct ShmLookups;

impl LookupServer for ShmLookups {
    fn tag(&self) -> EngineTag {
        TAG
    }

    fn answer(&self, h: &Header, region: &Region) -> Out {
        let status = match region.shared_fd().map(|fd| fd.try_clone()) {
            Some(Ok(fd)) => {
                return Out::WithFd {
                    header: Header { len: region.len(), ..reply(h, Opcode::LookupResp, Status::Ok) },
                    fd,
                }
            }
            Some(Err(_)) => Status::Internal,
            None => Status::NotShareable,
        };
        Out::Frame { header: reply(h, Opcode::LookupResp, status), payload: Payload::None, done: None }
    }
}

/// A peer's shared region, mapped into this process.
///
/// The mapping is made without populating it (it is made on the link's reader, and a GiB takes
/// tens of milliseconds). A fresh mapping of the owner's pages would otherwise fault once per
/// 4 KiB page on the first write through it — a trap each, about 0.37 s per GiB on the
/// development machine, more than three times the copy itself. So a write first maps its
/// range with `MADV_POPULATE_READ`: the kernel walks the owner's resident pages and maps them
/// sixteen at a time (fault-around), writable, because shared memory needs no write
/// notification — 0.08 s per GiB, on the copying thread. `populated` remembers which 2 MiB
/// blocks are mapped so that later writes skip the walk.
pub(crate) struct PeerMap {
    map: MmapRaw,
    len: u64,
    populated: Box<[AtomicU64]>,
}

/// The granule of [`PeerMap`]'s record of populated blocks.
const POPULATE_BLOCK: u64 = 2 << 20;

// SAFETY: the mapping is plain shared memory owned by this value; access follows the region
// concurrency contract (the bytes are only touched by the operation that addresses them).
unsafe impl Send for PeerMap {}
// SAFETY: as above.
unsafe impl Sync for PeerMap {}

impl PeerMap {
    pub(crate) fn open(fd: OwnedFd, len: u64) -> Result<PeerMap> {
        let blocks = len.div_ceil(POPULATE_BLOCK).div_ceil(64) as usize;
        Ok(PeerMap { map: map_fd(&fd, len, false)?, len, populated: (0..blocks).map(|_| AtomicU64::new(0)).collect() })
    }

    /// Maps the pages of `[offset, offset + len)` that earlier writes have not mapped (see the
    /// type's docs). Blocks wholly inside the range are recorded as mapped; a partly covered
    /// block is populated again next time, which costs a page-table walk and no fault.
    fn populate(&self, offset: u64, len: u64) {
        let (first, end) = (offset / POPULATE_BLOCK, (offset + len).div_ceil(POPULATE_BLOCK));
        let bit = |b: u64| (&self.populated[(b / 64) as usize], 1u64 << (b % 64));
        if (first..end).all(|b| {
            let (w, m) = bit(b);
            w.load(Ordering::Relaxed) & m != 0
        }) {
            return;
        }
        let page = crate::region::page_size();
        let start = offset / page * page;
        let stop = ((offset + len).div_ceil(page) * page).min(self.len.div_ceil(page) * page);
        // SAFETY: `[start, stop)` lies inside the mapping (the caller bounds-checked the range
        // and the mapping's length is the region's, a whole number of pages). Populating maps
        // pages the owner already allocated and changes no contents. A kernel without
        // MADV_POPULATE_READ refuses it: the copy then faults the pages in as before.
        let r = unsafe {
            libc::madvise(
                self.map.as_mut_ptr().add(start as usize).cast(),
                (stop - start) as usize,
                libc::MADV_POPULATE_READ,
            )
        };
        if r != 0 {
            return;
        }
        for b in first..end {
            let whole = b * POPULATE_BLOCK >= offset && ((b + 1) * POPULATE_BLOCK).min(self.len) <= offset + len;
            if whole {
                let (w, m) = bit(b);
                w.fetch_or(m, Ordering::Relaxed);
            }
        }
    }

    /// The mapped region's length.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Copies `len` bytes between `local[local_offset..]` and this mapping at `remote_offset`
    /// (into the mapping when `write`). The caller has bounds-checked both ranges.
    ///
    /// With `crc` (a WRITE), the copy goes in [`CRC_BLOCK`]s and each block is read back from
    /// the mapping right after it was written, while it is still in cache, into a crc32 of the
    /// bytes as placed: one pass over memory instead of a copy and a second read of the whole
    /// range (measured: 0.21 s per GiB against 0.24 s on the development machine, and less
    /// memory traffic for the other copies running at the same time).
    pub(crate) fn copy(
        &self,
        write: bool,
        local: &Region,
        local_offset: u64,
        remote_offset: u64,
        len: u64,
        crc: bool,
    ) -> Option<u32> {
        debug_assert!(remote_offset + len <= self.len && local.check(local_offset, len).is_ok());
        let Ok(mine) = local.ptr_range(local_offset, len) else { return None };
        if write {
            self.populate(remote_offset, len);
        }
        if write && crc {
            let mut hasher = crc32fast::Hasher::new();
            let mut at = 0usize;
            while at < len as usize {
                let n = CRC_BLOCK.min(len as usize - at);
                // SAFETY: as below, for the block `[at, at + n)` of both ranges; the initiator
                // owns the peer's range for this operation, so nobody writes the block while it
                // is read back (the region concurrency contract).
                unsafe {
                    let peer = self.map.as_mut_ptr().add(remote_offset as usize + at);
                    std::ptr::copy(mine.add(at), peer, n);
                    hasher.update(std::slice::from_raw_parts(peer, n));
                }
                at += n;
            }
            return Some(hasher.finalize());
        }
        // SAFETY: both ranges were bounds-checked; `self` and `local` keep both mappings alive
        // for the call. No reference is made to either side: the peer may write its memory and
        // our region is open to other peers, so only raw pointers touch them (the region
        // concurrency contract makes the initiator own the two ranges for this operation).
        // `ptr::copy` tolerates the overlap of a region mapped twice (a node writing to itself).
        unsafe {
            let peer = self.map.as_mut_ptr().add(remote_offset as usize);
            if write {
                std::ptr::copy(mine, peer, len as usize);
            } else {
                std::ptr::copy(peer, mine, len as usize);
            }
        }
        None
    }
}

/// Read half of a unix stream that also collects descriptors passed with SCM_RIGHTS.
pub(crate) struct FdReader {
    inner: OwnedReadHalf,
    fds: Vec<OwnedFd>,
}

impl FdReader {
    pub(crate) fn new(inner: OwnedReadHalf) -> Self {
        FdReader { inner, fds: Vec::new() }
    }
}

/// `recvmsg` into `buf`, appending received descriptors to `fds`.
fn recv_with_fds(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    // Room for up to 8 descriptors, u64-aligned.
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg) as _;
    // SAFETY: `msg` points at live buffers (`buf`, `cmsg`) of the lengths it states.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `msg`'s control area; CMSG_* walk it within `msg_controllen`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    // Each received descriptor is new and owned by us alone.
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(n as usize)
}

impl AsyncRead for FdReader {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            ready!(this.inner.as_ref().poll_read_ready(cx))?;
            let raw = this.inner.as_ref().as_raw_fd();
            let dst = buf.initialize_unfilled();
            let fds = &mut this.fds;
            match this.inner.as_ref().try_io(Interest::READABLE, || recv_with_fds(raw, dst, fds)) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl FrameSource for FdReader {
    fn take_fd(&mut self) -> Option<OwnedFd> {
        (!self.fds.is_empty()).then(|| self.fds.remove(0))
    }
}

/// Write half of a unix stream that can pass descriptors.
pub(crate) struct FdWriter(pub(crate) OwnedWriteHalf);

fn send_with_fd(sock: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    let mut cmsg = [0u64; 4];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: the control buffer (32 bytes) holds one cmsghdr with one descriptor; `iov` points at
    // `bytes`, which outlives the call.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsyncWrite for FdWriter {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl FrameSink for FdWriter {
    fn send_fd<'a>(
        &'a mut self,
        bytes: &'a [u8],
        fd: &'a OwnedFd,
    ) -> Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send + 'a>> {
        Box::pin(async move {
            let sock = self.0.as_ref();
            let n = loop {
                sock.writable().await?;
                match sock.try_io(Interest::WRITABLE, || send_with_fd(sock.as_raw_fd(), bytes, fd.as_raw_fd())) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(e),
                }
            };
            // The descriptor travelled with the first byte; the rest (rarely any) follows plainly.
            self.0.write_all(&bytes[n..]).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::test_access as ta;

    fn bits(m: &PeerMap) -> Vec<bool> {
        let blocks = m.len.div_ceil(POPULATE_BLOCK);
        (0..blocks).map(|b| m.populated[(b / 64) as usize].load(Ordering::Relaxed) & (1 << (b % 64)) != 0).collect()
    }

    #[test]
    fn writes_populate_and_remember_whole_blocks_and_report_the_placed_crc() {
        let len = 3 * POPULATE_BLOCK + 8192;
        let owner = Region::shared(len).unwrap();
        let fd = owner.shared_fd().unwrap().try_clone().unwrap();
        let map = PeerMap::open(fd, len).unwrap();
        let src = Region::alloc(len, Default::default()).unwrap();
        ta::fill(&src, 0, len, 0x5a).unwrap();
        // Half a block: nothing recorded (the next write walks it again).
        assert_eq!(map.copy(true, &src, 0, 100, POPULATE_BLOCK / 2, false), None);
        assert_eq!(bits(&map), [false; 4]);
        // Blocks 1 and 2 whole, 3 (the short last one) whole up to the end of the mapping.
        let crc = map.copy(true, &src, 0, POPULATE_BLOCK, 2 * POPULATE_BLOCK + 8192, true);
        assert_eq!(bits(&map), [false, true, true, true]);
        assert_eq!(crc, Some(ta::crc32(&owner, POPULATE_BLOCK, 2 * POPULATE_BLOCK + 8192).unwrap()));
        assert!(ta::view(&owner, 100, POPULATE_BLOCK / 2).unwrap().iter().all(|&b| b == 0x5a));
        // A READ reports no crc.
        assert_eq!(map.copy(false, &src, 0, 0, 4096, true), None);
    }
}
