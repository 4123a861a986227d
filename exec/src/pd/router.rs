//! The LLM router: requests in, answers out. For each request it reserves KV pages on a decode
//! instance, sends the prefill where the [`Dispatcher`] says (whole, or split while a new prefill
//! instance loads — zigzag weighted by prompt tokens), and collects the tokens the decode
//! instance streams. It measures each request's time to first token and the gaps between its
//! tokens. A request whose prefill or decoding fails is re-queued and redone from its prompt
//! (greedy decoding gives the same tokens); it is answered once, when its last token arrives.
//!
//! Each dispatch is a numbered attempt, and the router takes tokens (and aborts) only of the
//! attempt it waits for. An attempt it gave up on may still decode — its `Release` was lost, or
//! its call timed out after the decode had started — on the instance that redoes it or on another
//! one: its tokens never enter the answer, its abort does not redo the request again, and each of
//! its tokens is answered with a `Release` of the lease it names, which stops that decode.
//!
//! An instance whose link goes down (or that answers that it runs no `llm` service) is gone:
//! nothing more is prefilled or decoded there, and the requests that were decoding there are
//! redone elsewhere — nothing waits for tokens that cannot come. When its link comes back
//! (`PeerEvent::Up`) the router asks it what it is ([`LlmMsg::Status`]) and takes it back: a
//! decode instance once the decodes it still ran for the router are over (they were redone
//! elsewhere, and their late tokens must not mix with the redone ones'), a prefill instance
//! when it holds every stage or is the one loading. A command naming it ([`PdCmd::Decode`] or
//! [`PdCmd::Scaling`]) takes it back at once.
//!
//! Commands: [`PdCmd::Mutate`] turns a prefill instance into a decode one (nothing more is sent
//! to it for prefill; prefills racing the switch are refused there and re-queued);
//! [`PdCmd::Scaling`] pairs an arriving prefill instance with the old one; [`PdCmd::Rebalance`]
//! runs one co-migration round now. With [`PdRouterConfig::monitor`] set the router also runs
//! rounds on its own, dLoRA's periodic monitor (seed `002_…`, §5): one every
//! [`MonitorConfig::every`], never two at once, each beside the routing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Mesh, PeerEvent, ServiceExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::migrate::{rebalance, Rebalance, RebalanceConfig};
use super::proto::{KvGrant, LlmMsg, Role, Split};
use crate::serve::{DispatchConfig, Dispatcher, ServeError};

/// A generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    /// Its id (unique).
    pub id: u64,
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: u32,
    /// The LoRA adapter to serve it with (0: the base model).
    pub adapter: u32,
}

/// A request's answer.
#[derive(Debug, Clone)]
pub struct GenAnswer {
    /// The request.
    pub id: u64,
    /// The generated tokens, or why there are none.
    pub result: Result<Vec<u32>, String>,
    /// From the request's arrival at the router to its first token.
    pub ttft: Duration,
    /// Between consecutive tokens.
    pub gaps: Vec<Duration>,
    /// The instance its (last) prefill went to, and the stages that ran there when split.
    pub prefill: (u32, u32),
    /// The decode instance.
    pub decode: u32,
    /// Prefill attempts.
    pub attempts: u32,
}

/// What the router is told while it runs.
#[derive(Debug)]
pub enum PdCmd {
    /// Turn prefill instance `node` into a decode instance; `done` is told when it switched.
    Mutate {
        /// The instance.
        node: u32,
        /// Told the outcome.
        done: oneshot::Sender<Result<(), String>>,
    },
    /// `node` starts loading the model (by multicast): pair it with the old prefill instance
    /// and poll its resident stages.
    Scaling {
        /// The arriving instance.
        node: u32,
    },
    /// `node` is a decode instance from now on (one that joined): new requests may decode there.
    Decode {
        /// The instance.
        node: u32,
    },
    /// One co-migration round over the decode instances now ([`super::migrate::rebalance`]),
    /// run beside the routing; `done` is told what it did.
    Rebalance {
        /// What the round works with.
        config: RebalanceConfig,
        /// Told the outcome.
        done: oneshot::Sender<Result<Rebalance, String>>,
    },
}

/// The router's own co-migration monitor: a round ([`super::migrate::rebalance`]) every `every`
/// over the decode instances it knows, the next one only after the last finished.
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    /// Time between rounds (the last one's end to the next one's start at the least).
    pub every: Duration,
    /// What each round works with.
    pub rounds: RebalanceConfig,
}

