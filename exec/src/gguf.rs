//! Importing a llama-architecture GGUF file (llama.cpp's format) as an ordinary model directory:
//! `model.safetensors` with Hugging Face's tensor names (dequantized by `candle` to f32 or f16),
//! `config.json` and `tokenizer.json`, so the parameter pool, manifests, multicast and loaders
//! treat it like any other model.
//!
//! - **Q/K rows.** llama.cpp's converter permutes the rows of `q_proj` and `k_proj` so that its
//!   RoPE can rotate adjacent pairs; this module undoes that permutation, so [`crate::llama`]
//!   rotates halves as Hugging Face's layout wants.
//! - **Tokenizer.** It is rebuilt from the GGUF metadata: byte-level BPE (`tokenizer.ggml.model =
//!   gpt2`) with the vocabulary, the merges and the control tokens as special tokens. The
//!   pre-tokenizer follows `tokenizer.ggml.pre`: `smollm` (and the other llama.cpp types that
//!   split digits one by one: `starcoder`, `refact`, `codeshell`) gets each digit alone, then
//!   GPT-2's regex; `gpt2` and `default` get GPT-2's regex. Other pre-tokenizers are refused,
//!   rather than tokenised subtly wrong.
//! - **Chat template.** It is kept in `config.json` as `chat_template`, for reference; nothing
//!   here renders it.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::llama::LlamaConfig;
use crate::ExecError;

/// What [`import`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Imported {
    /// The model's configuration (also in `config.json`).
    pub config: LlamaConfig,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
    /// Tokens in the vocabulary.
    pub vocabulary: usize,
    /// Whether the directory held a model (an earlier import), which this one replaced.
    pub replaced: bool,
}

fn bad(why: impl std::fmt::Display) -> ExecError {
    ExecError::Model(format!("gguf: {why}"))
}

fn meta<'a>(c: &'a Content, key: &str) -> Result<&'a Value, ExecError> {
    c.metadata.get(key).ok_or_else(|| bad(format!("no {key} in the metadata")))
}

fn meta_u32(c: &Content, key: &str) -> Result<u32, ExecError> {
    let v = meta(c, key)?;
    v.to_u32()
        .or_else(|_| v.to_u64().map(|x| x as u32))
        .or_else(|_| v.to_i32().map(|x| x as u32))
        .map_err(|e| bad(format!("{key}: {e}")))
}

fn meta_strings(c: &Content, key: &str) -> Result<Vec<String>, ExecError> {
    meta(c, key)?
        .to_vec()
        .map_err(|e| bad(format!("{key}: {e}")))?
        .iter()
        .map(|v| v.to_string().cloned().map_err(|e| bad(format!("{key}: {e}"))))
        .collect()
}

