//! Loads from the file through the manager, on the `mem` test double: a load reports its
//! progress as the node places bytes, may outlast `request_timeout` while it keeps going, and
//! is given up after `request_timeout` without progress.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cascade_multicast::cluster::Controller;
use cascade_transport::mem::{MemFabric, MemNode};
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Mesh, ServiceExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::exec::{Io, LOAD_POLL};
use super::*;
use crate::node::{start_services, PoolMsg};

/// A scratch directory of its own for each call (the tests run at once).
fn scratch(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/mem-manager-tests")
        .join(format!("{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Real time, a real pool node: the load's progress reaches the notices (and with them the
/// status and the CLI's bars), going forward, and the copy ends ready with no progress shown.
#[tokio::test]
async fn a_load_from_the_file_reports_its_progress_as_the_node_places_bytes() {
    let dir = scratch("load-progress");
    let file = dir.join("big.safetensors");
    crate::synthetic::write_llama2_like(&file, 128 << 20, 7).unwrap();
    let fabric = MemFabric::new();
    start_services(Arc::new(fabric.add_node(1)), Duration::from_secs(10)).unwrap();
    let mut cfg = ManagerConfig::new(vec![1]);
    cfg.request_timeout = Duration::from_secs(60);
    cfg.load_poll = Duration::from_millis(2);
    let mut m = crate::test_util::open_manager(Arc::new(fabric.add_node(0)), &dir.join("meta"), cfg).unwrap();
    let (tx, mut notices) = mpsc::unbounded_channel();
    m.notify(tx, std::time::Instant::now());
    m.start().await.unwrap();
    m.register("big", &file).await.unwrap();
    let (mut progress, mut ready) = (Vec::new(), false);
    while let Ok((_, n)) = notices.try_recv() {
        match n {
            Notice::Progress { bytes, total, .. } => progress.push((bytes, total)),
            Notice::Ready { .. } => ready = true,
            Notice::Failed { reason, .. } => panic!("the load failed: {reason}"),
            _ => {}
        }
    }
    assert!(ready, "no copy became ready");
    assert!(!progress.is_empty(), "a load of 128 MiB reported no progress");
    assert!(progress.windows(2).all(|w| w[0].0 < w[1].0), "progress goes forward: {progress:?}");
    assert!(progress.iter().all(|(b, total)| 0 < *b && *b <= *total), "{progress:?}");
    let s = m.status_handle().lock().unwrap().clone();
    assert!(s.healthy && s.copies.iter().all(|c| c.in_place.is_none()), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pool node's stand-in (a test double) on `node`: it answers `Load` after `finish` and says
/// it has placed 1 MiB per second of the load so far, up to `stall` (then no more); with
/// `can_say` false it refuses `LoadProgress`, as a node built before it does.
fn fake_node(node: MemNode, finish: Duration, stall: Duration, can_say: bool) {
    let node = Arc::new(node);
    let mut inbox = node.subscribe::<PoolMsg>(DEFAULT_INBOX).unwrap();
    let began = Arc::new(std::sync::Mutex::new(None::<Instant>));
    tokio::spawn(async move {
        while let Some(m) = inbox.recv().await {
            let (node, began) = (node.clone(), began.clone());
            tokio::spawn(async move {
                let reply = match m.msg {
                    PoolMsg::Load { .. } => {
                        *began.lock().unwrap() = Some(Instant::now());
                        tokio::time::sleep(finish).await;
                        PoolMsg::Loaded { result: Ok(finish.as_secs_f64()), file_missing: false }
                    }
                    PoolMsg::LoadProgress { .. } if can_say => {
                        let at = began.lock().unwrap().map(|t| t.elapsed().min(stall).as_secs() << 20);
                        PoolMsg::LoadAt { progress: at.map(|b| (b, 0)) }
                    }
                    other => PoolMsg::Failed { message: format!("cannot decode {other:?}") },
                };
                node.reply(&m.reply_to.unwrap(), &reply).unwrap();
            });
        }
    });
}

/// The manager's side of one load against a [`fake_node`], `request_timeout` 20 s: its
/// answer, how long it took, and the bytes of its progress notices.
async fn load_against(
    finish: Duration,
    stall: Duration,
    can_say: bool,
) -> (Result<PoolMsg, String>, Duration, Vec<u64>) {
    let fabric = MemFabric::new();
    fake_node(fabric.add_node(1), finish, stall, can_say);
    let mesh: Arc<dyn Mesh> = Arc::new(fabric.add_node(0));
    let (tx, mut notices) = mpsc::unbounded_channel();
    let io = Io {
        mesh: mesh.clone(),
        ctl: Arc::new(Controller::new(mesh).unwrap()),
        nodes: vec![1],
        rates: ManagerConfig::new(vec![1]).rates,
        request_timeout: Duration::from_secs(20),
        load_poll: LOAD_POLL,
        notices: Some(tx),
        epoch: std::time::Instant::now(),
        pool: "p".into(),
        status: Arc::default(),
        failures: Arc::default(),
    };
    let dir = scratch("load-fake");
    let file = dir.join("m.safetensors");
    crate::synthetic::write_llama2_like(&file, 1 << 20, 9).unwrap();
    let manifest = Box::new(crate::manifest::Manifest::from_file(&file, "m", 1 << 20).unwrap());
    let load = PoolMsg::Load { pool: "p".into(), copy: 5, path: file.display().to_string(), manifest };
    let t = Instant::now();
    let r = io.load_one(1, load, 1 << 40).await;
    let took = t.elapsed();
    let mut progress = Vec::new();
    while let Ok((_, n)) = notices.try_recv() {
        if let Notice::Progress { copy: 5, node: 1, bytes, .. } = n {
            progress.push(bytes);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    (r, took, progress)
}

#[tokio::test(start_paused = true)]
async fn a_load_that_keeps_going_may_outlast_the_request_timeout() {
    let (r, took, progress) = load_against(Duration::from_secs(90), Duration::MAX, true).await;
    assert!(matches!(r, Ok(PoolMsg::Loaded { result: Ok(_), .. })), "{r:?}");
    assert!(took >= Duration::from_secs(90) && took < Duration::from_secs(91), "{took:?}");
    // One notice per second of placed bytes, from about the first second to the last.
    assert!(progress.len() >= 85 && progress.windows(2).all(|w| w[0] < w[1]), "{progress:?}");
}

#[tokio::test(start_paused = true)]
async fn a_load_that_stops_making_progress_is_given_up_a_request_timeout_later() {
    let (r, took, progress) = load_against(Duration::from_secs(1000), Duration::from_secs(30), true).await;
    let e = r.unwrap_err();
    assert!(e.contains("made no progress for 20s") && e.contains(&format!("{} of", 30u64 << 20)), "{e}");
    // Its last progress at 30 s, given up 20 s later (checked every poll).
    assert!(took >= Duration::from_secs(50) && took <= Duration::from_secs(50) + LOAD_POLL * 2, "{took:?}");
    assert_eq!(progress.last(), Some(&(30u64 << 20)));
}

#[tokio::test(start_paused = true)]
async fn a_node_that_cannot_say_how_far_it_is_gets_the_request_timeout_in_all() {
    // As before progress existed: a 15 s load is fine, a 25 s one is given up at 20 s.
    let (r, _, progress) = load_against(Duration::from_secs(15), Duration::MAX, false).await;
    assert!(matches!(r, Ok(PoolMsg::Loaded { .. })) && progress.is_empty(), "{r:?}");
    let (r, took, _) = load_against(Duration::from_secs(25), Duration::MAX, false).await;
    assert!(r.unwrap_err().contains("made no progress"), "{took:?}");
    assert!(took >= Duration::from_secs(20) && took <= Duration::from_secs(20) + LOAD_POLL * 2, "{took:?}");
}
