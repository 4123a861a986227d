use proptest::prelude::*;

use super::*;

const GIB: u64 = 1 << 30;

fn flat(nodes: u32, gbps: f64) -> Topology {
    let mut t = Topology::new();
    for n in 0..nodes {
        t.add_node(n, 1, gbps).unwrap();
    }
    t
}

fn req(sources: &[Loc], targets: &[Loc]) -> Request {
    Request { bytes: GIB, sources: sources.to_vec(), targets: targets.to_vec() }
}

fn gpus(range: std::ops::Range<u32>) -> Vec<Loc> {
    range.map(|n| Loc::gpu(n, 0)).collect()
}

/// Every target has exactly one incoming edge, edges only reach targets, and following parents
/// from any target ends at a source.
fn check_structure(p: &Plan, r: &Request) {
    let targets: BTreeSet<Loc> = r.targets.iter().copied().collect();
    let sources: BTreeSet<Loc> = r.sources.iter().copied().collect();
    let mut parent = BTreeMap::new();
    for e in &p.edges {
        // Start order: a sender's own incoming edge comes before its outgoing ones.
        assert!(sources.contains(&e.from) || parent.contains_key(&e.from), "{} sends before it receives", e.from);
        assert!(targets.contains(&e.to), "edge into non-target {}", e.to);
        assert!(parent.insert(e.to, e.from).is_none(), "{} has two parents", e.to);
    }
    assert_eq!(parent.len(), targets.len(), "every target is reached");
    for &t in &targets {
        let mut at = t;
        for _ in 0..=targets.len() {
            match parent.get(&at) {
                Some(&p) => at = p,
                None => break,
            }
        }
        assert!(sources.contains(&at), "{t} does not trace back to a source (stuck at {at})");
    }
    assert_eq!(p.predicted.len(), targets.len());
    assert!(p.predicted.iter().all(|(_, s)| s.is_finite() && *s > 0.0));
}

#[test]
fn blitz_time_does_not_grow_with_the_number_of_targets() {
    let t = flat(9, 100.0);
    let bound = GIB as f64 * 8.0 / 100e9;
    for n in 1..=8 {
        let r = req(&[Loc::gpu(0, 0)], &gpus(1..n + 1));
        let p = plan(&t, &r, PlannerKind::Blitz).unwrap();
        check_structure(&p, &r);
        assert_eq!(p.chains().len(), 1);
        assert!(p.makespan() <= bound * 1.10, "N={n}: {} vs bound {bound}", p.makespan());
    }
}

#[test]
fn star_grows_linearly_and_tree_logarithmically() {
    let t = flat(9, 100.0);
    let one = GIB as f64 * 8.0 / 100e9;
    for n in [1u32, 2, 4, 7, 8] {
        let r = req(&[Loc::gpu(0, 0)], &gpus(1..n + 1));
        let star = plan(&t, &r, PlannerKind::Star).unwrap();
        let tree = plan(&t, &r, PlannerKind::Tree).unwrap();
        check_structure(&star, &r);
        check_structure(&tree, &r);
        let rounds = f64::from(n + 1).log2().ceil();
        assert!((star.makespan() / one - f64::from(n)).abs() < 0.01, "star N={n}: {}", star.makespan() / one);
        assert!((tree.makespan() / one - rounds).abs() < 0.01, "tree N={n}: {}", tree.makespan() / one);
    }
}

#[test]
fn plans_are_deterministic_whatever_the_input_order() {
    let mut t = flat(12, 100.0);
    t.set_link(0, 5, Link { kind: LinkKind::Rdma, gbps: 400.0 }).unwrap();
    t.add_flow(Loc::gpu(1, 0), Loc::gpu(11, 0)).unwrap();
    let mut targets = gpus(2..11);
    let a = plan(&t, &req(&[Loc::gpu(0, 0), Loc::gpu(1, 0)], &targets), PlannerKind::Blitz).unwrap();
    targets.reverse();
    let b = plan(&t, &req(&[Loc::gpu(1, 0), Loc::gpu(0, 0)], &targets), PlannerKind::Blitz).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.to_string(), b.to_string());
}

