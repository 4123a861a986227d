//! The real SmolLM2-135M-Instruct (GGUF Q4_1, imported) against greedy tokens from an independent
//! implementation (`testdata/smollm2_reference.py`: the `gguf` package's dequantization, GGUF's
//! own Q/K layout with interleaved RoPE, its own BPE, numpy). Skips, saying so, without the model
//! (`.ci/run` fetches it with `scripts/fetch-smollm2.sh`).
//!
//! Float and quantized arithmetic may break a near-tie differently, so free-running generation is
//! compared up to the reference's first step whose top-2 margin is below 0.3 (the rule);
//! teacher-forced, every step with a margin of at least 0.3 must choose the reference's token.
#![allow(clippy::unwrap_used)]

mod common;

use common::{llm_reference, smollm2_dir};

use cascade_exec::gguf::Storage;
use cascade_exec::llama::generate::{greedy, Generator};
use cascade_exec::llama::{Llama, LlamaConfig};
use cascade_exec::weights::Weights;
use cascade_exec::{Activation, ExecError, LayerExec};

const NEAR_TIE: f32 = 0.3;

fn load() -> Option<Generator> {
    Some(Generator::from_dir(&smollm2_dir()?).unwrap())
}

#[test]
fn greedy_tokens_match_the_independent_reference() {
    let Some(g) = load() else { return };
    let refs = llm_reference();
    let prompts: Vec<Vec<u32>> = refs.iter().map(|r| g.encode(&r.prompt).unwrap()).collect();
    for (r, p) in refs.iter().zip(&prompts) {
        assert_eq!(p, &r.prompt_tokens, "tokens of {:?}", r.prompt);
    }
    // All prompts in one packed batch (prefills of different lengths, then batched decode steps).
    let out = g.generate(&prompts, 32).unwrap();
    let mut compared = 0;
    for (r, o) in refs.iter().zip(&out) {
        let tie = r.margins.iter().position(|&m| m < NEAR_TIE).unwrap_or(r.tokens.len());
        let same = o.tokens.iter().zip(&r.tokens).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{:?}: {} of {} tokens as the reference; first near-tie at step {tie} (margin {:?}); {:?}",
            r.prompt,
            same,
            r.tokens.len(),
            r.margins.get(tie),
            g.decode(&o.tokens).unwrap()
        );
        assert!(same >= tie, "{:?}: differs at step {same}, before the first near-tie at {tie}", r.prompt);
        compared += tie;
        // Alone, a prompt gives what it gave in the batch.
        assert_eq!(g.generate(std::slice::from_ref(&o.prompt_tokens), 32).unwrap()[0].tokens, o.tokens);
    }
    assert!(compared > 0);
}

#[test]
fn teacher_forced_choices_and_margins_match_the_reference() {
    let Some(g) = load() else { return };
    let m = g.model();
    let layers = m.layers();
    let mut checked = 0;
    for (i, r) in llm_reference().iter().enumerate() {
        let seq = 1000 + i as u64;
        let mut act = Activation::packed(&[(seq, 0, r.prompt_tokens.clone())]).unwrap();
        for (step, (&want, (&second, &margin))) in r.tokens.iter().zip(r.seconds.iter().zip(&r.margins)).enumerate() {
            let pos = (r.prompt_tokens.len() + step) as u32;
            let out = m.run(0..layers, act).unwrap();
            let logits = out.hidden.unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap().remove(0);
            let best = logits.iter().enumerate().fold(0, |b, (j, &x)| if x > logits[b] { j } else { b });
            let gap = logits[want as usize] - logits[second as usize];
            assert!((gap - margin).abs() < 0.05, "{:?} step {step}: gap {gap}, the reference's {margin}", r.prompt);
            if margin >= NEAR_TIE {
                assert_eq!(best as u32, want, "{:?} step {step} (margin {margin})", r.prompt);
                checked += 1;
            }
            act = Activation::packed(&[(seq, pos, vec![want])]).unwrap();
        }
        assert!(m.free(seq));
    }
    eprintln!("{checked} teacher-forced steps with a margin of at least {NEAR_TIE} chose the reference's token");
    assert!(checked >= 80);
}

