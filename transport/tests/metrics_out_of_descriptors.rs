//! The metrics server when the process runs out of file descriptors: it backs off instead of
//! spinning a core on a failing `accept`, and serves the waiting scrape once descriptors are
//! free again. A test binary of its own, since it lowers the whole process's RLIMIT_NOFILE.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use cascade_transport::metrics::{serve_metrics, Metrics};

/// CPU time this process has used (user + system), seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage for RUSAGE_SELF.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

fn nofile() -> libc::rlimit {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid pointer to an rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r
}

fn set_nofile(r: libc::rlimit) {
    // SAFETY: a valid pointer to an rlimit; lowering the soft limit (or restoring it) needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
}

/// GET /metrics on `s`; the status line of the answer.
fn scrape(mut s: TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer.lines().next().unwrap_or_default().to_string()
}

/// Before: `accept` failing with EMFILE was retried at once, forever — a core at 100% for as
/// long as the process stayed out of descriptors (this test measured ~0.5 s of CPU in 0.5 s).
#[test]
fn the_metrics_server_backs_off_when_out_of_descriptors_and_serves_again() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(serve_metrics(listener, Arc::new(Metrics::new())));
    assert_eq!(scrape(TcpStream::connect(addr).unwrap()), "HTTP/1.1 200 OK");

    // Leave the process exactly one free descriptor, which the client's socket takes: the
    // server's accept then fails with EMFILE while the connection waits in its backlog.
    let before = nofile();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as libc::rlim_t;
    set_nofile(libc::rlimit { rlim_cur: open + 16, rlim_max: before.rlim_max });
    let mut hoard = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        hoard.push(f);
    }
    assert!(!hoard.is_empty());
    hoard.pop();
    let waiting = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let (t0, c0) = (std::time::Instant::now(), cpu_seconds());
    std::thread::sleep(Duration::from_millis(500));
    let cpu = cpu_seconds() - c0;
    let wall = t0.elapsed().as_secs_f64();
    drop(hoard);
    set_nofile(before);
    assert!(cpu < 0.3 * wall, "{cpu:.3} s of CPU in {wall:.3} s while out of descriptors: the accept loop spins");
    // Descriptors free again: the scrape that waited is answered.
    assert_eq!(scrape(waiting), "HTTP/1.1 200 OK");
}
