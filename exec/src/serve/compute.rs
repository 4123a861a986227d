//! An instance's compute thread — the stand-in for its GPU: it owns the model, builds each stage
//! once its bytes are verified, and runs one layer at a time for the earliest job whose next
//! layer is resident, so a layer that lands preempts later batches (BlitzScale §5.2's schedule
//! on the new instance; on a fully loaded instance this is plain FIFO).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};

use bytes::Bytes;
use cascade_param_pool::manifest::Manifest;
use tracing::{debug, warn};

use crate::weights::Weights;
use crate::{Activation, ExecError, Staged};

/// Something to do with the model itself, on the compute thread (between layers).
pub(crate) type WithModel<M> = Box<dyn FnOnce(&mut M) + Send>;

/// Work for the compute thread.
pub(crate) enum Cmd<T, M> {
    /// Run `act` up to (not including) layer `stop`; an `urgent` job goes ahead of every job
    /// queued (the entry stage run for a peer, a millisecond that the peer waits on).
    Job { act: Activation, stop: usize, tag: T, urgent: bool },
    /// The model's packed image up to here is verified on this node: build what it completes.
    Verified(Bytes),
    /// Run this with the model (a decoder's KV cache moves in and out this way).
    With(WithModel<M>),
    /// Finish every job that can run, fail those waiting for a layer, and end the thread.
    Stop,
}

/// A finished (or failed) job, with its tag.
pub(crate) struct Finished<T> {
    pub(crate) tag: T,
    pub(crate) result: Result<Activation, ExecError>,
}

/// The handle the async side keeps.
pub(crate) struct Compute<T, M> {
    tx: mpsc::Sender<Cmd<T, M>>,
    resident: Arc<AtomicU32>,
    after_entry: Arc<AtomicU32>,
    layers: usize,
}

impl<T: Send + 'static, M: Staged> Compute<T, M> {
    /// Starts the thread on `model` (stages already built count as resident); finished jobs go
    /// to `done`. The thread ends when the handle is dropped and its jobs are done.
    pub(crate) fn start(
        model: M,
        manifest: Arc<Manifest>,
        done: tokio::sync::mpsc::UnboundedSender<Finished<T>>,
        name: String,
        core: Option<usize>,
    ) -> std::io::Result<Compute<T, M>> {
        if let Some(c) = core {
            check_core(c)?;
        }
        let (tx, rx) = mpsc::channel();
        let layers = model.layers();
        let resident = Arc::new(AtomicU32::new(0));
        let after_entry = Arc::new(AtomicU32::new(0));
        let (r2, k2) = (resident.clone(), after_entry.clone());
        std::thread::Builder::new().name(name).spawn(move || {
            if let Some(c) = core {
                pin(c);
            }
            run(model, &manifest, &rx, &done, (&r2, &k2))
        })?;
        Ok(Compute { tx, resident, after_entry, layers })
    }

    /// Queues work; false once the thread is gone.
    pub(crate) fn send(&self, cmd: Cmd<T, M>) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// Stages resident now (a prefix of the model).
    pub(crate) fn resident(&self) -> usize {
        self.resident.load(Ordering::Acquire) as usize
    }

    /// Stages resident from stage 1 on (a prefix of the model less its entry stage): what this
    /// instance can run of a batch whose entry stage ran elsewhere, while its own entry stage
    /// has not arrived (a copy packed with the embeddings last).
    pub(crate) fn after_entry(&self) -> usize {
        self.after_entry.load(Ordering::Acquire) as usize
    }

    /// The model's stages.
    pub(crate) fn layers(&self) -> usize {
        self.layers
    }
}

struct Pending<T> {
    act: Activation,
    stop: usize,
    tag: T,
}

