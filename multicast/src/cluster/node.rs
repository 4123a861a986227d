//! The node side of the control protocol: what `cascade node` runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cascade_transport::{Endpoint, Link, Op, PeerEvent, Region, TransportError};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{fill_synthetic, send, Control, HeldCopies};
use crate::executor::{notice_run, run_member, CoordSink, MemberCmd, MemberCtx, Router, ToCoord};
use crate::topology::{Loc, NodeId};

/// A handler for messages that are neither chunk notices nor multicast control (the parameter
/// pool's node requests): returns `true` when it took the message.
pub type Extension = Arc<dyn Fn(NodeId, &Bytes) -> bool + Send + Sync>;

struct NodeRun {
    controller: NodeId,
    router: Arc<Router>,
    regions: BTreeMap<Loc, Region>,
    /// Locations whose region is a held copy lent to the run (not deregistered on release).
    lent: BTreeSet<Loc>,
    cmds: BTreeMap<Loc, mpsc::UnboundedSender<MemberCmd>>,
    resent: Arc<AtomicU64>,
}

type Runs = Arc<Mutex<BTreeMap<u32, NodeRun>>>;

struct ToController {
    link: Arc<dyn Link>,
    run: u32,
}

impl CoordSink for ToController {
    fn send(&self, msg: ToCoord) {
        drop(self.link.post(vec![Op::Send { payload: Control::Report { run: self.run, msg }.encode() }]));
    }
}

/// Serves multicast runs on this node until its endpoint shuts down, holding no copies and with
/// no extension: what benchmarks and tests run.
pub async fn serve_node(ep: Arc<Endpoint>, op_timeout: Duration) {
    serve_node_with(ep, op_timeout, Arc::default(), None).await
}

/// Serves multicast runs on this node until its endpoint shuts down: the daemon's main loop.
/// `held` are the node's copies (sources with `Prepare{copy}`, filled by `Keep`); `ext` gets the
/// messages the multicast does not know.
pub async fn serve_node_with(ep: Arc<Endpoint>, op_timeout: Duration, held: Arc<HeldCopies>, ext: Option<Extension>) {
    let runs: Runs = Arc::default();
    let mut events = ep.events();
    loop {
        let m = tokio::select! {
            m = ep.recv() => match m { Some(m) => m, None => break },
            ev = events.recv() => {
                match ev {
                    Ok(PeerEvent::Down { peer, .. }) => drop_runs_of(&ep, &runs, peer),
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                    _ => {}
                }
                continue;
            }
        };
        // Chunk notices go to their run's router.
        if let Some(run) = notice_run(&m.payload) {
            if let Some(r) = runs.lock().unwrap_or_else(|e| e.into_inner()).get(&run) {
                r.router.route(run, &m.payload);
            }
            continue;
        }
        let Some(c) = Control::decode(&m.payload) else {
            if !ext.as_ref().is_some_and(|f| f(m.from, &m.payload)) {
                debug!(from = m.from, len = m.payload.len(), "ignoring an unknown message");
            }
            continue;
        };
        if let Err(e) = handle(&ep, &runs, &held, m.from, c.clone(), op_timeout) {
            warn!(error = %e, "control request failed");
            let run = match c {
                Control::Prepare { run, .. }
                | Control::Start { run, .. }
                | Control::AddChild { run, .. }
                | Control::Verify { run, .. }
                | Control::Keep { run, .. }
                | Control::Release { run } => run,
                _ => 0,
            };
            let _ = send(&ep, m.from, &Control::Error { run, message: e.to_string() });
        }
    }
}

/// The controller of these runs is gone: nobody will keep or release their regions.
fn drop_runs_of(ep: &Endpoint, runs: &Runs, controller: NodeId) {
    let mut guard = runs.lock().unwrap_or_else(|e| e.into_inner());
    let orphans: Vec<u32> = guard.iter().filter(|(_, r)| r.controller == controller).map(|(id, _)| *id).collect();
    for id in orphans {
        if let Some(r) = guard.remove(&id) {
            release(ep, &r);
            info!(run = id, controller, "dropped the run of a controller that went down");
        }
    }
}

fn release(ep: &Endpoint, r: &NodeRun) {
    for (loc, region) in &r.regions {
        if !r.lent.contains(loc) {
            ep.regions().deregister(region.id());
        }
    }
    // Dropping the command senders ends the member tasks.
}

