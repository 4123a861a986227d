//! Multicast across namespaced hosts: one `cascade node` per network namespace, egress shaped to
//! 1000 Mbit/s, a controller in its own namespace; every byte is checked (crc32) at every target.
//! Prints a skip reason and passes when namespaces cannot be made (not root); CI runs as root.
#![allow(clippy::unwrap_used)]

use std::process::Stdio;

use cascade_tests::netns::Netns;

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");

#[test]
fn multicast_to_seven_namespaced_hosts_checks_every_byte() {
    if let Some(why) = Netns::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let hosts = 9; // 0: controller, 1: source, 2..=8: seven targets
    let mut net = Netns::create(hosts, Some(1000)).unwrap();
    let dir = tempdir();
    let mut cluster = format!("name = \"nsmc{}\"\n", std::process::id());
    let mut topo = String::new();
    for i in 0..hosts {
        cluster += &format!("[[nodes]]\nid = {i}\naddr = \"{}:7400\"\n", Netns::addr(i));
        topo += &format!("[[nodes]]\nid = {i}\ngpus = 1\nnic_gbps = 1.0\n");
    }
    std::fs::write(dir.join("cluster.toml"), cluster).unwrap();
    std::fs::write(dir.join("topo.toml"), topo).unwrap();
    for i in 1..hosts {
        let mut c = net.command(i, CASCADE);
        c.args(["node", "--cluster"]).arg(dir.join("cluster.toml")).args(["--node", &i.to_string()]);
        c.env("CASCADE_SECRET", "ns-secret").env("RUST_LOG", "error").env("XDG_RUNTIME_DIR", &dir);
        c.stdout(Stdio::null());
        net.spawn(c).unwrap();
    }
    let targets: Vec<String> = (2..hosts).map(|i| format!("{i}/gpu0")).collect();
    let mut c = net.command(0, CASCADE);
    c.args(["multicast", "--cluster"]).arg(dir.join("cluster.toml")).args(["--node", "0", "--topology"]);
    c.arg(dir.join("topo.toml")).args(["--sources", "1/gpu0", "--targets", &targets.join(",")]);
    c.args(["--bytes", &(32u64 << 20).to_string(), "--planner", "blitz", "--deadline-s", "60", "--json"]);
    c.env("CASCADE_SECRET", "ns-secret").env("RUST_LOG", "error").env("XDG_RUNTIME_DIR", &dir);
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "controller failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["completed"], 7, "{v}");
    assert_eq!(v["verified"], 7, "every target's crc32 equals the source's: {v}");
    assert_eq!(v["failed"].as_array().unwrap().len(), 0);
    // 32 MiB at 1000 Mbit/s takes 0.27 s; a chain of 7 adds only a few chunks.
    eprintln!("7 namespaced hosts loaded in {:.3} s (bound 0.268 s)", v["seconds"].as_f64().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cascade-nsmc-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
