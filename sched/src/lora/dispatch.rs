//! dLoRA's proactive mechanism (§5.1) and the cluster's knobs: where adapters are preloaded,
//! where each request goes, and each replica's bounded set of resident adapters.
//!
//! * **Placement** ([`place`]): every adapter on one replica first (the most popular first, each
//!   on the replica with fewest adapters), then replicas of the adapter with the lowest *burst
//!   tolerance* — peak capacity ÷ average load, the peak capacity being the requests the free
//!   KV memory of the replicas holding it can serve — are added greedily, each on the replica
//!   without it that has most free memory, until the minimum burst tolerance would decrease or no
//!   replica has room.
//! * **Routing** ([`route`]): to the replica with the shortest estimated pending time — its
//!   queued work plus the adapter's load time where it is not resident (`proactive`, `dlora`);
//!   or round-robin over the replicas the placement preloaded with the adapter (`rr`).
//!   *Variant* (`route_cost = "artifact"`, [`RouteCost::Artifact`]): the public artifact's
//!   cost instead of the pending time (`EngineManager.get_engine_req_model_cnt`,
//!   `LLMServe/dLoRA-artifact`): per replica, Σ over its adapters of ⌊n_a / B⌋ · 0.6 (a full
//!   merged batch at 60% of an unmerged one's time) plus ⌊Σ_a (n_a mod B) / B⌋, with n_a the
//!   adapter's requests there and B the largest batch, plus the adapter's load time in seconds
//!   where it is not resident; the lowest cost wins, the first replica on ties. Below B
//!   requests per replica every cost is 0, so the first candidate takes everything — the
//!   imbalance the artifact's periodic migration then corrects. Kept beside ours to compare
//!   against what the paper measured, not as a recommendation.
//!   Under that cost the candidates are the artifact's too (`select_engine`): the replicas
//!   holding the adapter (`rr` is then its `DISPATCH_ONLY` mode, which its Figure 11 runs as
//!   round-robin: the cost over the holders, not a rotation), and under `proactive` (its
//!   `DISPATCH_MIG` mode) also a replica that holds another adapter with no request queued
//!   there and a replica elsewhere, which it swaps out for the request's (the lowest such id;
//!   the artifact takes the first in its mapping's order); `dlora` (its `PERIOD_MIG`) routes to
//!   holders only and leaves the rest to migration. With no holder, the replica with fewest
//!   requests.
//! * **Artifact placement** ([`Placement::Artifact`], [`place_artifact`]): the public
//!   artifact's start (`find_best_lora_weight_schedule(is_init=True)`), which does not know the
//!   workload: the greedy above over *equal* shares — each adapter once, adapter `a` on replica
//!   `a mod G` — then replicas added until there are `G + M − 1` of them (G replicas, M
//!   adapters): round-robin over replicas and adapters in its dispatch-only and substitution
//!   modes (adapters 1, 2, … gain a second replica), every one of one adapter drawn at random in
//!   its periodic-migration mode. The paper calls its placement workload-aware; the artifact's
//!   learns the workload only from the requests it sees and re-places after a migration, which
//!   the variant does not model (its migration loads adapters where the plan moves requests).
//!   A replica takes at most `min(max_adapters_per_replica, M)` adapters (the artifact: M).
//! * **Swapping** ([`AdapterSet`]): at most `max_adapters_per_replica` adapters on a replica
//!   (16 in the artifact); loading one evicts the least recently used adapter no queued request
//!   needs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{AdapterId, CostModel};

crate::named_enum! {
    /// How requests are routed across replicas.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum Dispatch("dispatch") {
        /// Round-robin over the replicas preloaded with the adapter (under the artifact's
        /// routing cost, its dispatch-only mode: the cheapest of them).
        Rr = "rr",
        /// Shortest estimated pending time, loading adapters where needed; no migration.
        Proactive = "proactive",
        /// `proactive` plus reactive request–adapter co-migration (§5.2).
        Dlora = "dlora",
    }
}