/// The router's set-up.
#[derive(Debug, Clone)]
pub struct PdRouterConfig {
    /// Prefill dispatch (`old` is the instance a new one pairs with; `layers` the stages).
    pub dispatch: DispatchConfig,
    /// Other prefill instances serving from the start.
    pub more_prefill: Vec<u32>,
    /// Decode instances.
    pub decode: Vec<u32>,
    /// Limit on each call (a prefill includes its KV move).
    pub call_timeout: Duration,
    /// How often an arriving instance's resident stages are polled.
    pub poll_every: Duration,
    /// Attempts per request before it is answered with an error.
    pub max_attempts: u32,
    /// Wait before a failed request is dispatched again.
    pub retry_after: Duration,
    /// Co-migration rounds on a timer (`None`: only when told, [`PdCmd::Rebalance`]).
    pub monitor: Option<MonitorConfig>,
}

/// What the router counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Requests answered with tokens.
    pub answered: u64,
    /// Requests answered with an error.
    pub failed: u64,
    /// Prefills re-queued after a failure (or a decode abort).
    pub requeued: u64,
    /// Rounds the monitor finished (a round whose trigger did not fire included).
    pub monitor_rounds: u64,
    /// Monitor rounds that failed (an instance did not answer, say); the next round tries again.
    pub monitor_failed: u64,
    /// Requests the monitor's rounds moved to another decode instance.
    pub migrated: u64,
    /// Tokens of attempts the router had given up on (dropped; their decodes told to stop).
    pub stale_tokens: u64,
}

struct Pending {
    req: GenRequest,
    arrived: Instant,
    attempts: u32,
    /// The attempt whose tokens count (`None` between a failure and the next dispatch).
    current: Option<u32>,
    /// The last attempt's number (every dispatch takes the next one).
    numbered: u32,
    first: Option<(u32, Instant)>,
    tokens: BTreeMap<u32, (u32, Instant)>,
    done_at: Option<u32>,
    prefill: (u32, u32),
    decode: u32,
}

impl Pending {
    /// Its current attempt is given up on: nothing of it counts any more.
    fn forget(&mut self) {
        self.current = None;
        self.first = None;
        self.tokens.clear();
        self.done_at = None;
    }

    /// Its decoding is lost: it is queued again, to be redone from its prompt (its tokens so far
    /// are dropped; greedy decoding repeats them).
    fn redo(&mut self, d: &mut Dispatcher, stats: &mut RouterStats) {
        self.forget();
        stats.requeued += 1;
        d.arrive_weighted(self.req.id, self.req.prompt.len() as f64);
    }
}

/// A prefill's outcome: `Busy` when no decode instance had room (back-pressure: retried, not
/// counted).
enum Outcome {
    Done {
        /// The first token.
        first: u32,
        /// Whether a decode instance generates the rest.
        decoding: bool,
        /// Stages on the first instance when split (0: whole).
        on_first: u32,
        /// The decode instance.
        node: u32,
        /// The reservation it decodes under.
        lease: u64,
    },
    Busy(String),
    Failed(ServeError),
}

/// A prefill task's result: the request, the attempt, its outcome.
type Prefilled = (u64, u32, Outcome);

