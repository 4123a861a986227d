//! `incast --senders 8 --objects 8 --object-bytes 153600 --rounds R --json`:
//! see [`cascade_benches::incast`].

use cascade_benches::{incast, main_or_peer, PeerArgs};
use clap::Parser;

/// Incast: one receiver READs objects from many senders at once.
#[derive(Parser)]
#[command(about = "Incast: one receiver READs objects from many senders at once")]
struct Cli {
    #[command(flatten)]
    args: incast::IncastArgs,
    #[command(flatten)]
    peer: PeerArgs,
}

fn main() -> anyhow::Result<()> {
    cascade_benches::quiet_panic_on_closed_stdout();
    let c = Cli::parse();
    let threads = c.args.threads;
    main_or_peer(&c.peer, threads, || async move { incast::run(c.args, false).await.map(drop) })
}
