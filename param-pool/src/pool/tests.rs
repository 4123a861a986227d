use proptest::prelude::*;

use super::*;

/// Marks every copy the actions create as ready (the daemons' job), returning further actions.
fn settle(p: &mut Pool, mut actions: Vec<Action>) -> Vec<Action> {
    let mut all = Vec::new();
    while let Some(a) = actions.pop() {
        if let Action::Create { copy, .. } = &a {
            if p.copies().any(|c| c.id == copy.id) {
                actions.extend(p.copy_ready(copy.id).unwrap());
            }
        }
        all.push(a);
    }
    all
}

fn creates(a: &[Action]) -> Vec<&ModelCopy> {
    a.iter().filter_map(|x| if let Action::Create { copy, .. } = x { Some(copy) } else { None }).collect()
}

#[test]
fn register_places_k_copies_on_distinct_nodes() {
    let mut p = Pool::new(2, 0..4);
    let a = p.register(7, 100, true).unwrap();
    let c = creates(&a);
    assert_eq!(c.len(), 2);
    assert_ne!(c[0].node, c[1].node);
    assert!(
        a.iter().all(|x| matches!(x, Action::Create { from: Source::File, .. })),
        "first copies come from the file"
    );
    assert_eq!(p.check().len(), 1, "not ready yet");
    settle(&mut p, a);
    assert!(p.check().is_empty());
    assert_eq!(p.register(7, 1, true), Err(PoolError::Duplicate(7)));
    assert_eq!(Pool::new(3, 0..2).register(1, 1, true), Err(PoolError::TooFewNodes { have: 2, k: 3 }));
}

#[test]
fn reclaim_that_would_break_the_invariant_copies_first() {
    let mut p = Pool::new(1, 0..3);
    let a = p.register(1, 100, true).unwrap();
    settle(&mut p, a);
    let only = p.copies().next().unwrap().id;
    let a = p.reclaim(only).unwrap();
    let c = creates(&a);
    assert_eq!(c.len(), 1, "a replacement first");
    assert!(!a.iter().any(|x| matches!(x, Action::Drop { .. })), "not dropped before the replacement is ready");
    assert_eq!(
        a.iter().find_map(|x| if let Action::Create { from, .. } = x { Some(from.clone()) } else { None }),
        Some(Source::Copies(vec![only]))
    );
    let new = c[0].id;
    assert_eq!(p.copy_ready(new).unwrap(), vec![Action::Drop { copy: only }]);
    assert!(p.check().is_empty());
}

#[test]
fn reclaim_of_a_spare_copy_drops_it_at_once() {
    let mut p = Pool::new(1, 0..3);
    let a = p.register(1, 100, true).unwrap();
    settle(&mut p, a);
    let a = p.deploy(1, 2, 0).unwrap();
    let gpu = creates(&a)[0].id;
    p.copy_ready(gpu).unwrap();
    assert_eq!(p.reclaim(gpu).unwrap(), vec![Action::Drop { copy: gpu }]);
}

#[test]
fn node_down_repairs_from_survivors_then_file_then_reports_lost() {
    let mut p = Pool::new(1, 0..3);
    let a = p.register(1, 100, true).unwrap();
    settle(&mut p, a);
    let a = p.register(2, 100, false).unwrap(); // file unreachable later
    settle(&mut p, a);
    let a = p.deploy(1, 2, 0).unwrap();
    settle(&mut p, a);
    let n1 = p.copies().find(|c| c.model == 1 && c.kind == CopyKind::HostCache).unwrap().node;
    // Model 1 keeps its GPU copy on node 2: nothing to do for it.
    let a = p.node_down(n1);
    assert!(creates(&a).iter().all(|c| c.model != 1) || n1 == 2);
    settle(&mut p, a);
    assert!(p.check().is_empty(), "{:?}", p.check());
    // Kill every node holding model 2: its file is unreachable, so it is lost.
    let holders: Vec<NodeId> = p.copies().filter(|c| c.model == 2).map(|c| c.node).collect();
    let mut lost = false;
    for n in holders {
        lost |= p.node_down(n).iter().any(|x| matches!(x, Action::Lost { model: 2, .. }));
    }
    assert!(lost || p.live_nodes().count() == 0);
    // A model whose file is reachable comes back from the file.
    let mut q = Pool::new(1, 0..2);
    let a = q.register(3, 10, true).unwrap();
    settle(&mut q, a);
    let n = q.copies().next().unwrap().node;
    let a = q.node_down(n);
    assert!(matches!(a.as_slice(), [Action::Create { from: Source::File, .. }]), "{a:?}");
}

