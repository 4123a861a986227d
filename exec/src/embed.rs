//! Sentence embeddings end to end: a model directory (`model.safetensors`, `tokenizer.json`,
//! `config.json`, `sentence_bert_config.json` as sentence-transformers ships them) → tokens (cut
//! to sentence-transformers' `max_seq_length`) → every BERT stage → pooling as `modules.json`
//! says (all-MiniLM-L6-v2's mean and L2 normalisation without it: [`crate::pooling`]). A prompt
//! that `config_sentence_transformers.json` makes the default goes before every text
//! ([`crate::prompts`]).

use std::path::{Path, PathBuf};

use cascade_param_pool::files::MappedFile;
use cascade_param_pool::manifest::Manifest;
use tokenizers::{Encoding, Tokenizer, TruncationParams};

use crate::bert::{Bert, BertConfig};
use crate::pooling::Pooling;
use crate::prompts::{Prompt, Prompts};
use crate::tokens;
use crate::weights::Weights;
use crate::{Activation, ExecError, LayerExec};

/// A loaded sentence-embedding model.
pub struct Embedder {
    tokenizer: Tokenizer,
    model: Bert,
    manifest: Manifest,
    pooling: Pooling,
    prompts: Prompts,
    /// The prompt put before every text: the model's default one unless another is chosen.
    prompt: Option<Prompt>,
}

/// The files of a model directory.
fn file(dir: &Path, name: &str) -> Result<PathBuf, ExecError> {
    let p = dir.join(name);
    if p.is_file() {
        Ok(p)
    } else {
        Err(ExecError::Model(format!("{} is missing", p.display())))
    }
}

impl Embedder {
    /// Loads `dir`: `model.safetensors` and `tokenizer.json`; `config.json` if present (else
    /// all-MiniLM-L6-v2's); the prompts of `config_sentence_transformers.json`, its default one
    /// put before every text ([`crate::prompts`]).
    pub fn from_dir(dir: &Path) -> Result<Embedder, ExecError> {
        let d = read_dir(dir)?;
        let model = Bert::load(d.config, &Weights::file(&d.manifest, &d.bytes)?)?;
        Ok(Embedder {
            tokenizer: d.tokenizer,
            model,
            manifest: d.manifest,
            pooling: d.pooling,
            prompts: d.prompts,
            prompt: d.prompt,
        })
    }

    /// The model's named prompts (`config_sentence_transformers.json`).
    pub fn prompts(&self) -> &Prompts {
        &self.prompts
    }

    /// The prompt put before every text, if any.
    pub fn prompt(&self) -> Option<&Prompt> {
        self.prompt.as_ref()
    }

    /// Puts the model's prompt `name` before every text from now on (sentence-transformers'
    /// `encode(prompt_name=…)`); a name the model does not have is refused, naming its prompts.
    pub fn use_prompt_named(&mut self, name: &str) -> Result<(), ExecError> {
        let text = self.prompts.get(name)?.to_string();
        self.use_prompt(&text)
    }

    /// Puts `text` before every text from now on (sentence-transformers' `encode(prompt=…)`); an
    /// empty one puts nothing, the model's default prompt included.
    pub fn use_prompt(&mut self, text: &str) -> Result<(), ExecError> {
        self.prompt = Prompt::new(&self.tokenizer, text, self.pooling.include_prompt)?;
        Ok(())
    }

    /// `texts`' encodings, the prompt before each.
    fn encodings(&self, texts: &[&str]) -> Result<Vec<Encoding>, ExecError> {
        Prompt::applied(self.prompt.as_ref(), texts, |t| encodings(&self.tokenizer, t))
    }

    /// The tokenizer of `path`, padding turned off (batches are padded to their longest input).
    pub fn tokenizer(path: &Path) -> Result<Tokenizer, ExecError> {
        let mut t = Tokenizer::from_file(path).map_err(|e| ExecError::Model(format!("{}: {e}", path.display())))?;
        t.with_padding(None);
        Ok(t)
    }

