//! The per-sequence KV cache of the blocks an executor runs: for every sequence and block, the
//! keys and values of its tokens so far (`[1, kv_heads, tokens, head_dim]` each, after RoPE).
//!
//! Each entry keeps room to grow: a buffer of some capacity along the token axis, of which the
//! first `tokens` are the cache. An append writes its tokens into the room in place and copies
//! the cache only when the room runs out, into a buffer with room for half as many tokens again
//! (at least 64): a decode step, or a chunk of a long prompt, costs its own tokens, not the
//! whole cache. (Until 2026-12-05 every append concatenated the cache with its new tokens: a
//! copy of the sequence's whole cache per block and per decoded token, 189 MB per token for
//! SmolLM2 at 4,000 tokens.) A prompt's first prefill gets no room beyond its tokens, so a
//! prefill-only instance holds exactly what it moves on.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::ExecError;

/// Keys and values by sequence and block.
#[derive(Default)]
pub struct KvCache {
    seqs: HashMap<u64, Vec<Option<Entry>>>,
}

/// One sequence's keys and values in one block: buffers `[1, kv_heads, capacity, head_dim]`
/// (contiguous) whose first `tokens` positions hold the cache. Not `Clone`: two entries sharing
/// buffers would append into the same room.
struct Entry {
    k: Tensor,
    v: Tensor,
    tokens: usize,
}

/// Tokens of room an entry grows with at least (otherwise half its tokens).
const GROW_MIN: usize = 64;

impl Entry {
    /// The cache, as views of the buffers.
    fn view(&self) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((self.k.narrow(2, 0, self.tokens)?, self.v.narrow(2, 0, self.tokens)?))
    }

    fn capacity(&self) -> usize {
        self.k.dim(2).unwrap_or(0)
    }

    /// Appends `k`, `v` (`[1, kv_heads, n, head_dim]`): in place when they fit, otherwise into
    /// new buffers with room for more.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> candle_core::Result<()> {
        let n = k.dim(2)?;
        let need = self.tokens + n;
        if need <= self.capacity() {
            self.k.slice_set(&k.contiguous()?, 2, self.tokens)?;
            self.v.slice_set(&v.contiguous()?, 2, self.tokens)?;
        } else {
            // Room for half as many tokens again: amortised, whether a decode step or a chunk
            // of a prompt ran out of room.
            let room = (need / 2).max(GROW_MIN);
            let grow = |old: &Tensor, new: &Tensor| -> candle_core::Result<Tensor> {
                let (b, h, _, d) = old.dims4()?;
                let pad = Tensor::zeros((b, h, room, d), old.dtype(), old.device())?;
                Tensor::cat(&[&old.narrow(2, 0, self.tokens)?, new, &pad], 2)
            };
            (self.k, self.v) = (grow(&self.k, k)?, grow(&self.v, v)?);
        }
        self.tokens = need;
        Ok(())
    }
}

impl KvCache {
    /// Tokens cached for `seq` in `block` (0 if none).
    pub fn len(&self, seq: u64, block: usize) -> usize {
        self.seqs.get(&seq).and_then(|b| b.get(block)).and_then(Option::as_ref).map_or(0, |e| e.tokens)
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
            blocks.resize_with(block + 1, || None);
        }
        let entry = match &mut blocks[block] {
            Some(e) => {
                e.append(&k, &v)?;
                e
            }
            // A prefill: exactly its tokens, until a decode step grows it.
            slot @ None => slot.insert(Entry { tokens: k.dim(2)?, k: k.contiguous()?, v: v.contiguous()? }),
        };
        Ok(entry.view()?)
    }

    /// `seq`'s keys and values of `block`, if any (views of the cache).
    pub fn get(&self, seq: u64, block: usize) -> Option<(Tensor, Tensor)> {
        self.seqs.get(&seq)?.get(block)?.as_ref()?.view().ok()
    }

    /// Sets `seq`'s cache of `block` (a cache moved here from another instance).
    pub fn put(&mut self, seq: u64, block: usize, k: Tensor, v: Tensor) {
        let blocks = self.seqs.entry(seq).or_default();
        if blocks.len() <= block {
            blocks.resize_with(block + 1, || None);
        }
        blocks[block] = Some(Entry { tokens: k.dim(2).unwrap_or(0), k, v });
    }

    /// Drops `seq`'s cache; whether it had one.
    pub fn free(&mut self, seq: u64) -> bool {
        self.seqs.remove(&seq).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `[1, 2, n, 3]` of the values `from..`.
    fn tokens(from: usize, n: usize) -> Tensor {
        let v: Vec<f32> = (0..2 * n * 3).map(|i| (from * 100 + i) as f32).collect();
        Tensor::from_vec(v, (1, 2, n, 3), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Appends in place equal concatenation; a view handed out earlier keeps its values while
    /// later tokens are written into the room behind it; the room grows by half, so a hundred
    /// decode steps copy the cache a few times, not a hundred; a prefill gets no room.
    #[test]
    fn appends_equal_concatenation_and_copy_the_cache_only_when_the_room_runs_out() {
        let mut c = KvCache::default();
        let (k, v) = c.append(7, 1, 0, tokens(0, 5), tokens(1, 5)).unwrap();
        let capacity = |c: &KvCache| c.seqs[&7][1].as_ref().unwrap().capacity();
        assert_eq!((k.dim(2).unwrap(), capacity(&c)), (5, 5), "a prefill holds its tokens only");
        let (mut want_k, mut want_v) = (k, v);
        let mut early = None;
        let mut copies = 0;
        for step in 0..100 {
            let before = capacity(&c);
            let (k, v) = c.append(7, 1, 5 + step, tokens(10 + step, 1), tokens(500 + step, 1)).unwrap();
            copies += usize::from(capacity(&c) != before);
            want_k = Tensor::cat(&[&want_k, &tokens(10 + step, 1)], 2).unwrap();
            want_v = Tensor::cat(&[&want_v, &tokens(500 + step, 1)], 2).unwrap();
            assert_eq!(values(&k), values(&want_k), "step {step}");
            assert_eq!(values(&v), values(&want_v), "step {step}");
            if step == 10 {
                early = Some((values(&k), k));
            }
        }
        let (was, view) = early.unwrap();
        assert_eq!(values(&view), was, "a view of the cache changed under later appends");
        assert!((1..=6).contains(&copies), "{copies} copies of the cache in 100 steps");
        assert_eq!(c.len(7, 1), 105);
        assert_eq!(values(&c.get(7, 1).unwrap().0), values(&want_k));
        // A moved-in cache grows the same way.
        c.put(8, 0, tokens(0, 3), tokens(1, 3));
        let (k, _) = c.append(8, 0, 3, tokens(9, 2), tokens(9, 2)).unwrap();
        assert_eq!(values(&k), values(&Tensor::cat(&[&tokens(0, 3), &tokens(9, 2)], 2).unwrap()));
    }
}
