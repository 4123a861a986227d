//! Carrying out an epoch plan's moves (Symphony §4.7's sub-clusters, Shepherd's HERD groups): a
//! model the plan puts on another sub-cluster gets serving instances there through the pool —
//! one multicast from its copies — and only then leaves its old sub-cluster, so it is served
//! throughout. The plan itself comes from `cascade_sched::plan` (`epoch-plan`); this side only
//! knows models, nodes and which sub-cluster holds which nodes.

use super::{Manager, ManagerError};
use crate::meta::MetaStore;
use crate::pool::{CopyKind, CopyState, ModelId, NodeId};

/// One model's move between two epochs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EpochMove {
    /// The model.
    pub model: ModelId,
    /// The nodes of its old sub-cluster (its instances there go).
    pub from: Vec<NodeId>,
    /// The nodes of its new sub-cluster (each gets an instance on GPU 0).
    pub to: Vec<NodeId>,
}

/// The moves between two plans: `previous[i]` and `next[i]` are the sub-clusters of
/// `models[i]`, `nodes_of[j]` the nodes of sub-cluster j. Models that stay do not move.
///
/// Refused: plans of another length than `models`, a model listed twice (the plans would put it
/// in two sub-clusters at once), a node in two sub-clusters (they partition the cluster: a model
/// moving between the two would lose its instance there), and a sub-cluster the plans name but
/// `nodes_of` lacks.
pub fn epoch_moves(
    models: &[ModelId],
    previous: &[usize],
    next: &[usize],
    nodes_of: &[Vec<NodeId>],
) -> Result<Vec<EpochMove>, String> {
    if previous.len() != models.len() || next.len() != models.len() {
        return Err(format!("{} models, plans of {} and {}", models.len(), previous.len(), next.len()));
    }
    check_models_and_sub_clusters(models, nodes_of)?;
    models
        .iter()
        .zip(previous.iter().zip(next))
        .filter(|(_, (a, b))| a != b)
        .map(|(&model, (&a, &b))| {
            Ok(EpochMove { model, from: nodes(nodes_of, model, a)?, to: nodes(nodes_of, model, b)? })
        })
        .collect()
}

/// The nodes of sub-cluster `j`, where a plan puts `model`.
fn nodes(nodes_of: &[Vec<NodeId>], model: ModelId, j: usize) -> Result<Vec<NodeId>, String> {
    nodes_of.get(j).cloned().ok_or_else(|| {
        format!(
            "a plan puts model {model} in sub-cluster {j}, but only {} are given (0 to {})",
            nodes_of.len(),
            nodes_of.len().saturating_sub(1)
        )
    })
}

/// Each model once, each node once in one sub-cluster at most.
fn check_models_and_sub_clusters(models: &[ModelId], nodes_of: &[Vec<NodeId>]) -> Result<(), String> {
    if let Some((first, i)) = super::first_repeat(models) {
        return Err(format!(
            "model {} is listed twice (the plans' models {first} and {i}): a model is in one sub-cluster",
            models[i]
        ));
    }
    let mut home = std::collections::BTreeMap::new();
    for (j, nodes) in nodes_of.iter().enumerate() {
        for &n in nodes {
            match home.insert(n, j) {
                Some(k) if k == j => return Err(format!("node {n} is listed twice in sub-cluster {j}")),
                Some(k) => {
                    return Err(format!("node {n} is in sub-clusters {k} and {j}: sub-clusters do not share nodes"));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// The moves an epoch plan asks for (`assignment` arrays of `epoch-plan --json`): against the
/// previous epoch's plan, only the models whose sub-cluster changed; without one (the first
/// epoch), every model to its sub-cluster. Refused as [`epoch_moves`] refuses.
pub fn moves_from_plans(
    models: &[ModelId],
    previous: Option<&[usize]>,
    next: &[usize],
    nodes_of: &[Vec<NodeId>],
) -> Result<Vec<EpochMove>, String> {
    match previous {
        Some(p) => epoch_moves(models, p, next, nodes_of),
        None => {
            if next.len() != models.len() {
                return Err(format!("{} models, a plan of {}", models.len(), next.len()));
            }
            check_models_and_sub_clusters(models, nodes_of)?;
            models
                .iter()
                .zip(next)
                .map(|(&model, &j)| Ok(EpochMove { model, from: Vec::new(), to: nodes(nodes_of, model, j)? }))
                .collect()
        }
    }
}

impl<S: MetaStore + 'static> Manager<S> {
    /// Carries out `moves` in order: for each, an instance on GPU 0 of every `to` node that has
    /// none (one multicast), checked ready, and then the GPU instances on the `from` nodes are
    /// reclaimed (the pool keeps its k copies while doing so). A plan naming a model that is not
    /// registered or a node outside the pool is refused before anything moves; a move that cannot
    /// be made stops here with the old instances still serving.
    pub async fn apply_epoch(&mut self, moves: &[EpochMove]) -> Result<(), ManagerError> {
        // The whole plan is checked before its first move: one naming a model that is not
        // registered or a node outside the pool used to stop it in its middle, the moves before
        // it made and the rest not.
        let members: Vec<NodeId> = self.pool().members().map(|(n, _)| n).collect();
        let twice = super::first_repeat(&moves.iter().map(|m| m.model).collect::<Vec<_>>());
        for (i, mv) in moves.iter().enumerate() {
            if let Some((first, _)) = twice.filter(|&(_, at)| at == i) {
                return Err(ManagerError::Refused(format!(
                    "model {} moves twice in one plan (to {:?} and {:?}): nothing was moved",
                    mv.model, moves[first].to, mv.to
                )));
            }
            if !self.pool().has_model(mv.model) {
                return Err(ManagerError::Refused(format!("model {} is not registered: nothing was moved", mv.model)));
            }
            if mv.to.is_empty() {
                return Err(ManagerError::Refused(format!("model {} moves to no node: nothing was moved", mv.model)));
            }
            if let Some(n) = mv.to.iter().find(|n| !members.contains(n)) {
                return Err(ManagerError::Refused(format!(
                    "node {n} (in model {}'s move) is not a pool node: nothing was moved",
                    mv.model
                )));
            }
        }
        for mv in moves {
            let on = |m: &Self, n: NodeId| {
                m.pool().copies().any(|c| {
                    c.model == mv.model && c.node == n && c.kind == CopyKind::Gpu(0) && c.state == CopyState::Ready
                })
            };
            let missing: Vec<NodeId> = mv.to.iter().copied().filter(|&n| !on(self, n)).collect();
            if !missing.is_empty() {
                self.scale_out(mv.model, &missing).await?;
            }
            if let Some(n) = mv.to.iter().find(|&&n| !on(self, n)) {
                return Err(ManagerError::Refused(format!(
                    "model {} could not be started on node {n} of its new sub-cluster; its old instances stay",
                    mv.model
                )));
            }
            let old: Vec<_> = self
                .pool()
                .copies()
                .filter(|c| c.model == mv.model && mv.from.contains(&c.node) && !mv.to.contains(&c.node))
                .filter(|c| matches!(c.kind, CopyKind::Gpu(_)))
                .map(|c| c.id)
                .collect();
            for copy in old {
                self.reclaim(copy).await?;
            }
        }
        Ok(())
    }
}
