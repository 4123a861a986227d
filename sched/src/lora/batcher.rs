//! One replica's batching decision, made once per iteration (dLoRA §4.2 and Appendix A.1).
//!
//! The driver hands [`Batcher::decide`] the requests that can run this iteration in FCFS
//! (arrival) order; the batcher returns which of them to run and in which [`Mode`]. The FCFS
//! batch `B_fcfs` is the first `max_batch` of them (the *window*).
//!
//! **`dlora`** follows the paper:
//! 1. *Starvation (Algorithm 3, lines 6–15).* An adapter whose credit exceeds `t_starve` is
//!    starving until its credit falls below `t_normal`; while any adapter starves, its requests
//!    (FCFS, up to `max_batch`) are served first — and, in an unmerged batch, the slots left take
//!    the other requests in FCFS order (the pseudo-code serves the starving ones alone; filling
//!    the batch costs little and keeps a starvation iteration from serving two requests).
//! 2. *Eligibility (line 18).* An adapter may be merged only if its credit covers what serving it
//!    instead of `B_fcfs` costs: `1/max_batch` credit per request of `B_fcfs` it displaces.
//! 3. *Algorithm 1.* Unmerged: the eligible adapter with most runnable requests `R_merge` is
//!    merged when `|R_merge| / |B_fcfs| > α` and the merge is amortised (below), else `B_fcfs`
//!    runs unmerged. Merged with adapter
//!    `l`: stay while `|R_l| / |B_fcfs| ≥ β` and `l` is eligible, else un-merge and run `B_fcfs`.
//! 4. *Credits (lines 14 and 21).* A batch other than `B_fcfs` transfers `1/max_batch` credit to
//!    the adapter of every request of `B_fcfs` it displaces, paid evenly by the requests it serves
//!    from beyond the window (those that jumped the queue), or by all it serves if none did.
//! 5. *Algorithm 2.* At break points — a mode switch, a change of `R_merge`'s adapter, or every
//!    `break_iters` iterations — the period since the last one is judged by the throughput
//!    (tokens processed per ms, from the cost model) of what merged and unmerged batches achieved
//!    or would have achieved, the switch overhead `t_M` charged to the mode the replica was not in: after
//!    an unmerged period, `α −= γ_dec` if merging would have been faster, else `α ×= γ_mul`;
//!    after a merged period, `β ×= γ_mul` if un-merging would have been faster, else
//!    `β −= γ_dec`.
//!
//! **Where this departs from the paper, stated.** The paper gives no bounds for α and β beyond
//! "β stays below α": here `0.01 ≤ α ≤ alpha_max` and `0.01 ≤ β ≤ α − 0.01`. Credits start at
//! `credit0` each and are conserved (the paper: "the same credit to each adapter"; the amount of a
//! transfer is not given). Credits are counted in *batches*, as the public artifact counts them
//! (its `credit_cost = 1/max_num_seqs` per displaced request): a credit is `max_batch` displaced
//! requests, so the thresholds mean the same at every batch size. The defaults — 128 credits
//! each, starving above 160, normal again below 128 — are this implementation's; the artifact's
//! thresholds (10,000 credits above the start, about 1/36 credit per displaced request) never bind in a
//! run of minutes, ours do, and the paper leaves `T_starve` as the knob between performance and
//! fairness. An earlier version counted one credit per displaced request with the same numbers —
//! 32× tighter at `max_batch` 32 — and the dominant adapter, having spent its credit, merged for
//! one iteration whenever reversion returned just enough credit for it, paying two 20 ms switches
//! for one 15 ms iteration (README, dLoRA, "credit scale"). Conserved transfers
//! alone lock up: in FCFS batches no credit moves, so an adapter that spent its credit on merges
//! could never merge again. Each iteration every credit therefore moves a fraction λ
//! (`credit_reversion`; by default `1 / (2·max_batch·(t_starve − credit0))`, half of what the
//! bound below allows) of the way back to `credit0` — which keeps the sum — and an adapter that
//! paid recovers. *Merged starvation batches*: the pseudo-code returns `B_starve` without a
//! mode. Here a starvation batch runs merged when the merged adapter's requests are all it
//! holds, or when its starving requests are all of one adapter, fill a batch as large as
//! `B_fcfs`, and merging that adapter pays: the iterations it will starve for (until its credit,
//! paying for what it displaces, falls below `t_normal`) together save more than the switch into
//! merged mode and the one out of it (`merge_starving`; this implementation's choice, measured
//! in the README: merging partial starvation batches too was worse at 3 requests/s). Otherwise
//! it runs unmerged, the free slots filled FCFS.
//!
//! Algorithm 1 runs over the eligible adapters (Algorithm 3, line 19), so `R_merge` and
//! Algorithm 2's would-be merged batch are the eligible argmax's; iterations with no eligible
//! adapter are not recorded for tuning (α decided nothing there: recording them let α fall to its
//! floor while the dominant adapter could not pay, and then merge an adapter with one request).
//! *Amortised merges* are this implementation's addition, from the paper's "a final decision is
//! made by taking all factors into account, including execution time, queuing delay, and
//! switching overhead" (§4): Algorithm 1 alone merges whenever the ratio passes α, even when the
//! adapter's credit lets it stay merged for one iteration only — which, once the dominant adapter
//! has spent its credit, is what happened every few iterations, two 20 ms switches bought for
//! one 15 ms iteration. A merge is made only if `k·s > 2·t_M`: `k` the merged iterations the
//! adapter's credit pays for at the current displacement, `s` the time one of them saves (what
//! the unmerged `B_fcfs` would take for the merged batch's work — sequences and prompt tokens at
//! their cost-model prices — less the merged iteration's time), `t_M` one switch. Measured on
//! Figure 10's grid (README, dLoRA): on held-out seeds, dLoRA lowest in 44 of 48 settings with
//! it, 38 without.
//!
//! Algorithm 2 counts a batch's size `|B_i|` in tokens processed — a prompt's tokens for a
//! request it prefills, one for a decode step — since with continuous batching a batch mixes both
//! and a prefill's work is done whichever mode does it; counting requests made a would-be merged
//! batch full of prefills look slower than the FCFS batch of decode steps and kept α rising.
//!
//! **The starvation bound** ([`Batcher::starvation_bound`]): a request in the window that is not
//! served is displaced, so its adapter gains at least `u = 1/max_batch` credit and pays nothing
//! that iteration, while reversion takes at most `λ·(t_starve − credit0)` from a credit not above
//! `t_starve`: a net gain of at least `g = u − λ·(t_starve − credit0) > 0`. An adapter's credit
//! never falls below `F = min(0, credit0, min(t_normal, credit0) − 1)` (a merge is paid for only
//! from credit that covers it; a starving adapter has at least `t_normal`, reversion keeps it at
//! least `min(t_normal, credit0)`, and it pays at most `max_batch · u = 1`; reversion lifts a credit below
//! `credit0`). The order within an iteration: starvation check, reversion, transfers. After `⌊(t_starve − F) / g⌋ + 1` consecutive iterations
//! displaced, its adapter starves, and a starving adapter's request in the window is within the first `max_batch` of
//! the starving requests, so it runs. No request spends more consecutive iterations in the window
//! without running than that bound; the tests check it on random workloads.
//!
//! The baselines: **`merged-only`** merges the adapter of the oldest request and runs its
//! requests (PEFT-style batching by type; a switch whenever the head's adapter changes);
//! **`unmerged-only`** runs `B_fcfs` unmerged; **`slora`** (S-LoRA-like) runs unmerged with
//! S-LoRA's adapter clustering: FCFS, a request admitted only if its adapter is already in the
//! batch or the batch has fewer than `slora_max_adapters` adapters (the oldest request always
//! runs). S-LoRA's custom kernels are not modelled: its iterations cost what unmerged ones do.

