//! The framed wire protocol shared by the stream backends (`tcp`, `shm`).
//!
//! Every frame starts with a fixed 56-byte little-endian header; some opcodes are followed by
//! `len` payload bytes. The header carries its own crc32 so that garbage is recognised at once and
//! only that connection is closed.
//!
//! ```text
//! 0  magic   u32  "CSCD"          24 key     u64  remote key
//! 4  op      u8                   32 offset  u64  offset in the region
//! 5  flags   u8   bit0: crc valid 40 len     u64  bytes addressed / payload length
//! 6  status  u16                  48 hcrc    u32  crc32 of bytes 0..48
//! 8  req_id  u64                  52 pad     u32  zero
//! 16 region  u32
//! 20 crc     u32  crc32 of the data (when flags bit0); in a LookupReq, the engine's tag
//! ```
//!
//! This module is pure: it encodes and decodes, and never touches a socket.

/// Magic number at the start of every frame ("CSCD").
pub const MAGIC: u32 = u32::from_le_bytes(*b"CSCD");
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 56;
/// Largest SEND message accepted (64 MiB); larger ones are refused before any byte is read.
pub const MAX_MESSAGE: u64 = 64 << 20;
/// Longest reason a [`Opcode::Goodbye`] may carry (1 KiB); a longer one is refused.
pub const MAX_GOODBYE: u64 = 1 << 10;
/// Flag: the `crc` field holds the crc32 of the data.
pub const FLAG_CRC: u8 = 1;

/// Operation carried by a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// One-sided WRITE: `len` payload bytes follow, to land at `region`/`offset`.
    Write = 1,
    /// Completion of a WRITE, with its status.
    WriteAck = 2,
    /// One-sided READ request for `len` bytes at `region`/`offset`.
    ReadReq = 3,
    /// Answer to a READ: on success `len` payload bytes follow.
    ReadResp = 4,
    /// Two-sided SEND: `len` payload bytes follow, delivered to the peer's receive queue.
    Send = 5,
    /// Keepalive; carries nothing.
    Ping = 6,
    /// A one-sided engine asks for access to a region (key-checked by the owner); the `crc`
    /// field names the engine ([`EngineTag`]), whose lookup server answers.
    LookupReq = 7,
    /// Answer to a `LookupReq`, in the engine's own terms (shm: the memfd travels with it by
    /// SCM_RIGHTS; rdma: `offset` = virtual address, `key` = rkey, `len` = length).
    LookupResp = 8,
    /// One-sided paths (shm, rdma): the initiator has placed `len` bytes at `region`/`offset`
    /// without the target's CPU; asks the target to check (and verify the crc) and send a WriteAck.
    Written = 9,
    /// The owner withdrew `region`: drop any mapping or key cached for it (no answer).
    Forget = 10,
    /// The sender is closing this link on purpose (its endpoint is shutting down): `len` bytes
    /// of UTF-8 reason follow, and nothing after them. Sent only to peers that advertised
    /// `Caps::GOODBYE` in the handshake; a peer that closes without it has failed.
    Goodbye = 11,
}

/// Names a one-sided engine in a [`Opcode::LookupReq`]: each engine's file declares its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineTag(pub u32);

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Write,
            2 => Opcode::WriteAck,
            3 => Opcode::ReadReq,
            4 => Opcode::ReadResp,
            5 => Opcode::Send,
            6 => Opcode::Ping,
            7 => Opcode::LookupReq,
            8 => Opcode::LookupResp,
            9 => Opcode::Written,
            10 => Opcode::Forget,
            11 => Opcode::Goodbye,
            _ => return None,
        })
    }
}

/// Outcome of a remote operation, as answered by its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u16)]
#[non_exhaustive]
pub enum Status {
    /// Success.
    #[error("ok")]
    Ok = 0,
    /// No region with that id is registered.
    #[error("unknown region")]
    UnknownRegion = 1,
    /// The key does not match the region's.
    #[error("wrong remote key")]
    BadKey = 2,
    /// The range is not inside the region.
    #[error("range out of the region's bounds")]
    OutOfBounds = 3,
    /// The data's crc32 did not match.
    #[error("crc32 mismatch")]
    CrcMismatch = 4,
    /// The region cannot be accessed one-sidedly over this backend (e.g. not memfd-backed for shm).
    #[error("region is not accessible one-sidedly over this backend")]
    NotShareable = 5,
    /// The target failed for a local reason.
    #[error("internal error at the target")]
    Internal = 6,
}

