use super::*;

fn spec(id: NodeId, addr: &str, host: Option<&str>) -> NodeSpec {
    NodeSpec { id, addr: addr.parse().unwrap(), host: host.map(String::from) }
}

#[test]
fn parses_a_cluster_file() {
    let c = ClusterSpec::from_toml(
        r#"
        name = "t1"
        [[nodes]]
        id = 0
        addr = "127.0.0.1:7000"
        [[nodes]]
        id = 1
        addr = "10.1.0.2:7000"
        host = "b"
        "#,
    )
    .unwrap();
    assert_eq!(c.nodes.len(), 2);
    assert_eq!(c.node(1).unwrap().host_key(), "b");
    assert_eq!(c.node(0).unwrap().host_key(), "127.0.0.1");
}

#[test]
fn rejects_duplicates_and_junk() {
    let dup = "[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:2\"\n";
    assert!(ClusterSpec::from_toml(dup).unwrap_err().to_string().contains("appears twice"));
    let same_addr = "[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n[[nodes]]\nid = 1\naddr = \"127.0.0.1:1\"\n";
    assert!(ClusterSpec::from_toml(same_addr).unwrap_err().to_string().contains("share address"));
    assert!(ClusterSpec::from_toml("nodes = []").is_err());
    assert!(ClusterSpec::from_toml("[[nodes]]\nid = 0\naddr = \"nowhere\"\n").is_err());
    // A host name says that only addresses are taken (serde said "invalid socket address syntax").
    let named = ClusterSpec::from_toml("[[nodes]]\nid = 0\naddr = \"gpu-1.example:7400\"\n").unwrap_err().to_string();
    assert!(named.contains("\"gpu-1.example:7400\" is not an IP address and port"), "{named}");
    assert!(named.contains("host names are not resolved"), "{named}");
    let v6 = ClusterSpec::from_toml("[[nodes]]\nid = 0\naddr = \"[::1]:7400\"\n").unwrap();
    assert_eq!(v6.nodes[0].addr, "[::1]:7400".parse().unwrap());
    assert!(ClusterSpec::from_toml("name = \"../x\"\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\n").is_err());
    let port0 = "[[nodes]]\nid = 3\naddr = \"127.0.0.1:0\"\n";
    assert!(ClusterSpec::from_toml(port0).unwrap_err().to_string().contains("node 3: address 127.0.0.1:0 has port 0"));
    for any in ["0.0.0.0:7400", "[::]:7400"] {
        let e = ClusterSpec::from_toml(&format!("[[nodes]]\nid = 2\naddr = \"{any}\"\n")).unwrap_err().to_string();
        assert!(e.contains(&format!("node 2: address {any} is unspecified, which no peer can dial")), "{e}");
    }
    let no_host = "[[nodes]]\nid = 0\naddr = \"127.0.0.1:1\"\nhost = \" \"\n";
    assert!(ClusterSpec::from_toml(no_host).unwrap_err().to_string().contains("an empty host name"));
}

#[test]
fn endpoint_config_is_validated() {
    let c = ClusterSpec::new("c", vec![spec(0, "127.0.0.1:1", None)]).unwrap();
    assert!(EndpointConfig::new(0, c.clone(), b"s").validate().is_ok());
    assert!(EndpointConfig::new(5, c.clone(), b"s").validate().is_err());
    assert!(EndpointConfig::new(0, c, b"").validate().is_err());
}

#[test]
fn backend_selection() {
    let a = spec(0, "127.0.0.1:1", None);
    let b = spec(1, "127.0.0.1:2", None);
    let c = spec(2, "10.0.0.3:2", None);
    let all = Caps::TCP.with(Caps::SHM).with(Caps::RDMA);
    assert_eq!(select_backend(&a, all, &b, all), BackendKind::Shm);
    assert_eq!(select_backend(&a, Caps::TCP, &b, all), BackendKind::Tcp);
    assert_eq!(select_backend(&a, all, &c, all), BackendKind::Rdma);
    assert_eq!(select_backend(&a, all, &c, Caps::TCP.with(Caps::SHM)), BackendKind::Tcp);
    // Same answer from both sides.
    for (x, y) in [(&a, &b), (&a, &c)] {
        assert_eq!(select_backend(x, all, y, all), select_backend(y, all, x, all));
    }
}

#[test]
fn a_file_error_names_the_file_and_each_cause_once() {
    use std::error::Error as _;
    let dir = std::env::temp_dir().join(format!("cascade-config-chain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = ClusterSpec::load(&dir.join("absent.toml")).unwrap_err();
    assert!(missing.to_string().contains("absent.toml"), "{missing}");
    assert!(missing.to_string().contains("No such file"), "{missing}");
    assert!(missing.source().is_none(), "the OS error is in the message already");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "nodes = []\n").unwrap();
    let e = ClusterSpec::load(&bad).unwrap_err().to_string();
    assert_eq!(e.matches("configuration").count(), 1, "{e}");
    assert!(e.contains("bad.toml") && e.contains("no nodes"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
