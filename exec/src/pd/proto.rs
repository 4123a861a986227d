//! The LLM service's messages (service [`ServiceId::LLM`], version 7: sampling), binary-encoded on
//! the typed control plane.
//!
//! ```text
//! router  -> decode   Reserve{req, tokens}                         -> Reserved{grant} | Failed
//! router  -> decode   Release{req, lease}                          -> Ack
//! router  -> prefill  Prefill{req, attempt, prompt, kv, split, ..}  -> Prefilled{req, first, ..} | Failed
//! new     -> old      Continue{req, attempt, act, kv, crcs, ..}     -> Prefilled | Failed  (a split prefill)
//! prefill -> decode   Start{req, attempt, lease, crcs, first, ..}  -> Ack | Failed  (after its KV WRITEs)
//! decode  -> router   Token{req, attempt, lease, index, token, done}  (one-way, per generated token)
//! decode  -> router   Abort{req, attempt, message}                    (one-way: decoding failed)
//! router  -> prefill  Mutate                                       -> Ack  (it becomes a decode instance)
//! router  -> any      Status                                       -> State{role, resident, ..}
//! router  -> decode   Load                                         -> Loads{requests, adapters, ..}
//! router  -> decode   Migrate{req, kv}                             -> Migrated{req, tokens} | Failed
//! decode  -> decode   ReserveAdapter{adapter, bytes}               -> AdapterGrant{..} | Ack (served there)
//! decode  -> decode   Resume{req, attempt, lease, crcs, ..}        -> Ack | Failed  (after its WRITEs)
//! decode  -> router   Leaving{running}                                (one-way: it stops; move its requests)
//! ```
//!
//! Co-migration (dLoRA §5.2): a decode instance hands a running request to another one between
//! two decode steps — its KV so far by one-sided WRITEs into pages the other granted, and, when
//! the other lacks the request's adapter, the adapter's tensors by a WRITE into a region it
//! granted — then `Resume` there; the token stream goes on from the new instance. A migration
//! that fails leaves the request decoding where it was.
//!
//! The KV of a prefilled request moves from the prefill instance(s) to the decode instance by
//! one-sided WRITEs, block (layer) by block, into the pages the decode instance granted in its
//! registered KV region ([`KvGrant`]); `Start` follows the WRITEs' completion.
//!
//! A grant is a *lease* (`KvGrant::lease`): `Start`, `Resume` and `Release` name it, and the
//! decode instance acts on none that names a lease the request no longer holds — a late message
//! of an attempt the router abandoned (its call timed out, it redid the request) cannot start,
//! free or take the pages of a later one. An abandoned writer may still WRITE into pages that
//! were freed and granted again, which no message can stop; so `Start` and `Resume` carry each
//! block's crc32 as the writer computed it, and the decode instance checks the bytes it reads
//! against them before it decodes: foreign bytes make it refuse the start (the request is redone)
//! rather than decode from them.
//!
//! `Prefill`, `Continue`, `Start` and `Resume` carry how the request's tokens are drawn
//! ([`SeqSampling`]; `None`: greedily): the first where its prefill ends, the others on its
//! decode instance. The n-th token's draw depends only on the request's settings, its index and
//! n, so a request redone, split or migrated draws as it would have in one process.
//!
//! Each dispatch of a request is an *attempt*, numbered by the router; the number travels with
//! the prefill (`Prefill`, `Continue`, `Start`) and with a migration (`Resume`), and every
//! `Token` and `Abort` carries it, and the lease it decodes under. The router takes tokens only
//! of the attempt it is waiting for: a decode of an attempt it gave up on (whose `Release` was
//! lost, on this instance or another) streams nothing into the answer and cannot abort the
//! attempt that redoes it; the router answers its tokens with a `Release` of their lease, which
//! stops it.

use cascade_transport::{binary_message, NodeId, ServiceId};
use serde::{Deserialize, Serialize};

pub use crate::llama::sample::SeqSampling;
pub use crate::serve::Split;

/// Pages of a decode instance's registered KV region granted to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGrant {
    /// The decode instance.
    pub node: NodeId,
    /// Its KV region's id.
    pub region: u32,
    /// The region's key.
    pub key: u64,
    /// The region's length.
    pub len: u64,
    /// The pages, in token order.
    pub pages: Vec<u32>,
    /// The reservation this grant is (messages about it name it).
    pub lease: u64,
}

