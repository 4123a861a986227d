//! Endpoint tests over real loopback sockets, in one process.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::config::ClusterSpec;
use crate::region::test_access as ta;
use crate::wire::Status;

fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let ls: Vec<_> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ls.iter().map(|l| l.local_addr().unwrap()).collect()
}

fn cluster(n: usize, tag: &str) -> ClusterSpec {
    let nodes =
        free_addrs(n).into_iter().enumerate().map(|(i, addr)| NodeSpec { id: i as NodeId, addr, host: None }).collect();
    ClusterSpec::new(format!("t-{tag}-{}", std::process::id()), nodes).unwrap()
}

fn fast(mut c: EndpointConfig, shm: bool) -> EndpointConfig {
    c.shm = shm;
    c.keepalive = Duration::from_millis(100);
    c.dead_after = Duration::from_millis(600);
    c.op_timeout = Duration::from_secs(10);
    c
}

async fn mesh(n: usize, shm: bool, tag: &str) -> Vec<Endpoint> {
    let c = cluster(n, tag);
    let mut eps = Vec::new();
    for i in 0..n {
        eps.push(Endpoint::start(fast(EndpointConfig::new(i as NodeId, c.clone(), b"secret"), shm)).await.unwrap());
    }
    for e in &eps {
        let rep = e.wait_ready(Duration::from_secs(10)).await.unwrap();
        assert_eq!(rep.peers.len(), n - 1);
    }
    eps
}

