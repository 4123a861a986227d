//! # cascade-transport
//!
//! Cascade's data plane: registered memory regions, one-sided READ/WRITE into peers' regions,
//! two-sided SEND/RECV, and a connection pool that pre-establishes a full mesh between the nodes
//! of a cluster before it reports ready.
//!
//! * [`Region`] / [`RegionTable`] — page-aligned (optionally `mlock`ed) or memfd-shared memory
//!   that peers address by id and key; every remote access is bounds- and key-checked.
//! * [`Link`] — the one trait every backend implements: post a batch of [`Op`]s, await their
//!   [`OpHandle`]s.
//! * Backends: `tcp` (framed protocol over sockets, payloads land straight in regions),
//!   `shm` (same host: a WRITE is one memcpy into the peer's mapping), `rdma` (feature `rdma`,
//!   see [`rdma`]), and [`mem`] — an in-process **test double** with programmable faults.
//! * [`service`] — the typed control plane: every message carries a service id, a version and a
//!   request id; each service has its own bounded inbox; replies are matched to calls by id.
//! * [`Endpoint`] — joins the cluster, picks the best backend per peer, authenticates peers with
//!   a shared secret (HMAC; the secret never crosses the wire), detects lost peers by keepalive,
//!   publishes [`PeerEvent`]s and reconnects with backoff.
//!
//! Safety rules: a remote access to an unknown region, with a wrong key or out of bounds is
//! refused with an error to the initiator and the target memory is untouched; a malformed frame
//! closes only its own connection; operations on a dead peer fail within the keepalive deadline.
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod accept;
pub mod background;
mod budget;
mod config;
pub mod device;
mod endpoint;
mod error;
mod frame;
pub mod handshake;
mod link;
pub mod mem;
mod mesh;
pub mod metrics;
mod onesided;
pub mod rdma;
mod region;
pub mod service;
mod shm;
pub mod stall;
mod stats;
pub mod stdout;
mod stream;
mod tcp;
pub mod wire;

/// Harnesses for `cargo fuzz` (feature `fuzzing`): not part of the API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::stream::fuzz::link_machine;
}

/// Identifies a node of the cluster.
pub type NodeId = u32;

pub use accept::{back_off_after_failed_accept, ACCEPT_BACKOFF};
pub use budget::{available as memory_available, spare as memory_to_spare, MemoryBudget, HEADROOM};
pub use config::{default_runtime_dir, select_backend, ClusterSpec, EndpointConfig, NodeSpec};
pub use endpoint::{Endpoint, MeshReport, PeerEvent, PeerStats};
pub use error::{HandshakeError, Result, TransportError};
pub use handshake::Caps;
pub use link::{run_batch, BackendKind, Completion, Link, Op, OpHandle};
pub use mesh::{register_new_blocking, BoxFuture, Mesh};
pub use metrics::Metrics;
#[cfg(any(test, feature = "test-access"))]
pub use region::test_access;
pub use region::{Prefault, Region, RegionId, RegionOptions, RegionTable, RemoteKey, RemoteRegion, PAGE};
pub use service::{Inbox, Message, Received, ReplyTo, ServiceExt, ServiceFault, ServiceId, Services};
pub use stall::{Stall, StallWatch};
pub use stats::StatsSnapshot;
