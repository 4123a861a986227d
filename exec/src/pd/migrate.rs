//! dLoRA's reactive request–adapter co-migration (seed `002_…`, §5.2) over real decode instances:
//! the router's monitor asks each decode instance for its load (`Load`), and when a trigger fires
//! it builds the co-migration problem of [`cascade_sched::lora::migrate`] for the top-K
//! overloaded × top-K underloaded instances, solves it (`good_lp` on `microlp`, the greedy plan as
//! fallback and bound, the result checked), and carries the moves out: pages reserved on the new
//! instance, then `Migrate` to the old one, which hands the request over between two decode
//! steps — its KV by one-sided WRITEs, its adapter by a WRITE when the new instance lacks it.
//!
//! [`plan`] is the decision, sans IO (the same trigger and problem as the simulator's monitor in
//! `cascade_sched::lora::sim`); [`rebalance`] is the IO around it.
//!
//! **Departures, stated.** Every running request on an overloaded instance may move (the
//! simulator, like the paper, excludes the requests in the running batch; here a request is
//! handed over between two steps, so none is mid-iteration). A request's remaining time is its
//! remaining tokens × the instance's step time per request (the cost model's `per_seq_ms` plus
//! its share of `base_ms`), which is the linear model the paper's ILP uses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_sched::lora::dispatch::ClusterConfig;
use cascade_sched::lora::migrate::{MigProblem, MigReplica, MigRequest, PlanSource};
use cascade_sched::lora::CostModel;
use cascade_transport::{Mesh, NodeId, ServiceExt};

use super::kv::KvLayout;
use super::proto::{LlmMsg, ReqLoad};
use crate::serve::ServeError;

/// One decode instance's load, as it answered `Load`.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceLoad {
    /// The instance.
    pub node: NodeId,
    /// Its running requests.
    pub requests: Vec<ReqLoad>,
    /// The adapters it serves.
    pub adapters: Vec<u32>,
    /// Pages of its KV region (0 before it exists).
    pub kv_pages: u32,
    /// Free pages of it.
    pub free_pages: u32,
}

impl InstanceLoad {
    /// Fraction of its KV region in use.
    pub fn kv_use(&self) -> f64 {
        if self.kv_pages == 0 {
            0.0
        } else {
            1.0 - f64::from(self.free_pages) / f64::from(self.kv_pages)
        }
    }
}

/// A move the plan asks for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Move {
    /// The request.
    pub req: u64,
    /// Its adapter.
    pub adapter: u32,
    /// The instance it leaves.
    pub from: NodeId,
    /// The instance it goes to.
    pub to: NodeId,
    /// Tokens its KV cache will need there (so far and to come).
    pub tokens: u32,
}

/// A monitor decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Why the monitor acted.
    pub trigger: String,
    /// The solved problem's plan: objective, the objective with nothing moved, who produced it.
    pub objective_ms: f64,
    /// The objective with nothing moved.
    pub stay_ms: f64,
    /// ILP or greedy.
    pub source: PlanSource,
    /// Solver time.
    pub solve_ms: f64,
    /// Why the solver's plan was not used, when it was not.
    pub solver_note: Option<String>,
    /// The moves.
    pub moves: Vec<Move>,
}

/// Which trigger fires, if any: the fullest instance's KV use ≥ `kv_trigger` while another's is
/// below, or an instance with `queue_trigger` requests more than the average.
pub fn trigger(loads: &[InstanceLoad], c: &ClusterConfig) -> Option<String> {
    if loads.len() < 2 {
        return None;
    }
    let kv: Vec<f64> = loads.iter().map(InstanceLoad::kv_use).collect();
    let (kv_max, kv_min) = kv.iter().fold((0.0f64, f64::INFINITY), |(a, b), &x| (a.max(x), b.min(x)));
    if kv_max >= c.kv_trigger && kv_min < c.kv_trigger {
        return Some(format!("KV use {kv_max:.2} on the fullest instance, {kv_min:.2} on the emptiest"));
    }
    let q: Vec<f64> = loads.iter().map(|l| l.requests.len() as f64).collect();
    let mean = q.iter().sum::<f64>() / q.len() as f64;
    let (i, max) = q.iter().copied().enumerate().fold((0, 0.0), |b, (i, x)| if x > b.1 { (i, x) } else { b });
    (max - mean >= c.queue_trigger as f64)
        .then(|| format!("node {} runs {max} requests, {:.1} above the average", loads[i].node, max - mean))
}

