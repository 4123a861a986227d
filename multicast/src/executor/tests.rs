//! Executor tests on the `mem` test double (faults on demand) and on real loopback endpoints.

use std::time::{Duration, Instant};

use cascade_transport::mem::{Fault, MemFabric};

use super::*;
use crate::planner::{plan as make_plan, PlannerKind, Request};
use cascade_transport::test_access as ta;

const MIB: u64 = 1 << 20;

fn flat(n: u32) -> Topology {
    let mut t = Topology::new();
    for i in 0..n {
        t.add_node(i, 1, 100.0).unwrap();
    }
    t
}

/// `n` mem nodes; node 0 holds the source region filled with a pattern.
fn mem_members(f: &MemFabric, n: u32, bytes: u64) -> Vec<Member> {
    (0..n)
        .map(|i| {
            let node = f.add_node(i);
            let region = Region::alloc(bytes, Default::default()).unwrap();
            if i == 0 {
                for c in 0..bytes / 4096 {
                    ta::fill(&region, c * 4096, 4096, (c % 251) as u8 + 1).unwrap();
                }
            }
            node.regions().register(&region);
            Member { loc: Loc::gpu(i, 0), mesh: Arc::new(node), region }
        })
        .collect()
}

fn layers(bytes: u64, n: u64) -> Vec<std::ops::Range<u64>> {
    (0..n).map(|i| i * bytes / n..(i + 1) * bytes / n).collect()
}

fn setup(n: u32, bytes: u64, chunk: u64) -> (MemFabric, Topology, Plan, Layout, Vec<Member>) {
    let f = MemFabric::new();
    let members = mem_members(&f, n, bytes);
    let t = flat(n);
    let targets: Vec<Loc> = (1..n).map(|i| Loc::gpu(i, 0)).collect();
    let p = make_plan(&t, &Request { bytes, sources: vec![Loc::gpu(0, 0)], targets }, PlannerKind::Blitz).unwrap();
    let layout = unsafe_layout(&members[0].region, bytes, chunk, layers(bytes, 4)).unwrap();
    (f, t, p, layout, members)
}

/// The layout of a test's source region (nothing writes it while the crcs are taken).
fn unsafe_layout(
    r: &Region,
    bytes: u64,
    chunk: u64,
    layers: Vec<std::ops::Range<u64>>,
) -> Result<Layout, crate::LayoutError> {
    // SAFETY: the tests fill their source regions before any run starts.
    unsafe { Layout::from_region(r, bytes, chunk, layers) }
}

