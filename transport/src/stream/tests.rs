//! Link-level tests over an in-memory duplex stream (no sockets, no device).

use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

use super::*;
use crate::onesided::{LookupServer, OneSidedEngine, PeerAccess};
use crate::rdma::{RdmaLookups, RemoteMr, RkeyResolver};
use crate::region::test_access as ta;
use crate::wire::Status;

impl FrameSource for ReadHalf<DuplexStream> {
    fn take_fd(&mut self) -> Option<OwnedFd> {
        None
    }
}

impl FrameSink for WriteHalf<DuplexStream> {
    fn send_fd<'a>(
        &'a mut self,
        _bytes: &'a [u8],
        _fd: &'a OwnedFd,
    ) -> Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send + 'a>> {
        Box::pin(async { Err(io::ErrorKind::Unsupported.into()) })
    }
}

fn link(peer: NodeId, io: DuplexStream, regions: RegionTable, rkeys: Option<RkeyResolver>) -> Arc<StreamLink> {
    link_with(peer, io, regions, rkeys, true, Box::new(|_| {}))
}

fn link_with(
    peer: NodeId,
    io: DuplexStream,
    regions: RegionTable,
    rkeys: Option<RkeyResolver>,
    goodbye: bool,
    on_close: OnClose,
) -> Arc<StreamLink> {
    let (r, w) = tokio::io::split(io);
    let servers: Vec<Arc<dyn LookupServer>> =
        rkeys.into_iter().map(|f| Arc::new(RdmaLookups(f)) as Arc<dyn LookupServer>).collect();
    let ctx = LinkCtx {
        one_sided: None,
        servers,
        peer,
        kind: BackendKind::Tcp,
        regions,
        services: crate::service::Services::new(2),
        timing: Timing { keepalive: Duration::from_millis(100), dead_after: Duration::from_secs(5) },
        on_close,
        goodbye,
    };
    StreamLink::spawn(ctx, r, w)
}

/// The initiator's side of an RDMA lookup without a queue pair: decodes answers, moves nothing.
struct RkeyProbe;

impl OneSidedEngine for RkeyProbe {
    fn tag(&self) -> crate::wire::EngineTag {
        crate::rdma::TAG
    }
    fn decode_answer(&self, peer: NodeId, h: &Header, _fd: Option<OwnedFd>) -> Result<PeerAccess> {
        Ok(Arc::new(RemoteMr::from_answer(peer, h)?))
    }
    fn transfer<'a>(
        &'a self,
        _access: &'a PeerAccess,
        m: crate::onesided::Move<'a>,
    ) -> crate::mesh::BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move { Err(TransportError::NotConnected { peer: m.peer }) })
    }
}

async fn rkey_lookup(link: &StreamLink, region: RegionId, key: RemoteKey) -> Result<Option<RemoteMr>> {
    let got = link.shared.request_access(region, key, Arc::new(RkeyProbe)).await?;
    Ok(got.map(|a| *a.downcast::<RemoteMr>().unwrap()))
}

/// A region table holding one new region of `len` bytes (a peer's side of a test), and that region.
fn registered(len: u64) -> (RegionTable, Region) {
    let table = RegionTable::new();
    let region = Region::alloc(len, Default::default()).unwrap();
    table.register(&region);
    (table, region)
}

/// A stand-in for the RDMA device's lookup: answers with a registration derived from the region.
fn fake_resolver() -> RkeyResolver {
    Arc::new(|r: &Region| Ok(RemoteMr { addr: 0x7000_0000 + u64::from(r.id().0), rkey: 42, len: r.len() }))
}

#[tokio::test]
async fn rdma_lookup_is_key_checked_by_the_owner() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, region) = registered(8192);
    let a = link(1, a_io, RegionTable::new(), None);
    let _b = link(0, b_io, b_regions, Some(fake_resolver()));
    let got = rkey_lookup(&a, region.id(), region.key()).await.unwrap();
    assert_eq!(got, Some(RemoteMr { addr: 0x7000_0000 + u64::from(region.id().0), rkey: 42, len: 8192 }));
    let bad = rkey_lookup(&a, region.id(), RemoteKey(region.key().0 ^ 1)).await;
    assert!(matches!(bad, Err(TransportError::Refused { status: Status::BadKey, .. })));
    let unknown = rkey_lookup(&a, RegionId(u32::MAX), region.key()).await;
    assert!(matches!(unknown, Err(TransportError::Refused { status: Status::UnknownRegion, .. })));
}

