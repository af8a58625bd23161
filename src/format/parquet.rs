//! Parquet: footers and row groups decoded into Arrow batches and rows.
//!
//! Like every format, this module does no I/O: the caller fetches bytes and
//! hands them over. Reading a file goes:
//!
//! 1. fetch the last [`FOOTER_PROBE`] bytes (or the whole file, if smaller)
//!    and call [`decode_footer`]; on [`FooterDecode::NeedTail`] fetch that
//!    many tail bytes and call it again;
//! 2. for each row group (the unit of work), fetch the bytes of
//!    [`row_group_span`] and decode them with [`read_row_group`] into Arrow
//!    batches;
//! 3. for per-row output, turn each batch into [`Sample`]s with
//!    [`batch_to_samples`], whose values match pyarrow's `to_pylist()`.
//!
//! Every failure is an [`Error::Format`] naming the file's URL and a byte
//! offset; a panic inside the Parquet decoder on corrupt bytes is caught and
//! reported the same way.

use std::ops::Range;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{
    Array, BinaryArray, BinaryViewArray, BooleanArray, FixedSizeBinaryArray, FixedSizeListArray,
    Float16Array, Float32Array, Float64Array, GenericListArray, Int16Array, Int32Array, Int64Array,
    Int8Array, LargeBinaryArray, LargeListArray, LargeStringArray, ListArray, MapArray,
    OffsetSizeTrait, RecordBatch, RecordBatchReader, StringArray, StringViewArray, UInt16Array,
    UInt32Array, UInt64Array, UInt8Array,
};
use arrow_schema::{DataType, SchemaRef};
use bytes::{Buf, Bytes};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use parquet::errors::ParquetError;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData, ParquetMetaDataReader};
use parquet::file::reader::{ChunkReader, Length};

use super::{Sample, SampleId, ShardRef};
use crate::error::{guard, Error, Result};
use crate::value::Value;

/// How many bytes at the end of a Parquet file a caller should fetch first:
/// enough for the footer of most files, so one request usually suffices.
pub const FOOTER_PROBE: u64 = 64 * 1024;

/// The fixed end of a Parquet file: 4 bytes of metadata length, then `PAR1`.
const FOOTER_LEN: u64 = 8;
/// The magic at both ends of a Parquet file.
const MAGIC: &[u8; 4] = b"PAR1";
/// The magic ending a file with an encrypted footer.
const MAGIC_ENCRYPTED: &[u8; 4] = b"PARE";
/// The smallest possible file: leading magic, metadata length, trailing magic.
const MIN_FILE_LEN: u64 = 12;

/// What [`decode_footer`] made of the tail bytes it was given.
#[derive(Debug, Clone)]
pub enum FooterDecode {
    /// The file's metadata, checked to be consistent with the file size.
    Metadata(Arc<ParquetMetaData>),
    /// The metadata is longer than the tail given: fetch this many bytes
    /// from the end of the file and call [`decode_footer`] again.
    NeedTail(u64),
}

/// An [`Error::Format`] about the file at `url`.
fn format_error(url: &str, offset: u64, reason: impl Into<String>) -> Error {
    Error::Format {
        url: url.to_owned(),
        offset,
        compression: None,
        member: None,
        reason: reason.into(),
    }
}

/// Decodes a Parquet footer from `tail`, the last `tail.len()` bytes of a
/// file of `file_size` bytes at `url`.
///
/// Returns [`FooterDecode::NeedTail`] when `tail` is too short to hold the
/// metadata (or the 8-byte footer). Fails with [`Error::Format`] when the
/// file is too short, lacks the `PAR1` magic, declares metadata longer than
/// the file, has metadata that does not decode, or has column chunks that
/// lie outside the file's data.
pub fn decode_footer(url: &str, file_size: u64, tail: &[u8]) -> Result<FooterDecode> {
    if file_size < MIN_FILE_LEN {
        return Err(format_error(
            url,
            0,
            format!(
                "not a Parquet file ({file_size} bytes, shorter than the {MIN_FILE_LEN} bytes of an empty one)"
            ),
        ));
    }
    let tail_len = tail.len() as u64;
    if tail_len > file_size {
        return Err(format_error(
            url,
            0,
            format!("{tail_len} tail bytes given for a file of {file_size} bytes"),
        ));
    }
    if tail_len < FOOTER_LEN {
        return Ok(FooterDecode::NeedTail(FOOTER_PROBE.min(file_size)));
    }
    let footer_offset = file_size - FOOTER_LEN;
    let footer = &tail[tail.len() - FOOTER_LEN as usize..];
    let magic = &footer[4..];
    if magic == MAGIC_ENCRYPTED {
        return Err(format_error(
            url,
            file_size - 4,
            "encrypted Parquet footer (PARE magic) is not supported",
        ));
    }
    if magic != MAGIC {
        return Err(format_error(
            url,
            file_size - 4,
            "not a Parquet file (no PAR1 magic at the end)",
        ));
    }
    let metadata_len = u64::from(u32::from_le_bytes([
        footer[0], footer[1], footer[2], footer[3],
    ]));
    if metadata_len + MIN_FILE_LEN > file_size {
        return Err(format_error(
            url,
            footer_offset,
            format!(
                "Parquet metadata length {metadata_len} runs past the start of the file ({file_size} bytes)"
            ),
        ));
    }
    let needed = metadata_len + FOOTER_LEN;
    if tail_len < needed {
        return Ok(FooterDecode::NeedTail(needed));
    }
    if tail_len == file_size && &tail[..4] != MAGIC {
        return Err(format_error(
            url,
            0,
            "not a Parquet file (no PAR1 magic at the start)",
        ));
    }
    let metadata_start = file_size - needed;
    let buf = &tail[tail.len() - needed as usize..tail.len() - FOOTER_LEN as usize];
    let metadata = guard(|| ParquetMetaDataReader::decode_metadata(buf)).map_err(|reason| {
        format_error(
            url,
            metadata_start,
            format!("undecodable Parquet metadata: {reason}"),
        )
    })?;
    check_layout(&metadata, metadata_start)
        .map_err(|reason| format_error(url, metadata_start, reason))?;
    Ok(FooterDecode::Metadata(Arc::new(metadata)))
}

