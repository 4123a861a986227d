//! # cascade-sched
//!
//! Batching schedulers for GPU model serving under latency SLOs (seed papers 001 Symphony and
//! 003 Shepherd), a deterministic serving simulator to evaluate them at cluster scale, and the
//! metrics the papers report.
//!
//! * [`scheduler`] — the sans-IO [`Scheduler`] trait every scheduler
//!   implements: the simulator (and the real-time engine) drive it with events and carry out its
//!   decisions;
//! * [`symphony`] — Symphony's non-work-conserving scheduler (§4.3, Appendix C) and its
//!   work-conserving variant, split into the model and rank sides of §4.5;
//! * [`clockwork`], [`nexus`] — the baselines as the papers describe them; [`clockwork_real`]
//!   adds the real Clockwork's schedule-ahead window and fixed batch sizes;
//! * [`flex`] — Shepherd's FLEX (Algorithm 1) and its non-preemptive variant;
//! * [`profile`] — ℓ(b) = α·b + β profiles and the papers' tables (`data/`);
//! * [`arrival`] — Poisson, Gamma, MMPP and trace-replay arrivals;
//! * [`sim`], [`metrics`], [`scenario`] — the simulator, what it measures, and scenario files;
//! * [`autoscale`] — Symphony's autoscaling advice (§4.4);
//! * [`realtime`] — Symphony on real threads against the wall clock (§4.5): ModelThreads, a
//!   RankThread and emulated GPU workers, fed by an in-process load generator.
//!
//! * [`lora`] — dLoRA (seed 002): dynamic merged/unmerged batching with adaptive thresholds and
//!   credits, burst-tolerance placement and routing, request–adapter co-migration (an ILP on
//!   `good_lp`/`microlp`), and the `lora-sim` simulator.
//! * [`partition`] — a cluster split by an epoch plan, one scheduler per part (`symphony/L`,
//!   `flex/herd:G:GMAX`), itself a [`Scheduler`];
//! * [`named_enum!`] — enums whose variants are chosen by name on the command line;
//! * [`plan`] — epoch-scale planning: Symphony's sub-cluster partitioning MILP (§4.7, Appendix A)
//!   and Shepherd's HERD groups (§4), each with a greedy fallback and a checked solver answer.
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod arrival;
pub mod autoscale;
pub mod charged;
pub mod clockwork;
pub mod clockwork_real;
pub mod flex;
pub mod lora;
pub mod metrics;
mod named;
pub mod nexus;
pub mod partition;
pub mod plan;
pub mod profile;
pub mod realtime;
pub mod scenario;
pub mod scheduler;
pub mod sim;
pub mod symphony;
pub mod time;

pub use metrics::Report;
pub use profile::Profile;
pub use scenario::{Goodput, Probe, Scenario, ScenarioError};
pub use scheduler::{Decision, GpuId, ModelId, Ms, Request, Scheduler, SCHEDULERS};
