//! RDMA backend (cargo feature `rdma`).
//!
//! Without the feature, [`probe`] reports that the build has no RDMA support and endpoints use
//! tcp. See the feature-gated implementation for the queue-pair path.

use crate::error::{Result, TransportError};

/// Checks that an RDMA device can be opened.
#[cfg(not(feature = "rdma"))]
pub fn probe() -> Result<()> {
    Err(TransportError::NoRdmaDevice { detail: "built without the `rdma` feature".into() })
}
