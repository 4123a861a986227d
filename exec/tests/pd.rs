//! Prefill/decode disaggregation with the real SmolLM2-135M over loopback TCP endpoints: the KV
//! moves by one-sided WRITEs into the decode instance's pages, a split prefill's two halves of
//! the KV both land there, a prefill instance mutates into a decode one mid-burst, and a new
//! prefill instance is scaled out by multicast and serves while its copy arrives. Every answer
//! must equal the independent reference's greedy tokens (which single-process greedy reproduces,
//! see `smollm2.rs`). Skips, saying so, without the model.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cascade_exec::llama::generate::Generator;
use cascade_exec::llama::multi_lora::{serve_alone, LoraJob};
use cascade_exec::llama::sample::{Decoding, Sampling};
use cascade_exec::llama::stop::StopStrings;
use cascade_exec::llama::{LoraAdapter, Proj};
use cascade_exec::pd::kv::KvLayout;
use cascade_exec::pd::migrate::{rebalance, RebalanceConfig};
use cascade_exec::pd::proto::{SeqSampling, Written};
use cascade_exec::pd::router::{self, GenAnswer, GenRequest, MonitorConfig, PdCmd, PdRouterConfig};
use cascade_exec::pd::{LlmConfig, LlmInstance, LlmMsg, PdModel, Role};
use cascade_exec::serve::{load_packed, scale_out, Source, Split};
use cascade_multicast::cluster::{Controller, MulticastNode};
use cascade_multicast::Topology;
use cascade_transport::mem::MemFabric;
use cascade_transport::{
    test_access as ta, Endpoint, Mesh, Op, RegionId, RemoteKey, RemoteRegion, ServiceExt, ServiceFault, TransportError,
};
use common::{llm_reference, smollm2_dir};
use tokio::sync::{mpsc, oneshot};

const MAX_TOKENS: u32 = 12;
/// KV pages of every instance.
const KV_PAGES: u32 = 64;

struct Cluster {
    eps: Vec<Arc<Endpoint>>,
    /// Every node's mesh: the endpoints', or the mem fabric's nodes.
    meshes: Vec<Arc<dyn Mesh>>,
    model: PdModel,
    instances: Vec<LlmInstance>,
}

/// Node 0 routes; `roles[i]` is node `i + 1`'s role, `None` for one that starts without a copy.
async fn cluster(roles: &[Option<Role>], tag: &str) -> Option<Cluster> {
    cluster_with(roles, tag, test_config()).await
}

/// [`cluster`] with the instances' own settings.
async fn cluster_with(roles: &[Option<Role>], tag: &str, cfg: LlmConfig) -> Option<Cluster> {
    smollm2_dir()?;
    let eps = cascade_tests::loopback::endpoints(roles.len() as u32 + 1, tag, |_| {}).await.unwrap();
    let meshes = eps.iter().map(|e| e.clone() as Arc<dyn Mesh>).collect();
    Some(with_instances(eps, meshes, roles, cfg))
}

/// The same nodes on a mem fabric (a test double whose links a test can cut).
fn mem_cluster(roles: &[Option<Role>]) -> Option<(Cluster, MemFabric)> {
    mem_cluster_with(roles, test_config())
}

/// [`mem_cluster`] with the instances' own settings.
fn mem_cluster_with(roles: &[Option<Role>], cfg: LlmConfig) -> Option<(Cluster, MemFabric)> {
    smollm2_dir()?;
    let fabric = MemFabric::new();
    let meshes = (0..=roles.len() as u32).map(|i| Arc::new(fabric.add_node(i)) as Arc<dyn Mesh>).collect();
    Some((with_instances(Vec::new(), meshes, roles, cfg), fabric))
}

/// Starts `roles`' instances on `meshes[1..]`.
fn with_instances(
    eps: Vec<Arc<Endpoint>>,
    meshes: Vec<Arc<dyn Mesh>>,
    roles: &[Option<Role>],
    cfg: LlmConfig,
) -> Cluster {
    let (model, file) = PdModel::from_dir(&smollm2_dir().unwrap()).unwrap();
    let instances =
        meshes.iter().skip(1).zip(roles).map(|(mesh, &role)| instance_with(mesh, &model, &file, role, cfg)).collect();
    Cluster { eps, meshes, model, instances }
}

/// The instances' settings in these tests.
fn test_config() -> LlmConfig {
    LlmConfig { kv_pages: KV_PAGES, page_tokens: 16, max_prompt: 64, max_running: 8, ..LlmConfig::default() }
}

/// Starts an instance on `mesh`: a held copy in `role`, or a prefill instance whose copy
/// arrives (`None`).
fn instance(mesh: &Arc<dyn Mesh>, model: &PdModel, file: &[u8], role: Option<Role>) -> LlmInstance {
    instance_with(mesh, model, file, role, test_config())
}

/// [`instance`] with its own settings.
fn instance_with(
    mesh: &Arc<dyn Mesh>,
    model: &PdModel,
    file: &[u8],
    role: Option<Role>,
    cfg: LlmConfig,
) -> LlmInstance {
    let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(10)).unwrap();
    let source = match role {
        Some(_) => Source::Held(load_packed(&**mesh, &model.manifest, file).unwrap()),
        None => Source::Arriving,
    };
    LlmInstance::start(mesh.clone(), model.clone(), source, mc, role.unwrap_or(Role::Prefill), cfg).unwrap()
}

fn topology(n: u32) -> Topology {
    let mut t = Topology::new();
    for i in 0..n {
        t.add_node(i, 0, 10.0).unwrap();
    }
    t
}

/// The reference's first `MAX_TOKENS` tokens of each prompt (fewer when it ends earlier).
fn expected() -> Vec<(Vec<u32>, Vec<u32>)> {
    expected_up_to(MAX_TOKENS)
}

/// The reference's prompts and their first `max` tokens (at most 30: its shortest answer).
fn expected_up_to(max: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    llm_reference().into_iter().map(|r| (r.prompt_tokens, r.tokens.into_iter().take(max as usize).collect())).collect()
}

fn router_cfg(c: &Cluster, old: u32, more: Vec<u32>, decode: Vec<u32>) -> PdRouterConfig {
    PdRouterConfig::new(&c.model, old, more, decode)
}

/// The co-migration rounds of these tests: a trigger at 2 requests above the average, the CPU
/// SmolLM2 costs, 16-token KV pages.
fn rounds(model: &cascade_exec::llama::LlamaConfig) -> RebalanceConfig {
    RebalanceConfig {
        cluster: cascade_sched::lora::dispatch::ClusterConfig { queue_trigger: 2, ..Default::default() },
        cost: cascade_sched::lora::CostModel::cpu_smollm2(),
        layout: KvLayout::new(model, 16),
    }
}

fn check(answers: &[GenAnswer], n: usize, want: &[(Vec<u32>, Vec<u32>)]) {
    let mut seen = HashMap::new();
    for a in answers {
        assert!(seen.insert(a.id, ()).is_none(), "request {} answered twice", a.id);
        let tokens = a.result.as_ref().unwrap_or_else(|e| panic!("request {} failed: {e}", a.id));
        assert_eq!(tokens, &want[a.id as usize % want.len()].1, "request {} ({:?})", a.id, a.prefill);
        assert_eq!(a.gaps.len(), tokens.len() - 1);
    }
    assert_eq!(seen.len(), n, "every request is answered");
}

/// A router on node 0 of a cluster, with its channels.
struct Routed {
    mesh: Arc<dyn Mesh>,
    want: Vec<(Vec<u32>, Vec<u32>)>,
    /// Tokens each request asks for (`MAX_TOKENS` unless [`Routed::asking`] says otherwise).
    max_tokens: u32,
    req_tx: mpsc::UnboundedSender<GenRequest>,
    cmd_tx: mpsc::UnboundedSender<PdCmd>,
    ans_rx: mpsc::UnboundedReceiver<GenAnswer>,
    routing: tokio::task::JoinHandle<Result<router::RouterStats, cascade_exec::serve::ServeError>>,
}

impl Routed {
    /// Starts `cfg`'s router on `c`'s node 0.
    fn start(c: &Cluster, cfg: PdRouterConfig) -> Routed {
        let mesh = c.meshes[0].clone();
        let (req_tx, req_rx) = mpsc::unbounded_channel();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ans_tx, ans_rx) = mpsc::unbounded_channel();
        let routing = tokio::spawn(router::run(mesh.clone(), cfg, req_rx, cmd_rx, ans_tx));
        Routed { mesh, want: expected(), max_tokens: MAX_TOKENS, req_tx, cmd_tx, ans_rx, routing }
    }

    /// Requests of `max_tokens` tokens each from now on.
    fn asking(mut self, max_tokens: u32) -> Routed {
        (self.max_tokens, self.want) = (max_tokens, expected_up_to(max_tokens));
        self
    }

    /// Closes the request stream and waits, `within` at most, for the router to answer every
    /// request: its stats, the answers, and the reference.
    async fn finish(self, within: Duration) -> (router::RouterStats, Vec<GenAnswer>, Vec<(Vec<u32>, Vec<u32>)>) {
        let Routed { req_tx, routing, want, mut ans_rx, .. } = self;
        drop(req_tx);
        let Ok(stats) = tokio::time::timeout(within, routing).await else {
            let got: Vec<GenAnswer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
            panic!("the router did not finish in {within:?}; answered: {got:?}")
        };
        let answers = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
        (stats.unwrap().unwrap(), answers, want)
    }

    /// Sends the next `n` requests (numbered from `answers.len()`) and adds their answers.
    async fn round(&mut self, n: usize, answers: &mut Vec<GenAnswer>) {
        let first = answers.len();
        (first..first + n).for_each(|i| self.send(i));
        while answers.len() < first + n {
            let a = tokio::time::timeout(Duration::from_secs(120), self.ans_rx.recv()).await;
            answers.push(a.expect("answers keep coming").expect("the router runs"));
        }
    }

    /// Sends request `i`: the reference's prompt `i` (cyclically), `max_tokens` tokens.
    fn send(&self, i: usize) {
        let (prompt, _) = &self.want[i % self.want.len()];
        let req = GenRequest {
            id: i as u64,
            prompt: prompt.clone(),
            max_tokens: self.max_tokens,
            adapter: 0,
            sample: None,
            stop: Default::default(),
            tokens: None,
        };
        self.req_tx.send(req).unwrap();
    }
}

