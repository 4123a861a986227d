//! The scale planner: a pure function from (topology, sources, targets, bytes) to a [`Plan`].
//!
//! `blitz` follows BlitzScale's Algorithm 1 (seed paper 004, "Online network-based scale plan
//! generation"):
//!
//! 1. **NVLink grouping** (line 1): targets joined by NVLink form a group; only its *head* (the
//!    smallest location) is loaded over the network, the rest get an NVLink fan-out from it. A
//!    group that shares an NVLink domain with a source is fanned out from that source directly.
//! 2. **Interference pruning** (line 2): a source whose NIC already carries an outward serving
//!    flow (e.g. a prefill instance sending KV cache) is dropped when another source exists.
//!    Incoming flows do not disqualify a source: the two directions are independent.
//! 3. **Greedy chains** (lines 4–11): one chain per remaining source. Repeatedly, the pair
//!    (chain tail, unassigned head) with the highest link bandwidth is joined — so targets come
//!    in order of link speed, faster first (Figure 10b), and several sources give several chains
//!    (Figure 11).
//! 4. **Chunk size and prediction**: the pipeline of a chain of N hops over bandwidth B with
//!    chunk c and per-chunk overhead o takes about (S/c + N − 1)(c/B + o); its minimum is at
//!    c = √(S·o·B/(N − 1)), rounded down to a power of two within [64 KiB, 16 MiB]. A target at
//!    position i of a chain completes at S/B_min + (i − 1)·c/B_min + i·latency, where B_min is
//!    the slowest link from the source to it.
//!
//! 5. **Shared machines** (not in the paper, whose nodes are separate servers): where several
//!    nodes are processes of one machine ([`Topology::machine_of`]), its cores move the bytes of
//!    every hop that touches it, so a pipelined hop gets at most `copy_gbps / k` of the machine
//!    when k hops touch it at once — on one host over shared memory a chain of N hops takes about
//!    N times one hop, which the per-link model alone predicted flat.
//!
//! Choices the paper leaves open, made here: ties in step 3 go to the chain with fewer hops (so
//! equal links spread targets evenly over the sources), then to the smaller location; the NIC
//! bandwidth-halving the paper mentions for a target GPU that shares a NIC with a busy GPU is not
//! modelled (the paper leaves it out of Algorithm 1 too).
//!
//! Baselines, for comparison: `chain` (one pipelined chain from the first source through every
//! target in location order), `star` (the first source sends to every target at once, sharing its
//! NIC) and `tree` (binomial store-and-forward: every holder sends the whole model to one new
//! target per round). Baselines do no grouping and no pruning.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::topology::{Link, LinkKind, Loc, NodeId, Topology, TopologyError};

/// Which planner to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlannerKind {
    /// BlitzScale's Algorithm 1.
    Blitz,
    /// One chain through every target.
    Chain,
    /// The source sends to every target.
    Star,
    /// Binomial tree, store-and-forward.
    Tree,
}

impl FromStr for PlannerKind {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        Ok(match s {
            "blitz" => PlannerKind::Blitz,
            "chain" => PlannerKind::Chain,
            "star" => PlannerKind::Star,
            "tree" => PlannerKind::Tree,
            other => return Err(PlanError::UnknownPlanner(other.to_string())),
        })
    }
}

impl fmt::Display for PlannerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlannerKind::Blitz => "blitz",
            PlannerKind::Chain => "chain",
            PlannerKind::Star => "star",
            PlannerKind::Tree => "tree",
        })
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// No source was given.
    #[error("no source holds the parameters")]
    NoSource,
    /// Nothing to do.
    #[error("no target given")]
    NoTarget,
    /// A zero-byte transfer.
    #[error("nothing to send: 0 bytes")]
    Empty,
    /// A location is also a source, or listed twice.
    #[error("target {0} is listed twice or is also a source")]
    DuplicateTarget(Loc),
    /// Unknown planner name.
    #[error("unknown planner {0:?} (blitz, chain, star or tree)")]
    UnknownPlanner(String),
    /// A location not in the topology.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// Timing constants of the cost model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Latency added by each hop, seconds.
    pub hop_latency_s: f64,
    /// Fixed cost of each chunk (posting, completion, crc bookkeeping), seconds.
    pub chunk_overhead_s: f64,
    /// Smallest chunk.
    pub min_chunk: u64,
    /// Largest chunk.
    pub max_chunk: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel { hop_latency_s: 20e-6, chunk_overhead_s: 10e-6, min_chunk: 64 << 10, max_chunk: 16 << 20 }
    }
}

