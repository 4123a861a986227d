//! Tokenising a text that may be far longer than a model takes, in work bounded by what it takes.
//!
//! A tokenizer turns all of a text into tokens even when the model keeps only its first few
//! hundred (an embedding cut at 256 tokens) or refuses it for holding more than its context
//! window: a 50 MB line took 33 s and 3.4 GB to embed, and a 10 MB prompt 1.5 GB to refuse.
//! [`encode_enough`] tokenises prefixes of the text instead, doubling from [`FIRST`] bytes, until
//! one holds enough tokens to decide, or the prefix is the whole text.
//!
//! A prefix always ends just before a whitespace character that follows a non-whitespace one.
//! The pre-tokenizers of the models here split there and never join across it — BERT's
//! (whitespace and punctuation; the whitespace dropped), byte-level BPE's (GPT-2's pattern, as
//! SmolLM2's: a word ends where whitespace begins), SentencePiece's metaspace (a word starts at
//! its space) — and their normalizers work character by character. So the prefix's tokens are
//! the first tokens of the whole text: once a prefix holds more than the model keeps, its first
//! tokens are exactly the whole text's, and the whole text holds at least as many tokens as the
//! prefix. Tests check this against tokenising the whole text, for both real tokenizers.

use tokenizers::{Encoding, Tokenizer};

use crate::ExecError;

/// Bytes of the first prefix tried: texts up to this long are tokenised whole, as before.
pub const FIRST: usize = 64 << 10;

/// What [`encode_enough`] tokenised.
#[derive(Debug)]
pub struct Enough {
    /// The encoding of the whole text, or of a prefix that satisfied `enough`.
    pub encoding: Encoding,
    /// Whether `encoding` is the whole text's.
    pub whole: bool,
}

/// `text` tokenised (`add_special`: the tokenizer's post-processing, `[CLS]`/`[SEP]`), or a prefix
/// of it for which `enough(encoding)` holds — a prefix holding more tokens than the caller keeps.
/// Prefixes of `first`, `2·first`, … bytes are tried (cut back to the last word's end); the whole
/// text when no shorter one suffices.
pub fn encode_enough(
    tokenizer: &Tokenizer,
    text: &str,
    add_special: bool,
    first: usize,
    enough: impl Fn(&Encoding) -> bool,
) -> Result<Enough, ExecError> {
    let encode = |t: &str| tokenizer.encode(t, add_special).map_err(|e| ExecError::Input(format!("tokenising: {e}")));
    let mut len = first.max(1);
    while len < text.len() {
        if let Some(end) = word_end_before(text, len) {
            let encoding = encode(&text[..end])?;
            if enough(&encoding) {
                return Ok(Enough { encoding, whole: false });
            }
        }
        len = len.saturating_mul(2);
    }
    Ok(Enough { encoding: encode(text)?, whole: true })
}

/// The last byte offset at or before `at` where a whitespace character follows a non-whitespace
/// one (the end of a word), if there is one past the text's start.
fn word_end_before(text: &str, at: usize) -> Option<usize> {
    let mut after_ws = false;
    // Walking back from `at`: remember that the character just after the current one is
    // whitespace; the current one ending a word there is the answer.
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let head = &text[..at];
    if let Some(c) = text[head.len()..].chars().next() {
        after_ws = c.is_whitespace();
    }
    for (i, c) in head.char_indices().rev() {
        if after_ws && !c.is_whitespace() {
            return Some(i + c.len_utf8());
        }
        after_ws = c.is_whitespace();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::word_end_before;

    #[test]
    fn a_prefix_ends_where_a_word_does() {
        assert_eq!(word_end_before("hello world", 8), Some(5));
        assert_eq!(word_end_before("hello world", 5), Some(5));
        assert_eq!(word_end_before("hello world", 4), None);
        assert_eq!(word_end_before("hello   world", 7), Some(5));
        assert_eq!(word_end_before("   hello", 2), None);
        assert_eq!(word_end_before("a\u{00e9}\u{00e9} b", 3), None, "inside a multi-byte character");
        assert_eq!(word_end_before("a\u{00e9}\u{00e9} b", 6), Some(5));
        assert_eq!(word_end_before("ab", 99), None, "the end of the text is no word's end here");
    }
}