fn opts() -> ExecOptions {
    ExecOptions {
        op_timeout: Duration::from_secs(2),
        deadline: Duration::from_secs(20),
        watch_every: Duration::from_millis(10),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_delivers_every_byte_and_every_layer() {
    let (_f, t, p, layout, members) = setup(5, 4 * MIB, 256 << 10);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let rep = execute(&t, &p, &layout, members.clone(), Some(tx), opts()).await.unwrap();
    assert_eq!(rep.completed.len(), 4, "{rep:?}");
    assert!(rep.failed.is_empty());
    assert_eq!(rep.resent_chunks, 0);
    let want = ta::crc32(&members[0].region, 0, 4 * MIB).unwrap();
    for m in &members[1..] {
        assert_eq!(ta::crc32(&m.region, 0, 4 * MIB).unwrap(), want, "{}", m.loc);
    }
    let mut ready: BTreeMap<Loc, Vec<usize>> = BTreeMap::new();
    while let Ok(e) = rx.try_recv() {
        if let Event::LayerReady { target, layer } = e {
            ready.entry(target).or_default().push(layer);
        }
    }
    for m in &members[1..] {
        assert_eq!(ready[&m.loc], vec![0, 1, 2, 3], "{}: layers arrive complete, in order", m.loc);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_caught_refetched_and_never_forwarded() {
    let (f, t, p, layout, members) = setup(4, 2 * MIB, 256 << 10);
    // The first chunk written from 0/gpu0 to 1/gpu0 lands corrupted.
    f.set_fault(0, 1, Some(Fault::CorruptNext(1)));
    let rep = execute(&t, &p, &layout, members.clone(), None, opts()).await.unwrap();
    assert_eq!(rep.completed.len(), 3, "{rep:?}");
    // Exactly one re-send: had the bad chunk been forwarded, the next hop would have NACKed too.
    assert_eq!(rep.resent_chunks, 1);
    let want = ta::crc32(&members[0].region, 0, 2 * MIB).unwrap();
    for m in &members[1..] {
        assert_eq!(ta::crc32(&m.region, 0, 2 * MIB).unwrap(), want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_killed_mid_chain_is_routed_around() {
    let (f, t, p, layout, members) = setup(6, 4 * MIB, 128 << 10);
    // Slow every hop so the kill lands mid-transfer.
    for i in 0..5 {
        f.set_fault(i, i + 1, Some(Fault::Delay(Duration::from_millis(5))));
    }
    let chain: Vec<Loc> = p.chains()[0].clone();
    assert_eq!(chain.len(), 6);
    let victim = chain[2];
    let f2 = f.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(60)).await;
        f2.kill(victim.node);
    });
    let started = Instant::now();
    let rep = execute(&t, &p, &layout, members.clone(), None, opts()).await.unwrap();
    assert_eq!(rep.failed.iter().map(|(l, _)| *l).collect::<Vec<_>>(), vec![victim], "{rep:?}");
    assert_eq!(rep.completed.len(), 4);
    assert!(rep.replans >= 1);
    assert!(started.elapsed() < Duration::from_secs(10), "no hang: {:?}", started.elapsed());
    let want = ta::crc32(&members[0].region, 0, 4 * MIB).unwrap();
    for m in members.iter().filter(|m| m.loc != victim && m.loc != Loc::gpu(0, 0)) {
        assert_eq!(ta::crc32(&m.region, 0, 4 * MIB).unwrap(), want, "{}", m.loc);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_only_source_fails_every_target_promptly() {
    let (f, t, p, layout, members) = setup(3, MIB, 256 << 10);
    f.kill(0);
    let started = Instant::now();
    let rep = execute(&t, &p, &layout, members, None, opts()).await.unwrap();
    assert!(rep.completed.is_empty());
    assert_eq!(rep.failed.len(), 2, "{rep:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_members_and_small_regions_are_refused() {
    let (_f, t, p, layout, members) = setup(3, MIB, 256 << 10);
    let r = execute(&t, &p, &layout, members[..2].to_vec(), None, opts()).await;
    assert!(matches!(r, Err(ExecError::MissingMember(_))));
    let mut small = members.clone();
    small[2].region = Region::alloc(4096, Default::default()).unwrap();
    assert!(matches!(execute(&t, &p, &layout, small, None, opts()).await, Err(ExecError::RegionTooSmall { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_over_real_tcp_endpoints() {
    let bytes = 8 * MIB;
    let mut members = Vec::new();
    for (i, ep) in crate::test_util::loopback_endpoints(3, "mc").await.into_iter().enumerate() {
        let region = ep.register_new(bytes).unwrap();
        if i == 0 {
            ta::fill(&region, 0, bytes, 0x77).unwrap();
            ta::fill(&region, MIB, MIB, 0x11).unwrap();
        }
        members.push(Member { loc: Loc::gpu(i as u32, 0), mesh: ep, region });
    }
    let t = flat(3);
    let p = make_plan(
        &t,
        &Request { bytes, sources: vec![Loc::gpu(0, 0)], targets: vec![Loc::gpu(1, 0), Loc::gpu(2, 0)] },
        PlannerKind::Blitz,
    )
    .unwrap();
    let layout = unsafe_layout(&members[0].region, bytes, MIB, vec![]).unwrap();
    let rep = execute(&t, &p, &layout, members.clone(), None, opts()).await.unwrap();
    assert_eq!(rep.completed.len(), 2, "{rep:?}");
    let want = ta::crc32(&members[0].region, 0, bytes).unwrap();
    assert!(members[1..].iter().all(|m| ta::crc32(&m.region, 0, bytes).unwrap() == want));
}

#[test]
fn notices_round_trip_and_reject_junk() {
    use cascade_transport::Message;

    use super::notice::{Kind, Notice};
    let n = Notice { run: 9, kind: Kind::Nack, index: 77, from: Loc::host(3), to: Loc::gpu(4, 1), crc: Some(7) };
    assert_eq!(Notice::decode_body(2, &n.encode_body()).unwrap(), n);
    // Golden bytes: run 9, Nack (1), index 77, (3, None), (4, Some(1)), Some(7) in postcard varints.
    assert_eq!(n.encode_body(), vec![9, 1, 77, 3, 0, 4, 1, 1, 1, 7]);
    assert!(Notice::decode_body(2, &[9, 7, 77, 3, 0, 4, 1, 1, 0]).is_err(), "unknown kind");
    assert!(Notice::decode_body(2, &n.encode_body()[..9]).is_err(), "truncated");
}

#[test]
fn layouts_must_tile_the_bytes() {
    assert!(Layout::new(100, 10, vec![0; 10], vec![0..50, 50..100]).is_ok());
    assert_eq!(Layout::new(100, 10, vec![0; 10], vec![0..50, 60..100]), Err(crate::LayoutError::Gap(1)));
    assert_eq!(Layout::new(100, 10, vec![0; 9], vec![]), Err(crate::LayoutError::Checksums { want: 10, got: 9 }));
    assert_eq!(Layout::new(100, 0, vec![], vec![]), Err(crate::LayoutError::Empty));
    let l = Layout::new(100, 30, vec![0; 4], vec![0..45, 45..100]).unwrap();
    assert_eq!(l.chunk_range(3), 90..100);
    assert_eq!(l.chunks_of_layer(0), 0..2);
    assert_eq!(l.chunks_of_layer(1), 1..4);
}

/// A re-planned target is sent only what it lacks: its new sender starts at the first layer the
/// target had not reported ready. Before, it re-sent every chunk from 0, rewriting verified layers
/// that an instance serving layer by layer may be reading. To see a re-send, every holder's copy
/// of layer 0 is spoiled once the target holds layers 0 and 1: a re-sent layer 0 would land over
/// the target's verified one (the member ignores chunks it holds, but the WRITE has placed them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replanned_target_is_sent_only_the_layers_it_lacks() {
    let bytes = 4 * MIB; // 4 layers of 1 MiB, 8 chunks each
    let (f, t, p, layout, members) = setup(4, bytes, 128 << 10);
    let chain: Vec<Loc> = p.chains()[0].clone();
    let (victim, last) = (chain[2], chain[3]);
    // Slow the last hop, so its target is mid-way when its sender dies.
    f.set_fault(victim.node, last.node, Some(Fault::Delay(Duration::from_millis(20))));
    let want = ta::crc32(&members[0].region, 0, bytes).unwrap();
    let regions: BTreeMap<Loc, Region> = members.iter().map(|m| (m.loc, m.region.clone())).collect();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let run = tokio::spawn(async move { execute(&t, &p, &layout, members, Some(tx), opts()).await });
    let mut from = None;
    while let Some(e) = rx.recv().await {
        match e {
            Event::LayerReady { target, layer: 1 } if target == last => {
                for holder in [chain[0], chain[1]] {
                    ta::fill(&regions[&holder], 0, MIB, 0xee).unwrap();
                }
                f.kill(victim.node);
            }
            Event::Replanned { target, from: np } if target == last => from = Some(np),
            _ => {}
        }
    }
    let rep = run.await.unwrap().unwrap();
    assert!(rep.completed.contains(&last), "{rep:?}");
    assert!(from.is_some(), "the last target was re-planned: {rep:?}");
    assert_eq!(ta::crc32(&regions[&last], 0, bytes).unwrap(), want, "its verified layers were written over");
}