crate::named_enum! {
    /// What `proactive` and `dlora` routing minimise (see the module docs).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum RouteCost("route cost") {
        /// The estimated pending time (ours).
        #[default]
        Pending = "pending",
        /// The public artifact's batch-count cost.
        Artifact = "artifact",
    }
}

crate::named_enum! {
    /// Where adapters start (see the module docs).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum Placement("placement") {
        /// Burst-tolerance placement over the workload's shares ([`place`], §5.1).
        #[default]
        Burst = "burst",
        /// The public artifact's start, blind to the workload ([`place_artifact`]).
        Artifact = "artifact",
    }
}

/// How [`place_artifact`] adds replicas beyond one per adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArtifactFill {
    /// Round-robin over replicas and adapters (the artifact's dispatch-only and
    /// dispatch-with-substitution modes).
    Sequential,
    /// Every further replica is of this adapter (its periodic-migration mode, which draws the
    /// adapter at random).
    Spread(AdapterId),
}

/// Dispatch and migration parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// How requests are routed.
    pub dispatch: Dispatch,
    /// What `proactive` and `dlora` routing minimise.
    pub route_cost: RouteCost,
    /// Where adapters start.
    pub placement: Placement,
    /// Most adapters resident on one replica.
    pub max_adapters_per_replica: usize,
    /// The monitor's period, ms.
    pub monitor_ms: f64,
    /// Migration trigger: the fullest replica's KV use at least this while another's is below.
    pub kv_trigger: f64,
    /// Migration trigger: a replica with this many requests more than the average.
    pub queue_trigger: usize,
    /// Replicas considered on each side (top-K overloaded × top-K underloaded).
    pub top_k: usize,
    /// The affinity penalty η per adapter a replica gains, ms; `None`: the adapter load time.
    pub eta_ms: Option<f64>,
    /// Host-swap bandwidth B for KV beyond a replica's memory, bytes per ms (PCIe 4.0: 25 GB/s):
    /// the co-migration plan's price for overflowing a replica. The simulator has no host swap —
    /// it preempts by recomputation — so a scenario that wants plans to keep within memory
    /// prices it prohibitively (`lora_8gpu.toml`: 1000 bytes/ms).
    pub swap_bytes_per_ms: f64,
    /// Relax request variables to [0, 1] and round each to its largest entry (the paper's
    /// relaxation); `false` solves the exact ILP.
    pub relax: bool,
    /// The solver's time budget, ms; the greedy plan is used when it runs out.
    pub solve_budget_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            dispatch: Dispatch::Dlora,
            route_cost: RouteCost::Pending,
            placement: Placement::Burst,
            max_adapters_per_replica: 16,
            monitor_ms: 200.0,
            kv_trigger: 0.9,
            queue_trigger: 16,
            top_k: 2,
            eta_ms: None,
            swap_bytes_per_ms: 25e6,
            relax: true,
            solve_budget_ms: 200,
        }
    }
}

impl ClusterConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_adapters_per_replica == 0 || self.top_k == 0 {
            return Err("cluster: max_adapters_per_replica and top_k must be ≥ 1".into());
        }
        if !(self.monitor_ms > 0.0 && self.swap_bytes_per_ms > 0.0 && (0.0..=1.0).contains(&self.kv_trigger)) {
            return Err("cluster: need monitor_ms > 0, swap_bytes_per_ms > 0, 0 ≤ kv_trigger ≤ 1".into());
        }
        Ok(())
    }
}

