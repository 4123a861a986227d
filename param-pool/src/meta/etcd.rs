//! [`EtcdStore`]: the pool's metadata in etcd, for control planes spread over machines (feature
//! `etcd`, the `etcd-client` crate).
//!
//! Keys under a prefix `P`:
//!
//! * `P/wal/<seq, 20 digits>` — one record each, written with a transaction that requires the key
//!   not to exist yet, so two managers that both think they own `P` cannot interleave their logs:
//!   the second one's append fails (`Fenced`);
//! * `P/snapshot` — `seq u64 LE | state`: the state after every record up to `seq`. A snapshot and
//!   the deletion of the records it covers are one transaction.
//!
//! etcd's writes are atomic and replicated, so there is no torn tail to cut off; recovery still
//! checks that the records it finds follow the snapshot without a gap. The trait is synchronous
//! (the embedded store's fsyncs block too): requests run on a dedicated thread with its own
//! runtime, so the store can be used from inside the manager's runtime.
//!
//! A snapshot is one etcd value and so must fit etcd's request limit (1.5 MiB by default): about
//! a thousand models with their manifests. Larger catalogs are refused with a clear error.

use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Txn, TxnOp};

use super::{MetaError, MetaStore, Recovered};

/// Largest snapshot written (etcd refuses requests over 1.5 MiB by default).
const MAX_VALUE: usize = 1_400_000;

enum Req {
    Append(Vec<u8>),
    Snapshot(Vec<u8>),
    Recover,
}

enum Resp {
    Done,
    Recovered(Recovered),
}

type Call = (Req, std_mpsc::SyncSender<Result<Resp, MetaError>>);

/// The pool's metadata in etcd.
pub struct EtcdStore {
    calls: std_mpsc::Sender<Call>,
    /// Where it is, for messages.
    at: String,
}

fn etcd_err(what: &str) -> impl FnOnce(etcd_client::Error) -> MetaError + '_ {
    move |e| MetaError::Corrupt(format!("etcd: {what}: {e}"))
}

struct Worker {
    client: Client,
    prefix: String,
    /// Sequence number of the next record.
    next: u64,
}

impl Worker {
    fn wal_key(&self, seq: u64) -> String {
        format!("{}/wal/{seq:020}", self.prefix)
    }

    fn snapshot_key(&self) -> String {
        format!("{}/snapshot", self.prefix)
    }

    async fn append(&mut self, rec: Vec<u8>) -> Result<Resp, MetaError> {
        let key = self.wal_key(self.next);
        let txn = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
            key.clone(),
            rec,
            None,
        )]);
        let resp = self.client.txn(txn).await.map_err(etcd_err("appending a record"))?;
        if !resp.succeeded() {
            return Err(MetaError::Corrupt(format!(
                "etcd: {key} exists already: another manager is writing under {}",
                self.prefix
            )));
        }
        self.next += 1;
        Ok(Resp::Done)
    }

    async fn snapshot(&mut self, state: Vec<u8>) -> Result<Resp, MetaError> {
        if state.len() + 8 > MAX_VALUE {
            return Err(MetaError::Corrupt(format!(
                "etcd: a snapshot of {} bytes exceeds etcd's request limit; use the embedded store",
                state.len()
            )));
        }
        let covered = self.next; // records 0..next are in the state
        let mut value = covered.to_le_bytes().to_vec();
        value.extend(state);
        let from = self.wal_key(0);
        let to = self.wal_key(covered);
        let txn = Txn::new().and_then([
            TxnOp::put(self.snapshot_key(), value, None),
            TxnOp::delete(from, Some(DeleteOptions::new().with_range(to))),
        ]);
        self.client.txn(txn).await.map_err(etcd_err("writing a snapshot"))?;
        Ok(Resp::Done)
    }

    async fn recover(&mut self) -> Result<Resp, MetaError> {
        let snap = self.client.get(self.snapshot_key(), None).await.map_err(etcd_err("reading the snapshot"))?;
        let (covered, snapshot) = match snap.kvs().first() {
            Some(kv) => {
                let v = kv.value();
                if v.len() < 8 {
                    return Err(MetaError::Corrupt(format!("etcd: {} is damaged", self.snapshot_key())));
                }
                let mut seq = [0u8; 8];
                seq.copy_from_slice(&v[..8]);
                (u64::from_le_bytes(seq), Some(v[8..].to_vec()))
            }
            None => (0, None),
        };
        let prefix = format!("{}/wal/", self.prefix);
        let resp = self
            .client
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(etcd_err("reading the log"))?;
        let mut records = Vec::new();
        let mut want = covered;
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            let seq: u64 = key
                .strip_prefix(&prefix)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| MetaError::Corrupt(format!("etcd: unexpected key {key}")))?;
            if seq < covered {
                continue; // left by a snapshot that was not followed by its deletion (cannot happen in one txn)
            }
            if seq != want {
                return Err(MetaError::Corrupt(format!("etcd: record {want} is missing before record {seq}")));
            }
            records.push(kv.value().to_vec());
            want += 1;
        }
        self.next = want;
        Ok(Resp::Recovered(Recovered { snapshot, records, dropped_tail_bytes: 0 }))
    }
}

