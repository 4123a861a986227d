//! Helpers shared by this crate's tests.

use std::sync::Arc;

use cascade_transport::Endpoint;

/// `n` tcp endpoints on loopback forming a full mesh, ready.
pub(crate) async fn loopback_endpoints(n: u32, tag: &str) -> Vec<Arc<Endpoint>> {
    cascade_tests::loopback::endpoints(n, tag, |_| {}).await.unwrap()
}