/// Runs the router until `requests` closes and every request is answered.
pub async fn run(
    mesh: Arc<dyn Mesh>,
    cfg: PdRouterConfig,
    mut requests: mpsc::UnboundedReceiver<GenRequest>,
    mut cmds: mpsc::UnboundedReceiver<PdCmd>,
    answers: mpsc::UnboundedSender<GenAnswer>,
) -> Result<RouterStats, ServeError> {
    let mut inbox = mesh.subscribe::<LlmMsg>(DEFAULT_INBOX)?;
    let mut events = mesh.peer_events();
    // Instances gone for the rest of the run.
    let mut gone: HashSet<u32> = HashSet::new();
    let mut watching = true;
    let mut d = Dispatcher::new(cfg.dispatch);
    for &n in &cfg.more_prefill {
        d.serving(n);
    }
    let mut decode = cfg.decode.clone();
    let mut next_decode = 0usize;
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut tasks: JoinSet<Prefilled> = JoinSet::new();
    let mut delayed: Vec<(Instant, u64)> = Vec::new();
    let mut scaling: Option<u32> = None;
    let mut stats = RouterStats::default();
    let mut open = true;
    let mut tick = tokio::time::interval(cfg.poll_every.min(Duration::from_millis(20)));
    // The monitor: the time of its next round, and its rounds' outcomes (one at a time).
    let mut next_round = cfg.monitor.as_ref().map(|m| Instant::now() + m.every);
    let (round_tx, mut round_rx) = mpsc::unbounded_channel::<Result<Rebalance, ServeError>>();
    // Mutations answered: the node, the outcome, and whom to tell.
    let (mutated_tx, mut mutated_rx) =
        mpsc::unbounded_channel::<(u32, Result<(), String>, oneshot::Sender<Result<(), String>>)>();
    // An arriving instance's resident stages, from its follower (a task: the router never waits
    // for a status call).
    let (res_tx, mut res_rx) = mpsc::unbounded_channel::<(u32, u32)>();
    // Gone instances whose link came back, with their state once they can serve again.
    let (back_tx, mut back_rx) = mpsc::unbounded_channel::<(u32, LlmMsg)>();
    loop {
        // Dispatch what can go now.
        while let Some(x) = d.next_dispatch() {
            let Some(p) = pending.get_mut(&x.batch) else { continue };
            p.attempts += 1;
            p.numbered += 1;
            let attempt = p.numbered;
            p.current = Some(attempt);
            p.prefill = (x.to, x.split.map_or(0, |s| s.layers));
            let order: Vec<u32> = (0..decode.len()).map(|i| decode[(next_decode + i) % decode.len()]).collect();
            next_decode = next_decode.wrapping_add(1);
            let (mesh, req, timeout) = (mesh.clone(), p.req.clone(), cfg.call_timeout);
            tasks.spawn(async move {
                let r = prefill(&mesh, &req, attempt, x.to, x.split, &order, timeout).await;
                (req.id, attempt, r)
            });
        }
        if !open && pending.is_empty() {
            return Ok(stats);
        }
        tokio::select! {
            r = requests.recv(), if open => match r {
                Some(req) => {
                    d.arrive_weighted(req.id, req.prompt.len() as f64);
                    pending.insert(req.id, Pending {
                        req, arrived: Instant::now(), attempts: 0, current: None, numbered: 0, first: None,
                        tokens: BTreeMap::new(),
                        done_at: None, prefill: (0, 0), decode: 0,
                    });
                }
                None => open = false,
            },
            Some(c) = cmds.recv() => match c {
                // No more prefills go there at once; it decodes once it says it does (the call runs
                // in a task: the router goes on routing meanwhile).
                PdCmd::Mutate { node, done } => {
                    d.down(node);
                    let (mesh, timeout, tx) = (mesh.clone(), cfg.call_timeout, mutated_tx.clone());
                    tokio::spawn(async move {
                        let r = match mesh.call(node, &LlmMsg::Mutate, timeout).await {
                            Ok(LlmMsg::Ack) => Ok(()),
                            other => Err(format!("{other:?}")),
                        };
                        let _ = tx.send((node, r, done));
                    });
                }
                // Both say the node serves (again): one gone before is back for good.
                PdCmd::Scaling { node } => {
                    gone.remove(&node);
                    d.scaling(node);
                    scaling = Some(node);
                    tokio::spawn(follow(mesh.clone(), node, cfg.poll_every, cfg.call_timeout, res_tx.clone()));
                }
                PdCmd::Decode { node } => {
                    gone.remove(&node);
                    if !decode.contains(&node) {
                        decode.push(node);
                    }
                }
                PdCmd::Rebalance { config, done } => {
                    let (mesh, nodes, timeout) = (mesh.clone(), decode.clone(), cfg.call_timeout);
                    tokio::spawn(async move {
                        let r = rebalance(&mesh, &nodes, &config, timeout).await;
                        let _ = done.send(r.map_err(|e| e.to_string()));
                    });
                }
            },
            Some(m) = inbox.recv() => match m.msg {
                LlmMsg::Token { req, attempt, lease, index, token, done } => match pending.get_mut(&req) {
                    Some(p) if p.current == Some(attempt) => {
                        p.decode = m.from;
                        p.tokens.insert(index, (token, Instant::now()));
                        if done {
                            p.done_at = Some(index);
                        }
                    }
                    // An attempt given up on (or of a request answered already) still decodes
                    // there: its token is dropped and its decode told to stop.
                    _ => {
                        stats.stale_tokens += 1;
                        debug!(req, attempt, node = m.from, "a token of an attempt given up on: its decode is stopped");
                        if !done {
                            let (mesh, timeout) = (mesh.clone(), cfg.call_timeout);
                            tokio::spawn(async move {
                                let _ = mesh.call(m.from, &LlmMsg::Release { req, lease }, timeout).await;
                            });
                        }
                    }
                },
                LlmMsg::Abort { req, attempt, message } => match pending.get_mut(&req) {
                    Some(p) if p.current == Some(attempt) => {
                        warn!(req, %message, "decoding aborted: the request is redone");
                        if p.first.is_some() {
                            p.redo(&mut d, &mut stats);
                        } else {
                            // Its prefill has not answered: the request is redone when it does.
                            p.forget();
                        }
                    }
                    _ => debug!(req, attempt, %message, "an attempt given up on aborted"),
                },
                other => debug!(?other, "unexpected llm message at the router"),
            },
            Some(done) = tasks.join_next() => {
                let Ok((id, attempt, r)) = done else { continue };
                let Some(current) = pending.get(&id).map(|p| p.current) else { continue };
                if current != Some(attempt) {
                    // Its decode aborted before this answer came: the decode, if it still runs,
                    // stops, and the request is redone.
                    if let Outcome::Done { decoding: true, node, lease, .. } = r {
                        let (mesh, timeout) = (mesh.clone(), cfg.call_timeout);
                        tokio::spawn(async move {
                            let _ = mesh.call(node, &LlmMsg::Release { req: id, lease }, timeout).await;
                        });
                    }
                    if current.is_none() {
                        stats.requeued += 1;
                        delayed.push((Instant::now(), id));
                    }
                    continue;
                }
                match r {
                    Outcome::Busy(why) => {
                        debug!(req = id, %why, "no KV room: the request waits");
                        if let Some(p) = pending.get_mut(&id) {
                            p.attempts -= 1;
                            p.current = None;
                        }
                        delayed.push((Instant::now() + cfg.retry_after, id));
                    }
                    Outcome::Done { decoding: true, node, .. } if gone.contains(&node) => {
                        debug!(req = id, node, "the decode instance went while prefilling: redone");
                        if let Some(p) = pending.get_mut(&id) {
                            p.forget();
                        }
                        stats.requeued += 1;
                        delayed.push((Instant::now(), id));
                    }
                    Outcome::Done { first, decoding, on_first, node, .. } => {
                        d.done(id);
                        if let Some(p) = pending.get_mut(&id) {
                            p.first = Some((first, Instant::now()));
                            p.prefill.1 = on_first;
                            p.decode = node;
                            if !decoding {
                                p.done_at = Some(0);
                            }
                        }
                    }
                    Outcome::Failed(e) => {
                        // A node that answered "no such service" is asked until it serves again.
                        if let ServeError::Transport(t) = &e {
                            if let Some(node) = t.no_such_service() {
                                if lose(node, &mut gone, &mut d, &mut decode, &mut pending, &mut stats) {
                                    let whole = !d.takes_partial(node);
                                    tokio::spawn(probe(mesh.clone(), node, whole, cfg.poll_every, cfg.call_timeout, back_tx.clone()));
                                }
                            }
                        }
                        let attempts = pending.get(&id).map_or(0, |p| p.attempts);
                        debug!(req = id, attempts, error = %e, "prefill failed");
                        if let Some(p) = pending.get_mut(&id) {
                            p.current = None;
                        }
                        if attempts >= cfg.max_attempts || matches!(e, ServeError::Input(_)) {
                            d.done(id);
                            if let Some(p) = pending.remove(&id) {
                                stats.failed += 1;
                                let _ = answers.send(answer(p, Err(e.to_string())));
                            }
                        } else {
                            stats.requeued += 1;
                            delayed.push((Instant::now() + cfg.retry_after, id));
                        }
                    }
                }
            },
            Some(r) = round_rx.recv() => {
                stats.monitor_rounds += 1;
                match r {
                    Ok(r) => {
                        let moved = r.outcomes.iter().filter(|(_, o)| o.is_ok()).count();
                        stats.migrated += moved as u64;
                        if r.decision.is_some() {
                            info!(moved, tried = r.outcomes.len(), seconds = r.seconds, "co-migration round");
                        }
                    }
                    Err(e) => {
                        stats.monitor_failed += 1;
                        warn!(error = %e, "co-migration round failed; the next one tries again");
                    }
                }
                next_round = cfg.monitor.as_ref().map(|m| Instant::now() + m.every);
            },
            Some((node, r, done)) = mutated_rx.recv() => {
                // A node lost while its answer came back joins when its link does.
                if r.is_ok() && !gone.contains(&node) && !decode.contains(&node) {
                    decode.push(node);
                }
                let _ = done.send(r);
            }
            Some((node, resident)) = res_rx.recv() => {
                if scaling == Some(node) {
                    d.resident(resident);
                }
            }
            Some((node, state)) = back_rx.recv() => match state {
                LlmMsg::State { role: Role::Decode, .. } if gone.contains(&node) => {
                    info!(node, "decode instance back: it decodes again");
                    gone.remove(&node);
                    if !decode.contains(&node) {
                        decode.push(node);
                    }
                }
                LlmMsg::State { role: Role::Prefill, resident, .. } if gone.contains(&node) && d.up(node, resident, 0) => {
                    info!(node, resident, "prefill instance back: it prefills again");
                    gone.remove(&node);
                }
                _ => {}
            },
            ev = events.recv(), if watching => match ev {
                Ok(PeerEvent::Down { peer, .. }) => {
                    lose(peer, &mut gone, &mut d, &mut decode, &mut pending, &mut stats);
                }
                Ok(PeerEvent::Up { peer, .. }) if gone.contains(&peer) => {
                    let whole = !d.takes_partial(peer);
                    tokio::spawn(probe(mesh.clone(), peer, whole, cfg.poll_every, cfg.call_timeout, back_tx.clone()));
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => watching = false,
                _ => {}
            },
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        if let (Some(m), Some(at)) = (&cfg.monitor, next_round) {
            // Only while there is something to balance, and with two instances to balance over.
            if at <= now && decode.len() > 1 && !pending.is_empty() {
                next_round = None;
                let (mesh, nodes, rc, timeout, tx) =
                    (mesh.clone(), decode.clone(), m.rounds.clone(), cfg.call_timeout, round_tx.clone());
                tokio::spawn(async move {
                    let _ = tx.send(rebalance(&mesh, &nodes, &rc, timeout).await);
                });
            }
        }
        delayed.retain(|&(at, id)| {
            if at <= now {
                d.failed(id);
            }
            at > now
        });
        // Answer the requests whose every token arrived.
        let complete: Vec<u64> = pending
            .iter()
            .filter(|(_, p)| {
                p.first.is_some() && p.done_at.is_some_and(|last| (1..=last).all(|i| p.tokens.contains_key(&i)))
            })
            .map(|(&id, _)| id)
            .collect();
        for id in complete {
            if let Some(p) = pending.remove(&id) {
                stats.answered += 1;
                let mut tokens = vec![p.first.map_or(0, |f| f.0)];
                tokens.extend(p.tokens.values().map(|t| t.0));
                let _ = answers.send(answer(p, Ok(tokens)));
            }
        }
    }
}

/// `node` is gone: no more prefills or decodes go there, and every request decoding there is
/// redone from its prompt (its tokens so far are dropped; greedy decoding repeats them). Returns
/// false when it was gone already.
fn lose(
    node: u32,
    gone: &mut HashSet<u32>,
    d: &mut Dispatcher,
    decode: &mut Vec<u32>,
    pending: &mut HashMap<u64, Pending>,
    stats: &mut RouterStats,
) -> bool {
    if !gone.insert(node) {
        return false;
    }
    warn!(node, "instance gone: nothing more goes there");
    d.down(node);
    decode.retain(|&n| n != node);
    for p in pending.values_mut().filter(|p| p.first.is_some() && p.decode == node) {
        p.redo(d, stats);
    }
    true
}

/// Asks the arriving instance `node` for its resident stages every `every` and reports each
/// change on `tx`, until it holds them all or the router is gone. Failed calls (its link down
/// for a while) are tried again at the next poll.
async fn follow(
    mesh: Arc<dyn Mesh>,
    node: u32,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<(u32, u32)>,
) {
    let mut last = None;
    while !tx.is_closed() {
        match mesh.call(node, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { resident, layers, .. }) => {
                if last != Some(resident) {
                    last = Some(resident);
                    if tx.send((node, resident)).is_err() || resident >= layers {
                        return;
                    }
                }
            }
            other => debug!(node, answer = ?other, "status of the arriving instance"),
        }
        tokio::time::sleep(every).await;
    }
}

/// Asks `node`, gone, for its state until it can serve again, and reports it on `tx`: a decode
/// instance once it decodes nothing (what it ran before it was lost was redone elsewhere), a
/// prefill instance — with `whole` — once it holds every stage. It
/// asks every `every` — and while the node runs no `llm` service yet, each wait twice the last,
/// up to [`crate::serve::router::PROBE_AT_MOST`]. Gives up when the link fails again (its coming
/// back starts another probe), the node answers something other than its state, or the router
/// is gone.
async fn probe(
    mesh: Arc<dyn Mesh>,
    node: u32,
    whole: bool,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<(u32, LlmMsg)>,
) {
    let mut backoff = every;
    while !tx.is_closed() && mesh.connected_to(node) {
        let wait = match mesh.call(node, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { role: Role::Decode, running, .. }) if running > 0 => every,
            Ok(LlmMsg::State { role: Role::Prefill, resident, layers, .. }) if whole && resident < layers => every,
            Ok(state @ LlmMsg::State { .. }) => {
                let _ = tx.send((node, state));
                return;
            }
            Err(e) if e.no_such_service().is_some() => {
                let wait = backoff;
                backoff = (backoff * 2).min(crate::serve::router::PROBE_AT_MOST);
                wait
            }
            other => return debug!(node, answer = ?other, "a node marked gone serves nothing"),
        };
        tokio::time::sleep(wait).await;
    }
}

