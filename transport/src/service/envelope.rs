//! The envelope every control message travels in: service id, protocol version, kind and
//! request id, then the service's own body.
//!
//! ```text
//! offset  size  field
//! 0       2     service id (u16, little endian)
//! 2       2     version of the service's protocol the body is written in (u16, ≥ 1)
//! 4       1     kind: 0 one-way, 1 request, 2 reply, 3 error
//! 5       3     reserved, must be zero
//! 8       8     request id (u64; 0 for one-way messages and faults about them)
//! 16      ..    body (the service's message, or a ServiceFault for kind 3)
//! ```
//!
//! Decoding is total: every byte string either decodes or yields a typed [`EnvelopeError`].

use bytes::{BufMut, Bytes, BytesMut};

/// Encoded size of the envelope header.
pub const ENVELOPE_LEN: usize = 16;

/// Identifies a service on a node's endpoint. Each crate owns the ids of its services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ServiceId(pub u16);

impl ServiceId {
    /// The transport's own service: faults about envelopes (never subscribed).
    pub const TRANSPORT: ServiceId = ServiceId(0);
    /// Multicast control: requests from a controller to the nodes of a run.
    pub const MULTICAST: ServiceId = ServiceId(1);
    /// Multicast reports: what members tell their run's controller.
    pub const MULTICAST_REPORT: ServiceId = ServiceId(2);
    /// Multicast chunk notices between the members of a run.
    pub const MULTICAST_NOTICE: ServiceId = ServiceId(3);
    /// The parameter pool's node requests (load, drop, check, list, lend, keep).
    pub const POOL: ServiceId = ServiceId(4);
    /// Reserved for layer execution (exec).
    pub const EXEC: ServiceId = ServiceId(5);
    /// LLM serving with prefill/decode disaggregation (exec's `pd`).
    pub const LLM: ServiceId = ServiceId(6);
    /// Application messages: the C ABI's SEND/RECV (an opaque tag and bytes).
    pub const APP: ServiceId = ServiceId(7);
}

impl std::fmt::Display for ServiceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match *self {
            ServiceId::TRANSPORT => "transport",
            ServiceId::MULTICAST => "multicast",
            ServiceId::MULTICAST_REPORT => "multicast-report",
            ServiceId::MULTICAST_NOTICE => "multicast-notice",
            ServiceId::POOL => "pool",
            ServiceId::EXEC => "exec",
            ServiceId::LLM => "llm",
            ServiceId(n) => return write!(f, "service {n}"),
        };
        f.write_str(name)
    }
}

/// What an envelope carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A message that expects no answer.
    OneWay = 0,
    /// A request; the answer carries the same request id.
    Request = 1,
    /// The answer to a request.
    Reply = 2,
    /// The transport could not deliver a request: the body is a `ServiceFault`.
    Error = 3,
}

/// The fixed header of a control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    /// The service the message is for.
    pub service: ServiceId,
    /// The service protocol version of the body.
    pub version: u16,
    /// One-way, request, reply or error.
    pub kind: Kind,
    /// Matches a reply to its request (0 for one-way messages).
    pub request_id: u64,
}

/// Why bytes are not an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// Fewer bytes than the header.
    #[error("control message of {0} bytes is shorter than its 16-byte envelope")]
    Short(usize),
    /// Version 0 is never valid.
    #[error("control message with version 0")]
    ZeroVersion,
    /// The kind byte is not one of the four kinds.
    #[error("unknown control message kind {0}")]
    UnknownKind(u8),
    /// The reserved bytes are not zero.
    #[error("reserved envelope bytes are not zero")]
    Reserved,
    /// A one-way message with a request id, or a request or reply without one.
    #[error("request id {id} does not fit a {kind:?} message")]
    RequestId {
        /// The kind.
        kind: Kind,
        /// The id.
        id: u64,
    },
}

impl Envelope {
    /// Writes the header followed by `body`.
    pub fn encode(&self, body: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(ENVELOPE_LEN + body.len());
        b.put_u16_le(self.service.0);
        b.put_u16_le(self.version);
        b.put_u8(self.kind as u8);
        b.put_bytes(0, 3);
        b.put_u64_le(self.request_id);
        b.put_slice(body);
        b.freeze()
    }

    /// Splits a message into its header and body.
    pub fn decode(b: &[u8]) -> Result<(Envelope, &[u8]), EnvelopeError> {
        if b.len() < ENVELOPE_LEN {
            return Err(EnvelopeError::Short(b.len()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let version = u16_at(2);
        if version == 0 {
            return Err(EnvelopeError::ZeroVersion);
        }
        let kind = match b[4] {
            0 => Kind::OneWay,
            1 => Kind::Request,
            2 => Kind::Reply,
            3 => Kind::Error,
            k => return Err(EnvelopeError::UnknownKind(k)),
        };
        if b[5..8] != [0, 0, 0] {
            return Err(EnvelopeError::Reserved);
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        let request_id = u64::from_le_bytes(id);
        let id_ok = match kind {
            Kind::OneWay => request_id == 0,
            Kind::Request | Kind::Reply => request_id != 0,
            // A fault about a one-way message carries id 0.
            Kind::Error => true,
        };
        if !id_ok {
            return Err(EnvelopeError::RequestId { kind, id: request_id });
        }
        Ok((Envelope { service: ServiceId(u16_at(0)), version, kind, request_id }, &b[ENVELOPE_LEN..]))
    }
}
