//! `p2p --backend tcp|shm --bytes N [--iters K] [--compare] --json`: see [`cascade_benches::p2p`].

use cascade_benches::{main_or_peer, p2p, PeerArgs};
use clap::Parser;

/// Point-to-point one-sided WRITE throughput between two processes.
#[derive(Parser)]
#[command(about = "Point-to-point one-sided WRITE throughput between two processes")]
struct Cli {
    #[command(flatten)]
    args: p2p::P2pArgs,
    #[command(flatten)]
    peer: PeerArgs,
}

fn main() -> anyhow::Result<()> {
    cascade_benches::quiet_panic_on_closed_stdout();
    let c = Cli::parse();
    main_or_peer(&c.peer, 2, || async move { p2p::run(c.args, false).await.map(drop) })
}
