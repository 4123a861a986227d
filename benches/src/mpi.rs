//! The peer in the multicast benchmark: OpenMPI's `MPI_Bcast` (`benches/mpi/bcast.c`), built
//! with `mpicc` when it is installed and run with `mpirun` on the same hosts as Cascade's nodes —
//! one host's processes (shared memory between them, OpenMPI's default choice there) or the
//! namespaced hosts (one rank per host, TCP over the shaped links, pipelined broadcast).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use cascade_devcluster::netns::Netns;

/// The program's source, carried in the binary so that it builds from any directory.
const SOURCE: &str = include_str!("../mpi/bcast.c");

/// How to install the reference when it is missing.
const INSTALL: &str = "apt-get install openmpi-bin libopenmpi-dev";

/// A built `bcast` program.
pub struct MpiBcast {
    exe: PathBuf,
    dir: PathBuf,
}

impl MpiBcast {
    /// Builds `bcast` into `dir` with `mpicc -O2`; a clear error when OpenMPI is not installed.
    pub fn build(dir: &Path) -> anyhow::Result<MpiBcast> {
        for tool in ["mpicc", "mpirun"] {
            let found = Command::new(tool).arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
            if !found {
                bail!("--compare-mpi needs OpenMPI's `{tool}` ({INSTALL})");
            }
        }
        let src = dir.join("bcast.c");
        std::fs::write(&src, SOURCE)?;
        let exe = dir.join("bcast");
        let out = Command::new("mpicc").arg("-O2").arg("-o").arg(&exe).arg(&src).output().context("running mpicc")?;
        if !out.status.success() {
            bail!("mpicc failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(MpiBcast { exe, dir: dir.to_path_buf() })
    }

    /// Broadcasts `bytes` from host `first` to hosts `first+1 ..= first+targets`, once; returns
    /// the slowest rank's seconds. With `net`, each rank runs in its host's namespace and talks
    /// TCP over the shaped links (pipelined broadcast, 1 MiB segments); otherwise every rank
    /// runs on this host, which OpenMPI links by shared memory.
    pub fn run(&self, net: Option<&Netns>, first: usize, targets: usize, bytes: u64) -> anyhow::Result<f64> {
        let ranks = targets + 1;
        let mut c = match net {
            None => {
                let mut c = Command::new("mpirun");
                c.arg("--oversubscribe");
                c
            }
            Some(n) => {
                let hosts: String = (first..first + ranks).map(|i| format!("{} slots=1\n", Netns::addr(i))).collect();
                std::fs::write(self.dir.join("hosts"), hosts)?;
                std::fs::write(self.dir.join("rsh"), rsh_agent(n, &self.dir))?;
                set_executable(&self.dir.join("rsh"))?;
                let subnet = format!("{}/24", Netns::addr(0));
                std::fs::create_dir_all(self.dir.join("tmp-0"))?;
                let mut c = n.command(0, "mpirun");
                c.env("TMPDIR", self.dir.join("tmp-0"));
                c.arg("--hostfile").arg(self.dir.join("hosts"));
                c.arg("--mca").arg("plm_rsh_agent").arg(self.dir.join("rsh"));
                for (k, v) in [
                    ("btl", "tcp,self"),
                    ("btl_tcp_if_include", subnet.as_str()),
                    ("oob_tcp_if_include", subnet.as_str()),
                    ("coll_tuned_use_dynamic_rules", "1"),
                    ("coll_tuned_bcast_algorithm", "3"),
                    ("coll_tuned_bcast_algorithm_segmentsize", "1048576"),
                    // One slot per host hides that the hosts share this machine's cores: ranks
                    // would busy-poll them from each other. They yield, as oversubscribed ones do.
                    ("mpi_yield_when_idle", "1"),
                ] {
                    c.args(["--mca", k, v]);
                }
                c
            }
        };
        c.arg("--allow-run-as-root").args(["-np", &ranks.to_string()]).arg(&self.exe);
        c.args([bytes.to_string(), "1".into()]);
        let out = c.output().context("running mpirun")?;
        if !out.status.success() {
            bail!("mpirun failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("bcast's output")?;
        if v["verified"] != serde_json::json!(true) {
            bail!("MPI_Bcast delivered wrong bytes: {v}");
        }
        v["seconds"].as_f64().context("bcast printed no seconds")
    }
}

/// OpenMPI's remote-shell agent for namespaced hosts: `rsh <addr> [options] <command...>` runs the
/// command inside the namespace of the host with that address.
///
/// Every namespace shares this host's name and `/tmp`, where OpenMPI's daemons would all make
/// the same session directory; each host gets a scratch directory of its own (`TMPDIR`).
fn rsh_agent(n: &Netns, dir: &Path) -> String {
    let mut s =
        String::from("#!/bin/sh\nhost=$1; shift\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\ncase $host in\n");
    for i in 0..n.len() {
        s += &format!("  {}) ns={}; tmp={}/tmp-{i} ;;\n", Netns::addr(i), n.name(i), dir.display());
    }
    s += "  *) echo \"unknown host $host\" >&2; exit 1 ;;\nesac\n";
    s += "mkdir -p \"$tmp\" && TMPDIR=\"$tmp\" exec ip netns exec \"$ns\" sh -c \"$*\"\n";
    s
}

fn set_executable(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}
