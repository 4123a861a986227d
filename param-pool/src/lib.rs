//! # cascade-param-pool
//!
//! Will hold the global parameter pool (seed paper 004, "Global parameter pool" and "Fault
//! tolerance"): safetensors manifests, the io_uring loader, the ≥k-copies invariant, durable
//! metadata and repair.
//!
//! **Status:** not implemented yet (tracked by the parameter-pool issue). This crate exports nothing.
