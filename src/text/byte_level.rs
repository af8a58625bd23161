//! The ids of a byte-level BPE tokenizer (GPT-2's `ByteLevel`
//! pre-tokenizer with its regex, no normalizer, a BPE model without
//! dropout: GPT-2, RoBERTa, GPT-NeoX and most tokenizers trained with
//! `pre_tokenizers.ByteLevel()`) without the library's per-document
//! pipeline, which builds alignment tables, offsets and a `String` per
//! token for every text.
//!
//! The text is cut into the pre-tokenizer's words by one `regex-automata`
//! search a word; each word's ids come from a per-thread cache keyed by the
//! word's bytes, and only a word not seen yet goes to the library's BPE
//! model (`Model::tokenize` of the word's byte-level characters: exactly
//! the string the library's own pipeline hands the model). A text that
//! holds an added token's content (the library cuts those out first) and
//! the empty text go through the library. The ids are the library's:
//! proptest against `Tokenizer::encode_fast` (tests below), and
//! `benches/text_bench.py` checks every document's ids of the corpus.
//!
//! On the text benchmark's corpus (one thread, one shard of 3.9 M tokens)
//! the library's `encode_fast` gives 1.45 M tokens/s, this 14.4 M
//! (docs/performance.md, "Tokenizing byte-level BPE").

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::AhoCorasick;
use regex_automata::meta::Regex;
use regex_automata::Input;
use rustc_hash::FxHashMap;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{Model, Tokenizer};

/// GPT-2's pre-tokenizer regex (the `tokenizers` library's `ByteLevel`),
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// as two patterns searched leftmost-first, the first preferred (the
/// alternation's order): the last one, [`WHITESPACE`], stands for both
/// whitespace alternatives, the lookahead applied by hand
/// ([`ByteLevelWords::encode`]).
const WORDS: [&str; 2] = [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+",
    r"\s+",
];

/// The pattern of [`WORDS`] that matches whitespace runs.
const WHITESPACE: usize = 1;

/// Words longer than this many bytes are not cached (the library's BPE
/// cache keeps the same bound).
const MAX_CACHED_WORD: usize = 256;

/// Words cached per tokenizer and thread; the cache starts again when full.
const MAX_CACHED_WORDS: usize = 1 << 16;

/// Tokenizers with a cache per thread; the least recently made one's goes
/// when another comes.
const MAX_CACHED_TOKENIZERS: usize = 4;

/// Tells tokenizers' caches apart (clones share one: same tokenizer).
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(0);

type WordIds = FxHashMap<Box<[u8]>, Box<[i32]>>;

thread_local! {
    /// Each tokenizer's words seen by this thread, by cache id.
    static CACHES: RefCell<Vec<(u64, WordIds)>> = const { RefCell::new(Vec::new()) };
}

/// A byte-level BPE tokenizer's pre-tokenizer and cache: the ids of a text
/// from the library's model, word by word.
#[derive(Clone)]
pub(super) struct ByteLevelWords {
    words: Regex,
    /// The added tokens' contents, when there are any.
    added: Option<AhoCorasick>,
    add_prefix_space: bool,
    /// The byte-level character of each byte (GPT-2's `bytes_to_unicode`).
    chars: [char; 256],
    cache_id: u64,
}

