//! # cascade-devcluster
//!
//! Clusters for development and benchmarks on one machine, used at run time by `cascade demo`,
//! the multicast benchmark and the integration tests: [`netns::Netns`] makes N hosts as network
//! namespaces on a bridge with shaped links (root needed), [`free_addrs`] finds free loopback
//! ports, [`process::stop_processes`] stops the nodes they run (SIGTERM, then SIGKILL after a
//! grace). Nothing here is for production deployments.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

mod cleanup;
pub mod netns;
pub mod process;

/// Kills process `pid`, a child of this process that a development cluster's run started
/// outside [`netns::Netns::spawn`] and [`process::spawn_node`] (a driver, a controller), when
/// this process is interrupted (SIGINT, SIGTERM, SIGHUP); call [`reaped`] once it is waited
/// for.
pub fn kill_on_interrupt(pid: u32) {
    cleanup::child(pid);
}

/// Process `pid` of [`kill_on_interrupt`] has been waited for: its pid is no longer ours.
pub fn reaped(pid: u32) {
    cleanup::forget_child(pid);
}

/// Removes the same-host sockets of a development cluster's nodes from `dir` (their runtime
/// directory): the files named `prefix….sock`, where `prefix` is `cascade-CLUSTER-` for the
/// cluster's name. A killed node cannot remove its own, and each run's names differ, so they
/// would pile up.
pub fn remove_sockets(dir: &std::path::Path, prefix: &str) {
    cleanup::remove_sockets(dir, prefix);
}

/// [`remove_sockets`] when this process is interrupted (SIGINT, SIGTERM, SIGHUP), after the
/// processes registered to be killed are.
pub fn remove_sockets_on_interrupt(dir: &std::path::Path, prefix: &str) {
    cleanup::sockets(dir, prefix);
}

/// Removes directory `dir` (a run's scratch directory) with what it holds when this process is
/// interrupted, until [`keep_dir`].
pub fn remove_dir_on_interrupt(dir: &std::path::Path) {
    cleanup::dir(dir);
}

/// Directory `dir` of [`remove_dir_on_interrupt`] is no longer removed (it has been removed, or
/// is to be kept).
pub fn keep_dir(dir: &std::path::Path) {
    cleanup::forget_dir(dir);
}

/// The first SIGINT or SIGTERM from now on is left to this process — a server that finishes
/// its requests and then stops its nodes itself — and only a second one (or SIGHUP) kills what
/// was registered and exits, as every interrupt does otherwise.
pub fn interrupt_gracefully() {
    cleanup::graceful();
}

/// The lowest port [`free_addrs`] hands out.
const LOWEST_PORT: u32 = 10_000;

/// Free loopback ports, reserved only for the moment of asking.
///
/// They come from below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), not from
/// binding port 0: an ephemeral port, released here, could be taken as the local port of any
/// outgoing connection on the machine before its user binds it (a CI run of the metrics test
/// failed so, "Address already in use" on 42005). Successive calls in a process go on from where
/// the last stopped, and processes start at different places (by pid), so that callers asking
/// at once rarely meet; each port is checked free by binding it.
pub fn free_addrs(n: usize) -> Vec<SocketAddr> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let top = ephemeral_start().max(LOWEST_PORT + 1_000);
    let span = top - LOWEST_PORT;
    let _ = NEXT.compare_exchange(
        0,
        std::process::id().wrapping_mul(7_919) % span + 1,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
    let mut held = Vec::with_capacity(n);
    for _ in 0..span {
        if held.len() == n {
            break;
        }
        let port = LOWEST_PORT + NEXT.fetch_add(1, Ordering::AcqRel) % span;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
            held.push(l);
        }
    }
    held.iter().filter_map(|l| l.local_addr().ok()).collect()
}

/// The first port of the kernel's ephemeral range (32768 where it cannot be read).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_addrs_are_distinct_bindable_and_below_the_ephemeral_range() {
        let a = free_addrs(8);
        let b = free_addrs(8);
        let all: std::collections::BTreeSet<u16> = a.iter().chain(&b).map(SocketAddr::port).collect();
        assert_eq!(all.len(), 16, "{a:?} {b:?}");
        let top = ephemeral_start().max(LOWEST_PORT + 1_000);
        assert!(all.iter().all(|&p| u32::from(p) >= LOWEST_PORT && u32::from(p) < top), "{all:?}");
        assert!(a.iter().all(|x| x.ip().is_loopback() && TcpListener::bind(x).is_ok()), "{a:?}");
    }
}
