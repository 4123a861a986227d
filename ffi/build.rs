//! Passes the target triple to the tests, which compile a C program with the `cc` crate.
fn main() {
    for var in ["TARGET", "HOST"] {
        if let Ok(v) = std::env::var(var) {
            println!("cargo:rustc-env=CASCADE_FFI_{var}={v}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