    /// The model.
    pub fn model(&self) -> &Bert {
        &self.model
    }

    /// The model's manifest (built from the file).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The most tokens of a text the model sees (with `[CLS]` and `[SEP]`); longer texts are cut
    /// to their first ones, as sentence-transformers does. `None`: the tokenizer cuts nothing.
    pub fn max_tokens(&self) -> Option<usize> {
        self.tokenizer.get_truncation().map(|t| t.max_length)
    }

    /// Whether each text is longer than [`Embedder::max_tokens`] and so embedded from its start
    /// only.
    pub fn truncated(&self, texts: &[&str]) -> Result<Vec<bool>, ExecError> {
        Ok(self.encodings(texts)?.iter().map(was_cut).collect())
    }

    /// `texts` as a batch before its first layer (padded to the longest, mask 0 on padding), the
    /// prompt before each.
    pub fn batch(&self, texts: &[&str]) -> Result<Activation, ExecError> {
        padded(&self.encodings(texts)?.iter().collect::<Vec<_>>())
    }

    /// One embedding per text (unit length where the model normalises: all-MiniLM-L6-v2 does).
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, ExecError> {
        self.embed_noting_cuts(texts).map(|(v, _)| v)
    }

    /// One embedding per text, and whether each text was cut
    /// ([`Embedder::truncated`]), from one tokenisation; computed [`BATCH`] texts at a time
    /// ([`Embedder::embed_in_batches`]).
    pub fn embed_noting_cuts(&self, texts: &[&str]) -> Result<(Vec<Vec<f32>>, Vec<bool>), ExecError> {
        self.embed_in_batches(texts, BATCH, |_, _| {})
    }

    /// [`Embedder::embed_noting_cuts`] with at most `batch` texts per forward pass, calling
    /// `progress(texts done, texts)` after each pass.
    ///
    /// Up to `batch` texts run as one batch in their order. More are sorted by token count,
    /// longest first, and cut into batches of `batch`, each padded only to its own longest
    /// text, as sentence-transformers' `encode` does. So memory stays bounded, and a long text
    /// does not pad every short one. A pass also holds at most [`PASS_CELLS`] attention cells
    /// (texts × padded tokens²; [`passes`]): a large `batch` runs many short texts at once but
    /// long ones no more than [`BATCH`] at a time. Embeddings come back in the texts' order. A
    /// text's embedding does not depend on its batch beyond float rounding (padding is masked).
    pub fn embed_in_batches(
        &self,
        texts: &[&str],
        batch: usize,
        progress: impl FnMut(usize, usize),
    ) -> Result<(Vec<Vec<f32>>, Vec<bool>), ExecError> {
        let enc = self.encodings(texts)?;
        Ok((self.embed_encoded(&enc, batch, progress)?, enc.iter().map(was_cut).collect()))
    }

    /// One embedding per text, in [`BATCH`]es as [`Embedder::embed_noting_cuts`] computes them,
    /// and the tokens each was embedded from (its prompt's, `[CLS]` and `[SEP]` among them, after
    /// [`Embedder::max_tokens`] cut it), from one tokenisation.
    pub fn embed_counting_tokens(&self, texts: &[&str]) -> Result<(Vec<Vec<f32>>, Vec<usize>), ExecError> {
        let enc = self.encodings(texts)?;
        Ok((self.embed_encoded(&enc, BATCH, |_, _| {})?, enc.iter().map(|e| e.get_ids().len()).collect()))
    }