/// The monitor's decision for `loads`, or `None` when no trigger fires. `layout` sizes KV in
/// bytes; `cost` gives the step time, the migration bandwidth and the adapter's size and load
/// time. With `router`, only that router's requests move; the others' count as load where they
/// are (dLoRA has one cluster-wide monitor; a router here moves only what its own state follows).
pub fn plan(
    loads: &[InstanceLoad],
    c: &ClusterConfig,
    cost: &CostModel,
    layout: &KvLayout,
    router: Option<NodeId>,
) -> Option<Decision> {
    let why = trigger(loads, c)?;
    let n = loads.len();
    let step_ms = |running: usize| cost.base_ms / running.max(1) as f64 + cost.per_seq_ms;
    let pending: Vec<f64> = loads
        .iter()
        .map(|l| l.requests.iter().map(|r| f64::from(r.remaining) * step_ms(l.requests.len())).sum())
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| pending[b].total_cmp(&pending[a]).then(a.cmp(&b)));
    let k = c.top_k.min(n / 2).max(1);
    let over = &order[..k];
    let members: Vec<usize> = over.iter().chain(&order[n - k..]).copied().collect();
    let kv_bytes = |tokens: u32| layout.pages_for(tokens as usize) as f64 * layout.page_bytes() as f64;
    let (mut requests, mut ids, mut replicas) = (Vec::new(), Vec::new(), Vec::new());
    for (pi, &j) in members.iter().enumerate() {
        let l = &loads[j];
        let (mut base_ms, mut base_mem) = (0.0, 0.0);
        for r in &l.requests {
            let exec_ms = f64::from(r.remaining) * step_ms(l.requests.len());
            let mem = kv_bytes(r.tokens.saturating_add(r.remaining));
            if over.contains(&j) && router.is_none_or(|me| r.router == me) {
                let move_ms = kv_bytes(r.tokens) / cost.migrate_bytes_per_ms;
                requests.push(MigRequest { adapter: r.adapter, from: pi, exec_ms, mem_bytes: mem, move_ms });
                ids.push((j, r));
            } else {
                base_ms += exec_ms;
                base_mem += mem;
            }
        }
        let capacity = f64::from(l.kv_pages) * layout.page_bytes() as f64;
        replicas.push(MigReplica { base_ms, base_mem, capacity, resident: l.adapters.clone() });
    }
    let problem = MigProblem {
        requests,
        replicas,
        adapter_bytes: cost.adapter_bytes as f64,
        eta_ms: c.eta_ms.unwrap_or(cost.adapter_load_ms),
        swap_bytes_per_ms: c.swap_bytes_per_ms,
    };
    let p = problem.solve(c.relax, Duration::from_millis(c.solve_budget_ms));
    let moves =
        p.to.iter()
            .zip(&ids)
            .filter(|(&to, (j, _))| members[to] != *j)
            .map(|(&to, (j, r))| Move {
                req: r.req,
                adapter: r.adapter,
                from: loads[*j].node,
                to: loads[members[to]].node,
                tokens: r.tokens.saturating_add(r.remaining),
            })
            .collect();
    Some(Decision {
        trigger: why,
        objective_ms: p.objective,
        stay_ms: p.stay_objective,
        source: p.source,
        solve_ms: p.solve_ms,
        solver_note: p.solver_note,
        moves,
    })
}

/// What a co-migration round works with: the trigger, top-K and solver settings, the cost model
/// (step time, migration bandwidth, adapter size) and the instances' KV pages.
#[derive(Debug, Clone)]
pub struct RebalanceConfig {
    /// Trigger, top-K and solver settings.
    pub cluster: ClusterConfig,
    /// Step time, migration bandwidth, adapter size.
    pub cost: CostModel,
    /// The instances' KV pages.
    pub layout: KvLayout,
}