/// What to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Size of the parameters.
    pub bytes: u64,
    /// Locations holding a full copy.
    pub sources: Vec<Loc>,
    /// Locations to load.
    pub targets: Vec<Loc>,
}

/// How data moves along the plan's edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Forwarding {
    /// Each member forwards chunk i to its children while chunk i+1 arrives.
    Pipelined,
    /// Each member forwards only once it holds everything, to its children one after another.
    StoreAndForward,
}

/// One transfer of the plan: `to` receives everything from `from`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Edge {
    /// Sender.
    pub from: Loc,
    /// Receiver.
    pub to: Loc,
    /// Link kind.
    pub kind: LinkKind,
    /// Link bandwidth, Gbit/s.
    pub gbps: f64,
}

/// A scale plan. Every target has exactly one incoming edge.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// Planner that made it.
    pub planner: PlannerKind,
    /// Bytes moved to each target.
    pub bytes: u64,
    /// Chunk size of the pipeline.
    pub chunk_bytes: u64,
    /// Forwarding discipline.
    pub forwarding: Forwarding,
    /// Transfers, in the order a sender starts them (for store-and-forward: its rounds).
    pub edges: Vec<Edge>,
    /// Predicted completion time of each target, seconds, in location order.
    #[serde(serialize_with = "ser_predicted")]
    pub predicted: Vec<(Loc, f64)>,
}

fn ser_predicted<S: serde::Serializer>(v: &[(Loc, f64)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(v.len()))?;
    for (l, t) in v {
        m.serialize_entry(&l.to_string(), t)?;
    }
    m.end()
}

impl Plan {
    /// The chains of a pipelined plan whose senders each have one network child: every path from a
    /// source, following edges. NVLink fan-outs appear as their own short chains.
    pub fn chains(&self) -> Vec<Vec<Loc>> {
        let receivers: BTreeSet<Loc> = self.edges.iter().map(|e| e.to).collect();
        let mut children: BTreeMap<Loc, Vec<Loc>> = BTreeMap::new();
        for e in &self.edges {
            children.entry(e.from).or_default().push(e.to);
        }
        let mut out = Vec::new();
        for e in &self.edges {
            // Start a path at each edge whose sender is not itself a receiver of a single-child
            // chain link, i.e. at sources, and at second and later children.
            let first_child = children.get(&e.from).and_then(|c| c.first()) == Some(&e.to);
            if receivers.contains(&e.from) && first_child {
                continue;
            }
            let mut path = vec![e.from, e.to];
            let mut at = e.to;
            while let Some(next) = children.get(&at).and_then(|c| c.first()) {
                path.push(*next);
                at = *next;
            }
            out.push(path);
        }
        out
    }

    /// The plan's targets: every receiver of an edge.
    pub fn targets(&self) -> BTreeSet<Loc> {
        self.edges.iter().map(|e| e.to).collect()
    }

    /// The senders that receive nothing: the sources the plan actually uses.
    pub fn sources(&self) -> BTreeSet<Loc> {
        let targets = self.targets();
        self.edges.iter().map(|e| e.from).filter(|l| !targets.contains(l)).collect()
    }

    /// Predicted time until the last target is complete.
    pub fn makespan(&self) -> f64 {
        self.predicted.iter().map(|(_, t)| *t).fold(0.0, f64::max)
    }
}

impl fmt::Display for Plan {
    /// A stable text form (used by golden tests and the CLI).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "planner {} chunk {} {:?}", self.planner, self.chunk_bytes, self.forwarding)?;
        match self.forwarding {
            Forwarding::Pipelined => {
                for c in self.chains() {
                    let hops: Vec<String> = c.iter().map(|l| l.to_string()).collect();
                    writeln!(f, "chain {}", hops.join(" -> "))?;
                }
            }
            Forwarding::StoreAndForward => {
                for e in &self.edges {
                    writeln!(f, "send {} -> {}", e.from, e.to)?;
                }
            }
        }
        for (l, t) in &self.predicted {
            writeln!(f, "done {l} {:.4}s", t)?;
        }
        Ok(())
    }
}

/// Plans with the default cost model.
pub fn plan(topo: &Topology, req: &Request, kind: PlannerKind) -> Result<Plan, PlanError> {
    plan_with(topo, req, kind, &CostModel::default())
}

