//! Controller and node daemons over real loopback endpoints, in one process.

use std::sync::Arc;
use std::time::Duration;

use cascade_transport::{Endpoint, Region};

use super::*;
use crate::{Event, PlannerKind, Topology};

async fn cluster(n: u32, tag: &str) -> Vec<Arc<Endpoint>> {
    let eps = crate::test_util::loopback_endpoints(n, tag).await;
    for e in &eps[1..] {
        tokio::spawn(serve_node(e.clone(), Duration::from_secs(10)));
    }
    eps
}

fn topo(n: u32) -> Topology {
    let mut t = Topology::new();
    for i in 0..n {
        t.add_node(i, 1, 100.0).unwrap();
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_runs_a_multicast_on_node_daemons_and_verifies_every_byte() {
    let eps = cluster(5, "ctl").await;
    let ctl = Controller::new(eps[0].clone());
    for planner in [PlannerKind::Blitz, PlannerKind::Star, PlannerKind::Tree] {
        let spec = RunSpec {
            topology: topo(5),
            bytes: 6 << 20,
            sources: vec![Loc::gpu(1, 0)],
            targets: vec![Loc::gpu(2, 0), Loc::gpu(3, 0), Loc::gpu(4, 0)],
            planner,
            layers: vec![0..(2 << 20), (2 << 20)..(6 << 20)],
            seed: 42,
            deadline: Duration::from_secs(30),
            source_copies: Default::default(),
            keep: Default::default(),
            layout: None,
            progress: None,
        };
        let out = ctl.run(&spec).await.unwrap();
        assert_eq!(out.report.completed.len(), 3, "{planner}: {:?}", out.report);
        assert_eq!(out.verified.len(), 3, "{planner}: every target's crc32 matches the source");
        assert!(out.mismatched.is_empty());
        let layers = out.events.iter().filter(|(_, e)| matches!(e, Event::LayerReady { .. })).count();
        assert_eq!(layers, 6, "{planner}: 2 layers at each of 3 targets");
        // Regions are released after the run.
        assert!(eps[2].regions().is_empty(), "{planner}: the run's regions are released");
    }
}

#[test]
fn control_messages_round_trip() {
    let m = Control::Prepared { run: 7, loc: Loc::gpu(3, 1), region: 9, key: 11, crcs: Some(vec![1, 2]) };
    assert_eq!(Control::decode(&m.encode()), Some(m));
    assert_eq!(Control::decode(b"CSCT{not json"), None);
    assert_eq!(Control::decode(b"other"), None);
}

#[test]
fn synthetic_models_are_deterministic_and_differ_by_seed() {
    let a = Region::alloc(1 << 16, Default::default()).unwrap();
    let b = Region::alloc(1 << 16, Default::default()).unwrap();
    fill_synthetic(&a, 1 << 16, 5).unwrap();
    fill_synthetic(&b, 1 << 16, 5).unwrap();
    assert_eq!(a.crc32(0, 1 << 16).unwrap(), b.crc32(0, 1 << 16).unwrap());
    fill_synthetic(&b, 1 << 16, 6).unwrap();
    assert_ne!(a.crc32(0, 1 << 16).unwrap(), b.crc32(0, 1 << 16).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_copies_serve_as_sources_and_verified_targets_are_kept() {
    let eps = crate::test_util::loopback_endpoints(4, "held").await;
    let held: Vec<Arc<HeldCopies>> = (0..4).map(|_| Arc::default()).collect();
    for (e, h) in eps[1..].iter().zip(&held[1..]) {
        tokio::spawn(serve_node_with(e.clone(), Duration::from_secs(10), h.clone(), None));
    }
    // Node 1 holds copy 7: a region filled with the synthetic model of seed 9.
    let bytes = 3 << 20;
    let r = eps[1].register_new(bytes).unwrap();
    fill_synthetic(&r, bytes, 9).unwrap();
    held[1].insert(7, r.clone());
    let layout =
        Layout::new(bytes, 1 << 20, (0..3).map(|i| r.crc32(i << 20, 1 << 20).unwrap()).collect(), vec![]).unwrap();
    let ctl = Controller::new(eps[0].clone());
    let mut spec = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 1);
    spec.source_copies.insert(Loc::host(1), 7);
    spec.keep.insert(Loc::host(2), 8);
    spec.keep.insert(Loc::host(3), 9);
    spec.layout = Some(layout.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    spec.progress = Some(tx);
    let out = ctl.run(&spec).await.unwrap();
    assert_eq!(out.verified.len(), 2);
    assert_eq!(out.kept.len(), 2);
    let mut seen = 0;
    while rx.try_recv().is_ok() {
        seen += 1;
    }
    assert_eq!(seen, out.events.len(), "every event also went to the progress channel");
    // The kept regions are the source's bytes; the lent source is still registered.
    for (n, id) in [(2, 8), (3, 9)] {
        let k = held[n].get(id).unwrap();
        assert_eq!(k.crc32(0, bytes).unwrap(), r.crc32(0, bytes).unwrap());
        assert_eq!(eps[n].regions().len(), 1, "only the kept copy stays registered on node {n}");
    }
    assert_eq!(eps[1].regions().len(), 1, "the source copy is still registered after the run");
    // A source whose bytes differ from the layout fails the run and leaves nothing behind.
    fill_synthetic(&r, 1 << 20, 10).unwrap();
    let mut bad = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    bad.source_copies.insert(Loc::host(1), 7);
    bad.layout = Some(layout);
    let err = ctl.run(&bad).await.unwrap_err().to_string();
    assert!(err.contains("does not hold the bytes"), "{err}");
    assert_eq!(eps[2].regions().len(), 1, "the failed run's target region was released");
    // A copy the node does not hold is a clear error.
    let mut missing = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    missing.source_copies.insert(Loc::host(1), 99);
    let err = ctl.run(&missing).await.unwrap_err().to_string();
    assert!(err.contains("holds no copy 99"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_drops_the_runs_of_a_controller_that_went_down() {
    let eps = cluster(3, "orphan").await;
    // Prepare a target on node 2 by hand, then the controller disappears.
    let m = Control::Prepare { run: 77, loc: Loc::host(2), bytes: 1 << 20, chunk: 1 << 20, fill: None, copy: None };
    eps[0].send(2, m.encode()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while eps[2].regions().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the region was never prepared");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eps[0].shutdown();
    while !eps[2].regions().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the orphaned run's region was not dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