/// What one [`rebalance`] did.
#[derive(Debug, Clone)]
pub struct Rebalance {
    /// The loads it saw.
    pub loads: Vec<InstanceLoad>,
    /// The decision, when a trigger fired.
    pub decision: Option<Decision>,
    /// Each move's outcome: tokens generated before it, or why it did not happen (the request
    /// then decodes where it was).
    pub outcomes: Vec<(Move, Result<u32, String>)>,
    /// The whole round, monitor to last move.
    pub seconds: f64,
}

/// One monitor round over the decode instances `decode`: loads, [`plan`] (moving this router's
/// requests only), and the moves, one after another. The solver's time and each move's outcome
/// go to the router node's metrics (`cascade_lora_migration_solve_seconds`,
/// `cascade_lora_migrations_total{result}`).
pub async fn rebalance(
    mesh: &Arc<dyn Mesh>,
    decode: &[NodeId],
    rc: &RebalanceConfig,
    timeout: Duration,
) -> Result<Rebalance, ServeError> {
    let t0 = Instant::now();
    let mut loads = Vec::with_capacity(decode.len());
    for &node in decode {
        loads.push(load(mesh, node, timeout).await?);
    }
    let decision = plan(&loads, &rc.cluster, &rc.cost, &rc.layout, Some(mesh.node()));
    let metrics = mesh.metrics();
    let mut outcomes = Vec::new();
    if let Some(d) = &decision {
        metrics
            .histogram("cascade_lora_migration_solve_seconds", "Time to solve a co-migration plan", &[])
            .observe(d.solve_ms / 1e3);
        for m in &d.moves {
            let r = move_one(mesh, m, timeout).await;
            let result = if r.is_ok() { "moved" } else { "failed" };
            metrics
                .counter("cascade_lora_migrations", "Requests co-migrated with their adapters", &[("result", result)])
                .inc();
            outcomes.push((m.clone(), r.map_err(|e| e.to_string())));
        }
    }
    Ok(Rebalance { loads, decision, outcomes, seconds: t0.elapsed().as_secs_f64() })
}

/// A request a [`drain`] moved: where to, and the tokens generated before.
pub type Moved = (NodeId, u32);

/// What one [`drain`] did.
#[derive(Debug, Clone)]
pub struct Drain {
    /// The instance that leaves.
    pub from: NodeId,
    /// Each request's outcome: where it went and the tokens generated before, or why it stayed
    /// (it is then aborted when the instance stops, and redone from its prompt).
    pub outcomes: Vec<(u64, Result<Moved, String>)>,
    /// The whole drain.
    pub seconds: f64,
}

impl Drain {
    /// Requests moved.
    pub fn moved(&self) -> usize {
        self.outcomes.iter().filter(|(_, o)| o.is_ok()).count()
    }
}

