//! Stop strings: a sequence ends as soon as its text contains one, and its text is cut where the
//! first one begins (the `stop` of OpenAI's completions and of `transformers`' `stop_strings`,
//! which also cut the text there; the tokens generated are kept whole).
//!
//! Sans IO: [`StopStrings::ended`] decodes a sequence's last tokens ([`StopStrings::tail_tokens`]
//! of them) and looks for the strings there, so a step costs the decoding of a few tokens, not of
//! all generated so far; `generate`'s loop and the `pd` router, which sees the tokens a decode
//! instance streams, both ask it. A stop string ending in the newest token lies in
//! that tail: every token is at least one byte of text, and two more are decoded than the longest
//! stop string has bytes — one for a character split across tokens, one for a decoder that drops
//! the first token's leading space.

use tokenizers::Tokenizer;

use crate::ExecError;

/// Stop strings at most, as OpenAI allows 4 and vLLM any number: enough for a chat's turn
/// markers and a few more.
pub const MAX_STOPS: usize = 16;

/// Bytes of one stop string at most.
pub const MAX_STOP_BYTES: usize = 256;

/// The strings that end a sequence (none: only end-of-sequence, the token budget and the
/// context window end it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStrings {
    stops: Vec<String>,
}

impl StopStrings {
    /// Stop strings, each non-empty and at most [`MAX_STOP_BYTES`] bytes, at most [`MAX_STOPS`]
    /// of them (one given twice counts once).
    pub fn new(stops: Vec<String>) -> Result<StopStrings, ExecError> {
        if stops.len() > MAX_STOPS {
            return Err(ExecError::Input(format!("{} stop strings; at most {MAX_STOPS}", stops.len())));
        }
        if let Some(bad) = stops.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(ExecError::Input(if bad.is_empty() {
                "an empty stop string: it would end every sequence before its first token".into()
            } else {
                format!("a stop string of {} bytes; at most {MAX_STOP_BYTES}", bad.len())
            }));
        }
        let mut stops = stops;
        stops.sort();
        stops.dedup();
        Ok(StopStrings { stops })
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The strings.
    pub fn strings(&self) -> &[String] {
        &self.stops
    }

    /// How many of a sequence's last tokens [`StopStrings::hit`] needs decoded to see a stop
    /// string that ends in the newest one (0 without any).
    pub fn tail_tokens(&self) -> usize {
        self.stops.iter().map(|s| s.len() + 2).max().unwrap_or(0)
    }

    /// Whether the text of a sequence's last [`StopStrings::tail_tokens`] tokens (or of all, when
    /// it has fewer) holds a stop string.
    pub fn hit(&self, tail: &str) -> bool {
        self.stops.iter().any(|s| tail.contains(s.as_str()))
    }

    /// Whether a sequence whose tokens are `tokens` holds a stop string ending in its last token:
    /// [`StopStrings::hit`] on the text `tokenizer` decodes its last
    /// [`StopStrings::tail_tokens`] tokens to (special tokens kept, as `generate` shows them). A
    /// tail that does not decode holds none.
    pub fn ended(&self, tokenizer: &Tokenizer, tokens: &[u32]) -> bool {
        if self.stops.is_empty() {
            return false;
        }
        let tail = &tokens[tokens.len().saturating_sub(self.tail_tokens())..];
        tokenizer.decode(tail, false).is_ok_and(|t| self.hit(&t))
    }

    /// Where `text` is cut: the start of the first stop string in it, and that string (the
    /// longest, when several begin there).
    pub fn cut<'a>(&'a self, text: &str) -> Option<(usize, &'a str)> {
        self.stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at, s.as_str())))
            .min_by_key(|&(at, s)| (at, usize::MAX - s.len()))
    }

    /// How many bytes at the end of `text` could begin a stop string that more text would
    /// complete: a stream shows text only up to them (at a character boundary).
    pub fn held_back(&self, text: &str) -> usize {
        let longest = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k])).take(1))
            .max()
            .unwrap_or(0);
        longest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> StopStrings {
        StopStrings::new(s.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    /// The first stop string in the text cuts it, the longest of those starting at one place;
    /// none: no cut.
    #[test]
    fn the_first_stop_string_cuts_the_text() {
        let s = stops(&["\n\n", "User:", "\n"]);
        assert_eq!(s.cut("Hello there.\n\nUser: hi"), Some((12, "\n\n")));
        assert_eq!(s.cut("Hello User:\n"), Some((6, "User:")));
        assert_eq!(s.cut("Hello"), None);
        assert_eq!(stops(&[]).cut("anything"), None);
        assert!(s.hit("a\nb") && !s.hit("abc") && !stops(&[]).hit("a\n"));
    }

    /// A stream holds back the end of its text that could begin a stop string, and nothing else.
    #[test]
    fn a_stream_holds_back_what_could_begin_a_stop_string() {
        let s = stops(&["</answer>", "\n\n"]);
        assert_eq!(s.held_back("The answer is 4</ans"), 5);
        assert_eq!(s.held_back("The answer is 4<"), 1);
        assert_eq!(s.held_back("The answer is 4\n"), 1);
        assert_eq!(s.held_back("The answer is 4"), 0);
        assert_eq!(s.held_back("The answer is 4</answe"), 7);
        // Never inside a character: a stop string's first byte of a two-byte one is no prefix.
        assert_eq!(stops(&["é!"]).held_back("caf\u{e9}"), 2);
        assert_eq!(stops(&[]).held_back("x"), 0);
    }

    /// Empty, too long or too many stop strings are refused, naming why; one given twice counts
    /// once. The tail decoded covers the longest with two tokens to spare.
    #[test]
    fn bad_stop_strings_are_refused() {
        let err = |v: Vec<String>| StopStrings::new(v).unwrap_err().to_string();
        assert!(err(vec![String::new()]).contains("empty"));
        assert!(err(vec!["x".repeat(MAX_STOP_BYTES + 1)]).contains("bytes"));
        assert!(err(vec!["x".into(); MAX_STOPS + 1]).contains("at most"));
        let s = stops(&["ab", "ab", "\n"]);
        assert_eq!(s.strings(), ["\n", "ab"]);
        assert_eq!(s.tail_tokens(), 4);
        assert_eq!(stops(&[]).tail_tokens(), 0);
    }
}
