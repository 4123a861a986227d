//! What metering a link costs: one WRITE posted and awaited, on the bare link and through
//! [`Metered`] (what every endpoint hands out), on the in-process `mem` test double — the
//! cheapest link there is, so the wrapper's share of an operation is at its largest here.
//!
//! `cargo bench -p cascade-transport --bench metered`
// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;

use cascade_transport::mem::MemFabric;
use cascade_transport::metrics::Metered;
use cascade_transport::{Link, Metrics, Op, Region};
use criterion::{criterion_group, criterion_main, Criterion};

fn metered(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let _in_runtime = rt.enter();
    let fabric = MemFabric::new();
    let a = fabric.add_node(1);
    let b = fabric.add_node(2);
    let src = Region::alloc(4096, Default::default()).expect("source");
    let dst = Region::alloc(4096, Default::default()).expect("destination");
    b.regions().register(&dst);
    let bare = a.link(2).expect("link");
    let wrapped: Arc<dyn Link> = Arc::new(Metered::new(bare.clone(), &Arc::new(Metrics::new())));
    for size in [64u64, 4096] {
        for (name, link) in [("bare", &bare), ("metered", &wrapped)] {
            c.bench_function(&format!("mem WRITE {size} B, {name}"), |bench| {
                bench.iter(|| {
                    rt.block_on(async {
                        for h in link.post(vec![Op::write(&src, 0, dst.remote(2), 0, size)]) {
                            h.await.expect("write");
                        }
                    })
                })
            });
        }
    }
}

criterion_group!(benches, metered);
criterion_main!(benches);
