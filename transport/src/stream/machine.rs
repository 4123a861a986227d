//! The receive side of a stream link as a pure state machine.
//!
//! The reader decodes a frame header and asks [`on_header`] what to do with it; the answer is a
//! [`Step`] that says exactly how many payload bytes to take off the stream and where they go, what
//! to send back and which of our operations completes. When a step lands payload bytes in a
//! region, the reader reports the landed checksum to [`on_landed`], which returns the step that
//! finishes the frame. Neither function touches a socket, a clock or a task: the socket code in
//! `stream.rs` executes the steps, and `fuzz.rs` executes them over arbitrary byte streams.
//!
//! The machine's guarantees, each checked by the fuzz harness:
//! - a step reads exactly the header's [`Header::payload_len`] bytes, so the stream stays in step
//!   (a refused WRITE is drained, not left on the wire);
//! - bytes land only in a range the region table admitted for that region and key;
//! - an answer that matches none of our pending requests closes the link;
//! - every answer echoes the request id of the request it answers.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Result, TransportError};
use crate::frame::{reply, Out, Payload};
use crate::link::{Completion, Done};
use crate::onesided::{LookupServer, OneSidedEngine, PeerAccess};
use crate::region::{Region, RegionId, RegionTable, RemoteKey};
use crate::stats::LinkStats;
use crate::wire::{EngineTag, Header, Opcode, Status, FLAG_CRC};
use crate::NodeId;

use super::Pending;

/// What the machine reads: the link's local regions, its pending operations and the lookup
/// servers of the engines this node serves.
pub(crate) trait LinkTables {
    /// The link's peer.
    fn peer(&self) -> NodeId;
    /// The local regions peers may address.
    fn regions(&self) -> &RegionTable;
    /// Removes and returns our pending operation `req_id`.
    fn take(&self, req_id: u64) -> Option<Pending>;
    /// The server answering lookups of engine `tag`, if this node serves it.
    fn server(&self, tag: EngineTag) -> Option<&Arc<dyn LookupServer>>;
    /// The link's counters.
    fn stats(&self) -> &LinkStats;
}

/// What the reader does next for the frame it just decoded.
pub(crate) enum Step {
    /// Nothing: the frame carried no payload and needs no answer (a keepalive).
    Nothing,
    /// Queue `Out` to the peer.
    Send(Out),
    /// Read the `len` payload bytes into `region[offset..offset + len]` (computing their crc32
    /// when `crc`), then report to [`on_landed`] with `then`.
    Land { region: Region, offset: u64, len: u64, crc: bool, then: Landed },
    /// Read and discard `len` payload bytes, then send `ack`.
    Drain { len: u64, ack: Header },
    /// Read a `len`-byte message and hand it to the node's services.
    Message { len: u64 },
    /// The peer withdrew its region `region`: drop what the one-sided engine cached for it.
    Forget { region: RegionId },
    /// The peer is leaving on purpose: read its `len`-byte reason, then close the link as a
    /// departure (not a failure).
    Goodbye { len: u64 },
    /// Complete one of our operations.
    Complete { done: Done, result: Result<Completion> },
    /// Decode the answer to our lookup with `engine` (a descriptor may have come with it).
    DecodeLookup { done: LookupDone, engine: Arc<dyn OneSidedEngine>, header: Header },
    /// Answer our lookup without decoding (the owner refused it or cannot share the region).
    Looked { done: LookupDone, found: Result<Option<PeerAccess>> },
    /// The peer broke the protocol: fail `taken` (already removed from the pending table) and
    /// close the link with `error`.
    Close { error: TransportError, taken: Option<Pending> },
}

/// Where a lookup's answer goes.
pub(crate) type LookupDone = tokio::sync::oneshot::Sender<Result<Option<PeerAccess>>>;

/// What to do once payload bytes have landed.
pub(crate) enum Landed {
    /// A peer's WRITE landed: acknowledge it, with a crc verdict when it carried one.
    WriteIn { ack: Header, expected: Option<u32> },
    /// The answer to our READ landed: complete it.
    ReadDone { done: Done, len: u64, expected: Option<u32> },
}

