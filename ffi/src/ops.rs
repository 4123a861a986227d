//! One-sided WRITE/READ in batches, SEND/RECV, and the completion queue they report to.

use std::ffi::c_char;

use cascade_transport::{Op, OpHandle, ServiceExt, TransportError};

use crate::buf;
use crate::endpoint::{cascade_endpoint, lock};
use crate::error::{code_of, guard, FfiError, CASCADE_IN_PROGRESS, CASCADE_OK};
use crate::message::AppMessage;
use crate::region::{cascade_remote_region, region};

/// [`cascade_op::kind`]: a one-sided WRITE from the local region into the remote one.
pub const CASCADE_OP_WRITE: u32 = 1;
/// [`cascade_op::kind`]: a one-sided READ from the remote region into the local one.
pub const CASCADE_OP_READ: u32 = 2;
/// [`cascade_op::flags`]: verify the data's crc32 at its destination (a mismatch fails the
/// operation with `CASCADE_ERR_CRC`).
pub const CASCADE_OP_VERIFY: u32 = 1;

/// [`cascade_completion::kind`]: a WRITE finished.
pub const CASCADE_EVENT_WRITE: u32 = 1;
/// A READ finished.
pub const CASCADE_EVENT_READ: u32 = 2;
/// A SEND was handed to the link.
pub const CASCADE_EVENT_SEND: u32 = 3;
/// A multicast target holds layers `0..=layer`, every chunk verified (`node` is the target).
pub const CASCADE_EVENT_LAYER_READY: u32 = 4;
/// A multicast target holds everything, verified (`node` is the target).
pub const CASCADE_EVENT_TARGET_DONE: u32 = 5;
/// A multicast run ended (`status`; its outcome as JSON in [`cascade_completion_detail`]).
pub const CASCADE_EVENT_MULTICAST_DONE: u32 = 6;

/// One operation of a batch for [`cascade_post`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct cascade_op {
    /// `sizeof(cascade_op)` as the caller compiled it; every op of a batch has the same size,
    /// and the array's stride is that size.
    pub struct_size: u32,
    /// `CASCADE_OP_WRITE` or `CASCADE_OP_READ`.
    pub kind: u32,
    /// The local region (source of a WRITE, destination of a READ).
    pub local: *const crate::region::cascade_region,
    /// Offset in the local region.
    pub local_offset: u64,
    /// The peer's region; its `node` is the peer.
    pub remote: cascade_remote_region,
    /// Offset in the peer's region.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
    /// `CASCADE_OP_*` flags.
    pub flags: u32,
    /// Returned in the operation's completion.
    pub tag: u64,
}

/// A finished operation or a multicast event, from [`cascade_poll`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct cascade_completion {
    /// The tag the operation (or run) was posted with.
    pub tag: u64,
    /// Payload bytes moved (a run's: bytes per target).
    pub bytes: u64,
    /// `CASCADE_OK` or a negative `CASCADE_ERR_*` code (details in
    /// [`cascade_completion_detail`]).
    pub status: i32,
    /// `CASCADE_EVENT_*`.
    pub kind: u32,
    /// The peer (operations) or the target node (multicast events).
    pub node: u32,
    /// The layer of a `CASCADE_EVENT_LAYER_READY`; 0 otherwise.
    pub layer: u32,
}

/// Posts `n` one-sided operations at `ops` (an array whose stride is `ops[0].struct_size`).
/// Every operation is checked first (kinds, regions, bounds of the local side): a bad one fails
/// the call and posts nothing. Each then completes asynchronously with one record in the
/// completion queue, carrying its tag ([`cascade_poll`]). Operations to different peers and of
/// one batch may complete in any order.
///
/// # Safety
/// `ep` is a live endpoint; `ops` points to `n` ops laid out as described; their region handles
/// are live and stay so until their completions are polled.
#[no_mangle]
pub unsafe extern "C" fn cascade_post(ep: *const cascade_endpoint, ops: *const cascade_op, n: usize) -> i32 {
    guard("cascade_post", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        // SAFETY: the caller's contract.
        let batch = unsafe { read_ops(ops, n) }?;
        // Links post from the endpoint's runtime.
        let _rt = e.rt.enter();
        // One post per peer, so the link sees the batch at once.
        let mut by_peer: std::collections::BTreeMap<u32, Vec<Posted>> = Default::default();
        for p in batch {
            by_peer.entry(p.peer).or_default().push(p);
        }
        for (peer, ops) in by_peer {
            let (meta, ops) = records(ops);
            let handles = match e.ep.link(peer) {
                Ok(link) => link.post(ops).into_iter().map(Ok).collect(),
                // No live link: every op of the batch fails with that.
                Err(_) => meta.iter().map(|_| Err(TransportError::NotConnected { peer })).collect(),
            };
            report(e, peer, meta, handles);
        }
        Ok(CASCADE_OK)
    })
}

