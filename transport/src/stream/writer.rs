//! The writer task of a stream link: drains the control and bulk lanes onto the stream, sends
//! keepalives, and, when the link leaves on purpose, finishes the frame in flight and says
//! goodbye (see the parent module's docs).

use std::io;
use std::sync::atomic::Ordering;

use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tracing::debug;

use super::{stopped, FrameSink, Out, Payload, Shared, Timing, GOODBYE_FLUSH};
use crate::link::Completion;
use crate::wire::{Header, Opcode};

pub(super) async fn write_loop<W: FrameSink>(
    s: &Shared,
    w: W,
    (mut control, mut bulk): (mpsc::UnboundedReceiver<Out>, mpsc::UnboundedReceiver<Out>),
    timing: Timing,
) -> io::Result<()> {
    let mut stop = s.shutdown.subscribe();
    let mut w = BufWriter::with_capacity(64 << 10, w);
    let mut tick = tokio::time::interval(timing.keepalive);
    loop {
        // `None`: a keepalive is due.
        let out = tokio::select! {
            biased;
            _ = stopped(&mut stop) => return leave(s, &mut w, &mut control).await,
            out = control.recv() => match out { Some(o) => Some(o), None => return Ok(()) },
            out = bulk.recv() => match out { Some(o) => Some(o), None => return Ok(()) },
            _ = tick.tick() => {
                let idle = s.now_ms().saturating_sub(s.last_tx_ms.load(Ordering::Relaxed));
                if idle < timing.keepalive.as_millis() as u64 {
                    continue;
                }
                None
            }
        };
        // Every write below races the stop signal: a peer that stopped reading must not hold a
        // closing link's writer.
        let finished = {
            let batch = async {
                let Some(out) = out else {
                    w.write_all(&Header::new(Opcode::Ping).encode()).await?;
                    return w.flush().await;
                };
                write_one(s, &mut w, out).await?;
                // Coalesce whatever else is queued, control first after every frame, then
                // flush once.
                while let Ok(out) = control.try_recv().or_else(|_| bulk.try_recv()) {
                    write_one(s, &mut w, out).await?;
                }
                w.flush().await
            };
            tokio::pin!(batch);
            tokio::select! {
                r = &mut batch => { r?; true }
                // Stopped mid-frame: a goodbye can follow only a whole frame, so a leaving
                // link finishes what it is writing first (bounded); a failed one stops here.
                _ = stopped(&mut stop) => {
                    if !s.says_goodbye() {
                        return Ok(());
                    }
                    match tokio::time::timeout(GOODBYE_FLUSH, &mut batch).await {
                        Ok(r) => { r?; false }
                        Err(_) => return Ok(()),
                    }
                }
            }
        };
        if !finished {
            return leave(s, &mut w, &mut control).await;
        }
        s.last_tx_ms.store(s.now_ms(), Ordering::Relaxed);
    }
}

/// A leaving link's last writes, where it says goodbye: the control frames already queued
/// when it left, then the goodbye, each within [`GOODBYE_FLUSH`]. The queued frames include the
/// replies this node posted just before it left (an instance answers the last batch it held and
/// its node leaves at once); dropped, their callers saw the node go down instead of the answer.
/// A link closed as a failure writes nothing more.
async fn leave<W: FrameSink>(
    s: &Shared,
    w: &mut BufWriter<W>,
    control: &mut mpsc::UnboundedReceiver<Out>,
) -> io::Result<()> {
    if !s.says_goodbye() {
        return Ok(());
    }
    let queued = async {
        while let Ok(out) = control.try_recv() {
            write_one(s, w, out).await?;
        }
        w.flush().await
    };
    match tokio::time::timeout(GOODBYE_FLUSH, queued).await {
        Ok(r) => r?,
        Err(_) => {
            debug!(peer = s.peer, "queued frames not written in time: no goodbye");
            return Ok(());
        }
    }
    say_goodbye(s, w).await
}

/// Writes this side's goodbye, if it leaves and the peer understands one, within
/// [`GOODBYE_FLUSH`]. A goodbye that cannot be written in time is dropped: the peer sees a
/// failure, as it would have without one.
async fn say_goodbye<W: FrameSink>(s: &Shared, w: &mut BufWriter<W>) -> io::Result<()> {
    let Some(reason) = s.goodbye.lock().unwrap_or_else(|e| e.into_inner()).take() else { return Ok(()) };
    let mut cut = reason.len().min(crate::wire::MAX_GOODBYE as usize);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let header = Header { len: cut as u64, ..Header::new(Opcode::Goodbye) };
    let write = async {
        w.write_all(&header.encode()).await?;
        w.write_all(&reason.as_bytes()[..cut]).await?;
        w.flush().await
    };
    match tokio::time::timeout(GOODBYE_FLUSH, write).await {
        Ok(r) => r,
        Err(_) => {
            debug!(peer = s.peer, "goodbye not written in time");
            Ok(())
        }
    }
}

async fn write_one<W: FrameSink>(s: &Shared, w: &mut BufWriter<W>, out: Out) -> io::Result<()> {
    match out {
        Out::Frame { header, payload, done } => {
            w.write_all(&header.encode()).await?;
            match payload {
                Payload::None => {}
                Payload::Bytes(b) => w.write_all(&b).await?,
                Payload::Region { region, offset, len } => {
                    // SAFETY: the range was bounds-checked when the operation was posted/served,
                    // `region` is kept alive by this scope, and the region contract makes the
                    // owner responsible for not changing bytes that are being sent.
                    let data = unsafe { region.slice(offset, len) };
                    w.write_all(data).await?;
                }
            }
            s.stats.tx(header.payload_len());
            if let Some((done, len)) = done {
                s.finish_op(done, Ok(Completion::moved(len)));
            }
        }
        Out::WithFd { header, fd } => {
            w.flush().await?;
            w.get_mut().send_fd(&header.encode(), &fd).await?;
        }
    }
    Ok(())
}
