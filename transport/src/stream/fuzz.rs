//! A harness that executes the link machine over arbitrary input, the way the socket code does,
//! and checks the machine's guarantees after every frame. `cargo fuzz run link` feeds it (the
//! `fuzzing` feature exposes it as [`crate::fuzzing::link_machine`]); the unit tests below feed it
//! seeded random input on every `cargo test`.
//!
//! The input is a script: each step either posts one of our operations (a WRITE, a READ or a
//! lookup waiting for its answer) or delivers a frame from the peer, whose header fields are drawn
//! from the input (biased towards the ids, keys and bounds that matter) and whose payload bytes
//! are the input's next bytes. Running out of input is the peer hanging up.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::machine::{self, LinkTables, Step};
use super::Pending;
use crate::error::{Result, TransportError};
use crate::frame::{reply, Out, Payload};
use crate::link::{Done, OpHandle};
use crate::mesh::BoxFuture;
use crate::onesided::{LookupServer, Move, OneSidedEngine, PeerAccess};
use crate::region::{Region, RegionOptions, RegionTable};
use crate::stats::LinkStats;
use crate::wire::{EngineTag, Header, Opcode, Status, MAX_GOODBYE, MAX_MESSAGE};
use crate::NodeId;

const PEER: NodeId = 7;
const TAG: EngineTag = EngineTag(1);

/// Runs the link machine over `data` (see the module docs); panics when a guarantee is broken.
#[cfg_attr(not(feature = "fuzzing"), allow(unreachable_pub))]
pub fn link_machine(data: &[u8]) {
    let mut h = Harness::new();
    let mut input = Input(data);
    while let Some(choice) = input.byte() {
        if choice % 4 == 0 {
            h.post(&mut input);
        } else if !h.frame(&mut input) {
            return;
        }
    }
}

/// What we expect of the answer to a pending operation.
enum Posted {
    Write,
    Read { dest: usize, offset: u64, len: u64 },
    Lookup,
}

struct Tables {
    regions: RegionTable,
    pending: RefCell<HashMap<u64, Pending>>,
    servers: Vec<Arc<dyn LookupServer>>,
    stats: LinkStats,
}

impl LinkTables for Tables {
    fn peer(&self) -> NodeId {
        PEER
    }
    fn regions(&self) -> &RegionTable {
        &self.regions
    }
    fn take(&self, req_id: u64) -> Option<Pending> {
        self.pending.borrow_mut().remove(&req_id)
    }
    fn server(&self, tag: EngineTag) -> Option<&Arc<dyn LookupServer>> {
        self.servers.iter().find(|s| s.tag() == tag)
    }
    fn stats(&self) -> &LinkStats {
        &self.stats
    }
}

struct Harness {
    t: Tables,
    /// Two registered regions and one that is not; a READ may land in any of them.
    local: Vec<Region>,
    posted: HashMap<u64, Posted>,
    handles: Vec<OpHandle>,
    next_id: u64,
}

impl Harness {
    fn new() -> Harness {
        let alloc = |len| Region::alloc(len, RegionOptions::default()).expect("allocating a fuzz region");
        let local = vec![alloc(64), alloc(4096), alloc(256)];
        let regions = RegionTable::new();
        regions.register(&local[0]);
        regions.register(&local[1]);
        let t = Tables {
            regions,
            pending: RefCell::default(),
            servers: vec![Arc::new(Server)],
            stats: LinkStats::default(),
        };
        Harness { t, local, posted: HashMap::new(), handles: Vec::new(), next_id: 1 }
    }

    fn done(&mut self) -> Done {
        let (done, handle) = OpHandle::new(PEER);
        self.handles.push(handle);
        done
    }

    /// Posts one of our operations.
    fn post(&mut self, input: &mut Input) {
        let id = self.next_id;
        self.next_id += 1;
        let kind = input.byte().unwrap_or(0) % 3;
        let (pending, posted) = match kind {
            0 => {
                let crc = input.flag().then(|| input.u32());
                (Pending::Write { done: self.done(), len: input.small(), crc, placed: None }, Posted::Write)
            }
            1 => {
                let dest = usize::from(input.byte().unwrap_or(0)) % self.local.len();
                let size = self.local[dest].len();
                let offset = input.small() % size;
                let len = input.small() % (size - offset + 1);
                let verify = input.flag();
                let region = self.local[dest].clone();
                let done = self.done();
                (Pending::Read { done, dest: region, offset, len, verify }, Posted::Read { dest, offset, len })
            }
            _ => {
                let (done, _rx) = tokio::sync::oneshot::channel();
                (Pending::Lookup { done, engine: Arc::new(Engine) }, Posted::Lookup)
            }
        };
        self.t.pending.borrow_mut().insert(id, pending);
        self.posted.insert(id, posted);
    }

