//! # cascade-ffi
//!
//! The C ABI of Cascade (cdylib + staticlib), declared in `include/cascade.h`. Today it exposes
//! only the library version; the data-plane entry points are added as the crates beneath it
//! stabilise.
#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::ffi::c_char;

static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The library version as a NUL-terminated string with static lifetime.
#[no_mangle]
pub extern "C" fn cascade_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    #[test]
    fn version_is_nul_terminated_and_matches_the_crate() {
        // SAFETY: `cascade_version` returns a pointer to a static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(super::cascade_version()) };
        assert_eq!(s.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