/// What a WRITE into a granted region put there: its length and crc32, which the reader checks
/// its copy of the bytes against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Written {
    /// Bytes from the region's start.
    pub bytes: u64,
    /// Their crc32.
    pub crc: u32,
}

/// A registered region of a peer lent for one WRITE.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionGrant {
    /// The peer.
    pub node: NodeId,
    /// The region's id.
    pub region: u32,
    /// Its key.
    pub key: u64,
    /// Its length.
    pub len: u64,
}

/// One request decoding on an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReqLoad {
    /// The request.
    pub req: u64,
    /// Its adapter (0: the base model).
    pub adapter: u32,
    /// Tokens in its KV.
    pub tokens: u32,
    /// Tokens it still generates at most.
    pub remaining: u32,
    /// The router whose request it is (its tokens go there). Only that router moves it: another
    /// router's state would not follow the move.
    pub router: u32,
}

/// What an instance does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Prefills prompts and moves their KV to decode instances.
    Prefill,
    /// Decodes requests whose KV it received.
    Decode,
}

/// Requests and replies of the LLM service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum LlmMsg {
    /// Reserve KV pages for `tokens` tokens (prompt and generation) of request `req`.
    Reserve {
        /// The request.
        req: u64,
        /// Tokens to hold.
        tokens: u32,
    },
    /// The pages reserved.
    Reserved {
        /// Where the request's KV goes.
        grant: KvGrant,
    },
    /// Free request `req`'s pages (a reservation its prefill never used), if it holds them
    /// under `lease`.
    Release {
        /// The request.
        req: u64,
        /// The reservation ([`KvGrant::lease`]).
        lease: u64,
    },
    /// Prefill `prompt`: every stage here, or the first `split.layers` here and the rest on
    /// `split.then`; then move the KV to `kv` and start decoding there.
    Prefill {
        /// The request (also its sequence id in every KV cache).
        req: u64,
        /// The router's attempt at it (its tokens carry it).
        attempt: u32,
        /// The prompt's tokens.
        prompt: Vec<u32>,
        /// Tokens to generate at most (the first included).
        max_tokens: u32,
        /// The decode instance's pages.
        kv: KvGrant,
        /// `None`: every stage here.
        split: Option<Split>,
        /// Where the decode instance streams the tokens.
        router: NodeId,
        /// The LoRA adapter it is served with (0: the base model).
        adapter: u32,
        /// How its tokens are drawn (`None`: greedily).
        sample: Option<SeqSampling>,
    },
    /// The rest of a split prefill: `act` is the activation after the asker's stages, whose KV
    /// it already wrote to `kv`.
    Continue {
        /// The request.
        req: u64,
        /// The router's attempt at it.
        attempt: u32,
        /// The activation's bytes ([`crate::Activation::to_bytes`]).
        act: Vec<u8>,
        /// Tokens to generate at most.
        max_tokens: u32,
        /// The decode instance's pages.
        kv: KvGrant,
        /// Where the decode instance streams the tokens.
        router: NodeId,
        /// crc32 of each block's pages the asker WROTE, in block order.
        crcs: Vec<u32>,
        /// How its tokens are drawn (`None`: greedily).
        sample: Option<SeqSampling>,
    },
    /// The prefill is done: its first token, and whether a decode instance now generates the
    /// rest (false when the first token ended it).
    Prefilled {
        /// The request.
        req: u64,
        /// The first generated token.
        first: u32,
        /// Stages run on the instance the prefill was sent to when it was split (0 = whole).
        on_first: u32,
        /// Whether decoding started.
        decoding: bool,
    },
    /// Every block of `req`'s prompt KV is in its pages: decode from `first`.
    Start {
        /// The request.
        req: u64,
        /// The router's attempt at it (its tokens carry it).
        attempt: u32,
        /// The reservation the KV was written into ([`KvGrant::lease`]).
        lease: u64,
        /// crc32 of each block's pages as written (every block of the model, in order).
        crcs: Vec<u32>,
        /// Prompt tokens (the KV's length).
        prompt_len: u32,
        /// The first generated token (decoding feeds it next).
        first: u32,
        /// Tokens to generate at most (the first included).
        max_tokens: u32,
        /// Where to stream the tokens.
        router: NodeId,
        /// The LoRA adapter it is served with (0: the base model).
        adapter: u32,
        /// How its tokens are drawn (`None`: greedily).
        sample: Option<SeqSampling>,
    },
    /// A decode instance's load, for migration decisions.
    Load,
    /// The answer to `Load`.
    Loads {
        /// Requests decoding here.
        requests: Vec<ReqLoad>,
        /// Adapters this instance serves.
        adapters: Vec<u32>,
        /// Pages of the KV region (0 before it exists).
        kv_pages: u32,
        /// Free pages of it.
        free_pages: u32,
    },
    /// Make room for adapter `adapter`'s image of `bytes` (a migration brings it).
    ReserveAdapter {
        /// The adapter.
        adapter: u32,
        /// Its image's length ([`crate::llama::LoraAdapter::to_image`]).
        bytes: u64,
    },
    /// Where to WRITE the adapter's image.
    AdapterGrant {
        /// The region.
        grant: RegionGrant,
    },
    /// Hand request `req` to the decode instance that granted `kv`, between two decode steps
    /// (with its adapter when that instance lacks it).
    Migrate {
        /// The request.
        req: u64,
        /// Its pages on the new instance (for every token so far and to come).
        kv: KvGrant,
    },
    /// The request moved: the new instance decodes it from token `tokens` of the answer on.
    Migrated {
        /// The request.
        req: u64,
        /// Tokens of the answer generated before the move.
        tokens: u32,
    },
    /// Decode a migrated request whose KV (and adapter) the old instance WROTE here.
    Resume {
        /// The request.
        req: u64,
        /// The router's attempt it decodes for (its tokens carry it).
        attempt: u32,
        /// The reservation the KV was written into ([`KvGrant::lease`]).
        lease: u64,
        /// crc32 of each block's pages as written (every block of the model, in order).
        crcs: Vec<u32>,
        /// Tokens in its KV (the position fed next).
        pos: u32,
        /// The last generated token (fed next).
        last: u32,
        /// Tokens of the answer so far.
        generated: u32,
        /// Tokens to generate at most.
        max_tokens: u32,
        /// Where to stream the tokens.
        router: NodeId,
        /// Its adapter.
        adapter: u32,
        /// The adapter's image in the granted region, when one was written.
        adapter_image: Option<Written>,
        /// How its tokens are drawn (`None`: greedily): the `n`-th token's draw depends on this
        /// and `n` alone, so it goes on here as it would have there.
        sample: Option<SeqSampling>,
    },
    /// A generated token: `index` 1 is the second token of the answer (index 0 is `first`).
    Token {
        /// The request.
        req: u64,
        /// The router's attempt it was generated for.
        attempt: u32,
        /// The reservation it decodes under here (a `Release` of it stops the decode).
        lease: u64,
        /// Its index in the answer.
        index: u32,
        /// The token.
        token: u32,
        /// The request is complete with it.
        done: bool,
    },
    /// Decoding `req` failed: nothing more comes for it.
    Abort {
        /// The request.
        req: u64,
        /// The router's attempt that failed.
        attempt: u32,
        /// Why.
        message: String,
    },
    /// Become a decode instance (keeping the parameters): prefills still running finish.
    Mutate,
    /// Ask for the instance's state.
    Status,
    /// The instance's state.
    State {
        /// What it does.
        role: Role,
        /// Stages resident.
        resident: u32,
        /// The model's stages.
        layers: u32,
        /// Requests decoding (those being handed over to another instance included).
        running: u32,
        /// Free KV pages (0 before the region exists).
        free_pages: u32,
    },
    /// Done.
    Ack,
    /// The request failed here; nothing of it was answered.
    Failed {
        /// Why.
        message: String,
        /// Whether it may succeed elsewhere or later.
        retry: bool,
    },
    /// The decode instance stops (a scale-in): it takes no new request and, for its drain
    /// window ([`crate::pd::LlmConfig::drain`]), keeps decoding and serves `Load` and `Migrate`
    /// so that the router can move its requests, with their KV, to other decode instances;
    /// those still there at the window's end are aborted (`Abort`) and redone.
    Leaving {
        /// The router's requests decoding there when it said so.
        running: u32,
    },
}

