//! `load --file F --json` → `{bytes, seconds, gbyte_per_s, ...}`: loads a safetensors model into a
//! registered host region with the io_uring loader (O_DIRECT unless `--buffered`).
//!
//! `--compare` also runs `fio --ioengine=io_uring --direct=1 --rw=read --bs=4M` on the same file;
//! `--cold` drops the page cache first (root); `--make-synthetic BYTES` writes a model to `--file`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use cascade_benches::median;
use cascade_param_pool::{load, LoadOptions, Manifest, DEFAULT_CHUNK};
use cascade_transport::Region;
use clap::Parser;
use serde_json::json;

/// Load a model file into a registered region.
#[derive(Parser)]
#[command(about = "Load a safetensors model into a registered region with io_uring")]
struct Cli {
    /// The safetensors file.
    #[arg(long)]
    file: PathBuf,
    /// First write a synthetic model of this many bytes (Llama-like names) to --file.
    #[arg(long)]
    make_synthetic: Option<u64>,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    buffered: bool,
    /// Reads in flight.
    #[arg(long, default_value_t = 8)]
    queue_depth: u32,
    /// Bytes per read.
    #[arg(long, default_value_t = 4 << 20)]
    block: u64,
    /// Skip the crc32 check of every chunk (it is timed separately otherwise).
    #[arg(long)]
    no_verify: bool,
    /// Drop the page cache before each measurement (needs root).
    #[arg(long)]
    cold: bool,
    /// Also measure fio on the same file.
    #[arg(long)]
    compare: bool,
    /// Measurements (alternating loader and fio with --compare); medians are reported.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn drop_caches() -> anyhow::Result<()> {
    // SAFETY: sync(2) has no preconditions and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("--cold: dropping the page cache needs root")
}

fn fio(path: &std::path::Path, bs: u64, depth: u32) -> anyhow::Result<f64> {
    let out = Command::new("fio")
        .args(["--name=cascade-load", "--ioengine=io_uring", "--direct=1", "--rw=read", "--output-format=json"])
        .arg(format!("--filename={}", path.display()))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={depth}"))
        .output()
        .context("running fio (apt-get install fio)")?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio JSON")?;
    v["jobs"][0]["read"]["bw_bytes"].as_f64().map(|b| b / 1e9).context("fio reported no bandwidth")
}

fn main() -> anyhow::Result<()> {
    cascade_benches::quiet_panic_on_closed_stdout();
    cascade_benches::init_logging();
    let c = Cli::parse();
    if let Some(b) = c.make_synthetic {
        if b < 1 << 20 {
            bail!("--make-synthetic needs at least 1 MiB");
        }
        // Built in memory, then loaded into a region of its size: 1 TiB was being built when the
        // run was stopped.
        if let Some(free) = cascade_transport::memory_to_spare().filter(|&free| b.saturating_mul(2) > free) {
            bail!(
                "--make-synthetic {} MiB: it is built in memory and loaded into a region of its size, {} MiB, more \
                 than the {} MiB this machine can spare (its available memory less 256 MiB)",
                b >> 20,
                b.saturating_mul(2) >> 20,
                free >> 20
            );
        }
        cascade_param_pool::synthetic::write_llama2_like(&c.file, b, 1).context("writing the synthetic model")?;
    }
    let manifest = Manifest::from_file(&c.file, "model", DEFAULT_CHUNK)?;
    let region = Region::alloc(manifest.bytes, Default::default())?;
    // Touch the region once so page faults are not counted as disk time.
    // SAFETY: the region is private to this benchmark (never registered).
    unsafe { region.fill(0, manifest.bytes, 0)? };
    if c.repeat == 0 {
        bail!("--repeat must be positive");
    }
    let opts = LoadOptions { queue_depth: c.queue_depth, block: c.block, direct: !c.buffered, verify: !c.no_verify };
    let (mut ours, mut theirs, mut last) = (Vec::new(), Vec::new(), None);
    for _ in 0..c.repeat {
        if c.cold {
            drop_caches()?;
        }
        // SAFETY: as above.
        let rep = unsafe { load(&manifest, &c.file, &region, opts)? };
        ours.push(rep.bytes as f64 / rep.seconds / 1e9);
        last = Some(rep);
        if c.compare {
            if c.cold {
                drop_caches()?;
            }
            theirs.push(fio(&c.file, c.block, c.queue_depth)?);
        }
    }
    let rep = last.context("no measurement")?;
    let gbps = median(&mut ours.clone());
    let mut out = json!({
        "file": c.file.display().to_string(), "bytes": rep.bytes, "seconds": rep.bytes as f64 / gbps / 1e9,
        "gbyte_per_s": gbps, "samples_gbyte_per_s": ours, "mode": rep.mode, "cold": c.cold,
        "verify_seconds": rep.verify_seconds, "layers": manifest.layers.len(),
        "queue_depth": c.queue_depth, "block": c.block, "repeat": c.repeat,
    });
    if c.compare {
        let f = median(&mut theirs.clone());
        out["fio_gbyte_per_s"] = json!(f);
        out["fio_samples_gbyte_per_s"] = json!(theirs);
        out["ratio"] = json!(gbps / f);
    }
    if c.json {
        println!("{out}");
    } else {
        println!(
            "loaded {} bytes ({} layers, {:?}) in {:.3} s = {:.2} GB/s{}",
            rep.bytes,
            manifest.layers.len(),
            rep.mode,
            rep.bytes as f64 / gbps / 1e9,
            gbps,
            out.get("fio_gbyte_per_s")
                .map(|f| format!(
                    "; fio {:.2} GB/s, ratio {:.2}",
                    f.as_f64().unwrap_or(0.0),
                    out["ratio"].as_f64().unwrap_or(0.0)
                ))
                .unwrap_or_default()
        );
    }
    Ok(())
}
