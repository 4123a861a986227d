//! The manager's admin interface: one JSON request per line, one JSON answer per line —
//! `{"ok": true, "result": …}` or `{"ok": false, "error": "…"}`. `cascade pool …` are its
//! clients. `status` is answered from the latest published status, so it answers while the
//! manager is busy repairing; the other requests wait their turn.
//!
//! Only the operator may use it:
//! - by default it listens on a unix socket that only its owner may open (mode 0600); every
//!   connection's peer credentials are read (`SO_PEERCRED`) and only the manager's own user or
//!   root is served, and a model file is registered only if that caller could read it;
//! - on TCP (`--admin host:port`) every connection first proves it holds the cluster secret:
//!   the manager sends a random challenge and the client answers HMAC-SHA256(secret, challenge),
//!   so the secret never crosses the wire;
//! - lines are at most [`MAX_LINE`] bytes, at most [`MAX_CONNECTIONS`] connections are served at
//!   once (the next one is told so and closed), and a failing `accept` (out of descriptors) backs
//!   off instead of spinning.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tracing::debug;

use super::Status;
use crate::manifest::hex;
use crate::pool::{CopyId, ModelId, NodeId};

/// A request to the manager.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// The pool's status.
    Status,
    /// Verify the invariant and every copy's checksums.
    Check,
    /// Every member node: state and history.
    Nodes,
    /// Drop the copies the nodes hold for other pools (an explicit decision of the operator).
    DropForeign,
    /// Repair what a check finds, then check again.
    Repair,
    /// Register a model file.
    Register {
        /// Model name.
        name: String,
        /// Path of its safetensors file (as the nodes see it).
        path: String,
    },
    /// Start a serving instance.
    Deploy {
        /// Model.
        model: ModelId,
        /// Node.
        node: NodeId,
        /// GPU.
        gpu: u32,
    },
    /// Ask for a copy to go.
    Reclaim {
        /// Copy.
        copy: CopyId,
    },
    /// Drain a node: its copies are made elsewhere first, then dropped; nothing new goes there
    /// (`cascade pool drain`). Answers with a [`DrainReport`](super::DrainReport).
    Drain {
        /// Node.
        node: NodeId,
    },
    /// Take a drained node back (`cascade pool undrain`).
    Undrain {
        /// Node.
        node: NodeId,
    },
    /// Carry out an epoch plan's moves (`cascade pool apply-epoch`): each moved model gets
    /// instances on its new sub-cluster before its old ones go.
    ApplyEpoch {
        /// The moves, in order.
        moves: Vec<super::epoch::EpochMove>,
    },
}

/// Longest request line accepted.
pub const MAX_LINE: usize = 64 << 10;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
const CHALLENGE_CONTEXT: &[u8] = b"cascade-admin-v1:";

/// Where the admin interface listens: a unix socket (the default) or a TCP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// A TCP address; clients must hold the cluster secret.
    Tcp(SocketAddr),
}

impl AdminAddr {
    /// The default: `cascade-pool.sock` in `$XDG_RUNTIME_DIR` (or the temp dir).
    pub fn default_unix() -> AdminAddr {
        let dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        AdminAddr::Unix(dir.join("cascade-pool.sock"))
    }
}

impl std::str::FromStr for AdminAddr {
    type Err = std::convert::Infallible;
    /// `host:port` is TCP; anything else is a socket path.
    fn from_str(s: &str) -> Result<AdminAddr, Self::Err> {
        Ok(match s.parse::<SocketAddr>() {
            Ok(a) => AdminAddr::Tcp(a),
            Err(_) => AdminAddr::Unix(PathBuf::from(s)),
        })
    }
}

impl std::fmt::Display for AdminAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminAddr::Unix(p) => write!(f, "{}", p.display()),
            AdminAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// Who sent a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// The operator: a TCP client that proved it holds the cluster secret, or the manager's own
    /// process.
    Operator,
    /// A local user on the unix socket, by its credentials.
    Local {
        /// User id.
        uid: u32,
        /// Primary group id.
        gid: u32,
    },
}

