//! Fuzzes the decoders that see bytes from the network before anything is trusted: the frame
//! header and the handshake messages. Neither may panic, and whatever decodes must re-encode to
//! the same bytes.
#![no_main]

use cascade_transport::handshake::{Msg, MSG_LEN};
use cascade_transport::wire::{Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
    }
    if data.len() >= MSG_LEN {
        let mut b = [0u8; MSG_LEN];
        b.copy_from_slice(&data[..MSG_LEN]);
        if let Ok(m) = Msg::decode(&b) {
            // Re-encoding is canonical (unused bytes are zero), so decode it again instead.
            assert_eq!(Msg::decode(&m.encode()).ok(), Some(m));
        }
    }
});