#[test]
fn bytes_per_node_stay_within_ten_percent_of_the_mean() {
    let mut p = Pool::new(2, 0..6);
    for m in 0..60u32 {
        let bytes = 1_000_000_000 + u64::from(m * 7919 % 200) * 1_000_000; // 1.0–1.2 GB
        let a = p.register(m, bytes, true).unwrap();
        settle(&mut p, a);
    }
    let loads = p.bytes_per_node();
    let mean = loads.values().sum::<u64>() as f64 / loads.len() as f64;
    for (n, b) in &loads {
        assert!((*b as f64 - mean).abs() <= 0.10 * mean, "node {n}: {b} vs mean {mean}");
    }
}

#[derive(Debug, Clone)]
enum Op {
    Register(u32, u64, bool),
    Deploy(u32, u32),
    Reclaim(usize),
    Fail(usize),
    Down(u32),
    Up(u32),
    Drain(u32),
    Undrain(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..8, 1u64..1000, any::<bool>()).prop_map(|(m, b, f)| Op::Register(m, b, f)),
        (0u32..8, 0u32..6).prop_map(|(m, n)| Op::Deploy(m, n)),
        any::<usize>().prop_map(Op::Reclaim),
        any::<usize>().prop_map(Op::Fail),
        (0u32..6).prop_map(Op::Down),
        (0u32..6).prop_map(Op::Up),
        (0u32..6).prop_map(Op::Drain),
        (0u32..6).prop_map(Op::Undrain),
    ]
}

proptest! {
    /// With k ≥ 2, at most one node lost between settles and enough undrained nodes alive, the
    /// invariant is restored after every settle, no model is ever lost, and a drained node holds
    /// nothing once its replacements are ready.
    #[test]
    fn invariant_survives_random_operations_and_failures(k in 2usize..4, ops in proptest::collection::vec(op(), 1..60)) {
        let mut p = Pool::new(k, 0..6);
        for o in ops {
            let live = p.live_nodes().filter(|n| !p.is_draining(*n)).count();
            let actions = match o {
                Op::Register(m, b, f) => p.register(m, b, f).unwrap_or_default(),
                Op::Deploy(m, n) => p.deploy(m, n, 0).unwrap_or_default(),
                Op::Reclaim(i) => {
                    let ids: Vec<CopyId> = p.copies().map(|c| c.id).collect();
                    if ids.is_empty() { vec![] } else {
                        // Refused only when no other live node could take the copy's place.
                        p.reclaim(ids[i % ids.len()]).unwrap_or_else(|e| {
                            assert!(matches!(e, PoolError::TooFewNodes { .. }), "{e}");
                            vec![]
                        })
                    }
                }
                Op::Fail(i) => {
                    // A copy being filled fails (a completed one cannot).
                    let ids: Vec<CopyId> = p.copies().filter(|c| c.state == CopyState::Loading).map(|c| c.id).collect();
                    if ids.is_empty() { vec![] } else { p.copy_failed(ids[i % ids.len()]).unwrap() }
                }
                Op::Down(n) if live > k => p.node_down(n),
                Op::Down(_) => vec![],
                Op::Up(n) => p.node_up(n),
                // Refused only when the other nodes could not hold k copies of what it holds.
                Op::Drain(n) => p.drain(n).unwrap_or_else(|e| {
                    assert!(matches!(e, PoolError::TooFewNodes { .. } | PoolError::NoSuchNode(_)), "{e}");
                    vec![]
                }),
                Op::Undrain(n) => p.undrain(n).unwrap_or_default(),
            };
            prop_assert!(!actions.iter().any(|a| matches!(a, Action::Lost { .. })), "{actions:?}");
            // Pending copies complete (the daemons), then the invariant must hold.
            let pending: Vec<CopyId> = p.copies().filter(|c| c.state == CopyState::Loading).map(|c| c.id).collect();
            let mut more = actions;
            for id in pending {
                more.extend(p.copy_ready(id).unwrap());
            }
            settle(&mut p, more);
            prop_assert!(p.check().is_empty(), "{:?}", p.check());
            for c in p.copies() {
                prop_assert!(p.live_nodes().any(|n| n == c.node));
                prop_assert!(!p.is_draining(c.node), "copy {c:?} still on a drained node");
            }
        }
    }
}

