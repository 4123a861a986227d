//! `cascade` — the operator's command: run a node daemon, drive a multicast, check a cluster file.
// The argument structs' doc comments are clap's `--help` text, written for a terminal (TOML
// tables such as `[[nodes]]`, placeholders such as `<time>`), not rustdoc markdown.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use cascade_multicast::cluster::{Controller, RunSpec};
use cascade_multicast::{Event, Loc, MeshRates, PlannerKind, Topology};
use cascade_param_pool::node::start_services;
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, StallWatch};
use clap::{Args, Parser, Subcommand};
use say::say;

mod batch;
mod demo;
mod embed;
mod generate;
mod input;
mod live;
mod llm;
mod llm_server;
mod lora;
mod models;
mod openai;
mod pd;
mod plot;
mod pool;
mod say;

#[derive(Parser)]
#[command(name = "cascade", version, about = "Cascade data plane for model-serving clusters")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a cluster file and print its members.
    CheckCluster {
        /// The TOML cluster file.
        file: PathBuf,
    },
    /// Run a node: join the cluster's mesh and execute the multicast plans a controller sends.
    Node(NodeArgs),
    /// Plan and run a multicast from this node (the controller) on node daemons, then verify it.
    Multicast(MulticastArgs),
    /// The parameter pool end to end on one machine: a local cluster and pool manager; register a
    /// model, scale it to every node by chained multicast, kill a node, repair, check; report +
    /// timeline (the main job is `cascade live`).
    Demo(demo::DemoArgs),
    /// Live autoscaling of the real all-MiniLM-L6-v2 under a burst: the model is multicast to a
    /// second instance that serves layer by layer while it loads, under each policy
    /// (stop-the-world, best-effort, zigzag); report + plot.
    Live(live::LiveArgs),
    /// Serve a model on this node: an instance of the exec service (requests from a router).
    Instance(live::InstanceArgs),
    /// Sentence embeddings with a real BERT model on the CPU (all-MiniLM-L6-v2's directory:
    /// model.safetensors, tokenizer.json, config.json; sentence_bert_config.json sets where long
    /// texts are cut, modules.json and 1_Pooling/config.json the pooling, as sentence-transformers
    /// does; without modules.json, all-MiniLM-L6-v2's mean and L2 normalisation).
    Embed(embed::EmbedArgs),
    /// Text generation with a real llama-architecture LLM on the CPU, greedy or sampled (a
    /// directory that `cascade model import --gguf` wrote).
    Generate(generate::GenerateArgs),
    /// LLM serving with prefill/decode disaggregation on this machine: SmolLM2 in four instance
    /// processes, a burst, a prefill→decode mutation and a live scale-out in its middle; every
    /// answer checked against single-process generation (greedy, or sampled with --temperature);
    /// TTFT/TBT per request.
    Pd(pd::PdArgs),
    /// dLoRA on the real SmolLM2: several LoRA adapters (seeded test doubles, or PEFT directories
    /// with --adapter), a skewed stream, merged/unmerged batching chosen per iteration; every
    /// response checked against the same request served alone.
    LoraServe(lora::LoraServeArgs),
    /// Serve an LLM on this node: a prefill or decode instance (requests from `cascade pd`'s router).
    LlmInstance(pd::LlmInstanceArgs),
    /// Serve an LLM over HTTP with OpenAI's completions and chat completions API (POST
    /// /v1/completions, /v1/chat/completions; GET /v1/models, /health): requests from every
    /// connection batched together as they come, each with its own budget, sampling and stop
    /// strings.
    LlmServer(llm_server::LlmServerArgs),
    /// Model files: import a GGUF file as a model directory.
    Model {
        #[command(subcommand)]
        cmd: llm::ModelCmd,
    },
    /// The global parameter pool: run its manager, inspect, check and repair it.
    Pool {
        #[command(subcommand)]
        cmd: pool::PoolCmd,
    },
}

