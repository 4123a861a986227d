use proptest::prelude::*;

use std::path::Path;

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

/// One store per data directory at a time: a second (another manager, in this process or
/// another) and `wal salvage` are refused while the first is open, saying who holds it, and both
/// work once it is dropped. Before, two managers appended to one log.
#[test]
fn a_data_directory_is_held_by_one_store_at_a_time() {
    let d = dir("lock");
    let mut first = EmbeddedStore::open(&d).unwrap();
    first.append(b"one").unwrap();
    match EmbeddedStore::open(&d) {
        Err(e @ MetaError::InUse { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("pid {}", std::process::id())), "{text}");
            assert!(text.contains("one pool manager per data directory"), "{text}");
        }
        Err(e) => panic!("a second store on the directory: {e}"),
        Ok(_) => panic!("a second store opened the directory a first one holds"),
    }
    assert!(matches!(wal::salvage(&d), Err(MetaError::InUse { .. })), "salvage under a running manager");
    drop(first);
    assert_eq!(EmbeddedStore::open(&d).unwrap().recover().unwrap().records, vec![b"one".to_vec()]);
    assert_eq!(wal::salvage(&d).unwrap().kept_records, 1);
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

fn three_records(tag: &str) -> (Scratch, Vec<u8>) {
    let d = dir(tag);
    let mut s = EmbeddedStore::open(&d).unwrap();
    for r in [&b"first"[..], b"second", b"third"] {
        s.append(r).unwrap();
    }
    let bytes = std::fs::read(d.join("wal.log")).unwrap();
    (d, bytes)
}

fn recover_from(d: &Path, bytes: &[u8]) -> Result<Recovered, MetaError> {
    std::fs::write(d.join("wal.log"), bytes).unwrap();
    EmbeddedStore::open(d).unwrap().recover()
}

#[test]
fn a_damaged_record_before_the_end_refuses_recovery_and_changes_nothing() {
    let (d, mut bytes) = three_records("crc");
    bytes[HEADER + 5 + HEADER + 2] ^= 0xff; // inside "second"
    let err = recover_from(&d, &bytes).unwrap_err();
    assert!(matches!(err, MetaError::WalCorrupt { offset, valid: 1, .. } if offset == (HEADER + 5) as u64), "{err}");
    assert_eq!(std::fs::read(d.join("wal.log")).unwrap(), bytes, "recovery left the log as it was");
}

#[test]
fn a_damaged_complete_last_record_is_corruption_not_a_torn_tail() {
    let (d, mut bytes) = three_records("last");
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    assert!(matches!(recover_from(&d, &bytes), Err(MetaError::WalCorrupt { valid: 2, .. })));
}

#[test]
fn every_single_bit_flip_is_refused_or_harmless() {
    let (d, bytes) = three_records("flip");
    let all = vec![b"first".to_vec(), b"second".to_vec(), b"third".to_vec()];
    for bit in 0..bytes.len() * 8 {
        let mut b = bytes.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        match recover_from(&d, &b) {
            Ok(rec) => assert_eq!(rec.records, all, "bit {bit}: recovered with less state"),
            Err(MetaError::WalCorrupt { .. }) => {}
            Err(e) => panic!("bit {bit}: {e}"),
        }
    }
}

#[test]
fn a_crash_at_every_byte_of_an_append_loses_nothing_acknowledged() {
    let (d, bytes) = three_records("cut");
    let acknowledged = HEADER * 2 + 5 + 6;
    for cut in acknowledged..bytes.len() {
        let rec = recover_from(&d, &bytes[..cut]).unwrap();
        assert_eq!(rec.records, vec![b"first".to_vec(), b"second".to_vec()], "cut at {cut}");
        assert_eq!(rec.dropped_tail_bytes, (cut - acknowledged) as u64);
    }
    // A zero-filled tail (the file grew, its data never reached the disk) is torn too.
    let mut b = bytes[..acknowledged].to_vec();
    b.extend([0u8; 40]);
    assert_eq!(recover_from(&d, &b).unwrap().records.len(), 2);
}

