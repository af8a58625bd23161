//! What the pipeline thread hands the stream: samples, table batches and
//! skipped shards, and the compression found of each shard, shared by the
//! pipeline's threads.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;

use crate::compression::Compression;
use crate::error::Error;
use crate::format::Sample;

/// Rows of one row group as an Arrow record batch.
#[derive(Debug)]
pub struct TableBatch {
    /// The Parquet file's URL.
    pub url: Arc<str>,
    /// Index in the file of the batch's first row.
    pub first_row: u64,
    /// The rows.
    pub batch: RecordBatch,
}

/// What the stream yields besides samples.
#[derive(Debug)]
pub enum Event {
    /// The next sample.
    Sample(Sample),
    /// The next rows of a table, with `TableOutput::Arrow`.
    Batch(TableBatch),
    /// A bad shard was skipped under `on_error="warn"`; the rest goes on.
    Skipped(Error),
}

impl Event {
    /// The samples (or table rows) the event hands out.
    pub(crate) fn samples(&self) -> u64 {
        match self {
            Event::Sample(_) => 1,
            Event::Batch(table) => table.batch.num_rows() as u64,
            Event::Skipped(_) => 0,
        }
    }
}

/// The compression of each compressed shard read so far, by shard index.
pub(crate) type CompressedShards = Arc<Mutex<HashMap<usize, Compression>>>;
