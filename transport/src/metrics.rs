//! Prometheus metrics: one registry per endpoint (never a global one), rendered in the
//! OpenMetrics text format by [`Metrics::render`] and served over plain HTTP by
//! [`serve_metrics`].
//!
//! The transport records, for every operation posted through [`crate::Endpoint::link`]:
//! `cascade_transfer_ops_total{op,backend,peer}`, `cascade_transfer_bytes_total{op,backend,peer}`
//! (payload bytes of successful operations), `cascade_transfer_latency_seconds{op,backend}`
//! (post to completion) and `cascade_transfer_errors_total{op,backend,kind}`; at each render,
//! `cascade_mesh_peers_up{backend}`; and `cascade_mesh_peer_losses_total{how}` for every link that
//! closed (`left`: the peer said goodbye; `failed`: anything else). Other crates add their own families to the same registry
//! through [`Metrics::counter`], [`Metrics::gauge`] and [`Metrics::histogram`] (the multicast's
//! runs, the pool's copies and repairs), so one scrape shows the whole node.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use prometheus_client::encoding::text::encode;
pub use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
pub use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::{Result, TransportError};
use crate::link::{BackendKind, Completion, Link, Op, OpHandle};
use crate::region::RemoteRegion;
use crate::stats::StatsSnapshot;
use crate::NodeId;

/// Label pairs of one series.
pub type Labels = Vec<(String, String)>;

/// A floating-point gauge.
pub type FloatGauge = Gauge<f64, AtomicU64>;

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Histogram buckets of every duration this crate and its users record, in seconds: 10 µs to
/// about 6 minutes, ×2.5 per bucket.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.5, 20))
}

/// A hook run before each render, to refresh gauges computed from state (peers up, say).
type Refresh = Box<dyn Fn() + Send + Sync>;

/// One node's metrics registry.
pub struct Metrics {
    registry: Mutex<Registry>,
    counters: Mutex<HashMap<&'static str, Family<Labels, Counter>>>,
    gauges: Mutex<HashMap<&'static str, Family<Labels, FloatGauge>>>,
    histograms: Mutex<HashMap<&'static str, HistogramFamily>>,
    refresh: Mutex<Vec<Refresh>>,
    /// Held by [`Metrics::update`] and by a render: a render sees an update whole or not at all.
    updating: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    /// An empty registry.
    pub fn new() -> Metrics {
        Metrics {
            registry: Mutex::new(Registry::default()),
            counters: Mutex::default(),
            gauges: Mutex::default(),
            histograms: Mutex::default(),
            refresh: Mutex::default(),
            updating: Mutex::default(),
        }
    }

    /// The series `pairs` of family `name` in `families`, the family made by `make` and
    /// registered with `help` on first use.
    fn series<M, C>(
        &self,
        families: &Mutex<HashMap<&'static str, Family<Labels, M, C>>>,
        name: &'static str,
        help: &str,
        pairs: &[(&str, &str)],
        make: impl FnOnce() -> Family<Labels, M, C>,
    ) -> M
    where
        M: prometheus_client::encoding::EncodeMetric
            + prometheus_client::metrics::TypedMetric
            + Clone
            + Send
            + Sync
            + std::fmt::Debug
            + 'static,
        C: prometheus_client::metrics::family::MetricConstructor<M> + Clone + Send + Sync + std::fmt::Debug + 'static,
    {
        let mut families = lock(families);
        let family = families.entry(name).or_insert_with(|| {
            let f = make();
            lock(&self.registry).register(name, help, f.clone());
            f
        });
        let series = family.get_or_create(&labels(pairs)).clone();
        series
    }

    /// The counter `name` (registered on first use with `help`; a counter's exposed name gets
    /// `_total` appended, so pass it without) for the series `labels`. The handle is cheap to
    /// keep and increment.
    pub fn counter(&self, name: &'static str, help: &str, pairs: &[(&str, &str)]) -> Counter {
        self.series(&self.counters, name, help, pairs, Family::default)
    }

    /// The gauge `name` for the series `labels` (registered on first use with `help`).
    pub fn gauge(&self, name: &'static str, help: &str, pairs: &[(&str, &str)]) -> FloatGauge {
        self.series(&self.gauges, name, help, pairs, Family::default)
    }

    /// Forgets every series of the gauge `name` (before setting the current ones, so that a
    /// state nothing is in any more does not keep its last value).
    pub fn clear_gauge(&self, name: &'static str) {
        if let Some(f) = lock(&self.gauges).get(name) {
            f.clear();
        }
    }

    /// The duration histogram `name` (seconds; registered on first use with `help`) for the
    /// series `labels`.
    pub fn histogram(&self, name: &'static str, help: &str, pairs: &[(&str, &str)]) -> Histogram {
        self.series(&self.histograms, name, help, pairs, || {
            HistogramFamily::new_with_constructor(duration_histogram as fn() -> Histogram)
        })
    }

