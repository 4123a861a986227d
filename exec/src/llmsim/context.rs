//! Requests longer than the model's context window.
//!
//! A model serves a request only if its prompt and its output fit the context window together
//! (Llama-2's is 4,096 tokens). The Azure LLM 2023 traces were recorded on other models: 14% of
//! the code trace's prompts have more than 4,096 tokens (up to 7,437). A serving stack does one
//! of two things with such a request — it cuts the prompt to fit (TGI's `truncate`, a client
//! that keeps the prompt's end) or refuses it at admission (vLLM answers a prompt over
//! `max_model_len` with an error) — and the paper does not say which its evaluation did, so the
//! choice is the caller's, and the report counts the requests it touched. `Keep` serves them
//! whole, as if the model had a longer window: not a real Llama-2, kept to compare with runs from
//! before the window was modelled.

use super::TraceRequest;

cascade_sched::named_enum! {
    /// What becomes of a request whose prompt and output exceed the context window.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
    #[serde(rename_all = "lowercase")]
    pub enum OverContext("--over-context") {
        /// The prompt is cut to the window less the output (its end kept); the request is served.
        #[default]
        Clip = "clip",
        /// The request is refused on arrival: never served, counted as missing its SLO.
        Refuse = "refuse",
        /// Served whole, as if the window were larger (not what the named model can do).
        Keep = "keep",
    }
}

/// The trace as the model can serve it under `how`, and how many requests exceeded `window`.
///
/// Clipping keeps the output (what the user asked for) and the prompt's last tokens; an output
/// that alone fills the window is cut to leave one prompt token. `window` is at least 2.
pub(crate) fn fit(trace: &[TraceRequest], window: u64, how: OverContext) -> (Vec<TraceRequest>, usize) {
    let window = window.max(2);
    let over = trace.iter().filter(|r| r.prompt_tokens + r.output_tokens > window).count();
    let fitted = match how {
        OverContext::Keep => trace.to_vec(),
        OverContext::Refuse => trace.iter().copied().filter(|r| r.prompt_tokens + r.output_tokens <= window).collect(),
        OverContext::Clip => trace
            .iter()
            .map(|r| {
                if r.prompt_tokens + r.output_tokens <= window {
                    return *r;
                }
                let output_tokens = r.output_tokens.min(window - 1);
                TraceRequest { prompt_tokens: window - output_tokens, output_tokens, ..*r }
            })
            .collect(),
    };
    (fitted, over)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt_tokens: u64, output_tokens: u64) -> TraceRequest {
        TraceRequest { at_ms: 1.0, prompt_tokens, output_tokens }
    }

    #[test]
    fn clipping_keeps_the_output_and_fits_the_window() {
        let t = [req(100, 10), req(4090, 6), req(7437, 28), req(10, 5000), req(4000, 97)];
        let (f, over) = fit(&t, 4096, OverContext::Clip);
        assert_eq!(over, 3);
        let pairs: Vec<(u64, u64)> = f.iter().map(|r| (r.prompt_tokens, r.output_tokens)).collect();
        assert_eq!(pairs, [(100, 10), (4090, 6), (4068, 28), (1, 4095), (3999, 97)]);
        assert!(f.iter().all(|r| r.prompt_tokens + r.output_tokens <= 4096 && r.prompt_tokens >= 1));
    }

    #[test]
    fn refusing_drops_exactly_the_requests_over_the_window_and_keep_changes_nothing() {
        let t = [req(100, 10), req(4090, 7), req(4090, 6)];
        let (f, over) = fit(&t, 4096, OverContext::Refuse);
        assert_eq!((f, over), (vec![req(100, 10), req(4090, 6)], 1));
        let (f, over) = fit(&t, 4096, OverContext::Keep);
        assert_eq!((f, over), (t.to_vec(), 1));
        assert_eq!("refuse".parse::<OverContext>(), Ok(OverContext::Refuse));
        assert!("truncate".parse::<OverContext>().unwrap_err().contains("clip, refuse, keep"));
    }
}