    /// [`Embedder::embed_in_batches`] of texts already tokenised.
    fn embed_encoded(
        &self,
        enc: &[Encoding],
        batch: usize,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Vec<Vec<f32>>, ExecError> {
        if batch == 0 {
            return Err(ExecError::Input("a batch of 0 texts".into()));
        }
        let lens: Vec<usize> = enc.iter().map(|e| e.get_ids().len()).collect();
        let mut out = vec![Vec::new(); enc.len()];
        let mut done = 0;
        for part in passes(&lens, batch, PASS_CELLS) {
            let part = &part[..];
            let rows: Vec<&Encoding> = part.iter().map(|&i| &enc[i]).collect();
            let act = self.model.run(0..self.model.layers(), padded(&rows)?)?;
            for (&i, v) in part.iter().zip(self.pooling.pool(&act, Prompt::skip(self.prompt.as_ref()))?) {
                out[i] = v;
            }
            done += part.len();
            progress(done, enc.len());
        }
        Ok(out)
    }
}

/// Texts per forward pass when many are embedded at once: sentence-transformers' default
/// `batch_size`. A batch of 1,400 texts of 256 tokens in one pass took 13.8 GB and 171 s here.
pub const BATCH: usize = 32;

/// The most attention cells (texts × padded tokens²) one forward pass holds: [`BATCH`] texts at
/// sentence-transformers' cut of 256 tokens, about 0.5 GB here. Measured on 256 texts of 256
/// tokens, passes of 32, 128 and 256 such texts took 0.50, 1.60 and 3.07 GB (and 23, 29 and 30 s):
/// a pass of 4,096 would have needed some 47 GB. Texts of 10 tokens fit 20,000 to a pass.
pub const PASS_CELLS: usize = BATCH * 256 * 256;

/// The forward passes for texts of `lens` tokens: indices into `lens`, at most `batch` texts and
/// at most `cells` attention cells (texts × the pass's longest² — a text longer than that runs
/// alone) each. All of them in their order when they fit one pass; otherwise sorted longest
/// first, so that each pass pads to about its own length.
pub fn passes(lens: &[usize], batch: usize, cells: usize) -> Vec<Vec<usize>> {
    let batch = batch.max(1);
    let fits =
        |rows: usize, longest: usize| rows <= batch && rows.saturating_mul(longest.saturating_mul(longest)) <= cells;
    let longest = lens.iter().copied().max().unwrap_or(0);
    if fits(lens.len(), longest) {
        return if lens.is_empty() { Vec::new() } else { vec![(0..lens.len()).collect()] };
    }
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut out: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match out.last_mut() {
            // Sorted longest first: a pass's first text is its longest.
            Some(pass) if fits(pass.len() + 1, lens[pass[0]]) => pass.push(i),
            _ => out.push(vec![i]),
        }
    }
    out
}

/// A model directory's files: its `config.json` text (if any), tokenizer, manifest (1 MiB
/// chunks) and safetensors bytes.
pub(crate) struct ModelFiles {
    pub(crate) config: Option<String>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) manifest: Manifest,
    /// The safetensors file, mapped (not read into memory: tensors built from it would hold the
    /// model twice).
    pub(crate) bytes: MappedFile,
}

/// What [`read_files_while`]'s work is given while the manifest's hashes are computed.
pub(crate) struct Loading<'a> {
    pub(crate) config: Option<&'a str>,
    /// The manifest's layout: its content hash and chunk crcs are not computed yet (empty).
    pub(crate) layout: &'a Manifest,
    pub(crate) bytes: &'a [u8],
}

/// Reads `dir`'s `model.safetensors`, `tokenizer.json`, `config.json` (optional) and
/// `sentence_bert_config.json` (optional: [`sentence_bert`]).
pub(crate) fn read_files(dir: &Path) -> Result<ModelFiles, ExecError> {
    Ok(read_files_while(dir, |_| ())?.0)
}