async fn one_sided(shm: bool) {
    let eps = mesh(2, shm, if shm { "os-shm" } else { "os-tcp" }).await;
    let want = if shm { BackendKind::Shm } else { BackendKind::Tcp };
    assert_eq!(eps[0].connected(), vec![(1, want)]);
    let dst = eps[1].register_new(1 << 20).unwrap();
    let src = eps[0].register_new(1 << 20).unwrap();
    for i in 0..(1u64 << 20) / 4096 {
        ta::fill(&src, i * 4096, 4096, (i % 200) as u8 + 1).unwrap();
    }
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 1 << 20).verified()]).await.unwrap();
    assert_eq!(r[0].as_ref().unwrap().bytes, 1 << 20);
    assert_eq!(ta::crc32(&dst, 0, 1 << 20).unwrap(), ta::crc32(&src, 0, 1 << 20).unwrap());

    // Readying the link for the region, then a WRITE that reports the crc of what it placed:
    // shm computes it during the copy, tcp leaves it to the receiver.
    let link = eps[0].link(1).unwrap();
    assert_eq!(link.prepare(dst.remote(1)).await.unwrap().bytes, 0);
    let odd = 3 * 65536 + 123; // not a whole number of the copy's blocks
    let r = eps[0].run(1, vec![Op::write(&src, 5, dst.remote(1), 7, odd).with_placed_crc()]).await.unwrap();
    let placed = r[0].as_ref().unwrap().crc;
    assert_eq!(placed, shm.then(|| ta::crc32(&dst, 7, odd).unwrap()));
    assert_eq!(ta::view(&dst, 7, odd).unwrap(), ta::view(&src, 5, odd).unwrap());
    // A region that does not exist cannot be readied.
    let mut gone = dst.remote(1);
    gone.id = crate::RegionId(u32::MAX - 1);
    if shm {
        assert!(link.prepare(gone).await.is_err());
    }
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 1 << 20)]).await.unwrap();
    assert_eq!(r[0].as_ref().unwrap().crc, None, "no crc unless asked");

    // READ back a slice, with and without verification.
    let back = eps[0].register_new(8192).unwrap();
    let r = eps[0]
        .run(
            1,
            vec![
                Op::read(&back, 0, dst.remote(1), 4096, 4096),
                Op::read(&back, 4096, dst.remote(1), 8192, 4096).verified(),
            ],
        )
        .await
        .unwrap();
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
    assert_eq!(ta::view(&back, 0, 8192).unwrap(), ta::view(&src, 4096, 8192).unwrap());

    // Refusals leave the target untouched.
    let before = ta::crc32(&dst, 0, 1 << 20).unwrap();
    let mut bad_key = dst.remote(1);
    bad_key.key = crate::RemoteKey(bad_key.key.0.wrapping_add(1));
    let mut unknown = dst.remote(1);
    unknown.id = crate::RegionId(u32::MAX);
    let r = eps[0]
        .run(
            1,
            vec![
                Op::write(&src, 0, bad_key, 0, 4096),
                Op::write(&src, 0, dst.remote(1), (1 << 20) - 100, 4096),
                Op::write(&src, 0, unknown, 0, 16),
                Op::read(&back, 0, bad_key, 0, 16),
                Op::read(&back, 0, dst.remote(1), 1 << 20, 1),
            ],
        )
        .await
        .unwrap();
    let statuses: Vec<_> = r
        .iter()
        .map(|x| match x {
            Err(TransportError::Refused { status, .. }) => *status,
            other => panic!("expected a refusal, got {other:?}"),
        })
        .collect();
    assert_eq!(
        statuses,
        [Status::BadKey, Status::OutOfBounds, Status::UnknownRegion, Status::BadKey, Status::OutOfBounds]
    );
    assert_eq!(ta::crc32(&dst, 0, 1 << 20).unwrap(), before);
    // The link survived the refusals.
    assert!(eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 16)]).await.unwrap()[0].is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_one_sided_operations() {
    one_sided(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_one_sided_operations() {
    one_sided(true).await;
}

/// A message posted in a WRITE's batch finds the WRITE's bytes in place when it arrives, though
/// each WRITE is large enough for the bulk lane that separately posted messages overtake.
async fn a_message_behind_a_write_finds_its_bytes(shm: bool) {
    use crate::service::{ServiceExt, ServiceFault};
    const ROUNDS: u64 = 16;
    const LEN: u64 = 4 << 20;
    let eps = mesh(2, shm, if shm { "order-shm" } else { "order-tcp" }).await;
    let mut inbox = eps[1].subscribe::<ServiceFault>(ROUNDS as usize).unwrap();
    let dst = eps[1].register_new(ROUNDS * LEN).unwrap();
    let src = eps[0].register_new(ROUNDS * LEN).unwrap();
    for k in 0..ROUNDS {
        ta::fill(&src, k * LEN, LEN, k as u8 + 1).unwrap();
    }
    let mut handles = Vec::new();
    // Posted back to back, without waiting: every round's bytes and message are in flight at once.
    for k in 0..ROUNDS {
        let write = Op::write(&src, k * LEN, dst.remote(1), k * LEN, LEN);
        let note = ServiceFault::Malformed { detail: k.to_string() };
        handles.extend(eps[0].post_oneway_after(1, vec![write], &note).unwrap());
    }
    for _ in 0..ROUNDS {
        let m = tokio::time::timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
        let ServiceFault::Malformed { detail } = m.msg else { panic!("unexpected {:?}", m.msg) };
        let k: u64 = detail.parse().unwrap();
        // The last byte lands last; a cheap look, so that a message that overtook its bytes is
        // caught before they land.
        let last = ta::view(&dst, (k + 1) * LEN - 1, 1).unwrap();
        assert_eq!(last[0], k as u8 + 1, "round {k}'s message arrived before its bytes");
    }
    for h in handles {
        h.await.unwrap();
    }
    for k in 0..ROUNDS {
        assert!(ta::view(&dst, k * LEN, LEN).unwrap().iter().all(|&b| b == k as u8 + 1));
    }
    // A WRITE that fails: the message behind it is still delivered, after the refusal, and its
    // receiver finds the bytes untouched.
    let mut bad_key = dst.remote(1);
    bad_key.key = crate::RemoteKey(bad_key.key.0.wrapping_add(1));
    let note = ServiceFault::Malformed { detail: "after a refused write".into() };
    let h = eps[0].post_oneway_after(1, vec![Op::write(&src, 0, bad_key, 0, LEN)], &note).unwrap();
    let mut r = Vec::new();
    for h in h {
        r.push(h.await);
    }
    assert!(matches!(r[0], Err(TransportError::Refused { status: Status::BadKey, .. })), "{r:?}");
    assert!(r[1].is_ok(), "{r:?}");
    assert!(tokio::time::timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().is_some());
    assert!(ta::view(&dst, 0, LEN).unwrap().iter().all(|&b| b == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_message_behind_a_write_finds_its_bytes() {
    a_message_behind_a_write_finds_its_bytes(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_a_message_behind_a_write_finds_its_bytes() {
    a_message_behind_a_write_finds_its_bytes(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_regions_over_shm_fall_back_to_the_stream() {
    let eps = mesh(2, true, "fallback").await;
    let dst = Region::alloc(4096, Default::default()).unwrap();
    eps[1].regions().register(&dst);
    let src = Region::alloc(4096, Default::default()).unwrap();
    ta::fill(&src, 0, 4096, 9).unwrap();
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 4096).verified()]).await.unwrap();
    assert!(r[0].is_ok(), "{r:?}");
    assert!(ta::view(&dst, 0, 4096).unwrap().iter().all(|&b| b == 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_and_events() {
    use crate::service::{ServiceExt, ServiceFault};
    let eps = mesh(3, false, "send").await;
    let mut inbox = eps[0].subscribe::<ServiceFault>(8).unwrap();
    let msg = |s: &str| ServiceFault::Malformed { detail: s.into() };
    eps[2].post_oneway(0, &msg("from two")).unwrap().await.unwrap();
    eps[1].post_oneway(0, &msg("from one")).unwrap().await.unwrap();
    let mut got = vec![];
    for _ in 0..2 {
        let m = inbox.recv().await.unwrap();
        got.push((m.from, m.msg));
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(got, vec![(1, msg("from one")), (2, msg("from two"))]);
    let too_big = Bytes::from(vec![0u8; (crate::wire::MAX_MESSAGE + 1) as usize]);
    let r = eps[1].run(0, vec![Op::Send { payload: too_big }]).await.unwrap();
    assert!(matches!(r[0], Err(TransportError::MessageTooLarge { .. })));
    // A service message over the limit is refused when it is posted, to a peer and to this node
    // alike (it failed only in its handle, and one to this node was delivered).
    let huge = msg(&"x".repeat((crate::wire::MAX_MESSAGE + 1) as usize));
    for to in [0, 1] {
        let Err(e) = eps[1].post_oneway(to, &huge) else { panic!("posted to {to}") };
        assert!(matches!(e, TransportError::MessageTooLarge { .. }), "to {to}: {e}");
    }
    let s = eps[0].stats();
    assert_eq!(s.len(), 2);
    // 16-byte envelope, 1-byte variant, 1-byte length, 8 bytes of text.
    assert!(s.iter().all(|p| p.stats.bytes_rx == 26), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_peer_is_reported_and_reconnected() {
    let c = cluster(2, "reconnect");
    let a = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"s"), false)).await.unwrap();
    let b = Endpoint::start(fast(EndpointConfig::new(1, c.clone(), b"s"), false)).await.unwrap();
    a.wait_ready(Duration::from_secs(5)).await.unwrap();
    let mut ev = a.events();
    b.shutdown();
    drop(b);
    // The Down comes within `dead_after` (0.6 s) at the latest; the wait is long because one CI
    // run on a loaded 2-core VM missed a 5 s one (not reproduced in 80 runs since). What was
    // heard is kept for the failure message.
    let mut heard = Vec::new();
    let down = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match ev.recv().await {
                Ok(PeerEvent::Down { peer, .. }) => return peer,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => panic!("events closed; heard {heard:?}"),
                other => heard.push(format!("{other:?}")),
            }
        }
    })
    .await;
    let down = down.unwrap_or_else(|_| panic!("no Down in 20 s; heard {heard:?}; connected {:?}", a.connected()));
    assert_eq!(down, 1);
    assert!(matches!(a.link(1), Err(TransportError::NotConnected { peer: 1 })));
    // The peer comes back on the same address: node 0 dials it again.
    let b = Endpoint::start(fast(EndpointConfig::new(1, c, b"s"), false)).await.unwrap();
    b.wait_ready(Duration::from_secs(10)).await.unwrap();
    a.wait_ready(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_never_connects() {
    let c = cluster(2, "secret");
    let a = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"right"), false)).await.unwrap();
    let _b = Endpoint::start(fast(EndpointConfig::new(1, c, b"wrong"), false)).await.unwrap();
    assert!(a.wait_ready(Duration::from_millis(800)).await.is_err());
    assert!(a.connected().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frame_after_handshake_closes_only_that_link() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Nodes 0 and 1 run; node 2's place is taken by a raw client that knows the secret.
    let c = cluster(3, "malformed");
    let a = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"s"), false)).await.unwrap();
    let b = Endpoint::start(fast(EndpointConfig::new(1, c.clone(), b"s"), false)).await.unwrap();
    let hcfg = HandshakeConfig {
        version: PROTOCOL_VERSION,
        node: 2,
        caps: Caps::TCP,
        secret: Arc::from(&b"s"[..]),
        timeout: Duration::from_secs(5),
    };
    for junk in [vec![0x42u8; 200], crate::wire::Header::new(crate::wire::Opcode::Write).encode()[..30].to_vec()] {
        let mut raw = TcpStream::connect(c.node(0).unwrap().addr).await.unwrap();
        handshake::dial(&mut raw, &hcfg, 0).await.unwrap();
        raw.write_all(&junk).await.unwrap();
        raw.shutdown().await.unwrap();
        // The endpoint drops this connection...
        let mut sink = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut sink)).await.unwrap().ok();
    }
    // ...and keeps serving node 1.
    let dst = a.register_new(4096).unwrap();
    let src = Region::alloc(4096, Default::default()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while b.link(0).is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    let r = b.run(0, vec![Op::write(&src, 0, dst.remote(0), 0, 4096).verified()]).await.unwrap();
    assert!(r[0].is_ok(), "{r:?}");
    assert!(a.connected().iter().any(|(p, _)| *p == 1));
    assert!(matches!(a.link(2), Err(TransportError::NotConnected { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_requested_without_a_device_falls_back_to_tcp() {
    let c = cluster(2, "rdma-fallback");
    let mut eps = Vec::new();
    for i in 0..2 {
        let mut cfg = fast(EndpointConfig::new(i, c.clone(), b"s"), false);
        cfg.rdma = true;
        eps.push(Endpoint::start(cfg).await.unwrap());
    }
    // This machine has no RDMA device (and the default build no RDMA support).
    if crate::rdma::probe().is_ok() {
        eprintln!("an RDMA device is present; the fallback is not exercised here");
        return;
    }
    assert!(!eps[0].caps().has(Caps::RDMA));
    eps[0].wait_ready(Duration::from_secs(5)).await.unwrap();
    assert_eq!(eps[0].connected(), vec![(1, BackendKind::Tcp)]);
    let dst = eps[1].register_new(4096).unwrap();
    let src = eps[0].register_new(4096).unwrap();
    assert!(eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 4096).verified()]).await.unwrap()[0].is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarts_on_its_address_at_once() {
    let c = cluster(2, "rebind");
    for _ in 0..5 {
        let e = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"s"), false)).await.unwrap();
        e.shutdown();
        drop(e); // the listener may still be open in its task: the next start must wait for it
    }
}

/// Starting a node that already runs on this host is refused, and the running node keeps its
/// same-host socket (it used to be deleted, silently pushing later peers onto tcp).
#[tokio::test]
async fn a_second_start_of_a_running_node_is_refused_and_leaves_its_socket() {
    let c = cluster(2, "twice");
    let first = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"secret"), true)).await.unwrap();
    let cfg = fast(EndpointConfig::new(0, c.clone(), b"secret"), true);
    let path = cfg.socket_path(0);
    let err = Endpoint::start(cfg).await.err().unwrap().to_string();
    assert!(err.contains("already runs"), "{err}");
    assert!(std::os::unix::net::UnixStream::connect(&path).is_ok(), "the running node's socket is gone");
    drop(first);
}