use serde::{Deserialize, Serialize};

use super::{AdapterId, CostModel, Mode};

crate::named_enum! {
    /// A batching policy.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "kebab-case")]
    pub enum Policy("policy") {
        /// dLoRA: dynamic merged/unmerged batching with adaptive thresholds and credits.
        Dlora = "dlora",
        /// Always merged: one adapter at a time, the oldest request's.
        MergedOnly = "merged-only",
        /// Always unmerged, FCFS.
        UnmergedOnly = "unmerged-only",
        /// S-LoRA-like: always unmerged, FCFS with adapter clustering.
        Slora = "slora",
    }
}

/// The batcher's parameters (the artifact's constants by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchConfig {
    /// Largest batch, sequences.
    pub max_batch: usize,
    /// α₀.
    pub alpha0: f64,
    /// β₀; `None`: merged ÷ unmerged iteration time from the cost model.
    pub beta0: Option<f64>,
    /// γ_dec.
    pub gamma_dec: f64,
    /// γ_mul.
    pub gamma_mul: f64,
    /// Upper bound of α.
    pub alpha_max: f64,
    /// Iterations between break points when nothing else marks one.
    pub break_iters: u32,
    /// Every adapter's credit at the start, in batches (a credit is `max_batch` displaced
    /// requests).
    pub credit0: f64,
    /// An adapter with more credit than this starves (batches).
    pub t_starve: f64,
    /// A starving adapter with less credit than this is served normally again (batches).
    pub t_normal: f64,
    /// Each iteration every credit moves this fraction of the way back to `credit0` (λ; see
    /// the module docs); `None`: `1 / (2·max_batch·(t_starve − credit0))`, or 1/64 when
    /// `t_starve ≤ credit0` (the bound then puts no limit on it).
    pub credit_reversion: Option<f64>,
    /// `slora`: most distinct adapters in a batch.
    pub slora_max_adapters: usize,
    /// `dlora`: merge only when the adapter's credit pays for enough merged iterations to save
    /// the merge's and the un-merge's switch time (module docs, "amortised merges").
    pub amortize_switches: bool,
    /// `dlora`: a starvation batch whose starving requests are all of one adapter and fill a
    /// batch as large as the FCFS one runs merged with it when the iterations it will starve for
    /// save more than the switches cost (module docs, "merged starvation batches"); `false`:
    /// such batches run unmerged (filled FCFS) unless that adapter is already merged.
    pub merge_starving: bool,
}

