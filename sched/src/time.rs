//! Totally ordered times for timer sets, and Symphony's dispatch delay.

use crate::scheduler::Ms;

/// A time usable as an ordered key (`f64::total_cmp`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct At(pub Ms);

impl Eq for At {}

impl PartialOrd for At {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for At {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// The time from a dispatch decision until the batch can start on its GPU: Symphony's
/// `delay(bs) = d_ctrl + d_data · bs` (control message, then every request's input).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Delay {
    /// Fixed part, ms.
    pub ctrl_ms: f64,
    /// Per request, ms.
    pub data_ms: f64,
}

impl Delay {
    /// delay(bs).
    pub fn of(&self, bs: usize) -> Ms {
        self.ctrl_ms + self.data_ms * bs as f64
    }
}
