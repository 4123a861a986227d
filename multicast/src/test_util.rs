//! Helpers shared by this crate's tests.

use std::sync::Arc;
use std::time::Duration;

use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, NodeSpec};

/// `n` tcp endpoints on loopback forming a full mesh, ready.
pub(crate) async fn loopback_endpoints(n: u32, tag: &str) -> Vec<Arc<Endpoint>> {
    let ls: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let nodes = ls
        .iter()
        .enumerate()
        .map(|(i, l)| NodeSpec { id: i as u32, addr: l.local_addr().unwrap(), host: None })
        .collect();
    drop(ls);
    let c = ClusterSpec::new(format!("{tag}{}", std::process::id()), nodes).unwrap();
    let mut eps = Vec::new();
    for i in 0..n {
        let mut cfg = EndpointConfig::new(i, c.clone(), b"s");
        cfg.shm = false;
        eps.push(Arc::new(Endpoint::start(cfg).await.unwrap()));
    }
    for e in &eps {
        e.wait_ready(Duration::from_secs(10)).await.unwrap();
    }
    eps
}