/// Burst-tolerance placement: which adapters each of `replicas` preloads. `shares` is each
/// adapter's share of the load; `mean_tokens` a request's mean KV tokens.
pub fn place(
    shares: &[f64],
    replicas: usize,
    cap: usize,
    cost: &CostModel,
    mean_tokens: f64,
) -> Result<Vec<Vec<AdapterId>>, String> {
    if shares.len() > replicas * cap {
        return Err(format!("{} adapters do not fit {replicas} replicas of {cap} adapters", shares.len()));
    }
    let mut on: Vec<Vec<AdapterId>> = vec![Vec::new(); replicas];
    let mut order: Vec<usize> = (0..shares.len()).collect();
    order.sort_by(|&a, &b| shares[b].total_cmp(&shares[a]).then(a.cmp(&b)));
    for a in order {
        let j = (0..replicas).min_by_key(|&j| (on[j].len(), j)).unwrap_or(0);
        on[j].push(a as AdapterId);
    }
    let adapter_tokens = cost.adapter_bytes as f64 / cost.kv_bytes_per_token as f64;
    let free = |on: &[Vec<AdapterId>], j: usize| {
        (cost.kv_capacity_tokens as f64 - on[j].len() as f64 * adapter_tokens).max(0.0)
    };
    let tolerance = |on: &[Vec<AdapterId>], a: usize| {
        if shares[a] <= 0.0 {
            return f64::INFINITY;
        }
        let cap: f64 = (0..replicas).filter(|&j| on[j].contains(&(a as AdapterId))).map(|j| free(on, j)).sum();
        cap / mean_tokens.max(1.0) / shares[a]
    };
    let min_tolerance =
        |on: &[Vec<AdapterId>]| (0..shares.len()).map(|a| tolerance(on, a)).fold(f64::INFINITY, f64::min);
    loop {
        let current = min_tolerance(&on);
        let Some(a) = (0..shares.len()).min_by(|&x, &y| tolerance(&on, x).total_cmp(&tolerance(&on, y))) else {
            break;
        };
        let target = (0..replicas)
            .filter(|&j| on[j].len() < cap && !on[j].contains(&(a as AdapterId)))
            .max_by(|&x, &y| free(&on, x).total_cmp(&free(&on, y)).then(y.cmp(&x)));
        let Some(j) = target else { break };
        on[j].push(a as AdapterId);
        if min_tolerance(&on) < current {
            on[j].pop();
            break;
        }
    }
    Ok(on)
}

/// The public artifact's initial placement of `adapters` adapters on `replicas` replicas of at
/// most `cap` adapters each (see the module docs).
pub fn place_artifact(
    adapters: usize,
    replicas: usize,
    cap: usize,
    fill: ArtifactFill,
) -> Result<Vec<Vec<AdapterId>>, String> {
    if adapters > replicas * cap || replicas == 0 {
        return Err(format!("{adapters} adapters do not fit {replicas} replicas of {cap} adapters"));
    }
    if let ArtifactFill::Spread(x) = fill {
        if x as usize >= adapters {
            return Err(format!("adapter {x} to spread is not one of the {adapters} adapters"));
        }
    }
    let mut on: Vec<Vec<AdapterId>> = vec![Vec::new(); replicas];
    for a in 0..adapters {
        on[a % replicas].push(a as AdapterId);
    }
    let room = cap.min(adapters);
    let target = (replicas + adapters).saturating_sub(1);
    let spread = match fill {
        ArtifactFill::Spread(x) => Some(x),
        ArtifactFill::Sequential => None,
    };
    let (mut j, mut next) = (0, 0);
    for _ in adapters..target {
        let fits = |k: usize| on[k].len() < room && spread.is_none_or(|x| !on[k].contains(&x));
        let Some(k) = (0..replicas).map(|d| (j + d) % replicas).find(|&k| fits(k)) else { break };
        // A replica with room lacks some adapter, since it holds fewer than all of them.
        let a = match spread {
            Some(x) => x,
            None => match (0..adapters).map(|d| ((next + d) % adapters) as AdapterId).find(|a| !on[k].contains(a)) {
                Some(a) => a,
                None => break,
            },
        };
        on[k].push(a);
        j = (k + 1) % replicas;
        next = (a as usize + 1) % adapters;
    }
    Ok(on)
}

/// The replica of lowest cost for a request of an adapter: `cost[j]` (ours: the estimated
/// pending time, ms; or the artifact's cost, [`artifact_cost`]), plus `load` where the adapter is
/// not resident. Only replicas where it is resident or can be loaded (`loadable`) are
/// candidates, the first of them on ties (as the artifact's strict `<` picks); `None` when there
/// is none.
pub fn route(cost: &[f64], resident: &[bool], loadable: &[bool], load: f64) -> Option<usize> {
    (0..cost.len()).filter(|&j| resident[j] || loadable[j]).min_by(|&a, &b| {
        let t = |j: usize| cost[j] + if resident[j] { 0.0 } else { load };
        t(a).total_cmp(&t(b)).then(a.cmp(&b))
    })
}

