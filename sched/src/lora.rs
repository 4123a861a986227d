//! dLoRA (seed `002_…`): serving many LoRA adapters of one base model.
//!
//! * [`batcher`] — per replica, per iteration: Algorithm 1 (dynamic merged/unmerged batching),
//!   Algorithm 2 (adaptive thresholds) and Appendix A.1's Algorithm 3 (credits against
//!   starvation), and the baselines on the same interface ([`Policy`]): `merged-only`,
//!   `unmerged-only`, `slora`;
//! * [`cost`] — iteration, switch and adapter-load costs: the paper's Llama-2-7B numbers and this
//!   machine's measured SmolLM2 ones;
//! * [`dispatch`] — §5.1: burst-tolerance placement and routing by estimated pending time, with a
//!   bounded LRU set of adapters per replica;
//! * [`migrate`] — §5.2: the request–adapter co-migration ILP (`good_lp` + `microlp`), with its
//!   relaxations, a greedy plan that is fallback and bound, and a feasibility check;
//! * [`workload`], [`sim`] — scenarios and the simulator behind `lora-sim`: emulated replicas (a
//!   test double for GPUs, costs from [`cost`]) running continuous batching iteration by
//!   iteration.
//!
//! Everything here is sans IO: no clock, no threads; a driver (the simulator, or a real serving
//! loop on the CPU model) calls [`batcher::Batcher::decide`] once per iteration.

pub mod batcher;
pub mod cost;
pub mod dispatch;
pub mod migrate;
pub mod sim;
#[cfg(test)]
mod tests;
pub mod workload;

pub use batcher::{BatchConfig, Batcher, Choice, Policy, Runnable};
pub use cost::CostModel;

/// An adapter (a LoRA fine-tune of the base model), numbered from 0.
pub type AdapterId = u32;

/// How a replica's weights are set for an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Base weights; each request adds its own adapter's `B·A·x`.
    Unmerged,
    /// This adapter folded into the base weights: only its requests can run.
    Merged(AdapterId),
}

impl Mode {
    /// Merge and un-merge operations to go from `self` to `to` (0, 1 or 2).
    pub fn switch_ops(self, to: Mode) -> u32 {
        match (self, to) {
            (a, b) if a == b => 0,
            (Mode::Merged(_), Mode::Merged(_)) => 2,
            _ => 1,
        }
    }
}
