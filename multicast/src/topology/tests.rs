use super::*;

const TOML: &str = r#"
[[nodes]]
id = 0
gpus = 4
nic_gbps = 100
nvlink = true
nics = [[0, 1], [2, 3]]

[[nodes]]
id = 1
gpus = 2
nic_gbps = 25

[[links]]
a = 0
b = 1
gbps = 10
kind = "tcp"

[[flows]]
from = "0/gpu0"
to = "1/gpu1"
"#;

#[test]
fn parses_nodes_links_nics_and_flows() {
    let t = Topology::from_toml(TOML).unwrap();
    assert_eq!(t.nodes().count(), 2);
    assert_eq!(t.link(Loc::gpu(0, 0), Loc::gpu(0, 3)).unwrap().kind, LinkKind::Nvlink);
    assert_eq!(t.link(Loc::gpu(1, 0), Loc::gpu(1, 1)).unwrap().kind, LinkKind::Pcie, "no NVLink on node 1");
    assert_eq!(t.link(Loc::host(0), Loc::gpu(0, 1)).unwrap().kind, LinkKind::Pcie);
    assert_eq!(t.link(Loc::gpu(0, 0), Loc::gpu(1, 0)).unwrap(), Link { kind: LinkKind::Tcp, gbps: 10.0 });
    assert_eq!(t.nic(Loc::gpu(0, 3)), (0, 1));
    assert!(t.sends_outward(Loc::gpu(0, 1)), "gpu1 shares gpu0's NIC, which sends outward");
    assert!(!t.sends_outward(Loc::gpu(0, 2)));
    assert!(t.receives_inward(Loc::gpu(1, 0)));
    assert!(!t.receives_inward(Loc::gpu(0, 0)));
}

#[test]
fn default_inter_node_bandwidth_is_the_slower_nic() {
    let mut t = Topology::new();
    t.add_node(0, 1, 100.0).unwrap();
    t.add_node(1, 1, 40.0).unwrap();
    assert_eq!(t.link(Loc::gpu(0, 0), Loc::gpu(1, 0)).unwrap(), Link { kind: LinkKind::Rdma, gbps: 40.0 });
}

#[test]
fn nvlink_groups_follow_connectivity() {
    let mut t = Topology::new();
    t.add_node(0, 4, 100.0).unwrap();
    t.add_node(1, 2, 100.0).unwrap();
    t.join_nvlink(0, &[0, 1]).unwrap();
    t.join_nvlink(0, &[1, 2]).unwrap(); // 0-1-2 joined through 1
    let g = t.nvlink_groups(&[
        Loc::gpu(1, 1),
        Loc::gpu(0, 2),
        Loc::gpu(0, 0),
        Loc::gpu(0, 3),
        Loc::host(1),
        Loc::gpu(1, 0),
    ]);
    assert_eq!(
        g,
        vec![
            vec![Loc::gpu(0, 0), Loc::gpu(0, 2)],
            vec![Loc::gpu(0, 3)],
            vec![Loc::host(1)], // host memory orders before a node's GPUs
            vec![Loc::gpu(1, 0)],
            vec![Loc::gpu(1, 1)],
        ]
    );
}

#[test]
fn bad_topologies_are_refused_with_the_reason() {
    let e = |s: &str| Topology::from_toml(s).unwrap_err().to_string();
    assert!(e("[[nodes]]\nid = 0\nnic_gbps = 1\n[[nodes]]\nid = 0\nnic_gbps = 1\n").contains("appears twice"));
    assert!(e("[[nodes]]\nid = 0\nnic_gbps = 0\n").contains("positive"));
    assert!(e("[[nodes]]\nid = 0\ngpus = 2\nnic_gbps = 1\nnics = [[0]]\n").contains("exactly one NIC"));
    assert!(e("[[nodes]]\nid = 0\nnic_gbps = 1\n[[flows]]\nfrom = \"0/gpu0\"\nto = \"0/host\"\n").contains("0/gpu0"));
    assert!(e("[[nodes]]\nid = 0\nnic_gbps = 1\n[[links]]\na = 0\nb = 9\ngbps = 1\n").contains("node 9"));
    assert!(e("[[nodes]]\nid = 0\nnic_gbps = 1\nbogus = 3\n").contains("bogus"));
}

