//! The load monitor (BlitzScale §5.3 follows prior work: serving load in tokens per second and
//! KV usage against a per-instance bound profiled offline). The rule, every tick:
//!
//! - **prefill** instances wanted = ⌈(prompt tokens/s arriving over the last 2 s + queued prompt
//!   tokens ÷ 2 s) ÷ (u · one instance's prefill capacity)⌉: the arrival rate at a utilisation u
//!   ([`UTILISATION`] = 80% unless the run sets another: the paper's "upper bound … profiled
//!   offline" is a deployment's choice), plus enough to drain the backlog in two seconds —
//!   queueing that would threaten the TTFT SLO;
//! - **decode** instances wanted = ⌈sequences decoding, waiting or in KV transfer ÷ the largest batch
//!   whose iteration stays within 80% of the TBT SLO⌉;
//! - at least one of each. Out: instances are started (or mutated) at once up to what is wanted.
//!   In: an instance idle for `scale_in_idle_s` while more than wanted are running is released.

use super::Profile;

/// Seconds over which the arrival rate is measured, and within which the backlog should drain.
pub(super) const WINDOW_S: f64 = 2.0;
/// Target utilisation of prefill instances, by default.
pub const UTILISATION: f64 = 0.8;

/// What the monitor sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Load {
    /// Prompt tokens arrived in the last [`WINDOW_S`].
    pub(super) recent_prompt_tokens: u64,
    /// Prompt tokens queued for prefill.
    pub(super) backlog_tokens: u64,
    /// Sequences decoding, waiting for a decode slot or with their KV in flight.
    pub(super) decode_seqs: usize,
}

/// (prefill, decode) instances wanted for `load`, prefill instances at `utilisation`.
pub(super) fn wanted(p: &Profile, utilisation: f64, load: Load) -> (usize, usize) {
    let demand = (load.recent_prompt_tokens as f64 + load.backlog_tokens as f64) / WINDOW_S;
    let prefill = (demand / (utilisation * p.prefill_capacity())).ceil().max(1.0) as usize;
    let decode = load.decode_seqs.div_ceil(p.decode_target_batch()).max(1);
    (prefill, decode)
}