/// Posts `n` one-sided operations at `ops`, all to one peer, and then sends that peer `len` bytes
/// at `data` with `tag`: the peer receives the message ([`cascade_recv`]) only after the batch's
/// WRITEs placed their bytes in its regions — or were refused, so a receiver that must be sure
/// checks what it reads — without the sender waiting for the WRITEs' round trips first (what
/// NIXL calls a transfer's notification). The operations are checked and complete as with
/// [`cascade_post`]; the message then completes as a `CASCADE_EVENT_SEND` with `tag`. READs in
/// the batch are not ordered before the message.
///
/// # Safety
/// `ep` is a live endpoint; `ops` as for [`cascade_post`]; `data` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cascade_post_notify(
    ep: *const cascade_endpoint,
    ops: *const cascade_op,
    n: usize,
    tag: u64,
    data: *const u8,
    len: usize,
) -> i32 {
    guard("cascade_post_notify", || {
        // SAFETY: the caller's contract.
        let (e, data) = unsafe { (buf::handle(ep, "ep")?, buf::bytes(data, len, "data")?) };
        // SAFETY: the caller's contract.
        let batch = unsafe { read_ops(ops, n) }?;
        let Some(peer) = batch.first().map(|p| p.peer) else {
            return Err(FfiError::arg("n is 0: a notification follows at least one operation"));
        };
        if let Some(i) = batch.iter().position(|p| p.peer != peer) {
            return Err(FfiError::arg(format!(
                "ops[{i}] goes to node {}, ops[0] to node {peer}: one batch, one peer",
                batch[i].peer
            )));
        }
        let bytes = data.len() as u64;
        let _rt = e.rt.enter();
        let (mut meta, ops) = records(batch);
        let handles = e.ep.post_oneway_after(peer, ops, &AppMessage { tag, data })?;
        // The SEND's record carries the message's size, as cascade_send's does.
        meta.push((tag, CASCADE_EVENT_SEND, Some(bytes)));
        report(e, peer, meta, handles.into_iter().map(Ok).collect());
        Ok(CASCADE_OK)
    })
}

/// One checked operation of a caller's batch.
struct Posted {
    peer: u32,
    tag: u64,
    kind: u32,
    op: Op,
}

/// Reads and checks the caller's `n` ops at `ops` (kinds, regions, bounds of the local side).
///
/// # Safety
/// As [`cascade_post`]'s `ops` and `n`.
unsafe fn read_ops(ops: *const cascade_op, n: usize) -> Result<Vec<Posted>, FfiError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `ops` points to at least one op starting with its size (the caller's contract).
    let first = unsafe { buf::sized(ops, "ops[0]") }?;
    let stride = first.struct_size as usize;
    let mut batch = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: the array holds `n` ops `stride` bytes apart, each at least as large as
        // this library's `cascade_op` (checked on the first, the same for all).
        let o = unsafe { ops.cast::<u8>().add(i * stride).cast::<cascade_op>().read_unaligned() };
        // SAFETY: live region handles (the caller's contract).
        let local = unsafe { region(o.local) }.map_err(|_| FfiError::arg(format!("ops[{i}].local is null")))?;
        let remote = o.remote.into();
        let op = match o.kind {
            CASCADE_OP_WRITE => Op::write(&local.region, o.local_offset, remote, o.remote_offset, o.len),
            CASCADE_OP_READ => Op::read(&local.region, o.local_offset, remote, o.remote_offset, o.len),
            k => return Err(FfiError::arg(format!("ops[{i}].kind is {k}: CASCADE_OP_WRITE or CASCADE_OP_READ"))),
        };
        let op = if o.flags & CASCADE_OP_VERIFY != 0 { op.verified() } else { op };
        local
            .region
            .check(o.local_offset, o.len)
            .map_err(|err| FfiError::from(err).with_prefix(&format!("ops[{i}]")))?;
        if o.len == 0 {
            return Err(FfiError::arg(format!("ops[{i}].len is 0")));
        }
        let kind = if o.kind == CASCADE_OP_WRITE { CASCADE_EVENT_WRITE } else { CASCADE_EVENT_READ };
        batch.push(Posted { peer: o.remote.node, tag: o.tag, kind, op });
    }
    Ok(batch)
}

/// What a posted operation's completion record says: its tag, its `CASCADE_EVENT_*` kind, and
/// the bytes to report instead of the link's count (a message's own size).
type Record = (u64, u32, Option<u64>);

/// A batch's operations, and what each one's completion record will say.
fn records(batch: Vec<Posted>) -> (Vec<Record>, Vec<Op>) {
    batch.into_iter().map(|p| ((p.tag, p.kind, None), p.op)).unzip()
}

/// Queues one completion record per handle once it resolves.
fn report(e: &cascade_endpoint, peer: u32, meta: Vec<Record>, handles: Vec<Result<OpHandle, TransportError>>) {
    let limit = e.ep.config().op_timeout;
    for ((tag, kind, size), h) in meta.into_iter().zip(handles) {
        let (queue, details) = (e.queue.clone(), e.details.clone());
        e.rt.spawn(async move {
            let what = match kind {
                CASCADE_EVENT_WRITE => "write",
                CASCADE_EVENT_READ => "read",
                _ => "send",
            };
            let r = match h {
                Ok(h) => h.wait(what, limit).await,
                Err(err) => Err(err),
            };
            let (status, bytes, detail) = match r {
                Ok(c) => (CASCADE_OK, size.unwrap_or(c.bytes), None),
                Err(err) => (code_of(&err), 0, Some(err.to_string())),
            };
            let c = cascade_completion { tag, bytes, status, kind, node: peer, layer: 0 };
            cascade_endpoint::complete(&queue, &details, c, detail);
        });
    }
}

