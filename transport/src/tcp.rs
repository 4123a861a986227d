//! TCP backend: the framed protocol of [`crate::stream`] over a socket.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::frame::{FrameSink, FrameSource};

impl FrameSource for OwnedReadHalf {
    fn take_fd(&mut self) -> Option<OwnedFd> {
        None
    }
}

impl FrameSink for OwnedWriteHalf {
    fn send_fd<'a>(
        &'a mut self,
        _bytes: &'a [u8],
        _fd: &'a OwnedFd,
    ) -> Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send + 'a>> {
        Box::pin(async { Err(io::Error::new(io::ErrorKind::Unsupported, "descriptors cannot cross a TCP link")) })
    }
}

/// Unsent bytes the kernel holds for a link before the writer waits: enough to keep a fast link
/// busy, small enough that a control frame the writer puts ahead of queued bulk data does not
/// then wait behind megabytes already in the socket (on a 100 Mbit/s link, 512 KiB is 42 ms).
const NOTSENT_LOWAT: libc::c_int = 512 << 10;

/// Socket settings for data links: no Nagle delay; a bounded unsent backlog.
pub(crate) fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let v = NOTSENT_LOWAT;
    // SAFETY: `s` owns a valid socket descriptor for the call; the option value is a c_int on
    // the stack whose size is passed with it.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
