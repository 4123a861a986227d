//! Frame I/O, a leaf of the transport: the halves of a byte stream that carry frames (and, on a
//! unix socket, file descriptors), what a link's writer sends, and the header of an answer. The
//! link engine (`stream`) and the one-sided engines (`shm`, `rdma`) build on it; it depends on
//! neither.

use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::link::Done;
use crate::region::Region;
use crate::wire::{Header, Opcode, Status};

/// Source half of a stream: an `AsyncRead` that may also carry file descriptors.
pub(crate) trait FrameSource: AsyncRead + Unpin + Send + 'static {
    /// A descriptor that arrived with the bytes read so far, if any.
    fn take_fd(&mut self) -> Option<OwnedFd>;
}

/// Sink half of a stream: an `AsyncWrite` that may also send file descriptors.
pub(crate) trait FrameSink: AsyncWrite + Unpin + Send + 'static {
    /// Writes `bytes` with `fd` attached.
    fn send_fd<'a>(
        &'a mut self,
        bytes: &'a [u8],
        fd: &'a OwnedFd,
    ) -> Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send + 'a>>;
}

/// The payload that follows a frame's header.
pub(crate) enum Payload {
    /// Nothing.
    None,
    /// Bytes of a region, sent straight from its memory.
    Region { region: Region, offset: u64, len: u64 },
    /// A message.
    Bytes(Bytes),
}

/// What a link's writer sends: a frame, or a header with a descriptor attached.
pub(crate) enum Out {
    /// A frame; `done` completes an operation once the frame is written.
    Frame { header: Header, payload: Payload, done: Option<(Done, u64)> },
    /// A header with a descriptor (SCM_RIGHTS; unix sockets only).
    WithFd { header: Header, fd: OwnedFd },
}

/// The header of an answer to `h`.
pub(crate) fn reply(h: &Header, op: Opcode, status: Status) -> Header {
    Header { req_id: h.req_id, region: h.region, offset: h.offset, status, ..Header::new(op) }
}
