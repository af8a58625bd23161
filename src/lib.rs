//! shardstream: deterministic, shard-aware streaming of WebDataset tar
//! shards into PyTorch.
//!
//! One module per stage: [`spec`] parses the dataset spec, [`dataset`]
//! resolves it into [`shard`]s, [`plan`] assigns
//! shards to `(rank, worker)` slots before any byte is read, [`store`]
//! reaches each backend's objects, [`source`] reads their bytes ahead of
//! the parser, [`format`](mod@format) turns bytes into samples
//! without doing I/O, [`shuffle`] mixes them in a bounded buffer, and
//! [`pipeline`] wires the stages together for one slot.
#![warn(missing_docs)]

pub mod augment;
pub mod byte_size;
#[cfg(feature = "cli")]
pub mod cli;
pub mod collate;
pub mod compression;
pub mod config;
pub mod dataset;
pub mod decode;
#[cfg(test)]
mod end_to_end;
pub mod error;
pub mod fork;
pub mod format;
pub mod hash;
pub mod index;
pub mod json;
pub mod ledger;
pub mod location;
pub mod manifest;
pub mod pipeline;
pub mod plan;
pub mod shard;
pub mod shuffle;
pub mod source;
pub mod spec;
pub mod state;
pub mod stats;
pub mod store;
pub mod text;
pub mod value;
pub mod write;

/// Python bindings (the `python` feature); [`python::convert`] is public
/// for the hand-off micro benchmark.
#[cfg(feature = "python")]
pub mod python;

pub use config::{OnError, StreamOptions};
pub use error::{Error, Result};
pub use format::{Sample, SampleId};
pub use pipeline::{Event, SampleStream};
pub use plan::SlotSpec;
pub use stats::{Counters, Stats};
pub use value::{Array, ArrayData, Value};