/// Moves every request decoding on `from`, an instance that leaves (`LlmMsg::Leaving`: a
/// scale-in), to the decode instances `to`, with its KV (and its adapter when the new instance
/// lacks it), the same way a co-migration moves one — so that the tokens generated so far are
/// kept instead of being redone from the prompt. It follows the instance until it stops (its
/// `Load` fails) or `until` has passed: a request whose reservation there starts meanwhile (its
/// prefill was under way) moves too. Requests holding the most tokens go first (a redo would
/// cost them most); each goes to the instance with the fewest requests (then the most free
/// pages) that grants it room, the next one when it has none; a request none took is tried
/// again a little later (a target briefly unreachable), a few times at most. `moved` hears
/// of each move as it completes. An instance of `to` that does not answer `Load` is left out.
/// Only this router's requests move (`ReqLoad::router`): each router the instance told it
/// leaves drains its own, whose state follows the move.
/// Not in the papers: dLoRA migrates to balance load; this empties an instance with the same
/// mechanism.
pub async fn drain(
    mesh: &Arc<dyn Mesh>,
    (from, to): (NodeId, &[NodeId]),
    (timeout, every, until): (Duration, Duration, Duration),
    moved: impl Fn(u64, NodeId),
) -> Drain {
    let t0 = Instant::now();
    let mut targets = Vec::new();
    for &node in to.iter().filter(|&&n| n != from) {
        match load(mesh, node, timeout).await {
            Ok(l) => targets.push(Target { node, running: l.requests.len(), free_pages: l.free_pages }),
            Err(e) => tracing::warn!(node, error = %e, "a decode instance left out of the drain"),
        }
    }
    let metrics = mesh.metrics();
    // A request moved is done; one whose move failed (its target briefly unreachable, no room
    // yet) is tried again after RETRY_AFTER, MOVE_TRIES times at most.
    let mut tried: std::collections::HashMap<u64, (u32, Instant)> = std::collections::HashMap::new();
    let mut outcomes: std::collections::BTreeMap<u64, Result<Moved, String>> = std::collections::BTreeMap::new();
    let mine = mesh.node();
    while t0.elapsed() < until {
        let Ok(InstanceLoad { requests, .. }) = load(mesh, from, timeout).await else { break };
        let now = Instant::now();
        let due = |r: &ReqLoad| match (outcomes.get(&r.req), tried.get(&r.req)) {
            (Some(Ok(_)), _) => false,
            (_, Some(&(n, at))) => n < MOVE_TRIES && now >= at,
            _ => true,
        };
        let mut fresh: Vec<ReqLoad> = requests.into_iter().filter(|r| r.router == mine && due(r)).collect();
        if fresh.is_empty() {
            tokio::time::sleep(every).await;
            continue;
        }
        fresh.sort_by(|a, b| b.tokens.cmp(&a.tokens).then(a.req.cmp(&b.req)));
        for r in fresh {
            let n = tried.get(&r.req).map_or(0, |t| t.0) + 1;
            tried.insert(r.req, (n, Instant::now() + RETRY_AFTER));
            let mut last = String::from("no decode instance to move it to");
            let mut went = None;
            for i in order(&targets) {
                let m = Move {
                    req: r.req,
                    adapter: r.adapter,
                    from,
                    to: targets[i].node,
                    tokens: r.tokens.saturating_add(r.remaining),
                };
                match move_one(mesh, &m, timeout).await {
                    Ok(tokens) => {
                        targets[i].running += 1;
                        moved(r.req, m.to);
                        went = Some((m.to, tokens));
                        break;
                    }
                    Err(e) => last = format!("to node {}: {e} (try {n} of {MOVE_TRIES})", m.to),
                }
            }
            let result = if went.is_some() { "moved" } else { "failed" };
            let help = "Moves of requests off decode instances that left, by result (a failed one is tried again)";
            metrics.counter("cascade_llm_drained", help, &[("result", result)]).inc();
            outcomes.insert(r.req, went.ok_or(last));
        }
    }
    let outcomes = outcomes.into_iter().collect();
    Drain { from, outcomes, seconds: t0.elapsed().as_secs_f64() }
}

/// How many times a drain tries to move one request.
const MOVE_TRIES: u32 = 5;
/// How long a drain waits before it tries a failed move again.
const RETRY_AFTER: Duration = Duration::from_millis(250);

/// A decode instance a drain may move requests to, as its `Load` said and the drain's moves
/// since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Target {
    node: NodeId,
    running: usize,
    free_pages: u32,
}

/// The order a drain tries `targets` in for its next request (indices): fewest requests first,
/// then most free pages, then the lowest node.
fn order(targets: &[Target]) -> Vec<usize> {
    let mut o: Vec<usize> = (0..targets.len()).collect();
    o.sort_by_key(|&i| (targets[i].running, std::cmp::Reverse(targets[i].free_pages), targets[i].node));
    o
}

/// Decode instance `node`'s load (`Load`).
async fn load(mesh: &Arc<dyn Mesh>, node: NodeId, timeout: Duration) -> Result<InstanceLoad, ServeError> {
    match mesh.call(node, &LlmMsg::Load, timeout).await? {
        LlmMsg::Loads { requests, adapters, kv_pages, free_pages } => {
            Ok(InstanceLoad { node, requests, adapters, kv_pages, free_pages })
        }
        other => Err(other.unexpected_from(node)),
    }
}