fn answer(p: Pending, result: Result<Vec<u32>, String>) -> GenAnswer {
    let first = p.first.map(|f| f.1);
    let ttft = first.map_or(Duration::ZERO, |f| f - p.arrived);
    let mut gaps = Vec::new();
    let mut last = first;
    for (_, at) in p.tokens.values() {
        if let Some(l) = last {
            gaps.push(at.saturating_duration_since(l));
        }
        last = Some(*at);
    }
    GenAnswer { id: p.req.id, result, ttft, gaps, prefill: p.prefill, decode: p.decode, attempts: p.attempts }
}

/// Reserves KV on the first decode instance of `order` with room, then prefills on `to`, as
/// attempt `attempt` of the request.
async fn prefill(
    mesh: &Arc<dyn Mesh>,
    req: &GenRequest,
    attempt: u32,
    to: u32,
    split: Option<Split>,
    order: &[u32],
    timeout: Duration,
) -> Outcome {
    if order.is_empty() {
        // Not back-pressure: with no decode instance left, waiting would never end. Counted
        // as an attempt, so the request is answered with this error once its attempts run out
        // (a decode instance that joins meanwhile, `PdCmd::Decode`, takes it).
        return Outcome::Failed(ServeError::Peer("no decode instance is left".into()));
    }
    let tokens = req.prompt.len() as u32 + req.max_tokens;
    let mut grant: Option<KvGrant> = None;
    let mut why = String::new();
    for &n in order {
        match mesh.call(n, &LlmMsg::Reserve { req: req.id, tokens }, timeout).await {
            Ok(LlmMsg::Reserved { grant: g }) => {
                grant = Some(g);
                break;
            }
            Ok(LlmMsg::Failed { message, retry: false }) => return Outcome::Failed(ServeError::Input(message)),
            other => why = format!("node {n}: {other:?}"),
        }
    }
    let Some(kv) = grant else { return Outcome::Busy(why) };
    let (node, lease) = (kv.node, kv.lease);
    let msg = LlmMsg::Prefill {
        req: req.id,
        attempt,
        prompt: req.prompt.clone(),
        max_tokens: req.max_tokens,
        kv,
        split,
        router: mesh.node(),
        adapter: req.adapter,
    };
    let r = match mesh.call(to, &msg, timeout).await {
        Ok(LlmMsg::Prefilled { first, decoding, on_first, .. }) => {
            Outcome::Done { first, decoding, on_first, node, lease }
        }
        Ok(LlmMsg::Failed { message, retry }) => {
            Outcome::Failed(if retry { ServeError::Peer(message) } else { ServeError::Input(message) })
        }
        Ok(other) => Outcome::Failed(ServeError::Protocol(format!("unexpected answer {other:?}"))),
        Err(e) => Outcome::Failed(e.into()),
    };
    // A reservation its prefill did not use (or that decoding will not free) goes back.
    if !matches!(r, Outcome::Done { decoding: true, .. }) {
        let _ = mesh.call(node, &LlmMsg::Release { req: req.id, lease }, timeout).await;
    }
    r
}
