//! The ids of a byte-level BPE tokenizer without the library's per-text
//! pipeline, which builds alignment tables, offsets and a `String` per
//! token for every text. Two pre-tokenizer forms are recognised: GPT-2's
//! `ByteLevel` with its regex (GPT-2, RoBERTa, GPT-NeoX/Pythia/OLMo and
//! what `pre_tokenizers.ByteLevel()` trains), and a regex `Split` followed
//! by `ByteLevel` without one (Llama 3, Qwen2, and the GPT-4-style
//! patterns), when the regex ends in GPT-2's whitespace alternatives
//! `\s+(?!\S)|\s+`; with no normalizer or NFC, a BPE model without
//! dropout, and any post-processor (what it puts around every text is
//! learned from the library once).
//!
//! The text is cut into the pre-tokenizer's words by one `regex-automata`
//! search a word; each word's ids come from a per-thread cache keyed by the
//! word's bytes, and only a word not seen yet goes to the library's BPE
//! model (`Model::tokenize` of the word's byte-level characters: exactly
//! the string the library's own pipeline hands the model). A text that
//! holds an added token's content (the library cuts those out first), a
//! text that NFC would change (under an NFC normalizer) and the empty text
//! go through the library. The ids are the library's: proptest against
//! `Tokenizer::encode_fast` (tests below), and `benches/tokenizer_bench.py`
//! checks every document's ids against the Python package.
//!
//! On the text benchmark's corpus (one thread, one shard of 3.9 M tokens)
//! the library's `encode_fast` gives 1.45 M tokens/s, this 14.4 M
//! (docs/performance.md, "Tokenizing byte-level BPE").

use std::borrow::Cow;
use std::cell::RefCell;

use aho_corasick::AhoCorasick;
use regex_automata::meta::Regex;
use regex_automata::Input;
use rustc_hash::FxHashMap;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    Model, NormalizerWrapper, PostProcessor, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};
use unicode_normalization_alignments::is_nfc;

/// GPT-2's pre-tokenizer regex (the `tokenizers` library's `ByteLevel`),
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// without its whitespace alternatives ([`WHITESPACE_TAIL`]).
const GPT2_WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+";

/// How the regexes this path takes end: `\s+(?!\S)` then `\s+`. The
/// rest of the regex and [`WHITESPACE`] are searched as two patterns,
/// leftmost-first, the first preferred (the alternation's order); the
/// lookahead is applied by hand ([`ByteLevelWords::next_word`]).
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// The pattern that stands for both whitespace alternatives.
const WHITESPACE: &str = r"\s+";

/// Words longer than this many bytes are not cached (the library's BPE
/// cache keeps the same bound).
const MAX_CACHED_WORD: usize = 256;

/// The most bytes one tokenizer's cache holds in one thread (words, ids and
/// a table slot each, [`entry_bytes`]); it starts again when full.
const MAX_CACHE_BYTES: usize = 16 << 20;

/// Tokenizers with a cache per thread; the least recently used one's goes
/// when another comes.
const MAX_CACHED_TOKENIZERS: usize = 4;

/// What one cached word costs: its bytes, its ids and the table's slot and
/// allocations.
fn entry_bytes(word: &[u8], ids: &[i32]) -> usize {
    word.len() + 4 * ids.len() + 64
}

/// One tokenizer's words seen by a thread, and the bytes they take.
#[derive(Default)]
struct WordCache {
    ids: FxHashMap<Box<[u8]>, Box<[i32]>>,
    bytes: usize,
}

thread_local! {
    /// Each tokenizer's words seen by this thread, by the tokenizer's file
    /// digest (the words' ids depend on the file alone), most recently
    /// used last.
    static CACHES: RefCell<Vec<(u64, WordCache)>> = const { RefCell::new(Vec::new()) };
}

