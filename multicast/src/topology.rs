//! The cluster topology the planner works on: nodes with GPUs and host memory, the links between
//! them with their kind and bandwidth, which GPUs share a NIC, and the serving flows that are on
//! the network right now.
//!
//! Inside a node, GPUs joined by NVLink form an undirected petgraph whose connected components are
//! the NVLink groups of Algorithm 1, line 1. Between nodes, bandwidth is the smaller of the two
//! NICs unless a link entry sets it. Loaded from TOML:
//!
//! ```toml
//! [[nodes]]
//! id = 0
//! gpus = 4
//! nic_gbps = 100        # per NIC
//! nvlink = true         # all GPUs of the node on one NVLink domain
//! nics = [[0, 1], [2, 3]]   # optional: which GPUs share a NIC (default: one NIC for all)
//!
//! [[links]]             # optional: a measured or shaped bandwidth between two nodes
//! a = 0
//! b = 1
//! gbps = 25
//! kind = "tcp"          # rdma | tcp (default rdma)
//!
//! [[flows]]             # serving traffic, e.g. prefill -> decode KV cache
//! from = "0/gpu0"
//! to = "1/gpu2"
//!
//! [[machines]]          # optional: nodes that are processes of one machine and share its CPUs
//! nodes = [1, 2, 3]
//! copy_gbps = 60        # what the machine's cores move per second over all its hops together
//! ```
//!
//! A machine matters where a hop's bytes are moved by the CPU (shared memory, TCP, the crc32 of
//! every chunk): the planner's prediction divides the machine's `copy_gbps` among the hops that
//! run on it at once (see [`Topology::machine_of`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use petgraph::graph::UnGraph;
use petgraph::unionfind::UnionFind;
use serde::Deserialize;

/// A node of the cluster (the transport's node id).
pub use cascade_transport::NodeId;

/// Where parameters can live: a GPU of a node, or the node's host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    /// The node.
    pub node: NodeId,
    /// `Some(i)` for GPU i, `None` for host memory.
    pub gpu: Option<u32>,
}

impl Loc {
    /// GPU `i` of `node`.
    pub fn gpu(node: NodeId, i: u32) -> Loc {
        Loc { node, gpu: Some(i) }
    }

    /// Host memory of `node`.
    pub fn host(node: NodeId) -> Loc {
        Loc { node, gpu: None }
    }
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.gpu {
            Some(i) => write!(f, "{}/gpu{i}", self.node),
            None => write!(f, "{}/host", self.node),
        }
    }
}

/// Why a location string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad location {0:?}: expected NODE/gpuN or NODE/host")]
pub struct BadLoc(pub String);

impl FromStr for Loc {
    type Err = BadLoc;
    fn from_str(s: &str) -> Result<Loc, BadLoc> {
        let bad = || BadLoc(s.to_string());
        let (n, d) = s.split_once('/').ok_or_else(bad)?;
        let node = n.parse().map_err(|_| bad())?;
        match d {
            "host" => Ok(Loc::host(node)),
            _ => d.strip_prefix("gpu").and_then(|i| i.parse().ok()).map(|i| Loc::gpu(node, i)).ok_or_else(bad),
        }
    }
}

/// Text formats (TOML, JSON) write a location as `NODE/gpuN` or `NODE/host`; binary formats (the
/// control plane's codec) as the pair `(node, gpu)`.
impl serde::Serialize for Loc {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            serde::Serialize::serialize(&(self.node, self.gpu), s)
        }
    }
}

impl<'de> Deserialize<'de> for Loc {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            let (node, gpu) = <(NodeId, Option<u32>)>::deserialize(d)?;
            Ok(Loc { node, gpu })
        }
    }
}

/// Kind of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    /// GPU to GPU inside a node.
    Nvlink,
    /// Host memory to GPU inside a node.
    Pcie,
    /// Between nodes, RDMA.
    Rdma,
    /// Between nodes, TCP.
    Tcp,
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkKind::Nvlink => "nvlink",
            LinkKind::Pcie => "pcie",
            LinkKind::Rdma => "rdma",
            LinkKind::Tcp => "tcp",
        })
    }
}

/// A link's kind and bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Kind.
    pub kind: LinkKind,
    /// Bandwidth in Gbit/s.
    pub gbps: f64,
}