/// The Hugging Face name of a GGUF tensor, and whether its rows are permuted for RoPE (and with
/// how many heads).
fn hf_name(name: &str, cfg: &LlamaConfig) -> Result<(String, Option<usize>), ExecError> {
    let simple = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(s) = simple {
        return Ok((s.to_string(), None));
    }
    let rest = name.strip_prefix("blk.").ok_or_else(|| bad(format!("unknown tensor {name:?}")))?;
    let (n, tail) = rest.split_once('.').ok_or_else(|| bad(format!("unknown tensor {name:?}")))?;
    let n: usize = n.parse().map_err(|_| bad(format!("unknown tensor {name:?}")))?;
    let (hf, heads) = match tail {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(cfg.num_attention_heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(cfg.num_key_value_heads)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        _ => return Err(bad(format!("unknown tensor {name:?}"))),
    };
    Ok((format!("model.layers.{n}.{hf}"), heads))
}

/// Undoes llama.cpp's row permutation of a Q or K projection `[heads·d, in]`: GGUF's rows are
/// Hugging Face's viewed as `[heads, 2, d/2]` with the last two axes swapped.
pub fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor, ExecError> {
    let (out, inn) = w.dims2()?;
    if heads == 0 || !out.is_multiple_of(2 * heads) {
        return Err(bad(format!("{out} rows do not split into {heads} heads of pairs")));
    }
    Ok(w.reshape((heads, out / heads / 2, 2, inn))?.transpose(1, 2)?.contiguous()?.reshape((out, inn))?)
}

/// The model's configuration from the GGUF metadata.
fn config(c: &Content) -> Result<LlamaConfig, ExecError> {
    let arch = meta(c, "general.architecture")?.to_string().map_err(bad)?;
    if arch != "llama" {
        return Err(bad(format!("architecture {arch:?}: only llama is supported")));
    }
    let f = |key: &str| -> Result<f64, ExecError> {
        let v = meta(c, key)?;
        v.to_f32().map(f64::from).or_else(|_| v.to_f64()).map_err(|e| bad(format!("{key}: {e}")))
    };
    let heads = meta_u32(c, "llama.attention.head_count")? as usize;
    let tokens = meta(c, "tokenizer.ggml.tokens")?.to_vec().map_err(bad)?.len();
    let cfg = LlamaConfig {
        model_type: "llama".into(),
        hidden_size: meta_u32(c, "llama.embedding_length")? as usize,
        intermediate_size: meta_u32(c, "llama.feed_forward_length")? as usize,
        num_hidden_layers: meta_u32(c, "llama.block_count")? as usize,
        num_attention_heads: heads,
        num_key_value_heads: meta_u32(c, "llama.attention.head_count_kv").map_or(heads, |v| v as usize),
        rms_norm_eps: f("llama.attention.layer_norm_rms_epsilon")?,
        rope_theta: f("llama.rope.freq_base").unwrap_or(10_000.0),
        vocab_size: meta_u32(c, "llama.vocab_size").map_or(tokens, |v| v as usize),
        max_position_embeddings: meta_u32(c, "llama.context_length")? as usize,
        tie_word_embeddings: !c.tensor_infos.contains_key("output.weight"),
        bos_token_id: meta_u32(c, "tokenizer.ggml.bos_token_id")?,
        eos_token_id: meta_u32(c, "tokenizer.ggml.eos_token_id")?,
    };
    cfg.check()?;
    Ok(cfg)
}

/// `tokenizer.json` (the `tokenizers` crate's format) from the GGUF metadata.
fn tokenizer_json(c: &Content) -> Result<serde_json::Value, ExecError> {
    let model = meta(c, "tokenizer.ggml.model")?.to_string().map_err(bad)?;
    if model != "gpt2" {
        return Err(bad(format!("tokenizer model {model:?}: only gpt2 (byte-level BPE) is supported")));
    }
    let pre = c.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).map_or("default", String::as_str);
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        "gpt2" | "default" => byte_level.clone(),
        other => return Err(bad(format!("pre-tokenizer {other:?} is not supported"))),
    };
    let tokens = meta_strings(c, "tokenizer.ggml.tokens")?;
    let merges = meta_strings(c, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match c.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v.to_vec().map_err(bad)?.iter().map(|t| t.to_i32().map(i64::from).unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    // Token type 3 is a control token (`<|im_start|>`, `<|endoftext|>`, …): matched whole, never split.
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == 3)
        .map(|(i, (t, _))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// The files [`import`] writes into a model directory, and the only ones a directory it replaces
/// may hold.
pub const IMPORT_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// Imports the GGUF file `gguf` into the directory `out`, its tensors stored as `dtype` (F32 or
/// F16). `progress` is told each tensor's name as it is converted.
///
/// `out` may be missing (it is created, with its parents), empty, or a model directory an import
/// wrote (only [`IMPORT_FILES`]), which is then replaced whole. Anything else there (another
/// model's files, a directory of the user's) is refused before the GGUF is read, so nothing is
/// overwritten or left mixed with the new model. The files are written into a directory beside
/// `out` and exchanged with it in one step at the end: `out` holds the previous model or the new
/// one, whole, never a part of either, whether the import succeeds, fails or is stopped.
pub fn import(
    gguf: &Path,
    out: &Path,
    dtype: DType,
    progress: impl FnMut(usize, usize, &str),
) -> Result<Imported, ExecError> {
    if !matches!(dtype, DType::F32 | DType::F16) {
        return Err(bad(format!("{dtype:?}: only f32 and f16 are written")));
    }
    let there = target(out)?;
    let tmp = staging(out)?;
    let done = write_model(gguf, &tmp, out, dtype, progress).and_then(|mut imported| {
        put_in_place(&tmp, out, there != Target::Missing)?;
        imported.replaced = there == Target::Import;
        Ok(imported)
    });
    // After a failure the staging directory holds the partial files; after an exchange, the
    // previous model.
    let _ = std::fs::remove_dir_all(&tmp);
    done
}

/// [`import`] as f32 where `dir` is missing, for a model imported on first use: when another
/// process imported it first (`dir` is there by the end), that import is kept and this one
/// removed.
pub fn import_into_place(gguf: &Path, dir: &Path) -> Result<(), ExecError> {
    let tmp = staging(dir)?;
    let done = write_model(gguf, &tmp, dir, DType::F32, |_, _, _| {});
    if done.is_ok() {
        let _ = std::fs::rename(&tmp, dir);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    done.map(|_| ())
}

/// What an import finds where it is to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Nothing: the directory is created.
    Missing,
    /// An empty directory.
    Empty,
    /// A directory with only [`IMPORT_FILES`]: an earlier import, replaced.
    Import,
}

/// What `out` is; an error naming what it holds where an import may not replace it.
fn target(out: &Path) -> Result<Target, ExecError> {
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Target::Missing),
        Err(e) => return Err(bad(format!("{}: {e}", out.display()))),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        return Err(bad(format!("{} is a symbolic link: name the directory itself", out.display())));
    }
    if !meta.is_dir() {
        return Err(bad(format!("{} is there and is not a directory", out.display())));
    }
    let (mut others, mut files) = (Vec::new(), 0);
    for entry in std::fs::read_dir(out).map_err(|e| bad(format!("{}: {e}", out.display())))? {
        let entry = entry.map_err(|e| bad(format!("{}: {e}", out.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let file = entry.file_type().is_ok_and(|t| t.is_file());
        if !file || !IMPORT_FILES.contains(&name.as_str()) {
            others.push(name);
        } else {
            files += 1;
        }
    }
    if others.is_empty() {
        return Ok(if files == 0 { Target::Empty } else { Target::Import });
    }
    others.sort();
    let shown = if others.len() > 4 {
        format!("{} and {} more", others[..3].join(", "), others.len() - 3)
    } else {
        others.join(", ")
    };
    Err(bad(format!(
        "{} holds {shown}, which an import does not write ({}): refused, so that nothing there is \
         overwritten or left beside the new model; name a new or empty directory",
        out.display(),
        IMPORT_FILES.join(", ")
    )))
}

/// A fresh directory beside `out` (same file system, hidden, named after it and this process)
/// to write an import into; `out`'s parents are created.
fn staging(out: &Path) -> Result<std::path::PathBuf, ExecError> {
    let name = out.file_name().ok_or_else(|| bad(format!("{} names no directory", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(parent).map_err(|e| bad(format!("{}: {e}", parent.display())))?;
    let tmp = parent.join(format!(".{}.import-{}", name.to_string_lossy(), std::process::id()));
    // One left by an earlier process of this id that was killed.
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| bad(format!("{}: {e}", tmp.display())))?;
    Ok(tmp)
}

/// Moves the import written in `tmp` to `out`: a rename where `out` is missing, an atomic
/// exchange (`renameat2(RENAME_EXCHANGE)`) where it `replaces` a directory, which leaves the
/// previous one in `tmp`.
fn put_in_place(tmp: &Path, out: &Path, replaces: bool) -> Result<(), ExecError> {
    let failed = |e: std::io::Error| bad(format!("moving the import into {}: {e}", out.display()));
    if !replaces {
        // Fails (the directory is not empty) if another import got there meanwhile.
        return std::fs::rename(tmp, out).map_err(failed);
    }
    use std::os::unix::ffi::OsStrExt;
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|e| bad(format!("{}: {e}", p.display())));
    let (from, to) = (c(tmp)?, c(out)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; renameat2 only
    // reads them.
    let rc =
        unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc != 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Reads `gguf` and writes the model directory's files into `dir` (which exists), naming them in
/// errors as the files of `named`, where they will lie.
fn write_model(
    gguf: &Path,
    dir: &Path,
    named: &Path,
    dtype: DType,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<Imported, ExecError> {
    let mut r =
        BufReader::new(File::open(gguf).map_err(|e| ExecError::Model(format!("GGUF file {}: {e}", gguf.display())))?);
    let c = Content::read(&mut r)
        .map_err(|e| ExecError::Model(format!("GGUF file {} does not read as GGUF: {e}", gguf.display())))?;
    let cfg = config(&c)?;
    let tok = tokenizer_json(&c)?;
    // Parse it back before writing anything: the file we write must load.
    let text = serde_json::to_string(&tok).map_err(bad)?;
    tokenizers::Tokenizer::from_bytes(text.as_bytes())
        .map_err(|e| bad(format!("the tokenizer built from the metadata: {e}")))?;

    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: HashMap<String, Tensor> = HashMap::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        progress(i, names.len(), name);
        let (hf, heads) = hf_name(name, &cfg)?;
        let q = c.tensor(&mut r, name, &Device::Cpu).map_err(|e| bad(format!("{name}: {e}")))?;
        let mut t = q.dequantize(&Device::Cpu).map_err(|e| bad(format!("{name}: {e}")))?;
        if let Some(h) = heads {
            t = unpermute(&t, h)?;
        }
        tensors.insert(hf, t.to_dtype(dtype)?);
    }
    check_shapes(&cfg, &tensors)?;

    let failed = |file: &str, e: &dyn std::fmt::Display| bad(format!("{}: {e}", named.join(file).display()));
    let model_path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &model_path).map_err(|e| failed("model.safetensors", &e))?;
    let mut config_json = serde_json::to_value(&cfg).map_err(bad)?;
    config_json["architectures"] = json!(["LlamaForCausalLM"]);
    config_json["torch_dtype"] = json!(if dtype == DType::F16 { "float16" } else { "float32" });
    if let Some(t) = c.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()) {
        config_json["chat_template"] = json!(t);
    }
    let write = |name: &str, text: String| std::fs::write(dir.join(name), text).map_err(|e| failed(name, &e));
    write("config.json", serde_json::to_string_pretty(&config_json).map_err(bad)?)?;
    write("tokenizer.json", text)?;
    // `safetensors` writes through a temporary file, created readable by its owner only; the
    // model gets the mode the process gives its other files (its umask), as config.json has.
    let mode = std::fs::metadata(dir.join("config.json")).map_err(|e| failed("config.json", &e))?.permissions();
    std::fs::set_permissions(&model_path, mode).map_err(|e| failed("model.safetensors", &e))?;
    let bytes = std::fs::metadata(&model_path).map_err(|e| failed("model.safetensors", &e))?.len();
    let vocabulary = meta(&c, "tokenizer.ggml.tokens")?.to_vec().map_err(bad)?.len();
    Ok(Imported { config: cfg, tensors: tensors.len(), bytes, vocabulary, replaced: false })
}

/// Refuses a file whose tensors do not have the shapes its metadata implies.
fn check_shapes(cfg: &LlamaConfig, tensors: &HashMap<String, Tensor>) -> Result<(), ExecError> {
    let (h, f, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim());
    for (name, t) in tensors {
        let shape = t.dims();
        let want: Vec<usize> = match name.rsplit('.').nth(1).unwrap_or("") {
            "embed_tokens" | "lm_head" => vec![cfg.vocab_size, h],
            "q_proj" | "o_proj" => vec![h, h],
            "k_proj" | "v_proj" => vec![kv, h],
            "gate_proj" | "up_proj" => vec![f, h],
            "down_proj" => vec![h, f],
            _ => vec![h],
        };
        if shape != want {
            return Err(bad(format!("{name} is {shape:?}, the configuration implies {want:?}")));
        }
    }
    let blocks = tensors.keys().filter(|n| n.ends_with("mlp.down_proj.weight")).count();
    if blocks != cfg.num_hidden_layers {
        return Err(bad(format!("{blocks} blocks, the configuration says {}", cfg.num_hidden_layers)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's converter's permutation (`convert_hf_to_gguf.py`'s `permute`), written here
    /// from its definition: rows viewed as `[heads, 2, d/2]`, the last two axes swapped.
    fn permute(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        let half = rows / heads / 2;
        let mut out = vec![0.0; w.len()];
        for h in 0..heads {
            for two in 0..2 {
                for i in 0..half {
                    let src = h * 2 * half + two * half + i;
                    let dst = h * 2 * half + i * 2 + two;
                    out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_undoes_the_converters_permutation() {
        let (rows, cols, heads) = (24, 3, 3);
        let hf: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let gguf = Tensor::from_vec(permute(&hf, rows, cols, heads), (rows, cols), &Device::Cpu).unwrap();
        let back = unpermute(&gguf, heads).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(back, hf);
        assert!(unpermute(&gguf, 5).is_err());
    }

    #[test]
    fn a_missing_or_foreign_file_is_a_clear_error() {
        let e = import(Path::new("/nonexistent.gguf"), Path::new("/tmp/x"), DType::F32, |_, _, _| {}).unwrap_err();
        assert!(e.to_string().contains("/nonexistent.gguf"), "{e}");
        let dir = std::env::temp_dir().join(format!("cascade-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("not.gguf");
        std::fs::write(&f, b"GGUF\x03\0\0\0garbage").unwrap();
        assert!(import(&f, &dir.join("out"), DType::F32, |_, _, _| {}).is_err());
        assert!(import(&f, &dir.join("out"), DType::U8, |_, _, _| {}).unwrap_err().to_string().contains("f32 and f16"));
        assert!(!dir.join("out").exists(), "nothing is written for a refused file");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["not.gguf"], "no staging directory is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A directory holding files an import does not write (here another model's), a symbolic
    /// link or a plain file is refused before the GGUF is even opened, and left as it was; an
    /// empty directory or an earlier import's may be written.
    #[test]
    fn an_import_refuses_a_directory_it_would_mix_with_or_overwrite() {
        let dir = std::env::temp_dir().join(format!("cascade-gguf-target-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let bert = dir.join("bert");
        std::fs::create_dir_all(&bert).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "sentence_bert_config.json"] {
            std::fs::write(bert.join(f), f).unwrap();
        }
        let missing = Path::new("/nonexistent.gguf");
        let e = import(missing, &bert, DType::F32, |_, _, _| {}).unwrap_err().to_string();
        assert!(e.contains("holds sentence_bert_config.json, vocab.txt, which an import does not write"), "{e}");
        assert_eq!(std::fs::read_to_string(bert.join("model.safetensors")).unwrap(), "model.safetensors");
        std::os::unix::fs::symlink(&bert, dir.join("link")).unwrap();
        let e = import(missing, &dir.join("link"), DType::F32, |_, _, _| {}).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        let e = import(missing, &bert.join("vocab.txt"), DType::F32, |_, _, _| {}).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");

        assert_eq!(target(&dir.join("none")).unwrap(), Target::Missing);
        std::fs::create_dir(dir.join("empty")).unwrap();
        assert_eq!(target(&dir.join("empty")).unwrap(), Target::Empty);
        for f in ["vocab.txt", "sentence_bert_config.json"] {
            std::fs::remove_file(bert.join(f)).unwrap();
        }
        assert_eq!(target(&bert).unwrap(), Target::Import);
        std::fs::create_dir(bert.join("config.json.d")).unwrap();
        assert!(target(&bert).is_err(), "a directory among the files");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An import replaces an earlier one by exchanging the directories in one step: the new files
    /// are where the old ones were, and the old ones where the new were written.
    #[test]
    fn putting_an_import_in_place_exchanges_the_directories() {
        let dir = std::env::temp_dir().join(format!("cascade-gguf-exchange-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (out, tmp) = (dir.join("model"), dir.join(".model.import"));
        for (d, text) in [(&out, "old"), (&tmp, "new")] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.safetensors"), text).unwrap();
        }
        put_in_place(&tmp, &out, true).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("model.safetensors")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(tmp.join("model.safetensors")).unwrap(), "old");
        // Where the directory was missing but another import put one there meanwhile, the rename
        // fails rather than replacing it.
        assert!(put_in_place(&tmp, &out, false).unwrap_err().to_string().contains("moving the import into"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