impl Default for BatchConfig {
    fn default() -> BatchConfig {
        BatchConfig {
            max_batch: 32,
            alpha0: 1.0,
            beta0: None,
            gamma_dec: 0.05,
            gamma_mul: 1.1,
            alpha_max: 4.0,
            break_iters: 16,
            credit0: 128.0,
            t_starve: 160.0,
            t_normal: 128.0,
            credit_reversion: None,
            slora_max_adapters: 4,
            amortize_switches: true,
            merge_starving: true,
        }
    }
}

impl BatchConfig {
    /// The credit one displaced request moves: `1/max_batch`.
    pub fn unit(&self) -> f64 {
        1.0 / self.max_batch.max(1) as f64
    }

    /// λ: `credit_reversion`, or its default, half of what the starvation bound allows.
    pub fn reversion(&self) -> f64 {
        self.credit_reversion.unwrap_or_else(|| {
            let gap = (self.t_starve - self.credit0).max(0.0);
            if gap > 0.0 {
                self.unit() / (2.0 * gap)
            } else {
                1.0 / 64.0
            }
        })
    }

    /// Checks the parameters' ranges.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_batch == 0 {
            return Err("max_batch must be ≥ 1".into());
        }
        if !(self.gamma_dec > 0.0 && self.gamma_dec < 1.0 && self.gamma_mul > 1.0 && self.gamma_mul.is_finite()) {
            return Err("need 0 < gamma_dec < 1 and gamma_mul > 1".into());
        }
        if !(self.alpha0 > 0.0 && self.alpha0 <= self.alpha_max) {
            return Err("need 0 < alpha0 ≤ alpha_max".into());
        }
        if self.t_normal.is_nan()
            || self.t_normal > self.t_starve
            || !self.t_starve.is_finite()
            || !self.credit0.is_finite()
        {
            return Err("need finite credits with t_normal ≤ t_starve".into());
        }
        let lambda = self.reversion();
        if !(0.0..1.0).contains(&lambda) || lambda * (self.t_starve - self.credit0).max(0.0) >= self.unit() {
            return Err(format!(
                "need 0 ≤ credit_reversion < 1 and credit_reversion·(t_starve − credit0) < 1/max_batch \
                 (credit_reversion {lambda}, t_starve − credit0 = {}, max_batch {})",
                self.t_starve - self.credit0,
                self.max_batch
            ));
        }
        if self.break_iters == 0 || self.slora_max_adapters == 0 {
            return Err("break_iters and slora_max_adapters must be ≥ 1".into());
        }
        Ok(())
    }
}

/// A request that can run this iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Runnable {
    /// Its adapter.
    pub adapter: AdapterId,
    /// Prompt tokens this iteration prefills (0 for a decode step).
    pub prompt_tokens: u64,
}

