//! How much memory a node may give to regions: a configured limit on the bytes of live regions
//! it allocated, and the memory the system has available. An allocation that does not fit is
//! refused with [`TransportError::Capacity`] before anything is allocated — a multicast of more
//! bytes than a node has fails at once with a clear error instead of getting the node killed by
//! the kernel's OOM killer part way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Result, TransportError};

/// Bytes left to the rest of the system when judging whether a region fits in available memory.
pub const HEADROOM: u64 = 256 << 20;

/// A node's memory budget for regions. Clones share the count.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    limit: Option<u64>,
    used: Arc<AtomicU64>,
}

/// Bytes reserved from a budget, given back when dropped (with the region that holds it).
#[derive(Debug)]
pub(crate) struct Reservation {
    len: u64,
    used: Arc<AtomicU64>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.used.fetch_sub(self.len, Ordering::SeqCst);
    }
}

impl MemoryBudget {
    /// A budget of at most `limit` bytes of live regions (`None`: only the system's available
    /// memory bounds it).
    pub fn new(limit: Option<u64>) -> MemoryBudget {
        MemoryBudget { limit, used: Arc::default() }
    }

    /// The configured limit, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Bytes of live regions allocated against this budget.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Reserves `len` bytes, or says why they do not fit.
    pub(crate) fn reserve(&self, len: u64) -> Result<Reservation> {
        if let Some(free) = spare() {
            if len > free {
                return Err(TransportError::Capacity { want: len, free, by: "the memory the system has available" });
            }
        }
        let mut used = self.used.load(Ordering::SeqCst);
        loop {
            if let Some(limit) = self.limit {
                if used.saturating_add(len) > limit {
                    return Err(TransportError::Capacity {
                        want: len,
                        free: limit.saturating_sub(used),
                        by: "the node's memory limit",
                    });
                }
            }
            match self.used.compare_exchange(used, used + len, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(Reservation { len, used: self.used.clone() }),
                Err(now) => used = now,
            }
        }
    }
}

/// What a new allocation may take of the machine's memory: [`available`] less [`HEADROOM`]
/// (`None` where it cannot be read). Every check of a region, model or batch against the
/// machine's memory uses this one bound.
pub fn spare() -> Option<u64> {
    available().map(|a| a.saturating_sub(HEADROOM))
}

/// `MemAvailable` from `/proc/meminfo`, in bytes (`None` where it cannot be read).
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_counts_live_reservations_only() {
        let b = MemoryBudget::new(Some(100 << 20));
        let a = b.reserve(60 << 20).unwrap();
        let err = b.reserve(60 << 20).unwrap_err();
        assert!(matches!(err, TransportError::Capacity { free, .. } if free == 40 << 20), "{err}");
        drop(a);
        assert_eq!(b.used(), 0);
        b.reserve(60 << 20).unwrap();
    }

    #[test]
    fn more_than_the_machine_has_is_refused() {
        let err = MemoryBudget::new(None).reserve(1 << 50).unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }
}
