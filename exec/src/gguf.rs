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
//!   A beginning- or end-of-sequence token is added around every text where the metadata says
//!   `add_bos_token` or `add_eos_token`, as llama.cpp does.
//! - **Chat template.** It is kept in `config.json` as `chat_template`; [`crate::llama::chat`]
//!   renders it (`cascade generate --chat`).
//! - **What is not computed here** (RoPE scaling, RoPE on part of a head, heads of another width,
//!   experts) is refused, naming the metadata key, as are tensors of no known name.
//! - **Writing.** Each tensor is dequantized only when its bytes are written (`gguf/tensors.rs`), and
//!   the directory is written beside its place and exchanged with it at the end (`gguf/place.rs`).

mod place;
mod tensors;

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::Tensor;
use place::{put_in_place, staging, target, Target};
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
    /// With [`Storage::Quantized`]: matrices written as their GGUF blocks.
    pub kept_as_blocks: usize,
    /// With [`Storage::Quantized`]: matrices of another quantized GGML type (Q4_K, Q6_K, …),
    /// written dequantized to f32 instead, counted by type — such a directory is not the fifth of
    /// the f32 import's size that a Q4_1 one is.
    pub widened: std::collections::BTreeMap<String, usize>,
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
    // What changes the computation beyond the fields above, and is not applied here.
    let head = cfg.head_dim() as u64;
    let number = |key: &str| meta_u32(c, key).ok().map(u64::from);
    for key in ["llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"] {
        if let Some(n) = number(key).filter(|&n| n != head) {
            return Err(bad(format!("{key} = {n}, not the head width {head}: not computed here")));
        }
    }
    if let Some(kind) =
        c.metadata.get("llama.rope.scaling.type").and_then(|v| v.to_string().ok()).filter(|k| *k != "none")
    {
        return Err(bad(format!("llama.rope.scaling.type = {kind:?}: RoPE scaling is not applied here")));
    }
    if let Some(n) = number("llama.expert_count").filter(|&n| n > 0) {
        return Err(bad(format!("llama.expert_count = {n}: a mixture of experts is not computed here")));
    }
    Ok(cfg)
}

/// What the tokenizer adds around a text, as the GGUF's `tokenizer.ggml.add_bos_token` and
/// `add_eos_token` say (llama.cpp adds them when it tokenises a prompt): a `TemplateProcessing`,
/// or null when it adds nothing (SmolLM2).
fn post_processor(c: &Content, tokens: &[String]) -> Result<serde_json::Value, ExecError> {
    let flag = |key: &str| c.metadata.get(key).and_then(|v| v.to_bool().ok()).unwrap_or(false);
    let mut around = Vec::new();
    for (add, id_key, at_start) in [
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", true),
        ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id", false),
    ] {
        if flag(add) {
            let id = meta_u32(c, id_key)?;
            let token = tokens.get(id as usize).ok_or_else(|| bad(format!("{id_key} {id}: no such token")))?;
            around.push((at_start, id, token.clone()));
        }
    }
    if around.is_empty() {
        return Ok(serde_json::Value::Null);
    }
    let special = |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
    let template = |seqs: &[(&str, u32)]| -> Vec<serde_json::Value> {
        let mut t = Vec::new();
        for &(seq, type_id) in seqs {
            t.extend(around.iter().filter(|a| a.0).map(|a| special(&a.2, type_id)));
            t.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
            t.extend(around.iter().filter(|a| !a.0).map(|a| special(&a.2, type_id)));
        }
        t
    };
    let specials: serde_json::Map<String, serde_json::Value> = around
        .iter()
        .map(|(_, id, token)| (token.clone(), json!({"id": token, "ids": [id], "tokens": [token]})))
        .collect();
    Ok(json!({
        "type": "TemplateProcessing",
        "single": template(&[("A", 0)]),
        "pair": template(&[("A", 0), ("B", 1)]),
        "special_tokens": specials,
    }))
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
        "post_processor": post_processor(c, &tokens)?,
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

/// The GGUF block types a [`Storage::Quantized`] import keeps as blocks.
pub const KEPT_BLOCKS: &str = crate::projection::blocks::KEPT;

/// How [`import`] stores a model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// f32: the exact dequantized values.
    F32,
    /// f16: the dequantized values rounded (half the bytes of f32).
    F16,
    /// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices ([`KEPT_BLOCKS`]) kept in their GGUF blocks, as
    /// U8 `[rows, blocks, bytes per block]` (4.5 to 8.5 bits a weight; SmolLM2-135M's Q4_1:
    /// 96.6 MB against 538 MB), which load into panels of those blocks and compute, bit for bit,
    /// what the f32 import computes; every other tensor (the norms, other block types such as the
    /// K-quants) dequantized to f32.
    Quantized,
}

