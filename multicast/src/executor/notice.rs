//! The notice a sender sends after each chunk WRITE (and the NACK asking for a re-send): the
//! multicast-notice service's one message.

use cascade_transport::service::ServiceId;
use serde::{Deserialize, Serialize};

use crate::topology::Loc;

/// What a notice says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Chunk `index` is in the receiver's region.
    Chunk,
    /// Chunk `index` failed its crc at the receiver: write it again.
    Nack,
}

/// A chunk notice between two members of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// The run.
    pub run: u32,
    /// Chunk or NACK.
    pub kind: Kind,
    /// The chunk.
    pub index: u32,
    /// The sender.
    pub from: Loc,
    /// The receiver.
    pub to: Loc,
    /// With a chunk: the crc32 of the chunk as it was placed in the receiver's region, when
    /// the sender's link computed it during the WRITE (shared memory: read back from the
    /// receiver's memory right after the copy). The receiver then checks it against the layout
    /// instead of reading the chunk again; without it, the receiver reads the chunk itself.
    pub crc: Option<u32>,
}

cascade_transport::binary_message!(Notice, ServiceId::MULTICAST_NOTICE, 2);
