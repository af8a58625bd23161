//! Footers, row groups and rows of files written with the `parquet` crate.

use std::ops::Range;
use std::sync::Arc;

use arrow_array::types::{Float16Type, Int32Type, Int8Type};
use arrow_array::{
    BinaryArray, BinaryViewArray, BooleanArray, FixedSizeBinaryArray, Float16Array, Float32Array,
    Float64Array, Int16Array, Int32Array, Int64Array, LargeBinaryArray, LargeStringArray,
    RecordBatch, StringArray, StringViewArray, UInt32Array, UInt64Array, UInt8Array,
};
use arrow_schema::DataType;
use bytes::Bytes;
use parquet::file::metadata::ParquetMetaData;

use crate::error::{Error, Result};
use crate::format::{Sample, SampleId, ShardRef};
use crate::value::Value;

use super::footer::chunk_range;
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
                batch_to_samples(&shard(), &format!("rg{rg}/"), &batch, 0, first_row).unwrap(),
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
    let (url, offset, reason) = unwrap_format(read(&file, &meta, 0, Some(&columns)).unwrap_err());
    assert_eq!((url.as_str(), offset), (URL, 0));
    assert_eq!(reason, format!("no column \"nope\" (columns: {COLUMNS})"));
}

#[test]
fn a_bad_footer_is_a_format_error() {
    let file = write_file(Compression::SNAPPY);
    let size = file.len() as u64;

    let mut bad_magic = file.clone();
    *bad_magic.last_mut().unwrap() = b'X';
    let (url, offset, reason) = unwrap_format(decode_footer(URL, size, &bad_magic).unwrap_err());
    assert_eq!((url.as_str(), offset), (URL, size - 4));
    assert_eq!(reason, "not a Parquet file (no PAR1 magic at the end)");
    let message = decode_footer(URL, size, &bad_magic)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains(URL) && message.contains("no PAR1 magic"),
        "{message}"
    );

    let mut encrypted = file.clone();
    encrypted[file.len() - 4..].copy_from_slice(b"PARE");
    let (_, offset, reason) = unwrap_format(decode_footer(URL, size, &encrypted).unwrap_err());
    assert_eq!(offset, size - 4);
    assert_eq!(
        reason,
        "encrypted Parquet footer (PARE magic) is not supported"
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
    let FooterDecode::NeedTail(needed) = decode_footer(URL, size, &file[file.len() - 8..]).unwrap()
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
    let (url, offset, reason) =
        unwrap_format(read_row_group(&shard(), &meta, 1, None, span.start, short, 3).unwrap_err());
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
    let mut fixed_list = arrow_array::builder::FixedSizeListBuilder::new(Int32Builder::new(), 2);
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
    let samples = batch_to_samples(&shard(), "k/", &batch.slice(1, 3), 0, 10).unwrap();
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
    let all = batch_to_samples(&shard(), "", &batch, 0, 0).unwrap();
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
    let (url, _, reason) = unwrap_format(batch_to_samples(&shard(), "", &batch, 0, 0).unwrap_err());
    assert_eq!(url, URL);
    assert_eq!(
        reason,
        "column \"day\": type Date32 is not supported in per-row output; use batch_format=\"arrow\""
    );

    // Nested, and even when every value is null.
    let mut decimals = ListBuilder::new(arrow_array::builder::Decimal128Builder::new());
    decimals.append_null();
    let batch =
        RecordBatch::try_from_iter([("amounts", Arc::new(decimals.finish()) as ArrayRef)]).unwrap();
    let (_, _, reason) = unwrap_format(batch_to_samples(&shard(), "", &batch, 0, 0).unwrap_err());
    assert!(
        reason.starts_with("column \"amounts\": type Decimal128("),
        "{reason}"
    );
}