impl Cmd {
    /// Whether this process computes a model's layers, allocating and freeing tensors of tens of
    /// megabytes at every layer: the data plane's daemons (nodes, the pool manager) and the
    /// import leave the allocator as it is, so that they give freed memory back.
    fn computes(&self) -> bool {
        matches!(
            self,
            Cmd::Embed(_)
                | Cmd::Generate(_)
                | Cmd::Live(_)
                | Cmd::Instance(_)
                | Cmd::Pd(_)
                | Cmd::LoraServe(_)
                | Cmd::LlmInstance(_)
                | Cmd::LlmServer(_)
        )
    }

    /// A short-lived command that prints its result (not a daemon, not the demo).
    fn prints_and_exits(&self) -> bool {
        match self {
            Cmd::CheckCluster { .. } | Cmd::Embed(_) | Cmd::Generate(_) | Cmd::Model { .. } => true,
            Cmd::Pool { cmd } => cmd.prints_and_exits(),
            Cmd::Node(_)
            | Cmd::Multicast(_)
            | Cmd::Demo(_)
            | Cmd::Live(_)
            | Cmd::Instance(_)
            | Cmd::Pd(_)
            | Cmd::LoraServe(_)
            | Cmd::LlmInstance(_)
            | Cmd::LlmServer(_) => false,
        }
    }
}

#[derive(Args)]
struct NodeArgs {
    #[command(flatten)]
    member: Member,
    /// Device memory of this node's GPUs, in GPU order, comma separated: `cuda:N` (a build with
    /// the `cuda` feature) or `emulated:N` (a test double in host memory). Targets `NODE/gpuI`
    /// of multicasts then land in device I. A device that cannot be opened is reported and that
    /// GPU falls back to host memory; a name of another form is refused. A target on a GPU past
    /// the list is refused; without `--device` every GPU index is emulated in host memory.
    #[arg(long, value_delimiter = ',', value_parser = device_spec)]
    device: Vec<String>,
}

#[derive(Args)]
pub(crate) struct Member {
    /// Cluster file (TOML: name, [[nodes]] id/addr/host).
    #[arg(long)]
    pub(crate) cluster: PathBuf,
    /// This node's id in the cluster file.
    #[arg(long)]
    pub(crate) node: u32,
    /// File holding the cluster secret (or set CASCADE_SECRET).
    #[arg(long)]
    pub(crate) secret_file: Option<PathBuf>,
    /// Do not use shared memory with same-host nodes.
    #[arg(long)]
    pub(crate) no_shm: bool,
    /// Most MiB of memory this node gives to regions (multicast buffers, pool copies); what
    /// does not fit is refused before anything is allocated. Default: the memory the system has
    /// available, less 256 MiB. At least 1 (a node that can hold nothing is a typo), and at most
    /// 2^44 - 1 (the limit in bytes must fit 64 bits).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=u64::MAX >> 20))]
    pub(crate) memory_limit_mib: Option<u64>,
    /// Seconds to wait for the full mesh.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    pub(crate) ready_timeout_s: f64,
    /// Serve Prometheus metrics at http://ADDR/metrics: `host:port`, or a port alone for
    /// loopback (127.0.0.1). Off unless given.
    #[arg(long, value_parser = metrics_addr)]
    pub(crate) metrics: Option<std::net::SocketAddr>,
}

/// `--metrics`: `host:port`, or a port alone on loopback.
pub(crate) fn metrics_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse().map_err(|_| format!("{s:?} is neither host:port nor a port"))
}