/// A prefill split after 1, 7, 16 or 31 stages lands both halves of the KV on the decode
/// instance, which decodes the reference's tokens — and, for sampled requests, the tokens one
/// process draws. Every page goes back after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_prefill_moves_both_halves_of_the_kv_to_the_decode_instance() {
    let Some(c) = cluster(&[Some(Role::Prefill), Some(Role::Prefill), Some(Role::Decode)], "pd-split").await else {
        return;
    };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let mut inbox = mesh.subscribe::<LlmMsg>(1024).unwrap();
    let layers = c.model.config.stages() as u32;
    // Greedy, then sampled: the first token is drawn where the split prefill ends (node 1),
    // the rest on node 3, each as one process draws it.
    let sampling = Sampling { temperature: 1.1, top_k: 50, top_p: 0.9, seed: 7 };
    let greedy = expected();
    let g = Generator::from_dir(&smollm2_dir().unwrap()).unwrap();
    let mut drawn = vec![Vec::new(); greedy.len()];
    let prompts = greedy.iter().map(|(p, _)| p.clone());
    let none = StopStrings::default();
    g.generate_stream(
        prompts,
        MAX_TOKENS as usize,
        Decoding::Sample(sampling),
        &none,
        |_, _| {},
        |i, d| drawn[i] = d.tokens,
    )
    .unwrap();
    assert_ne!(drawn, greedy.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(), "sampling drew the greedy tokens");
    let sampled = greedy
        .iter()
        .zip(&drawn)
        .enumerate()
        .map(|(i, ((p, _), d))| (p.clone(), d.clone(), Some(SeqSampling { sampling, index: i as u64 })));
    let runs: Vec<_> = greedy.iter().map(|(p, t)| (p.clone(), t.clone(), None)).chain(sampled).collect();
    for (i, (prompt, want, sample)) in runs.into_iter().enumerate() {
        let req = 100 + i as u64;
        let tokens = prompt.len() as u32 + MAX_TOKENS;
        let LlmMsg::Reserved { grant } =
            mesh.call(3, &LlmMsg::Reserve { req, tokens }, Duration::from_secs(30)).await.unwrap()
        else {
            panic!("no reservation")
        };
        // Stages [0, k) on node 2, the rest on node 1: KV blocks from both.
        let k = [1, 7, 16, 31][i % 4];
        let split = Some(Split { layers: k, then: 1 });
        let msg = LlmMsg::Prefill {
            req,
            attempt: 1,
            prompt,
            max_tokens: MAX_TOKENS,
            kv: grant,
            split,
            router: 0,
            adapter: 0,
            sample,
        };
        let LlmMsg::Prefilled { first, on_first, decoding, .. } =
            mesh.call(2, &msg, Duration::from_secs(120)).await.unwrap()
        else {
            panic!("prefill failed")
        };
        assert_eq!((on_first, decoding), (k, want.len() > 1));
        let mut got = vec![first];
        while got.len() < want.len() {
            let m = inbox.recv().await.unwrap();
            if let LlmMsg::Token { req: r, index, token, done, .. } = m.msg {
                assert_eq!((r, index as usize), (req, got.len()));
                got.push(token);
                assert_eq!(done, got.len() == want.len());
            }
        }
        assert_eq!(got, want, "split after {k} of {layers} stages, {sample:?}");
    }
    // Every page went back; nobody decodes any more.
    match mesh.call(3, &LlmMsg::Status, Duration::from_secs(10)).await.unwrap() {
        LlmMsg::State { role, running, free_pages, .. } => {
            assert_eq!((role, running, free_pages), (Role::Decode, 0, 64))
        }
        other => panic!("{other:?}"),
    }
    // The node's metrics say the same.
    let text = c.eps[3].metrics().render();
    assert!(text.contains("cascade_llm_kv_pages_free{} 64"), "{text}");
    assert!(text.contains("cascade_llm_kv_requests{} 0"), "{text}");
    // A prefill instance refuses to decode, a decode instance to prefill.
    assert!(matches!(
        mesh.call(1, &LlmMsg::Reserve { req: 1, tokens: 8 }, Duration::from_secs(10)).await.unwrap(),
        LlmMsg::Failed { .. }
    ));
    for e in &c.eps {
        e.shutdown();
    }
}