/// A request on its way to the manager's loop, with where its answer goes.
pub struct AdminCall {
    /// The request.
    pub request: AdminRequest,
    /// Who sent it.
    pub caller: Caller,
    /// The answer.
    pub reply: oneshot::Sender<Result<serde_json::Value, String>>,
}

/// A bound admin listener.
pub enum AdminListener {
    /// On a unix socket.
    Unix(UnixListener, PathBuf),
    /// On TCP, with the cluster secret that clients must prove.
    Tcp(TcpListener, Arc<[u8]>),
}

impl AdminListener {
    /// Binds `addr`. A unix socket gets mode 0600; a socket file left by a manager that is gone
    /// is replaced, one that a live manager answers on is not. TCP needs the cluster `secret`.
    pub async fn bind(addr: &AdminAddr, secret: &[u8]) -> std::io::Result<AdminListener> {
        match addr {
            AdminAddr::Tcp(a) => {
                if secret.is_empty() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "a TCP admin address needs the cluster secret",
                    ));
                }
                Ok(AdminListener::Tcp(TcpListener::bind(a).await?, Arc::from(secret)))
            }
            AdminAddr::Unix(p) => {
                if UnixStream::connect(p).await.is_ok() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        format!("a pool manager already answers on {}", p.display()),
                    ));
                }
                let _ = std::fs::remove_file(p);
                // Created with no permissions for others from the start (no window before chmod).
                // SAFETY: umask only changes this process's file-creation mask; it is restored below.
                let old = unsafe { libc::umask(0o177) };
                let l = UnixListener::bind(p);
                // SAFETY: as above.
                unsafe { libc::umask(old) };
                let l = l?;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))?;
                Ok(AdminListener::Unix(l, p.clone()))
            }
        }
    }
}

impl Drop for AdminListener {
    fn drop(&mut self) {
        if let AdminListener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Serves admin connections on `listener`, passing requests to the manager through `tx`
/// (status straight from `status`). Runs until the manager's loop stops taking calls.
pub async fn serve_admin(listener: AdminListener, tx: mpsc::Sender<AdminCall>, status: Arc<Mutex<Status>>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    loop {
        if tx.is_closed() {
            return;
        }
        let accepted = match &listener {
            AdminListener::Unix(l, _) => l.accept().await.map(|(s, _)| Conn::Unix(s)),
            AdminListener::Tcp(l, secret) => l.accept().await.map(|(s, _)| Conn::Tcp(s, secret.clone())),
        };
        let conn = match accepted {
            Ok(c) => c,
            Err(e) => {
                cascade_transport::back_off_after_failed_accept("admin", &e).await;
                continue;
            }
        };
        let (calls, status) = (tx.clone(), status.clone());
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(async move {
                let _ = conn.refuse("too many admin connections; try again").await;
            });
            continue;
        };
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.serve(me, calls, status).await {
                debug!(error = %e, "admin connection ended");
            }
        });
    }
}

enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream, Arc<[u8]>),
}

impl Conn {
    async fn refuse(self, why: &str) -> std::io::Result<()> {
        let line = answer_line(Err(why.to_string()));
        match self {
            Conn::Unix(mut s) => s.write_all(&line).await,
            Conn::Tcp(mut s, _) => s.write_all(&line).await,
        }
    }