#[test]
fn reclaim_with_no_other_node_to_take_the_place_is_refused_and_changes_nothing() {
    let mut p = Pool::new(2, 0..2);
    let acts = p.register(1, 100, true).unwrap();
    settle(&mut p, acts);
    let ids: Vec<CopyId> = p.copies().map(|c| c.id).collect();
    for &id in &ids {
        let copy = p.copies().find(|c| c.id == id).unwrap().clone();
        p.copy_ready(id).unwrap();
        let before = p.clone();
        assert_eq!(p.reclaim(id), Err(PoolError::TooFewNodes { have: 1, k: 2 }), "{copy:?}");
        assert_eq!(p, before, "a refused reclaim leaves the pool as it was");
    }
    assert!(p.check().is_empty(), "{:?}", p.check());
}

#[test]
fn copies_go_only_where_they_fit_and_a_register_without_room_is_refused() {
    let mut p = Pool::new(2, 0..3);
    p.set_capacity(0, Some(100));
    p.set_capacity(1, Some(1000));
    // Node 0 cannot take a 500-byte model: its copies go to 1 and 2.
    let acts = p.register(1, 500, true).unwrap();
    let nodes: BTreeSet<NodeId> = p.copies().map(|c| c.node).collect();
    assert_eq!(nodes, BTreeSet::from([1, 2]));
    settle(&mut p, acts);
    // Node 1 has 500 left: a 600-byte model fits only on node 2, so k = 2 is refused up front.
    let before = p.clone();
    assert_eq!(p.register(2, 600, true), Err(PoolError::NoRoom { bytes: 600, have: 1, k: 2 }));
    assert_eq!(p, before, "a refused register changes nothing");
    assert!(matches!(p.deploy(1, 0, 0), Err(PoolError::NoRoom { .. })), "no instance where it does not fit");
    // Node 2 dies: the repair has nowhere to go (node 0 is too small, node 1 holds one already),
    // so the model stays below k and check says so, instead of overfilling node 0.
    let acts = p.node_down(2);
    assert!(acts.iter().all(|a| !matches!(a, Action::Create { .. })), "{acts:?}");
    assert!(!p.check().is_empty());
}

#[test]
fn a_scale_out_deploys_on_every_node_or_on_none() {
    let mut p = Pool::new(2, 0..5);
    let a = p.register(1, 100, true).unwrap();
    settle(&mut p, a);
    let a = p.node_down(4);
    settle(&mut p, a);
    let before = p.copies().count();
    assert_eq!(p.deploy_all(1, &[2, 3, 4], 0), Err(PoolError::NoSuchNode(4)));
    // A node the pool never had is named as such, with the pool's nodes.
    let e = p.deploy_all(1, &[2, 9], 0).unwrap_err();
    assert_eq!(e, PoolError::NotInPool { node: 9, nodes: vec![0, 1, 2, 3, 4] });
    assert_eq!(e.to_string(), "node 9 is not one of the pool's nodes (0, 1, 2, 3, 4)");
    assert_eq!(p.copies().count(), before, "a refused scale-out left no copy behind");
    let a = p.deploy_all(1, &[2, 3], 0).unwrap();
    let made: Vec<(NodeId, CopyKind)> = creates(&a).iter().map(|c| (c.node, c.kind)).collect();
    assert_eq!(made, vec![(2, CopyKind::Gpu(0)), (3, CopyKind::Gpu(0))]);
    assert_eq!(p.copies().count(), before + 2);
}
