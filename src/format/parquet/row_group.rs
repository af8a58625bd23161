//! One row group decoded from its fetched bytes into Arrow batches.

use std::ops::Range;
use std::sync::Arc;

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::SchemaRef;
use bytes::{Buf, Bytes};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use parquet::errors::ParquetError;
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::{ChunkReader, Length};

use super::footer::chunk_range;
use crate::error::{guard, Result};
use crate::format::ShardRef;

/// The bytes of one row group span, addressed by file offsets.
struct SpanReader {
    /// File offset of the first byte of `bytes`.
    start: u64,
    /// The span's bytes.
    bytes: Bytes,
}

impl SpanReader {
    /// Indexes into `bytes` of the file range `start..start + len` (to the
    /// end of the span when `len` is `None`).
    fn local(&self, start: u64, len: Option<usize>) -> parquet::errors::Result<Range<usize>> {
        let end_of_span = self.start + self.bytes.len() as u64;
        let end = len.map_or(Some(end_of_span), |len| start.checked_add(len as u64));
        match end {
            Some(end) if start >= self.start && end <= end_of_span => {
                Ok((start - self.start) as usize..(end - self.start) as usize)
            }
            _ => Err(ParquetError::General(format!(
                "bytes {start}..{} lie outside the fetched bytes {}..{end_of_span}",
                end.map_or_else(|| "?".to_owned(), |e| e.to_string()),
                self.start
            ))),
        }
    }
}