/// The artifact's substitution on replica `j` for a request of adapter `a` (`DISPATCH_MIG`; see
/// the module docs): an adapter resident there (`resident[j]`) other than `a`, with no request
/// queued there (`needed[j]`, sorted) and resident on another replica too — the lowest such id.
pub fn substitute(resident: &[Vec<AdapterId>], needed: &[Vec<AdapterId>], j: usize, a: AdapterId) -> Option<AdapterId> {
    resident
        .get(j)?
        .iter()
        .copied()
        .filter(|&b| {
            b != a
                && needed.get(j).is_none_or(|n| n.binary_search(&b).is_err())
                && resident.iter().enumerate().any(|(k, r)| k != j && r.contains(&b))
        })
        .min()
}

/// The artifact's cost of a replica whose requests per adapter are `counts`, with batches of at
/// most `max_batch` (see the module docs).
pub fn artifact_cost(counts: impl IntoIterator<Item = usize>, max_batch: usize) -> f64 {
    let b = max_batch.max(1);
    let (mut cost, mut rest) = (0.0, 0);
    for n in counts {
        cost += (n / b) as f64 * 0.6;
        rest += n % b;
    }
    cost + (rest / b) as f64
}

/// A replica's resident adapters, bounded, least recently used evicted first.
#[derive(Debug, Clone, Default)]
pub struct AdapterSet {
    cap: usize,
    /// Adapter → (last use, ready at), ms.
    on: BTreeMap<AdapterId, (f64, f64)>,
}

impl AdapterSet {
    /// A set of at most `cap` adapters holding `preloaded` (ready at time 0).
    pub fn new(cap: usize, preloaded: &[AdapterId]) -> AdapterSet {
        AdapterSet { cap, on: preloaded.iter().map(|&a| (a, (0.0, 0.0))).collect() }
    }

    /// Whether `a` is resident (possibly still loading).
    pub fn contains(&self, a: AdapterId) -> bool {
        self.on.contains_key(&a)
    }

    /// When `a` is ready, if resident.
    pub fn ready_at(&self, a: AdapterId) -> Option<f64> {
        self.on.get(&a).map(|v| v.1)
    }

    /// Resident adapters.
    pub fn adapters(&self) -> Vec<AdapterId> {
        self.on.keys().copied().collect()
    }

    /// Records a use of `a` at `now`.
    pub fn touch(&mut self, a: AdapterId, now: f64) {
        if let Some(v) = self.on.get_mut(&a) {
            v.0 = v.0.max(now);
        }
    }

    /// Drops `a` (the artifact's substitution); whether it was resident.
    pub fn remove(&mut self, a: AdapterId) -> bool {
        self.on.remove(&a).is_some()
    }

    /// Whether `a` could be loaded now: room, or an adapter `needed` says no request needs.
    pub fn can_load(&self, needed: impl Fn(AdapterId) -> bool) -> bool {
        self.on.len() < self.cap || self.on.keys().any(|&a| !needed(a))
    }

    /// Loads `a` (ready at `ready`), evicting the least recently used adapter no request needs
    /// when full; returns the evicted one. Beyond the bound only if every resident adapter is
    /// needed (the caller checked [`AdapterSet::can_load`] where that matters).
    pub fn load(
        &mut self,
        a: AdapterId,
        now: f64,
        ready: f64,
        needed: impl Fn(AdapterId) -> bool,
    ) -> Option<AdapterId> {
        let mut evicted = None;
        if self.on.len() >= self.cap {
            evicted = self
                .on
                .iter()
                .filter(|(&k, _)| !needed(k))
                .min_by(|x, y| x.1 .0.total_cmp(&y.1 .0).then(x.0.cmp(y.0)))
                .map(|(&k, _)| k);
            if let Some(k) = evicted {
                self.on.remove(&k);
            }
        }
        self.on.insert(a, (now, ready));
        evicted
    }
}
