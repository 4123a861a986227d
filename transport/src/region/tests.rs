use super::*;
use crate::region::test_access as ta;

#[test]
fn host_region_is_page_aligned_and_zeroed() {
    let r = Region::alloc(3 * PAGE as u64 + 5, RegionOptions::default()).unwrap();
    assert_eq!(r.base() as usize % PAGE, 0);
    assert!(ta::view(&r, 0, r.len()).unwrap().iter().all(|&b| b == 0));
    assert!(!r.is_shared());
}

#[test]
fn empty_region_is_refused() {
    assert!(Region::alloc(0, RegionOptions::default()).is_err());
    assert!(Region::shared(0).is_err());
}

#[test]
fn local_access_is_bounds_checked() {
    let r = Region::alloc(100, RegionOptions::default()).unwrap();
    ta::write_local(&r, 90, &[7; 10]).unwrap();
    assert!(matches!(
        ta::write_local(&r, 91, &[7; 10]),
        Err(TransportError::OutOfBounds { offset: 91, len: 10, region_len: 100, .. })
    ));
    assert!(ta::view(&r, u64::MAX, 2).is_err(), "offset overflow must not wrap");
    assert_eq!(&ta::view(&r, 88, 4).unwrap()[..], &[0, 0, 7, 7]);
}

#[test]
fn view_is_zero_copy_and_keeps_region_alive() {
    let r = Region::alloc(64, RegionOptions::default()).unwrap();
    ta::fill(&r, 0, 64, 3).unwrap();
    let v = ta::view(&r, 8, 8).unwrap();
    let base = r.base() as usize;
    drop(r);
    assert_eq!(v.as_ptr() as usize, base + 8);
    assert_eq!(&v[..], &[3; 8]);
}

#[test]
fn shared_region_is_visible_through_a_second_mapping() {
    let r = Region::shared(2 * PAGE as u64).unwrap();
    let other = map_fd(r.shared_fd().unwrap(), r.len(), false).unwrap();
    ta::write_local(&r, PAGE as u64, b"hello").unwrap();
    // SAFETY: the mapping is 2 pages long and nobody writes it concurrently.
    let seen = unsafe { std::slice::from_raw_parts(other.as_ptr().add(PAGE), 5) };
    assert_eq!(seen, b"hello");
}

#[test]
fn table_checks_region_key_and_bounds() {
    let t = RegionTable::new();
    let r = Region::alloc(4096, RegionOptions::default()).unwrap();
    t.register(&r);
    assert!(t.access(r.id(), r.key(), 0, 4096).is_ok());
    assert_eq!(t.access(r.id(), RemoteKey(r.key().0 ^ 2), 0, 1).unwrap_err(), Status::BadKey);
    assert_eq!(t.access(r.id(), r.key(), 4000, 97).unwrap_err(), Status::OutOfBounds);
    assert_eq!(t.access(RegionId(u32::MAX), r.key(), 0, 1).unwrap_err(), Status::UnknownRegion);
    t.deregister(r.id());
    assert_eq!(t.access(r.id(), r.key(), 0, 1).unwrap_err(), Status::UnknownRegion);
}

#[test]
fn keys_differ_between_regions() {
    let a = Region::alloc(8, RegionOptions::default()).unwrap();
    let b = Region::alloc(8, RegionOptions::default()).unwrap();
    assert_ne!(a.id(), b.id());
    assert_ne!(a.key(), b.key());
}

#[test]
fn mlock_either_locks_or_says_why() {
    match Region::alloc(PAGE as u64, RegionOptions { mlock: true }) {
        Ok(r) => assert!(r.is_locked()),
        Err(e) => assert!(e.to_string().contains("mlock"), "{e}"),
    }
}

/// Pages of a shared region resident in this process's mapping (`mincore`).
fn resident_pages(r: &Region) -> usize {
    let Backing::Shared { map, .. } = &r.0.backing else { panic!("not a shared region") };
    let page = page_size() as usize;
    let pages = (r.len() as usize).div_ceil(page);
    let mut v = vec![0u8; pages];
    // SAFETY: the mapping is `r.len()` bytes from a page-aligned start; `v` has a byte per page.
    let rc = unsafe { libc::mincore(map.as_mut_ptr().cast(), r.len() as usize, v.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().filter(|&&b| b & 1 != 0).count()
}

/// A region whose length is no whole number of pages (a model's packed image) is pre-faulted in
/// the background all the same, to its first page. Before 2026-12-05 the thread counted its
/// slices back from the region's end, so each started inside a page, `madvise` refused every one
/// (EINVAL) and no page was faulted in: the transfer that filled the region faulted them all
/// itself (`cascade pd`'s scale-out of a 538,060,032-byte copy took 1–3 s on this VM).
#[test]
fn a_region_of_no_whole_number_of_pages_is_prefaulted_in_the_background() {
    for len in [(8u64 << 20) + 100, 3 * (2 << 20) + 4096 + 1, 5000] {
        let r = Region::shared_prefault(len, Prefault::Background).unwrap();
        let pages = (len as usize).div_ceil(page_size() as usize);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while resident_pages(&r) < pages {
            assert!(
                std::time::Instant::now() < deadline,
                "{len} bytes: {} of {pages} pages resident",
                resident_pages(&r)
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(ta::view(&r, 0, len).unwrap().iter().all(|&b| b == 0));
    }
}

#[test]
fn a_region_prefaulted_in_the_background_is_usable_at_once_and_zeroed() {
    let len = 96u64 << 20; // three pre-fault slices
    let r = Region::shared_prefault(len, Prefault::Background).unwrap();
    // Written from the front while the thread faults pages in from the back: both meet, and
    // no byte is changed by the pre-faulting.
    ta::fill(&r, 0, 1 << 20, 7).unwrap();
    ta::fill(&r, len - 4096, 4096, 9).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(ta::view(&r, 0, 1 << 20).unwrap().iter().all(|&b| b == 7));
    assert!(ta::view(&r, len - 4096, 4096).unwrap().iter().all(|&b| b == 9));
    assert!(ta::view(&r, 1 << 20, 1 << 20).unwrap().iter().all(|&b| b == 0));
    // Budgeted allocation takes the same path; freeing the region ends the thread's work.
    let budget = crate::MemoryBudget::new(Some(len));
    let b = Region::alloc_within_prefault(len, true, &budget, Prefault::Background).unwrap();
    assert!(Region::alloc_within_prefault(4096, true, &budget, Prefault::Background).is_err());
    drop(b);
    // The pre-fault thread holds the region for the slice it is faulting in, so the budget comes
    // back when that slice is done: within a moment, not necessarily at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while Region::alloc_within_prefault(len, true, &budget, Prefault::Now).is_err() {
        assert!(std::time::Instant::now() < deadline, "the budget never came back");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
