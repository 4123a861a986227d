//! `cascade model import --gguf` and `cascade generate`: a real decoder LLM on the CPU.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use cascade_exec::llama::generate::{Generated, Generator};
use clap::{Args, Subcommand, ValueEnum};

/// Model files.
#[derive(Subcommand)]
pub(crate) enum ModelCmd {
    /// Import a llama-architecture GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf) as a model
    /// directory: model.safetensors (dequantized, Hugging Face names), config.json, tokenizer.json.
    Import(ImportArgs),
}

/// How the imported tensors are stored.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Dtype {
    /// 32-bit floats (exact dequantized values).
    F32,
    /// 16-bit floats (half the bytes; the dequantized values rounded).
    F16,
}

#[derive(Args)]
pub(crate) struct ImportArgs {
    /// The GGUF file.
    #[arg(long)]
    gguf: PathBuf,
    /// The model directory to write (created).
    #[arg(long)]
    out: PathBuf,
    /// Storage of the dequantized tensors.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

pub(crate) fn model(cmd: ModelCmd) -> anyhow::Result<()> {
    let ModelCmd::Import(a) = cmd;
    let dtype = match a.dtype {
        Dtype::F32 => candle_core::DType::F32,
        Dtype::F16 => candle_core::DType::F16,
    };
    let t = Instant::now();
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("dequantizing {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let out = cascade_exec::gguf::import(&a.gguf, &a.out, dtype, |i, n, name| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
        bar.set_message(name.to_string());
    })
    // The error names the GGUF file; the directory is this call's.
    .with_context(|| format!("importing into {}", a.out.display()))?;
    bar.finish_and_clear();
    let c = &out.config;
    println!(
        "{}: {} tensors, {} blocks, hidden {}, {} query / {} key-value heads, vocabulary {}; {:.1} MB written in {:.1} s",
        a.out.display(),
        out.tensors,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        out.vocabulary,
        out.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// The model directory (`cascade model import --gguf` writes one).
    #[arg(long, default_value = "target/models/smollm2-135m/f32")]
    model: PathBuf,
    /// The prompt, used as given (special tokens such as <|im_start|> are recognised).
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Wrap each prompt in the model's ChatML turn (a user message, then the assistant's turn).
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (generation stops earlier at end-of-sequence).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Print one JSON object per prompt: {prompt_tokens, tokens, text}.
    #[arg(long)]
    json: bool,
}

/// The ChatML turn SmolLM2-Instruct's template renders for one user message (with its default
/// system message).
fn chatml(user: &str) -> String {
    format!(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// Text generated so far and shown (escaped as `{:?}` shows it, without the quotes).
#[derive(Default)]
struct Streamed {
    tokens: Vec<u32>,
    text: String,
}

impl Streamed {
    /// Takes `tok` and prints the text it completes: a token may end in the middle of a
    /// character, whose bytes then wait for the next one.
    fn push(&mut self, g: &Generator, tok: u32) {
        self.tokens.push(tok);
        let Ok(text) = g.decode(&self.tokens) else { return };
        if text.ends_with('\u{FFFD}') || !text.starts_with(&self.text) {
            return;
        }
        use std::io::Write;
        print!("{}", escaped(&text[self.text.len()..]));
        let _ = std::io::stdout().flush();
        self.text = text;
    }
}

/// `text` escaped as `{:?}` shows it, without the quotes (it escapes character by character, so
/// pieces escaped one by one read as the whole would).
fn escaped(text: &str) -> String {
    let quoted = format!("{text:?}");
    quoted[1..quoted.len() - 1].to_string()
}

/// Prints one prompt's result: its JSON line, the rest of its streamed text (`streamed`: what was
/// shown as it came), or its `"prompt" → "text"` line; and a note if it filled the context window.
fn show(a: &GenerateArgs, g: &Generator, prompt: &str, o: &Generated, streamed: Option<&String>) -> anyhow::Result<()> {
    let text = g.decode(&o.tokens)?;
    if a.json {
        let v = serde_json::json!({"prompt_tokens": o.prompt_tokens, "tokens": o.tokens, "text": text, "at_window": o.at_window});
        println!("{v}");
    } else if let Some(shown) = streamed {
        println!("{}\"", escaped(text.get(shown.len()..).unwrap_or_default()));
    } else {
        println!("{:?} → {text:?}", crate::shorten(prompt));
    }
    if o.at_window {
        eprintln!(
            "note: {:?} stopped after {} tokens: with its {} prompt tokens they fill the model's context window of {}",
            crate::shorten(prompt),
            o.tokens.len(),
            o.prompt_tokens.len(),
            g.model().config().max_position_embeddings
        );
    }
    // Seen at once when piped too (stdout is buffered there).
    use std::io::Write;
    std::io::stdout().flush()?;
    Ok(())
}

pub(crate) fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let t = Instant::now();
    let g = Generator::from_dir(&a.model).with_context(|| {
        format!(
            "loading {} (scripts/fetch-smollm2.sh fetches SmolLM2-135M-Instruct and imports it there)",
            a.model.display()
        )
    })?;
    let loaded = t.elapsed();
    let texts: Vec<String> = a.prompt.iter().map(|p| if a.chat { chatml(p) } else { p.clone() }).collect();
    let prompts = texts.iter().map(|p| g.encode(p)).collect::<Result<Vec<_>, _>>()?;
    let t = Instant::now();
    // One prompt as text is shown token by token as it is generated (a long one takes minutes);
    // with several, each is shown once it and every prompt before it are done, in their order.
    let stream = !a.json && prompts.len() == 1;
    let mut shown = Streamed::default();
    if stream {
        print!("{:?} → \"", crate::shorten(&a.prompt[0]));
    }
    let mut done: Vec<Option<Generated>> = vec![None; prompts.len()];
    let mut next = 0;
    let mut failed: Option<anyhow::Error> = None;
    let out = g.generate_each(
        &prompts,
        a.max_tokens,
        |_, tok| {
            if stream {
                shown.push(&g, tok);
            }
        },
        |i, o| {
            if stream {
                return; // shown below, after its streamed text
            }
            done[i] = Some(o.clone());
            while let Some(o) = done.get_mut(next).and_then(Option::take) {
                if failed.is_none() {
                    failed = show(&a, &g, &a.prompt[next], &o, None).err();
                }
                next += 1;
            }
        },
    )?;
    if let Some(e) = failed {
        return Err(e);
    }
    if stream {
        show(&a, &g, &a.prompt[0], &out[0], Some(&shown.text))?;
    }
    let ran = t.elapsed();
    let generated: usize = out.iter().map(|o| o.tokens.len()).sum();
    if !a.json {
        println!(
            "({} stages on the CPU; model loaded in {:.1} s; {} tokens generated in {:.2} s, {:.1} tokens/s)",
            g.model().config().stages(),
            loaded.as_secs_f64(),
            generated,
            ran.as_secs_f64(),
            generated as f64 / ran.as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}