/// Decides what to do with a decoded frame header.
pub(crate) fn on_header(t: &impl LinkTables, h: Header) -> Step {
    let peer = t.peer();
    let access = |offset, len| t.regions().access(RegionId(h.region), RemoteKey(h.key), offset, len);
    match h.op {
        Opcode::Ping => Step::Nothing,
        Opcode::Forget => Step::Forget { region: RegionId(h.region) },
        Opcode::Goodbye => Step::Goodbye { len: h.len },
        Opcode::Write => match access(h.offset, h.len) {
            Ok(region) => {
                let ack = reply(&h, Opcode::WriteAck, Status::Ok);
                let then = Landed::WriteIn { ack, expected: h.crc() };
                Step::Land { region, offset: h.offset, len: h.len, crc: h.crc().is_some(), then }
            }
            Err(st) => {
                t.stats().op_err();
                Step::Drain { len: h.len, ack: reply(&h, Opcode::WriteAck, st) }
            }
        },
        Opcode::Written => {
            let (status, got) = match access(h.offset, h.len) {
                Ok(region) => {
                    t.stats().rx(h.len);
                    let got = match h.crc() {
                        // SAFETY: `Written` follows the peer's completed one-sided WRITE of
                        // exactly this range, which the owner exposed to it alone.
                        Some(_) => unsafe { region.crc32(h.offset, h.len) }.ok(),
                        None => None,
                    };
                    crc_status(h.crc(), got)
                }
                Err(st) => (st, None),
            };
            Step::Send(ack(reply(&h, Opcode::WriteAck, status).with_crc(got)))
        }
        Opcode::ReadReq => Step::Send(match access(h.offset, h.len) {
            Ok(region) => {
                let crc = if h.flags & FLAG_CRC != 0 {
                    // SAFETY: a READ's source range is stable while the owner exposes it for
                    // reading (region contract); the answer sends the same bytes.
                    unsafe { region.crc32(h.offset, h.len) }.ok()
                } else {
                    None
                };
                let header = Header { len: h.len, ..reply(&h, Opcode::ReadResp, Status::Ok) }.with_crc(crc);
                Out::Frame { header, payload: Payload::Region { region, offset: h.offset, len: h.len }, done: None }
            }
            Err(st) => {
                t.stats().op_err();
                ack(reply(&h, Opcode::ReadResp, st))
            }
        }),
        Opcode::Send => Step::Message { len: h.len },
        Opcode::LookupReq => Step::Send(match access(0, 0) {
            Ok(region) => match t.server(h.engine()) {
                Some(server) => server.answer(&h, &region),
                None => ack(reply(&h, Opcode::LookupResp, Status::NotShareable)),
            },
            Err(st) => ack(reply(&h, Opcode::LookupResp, st)),
        }),
        Opcode::WriteAck => match t.take(h.req_id) {
            Some(Pending::Write { done, len, crc, placed }) => {
                let result = match h.status {
                    Status::Ok => Ok(Completion { bytes: len, crc: placed }),
                    Status::CrcMismatch => Err(TransportError::CrcMismatch {
                        peer,
                        op: "write",
                        expected: crc.unwrap_or(0),
                        actual: h.crc().unwrap_or(0),
                    }),
                    status => Err(TransportError::Refused { peer, op: "write", status }),
                };
                Step::Complete { done, result }
            }
            other => unmatched(peer, &h, other),
        },
        Opcode::ReadResp => match t.take(h.req_id) {
            Some(Pending::Read { done, dest, offset, len, verify }) => {
                if h.status != Status::Ok {
                    let result = Err(TransportError::Refused { peer, op: "read", status: h.status });
                    return Step::Complete { done, result };
                }
                if h.len != len {
                    let error = protocol(peer, format!("READ answer of {} bytes, {len} requested", h.len));
                    let taken = Some(Pending::Read { done, dest, offset, len, verify });
                    return Step::Close { error, taken };
                }
                if verify && h.crc().is_none() {
                    let error = protocol(peer, "READ answer lacks the requested crc32".into());
                    let taken = Some(Pending::Read { done, dest, offset, len, verify });
                    return Step::Close { error, taken };
                }
                let expected = if verify { h.crc() } else { None };
                Step::Land { region: dest, offset, len, crc: verify, then: Landed::ReadDone { done, len, expected } }
            }
            other => unmatched(peer, &h, other),
        },
        Opcode::LookupResp => match t.take(h.req_id) {
            Some(Pending::Lookup { done, engine }) => match h.status {
                Status::Ok => Step::DecodeLookup { done, engine, header: h },
                Status::NotShareable => Step::Looked { done, found: Ok(None) },
                status => Step::Looked { done, found: Err(TransportError::Refused { peer, op: "lookup", status }) },
            },
            other => unmatched(peer, &h, other),
        },
    }
}

/// Finishes a frame whose payload landed; `got` is the landed bytes' crc32 when it was asked for.
pub(crate) fn on_landed(t: &impl LinkTables, then: Landed, got: Option<u32>) -> Step {
    match then {
        Landed::WriteIn { ack: header, expected } => {
            let (status, crc) = crc_status(expected, got);
            Step::Send(ack(Header { status, ..header }.with_crc(crc)))
        }
        Landed::ReadDone { done, len, expected } => {
            let result = match (expected, got) {
                (Some(expected), Some(actual)) if expected != actual => {
                    Err(TransportError::CrcMismatch { peer: t.peer(), op: "read", expected, actual })
                }
                _ => Ok(Completion::moved(len)),
            };
            Step::Complete { done, result }
        }
    }
}

/// Decodes the owner's answer to a lookup with `engine`; an undecodable answer closes the link.
pub(crate) fn decode_lookup(
    peer: NodeId,
    done: LookupDone,
    engine: &Arc<dyn OneSidedEngine>,
    h: &Header,
    fd: Option<OwnedFd>,
) -> Step {
    match engine.decode_answer(peer, h, fd) {
        Ok(access) => Step::Looked { done, found: Ok(Some(access)) },
        Err(error) => Step::Close { error, taken: Some(Pending::Lookup { done, engine: engine.clone() }) },
    }
}

/// An answer frame that matches none of our pending requests (or one of another kind): the peer
/// broke the protocol. An operation of another kind that was taken fails with the link.
fn unmatched(peer: NodeId, h: &Header, taken: Option<Pending>) -> Step {
    Step::Close { error: protocol(peer, format!("{:?} for unknown request {}", h.op, h.req_id)), taken }
}

fn ack(header: Header) -> Out {
    Out::Frame { header, payload: Payload::None, done: None }
}

fn crc_status(expected: Option<u32>, got: Option<u32>) -> (Status, Option<u32>) {
    match (expected, got) {
        (Some(e), Some(g)) if e != g => (Status::CrcMismatch, Some(g)),
        _ => (Status::Ok, None),
    }
}

fn protocol(peer: NodeId, detail: String) -> TransportError {
    TransportError::Protocol { peer: Some(peer), detail }
}
