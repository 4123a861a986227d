//! Inputs given on the command line and, after them, one per line of a file or standard input.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;

/// Lines as they are read, each with its context on failure.
pub(crate) type Lines = Box<dyn Iterator<Item = anyhow::Result<String>> + Send>;

/// Reads `lines` on a thread of its own into a channel of `capacity`, so that a consumer can take
/// what has arrived without waiting for more (a line typed or piped in is answered at once).
pub(crate) fn read_ahead(lines: Lines, capacity: usize) -> std::sync::mpsc::Receiver<anyhow::Result<String>> {
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
/// it).
pub(crate) fn given_then_lines(given: Vec<String>, file: Option<PathBuf>, flag: &'static str) -> anyhow::Result<Lines> {
    let given = given.into_iter().map(Ok);
    let Some(path) = file else { return Ok(Box::new(given)) };
    let mut reader: Box<dyn BufRead + Send> = if path.as_os_str() == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(&path).with_context(|| format!("opening {flag} {}", path.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let mut n = 0usize;
    let lines = std::iter::from_fn(move || {
        let mut bytes = Vec::new();
        n += 1;
        match reader.read_until(b'\n', &mut bytes) {
            Ok(0) => None,
            Ok(_) => {
                if bytes.ends_with(b"\n") {
                    bytes.pop();
                    if bytes.ends_with(b"\r") {
                        bytes.pop();
                    }
                }
                Some(Ok(String::from_utf8(bytes).unwrap_or_else(|e| {
                    eprintln!(
                        "note: line {n} of {flag} {} is not valid UTF-8: read with U+FFFD in place of its bad bytes",
                        path.display()
                    );
                    String::from_utf8_lossy(e.as_bytes()).into_owned()
                })))
            }
            Err(e) => {
                Some(Err(anyhow::Error::new(e).context(format!("reading line {n} of {flag} {}", path.display()))))
            }
        }
    });
    Ok(Box::new(given.chain(lines)))
}