#[derive(Args)]
struct MulticastArgs {
    #[command(flatten)]
    member: Member,
    /// Topology file (TOML: [[nodes]] id/gpus/nic_gbps, [[links]], [[flows]]). Without it, the
    /// topology is derived from this node's connection pool (one GPU per node, --nic-gbps).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// NIC rate assumed when deriving the topology, Gbit/s.
    #[arg(long, default_value_t = 100.0, value_parser = rate)]
    nic_gbps: f64,
    /// When deriving the topology: what one host's cores move over all its hops together,
    /// Gbit/s (`multicast --calibrate` measures it); members that share a host then share it.
    #[arg(long, value_parser = rate)]
    machine_gbps: Option<f64>,
    /// Locations holding the parameters, comma separated (e.g. 1/gpu0).
    #[arg(long, value_delimiter = ',', required = true)]
    sources: Vec<Loc>,
    /// Locations to load, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    targets: Vec<Loc>,
    /// Bytes of the (synthetic) model.
    #[arg(long)]
    bytes: u64,
    /// blitz, chain, star or tree.
    #[arg(long, default_value = "blitz")]
    planner: PlannerKind,
    /// Split the model into this many equal layers (LayerReady granularity; at most --bytes).
    #[arg(long, default_value_t = 8)]
    layers: u64,
    /// Give up after this many seconds (positive); unfinished targets are reported failed.
    #[arg(long, default_value_t = 600.0, value_parser = seconds)]
    deadline_s: f64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// `text` as a person reads it back in a line of output: a long one cut in its middle (the
/// JSON outputs keep it whole).
fn shorten(text: &str) -> String {
    const HEAD: usize = 60;
    const TAIL: usize = 20;
    let chars = text.chars().count();
    if chars <= HEAD + TAIL + 20 {
        return text.to_string();
    }
    let head: String = text.chars().take(HEAD).collect();
    let tail: String = text.chars().skip(chars - TAIL).collect();
    format!("{head} … ({} characters) … {tail}", chars - HEAD - TAIL)
}

/// Logs to stderr at `RUST_LOG`, or at `default` when it is not set.
fn logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init();
}

/// Joins the cluster as `m`; with `wait_all`, waits until every member is connected.
impl Member {
    /// Node 0 of `cluster`, as a demonstration's driver joins it (secret from the environment).
    pub(crate) fn driver(cluster: &std::path::Path) -> Member {
        Member {
            cluster: cluster.to_path_buf(),
            node: 0,
            secret_file: None,
            no_shm: false,
            memory_limit_mib: None,
            ready_timeout_s: 120.0,
            metrics: None,
        }
    }
}

pub(crate) async fn join(m: &Member, wait_all: bool) -> anyhow::Result<Arc<Endpoint>> {
    join_with(m, wait_all, |_| Ok(())).await
}

/// The cluster secret: from `file`, or else `CASCADE_SECRET`.
pub(crate) fn read_secret(file: Option<&std::path::Path>) -> anyhow::Result<Vec<u8>> {
    let secret = match (file, std::env::var("CASCADE_SECRET")) {
        (Some(f), _) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
        (None, Ok(s)) => s.into_bytes(),
        (None, Err(_)) => bail!("no cluster secret: pass --secret-file or set CASCADE_SECRET"),
    };
    Ok(secret.trim_ascii().to_vec())
}

/// Joins the cluster as `m`, with `services` started on the endpoint before any peer connects.
pub(crate) async fn join_with(
    m: &Member,
    wait_all: bool,
    services: impl FnOnce(&Arc<Endpoint>) -> anyhow::Result<()>,
) -> anyhow::Result<Arc<Endpoint>> {
    let cluster = ClusterSpec::load(&m.cluster)?;
    let secret = read_secret(m.secret_file.as_deref())?;
    let mut cfg = EndpointConfig::new(m.node, cluster, &secret);
    cfg.shm = !m.no_shm;
    cfg.memory_limit = m.memory_limit_mib.map(|mib| mib << 20);
    let ep = Arc::new(Endpoint::bind(cfg).await?);
    watch_stalls(ep.metrics());
    if let Some(addr) = m.metrics {
        let bound = cascade_transport::metrics::spawn_metrics_server(addr, ep.metrics().clone()).await?;
        // One line a supervisor (or a test) can read the address from, port 0 included.
        say!("metrics: http://{bound}/metrics");
        tracing::info!(%bound, "serving metrics");
    }
    services(&ep)?;
    ep.open();
    if wait_all {
        wait_for_mesh(&ep, m).await?;
    }
    Ok(ep)
}

