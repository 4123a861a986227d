//! The manager's side of failure detection: peer events into the [`Detector`](super::Detector),
//! suspects due declared dead (the pool repairs them), dead members whose link stayed up
//! re-admitted, and each node's history.

use cascade_transport::PeerEvent;
use tokio::sync::broadcast;
use tracing::{info, warn};

use super::{Manager, ManagerError, Notice, HISTORY};
use crate::meta::{Event, MetaStore};
use crate::pool::{Action, NodeId};

impl<S: MetaStore + 'static> Manager<S> {
    /// Whether the manager has a link to node `n` now.
    pub(super) fn connected(&self, n: NodeId) -> bool {
        self.io.connected(n)
    }

    /// Declares node `n` dead: the pool replaces its copies (the actions returned).
    /// A drained node that holds nothing is simply gone: nothing to repair.
    pub(super) async fn declare_dead(&mut self, n: NodeId) -> Result<Vec<Action>, ManagerError> {
        let drained = self.pool().is_draining(n) && !self.pool().copies().any(|c| c.node == n);
        if drained {
            info!(node = n, after = ?self.cfg.dead_after, "a drained node is gone: nothing to repair");
        } else {
            warn!(node = n, after = ?self.cfg.dead_after, "declaring the node dead; repairing the pool");
            self.count_repair("node_down");
        }
        self.detector.forget(n);
        self.notice(Notice::NodeDown { node: n, drained });
        let actions = self.apply(Event::NodeDown(n)).await?;
        let what =
            if drained { "gone after its drain; nothing to repair" } else { "declared dead; its copies were replaced" };
        self.remember(n, what.into());
        Ok(actions)
    }

    /// Records what happened to node `n`.
    pub(super) fn remember(&mut self, n: NodeId, what: String) {
        let h = self.history.entry(n).or_default();
        h.push_back((self.since.elapsed().as_secs_f64(), what));
        while h.len() > HISTORY {
            h.pop_front();
        }
    }

    /// A member the pool holds dead.
    fn is_dead_member(&self, n: NodeId) -> bool {
        self.pool().members().any(|(m, live)| m == n && !live)
    }

    /// Re-admits a node declared dead whose link stayed up: the pool counts it live (and empty)
    /// again, and the copies it still holds from before its death — replaced meanwhile — are
    /// dropped.
    async fn readmit(&mut self, n: NodeId) -> Result<Vec<Action>, ManagerError> {
        let stale = self.io.list(vec![n]).await.ours.remove(&n).unwrap_or_default();
        let actions = self.apply(Event::NodeUp(n)).await?;
        info!(node = n, stale = stale.len(), "re-admitting a node declared dead; dropping the copies it kept");
        self.io.drop_all(stale.iter().map(|c| (n, *c)).collect()).await;
        self.remember(n, format!("re-admitted; {} stale copies dropped", stale.len()));
        Ok(actions)
    }

    /// A peer event from the mesh, or the news that some were missed.
    pub(super) fn note_peer_result(&mut self, ev: Result<PeerEvent, broadcast::error::RecvError>) {
        match ev {
            Ok(ev) => self.note_peer(ev),
            Err(broadcast::error::RecvError::Lagged(_)) => self.recheck_links(),
            Err(broadcast::error::RecvError::Closed) => {}
        }
    }

    /// A link down makes a live pool node a suspect; a link up clears it. A dead member's link
    /// coming up starts its wait for re-admission; going down again stops it.
    fn note_peer(&mut self, ev: PeerEvent) {
        let now = tokio::time::Instant::now();
        match ev {
            PeerEvent::Down { peer, reason, graceful } => {
                // A node that said goodbye is suspected like one whose link failed: it may be
                // restarting, and the detector's wait tells the two apart; the history says which.
                let how = if graceful { "left" } else { "link down" };
                if self.pool().live_nodes().any(|x| x == peer) {
                    info!(node = peer, %reason, graceful, "link to a pool node went down");
                    self.detector.link_down(now, peer);
                    self.remember(peer, format!("{how}: {reason}"));
                } else if self.is_dead_member(peer) {
                    self.detector.dead_link_down(peer);
                    self.remember(peer, format!("link down again before re-admission: {reason}"));
                }
            }
            PeerEvent::Up { peer, .. } => {
                if self.is_dead_member(peer) {
                    info!(node = peer, "a node declared dead is back; re-admitting it if it stays");
                    self.detector.dead_link_up(now, peer);
                    self.remember(peer, "link up after its death; waiting before re-admission".into());
                } else if self.detector.suspects().contains_key(&peer) {
                    self.detector.link_up(peer);
                    self.remember(peer, "link up in time: not dead".into());
                }
            }
        }
    }

    /// Peer events were missed: every live pool node without a link becomes a suspect, and
    /// every dead one with a link starts its wait for re-admission.
    pub(super) fn recheck_links(&mut self) {
        let now = tokio::time::Instant::now();
        for (n, live) in self.pool().members().collect::<Vec<_>>() {
            match (live, self.connected(n)) {
                (true, false) => self.detector.link_down(now, n),
                (false, true) => self.detector.dead_link_up(now, n),
                _ => {}
            }
        }
    }

    /// Takes the peer events that arrived and declares the suspects that are due dead. Returns
    /// the resulting actions.
    pub(super) async fn poll_peers(&mut self) -> Result<Vec<Action>, ManagerError> {
        loop {
            match self.events.try_recv() {
                Ok(ev) => self.note_peer(ev),
                Err(broadcast::error::TryRecvError::Lagged(_)) => self.recheck_links(),
                Err(_) => break,
            }
        }
        let io = self.io.clone();
        let now = tokio::time::Instant::now();
        let due = self.detector.poll_dead(now, |n| io.connected(n));
        let back = self.detector.poll_returned(now, |n| io.connected(n));
        let mut actions = Vec::new();
        for n in due {
            actions.extend(self.declare_dead(n).await?);
        }
        for n in back {
            actions.extend(self.readmit(n).await?);
        }
        self.publish();
        Ok(actions)
    }
}
