//! sentence-transformers' prompts: a text put before every input of a model (`"query: "`,
//! `"Represent this sentence for searching relevant passages: "`), as its
//! `config_sentence_transformers.json` names them (`prompts`, and `default_prompt_name`: the one
//! `encode` uses when the caller names none), and whether pooling leaves the prompt's tokens out
//! (`include_prompt` in `1_Pooling/config.json`, [`crate::pooling::Pooling::include_prompt`]).
//!
//! As sentence-transformers 3 does it: the prompt is prepended to the text before tokenising
//! (so the model's cut counts its tokens too), and with `include_prompt: false` the first
//! `len(tokens of the prompt alone, [CLS] and [SEP] included) − 1` positions — `[CLS]` and the
//! prompt's own tokens — are masked out of pooling only, after every layer has attended to them.

use std::collections::BTreeMap;
use std::path::Path;

use tokenizers::Tokenizer;

use crate::ExecError;

/// The file that names a model's prompts.
pub const FILE: &str = "config_sentence_transformers.json";

/// A model's named prompts and the one used by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompts {
    /// Each prompt's text by name.
    pub named: BTreeMap<String, String>,
    /// The name of the prompt used when none is asked for (`default_prompt_name`).
    pub default: Option<String>,
}

impl Prompts {
    /// The prompts `dir`'s [`FILE`] names; none without the file. A default that names no prompt
    /// is refused, as sentence-transformers refuses it at load.
    pub fn from_dir(dir: &Path) -> Result<Prompts, ExecError> {
        #[derive(serde::Deserialize)]
        struct File {
            #[serde(default)]
            prompts: BTreeMap<String, String>,
            #[serde(default)]
            default_prompt_name: Option<String>,
        }
        let path = dir.join(FILE);
        let bad = |why: String| ExecError::Model(format!("{}: {why}", path.display()));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Prompts::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        let f: File = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let p = Prompts { named: f.prompts, default: f.default_prompt_name };
        if let Some(name) = &p.default {
            p.get(name).map_err(|e| bad(format!("default_prompt_name: {e}")))?;
        }
        Ok(p)
    }

    /// The text of the prompt `name`, or an error naming the prompts there are.
    pub fn get(&self, name: &str) -> Result<&str, ExecError> {
        self.named.get(name).map(String::as_str).ok_or_else(|| {
            let names: Vec<&str> = self.named.keys().map(String::as_str).collect();
            ExecError::Input(match names.is_empty() {
                true => format!("no prompt named {name:?}: the model names no prompts"),
                false => format!("no prompt named {name:?}: the model's are {}", names.join(", ")),
            })
        })
    }

    /// The text of the default prompt, if the model has one.
    pub fn default_text(&self) -> Option<&str> {
        self.default.as_deref().and_then(|n| self.named.get(n)).map(String::as_str)
    }
}

/// A prompt as it is applied: its text, put before each input, and how many leading positions
/// pooling leaves out (0 when pooling includes the prompt).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    /// Put before each text.
    pub text: String,
    /// Positions masked out of pooling from the start of each text's tokens.
    pub pool_skip: usize,
}

impl Prompt {
    /// `text` as `tokenizer` applies it, its tokens left out of pooling unless `include_prompt`.
    /// An empty text is no prompt.
    pub fn new(tokenizer: &Tokenizer, text: &str, include_prompt: bool) -> Result<Option<Prompt>, ExecError> {
        if text.is_empty() {
            return Ok(None);
        }
        let pool_skip = match include_prompt {
            true => 0,
            false => {
                let e = tokenizer
                    .encode(text, true)
                    .map_err(|e| ExecError::Input(format!("tokenising the prompt: {e}")))?;
                e.get_ids().len().saturating_sub(1)
            }
        };
        Ok(Some(Prompt { text: text.to_string(), pool_skip }))
    }

    /// `f` of `texts`, each with `prompt` (if any) before it.
    pub fn applied<R>(prompt: Option<&Prompt>, texts: &[&str], f: impl FnOnce(&[&str]) -> R) -> R {
        match prompt {
            None => f(texts),
            Some(p) => {
                let prompted: Vec<String> = texts.iter().map(|t| format!("{}{t}", p.text)).collect();
                f(&prompted.iter().map(String::as_str).collect::<Vec<_>>())
            }
        }
    }

    /// The positions [`crate::pooling::Pooling::pool`] leaves out for `prompt`.
    pub fn skip(prompt: Option<&Prompt>) -> usize {
        prompt.map_or(0, |p| p.pool_skip)
    }
}
