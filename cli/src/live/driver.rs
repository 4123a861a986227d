//! One policy's run, on node 0: measures one instance's capacity, replays the
//! burst open-loop through the router, scales the model out to node 2 during it, checks every
//! served embedding against the reference, and writes the record (`<out>/<policy>/run.json`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cascade_exec::embed::reference_sentences;
use cascade_exec::serve::router::{self, Answer, Request, RouterCmd, RouterConfig};
use cascade_exec::serve::{scale_out, DispatchConfig, ExecMsg, LivePolicy, ServedModel};
use cascade_multicast::cluster::Controller;
use cascade_multicast::{Event, Topology};
use cascade_transport::{Mesh, ServiceExt};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{LiveArgs, NEW, OLD};
use crate::Member;

/// What one policy's run recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PolicyRun {
    pub(crate) policy: String,
    /// One instance's capacity, requests/s (batches of `max_batch`, measured on node 1).
    pub(crate) capacity_rps: f64,
    /// Zigzag's T: a block's load time over a layer's execution time.
    pub(crate) load_ratio: u32,
    /// The burst's rate, requests/s.
    pub(crate) rate_rps: f64,
    /// Requests sent.
    pub(crate) sent: u64,
    /// When the scale-out began, seconds from the burst's start.
    pub(crate) scale_at_s: f64,
    /// When node 2 held its first layer, and all of them (seconds from the burst's start).
    pub(crate) first_layer_s: Option<f64>,
    pub(crate) loaded_s: Option<f64>,
    /// Multicast transfer time of the copy (seconds).
    pub(crate) transfer_s: f64,
    /// Per request: [arrived, answered] (seconds from the burst's start), the node its batch
    /// went to, the layers run there when split (0 = whole), cosine to the reference. A batch
    /// whose entry stage ran on old before new (three segments) counts as gone to new with its
    /// stages up to the last one new ran.
    pub(crate) requests: Vec<(f64, f64, u32, u32, f64)>,
    /// Requests never answered with an embedding.
    pub(crate) lost: u64,
    /// Answers whose embedding's cosine to the reference is below 0.9999.
    pub(crate) mismatched: u64,
    /// Batches re-queued after a failure.
    pub(crate) requeued: u64,
}

/// The most requests a burst may hold.
const MAX_BURST: u64 = 10_000_000;

/// The burst's arrival times: Poisson at `rate` for `secs` (seeded: the same pattern, scaled to
/// the rate, for every run).
fn arrivals(rate: f64, secs: f64) -> Vec<f64> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        t += -u.ln() / rate;
        if t >= secs {
            return out;
        }
        out.push(t);
    }
}

