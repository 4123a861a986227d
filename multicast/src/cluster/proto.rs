//! The multicast's three services and their messages (see the transport's `service` module for
//! the envelope, the codec and how requests are matched to replies).
//!
//! ```text
//! service            request (controller -> node)              reply
//! multicast          Prepare{run, loc, bytes, chunk, fill}      Prepared{region, key, crcs}
//!                    Start{run, loc, layout, source, children,  Ack
//!                          ready_first}
//!                    AddChild{run, loc, child}                  Ack
//!                    Verify{run, loc}                           Verified{crc}
//!                    Release{run}                               Ack
//!                    (any of them)                              Failed{message}
//! multicast-report   Report{run, msg}       member -> controller, one-way
//! multicast-notice   Notice{run, kind, index, from, to}   member -> member, one-way
//! ```

use cascade_transport::service::ServiceId;
use serde::{Deserialize, Serialize};

use crate::executor::{ChildSpec, ToCoord};
pub use crate::executor::{Notice, NoticeKind};
use crate::layout::Layout;
use crate::topology::Loc;

/// Where a member's bytes come from when its region is prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Fill {
    /// Nothing: a target, written by the run; its pages allocated before it is prepared.
    Target,
    /// A source filled with the deterministic synthetic model of this seed.
    Synthetic {
        /// The seed.
        seed: u64,
    },
    /// A source whose region its node lent to the run beforehand
    /// ([`MulticastNode::lend`](super::MulticastNode::lend)): a copy the node holds.
    Lent,
    /// A target whose pages are allocated in the background, last first, while the run already
    /// fills it from the front ([`Prefault::Background`](cascade_transport::Prefault)): the
    /// transfer starts without waiting for the allocation.
    TargetInBackground,
    /// A lent source whose crc32 pass runs beside the transfer: the node answers at once, starts
    /// the pass with the source's `Start` and reports the chunks' crcs to the controller when
    /// it ends ([`ToCoord::SourceChecked`]). For runs whose layout is known beforehand: every target
    /// checks each chunk against that layout as it lands, so a corrupt source's bytes are never
    /// accepted meanwhile, and the run fails with
    /// [`ControlError::SourceMismatch`](super::ControlError::SourceMismatch) once the pass shows it.
    LentCheckBeside,
}

/// Requests of the multicast control service, and their replies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Control {
    /// Allocate and register a region for `loc` (or take the lent one); a source answers with
    /// the crc32 of each `chunk`.
    Prepare {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// Bytes of the model.
        bytes: u64,
        /// Chunk size (for the crcs of a source).
        chunk: u64,
        /// Where the bytes come from.
        fill: Fill,
    },
    /// The region is ready.
    Prepared {
        /// Region id.
        region: u32,
        /// Its key.
        key: u64,
        /// Per-chunk crc32 (sources only).
        crcs: Option<Vec<u32>>,
    },
    /// Start the member.
    Start {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
        /// What travels.
        layout: Layout,
        /// True for a source.
        source: bool,
        /// Where it sends.
        children: Vec<ChildSpec>,
        /// Ready the links to the children (look their regions up, map them) before answering;
        /// otherwise that runs beside the transfer.
        ready_first: bool,
    },
    /// A new child after a re-plan.
    AddChild {
        /// Run id.
        run: u32,
        /// The sender.
        loc: Loc,
        /// The child.
        child: ChildSpec,
    },
    /// Ask for the crc32 of a member's whole region.
    Verify {
        /// Run id.
        run: u32,
        /// Member location.
        loc: Loc,
    },
    /// The crc32 of the model's bytes in the region.
    Verified {
        /// The crc32.
        crc: u32,
    },
    /// Drop the run's regions (lent and detached ones stay with their owner).
    Release {
        /// Run id.
        run: u32,
    },
    /// Done.
    Ack,
    /// The request failed at the node.
    Failed {
        /// What failed.
        message: String,
    },
}

// Version 3: `ChildSpec` carries the layers the child holds (a re-plan's new sender skips them).
// Version 4: `Fill::LentCheckBeside`.
cascade_transport::binary_message!(Control, ServiceId::MULTICAST, 4);

/// A member's report to its run's controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Run id.
    pub run: u32,
    /// The report.
    pub msg: ToCoord,
}

// Version 2: `ToCoord::SourceChecked`.
cascade_transport::binary_message!(Report, ServiceId::MULTICAST_REPORT, 2);