/// Imports the GGUF file `gguf` into the directory `out`, its tensors stored as `storage` says.
/// `progress` is told each tensor's name as it is converted.
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
    storage: Storage,
    progress: impl FnMut(usize, usize, &str),
) -> Result<Imported, ExecError> {
    let there = target(out)?;
    let tmp = staging(out)?;
    let done = write_model(gguf, &tmp, out, storage, progress).and_then(|mut imported| {
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
    let done = write_model(gguf, &tmp, dir, Storage::F32, |_, _, _| {});
    if done.is_ok() {
        let _ = std::fs::rename(&tmp, dir);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    done.map(|_| ())
}

/// Reads `gguf` and writes the model directory's files into `dir` (which exists), naming them in
/// errors as the files of `named`, where they will lie.
fn write_model(
    gguf: &Path,
    dir: &Path,
    named: &Path,
    storage: Storage,
    progress: impl FnMut(usize, usize, &str),
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

    // Every name and shape is checked before a tensor is read; each is then read as it is written.
    let source = tensors::Source::new(&c, r, storage, progress);
    let mut lazy = Vec::with_capacity(c.tensor_infos.len());
    let (mut kept_as_blocks, mut widened) = (0, std::collections::BTreeMap::new());
    for (name, info) in &c.tensor_infos {
        let (hf, heads) = hf_name(name, &cfg)?;
        check_shape(&cfg, &hf, info.shape.dims())?;
        let t = source.tensor(name, info.shape.dims(), heads);
        let quantized = !matches!(info.ggml_dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if t.as_blocks() {
            kept_as_blocks += 1;
        } else if storage == Storage::Quantized && quantized {
            *widened.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
        }
        lazy.push((hf, t));
    }
    check_blocks(&cfg, lazy.iter().map(|(n, _)| n.as_str()))?;
    let count = lazy.len();

    let failed = |file: &str, e: &dyn std::fmt::Display| bad(format!("{}: {e}", named.join(file).display()));
    let model_path = dir.join("model.safetensors");
    let written = safetensors::serialize_to_file(lazy, None, &model_path);
    if let Some(e) = source.failure() {
        return Err(e);
    }
    written.map_err(|e| failed("model.safetensors", &e))?;
    let mut config_json = serde_json::to_value(&cfg).map_err(bad)?;
    config_json["architectures"] = json!(["LlamaForCausalLM"]);
    config_json["torch_dtype"] = json!(if storage == Storage::F16 { "float16" } else { "float32" });
    if storage == Storage::Quantized {
        // Not a Hugging Face key: what `projection::blocks` reads, said where a person looks.
        config_json["quantization"] =
            json!(format!("GGUF {KEPT_BLOCKS} blocks kept: U8 [rows, blocks, bytes per block: 18, 20, 22, 24 or 34]"));
    }
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
    Ok(Imported { config: cfg, tensors: count, bytes, vocabulary, replaced: false, kept_as_blocks, widened })
}

/// Refuses a tensor (by its Hugging Face name) whose shape is not the one the metadata implies.
fn check_shape(cfg: &LlamaConfig, name: &str, shape: &[usize]) -> Result<(), ExecError> {
    let (h, f, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim());
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
    Ok(())
}

/// Refuses a file with another number of blocks than its metadata says.
fn check_blocks<'n>(cfg: &LlamaConfig, names: impl Iterator<Item = &'n str>) -> Result<(), ExecError> {
    let blocks = names.filter(|n| n.ends_with("mlp.down_proj.weight")).count();
    if blocks != cfg.num_hidden_layers {
        return Err(bad(format!("{blocks} blocks, the configuration says {}", cfg.num_hidden_layers)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::collections::HashMap;

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

    /// SmolLM2-135M's metadata, as far as [`config`] reads it.
    fn smollm2_metadata() -> HashMap<String, Value> {
        let tokens = Value::Array(vec![Value::String("a".into()); 49152]);
        [
            ("general.architecture", Value::String("llama".into())),
            ("llama.attention.head_count", Value::U32(9)),
            ("llama.attention.head_count_kv", Value::U32(3)),
            ("llama.embedding_length", Value::U32(576)),
            ("llama.feed_forward_length", Value::U32(1536)),
            ("llama.block_count", Value::U32(30)),
            ("llama.context_length", Value::U32(8192)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("llama.rope.freq_base", Value::F32(100_000.0)),
            ("llama.rope.dimension_count", Value::U32(64)),
            ("tokenizer.ggml.tokens", tokens),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Metadata that changes what the model computes beyond its configuration — RoPE on part of
    /// a head, heads of another width, RoPE scaling, experts — is refused, naming the key; the
    /// plain model's reads.
    #[test]
    fn metadata_not_applied_here_is_refused() {
        let content = |changes: &[(&str, Value)]| {
            let mut metadata = smollm2_metadata();
            for (k, v) in changes {
                metadata.insert(k.to_string(), v.clone());
            }
            Content {
                magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
                metadata,
                tensor_infos: HashMap::new(),
                tensor_data_offset: 0,
            }
        };
        assert_eq!(config(&content(&[])).unwrap().head_dim(), 64);
        assert!(config(&content(&[("llama.rope.scaling.type", Value::String("none".into()))])).is_ok());
        for (key, value) in [
            ("llama.rope.dimension_count", Value::U32(32)),
            ("llama.attention.key_length", Value::U32(128)),
            ("llama.rope.scaling.type", Value::String("linear".into())),
            ("llama.expert_count", Value::U32(8)),
        ] {
            let e = config(&content(&[(key, value)])).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    /// A GGUF whose tokenizer adds a beginning-of-sequence token (`add_bos_token`, as llama.cpp
    /// does when it tokenises a prompt), or an end one, gets a tokenizer that adds it; one that
    /// says neither (SmolLM2) adds nothing. Before 2026-12-05 the flags were not read.
    #[test]
    fn the_tokenizer_adds_what_the_gguf_says_around_a_text() {
        let strings = |v: &[&str]| Value::Array(v.iter().map(|t| Value::String(t.to_string())).collect());
        let tokenizer = |flags: &[(&str, bool)]| {
            let mut metadata: HashMap<String, Value> = [
                ("tokenizer.ggml.model", Value::String("gpt2".into())),
                ("tokenizer.ggml.tokens", strings(&["<unk>", "<s>", "</s>", "h", "i", "hi"])),
                ("tokenizer.ggml.merges", strings(&["h i"])),
                ("tokenizer.ggml.token_type", Value::Array([3, 3, 3, 1, 1, 1].map(Value::I32).to_vec())),
                ("tokenizer.ggml.bos_token_id", Value::U32(1)),
                ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            for &(k, on) in flags {
                metadata.insert(k.to_string(), Value::Bool(on));
            }
            let c = Content {
                magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
                metadata,
                tensor_infos: HashMap::new(),
                tensor_data_offset: 0,
            };
            let json = serde_json::to_string(&tokenizer_json(&c).unwrap()).unwrap();
            tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap()
        };
        let ids = |t: &tokenizers::Tokenizer| t.encode("hi", true).unwrap().get_ids().to_vec();
        assert_eq!(ids(&tokenizer(&[])), [5]);
        assert_eq!(ids(&tokenizer(&[("tokenizer.ggml.add_bos_token", false)])), [5]);
        assert_eq!(ids(&tokenizer(&[("tokenizer.ggml.add_bos_token", true)])), [1, 5]);
        let both = [("tokenizer.ggml.add_bos_token", true), ("tokenizer.ggml.add_eos_token", true)];
        assert_eq!(ids(&tokenizer(&both)), [1, 5, 2]);
        // Special tokens in the text are still recognised, and not added twice by the template.
        assert_eq!(tokenizer(&both).encode("<s>hi", true).unwrap().get_ids(), [1, 1, 5, 2]);
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
        let e = import(Path::new("/nonexistent.gguf"), Path::new("/tmp/x"), Storage::F32, |_, _, _| {}).unwrap_err();
        assert!(e.to_string().contains("/nonexistent.gguf"), "{e}");
        let dir = std::env::temp_dir().join(format!("cascade-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("not.gguf");
        std::fs::write(&f, b"GGUF\x03\0\0\0garbage").unwrap();
        assert!(import(&f, &dir.join("out"), Storage::F32, |_, _, _| {}).is_err());
        assert!(import(&f, &dir.join("out"), Storage::Quantized, |_, _, _| {}).is_err());
        assert!(!dir.join("out").exists(), "nothing is written for a refused file");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["not.gguf"], "no staging directory is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
