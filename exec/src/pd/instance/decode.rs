//! The decode side of an instance: continuous batching over the running requests, and the
//! requests it stops between two steps (a router gave up on one, or was lost).

use std::sync::Arc;

use cascade_transport::{PeerEvent, ServiceExt};
use tokio::sync::broadcast;
use tracing::{debug, info, warn};

use super::transfer::hand_over;
use super::{failed, lock, release, retire, run, Handover, Seq, Shared};
use crate::llama::generate::choose;
use crate::llama::sample::Sampler;
use crate::pd::proto::LlmMsg;
use crate::serve::compute::Cmd;
use crate::serve::ServeError;
use crate::Activation;

/// Requests the decode loop stops between two steps (freeing their pages and cache there, where
/// no step of theirs is in flight).
#[derive(Debug, Clone, Copy)]
pub(super) enum Stop {
    /// Those of a router whose link failed.
    Router(u32),
    /// The one decoding under this lease: the router gave up on the attempt (`Release`).
    Lease { req: u64, lease: u64 },
}

impl Stop {
    fn matches(self, s: &Seq) -> bool {
        self.hits(s.req, s.lease, s.router)
    }

    fn hits(self, req: u64, lease: u64, router: u32) -> bool {
        match self {
            Stop::Router(r) => router == r,
            Stop::Lease { req: q, lease: l } => req == q && lease == l,
        }
    }
}

/// A request taken out of the running set to be handed over (co-migration): a stop that names it
/// meanwhile is kept here, and applied if the hand-over fails and it would decode here again.
pub(super) struct Away {
    pub(super) req: u64,
    pub(super) lease: u64,
    pub(super) router: u32,
    /// A stop named it while it was away.
    pub(super) stopped: bool,
}

/// The router gave up on reservation `lease` of `req`: its pages are freed, or, when the request
/// decodes under it (its prefill went on and started it), the decode loop stops it.
pub(super) fn give_up(sh: &Shared, req: u64, lease: u64) {
    // Checked and released under one lock: a Start between the two would otherwise leave a
    // decoding request without its pages.
    let started = match lock(&sh.kv).as_mut() {
        Some((_, pages)) if pages.started(req, lease) => true,
        Some((_, pages)) => {
            pages.release(req, lease);
            false
        }
        None => false,
    };
    if started {
        lock(&sh.stops).push(Stop::Lease { req, lease });
        sh.wake.notify_one();
    }
}

/// A router whose link failed cannot take its requests' tokens, and it redoes them elsewhere
/// (see [`crate::pd::router`]): the requests decoding here for it stop at the decode loop's next
/// step boundary, their KV pages and cache freed there instead of after every token they had
/// left; the pages it reserved for prefills that have not started here are freed at once (a
/// `Start` for one of them is refused: it holds no pages).
pub(super) async fn drop_lost_routers(sh: Arc<Shared>) {
    let mut events = sh.mesh.peer_events();
    let mut stop = sh.stop.subscribe();
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            _ = stop.wait_for(|&s| s) => return,
        };
        let peer = match ev {
            Ok(PeerEvent::Down { peer, .. }) => peer,
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let decoding = lock(&sh.running).iter().filter(|s| s.router == peer).count();
        // Pages it reserved for prefills that have not started here (their Start is refused).
        let reserved = lock(&sh.kv).as_ref().map_or_else(Vec::new, |(_, pages)| pages.reserved_by(peer));
        if decoding > 0 || !reserved.is_empty() {
            warn!(
                router = peer,
                decoding,
                holding_pages = reserved.len(),
                "the router's link failed: its requests here stop"
            );
        }
        for (req, lease) in reserved {
            release(&sh, req, lease);
        }
        // The decoding ones stop between two steps.
        lock(&sh.stops).push(Stop::Router(peer));
        sh.wake.notify_one();
    }
}

