//! `check` and `repair`: the pool's invariant and every copy's checksums verified on its node,
//! and what they find repaired.

use super::{report, CheckReport, Manager, ManagerError};
use crate::meta::{Event, MetaStore};
use crate::pool::{CopyState, ModelCopy};

impl<S: MetaStore + 'static> Manager<S> {
    /// Checks the invariant and every copy's checksums on its node.
    pub async fn check(&mut self) -> Result<CheckReport, ManagerError> {
        let mut problems: Vec<String> = Vec::new();
        for v in self.pool().check() {
            problems.push(report::describe(&v));
        }
        for (m, why) in &self.lost {
            problems.push(format!("model {m} is lost: {why}"));
        }
        for n in self.detector.suspects().keys() {
            problems.push(format!("node {n} is unreachable (not yet declared dead)"));
        }
        let copies: Vec<ModelCopy> = self.pool().copies().cloned().collect();
        for c in copies.iter().filter(|c| c.state == CopyState::Loading) {
            problems.push(format!("copy {} of model {} on node {} is still loading", c.id, c.model, c.node));
        }
        let listing = self.io.list(self.pool().live_nodes().collect()).await;
        self.foreign = listing.foreign;
        self.publish();
        let held = listing.ours;
        for n in self.pool().live_nodes() {
            match held.get(&n) {
                None => problems.push(format!("node {n} did not answer")),
                Some(ids) => {
                    for id in ids {
                        if !copies.iter().any(|c| c.id == *id && c.node == n) {
                            problems.push(format!("node {n} holds copy {id}, which the pool does not know"));
                        }
                    }
                }
            }
        }
        let ready: Vec<ModelCopy> = copies.iter().filter(|c| c.state != CopyState::Loading).cloned().collect();
        let sums = self.io.check(self.with_crcs(&ready)).await;
        let mut bad = Vec::new();
        for c in &ready {
            if !sums.get(&c.id).copied().unwrap_or(false) {
                problems.push(format!(
                    "copy {} of model {} on node {} is missing or does not match its manifest's crcs",
                    c.id, c.model, c.node
                ));
                bad.push(c.id);
                self.verified.remove(&c.id);
                self.bad.insert(c.id);
            } else {
                self.verified.insert(c.id);
                self.bad.remove(&c.id);
            }
        }
        self.publish();
        Ok(CheckReport {
            healthy: problems.is_empty(),
            copies_checked: ready.len(),
            bytes_checked: ready.iter().map(|c| self.model_bytes(c.model)).sum(),
            problems,
            bad_copies: bad,
        })
    }

    /// Repairs what [`check`](Self::check) finds: unreachable nodes are declared dead now, bad
    /// copies are replaced, unknown ones dropped, unfinished ones made again. Returns the check
    /// after the repair.
    pub async fn repair(&mut self) -> Result<CheckReport, ManagerError> {
        self.count_repair("admin");
        let mut actions = Vec::new();
        for n in self.pool().live_nodes().collect::<Vec<_>>() {
            if !self.connected(n) {
                actions.extend(self.declare_dead(n).await?);
            }
        }
        self.drive(actions).await?;
        let before = self.check().await?;
        let mut actions = Vec::new();
        for id in &before.bad_copies {
            if let Some(c) = self.seen.get(id).cloned() {
                self.io.drop_all(vec![(c.node, c.id)]).await;
                actions.extend(self.apply(Event::CopyFailed(c.id)).await?);
            }
        }
        self.drive(actions).await?;
        self.reconcile().await?;
        self.check().await
    }
}
