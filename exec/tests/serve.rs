//! Instances serving the real all-MiniLM-L6-v2 over loopback TCP endpoints while a new instance's
//! copy arrives by multicast: every request is answered once, with the right embedding, under
//! each policy; a failure of either instance re-queues its batches. Skips, saying so, without the
//! model (see `common`).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_exec::embed::Embedder;
use cascade_exec::serve::router::{self, Answer, Request, RouterCmd, RouterConfig};
use cascade_exec::serve::{scale_out, DispatchConfig, Instance, InstanceConfig, LivePolicy, ServedModel, Source};
use cascade_exec::serve::{ExecMsg, ServeError};
use cascade_multicast::cluster::{Controller, MulticastNode};
use cascade_multicast::Topology;
use cascade_transport::mem::MemFabric;
use cascade_transport::{Endpoint, Mesh, ServiceExt, ServiceFault, TransportError};
use common::{cosine, model_dir, reference};
use tokio::sync::mpsc;

struct Cluster {
    eps: Vec<Arc<Endpoint>>,
    model: ServedModel,
    _instances: Vec<Instance>,
}

/// What a node from 1 on runs.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    /// An instance serving a held copy.
    Held,
    /// An instance whose copy arrives by multicast.
    Arriving,
    /// No instance: the endpoint alone.
    Absent,
}

/// Node 0 routes and controls multicasts; node 1 serves a held copy; nodes 2.. start empty.
async fn cluster(n: u32, tag: &str) -> Option<Cluster> {
    let roles: Vec<Role> = (1..n).map(|i| if i == 1 { Role::Held } else { Role::Arriving }).collect();
    cluster_of(tag, &roles).await
}

/// The instances' limits in these tests: batches of 4 texts of 64 tokens, 8 slots.
fn test_config() -> InstanceConfig {
    InstanceConfig { max_batch: 4, max_tokens: Some(64), slots: 8, op_timeout: Duration::from_secs(30), core: None }
}

/// Node 0 routes and controls multicasts; node i + 1 plays `roles[i]`.
async fn cluster_of(tag: &str, roles: &[Role]) -> Option<Cluster> {
    cluster_with(tag, roles, test_config()).await
}

/// [`cluster_of`] with the instances' own limits.
async fn cluster_with(tag: &str, roles: &[Role], cfg: InstanceConfig) -> Option<Cluster> {
    let dir = model_dir()?;
    let (model, file) = ServedModel::from_dir(&dir).unwrap();
    let eps = cascade_tests::loopback::endpoints(roles.len() as u32 + 1, tag, |_| {}).await.unwrap();
    let mut instances = Vec::new();
    for (ep, &role) in eps.iter().skip(1).zip(roles) {
        let mesh: Arc<dyn Mesh> = ep.clone();
        let source = match role {
            Role::Held => Source::Held(model.load(&*mesh, &file).unwrap()),
            Role::Arriving => Source::Arriving,
            Role::Absent => continue,
        };
        let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(10)).unwrap();
        instances.push(Instance::start(mesh, model.clone(), source, mc, cfg).unwrap());
    }
    Some(Cluster { eps, model, _instances: instances })
}

/// Limits whose activation region (what a pairing registers: `slots` batches of `max_batch`
/// texts of `max_tokens` tokens) could never be allocated on the node are refused when the
/// instance starts, not at its first hand-over in the middle of a burst. On the mem fabric (a
/// test double) with a 64 MiB limit: the test limits' region (8 × 4 × 64 tokens) fits; 4,096
/// texts a batch (8 × 1.6 GB) do not, nor a batch size whose slot overflows.
#[tokio::test]
async fn limits_whose_activation_region_cannot_fit_are_refused_at_start() {
    let Some(dir) = model_dir() else { return };
    let (model, _) = ServedModel::from_dir(&dir).unwrap();
    let fabric = MemFabric::new();
    // A node of its own for each start (a node's services subscribe once).
    let start = |node: u32, cfg: InstanceConfig| {
        let mesh: Arc<dyn Mesh> = Arc::new(fabric.add_node_with_limit(node, Some(64 << 20)));
        let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(10)).unwrap();
        Instance::start(mesh, model.clone(), Source::Arriving, mc, cfg)
    };
    start(1, test_config()).unwrap().stop_and_wait().await;
    for (node, max_batch) in [(2, 4096), (3, usize::MAX / 2)] {
        let e = start(node, InstanceConfig { max_batch, ..test_config() }).err().expect("started");
        assert!(matches!(e, ServeError::Config(_)), "{e}");
        assert!(e.to_string().contains("exceeds the node's memory limit"), "{e}");
    }
    // A compute core past cpu_set_t: refused at start (before, the compute thread panicked in
    // CPU_SET and the instance served nothing).
    let e = start(4, InstanceConfig { core: Some(4096), ..test_config() }).err().expect("started");
    assert!(matches!(e, ServeError::Config(_)), "{e}");
    assert!(e.to_string().contains("core 4096 is not one this process may run on"), "{e}");
}

