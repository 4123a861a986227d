//! Cluster membership and endpoint settings.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Result, TransportError};
use crate::handshake::Caps;
use crate::link::BackendKind;
use crate::NodeId;

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Unique node id.
    pub id: NodeId,
    /// Address its TCP listener binds and peers dial: an IP address and a port (host names are
    /// not resolved).
    #[serde(deserialize_with = "socket_addr")]
    pub addr: SocketAddr,
    /// Name of the machine it runs on; nodes with the same host talk over shared memory.
    /// Defaults to the address's IP.
    #[serde(default)]
    pub host: Option<String>,
}

/// An `IP:port` address, with a refusal that says what is expected: serde's own said only
/// "invalid socket address syntax", also for a host name.
fn socket_addr<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<SocketAddr, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(|_| {
        serde::de::Error::custom(format!(
            "{text:?} is not an IP address and port (such as \"10.0.0.1:7400\" or \"[::1]:7400\"; host names are not resolved)"
        ))
    })
}

impl NodeSpec {
    /// The host identity used for same-host detection.
    pub fn host_key(&self) -> String {
        self.host.clone().unwrap_or_else(|| self.addr.ip().to_string())
    }
}

/// The cluster's membership, loaded directly or from a TOML file:
///
/// ```toml
/// name = "prod-a"
/// [[nodes]]
/// id = 0
/// addr = "10.0.0.1:7400"
/// host = "gpu-host-1"   # optional
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Cluster name; scopes the local socket names.
    #[serde(default = "default_name")]
    pub name: String,
    /// Members.
    pub nodes: Vec<NodeSpec>,
}

fn default_name() -> String {
    "cascade".into()
}

