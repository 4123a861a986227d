//! Test harness: see `src/bin/test-node.rs` and `tests/`.