/// Waits (at most `--ready-timeout-s`) until `ep` is connected to every member of the cluster.
async fn wait_for_mesh(ep: &Endpoint, m: &Member) -> anyhow::Result<()> {
    let rep = ep.wait_ready(Duration::from_secs_f64(m.ready_timeout_s)).await.context("waiting for the full mesh")?;
    tracing::info!(
        node = m.node,
        peers = rep.peers.len(),
        setup_ms = rep.setup.as_secs_f64() * 1e3,
        "joined the cluster"
    );
    Ok(())
}

/// A runtime standing still this long is reported (a third of the keepalive's default limit).
const STALL_REPORTED: Duration = Duration::from_secs(1);

/// Starts the process's [`StallWatch`] (once: one runtime per process here), so that a node whose
/// async runtime stands still says so in its log and metrics before its peers declare it down.
fn watch_stalls(metrics: &Arc<cascade_transport::metrics::Metrics>) {
    static WATCH: std::sync::OnceLock<Option<StallWatch>> = std::sync::OnceLock::new();
    WATCH.get_or_init(|| match StallWatch::start(STALL_REPORTED, Some(metrics.clone())) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the runtime's stall watch");
            None
        }
    });
}

/// How long a serving instance may take to stop on SIGINT/SIGTERM before its node leaves anyway.
pub(crate) const GRACE: Duration = Duration::from_secs(60);

/// An instance's graceful stop on SIGINT/SIGTERM, before its node leaves the cluster: `stop`
/// (the instance's `stop_and_wait`) takes no more requests and answers those it took, within
/// `grace`, or until a second signal. Says on stderr what it does, since an operator waits on it.
pub(crate) async fn stop_gracefully(node: u32, grace: Duration, stop: impl std::future::Future<Output = ()>) {
    say!(
        "node {node}: stopping: finishing the requests it holds (at most {} s; signal again to leave now)",
        grace.as_secs()
    );
    let t0 = std::time::Instant::now();
    tokio::select! {
        r = tokio::time::timeout(grace, stop) => match r {
            Ok(()) => say!("node {node}: instance stopped in {:.2} s", t0.elapsed().as_secs_f64()),
            Err(_) => say!("node {node}: instance not stopped after {} s: leaving anyway", grace.as_secs()),
        },
        () = shutdown_signal() => say!("node {node}: second signal: leaving now"),
    }
}

/// Resolves on the first SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn node(a: NodeArgs) -> anyhow::Result<()> {
    let m = a.member;
    // The node's services (multicast, pool) serve on their own tasks until the endpoint closes;
    // they are subscribed before any peer can reach the node.
    let ep = join_with(&m, false, |ep| {
        let services = start_services(ep.clone(), Duration::from_secs(30)).context("starting the node's services")?;
        for (gpu, spec) in a.device.iter().enumerate() {
            match cascade_transport::device::open(spec) {
                Ok(dev) => services.multicast.attach_device(gpu as u32, dev),
                Err(e) => tracing::warn!(gpu, device = %spec, error = %e, "device unavailable: this GPU's targets stay in host memory"),
            }
        }
        // Its GPUs are those --device names: a target on another is refused (without --device,
        // every GPU is emulated in host memory).
        services.multicast.declare_gpus(u32::try_from(a.device.len()).unwrap_or(u32::MAX));
        Ok(())
    })
    .await?;
    // A stop while it waits for its peers leaves at once, as a stop later does: killed by the
    // signal, it left its same-host socket behind and said nothing.
    tokio::select! {
        r = wait_for_mesh(&ep, &m) => r?,
        () = shutdown_signal() => {
            say!("node {}: stopped before the full mesh formed", m.node);
            ep.leave().await;
            return Ok(());
        }
    }
    shutdown_signal().await;
    tracing::info!("shutting down");
    ep.leave().await;
    Ok(())
}

