//! `multicast --targets N --bytes S --link-mbit B --planner blitz|chain|star|tree [--netns] --json`:
//! see [`cascade_benches::multicast`].

use cascade_benches::multicast::{run_role, Bed, RoleArgs};
use cascade_multicast::PlannerKind;
use clap::Parser;

/// Multicast a synthetic model to N targets through a planner; report the time.
#[derive(Parser)]
#[command(about = "Multicast a synthetic model to N node processes through a planner")]
struct Cli {
    /// Number of targets.
    #[arg(long, default_value_t = 4)]
    targets: usize,
    /// Model bytes.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: u64,
    /// Link rate (shaped with --netns).
    #[arg(long, default_value_t = 1000)]
    link_mbit: u64,
    /// blitz, chain, star or tree.
    #[arg(long, default_value = "blitz")]
    planner: PlannerKind,
    /// Run each node in its own network namespace with shaped links (needs root).
    #[arg(long)]
    netns: bool,
    /// With --netns: the hosts' link MTU (default Ethernet's 1500; 9000 for jumbo frames, as
    /// data-centre fabrics run).
    #[arg(long)]
    mtu: Option<u32>,
    /// Link the nodes (one host) by shared memory instead of loopback tcp.
    #[arg(long)]
    shm: bool,
    /// Measure the executor's per-chunk overhead (and on shm the hop rate and what the host's
    /// cores move over all hops together) first and plan with them instead of the defaults.
    #[arg(long)]
    calibrate: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    role: RoleArgs,
}

fn main() -> anyhow::Result<()> {
    cascade_benches::init_logging();
    let c = Cli::parse();
    if run_role(&c.role)? {
        return Ok(());
    }
    if c.targets == 0 || c.bytes == 0 || c.link_mbit == 0 {
        anyhow::bail!("--targets, --bytes and --link-mbit must be positive");
    }
    let mut bed = Bed::start_with(c.netns, c.shm, c.targets, c.link_mbit, c.mtu)?;
    if c.calibrate {
        // The planner is told this bed's measured per-chunk overhead (and, on shm, hop and host rates).
        bed.calibrate()?;
        eprintln!("{}", bed.calibration());
    }
    let v = bed.run(c.planner, c.targets, c.bytes)?;
    if c.json {
        println!("{v}");
    } else {
        println!(
            "{} to {} targets: {:.3} s (bound {})",
            c.planner,
            c.targets,
            v["seconds"].as_f64().unwrap_or(f64::NAN),
            v["bound_seconds"].as_f64().map(|b| format!("{b:.3} s")).unwrap_or_else(|| "n/a: unshaped".into())
        );
    }
    Ok(())
}
