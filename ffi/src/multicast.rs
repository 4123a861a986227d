//! Chained multicast from C: plan (JSON out) and execute, with `LayerReady` progress through
//! the completion queue.

use std::collections::BTreeSet;
use std::ffi::c_char;
use std::time::Duration;

use cascade_multicast::cluster::RunSpec;
use cascade_multicast::executor::new_run_id;
use cascade_multicast::{plan, Event, Loc, MeshRates, PlannerKind, Request, Topology};

use crate::buf;
use crate::endpoint::cascade_endpoint;
use crate::error::{guard, FfiError, FfiResult, CASCADE_ERR_MULTICAST, CASCADE_IN_PROGRESS, CASCADE_OK};
use crate::ops::{
    cascade_completion, CASCADE_EVENT_LAYER_READY, CASCADE_EVENT_MULTICAST_DONE, CASCADE_EVENT_TARGET_DONE,
};
use crate::region::cascade_region;

/// A multicast request as C passes it (JSON).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct McRequest {
    /// Bytes per target (with a lent source: at most the region's length; default all of it).
    #[serde(default)]
    bytes: Option<u64>,
    /// Locations holding a copy (`"NODE/host"`, `"NODE/gpuN"`); with a lent source, omitted.
    #[serde(default)]
    sources: Vec<Loc>,
    /// Locations to fill.
    targets: Vec<Loc>,
    /// `blitz` (default), `chain`, `star` or `tree`.
    #[serde(default)]
    planner: Option<PlannerKind>,
    /// Equal layers the bytes are split into (`LayerReady` granularity; default 1).
    #[serde(default)]
    layers: Option<u64>,
    /// NIC rate the planner assumes, Gbit/s (default 25).
    #[serde(default)]
    nic_gbps: Option<f64>,
    /// Seed of the synthetic model sources are filled with (no lent source; default 1).
    #[serde(default)]
    seed: Option<u64>,
    /// Give up after this many seconds (default 600).
    #[serde(default)]
    deadline_s: Option<f64>,
    /// Keep the run after verification so that each target's node can take its copy
    /// ([`cascade_multicast_take`]); the controller then ends it with
    /// [`cascade_multicast_release`]. Default false: targets are released at once.
    #[serde(default)]
    hold: bool,
}

impl McRequest {
    fn parse(text: &str) -> FfiResult<McRequest> {
        let r: McRequest = serde_json::from_str(text).map_err(|e| FfiError::arg(format!("request JSON: {e}")))?;
        if r.targets.is_empty() {
            return Err(FfiError::arg("request JSON: no targets"));
        }
        if r.layers == Some(0) || r.bytes == Some(0) {
            return Err(FfiError::arg("request JSON: bytes and layers must be positive"));
        }
        if r.nic_gbps.is_some_and(|g| !(g > 0.0 && g.is_finite())) {
            return Err(FfiError::arg("request JSON: nic_gbps must be positive"));
        }
        if r.deadline_s.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
            return Err(FfiError::arg("request JSON: deadline_s must be positive"));
        }
        Ok(r)
    }

    fn topology(&self, e: &cascade_endpoint) -> FfiResult<Topology> {
        let g = self.nic_gbps.unwrap_or(25.0);
        let rates = MeshRates { nic_gbps: g, tcp_gbps: g, shm_gbps: 4.0 * g, machine_gbps: None };
        let gpus = self.sources.iter().chain(&self.targets).filter_map(|l| l.gpu).max().map_or(1, |g| g + 1);
        Topology::from_mesh(&e.ep.config().cluster, e.ep.node(), &e.ep.connected(), gpus, rates)
            .map_err(|err| FfiError::new(CASCADE_ERR_MULTICAST, err.to_string()))
    }
}

