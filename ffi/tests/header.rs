//! The committed header is what cbindgen makes of the crate today.
#![allow(clippy::unwrap_used)]

#[test]
fn the_committed_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_src(format!("{dir}/src/lib.rs"))
        .with_config(config)
        .generate()
        .expect("generating the header");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let path = format!("{dir}/include/cascade.h");
    if std::env::var_os("CASCADE_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing the header");
        return;
    }
    let committed = std::fs::read(&path).expect("include/cascade.h");
    assert!(
        committed == fresh,
        "include/cascade.h is stale: regenerate it with CASCADE_BLESS=1 cargo test -p cascade-ffi --test header"
    );
}
