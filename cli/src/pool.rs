//! `cascade pool …`: run the pool manager, and the operator's tools that talk to it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use cascade_multicast::MeshRates;
use cascade_param_pool::manager::epoch::moves_from_plans;
use cascade_param_pool::manager::{
    admin_call, serve_admin, AdminAddr, AdminListener, AdminRequest, CheckReport, Manager, ManagerConfig, Status,
};
use cascade_param_pool::EmbeddedStore;
use clap::{Args, Subcommand};

use crate::{join, shutdown_signal, Member};

pub(crate) mod progress;

#[derive(Subcommand)]
pub(crate) enum PoolCmd {
    /// Run the pool manager: a cluster member that keeps every model at k copies and repairs the
    /// pool when a node dies. Its metadata lives in --data-dir.
    Serve(ServeArgs),
    /// Print the pool: models, copies, nodes, bytes.
    Status(Admin),
    /// Verify the invariant and every copy's checksums; exit 0 when healthy, 1 otherwise.
    Check(Admin),
    /// Every pool node: live, suspect, dead or returning, with what happened to it.
    Nodes(Admin),
    /// Drop the copies the nodes hold for other pools (listed as foreign by `status`). The
    /// manager never does this on its own.
    DropForeign(Admin),
    /// Repair what a check finds (unreachable nodes, bad, unknown or unfinished copies), then check.
    Repair(Admin),
    /// Register a safetensors model file; its first k copies are loaded from the file.
    Register {
        #[command(flatten)]
        admin: Admin,
        /// Model name.
        #[arg(long)]
        name: String,
        /// The safetensors file (a path every node can read).
        #[arg(long)]
        file: PathBuf,
    },
    /// Start a serving instance of a model on a node's GPU (its parameters come from the pool).
    Deploy {
        #[command(flatten)]
        admin: Admin,
        /// The model: its id, or the name it was registered under.
        #[arg(long)]
        model: String,
        /// Node.
        #[arg(long)]
        node: u32,
        /// GPU index.
        #[arg(long, default_value_t = 0)]
        gpu: u32,
    },
    /// Take a node out of service without ever dropping below k copies: every copy it holds is
    /// made elsewhere first, then dropped there; nothing new is placed on it. Exits 0 once it
    /// holds nothing (stop it then), 1 if some copies could not be moved.
    Drain {
        #[command(flatten)]
        admin: Admin,
        /// Node.
        #[arg(long)]
        node: u32,
    },
    /// Take a drained node back: copies may be placed on it again.
    Undrain {
        #[command(flatten)]
        admin: Admin,
        /// Node.
        #[arg(long)]
        node: u32,
    },
    /// Carry out an epoch plan (`epoch-plan --json` of the sched benches): every model whose
    /// sub-cluster changed gets instances (GPU 0) on the nodes of its new sub-cluster by one
    /// multicast through the pool, then its instances on the old one go.
    ApplyEpoch {
        #[command(flatten)]
        admin: Admin,
        /// The new epoch's plan (its `assignment`: model index → sub-cluster).
        #[arg(long)]
        plan: PathBuf,
        /// The previous epoch's plan: only models that changed sub-cluster move. Without it,
        /// every model is placed on its sub-cluster (the first epoch).
        #[arg(long)]
        previous: Option<PathBuf>,
        /// The pool's model of each of the plan's models, in the plan's order: its id or the
        /// name it was registered under.
        #[arg(long, value_delimiter = ',', required = true)]
        models: Vec<String>,
        /// The nodes of each sub-cluster: `1,2;3,4` is sub-cluster 0 = nodes 1 and 2,
        /// sub-cluster 1 = nodes 3 and 4.
        #[arg(long)]
        sub_clusters: String,
    },
    /// Look at (or, explicitly, salvage) an embedded store's write-ahead log. The manager refuses
    /// to start on a damaged log rather than lose what follows the damage; these are the tools.
    Wal {
        #[command(subcommand)]
        what: WalCmd,
    },
}

impl PoolCmd {
    /// Every pool command but the manager itself prints its result and exits.
    pub(crate) fn prints_and_exits(&self) -> bool {
        !matches!(self, PoolCmd::Serve(_))
    }
}

