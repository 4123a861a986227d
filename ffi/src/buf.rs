//! Arguments in (strings copied, handles checked) and output buffers out.

use std::ffi::{c_char, CStr};

use crate::error::{FfiError, FfiResult, CASCADE_ERR_BUFFER_TOO_SMALL, CASCADE_OK};

/// Copies a NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string readable for the call.
pub(crate) unsafe fn text(p: *const c_char, what: &str) -> FfiResult<String> {
    if p.is_null() {
        return Err(FfiError::arg(format!("{what} is null")));
    }
    // SAFETY: non-null, and the caller guarantees a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(str::to_owned).map_err(|_| FfiError::arg(format!("{what} is not UTF-8")))
}

/// Copies `len` bytes at `p` (`p` may be null when `len` is 0).
///
/// # Safety
/// `p` is readable for `len` bytes when `len > 0`.
pub(crate) unsafe fn bytes(p: *const u8, len: usize, what: &str) -> FfiResult<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(FfiError::arg(format!("{what} is null but its length is {len}")));
    }
    // SAFETY: non-null and readable for `len` bytes (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, len) }.to_vec())
}

/// A shared reference to the object behind a handle.
///
/// # Safety
/// `p` is null or a live handle of this type that no other thread destroys during the call.
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> FfiResult<&'a T> {
    // SAFETY: the caller guarantees `p` is null or valid for the call.
    unsafe { p.as_ref() }.ok_or_else(|| FfiError::arg(format!("{what} is null")))
}

/// An out-parameter, checked on entry: before any work whose result could then not be handed
/// back (an endpoint made, a region registered).
pub(crate) struct Out<T>(std::ptr::NonNull<T>);

/// Checks the out-parameter `p`.
///
/// # Safety
/// `p` is null or writable for one `T` until the call returns.
pub(crate) unsafe fn out_param<T>(p: *mut T, what: &str) -> FfiResult<Out<T>> {
    std::ptr::NonNull::new(p).map(Out).ok_or_else(|| FfiError::arg(format!("{what} is null")))
}

impl<T> Out<T> {
    /// Writes the result.
    pub(crate) fn put(self, v: T) {
        // SAFETY: non-null (checked by `out_param`) and writable for the call (the contract
        // `out_param` was called under).
        unsafe { self.0.as_ptr().write(v) }
    }
}

/// Tells the caller an output takes `need` bytes (`*needed`), and refuses a `(buf, cap)` that
/// cannot hold them. An output of no bytes (an empty message) fits any buffer, null included.
///
/// # Safety
/// `needed` is null or writable.
pub(crate) unsafe fn fits(need: usize, buf: *const u8, cap: usize, needed: *mut usize) -> FfiResult<()> {
    if !needed.is_null() {
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { needed.write(need) };
    }
    if cap < need || (buf.is_null() && need > 0) {
        return Err(FfiError::new(
            CASCADE_ERR_BUFFER_TOO_SMALL,
            format!("the output needs {need} bytes; the buffer holds {cap}"),
        ));
    }
    Ok(())
}

/// Writes `data` (plus a terminating NUL when `nul`) to `(buf, cap)`, and its size to `*needed`.
///
/// # Safety
/// `needed` is null or writable; `buf` is null or writable for `cap` bytes.
pub(crate) unsafe fn out(data: &[u8], nul: bool, buf: *mut u8, cap: usize, needed: *mut usize) -> FfiResult<i32> {
    let need = data.len() + usize::from(nul);
    // SAFETY: forwarded contract for `needed`.
    unsafe { fits(need, buf, cap, needed) }?;
    if need == 0 {
        // Nothing to write, and `buf` may be null, which even a copy of no bytes must not get.
        return Ok(CASCADE_OK);
    }
    // SAFETY: `buf` is non-null (`fits`: need > 0), writable for `cap ≥ need` bytes and cannot
    // overlap our own `data`.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len());
        if nul {
            buf.add(data.len()).write(0);
        }
    }
    Ok(CASCADE_OK)
}

/// Writes `text` NUL-terminated (see [`out`]).
///
/// # Safety
/// As [`out`].
pub(crate) unsafe fn out_text(text: &str, buf: *mut c_char, cap: usize, needed: *mut usize) -> FfiResult<i32> {
    // SAFETY: forwarded contract.
    unsafe { out(text.as_bytes(), true, buf.cast(), cap, needed) }
}

/// Reads a caller's struct that starts with its `struct_size`: at least `min` bytes (the first
/// version of the struct) must be there; fields a newer caller appended are ignored, and a struct
/// this library knows to be longer than the caller's is refused.
///
/// # Safety
/// `p` is null or points to a readable struct of at least the `u32` size it starts with.
pub(crate) unsafe fn sized<T: Copy>(p: *const T, what: &str) -> FfiResult<T> {
    if p.is_null() {
        return Err(FfiError::arg(format!("{what} is null")));
    }
    // SAFETY: the struct starts with its size, a u32 (the caller's contract).
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    if size < std::mem::size_of::<T>() {
        return Err(FfiError::arg(format!(
            "{what}.struct_size is {size}, this library needs {} (set it to sizeof the struct)",
            std::mem::size_of::<T>()
        )));
    }
    // SAFETY: the caller's struct holds at least `size_of::<T>()` readable bytes.
    Ok(unsafe { p.read_unaligned() })
}
