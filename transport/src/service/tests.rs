use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

use super::*;
use crate::link::Op;
use crate::mem::MemFabric;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Echo {
    Ping(u32),
    Pong(u32),
    Slow(u32),
}
crate::binary_message!(Echo, ServiceId(100), 2);

/// The same service id, but a client that speaks a newer version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum EchoV3 {
    Ping(u32),
}
crate::binary_message!(EchoV3, ServiceId(100), 3);

/// An echo server on `node`: Ping(n) → Pong(n); Slow(n) answers after 300 ms.
fn serve(node: &Arc<crate::mem::MemNode>) {
    let mut inbox = node.subscribe::<Echo>(16).unwrap();
    let n = node.clone();
    tokio::spawn(async move {
        while let Some(m) = inbox.recv().await {
            let to = m.reply_to.unwrap();
            match m.msg {
                Echo::Ping(x) => n.reply(&to, &Echo::Pong(x)).unwrap(),
                Echo::Slow(x) => {
                    let n = n.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        n.reply(&to, &Echo::Pong(x)).unwrap();
                    });
                }
                Echo::Pong(_) => {}
            }
        }
    });
}

fn two() -> (MemFabric, Arc<crate::mem::MemNode>, Arc<crate::mem::MemNode>) {
    let f = MemFabric::new();
    let a = Arc::new(f.add_node(1));
    let b = Arc::new(f.add_node(2));
    (f, a, b)
}

#[tokio::test]
async fn calls_are_matched_by_id() {
    let (_f, a, b) = two();
    serve(&b);
    let limit = Duration::from_secs(5);
    let (x, y) = tokio::join!(a.call(2, &Echo::Ping(7), limit), a.call(2, &Echo::Ping(8), limit));
    assert_eq!((x.unwrap(), y.unwrap()), (Echo::Pong(7), Echo::Pong(8)));
    assert_eq!(a.services().stats().replies, 2);
}

#[tokio::test]
async fn a_late_reply_is_dropped_and_counted_not_given_to_the_next_call() {
    let (_f, a, b) = two();
    serve(&b);
    let r = a.call(2, &Echo::Slow(1), Duration::from_millis(50)).await;
    assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
    // The next call is answered with its own reply, even though the late one arrives first.
    let slow_then_fast = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.call(2, &Echo::Ping(2), Duration::from_secs(5)).await
    };
    assert_eq!(slow_then_fast.await.unwrap(), Echo::Pong(2));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(a.services().stats().late_replies, 1);
}

