//! Per-peer counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one link, updated by its tasks.
#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    bytes_tx: AtomicU64,
    bytes_rx: AtomicU64,
    ops: AtomicU64,
    errors: AtomicU64,
}

/// A copy of a link's counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StatsSnapshot {
    /// Payload bytes sent (WRITE data, READ answers, SEND messages).
    pub bytes_tx: u64,
    /// Payload bytes received.
    pub bytes_rx: u64,
    /// Operations this side initiated that completed successfully.
    pub ops: u64,
    /// Operations that failed, on either side.
    pub errors: u64,
}

impl LinkStats {
    pub(crate) fn tx(&self, n: u64) {
        self.bytes_tx.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn rx(&self, n: u64) {
        self.bytes_rx.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn op_ok(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn op_err(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads the counters.
    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            bytes_tx: self.bytes_tx.load(Ordering::Relaxed),
            bytes_rx: self.bytes_rx.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}
