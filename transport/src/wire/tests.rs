use super::*;
use proptest::prelude::*;

fn any_op() -> impl Strategy<Value = Opcode> {
    (1u8..=11).prop_map(|v| Opcode::from_u8(v).unwrap())
}

fn any_status() -> impl Strategy<Value = Status> {
    (0u16..=6).prop_map(|v| Status::from_u16(v).unwrap())
}

prop_compose! {
    fn any_header()(op in any_op(), status in any_status(), req_id: u64, region: u32,
                    crc: Option<u32>, key: u64, offset: u64, len in 0..=MAX_MESSAGE) -> Header {
        // A goodbye's reason is short (the decoder refuses longer ones, tested below).
        let len = if op == Opcode::Goodbye { len % (MAX_GOODBYE + 1) } else { len };
        Header { op, flags: 0, status, req_id, region, crc: 0, key, offset, len }.with_crc(crc)
    }
}

proptest! {
    #[test]
    fn encode_decode_round_trip(h in any_header()) {
        prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn any_single_bit_flip_is_detected(h in any_header(), bit in 0usize..(48 * 8)) {
        let mut b = h.encode();
        b[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(Header::decode(&b).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = Header::decode(&b);
    }
}

#[test]
fn truncated_header_is_refused() {
    let b = Header::new(Opcode::Ping).encode();
    assert_eq!(Header::decode(&b[..55]), Err(FrameError::Truncated(55)));
}

#[test]
fn garbage_is_refused_by_magic() {
    assert!(matches!(Header::decode(&[b'G'; 64]), Err(FrameError::BadMagic(_))));
}

#[test]
fn oversized_send_is_refused() {
    let mut h = Header::new(Opcode::Send);
    h.len = MAX_MESSAGE + 1;
    assert_eq!(Header::decode(&h.encode()), Err(FrameError::TooLarge(MAX_MESSAGE + 1)));
}

#[test]
fn oversized_goodbye_is_refused_and_its_reason_is_its_payload() {
    let mut h = Header::new(Opcode::Goodbye);
    h.len = MAX_GOODBYE;
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    assert_eq!(h.payload_len(), MAX_GOODBYE);
    h.len = MAX_GOODBYE + 1;
    assert_eq!(Header::decode(&h.encode()), Err(FrameError::TooLarge(MAX_GOODBYE + 1)));
}

#[test]
fn payload_lengths_follow_the_opcode() {
    let mut h = Header::new(Opcode::ReadResp);
    h.len = 10;
    assert_eq!(h.payload_len(), 10);
    h.status = Status::BadKey;
    assert_eq!(h.payload_len(), 0);
    h.op = Opcode::ReadReq;
    assert_eq!(h.payload_len(), 0);
    h.op = Opcode::Write;
    assert_eq!(h.payload_len(), 10);
}
