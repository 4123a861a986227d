//! Stopping the node processes a development cluster started, as an operator would.

use std::process::Child;
use std::time::{Duration, Instant};

/// Sends SIGTERM to `child` unless it has exited (its pid may be another process's by then):
/// whether it was signalled.
pub fn terminate(child: &mut Child) -> std::io::Result<bool> {
    if child.try_wait()?.is_some() {
        return Ok(false);
    }
    let pid = libc::pid_t::try_from(child.id()).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) on the pid of a child not reaped yet (so the pid is still its own) with a
    // valid signal number; it touches no memory of this process.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(true)
}

/// Starts `cmd`, a node of a development cluster on loopback: it is killed when this process
/// is interrupted (SIGINT, SIGTERM, SIGHUP), as what runs in namespaces is; before, SIGTERM to
/// a tool alone left its nodes serving for good. Stop it with [`stop_processes`].
pub fn spawn_node(cmd: &mut std::process::Command) -> std::io::Result<Child> {
    let child = cmd.spawn()?;
    crate::cleanup::child(child.id());
    Ok(child)
}

/// [`spawn_node`], and the node is also sent SIGTERM when the thread that calls this ends —
/// with it, if it is the main thread, this whole process, however it ends (SIGKILL, a crash):
/// a server's instances do not outlive it. Call it from a thread that lives as long as the node
/// should (the kernel ties the signal to the thread that forked, not to the process).
pub fn spawn_node_tied(cmd: &mut std::process::Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: prctl(2) and getppid(2) are, and it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the prctl: no signal will come for it.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                libc::raise(libc::SIGTERM);
            }
            Ok(())
        });
    }
    spawn_node(cmd)
}

/// Whether process `pid` has exited: it is not there, or it is a zombie its parent has not reaped
/// yet. For a process this one did not start (a node a namespaced run's launcher started), where
/// no `Child` can tell. A pid reused after the parent reaped it reads as running.
pub fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's name in parentheses, which may itself hold ") ".
        Ok(stat) => stat.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// The first of `children` that has exited, by its index, with its status (reaped).
pub fn first_exited(children: &mut [Child]) -> Option<(usize, std::process::ExitStatus)> {
    first_exited_of(children, |_| true)
}

/// [`first_exited`] among the children whose index `watched` accepts (one stopped on purpose
/// is left out, so that it does not hide another's exit).
pub fn first_exited_of(
    children: &mut [Child],
    watched: impl Fn(usize) -> bool,
) -> Option<(usize, std::process::ExitStatus)> {
    let found = children
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| watched(*i))
        .find_map(|(i, c)| c.try_wait().ok().flatten().map(|s| (i, s)));
    if let Some((i, _)) = found {
        crate::cleanup::forget_child(children[i].id());
    }
    found
}

/// Stops `children`: SIGTERM to each still running, so that it can leave its cluster cleanly
/// (and remove what it made, such as its same-host socket), then SIGKILL for any still running
/// after `grace`, said on stderr. A child already reaped (one a run killed) is not signalled.
/// Returns how many had to be killed.
pub fn stop_processes(children: impl IntoIterator<Item = Child>, grace: Duration) -> usize {
    // Those that exited are left out; one that could not be signalled is killed after the grace.
    let mut children: Vec<_> = children
        .into_iter()
        .filter_map(|mut c| {
            let signalled = !matches!(terminate(&mut c), Ok(false));
            if !signalled {
                crate::cleanup::forget_child(c.id());
            }
            signalled.then_some(c)
        })
        .collect();
    let deadline = Instant::now() + grace;
    let mut killed = 0;
    for c in &mut children {
        loop {
            match c.try_wait() {
                Ok(Some(_)) => {
                    crate::cleanup::forget_child(c.id());
                    break;
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    eprintln!("a node (pid {}) still ran {:.0?} after SIGTERM: killed", c.id(), grace);
                    let _ = c.kill();
                    let _ = c.wait();
                    crate::cleanup::forget_child(c.id());
                    killed += 1;
                    break;
                }
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A running process is not gone; one that exited is, before it is reaped (a zombie) and
    /// after.
    #[test]
    fn an_exited_process_is_gone_before_and_after_it_is_reaped() {
        assert!(!gone(std::process::id()));
        let mut child = Command::new("sleep").arg("0").spawn().expect("sleep");
        let t = Instant::now();
        while !gone(child.id()) {
            assert!(t.elapsed() < Duration::from_secs(10), "sleep 0 never read as gone");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Not reaped yet: still a zombie, still there.
        assert!(std::path::Path::new(&format!("/proc/{}", child.id())).exists());
        child.wait().expect("reaping sleep 0");
        let mut long = Command::new("sleep").arg("30").spawn().expect("sleep");
        assert!(!gone(long.id()));
        long.kill().expect("killing sleep 30");
        long.wait().expect("reaping sleep 30");
    }

    #[test]
    fn the_first_child_to_exit_is_found_by_its_index() {
        let mut children: Vec<Child> =
            ["30", "0"].iter().map(|s| Command::new("sleep").arg(s).spawn().expect("sleep")).collect();
        let t = Instant::now();
        let found = loop {
            if let Some(x) = first_exited(&mut children) {
                break x;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "sleep 0 did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(found.0, 1);
        assert!(found.1.success());
        stop_processes(children, Duration::from_secs(5));
    }

    #[test]
    fn a_process_that_leaves_on_sigterm_is_not_killed_and_one_that_ignores_it_is() {
        let polite = Command::new("sleep").arg("30").spawn().expect("sleep");
        let t = Instant::now();
        assert_eq!(stop_processes([polite], Duration::from_secs(10)), 0);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let stubborn = Command::new("sh").args(["-c", "trap '' TERM; sleep 30"]).spawn().expect("sh");
        // Give the shell time to install its trap before the signal.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        assert_eq!(stop_processes([stubborn], Duration::from_millis(500)), 1);
        assert!(t.elapsed() >= Duration::from_millis(500), "{:?}", t.elapsed());
    }

    #[test]
    fn a_reaped_child_is_not_signalled() {
        let mut c = Command::new("true").spawn().expect("true");
        c.wait().expect("wait");
        assert!(!terminate(&mut c).expect("terminate"));
        assert_eq!(stop_processes([c], Duration::from_secs(1)), 0);
    }
}
