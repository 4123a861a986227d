//! Decision-level tests of the manager's policy (pure: no node, no clock).

use super::*;
use crate::manifest::Manifest;
use crate::pool::{CopyState, Pool};

fn entry(bytes: u64) -> ModelEntry {
    let manifest = Manifest {
        name: "m".into(),
        bytes,
        file_bytes: bytes,
        chunk: bytes,
        chunk_crcs: vec![0],
        layers: vec![],
        content_hash: String::new(),
    };
    ModelEntry { path: "/m".into(), manifest }
}

/// A pool of nodes 1..=4 with models 1 and 2 registered (k = 1) and their loads done.
fn pool() -> (Pool, BTreeMap<ModelId, ModelEntry>) {
    let mut p = Pool::new(1, 1..=4);
    for m in [1, 2] {
        for a in p.register(m, 10, true).unwrap() {
            if let Action::Create { copy, .. } = a {
                p.copy_ready(copy.id).unwrap();
            }
        }
    }
    (p, BTreeMap::from([(1, entry(10)), (2, entry(10))]))
}

#[test]
fn actions_split_into_drops_losses_and_one_group_per_model_and_source() {
    let (mut p, _) = pool();
    let node = p.copies().next().unwrap().node;
    let mut actions = p.node_down(node);
    actions.push(Action::Drop { copy: 77 });
    actions.push(Action::Lost { model: 9, reason: "gone".into() });
    let b = split(actions);
    assert_eq!(b.drops, vec![77]);
    assert_eq!(b.lost, vec![(9, "gone".to_string())]);
    // k = 1: the dead node's copy comes back from the file.
    assert_eq!(b.creates.len(), 1);
    assert!(b.creates.keys().all(|(_, file)| *file));
}

#[test]
fn one_job_per_model_at_a_time_and_models_in_parallel() {
    let (p, _) = pool();
    let c1 = p.copies().find(|c| c.model == 1).unwrap().clone();
    let c2 = p.copies().find(|c| c.model == 2).unwrap().clone();
    let mut creates = BTreeMap::from([
        ((1, true), vec![(c1.clone(), Source::File)]),
        ((1, false), vec![(c1.clone(), Source::Copies(vec![]))]),
        ((2, true), vec![(c2.clone(), Source::File)]),
    ]);
    let first = startable(&mut creates, &BTreeSet::new());
    let keys: Vec<_> = first.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, vec![(1, false), (2, true)], "models 1 and 2 start together, one group each");
    assert_eq!(creates.len(), 1);
    assert!(startable(&mut creates, &BTreeSet::from([1])).is_empty(), "model 1 is busy");
    assert_eq!(startable(&mut creates, &BTreeSet::new()).len(), 1);
}

#[test]
fn a_multicast_job_needs_a_reachable_source() {
    let (mut p, cat) = pool();
    let src = p.copies().find(|c| c.model == 1).unwrap().clone();
    let actions = p.deploy(1, if src.node == 1 { 2 } else { 1 }, 0).unwrap();
    let b = split(actions);
    let ((model, file), group) = b.creates.into_iter().next().unwrap();
    assert!(!file);
    match job(&p, &cat, model, file, &group, |_| true).unwrap() {
        Job::Multicast { sources, targets, .. } => {
            assert_eq!(sources.values().copied().collect::<Vec<_>>(), vec![src.id]);
            assert_eq!(targets.len(), 1);
        }
        other => panic!("{other:?}"),
    }
    let err = job(&p, &cat, model, file, &group, |n| n != src.node).unwrap_err();
    assert!(err.contains("no reachable source"), "{err}");
    assert!(job(&p, &BTreeMap::new(), model, file, &group, |_| true).is_err(), "no catalog entry");
}

#[test]
fn the_retry_budget_is_per_model() {
    let mut r = Retries::default();
    for _ in 0..MAX_FAILURES {
        assert!(r.failed(1));
    }
    assert!(!r.failed(1));
    assert!(r.failed(2));
}

#[test]
fn reconcile_drops_unknown_checks_present_and_reissues_missing() {
    let (mut p, _) = pool();
    let ready = p.copies().find(|c| c.model == 1).unwrap().clone();
    // Model 1 is deployed on two more nodes; one of them holds the copy already.
    let others: Vec<NodeId> = (1..=4).filter(|n| *n != ready.node).take(2).collect();
    p.deploy(1, others[0], 0).unwrap();
    p.deploy(1, others[1], 0).unwrap();
    let loading: Vec<ModelCopy> = p.copies().filter(|c| c.state == CopyState::Loading).cloned().collect();
    assert_eq!(loading.len(), 2);
    let held = BTreeMap::from([
        (ready.node, vec![ready.id, 999]),
        (loading[0].node, vec![loading[0].id]),
        (loading[1].node, vec![]),
    ]);
    let r = reconcile(&p, &held);
    assert_eq!(r.unknown, vec![(ready.node, 999)]);
    assert_eq!(r.check, vec![loading[0].clone()]);
    assert_eq!(r.reissue, vec![loading[1].clone()]);
    let again = reissue(&p, r.reissue);
    assert!(matches!(&again[..], [Action::Create { copy, .. }] if copy.id == loading[1].id));
}

#[test]
fn a_complete_copy_its_node_no_longer_lists_is_missing_but_a_silent_node_proves_nothing() {
    let mut p = Pool::new(1, 1..=2);
    let acts = p.register(1, 10, true).unwrap();
    let Action::Create { copy, .. } = &acts[0] else { panic!("{acts:?}") };
    p.copy_ready(copy.id).unwrap();
    let node = copy.node;
    let held = BTreeMap::from([(node, vec![])]);
    assert_eq!(reconcile(&p, &held).missing.len(), 1);
    // The node did not answer: nothing is concluded about its copies.
    assert!(reconcile(&p, &BTreeMap::new()).missing.is_empty());
}
