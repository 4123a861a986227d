//! `multicast`: load a synthetic model onto N targets from one source through a planner, on
//! separate node processes — in namespaced hosts with shaped links (`--netns`, root) or on
//! loopback (unshaped) — and report the time until the last target holds every byte, verified.
//!
//! `multicast --targets N --bytes S --link-mbit B --planner blitz|chain|star|tree [--netns] --json`
//! → `{planner, targets, bytes, link_mbit, seconds, bound_seconds, ...}`, bound = S·8/(B·10⁶).
//! Without `--netns` nothing is shaped: `link_mbit` and `bound_seconds` are null.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use cascade_devcluster::netns::Netns;
use cascade_multicast::cluster::{Controller, MulticastNode, RunSpec};
use cascade_multicast::{Loc, PlannerKind, Topology};
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig};
use serde_json::{json, Value};

const SECRET: &str = "cascade-multicast-bench";

/// Hidden roles of the benchmark binaries (node daemon, controller).
#[derive(Debug, Clone, clap::Args)]
pub struct RoleArgs {
    /// "node" or "controller" when started by the benchmark itself.
    #[arg(long, hide = true)]
    pub mc_role: Option<String>,
    /// Cluster file of the role.
    #[arg(long, hide = true)]
    pub mc_cluster: Option<PathBuf>,
    /// Node id of the role.
    #[arg(long, hide = true)]
    pub mc_node: Option<u32>,
    /// Topology file (controller).
    #[arg(long, hide = true)]
    pub mc_topology: Option<PathBuf>,
    /// Planner (controller).
    #[arg(long, hide = true)]
    pub mc_planner: Option<PlannerKind>,
    /// Targets (controller).
    #[arg(long, hide = true)]
    pub mc_targets: Option<usize>,
    /// Bytes (controller).
    #[arg(long, hide = true)]
    pub mc_bytes: Option<u64>,
    /// Use shared memory between the (same-host) nodes.
    #[arg(long, hide = true)]
    pub mc_shm: bool,
    /// Per-chunk overhead the planner assumes, seconds (controller).
    #[arg(long, hide = true)]
    pub mc_overhead_s: Option<f64>,
    /// Force this chunk size (controller; calibration).
    #[arg(long, hide = true)]
    pub mc_chunk: Option<u64>,
}

/// The test bed's options, shared by `multicast` and `multicast-sweep`.
#[derive(Debug, Clone, clap::Args)]
pub struct BedArgs {
    /// Model bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub bytes: u64,
    /// Link rate (shaped with --netns).
    #[arg(long, default_value_t = 1000)]
    pub link_mbit: u64,
    /// Run each node in its own network namespace with shaped links (needs root).
    #[arg(long)]
    pub netns: bool,
    /// With --netns: the hosts' link MTU (default Ethernet's 1500; 9000 for jumbo frames, as
    /// data-centre fabrics run).
    #[arg(long)]
    pub mtu: Option<u32>,
    /// Link the nodes (one host) by shared memory instead of loopback tcp.
    #[arg(long)]
    pub shm: bool,
    /// Measure the executor's per-chunk overhead (and on shm the hop rate and what the host's
    /// cores move over all hops together) first and plan with them instead of the defaults.
    #[arg(long)]
    pub calibrate: bool,
}

impl BedArgs {
    /// Starts a bed for up to `max_targets` targets, calibrated first with `--calibrate` (the
    /// calibration is printed on stderr).
    pub fn start(&self, max_targets: usize) -> anyhow::Result<Bed> {
        if max_targets == 0 || self.bytes == 0 || self.link_mbit == 0 {
            bail!("the number of targets, --bytes and --link-mbit must be positive");
        }
        let mut bed = Bed::start_with(self.netns, self.shm, max_targets, self.link_mbit, self.mtu)?;
        if self.calibrate {
            // The planner is told this bed's measured per-chunk overhead (and, on shm, hop and host rates).
            bed.calibrate()?;
            eprintln!("{}", bed.calibration());
        }
        Ok(bed)
    }
}

/// Joins the cluster; a node starts its multicast service before any peer can reach it.
async fn join(cluster: &std::path::Path, node: u32, serve: bool, shm: bool) -> anyhow::Result<Arc<Endpoint>> {
    let mut cfg = EndpointConfig::new(node, ClusterSpec::load(cluster)?, SECRET.as_bytes());
    cfg.shm = shm;
    let ep = Arc::new(Endpoint::bind(cfg).await?);
    if serve {
        MulticastNode::start(ep.clone(), Duration::from_secs(60))?;
    }
    ep.open();
    ep.wait_ready(Duration::from_secs(30)).await?;
    Ok(ep)
}

