//! Draining a node: the operator's planned removal (maintenance, a smaller cluster), which
//! keeps the invariant at every moment — unlike stopping the node, which leaves its models a
//! copy short until the failure detector declares it dead and the repair completes.
//!
//! A drained node takes no new copy (placement, repairs, instances) until it is undrained. Its
//! copies are evicted the way [`Pool::reclaim`] evicts one: each stays — counting for the
//! invariant and serving as a source — until a replacement elsewhere is ready, then goes. The
//! mark is part of the pool (an event, so it survives a restart of the manager) and outlives
//! the node's death and return, as a cordon does: only [`Pool::undrain`] lifts it.

use std::collections::BTreeSet;

use super::{Action, CopyState, ModelId, NodeId, Pool, PoolError};

impl Pool {
    /// Drains `node`: nothing new is placed there, and each of its copies is replaced elsewhere
    /// before it is dropped. A copy still being filled there is dropped at once.
    ///
    /// All or nothing: refused ([`PoolError::TooFewNodes`], the pool unchanged) when some model
    /// it holds could not get its `k` copies on the other live, undrained nodes with room.
    /// Draining a node already draining, or one declared dead (it holds nothing), only marks it.
    pub fn drain(&mut self, node: NodeId) -> Result<Vec<Action>, PoolError> {
        self.member(node)?;
        let mut next = self.clone();
        next.draining.insert(node);
        let mut out = Vec::new();
        let mut models = BTreeSet::new();
        let held: Vec<_> = next.copies.values().filter(|c| c.node == node).map(|c| (c.id, c.model, c.state)).collect();
        for (id, model, state) in held {
            models.insert(model);
            match state {
                CopyState::Loading => {
                    next.copies.remove(&id);
                    out.push(Action::Drop { copy: id });
                }
                CopyState::Ready => {
                    if let Some(c) = next.copies.get_mut(&id) {
                        c.state = CopyState::Evicting;
                    }
                }
                CopyState::Evicting => {}
            }
        }
        for &m in &models {
            out.extend(next.top_up(m));
            let placed = next.used_nodes(m).len();
            if placed < next.k && !next.models.get(&m).is_some_and(|x| x.lost) {
                return Err(PoolError::TooFewNodes { have: placed, k: next.k });
            }
        }
        for &m in &models {
            out.extend(next.finish_evictions(m));
        }
        *self = next;
        Ok(out)
    }

    /// Takes a drained `node` back: copies may be placed there again, and models the drain or a
    /// lack of room left short of `k` are topped up. Copies still evicting there keep going (a
    /// drain undone keeps what it moved).
    pub fn undrain(&mut self, node: NodeId) -> Result<Vec<Action>, PoolError> {
        self.member(node)?;
        if !self.draining.remove(&node) {
            return Ok(Vec::new());
        }
        let models: Vec<ModelId> = self.models.keys().copied().collect();
        Ok(models.into_iter().flat_map(|m| self.top_up(m)).collect())
    }

    /// Whether `node` is drained or draining.
    pub fn is_draining(&self, node: NodeId) -> bool {
        self.draining.contains(&node)
    }

