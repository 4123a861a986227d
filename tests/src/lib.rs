//! # cascade-tests
//!
//! Cross-crate integration tests and the harnesses they share: [`Cluster`] starts N `test-node`
//! processes on loopback, each joining the mesh of a generated cluster file, and drives them with
//! line commands; [`netns::Netns`] (from `cascade-devcluster`) makes N hosts as network namespaces on a shaped bridge. Every
//! process is killed (and every namespace deleted) on drop, also when a test panics.
#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::Value;

pub use cascade_devcluster::{free_addrs, netns};

pub mod etcd;
pub mod loopback;
pub mod models;

/// Options for a spawned cluster.
#[derive(Debug, Clone)]
pub struct ClusterOpts {
    /// Number of nodes.
    pub nodes: usize,
    /// Use shared memory between the (same-host) nodes.
    pub shm: bool,
    /// Bytes of the region each node registers.
    pub region_bytes: u64,
    /// Secret per node (index → secret); nodes not listed use "test-secret".
    pub secrets: Vec<(usize, String)>,
    /// How long each node waits for the mesh.
    pub ready_timeout: Duration,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts {
            nodes: 2,
            shm: false,
            region_bytes: 1 << 20,
            secrets: vec![],
            ready_timeout: Duration::from_secs(20),
        }
    }
}

/// One spawned node.
pub struct NodeProc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Its first line: `ready` (with region descriptor) or `not_ready`.
    pub hello: Value,
}

impl NodeProc {
    /// Sends one command and waits (up to `limit`) for its answer.
    pub fn cmd(&mut self, line: &str, limit: Duration) -> anyhow::Result<Value> {
        writeln!(self.stdin, "{line}").context("writing to node")?;
        self.stdin.flush()?;
        self.next(limit)
    }

    /// Sends a command without waiting for the answer.
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{line}")?;
        Ok(self.stdin.flush()?)
    }

    /// The next JSON line the node prints.
    pub fn next(&mut self, limit: Duration) -> anyhow::Result<Value> {
        let l = self.lines.recv_timeout(limit).map_err(|e| anyhow!("no answer within {limit:?}: {e}"))?;
        serde_json::from_str(&l).with_context(|| format!("node printed {l:?}"))
    }

    /// `(id, key, len)` of the node's region.
    pub fn region(&self) -> (u64, u64, u64) {
        let r = &self.hello["region"];
        (r["id"].as_u64().unwrap_or(0), r["key"].as_u64().unwrap_or(0), r["len"].as_u64().unwrap_or(0))
    }

    /// SIGKILLs the node.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of `test-node` processes on loopback.
pub struct Cluster {
    /// The nodes, index = node id.
    pub nodes: Vec<NodeProc>,
    /// Each node's TCP address.
    pub addrs: Vec<SocketAddr>,
    dir: PathBuf,
}

impl Cluster {
    /// Starts the nodes and waits for each one's first line.
    pub fn spawn(bin: &str, opts: &ClusterOpts) -> anyhow::Result<Cluster> {
        let addrs = free_addrs(opts.nodes);
        if addrs.len() != opts.nodes {
            bail!("could not reserve {} loopback ports", opts.nodes);
        }
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!("it{}x{}", std::process::id(), SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let dir = std::env::temp_dir().join(format!("cascade-{name}"));
        std::fs::create_dir_all(&dir)?;
        let mut toml = format!("name = \"{name}\"\n");
        for (i, a) in addrs.iter().enumerate() {
            toml += &format!("[[nodes]]\nid = {i}\naddr = \"{a}\"\n");
        }
        let file = dir.join("cluster.toml");
        std::fs::write(&file, toml)?;
        let mut nodes = Vec::new();
        for i in 0..opts.nodes {
            let secret = opts.secrets.iter().find(|(n, _)| *n == i).map(|(_, s)| s.as_str()).unwrap_or("test-secret");
            nodes.push(spawn_node(bin, &file, &dir, i, secret, opts)?);
        }
        let mut c = Cluster { nodes, addrs, dir };
        for n in &mut c.nodes {
            n.hello = n.next(opts.ready_timeout + Duration::from_secs(10))?;
        }
        Ok(c)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn_node(bin: &str, file: &Path, dir: &Path, i: usize, secret: &str, o: &ClusterOpts) -> anyhow::Result<NodeProc> {
    let mut cmd = Command::new(bin);
    cmd.arg("--cluster").arg(file).arg("--node").arg(i.to_string()).arg("--secret").arg(secret);
    cmd.arg("--region-bytes").arg(o.region_bytes.to_string());
    cmd.arg("--ready-timeout-s").arg(o.ready_timeout.as_secs_f64().to_string());
    if !o.shm {
        cmd.arg("--no-shm");
    }
    cmd.env("XDG_RUNTIME_DIR", dir);
    // Expected refusals and peer losses are logged as warnings; keep test output readable.
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "error");
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {bin}"))?;
    let stdin = child.stdin.take().context("no stdin")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    Ok(NodeProc { child, stdin, lines: rx, hello: Value::Null })
}
