//! The router's calls, each in a task of its own: a request's prefill (with its KV
//! reservation), and the polls of an arriving instance and of a gone one.

use std::sync::Arc;
use std::time::Duration;

use cascade_transport::{Mesh, ServiceExt};
use tokio::sync::mpsc;
use tracing::debug;

use super::state::Outcome;
use super::{GenRequest, Report};
use crate::pd::proto::{KvGrant, LlmMsg, Role, Split};
use crate::serve::router::Backoff;
use crate::serve::ServeError;

/// Asks the arriving instance `node` for its resident stages every `every` and reports each
/// change on `tx`, until it holds them all or the router is gone. Failed calls (its link down
/// for a while) are tried again at the next poll.
pub(super) async fn follow(
    mesh: Arc<dyn Mesh>,
    node: u32,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<Report>,
) {
    let mut last = None;
    while !tx.is_closed() {
        match mesh.call(node, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { resident, layers, .. }) => {
                if last != Some(resident) {
                    last = Some(resident);
                    if tx.send(Report::Resident(node, resident)).is_err() || resident >= layers {
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
pub(super) async fn probe(
    mesh: Arc<dyn Mesh>,
    node: u32,
    whole: bool,
    every: Duration,
    limit: Duration,
    tx: mpsc::UnboundedSender<Report>,
) {
    let mut backoff = Backoff::new(every);
    while !tx.is_closed() && mesh.connected_to(node) {
        let wait = match mesh.call(node, &LlmMsg::Status, limit).await {
            Ok(LlmMsg::State { role: Role::Decode, running, .. }) if running > 0 => every,
            Ok(LlmMsg::State { role: Role::Prefill, resident, layers, .. }) if whole && resident < layers => every,
            Ok(state @ LlmMsg::State { .. }) => {
                let _ = tx.send(Report::Back(node, state));
                return;
            }
            Err(e) if e.no_such_service().is_some() => backoff.next(),
            other => return debug!(node, answer = ?other, "a node marked gone serves nothing"),
        };
        tokio::time::sleep(wait).await;
    }
}

/// Reserves KV on the first decode instance of `order` with room, then prefills on `to`, as
/// attempt `attempt` of the request.
pub(super) async fn prefill(
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
    // Saturating: a budget of u32::MAX ("until end of sequence") asks for more than any window
    // holds and is refused at the reservation; wrapped, it would reserve a few tokens and decode on.
    let tokens = (req.prompt.len() as u32).saturating_add(req.max_tokens);
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
        sample: req.sample,
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
