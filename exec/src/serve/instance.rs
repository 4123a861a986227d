//! A serving instance on a node: the exec service. It embeds batches with the layers resident
//! here, hands a split batch's activation to its paired instance with a one-sided WRITE into the
//! slot that instance granted, and runs the rest of batches handed to it the same way.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cascade_multicast::cluster::MulticastNode;
use cascade_transport::service::DEFAULT_INBOX;
use cascade_transport::{Mesh, Region, ReplyTo, ServiceExt};
use tokio::sync::{mpsc, watch};
use tracing::debug;

use super::compute::{Cmd, Compute, Finished};
use super::copy::Copy;
use super::proto::{ExecMsg, Split};
use super::{ServeError, ServedModel};
use crate::bert::Bert;
use crate::{Activation, ExecError};

mod grants;
mod pairs;

use grants::{Grants, Held};
use pairs::{Ask, Pairs};

/// Where an instance's parameters come from.
pub enum Source {
    /// The whole packed image, in a region this node holds (a pool copy, or one it loaded).
    Held(Region),
    /// A copy a multicast is filling on this node: stages are built from the verified layers
    /// its `LayerReady` events report ([`ExecMsg::LayerReady`]); [`ExecMsg::Adopt`] makes it
    /// held once the run verified it.
    Arriving,
}

/// An instance's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceConfig {
    /// Texts per batch at most.
    pub max_batch: usize,
    /// Tokens per text at most (with the special tokens); sizes the activation slots. `None`
    /// (the default): the model's own cut ([`ServedModel::max_tokens`]: 256 for
    /// all-MiniLM-L6-v2, as sentence-transformers cuts), so every text the model takes is
    /// served. A lower limit refuses, whole, a batch whose longest text is longer (a batch is
    /// padded to its longest text).
    pub max_tokens: Option<usize>,
    /// Activation slots this instance grants its peers (and asks of its peer when it splits):
    /// the cap on pending cooperative batches per pair.
    pub slots: u32,
    /// Limit on each activation WRITE and each call to the paired instance.
    pub op_timeout: Duration,
    /// Pin the compute thread to this CPU core (an instance standing for one GPU).
    pub core: Option<usize>,
}

impl Default for InstanceConfig {
    fn default() -> Self {
        InstanceConfig { max_batch: 8, max_tokens: None, slots: 16, op_timeout: Duration::from_secs(30), core: None }
    }
}

/// Where a finished job's result goes.
enum Tag {
    /// Answer the router (after the split's hand-over when there is one; `onward` is the
    /// segment after `split.then`'s).
    Run { reply: ReplyTo, batch: u64, split: Option<Split>, onward: Option<Split> },
    /// Release the slot `held` (its peer handed the batch over) and answer the peer, after
    /// handing the batch on to `split.then` when there is a next segment.
    Finish { reply: ReplyTo, batch: u64, held: Held, on_first: u32, split: Option<Split> },
}

struct Shared {
    mesh: Arc<dyn Mesh>,
    model: ServedModel,
    cfg: InstanceConfig,
    /// Tokens per text at most: `cfg.max_tokens`, or the model's own cut.
    max_tokens: usize,
    compute: Compute<Tag, Bert>,
    /// The activation slots granted to peers that hand batches over to this instance.
    grants: Grants,
    /// The slots this instance holds in the regions of the peers it hands batches over to.
    pairs: Pairs,
    /// Set to stop the instance.
    stop: watch::Sender<bool>,
    /// Work under way: the finish task and every hand-over hold a receiver, so
    /// `closed()` resolves once all of it is over (after a stop).
    work: watch::Sender<()>,
    /// Set once the instance has stopped: every batch it took answered, its regions withdrawn.
    stopped: watch::Sender<bool>,
    /// The node's copy of the parameters.
    copy: Copy,
    /// The instance's series in the node's metrics.
    meters: Meters,
}

/// An instance's series, resolved once: jobs queued, jobs computed by kind.
struct Meters {
    queued: cascade_transport::metrics::FloatGauge,
    runs: cascade_transport::metrics::Counter,
    finishes: cascade_transport::metrics::Counter,
}

