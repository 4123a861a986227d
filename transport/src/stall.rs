//! A watch on the async runtime a node runs on: it says when the runtime stood still.
//!
//! A task that blocks a runtime worker (a long copy, a page-faulting allocation, a lock held
//! across heavy work) can stop the runtime's I/O driver and timers with it: the node then sends no
//! keepalive, and after [`dead_after`](crate::EndpointConfig::dead_after) its peers declare it
//! down, although the process is alive. Seen from the peers that is only "no traffic"; this watch
//! makes the stalled node itself say so. A task on the runtime wakes every [`BEAT`]; when it
//! wakes longer than the threshold late, the runtime stood still that long: it logs a warning
//! with how long, and counts it in `cascade_runtime_stalls_total` and
//! `cascade_runtime_stall_seconds_max`.
//!
//! A plain thread beside the runtime wakes every [`BEAT`] too. When it was as late as the task,
//! the whole process was held (descheduled on a starved host, stopped), not the runtime's
//! workers by a task: the warning says which.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::metrics::Metrics;

/// How often the runtime's task (and the thread beside it) wakes.
pub const BEAT: Duration = Duration::from_millis(100);

/// A stall the watch saw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stall {
    /// How long the runtime ran no task of the watch.
    pub length: Duration,
    /// How late the watch's own thread was over the same time: close to `length` when the whole
    /// process was held rather than the runtime's workers.
    pub watcher_late: Duration,
}

impl Stall {
    /// Whether the whole process was held (the watch's thread was about as late as the runtime),
    /// rather than the runtime's workers by a task.
    pub fn process_held(&self) -> bool {
        self.watcher_late * 2 >= self.length
    }
}

struct Shared {
    /// The longest the watch's thread slept since the task last looked, in µs.
    watcher_gap_us: AtomicU64,
    stop: AtomicBool,
    seen: Mutex<Vec<Stall>>,
}

/// Watches the current runtime until dropped. See the module's docs.
pub struct StallWatch {
    shared: Arc<Shared>,
}

impl StallWatch {
    /// Starts watching the runtime this is called on (a task on it and a thread beside it);
    /// stalls longer than `threshold` are reported, and counted in `metrics` when given.
    pub fn start(threshold: Duration, metrics: Option<Arc<Metrics>>) -> std::io::Result<StallWatch> {
        let shared = Arc::new(Shared {
            watcher_gap_us: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            seen: Mutex::new(Vec::new()),
        });
        let watcher = shared.clone();
        std::thread::Builder::new().name("cascade-stall-watch".into()).spawn(move || {
            while !watcher.stop.load(Ordering::Relaxed) {
                let asleep = Instant::now();
                std::thread::sleep(BEAT);
                watcher.watcher_gap_us.fetch_max(micros(asleep.elapsed()), Ordering::Relaxed);
            }
        })?;
        let watch = shared.clone();
        tokio::spawn(async move {
            let mut prev = Instant::now();
            while !watch.stop.load(Ordering::Relaxed) {
                tokio::time::sleep(BEAT).await;
                let gap = prev.elapsed().saturating_sub(BEAT);
                if gap > threshold {
                    // The thread's lateness over the stall is in once it has woken after it.
                    tokio::time::sleep(BEAT * 2).await;
                    let watcher = Duration::from_micros(watch.watcher_gap_us.swap(0, Ordering::Relaxed));
                    report(
                        &watch,
                        Stall { length: gap, watcher_late: watcher.saturating_sub(BEAT) },
                        metrics.as_deref(),
                    );
                } else {
                    watch.watcher_gap_us.store(0, Ordering::Relaxed);
                }
                prev = Instant::now();
            }
        });
        Ok(StallWatch { shared })
    }

    /// The stalls seen so far.
    pub fn stalls(&self) -> Vec<Stall> {
        self.shared.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

fn report(watch: &Shared, stall: Stall, metrics: Option<&Metrics>) {
    let (ms, late_ms) = (stall.length.as_millis() as u64, stall.watcher_late.as_millis() as u64);
    if stall.process_held() {
        warn!(
            stall_ms = ms,
            watcher_late_ms = late_ms,
            "the whole process was held (not scheduled or stopped): its links sent nothing meanwhile"
        );
    } else {
        warn!(
            stall_ms = ms,
            "the async runtime stood still: a task blocked its workers, and the node's links sent no keepalive meanwhile"
        );
    }
    if let Some(m) = metrics {
        m.counter("cascade_runtime_stalls_total", "Times the node's async runtime stood still past the threshold", &[])
            .inc();
        let max = m.gauge("cascade_runtime_stall_seconds_max", "The longest stall of the node's async runtime", &[]);
        max.set(max.get().max(stall.length.as_secs_f64()));
    }
    watch.seen.lock().unwrap_or_else(|e| e.into_inner()).push(stall);
}

fn micros(d: Duration) -> u64 {
    d.as_micros() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that blocks the only runtime thread is seen, with about its length, as the
    /// runtime's stall (not the process's); a runtime that only sleeps shows none. (A loaded host
    /// may hold the whole test process meanwhile: such stalls are the process's and let pass.)
    #[tokio::test(flavor = "current_thread")]
    async fn a_blocked_runtime_is_seen_and_an_idle_one_is_not() {
        let w = StallWatch::start(Duration::from_millis(300), None).unwrap();
        let runtime_stalls =
            |w: &StallWatch| -> Vec<Stall> { w.stalls().into_iter().filter(|s| !s.process_held()).collect() };
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(runtime_stalls(&w).is_empty(), "an idle runtime: {:?}", w.stalls());
        // Blocks the runtime's one thread, as a heavy task would.
        std::thread::sleep(Duration::from_millis(900));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = runtime_stalls(&w);
        assert_eq!(s.len(), 1, "{:?}", w.stalls());
        assert!(s[0].length >= Duration::from_millis(800) && s[0].length < Duration::from_millis(2000), "{s:?}");
    }
}