/// Checks that row counts are not negative and every column chunk lies
/// within the file's data, which ends where the metadata starts.
fn check_layout(metadata: &ParquetMetaData, data_end: u64) -> std::result::Result<(), String> {
    for (i, row_group) in metadata.row_groups().iter().enumerate() {
        if row_group.num_rows() < 0 {
            return Err(format!(
                "row group {i} has a negative row count ({})",
                row_group.num_rows()
            ));
        }
        for column in row_group.columns() {
            match chunk_range(column) {
                Some(range) if range.end <= data_end => {}
                Some(range) => {
                    return Err(format!(
                        "row group {i} column {}: bytes {}..{} run past the end of the data (the metadata starts at {data_end})",
                        column.column_path(),
                        range.start,
                        range.end
                    ))
                }
                None => {
                    return Err(format!(
                        "row group {i} column {}: negative offset or size",
                        column.column_path()
                    ))
                }
            }
        }
    }
    Ok(())
}

/// The bytes of a column chunk in the file (from its dictionary page, if
/// any), as the decoder reads them; `None` for negative or overflowing
/// values.
fn chunk_range(column: &ColumnChunkMetaData) -> Option<Range<u64>> {
    let start = column
        .dictionary_page_offset()
        .unwrap_or(column.data_page_offset());
    let start = u64::try_from(start).ok()?;
    let len = u64::try_from(column.compressed_size()).ok()?;
    Some(start..start.checked_add(len)?)
}

/// The byte range of the file covering every column chunk of `row_group`
/// (dictionary pages included): the bytes [`read_row_group`] needs.
///
/// Empty for a row group without columns. Panics if `row_group` is out of
/// range; metadata from [`decode_footer`] has been checked to hold valid
/// chunk ranges.
pub fn row_group_span(meta: &ParquetMetaData, row_group: usize) -> Range<u64> {
    meta.row_group(row_group)
        .columns()
        .iter()
        .filter_map(chunk_range)
        .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
        .unwrap_or(0..0)
}

/// Number of rows in `row_group`. Panics if `row_group` is out of range.
pub fn row_group_rows(meta: &ParquetMetaData, row_group: usize) -> u64 {
    u64::try_from(meta.row_group(row_group).num_rows()).unwrap_or(0)
}

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
/// [`row_group_span`], into Arrow batches of up to `batch_rows` rows.
///
/// `columns` selects top-level columns by name (the batches keep the file's
/// column order); `None` reads them all. An unknown name fails with an
/// [`Error::Format`] listing the file's columns; bytes that do not cover the
/// selected column chunks, or that do not decode, fail with an
/// [`Error::Format`] at `span_start`.
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
    /// [`batch_to_samples`] as `first_row` before taking the batch.
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