/// Runs a hidden role if asked to; `Ok(true)` when one ran.
pub fn run_role(r: &RoleArgs) -> anyhow::Result<bool> {
    let Some(role) = r.mc_role.as_deref() else { return Ok(false) };
    let (Some(cluster), Some(node)) = (&r.mc_cluster, r.mc_node) else { bail!("role needs a cluster and a node") };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let ep = join(cluster, node, role == "node", r.mc_shm).await?;
        match role {
            // Serves until the benchmark kills this process.
            "node" => std::future::pending::<()>().await,
            "controller" => {
                let text = std::fs::read_to_string(r.mc_topology.as_ref().context("topology")?)?;
                let (n, bytes) = (r.mc_targets.context("targets")?, r.mc_bytes.context("bytes")?);
                let targets = (2..2 + n as u32).map(|i| Loc::gpu(i, 0)).collect();
                let mut spec =
                    RunSpec::synthetic(Topology::from_toml(&text)?, bytes, vec![Loc::gpu(1, 0)], targets, 0x5eed);
                spec.planner = r.mc_planner.context("planner")?;
                if let Some(o) = r.mc_overhead_s {
                    spec.cost.chunk_overhead_s = o;
                }
                if let Some(c) = r.mc_chunk {
                    (spec.cost.min_chunk, spec.cost.max_chunk) = (c, c);
                }
                spec.layers = (0..8u64).map(|i| i * bytes / 8..(i + 1) * bytes / 8).filter(|l| !l.is_empty()).collect();
                spec.deadline = Duration::from_secs(300);
                let out = Controller::new(ep.clone())?.run(&spec).await?;
                println!(
                    "{}",
                    json!({
                        "seconds": out.transfer_seconds, "setup_seconds": out.setup_seconds, "completed": out.report.completed.len(),
                        "verified": out.verified.len(), "failed": out.report.failed.len(),
                        "failures": out.report.failed.iter().map(|(l, why)| format!("{l}: {why}")).collect::<Vec<_>>(),
                        "predicted_seconds": out.plan.makespan(), "chunk_bytes": out.plan.chunk_bytes,
                    })
                );
                ep.shutdown();
            }
            other => bail!("unknown role {other}"),
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(true)
}

/// A running test bed: one source, up to `max_targets` targets, a controller slot; node processes
/// serve every run started on it.
pub struct Bed {
    net: Option<Netns>,
    shm: bool,
    hosts: usize,
    /// The link rate the planner is told, Gbit/s: on namespaced hosts the TCP payload rate the
    /// shaped link carries (its rate less each frame's headers,
    /// [`Netns::tcp_payload_share`]), memcpy's measured one on shared memory, the nominal
    /// `link_mbit` on loopback tcp.
    pub link_gbps: f64,
    /// The per-chunk overhead the planner is told, seconds (from [`Bed::calibrate`]).
    pub chunk_overhead_s: Option<f64>,
    /// On shared memory: what the host's cores move over all hops together, Gbit/s (from
    /// [`Bed::calibrate`]); the planner splits it among the hops of a run.
    pub machine_gbps: Option<f64>,
    exe: PathBuf,
    dir: PathBuf,
    children: Vec<Child>,
    /// The shaped rate, if any.
    pub link_mbit: Option<u64>,
    /// The namespaced hosts' link MTU, if namespaced.
    pub mtu: Option<u32>,
}

impl Bed {
    /// Starts the nodes: in namespaces shaped to `link_mbit` with `netns`, else on loopback
    /// (tcp, or shared memory with `shm`).
    pub fn start(netns: bool, max_targets: usize, link_mbit: u64) -> anyhow::Result<Bed> {
        Self::start_with(netns, false, max_targets, link_mbit, None)
    }

    /// As [`Bed::start`]; `shm` links the (loopback) nodes by shared memory; `mtu` sets the
    /// namespaced hosts' link MTU (Ethernet's 1500 when `None`).
    pub fn start_with(
        netns: bool,
        shm: bool,
        max_targets: usize,
        link_mbit: u64,
        mtu: Option<u32>,
    ) -> anyhow::Result<Bed> {
        if netns && shm {
            bail!("namespaced hosts do not share memory: --shm is for one host");
        }
        if mtu.is_some() && !netns {
            bail!("--mtu sets the namespaced hosts' links: it needs --netns");
        }
        let hosts = max_targets + 2; // 0: controller, 1: source, 2..: targets
        let exe = std::env::current_exe()?;
        let dir = std::env::temp_dir().join(format!("cascade-mcbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        // Its cluster file, topology, and every node's socket: gone with the bed, or on Ctrl-C.
        cascade_devcluster::remove_dir_on_interrupt(&dir);
        let (net, addrs): (Option<Netns>, Vec<String>) = if netns {
            if let Some(why) = Netns::unavailable() {
                bail!("--netns: {why}");
            }
            let n = Netns::create_with_mtu(hosts, Some(link_mbit), mtu)?;
            (Some(n), (0..hosts).map(|i| format!("{}:7400", Netns::addr(i))).collect())
        } else {
            let ls: Vec<_> = (0..hosts)
                .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
                .collect::<Result<_, _>>()
                .with_context(|| format!("reserving {hosts} loopback ports, one per node"))?;
            (None, ls.iter().map(|l| l.local_addr().map(|a| a.to_string())).collect::<Result<_, _>>()?)
        };
        // On shared memory no wire sets the rate: memcpy's (256 MiB, what a shm hop does without
        // the control around it) is the first guess, `calibrate` measures the hop itself.
        let link_gbps = if shm {
            crate::p2p::memcpy_gbit(256 << 20)?
        } else if netns {
            link_mbit as f64 / 1000.0 * Netns::tcp_payload_share(mtu.unwrap_or(1500))
        } else {
            link_mbit as f64 / 1000.0
        };
        let mut cluster = format!("name = \"mcbench{}\"\n", std::process::id());
        for (i, a) in addrs.iter().enumerate() {
            cluster += &format!("[[nodes]]\nid = {i}\naddr = \"{a}\"\n");
        }
        std::fs::write(dir.join("cluster.toml"), cluster)?;
        let mut bed = Bed {
            net,
            shm,
            hosts,
            link_gbps,
            chunk_overhead_s: None,
            machine_gbps: None,
            exe,
            dir,
            children: Vec::new(),
            link_mbit: netns.then_some(link_mbit),
            mtu: if netns { Some(mtu.unwrap_or(1500)) } else { None },
        };
        bed.set_link_gbps(link_gbps)?;
        for i in 1..hosts {
            let mut c = bed.command(i);
            c.args(["--mc-role", "node", "--mc-node", &i.to_string()]).stdout(Stdio::null());
            bed.spawn(c)?;
        }
        Ok(bed)
    }

    fn command(&self, host: usize) -> Command {
        let mut c = match &self.net {
            Some(n) => n.command(host, self.exe.to_str().unwrap_or_default()),
            None => Command::new(&self.exe),
        };
        c.arg("--mc-cluster").arg(self.dir.join("cluster.toml"));
        if self.shm {
            c.arg("--mc-shm");
        }
        c.env("XDG_RUNTIME_DIR", &self.dir);
        if std::env::var_os("RUST_LOG").is_none() {
            c.env("RUST_LOG", "error");
        }
        c
    }

    fn spawn(&mut self, mut c: Command) -> anyhow::Result<()> {
        match &mut self.net {
            // Killed with the namespaces, also when the benchmark is interrupted.
            Some(net) => {
                net.spawn(c)?;
            }
            None => self.children.push(cascade_devcluster::process::spawn_node(&mut c).context("starting a node")?),
        }
        Ok(())
    }

    /// Measures the executor on this bed: one target, 64 MiB (256 MiB on shared memory), moved in 256 KiB and in 8 MiB
    /// chunks (median of three each). The per-chunk overhead is the difference in time over the
    /// difference in chunk count; on shared memory, where no wire sets the rate, the hop's rate
    /// is what the 8 MiB run achieved (copy, crc32 and control together). On shared memory every
    /// hop's bytes are moved by the same host's cores, so a chain of k = cores + 1 targets (more
    /// hops than cores: the host is saturated) in 4 MiB chunks measures what the host moves over
    /// all hops together: inverting the planner's pipeline formula, t = (S + (k − 1)·c)·k / C.
    /// Later runs tell the planner these figures instead of the defaults.
    pub fn calibrate(&mut self) -> anyhow::Result<f64> {
        // On shared memory 64 MiB would stay partly in the caches and overstate the hop's rate.
        let bytes: u64 = if self.shm { 256 << 20 } else { 64 << 20 };
        // Median of three: this kind of machine's run-to-run spread is tens of percent.
        let time = |bed: &Bed, targets: usize, chunk: u64| -> anyhow::Result<f64> {
            let mut t = Vec::new();
            for _ in 0..3 {
                let v = bed.controller(PlannerKind::Chain, targets, bytes, Some(chunk))?;
                t.push(v["seconds"].as_f64().unwrap_or(f64::INFINITY));
            }
            t.sort_by(f64::total_cmp);
            Ok(t[1])
        };
        let (small, large) = (256u64 << 10, 8u64 << 20);
        let (ts, tl) = (time(self, 1, small)?, time(self, 1, large)?);
        let o = ((ts - tl) / ((bytes / small) as f64 - (bytes / large) as f64)).clamp(1e-6, 1e-3);
        self.chunk_overhead_s = Some(o);
        if self.shm {
            let hop_gbps = bytes as f64 * 8.0 / (tl - o * (bytes / large) as f64).max(1e-6) / 1e9;
            self.link_gbps = hop_gbps;
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            let k = (cores + 1).min(self.hosts - 2);
            if k >= 2 {
                let chunk = 4u64 << 20;
                let tk = time(self, k, chunk)?;
                let moved = (bytes + (k as u64 - 1) * chunk) as f64 * k as f64;
                self.machine_gbps = Some(moved * 8.0 / tk.max(1e-6) / 1e9);
            }
            self.write_topology()?;
        }
        Ok(o)
    }

    /// What [`Bed::calibrate`] measured, in one line.
    pub fn calibration(&self) -> String {
        let mut line = format!("calibrated: link {:.1} Gbit/s", self.link_gbps);
        if let Some(o) = self.chunk_overhead_s {
            line += &format!(", chunk overhead {:.0} µs", o * 1e6);
        }
        if let Some(m) = self.machine_gbps {
            line += &format!(", host {m:.1} Gbit/s over all hops");
        }
        line
    }

    /// The rate the planner assumes for every node's link (the topology file the controller reads).
    fn set_link_gbps(&mut self, gbps: f64) -> anyhow::Result<()> {
        self.link_gbps = gbps;
        self.write_topology()
    }

    /// Writes the topology file the controller reads: every node's link at `link_gbps`, and on
    /// shared memory, once measured, every node on one machine of `machine_gbps`.
    fn write_topology(&self) -> anyhow::Result<()> {
        let gbps = self.link_gbps;
        let mut topo: String =
            (0..self.hosts).map(|i| format!("[[nodes]]\nid = {i}\ngpus = 1\nnic_gbps = {gbps}\n")).collect();
        if let Some(m) = self.machine_gbps {
            let nodes: Vec<String> = (0..self.hosts).map(|i| i.to_string()).collect();
            topo += &format!("[[machines]]\nnodes = [{}]\ncopy_gbps = {m}\n", nodes.join(", "));
        }
        std::fs::write(self.dir.join("topo.toml"), topo)?;
        Ok(())
    }

    fn controller(
        &self,
        planner: PlannerKind,
        targets: usize,
        bytes: u64,
        chunk: Option<u64>,
    ) -> anyhow::Result<Value> {
        let mut c = self.command(0);
        c.args(["--mc-role", "controller", "--mc-node", "0", "--mc-planner", &planner.to_string()]);
        c.args(["--mc-targets", &targets.to_string(), "--mc-bytes", &bytes.to_string(), "--mc-topology"]);
        c.arg(self.dir.join("topo.toml"));
        if let Some(o) = self.chunk_overhead_s {
            c.args(["--mc-overhead-s", &o.to_string()]);
        }
        if let Some(ch) = chunk {
            c.args(["--mc-chunk", &ch.to_string()]);
        }
        let child = c
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("running the controller")?;
        // Killed too when the benchmark is interrupted while it runs.
        let pid = child.id();
        cascade_devcluster::kill_on_interrupt(pid);
        let out = child.wait_with_output().context("running the controller");
        cascade_devcluster::reaped(pid);
        let out = out?;
        if !out.status.success() {
            bail!("controller failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        serde_json::from_slice(&out.stdout).context("controller output")
    }

    /// The namespaced hosts, if the bed has them.
    pub fn net(&self) -> Option<&Netns> {
        self.net.as_ref()
    }

    /// The bed's scratch directory (removed with the bed).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// One run: `targets` targets, `bytes` bytes, through `planner`.
    pub fn run(&self, planner: PlannerKind, targets: usize, bytes: u64) -> anyhow::Result<Value> {
        let v = self.controller(planner, targets, bytes, None)?;
        if v["completed"] != json!(targets) || v["verified"] != json!(targets) {
            bail!("not every target completed with the source's bytes: {v}");
        }
        let bound = self.link_mbit.map(|b| bytes as f64 * 8.0 / (b as f64 * 1e6));
        Ok(json!({
            "planner": planner, "targets": targets, "bytes": bytes, "link_mbit": self.link_mbit,
            "seconds": v["seconds"], "setup_seconds": v["setup_seconds"], "bound_seconds": bound, "netns": self.net.is_some(), "mtu": self.mtu, "shm": self.shm,
            "predicted_seconds": v["predicted_seconds"], "chunk_bytes": v["chunk_bytes"], "verified": v["verified"],
            "link_gbps": self.link_gbps, "chunk_overhead_s": self.chunk_overhead_s, "machine_gbps": self.machine_gbps,
        }))
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.net = None; // deletes the namespaces
        let _ = std::fs::remove_dir_all(&self.dir);
        cascade_devcluster::keep_dir(&self.dir);
    }
}
