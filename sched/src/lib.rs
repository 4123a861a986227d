//! # cascade-sched
//!
//! Will hold the batching schedulers (Symphony, Shepherd's FLEX, Clockwork-like, Nexus-like,
//! dLoRA), the deterministic serving simulator and the real-time engine (seed papers 001–003).
//!
//! **Status:** not implemented yet (tracked by the schedulers issue). This crate exports nothing.
