//! TCP backend: the framed protocol of [`crate::stream`] over a socket.

use std::io;
use std::os::fd::OwnedFd;
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

/// Socket settings for data links: no Nagle delay.
pub(crate) fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)
}