/// WRITEs node `from` has completed to `to`, by its metrics.
fn writes_to(ep: &Endpoint, to: u32) -> u64 {
    let peer = format!("peer=\"{to}\"");
    ep.metrics()
        .render()
        .lines()
        .filter(|l| l.starts_with("cascade_transfer_ops_total{") && l.contains("op=\"write\"") && l.contains(&peer))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_its_first_token_ends_moves_no_kv_and_one_that_decodes_does() {
    let Some(c) = cluster(&[Some(Role::Prefill), Some(Role::Decode)], "pd-first").await else { return };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let limit = Duration::from_secs(120);
    let (prompt, want) = expected().swap_remove(0);
    let mut inbox = mesh.subscribe::<LlmMsg>(1024).unwrap();
    for (req, max_tokens) in [(1u64, 1u32), (2, 2)] {
        let tokens = prompt.len() as u32 + max_tokens;
        let LlmMsg::Reserved { grant } = mesh.call(2, &LlmMsg::Reserve { req, tokens }, limit).await.unwrap() else {
            panic!("no reservation")
        };
        let lease = grant.lease;
        let before = writes_to(&c.eps[1], 2);
        let msg = LlmMsg::Prefill {
            req,
            attempt: 1,
            prompt: prompt.clone(),
            max_tokens,
            kv: grant,
            split: None,
            router: 0,
            adapter: 0,
            sample: None,
        };
        let LlmMsg::Prefilled { first, decoding, .. } = mesh.call(1, &msg, limit).await.unwrap() else {
            panic!("prefill failed")
        };
        assert_eq!((first, decoding), (want[0], max_tokens > 1));
        let written = writes_to(&c.eps[1], 2) - before;
        if decoding {
            // Its KV was written (Start riding behind the WRITEs), and it decodes its second
            // token from it.
            assert!(written > 0, "no KV written for a request that decodes");
            loop {
                let m = tokio::time::timeout(limit, inbox.recv()).await.unwrap().unwrap();
                if let LlmMsg::Token { req: r, index: 1, token, done, .. } = m.msg {
                    assert_eq!((r, token, done), (req, want[1], true));
                    break;
                }
            }
        } else {
            // Nothing decodes from it: nothing moved, and its pages wait for the router's Release.
            assert_eq!(written, 0, "KV written for a request its first token ended");
            assert_eq!(free_pages(&c, 2).await, KV_PAGES - tokens.div_ceil(16), "its pages are held");
            let release = LlmMsg::Release { req, lease };
            mesh.call(2, &release, limit).await.unwrap();
        }
        // Every page back (a finished sequence frees them at its step's end).
        let t = std::time::Instant::now();
        while free_pages(&c, 2).await != KV_PAGES {
            assert!(t.elapsed() < Duration::from_secs(10), "pages of request {req} still held");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for e in &c.eps {
        e.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_move_that_fails_leaves_no_staging_region_registered() {
    // Node 1 prefills with a 2 s limit on its operations; node 2 decodes.
    let cfg = LlmConfig { op_timeout: Duration::from_secs(2), ..test_config() };
    let Some((c, fabric)) = mem_cluster_with(&[Some(Role::Prefill), Some(Role::Decode)], cfg) else { return };
    let meshes = &c.meshes;
    let (prompt, _) = expected().swap_remove(0);
    let limit = Duration::from_secs(60);
    let prefill = |req: u64| {
        let (mesh, prompt) = (meshes[0].clone(), prompt.clone());
        async move {
            let tokens = prompt.len() as u32 + 2;
            let LlmMsg::Reserved { grant } = mesh.call(2, &LlmMsg::Reserve { req, tokens }, limit).await.unwrap()
            else {
                panic!("no reservation")
            };
            let lease = grant.lease;
            let msg = LlmMsg::Prefill {
                req,
                attempt: 1,
                prompt,
                max_tokens: 2,
                kv: grant,
                split: None,
                router: 0,
                adapter: 0,
                sample: None,
            };
            (mesh.call(1, &msg, limit).await.unwrap(), lease)
        }
    };
    let (first, _) = prefill(1).await;
    assert!(matches!(first, LlmMsg::Prefilled { decoding: true, .. }), "{first:?}");
    // The first move left its staging region as the spare: registered, and reused.
    let registered = meshes[1].regions().len();
    let (again, _) = prefill(2).await;
    assert!(matches!(again, LlmMsg::Prefilled { decoding: true, .. }), "{again:?}");
    assert_eq!(meshes[1].regions().len(), registered, "a second move reuses the spare");
    // The decode node's link swallows the third move's WRITEs: it fails at the 2 s limit, and
    // its region — which an abandoned WRITE may still read — is deregistered, not kept.
    fabric.set_fault(1, 2, Some(cascade_transport::mem::Fault::Drop));
    let (failed, lease) = prefill(3).await;
    assert!(matches!(&failed, LlmMsg::Failed { .. }), "{failed:?}");
    assert_eq!(meshes[1].regions().len(), registered - 1, "the failed move's region is deregistered");
    fabric.set_fault(1, 2, None);
    meshes[0].call(2, &LlmMsg::Release { req: 3, lease }, limit).await.unwrap();
    // The next move registers a new one: as many regions as before the failure, none leaked.
    let (after, _) = prefill(4).await;
    assert!(matches!(after, LlmMsg::Prefilled { decoding: true, .. }), "{after:?}");
    assert_eq!(meshes[1].regions().len(), registered, "no staging region leaked");
}

/// A prefill instance told to mutate maps its KV region (here 1 GiB of shared memory) and has it
/// pre-faulted off the runtime's workers: its node goes on serving its links meanwhile, and the
/// mutation is answered before the pages are all faulted in. Before, the allocation ran on a
/// worker and in `cascade pd` (188 MB on two loaded cores) held it for up to 3 s: the node sent
/// no keepalive, its peers declared it down and the router redid every request it held. One
/// runtime thread here, so that a blocked worker shows as a gap in the ticks of a task beside
/// it.
#[tokio::test(flavor = "current_thread")]
async fn a_mutation_allocates_its_kv_region_off_the_runtime() {
    let Some(dir) = smollm2_dir() else { return };
    let (model, _) = PdModel::from_dir(&dir).unwrap();
    let page = KvLayout::new(&model.config, 16).page_bytes();
    let cfg = LlmConfig { kv_pages: ((1u64 << 30) / page) as u32, ..test_config() };
    let eps = cascade_tests::loopback::endpoints(2, "pd-mutate-off-runtime", |c| c.shm = true).await.unwrap();
    let meshes: Vec<Arc<dyn Mesh>> = eps.iter().map(|e| e.clone() as Arc<dyn Mesh>).collect();
    // Packing the model's copy is slow too (a debug build): off the one runtime thread as well.
    let c =
        tokio::task::spawn_blocking(move || with_instances(eps, meshes, &[Some(Role::Prefill)], cfg)).await.unwrap();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let ticker = tokio::spawn(async move {
        let (mut worst, mut last) = (Duration::ZERO, std::time::Instant::now());
        while !*stopped.borrow_and_update() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                _ = stopped.changed() => {}
            }
            worst = worst.max(last.elapsed());
            last = std::time::Instant::now();
        }
        worst
    });
    let t = std::time::Instant::now();
    let answer = c.meshes[0].call(1, &LlmMsg::Mutate, Duration::from_secs(60)).await;
    let took = t.elapsed();
    stop.send_replace(true);
    let worst = ticker.await.unwrap();
    eprintln!("mutation {took:?}, longest runtime gap {worst:?}");
    assert!(matches!(answer, Ok(LlmMsg::Ack)), "{answer:?}");
    assert_eq!(c.instances[0].role(), Role::Decode);
    assert!(
        worst < Duration::from_millis(100) || worst * 2 < took,
        "the runtime stood still for {worst:?} of the mutation's {took:?}"
    );
    assert!(c.meshes[1].regions().len() >= 2, "the model's copy and the KV region are registered");
    // Pre-faulting 1 GiB took 3.6 s here; mapping it takes milliseconds.
    assert!(took < Duration::from_secs(2), "the mutation waited {took:?}: for the KV region's pages?");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_survives_a_mutation_and_a_live_scale_out() {
    // 1, 2: prefill (held); 3: decode; 4: prefill, arriving by multicast from 1.
    let roles = [Some(Role::Prefill), Some(Role::Prefill), Some(Role::Decode), None];
    let Some(c) = cluster(&roles, "pd-burst").await else { return };
    let r = Routed::start(&c, router_cfg(&c, 1, vec![2], vec![3]));
    let (mesh, want, cmd_tx) = (r.mesh.clone(), r.want.clone(), r.cmd_tx.clone());
    let n = 24;
    for i in 0..12 {
        r.send(i);
    }
    // Node 2 becomes a decode instance; node 4 is scaled out from node 1 to make up for it.
    let (tx, rx) = oneshot::channel();
    cmd_tx.send(PdCmd::Mutate { node: 2, done: tx }).unwrap();
    rx.await.unwrap().unwrap();
    cmd_tx.send(PdCmd::Scaling { node: 4 }).unwrap();
    let ctl = Controller::new(mesh.clone()).unwrap();
    let out = scale_out(&mesh, &ctl, &c.model.manifest, topology(5), 1, &[4], None).await.unwrap();
    assert_eq!(out.adopted, vec![4]);
    for i in 12..n {
        r.send(i);
    }
    let Routed { req_tx, routing, mut ans_rx, .. } = r;
    drop(req_tx);
    let stats = routing.await.unwrap().unwrap();
    let answers: Vec<GenAnswer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    let on = |node: u32| answers.iter().filter(|a| a.prefill.0 == node).count();
    let split = answers.iter().filter(|a| a.prefill.1 > 0).count();
    let decoded_on_2 = answers.iter().filter(|a| a.decode == 2).count();
    eprintln!(
        "prefills: node 1 {}, node 2 {}, node 4 {} ({split} split); decoded on node 2: {decoded_on_2}; requeued {}",
        on(1),
        on(2),
        on(4),
        stats.requeued
    );
    assert!(on(4) > 0, "the new prefill instance served");
    assert!(
        answers.iter().filter(|a| a.id >= 12).all(|a| a.prefill.0 != 2),
        "nothing prefilled on node 2 after it mutated"
    );
    for e in &c.eps {
        e.shutdown();
    }
}

/// dLoRA's co-migration on real instances: node 1 prefills, four requests with two adapters
/// (seeded test doubles) decode on node 2; node 3 serves no adapter. The monitor's trigger fires, the ILP plan moves
/// requests to node 3 — their KV by WRITEs into node 3's pages, their adapters' tensors by a
/// WRITE — and every request's tokens equal what the same adapter gives it served alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_migrate_with_their_adapters_and_answer_as_if_served_alone() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some(c) = cluster(&roles, "pd-comigrate").await else { return };
    let mesh: Arc<dyn Mesh> = c.eps[0].clone();
    let mut inbox = mesh.subscribe::<LlmMsg>(1024).unwrap();
    let cfg = c.model.config.clone();
    let adapter = |k: u32| LoraAdapter::seeded(&cfg, 8, 16.0, &Proj::ALL, u64::from(k), 0.05).unwrap();
    for k in [1, 2] {
        c.instances[0].add_adapter(k, adapter(k)).await.unwrap();
        c.instances[1].add_adapter(k, adapter(k)).await.unwrap();
    }
    assert_eq!(c.instances[2].adapters(), Vec::<u32>::new());
    const LONG: u32 = 24;
    let prompts: Vec<Vec<u32>> = expected().into_iter().map(|(p, _)| p).take(4).collect();
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let req = 200 + i as u64;
        let tokens = prompt.len() as u32 + LONG;
        let LlmMsg::Reserved { grant } =
            mesh.call(2, &LlmMsg::Reserve { req, tokens }, Duration::from_secs(30)).await.unwrap()
        else {
            panic!("no reservation")
        };
        let adapter = 1 + i as u32 % 2;
        let msg = LlmMsg::Prefill {
            req,
            attempt: 1,
            prompt: prompt.clone(),
            max_tokens: LONG,
            kv: grant,
            split: None,
            router: 0,
            adapter,
            sample: None,
        };
        let answer = mesh.call(1, &msg, Duration::from_secs(120)).await.unwrap();
        let LlmMsg::Prefilled { first, decoding: true, .. } = answer else { panic!("prefill: {answer:?}") };
        got.insert(req, vec![first]);
    }
    // Four requests on node 2, none on node 3: 2 above the average of 2.
    let r = rebalance(&mesh, &[2, 3], &rounds(&cfg), Duration::from_secs(60)).await.unwrap();
    let d = r.decision.as_ref().expect("the trigger fires");
    eprintln!(
        "trigger: {}; plan {:?} {:.1} ms (stay {:.1} ms; {:?}), solved in {:.2} ms; moves {:?}; round {:.3} s",
        d.trigger, d.source, d.objective_ms, d.stay_ms, d.solver_note, d.solve_ms, r.outcomes, r.seconds
    );
    assert!(!r.outcomes.is_empty(), "the plan moves something");
    for (m, outcome) in &r.outcomes {
        assert_eq!((m.from, m.to), (2, 3));
        let before = outcome.as_ref().unwrap_or_else(|e| panic!("request {} did not move: {e}", m.req));
        assert!(*before >= 1 && *before < LONG, "moved mid-stream ({before} tokens before)");
    }
    // A move of a request that is not decoding there fails, and its pages go back.
    let LlmMsg::Reserved { grant } =
        mesh.call(3, &LlmMsg::Reserve { req: 999, tokens: 8 }, Duration::from_secs(30)).await.unwrap()
    else {
        panic!("no reservation")
    };
    let lease = grant.lease;
    let answer = mesh.call(2, &LlmMsg::Migrate { req: 999, kv: grant }, Duration::from_secs(30)).await.unwrap();
    assert!(matches!(&answer, LlmMsg::Failed { message, .. } if message.contains("not decoding here")), "{answer:?}");
    mesh.call(3, &LlmMsg::Release { req: 999, lease }, Duration::from_secs(30)).await.unwrap();
    let moved_adapters: std::collections::BTreeSet<u32> = r.outcomes.iter().map(|(m, _)| m.adapter).collect();
    assert_eq!(c.instances[2].adapters(), moved_adapters.iter().copied().collect::<Vec<_>>(), "adapters came along");
    // Every token arrives once, in order, from whichever instance decodes the request, until
    // the request's last (its LONG-th, or the end-of-sequence token).
    let mut open: std::collections::BTreeSet<u64> = got.keys().copied().collect();
    while !open.is_empty() {
        let m = tokio::time::timeout(Duration::from_secs(120), inbox.recv())
            .await
            .unwrap_or_else(|_| panic!("no token for 120 s; still open: {open:?}"))
            .unwrap();
        match m.msg {
            LlmMsg::Token { req, index, token, done, .. } => {
                let t = got.get_mut(&req).unwrap();
                assert_eq!(index as usize, t.len(), "request {req} from node {}", m.from);
                t.push(token);
                if done {
                    open.remove(&req);
                }
            }
            LlmMsg::Abort { req, message, .. } => panic!("request {req} aborted: {message}"),
            _ => {}
        }
    }
    let text = c.eps[0].metrics().render();
    assert!(text.contains("cascade_lora_migrations_total{result=\"moved\"}"), "{text}");
    assert!(text.contains("cascade_lora_migration_solve_seconds_count"), "{text}");
    // The same requests served alone, each with its adapter, in one process.
    let mut g = Generator::from_dir(&smollm2_dir().unwrap()).unwrap();
    for k in [1, 2] {
        g.model_mut().add_adapter(k, adapter(k)).unwrap();
    }
    let mut exact = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let req = 200 + i as u64;
        let job = LoraJob { arrival: 0, adapter: i as u32 % 2, prompt: prompt.clone(), max_tokens: LONG as usize };
        let alone = serve_alone(g.model_mut(), &job, 1000 + i as u64).unwrap();
        let served = &got[&req];
        assert!(served.len() == LONG as usize || served.last() == Some(&cfg.eos_token_id));
        if let Some(step) = served.iter().zip(&alone.tokens).position(|(a, b)| a != b) {
            // Batched and alone arithmetic may only break a near-tie differently.
            assert!(
                alone.margins[step] < 0.01,
                "request {req} differs at token {step} (margin {})",
                alone.margins[step]
            );
        } else {
            exact += 1;
        }
    }
    eprintln!("{exact} of {} requests token for token equal to the request served alone", prompts.len());
    for e in &c.eps {
        e.shutdown();
    }
}

/// The router drives co-migration: four requests decode on node 2, node 3 joins as a decode
/// instance (`PdCmd::Decode`), and a `PdCmd::Rebalance` round moves requests there while they
/// stream; every answer comes back whole and equal to the reference's greedy tokens (up to the
/// first near-tie the reference recorded, where float arithmetic may break it differently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_rebalances_requests_onto_a_decode_instance_that_joined() {
    rebalance_onto_a_joined_instance(false, "pd-rebalance", None).await;
}

