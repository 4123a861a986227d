//! The manager's failure scenarios on the `mem` test double with virtual time (tokio's paused
//! clock): a node killed in the middle of a repair, the manager itself restarted in the middle of
//! a repair, a flapping link. Time moves only when every task waits on a timer (blocking work —
//! loads, checksums, WAL writes — holds it still), so the times measured here are virtual and
//! the same on every run of a seed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cascade_transport::mem::{MemFabric, MemNode};
use tokio::time::Instant;

use super::*;
use crate::meta::EmbeddedStore;
use crate::node::start_services;

pub(super) const DEAD_AFTER: Duration = Duration::from_millis(500);

pub(super) struct MemCluster {
    pub(super) fabric: MemFabric,
    /// Node `i`'s multicast service at `i - 1`.
    multicast: Vec<Arc<cascade_multicast::cluster::MulticastNode>>,
    nodes: u32,
    dir: PathBuf,
    models: Vec<PathBuf>,
}

impl MemCluster {
    /// Node 0 is the manager's, nodes 1..=n serve the pool; `models` model files of 1–3 MiB.
    pub(super) fn new(n: u32, models: usize, tag: &str) -> MemCluster {
        Self::with_limits(n, models, tag, &[])
    }

    /// As `new`, with memory limits for some nodes.
    fn with_limits(n: u32, models: usize, tag: &str, limits: &[(NodeId, u64)]) -> MemCluster {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/mem-manager-tests")
            .join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let paths = (0..models)
            .map(|i| {
                let p = dir.join(format!("m{i}.safetensors"));
                crate::synthetic::write_llama2_like(&p, (1 + i as u64 % 3) << 20, 100 + i as u64).unwrap();
                p
            })
            .collect();
        let fabric = MemFabric::new();
        let mut multicast = Vec::new();
        for i in 1..=n {
            let limit = limits.iter().find(|(x, _)| *x == i).map(|(_, b)| *b);
            let services =
                start_services(Arc::new(fabric.add_node_with_limit(i, limit)), Duration::from_secs(10)).unwrap();
            multicast.push(services.multicast);
        }
        MemCluster { fabric, multicast, nodes: n, dir, models: paths }
    }

    /// A started manager with every model registered, and its notices.
    pub(super) async fn registered(
        &self,
        k: usize,
    ) -> (Manager<EmbeddedStore>, mpsc::UnboundedReceiver<(f64, Notice)>) {
        let mut m = self.manager(k);
        let (tx, notices) = mpsc::unbounded_channel();
        m.notify(tx, std::time::Instant::now());
        m.start().await.unwrap();
        for (i, p) in self.models.iter().enumerate() {
            m.register(&format!("m{i}"), p).await.unwrap();
        }
        (m, notices)
    }

    /// A manager of a second pool (its own new store) on a fresh node 0, over the same nodes.
    fn other_pool(&self, k: usize) -> Manager<EmbeddedStore> {
        let mut cfg = ManagerConfig::new((1..=self.nodes).collect());
        cfg.k = k;
        cfg.init = true;
        let store = EmbeddedStore::open(&self.dir.join("meta-other")).unwrap();
        Manager::open(Arc::new(self.fabric.add_node(0)), store, cfg).unwrap()
    }

    /// A manager on a fresh node 0 (a restarted manager process), on the cluster's store.
    pub(super) fn manager(&self, k: usize) -> Manager<EmbeddedStore> {
        let mesh: Arc<MemNode> = Arc::new(self.fabric.add_node(0));
        let mut cfg = ManagerConfig::new((1..=self.nodes).collect());
        cfg.k = k;
        cfg.dead_after = DEAD_AFTER;
        cfg.request_timeout = Duration::from_secs(20);
        crate::test_util::open_manager(mesh, &self.dir.join("meta"), cfg).unwrap()
    }
}

impl Drop for MemCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Exactly k ready copies of every model, none on `dead`, and every copy's crcs match.
pub(super) async fn assert_whole(m: &mut Manager<EmbeddedStore>, k: usize, models: usize, dead: &[NodeId]) {
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.healthy, "{s}");
    assert_eq!(s.copies.len(), models * k, "exactly k copies of every model:\n{s}");
    assert!(s.copies.iter().all(|c| !dead.contains(&c.node)), "{s}");
    let rep = m.check().await.unwrap();
    assert!(rep.healthy, "{:?}", rep.problems);
}