async fn multicast(a: MulticastArgs) -> anyhow::Result<()> {
    if a.bytes == 0 || a.layers == 0 {
        bail!("--bytes and --layers must be positive");
    }
    // More layers than bytes made empty layers, dropped in silence (`--bytes 3 --layers 8` ran
    // 3 layers; `--layers 100000000` built a hundred million ranges first).
    if a.layers > a.bytes {
        bail!("--layers {} exceeds --bytes {}: a layer holds at least one byte", a.layers, a.bytes);
    }
    // A deadline of 0 raced the run: a small one finished anyway, a larger one failed at once.
    if a.deadline_s <= 0.0 {
        bail!("--deadline-s must be positive");
    }
    // This command is the run's controller and serves no copies: a location on its own node was
    // asked to prepare, and failed with "multicast service: no such service on the node".
    if let Some(l) = a.sources.iter().chain(&a.targets).find(|l| l.node == a.member.node) {
        bail!(
            "{l} is on node {}, this controller, which holds no copies: name locations on the nodes \
             running `cascade node`",
            a.member.node
        );
    }
    let layers = (0..a.layers).map(|i| i * a.bytes / a.layers..(i + 1) * a.bytes / a.layers).collect();
    // A topology file is read before joining: a bad one was found only once every node was up.
    let given = match &a.topology {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            Some(Topology::from_toml(&text).with_context(|| format!("topology {}", path.display()))?)
        }
        None => None,
    };
    let ep = join(&a.member, true).await?;
    let topology = match given {
        Some(t) => t,
        None => {
            let rates = MeshRates {
                nic_gbps: a.nic_gbps,
                tcp_gbps: a.nic_gbps,
                shm_gbps: 4.0 * a.nic_gbps,
                machine_gbps: a.machine_gbps,
            };
            Topology::from_mesh(&ep.config().cluster, ep.node(), &ep.connected(), 1, rates)?
        }
    };
    let mut spec = RunSpec::synthetic(topology, a.bytes, a.sources.clone(), a.targets.clone(), 0x5eed);
    spec.planner = a.planner;
    spec.layers = layers;
    spec.deadline = Duration::from_secs_f64(a.deadline_s);
    let out = match Controller::new(ep.clone()).map_err(anyhow::Error::from) {
        Ok(ctl) => ctl.run(&spec).await.map_err(anyhow::Error::from),
        Err(e) => Err(e),
    };
    ep.leave().await;
    let out = match out {
        Ok(out) => out,
        // A run that could not even finish still answers in the format asked for.
        Err(e) if a.json => {
            println!(
                "{}",
                serde_json::json!({
                    "planner": a.planner, "targets": a.targets.len(), "bytes": a.bytes,
                    "completed": 0, "verified": 0, "error": format!("{e:#}"),
                })
            );
            std::process::exit(1);
        }
        Err(e) => return Err(e),
    };
    let done_at: Vec<_> = out
        .events
        .iter()
        .filter_map(|(t, e)| match e {
            Event::TargetDone { target } => Some(serde_json::json!({"target": target.to_string(), "seconds": t})),
            _ => None,
        })
        .collect();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "planner": a.planner, "targets": a.targets.len(), "bytes": a.bytes,
                "seconds": out.transfer_seconds, "chunk_bytes": out.plan.chunk_bytes,
                "predicted_seconds": out.plan.makespan(),
                "completed": out.report.completed.len(), "verified": out.verified.len(),
                "failed": out.report.failed.iter().map(|(l, w)| serde_json::json!([l.to_string(), w])).collect::<Vec<_>>(),
                "replans": out.report.replans, "done_at": done_at,
            })
        );
    } else {
        println!("the plan (its `done` lines are the planner's predictions):");
        print!("{}", out.plan);
        println!(
            "{} of {} targets completed and verified in {:.3} s (predicted {:.3} s); {} failed, {} re-plans",
            out.verified.len(),
            a.targets.len(),
            out.transfer_seconds,
            out.plan.makespan(),
            out.report.failed.len(),
            out.report.replans
        );
        for (l, why) in &out.report.failed {
            println!("  failed {l}: {why}");
        }
    }
    if !out.mismatched.is_empty() {
        bail!("targets whose bytes differ from the source: {:?}", out.mismatched);
    }
    if !out.report.failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// `n` copies in words: "1 copy", "3 copies".
pub(crate) fn copies(n: usize) -> String {
    count(n, "copy", "copies")
}