fn router_cfg(policy: LivePolicy) -> RouterConfig {
    RouterConfig {
        dispatch: DispatchConfig { policy, layers: 7, old: 1, per_instance: 2, max_coop: 8, load_ratio: 2 },
        max_batch: 4,
        call_timeout: Duration::from_secs(60),
        poll_every: Duration::from_millis(5),
        max_attempts: 8,
    }
}

fn topology(n: u32) -> Topology {
    let mut t = Topology::new();
    for i in 0..n {
        t.add_node(i, 0, 10.0).unwrap();
    }
    t
}

/// Checks that every request got exactly one answer, equal to the reference embedding of its
/// text (the independent implementation's, cosine ≥ 0.9999).
fn check(answers: &[Answer], texts: &[String], want: &HashMap<String, Vec<f32>>) {
    let mut seen = HashMap::new();
    for a in answers {
        assert!(seen.insert(a.id, ()).is_none(), "request {} answered twice", a.id);
        let emb = a.result.as_ref().unwrap_or_else(|e| panic!("request {} refused: {e}", a.id));
        let text = &texts[a.id as usize];
        let c = cosine(emb, &want[text]);
        assert!(c >= 0.9999, "request {} ({text:?}): cosine {c}", a.id);
    }
    assert_eq!(seen.len(), texts.len(), "every request is answered");
}