/// Accesses to one peer region that start together (the first WRITEs of a transfer) make one
/// lookup between them, not one each: the owner answers once and every access gets that answer.
/// Before 2026-12-05 each made its own (over shm, each answer a mapping of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_accesses_to_a_region_look_it_up_once() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, region) = registered(8192);
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = answered.clone();
    let resolver: RkeyResolver = Arc::new(move |r: &Region| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // Slow enough that the accesses below all start before the first answer comes.
        std::thread::sleep(Duration::from_millis(50));
        Ok(RemoteMr { addr: 0x7000_0000, rkey: 42, len: r.len() })
    });
    let a = link(1, a_io, RegionTable::new(), None);
    let _b = link(0, b_io, b_regions, Some(resolver));
    let os = Arc::new(crate::onesided::OneSided::new(Arc::new(RkeyProbe)));
    let remote = region.remote(0);
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (shared, os) = (a.shared.clone(), os.clone());
            tokio::spawn(async move { one_sided::access(&shared, &os, remote).await.map(|x| x.is_some()) })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap(), "every access gets the answer");
    }
    assert_eq!(answered.load(std::sync::atomic::Ordering::SeqCst), 1, "one lookup for four accesses");
}

#[tokio::test]
async fn a_node_without_a_device_declines_rdma_lookups() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, region) = registered(4096);
    let a = link(1, a_io, RegionTable::new(), None);
    let _b = link(0, b_io, b_regions, None);
    let got = rkey_lookup(&a, region.id(), region.key()).await.unwrap();
    assert!(got.is_none(), "the initiator must fall back to the framed protocol");
}

#[tokio::test]
async fn written_notice_verifies_the_crc_at_the_owner() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, region) = registered(4096);
    ta::fill(&region, 0, 4096, 7).unwrap();
    let a = link(1, a_io, RegionTable::new(), None);
    let _b = link(0, b_io, b_regions, None);
    let good = ta::crc32(&region, 0, 4096).unwrap();
    for (crc, ok) in [(good, true), (good ^ 1, false)] {
        let (done, h) = OpHandle::new(0);
        a.shared.post_written(done, region.remote(1), 0, 4096, Some(crc), None);
        match (h.await, ok) {
            (Ok(c), true) => assert_eq!(c.bytes, 4096),
            (Err(TransportError::CrcMismatch { expected, actual, .. }), false) => {
                assert_eq!((expected, actual), (good ^ 1, good))
            }
            (other, _) => panic!("crc {crc:#x}: {other:?}"),
        }
    }
}

