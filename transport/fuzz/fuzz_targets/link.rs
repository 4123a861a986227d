//! Fuzzes the link machine: the pure state machine that decides, for every frame a peer sends,
//! how many bytes to read, where they land, what to answer and which operation completes. The
//! harness (`cascade_transport::fuzzing::link_machine`) panics when one of its guarantees breaks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cascade_transport::fuzzing::link_machine(data));
