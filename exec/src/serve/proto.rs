//! The exec service's messages (service [`ServiceId::EXEC`], version 4), binary-encoded on the
//! typed control plane.
//!
//! ```text
//! router -> instance  Run{batch, texts, split, onward}  ->  Done{batch, embeddings, on_first} | Failed
//! router -> new       PairWith{old}                     ->  Ack | Failed
//! new    -> old       Pair{slots}                       ->  Paired{region, key, len, slots, slot_bytes}
//! new    -> old       Finish{batch, region, slot, len, crc, split} -> Done | Failed  (behind a WRITE into the slot)
//! ctrl   -> instance  LayerReady{run, layer}                (one-way: the multicast's event, forwarded)
//! ctrl   -> instance  Lend{run} | Adopt{run}            ->  Ack | Failed
//! router -> instance  Status                            ->  State{resident, layers, after_entry}
//! ```
//!
//! A batch may cross three segments while a new copy's embedding table has not arrived: the
//! router sends `Run{split: 1 layer then new, onward: x layers then old}` to old, which runs the
//! entry stage and hands over to new with `Finish{split: Some(x then old)}`; new runs stages
//! `1..x` and hands over to old with `Finish{split: None}`; the answers go back the same way.

use cascade_transport::{binary_message, NodeId, ServiceId};
use serde::{Deserialize, Serialize};

/// Where a batch's remaining layers run after its first `layers` ran here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// Layers to run here, from the first.
    pub layers: u32,
    /// The instance that runs the rest (it was [`ExecMsg::Pair`]ed with this one).
    pub then: NodeId,
}

/// Requests and replies of the exec service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ExecMsg {
    /// Embed `texts`: every layer here, or the first `split.layers` here and the rest on
    /// `split.then`.
    Run {
        /// The router's batch id.
        batch: u64,
        /// The batch's texts.
        texts: Vec<String>,
        /// `None`: the whole model here.
        split: Option<Split>,
        /// Where the batch goes after `split.then` ran it up to `onward.layers` (a third
        /// segment); `None`: `split.then` runs every remaining layer.
        onward: Option<Split>,
    },
    /// The batch's unit-length embeddings, one per text.
    Done {
        /// The batch.
        batch: u64,
        /// The embeddings.
        embeddings: Vec<Vec<f32>>,
        /// Layers that ran on the instance the batch was sent to.
        on_first: u32,
    },
    /// Reserve activation slots for the asking instance in an activation region the answering
    /// one registers for it, which the asker then owns: it alone WRITEs them, each between the
    /// answer to its previous [`ExecMsg::Finish`] on that slot and its next. Pairing again (the
    /// asker no longer trusts its pairing) gets a new region and withdraws the old one: WRITEs
    /// still in flight into it are refused and `Finish`es naming it are not computed.
    Pair {
        /// Slots wanted (the cap on this pair's pending cooperative batches).
        slots: u32,
    },
    /// Pair with `peer` now (ask it for slots), before the first split batch needs them: the
    /// router's step (1) when a scale-out begins.
    PairWith {
        /// The instance to hand batches over to.
        peer: NodeId,
    },
    /// The slots granted.
    Paired {
        /// The activation region's id on the answering node.
        region: u32,
        /// Its key.
        key: u64,
        /// Its length.
        len: u64,
        /// The first slot granted.
        first: u32,
        /// Slots granted (maybe fewer than asked).
        slots: u32,
        /// Bytes per slot.
        slot_bytes: u64,
    },
    /// The activation of `batch` lies in `slot`: its `len` bytes were WRITTEN in the same batch
    /// as this request, which the link delivers after them. Run its remaining layers and answer
    /// with [`ExecMsg::Done`] — once the slot's bytes match `crc` (a WRITE that was refused
    /// leaves the slot's old bytes, which are never computed on).
    Finish {
        /// The batch.
        batch: u64,
        /// The activation region of the pairing (its id in [`ExecMsg::Paired`]).
        region: u32,
        /// The slot (of those granted).
        slot: u32,
        /// Bytes of the activation.
        len: u64,
        /// crc32 of the activation's bytes.
        crc: u32,
        /// `Some`: run up to `split.layers` only and hand over to `split.then`; `None`: run every
        /// remaining layer.
        split: Option<Split>,
    },
    /// The multicast run `run` verified layers `0..=layer` of this node's new copy (the
    /// multicast's `LayerReady`, forwarded by its controller).
    LayerReady {
        /// The multicast run filling this instance's copy.
        run: u32,
        /// The last layer verified (layers arrive in order).
        layer: u32,
    },
    /// Lend the instance's held copy to multicast run `run` as its source (the asker is the
    /// run's controller).
    Lend {
        /// The run.
        run: u32,
    },
    /// Take the copy multicast run `run` filled on this node out of the run, and hold it (it can
    /// be lent to the next run).
    Adopt {
        /// The run.
        run: u32,
    },
    /// Done.
    Ack,
    /// Ask for the instance's state.
    Status,
    /// The instance's state.
    State {
        /// Model stages resident (built from verified bytes).
        resident: u32,
        /// The model's stages.
        layers: u32,
        /// Stages resident from stage 1 on while the entry stage is not (a copy packed with its
        /// embeddings last): what the instance can run of a batch whose entry stage ran on a
        /// peer. Equals `resident − 1` once the entry stage is resident.
        after_entry: u32,
    },
    /// The request failed at the instance; nothing of it was answered.
    Failed {
        /// Why.
        message: String,
        /// Whether it may succeed elsewhere or later (false: the input itself is refused).
        retry: bool,
    },
}