/// Turns the rows of `batch` into samples: row `i` becomes the sample with
/// index `first_row + i` (its row within the row group), key
/// `{key_prefix}{first_row + i}` (pass a prefix that makes keys unique in
/// the file, such as `"rg3/"`), offset and length 0, and one field per
/// column in schema order.
///
/// Values are what pyarrow's `to_pylist()` gives: integers, floats,
/// strings, bytes, lists, dicts for structs, lists of `(key, value)` tuples
/// for maps, decoded values for dictionaries and `None` for nulls at any
/// depth. A column of another type (dates, times, timestamps, decimals...)
/// fails with an [`Error::Format`] rather than being dropped.
pub fn batch_to_samples(
    shard: &ShardRef,
    key_prefix: &str,
    batch: &RecordBatch,
    first_row: u64,
) -> Result<Vec<Sample>> {
    let columns = batch
        .schema_ref()
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(field, array)| {
            Column::new(array.as_ref())
                .map(|column| (field.name().as_str(), column))
                .map_err(|data_type| {
                    shard.format_error(
                        0,
                        None,
                        format!(
                            "column {:?}: type {data_type} is not supported in per-row output; use batch_format=\"arrow\"",
                            field.name()
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((0..batch.num_rows())
        .map(|i| {
            let index = first_row + i as u64;
            Sample {
                id: SampleId {
                    shard: shard.index,
                    index,
                },
                key: format!("{key_prefix}{index}"),
                url: shard.url.clone(),
                fields: columns
                    .iter()
                    .map(|(name, column)| ((*name).to_owned(), column.value(i)))
                    .collect(),
                offset: 0,
                length: 0,
            }
        })
        .collect())
}

/// An Arrow array downcast once, with its children, for reading values
/// row by row.
struct Column<'a> {
    /// The array, for its nulls.
    array: &'a dyn Array,
    /// The typed view.
    kind: Kind<'a>,
}

/// The typed view of a [`Column`].
enum Kind<'a> {
    Null,
    Bool(&'a BooleanArray),
    I8(&'a Int8Array),
    I16(&'a Int16Array),
    I32(&'a Int32Array),
    I64(&'a Int64Array),
    U8(&'a UInt8Array),
    U16(&'a UInt16Array),
    U32(&'a UInt32Array),
    U64(&'a UInt64Array),
    F16(&'a Float16Array),
    F32(&'a Float32Array),
    F64(&'a Float64Array),
    Str(&'a StringArray),
    LargeStr(&'a LargeStringArray),
    StrView(&'a StringViewArray),
    Bin(&'a BinaryArray),
    LargeBin(&'a LargeBinaryArray),
    BinView(&'a BinaryViewArray),
    FixedBin(&'a FixedSizeBinaryArray),
    List(&'a ListArray, Box<Column<'a>>),
    LargeList(&'a LargeListArray, Box<Column<'a>>),
    FixedList(&'a FixedSizeListArray, Box<Column<'a>>),
    Struct(Vec<(&'a str, Column<'a>)>),
    Map(&'a MapArray, Box<Column<'a>>, Box<Column<'a>>),
    /// Keys clamped into the values' range (null keys are checked first).
    Dict(Vec<usize>, Box<Column<'a>>),
}

impl<'a> Column<'a> {
    /// Downcasts `array` and its children; the unsupported type on failure.
    fn new(array: &'a dyn Array) -> std::result::Result<Self, DataType> {
        let child = |a: &'a dyn Array| Column::new(a).map(Box::new);
        let kind = match array.data_type() {
            DataType::Null => Kind::Null,
            DataType::Boolean => Kind::Bool(array.as_boolean()),
            DataType::Int8 => Kind::I8(array.as_primitive::<Int8Type>()),
            DataType::Int16 => Kind::I16(array.as_primitive::<Int16Type>()),
            DataType::Int32 => Kind::I32(array.as_primitive::<Int32Type>()),
            DataType::Int64 => Kind::I64(array.as_primitive::<Int64Type>()),
            DataType::UInt8 => Kind::U8(array.as_primitive::<UInt8Type>()),
            DataType::UInt16 => Kind::U16(array.as_primitive::<UInt16Type>()),
            DataType::UInt32 => Kind::U32(array.as_primitive::<UInt32Type>()),
            DataType::UInt64 => Kind::U64(array.as_primitive::<UInt64Type>()),
            DataType::Float16 => Kind::F16(array.as_primitive::<Float16Type>()),
            DataType::Float32 => Kind::F32(array.as_primitive::<Float32Type>()),
            DataType::Float64 => Kind::F64(array.as_primitive::<Float64Type>()),
            DataType::Utf8 => Kind::Str(array.as_string::<i32>()),
            DataType::LargeUtf8 => Kind::LargeStr(array.as_string::<i64>()),
            DataType::Utf8View => Kind::StrView(array.as_string_view()),
            DataType::Binary => Kind::Bin(array.as_binary::<i32>()),
            DataType::LargeBinary => Kind::LargeBin(array.as_binary::<i64>()),
            DataType::BinaryView => Kind::BinView(array.as_binary_view()),
            DataType::FixedSizeBinary(_) => Kind::FixedBin(array.as_fixed_size_binary()),
            DataType::List(_) => {
                let list = array.as_list::<i32>();
                Kind::List(list, child(list.values().as_ref())?)
            }
            DataType::LargeList(_) => {
                let list = array.as_list::<i64>();
                Kind::LargeList(list, child(list.values().as_ref())?)
            }
            DataType::FixedSizeList(_, _) => {
                let list = array.as_fixed_size_list();
                Kind::FixedList(list, child(list.values().as_ref())?)
            }
            DataType::Struct(_) => {
                let array = array.as_struct();
                Kind::Struct(
                    array
                        .column_names()
                        .into_iter()
                        .zip(array.columns())
                        .map(|(name, column)| Ok((name, Column::new(column.as_ref())?)))
                        .collect::<std::result::Result<_, DataType>>()?,
                )
            }
            DataType::Map(_, _) => {
                let map = array.as_map();
                Kind::Map(
                    map,
                    child(map.keys().as_ref())?,
                    child(map.values().as_ref())?,
                )
            }
            DataType::Dictionary(_, _) => {
                let dictionary = array.as_any_dictionary();
                Kind::Dict(
                    dictionary.normalized_keys(),
                    child(dictionary.values().as_ref())?,
                )
            }
            other => return Err(other.clone()),
        };
        Ok(Column { array, kind })
    }

    /// The value at `row`.
    fn value(&self, row: usize) -> Value {
        if self.array.is_null(row) {
            return Value::Null;
        }
        match &self.kind {
            Kind::Null => Value::Null,
            Kind::Bool(a) => Value::Bool(a.value(row)),
            Kind::I8(a) => Value::Int(a.value(row).into()),
            Kind::I16(a) => Value::Int(a.value(row).into()),
            Kind::I32(a) => Value::Int(a.value(row).into()),
            Kind::I64(a) => Value::Int(a.value(row)),
            Kind::U8(a) => Value::Int(a.value(row).into()),
            Kind::U16(a) => Value::Int(a.value(row).into()),
            Kind::U32(a) => Value::Int(a.value(row).into()),
            Kind::U64(a) => Value::UInt(a.value(row)),
            Kind::F16(a) => Value::Float(a.value(row).to_f64()),
            Kind::F32(a) => Value::Float(a.value(row).into()),
            Kind::F64(a) => Value::Float(a.value(row)),
            Kind::Str(a) => Value::Str(a.value(row).to_owned()),
            Kind::LargeStr(a) => Value::Str(a.value(row).to_owned()),
            Kind::StrView(a) => Value::Str(a.value(row).to_owned()),
            Kind::Bin(a) => Value::Bytes(Bytes::copy_from_slice(a.value(row))),
            Kind::LargeBin(a) => Value::Bytes(Bytes::copy_from_slice(a.value(row))),
            Kind::BinView(a) => Value::Bytes(Bytes::copy_from_slice(a.value(row))),
            Kind::FixedBin(a) => Value::Bytes(Bytes::copy_from_slice(a.value(row))),
            Kind::List(a, items) => items.list(list_range(a, row)),
            Kind::LargeList(a, items) => items.list(list_range(a, row)),
            Kind::FixedList(a, items) => {
                let start = a.value_offset_at(row);
                items.list(start..start + a.value_length() as usize)
            }
            Kind::Struct(fields) => Value::Map(
                fields
                    .iter()
                    .map(|(name, field)| ((*name).to_owned(), field.value(row)))
                    .collect(),
            ),
            Kind::Map(a, keys, values) => {
                let offsets = a.value_offsets();
                let range = offsets[row] as usize..offsets[row + 1] as usize;
                Value::List(
                    range
                        .map(|i| Value::Tuple(vec![keys.value(i), values.value(i)]))
                        .collect(),
                )
            }
            Kind::Dict(keys, values) => values.value(keys[row]),
        }
    }

    /// The values at `rows`, as a list.
    fn list(&self, rows: Range<usize>) -> Value {
        Value::List(rows.map(|i| self.value(i)).collect())
    }
}

/// The child rows of list entry `row`.
fn list_range<O: OffsetSizeTrait>(list: &GenericListArray<O>, row: usize) -> Range<usize> {
    let offsets = list.value_offsets();
    offsets[row].as_usize()..offsets[row + 1].as_usize()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::builder::{
        Int32Builder, Int64Builder, ListBuilder, MapBuilder, StringBuilder, StructBuilder,
    };
    use arrow_array::types::ArrowPrimitiveType;
    use arrow_array::{ArrayRef, DictionaryArray, NullArray};
    use arrow_schema::{Field, Fields};
    use parquet::arrow::ArrowWriter;
    use parquet::basic::{Compression, GzipLevel, ZstdLevel};
    use parquet::file::properties::WriterProperties;

    const URL: &str = "s3://bucket/table/part-00000.parquet";
    const ROWS: usize = 30;
    const ROW_GROUP_ROWS: usize = 7;
    const COLUMNS: &str = "id, name, tag, score, items, attrs, blob, big";

    fn shard() -> ShardRef {
        ShardRef::whole(3, URL.into())
    }

    fn s(text: &str) -> Value {
        Value::Str(text.to_owned())
    }

    fn codecs() -> Vec<Compression> {
        vec![
            Compression::SNAPPY,
            Compression::ZSTD(ZstdLevel::default()),
            Compression::GZIP(GzipLevel::default()),
            Compression::LZ4_RAW,
        ]
    }

    // The test table, row by row, as the values `to_pylist()` gives.
    fn name(i: usize) -> Option<String> {
        (i % 5 != 3).then(|| format!("name-{i}"))
    }
    fn tag(i: usize) -> Option<&'static str> {
        (i % 7 != 6).then(|| ["cat", "dog", "bird"][i % 3])
    }
    /// `None` for a null list; per item, `None` for a null struct, else
    /// (a, b).
    #[allow(clippy::type_complexity)]
    fn items(i: usize) -> Option<Vec<Option<(i32, Option<String>)>>> {
        (i % 4 != 1).then(|| {
            (0..i % 3)
                .map(|j| {
                    (!(i.is_multiple_of(5) && j == 0))
                        .then(|| ((i * 10 + j) as i32, (j != 1).then(|| format!("b{i}.{j}"))))
                })
                .collect()
        })
    }
    fn attrs(i: usize) -> Option<Vec<(String, Option<i64>)>> {
        (i % 9 != 8).then(|| {
            (0..=i % 2)
                .map(|j| (format!("k{j}"), (j != 1).then_some((i * 7 + j) as i64)))
                .collect()
        })
    }

    fn expected_row(i: usize) -> Vec<(String, Value)> {
        let opt = |v: Option<Value>| v.unwrap_or(Value::Null);
        vec![
            ("id".into(), Value::Int(i as i64)),
            ("name".into(), opt(name(i).map(Value::Str))),
            ("tag".into(), opt(tag(i).map(s))),
            ("score".into(), Value::Float(i as f64 * 0.5)),
            (
                "items".into(),
                opt(items(i).map(|items| {
                    Value::List(
                        items
                            .into_iter()
                            .map(|item| {
                                opt(item.map(|(a, b)| {
                                    Value::Map(vec![
                                        ("a".into(), Value::Int(a.into())),
                                        ("b".into(), opt(b.map(Value::Str))),
                                    ])
                                }))
                            })
                            .collect(),
                    )
                })),
            ),
            (
                "attrs".into(),
                opt(attrs(i).map(|entries| {
                    Value::List(
                        entries
                            .into_iter()
                            .map(|(k, v)| Value::Tuple(vec![Value::Str(k), opt(v.map(Value::Int))]))
                            .collect(),
                    )
                })),
            ),
            ("blob".into(), Value::from(vec![i as u8; i % 4])),
            ("big".into(), Value::UInt(u64::MAX - i as u64)),
        ]
    }

    fn table(rows: Range<usize>) -> RecordBatch {
        let item_fields = Fields::from(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Utf8, true),
        ]);
        let mut items_builder = ListBuilder::new(StructBuilder::new(
            item_fields,
            vec![
                Box::new(Int32Builder::new()),
                Box::new(StringBuilder::new()),
            ],
        ));
        let mut attrs_builder = MapBuilder::new(None, StringBuilder::new(), Int64Builder::new());
        for i in rows.clone() {
            match items(i) {
                None => items_builder.append(false),
                Some(list) => {
                    let structs = items_builder.values();
                    for item in list {
                        let (a, b) = item.clone().unwrap_or((0, None));
                        structs
                            .field_builder::<Int32Builder>(0)
                            .unwrap()
                            .append_value(a);
                        structs
                            .field_builder::<StringBuilder>(1)
                            .unwrap()
                            .append_option(b);
                        structs.append(item.is_some());
                    }
                    items_builder.append(true);
                }
            }
            match attrs(i) {
                None => attrs_builder.append(false).unwrap(),
                Some(entries) => {
                    for (k, v) in entries {
                        attrs_builder.keys().append_value(k);
                        attrs_builder.values().append_option(v);
                    }
                    attrs_builder.append(true).unwrap();
                }
            }
        }
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                "id",
                Arc::new(Int64Array::from_iter_values(rows.clone().map(|i| i as i64))),
            ),
            (
                "name",
                Arc::new(rows.clone().map(name).collect::<StringArray>()),
            ),
            (
                "tag",
                Arc::new(
                    rows.clone()
                        .map(tag)
                        .collect::<DictionaryArray<Int32Type>>(),
                ),
            ),
            (
                "score",
                Arc::new(Float32Array::from_iter_values(
                    rows.clone().map(|i| i as f32 * 0.5),
                )),
            ),
            ("items", Arc::new(items_builder.finish())),
            ("attrs", Arc::new(attrs_builder.finish())),
            (
                "blob",
                Arc::new(BinaryArray::from_iter_values(
                    rows.clone().map(|i| vec![i as u8; i % 4]),
                )),
            ),
            (
                "big",
                Arc::new(UInt64Array::from_iter_values(
                    rows.map(|i| u64::MAX - i as u64),
                )),
            ),
        ];
        RecordBatch::try_from_iter(columns).unwrap()
    }

    fn write_file(compression: Compression) -> Vec<u8> {
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
            .set_compression(compression)
            .set_dictionary_enabled(true)
            .build();
        let batch = table(0..ROWS);
        let mut file = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut file, batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        file
    }

    fn metadata(file: &[u8]) -> Arc<ParquetMetaData> {
        match decode_footer(URL, file.len() as u64, file).unwrap() {
            FooterDecode::Metadata(meta) => meta,
            FooterDecode::NeedTail(n) => panic!("whole file given, yet {n} bytes needed"),
        }
    }

    fn read(
        file: &[u8],
        meta: &Arc<ParquetMetaData>,
        row_group: usize,
        columns: Option<&[String]>,
    ) -> Result<Vec<RecordBatch>> {
        let span = row_group_span(meta, row_group);
        let bytes = Bytes::copy_from_slice(&file[span.start as usize..span.end as usize]);
        read_row_group(&shard(), meta, row_group, columns, span.start, bytes, 3)?.collect()
    }

    /// Every sample of the file, reading the row groups from their spans.
    fn read_samples(file: &[u8], columns: Option<&[String]>) -> Vec<Sample> {
        let meta = metadata(file);
        let mut samples = Vec::new();
        for rg in 0..meta.num_row_groups() {
            let span = row_group_span(&meta, rg);
            let bytes = Bytes::copy_from_slice(&file[span.start as usize..span.end as usize]);
            let mut batches =
                read_row_group(&shard(), &meta, rg, columns, span.start, bytes, 3).unwrap();
            assert_eq!(batches.rows(), row_group_rows(&meta, rg));
            loop {
                let first_row = batches.next_row();
                let Some(batch) = batches.next() else { break };
                let batch = batch.unwrap();
                assert!(batch.num_rows() <= 3);
                assert_eq!(batch.schema(), batches.schema());
                samples.extend(
                    batch_to_samples(&shard(), &format!("rg{rg}/"), &batch, first_row).unwrap(),
                );
            }
            assert_eq!(batches.next_row(), row_group_rows(&meta, rg));
        }
        samples
    }

    fn unwrap_format(error: Error) -> (String, u64, String) {
        match error {
            Error::Format {
                url,
                offset,
                reason,
                ..
            } => (url, offset, reason),
            other => panic!("expected a format error, got {other}"),
        }
    }

    #[test]
    fn footer_probe_then_second_fetch() {
        let file = write_file(Compression::SNAPPY);
        let size = file.len() as u64;

        let needed = match decode_footer(URL, size, &file[file.len() - 16..]).unwrap() {
            FooterDecode::NeedTail(n) => n,
            FooterDecode::Metadata(_) => panic!("16 bytes cannot hold the metadata"),
        };
        assert!(needed > 16 && needed < size, "{needed} of {size}");
        let meta = match decode_footer(URL, size, &file[(size - needed) as usize..]).unwrap() {
            FooterDecode::Metadata(meta) => meta,
            FooterDecode::NeedTail(n) => panic!("asked again for {n} bytes"),
        };
        assert_eq!(meta.num_row_groups(), ROWS.div_ceil(ROW_GROUP_ROWS));
        assert_eq!(meta.file_metadata().num_rows(), ROWS as i64);

        // Too short to even hold the footer: ask for the probe (capped).
        assert!(matches!(
            decode_footer(URL, size, &file[file.len() - 3..]).unwrap(),
            FooterDecode::NeedTail(n) if n == size.min(FOOTER_PROBE)
        ));
        // The whole file as the tail: the same metadata.
        let whole = metadata(&file);
        assert_eq!(whole.num_row_groups(), meta.num_row_groups());
        let rows: Vec<u64> = (0..meta.num_row_groups())
            .map(|rg| row_group_rows(&meta, rg))
            .collect();
        assert_eq!(rows, vec![7, 7, 7, 7, 2]);
    }

    #[test]
    fn row_group_spans_are_disjoint_and_in_the_data() {
        let file = write_file(Compression::ZSTD(ZstdLevel::default()));
        let meta = metadata(&file);
        let mut end = 4;
        for rg in 0..meta.num_row_groups() {
            let span = row_group_span(&meta, rg);
            assert!(span.start >= end && span.end > span.start, "{span:?}");
            for column in meta.row_group(rg).columns() {
                let chunk = chunk_range(column).unwrap();
                assert!(span.start <= chunk.start && chunk.end <= span.end);
            }
            end = span.end;
        }
        assert!(end < file.len() as u64 - 8);
        assert_eq!(row_group_span(&meta, 0).start, 4);
    }

    #[test]
    fn row_groups_decode_to_the_written_rows_with_every_codec() {
        for compression in codecs() {
            let file = write_file(compression);
            let meta = metadata(&file);
            for rg in meta.row_groups() {
                assert_eq!(rg.column(0).compression(), compression);
            }
            // The dictionary-encoded columns kept their dictionary pages.
            assert!(meta
                .row_group(0)
                .column(2)
                .dictionary_page_offset()
                .is_some());

            let samples = read_samples(&file, None);
            assert_eq!(samples.len(), ROWS, "{compression}");
            for (i, sample) in samples.iter().enumerate() {
                let (rg, row) = (i / ROW_GROUP_ROWS, (i % ROW_GROUP_ROWS) as u64);
                assert_eq!(
                    sample.id,
                    SampleId {
                        shard: 3,
                        index: row
                    }
                );
                assert_eq!(sample.key, format!("rg{rg}/{row}"));
                assert_eq!(&*sample.url, URL);
                assert_eq!((sample.offset, sample.length), (0, 0));
                assert_eq!(sample.fields, expected_row(i), "{compression}, row {i}");
            }
        }
    }

    #[test]
    fn rows_hold_the_values_pyarrow_gives() {
        let samples = read_samples(&write_file(Compression::LZ4_RAW), None);
        let field = |i: usize, name: &str| {
            samples[i]
                .fields
                .iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1
                .clone()
        };
        // Row 20: a null struct then a struct with a null field; a map with
        // a null value; a dictionary value.
        assert_eq!(
            field(20, "items"),
            Value::List(vec![
                Value::Null,
                Value::Map(vec![
                    ("a".into(), Value::Int(201)),
                    ("b".into(), Value::Null)
                ]),
            ])
        );
        assert_eq!(field(20, "tag"), Value::Null);
        assert_eq!(field(22, "tag"), s("dog"));
        assert_eq!(field(23, "tag"), s("bird"));
        assert_eq!(field(20, "name"), s("name-20"));
        assert_eq!(
            field(21, "attrs"),
            Value::List(vec![
                Value::Tuple(vec![s("k0"), Value::Int(147)]),
                Value::Tuple(vec![s("k1"), Value::Null]),
            ])
        );
        // Nulls at the top level.
        assert_eq!(field(13, "name"), Value::Null);
        assert_eq!(field(13, "tag"), Value::Null);
        assert_eq!(field(13, "items"), Value::Null);
        assert_eq!(field(17, "attrs"), Value::Null);
        assert_eq!(field(3, "blob"), Value::from(vec![3u8, 3, 3]));
        assert_eq!(field(2, "big"), Value::UInt(u64::MAX - 2));
        assert_eq!(field(2, "score"), Value::Float(1.0));
    }

    #[test]
    fn projection_reads_the_named_columns_in_file_order() {
        let file = write_file(Compression::SNAPPY);
        let columns = vec!["tag".to_owned(), "id".to_owned(), "tag".to_owned()];
        let meta = metadata(&file);
        let batches = read(&file, &meta, 1, Some(&columns)).unwrap();
        let names: Vec<String> = batches[0]
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(names, ["id", "tag"]);
        assert!(matches!(
            batches[0].schema().field(1).data_type(),
            DataType::Dictionary(_, _)
        ));

        let samples = read_samples(&file, Some(&columns));
        assert_eq!(samples.len(), ROWS);
        for (i, sample) in samples.iter().enumerate() {
            let expected: Vec<_> = expected_row(i)
                .into_iter()
                .filter(|(n, _)| n == "id" || n == "tag")
                .collect();
            assert_eq!(sample.fields, expected);
        }
    }

    #[test]
    fn an_unknown_column_lists_the_columns() {
        let file = write_file(Compression::SNAPPY);
        let meta = metadata(&file);
        let columns = vec!["id".to_owned(), "nope".to_owned()];
        let (url, offset, reason) =
            unwrap_format(read(&file, &meta, 0, Some(&columns)).unwrap_err());
        assert_eq!((url.as_str(), offset), (URL, 0));
        assert_eq!(reason, format!("no column \"nope\" (columns: {COLUMNS})"));
    }

    #[test]
    fn a_bad_footer_is_a_format_error() {
        let file = write_file(Compression::SNAPPY);
        let size = file.len() as u64;

        let mut bad_magic = file.clone();
        *bad_magic.last_mut().unwrap() = b'X';
        let (url, offset, reason) =
            unwrap_format(decode_footer(URL, size, &bad_magic).unwrap_err());
        assert_eq!((url.as_str(), offset), (URL, size - 4));
        assert_eq!(reason, "not a Parquet file (no PAR1 magic at the end)");
        let message = decode_footer(URL, size, &bad_magic)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(URL) && message.contains("no PAR1 magic"),
            "{message}"
        );

        let (_, offset, reason) = unwrap_format(decode_footer(URL, 4, b"PAR1").unwrap_err());
        assert_eq!(offset, 0);
        assert!(reason.contains("shorter than the 12 bytes"), "{reason}");

        // The last 100 bytes as a file of their own: the metadata length
        // points before its start.
        let (url, offset, reason) =
            unwrap_format(decode_footer(URL, 100, &file[file.len() - 100..]).unwrap_err());
        assert_eq!((url.as_str(), offset), (URL, 92));
        assert!(
            reason.contains("runs past the start of the file"),
            "{reason}"
        );

        // A file cut short at the front: the metadata no longer fits.
        let truncated = &file[file.len() - 40..];
        let (_, offset, _) = unwrap_format(decode_footer(URL, 40, truncated).unwrap_err());
        assert_eq!(offset, 32);

        // Garbage metadata.
        let FooterDecode::NeedTail(needed) =
            decode_footer(URL, size, &file[file.len() - 8..]).unwrap()
        else {
            panic!("8 bytes cannot hold the metadata");
        };
        let metadata_start = size - needed;
        let mut garbage = file.clone();
        for (k, byte) in garbage[metadata_start as usize..file.len() - 8]
            .iter_mut()
            .enumerate()
        {
            *byte = (k as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8;
        }
        let (url, offset, reason) = unwrap_format(decode_footer(URL, size, &garbage).unwrap_err());
        assert_eq!((url.as_str(), offset), (URL, metadata_start));
        assert!(
            reason.starts_with("undecodable Parquet metadata"),
            "{reason}"
        );

        // No magic at the start of a whole file.
        let mut headless = file.clone();
        headless[0] = b'Q';
        let (_, offset, reason) = unwrap_format(decode_footer(URL, size, &headless).unwrap_err());
        assert_eq!(offset, 0);
        assert!(reason.contains("no PAR1 magic at the start"), "{reason}");
    }

    #[test]
    fn corrupt_row_group_bytes_are_a_format_error() {
        let file = write_file(Compression::SNAPPY);
        let meta = metadata(&file);
        let span = row_group_span(&meta, 1);
        let (start, end) = (span.start as usize, span.end as usize);

        // All garbage.
        let mut garbage = file.clone();
        for (k, byte) in garbage[start..end].iter_mut().enumerate() {
            *byte = 0xA5 ^ (k as u8).wrapping_mul(31);
        }
        let (url, offset, reason) = unwrap_format(read(&garbage, &meta, 1, None).unwrap_err());
        assert_eq!((url.as_str(), offset), (URL, span.start));
        assert!(reason.starts_with("row group 1: "), "{reason}");

        // Garbage patches here and there: an error or (by luck) rows, never
        // a panic.
        let mut errors = 0;
        for at in (start..end - 16).step_by(37) {
            let mut patched = file.clone();
            for byte in &mut patched[at..at + 16] {
                *byte = !*byte;
            }
            if let Err(error) = read(&patched, &meta, 1, None) {
                let (url, offset, reason) = unwrap_format(error);
                assert_eq!((url.as_str(), offset), (URL, span.start));
                assert!(reason.starts_with("row group 1: "), "{reason}");
                errors += 1;
            }
        }
        assert!(errors > 0);

        // Bytes that stop short of the span.
        let short = Bytes::copy_from_slice(&file[start..end - 10]);
        let (url, offset, reason) = unwrap_format(
            read_row_group(&shard(), &meta, 1, None, span.start, short, 3).unwrap_err(),
        );
        assert_eq!((url.as_str(), offset), (URL, span.start));
        assert!(reason.contains("were given"), "{reason}");

        // A row group that does not exist.
        let error = read_row_group(&shard(), &meta, 9, None, 0, Bytes::new(), 3).unwrap_err();
        assert!(unwrap_format(error).2.contains("does not exist"));
    }

    #[test]
    fn arrow_types_convert_like_to_pylist() {
        type F16 = <Float16Type as ArrowPrimitiveType>::Native;
        let dict_values: ArrayRef = Arc::new(Int64Array::from(vec![Some(10), None, Some(30)]));
        let dict_keys = arrow_array::Int8Array::from(vec![Some(2), Some(0), None, Some(1)]);
        let mut fixed_list =
            arrow_array::builder::FixedSizeListBuilder::new(Int32Builder::new(), 2);
        // Entries [n, null], one of them null.
        for row in [Some(1), None, Some(3), Some(5)] {
            match row {
                Some(n) => {
                    fixed_list.values().append_value(n);
                    fixed_list.values().append_null();
                    fixed_list.append(true);
                }
                None => {
                    fixed_list.values().append_nulls(2);
                    fixed_list.append(false);
                }
            }
        }
        let mut large_list = arrow_array::builder::LargeListBuilder::new(StringBuilder::new());
        large_list.append_value([Some("x"), None]);
        large_list.append_value(Vec::<Option<&str>>::new());
        large_list.append_null();
        large_list.append_value([Some("y")]);
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("null", Arc::new(NullArray::new(4))),
            (
                "bool",
                Arc::new(BooleanArray::from(vec![
                    Some(true),
                    Some(false),
                    None,
                    Some(true),
                ])),
            ),
            ("u8", Arc::new(UInt8Array::from(vec![255, 0, 1, 2]))),
            ("i16", Arc::new(Int16Array::from(vec![-300, 0, 1, 2]))),
            ("u32", Arc::new(UInt32Array::from(vec![u32::MAX, 0, 1, 2]))),
            (
                "f16",
                Arc::new(Float16Array::from(vec![
                    F16::from_f64(1.5),
                    F16::from_f64(-2.0),
                    F16::from_f64(0.0),
                    F16::from_f64(65504.0),
                ])),
            ),
            (
                "f64",
                Arc::new(Float64Array::from(vec![
                    Some(0.1),
                    None,
                    Some(-1e300),
                    Some(2.0),
                ])),
            ),
            (
                "large_str",
                Arc::new(LargeStringArray::from(vec![
                    Some("é"),
                    None,
                    Some(""),
                    Some("z"),
                ])),
            ),
            (
                "str_view",
                Arc::new(
                    [
                        Some("a string longer than twelve bytes"),
                        Some("short"),
                        None,
                        Some(""),
                    ]
                    .into_iter()
                    .collect::<StringViewArray>(),
                ),
            ),
            (
                "bin_view",
                Arc::new(
                    [
                        Some(&b"\x00\x01"[..]),
                        None,
                        Some(&b"0123456789abcdef"[..]),
                        Some(&b""[..]),
                    ]
                    .into_iter()
                    .collect::<BinaryViewArray>(),
                ),
            ),
            (
                "large_bin",
                Arc::new(LargeBinaryArray::from(vec![
                    Some(&b"q"[..]),
                    Some(&b""[..]),
                    None,
                    Some(&b"r"[..]),
                ])),
            ),
            (
                "fixed_bin",
                Arc::new(
                    FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                        vec![Some(*b"ab"), None, Some(*b"cd"), Some(*b"ef")].into_iter(),
                        2,
                    )
                    .unwrap(),
                ),
            ),
            ("fixed_list", Arc::new(fixed_list.finish())),
            ("large_list", Arc::new(large_list.finish())),
            (
                "dict",
                Arc::new(DictionaryArray::<Int8Type>::try_new(dict_keys, dict_values).unwrap()),
            ),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let samples = batch_to_samples(&shard(), "k/", &batch.slice(1, 3), 10).unwrap();
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].key, "k/10");
        assert_eq!(
            samples[2].id,
            SampleId {
                shard: 3,
                index: 12
            }
        );
        let row =
            |i: usize| -> Vec<Value> { samples[i].fields.iter().map(|(_, v)| v.clone()).collect() };
        // Rows 1..4 of the batch.
        assert_eq!(
            row(0),
            vec![
                Value::Null,
                Value::Bool(false),
                Value::Int(0),
                Value::Int(0),
                Value::Int(0),
                Value::Float(-2.0),
                Value::Null,
                Value::Null,
                s("short"),
                Value::Null,
                Value::from(Vec::new()),
                Value::Null,
                Value::Null,
                Value::List(vec![]),
                Value::Int(10),
            ]
        );
        assert_eq!(
            row(1),
            vec![
                Value::Null,
                Value::Null,
                Value::Int(1),
                Value::Int(1),
                Value::Int(1),
                Value::Float(0.0),
                Value::Float(-1e300),
                s(""),
                Value::Null,
                Value::from(b"0123456789abcdef".to_vec()),
                Value::Null,
                Value::from(b"cd".to_vec()),
                Value::List(vec![Value::Int(3), Value::Null]),
                Value::Null,
                Value::Null,
            ]
        );
        assert_eq!(row(2)[5], Value::Float(65504.0));
        assert_eq!(row(2)[12], Value::List(vec![Value::Int(5), Value::Null]));
        assert_eq!(row(2)[13], Value::List(vec![s("y")]));
        // Dictionary key 1 points at a null value.
        assert_eq!(row(2)[14], Value::Null);
        let names: Vec<&str> = samples[0].fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[..3], ["null", "bool", "u8"]);

        // The unsliced batch: first rows, u8 at 255, u32 at its maximum.
        let all = batch_to_samples(&shard(), "", &batch, 0).unwrap();
        assert_eq!(all[0].fields[2].1, Value::Int(255));
        assert_eq!(all[0].fields[4].1, Value::Int(u32::MAX.into()));
        assert_eq!(all[0].fields[3].1, Value::Int(-300));
        assert_eq!(all[0].fields[7].1, s("é"));
        assert_eq!(all[0].fields[8].1, s("a string longer than twelve bytes"));
        assert_eq!(all[0].fields[14].1, Value::Int(30));
        assert_eq!(all[0].fields[9].1, Value::from(vec![0u8, 1]));
        assert_eq!(
            all[0].fields[12].1,
            Value::List(vec![Value::Int(1), Value::Null])
        );
    }

    #[test]
    fn unsupported_types_are_an_error_not_dropped() {
        let dates: ArrayRef = Arc::new(arrow_array::Date32Array::from(vec![1, 2]));
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(Int32Array::from(vec![1, 2])) as ArrayRef),
            ("day", dates),
        ])
        .unwrap();
        let (url, _, reason) =
            unwrap_format(batch_to_samples(&shard(), "", &batch, 0).unwrap_err());
        assert_eq!(url, URL);
        assert_eq!(
            reason,
            "column \"day\": type Date32 is not supported in per-row output; use batch_format=\"arrow\""
        );

        // Nested, and even when every value is null.
        let mut decimals = ListBuilder::new(arrow_array::builder::Decimal128Builder::new());
        decimals.append_null();
        let batch =
            RecordBatch::try_from_iter([("amounts", Arc::new(decimals.finish()) as ArrayRef)])
                .unwrap();
        let (_, _, reason) = unwrap_format(batch_to_samples(&shard(), "", &batch, 0).unwrap_err());
        assert!(
            reason.starts_with("column \"amounts\": type Decimal128("),
            "{reason}"
        );
    }

    #[test]
    fn batches_can_move_between_threads() {
        fn assert_send<T: Send>() {}
        assert_send::<RowGroupBatches>();
        assert_send::<FooterDecode>();
    }
}
