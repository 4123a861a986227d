//! A model's chat template — Hugging Face's Jinja, as `config.json`'s `chat_template` (where
//! `cascade model import` keeps the GGUF's), `tokenizer_config.json`'s or `chat_template.jinja`
//! give it — rendered as `transformers`' `apply_chat_template` renders it: Jinja with
//! `trim_blocks` and `lstrip_blocks`, loop controls, Python's string methods (`minijinja-contrib`'s
//! `pycompat`), `raise_exception`, the messages, `add_generation_prompt` and the special tokens
//! by name (`bos_token`, `eos_token`).

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::ExecError;

/// One message of a conversation.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Message<'a> {
    /// `system`, `user` or `assistant`.
    pub role: &'a str,
    /// Its text.
    pub content: &'a str,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts of the model's special tokens.
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<ChatTemplate, ExecError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |why: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, why))
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ExecError::Model(format!("the chat template does not compile: {e}")))?;
        Ok(ChatTemplate { env, bos_token, eos_token })
    }

    /// The template of the model directory `dir`, if it has one: `config.json`'s `chat_template`,
    /// else `tokenizer_config.json`'s (one template, or a list of named ones: the one named
    /// `default`), else the file `chat_template.jinja`.
    pub fn source(dir: &Path) -> Result<Option<String>, ExecError> {
        for file in ["config.json", "tokenizer_config.json"] {
            let path = dir.join(file);
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ExecError::Model(format!("{}: {e}", path.display()))),
            };
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ExecError::Model(format!("{}: {e}", path.display())))?;
            // One template, or several by name (`transformers`' list form): the one named default.
            let template = match v.get("chat_template") {
                Some(serde_json::Value::String(t)) => Some(t.as_str()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str()),
                _ => None,
            };
            if let Some(t) = template {
                return Ok(Some(t.to_string()));
            }
        }
        let path = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&path) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ExecError::Model(format!("{}: {e}", path.display()))),
        }
    }

    /// `messages` rendered, then the assistant's turn opened when `add_generation_prompt`.
    pub fn render(&self, messages: &[Message<'_>], add_generation_prompt: bool) -> Result<String, ExecError> {
        let t = self.env.get_template(NAME).map_err(|e| ExecError::Model(format!("chat template: {e}")))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ExecError::Input(format!("the chat template refused the conversation: {e}")))
    }

    /// One user message, and the assistant's turn opened: what a chat prompt is.
    pub fn user_turn(&self, user: &str) -> Result<String, ExecError> {
        self.render(&[Message { role: "user", content: user }], true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as its GGUF carries it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, "<s>".into(), "</s>".into()).unwrap()
    }

    /// SmolLM2's template gives the ChatML turn with its default system message; with a system
    /// message of the conversation's own, that one.
    #[test]
    fn smollm2s_template_renders_its_chatml_turn() {
        let t = template(SMOLLM2);
        assert_eq!(
            t.user_turn("What is the capital of France?").unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = [Message { role: "system", content: "Be brief." }, Message { role: "user", content: "Hi" }];
        assert_eq!(
            t.render(&with_system, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    /// What other models' templates use: the special tokens by name, Python's string methods,
    /// block trimming as `transformers` sets it, and `raise_exception`, whose message is the error.
    #[test]
    fn templates_render_as_transformers_renders_them() {
        let zephyr = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'].strip() + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";
        assert_eq!(template(zephyr).user_turn("  Hi  ").unwrap(), "<|user|>\nHi</s>\n<|assistant|>\n");
        let llama2 = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}";
        let t = template(llama2);
        assert_eq!(t.user_turn("Hi").unwrap(), "<s>[INST] Hi [/INST]");
        let two_users = [Message { role: "user", content: "a" }, Message { role: "user", content: "b" }];
        let e = t.render(&two_users, true).unwrap_err().to_string();
        assert!(e.contains("Conversation roles must alternate"), "{e}");
        let e = ChatTemplate::new("{% if %}", "<s>".into(), "</s>".into()).unwrap_err().to_string();
        assert!(e.contains("does not compile"), "{e}");
    }

    /// The template is found in `config.json`, else `tokenizer_config.json`, else
    /// `chat_template.jinja`; a directory with none has none.
    #[test]
    fn the_template_is_found_where_directories_keep_it() {
        let dir = std::env::temp_dir().join(format!("cascade-chat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap(), None);
        std::fs::write(dir.join("chat_template.jinja"), "file").unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap().as_deref(), Some("file"));
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "tokenizer"}"#).unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap().as_deref(), Some("tokenizer"));
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]}"#,
        )
        .unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap().as_deref(), Some("named"));
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "tokenizer"}"#).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap().as_deref(), Some("tokenizer"));
        std::fs::write(dir.join("config.json"), r#"{"chat_template": "config"}"#).unwrap();
        assert_eq!(ChatTemplate::source(&dir).unwrap().as_deref(), Some("config"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
