//! The manager's policy, sans I/O: how the pool's actions become jobs (one per model, run
//! concurrently), when to give up on a model's copies, and what reconciling with the nodes
//! decides. The driver (`manager.rs`) executes what these functions return.

use std::collections::{BTreeMap, BTreeSet};

use cascade_multicast::Loc;

use crate::meta::ModelEntry;
use crate::pool::{Action, CopyId, CopyKind, CopyState, ModelCopy, ModelId, NodeId, Pool, Source};

/// A copy's location in a multicast plan.
pub fn loc_of(c: &ModelCopy) -> Loc {
    match c.kind {
        CopyKind::Gpu(g) => Loc::gpu(c.node, g),
        CopyKind::HostCache => Loc::host(c.node),
    }
}

/// Copies to make, with where they come from.
pub type Group = Vec<(ModelCopy, Source)>;
/// Groups of copies to make, by model and by whether they come from the file.
pub type Creates = BTreeMap<(ModelId, bool), Group>;

/// A batch of the pool's actions, sorted by what the driver does with them.
#[derive(Debug, Default, PartialEq)]
pub struct Batch {
    /// Copies to release on their nodes.
    pub drops: Vec<CopyId>,
    /// Models with no copy and no reachable file.
    pub lost: Vec<(ModelId, String)>,
    /// Copies to make, by model and by whether they come from the file.
    pub creates: Creates,
}

/// Sorts `actions`.
pub fn split(actions: impl IntoIterator<Item = Action>) -> Batch {
    let mut b = Batch::default();
    for a in actions {
        match a {
            Action::Drop { copy } => b.drops.push(copy),
            Action::Lost { model, reason } => b.lost.push((model, reason)),
            Action::Create { copy, from } => {
                let file = from == Source::File;
                b.creates.entry((copy.model, file)).or_default().push((copy, from));
            }
        }
    }
    b
}

/// One model's copies to make: the unit the driver runs concurrently with other models'.
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    /// Load the copies from the model's file, each on its node.
    Load {
        /// The model.
        model: ModelId,
        /// Its catalog entry (file and manifest).
        entry: ModelEntry,
        /// The copies.
        copies: Vec<ModelCopy>,
    },
    /// One chained multicast from the model's reachable ready copies to the new ones.
    Multicast {
        /// The model.
        model: ModelId,
        /// Its catalog entry (the manifest gives the layout and the crcs).
        entry: ModelEntry,
        /// Source copies by location.
        sources: BTreeMap<Loc, CopyId>,
        /// New copies by location.
        targets: BTreeMap<Loc, ModelCopy>,
    },
}

impl Job {
    /// The model.
    pub fn model(&self) -> ModelId {
        match self {
            Job::Load { model, .. } | Job::Multicast { model, .. } => *model,
        }
    }

    /// The copies it makes.
    pub fn copies(&self) -> Vec<CopyId> {
        match self {
            Job::Load { copies, .. } => copies.iter().map(|c| c.id).collect(),
            Job::Multicast { targets, .. } => targets.values().map(|c| c.id).collect(),
        }
    }
}

/// The job for one group of [`Batch::creates`], or why there is none (every copy of the group
/// then fails).
pub fn job(
    pool: &Pool,
    catalog: &BTreeMap<ModelId, ModelEntry>,
    model: ModelId,
    file: bool,
    group: &[(ModelCopy, Source)],
    connected: impl Fn(NodeId) -> bool,
) -> Result<Job, String> {
    let entry = catalog.get(&model).cloned().ok_or_else(|| format!("model {model} has no catalog entry"))?;
    if file {
        return Ok(Job::Load { model, entry, copies: group.iter().map(|(c, _)| c.clone()).collect() });
    }
    let mut sources = BTreeMap::new();
    for (_, from) in group {
        if let Source::Copies(ids) = from {
            for id in ids {
                if let Some(c) = pool.copies().find(|c| c.id == *id && connected(c.node)) {
                    sources.insert(loc_of(c), c.id);
                }
            }
        }
    }
    if sources.is_empty() {
        return Err("no reachable source copy".into());
    }
    let targets = group.iter().map(|(c, _)| (loc_of(c), c.clone())).collect();
    Ok(Job::Multicast { model, entry, sources, targets })
}

/// How many times a model's copies may fail within one drive before the driver stops retrying
/// them (an operator's `cascade pool repair` tries again).
pub const MAX_FAILURES: u32 = 3;

/// Counts failed copies per model within one drive.
#[derive(Debug, Default)]
pub struct Retries {
    failures: BTreeMap<ModelId, u32>,
}

impl Retries {
    /// Records a failed copy of `model`; true while its follow-ups should still be done.
    pub fn failed(&mut self, model: ModelId) -> bool {
        let f = self.failures.entry(model).or_default();
        *f += 1;
        *f <= MAX_FAILURES
    }
}

/// What reconciling the pool with what the nodes hold decides.
#[derive(Debug, Default, PartialEq)]
pub struct Reconcile {
    /// Copies on nodes that the pool does not know: dropped.
    pub unknown: Vec<(NodeId, CopyId)>,
    /// Copies still loading in the pool that their node holds: checked, and kept if they match.
    pub check: Vec<ModelCopy>,
    /// Copies still loading in the pool that their node does not hold: made again.
    pub reissue: Vec<ModelCopy>,
    /// Complete copies in the pool that their (answering) node does not hold any more: failed,
    /// so the pool makes them again.
    pub missing: Vec<ModelCopy>,
}

/// Compares the pool with `held` (what each answering node lists).
pub fn reconcile(pool: &Pool, held: &BTreeMap<NodeId, Vec<CopyId>>) -> Reconcile {
    let mut r = Reconcile::default();
    for (&node, ids) in held {
        for &id in ids {
            if !pool.copies().any(|c| c.id == id && c.node == node) {
                r.unknown.push((node, id));
            }
        }
    }
    for c in pool.copies() {
        let here = held.get(&c.node).map(|ids| ids.contains(&c.id));
        match (c.state, here) {
            (CopyState::Loading, Some(true)) => r.check.push(c.clone()),
            (CopyState::Loading, _) => r.reissue.push(c.clone()),
            (_, Some(false)) => r.missing.push(c.clone()),
            _ => {}
        }
    }
    r
}

/// `Create` actions that make `copies` again from their model's current sources.
pub fn reissue(pool: &Pool, copies: Vec<ModelCopy>) -> Vec<Action> {
    copies.into_iter().map(|c| Action::Create { from: pool.sources(c.model), copy: c }).collect()
}

/// The groups of `creates` that can start now: at most one job per model runs at a time (its
/// follow-ups wait for it). Returns the startable groups and puts back the others.
pub fn startable(creates: &mut Creates, busy: &BTreeSet<ModelId>) -> Vec<((ModelId, bool), Group)> {
    let mut taken = BTreeSet::new();
    let keys: Vec<(ModelId, bool)> =
        creates.keys().filter(|(m, _)| !busy.contains(m) && taken.insert(*m)).copied().collect();
    keys.into_iter().filter_map(|k| creates.remove(&k).map(|g| (k, g))).collect()
}

#[cfg(test)]
mod tests;
