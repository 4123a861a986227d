//! Connection handshake: protocol version, node ids, capabilities, and mutual authentication.
//!
//! Both sides prove knowledge of the cluster secret with HMAC-SHA256 over fresh nonces from both
//! sides and both node ids; the secret itself never crosses the wire. The exchange:
//!
//! ```text
//! dialer   -> Hello    { version, node, expect, caps, nonce_d }
//! acceptor -> HelloAck { version, node, caps, nonce_a, proof_a = HMAC(s, "A"|nonce_d|nonce_a|d|a) }
//!          or Reject   { reason }                       (version, unknown node, wrong peer)
//! dialer   -> Proof    { proof_d = HMAC(s, "D"|nonce_a|nonce_d|d|a) }   (after checking proof_a)
//!          or Reject   { AuthFailed }
//! acceptor -> Accept | Reject { AuthFailed }
//! ```
//!
//! Message encoding and the proof are pure functions; [`dial`] and [`accept`] drive them over any
//! async stream.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::HandshakeError;
use crate::NodeId;

/// The wire protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 2;
/// Every handshake message is exactly this long.
pub const MSG_LEN: usize = 84;
const MAGIC: [u8; 4] = *b"CSHS";
const NONCE: usize = 32;

/// Capability bits a node advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Caps(pub u32);

impl Caps {
    /// Framed stream over TCP (always present).
    pub const TCP: Caps = Caps(1);
    /// Same-host shared memory.
    pub const SHM: Caps = Caps(2);
    /// An opened RDMA device.
    pub const RDMA: Caps = Caps(4);
    /// Understands [`Opcode::Goodbye`](crate::wire::Opcode::Goodbye): told when this node's
    /// peer closes a link on purpose, it reports a departure rather than a failure.
    pub const GOODBYE: Caps = Caps(8);

    /// True if all bits of `other` are set.
    pub fn has(self, other: Caps) -> bool {
        self.0 & other.0 == other.0
    }

    /// Union of two sets.
    pub fn with(self, other: Caps) -> Caps {
        Caps(self.0 | other.0)
    }
}

/// What a node presents in a handshake.
#[derive(Clone)]
pub struct HandshakeConfig {
    /// Protocol version spoken (normally [`PROTOCOL_VERSION`]).
    pub version: u16,
    /// Our node id.
    pub node: NodeId,
    /// Our capabilities.
    pub caps: Caps,
    /// The shared cluster secret.
    pub secret: std::sync::Arc<[u8]>,
    /// Time limit for the whole exchange.
    pub timeout: Duration,
}

/// What we learned about the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's node id.
    pub node: NodeId,
    /// The peer's capabilities.
    pub caps: Caps,
}

/// A handshake message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Dialer's opening.
    Hello {
        /// Protocol version.
        version: u16,
        /// Dialer's node id.
        node: NodeId,
        /// The node id the dialer means to reach.
        expect: NodeId,
        /// Dialer's capabilities.
        caps: Caps,
        /// Dialer's nonce.
        nonce: [u8; NONCE],
    },
    /// Acceptor's answer with its proof.
    HelloAck {
        /// Protocol version.
        version: u16,
        /// Acceptor's node id.
        node: NodeId,
        /// Acceptor's capabilities.
        caps: Caps,
        /// Acceptor's nonce.
        nonce: [u8; NONCE],
        /// HMAC proof of the acceptor.
        proof: [u8; 32],
    },
    /// Dialer's proof.
    Proof {
        /// HMAC proof of the dialer.
        proof: [u8; 32],
    },
    /// Final acceptance.
    Accept,
    /// Refusal.
    Reject {
        /// Why.
        reason: RejectReason,
    },
}

/// A refusal's reason, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Version mismatch; carries the refuser's version.
    Version(u16),
    /// Authentication failed.
    Auth,
    /// The dialer is not a member of the cluster.
    UnknownNode,
    /// The dialer expected another node id; carries the refuser's id.
    WrongPeer(NodeId),
}

