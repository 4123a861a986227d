//! Status codes, the thread's last error, and the guard every entry point runs under.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cascade_transport::TransportError;

/// Success.
pub const CASCADE_OK: i32 = 0;
/// Not done yet (nothing to poll, mesh not complete within the wait): call again.
pub const CASCADE_IN_PROGRESS: i32 = 1;
/// A null pointer, a bad value, a struct too small, malformed text or JSON.
pub const CASCADE_ERR_INVALID_ARGUMENT: i32 = -1;
/// The output buffer is too small; `*needed` says how large it must be.
pub const CASCADE_ERR_BUFFER_TOO_SMALL: i32 = -2;
/// No live link to the peer.
pub const CASCADE_ERR_NOT_CONNECTED: i32 = -3;
/// An operation did not finish within its limit.
pub const CASCADE_ERR_TIMEOUT: i32 = -4;
/// The peer refused the access (unknown region, wrong key, out of its bounds).
pub const CASCADE_ERR_REFUSED: i32 = -5;
/// Data arrived corrupt (crc32 mismatch).
pub const CASCADE_ERR_CRC: i32 = -6;
/// The peer went down while the operation was in flight.
pub const CASCADE_ERR_PEER_DOWN: i32 = -7;
/// Bad configuration (cluster file, node id, secret, limits).
pub const CASCADE_ERR_CONFIG: i32 = -8;
/// An operating-system error (sockets, memory, files).
pub const CASCADE_ERR_IO: i32 = -9;
/// A panic inside the library, caught at the boundary.
pub const CASCADE_ERR_PANIC: i32 = -10;
/// A local access outside a region.
pub const CASCADE_ERR_OUT_OF_BOUNDS: i32 = -11;
/// The region is still in use by operations in flight or by peers: try again later.
pub const CASCADE_ERR_BUSY: i32 = -12;
/// The pool manager refused or could not be reached.
pub const CASCADE_ERR_POOL: i32 = -13;
/// A multicast could not be planned or run.
pub const CASCADE_ERR_MULTICAST: i32 = -14;
/// Anything else (a protocol violation by a peer, a message too large, …).
pub const CASCADE_ERR_OTHER: i32 = -15;

/// An error on its way to C: a status code and its message.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub(crate) code: i32,
    pub(crate) msg: String,
}

impl FfiError {
    pub(crate) fn new(code: i32, msg: impl Into<String>) -> FfiError {
        FfiError { code, msg: msg.into() }
    }

    pub(crate) fn arg(msg: impl Into<String>) -> FfiError {
        FfiError::new(CASCADE_ERR_INVALID_ARGUMENT, msg)
    }

    /// The same error, its message prefixed with what it concerns (`ops[3]`).
    pub(crate) fn with_prefix(mut self, p: &str) -> FfiError {
        self.msg = format!("{p}: {}", self.msg);
        self
    }
}

/// The status code of a transport error.
pub(crate) fn code_of(e: &TransportError) -> i32 {
    match e {
        TransportError::OutOfBounds { .. } => CASCADE_ERR_OUT_OF_BOUNDS,
        TransportError::Refused { .. } => CASCADE_ERR_REFUSED,
        TransportError::CrcMismatch { .. } => CASCADE_ERR_CRC,
        TransportError::PeerDown { .. } => CASCADE_ERR_PEER_DOWN,
        TransportError::NotConnected { .. } => CASCADE_ERR_NOT_CONNECTED,
        TransportError::Timeout { .. } | TransportError::MeshIncomplete { .. } => CASCADE_ERR_TIMEOUT,
        TransportError::Config(_) | TransportError::Capacity { .. } => CASCADE_ERR_CONFIG,
        TransportError::Io { .. } => CASCADE_ERR_IO,
        _ => CASCADE_ERR_OTHER,
    }
}

impl From<TransportError> for FfiError {
    fn from(e: TransportError) -> FfiError {
        FfiError::new(code_of(&e), e.to_string())
    }
}

pub(crate) type FfiResult<T> = Result<T, FfiError>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    // A message with a NUL inside is cut there rather than lost.
    let msg = msg.split('\0').next().unwrap_or_default();
    let c = CString::new(msg).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// The message of the last call on this thread that failed ("" when none has). The pointer is
/// valid until the next call on this thread that fails; copy it to keep it.
#[no_mangle]
pub extern "C" fn cascade_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Runs an entry point's body: its error becomes a status code and this thread's last error,
/// and a panic is caught here, never unwinding into C.
pub(crate) fn guard(call: &str, f: impl FnOnce() -> FfiResult<i32>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            set_last_error(&format!("{call}: {}", e.msg));
            e.code
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("{call}: internal error (panic): {what}"));
            CASCADE_ERR_PANIC
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: `cascade_last_error` returns a NUL-terminated string owned by this thread.
        unsafe { std::ffi::CStr::from_ptr(cascade_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        assert_eq!(guard("cascade_test", || panic!("boom")), CASCADE_ERR_PANIC);
        assert!(last().contains("cascade_test: internal error (panic): boom"), "{}", last());
        assert_eq!(guard("cascade_test", || Err(FfiError::arg("bad\0tail"))), CASCADE_ERR_INVALID_ARGUMENT);
        assert_eq!(last(), "cascade_test: bad");
        assert_eq!(guard("cascade_test", || Ok(CASCADE_IN_PROGRESS)), CASCADE_IN_PROGRESS);
        // Success leaves the last error as it was.
        assert_eq!(last(), "cascade_test: bad");
    }
}
