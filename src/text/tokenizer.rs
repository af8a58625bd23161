//! The `shardstream.Tokenizer` transform: a Hugging Face `tokenizer.json`
//! (the `tokenizers` crate, the library the Python `tokenizers` package
//! wraps) run where the field decoders run, turning a text field into an
//! int32 array of token ids.
//!
//! The ids of a text are those of Python's
//! `tokenizers.Tokenizer.from_str(json).encode(text, add_special_tokens).ids`
//! with the file's truncation and padding turned off (a document is never
//! cut or padded here: packing into sequences is a later stage), with
//! `bos` put first and `eos` last when they are set.

use std::fmt;

use tokenizers::Tokenizer;

use super::byte_level::ByteLevelWords;
use crate::hash::fnv1a;

/// A special token given by its id or by its text (looked up in the
/// tokenizer's vocabulary, added tokens included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenRef {
    /// The token's id.
    Id(u32),
    /// The token's text, e.g. `"<|endoftext|>"`.
    Text(String),
}

/// What is wrong with a tokenizer's file or parameters: the parameter's
/// name (`"json"` for the file itself) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{parameter}: {reason}")]
pub struct TokenizerSpecError {
    /// `"json"`, `"bos"` or `"eos"`.
    pub parameter: &'static str,
    /// What is wrong.
    pub reason: String,
}

/// A loaded, checked tokenizer with its special-token choices; shared by
/// the decode threads (encoding needs no lock).
#[derive(Clone)]
pub struct TokenizerSpec {
    tokenizer: Tokenizer,
    /// The `tokenizer.json` text it was loaded from (what pickling sends).
    json: String,
    /// 64-bit FNV-1a of `json`: what the state's fingerprint holds.
    digest: u64,
    bos: Option<u32>,
    eos: Option<u32>,
    add_special_tokens: bool,
    /// The same ids without the library's per-text pipeline, for a
    /// byte-level BPE tokenizer.
    byte_level: Option<ByteLevelWords>,
}

impl TokenizerSpec {
    /// Loads the tokenizer in `json` (a `tokenizer.json`'s text), turns off
    /// its truncation and padding, and checks the special tokens: each must
    /// be in the vocabulary, and none the tokenizer's post-processor already
    /// adds there when `add_special_tokens` is on (that would double it).
    pub fn new(
        json: String,
        bos: Option<TokenRef>,
        eos: Option<TokenRef>,
        add_special_tokens: bool,
    ) -> Result<Self, TokenizerSpecError> {
        let file_error = |reason: String| TokenizerSpecError {
            parameter: "json",
            reason,
        };
        let mut tokenizer = Tokenizer::from_bytes(json.as_bytes()).map_err(|e| {
            file_error(format!(
                "not a tokenizer.json the tokenizers library reads ({e})"
            ))
        })?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| file_error(e.to_string()))?;
        tokenizer.with_padding(None);
        let vocab = tokenizer.get_vocab_size(true);
        if vocab > i32::MAX as usize {
            return Err(file_error(format!(
                "its {vocab} tokens do not fit int32 ids"
            )));
        }
        let resolve = |parameter: &'static str,
                       token: Option<TokenRef>|
         -> Result<Option<u32>, TokenizerSpecError> {
            let fail = |reason: String| TokenizerSpecError { parameter, reason };
            let id = match token {
                None => return Ok(None),
                Some(TokenRef::Id(id)) => {
                    if tokenizer.id_to_token(id).is_none() {
                        return Err(fail(format!(
                            "id {id} is not in the tokenizer's vocabulary ({vocab} tokens)"
                        )));
                    }
                    id
                }
                Some(TokenRef::Text(text)) => tokenizer.token_to_id(&text).ok_or_else(|| {
                    fail(format!(
                        "{text:?} is not a token of the tokenizer's vocabulary"
                    ))
                })?,
            };
            Ok(Some(id))
        };
        let bos = resolve("bos", bos)?;
        let eos = resolve("eos", eos)?;
        let mut spec = TokenizerSpec {
            byte_level: ByteLevelWords::of(&tokenizer, add_special_tokens, fnv1a(json.as_bytes())),
            tokenizer,
            digest: fnv1a(json.as_bytes()),
            json,
            bos: None,
            eos: None,
            add_special_tokens,
        };
        // What the post-processor adds around every text.
        let added = spec
            .encode("")
            .map_err(|reason| file_error(format!("encoding an empty text failed: {reason}")))?;
        let doubled = |parameter: &'static str, id: u32, place: &str| TokenizerSpecError {
            parameter,
            reason: format!(
                "the tokenizer already puts token {id} {place} of every text \
                 (its post-processor, with add_special_tokens=True); leave {parameter} unset \
                 or pass add_special_tokens=False"
            ),
        };
        if let Some(id) = bos {
            if added.first() == Some(&(id as i32)) {
                return Err(doubled("bos", id, "first"));
            }
        }
        if let Some(id) = eos {
            if added.last() == Some(&(id as i32)) {
                return Err(doubled("eos", id, "last"));
            }
        }
        spec.bos = bos;
        spec.eos = eos;
        Ok(spec)
    }

    /// The token ids of `text`: `bos`, the tokenizer's ids, `eos`.
    pub fn encode(&self, text: &str) -> Result<Vec<i32>, String> {
        let mut out = Vec::with_capacity(text.len() / 4 + 2);
        out.extend(self.bos.map(|id| id as i32));
        let done = match &self.byte_level {
            Some(words) => words.encode(self.tokenizer.get_model(), text, &mut out)?,
            None => false,
        };
        if !done {
            let encoding = self
                .tokenizer
                .encode_fast(text, self.add_special_tokens)
                .map_err(|e| e.to_string())?;
            // Ids fit: the vocabulary was checked to be within int32.
            out.extend(encoding.get_ids().iter().map(|&id| id as i32));
        }
        out.extend(self.eos.map(|id| id as i32));
        Ok(out)
    }

    /// The `tokenizer.json` text it was loaded from.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// The id put before every text, if any.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The id put after every text, if any.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether the tokenizer's post-processor adds its special tokens.
    pub fn add_special_tokens(&self) -> bool {
        self.add_special_tokens
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id of `token`, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }
}

