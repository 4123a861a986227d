//! Scaling an instance out: a chained multicast of the model from an instance's held copy to
//! new instances, whose `LayerReady` events are forwarded to them as they happen, so that they
//! serve their first layers while the rest arrives.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use cascade_multicast::cluster::{Controller, RunOutcome, RunSpec};
use cascade_multicast::executor::new_run_id;
use cascade_multicast::{CostModel, Event, Loc, PlannerKind, Topology};
use cascade_transport::{Mesh, ServiceExt};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::proto::ExecMsg;
use super::ServeError;
use cascade_param_pool::manifest::Manifest;

/// What a scale-out did.
#[derive(Debug, Clone)]
pub struct ScaleOutcome {
    /// The multicast's outcome.
    pub run: RunOutcome,
    /// Targets that hold their copy now (adopted by their instance).
    pub adopted: Vec<u32>,
}

/// Multicasts the model `manifest` describes from the held copy of the instance on `from` to the instances on `to`
/// (started with an arriving source), through the controller `ctl` on `mesh`; `progress`
/// receives every multicast event. `topology` describes the nodes and their links.
pub async fn scale_out(
    mesh: &Arc<dyn Mesh>,
    ctl: &Controller,
    manifest: &Manifest,
    topology: Topology,
    from: u32,
    to: &[u32],
    progress: Option<mpsc::UnboundedSender<(f64, Event)>>,
) -> Result<ScaleOutcome, ServeError> {
    const CALL: Duration = Duration::from_secs(30);
    let run = new_run_id();
    match mesh.call(from, &ExecMsg::Lend { run }, CALL).await? {
        ExecMsg::Ack => {}
        other => return Err(ServeError::Peer(format!("node {from} cannot lend its copy: {other:?}"))),
    }
    let source = Loc::host(from);
    let targets: Vec<Loc> = to.iter().map(|&n| Loc::host(n)).collect();
    let bytes = manifest.bytes;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let spec = RunSpec {
        topology,
        bytes,
        sources: vec![source],
        targets: targets.clone(),
        planner: PlannerKind::Blitz,
        layers: Vec::new(),
        seed: 0,
        deadline: Duration::from_secs(600),
        lent: BTreeSet::from([source]),
        run: Some(run),
        hold: true,
        layout: Some(manifest.layout()),
        progress: Some(tx),
        cost: CostModel::default(),
        start_at_once: true,
    };
    let running = ctl.run(&spec);
    tokio::pin!(running);
    let result = loop {
        tokio::select! {
            r = &mut running => break r,
            Some((t, ev)) = rx.recv() => forward(mesh, run, progress.as_ref(), t, ev),
        }
    };
    // Events still queued when the run ended.
    while let Ok((t, ev)) = rx.try_recv() {
        forward(mesh, run, progress.as_ref(), t, ev);
    }
    let members: Vec<Loc> = std::iter::once(source).chain(targets.iter().copied()).collect();
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            ctl.release(run, &members).await;
            return Err(ServeError::Peer(format!("multicast: {e}")));
        }
    };
    let mut adopted = Vec::new();
    for t in &out.verified {
        // The run's LayerReady messages travel ahead of this call on the same link.
        match mesh.call(t.node, &ExecMsg::Adopt { run }, CALL).await {
            Ok(ExecMsg::Ack) => adopted.push(t.node),
            other => warn!(node = t.node, answer = ?other, "the new instance did not adopt its copy"),
        }
    }
    ctl.release(run, &members).await;
    Ok(ScaleOutcome { run: out, adopted })
}

/// Forwards a `LayerReady` to its target's instance, and every event to `progress`.
fn forward(mesh: &Arc<dyn Mesh>, run: u32, progress: Option<&mpsc::UnboundedSender<(f64, Event)>>, t: f64, ev: Event) {
    if let Event::LayerReady { target, layer } = &ev {
        let msg = ExecMsg::LayerReady { run, layer: *layer as u32 };
        if let Err(e) = mesh.post_oneway(target.node, &msg) {
            debug!(node = target.node, error = %e, "cannot forward LayerReady");
        }
    }
    if let Some(p) = progress {
        let _ = p.send((t, ev));
    }
}