binary_message!(ExecMsg, ServiceId::EXEC, 4);

#[cfg(test)]
mod tests {
    use cascade_transport::Message;

    use super::*;

    fn all() -> Vec<ExecMsg> {
        let split = Some(Split { layers: 3, then: 1 });
        vec![
            ExecMsg::Run { batch: 7, texts: vec!["Hello, world!".into(), String::new()], split, onward: None },
            ExecMsg::Run { batch: 8, texts: vec!["x".into()], split: None, onward: None },
            ExecMsg::Run {
                batch: 9,
                texts: vec!["y".into()],
                split: Some(Split { layers: 1, then: 2 }),
                onward: split,
            },
            ExecMsg::Done { batch: 7, embeddings: vec![vec![0.5, -0.25], vec![]], on_first: 3 },
            ExecMsg::Pair { slots: 8 },
            ExecMsg::PairWith { peer: 1 },
            ExecMsg::Paired { region: 4, key: u64::MAX, len: 1 << 30, first: 8, slots: 8, slot_bytes: 1_581_092 },
            ExecMsg::Finish { batch: 9, region: 4, slot: 3, len: 172_964, crc: 0x1234_5678, split: None },
            ExecMsg::Finish { batch: 9, region: u32::MAX, slot: 3, len: 172_964, crc: u32::MAX, split },
            ExecMsg::LayerReady { run: 0xdead_beef, layer: 6 },
            ExecMsg::Lend { run: 1 },
            ExecMsg::Adopt { run: 2 },
            ExecMsg::Ack,
            ExecMsg::Status,
            ExecMsg::State { resident: 2, layers: 7, after_entry: 1 },
            ExecMsg::Failed { message: "no".into(), retry: false },
        ]
    }

    #[test]
    fn every_message_round_trips_and_truncations_are_refused() {
        for m in all() {
            let b = m.encode_body();
            assert_eq!(ExecMsg::decode_body(ExecMsg::VERSION, &b).unwrap(), m);
            for cut in 0..b.len() {
                assert!(ExecMsg::decode_body(ExecMsg::VERSION, &b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(ExecMsg::decode_body(ExecMsg::VERSION, &long).is_err(), "{m:?} with a trailing byte");
        }
    }
}
