//! Inputs given on the command line and, after them, one per line of a file or standard input.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;

/// A line as read: its text, and whether it was longer than the reader keeps and so read only in
/// part (`text` is then its first bytes, whole characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Line {
    /// The text (the line's start, if it was cut).
    pub(crate) text: String,
    /// Whether the line went on past what the reader keeps.
    pub(crate) cut: bool,
}

impl Line {
    /// Why a line cut at `kept` bytes (a reader's limit) is refused: it was read only in part.
    pub(crate) fn cut_refusal(kept: usize) -> String {
        format!("a line longer than {}, read only in part", size(kept))
    }
}

impl From<String> for Line {
    fn from(text: String) -> Line {
        Line { text, cut: false }
    }
}

/// The most bytes of a prompt line kept (`generate`, `pd`, `lora-serve`): SmolLM2's window of
/// 8,192 tokens of at most 81 bytes each is 648 KiB, so a longer line could never be a prompt. A
/// line read whole could hold a whole file: a file with no newline (`/dev/zero`) was read until
/// memory ran out.
pub(crate) const PROMPT_LINE: usize = 1 << 20;

/// The most bytes of a text line kept (`embed`): all-MiniLM-L6-v2 embeds a text's first 256
/// tokens, a few KiB of words; up to 4,096 lines wait read ahead, so at most 256 MiB of text. A
/// 50 MB line took 3.4 GB to embed.
pub(crate) const TEXT_LINE: usize = 64 << 10;

