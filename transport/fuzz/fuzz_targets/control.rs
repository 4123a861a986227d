//! Fuzzes the control plane's decoders, which see bytes from the network before anything is
//! trusted: the envelope, then the body of every service's message (transport faults, multicast
//! control, reports and notices, the pool's requests, exec's and the LLM service's messages).
//! None may panic, and whatever decodes must re-encode canonically: encoding it, decoding that
//! and encoding again gives the same bytes (bytes, not values: a NaN in a float field is a valid
//! message that is not equal to itself).
#![no_main]

use cascade_exec::pd::LlmMsg;
use cascade_exec::serve::ExecMsg;
use cascade_multicast::cluster::proto::{Control, Notice, Report};
use cascade_param_pool::node::PoolMsg;
use cascade_transport::service::{Envelope, Message, ServiceFault};
use libfuzzer_sys::fuzz_target;

fn round_trip<M: Message>(version: u16, body: &[u8]) {
    if let Ok(m) = M::decode_body(version, body) {
        let first = m.encode_body();
        let again = M::decode_body(M::VERSION, &first).expect("a re-encoded message decodes");
        assert_eq!(again.encode_body(), first);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok((env, body)) = Envelope::decode(data) else { return };
    assert_eq!(&env.encode(body)[..], data);
    // Every decoder sees every body, whatever service the envelope names.
    round_trip::<ServiceFault>(env.version, body);
    round_trip::<Control>(env.version, body);
    round_trip::<Report>(env.version, body);
    round_trip::<Notice>(env.version, body);
    round_trip::<PoolMsg>(env.version, body);
    round_trip::<ExecMsg>(env.version, body);
    round_trip::<LlmMsg>(env.version, body);
});
