//! Inputs given on the command line and, after them, one per line of a file or standard input.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;

/// Lines as they are read, each with its context on failure.
pub(crate) type Lines = Box<dyn Iterator<Item = anyhow::Result<String>> + Send>;

/// `given`, then the lines of `file` (`-`: standard input) as they are read; `flag` names the
/// option in errors (`--text-file`). Every line is an item, an empty one too, so that output
/// line N can answer input line N.
pub(crate) fn given_then_lines(given: Vec<String>, file: Option<PathBuf>, flag: &'static str) -> anyhow::Result<Lines> {
    let given = given.into_iter().map(Ok);
    let Some(path) = file else { return Ok(Box::new(given)) };
    let reader: Box<dyn BufRead + Send> = if path.as_os_str() == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(&path).with_context(|| format!("opening {flag} {}", path.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let lines = reader
        .lines()
        .enumerate()
        .map(move |(n, line)| line.with_context(|| format!("reading line {} of {flag} {}", n + 1, path.display())));
    Ok(Box::new(given.chain(lines)))
}
