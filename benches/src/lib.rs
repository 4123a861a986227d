//! # cascade-benches
//!
//! Benchmark binaries (`src/bin/`), each printing one JSON object with `--json` (fields as in
//! DESIGN.md), and the helper they share: every benchmark runs its peers as separate processes —
//! the same binary started in the hidden peer role — so that bytes really cross process
//! boundaries through the transport.
#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, NodeSpec, RegionId, RemoteKey, RemoteRegion};

/// Lets a closed stdout end the process quietly, killed by SIGPIPE as Unix tools are (`| head`),
/// instead of panicking in `println!`; any other failure to write stdout (a full disk) is said
/// in one line ([`quiet_panic_on_closed_stdout`]). Only for binaries that open no socket: with
/// SIGPIPE at its default, a write to a peer that reset its connection would kill the process
/// too, where the transport expects EPIPE as an error. Call it first in `main`, before any
/// thread exists.
pub fn exit_quietly_on_closed_stdout() {
    // SAFETY: restores a signal's default disposition; called at start-up before any thread
    // exists, so no other thread is changing or relying on the disposition meanwhile.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    quiet_panic_on_closed_stdout();
}

/// For binaries that open sockets, where SIGPIPE must stay ignored: a closed stdout (`| head`)
/// makes `println!` panic, and [`cascade_transport::stdout::report_write_failures_briefly`]
/// keeps that panic quiet — no message, no backtrace — while it unwinds as any panic does, so
/// the peers are stopped and the temporary directory is removed on the way out (exit status
/// 101); any other failure to write stdout (a full disk) is said in one line. Call it first in
/// `main`.
pub fn quiet_panic_on_closed_stdout() {
    cascade_transport::stdout::report_write_failures_briefly();
}

/// Secret the benchmark clusters share.
pub const SECRET: &[u8] = b"cascade-bench";

/// A temporary cluster: its file, its directory, and the peers running in it.
pub struct BenchCluster {
    /// Membership (node 0 is the benchmark process itself).
    pub spec: ClusterSpec,
    /// Directory holding the cluster file and sockets.
    pub dir: PathBuf,
    peers: Vec<Child>,
    /// Region of each peer (index = node id − 1).
    pub regions: Vec<RemoteRegion>,
}

impl BenchCluster {
    /// Writes a cluster of `n` loopback nodes and starts nodes 1..n as peer processes of `exe`,
    /// each registering a region of `region_bytes` filled with a pattern; `extra` is appended to
    /// each peer's command line.
    pub fn start(exe: &str, n: usize, region_bytes: u64, shm: bool, extra: &[&str]) -> anyhow::Result<BenchCluster> {
        let ls: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
        let nodes = ls
            .iter()
            .enumerate()
            .map(|(i, l)| Ok(NodeSpec { id: i as u32, addr: l.local_addr()?, host: None }))
            .collect::<anyhow::Result<Vec<_>>>()?;
        drop(ls);
        let name = format!("bench{}", std::process::id());
        let spec = ClusterSpec::new(name.clone(), nodes)?;
        let dir = std::env::temp_dir().join(format!("cascade-{name}"));
        std::fs::create_dir_all(&dir)?;
        // Its cluster file and every node's socket (node 0's too): gone with the cluster, or on
        // Ctrl-C (the peers stop at the end of their standard input).
        cascade_devcluster::remove_dir_on_interrupt(&dir);
        let mut toml = format!("name = \"{name}\"\n");
        for n in &spec.nodes {
            toml += &format!("[[nodes]]\nid = {}\naddr = \"{}\"\n", n.id, n.addr);
        }
        let file = dir.join("cluster.toml");
        std::fs::write(&file, toml)?;
        let mut c = BenchCluster { spec, dir: dir.clone(), peers: vec![], regions: vec![] };
        for id in 1..n {
            let mut cmd = Command::new(exe);
            cmd.args(["--role", "peer", "--cluster"]).arg(&file).args(["--node", &id.to_string()]);
            cmd.args(["--region-bytes", &region_bytes.to_string()]);
            if shm {
                cmd.arg("--shm");
            }
            cmd.args(extra);
            cmd.env("XDG_RUNTIME_DIR", &dir).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
            c.peers.push(cmd.spawn().with_context(|| format!("starting peer {id}"))?);
        }
        for (i, p) in c.peers.iter_mut().enumerate() {
            let out = p.stdout.take().context("peer stdout")?;
            let mut line = String::new();
            BufReader::new(out).read_line(&mut line)?;
            let v: serde_json::Value =
                serde_json::from_str(&line).with_context(|| format!("peer {} printed {line:?}", i + 1))?;
            let field = |k: &str| v[k].as_u64().with_context(|| format!("peer {} lacks {k}: {line}", i + 1));
            c.regions.push(RemoteRegion {
                node: (i + 1) as u32,
                id: RegionId(field("id")? as u32),
                key: RemoteKey(field("key")?),
                len: field("len")?,
            });
        }
        Ok(c)
    }