/// [`read_files`], running `work` (a model's loading) while the manifest's content hash and
/// chunk crcs are computed on another thread ([`Manifest::from_bytes_while`]).
pub(crate) fn read_files_while<R>(
    dir: &Path,
    work: impl FnOnce(Loading<'_>) -> R,
) -> Result<(ModelFiles, R), ExecError> {
    let weights_path = file(dir, "model.safetensors")?;
    let mut tokenizer = Embedder::tokenizer(&file(dir, "tokenizer.json")?)?;
    sentence_bert(dir, &mut tokenizer)?;
    let config = read_optional(&dir.join("config.json"))?;
    let bytes = MappedFile::open(&weights_path)
        .map_err(|e| ExecError::Model(format!("reading {}: {e}", weights_path.display())))?;
    let name = dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    // The manifest's errors name the file.
    let (manifest, done) =
        Manifest::from_bytes_while(&bytes, &name, 1 << 20, &weights_path.to_string_lossy(), |layout| {
            work(Loading { config: config.as_deref(), layout, bytes: &bytes })
        })
        .map_err(|e| ExecError::Model(e.to_string()))?;
    Ok((ModelFiles { config, tokenizer, manifest, bytes }, done))
}

/// The text of an optional file of a model directory: `None` when it is not there.
fn read_optional(path: &Path) -> Result<Option<String>, ExecError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ExecError::Model(format!("{}: {e}", path.display()))),
    }
}

/// Applies `dir/sentence_bert_config.json`, if the file is there, to `tokenizer` as
/// sentence-transformers' `Transformer` module does: `max_seq_length` replaces the cut
/// `tokenizer.json` sets (all-MiniLM-L6-v2's says 128, sentence-transformers uses 256), and
/// `do_lower_case` lowercases every text before the tokenizer sees it.
fn sentence_bert(dir: &Path, tokenizer: &mut Tokenizer) -> Result<(), ExecError> {
    #[derive(serde::Deserialize)]
    struct SentenceBertConfig {
        max_seq_length: usize,
        #[serde(default)]
        do_lower_case: bool,
    }
    let path = dir.join("sentence_bert_config.json");
    let Some(text) = read_optional(&path)? else { return Ok(()) };
    let c: SentenceBertConfig =
        serde_json::from_str(&text).map_err(|e| ExecError::Model(format!("{}: {e}", path.display())))?;
    let max = c.max_seq_length;
    if max < 2 {
        return Err(ExecError::Model(format!(
            "{}: max_seq_length {max} leaves no room for a token beside [CLS] and [SEP]",
            path.display()
        )));
    }
    let cut = TruncationParams { max_length: max, ..tokenizer.get_truncation().cloned().unwrap_or_default() };
    tokenizer.with_truncation(Some(cut)).map_err(|e| ExecError::Model(format!("truncation to {max} tokens: {e}")))?;
    if c.do_lower_case {
        use tokenizers::normalizers::{Lowercase, NormalizerWrapper, Sequence};
        let lower = NormalizerWrapper::Lowercase(Lowercase);
        let normalizer = match tokenizer.get_normalizer().cloned() {
            Some(n) => NormalizerWrapper::Sequence(Sequence::new(vec![lower, n])),
            None => lower,
        };
        tokenizer
            .with_normalizer(Some(normalizer))
            .map_err(|e| ExecError::Model(format!("{}: do_lower_case: {e}", path.display())))?;
    }
    Ok(())
}

/// A BERT model directory, read.
pub(crate) struct BertDir {
    /// Its configuration (all-MiniLM-L6-v2's without `config.json`).
    pub(crate) config: BertConfig,
    /// Its pooling (`modules.json`'s, all-MiniLM-L6-v2's without it: [`Pooling::from_dir`]).
    pub(crate) pooling: Pooling,
    /// Its named prompts.
    pub(crate) prompts: Prompts,
    /// Its default prompt, as applied.
    pub(crate) prompt: Option<Prompt>,
    /// Its tokenizer, cut as `sentence_bert_config.json` says.
    pub(crate) tokenizer: Tokenizer,
    /// Where each tensor lies in the file.
    pub(crate) manifest: Manifest,
    /// The safetensors file, mapped.
    pub(crate) bytes: MappedFile,
}