/// A byte-level BPE tokenizer's pre-tokenizer and cache: the ids of a text
/// from the library's model, word by word.
#[derive(Clone)]
pub(super) struct ByteLevelWords {
    /// The pre-tokenizer's regex without its whitespace alternatives
    /// (pattern 0), and [`WHITESPACE`] (pattern 1).
    words: Regex,
    /// The added tokens' contents, when there are any.
    added: Option<AhoCorasick>,
    add_prefix_space: bool,
    /// The normalizer is NFC: a text NFC would change goes to the library.
    nfc: bool,
    /// The byte-level character of each byte (GPT-2's `bytes_to_unicode`).
    chars: [char; 256],
    /// What the post-processor puts before and after every text's ids.
    prefix: Vec<i32>,
    suffix: Vec<i32>,
    /// The tokenizer file's digest: which thread cache holds its words.
    digest: u64,
}

impl ByteLevelWords {
    /// The fast path for `tokenizer`, or `None` when its ids could differ
    /// from the library's: a normalizer other than NFC, a pre-tokenizer of
    /// another form, a model other than BPE or a BPE with dropout.
    /// Truncation and padding are off; `digest` is the tokenizer file's.
    pub(super) fn of(tokenizer: &Tokenizer, add_special_tokens: bool, digest: u64) -> Option<Self> {
        let nfc = match tokenizer.get_normalizer() {
            None => false,
            Some(NormalizerWrapper::NFC(_)) => true,
            Some(_) => return None,
        };
        let (words, add_prefix_space) = pre_tokenizer_words(tokenizer.get_pre_tokenizer()?)?;
        match tokenizer.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none_or(|p| p == 0.0) => {}
            _ => return None,
        }
        let added_tokens = tokenizer.get_added_tokens_decoder();
        // The library finds a `normalized` added token in the normalized
        // text: by its NFC form under NFC, which is not what is searched.
        if nfc
            && added_tokens
                .values()
                .any(|t| t.normalized && !is_nfc(&t.content))
        {
            return None;
        }
        let contents: Vec<&str> = added_tokens
            .values()
            .map(|t| t.content.as_str())
            .filter(|c| !c.is_empty())
            .collect();
        let added = if contents.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&contents).ok()?)
        };
        // A regex that can match the empty text would make no progress
        // here (the library steps past an empty match).
        let shortest = regex_syntax::parse(&words).ok()?.properties().minimum_len();
        if shortest.is_none_or(|bytes| bytes == 0) {
            return None;
        }
        let words = Regex::new_many(&[words.as_str(), WHITESPACE]).ok()?;
        let mut fast = ByteLevelWords {
            words,
            added,
            add_prefix_space,
            nfc,
            chars: byte_chars(),
            prefix: Vec::new(),
            suffix: Vec::new(),
            digest,
        };
        if add_special_tokens {
            if let Some(processor) = tokenizer.get_post_processor() {
                let added = processor.added_tokens(false);
                (fast.prefix, fast.suffix) = fast.around_every_text(tokenizer, added)?;
            }
        }
        Some(fast)
    }

    /// What the post-processor (which adds `added` ids to a text) puts
    /// before and after every text's ids. Every post-processor of the
    /// library puts the same tokens around any one text (its template's
    /// special tokens), so two probe texts tell where; `None` unless both
    /// agree with one split.
    fn around_every_text(
        &self,
        tokenizer: &Tokenizer,
        added: usize,
    ) -> Option<(Vec<i32>, Vec<i32>)> {
        let probes = ["a", "the 2 words."];
        let mut pairs = Vec::new();
        for probe in probes {
            let library = tokenizer.encode_fast(probe, true).ok()?;
            let library: Vec<i32> = library.get_ids().iter().map(|&id| id as i32).collect();
            let mut content = Vec::new();
            if !self
                .encode(tokenizer.get_model(), probe, &mut content)
                .ok()?
            {
                return None;
            }
            if library.len() != content.len() + added {
                return None;
            }
            pairs.push((library, content));
        }
        (0..=added).find_map(|before| {
            let (library, content) = &pairs[0];
            let prefix = &library[..before];
            let suffix = &library[before + content.len()..];
            pairs
                .iter()
                .all(|(library, content)| {
                    library[..before] == *prefix
                        && library[before..before + content.len()] == **content
                        && library[before + content.len()..] == *suffix
                })
                .then(|| (prefix.to_vec(), suffix.to_vec()))
        })
    }

    /// Appends the ids of `text` (`model` is the tokenizer's) to `out`, the
    /// post-processor's around them, and returns `true`; `false`, appending
    /// nothing, when the text is empty, holds an added token's content, or
    /// is not NFC under an NFC normalizer (the library's pipeline gives its
    /// ids). The library's error when the model fails.
    pub(super) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<i32>,
    ) -> Result<bool, String> {
        if text.is_empty()
            || self.added.as_ref().is_some_and(|a| a.is_match(text))
            || (self.nfc && !is_nfc(text))
        {
            return Ok(false);
        }
        out.extend_from_slice(&self.prefix);
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
                    if let Some(ids) = cache.ids.get(word) {
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
                        let ids = &out[first..];
                        let bytes = entry_bytes(word, ids);
                        if cache.bytes + bytes > MAX_CACHE_BYTES {
                            *cache = WordCache::default();
                        }
                        cache.bytes += bytes;
                        cache.ids.insert(word.into(), ids.into());
                    }
                }
                at = end;
            }
            out.extend_from_slice(&self.suffix);
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
        if found.pattern().as_usize() == 1 && end < text.len() {
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

    /// This thread's cache of this tokenizer's words, made the most
    /// recently used.
    fn cache<'c>(&self, caches: &'c mut Vec<(u64, WordCache)>) -> &'c mut WordCache {
        match caches.iter().position(|(digest, _)| *digest == self.digest) {
            Some(index) => {
                let used = caches.remove(index);
                caches.push(used);
            }
            None => {
                if caches.len() >= MAX_CACHED_TOKENIZERS {
                    caches.remove(0);
                }
                caches.push((self.digest, WordCache::default()));
            }
        }
        &mut caches.last_mut().expect("pushed above").1
    }
}

