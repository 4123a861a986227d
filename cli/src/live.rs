//! `cascade live`: live autoscaling of the real all-MiniLM-L6-v2, end to end (BlitzScale §5.2).
//!
//! One instance serves embedding requests; an open-loop burst beyond its capacity arrives; the
//! model is multicast from the parameter pool's host copy (a node that serves nothing; or, with
//! `--source old`, from the serving instance itself) to a second node over links shaped slow
//! enough that the load takes seconds (as 7–70 B models take on real fabrics relative to their
//! compute), and the second instance serves layer by layer while its copy arrives. Each instance computes on one thread
//! pinned to a core of its own, standing for one GPU, so that on a 2-core machine the second
//! instance really adds capacity. The same burst is run under each policy — stop-the-world,
//! best-effort live, zigzag live — each on a fresh cluster; `report.json` and `live.png`
//! (requests/s served and p99 latency over time, one line per policy) go to `--out`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use cascade_devcluster::netns::Netns;
use cascade_exec::serve::{Instance, InstanceConfig, LivePolicy, ServedModel, Source};
use cascade_multicast::cluster::MulticastNode;
use cascade_transport::Mesh;
use clap::Args;

use crate::Member;

mod driver;
mod report;

const SECRET: &str = "cascade-live";

/// `cascade live`'s options.
#[derive(Args, Clone)]
pub(crate) struct LiveArgs {
    /// The model directory (model.safetensors, tokenizer.json, config.json).
    #[arg(long, default_value = crate::models::MINILM)]
    model: PathBuf,
    /// Put every node in its own network namespace, egress shaped to --link-mbit (root).
    #[arg(long)]
    netns: bool,
    /// Link rate with --netns, Mbit/s. Several, comma-separated, run the whole comparison at
    /// each rate in turn (each in `OUT/<rate>mbit/`) and end with a table of the p99 ratios
    /// per rate (`OUT/sweep.json`).
    #[arg(long, value_delimiter = ',', default_value = "100")]
    link_mbit: Vec<u64>,
    /// The policies to compare, on the same burst.
    #[arg(long, value_delimiter = ',', default_value = "stop-the-world,best-effort,zigzag")]
    policies: Vec<LivePolicy>,
    /// The burst's rate, as a multiple of one instance's capacity, measured by the first run of
    /// each round just before its burst; the round's other policies get the same burst (the
    /// same arrivals). This VM's speed drifts by ±25% over minutes, so each round measures
    /// again; measuring in every run instead gave policies of one round bursts up to 39% apart,
    /// and their p99s followed their burst sizes rather than their policies.
    #[arg(long, default_value_t = 1.6, value_parser = crate::rate)]
    burst: f64,
    /// The burst's length, seconds.
    #[arg(long, default_value_t = 14.0, value_parser = crate::seconds)]
    burst_s: f64,
    /// Seconds into the burst when the scale-out begins (the autoscaler's reaction).
    #[arg(long, default_value_t = 1.0, value_parser = crate::seconds)]
    scale_after_s: f64,
    /// Texts per batch.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Cooperative batches outstanding at most (the pair's activation slots in use): enough to
    /// keep the old instance busy while activations and replies cross the links, few enough
    /// that little work is committed to it when the load completes. A batch in three segments
    /// (the entry stage on old, see `cascade_exec::serve::dispatch`) crosses two hand-overs and
    /// holds its place 0.3–0.5 s, against about 30 ms of old's share of it (the entry stage and
    /// half the blocks): about 16. With 8, old idled and the pair served 175–199 req/s of a
    /// 216 req/s burst during the load (three rounds); with 16, zigzag's burst p99 fell from
    /// 1.53–2.16 s to 1.23–1.85 s.
    #[arg(long, default_value_t = 16)]
    max_coop: usize,
    /// Where the scale-out's copy comes from: `pool`, a fourth node holding the parameter pool's
    /// host copy (it serves nothing), or `old`, the serving instance itself — whose link then
    /// carries the multicast ahead of its replies and of the TCP acks of the activations sent to
    /// it (README: p99 zigzag ÷ best-effort 0.84 from the pool, 0.99 from old).
    #[arg(long, value_enum, default_value_t = CopySource::Pool)]
    source: CopySource,
    /// Rounds: every policy once per round, in turn (this VM's speed drifts by ±20% between
    /// runs; the report gives each policy's median over the rounds).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Where report.json, live.png, the per-policy records and the logs go.
    #[arg(long, default_value = "target/live")]
    out: PathBuf,
    /// TrueType font for the PNG.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Internal (--netns): run one policy's driver against this cluster file.
    #[arg(long, hide = true)]
    driver: Option<PathBuf>,
    /// Internal (--netns): the round the driver runs.
    #[arg(long, hide = true, default_value_t = 0)]
    round: usize,
    /// Internal: the burst's rate (requests/s) set by the round's first run.
    #[arg(long, hide = true)]
    rate_rps: Option<f64>,
}

