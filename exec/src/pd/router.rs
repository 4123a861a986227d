//! The LLM router: requests in, answers out. For each request it reserves KV pages on a decode
//! instance, sends the prefill where the [`crate::serve::Dispatcher`] says (whole, or split while a new prefill
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
//! (`PeerEvent::Up`), or at once for one that answered "no such service" with its link up (an
//! instance restarting; asked at growing intervals), the router asks it what it is
//! ([`LlmMsg::Status`]) and takes it back: a
//! decode instance once the decodes it still ran for the router are over (they were redone
//! elsewhere, and their late tokens must not mix with the redone ones'), a prefill instance
//! when it holds every stage or is the one loading. A command naming it ([`PdCmd::Decode`] or
//! [`PdCmd::Scaling`]) takes it back at once.
//!
//! A request that streams its tokens ([`GenRequest::tokens`]) gets its answer's in-order prefix
//! as it grows, each token once. A request cancelled ([`PdCmd::Cancel`]) is answered with an error
//! at once and its decode told to stop.
//!
//! A request with stop strings ([`GenRequest::stop`]) is checked token by token as its answer's
//! tokens arrive in order ([`PdRouterConfig::tokenizer`] reads their text): at the first that
//! completes one it is answered with the tokens up to it, and its decode is told to stop with a
//! `Release` of its lease, as an attempt given up on is; a token the decode had begun meanwhile
//! comes back stale.
//!
//! A lost decode instance is replaced ([`PdRouterConfig::replace_lost_decode`]): once a prefill
//! instance holding every stage can be spared, it is mutated into a decode instance, so a dead
//! decode instance does not leave the survivors with its load for good.
//!
//! Commands: [`PdCmd::Mutate`] turns a prefill instance into a decode one (nothing more is sent
//! to it for prefill; prefills racing the switch are refused there and re-queued);
//! [`PdCmd::Scaling`] pairs an arriving prefill instance with the old one; [`PdCmd::Rebalance`]
//! runs one co-migration round now. With [`PdRouterConfig::monitor`] set the router also runs
//! rounds on its own, dLoRA's periodic monitor (seed `002_…`, §5): one every
//! [`MonitorConfig::every`], never two at once, each beside the routing.
//!
//! The loop ([`run`]) waits for the next event. What the router does on each is `state`'s,
//! without IO: it updates the state and names the calls to make; the loop starts each call in a
//! task of its own (`calls`), which reports back as an event — the loop never waits on a peer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Mesh, ServiceExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

mod calls;
mod state;

use super::migrate::{drain, rebalance, Drain, Rebalance, RebalanceConfig};
use super::proto::LlmMsg;
use crate::serve::{DispatchConfig, ServeError};
use state::{Action, Prefilled, Routing};

/// A generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// Its id: a request whose id is still pending is answered at once with an error (under
    /// that id), and the pending one goes on.
    pub id: u64,
    /// The prompt's tokens (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least one).
    pub max_tokens: u32,
    /// The LoRA adapter to serve it with (0: the base model).
    pub adapter: u32,
    /// How its tokens are drawn (`None`: greedily). `index` places it in its run: a request
    /// with the settings and index of prompt `index` of a [`crate::llama::generate::Generator`]
    /// run draws the same tokens from the same logits.
    pub sample: Option<super::proto::SeqSampling>,
    /// Its stop strings: the router ends its answer at the first token whose text completes one
    /// (as [`crate::llama::generate::Generator::generate_stream`] ends it) and tells its decode
    /// to stop. Needs [`PdRouterConfig::tokenizer`]; none: only the instance ends it.
    pub stop: crate::llama::stop::StopStrings,
    /// Where its answer's tokens go as they arrive, in order, each once (`None`: only the whole
    /// answer): what the router streams is the answer's in-order prefix, cut at a stop string.
    /// A redone attempt repeats the tokens already streamed — the router's redo rests on that
    /// (greedy, or sampled as the request's index draws) — and they are not sent again; should
    /// one differ, the request is answered with an error rather than with text that contradicts
    /// what was streamed.
    pub tokens: Option<TokenSink>,
}

/// Where a request's tokens are streamed ([`GenRequest::tokens`]); two are equal when they feed
/// the same channel.
#[derive(Debug, Clone)]
pub struct TokenSink(pub mpsc::UnboundedSender<u32>);

