//! The manager's admin interface: one JSON request per line over TCP (loopback by default),
//! one JSON answer per line — `{"ok": true, "result": …}` or `{"ok": false, "error": "…"}`.
//! `cascade pool status|check|repair|register` are its clients. `status` is answered from the
//! latest published status, so it answers while the manager is busy repairing; the other
//! requests wait their turn.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

use super::Status;
use crate::pool::{CopyId, ModelId, NodeId};

/// A request to the manager.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// The pool's status.
    Status,
    /// Verify the invariant and every copy's checksums.
    Check,
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
}

/// A request on its way to the manager's loop, with where its answer goes.
pub struct AdminCall {
    /// The request.
    pub request: AdminRequest,
    /// The answer.
    pub reply: oneshot::Sender<Result<serde_json::Value, String>>,
}

/// Serves admin connections on `listener`, passing requests to the manager through `tx`
/// (status straight from `status`). Runs until the manager's loop stops taking calls.
pub async fn serve_admin(listener: TcpListener, tx: mpsc::Sender<AdminCall>, status: Arc<Mutex<Status>>) {
    loop {
        let Ok((sock, peer)) = listener.accept().await else { continue };
        let (calls, status) = (tx.clone(), status.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(sock, calls, status).await {
                debug!(%peer, error = %e, "admin connection ended");
            }
        });
        if tx.is_closed() {
            return;
        }
    }
}

async fn connection(sock: TcpStream, tx: mpsc::Sender<AdminCall>, status: Arc<Mutex<Status>>) -> std::io::Result<()> {
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await? {
        let answer = match serde_json::from_str::<AdminRequest>(&line) {
            Err(e) => Err(format!("bad request: {e}")),
            Ok(AdminRequest::Status) => {
                Ok(serde_json::to_value(&*status.lock().unwrap_or_else(|e| e.into_inner())).unwrap_or_default())
            }
            Ok(request) => {
                let (reply, rx) = oneshot::channel();
                if tx.send(AdminCall { request, reply }).await.is_err() {
                    Err("the manager is shutting down".to_string())
                } else {
                    rx.await.unwrap_or_else(|_| Err("the manager dropped the request".into()))
                }
            }
        };
        let v = match answer {
            Ok(result) => serde_json::json!({ "ok": true, "result": result }),
            Err(error) => serde_json::json!({ "ok": false, "error": error }),
        };
        let mut out = serde_json::to_vec(&v).unwrap_or_default();
        out.push(b'\n');
        w.write_all(&out).await?;
    }
    Ok(())
}

/// Why an admin call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The manager could not be reached or the exchange broke off.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The manager's answer is not an answer.
    #[error("the pool manager's answer is malformed: {0}")]
    Malformed(String),
    /// The manager refused the request, with its reason.
    #[error("{0}")]
    Refused(String),
}

/// Sends one request to the manager at `addr` and returns its result.
pub async fn admin_call(addr: SocketAddr, req: &AdminRequest) -> Result<serde_json::Value, AdminError> {
    let io = |context: String| move |source| AdminError::Io { context, source };
    let sock = TcpStream::connect(addr).await.map_err(io(format!("connecting to the pool manager at {addr}")))?;
    let (r, mut w) = sock.into_split();
    let mut line = serde_json::to_vec(req).map_err(|e| AdminError::Malformed(e.to_string()))?;
    line.push(b'\n');
    w.write_all(&line).await.map_err(io("sending to the pool manager".into()))?;
    let answer = BufReader::new(r)
        .lines()
        .next_line()
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
