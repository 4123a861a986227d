//! Penalties on tokens a sequence has seen, applied to its logits before its next token is
//! chosen (greedily or sampled), in vLLM's order: the repetition penalty of CTRL (Keskar et al.,
//! 2019) as `transformers` and vLLM apply it — over the prompt's and the generated tokens, a
//! positive logit divided by it, a negative one multiplied — then OpenAI's presence and frequency
//! penalties over the generated tokens: `logit − presence·[count > 0] − frequency·count`.
//!
//! A sequence's penalties depend on its own tokens alone, so its choices stay independent of
//! what runs beside it, as [`super::sample`]'s draws are.

use std::collections::{HashMap, HashSet};

use crate::ExecError;

/// A sequence's penalties; [`Penalties::default`] changes nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token generated at least once (OpenAI: −2 to 2).
    pub presence: f32,
    /// Subtracted from a generated token's logit once per time it was generated (−2 to 2).
    pub frequency: f32,
    /// Divides the positive logits of the tokens seen (prompt or generated), multiplies their
    /// negative ones (1: none; above 1 discourages repeats).
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Penalties {
        Penalties { presence: 0.0, frequency: 0.0, repetition: 1.0 }
    }
}

impl Penalties {
    /// Checked penalties: presence and frequency from −2 to 2 (OpenAI's range), repetition above
    /// 0 and at most 10.
    pub fn new(presence: f32, frequency: f32, repetition: f32) -> Result<Penalties, ExecError> {
        for (name, v) in [("presence penalty", presence), ("frequency penalty", frequency)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ExecError::Input(format!("{name} {v}: from -2 to 2")));
            }
        }
        if !(repetition > 0.0 && repetition <= 10.0) {
            return Err(ExecError::Input(format!("repetition penalty {repetition}: above 0, at most 10")));
        }
        Ok(Penalties { presence, frequency, repetition })
    }

    /// Whether they change nothing.
    pub fn is_neutral(&self) -> bool {
        *self == Penalties::default()
    }
}

/// What a sequence has seen: its prompt's tokens and how often each token was generated.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    prompt: HashSet<u32>,
    generated: HashMap<u32, u32>,
}

impl Seen {
    /// A sequence with `prompt`, nothing generated yet.
    pub fn new(prompt: &[u32]) -> Seen {
        Seen { prompt: prompt.iter().copied().collect(), generated: HashMap::new() }
    }

    /// `token` was generated.
    pub fn push(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
    }

    /// `p` applied to `row`, the sequence's next logits (tokens outside the row are skipped).
    pub fn apply(&self, p: &Penalties, row: &mut [f32]) {
        if p.repetition != 1.0 {
            for &t in self.prompt.iter().chain(self.generated.keys().filter(|t| !self.prompt.contains(t))) {
                if let Some(x) = row.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / p.repetition } else { *x * p.repetition };
                }
            }
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(x) = row.get_mut(t as usize) {
                    *x -= p.presence + p.frequency * n as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Repetition over prompt and generated tokens, each once; then presence once and frequency
    /// per time over the generated ones.
    #[test]
    fn penalties_apply_as_vllm_orders_them() {
        let mut seen = Seen::new(&[0, 1, 1]);
        seen.push(1);
        seen.push(2);
        seen.push(2);
        let mut row = vec![2.0, -2.0, 4.0, 3.0];
        seen.apply(&Penalties::new(0.5, 0.25, 2.0).unwrap(), &mut row);
        // 0: prompt only, 2/2; 1: prompt and once, −2·2 − 0.5 − 0.25; 2: twice, 4/2 − 0.5 − 0.5; 3: unseen.
        assert_eq!(row, [1.0, -4.75, 1.0, 3.0]);
        let mut same = vec![2.0, -2.0, 4.0, 3.0];
        seen.apply(&Penalties::default(), &mut same);
        assert_eq!(same, [2.0, -2.0, 4.0, 3.0]);
        assert!(Penalties::new(2.5, 0.0, 1.0).is_err() && Penalties::new(0.0, 0.0, 0.0).is_err());
        assert!(Penalties::new(0.0, -2.0, 1.2).is_ok() && Penalties::new(0.0, 0.0, f32::NAN).is_err());
    }
}