    async fn serve(self, me: u32, tx: mpsc::Sender<AdminCall>, status: Arc<Mutex<Status>>) -> std::io::Result<()> {
        match self {
            Conn::Unix(s) => {
                let cred = s.peer_cred()?;
                let (uid, gid) = (cred.uid(), cred.gid());
                let (r, mut w) = s.into_split();
                if uid != me && uid != 0 {
                    w.write_all(&answer_line(Err(format!("uid {uid} may not use this pool manager")))).await?;
                    return Ok(());
                }
                requests(BufReader::new(r), w, Caller::Local { uid, gid }, tx, status).await
            }
            Conn::Tcp(s, secret) => {
                let (r, mut w) = s.into_split();
                let mut r = BufReader::new(r);
                let mut nonce = [0u8; 32];
                getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
                let challenge = serde_json::json!({ "challenge": hex(&nonce) });
                w.write_all(format!("{challenge}\n").as_bytes()).await?;
                let Some(line) = read_line(&mut r).await? else { return Ok(()) };
                let proof = serde_json::from_str::<serde_json::Value>(&line)
                    .ok()
                    .and_then(|v| v["auth"].as_str().and_then(unhex));
                if proof.is_none_or(|p| mac(&secret, &nonce).verify_slice(&p).is_err()) {
                    w.write_all(&answer_line(Err("authentication failed".into()))).await?;
                    return Ok(());
                }
                requests(r, w, Caller::Operator, tx, status).await
            }
        }
    }
}

/// Whether user `uid` (primary group `gid`) may read `path` by its permission bits: owner, group
/// or others. Supplementary groups are not consulted (a file readable only through one is
/// refused: register it as root or over TCP), nor the directories on the way.
pub(super) fn may_read(uid: u32, gid: u32, path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if uid == 0 {
        return Ok(());
    }
    let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mode = m.mode();
    let ok = (m.uid() == uid && mode & 0o400 != 0) || (m.gid() == gid && mode & 0o040 != 0) || mode & 0o004 != 0;
    if ok {
        Ok(())
    } else {
        Err(format!("{}: uid {uid} may not read it, so it may not register it", path.display()))
    }
}

fn mac(secret: &[u8], nonce: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("HMAC takes any key"));
    m.update(CHALLENGE_CONTEXT);
    m.update(nonce);
    m
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// One line of at most [`MAX_LINE`] bytes (`None` at the end of the stream).
async fn read_line<R: AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = (&mut *r).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf).await?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') && buf.len() > MAX_LINE {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "request line too long"));
    }
    String::from_utf8(buf)
        .map(|s| Some(s.trim_end().to_string()))
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "request is not UTF-8"))
}

fn answer_line(answer: Result<serde_json::Value, String>) -> Vec<u8> {
    let v = match answer {
        Ok(result) => serde_json::json!({ "ok": true, "result": result }),
        Err(error) => serde_json::json!({ "ok": false, "error": error }),
    };
    let mut out = serde_json::to_vec(&v).unwrap_or_default();
    out.push(b'\n');
    out
}

async fn requests<R: AsyncBufRead + Unpin, W: AsyncWrite + Unpin>(
    mut r: R,
    mut w: W,
    caller: Caller,
    tx: mpsc::Sender<AdminCall>,
    status: Arc<Mutex<Status>>,
) -> std::io::Result<()> {
    loop {
        let line = match read_line(&mut r).await {
            Ok(Some(l)) => l,
            Ok(None) => return Ok(()),
            Err(e) => {
                w.write_all(&answer_line(Err(format!("bad request: {e}")))).await?;
                return Err(e);
            }
        };
        let answer = match serde_json::from_str::<AdminRequest>(&line) {
            Err(e) => Err(format!("bad request: {e}")),
            Ok(AdminRequest::Status) => {
                Ok(serde_json::to_value(&*status.lock().unwrap_or_else(|e| e.into_inner())).unwrap_or_default())
            }
            Ok(request) => {
                let (reply, rx) = oneshot::channel();
                if tx.send(AdminCall { request, caller, reply }).await.is_err() {
                    Err("the manager is shutting down".to_string())
                } else {
                    rx.await.unwrap_or_else(|_| Err("the manager dropped the request".into()))
                }
            }
        };
        w.write_all(&answer_line(answer)).await?;
    }
}

/// Why an admin call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The manager could not be reached or the exchange broke off.
    #[error("{context}: {error}")]
    Io {
        /// What was being done.
        context: String,
        /// The error. Part of the message, not a `source()`, so an error chain prints it once.
        error: std::io::Error,
    },
    /// The manager's answer is not an answer.
    #[error("the pool manager's answer is malformed: {0}")]
    Malformed(String),
    /// The manager refused the request, with its reason.
    #[error("{0}")]
    Refused(String),
}