impl EtcdStore {
    /// Connects to `endpoints` (e.g. `http://127.0.0.1:2379`) and keeps the metadata under
    /// `prefix`. Call [`MetaStore::recover`] before appending (as [`DurablePool::open`](super::DurablePool::open) does).
    pub fn connect(endpoints: &[String], prefix: &str, timeout: Duration) -> Result<EtcdStore, MetaError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| MetaError::Io { context: "starting the etcd client's runtime".into(), error: e })?;
        let opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let eps = endpoints.to_vec();
        let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
        let (calls, rx) = std_mpsc::channel::<Call>();
        let prefix = prefix.trim_end_matches('/').to_string();
        let prefix_shown = prefix.clone();
        std::thread::Builder::new()
            .name("etcd-store".into())
            .spawn(move || {
                rt.block_on(async move {
                    let client = match Client::connect(&eps, Some(opts)).await {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(etcd_err("connecting")(e)));
                            return;
                        }
                    };
                    let mut w = Worker { client, prefix, next: 0 };
                    // A connection is lazy: make one request so a dead endpoint fails here.
                    if let Err(e) = w.client.get(w.snapshot_key(), None).await {
                        let _ = ready_tx.send(Err(etcd_err("reaching the server")(e)));
                        return;
                    }
                    let _ = ready_tx.send(Ok(()));
                    while let Ok((req, reply)) = rx.recv() {
                        let r = match req {
                            Req::Append(b) => w.append(b).await,
                            Req::Snapshot(b) => w.snapshot(b).await,
                            Req::Recover => w.recover().await,
                        };
                        let _ = reply.send(r);
                    }
                })
            })
            .map_err(|e| MetaError::Io { context: "starting the etcd client's thread".into(), error: e })?;
        ready_rx.recv().map_err(|_| MetaError::Corrupt("etcd: the client thread stopped".into()))??;
        Ok(EtcdStore { calls, at: format!("etcd {} under {prefix_shown}", endpoints.join(",")) })
    }

    fn call(&self, req: Req) -> Result<Resp, MetaError> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        self.calls.send((req, tx)).map_err(|_| MetaError::Corrupt("etcd: the client thread stopped".into()))?;
        rx.recv().map_err(|_| MetaError::Corrupt("etcd: the client thread stopped".into()))?
    }
}

impl MetaStore for EtcdStore {
    fn append(&mut self, record: &[u8]) -> Result<(), MetaError> {
        self.call(Req::Append(record.to_vec())).map(|_| ())
    }

    fn snapshot(&mut self, state: &[u8]) -> Result<(), MetaError> {
        self.call(Req::Snapshot(state.to_vec())).map(|_| ())
    }

    fn describe(&self) -> String {
        self.at.clone()
    }

    fn recover(&mut self) -> Result<Recovered, MetaError> {
        match self.call(Req::Recover)? {
            Resp::Recovered(r) => Ok(r),
            Resp::Done => Err(MetaError::Corrupt("etcd: unexpected answer to recover".into())),
        }
    }
}
