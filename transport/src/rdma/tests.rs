use super::*;

fn info() -> ConnInfo {
    ConnInfo { qp_num: 0x1234, psn: 0x00ab_cdef, lid: 7, port: 1, gid_index: 3, gid: [9; 16] }
}

#[test]
fn conn_info_round_trips() {
    assert_eq!(ConnInfo::decode(&info().encode()).unwrap(), info());
}

#[test]
fn conn_info_rejects_junk() {
    let good = info().encode();
    assert!(ConnInfo::decode(&good[..31]).is_err());
    let mut b = good;
    b[0] = b'X';
    assert!(ConnInfo::decode(&b).is_err());
    let mut b = good;
    b[11] = 1; // PSN above 24 bits
    assert!(ConnInfo::decode(&b).is_err());
    let mut b = good;
    b[14] = 0;
    assert!(ConnInfo::decode(&b).is_err());
}

#[test]
fn encode_masks_the_psn_to_24_bits() {
    let mut i = info();
    i.psn = 0xff12_3456;
    assert_eq!(ConnInfo::decode(&i.encode()).unwrap().psn, 0x0012_3456);
}

#[test]
fn remote_addresses_are_bounds_checked() {
    let mr = RemoteMr { addr: 0x1000, rkey: 5, len: 100 };
    assert_eq!(mr.address(10, 90), Ok(0x100a));
    assert_eq!(mr.address(10, 91), Err(Status::OutOfBounds));
    assert_eq!(mr.address(u64::MAX, 2), Err(Status::OutOfBounds));
}

#[test]
fn mr_table_checks_keys_and_tracks_registrations() {
    let mut t: MrTable<&'static str> = MrTable::default();
    let (id, key) = (RegionId(4), RemoteKey(77));
    let mr = RemoteMr { addr: 0x2000, rkey: 9, len: 4096 };
    assert!(t.insert(id, key, 11, mr, "first").is_none());
    assert_eq!(t.resolve(id, key), Ok(mr));
    assert_eq!(t.resolve(id, RemoteKey(78)), Err(Status::BadKey));
    assert_eq!(t.resolve(RegionId(5), key), Err(Status::UnknownRegion));
    assert_eq!(t.lkey(id), Some(11));
    assert_eq!(t.insert(id, key, 12, mr, "second"), Some("first"));
    assert_eq!(t.len(), 1);
    assert_eq!(t.remove(id), Some("second"));
    assert!(t.is_empty());
    assert_eq!(t.resolve(id, key), Err(Status::UnknownRegion));
}

#[cfg(not(feature = "rdma"))]
#[test]
fn probe_without_the_feature_says_so() {
    let e = probe().unwrap_err().to_string();
    assert!(e.contains("no RDMA device") && e.contains("feature"), "{e}");
}

async fn both(a: Option<ConnInfo>, b: Option<ConnInfo>) -> (Result<Option<ConnInfo>>, Result<Option<ConnInfo>>) {
    let (mut x, mut y) = tokio::io::duplex(256);
    let t = std::time::Duration::from_secs(2);
    tokio::join!(exchange(&mut x, a, t), exchange(&mut y, b, t))
}

#[tokio::test]
async fn exchange_hands_each_side_the_other_info() {
    let mut other = info();
    other.qp_num = 99;
    let (a, b) = both(Some(info()), Some(other)).await;
    assert_eq!(a.unwrap(), Some(other));
    assert_eq!(b.unwrap(), Some(info()));
}

#[tokio::test]
async fn a_declining_side_makes_both_fall_back() {
    let (a, b) = both(Some(info()), None).await;
    assert_eq!(a.unwrap(), None);
    assert_eq!(b.unwrap(), None);
}

#[tokio::test]
async fn exchange_fails_on_junk_or_silence() {
    use tokio::io::AsyncWriteExt;
    let (mut x, mut y) = tokio::io::duplex(256);
    y.write_all(&[0xee; ConnInfo::LEN]).await.unwrap();
    assert!(exchange(&mut x, Some(info()), std::time::Duration::from_secs(1)).await.is_err());
    let (mut x, _y) = tokio::io::duplex(256);
    assert!(exchange(&mut x, Some(info()), std::time::Duration::from_millis(50)).await.is_err());
}