/// Reads the BERT model directory `dir`.
pub(crate) fn read_dir(dir: &Path) -> Result<BertDir, ExecError> {
    let f = read_files(dir)?;
    let mut cfg = match &f.config {
        Some(text) => BertConfig::from_json(text)?,
        None => BertConfig::minilm_l6(),
    };
    // A checkpoint saved from a `BertFor…` model names the encoder's tensors `bert.…`.
    let named = |n: &str| f.manifest.layers.iter().flat_map(|l| &l.tensors).any(|t| t.name == n);
    if !named("embeddings.word_embeddings.weight") && named("bert.embeddings.word_embeddings.weight") {
        cfg.tensor_prefix = "bert.".into();
    }
    if let Some(t) = f.tokenizer.get_truncation() {
        if t.max_length > cfg.max_position_embeddings {
            return Err(ExecError::Model(format!(
                "{}: texts are cut at {} tokens, but the model has {} positions",
                dir.display(),
                t.max_length,
                cfg.max_position_embeddings
            )));
        }
    }
    let pooling = Pooling::from_dir(dir, cfg.hidden_size)?;
    let prompts = Prompts::from_dir(dir)?;
    let prompt = match prompts.default_text() {
        Some(text) => Prompt::new(&f.tokenizer, text, pooling.include_prompt)?,
        None => None,
    };
    Ok(BertDir { config: cfg, pooling, prompts, prompt, tokenizer: f.tokenizer, manifest: f.manifest, bytes: f.bytes })
}

/// `texts` tokenised into a batch as they are, no prompt put before them (see [`Embedder::batch`]).
pub fn tokenize(tokenizer: &Tokenizer, texts: &[&str]) -> Result<Activation, ExecError> {
    let enc = encodings(tokenizer, texts)?;
    padded(&enc.iter().collect::<Vec<_>>())
}

/// `texts` tokenised (at least one). A text longer than [`tokens::FIRST`] bytes that the
/// tokenizer cuts is tokenised only as far as the cut needs ([`tokens::encode_enough`]): the same
/// tokens, and still marked as cut, in work bounded by the cut instead of the text.
fn encodings(tokenizer: &Tokenizer, texts: &[&str]) -> Result<Vec<Encoding>, ExecError> {
    if texts.is_empty() {
        return Err(ExecError::Input("no text to embed".into()));
    }
    let batch = |texts: Vec<&str>| {
        tokenizer.encode_batch(texts, true).map_err(|e| ExecError::Input(format!("tokenising: {e}")))
    };
    let long = |t: &&str| t.len() > tokens::FIRST;
    if tokenizer.get_truncation().is_none() || !texts.iter().any(long) {
        return batch(texts.to_vec());
    }
    let mut short = batch(texts.iter().copied().filter(|t| !long(t)).collect())?.into_iter();
    texts
        .iter()
        .map(|t| match long(t) {
            true => tokens::encode_enough(tokenizer, t, true, tokens::FIRST, was_cut).map(|e| e.encoding),
            false => short.next().ok_or_else(|| ExecError::Input("a text was not tokenised".into())),
        })
        .collect()
}

/// Whether the tokenizer cut the text.
fn was_cut(e: &Encoding) -> bool {
    !e.get_overflowing().is_empty()
}

/// `rows` as a batch before the first layer, padded to the longest (mask 0 on padding).
fn padded(rows: &[&Encoding]) -> Result<Activation, ExecError> {
    let longest = rows.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
    let pad = |v: &[u32]| {
        let mut v = v.to_vec();
        v.resize(longest, 0);
        v
    };
    let ids = rows.iter().map(|e| pad(e.get_ids())).collect();
    let mask = rows.iter().map(|e| pad(e.get_attention_mask())).collect();
    Activation::new(ids, mask)
}

