//! The per-sequence KV cache of the blocks an executor runs: for every sequence and block, the
//! keys and values of its tokens so far (`[1, kv_heads, tokens, head_dim]` each, after RoPE).

use std::collections::HashMap;

use candle_core::Tensor;

use crate::ExecError;

/// Keys and values by sequence and block.
#[derive(Default)]
pub struct KvCache {
    seqs: HashMap<u64, Vec<Option<(Tensor, Tensor)>>>,
}

impl KvCache {
    /// Tokens cached for `seq` in `block` (0 if none).
    pub fn len(&self, seq: u64, block: usize) -> usize {
        self.seqs
            .get(&seq)
            .and_then(|b| b.get(block))
            .and_then(Option::as_ref)
            .map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }

    /// Sequences with a cache here.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Appends `k`, `v` (new tokens starting at position `pos`) to `seq`'s cache of `block`;
    /// returns the whole cache. `pos` must be the tokens already cached.
    pub fn append(
        &mut self,
        seq: u64,
        block: usize,
        pos: usize,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor), ExecError> {
        let have = self.len(seq, block);
        if have != pos {
            return Err(ExecError::Input(format!(
                "sequence {seq}: block {block} holds {have} tokens, the batch continues at {pos}"
            )));
        }
        let blocks = self.seqs.entry(seq).or_default();
        if blocks.len() <= block {
            blocks.resize(block + 1, None);
        }
        let next = match blocks[block].take() {
            Some((ok, ov)) => (Tensor::cat(&[&ok, &k], 2)?, Tensor::cat(&[&ov, &v], 2)?),
            None => (k, v),
        };
        blocks[block] = Some(next.clone());
        Ok(next)
    }

    /// `seq`'s keys and values of `block`, if any.
    pub fn get(&self, seq: u64, block: usize) -> Option<&(Tensor, Tensor)> {
        self.seqs.get(&seq)?.get(block)?.as_ref()
    }

    /// Sets `seq`'s cache of `block` (a cache moved here from another instance).
    pub fn put(&mut self, seq: u64, block: usize, k: Tensor, v: Tensor) {
        let blocks = self.seqs.entry(seq).or_default();
        if blocks.len() <= block {
            blocks.resize(block + 1, None);
        }
        blocks[block] = Some((k, v));
    }

    /// Drops `seq`'s cache; whether it had one.
    pub fn free(&mut self, seq: u64) -> bool {
        self.seqs.remove(&seq).is_some()
    }
}