/// Moves up to `cap` completion records into `out` without waiting; `*n` gets how many.
/// Returns [`CASCADE_OK`] when it moved at least one, [`CASCADE_IN_PROGRESS`] when none was there.
///
/// # Safety
/// `ep` is a live endpoint; `out` is writable for `cap` records; `n` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_poll(
    ep: *const cascade_endpoint,
    out: *mut cascade_completion,
    cap: usize,
    n: *mut usize,
) -> i32 {
    guard("cascade_poll", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        if n.is_null() || (out.is_null() && cap > 0) {
            return Err(FfiError::arg("out or n is null"));
        }
        let mut q = lock(&e.queue);
        let k = cap.min(q.len());
        for (i, c) in q.drain(..k).enumerate() {
            // SAFETY: `out` is writable for `cap > i` records.
            unsafe { out.add(i).write(c) };
        }
        // SAFETY: non-null and writable.
        unsafe { n.write(k) };
        Ok(if k == 0 { CASCADE_IN_PROGRESS } else { CASCADE_OK })
    })
}

/// The detail text of the newest completion with `tag` that has one — a failed operation's
/// error message, a multicast run's outcome (JSON) — into `(buf, cap)`, NUL-terminated.
/// The newest 1,024 details are kept. [`CASCADE_IN_PROGRESS`] when there is none.
///
/// # Safety
/// `ep` is a live endpoint; `buf` is writable for `cap` bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_completion_detail(
    ep: *const cascade_endpoint,
    tag: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("cascade_completion_detail", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        let found = lock(&e.details).iter().rev().find(|(t, _)| *t == tag).map(|(_, d)| d.clone());
        match found {
            // SAFETY: the caller's contract for the buffer.
            Some(d) => unsafe { buf::out_text(&d, buf, cap, needed) },
            None => Ok(CASCADE_IN_PROGRESS),
        }
    })
}

/// Sends `len` bytes at `data` with `tag` to `peer`'s receive queue (copied on entry; a message
/// over the control plane's limit, 64 MiB with its framing, fails the call with
/// `CASCADE_ERR_OTHER` and sends nothing). A completion `CASCADE_EVENT_SEND` with `tag` follows when
/// the link has sent it. Messages from one peer arrive in the order sent.
///
/// # Safety
/// `ep` is a live endpoint; `data` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cascade_send(
    ep: *const cascade_endpoint,
    peer: u32,
    tag: u64,
    data: *const u8,
    len: usize,
) -> i32 {
    guard("cascade_send", || {
        // SAFETY: the caller's contract.
        let (e, data) = unsafe { (buf::handle(ep, "ep")?, buf::bytes(data, len, "data")?) };
        let bytes = data.len() as u64;
        let _rt = e.rt.enter();
        let h = e.ep.post_oneway(peer, &AppMessage { tag, data })?;
        // Its record carries the message's size (0 if it failed, as every op's does).
        report(e, peer, vec![(tag, CASCADE_EVENT_SEND, Some(bytes))], vec![Ok(h)]);
        Ok(CASCADE_OK)
    })
}

/// Takes the next received message without waiting: its bytes into `(buf, cap)`, its size into
/// `*needed`, its sender and tag into `*from` and `*tag` (each may be null). Returns
/// [`CASCADE_IN_PROGRESS`] when none is there; when `cap` is too small, the message stays queued
/// and the call returns `CASCADE_ERR_BUFFER_TOO_SMALL` with `*needed` set. A message of no
/// bytes needs no buffer (`buf` may be null).
///
/// # Safety
/// `ep` is a live endpoint; `buf` is writable for `cap` bytes; the other pointers are null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_recv(
    ep: *const cascade_endpoint,
    from: *mut u32,
    tag: *mut u64,
    buf: *mut u8,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("cascade_recv", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        let mut held = lock(&e.held);
        let m = match held.take().or_else(|| lock(&e.inbox).try_recv()) {
            Some(m) => m,
            None => return Ok(CASCADE_IN_PROGRESS),
        };
        // SAFETY: the caller's contract for the buffer.
        if let Err(err) = unsafe { buf::out(&m.msg.data, false, buf, cap, needed) } {
            *held = Some(m);
            return Err(err);
        }
        // SAFETY: null or writable (the caller's contract).
        unsafe {
            if !from.is_null() {
                from.write(m.from);
            }
            if !tag.is_null() {
                tag.write(m.msg.tag);
            }
        }
        Ok(CASCADE_OK)
    })
}

/// Keeps the compiler honest about the record layout C sees.
const _: () = assert!(std::mem::size_of::<cascade_completion>() == 32);