#[derive(Subcommand)]
pub(crate) enum WalCmd {
    /// Check the log; exit 0 when recovery would accept it, 1 otherwise. Changes nothing.
    Verify(WalArgs),
    /// Print the intact records, one JSON event per line. Changes nothing.
    Dump(WalArgs),
    /// Keep the intact prefix and give up everything from the first damaged record on (the
    /// original is kept beside it as wal.log.damaged-<time>). Run with the manager stopped.
    Salvage(WalArgs),
}

#[derive(Args)]
pub(crate) struct WalArgs {
    /// The manager's --data-dir.
    #[arg(long)]
    data_dir: PathBuf,
}

#[derive(Args)]
pub(crate) struct Admin {
    /// The manager's admin address: a unix socket path (default: cascade-pool.sock in
    /// $XDG_RUNTIME_DIR or the temp dir) or host:port (then the cluster secret is needed).
    #[arg(long)]
    admin: Option<AdminAddr>,
    /// File holding the cluster secret, for a TCP admin address (or set CASCADE_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

impl Admin {
    /// The ids of `models`, each given as an id or the name it was registered under (a number
    /// is an id when a model has it, else a name). One that names no model is refused, with
    /// the models there are.
    async fn model_ids(&self, models: &[String]) -> anyhow::Result<Vec<u32>> {
        let status: Status = serde_json::from_value(self.call(AdminRequest::Status).await?)?;
        models
            .iter()
            .map(|m| {
                let by_id = m.parse::<u32>().ok().filter(|id| status.models.iter().any(|s| s.id == *id));
                let by_name = || status.models.iter().find(|s| s.name == *m).map(|s| s.id);
                by_id.or_else(by_name).ok_or_else(|| {
                    let known: Vec<String> = status.models.iter().map(|s| format!("{} ({:?})", s.id, s.name)).collect();
                    let known = if known.is_empty() { "none".to_string() } else { known.join(", ") };
                    anyhow::anyhow!("no model has the id or name {m:?}; the pool's models: {known}")
                })
            })
            .collect()
    }

