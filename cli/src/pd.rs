//! `cascade pd`: LLM serving with prefill/decode disaggregation, for real, on one machine — the
//! SmolLM2-135M model in four instance processes on loopback (two prefill instances and a decode
//! one holding copies, and a fourth started empty), and this process as the router. A burst of
//! generation requests arrives; in its middle one prefill instance mutates into a decode one and
//! the empty instance is scaled out by multicast from the other prefill instance, serving its
//! first layers cooperatively while the rest arrives. Every answer is checked against
//! single-process generation, greedy or, with `--temperature`, sampled alike; TTFT and the gaps
//! between tokens are measured per request;
//! `report.json` goes to `--out`. With `--kill-decode-at-s`, the first decode instance's process
//! is killed (SIGKILL) after the mutation: the router redoes the requests it was decoding on the
//! mutated instance, and still none is lost; with `--replace-lost-decode` as well, the router
//! then turns a prefill instance into a decode one in its place once one can be spared.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_exec::llama::generate::Generator;
use cascade_exec::llama::sample::Decoding;
use cascade_exec::llama::stop::StopStrings;
use cascade_exec::pd::kv::KvLayout;
use cascade_exec::pd::migrate::RebalanceConfig;
use cascade_exec::pd::proto::{LlmMsg, SeqSampling};
use cascade_exec::pd::router::{self, GenAnswer, GenRequest, MonitorConfig, PdCmd, PdRouterConfig};
use cascade_exec::pd::{LlmConfig, LlmInstance, PdModel, Role};
use cascade_exec::serve::{load_packed, scale_out, Source};
use cascade_multicast::cluster::{Controller, MulticastNode};
use cascade_multicast::Topology;
use cascade_sched::lora::dispatch::ClusterConfig;
use cascade_sched::lora::CostModel;
use cascade_transport::{Mesh, ServiceExt};
use clap::{Args, ValueEnum};
use tokio::sync::{mpsc, oneshot};

use crate::Member;

const SECRET: &str = "cascade-pd";
/// Nodes: 1 and 2 prefill (held copies), 3 decode (held), 4 prefill arriving by multicast.
const OLD: u32 = 1;
const MUTATES: u32 = 2;
const DECODE: u32 = 3;
const NEW: u32 = 4;

/// An instance's role on the command line.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum RoleArg {
    /// Prefill prompts and move their KV to decode instances.
    Prefill,
    /// Decode requests whose KV arrives.
    Decode,
}

/// `cascade llm-instance`'s options.
#[derive(Args)]
pub(crate) struct LlmInstanceArgs {
    #[command(flatten)]
    member: Member,
    /// The model directory (`cascade model import --gguf` writes one).
    #[arg(long)]
    model: PathBuf,
    /// What it does first.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// Start without a copy: it arrives by multicast.
    #[arg(long)]
    arriving: bool,
    /// Pin the compute thread to this core.
    #[arg(long)]
    core: Option<usize>,
    /// On SIGTERM/SIGINT a decode instance keeps decoding this many seconds at most while the
    /// routers move its requests, with their KV, to other decode instances; what is left then is
    /// aborted and redone from its prompt. 0: abort at once.
    #[arg(long, default_value_t = 10.0, value_parser = crate::seconds)]
    drain_s: f64,
    /// The longest prompt it prefills, in tokens (sizes its KV staging region: about 46 KB a
    /// token for SmolLM2-135M).
    #[arg(long, default_value_t = LlmConfig::default().max_prompt, value_parser = clap::value_parser!(u32).range(1..=MAX_PROMPT as i64))]
    max_prompt: u32,
}

/// The longest prompt an instance may be told to take: a decode instance's KV region's tokens.
pub(crate) const MAX_PROMPT: u32 = 4096;