impl Length for SpanReader {
    fn len(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

impl ChunkReader for SpanReader {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(self.bytes.slice(self.local(start, None)?).reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        Ok(self.bytes.slice(self.local(start, Some(length))?))
    }
}

/// Decodes `row_group` of a file whose metadata is `meta` from `bytes`, the
/// file's bytes starting at offset `span_start` and covering
/// [`row_group_span`](super::footer::row_group_span), into Arrow batches of up to `batch_rows` rows.
///
/// `columns` selects top-level columns by name (the batches keep the file's
/// column order); `None` reads them all. An unknown name fails with an
/// [`Error::Format`](crate::error::Error::Format) listing the file's columns; bytes that do not cover the
/// selected column chunks, or that do not decode, fail with an
/// [`Error::Format`](crate::error::Error::Format) at `span_start`.
pub fn read_row_group(
    shard: &ShardRef,
    meta: &Arc<ParquetMetaData>,
    row_group: usize,
    columns: Option<&[String]>,
    span_start: u64,
    bytes: Bytes,
    batch_rows: usize,
) -> Result<RowGroupBatches> {
    let count = meta.num_row_groups();
    if row_group >= count {
        return Err(shard.format_error(
            0,
            None,
            format!("row group {row_group} does not exist (the file has {count})"),
        ));
    }
    let row_group_error = |reason: String| {
        shard.format_error(span_start, None, format!("row group {row_group}: {reason}"))
    };

    let schema = meta.file_metadata().schema_descr();
    let mask = match columns {
        None => ProjectionMask::all(),
        Some(names) => {
            let roots = schema.root_schema().get_fields();
            let indices = names
                .iter()
                .map(|name| {
                    roots
                        .iter()
                        .position(|f| f.name() == name.as_str())
                        .ok_or_else(|| {
                            let available: Vec<&str> = roots.iter().map(|f| f.name()).collect();
                            shard.format_error(
                                0,
                                None,
                                format!("no column {name:?} (columns: {})", available.join(", ")),
                            )
                        })
                })
                .collect::<Result<Vec<usize>>>()?;
            ProjectionMask::roots(schema, indices)
        }
    };

    let metadata = meta.row_group(row_group);
    let span_end = span_start + bytes.len() as u64;
    for (leaf, column) in metadata.columns().iter().enumerate() {
        if !mask.leaf_included(leaf) {
            continue;
        }
        match chunk_range(column) {
            Some(range) if range.start >= span_start && range.end <= span_end => {}
            Some(range) => {
                return Err(row_group_error(format!(
                    "column {} needs bytes {}..{} but bytes {span_start}..{span_end} were given",
                    column.column_path(),
                    range.start,
                    range.end
                )))
            }
            None => {
                return Err(row_group_error(format!(
                    "column {}: negative offset or size",
                    column.column_path()
                )))
            }
        }
    }
    let rows = metadata.num_rows();
    let file_rows = meta.file_metadata().num_rows();
    if rows < 0 || file_rows < rows {
        return Err(row_group_error(format!(
            "{rows} rows, but the file has {file_rows} in all"
        )));
    }

    let arrow_metadata = guard(|| ArrowReaderMetadata::try_new(meta.clone(), Default::default()))
        .map_err(|reason| {
        // The parquet crate's message for a damaged embedded Arrow schema
        // ends in a flatbuffers error's Debug form: say what is wrong.
        let reason = if reason.contains("ARROW:schema") {
            "the footer's ARROW:schema metadata is damaged (it is not an Arrow schema)".into()
        } else {
            reason
        };
        shard.format_error(
            0,
            None,
            format!("cannot read the Parquet schema as Arrow: {reason}"),
        )
    })?;
    let reader = SpanReader {
        start: span_start,
        bytes,
    };
    let reader = guard(|| {
        ParquetRecordBatchReaderBuilder::new_with_metadata(reader, arrow_metadata)
            .with_row_groups(vec![row_group])
            .with_projection(mask)
            .with_batch_size(batch_rows.max(1))
            .build()
    })
    .map_err(row_group_error)?;
    Ok(RowGroupBatches {
        schema: reader.schema(),
        reader: Some(reader),
        shard: shard.clone(),
        row_group,
        span_start,
        rows: rows as u64,
        next_row: 0,
    })
}

/// The Arrow batches of one row group, from [`read_row_group`]. Ends after
/// the first error.
pub struct RowGroupBatches {
    /// The decoder; `None` once it ended or failed.
    reader: Option<ParquetRecordBatchReader>,
    /// Schema of the batches.
    schema: SchemaRef,
    /// The file, for errors.
    shard: ShardRef,
    /// Index of the row group.
    row_group: usize,
    /// File offset of the row group's bytes, for errors.
    span_start: u64,
    /// Row count from the metadata.
    rows: u64,
    /// Rows returned so far.
    next_row: u64,
}

impl RowGroupBatches {
    /// The Arrow schema of the batches (the selected columns).
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// Index within the row group of the next batch's first row: pass it to
    /// [`batch_to_samples`](super::rows::batch_to_samples) as `first_row` before taking the batch.
    pub fn next_row(&self) -> u64 {
        self.next_row
    }

    /// Number of rows in the row group.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Ends the iteration with an error about this row group.
    fn fail(&mut self, reason: String) -> Option<Result<RecordBatch>> {
        self.reader = None;
        Some(Err(self.shard.format_error(
            self.span_start,
            None,
            format!("row group {}: {reason}", self.row_group),
        )))
    }
}

impl std::fmt::Debug for RowGroupBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowGroupBatches")
            .field("url", &self.shard.url)
            .field("row_group", &self.row_group)
            .field("rows", &self.rows)
            .field("next_row", &self.next_row)
            .finish_non_exhaustive()
    }
}

impl Iterator for RowGroupBatches {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        let reader = self.reader.as_mut()?;
        match guard(|| reader.next().transpose()) {
            Ok(Some(batch)) => {
                self.next_row += batch.num_rows() as u64;
                if self.next_row > self.rows {
                    return self.fail(format!(
                        "decoded more rows than the {} of the metadata",
                        self.rows
                    ));
                }
                Some(Ok(batch))
            }
            Ok(None) if self.next_row != self.rows => self.fail(format!(
                "decoded {} rows, the metadata says {}",
                self.next_row, self.rows
            )),
            Ok(None) => {
                self.reader = None;
                None
            }
            Err(reason) => self.fail(reason),
        }
    }
}