/// Plans a multicast over the endpoint's current mesh without running it, and writes the plan
/// (planner, chunk size, edges, predicted completion per target) as JSON into `(buf, cap)`.
/// The request is JSON: `{"bytes": N, "sources": ["0/host"], "targets": ["1/host", "2/gpu0"],
/// "planner": "blitz", "nic_gbps": 25}` (`planner` and `nic_gbps` optional).
///
/// # Safety
/// `ep` is a live endpoint; `request_json` is a NUL-terminated string; `buf` is writable for
/// `cap` bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_multicast_plan(
    ep: *const cascade_endpoint,
    request_json: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("cascade_multicast_plan", || {
        // SAFETY: the caller's contract.
        let (e, text) = unsafe { (buf::handle(ep, "ep")?, buf::text(request_json, "request_json")?) };
        let r = McRequest::parse(&text)?;
        let bytes = r.bytes.ok_or_else(|| FfiError::arg("request JSON: bytes is required to plan"))?;
        let req = Request { bytes, sources: r.sources.clone(), targets: r.targets.clone() };
        let p = plan(&r.topology(e)?, &req, r.planner.unwrap_or(PlannerKind::Blitz))
            .map_err(|err| FfiError::new(CASCADE_ERR_MULTICAST, err.to_string()))?;
        let json = serde_json::to_string(&p).map_err(|err| FfiError::new(CASCADE_ERR_MULTICAST, err.to_string()))?;
        // SAFETY: the caller's contract for the buffer.
        unsafe { buf::out_text(&json, buf, cap, needed) }
    })
}

