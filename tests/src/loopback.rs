//! In-process endpoints on loopback: `n` tcp endpoints forming a full mesh, for tests that drive
//! several cluster members from one process.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, NodeSpec};

/// `n` tcp endpoints (no shared memory) on free loopback ports, every one connected to every
/// other; `tweak` adjusts each endpoint's settings before it starts.
pub async fn endpoints(n: u32, tag: &str, tweak: impl Fn(&mut EndpointConfig)) -> anyhow::Result<Vec<Arc<Endpoint>>> {
    let addrs = crate::free_addrs(n as usize);
    if addrs.len() != n as usize {
        anyhow::bail!("could not reserve {n} loopback ports");
    }
    let nodes = addrs.iter().enumerate().map(|(i, a)| NodeSpec { id: i as u32, addr: *a, host: None }).collect();
    let c = ClusterSpec::new(format!("{tag}{}", std::process::id()), nodes)?;
    let mut eps = Vec::new();
    for i in 0..n {
        let mut cfg = EndpointConfig::new(i, c.clone(), b"s");
        cfg.shm = false;
        tweak(&mut cfg);
        eps.push(Arc::new(Endpoint::start(cfg).await.with_context(|| format!("starting endpoint {i}"))?));
    }
    for e in &eps {
        e.wait_ready(Duration::from_secs(10)).await.context("waiting for the loopback mesh")?;
    }
    Ok(eps)
}
