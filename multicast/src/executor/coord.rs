//! The coordinator: a sans-IO state machine that tracks every target, and re-plans a target whose
//! sender failed it. It takes reports and observations and returns actions; the in-process
//! executor and the controller of the node daemons drive it.

use std::collections::{BTreeMap, BTreeSet};

use super::member::{ChildSpec, ToCoord};
use super::{Event, Report};
use crate::planner::{plan, PlannerKind, Request};
use crate::topology::{Loc, NodeId, Topology};
use crate::Plan;

/// Attempts at re-planning one target before it is declared failed.
const MAX_ATTEMPTS: u32 = 3;

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Tell `member` to send `child` everything it does not hold yet (`child.held_layers`).
    AddChild {
        /// The sender.
        member: Loc,
        /// The new child.
        child: ChildSpec,
    },
    /// Publish an event.
    Emit(Event),
}

/// Tracks a multicast run.
#[derive(Debug, Clone)]
pub(crate) struct Coordinator {
    topo: Topology,
    bytes: u64,
    sources: BTreeSet<Loc>,
    targets: BTreeSet<Loc>,
    specs: BTreeMap<Loc, ChildSpec>,
    parent: BTreeMap<Loc, Loc>,
    done: BTreeSet<Loc>,
    failed: BTreeMap<Loc, String>,
    attempts: BTreeMap<Loc, u32>,
    excluded: BTreeMap<Loc, BTreeSet<Loc>>,
    /// Per target, the layers `[0, n)` it reported ready (they complete in order).
    held: BTreeMap<Loc, u32>,
    replans: u32,
}

impl Coordinator {
    /// Starts tracking `plan`; `specs` gives each target's region.
    pub(crate) fn new(topo: &Topology, plan: &Plan, specs: BTreeMap<Loc, ChildSpec>) -> Coordinator {
        Coordinator {
            topo: topo.clone(),
            bytes: plan.bytes,
            sources: plan.sources(),
            parent: plan.edges.iter().map(|e| (e.to, e.from)).collect(),
            targets: plan.targets(),
            specs,
            done: BTreeSet::new(),
            failed: BTreeMap::new(),
            attempts: BTreeMap::new(),
            excluded: BTreeMap::new(),
            held: BTreeMap::new(),
            replans: 0,
        }
    }

    /// True once every target is completed or failed.
    pub(crate) fn finished(&self) -> bool {
        self.done.len() + self.failed.len() >= self.targets.len()
    }

    fn open(&self, t: &Loc) -> bool {
        !self.done.contains(t) && !self.failed.contains_key(t)
    }

    /// The (sender, target) pairs still in flight between different nodes, for liveness checks.
    pub(crate) fn edges_in_flight(&self) -> Vec<(Loc, Loc)> {
        self.parent.iter().filter(|(c, p)| self.open(c) && p.node != c.node).map(|(c, p)| (*p, *c)).collect()
    }

    /// A member's report.
    pub(crate) fn on_report(&mut self, m: ToCoord) -> Vec<Action> {
        match m {
            ToCoord::Done(l) => {
                if self.targets.contains(&l) && self.open(&l) {
                    self.done.insert(l);
                    return vec![Action::Emit(Event::TargetDone { target: l })];
                }
                vec![]
            }
            ToCoord::LayerReady { loc, layer } => {
                let held = self.held.entry(loc).or_default();
                if layer == *held as usize {
                    *held += 1;
                }
                vec![Action::Emit(Event::LayerReady { target: loc, layer })]
            }
            ToCoord::ChildLost { parent, child, reason } => self.on_broken(parent, child, &reason),
            // The controller compares a source's check; nothing in the plan changes.
            ToCoord::SourceChecked { .. } => vec![],
        }
    }

    /// Every member on `node` is gone: its open targets fail, and the targets it was feeding are
    /// re-planned.
    pub(crate) fn on_node_down(&mut self, node: NodeId, reason: &str) -> Vec<Action> {
        let mut out = Vec::new();
        let lost: Vec<Loc> = self.targets.iter().copied().filter(|t| t.node == node && self.open(t)).collect();
        for t in lost {
            out.extend(self.fail(t, format!("node {node} is down: {reason}")));
        }
        let fed: Vec<(Loc, Loc)> =
            self.parent.iter().filter(|(c, p)| p.node == node && self.open(c)).map(|(c, p)| (*p, *c)).collect();
        for (p, c) in fed {
            out.extend(self.on_broken(p, c, reason));
        }
        out
    }

    /// The deadline passed: every open target fails.
    pub(crate) fn on_deadline(&mut self, why: &str) -> Vec<Action> {
        let open: Vec<Loc> = self.targets.iter().copied().filter(|t| self.open(t)).collect();
        open.into_iter().flat_map(|t| self.fail(t, why.to_string())).collect()
    }

    /// `parent` could not send to `child`: find `child` another sender, or fail it.
    pub(crate) fn on_broken(&mut self, parent: Loc, child: Loc, reason: &str) -> Vec<Action> {
        let mut out = Vec::new();
        let mut work = vec![(parent, child, reason.to_string())];
        while let Some((p, c, why)) = work.pop() {
            if !self.open(&c) || self.parent.get(&c) != Some(&p) {
                continue; // stale, or already handled
            }
            self.excluded.entry(c).or_default().insert(p);
            let n = self.attempts.entry(c).or_default();
            *n += 1;
            let holders: Vec<Loc> = self
                .sources
                .iter()
                .chain(self.done.iter())
                .copied()
                .filter(|h| !self.excluded[&c].contains(h) && !self.failed.contains_key(h))
                .collect();
            let next = if *n > MAX_ATTEMPTS || holders.is_empty() {
                None
            } else {
                let req = Request { bytes: self.bytes, sources: holders, targets: vec![c] };
                plan(&self.topo, &req, PlannerKind::Blitz).ok().and_then(|p| p.edges.first().map(|e| e.from))
            };
            match (next, self.specs.get(&c).copied()) {
                (Some(np), Some(mut spec)) => {
                    // The new sender skips the layers the target already holds verified.
                    spec.held_layers = self.held.get(&c).copied().unwrap_or(0);
                    self.replans += 1;
                    self.parent.insert(c, np);
                    out.push(Action::AddChild { member: np, child: spec });
                    out.push(Action::Emit(Event::Replanned { target: c, from: np }));
                }
                _ => {
                    out.extend(self.fail(c, format!("no surviving holder can reach it (last error: {why})")));
                    // Its own children lose their sender too.
                    for (&orphan, &op) in &self.parent {
                        if op == c && self.open(&orphan) {
                            work.push((c, orphan, format!("its sender {c} failed")));
                        }
                    }
                }
            }
        }
        out
    }

    fn fail(&mut self, t: Loc, why: String) -> Vec<Action> {
        if !self.open(&t) {
            return vec![];
        }
        self.failed.insert(t, why.clone());
        vec![Action::Emit(Event::TargetFailed { target: t, reason: why })]
    }

    /// The outcome so far.
    pub(crate) fn report(&self, resent_chunks: u64, seconds: f64) -> Report {
        Report {
            completed: self.done.iter().copied().collect(),
            failed: self.failed.iter().map(|(l, w)| (*l, w.clone())).collect(),
            replans: self.replans,
            resent_chunks,
            seconds,
        }
    }
}
