use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::region::test_access as ta;
use crate::wire::Status;

fn setup() -> (MemFabric, MemNode, MemNode, Region, Region) {
    let f = MemFabric::new();
    let a = f.add_node(1);
    let b = f.add_node(2);
    let src = Region::alloc(1024, Default::default()).unwrap();
    let dst = Region::alloc(1024, Default::default()).unwrap();
    for i in 0..1024u64 {
        ta::write_local(&src, i, &[(i % 251) as u8]).unwrap();
    }
    b.regions().register(&dst);
    (f, a, b, src, dst)
}

#[tokio::test]
async fn write_and_read_move_the_bytes() {
    let (_f, a, _b, src, dst) = setup();
    let l = a.link(2).unwrap();
    let h = l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 1024).verified()]);
    for r in futures_all(h).await {
        assert_eq!(r.unwrap().bytes, 1024);
    }
    assert_eq!(ta::view(&dst, 0, 1024).unwrap(), ta::view(&src, 0, 1024).unwrap());
    let back = Region::alloc(100, Default::default()).unwrap();
    let r = futures_all(l.post(vec![Op::read(&back, 0, dst.remote(2), 10, 100).verified()])).await;
    assert!(r[0].is_ok());
    assert_eq!(ta::view(&back, 0, 100).unwrap(), ta::view(&src, 10, 100).unwrap());
}

async fn futures_all(h: Vec<OpHandle>) -> Vec<Result<Completion>> {
    let mut v = Vec::new();
    for x in h {
        v.push(x.await);
    }
    v
}

#[tokio::test]
async fn bad_accesses_are_refused_and_memory_untouched() {
    let (_f, a, _b, src, dst) = setup();
    let l = a.link(2).unwrap();
    let mut wrong_key = dst.remote(2);
    wrong_key.key = crate::RemoteKey(wrong_key.key.0 ^ 1);
    let r = futures_all(l.post(vec![Op::write(&src, 0, wrong_key, 0, 8), Op::write(&src, 0, dst.remote(2), 1020, 8)]))
        .await;
    assert!(matches!(r[0], Err(TransportError::Refused { status: Status::BadKey, .. })));
    assert!(matches!(r[1], Err(TransportError::Refused { status: Status::OutOfBounds, .. })));
    assert!(ta::view(&dst, 0, 1024).unwrap().iter().all(|&b| b == 0));
}

#[tokio::test]
async fn corruption_is_caught_by_verification() {
    let (f, a, _b, src, dst) = setup();
    f.set_fault(1, 2, Some(Fault::Corrupt));
    let l = a.link(2).unwrap();
    let r = futures_all(l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 64).verified()])).await;
    assert!(matches!(r[0], Err(TransportError::CrcMismatch { .. })), "{:?}", r[0]);
    f.set_fault(1, 2, None);
    let r = futures_all(l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 64).verified()])).await;
    assert!(r[0].is_ok());
}

#[tokio::test]
async fn dropped_operations_time_out_and_killed_nodes_fail_fast() {
    let (f, a, _b, src, dst) = setup();
    let l = a.link(2).unwrap();
    f.set_fault(1, 2, Some(Fault::Drop));
    let h = l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 8)]).pop().unwrap();
    assert!(matches!(h.wait("write", Duration::from_millis(50)).await, Err(TransportError::Timeout { .. })));
    f.set_fault(1, 2, None);
    f.kill(2);
    assert!(!l.is_alive());
    let r = futures_all(l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 8)])).await;
    assert!(matches!(r[0], Err(TransportError::PeerDown { peer: 2, .. })));
}

#[tokio::test]
async fn delayed_operations_complete_late() {
    let (f, a, _b, src, dst) = setup();
    f.set_fault(1, 2, Some(Fault::Delay(Duration::from_millis(30))));
    let l = a.link(2).unwrap();
    let t = std::time::Instant::now();
    let r = futures_all(l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 8)])).await;
    assert!(r[0].is_ok());
    assert!(t.elapsed() >= Duration::from_millis(30));
}

#[tokio::test]
async fn only_the_next_operations_are_delayed_with_delay_next() {
    let (f, a, _b, src, dst) = setup();
    f.set_fault(1, 2, Some(Fault::DelayNext(2, Duration::from_millis(300))));
    let l = a.link(2).unwrap();
    let write = || l.post(vec![Op::write(&src, 0, dst.remote(2), 0, 8)]);
    let t = std::time::Instant::now();
    let (first, second) = (write(), write());
    let third = futures_all(write()).await;
    assert!(third[0].is_ok() && t.elapsed() < Duration::from_millis(300), "the third is not delayed");
    let (first, second) = tokio::join!(futures_all(first), futures_all(second));
    assert!(first[0].is_ok() && second[0].is_ok());
    assert!(t.elapsed() >= Duration::from_millis(300), "the first two are");
    assert!(f.0.faults.lock().unwrap().is_empty(), "the fault is spent");
}

#[tokio::test]
async fn a_delayed_batch_keeps_its_order() {
    use crate::service::{ServiceExt, ServiceFault};
    let (f, a, b, src, dst) = setup();
    let mut inbox = b.subscribe::<ServiceFault>(4).unwrap();
    f.set_fault(1, 2, Some(Fault::Delay(Duration::from_millis(30))));
    let t = std::time::Instant::now();
    let ops = vec![Op::write(&src, 0, dst.remote(2), 0, 512), Op::write(&src, 512, dst.remote(2), 512, 512)];
    let note = ServiceFault::Malformed { detail: "behind".into() };
    let r = futures_all(a.post_oneway_after(2, ops, &note).unwrap()).await;
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
    // Each operation waits out its own delay behind the one before it: none overtakes.
    assert!(t.elapsed() >= Duration::from_millis(90), "{:?}", t.elapsed());
    assert_eq!(inbox.recv().await.unwrap().msg, note);
    assert_eq!(ta::view(&dst, 0, 1024).unwrap(), ta::view(&src, 0, 1024).unwrap());
}

#[tokio::test]
async fn send_reaches_the_service_inbox() {
    use crate::service::{ServiceExt, ServiceFault};
    let (_f, a, b, _src, _dst) = setup();
    let mut inbox = b.subscribe::<ServiceFault>(4).unwrap();
    let h = a.post_oneway(2, &ServiceFault::Malformed { detail: "hi".into() }).unwrap();
    assert!(h.await.is_ok());
    let m = inbox.recv().await.unwrap();
    assert_eq!((m.from, m.msg), (1, ServiceFault::Malformed { detail: "hi".into() }));
    // A raw SEND that is not an envelope is dropped and counted.
    let l = a.link(2).unwrap();
    assert!(futures_all(l.post(vec![Op::Send { payload: Bytes::from_static(b"hi") }])).await[0].is_ok());
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while b.services().stats().malformed == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
}
