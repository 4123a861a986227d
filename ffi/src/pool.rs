//! The parameter pool's manager, asked over its admin address: status and check as JSON.

use std::ffi::c_char;

use cascade_param_pool::manager::{admin_call, AdminAddr, AdminRequest};

use crate::buf;
use crate::error::{guard, FfiError, FfiResult, CASCADE_ERR_IO, CASCADE_ERR_POOL};

/// Asks the manager at `admin` (a unix socket path, or `host:port` with the cluster secret).
fn ask(admin: &str, secret: &[u8], req: AdminRequest) -> FfiResult<String> {
    let addr: AdminAddr = admin.parse().map_err(|e| FfiError::arg(format!("admin address {admin:?}: {e}")))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| FfiError::new(CASCADE_ERR_IO, format!("starting a runtime: {e}")))?;
    let v = rt.block_on(admin_call(&addr, secret, &req)).map_err(|e| FfiError::new(CASCADE_ERR_POOL, e.to_string()))?;
    Ok(v.to_string())
}

/// Shared body of the pool calls.
///
/// # Safety
/// As the calls' own contracts.
unsafe fn pool_call(
    admin: *const c_char,
    secret: *const u8,
    secret_len: usize,
    req: AdminRequest,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> FfiResult<i32> {
    // SAFETY: the caller's contract.
    let (admin, secret) = unsafe { (buf::text(admin, "admin")?, buf::bytes(secret, secret_len, "secret")?) };
    let json = ask(&admin, &secret, req)?;
    // SAFETY: the caller's contract for the buffer.
    unsafe { buf::out_text(&json, buf, cap, needed) }
}

/// The pool's status (models, copies and their states, nodes, bytes) as JSON, from the manager
/// at `admin` (a unix socket path, or `host:port`, which needs the cluster secret; pass
/// `secret = NULL, secret_len = 0` for a socket). Blocks for the round trip.
///
/// # Safety
/// `admin` is a NUL-terminated string; `secret` is readable for `secret_len` bytes; `buf` is
/// writable for `cap` bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_pool_status(
    admin: *const c_char,
    secret: *const u8,
    secret_len: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    // SAFETY: forwarded contract.
    guard("cascade_pool_status", || unsafe {
        pool_call(admin, secret, secret_len, AdminRequest::Status, buf, cap, needed)
    })
}

/// Verifies the pool's invariant and every copy's checksums; the report is JSON with
/// `"healthy": true|false` and the problems found. Returns `CASCADE_OK` whenever the check ran
/// (read `healthy`); an error only when it could not. Arguments as [`cascade_pool_status`].
///
/// # Safety
/// As [`cascade_pool_status`].
#[no_mangle]
pub unsafe extern "C" fn cascade_pool_check(
    admin: *const c_char,
    secret: *const u8,
    secret_len: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    // SAFETY: forwarded contract.
    guard("cascade_pool_check", || unsafe {
        pool_call(admin, secret, secret_len, AdminRequest::Check, buf, cap, needed)
    })
}