/// Stages `[0, k)` on one executor and `[k, L)` on another, the activation between them as bytes:
/// the same tokens as one executor.
#[test]
fn a_split_model_generates_the_same_tokens() {
    let Some(dir) = smollm2_dir() else { return };
    let g = Generator::from_dir(&dir).unwrap();
    let cfg = LlamaConfig::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let w = Weights::file(g.manifest(), &bytes).unwrap();
    let l = cfg.stages();
    let k = 13;
    let front = Llama::load(cfg.clone(), &w, 0..k).unwrap();
    let back = Llama::load(cfg.clone(), &w, k..l).unwrap();
    let prompts: Vec<Vec<u32>> = llm_reference().iter().map(|r| r.prompt_tokens.clone()).collect();
    let split = greedy(
        |a| {
            let mid = front.run(0..k, a)?;
            back.run(k..l, Activation::from_bytes(&mid.to_bytes()?)?)
        },
        &prompts,
        1,
        24,
        cfg.eos_token_id,
        cfg.max_position_embeddings,
    )
    .unwrap();
    let whole = g.generate(&prompts, 24).unwrap();
    assert_eq!(split, whole);
    // Each half holds the cache of its own blocks only.
    assert_eq!(front.cache().len(1, k - 2), whole[0].prompt_tokens.len() + whole[0].tokens.len() - 1);
    assert_eq!(back.cache().len(1, k - 2), 0);
    // A half refuses the other's stages: they are not resident there.
    assert!(matches!(
        front.run(k..k + 1, Activation::packed(&[(9, 0, vec![1])]).unwrap()),
        Err(ExecError::OutOfOrder { .. })
    ));
    let mut at_k = Activation::packed(&[(9, 0, vec![1])]).unwrap();
    at_k.next_layer = k;
    assert!(matches!(front.run(k..k + 1, at_k), Err(ExecError::NotResident { layer }) if layer == k));
}

#[test]
fn bad_batches_are_refused_and_leave_the_cache_alone() {
    let Some(g) = load() else { return };
    let m = g.model();
    let l = m.layers();
    let seq = 77;
    m.run(0..l, Activation::packed(&[(seq, 0, vec![504, 3575])]).unwrap()).unwrap();
    // Continuing at the wrong position.
    let e = m.run(0..l, Activation::packed(&[(seq, 5, vec![282])]).unwrap()).unwrap_err();
    assert!(e.to_string().contains("continues at 5"), "{e}");
    // A token past the vocabulary.
    let e = m.run(0..l, Activation::packed(&[(seq, 2, vec![1 << 20])]).unwrap()).unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
    // Past the context.
    let e = m.run(0..l, Activation::packed(&[(seq + 1, 8190, vec![1, 2, 3])]).unwrap()).unwrap_err();
    assert!(e.to_string().contains("at most 8192"), "{e}");
    assert_eq!(m.cache().len(seq, 0), 2);
    assert_eq!(m.cache().len(seq, 29), 2);
    // The right position still works.
    m.run(0..l, Activation::packed(&[(seq, 2, vec![282])]).unwrap()).unwrap();
    assert_eq!(m.cache().len(seq, 29), 3);
    assert!(m.free(seq) && !m.free(seq));
}

/// The f32 model's directory, its GGUF, and a fresh import of that GGUF as `storage`.
struct Imported {
    dir: std::path::PathBuf,
    gguf: std::path::PathBuf,
    out: std::path::PathBuf,
    imported: cascade_exec::gguf::Imported,
}

/// [`Imported`], or `None` after saying that the test skips (no model, or no GGUF beside it).
fn import_as(storage: Storage) -> Option<Imported> {
    let dir = smollm2_dir()?;
    let gguf = dir.parent().unwrap().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        eprintln!("SKIPPED: no GGUF beside {}", dir.display());
        return None;
    }
    let out = std::env::temp_dir().join(format!("cascade-{storage:?}-{}", std::process::id()));
    let imported = cascade_exec::gguf::import(&gguf, &out, storage, |_, _, _| {}).unwrap();
    Some(Imported { dir, gguf, out, imported })
}

/// An f16 import loads and, rounded as it is, agrees with the reference up to the first near-tie.
#[test]
fn an_f16_import_agrees_with_the_reference_until_the_first_near_tie() {
    let Some(Imported { dir, gguf, out, imported }) = import_as(Storage::F16) else { return };
    let f32_bytes = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    assert!(imported.bytes < f32_bytes / 2 + (1 << 20), "{} vs {f32_bytes}", imported.bytes);
    assert!(!imported.replaced);
    // The model file has the mode the other files got (before 2026-12-05 it kept the 0600 of
    // the temporary file safetensors writes through).
    let mode =
        |f: &str| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(out.join(f)).unwrap().permissions());
    assert_eq!(mode("model.safetensors"), mode("config.json"));
    let g = Generator::from_dir(&out).unwrap();
    for r in llm_reference() {
        let tie = r.margins.iter().position(|&m| m < NEAR_TIE).unwrap_or(r.tokens.len());
        let got = g.generate(std::slice::from_ref(&r.prompt_tokens), tie.max(1)).unwrap().remove(0).tokens;
        assert_eq!(got[..tie], r.tokens[..tie], "{:?}", r.prompt);
    }
    // Imported again over itself: replaced whole, with nothing left beside it.
    drop(g);
    let again = cascade_exec::gguf::import(&gguf, &out, Storage::F16, |_, _, _| {}).unwrap();
    assert!(again.replaced);
    assert_eq!(std::fs::metadata(out.join("model.safetensors")).unwrap().len(), imported.bytes);
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    let beside: Vec<_> = std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&name) && *n != name)
        .collect();
    assert!(beside.is_empty(), "left beside the model: {beside:?}");
    std::fs::remove_dir_all(&out).unwrap();
}

