//! Endpoints: create from a config or a cluster file, wait for the mesh, destroy; metrics.

use std::collections::VecDeque;
use std::ffi::c_char;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cascade_multicast::cluster::Controller;
use cascade_param_pool::node::{start_services, NodeServices};
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, Inbox, Received, ServiceExt};

use crate::buf;
use crate::error::{guard, FfiError, FfiResult, CASCADE_ERR_CONFIG, CASCADE_ERR_IO, CASCADE_IN_PROGRESS, CASCADE_OK};
use crate::message::AppMessage;
use crate::ops::cascade_completion;

/// Bytes that hold any address [`cascade_metrics_serve`] writes (IPv6, port and NUL included).
pub const CASCADE_ADDR_CAP: usize = 64;

/// `flags` of [`cascade_endpoint_config`]: never use shared memory with same-host peers.
pub const CASCADE_CONFIG_NO_SHM: u32 = 1;

/// Details kept for completions ([`crate::cascade_completion_detail`]): the newest this many.
const DETAILS: usize = 1024;

/// How an endpoint is made. Zero-initialise it, set `struct_size = sizeof(cascade_endpoint_config)`
/// and the fields you need; zero means the default for every optional field.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct cascade_endpoint_config {
    /// `sizeof(cascade_endpoint_config)` as the caller compiled it.
    pub struct_size: u32,
    /// This node's id in the cluster.
    pub node: u32,
    /// The cluster's membership as the text of a cluster file (TOML: `name`, `[[nodes]]` with
    /// `id`, `addr` and optional `host`). Copied.
    pub cluster_toml: *const c_char,
    /// The shared cluster secret (never sent on the wire). Copied.
    pub secret: *const u8,
    /// Its length in bytes (> 0).
    pub secret_len: usize,
    /// `CASCADE_CONFIG_*` flags.
    pub flags: u32,
    /// Limit for one operation once posted, milliseconds (0: 60 000).
    pub op_timeout_ms: u32,
    /// Most bytes of regions the library allocates for this node (0: what the system has).
    pub memory_limit: u64,
}

/// An endpoint: this process's node in a Cascade cluster (opaque).
pub struct cascade_endpoint {
    pub(crate) rt: tokio::runtime::Runtime,
    pub(crate) ep: Arc<Endpoint>,
    pub(crate) services: NodeServices,
    pub(crate) controller: Arc<Controller>,
    /// Runs this endpoint controlled with `"hold": true`, and their members, until released.
    pub(crate) held_runs: Arc<Mutex<std::collections::HashMap<u32, Vec<cascade_multicast::Loc>>>>,
    pub(crate) queue: Arc<Mutex<VecDeque<cascade_completion>>>,
    pub(crate) details: Arc<Mutex<VecDeque<(u64, String)>>>,
    pub(crate) inbox: Mutex<Inbox<AppMessage>>,
    /// A received message too large for the caller's last buffer, kept for the next call.
    pub(crate) held: Mutex<Option<Received<AppMessage>>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl cascade_endpoint {
    /// Queues a completion record, with its detail text (an error, a run's outcome) if any.
    pub(crate) fn complete(
        queue: &Mutex<VecDeque<cascade_completion>>,
        details: &Mutex<VecDeque<(u64, String)>>,
        c: cascade_completion,
        detail: Option<String>,
    ) {
        if let Some(d) = detail {
            let mut ds = lock(details);
            if ds.len() == DETAILS {
                ds.pop_front();
            }
            ds.push_back((c.tag, d));
        }
        lock(queue).push_back(c);
    }

    fn start(cfg: EndpointConfig) -> FfiResult<Box<cascade_endpoint>> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cascade-ffi")
            .enable_all()
            .build()
            .map_err(|e| FfiError::new(CASCADE_ERR_IO, format!("starting the runtime: {e}")))?;
        let op_timeout = cfg.op_timeout;
        let (ep, services, controller, inbox) = rt.block_on(async {
            let ep = Arc::new(Endpoint::bind(cfg).await?);
            // Services before any peer can reach the node: the multicast and pool services
            // make this a full Cascade node; the app service carries SEND/RECV.
            let services = start_services(ep.clone(), op_timeout)?;
            let inbox = ep.subscribe::<AppMessage>(cascade_transport::service::DEFAULT_INBOX)?;
            let controller = Arc::new(Controller::new(ep.clone())?);
            ep.open();
            Ok::<_, cascade_transport::TransportError>((ep, services, controller, inbox))
        })?;
        Ok(Box::new(cascade_endpoint {
            rt,
            ep,
            services,
            controller,
            held_runs: Arc::default(),
            queue: Arc::default(),
            details: Arc::default(),
            inbox: Mutex::new(inbox),
            held: Mutex::new(None),
        }))
    }
}

