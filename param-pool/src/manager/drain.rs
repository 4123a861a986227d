//! Draining a node through the manager (`cascade pool drain --node N`): the pool's
//! [`drain`](crate::pool::Pool::drain) written ahead and carried out — every copy the node holds
//! is made again elsewhere by multicast from the copies (the node's own among the sources), and
//! dropped from the node once its replacement is verified — so the node can then be stopped
//! without the pool ever holding fewer than k whole copies of a model. A node stopped without a
//! drain costs a repair after the failure detector's wait, a copy short until then.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Manager, ManagerError};
use crate::meta::{Event, MetaStore};
use crate::pool::{CopyId, CopyState, ModelId, NodeId};

/// What a drain did (`cascade pool drain`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainReport {
    /// The node.
    pub node: NodeId,
    /// The node holds nothing for the pool any more: it may be stopped.
    pub drained: bool,
    /// Copies made elsewhere to replace the node's (new ready copies of its models, at most as
    /// many per model as it held: copies a concurrent repair made are not counted beyond that).
    pub copies_made: usize,
    /// Their bytes.
    pub bytes_made: u64,
    /// Copies the node dropped.
    pub copies_dropped: usize,
    /// Copies still on the node (their replacements could not be made; see the manager's log).
    pub left: Vec<CopyId>,
    /// Wall-clock seconds the drain took.
    pub seconds: f64,
}

/// The drain's replacements among the new ready copies (`new`, by model): at most as many of
/// each model as the node held (`held`). A repair running meanwhile for another node may have
/// made copies too, of these models or of others, and they are not the drain's.
fn replacements(mut held: BTreeMap<ModelId, usize>, new: impl Iterator<Item = ModelId>) -> Vec<ModelId> {
    new.filter(|m| held.get_mut(m).and_then(|room| room.checked_sub(1).map(|r| *room = r)).is_some()).collect()
}

impl<S: MetaStore + 'static> Manager<S> {
    /// Drains `node` and waits until its copies are replaced and dropped. Refused, with nothing
    /// written, when the other nodes could not hold k copies of every model it holds.
    pub async fn drain(&mut self, node: NodeId) -> Result<DrainReport, ManagerError> {
        // Tried on a copy first: a drain the pool refuses is not written ahead.
        self.pool().clone().drain(node).map_err(|e| ManagerError::Refused(format!("draining node {node}: {e}")))?;
        let t = Instant::now();
        // The node's copies, and how many of each model it holds: the most the drain replaces.
        let (mut held, mut to_replace) = (BTreeSet::new(), BTreeMap::new());
        for c in self.pool().copies().filter(|c| c.node == node) {
            held.insert(c.id);
            *to_replace.entry(c.model).or_default() += 1;
        }
        let before: BTreeSet<CopyId> = self.pool().copies().map(|c| c.id).collect();
        info!(node, copies = held.len(), "draining the node: its copies are made elsewhere first");
        self.remember(node, format!("draining: {} to move", super::copies(held.len())));
        let actions = self.apply(Event::Drain(node)).await?;
        self.drive(actions).await?;
        let made = replacements(
            to_replace,
            self.pool().copies().filter(|c| !before.contains(&c.id) && c.state == CopyState::Ready).map(|c| c.model),
        );
        let left: Vec<CopyId> = self.pool().copies().filter(|c| c.node == node).map(|c| c.id).collect();
        let report = DrainReport {
            node,
            drained: left.is_empty(),
            copies_made: made.len(),
            bytes_made: made.iter().map(|m| self.model_bytes(*m)).sum(),
            copies_dropped: held.iter().filter(|c| !left.contains(c)).count(),
            left,
            seconds: t.elapsed().as_secs_f64(),
        };
        let result = if report.drained { "drained" } else { "incomplete" };
        self.io
            .mesh
            .metrics()
            .counter("cascade_pool_drains", "Drains of pool nodes, by result", &[("result", result)])
            .inc();
        if report.drained {
            info!(node, made = report.copies_made, seconds = report.seconds, "drained: the node may be stopped");
            self.remember(
                node,
                format!("drained: {} made elsewhere, {:.2} s", super::copies(report.copies_made), report.seconds),
            );
        } else {
            warn!(node, left = ?report.left, "the drain is incomplete: some copies could not be made elsewhere");
            self.remember(node, format!("drain incomplete: {} still here", super::copies(report.left.len())));
        }
        self.publish();
        Ok(report)
    }

    /// Takes a drained `node` back: the pool may place copies there again (models left short
    /// of k are topped up at once).
    pub async fn undrain(&mut self, node: NodeId) -> Result<(), ManagerError> {
        if !self.pool().members().any(|(n, _)| n == node) {
            return Err(ManagerError::Refused(format!("node {node} is not a member of the pool")));
        }
        if !self.pool().is_draining(node) {
            return Ok(());
        }
        let actions = self.apply(Event::Undrain(node)).await?;
        info!(node, "undrained: copies may be placed on the node again");
        self.remember(node, "undrained".into());
        self.drive(actions).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_node_s_models_count_as_its_replacements_and_no_more_than_it_held() {
        let held = BTreeMap::from([(1, 2), (2, 1)]);
        // Model 3's copy and the second extra copy of model 2 come from a concurrent repair.
        assert_eq!(replacements(held.clone(), [1, 3, 2, 1, 2].into_iter()), vec![1, 2, 1]);
        assert_eq!(replacements(held, [1].into_iter()), vec![1], "a replacement not yet ready is not counted");
        assert!(replacements(BTreeMap::new(), [1, 2].into_iter()).is_empty());
    }
}
