//! `cascade embed`: sentence embeddings with a real BERT model on the CPU.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use cascade_exec::embed::{Embedder, BATCH};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::input::TEXT_LINE;
use crate::{count, shorten};

#[derive(Args)]
#[command(group = clap::ArgGroup::new("input").required(true).multiple(true).args(["text", "text_file"]))]
pub(crate) struct EmbedArgs {
    /// The model's directory.
    #[arg(long, default_value = crate::models::MINILM)]
    model: PathBuf,
    /// A text to embed (repeat for a batch).
    #[arg(long)]
    text: Vec<String>,
    /// A file of texts to embed, one per line (`-`: standard input), after any `--text`. Every
    /// line is a text, an empty one too, so output line N is input line N. Embedded as they
    /// arrive, up to 4,096 lines or 512 KiB at a time: output begins before the input ends (a
    /// line typed or piped in alone is answered at once), in bounded memory. A line over 64 KiB
    /// is embedded from its first 64 KiB (the model takes its first 256 tokens), the rest of it
    /// skipped.
    #[arg(long, value_name = "FILE")]
    text_file: Option<PathBuf>,
    /// Texts per forward pass. More texts than this run in batches of texts of about the same
    /// length (sorted by tokens within each 4,096 read), so memory stays bounded; the output
    /// keeps the input's order. A pass of long texts holds fewer: at most 32 of 256 tokens
    /// (about 0.5 GB), whatever this says. 1 to 4,096.
    #[arg(long, default_value_t = BATCH as u32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// Put the model's prompt NAME before every text: one its `config_sentence_transformers.json`
    /// names under `prompts` (`query`, …), as sentence-transformers' `encode(prompt_name=…)`.
    /// Without this or --prompt, the prompt its `default_prompt_name` names, if any (said on
    /// stderr).
    #[arg(long, value_name = "NAME", conflicts_with = "prompt")]
    prompt_name: Option<String>,
    /// Put TEXT before every text, as sentence-transformers' `encode(prompt=…)`; `--prompt ""`
    /// puts none, not even the model's default.
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// Print one JSON object per text: {text, dim, embedding, truncated} (`truncated`: the text
    /// is longer than the model takes and was embedded from its first tokens, as
    /// sentence-transformers does).
    #[arg(long)]
    json: bool,
}

/// Texts embedded at a time at most (what has arrived, up to this): memory stays bounded however
/// long the input is.
const BLOCK: usize = 4096;

/// Bytes of text embedded at a time at most (with [`BLOCK`] texts): a block's output comes when all
/// of it is embedded, so a file of long texts shows its first lines after some 250 of them (about
/// 25 s here), not after 4,096 (some 6 minutes).
const BLOCK_BYTES: usize = 512 << 10;

/// `first`, then the lines that have arrived on `rx`, until the block holds `max_texts` texts or
/// `max_bytes` bytes (the line that passes it included) or a read failed (then its error, the
/// texts before it kept). A line cut at [`TEXT_LINE`] bytes (noted on stderr) is embedded from
/// its start, as a text over the model's tokens is: the model takes far fewer.
fn take_block(
    first: anyhow::Result<crate::input::Line>,
    rx: &std::sync::mpsc::Receiver<anyhow::Result<crate::input::Line>>,
    max_texts: usize,
    max_bytes: usize,
) -> (Vec<String>, Option<anyhow::Error>) {
    let (mut block, mut bytes) = (Vec::new(), 0usize);
    let mut next = Some(first);
    while let Some(line) = next.take() {
        match line {
            Ok(line) => {
                bytes += line.text.len();
                block.push(line.text);
            }
            Err(e) => return (block, Some(e)),
        }
        if block.len() < max_texts && bytes < max_bytes {
            next = rx.try_recv().ok();
        }
    }
    (block, None)
}