/// Seconds per batch of `n` texts on the old instance, one at a time (after a warm-up).
async fn batch_seconds(mesh: &Arc<dyn Mesh>, texts: &[String]) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for i in 0..14u64 {
        let t0 = Instant::now();
        let msg = ExecMsg::Run { batch: i, texts: texts.to_vec(), split: None, onward: None };
        match mesh.call(OLD, &msg, Duration::from_secs(60)).await? {
            ExecMsg::Done { .. } => {}
            other => bail!("calibration batch: {other:?}"),
        }
        if i >= 4 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Where one round's run of `policy` keeps its record and logs.
pub(crate) fn run_dir(out: &Path, round: usize, policy: LivePolicy) -> std::path::PathBuf {
    out.join(format!("round-{}", round + 1)).join(policy.name())
}

pub(crate) async fn drive(a: &LiveArgs, cluster: &Path, policy: LivePolicy, round: usize) -> anyhow::Result<()> {
    let ep = crate::join(&Member::driver(cluster), true).await?;
    let mesh: Arc<dyn Mesh> = ep.clone();
    let (model, _) = ServedModel::from_dir(&a.model).context("reading the model")?;
    let refs = reference_sentences()?;
    let texts: Vec<String> = (0..a.max_batch).map(|i| refs[i % refs.len()].0.clone()).collect();
    let per_batch = batch_seconds(&mesh, &texts).await?;
    let capacity = a.max_batch as f64 / per_batch;
    let layers = model.config.num_hidden_layers as u32 + 1;
    // T: a block's load time on the link over one layer's execution time.
    let block = model.manifest.layers.get(1).map_or(0, |l| l.range.end - l.range.start) as f64;
    let link_bps = if a.netns { a.link() as f64 * 1e6 } else { 8e9 };
    let load_ratio = ((block * 8.0 / link_bps) / (per_batch / f64::from(layers))).round().max(1.0) as u32;
    // The round's first run sets the burst; the others replay it.
    let rate = a.rate_rps.unwrap_or(a.burst * capacity);
    // A burst beyond this was drawn into memory before anything ran (`--burst 1e12` never
    // started); at this machine's 250 req/s it would last half a day.
    if rate * a.burst_s > MAX_BURST as f64 {
        bail!(
            "a burst of {:.3e} requests ({rate:.3e} req/s for {} s): at most {MAX_BURST}; lower --burst or --burst-s",
            rate * a.burst_s,
            a.burst_s
        );
    }
    let times = arrivals(rate, a.burst_s);
    // No request measures nothing (the run reported p50 and p99 as NaN).
    if times.is_empty() {
        bail!("a burst of {rate:.3e} req/s for {} s holds no request; raise --burst or --burst-s", a.burst_s);
    }
    eprintln!(
        "{}: one instance {per_batch:.3} s per batch of {} → {capacity:.1} req/s; burst {rate:.1} req/s for {} s \
         ({} requests); T = {load_ratio}",
        policy.name(),
        a.max_batch,
        a.burst_s,
        times.len()
    );

    let cfg = RouterConfig {
        dispatch: DispatchConfig { policy, layers, old: OLD, per_instance: 3, max_coop: a.max_coop, load_ratio },
        max_batch: a.max_batch,
        call_timeout: Duration::from_secs(120),
        poll_every: Duration::from_millis(10),
        max_attempts: 8,
    };
    let (req_tx, req_rx) = mpsc::channel(1 << 16);
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let (ans_tx, mut ans_rx) = mpsc::unbounded_channel();
    let routing = tokio::spawn(router::run(mesh.clone(), cfg, req_rx, cmd_rx, ans_tx));
    let start = Instant::now();
    let texts: Vec<String> = (0..times.len()).map(|i| refs[i % refs.len()].0.clone()).collect();
    let sending = {
        let (times, texts) = (times.clone(), texts.clone());
        tokio::spawn(async move {
            for (i, (t, text)) in times.iter().zip(texts).enumerate() {
                tokio::time::sleep_until((start + Duration::from_secs_f64(*t)).into()).await;
                let r = Request { id: i as u64, text, arrived: Instant::now() };
                if req_tx.send(r).await.is_err() {
                    return;
                }
            }
        })
    };
    // The autoscaler reacts: the model goes to node 2 by multicast, its layers announced as
    // they are verified.
    tokio::time::sleep_until((start + Duration::from_secs_f64(a.scale_after_s)).into()).await;
    let scale_at = start.elapsed().as_secs_f64();
    cmd_tx.send(RouterCmd::Scale { node: NEW }).ok();
    let ctl = Controller::new(mesh.clone())?;
    let mut topology = Topology::new();
    for n in 0..a.source.nodes() as u32 {
        topology.add_node(n, 0, link_bps / 1e9)?;
    }
    let source = a.source.node();
    let (ptx, mut prx) = mpsc::unbounded_channel::<(f64, Event)>();
    // Each event timed as it arrives, on the burst's clock.
    let events = tokio::spawn(async move {
        let (mut first_layer, mut loaded) = (None, None);
        while let Some((_, ev)) = prx.recv().await {
            let now = start.elapsed().as_secs_f64();
            match ev {
                Event::LayerReady { layer: 0, .. } => first_layer = Some(now),
                Event::TargetDone { .. } => loaded = Some(now),
                _ => {}
            }
        }
        (first_layer, loaded)
    });
    let scaled = scale_out(&mesh, &ctl, &model.manifest, topology, source, &[NEW], Some(ptx)).await?;
    let (first_layer, loaded) = events.await.unwrap_or((None, None));
    sending.await.ok();
    let stats = routing.await.context("the router failed")?;
    let answers: Vec<Answer> = std::iter::from_fn(|| ans_rx.try_recv().ok()).collect();
    let want: std::collections::HashMap<&str, &[f32]> = refs.iter().map(|(t, e)| (t.as_str(), e.as_slice())).collect();
    let mut requests = Vec::new();
    let (mut lost, mut mismatched) = (times.len() as u64, 0);
    for ans in &answers {
        let Ok(e) = &ans.result else { continue };
        lost -= 1;
        let c = cosine(e, want[texts[ans.id as usize].as_str()]);
        if c < 0.9999 {
            mismatched += 1;
        }
        let at = |i: Instant| i.duration_since(start).as_secs_f64();
        // A three-segment batch (the entry stage on old) counts as sent to new with its stages
        // up to `onward.layers` there.
        let (node, on_first) = match (ans.split, ans.onward) {
            (Some(s), Some(o)) => (s.then, o.layers),
            (s, _) => (ans.to, s.map_or(0, |s| s.layers)),
        };
        requests.push((at(ans.arrived), at(ans.answered), node, on_first, c));
    }
    requests.sort_by(|x, y| x.0.total_cmp(&y.0));
    let run = PolicyRun {
        policy: policy.name().into(),
        capacity_rps: capacity,
        load_ratio,
        rate_rps: rate,
        sent: times.len() as u64,
        scale_at_s: scale_at,
        first_layer_s: first_layer,
        loaded_s: loaded,
        transfer_s: scaled.run.transfer_seconds,
        requests,
        lost,
        mismatched,
        requeued: stats.requeued,
    };
    let path = run_dir(&a.out, round, policy).join("run.json");
    std::fs::write(&path, serde_json::to_vec(&run)?).with_context(|| format!("writing {}", path.display()))?;
    ep.leave().await;
    Ok(())
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}
