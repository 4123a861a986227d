//! `cascade` — the operator's command.
//!
//! Today it can check a cluster file; the node daemon, demo, pool tools and simulator arrive with
//! the crates that implement them.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cascade", version, about = "Cascade data plane for model-serving clusters")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a cluster file and print its members.
    CheckCluster {
        /// The TOML cluster file.
        file: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::CheckCluster { file } => {
            let c =
                cascade_transport::ClusterSpec::load(&file).with_context(|| format!("checking {}", file.display()))?;
            println!("cluster {:?}: {} nodes", c.name, c.nodes.len());
            for n in &c.nodes {
                println!("  node {:>4}  {}  host {}", n.id, n.addr, n.host_key());
            }
            Ok(())
        }
    }
}