    /// Delivers one frame from the peer; false once the link is closed or the input is over.
    fn frame(&mut self, input: &mut Input) -> bool {
        let Some(h) = self.header(input) else { return false };
        let Ok(h) = Header::decode(&h.encode()) else { return false }; // the real link closes
        let posted = if is_answer(h.op) { self.posted.remove(&h.req_id) } else { None };
        let mut consumed = 0u64;
        let mut answers = 0;
        let mut step = machine::on_header(&self.t, h);
        loop {
            step = match step {
                Step::Nothing => break,
                Step::Send(out) => {
                    check_answer(&h, &out);
                    answers += 1;
                    break;
                }
                Step::Land { region, offset, len, crc, then } => {
                    let end = offset.checked_add(len).expect("landing range overflows");
                    assert!(end <= region.len(), "landing {offset}+{len} outside a {}-byte region", region.len());
                    match (&posted, h.op) {
                        (_, Opcode::Write) => {
                            assert_eq!((region.id().0, region.key().0), (h.region, h.key), "WRITE lands elsewhere");
                            assert_eq!((offset, len), (h.offset, h.len), "WRITE lands at another range");
                        }
                        (Some(Posted::Read { dest, offset: o, len: l }), Opcode::ReadResp) => {
                            assert_eq!(region.id(), self.local[*dest].id(), "READ answer lands elsewhere");
                            assert_eq!((offset, len), (*o, *l), "READ answer lands at another range");
                        }
                        _ => panic!("{:?} landed bytes without a matching request", h.op),
                    }
                    let Some(bytes) = input.take(len) else { return false };
                    consumed += len;
                    // SAFETY: the harness owns these regions and runs on one thread; the range
                    // was checked against the region's length above.
                    unsafe { region.write_local(offset, bytes) }.expect("landing in range");
                    let got = crc.then(|| crc32fast::hash(bytes));
                    machine::on_landed(&self.t, then, got)
                }
                Step::Drain { len, ack } => {
                    assert_eq!(h.op, Opcode::Write, "only a refused WRITE is drained");
                    assert_ne!(ack.status, Status::Ok, "a drained WRITE is acknowledged as refused");
                    if input.take(len).is_none() {
                        return false;
                    }
                    consumed += len;
                    Step::Send(Out::Frame { header: ack, payload: Payload::None, done: None })
                }
                Step::Message { len } => {
                    assert!(len <= MAX_MESSAGE);
                    if input.take(len).is_none() {
                        return false;
                    }
                    consumed += len;
                    break;
                }
                Step::Forget { region } => {
                    assert_eq!((h.op, region.0), (Opcode::Forget, h.region));
                    break;
                }
                Step::Complete { done, result } => {
                    assert!(posted.is_some(), "{:?} completed an operation it does not answer", h.op);
                    let _ = done.send(result);
                    break;
                }
                Step::DecodeLookup { done, engine, header } => {
                    machine::decode_lookup(PEER, done, &engine, &header, None)
                }
                Step::Looked { done, found } => {
                    assert!(matches!(posted, Some(Posted::Lookup)), "a lookup answered by {:?}", h.op);
                    let _ = done.send(found);
                    break;
                }
                Step::Goodbye { len } => {
                    assert_eq!(h.op, Opcode::Goodbye, "only a goodbye ends the link as a departure");
                    assert!(len <= MAX_GOODBYE);
                    if input.take(len).is_none() {
                        return false;
                    }
                    assert_eq!(len, h.payload_len(), "the goodbye's reason is its payload");
                    return false; // nothing follows a goodbye: the real link closes
                }
                Step::Close { .. } => {
                    assert!(is_answer(h.op), "{:?} closed the link", h.op);
                    return false;
                }
            };
        }
        assert_eq!(consumed, h.payload_len(), "the stream is out of step after {h:?}");
        let answered = matches!(h.op, Opcode::Write | Opcode::Written | Opcode::ReadReq | Opcode::LookupReq);
        assert_eq!(answers, usize::from(answered), "{:?} answered {answers} times", h.op);
        true
    }

    /// A frame header drawn from the input, biased towards pending ids, registered regions,
    /// right keys and ranges near the bounds.
    fn header(&self, input: &mut Input) -> Option<Header> {
        let op = match input.byte()? {
            // Rare: a goodbye ends the session.
            255 => Opcode::Goodbye,
            b => match b % 10 {
                0 => Opcode::Write,
                1 => Opcode::WriteAck,
                2 => Opcode::ReadReq,
                3 => Opcode::ReadResp,
                4 => Opcode::Send,
                5 => Opcode::Ping,
                6 => Opcode::LookupReq,
                7 => Opcode::LookupResp,
                8 => Opcode::Forget,
                _ => Opcode::Written,
            },
        };
        let status = match input.byte()? % 8 {
            0..=2 => Status::Ok,
            3 => Status::UnknownRegion,
            4 => Status::BadKey,
            5 => Status::OutOfBounds,
            6 => Status::CrcMismatch,
            _ => Status::NotShareable,
        };
        let req_id = u64::from(input.byte()?) % (self.next_id + 1);
        let target = &self.local[usize::from(input.byte()?) % self.local.len()];
        let right_key = input.byte()? % 4 != 0;
        let key = if right_key { target.key().0 } else { input.u64() };
        let offset = if input.flag() { input.small() } else { input.u64() };
        let len = if input.flag() { input.small() } else { input.u64() };
        let crc = input.flag().then(|| input.u32());
        let engine = if input.flag() { TAG.0 } else { input.u32() };
        let h = Header { op, flags: 0, status, req_id, region: target.id().0, crc: 0, key, offset, len };
        Some(match op {
            Opcode::LookupReq => Header { crc: engine, ..h },
            _ => h.with_crc(crc),
        })
    }
}

