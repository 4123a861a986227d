//! The prefill side of an instance: a prompt's stages (all, or the first ones of a split),
//! its KV moved to the decode instance's pages, and `Start` there, riding behind the KV's
//! WRITEs.

use std::ops::Range;
use std::sync::Arc;

use cascade_transport::ServiceExt;

use super::transfer::{move_kv, stage_kv};
use super::{lock, run, with_model, Shared};
use crate::llama::generate::choose;
use crate::llama::sample::Sampler;
use crate::pd::proto::{LlmMsg, Role};
use crate::serve::ServeError;
use crate::{Activation, ExecError};

/// Blocks whose KV stages `stages` compute (stage `1 + b` is block `b`).
fn blocks(stages: Range<usize>, n_blocks: usize) -> Range<usize> {
    stages.start.max(1) - 1..stages.end.clamp(1, n_blocks + 1) - 1
}

/// A sequence id for one prefill in the model's KV cache: this node in the top 16 bits, a count
/// below. Two prefills of one request — one the router gave up on while it ran on, and the one
/// that redoes it — never share cache entries, here or on the instance that continues a split
/// prefill (which keeps the id it is given). Decode instances key their caches by request.
fn prefill_seq(sh: &Shared) -> u64 {
    let n = sh.prefills.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    (u64::from(sh.mesh.node()) << 48) | (n & ((1 << 48) - 1))
}

pub(super) async fn prefill(sh: &Arc<Shared>, msg: LlmMsg) -> Result<LlmMsg, ServeError> {
    if *lock(&sh.role) != Role::Prefill {
        return Err(ServeError::Peer("not a prefill instance (mutated to decode)".into()));
    }
    let layers = sh.compute.layers();
    let (req, attempt, seq, act, max_tokens, kv, split, router, mut crcs, sample) = match msg {
        LlmMsg::Prefill { req, attempt, prompt, max_tokens, kv, split, router, adapter, sample } => {
            if prompt.is_empty() || prompt.len() > sh.cfg.max_prompt as usize {
                return Err(ServeError::Input(format!("{} prompt tokens: 1 to {}", prompt.len(), sh.cfg.max_prompt)));
            }
            if adapter != 0 && !lock(&sh.adapters).contains(&adapter) {
                return Err(ServeError::Peer(format!("adapter {adapter} is not served here")));
            }
            let seq = prefill_seq(sh);
            let act = Activation::packed(&[(seq, 0, prompt)])?.with_adapters(&[adapter])?;
            (req, attempt, seq, act, max_tokens, kv, split, router, Vec::new(), sample)
        }
        LlmMsg::Continue { req, attempt, act, max_tokens, kv, router, crcs, sample } => {
            let act = Activation::from_bytes(&act)?;
            let seq = act.segments.first().ok_or_else(|| ServeError::Input("an activation of no sequence".into()))?.seq;
            (req, attempt, seq, act, max_tokens, kv, None, router, crcs, sample)
        }
        other => return Err(ServeError::Protocol(format!("not a prefill: {other:?}"))),
    };
    if let Some(Err(e)) = sample.map(|s| s.sampling.check()) {
        return Err(ServeError::Input(e.to_string()));
    }
    let adapter = act.segments.first().map_or(0, |g| g.adapter);
    let from = act.next_layer;
    let prompt_len = act.ids.dims2().map_err(ExecError::from)?.1 as u32;
    let stop = match split {
        Some(s) if s.layers == 0 || s.layers as usize >= layers => {
            return Err(ServeError::Input(format!("a split after {} of {layers} stages", s.layers)))
        }
        Some(s) => s.layers as usize,
        None => layers,
    };
    let out = run(sh, act, stop).await;
    let blocks = blocks(from..stop, sh.layout.blocks);
    let free = || with_model(sh, move |m| m.free(seq));
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            // The stages' error is the one to report.
            let _freed = free().await;
            return Err(e);
        }
    };
    if let Some(s) = split {
        let moved = move_kv(sh, seq, blocks, &kv).await;
        free().await?;
        crcs.extend(moved?);
        let cont = LlmMsg::Continue { req, attempt, act: out.to_bytes()?, max_tokens, kv, router, crcs, sample };
        return match sh.mesh.call(s.then, &cont, sh.cfg.op_timeout).await? {
            LlmMsg::Prefilled { req, first, decoding, .. } => {
                Ok(LlmMsg::Prefilled { req, first, on_first: s.layers, decoding })
            }
            other => Err(other.unexpected_from(s.then)),
        };
    }
    // The answer's token 0: drawn as the request says, or greedily.
    let mut sampler = sample.map(Sampler::of);
    let first = choose(&out, [sampler.as_mut().map(|s| (s, 0))])?[0];
    let decoding = first != sh.model.config.eos_token_id && max_tokens > 1;
    if !decoding {
        // Nothing decodes from this KV: it stays here and is freed (the router releases the pages).
        free().await?;
        return Ok(LlmMsg::Prefilled { req, first, on_first: 0, decoding });
    }
    // The KV is copied out for the WRITEs, so the cache entry goes before they are on the wire.
    let staged = stage_kv(sh, seq, blocks, &kv).await;
    free().await?;
    let mut staged = staged?;
    crcs.append(&mut staged.crcs);
    let lease = kv.lease;
    let start = LlmMsg::Start { req, attempt, lease, crcs, prompt_len, first, max_tokens, router, adapter, sample };
    // `Start` rides behind the WRITEs: the decode instance takes it after their bytes landed
    // and checks each block's copy against its crc before decoding from it.
    match staged.call(sh, &start).await? {
        LlmMsg::Ack => {}
        other => return Err(other.unexpected_from(kv.node)),
    }
    Ok(LlmMsg::Prefilled { req, first, on_first: 0, decoding })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_map_to_blocks() {
        assert_eq!(blocks(0..32, 30), 0..30);
        assert_eq!(blocks(0..5, 30), 0..4);
        assert_eq!(blocks(5..32, 30), 4..30);
        assert_eq!(blocks(0..1, 30), 0..0);
        assert_eq!(blocks(31..32, 30), 30..30);
    }
}