/// `n` things in words, singular for one: `count(1, "text", "texts")` is "1 text".
pub(crate) fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A number of seconds: finite and not negative (NaN, inf and -1 are refused at parse time).
/// The first item of `v` that an earlier one equals (an option naming something twice).
pub(crate) fn first_repeat<T: PartialEq>(v: &[T]) -> Option<&T> {
    v.iter().enumerate().find_map(|(i, x)| v[..i].contains(x).then_some(x))
}

/// `--device`'s names, checked for form at parse time (`gpu:0` used to start the node with a
/// warning, its GPU's targets in host memory).
fn device_spec(s: &str) -> Result<String, String> {
    cascade_transport::device::check_spec(s).map(|()| s.to_string()).map_err(|e| e.to_string())
}

pub(crate) fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(0.0..=1e9).contains(&v) {
        return Err(format!("{s} is not a usable number of seconds (finite, 0 to 1e9)"));
    }
    Ok(v)
}

/// A link rate in Gbit/s: finite and positive.
pub(crate) fn rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("{s} is not a usable rate (finite and positive)"));
    }
    Ok(v)
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            say::error(&e);
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    // SAFETY: the first thing the program does, before any thread exists.
    unsafe { cascade_exec::threads::settle_compute_threads() };
    let cli = Cli::parse();
    if cli.cmd.computes() {
        // Tensors of tens of megabytes are reused from the heap, not faulted in afresh each
        // layer (where the C library is glibc; elsewhere its allocator is left as it is).
        cascade_exec::heap::keep_freed_memory();
    }
    // A report or answer that cannot be written (a full disk) is said in one line, not as a panic.
    cascade_transport::stdout::report_write_failures_briefly();
    if cli.cmd.prints_and_exits() {
        // A tool whose output is piped into `head` ends quietly when the reader goes away, as
        // Unix tools do, instead of panicking in println!. Daemons keep SIGPIPE ignored: their
        // sockets report EPIPE as an error.
        // SAFETY: restoring a signal's default disposition at start-up, before any thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // The demo's own output is the point; its daemons log to files.
    logging(if matches!(cli.cmd, Cmd::Demo(_) | Cmd::Live(_) | Cmd::Pd(_) | Cmd::LoraServe(_)) {
        "error"
    } else {
        "info"
    });
    match cli.cmd {
        Cmd::CheckCluster { file } => {
            // The error names the file already.
            let c = ClusterSpec::load(&file)?;
            println!("cluster {:?}: {} nodes", c.name, c.nodes.len());
            for n in &c.nodes {
                println!("  node {:>4}  {}  host {}", n.id, n.addr, n.host_key());
            }
            Ok(())
        }
        Cmd::Node(a) => tokio::runtime::Runtime::new()?.block_on(node(a)),
        Cmd::Multicast(a) => tokio::runtime::Runtime::new()?.block_on(multicast(a)),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Embed(a) => embed::embed(a),
        Cmd::Generate(a) => generate::generate(a),
        Cmd::Pd(a) => pd::run(a),
        Cmd::LoraServe(a) => lora::run(a),
        Cmd::LlmInstance(a) => tokio::runtime::Runtime::new()?.block_on(pd::instance(a)),
        Cmd::LlmServer(a) => llm_server::run(a),
        Cmd::Model { cmd } => llm::model(cmd),
        Cmd::Live(a) => live::run(a),
        Cmd::Instance(a) => tokio::runtime::Runtime::new()?.block_on(live::instance(a)),
        Cmd::Pool { cmd } => tokio::runtime::Runtime::new()?.block_on(pool::run(cmd)),
    }
}

#[cfg(test)]
mod tests {
    use super::shorten;

    #[test]
    fn long_texts_are_cut_in_the_middle_and_short_ones_kept() {
        assert_eq!(shorten("a short prompt"), "a short prompt");
        let long = format!("{}{}{}", "a".repeat(60), "é".repeat(500), "z".repeat(20));
        assert_eq!(shorten(&long), format!("{} … (500 characters) … {}", "a".repeat(60), "z".repeat(20)));
        let edge = "x".repeat(100);
        assert_eq!(shorten(&edge), edge);
    }
}