/// Continuous batching: every running request decodes one token per step, in one batch; a
/// request that starts joins at the next step.
pub(super) async fn decode_loop(sh: Arc<Shared>) {
    let layers = sh.compute.layers();
    let eos = sh.model.config.eos_token_id;
    let mut drain_until = None;
    loop {
        if *sh.stop.borrow() {
            return shut_down(&sh).await;
        }
        if sh.leaving() && drained(&sh, &mut drain_until) {
            sh.stop.send_replace(true);
            continue;
        }
        // Between two steps: stop the requests a router gave up on or lost, freeing their pages
        // and cache while no step of theirs is in flight.
        let stops: Vec<Stop> = std::mem::take(&mut *lock(&sh.stops));
        if !stops.is_empty() {
            let stopped: Vec<(u64, u64)> = {
                let mut running = lock(&sh.running);
                let hit = |s: &Seq| stops.iter().any(|x| x.matches(s));
                let stopped = running.iter().filter(|s| hit(s)).map(|s| (s.req, s.lease)).collect();
                running.retain(|s| !hit(s));
                for a in lock(&sh.away).iter_mut() {
                    a.stopped |= stops.iter().any(|x| x.hits(a.req, a.lease, a.router));
                }
                stopped
            };
            for (req, lease) in stopped {
                retire(&sh, req, lease).await;
            }
        }
        // Between two steps: hand over the requests a migration asked for.
        let handovers: Vec<Handover> = std::mem::take(&mut *lock(&sh.handovers));
        for h in handovers {
            let seq = {
                let mut running = lock(&sh.running);
                let seq = running.iter().position(|s| s.req == h.req).map(|i| running.remove(i));
                if let Some(s) = &seq {
                    lock(&sh.away).push(Away { req: s.req, lease: s.lease, router: s.router, stopped: false });
                }
                seq
            };
            match seq {
                Some(seq) => {
                    tokio::spawn(hand_over(sh.clone(), seq, h));
                }
                None => {
                    let e = ServeError::Peer(format!("request {} is not decoding here", h.req));
                    let _ = sh.mesh.reply(&h.reply, &failed(&e));
                }
            }
        }
        // The step's sequences, adapters and samplers (each with the number of the token it
        // draws), taken together.
        let (mut batch, mut adapters, mut samplers) = (Vec::new(), Vec::new(), Vec::<Option<(Sampler, u64)>>::new());
        for s in lock(&sh.running).iter() {
            batch.push((s.req, s.pos, vec![s.last]));
            adapters.push(s.adapter);
            samplers.push(s.sample.map(|k| (Sampler::of(k), u64::from(s.generated))));
        }
        if batch.is_empty() {
            if drain_until.is_some() {
                // Leaving: the requests away may come back, or the window end, unannounced.
                let _ = tokio::time::timeout(std::time::Duration::from_millis(20), sh.wake.notified()).await;
            } else {
                sh.wake.notified().await;
            }
            continue;
        }
        let result = match Activation::packed(&batch).and_then(|a| a.with_adapters(&adapters)) {
            Ok(act) => run(&sh, act, layers)
                .await
                .and_then(|a| Ok(choose(&a, samplers.iter_mut().map(|d| d.as_mut().map(|(k, n)| (k, *n))))?)),
            Err(e) => Err(e.into()),
        };
        let mut finished = Vec::new();
        {
            let mut running = lock(&sh.running);
            match result {
                Ok(tokens) => {
                    for ((req, _, _), tok) in batch.iter().zip(tokens) {
                        let Some(s) = running.iter_mut().find(|s| s.req == *req) else { continue };
                        s.generated += 1;
                        s.pos += 1;
                        s.last = tok;
                        let done = tok == eos || s.generated >= s.max_tokens;
                        if done {
                            // Its pages are back before anyone learns it is done (a router may
                            // reserve again at once); its cache goes after the step.
                            release(&sh, s.req, s.lease);
                        }
                        let (req, attempt, lease, index) = (s.req, s.attempt, s.lease, s.generated - 1);
                        let msg = LlmMsg::Token { req, attempt, lease, index, token: tok, done };
                        if let Err(e) = sh.mesh.post_oneway(s.router, &msg) {
                            warn!(req = s.req, error = %e, "cannot stream a token");
                        }
                        if done {
                            finished.push((s.req, s.lease));
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "a decode step failed: its requests are aborted");
                    for s in running.iter() {
                        let abort = LlmMsg::Abort { req: s.req, attempt: s.attempt, message: e.to_string() };
                        let _ = sh.mesh.post_oneway(s.router, &abort);
                        finished.push((s.req, s.lease));
                    }
                }
            }
            running.retain(|s| !finished.contains(&(s.req, s.lease)));
        }
        for (req, lease) in finished {
            retire(&sh, req, lease).await;
        }
    }
}

/// Whether a leaving instance may stop: nothing decodes here any more (every request moved away
/// or finished, none being handed over, no reservation waiting for its start), or the drain
/// window is over. The first call starts the window and tells each router whose requests decode
/// here that the instance leaves.
fn drained(sh: &Shared, until: &mut Option<std::time::Instant>) -> bool {
    let until = *until.get_or_insert_with(|| {
        // The routers of the requests decoding here and of those whose pages are reserved here.
        let mut routers = lock(&sh.kv).as_ref().map(|(_, pages)| pages.holders()).unwrap_or_default();
        for s in lock(&sh.running).iter() {
            routers.entry(s.router).or_insert(1);
        }
        let n: u32 = routers.values().sum();
        if n > 0 {
            info!(requests = n, window = ?sh.cfg.drain, "leaving: the routers are asked to move its requests");
        }
        for (router, running) in routers {
            if let Err(e) = sh.mesh.post_oneway(router, &LlmMsg::Leaving { running }) {
                warn!(router, error = %e, "cannot tell the router the instance leaves");
            }
        }
        std::time::Instant::now() + sh.cfg.drain
    });
    let running = lock(&sh.running).len();
    let away = lock(&sh.away).len();
    // Those decoding here and away hold pages too; the rest wait for their start.
    let holding = lock(&sh.kv).as_ref().map_or(0, |(_, pages)| pages.requests());
    let empty = running == 0 && away == 0 && holding == 0 && lock(&sh.handovers).is_empty();
    if !empty && std::time::Instant::now() >= until {
        warn!(requests = running + away, "leaving: the drain window is over; what still decodes here is aborted");
        return true;
    }
    empty
}

/// The decode loop's end when the instance stops: migrations out under way end first (each
/// within its time limit; a request whose move failed comes back), then every request still
/// here is aborted to its router, which redoes it elsewhere, and its pages and cache are freed
/// (an admission that ends after the stop is refused instead: `admit`); prefills and admissions
/// under way end and are answered, migrations asked for meanwhile are refused; the compute
/// thread ends once what it holds is done, and the regions are withdrawn.
async fn shut_down(sh: &Arc<Shared>) {
    let deadline = std::time::Instant::now() + sh.cfg.op_timeout * 2;
    while !lock(&sh.away).is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let seqs: Vec<Seq> = std::mem::take(&mut *lock(&sh.running));
    if !seqs.is_empty() {
        warn!(requests = seqs.len(), "the instance stops: its requests are aborted to their routers");
    }
    for s in seqs {
        let abort = LlmMsg::Abort { req: s.req, attempt: s.attempt, message: ServeError::Stopped.to_string() };
        let _ = sh.mesh.post_oneway(s.router, &abort);
        retire(sh, s.req, s.lease).await;
    }
    // The request loop holds a share of the work until it ends, so no migration is asked for
    // after the wait.
    if tokio::time::timeout(sh.cfg.op_timeout * 2, sh.work.closed()).await.is_err() {
        warn!("the instance stops with prefills or admissions still under way");
    }
    for h in std::mem::take(&mut *lock(&sh.handovers)) {
        let _ = sh.mesh.reply(&h.reply, &failed(&ServeError::Stopped));
    }
    sh.compute.send(Cmd::Stop);
    sh.withdraw_regions();
    sh.stopped.send_replace(true);
    debug!(node = sh.mesh.node(), "LLM instance stopped");
}
