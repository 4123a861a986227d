//! # cascade-exec
//!
//! Layer-wise execution and live autoscaling from seed paper 004 (BlitzScale).
//!
//! **Status:** the zigzag planner ([`zigzag`]) — cooperative execution's schedule while a new
//! instance loads — is implemented, exact, and checked against an event simulation. The layer
//! executors, the instances and the live-scaling protocol are not built yet.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod zigzag;
