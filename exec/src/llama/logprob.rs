//! Log-probabilities of generated tokens, as OpenAI's `logprobs` reports them: each chosen
//! token's, and the most likely alternatives' at its step, from the step's logits (the model's
//! distribution, before any temperature, top-k or top-p a sampler applies).

/// A generated token's log-probability under the model — the log-softmax of the step's logits,
/// before any temperature, top-k or top-p a sampler applies — and the most likely tokens' at
/// that step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    /// The token's log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, the most likely first (of equal
    /// ones, the lower id first), as many as asked.
    pub top: Vec<(u32, f32)>,
}

/// The most alternatives a prompt may ask for at each token ([`super::generate::StreamPrompt::logprobs`]), as
/// OpenAI's `top_logprobs` allows.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// `chosen`'s log-probability among the logits `row` and the `top` most likely tokens'
/// ([`TokenLogprob`]); the normalising sum in f64.
pub fn logprob_of(row: &[f32], chosen: u32, top: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &x) in row.iter().enumerate() {
            if best.len() == top && best.last().is_some_and(|&(_, v)| x <= v) {
                continue;
            }
            // After the equal ones already in: of equal logits the lower id stays first.
            let at = best.partition_point(|&(_, v)| v >= x);
            best.insert(at, (i as u32, x));
            best.truncate(top);
        }
    }
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let logprob = row.get(chosen as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    TokenLogprob { logprob, top: best.into_iter().map(|(i, x)| (i, lp(x))).collect() }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The chosen token's log-probability is candle's log-softmax of the row; the alternatives
    /// come most likely first, the lower id first among equals, as many as asked.
    #[test]
    fn log_probabilities_are_the_rows_log_softmax_and_the_top_come_in_order() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
        let mut row = row;
        row[10] = 9.0;
        row[3] = 9.0;
        row[500] = 8.5;
        let t = Tensor::new(row.as_slice(), &Device::Cpu).unwrap();
        let want = candle_nn::ops::log_softmax(&t, 0).unwrap().to_vec1::<f32>().unwrap();
        let got = logprob_of(&row, 500, 4);
        assert!((got.logprob - want[500]).abs() < 1e-5, "{} vs {}", got.logprob, want[500]);
        let ids: Vec<u32> = got.top.iter().map(|&(i, _)| i).collect();
        assert_eq!(&ids[..3], &[3, 10, 500]);
        for &(i, lp) in &got.top {
            assert!((lp - want[i as usize]).abs() < 1e-5);
        }
        assert!(got.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert_eq!(logprob_of(&row, 3, 0).top, vec![]);
        let total: f64 = row.iter().map(|&x| f64::from(logprob_of(&row, 0, 0).logprob - row[0] + x).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
    }
}