/// Plans with an explicit cost model.
pub fn plan_with(topo: &Topology, req: &Request, kind: PlannerKind, cost: &CostModel) -> Result<Plan, PlanError> {
    validate(topo, req)?;
    let mut sources = req.sources.clone();
    sources.sort();
    sources.dedup();
    let mut targets = req.targets.clone();
    targets.sort();
    let (forwarding, edges) = match kind {
        PlannerKind::Blitz => (Forwarding::Pipelined, blitz(topo, &sources, &targets)),
        PlannerKind::Chain => (Forwarding::Pipelined, chain(topo, sources[0], &targets)),
        PlannerKind::Star => (Forwarding::Pipelined, star(topo, sources[0], &targets)),
        PlannerKind::Tree => (Forwarding::StoreAndForward, tree(topo, sources[0], &targets)),
    };
    let rates = edge_rates(topo, forwarding, &edges);
    let chunk_bytes = chunk_size(req.bytes, &edges, &rates, cost);
    let predicted = predict(req.bytes, chunk_bytes, forwarding, &edges, &rates, cost);
    Ok(Plan { planner: kind, bytes: req.bytes, chunk_bytes, forwarding, edges, predicted })
}

fn validate(topo: &Topology, req: &Request) -> Result<(), PlanError> {
    if req.sources.is_empty() {
        return Err(PlanError::NoSource);
    }
    if req.targets.is_empty() {
        return Err(PlanError::NoTarget);
    }
    if req.bytes == 0 {
        return Err(PlanError::Empty);
    }
    for s in &req.sources {
        topo.check_loc(*s, "source")?;
    }
    let sources: BTreeSet<Loc> = req.sources.iter().copied().collect();
    let mut seen = BTreeSet::new();
    for t in &req.targets {
        topo.check_loc(*t, "target")?;
        if sources.contains(t) || !seen.insert(*t) {
            return Err(PlanError::DuplicateTarget(*t));
        }
    }
    Ok(())
}

fn edge(topo: &Topology, from: Loc, to: Loc) -> Edge {
    // Both locations were validated, so a link exists; host-to-host on one node cannot occur
    // because a target is never its own source.
    let l = topo.link(from, to).unwrap_or(Link { kind: LinkKind::Pcie, gbps: f64::MIN_POSITIVE });
    Edge { from, to, kind: l.kind, gbps: l.gbps }
}

/// Algorithm 1.
fn blitz(topo: &Topology, sources: &[Loc], targets: &[Loc]) -> Vec<Edge> {
    let mut edges = Vec::new();
    let mut fanouts = Vec::new();
    // Line 1: NVLink groups. A group in a source's NVLink domain fans out from that source.
    let mut heads = Vec::new();
    for group in topo.nvlink_groups(targets) {
        let local_source = sources
            .iter()
            .find(|s| group.iter().any(|g| topo.link(**s, *g).is_some_and(|l| l.kind == LinkKind::Nvlink)));
        match local_source {
            Some(&s) => fanouts.extend(group.iter().map(|&g| edge(topo, s, g))),
            None => {
                heads.push(group[0]);
                fanouts.extend(group[1..].iter().map(|&g| edge(topo, group[0], g)));
            }
        }
    }
    // Line 2: prune sources whose NIC already sends serving traffic outward.
    let quiet: Vec<Loc> = sources.iter().copied().filter(|s| !topo.sends_outward(*s)).collect();
    let usable = if quiet.is_empty() { sources.to_vec() } else { quiet };
    // Lines 4–11: greedy chains, fastest link first.
    let mut chains: Vec<(Loc, usize)> = usable.iter().map(|s| (*s, 0)).collect(); // (tail, hops)
    let mut pool = Remaining::new(topo, &heads);
    while !pool.is_empty() {
        let mut best: Option<(usize, Loc, f64)> = None;
        for (ci, (tail, hops)) in chains.iter().enumerate() {
            let Some((t, gbps)) = pool.best_from(topo, *tail) else { continue };
            let better = match best {
                None => true,
                Some((bi, bt, bg)) => gbps > bg || (gbps == bg && (*hops, tail, t) < (chains[bi].1, &chains[bi].0, bt)),
            };
            if better {
                best = Some((ci, t, gbps));
            }
        }
        let Some((ci, t, _)) = best else { break };
        edges.push(edge(topo, chains[ci].0, t));
        chains[ci] = (t, chains[ci].1 + 1);
        pool.remove(topo, t);
    }
    edges.extend(fanouts);
    edges
}

