//! A resolved shard list in a compact binary form: a copy of a dataset (the
//! pickle a `spawn` DataLoader worker is started with) plans over exactly
//! the shards its original resolved, without listing a prefix or reading a
//! footer again, so it cannot see a dataset that changed in between.
//!
//! Everything a [`Shard`] holds is written: URL, size, the modification
//! time its manifest records, ETag, kind, the
//! manifest's sample spans and, for a Parquet row group, its file's footer
//! (written once per file, re-encoded from the decoded metadata) with the
//! row group's index, span, rows, file size and token counts. Decoding checks the re-decoded footer
//! against the row group's span and rows written beside it.

use std::ops::Range;
use std::sync::Arc;

use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader, ParquetMetaDataWriter};

use crate::compression::Compression;
use crate::format::parquet::{row_group_rows, row_group_span};
use crate::shard::ShardTokens;
use crate::shard::{RowGroup, SampleIndex, Shard, ShardKind};

/// The first bytes of an encoded list (and its version).
const MAGIC: &[u8; 4] = b"SSL4";

/// Encodes `shards`.
pub fn encode(shards: &[Shard]) -> std::result::Result<Vec<u8>, String> {
    let mut footers: Vec<&Arc<ParquetMetaData>> = Vec::new();
    let mut footer_of = Vec::with_capacity(shards.len());
    for shard in shards {
        footer_of.push(match &shard.kind {
            ShardKind::Parquet(group) => Some(
                match footers.iter().position(|m| Arc::ptr_eq(m, &group.metadata)) {
                    Some(i) => i,
                    None => {
                        footers.push(&group.metadata);
                        footers.len() - 1
                    }
                },
            ),
            _ => None,
        });
    }
    let mut out = Writer(MAGIC.to_vec());
    out.uint(footers.len() as u64);
    for metadata in footers {
        let mut bytes = Vec::new();
        ParquetMetaDataWriter::new(&mut bytes, metadata)
            .finish()
            .map_err(|e| format!("a Parquet footer cannot be encoded: {e}"))?;
        out.bytes(&bytes);
    }
    out.uint(shards.len() as u64);
    for (shard, footer) in shards.iter().zip(footer_of) {
        out.bytes(shard.url.as_bytes());
        out.option(shard.size);
        out.option(shard.mtime_ns);
        match &shard.etag {
            None => out.0.push(0),
            Some(etag) => {
                out.0.push(1);
                out.bytes(etag.as_bytes());
            }
        }
        match (&shard.kind, footer) {
            (ShardKind::Tar, _) => out.0.push(0),
            (ShardKind::Raw, _) => out.0.push(1),
            (ShardKind::Lines, _) => out.0.push(4),
            (ShardKind::Parquet(group), Some(footer)) => {
                out.0.push(3);
                for n in [
                    footer as u64,
                    group.index as u64,
                    group.span.start,
                    group.span.end,
                    group.rows,
                    group.first_row,
                    group.file_size,
                ] {
                    out.uint(n);
                }
                out.tokens(group.tokens.as_deref());
            }
            (ShardKind::Parquet(_), None) => unreachable!("every row group has a footer"),
        }
        match &shard.index {
            None => out.0.push(0),
            Some(index) => {
                out.0.push(match index.compression() {
                    None => 1,
                    Some(Compression::Gzip) => 2,
                    Some(Compression::Zstd) => 3,
                });
                out.uint(index.len());
                // Spans as the gap since the previous span's end (0 in a
                // tar) and the length: a few bytes per sample.
                let mut end = 0u64;
                for i in 0..index.len() {
                    let (offset, length) = (index.offset(i), index.length(i));
                    out.uint(offset.wrapping_sub(end));
                    out.uint(length);
                    end = offset.wrapping_add(length);
                }
                out.tokens(index.tokens().map(|t| t.as_ref()));
            }
        }
    }
    Ok(out.0)
}

/// Decodes what [`encode`] wrote; a reason if it is not such a list.
pub fn decode(bytes: &[u8]) -> std::result::Result<Vec<Shard>, String> {
    let mut r = Reader(bytes);
    if r.take(MAGIC.len())? != MAGIC {
        return Err("is not an encoded shard list".into());
    }
    let count = r.count()?;
    let mut footers = Vec::with_capacity(count);
    for _ in 0..count {
        footers.push(Arc::new(decode_footer(r.bytes()?)?));
    }
    let count = r.count()?;
    let mut shards = Vec::with_capacity(count);
    for _ in 0..count {
        let url = r.string()?;
        let size = r.option()?;
        let mtime_ns = r.option()?;
        let etag = match r.byte()? {
            0 => None,
            1 => Some(r.string()?),
            other => return Err(format!("has an ETag tag {other}")),
        };
        let kind = match r.byte()? {
            0 => ShardKind::Tar,
            1 => ShardKind::Raw,
            4 => ShardKind::Lines,
            3 => ShardKind::Parquet(Arc::new(row_group(&mut r, &footers, &url)?)),
            other => return Err(format!("has a shard kind {other}")),
        };
        let compression = match r.byte()? {
            0 => None,
            1 => Some(None),
            2 => Some(Some(Compression::Gzip)),
            3 => Some(Some(Compression::Zstd)),
            other => return Err(format!("has a sample index tag {other}")),
        };
        let index = match compression {
            None => None,
            Some(compression) => {
                let n = r.count()?;
                let (mut offsets, mut lengths) = (Vec::with_capacity(n), Vec::with_capacity(n));
                let mut end = 0u64;
                for _ in 0..n {
                    let offset = end.wrapping_add(r.uint()?);
                    let length = r.uint()?;
                    offsets.push(offset);
                    lengths.push(length);
                    end = offset.wrapping_add(length);
                }
                let tokens = r.tokens(n)?;
                let index = SampleIndex::from_parts(offsets, lengths, compression)
                    .ok_or_else(|| format!("has a sample index of {url} that does not add up"))?
                    .with_tokens(tokens);
                Some(Arc::new(index))
            }
        };
        shards.push(Shard {
            url,
            size,
            index,
            etag,
            mtime_ns,
            kind,
        });
    }
    if !r.0.is_empty() {
        return Err(format!("has {} bytes after its end", r.0.len()));
    }
    Ok(shards)
}

