//! How a generation chooses each next token from the head's logits: greedily (the first largest
//! logit, what every test against a reference uses) or by seeded random sampling with a
//! temperature, top-k and top-p (nucleus) cut.
//!
//! Sampling follows Hugging Face `transformers`' order of logits processors: the logits are
//! divided by the temperature, the `top_k` largest kept, then the smallest set of those whose
//! probabilities (softmax of the tempered logits) sum to at least `top_p`, and the token is drawn
//! from the kept ones in proportion to their probabilities. Ties are broken by the lower token id,
//! so the kept set is one set whatever order the vocabulary is scanned in.
//!
//! The draw for a sequence's `n`-th token is a function of the run's seed, the sequence's index
//! in the run and `n` alone ([`Sampler::pick`]), not a generator's state: a prompt's
//! continuation depends on the seed, its index and its own logits — not on which other prompts
//! share its batches, when they started, or how its prompt was chunked — and a sequence taken
//! up elsewhere (a migrated request) would draw on as it would have where it was, with nothing
//! to carry but the seed and its index. The draws come from SplitMix64
//! ([`cascade_sched::arrival::Rng`], the simulators' own), stable across builds, so a seed
//! reproduces a text.

use cascade_sched::arrival::Rng;

use crate::ExecError;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Decoding {
    /// The first largest logit.
    #[default]
    Greedy,
    /// Drawn at random from the tempered, cut distribution.
    Sample(Sampling),
}

impl Decoding {
    /// Greedy for a temperature of 0 (as `transformers` treats `do_sample=False`), otherwise
    /// sampling with these settings; an error names a setting out of its range.
    pub fn new(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Result<Decoding, ExecError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(ExecError::Input(format!("temperature {temperature}: must be 0 (greedy) or more")));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ExecError::Input(format!("top-p {top_p}: must be in (0, 1]")));
        }
        if temperature == 0.0 {
            return Ok(Decoding::Greedy);
        }
        Ok(Decoding::Sample(Sampling { temperature, top_k, top_p, seed }))
    }

    /// The sampling settings, or `None` for greedy.
    pub fn sampling(self) -> Option<Sampling> {
        match self {
            Decoding::Greedy => None,
            Decoding::Sample(s) => Some(s),
        }
    }
}

/// Sampling's settings ([`Decoding::new`] checks them).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    /// Logits are divided by it: below 1 sharpens the distribution, above 1 flattens it.
    pub temperature: f32,
    /// Only the `top_k` most likely tokens are kept; 0 keeps every token.
    pub top_k: usize,
    /// Only the most likely tokens whose probabilities sum to at least `top_p` are kept (the
    /// most likely one always); 1 keeps every token.
    pub top_p: f32,
    /// The run's seed.
    pub seed: u64,
}

/// How one sequence samples: the settings and its index in the run, all that its draws depend
/// on ([`Sampler::pick`]); what a request carries from instance to instance.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SeqSampling {
    /// The settings (the run's seed among them).
    pub sampling: Sampling,
    /// The sequence's index in the run.
    pub index: u64,
}

impl Sampling {
    /// Checks the settings as [`Decoding::new`] does (a temperature above 0): a peer's message
    /// is not trusted to.
    pub fn check(&self) -> Result<(), ExecError> {
        match Decoding::new(self.temperature, self.top_k, self.top_p, self.seed)? {
            Decoding::Sample(_) => Ok(()),
            Decoding::Greedy => Err(ExecError::Input("sampling at temperature 0".into())),
        }
    }
}

/// One sequence's sampler: the settings and its own stream of draws, with a scratch kept
/// between draws. What a sequence carries elsewhere is its [`SeqSampling`].
#[derive(Debug)]
pub struct Sampler {
    s: Sampling,
    /// The sequence's seed, hashed from (seed, index).
    stream: u64,
    /// Scratch: the candidates as (logit, token id).
    cand: Vec<(f32, u32)>,
}

/// Candidates sorted first in [`Sampler::pick`]'s nucleus search; doubled until the nucleus is
/// inside them.
const FIRST_SORTED: usize = 64;

impl Sampler {
    /// The sampler of the run's sequence `index` (its prompt's place among the run's prompts).
    pub fn new(s: Sampling, index: u64) -> Sampler {
        // Hashed, not added: SplitMix64 streams from nearby seeds would overlap.
        let stream = Rng::new(s.seed.wrapping_add(index.wrapping_mul(0xd1b5_4a32_d192_ed03))).next_u64();
        Sampler { s, stream, cand: Vec::new() }
    }

    /// The sampler `spec` describes.
    pub fn of(spec: SeqSampling) -> Sampler {
        Sampler::new(spec.sampling, spec.index)
    }