/// crc32 of each `chunk` of `region[..bytes]` (the last one may be short).
pub fn chunk_crcs(region: &Region, bytes: u64, chunk: u64) -> Result<Vec<u32>, TransportError> {
    let chunk = chunk.max(1);
    (0..bytes.div_ceil(chunk)).map(|i| region.crc32(i * chunk, chunk.min(bytes - i * chunk))).collect()
}

fn handle(
    ep: &Arc<Endpoint>,
    runs: &Runs,
    held: &HeldCopies,
    from: NodeId,
    c: Control,
    op_timeout: Duration,
) -> Result<(), TransportError> {
    let mut guard = runs.lock().unwrap_or_else(|e| e.into_inner());
    match c {
        Control::Prepare { run, loc, bytes, chunk, fill, copy } => {
            let r = guard.entry(run).or_insert_with(|| NodeRun {
                controller: from,
                router: Arc::new(Router::default()),
                regions: BTreeMap::new(),
                lent: BTreeSet::new(),
                cmds: BTreeMap::new(),
                resent: Default::default(),
            });
            let (region, crcs) = match (copy, fill) {
                (Some(id), _) => {
                    let region = held.get(id).ok_or_else(|| protocol(format!("this node holds no copy {id}")))?;
                    if region.len() < bytes {
                        return Err(protocol(format!("copy {id} has {} bytes, the run moves {bytes}", region.len())));
                    }
                    r.lent.insert(loc);
                    let crcs = chunk_crcs(&region, bytes, chunk)?;
                    (region, Some(crcs))
                }
                (None, Some(seed)) => {
                    let region = ep.register_new(bytes)?;
                    fill_synthetic(&region, bytes, seed)?;
                    let crcs = chunk_crcs(&region, bytes, chunk)?;
                    (region, Some(crcs))
                }
                (None, None) => (ep.register_new(bytes)?, None),
            };
            let reply = Control::Prepared { run, loc, region: region.id().0, key: region.key().0, crcs };
            r.regions.insert(loc, region);
            send(ep, from, &reply)
        }
        Control::Start { run, loc, layout, source, children } => {
            let r = guard.get_mut(&run).ok_or_else(|| unknown(run))?;
            let region = r.regions.get(&loc).cloned().ok_or_else(|| unknown(run))?;
            let inbox = r.router.add(loc);
            let (tx, rx) = mpsc::unbounded_channel();
            r.cmds.insert(loc, tx);
            let ctx = MemberCtx {
                run,
                me: loc,
                is_source: source,
                layout: Arc::new(layout),
                mesh: ep.clone(),
                region,
                router: r.router.clone(),
                coord: Arc::new(ToController { link: ep.link(r.controller)?, run }),
                op_timeout,
                resent: r.resent.clone(),
            };
            tokio::spawn(run_member(ctx, children, inbox, rx));
            Ok(())
        }
        Control::AddChild { run, loc, child } => {
            let r = guard.get(&run).ok_or_else(|| unknown(run))?;
            if let Some(tx) = r.cmds.get(&loc) {
                let _ = tx.send(MemberCmd::AddChild(child));
            }
            Ok(())
        }
        Control::Verify { run, loc } => {
            let r = guard.get(&run).ok_or_else(|| unknown(run))?;
            let region = r.regions.get(&loc).ok_or_else(|| unknown(run))?;
            let bytes = region.len();
            send(ep, from, &Control::Verified { run, loc, crc: region.crc32(0, bytes)? })
        }
        Control::Keep { run, loc, copy } => {
            let r = guard.get_mut(&run).ok_or_else(|| unknown(run))?;
            if r.lent.contains(&loc) {
                return Err(protocol(format!("{loc} is a source of run {run}, not a new copy")));
            }
            let region = r.regions.remove(&loc).ok_or_else(|| unknown(run))?;
            // The member task may still hold its command sender; it only reads the region now.
            r.cmds.remove(&loc);
            if let Some(old) = held.insert(copy, region) {
                // A controller re-issued this copy after a restart: the new bytes replace the old.
                ep.regions().deregister(old.id());
            }
            send(ep, from, &Control::Kept { run, loc, copy })
        }
        Control::Release { run } => {
            if let Some(r) = guard.remove(&run) {
                release(ep, &r);
            }
            send(ep, from, &Control::Released { run })
        }
        other => {
            debug!(?other, "unexpected control message at a node");
            Ok(())
        }
    }
}

fn protocol(detail: String) -> TransportError {
    TransportError::Protocol { peer: None, detail }
}

fn unknown(run: u32) -> TransportError {
    protocol(format!("unknown multicast run {run}"))
}
