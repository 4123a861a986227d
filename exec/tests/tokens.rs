//! `tokens::encode_enough` gives what tokenising the whole text gives, for both real tokenizers:
//! all-MiniLM-L6-v2's (BERT WordPiece, cut at a length) and SmolLM2's (byte-level BPE, refused
//! over a window). Random texts of words, whitespace runs, punctuation, accents, CJK, emoji and
//! special tokens; tiny first prefixes and limits, so that prefixes end in every kind of place.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::OnceLock;

use cascade_exec::embed::Embedder;
use cascade_exec::tokens::encode_enough;
use proptest::prelude::*;
use tokenizers::{Encoding, Tokenizer, TruncationParams};

const PIECES: &[&str] = &[
    "the",
    "serving",
    "Cluster",
    "naïve",
    "café",
    "résumé",
    "über",
    "日本語",
    "模型",
    "😀",
    "🦀rust",
    "x",
    "antidisestablishmentarianism",
    "3.14",
    "42",
    "a-b",
    "(",
    ")",
    ",",
    ".",
    "!?",
    "'s",
    "don't",
    "<|im_start|>",
    "<|im_end|>",
    "e\u{0301}",
    "\u{0301}",
    "\u{200b}",
    "\t",
    "\n",
    " ",
    "  ",
    "     ",
    "\r\n",
    "\u{00a0}",
    "\u{3000}",
];

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(proptest::sample::select(PIECES), 0..120).prop_map(|v| v.concat())
}

fn minilm() -> Option<&'static Tokenizer> {
    static T: OnceLock<Option<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| common::model_dir().map(|d| Embedder::tokenizer(&d.join("tokenizer.json")).unwrap())).as_ref()
}

fn smollm2() -> Option<&'static Tokenizer> {
    static T: OnceLock<Option<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| common::smollm2_dir().map(|d| Tokenizer::from_file(d.join("tokenizer.json")).unwrap())).as_ref()
}

fn cut(e: &Encoding) -> bool {
    !e.get_overflowing().is_empty()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Cut at `max` tokens, as an embedding is: a prefix that was cut gives the whole text's
    /// tokens, mask, types and offsets, and the whole text is cut too.
    #[test]
    fn a_cut_prefix_tokenises_as_the_whole_text(text in text(), max in 3usize..40, first in 1usize..64) {
        let Some(t) = minilm() else { return Ok(()) };
        let mut t = t.clone();
        t.with_truncation(Some(TruncationParams { max_length: max, ..TruncationParams::default() })).unwrap();
        let got = encode_enough(&t, &text, true, first, cut).unwrap();
        let whole = t.encode(text.as_str(), true).unwrap();
        prop_assert_eq!(got.encoding.get_ids(), whole.get_ids());
        prop_assert_eq!(got.encoding.get_attention_mask(), whole.get_attention_mask());
        prop_assert_eq!(got.encoding.get_type_ids(), whole.get_type_ids());
        prop_assert_eq!(got.encoding.get_offsets(), whole.get_offsets());
        prop_assert_eq!(cut(&got.encoding), cut(&whole));
        prop_assert!(got.whole || cut(&whole));
    }

    /// Over a window, as a prompt is refused: a prefix's tokens are the whole text's first ones,
    /// so "at least N tokens" holds, and a prefix is taken only when the whole is over too.
    #[test]
    fn a_prefix_over_the_window_is_the_start_of_the_whole_text(text in text(), window in 1usize..40, first in 1usize..64) {
        let Some(t) = smollm2() else { return Ok(()) };
        let got = encode_enough(t, &text, false, first, |e| e.len() > window).unwrap();
        let whole = t.encode(text.as_str(), false).unwrap();
        let (p, w) = (got.encoding.get_ids(), whole.get_ids());
        if got.whole {
            prop_assert_eq!(p, w);
        } else {
            prop_assert!(p.len() > window && w.len() >= p.len());
            prop_assert_eq!(p, &w[..p.len()]);
        }
    }
}
