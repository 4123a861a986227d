//! Planning time of `blitz` for 1,000 targets over 125 nodes (target: ≤ 10 ms).
//!
//! `cargo bench -p cascade-multicast --bench planner`
// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use cascade_multicast::{plan, Link, LinkKind, Loc, PlannerKind, Request, Topology};
use criterion::{criterion_group, criterion_main, Criterion};

/// 125 nodes × 8 GPUs with NICs of three speeds, some explicit links and serving flows; the
/// parameters sit in node 0's host cache and in two GPUs, every GPU is a target.
fn cluster(nvlink: bool) -> (Topology, Request) {
    let mut t = Topology::new();
    for n in 0..125u32 {
        let gbps = [100.0, 200.0, 400.0][(n % 3) as usize];
        t.add_node(n, 8, gbps).expect("node");
        t.set_nics(n, &[vec![0, 1, 2, 3], vec![4, 5, 6, 7]]).expect("nics");
        if nvlink {
            t.join_nvlink(n, &(0..8).collect::<Vec<_>>()).expect("nvlink");
        }
    }
    for n in (0..120u32).step_by(7) {
        t.set_link(n, n + 3, Link { kind: LinkKind::Rdma, gbps: 800.0 }).expect("link");
    }
    for n in (10..100u32).step_by(10) {
        t.add_flow(Loc::gpu(n, 0), Loc::gpu(n + 1, 0)).expect("flow");
    }
    let sources = vec![Loc::host(0), Loc::gpu(10, 0), Loc::gpu(20, 0)];
    let targets = (0..125u32)
        .flat_map(|n| (0..8).map(move |g| Loc::gpu(n, g)))
        .filter(|l| !sources.contains(l))
        .take(1000)
        .collect();
    (t, Request { bytes: 14 << 30, sources, targets })
}

fn bench(c: &mut Criterion) {
    for (name, nvlink) in
        [("blitz_1000_targets_125_nodes_no_nvlink", false), ("blitz_1000_targets_125_nodes_nvlink", true)]
    {
        let (t, r) = cluster(nvlink);
        assert!(r.targets.len() >= 997);
        c.bench_function(name, |b| b.iter(|| plan(black_box(&t), black_box(&r), PlannerKind::Blitz).expect("plan")));
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