#[test]
fn a_failed_append_is_cut_back_before_anything_else_is_acknowledged() {
    for written in [0, 3, HEADER, HEADER + 2] {
        let d = dir("enospc");
        let mut s = EmbeddedStore::open(&d).unwrap();
        s.append(b"one").unwrap();
        s.fail_append = Some(written);
        let err = s.append(b"lost-to-enospc").unwrap_err();
        assert!(err.to_string().contains("No space left"), "{err}");
        // Space is back: these are acknowledged and must survive a restart.
        s.append(b"two").unwrap();
        s.append(b"three").unwrap();
        drop(s);
        let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
        assert_eq!(rec.records, vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()], "{written} bytes");
        assert_eq!(rec.dropped_tail_bytes, 0);
    }
}

#[test]
fn snapshots_compact_the_log() {
    let d = dir("snap");
    let mut s = EmbeddedStore::open(&d).unwrap();
    s.append(b"x").unwrap();
    s.snapshot(b"state-1").unwrap();
    s.append(b"y").unwrap();
    drop(s);
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(rec.snapshot.as_deref(), Some(&b"state-1"[..]));
    assert_eq!(rec.records, vec![b"y".to_vec()]);
    // A damaged snapshot is an error, not silently empty state.
    let mut b = std::fs::read(d.join("snapshot.bin")).unwrap();
    b[HEADER + 1] ^= 1;
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
        let mut p = DurablePool::init(EmbeddedStore::open(&d).unwrap(), fresh(), every).unwrap();
        let mut reference = State { id: None, pool: fresh(), catalog: Default::default() };
        for e in events() {
            let got = p.apply(e.clone());
            let want = apply(&mut reference, &e);
            assert_eq!(got.is_ok(), want.is_ok(), "{e:?}");
        }
        assert_eq!(p.pool(), &reference.pool);
        assert_eq!(p.catalog().len(), 1);
        let id = p.id().to_string();
        drop(p);
        let (p, dropped) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), every).unwrap();
        assert_eq!(dropped, 0);
        assert_eq!(p.id(), id, "the pool keeps its id");
        assert_eq!(p.pool(), &reference.pool, "snapshot every {every}");
        assert_eq!(p.catalog(), &reference.catalog, "the catalog survives a restart (snapshot every {every})");
    }
}

#[test]
fn a_store_without_a_pool_is_refused_and_init_refuses_a_store_with_one() {
    let d = dir("identity");
    let err = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), 10).err().unwrap();
    assert!(matches!(err, MetaError::NotAPool(_)), "{err}");
    assert!(err.to_string().contains("--init"), "{err}");
    let mut p = DurablePool::init(EmbeddedStore::open(&d).unwrap(), fresh(), 10).unwrap();
    p.apply(Event::Register { model: 1, bytes: 100, file_reachable: true }).unwrap();
    drop(p);
    let err = DurablePool::init(EmbeddedStore::open(&d).unwrap(), fresh(), 10).err().unwrap();
    assert!(matches!(err, MetaError::AlreadyAPool(..)), "{err}");
    let (p, _) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), 10).unwrap();
    assert_eq!(p.pool().copies().count(), 2, "nothing was lost by the refused --init");
}