/// The distinct adapters of `batch` (indices into `runnable`), ascending.
pub fn adapters_of(runnable: &[Runnable], batch: &[usize]) -> Vec<AdapterId> {
    let mut adapters: Vec<AdapterId> = batch.iter().map(|&i| runnable[i].adapter).collect();
    adapters.sort_unstable();
    adapters.dedup();
    adapters
}

/// What to run this iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Indices into the runnable requests, ascending (FCFS order).
    pub batch: Vec<usize>,
    /// The mode the iteration runs in.
    pub mode: Mode,
    /// Merges and un-merges to do before it (each costs `switch_ms`).
    pub switch_ops: u32,
    /// Whether starving adapters were served first.
    pub starvation: bool,
}

/// Counters of one batcher.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BatcherStats {
    /// Iterations that began with a mode switch.
    pub mode_switches: u64,
    /// Merge and un-merge operations.
    pub switch_ops: u64,
    /// Iterations decided by starvation prevention.
    pub starvation_batches: u64,
    /// Iterations run merged.
    pub merged_iterations: u64,
    /// Iterations run unmerged.
    pub unmerged_iterations: u64,
    /// Break points at which the thresholds were tuned.
    pub tunings: u64,
}

/// Algorithm 2's record of the period since the last break point.
#[derive(Debug, Clone, Default)]
struct Period {
    merged: bool,
    adapter: Option<AdapterId>,
    iters: u32,
    merged_tokens: f64,
    merged_ms: f64,
    unmerged_tokens: f64,
    unmerged_ms: f64,
}

/// One replica's batching state.
#[derive(Debug, Clone)]
pub struct Batcher {
    policy: Policy,
    cfg: BatchConfig,
    cost: CostModel,
    mode: Mode,
    alpha: f64,
    beta: f64,
    credit: Vec<f64>,
    starving: Vec<bool>,
    period: Period,
    stats: BatcherStats,
}