/// A row group's fields, checked against its file's footer.
fn row_group(
    r: &mut Reader<'_>,
    footers: &[Arc<ParquetMetaData>],
    url: &str,
) -> std::result::Result<RowGroup, String> {
    let footer = r.count()?;
    let metadata = footers
        .get(footer)
        .ok_or_else(|| format!("names footer {footer} of {}", footers.len()))?
        .clone();
    let index = r.count()?;
    let span: Range<u64> = r.uint()?..r.uint()?;
    let (rows, first_row, file_size) = (r.uint()?, r.uint()?, r.uint()?);
    let tokens = r.tokens(
        rows.try_into()
            .map_err(|_| "has too many rows".to_owned())?,
    )?;
    if index >= metadata.num_row_groups()
        || row_group_span(&metadata, index) != span
        || row_group_rows(&metadata, index) != rows
    {
        return Err(format!(
            "has row group {index} of {url} ({rows} rows at bytes {}..{}), which its footer does not describe",
            span.start, span.end
        ));
    }
    Ok(RowGroup {
        metadata,
        index,
        span,
        rows,
        first_row,
        file_size,
        tokens,
    })
}

/// Decodes a footer written by `ParquetMetaDataWriter`: the metadata, its
/// length (4 bytes) and `PAR1`.
fn decode_footer(bytes: &[u8]) -> std::result::Result<ParquetMetaData, String> {
    let metadata = bytes
        .len()
        .checked_sub(8)
        .map(|end| &bytes[..end])
        .ok_or("has a Parquet footer shorter than 8 bytes")?;
    std::panic::catch_unwind(|| ParquetMetaDataReader::decode_metadata(metadata))
        .map_err(|_| "has a Parquet footer that does not decode".to_owned())?
        .map_err(|e| format!("has a Parquet footer that does not decode: {e}"))
}

/// Appends LEB128 integers and length-prefixed bytes.
struct Writer(Vec<u8>);

impl Writer {
    /// Token counts: a tag, then the field, the tokenizer and each count.
    fn tokens(&mut self, tokens: Option<&ShardTokens>) {
        let Some(tokens) = tokens else {
            self.0.push(0);
            return;
        };
        self.0.push(1);
        self.bytes(tokens.field.as_bytes());
        match &tokens.tokenizer {
            None => self.0.push(0),
            Some(tokenizer) => {
                self.0.push(1);
                self.bytes(tokenizer.as_bytes());
            }
        }
        for &count in &tokens.counts {
            self.uint(count);
        }
    }

    fn uint(&mut self, mut n: u64) {
        while n >= 0x80 {
            self.0.push((n as u8 & 0x7f) | 0x80);
            n >>= 7;
        }
        self.0.push(n as u8);
    }

    fn option(&mut self, n: Option<u64>) {
        match n {
            None => self.0.push(0),
            Some(n) => {
                self.0.push(1);
                self.uint(n);
            }
        }
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.uint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }
}