proptest! {
    /// A crash at any byte of the log recovers the pool after some prefix of the events (or,
    /// cut inside the pool's first record, finds no pool and refuses).
    #[test]
    fn a_crash_anywhere_recovers_a_prefix(cut in any::<u64>()) {
        let d = dir("crash");
        let mut p = DurablePool::init(EmbeddedStore::open(&d).unwrap(), fresh(), 1000).unwrap();
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
        match DurablePool::open(EmbeddedStore::open(&d).unwrap(), fresh(), 1000) {
            Ok((p, _)) => prop_assert!(states.contains(p.pool()), "recovered a state that never existed"),
            Err(e) => prop_assert!(matches!(e, MetaError::NotAPool(_)), "{}", e),
        }
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
            let mut p = DurablePool::init(store(&s, &prefix), fresh(), every).unwrap();
            let mut reference = State { id: None, pool: fresh(), catalog: Default::default() };
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

#[test]
fn a_crash_between_a_snapshot_and_the_log_truncation_applies_nothing_twice() {
    let d = dir("snapcrash");
    let mut s = EmbeddedStore::open(&d).unwrap();
    s.append(b"a").unwrap();
    s.append(b"b").unwrap();
    s.crash_before_truncate = true;
    s.snapshot(b"state-ab").unwrap();
    drop(s);
    let mut s = EmbeddedStore::open(&d).unwrap();
    let rec = s.recover().unwrap();
    assert_eq!(rec.snapshot.as_deref(), Some(&b"state-ab"[..]));
    assert!(rec.records.is_empty(), "records the snapshot covers came back: {:?}", rec.records);
    s.append(b"c").unwrap();
    drop(s);
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(rec.records, vec![b"c".to_vec()]);
    // A later snapshot and new records: the restarted log never looks covered.
    let mut s = EmbeddedStore::open(&d).unwrap();
    s.recover().unwrap();
    s.snapshot(b"state-abc").unwrap();
    s.append(b"a").unwrap();
    s.append(b"b").unwrap();
    drop(s);
    let rec = EmbeddedStore::open(&d).unwrap().recover().unwrap();
    assert_eq!(rec.records, vec![b"a".to_vec(), b"b".to_vec()]);
}

#[test]
fn k_belongs_to_the_pool_from_its_first_record() {
    let d = dir("k");
    let p = DurablePool::init(EmbeddedStore::open(&d).unwrap(), Pool::new(3, 0..4), 1000).unwrap();
    drop(p);
    // Reopened (no snapshot yet) by a manager configured with another k: the pool keeps its own.
    let (p, _) = DurablePool::open(EmbeddedStore::open(&d).unwrap(), Pool::new(1, 0..4), 1000).unwrap();
    assert_eq!(p.pool().k(), 3);
}

/// A dropped store's directory can be opened again at once, even while another thread of the
/// process is starting programs: a child between fork and exec holds a copy of every descriptor,
/// the lock's among them.
#[test]
fn a_store_reopens_while_other_threads_start_programs() {
    let d = dir("reopen-spawn");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::process::Command::new("true").status();
            }
        })
    };
    let mut refused = 0;
    for _ in 0..2000 {
        match EmbeddedStore::open(&d) {
            Ok(s) => drop(s),
            Err(MetaError::InUse { .. }) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spawner.join().unwrap();
    assert_eq!(refused, 0, "opens refused as in use by this very process");
}

/// A directory another process holds is refused, naming that process as the kernel knows it,
/// and is free again once that process has gone. (The test runs itself as the other process.)
#[test]
fn a_directory_another_process_holds_is_refused_with_its_pid() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    const HOLD: &str = "CASCADE_TEST_HOLD_DIR";
    const NAME: &str = "meta::tests::a_directory_another_process_holds_is_refused_with_its_pid";
    if let Some(d) = std::env::var_os(HOLD) {
        let _held = EmbeddedStore::open(Path::new(&d)).unwrap();
        println!("\nheld");
        // Until the parent closes stdin, or a minute if it never does.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(std::io::stdin().read_line(&mut String::new())));
        let _ = rx.recv_timeout(std::time::Duration::from_secs(60));
        return;
    }
    let d = dir("other-process");
    std::fs::create_dir_all(&*d).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(HOLD, &*d)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Kept open until the child has ended: it still prints its test's result.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(out.by_ref().map_while(Result::ok).any(|l| l == "held"), "the other process never held the directory");
    match EmbeddedStore::open(&d) {
        Err(MetaError::InUse { holder, .. }) => assert_eq!(holder, format!("pid {}", child.id())),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("opened a directory another process holds"),
    }
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    EmbeddedStore::open(&d).expect("free once its holder has gone");
}