    /// The sequence's `n`-th generated token (from 0), drawn from `logits` (one per token of
    /// the vocabulary). NaN and infinite logits are never drawn; a row with no finite logit is
    /// refused.
    pub fn pick(&mut self, logits: &[f32], n: u64) -> Result<u32, ExecError> {
        let inv_t = 1.0 / self.s.temperature;
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l, i as u32)));
        if self.cand.is_empty() {
            return Err(ExecError::Input(format!("no finite logit among {} to sample from", logits.len())));
        }
        // Higher logit first; the lower id first among equals.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if self.s.top_k > 0 && self.s.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(self.s.top_k - 1, order);
            self.cand.truncate(self.s.top_k);
        }
        let max = self.cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        // The tempered softmax's weight: exp((l − max)/T), the difference taken before the
        // division, so that a tiny temperature gives 0 (and the largest 1), never ∞ − ∞. exp in
        // f32 (a pass over the vocabulary in f64 cost about 0.5 ms a token), summed in f64.
        let weight = |l: f32| if l >= max { 1.0 } else { ((l - max) * inv_t).exp() as f64 };
        let total: f64 = self.cand.iter().map(|c| weight(c.0)).sum();
        let kept = if self.s.top_p < 1.0 {
            // The nucleus: sort the largest few, and more only while they do not reach top_p.
            let need = self.s.top_p as f64 * total;
            let mut sorted = FIRST_SORTED.min(self.cand.len());
            loop {
                if sorted < self.cand.len() {
                    self.cand.select_nth_unstable_by(sorted - 1, order);
                }
                self.cand[..sorted].sort_unstable_by(order);
                let mut sum = 0.0;
                let reach = self.cand[..sorted].iter().position(|c| {
                    sum += weight(c.0);
                    sum >= need
                });
                match reach {
                    Some(k) => break k + 1,
                    // Rounding: all of them fall a hair short of top_p × total.
                    None if sorted == self.cand.len() => break sorted,
                    None => sorted = (sorted * 2).min(self.cand.len()),
                }
            }
        } else {
            self.cand.len()
        };
        let total = if kept < self.cand.len() { self.cand[..kept].iter().map(|c| weight(c.0)).sum() } else { total };
        let kept = &self.cand[..kept];
        // unit() is in (0, 1]: a token of weight 0 is never drawn.
        let target = Rng::new(self.stream ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).unit() * total;
        let mut sum = 0.0;
        for c in kept {
            sum += weight(c.0);
            if sum >= target {
                return Ok(c.1);
            }
        }
        Ok(kept.iter().rev().find(|c| weight(c.0) > 0.0).unwrap_or(&kept[0]).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(temperature: f32, top_k: usize, top_p: f32) -> Sampling {
        match Decoding::new(temperature, top_k, top_p, 7).unwrap() {
            Decoding::Sample(s) => s,
            Decoding::Greedy => panic!("greedy"),
        }
    }

    /// Draw counts of `n` picks from `logits`.
    fn counts(s: Sampling, logits: &[f32], n: usize) -> Vec<usize> {
        let mut k = Sampler::new(s, 3);
        let mut c = vec![0; logits.len()];
        for t in 0..n {
            c[k.pick(logits, t as u64).unwrap() as usize] += 1;
        }
        c
    }

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits.iter().map(|&l| (((l - m) / t) as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| x / z).collect()
    }

    /// Pearson's χ² of `counts` against the probabilities `p` (the cells with p > 0).
    fn chi2(counts: &[usize], p: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p))
            .sum()
    }

    const LOGITS: [f32; 8] = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 2.5, -3.0];

    #[test]
    fn draws_follow_the_tempered_softmax() {
        // χ² with 7 degrees of freedom: 24.3 is its 0.999 quantile. The seed is fixed, so this
        // is one deterministic check of the whole pipeline's proportions.
        for t in [0.5, 1.0, 2.0] {
            let c = counts(sampling(t, 0, 1.0), &LOGITS, 40_000);
            let x = chi2(&c, &softmax(&LOGITS, t));
            assert!(x < 24.3, "temperature {t}: χ² {x:.1} for {c:?}");
        }
        // A wrong temperature (1 for 0.5) is far off.
        let c = counts(sampling(0.5, 0, 1.0), &LOGITS, 40_000);
        assert!(chi2(&c, &softmax(&LOGITS, 1.0)) > 1000.0);
    }

    #[test]
    fn top_k_and_top_p_keep_the_most_likely_and_renormalise() {
        // Top 3 of LOGITS: ids 3 (3.0), 6 (2.5), 0 (2.0).
        let c = counts(sampling(1.0, 3, 1.0), &LOGITS, 30_000);
        let mut p = vec![0.0; LOGITS.len()];
        let top: Vec<f32> = [3, 6, 0].iter().map(|&i| LOGITS[i]).collect();
        for (&i, q) in [3usize, 6, 0].iter().zip(softmax(&top, 1.0)) {
            p[i] = q;
        }
        assert!(c.iter().zip(&p).all(|(&n, &q)| q > 0.0 || n == 0), "outside the top 3: {c:?}");
        assert!(chi2(&c, &p) < 13.8, "{c:?}"); // 2 degrees of freedom, 0.999

        // Softmax(LOGITS): id 3 0.442, id 6 0.268, id 0 0.163, id 1 0.060 …: top-p 0.7 keeps
        // {3, 6}, 0.72 (past 0.442 + 0.268) keeps {3, 6, 0}.
        let full = softmax(&LOGITS, 1.0);
        let nucleus = |top_p: f32| {
            let c = counts(sampling(1.0, 0, top_p), &LOGITS, 20_000);
            (0..LOGITS.len()).filter(|&i| c[i] > 0).collect::<Vec<_>>()
        };
        assert!(full[3] + full[6] > 0.7 && full[3] + full[6] < 0.72);
        assert_eq!(nucleus(0.7), [3, 6]);
        assert_eq!(nucleus(0.72), [0, 3, 6]);
        assert_eq!(nucleus(0.01), [3]);
        // Top-k then top-p: of the top 2 (3: 0.62, 6: 0.38 renormalised) 0.6 keeps one.
        let c = counts(sampling(1.0, 2, 0.6), &LOGITS, 5_000);
        assert_eq!(c[3], 5_000);
    }

    #[test]
    fn a_nucleus_past_the_first_sorted_candidates_is_found_whole() {
        // 1,000 equal logits: top-p 0.5 keeps exactly 500 of them, the lowest ids, beyond the
        // first FIRST_SORTED sorted.
        let logits = vec![1.0f32; 1000];
        let c = counts(sampling(1.0, 0, 0.5), &logits, 50_000);
        assert!(c[..500].iter().all(|&n| n > 0), "a token of the nucleus was never drawn");
        assert!(c[500..].iter().all(|&n| n == 0), "a token outside the nucleus was drawn");
    }

    #[test]
    fn a_seed_an_index_and_a_token_number_give_one_draw() {
        let s = sampling(1.0, 0, 1.0);
        let draw = |seed: u64, index: u64| {
            let mut k = Sampler::new(Sampling { seed, ..s }, index);
            (0..64).map(|n| k.pick(&LOGITS, n).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1, 0), draw(1, 0));
        assert_ne!(draw(1, 0), draw(1, 1));
        assert_ne!(draw(1, 0), draw(2, 0));
        // Draw n is a function of (seed, index, n), not of the draws before it: taken in
        // reverse, or by a fresh sampler (a sequence resumed elsewhere), the same tokens.
        let mut k = Sampler::new(Sampling { seed: 1, ..s }, 0);
        let mut reversed: Vec<u32> = (0..64).rev().map(|n| k.pick(&LOGITS, n).unwrap()).collect();
        reversed.reverse();
        assert_eq!(reversed, draw(1, 0));
        assert_eq!(Sampler::new(Sampling { seed: 1, ..s }, 0).pick(&LOGITS, 40).unwrap(), draw(1, 0)[40]);
    }

    #[test]
    fn bad_settings_and_rows_are_refused_and_nan_never_drawn() {
        assert_eq!(Decoding::new(0.0, 5, 0.9, 1).unwrap(), Decoding::Greedy);
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (f32::INFINITY, 1.0), (1.0, 0.0), (1.0, 1.5), (1.0, f32::NAN)] {
            assert!(Decoding::new(t, 0, p, 1).is_err(), "temperature {t}, top-p {p}");
        }
        let mut k = Sampler::new(sampling(1.0, 0, 1.0), 0);
        assert!(k.pick(&[f32::NAN, f32::NEG_INFINITY], 0).is_err());
        // A temperature so small that the logits over it overflow is the greedy choice, not NaN.
        for t in [1e-30, f32::MIN_POSITIVE / 4.0] {
            let mut k = Sampler::new(sampling(t, 0, 0.9), 0);
            assert!((0..100).all(|n| k.pick(&LOGITS, n).unwrap() == 3), "temperature {t}");
        }
        for n in 0..1000 {
            assert_eq!(k.pick(&[f32::NAN, 0.0, f32::NEG_INFINITY, f32::NAN], n).unwrap(), 1);
        }
    }
}
