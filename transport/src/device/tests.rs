use super::*;
use crate::region::test_access as ta;

fn round_trip(dev: &dyn DeviceMemory) {
    let len = 3 << 20;
    let region = Region::alloc(len, Default::default()).unwrap();
    for i in 0..len / 4096 {
        ta::fill(&region, i * 4096, 4096, (i % 251) as u8).unwrap();
    }
    let buf = dev.alloc(len).unwrap();
    assert_eq!(buf.len(), len);
    // Two layers, uploaded separately as they would be verified.
    // SAFETY: nothing writes the region in this test.
    unsafe {
        upload_region(dev, &buf, 0, &region, 0, 1 << 20).unwrap();
        upload_region(dev, &buf, 1 << 20, &region, 1 << 20, len - (1 << 20)).unwrap();
    }
    let crc = |o: u64, n: u64| ta::crc32(&region, o, n).unwrap();
    let layers = [(0..1 << 20, crc(0, 1 << 20)), (1 << 20..len, crc(1 << 20, len - (1 << 20)))];
    assert_eq!(verify_on_device(dev, &buf, layers.clone()).unwrap(), Ok(()));
    // Device to device: a second buffer gets the first's second layer.
    let other = dev.alloc(len).unwrap();
    dev.copy(dev, &buf, 1 << 20, &other, 0, len - (1 << 20)).unwrap();
    let mut back = vec![0u8; (len - (1 << 20)) as usize];
    dev.download(&other, 0, &mut back).unwrap();
    assert_eq!(crc32fast::hash(&back), layers[1].1);
    // A corrupt byte on the device is caught by the read-back check, in the layer it is in.
    dev.upload(&buf, (1 << 20) + 5, &[0xEE]).unwrap();
    assert_eq!(verify_on_device(dev, &buf, layers).unwrap(), Err(1));
    // Out of bounds is refused, never clamped.
    assert!(dev.upload(&buf, len - 1, &[1, 2]).is_err());
    assert!(dev.download(&buf, len, &mut [0u8; 1]).is_err());
    assert!(dev.copy(dev, &buf, 0, &other, 1, len).is_err());
    // SAFETY: as above.
    assert!(unsafe { upload_region(dev, &buf, 0, &region, len - 4, 8) }.is_err());
}

#[test]
fn the_emulated_device_round_trips_and_checks_bounds() {
    let dev = open("emulated:1").unwrap();
    assert!(dev.describe().contains("test double"));
    round_trip(dev.as_ref());
}

/// A name's form is checked without opening anything: `cuda:N` passes on any build (opening it
/// may still fail, and a node falls back), a misspelt one does not.
#[test]
fn a_device_names_form_is_checked_without_opening_it() {
    for ok in ["cuda:0", "cuda:7", "cuda", "emulated:3"] {
        check_spec(ok).unwrap();
    }
    for bad in ["gpu:0", "cuda:x", "cuda:-1", "emulated:", "", "CUDA:0"] {
        assert!(matches!(check_spec(bad), Err(TransportError::Config(_))), "{bad:?} passed");
    }
}

#[test]
fn asking_for_cuda_without_it_is_a_clear_error() {
    assert!(matches!(open("tpu:0"), Err(TransportError::Config(_))));
    assert!(matches!(open("cuda:x"), Err(TransportError::Config(_))));
    match open("cuda:0") {
        Err(TransportError::Device(why)) => {
            assert!(why.contains("cuda:0"), "{why}");
            eprintln!("as expected without a GPU: {why}");
        }
        Err(e) => panic!("not a device error: {e}"),
        // A machine with a GPU and a build with the `cuda` feature: nothing to check here.
        Ok(d) => eprintln!("this machine has {}", d.describe()),
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "requires a CUDA GPU (cargo test -p cascade-transport --features cuda -- --ignored)"]
fn a_cuda_gpu_round_trips_and_checks_bounds() {
    let dev = open("cuda:0").unwrap();
    eprintln!("testing {}", dev.describe());
    round_trip(dev.as_ref());
    // A copy from another handle's buffer: our cross-device path (the source device's own
    // synchronisation), though both handles share GPU 0's primary context, so cudarc takes its
    // same-context copy, not the peer copy two GPUs take.
    let other = open("cuda:0").unwrap();
    let src = other.alloc(1 << 20).unwrap();
    other.upload(&src, 0, &[9u8; 1 << 20]).unwrap();
    let dst = dev.alloc(1 << 20).unwrap();
    dev.copy(other.as_ref(), &src, 0, &dst, 0, 1 << 20).unwrap();
    let mut back = vec![0u8; 1 << 20];
    dev.download(&dst, 0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 9));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "requires two CUDA GPUs in one host (peer copy)"]
