//! The router's loop over the transport: it batches requests as they arrive (a batch closes when
//! full, or at once when nothing is queued), dispatches batches as [`Dispatcher`] decides, calls
//! the instances with typed requests, follows the new instance's resident layers, and answers
//! every request exactly once — with its embedding, or with the error that refused it.
//!
//! An instance whose link fails, or that answers that it runs no `exec` service, takes no more
//! batches. When its link comes back (`PeerEvent::Up`), or — for one that answered "no such
//! service" with its link up — from then on, it is asked what it holds (at growing intervals, up
//! to [`PROBE_AT_MOST`], while it runs no service yet) and takes batches again once it serves: a
//! link flap or a restarted instance costs capacity only while it lasts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_transport::{Mesh, PeerEvent, ServiceExt, TransportError};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{debug, info};

use super::dispatch::{Dispatch, DispatchConfig, Dispatcher};
use super::proto::{ExecMsg, Split};

/// A request to embed one text.
#[derive(Debug, Clone)]
pub struct Request {
    /// The caller's id.
    pub id: u64,
    /// The text.
    pub text: String,
    /// When it arrived.
    pub arrived: Instant,
}

/// The answer to a request.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The request's id.
    pub id: u64,
    /// Its unit-length embedding, or why it was refused.
    pub result: Result<Vec<f32>, String>,
    /// When it arrived.
    pub arrived: Instant,
    /// When it was answered.
    pub answered: Instant,
    /// The instance its batch was sent to.
    pub to: u32,
    /// Layers run on that instance when the batch was split (then the rest ran on `then`).
    pub split: Option<Split>,
    /// When the batch crossed three segments: the layers `split.then` ran up to, and the
    /// instance that ran the rest.
    pub onward: Option<Split>,
}

/// Commands to a running router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterCmd {
    /// `node` starts loading the model (an arriving [`super::Source`]): pair it with the old
    /// instance and follow its resident layers.
    Scale {
        /// The new instance's node.
        node: u32,
    },
}

/// The router's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// The dispatcher's.
    pub dispatch: DispatchConfig,
    /// Texts per batch at most (the instances' limit).
    pub max_batch: usize,
    /// Limit on each call to an instance.
    pub call_timeout: Duration,
    /// How often a loading instance is asked for its resident layers.
    pub poll_every: Duration,
    /// Attempts per batch before its requests are answered with the last error.
    pub max_attempts: u32,
}

/// What the router saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterStats {
    /// Requests answered with an embedding.
    pub served: u64,
    /// Requests answered with an error.
    pub refused: u64,
    /// Batches sent again after their instance failed them.
    pub requeued: u64,
    /// The new instance's layers each time they changed, as the router saw them.
    pub residency: Vec<ResidencyChange>,
}

/// The new instance's layers at one moment of its load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidencyChange {
    /// Seconds since the router started.
    pub at_s: f64,
    /// Stages resident from the first on: the prefix a batch can start on the new instance with.
    pub resident: u32,
    /// Stages `1..=after_entry` resident, whether or not the entry stage is: a copy packed with
    /// its embeddings last holds blocks long before its entry stage (see [`super::dispatch`]).
    pub after_entry: u32,
}

struct Batch {
    requests: Vec<Request>,
    attempts: u32,
}

type CallResult = (Dispatch, Result<ExecMsg, TransportError>);

/// The longest wait between two questions to a node marked down that runs no `exec` service yet.
pub const PROBE_AT_MOST: Duration = Duration::from_secs(1);

/// The waits between questions to a node that runs no service yet: the first `every`, each
/// after it twice the last, up to [`PROBE_AT_MOST`] (both routers' probes).
pub(crate) struct Backoff(Duration);

impl Backoff {
    /// Starting at `every`.
    pub(crate) fn new(every: Duration) -> Backoff {
        Backoff(every)
    }

    /// The next wait.
    pub(crate) fn next(&mut self) -> Duration {
        let wait = self.0;
        self.0 = (wait * 2).min(PROBE_AT_MOST);
        wait
    }
}

