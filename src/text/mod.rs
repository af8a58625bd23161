//! Text for language models: [`tokenizer`] turns a text field into token
//! ids on the decode threads (the `shardstream.Tokenizer` transform).

pub mod tokenizer;