fn is_answer(op: Opcode) -> bool {
    matches!(op, Opcode::WriteAck | Opcode::ReadResp | Opcode::LookupResp)
}

/// An answer echoes its request's id, and a READ answer's payload lies inside its region.
fn check_answer(h: &Header, out: &Out) {
    let header = match out {
        Out::Frame { header, payload, .. } => {
            if let Payload::Region { region, offset, len } = payload {
                assert!(offset.checked_add(*len).is_some_and(|end| end <= region.len()), "READ answer out of bounds");
                assert_eq!(header.len, *len);
            }
            header
        }
        Out::WithFd { header, .. } => header,
    };
    assert_eq!(header.req_id, h.req_id, "{:?} answered with another request's id", h.op);
}

/// A lookup server that answers with the region's length.
struct Server;

impl LookupServer for Server {
    fn tag(&self) -> EngineTag {
        TAG
    }
    fn answer(&self, h: &Header, region: &Region) -> Out {
        let header = Header { len: region.len(), ..reply(h, Opcode::LookupResp, Status::Ok) };
        Out::Frame { header, payload: Payload::None, done: None }
    }
}

/// An engine whose answers decode unless they name an empty region; it moves nothing.
struct Engine;

impl OneSidedEngine for Engine {
    fn tag(&self) -> EngineTag {
        TAG
    }
    fn decode_answer(&self, peer: NodeId, h: &Header, _fd: Option<OwnedFd>) -> Result<PeerAccess> {
        match h.len {
            0 => Err(TransportError::Protocol { peer: Some(peer), detail: "empty region".into() }),
            len => Ok(Arc::new(len)),
        }
    }
    fn transfer<'a>(&'a self, _access: &'a PeerAccess, _m: Move<'a>) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async { Ok(None) })
    }
}

/// The fuzzer's bytes, read front to back; reads past the end yield zeros (or `None`).
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn flag(&mut self) -> bool {
        self.byte().is_some_and(|b| b & 1 == 1)
    }
    fn u32(&mut self) -> u32 {
        (0..4).fold(0, |v, _| (v << 8) | u32::from(self.byte().unwrap_or(0)))
    }
    fn u64(&mut self) -> u64 {
        (u64::from(self.u32()) << 32) | u64::from(self.u32())
    }
    /// A value up to 8191: lengths and offsets around the regions' sizes.
    fn small(&mut self) -> u64 {
        (u64::from(self.byte().unwrap_or(0)) << 5 | u64::from(self.byte().unwrap_or(0))) & 0x1fff
    }
    /// The next `len` bytes, or `None` when fewer remain (the peer hung up mid-frame).
    fn take(&mut self, len: u64) -> Option<&'a [u8]> {
        let n = usize::try_from(len).ok().filter(|&n| n <= self.0.len())?;
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_link_machine_keeps_its_guarantees(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            link_machine(&data);
        }
    }

    /// A script that posts a READ and answers it: the harness must get past the first frame, or
    /// the property above would pass by closing at once.
    #[test]
    fn a_matching_read_answer_lands_and_completes() {
        let mut h = Harness::new();
        // Post a READ of 16 bytes at offset 8 of region 0 (the 64-byte one), with verification.
        let post = [1u8, 0, 0, 8, 0, 16, 1];
        h.post(&mut Input(&post));
        let payload = [0x5a; 16];
        let answer = Header { len: 16, ..Header::new(Opcode::ReadResp) }.with_crc(Some(crc32fast::hash(&payload)));
        let answer = Header { req_id: 1, ..answer };
        let step = machine::on_header(&h.t, answer);
        let Step::Land { offset: 8, len: 16, crc: true, then, .. } = step else { panic!("READ answer did not land") };
        assert!(matches!(machine::on_landed(&h.t, then, Some(crc32fast::hash(&payload))), Step::Complete { .. }));
        // The same id again matches nothing: the link closes.
        assert!(matches!(machine::on_header(&h.t, answer), Step::Close { .. }));
    }

    #[test]
    fn a_write_to_an_unknown_region_is_drained_and_refused() {
        let h = Harness::new();
        let w = Header { region: h.local[2].id().0, key: h.local[2].key().0, len: 100, ..Header::new(Opcode::Write) };
        let Step::Drain { len: 100, ack } = machine::on_header(&h.t, w) else { panic!("not drained") };
        assert_eq!(ack.status, Status::UnknownRegion);
    }
}