impl LiveArgs {
    /// The link rate of a comparison at one rate (the first of the list).
    fn link(&self) -> u64 {
        self.link_mbit.first().copied().unwrap_or(100)
    }
}

/// Which node sends the scale-out's copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CopySource {
    /// The serving instance (node 1).
    Old,
    /// A pool node (node 3) that holds a copy and serves nothing.
    Pool,
}

/// A run's nodes: 0 drives; OLD serves from the start; NEW starts empty; POOL, with `--source
/// pool`, holds the pool's copy and serves nothing.
const OLD: u32 = 1;
const NEW: u32 = 2;
const POOL: u32 = 3;

impl CopySource {
    /// The node that sends the copy.
    fn node(self) -> u32 {
        match self {
            CopySource::Old => OLD,
            CopySource::Pool => POOL,
        }
    }

    /// The nodes a run has: the driver, old, new, and the pool node when it is the source.
    fn nodes(self) -> usize {
        NEW.max(self.node()) as usize + 1
    }

    /// Its name on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CopySource::Old => "old",
            CopySource::Pool => "pool",
        }
    }
}

/// `cascade instance`'s options: one serving instance on a node.
#[derive(Args)]
pub(crate) struct InstanceArgs {
    #[command(flatten)]
    member: Member,
    /// The model directory (model.safetensors, tokenizer.json, config.json).
    #[arg(long)]
    model: PathBuf,
    /// Start without a copy: it arrives by multicast, and the instance serves its layers as
    /// they are verified. Otherwise the node loads the model file and holds a copy.
    #[arg(long)]
    arriving: bool,
    /// Pin the instance's compute thread to this core.
    #[arg(long)]
    core: Option<usize>,
    /// Texts per batch at most.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Tokens per text at most (sizes the activation slots); by default the model's own cut
    /// (256 for all-MiniLM-L6-v2), so every text the model takes is served.
    #[arg(long)]
    max_tokens: Option<usize>,
}

/// Runs an instance until SIGINT/SIGTERM, then stops it gracefully ([`crate::stop_gracefully`]).
pub(crate) async fn instance(a: InstanceArgs) -> anyhow::Result<()> {
    let (model, file) =
        ServedModel::from_dir(&a.model).with_context(|| format!("reading the model in {}", a.model.display()))?;
    let cfg =
        InstanceConfig { max_batch: a.max_batch, max_tokens: a.max_tokens, core: a.core, ..InstanceConfig::default() };
    let mut held = None;
    let ep = crate::join_with(&a.member, false, |ep| {
        let mesh: Arc<dyn Mesh> = ep.clone();
        let mc = MulticastNode::start(mesh.clone(), Duration::from_secs(30))?;
        let source = if a.arriving { Source::Arriving } else { Source::Held(model.load(&*mesh, &file)?) };
        held = Some(Instance::start(mesh, model.clone(), source, mc, cfg)?);
        Ok(())
    })
    .await?;
    tracing::info!(node = a.member.node, arriving = a.arriving, "instance serving");
    crate::shutdown_signal().await;
    if let Some(i) = &held {
        crate::stop_gracefully(a.member.node, crate::GRACE, i.stop_and_wait()).await;
    }
    ep.leave().await;
    drop(held);
    Ok(())
}

