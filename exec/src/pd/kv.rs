//! The KV region of a decode instance: fixed-size pages of `page_tokens` tokens, each holding
//! every block's keys and values for those tokens, so a request's KV is the list of pages it was
//! granted. Pages are reserved per request and freed when it finishes.
//!
//! Layout: page `p`, block `b` starts at `p · page_bytes + b · block_page_bytes`; in it the keys
//! `[kv_heads, page_tokens, head_dim]` then the values, f32, little-endian. A page's tail past
//! the request's tokens is never read.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::llama::LlamaConfig;
use crate::ExecError;

/// Sizes of a KV page for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Blocks of the model.
    pub blocks: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_tokens: usize,
}

impl KvLayout {
    /// The layout of `cfg`'s KV with pages of `page_tokens` tokens.
    pub fn new(cfg: &LlamaConfig, page_tokens: usize) -> KvLayout {
        KvLayout {
            blocks: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
            page_tokens: page_tokens.max(1),
        }
    }

    /// Bytes of one block's keys and values in a page.
    pub fn block_page_bytes(&self) -> u64 {
        (2 * self.kv_heads * self.page_tokens * self.head_dim * 4) as u64
    }

    /// Bytes of a page.
    pub fn page_bytes(&self) -> u64 {
        self.blocks as u64 * self.block_page_bytes()
    }

    /// Pages for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// Offset of block `block` in page `page`.
    pub fn offset(&self, page: u32, block: usize) -> u64 {
        u64::from(page) * self.page_bytes() + block as u64 * self.block_page_bytes()
    }

    /// The bytes of block-page `i` (tokens `i·page_tokens ..`) of one block's cached keys and
    /// values (`[1, kv_heads, tokens, head_dim]` each).
    pub fn page_image(&self, k: &Tensor, v: &Tensor, i: usize) -> Result<Vec<u8>, ExecError> {
        let tokens = k.dim(2)?;
        let start = i * self.page_tokens;
        if start >= tokens {
            return Err(ExecError::Input(format!("page {i} of a {tokens}-token cache")));
        }
        let n = (tokens - start).min(self.page_tokens);
        let mut out = vec![0u8; self.block_page_bytes() as usize];
        let half = self.kv_heads * self.page_tokens * self.head_dim * 4;
        for (which, t) in [k, v].into_iter().enumerate() {
            let rows = t.squeeze(0)?.narrow(1, start, n)?.to_vec3::<f32>()?;
            for (h, head) in rows.iter().enumerate() {
                for (j, row) in head.iter().enumerate() {
                    let at = which * half + ((h * self.page_tokens + j) * self.head_dim) * 4;
                    for (c, x) in row.iter().enumerate() {
                        out[at + 4 * c..at + 4 * c + 4].copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        Ok(out)
    }

    /// One block's keys and values (`[1, kv_heads, tokens, head_dim]`) from its block-pages, in
    /// token order.
    pub fn tensors(&self, pages: &[&[u8]], tokens: usize) -> Result<(Tensor, Tensor), ExecError> {
        if pages.len() != self.pages_for(tokens) || pages.iter().any(|p| p.len() as u64 != self.block_page_bytes()) {
            return Err(ExecError::Input(format!("{} block-pages for {tokens} tokens", pages.len())));
        }
        let half = self.kv_heads * self.page_tokens * self.head_dim * 4;
        let mut kv = [Vec::with_capacity(self.kv_heads * tokens * self.head_dim), Vec::new()];
        kv[1].reserve(self.kv_heads * tokens * self.head_dim);
        for (which, out) in kv.iter_mut().enumerate() {
            for h in 0..self.kv_heads {
                for t in 0..tokens {
                    let (page, j) = (t / self.page_tokens, t % self.page_tokens);
                    let at = which * half + ((h * self.page_tokens + j) * self.head_dim) * 4;
                    let row = &pages[page][at..at + 4 * self.head_dim];
                    out.extend(row.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                }
            }
        }
        let [k, v] = kv;
        let shape = (1, self.kv_heads, tokens, self.head_dim);
        Ok((Tensor::from_vec(k, shape, &Device::Cpu)?, Tensor::from_vec(v, shape, &Device::Cpu)?))
    }
}

/// Which pages are free, which request holds which, and which node reserved them.
#[derive(Debug, Default)]
pub struct Pages {
    free: Vec<u32>,
    held: HashMap<u64, (Vec<u32>, u32)>,
}

impl Pages {
    /// `n` free pages.
    pub fn new(n: u32) -> Pages {
        Pages { free: (0..n).rev().collect(), held: HashMap::new() }
    }

    /// Reserves `n` pages for `req` on behalf of node `by` (its router) (`None`, nothing
    /// reserved, when fewer are free or `req` holds pages already).
    pub fn reserve(&mut self, req: u64, by: u32, n: usize) -> Option<Vec<u32>> {
        if n == 0 || self.free.len() < n || self.held.contains_key(&req) {
            return None;
        }
        let pages: Vec<u32> = (0..n).filter_map(|_| self.free.pop()).collect();
        self.held.insert(req, (pages.clone(), by));
        Some(pages)
    }

    /// `req`'s pages.
    pub fn of(&self, req: u64) -> Option<&[u32]> {
        self.held.get(&req).map(|(p, _)| p.as_slice())
    }

    /// The requests whose pages node `by` reserved.
    pub fn reserved_by(&self, by: u32) -> Vec<u64> {
        self.held.iter().filter(|(_, (_, b))| *b == by).map(|(&r, _)| r).collect()
    }

    /// Frees `req`'s pages; how many.
    pub fn free(&mut self, req: u64) -> usize {
        let (pages, _) = self.held.remove(&req).unwrap_or_default();
        let n = pages.len();
        self.free.extend(pages);
        n
    }

    /// Requests holding pages.
    pub fn requests(&self) -> usize {
        self.held.len()
    }

    /// Pages free.
    pub fn available(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_survives_pages_and_pages_are_accounted() {
        let l = KvLayout { blocks: 2, kv_heads: 3, head_dim: 4, page_tokens: 5 };
        let tokens = 12;
        let k =
            Tensor::arange(0f32, (3 * tokens * 4) as f32, &Device::Cpu).unwrap().reshape((1, 3, tokens, 4)).unwrap();
        let v = (k.clone() * -1.0).unwrap();
        let images: Vec<Vec<u8>> = (0..l.pages_for(tokens)).map(|i| l.page_image(&k, &v, i).unwrap()).collect();
        assert_eq!(images.len(), 3);
        assert!(l.page_image(&k, &v, 3).is_err());
        let refs: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
        let (k2, v2) = l.tensors(&refs, tokens).unwrap();
        assert_eq!(k2.to_vec3::<f32>().ok(), None); // four dimensions
        assert_eq!(
            k2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        assert_eq!(
            v2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        assert!(l.tensors(&refs[..2], tokens).is_err());
        assert_eq!(l.offset(2, 1), 2 * l.page_bytes() + l.block_page_bytes());

        let mut p = Pages::new(4);
        let a = p.reserve(1, 9, 3).unwrap();
        assert_eq!(a.len(), 3);
        assert!(p.reserve(2, 9, 2).is_none(), "one page left");
        assert!(p.reserve(1, 9, 1).is_none(), "one reservation per request");
        assert_eq!(p.of(1), Some(a.as_slice()));
        assert_eq!((p.reserved_by(9), p.reserved_by(8)), (vec![1], vec![]));
        assert_eq!(p.free(1), 3);
        assert_eq!(p.free(1), 0);
        assert_eq!(p.available(), 4);
    }
}