#[test]
fn locations_parse_and_print() {
    for s in ["3/gpu7", "12/host"] {
        assert_eq!(s.parse::<Loc>().unwrap().to_string(), s);
    }
    for bad in ["3", "x/gpu1", "3/gpu", "3/cpu0", "/host"] {
        assert!(bad.parse::<Loc>().is_err(), "{bad}");
    }
}

#[test]
fn derived_from_a_connection_pool() {
    use cascade_transport::{BackendKind, ClusterSpec, NodeSpec};
    let nodes =
        (0..3).map(|i| NodeSpec { id: i, addr: format!("127.0.0.{}:1", i + 1).parse().unwrap(), host: None }).collect();
    let c = ClusterSpec::new("m", nodes).unwrap();
    let rates = MeshRates { nic_gbps: 100.0, tcp_gbps: 25.0, shm_gbps: 400.0, machine_gbps: None };
    let t = Topology::from_mesh(&c, 0, &[(1, BackendKind::Shm), (2, BackendKind::Tcp)], 2, rates).unwrap();
    assert_eq!(t.nodes().count(), 3);
    assert_eq!(t.link(Loc::gpu(0, 0), Loc::gpu(1, 1)).unwrap(), Link { kind: LinkKind::Pcie, gbps: 400.0 });
    assert_eq!(t.link(Loc::gpu(0, 0), Loc::gpu(2, 0)).unwrap(), Link { kind: LinkKind::Tcp, gbps: 25.0 });
    // Links the local pool does not see keep the NIC default.
    assert_eq!(t.link(Loc::gpu(1, 0), Loc::gpu(2, 0)).unwrap(), Link { kind: LinkKind::Rdma, gbps: 100.0 });
}

/// With `machine_gbps`, members that share a host (by `host`, else by address) are one machine
/// each; a member alone on its host is on none. Without it, none is declared.
#[test]
fn a_derived_topology_declares_the_hosts_shared_by_several_members() {
    use cascade_transport::{BackendKind, ClusterSpec, NodeSpec};
    let spec = |id: u32, ip: &str, host: Option<&str>| NodeSpec {
        id,
        addr: format!("{ip}:{}", 7000 + id).parse().unwrap(),
        host: host.map(str::to_string),
    };
    let c = ClusterSpec::new(
        "m",
        vec![
            spec(0, "10.0.0.1", None),
            spec(1, "10.0.0.1", None),
            spec(2, "10.0.0.2", Some("box-b")),
            spec(3, "10.0.0.3", Some("box-b")),
            spec(4, "10.0.0.4", None),
        ],
    )
    .unwrap();
    let links = [(1, BackendKind::Shm), (2, BackendKind::Tcp), (3, BackendKind::Tcp), (4, BackendKind::Tcp)];
    let rates = MeshRates { nic_gbps: 10.0, tcp_gbps: 10.0, shm_gbps: 40.0, machine_gbps: Some(60.0) };
    let t = Topology::from_mesh(&c, 0, &links, 1, rates).unwrap();
    let (a, b) = (t.machine_of(0).unwrap(), t.machine_of(2).unwrap());
    assert_eq!(t.machine_of(1), Some(a));
    assert_eq!(t.machine_of(3), Some(b));
    assert_ne!(a.index, b.index);
    assert_eq!((a.copy_gbps, b.copy_gbps), (60.0, 60.0));
    assert_eq!(t.machine_of(4), None, "alone on its host");
    let t = Topology::from_mesh(&c, 0, &links, 1, MeshRates { machine_gbps: None, ..rates }).unwrap();
    assert!((0..5).all(|n| t.machine_of(n).is_none()));
    // From the local links alone: the local node and its shared-memory peers.
    let t = Topology::from_links(&[0, 1, 2, 3, 4], 0, &links, 1, rates).unwrap();
    assert_eq!(t.machine_of(0), t.machine_of(1));
    assert!(t.machine_of(0).is_some());
    assert!((2..5).all(|n| t.machine_of(n).is_none()));
    // A local node with no shared-memory peer is on no machine.
    let t = Topology::from_links(&[0, 2], 0, &[(2, BackendKind::Tcp)], 1, rates).unwrap();
    assert!(t.machine_of(0).is_none());
}
