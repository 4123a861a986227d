//! The manager's failure detector, sans I/O: it takes peer events and the time, and says which
//! nodes are due to be declared dead (seed paper 004, "Fault tolerance": a node whose link stays
//! down for `dead_after` is dead; a link that comes back in time clears the suspicion), and
//! which dead nodes are due to be re-admitted.
//!
//! Re-admission has hysteresis: a node declared dead whose link comes back is a *returning*
//! node, re-admitted only once its link stayed up for `dead_after` too; a link that drops again
//! before that restarts the wait. (The paper does not re-admit; a false death — a paused process,
//! a network blip — would otherwise shrink the pool for good.)

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::pool::NodeId;

/// Suspects and when their links went down.
#[derive(Debug, Clone)]
pub struct Detector {
    dead_after: Duration,
    suspects: BTreeMap<NodeId, Instant>,
    returning: BTreeMap<NodeId, Instant>,
}

impl Detector {
    /// A detector declaring a node dead once its link stayed down for `dead_after`.
    pub fn new(dead_after: Duration) -> Detector {
        Detector { dead_after, suspects: BTreeMap::new(), returning: BTreeMap::new() }
    }

    /// The link to `node` went down at `now`: it becomes a suspect (if it is not one already).
    pub fn link_down(&mut self, now: Instant, node: NodeId) {
        self.suspects.entry(node).or_insert(now);
    }

    /// The link to `node` is up again: it is no longer a suspect.
    pub fn link_up(&mut self, node: NodeId) {
        self.suspects.remove(&node);
    }

    /// The link to a node declared dead is up at `now`: it may be re-admitted once the link
    /// stays up for `dead_after` (an earlier return that is still waiting keeps its clock).
    pub fn dead_link_up(&mut self, now: Instant, node: NodeId) {
        self.returning.entry(node).or_insert(now);
    }

    /// The link to a returning node went down again: its wait starts over at its next return.
    pub fn dead_link_down(&mut self, node: NodeId) {
        self.returning.remove(&node);
    }

    /// Returning nodes due at `now` whose link is still up: the driver re-admits them. A due
    /// node whose link is down again is dropped from the returning set.
    pub fn poll_returned(&mut self, now: Instant, connected: impl Fn(NodeId) -> bool) -> Vec<NodeId> {
        take_due(&mut self.returning, now, self.dead_after).into_iter().filter(|n| connected(*n)).collect()
    }

    /// Returning nodes, with when their link came back.
    pub fn returning(&self) -> &BTreeMap<NodeId, Instant> {
        &self.returning
    }

    /// When the next suspect or returning node is due, if any: the driver wakes up then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.suspects.values().chain(self.returning.values()).min().map(|t| *t + self.dead_after)
    }

    /// Suspects due at `now`, which the driver declares dead; a suspect whose link is up again
    /// (`connected`) is cleared instead. Due nodes stop being suspects.
    pub fn poll_dead(&mut self, now: Instant, connected: impl Fn(NodeId) -> bool) -> Vec<NodeId> {
        take_due(&mut self.suspects, now, self.dead_after).into_iter().filter(|n| !connected(*n)).collect()
    }

    /// The current suspects (unreachable, not yet declared dead), with when their link went down.
    pub fn suspects(&self) -> &BTreeMap<NodeId, Instant> {
        &self.suspects
    }

    /// Forgets `node` (it was declared dead by other means).
    pub fn forget(&mut self, node: NodeId) {
        self.suspects.remove(&node);
    }
}

/// Removes and returns the nodes whose clock in `since` started at least `after` before `now`.
fn take_due(since: &mut BTreeMap<NodeId, Instant>, now: Instant, after: Duration) -> Vec<NodeId> {
    let due: Vec<NodeId> = since.iter().filter(|(_, t)| now >= **t + after).map(|(n, _)| *n).collect();
    for n in &due {
        since.remove(n);
    }
    due
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_due_after_dead_after_unless_its_link_came_back() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Detector::new(ms(500));
        assert_eq!(d.poll_timeout(), None);
        d.link_down(t0, 1);
        d.link_down(t0 + ms(100), 2);
        d.link_down(t0 + ms(200), 1); // a second Down does not restart the clock
        assert_eq!(d.poll_timeout(), Some(t0 + ms(500)));
        assert!(d.poll_dead(t0 + ms(499), |_| false).is_empty());
        assert_eq!(d.poll_dead(t0 + ms(500), |_| false), vec![1]);
        assert_eq!(d.poll_timeout(), Some(t0 + ms(600)));
        // Node 2's link flaps back before it is due: cleared.
        d.link_up(2);
        assert_eq!(d.poll_timeout(), None);
        // A link that is up again when the node is due (the Up event was missed) clears it too.
        d.link_down(t0 + ms(1000), 3);
        assert!(d.poll_dead(t0 + ms(2000), |n| n == 3).is_empty());
        assert!(d.suspects().is_empty());
    }

    #[test]
    fn a_dead_node_is_readmitted_only_after_its_link_stayed_up_for_dead_after() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Detector::new(ms(500));
        d.dead_link_up(t0, 4);
        assert_eq!(d.poll_timeout(), Some(t0 + ms(500)));
        assert!(d.poll_returned(t0 + ms(499), |_| true).is_empty());
        // It flaps: the wait starts over at its next return.
        d.dead_link_down(4);
        d.dead_link_up(t0 + ms(600), 4);
        assert!(d.poll_returned(t0 + ms(1000), |_| true).is_empty());
        assert_eq!(d.poll_returned(t0 + ms(1100), |_| true), vec![4]);
        assert!(d.returning().is_empty());
        // Due, but its link is down again (the event was missed): not re-admitted.
        d.dead_link_up(t0 + ms(2000), 5);
        assert!(d.poll_returned(t0 + ms(3000), |_| false).is_empty());
    }
}