impl Msg {
    /// Encodes to the fixed-size wire form.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        match self {
            Msg::Hello { version, node, expect, caps, nonce } => {
                b[4] = 1;
                b[5..7].copy_from_slice(&version.to_le_bytes());
                b[7..11].copy_from_slice(&node.to_le_bytes());
                b[11..15].copy_from_slice(&expect.to_le_bytes());
                b[15..19].copy_from_slice(&caps.0.to_le_bytes());
                b[19..51].copy_from_slice(nonce);
            }
            Msg::HelloAck { version, node, caps, nonce, proof } => {
                b[4] = 2;
                b[5..7].copy_from_slice(&version.to_le_bytes());
                b[7..11].copy_from_slice(&node.to_le_bytes());
                b[15..19].copy_from_slice(&caps.0.to_le_bytes());
                b[19..51].copy_from_slice(nonce);
                b[51..83].copy_from_slice(proof);
            }
            Msg::Proof { proof } => {
                b[4] = 3;
                b[51..83].copy_from_slice(proof);
            }
            Msg::Accept => b[4] = 4,
            Msg::Reject { reason } => {
                b[4] = 5;
                let (code, detail) = match reason {
                    RejectReason::Version(v) => (1u8, u32::from(*v)),
                    RejectReason::Auth => (2, 0),
                    RejectReason::UnknownNode => (3, 0),
                    RejectReason::WrongPeer(n) => (4, *n),
                };
                b[5] = code;
                b[7..11].copy_from_slice(&detail.to_le_bytes());
            }
        }
        b
    }

    /// Decodes a wire message.
    pub fn decode(b: &[u8; MSG_LEN]) -> Result<Msg, HandshakeError> {
        if b[0..4] != MAGIC {
            return Err(HandshakeError::Malformed("not a Cascade handshake (bad magic)"));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let arr32 = |i: usize| {
            let mut a = [0u8; 32];
            a.copy_from_slice(&b[i..i + 32]);
            a
        };
        Ok(match b[4] {
            1 => Msg::Hello {
                version: u16_at(5),
                node: u32_at(7),
                expect: u32_at(11),
                caps: Caps(u32_at(15)),
                nonce: arr32(19),
            },
            2 => Msg::HelloAck {
                version: u16_at(5),
                node: u32_at(7),
                caps: Caps(u32_at(15)),
                nonce: arr32(19),
                proof: arr32(51),
            },
            3 => Msg::Proof { proof: arr32(51) },
            4 => Msg::Accept,
            5 => Msg::Reject {
                reason: match b[5] {
                    1 => RejectReason::Version(u16_at(7)),
                    2 => RejectReason::Auth,
                    3 => RejectReason::UnknownNode,
                    4 => RejectReason::WrongPeer(u32_at(7)),
                    _ => return Err(HandshakeError::Malformed("unknown reject reason")),
                },
            },
            _ => return Err(HandshakeError::Malformed("unknown message type")),
        })
    }
}

/// Which side computes a proof.
#[derive(Debug, Clone, Copy)]
pub enum Role {
    /// The side that opened the connection.
    Dialer,
    /// The side that accepted it.
    Acceptor,
}

/// HMAC-SHA256 proof of the secret, bound to both nonces, both node ids and the role.
pub fn proof(secret: &[u8], role: Role, dialer: (NodeId, &[u8; NONCE]), acceptor: (NodeId, &[u8; NONCE])) -> [u8; 32] {
    mac(secret, role, dialer, acceptor).finalize().into_bytes().into()
}

/// Checks a proof in constant time.
pub fn verify(
    secret: &[u8],
    role: Role,
    dialer: (NodeId, &[u8; NONCE]),
    acceptor: (NodeId, &[u8; NONCE]),
    proof: &[u8; 32],
) -> bool {
    mac(secret, role, dialer, acceptor).verify_slice(proof).is_ok()
}

fn mac(secret: &[u8], role: Role, d: (NodeId, &[u8; NONCE]), a: (NodeId, &[u8; NONCE])) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    match role {
        Role::Acceptor => {
            m.update(b"cascade-acceptor");
            m.update(d.1);
            m.update(a.1);
        }
        Role::Dialer => {
            m.update(b"cascade-dialer");
            m.update(a.1);
            m.update(d.1);
        }
    }
    m.update(&d.0.to_le_bytes());
    m.update(&a.0.to_le_bytes());
    m
}

/// Interprets a refusal received from the peer.
pub fn rejection(reason: RejectReason, ours: &HandshakeConfig, expect: Option<NodeId>) -> HandshakeError {
    match reason {
        RejectReason::Version(theirs) => HandshakeError::VersionMismatch { ours: ours.version, theirs },
        RejectReason::Auth => HandshakeError::AuthFailed,
        RejectReason::UnknownNode => {
            HandshakeError::Refused(format!("node {} is not a member of its cluster", ours.node))
        }
        RejectReason::WrongPeer(found) => HandshakeError::WrongPeer { expected: expect.unwrap_or(found), found },
    }
}

fn nonce() -> Result<[u8; NONCE], HandshakeError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|_| HandshakeError::Malformed("the OS random source failed"))?;
    Ok(n)
}

/// Errors of a driven handshake: protocol-level, or I/O.
#[derive(Debug)]
pub enum DriveError {
    /// The handshake itself failed.
    Handshake(HandshakeError),
    /// The stream failed or timed out.
    Io(std::io::Error),
}

