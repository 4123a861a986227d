//! The manager with node daemons over real loopback endpoints, in one process.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::Endpoint;

use super::*;
use crate::node::start_services;
use crate::test_util::Scratch;
use cascade_transport::test_access as ta;

async fn endpoints(n: u32, tag: &str) -> Vec<Arc<Endpoint>> {
    cascade_tests::loopback::endpoints(n, tag, |cfg| cfg.connect_timeout = Duration::from_millis(300)).await.unwrap()
}

fn scratch(tag: &str) -> Scratch {
    let d = Scratch::new(&format!("mgr-{tag}"));
    std::fs::create_dir_all(&*d).unwrap();
    d
}

fn models(dir: &std::path::Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("m{i}.safetensors"));
            crate::synthetic::write_llama2_like(&p, (1 + i as u64 % 3) << 20, i as u64).unwrap();
            p
        })
        .collect()
}

fn config(nodes: Vec<NodeId>, k: usize) -> ManagerConfig {
    let mut cfg = ManagerConfig::new(nodes);
    cfg.k = k;
    cfg.dead_after = Duration::from_millis(200);
    cfg.request_timeout = Duration::from_secs(20);
    cfg
}

async fn healthy_within(status: &Arc<Mutex<Status>>, limit: Duration) -> Status {
    let t = Instant::now();
    loop {
        let s = status.lock().unwrap().clone();
        if s.healthy || t.elapsed() > limit {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repairs_after_a_node_dies_from_copies_or_from_the_file() {
    for k in [1, 2] {
        let dir = scratch(&format!("repair{k}"));
        let eps = endpoints(5, &format!("mgr{k}")).await;
        for e in &eps[1..] {
            start_services(e.clone(), Duration::from_secs(10)).unwrap();
        }
        let mut m =
            crate::test_util::open_manager(eps[0].clone(), &dir.join("meta"), config(vec![1, 2, 3, 4], k)).unwrap();
        m.start().await.unwrap();
        for (i, p) in models(&dir, 6).iter().enumerate() {
            m.register(&format!("m{i}"), p).await.unwrap();
        }
        let rep = m.check().await.unwrap();
        assert!(rep.healthy, "k={k}: {:?}", rep.problems);
        assert_eq!(rep.copies_checked, 6 * k);
        let bytes = m.status_handle().lock().unwrap().nodes.iter().map(|n| n.bytes).collect::<Vec<_>>();
        let mean = bytes.iter().sum::<u64>() as f64 / bytes.len() as f64;
        assert!(bytes.iter().all(|b| (*b as f64 - mean).abs() <= mean * 0.5), "k={k}: roughly balanced: {bytes:?}");
        // A duplicate name or duplicate content is refused.
        let again = m.register("m0", &dir.join("m1.safetensors")).await.unwrap_err().to_string();
        assert!(again.contains("registered already"), "{again}");
        let same = m.register("other", &dir.join("m1.safetensors")).await.unwrap_err().to_string();
        assert!(same.contains("same content"), "{same}");
        // Node 2 dies.
        let status = m.status_handle();
        let (tx, rx) = mpsc::channel(4);
        let mgr = tokio::spawn(m.run(rx));
        let killed = Instant::now();
        eps[2].shutdown();
        let t = Instant::now();
        while status.lock().unwrap().nodes.iter().any(|n| n.id == 2) {
            assert!(t.elapsed() < Duration::from_secs(10), "k={k}: node 2 was never declared dead");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let s = healthy_within(&status, Duration::from_secs(20)).await;
        eprintln!("k={k}: pool healthy {:?} after the node died", killed.elapsed());
        assert!(s.healthy, "k={k}: repaired: {s}");
        assert!(s.copies.iter().all(|c| c.node != 2));
        assert_eq!(s.copies.len(), 6 * k, "k={k}: exactly k copies of every model, none duplicated");
        let (rtx, rrx) = tokio::sync::oneshot::channel();
        tx.send(AdminCall { request: AdminRequest::Check, caller: Caller::Operator, reply: rtx }).await.unwrap();
        let rep: CheckReport = serde_json::from_value(rrx.await.unwrap().unwrap()).unwrap();
        assert!(rep.healthy, "k={k}: {:?}", rep.problems);
        drop(tx);
        mgr.await.unwrap().unwrap();
        for e in &eps {
            e.shutdown();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_only_copy_died_with_its_file_gone_is_reported_lost() {
    let dir = scratch("lost");
    let eps = endpoints(3, "lost").await;
    for e in &eps[1..] {
        start_services(e.clone(), Duration::from_secs(10)).unwrap();
    }
    let mut m = crate::test_util::open_manager(eps[0].clone(), &dir.join("meta"), config(vec![1, 2], 1)).unwrap();
    m.start().await.unwrap();
    let p = &models(&dir, 1)[0];
    let id = m.register("m", p).await.unwrap();
    let node = m.status_handle().lock().unwrap().copies[0].node;
    std::fs::remove_file(p).unwrap();
    eps[node as usize].shutdown();
    let t = Instant::now();
    while m.status_handle().lock().unwrap().nodes.iter().any(|n| n.id == node) {
        assert!(t.elapsed() < Duration::from_secs(10), "node {node} was never declared dead");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let actions = m.poll_peers().await.unwrap();
        m.drive(actions).await.unwrap();
    }
    // The file is gone: the load on the survivor fails, and the model is reported lost.
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.models[0].lost.is_some(), "{s}");
    assert!(s.copies.is_empty(), "no copy is left pending: {s}");
    let rep = m.check().await.unwrap();
    assert!(!rep.healthy);
    assert!(rep.problems.iter().any(|p| p.contains(&format!("model {id} is lost"))), "{:?}", rep.problems);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_finds_corrupt_and_unknown_copies_and_repair_fixes_them() {
    let dir = scratch("corrupt");
    let eps = endpoints(4, "corrupt").await;
    let mut pools = vec![None];
    for e in &eps[1..] {
        pools.push(Some(start_services(e.clone(), Duration::from_secs(10)).unwrap().pool));
    }
    let held = |n: usize| pools[n].as_ref().unwrap().held();
    let mut m = crate::test_util::open_manager(eps[0].clone(), &dir.join("meta"), config(vec![1, 2, 3], 2)).unwrap();
    m.start().await.unwrap();
    m.register("m", &models(&dir, 1)[0]).await.unwrap();
    let c = m.status_handle().lock().unwrap().copies[0].clone();
    // Flip a byte of one copy, and plant a copy nobody knows.
    let pid = m.pool_id().to_string();
    ta::write_local(&held(c.node as usize).get(&pid, c.id).unwrap(), 12345, &[0xff, 0x00, 0xff]).unwrap();
    let stray = eps[3].register_new(4096).unwrap();
    held(3).insert(&pid, 999, stray);
    let rep = m.check().await.unwrap();
    assert!(!rep.healthy);
    assert_eq!(rep.bad_copies, vec![c.id], "{:?}", rep.problems);
    {
        // Status says so too (it used to say healthy while a copy was bad).
        let s = m.status_handle().lock().unwrap().clone();
        assert!(!s.healthy, "{s}");
        assert!(s.copies.iter().any(|x| x.id == c.id && x.bad && !x.verified), "{s}");
    }
    assert!(rep.problems.iter().any(|p| p.contains("copy 999")), "{:?}", rep.problems);
    let after = m.repair().await.unwrap();
    assert!(after.healthy, "{:?}", after.problems);
    let t = Instant::now();
    while held(3).get(&pid, 999).is_some() {
        assert!(t.elapsed() < Duration::from_secs(5), "the unknown copy was dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = m.status_handle().lock().unwrap().clone();
    assert_eq!(s.copies.len(), 2);
    assert!(s.healthy && s.copies.iter().all(|x| x.verified && !x.bad), "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_manager_keeps_finished_copies_and_remakes_unfinished_ones() {
    let dir = scratch("restart");
    let eps = endpoints(4, "restart").await;
    for e in &eps[1..] {
        start_services(e.clone(), Duration::from_secs(10)).unwrap();
    }
    let paths = models(&dir, 3);
    {
        let mut m =
            crate::test_util::open_manager(eps[0].clone(), &dir.join("meta"), config(vec![1, 2, 3], 1)).unwrap();
        m.start().await.unwrap();
        m.register("a", &paths[0]).await.unwrap();
        // Register b, but "crash" before any of its copies is made: the events are in the log,
        // the loads never went out.
        let entry = ModelEntry {
            path: paths[1].display().to_string(),
            manifest: Manifest::from_file(&paths[1], "b", DEFAULT_CHUNK).unwrap(),
        };
        let bytes = entry.manifest.bytes;
        m.apply(Event::Describe { model: 2, entry: Box::new(entry) }).await.unwrap();
        let pending = m.apply(Event::Register { model: 2, bytes, file_reachable: true }).await.unwrap();
        assert_eq!(pending.len(), 1);
    }
    let mut m = crate::test_util::open_manager(eps[0].clone(), &dir.join("meta"), config(vec![1, 2, 3], 1)).unwrap();
    assert!(!m.status_handle().lock().unwrap().healthy, "b's copy is still loading after recovery");
    m.start().await.unwrap();
    let rep = m.check().await.unwrap();
    assert!(rep.healthy, "{:?}", rep.problems);
    assert_eq!(m.status_handle().lock().unwrap().copies.len(), 2, "one copy of each, none duplicated");
}
