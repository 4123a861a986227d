//! Typed errors of the transport.

use std::time::Duration;

use crate::wire::{FrameError, Status};
use crate::NodeId;

/// Result alias used throughout the transport.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// Our protocol version.
        ours: u16,
        /// The peer's protocol version.
        theirs: u16,
    },
    /// The peer could not prove knowledge of the cluster secret (or refused ours).
    #[error("authentication failed: the peer does not share this cluster's secret")]
    AuthFailed,
    /// The peer at this address is not the node we meant to reach.
    #[error("reached node {found}, expected node {expected}")]
    WrongPeer {
        /// The node id we dialed.
        expected: NodeId,
        /// The node id that answered.
        found: NodeId,
    },
    /// The peer's node id is not a member of our cluster.
    #[error("node {0} is not a member of this cluster")]
    UnknownNode(NodeId),
    /// The bytes received are not a handshake message.
    #[error("malformed handshake message: {0}")]
    Malformed(&'static str),
    /// The peer refused us with the given reason.
    #[error("refused by peer: {0}")]
    Refused(String),
}

/// Every error the transport reports. Each variant carries the context needed to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A local access outside a region.
    #[error("access [{offset}, {offset}+{len}) is outside region {region} of {region_len} bytes")]
    OutOfBounds {
        /// Region id.
        region: u32,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The peer refused a one-sided operation; its memory was not touched.
    #[error("{op} on node {peer} refused: {status}")]
    Refused {
        /// The peer that refused.
        peer: NodeId,
        /// The operation ("write", "read", ...).
        op: &'static str,
        /// The status it answered with.
        status: Status,
    },
    /// The data arrived but its crc32 does not match the sender's.
    #[error("{op} with node {peer}: crc32 mismatch (expected {expected:#010x}, got {actual:#010x})")]
    CrcMismatch {
        /// Peer involved.
        peer: NodeId,
        /// The operation.
        op: &'static str,
        /// crc32 computed by the sender.
        expected: u32,
        /// crc32 of what arrived.
        actual: u32,
    },
    /// The connection to the peer is down; pending operations were failed.
    #[error("node {peer} is down: {reason}")]
    PeerDown {
        /// The lost peer.
        peer: NodeId,
        /// Why the link was declared down.
        reason: String,
    },
    /// No link to this peer exists (not a member, or not connected yet).
    #[error("no connection to node {peer}")]
    NotConnected {
        /// The peer.
        peer: NodeId,
    },
    /// An operation did not complete in time.
    #[error("{op} with node {peer} timed out after {after:?}")]
    Timeout {
        /// Peer involved.
        peer: NodeId,
        /// The operation.
        op: &'static str,
        /// The time limit.
        after: Duration,
    },
    /// The full mesh did not come up in time.
    #[error("nodes {missing:?} did not connect within {after:?}")]
    MeshIncomplete {
        /// The members still missing.
        missing: Vec<NodeId>,
        /// The time limit.
        after: Duration,
    },
    /// A message exceeds the largest SEND the transport accepts.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Message length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The peer violated the wire protocol; only that connection was closed.
    #[error("protocol error with node {peer:?}: {detail}")]
    Protocol {
        /// The peer, when known.
        peer: Option<NodeId>,
        /// What was wrong.
        detail: String,
    },
    /// A frame could not be decoded.
    #[error("bad frame from node {peer:?}: {error}")]
    Frame {
        /// The peer, when known.
        peer: Option<NodeId>,
        /// The decoding error. Part of the message, not a `source()`, so an error chain prints it once.
        error: FrameError,
    },
    /// The connection handshake failed.
    #[error("handshake with {peer} failed: {error}")]
    Handshake {
        /// Address or node id of the peer.
        peer: String,
        /// Why. Part of the message, not a `source()`, so an error chain prints it once.
        error: HandshakeError,
    },
    /// A node's service table could not deliver a control message (see `service`).
    #[error("node {peer}, {service} service: {fault}")]
    Service {
        /// The node that answered.
        peer: NodeId,
        /// The service addressed.
        service: crate::service::ServiceId,
        /// What it answered.
        fault: crate::service::ServiceFault,
    },
    /// Invalid configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// A region that does not fit in the node's memory budget (nothing was allocated).
    #[error("a region of {want} bytes does not fit: {free} bytes free under {by}")]
    Capacity {
        /// Bytes asked for.
        want: u64,
        /// Bytes that would fit.
        free: u64,
        /// Which bound refused it.
        by: &'static str,
    },
    /// No RDMA device could be opened.
    #[error("no RDMA device: {detail}")]
    NoRdmaDevice {
        /// What was tried.
        detail: String,
    },
    /// Device (GPU) memory: none available, or an operation on it failed.
    #[error("device memory: {0}")]
    Device(String),
    /// An operating-system call failed.
    #[error("{context}: {error}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error. Part of the message, not a `source()`, so an error chain prints it once.
        error: std::io::Error,
    },
}

impl TransportError {
    /// The variant's short name, a label value for metrics (`out_of_bounds`, `timeout`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            TransportError::OutOfBounds { .. } => "out_of_bounds",
            TransportError::Refused { .. } => "refused",
            TransportError::CrcMismatch { .. } => "crc_mismatch",
            TransportError::PeerDown { .. } => "peer_down",
            TransportError::NotConnected { .. } => "not_connected",
            TransportError::Timeout { .. } => "timeout",
            TransportError::MeshIncomplete { .. } => "mesh_incomplete",
            TransportError::MessageTooLarge { .. } => "message_too_large",
            TransportError::Protocol { .. } => "protocol",
            TransportError::Frame { .. } => "frame",
            TransportError::Handshake { .. } => "handshake",
            TransportError::Service { .. } => "service",
            TransportError::Config(_) => "config",
            TransportError::Capacity { .. } => "capacity",
            TransportError::NoRdmaDevice { .. } => "no_rdma_device",
            TransportError::Device(_) => "device",
            TransportError::Io { .. } => "io",
        }
    }

    /// The node that answered "no such service": its link is up, but nothing there serves the
    /// service called (it stopped — a node shutting down drops its services before its links —
    /// or never started). Retrying the same node at once cannot help.
    pub fn no_such_service(&self) -> Option<NodeId> {
        match self {
            TransportError::Service { peer, fault: crate::service::ServiceFault::UnknownService, .. } => Some(*peer),
            _ => None,
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, error: std::io::Error) -> Self {
        TransportError::Io { context: context.into(), error }
    }
}