/// Runs the comparison.
pub(crate) fn run(a: LiveArgs) -> anyhow::Result<()> {
    let no_rate = a.link_mbit.is_empty() || a.link_mbit.contains(&0);
    if a.policies.is_empty() || a.burst <= 0.0 || a.burst_s <= 0.0 || no_rate || a.max_batch == 0 {
        bail!("--policies, --burst, --burst-s, --link-mbit and --max-batch must be non-empty/positive");
    }
    if a.max_coop == 0 || a.rounds == 0 {
        bail!("--max-coop and --rounds must be positive");
    }
    if a.link_mbit.len() > 1 && (!a.netns || a.driver.is_some()) {
        bail!("several --link-mbit rates need --netns: without it no link is shaped");
    }
    // A policy named twice ran twice a round and entered its medians twice; a rate named twice
    // ran the whole comparison again into the same `OUT/<rate>mbit/`, over the first.
    if let Some(p) = crate::first_repeat(&a.policies) {
        bail!("--policies names {} twice", p.name());
    }
    if let Some(r) = crate::first_repeat(&a.link_mbit) {
        bail!("--link-mbit names {r} twice");
    }
    // The plot is drawn after every round has run: say now, not minutes later, that it will not be.
    if a.driver.is_none() {
        if let Err(e) = crate::plot::register_font(&a.font) {
            eprintln!("warning: {e:#}: the runs go ahead, but live.png will not be drawn");
        }
    }
    // The driver, in a namespace, finds what its launcher fetched.
    crate::models::ensure_minilm(&a.model, a.driver.is_none())?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let a = LiveArgs { out: std::fs::canonicalize(&a.out)?, model: std::fs::canonicalize(&a.model)?, ..a };
    if let Some(cluster) = a.driver.clone() {
        let policy = a.policies[0];
        return runtime()?.block_on(driver::drive(&a, &cluster, policy, a.round));
    }
    if a.netns {
        if let Some(why) = Netns::unavailable() {
            bail!("--netns: {why}");
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "live autoscaling of all-MiniLM-L6-v2: each instance computes on one thread pinned to a core \
         of its own (standing for one GPU); this machine has {cores} cores{}",
        if cores < 2 { " — the second instance cannot add capacity here" } else { "" }
    );
    if a.link_mbit.len() == 1 {
        return compare(&a).map(drop);
    }
    let mut rows = Vec::new();
    for &mbit in &a.link_mbit {
        println!("— links at {mbit} Mbit/s —");
        let out = a.out.join(format!("{mbit}mbit"));
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        let one = LiveArgs { link_mbit: vec![mbit], out, ..a.clone() };
        rows.push((mbit, compare(&one)?));
    }
    report::sweep(&a, &rows)
}

/// The comparison at one link rate: every round, every policy; the report.
fn compare(a: &LiveArgs) -> anyhow::Result<report::Ratios> {
    let mut rounds = Vec::new();
    for round in 0..a.rounds.max(1) {
        // Each round starts with another policy, so that none always runs first or last.
        let k = a.policies.len();
        let mut runs: Vec<Option<driver::PolicyRun>> = vec![None; k];
        let mut rate = None;
        for i in 0..k {
            let p = (round + i) % k;
            let policy = a.policies[p];
            let one = LiveArgs { policies: vec![policy], rate_rps: rate, ..a.clone() };
            let r = run_policy(&one, policy, round)?;
            println!("round {}: {}", round + 1, report::line(&r));
            rate = Some(r.rate_rps);
            runs[p] = Some(r);
        }
        rounds.push(runs.into_iter().flatten().collect());
    }
    report::write(a, &rounds)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// One policy on a fresh cluster: node 0 drives, node 1 holds the model, node 2 starts empty
/// (and with `--source pool`, node 3 holds the pool's copy).
fn run_policy(a: &LiveArgs, policy: LivePolicy, round: usize) -> anyhow::Result<driver::PolicyRun> {
    let exe = std::env::current_exe().context("locating the cascade binary")?;
    let exe = exe.to_str().context("binary path")?.to_string();
    let dir = driver::run_dir(&a.out, round, policy);
    std::fs::create_dir_all(&dir)?;
    let record = dir.join("run.json");
    let _ = std::fs::remove_file(&record);
    let n = a.source.nodes();
    if a.netns {
        let mut net = Netns::create(n, Some(a.link()))?;
        let addrs: Vec<std::net::SocketAddr> = (0..n).map(|i| (Netns::addr(i), 7500).into()).collect();
        let cluster = crate::demo::write_cluster(&dir, &addrs, &dir)?;
        for i in 1..n {
            let mut c = net.command(i, &exe);
            instance_args(&mut c, a, &cluster, i, &dir)?;
            net.spawn(c)?;
        }
        let mut c = net.command(0, &exe);
        c.arg("live").arg("--driver").arg(&cluster).arg("--policies").arg(policy.name());
        c.args(["--round", &round.to_string()]);
        driver_args(&mut c, a);
        c.env("CASCADE_SECRET", SECRET);
        let mut driver = c.spawn().context("running the driver in its namespace")?;
        cascade_devcluster::kill_on_interrupt(driver.id());
        // A node that exits during the run ends it at once, with what the node said: the
        // driver would otherwise wait out its mesh timeout (120 s) and blame the connection.
        let status = loop {
            if let Some(status) = driver.try_wait()? {
                break Ok(status);
            }
            if let Some((k, status)) = net.exited() {
                let _ = driver.kill();
                let _ = driver.wait();
                break Err(node_exited(&dir, k + 1, status));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        cascade_devcluster::reaped(driver.id());
        crate::demo::stop_hosts(&mut net, &dir);
        if !status?.success() {
            bail!("{} failed (logs in {})", policy.name(), dir.display());
        }
    } else {
        let addrs = cascade_devcluster::free_addrs(n);
        if addrs.len() != n {
            bail!("could not reserve {n} loopback ports");
        }
        let cluster = crate::demo::write_cluster(&dir, &addrs, &dir)?;
        let mut children = Vec::new();
        for i in 1..n {
            let mut c = Command::new(&exe);
            instance_args(&mut c, a, &cluster, i, &dir)?;
            children.push(cascade_devcluster::process::spawn_node(&mut c).context("starting an instance")?);
        }
        std::env::set_var("CASCADE_SECRET", SECRET);
        let res = runtime()?.block_on(async {
            tokio::select! {
                r = driver::drive(a, &cluster, policy, round) => r,
                e = watch_nodes(&dir, || cascade_devcluster::process::first_exited(&mut children)) => Err(e),
            }
        });
        crate::demo::stop_nodes(children, &dir);
        res?;
    }
    let text = std::fs::read_to_string(&record).with_context(|| format!("reading {}", record.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Resolves, with [`node_exited`]'s error, when `exited` (polled every 100 ms) finds one of the
/// run's node processes exited (node `i + 1` at index `i`): none does before the run is done
/// with it.
pub(crate) async fn watch_nodes(
    dir: &Path,
    mut exited: impl FnMut() -> Option<(usize, std::process::ExitStatus)>,
) -> anyhow::Error {
    loop {
        if let Some((k, status)) = exited() {
            return node_exited(dir, k + 1, status);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A node that exited before its run ended, with the last lines of its log (where it said why):
/// `dir/node-{node}.log`.
fn node_exited(dir: &Path, node: usize, status: std::process::ExitStatus) -> anyhow::Error {
    exited_early(dir, node, &format!("exited ({status})"))
}

/// "node N `how` before the run ended", with the last lines of its log `dir/node-{node}.log`.
pub(crate) fn exited_early(dir: &Path, node: usize, how: &str) -> anyhow::Error {
    let log = dir.join(format!("node-{node}.log"));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(3)..].join("\n");
    anyhow::anyhow!("node {node} {how} before the run ended; the end of {}:\n{tail}", log.display())
}

fn instance_args(c: &mut Command, a: &LiveArgs, cluster: &Path, i: usize, dir: &Path) -> anyhow::Result<()> {
    c.arg("instance").arg("--cluster").arg(cluster).args(["--node", &i.to_string(), "--ready-timeout-s", "120"]);
    c.arg("--model").arg(&a.model).args(["--max-batch", &a.max_batch.to_string()]);
    // Old and new compute, each on a core of its own (of those this process may use: a
    // container's cpuset may start above 0); the pool node only holds its copy.
    if i as u32 == OLD || i as u32 == NEW {
        let cores = cascade_exec::serve::allowed_cores().context("reading this process's CPU affinity")?;
        if let Some(core) = cores.get(i - 1) {
            c.args(["--core", &core.to_string()]);
        }
    }
    if i as u32 == NEW {
        c.arg("--arriving");
    }
    // One compute thread per instance: candle's matmuls follow rayon's thread count.
    // Node logs at CASCADE_LIVE_LOG (a RUST_LOG filter; default info).
    let log = std::env::var("CASCADE_LIVE_LOG").unwrap_or_else(|_| "info".into());
    c.env("CASCADE_SECRET", SECRET).env("RAYON_NUM_THREADS", "1").env("RUST_LOG", log);
    c.env("XDG_RUNTIME_DIR", dir);
    let log = std::fs::File::create(dir.join(format!("node-{i}.log")))?;
    c.stdout(Stdio::null()).stderr(log);
    Ok(())
}

fn driver_args(c: &mut Command, a: &LiveArgs) {
    c.arg("--model").arg(&a.model).arg("--netns").args(["--link-mbit", &a.link().to_string()]);
    c.args(["--burst", &a.burst.to_string(), "--burst-s", &a.burst_s.to_string()]);
    c.args(["--scale-after-s", &a.scale_after_s.to_string(), "--max-batch", &a.max_batch.to_string()]);
    c.args(["--max-coop", &a.max_coop.to_string(), "--source", a.source.name()]);
    if let Some(r) = a.rate_rps {
        c.args(["--rate-rps", &r.to_string()]);
    }
    c.arg("--out").arg(&a.out).arg("--font").arg(&a.font);
}
