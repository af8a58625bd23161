//! The footer of a Parquet file: its metadata, checked against the file's
//! size, and the byte span and row count of each row group.

use std::ops::Range;
use std::sync::Arc;

use parquet::file::metadata::{
    ColumnChunkMetaData, FooterTail, ParquetMetaData, ParquetMetaDataReader,
};

use crate::error::{guard, Error, Result};

/// How many bytes at the end of a Parquet file a caller should fetch first:
/// enough for the footer of most files, so one request usually suffices.
pub const FOOTER_PROBE: u64 = 64 * 1024;

/// The fixed end of a Parquet file: 4 bytes of metadata length, then `PAR1`.
const FOOTER_LEN: u64 = 8;
/// The magic at the start of a Parquet file.
const MAGIC: &[u8; 4] = b"PAR1";
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
    let mut footer = [0u8; FOOTER_LEN as usize];
    footer.copy_from_slice(&tail[tail.len() - FOOTER_LEN as usize..]);
    // The crate's own reading of the footer: metadata length and magic.
    let Ok(footer) = FooterTail::try_new(&footer) else {
        return Err(format_error(
            url,
            file_size - 4,
            "not a Parquet file (no PAR1 magic at the end)",
        ));
    };
    if footer.is_encrypted_footer() {
        return Err(format_error(
            url,
            file_size - 4,
            "encrypted Parquet footer (PARE magic) is not supported",
        ));
    }
    let metadata_len = footer.metadata_length() as u64;
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
    let metadata = zero_dictionary_offsets_as_absent(metadata).map_err(|reason| {
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

/// `metadata` with every `dictionary_page_offset` of 0 taken as absent, as
/// pyarrow and the Java reader take it: parquet-mr wrote 0 for column
/// chunks whose dictionary page, if any, is their first page, at the data
/// page offset. Offset 0 is the file's leading magic, never a page.
fn zero_dictionary_offsets_as_absent(
    metadata: ParquetMetaData,
) -> std::result::Result<ParquetMetaData, String> {
    let zero = |column: &ColumnChunkMetaData| column.dictionary_page_offset() == Some(0);
    let row_groups = metadata.row_groups();
    if !row_groups.iter().any(|g| g.columns().iter().any(zero)) {
        return Ok(metadata);
    }
    let mut builder = metadata.into_builder();
    let row_groups = builder
        .take_row_groups()
        .into_iter()
        .map(|row_group| {
            let mut row_group = row_group.into_builder();
            let columns = row_group
                .take_columns()
                .into_iter()
                .map(|column| match zero(&column) {
                    true => column
                        .into_builder()
                        .set_dictionary_page_offset(None)
                        .build(),
                    false => Ok(column),
                })
                .collect::<parquet::errors::Result<Vec<_>>>()?;
            row_group.set_column_metadata(columns).build()
        })
        .collect::<parquet::errors::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    Ok(builder.set_row_groups(row_groups).build())
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
pub(super) fn chunk_range(column: &ColumnChunkMetaData) -> Option<Range<u64>> {
    let start = column
        .dictionary_page_offset()
        .unwrap_or(column.data_page_offset());
    let start = u64::try_from(start).ok()?;
    let len = u64::try_from(column.compressed_size()).ok()?;
    Some(start..start.checked_add(len)?)
}

/// The byte range of the file covering every column chunk of `row_group`
/// (dictionary pages included): the bytes `read_row_group` needs.
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
