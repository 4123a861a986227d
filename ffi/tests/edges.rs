//! The C ABI at its edges, called from Rust as a C caller would: two endpoints of one process on
//! loopback. What a careful C program may legitimately do must work, and what breaks a call's
//! contract in a way the library can see must be refused with a code that says so.
#![allow(clippy::unwrap_used)]

use std::ffi::{CStr, CString};
use std::net::TcpListener;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use cascade_ffi::*;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated string valid until this thread's next failing call.
    unsafe { CStr::from_ptr(cascade_last_error()) }.to_string_lossy().into_owned()
}

/// Two connected endpoints, nodes 0 and 1.
fn pair() -> (*mut cascade_endpoint, *mut cascade_endpoint) {
    let toml = CString::new(format!(
        "name = \"edges\"\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:{}\"\n[[nodes]]\nid = 1\naddr = \"127.0.0.1:{}\"\n",
        free_port(),
        free_port()
    ))
    .unwrap();
    let secret = b"edges-secret";
    let make = |node: u32| {
        let cfg = cascade_endpoint_config {
            struct_size: std::mem::size_of::<cascade_endpoint_config>() as u32,
            node,
            cluster_toml: toml.as_ptr(),
            secret: secret.as_ptr(),
            secret_len: secret.len(),
            flags: CASCADE_CONFIG_NO_SHM,
            op_timeout_ms: 5_000,
            memory_limit: 0,
        };
        let mut ep = null_mut();
        // SAFETY: a full config whose pointers outlive the call; `ep` is writable.
        assert_eq!(unsafe { cascade_endpoint_create(&cfg, &mut ep) }, CASCADE_OK, "{}", last_error());
        ep
    };
    let (a, b) = (make(0), make(1));
    for ep in [a, b] {
        // SAFETY: a live endpoint.
        assert_eq!(unsafe { cascade_endpoint_wait_ready(ep, 10_000) }, CASCADE_OK, "{}", last_error());
    }
    (a, b)
}

fn destroy(eps: [*mut cascade_endpoint; 2]) {
    for ep in eps {
        // SAFETY: live endpoints, not used again.
        assert_eq!(unsafe { cascade_endpoint_destroy(ep) }, CASCADE_OK);
    }
}

