//! One shard of a dataset: where it lives, what it holds and, when a
//! manifest gave them, the byte spans of its samples. Resolution makes
//! shards; the plan, the pipeline and resumes read them.

use std::ops::Range;
use std::sync::Arc;

use parquet::file::metadata::ParquetMetaData;
use serde::{Deserialize, Serialize};

use crate::compression::Compression;
use crate::location::Location;
use crate::plan::ShardInfo;

/// What a shard holds and how it is read. A Parquet file is never a
/// shard: resolution reads its footer and makes each row group one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardKind {
    /// A tar archive, plain or compressed: many samples grouped by key.
    Tar,
    /// One raw object: one sample.
    Raw,
    /// A JSON-lines file, plain or compressed: one sample per line.
    Lines,
    /// One row group of a Parquet file.
    Parquet(Arc<RowGroup>),
}

impl ShardKind {
    /// Whether a manifest gives this kind of shard its samples' byte spans
    /// (a stream of samples: tar or JSON lines); a row group or a raw
    /// object knows its count without one.
    pub fn has_manifest_spans(&self) -> bool {
        matches!(self, ShardKind::Tar | ShardKind::Lines)
    }
}

/// One row group of a Parquet file, as its footer describes it.
#[derive(Debug)]
pub struct RowGroup {
    /// The file's footer.
    pub metadata: Arc<ParquetMetaData>,
    /// Row group index in the file.
    pub index: usize,
    /// Bytes of the file holding the row group's column chunks.
    pub span: Range<u64>,
    /// Rows in the row group.
    pub rows: u64,
    /// Index in the file of the row group's first row.
    pub first_row: u64,
    /// Size of the whole file in bytes.
    pub file_size: u64,
    /// The token counts of the row group's rows, when a manifest records
    /// the file's (`shardstream index --count-tokens`).
    pub tokens: Option<Arc<ShardTokens>>,
}

impl PartialEq for RowGroup {
    fn eq(&self, other: &Self) -> bool {
        (
            self.index,
            &self.span,
            self.rows,
            self.first_row,
            self.file_size,
            &self.tokens,
        ) == (
            other.index,
            &other.span,
            other.rows,
            other.first_row,
            other.file_size,
            &other.tokens,
        )
    }
}

impl Eq for RowGroup {}

/// One shard of the dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The URL as the user spelled it (after brace expansion); becomes `__url__`.
    pub url: String,
    /// Size in bytes, when known.
    pub size: Option<u64>,
    /// Byte spans of its samples, from a manifest.
    pub index: Option<Arc<SampleIndex>>,
    /// The object's ETag, when a listing (or, for an object named outright,
    /// its manifest) gave it.
    pub etag: Option<String>,
    /// The modification time (nanoseconds since the epoch) that the
    /// manifest records for a local file, which the file must still have.
    pub mtime_ns: Option<u64>,
    /// What the shard holds.
    pub kind: ShardKind,
}

impl Shard {
    /// A shard known by URL and maybe size, without a sample index.
    pub fn new(url: impl Into<String>, size: Option<u64>) -> Self {
        Shard {
            url: url.into(),
            size,
            index: None,
            etag: None,
            mtime_ns: None,
            kind: ShardKind::Tar,
        }
    }

    /// What the plan knows of this shard.
    pub fn info(&self) -> ShardInfo {
        let samples = match &self.kind {
            ShardKind::Raw => Some(1),
            ShardKind::Parquet(group) => Some(group.rows),
            ShardKind::Tar | ShardKind::Lines => self.index.as_ref().map(|i| i.len()),
        };
        ShardInfo {
            size: self.size,
            samples,
        }
    }

    /// Its samples' token counts, when a manifest records them: a tar or
    /// JSON-lines shard's in its sample index, a row group's in the row
    /// group.
    pub fn tokens(&self) -> Option<&Arc<ShardTokens>> {
        match &self.kind {
            ShardKind::Parquet(group) => group.tokens.as_ref(),
            _ => self.index.as_ref().and_then(|index| index.tokens()),
        }
    }

    /// Where the shard's bytes live.
    pub fn location(&self) -> Location {
        Location::parse(&self.url)
    }
}