impl PartialEq for TokenizerSpec {
    fn eq(&self, other: &Self) -> bool {
        self.json == other.json
            && self.bos == other.bos
            && self.eos == other.eos
            && self.add_special_tokens == other.add_special_tokens
    }
}

impl fmt::Debug for TokenizerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for TokenizerSpec {
    /// `Tokenizer(digest=0x..., bos=1, eos=None, add_special_tokens=True)`:
    /// the file by its 64-bit FNV-1a digest (what a state's fingerprint
    /// compares), the rest as Python would build it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let id = |id: Option<u32>| id.map_or_else(|| "None".to_owned(), |id| id.to_string());
        write!(
            f,
            "Tokenizer(digest=0x{:016x}, bos={}, eos={}, add_special_tokens={})",
            self.digest,
            id(self.bos),
            id(self.eos),
            if self.add_special_tokens {
                "True"
            } else {
                "False"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer over five words (`<s>` 0, `<unk>` 1, `</s>`
    /// 2, `hello` 3, `world` 4), split on whitespace; `post_processor` is
    /// the JSON of its post-processor (`null` for none).
    fn word_level(post_processor: &str) -> String {
        let special = |id: u32, text: &str| {
            format!(
                r#"{{"id":{id},"content":"{text}","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}"#
            )
        };
        format!(
            r#"{{"version":"1.0","truncation":{{"direction":"Right","max_length":2,"strategy":"LongestFirst","stride":0}},"padding":null,"added_tokens":[{},{}],"normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":{post_processor},"decoder":null,"model":{{"type":"WordLevel","vocab":{{"<s>":0,"<unk>":1,"</s>":2,"hello":3,"world":4}},"unk_token":"<unk>"}}}}"#,
            special(0, "<s>"),
            special(2, "</s>")
        )
    }

    /// A post-processor that puts `<s>` first.
    const BOS_FIRST: &str = r#"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],"special_tokens":{"<s>":{"id":"<s>","ids":[0],"tokens":["<s>"]}}}"#;

    #[test]
    fn ids_come_with_bos_and_eos_and_no_truncation() {
        let spec = TokenizerSpec::new(
            word_level("null"),
            Some(TokenRef::Text("<s>".into())),
            Some(TokenRef::Id(2)),
            true,
        )
        .unwrap();
        // The file truncates to 2 tokens; a document is never cut here.
        assert_eq!(
            spec.encode("hello world there hello").unwrap(),
            [0, 3, 4, 1, 3, 2]
        );
        assert_eq!(spec.encode("").unwrap(), [0, 2]);
        assert_eq!(spec.vocab_size(), 5);
        assert_eq!((spec.bos(), spec.eos()), (Some(0), Some(2)));
    }

    #[test]
    fn the_post_processors_tokens_come_once() {
        let json = word_level(BOS_FIRST);
        let spec = TokenizerSpec::new(json.clone(), None, None, true).unwrap();
        assert_eq!(spec.encode("world").unwrap(), [0, 4]);
        let off = TokenizerSpec::new(json.clone(), Some(TokenRef::Id(0)), None, false).unwrap();
        assert_eq!(off.encode("world").unwrap(), [0, 4]);
        let doubled = TokenizerSpec::new(json, Some(TokenRef::Id(0)), None, true).unwrap_err();
        assert_eq!(doubled.parameter, "bos");
        assert!(
            doubled.reason.contains("add_special_tokens=False"),
            "{doubled}"
        );
    }

    #[test]
    fn bad_files_and_tokens_are_named() {
        let error = TokenizerSpec::new("{}".into(), None, None, true).unwrap_err();
        assert_eq!(error.parameter, "json");
        let error =
            TokenizerSpec::new(word_level("null"), None, Some(TokenRef::Id(5)), true).unwrap_err();
        assert_eq!(error.parameter, "eos");
        assert!(error.reason.contains("id 5"), "{error}");
        let error = TokenizerSpec::new(
            word_level("null"),
            Some(TokenRef::Text("<bos>".into())),
            None,
            true,
        )
        .unwrap_err();
        assert_eq!(error.parameter, "bos");
        assert!(error.reason.contains("\"<bos>\""), "{error}");
    }

    #[test]
    fn the_description_names_the_file_by_digest() {
        let a = TokenizerSpec::new(word_level("null"), None, None, true).unwrap();
        let b = TokenizerSpec::new(word_level(BOS_FIRST), None, None, true).unwrap();
        assert_ne!(a.to_string(), b.to_string());
        assert!(
            a.to_string()
                .ends_with("bos=None, eos=None, add_special_tokens=True)"),
            "{a}"
        );
        assert_eq!(a, a.clone());
        assert_ne!(a, b);
    }
}