impl ByteLevelWords {
    /// The fast path for `tokenizer`, or `None` when its ids could differ
    /// from the library's: a normalizer, another pre-tokenizer (or
    /// `ByteLevel` without its regex), a model other than BPE or a BPE
    /// with dropout, or a post-processor that adds tokens (unless
    /// `add_special_tokens` is off). Truncation and padding are off.
    pub(super) fn of(tokenizer: &Tokenizer, add_special_tokens: bool) -> Option<Self> {
        let byte_level = match tokenizer.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex => b,
            _ => return None,
        };
        let deterministic = match tokenizer.get_model() {
            ModelWrapper::BPE(bpe) => bpe.dropout.is_none_or(|p| p == 0.0),
            _ => false,
        };
        let adds_nothing = !add_special_tokens
            || matches!(
                tokenizer.get_post_processor(),
                None | Some(PostProcessorWrapper::ByteLevel(_))
            );
        if tokenizer.get_normalizer().is_some() || !deterministic || !adds_nothing {
            return None;
        }
        let contents: Vec<&str> = tokenizer
            .get_added_vocabulary()
            .get_vocab()
            .keys()
            .map(String::as_str)
            .filter(|c| !c.is_empty())
            .collect();
        let added = if contents.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&contents).ok()?)
        };
        Some(ByteLevelWords {
            words: Regex::new_many(&WORDS).ok()?,
            added,
            add_prefix_space: byte_level.add_prefix_space,
            chars: byte_chars(),
            cache_id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Appends the ids of `text` (its model's: `model` is the tokenizer's)
    /// to `out` and returns `true`; `false`, appending nothing, when the
    /// text is empty or holds an added token's content (the library's
    /// pipeline gives its ids). The library's error when the model fails.
    pub(super) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<i32>,
    ) -> Result<bool, String> {
        if text.is_empty() || self.added.as_ref().is_some_and(|a| a.is_match(text)) {
            return Ok(false);
        }
        // ByteLevel's `add_prefix_space`: a space before a text that does
        // not start with one.
        let text: Cow<'_, str> = if self.add_prefix_space && !text.starts_with(' ') {
            Cow::Owned(format!(" {text}"))
        } else {
            Cow::Borrowed(text)
        };
        let (text, bytes) = (text.as_ref(), text.as_bytes());
        let mut mapped = String::new();
        CACHES.with(|caches| {
            let mut caches = caches.borrow_mut();
            let cache = self.cache(&mut caches);
            let mut at = 0;
            while at < text.len() {
                let (start, end) = self.next_word(text, at);
                // What the regex leaves between two matches is a word too
                // (the library's `Isolated` split); this regex leaves none.
                for (s, e) in [(at, start), (start, end)] {
                    if s == e {
                        continue;
                    }
                    let word = &bytes[s..e];
                    if let Some(ids) = cache.get(word) {
                        out.extend_from_slice(ids);
                        continue;
                    }
                    mapped.clear();
                    mapped.extend(word.iter().map(|&b| self.chars[b as usize]));
                    let tokens = model.tokenize(&mapped).map_err(|e| e.to_string())?;
                    let first = out.len();
                    // Ids fit: the vocabulary was checked to be within int32.
                    out.extend(tokens.iter().map(|t| t.id as i32));
                    if word.len() <= MAX_CACHED_WORD {
                        if cache.len() >= MAX_CACHED_WORDS {
                            cache.clear();
                        }
                        cache.insert(word.into(), out[first..].into());
                    }
                }
                at = end;
            }
            Ok(true)
        })
    }

    /// The span of the pre-tokenizer's next word at or after `at` (the
    /// text's end when no word is left).
    fn next_word(&self, text: &str, at: usize) -> (usize, usize) {
        let Some(found) = self.words.search(&Input::new(text).span(at..text.len())) else {
            return (text.len(), text.len());
        };
        let (start, mut end) = (found.start(), found.end());
        // `\s+(?!\S)` before `\s+`: a whitespace run that text follows
        // leaves its last character to the next word (where " word" takes
        // a space), unless that character is the whole run.
        if found.pattern().as_usize() == WHITESPACE && end < text.len() {
            let last = text[start..end]
                .chars()
                .next_back()
                .map_or(0, char::len_utf8);
            if end - last > start {
                end -= last;
            }
        }
        (start, end)
    }

    /// This thread's cache of this tokenizer's words.
    fn cache<'c>(&self, caches: &'c mut Vec<(u64, WordIds)>) -> &'c mut WordIds {
        let index = match caches.iter().position(|(id, _)| *id == self.cache_id) {
            Some(index) => index,
            None => {
                if caches.len() >= MAX_CACHED_TOKENIZERS {
                    caches.remove(0);
                }
                caches.push((self.cache_id, WordIds::default()));
                caches.len() - 1
            }
        };
        &mut caches[index].1
    }
}

