//! The pool manager's core: a pure (sans-IO) state machine over models, nodes and copies.
//!
//! It keeps BlitzScale's invariant (seed paper 004, "Global parameter pool"): every registered
//! model has at least `k` **ready** copies on distinct live nodes — serving instances on GPUs or
//! host caches — so scaling never depends on a cache hit, and a lost machine's copies are made
//! again elsewhere. Inputs are events (register, deploy, copy ready/failed, reclaim, node down);
//! outputs are [`Action`]s for the daemons (create a copy from given sources, drop a copy, report
//! a model lost). Placement puts a new host-cache copy on the live node with the fewest bytes, so
//! bytes per node stay balanced.

use std::collections::{BTreeMap, BTreeSet};

/// A node of the cluster (the transport's node id).
pub use cascade_transport::NodeId;
/// A model's id.
pub type ModelId = u32;
/// A copy's id.
pub type CopyId = u64;

/// Where a copy lives on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub enum CopyKind {
    /// A serving instance on a GPU.
    Gpu(u32),
    /// Host memory cache.
    HostCache,
}

/// A copy's life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CopyState {
    /// Being filled.
    Loading,
    /// Complete and verified.
    Ready,
    /// Asked to go; kept until the invariant holds without it.
    Evicting,
}

/// One copy of a model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelCopy {
    /// Its id.
    pub id: CopyId,
    /// The model.
    pub model: ModelId,
    /// The node.
    pub node: NodeId,
    /// GPU or host cache.
    pub kind: CopyKind,
    /// State.
    pub state: CopyState,
}

/// Where the bytes of a new copy come from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Source {
    /// These ready copies (the multicast planner picks among them).
    Copies(Vec<CopyId>),
    /// The model's file, through the loader.
    File,
}

/// What the daemons must do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Action {
    /// Fill a new copy; report `copy_ready` or `copy_failed` when done.
    Create {
        /// The new copy.
        copy: ModelCopy,
        /// Where its bytes come from.
        from: Source,
    },
    /// Release a copy's memory.
    Drop {
        /// The copy.
        copy: CopyId,
    },
    /// No copy survived and the file is unreachable: the model cannot be served.
    Lost {
        /// The model.
        model: ModelId,
        /// Why.
        reason: String,
    },
}

/// `1, 2, 3`.
fn list(nodes: &[NodeId]) -> String {
    nodes.iter().map(NodeId::to_string).collect::<Vec<_>>().join(", ")
}

/// A refused request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Unknown model.
    #[error("unknown model {0}")]
    UnknownModel(ModelId),
    /// Unknown copy.
    #[error("unknown copy {0}")]
    UnknownCopy(CopyId),
    /// A node the pool has but declared dead.
    #[error("node {0} is not a live member")]
    NoSuchNode(NodeId),
    /// A node that is not one of the pool's (it never was: a mistyped id).
    #[error("node {node} is not one of the pool's nodes ({})", list(nodes))]
    NotInPool {
        /// The node asked for.
        node: NodeId,
        /// The pool's nodes.
        nodes: Vec<NodeId>,
    },
    /// The node is being drained: nothing new goes there until it is undrained.
    #[error("node {0} is drained: nothing new is placed there (`cascade pool undrain` takes it back)")]
    Draining(NodeId),
    /// The model is registered already.
    #[error("model {0} is registered already")]
    Duplicate(ModelId),
    /// Fewer nodes with room for the model than the invariant needs.
    #[error("a model of {bytes} bytes fits on {have} live nodes; {k} copies are needed")]
    NoRoom {
        /// The model's bytes.
        bytes: u64,
        /// Nodes with room.
        have: usize,
        /// Copies needed.
        k: usize,
    },
    /// Fewer live nodes than the invariant needs.
    #[error("k = {k} copies on distinct nodes need {k} live {}; live now: {have}", if *k == 1 { "node" } else { "nodes" })]
    TooFewNodes {
        /// Live nodes.
        have: usize,
        /// Copies required.
        k: usize,
    },
}

