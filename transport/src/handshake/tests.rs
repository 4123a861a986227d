use std::sync::Arc;

use super::*;

fn cfg(node: NodeId, secret: &[u8], version: u16) -> HandshakeConfig {
    HandshakeConfig { version, node, caps: Caps::TCP, secret: Arc::from(secret), timeout: Duration::from_secs(5) }
}

async fn run(
    d: HandshakeConfig,
    a: HandshakeConfig,
    expect: NodeId,
) -> (Result<PeerInfo, DriveError>, Result<PeerInfo, DriveError>) {
    let (mut x, mut y) = tokio::io::duplex(1024);
    tokio::join!(dial(&mut x, &d, expect), accept(&mut y, &a, |n| n < 10))
}

fn hs(r: Result<PeerInfo, DriveError>) -> HandshakeError {
    match r {
        Err(DriveError::Handshake(e)) => e,
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

#[tokio::test]
async fn same_secret_connects_both_ways() {
    let (d, a) = run(cfg(1, b"s3cret", 1), cfg(2, b"s3cret", 1), 2).await;
    assert_eq!(d.unwrap(), PeerInfo { node: 2, caps: Caps::TCP });
    assert_eq!(a.unwrap(), PeerInfo { node: 1, caps: Caps::TCP });
}

#[tokio::test]
async fn wrong_secret_is_refused_on_both_sides() {
    let (d, a) = run(cfg(1, b"right", 1), cfg(2, b"wrong", 1), 2).await;
    assert_eq!(hs(d), HandshakeError::AuthFailed);
    assert!(a.is_err());
}

#[tokio::test]
async fn version_mismatch_is_refused_with_both_versions() {
    let (d, a) = run(cfg(1, b"s", 2), cfg(2, b"s", 1), 2).await;
    assert_eq!(hs(d), HandshakeError::VersionMismatch { ours: 2, theirs: 1 });
    assert_eq!(hs(a), HandshakeError::VersionMismatch { ours: 1, theirs: 2 });
}

#[tokio::test]
async fn non_member_is_refused() {
    let (d, a) = run(cfg(42, b"s", 1), cfg(2, b"s", 1), 2).await;
    assert!(matches!(hs(d), HandshakeError::Refused(_)));
    assert_eq!(hs(a), HandshakeError::UnknownNode(42));
}

#[tokio::test]
async fn reaching_the_wrong_node_is_reported() {
    let (d, _a) = run(cfg(1, b"s", 1), cfg(3, b"s", 1), 2).await;
    assert_eq!(hs(d), HandshakeError::WrongPeer { expected: 2, found: 3 });
}

#[test]
fn proof_binds_role_nonces_and_ids() {
    let (n1, n2) = ([1u8; 32], [2u8; 32]);
    let p = proof(b"k", Role::Dialer, (1, &n1), (2, &n2));
    assert!(verify(b"k", Role::Dialer, (1, &n1), (2, &n2), &p));
    assert!(!verify(b"k", Role::Acceptor, (1, &n1), (2, &n2), &p), "a reflected proof must fail");
    assert!(!verify(b"k", Role::Dialer, (1, &n2), (2, &n1), &p));
    assert!(!verify(b"k", Role::Dialer, (3, &n1), (2, &n2), &p));
    assert!(!verify(b"K", Role::Dialer, (1, &n1), (2, &n2), &p));
}

#[test]
fn messages_round_trip() {
    let msgs = [
        Msg::Hello { version: 7, node: 3, expect: 9, caps: Caps(5), nonce: [4; 32] },
        Msg::HelloAck { version: 7, node: 9, caps: Caps(1), nonce: [8; 32], proof: [6; 32] },
        Msg::Proof { proof: [1; 32] },
        Msg::Accept,
        Msg::Reject { reason: RejectReason::Version(3) },
        Msg::Reject { reason: RejectReason::WrongPeer(11) },
        Msg::Reject { reason: RejectReason::Auth },
        Msg::Reject { reason: RejectReason::UnknownNode },
    ];
    for m in msgs {
        assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
    }
    assert!(Msg::decode(&[0u8; MSG_LEN]).is_err());
}
