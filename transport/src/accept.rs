//! What every accept loop of a server here (peers, metrics, the pool's admin) does when
//! `accept` fails.

use std::time::Duration;

/// The pause after a failed `accept`.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Logs a failed `accept` of the listener serving `what` and waits [`ACCEPT_BACKOFF`] before the
/// caller accepts again. Out of descriptors (EMFILE) and the like, the connection stays in the
/// backlog and `accept` fails again at once: retrying at once would spin a core.
pub async fn back_off_after_failed_accept(what: &str, e: &std::io::Error) {
    tracing::warn!(error = %e, "{what} accept failed; backing off");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}