/// A broken invariant, as [`Pool::check`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A model with fewer whole (ready or evicting) copies on distinct live nodes than `k`.
    TooFewCopies {
        /// The model.
        model: ModelId,
        /// Whole copies on distinct live nodes.
        have: usize,
    },
    /// A copy recorded on a dead node.
    OnDeadNode {
        /// The copy.
        copy: CopyId,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Model {
    bytes: u64,
    file_reachable: bool,
    lost: bool,
}

/// The pool's state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Pool {
    k: usize,
    nodes: BTreeMap<NodeId, bool>,
    models: BTreeMap<ModelId, Model>,
    copies: BTreeMap<CopyId, ModelCopy>,
    next_copy: CopyId,
    /// Bytes each node may hold for the pool (a node not listed: no limit). Set by events, so a
    /// replay places copies exactly as the first run did.
    #[serde(default)]
    capacity: BTreeMap<NodeId, u64>,
    /// Nodes the operator drains (or drained): nothing new is placed there ([`Pool::drain`]).
    #[serde(default)]
    draining: BTreeSet<NodeId>,
}

impl Pool {
    /// A pool over `nodes` keeping `k` ready copies of every model.
    pub fn new(k: usize, nodes: impl IntoIterator<Item = NodeId>) -> Pool {
        Pool {
            k: k.max(1),
            nodes: nodes.into_iter().map(|n| (n, true)).collect(),
            models: BTreeMap::new(),
            copies: BTreeMap::new(),
            next_copy: 1,
            capacity: BTreeMap::new(),
            draining: BTreeSet::new(),
        }
    }

    /// Sets the bytes `node` may hold for the pool (`None`: no limit). Copies already placed
    /// stay; new ones go only where they fit.
    pub fn set_capacity(&mut self, node: NodeId, bytes: Option<u64>) {
        match bytes {
            Some(b) => self.capacity.insert(node, b),
            None => self.capacity.remove(&node),
        };
    }

    /// The bytes `node` may hold for the pool, if limited.
    pub fn capacity(&self, node: NodeId) -> Option<u64> {
        self.capacity.get(&node).copied()
    }

    /// Whether `bytes` more fit on `node`, given what it holds (`loads`).
    fn fits(&self, loads: &BTreeMap<NodeId, u64>, node: NodeId, bytes: u64) -> bool {
        match self.capacity.get(&node) {
            Some(cap) => loads.get(&node).copied().unwrap_or(0).saturating_add(bytes) <= *cap,
            None => true,
        }
    }

    /// Copies required per model.
    pub fn k(&self) -> usize {
        self.k
    }

    /// All copies.
    pub fn copies(&self) -> impl Iterator<Item = &ModelCopy> {
        self.copies.values()
    }

