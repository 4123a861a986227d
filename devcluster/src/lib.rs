//! # cascade-devcluster
//!
//! Clusters for development and benchmarks on one machine, used at run time by `cascade demo`,
//! the multicast benchmark and the integration tests: [`netns::Netns`] makes N hosts as network
//! namespaces on a bridge with shaped links (root needed), [`free_addrs`] finds free loopback
//! ports. Nothing here is for production deployments.

use std::net::{SocketAddr, TcpListener};

pub mod netns;

/// Free loopback ports, reserved only for the moment of asking.
pub fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let ls: Vec<_> = (0..n).filter_map(|_| TcpListener::bind("127.0.0.1:0").ok()).collect();
    ls.iter().filter_map(|l| l.local_addr().ok()).collect()
}
