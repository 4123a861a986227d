//! `test-node`: one cluster member driven by line commands on stdin, answering one JSON line each.
//! Used by the multi-process integration tests (see `cascade_tests::Cluster`).
//!
//! On start it joins the mesh, registers one region, and prints
//! `{"event":"ready", "node", "region":{"id","key","len"}, "setup_ms", "peers":[[id,backend]...]}`
//! (or `{"event":"not_ready","error"}`). Commands:
//! `fill SEED` · `crc OFF LEN` · `peers` · `quit` ·
//! `write PEER REGION KEY ROFF LEN VERIFY COUNT` · `read PEER REGION KEY ROFF LEN VERIFY`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, Op, RegionId, RemoteKey, RemoteRegion};
use clap::Parser;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Parser)]
struct Args {
    /// Cluster file.
    #[arg(long)]
    cluster: PathBuf,
    /// This node's id.
    #[arg(long)]
    node: u32,
    /// Cluster secret.
    #[arg(long, default_value = "test-secret")]
    secret: String,
    /// Disable shared memory between same-host nodes.
    #[arg(long)]
    no_shm: bool,
    /// Size of the region this node registers.
    #[arg(long, default_value_t = 1 << 20)]
    region_bytes: u64,
    /// How long to wait for the full mesh.
    #[arg(long, default_value_t = 20.0)]
    ready_timeout_s: f64,
    /// Keepalive interval in milliseconds (peers are declared down after 6 intervals).
    #[arg(long, default_value_t = 250)]
    keepalive_ms: u64,
}

fn say(v: Value) {
    println!("{v}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let a = Args::parse();
    let cluster = ClusterSpec::load(&a.cluster)?;
    let mut cfg = EndpointConfig::new(a.node, cluster, a.secret.as_bytes());
    cfg.shm = !a.no_shm;
    cfg.keepalive = Duration::from_millis(a.keepalive_ms);
    cfg.dead_after = cfg.keepalive * 6;
    cfg.op_timeout = Duration::from_secs(120);
    let ep = Endpoint::start(cfg).await?;
    let region = ep.register_new(a.region_bytes)?;
    match ep.wait_ready(Duration::from_secs_f64(a.ready_timeout_s)).await {
        Ok(rep) => say(json!({
            "event": "ready", "node": a.node,
            "region": {"id": region.id().0, "key": region.key().0, "len": region.len()},
            "setup_ms": rep.setup.as_secs_f64() * 1e3,
            "peers": rep.peers.iter().map(|(p, k)| json!([p, k.to_string()])).collect::<Vec<_>>(),
        })),
        // Keep serving: the peers that did connect remain usable.
        Err(e) => say(json!({"event": "not_ready", "error": e.to_string()})),
    }
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match run(&ep, &region, &w).await {
            Ok(Some(v)) => v,
            Ok(None) => break,
            Err(e) => json!({"error": format!("{e:#}")}),
        };
        say(reply);
    }
    ep.leave().await;
    Ok(())
}

fn num<T: std::str::FromStr>(w: &[&str], i: usize) -> anyhow::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    w.get(i).with_context(|| format!("missing argument {i}"))?.parse::<T>().with_context(|| format!("argument {i}"))
}

async fn run(ep: &Endpoint, region: &cascade_transport::Region, w: &[&str]) -> anyhow::Result<Option<Value>> {
    Ok(Some(match w.first().copied() {
        Some("quit") | None => return Ok(None),
        Some("fill") => {
            let seed: u64 = num(w, 1)?;
            let mut off = 0;
            while off < region.len() {
                let n = 4096.min(region.len() - off);
                // SAFETY: the harness runs one command at a time and its tests fill a region
                // only while no transfer addresses it.
                unsafe { region.fill(off, n, ((off / 4096).wrapping_mul(31).wrapping_add(seed) % 251) as u8)? };
                off += n;
            }
            json!({"ok": true})
        }
        // SAFETY: the tests ask for a crc only after the transfers into the range completed.
        Some("crc") => json!({"crc": unsafe { region.crc32(num(w, 1)?, num(w, 2)?)? }}),
        Some("peers") => {
            json!({"peers": ep.connected().iter().map(|(p, k)| json!([p, k.to_string()])).collect::<Vec<_>>()})
        }
        Some(op @ ("write" | "read")) => {
            let peer: u32 = num(w, 1)?;
            let remote = RemoteRegion { node: peer, id: RegionId(num(w, 2)?), key: RemoteKey(num(w, 3)?), len: 0 };
            let (roff, len, verify): (u64, u64, u8) = (num(w, 4)?, num(w, 5)?, num(w, 6)?);
            let count: u32 = if op == "write" { num(w, 7)? } else { 1 };
            let t = Instant::now();
            let mut done = 0;
            for _ in 0..count {
                let mut o = if op == "write" {
                    Op::write(region, 0, remote, roff, len)
                } else {
                    Op::read(region, 0, remote, roff, len)
                };
                if verify == 1 {
                    o = o.verified();
                }
                let r = ep.run(peer, vec![o]).await.and_then(|mut v| v.remove(0));
                if let Err(e) = r {
                    return Ok(Some(
                        json!({"error": e.to_string(), "completed": done, "seconds": t.elapsed().as_secs_f64()}),
                    ));
                }
                done += 1;
            }
            json!({"ok": true, "completed": done, "seconds": t.elapsed().as_secs_f64()})
        }
        Some(other) => anyhow::bail!("unknown command {other:?}"),
    }))
}