/// Reads what [`Writer`] wrote, failing on anything short or malformed.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// What [`Writer::tokens`] wrote for `n` samples.
    fn tokens(&mut self, n: usize) -> std::result::Result<Option<Arc<ShardTokens>>, String> {
        match self.byte()? {
            0 => Ok(None),
            1 => {
                let field = self.string()?;
                let tokenizer = match self.byte()? {
                    0 => None,
                    1 => Some(self.string()?),
                    other => return Err(format!("has a tokenizer tag {other}")),
                };
                let counts = (0..n).map(|_| self.uint()).collect::<Result<_, _>>()?;
                Ok(Some(Arc::new(ShardTokens {
                    field,
                    tokenizer,
                    counts,
                })))
            }
            other => Err(format!("has a token counts tag {other}")),
        }
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("is cut short".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn byte(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn uint(&mut self) -> std::result::Result<u64, String> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            n |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(n);
            }
        }
        Err("has an integer longer than 64 bits".into())
    }

    /// A count or index, bounded by the bytes left (every item takes one).
    fn count(&mut self) -> std::result::Result<usize, String> {
        let n = self.uint()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.0.len())
            .ok_or_else(|| format!("has a count of {n} with {} bytes left", self.0.len()))
    }

    fn option(&mut self) -> std::result::Result<Option<u64>, String> {
        match self.byte()? {
            0 => Ok(None),
            1 => self.uint().map(Some),
            other => Err(format!("has an option tag {other}")),
        }
    }

    fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let n = self.count()?;
        self.take(n)
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "has a name that is not UTF-8".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    fn parquet_file() -> Vec<u8> {
        let ids = Int64Array::from_iter_values(0..10);
        let names = StringArray::from_iter_values((0..10).map(|i| format!("row {i}")));
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("name", Arc::new(names) as ArrayRef),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(4))
            .build();
        let mut file = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut file, batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        file
    }

    fn shards() -> Vec<Shard> {
        let file = parquet_file();
        let metadata =
            match crate::format::parquet::decode_footer("t.parquet", file.len() as u64, &file)
                .unwrap()
            {
                crate::format::parquet::FooterDecode::Metadata(m) => m,
                crate::format::parquet::FooterDecode::NeedTail(_) => unreachable!(),
            };
        let mut shards = vec![
            Shard {
                mtime_ns: Some(1_700_000_000_123_456_789),
                ..Shard::new("a.tar", Some(3072))
            },
            Shard {
                etag: Some("\"e1\"".into()),
                kind: ShardKind::Raw,
                ..Shard::new("s3://b/raw.bin", None)
            },
            Shard {
                index: Some(Arc::new(
                    SampleIndex::from_parts(
                        vec![0, 1024, 1536, u64::MAX - 10],
                        vec![1024, 512, 100, 10],
                        Some(Compression::Zstd),
                    )
                    .unwrap(),
                )),
                ..Shard::new("c.tar.zst", Some(900))
            },
            Shard {
                kind: ShardKind::Lines,
                index: Some(Arc::new(
                    SampleIndex::from_parts(vec![0, 40], vec![40, 25], None)
                        .unwrap()
                        .with_tokens(Some(Arc::new(ShardTokens {
                            field: "text".into(),
                            tokenizer: Some("Tokenizer(digest=0x01, bos=None)".into()),
                            counts: vec![9, u64::MAX],
                        }))),
                )),
                ..Shard::new("d.jsonl", Some(65))
            },
        ];
        let mut first_row = 0;
        for index in 0..metadata.num_row_groups() {
            let rows = row_group_rows(&metadata, index);
            shards.push(Shard {
                kind: ShardKind::Parquet(Arc::new(RowGroup {
                    metadata: metadata.clone(),
                    index,
                    span: row_group_span(&metadata, index),
                    rows,
                    first_row,
                    file_size: file.len() as u64,
                    tokens: (index == 1).then(|| {
                        Arc::new(ShardTokens {
                            field: "text".into(),
                            tokenizer: None,
                            counts: (0..rows).collect(),
                        })
                    }),
                })),
                ..Shard::new("t.parquet", Some(file.len() as u64))
            });
            first_row += rows;
        }
        shards
    }

    fn summary(shards: &[Shard]) -> Vec<String> {
        shards
            .iter()
            .map(|s| {
                let index = s.index.as_ref().map(|i| {
                    let spans: Vec<_> = (0..i.len()).map(|k| (i.offset(k), i.length(k))).collect();
                    format!("{spans:?} {:?} {:?}", i.compression(), i.tokens())
                });
                let kind = match &s.kind {
                    ShardKind::Parquet(g) => format!(
                        "rg {} {:?} {} {} of {} ({} bytes) {:?}",
                        g.index,
                        g.span,
                        g.rows,
                        g.first_row,
                        g.metadata.file_metadata().num_rows(),
                        g.file_size,
                        g.tokens
                    ),
                    other => format!("{other:?}"),
                };
                format!(
                    "{} {:?} {:?} {:?} {kind} {index:?}",
                    s.url, s.size, s.mtime_ns, s.etag
                )
            })
            .collect()
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let shards = shards();
        assert_eq!(shards.len(), 7, "three row groups");
        let decoded = decode(&encode(&shards).unwrap()).unwrap();
        assert_eq!(summary(&decoded), summary(&shards));
        assert!(summary(&decoded)[3].contains("counts: [9, 18446744073709551615]"));
        let ShardKind::Parquet(group) = &decoded[4].kind else {
            panic!("a row group")
        };
        let ShardKind::Parquet(last) = &decoded[6].kind else {
            panic!("a row group")
        };
        assert!(
            Arc::ptr_eq(&group.metadata, &last.metadata),
            "one footer per file"
        );
        let state = crate::config::StreamOptions::default();
        assert_eq!(
            crate::state::fingerprint(&decoded, &state),
            crate::state::fingerprint(&shards, &state)
        );
    }

    #[test]
    fn bad_bytes_are_refused() {
        let bytes = encode(&shards()).unwrap();
        for cut in [0, 3, 4, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).unwrap_err().contains("after its end"));
        assert!(decode(b"nope").is_err());
    }
}