/// The token counts of a shard's samples, and how they were counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardTokens {
    /// The field counted.
    pub field: String,
    /// The tokenizer that made the field's ids, as `Tokenizer(digest=...,
    /// bos=..., eos=..., add_special_tokens=...)`; `None` when the field
    /// holds token ids already.
    pub tokenizer: Option<String>,
    /// Tokens of each sample, in order.
    pub counts: Vec<u64>,
}

/// Byte spans of a shard's samples (and their token counts, when the
/// manifest has them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleIndex {
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    compression: Option<Compression>,
    tokens: Option<Arc<ShardTokens>>,
}

impl SampleIndex {
    /// The index of a plain tar shard from its samples' `(offset, length)`
    /// spans, in order.
    pub fn from_spans(spans: &[(u64, u64)]) -> Self {
        SampleIndex {
            offsets: spans.iter().map(|s| s.0).collect(),
            lengths: spans.iter().map(|s| s.1).collect(),
            compression: None,
            tokens: None,
        }
    }

    /// An index of the spans `offsets[i]..offsets[i] + lengths[i]` (as
    /// [`SampleIndex::offset`] and [`SampleIndex::length`] give them back)
    /// of a shard with `compression`; `None` unless there are as many
    /// lengths as offsets.
    pub fn from_parts(
        offsets: Vec<u64>,
        lengths: Vec<u64>,
        compression: Option<Compression>,
    ) -> Option<Self> {
        (offsets.len() == lengths.len()).then_some(SampleIndex {
            offsets,
            lengths,
            compression,
            tokens: None,
        })
    }

    /// The index with its samples' token counts (one per sample, checked
    /// by the manifest).
    pub fn with_tokens(mut self, tokens: Option<Arc<ShardTokens>>) -> Self {
        self.tokens = tokens;
        self
    }

    /// The samples' token counts, when the manifest has them.
    pub fn tokens(&self) -> Option<&Arc<ShardTokens>> {
        self.tokens.as_ref()
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.offsets.len() as u64
    }

    /// Whether the shard has no samples.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Byte offset of sample `index`.
    pub fn offset(&self, index: u64) -> u64 {
        self.offsets[index as usize]
    }

    /// Byte length of sample `index`.
    pub fn length(&self, index: u64) -> u64 {
        self.lengths[index as usize]
    }

    /// The shard's compression: its spans are then offsets in the
    /// decompressed tar, and no byte range of the shard holds a sample alone.
    pub fn compression(&self) -> Option<Compression> {
        self.compression
    }

    /// The bytes a read of `samples` (non-empty, within the shard) of a
    /// plain shard of `size` bytes (when known) fetches: from the first
    /// one's offset (from the shard's first byte for its first sample) to
    /// the next sample's, or, after the shard's last sample, to its end.
    /// The read then sees where its last sample really ends (a member of it
    /// past its recorded length is found, not cut off), and every sample
    /// the manifest leaves out before its first sample, between two of
    /// its samples or after its last one lies in some read.
    pub fn read_range(&self, samples: &Range<u64>, size: Option<u64>) -> Range<u64> {
        let last = samples.end as usize - 1;
        let last_end = self.offsets[last] + self.lengths[last];
        let end = match self.offsets.get(samples.end as usize) {
            Some(&next) => next,
            None => size.filter(|&size| size >= last_end).unwrap_or(last_end),
        };
        let start = match samples.start {
            0 => 0,
            start => self.offsets[start as usize],
        };
        start..end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ranges() {
        let index = SampleIndex {
            offsets: vec![0, 1024, 3072],
            lengths: vec![1024, 2048, 512],
            compression: None,
            tokens: None,
        };
        assert_eq!(index.read_range(&(1..3), Some(10240)), 1024..10240);
        assert_eq!(index.read_range(&(1..3), None), 1024..3584);
        assert_eq!(index.read_range(&(0..1), Some(10240)), 0..1024);
        assert_eq!(index.read_range(&(0..2), None), 0..3072);
        // The first sample's read starts at the shard's first byte.
        let later = SampleIndex {
            offsets: vec![512, 1536],
            ..index
        };
        assert_eq!(later.read_range(&(0..1), None), 0..1536);
        assert_eq!(later.read_range(&(1..2), None), 1536..3584);
    }
}