/// Routes `requests` until the channel closes and every request is answered on `answers`.
pub async fn run(
    mesh: Arc<dyn Mesh>,
    cfg: RouterConfig,
    mut requests: mpsc::Receiver<Request>,
    mut cmds: mpsc::UnboundedReceiver<RouterCmd>,
    answers: mpsc::UnboundedSender<Answer>,
) -> RouterStats {
    let start = Instant::now();
    let mut disp = Dispatcher::new(cfg.dispatch);
    let mut stats = RouterStats::default();
    let mut open: Vec<Request> = Vec::new();
    let mut batches: HashMap<u64, Batch> = HashMap::new();
    let mut next_batch = 0u64;
    let mut calls: JoinSet<CallResult> = JoinSet::new();
    let mut events = mesh.peer_events();
    let (res_tx, mut res_rx) = mpsc::unbounded_channel::<(u32, u32)>();
    // Instances down before whose link came back, with the stages they hold.
    let (back_tx, mut back_rx) = mpsc::unbounded_channel::<(u32, u32, u32)>();
    let mut closed = false;
    loop {
        if !open.is_empty() && (open.len() >= cfg.max_batch || disp.queued() == 0) {
            let b = next_batch;
            next_batch += 1;
            batches.insert(b, Batch { requests: std::mem::take(&mut open), attempts: 0 });
            disp.arrive(b);
        }
        while let Some(d) = disp.next_dispatch() {
            let Some(batch) = batches.get_mut(&d.batch) else { continue };
            batch.attempts += 1;
            let texts = batch.requests.iter().map(|r| r.text.clone()).collect();
            let msg = ExecMsg::Run { batch: d.batch, texts, split: d.split, onward: d.onward };
            let m = mesh.clone();
            let limit = cfg.call_timeout;
            calls.spawn(async move { (d, m.call(d.to, &msg, limit).await) });
        }
        if closed && open.is_empty() && batches.is_empty() {
            return stats;
        }
        tokio::select! {
            r = requests.recv(), if !closed => match r {
                Some(req) => open.push(req),
                None => closed = true,
            },
            Some(RouterCmd::Scale { node }) = cmds.recv() => {
                info!(node, "scaling: pairing the new instance");
                disp.scaling(node);
                tokio::spawn(follow(mesh.clone(), (node, cfg.dispatch.old), cfg.dispatch.layers, cfg.poll_every, cfg.call_timeout, res_tx.clone()));
            }
            Some((r, k)) = res_rx.recv() => {
                disp.resident(r);
                disp.after_entry(k);
                stats.residency.push(ResidencyChange { at_s: start.elapsed().as_secs_f64(), resident: r, after_entry: k });
            }
            Some(j) = calls.join_next() => {
                let Ok(call) = j else { continue };
                // A node that answered "no such service" is asked until it serves again.
                if let Some(node) = answer(&mesh, &mut disp, &mut batches, &mut stats, &answers, cfg.max_attempts, call) {
                    let whole = !disp.takes_partial(node);
                    tokio::spawn(probe(mesh.clone(), node, whole, cfg.poll_every, cfg.call_timeout, back_tx.clone()));
                }
            }
            Some((node, resident, after_entry)) = back_rx.recv() => {
                if disp.up(node, resident, after_entry) {
                    info!(node, resident, "instance back: it takes batches again");
                    if resident < cfg.dispatch.layers {
                        tokio::spawn(follow(mesh.clone(), (node, cfg.dispatch.old), cfg.dispatch.layers, cfg.poll_every, cfg.call_timeout, res_tx.clone()));
                    }
                }
            }
            ev = events.recv() => match ev {
                Ok(PeerEvent::Down { peer, .. }) => disp.down(peer),
                Ok(PeerEvent::Up { peer, .. }) if disp.is_down(peer) => {
                    let whole = !disp.takes_partial(peer);
                    tokio::spawn(probe(mesh.clone(), peer, whole, cfg.poll_every, cfg.call_timeout, back_tx.clone()));
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return stats,
                _ => {}
            },
        }
    }
}

/// Asks `node`, marked down, what it holds, and reports an instance that can serve on `tx`
/// (with `whole`, only once it holds every stage; the dispatcher decides whether it takes
/// batches again). It asks every `every` — and while the node runs no `exec` service yet, each
/// wait twice the last, up to [`PROBE_AT_MOST`]. The probe ends when its link fails (its coming
/// back starts another), on any other answer, or when the router is gone.
async fn probe(
    mesh: Arc<dyn Mesh>,
    node: u32,
    whole: bool,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<(u32, u32, u32)>,
) {
    let mut backoff = Backoff::new(every);
    while !tx.is_closed() && mesh.connected_to(node) {
        let wait = match mesh.call(node, &ExecMsg::Status, limit).await {
            Ok(ExecMsg::State { resident, layers, .. }) if whole && resident < layers => every,
            Ok(ExecMsg::State { resident, after_entry, .. }) => {
                let _ = tx.send((node, resident, after_entry));
                return;
            }
            Err(e) if e.no_such_service().is_some() => backoff.next(),
            other => return debug!(node, answer = ?other, "a node marked down serves nothing"),
        };
        tokio::time::sleep(wait).await;
    }
}

/// Pairs `node` with `old` (step 1: its activation slots are ready before the first layer
/// lands), then asks it for its resident layers until it holds them all; reports each change.
async fn follow(
    mesh: Arc<dyn Mesh>,
    (node, old): (u32, u32),
    layers: u32,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<(u32, u32)>,
) {
    match mesh.call(node, &ExecMsg::PairWith { peer: old }, limit).await {
        Ok(ExecMsg::Ack) => {}
        // Pairing again at the first split batch is the instance's own fallback.
        other => debug!(node, old, answer = ?other, "pairing ahead failed"),
    }
    let mut last = None;
    // Until the router is gone too (it may finish before the copy does).
    while !tx.is_closed() {
        match mesh.call(node, &ExecMsg::Status, limit).await {
            Ok(ExecMsg::State { resident, after_entry, .. }) => {
                if last != Some((resident, after_entry)) {
                    last = Some((resident, after_entry));
                    if tx.send((resident, after_entry)).is_err() || resident >= layers {
                        return;
                    }
                }
            }
            Ok(other) => debug!(node, ?other, "unexpected status answer"),
            Err(e) if !mesh.connected_to(node) || e.no_such_service().is_some() => {
                return debug!(node, error = %e, "the new instance is gone")
            }
            Err(e) => debug!(node, error = %e, "status"),
        }
        tokio::time::sleep(every).await;
    }
}

/// Handles a batch's call result; returns a node it has just marked down for answering "no
/// such service" (to be probed).
fn answer(
    mesh: &Arc<dyn Mesh>,
    disp: &mut Dispatcher,
    batches: &mut HashMap<u64, Batch>,
    stats: &mut RouterStats,
    answers: &mpsc::UnboundedSender<Answer>,
    max_attempts: u32,
    (d, r): CallResult,
) -> Option<u32> {
    let Dispatch { batch: b, to, split, onward } = d;
    let give_back = |result: Result<Vec<Vec<f32>>, String>,
                     batches: &mut HashMap<u64, Batch>,
                     stats: &mut RouterStats| {
        let Some(batch) = batches.remove(&b) else { return };
        let now = Instant::now();
        for (i, req) in batch.requests.into_iter().enumerate() {
            let result = match &result {
                Ok(e) => e.get(i).cloned().ok_or_else(|| "the instance answered fewer embeddings".to_string()),
                Err(e) => Err(e.clone()),
            };
            if result.is_ok() {
                stats.served += 1;
            } else {
                stats.refused += 1;
            }
            let _ = answers.send(Answer { id: req.id, result, arrived: req.arrived, answered: now, to, split, onward });
        }
    };
    let mut unserved = None;
    let retry = match r {
        Ok(ExecMsg::Done { embeddings, .. }) => {
            disp.done(b);
            give_back(Ok(embeddings), batches, stats);
            return None;
        }
        Ok(ExecMsg::Failed { message, retry: false }) => {
            disp.done(b);
            give_back(Err(message), batches, stats);
            return None;
        }
        Ok(ExecMsg::Failed { message, .. }) => message,
        Ok(other) => format!("unexpected answer {other:?}"),
        Err(e) => {
            // A node whose link still answers but that runs no exec instance takes no more
            // batches either: retried at once, it would refuse them all.
            if let Some(peer) = e.no_such_service() {
                if !disp.is_down(peer) {
                    disp.down(peer);
                    unserved = disp.is_down(peer).then_some(peer);
                }
            }
            e.to_string()
        }
    };
    // The instances involved that are gone take no more batches.
    for n in std::iter::once(to).chain(split.map(|s| s.then)).chain(onward.map(|s| s.then)) {
        if !mesh.connected_to(n) {
            disp.down(n);
        }
    }
    let attempts = batches.get(&b).map_or(0, |x| x.attempts);
    if attempts >= max_attempts {
        disp.done(b);
        give_back(Err(format!("{attempts} attempts; the last: {retry}")), batches, stats);
    } else {
        debug!(batch = b, to, error = %retry, "batch failed; queued again");
        stats.requeued += 1;
        disp.failed(b);
    }
    unserved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_waits_double_up_to_their_bound() {
        let mut b = Backoff::new(Duration::from_millis(200));
        let waits: Vec<u128> = (0..5).map(|_| b.next().as_millis()).collect();
        assert_eq!(waits, [200, 400, 800, 1000, 1000]);
    }
}
