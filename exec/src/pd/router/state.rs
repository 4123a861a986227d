//! The router's state and what it does on each event, sans IO: each handler updates the state
//! and queues [`Action`]s — the calls to make — which [`super::run`]'s loop carries out, each in
//! a task of its own, reporting back as events.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use cascade_transport::metrics::Metrics;
use cascade_transport::{NodeId, PeerEvent};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::{GenAnswer, GenRequest, PdCmd, PdRouterConfig, RouterStats};
use crate::pd::migrate::{Drain, Rebalance, RebalanceConfig};
use crate::pd::proto::{LlmMsg, Role, Split};
use crate::serve::{Dispatcher, ServeError};

/// A call the router makes (the loop runs each in a task; see [`super::run`]).
pub(super) enum Action {
    /// Attempt `attempt` of `req`: KV reserved on the first of `order` with room, the prefill on
    /// `to`; its [`Outcome`] comes back as [`Routing::prefilled`].
    Prefill { req: GenRequest, attempt: u32, to: u32, split: Option<Split>, order: Vec<u32> },
    /// `Release` `req`'s `lease` on `node`: stops a decode of an attempt given up on.
    Stop { node: u32, req: u64, lease: u64 },
    /// Ask gone `node` until it can serve again (`whole`: only once it holds every stage); its
    /// state comes back as [`Routing::back`].
    Probe { node: u32, whole: bool },
    /// Follow the arriving instance `node`'s resident stages ([`Routing::resident`]).
    Follow { node: u32 },
    /// Turn `node` into a decode instance; the answer comes back as [`Routing::mutated`].
    Mutate { node: u32, done: oneshot::Sender<Result<(), String>> },
    /// A co-migration round over `nodes`: for a command (`done` told its outcome), or the
    /// monitor's (`done` is `None`; its outcome comes back as [`Routing::round_done`]).
    Rebalance { nodes: Vec<u32>, config: RebalanceConfig, done: Option<oneshot::Sender<Result<Rebalance, String>>> },
    /// Move the requests decoding on `from`, which leaves, to the decode instances `to`, until it
    /// stops or `until` has passed; each move comes back as [`Routing::moved`], the end as
    /// [`Routing::drained`].
    Drain { from: u32, to: Vec<u32>, until: Duration },
}

/// A request not answered yet.
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
    /// The reservation its current attempt decodes under.
    lease: u64,
    /// When its current attempt last made progress (the prefill's answer, a token).
    progress: Instant,
    /// Tokens of its answer checked for its stop strings (the first ones, in order).
    checked: usize,
    /// Whether a stop string ended it.
    stopped: bool,
    /// The tokens streamed to [`GenRequest::tokens`] so far (kept across attempts: a redone
    /// one must repeat them).
    streamed: Vec<u32>,
    /// Tokens of the current attempt's answer already compared with `streamed` or sent.
    stream_checked: usize,
}

impl Pending {
    /// Its current attempt is given up on: nothing of it counts any more.
    fn forget(&mut self) {
        self.current = None;
        self.first = None;
        self.tokens.clear();
        self.done_at = None;
        self.checked = 0;
        self.stream_checked = 0;
        self.stopped = false;
    }

    /// Checks the tokens of its answer that arrived in order since the last check for its stop
    /// strings: at the first that completes one, the answer ends there (the tokens after it
    /// dropped, none more waited for) and whether its decode may still run is returned.
    fn stop_at_a_stop_string(&mut self, tokenizer: &tokenizers::Tokenizer) -> Option<bool> {
        let (first, _) = self.first?;
        if self.req.stop.is_empty() || self.stopped {
            return None;
        }
        let mut answer = vec![first];
        answer.extend((1..).map_while(|i| self.tokens.get(&i).map(|t| t.0)));
        let end = (self.checked..answer.len()).find(|&n| self.req.stop.ended(tokenizer, &answer[..=n]));
        self.checked = answer.len();
        let end = end? as u32;
        // The instance ended it there itself: its decode is over.
        let over = self.done_at == Some(end);
        self.done_at = Some(end);
        self.tokens.retain(|&i, _| i <= end);
        self.stopped = true;
        Some(!over)
    }

