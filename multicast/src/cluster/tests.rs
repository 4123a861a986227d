//! Controller and node services over real loopback endpoints, in one process.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use cascade_transport::{test_access as ta, Endpoint, Message, Region, ServiceExt};

use super::*;
use crate::{Event, Layout, Loc, PlannerKind, Topology};

/// Endpoints 0..n on loopback; nodes 1.. run the multicast service.
async fn cluster(n: u32, tag: &str) -> (Vec<Arc<Endpoint>>, Vec<Arc<MulticastNode>>) {
    let eps = crate::test_util::loopback_endpoints(n, tag).await;
    let mut nodes = Vec::new();
    for e in &eps[1..] {
        nodes.push(MulticastNode::start(e.clone(), Duration::from_secs(10)).unwrap());
    }
    (eps, nodes)
}

fn topo(n: u32) -> Topology {
    let mut t = Topology::new();
    for i in 0..n {
        t.add_node(i, 1, 100.0).unwrap();
    }
    t
}

fn fill(r: &Region, bytes: u64, seed: u64) {
    // SAFETY: the tests fill a region before any run that reads it.
    unsafe { fill_synthetic(r, bytes, seed) }.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_runs_a_multicast_on_node_services_and_verifies_every_byte() {
    let (eps, _nodes) = cluster(5, "ctl").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    for planner in [PlannerKind::Blitz, PlannerKind::Star, PlannerKind::Tree] {
        let mut spec = RunSpec::synthetic(
            topo(5),
            6 << 20,
            vec![Loc::gpu(1, 0)],
            vec![Loc::gpu(2, 0), Loc::gpu(3, 0), Loc::gpu(4, 0)],
            42,
        );
        spec.planner = planner;
        spec.layers = vec![0..(2 << 20), (2 << 20)..(6 << 20)];
        spec.deadline = Duration::from_secs(30);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_overlap_on_one_controller() {
    let (eps, _nodes) = cluster(5, "overlap").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let a = RunSpec::synthetic(topo(5), 4 << 20, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 1);
    let b = RunSpec::synthetic(topo(5), 3 << 20, vec![Loc::host(4)], vec![Loc::host(2), Loc::host(3)], 2);
    let (x, y) = tokio::join!(ctl.run(&a), ctl.run(&b));
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!((x.verified.len(), y.verified.len()), (2, 2));
    assert_ne!(x.run, y.run);
}

/// Golden bytes of the multicast control service (`testdata/control.txt`): changing one is a
/// protocol change and needs a new version.
#[test]
fn control_messages_match_their_golden_bytes() {
    let text = include_str!("../../testdata/wire/control.txt");
    let golden: std::collections::HashMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_once(char::is_whitespace).map(|(a, b)| (a, b.trim())).unwrap())
        .collect();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let cases = [
        (
            "prepare_target",
            Control::Prepare { run: 7, loc: Loc::gpu(3, 1), bytes: 1 << 20, chunk: 1 << 16, fill: Fill::Target },
        ),
        ("prepare_lent", Control::Prepare { run: 7, loc: Loc::host(2), bytes: 300, chunk: 100, fill: Fill::Lent }),
        (
            "prepare_lent_beside",
            Control::Prepare { run: 7, loc: Loc::host(2), bytes: 300, chunk: 100, fill: Fill::LentCheckBeside },
        ),
        ("prepared", Control::Prepared { region: 9, key: 11, crcs: Some(vec![1, 2]) }),
        ("verify", Control::Verify { run: 7, loc: Loc::host(2) }),
        ("verified", Control::Verified { crc: 0xdeadbeef }),
        ("release", Control::Release { run: 300 }),
        ("ack", Control::Ack),
        ("failed", Control::Failed { message: "no".into() }),
    ];
    for (name, m) in cases {
        assert_eq!(hex(&m.encode_body()), golden[name], "{name}");
        assert_eq!(Control::decode_body(2, &m.encode_body()).unwrap(), m, "{name}");
    }
    assert!(Control::decode_body(1, b"{not binary").is_err());
    let r = Report { run: 5, msg: crate::executor::ToCoord::LayerReady { loc: Loc::host(1), layer: 2 } };
    assert_eq!(hex(&r.encode_body()), golden["report_layer_ready"]);
    let r = Report { run: 5, msg: crate::executor::ToCoord::SourceChecked { loc: Loc::host(1), crcs: vec![1, 300] } };
    assert_eq!(hex(&r.encode_body()), golden["report_source_checked"]);
    assert_eq!(Report::decode_body(2, &r.encode_body()).unwrap(), r);
}

#[test]
fn synthetic_models_are_deterministic_and_differ_by_seed() {
    let a = Region::alloc(1 << 16, Default::default()).unwrap();
    let b = Region::alloc(1 << 16, Default::default()).unwrap();
    fill(&a, 1 << 16, 5);
    fill(&b, 1 << 16, 5);
    assert_eq!(ta::crc32(&a, 0, 1 << 16).unwrap(), ta::crc32(&b, 0, 1 << 16).unwrap());
    fill(&b, 1 << 16, 6);
    assert_ne!(ta::crc32(&a, 0, 1 << 16).unwrap(), ta::crc32(&b, 0, 1 << 16).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lent_sources_serve_and_verified_targets_are_detached() {
    let (eps, nodes) = cluster(4, "held").await;
    // Node 1 holds a region filled with the synthetic model of seed 9 and lends it to run 500.
    let bytes = 3 << 20;
    let r = eps[1].register_new(bytes).unwrap();
    fill(&r, bytes, 9);
    let crcs = (0..3).map(|i| ta::crc32(&r, i << 20, 1 << 20).unwrap()).collect();
    let layout = Layout::new(bytes, 1 << 20, crcs, vec![]).unwrap();
    let run = 500;
    nodes[0].lend(run, Loc::host(1), r.clone(), 0).unwrap();
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let mut spec = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 1);
    spec.lent = BTreeSet::from([Loc::host(1)]);
    spec.run = Some(run);
    spec.hold = true;
    spec.layout = Some(layout.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    spec.progress = Some(tx);
    let out = ctl.run(&spec).await.unwrap();
    assert_eq!(out.verified.len(), 2);
    let mut seen = 0;
    while rx.try_recv().is_ok() {
        seen += 1;
    }
    assert_eq!(seen, out.events.len(), "every event also went to the progress channel");
    // The node services take the verified targets out; releasing the run leaves them alone.
    let kept: Vec<Region> =
        [(1, 2), (2, 3)].iter().map(|(i, n)| nodes[*i].detach(run, Loc::host(*n)).unwrap()).collect();
    ctl.release(run, &[Loc::host(1), Loc::host(2), Loc::host(3)]).await;
    for (k, n) in kept.iter().zip([2, 3]) {
        assert_eq!(ta::crc32(k, 0, bytes).unwrap(), ta::crc32(&r, 0, bytes).unwrap());
        assert_eq!(eps[n].regions().len(), 1, "only the detached region stays registered on node {n}");
    }
    assert_eq!(eps[1].regions().len(), 1, "the lent source is still registered after the run");
    assert!(nodes[0].detach(run, Loc::host(1)).is_err(), "a released run has nothing to detach");
    // A source whose bytes differ from the layout fails the run and leaves nothing behind.
    fill(&r, 1 << 20, 10);
    nodes[0].lend(501, Loc::host(1), r.clone(), 0).unwrap();
    let mut bad = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    bad.lent = BTreeSet::from([Loc::host(1)]);
    bad.run = Some(501);
    bad.layout = Some(layout);
    let err = ctl.run(&bad).await.unwrap_err();
    assert!(matches!(err, ControlError::SourceMismatch(_)), "{err}");
    assert_eq!(eps[2].regions().len(), 1, "the failed run's target region was released");
    assert_eq!(eps[1].regions().len(), 1, "the lent region is not released with the run");
    // A source that was never lent is a clear error from that node alone.
    let mut missing = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    missing.lent = BTreeSet::from([Loc::host(1)]);
    let err = ctl.run(&missing).await.unwrap_err();
    assert!(matches!(err, ControlError::Node { node: 1, .. }), "{err}");
    assert!(err.to_string().contains("no region was lent"), "{err}");
}

/// A run that starts at once checks its lent sources beside the transfer: the node answers
/// `Prepare` before its crc pass and reports the pass to the controller; a corrupt source still
/// fails the run, and no target keeps any of its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_source_checked_beside_the_transfer_still_fails_a_run_when_corrupt() {
    let (eps, nodes) = cluster(4, "beside").await;
    let bytes = 3 << 20;
    let r = eps[1].register_new(bytes).unwrap();
    fill(&r, bytes, 9);
    let crcs: Vec<u32> = (0..3).map(|i| ta::crc32(&r, i << 20, 1 << 20).unwrap()).collect();
    let layout = Layout::new(bytes, 1 << 20, crcs.clone(), vec![]).unwrap();
    // The protocol: Prepared carries no crcs; the pass runs once the source starts and its
    // report goes to the controller.
    let mut reports = eps[0].subscribe::<Report>(cascade_transport::service::DEFAULT_INBOX).unwrap();
    nodes[0].lend(600, Loc::host(1), r.clone(), 0).unwrap();
    let m = Control::Prepare { run: 600, loc: Loc::host(1), bytes, chunk: 1 << 20, fill: Fill::LentCheckBeside };
    let got = eps[0].call(1, &m, Duration::from_secs(5)).await.unwrap();
    assert!(matches!(got, Control::Prepared { crcs: None, .. }), "{got:?}");
    let quiet = tokio::time::timeout(Duration::from_millis(200), reports.recv()).await;
    assert!(quiet.is_err(), "the pass waits for the source's Start: {quiet:?}");
    let start = Control::Start {
        run: 600,
        loc: Loc::host(1),
        layout: layout.clone(),
        source: true,
        children: vec![],
        ready_first: false,
    };
    assert_eq!(eps[0].call(1, &start, Duration::from_secs(5)).await.unwrap(), Control::Ack);
    let rep = tokio::time::timeout(Duration::from_secs(5), reports.recv()).await.unwrap().unwrap();
    assert_eq!(rep.msg.run, 600);
    assert_eq!(rep.msg.msg, crate::executor::ToCoord::SourceChecked { loc: Loc::host(1), crcs });
    drop(reports);
    let release = Control::Release { run: 600 };
    assert_eq!(eps[0].call(1, &release, Duration::from_secs(5)).await.unwrap(), Control::Ack);
    // Through the controller: a sound source serves, a corrupt one fails the run.
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let spec = |run: u32| {
        let mut s = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 1);
        s.lent = BTreeSet::from([Loc::host(1)]);
        s.run = Some(run);
        s.layout = Some(layout.clone());
        s.start_at_once = true;
        s.deadline = Duration::from_secs(30);
        s
    };
    assert!(spec(0).checks_beside());
    nodes[0].lend(601, Loc::host(1), r.clone(), 0).unwrap();
    let out = ctl.run(&spec(601)).await.unwrap();
    assert_eq!(out.verified.len(), 2);
    // Corrupt the last chunk: the first two may arrive, the last never verifies.
    ta::fill(&r, 2 << 20, 1 << 20, 0xab).unwrap();
    nodes[0].lend(602, Loc::host(1), r.clone(), 0).unwrap();
    let err = ctl.run(&spec(602)).await.unwrap_err();
    assert!(matches!(err, ControlError::SourceMismatch(l) if l == Loc::host(1)), "{err}");
    for n in [2, 3] {
        assert!(eps[n].regions().is_empty(), "the failed run's target region on node {n} was released");
        assert!(nodes[n - 1].detach(602, Loc::host(n as u32)).is_err(), "nothing to adopt on node {n}");
    }
    assert_eq!(eps[1].regions().len(), 1, "the lent region is not released with the run");
}

/// A transfer that ends before a lent source's crc pass does not end the run: it waits for the
/// pass, and a mismatch still fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waits_for_the_checks_still_running_when_its_transfer_ends() {
    let (eps, _nodes) = cluster(2, "await-checks").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let layout = Layout::new(2, 1, vec![7, 8], vec![]).unwrap();
    for (crcs, ok) in [(vec![7, 8], true), (vec![7, 9], false)] {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut down = cascade_transport::Mesh::peer_events(eps[0].as_ref());
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = tx.send(crate::executor::ToCoord::Done(Loc::host(2)));
            let _ = tx.send(crate::executor::ToCoord::SourceChecked { loc: Loc::host(1), crcs });
            tx
        });
        let t = std::time::Instant::now();
        let checking = BTreeSet::from([Loc::host(1)]);
        let res = ctl.await_checks(9, &layout, checking, &mut rx, &mut down).await;
        assert!(t.elapsed() >= Duration::from_millis(90), "it returned before the report came");
        assert_eq!(res.is_ok(), ok, "{res:?}");
        if !ok {
            assert!(matches!(res, Err(ControlError::SourceMismatch(l)) if l == Loc::host(1)));
        }
        drop(late.await.unwrap());
    }
    // A source whose node is not (or no longer) connected has nothing left to check: its
    // down event may have gone to the run's loop before the wait began.
    let (_tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut down = cascade_transport::Mesh::peer_events(eps[0].as_ref());
    let t = std::time::Instant::now();
    let res = ctl.await_checks(9, &layout, BTreeSet::from([Loc::host(7)]), &mut rx, &mut down).await;
    assert!(res.is_ok(), "{res:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "it waited for a node that is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_drops_the_runs_of_a_controller_that_went_down() {
    let (eps, _nodes) = cluster(3, "orphan").await;
    // Prepare a target on node 2 by hand, then the controller disappears.
    let m = Control::Prepare { run: 77, loc: Loc::host(2), bytes: 1 << 20, chunk: 1 << 20, fill: Fill::Target };
    let r = eps[0].call(2, &m, Duration::from_secs(5)).await.unwrap();
    assert!(matches!(r, Control::Prepared { crcs: None, .. }), "{r:?}");
    assert_eq!(eps[2].regions().len(), 1);
    eps[0].shutdown();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !eps[2].regions().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the orphaned run's region was not dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_fails_its_call_only() {
    let (eps, _nodes) = cluster(3, "refuse").await;
    let bad = Control::Start {
        run: 1234,
        loc: Loc::host(2),
        layout: Layout::new(1, 1, vec![0], vec![]).unwrap(),
        source: false,
        children: vec![],
        ready_first: true,
    };
    let r = eps[0].call(2, &bad, Duration::from_secs(5)).await.unwrap();
    assert!(matches!(&r, Control::Failed { message } if message.contains("unknown multicast run 1234")), "{r:?}");
    // The node keeps serving, and a reply to a request is never given to another.
    let ok =
        Control::Prepare { run: 78, loc: Loc::host(2), bytes: 4096, chunk: 4096, fill: Fill::Synthetic { seed: 3 } };
    let r = eps[0].call(2, &ok, Duration::from_secs(5)).await.unwrap();
    assert!(matches!(r, Control::Prepared { crcs: Some(ref c), .. } if c.len() == 1), "{r:?}");
    let r = eps[0].call(2, &Control::Release { run: 78 }, Duration::from_secs(5)).await.unwrap();
    assert_eq!(r, Control::Ack);
    assert!(eps[2].regions().is_empty());
    assert_eq!(eps[0].services().stats().late_replies, 0);
}

/// The same services on the `mem` test double, with virtual time.
#[tokio::test(start_paused = true)]
async fn controller_and_node_services_run_on_the_mem_double() {
    let fabric = cascade_transport::mem::MemFabric::new();
    let ctl_node = Arc::new(fabric.add_node(0));
    for i in 1..4 {
        MulticastNode::start(Arc::new(fabric.add_node(i)), Duration::from_secs(10)).unwrap();
    }
    let ctl = Controller::new(ctl_node).unwrap();
    let spec = RunSpec::synthetic(topo(4), 3 << 20, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 4);
    let out = tokio::time::timeout(Duration::from_secs(30), ctl.run(&spec)).await.expect("the run ended").unwrap();
    assert_eq!(out.verified.len(), 2, "{:?}", out.report);
}

/// The only source dies in the middle of a run: the controller notices within the link's
/// deadline, fails what nobody else can feed, and returns its report in seconds — completed
/// targets verified against the layout, not against the dead source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dies_mid_run_ends_the_run_in_seconds_with_a_report() {
    let (eps, _nodes) = cluster(5, "deadsrc").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let bytes: u64 = 256 << 20;
    let mut spec = RunSpec::synthetic(topo(5), bytes, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 7);
    spec.planner = PlannerKind::Chain;
    spec.layers = (0..256).map(|i| i * (1 << 20)..(i + 1) * (1 << 20)).collect();
    spec.deadline = Duration::from_secs(600);
    let (tx, mut progress) = tokio::sync::mpsc::unbounded_channel();
    spec.progress = Some(tx);
    let source = eps[1].clone();
    tokio::spawn(async move {
        while let Some((_, e)) = progress.recv().await {
            if matches!(e, Event::LayerReady { .. }) {
                source.shutdown();
                return;
            }
        }
    });
    let t = std::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(20), ctl.run(&spec)).await.expect("the run hung").unwrap();
    assert!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());
    let settled = out.report.completed.len() + out.report.failed.len();
    assert_eq!(settled, 2, "every target completed or failed: {:?}", out.report);
    assert_eq!(out.verified.len(), out.report.completed.len(), "completed targets verified without the source");
}