/// Pages on the new instance, then `Migrate` on the old one; the pages are released when the
/// move fails.
async fn move_one(mesh: &Arc<dyn Mesh>, m: &Move, timeout: Duration) -> Result<u32, ServeError> {
    let kv = match mesh.call(m.to, &LlmMsg::Reserve { req: m.req, tokens: m.tokens }, timeout).await? {
        LlmMsg::Reserved { grant } => grant,
        other => return Err(other.unexpected_from(m.to)),
    };
    let lease = kv.lease;
    let answer = mesh.call(m.from, &LlmMsg::Migrate { req: m.req, kv }, timeout).await;
    match answer {
        Ok(LlmMsg::Migrated { tokens, .. }) => Ok(tokens),
        other => {
            let _ = mesh.call(m.to, &LlmMsg::Release { req: m.req, lease }, timeout).await;
            match other {
                Ok(a) => Err(a.unexpected_from(m.from)),
                Err(e) => Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pd::proto::KvGrant;

    fn load(node: NodeId, reqs: &[(u64, u32)], adapters: &[u32]) -> InstanceLoad {
        InstanceLoad {
            node,
            requests: reqs
                .iter()
                .map(|&(req, adapter)| ReqLoad { req, adapter, tokens: 20, remaining: 20, router: 0 })
                .collect(),
            adapters: adapters.to_vec(),
            kv_pages: 64,
            free_pages: 64 - 2 * reqs.len() as u32,
        }
    }

    fn layout() -> KvLayout {
        KvLayout { blocks: 2, kv_heads: 1, head_dim: 4, page_tokens: 16 }
    }

    #[test]
    fn nothing_moves_without_a_trigger_and_the_busy_instance_sheds_load_with_one() {
        let c = ClusterConfig { queue_trigger: 2, ..ClusterConfig::default() };
        let cost = CostModel::cpu_smollm2();
        let even = [load(1, &[(1, 1), (2, 2)], &[1, 2]), load(2, &[(3, 1), (4, 2)], &[1, 2])];
        assert_eq!(trigger(&even, &c), None);
        assert!(plan(&even, &c, &cost, &layout(), None).is_none());
        let skewed = [load(1, &[(1, 1), (2, 2), (3, 1), (4, 2)], &[1, 2]), load(2, &[], &[])];
        let d = plan(&skewed, &c, &cost, &layout(), None).unwrap();
        assert!(d.trigger.contains("node 1 runs 4 requests"), "{}", d.trigger);
        assert!(!d.moves.is_empty() && d.objective_ms < d.stay_ms, "{d:?}");
        assert!(d.moves.iter().all(|m| m.from == 1 && m.to == 2 && m.tokens == 40));
    }

    /// A leaving instance holds requests of two routers: router 0's drain moves its own and
    /// leaves router 9's, whose state would not follow the move (router 9 drains those itself).
    /// Fakes answer for the instances on the mem fabric (a test double): node 1 leaves, node 2
    /// grants pages.
    #[tokio::test]
    async fn a_drain_moves_only_the_draining_routers_requests() {
        use cascade_transport::mem::MemFabric;
        use cascade_transport::service::DEFAULT_INBOX;
        use cascade_transport::ServiceExt;
        use std::sync::Mutex;

        let fabric = MemFabric::new();
        let nodes: Vec<Arc<dyn Mesh>> = (0..3).map(|i| Arc::new(fabric.add_node(i)) as Arc<dyn Mesh>).collect();
        let req = |req, router| ReqLoad { req, adapter: 0, tokens: 10, remaining: 5, router };
        let running = Arc::new(Mutex::new(vec![req(1, 0), req(2, 9), req(3, 0)]));
        let asked = Arc::new(Mutex::new(Vec::new()));
        for node in [1, 2] {
            let (mesh, running, asked) = (nodes[node].clone(), running.clone(), asked.clone());
            let mut inbox = mesh.subscribe::<LlmMsg>(DEFAULT_INBOX).unwrap();
            tokio::spawn(async move {
                while let Some(m) = inbox.recv().await {
                    let answer = match m.msg {
                        LlmMsg::Load => LlmMsg::Loads {
                            requests: if node == 1 { running.lock().unwrap().clone() } else { Vec::new() },
                            adapters: Vec::new(),
                            kv_pages: 64,
                            free_pages: 64,
                        },
                        LlmMsg::Reserve { .. } => LlmMsg::Reserved {
                            grant: KvGrant { node: 2, region: 1, key: 1, len: 1 << 20, pages: vec![0], lease: 1 },
                        },
                        LlmMsg::Migrate { req, .. } => {
                            asked.lock().unwrap().push(req);
                            running.lock().unwrap().retain(|r| r.req != req);
                            LlmMsg::Migrated { req, tokens: 3 }
                        }
                        other => LlmMsg::Failed { message: format!("unexpected {other:?}"), retry: false },
                    };
                    let _ = mesh.reply(&m.reply_to.unwrap(), &answer);
                }
            });
        }
        let timing = (Duration::from_secs(5), Duration::from_millis(10), Duration::from_millis(300));
        let d = drain(&nodes[0], (1, &[2]), timing, |_, _| {}).await;
        let moved: Vec<u64> = d.outcomes.iter().filter(|(_, o)| o.is_ok()).map(|(r, _)| *r).collect();
        assert_eq!(moved, [1, 3], "{:?}", d.outcomes);
        assert_eq!(*asked.lock().unwrap(), [1, 3], "router 9's request was left where it is");
        assert_eq!(running.lock().unwrap().iter().map(|r| r.req).collect::<Vec<_>>(), [2]);
    }

    /// With a router named, the plan moves only that router's requests off the busy instance:
    /// the requests a plan for every router moves are given to router 9, and router 0's plan
    /// moves none of them.
    #[test]
    fn a_routers_plan_moves_only_its_own_requests() {
        let c = ClusterConfig { queue_trigger: 2, ..ClusterConfig::default() };
        let cost = CostModel::cpu_smollm2();
        let mut skewed = [load(1, &[(1, 1), (2, 2), (3, 1), (4, 2), (5, 1), (6, 2)], &[1, 2]), load(2, &[], &[])];
        let all = plan(&skewed, &c, &cost, &layout(), None).unwrap();
        let theirs: Vec<u64> = all.moves.iter().map(|m| m.req).collect();
        assert!(!theirs.is_empty() && theirs.len() < 6, "{all:?}");
        for r in skewed[0].requests.iter_mut().filter(|r| theirs.contains(&r.req)) {
            r.router = 9;
        }
        let mine = plan(&skewed, &c, &cost, &layout(), Some(0)).unwrap();
        assert!(mine.moves.iter().all(|m| !theirs.contains(&m.req)), "router 9's {theirs:?} moved: {:?}", mine.moves);
    }

    #[test]
    fn a_drain_fills_the_least_busy_instance_first() {
        let t = |node, running, free_pages| Target { node, running, free_pages };
        assert_eq!(order(&[t(2, 3, 10), t(3, 1, 5), t(4, 1, 9)]), [2, 1, 0]);
        assert_eq!(order(&[t(5, 0, 9), t(4, 0, 9)]), [1, 0], "ties go to the lower node");
        assert!(order(&[]).is_empty());
    }

    #[test]
    fn a_full_kv_region_triggers_while_another_has_room() {
        let c = ClusterConfig { queue_trigger: 100, kv_trigger: 0.9, ..ClusterConfig::default() };
        let mut full = load(1, &[(1, 1)], &[1]);
        full.free_pages = 3;
        let d = trigger(&[full.clone(), load(2, &[], &[])], &c).unwrap();
        assert!(d.starts_with("KV use 0.95"), "{d}");
        let mut also_full = load(2, &[], &[]);
        also_full.free_pages = 0;
        assert_eq!(trigger(&[full, also_full], &c), None, "nowhere to go");
    }
}