/// Clusters without a name (or with the same one) do not share socket paths.
#[test]
fn clusters_that_share_a_name_do_not_share_sockets() {
    let spec = |port: u16| {
        let nodes = vec![NodeSpec { id: 1, addr: SocketAddr::from(([127, 0, 0, 1], port)), host: None }];
        ClusterSpec::new("cascade", nodes).unwrap()
    };
    let a = EndpointConfig::new(1, spec(7001), b"s").socket_path(1);
    let b = EndpointConfig::new(1, spec(7002), b"s").socket_path(1);
    assert_ne!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_transfers_errors_and_peers() {
    let eps = mesh(2, false, "metrics").await;
    let dst = eps[1].register_new(8192).unwrap();
    let src = eps[0].register_new(8192).unwrap();
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 0, 8192), Op::read(&src, 0, dst.remote(1), 0, 100)]);
    assert!(r.await.unwrap().iter().all(|c| c.is_ok()));
    // Out of the peer's bounds: refused, counted as an error.
    let r = eps[0].run(1, vec![Op::write(&src, 0, dst.remote(1), 4096, 8192)]).await.unwrap();
    assert!(r[0].is_err());
    let text = eps[0].metrics().render();
    let has = |line: &str| assert!(text.contains(line), "missing {line:?} in\n{text}");
    has("cascade_transfer_bytes_total{op=\"write\",backend=\"tcp\",peer=\"1\"} 8192");
    has("cascade_transfer_bytes_total{op=\"read\",backend=\"tcp\",peer=\"1\"} 100");
    has("cascade_transfer_ops_total{op=\"write\",backend=\"tcp\",peer=\"1\"} 1");
    has("cascade_transfer_latency_seconds_count{op=\"write\",backend=\"tcp\"} 1");
    has("cascade_transfer_errors_total{op=\"write\",backend=\"tcp\",kind=\"");
    has("cascade_mesh_peers_up{backend=\"tcp\"} 1");
}

