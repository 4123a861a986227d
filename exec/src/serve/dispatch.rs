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
//!      split best-effort at dispatch.
//! 3. Once new holds every layer, batches go whole to whichever instance has fewer outstanding.
//!
//! At most `max_coop` cooperative batches are outstanding (the activation slots of the pair).
//! A batch whose instance fails goes back to its place in the queue: nothing is lost, and since
//! the router answers each request once, nothing is answered twice.

use std::collections::{HashMap, VecDeque};

use crate::zigzag::{self, Instance as Plan};

use super::proto::Split;

/// How batches are split while the new instance loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LivePolicy {
    /// The new instance serves only once fully loaded.
    StopTheWorld,
    /// Each batch's split fixed at dispatch: the resident layers, at most half.
    BestEffort,
    /// The batches queued when cooperation begins planned together (zigzag), later ones
    /// best-effort.
    Zigzag,
}

impl LivePolicy {
    /// Every policy, in the order a comparison runs them.
    pub const ALL: [LivePolicy; 3] = [LivePolicy::StopTheWorld, LivePolicy::BestEffort, LivePolicy::Zigzag];

    /// The policy's name (what [`std::str::FromStr`] reads).
    pub fn name(self) -> &'static str {
        match self {
            LivePolicy::StopTheWorld => "stop-the-world",
            LivePolicy::BestEffort => "best-effort",
            LivePolicy::Zigzag => "zigzag",
        }
    }
}

impl std::fmt::Display for LivePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LivePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        LivePolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown policy {s:?} (stop-the-world, best-effort, zigzag)"))
    }
}

/// Where a batch goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    /// The batch.
    pub batch: u64,
    /// The instance it is sent to.
    pub to: u32,
    /// Its split, when it cooperates.
    pub split: Option<Split>,
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

    /// `node` is gone: nothing more goes there (its outstanding batches fail on their own).
    pub fn down(&mut self, node: u32) {
        if let Some(l) = self.load.get_mut(&node) {
            l.alive = false;
        }
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
            Some(n) if self.resident >= 1 && self.alive(old) && self.cfg.policy != LivePolicy::StopTheWorld => {
                if !self.cooperating {
                    self.cooperating = true;
                    self.plan();
                }
                let coop: usize = self.load.values().map(|l| l.coop).sum();
                if coop >= self.cfg.max_coop {
                    return None;
                }
                // A planned split may name layers still loading: new runs each once it lands.
                let x = self.planned.remove(&batch).unwrap_or(self.resident.min(l / 2));
                if x == 0 {
                    Dispatch { batch, to: old, split: None }
                } else {
                    Dispatch { batch, to: n, split: Some(Split { layers: x, then: old }) }
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

    /// The instances that take whole batches: every live one but a new one still loading.
    fn plain(&self) -> Vec<u32> {
        let loading = self.new.filter(|_| self.resident < self.cfg.layers);
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
        Some(Dispatch { batch, to: *n, split: None })
    }

    /// Zigzag: plans the batches queued now.
    fn plan(&mut self) {
        if self.cfg.policy != LivePolicy::Zigzag || self.queue.is_empty() || self.cfg.layers < 2 {
            return;
        }
        let weights = self.queue.iter().map(|b| self.weights.get(b).copied().unwrap_or(1.0)).collect();
        let inst = Plan { layers: self.cfg.layers, load_ratio: self.cfg.load_ratio.max(1), weights };
        match zigzag::zigzag(&inst) {
            Ok(s) => self.planned = self.queue.iter().copied().zip(s.x).collect(),
            Err(e) => tracing::warn!(error = %e, "zigzag plan failed; splitting best-effort"),
        }
    }
}

#[cfg(test)]
mod tests;
