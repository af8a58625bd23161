//! Text for language models: [`tokenizer`] turns a text field into token
//! ids on the decode threads (the `shardstream.Tokenizer` transform;
//! [`byte_level`] the same ids faster for byte-level BPE tokenizers), and
//! [`pack`] lays the documents' ids into fixed-length sequences (the
//! `pack` option, `shardstream.Pack`), planned across ranks by [`counts`].

mod byte_level;
pub mod counts;
pub mod pack;
pub mod tokenizer;