/// Test hooks inside the endpoint's code paths.
pub(super) mod hooks {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use crate::NodeId;

    struct Pause {
        cluster: String,
        node: NodeId,
        time: Duration,
        entered: Arc<AtomicBool>,
    }

    static PAUSES: Mutex<Vec<Pause>> = Mutex::new(Vec::new());

    /// Makes `node` of `cluster` stop for `time` (once) between spawning a link and entering
    /// it; the flag turns true when it stops there.
    pub(crate) fn pause_next_install(cluster: &str, node: NodeId, time: Duration) -> Arc<AtomicBool> {
        let entered = Arc::new(AtomicBool::new(false));
        PAUSES.lock().unwrap().push(Pause { cluster: cluster.into(), node, time, entered: entered.clone() });
        entered
    }

    pub(crate) fn pause_install(cluster: &str, node: NodeId) {
        let pause = {
            let mut p = PAUSES.lock().unwrap();
            p.iter().position(|x| x.cluster == cluster && x.node == node).map(|i| p.remove(i))
        };
        if let Some(p) = pause {
            p.entered.store(true, Ordering::SeqCst);
            std::thread::sleep(p.time);
        }
    }
}

async fn until(flag: &std::sync::atomic::AtomicBool) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while !flag.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
}

async fn next_down(ev: &mut broadcast::Receiver<PeerEvent>, within: Duration) -> Option<NodeId> {
    tokio::time::timeout(within, async {
        loop {
            match ev.recv().await {
                Ok(PeerEvent::Down { peer, .. }) => return peer,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
            }
        }
    })
    .await
    .ok()
}