/// Within a batch a SEND follows the bulk frames before it into the bulk lane; the batch's other
/// small frames, and anything before the first bulk frame, keep the control lane.
#[test]
fn a_batch_keeps_its_sends_behind_its_bulk_frames() {
    let (lanes, mut control, mut bulk) = Lanes::new();
    let r = Region::alloc(1 << 20, Default::default()).unwrap();
    let frame = |op: Opcode, len: u64| Out::Frame {
        header: Header::new(op),
        payload: if len > 0 { Payload::Region { region: r.clone(), offset: 0, len } } else { Payload::None },
        done: None,
    };
    let mut in_bulk = false;
    for (op, len) in [(Opcode::Send, 0), (Opcode::Write, 1 << 20), (Opcode::Write, 4096), (Opcode::Send, 0)] {
        assert!(lanes.send_in(frame(op, len), &mut in_bulk));
    }
    let drain = |rx: &mut mpsc::UnboundedReceiver<Out>| {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|o| match o {
                Out::Frame { header, payload: Payload::Region { len, .. }, .. } => (header.op, len),
                Out::Frame { header, .. } => (header.op, 0),
                Out::WithFd { header, .. } => (header.op, 0),
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(drain(&mut control), [(Opcode::Send, 0), (Opcode::Write, 4096)]);
    assert_eq!(drain(&mut bulk), [(Opcode::Write, 1 << 20), (Opcode::Send, 0)]);
    // Separately posted, a SEND takes the control lane again.
    assert!(lanes.send(frame(Opcode::Send, 0)));
    assert_eq!(drain(&mut control), [(Opcode::Send, 0)]);
}

/// A link whose close is reported on the returned channel.
fn watched(
    peer: NodeId,
    io: DuplexStream,
    regions: RegionTable,
    goodbye: bool,
) -> (Arc<StreamLink>, tokio::sync::oneshot::Receiver<Closed>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let on_close: OnClose = Box::new(move |c| {
        let _ = tx.send(c);
    });
    (link_with(peer, io, regions, None, goodbye, on_close), rx)
}

async fn closed_within(rx: tokio::sync::oneshot::Receiver<Closed>) -> Closed {
    tokio::time::timeout(Duration::from_secs(5), rx).await.expect("the link did not close").unwrap()
}

/// A side that leaves says goodbye: the peer closes as a departure, with the reason; a side that
/// closes for a failure, or whose peer does not understand a goodbye, is seen as a failure.
#[tokio::test]
async fn a_leaving_link_says_goodbye_and_a_failed_one_does_not() {
    for (leaves, hears, graceful) in [(true, true, true), (false, true, false), (true, false, false)] {
        let (a_io, b_io) = tokio::io::duplex(1 << 16);
        // `a` is node 1's link to node 0; `hears` is whether node 0 advertised the goodbye.
        let (a, a_closed) = watched(0, a_io, RegionTable::new(), hears);
        let (b, b_closed) = watched(1, b_io, RegionTable::new(), true);
        if leaves {
            a.leave("scaled in");
        } else {
            a.close("boom");
        }
        let mine = closed_within(a_closed).await;
        assert_eq!(mine.graceful, leaves, "{mine:?}");
        let theirs = closed_within(b_closed).await;
        assert_eq!(theirs.graceful, graceful, "leaves {leaves}, hears {hears}: {theirs:?}");
        if graceful {
            assert_eq!(theirs.reason, "node 1 left: scaled in");
        }
        assert!(!b.is_alive());
        tokio::time::timeout(Duration::from_secs(5), a.writer_stopped()).await.expect("writer still running");
    }
}

/// What was posted before the leave goes out before the goodbye: a small frame queued on the
/// control lane, not yet picked up by the writer when the link leaves, still lands at the peer
/// (as an instance's last reply does when its node leaves right after; it used to be dropped).
#[tokio::test]
async fn frames_queued_before_a_leave_go_out_before_the_goodbye() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, dst) = registered(4096);
    let (a, _a_closed) = watched(0, a_io, RegionTable::new(), true);
    let (_b, b_closed) = watched(1, b_io, b_regions, true);
    let src = Region::alloc(4096, Default::default()).unwrap();
    crate::region::test_access::write_local(&src, 0, &[7u8; 4096]).unwrap();
    // Posted and left at once: the writer task has not run in between.
    let _h = a.post(vec![Op::write(&src, 0, dst.remote(0), 0, 4096)]);
    a.leave("done");
    let theirs = closed_within(b_closed).await;
    assert!(theirs.graceful, "the peer saw a failure: {theirs:?}");
    let landed = crate::region::test_access::view(&dst, 0, 4096).unwrap();
    assert!(landed.iter().all(|&b| b == 7), "the WRITE posted before the leave did not land");
}

/// A link that leaves while a large WRITE is on the wire finishes that frame first, so the peer
/// reads a whole frame and then the goodbye (the stream stays in step), not a broken frame.
#[tokio::test]
async fn a_goodbye_follows_the_frame_in_flight() {
    let (a_io, b_io) = tokio::io::duplex(1 << 16);
    let (b_regions, dst) = registered(4 << 20);
    let (a, _a_closed) = watched(0, a_io, RegionTable::new(), true);
    let (_b, b_closed) = watched(1, b_io, b_regions, true);
    let src = Region::alloc(4 << 20, Default::default()).unwrap();
    let h = a.post(vec![Op::write(&src, 0, dst.remote(0), 0, 4 << 20)]);
    // Let the writer start on the frame (the 64 KiB duplex makes it take many reads).
    tokio::task::yield_now().await;
    a.leave("done");
    let theirs = closed_within(b_closed).await;
    assert!(theirs.graceful, "the peer saw a failure: {theirs:?}");
    // The WRITE itself fails: its ack can no longer come back on a closed link.
    for r in h {
        assert!(matches!(r.await, Err(TransportError::PeerDown { .. })));
    }
}