/// Unassigned chain heads, indexed so the best next hop from a tail is found without scanning
/// every target: by NIC speed (the default inter-node bandwidth is the smaller NIC), plus the
/// targets on the tail's own node and on nodes with an explicit link to it.
struct Remaining {
    by_nic: BTreeSet<(std::cmp::Reverse<u64>, Loc)>,
    by_node: BTreeMap<NodeId, BTreeSet<Loc>>,
}

impl Remaining {
    fn new(topo: &Topology, heads: &[Loc]) -> Remaining {
        let mut r = Remaining { by_nic: BTreeSet::new(), by_node: BTreeMap::new() };
        for &h in heads {
            r.by_nic.insert((std::cmp::Reverse(nic_key(topo, h)), h));
            r.by_node.entry(h.node).or_default().insert(h);
        }
        r
    }

    fn is_empty(&self) -> bool {
        self.by_nic.is_empty()
    }

    fn remove(&mut self, topo: &Topology, l: Loc) {
        self.by_nic.remove(&(std::cmp::Reverse(nic_key(topo, l)), l));
        if let Some(s) = self.by_node.get_mut(&l.node) {
            s.remove(&l);
            if s.is_empty() {
                self.by_node.remove(&l.node);
            }
        }
    }

    /// The remaining target with the fastest link from `tail`; ties go to the target with the
    /// faster NIC (it forwards faster), then to the smaller location.
    fn best_from(&self, topo: &Topology, tail: Loc) -> Option<(Loc, f64)> {
        let special: Vec<NodeId> = std::iter::once(tail.node).chain(topo.linked_nodes(tail.node)).collect();
        let mut best: Option<(Loc, f64, u64)> = None;
        let mut consider = |l: Loc| {
            if let Some(link) = topo.link(tail, l) {
                let nic = nic_key(topo, l);
                let better = best.is_none_or(|(bl, bg, bn)| {
                    link.gbps > bg || (link.gbps == bg && (nic > bn || (nic == bn && l < bl)))
                });
                if better {
                    best = Some((l, link.gbps, nic));
                }
            }
        };
        for n in &special {
            for &l in self.by_node.get(n).into_iter().flatten() {
                consider(l);
            }
        }
        // Among the others the link is min(NIC, NIC), so the first of them in `by_nic` order
        // (fastest NIC, then smallest location) wins under the same tie-break.
        if let Some((_, l)) = self.by_nic.iter().find(|(_, l)| !special.contains(&l.node)) {
            consider(*l);
        }
        best.map(|(l, g, _)| (l, g))
    }
}

fn nic_key(topo: &Topology, l: Loc) -> u64 {
    topo.node(l.node).map(|n| n.nic_gbps.to_bits()).unwrap_or(0)
}

fn chain(topo: &Topology, source: Loc, targets: &[Loc]) -> Vec<Edge> {
    let mut prev = source;
    targets
        .iter()
        .map(|&t| {
            let e = edge(topo, prev, t);
            prev = t;
            e
        })
        .collect()
}

fn star(topo: &Topology, source: Loc, targets: &[Loc]) -> Vec<Edge> {
    targets.iter().map(|&t| edge(topo, source, t)).collect()
}

/// Binomial tree: in each round every holder sends to one new target.
fn tree(topo: &Topology, source: Loc, targets: &[Loc]) -> Vec<Edge> {
    let mut holders = vec![source];
    let mut next = targets.iter();
    let mut edges = Vec::new();
    'rounds: loop {
        let senders = holders.clone();
        for h in senders {
            let Some(&t) = next.next() else { break 'rounds };
            edges.push(edge(topo, h, t));
            holders.push(t);
        }
    }
    edges
}