/// Nodes 0 (`a`, its events subscribed) and 1 (`b`) of a fresh cluster, once node `paused` has
/// stopped between spawning its link to the other and entering it; then `b` shuts down.
async fn shut_down_while_installing(tag: &str, paused: NodeId) -> (Endpoint, broadcast::Receiver<PeerEvent>, Endpoint) {
    let c = cluster(2, tag);
    let stopped = hooks::pause_next_install(&c.name, paused, Duration::from_millis(300));
    let a = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"s"), false)).await.unwrap();
    let ev = a.events();
    let b = Endpoint::start(fast(EndpointConfig::new(1, c, b"s"), false)).await.unwrap();
    until(&stopped).await;
    b.shutdown();
    (a, ev, b)
}

/// An endpoint that shuts down while it installs a fresh link must close that link too: before
/// the fix the link was entered after `shutdown` had drained the table, and lived on (keepalives
/// and all), so its peer never heard `Down`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_installed_during_shutdown_is_closed() {
    // `b` is shut down but still held (dropping it would drop its table, and the link with it).
    let (_a, mut ev, b) = shut_down_while_installing("install-shutdown", 1).await;
    assert_eq!(
        next_down(&mut ev, Duration::from_secs(3)).await,
        Some(1),
        "the peer that shut down was never reported down"
    );
    assert!(b.connected().is_empty());
}

/// A link that closes between its spawn and its entry in the table must not be left there as a
/// live peer: before the fix its close found no entry to remove, so no `Down` was ever sent and
/// `link()` kept handing out a dead link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_that_closes_while_installed_is_reported_down() {
    let (a, mut ev, b) = shut_down_while_installing("install-closed", 0).await;
    drop(b);
    assert_eq!(
        next_down(&mut ev, Duration::from_secs(3)).await,
        Some(1),
        "a link that died while installed was never reported down"
    );
    assert!(matches!(a.link(1), Err(TransportError::NotConnected { peer: 1 })));
}

/// The next `Down` on `ev`, whole.
async fn next_down_event(ev: &mut broadcast::Receiver<PeerEvent>, within: Duration) -> PeerEvent {
    tokio::time::timeout(within, async {
        loop {
            match ev.recv().await {
                Ok(d @ PeerEvent::Down { .. }) => return d,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => panic!("events closed"),
            }
        }
    })
    .await
    .expect("no Down")
}

