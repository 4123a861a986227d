//! A control message is not stuck behind a transfer: on a tcp link, a message posted after 64
//! queued 1 MiB WRITEs reaches the peer before most of them have landed (the writer's control
//! lane, and a bounded unsent backlog in the socket).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{binary_message, Op, ServiceExt, ServiceId};

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Hello(u32);

binary_message!(Hello, ServiceId(900), 1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_overtakes_queued_bulk_writes() {
    let eps = cascade_tests::loopback::endpoints(2, "lane", |_| {}).await.unwrap();
    let mut inbox = eps[1].subscribe::<Hello>(DEFAULT_INBOX).unwrap();
    const CHUNK: u64 = 1 << 20;
    const N: u64 = 64;
    let src = eps[0].register_new(CHUNK * N).unwrap();
    let dst = eps[1].register_new(CHUNK * N).unwrap();
    let link = eps[0].link(1).unwrap();
    let ops = (0..N).map(|i| Op::write(&src, i * CHUNK, dst.remote(1), i * CHUNK, CHUNK)).collect();
    let writes = link.post(ops);
    eps[0].post_oneway(1, &Hello(7)).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
    // What node 1 had received from node 0 when the message came.
    let received = eps[1].stats().iter().find(|p| p.peer == 0).unwrap().stats.bytes_rx;
    assert_eq!(got.msg.0, 7);
    for w in writes {
        w.wait("write", Duration::from_secs(10)).await.unwrap();
    }
    assert!(
        received < CHUNK * N / 2,
        "the message arrived after {} MiB of the {N} MiB queued before it",
        received >> 20
    );
}