#[tokio::test]
async fn unknown_service_is_a_typed_error_back() {
    let (_f, a, _b) = two();
    let r = a.call(2, &Echo::Ping(1), Duration::from_secs(5)).await;
    match r {
        Err(TransportError::Service { peer: 2, service, fault: ServiceFault::UnknownService }) => {
            assert_eq!(service, ServiceId(100))
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_newer_version_is_refused_and_the_service_keeps_working() {
    let (_f, a, b) = two();
    serve(&b);
    let r = a.call(2, &EchoV3::Ping(1), Duration::from_secs(5)).await;
    assert!(
        matches!(r, Err(TransportError::Service { fault: ServiceFault::UnsupportedVersion { supported: 2 }, .. })),
        "{r:?}"
    );
    assert_eq!(a.call(2, &Echo::Ping(3), Duration::from_secs(5)).await.unwrap(), Echo::Pong(3));
    assert_eq!(b.services().stats().refused, 1);
}

#[tokio::test]
async fn a_malformed_body_is_refused() {
    let (_f, a, b) = two();
    serve(&b);
    let (id, rx) = a.services().register_call(2, ServiceId(100));
    let env = Envelope { service: ServiceId(100), version: 2, kind: Kind::Request, request_id: id };
    let link = a.link(2).unwrap();
    drop(link.post(vec![Op::Send { payload: env.encode(&[9, 9, 9]) }]));
    let r = tokio::time::timeout(Duration::from_secs(5), rx).await.unwrap().unwrap();
    assert!(matches!(r, Err(TransportError::Service { fault: ServiceFault::Malformed { .. }, .. })), "{r:?}");
    // A one-way message for a service nobody runs: the sender is told, and counts it.
    let oneway = Envelope { service: ServiceId(77), version: 1, kind: Kind::OneWay, request_id: 0 };
    drop(link.post(vec![Op::Send { payload: oneway.encode(&[]) }]));
    tokio::time::timeout(Duration::from_secs(5), async {
        while a.services().stats().faults_received == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_call_fails_at_once_when_its_peer_dies() {
    let (f, a, b) = two();
    serve(&b);
    let call = a.call(2, &Echo::Slow(1), Duration::from_secs(30));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        f.kill(2);
    };
    let t = std::time::Instant::now();
    let (r, ()) = tokio::join!(call, kill);
    assert!(matches!(r, Err(TransportError::PeerDown { peer: 2, .. })), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn one_subscription_per_service() {
    let (_f, a, _b) = two();
    let first = a.subscribe::<Echo>(1).unwrap();
    assert!(a.subscribe::<Echo>(1).is_err());
    drop(first);
    assert!(a.subscribe::<Echo>(1).is_ok());
}

#[tokio::test]
async fn a_full_inbox_holds_the_sender_back_instead_of_dropping() {
    let (_f, a, b) = two();
    let mut inbox = b.subscribe::<Echo>(2).unwrap();
    for i in 0..50 {
        drop(a.post_oneway(2, &Echo::Ping(i)).unwrap());
    }
    for i in 0..50 {
        let m = tokio::time::timeout(Duration::from_secs(5), inbox.recv()).await.unwrap().unwrap();
        assert_eq!(m.msg, Echo::Ping(i));
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Golden samples under `testdata/envelope.txt`: the encoder writes them byte for byte and the
/// decoder reads them back.
#[test]
fn golden_envelopes() {
    let text = include_str!("../../testdata/envelope.txt");
    let golden: HashMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut it = l.split_whitespace();
            (it.next().unwrap(), it.next().unwrap())
        })
        .collect();
    let cases: Vec<(&str, Envelope, Vec<u8>)> = vec![
        (
            "request_multicast_v1",
            Envelope { service: ServiceId::MULTICAST, version: 1, kind: Kind::Request, request_id: 0x0102030405060708 },
            b"body".to_vec(),
        ),
        (
            "oneway_pool_v3",
            Envelope { service: ServiceId::POOL, version: 3, kind: Kind::OneWay, request_id: 0 },
            vec![],
        ),
        (
            "reply_exec_v1",
            Envelope { service: ServiceId::EXEC, version: 1, kind: Kind::Reply, request_id: 42 },
            vec![0xff],
        ),
        (
            "error_unknown_service",
            Envelope { service: ServiceId(7), version: 1, kind: Kind::Error, request_id: 5 },
            vec![],
        ),
    ];
    for (name, env, body) in cases {
        let bytes = env.encode(&body);
        assert_eq!(hex(&bytes), golden[name], "{name}");
        let (back, rest) = Envelope::decode(&unhex(golden[name])).map(|(e, r)| (e, r.to_vec())).unwrap();
        assert_eq!((back, rest), (env, body), "{name}");
    }
    let faults = [
        ("fault_unknown_service", ServiceFault::UnknownService),
        ("fault_unsupported_v2", ServiceFault::UnsupportedVersion { supported: 2 }),
        ("fault_malformed", ServiceFault::Malformed { detail: "bad".into() }),
    ];
    for (name, f) in faults {
        assert_eq!(hex(&f.encode_body()), golden[name], "{name}");
        assert_eq!(ServiceFault::decode_body(1, &unhex(golden[name])).unwrap(), f, "{name}");
    }
}

#[test]
fn envelope_decoding_rejects_what_it_must() {
    let ok = Envelope { service: ServiceId(1), version: 1, kind: Kind::Request, request_id: 9 }.encode(b"x");
    assert!(Envelope::decode(&ok[..15]).is_err());
    let mut b = ok.to_vec();
    b[2] = 0;
    b[3] = 0;
    assert_eq!(Envelope::decode(&b).unwrap_err(), EnvelopeError::ZeroVersion);
    let mut b = ok.to_vec();
    b[4] = 4;
    assert_eq!(Envelope::decode(&b).unwrap_err(), EnvelopeError::UnknownKind(4));
    let mut b = ok.to_vec();
    b[6] = 1;
    assert_eq!(Envelope::decode(&b).unwrap_err(), EnvelopeError::Reserved);
    let mut b = ok.to_vec();
    b[8..16].fill(0);
    assert!(matches!(Envelope::decode(&b), Err(EnvelopeError::RequestId { .. })));
    // Trailing bytes after a message body are refused too.
    assert!(decode_binary::<Echo>(ServiceId(100), &[0, 1, 0]).is_err());
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::OneWay), Just(Kind::Request), Just(Kind::Reply), Just(Kind::Error)]
}

proptest! {
    #[test]
    fn envelopes_round_trip(service in any::<u16>(), version in 1u16.., kind in kind(), id in 1u64.., body in proptest::collection::vec(any::<u8>(), 0..64)) {
        let id = if kind == Kind::OneWay { 0 } else { id };
        let env = Envelope { service: ServiceId(service), version, kind, request_id: id };
        let bytes = env.encode(&body);
        let (back, rest) = Envelope::decode(&bytes).unwrap();
        prop_assert_eq!(back, env);
        prop_assert_eq!(rest, &body[..]);
    }

    #[test]
    fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Ok((_, body)) = Envelope::decode(&bytes) {
            let _ = ServiceFault::decode_body(1, body);
            let _ = Echo::decode_body(2, body);
        }
    }

    #[test]
    fn echo_messages_round_trip(n in any::<u32>()) {
        for m in [Echo::Ping(n), Echo::Pong(n), Echo::Slow(n)] {
            prop_assert_eq!(Echo::decode_body(2, &m.encode_body()).unwrap(), m);
        }
        let _ = Bytes::new();
    }
}

#[tokio::test]
async fn a_node_calls_its_own_services_in_order() {
    let (_f, a, _b) = two();
    serve(&a);
    let limit = Duration::from_secs(5);
    assert_eq!(a.call(1, &Echo::Ping(3), limit).await.unwrap(), Echo::Pong(3));
    // One-way messages to itself arrive in the order posted.
    #[derive(Debug, Serialize, Deserialize)]
    struct Note(u32);
    crate::binary_message!(Note, ServiceId(101), 1);
    let mut inbox = a.subscribe::<Note>(64).unwrap();
    for i in 0..32 {
        a.post_oneway(1, &Note(i)).unwrap();
    }
    for i in 0..32 {
        let m = inbox.recv().await.unwrap();
        assert_eq!((m.from, m.msg.0), (1, i));
    }
    // A version the node's service does not read: the call fails with the fault, as from a peer.
    let r = a.call(1, &EchoV3::Ping(1), limit).await;
    assert!(matches!(r, Err(TransportError::Service { fault: ServiceFault::UnsupportedVersion { .. }, .. })), "{r:?}");
}