/// A node that leaves (`Endpoint::leave`) is reported by its peers as a departure, over tcp and
/// shm; its peers' pending operations and later calls fail as for any lost peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_is_reported_as_a_departure() {
    for shm in [false, true] {
        let eps = mesh(2, shm, if shm { "leave-shm" } else { "leave-tcp" }).await;
        let mut ev = eps[0].events();
        eps[1].leave().await;
        match next_down_event(&mut ev, Duration::from_secs(5)).await {
            PeerEvent::Down { peer, reason, graceful } => {
                assert_eq!(peer, 1);
                assert!(graceful, "shm {shm}: {reason}");
                assert_eq!(reason, "node 1 left: endpoint shut down");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(eps[0].link(1), Err(TransportError::NotConnected { peer: 1 })));
        let text = eps[0].metrics().render();
        assert!(text.contains("cascade_mesh_peer_losses_total{how=\"left\"} 1"), "{text}");
        assert!(!text.contains("how=\"failed\""), "{text}");
    }
}

/// Goodbyes on the wire, seen from a raw peer: an endpoint says goodbye when it shuts down only
/// to a peer that advertised `Caps::GOODBYE`, and a peer that vanishes without one, or falls
/// silent, is reported as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodbyes_go_only_to_peers_that_understand_them_and_silence_is_a_failure() {
    use tokio::io::AsyncReadExt;
    let raw_peer = |c: &ClusterSpec, caps: Caps| {
        let (addr, hcfg) = (
            c.node(0).unwrap().addr,
            HandshakeConfig {
                version: PROTOCOL_VERSION,
                node: 2,
                caps,
                secret: Arc::from(&b"s"[..]),
                timeout: Duration::from_secs(5),
            },
        );
        async move {
            let mut raw = TcpStream::connect(addr).await.unwrap();
            handshake::dial(&mut raw, &hcfg, 0).await.unwrap();
            raw
        }
    };
    // Until EOF: the opcodes node 0 sent (keepalives aside) and the payload of each.
    async fn frames(raw: &mut TcpStream) -> Vec<(crate::wire::Opcode, Vec<u8>)> {
        let mut got = Vec::new();
        let mut hb = [0u8; crate::wire::HEADER_LEN];
        while tokio::time::timeout(Duration::from_secs(5), raw.read_exact(&mut hb)).await.unwrap().is_ok() {
            let h = crate::wire::Header::decode(&hb).unwrap();
            let mut payload = vec![0u8; h.payload_len() as usize];
            raw.read_exact(&mut payload).await.unwrap();
            if h.op != crate::wire::Opcode::Ping {
                got.push((h.op, payload));
            }
        }
        got
    }
    for hears in [true, false] {
        let c = cluster(3, if hears { "bye-hears" } else { "bye-deaf" });
        // The raw peer sends no keepalives: node 0 must not declare it silent meanwhile.
        let mut cfg = fast(EndpointConfig::new(0, c.clone(), b"s"), false);
        cfg.dead_after = Duration::from_secs(30);
        let a = Endpoint::start(cfg).await.unwrap();
        let caps = if hears { Caps::TCP.with(Caps::GOODBYE) } else { Caps::TCP };
        let mut raw = raw_peer(&c, caps).await;
        tokio::time::timeout(Duration::from_secs(5), async {
            while a.link(2).is_err() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap();
        a.leave().await;
        let want = if hears { vec![(crate::wire::Opcode::Goodbye, b"endpoint shut down".to_vec())] } else { vec![] };
        assert_eq!(frames(&mut raw).await, want, "peer that hears goodbyes: {hears}");
    }
    // A peer that vanishes without a goodbye has failed.
    let c = cluster(3, "bye-vanish");
    let a = Endpoint::start(fast(EndpointConfig::new(0, c.clone(), b"s"), false)).await.unwrap();
    let mut ev = a.events();
    let raw = raw_peer(&c, Caps::TCP.with(Caps::GOODBYE)).await;
    tokio::time::timeout(Duration::from_secs(5), async {
        while a.link(2).is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    drop(raw);
    match next_down_event(&mut ev, Duration::from_secs(5)).await {
        PeerEvent::Down { peer: 2, graceful, reason } => assert!(!graceful, "{reason}"),
        other => panic!("{other:?}"),
    }
    // So has one that stays connected but says nothing past `dead_after` (0.6 s).
    let _silent = raw_peer(&c, Caps::TCP.with(Caps::GOODBYE)).await;
    match next_down_event(&mut ev, Duration::from_secs(10)).await {
        PeerEvent::Down { peer: 2, graceful, reason } => {
            assert!(!graceful && reason.contains("keepalive"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let text = a.metrics().render();
    assert!(text.contains("cascade_mesh_peer_losses_total{how=\"failed\"} 2"), "{text}");
}