    /// Runs `f` before every render (to set gauges from current state). Hold only weak
    /// references to what owns this registry in it, or the two keep each other alive.
    pub fn on_render(&self, f: impl Fn() + Send + Sync + 'static) {
        lock(&self.refresh).push(Box::new(f));
    }

    /// Runs `f`, which sets several series together (a family cleared and set again from the
    /// current state, say), as one step: a render sees the series as they were before `f` or
    /// after it, never half-way (a cleared family whose new values are not set yet). Not from
    /// an [`on_render`](Self::on_render) callback: those run inside the render's own step.
    pub fn update<R>(&self, f: impl FnOnce() -> R) -> R {
        let _whole = lock(&self.updating);
        f()
    }

    /// Every family in the OpenMetrics text format (what `/metrics` serves).
    pub fn render(&self) -> String {
        let _whole = lock(&self.updating);
        for f in lock(&self.refresh).iter() {
            f();
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &lock(&self.registry));
        out
    }
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` with what `metrics` renders at each scrape, until the
/// listener's task is dropped; anything else is answered 404 (405 for another method). Plain
/// HTTP/1.1, one request per connection: enough for a Prometheus scraper and `curl`. A failed
/// accept (the process out of descriptors) is retried after [`crate::ACCEPT_BACKOFF`].
pub async fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let mut sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                crate::back_off_after_failed_accept("metrics", &e).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut req = Vec::with_capacity(512);
            let mut buf = [0u8; 1024];
            // Read the request head (at most 8 KiB, 5 s); the body of a GET is empty.
            let head = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(head, Ok(true)) {
                return;
            }
            let line = String::from_utf8_lossy(&req);
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
                ("GET", "/metrics") => ("200 OK", CONTENT_TYPE, metrics.render()),
                ("GET", _) => ("404 Not Found", "text/plain", "only /metrics is served here\n".to_string()),
                _ => ("405 Method Not Allowed", "text/plain", "GET /metrics\n".to_string()),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Binds `addr` and serves `metrics` there on a new task (see [`serve_metrics`]); returns the
/// address bound (useful with port 0).
pub async fn spawn_metrics_server(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<SocketAddr> {
    let l = TcpListener::bind(addr).await.map_err(|e| TransportError::io(format!("binding metrics on {addr}"), e))?;
    let bound = l.local_addr().map_err(|e| TransportError::io("metrics listener address", e))?;
    tokio::spawn(serve_metrics(l, metrics));
    Ok(bound)
}

/// The meters of one kind of operation on one link.
#[derive(Clone)]
struct OpMeters {
    ops: Counter,
    bytes: Counter,
    latency: Histogram,
}

/// A [`Link`] whose operations are counted in the endpoint's [`Metrics`]: the endpoint hands
/// these out, so every user of its links is measured the same way. Public so that its cost can
/// be measured against the bare link (`cargo bench -p cascade-transport --bench metered`) and so
/// that a user's own links can be metered the same way.
pub struct Metered {
    inner: Arc<dyn Link>,
    metrics: Weak<Metrics>,
    write: OpMeters,
    read: OpMeters,
    send: OpMeters,
}

impl Metered {
    /// `inner`, counted in `metrics` (its series are resolved here, once).
    pub fn new(inner: Arc<dyn Link>, metrics: &Arc<Metrics>) -> Metered {
        let (backend, peer) = (inner.kind().to_string(), inner.peer().to_string());
        let meters = |op: &str| OpMeters {
            ops: metrics.counter(
                "cascade_transfer_ops",
                "Operations completed successfully, by operation, backend and peer",
                &[("op", op), ("backend", &backend), ("peer", &peer)],
            ),
            bytes: metrics.counter(
                "cascade_transfer_bytes",
                "Payload bytes of successful operations, by operation, backend and peer",
                &[("op", op), ("backend", &backend), ("peer", &peer)],
            ),
            latency: metrics.histogram(
                "cascade_transfer_latency_seconds",
                "Time from posting an operation to its completion, by operation and backend",
                &[("op", op), ("backend", &backend)],
            ),
        };
        Metered {
            write: meters("write"),
            read: meters("read"),
            send: meters("send"),
            metrics: Arc::downgrade(metrics),
            inner,
        }
    }
}

impl Link for Metered {
    fn peer(&self) -> NodeId {
        self.inner.peer()
    }
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn post(&self, ops: Vec<Op>) -> Vec<OpHandle> {
        let kinds: Vec<&'static str> = ops.iter().map(Op::name).collect();
        let started = Instant::now();
        let backend = self.inner.kind();
        self.inner
            .post(ops)
            .into_iter()
            .zip(kinds)
            .map(|(h, op)| {
                let m = match op {
                    "write" => self.write.clone(),
                    "read" => self.read.clone(),
                    _ => self.send.clone(),
                };
                let metrics = self.metrics.clone();
                h.observed(Box::new(move |r: &Result<Completion>| match r {
                    Ok(c) => {
                        m.ops.inc();
                        m.bytes.inc_by(c.bytes);
                        m.latency.observe(started.elapsed().as_secs_f64());
                    }
                    Err(e) => {
                        if let Some(metrics) = metrics.upgrade() {
                            metrics
                                .counter(
                                    "cascade_transfer_errors",
                                    "Operations that failed, by operation, backend and error kind",
                                    &[("op", op), ("backend", &backend.to_string()), ("kind", e.kind())],
                                )
                                .inc();
                        }
                    }
                }))
            })
            .collect()
    }
    fn prepare(&self, remote: RemoteRegion) -> OpHandle {
        self.inner.prepare(remote)
    }
    fn stats(&self) -> StatsSnapshot {
        self.inner.stats()
    }
    fn is_alive(&self) -> bool {
        self.inner.is_alive()
    }
    fn close(&self, reason: &str) {
        self.inner.close(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_with_their_labels_and_conventions() {
        let m = Metrics::new();
        m.counter("cascade_test_things", "Things", &[("kind", "a")]).inc_by(3);
        m.gauge("cascade_test_level", "Level", &[]).set(2.5);
        m.histogram("cascade_test_seconds", "Durations", &[("op", "x")]).observe(0.01);
        let text = m.render();
        assert!(text.contains("cascade_test_things_total{kind=\"a\"} 3"), "{text}");
        assert!(text.contains("cascade_test_level{} 2.5"), "{text}");
        assert!(text.contains("cascade_test_seconds_count{op=\"x\"} 1"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        // The same series is the same counter.
        m.counter("cascade_test_things", "Things", &[("kind", "a")]).inc();
        assert!(m.render().contains("cascade_test_things_total{kind=\"a\"} 4"));
        m.clear_gauge("cascade_test_level");
        assert!(!m.render().contains("cascade_test_level{} 2.5"));
    }

    /// A render never sees an update half-done: here a family cleared and its two series set
    /// again, over and over, while this thread renders.
    #[test]
    fn a_render_sees_an_update_whole() {
        use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
        let m = Arc::new(Metrics::new());
        let set_pair = |m: &Metrics, v: f64| {
            m.update(|| {
                m.clear_gauge("cascade_test_pair");
                for side in ["a", "b"] {
                    m.gauge("cascade_test_pair", "Pair", &[("side", side)]).set(v);
                }
            })
        };
        set_pair(&m, 1.0);
        let (stop, updates) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
        let writer = {
            let (m, stop, updates) = (m.clone(), stop.clone(), updates.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let n = updates.fetch_add(1, Ordering::Relaxed);
                    set_pair(&m, f64::from(n % 7 + 1));
                }
            })
        };
        // Until both sides did a few thousand steps (or 10 s went by) and always the whole pair.
        let t = std::time::Instant::now();
        let mut renders = 0;
        while (renders < 2000 || updates.load(Ordering::Relaxed) < 2000)
            && t.elapsed() < std::time::Duration::from_secs(10)
        {
            let text = m.render();
            let sides = ["side=\"a\"", "side=\"b\""].iter().filter(|s| text.contains(*s)).count();
            assert_eq!(sides, 2, "a render saw half an update:\n{text}");
            renders += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    }

    #[tokio::test]
    async fn the_server_answers_metrics_and_refuses_the_rest() {
        let m = Arc::new(Metrics::new());
        m.counter("cascade_test_scrapes", "Scrapes", &[]).inc();
        let addr = spawn_metrics_server("127.0.0.1:0".parse().unwrap(), m.clone()).await.unwrap();
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("cascade_test_scrapes_total{} 1"), "{ok}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
    }

    #[tokio::test]
    async fn operations_whose_handles_are_dropped_are_counted_too() {
        use crate::mem::{Fault, MemFabric};
        use crate::region::Region;
        use crate::Op;
        let f = MemFabric::new();
        let a = f.add_node(1);
        let b = f.add_node(2);
        let (src, dst) =
            (Region::alloc(64, Default::default()).unwrap(), Region::alloc(64, Default::default()).unwrap());
        b.regions().register(&dst);
        let m = Arc::new(Metrics::new());
        let l = Metered::new(a.link(2).unwrap(), &m);
        let write = || Op::write(&src, 0, dst.remote(2), 0, 64);
        // Dropped before it completes (held 50 ms), and after (the mem link completes at once).
        f.set_fault(1, 2, Some(Fault::Delay(std::time::Duration::from_millis(50))));
        drop(l.post(vec![write()]));
        f.set_fault(1, 2, None);
        drop(l.post(vec![write()]));
        let line = "cascade_transfer_ops_total{op=\"write\",backend=\"mem\",peer=\"2\"} 2";
        let t = std::time::Instant::now();
        while !m.render().contains(line) {
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "{}", m.render());
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(m.render().contains("cascade_transfer_bytes_total{op=\"write\",backend=\"mem\",peer=\"2\"} 128"));
    }
}
