//! # cascade-multicast
//!
//! BlitzScale's chained multicast (seed paper 004, Algorithm 1): scaling a model to N new
//! instances by serial forwarding chains costs about one load.
//!
//! * [`topology`] — nodes, GPUs, host memory, NICs, links and serving flows (TOML or built in code);
//! * [`planner`] — the pure, deterministic scale planner (`blitz`) and the `chain`, `star`, `tree`
//!   baselines, with a cost model that picks the chunk size and predicts completion times.
//!
//! * [`executor`] — runs a plan over the transport: pipelined chunks landing in registered regions,
//!   crc32 verified before forwarding, `LayerReady` events, re-planning around failed members;
//! * [`layout`] — chunks, per-chunk crc32 and the layer table of what travels;
//! * [`cluster`] — the same across processes: the node daemon's service ([`cluster::MulticastNode`]),
//!   the controller, and the copies a node holds for the parameter pool.
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod cluster;
pub mod executor;
pub mod layout;
pub mod planner;
pub mod topology;

#[cfg(test)]
mod test_util;

pub use executor::{execute, Event, ExecError, ExecOptions, Member, Report};
pub use layout::{Layout, LayoutError};
pub use planner::{plan, plan_with, CostModel, Edge, Forwarding, Plan, PlanError, PlannerKind, Request};
pub use topology::{Link, LinkKind, Loc, Machine, MeshRates, NodeId, Topology, TopologyError};
