//! Draining a node through the manager, on the `mem` test double with virtual time: the pool
//! never holds fewer than k whole copies while the node's copies move, the drained node's
//! departure needs no repair, a drain the pool cannot honour is refused without a record, and
//! an undrained node takes copies again.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use super::tests_mem::{assert_whole, healthy_without, nodes, notice_where, MemCluster, DEAD_AFTER};
use super::*;
use crate::manager::admin::{AdminCall, AdminRequest, Caller};

/// Whole copies per model, replayed from the notices: each ready copy adds one, each dropped
/// one takes one; panics if a model ever has fewer than `k`.
fn replay_never_below_k(
    notices: &[Notice],
    start: &BTreeMap<ModelId, usize>,
    k: usize,
    of: &BTreeMap<CopyId, ModelId>,
) {
    let mut have = start.clone();
    for n in notices {
        let (copy, delta) = match n {
            Notice::Ready { copy, .. } => (*copy, 1i64),
            Notice::Dropped { copy, .. } => (*copy, -1),
            Notice::NodeDown { node, .. } => panic!("node {node} declared dead during a drain"),
            _ => continue,
        };
        let model = of[&copy];
        let h = have.entry(model).or_default();
        *h = (*h as i64 + delta) as usize;
        assert!(*h >= k, "model {model} fell to {h} whole copies at {n:?}; notices: {notices:?}");
    }
}

/// One admin request, answered.
async fn call(admin: &mpsc::Sender<AdminCall>, request: AdminRequest) -> Result<serde_json::Value, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    admin.send(AdminCall { request, caller: Caller::Operator, reply: tx }).await.unwrap();
    rx.await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_drained_node_holds_nothing_and_its_departure_needs_no_repair() {
    let (k, models) = (2, 6);
    let c = MemCluster::new(5, models, "drain");
    let (mut m, mut notices) = c.registered(k).await;
    while notices.try_recv().is_ok() {}
    let s = m.status_handle().lock().unwrap().clone();
    let victim = s.nodes.iter().max_by_key(|n| n.bytes).unwrap().id;
    let held = s.copies.iter().filter(|x| x.node == victim).count();
    assert!(held >= 2, "{s}");
    let mut of: BTreeMap<CopyId, ModelId> = s.copies.iter().map(|x| (x.id, x.model)).collect();
    let start: BTreeMap<ModelId, usize> = s.models.iter().map(|x| (x.id, x.ready)).collect();

    let rep = m.drain(victim).await.unwrap();
    assert!(rep.drained, "{rep:?}");
    assert_eq!((rep.copies_made, rep.copies_dropped), (held, held), "{rep:?}");
    assert!(rep.left.is_empty() && rep.bytes_made > 0, "{rep:?}");
    let mut seen = Vec::new();
    while let Ok((_, n)) = notices.try_recv() {
        if let Notice::Creating { copy, model, node, from, .. } = &n {
            assert_ne!(*node, victim, "a copy placed on the drained node");
            assert_eq!(*from, "multicast", "replacements come from the copies, the node's own among them");
            of.insert(*copy, *model);
        }
        seen.push(n);
    }
    replay_never_below_k(&seen, &start, k, &of);
    assert_whole(&mut m, k, models, &[victim]).await;
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.nodes.iter().any(|n| n.id == victim && n.draining && n.copies == 0), "{s}");
    assert!(s.to_string().contains("(drained)"), "{s}");
    assert!(s.models.iter().all(|x| x.whole == x.ready && x.whole >= k), "nothing evicting is left: {s:?}");

    // The node stops: declared dead after dead_after, and nothing is made again.
    let status = m.status_handle();
    let (admin, rx) = mpsc::channel(4);
    let _task = tokio::spawn(m.run(rx));
    assert_eq!(nodes(&admin).await.iter().find(|n| n.id == victim).unwrap().state, "drained");
    c.fabric.kill(victim);
    let gone = notice_where(&mut notices, |n| matches!(n, Notice::NodeDown { .. })).await;
    assert_eq!(gone, Notice::NodeDown { node: victim, drained: true });
    tokio::time::sleep(DEAD_AFTER).await;
    while let Ok((_, n)) = notices.try_recv() {
        assert!(!matches!(n, Notice::Creating { .. }), "a drained node's departure repaired something: {n:?}");
    }
    healthy_without(&status, &[victim]).await;
    let report = nodes(&admin).await;
    let v = report.iter().find(|n| n.id == victim).unwrap();
    assert!((v.state.as_str(), v.draining) == ("dead", true), "{v:?}");
    assert!(v.history.iter().any(|(_, w)| w.contains("nothing to repair")), "{:?}", v.history);
}

