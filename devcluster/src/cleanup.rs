//! What a development cluster made on the machine goes when its process is interrupted.
//!
//! [`crate::netns::Netns`] tears its namespaces down on drop and the tools stop their node
//! processes when a run ends, but SIGINT (Ctrl-C), SIGTERM or SIGHUP end a process without
//! either: every interrupted `cascade live --netns` left its five namespaces, their veth pairs
//! and bridge behind, and SIGTERM to a tool alone left its node processes serving for good. So
//! namespaces and node processes are also registered here, and the first one registered in a
//! process starts a watcher for those signals that kills the processes, deletes the
//! namespaces, and then exits as the signal would have (status 128 + its number). From then on
//! the process ends on these signals through the watcher.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard, Once};

use tokio::signal::unix::{signal, SignalKind};

#[derive(Default)]
struct Registry {
    namespaces: BTreeSet<String>,
    children: BTreeSet<u32>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { namespaces: BTreeSet::new(), children: BTreeSet::new() });

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

/// Process `pid`, a child, is killed on an interrupt until [`forget_child`].
pub(crate) fn child(pid: u32) {
    watch();
    registry().children.insert(pid);
}

/// Process `pid` has been reaped.
pub(crate) fn forget_child(pid: u32) {
    registry().children.remove(&pid);
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
            tokio::select! {
                _ = int.recv() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
                _ = hup.recv() => libc::SIGHUP,
            }
        });
        clean_up();
        std::process::exit(128 + number);
    })?;
    Ok(())
}

/// Kills the registered processes and deletes the registered namespaces (deleting a namespace
/// removes its ends of the veth pairs, and so the pairs).
fn clean_up() {
    let (children, namespaces) = {
        let mut r = registry();
        (std::mem::take(&mut r.children), std::mem::take(&mut r.namespaces))
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
}
