//! Large buffers kept for reuse by the process's allocator instead of mapped afresh each time.
//!
//! glibc's `malloc` serves an allocation above its mmap threshold (which adapts, up to 32 MiB)
//! with a mapping of its own and unmaps it when it is freed, and it gives the top of its heap
//! back to the kernel once 128 KiB or more of it are free. A forward pass allocates and frees
//! tensors of tens of megabytes at every layer — for 32 texts of 256 tokens through
//! all-MiniLM-L6-v2, 100 MB of attention scores and 50 MB of MLP activations — so each one was
//! faulted in and zeroed by the kernel page by page at every use: `perf` on `cascade embed` of
//! 300 such texts showed a fifth of the time in page faults (2026-12-06). [`keep_freed_memory`]
//! raises both thresholds, so freed buffers stay in the heap and the next layer's come from
//! there.
//!
//! The cost is that the process keeps the heap at its peak after a large batch, as a serving
//! process does anyway; the peak itself does not grow (13 MB more on that run's 519 MB).

/// Allocations up to this size come from the heap, not from a mapping of their own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 1 << 30;
/// Free memory at the heap's top kept rather than given back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = libc::c_int::MAX;

/// Sets glibc's mmap and trim thresholds as the module docs say; returns whether glibc took
/// both (false elsewhere: other C libraries are left as they are).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's parameters (under its own lock); any
        // value is checked by glibc, which returns 0 for one it refuses.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of this thread so far.
    fn faults() -> i64 {
        // SAFETY: rusage is plain integers and timevals, for which all-zero bytes are valid.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage writes the struct it is given, which lives across the call.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        u.ru_minflt
    }

    /// Page faults while a buffer of `bytes` is allocated, written and freed.
    fn faults_touching(bytes: usize) -> i64 {
        let before = faults();
        let v = std::hint::black_box(vec![1u8; bytes]);
        drop(v);
        faults() - before
    }

    /// glibc takes the thresholds, and a buffer of 48 MiB (above the 32 MiB up to which glibc's
    /// own threshold adapts) freed and allocated again comes back without faulting its pages in
    /// afresh: 12,288 faults a time before.
    #[test]
    fn a_freed_large_buffer_is_reused_without_faulting_in_again() {
        assert!(keep_freed_memory(), "mallopt refused a threshold");
        let bytes = 48 << 20;
        let first = faults_touching(bytes);
        let again = faults_touching(bytes);
        let pages = (bytes / 4096) as i64;
        assert!(again < pages / 20, "{again} faults the second time ({first} the first, {pages} pages)");
    }
}
