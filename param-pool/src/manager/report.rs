//! What the manager reports: the pool's status and the outcome of a check.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::meta::ModelEntry;
use crate::pool::{CopyId, CopyKind, CopyState, ModelId, NodeId, Pool, Violation};

/// One model in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelStatus {
    /// Id.
    pub id: ModelId,
    /// Name.
    pub name: String,
    /// Bytes of parameters.
    pub bytes: u64,
    /// Ready copies on distinct live nodes.
    pub ready: usize,
    /// Whole copies — ready, or evicting and still readable — on distinct live nodes
    /// ([`Pool::whole_nodes`]); absent from an older manager's answer, read as 0.
    #[serde(default)]
    pub whole: usize,
    /// Why it is lost, if it is.
    pub lost: Option<String>,
}

/// One copy in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyStatus {
    /// Id.
    pub id: CopyId,
    /// Model.
    pub model: ModelId,
    /// Node.
    pub node: NodeId,
    /// `host` or `gpuN`.
    pub kind: String,
    /// `loading`, `ready` or `evicting`.
    pub state: String,
    /// Its bytes were checked against the manifest's crcs by this manager (when it was made,
    /// or by a check since it started); a copy recovered from the log is unverified until then.
    #[serde(default)]
    pub verified: bool,
    /// The last check found it missing on its node or different from its manifest.
    #[serde(default)]
    pub bad: bool,
    /// Of a loading copy: its bytes in place so far, as its multicast reports them layer by
    /// layer (verified) or its load from the file as the node is asked (placed; verified at the
    /// end). `None` until the first report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_place: Option<u64>,
}

/// One node in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Id.
    pub id: NodeId,
    /// Member of the pool (not declared dead).
    pub live: bool,
    /// Its link is down, not yet declared dead.
    pub unreachable: bool,
    /// Bytes of the copies it holds or fills.
    pub bytes: u64,
    /// Copies it holds or fills.
    pub copies: usize,
    /// Drained or draining: nothing new is placed there.
    #[serde(default)]
    pub draining: bool,
}

/// The pool at a glance (`cascade pool status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Copies required per model.
    pub k: usize,
    /// Every model.
    pub models: Vec<ModelStatus>,
    /// Every copy.
    pub copies: Vec<CopyStatus>,
    /// Every node.
    pub nodes: Vec<NodeStatus>,
    /// Broken invariants (copies still loading count as missing).
    pub violations: Vec<String>,
    /// No violation, nothing loading, nothing lost, every node reachable, store writable.
    pub healthy: bool,
    /// Why the manager is degraded (its metadata store refuses writes), if it is.
    #[serde(default)]
    pub degraded: Option<String>,
    /// Copies the nodes hold for other pools: reported, never touched.
    #[serde(default)]
    pub foreign: Vec<ForeignCopy>,
}

/// A member node as `cascade pool nodes` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The node.
    pub id: NodeId,
    /// `live`, `suspect` (link down, not yet declared dead), `dead`, `returning` (declared
    /// dead, link back, waiting to be re-admitted), `draining` (its copies being moved away) or
    /// `drained` (live, holding nothing, taking nothing new).
    pub state: String,
    /// Bytes of copies it holds for the pool.
    pub bytes: u64,
    /// Copies it holds for the pool.
    pub copies: usize,
    /// Drained or draining (also while dead): nothing new is placed there until undrained.
    #[serde(default)]
    pub draining: bool,
    /// What happened to it: seconds since the manager started, and what.
    pub history: Vec<(f64, String)>,
}

/// A copy a node holds for another pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignCopy {
    /// The node.
    pub node: NodeId,
    /// The other pool's id.
    pub pool: String,
    /// Its copy id there.
    pub copy: u64,
}

pub(super) fn describe(v: &Violation) -> String {
    match v {
        Violation::TooFewCopies { model, have } => format!("model {model} has {have} ready copies on distinct nodes"),
        Violation::OnDeadNode { copy } => format!("copy {copy} is recorded on a dead node"),
    }
}

fn kind(k: CopyKind) -> String {
    match k {
        CopyKind::Gpu(g) => format!("gpu{g}"),
        CopyKind::HostCache => "host".into(),
    }
}

fn state(s: CopyState) -> String {
    match s {
        CopyState::Loading => "loading",
        CopyState::Ready => "ready",
        CopyState::Evicting => "evicting",
    }
    .into()
}

