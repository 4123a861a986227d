//! [`Mesh`]: what code above the transport needs from a node — its id, its links, its regions and
//! its receive queue — implemented by the real [`Endpoint`](crate::Endpoint) and by the
//! [`MemNode`](crate::mem::MemNode) test double alike.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::Result;
use crate::link::{Incoming, Link};
use crate::region::RegionTable;
use crate::NodeId;

/// A boxed future, for the dyn-compatible async method of [`Mesh`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One node's view of the cluster.
pub trait Mesh: Send + Sync + 'static {
    /// This node's id.
    fn node(&self) -> NodeId;
    /// The link to `peer`.
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>>;
    /// Regions peers may access on this node.
    fn regions(&self) -> &RegionTable;
    /// The next message sent to this node (`None` once the node is shut down).
    fn recv(&self) -> BoxFuture<'_, Option<Incoming>>;
}

impl Mesh for crate::Endpoint {
    fn node(&self) -> NodeId {
        crate::Endpoint::node(self)
    }
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        crate::Endpoint::link(self, peer)
    }
    fn regions(&self) -> &RegionTable {
        crate::Endpoint::regions(self)
    }
    fn recv(&self) -> BoxFuture<'_, Option<Incoming>> {
        Box::pin(crate::Endpoint::recv(self))
    }
}

impl Mesh for crate::mem::MemNode {
    fn node(&self) -> NodeId {
        self.id()
    }
    fn link(&self, peer: NodeId) -> Result<Arc<dyn Link>> {
        crate::mem::MemNode::link(self, peer)
    }
    fn regions(&self) -> &RegionTable {
        crate::mem::MemNode::regions(self)
    }
    fn recv(&self) -> BoxFuture<'_, Option<Incoming>> {
        Box::pin(crate::mem::MemNode::recv(self))
    }
}