/// An import that keeps the GGUF's Q4_1 and Q8_0 blocks is under a fifth of the f32 import's
/// bytes and computes what the f32 import computes, bit for bit: the same hidden states after a
/// prefill of several prompts and a decode step, and the same greedy tokens for the reference's
/// prompts.
#[test]
fn a_quantized_import_computes_what_the_f32_import_computes() {
    let Some(Imported { dir, out, imported, .. }) = import_as(Storage::Quantized) else { return };
    let f32_bytes = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    assert!(imported.bytes < f32_bytes / 5, "{} vs {f32_bytes}", imported.bytes);
    // Its 210 Q4_1 matrices and its Q8_0 embedding kept as blocks; no other quantized type.
    assert_eq!((imported.kept_as_blocks, imported.widened.len()), (211, 0), "{:?}", imported.widened);
    let (q, f) = (Generator::from_dir(&out).unwrap(), Generator::from_dir(&dir).unwrap());
    let bits = |g: &Generator, act: Activation| -> Vec<u32> {
        let h = g.model().run(0..g.model().layers(), act).unwrap().hidden.unwrap();
        h.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    let refs = llm_reference();
    let prefill: Vec<(u64, u32, Vec<u32>)> =
        refs.iter().enumerate().map(|(i, r)| (i as u64, 0, r.prompt_tokens.clone())).collect();
    let step: Vec<(u64, u32, Vec<u32>)> =
        refs.iter().enumerate().map(|(i, r)| (i as u64, r.prompt_tokens.len() as u32, vec![r.tokens[0]])).collect();
    for (act, what) in [(&prefill, "prefill"), (&step, "decode step")] {
        let (a, b) = (Activation::packed(act).unwrap(), Activation::packed(act).unwrap());
        assert!(bits(&q, a) == bits(&f, b), "{what}: the hidden states differ");
    }
    for i in 0..refs.len() as u64 {
        assert!(q.model().free(i) && f.model().free(i));
    }
    let prompts: Vec<Vec<u32>> = refs.iter().map(|r| r.prompt_tokens.clone()).collect();
    let (tq, tf) = (q.generate(&prompts, 32).unwrap(), f.generate(&prompts, 32).unwrap());
    for ((a, b), r) in tq.iter().zip(&tf).zip(&refs) {
        assert_eq!(a.tokens, b.tokens, "{:?}", r.prompt);
    }
    drop(q);
    std::fs::remove_dir_all(&out).unwrap();
}

/// A prompt longer than `ATTENTION_ROWS` is prefilled in blocks of query rows, each against the
/// keys it may see: its logits equal those of feeding the prompt one token at a time (each step's
/// attention whole), within float rounding, and a prefill split in two segments at another
/// boundary agrees as well.
#[test]
fn a_long_prompt_prefilled_in_blocks_gives_the_logits_of_one_token_at_a_time() {
    let Some(g) = load() else { return };
    let m = g.model();
    let layers = m.layers();
    let text = "The pool keeps k copies of every model and repairs itself when a node dies. ".repeat(18);
    let prompt = g.encode(&text).unwrap();
    let n = prompt.len();
    assert!(n > cascade_exec::llama::ATTENTION_ROWS + 10, "{n} tokens: more than one block");
    let last = |act: Activation| -> Vec<f32> {
        m.run(0..layers, act).unwrap().hidden.unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap().remove(0)
    };
    let whole = last(Activation::packed(&[(1, 0, prompt.clone())]).unwrap());
    assert!(m.free(1));
    // Split at 100: the second segment's blocks start at position 100.
    last(Activation::packed(&[(2, 0, prompt[..100].to_vec())]).unwrap());
    let split = last(Activation::packed(&[(2, 100, prompt[100..].to_vec())]).unwrap());
    assert!(m.free(2));
    let mut stepped = Vec::new();
    for (pos, &t) in prompt.iter().enumerate() {
        stepped = last(Activation::packed(&[(3, pos as u32, vec![t])]).unwrap());
    }
    assert!(m.free(3));
    let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |b, (j, &x)| if x > v[b] { j } else { b });
    for (what, other) in [("split", &split), ("one token at a time", &stepped)] {
        let worst = whole.iter().zip(other.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-3, "{what}: logits differ by up to {worst}");
        assert_eq!(argmax(&whole), argmax(other), "{what}");
    }
}