    /// Streams the tokens of its answer that arrived in order and were not streamed yet (up to a
    /// stop string, once one ended it). Returns false when a redone attempt's token differs from
    /// the one streamed at its place.
    fn stream(&mut self) -> bool {
        let (Some(sink), Some((first, _))) = (&self.req.tokens, self.first) else { return true };
        let token = |i: usize| if i == 0 { Some(first) } else { self.tokens.get(&(i as u32)).map(|t| t.0) };
        // The tokens already streamed that this attempt has given again must be the same. Only
        // what arrived since the last call is looked at.
        let mut n = self.stream_checked;
        while let Some(t) = token(n) {
            match self.streamed.get(n) {
                Some(&was) if was != t => return false,
                Some(_) => {}
                None => {
                    let _ = sink.0.send(t);
                    self.streamed.push(t);
                }
            }
            n += 1;
        }
        self.stream_checked = n;
        true
    }

    /// Whether every token of its answer arrived.
    fn complete(&self) -> bool {
        self.first.is_some() && self.done_at.is_some_and(|last| (1..=last).all(|i| self.tokens.contains_key(&i)))
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
pub(super) enum Outcome {
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
pub(super) type Prefilled = (u64, u32, Outcome);

/// The router's state between two events.
pub(super) struct Routing {
    cfg: PdRouterConfig,
    d: Dispatcher,
    /// Instances gone (until they can serve again).
    gone: HashSet<u32>,
    /// Decode instances, and the one the next reservation tries first.
    decode: Vec<u32>,
    next_decode: usize,
    pending: HashMap<u64, Pending>,
    /// Requests to dispatch again, and when.
    delayed: Vec<(Instant, u64)>,
    /// The arriving prefill instance.
    scaling: Option<u32>,
    /// Decode instances the router keeps ([`PdRouterConfig::replace_lost_decode`]).
    decode_target: usize,
    /// The prefill instance being turned into a decode one in place of a lost one.
    replacing: Option<u32>,
    /// When the monitor's next round starts (`None` while one runs, or without a monitor).
    next_round: Option<Instant>,
    pub(super) stats: RouterStats,
    /// The stats and queue as the node's metrics last showed them.
    published: (RouterStats, usize),
    answers: mpsc::UnboundedSender<GenAnswer>,
    /// Calls to make, in order.
    actions: Vec<Action>,
}

impl Routing {
    pub(super) fn new(cfg: PdRouterConfig, answers: mpsc::UnboundedSender<GenAnswer>) -> Routing {
        let mut d = Dispatcher::new(cfg.dispatch);
        for &n in &cfg.more_prefill {
            d.serving(n);
        }
        Routing {
            d,
            gone: HashSet::new(),
            decode: cfg.decode.clone(),
            next_decode: 0,
            pending: HashMap::new(),
            delayed: Vec::new(),
            scaling: None,
            decode_target: cfg.decode.len(),
            replacing: None,
            next_round: cfg.monitor.as_ref().map(|m| Instant::now() + m.every),
            stats: RouterStats::default(),
            published: (RouterStats::default(), 0),
            answers,
            actions: Vec::new(),
            cfg,
        }
    }

    /// The calls to make now.
    pub(super) fn actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Every request is answered.
    pub(super) fn idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Sends what the dispatcher lets go now, each dispatch a new attempt.
    pub(super) fn dispatch(&mut self) {
        while let Some(x) = self.d.next_dispatch() {
            // Cancelled while it waited: the dispatcher lets it go.
            let Some(p) = self.pending.get_mut(&x.batch) else {
                self.d.done(x.batch);
                continue;
            };
            p.attempts += 1;
            p.numbered += 1;
            let attempt = p.numbered;
            p.current = Some(attempt);
            p.prefill = (x.to, x.split.map_or(0, |s| s.layers));
            let n = self.decode.len();
            let order: Vec<u32> = (0..n).map(|i| self.decode[(self.next_decode + i) % n]).collect();
            self.next_decode = self.next_decode.wrapping_add(1);
            self.actions.push(Action::Prefill { req: p.req.clone(), attempt, to: x.to, split: x.split, order });
        }
    }

    pub(super) fn arrive(&mut self, req: GenRequest) {
        // Refused at once, answered under its own id: a request that cannot be served as asked,
        // and one whose id is pending already — taken, it would replace the pending one, which
        // would never be answered.
        let refused = if self.pending.contains_key(&req.id) {
            Some(format!("request id {} is already pending", req.id))
        } else if req.prompt.is_empty() || req.max_tokens == 0 {
            Some(format!("{} prompt tokens, {} to generate: both must be at least 1", req.prompt.len(), req.max_tokens))
        } else if let Some(Err(e)) = req.sample.map(|s| s.sampling.check()) {
            Some(e.to_string())
        } else if !req.stop.is_empty() && self.cfg.tokenizer.is_none() {
            Some("stop strings, and no tokenizer at the router to read the tokens' text".into())
        } else {
            None
        };
        if let Some(why) = refused {
            debug!(req = req.id, why, "request refused");
            self.stats.failed += 1;
            let no = GenAnswer {
                id: req.id,
                result: Err(why),
                ttft: Duration::ZERO,
                gaps: Vec::new(),
                prefill: (0, 0),
                decode: 0,
                attempts: 0,
                stopped: false,
            };
            let _ = self.answers.send(no);
            return;
        }
        self.d.arrive_weighted(req.id, req.prompt.len() as f64);
        let p = Pending {
            req,
            arrived: Instant::now(),
            attempts: 0,
            current: None,
            numbered: 0,
            first: None,
            tokens: BTreeMap::new(),
            done_at: None,
            prefill: (0, 0),
            decode: 0,
            lease: 0,
            progress: Instant::now(),
            checked: 0,
            stopped: false,
            streamed: Vec::new(),
            stream_checked: 0,
        };
        self.pending.insert(p.req.id, p);
    }

    pub(super) fn command(&mut self, c: PdCmd) {
        match c {
            // No more prefills go there at once; it decodes once it says it does.
            PdCmd::Mutate { node, done } => {
                self.d.down(node);
                self.actions.push(Action::Mutate { node, done });
            }
            // Both say the node serves (again): one gone before is back for good.
            PdCmd::Scaling { node } => {
                self.gone.remove(&node);
                self.d.scaling(node);
                self.scaling = Some(node);
                self.actions.push(Action::Follow { node });
            }
            PdCmd::Decode { node } => {
                self.gone.remove(&node);
                self.add_decode(node);
                self.decode_target = self.decode_target.max(self.decode.len());
            }
            PdCmd::Cancel { id } => self.cancel(id),
            PdCmd::Rebalance { config, done } => {
                self.actions.push(Action::Rebalance { nodes: self.decode.clone(), config, done: Some(done) });
            }
        }
    }

    fn add_decode(&mut self, node: u32) {
        if !self.decode.contains(&node) {
            self.decode.push(node);
        }
    }

    /// A decode instance's token or abort: taken only from the attempt the request waits for.
    pub(super) fn message(&mut self, from: NodeId, msg: LlmMsg) {
        match msg {
            LlmMsg::Token { req, attempt, lease, index, token, done } => match self.pending.get_mut(&req) {
                Some(p) if p.current == Some(attempt) => {
                    p.decode = from;
                    p.lease = lease;
                    p.progress = Instant::now();
                    // Past a stop string (the decode went on a step before its stop came):
                    // nothing of the answer.
                    if !p.stopped {
                        p.tokens.insert(index, (token, p.progress));
                        if done {
                            p.done_at = Some(index);
                        }
                        self.took(req);
                    }
                }
                // An attempt given up on (or of a request answered already) still decodes
                // there: its token is dropped and its decode told to stop.
                _ => {
                    self.stats.stale_tokens += 1;
                    debug!(req, attempt, node = from, "a token of an attempt given up on: its decode is stopped");
                    if !done {
                        self.stop(from, req, lease);
                    }
                }
            },
            LlmMsg::Abort { req, attempt, message } => match self.pending.get_mut(&req) {
                Some(p) if p.current == Some(attempt) => {
                    warn!(req, %message, "decoding aborted: the request is redone");
                    if p.first.is_some() {
                        p.redo(&mut self.d, &mut self.stats);
                    } else {
                        // Its prefill has not answered: the request is redone when it does.
                        p.forget();
                    }
                }
                _ => debug!(req, attempt, %message, "an attempt given up on aborted"),
            },
            LlmMsg::Leaving { running } => self.leaving(from, running),
            other => debug!(?other, "unexpected llm message at the router"),
        }
    }

    /// Decode instance `node` leaves (a scale-in; it decodes `running` of this router's
    /// requests): no new request goes there, the router keeps one decode instance fewer, and the
    /// requests there move, with their KV, to the other decode instances.
    fn leaving(&mut self, node: u32, running: u32) {
        if self.decode.contains(&node) {
            self.decode.retain(|&n| n != node);
            self.decode_target = self.decode_target.saturating_sub(1);
        }
        self.d.down(node);
        self.stats.decode_left += 1;
        info!(node, running, to = ?self.decode, "a decode instance leaves: its requests move");
        if !self.decode.is_empty() {
            // As long as a request may go silent: the requests moving stream nothing meanwhile.
            let until = self.cfg.stall_after;
            self.actions.push(Action::Drain { from: node, to: self.decode.clone(), until });
        }
    }

    /// Request `req` moved from leaving `from` to `to`: it decodes there now, before its first
    /// token from there says so (the leaving node may be lost first, and what decoded there
    /// would be redone).
    /// (A drain moves another router's requests on the instance too: not counted here.)
    pub(super) fn moved(&mut self, req: u64, from: u32, to: u32) {
        if let Some(p) = self.pending.get_mut(&req) {
            self.stats.drain_moved += 1;
            if p.decode == from {
                p.decode = to;
            }
        }
    }

    /// A drain ended (the leaving instance stopped): those it could not move were aborted when
    /// it stopped, and are redone.
    pub(super) fn drained(&mut self, d: Drain) {
        let failed: Vec<_> = d.outcomes.iter().filter_map(|(req, o)| o.as_ref().err().map(|e| (req, e))).collect();
        info!(from = d.from, moved = d.moved(), failed = failed.len(), seconds = d.seconds, "drain over");
        for (req, e) in failed {
            debug!(req, from = d.from, error = %e, "not moved: redone");
        }
    }

    /// Request `id`'s answer grew: it is checked for its stop strings, and what arrived in order
    /// is streamed; a redone attempt that diverges from what was streamed ends it with an error
    /// (and its decode, if it still runs).
    fn took(&mut self, id: u64) {
        self.check_stop(id);
        let Some(p) = self.pending.get_mut(&id) else { return };
        if p.stream() {
            return;
        }
        warn!(req = id, "a redone attempt's tokens differ from those streamed: the request fails");
        if let Some(p) = self.pending.remove(&id) {
            self.d.done(id);
            self.stats.diverged += 1;
            self.stats.failed += 1;
            if p.done_at.is_none() {
                self.stop(p.decode, id, p.lease);
            }
            let why = "a redone attempt's tokens differ from those already streamed".to_string();
            let _ = self.answers.send(answer(p, Err(why)));
        }
    }

    /// Request `id` is no longer wanted ([`PdCmd::Cancel`]): answered with an error now; its
    /// decode, if one runs, is told to stop. Still queued at the dispatcher, it is dropped when
    /// its turn comes ([`Routing::dispatch`]); prefilling, its prefill's answer lets it go
    /// ([`Routing::prefilled`]).
    fn cancel(&mut self, id: u64) {
        let Some(p) = self.pending.remove(&id) else { return };
        debug!(req = id, "cancelled");
        self.stats.cancelled += 1;
        if p.current.is_some() && p.first.is_some() && !p.complete() {
            self.stop(p.decode, id, p.lease);
        }
        let _ = self.answers.send(answer(p, Err("cancelled".into())));
    }

    /// Checks request `id`'s answer for its stop strings ([`Pending::stop_at_a_stop_string`]);
    /// at one, its decode, if it still runs, is told to stop.
    fn check_stop(&mut self, id: u64) {
        let (Some(tokenizer), Some(p)) = (&self.cfg.tokenizer, self.pending.get_mut(&id)) else { return };
        let Some(running) = p.stop_at_a_stop_string(tokenizer) else { return };
        debug!(req = id, tokens = p.checked, "a stop string ends the answer");
        self.stats.stopped += 1;
        let (node, lease) = (p.decode, p.lease);
        if running {
            self.stop(node, id, lease);
        }
    }

    /// Tells `node` to stop decoding `req` under `lease` (an attempt given up on, or one a stop
    /// string ended).
    fn stop(&mut self, node: u32, req: u64, lease: u64) {
        self.actions.push(Action::Stop { node, req, lease });
    }

    /// Asks gone `node` until it can serve again.
    fn probe(&mut self, node: u32) {
        let whole = !self.d.takes_partial(node);
        self.actions.push(Action::Probe { node, whole });
    }

    /// Attempt `attempt` of request `id` answered its prefill call.
    pub(super) fn prefilled(&mut self, id: u64, attempt: u32, r: Outcome) {
        let Some(current) = self.pending.get(&id).map(|p| p.current) else {
            // Answered meanwhile (cancelled): the dispatcher lets it go, its decode stops.
            self.d.done(id);
            if let Outcome::Done { decoding: true, node, lease, .. } = r {
                self.stop(node, id, lease);
            }
            return;
        };
        if current != Some(attempt) {
            // Its decode aborted before this answer came: the decode, if it still runs, stops,
            // and the request is redone.
            if let Outcome::Done { decoding: true, node, lease, .. } = r {
                self.stop(node, id, lease);
            }
            if current.is_none() {
                self.redo_after(id, Duration::ZERO);
            }
            return;
        }
        match r {
            Outcome::Busy(why) => {
                debug!(req = id, %why, "no KV room: the request waits");
                if let Some(p) = self.pending.get_mut(&id) {
                    p.attempts -= 1;
                    p.current = None;
                }
                self.delayed.push((Instant::now() + self.cfg.retry_after, id));
            }
            Outcome::Done { decoding: true, node, .. } if self.gone.contains(&node) => {
                debug!(req = id, node, "the decode instance went while prefilling: redone");
                if let Some(p) = self.pending.get_mut(&id) {
                    p.forget();
                }
                self.redo_after(id, Duration::ZERO);
            }
            Outcome::Done { first, decoding, on_first, node, lease } => {
                self.d.done(id);
                if let Some(p) = self.pending.get_mut(&id) {
                    p.progress = Instant::now();
                    p.lease = lease;
                    p.first = Some((first, p.progress));
                    p.prefill.1 = on_first;
                    p.decode = node;
                    if !decoding {
                        p.done_at = Some(0);
                    }
                }
                self.took(id);
            }
            Outcome::Failed(e) => self.failed(id, e),
        }
    }

    /// Request `id`'s prefill failed: redone later, or answered with the error when it cannot
    /// succeed or its attempts are spent.
    fn failed(&mut self, id: u64, e: ServeError) {
        // A node that answered "no such service" is asked until it serves again.
        if let ServeError::Transport(t) = &e {
            if let Some(node) = t.no_such_service() {
                if self.lose(node) {
                    self.probe(node);
                }
            }
        }
        let Some(p) = self.pending.get_mut(&id) else { return };
        debug!(req = id, attempts = p.attempts, error = %e, "prefill failed");
        // Its decode may have started and streamed before the call failed: none of it counts.
        p.forget();
        if p.attempts >= self.cfg.max_attempts || matches!(e, ServeError::Input(_)) {
            self.d.done(id);
            if let Some(p) = self.pending.remove(&id) {
                self.stats.failed += 1;
                let _ = self.answers.send(answer(p, Err(e.to_string())));
            }
        } else {
            self.redo_after(id, self.cfg.retry_after);
        }
    }

    /// Request `id`, its attempt given up on, is dispatched again `after` from now (counted).
    fn redo_after(&mut self, id: u64, after: Duration) {
        self.stats.requeued += 1;
        self.delayed.push((Instant::now() + after, id));
    }

    /// `node` is gone: no more prefills or decodes go there, and every request decoding there is
    /// redone from its prompt (its tokens so far are dropped; greedy decoding repeats them).
    /// Returns false when it was gone already.
    fn lose(&mut self, node: u32) -> bool {
        if !self.gone.insert(node) {
            return false;
        }
        warn!(node, "instance gone: nothing more goes there");
        self.d.down(node);
        self.decode.retain(|&n| n != node);
        for p in self.pending.values_mut().filter(|p| p.first.is_some() && p.decode == node) {
            p.redo(&mut self.d, &mut self.stats);
        }
        true
    }

    /// A co-migration round of the monitor ended.
    pub(super) fn round_done(&mut self, r: Result<Rebalance, ServeError>) {
        self.stats.monitor_rounds += 1;
        match r {
            Ok(r) => {
                let moved = r.outcomes.iter().filter(|(_, o)| o.is_ok()).count();
                self.stats.migrated += moved as u64;
                if r.decision.is_some() {
                    info!(moved, tried = r.outcomes.len(), seconds = r.seconds, "co-migration round");
                }
            }
            Err(e) => {
                self.stats.monitor_failed += 1;
                warn!(error = %e, "co-migration round failed; the next one tries again");
            }
        }
        self.next_round = self.cfg.monitor.as_ref().map(|m| Instant::now() + m.every);
    }

    /// `node` answered its mutation.
    pub(super) fn mutated(&mut self, node: u32, r: Result<(), String>, done: oneshot::Sender<Result<(), String>>) {
        let replacing = self.replacing == Some(node);
        if replacing {
            self.replacing = None;
        }
        match &r {
            // A node lost while its answer came back joins when its link does.
            Ok(()) if !self.gone.contains(&node) => {
                self.add_decode(node);
                if !replacing {
                    self.decode_target = self.decode_target.max(self.decode.len());
                }
            }
            Ok(()) => {}
            // Whether it switched is not known: it is asked, and taken back as what it says.
            Err(e) if replacing => {
                warn!(node, error = %e, "the replacing mutation failed: the instance is asked what it is");
                self.gone.insert(node);
                self.probe(node);
            }
            Err(_) => {}
        }
        let _ = done.send(r);
    }

    /// While fewer decode instances serve than the router keeps and no replacement is under
    /// way, turns the least busy prefill instance holding every stage into a decode one — if
    /// another such instance stays, and never the old one a loading instance is paired with.
    fn replace_lost_decode(&mut self) {
        if !self.cfg.replace_lost_decode || self.replacing.is_some() || self.decode.len() >= self.decode_target {
            return;
        }
        let whole = self.d.whole_instances();
        if whole.len() < 2 {
            return;
        }
        let paired = self.d.paired_old();
        let Some(&(node, _)) =
            whole.iter().filter(|(n, _)| Some(*n) != paired).min_by_key(|&&(n, busy)| (busy, std::cmp::Reverse(n)))
        else {
            return;
        };
        info!(
            node,
            decode = self.decode.len(),
            keep = self.decode_target,
            "a decode instance is lost: a prefill instance becomes one in its place"
        );
        self.stats.decode_replaced += 1;
        self.replacing = Some(node);
        self.d.down(node);
        let (done, _) = oneshot::channel();
        self.actions.push(Action::Mutate { node, done });
    }

    /// The arriving instance `node` holds its first `resident` stages.
    pub(super) fn resident(&mut self, node: u32, resident: u32) {
        if self.scaling == Some(node) {
            self.d.resident(resident);
        }
    }

    /// Gone `node` can serve again, in `state`.
    pub(super) fn back(&mut self, node: u32, state: LlmMsg) {
        if !self.gone.contains(&node) {
            return;
        }
        match state {
            LlmMsg::State { role: Role::Decode, .. } => {
                info!(node, "decode instance back: it decodes again");
                self.gone.remove(&node);
                self.add_decode(node);
            }
            LlmMsg::State { role: Role::Prefill, resident, .. } if self.d.up(node, resident, 0) => {
                info!(node, resident, "prefill instance back: it prefills again");
                self.gone.remove(&node);
            }
            _ => {}
        }
    }

    pub(super) fn peer_event(&mut self, ev: PeerEvent) {
        match ev {
            PeerEvent::Down { peer, .. } => {
                self.lose(peer);
            }
            PeerEvent::Up { peer, .. } if self.gone.contains(&peer) => self.probe(peer),
            _ => {}
        }
    }

    /// After each event: the monitor's next round when due, the delayed requests whose time
    /// came, and the answers of the requests whose every token arrived.
    pub(super) fn after(&mut self, now: Instant) {
        self.replace_lost_decode();
        if let (Some(m), Some(at)) = (&self.cfg.monitor, self.next_round) {
            // Only while there is something to balance, and with two instances to balance over.
            if at <= now && self.decode.len() > 1 && !self.pending.is_empty() {
                self.next_round = None;
                let round = Action::Rebalance { nodes: self.decode.clone(), config: m.rounds.clone(), done: None };
                self.actions.push(round);
            }
        }
        let d = &mut self.d;
        self.delayed.retain(|&(at, id)| {
            if at <= now {
                d.failed(id);
            }
            at > now
        });
        // One pass: the answers complete, and the decodes silent for `stall_after`.
        let stall = self.cfg.stall_after;
        let (mut complete, mut silent) = (Vec::new(), Vec::new());
        for (&id, p) in &self.pending {
            if p.complete() {
                complete.push(id);
            } else if p.current.is_some() && p.first.is_some() && now.saturating_duration_since(p.progress) >= stall {
                silent.push(id);
            }
        }
        self.give_up_silent_decodes(silent);
        for id in complete {
            if let Some(p) = self.pending.remove(&id) {
                self.stats.answered += 1;
                let mut tokens = vec![p.first.map_or(0, |f| f.0)];
                tokens.extend(p.tokens.values().map(|t| t.0));
                let _ = self.answers.send(answer(p, Ok(tokens)));
            }
        }
    }

    /// Requests whose decode sent nothing for [`PdRouterConfig::stall_after`] (an instance that
    /// hangs with its link up; tokens lost on the way): their decode is told to stop and they are
    /// redone from their prompts, as after an abort.
    fn give_up_silent_decodes(&mut self, silent: Vec<u64>) {
        let stall = self.cfg.stall_after;
        for id in silent {
            let Some(p) = self.pending.get_mut(&id) else { continue };
            warn!(req = id, node = p.decode, after = ?stall, "no token from the decode: it is stopped and the request redone");
            self.stats.stalled += 1;
            let (node, lease) = (p.decode, p.lease);
            p.redo(&mut self.d, &mut self.stats);
            self.actions.push(Action::Stop { node, req: id, lease });
        }
    }

    /// Shows in `m` (the node's metrics) what the stats counted since the last time, and the
    /// requests not answered yet.
    pub(super) fn publish(&mut self, m: &Metrics) {
        let now = (self.stats.clone(), self.pending.len());
        if now == self.published {
            return;
        }
        let (s, was) = (&now.0, &self.published.0);
        let count = |name, help, pairs: &[(&str, &str)], by: u64| {
            if by > 0 {
                m.counter(name, help, pairs).inc_by(by);
            }
        };
        let requests_help = "Requests the LLM router answered, by outcome";
        count("cascade_llm_router_requests", requests_help, &[("outcome", "answered")], s.answered - was.answered);
        count("cascade_llm_router_requests", requests_help, &[("outcome", "failed")], s.failed - was.failed);
        let help = "Prefills the LLM router dispatched again (a failure, an abort, a lost instance)";
        count("cascade_llm_router_requeued", help, &[], s.requeued - was.requeued);
        let help = "Tokens of attempts the LLM router had given up on (dropped; their decodes told to stop)";
        count("cascade_llm_router_stale_tokens", help, &[], s.stale_tokens - was.stale_tokens);
        count("cascade_llm_router_requests", requests_help, &[("outcome", "cancelled")], s.cancelled - was.cancelled);
        let help =
            "Requests the LLM router answered with an error because a redone attempt's tokens differed from those \
                    streamed";
        count("cascade_llm_router_diverged", help, &[], s.diverged - was.diverged);
        let help = "Requests the LLM router answered at one of their stop strings";
        count("cascade_llm_router_stopped", help, &[], s.stopped - was.stopped);
        let help = "Prefill instances the LLM router turned into decode ones in place of lost decode instances";
        count("cascade_llm_router_decode_replaced", help, &[], s.decode_replaced - was.decode_replaced);
        let help = "Decode instances that left (a scale-in) while decoding the LLM router's requests";
        count("cascade_llm_router_decode_left", help, &[], s.decode_left - was.decode_left);
        let help = "Requests the LLM router moved off decode instances that left";
        count("cascade_llm_router_drain_moved", help, &[], s.drain_moved - was.drain_moved);
        m.gauge("cascade_llm_router_pending", "Requests the LLM router holds, not answered yet", &[]).set(now.1 as f64);
        self.published = now;
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
    GenAnswer {
        id: p.req.id,
        result,
        ttft,
        gaps,
        prefill: p.prefill,
        decode: p.decode,
        attempts: p.attempts,
        stopped: p.stopped,
    }
}

#[cfg(test)]
mod tests;
