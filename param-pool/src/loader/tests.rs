use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::*;
use cascade_transport::test_access as ta;

/// Loads into a region the test allocated and never registered: nobody else can reach it.
fn load_private(m: &Manifest, path: &Path, region: &Region, opts: LoadOptions) -> Result<LoadReport, LoadError> {
    // SAFETY: the tests' regions are private to them.
    unsafe { load(m, path, region, opts) }
}

/// Writes a synthetic model of about `mib` MiB whose file order is not the packed order.
fn model_file(dir: &Path, tag: &str, mib: usize) -> std::path::PathBuf {
    let mut data = Vec::new();
    let per = mib * (1 << 20) / 10;
    for i in 0..10usize {
        let name = match i {
            0 => "lm_head.weight".to_string(),
            1 => "model.embed_tokens.weight".into(),
            n => format!("model.layers.{}.mlp.weight", 10 - n),
        };
        let bytes: Vec<u8> = (0..per).map(|j| (j * 31 + i * 7) as u8).collect();
        data.push((name, bytes));
    }
    let views: Vec<(String, TensorView<'_>)> =
        data.iter().map(|(n, b)| (n.clone(), TensorView::new(Dtype::U8, vec![b.len()], b).unwrap())).collect();
    let path = dir.join(format!("model-{tag}.safetensors"));
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    path
}

fn tmp() -> std::path::PathBuf {
    // Not /tmp: it may be tmpfs, which refuses O_DIRECT; the target dir is on the build disk.
    let d =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/loader-tests").join(format!("{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn check(tag: &str, opts: LoadOptions, want_mode: Option<LoadMode>) {
    let dir = tmp();
    let path = model_file(&dir, tag, 20);
    let m = Manifest::from_file(&path, "m", 1 << 20).unwrap();
    let region = Region::alloc(m.bytes, Default::default()).unwrap();
    let progress = LoadProgress::default();
    // SAFETY: the region is private to the test.
    let rep = unsafe { load_counting(&m, &path, &region, opts, &progress) }.unwrap();
    // Every byte counted once as placed, and once as verified when the load verifies.
    assert_eq!(progress.placed.load(Ordering::Relaxed), m.bytes, "{opts:?}");
    assert_eq!(progress.verified.load(Ordering::Relaxed), if opts.verify { m.bytes } else { 0 }, "{opts:?}");
    if let Some(mode) = want_mode {
        assert_eq!(rep.mode, mode);
    }
    assert_eq!(rep.bytes, m.bytes);
    // Same bytes as packing the file in memory.
    let file = std::fs::read(&path).unwrap();
    let mut want = vec![0u8; m.bytes as usize];
    m.pack(&file, &mut want);
    assert_eq!(&ta::view(&region, 0, m.bytes).unwrap()[..], &want[..]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn direct_load_lands_the_packed_image() {
    // ext4 and most disks accept O_DIRECT; elsewhere the loader falls back and says so.
    check("direct", LoadOptions::default(), None);
}

#[test]
fn buffered_load_lands_the_packed_image() {
    check("buffered", LoadOptions { direct: false, ..Default::default() }, Some(LoadMode::Buffered));
}

#[test]
fn odd_blocks_and_a_queue_of_one_work_too() {
    check("odd1", LoadOptions { block: 12288, queue_depth: 1, ..Default::default() }, None);
    check(
        "odd3",
        LoadOptions { block: 12288, queue_depth: 3, direct: false, ..Default::default() },
        Some(LoadMode::Buffered),
    );
}

#[test]
fn a_changed_file_or_a_small_region_is_refused() {
    let dir = tmp();
    let path = model_file(&dir, "changed", 2);
    let m = Manifest::from_file(&path, "m", 1 << 20).unwrap();
    let small = Region::alloc(4096, Default::default()).unwrap();
    assert!(matches!(load_private(&m, &path, &small, LoadOptions::default()), Err(LoadError::RegionTooSmall { .. })));
    let region = Region::alloc(m.bytes, Default::default()).unwrap();
    // Same length, different bytes: caught by the chunk crcs.
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let e = load_private(&m, &path, &region, LoadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("crc32"), "{e}");
    // Different length.
    bytes.push(0);
    std::fs::write(&path, &bytes).unwrap();
    assert!(load_private(&m, &path, &region, LoadOptions::default())
        .unwrap_err()
        .to_string()
        .contains("manifest says"));
    assert!(matches!(
        load_private(&m, &path, &region, LoadOptions { block: 1000, ..Default::default() }),
        Err(LoadError::Options(_))
    ));
    let _ = std::fs::remove_file(&path);
}

/// A read that fails while others are in flight: the load returns the error only after every
/// read was reaped (before the fix, the ring was dropped with reads still targeting staging
/// buffers that were then freed).
#[test]
fn a_failing_read_midway_leaves_no_read_in_flight() {
    let dir = tmp();
    let path = model_file(&dir, "fail", 20);
    let m = Manifest::from_file(&path, "m", 1 << 20).unwrap();
    for direct in [true, false] {
        let region = Region::alloc(m.bytes, Default::default()).unwrap();
        FAIL_AT.with(|f| f.set(Some(1)));
        let opts = LoadOptions { direct, block: 1 << 20, queue_depth: 8, ..Default::default() };
        let e = load_private(&m, &path, &region, opts);
        FAIL_AT.with(|f| f.set(None));
        let e = e.unwrap_err();
        assert!(e.to_string().contains("Input/output error"), "{e}");
        assert_eq!(IN_FLIGHT.with(|n| n.get()), 0, "direct={direct}: reads still in flight");
    }
    // The same load without the fault succeeds: the ring and the file are fine.
    let region = Region::alloc(m.bytes, Default::default()).unwrap();
    assert!(load_private(&m, &path, &region, LoadOptions::default()).is_ok());
    let _ = std::fs::remove_file(&path);
}
