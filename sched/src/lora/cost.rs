//! What an iteration, a mode switch and an adapter load cost on one replica.
//!
//! A merged iteration costs what the base model does: `base + per_seq·seqs +
//! per_prefill_token·prompt_tokens` (continuous batching mixes decode steps and prefills). An
//! unmerged one multiplies that by `unmerged_factor` (the adapters' `B·A·x`, their gathers and the
//! additions) and reads each distinct adapter's weights once (`per_adapter_ms`).

use serde::{Deserialize, Serialize};

use super::batcher::{adapters_of, Runnable};
use super::Mode;

/// A replica's costs, ms unless named otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    /// Fixed cost of an iteration, merged.
    pub base_ms: f64,
    /// Cost per sequence in the batch, merged.
    pub per_seq_ms: f64,
    /// Cost per prompt token prefilled in the batch, merged.
    pub per_prefill_token_ms: f64,
    /// Unmerged iteration ÷ merged iteration of the same batch.
    pub unmerged_factor: f64,
    /// Reading one distinct adapter's weights in an unmerged iteration.
    pub per_adapter_ms: f64,
    /// One merge or one un-merge (`(α/r)·B·A` added to or taken from the weights).
    pub switch_ms: f64,
    /// Loading an adapter from host memory onto the replica.
    pub adapter_load_ms: f64,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: u64,
    /// KV-cache tokens one replica holds.
    pub kv_capacity_tokens: u64,
    /// Bytes of one adapter.
    pub adapter_bytes: u64,
    /// Request migration bandwidth between replicas, bytes per ms (the cluster's network).
    pub migrate_bytes_per_ms: f64,
}

impl CostModel {
    /// Llama-2-7B on one A800-80GB, from the paper and public figures: a merged decode iteration
    /// of 15 ms and an unmerged one of 27 ms (dLoRA §2–4: `unmerged_factor` 1.8), a switch of
    /// 20 ms, 0.12 ms per sequence and 0.09 ms per prompt token (the roofline figures `llmsim`
    /// uses for the same model), a 56 MB rank-8 adapter (§4.3) read at 1.6 TB/s of HBM
    /// (0.035 ms) and loaded over PCIe 4.0 at 25 GB/s (2.2 ms), 0.5 MiB of KV per token
    /// (2 · 32 layers · 4096 · fp16) with 64 GiB of the 80 GB for KV (131,072 tokens), and
    /// 200 Gbit/s InfiniBand between replicas (§7.1).
    pub fn paper_7b() -> CostModel {
        CostModel {
            base_ms: 15.0,
            per_seq_ms: 0.12,
            per_prefill_token_ms: 0.09,
            unmerged_factor: 27.0 / 15.0,
            per_adapter_ms: 0.035,
            switch_ms: 20.0,
            adapter_load_ms: 2.24,
            kv_bytes_per_token: 512 << 10,
            kv_capacity_tokens: 131_072,
            adapter_bytes: 56_000_000,
            migrate_bytes_per_ms: 25e6,
        }
    }

    /// SmolLM2-135M on this development machine's CPU (2 vCPUs), from `lora-cost` (README,
    /// 2026-11-22, rank 8 on q/k/v/o): merged decode 77 ms at batch 1 and 255 ms at 16
    /// (65 ms + 11.8 ms per sequence), unmerged 1.7–2.2× merged from batch 4 (1.9 here), merge
    /// 70.5 ms, an adapter from host memory 1.1 ms (3.7 MB). Prompt tokens are charged like
    /// sequences (not measured separately); KV is 30 layers · 2 · 192 · f32 = 46 kB per token, with
    /// 4 GiB for KV; migration over loopback TCP at 1 GB/s.
    pub fn cpu_smollm2() -> CostModel {
        CostModel {
            base_ms: 65.0,
            per_seq_ms: 11.8,
            per_prefill_token_ms: 11.8,
            unmerged_factor: 1.9,
            per_adapter_ms: 0.0,
            switch_ms: 70.5,
            adapter_load_ms: 1.1,
            kv_bytes_per_token: 46_080,
            kv_capacity_tokens: 93_206,
            adapter_bytes: 3_700_000,
            migrate_bytes_per_ms: 1e6,
        }
    }