/// The same with sampled requests (temperature 1.1, top-p 0.95): each request's first token is
/// drawn on the prefill instance and the rest on the decode instances, a moved request's next
/// draws on the instance it moved to — and every answer equals what one process draws for the
/// same prompt, settings and index (`Generator::generate_stream`), while differing from the
/// greedy answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_requests_migrate_and_draw_what_one_process_draws() {
    let sampling = Sampling { temperature: 1.1, top_k: 0, top_p: 0.95, seed: 42 };
    rebalance_onto_a_joined_instance(false, "pd-sampled", Some(sampling)).await;
}

/// The same, but nobody asks: the router's own monitor (`PdRouterConfig::monitor`) runs the
/// rounds on its timer and moves requests to the instance that joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_monitor_rebalances_on_its_own() {
    rebalance_onto_a_joined_instance(true, "pd-monitor", None).await;
}

async fn rebalance_onto_a_joined_instance(by_monitor: bool, tag: &str, sampling: Option<Sampling>) {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some(c) = cluster(&roles, tag).await else { return };
    const LONG: u32 = 24;
    let mut cfg = router_cfg(&c, 1, vec![], vec![2]);
    if by_monitor {
        cfg.monitor = Some(MonitorConfig { every: Duration::from_millis(100), rounds: rounds(&c.model.config) });
    }
    let Routed { mesh, req_tx, cmd_tx, mut ans_rx, routing, .. } = Routed::start(&c, cfg);
    let reference = llm_reference();
    for (i, r) in reference.iter().enumerate() {
        let sample = sampling.map(|sampling| SeqSampling { sampling, index: i as u64 });
        req_tx
            .send(GenRequest {
                id: i as u64,
                prompt: r.prompt_tokens.clone(),
                max_tokens: LONG,
                adapter: 0,
                sample,
                stop: Default::default(),
                tokens: None,
            })
            .unwrap();
    }
    // Wait until all four decode on node 2.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        match mesh.call(2, &LlmMsg::Load, Duration::from_secs(10)).await.unwrap() {
            LlmMsg::Loads { requests, .. } if requests.len() == reference.len() => break,
            _ => assert!(std::time::Instant::now() < deadline, "the requests never all decoded on node 2"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cmd_tx.send(PdCmd::Decode { node: 3 }).unwrap();
    let mut moved: Vec<u64> = Vec::new();
    if !by_monitor {
        let (tx, rx) = oneshot::channel();
        cmd_tx.send(PdCmd::Rebalance { config: rounds(&c.model.config), done: tx }).unwrap();
        let r = rx.await.unwrap().unwrap();
        eprintln!("rebalance: {:?} in {:.3} s", r.outcomes, r.seconds);
        moved = r.outcomes.iter().filter(|(_, o)| o.is_ok()).map(|(m, _)| m.req).collect();
        assert!(!moved.is_empty(), "nothing moved: {:?}", r.decision);
    }
    drop(req_tx);
    let stats = routing.await.unwrap().unwrap();
    eprintln!("router: {stats:?}");
    assert_eq!((stats.answered, stats.failed), (reference.len() as u64, 0));
    let answers: Vec<GenAnswer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    if by_monitor {
        // Who moved: the requests node 3 finished.
        moved = answers.iter().filter(|a| a.decode == 3).map(|a| a.id).collect();
        assert!(stats.monitor_rounds >= 1 && stats.migrated >= 1, "the monitor moved nothing: {stats:?}");
        // (A later round may move a request back; every request on node 3 got there by a move.)
        assert!(!moved.is_empty() && moved.len() as u64 <= stats.migrated, "{moved:?} vs {stats:?}");
    } else {
        assert_eq!((stats.monitor_rounds, stats.migrated), (0, 0), "no monitor was configured");
    }
    // Sampled: what one process draws for each prompt (index i) with the same settings.
    let drawn: Option<Vec<Vec<u32>>> = sampling.map(|s| {
        let g = Generator::from_dir(&smollm2_dir().unwrap()).unwrap();
        let mut out = vec![Vec::new(); reference.len()];
        let prompts = reference.iter().map(|r| r.prompt_tokens.clone());
        let none = StopStrings::default();
        g.generate_stream(prompts, LONG as usize, Decoding::Sample(s), &none, |_, _| {}, |i, d| out[i] = d.tokens)
            .unwrap();
        out
    });
    for a in &answers {
        let want = &reference[a.id as usize];
        let tokens = a.result.as_ref().unwrap();
        if let Some(drawn) = &drawn {
            assert_eq!(tokens, &drawn[a.id as usize], "request {}: pd drew otherwise than one process", a.id);
        } else {
            let sure = want.margins.iter().position(|&m| m < 0.3).unwrap_or(want.tokens.len()).min(LONG as usize);
            assert_eq!(tokens[..sure.min(tokens.len())], want.tokens[..sure.min(tokens.len())], "request {}", a.id);
        }
        assert!(tokens.len() == LONG as usize || tokens.last() == Some(&c.model.config.eos_token_id));
        assert_eq!(a.gaps.len(), tokens.len() - 1, "every token once");
        let on = if moved.contains(&a.id) { 3 } else { 2 };
        assert_eq!(a.decode, on, "request {} finished on node {}", a.id, a.decode);
    }
    if sampling.is_some() {
        let greedy = |a: &GenAnswer| {
            let t = a.result.as_ref().unwrap();
            t[..] == reference[a.id as usize].tokens[..t.len().min(reference[a.id as usize].tokens.len())]
        };
        assert!(!answers.iter().all(greedy), "every sampled answer is the greedy one: sampling was ignored");
    }
    for e in &c.eps {
        e.shutdown();
    }
}

/// Until decode instance `node` decodes something (60 s at most).
async fn until_decoding(mesh: &Arc<dyn Mesh>, node: u32) {
    let t0 = std::time::Instant::now();
    loop {
        match mesh.call(node, &LlmMsg::Status, Duration::from_secs(10)).await {
            Ok(LlmMsg::State { running, .. }) if running > 0 => return,
            Ok(_) => {}
            other => panic!("status of node {node}: {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "nothing ever decoded on node {node}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A decode instance dies with requests decoding on it: the router redoes them elsewhere from
/// their prompts and sends nothing more there; every request is answered once, with the
/// reference tokens, and the router does not wait for tokens that cannot come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_instance_dying_mid_stream_loses_nothing() {
    // 1: prefill; 2 and 3: decode.
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some(c) = cluster(&roles, "pd-decode-dies").await else { return };
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2, 3]));
    let n = 16;
    for i in 0..n {
        r.send(i);
    }
    let Routed { mesh, want, req_tx, mut ans_rx, routing, .. } = r;
    drop(req_tx);
    // Node 3 goes once it decodes something.
    until_decoding(&mesh, 3).await;
    c.eps[3].shutdown();
    let stats = tokio::time::timeout(Duration::from_secs(120), routing)
        .await
        .expect("the router finished: it waited for no token from the dead instance")
        .unwrap()
        .unwrap();
    let answers: Vec<GenAnswer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert!(stats.requeued > 0, "a request was decoding on node 3 when it died");
    eprintln!(
        "decode died: requeued {}, answered via node 2 {}, via node 3 (before it died) {}",
        stats.requeued,
        answers.iter().filter(|a| a.decode == 2).count(),
        answers.iter().filter(|a| a.decode == 3).count()
    );
    for e in &c.eps {
        e.shutdown();
    }
}

/// A decode instance without a drain window is stopped with requests decoding on it
/// (`LlmInstance::stop_and_wait`): it aborts them to the router, which redoes them elsewhere;
/// every request is answered once, with the reference tokens; the stopped instance answers
/// nothing more and its KV and staging regions are withdrawn, while its node stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_decode_instance_hands_its_requests_back() {
    // 1: prefill; 2 and 3: decode.
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let cfg = LlmConfig { drain: Duration::ZERO, ..test_config() };
    let Some(c) = cluster_with(&roles, "pd-decode-stops", cfg).await else { return };
    let base = c.meshes[3].regions().len();
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2, 3]));
    let n = 16;
    for i in 0..n {
        r.send(i);
    }
    let Routed { mesh, want, req_tx, mut ans_rx, routing, .. } = r;
    drop(req_tx);
    until_decoding(&mesh, 3).await;
    assert!(c.meshes[3].regions().len() > base, "node 3 registered its KV region");
    c.instances[2].stop_and_wait().await;
    assert_eq!(c.meshes[3].regions().len(), base, "node 3 withdrew its regions before it said it stopped");
    let stats = tokio::time::timeout(Duration::from_secs(120), routing)
        .await
        .expect("the router finished: it waited for no token from the stopped instance")
        .unwrap()
        .unwrap();
    let answers: Vec<GenAnswer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert!(stats.requeued > 0, "a request was decoding on node 3 when it stopped");
    let gone = mesh.call(3, &LlmMsg::Status, Duration::from_secs(5)).await;
    assert!(
        matches!(gone, Err(TransportError::Service { peer: 3, fault: ServiceFault::UnknownService, .. })),
        "a stopped instance answers nothing: {gone:?}"
    );
    assert!(mesh.connected_to(3), "the node itself stays up");
    for e in &c.eps {
        e.shutdown();
    }
}