/// `cascade_recv` polled until a message is there (`buf` null when `cap` is 0).
fn recv(ep: *mut cascade_endpoint, buf: *mut u8, cap: usize) -> (i32, u32, u64, usize) {
    let (mut from, mut tag, mut needed) = (u32::MAX, u64::MAX, usize::MAX);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        // SAFETY: a live endpoint; `buf` is null with `cap` 0 or writable for `cap` bytes; the
        // out-parameters are writable.
        let rc = unsafe { cascade_recv(ep, &mut from, &mut tag, buf, cap, &mut needed) };
        if rc != CASCADE_IN_PROGRESS || Instant::now() > end {
            return (rc, from, tag, needed);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn an_empty_message_is_received_without_a_buffer() {
    let (a, b) = pair();
    // SAFETY: a live endpoint; no data with length 0.
    assert_eq!(unsafe { cascade_send(a, 1, 7, null(), 0) }, CASCADE_OK, "{}", last_error());
    // SAFETY: as above, 5 readable bytes.
    assert_eq!(unsafe { cascade_send(a, 1, 8, b"after".as_ptr(), 5) }, CASCADE_OK, "{}", last_error());
    // The empty message fits the caller's "no buffer": before, it was refused as too large for
    // it ("the output needs 0 bytes; the buffer holds 0") and stayed queued for ever, blocking
    // every message behind it.
    assert_eq!(recv(b, null_mut(), 0), (CASCADE_OK, 0, 7, 0), "{}", last_error());
    // The next message does need a buffer, says how large, and stays queued until it gets one.
    assert_eq!(recv(b, null_mut(), 0), (CASCADE_ERR_BUFFER_TOO_SMALL, u32::MAX, u64::MAX, 5));
    let mut buf = [0u8; 5];
    assert_eq!(recv(b, buf.as_mut_ptr(), buf.len()), (CASCADE_OK, 0, 8, 5));
    assert_eq!(&buf, b"after");
    // A message over the limit fails the call and queues no completion (it was taken, and
    // failed later in its completion; to this node itself it was delivered).
    let huge = vec![7u8; 65 << 20];
    for to in [1, 0] {
        // SAFETY: a live endpoint; `huge` is readable for its length.
        let rc = unsafe { cascade_send(a, to, 9, huge.as_ptr(), huge.len()) };
        assert_eq!(rc, CASCADE_ERR_OTHER, "to {to}: {}", last_error());
        assert!(last_error().contains("exceeds the limit of 67108864 bytes"), "{}", last_error());
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut c = cascade_completion::default();
    let mut n = 0;
    // SAFETY: a live endpoint; one writable record and a writable count.
    while unsafe { cascade_poll(a, &mut c, 1, &mut n) } == CASCADE_OK {
        assert_ne!(c.tag, 9, "a refused message was queued: {c:?}");
    }
    destroy([a, b]);
}

#[test]
fn a_region_deregistered_through_another_endpoint_is_refused_and_kept() {
    let (a, b) = pair();
    let mut region = null_mut();
    // SAFETY: a live endpoint; `region` is writable.
    assert_eq!(unsafe { cascade_region_alloc(b, 4096, &mut region) }, CASCADE_OK, "{}", last_error());
    // Through the wrong endpoint: before, this withdrew nothing and waited out its timeout as
    // "still used by operations in flight; call again", every time it was called.
    let start = Instant::now();
    // SAFETY: live handles (the region of the other endpoint is the misuse under test).
    let rc = unsafe { cascade_region_deregister(a, region, 2_000) };
    assert_eq!(rc, CASCADE_ERR_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("registered with another endpoint (node 1)"), "{}", last_error());
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    // The region is still registered with its own endpoint: node 0 can write into it.
    let mut desc = cascade_remote_region::default();
    // SAFETY: a live region; `desc` is writable.
    assert_eq!(unsafe { cascade_region_descriptor(region, &mut desc) }, CASCADE_OK);
    let mut src = null_mut();
    // SAFETY: a live endpoint; `src` is writable.
    assert_eq!(unsafe { cascade_region_alloc(a, 4096, &mut src) }, CASCADE_OK, "{}", last_error());
    let op = cascade_op {
        struct_size: std::mem::size_of::<cascade_op>() as u32,
        kind: CASCADE_OP_WRITE,
        local: src,
        local_offset: 0,
        remote: desc,
        remote_offset: 0,
        len: 4096,
        flags: CASCADE_OP_VERIFY,
        tag: 3,
    };
    // SAFETY: one op whose handles stay live until its completion is polled below.
    assert_eq!(unsafe { cascade_post(a, &op, 1) }, CASCADE_OK, "{}", last_error());
    let mut c = cascade_completion::default();
    let mut n = 0;
    let end = Instant::now() + Duration::from_secs(10);
    // SAFETY: a live endpoint; one writable record and a writable count.
    while unsafe { cascade_poll(a, &mut c, 1, &mut n) } != CASCADE_OK && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!((c.tag, c.status, c.bytes), (3, CASCADE_OK, 4096));
    // Through its own endpoint it goes.
    // SAFETY: live handles of the right endpoints, not used again.
    unsafe {
        assert_eq!(cascade_region_deregister(b, region, 2_000), CASCADE_OK, "{}", last_error());
        assert_eq!(cascade_region_deregister(a, src, 2_000), CASCADE_OK, "{}", last_error());
    }
    destroy([a, b]);
}

#[test]
fn a_missing_cluster_file_is_bad_configuration_as_a_missing_secret_is() {
    let dir = std::env::temp_dir().join(format!("cascade-ffi-join-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cluster, secret) = (dir.join("cluster.toml"), dir.join("secret"));
    std::fs::write(&cluster, format!("name = \"j\"\n[[nodes]]\nid = 0\naddr = \"127.0.0.1:{}\"\n", free_port()))
        .unwrap();
    std::fs::write(&secret, "join-secret\n").unwrap();
    let missing = dir.join("missing");
    let path = |p: &std::path::Path| CString::new(p.to_str().unwrap()).unwrap();
    for (c, s, says) in [(&missing, &secret, "reading cluster file"), (&cluster, &missing, "reading the secret")] {
        let mut ep = null_mut();
        // SAFETY: NUL-terminated paths; `ep` is writable.
        let rc = unsafe { cascade_endpoint_join(path(c).as_ptr(), 0, path(s).as_ptr(), &mut ep) };
        assert_eq!(rc, CASCADE_ERR_CONFIG, "{}", last_error());
        assert!(last_error().contains(says), "{}", last_error());
    }
    let mut ep = null_mut();
    // SAFETY: as above.
    let rc = unsafe { cascade_endpoint_join(path(&cluster).as_ptr(), 0, path(&secret).as_ptr(), &mut ep) };
    assert_eq!(rc, CASCADE_OK, "{}", last_error());
    // SAFETY: a live endpoint, not used again.
    assert_eq!(unsafe { cascade_endpoint_destroy(ep) }, CASCADE_OK);
    let _ = std::fs::remove_dir_all(&dir);
}