/// A multicast larger than the nodes can hold is refused at once, before anything is allocated
/// or sent (it used to get the nodes OOM-killed and the controller stuck).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multicast_that_does_not_fit_is_refused_before_anything_moves() {
    let (eps, _nodes) = cluster(3, "toobig").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let spec = RunSpec::synthetic(topo(3), 1 << 50, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    let t = std::time::Instant::now();
    let err = ctl.run(&spec).await.unwrap_err().to_string();
    assert!(err.contains("does not fit"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
    for e in &eps {
        assert!(e.regions().is_empty(), "node {}: nothing is left allocated", e.node());
        assert_eq!(e.budget().used(), 0);
    }
}

/// Bytes of this process's mappings of shared regions (memfds), from `/proc/self/maps`.
fn mapped_shared_bytes() -> u64 {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains("memfd:cascade-region"))
        .map(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            u64::from_str_radix(b, 16).unwrap() - u64::from_str_radix(a, 16).unwrap()
        })
        .sum()
}

/// Twenty multicasts of 256 MiB over shm, half of them started at once: every mapping of a peer's region is dropped when its
/// owner releases it, so the mapped shared memory does not grow from run to run (each run used to
/// leave its regions mapped by the peers that wrote into them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_mappings_are_released_with_their_regions() {
    let eps = cascade_tests::loopback::endpoints(4, "shmleak", |cfg| cfg.shm = true).await.unwrap();
    let _nodes: Vec<_> =
        eps[1..].iter().map(|e| MulticastNode::start(e.clone(), Duration::from_secs(30)).unwrap()).collect();
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let before = mapped_shared_bytes();
    for i in 0..20 {
        let mut spec = RunSpec::synthetic(topo(4), 256 << 20, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], i);
        // Every other run starts at once: targets pre-fault in the background (and are freed
        // while that may still run), senders map their children on the first WRITE.
        spec.start_at_once = i % 2 == 1;
        let out = ctl.run(&spec).await.unwrap();
        assert_eq!(out.verified.len(), 2, "run {i}");
        assert!(
            matches!(out.events.first(), Some((t, crate::Event::Started { .. })) if *t == 0.0),
            "{:?}",
            out.events.first()
        );
        let t = std::time::Instant::now();
        while mapped_shared_bytes() > before && t.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now = mapped_shared_bytes();
        assert!(now <= before, "run {i}: {} MiB of shared regions still mapped", (now - before) >> 20);
    }
}

