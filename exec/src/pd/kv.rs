//! The KV region of a decode instance: fixed-size pages of `page_tokens` tokens, each holding
//! every block's keys and values for those tokens, so a request's KV is the list of pages it was
//! granted. Pages are reserved per request and freed when it finishes.
//!
//! Layout: page `p`, block `b` starts at `p · page_bytes + b · block_page_bytes`; in it the keys
//! `[kv_heads, page_tokens, head_dim]` then the values, f32, little-endian. A page's tail past
//! the request's tokens is never read.

use std::collections::{HashMap, VecDeque};

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

/// One request's reservation: its pages, the node that reserved them, the lease that names this
/// reservation (and no earlier or later one of the same request), and whether decoding started.
#[derive(Debug)]
struct Held {
    pages: Vec<u32>,
    by: u32,
    lease: u64,
    started: bool,
}

/// Which pages are free, which request holds which, and under which lease.
///
/// A reservation is a *lease*: every message about it names its lease, so a message of an
/// abandoned attempt (a late `Start`, a late `Release`, a finished sequence of an earlier
/// reservation) cannot take or free another reservation of the same request. Freed pages go to
/// the back of the free list, so the pages an abandoned writer may still WRITE are reused last
/// (the crc check at `Start` catches one that does land in a reused page before it is read).
#[derive(Debug, Default)]
pub struct Pages {
    free: VecDeque<u32>,
    held: HashMap<u64, Held>,
    next_lease: u64,
}

/// Why a reservation cannot start decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The request holds no pages (never reserved, or released).
    #[error("request {0} holds no KV pages")]
    NotHeld(u64),
    /// The request holds pages under another lease (this one was released or replaced).
    #[error("request {req}: lease {got} is stale (it holds lease {held})")]
    Stale {
        /// The request.
        req: u64,
        /// The lease named.
        got: u64,
        /// The lease it holds.
        held: u64,
    },
    /// Decoding started under this lease already.
    #[error("request {0} started decoding already")]
    Started(u64),
}

impl Pages {
    /// `n` free pages.
    pub fn new(n: u32) -> Pages {
        Pages { free: (0..n).collect(), held: HashMap::new(), next_lease: 1 }
    }

    /// Reserves `n` pages for `req` on behalf of node `by` (its router): the lease and the pages.
    /// A reservation `by` made earlier for `req` that did not start is replaced (its router
    /// redoes the request, so it abandoned that one, whose `Release` may have been lost); `None`,
    /// nothing reserved, when fewer pages are free, or `req` holds pages another node reserved
    /// or decodes under.
    pub fn reserve(&mut self, req: u64, by: u32, n: usize) -> Option<(u64, Vec<u32>)> {
        match self.held.get(&req) {
            Some(h) if h.by == by && !h.started => {
                let lease = h.lease;
                self.release(req, lease);
            }
            Some(_) => return None,
            None => {}
        }
        if n == 0 || self.free.len() < n {
            return None;
        }
        let pages: Vec<u32> = self.free.drain(..n).collect();
        let lease = self.next_lease;
        self.next_lease += 1;
        self.held.insert(req, Held { pages: pages.clone(), by, lease, started: false });
        Some((lease, pages))
    }

    /// Marks `req`'s reservation `lease` started and gives its pages: once per lease.
    pub fn start(&mut self, req: u64, lease: u64) -> Result<Vec<u32>, LeaseError> {
        let h = self.held.get_mut(&req).ok_or(LeaseError::NotHeld(req))?;
        if h.lease != lease {
            return Err(LeaseError::Stale { req, got: lease, held: h.lease });
        }
        if h.started {
            return Err(LeaseError::Started(req));
        }
        h.started = true;
        Ok(h.pages.clone())
    }

    /// `req`'s pages.
    pub fn of(&self, req: u64) -> Option<&[u32]> {
        self.held.get(&req).map(|h| h.pages.as_slice())
    }