/// The regex of the pre-tokenizer's words without its whitespace
/// alternatives, and whether a space goes before each text: for GPT-2's
/// `ByteLevel` with its regex, or a regex `Split` (isolating its matches)
/// then `ByteLevel` without one and without a space; `None` for any other.
fn pre_tokenizer_words(pre_tokenizer: &PreTokenizerWrapper) -> Option<(String, bool)> {
    let byte_level = |p: &PreTokenizerWrapper| match p {
        PreTokenizerWrapper::ByteLevel(b) => Some(*b),
        _ => None,
    };
    if let Some(ByteLevel {
        use_regex: true,
        add_prefix_space,
        ..
    }) = byte_level(pre_tokenizer)
    {
        return Some((GPT2_WORDS.to_owned(), add_prefix_space));
    }
    let PreTokenizerWrapper::Sequence(sequence) = pre_tokenizer else {
        return None;
    };
    let [PreTokenizerWrapper::Split(split), last] = sequence.as_ref() else {
        return None;
    };
    let Split {
        pattern: SplitPattern::Regex(regex),
        behavior: SplitDelimiterBehavior::Isolated,
        invert: false,
        ..
    } = split
    else {
        return None;
    };
    match byte_level(last) {
        Some(ByteLevel {
            use_regex: false,
            add_prefix_space: false,
            ..
        }) => Some((regex.strip_suffix(WHITESPACE_TAIL)?.to_owned(), false)),
        _ => None,
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

    /// GPT-2's pre-tokenizer, with or without a space before each text.
    fn gpt2(add_prefix_space: bool) -> String {
        format!(
            r#"{{"type":"ByteLevel","add_prefix_space":{add_prefix_space},"trim_offsets":true,"use_regex":true}}"#
        )
    }

    /// Llama 3's pre-tokenizer regex.
    const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Llama 3's pre-tokenizer: its regex `Split`, then `ByteLevel`
    /// without a regex.
    fn llama3() -> String {
        let regex = LLAMA3_REGEX;
        format!(
            r#"{{"type":"Sequence","pretokenizers":[{{"type":"Split","pattern":{{"Regex":{}}},"behavior":"Isolated","invert":false}},{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}}]}}"#,
            serde_json::to_string(regex).unwrap()
        )
    }

    const BYTE_LEVEL_POST: &str =
        r#"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"#;

    /// A template putting the first added token (id `bos`) before every text.
    fn bos_template(bos: usize) -> String {
        format!(
            r#"{{"type":"TemplateProcessing","single":[{{"SpecialToken":{{"id":"<|endoftext|>","type_id":0}}}},{{"Sequence":{{"id":"A","type_id":0}}}}],"pair":[{{"Sequence":{{"id":"A","type_id":0}}}},{{"Sequence":{{"id":"B","type_id":1}}}}],"special_tokens":{{"<|endoftext|>":{{"id":"<|endoftext|>","ids":[{bos}],"tokens":["<|endoftext|>"]}}}}}}"#
        )
    }

    /// A byte-level BPE tokenizer.json: the 256 byte characters, then
    /// `merges` (pairs of tokens, merged in order, each merge a new token),
    /// `added` as special added tokens (ids after those), and the given
    /// normalizer, pre-tokenizer and post-processor (JSON).
    fn byte_level_bpe(
        merges: &[(&str, &str)],
        added: &[&str],
        normalizer: &str,
        pre_tokenizer: &str,
        post_processor: &str,
    ) -> String {
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
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{}],"normalizer":{normalizer},"pre_tokenizer":{pre_tokenizer},"post_processor":{post_processor},"decoder":{BYTE_LEVEL_POST},"model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{{{}}},"merges":[{}]}}}}"#,
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

    /// The id of the one added token, `<|endoftext|>`.
    const EOT: usize = 256 + MERGES.len();

    /// The tokenizers the fast path takes, by name: GPT-2's form with and
    /// without the prefix space, under NFC, with a template adding a
    /// token, and Llama 3's form with its template.
    fn tokenizers() -> Vec<(&'static str, String)> {
        let eot = &["<|endoftext|>"];
        vec![
            (
                "gpt2",
                byte_level_bpe(&MERGES, eot, "null", &gpt2(false), BYTE_LEVEL_POST),
            ),
            (
                "gpt2-prefix",
                byte_level_bpe(&MERGES, eot, "null", &gpt2(true), BYTE_LEVEL_POST),
            ),
            (
                "gpt2-nfc",
                byte_level_bpe(&MERGES, eot, r#"{"type":"NFC"}"#, &gpt2(false), "null"),
            ),
            (
                "llama3",
                byte_level_bpe(&MERGES, eot, "null", &llama3(), &bos_template(EOT)),
            ),
        ]
    }

    /// The tokenizer of `json` and its fast path (its cache by the file's
    /// digest, as `TokenizerSpec` makes it).
    fn load(json: &str, add_special_tokens: bool) -> (Tokenizer, Option<ByteLevelWords>) {
        let tokenizer = Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let digest = crate::hash::fnv1a(json.as_bytes()) ^ u64::from(add_special_tokens);
        let words = ByteLevelWords::of(&tokenizer, add_special_tokens, digest);
        (tokenizer, words)
    }

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
        for (name, json) in tokenizers() {
            let (tokenizer, words) = load(&json, true);
            let words = words.expect(name);
            for text in [
                "the weather in there",
                "  the   end\n\n\nthe's  ",
                "it's 12,345 things!\t\tok \u{a0}\u{3000}x",
                "日本語 テキスト、 и кириллица ١٢٣",
                " ",
                "\n",
                "IT'S 1234567 \r\n\r\n  x",
                "a\u{301}e\u{301} 😀😀 don't",
            ] {
                let expected = library_ids(&tokenizer, text);
                match fast_ids(&tokenizer, &words, text) {
                    Some(ids) => assert_eq!(ids, expected, "{text:?} ({name})"),
                    // NFC changes a text with a combining accent.
                    None => assert!(name.ends_with("nfc") && text.contains('\u{301}')),
                }
            }
            // Added tokens and the empty text go through the library.
            assert_eq!(fast_ids(&tokenizer, &words, "a<|endoftext|>b"), None);
            assert_eq!(fast_ids(&tokenizer, &words, ""), None);
        }
        // The template's token comes first.
        let (_, json) = &tokenizers()[3];
        let (_, words) = load(json, true);
        assert_eq!(words.unwrap().prefix, [EOT as i32]);
        assert!(load(json, false).1.unwrap().prefix.is_empty());
    }

    #[test]
    fn a_regex_that_matches_the_empty_text_takes_the_library_path() {
        // `\p{N}*` matches nothing before a letter: the library steps past
        // it, the word search would not.
        let empty = r"\p{N}*|[^\s\p{N}]+|\s+(?!\S)|\s+";
        let json = byte_level_bpe(&MERGES, &[], "null", &llama3(), BYTE_LEVEL_POST).replace(
            &serde_json::to_string(LLAMA3_REGEX).unwrap(),
            &serde_json::to_string(empty).unwrap(),
        );
        assert!(json.contains(r"\\p{N}*|"), "the regex is replaced");
        assert!(load(&json, true).1.is_none());
    }

    #[test]
    fn a_normalized_added_token_that_nfc_changes_takes_the_library_path() {
        let added = |normalized: bool| {
            byte_level_bpe(
                &MERGES,
                &["e\u{301}x"],
                r#"{"type":"NFC"}"#,
                &gpt2(false),
                "null",
            )
            .replace(
                r#""normalized":false"#,
                &format!(r#""normalized":{normalized}"#),
            )
        };
        let (tokenizer, words) = load(&added(true), true);
        assert!(words.is_none());
        // The library finds it by its NFC form.
        assert!(library_ids(&tokenizer, "caf\u{e9}x").contains(&(EOT as i32)));
        assert!(load(&added(false), true).1.is_some());
    }

    #[test]
    fn other_tokenizers_take_the_library_path() {
        let plain = byte_level_bpe(&MERGES, &[], "null", &gpt2(false), BYTE_LEVEL_POST);
        let regex_split = llama3();
        let variants = [
            plain.replace(r#""normalizer":null"#, r#""normalizer":{"type":"NFKC"}"#),
            plain.replace(r#""use_regex":true},"post"#, r#""use_regex":false},"post"#),
            plain.replace(r#""dropout":null"#, r#""dropout":0.5"#),
            // A Split whose regex does not end in GPT-2's whitespace.
            plain.replace(
                &gpt2(false),
                &regex_split.replace(r#"|\\s+(?!\\S)|\\s+"#, ""),
            ),
            // A ByteLevel that puts a space before each word of the Split.
            plain.replace(
                &gpt2(false),
                &regex_split.replace(r#""add_prefix_space":false"#, r#""add_prefix_space":true"#),
            ),
            plain.replace(&gpt2(false), r#"{"type":"Whitespace"}"#),
        ];
        for json in &variants {
            assert_ne!(json, &plain, "a variant changes the tokenizer");
            assert!(load(json, true).1.is_none(), "{json}");
        }
        assert!(load(&plain, true).1.is_some());
    }

    /// Characters of every class the regexes tell apart: letters of both
    /// cases, digits of several scripts, marks, symbols, ASCII and Unicode
    /// whitespace, line breaks, the apostrophe and the contractions'
    /// letters, and characters NFC changes.
    fn text() -> impl Strategy<Value = String> {
        let alphabet = prop::sample::select(vec![
            'a', 't', 'h', 'e', 's', 'r', 'v', 'l', 'd', 'm', 'S', 'T', 'L', '\'', ' ', ' ', ' ',
            '\n', '\t', '\r', '\u{a0}', '\u{3000}', '\u{2028}', '\u{200b}', '\u{85}', '5', '1',
            '٣', '²', 'é', '\u{301}', '\u{2126}', '日', 'и', '!', ',', '-', '😀', '\u{0}',
            '\u{7f}',
        ]);
        prop::collection::vec(alphabet, 0..40).prop_map(|c| c.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_ids_are_the_library_ids(
            texts in prop::collection::vec(text(), 1..6),
            which in 0..4usize,
        ) {
            let (name, json) = &tokenizers()[which];
            let (tokenizer, words) = load(json, true);
            let words = words.unwrap();
            // Several texts through one cache: later ones meet cached words.
            for text in &texts {
                let expected = library_ids(&tokenizer, text);
                match fast_ids(&tokenizer, &words, text) {
                    Some(ids) => prop_assert_eq!(ids, expected, "{:?} ({})", text, name),
                    None => prop_assert!(text.is_empty() || words.nfc && !is_nfc(text)),
                }
            }
        }
    }
}