/// Runs an LLM instance until SIGINT/SIGTERM, then stops it gracefully
/// ([`crate::stop_gracefully`]).
pub(crate) async fn instance(a: LlmInstanceArgs) -> anyhow::Result<()> {
    let (model, file) = PdModel::from_dir(&a.model).with_context(|| format!("reading {}", a.model.display()))?;
    let role = match a.role {
        RoleArg::Prefill => Role::Prefill,
        RoleArg::Decode => Role::Decode,
    };
    let cfg = LlmConfig {
        core: a.core,
        drain: Duration::from_secs_f64(a.drain_s),
        max_prompt: a.max_prompt,
        ..LlmConfig::default()
    };
    let mut held = None;
    let ep = crate::join_with(&a.member, false, |ep| {
        let mesh: Arc<dyn Mesh> = ep.clone();
        let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(30))?;
        let source =
            if a.arriving { Source::Arriving } else { Source::Held(load_packed(&*mesh, &model.manifest, &file)?) };
        held = Some(LlmInstance::start(mesh, model.clone(), source, mc, role, cfg)?);
        Ok(())
    })
    .await?;
    tracing::info!(node = a.member.node, arriving = a.arriving, "llm instance serving");
    crate::shutdown_signal().await;
    if let Some(i) = &held {
        // The drain window, and then the time to finish what it holds.
        let grace = crate::GRACE.max(Duration::from_secs_f64(a.drain_s) + Duration::from_secs(30));
        crate::stop_gracefully(a.member.node, grace, i.stop_and_wait()).await;
    }
    ep.leave().await;
    drop(held);
    Ok(())
}

/// `cascade pd`'s options.
#[derive(Args)]
pub(crate) struct PdArgs {
    /// The model directory; imported from the GGUF (fetched with scripts/fetch-smollm2.sh) when
    /// missing.
    #[arg(long, default_value = crate::models::SMOLLM2)]
    model: PathBuf,
    /// A file of prompts, one per line, for the burst to cycle through instead of its six
    /// built-in ones (an empty line, or one longer than the context window, is refused naming
    /// it). Each is generated once in one process first: the reference every answer is checked
    /// against.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Requests in the burst.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Their rate, requests/s (open loop).
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Tokens each request generates at most.
    #[arg(long, default_value_t = 24)]
    max_tokens: u32,
    /// Seconds into the burst when the mutation and the scale-out begin.
    #[arg(long, default_value_t = 2.0, value_parser = crate::seconds)]
    scale_after_s: f64,
    /// Where report.json and the node logs go.
    #[arg(long, default_value = "target/pd")]
    out: PathBuf,
    /// Run the router's co-migration monitor every this many milliseconds (dLoRA §5: a decode
    /// instance's requests move with their KV to a less loaded one); 0: no monitor.
    #[arg(long, default_value_t = 0)]
    rebalance_every_ms: u64,
    /// Kill the decode instance (node 3) with SIGKILL this many seconds into the burst, after
    /// the mutation gave the burst a second decode instance (so it must be later than
    /// `--scale-after-s`) — or, if it decodes nothing then, once it decodes a request (60 s at
    /// most); its requests are redone from their prompts.
    #[arg(long, conflicts_with = "stop_decode_at_s", value_parser = crate::seconds)]
    kill_decode_at_s: Option<f64>,
    /// Stop the decode instance (node 3) with SIGTERM this many seconds into the burst, after
    /// the mutation (a graceful scale-in) — or, if it decodes nothing then, once it decodes a
    /// request (60 s at most): it leaves, the router moves the requests it decodes, with their
    /// KV, to the mutated instance, and it exits.
    #[arg(long, value_parser = crate::seconds)]
    stop_decode_at_s: Option<f64>,
    /// Replace a lost decode instance: the router turns a prefill instance into a decode one
    /// once one holding every stage can be spared (after the scale-out). Off by default: on this
    /// demo it lowered the kill runs' TTFT p99 a little and raised their p50 (README).
    #[arg(long)]
    replace_lost_decode: bool,
    /// Sampled requests: request N's n-th token is drawn from the seed, N and n wherever it is
    /// computed (prefill instance, decode instance, after a move), so the reference is one
    /// process drawing for the same requests.
    #[command(flatten)]
    sampling: crate::generate::SamplingArgs,
    /// End a request at the first token whose text completes this string (the router reads the
    /// tokens as they stream and tells the decode instance to stop); repeat for several. The
    /// reference ends its answers alike.
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of",
];