impl From<HandshakeError> for DriveError {
    fn from(e: HandshakeError) -> Self {
        DriveError::Handshake(e)
    }
}
impl From<std::io::Error> for DriveError {
    fn from(e: std::io::Error) -> Self {
        DriveError::Io(e)
    }
}

async fn send<S: AsyncWrite + Unpin>(s: &mut S, m: &Msg) -> std::io::Result<()> {
    s.write_all(&m.encode()).await?;
    s.flush().await
}

async fn recv<S: AsyncRead + Unpin>(s: &mut S) -> Result<Msg, DriveError> {
    let mut b = [0u8; MSG_LEN];
    s.read_exact(&mut b).await?;
    Ok(Msg::decode(&b)?)
}

async fn timed<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, DriveError>>,
) -> Result<T, DriveError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| DriveError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake timed out")))?
}

/// Runs the dialer's side against `expect`.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    cfg: &HandshakeConfig,
    expect: NodeId,
) -> Result<PeerInfo, DriveError> {
    timed(cfg.timeout, async {
        let nd = nonce()?;
        send(s, &Msg::Hello { version: cfg.version, node: cfg.node, expect, caps: cfg.caps, nonce: nd }).await?;
        let (peer, caps, na) = match recv(s).await? {
            Msg::HelloAck { version, node, caps, nonce, proof } => {
                if version != cfg.version {
                    return Err(HandshakeError::VersionMismatch { ours: cfg.version, theirs: version }.into());
                }
                if node != expect {
                    return Err(HandshakeError::WrongPeer { expected: expect, found: node }.into());
                }
                if !verify(&cfg.secret, Role::Acceptor, (cfg.node, &nd), (node, &nonce), &proof) {
                    send(s, &Msg::Reject { reason: RejectReason::Auth }).await?;
                    return Err(HandshakeError::AuthFailed.into());
                }
                (node, caps, nonce)
            }
            Msg::Reject { reason } => return Err(rejection(reason, cfg, Some(expect)).into()),
            _ => return Err(HandshakeError::Malformed("expected HelloAck").into()),
        };
        let p = proof(&cfg.secret, Role::Dialer, (cfg.node, &nd), (peer, &na));
        send(s, &Msg::Proof { proof: p }).await?;
        match recv(s).await? {
            Msg::Accept => Ok(PeerInfo { node: peer, caps }),
            Msg::Reject { reason } => Err(rejection(reason, cfg, Some(expect)).into()),
            _ => Err(HandshakeError::Malformed("expected Accept").into()),
        }
    })
    .await
}

/// Runs the acceptor's side; `is_member` says whether a node id belongs to the cluster.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    cfg: &HandshakeConfig,
    is_member: impl Fn(NodeId) -> bool,
) -> Result<PeerInfo, DriveError> {
    timed(cfg.timeout, async {
        let (peer, caps, nd) = match recv(s).await? {
            Msg::Hello { version, node, expect, caps, nonce } => {
                let refuse = if version != cfg.version {
                    Some((
                        RejectReason::Version(cfg.version),
                        HandshakeError::VersionMismatch { ours: cfg.version, theirs: version },
                    ))
                } else if expect != cfg.node {
                    Some((
                        RejectReason::WrongPeer(cfg.node),
                        HandshakeError::Refused(format!("dialer expected node {expect}")),
                    ))
                } else if !is_member(node) || node == cfg.node {
                    Some((RejectReason::UnknownNode, HandshakeError::UnknownNode(node)))
                } else {
                    None
                };
                if let Some((reason, err)) = refuse {
                    send(s, &Msg::Reject { reason }).await?;
                    return Err(err.into());
                }
                (node, caps, nonce)
            }
            _ => return Err(HandshakeError::Malformed("expected Hello").into()),
        };
        let na = nonce()?;
        let p = proof(&cfg.secret, Role::Acceptor, (peer, &nd), (cfg.node, &na));
        send(s, &Msg::HelloAck { version: cfg.version, node: cfg.node, caps: cfg.caps, nonce: na, proof: p }).await?;
        match recv(s).await? {
            Msg::Proof { proof } if verify(&cfg.secret, Role::Dialer, (peer, &nd), (cfg.node, &na), &proof) => {
                send(s, &Msg::Accept).await?;
                Ok(PeerInfo { node: peer, caps })
            }
            Msg::Proof { .. } => {
                send(s, &Msg::Reject { reason: RejectReason::Auth }).await?;
                Err(HandshakeError::AuthFailed.into())
            }
            Msg::Reject { reason } => Err(rejection(reason, cfg, None).into()),
            _ => Err(HandshakeError::Malformed("expected Proof").into()),
        }
    })
    .await
}

#[cfg(test)]
mod tests;