    /// The drained and draining nodes.
    pub fn draining(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.draining.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{CopyId, CopyKind, Source};
    use super::*;

    fn creates(a: &[Action]) -> Vec<CopyId> {
        a.iter().filter_map(|x| if let Action::Create { copy, .. } = x { Some(copy.id) } else { None }).collect()
    }

    /// k = 2 over nodes 0..4, models 1..=3 settled, and an instance of model 1 on node `on`.
    fn pool_with_instance(on: NodeId) -> Pool {
        let mut p = Pool::new(2, 0..4);
        for m in 1..=3 {
            for id in creates(&p.register(m, 100 * m as u64, true).unwrap()) {
                p.copy_ready(id).unwrap();
            }
        }
        for id in creates(&p.deploy(1, on, 0).unwrap()) {
            p.copy_ready(id).unwrap();
        }
        p
    }

    #[test]
    fn a_drain_replaces_every_copy_before_dropping_it_and_never_goes_below_k() {
        let mut p = pool_with_instance(0);
        let victim = p.copies().filter(|c| c.node == 0).count();
        assert!(victim >= 2, "node 0 holds copies to move");
        let mut work = p.drain(0).unwrap();
        assert!(p.check().is_empty(), "the evicting copies still count: {:?}", p.check());
        let mut dropped = BTreeSet::new();
        // The daemons complete one copy at a time; the invariant holds after each.
        while let Some(a) = work.pop() {
            match a {
                Action::Create { copy, from } => {
                    assert_ne!(copy.node, 0, "nothing new on a drained node");
                    assert!(matches!(from, Source::Copies(_)), "replacements come from the copies");
                    work.extend(p.copy_ready(copy.id).unwrap());
                }
                Action::Drop { copy } => {
                    dropped.insert(copy);
                }
                Action::Lost { .. } => panic!("{a:?}"),
            }
            assert!(p.check().is_empty(), "{:?}", p.check());
        }
        assert_eq!(dropped.len(), victim, "every copy of node 0 went, once its replacement was ready");
        assert_eq!(p.copies().filter(|c| c.node == 0).count(), 0);
        for m in 1..=3 {
            assert_eq!(p.ready_nodes(m).len(), 2, "model {m}: k ready copies elsewhere");
        }
        // Nothing new goes there: a register, an instance, a repair.
        for id in creates(&p.register(4, 10, true).unwrap()) {
            assert_ne!(p.copies().find(|c| c.id == id).unwrap().node, 0);
        }
        assert_eq!(p.deploy(2, 0, 0), Err(PoolError::Draining(0)));
        let other = p.copies().find(|c| c.node == 1).unwrap().node;
        assert!(p.node_down(other).iter().all(|a| !matches!(a, Action::Create { copy, .. } if copy.node == 0)));
        // Its death and return do not lift the drain; undrain does.
        p.node_down(0);
        p.node_up(0);
        assert!(p.is_draining(0));
        assert_eq!(p.deploy(2, 0, 0), Err(PoolError::Draining(0)));
        p.undrain(0).unwrap();
        assert!(!p.is_draining(0));
        assert!(p.deploy(2, 0, 0).is_ok());
    }

    #[test]
    fn a_drain_that_would_leave_a_model_short_is_refused_and_changes_nothing() {
        let mut p = Pool::new(2, 0..3);
        for id in creates(&p.register(1, 100, true).unwrap()) {
            p.copy_ready(id).unwrap();
        }
        let on: Vec<NodeId> = p.copies().map(|c| c.node).collect();
        let free = (0..3).find(|n| !on.contains(n)).unwrap();
        // The first drain fits (the free node takes the copy); a second would leave one node.
        let first = on[0];
        let a = p.drain(first).unwrap();
        for id in creates(&a) {
            p.copy_ready(id).unwrap();
        }
        let before = p.clone();
        assert_eq!(p.drain(free), Err(PoolError::TooFewNodes { have: 1, k: 2 }));
        assert_eq!(p, before, "a refused drain leaves the pool as it was");
        // No room counts like no node.
        let mut q = Pool::new(2, 0..3);
        q.set_capacity(2, Some(50));
        for id in creates(&q.register(1, 100, true).unwrap()) {
            q.copy_ready(id).unwrap();
        }
        let before = q.clone();
        assert!(matches!(q.drain(0), Err(PoolError::TooFewNodes { .. })));
        assert_eq!(q, before);
        assert_eq!(q.drain(9), Err(PoolError::NotInPool { node: 9, nodes: vec![0, 1, 2] }));
    }

    #[test]
    fn a_copy_still_loading_on_a_drained_node_goes_at_once_and_is_made_elsewhere() {
        let mut p = Pool::new(1, 0..3);
        let a = p.register(1, 100, true).unwrap();
        let loading = p.copies().next().unwrap().clone();
        assert_eq!(creates(&a), vec![loading.id]);
        let a = p.drain(loading.node).unwrap();
        assert!(a.contains(&Action::Drop { copy: loading.id }), "{a:?}");
        let made = creates(&a);
        assert_eq!(made.len(), 1, "{a:?}");
        let c = p.copies().find(|c| c.id == made[0]).unwrap();
        assert_ne!(c.node, loading.node);
        assert_eq!(c.kind, CopyKind::HostCache);
        // A half-filled copy is no source: the replacement comes from the file.
        assert!(a.iter().any(|x| matches!(x, Action::Create { from: Source::File, .. })), "{a:?}");
    }

    #[test]
    fn draining_survives_a_snapshot_of_the_pool() {
        let mut p = pool_with_instance(1);
        p.drain(1).unwrap();
        let back: Pool = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(back.is_draining(1));
        // A snapshot written before draining existed reads as draining nothing.
        let mut v: serde_json::Value = serde_json::to_value(&p).unwrap();
        v.as_object_mut().unwrap().remove("draining");
        let old: Pool = serde_json::from_value(v).unwrap();
        assert_eq!(old.draining().count(), 0);
    }
}