    /// Endpoint settings for node 0 in this cluster.
    pub fn config(&self, shm: bool) -> EndpointConfig {
        let mut cfg = EndpointConfig::new(0, self.spec.clone(), SECRET);
        cfg.shm = shm;
        cfg.runtime_dir = self.dir.clone();
        cfg
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        for p in &mut self.peers {
            drop(p.stdin.take()); // EOF tells the peer to stop
        }
        for p in &mut self.peers {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = p.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = p.kill();
            let _ = p.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        cascade_devcluster::keep_dir(&self.dir);
    }
}

pub mod incast;
pub mod mpi;
pub mod multicast;
pub mod p2p;

/// Arguments of the hidden peer role.
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// "peer" when started by a benchmark as one of its peers.
    #[arg(long, hide = true, default_value = "main")]
    pub role: String,
    /// Cluster file (peer role).
    #[arg(long, hide = true)]
    pub cluster: Option<PathBuf>,
    /// Node id (peer role).
    #[arg(long, hide = true)]
    pub node: Option<u32>,
    /// Region size (peer role).
    #[arg(long, hide = true, default_value_t = 0)]
    pub region_bytes: u64,
    /// Use shared memory (peer role).
    #[arg(long, hide = true)]
    pub shm: bool,
}

/// Runs a peer: join, register and fill a region, print its descriptor, serve until stdin closes.
pub async fn run_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let (Some(file), Some(node)) = (&a.cluster, a.node) else { bail!("peer role needs --cluster and --node") };
    let spec = ClusterSpec::load(file)?;
    let mut cfg = EndpointConfig::new(node, spec, SECRET);
    cfg.shm = a.shm;
    let ep = Endpoint::start(cfg).await?;
    let r = ep.alloc(a.region_bytes)?;
    let mut off = 0;
    while off < r.len() {
        let n = 4096.min(r.len() - off);
        // SAFETY: the region is not registered yet: nobody else can reach it.
        unsafe { r.fill(off, n, (off / 4096 % 251) as u8 + u8::try_from(node % 4).unwrap_or(0))? };
        off += n;
    }
    ep.register(&r)?;
    println!("{}", serde_json::json!({"id": r.id().0, "key": r.key().0, "len": r.len()}));
    let mut stdin = tokio::io::stdin();
    let mut sink = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stdin, &mut sink).await.ok();
    ep.shutdown();
    Ok(())
}

/// Median of samples (sorts them in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Percentile helper over microsecond samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Entry point of every benchmark binary: serve as a peer when started as one, else run `bench`
/// on a runtime with `threads` workers (1 = current-thread).
pub fn main_or_peer<F>(peer: &PeerArgs, threads: usize, bench: impl FnOnce() -> F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    if peer.role == "peer" {
        // A harness peer's warnings are its fellow peers leaving at teardown (they all stop at
        // once); a failure during the measurement surfaces in the measuring process, which
        // logs at `warn`. RUST_LOG still applies to both.
        init_logging_at("error");
        // Peers serve on one thread: on a small machine, fewer runnable threads means less jitter.
        return tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run_peer(peer));
    }
    init_logging();
    incast::runtime(threads)?.block_on(bench())
}

/// Logging to stderr, warnings and errors unless RUST_LOG says otherwise.
pub fn init_logging() {
    init_logging_at("warn");
}

/// Logging to stderr at `level` unless RUST_LOG says otherwise.
fn init_logging_at(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into());
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter).try_init();
}

/// Registers the font at `path` as plotters' "sans-serif" (the plots' text).
pub fn register_font(path: &std::path::Path) -> anyhow::Result<()> {
    let font = std::fs::read(path)
        .with_context(|| format!("reading font {} (apt-get install fonts-dejavu-core)", path.display()))?;
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{} is not a usable font", path.display()))
}
