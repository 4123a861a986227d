//! The reader task of a stream link: decodes frames and executes the steps the link machine
//! decides on, landing payloads straight into registered regions.

use std::io;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncReadExt;

use super::machine::{self, Step};
use super::{FrameSource, Out, Payload, Shared, Timing, CHUNK};
use crate::error::{Result, TransportError};
use crate::onesided::OneSided;
use crate::region::Region;
use crate::service::Services;
use crate::wire::{Header, Opcode, HEADER_LEN};

/// Reads `len` bytes into `region[offset..]`, in chunks, returning the crc32 when asked.
async fn land<R: FrameSource>(
    s: &Shared,
    r: &mut R,
    region: &Region,
    offset: u64,
    len: u64,
    crc: bool,
) -> io::Result<Option<u32>> {
    // SAFETY: the caller bounds-checked the range against `region`, which outlives this call; the
    // bytes belong to an operation the owner exposed to the peer (region contract).
    let dst = unsafe { region.slice_mut(offset, len) };
    let mut hasher = crc.then(crc32fast::Hasher::new);
    let mut pos = 0;
    while pos < dst.len() {
        let end = (pos + CHUNK).min(dst.len());
        let n = r.read(&mut dst[pos..end]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(h) = hasher.as_mut() {
            h.update(&dst[pos..pos + n]);
        }
        pos += n;
        s.touch_rx();
    }
    s.stats.rx(len);
    Ok(hasher.map(|h| h.finalize()))
}

/// Reads and discards `len` bytes (the payload of a refused WRITE), keeping the stream in step.
async fn drain<R: FrameSource>(s: &Shared, r: &mut R, mut len: u64) -> io::Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    while len > 0 {
        let want = len.min(scratch.len() as u64) as usize;
        let n = r.read(&mut scratch[..want]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        len -= n as u64;
        s.touch_rx();
    }
    Ok(())
}

/// Reads frames and executes the steps the link machine ([`machine`]) decides on, until the
/// link fails (`Err`) or the peer says goodbye (`Ok` with its reason).
pub(super) async fn read_loop<R: FrameSource>(
    s: &Arc<Shared>,
    mut r: R,
    services: &Services,
    one_sided: Option<&OneSided>,
    timing: Timing,
) -> Result<Option<String>> {
    let peer = s.peer;
    let io_err = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            TransportError::PeerDown { peer, reason: "connection closed by peer".into() }
        } else {
            TransportError::io(format!("receiving from node {peer}"), e)
        }
    };
    let mut hb = [0u8; HEADER_LEN];
    loop {
        r.read_exact(&mut hb).await.map_err(io_err)?;
        s.touch_rx();
        let h = Header::decode(&hb).map_err(|error| TransportError::Frame { peer: Some(peer), error })?;
        let mut step = machine::on_header(&**s, h);
        loop {
            step = match step {
                Step::Nothing => break,
                Step::Send(out) => {
                    s.send(out);
                    break;
                }
                Step::Land { region, offset, len, crc, then } => {
                    let got = land(s, &mut r, &region, offset, len, crc).await.map_err(io_err)?;
                    machine::on_landed(&**s, then, got)
                }
                Step::Drain { len, ack } => {
                    drain(s, &mut r, len).await.map_err(io_err)?;
                    Step::Send(Out::Frame { header: ack, payload: Payload::None, done: None })
                }
                Step::Message { len } => {
                    let mut buf = BytesMut::zeroed(len as usize);
                    r.read_exact(&mut buf).await.map_err(io_err)?;
                    s.touch_rx();
                    s.stats.rx(len);
                    match deliver(s, services, buf.freeze(), timing).await {
                        Some(back) => {
                            let h = Header { len: back.len() as u64, ..Header::new(Opcode::Send) };
                            Step::Send(Out::Frame { header: h, payload: Payload::Bytes(back), done: None })
                        }
                        None => break,
                    }
                }
                Step::Complete { done, result } => {
                    s.finish_op(done, result);
                    break;
                }
                Step::Forget { region } => {
                    if let Some(os) = one_sided {
                        os.forget(region);
                    }
                    break;
                }
                Step::Goodbye { len } => {
                    let mut why = vec![0u8; len as usize];
                    r.read_exact(&mut why).await.map_err(io_err)?;
                    return Ok(Some(String::from_utf8_lossy(&why).into_owned()));
                }
                Step::DecodeLookup { done, engine, header } => {
                    machine::decode_lookup(peer, done, &engine, &header, r.take_fd())
                }
                Step::Looked { done, found } => {
                    let _ = done.send(found);
                    break;
                }
                Step::Close { error, taken } => {
                    if let Some(p) = taken {
                        s.fail(p, &error.to_string());
                    }
                    return Err(error);
                }
            }
        }
    }
}

/// Hands a received message to the node's services. A full inbox holds this link's reader (the
/// peer is alive: its message is in hand), so the wait keeps the keepalive watchdog quiet.
async fn deliver(s: &Shared, services: &Services, payload: Bytes, timing: Timing) -> Option<Bytes> {
    let fut = services.deliver(s.peer, payload);
    tokio::pin!(fut);
    loop {
        tokio::select! {
            back = &mut fut => return back,
            _ = tokio::time::sleep(timing.keepalive / 2) => s.touch_rx(),
        }
    }
}