/// A decode instance told to stop with a drain window (the default; a graceful scale-in, as
/// SIGTERM to `cascade llm-instance` does) leaves: it says so to the router, which moves the
/// requests decoding there, with their KV, to the other decode instance — none is redone from
/// its prompt — and it stops once they are gone; every request is answered once, with the
/// reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_decode_instance_moves_its_requests_with_their_kv() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some(c) = cluster(&roles, "pd-decode-leaves").await else { return };
    let base = c.meshes[3].regions().len();
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2, 3]));
    let n = 16;
    (0..n).for_each(|i| r.send(i));
    until_decoding(&r.mesh, 3).await;
    let t0 = std::time::Instant::now();
    c.instances[2].stop_and_wait().await;
    let took = t0.elapsed();
    assert_eq!(c.meshes[3].regions().len(), base, "node 3 withdrew its regions before it said it stopped");
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert_eq!(stats.decode_left, 1);
    assert!(stats.drain_moved > 0, "the requests decoding on node 3 moved: {stats:?}");
    assert!(took < test_config().drain, "node 3 stopped once its requests were gone, in {took:?}");
    eprintln!(
        "decode left: {} moved in {:.2} s, {} requeued (those whose prefill was under way for node 3)",
        stats.drain_moved,
        took.as_secs_f64(),
        stats.requeued
    );
    for e in &c.eps {
        e.shutdown();
    }
}

/// A decode instance goes silent with its link up while it decodes (the mem fabric, a test
/// double, swallows everything it sends the router: a hung process, tokens lost on the way):
/// the router gives those requests up after `stall_after` without a token and redoes them; once
/// the instance speaks again every request is answered once, with the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_a_silent_decode_instance_are_redone() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let stall = Duration::from_secs(2);
    let cfg = PdRouterConfig {
        stall_after: stall,
        call_timeout: Duration::from_secs(10),
        ..router_cfg(&c, 1, vec![], vec![2, 3])
    };
    let r = Routed::start(&c, cfg);
    let n = 12;
    (0..n).for_each(|i| r.send(i));
    until_decoding(&r.mesh, 3).await;
    fabric.set_fault(3, 0, Some(cascade_transport::mem::Fault::Drop));
    tokio::time::sleep(stall + Duration::from_secs(2)).await;
    fabric.set_fault(3, 0, None);
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert!(stats.stalled > 0, "a request was decoding on the silent instance: {stats:?}");
}

/// A leaving decode instance cannot reach the other one for a moment (the mem fabric, a test
/// double, cuts their link as the drain begins): the moves fail and are tried again once it is
/// back, so its requests still move with their KV instead of being redone. The requests are
/// long enough to outlast the cut: with twelve tokens and a cut of 400 ms, those on node 3
/// sometimes finished before it ended, once decoding got faster (2026-12-05), and none moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_target_is_briefly_unreachable_tries_again() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2, 3])).asking(30);
    let n = 12;
    (0..n).for_each(|i| r.send(i));
    until_decoding(&r.mesh, 3).await;
    fabric.set_link(3, 2, false);
    c.instances[2].stop();
    tokio::time::sleep(Duration::from_millis(150)).await;
    fabric.set_link(3, 2, true);
    c.instances[2].stop_and_wait().await;
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert!(stats.drain_moved > 0, "the requests on node 3 moved once node 2 was back: {stats:?}");
    eprintln!("drain through a cut link: {} moved, {} requeued", stats.drain_moved, stats.requeued);
}

/// The only decode instance dies: the requests it was decoding, and those still to come, are
/// answered with an error once their attempts run out — the router ends, nothing waits forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_decode_instance_left_requests_fail_instead_of_waiting() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some(c) = cluster(&roles, "pd-no-decode").await else { return };
    let mut r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2]));
    r.send(0);
    // The first answer comes whole; then node 2 goes, and a second request follows.
    let first = r.ans_rx.recv().await.unwrap();
    assert_eq!(first.result.as_ref().unwrap(), &r.want[0].1);
    c.eps[2].shutdown();
    while r.mesh.connected_to(2) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    r.send(1);
    let Routed { req_tx, routing, mut ans_rx, .. } = r;
    drop(req_tx);
    let stats = tokio::time::timeout(Duration::from_secs(60), routing)
        .await
        .expect("the router finished: it did not wait for a decode instance forever")
        .unwrap()
        .unwrap();
    let second = ans_rx.recv().await.unwrap();
    let err = second.result.unwrap_err();
    assert!(err.contains("no decode instance"), "{err}");
    assert_eq!((stats.answered, stats.failed), (1, 1));
    for e in &c.eps {
        e.shutdown();
    }
}

/// A request whose prompt and output would pass the model's context window is refused at its
/// KV reservation, alone: the request beside it is answered as usual. Admitted (before
/// 2026-12-04 only the KV room bounded it), it would have failed, on reaching the window, the
/// decode step of every request batched with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_the_context_window_is_refused_alone() {
    let Some(dir) = smollm2_dir() else { return };
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let window = cascade_exec::llama::LlamaConfig::from_json(&config).unwrap().max_position_embeddings as u32;
    // KV room beyond the window, so that the window is what refuses.
    let cfg = LlmConfig { kv_pages: (window + 2).div_ceil(16), ..test_config() };
    let (c, _fabric) = mem_cluster_with(&[Some(Role::Prefill), Some(Role::Decode)], cfg).unwrap();
    let limit = Duration::from_secs(10);
    // window + 1 tokens fit (the last output token is never fed back); one more does not.
    let fits = reserve(&c, 0, 2, 1, window + 1).await;
    c.meshes[0].call(2, &LlmMsg::Release { req: 1, lease: fits.lease }, limit).await.unwrap();
    let over = c.meshes[0].call(2, &LlmMsg::Reserve { req: 2, tokens: window + 2 }, limit).await;
    let refused = matches!(&over, Ok(LlmMsg::Failed { message, retry: false }) if message.contains("context window"));
    assert!(refused, "{over:?}");
    assert_eq!(free_pages(&c, 2).await, cfg.kv_pages);
    // Through the router: the long request fails at once, the other decodes.
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2]));
    let prompt = r.want[0].0.clone();
    r.req_tx
        .send(GenRequest {
            id: 0,
            prompt: prompt.clone(),
            max_tokens: window,
            adapter: 0,
            sample: None,
            stop: Default::default(),
            tokens: None,
        })
        .unwrap();
    r.send(1);
    // "Until end of sequence": prompt + u32::MAX tokens overflowed the router's sum (a panic in
    // a debug build, a wrapped reservation of a few tokens in a release one).
    r.req_tx
        .send(GenRequest {
            id: 2,
            prompt,
            max_tokens: u32::MAX,
            adapter: 0,
            sample: None,
            stop: Default::default(),
            tokens: None,
        })
        .unwrap();
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    let answer = |id| answers.iter().find(|a| a.id == id).unwrap_or_else(|| panic!("request {id} unanswered"));
    for id in [0, 2] {
        let err = answer(id).result.as_ref().unwrap_err();
        assert!(err.contains("context window"), "request {id}: {err}");
    }
    assert_eq!(answer(1).result.as_ref().unwrap(), &want[1].1);
    assert_eq!((stats.answered, stats.failed), (1, 2));
}

/// The router's link to a decode instance fails mid-stream and comes back (a link flap; the
/// mem fabric, a test double, cuts it): the requests decoding there are redone elsewhere, and
/// once the instance's own leftover decodes are over it decodes for the router again — every
/// answer once, with the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_instance_whose_link_comes_back_decodes_again() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let mut r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2, 3]));
    let n = 8;
    (0..n).for_each(|i| r.send(i));
    // The link to node 3 fails once node 3 decodes something.
    let t0 = std::time::Instant::now();
    loop {
        match c.meshes[0].call(3, &LlmMsg::Status, Duration::from_secs(10)).await {
            Ok(LlmMsg::State { running, .. }) if running > 0 => break,
            Ok(_) => assert!(t0.elapsed() < Duration::from_secs(60), "nothing ever decoded on node 3"),
            other => panic!("status of node 3: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    fabric.set_link(0, 3, false);
    let mut answers = Vec::new();
    while answers.len() < n {
        answers.push(r.ans_rx.recv().await.unwrap());
    }
    fabric.set_link(0, 3, true);
    // Rounds of 4 until a request sent after the link came back is decoded on node 3.
    let mut sent = n;
    while !answers[n..].iter().any(|a| a.decode == 3) {
        assert!(t0.elapsed() < Duration::from_secs(120), "node 3 never decoded again after its link came back");
        (sent..sent + 4).for_each(|i| r.send(i));
        sent += 4;
        while answers.len() < sent {
            answers.push(r.ans_rx.recv().await.unwrap());
        }
    }
    let Routed { req_tx, routing, want, .. } = r;
    drop(req_tx);
    let stats = routing.await.unwrap().unwrap();
    check(&answers, sent, &want);
    assert_eq!((stats.answered, stats.failed), (sent as u64, 0));
    assert!(stats.requeued > 0, "a request was decoding on node 3 when its link failed");
    eprintln!(
        "link back: requeued {}, {} of {sent} decoded on node 3",
        stats.requeued,
        answers.iter().filter(|a| a.decode == 3).count()
    );
}

/// An instance that does not answer its calls (the mem fabric, a test double, holds what the
/// router sends it) does not hold up the router: while its follower waits on a status call and
/// a mutation waits for its answer, requests are prefilled on the old instance and their tokens
/// collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_instance_does_not_hold_up_the_router() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), None];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    // Every call to node 3 would wait out the call timeout (120 s).
    // Every call to node 3 waits out the call timeout (120 s): its request is held 300 s.
    fabric.set_fault(0, 3, Some(cascade_transport::mem::Fault::Delay(Duration::from_secs(300))));
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2]));
    r.cmd_tx.send(PdCmd::Scaling { node: 3 }).unwrap();
    let (done, _mutated) = oneshot::channel();
    r.cmd_tx.send(PdCmd::Mutate { node: 3, done }).unwrap();
    let n = 4;
    (0..n).for_each(|i| r.send(i));
    // The router answers every request while its calls to node 3 hang.
    let (stats, answers, want) = r.finish(Duration::from_secs(60)).await;
    check(&answers, n, &want);
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    assert!(answers.iter().all(|a| a.prefill.0 == 1), "node 3 holds nothing: everything prefilled on node 1");
}