impl ClusterSpec {
    /// Builds and validates a cluster from its members.
    pub fn new(name: impl Into<String>, nodes: Vec<NodeSpec>) -> Result<ClusterSpec> {
        let c = ClusterSpec { name: name.into(), nodes };
        c.validate()?;
        Ok(c)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<ClusterSpec> {
        let c: ClusterSpec = toml::from_str(text).map_err(|e| TransportError::Config(format!("cluster file: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    /// Reads a TOML cluster file.
    pub fn load(path: &Path) -> Result<ClusterSpec> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TransportError::io(format!("reading cluster file {}", path.display()), e))?;
        Self::from_toml(&text).map_err(|e| match e {
            // Name the file inside the one "configuration:" the message has.
            TransportError::Config(why) => {
                let why = why.strip_prefix("cluster file: ").unwrap_or(&why);
                TransportError::Config(format!("cluster file {}: {why}", path.display()))
            }
            other => other,
        })
    }

    /// Checks ids and addresses are unique, every address is one peers can dial (a port, not
    /// 0.0.0.0 or ::), host names are not empty, and the name is usable in a file name.
    pub fn validate(&self) -> Result<()> {
        if self.nodes.is_empty() {
            return Err(TransportError::Config("the cluster has no nodes".into()));
        }
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(TransportError::Config(format!(
                "cluster name {:?} must be non-empty ASCII letters, digits, '-', '_' or '.'",
                self.name
            )));
        }
        for (i, a) in self.nodes.iter().enumerate() {
            // Port 0 binds somewhere random that no peer can dial: a node with a lower id, which
            // dials this one, never reached it over TCP (the wait ended in "did not connect").
            if a.addr.port() == 0 {
                return Err(TransportError::Config(format!(
                    "node {}: address {} has port 0, which no peer can dial",
                    a.id, a.addr
                )));
            }
            // 0.0.0.0 or :: is where a server listens, not an address to dial: a peer on another
            // host dialling it reaches itself, and every such node counted as one host.
            if a.addr.ip().is_unspecified() {
                return Err(TransportError::Config(format!(
                    "node {}: address {} is unspecified, which no peer can dial: give the node's own IP \
                     (the node listens on it; 127.0.0.1 for nodes on one machine)",
                    a.id, a.addr
                )));
            }
            // An empty host would put every node that gives one on one "machine" (shared memory
            // between hosts that share none).
            if a.host.as_deref().is_some_and(|h| h.trim().is_empty()) {
                return Err(TransportError::Config(format!(
                    "node {}: an empty host name (leave `host` out to use the address's IP)",
                    a.id
                )));
            }
            for b in &self.nodes[i + 1..] {
                if a.id == b.id {
                    return Err(TransportError::Config(format!("node id {} appears twice", a.id)));
                }
                if a.addr == b.addr {
                    return Err(TransportError::Config(format!(
                        "nodes {} and {} share address {}",
                        a.id, b.id, a.addr
                    )));
                }
            }
        }
        Ok(())
    }

    /// The member with this id.
    pub fn node(&self, id: NodeId) -> Option<&NodeSpec> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// Settings of one endpoint.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// This node's id (must be in `cluster`).
    pub node: NodeId,
    /// Membership.
    pub cluster: ClusterSpec,
    /// Shared cluster secret (never sent).
    pub secret: Arc<[u8]>,
    /// Use shared memory with same-host peers.
    pub shm: bool,
    /// Try to open an RDMA device (feature `rdma`); falls back to tcp with a warning.
    pub rdma: bool,
    /// Send a keepalive when a link has been idle this long.
    pub keepalive: Duration,
    /// Declare a peer down when nothing arrived for this long.
    pub dead_after: Duration,
    /// Limit for one operation, once posted.
    pub op_timeout: Duration,
    /// Limit for connecting plus the handshake.
    pub connect_timeout: Duration,
    /// Largest pause between reconnection attempts (backoff doubles up to it).
    pub reconnect_max: Duration,
    /// Directory for the same-host sockets ([`default_runtime_dir`] by default).
    pub runtime_dir: PathBuf,
    /// Most bytes of regions this node allocates for the cluster (`None`: what the system has
    /// available, less [`crate::HEADROOM`], is the only bound).
    pub memory_limit: Option<u64>,
}

/// Where a node's same-host socket goes unless its configuration says otherwise:
/// `$XDG_RUNTIME_DIR`, or else the system's temporary directory.
pub fn default_runtime_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

impl EndpointConfig {
    /// Settings with defaults: shm on, rdma off, keepalive 500 ms, down after 3 s,
    /// operations limited to 60 s, connect to 5 s, reconnect backoff up to 5 s.
    pub fn new(node: NodeId, cluster: ClusterSpec, secret: &[u8]) -> EndpointConfig {
        EndpointConfig {
            node,
            cluster,
            secret: Arc::from(secret),
            shm: true,
            rdma: false,
            keepalive: Duration::from_millis(500),
            dead_after: Duration::from_secs(3),
            op_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            reconnect_max: Duration::from_secs(5),
            runtime_dir: default_runtime_dir(),
            memory_limit: None,
        }
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<()> {
        self.cluster.validate()?;
        if self.cluster.node(self.node).is_none() {
            return Err(TransportError::Config(format!("node {} is not in the cluster", self.node)));
        }
        if self.secret.is_empty() {
            return Err(TransportError::Config("the cluster secret must not be empty".into()));
        }
        if self.dead_after <= self.keepalive {
            return Err(TransportError::Config("dead_after must exceed the keepalive interval".into()));
        }
        Ok(())
    }

    /// Path of a node's same-host socket.
    ///
    /// The name is the cluster's plus a digest of its members (ids and addresses), so two
    /// clusters that share a name — or have none, and so the default — never share sockets.
    pub fn socket_path(&self, node: NodeId) -> PathBuf {
        let mut h = crc32fast::Hasher::new();
        for n in &self.cluster.nodes {
            h.update(&n.id.to_le_bytes());
            h.update(n.addr.to_string().as_bytes());
        }
        self.runtime_dir.join(format!("cascade-{}-{:08x}-{}.sock", self.cluster.name, h.finalize(), node))
    }
}

/// Picks the backend for a pair of nodes: shared memory on the same host, RDMA where both have a
/// device, TCP otherwise. Pure, so both sides reach the same answer from the same inputs.
pub fn select_backend(local: &NodeSpec, local_caps: Caps, peer: &NodeSpec, peer_caps: Caps) -> BackendKind {
    if local.host_key() == peer.host_key() && local_caps.has(Caps::SHM) && peer_caps.has(Caps::SHM) {
        BackendKind::Shm
    } else if local_caps.has(Caps::RDMA) && peer_caps.has(Caps::RDMA) {
        BackendKind::Rdma
    } else {
        BackendKind::Tcp
    }
}

#[cfg(test)]
mod tests;
