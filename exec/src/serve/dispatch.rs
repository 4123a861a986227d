//! The router's decisions, sans IO: which instance runs the next queued batch, and how a batch is
//! split while a new instance loads — BlitzScale §5.2's three steps.
//!
//! 1. While the new instance (paired with the old, overloaded one) holds no layer, batches go to
//!    the old one. Once it holds the first layer, the old instance's queue and every new arrival
//!    are redirected through the new one.
//! 2. While it loads, batch `i` runs its first `x_i` layers on new, which WRITEs the activation to
//!    old; old runs the remaining `L − x_i`. The split comes from the policy:
//!    * **stop-the-world** — no cooperation: the new instance serves only once fully loaded;
//!    * **best-effort** — `x` is fixed when the batch is dispatched: the layers resident then, at
//!      most `⌊L/2⌋` (the paper's Figure 12(a));
//!    * **zigzag** — when step 2 begins, the batches queued then are planned together by
//!      [`crate::zigzag::zigzag`] (the paper's setting: `N` batches queued at `t = 0`).
//!      *Departure:* the paper does not say how batches arriving later are split; here they are
//!      split best-effort at dispatch. So are the queued batches beyond the first
//!      [`zigzag::batches_within`]`(L, `[`PLAN_STEPS`]`)`: the exact program grows with the square
//!      of the batches and runs on the router's loop, so a long queue (an overload, exactly when
//!      an instance is scaled) must not hold the router for seconds — 4,096 queued batches of a
//!      32-stage model would take 5.2·10⁸ cells and 1.7·10¹⁰ steps.
//! 3. Once new holds every layer, batches go whole to whichever instance has fewer outstanding.
//!
//! **The entry stage on old** (a departure, for copies packed with their embeddings last, see
//! [`Manifest::with_embeddings_last`](cascade_param_pool::manifest::Manifest::with_embeddings_last)):
//! BlitzScale's LLMs load their small embedding first; a BERT encoder's embedding table is half its
//! bytes and almost none of its compute, so a copy that loads it first can help only in the last
//! half of its load. Packed last, new holds blocks long before its entry stage; while it lacks it,
//! a split batch crosses three segments: old runs the entry stage (stage 0, ahead of its queue),
//! new runs stages `1..x`, old the rest. The split `x` is chosen as above, counting the entry
//! stage as resident (old runs it) and the half as half the blocks (`x ≤ 1 + ⌊(L − 1)/2⌋`);
//! `x ≤ 1` leaves new nothing, and the batch goes to old whole. Zigzag then plans the paper's
//! problem over the blocks (`L − 1` layers, the first block resident when cooperation begins)
//! and adds the entry stage to each split.
//!
//! At most `max_coop` cooperative batches are outstanding (the activation slots of the pair).
//! A batch whose instance fails goes back to its place in the queue: nothing is lost, and since
//! the router answers each request once, nothing is answered twice.

use std::collections::{HashMap, VecDeque};

use crate::zigzag::{self, Instance as Plan};

use super::proto::Split;

cascade_sched::named_enum! {
    /// How batches are split while the new instance loads (`ALL` is the order a comparison
    /// runs them in).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    #[serde(rename_all = "kebab-case")]
    pub enum LivePolicy("policy") {
        /// The new instance serves only once fully loaded.
        StopTheWorld = "stop-the-world",
        /// Each batch's split fixed at dispatch: the resident layers, at most half.
        BestEffort = "best-effort",
        /// The batches queued when cooperation begins planned together (zigzag), later ones
        /// best-effort.
        Zigzag = "zigzag",
    }
}

/// Steps of the exact plan ([`zigzag::dp_steps`]) the router allows itself when cooperation
/// begins: a few milliseconds on one core. At 7 layers that plans the first 315 queued batches, at
/// 32 layers the first 65; the rest are split best-effort at dispatch.
pub const PLAN_STEPS: u64 = 1 << 22;

/// Where a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    /// The batch.
    pub batch: u64,
    /// The instance it is sent to.
    pub to: u32,
    /// Its split, when it cooperates.
    pub split: Option<Split>,
    /// The segment after `split.then`'s, when the batch crosses three (the entry stage on old).
    pub onward: Option<Split>,
}

/// The dispatcher's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DispatchConfig {
    /// The policy.
    pub policy: LivePolicy,
    /// The model's layers (stages).
    pub layers: u32,
    /// The serving instance.
    pub old: u32,
    /// Whole batches outstanding per instance (1 would idle it between batches).
    pub per_instance: usize,
    /// Cooperative batches outstanding at most.
    pub max_coop: usize,
    /// Zigzag's `T`: one layer's load time over one layer's execution time (≥ 1).
    pub load_ratio: u32,
}

#[derive(Debug, Default)]
struct Load {
    whole: usize,
    coop: usize,
    alive: bool,
}