    async fn call(&self, req: AdminRequest) -> anyhow::Result<serde_json::Value> {
        let addr = self.admin.clone().unwrap_or_else(AdminAddr::default_unix);
        let secret = match addr {
            AdminAddr::Tcp(_) => crate::read_secret(self.secret_file.as_deref())?,
            AdminAddr::Unix(_) => Vec::new(),
        };
        Ok(admin_call(&addr, &secret, &req).await?)
    }
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    member: Member,
    /// Where the metadata lives: `embedded` (a write-ahead log and snapshots in --data-dir) or
    /// `etcd` (--etcd-endpoints; needs a build with the `etcd` feature).
    #[arg(long, default_value = "embedded")]
    meta: String,
    /// Metadata directory of the embedded store.
    #[arg(long, required_if_eq("meta", "embedded"))]
    data_dir: Option<PathBuf>,
    /// Create a new pool in an empty store (refused if the store holds one). Without it, a store
    /// that holds no pool is refused: a mistyped path never starts an empty pool.
    #[arg(long)]
    init: bool,
    /// etcd endpoints, comma separated (e.g. http://127.0.0.1:2379).
    #[arg(long, value_delimiter = ',', required_if_eq("meta", "etcd"))]
    etcd_endpoints: Vec<String>,
    /// Key prefix of the pool's metadata in etcd.
    #[arg(long, default_value = "/cascade/pool")]
    etcd_prefix: String,
    /// Admin address: a unix socket path, mode 0600 (default: cascade-pool.sock in
    /// $XDG_RUNTIME_DIR or the temp dir), or host:port, where every client must prove it holds
    /// the cluster secret.
    #[arg(long)]
    admin: Option<AdminAddr>,
    /// Copies required per model, for a new pool (--init); an existing pool keeps its own k.
    #[arg(long, default_value_t = 1)]
    k: usize,
    /// Seconds a node's link may stay down before the node is declared dead.
    #[arg(long, default_value_t = 1.0, value_parser = crate::seconds)]
    dead_after_s: f64,
    /// Pool nodes, comma separated (default: every other cluster member).
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<u32>,
    /// Link rate the planner assumes, Gbit/s.
    #[arg(long, default_value_t = 25.0, value_parser = crate::rate)]
    nic_gbps: f64,
    /// What one host's cores move over all its hops together, Gbit/s: the manager's host and
    /// the pool nodes it reaches by shared memory then share it in the planner's predictions.
    #[arg(long, value_parser = crate::rate)]
    machine_gbps: Option<f64>,
}

pub(crate) fn config(a: &ServeArgs, cluster_nodes: impl Iterator<Item = u32>) -> anyhow::Result<ManagerConfig> {
    if !(a.dead_after_s >= 0.0 && a.dead_after_s.is_finite()) {
        bail!("--dead-after-s must be a non-negative number of seconds");
    }
    if !(a.nic_gbps > 0.0 && a.nic_gbps.is_finite()) {
        bail!("--nic-gbps must be positive");
    }
    let members: Vec<u32> = cluster_nodes.collect();
    let nodes: Vec<u32> = if a.nodes.is_empty() {
        members.iter().copied().filter(|n| *n != a.member.node).collect()
    } else {
        a.nodes.clone()
    };
    if nodes.contains(&a.member.node) {
        bail!("the manager (node {}) cannot be one of the pool's nodes", a.member.node);
    }
    // A node outside the cluster file was waited for, then declared dead and "repaired"; one
    // named twice was taken without a word (and would count twice against k below).
    if let Some(n) = nodes.iter().find(|n| !members.contains(n)) {
        bail!("--nodes names node {n}, which is not in the cluster file");
    }
    if let Some(n) = crate::first_repeat(&nodes) {
        bail!("--nodes names node {n} twice");
    }
    if a.k == 0 {
        bail!("--k must be at least 1");
    }
    // A new pool that could never hold k copies would refuse every register.
    if a.init && a.k > nodes.len() {
        bail!("--k {} exceeds the pool's {} node(s): no model could ever have k copies", a.k, nodes.len());
    }
    let mut cfg = ManagerConfig::new(nodes);
    cfg.k = a.k;
    cfg.init = a.init;
    cfg.dead_after = Duration::from_secs_f64(a.dead_after_s);
    cfg.rates = MeshRates {
        nic_gbps: a.nic_gbps,
        tcp_gbps: a.nic_gbps,
        shm_gbps: 4.0 * a.nic_gbps,
        machine_gbps: a.machine_gbps,
    };
    cfg.ready_timeout = Duration::from_secs_f64(a.member.ready_timeout_s);
    Ok(cfg)
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    if let (false, "embedded", Some(dir)) = (a.init, a.meta.as_str(), a.data_dir.as_ref()) {
        // Before joining or creating anything: a mistyped path is an error, never an empty pool.
        if !EmbeddedStore::exists(dir) {
            bail!("{} holds no pool: start with --init to create one (is the path right?)", dir.display());
        }
    }
    let ep = join(&a.member, false).await?;
    let cfg = config(&a, ep.config().cluster.nodes.iter().map(|n| n.id))?;
    match a.meta.as_str() {
        "embedded" => {
            let dir = a.data_dir.as_ref().context("--data-dir is required with --meta embedded")?;
            let store = EmbeddedStore::open(dir).with_context(|| format!("opening {}", dir.display()))?;
            serve_with(a, ep, store, cfg).await
        }
        #[cfg(feature = "etcd")]
        "etcd" => {
            let eps = a.etcd_endpoints.clone();
            let prefix = a.etcd_prefix.clone();
            let store = tokio::task::spawn_blocking(move || {
                cascade_param_pool::EtcdStore::connect(&eps, &prefix, Duration::from_secs(5))
            })
            .await??;
            serve_with(a, ep, store, cfg).await
        }
        #[cfg(not(feature = "etcd"))]
        "etcd" => bail!("this cascade was built without the `etcd` feature (cargo build --features etcd)"),
        other => bail!("unknown --meta {other:?}: embedded or etcd"),
    }
}

async fn serve_with<S: cascade_param_pool::MetaStore + 'static>(
    a: ServeArgs,
    ep: std::sync::Arc<cascade_transport::Endpoint>,
    store: S,
    cfg: ManagerConfig,
) -> anyhow::Result<()> {
    let mut m = Manager::open(ep.clone(), store, cfg)?;
    let addr = a.admin.clone().unwrap_or_else(AdminAddr::default_unix);
    let secret = crate::read_secret(a.member.secret_file.as_deref())?;
    let listener = AdminListener::bind(&addr, &secret).await.with_context(|| format!("binding {addr}"))?;
    // A stop while it waits for its nodes (or repairs at start) leaves at once, as a stop later
    // does: killed by the signal, it left its admin and same-host sockets behind. What the start
    // had begun is in the log and is carried on at the next start, as after a crash.
    tokio::select! {
        r = m.start() => r?,
        () = shutdown_signal() => {
            tracing::info!("shutting down before the pool started");
            drop(listener);
            ep.leave().await;
            return Ok(());
        }
    }
    tracing::info!(admin = %addr, "pool manager ready");
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(serve_admin(listener, tx, m.status_handle()));
    tokio::select! {
        r = m.run(rx) => r?,
        _ = shutdown_signal() => tracing::info!("shutting down"),
    }
    ep.leave().await;
    Ok(())
}