/// Runs `cascade embed`: what has arrived, up to [`BLOCK`] texts at a time, each block in
/// batches of `--batch`.
pub(crate) fn embed(a: EmbedArgs) -> anyhow::Result<()> {
    let input = crate::input::given_then_lines(a.text.clone(), a.text_file.clone(), "--text-file", TEXT_LINE)?;
    // Read ahead: a block is what has arrived (up to BLOCK texts), so a text typed or piped in
    // alone is embedded at once, and a file's next block is read while this one is embedded.
    let rx = crate::input::read_ahead(input, BLOCK);
    crate::models::ensure_minilm(&a.model, true)?;
    let t = std::time::Instant::now();
    let mut e = Embedder::from_dir(&a.model).with_context(|| format!("loading the model in {}", a.model.display()))?;
    let loaded = t.elapsed();
    match (&a.prompt_name, &a.prompt) {
        (Some(name), _) => e.use_prompt_named(name).with_context(|| format!("--prompt-name {name:?}"))?,
        (None, Some(text)) => e.use_prompt(text)?,
        (None, None) => {
            if let (Some(name), Some(p)) = (&e.prompts().default, e.prompt()) {
                eprintln!(
                    "note: every text gets the model's default prompt {name:?} ({:?}) before it, as sentence-transformers does; --prompt \"\" for none",
                    p.text
                );
            }
        }
    }
    // Progress on stderr when there may be more than one pass (indicatif draws nothing when it
    // is no terminal); the length is unknown until the input ends.
    let bar = (a.text_file.is_some() || a.text.len() > a.batch as usize).then(|| {
        let style = ProgressStyle::with_template("embedding: {pos} texts, {per_sec} {spinner}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        ProgressBar::new_spinner().with_style(style)
    });
    let mut stdout = std::io::stdout().lock();
    let (mut done, mut ran) = (0usize, std::time::Duration::ZERO);
    // A read that failed: the texts before it are embedded, then the run ends with it.
    let mut failed = None;
    while failed.is_none() {
        // The first text waited for, then what has arrived.
        let Ok(first) = rx.recv() else { break };
        let block;
        (block, failed) = take_block(first, &rx, BLOCK, BLOCK_BYTES);
        let texts: Vec<&str> = block.iter().map(String::as_str).collect();
        let t = std::time::Instant::now();
        let (out, cut) = e.embed_in_batches(&texts, a.batch as usize, |n, _| {
            if let Some(b) = &bar {
                b.set_position((done + n) as u64);
            }
        })?;
        ran += t.elapsed();
        done += texts.len();
        if let Some(b) = &bar {
            b.suspend(|| print(&mut stdout, &a, &e, &texts, &out, &cut))?;
        } else {
            print(&mut stdout, &a, &e, &texts, &out, &cut)?;
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(e) = failed {
        return Err(e.context(format!("after {} embedded", count(done, "text", "texts"))));
    }
    if done == 0 {
        let path = a.text_file.as_deref().unwrap_or(std::path::Path::new("-"));
        anyhow::bail!("--text-file {} holds no line, and no --text was given: nothing to embed", path.display());
    }
    if !a.json {
        writeln!(
            stdout,
            "({} and the embedding stage on the CPU; model loaded in {:.0} ms, {} embedded in {:.0} ms)",
            count(e.model().config().num_hidden_layers, "encoder layer", "encoder layers"),
            loaded.as_secs_f64() * 1e3,
            count(done, "text", "texts"),
            ran.as_secs_f64() * 1e3
        )?;
    }
    Ok(())
}

/// One line per text: JSON, or the text, its first values and a note if it was cut.
fn print(
    out: &mut impl Write,
    a: &EmbedArgs,
    e: &Embedder,
    texts: &[&str],
    vectors: &[Vec<f32>],
    cut: &[bool],
) -> std::io::Result<()> {
    for ((text, v), &cut) in texts.iter().zip(vectors).zip(cut) {
        if a.json {
            writeln!(out, "{}", serde_json::json!({ "text": text, "dim": v.len(), "embedding": v, "truncated": cut }))?;
        } else {
            let head: Vec<String> = v.iter().take(6).map(|x| format!("{x:+.5}")).collect();
            let note = match e.max_tokens() {
                Some(max) if cut => format!(" (longer than the model takes: embedded from its first {max} tokens)"),
                _ => String::new(),
            };
            writeln!(out, "{:?}: dim {}, [{} ...]{note}", shorten(text), v.len(), head.join(", "))?;
        }
    }
    out.flush()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::take_block;
    use crate::input::Line;

    #[test]
    fn a_block_is_what_has_arrived_up_to_its_texts_and_bytes() {
        let (tx, rx) = std::sync::mpsc::channel();
        let line = |t: &str| Ok(Line::from(t.to_string()));
        for t in ["bb", "ccc", "dddd", "e"] {
            tx.send(line(t)).unwrap();
        }
        // Up to 3 texts.
        assert_eq!(take_block(line("a"), &rx, 3, 100).0, ["a", "bb", "ccc"]);
        // Up to 5 bytes: the text that passes them is in.
        assert_eq!(take_block(line("x"), &rx, 100, 5).0, ["x", "dddd"]);
        // What has arrived, not more: nothing waited for.
        assert_eq!(take_block(line("y"), &rx, 100, 100).0, ["y", "e"]);
        // A failed read ends the block with the texts before it.
        tx.send(line("z")).unwrap();
        tx.send(Err(anyhow::anyhow!("disk"))).unwrap();
        tx.send(line("after")).unwrap();
        let (texts, failed) = take_block(line("w"), &rx, 100, 100);
        assert_eq!(
            (texts, failed.map(|e| e.to_string())),
            (vec!["w".to_string(), "z".to_string()], Some("disk".into()))
        );
    }
}