/// UTF-8's byte-order mark, U+FEFF.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// `bytes` in words: "64 KiB", "1 MiB".
pub(crate) fn size(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// Lines as they are read, each with its context on failure.
pub(crate) type Lines = Box<dyn Iterator<Item = anyhow::Result<Line>> + Send>;

/// Reads `lines` on a thread of its own into a channel of `capacity`, so that a consumer can take
/// what has arrived without waiting for more (a line typed or piped in is answered at once).
pub(crate) fn read_ahead(lines: Lines, capacity: usize) -> std::sync::mpsc::Receiver<anyhow::Result<Line>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
    std::thread::spawn(move || {
        for line in lines {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// `given`, then the lines of `file` (`-`: standard input) as they are read; `flag` names the
/// option in errors (`--text-file`). Every line is an item, an empty one too, so that output
/// line N can answer input line N. A line that is not valid UTF-8 is read with U+FFFD in place
/// of its bad bytes, and a note on stderr says which (it ended the run, losing the lines after
/// it). A byte-order mark before the first line is dropped. A line longer than `max_line` bytes
/// is read as its first `max_line` bytes, marked [`Line::cut`], with a note on stderr; the rest of
/// it is skipped, not kept.
pub(crate) fn given_then_lines(
    given: Vec<String>,
    file: Option<PathBuf>,
    flag: &'static str,
    max_line: usize,
) -> anyhow::Result<Lines> {
    let given = given.into_iter().map(|t| Ok(Line::from(t)));
    let Some(path) = file else { return Ok(Box::new(given)) };
    let reader: Box<dyn BufRead + Send> = if path.as_os_str() == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(&path).with_context(|| format!("opening {flag} {}", path.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let mut lines = LineReader { reader, max: max_line, skipping: false };
    let mut n = 0usize;
    let lines = std::iter::from_fn(move || {
        n += 1;
        let where_ = || format!("line {n} of {flag} {}", path.display());
        match lines.next_line() {
            Ok(None) => None,
            Ok(Some((mut bytes, cut))) => {
                // A byte-order mark (files saved by some Windows editors) is no part of the first
                // text: the BPE tokenizer made tokens of it, and a prompt changed.
                if n == 1 && bytes.starts_with(BOM) {
                    bytes.drain(..BOM.len());
                }
                if cut {
                    let max = size(max_line);
                    eprintln!(
                        "note: {} is longer than {max}: only its first {max} is read (the rest is skipped)",
                        where_()
                    );
                }
                let text = String::from_utf8(bytes).unwrap_or_else(|e| {
                    eprintln!("note: {} is not valid UTF-8: read with U+FFFD in place of its bad bytes", where_());
                    String::from_utf8_lossy(e.as_bytes()).into_owned()
                });
                Some(Ok(Line { text, cut }))
            }
            Err(e) => Some(Err(anyhow::Error::new(e).context(format!("reading {}", where_())))),
        }
    });
    Ok(Box::new(given.chain(lines)))
}

/// Reads lines of at most `max` bytes.
struct LineReader<R> {
    reader: R,
    max: usize,
    /// The last line was cut: the rest of it is skipped before the next one is read.
    skipping: bool,
}

impl<R: BufRead> LineReader<R> {
    /// The next line without its `\n` or `\r\n`, and whether it was cut at `max` bytes (then
    /// back to a whole UTF-8 character); `None` at the end.
    fn next_line(&mut self) -> std::io::Result<Option<(Vec<u8>, bool)>> {
        if std::mem::take(&mut self.skipping) {
            self.skip_line()?;
        }
        let mut bytes = Vec::new();
        let limit = u64::try_from(self.max).unwrap_or(u64::MAX).saturating_add(1);
        if std::io::Read::take(&mut self.reader, limit).read_until(b'\n', &mut bytes)? == 0 {
            return Ok(None);
        }
        if bytes.ends_with(b"\n") {
            bytes.pop();
            if bytes.ends_with(b"\r") {
                bytes.pop();
            }
            return Ok(Some((bytes, false)));
        }
        if bytes.len() <= self.max {
            return Ok(Some((bytes, false))); // the last line, without a newline
        }
        bytes.truncate(self.max);
        // A character the cut split in two is left out with the rest.
        if let Err(e) = std::str::from_utf8(&bytes) {
            if e.error_len().is_none() {
                bytes.truncate(e.valid_up_to());
            }
        }
        self.skipping = true;
        Ok(Some((bytes, true)))
    }

    /// Reads past the end of the current line, keeping nothing.
    fn skip_line(&mut self) -> std::io::Result<()> {
        loop {
            let buf = self.reader.fill_buf()?;
            if buf.is_empty() {
                return Ok(());
            }
            match buf.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.reader.consume(i + 1);
                    return Ok(());
                }
                None => {
                    let all = buf.len();
                    self.reader.consume(all);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::LineReader;

    fn lines(input: &[u8], max: usize) -> Vec<(String, bool)> {
        let mut r = LineReader { reader: input, max, skipping: false };
        std::iter::from_fn(|| r.next_line().unwrap()).map(|(b, cut)| (String::from_utf8(b).unwrap(), cut)).collect()
    }

    #[test]
    fn sizes_are_said_in_their_unit() {
        assert_eq!(
            (super::size(64 << 10), super::size(1 << 20), super::size(3 << 20)),
            ("64 KiB".into(), "1 MiB".into(), "3 MiB".into())
        );
    }

    #[test]
    fn a_line_over_the_limit_is_cut_and_the_rest_of_it_skipped() {
        let s = |t: &str, cut| (t.to_string(), cut);
        assert_eq!(lines(b"ab\r\ncd\n\nef", 4), [s("ab", false), s("cd", false), s("", false), s("ef", false)]);
        assert_eq!(
            lines(b"abcd\nabcde\nxy\nabcdefghij", 4),
            [s("abcd", false), s("abcd", true), s("xy", false), s("abcd", true)]
        );
        assert_eq!(lines(b"abcde", 4), [s("abcd", true)]);
        // Cut inside a character: the character goes with the rest.
        assert_eq!(lines("ab\u{e9}\u{e9}\nz".as_bytes(), 3), [s("ab", true), s("z", false)]);
        // A line longer than the reader's buffer is skipped through several fills.
        let long = [vec![b'x'; 100_000], b"\nok\n".to_vec()].concat();
        let mut r = LineReader { reader: std::io::BufReader::with_capacity(64, &long[..]), max: 10, skipping: false };
        assert_eq!(r.next_line().unwrap(), Some((vec![b'x'; 10], true)));
        assert_eq!(r.next_line().unwrap(), Some((b"ok".to_vec(), false)));
        assert_eq!(r.next_line().unwrap(), None);
    }
}