/// A prompt prefilled in chunks (a chunk per step, as `Generator` does with prompts over
/// `PREFILL_CHUNK`) generates what it generates prefilled at once, beside a short prompt that
/// decodes between the chunks.
#[test]
fn a_prompt_prefilled_in_chunks_generates_the_tokens_of_one_prefill() {
    use cascade_exec::llama::generate::{greedy_running, GreedyLimits};
    let Some(g) = load() else { return };
    let m = g.model();
    let layers = m.layers();
    let long =
        g.encode(&"The pool keeps k copies of every model and repairs itself when a node dies. ".repeat(18)).unwrap();
    let prompts = vec![long, g.encode("What is the capital of France?").unwrap()];
    let cfg = m.config();
    let run = |seq_base: u64, prefill_chunk: usize| {
        let limits = GreedyLimits {
            prefill_chunk,
            ..GreedyLimits::all_at_once(seq_base, 8, cfg.eos_token_id, cfg.max_position_embeddings)
        };
        greedy_running(
            |a| m.run(0..layers, a),
            &prompts,
            limits,
            |_, _| {},
            |i, _| {
                m.free(seq_base + i as u64);
            },
        )
        .unwrap()
    };
    let whole = run(100, usize::MAX);
    let chunked = run(200, 100);
    assert!(prompts[0].len() > 250, "{} tokens: three chunks at least", prompts[0].len());
    assert_eq!(chunked, whole);
}

/// Every kept block type computes what the f32 import computes, and a type not kept is said:
/// the real GGUF with a few matrices requantized — a Q projection to Q4_0 (its rows un-permuted
/// whole), others to Q5_0 and Q5_1, one `ffn_down` to Q4_K — imports with 210 matrices kept as
/// blocks and the Q4_K one counted as widened to f32 (`cascade model import` prints it), and its
/// hidden states after a prefill are those of the same file's f32 import, bit for bit.
#[test]
fn a_mixed_quantized_import_computes_what_its_f32_import_computes_and_counts_what_it_widens() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::Device;
    let Some(dir) = smollm2_dir() else { return };
    let gguf = dir.parent().unwrap().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        eprintln!("SKIPPED: no GGUF beside {}", dir.display());
        return;
    }
    let mut r = std::io::BufReader::new(std::fs::File::open(&gguf).unwrap());
    let content = gguf_file::Content::read(&mut r).unwrap();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in content.tensor_infos.keys() {
        let mut q = content.tensor(&mut r, name, &Device::Cpu).unwrap();
        let to = match name.as_str() {
            "blk.3.ffn_down.weight" => Some(GgmlDType::Q4K),
            "blk.4.attn_q.weight" => Some(GgmlDType::Q4_0),
            "blk.5.attn_k.weight" => Some(GgmlDType::Q5_0),
            "blk.6.ffn_up.weight" => Some(GgmlDType::Q5_1),
            _ => None,
        };
        if let Some(to) = to {
            q = QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), to).unwrap();
        }
        tensors.push((name.clone(), q));
    }
    let mixed = std::env::temp_dir().join(format!("cascade-q4k-{}.gguf", std::process::id()));
    {
        let meta: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
        gguf_file::write(&mut std::fs::File::create(&mixed).unwrap(), &meta, &named).unwrap();
    }
    let out = std::env::temp_dir().join(format!("cascade-q4k-import-{}", std::process::id()));
    let imported = cascade_exec::gguf::import(&mixed, &out, Storage::Quantized, |_, _, _| {}).unwrap();
    assert_eq!(imported.kept_as_blocks, 210);
    assert_eq!(imported.widened.into_iter().collect::<Vec<_>>(), [("Q4K".to_string(), 1)]);
    let wide = std::env::temp_dir().join(format!("cascade-q4k-f32-{}", std::process::id()));
    cascade_exec::gguf::import(&mixed, &wide, Storage::F32, |_, _, _| {}).unwrap();
    let bits = |dir: &std::path::Path| -> Vec<u32> {
        let g = Generator::from_dir(dir).unwrap();
        let act = Activation::packed(&[(1, 0, llm_reference()[0].prompt_tokens.clone())]).unwrap();
        let h = g.model().run(0..g.model().layers(), act).unwrap().hidden.unwrap();
        h.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    assert_eq!(bits(&out), bits(&wide), "the quantized import computes otherwise than the f32 one");
    let _ = std::fs::remove_file(&mixed);
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&wide);
}