/// A GPU target with an attached device (the emulated one here; a CUDA GPU where there is one)
/// holds the model in device memory, read back and checked chunk by chunk, when it reports done;
/// a GPU target without a device stays in host memory as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_targets_land_in_device_memory_when_the_node_has_one() {
    gpu_targets_land_in("emulated:0", 5 << 20).await;
}

/// The same on a real GPU, with a model large enough that the device copies take real time.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "requires a CUDA GPU (cargo test -p cascade-multicast --features cuda -- --ignored)"]
async fn gpu_targets_land_in_cuda_memory() {
    gpu_targets_land_in("cuda:0", 256 << 20).await;
}

/// **Test double**: the emulated device, except that the host→device copy covering byte `at`
/// lands with that byte flipped (a bad DMA, a bad page of device memory).
struct CorruptingDevice {
    inner: cascade_transport::device::EmulatedDevice,
    at: u64,
}

impl cascade_transport::device::DeviceMemory for CorruptingDevice {
    fn describe(&self) -> String {
        format!("corrupting {}", self.inner.describe())
    }
    fn alloc(&self, len: u64) -> cascade_transport::Result<cascade_transport::device::DeviceBuffer> {
        self.inner.alloc(len)
    }
    fn upload_in_range(
        &self,
        dst: &cascade_transport::device::DeviceBuffer,
        dst_offset: u64,
        src: &[u8],
    ) -> cascade_transport::Result<()> {
        let mut bytes = src.to_vec();
        if let Some(b) = self.at.checked_sub(dst_offset).and_then(|i| bytes.get_mut(i as usize)) {
            *b ^= 0xff;
        }
        self.inner.upload(dst, dst_offset, &bytes)
    }
    fn download_in_range(
        &self,
        src: &cascade_transport::device::DeviceBuffer,
        src_offset: u64,
        dst: &mut [u8],
    ) -> cascade_transport::Result<()> {
        self.inner.download(src, src_offset, dst)
    }
    fn copy_in_range(
        &self,
        src_device: &dyn cascade_transport::device::DeviceMemory,
        src: &cascade_transport::device::DeviceBuffer,
        src_offset: u64,
        dst: &cascade_transport::device::DeviceBuffer,
        dst_offset: u64,
        len: u64,
    ) -> cascade_transport::Result<()> {
        self.inner.copy(src_device, src, src_offset, dst, dst_offset, len)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A device copy that differs from what the staging region verified is caught by the read-back
/// of its layer: the layers before it are announced, the bad one and those after it never are,
/// and the target never reports done, while the run's other target completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_device_copy_stops_its_target_at_the_bad_layer() {
    let (eps, nodes) = cluster(4, "devbad").await;
    let (bytes, layer) = (4u64 << 20, 1u64 << 20);
    let bad = 2 * layer + 12345; // in layer 2
    nodes[1].attach_device(
        0,
        Arc::new(CorruptingDevice { inner: cascade_transport::device::EmulatedDevice::new(0), at: bad }),
    );
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let mut spec = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::gpu(2, 0), Loc::gpu(3, 0)], 9);
    spec.layers = (0..4).map(|l| l * layer..(l + 1) * layer).collect();
    spec.deadline = Duration::from_secs(3);
    let out = ctl.run(&spec).await;
    let out = match out {
        Ok(o) => o,
        Err(e) => panic!("the run should end with a report, not an error: {e}"),
    };
    assert_eq!(out.verified, vec![Loc::gpu(3, 0)], "{:?}", out.report);
    let ready: Vec<usize> = out
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            crate::Event::LayerReady { target, layer } if *target == Loc::gpu(2, 0) => Some(*layer),
            _ => None,
        })
        .collect();
    assert_eq!(ready, vec![0, 1], "layers announced by the corrupted target");
}