fn wal(cmd: WalCmd) -> anyhow::Result<()> {
    use cascade_param_pool::meta::wal;
    let dir = |a: &WalArgs| {
        if !a.data_dir.join("wal.log").is_file() {
            bail!("{} holds no write-ahead log (wal.log)", a.data_dir.display());
        }
        Ok(a.data_dir.clone())
    };
    match cmd {
        WalCmd::Verify(a) => {
            let r = wal::verify(&dir(&a)?)?;
            println!("{}", serde_json::to_string(&r)?);
            if !r.ok() {
                std::process::exit(1);
            }
        }
        WalCmd::Dump(a) => {
            for e in wal::dump(&dir(&a)?)? {
                println!("{e}");
            }
        }
        WalCmd::Salvage(a) => println!("{}", serde_json::to_string(&wal::salvage(&dir(&a)?)?)?),
    }
    Ok(())
}

/// `1,2;3,4` → [[1, 2], [3, 4]].
fn parse_sub_clusters(s: &str) -> anyhow::Result<Vec<Vec<u32>>> {
    let groups: Vec<Vec<u32>> = s
        .split(';')
        .map(|g| g.split(',').map(|n| n.trim().parse::<u32>()).collect::<Result<Vec<u32>, _>>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--sub-clusters {s:?}: node ids, ',' within and ';' between sub-clusters"))?;
    if groups.iter().any(|g| g.is_empty()) {
        bail!("--sub-clusters {s:?}: a sub-cluster without nodes");
    }
    Ok(groups)
}

/// The `assignment` array of an `epoch-plan --json` output.
fn read_assignment(path: &std::path::Path) -> anyhow::Result<Vec<usize>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    serde_json::from_value(v["assignment"].clone())
        .with_context(|| format!("{}: no assignment array (an epoch-plan --json output?)", path.display()))
}

fn print_check(rep: &CheckReport, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(rep)?);
    } else {
        println!(
            "{}: {} copies ({} bytes) checked against their manifests",
            if rep.healthy { "healthy" } else { "NOT healthy" },
            rep.copies_checked,
            rep.bytes_checked
        );
        for p in &rep.problems {
            println!("  {p}");
        }
    }
    if !rep.healthy {
        std::process::exit(1);
    }
    Ok(())
}

