//! `multicast --targets N --bytes S --link-mbit B --planner blitz|chain|star|tree [--netns] --json`:
//! see [`cascade_benches::multicast`].

use cascade_benches::multicast::{run_role, BedArgs, RoleArgs};
use cascade_multicast::PlannerKind;
use clap::Parser;

/// Multicast a synthetic model to N targets through a planner; report the time.
#[derive(Parser)]
#[command(about = "Multicast a synthetic model to N node processes through a planner")]
struct Cli {
    /// Number of targets.
    #[arg(long, default_value_t = 4)]
    targets: usize,
    /// blitz, chain, star or tree.
    #[arg(long, default_value = "blitz")]
    planner: PlannerKind,
    #[command(flatten)]
    bed: BedArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    role: RoleArgs,
}

fn main() -> anyhow::Result<()> {
    cascade_benches::quiet_panic_on_closed_stdout();
    cascade_benches::init_logging();
    let c = Cli::parse();
    if run_role(&c.role)? {
        return Ok(());
    }
    let bed = c.bed.start(c.targets)?;
    let v = bed.run(c.planner, c.targets, c.bed.bytes)?;
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
