//! `cascade model import --gguf`: a llama GGUF file as a model directory.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};

/// Model files.
#[derive(Subcommand)]
pub(crate) enum ModelCmd {
    /// Import a llama-architecture GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf) as a model
    /// directory: model.safetensors (dequantized, or with `--dtype quantized` its Q4_0, Q4_1,
    /// Q5_0, Q5_1 and Q8_0 blocks kept; Hugging Face names), config.json, tokenizer.json.
    Import(ImportArgs),
}

/// How the imported tensors are stored.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Dtype {
    /// 32-bit floats (exact dequantized values).
    F32,
    /// 16-bit floats (half the bytes; the dequantized values rounded).
    F16,
    /// The GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks kept as they are (4.5 to 8.5 bits a
    /// weight), computed as the exact f32 values they dequantize to; the other tensors (other
    /// block types among them, as a note says) in f32.
    Quantized,
}

#[derive(Args)]
pub(crate) struct ImportArgs {
    /// The GGUF file.
    #[arg(long)]
    gguf: PathBuf,
    /// The model directory to write: created, or an empty directory, or one an earlier import
    /// wrote (replaced whole); a directory holding other files is refused.
    #[arg(long)]
    out: PathBuf,
    /// Storage of the tensors.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

pub(crate) fn model(cmd: ModelCmd) -> anyhow::Result<()> {
    let ModelCmd::Import(a) = cmd;
    let storage = match a.dtype {
        Dtype::F32 => cascade_exec::gguf::Storage::F32,
        Dtype::F16 => cascade_exec::gguf::Storage::F16,
        Dtype::Quantized => cascade_exec::gguf::Storage::Quantized,
    };
    let t = Instant::now();
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("importing {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let out = cascade_exec::gguf::import(&a.gguf, &a.out, storage, |i, n, name| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
        bar.set_message(name.to_string());
    })
    // The error names the GGUF file; the directory is this call's.
    .with_context(|| format!("importing into {}", a.out.display()))?;
    bar.finish_and_clear();
    let c = &out.config;
    println!(
        "{}: {} tensors, {} blocks, hidden {}, {} query / {} key-value heads, vocabulary {}; {:.1} MB written in {:.1} s{}",
        a.out.display(),
        out.tensors,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        out.vocabulary,
        out.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64(),
        if out.replaced { " (replacing the model an earlier import left there)" } else { "" }
    );
    if !out.widened.is_empty() {
        let types: Vec<String> = out.widened.iter().map(|(t, n)| format!("{n} {t}")).collect();
        eprintln!(
            "note: {} matrices kept as their GGUF blocks; {} written dequantized to f32 instead: --dtype quantized \
             keeps {} blocks only",
            out.kept_as_blocks,
            types.join(", "),
            cascade_exec::gguf::KEPT_BLOCKS
        );
    }
    Ok(())
}