/// Starts a multicast from this endpoint (its controller) and returns [`CASCADE_IN_PROGRESS`]
/// at once. Progress arrives through [`crate::cascade_poll`] with `tag`: a
/// `CASCADE_EVENT_LAYER_READY` per target and layer (every chunk of layers `0..=layer`
/// verified there), a `CASCADE_EVENT_TARGET_DONE` per target, and last one
/// `CASCADE_EVENT_MULTICAST_DONE` whose status says whether every target was filled and verified
/// end to end; its detail ([`crate::cascade_completion_detail`]) is the outcome as JSON.
///
/// With `source` non-null, that registered region of this endpoint is the one source (lent to
/// the run, read but never written; keep it unchanged until the run is done) and the request
/// names no sources; otherwise the sources hold a synthetic model of `seed`. Every member node
/// must run Cascade's multicast service (a `cascade node` or another endpoint of this API).
/// Target regions are allocated on their nodes and released after verification.
///
/// # Safety
/// `ep` is a live endpoint; `request_json` is a NUL-terminated string; `source` is null or a
/// live region of `ep`.
#[no_mangle]
pub unsafe extern "C" fn cascade_multicast_execute(
    ep: *const cascade_endpoint,
    request_json: *const c_char,
    source: *const cascade_region,
    tag: u64,
) -> i32 {
    guard("cascade_multicast_execute", || {
        // SAFETY: the caller's contract.
        let (e, text) = unsafe { (buf::handle(ep, "ep")?, buf::text(request_json, "request_json")?) };
        let r = McRequest::parse(&text)?;
        let topology = r.topology(e)?;
        // SAFETY: null or a live region (the caller's contract).
        let source = unsafe { source.as_ref() };
        let me = e.ep.node();
        let (bytes, sources) = match source {
            Some(s) => {
                if !r.sources.is_empty() {
                    return Err(FfiError::arg("a lent source replaces the request's sources: name none"));
                }
                let len = s.region.len();
                let bytes = r.bytes.unwrap_or(len);
                if bytes > len {
                    return Err(FfiError::arg(format!("bytes {bytes} exceed the source region's {len}")));
                }
                (bytes, vec![Loc::host(me)])
            }
            None => {
                if r.sources.is_empty() {
                    return Err(FfiError::arg("request JSON: no sources (and no source region)"));
                }
                (r.bytes.ok_or_else(|| FfiError::arg("request JSON: bytes is required"))?, r.sources.clone())
            }
        };
        let layers = r.layers.unwrap_or(1).min(bytes);
        let mut spec = RunSpec::synthetic(topology, bytes, sources, r.targets.clone(), r.seed.unwrap_or(1));
        spec.planner = r.planner.unwrap_or(PlannerKind::Blitz);
        spec.layers = (0..layers).map(|i| i * bytes / layers..(i + 1) * bytes / layers).collect();
        spec.deadline = Duration::from_secs_f64(r.deadline_s.unwrap_or(600.0));
        spec.hold = r.hold;
        if let Some(s) = source {
            let run = new_run_id();
            e.services.multicast.lend(run, Loc::host(me), s.region.clone(), me)?;
            spec.run = Some(run);
            spec.lent = BTreeSet::from([Loc::host(me)]);
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        spec.progress = Some(tx);
        let (queue, details) = (e.queue.clone(), e.details.clone());
        let (q2, d2) = (queue.clone(), details.clone());
        let forward = e.rt.spawn(async move {
            while let Some((_, ev)) = rx.recv().await {
                let (kind, target, layer) = match ev {
                    Event::LayerReady { target, layer } => (CASCADE_EVENT_LAYER_READY, target, layer as u32),
                    Event::TargetDone { target } => (CASCADE_EVENT_TARGET_DONE, target, 0),
                    _ => continue,
                };
                let c = cascade_completion { tag, bytes: 0, status: CASCADE_OK, kind, node: target.node, layer };
                cascade_endpoint::complete(&q2, &d2, c, None);
            }
        });
        let controller = e.controller.clone();
        let held = e.held_runs.clone();
        e.rt.spawn(async move {
            let out = controller.run(&spec).await;
            if let (Ok(o), true) = (&out, spec.hold) {
                let members = spec.sources.iter().chain(&spec.targets).copied().collect();
                crate::endpoint::lock(&held).insert(o.run, members);
            }
            drop(spec);
            // Every event of the run is queued before its end is.
            let _ = forward.await;
            let (status, detail) = match out {
                Ok(o) => {
                    let ok = o.report.failed.is_empty() && o.mismatched.is_empty();
                    let detail = serde_json::json!({
                        "run": o.run,
                        "planner": o.plan.planner,
                        "bytes": o.plan.bytes,
                        "completed": o.report.completed,
                        "failed": o.report.failed.iter().map(|(l, why)| (l.to_string(), why.clone())).collect::<Vec<_>>(),
                        "verified": o.verified,
                        "mismatched": o.mismatched,
                        "setup_seconds": o.setup_seconds,
                        "transfer_seconds": o.transfer_seconds,
                    });
                    (if ok { CASCADE_OK } else { CASCADE_ERR_MULTICAST }, detail.to_string())
                }
                Err(err) => (CASCADE_ERR_MULTICAST, serde_json::json!({ "error": err.to_string() }).to_string()),
            };
            let c = cascade_completion { tag, bytes, status, kind: CASCADE_EVENT_MULTICAST_DONE, node: me, layer: 0 };
            cascade_endpoint::complete(&queue, &details, c, Some(detail));
        });
        Ok(CASCADE_IN_PROGRESS)
    })
}

/// On a target's node: takes the copy run `run` filled at location `loc` (`"NODE/host"`,
/// `"NODE/gpuN"`; NODE is this endpoint's node) out of the run — a run started with
/// `"hold": true` whose `CASCADE_EVENT_MULTICAST_DONE` has arrived (its detail names the run).
/// `*out` is then a library-owned region holding the verified bytes ([`crate::cascade_region_ptr`]),
/// deregistered by the caller like any other.
///
/// # Safety
/// `ep` is a live endpoint; `loc` is a NUL-terminated string; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_multicast_take(
    ep: *const cascade_endpoint,
    run: u32,
    loc: *const c_char,
    out: *mut *mut cascade_region,
) -> i32 {
    guard("cascade_multicast_take", || {
        // SAFETY: the caller's contract.
        let (e, loc, out) = unsafe { (buf::handle(ep, "ep")?, buf::text(loc, "loc")?, buf::out_param(out, "out")?) };
        let loc: Loc =
            loc.parse().map_err(|err: cascade_multicast::topology::BadLoc| FfiError::arg(err.to_string()))?;
        if loc.node != e.ep.node() {
            return Err(FfiError::arg(format!("{loc} is not on this endpoint's node {}", e.ep.node())));
        }
        let region = e.services.multicast.detach(run, loc)?;
        out.put(cascade_region::hand_out(e, region));
        Ok(CASCADE_OK)
    })
}

/// On the controller: ends held run `run` on every member's node (what no target took is freed).
///
/// # Safety
/// `ep` is a live endpoint.
#[no_mangle]
pub unsafe extern "C" fn cascade_multicast_release(ep: *const cascade_endpoint, run: u32) -> i32 {
    guard("cascade_multicast_release", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        let members = crate::endpoint::lock(&e.held_runs)
            .remove(&run)
            .ok_or_else(|| FfiError::arg(format!("run {run} is not a held run of this endpoint")))?;
        e.rt.block_on(e.controller.release(run, &members));
        Ok(CASCADE_OK)
    })
}
