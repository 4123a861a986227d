//! # cascade-exec
//!
//! Will hold layer-wise execution and live autoscaling (cooperative execution, zigzag scheduling)
//! from seed paper 004.
//!
//! **Status:** not implemented yet. This crate exports nothing.