#[tokio::test(start_paused = true)]
async fn a_drain_the_pool_cannot_honour_is_refused_and_an_undrained_node_takes_copies_again() {
    let (k, models) = (2, 2);
    let c = MemCluster::new(3, models, "undrain");
    let (mut m, _notices) = c.registered(k).await;
    let free = {
        let s = m.status_handle().lock().unwrap().clone();
        s.nodes.iter().min_by_key(|n| (n.bytes, n.id)).unwrap().id
    };
    // Draining one of three is fine; a second would leave one node for k = 2.
    assert!(m.drain(free).await.unwrap().drained);
    let (admin, rx) = mpsc::channel(4);
    let status = m.status_handle();
    let task = tokio::spawn(m.run(rx));
    let other = (1..=3).find(|n| *n != free).unwrap();
    let err = call(&admin, AdminRequest::Drain { node: other }).await.unwrap_err();
    assert!(
        err.contains(&format!("draining node {other}"))
            && err.contains("k = 2 copies on distinct nodes need 2 live nodes; live now: 1"),
        "{err}"
    );
    let err = call(&admin, AdminRequest::Drain { node: 9 }).await.unwrap_err();
    assert!(err.contains("node 9 is not one of the pool's nodes (1, 2, 3)"), "{err}");
    let err = call(&admin, AdminRequest::Deploy { model: 1, node: free, gpu: 0 }).await.unwrap_err();
    assert!(err.contains("drained"), "{err}");
    // Undrained, it takes a deploy again; a restarted manager knows only the records written,
    // so the refused drain left nothing behind.
    call(&admin, AdminRequest::Undrain { node: free }).await.unwrap();
    call(&admin, AdminRequest::Deploy { model: 1, node: free, gpu: 0 }).await.unwrap();
    assert!(status.lock().unwrap().copies.iter().any(|x| x.node == free && x.kind == "gpu0"));
    drop(admin);
    task.await.unwrap().unwrap();
    let mut m = c.manager(k);
    m.start().await.unwrap();
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.nodes.iter().all(|n| !n.draining), "{s}");
    // A drain survives a restart of the manager.
    assert!(m.drain(other).await.unwrap().drained);
    drop(m);
    let m = c.manager(k);
    assert!(m.pool().is_draining(other));
}

/// While a drain's replacements are multicast, the published status — what `cascade pool
/// status` reads while the manager is busy — shows each loading copy's bytes in place as its
/// layers land (the progress `cascade pool drain` draws), and nothing once it is ready.
#[tokio::test(start_paused = true)]
async fn the_status_shows_how_far_each_loading_copy_is_while_the_manager_drains() {
    let (k, models) = (2, 4);
    let c = MemCluster::new(4, models, "drain-progress");
    let (mut m, mut notices) = c.registered(k).await;
    while notices.try_recv().is_ok() {}
    let status = m.status_handle();
    let victim = status.lock().unwrap().nodes.iter().max_by_key(|n| n.bytes).unwrap().id;
    let watch = async {
        let (mut seen_loading, mut progress) = (0, 0);
        while let Some((_, n)) = notices.recv().await {
            let Notice::Progress { copy, bytes, total, .. } = n else { continue };
            progress += 1;
            let s = status.lock().unwrap().clone();
            let c = s.copies.iter().find(|c| c.id == copy).unwrap_or_else(|| panic!("copy {copy} not in {s}"));
            assert!(
                s.models.iter().all(|m| m.whole >= k && m.whole >= m.ready),
                "the status shows a model short: {s:?}"
            );
            match c.state.as_str() {
                // Later layers may have landed since the notice was sent, none fewer.
                "loading" => {
                    let at = c.in_place.unwrap_or_else(|| panic!("loading copy {copy} shows no progress: {s}"));
                    assert!(bytes <= at && at <= total, "copy {copy}: {at} of {total} after {bytes}");
                    let shown = format!("{}:{}:loading({}%)", c.node, c.kind, at * 100 / total);
                    assert!(s.to_string().contains(&shown), "{shown} not in\n{s}");
                    seen_loading += 1;
                }
                "ready" => assert_eq!(c.in_place, None, "a ready copy shows no progress"),
                other => panic!("copy {copy} is {other} while it loads"),
            }
        }
        (seen_loading, progress)
    };
    let (rep, (seen_loading, progress)) = tokio::join!(
        async {
            let rep = m.drain(victim).await.unwrap();
            drop(m); // the notices end with the manager
            rep
        },
        watch
    );
    assert!(rep.drained && rep.copies_made >= 2, "{rep:?}");
    assert!(progress >= rep.copies_made, "every replacement reports its layers: {progress} notices");
    assert!(seen_loading > 0, "no progress notice found its copy still loading ({progress} notices)");
    let s = status.lock().unwrap().clone();
    assert!(s.copies.iter().all(|c| c.in_place.is_none()), "{s}");
}