/// The router's link to a decode instance fails: the instance stops decoding that router's
/// requests and frees their KV at once (the router redoes them elsewhere), instead of decoding
/// every token they had left for nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_instance_drops_the_requests_of_a_router_it_lost() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    // While node 2 is gone the redone request finds no decode instance: room for 4 s of retries.
    let r = Routed::start(&c, PdRouterConfig { max_attempts: 200, ..router_cfg(&c, 1, vec![], vec![2]) });
    let prompt = r.want[0].0.clone();
    let status = |from: usize| {
        let mesh = c.meshes[from].clone();
        async move {
            match mesh.call(2, &LlmMsg::Status, Duration::from_secs(10)).await {
                Ok(LlmMsg::State { running, free_pages, .. }) => (running, free_pages),
                other => panic!("status of node 2: {other:?}"),
            }
        }
    };
    let decoding = || async {
        let t0 = std::time::Instant::now();
        while status(0).await.0 == 0 {
            assert!(t0.elapsed() < Duration::from_secs(60), "nothing ever decoded on node 2");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    // The yardstick, under whatever load this machine has now (a debug decode step takes
    // ~120 ms alone, several times that beside the other tests): the same request decoded
    // whole with every link up, from its first step on node 2 until its pages are free.
    r.req_tx
        .send(GenRequest {
            id: 0,
            prompt: prompt.clone(),
            max_tokens: 900,
            adapter: 0,
            sample: None,
            stop: Default::default(),
            tokens: None,
        })
        .unwrap();
    decoding().await;
    let started = std::time::Instant::now();
    while status(0).await != (0, KV_PAGES) {
        assert!(started.elapsed() < Duration::from_secs(120), "the request never finished on node 2");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let whole = started.elapsed();
    let mut r = r;
    assert!(r.ans_rx.recv().await.unwrap().result.is_ok());

    r.req_tx
        .send(GenRequest {
            id: 1,
            prompt,
            max_tokens: 900,
            adapter: 0,
            sample: None,
            stop: Default::default(),
            tokens: None,
        })
        .unwrap();
    decoding().await;
    fabric.set_link(0, 2, false);
    let cut = std::time::Instant::now();
    // Asked from node 1, whose link to node 2 is up. The request stops at the next step
    // boundary: well within a third of the time decoding all of it takes (1.9 s alone in a
    // debug build; the stop took 0.11–0.15 s), where decoding the rest for nobody would take
    // nearly all of it.
    while status(1).await != (0, KV_PAGES) {
        assert!(
            cut.elapsed() < whole / 3,
            "node 2 still decodes for the router it lost after {:?} (the whole request: {whole:?}): \
             (running, free pages) {:?}",
            cut.elapsed(),
            status(1).await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("node 2 dropped the lost router's request {:?} after the cut (whole: {whole:?})", cut.elapsed());
    fabric.set_link(0, 2, true);
    let Routed { req_tx, routing, mut ans_rx, want, .. } = r;
    drop(req_tx);
    let stats = tokio::time::timeout(Duration::from_secs(120), routing).await.unwrap().unwrap().unwrap();
    let a = ans_rx.recv().await.unwrap();
    let tokens = a.result.unwrap();
    assert_eq!(tokens[..want[0].1.len()], want[0].1[..], "redone after the link came back: the reference's tokens");
    // Redone once it was lost, and again each time it found no decode instance while node 2 was
    // gone.
    assert!(stats.answered == 2 && stats.requeued >= 1, "{stats:?}");
}

/// Pages a router reserved on a decode instance for a prefill that never started there are
/// freed when that router's link fails (the router redoes the request); another router's stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_routers_reservations_are_freed() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let limit = Duration::from_secs(10);
    let free = || free_pages(&c, 2);
    // Nodes 0 and 1 each reserve pages on node 2 as a router would (64 tokens: 4 pages each).
    for (from, req) in [(0, 7), (1, 8)] {
        let r = c.meshes[from].call(2, &LlmMsg::Reserve { req, tokens: 64 }, limit).await;
        assert!(matches!(r, Ok(LlmMsg::Reserved { .. })), "{r:?}");
    }
    assert_eq!(free().await, KV_PAGES - 8);
    fabric.set_link(0, 2, false);
    let cut = std::time::Instant::now();
    // Reservations do not expire: without the drop they would be held for good. The bound only
    // keeps a broken build from waiting forever; it is generous because the other tests of this
    // binary compute beside this one on two cores.
    while free().await != KV_PAGES - 4 {
        assert!(cut.elapsed() < Duration::from_secs(5), "node 0's pages still held: {} free", free().await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("node 0's reservations freed {:?} after the cut", cut.elapsed());
}

/// Reserves `tokens` tokens of KV for `req` on node `on`, asked by node `by`.
async fn reserve(c: &Cluster, by: usize, on: u32, req: u64, tokens: u32) -> cascade_exec::pd::KvGrant {
    match c.meshes[by].call(on, &LlmMsg::Reserve { req, tokens }, Duration::from_secs(10)).await {
        Ok(LlmMsg::Reserved { grant }) => grant,
        other => panic!("reserve {req} on {on}: {other:?}"),
    }
}

/// Node `on`'s free KV pages, asked by node 1 (whose links these tests leave up).
async fn free_pages(c: &Cluster, on: u32) -> u32 {
    match c.meshes[1].call(on, &LlmMsg::Status, Duration::from_secs(10)).await {
        Ok(LlmMsg::State { free_pages, .. }) => free_pages,
        other => panic!("status of node {on}: {other:?}"),
    }
}

/// A start as the prefill instance of reservation `kv` sends it.
fn start(req: u64, kv: &cascade_exec::pd::KvGrant, crcs: Vec<u32>, prompt_len: u32) -> LlmMsg {
    LlmMsg::Start {
        req,
        attempt: 1,
        lease: kv.lease,
        crcs,
        prompt_len,
        first: 1,
        max_tokens: 2,
        router: 0,
        adapter: 0,
        sample: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redone_reservation_replaces_one_whose_release_was_lost() {
    let Some((c, _fabric)) = mem_cluster(&[Some(Role::Decode)]) else { return };
    let limit = Duration::from_secs(10);
    // The router reserves for request 7 and loses track of it (its Release never arrives);
    // redoing the request, it reserves again: granted, the first reservation's pages freed.
    let first = reserve(&c, 0, 1, 7, 64).await;
    let second = reserve(&c, 0, 1, 7, 64).await;
    assert_ne!(first.lease, second.lease);
    assert_eq!(free_pages(&c, 1).await, KV_PAGES - 4, "one reservation of 4 pages");
    // Another node cannot take it; a late Start or Release of the first does nothing.
    let other = c.meshes[1].call(1, &LlmMsg::Reserve { req: 7, tokens: 64 }, limit).await;
    assert!(matches!(&other, Ok(LlmMsg::Failed { message, .. }) if message.contains("holds KV pages")), "{other:?}");
    let late = c.meshes[0].call(1, &start(7, &first, vec![0; c.model.config.num_hidden_layers], 40), limit).await;
    assert!(matches!(&late, Ok(LlmMsg::Failed { message, .. }) if message.contains("stale")), "{late:?}");
    c.meshes[0].call(1, &LlmMsg::Release { req: 7, lease: first.lease }, limit).await.unwrap();
    assert_eq!(free_pages(&c, 1).await, KV_PAGES - 4, "a late Release frees nothing");
    c.meshes[0].call(1, &LlmMsg::Release { req: 7, lease: second.lease }, limit).await.unwrap();
    assert_eq!(free_pages(&c, 1).await, KV_PAGES);
}

/// WRITEs `data` at `offset` of `remote` from `mesh` (as a prefill or old decode instance does).
async fn write_at(mesh: &Arc<dyn Mesh>, remote: RemoteRegion, offset: u64, data: &[u8]) {
    let staging = mesh.register_new(data.len() as u64).unwrap();
    ta::write_local(&staging, 0, data).unwrap();
    for h in mesh.link(remote.node).unwrap().post(vec![Op::write(&staging, 0, remote, offset, data.len() as u64)]) {
        h.wait("test write", Duration::from_secs(10)).await.unwrap();
    }
    mesh.deregister(staging.id());
}

fn kv_remote(kv: &cascade_exec::pd::KvGrant) -> RemoteRegion {
    RemoteRegion { node: kv.node, id: RegionId(kv.region), key: RemoteKey(kv.key), len: kv.len }
}

/// Fills every block of the first `n` pages of `kv` with `byte`; each block's crc32.
async fn fill_pages(
    mesh: &Arc<dyn Mesh>,
    layout: KvLayout,
    kv: &cascade_exec::pd::KvGrant,
    n: usize,
    byte: u8,
) -> Vec<u32> {
    let page = vec![byte; layout.block_page_bytes() as usize];
    let mut crc = crc32fast::Hasher::new();
    for p in 0..n {
        crc.update(&page);
        for b in 0..layout.blocks {
            write_at(mesh, kv_remote(kv), layout.offset(kv.pages[p], b), &page).await;
        }
    }
    vec![crc.finalize(); layout.blocks]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_bytes_in_a_requests_pages_make_its_start_fail_instead_of_decoding() {
    let Some((c, _fabric)) = mem_cluster(&[Some(Role::Decode)]) else { return };
    let limit = Duration::from_secs(10);
    let layout = KvLayout::new(&c.model.config, 16);
    let prompt_len = 20u32;
    let n = layout.pages_for(prompt_len as usize);
    // Node 1 plays the prefill instance, WRITEing every block's pages.
    for (req, stale) in [(1u64, true), (2, false)] {
        let kv = reserve(&c, 0, 1, req, 40).await;
        let crcs = fill_pages(&c.meshes[1], layout, &kv, n, 0).await;
        if stale {
            // An abandoned writer's late WRITE lands in one of the pages.
            let foreign = vec![0x5a; layout.block_page_bytes() as usize];
            write_at(&c.meshes[1], kv_remote(&kv), layout.offset(kv.pages[n - 1], 7), &foreign).await;
        }
        let r = c.meshes[1].call(1, &start(req, &kv, crcs, prompt_len), limit).await.unwrap();
        if stale {
            assert!(
                matches!(&r, LlmMsg::Failed { message, retry: true } if message.contains("block 7's KV pages hold other bytes")),
                "{r:?}"
            );
            assert_eq!(free_pages(&c, 1).await, KV_PAGES, "the refused reservation's pages went back");
            let text = c.meshes[1].metrics().render();
            assert!(text.contains("cascade_llm_kv_refused_total{reason=\"foreign\"} 1"), "{text}");
        } else {
            assert_eq!(r, LlmMsg::Ack, "the same pages with the written bytes start");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_adapter_image_with_foreign_bytes_is_refused() {
    let Some((c, _fabric)) = mem_cluster(&[Some(Role::Decode)]) else { return };
    let limit = Duration::from_secs(10);
    let layout = KvLayout::new(&c.model.config, 16);
    let image = LoraAdapter::seeded(&c.model.config, 8, 16.0, &Proj::ALL, 5, 0.05).unwrap().to_image().unwrap();
    let written = Written { bytes: image.len() as u64, crc: crc32fast::hash(&image) };
    // Node 1 plays the old decode instance of request 3 (adapter 5, 20 tokens so far).
    for (req, foreign) in [(3u64, true), (4, false)] {
        let kv = reserve(&c, 0, 1, req, 40).await;
        let crcs = fill_pages(&c.meshes[1], layout, &kv, layout.pages_for(20), 0).await;
        let grant = match c.meshes[1].call(1, &LlmMsg::ReserveAdapter { adapter: 5, bytes: written.bytes }, limit).await
        {
            Ok(LlmMsg::AdapterGrant { grant }) => grant,
            other => panic!("adapter grant: {other:?}"),
        };
        let remote =
            RemoteRegion { node: grant.node, id: RegionId(grant.region), key: RemoteKey(grant.key), len: grant.len };
        let mut bytes = image.clone();
        if foreign {
            bytes[image.len() / 2] ^= 1;
        }
        write_at(&c.meshes[1], remote, 0, &bytes).await;
        let resume = LlmMsg::Resume {
            req,
            attempt: 1,
            lease: kv.lease,
            crcs,
            pos: 20,
            last: 1,
            generated: 1,
            max_tokens: 2,
            router: 0,
            adapter: 5,
            adapter_image: Some(written),
            sample: None,
        };
        let r = c.meshes[1].call(1, &resume, limit).await.unwrap();
        if foreign {
            assert!(
                matches!(&r, LlmMsg::Failed { message, .. } if message.contains("adapter 5's image holds other bytes")),
                "{r:?}"
            );
            assert_eq!(c.instances[0].adapters(), Vec::<u32>::new(), "nothing installed");
            let text = c.meshes[1].metrics().render();
            assert!(text.contains("cascade_llm_kv_refused_total{reason=\"adapter\"} 1"), "{text}");
        } else {
            assert_eq!(r, LlmMsg::Ack);
            assert_eq!(c.instances[0].adapters(), vec![5]);
        }
    }
}

/// The router gives up on prefills whose calls are held past its timeout (the mem fabric, a test
/// double, delays the first two) and redoes them, while node 1 still runs them later: their
/// late WRITEs and Starts, under leases released meanwhile, touch nothing of the redone requests.
/// Every answer is the reference's and comes once, both late Starts are refused, and no KV page
/// is left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefills_the_router_gave_up_on_harm_nothing() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    // Held a little past the router's timeout, they arrive while the redone requests hold
    // their new reservations (reserved at once, decoding 12 tokens).
    let timeout = Duration::from_secs(6);
    let held = timeout + Duration::from_millis(200);
    fabric.set_fault(0, 1, Some(cascade_transport::mem::Fault::DelayNext(2, held)));
    let cfg = PdRouterConfig { call_timeout: timeout, ..router_cfg(&c, 1, vec![], vec![2]) };
    let r = Routed::start(&c, cfg);
    let n = 2;
    (0..n).for_each(|i| r.send(i));
    let (stats, answers, want) = r.finish(Duration::from_secs(180)).await;
    check(&answers, n, &want);
    assert!(answers.iter().all(|a| a.attempts >= 2), "each first attempt was given up: {answers:?}");
    assert_eq!((stats.answered, stats.failed), (n as u64, 0));
    // The held prefills run once their calls arrive, and their Starts are refused.
    let t0 = std::time::Instant::now();
    let stale = loop {
        let text = c.meshes[2].metrics().render();
        let line =
            text.lines().find(|l| l.starts_with("cascade_llm_kv_refused_total{reason=\"stale\"}")).map(String::from);
        if line.as_deref().is_some_and(|l| l.ends_with(&format!(" {n}"))) || t0.elapsed() > Duration::from_secs(120) {
            break line;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(stale, Some(format!("cascade_llm_kv_refused_total{{reason=\"stale\"}} {n}")));
    assert_eq!(free_pages(&c, 2).await, KV_PAGES, "no page is left held");
}

/// The router gives up on an attempt after its prefill started decoding (its call's answer was
/// late): the `Release` of that started lease stops the decode between two steps and frees its
/// pages, another request decoding beside it is untouched, and the request redone on the same
/// instance decodes once, with the reference tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_a_started_attempt_stops_its_decode_and_nothing_else() {
    let Some((c, _fabric)) = mem_cluster(&[Some(Role::Prefill), Some(Role::Decode)]) else { return };
    let limit = Duration::from_secs(60);
    let want = expected();
    let mut inbox = c.meshes[0].subscribe::<LlmMsg>(4096).unwrap();
    // Node 0 routes: reserves on node 2, prefills on node 1, takes the tokens.
    let go = |req: u64, which: usize, max_tokens: u32| {
        let (mesh, prompt) = (c.meshes[0].clone(), want[which].0.clone());
        async move {
            let tokens = prompt.len() as u32 + max_tokens;
            let kv = match mesh.call(2, &LlmMsg::Reserve { req, tokens }, limit).await {
                Ok(LlmMsg::Reserved { grant }) => grant,
                other => panic!("reserve {req}: {other:?}"),
            };
            let lease = kv.lease;
            let msg = LlmMsg::Prefill {
                req,
                attempt: 1,
                prompt,
                max_tokens,
                kv,
                split: None,
                router: 0,
                adapter: 0,
                sample: None,
            };
            match mesh.call(1, &msg, limit).await {
                Ok(LlmMsg::Prefilled { first, decoding: true, .. }) => (lease, first),
                other => panic!("prefill {req}: {other:?}"),
            }
        }
    };
    let (x, y) = (10u64, 11u64);
    let (x_lease, _) = go(x, 0, 600).await;
    c.meshes[0].call(2, &LlmMsg::Release { req: x, lease: x_lease }, limit).await.unwrap();
    let (_, y_first) = go(y, 1, MAX_TOKENS).await;
    // Y decodes to its end; X stops at the next step boundary (a step in flight may still give
    // a token or two; its answer has at least MAX_TOKENS before its end).
    let mut y_tokens = vec![y_first];
    let mut x_after = 0;
    let t0 = std::time::Instant::now();
    loop {
        let m = tokio::time::timeout(limit, inbox.recv()).await.expect("tokens keep coming").unwrap();
        match m.msg {
            LlmMsg::Token { req, .. } if req == x => x_after += 1,
            LlmMsg::Token { req, token, done, .. } if req == y => {
                y_tokens.push(token);
                if done {
                    break;
                }
            }
            LlmMsg::Abort { req, message, .. } => panic!("request {req} aborted: {message}"),
            _ => {}
        }
    }
    assert_eq!(y_tokens, want[1].1, "the request beside it decodes the reference tokens");
    assert!(x_after <= 3, "X decoded {x_after} tokens after its Release");
    loop {
        match c.meshes[0].call(2, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { running: 0, free_pages, .. }) if free_pages == KV_PAGES => break,
            Ok(state) => assert!(t0.elapsed() < Duration::from_secs(60), "X still decodes: {state:?}"),
            other => panic!("status: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Redone on the same instance, X decodes once, from its new lease.
    while inbox.try_recv().is_some() {}
    let (_, x_first) = go(x, 0, MAX_TOKENS).await;
    let mut x_tokens = vec![x_first];
    loop {
        let m = tokio::time::timeout(limit, inbox.recv()).await.expect("tokens keep coming").unwrap();
        match m.msg {
            LlmMsg::Token { req, index, token, done, .. } if req == x => {
                assert_eq!(index as usize, x_tokens.len(), "each token once, in order");
                x_tokens.push(token);
                if done {
                    break;
                }
            }
            LlmMsg::Abort { req, message, .. } => panic!("request {req} aborted: {message}"),
            _ => {}
        }
    }
    assert_eq!(x_tokens, want[0].1);
}

/// While the router serves request 5 on decode node 3, a decode of an attempt it does not wait
/// for streams request 5's tokens from node 2 (as a prefill whose call the router gave up on, and
/// whose `Release` was lost, would start it; here its KV is zeros, so its tokens are garbage), and
/// an abort of such an attempt arrives. Neither touches the answer: the request is answered once,
/// with the reference tokens, from node 3, in one attempt; and the stale decode on node 2 is
/// stopped by the router long before its 600 tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_of_an_attempt_given_up_on_streams_nothing_into_the_answer_and_is_stopped() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let limit = Duration::from_secs(10);
    // Its prefill is held a second: the stale decode streams before the real one does.
    fabric.set_fault(0, 1, Some(cascade_transport::mem::Fault::DelayNext(1, Duration::from_secs(1))));
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![3]));
    r.send(5);
    // The stale attempt: pages reserved on node 2 by the router's node, zeros written, started.
    let layout = KvLayout::new(&c.model.config, 16);
    let prompt_len = 20u32;
    let kv = reserve(&c, 0, 2, 5, prompt_len + 600).await;
    let crcs = fill_pages(&c.meshes[1], layout, &kv, layout.pages_for(prompt_len as usize), 0).await;
    let stale = LlmMsg::Start {
        req: 5,
        attempt: 0,
        lease: kv.lease,
        crcs,
        prompt_len,
        first: 1,
        max_tokens: 600,
        router: 0,
        adapter: 0,
        sample: None,
    };
    assert_eq!(c.meshes[1].call(2, &stale, limit).await.unwrap(), LlmMsg::Ack);
    let abort = LlmMsg::Abort { req: 5, attempt: 0, message: "a stale decode failed".into() };
    c.meshes[2].post_oneway(0, &abort).unwrap();
    let started = std::time::Instant::now();
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    let [a] = &answers[..] else { panic!("one answer: {answers:?}") };
    assert_eq!(a.result.as_ref().unwrap(), &want[5 % want.len()].1, "the reference tokens");
    assert_eq!((a.decode, a.attempts), (3, 1), "decoded on node 3, in one attempt");
    assert_eq!((stats.answered, stats.requeued), (1, 0), "{stats:?}");
    assert!(stats.stale_tokens >= 1, "{stats:?}");
    // The router's node shows them in its metrics.
    let text = c.meshes[0].metrics().render();
    let line = |name: &str| text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name}: {text}"));
    assert_eq!(
        line("cascade_llm_router_requests_total{outcome=\"answered\"}"),
        "cascade_llm_router_requests_total{outcome=\"answered\"} 1"
    );
    assert_eq!(line("cascade_llm_router_pending"), "cascade_llm_router_pending{} 0.0");
    let stale: u64 = line("cascade_llm_router_stale_tokens_total").rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(stale, stats.stale_tokens);
    // Told to stop, node 2 gives its pages back well before its 600 tokens would have ended.
    loop {
        match c.meshes[1].call(2, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { running: 0, free_pages, .. }) if free_pages == KV_PAGES => break,
            Ok(state) => {
                // (Not told, it ran its 600 tokens: 47 s in a debug build.)
                assert!(started.elapsed() < Duration::from_secs(15), "the stale decode goes on: {state:?}")
            }
            other => panic!("status: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The decode of the router's attempt aborts before the attempt's prefill has answered (the
/// abort here is sent by the test, while the mem fabric holds the router's prefill call a
/// second): the request is redone once, when that answer comes, and answered once with the
/// reference tokens; the aborted attempt's pages on the decode instance all come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_before_its_prefill_answered_redoes_the_request_once() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    fabric.set_fault(0, 1, Some(cascade_transport::mem::Fault::DelayNext(1, Duration::from_secs(1))));
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2]));
    r.send(2);
    // Its reservation on node 2 shows that attempt 1 was dispatched.
    while free_pages(&c, 2).await == KV_PAGES {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let abort = LlmMsg::Abort { req: 2, attempt: 1, message: "a decode step failed".into() };
    c.meshes[2].post_oneway(0, &abort).unwrap();
    let (stats, answers, want) = r.finish(Duration::from_secs(120)).await;
    check(&answers, 1, &want);
    assert_eq!((answers[0].attempts, stats.requeued), (2, 1), "{stats:?}");
    let t0 = std::time::Instant::now();
    while free_pages(&c, 2).await != KV_PAGES {
        assert!(t0.elapsed() < Duration::from_secs(15), "the aborted attempt's pages stay held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `Release` of a decoding request arrives while the request is being handed over to another
/// decode instance (the mem fabric holds the hand-over's KV WRITEs a second), and the hand-over
/// then fails (the new instance refuses its `Resume`: the lease it names was released there).
/// The request does not decode on where it was: it stops, and its pages come back.
/// (Its KV is zeros, written by the test as a prefill instance would: it decodes garbage.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_during_a_failed_hand_over_still_stops_the_request() {
    let roles = [Some(Role::Prefill), Some(Role::Decode), Some(Role::Decode)];
    let Some((c, fabric)) = mem_cluster(&roles) else { return };
    let limit = Duration::from_secs(60);
    let _inbox = c.meshes[0].subscribe::<LlmMsg>(4096).unwrap();
    // A request decoding on node 2 from zeroed KV (garbage tokens, but no early end: 600 steps).
    let (req, max_tokens, prompt_len) = (20u64, 600u32, 20u32);
    let kv = reserve(&c, 0, 2, req, prompt_len + max_tokens).await;
    let layout = KvLayout::new(&c.model.config, 16);
    let crcs = fill_pages(&c.meshes[1], layout, &kv, layout.pages_for(prompt_len as usize), 0).await;
    let lease = kv.lease;
    let go = LlmMsg::Start {
        req,
        attempt: 1,
        lease,
        crcs,
        prompt_len,
        first: 1,
        max_tokens,
        router: 0,
        adapter: 0,
        sample: None,
    };
    assert_eq!(c.meshes[1].call(2, &go, limit).await.unwrap(), LlmMsg::Ack);
    // Pages on node 3 whose lease is gone: the Resume there will be refused.
    let there = reserve(&c, 0, 3, req, 700).await;
    c.meshes[0].call(3, &LlmMsg::Release { req, lease: there.lease }, limit).await.unwrap();
    fabric.set_fault(2, 3, Some(cascade_transport::mem::Fault::DelayNext(1, Duration::from_secs(1))));
    let mesh = c.meshes[0].clone();
    let migrating = tokio::spawn(async move { mesh.call(2, &LlmMsg::Migrate { req, kv: there }, limit).await });
    // Wait until it is away (no longer among the requests node 2 decodes, but still counted as
    // running: it may come back), then release it.
    let t0 = std::time::Instant::now();
    loop {
        let loads = c.meshes[1].call(2, &LlmMsg::Load, limit).await.unwrap();
        let state = c.meshes[1].call(2, &LlmMsg::Status, limit).await.unwrap();
        match (&loads, &state) {
            (LlmMsg::Loads { requests, .. }, LlmMsg::State { running: 1, .. }) if requests.is_empty() => break,
            _ => assert!(t0.elapsed() < Duration::from_secs(30), "never handed over: {loads:?} {state:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.meshes[0].call(2, &LlmMsg::Release { req, lease }, limit).await.unwrap();
    let r = migrating.await.unwrap().unwrap();
    assert!(matches!(&r, LlmMsg::Failed { message, .. } if message.contains("holds no KV pages")), "{r:?}");
    // Stopped: nothing decodes on node 2 and its pages are all free.
    let t0 = std::time::Instant::now();
    loop {
        match c.meshes[1].call(2, &LlmMsg::Status, limit).await.unwrap() {
            LlmMsg::State { running: 0, free_pages, .. } if free_pages == KV_PAGES => break,
            // (Before the fix it decoded its 600 tokens here again.)
            state => assert!(t0.elapsed() < Duration::from_secs(5), "it decodes again: {state:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Prefill node 3's link is up but it runs no `llm` service (its instance is restarting): its
/// first prefill is refused with "no such service" and the router stops sending there; once an
/// instance runs there again it prefills again — with no link flap to tell the router, which
/// keeps asking it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_that_runs_an_instance_again_prefills_again() {
    let Some((mut c, fabric)) = mem_cluster(&[Some(Role::Prefill), Some(Role::Decode)]) else { return };
    c.meshes.push(Arc::new(fabric.add_node(3)));
    let mut r = Routed::start(&c, router_cfg(&c, 1, vec![3], vec![2]));
    let mut answers = Vec::new();
    r.round(4, &mut answers).await;
    assert!(answers.iter().all(|a| a.prefill.0 == 1), "node 3 runs nothing: {answers:?}");
    let (_, file) = PdModel::from_dir(&smollm2_dir().unwrap()).unwrap();
    c.instances.push(instance(&c.meshes[3], &c.model, &file, Some(Role::Prefill)));
    let t0 = std::time::Instant::now();
    while !answers[4..].iter().any(|a| a.prefill.0 == 3) {
        assert!(t0.elapsed() < Duration::from_secs(90), "node 3 never prefilled again");
        r.round(4, &mut answers).await;
    }
    let (stats, rest, want) = r.finish(Duration::from_secs(120)).await;
    answers.extend(rest);
    check(&answers, answers.len(), &want);
    assert_eq!(stats.failed, 0);
}

/// Requests with stop strings (`"."`, `"Elwes"`) through the router: each is answered with the
/// reference's tokens up to the first whose text completes one — found here by decoding the
/// whole answer so far, not the router's tail — or all of them where none does, with `stopped`
/// saying which; the decode instance is told to stop each stopped one (a token or two past the
/// stop at most, of 30 it would decode) and ends with every KV page free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_requests_at_the_router_and_their_decodes() {
    let roles = [Some(Role::Prefill), Some(Role::Decode)];
    let Some((c, _fabric)) = mem_cluster(&roles) else { return };
    const ASKED: u32 = 30;
    let r = Routed::start(&c, router_cfg(&c, 1, vec![], vec![2])).asking(ASKED);
    let stop = StopStrings::new(vec![".".into(), "Elwes".into()]).unwrap();
    let tokenizer = c.model.tokenizer.clone();
    let cut = |t: &[u32]| {
        let holds = |n: usize| {
            let text = tokenizer.decode(&t[..=n], false).unwrap();
            stop.strings().iter().any(|s| text.contains(s.as_str()))
        };
        (0..t.len()).find(|&n| holds(n)).map_or((t.to_vec(), false), |n| (t[..=n].to_vec(), true))
    };
    let want: Vec<(Vec<u32>, bool)> = r.want.iter().map(|(_, t)| cut(t)).collect();
    let n = 2 * want.len();
    for i in 0..n {
        let prompt = r.want[i % want.len()].0.clone();
        let req = GenRequest {
            id: i as u64,
            prompt,
            max_tokens: ASKED,
            adapter: 0,
            sample: None,
            stop: stop.clone(),
            tokens: None,
        };
        r.req_tx.send(req).unwrap();
    }
    let mesh = r.mesh.clone();
    let (stats, answers, _) = r.finish(Duration::from_secs(300)).await;
    assert_eq!(answers.len(), n);
    for a in &answers {
        let (tokens, stopped) = &want[a.id as usize % want.len()];
        assert_eq!((a.result.as_ref().unwrap(), a.stopped), (tokens, *stopped), "request {}", a.id);
    }
    let stopped = want.iter().filter(|w| w.1).count() as u64 * 2;
    assert!(stopped > 0 && stopped < n as u64, "the prompts should include stopped and unstopped ones: {want:?}");
    assert_eq!(stats.stopped, stopped);
    assert!(stats.stale_tokens <= 2 * stopped, "{} tokens decoded past the stops", stats.stale_tokens);
    let t0 = std::time::Instant::now();
    loop {
        match mesh.call(2, &LlmMsg::Status, Duration::from_secs(10)).await {
            Ok(LlmMsg::State { running: 0, free_pages, .. }) if free_pages == KV_PAGES => break,
            Ok(_) => {}
            other => panic!("status of node 2: {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "node 2 never freed every page");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
