//! Controller and node daemons over real loopback endpoints, in one process.

use super::*;

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