binary_message!(LlmMsg, ServiceId::LLM, 7);

impl LlmMsg {
    /// The error for an answer from `node` that its call did not expect: its refusal (`Failed`)
    /// as the peer's error, anything else as a protocol error.
    pub(crate) fn unexpected_from(self, node: NodeId) -> crate::serve::ServeError {
        use crate::serve::ServeError;
        match self {
            LlmMsg::Failed { message, .. } => ServeError::Peer(format!("node {node}: {message}")),
            other => ServeError::Protocol(format!("unexpected answer {other:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use cascade_transport::Message;

    use super::*;

    #[test]
    fn every_message_round_trips_and_truncations_are_refused() {
        let kv = KvGrant { node: 3, region: 2, key: u64::MAX, len: 1 << 28, pages: vec![4, 9, 1], lease: 12 };
        let all = vec![
            LlmMsg::Reserve { req: 1, tokens: 80 },
            LlmMsg::Reserved { grant: kv.clone() },
            LlmMsg::Release { req: 1, lease: 12 },
            LlmMsg::Prefill {
                req: 1,
                attempt: 2,
                prompt: vec![504, 3575],
                max_tokens: 32,
                kv: kv.clone(),
                split: Some(Split { layers: 5, then: 1 }),
                router: 0,
                adapter: 2,
                sample: None,
            },
            LlmMsg::Continue {
                req: 1,
                attempt: 2,
                act: vec![1, 2, 3],
                max_tokens: 32,
                kv,
                router: 0,
                crcs: vec![7, 8],
                sample: Some(SeqSampling {
                    sampling: crate::llama::sample::Sampling {
                        temperature: 0.7,
                        top_k: 40,
                        top_p: 0.9,
                        seed: u64::MAX,
                    },
                    index: 3,
                }),
            },
            LlmMsg::Prefilled { req: 1, first: 7042, on_first: 5, decoding: true },
            LlmMsg::Start {
                req: 1,
                attempt: 2,
                lease: 12,
                crcs: vec![1, u32::MAX],
                prompt_len: 5,
                first: 7042,
                max_tokens: 32,
                router: 0,
                adapter: 0,
                sample: None,
            },
            LlmMsg::Load,
            LlmMsg::Loads {
                requests: vec![ReqLoad { req: 4, adapter: 1, tokens: 17, remaining: 9, router: 3 }],
                adapters: vec![1, 3],
                kv_pages: 64,
                free_pages: 60,
            },
            LlmMsg::ReserveAdapter { adapter: 3, bytes: 1 << 20 },
            LlmMsg::AdapterGrant { grant: RegionGrant { node: 2, region: 5, key: 9, len: 1 << 20 } },
            LlmMsg::Migrate {
                req: 4,
                kv: KvGrant { node: 2, region: 1, key: 3, len: 4096, pages: vec![0, 1], lease: 5 },
            },
            LlmMsg::Migrated { req: 4, tokens: 8 },
            LlmMsg::Resume {
                req: 4,
                attempt: 1,
                lease: 5,
                crcs: vec![3],
                pos: 17,
                last: 198,
                generated: 8,
                max_tokens: 16,
                router: 0,
                adapter: 3,
                adapter_image: Some(Written { bytes: 1000, crc: 0xdead_beef }),
                sample: None,
            },
            LlmMsg::Token { req: 1, attempt: 2, lease: 12, index: 3, token: 198, done: false },
            LlmMsg::Abort { req: 1, attempt: 2, message: "gone".into() },
            LlmMsg::Leaving { running: 3 },
            LlmMsg::Mutate,
            LlmMsg::Status,
            LlmMsg::State { role: Role::Decode, resident: 32, layers: 32, running: 2, free_pages: 100 },
            LlmMsg::Ack,
            LlmMsg::Failed { message: "full".into(), retry: true },
        ];
        for m in all {
            let b = m.encode_body();
            assert_eq!(LlmMsg::decode_body(LlmMsg::VERSION, &b).unwrap(), m);
            for cut in 0..b.len() {
                assert!(LlmMsg::decode_body(LlmMsg::VERSION, &b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
        }
    }
}