impl Batcher {
    /// A batcher in unmerged mode with every credit at `credit0`.
    pub fn new(policy: Policy, cfg: BatchConfig, cost: CostModel) -> Batcher {
        let beta = cfg.beta0.unwrap_or_else(|| cost.beta0()).min(cfg.alpha0 - 0.01).max(0.01);
        Batcher {
            policy,
            alpha: cfg.alpha0,
            beta,
            cfg,
            cost,
            mode: Mode::Unmerged,
            credit: Vec::new(),
            starving: Vec::new(),
            period: Period::default(),
            stats: BatcherStats::default(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The current mode (that of the last iteration decided).
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// α and β now.
    pub fn thresholds(&self) -> (f64, f64) {
        (self.alpha, self.beta)
    }

    /// An adapter's credit.
    pub fn credit(&self, a: AdapterId) -> f64 {
        self.credit.get(a as usize).copied().unwrap_or(self.cfg.credit0)
    }

    /// The counters.
    pub fn stats(&self) -> &BatcherStats {
        &self.stats
    }

    /// The most consecutive iterations a request can spend in the FCFS window without running,
    /// under `dlora` (see the module docs); `None` for the baselines, which promise none
    /// (`merged-only` can starve an adapter; the unmerged ones never pass a window request over).
    pub fn starvation_bound(&self) -> Option<u64> {
        match self.policy {
            Policy::Dlora => {
                let c = &self.cfg;
                let floor = 0f64.min(c.credit0).min(c.t_normal.min(c.credit0) - 1.0);
                let gain = c.unit() - c.reversion() * (c.t_starve - c.credit0).max(0.0);
                Some(((c.t_starve - floor) / gain).floor() as u64 + 1)
            }
            Policy::UnmergedOnly => Some(0),
            Policy::MergedOnly | Policy::Slora => None,
        }
    }

    fn ensure(&mut self, a: AdapterId) {
        let n = a as usize + 1;
        if self.credit.len() < n {
            self.credit.resize(n, self.cfg.credit0);
            self.starving.resize(n, false);
        }
    }

    /// Decides this iteration's batch among `runnable` (FCFS order). An empty `runnable` gives
    /// an empty batch in the current mode.
    pub fn decide(&mut self, runnable: &[Runnable]) -> Choice {
        for r in runnable {
            self.ensure(r.adapter);
        }
        let window = runnable.len().min(self.cfg.max_batch);
        let fcfs: Vec<usize> = (0..window).collect();
        let (batch, mode, starvation) = match self.policy {
            _ if runnable.is_empty() => (Vec::new(), self.mode, false),
            Policy::UnmergedOnly => (fcfs, Mode::Unmerged, false),
            Policy::MergedOnly => {
                let a = runnable[0].adapter;
                (self.of_adapter(runnable, a), Mode::Merged(a), false)
            }
            Policy::Slora => (self.clustered(runnable), Mode::Unmerged, false),
            Policy::Dlora => self.dlora(runnable, &fcfs),
        };
        let switch_ops = self.mode.switch_ops(mode);
        if switch_ops > 0 {
            self.stats.mode_switches += 1;
            self.stats.switch_ops += switch_ops as u64;
        }
        if !batch.is_empty() {
            match mode {
                Mode::Merged(_) => self.stats.merged_iterations += 1,
                Mode::Unmerged => self.stats.unmerged_iterations += 1,
            }
        }
        self.mode = mode;
        Choice { batch, mode, switch_ops, starvation }
    }

    /// The first `max_batch` runnable requests of adapter `a`.
    fn of_adapter(&self, runnable: &[Runnable], a: AdapterId) -> Vec<usize> {
        (0..runnable.len()).filter(|&i| runnable[i].adapter == a).take(self.cfg.max_batch).collect()
    }

    fn clustered(&self, runnable: &[Runnable]) -> Vec<usize> {
        let mut adapters: Vec<AdapterId> = Vec::new();
        let mut batch = Vec::new();
        for (i, r) in runnable.iter().enumerate() {
            if batch.len() == self.cfg.max_batch {
                break;
            }
            if adapters.contains(&r.adapter) {
                batch.push(i);
            } else if adapters.len() < self.cfg.slora_max_adapters {
                adapters.push(r.adapter);
                batch.push(i);
            }
        }
        batch
    }

    fn dlora(&mut self, runnable: &[Runnable], fcfs: &[usize]) -> (Vec<usize>, Mode, bool) {
        // Algorithm 3, lines 6–10.
        for a in 0..self.credit.len() {
            if self.starving[a] && self.credit[a] < self.cfg.t_normal {
                self.starving[a] = false;
            } else if self.credit[a] > self.cfg.t_starve {
                self.starving[a] = true;
            }
        }
        // Reversion after the check and before this iteration's transfers: an adapter that is not
        // starving (credit ≤ t_starve) loses at most λ·(t_starve − credit0) to it.
        let (c0, lambda) = (self.cfg.credit0, self.cfg.reversion());
        for c in &mut self.credit {
            *c += lambda * (c0 - *c);
        }
        // Lines 11–15.
        let starve: Vec<usize> = (0..runnable.len())
            .filter(|&i| self.starving[runnable[i].adapter as usize])
            .take(self.cfg.max_batch)
            .collect();
        if !starve.is_empty() {
            let first = runnable[starve[0]].adapter;
            let alone = starve.iter().all(|&i| runnable[i].adapter == first);
            // Unmerged, the free slots take the other requests in FCFS order.
            let mut filled = starve.clone();
            let room = self.cfg.max_batch - starve.len();
            filled.extend((0..runnable.len()).filter(|&i| !self.starving[runnable[i].adapter as usize]).take(room));
            filled.sort_unstable();
            let (starve, mode) = match self.mode {
                Mode::Merged(l) if l == first && alone => (starve, self.mode),
                _ if alone && self.cfg.merge_starving && self.starving_merge_pays(runnable, fcfs, &starve, &filled) => {
                    (starve, Mode::Merged(first))
                }
                _ => (filled, Mode::Unmerged),
            };
            self.transfer(runnable, &starve, fcfs);
            self.stats.starvation_batches += 1;
            return (starve, mode, true);
        }
        // Line 17: what each adapter would pay to be served instead of B_fcfs.
        let mut count = vec![0usize; self.credit.len()];
        let mut in_window = vec![0usize; self.credit.len()];
        let mut first = vec![usize::MAX; self.credit.len()];
        for (i, r) in runnable.iter().enumerate() {
            let a = r.adapter as usize;
            count[a] += 1;
            first[a] = first[a].min(i);
            if i < fcfs.len() {
                in_window[a] += 1;
            }
        }
        let unit = self.cfg.unit();
        let eligible = |a: usize, credit: &[f64]| credit[a] >= (fcfs.len() - in_window[a]) as f64 * unit;
        // The adapter with most requests (ties: the one asked for first).
        let argmax = |only_eligible: bool, credit: &[f64]| {
            (0..count.len())
                .filter(|&a| count[a] > 0 && (!only_eligible || eligible(a, credit)))
                .max_by(|&a, &b| count[a].cmp(&count[b]).then(first[b].cmp(&first[a])))
                .map(|a| a as AdapterId)
        };
        let ratio = |a: AdapterId| count[a as usize] as f64 / fcfs.len() as f64;
        // Algorithm 1.
        let (batch, mode, r_merge) = match self.mode {
            Mode::Unmerged => match argmax(true, &self.credit) {
                Some(a) if ratio(a) > self.alpha => {
                    let merged = self.of_adapter(runnable, a);
                    if self.amortized(runnable, fcfs, a, &merged, fcfs.len() - in_window[a as usize]) {
                        (merged, Mode::Merged(a), Some(a))
                    } else {
                        (fcfs.to_vec(), Mode::Unmerged, Some(a))
                    }
                }
                a => (fcfs.to_vec(), Mode::Unmerged, a),
            },
            Mode::Merged(l) => {
                if ratio(l) < self.beta || !eligible(l as usize, &self.credit) {
                    (fcfs.to_vec(), Mode::Unmerged, Some(l))
                } else {
                    (self.of_adapter(runnable, l), Mode::Merged(l), Some(l))
                }
            }
        };
        // Algorithm 1 ran over the eligible adapters: with none, α decided nothing to learn from.
        if r_merge.is_some() {
            self.record(runnable, fcfs, &batch, mode, r_merge);
        }
        if batch != fcfs {
            self.transfer(runnable, &batch, fcfs);
        }
        (batch, mode, false)
    }

    /// Whether merging `a` into `merged` (its batch, which displaces `displaced` requests of
    /// `fcfs`) can pay for the merge and for the un-merge after it (see the module docs,
    /// "amortised merges"): the merged iterations `a`'s credit covers at this displacement, each
    /// saving what the unmerged FCFS batch would take to do the merged batch's work less what the
    /// merged batch takes, must save more than two switches.
    fn amortized(
        &self,
        runnable: &[Runnable],
        fcfs: &[usize],
        a: AdapterId,
        merged: &[usize],
        displaced: usize,
    ) -> bool {
        if !self.cfg.amortize_switches || displaced == 0 {
            return true;
        }
        let iterations = (self.credit[a as usize] / (displaced as f64 * self.cfg.unit())).floor();
        iterations * self.merged_saving_ms(runnable, a, merged, fcfs) > 2.0 * self.cost.switch_ms
    }

    /// What one iteration of `merged` (adapter `a`'s requests, merged) saves against the
    /// unmerged batch `unmerged`: the time `unmerged` would take for `merged`'s work (sequences
    /// and prompt tokens at their cost-model prices) less the merged iteration's time.
    fn merged_saving_ms(&self, runnable: &[Runnable], a: AdapterId, merged: &[usize], unmerged: &[usize]) -> f64 {
        let (m_ms, u_ms) = (
            self.cost.batch_ms(Mode::Merged(a), runnable, merged),
            self.cost.batch_ms(Mode::Unmerged, runnable, unmerged),
        );
        let (m_work, u_work) = (self.cost.work_ms(runnable, merged), self.cost.work_ms(runnable, unmerged));
        m_work * u_ms / u_work.max(1e-9) - m_ms
    }

    /// Whether to serve the starving requests `merged` (all of one adapter, not merged now)
    /// merged: they must fill a batch as large as `B_fcfs` (a smaller merged batch serves fewer
    /// requests than the unmerged one would), and serving them merged for as long as their
    /// adapter will starve must save more than the switches into and out of that mode. Each
    /// merged starvation iteration saves what the unmerged starvation batch `filled` would take
    /// for the merged batch's work less the merged batch's time, and the adapter starves until
    /// its credit, paying for the `fcfs` requests the merged batch displaces, falls below
    /// `t_normal` (at least this one iteration).
    fn starving_merge_pays(&self, runnable: &[Runnable], fcfs: &[usize], merged: &[usize], filled: &[usize]) -> bool {
        if merged.len() < fcfs.len() {
            return false;
        }
        let a = runnable[merged[0]].adapter;
        let displaced = fcfs.iter().filter(|i| merged.binary_search(i).is_err()).count();
        let above = self.credit[a as usize] - self.cfg.t_normal;
        let iterations =
            if displaced == 0 { f64::INFINITY } else { (above / (displaced as f64 * self.cfg.unit())).ceil().max(1.0) };
        let saving = self.merged_saving_ms(runnable, a, merged, filled);
        let switches = f64::from(self.mode.switch_ops(Mode::Merged(a)) + 1);
        saving > 0.0 && iterations * saving > switches * self.cost.switch_ms
    }

    /// Lines 14 and 21: `1/max_batch` credit to the adapter of every request of `fcfs` not in `served`,
    /// paid evenly by the served requests that jumped the window (or, when none did, by every
    /// served request).
    fn transfer(&mut self, runnable: &[Runnable], served: &[usize], fcfs: &[usize]) {
        let displaced: Vec<usize> = fcfs.iter().copied().filter(|i| served.binary_search(i).is_err()).collect();
        if displaced.is_empty() || served.is_empty() {
            return;
        }
        let jumpers: Vec<usize> = served.iter().copied().filter(|&i| i >= fcfs.len()).collect();
        let payers = if jumpers.is_empty() { served } else { &jumpers[..] };
        let unit = self.cfg.unit();
        let share = displaced.len() as f64 * unit / payers.len() as f64;
        for &i in &displaced {
            self.credit[runnable[i].adapter as usize] += unit;
        }
        for &i in payers {
            self.credit[runnable[i].adapter as usize] -= share;
        }
    }

    /// Algorithm 2's bookkeeping: a break point first if one is due, then this iteration's
    /// actual and would-be throughputs.
    fn record(
        &mut self,
        runnable: &[Runnable],
        fcfs: &[usize],
        batch: &[usize],
        mode: Mode,
        r_merge: Option<AdapterId>,
    ) {
        let merged = matches!(mode, Mode::Merged(_));
        let p = &self.period;
        if p.iters > 0 && (p.merged != merged || p.adapter != r_merge || p.iters >= self.cfg.break_iters) {
            self.tune();
        }
        let merged_batch = match (mode, r_merge) {
            (Mode::Merged(_), _) => batch.to_vec(),
            (Mode::Unmerged, Some(a)) => self.of_adapter(runnable, a),
            (Mode::Unmerged, None) => Vec::new(),
        };
        let m_ms = self.cost.batch_ms(Mode::Merged(r_merge.unwrap_or(0)), runnable, &merged_batch);
        let u_ms = self.cost.batch_ms(Mode::Unmerged, runnable, fcfs);
        let work = |b: &[usize]| b.iter().map(|&i| runnable[i].prompt_tokens.max(1)).sum::<u64>() as f64;
        let (m_work, u_work) = (work(&merged_batch), work(fcfs));
        let p = &mut self.period;
        p.merged = merged;
        p.adapter = r_merge;
        p.iters += 1;
        p.merged_tokens += m_work;
        p.merged_ms += m_ms;
        p.unmerged_tokens += u_work;
        p.unmerged_ms += u_ms;
    }

    /// Algorithm 2 (and its mirror for β) over the period that just ended.
    fn tune(&mut self) {
        let p = std::mem::take(&mut self.period);
        let t_m = self.cost.switch_ms;
        let g = (self.cfg.gamma_dec, self.cfg.gamma_mul);
        if p.merged {
            let t_merge = p.merged_tokens / p.merged_ms.max(1e-9);
            let t_unmerge = p.unmerged_tokens / (p.unmerged_ms + t_m);
            self.beta = if t_unmerge > t_merge { self.beta * g.1 } else { self.beta - g.0 };
        } else {
            let t_merge = p.merged_tokens / (p.merged_ms + t_m);
            let t_unmerge = p.unmerged_tokens / p.unmerged_ms.max(1e-9);
            self.alpha = if t_merge > t_unmerge { self.alpha - g.0 } else { self.alpha * g.1 };
        }
        self.alpha = self.alpha.clamp(0.02, self.cfg.alpha_max);
        self.beta = self.beta.clamp(0.01, self.alpha - 0.01);
        self.stats.tunings += 1;
    }
}
