use proptest::prelude::*;

use super::*;
use crate::test_util::Scratch;

fn dir(tag: &str) -> Scratch {
    Scratch::new(&format!("meta-{tag}"))
}

#[test]
fn records_survive_reopening() {
    let d = dir("rt");
    let mut s = EmbeddedStore::open(&d).unwrap();
    for r in [&b"one"[..], b"", b"three"] {
        s.append(r).unwrap();
    }
    drop(s);
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(
        rec,
        Recovered { snapshot: None, records: vec![b"one".to_vec(), vec![], b"three".to_vec()], dropped_tail_bytes: 0 }
    );
}

#[test]
fn a_torn_tail_is_cut_off_and_appending_continues() {
    let d = dir("torn");
    let mut s = EmbeddedStore::open(&d).unwrap();
    s.append(b"a").unwrap();
    s.append(b"bb").unwrap();
    // A crash in the middle of the third append: half a frame on disk.
    let partial = frame(b"ccccccc");
    OpenOptions::new().append(true).open(d.join("wal.log")).unwrap().write_all(&partial[..9]).unwrap();
    drop(s);
    let mut s = EmbeddedStore::open(&d).unwrap();
    let rec = s.recover().unwrap();
    assert_eq!(rec.records, vec![b"a".to_vec(), b"bb".to_vec()]);
    assert_eq!(rec.dropped_tail_bytes, 9);
    s.append(b"d").unwrap();
    assert_eq!(s.recover().unwrap().records.len(), 3);
}

#[test]
fn a_corrupt_record_stops_replay_there() {
    let d = dir("crc");
    let mut s = EmbeddedStore::open(&d).unwrap();
    for r in [&b"first"[..], b"second", b"third"] {
        s.append(r).unwrap();
    }
    let path = d.join("wal.log");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8 + 5 + 8 + 2] ^= 0xff; // inside "second"
    std::fs::write(&path, &bytes).unwrap();
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(rec.records, vec![b"first".to_vec()]);
    assert!(rec.dropped_tail_bytes > 0);
}

#[test]
fn snapshots_compact_the_log() {
    let d = dir("snap");
    let mut s = EmbeddedStore::open(&d).unwrap();
    s.append(b"x").unwrap();
    s.snapshot(b"state-1").unwrap();
    s.append(b"y").unwrap();
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(rec.snapshot.as_deref(), Some(&b"state-1"[..]));
    assert_eq!(rec.records, vec![b"y".to_vec()]);
    // A damaged snapshot is an error, not silently empty state.
    let mut b = std::fs::read(d.join("snapshot.bin")).unwrap();
    b[9] ^= 1;
    std::fs::write(d.join("snapshot.bin"), b).unwrap();
    assert!(matches!(EmbeddedStore::open(&d).unwrap().recover(), Err(MetaError::Corrupt(_))));
}

fn events() -> Vec<Event> {
    vec![
        Event::Register { model: 1, bytes: 100, file_reachable: true },
        Event::Register { model: 2, bytes: 300, file_reachable: false },
        Event::CopyReady(1),
        Event::CopyReady(2),
        Event::CopyReady(3),
        Event::CopyReady(4),
        Event::Deploy { model: 1, node: 3, gpu: 0 },
        Event::CopyReady(5),
        Event::NodeDown(0),
        Event::CopyReady(6),
        Event::Reclaim(5),
        Event::CopyFailed(99), // refused: unknown copy — replays the same way
        Event::NodeUp(0),
        Event::Describe {
            model: 1,
            entry: Box::new(ModelEntry { path: "/m/one.safetensors".into(), manifest: tiny() }),
        },
    ]
}

fn tiny() -> crate::manifest::Manifest {
    let bytes = crate::synthetic::llama2_like(64 << 10, 1).unwrap();
    crate::manifest::Manifest::from_bytes(&bytes, "tiny", 4096, "tiny.safetensors").unwrap()
}

fn fresh() -> Pool {
    Pool::new(2, 0..4)
}