/// The router's state.
#[derive(Debug)]
pub struct Dispatcher {
    cfg: DispatchConfig,
    queue: VecDeque<u64>,
    new: Option<u32>,
    resident: u32,
    after_entry: u32,
    planned: HashMap<u64, u32>,
    weights: HashMap<u64, f64>,
    cooperating: bool,
    load: HashMap<u32, Load>,
    outstanding: HashMap<u64, (u32, bool)>,
}

impl Dispatcher {
    /// Serving from `cfg.old` alone.
    pub fn new(cfg: DispatchConfig) -> Dispatcher {
        let mut load = HashMap::new();
        load.insert(cfg.old, Load { alive: true, ..Load::default() });
        Dispatcher {
            cfg,
            queue: VecDeque::new(),
            new: None,
            resident: 0,
            after_entry: 0,
            planned: HashMap::new(),
            weights: HashMap::new(),
            cooperating: false,
            load,
            outstanding: HashMap::new(),
        }
    }

    /// A batch arrived.
    pub fn arrive(&mut self, batch: u64) {
        self.queue.push_back(batch);
    }

    /// A batch of weight `weight` arrived: zigzag minimises the weighted sum of latencies (an LLM
    /// prefill batch weighs its prompt tokens, BlitzScale §5.2 "Coping with LLM"). Unweighted
    /// batches weigh 1.
    pub fn arrive_weighted(&mut self, batch: u64, weight: f64) {
        self.weights.insert(batch, weight);
        self.queue.push_back(batch);
    }

    /// `node` holds the model too and serves whole batches (another old instance).
    pub fn serving(&mut self, node: u32) {
        self.load.insert(node, Load { alive: true, ..Load::default() });
    }

    /// `node` starts loading the model: it is paired with the old instance.
    pub fn scaling(&mut self, node: u32) {
        self.new = Some(node);
        self.load.insert(node, Load { alive: true, ..Load::default() });
    }

    /// The new instance holds its first `resident` layers.
    pub fn resident(&mut self, resident: u32) {
        self.resident = resident.min(self.cfg.layers);
    }

    /// The new instance holds stages `1..=k` (whether or not it holds stage 0, its entry): while
    /// it lacks its entry stage, split batches cross three segments (see the module docs).
    pub fn after_entry(&mut self, k: u32) {
        self.after_entry = k.min(self.cfg.layers.saturating_sub(1));
    }

    /// Stages of a split batch new can take part in: its resident prefix, or, while its entry
    /// stage is missing, the entry (run on old) and the blocks after it.
    fn usable(&self) -> u32 {
        if self.resident >= 1 || self.after_entry == 0 {
            self.resident
        } else {
            1 + self.after_entry
        }
    }

    /// Batches waiting at the router.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Batches sent and not answered.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// The batch was answered.
    pub fn done(&mut self, batch: u64) {
        self.release(batch);
    }

    /// The batch failed where it was sent: it goes back to its place in the queue (batches are
    /// numbered in arrival order, so it runs before every later one).
    pub fn failed(&mut self, batch: u64) {
        if self.release(batch) {
            let at = self.queue.partition_point(|&b| b < batch);
            self.queue.insert(at, batch);
        }
    }

    /// Whether `node` serves with part of the model (the new instance): any other serves only
    /// with every stage.
    pub fn takes_partial(&self, node: u32) -> bool {
        self.new == Some(node)
    }

    /// `node` is gone: nothing more goes there (its outstanding batches fail on their own).
    pub fn down(&mut self, node: u32) {
        if let Some(l) = self.load.get_mut(&node) {
            l.alive = false;
        }
    }

    /// Whether `node` serves here and is down.
    pub fn is_down(&self, node: u32) -> bool {
        self.load.get(&node).is_some_and(|l| !l.alive)
    }

    /// `node`, down before, answers again (its link came back) holding its first `resident`
    /// stages, and stages `1..=after_entry`: it takes batches again — the new instance with
    /// what it holds now, any other only with every stage. Returns whether it was taken back.
    pub fn up(&mut self, node: u32, resident: u32, after_entry: u32) -> bool {
        let is_new = self.new == Some(node);
        if !self.is_down(node) || (!is_new && resident < self.cfg.layers) {
            return false;
        }
        if is_new {
            self.resident(resident);
            self.after_entry(after_entry);
        }
        if let Some(l) = self.load.get_mut(&node) {
            l.alive = true;
        }
        true
    }

    fn release(&mut self, batch: u64) -> bool {
        let Some((to, coop)) = self.outstanding.remove(&batch) else { return false };
        self.weights.remove(&batch);
        if let Some(l) = self.load.get_mut(&to) {
            if coop {
                l.coop -= 1;
            } else {
                l.whole -= 1;
            }
        }
        true
    }

