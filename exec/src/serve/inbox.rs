//! An instance's service inbox while it may be stopped: the next request or the stop, and on
//! the stop, what was queued refused so that its senders go elsewhere at once instead of
//! waiting for their time limit.

use cascade_transport::{Inbox, Message, Received, ServiceExt};
use tokio::sync::watch;

/// The next message, or `None` once `stop` is set (or the node's services are gone).
pub(crate) async fn next<M: Message>(inbox: &mut Inbox<M>, stop: &mut watch::Receiver<bool>) -> Option<Received<M>> {
    tokio::select! {
        m = inbox.recv() => m,
        _ = stop.wait_for(|&s| s) => None,
    }
}

/// Unsubscribes (requests from now on are answered "no such service") and answers every
/// request still queued with `refusal`.
pub(crate) fn refuse_queued<M: Message>(mesh: &(impl ServiceExt + ?Sized), mut inbox: Inbox<M>, refusal: &M) {
    inbox.close();
    while let Some(m) = inbox.try_recv() {
        if let Some(reply) = m.reply_to {
            let _ = mesh.reply(&reply, refusal);
        }
    }
}