async fn gpu_targets_land_in(device: &str, bytes: u64) {
    use cascade_transport::device;
    let (eps, nodes) = cluster(4, "device").await;
    let dev = device::open(device).unwrap();
    eprintln!("device {}", dev.describe());
    nodes[1].attach_device(0, dev.clone()); // node 2
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let mut spec = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::gpu(2, 0), Loc::gpu(3, 0)], 9);
    spec.layers = vec![0..(1 << 20), (1 << 20)..bytes];
    spec.hold = true;
    let t = std::time::Instant::now();
    let out = ctl.run(&spec).await.unwrap();
    eprintln!("{} MiB to one device target and one host target in {:.3} s", bytes >> 20, t.elapsed().as_secs_f64());
    assert_eq!(out.verified.len(), 2, "{:?}", out.report);
    let on_device = nodes[1].device_target(out.run, Loc::gpu(2, 0)).expect("node 2's target is on its device");
    assert!(nodes[2].device_target(out.run, Loc::gpu(3, 0)).is_none(), "node 3 has no device");
    let staged = nodes[1].region(out.run, Loc::gpu(2, 0)).unwrap();
    let mut back = vec![0u8; bytes as usize];
    on_device.dev.download(&on_device.buf, 0, &mut back).unwrap();
    assert!(back == ta::view(&staged, 0, bytes).unwrap(), "the device holds what the staging region verified");
    ctl.release(out.run, &[Loc::host(1), Loc::gpu(2, 0), Loc::gpu(3, 0)]).await;
    assert!(nodes[1].device_target(out.run, Loc::gpu(2, 0)).is_none(), "released with the run");
}