/// Waits (virtually) for a notice that `f` accepts.
pub(super) async fn notice_where(
    rx: &mut mpsc::UnboundedReceiver<(f64, Notice)>,
    f: impl Fn(&Notice) -> bool,
) -> Notice {
    loop {
        let (_, n) = rx.recv().await.expect("the manager stopped sending notices");
        if f(&n) {
            return n;
        }
    }
}

/// Lets every blocking task (a load, a checksum, a WAL write) end: paused time does not move
/// while one runs.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

pub(super) async fn healthy_without(status: &Arc<Mutex<Status>>, dead: &[NodeId]) {
    let t = Instant::now();
    loop {
        {
            let s = status.lock().unwrap();
            if s.healthy && s.nodes.iter().all(|n| !dead.contains(&n.id)) {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "not healthy after a virtual minute:\n{s}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A second node dies while the pool repairs the first: the drive takes the second death in and
/// the pool ends whole. Returns the virtual time from the first kill to the whole pool.
async fn second_death_mid_repair(seed: u64) -> Duration {
    let (k, models) = (2, 8);
    let c = MemCluster::new(5, models, &format!("kill{seed}"));
    let (m, mut notices) = c.registered(k).await;
    let status = m.status_handle();
    let first = 1 + (seed % 5) as NodeId;
    let second = 1 + ((seed / 5 + first as u64) % 5) as NodeId;
    let second = if second == first { first % 5 + 1 } else { second };
    let (admin, rx) = mpsc::channel(4);
    let task = tokio::spawn(m.run(rx));
    while notices.try_recv().is_ok() {} // the registrations' notices
    let t0 = Instant::now();
    c.fabric.kill(first);
    notice_where(&mut notices, |n| matches!(n, Notice::Creating { .. })).await;
    c.fabric.kill(second);
    healthy_without(&status, &[first, second]).await;
    assert!(!task.is_finished(), "the manager stopped: {:?}", task.await);
    let took = t0.elapsed();
    drop(admin);
    let mut m = match task.await.unwrap() {
        Ok(()) => c.manager(k),
        Err(e) => panic!("{e}"),
    };
    m.start().await.unwrap();
    assert_whole(&mut m, k, models, &[first, second]).await;
    took
}

#[tokio::test(start_paused = true)]
async fn a_node_killed_mid_repair_on_mem_with_virtual_time() {
    for seed in [1, 7, 12] {
        let took = second_death_mid_repair(seed).await;
        // Each death is declared `dead_after` after it; the repairs themselves take no virtual time.
        assert!(took >= DEAD_AFTER && took <= 2 * DEAD_AFTER + Duration::from_millis(100), "seed {seed}: {took:?}");
        assert_eq!(second_death_mid_repair(seed).await, took, "seed {seed}: the same virtual time again");
    }
}

#[tokio::test(start_paused = true)]
async fn a_manager_restarted_mid_repair_on_mem_finishes_it() {
    let (k, models) = (2, 8);
    let c = MemCluster::new(5, models, "restart");
    let (m, mut notices) = c.registered(k).await;
    let victim = m.status_handle().lock().unwrap().nodes.iter().max_by_key(|n| n.bytes).unwrap().id;
    let (_admin, rx) = mpsc::channel(4);
    let task = tokio::spawn(m.run(rx));
    c.fabric.kill(victim);
    // The manager "crashes" once the first repaired copy is ready: its node dies (the nodes drop
    // its runs), its task goes, and its blocking writes end before a new manager opens the store.
    notice_where(&mut notices, |n| matches!(n, Notice::Ready { .. })).await;
    c.fabric.kill(0);
    task.abort();
    let _ = task.await;
    settle().await;
    let mut m = c.manager(k);
    m.start().await.unwrap();
    assert_whole(&mut m, k, models, &[victim]).await;
}

#[tokio::test(start_paused = true)]
async fn a_flapping_link_is_not_a_death_but_a_long_cut_is() {
    let (k, models) = (2, 4);
    let c = MemCluster::new(4, models, "flap");
    let (m, mut notices) = c.registered(k).await;
    let status = m.status_handle();
    let (_admin, rx) = mpsc::channel(4);
    let _task = tokio::spawn(m.run(rx));
    // Three short cuts of 200 ms (under dead_after): never declared dead.
    for _ in 0..3 {
        c.fabric.set_link(0, 2, false);
        tokio::time::sleep(Duration::from_millis(200)).await;
        c.fabric.set_link(0, 2, true);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    {
        let s = status.lock().unwrap();
        assert!(s.healthy && s.nodes.iter().any(|n| n.id == 2), "{s}");
    }
    while let Ok((_, n)) = notices.try_recv() {
        assert!(!matches!(n, Notice::NodeDown { .. }), "a short cut declared a node dead: {n:?}");
    }
    // A cut longer than dead_after: declared dead exactly dead_after after the cut, repaired.
    let t0 = Instant::now();
    c.fabric.set_link(0, 2, false);
    let n = notice_where(&mut notices, |n| matches!(n, Notice::NodeDown { .. })).await;
    assert_eq!(n, Notice::NodeDown { node: 2, drained: false });
    assert_eq!(t0.elapsed(), DEAD_AFTER, "declared dead after exactly dead_after (virtual time)");
    healthy_without(&status, &[2]).await;
    let s = status.lock().unwrap().clone();
    assert_eq!(s.copies.len(), models * k, "{s}");
}

/// A register the pool cannot honour (k above the live nodes, a name with control characters)
/// is refused before anything is written: the catalog stays empty and the name stays free.
#[tokio::test(start_paused = true)]
async fn a_refused_register_leaves_nothing_behind() {
    let c = MemCluster::new(2, 1, "refused");
    let mut m = c.manager(3);
    m.start().await.unwrap();
    let err = m.register("m0", &c.models[0]).await.unwrap_err().to_string();
    assert!(err.contains("k = 3 copies on distinct nodes need 3 live nodes; live now: 2"), "{err}");
    let err = m.register("bad\u{1b}[2Jname", &c.models[0]).await.unwrap_err().to_string();
    assert!(err.contains("control characters") && !err.contains('\u{1b}'), "{err}");
    assert!(m.catalog().is_empty(), "a refused register left a catalog entry");
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.models.is_empty() && s.healthy, "{s}");
}

/// A store whose writes fail while `full` is set (a full disk), in front of a real one.
struct FlakyStore {
    inner: EmbeddedStore,
    full: Arc<std::sync::atomic::AtomicBool>,
}

impl crate::meta::MetaStore for FlakyStore {
    fn append(&mut self, record: &[u8]) -> Result<(), crate::meta::MetaError> {
        if self.full.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(crate::meta::MetaError::Io {
                context: "appending to the WAL".into(),
                error: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        self.inner.append(record)
    }
    fn snapshot(&mut self, state: &[u8]) -> Result<(), crate::meta::MetaError> {
        self.inner.snapshot(state)
    }
    fn recover(&mut self) -> Result<crate::meta::Recovered, crate::meta::MetaError> {
        self.inner.recover()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// A full disk while a node dies: the manager stays up and says it is degraded, then repairs the
/// pool once writes go through again.
#[tokio::test(start_paused = true)]
async fn a_full_disk_degrades_the_manager_instead_of_killing_it() {
    let (k, models) = (2, 4);
    let c = MemCluster::new(4, models, "enospc");
    let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cfg = ManagerConfig::new((1..=c.nodes).collect());
    cfg.k = k;
    cfg.dead_after = DEAD_AFTER;
    cfg.init = true;
    let store = FlakyStore { inner: EmbeddedStore::open(&c.dir.join("meta")).unwrap(), full: full.clone() };
    let mut m = Manager::open(Arc::new(c.fabric.add_node(0)), store, cfg).unwrap();
    m.start().await.unwrap();
    for (i, p) in c.models.iter().enumerate() {
        m.register(&format!("m{i}"), p).await.unwrap();
    }
    let status = m.status_handle();
    let (admin, rx) = mpsc::channel(4);
    let task = tokio::spawn(m.run(rx));
    full.store(true, std::sync::atomic::Ordering::SeqCst);
    c.fabric.kill(3);
    let t = Instant::now();
    loop {
        settle().await;
        let s = status.lock().unwrap().clone();
        if let Some(why) = &s.degraded {
            assert!(why.contains("No space left"), "{why}");
            assert!(!s.healthy);
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never degraded:\n{s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An admin request is answered (with the store's error), not left hanging.
    let (tx, back) = tokio::sync::oneshot::channel();
    admin
        .send(AdminCall { request: AdminRequest::Reclaim { copy: 1 }, caller: Caller::Operator, reply: tx })
        .await
        .unwrap();
    let answer = back.await.unwrap();
    assert!(answer.is_err(), "{answer:?}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!task.is_finished(), "the manager stopped on a full disk");
    full.store(false, std::sync::atomic::Ordering::SeqCst);
    healthy_without(&status, &[3]).await;
    assert!(status.lock().unwrap().degraded.is_none());
    drop(admin);
    task.await.unwrap().unwrap();
}

/// Registering a FIFO (or anything but a regular file) is refused at once; the manager does not
/// block on it (it used to, and missed a node's death meanwhile).
#[tokio::test(start_paused = true)]
async fn registering_a_fifo_is_refused_without_blocking() {
    let c = MemCluster::new(2, 0, "fifo");
    let mut m = c.manager(1);
    m.start().await.unwrap();
    let fifo = c.dir.join("model.safetensors");
    let path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `path` is a valid NUL-terminated string.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let r = tokio::time::timeout(Duration::from_secs(5), m.register("fifo", &fifo)).await;
    let err = r.expect("register blocked on a FIFO").unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
    assert!(m.catalog().is_empty());
}

/// A manager started on a new store (a mistyped path with --init, say) on nodes that hold another
/// pool's copies leaves them alone: it reports them, never drops or overwrites them — even where
/// its own copy ids are the same numbers.
#[tokio::test(start_paused = true)]
async fn a_new_pool_leaves_another_pools_copies_alone() {
    let c = MemCluster::new(3, 2, "twopools");
    let (m, _) = c.registered(2).await;
    let first = m.pool_id().to_string();
    let before = m.status_handle().lock().unwrap().copies.len();
    drop(m);
    // A second pool: its own store, the same nodes.
    let mut other = c.other_pool(2);
    other.start().await.unwrap();
    assert_ne!(other.pool_id(), first);
    let s = other.status_handle().lock().unwrap().clone();
    assert_eq!(s.foreign.len(), before, "the first pool's copies are reported:\n{s}");
    assert!(s.foreign.iter().all(|f| f.pool == first));
    other.register("m0", &c.models[0]).await.unwrap();
    // Asked explicitly, it drops them (and only them: its own copy stays).
    let own = other.status_handle().lock().unwrap().copies.len();
    assert_eq!(other.drop_foreign().await, before);
    assert!(other.status_handle().lock().unwrap().foreign.is_empty());
    assert!(other.check().await.unwrap().healthy);
    assert_eq!(other.status_handle().lock().unwrap().copies.len(), own);
    drop(other);
    // The first pool, restarted, had its copies dropped by that explicit request: it makes them
    // again from the files.
    let mut m = c.manager(2);
    m.start().await.unwrap();
    assert_whole(&mut m, 2, 2, &[]).await;
}

/// Without an explicit request, a second pool on the same nodes leaves the first one's copies
/// alone: the first pool, restarted, finds every copy intact and makes none again.
#[tokio::test(start_paused = true)]
async fn another_pools_copies_survive_a_second_pool() {
    let c = MemCluster::new(3, 2, "twopools2");
    let (m, _) = c.registered(2).await;
    drop(m);
    let mut other = c.other_pool(2);
    other.start().await.unwrap();
    other.register("m0", &c.models[0]).await.unwrap();
    assert!(other.repair().await.unwrap().healthy);
    drop(other);
    let mut m = c.manager(2);
    let (tx, mut notices) = mpsc::unbounded_channel();
    m.notify(tx, std::time::Instant::now());
    m.start().await.unwrap();
    assert_whole(&mut m, 2, 2, &[]).await;
    while let Ok((_, n)) = notices.try_recv() {
        assert!(!matches!(n, Notice::Creating { .. }), "a copy of the first pool had to be made again: {n:?}");
    }
}

async fn live_again(status: &Arc<Mutex<Status>>, node: NodeId) {
    let t = Instant::now();
    loop {
        {
            let s = status.lock().unwrap();
            if s.healthy && s.nodes.iter().any(|n| n.id == node) {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "node {node} not re-admitted:\n{s}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub(super) async fn nodes(admin: &mpsc::Sender<AdminCall>) -> Vec<NodeReport> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    admin.send(AdminCall { request: AdminRequest::Nodes, caller: Caller::Operator, reply: tx }).await.unwrap();
    serde_json::from_value(rx.await.unwrap().unwrap()).unwrap()
}

/// A false death (a long pause, a network blip) is not permanent: the node, declared dead and
/// replaced, is re-admitted once its link stayed up for `dead_after` — also by a manager
/// restarted in between — and the copies it kept from before are dropped, not counted twice.
#[tokio::test(start_paused = true)]
async fn a_node_declared_dead_that_comes_back_is_readmitted() {
    let (k, models) = (2, 4);
    let c = MemCluster::new(4, models, "readmit");
    let (m, mut notices) = c.registered(k).await;
    let status = m.status_handle();
    let (admin, rx) = mpsc::channel(4);
    let task = tokio::spawn(m.run(rx));
    while notices.try_recv().is_ok() {}
    c.fabric.set_link(0, 2, false);
    notice_where(&mut notices, |n| matches!(n, Notice::NodeDown { node: 2, .. })).await;
    healthy_without(&status, &[2]).await;
    assert_eq!(nodes(&admin).await.iter().find(|n| n.id == 2).unwrap().state, "dead");
    // Back, briefly: a flap before dead_after does not re-admit it.
    c.fabric.set_link(0, 2, true);
    tokio::time::sleep(DEAD_AFTER / 2).await;
    assert_eq!(nodes(&admin).await.iter().find(|n| n.id == 2).unwrap().state, "returning");
    c.fabric.set_link(0, 2, false);
    tokio::time::sleep(DEAD_AFTER * 2).await;
    assert!(status.lock().unwrap().nodes.iter().all(|n| n.id != 2));
    // Back for good: re-admitted dead_after later; the pool is whole with exactly k copies.
    c.fabric.set_link(0, 2, true);
    live_again(&status, 2).await;
    assert_eq!(status.lock().unwrap().copies.len(), models * k);
    let report = nodes(&admin).await;
    let two = report.iter().find(|n| n.id == 2).unwrap();
    assert_eq!(two.state, "live");
    assert!(two.history.iter().any(|(_, w)| w.contains("re-admitted")), "{:?}", two.history);

    // Dead again, and the manager restarts while the node is away and after it is back.
    c.fabric.set_link(0, 2, false);
    notice_where(&mut notices, |n| matches!(n, Notice::NodeDown { node: 2, .. })).await;
    healthy_without(&status, &[2]).await;
    drop(admin);
    task.await.unwrap().unwrap();
    c.fabric.set_link(0, 2, true);
    let mut m = c.manager(k);
    m.start().await.unwrap();
    let status = m.status_handle();
    let (_admin, rx) = mpsc::channel(4);
    let _task = tokio::spawn(m.run(rx));
    live_again(&status, 2).await;
    assert_eq!(status.lock().unwrap().copies.len(), models * k);
}

/// Copies a restarted manager recovered from its log are shown unverified until a check.
#[tokio::test(start_paused = true)]
async fn recovered_copies_are_unverified_until_checked() {
    let c = MemCluster::new(3, 2, "verified");
    let (m, _) = c.registered(2).await;
    assert!(m.status_handle().lock().unwrap().copies.iter().all(|x| x.verified), "made copies are verified");
    drop(m);
    let mut m = c.manager(2);
    m.start().await.unwrap();
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.copies.iter().all(|x| !x.verified), "{s}");
    assert!(s.to_string().contains("ready?"), "{s}");
    assert!(m.check().await.unwrap().healthy);
    assert!(m.status_handle().lock().unwrap().copies.iter().all(|x| x.verified));
}

/// Nodes advertise their memory limit; the pool places copies only where they fit and refuses a
/// register with too few nodes that have room before writing anything.
#[tokio::test(start_paused = true)]
async fn copies_are_placed_only_on_nodes_with_room() {
    // Node 3 may hold 1.5 MiB: the 2 MiB model (m1) cannot go there.
    let c = MemCluster::with_limits(3, 3, "capacity", &[(3, 3 << 19)]);
    let mut m = c.manager(2);
    m.start().await.unwrap();
    m.register("m1", &c.models[1]).await.unwrap();
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.copies.iter().all(|x| x.node != 3), "{s}");
    assert!(s.healthy, "{s}");
    drop(m);
    let mut m = c.other_pool(3);
    m.start().await.unwrap();
    let err = m.register("m2", &c.models[2]).await.unwrap_err().to_string();
    assert!(err.contains("fits on 2 live nodes"), "{err}");
}

/// A deploy whose instance cannot be made (a GPU the node does not have) is an error saying
/// why, not "serving" (it used to return success while the multicast had failed). An instance
/// on a GPU above 0 is made (the manager's topology had one GPU per node: every such deploy
/// failed as "not in the topology"), and a second deploy of one that serves is that answer.
#[tokio::test(start_paused = true)]
async fn a_deploy_that_cannot_be_made_is_an_error() {
    let c = MemCluster::new(3, 1, "deploy");
    c.multicast[1].declare_gpus(2); // node 2 has gpu0 and gpu1; nodes 1 and 3 emulate any GPU
    let (mut m, mut notices) = c.registered(1).await;
    let err = m.deploy(1, 2, 7).await.unwrap_err().to_string();
    assert!(err.contains("could not be made: "), "{err}");
    assert!(err.contains("node 2 has no gpu7: it has gpu0 to gpu1"), "{err}");
    m.deploy(1, 2, 1).await.unwrap();
    m.deploy(1, 3, 5).await.unwrap();
    while notices.try_recv().is_ok() {}
    m.deploy(1, 2, 1).await.unwrap();
    // Before, it made a copy at the instance's own place, whose multicast then failed ("target
    // 2/gpu1 is listed twice or is also a source").
    let after: Vec<_> = std::iter::from_fn(|| notices.try_recv().ok()).collect();
    assert!(after.is_empty(), "a second deploy of a serving instance did something: {after:?}");
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.healthy, "{s}");
}

/// A scale-out with one node the pool refuses (one it does not know), or naming a node twice,
/// starts nothing: no copy is left loading on the nodes it would have accepted. A valid one
/// makes every instance.
#[tokio::test(start_paused = true)]
async fn a_scale_out_with_a_refused_node_starts_nothing() {
    let c = MemCluster::new(3, 1, "scale-refused");
    let (mut m, _) = c.registered(1).await;
    let before = m.pool().copies().count();
    let err = m.scale_out(1, &[2, 3, 9]).await.unwrap_err().to_string();
    assert!(err.contains('9'), "{err}");
    assert_eq!(m.pool().copies().count(), before, "a refused scale-out left copies behind");
    let err = m.scale_out(1, &[2, 3, 2]).await.unwrap_err().to_string();
    assert!(err.contains("node 2 is listed twice") && err.contains("nothing was started"), "{err}");
    assert_eq!(m.pool().copies().count(), before, "a scale-out naming a node twice left copies behind");
    m.scale_out(1, &[2, 3]).await.unwrap();
    let ready =
        m.pool().copies().filter(|x| x.model == 1 && x.kind == CopyKind::Gpu(0) && x.state == CopyState::Ready).count();
    assert_eq!(ready, 2);
}

/// An epoch plan moves model 1 from sub-cluster 0 (nodes 1, 2) to sub-cluster 1 (nodes 3, 4):
/// instances appear on 3 and 4 through the pool, those on 1 and 2 go, and the pool stays whole.
#[tokio::test(start_paused = true)]
async fn an_epoch_plan_moves_a_model_through_the_pool() {
    let c = MemCluster::new(4, 2, "epoch");
    let (mut m, _) = c.registered(2).await;
    let nodes_of = vec![vec![1, 2], vec![3, 4]];
    // Epoch 1: both models on sub-cluster 0.
    let first: Vec<epoch::EpochMove> =
        [1, 2].into_iter().map(|model| epoch::EpochMove { model, from: vec![], to: nodes_of[0].clone() }).collect();
    m.apply_epoch(&first).await.unwrap();
    let gpus = |m: &Manager<EmbeddedStore>, model: ModelId| -> Vec<NodeId> {
        let mut v: Vec<NodeId> = m
            .pool()
            .copies()
            .filter(|x| x.model == model && x.kind == CopyKind::Gpu(0) && x.state == CopyState::Ready)
            .map(|x| x.node)
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(gpus(&m, 1), vec![1, 2]);
    // Epoch 2: model 1 moves to sub-cluster 1, model 2 stays.
    let moves = epoch::epoch_moves(&[1, 2], &[0, 0], &[1, 0], &nodes_of).unwrap();
    assert_eq!(moves, vec![epoch::EpochMove { model: 1, from: vec![1, 2], to: vec![3, 4] }]);
    m.apply_epoch(&moves).await.unwrap();
    assert_eq!(gpus(&m, 1), vec![3, 4]);
    assert_eq!(gpus(&m, 2), vec![1, 2]);
    let rep = m.check().await.unwrap();
    assert!(rep.healthy, "{:?}", rep.problems);
    let e = epoch::epoch_moves(&[1], &[0], &[2], &nodes_of).unwrap_err();
    assert_eq!(e, "a plan puts model 1 in sub-cluster 2, but only 2 are given (0 to 1)");
    // A model twice, or a node in two sub-clusters, contradict a plan: refused, not carried out
    // (the first put model 1 on both sub-clusters, the second moved it off node 2).
    let e = epoch::moves_from_plans(&[1, 1], None, &[0, 1], &nodes_of).unwrap_err();
    assert!(e.contains("model 1 is listed twice"), "{e}");
    let e = epoch::epoch_moves(&[1, 1], &[0, 1], &[1, 0], &nodes_of).unwrap_err();
    assert!(e.contains("model 1 is listed twice"), "{e}");
    let overlapping = vec![vec![1, 2], vec![2, 3]];
    let e = epoch::moves_from_plans(&[1, 2], Some(&[0, 0]), &[1, 0], &overlapping).unwrap_err();
    assert!(e.contains("node 2 is in sub-clusters 0 and 1"), "{e}");
    let e = epoch::moves_from_plans(&[1, 2], None, &[1, 0], &[vec![1, 2], vec![3, 3]]).unwrap_err();
    assert!(e.contains("node 3 is listed twice in sub-cluster 1"), "{e}");
    // The operator's way in: the admin request, from two plans' assignments.
    let back = epoch::moves_from_plans(&[1, 2], Some(&[1, 0]), &[0, 0], &nodes_of).unwrap();
    let r = m.serve(AdminRequest::ApplyEpoch { moves: back }, Caller::Operator).await.unwrap();
    assert_eq!(r["moved"], 1);
    assert_eq!(gpus(&m, 1), vec![1, 2]);
    let first = epoch::moves_from_plans(&[1, 2], None, &[1, 0], &nodes_of).unwrap();
    assert_eq!(first[0], epoch::EpochMove { model: 1, from: vec![], to: vec![3, 4] });
    assert!(epoch::moves_from_plans(&[1, 2], None, &[1], &nodes_of).is_err(), "plan shorter than the models");
    // A plan with a bad move anywhere is refused whole, before its first move: model 1 stays.
    let mv = |model, to: Vec<NodeId>| epoch::EpochMove { model, from: vec![1, 2], to };
    for (bad, says) in [
        (mv(9, vec![3, 4]), "model 9 is not registered"),
        (mv(2, vec![3, 42]), "node 42 (in model 2's move) is not a pool node"),
        (mv(2, vec![]), "model 2 moves to no node"),
        (mv(1, vec![2]), "model 1 moves twice in one plan"),
    ] {
        let e = m.apply_epoch(&[mv(1, vec![3, 4]), bad]).await.unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("nothing was moved"), "{e}");
        assert_eq!(gpus(&m, 1), vec![1, 2], "the move before the bad one was made");
    }
}
