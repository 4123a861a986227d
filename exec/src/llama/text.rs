//! A llama model's text side without its weights: the tokenizer, the chat template, the
//! end-of-sequence token and the context window — what takes a prompt's text to tokens and a
//! answer's tokens back to text. [`super::generate::Generator`] holds one beside its model; an
//! HTTP front or a router that computes nothing holds one alone.

use std::path::Path;

use tokenizers::Tokenizer;

use super::chat::ChatTemplate;
use super::LlamaConfig;
use crate::ExecError;

/// A model's tokenizer, chat template, end-of-sequence token and context window.
pub struct ModelText {
    tokenizer: Tokenizer,
    /// The model's chat template: none, or why it cannot be used (unreadable, or it did not compile).
    chat: Result<Option<ChatTemplate>, String>,
    eos: u32,
    window: usize,
    /// Whether the tokenizer is byte-level (GPT-2's table maps each token's characters to bytes).
    byte_level: bool,
}

impl ModelText {
    /// The text side of the model in `dir` whose configuration is `config` and tokenizer
    /// `tokenizer`: its chat template is read from `dir` (a template that cannot be read or
    /// compiled fails [`ModelText::chat_template`], not this).
    pub fn new(tokenizer: Tokenizer, config: &LlamaConfig, dir: &Path) -> ModelText {
        let token = |id: u32| tokenizer.id_to_token(id).unwrap_or_default();
        let chat = ChatTemplate::source(dir)
            .and_then(|source| {
                source
                    .map(|s| ChatTemplate::new(&s, token(config.bos_token_id), token(config.eos_token_id)))
                    .transpose()
            })
            .map_err(|e| format!("{}: {e}", dir.display()));
        let byte_level = matches!(tokenizer.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        ModelText { chat, eos: config.eos_token_id, window: config.max_position_embeddings, byte_level, tokenizer }
    }

    /// The model's chat template (`config.json`'s `chat_template`, which `cascade model import`
    /// keeps from the GGUF, or `tokenizer_config.json`'s or `chat_template.jinja`); an error
    /// when it has none or it does not compile.
    pub fn chat_template(&self) -> Result<&ChatTemplate, ExecError> {
        match &self.chat {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(ExecError::Model(
                "the model has no chat template (config.json's chat_template, tokenizer_config.json's or a \
                 chat_template.jinja file): give the prompt as the model expects it"
                    .into(),
            )),
            Err(e) => Err(ExecError::Model(e.clone())),
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// The context window: prompt and generated tokens together, at most.
    pub fn window(&self) -> usize {
        self.window
    }

    /// `text`'s tokens (special tokens such as `<|im_start|>` recognised; what the tokenizer adds
    /// around a text added: a beginning-of-sequence token where the model's tokenizer says so,
    /// none for SmolLM2).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ExecError> {
        super::generate::encode(&self.tokenizer, text)
    }

    /// `text`'s tokens as a prompt ([`ModelText::encode`]), or why it cannot be continued within
    /// the model's context window ([`super::generate::refusal`]): `Ok(Err(why))`. A text longer
    /// than [`tokens::FIRST`](crate::tokens::FIRST) bytes is tokenised only until it is known to
    /// hold more tokens than the window ("at least N tokens"), not whole (a 10 MB line took 1.5 GB).
    pub fn prompt(&self, text: &str) -> Result<Result<Vec<u32>, String>, ExecError> {
        let window = self.window;
        let e = crate::tokens::encode_enough(&self.tokenizer, text, true, crate::tokens::FIRST, |e| e.len() > window)?;
        let tokens = e.encoding.get_ids();
        if !e.whole {
            return Ok(Err(format!("at least {} tokens; the model's context window is {window}", tokens.len())));
        }
        Ok(super::generate::refusal(tokens, window).map_or_else(|| Ok(tokens.to_vec()), Err))
    }

    /// Token `id`'s bytes: a byte-level tokenizer's token through GPT-2's byte table (a token
    /// may hold part of a character: its bytes say what its text cannot); otherwise the token
    /// decoded alone. The bytes of an answer's tokens make its text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if self.byte_level {
            let bytes =
                self.tokenizer.id_to_token(id).and_then(|t| t.chars().map(byte_of).collect::<Option<Vec<u8>>>());
            if let Some(b) = bytes {
                return b;
            }
        }
        self.decode(&[id]).unwrap_or_default().into_bytes()
    }

    /// `tokens` as text (special tokens kept).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, ExecError> {
        self.tokenizer.decode(tokens, false).map_err(|e| ExecError::Input(format!("decoding: {e}")))
    }
}

/// The byte GPT-2's byte-level table shows as `c`: the printable bytes (`!`…`~`, `¡`…`¬`,
/// `®`…`ÿ`) as themselves, the others, in order, as U+0100 onwards.
fn byte_of(c: char) -> Option<u8> {
    let shown = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if shown(c) {
        return u8::try_from(c).ok();
    }
    let n = c.checked_sub(256)?;
    (0u32..=255).filter(|&b| !shown(b)).nth(n as usize).and_then(|b| u8::try_from(b).ok())
}

#[cfg(test)]
mod tests {
    /// GPT-2's table: every byte shown as one character, and read back.
    #[test]
    fn the_byte_level_table_reads_back_every_byte() {
        assert_eq!(super::byte_of('Ġ'), Some(b' '));
        assert_eq!(super::byte_of('Ċ'), Some(b'\n'));
        assert_eq!(super::byte_of('a'), Some(b'a'));
        assert_eq!(super::byte_of('é'), Some(0xE9));
        let shown: Vec<u8> = (0..512u32).filter_map(char::from_u32).filter_map(super::byte_of).collect();
        let mut sorted = shown.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!((shown.len(), sorted.len()), (256, 256));
    }
}
