//! What a development cluster made on the machine goes when its process is interrupted.
//!
//! [`crate::netns::Netns`] tears its namespaces down on drop and the tools stop their node
//! processes when a run ends, but SIGINT (Ctrl-C), SIGTERM or SIGHUP end a process without
//! either: every interrupted `cascade live --netns` left its five namespaces, their veth pairs
//! and bridge behind, and SIGTERM to a tool alone left its node processes serving for good. So
//! namespaces and node processes are also registered here, and the first one registered in a
//! process starts a watcher for those signals that kills the processes, deletes the
//! namespaces, and then exits as the signal would have (status 128 + its number). From then on
//! the process ends on these signals through the watcher — unless it asked for a graceful stop
//! ([`graceful`]): then the first SIGINT or SIGTERM is its own to handle, and a second one ends
//! it. A run's scratch directories and the same-host sockets of its clusters are registered too,
//! and removed after the processes are killed: a killed node cannot remove its socket, nor an
//! exiting process its endpoint's.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once};

use tokio::signal::unix::{signal, SignalKind};

#[derive(Default)]
struct Registry {
    namespaces: BTreeSet<String>,
    children: BTreeSet<u32>,
    /// Directories and the prefix of the sockets to remove there.
    sockets: BTreeSet<(PathBuf, String)>,
    dirs: BTreeSet<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    namespaces: BTreeSet::new(),
    children: BTreeSet::new(),
    sockets: BTreeSet::new(),
    dirs: BTreeSet::new(),
});

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Namespace `name` exists until [`forget_namespace`].
pub(crate) fn namespace(name: &str) {
    watch();
    registry().namespaces.insert(name.to_string());
}

/// Namespace `name` is gone.
pub(crate) fn forget_namespace(name: &str) {
    registry().namespaces.remove(name);
}

/// Whether the first SIGINT or SIGTERM is left to the process ([`graceful`]).
static GRACEFUL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The first SIGINT or SIGTERM is left to the process; a second one cleans up and exits.
pub(crate) fn graceful() {
    GRACEFUL.store(true, std::sync::atomic::Ordering::Relaxed);
    watch();
}

/// Process `pid`, a child, is killed on an interrupt until [`forget_child`].
pub(crate) fn child(pid: u32) {
    watch();
    registry().children.insert(pid);
}

/// Process `pid` has been reaped.
pub(crate) fn forget_child(pid: u32) {
    registry().children.remove(&pid);
}

/// The sockets named `prefix….sock` in `dir` are removed on an interrupt.
pub(crate) fn sockets(dir: &Path, prefix: &str) {
    watch();
    registry().sockets.insert((dir.to_path_buf(), prefix.to_string()));
}

/// Directory `dir` is removed, with what it holds, on an interrupt until [`forget_dir`].
pub(crate) fn dir(dir: &Path) {
    watch();
    registry().dirs.insert(dir.to_path_buf());
}

/// Directory `dir` is no longer removed on an interrupt.
pub(crate) fn forget_dir(dir: &Path) {
    registry().dirs.remove(dir);
}

/// Removes the files named `prefix….sock` in `dir`.
pub(crate) fn remove_sockets(dir: &Path, prefix: &str) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(prefix) && name.ends_with(".sock") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Starts the watcher once per process. The signals are taken over before this returns, so
/// none that arrives after the first namespace exists is missed. Without a runtime for it the
/// watcher is not started (said on stderr): the namespaces are then removed only on drop.
fn watch() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Err(e) = start() {
            eprintln!("warning: no watcher for SIGINT/SIGTERM: an interrupted run leaves its namespaces ({e})");
        }
    });
}

fn start() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    let streams = {
        let _in = rt.enter();
        (|| {
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
                signal(SignalKind::hangup())?,
            ))
        })()
    };
    let (mut int, mut term, mut hup) = match streams {
        Ok(s) => s,
        Err(e) => {
            // Not dropped: a runtime dropped inside another's task panics.
            rt.shutdown_background();
            return Err(e);
        }
    };
    std::thread::Builder::new().name("devcluster-signals".into()).spawn(move || {
        let number = rt.block_on(async move {
            let mut left_to_the_process = false;
            loop {
                let number = tokio::select! {
                    _ = int.recv() => libc::SIGINT,
                    _ = term.recv() => libc::SIGTERM,
                    _ = hup.recv() => libc::SIGHUP,
                };
                let graceful = GRACEFUL.load(std::sync::atomic::Ordering::Relaxed);
                if number == libc::SIGHUP || !graceful || left_to_the_process {
                    return number;
                }
                left_to_the_process = true;
                eprintln!("stopping gracefully: interrupt again to kill its processes at once");
            }
        });
        clean_up();
        std::process::exit(128 + number);
    })?;
    Ok(())
}

/// Kills the registered processes, deletes the registered namespaces (deleting a namespace
/// removes its ends of the veth pairs, and so the pairs), then removes the registered sockets
/// and directories.
fn clean_up() {
    let (children, namespaces, sockets, dirs) = {
        let mut r = registry();
        (
            std::mem::take(&mut r.children),
            std::mem::take(&mut r.namespaces),
            std::mem::take(&mut r.sockets),
            std::mem::take(&mut r.dirs),
        )
    };
    for &pid in &children {
        if let Ok(pid) = libc::pid_t::try_from(pid) {
            // SAFETY: kill(2) with a valid signal number touches no memory of this process. The
            // pid is a child not reaped when the registry was read (each is forgotten once
            // reaped), so it is still ours unless the main thread reaped it in between.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if !children.is_empty() {
        eprintln!("interrupted: killing the {} processes this one started", children.len());
    }
    if !namespaces.is_empty() {
        eprintln!(
            "interrupted: deleting the network namespaces {}",
            namespaces.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    for ns in namespaces {
        let _ = std::process::Command::new("ip").args(["netns", "del", &ns]).status();
    }
    // After the kills: a node killed is no longer writing in its directory.
    for (dir, prefix) in &sockets {
        remove_sockets(dir, prefix);
    }
    for d in &dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    /// Only this cluster's sockets go: not another cluster's, nor a file that is no socket.
    #[test]
    fn remove_sockets_takes_only_the_prefixed_sockets() {
        let dir = std::env::temp_dir().join(format!("cascade-cleanup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "cascade-demo1-ab-0.sock",
            "cascade-demo1-ab-3.sock",
            "cascade-demo12-ab-0.sock",
            "cascade-demo1-notes.txt",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        super::remove_sockets(&dir, "cascade-demo1-");
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["cascade-demo1-notes.txt", "cascade-demo12-ab-0.sock"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
