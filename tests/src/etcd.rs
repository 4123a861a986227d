//! A throwaway etcd server on loopback (Debian package `etcd-server`), killed and its data
//! directory removed on drop. Tests that need one print the reason and skip when it cannot start.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
pub struct EtcdServer {
    child: Child,
    /// Its client URL, `http://127.0.0.1:PORT`.
    pub endpoint: String,
    dir: PathBuf,
}

fn port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(|e| e.to_string())
}

impl EtcdServer {
    /// Starts etcd and waits until its client port accepts connections, or says why it cannot.
    pub fn start(tag: &str) -> Result<EtcdServer, String> {
        let (c, p) = (port()?, port()?);
        let dir = std::env::temp_dir().join(format!("cascade-etcd-{tag}-{}-{c}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let client = format!("http://127.0.0.1:{c}");
        let peer = format!("http://127.0.0.1:{p}");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start `etcd` (apt-get install etcd-server): {e}"))?;
        let mut s = EtcdServer { child, endpoint: client, dir };
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", c)).is_err() {
            if let Ok(Some(status)) = s.child.try_wait() {
                return Err(format!("etcd exited at start-up: {status}"));
            }
            if t.elapsed() > Duration::from_secs(20) {
                return Err("etcd did not open its client port within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(s)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
