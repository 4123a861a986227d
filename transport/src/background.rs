//! Background work: threads at the lowest CPU priority, for work that only saves someone time
//! later (pre-faulting pages, a check that runs beside a transfer) and must not take a core
//! from the request loops and transfers of a loaded host.

use std::thread::JoinHandle;

/// Spawns `f` on a new thread named `name` that runs at nice 19: on a busy host the scheduler
/// gives it a core only when nothing at the default priority wants one. The priority is the
/// thread's own (Linux keeps nice values per thread); if the host refuses the change, the
/// thread runs at the default priority.
pub fn spawn_background<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<JoinHandle<T>> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        // SAFETY: gettid has no preconditions; setpriority on this thread's own id changes only
        // this thread's nice value, and lowering one's own priority needs no privilege.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
        }
        f()
    })
}

/// Runs `f` on a [`spawn_background`] thread and awaits its result; `None` when the thread
/// could not be started or panicked. A thread of tokio's blocking pool waits for it, so the
/// runtime counts the work as in flight (a runtime whose clock is paused does not jump ahead
/// meanwhile) and the pool's threads keep their own priority.
pub async fn run_in_background<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let name = name.to_string();
    tokio::task::spawn_blocking(move || spawn_background(&name, f).ok()?.join().ok()).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn background_threads_run_at_nice_19() {
        let nice = run_in_background("nice-test", || {
            // SAFETY: getpriority and gettid have no preconditions (an error reads as -1, which
            // the assertion below refuses).
            unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
        })
        .await;
        assert_eq!(nice, Some(19));
        // The caller's own thread keeps its priority.
        // SAFETY: as above.
        let mine = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        assert_ne!(mine, 19);
    }
}