/// Errors in a topology.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The TOML did not parse.
    #[error("topology file: {0}")]
    Parse(String),
    /// A node id appears twice.
    #[error("node {0} appears twice")]
    DuplicateNode(NodeId),
    /// A reference to something that does not exist.
    #[error("{what} refers to {loc}, which is not in the topology")]
    Unknown {
        /// Where the reference is.
        what: String,
        /// What it refers to.
        loc: String,
    },
    /// A bandwidth that is not a positive number.
    #[error("{0}: bandwidth must be positive")]
    BadBandwidth(String),
    /// A node declared on two machines.
    #[error("node {0} is on two machines")]
    TwoMachines(NodeId),
    /// A GPU listed on two NICs, or on none while `nics` is given.
    #[error("node {node}: GPU {gpu} must be on exactly one NIC")]
    BadNics {
        /// The node.
        node: NodeId,
        /// The GPU.
        gpu: u32,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeFile {
    id: NodeId,
    #[serde(default)]
    gpus: u32,
    nic_gbps: f64,
    #[serde(default)]
    nvlink: bool,
    #[serde(default = "default_nvlink_gbps")]
    nvlink_gbps: f64,
    #[serde(default = "default_pcie_gbps")]
    pcie_gbps: f64,
    #[serde(default)]
    nics: Option<Vec<Vec<u32>>>,
}

fn default_nvlink_gbps() -> f64 {
    2400.0
}

fn default_pcie_gbps() -> f64 {
    200.0
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkFile {
    a: NodeId,
    b: NodeId,
    gbps: f64,
    #[serde(default = "default_kind")]
    kind: LinkKind,
}

fn default_kind() -> LinkKind {
    LinkKind::Rdma
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowFile {
    from: Loc,
    to: Loc,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineFile {
    nodes: Vec<NodeId>,
    copy_gbps: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyFile {
    nodes: Vec<NodeFile>,
    #[serde(default)]
    links: Vec<LinkFile>,
    #[serde(default)]
    flows: Vec<FlowFile>,
    #[serde(default)]
    machines: Vec<MachineFile>,
}

/// Nodes that run on one machine and share its CPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    /// Index of the machine, in the order machines were declared.
    pub index: usize,
    /// Bytes per second × 8 / 10⁹ the machine's cores move over all its hops together (copy and
    /// checksum), Gbit/s.
    pub copy_gbps: f64,
}

/// Rates assumed by [`Topology::from_mesh`], in Gbit/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeshRates {
    /// Each node's NIC (and RDMA links).
    pub nic_gbps: f64,
    /// TCP links.
    pub tcp_gbps: f64,
    /// Same-host shared-memory links.
    pub shm_gbps: f64,
    /// What one host's cores move over all its hops together (copy and crc32), Gbit/s: with it,
    /// nodes that are processes of one host are declared a machine ([`Topology::add_machine`]),
    /// so the planner shares the host's rate among their hops; `None` treats every hop as
    /// independent (the right model when each node has hosts of its own).
    pub machine_gbps: Option<f64>,
}

/// One node as the planner sees it.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// Node id.
    pub id: NodeId,
    /// Number of GPUs.
    pub gpus: u32,
    /// Bandwidth of each NIC, Gbit/s.
    pub nic_gbps: f64,
    /// NIC index of each GPU.
    pub nic_of: Vec<u32>,
    /// Host-to-GPU bandwidth, Gbit/s.
    pub pcie_gbps: f64,
    /// GPU-to-GPU NVLink bandwidth, Gbit/s (when joined).
    pub nvlink_gbps: f64,
}

/// A directed serving flow on the network (e.g. prefill → decode KV-cache transfer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Flow {
    /// Sender.
    pub from: Loc,
    /// Receiver.
    pub to: Loc,
}

/// The topology: nodes, NVLink domains, inter-node links and serving flows.
#[derive(Debug, Clone)]
pub struct Topology {
    nodes: BTreeMap<NodeId, NodeInfo>,
    nvlink: UnGraph<Loc, ()>,
    nvlink_index: BTreeMap<Loc, petgraph::graph::NodeIndex>,
    /// NVLink domain (union-find representative) of each GPU vertex, kept current on change.
    domain: Vec<usize>,
    links: BTreeMap<(NodeId, NodeId), Link>,
    linked: BTreeMap<NodeId, BTreeSet<NodeId>>,
    flows: BTreeSet<Flow>,
    machines: BTreeMap<NodeId, Machine>,
    machine_count: usize,
}

impl Topology {
    /// An empty topology.
    pub fn new() -> Topology {
        Topology {
            nodes: BTreeMap::new(),
            nvlink: UnGraph::new_undirected(),
            nvlink_index: BTreeMap::new(),
            domain: Vec::new(),
            links: BTreeMap::new(),
            linked: BTreeMap::new(),
            flows: BTreeSet::new(),
            machines: BTreeMap::new(),
            machine_count: 0,
        }
    }

    /// Parses a TOML topology.
    pub fn from_toml(text: &str) -> Result<Topology, TopologyError> {
        let f: TopologyFile = toml::from_str(text).map_err(|e| TopologyError::Parse(e.to_string()))?;
        let mut t = Topology::new();
        for n in f.nodes {
            t.add_node(n.id, n.gpus, n.nic_gbps)?;
            let info = t.nodes.get_mut(&n.id).ok_or(TopologyError::DuplicateNode(n.id))?;
            info.pcie_gbps = n.pcie_gbps;
            info.nvlink_gbps = n.nvlink_gbps;
            if let Some(nics) = n.nics {
                t.set_nics(n.id, &nics)?;
            }
            if n.nvlink {
                let all: Vec<u32> = (0..n.gpus).collect();
                t.join_nvlink(n.id, &all)?;
            }
        }
        for l in f.links {
            t.set_link(l.a, l.b, Link { kind: l.kind, gbps: l.gbps })?;
        }
        for fl in f.flows {
            t.add_flow(fl.from, fl.to)?;
        }
        for m in f.machines {
            t.add_machine(&m.nodes, m.copy_gbps)?;
        }
        Ok(t)
    }

    /// Derives a topology from a running cluster's connection pool: one node per cluster member
    /// with `gpus` GPUs and a NIC of `nic_gbps`, and each link of `local`'s pool as an explicit
    /// link of its kind (an RDMA link keeps the NIC rate; TCP gets `tcp_gbps`; a shared-memory
    /// link, i.e. a peer on the same host, gets `shm_gbps`). With `machine_gbps`, the members
    /// that share a host (the transport's same-host rule: `host`, else the address) are one
    /// machine each.
    pub fn from_mesh(
        cluster: &cascade_transport::ClusterSpec,
        local: NodeId,
        links: &[(NodeId, cascade_transport::BackendKind)],
        gpus: u32,
        rates: MeshRates,
    ) -> Result<Topology, TopologyError> {
        let nodes: Vec<NodeId> = cluster.nodes.iter().map(|n| n.id).collect();
        let mut t = Topology::from_links(&nodes, local, links, gpus, MeshRates { machine_gbps: None, ..rates })?;
        if let Some(g) = rates.machine_gbps {
            let mut hosts: BTreeMap<String, Vec<NodeId>> = BTreeMap::new();
            for n in &cluster.nodes {
                hosts.entry(n.host_key()).or_default().push(n.id);
            }
            for members in hosts.values().filter(|m| m.len() > 1) {
                t.add_machine(members, g)?;
            }
        }
        Ok(t)
    }

    /// The same from a list of node ids (every node of the cluster, `local` included). Only
    /// `local`'s links are known here, so with `machine_gbps` the one machine declared is
    /// `local`'s host: `local` and the peers it reaches by shared memory.
    pub fn from_links(
        nodes: &[NodeId],
        local: NodeId,
        links: &[(NodeId, cascade_transport::BackendKind)],
        gpus: u32,
        rates: MeshRates,
    ) -> Result<Topology, TopologyError> {
        use cascade_transport::BackendKind as B;
        let mut t = Topology::new();
        for &n in nodes {
            t.add_node(n, gpus, rates.nic_gbps)?;
        }
        for &(peer, kind) in links {
            let link = match kind {
                B::Rdma => Link { kind: LinkKind::Rdma, gbps: rates.nic_gbps },
                B::Shm | B::Mem => Link { kind: LinkKind::Pcie, gbps: rates.shm_gbps },
                _ => Link { kind: LinkKind::Tcp, gbps: rates.tcp_gbps },
            };
            t.set_link(local, peer, link)?;
        }
        if let Some(g) = rates.machine_gbps {
            let mut host: Vec<NodeId> = std::iter::once(local)
                .chain(links.iter().filter(|(_, k)| matches!(k, B::Shm | B::Mem)).map(|(p, _)| *p))
                .collect();
            host.sort_unstable();
            host.dedup();
            if host.len() > 1 {
                t.add_machine(&host, g)?;
            }
        }
        Ok(t)
    }

    /// Adds a node with `gpus` GPUs on one NIC of `nic_gbps`.
    pub fn add_node(&mut self, id: NodeId, gpus: u32, nic_gbps: f64) -> Result<(), TopologyError> {
        if self.nodes.contains_key(&id) {
            return Err(TopologyError::DuplicateNode(id));
        }
        if !(nic_gbps > 0.0 && nic_gbps.is_finite()) {
            return Err(TopologyError::BadBandwidth(format!("node {id} NIC")));
        }
        self.nodes.insert(
            id,
            NodeInfo {
                id,
                gpus,
                nic_gbps,
                nic_of: vec![0; gpus as usize],
                pcie_gbps: default_pcie_gbps(),
                nvlink_gbps: default_nvlink_gbps(),
            },
        );
        for g in 0..gpus {
            let l = Loc::gpu(id, g);
            let ix = self.nvlink.add_node(l);
            self.nvlink_index.insert(l, ix);
        }
        self.recompute_domains();
        Ok(())
    }

    /// Declares which GPUs share each NIC of `node`.
    pub fn set_nics(&mut self, node: NodeId, nics: &[Vec<u32>]) -> Result<(), TopologyError> {
        let info = self.node_mut(node)?;
        let mut seen = vec![None; info.gpus as usize];
        for (nic, gpus) in nics.iter().enumerate() {
            for &g in gpus {
                match seen.get_mut(g as usize) {
                    Some(slot @ None) => *slot = Some(nic as u32),
                    _ => return Err(TopologyError::BadNics { node, gpu: g }),
                }
            }
        }
        for (g, s) in seen.iter().enumerate() {
            match s {
                Some(n) => info.nic_of[g] = *n,
                None => return Err(TopologyError::BadNics { node, gpu: g as u32 }),
            }
        }
        Ok(())
    }

    /// Joins the given GPUs of `node` into one NVLink domain.
    pub fn join_nvlink(&mut self, node: NodeId, gpus: &[u32]) -> Result<(), TopologyError> {
        let ix: Vec<_> = gpus.iter().map(|&g| self.index(Loc::gpu(node, g), "nvlink")).collect::<Result<_, _>>()?;
        for w in ix.windows(2) {
            self.nvlink.update_edge(w[0], w[1], ());
        }
        self.recompute_domains();
        Ok(())
    }

    /// Sets the link between two nodes (overriding the NIC-derived default).
    pub fn set_link(&mut self, a: NodeId, b: NodeId, link: Link) -> Result<(), TopologyError> {
        self.node(a).ok_or_else(|| unknown("link", a))?;
        self.node(b).ok_or_else(|| unknown("link", b))?;
        if !(link.gbps > 0.0 && link.gbps.is_finite()) {
            return Err(TopologyError::BadBandwidth(format!("link {a}-{b}")));
        }
        self.links.insert((a.min(b), a.max(b)), link);
        self.linked.entry(a).or_default().insert(b);
        self.linked.entry(b).or_default().insert(a);
        Ok(())
    }

    /// Declares that `nodes` are processes of one machine whose cores move `copy_gbps` over all
    /// their hops together. A node belongs to at most one machine.
    pub fn add_machine(&mut self, nodes: &[NodeId], copy_gbps: f64) -> Result<Machine, TopologyError> {
        if !(copy_gbps > 0.0 && copy_gbps.is_finite()) {
            return Err(TopologyError::BadBandwidth(format!("machine {}", self.machine_count)));
        }
        for &n in nodes {
            self.node(n).ok_or_else(|| unknown("machine", n))?;
            if self.machines.contains_key(&n) {
                return Err(TopologyError::TwoMachines(n));
            }
        }
        let m = Machine { index: self.machine_count, copy_gbps };
        self.machine_count += 1;
        for &n in nodes {
            self.machines.insert(n, m);
        }
        Ok(m)
    }

    /// The machine `node` shares with other nodes, if one was declared.
    pub fn machine_of(&self, node: NodeId) -> Option<Machine> {
        self.machines.get(&node).copied()
    }

    /// Records a serving flow.
    pub fn add_flow(&mut self, from: Loc, to: Loc) -> Result<(), TopologyError> {
        self.check_loc(from, "flow")?;
        self.check_loc(to, "flow")?;
        self.flows.insert(Flow { from, to });
        Ok(())
    }

    /// The node with this id.
    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.get(&id)
    }

    fn node_mut(&mut self, id: NodeId) -> Result<&mut NodeInfo, TopologyError> {
        self.nodes.get_mut(&id).ok_or_else(|| unknown("node", id))
    }

    /// All nodes, by id.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.values()
    }

    /// The serving flows.
    pub fn flows(&self) -> impl Iterator<Item = &Flow> {
        self.flows.iter()
    }

    fn index(&self, l: Loc, what: &str) -> Result<petgraph::graph::NodeIndex, TopologyError> {
        self.nvlink_index
            .get(&l)
            .copied()
            .ok_or_else(|| TopologyError::Unknown { what: what.into(), loc: l.to_string() })
    }

    /// Checks that a location exists.
    pub fn check_loc(&self, l: Loc, what: &str) -> Result<(), TopologyError> {
        let n = self.node(l.node).ok_or_else(|| TopologyError::Unknown { what: what.into(), loc: l.to_string() })?;
        match l.gpu {
            Some(g) if g >= n.gpus => Err(TopologyError::Unknown { what: what.into(), loc: l.to_string() }),
            _ => Ok(()),
        }
    }

    /// Connected components of the NVLink graph, by union-find over its edges.
    fn recompute_domains(&mut self) {
        let mut uf = UnionFind::<usize>::new(self.nvlink.node_count());
        for e in self.nvlink.raw_edges() {
            uf.union(e.source().index(), e.target().index());
        }
        self.domain = uf.into_labeling();
    }

    fn domain_of(&self, l: Loc) -> Option<usize> {
        self.nvlink_index.get(&l).and_then(|ix| self.domain.get(ix.index()).copied())
    }

    /// Partitions `locs` into NVLink groups (Algorithm 1, line 1): GPUs of one node joined through
    /// NVLink — directly or via other GPUs — form one group; anything else is alone. Groups and
    /// their members come out sorted, so the result is deterministic.
    pub fn nvlink_groups(&self, locs: &[Loc]) -> Vec<Vec<Loc>> {
        let mut groups: BTreeMap<(NodeId, usize), Vec<Loc>> = BTreeMap::new();
        let mut alone = Vec::new();
        for &l in locs {
            match self.domain_of(l) {
                Some(d) => groups.entry((l.node, d)).or_default().push(l),
                None => alone.push(vec![l]),
            }
        }
        let mut out: Vec<Vec<Loc>> = groups.into_values().collect();
        out.extend(alone);
        for g in &mut out {
            g.sort();
            g.dedup();
        }
        out.sort();
        out
    }

    /// The link parameters travel between two locations over.
    pub fn link(&self, a: Loc, b: Loc) -> Option<Link> {
        let (na, nb) = (self.node(a.node)?, self.node(b.node)?);
        if a.node == b.node {
            return match (a.gpu, b.gpu) {
                (Some(x), Some(y)) if self.same_nvlink(a, b) && x != y => {
                    Some(Link { kind: LinkKind::Nvlink, gbps: na.nvlink_gbps })
                }
                (Some(_), Some(_)) | (None, Some(_)) | (Some(_), None) => {
                    Some(Link { kind: LinkKind::Pcie, gbps: na.pcie_gbps })
                }
                (None, None) => None,
            };
        }
        Some(
            self.links
                .get(&(a.node.min(b.node), a.node.max(b.node)))
                .copied()
                .unwrap_or(Link { kind: LinkKind::Rdma, gbps: na.nic_gbps.min(nb.nic_gbps) }),
        )
    }

    fn same_nvlink(&self, a: Loc, b: Loc) -> bool {
        matches!((self.domain_of(a), self.domain_of(b)), (Some(x), Some(y)) if x == y)
    }

    /// Nodes with an explicitly set link to `node`.
    pub fn linked_nodes(&self, node: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.linked.get(&node).into_iter().flatten().copied()
    }

    /// The NIC a location sends through: (node, nic index). Host memory uses NIC 0.
    pub fn nic(&self, l: Loc) -> (NodeId, u32) {
        let nic = match (l.gpu, self.node(l.node)) {
            (Some(g), Some(n)) => n.nic_of.get(g as usize).copied().unwrap_or(0),
            _ => 0,
        };
        (l.node, nic)
    }

    /// True when a serving flow leaves the NIC of `l` towards another node (outcast).
    pub fn sends_outward(&self, l: Loc) -> bool {
        let nic = self.nic(l);
        self.flows.iter().any(|f| f.from.node != f.to.node && self.nic(f.from) == nic)
    }

    /// True when a serving flow arrives at the NIC of `l` from another node (incast).
    pub fn receives_inward(&self, l: Loc) -> bool {
        let nic = self.nic(l);
        self.flows.iter().any(|f| f.from.node != f.to.node && self.nic(f.to) == nic)
    }
}

impl Default for Topology {
    fn default() -> Self {
        Self::new()
    }
}

fn unknown(what: &str, node: NodeId) -> TopologyError {
    TopologyError::Unknown { what: what.into(), loc: format!("node {node}") }
}

#[cfg(test)]
mod tests;
