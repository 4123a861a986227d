//! # cascade-ffi
//!
//! The C ABI of Cascade (cdylib + staticlib), declared in `include/cascade.h`, which `cbindgen`
//! generates from this crate (a test fails when the committed header is stale; regenerate it
//! with `CASCADE_BLESS=1 cargo test -p cascade-ffi --test header`).
//!
//! Conventions, modelled on NIXL's C API and Mooncake's `transfer_engine_c.h`:
//! * **Handles** are opaque pointers with create/destroy pairs ([`cascade_endpoint`],
//!   [`cascade_region`]); a null handle is an error, never a crash.
//! * **Status**: every call returns an `int32_t`: [`CASCADE_OK`] (0), [`CASCADE_IN_PROGRESS`]
//!   (1: nothing yet, try again) or a negative `CASCADE_ERR_*` code, with a message for this
//!   thread in [`cascade_last_error`].
//! * **Panics** never cross into C: every entry point runs under `catch_unwind`, and a panic
//!   becomes [`CASCADE_ERR_PANIC`].
//! * **Strings** are copied on entry; nothing keeps a caller's pointer past the call except the
//!   memory a caller registers ([`cascade_region_register`], under the DMA-lifetime rule).
//! * **Output buffers** are `(buf, cap, *needed)`: `*needed` always receives the size required
//!   (with the terminating NUL for text); when `cap` is smaller, nothing is written and the call
//!   returns [`CASCADE_ERR_BUFFER_TOO_SMALL`].
//! * **Config structs** start with their own `struct_size`, so a library can tell an older
//!   caller's struct from a newer one; [`cascade_abi_version`] says which ABI this is.
//! * Only `cascade_*` symbols are exported.
//!
//! Each endpoint owns a small tokio runtime (two workers): blocking calls wait on it, posted
//! operations complete on it and land in the endpoint's completion queue, which
//! [`cascade_poll`] drains without blocking. Calls may come from any thread, but not from
//! inside a tokio runtime of the caller's own.
#![cfg_attr(test, allow(clippy::unwrap_used))]
// The C names are the API.
#![allow(non_camel_case_types)]

mod buf;
mod endpoint;
mod error;
mod message;
mod multicast;
mod ops;
mod pool;
mod region;

pub use endpoint::{
    cascade_endpoint, cascade_endpoint_config, cascade_endpoint_create, cascade_endpoint_destroy,
    cascade_endpoint_join, cascade_endpoint_node, cascade_endpoint_wait_ready, cascade_metrics_render,
    cascade_metrics_serve, CASCADE_ADDR_CAP, CASCADE_CONFIG_NO_SHM,
};
pub use error::*;
pub use multicast::{
    cascade_multicast_execute, cascade_multicast_plan, cascade_multicast_release, cascade_multicast_take,
};
pub use ops::{
    cascade_completion, cascade_completion_detail, cascade_op, cascade_poll, cascade_post, cascade_post_notify,
    cascade_recv, cascade_send, CASCADE_EVENT_LAYER_READY, CASCADE_EVENT_MULTICAST_DONE, CASCADE_EVENT_READ,
    CASCADE_EVENT_SEND, CASCADE_EVENT_TARGET_DONE, CASCADE_EVENT_WRITE, CASCADE_OP_READ, CASCADE_OP_VERIFY,
    CASCADE_OP_WRITE,
};
pub use pool::{cascade_pool_check, cascade_pool_status};
pub use region::{
    cascade_region, cascade_region_alloc, cascade_region_deregister, cascade_region_descriptor, cascade_region_ptr,
    cascade_region_register, cascade_remote_region,
};

use std::ffi::c_char;

static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The version of this ABI: bumped on any incompatible change to a call or a struct.
pub const CASCADE_ABI_VERSION: u32 = 1;

/// The library version as a NUL-terminated string with static lifetime.
#[no_mangle]
pub extern "C" fn cascade_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// The ABI version the library implements ([`CASCADE_ABI_VERSION`] of its header); a caller
/// compiled against another header should refuse to go on.
#[no_mangle]
pub extern "C" fn cascade_abi_version() -> u32 {
    CASCADE_ABI_VERSION
}

#[cfg(test)]
mod tests {
    #[test]
    fn version_is_nul_terminated_and_matches_the_crate() {
        // SAFETY: `cascade_version` returns a pointer to a static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(super::cascade_version()) };
        assert_eq!(s.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!(super::cascade_abi_version(), super::CASCADE_ABI_VERSION);
    }
}