pub(crate) async fn run(cmd: PoolCmd) -> anyhow::Result<()> {
    match cmd {
        PoolCmd::Serve(a) => serve(a).await,
        PoolCmd::Status(a) => {
            let v = a.call(AdminRequest::Status).await?;
            if a.json {
                println!("{v}");
            } else {
                let s: Status = serde_json::from_value(v)?;
                print!("{s}");
            }
            Ok(())
        }
        PoolCmd::DropForeign(a) => {
            let v = a.call(AdminRequest::DropForeign).await?;
            println!(
                "{}",
                if a.json { v.to_string() } else { format!("dropped {} copies of other pools", v["dropped"]) }
            );
            Ok(())
        }
        PoolCmd::Nodes(a) => {
            let v = a.call(AdminRequest::Nodes).await?;
            if a.json {
                println!("{v}");
            } else {
                let nodes: Vec<cascade_param_pool::manager::NodeReport> = serde_json::from_value(v)?;
                println!("{:>5}  {:<9} {:>14}  {:>6}  history", "node", "state", "bytes", "copies");
                for n in nodes {
                    let last = n.history.last().map(|(t, w)| format!("{t:.1} s: {w}")).unwrap_or_default();
                    println!("{:>5}  {:<9} {:>14}  {:>6}  {}", n.id, n.state, n.bytes, n.copies, last.escape_debug());
                    for (t, w) in n.history.iter().rev().skip(1) {
                        println!("{:>40}  {t:.1} s: {}", "", w.escape_debug());
                    }
                }
            }
            Ok(())
        }
        PoolCmd::Check(a) => print_check(&serde_json::from_value(a.call(AdminRequest::Check).await?)?, a.json),
        PoolCmd::Repair(a) => {
            print_check(&serde_json::from_value(a.call_with_progress(AdminRequest::Repair).await?)?, a.json)
        }
        PoolCmd::Register { admin, name, file } => {
            let file = std::fs::canonicalize(&file).with_context(|| format!("{}", file.display()))?;
            let v = admin.call_with_progress(AdminRequest::Register { name, path: file.display().to_string() }).await?;
            println!("{}", if admin.json { v.to_string() } else { format!("registered model {}", v["model"]) });
            Ok(())
        }
        PoolCmd::Wal { what } => wal(what),
        PoolCmd::ApplyEpoch { admin, plan, previous, models, sub_clusters } => {
            let nodes_of = parse_sub_clusters(&sub_clusters)?;
            let next = read_assignment(&plan)?;
            let previous = previous.as_deref().map(read_assignment).transpose()?;
            let models = admin.model_ids(&models).await?;
            let moves = moves_from_plans(&models, previous.as_deref(), &next, &nodes_of).map_err(anyhow::Error::msg)?;
            let n = moves.len();
            let v = admin.call_with_progress(AdminRequest::ApplyEpoch { moves: moves.clone() }).await?;
            if admin.json {
                println!("{}", serde_json::json!({ "moves": moves, "result": v }));
            } else {
                for m in &moves {
                    println!("model {}: nodes {:?} -> {:?}", m.model, m.from, m.to);
                }
                println!("{} moved", crate::count(n, "model", "models"));
            }
            Ok(())
        }
        PoolCmd::Drain { admin, node } => {
            let v = admin.call_with_progress(AdminRequest::Drain { node }).await?;
            let rep: cascade_param_pool::manager::DrainReport = serde_json::from_value(v.clone())?;
            if admin.json {
                println!("{v}");
            } else if rep.drained {
                println!(
                    "node {node} drained: {} ({} bytes) made elsewhere, {} dropped there, in {:.2} s; it may be stopped",
                    crate::copies(rep.copies_made),
                    rep.bytes_made,
                    crate::copies(rep.copies_dropped),
                    rep.seconds
                );
            } else {
                println!(
                    "node {node} NOT drained: copies {:?} are still there (their replacements could not be made; \
                     see the manager's log); nothing new goes there",
                    rep.left
                );
            }
            if !rep.drained {
                std::process::exit(1);
            }
            Ok(())
        }
        PoolCmd::Undrain { admin, node } => {
            admin.call_with_progress(AdminRequest::Undrain { node }).await?;
            println!("node {node} takes copies again");
            Ok(())
        }
        PoolCmd::Deploy { admin, model, node, gpu } => {
            let model = admin.model_ids(&[model]).await?[0];
            admin.call_with_progress(AdminRequest::Deploy { model, node, gpu }).await?;
            println!("model {model} serving on node {node} gpu{gpu}");
            Ok(())
        }
    }
}
