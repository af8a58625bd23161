//! Tests of the stages together on real files (tar shards written to a
//! temporary folder), through the crate's public API: in the library's test
//! program, so that `cargo test` compiles the crate once.

mod pipeline;
mod resume;