    /// A named profile: `paper-7b` or `cpu-smollm2`.
    pub fn by_name(name: &str) -> Result<CostModel, String> {
        match name {
            "paper-7b" => Ok(CostModel::paper_7b()),
            "cpu-smollm2" => Ok(CostModel::cpu_smollm2()),
            _ => Err(format!("unknown cost profile {name:?} (paper-7b, cpu-smollm2)")),
        }
    }

    /// Checks that every cost is finite and non-negative and the capacities are non-zero.
    pub fn validate(&self) -> Result<(), String> {
        let ms = [
            ("base_ms", self.base_ms),
            ("per_seq_ms", self.per_seq_ms),
            ("per_prefill_token_ms", self.per_prefill_token_ms),
            ("per_adapter_ms", self.per_adapter_ms),
            ("switch_ms", self.switch_ms),
            ("adapter_load_ms", self.adapter_load_ms),
        ];
        for (name, v) in ms {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("cost {name} = {v}: must be a finite number ≥ 0"));
            }
        }
        if !(self.unmerged_factor.is_finite() && self.unmerged_factor >= 1.0) {
            return Err(format!("cost unmerged_factor = {}: must be ≥ 1", self.unmerged_factor));
        }
        if !(self.migrate_bytes_per_ms.is_finite() && self.migrate_bytes_per_ms > 0.0) {
            return Err("cost migrate_bytes_per_ms must be > 0".into());
        }
        if self.kv_capacity_tokens == 0 || self.kv_bytes_per_token == 0 {
            return Err("cost kv_capacity_tokens and kv_bytes_per_token must be > 0".into());
        }
        Ok(())
    }

    /// One iteration of `seqs` sequences with `prompt_tokens` of them prefilled, in `mode`, with
    /// `adapters` distinct adapters among them.
    pub fn iteration_ms(&self, mode: Mode, seqs: usize, prompt_tokens: u64, adapters: usize) -> f64 {
        if seqs == 0 {
            return 0.0;
        }
        let merged = self.base_ms + self.per_seq_ms * seqs as f64 + self.per_prefill_token_ms * prompt_tokens as f64;
        match mode {
            Mode::Merged(_) => merged,
            Mode::Unmerged => merged * self.unmerged_factor + self.per_adapter_ms * adapters as f64,
        }
    }

    /// One iteration of `batch` (indices into `runnable`) in `mode`.
    pub fn batch_ms(&self, mode: Mode, runnable: &[Runnable], batch: &[usize]) -> f64 {
        let prompt: u64 = batch.iter().map(|&i| runnable[i].prompt_tokens).sum();
        self.iteration_ms(mode, batch.len(), prompt, adapters_of(runnable, batch).len())
    }

    /// The work in `batch` whichever mode runs it: what its sequences and prompt tokens add to a
    /// merged iteration beyond the fixed cost, ms.
    pub fn work_ms(&self, runnable: &[Runnable], batch: &[usize]) -> f64 {
        let prompt: u64 = batch.iter().map(|&i| runnable[i].prompt_tokens).sum();
        self.per_seq_ms * batch.len() as f64 + self.per_prefill_token_ms * prompt as f64
    }

    /// β₀ of Algorithm 1 in the artifact: merged ÷ unmerged iteration time (one sequence).
    pub fn beta0(&self) -> f64 {
        self.iteration_ms(Mode::Merged(0), 1, 0, 1) / self.iteration_ms(Mode::Unmerged, 1, 0, 1)
    }

    /// Moving `tokens` of KV cache to another replica.
    pub fn migrate_ms(&self, tokens: u64) -> f64 {
        (tokens * self.kv_bytes_per_token) as f64 / self.migrate_bytes_per_ms
    }
}