/// A `__key__` column of strings keys the rows; a column named like
/// another name each sample is given, or a name two columns share, would
/// lose a value: an error naming the column. Before, the column replaced
/// the sample's own (`__url__`) or was replaced (`__id__` with sample ids),
/// and of two columns of one name the last was kept.
#[test]
fn a_column_named_like_a_sample_s_own_names_is_its_key_or_an_error() {
    let ints = |values: Vec<i32>| Arc::new(Int32Array::from(values)) as ArrayRef;
    let strings = |values: Vec<Option<&str>>| Arc::new(StringArray::from(values)) as ArrayRef;
    let batch = RecordBatch::try_from_iter([
        ("__key__", strings(vec![Some("x"), Some("y")])),
        ("v", ints(vec![1, 2])),
    ])
    .unwrap();
    let samples = batch_to_samples(&shard(), "", &batch, 100, 0).unwrap();
    let keys: Vec<_> = samples.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["x", "y"]);
    assert_eq!(samples[1].fields, [("v".to_owned(), Value::Int(2))]);
    let plain = RecordBatch::try_from_iter([("v", ints(vec![1, 2]))]).unwrap();
    let samples = batch_to_samples(&shard(), "", &plain, 100, 5).unwrap();
    assert_eq!(samples[1].key, "106");
    let refused = |columns: Vec<(&str, ArrayRef)>, expected: &str| {
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let (url, _, reason) =
            unwrap_format(batch_to_samples(&shard(), "", &batch, 0, 0).unwrap_err());
        assert_eq!(url, URL);
        assert!(reason.starts_with(expected), "{reason}");
    };
    for name in ["__url__", "__id__", "__seed__"] {
        refused(
            vec![(name, ints(vec![1])), ("v", ints(vec![1]))],
            &format!("column {name:?} is a name shardstream gives each sample; leave it out"),
        );
    }
    refused(
        vec![("a", ints(vec![1])), ("a", ints(vec![2]))],
        "column \"a\" is the name of two columns",
    );
    refused(
        vec![("__key__", ints(vec![1]))],
        "column \"__key__\": row 0 is not a string",
    );
    refused(
        vec![("__key__", strings(vec![Some("x"), None]))],
        "column \"__key__\": row 1 is null",
    );
}

#[test]
fn batches_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<RowGroupBatches>();
    assert_send::<FooterDecode>();
}

/// parquet-mr wrote `dictionary_page_offset = 0` for column chunks whose
/// dictionary page is their first page, at the data page offset
/// (parquet-testing's `dict-page-offset-zero.parquet`): taken as no
/// offset, as pyarrow takes it, the file reads as written.
#[test]
fn a_dictionary_page_offset_of_zero_is_no_offset() {
    use parquet::file::metadata::ParquetMetaDataWriter;

    let file = write_file(Compression::SNAPPY);
    let written = metadata(&file);
    let metadata_len = u32::from_le_bytes(file[file.len() - 8..file.len() - 4].try_into().unwrap());
    let metadata_start = file.len() - 8 - metadata_len as usize;
    let mut builder = ParquetMetaData::clone(&written).into_builder();
    let mut zeroed = 0;
    let row_groups = builder
        .take_row_groups()
        .into_iter()
        .map(|row_group| {
            let mut row_group = row_group.into_builder();
            let columns = row_group
                .take_columns()
                .into_iter()
                .map(|column| match column.dictionary_page_offset() {
                    Some(dictionary) => {
                        zeroed += 1;
                        let column = column
                            .into_builder()
                            .set_data_page_offset(dictionary)
                            .set_dictionary_page_offset(Some(0));
                        column.build().unwrap()
                    }
                    None => column,
                })
                .collect();
            row_group.set_column_metadata(columns).build().unwrap()
        })
        .collect();
    let rewritten = builder.set_row_groups(row_groups).build();
    assert!(zeroed > 0, "the file has dictionary pages");
    let mut patched = file[..metadata_start].to_vec();
    ParquetMetaDataWriter::new(&mut patched, &rewritten)
        .finish()
        .unwrap();

    let read = metadata(&patched);
    let offsets = |meta: &ParquetMetaData| -> Vec<(i64, Option<i64>)> {
        let columns = meta.row_groups().iter().flat_map(|g| g.columns());
        columns
            .map(|c| (c.data_page_offset(), c.dictionary_page_offset()))
            .collect()
    };
    assert!(offsets(&read)
        .iter()
        .all(|&(_, dictionary)| dictionary.is_none()));
    assert_eq!(
        offsets(&read).iter().map(|o| o.0).collect::<Vec<_>>(),
        offsets(&written)
            .iter()
            .map(|&(data, dictionary)| dictionary.unwrap_or(data))
            .collect::<Vec<_>>()
    );
    let samples = read_samples(&patched, None);
    assert_eq!(samples.len(), ROWS);
    for (i, sample) in samples.iter().enumerate() {
        assert_eq!(sample.fields, expected_row(i), "row {i}");
    }
}