    fn alive(&self, node: u32) -> bool {
        self.load.get(&node).is_some_and(|l| l.alive)
    }

    /// The next dispatch, if a batch can go anywhere now.
    pub fn next_dispatch(&mut self) -> Option<Dispatch> {
        let &batch = self.queue.front()?;
        let l = self.cfg.layers;
        let old = self.cfg.old;
        let new = self.new.filter(|&n| self.alive(n));
        let d = match new {
            Some(_) if self.resident >= l => self.whole(batch, &self.plain())?,
            Some(n) if self.usable() >= 1 && self.alive(old) && self.cfg.policy != LivePolicy::StopTheWorld => {
                if !self.cooperating {
                    self.cooperating = true;
                    self.plan();
                }
                let coop: usize = self.load.values().map(|l| l.coop).sum();
                if coop >= self.cfg.max_coop {
                    return None;
                }
                // A planned split may name layers still loading: new runs each once it lands.
                let entry_on_old = self.resident == 0;
                // At most half the layers on new: with the entry stage on old, half the blocks.
                let half = if entry_on_old { 1 + (l - 1) / 2 } else { l / 2 };
                let x = self.planned.remove(&batch).unwrap_or(self.usable().min(half));
                if x == 0 || (entry_on_old && x == 1) {
                    Dispatch { batch, to: old, split: None, onward: None }
                } else if entry_on_old {
                    let onward = Some(Split { layers: x, then: old });
                    Dispatch { batch, to: old, split: Some(Split { layers: 1, then: n }), onward }
                } else {
                    Dispatch { batch, to: n, split: Some(Split { layers: x, then: old }), onward: None }
                }
            }
            _ => self.whole(batch, &self.plain())?,
        };
        self.queue.pop_front();
        let coop = self.cooperating && self.resident < l && self.new.is_some_and(|n| self.alive(n));
        self.outstanding.insert(batch, (d.to, coop));
        if let Some(ld) = self.load.get_mut(&d.to) {
            if coop {
                ld.coop += 1;
            } else {
                ld.whole += 1;
            }
        }
        Some(d)
    }

    /// The instances that take whole batches now (every live one but a new one still loading),
    /// each with its batches outstanding, in node order.
    pub fn whole_instances(&self) -> Vec<(u32, usize)> {
        self.plain().into_iter().map(|n| (n, self.load.get(&n).map_or(0, |l| l.whole + l.coop))).collect()
    }

    /// The old instance while a new one still loads (the one its split batches finish on).
    pub fn paired_old(&self) -> Option<u32> {
        self.loading().map(|_| self.cfg.old)
    }

    /// The new instance while it still loads (it lacks some layers).
    fn loading(&self) -> Option<u32> {
        self.new.filter(|_| self.resident < self.cfg.layers)
    }

    /// The instances that take whole batches: every live one but a new one still loading.
    fn plain(&self) -> Vec<u32> {
        let loading = self.loading();
        let mut v: Vec<u32> =
            self.load.iter().filter(|(n, l)| l.alive && Some(**n) != loading).map(|(n, _)| *n).collect();
        v.sort_unstable();
        v
    }

    /// A whole batch to the least loaded live instance among `to`, if one has room.
    fn whole(&self, batch: u64, to: &[u32]) -> Option<Dispatch> {
        let n = to
            .iter()
            .filter(|&&n| self.load.get(&n).is_some_and(|l| l.alive && l.whole + l.coop < self.cfg.per_instance))
            .min_by_key(|&&n| self.load.get(&n).map_or(usize::MAX, |l| l.whole + l.coop))?;
        Some(Dispatch { batch, to: *n, split: None, onward: None })
    }

    /// Zigzag: plans the batches queued now.
    fn plan(&mut self) {
        // With the entry stage on old the problem is the paper's over the blocks: the first block
        // is resident now, the next lands T later, and a batch's split counts the entry stage too.
        let entry_on_old = self.resident == 0;
        let layers = if entry_on_old { self.cfg.layers.saturating_sub(1) } else { self.cfg.layers };
        if self.cfg.policy != LivePolicy::Zigzag || self.queue.is_empty() || layers < 2 {
            return;
        }
        let horizon = zigzag::batches_within(layers, PLAN_STEPS);
        let weights = self.queue.iter().take(horizon).map(|b| self.weights.get(b).copied().unwrap_or(1.0)).collect();
        let inst = Plan { layers, load_ratio: self.cfg.load_ratio.max(1), weights };
        match zigzag::zigzag(&inst) {
            Ok(s) => {
                let x = s.x.into_iter().map(|x| if entry_on_old && x > 0 { x + 1 } else { x });
                self.planned = self.queue.iter().copied().zip(x).collect();
            }
            Err(e) => tracing::warn!(error = %e, "zigzag plan failed; splitting best-effort"),
        }
    }
}

#[cfg(test)]
mod tests;