#[test]
fn a_restarted_manager_rebuilds_the_same_pool() {
    for every in [1000, 3] {
        let d = dir("pool");
        let (mut p, _) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), every).unwrap();
        let mut reference = State { pool: fresh(), catalog: Default::default() };
        for e in events() {
            let got = p.apply(e.clone());
            let want = apply(&mut reference, &e);
            assert_eq!(got.is_ok(), want.is_ok(), "{e:?}");
        }
        assert_eq!(p.pool(), &reference.pool);
        assert_eq!(p.catalog().len(), 1);
        drop(p);
        let (p, dropped) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), every).unwrap();
        assert_eq!(dropped, 0);
        assert_eq!(p.pool(), &reference.pool, "snapshot every {every}");
        assert_eq!(p.catalog(), &reference.catalog, "the catalog survives a restart (snapshot every {every})");
    }
}

proptest! {
    /// A crash at any byte of the log recovers the pool after some prefix of the events.
    #[test]
    fn a_crash_anywhere_recovers_a_prefix(cut in any::<u64>()) {
        let d = dir("crash");
        let (mut p, _) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), 1000).unwrap();
        let mut states = vec![fresh()];
        for e in events() {
            let _ = p.apply(e);
            states.push(p.pool().clone());
        }
        drop(p);
        let wal = d.join("wal.log");
        let len = std::fs::metadata(&wal).unwrap().len();
        let f = OpenOptions::new().write(true).open(&wal).unwrap();
        f.set_len(cut % (len + 1)).unwrap();
        let (p, _) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), 1000).unwrap();
        prop_assert!(states.contains(p.pool()), "recovered a state that never existed");
    }
}

/// A real etcd server on loopback for the test's lifetime (Debian package `etcd-server`).
#[cfg(feature = "etcd")]
mod etcd {
    use std::time::Duration;

    use super::*;
    use crate::meta::EtcdStore;

    use cascade_tests::etcd::EtcdServer as Server;

    fn server(tag: &str) -> Result<Server, String> {
        Server::start(tag)
    }

    fn port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn store(s: &Server, prefix: &str) -> EtcdStore {
        EtcdStore::connect(std::slice::from_ref(&s.endpoint), prefix, Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn a_restarted_manager_rebuilds_the_same_pool_from_etcd() {
        let s = match server("pool") {
            Ok(s) => s,
            Err(why) => return eprintln!("SKIPPED: {why}"),
        };
        for every in [1000, 3] {
            let prefix = format!("/cascade/test/{every}");
            let (mut p, _) = DurablePool::open(store(&s, &prefix), fresh(), every).unwrap();
            let mut reference = State { pool: fresh(), catalog: Default::default() };
            for e in events() {
                let got = p.apply(e.clone());
                let want = apply(&mut reference, &e);
                assert_eq!(got.is_ok(), want.is_ok(), "{e:?}");
            }
            drop(p);
            let (p, dropped) = DurablePool::open(store(&s, &prefix), fresh(), every).unwrap();
            assert_eq!(dropped, 0);
            assert_eq!(p.pool(), &reference.pool, "snapshot every {every}");
            assert_eq!(p.catalog(), &reference.catalog);
        }
    }

    #[test]
    fn two_managers_on_one_prefix_cannot_interleave_their_logs() {
        let s = match server("fence") {
            Ok(s) => s,
            Err(why) => return eprintln!("SKIPPED: {why}"),
        };
        let (mut a, mut b) = (store(&s, "/cascade/fence"), store(&s, "/cascade/fence"));
        a.recover().unwrap();
        a.append(b"one").unwrap();
        b.recover().unwrap();
        a.append(b"two").unwrap();
        let err = b.append(b"other").unwrap_err().to_string();
        assert!(err.contains("another manager"), "{err}");
        let mut c = store(&s, "/cascade/fence");
        assert_eq!(c.recover().unwrap().records, vec![b"one".to_vec(), b"two".to_vec()]);
        c.snapshot(b"state").unwrap();
        c.append(b"three").unwrap();
        let r = store(&s, "/cascade/fence").recover().unwrap();
        assert_eq!(r.snapshot.as_deref(), Some(&b"state"[..]));
        assert_eq!(r.records, vec![b"three".to_vec()], "the snapshot replaced the records it covers");
    }

    #[test]
    fn an_unreachable_etcd_is_a_clear_error() {
        let err = EtcdStore::connect(&[format!("http://127.0.0.1:{}", port())], "/x", Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("etcd"), "{err}");
    }
}