fn workload(n: usize) -> (Vec<String>, HashMap<String, Vec<f32>>) {
    let refs = reference();
    let texts = (0..n).map(|i| refs[i % refs.len()].text.clone()).collect();
    (texts, refs.into_iter().map(|r| (r.text, r.embedding)).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_serves_while_its_copy_arrives_under_each_policy() {
    for policy in [LivePolicy::StopTheWorld, LivePolicy::BestEffort, LivePolicy::Zigzag] {
        let Some(c) = cluster(3, "serve").await else { return };
        let mesh: Arc<dyn Mesh> = c.eps[0].clone();
        let (texts, want) = workload(32 + 16 * 4);
        let (req_tx, req_rx) = mpsc::channel(1024);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ans_tx, mut ans_rx) = mpsc::unbounded_channel();
        let routing = tokio::spawn(router::run(mesh.clone(), router_cfg(policy), req_rx, cmd_rx, ans_tx));
        let send = |i: usize| Request { id: i as u64, text: texts[i].clone(), arrived: Instant::now() };
        // A burst queues at the router, then the model is multicast to node 2.
        for i in 0..32 {
            req_tx.send(send(i)).await.unwrap();
        }
        cmd_tx.send(RouterCmd::Scale { node: 2 }).unwrap();
        let ctl = Controller::new(mesh.clone()).unwrap();
        let out = scale_out(&mesh, &ctl, &c.model.manifest, topology(3), 1, &[2], None).await.unwrap();
        assert_eq!(out.adopted, vec![2], "{policy:?}: the new instance holds its verified copy");
        // Then more, 16 at a time, until the new instance has served some batches whole: the
        // router learns of its last layer by polling, so a first round may all go to node 1.
        let mut answers: Vec<Answer> = Vec::new();
        let mut sent = 32;
        while sent < texts.len() {
            for i in sent..sent + 16 {
                req_tx.send(send(i)).await.unwrap();
            }
            sent += 16;
            while answers.len() < sent {
                answers.push(ans_rx.recv().await.unwrap());
            }
            if answers.iter().any(|a| a.to == 2) {
                break;
            }
        }
        drop(req_tx);
        let stats = routing.await.unwrap();
        check(&answers, &texts[..sent], &want);
        assert_eq!((stats.served, stats.refused), (sent as u64, 0), "{policy:?}");
        assert_eq!(stats.residency.last().map(|r| r.resident), Some(7), "{policy:?}: the router saw every layer land");
        let on_new = answers.iter().filter(|a| a.to == 2).count();
        assert!(on_new > 0, "{policy:?}: the new instance served some requests whole");
        let split = answers.iter().filter(|a| a.split.is_some()).count();
        let three = answers.iter().filter(|a| a.onward.is_some()).count();
        for a in answers.iter().filter(|a| a.onward.is_some()) {
            // The entry stage on old, then stages 1..x on new, then the rest on old.
            assert_eq!((a.to, a.split.map(|s| (s.layers, s.then))), (1, Some((1, 2))), "{policy:?}");
            assert!(a.onward.is_some_and(|o| o.layers >= 2 && o.then == 1), "{policy:?}: {:?}", a.onward);
        }
        if policy == LivePolicy::StopTheWorld {
            assert_eq!(split, 0, "stop-the-world never splits");
        }
        eprintln!(
            "{policy:?}: {on_new} of {sent} via node 2, {split} split ({three} in three segments), residency {:?}",
            stats.residency
        );
        for e in &c.eps {
            e.shutdown();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_split_across_instances_equals_one_instance() {
    let Some(c) = cluster(3, "split-eq").await else { return };
    let dir = model_dir().unwrap();
    let local = Embedder::from_dir(&dir).unwrap();
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let ctl = Controller::new(mesh.clone()).unwrap();
    scale_out(&mesh, &ctl, &c.model.manifest, topology(3), 1, &[2], None).await.unwrap();
    use cascade_exec::serve::{ExecMsg, Split};
    use cascade_transport::ServiceExt;
    let texts = vec!["The quick brown fox jumps over the lazy dog.".to_string(), "Hello, world!".to_string()];
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let whole = local.embed(&refs).unwrap();
    for k in 1..7 {
        let msg = ExecMsg::Run {
            batch: k,
            texts: texts.clone(),
            split: Some(Split { layers: k as u32, then: 1 }),
            onward: None,
        };
        match mesh.call(2, &msg, Duration::from_secs(30)).await.unwrap() {
            ExecMsg::Done { embeddings, on_first, .. } => {
                assert_eq!(on_first, k as u32);
                assert_eq!(embeddings, whole, "split after {k} layers: bit-identical to one process");
            }
            other => panic!("split after {k}: {other:?}"),
        }
    }
    // Three segments, as while a new copy lacks its embedding table: the entry stage on node 1,
    // stages 1..k on node 2, the rest on node 1.
    for k in 2..7 {
        let msg = ExecMsg::Run {
            batch: 20 + k,
            texts: texts.clone(),
            split: Some(Split { layers: 1, then: 2 }),
            onward: Some(Split { layers: k as u32, then: 1 }),
        };
        match mesh.call(1, &msg, Duration::from_secs(30)).await.unwrap() {
            ExecMsg::Done { embeddings, on_first, .. } => {
                assert_eq!(on_first, 1);
                assert_eq!(embeddings, whole, "entry on 1, stages 1..{k} on 2: bit-identical to one process");
            }
            other => panic!("three segments through {k}: {other:?}"),
        }
    }
    // Bad input is refused, not retried: too many texts, a split past the model.
    let refused = |m: ExecMsg| {
        let mesh = mesh.clone();
        async move {
            matches!(mesh.call(2, &m, Duration::from_secs(5)).await.unwrap(), ExecMsg::Failed { retry: false, .. })
        }
    };
    assert!(refused(ExecMsg::Run { batch: 9, texts: vec!["x".into(); 5], split: None, onward: None }).await);
    let past =
        ExecMsg::Run { batch: 10, texts: texts.clone(), split: Some(Split { layers: 7, then: 1 }), onward: None };
    assert!(refused(past).await);
    // An onward segment without a split, or one that does not lie after the split.
    let (one, three) = (Some(Split { layers: 1, then: 1 }), Some(Split { layers: 3, then: 1 }));
    assert!(refused(ExecMsg::Run { batch: 11, texts: texts.clone(), split: None, onward: three }).await);
    assert!(refused(ExecMsg::Run { batch: 12, texts, split: three, onward: one }).await);
    // A Finish whose activation never landed (no WRITE: the slot's bytes do not match its crc)
    // is refused, not computed on.
    let ExecMsg::Paired { region, first, .. } =
        mesh.call(2, &ExecMsg::Pair { slots: 1 }, Duration::from_secs(5)).await.unwrap()
    else {
        panic!("pairing refused")
    };
    let finish = ExecMsg::Finish { batch: 13, region, slot: first, len: 4096, crc: 0x1234_5678, split: None };
    match mesh.call(2, &finish, Duration::from_secs(5)).await.unwrap() {
        ExecMsg::Failed { message, .. } => assert!(message.contains("did not land"), "{message}"),
        other => panic!("a Finish without its bytes was answered {other:?}"),
    }
}

/// Texts as long as the model takes (sentence-transformers cuts all-MiniLM-L6-v2 at 256 tokens)
/// are served under the default limits, whole and split across two instances through an
/// activation slot, with the independent reference's embeddings — and so is the short text
/// batched with them. Before 2026-12-04 an instance took 128 tokens by default: such a batch
/// was refused whole, its short text with it, although `cascade embed` embeds the same texts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn texts_as_long_as_the_model_takes_are_served_whole_and_split_under_the_default_limits() {
    let roles = [Role::Held, Role::Arriving];
    let Some(c) = cluster_with("long-texts", &roles, InstanceConfig::default()).await else { return };
    assert_eq!(c.model.max_tokens(), 256);
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let ctl = Controller::new(mesh.clone()).unwrap();
    scale_out(&mesh, &ctl, &c.model.manifest, topology(3), 1, &[2], None).await.unwrap();
    use cascade_exec::serve::{ExecMsg, Split};
    use cascade_transport::ServiceExt;
    let (long, short) = (common::reference_long(), reference().remove(0));
    assert!(long.iter().any(|r| r.ids.len() == 256), "a text cut at the model's 256 tokens");
    let texts: Vec<String> = long.iter().map(|r| r.text.clone()).chain([short.text.clone()]).collect();
    let want: Vec<&Vec<f32>> = long.iter().map(|r| &r.embedding).chain([&short.embedding]).collect();
    for (batch, to, split) in [(1, 1, None), (2, 2, Some(Split { layers: 3, then: 1 }))] {
        let msg = ExecMsg::Run { batch, texts: texts.clone(), split, onward: None };
        match mesh.call(to, &msg, Duration::from_secs(60)).await.unwrap() {
            ExecMsg::Done { embeddings, .. } => {
                assert_eq!(embeddings.len(), want.len());
                for (i, (e, w)) in embeddings.iter().zip(&want).enumerate() {
                    let cos = cosine(e, w);
                    assert!(cos >= 0.9999, "batch {batch} on node {to}, text {i}: cosine {cos}");
                }
            }
            other => panic!("batch {batch} on node {to}: {other:?}"),
        }
    }
}

/// One instance takes hand-overs from three peers, each into an activation region of its own
/// (an old instance that every scale-out pairs with; it once refused the third peer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_takes_hand_overs_from_three_peers() {
    let Some(c) = cluster_of("three-peers", &[Role::Held; 4]).await else { return };
    let local = Embedder::from_dir(&model_dir().unwrap()).unwrap();
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    use cascade_exec::serve::{ExecMsg, Split};
    use cascade_transport::ServiceExt;
    let texts = vec!["Three peers, one old instance.".to_string()];
    let whole = local.embed(&[texts[0].as_str()]).unwrap();
    for round in 0..2u64 {
        for peer in [2u32, 3, 4] {
            let batch = round * 10 + u64::from(peer);
            let msg =
                ExecMsg::Run { batch, texts: texts.clone(), split: Some(Split { layers: 3, then: 1 }), onward: None };
            match mesh.call(peer, &msg, Duration::from_secs(30)).await.unwrap() {
                ExecMsg::Done { embeddings, on_first, .. } => {
                    assert_eq!(on_first, 3);
                    assert_eq!(embeddings, whole, "node {peer} to node 1: bit-identical to one process");
                }
                other => panic!("node {peer} handing over to node 1: {other:?}"),
            }
        }
    }
}

/// Runs `n` requests through a router (policy best-effort) while `during` acts on the cluster;
/// returns the answers and the router's statistics.
async fn serve_during<F, Fut>(c: &Cluster, n: usize, during: F) -> (Vec<Answer>, router::RouterStats, Vec<String>)
where
    F: FnOnce(mpsc::UnboundedSender<RouterCmd>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let (texts, want) = workload(n);
    let (req_tx, req_rx) = mpsc::channel(1024);
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let (ans_tx, mut ans_rx) = mpsc::unbounded_channel();
    let routing = tokio::spawn(router::run(mesh, router_cfg(LivePolicy::BestEffort), req_rx, cmd_rx, ans_tx));
    for (i, t) in texts.iter().enumerate() {
        req_tx.send(Request { id: i as u64, text: t.clone(), arrived: Instant::now() }).await.unwrap();
    }
    drop(req_tx);
    during(cmd_tx).await;
    let stats = routing.await.unwrap();
    let answers: Vec<Answer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    check(&answers, &texts, &want);
    (answers, stats, texts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_instance_failing_while_it_loads_loses_nothing() {
    let Some(c) = cluster(3, "new-dies").await else { return };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let cr = &c;
    let m = &mesh;
    let (answers, stats, _) = serve_during(&c, 40, |cmds| async move {
        cmds.send(RouterCmd::Scale { node: 2 }).unwrap();
        let ctl = Controller::new(m.clone()).unwrap();
        let scaling = scale_out(m, &ctl, &cr.model.manifest, topology(3), 1, &[2], None);
        tokio::pin!(scaling);
        // Node 2 dies once it serves its first layer: its split batches must go back to node 1.
        let died = async {
            while cr._instances[1].resident() == 0 && cr._instances[1].after_entry() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            cr.eps[2].shutdown();
        };
        let (r, ()) = tokio::join!(&mut scaling, died);
        // The multicast may have finished before the shutdown; either way nothing is lost.
        let _ = r;
    })
    .await;
    assert_eq!((stats.served, stats.refused), (40, 0));
    eprintln!(
        "new died: requeued {}, {} answered via node 2",
        stats.requeued,
        answers.iter().filter(|a| a.to == 2).count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_instance_failing_mid_batch_loses_nothing() {
    let Some(c) = cluster(3, "old-dies").await else { return };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let ctl = Controller::new(mesh.clone()).unwrap();
    scale_out(&mesh, &ctl, &c.model.manifest, topology(3), 1, &[2], None).await.unwrap();
    let cr = &c;
    // Enough work that node 1 still has batches at 150 ms however fast it computes: 40
    // requests were all served by then once BERT's layers ran 1.45 times faster (2026-12-06).
    let (answers, stats, _) = serve_during(&c, 200, |cmds| async move {
        cmds.send(RouterCmd::Scale { node: 2 }).unwrap();
        // Both serve; node 1 dies with batches outstanding.
        tokio::time::sleep(Duration::from_millis(150)).await;
        cr.eps[1].shutdown();
    })
    .await;
    assert_eq!((stats.served, stats.refused), (200, 0));
    let late_on_new = answers.iter().filter(|a| a.to == 2).count();
    assert!(stats.requeued > 0, "a batch was outstanding on node 1 when it died");
    eprintln!("old died: requeued {}, {late_on_new} answered via node 2", stats.requeued);
}

/// A node whose link is up but which runs no exec instance (as while a node shuts down: its
/// services go before its links) answers "no such service": the router stops sending there at
/// once instead of spending every attempt of a batch on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_an_instance_takes_no_more_batches() {
    // Node 1 is the router's `old` but runs no instance; node 2 serves a held copy.
    let Some(c) = cluster_of("no-instance", &[Role::Absent, Role::Held]).await else { return };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let gone = mesh.call(1, &ExecMsg::Status, Duration::from_secs(5)).await;
    assert!(
        matches!(gone, Err(TransportError::Service { peer: 1, fault: ServiceFault::UnknownService, .. })),
        "node 1 runs no instance but is connected: {gone:?}"
    );
    let (answers, stats, _) = serve_during(&c, 24, |cmds| async move {
        cmds.send(RouterCmd::Scale { node: 2 }).unwrap();
    })
    .await;
    assert_eq!((stats.served, stats.refused), (24, 0));
    assert!(answers.iter().all(|a| a.to == 2 && a.split.is_none()), "every batch went to node 2 alone");
    // At most the batches in flight to node 1 before its first refusal came back (the router
    // sends an instance `per_instance` = 2 at a time).
    assert!(stats.requeued <= 2, "one refusal marks node 1 gone: {} batches requeued", stats.requeued);
}

/// A router on node 0 of a mem fabric (a test double whose links a test can cut) with nodes 1
/// and 2, node 2 serving a held copy (paired as the new instance: it serves whole batches beside
/// node 1), node 1 serving one only if `node1_serves`.
struct MemServing {
    fabric: MemFabric,
    nodes: Vec<Arc<dyn Mesh>>,
    model: ServedModel,
    /// The model's file's bytes.
    file: cascade_param_pool::files::MappedFile,
    instances: Vec<Instance>,
    texts: Vec<String>,
    want: HashMap<String, Vec<f32>>,
    req_tx: mpsc::Sender<Request>,
    ans_rx: mpsc::UnboundedReceiver<Answer>,
    answers: Vec<Answer>,
    routing: tokio::task::JoinHandle<router::RouterStats>,
}

impl MemServing {
    fn start(node1_serves: bool) -> Option<MemServing> {
        let dir = model_dir()?;
        let (model, file) = ServedModel::from_dir(&dir).unwrap();
        let fabric = MemFabric::new();
        let nodes: Vec<Arc<dyn Mesh>> = (0..3).map(|i| Arc::new(fabric.add_node(i)) as Arc<dyn Mesh>).collect();
        let (texts, want) = workload(200);
        let (req_tx, req_rx) = mpsc::channel(1024);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ans_tx, ans_rx) = mpsc::unbounded_channel();
        let routing =
            tokio::spawn(router::run(nodes[0].clone(), router_cfg(LivePolicy::BestEffort), req_rx, cmd_rx, ans_tx));
        let mut s = MemServing {
            fabric,
            nodes,
            model,
            file,
            instances: Vec::new(),
            texts,
            want,
            req_tx,
            ans_rx,
            answers: Vec::new(),
            routing,
        };
        if node1_serves {
            s.serve_on(1);
        }
        s.serve_on(2);
        cmd_tx.send(RouterCmd::Scale { node: 2 }).unwrap();
        Some(s)
    }

    /// Starts an instance with a held copy on `node`.
    fn serve_on(&mut self, node: usize) {
        let cfg = test_config();
        let mesh = self.nodes[node].clone();
        let held = Source::Held(self.model.load(&*mesh, &self.file).unwrap());
        let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(10)).unwrap();
        self.instances.push(Instance::start(mesh, self.model.clone(), held, mc, cfg).unwrap());
    }

    /// Sends the next `n` requests and waits for their answers; those answers.
    async fn round(&mut self, n: usize) -> &[Answer] {
        let sent = self.answers.len();
        assert!(sent + n <= self.texts.len(), "out of texts");
        for i in sent..sent + n {
            let req = Request { id: i as u64, text: self.texts[i].clone(), arrived: Instant::now() };
            self.req_tx.send(req).await.unwrap();
        }
        while self.answers.len() < sent + n {
            self.answers.push(self.ans_rx.recv().await.unwrap());
        }
        &self.answers[sent..]
    }

    /// Rounds of 16 requests until `node` serves one, `within` at most.
    async fn until_served_by(&mut self, node: u32, within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        loop {
            let left = self.texts.len() - self.answers.len();
            assert!(Instant::now() < deadline && left >= 16, "node {node} never served again {what}");
            if self.round(16).await.iter().any(|a| a.to == node) {
                return;
            }
        }
    }

    /// Closes the request stream: every answer checked against the reference; the router's stats.
    async fn finish(self) -> (router::RouterStats, Vec<Answer>) {
        let MemServing { req_tx, routing, answers, texts, want, .. } = self;
        drop(req_tx);
        let stats = routing.await.unwrap();
        check(&answers, &texts[..answers.len()], &want);
        assert_eq!((stats.served, stats.refused), (answers.len() as u64, 0));
        (stats, answers)
    }
}

/// The router's link to an instance fails and comes back (a link flap; the mem fabric, a test
/// double, cuts it): while it is down every batch goes to the other instance, and once it is back
/// the instance takes batches again — a flap costs capacity only while it lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_link_comes_back_takes_batches_again() {
    let Some(mut s) = MemServing::start(true) else { return };
    s.fabric.set_link(0, 1, false);
    assert!(s.round(16).await.iter().all(|a| a.to == 2), "node 1 is cut off: everything goes to node 2");
    s.fabric.set_link(0, 1, true);
    // The router asks node 1 what it holds first.
    s.until_served_by(1, Duration::from_secs(60), "after its link came back").await;
    let (_, answers) = s.finish().await;
    eprintln!("link back: node 1 served {} of {}", answers.iter().filter(|a| a.to == 1).count(), answers.len());
}

/// A node whose link stays up answers "no such service" (its instance is not running: a restart)
/// and is marked down; once an instance runs there again it takes batches again, with no link
/// flap to tell the router — the router keeps asking it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_runs_an_instance_again_takes_batches_again() {
    let Some(mut s) = MemServing::start(false) else { return };
    assert!(s.round(16).await.iter().all(|a| a.to == 2), "node 1 runs nothing: everything goes to node 2");
    s.serve_on(1);
    s.until_served_by(1, Duration::from_secs(60), "once its instance ran").await;
    let (stats, answers) = s.finish().await;
    assert!(stats.requeued <= 2, "one refusal marks node 1 down: {} batches requeued", stats.requeued);
    eprintln!("instance back: node 1 served {} of {}", answers.iter().filter(|a| a.to == 1).count(), answers.len());
}

/// Three nodes on a mem fabric (a test double whose links a test can cut and delay): node 0
/// asks, nodes 1 and 2 serve held copies with `cfg`.
struct MemPair {
    fabric: MemFabric,
    nodes: Vec<Arc<dyn Mesh>>,
    model: ServedModel,
    file: cascade_param_pool::files::MappedFile,
    cfg: InstanceConfig,
    /// The instances on nodes 1 and 2.
    instances: [Option<Instance>; 2],
    /// Their nodes' multicast services (a node's, not an instance's).
    multicast: [Option<Arc<MulticastNode>>; 2],
    texts: Vec<String>,
    whole: Vec<Vec<f32>>,
}

impl MemPair {
    fn start(cfg: InstanceConfig) -> Option<MemPair> {
        let dir = model_dir()?;
        let (model, file) = ServedModel::from_dir(&dir).unwrap();
        let fabric = MemFabric::new();
        let nodes: Vec<Arc<dyn Mesh>> = (0..3).map(|i| Arc::new(fabric.add_node(i)) as Arc<dyn Mesh>).collect();
        let texts = vec!["A pairing that heals.".to_string()];
        let whole = Embedder::from_dir(&dir).unwrap().embed(&[texts[0].as_str()]).unwrap();
        let mut p =
            MemPair { fabric, nodes, model, file, cfg, instances: [None, None], multicast: [None, None], texts, whole };
        p.serve_on(1);
        p.serve_on(2);
        Some(p)
    }

    fn serve_on(&mut self, node: usize) {
        let mesh = self.nodes[node].clone();
        let held = Source::Held(self.model.load(&*mesh, &self.file).unwrap());
        let mc = self.multicast[node - 1]
            .get_or_insert_with(|| MulticastNode::start(mesh.clone(), Duration::from_secs(10)).unwrap())
            .clone();
        self.instances[node - 1] = Some(Instance::start(mesh, self.model.clone(), held, mc, self.cfg).unwrap());
    }

    /// Node 0 asks `from` to embed the text with its first three layers and hand the batch over
    /// to `then` for the rest; the answer (within 20 s).
    async fn split(&self, from: u32, then: u32, batch: u64) -> ExecMsg {
        use cascade_exec::serve::Split;
        let msg =
            ExecMsg::Run { batch, texts: self.texts.clone(), split: Some(Split { layers: 3, then }), onward: None };
        self.nodes[0].call(from, &msg, Duration::from_secs(20)).await.unwrap()
    }

    async fn split_ok(&self, from: u32, then: u32, batch: u64, what: &str) {
        match self.split(from, then, batch).await {
            ExecMsg::Done { embeddings, on_first, .. } => {
                assert_eq!(on_first, 3);
                assert_eq!(embeddings, self.whole, "{what}: bit-identical to one process");
            }
            other => panic!("{what}: {other:?}"),
        }
    }

    /// Until `cond` holds (10 s at most).
    async fn until(&self, what: &str, cond: impl Fn(&MemPair) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond(self) {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A stopped instance takes no more requests (its node answers "no such service") and withdraws
/// the activation regions it granted and the staging regions it wrote from; an instance started
/// on the node again serves, and the peer that had paired with the stopped one pairs again on
/// its next hand-over (its first WRITE refused: the region is gone) instead of failing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_restarts_is_paired_again() {
    let Some(mut p) =
        MemPair::start(InstanceConfig { max_batch: 4, max_tokens: Some(64), ..InstanceConfig::default() })
    else {
        return;
    };
    let base = p.nodes[1].regions().len();
    p.split_ok(2, 1, 1, "node 2 to node 1").await;
    p.split_ok(1, 2, 2, "node 1 to node 2").await;
    assert_eq!(p.nodes[1].regions().len(), base + 2, "node 1 granted one region and writes from another");
    p.instances[0].take().unwrap().stop_and_wait().await;
    assert_eq!(p.nodes[1].regions().len(), base, "node 1 withdrew its activation regions before it said it stopped");
    let gone = p.nodes[0].call(1, &ExecMsg::Status, Duration::from_secs(5)).await;
    assert!(
        matches!(gone, Err(TransportError::Service { peer: 1, fault: ServiceFault::UnknownService, .. })),
        "a stopped instance answers nothing: {gone:?}"
    );
    assert!(matches!(p.split(2, 1, 3).await, ExecMsg::Failed { retry: true, .. }), "node 1 runs no instance");
    p.serve_on(1);
    for b in 4..4 + u64::from(InstanceConfig::default().slots) + 2 {
        p.split_ok(2, 1, b, "node 2 to node 1 after node 1's instance restarted").await;
    }
}

/// An instance stopped with split batches queued on it (`Instance::stop_and_wait`, as a graceful
/// scale-in does) finishes them — first layers here, the rest on its peer after the hand-over —
/// and answers them all before it says it stopped; then its staging regions are gone. Requests
/// that had not reached its compute thread yet are refused as "stopped", to be sent elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_instance_answers_the_split_batches_it_held() {
    use cascade_exec::serve::Split;
    let Some(mut p) =
        MemPair::start(InstanceConfig { max_batch: 4, max_tokens: Some(64), ..InstanceConfig::default() })
    else {
        return;
    };
    let base = p.nodes[2].regions().len();
    let (first_tx, mut first_rx) = tokio::sync::mpsc::unbounded_channel();
    let calls: Vec<_> = (1..=8)
        .map(|batch| {
            let (mesh, first) = (p.nodes[0].clone(), first_tx.clone());
            let msg =
                ExecMsg::Run { batch, texts: p.texts.clone(), split: Some(Split { layers: 3, then: 1 }), onward: None };
            tokio::spawn(async move {
                let a = mesh.call(2, &msg, Duration::from_secs(20)).await.unwrap();
                let _ = first.send(());
                a
            })
        })
        .collect();
    // One batch came back: node 2's compute thread holds the others (each takes a millisecond
    // or so to tokenise and queue, tens to compute).
    first_rx.recv().await;
    p.instances[1].take().unwrap().stop_and_wait().await;
    assert_eq!(p.nodes[2].regions().len(), base, "node 2 withdrew its staging region before it said it stopped");
    let mut done = 0;
    for c in calls {
        match c.await.unwrap() {
            ExecMsg::Done { embeddings, on_first: 3, .. } => {
                assert_eq!(embeddings, p.whole);
                done += 1;
            }
            // Refused from the inbox; a batch it took and failed says more ("hand-over to …").
            ExecMsg::Failed { message, retry: true } if message == ServeError::Stopped.to_string() => {}
            other => panic!("a batch the instance took: {other:?}"),
        }
    }
    assert!(done >= 2, "only {done} of 8 batches answered: those queued at the stop were not finished");
}

/// Hand-overs that time out take their slots out of use (their WRITE may still land); once every
/// slot is out, the next hand-over pairs again — in a new region, so that the late WRITEs and
/// Finishes, which the mem fabric's delay lets overtake later messages, touch nothing it uses —
/// instead of waiting for a slot forever; and so does one after the link was cut and restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pairing_whose_slots_failed_is_renewed() {
    use cascade_transport::mem::Fault;
    let cfg = InstanceConfig { slots: 2, op_timeout: Duration::from_millis(300), ..test_config() };
    let Some(p) = MemPair::start(cfg) else { return };
    p.split_ok(2, 1, 1, "before the faults").await;
    p.fabric.set_fault(2, 1, Some(Fault::Delay(Duration::from_millis(700))));
    for b in 2..4 {
        match p.split(2, 1, b).await {
            ExecMsg::Failed { message, retry: true } => assert!(message.contains("time"), "{message}"),
            other => panic!("a hand-over past its time limit: {other:?}"),
        }
    }
    p.fabric.set_fault(2, 1, None);
    // The late WRITEs and Finishes arrive while these run: refused, or computed for no one.
    p.split_ok(2, 1, 4, "after every slot timed out").await;
    p.split_ok(2, 1, 5, "and again").await;
    p.fabric.set_link(2, 1, false);
    assert!(matches!(p.split(2, 1, 6).await, ExecMsg::Failed { retry: true, .. }), "the link is cut");
    p.fabric.set_link(2, 1, true);
    p.until("the link is back", |p| p.nodes[2].connected_to(1)).await;
    p.split_ok(2, 1, 7, "after the link came back").await;
}