/// Creates an endpoint from `config` and starts connecting to its peers (it does not wait: see
/// [`cascade_endpoint_wait_ready`]). On success `*out` is the new endpoint, to be destroyed with
/// [`cascade_endpoint_destroy`].
///
/// # Safety
/// `config` points to a `cascade_endpoint_config` whose `struct_size` is set and whose pointers
/// are valid for the call; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_endpoint_create(
    config: *const cascade_endpoint_config,
    out: *mut *mut cascade_endpoint,
) -> i32 {
    guard("cascade_endpoint_create", || {
        // SAFETY: the caller's contract for `out`.
        let out = unsafe { buf::out_param(out, "out") }?;
        // SAFETY: the caller's contract for `config`.
        let c = unsafe { buf::sized(config, "config") }?;
        // SAFETY: pointers valid for the call (the caller's contract).
        let toml = unsafe { buf::text(c.cluster_toml, "config.cluster_toml") }?;
        // SAFETY: as above.
        let secret = unsafe { buf::bytes(c.secret, c.secret_len, "config.secret") }?;
        let cluster = ClusterSpec::from_toml(&toml)?;
        let mut cfg = EndpointConfig::new(c.node, cluster, &secret);
        cfg.shm = c.flags & CASCADE_CONFIG_NO_SHM == 0;
        if c.op_timeout_ms > 0 {
            cfg.op_timeout = Duration::from_millis(c.op_timeout_ms.into());
        }
        if c.memory_limit > 0 {
            cfg.memory_limit = Some(c.memory_limit);
        }
        out.put(Box::into_raw(cascade_endpoint::start(cfg)?));
        Ok(CASCADE_OK)
    })
}

/// Joins the cluster described by the cluster file at `cluster_path` as `node`, with the secret
/// in `secret_path` (surrounding whitespace trimmed); defaults otherwise. As
/// [`cascade_endpoint_create`]; either file missing, unreadable or malformed is
/// `CASCADE_ERR_CONFIG`.
///
/// # Safety
/// The paths are NUL-terminated strings; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_endpoint_join(
    cluster_path: *const c_char,
    node: u32,
    secret_path: *const c_char,
    out: *mut *mut cascade_endpoint,
) -> i32 {
    guard("cascade_endpoint_join", || {
        // SAFETY: the caller's contract for `out`.
        let out = unsafe { buf::out_param(out, "out") }?;
        // SAFETY: NUL-terminated strings (the caller's contract).
        let (cluster_path, secret_path) =
            unsafe { (buf::text(cluster_path, "cluster_path")?, buf::text(secret_path, "secret_path")?) };
        // An unreadable cluster file is bad configuration, as an unreadable secret is (it was
        // CASCADE_ERR_IO, the secret CASCADE_ERR_CONFIG).
        let cluster = ClusterSpec::load(std::path::Path::new(&cluster_path))
            .map_err(|e| FfiError::new(CASCADE_ERR_CONFIG, e.to_string()))?;
        let secret = std::fs::read(&secret_path)
            .map_err(|e| FfiError::new(CASCADE_ERR_CONFIG, format!("reading the secret {secret_path}: {e}")))?;
        out.put(Box::into_raw(cascade_endpoint::start(EndpointConfig::new(node, cluster, secret.trim_ascii()))?));
        Ok(CASCADE_OK)
    })
}

