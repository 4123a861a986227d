//! # cascade-multicast
//!
//! Will hold BlitzScale's chained multicast (seed paper 004, Algorithm 1): the topology graph, the
//! pure scale planner and the pipelined chain executor over `cascade-transport`.
//!
//! **Status:** not implemented yet (tracked by the multicast issue). This crate exports nothing, so
//! nothing can be mistaken for a working planner.