/// The SENDs node `ep` has made, from its metrics.
fn sends(ep: &Endpoint) -> u64 {
    let text = ep.metrics().render();
    text.lines()
        .filter(|l| l.starts_with("cascade_transfer_ops_total{") && l.contains("op=\"send\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_be_planned_asks_no_node_for_anything() {
    let (eps, _nodes) = cluster(3, "unplanned").await;
    let ctl = Controller::new(eps[0].clone()).unwrap();
    // A warm-up run, so that the counter exists.
    let ok = RunSpec::synthetic(topo(3), 1 << 20, vec![Loc::host(1)], vec![Loc::host(2)], 1);
    assert_eq!(ctl.run(&ok).await.unwrap().verified.len(), 1);
    let before = sends(&eps[0]);
    assert!(before > 0);
    for targets in [vec![Loc::host(2), Loc::host(2)], vec![Loc::host(9)]] {
        let bad = RunSpec::synthetic(topo(3), 1 << 20, vec![Loc::host(1)], targets.clone(), 1);
        let e = ctl.run(&bad).await.unwrap_err();
        assert!(matches!(e, ControlError::Plan(_)), "{targets:?}: {e}");
    }
    // Before, each failed plan was followed by a Release to every member (to node 9 too, not in
    // the cluster, warned about as "did not confirm releasing the run's regions").
    assert_eq!(sends(&eps[0]), before, "a run that was never planned sent messages");
}

/// A region reserved for a target (`MulticastNode::reserve_target`, what a new instance does when
/// it starts) is the one the next run fills there and a higher layer detaches — its bytes, not
/// a new allocation's; a reservation of another size is left alone (the run allocates), and one
/// for a location of another node or a GPU is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_target_region_is_the_one_a_run_fills() {
    let (eps, nodes) = cluster(4, "reserve").await;
    let bytes = (3 << 20) + 100;
    let source = eps[1].register_new(bytes).unwrap();
    fill(&source, bytes, 4);
    let reserved =
        cascade_transport::Mesh::alloc_prefault(&*eps[2], bytes, cascade_transport::Prefault::Background).unwrap();
    let wrong_size = eps[3].alloc(bytes + 4096).unwrap();
    nodes[1].reserve_target(Loc::host(2), reserved.clone()).unwrap();
    nodes[2].reserve_target(Loc::host(3), wrong_size.clone()).unwrap();
    assert!(nodes[1].reserve_target(Loc::host(3), eps[2].alloc(4096).unwrap()).is_err(), "another node's location");
    assert!(nodes[1].reserve_target(Loc::gpu(2, 0), eps[2].alloc(4096).unwrap()).is_err(), "a GPU location");
    let crcs = (0..4).map(|i| ta::crc32(&source, i << 20, (bytes - (i << 20)).min(1 << 20)).unwrap()).collect();
    let run = 600;
    nodes[0].lend(run, Loc::host(1), source.clone(), 0).unwrap();
    let ctl = Controller::new(eps[0].clone()).unwrap();
    let mut spec = RunSpec::synthetic(topo(4), bytes, vec![Loc::host(1)], vec![Loc::host(2), Loc::host(3)], 1);
    spec.lent = BTreeSet::from([Loc::host(1)]);
    spec.run = Some(run);
    spec.hold = true;
    spec.start_at_once = true;
    spec.layout = Some(Layout::new(bytes, 1 << 20, crcs, vec![]).unwrap());
    let out = ctl.run(&spec).await.unwrap();
    assert_eq!(out.verified.len(), 2);
    let two = nodes[1].detach(run, Loc::host(2)).unwrap();
    let three = nodes[2].detach(run, Loc::host(3)).unwrap();
    ctl.release(run, &[Loc::host(1), Loc::host(2), Loc::host(3)]).await;
    assert_eq!(two.id(), reserved.id(), "node 2's copy is the reserved region");
    assert_eq!(ta::crc32(&reserved, 0, bytes).unwrap(), ta::crc32(&source, 0, bytes).unwrap());
    assert_ne!(three.id(), wrong_size.id(), "a reservation of another size is not taken");
    assert_eq!(ta::crc32(&three, 0, bytes).unwrap(), ta::crc32(&source, 0, bytes).unwrap());
}
