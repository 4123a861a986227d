//! # cascade-multicast
//!
//! BlitzScale's chained multicast (seed paper 004, Algorithm 1): scaling a model to N new
//! instances by serial forwarding chains costs about one load.
//!
//! * [`topology`] — nodes, GPUs, host memory, NICs, links and serving flows (TOML or built in code);
//! * [`planner`] — the pure, deterministic scale planner (`blitz`) and the `chain`, `star`, `tree`
//!   baselines, with a cost model that picks the chunk size and predicts completion times.
//!
//! **Status:** the pipelined chain executor over `cascade-transport`, the node daemon and the
//! multi-host harness are not implemented yet (tracked by the multicast issue).
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod planner;
pub mod topology;

pub use planner::{plan, plan_with, CostModel, Edge, Forwarding, Plan, PlanError, PlannerKind, Request};
pub use topology::{Link, LinkKind, Loc, NodeId, Topology, TopologyError};
