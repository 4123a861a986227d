//! `p2p`: one process WRITEs N bytes into another process's registered region.
//!
//! `p2p --backend tcp|shm --bytes N [--iters K] [--compare] --json` →
//! `{backend, bytes, seconds, gbit_per_s, ...}` where `seconds` is the median of K timed WRITEs
//! (after one warm-up). `--compare` also measures the reference the issue names: for tcp,
//! single-stream loopback `iperf3`; for shm, single-core memcpy of the same size.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_transport::{Endpoint, Op, Region};
use serde_json::{json, Value};

use crate::{median, BenchCluster};

/// Arguments of the `p2p` benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct P2pArgs {
    /// tcp or shm.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Bytes per WRITE.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Timed WRITEs (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Verify crc32 at the destination.
    #[arg(long)]
    pub verify: bool,
    /// Also measure the reference (iperf3 for tcp, memcpy for shm).
    #[arg(long)]
    pub compare: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark; returns its JSON result (and prints it unless `quiet`).
pub async fn run(a: P2pArgs, quiet: bool) -> anyhow::Result<Value> {
    let shm = match a.backend.as_str() {
        "tcp" => false,
        "shm" => true,
        other => bail!("unknown backend {other:?} (tcp or shm)"),
    };
    if a.bytes == 0 || a.iters == 0 {
        bail!("--bytes and --iters must be positive");
    }
    let exe = std::env::current_exe()?;
    let cluster = BenchCluster::start(exe.to_str().context("exe path")?, 2, a.bytes, shm, &[])?;
    let ep = Endpoint::start(cluster.config(shm)).await?;
    let rep = ep.wait_ready(Duration::from_secs(20)).await?;
    let src = ep.register_new(a.bytes)?;
    // SAFETY: the source is only read by the WRITEs below, which start after the fill.
    unsafe { src.fill(0, a.bytes, 0x5a)? };
    let dst = cluster.regions[0];
    let link = ep.link(1)?;
    let mut samples = Vec::new();
    for i in 0..=a.iters {
        let mut op = Op::write(&src, 0, dst, 0, a.bytes);
        if a.verify {
            op = op.verified();
        }
        let t = Instant::now();
        let h = link.post(vec![op]).pop().context("no handle")?;
        h.wait("write", Duration::from_secs(600)).await?;
        if i > 0 {
            samples.push(t.elapsed().as_secs_f64());
        }
    }
    let seconds = median(&mut samples);
    let gbit = a.bytes as f64 * 8.0 / seconds / 1e9;
    let mut out = json!({
        "backend": a.backend, "bytes": a.bytes, "seconds": seconds, "gbit_per_s": gbit,
        "iters": a.iters, "samples_s": samples, "verify": a.verify,
        "link": link.kind().to_string(), "mesh_setup_ms": rep.setup.as_secs_f64() * 1e3,
    });
    // The nodes stop before the reference runs: it takes seconds of blocking work (iperf3 for
    // 5 s, memcpy of the whole size five times), during which a live endpoint would miss its
    // keepalives and its peer would declare it down.
    ep.shutdown();
    drop(cluster);
    if a.compare {
        out["reference"] = json!(if shm { "memcpy single core" } else { "iperf3 single stream loopback" });
        let bytes = a.bytes;
        let reference = tokio::task::spawn_blocking(move || if shm { memcpy_gbit(bytes) } else { iperf3_gbit() })
            .await
            .context("the reference measurement panicked")?;
        match reference {
            Ok(reference) => {
                out["reference_gbit_per_s"] = json!(reference);
                out["ratio"] = json!(gbit / reference);
            }
            Err(e) => out["reference_error"] = json!(format!("{e:#}")),
        }
    }
    if quiet {
    } else if a.json {
        println!("{out}");
    } else {
        println!("{}: {} bytes in {:.4} s = {:.2} Gbit/s", a.backend, a.bytes, seconds, gbit);
        if let Some(r) = out.get("reference_gbit_per_s") {
            println!(
                "reference ({}): {:.2} Gbit/s, ratio {:.3}",
                out["reference"],
                r.as_f64().unwrap_or(0.0),
                out["ratio"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(out)
}

/// Single-core memcpy bandwidth between two pre-faulted buffers of `bytes` (median of 5).
pub fn memcpy_gbit(bytes: u64) -> anyhow::Result<f64> {
    let a = Region::alloc(bytes, Default::default())?;
    let b = Region::alloc(bytes, Default::default())?;
    // SAFETY: `a` and `b` are private to this function, never registered (so for the blocks below).
    unsafe { a.fill(0, bytes, 1)? };
    // SAFETY: as above.
    unsafe { b.fill(0, bytes, 2)? };
    // SAFETY: as above.
    let src = unsafe { a.view(0, bytes)? };
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: as above; `src` views `a`, not `b`.
        unsafe { b.write_local(0, &src)? };
        v.push(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 * 8.0 / median(&mut v) / 1e9)
}

/// Single-stream loopback throughput measured by iperf3 (5 s).
fn iperf3_gbit() -> anyhow::Result<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let mut server = std::process::Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(std::process::Stdio::null())
        .spawn()
        .context("running iperf3 (install it: apt-get install iperf3)")?;
    std::thread::sleep(Duration::from_millis(300));
    let out = std::process::Command::new("iperf3").args(["-c", "127.0.0.1", "-p", &port, "-t", "5", "-J"]).output()?;
    let _ = server.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3 JSON")?;
    v["end"]["sum_received"]["bits_per_second"].as_f64().map(|b| b / 1e9).context("iperf3 reported no throughput")
}