fn two_cuda_gpus_copy_peer_to_peer() {
    let (a, b) = (open("cuda:0").unwrap(), open("cuda:1").unwrap());
    let src = a.alloc(1 << 20).unwrap();
    a.upload(&src, 0, &vec![7u8; 1 << 20]).unwrap();
    let dst = b.alloc(1 << 20).unwrap();
    b.copy(a.as_ref(), &src, 0, &dst, 0, 1 << 20).unwrap();
    let mut back = vec![0u8; 1 << 20];
    b.download(&dst, 0, &mut back).unwrap();
    assert!(back.iter().all(|&x| x == 7));
}

/// Copies through a pinned staging region (what a multicast target does) and through pageable
/// memory give the same bytes, and unpinning leaves the region usable; prints each copy's rate
/// (best of three) so a run on a GPU records them.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "requires a CUDA GPU (cargo test -p cascade-transport --features cuda -- --ignored)"]
fn a_cuda_gpu_copies_pinned_and_pageable_regions_alike_and_reports_the_rates() {
    let dev = open("cuda:0").unwrap();
    let len: u64 = 1 << 30;
    let region = Region::alloc(len, Default::default()).unwrap();
    for i in 0..len / (1 << 20) {
        ta::fill(&region, i << 20, 1 << 20, (i % 253) as u8 ^ 0x5a).unwrap();
    }
    let want = ta::crc32(&region, 0, len).unwrap();
    let buf = dev.alloc(len).unwrap();
    let best = |f: &mut dyn FnMut()| {
        (0..3)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let gbs = |s: f64| len as f64 / s / 1e9;
    // SAFETY: nothing writes the region in this test.
    let pageable = best(&mut || unsafe { upload_region(dev.as_ref(), &buf, 0, &region, 0, len) }.unwrap());
    assert_eq!(verify_on_device(dev.as_ref(), &buf, [(0..len, want)]).unwrap(), Ok(()));
    let guard = dev.pin(&region).unwrap();
    assert!(guard.is_some(), "a CUDA device pins staging regions");
    let other = dev.alloc(len).unwrap();
    // SAFETY: as above.
    let pinned = best(&mut || unsafe { upload_region(dev.as_ref(), &other, 0, &region, 0, len) }.unwrap());
    assert_eq!(verify_on_device(dev.as_ref(), &other, [(0..len, want)]).unwrap(), Ok(()));
    let mut back = vec![0u8; len as usize];
    let down = best(&mut || dev.download(&other, 0, &mut back).unwrap());
    assert_eq!(crc32fast::hash(&back), want);
    let d2d = best(&mut || dev.copy(dev.as_ref(), &other, 0, &buf, 0, len).unwrap());
    drop(guard);
    // Unpinned, the region is ordinary memory again: written and read back by the CPU.
    ta::fill(&region, 0, 4096, 0x11).unwrap();
    assert_eq!(ta::view(&region, 0, 1).unwrap()[..], [0x11]);
    eprintln!(
        "{}: 1 GiB host->device pageable {:.1} GB/s, pinned {:.1} GB/s; device->host (pageable) {:.1} GB/s; \
         device->device {:.1} GB/s",
        dev.describe(),
        gbs(pageable),
        gbs(pinned),
        gbs(down),
        gbs(d2d)
    );
}

#[test]
fn a_read_back_buffer_smaller_than_a_range_checks_it_in_pieces() {
    let dev = open("emulated:0").unwrap();
    let len = 3 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i % 247) as u8).collect();
    let buf = dev.alloc(len as u64).unwrap();
    dev.upload(&buf, 0, &data).unwrap();
    let mut rb = ReadBack::new(dev.as_ref(), 5000).unwrap(); // far smaller than the ranges
    let whole = (0..len as u64, crc32fast::hash(&data));
    let tail = (1000..len as u64, crc32fast::hash(&data[1000..]));
    assert_eq!(rb.verify(dev.as_ref(), &buf, [whole.clone(), tail.clone()]).unwrap(), Ok(()));
    dev.upload(&buf, len as u64 - 1, &[0]).unwrap(); // the last byte (182 before)
    assert_eq!(rb.verify(dev.as_ref(), &buf, [(0..1000, crc32fast::hash(&data[..1000])), whole]).unwrap(), Err(1));
    assert!(rb.verify(dev.as_ref(), &buf, [(0..len as u64 + 1, 0)]).is_err(), "out of bounds is an error");
}