/// GPT-2's `bytes_to_unicode`: the printable bytes stand for themselves,
/// the others, in order, for U+0100 onwards.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\0')
        };
    }
    chars
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A byte-level BPE tokenizer.json: the 256 byte characters, then
    /// `merges` (pairs of tokens, merged in order, each merge a new token),
    /// `added` as special added tokens, and the given pre-tokenizer's
    /// `add_prefix_space`.
    fn byte_level_bpe(merges: &[(&str, &str)], added: &[&str], add_prefix_space: bool) -> String {
        let chars = byte_chars();
        let mut vocab: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        for (a, b) in merges {
            vocab.push(format!("{a}{b}"));
        }
        let mut entries: Vec<(String, usize)> = vocab.into_iter().zip(0..).collect();
        let added_json: Vec<String> = added
            .iter()
            .enumerate()
            .map(|(i, content)| {
                let id = entries.len() + i;
                format!(
                    r#"{{"id":{id},"content":{},"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}"#,
                    serde_json::to_string(content).unwrap()
                )
            })
            .collect();
        for (i, content) in added.iter().enumerate() {
            entries.push((content.to_string(), 256 + merges.len() + i));
        }
        let vocab_json: Vec<String> = entries
            .iter()
            .map(|(t, id)| format!("{}:{id}", serde_json::to_string(t).unwrap()))
            .collect();
        let merges_json: Vec<String> = merges
            .iter()
            .map(|(a, b)| serde_json::to_string(&[a, b]).unwrap())
            .collect();
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{}],"normalizer":null,"pre_tokenizer":{{"type":"ByteLevel","add_prefix_space":{add_prefix_space},"trim_offsets":true,"use_regex":true}},"post_processor":{{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}},"decoder":{{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}},"model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{{{}}},"merges":[{}]}}}}"#,
            added_json.join(","),
            vocab_json.join(","),
            merges_json.join(",")
        )
    }

    /// Merges for English-like words ("Ġ" is the byte-level space).
    const MERGES: [(&str, &str); 8] = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "a"),
        ("e", "r"),
        ("'", "s"),
        ("Ċ", "Ċ"),
    ];

    fn library_ids(tokenizer: &Tokenizer, text: &str) -> Vec<i32> {
        let encoding = tokenizer.encode_fast(text, true).unwrap();
        encoding.get_ids().iter().map(|&id| id as i32).collect()
    }

    /// The fast path's ids of `text`, or `None` when it leaves the text to
    /// the library; twice, so that the second comes from the cache.
    fn fast_ids(tokenizer: &Tokenizer, words: &ByteLevelWords, text: &str) -> Option<Vec<i32>> {
        let mut first = Vec::new();
        if !words
            .encode(tokenizer.get_model(), text, &mut first)
            .unwrap()
        {
            assert!(first.is_empty());
            return None;
        }
        let mut again = Vec::new();
        assert!(words
            .encode(tokenizer.get_model(), text, &mut again)
            .unwrap());
        assert_eq!(first, again, "the cached ids of {text:?}");
        Some(first)
    }

    #[test]
    fn gives_the_library_ids_of_words_spaces_and_contractions() {
        for prefix in [false, true] {
            let json = byte_level_bpe(&MERGES, &["<|endoftext|>"], prefix);
            let tokenizer = Tokenizer::from_bytes(json.as_bytes()).unwrap();
            let words = ByteLevelWords::of(&tokenizer, true).expect("a byte-level BPE");
            for text in [
                "the weather in there",
                "  the   end\n\n\nthe's  ",
                "it's 12,345 things!\t\tok \u{a0}\u{3000}x",
                "日本語 テキスト、 и кириллица ١٢٣",
                " ",
                "\n",
                "a\u{301}e\u{301} 😀😀 don't",
            ] {
                assert_eq!(
                    fast_ids(&tokenizer, &words, text),
                    Some(library_ids(&tokenizer, text)),
                    "{text:?} (add_prefix_space {prefix})"
                );
            }
            // Added tokens and the empty text go through the library.
            assert_eq!(fast_ids(&tokenizer, &words, "a<|endoftext|>b"), None);
            assert_eq!(fast_ids(&tokenizer, &words, ""), None);
        }
    }

    #[test]
    fn other_tokenizers_take_the_library_path() {
        let plain = byte_level_bpe(&MERGES, &[], false);
        let variants = [
            plain.replace(r#""normalizer":null"#, r#""normalizer":{"type":"NFC"}"#),
            plain.replace(r#""use_regex":true},"post"#, r#""use_regex":false},"post"#),
            plain.replace(r#""dropout":null"#, r#""dropout":0.5"#),
            plain.replace(
                r#""post_processor":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"#,
                r#""post_processor":{"type":"RobertaProcessing","sep":["Ġt",257],"cls":["Ġ",256],"trim_offsets":true,"add_prefix_space":false}"#,
            ),
        ];
        for json in &variants {
            assert_ne!(json, &plain, "a variant changes the tokenizer");
            let tokenizer = Tokenizer::from_bytes(json.as_bytes()).unwrap();
            assert!(ByteLevelWords::of(&tokenizer, true).is_none(), "{json}");
        }
        // Without its special tokens a post-processor adds nothing.
        let tokenizer = Tokenizer::from_bytes(variants[3].as_bytes()).unwrap();
        assert!(ByteLevelWords::of(&tokenizer, false).is_some());
        let plain = Tokenizer::from_bytes(plain.as_bytes()).unwrap();
        assert!(ByteLevelWords::of(&plain, true).is_some());
    }

    /// Characters of every class the regex tells apart: letters, digits of
    /// several scripts, marks, symbols, ASCII and Unicode whitespace, the
    /// apostrophe and the contractions' letters.
    fn text() -> impl Strategy<Value = String> {
        let alphabet = prop::sample::select(vec![
            'a', 't', 'h', 'e', 's', 'r', 'v', 'l', 'd', 'm', 'S', '\'', ' ', ' ', ' ', '\n', '\t',
            '\r', '\u{a0}', '\u{3000}', '\u{2028}', '\u{200b}', '\u{85}', '5', '٣', '²', 'é',
            '\u{301}', '日', 'и', '!', ',', '-', '😀', '\u{0}', '\u{7f}',
        ]);
        prop::collection::vec(alphabet, 0..40).prop_map(|c| c.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_ids_are_the_library_ids(texts in prop::collection::vec(text(), 1..6), prefix: bool) {
            let json = byte_level_bpe(&MERGES, &["<|endoftext|>"], prefix);
            let tokenizer = Tokenizer::from_bytes(json.as_bytes()).unwrap();
            let words = ByteLevelWords::of(&tokenizer, true).unwrap();
            // Several texts through one cache: later ones meet cached words.
            for text in &texts {
                let expected = library_ids(&tokenizer, text);
                match fast_ids(&tokenizer, &words, text) {
                    Some(ids) => prop_assert_eq!(ids, expected, "{:?}", text),
                    None => prop_assert!(text.is_empty()),
                }
            }
        }
    }
}