impl Meters {
    fn new(mesh: &Arc<dyn Mesh>) -> Meters {
        let m = mesh.metrics();
        let jobs = |kind: &str| {
            m.counter(
                "cascade_exec_jobs",
                "Batch jobs the instance computed, by kind (run, or finish of a split batch)",
                &[("kind", kind)],
            )
        };
        Meters {
            queued: m.gauge("cascade_exec_queued_jobs", "Batch jobs waiting for or in the compute thread", &[]),
            runs: jobs("run"),
            finishes: jobs("finish"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running instance. Dropping the handle stops it ([`Instance::stop`]).
pub struct Instance {
    shared: Arc<Shared>,
}

impl Instance {
    /// Starts the exec service on `mesh` for `model`, its parameters from `source`; `multicast`
    /// is the node's multicast service (copies arrive and leave through it). A held copy is
    /// built at once; an arriving one stage by stage as its layers are verified.
    pub fn start(
        mesh: Arc<dyn Mesh>,
        model: ServedModel,
        source: Source,
        multicast: Arc<MulticastNode>,
        cfg: InstanceConfig,
    ) -> Result<Instance, ServeError> {
        let max_tokens = cfg.max_tokens.unwrap_or_else(|| model.max_tokens());
        if cfg.max_batch == 0 || max_tokens == 0 || cfg.slots == 0 {
            return Err(ServeError::Config("max_batch, max_tokens and slots must be positive".into()));
        }
        if max_tokens > model.config.max_position_embeddings {
            return Err(ServeError::Config(format!(
                "max_tokens {max_tokens} exceeds the model's {} positions",
                model.config.max_position_embeddings
            )));
        }
        activation_region_fits(&*mesh, &cfg, max_tokens, model.config.hidden_size)?;
        let inbox = mesh.subscribe::<ExecMsg>(DEFAULT_INBOX)?;
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let name = format!("exec-{}", mesh.node());
        let compute = Compute::start(Bert::new(model.config.clone()), model.manifest.clone(), done_tx, name, cfg.core)
            .map_err(|e| ServeError::Config(format!("cannot start the compute thread: {e}")))?;
        let copy = Copy::new(source, multicast, &*mesh, model.manifest.bytes);
        copy.build_held(model.manifest.bytes, &compute)?;
        let meters = Meters::new(&mesh);
        let shared = Arc::new(Shared {
            mesh,
            model,
            cfg,
            max_tokens,
            compute,
            grants: Grants::default(),
            pairs: Pairs::default(),
            stop: watch::Sender::new(false),
            work: watch::Sender::new(()),
            stopped: watch::Sender::new(false),
            copy,
            meters,
        });
        tokio::spawn(serve(shared.clone(), inbox, shared.stop.subscribe()));
        tokio::spawn(finish(shared.clone(), done_rx, shared.work.subscribe()));
        Ok(Instance { shared })
    }

    /// Stages resident now.
    pub fn resident(&self) -> usize {
        self.shared.compute.resident()
    }

    /// Stages resident from stage 1 on, whether or not the entry stage is (see
    /// [`ExecMsg::State`]'s `after_entry`).
    pub fn after_entry(&self) -> usize {
        self.shared.compute.after_entry()
    }

    /// The model's stages.
    pub fn layers(&self) -> usize {
        self.shared.compute.layers()
    }

    /// Stops the instance: it takes no more requests (the node answers them "no such service",
    /// so a router stops sending there), the batches it holds are finished and answered — those
    /// waiting for a layer that never arrived fail, to be sent elsewhere — and its activation
    /// regions, granted and staging, are withdrawn. The node's copy of the parameters and its
    /// multicast service are not the instance's and stay.
    pub fn stop(&self) {
        self.shared.stop.send_replace(true);
    }

    /// Stops the instance ([`Instance::stop`]) and waits until it has stopped: every batch it
    /// took is answered — a split batch after its hand-over to the peer — and its regions are
    /// withdrawn. A graceful scale-in calls this before the node leaves the cluster, so that
    /// no batch it holds is lost with the node. Bounded by the hand-overs' time limit.
    pub async fn stop_and_wait(&self) {
        self.stop();
        let mut stopped = self.shared.stopped.subscribe();
        // The sender lives in `shared`, which `self` holds: the wait cannot see it dropped.
        let _ = stopped.wait_for(|&s| s).await;
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(sh: Arc<Shared>, mut inbox: cascade_transport::Inbox<ExecMsg>, mut stop: watch::Receiver<bool>) {
    while let Some(m) = super::inbox::next(&mut inbox, &mut stop).await {
        let from = m.from;
        let answer = match (m.msg, m.reply_to) {
            (ExecMsg::LayerReady { run, layer }, None) => {
                layer_ready(&sh, run, layer);
                None
            }
            (msg, Some(reply)) => match handle(&sh, from, msg, reply) {
                Ok(Some(a)) => Some((reply, a)),
                Ok(None) => None,
                Err(e) => Some((reply, e.to_failed())),
            },
            (msg, None) => {
                debug!(from, ?msg, "one-way exec message ignored");
                None
            }
        };
        if let Some((reply, a)) = answer {
            if let Err(e) = sh.mesh.reply(&reply, &a) {
                debug!(error = %e, "cannot answer");
            }
        }
    }
    super::inbox::refuse_queued(&*sh.mesh, inbox, &ServeError::Stopped.to_failed());
    sh.compute.send(Cmd::Stop);
    // No Finish comes any more (the inbox is closed): the granted regions can go now.
    sh.grants.withdraw(&*sh.mesh);
    // The batches queued finish (the compute thread ends once they have) and those split hand
    // their activations over before the staging regions go.
    sh.work.closed().await;
    sh.pairs.withdraw(&*sh.mesh).await;
    sh.stopped.send_replace(true);
    debug!(node = sh.mesh.node(), "instance stopped");
}

/// Refuses limits whose activation region — `slots` batches of `max_batch` texts of
/// `max_tokens` tokens, what a pairing registers — could never be allocated on this node: over
/// its memory limit, or (without one) over the memory the system has available now. Such an
/// instance used to start and serve alone, and failed at its first hand-over, in the middle of
/// the burst it was scaled for (`--max-batch 100000`: 16 slots of 39 GB; `usize::MAX` overflowed
/// the slot's size).
fn activation_region_fits(
    mesh: &dyn Mesh,
    cfg: &InstanceConfig,
    max_tokens: usize,
    width: usize,
) -> Result<(), ServeError> {
    let slot = cfg
        .max_batch
        .checked_mul(max_tokens)
        .and_then(|n| n.checked_mul(8 + 4 * width))
        .and_then(|n| n.checked_add(Activation::wire_len(0, 0, width, 0)));
    let region = slot.and_then(|s| u64::try_from(s).ok()).and_then(|s| s.checked_mul(cfg.slots as u64));
    let (room, by) = match mesh.memory_limit() {
        Some(limit) => (limit, "the node's memory limit"),
        None => (cascade_transport::memory_to_spare().unwrap_or(u64::MAX), "the memory the system has available"),
    };
    match region {
        Some(r) if r <= room => Ok(()),
        _ => Err(ServeError::Config(format!(
            "an activation region of {} slots × max_batch {} × max_tokens {max_tokens} ({}) exceeds {by} ({room} bytes): lower max_batch or slots",
            cfg.slots,
            cfg.max_batch,
            region.map_or("more than 2^64 bytes".to_string(), |r| format!("{r} bytes")),
        ))),
    }
}

impl Shared {
    /// Bytes of one activation slot: a batch of `max_batch` texts of `max_tokens` tokens.
    fn slot_bytes(&self) -> u64 {
        Activation::wire_len(self.cfg.max_batch, self.max_tokens, self.model.config.hidden_size, 0) as u64
    }

    /// What this instance asks of a peer it hands batches over to.
    fn ask(&self, then: u32) -> Ask {
        Ask { then, slots: self.cfg.slots, limit: self.cfg.op_timeout }
    }
}

/// Handles a request: `Some` answers now, `None` answers when its job finishes.
fn handle(sh: &Arc<Shared>, from: u32, msg: ExecMsg, reply: ReplyTo) -> Result<Option<ExecMsg>, ServeError> {
    match msg {
        ExecMsg::PairWith { peer } => {
            let sh = sh.clone();
            tokio::spawn(async move {
                let answer = match sh.pairs.pair(&*sh.mesh, &sh.ask(peer)).await {
                    Ok(()) => ExecMsg::Ack,
                    Err(e) => e.to_failed(),
                };
                let _ = sh.mesh.reply(&reply, &answer);
            });
            Ok(None)
        }
        ExecMsg::Run { batch, texts, split, onward } => {
            if texts.is_empty() || texts.len() > sh.cfg.max_batch {
                return Err(ServeError::Input(format!("{} texts: 1 to {} per batch", texts.len(), sh.cfg.max_batch)));
            }
            let layers = sh.compute.layers();
            let stop = match split {
                Some(s) if s.layers == 0 || s.layers as usize >= layers => {
                    return Err(ServeError::Input(format!("a split after {} of {layers} layers", s.layers)))
                }
                Some(s) => s.layers as usize,
                None => layers,
            };
            match (split, onward) {
                (None, Some(_)) => return Err(ServeError::Input("an onward segment without a split".into())),
                (Some(s), Some(o)) if o.layers <= s.layers || o.layers as usize >= layers => {
                    return Err(ServeError::Input(format!(
                        "segments after {} and {} of {layers} layers",
                        s.layers, o.layers
                    )))
                }
                _ => {}
            }
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let act = sh.model.batch(&refs)?;
            let tokens = act.ids.dims2().map_err(ExecError::from)?.1;
            if tokens > sh.max_tokens {
                return Err(ServeError::Input(format!("{tokens} tokens: at most {}", sh.max_tokens)));
            }
            sh.meters.queued.inc();
            // The entry stage of a three-segment batch is a millisecond the next segment's
            // instance waits on: it goes ahead of this instance's queue.
            let urgent = onward.is_some();
            sh.compute.send(Cmd::Job { act, stop, tag: Tag::Run { reply, batch, split, onward }, urgent });
            Ok(None)
        }
        ExecMsg::Finish { batch, region, slot, len, crc, split } => {
            let (act, held) = sh.grants.take(from, (region, slot), (len, crc), sh.slot_bytes())?;
            let on_first = act.next_layer as u32;
            let layers = sh.compute.layers();
            let stop = match split {
                Some(s) if s.layers <= on_first || s.layers as usize >= layers => {
                    sh.grants.release(held);
                    return Err(ServeError::Input(format!(
                        "a hand-over after {} layers to run up to {} of {layers}",
                        on_first, s.layers
                    )));
                }
                Some(s) => s.layers as usize,
                None => layers,
            };
            sh.meters.queued.inc();
            let tag = Tag::Finish { reply, batch, held, on_first, split };
            sh.compute.send(Cmd::Job { act, stop, tag, urgent: false });
            Ok(None)
        }
        ExecMsg::Pair { slots } => sh.grants.grant(&*sh.mesh, from, slots, sh.cfg.slots, sh.slot_bytes()).map(Some),
        ExecMsg::Lend { run } => {
            sh.copy.lend(run, from)?;
            Ok(Some(ExecMsg::Ack))
        }
        ExecMsg::Adopt { run } => {
            sh.copy.adopt(run)?;
            Ok(Some(ExecMsg::Ack))
        }
        ExecMsg::Status => Ok(Some(ExecMsg::State {
            resident: sh.compute.resident() as u32,
            layers: sh.compute.layers() as u32,
            after_entry: sh.compute.after_entry() as u32,
        })),
        other => Err(ServeError::Protocol(format!("unexpected request {other:?}"))),
    }
}

fn layer_ready(sh: &Arc<Shared>, run: u32, layer: u32) {
    if let Some(b) = sh.copy.arrived(&sh.model.manifest, run, layer) {
        sh.compute.send(Cmd::Verified(b));
    }
}

/// Routes finished jobs: answers, or hands a split batch over to its paired instance.
/// Answers the compute thread's finished jobs until it ends; `working` is its share of the
/// instance's work under way.
async fn finish(sh: Arc<Shared>, mut done: mpsc::UnboundedReceiver<Finished<Tag>>, _working: watch::Receiver<()>) {
    while let Some(f) = done.recv().await {
        sh.meters.queued.dec();
        match f.tag {
            Tag::Finish { .. } => sh.meters.finishes.inc(),
            Tag::Run { .. } => sh.meters.runs.inc(),
        };
        match f.tag {
            Tag::Run { reply, batch, split: None, .. } => {
                let answer = done_msg(&sh.model, batch, f.result, 0);
                let _ = sh.mesh.reply(&reply, &answer);
            }
            Tag::Run { reply, batch, split: Some(s), onward } => {
                pass_on(&sh, reply, batch, s, onward, f.result, s.layers)
            }
            Tag::Finish { reply, batch, held, on_first, split } => {
                // The activation was copied out when the job was queued.
                sh.grants.release(held);
                match split {
                    None => {
                        let answer = done_msg(&sh.model, batch, f.result, on_first);
                        let _ = sh.mesh.reply(&reply, &answer);
                    }
                    Some(s) => pass_on(&sh, reply, batch, s, None, f.result, on_first),
                }
            }
        }
    }
}

/// Hands a finished segment's activation over to `s.then` (with `onward` as its split) and
/// answers `reply` with what comes back, `on_first` set to the layers run before the hand-over
/// on the instance the batch was sent to.
fn pass_on(
    sh: &Arc<Shared>,
    reply: ReplyTo,
    batch: u64,
    s: Split,
    onward: Option<Split>,
    result: Result<Activation, ExecError>,
    on_first: u32,
) {
    let act = match result {
        Ok(act) => act,
        Err(e) => {
            let _ = sh.mesh.reply(&reply, &ServeError::from(e).to_failed());
            return;
        }
    };
    let sh = sh.clone();
    let working = sh.work.subscribe();
    tokio::spawn(async move {
        let _working = working;
        let answer = match hand_over(&sh, batch, s, onward, act).await {
            Ok(ExecMsg::Done { batch, embeddings, .. }) => ExecMsg::Done { batch, embeddings, on_first },
            Ok(other) => other,
            Err(e) => ServeError::Peer(format!("hand-over to node {}: {e}", s.then)).to_failed(),
        };
        let _ = sh.mesh.reply(&reply, &answer);
    });
}

fn done_msg(model: &ServedModel, batch: u64, r: Result<Activation, ExecError>, on_first: u32) -> ExecMsg {
    match r.and_then(|a| model.pool(&a)) {
        Ok(embeddings) => ExecMsg::Done { batch, embeddings, on_first },
        Err(e) => ServeError::from(e).to_failed(),
    }
}

/// Hands the activation over to `s.then` (pairing first when this instance holds no trusted
/// pairing with it) and asks it to finish the batch.
async fn hand_over(
    sh: &Arc<Shared>,
    batch: u64,
    s: Split,
    onward: Option<Split>,
    act: Activation,
) -> Result<ExecMsg, ServeError> {
    let bytes = act.to_bytes()?;
    let (len, crc) = (bytes.len() as u64, crc32fast::hash(&bytes));
    let finish = |region, slot| ExecMsg::Finish { batch, region, slot, len, crc, split: onward };
    match sh.pairs.hand_over(&*sh.mesh, &sh.ask(s.then), &bytes, finish).await? {
        done @ ExecMsg::Done { .. } => Ok(done),
        ExecMsg::Failed { message, .. } => Err(ServeError::Peer(message)),
        other => Err(ServeError::Protocol(format!("unexpected answer {other:?}"))),
    }
}