impl Status {
    pub(super) fn of(
        pool: &Pool,
        catalog: &BTreeMap<ModelId, ModelEntry>,
        lost: &BTreeMap<ModelId, String>,
        suspects: &BTreeMap<NodeId, tokio::time::Instant>,
    ) -> Status {
        let models: Vec<ModelStatus> = catalog
            .iter()
            .map(|(id, e)| ModelStatus {
                id: *id,
                name: e.manifest.name.clone(),
                bytes: e.manifest.bytes,
                ready: pool.ready_nodes(*id).len(),
                whole: pool.whole_nodes(*id).len(),
                lost: lost.get(id).cloned(),
            })
            .collect();
        let copies: Vec<CopyStatus> = pool
            .copies()
            .map(|c| CopyStatus {
                id: c.id,
                model: c.model,
                node: c.node,
                kind: kind(c.kind),
                state: state(c.state),
                verified: false,
                bad: false,
                in_place: None,
            })
            .collect();
        let bytes = pool.bytes_per_node();
        let nodes = bytes
            .iter()
            .map(|(n, b)| NodeStatus {
                id: *n,
                live: true,
                unreachable: suspects.contains_key(n),
                bytes: *b,
                copies: copies.iter().filter(|c| c.node == *n).count(),
                draining: pool.is_draining(*n),
            })
            .collect();
        let mut violations: Vec<String> = pool.check().iter().map(describe).collect();
        for (id, e) in catalog {
            if !pool.has_model(*id) && !lost.contains_key(id) {
                violations.push(format!("model {id} ({:?}) is described but was never placed", e.manifest.name));
            }
        }
        let healthy = violations.is_empty()
            && lost.is_empty()
            && suspects.is_empty()
            && pool.copies().all(|c| c.state != CopyState::Loading);
        Status { k: pool.k(), models, copies, nodes, violations, healthy, degraded: None, foreign: Vec::new() }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "k = {}; {}", self.k, if self.healthy { "healthy" } else { "NOT healthy" })?;
        if let Some(why) = &self.degraded {
            writeln!(f, "DEGRADED (metadata store refuses writes; retrying): {why}")?;
        }
        writeln!(
            f,
            "{:>5}  {:<28} {:>14}  {:>5}  copies (node:kind:state; ? = not checked since the manager started)",
            "model", "name", "bytes", "ready"
        )?;
        for m in &self.models {
            let cs: Vec<String> = self
                .copies
                .iter()
                .filter(|c| c.model == m.id)
                .map(|c| {
                    let mark = if c.bad {
                        "!BAD"
                    } else if !c.verified && c.state != "loading" {
                        "?"
                    } else {
                        ""
                    };
                    // A loading copy's progress, `loading(40%)`, once its first layer landed.
                    let pct = match c.in_place {
                        Some(b) if c.state == "loading" && m.bytes > 0 => format!("({}%)", b * 100 / m.bytes),
                        _ => String::new(),
                    };
                    format!("{}:{}:{}{pct}{mark}", c.node, c.kind, c.state)
                })
                .collect();
            let name = m.name.escape_debug().to_string();
            writeln!(f, "{:>5}  {:<28} {:>14}  {:>5}  {}", m.id, name, m.bytes, m.ready, cs.join(" "))?;
            if let Some(why) = &m.lost {
                writeln!(f, "       LOST: {why}")?;
            }
        }
        writeln!(f, "{:>5}  {:>14}  {:>6}", "node", "bytes", "copies")?;
        for n in &self.nodes {
            let note = match (n.unreachable, n.draining) {
                (true, _) => "  (unreachable)",
                (false, true) if n.copies > 0 => "  (draining)",
                (false, true) => "  (drained)",
                (false, false) => "",
            };
            writeln!(f, "{:>5}  {:>14}  {:>6}{note}", n.id, n.bytes, n.copies)?;
        }
        for v in &self.violations {
            writeln!(f, "violation: {v}")?;
        }
        for c in &self.foreign {
            writeln!(f, "node {} holds copy {} of another pool ({}): left alone", c.node, c.copy, c.pool)?;
        }
        Ok(())
    }
}

/// The outcome of `cascade pool check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Nothing wrong.
    pub healthy: bool,
    /// What is wrong, one line each.
    pub problems: Vec<String>,
    /// Copies whose checksums were verified.
    pub copies_checked: usize,
    /// Their bytes.
    pub bytes_checked: u64,
    /// Copies that are missing on their node or whose crcs differ from the manifest.
    pub bad_copies: Vec<CopyId>,
}