/// The sentences of `testdata/minilm_reference.json` with their reference embeddings, computed
/// by an independent implementation (numpy, float64; see `testdata/minilm_reference.py`): what a
/// demonstration checks served embeddings against.
pub fn reference_sentences() -> Result<Vec<(String, Vec<f32>)>, ExecError> {
    #[derive(serde::Deserialize)]
    struct Sentence {
        text: String,
        embedding: Vec<f32>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        sentences: Vec<Sentence>,
    }
    let f: File = serde_json::from_str(include_str!("../testdata/minilm_reference.json"))
        .map_err(|e| ExecError::Model(format!("reference sentences: {e}")))?;
    Ok(f.sentences.into_iter().map(|s| (s.text, s.embedding)).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{passes, sentence_bert, Tokenizer};

    /// Passes hold at most `batch` texts and `cells` attention cells; texts that fit one pass
    /// keep their order; every text is in exactly one pass.
    #[test]
    fn passes_are_bounded_by_texts_and_attention_cells() {
        assert_eq!(passes(&[3, 9, 4], 8, 1000), vec![vec![0, 1, 2]], "in order when they fit");
        assert!(passes(&[], 8, 1000).is_empty());
        // 32 texts of 256 tokens fill the default budget; 100 of them with a batch of 4096 run 32 at a time.
        let long = vec![256; 100];
        let p = passes(&long, 4096, super::PASS_CELLS);
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), [32, 32, 32, 4]);
        // Short texts run many to a pass; a text over the budget alone runs alone.
        let mixed: Vec<usize> = (0..1000).map(|i| if i == 7 { 50 } else { 4 + i % 5 }).collect();
        let p = passes(&mixed, 512, 2000);
        assert_eq!(p[0], vec![7], "50² = 2500 > 2000: alone");
        for pass in &p {
            let longest = pass.iter().map(|&i| mixed[i]).max().unwrap();
            assert!(pass.len() <= 512 && (pass.len() == 1 || pass.len() * longest * longest <= 2000), "{pass:?}");
        }
        let mut all: Vec<usize> = p.concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }

    /// A tokenizer that keeps case (a word-level test double: "hello" and "HELLO" are two
    /// tokens, no normaliser).
    fn cased_tokenizer() -> Tokenizer {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"hello": 0, "HELLO": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}"#;
        Tokenizer::from_bytes(json.as_bytes()).unwrap()
    }

    /// The cut comes from `sentence_bert_config.json` when the directory has one, and its
    /// `do_lower_case` lowercases texts first (before 2026-12-05 it was not read: a cased
    /// tokenizer saw the text as typed); an absent file leaves the tokenizer as it is, a cut that
    /// leaves no token or a malformed file is refused.
    #[test]
    fn sentence_bert_config_is_applied_checked_or_absent() {
        let dir = std::env::temp_dir().join(format!("cascade-embed-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("sentence_bert_config.json");
        let _ = std::fs::remove_file(&cfg);
        let applied = |t: &mut Tokenizer| sentence_bert(&dir, t).map(|()| t.get_truncation().map(|c| c.max_length));
        let ids = |t: &Tokenizer| t.encode("HELLO hello", false).unwrap().get_ids().to_vec();
        let mut t = cased_tokenizer();
        assert_eq!(applied(&mut t).unwrap(), None);
        assert_eq!(ids(&t), [1, 0]);
        std::fs::write(&cfg, r#"{"max_seq_length": 256, "do_lower_case": false}"#).unwrap();
        let mut t = cased_tokenizer();
        assert_eq!(applied(&mut t).unwrap(), Some(256));
        assert_eq!(ids(&t), [1, 0]);
        std::fs::write(&cfg, r#"{"max_seq_length": 256, "do_lower_case": true}"#).unwrap();
        let mut t = cased_tokenizer();
        assert_eq!(applied(&mut t).unwrap(), Some(256));
        assert_eq!(ids(&t), [0, 0], "lowercased first");
        std::fs::write(&cfg, r#"{"max_seq_length": 1}"#).unwrap();
        assert!(applied(&mut cased_tokenizer()).unwrap_err().to_string().contains("no room"));
        std::fs::write(&cfg, r#"{"do_lower_case": false}"#).unwrap();
        assert!(applied(&mut cased_tokenizer()).unwrap_err().to_string().contains("max_seq_length"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