/// The most requests a burst may hold.
const MAX_REQUESTS: usize = 1_000_000;

/// Runs the demonstration.
pub(crate) fn run(a: PdArgs) -> anyhow::Result<()> {
    if a.requests == 0 || a.max_tokens == 0 || !a.rate.is_finite() || a.rate <= 0.0 {
        bail!("--requests, --max-tokens and --rate must be positive");
    }
    // Every answer, with its token gaps and a report row, is kept for the report (and at this
    // machine's few requests per second a burst of more would last days).
    if a.requests > MAX_REQUESTS {
        bail!("--requests {}: at most {MAX_REQUESTS} (each answer is kept for the report)", a.requests);
    }
    if let Some(k) = a.kill_decode_at_s.or(a.stop_decode_at_s).filter(|&k| !(k.is_finite() && k > a.scale_after_s)) {
        bail!(
            "--kill-decode-at-s / --stop-decode-at-s {k} must come after --scale-after-s {}: until the mutation node \
             {DECODE} is the only decode instance",
            a.scale_after_s
        );
    }
    let decoding = a.sampling.decoding()?;
    let stops = StopStrings::new(a.stop.clone()).context("--stop")?;
    crate::models::ensure_smollm2(&a.model)?;
    std::fs::create_dir_all(&a.out)?;
    let model_dir = std::fs::canonicalize(&a.model)?;
    let out = std::fs::canonicalize(&a.out)?;
    let g = Generator::from_dir(&model_dir)?;
    let prompts = crate::generate::prompts_to_cycle(a.prompt_file.as_deref(), &PROMPTS, &g)?;
    // A request must fit one decode instance's KV (and so the model's window): refused here, not
    // after a reference run of minutes whose every request the instances would then refuse.
    let kv = LlmConfig::default();
    let room = kv.kv_pages * kv.page_tokens;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as u32;
    if longest.saturating_add(a.max_tokens) > room {
        bail!(
            "--max-tokens {}: with the longest prompt's {longest} tokens a request needs more than a decode \
             instance's {room} tokens of KV; at most {}",
            a.max_tokens,
            room.saturating_sub(longest)
        );
    }
    // Greedy: one answer per prompt (request N answers prompt N mod their number). Sampled: one
    // per request, each drawn as request N draws.
    let reference: Vec<Vec<u32>> = match decoding {
        Decoding::Greedy => prompts.clone(),
        Decoding::Sample(_) => (0..a.requests).map(|i| prompts[i % prompts.len()].clone()).collect(),
    };
    println!(
        "single-process {} reference for {} …",
        crate::generate::described(decoding),
        match decoding {
            Decoding::Greedy => crate::count(prompts.len(), "prompt", "prompts"),
            Decoding::Sample(_) => crate::count(reference.len(), "request", "requests"),
        }
    );
    // A prompt file's many prompts take minutes: counted on a bar on stderr (drawn on a terminal).
    let bar = indicatif::ProgressBar::new(reference.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("reference {bar:30} {pos}/{len}, {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut expected = Reference { decoding, stops, answers: vec![Vec::new(); reference.len()] };
    g.generate_stream(
        reference.iter().cloned(),
        a.max_tokens as usize,
        decoding,
        &expected.stops,
        |_, _| {},
        |i, o| {
            bar.inc(1);
            expected.answers[i] = o.tokens;
        },
    )?;
    bar.finish_and_clear();
    // What the router needs of the model, taken from the reference's load (not read again).
    let model = PdModel {
        config: g.model().config().clone(),
        manifest: Arc::new(g.manifest().clone()),
        tokenizer: Arc::new(g.tokenizer().clone()),
    };
    drop(g);

    let addrs = cascade_devcluster::free_addrs(5);
    if addrs.len() != 5 {
        bail!("could not reserve 5 loopback ports");
    }
    let cluster = crate::demo::write_cluster(&out, &addrs, &out)?;
    let roles: Vec<(u32, Role, bool)> =
        (1..=4u32).map(|node| (node, if node == DECODE { Role::Decode } else { Role::Prefill }, node == NEW)).collect();
    let children = spawn_instances(&cluster, &model_dir, &out, &roles, &[])?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let children = std::sync::Mutex::new(children);
    let decode_stopped = std::sync::atomic::AtomicBool::new(false);
    // SIGKILL (a crash), or SIGTERM (a scale-in) when `graceful`.
    let kill_decode = |graceful: bool| -> anyhow::Result<()> {
        decode_stopped.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut c = children.lock().map_err(|_| anyhow::anyhow!("the instance list is poisoned"))?;
        let c = &mut c[DECODE as usize - 1];
        if !graceful {
            return c.kill().context("killing the decode instance");
        }
        if !cascade_devcluster::process::terminate(c).context("SIGTERM to the decode instance")? {
            bail!("the decode instance exited before it was stopped");
        }
        Ok(())
    };
    // An instance that exits on its own ends the run at once, saying why: the router would
    // otherwise wait out its mesh timeout (120 s) and blame the connection.
    let watch = crate::live::watch_nodes(&out, || {
        let mut c = children.lock().unwrap_or_else(|e| e.into_inner());
        let stopped = decode_stopped.load(std::sync::atomic::Ordering::Relaxed);
        cascade_devcluster::process::first_exited_of(&mut c, |i| !(stopped && i == DECODE as usize - 1))
    });
    let res = rt.block_on(async {
        tokio::select! {
            r = drive(&a, &cluster, &model, &prompts, &expected, &out, &kill_decode) => r,
            e = watch => Err(e),
        }
    });
    crate::demo::stop_nodes(children.into_inner().unwrap_or_else(|e| e.into_inner()), &out);
    res
}

/// Starts an LLM instance process (`cascade llm-instance`) for each of `nodes` — its node id,
/// role, and whether its copy arrives by multicast (`arriving`) — in the cluster `cluster`,
/// serving the model in `model_dir`, each pinned to a core of its own (this process's cores in
/// turn), its log in `out/node-N.log`, each given `args` besides. This process joins as node 0
/// with the same secret. Call
/// it from the main thread: the instances get SIGTERM when the calling thread ends
/// ([`cascade_devcluster::process::spawn_node_tied`]), so they never outlive this process.
pub(crate) fn spawn_instances(
    cluster: &Path,
    model_dir: &Path,
    out: &Path,
    nodes: &[(u32, Role, bool)],
    args: &[String],
) -> anyhow::Result<Vec<std::process::Child>> {
    let exe = std::env::current_exe().context("locating the cascade binary")?;
    // The cores this process may use (a container's cpuset may start above 0).
    let cores = cascade_exec::serve::allowed_cores().context("reading this process's CPU affinity")?;
    let mut children = Vec::new();
    for &(node, role, arriving) in nodes {
        let mut c = Command::new(&exe);
        c.arg("llm-instance").arg("--cluster").arg(cluster).args([
            "--node",
            &node.to_string(),
            "--ready-timeout-s",
            "120",
        ]);
        c.arg("--model").arg(model_dir).args(["--role", if role == Role::Decode { "decode" } else { "prefill" }]);
        if !cores.is_empty() {
            c.args(["--core", &cores[(node as usize - 1) % cores.len()].to_string()]);
        }
        if arriving {
            c.arg("--arriving");
        }
        c.args(args);
        c.env("CASCADE_SECRET", SECRET).env("RAYON_NUM_THREADS", "1");
        c.env("RUST_LOG", std::env::var("CASCADE_PD_LOG").unwrap_or_else(|_| "info".into()));
        c.env("XDG_RUNTIME_DIR", out);
        c.stdout(Stdio::null()).stderr(std::fs::File::create(out.join(format!("node-{node}.log")))?);
        // Tied to this (the main) thread: a SIGKILLed or crashed tool leaves no instance serving.
        let started = cascade_devcluster::process::spawn_node_tied(&mut c).context("starting an instance");
        match started {
            Ok(child) => children.push(child),
            Err(e) => {
                crate::demo::stop_nodes(children, out);
                return Err(e);
            }
        }
    }
    std::env::set_var("CASCADE_SECRET", SECRET);
    Ok(children)
}

/// The single-process answers every request is checked against, and how they were drawn.
struct Reference {
    decoding: Decoding,
    /// The stop strings every request ends at.
    stops: StopStrings,
    /// Greedy: one per prompt (request N answers prompt N mod their number); sampled: one per
    /// request.
    answers: Vec<Vec<u32>>,
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1)) - 1).copied().unwrap_or(0.0)
}