impl PartialEq for TokenSink {
    fn eq(&self, other: &TokenSink) -> bool {
        self.0.same_channel(&other.0)
    }
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
    /// Whether one of its stop strings ended it (its last token completes one).
    pub stopped: bool,
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
    /// Request `id` is no longer wanted (its client went away): it is answered at once with an
    /// error (`"cancelled"`), its decode, if one runs, is told to stop, and a prefill of it in
    /// flight is let go when it answers. Nothing happens for an id not pending.
    Cancel {
        /// The request.
        id: u64,
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
    /// Keep the decode capacity: while fewer decode instances serve than the router was given
    /// (`decode`, and those added by [`PdCmd::Mutate`] and [`PdCmd::Decode`]) — one was lost and
    /// is not back — turn a prefill instance holding every stage into a decode one, the least
    /// busy, as long as another such instance stays to prefill and never the old instance a
    /// loading one is paired with. One at a time; a failed switch is asked about and retried.
    pub replace_lost_decode: bool,
    /// A request decoding that gets no token for this long is given up on there (its decode is
    /// told to stop) and redone from its prompt: a decode instance that hangs with its link up
    /// holds nothing for good. Longer than a migration between decode instances can take (a
    /// moving request streams nothing meanwhile; `call_timeout` bounds it).
    pub stall_after: Duration,
    /// The model's tokenizer, which reads the text of the tokens a request with stop strings
    /// ([`GenRequest::stop`]) gets; without it such a request is refused.
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
}

impl PdRouterConfig {
    /// The router of `model`'s instances: prefill instance `old` (the one an arriving instance
    /// pairs with; zigzag splits, 2 prefills in flight per instance, 4 cooperative at most) and
    /// `more_prefill`, decode instances `decode`; calls limited to 120 s, 20 attempts a request
    /// 20 ms apart, a decode silent for 150 s (past the longest call) given up on, no monitor, no
    /// replacement of a lost decode instance, stop strings read with the model's tokenizer.
    pub fn new(model: &super::PdModel, old: u32, more_prefill: Vec<u32>, decode: Vec<u32>) -> PdRouterConfig {
        PdRouterConfig {
            dispatch: DispatchConfig {
                policy: crate::serve::LivePolicy::Zigzag,
                layers: model.config.stages() as u32,
                old,
                per_instance: 2,
                max_coop: 4,
                load_ratio: 2,
            },
            more_prefill,
            decode,
            call_timeout: Duration::from_secs(120),
            poll_every: Duration::from_millis(10),
            max_attempts: 20,
            retry_after: Duration::from_millis(20),
            monitor: None,
            replace_lost_decode: false,
            stall_after: Duration::from_secs(150),
            tokenizer: Some(model.tokenizer.clone()),
        }
    }
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
    /// Tokens of attempts the router had given up on, or of requests it answered already (a
    /// decode goes on for a step or two after a stop string): dropped, their decodes told to stop.
    pub stale_tokens: u64,
    /// Requests answered at one of their stop strings (their decodes told to stop).
    pub stopped: u64,
    /// Requests cancelled ([`PdCmd::Cancel`]) before they were answered.
    pub cancelled: u64,
    /// Requests answered with an error because a redone attempt's tokens differed from those
    /// streamed already ([`GenRequest::tokens`]).
    pub diverged: u64,
    /// Decodes given up on because no token came for [`PdRouterConfig::stall_after`].
    pub stalled: u64,
    /// Prefill instances turned into decode ones to replace lost decode instances
    /// ([`PdRouterConfig::replace_lost_decode`]).
    pub decode_replaced: u64,
    /// Decode instances that left (stopped with a drain window: `LlmMsg::Leaving`).
    pub decode_left: u64,
    /// Requests moved, with their KV, off decode instances that left.
    pub drain_moved: u64,
}

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
    let mut watching = true;
    let mut open = true;
    let mut tick = tokio::time::interval(cfg.poll_every.min(Duration::from_millis(20)));
    let limits = (cfg.call_timeout, cfg.poll_every);
    // The calls' tasks report back here (the loop never waits for a call itself).
    let mut prefills: JoinSet<Prefilled> = JoinSet::new();
    let (tx, mut reports) = mpsc::unbounded_channel();
    let mut r = Routing::new(cfg, answers);
    loop {
        r.dispatch();
        for a in r.actions() {
            act(&mesh, limits, a, &mut prefills, &tx);
        }
        r.publish(mesh.metrics());
        if !open && r.idle() {
            return Ok(r.stats);
        }
        tokio::select! {
            x = requests.recv(), if open => match x {
                Some(req) => r.arrive(req),
                None => open = false,
            },
            Some(c) = cmds.recv() => r.command(c),
            Some(m) = inbox.recv() => r.message(m.from, m.msg),
            Some(done) = prefills.join_next() => {
                if let Ok((id, attempt, outcome)) = done {
                    r.prefilled(id, attempt, outcome);
                }
            }
            Some(report) = reports.recv() => match report {
                Report::Round(x) => r.round_done(x),
                Report::Mutated(node, x, done) => r.mutated(node, x, done),
                Report::Resident(node, resident) => r.resident(node, resident),
                Report::Back(node, state) => r.back(node, state),
                Report::Moved { req, from, to } => r.moved(req, from, to),
                Report::Drained(x) => r.drained(x),
            },
            ev = events.recv(), if watching => match ev {
                Ok(ev) => r.peer_event(ev),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => watching = false,
                Err(_) => {}
            },
            _ = tick.tick() => {}
        }
        r.after(Instant::now());
    }
}