/// Waits at most `timeout_ms` until every peer of the cluster is connected: [`CASCADE_OK`] once
/// they are, [`CASCADE_IN_PROGRESS`] if some are still missing then (call again; 0 only checks).
///
/// # Safety
/// `ep` is a live endpoint.
#[no_mangle]
pub unsafe extern "C" fn cascade_endpoint_wait_ready(ep: *const cascade_endpoint, timeout_ms: u32) -> i32 {
    guard("cascade_endpoint_wait_ready", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        match e.rt.block_on(e.ep.wait_ready(Duration::from_millis(timeout_ms.into()))) {
            Ok(_) => Ok(CASCADE_OK),
            Err(cascade_transport::TransportError::MeshIncomplete { .. }) => Ok(CASCADE_IN_PROGRESS),
            Err(err) => Err(err.into()),
        }
    })
}

/// This endpoint's node id, in `*node`.
///
/// # Safety
/// `ep` is a live endpoint; `node` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_endpoint_node(ep: *const cascade_endpoint, node: *mut u32) -> i32 {
    guard("cascade_endpoint_node", || {
        // SAFETY: the caller's contract.
        let (e, node) = unsafe { (buf::handle(ep, "ep")?, buf::out_param(node, "node")?) };
        node.put(e.ep.node());
        Ok(CASCADE_OK)
    })
}

/// Says goodbye to every peer (waiting at most half a second for each to be written, so its
/// peers report a departure, not a failure), closes every link, stops the endpoint's runtime and
/// frees it. Regions registered with it must be deregistered first (their handles are not freed
/// here). Null is accepted.
///
/// # Safety
/// `ep` is null or a live endpoint, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn cascade_endpoint_destroy(ep: *mut cascade_endpoint) -> i32 {
    guard("cascade_endpoint_destroy", || {
        if ep.is_null() {
            return Ok(CASCADE_OK);
        }
        // SAFETY: made by `Box::into_raw` in create/join; the caller gives it up.
        let e = unsafe { Box::from_raw(ep) };
        e.rt.block_on(e.ep.leave());
        let cascade_endpoint { rt, ep, services, controller, .. } = *e;
        drop((services, controller));
        drop(ep);
        rt.shutdown_timeout(Duration::from_secs(2));
        Ok(CASCADE_OK)
    })
}

/// The node's metrics in the Prometheus/OpenMetrics text format (what `/metrics` serves), into
/// `(buf, cap)`, NUL-terminated; `*needed` gets the size.
///
/// # Safety
/// `ep` is a live endpoint; `buf` is writable for `cap` bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_metrics_render(
    ep: *const cascade_endpoint,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("cascade_metrics_render", || {
        // SAFETY: the caller's contract.
        let e = unsafe { buf::handle(ep, "ep") }?;
        let text = e.ep.metrics().render();
        // SAFETY: the caller's contract for the buffer.
        unsafe { buf::out_text(&text, buf, cap, needed) }
    })
}

/// Serves the node's metrics at `http://ADDR/metrics` (`addr` as `host:port`; port 0 picks
/// one) for the endpoint's life; the address bound is written to `(buf, cap)`, which must hold
/// at least [`CASCADE_ADDR_CAP`] bytes (checked before anything is bound).
///
/// # Safety
/// `ep` is a live endpoint; `addr` is a NUL-terminated string; `buf` is writable for `cap`
/// bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_metrics_serve(
    ep: *const cascade_endpoint,
    addr: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard("cascade_metrics_serve", || {
        // SAFETY: the caller's contract.
        let (e, addr) = unsafe { (buf::handle(ep, "ep")?, buf::text(addr, "addr")?) };
        let addr: std::net::SocketAddr = addr.parse().map_err(|err| FfiError::arg(format!("addr {addr:?}: {err}")))?;
        // Checked before anything is bound, so a short buffer leaves no server behind.
        // SAFETY: the caller's contract for `needed`.
        unsafe { buf::fits(CASCADE_ADDR_CAP, buf.cast(), cap, needed) }?;
        let bound = e.rt.block_on(cascade_transport::metrics::spawn_metrics_server(addr, e.ep.metrics().clone()))?;
        // SAFETY: the caller's contract for the buffer.
        unsafe { buf::out_text(&bound.to_string(), buf, cap, needed) }
    })
}