fn run<T, M: Staged>(
    mut model: M,
    manifest: &Manifest,
    rx: &mpsc::Receiver<Cmd<T, M>>,
    done: &tokio::sync::mpsc::UnboundedSender<Finished<T>>,
    (resident, after_entry): (&AtomicU32, &AtomicU32),
) {
    let mut jobs: Vec<Pending<T>> = Vec::new();
    let mut stopping = false;
    let publish = |m: &M| {
        let k = (1..m.layers()).take_while(|&s| m.is_loaded(s)).count();
        let n = if m.is_loaded(0) { 1 + k } else { 0 };
        after_entry.store(k as u32, Ordering::Release);
        resident.store(n as u32, Ordering::Release);
    };
    publish(&model);
    loop {
        // Take what is queued; wait only when nothing can run.
        let runnable = |jobs: &[Pending<T>], m: &M| jobs.iter().position(|j| m.is_loaded(j.act.next_layer));
        if stopping && runnable(&jobs, &model).is_none() {
            for j in jobs.drain(..) {
                let e = ExecError::Model(format!("the instance stopped before layer {} arrived", j.act.next_layer));
                let _ = done.send(Finished { tag: j.tag, result: Err(e) });
            }
            return;
        }
        let cmd = if runnable(&jobs, &model).is_some() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => None,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return, // the instance is gone; waiting jobs could never run
            }
        };
        match cmd {
            Some(Cmd::Job { act, stop, tag, urgent }) => {
                if act.next_layer >= stop || stop > model.layers() {
                    let e = ExecError::Input(format!("layers {}..{stop} of {}", act.next_layer, model.layers()));
                    let _ = done.send(Finished { tag, result: Err(e) });
                } else if urgent {
                    jobs.insert(0, Pending { act, stop, tag });
                } else {
                    jobs.push(Pending { act, stop, tag });
                }
                continue;
            }
            Some(Cmd::Verified(bytes)) => {
                load_verified(&mut model, manifest, &bytes);
                publish(&model);
                continue;
            }
            Some(Cmd::With(f)) => {
                f(&mut model);
                continue;
            }
            Some(Cmd::Stop) => {
                stopping = true;
                continue;
            }
            None => {}
        }
        let Some(p) = runnable(&jobs, &model) else { continue };
        let mut j = jobs.remove(p);
        let layer = j.act.next_layer;
        match model.run(layer..layer + 1, j.act) {
            Ok(act) if act.next_layer == j.stop => {
                let _ = done.send(Finished { tag: j.tag, result: Ok(act) });
            }
            Ok(act) => {
                j.act = act;
                jobs.insert(p, j);
            }
            Err(e) => {
                let _ = done.send(Finished { tag: j.tag, result: Err(e) });
            }
        }
    }
}

/// The cores this process may run on (its affinity mask, which a container's cpuset or
/// `taskset` narrows), in order.
pub fn allowed_cores() -> std::io::Result<Vec<usize>> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set; sched_getaffinity(0, …) writes at
    // most its size into it, for the calling thread, and touches nothing else.
    let (r, set) = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let r = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        (r, set)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bits = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET only reads the set, at indices below its size in bits.
    Ok((0..bits).filter(|c| unsafe { libc::CPU_ISSET(*c, &set) }).collect())
}

/// Refuses a `core` this process may not run on: pinning to it failed, and the compute thread
/// ran unpinned after a warning — or, at 1,024 and above (past `cpu_set_t`), panicked in
/// `CPU_SET` and left the instance serving nothing.
pub(crate) fn check_core(core: usize) -> std::io::Result<()> {
    let allowed = allowed_cores()?;
    if allowed.contains(&core) {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("core {core} is not one this process may run on (it may use {})", ranges(&allowed)),
    ))
}

/// `[0, 1, 2, 5]` as "0-2, 5".
fn ranges(cores: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cores[i].to_string() } else { format!("{}-{}", cores[i], cores[j]) });
        i = j + 1;
    }
    if out.is_empty() {
        "no core".into()
    } else {
        out.join(", ")
    }
}

/// Pins the calling thread to CPU `core` (checked by [`check_core`] when the thread started;
/// logged and ignored when the system refuses after all).
fn pin(core: usize) {
    // SAFETY: `set` is a plain bit set on the stack, fully initialised by CPU_ZERO before use;
    // sched_setaffinity(0, …) only reads it and affects the calling thread alone.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        warn!(core, error = %std::io::Error::last_os_error(), "cannot pin the compute thread");
    }
}

/// Builds every stage not built yet whose tensors the verified bytes hold (with the embeddings
/// packed last, the blocks come before the entry stage).
fn load_verified<M: Staged>(model: &mut M, manifest: &Manifest, bytes: &[u8]) {
    let w = match Weights::verified_prefix(manifest, bytes) {
        Ok(w) => w,
        Err(e) => return warn!(error = %e, "verified bytes do not fit the model"),
    };
    for s in 0..model.layers() {
        if model.is_loaded(s) {
            continue;
        }
        match model.load_stage(s, &w) {
            Ok(()) => debug!(stage = s, "stage resident"),
            Err(ExecError::NotResident { .. }) => continue,
            Err(e) => return warn!(stage = s, error = %e, "cannot build the stage"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_this_process_may_not_use_are_refused() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(ranges(&[]), "no core");
        // Past cpu_set_t (CPU_SET panicked there) and far past it.
        for core in [1024, 4096, usize::MAX] {
            let e = check_core(core).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            assert!(e.to_string().starts_with(&format!("core {core} is not one this process may run on (it may use ")));
        }
        // The core this thread runs on is one it may use.
        // SAFETY: sched_getcpu has no preconditions.
        let here = unsafe { libc::sched_getcpu() };
        check_core(usize::try_from(here).unwrap()).unwrap();
    }
}
