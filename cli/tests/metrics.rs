//! `/metrics` of running processes: two `cascade node` daemons and a `cascade pool serve`
//! manager, each with `--metrics 0`, scraped over HTTP before and after a multicast between the
//! nodes and a model registered in the pool. The transfer counters, the peers up and the pool's
//! copies must move with what happened.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cascade_param_pool::manager::{admin_call, AdminAddr, AdminRequest};

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

struct Daemon {
    child: Child,
    metrics: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cmd` and waits for the address it serves metrics on (its `metrics: http://…` line).
fn start(mut cmd: Command) -> Daemon {
    cmd.stdout(Stdio::null()).stderr(Stdio::piped()).env("RUST_LOG", "warn");
    let mut child = cmd.spawn().unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("metrics: http://") {
                let _ = tx.send(url.trim_end_matches("/metrics").to_string());
            }
        }
    });
    let metrics = rx.recv_timeout(Duration::from_secs(30)).expect("the process never said where its metrics are");
    Daemon { child, metrics }
}

fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
}

/// The sum of every series of `family` whose labels contain all of `labels`.
fn value(text: &str, family: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(family) && l[family.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `cascade ARGS --cluster FILE --node N --no-shm` with the cluster secret.
fn command(cluster: &std::path::Path, args: &[&str], node: u32) -> Command {
    let mut c = Command::new(CASCADE);
    c.args(args).arg("--cluster").arg(cluster).args(["--node", &node.to_string(), "--no-shm"]);
    c.env("CASCADE_SECRET", "metrics-secret");
    c
}

/// A manager (node 0, admin on `addrs[4]`) and two pool nodes (1, 2), all with `--metrics 0`;
/// node 3 is left for a driver.
struct Cluster {
    dir: std::path::PathBuf,
    cluster: std::path::PathBuf,
    addrs: Vec<std::net::SocketAddr>,
    manager: Daemon,
    nodes: Vec<Daemon>,
}

impl Cluster {
    fn start(tag: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!("cascade-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // 0: pool manager, 1 and 2: nodes, 3: a driver; 4: the manager's admin port.
        let addrs = cascade_tests::free_addrs(5);
        let mut toml = format!("name = \"{tag}{}\"\n", std::process::id());
        for (i, a) in addrs[..4].iter().enumerate() {
            toml += &format!("[[nodes]]\nid = {i}\naddr = \"{a}\"\n");
        }
        let cluster = dir.join("cluster.toml");
        std::fs::write(&cluster, toml).unwrap();
        let mut manager = command(&cluster, &["pool", "serve"], 0);
        manager.arg("--data-dir").arg(dir.join("meta"));
        manager.args(["--init", "--k", "1", "--nodes", "1,2", "--admin", &addrs[4].to_string(), "--metrics", "0"]);
        let manager = start(manager);
        let nodes = (1..=2)
            .map(|n| {
                let mut cmd = command(&cluster, &["node"], n);
                cmd.args(["--metrics", "0", "--ready-timeout-s", "60"]);
                start(cmd)
            })
            .collect();
        Cluster { dir, cluster, addrs, manager, nodes }
    }

    fn cmd(&self, args: &[&str], node: u32) -> Command {
        command(&self.cluster, args, node)
    }

    /// Registers a synthetic model of about `bytes` and returns its id.
    fn register(&self, bytes: u64) -> u64 {
        let model = self.dir.join("model.safetensors");
        cascade_param_pool::synthetic::write_llama2_like(&model, bytes, 7).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let admin = AdminAddr::Tcp(self.addrs[4]);
        let register = AdminRequest::Register { name: "m".into(), path: model.display().to_string() };
        let t = Instant::now();
        loop {
            match rt.block_on(admin_call(&admin, b"metrics-secret", &register)) {
                Ok(v) => return v["model"].as_u64().unwrap(),
                Err(e) => assert!(t.elapsed() < Duration::from_secs(60), "the manager never took the model: {e}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn status(&self) -> serde_json::Value {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(admin_call(&AdminAddr::Tcp(self.addrs[4]), b"metrics-secret", &AdminRequest::Status)).unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn nodes_and_the_pool_manager_serve_metrics_that_move() {
    let c = Cluster::start("metrics");
    let (manager, nodes) = (&c.manager, &c.nodes);
    let before = scrape(&nodes[0].metrics);
    assert_eq!(value(&before, "cascade_transfer_bytes_total", &["op=\"write\""]), 0.0, "{before}");

    // 8 MiB from node 1 to node 2, driven by node 3.
    let mut mc = c.cmd(&["multicast", "--sources", "1/host", "--targets", "2/host", "--bytes", "8388608", "--json"], 3);
    let out = mc.args(["--ready-timeout-s", "60"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The run ends when node 2 verified its copy; over tcp each chunk's notice rides behind its
    // bytes, so node 1 may see its last WRITEs' completions (which its metrics count) a moment
    // after that. Scraped until they are in, for 10 s at most.
    let series = ["op=\"write\"", "backend=\"tcp\"", "peer=\"2\""];
    let t = Instant::now();
    let after = loop {
        let m = scrape(&nodes[0].metrics);
        if value(&m, "cascade_transfer_bytes_total", &series) >= 8388608.0 || t.elapsed() > Duration::from_secs(10) {
            break m;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let written = value(&after, "cascade_transfer_bytes_total", &series);
    assert!(written >= 8388608.0, "node 1 wrote {written} bytes to node 2:\n{after}");
    assert!(value(&after, "cascade_transfer_latency_seconds_count", &["op=\"write\""]) >= 1.0, "{after}");
    assert!(value(&after, "cascade_mesh_peers_up", &[]) >= 2.0, "{after}");
    let received = scrape(&nodes[1].metrics);
    assert!(value(&received, "cascade_mesh_peers_up", &["backend=\"tcp\""]) >= 2.0, "{received}");

    // A model registered in the pool: its copy shows up in the manager's metrics.
    c.register(4 << 20);
    let t = Instant::now();
    loop {
        let m = scrape(&manager.metrics);
        if value(&m, "cascade_pool_copies", &["state=\"ready\"", "tier=\"host\""]) >= 1.0 {
            // The synthetic model is about the size asked for (its tensors round it down).
            assert!(value(&m, "cascade_pool_resident_bytes", &["tier=\"host\""]) >= 4e6, "{m}");
            assert!(value(&m, "cascade_pool_events_total", &["event=\"ready\""]) >= 1.0, "{m}");
            assert_eq!(value(&m, "cascade_pool_models", &[]), 1.0, "{m}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no ready copy in the manager's metrics:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `cascade pool apply-epoch` with two `epoch-plan`-shaped plans: the model's instance appears on
/// its first sub-cluster, then moves to the other one, and the old instance goes. The model is
/// named by the name it was registered under or by its id; a name no model has is refused,
/// listing the pool's models.
#[test]
fn an_epoch_plan_moves_a_model_between_sub_clusters_through_the_cli() {
    let c = Cluster::start("epoch");
    let model = c.register(2 << 20);
    let gpu_nodes = |c: &Cluster| -> Vec<u64> {
        let s = c.status();
        let mut v: Vec<u64> = s["copies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["model"] == model && x["kind"] == "gpu0" && x["state"] == "ready")
            .map(|x| x["node"].as_u64().unwrap())
            .collect();
        v.sort_unstable();
        v
    };
    std::fs::write(c.dir.join("e1.json"), r#"{"assignment": [0]}"#).unwrap();
    std::fs::write(c.dir.join("e2.json"), r#"{"assignment": [1]}"#).unwrap();
    let apply_as = |models: &str, plan: &str, previous: Option<&str>| {
        let mut cmd = Command::new(CASCADE);
        cmd.args(["pool", "apply-epoch", "--admin", &c.addrs[4].to_string(), "--models", models]);
        cmd.args(["--sub-clusters", "1;2", "--json", "--plan"]).arg(c.dir.join(plan));
        if let Some(p) = previous {
            cmd.arg("--previous").arg(c.dir.join(p));
        }
        cmd.env("CASCADE_SECRET", "metrics-secret").env_remove("RUST_BACKTRACE").output().unwrap()
    };
    let apply = |models: &str, plan: &str, previous: Option<&str>| {
        let out = apply_as(models, plan, previous);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let out = apply_as("n", "e1.json", None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(r#"no model has the id or name "n"; the pool's models: 1 ("m")"#),
        "{err}"
    );
    // By its name ("m"), then by its id.
    let first = apply("m", "e1.json", None);
    assert_eq!(first["result"]["moved"], 1, "{first}");
    assert_eq!(gpu_nodes(&c), vec![1]);
    let second = apply(&model.to_string(), "e2.json", Some("e1.json"));
    assert_eq!(second["moves"][0]["from"], serde_json::json!([1]), "{second}");
    assert_eq!(gpu_nodes(&c), vec![2]);
    // Nothing changed: nothing moves.
    let third = apply("m", "e2.json", Some("e2.json"));
    assert_eq!(third["result"]["moved"], 0, "{third}");
    // A plan that names a sub-cluster that does not exist is refused before anything is asked.
    std::fs::write(c.dir.join("bad.json"), r#"{"assignment": [5]}"#).unwrap();
    let out = Command::new(CASCADE)
        .args(["pool", "apply-epoch", "--admin", &c.addrs[4].to_string(), "--models", &model.to_string()])
        .args(["--sub-clusters", "1;2", "--plan"])
        .arg(c.dir.join("bad.json"))
        .env("CASCADE_SECRET", "metrics-secret")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in sub-cluster 5, but only 2 are given"), "{err}");
}
