//! The server's own generation loop: one thread runs [`Generator::generate_stream`] over the
//! jobs as they come — up to 32 decode together, a job arriving while others run joins the next
//! step, one finished hands its slot to the next (continuous batching), each with its own budget,
//! sampling and stop strings. At most `max_waiting` jobs wait for a slot.

use std::sync::{mpsc, Arc, Mutex};

use cascade_exec::llama::generate::{Generated, Generator};
use cascade_exec::llama::sample::Decoding;
use cascade_exec::llama::stop::StopStrings;
use cascade_transport::metrics::Metrics;
use tokio::sync::oneshot;

use super::{Backend, Job, Refused};

/// The generation loop's queue and thread.
pub(crate) struct Local {
    /// The loop's queue (`None` once the server stops).
    jobs: Mutex<Option<mpsc::SyncSender<Job>>>,
    /// The loop's thread, until it is joined.
    looping: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Jobs that may wait for the loop at most.
    max_waiting: usize,
}

impl Local {
    /// Starts the loop over `g`, its time to first token and cancellations counted in `metrics`.
    pub(crate) fn start(g: Arc<Generator>, metrics: Arc<Metrics>, max_waiting: usize) -> anyhow::Result<Local> {
        let (tx, rx) = mpsc::sync_channel::<Job>(max_waiting);
        let looping =
            std::thread::Builder::new().name("generation".into()).spawn(move || generation(&g, &rx, &metrics))?;
        Ok(Local { jobs: Mutex::new(Some(tx)), looping: Mutex::new(Some(looping)), max_waiting })
    }
}

impl Backend for Local {
    fn submit(&self, jobs: Vec<Job>) -> Result<(), Refused> {
        // Every choice queued (`Some(true)`), or the queue full (`Some(false)`: those queued end
        // at once, their cancel flag set as the caller's guard drops).
        let sent = match self.jobs.lock() {
            Ok(queue) => queue.as_ref().and_then(|q| {
                jobs.into_iter()
                    .map(|job| match q.try_send(job) {
                        Ok(()) => Some(true),
                        Err(mpsc::TrySendError::Full(_)) => Some(false),
                        Err(mpsc::TrySendError::Disconnected(_)) => None,
                    })
                    .find(|sent| sent != &Some(true))
                    .unwrap_or(Some(true))
            }),
            Err(_) => None,
        };
        match sent {
            Some(true) => Ok(()),
            Some(false) => {
                Err(Refused::Busy(format!("{} requests wait already: send it again later", self.max_waiting)))
            }
            None => Err(Refused::Stopping),
        }
    }

    fn close(&self, _rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
        self.jobs.lock().map_err(|_| anyhow::anyhow!("the queue's lock was poisoned"))?.take();
        let looping = self.looping.lock().map_err(|_| anyhow::anyhow!("the loop's lock was poisoned"))?.take();
        match looping {
            Some(l) => l.join().map_err(|_| anyhow::anyhow!("the generation loop panicked")),
            None => Ok(()),
        }
    }
}

/// A job the loop runs: where its answer and tokens go, when it was queued, whether its first
/// token came.
struct Running {
    reply: oneshot::Sender<Generated>,
    tokens: Option<tokio::sync::mpsc::UnboundedSender<u32>>,
    queued: std::time::Instant,
    first: bool,
}

/// The generation loop: jobs as they come, batched by [`Generator::generate_stream`], each
/// answer sent back when its sequence ends (a streamed one's tokens as they come). Returns when
/// the queue closes.
fn generation(g: &Generator, rx: &mpsc::Receiver<Job>, metrics: &Metrics) {
    let none = StopStrings::default();
    let ttft = metrics.histogram(
        "cascade_llm_server_first_token_seconds",
        "From a request's queueing to its first token in the LLM server's generation loop",
        &[],
    );
    loop {
        let replies = std::cell::RefCell::new(std::collections::HashMap::new());
        let mut closed = false;
        let mut k = 0usize;
        let jobs = std::iter::from_fn(|| {
            // While sequences run, a job not yet sent is not waited for; with none, the loop waits.
            let job = if replies.borrow().is_empty() {
                let j = rx.recv().ok();
                closed = j.is_none();
                j?
            } else {
                rx.try_recv().ok()?
            };
            let running = Running { reply: job.reply, tokens: job.tokens, queued: job.queued, first: false };
            replies.borrow_mut().insert(k, running);
            k += 1;
            Some(job.prompt)
        });
        let on_token = |i, tok| {
            let mut replies = replies.borrow_mut();
            let Some(r) = replies.get_mut(&i) else { return };
            if !r.first {
                r.first = true;
                ttft.observe(r.queued.elapsed().as_secs_f64());
            }
            if let Some(tokens) = &r.tokens {
                let _ = tokens.send(tok);
            }
        };
        // Its token channel closes as its answer is sent: every token came before.
        let on_done = |i, out| {
            if let Some(r) = replies.borrow_mut().remove(&i) {
                if r.reply.send(out).is_err() {
                    let help = "Requests the LLM server stopped generating because their client went away";
                    metrics.counter("cascade_llm_server_cancelled", help, &[]).inc();
                }
            }
        };
        if let Err(e) = g.generate_stream(jobs, usize::MAX, Decoding::Greedy, &none, on_token, on_done) {
            // The requests it ran are answered with errors (their senders dropped); the loop goes on.
            tracing::error!(error = %e, "a generation step failed: the requests running are answered with an error");
        }
        if closed {
            return;
        }
    }
}