#[test]
fn bad_requests_are_refused() {
    let t = flat(3, 100.0);
    let e = |r: Request| plan(&t, &r, PlannerKind::Blitz).unwrap_err();
    assert_eq!(e(req(&[], &gpus(1..2))), PlanError::NoSource);
    assert_eq!(e(req(&gpus(0..1), &[])), PlanError::NoTarget);
    assert_eq!(e(Request { bytes: 0, ..req(&gpus(0..1), &gpus(1..2)) }), PlanError::Empty);
    assert_eq!(e(req(&gpus(0..1), &gpus(0..2))), PlanError::DuplicateTarget(Loc::gpu(0, 0)));
    assert_eq!(e(req(&gpus(0..1), &[Loc::gpu(1, 0), Loc::gpu(1, 0)])), PlanError::DuplicateTarget(Loc::gpu(1, 0)));
    assert!(matches!(e(req(&gpus(0..1), &[Loc::gpu(7, 0)])), PlanError::Topology(_)));
    assert!(matches!(e(req(&gpus(0..1), &[Loc::gpu(1, 3)])), PlanError::Topology(_)));
    assert!("ring".parse::<PlannerKind>().is_err());
}

#[test]
fn chunk_size_is_a_clamped_power_of_two() {
    let t = flat(9, 100.0);
    for (bytes, n) in [(GIB, 8u32), (64 << 20, 2), (4096, 3), (GIB, 1)] {
        let p = plan(&t, &Request { bytes, sources: gpus(0..1), targets: gpus(1..n + 1) }, PlannerKind::Blitz).unwrap();
        assert!(p.chunk_bytes.is_power_of_two(), "{}", p.chunk_bytes);
        assert!(p.chunk_bytes <= 16 << 20);
        assert!(p.chunk_bytes >= (64 << 10).min(bytes.next_power_of_two()), "{bytes} -> {}", p.chunk_bytes);
    }
    // Above 2^63 bytes the payload has no next power of two: the chunk is still the largest one
    // (it was 1 byte in a release build and a panic in a debug one).
    for bytes in [(1u64 << 63) + 1, u64::MAX] {
        let p = plan(&t, &Request { bytes, sources: gpus(0..1), targets: gpus(1..3) }, PlannerKind::Blitz).unwrap();
        assert_eq!(p.chunk_bytes, 16 << 20, "{bytes}");
    }
    // Longer chains want smaller chunks.
    let long = plan(&t, &req(&gpus(0..1), &gpus(1..9)), PlannerKind::Blitz).unwrap();
    let short = plan(&t, &req(&gpus(0..1), &gpus(1..3)), PlannerKind::Blitz).unwrap();
    assert!(long.chunk_bytes <= short.chunk_bytes);
}

/// Brute force of the greedy step, for checking the indexed version.
#[test]
fn hops_on_one_machine_share_its_cores() {
    // Nine processes of one machine whose cores together move 64 Gbit/s; each link alone could
    // carry 64 Gbit/s too (one hop saturates the machine, as on a 2-core host over shm).
    let mut t = flat(9, 64.0);
    t.add_machine(&(0..9).collect::<Vec<_>>(), 64.0).unwrap();
    let one = GIB as f64 * 8.0 / 64e9;
    for n in [1u32, 2, 4, 8] {
        let p = plan(&t, &req(&gpus(0..1), &gpus(1..n + 1)), PlannerKind::Blitz).unwrap();
        let ratio = p.makespan() / one;
        assert!((ratio / f64::from(n) - 1.0).abs() < 0.05, "N={n}: {ratio} hop-times");
    }
    // Separate machines (or none declared) keep the chain flat.
    let flat_chain = plan(&flat(9, 64.0), &req(&gpus(0..1), &gpus(1..9)), PlannerKind::Blitz).unwrap();
    assert!(flat_chain.makespan() / one < 1.1);
    // A machine that is faster than its links changes nothing until enough hops share it.
    let mut fast = flat(9, 64.0);
    fast.add_machine(&(0..9).collect::<Vec<_>>(), 256.0).unwrap();
    let two = plan(&fast, &req(&gpus(0..1), &gpus(1..3)), PlannerKind::Blitz).unwrap();
    let eight = plan(&fast, &req(&gpus(0..1), &gpus(1..9)), PlannerKind::Blitz).unwrap();
    assert!(two.makespan() / one < 1.1, "{}", two.makespan() / one);
    assert!((eight.makespan() / one - 2.0).abs() < 0.1, "{}", eight.makespan() / one);
}

