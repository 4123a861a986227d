//! Benchmark binaries live in `src/bin/`.
