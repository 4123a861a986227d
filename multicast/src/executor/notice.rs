//! The 32-byte notice a sender SENDs after each chunk WRITE (and the NACK asking for a re-send).

use crate::topology::Loc;

const MAGIC: u32 = u32::from_le_bytes(*b"CSMC");
/// Encoded size.
pub(crate) const NOTICE_LEN: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chunk = 1,
    Nack = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Notice {
    pub(crate) run: u32,
    pub(crate) kind: Kind,
    pub(crate) index: u32,
    pub(crate) from: Loc,
    pub(crate) to: Loc,
}

fn put_loc(b: &mut [u8], l: Loc) {
    b[0..4].copy_from_slice(&l.node.to_le_bytes());
    b[4..8].copy_from_slice(&l.gpu.unwrap_or(u32::MAX).to_le_bytes());
}

fn get_loc(b: &[u8]) -> Loc {
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Loc { node: u(0), gpu: Some(u(4)).filter(|g| *g != u32::MAX) }
}

impl Notice {
    pub(crate) fn encode(&self) -> [u8; NOTICE_LEN] {
        let mut b = [0u8; NOTICE_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.run.to_le_bytes());
        b[8] = self.kind as u8;
        b[12..16].copy_from_slice(&self.index.to_le_bytes());
        put_loc(&mut b[16..24], self.from);
        put_loc(&mut b[24..32], self.to);
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Notice> {
        if b.len() != NOTICE_LEN || b[0..4] != MAGIC.to_le_bytes() {
            return None;
        }
        let kind = match b[8] {
            1 => Kind::Chunk,
            2 => Kind::Nack,
            _ => return None,
        };
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Notice { run: u(4), kind, index: u(12), from: get_loc(&b[16..24]), to: get_loc(&b[24..32]) })
    }
}