#[test]
fn machines_are_read_from_toml_and_checked() {
    let text = "[[nodes]]\nid = 0\nnic_gbps = 10\n[[nodes]]\nid = 1\nnic_gbps = 10\n[[machines]]\nnodes = [0, 1]\ncopy_gbps = 40\n";
    let t = Topology::from_toml(text).unwrap();
    assert_eq!(t.machine_of(1).map(|m| m.copy_gbps), Some(40.0));
    assert!(Topology::from_toml(&text.replace("[0, 1]", "[0, 7]")).is_err());
    assert!(Topology::from_toml(&text.replace("copy_gbps = 40", "copy_gbps = 0")).is_err());
    let twice = format!("{text}[[machines]]\nnodes = [1]\ncopy_gbps = 5\n");
    assert!(Topology::from_toml(&twice).unwrap_err().to_string().contains("two machines"));
}

fn brute_best(topo: &Topology, tail: Loc, remaining: &BTreeSet<Loc>) -> Option<(Loc, f64)> {
    remaining
        .iter()
        .filter_map(|&l| topo.link(tail, l).map(|k| (l, k.gbps, nic_key(topo, l))))
        .max_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)).then(b.0.cmp(&a.0)))
        .map(|(l, g, _)| (l, g))
}

prop_compose! {
    fn any_topology()(nics in proptest::collection::vec(prop_oneof![Just(25.0), Just(100.0), Just(200.0)], 2..12),
                      gpus in 1u32..4,
                      links in proptest::collection::vec((0u32..12, 0u32..12, 1u32..500), 0..8),
                      nvlink_nodes in proptest::collection::vec(any::<bool>(), 12)) -> Topology {
        let mut t = Topology::new();
        for (i, g) in nics.iter().enumerate() {
            t.add_node(i as u32, gpus, *g).unwrap();
            if nvlink_nodes[i] && gpus > 1 {
                t.join_nvlink(i as u32, &(0..gpus).collect::<Vec<_>>()).unwrap();
            }
        }
        for (a, b, g) in links {
            let n = nics.len() as u32;
            if a % n != b % n {
                t.set_link(a % n, b % n, Link { kind: LinkKind::Rdma, gbps: f64::from(g) }).unwrap();
            }
        }
        t
    }
}

proptest! {
    #[test]
    fn indexed_greedy_step_matches_brute_force(t in any_topology(), pick in any::<u64>()) {
        let all: Vec<Loc> = t.nodes().flat_map(|n| (0..n.gpus).map(move |g| Loc::gpu(n.id, g)).chain([Loc::host(n.id)])).collect();
        let tail = all[(pick % all.len() as u64) as usize];
        let remaining: BTreeSet<Loc> = all.iter().copied().filter(|l| *l != tail && l.gpu.is_some()).collect();
        let heads: Vec<Loc> = remaining.iter().copied().collect();
        let idx = Remaining::new(&t, &heads);
        prop_assert_eq!(idx.best_from(&t, tail), brute_best(&t, tail, &remaining));
    }

    #[test]
    fn every_planner_reaches_every_target_once(t in any_topology(), planner in 0usize..4, nsrc in 1usize..3, seed in any::<u64>()) {
        let all: Vec<Loc> = t.nodes().flat_map(|n| (0..n.gpus).map(move |g| Loc::gpu(n.id, g))).collect();
        let k = (seed % all.len() as u64) as usize;
        let sources: Vec<Loc> = all.iter().cycle().skip(k).take(nsrc.min(all.len() - 1)).copied().collect();
        let targets: Vec<Loc> = all.iter().copied().filter(|l| !sources.contains(l)).collect();
        prop_assume!(!targets.is_empty());
        let kind = [PlannerKind::Blitz, PlannerKind::Chain, PlannerKind::Star, PlannerKind::Tree][planner];
        let r = Request { bytes: 1 << 26, sources, targets };
        let p = plan(&t, &r, kind).unwrap();
        check_structure(&p, &r);
    }
}