/// What a call's task reports back to the loop (a prefill's outcome comes through its
/// `JoinSet` instead).
enum Report {
    /// The monitor's co-migration round ended.
    Round(Result<Rebalance, ServeError>),
    /// A node answered its mutation; the command that asked for it is told.
    Mutated(u32, Result<(), String>, oneshot::Sender<Result<(), String>>),
    /// The arriving instance holds this many stages.
    Resident(u32, u32),
    /// A gone node can serve again, in this state.
    Back(u32, LlmMsg),
    /// A request on a leaving instance moved to another decode instance.
    Moved { req: u64, from: u32, to: u32 },
    /// A leaving instance stopped; its drain is over.
    Drained(Drain),
}

/// Starts `a` in a task of its own (`(call timeout, poll interval)` from the config).
fn act(
    mesh: &Arc<dyn Mesh>,
    (timeout, every): (Duration, Duration),
    a: Action,
    prefills: &mut JoinSet<Prefilled>,
    tx: &mpsc::UnboundedSender<Report>,
) {
    let mesh = mesh.clone();
    match a {
        Action::Prefill { req, attempt, to, split, order } => {
            prefills.spawn(async move {
                let r = calls::prefill(&mesh, &req, attempt, to, split, &order, timeout).await;
                (req.id, attempt, r)
            });
        }
        Action::Stop { node, req, lease } => {
            tokio::spawn(async move {
                let _ = mesh.call(node, &LlmMsg::Release { req, lease }, timeout).await;
            });
        }
        Action::Probe { node, whole } => {
            tokio::spawn(calls::probe(mesh, node, whole, every, timeout, tx.clone()));
        }
        Action::Follow { node } => {
            tokio::spawn(calls::follow(mesh, node, every, timeout, tx.clone()));
        }
        Action::Mutate { node, done } => {
            let tx = tx.clone();
            tokio::spawn(async move {
                let r = match mesh.call(node, &LlmMsg::Mutate, timeout).await {
                    Ok(LlmMsg::Ack) => Ok(()),
                    other => Err(format!("{other:?}")),
                };
                let _ = tx.send(Report::Mutated(node, r, done));
            });
        }
        Action::Drain { from, to, until } => {
            let tx = tx.clone();
            tokio::spawn(async move {
                let moved = |req, to| drop(tx.send(Report::Moved { req, from, to }));
                let d = drain(&mesh, (from, &to), (timeout, every, until), moved).await;
                let _ = tx.send(Report::Drained(d));
            });
        }
        Action::Rebalance { nodes, config, done } => {
            let tx = tx.clone();
            tokio::spawn(async move {
                let r = rebalance(&mesh, &nodes, &config, timeout).await;
                match done {
                    Some(done) => drop(done.send(r.map_err(|e| e.to_string()))),
                    None => drop(tx.send(Report::Round(r))),
                }
            });
        }
    }
}