    /// Live nodes.
    pub fn live_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.iter().filter(|(_, a)| **a).map(|(n, _)| *n)
    }

    /// Live nodes that new copies may go to: not draining.
    fn placeable_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.live_nodes().filter(|n| !self.draining.contains(n))
    }

    /// Sets the copies required per model (at least 1). Only a new pool's first event does this:
    /// k is part of the pool, not of a manager's configuration.
    pub fn set_k(&mut self, k: usize) {
        self.k = k.max(1);
    }

    /// Whether `model` is registered.
    pub fn has_model(&self, model: ModelId) -> bool {
        self.models.contains_key(&model)
    }

    /// Every member node, with whether it is live.
    pub fn members(&self) -> impl Iterator<Item = (NodeId, bool)> + '_ {
        self.nodes.iter().map(|(n, a)| (*n, *a))
    }

    /// Bytes held (or being filled) on each live node.
    pub fn bytes_per_node(&self) -> BTreeMap<NodeId, u64> {
        let mut m: BTreeMap<NodeId, u64> = self.live_nodes().map(|n| (n, 0)).collect();
        for c in self.copies.values() {
            if let (Some(b), Some(model)) = (m.get_mut(&c.node), self.models.get(&c.model)) {
                *b += model.bytes;
            }
        }
        m
    }

    fn alive(&self, n: NodeId) -> bool {
        self.nodes.get(&n).copied().unwrap_or(false)
    }

    /// Ready copies of `model` on distinct live nodes (evicting ones do not count).
    pub fn ready_nodes(&self, model: ModelId) -> BTreeSet<NodeId> {
        self.nodes_with(model, |s| s == CopyState::Ready)
    }

    /// Ready or evicting (so still whole) copies of `model` on distinct live nodes: what a drain
    /// never lets fall below k.
    pub fn whole_nodes(&self, model: ModelId) -> BTreeSet<NodeId> {
        self.nodes_with(model, |s| s != CopyState::Loading)
    }

    /// Nodes holding or filling a copy of `model`.
    fn used_nodes(&self, model: ModelId) -> BTreeSet<NodeId> {
        self.nodes_with(model, |s| s != CopyState::Evicting)
    }

    /// Live nodes holding a copy of `model` whose state `pick` accepts.
    fn nodes_with(&self, model: ModelId, pick: impl Fn(CopyState) -> bool) -> BTreeSet<NodeId> {
        self.copies
            .values()
            .filter(|c| c.model == model && pick(c.state) && self.alive(c.node))
            .map(|c| c.node)
            .collect()
    }

    /// Where a new copy of `model` would come from now: its ready (or evicting) copies on live
    /// nodes, or its file when there are none.
    pub fn sources(&self, model: ModelId) -> Source {
        let ready: Vec<CopyId> = self
            .copies
            .values()
            .filter(|c| {
                c.model == model && matches!(c.state, CopyState::Ready | CopyState::Evicting) && self.alive(c.node)
            })
            .map(|c| c.id)
            .collect();
        if ready.is_empty() {
            Source::File
        } else {
            Source::Copies(ready)
        }
    }

    fn new_copy(&mut self, model: ModelId, node: NodeId, kind: CopyKind) -> ModelCopy {
        let c = ModelCopy { id: self.next_copy, model, node, kind, state: CopyState::Loading };
        self.next_copy += 1;
        self.copies.insert(c.id, c.clone());
        c
    }

    /// Copies still needed for `model` (counting those being filled), each placed on the live node
    /// with the fewest bytes that holds none yet; a model with no copy and no reachable file is lost.
    fn top_up(&mut self, model: ModelId) -> Vec<Action> {
        self.top_up_from(model, false)
    }

    /// As [`top_up`](Self::top_up); `initial` is the registration, whose copies always come from
    /// the file (reachability only matters once the model had copies to lose).
    fn top_up_from(&mut self, model: ModelId, initial: bool) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(m) = self.models.get(&model).cloned() else { return out };
        if m.lost {
            return out;
        }
        let mut used = self.used_nodes(model);
        while used.len() < self.k {
            let source = self.sources(model);
            if !initial
                && source == Source::File
                && !m.file_reachable
                && !self.copies.values().any(|c| c.model == model && self.alive(c.node))
            {
                if let Some(mm) = self.models.get_mut(&model) {
                    mm.lost = true;
                }
                out.push(Action::Lost { model, reason: "no copy survived and the model file is unreachable".into() });
                return out;
            }
            let loads = self.bytes_per_node();
            let evicting: BTreeSet<NodeId> = self
                .copies
                .values()
                .filter(|c| c.model == model && c.state == CopyState::Evicting)
                .map(|c| c.node)
                .collect();
            let Some(node) = loads
                .iter()
                .filter(|(n, _)| {
                    !used.contains(n)
                        && !evicting.contains(n)
                        && !self.draining.contains(n)
                        && self.fits(&loads, **n, m.bytes)
                })
                .min_by_key(|(n, b)| (**b, **n))
                .map(|(n, _)| *n)
            else {
                break; // fewer live nodes with room than k: nothing more can be placed
            };
            let copy = self.new_copy(model, node, CopyKind::HostCache);
            used.insert(node);
            out.push(Action::Create { copy, from: source });
        }
        out
    }

    /// Whether a new model of `bytes` could get its `k` copies: enough live nodes, with room.
    /// Draining nodes do not count.
    pub fn can_place(&self, bytes: u64) -> Result<(), PoolError> {
        let live = self.placeable_nodes().count();
        if live < self.k {
            return Err(PoolError::TooFewNodes { have: live, k: self.k });
        }
        let loads = self.bytes_per_node();
        let room = self.placeable_nodes().filter(|n| self.fits(&loads, *n, bytes)).count();
        if room < self.k {
            return Err(PoolError::NoRoom { bytes, have: room, k: self.k });
        }
        Ok(())
    }

    /// Registers a model of `bytes` and places its first `k` copies, loaded from its file;
    /// `file_reachable` says whether repairs may later fall back to that file.
    pub fn register(&mut self, model: ModelId, bytes: u64, file_reachable: bool) -> Result<Vec<Action>, PoolError> {
        if self.models.contains_key(&model) {
            return Err(PoolError::Duplicate(model));
        }
        self.can_place(bytes)?;
        self.models.insert(model, Model { bytes, file_reachable, lost: false });
        Ok(self.top_up_from(model, true))
    }

    /// Refuses a node that is not one of the pool's, naming them.
    fn member(&self, node: NodeId) -> Result<(), PoolError> {
        if self.nodes.contains_key(&node) {
            return Ok(());
        }
        Err(PoolError::NotInPool { node, nodes: self.nodes.keys().copied().collect() })
    }

    /// Records whether the model's file can still be read (repairs fall back to it).
    pub fn set_file_reachable(&mut self, model: ModelId, reachable: bool) -> Result<(), PoolError> {
        self.models.get_mut(&model).ok_or(PoolError::UnknownModel(model))?.file_reachable = reachable;
        Ok(())
    }

    /// Starts a serving instance of `model` on GPU `gpu` of `node`.
    pub fn deploy(&mut self, model: ModelId, node: NodeId, gpu: u32) -> Result<Vec<Action>, PoolError> {
        if !self.models.contains_key(&model) {
            return Err(PoolError::UnknownModel(model));
        }
        self.member(node)?;
        if !self.alive(node) {
            return Err(PoolError::NoSuchNode(node));
        }
        if self.draining.contains(&node) {
            return Err(PoolError::Draining(node));
        }
        let bytes = self.models.get(&model).map_or(0, |m| m.bytes);
        if !self.fits(&self.bytes_per_node(), node, bytes) {
            return Err(PoolError::NoRoom { bytes, have: 0, k: 1 });
        }
        let from = self.sources(model);
        let copy = self.new_copy(model, node, CopyKind::Gpu(gpu));
        Ok(vec![Action::Create { copy, from }])
    }

    /// [`deploy`](Self::deploy) on each of `nodes` (a scale-out), all or none: when one node is
    /// refused the pool is left as it was and the error names that node's refusal.
    pub fn deploy_all(&mut self, model: ModelId, nodes: &[NodeId], gpu: u32) -> Result<Vec<Action>, PoolError> {
        let mut next = self.clone();
        let mut actions = Vec::with_capacity(nodes.len());
        for &node in nodes {
            actions.extend(next.deploy(model, node, gpu)?);
        }
        *self = next;
        Ok(actions)
    }

    /// A copy is complete and verified: evictions it was waiting for can proceed.
    pub fn copy_ready(&mut self, id: CopyId) -> Result<Vec<Action>, PoolError> {
        let c = self.copies.get_mut(&id).ok_or(PoolError::UnknownCopy(id))?;
        if c.state == CopyState::Loading {
            c.state = CopyState::Ready;
        }
        let model = c.model;
        Ok(self.finish_evictions(model))
    }

    /// A copy could not be filled: forget it and make another where needed.
    pub fn copy_failed(&mut self, id: CopyId) -> Result<Vec<Action>, PoolError> {
        let c = self.copies.remove(&id).ok_or(PoolError::UnknownCopy(id))?;
        Ok(self.top_up(c.model))
    }

    /// Asks for a copy to go (scale-in). If the invariant would break without it, a host-cache copy
    /// is made elsewhere first and the copy is dropped once that one is ready.
    pub fn reclaim(&mut self, id: CopyId) -> Result<Vec<Action>, PoolError> {
        let c = self.copies.get(&id).ok_or(PoolError::UnknownCopy(id))?;
        let (model, node) = (c.model, c.node);
        // Without it, can the model still have k copies on distinct live nodes? Its node only
        // counts if another copy stays there: a replacement never goes where one is leaving.
        let used: BTreeSet<NodeId> = self
            .copies
            .values()
            .filter(|o| o.id != id && o.model == model && o.state != CopyState::Evicting && self.alive(o.node))
            .map(|o| o.node)
            .collect();
        let (loads, bytes) = (self.bytes_per_node(), self.models.get(&model).map_or(0, |m| m.bytes));
        let free =
            self.placeable_nodes().filter(|n| *n != node && !used.contains(n) && self.fits(&loads, *n, bytes)).count();
        if used.len() + free < self.k {
            return Err(PoolError::TooFewNodes { have: used.len() + free, k: self.k });
        }
        let c = self.copies.get_mut(&id).ok_or(PoolError::UnknownCopy(id))?;
        if c.state == CopyState::Loading {
            // Nothing serves from a copy still being filled: it goes at once (an evicting copy
            // is a source of its replacement, which a half-filled one cannot be).
            self.copies.remove(&id);
            let mut out = vec![Action::Drop { copy: id }];
            out.extend(self.top_up(model));
            return Ok(out);
        }
        c.state = CopyState::Evicting;
        let mut out = self.top_up(model);
        out.extend(self.finish_evictions(model));
        Ok(out)
    }

    /// Drops evicting copies of `model` as far as the ready copies elsewhere allow.
    fn finish_evictions(&mut self, model: ModelId) -> Vec<Action> {
        let evicting: Vec<CopyId> =
            self.copies.values().filter(|c| c.model == model && c.state == CopyState::Evicting).map(|c| c.id).collect();
        let mut out = Vec::new();
        for id in evicting {
            // Ready copies other than this one, on distinct live nodes.
            let others: BTreeSet<NodeId> = self
                .copies
                .values()
                .filter(|c| c.model == model && c.id != id && c.state == CopyState::Ready && self.alive(c.node))
                .map(|c| c.node)
                .collect();
            if others.len() >= self.k {
                self.copies.remove(&id);
                out.push(Action::Drop { copy: id });
            }
        }
        out
    }

    /// A node is declared dead: its copies are gone; every model below `k` is repaired from the
    /// surviving copies, or from its file, or reported lost.
    pub fn node_down(&mut self, node: NodeId) -> Vec<Action> {
        if let Some(a) = self.nodes.get_mut(&node) {
            *a = false;
        }
        let affected: BTreeSet<ModelId> = self.copies.values().filter(|c| c.node == node).map(|c| c.model).collect();
        self.copies.retain(|_, c| c.node != node);
        let mut out = Vec::new();
        for m in affected {
            out.extend(self.top_up(m));
            out.extend(self.finish_evictions(m));
        }
        out
    }

    /// A node (re)joins, empty.
    pub fn node_up(&mut self, node: NodeId) -> Vec<Action> {
        self.nodes.insert(node, true);
        let models: Vec<ModelId> = self.models.keys().copied().collect();
        models.into_iter().flat_map(|m| self.top_up(m)).collect()
    }

    /// Every broken invariant (a pool whose pending copies are not ready yet reports them).
    pub fn check(&self) -> Vec<Violation> {
        let mut v = Vec::new();
        let live = self.live_nodes().count();
        for (&m, info) in &self.models {
            // An evicting copy is whole until its replacement is ready: it still counts.
            let have = self.whole_nodes(m).len();
            if !info.lost && have < self.k.min(live) {
                v.push(Violation::TooFewCopies { model: m, have });
            }
        }
        for c in self.copies.values() {
            if !self.alive(c.node) {
                v.push(Violation::OnDeadNode { copy: c.id });
            }
        }
        v
    }
}

mod drain;

#[cfg(test)]
mod tests;