    /// The requests, with their leases, whose pages node `by` reserved and that did not start.
    pub fn reserved_by(&self, by: u32) -> Vec<(u64, u64)> {
        self.held.iter().filter(|(_, h)| h.by == by && !h.started).map(|(&r, h)| (r, h.lease)).collect()
    }

    /// Whether `req` decodes under reservation `lease`.
    pub fn started(&self, req: u64, lease: u64) -> bool {
        self.held.get(&req).is_some_and(|h| h.lease == lease && h.started)
    }

    /// The lease `req` holds pages under.
    pub fn lease_of(&self, req: u64) -> Option<u64> {
        self.held.get(&req).map(|h| h.lease)
    }

    /// Frees `req`'s pages if it holds them under `lease`; how many.
    pub fn release(&mut self, req: u64, lease: u64) -> usize {
        if self.held.get(&req).is_none_or(|h| h.lease != lease) {
            return 0;
        }
        let pages = self.held.remove(&req).map(|h| h.pages).unwrap_or_default();
        let n = pages.len();
        self.free.extend(pages);
        n
    }

    /// The nodes (routers) that reserved the pages held now — decoding or waiting for their
    /// start — with how many requests each.
    pub fn holders(&self) -> std::collections::BTreeMap<u32, u32> {
        let mut by = std::collections::BTreeMap::new();
        for h in self.held.values() {
            *by.entry(h.by).or_default() += 1;
        }
        by
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
        let (lease, a) = p.reserve(1, 9, 3).unwrap();
        assert_eq!(a.len(), 3);
        assert!(p.reserve(2, 9, 2).is_none(), "one page left");
        assert_eq!(p.of(1), Some(a.as_slice()));
        assert_eq!((p.reserved_by(9), p.reserved_by(8)), (vec![(1, lease)], vec![]));
        assert_eq!(p.release(1, lease + 1), 0, "another lease frees nothing");
        assert_eq!(p.release(1, lease), 3);
        assert_eq!(p.release(1, lease), 0);
        assert_eq!(p.available(), 4);
    }

    #[test]
    fn a_reservation_is_a_lease_that_stale_messages_cannot_touch() {
        let mut p = Pages::new(8);
        let (first, a) = p.reserve(1, 9, 3).unwrap();
        // Node 8 cannot take node 9's reservation; node 9 redoing the request replaces it.
        assert!(p.reserve(1, 8, 1).is_none());
        let (second, b) = p.reserve(1, 9, 2).unwrap();
        assert_ne!(first, second);
        assert_eq!(p.available(), 6, "the first reservation's pages went back");
        assert!(b.iter().all(|x| !a.contains(x)), "freed pages are reused last: {a:?} then {b:?}");
        // A late Start or Release of the first reservation touches nothing.
        assert_eq!(p.start(1, first), Err(LeaseError::Stale { req: 1, got: first, held: second }));
        assert_eq!(p.release(1, first), 0);
        assert!(!p.started(1, second));
        assert_eq!(p.start(1, second), Ok(b.clone()));
        assert!(p.started(1, second) && !p.started(1, first));
        assert_eq!(p.reserved_by(9), vec![], "only reservations that did not start");
        p.reserve(2, 7, 1).unwrap();
        assert_eq!(p.holders(), [(7, 1), (9, 1)].into(), "decoding or waiting for their start");
        assert_eq!(p.release(2, p.lease_of(2).unwrap()), 1);
        assert_eq!(p.start(1, second), Err(LeaseError::Started(1)), "a reservation starts once");
        // A started reservation is not replaced: the request decodes under it.
        assert!(p.reserve(1, 9, 2).is_none());
        assert_eq!(p.lease_of(1), Some(second));
        assert_eq!(p.release(1, second), 2);
        assert_eq!(p.start(1, second), Err(LeaseError::NotHeld(1)));
        assert_eq!(p.available(), 8);
    }
}