/// Sends one request to the manager at `addr` and returns its result; a TCP address needs the
/// cluster `secret`.
pub async fn admin_call(addr: &AdminAddr, secret: &[u8], req: &AdminRequest) -> Result<serde_json::Value, AdminError> {
    let io = |context: String| move |error| AdminError::Io { context, error };
    // Nothing listens there: say what would, rather than only "No such file or directory".
    let connecting = |error: std::io::Error| {
        use std::io::ErrorKind::{ConnectionRefused, NotFound};
        let hint = match error.kind() {
            NotFound | ConnectionRefused => {
                " (no manager listens there: is `cascade pool serve` running, with the same --admin?)"
            }
            _ => "",
        };
        AdminError::Io { context: format!("connecting to the pool manager at {addr}{hint}"), error }
    };
    let (r, mut w): (Box<dyn AsyncBufRead + Unpin + Send>, Box<dyn AsyncWrite + Unpin + Send>) = match addr {
        AdminAddr::Unix(p) => {
            let (r, w) = UnixStream::connect(p).await.map_err(connecting)?.into_split();
            (Box::new(BufReader::new(r)), Box::new(w))
        }
        AdminAddr::Tcp(a) => {
            let (r, w) = TcpStream::connect(a).await.map_err(connecting)?.into_split();
            (Box::new(BufReader::new(r)), Box::new(w))
        }
    };
    let mut r = r;
    if let AdminAddr::Tcp(_) = addr {
        let line = read_line(&mut r)
            .await
            .map_err(io("reading the pool manager's challenge".into()))?
            .ok_or_else(|| AdminError::Malformed("the connection closed before the challenge".into()))?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| AdminError::Malformed(e.to_string()))?;
        let nonce = v["challenge"].as_str().and_then(unhex).ok_or_else(|| match v["error"].as_str() {
            Some(e) => AdminError::Refused(e.to_string()),
            None => AdminError::Malformed("no challenge".into()),
        })?;
        let proof = hex(&mac(secret, &nonce).finalize().into_bytes());
        let auth = serde_json::json!({ "auth": proof });
        w.write_all(format!("{auth}\n").as_bytes()).await.map_err(io("answering the challenge".into()))?;
    }
    let mut line = serde_json::to_vec(req).map_err(|e| AdminError::Malformed(e.to_string()))?;
    line.push(b'\n');
    w.write_all(&line).await.map_err(io("sending to the pool manager".into()))?;
    let answer = read_line(&mut r)
        .await
        .map_err(io("reading the pool manager's answer".into()))?
        .ok_or_else(|| AdminError::Malformed("the connection closed without an answer".into()))?;
    let v: serde_json::Value = serde_json::from_str(&answer).map_err(|e| AdminError::Malformed(e.to_string()))?;
    if v["ok"] == serde_json::Value::Bool(true) {
        Ok(v["result"].clone())
    } else {
        Err(AdminError::Refused(v["error"].as_str().unwrap_or("unknown error").to_string()))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    use super::*;
    use crate::test_util::Scratch;

    /// A manager stand-in that answers every call with who sent it.
    fn echo() -> (mpsc::Sender<AdminCall>, Arc<Mutex<Status>>) {
        let (tx, mut rx) = mpsc::channel::<AdminCall>(4);
        tokio::spawn(async move {
            while let Some(c) = rx.recv().await {
                let _ = c.reply.send(Ok(serde_json::json!(format!("{:?}", c.caller))));
            }
        });
        (tx, Arc::default())
    }

    async fn serve(addr: &AdminAddr, secret: &[u8]) {
        let l = AdminListener::bind(addr, secret).await.unwrap();
        let (tx, status) = echo();
        tokio::spawn(serve_admin(l, tx, status));
    }

    /// A served unix-socket admin interface in a scratch directory, and the socket's path.
    async fn unix(tag: &str) -> (Scratch, AdminAddr, std::path::PathBuf) {
        let d = Scratch::new(tag);
        std::fs::create_dir_all(&*d).unwrap();
        let p = d.join("pool.sock");
        let addr = AdminAddr::Unix(p.clone());
        serve(&addr, b"").await;
        (d, addr, p)
    }

    fn tcp() -> AdminAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        AdminAddr::Tcp(l.local_addr().unwrap())
    }

    #[tokio::test]
    async fn the_unix_socket_is_the_owners_alone() {
        let (_d, addr, p) = unix("admin-unix").await;
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        let v = admin_call(&addr, b"", &AdminRequest::Check).await.unwrap();
        assert!(v.as_str().unwrap().starts_with("Local"), "{v}");
        // A second manager does not take the socket of a live one.
        let err = AdminListener::bind(&addr, b"").await.err().unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    }

    /// No manager at the address (a socket path that is not there, a port nobody listens on):
    /// the error says so and what to start.
    #[tokio::test]
    async fn a_call_where_no_manager_listens_says_what_to_start() {
        let d = Scratch::new("admin-none");
        for addr in [AdminAddr::Unix(d.join("absent.sock")), tcp()] {
            let err = admin_call(&addr, b"s", &AdminRequest::Check).await.unwrap_err().to_string();
            assert!(err.contains("is `cascade pool serve` running, with the same --admin?"), "{err}");
        }
    }

    #[tokio::test]
    async fn tcp_clients_must_prove_the_cluster_secret() {
        let addr = tcp();
        serve(&addr, b"right").await;
        let err = admin_call(&addr, b"wrong", &AdminRequest::Check).await.unwrap_err().to_string();
        assert!(err.contains("authentication failed"), "{err}");
        let v = admin_call(&addr, b"right", &AdminRequest::Check).await.unwrap();
        assert_eq!(v, serde_json::json!("Operator"));
        assert!(AdminListener::bind(&tcp(), b"").await.is_err(), "TCP without a secret is refused");
    }

    #[tokio::test]
    async fn an_endless_line_is_cut_off_and_connections_are_bounded() {
        let (_d, addr, p) = unix("admin-limits").await;
        // A line with no end: the manager answers with an error and closes, holding at most
        // MAX_LINE bytes of it.
        let mut s = UnixStream::connect(&p).await.unwrap();
        let junk = vec![b'x'; MAX_LINE * 4];
        let _ = s.write_all(&junk).await;
        let mut answer = String::new();
        BufReader::new(&mut s).read_line(&mut answer).await.unwrap();
        assert!(answer.contains("too long"), "{answer}");
        // MAX_CONNECTIONS idle connections; the next one is refused with a message.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(UnixStream::connect(&p).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let err = admin_call(&addr, b"", &AdminRequest::Check).await.unwrap_err().to_string();
        assert!(err.contains("too many"), "{err}");
        drop(idle);
        tokio::time::sleep(Duration::from_millis(100)).await;
        admin_call(&addr, b"", &AdminRequest::Check).await.unwrap();
    }

    #[test]
    fn a_local_user_may_register_only_what_it_could_read() {
        let d = Scratch::new("admin-perm");
        std::fs::create_dir_all(&*d).unwrap();
        let f = d.join("secret.safetensors");
        std::fs::write(&f, b"x").unwrap();
        let m = std::fs::metadata(&f).unwrap();
        let (owner, group) = (m.uid(), m.gid());
        let stranger = owner.wrapping_add(4242);
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(may_read(stranger, group.wrapping_add(4242), &f).is_err(), "a 0600 file of another user");
        assert!(may_read(stranger, group, &f).is_err(), "group bits are off");
        if owner != 0 {
            assert!(may_read(owner, group, &f).is_ok());
        }
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(may_read(stranger, group, &f).is_ok(), "readable by the group");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o604)).unwrap();
        assert!(may_read(stranger, group.wrapping_add(4242), &f).is_ok(), "readable by all");
        assert!(may_read(0, 0, &f).is_ok());
    }
}