/// Each edge's rate in bytes/s: its link's, or less where the edge runs on a shared machine. A
/// pipelined plan runs all its hops at once, so a machine's `copy_gbps` is split among every edge
/// that has an end on it (an edge with both ends there counts once); store-and-forward rounds are
/// not modelled this way (their edges do not all run at once).
fn edge_rates(topo: &Topology, fw: Forwarding, edges: &[Edge]) -> Vec<f64> {
    // The machines each edge has an end on, looked up once.
    let on: Vec<Vec<crate::topology::Machine>> = edges
        .iter()
        .map(|e| {
            let mut ms: Vec<_> = [e.from.node, e.to.node].iter().filter_map(|n| topo.machine_of(*n)).collect();
            ms.dedup_by_key(|m| m.index);
            ms
        })
        .collect();
    let mut load: BTreeMap<usize, usize> = BTreeMap::new();
    if fw == Forwarding::Pipelined {
        for m in on.iter().flatten() {
            *load.entry(m.index).or_default() += 1;
        }
    }
    edges
        .iter()
        .zip(&on)
        .map(|(e, ms)| {
            let link = e.gbps * 1e9 / 8.0;
            ms.iter()
                .map(|m| m.copy_gbps * 1e9 / 8.0 / load.get(&m.index).copied().unwrap_or(1) as f64)
                .fold(link, f64::min)
        })
        .collect()
}

fn chunk_size(bytes: u64, edges: &[Edge], rates: &[f64], cost: &CostModel) -> u64 {
    let hops = longest_path(edges).max(1);
    let slowest = rates.iter().copied().fold(f64::INFINITY, f64::min);
    let b = if slowest.is_finite() { slowest } else { 1e9 };
    let ideal = if hops <= 1 {
        cost.max_chunk as f64
    } else {
        (bytes as f64 * cost.chunk_overhead_s * b / (hops - 1) as f64).sqrt()
    };
    let clamped = (ideal as u64).clamp(cost.min_chunk, cost.max_chunk.max(cost.min_chunk));
    // Round down to a power of two; never above the payload (whose next power of two does not
    // exist above 2^63: `next_power_of_two` would panic there, or wrap to 0 in a release build).
    let pow2 = 1u64 << (63 - clamped.leading_zeros());
    pow2.min(bytes.checked_next_power_of_two().unwrap_or(1 << 63)).max(1)
}

/// Hops of the longest path. Every planner emits a sender's incoming edge before its outgoing
/// ones (the edge order is the start order), so one pass in order sees each parent's depth first.
fn longest_path(edges: &[Edge]) -> usize {
    let mut depth: BTreeMap<Loc, usize> = BTreeMap::new();
    let mut longest = 0;
    for e in edges {
        let d = depth.get(&e.from).copied().unwrap_or(0) + 1;
        depth.insert(e.to, d);
        longest = longest.max(d);
    }
    longest
}

fn predict(bytes: u64, chunk: u64, fw: Forwarding, edges: &[Edge], rates: &[f64], cost: &CostModel) -> Vec<(Loc, f64)> {
    let s = bytes as f64;
    let c = chunk.min(bytes) as f64;
    // Transfers from one sender over the same kind of link share it (a star shares the NIC);
    // NVLink fan-outs do not take from the NIC.
    let mut out_degree: BTreeMap<(Loc, LinkKind), usize> = BTreeMap::new();
    for e in edges {
        *out_degree.entry((e.from, e.kind)).or_default() += 1;
    }
    let mut done: BTreeMap<Loc, f64> = BTreeMap::new();
    match fw {
        Forwarding::Pipelined => {
            // (slowest bandwidth so far in bytes/s, hops so far) at each receiver.
            let mut state: BTreeMap<Loc, (f64, usize)> = BTreeMap::new();
            for (e, rate) in edges.iter().zip(rates) {
                // A sender feeding k children at once splits its bandwidth k ways (star).
                let share = (e.gbps * 1e9 / 8.0) / out_degree.get(&(e.from, e.kind)).copied().unwrap_or(1) as f64;
                let share = share.min(*rate);
                let (b_prev, hops_prev) = state.get(&e.from).copied().unwrap_or((f64::INFINITY, 0));
                let b = b_prev.min(share);
                let hops = hops_prev + 1;
                state.insert(e.to, (b, hops));
                let t = s / b + (hops - 1) as f64 * c / b + hops as f64 * (cost.hop_latency_s + cost.chunk_overhead_s);
                done.insert(e.to, t);
            }
        }
        Forwarding::StoreAndForward => {
            // A sender's transfers run one after another, each starting when the previous ends.
            let mut free_at: BTreeMap<Loc, f64> = BTreeMap::new();
            for (e, rate) in edges.iter().zip(rates) {
                let start = free_at.get(&e.from).copied().unwrap_or(0.0).max(done.get(&e.from).copied().unwrap_or(0.0));
                let t = start + s / rate + cost.hop_latency_s;
                free_at.insert(e.from, t);
                done.insert(e.to, t);
            }
        }
    }
    done.into_iter().collect()
}

#[cfg(test)]
mod tests;