impl Status {
    fn from_u16(v: u16) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownRegion,
            2 => Status::BadKey,
            3 => Status::OutOfBounds,
            4 => Status::CrcMismatch,
            5 => Status::NotShareable,
            6 => Status::Internal,
            _ => return None,
        })
    }
}

/// Why a header was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not the magic number.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// The header's own crc32 does not match.
    #[error("header crc32 mismatch")]
    BadHeaderCrc,
    /// Unknown opcode.
    #[error("unknown opcode {0}")]
    UnknownOpcode(u8),
    /// Unknown status code.
    #[error("unknown status {0}")]
    UnknownStatus(u16),
    /// Flag bits that this version does not define.
    #[error("unknown flags {0:#04x}")]
    UnknownFlags(u8),
    /// A SEND larger than [`MAX_MESSAGE`], or a goodbye longer than [`MAX_GOODBYE`].
    #[error("message of {0} bytes exceeds the limit")]
    TooLarge(u64),
    /// Fewer bytes than a header.
    #[error("truncated header: {0} of {HEADER_LEN} bytes")]
    Truncated(usize),
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation.
    pub op: Opcode,
    /// Flag bits ([`FLAG_CRC`]).
    pub flags: u8,
    /// Status (answers only).
    pub status: Status,
    /// Request id, echoed by answers.
    pub req_id: u64,
    /// Region id at the target.
    pub region: u32,
    /// crc32 of the data, valid when `flags & FLAG_CRC`.
    pub crc: u32,
    /// Remote key.
    pub key: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes addressed (and payload length where the opcode carries one).
    pub len: u64,
}

impl Header {
    /// A header with everything but the opcode zeroed.
    pub fn new(op: Opcode) -> Header {
        Header { op, flags: 0, status: Status::Ok, req_id: 0, region: 0, crc: 0, key: 0, offset: 0, len: 0 }
    }

    /// Number of payload bytes that follow this header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self.op {
            Opcode::Write | Opcode::Send | Opcode::Goodbye => self.len,
            Opcode::ReadResp if self.status == Status::Ok => self.len,
            _ => 0,
        }
    }

    /// The engine a `LookupReq` is for.
    pub fn engine(&self) -> EngineTag {
        EngineTag(self.crc)
    }

    /// A `LookupReq` for `engine`.
    pub fn lookup(engine: EngineTag, req_id: u64, region: u32, key: u64) -> Header {
        Header { req_id, region, key, crc: engine.0, ..Header::new(Opcode::LookupReq) }
    }

    /// The crc32 carried, if any.
    pub fn crc(&self) -> Option<u32> {
        (self.flags & FLAG_CRC != 0).then_some(self.crc)
    }

    /// Sets the carried crc32.
    pub fn with_crc(mut self, crc: Option<u32>) -> Header {
        match crc {
            Some(c) => {
                self.flags |= FLAG_CRC;
                self.crc = c;
            }
            None => {
                self.flags &= !FLAG_CRC;
                self.crc = 0;
            }
        }
        self
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op as u8;
        b[5] = self.flags;
        b[6..8].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.region.to_le_bytes());
        b[20..24].copy_from_slice(&self.crc.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        let hcrc = crc32fast::hash(&b[0..48]);
        b[48..52].copy_from_slice(&hcrc.to_le_bytes());
        b
    }

    /// Decodes and validates a header from the first [`HEADER_LEN`] bytes of `b`.
    pub fn decode(b: &[u8]) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if crc32fast::hash(&b[0..48]) != u32_at(48) || u32_at(52) != 0 {
            return Err(FrameError::BadHeaderCrc);
        }
        let op = Opcode::from_u8(b[4]).ok_or(FrameError::UnknownOpcode(b[4]))?;
        let flags = b[5];
        if flags & !FLAG_CRC != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let status = Status::from_u16(u16_at(6)).ok_or(FrameError::UnknownStatus(u16_at(6)))?;
        let h = Header {
            op,
            flags,
            status,
            req_id: u64_at(8),
            region: u32_at(16),
            crc: u32_at(20),
            key: u64_at(24),
            offset: u64_at(32),
            len: u64_at(40),
        };
        if (h.op == Opcode::Send && h.len > MAX_MESSAGE) || (h.op == Opcode::Goodbye && h.len > MAX_GOODBYE) {
            return Err(FrameError::TooLarge(h.len));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests;
