//! Multi-host tests without a cluster: N hosts as network namespaces joined by veth pairs to a
//! bridge (in a switch namespace of its own), each host's egress shaped with
//! `tc qdisc … tbf rate <B>mbit`. Addresses are 10.77.0.1… inside these namespaces only.
//! Everything is torn down on drop — also when a test panics — and when the process is
//! interrupted by SIGINT, SIGTERM or SIGHUP (a watcher the first cluster of a process starts).

use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

/// A set of namespaced hosts on one shaped bridge.
pub struct Netns {
    prefix: String,
    hosts: Vec<String>,
    switch: String,
    children: Vec<Child>,
}

fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!("{} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Netns {
    /// Why namespaced hosts cannot be made here, if they cannot (not root, no `ip`, no netns).
    pub fn unavailable() -> Option<String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Some("needs root to create network namespaces".into());
        }
        for tool in ["ip", "tc"] {
            if Command::new(tool).arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
                return Some(format!("`{tool}` (iproute2) is not installed"));
            }
        }
        let probe = format!("csprobe{}", std::process::id());
        if let Err(e) = run(&["ip", "netns", "add", &probe]) {
            return Some(format!("network namespaces unavailable: {e}"));
        }
        let _ = run(&["ip", "netns", "del", &probe]);
        None
    }

    /// The share of a shaped link's rate that carries TCP payload at `mtu`: `tbf` charges a
    /// segment's bytes from its 14-byte Ethernet header on (a GSO packet as the segments it
    /// stands for), and an MTU-sized IPv4 packet carries `mtu − 52` bytes of payload (20 of IPv4
    /// header, 20 of TCP, 12 of the TCP timestamps Linux sends by default). 0.956 at 1500,
    /// 0.993 at 9000. The acknowledgements going the other way are not counted: receive
    /// offload coalesces them to under 1% of a link (measured: 67.61 MB sent for 64 MiB).
    pub fn tcp_payload_share(mtu: u32) -> f64 {
        const HEADERS: u32 = 20 + 20 + 12;
        const ETHERNET: u32 = 14;
        f64::from(mtu.saturating_sub(HEADERS)) / f64::from(mtu + ETHERNET)
    }

    /// Creates `n` hosts; with `link_mbit`, shapes each host's egress to that rate.
    pub fn create(n: usize, link_mbit: Option<u64>) -> anyhow::Result<Netns> {
        Self::create_with_mtu(n, link_mbit, None)
    }

    /// [`create`](Self::create) with every host's link (and the bridge) at `mtu` bytes instead
    /// of Ethernet's 1500 — 9000 for the jumbo frames data-centre fabrics run (RoCE and
    /// InfiniBand use 4096-byte packets): fewer packets per byte, and 0.7% of headers instead
    /// of 4.4%.
    pub fn create_with_mtu(n: usize, link_mbit: Option<u64>, mtu: Option<u32>) -> anyhow::Result<Netns> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        if n == 0 || n > 250 {
            bail!("between 1 and 250 hosts");
        }
        if let Some(m) = mtu.filter(|m| !(576..=65535).contains(m)) {
            bail!("MTU {m}: between 576 and 65535 bytes");
        }
        let prefix = format!("c{:x}{}", std::process::id() & 0xfffff, SEQ.fetch_add(1, Ordering::Relaxed));
        let mut ns = Netns { switch: format!("{prefix}sw"), hosts: Vec::new(), children: Vec::new(), prefix };
        run(&["ip", "netns", "add", &ns.switch])?;
        crate::cleanup::namespace(&ns.switch);
        run(&["ip", "-n", &ns.switch, "link", "add", "br0", "type", "bridge"])?;
        run(&["ip", "-n", &ns.switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let host = format!("{}h{i}", ns.prefix);
            run(&["ip", "netns", "add", &host])?;
            crate::cleanup::namespace(&host);
            ns.hosts.push(host.clone());
            let (h, s) = (format!("{}a{i}", ns.prefix), format!("{}b{i}", ns.prefix));
            run(&["ip", "link", "add", &h, "type", "veth", "peer", "name", &s])?;
            run(&["ip", "link", "set", &h, "netns", &host])?;
            run(&["ip", "link", "set", &s, "netns", &ns.switch])?;
            run(&["ip", "-n", &ns.switch, "link", "set", &s, "master", "br0"])?;
            run(&["ip", "-n", &ns.switch, "link", "set", &s, "up"])?;
            run(&["ip", "-n", &host, "link", "set", "lo", "up"])?;
            run(&["ip", "-n", &host, "addr", "add", &format!("{}/24", Self::addr(i)), "dev", &h])?;
            if let Some(m) = mtu {
                run(&["ip", "-n", &host, "link", "set", &h, "mtu", &m.to_string()])?;
                run(&["ip", "-n", &ns.switch, "link", "set", &s, "mtu", &m.to_string()])?;
            }
            run(&["ip", "-n", &host, "link", "set", &h, "up"])?;
            if let Some(mbit) = link_mbit {
                // The bucket must hold at least one timer tick of traffic (and a 64 KiB GSO burst).
                let burst = (mbit * 1_000_000 / 8 / 250).max(64 << 10);
                run(&[
                    "ip",
                    "netns",
                    "exec",
                    &host,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    &h,
                    "root",
                    "tbf",
                    "rate",
                    &format!("{mbit}mbit"),
                    "burst",
                    &burst.to_string(),
                    "latency",
                    "100ms",
                ])?;
            }
        }
        Ok(ns)
    }

    /// Address of host `i`.
    pub fn addr(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, (i + 1) as u8)
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// True when there are no hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The name of host `i`'s namespace (for `ip netns exec`).
    pub fn name(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// A command that runs `program` inside host `i`.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i], program]);
        c
    }

    /// Starts a command built by [`command`](Self::command); it is stopped by [`stop`](Self::stop)
    /// or killed on drop. Returns its process id.
    pub fn spawn(&mut self, mut cmd: Command) -> anyhow::Result<u32> {
        let child = cmd.spawn().context("starting a process in a namespace")?;
        let pid = child.id();
        crate::cleanup::child(pid);
        self.children.push(child);
        Ok(pid)
    }

    /// The first process [`spawn`](Self::spawn) started that has exited, by its order of
    /// starting, with its status.
    pub fn exited(&mut self) -> Option<(usize, std::process::ExitStatus)> {
        crate::process::first_exited(&mut self.children)
    }

    /// Stops the processes [`spawn`](Self::spawn) started, as an operator would: SIGTERM, then
    /// SIGKILL for any still running after `grace` ([`crate::process::stop_processes`]). Dropping
    /// the hosts instead kills them at once (a test that panicked should not wait). Returns how
    /// many had to be killed.
    pub fn stop(&mut self, grace: std::time::Duration) -> usize {
        crate::process::stop_processes(self.children.drain(..), grace)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
            crate::cleanup::forget_child(c.id());
        }
        // Deleting a namespace removes its end of each veth pair, and so the pair.
        for h in self.hosts.iter().chain(std::iter::once(&self.switch)) {
            let _ = run(&["ip", "netns", "del", h]);
            crate::cleanup::forget_namespace(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Netns;

    #[test]
    fn tcp_payload_share_counts_the_headers_of_each_frame() {
        assert!((Netns::tcp_payload_share(1500) - 1448.0 / 1514.0).abs() < 1e-12);
        assert!((Netns::tcp_payload_share(9000) - 8948.0 / 9014.0).abs() < 1e-12);
        assert!(Netns::tcp_payload_share(576) < Netns::tcp_payload_share(1500));
        assert_eq!(Netns::tcp_payload_share(40), 0.0);
    }
}