async fn drive(
    a: &PdArgs,
    cluster: &Path,
    model: &PdModel,
    prompts: &[Vec<u32>],
    expected: &Reference,
    out: &Path,
    kill_decode: &(dyn Fn(bool) -> anyhow::Result<()> + Sync),
) -> anyhow::Result<()> {
    let ep = crate::join(&Member::driver(cluster), true).await?;
    let mesh: Arc<dyn Mesh> = ep.clone();
    let cfg = PdRouterConfig {
        monitor: (a.rebalance_every_ms > 0).then(|| MonitorConfig {
            every: Duration::from_millis(a.rebalance_every_ms),
            rounds: RebalanceConfig {
                cluster: ClusterConfig::default(),
                cost: CostModel::cpu_smollm2(),
                layout: KvLayout::new(&model.config, LlmConfig::default().page_tokens as usize),
            },
        }),
        replace_lost_decode: a.replace_lost_decode,
        ..PdRouterConfig::new(model, OLD, vec![MUTATES], vec![DECODE])
    };
    let (req_tx, req_rx) = mpsc::unbounded_channel();
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let (ans_tx, mut ans_rx) = mpsc::unbounded_channel::<GenAnswer>();
    let routing = tokio::spawn(router::run(mesh.clone(), cfg, req_rx, cmd_rx, ans_tx));
    println!(
        "burst: {} requests at {} req/s ({:.1} s), up to {} tokens each; at {} s node {MUTATES} mutates to decode \
         and node {NEW} is scaled out from node {OLD}",
        a.requests,
        a.rate,
        a.requests as f64 / a.rate,
        a.max_tokens,
        a.scale_after_s
    );
    // The answers as they come, counted on a bar on stderr (drawn on a terminal only).
    let bar = indicatif::ProgressBar::new(a.requests as u64).with_style(
        indicatif::ProgressStyle::with_template("answered {bar:30} {pos}/{len} requests, {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let collecting = {
        let bar = bar.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            while let Some(x) = ans_rx.recv().await {
                bar.inc(1);
                answers.push(x);
            }
            answers
        })
    };
    let start = Instant::now();
    let sender = {
        let (prompts, n, rate, max_tokens) = (prompts.to_vec(), a.requests, a.rate, a.max_tokens);
        let (sampling, stop) = (expected.decoding.sampling(), expected.stops.clone());
        tokio::spawn(async move {
            for i in 0..n {
                tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate)).into()).await;
                let prompt = prompts[i % prompts.len()].clone();
                let sample = sampling.map(|sampling| SeqSampling { sampling, index: i as u64 });
                let _ = req_tx.send(GenRequest {
                    id: i as u64,
                    prompt,
                    max_tokens,
                    adapter: 0,
                    sample,
                    stop: stop.clone(),
                    tokens: None,
                });
            }
        })
    };
    tokio::time::sleep(Duration::from_secs_f64(a.scale_after_s)).await;
    let (tx, rx) = oneshot::channel();
    cmd_tx.send(PdCmd::Mutate { node: MUTATES, done: tx })?;
    rx.await?.map_err(anyhow::Error::msg).context("mutating node 2")?;
    let mutated_s = start.elapsed().as_secs_f64();
    cmd_tx.send(PdCmd::Scaling { node: NEW })?;
    let ctl = Controller::new(mesh.clone())?;
    let mut topo = Topology::new();
    for n in 0..5 {
        topo.add_node(n, 0, 10.0)?;
    }
    // The kill, when asked for, runs beside the scale-out (its time may fall inside it).
    let killing = async {
        let graceful = a.stop_decode_at_s.is_some();
        let Some(at) = a.kill_decode_at_s.or(a.stop_decode_at_s) else { return Ok(None) };
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        // An instance stopped or killed while it decodes nothing shows nothing moved or redone
        // (on a loaded machine the first decodes may start many seconds later): it waits for
        // one, asking the instance.
        let waited = Instant::now();
        while waited.elapsed() < Duration::from_secs(60) {
            match mesh.call(DECODE, &LlmMsg::Status, Duration::from_secs(10)).await {
                Ok(LlmMsg::State { running: 0, .. }) => tokio::time::sleep(Duration::from_millis(10)).await,
                _ => break,
            }
        }
        kill_decode(graceful)?;
        let at = start.elapsed().as_secs_f64();
        bar.suspend(|| {
            if graceful {
                println!("stopped the decode instance (node {DECODE}, SIGTERM) at {at:.1} s");
            } else {
                println!("killed the decode instance (node {DECODE}, SIGKILL) at {at:.1} s");
            }
        });
        Ok::<_, anyhow::Error>(Some(at))
    };
    let scaling = async {
        let r = scale_out(&mesh, &ctl, &model.manifest, topo, OLD, &[NEW], None).await;
        (r, start.elapsed().as_secs_f64())
    };
    let ((scaled, loaded_s), killed_s) = tokio::join!(scaling, killing);
    let (scaled, killed_s) = (scaled?, killed_s?);
    sender.await?;
    let stats = routing.await??;
    // The router is done and its sender dropped: the collector has every answer.
    let answers: Vec<GenAnswer> = collecting.await?;
    bar.finish_and_clear();

    let mut seen = HashMap::new();
    let (mut wrong, mut ttft, mut tbt) = (0, Vec::new(), Vec::new());
    let mut rows = Vec::new();
    for x in &answers {
        *seen.entry(x.id).or_insert(0) += 1;
        let want = &expected.answers[x.id as usize % expected.answers.len()];
        let ok = x.result.as_ref().is_ok_and(|t| t == want);
        if !ok {
            wrong += 1;
            eprintln!("request {}: {:?}, expected {want:?}", x.id, x.result);
        }
        ttft.push(x.ttft.as_secs_f64() * 1e3);
        tbt.extend(x.gaps.iter().map(|g| g.as_secs_f64() * 1e3));
        rows.push(serde_json::json!({
            "id": x.id, "ttft_ms": x.ttft.as_secs_f64() * 1e3,
            "tbt_ms": x.gaps.iter().map(|g| g.as_secs_f64() * 1e3).collect::<Vec<_>>(),
            "prefill_node": x.prefill.0, "split_stages": x.prefill.1, "decode_node": x.decode,
            "attempts": x.attempts, "tokens": x.result.as_ref().ok(), "equal_to_reference": ok,
            "stopped": x.stopped,
        }));
    }
    let lost = (0..a.requests as u64).filter(|i| !seen.contains_key(i)).count();
    let twice = seen.values().filter(|&&c| c > 1).count();
    let on = |n: u32| answers.iter().filter(|x| x.prefill.0 == n).count();
    let split = answers.iter().filter(|x| x.prefill.1 > 0).count();
    let decoded_by_mutated = answers.iter().filter(|x| x.decode == MUTATES).count();
    let report = serde_json::json!({
        "requests": a.requests, "prompt_file": a.prompt_file, "prompts": prompts.len(),
        "decoding": crate::generate::described(expected.decoding),
        "answered": answers.len(), "lost": lost, "answered_twice": twice,
        "not_equal_to_reference": wrong, "requeued": stats.requeued, "stale_tokens_dropped": stats.stale_tokens,
        "stop_strings": expected.stops.strings(), "stopped_at_a_stop_string": stats.stopped,
        "decodes_stalled": stats.stalled, "monitor_rounds": stats.monitor_rounds, "migrated": stats.migrated,
        "ttft_p50_ms": pct(&mut ttft.clone(), 0.5), "ttft_p99_ms": pct(&mut ttft.clone(), 0.99),
        "tbt_p50_ms": pct(&mut tbt.clone(), 0.5), "tbt_p99_ms": pct(&mut tbt.clone(), 0.99),
        "mutated_at_s": mutated_s, "scale_out_done_s": loaded_s, "multicast_s": scaled.run.report.seconds,
        "transfer_s": scaled.run.transfer_seconds,
        "decode_killed_at_s": killed_s.filter(|_| a.kill_decode_at_s.is_some()),
        "decode_stopped_at_s": killed_s.filter(|_| a.stop_decode_at_s.is_some()),
        "decode_left": stats.decode_left, "drain_moved": stats.drain_moved,
        "decode_replaced": stats.decode_replaced,
        "prefills": {"node1": on(OLD), "node2": on(MUTATES), "node4": on(NEW), "split": split},
        "decoded_by_mutated_instance": decoded_by_mutated,
        "per_request": rows,
    });
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    println!(
        "{} of {} answered ({lost} lost, {twice} twice, {wrong} not equal to single-process {}); \
         TTFT p50 {:.0} ms p99 {:.0} ms; TBT p50 {:.0} ms p99 {:.0} ms",
        answers.len(),
        a.requests,
        crate::generate::described(expected.decoding),
        pct(&mut ttft, 0.5),
        pct(&mut ttft.clone(), 0.99),
        pct(&mut tbt, 0.5),
        pct(&mut tbt.clone(), 0.99)
    );
    println!(
        "prefills: node 1 {}, node 2 {} (before it mutated at {mutated_s:.1} s), node 4 {} ({split} split while it \
         loaded; copy in place at {loaded_s:.1} s); node 2 decoded {decoded_by_mutated} requests after mutating; \
         report in {}",
        on(OLD),
        on(MUTATES),
        on(NEW),
        out.join("report.json").display()
    );
    if !expected.stops.is_empty() {
        println!(
            "{} ended at a stop string; {} stale tokens dropped (those decoded past a stop before its decode \
             stopped among them)",
            crate::count(stats.stopped as usize, "request", "requests"),
            stats.stale_tokens
        );
    }
    if let (Some(at), Some(_)) = (killed_s, a.stop_decode_at_s) {
        println!(
            "node {DECODE} was stopped at {at:.1} s: {} of its requests moved with their KV to another decode \
             instance; {} prefills redone",
            stats.drain_moved, stats.requeued
        );
    }
    if let (Some(at), Some(_)) = (killed_s, a.kill_decode_at_s) {
        println!(
            "node {DECODE} was killed at {at:.1} s: {} prefills redone (the requests it was decoding among them); \
             {} prefill instance(s) turned into decode ones in its place",
            stats.requeued, stats.decode_replaced
        );
    }
    if a.rebalance_every_ms > 0 {
        println!(
            "co-migration monitor: {} rounds ({} failed), {} requests moved with their KV",
            stats.monitor_rounds, stats.monitor_failed, stats.migrated
        );
    }
    ep.leave().await;
    if lost > 0 || twice > 0 || wrong > 0 {
        bail!("{lost} lost, {twice} answered twice, {wrong} not equal to the reference");
    }
    Ok(())
}
