//! Arrow batches turned into samples, one per row, with the values
//! pyarrow's `to_pylist()` gives.

use std::ops::Range;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{
    Array, BinaryArray, BinaryViewArray, BooleanArray, FixedSizeBinaryArray, FixedSizeListArray,
    Float16Array, Float32Array, Float64Array, GenericListArray, Int16Array, Int32Array, Int64Array,
    Int8Array, LargeBinaryArray, LargeListArray, LargeStringArray, ListArray, MapArray,
    OffsetSizeTrait, RecordBatch, StringArray, StringViewArray, UInt16Array, UInt32Array,
    UInt64Array, UInt8Array,
};
use arrow_schema::DataType;
use bytes::Bytes;
use parquet::file::metadata::ParquetMetaData;

use crate::error::Result;
use crate::format::{Sample, SampleId, ShardRef, GIVEN_NAMES};
use crate::value::Value;

/// Turns the rows of `batch` into samples: row `i` becomes the sample with
/// index `first_row + i` (its row within the row group), key
/// `{key_prefix}{key_first_row + first_row + i}` (pass a prefix or a first
/// row that makes keys unique in the file: `"rg3/"`, or the row group's
/// first row in the file), offset and length 0, and one field per column
/// in schema order.
///
/// A string column named `__key__` gives each row its key instead (a null
/// or a column of another type is a format error). A column named like
/// another name shardstream gives each sample (`__url__`, `__id__`,
/// `__seed__`), or a name two columns share, is a format error naming it:
/// the sample would lose one of the values.
///
/// Values are what pyarrow's `to_pylist()` gives: integers, floats,
/// strings, bytes, lists, dicts for structs, lists of `(key, value)` tuples
/// for maps, decoded values for dictionaries and `None` for nulls at any
/// depth. A column of another type (dates, times, timestamps, decimals...)
/// fails with an [`Error::Format`](crate::error::Error::Format) rather than being dropped.
pub fn batch_to_samples(
    shard: &ShardRef,
    key_prefix: &str,
    batch: &RecordBatch,
    key_first_row: u64,
    first_row: u64,
) -> Result<Vec<Sample>> {
    let fields = batch.schema_ref().fields();
    for (i, field) in fields.iter().enumerate() {
        let name = field.name().as_str();
        let reason = if fields[..i].iter().any(|other| other.name() == name) {
            "is the name of two columns: a sample holds one value per name"
        } else if name != KEY_COLUMN && GIVEN_NAMES.contains(&name) {
            "is a name shardstream gives each sample"
        } else {
            continue;
        };
        return Err(shard.format_error(
            0,
            None,
            format!(
                "column {name:?} {reason}; leave it out (columns=[...]) or read Arrow batches \
                 (batch_format=\"arrow\")"
            ),
        ));
    }
    let columns = fields
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
    let key_column = columns.iter().position(|(name, _)| *name == KEY_COLUMN);
    (0..batch.num_rows())
        .map(|i| {
            let index = first_row + i as u64;
            let key = match key_column {
                Some(at) => match columns[at].1.value(i) {
                    Value::Str(key) => key,
                    other => {
                        let what = if matches!(other, Value::Null) {
                            "null"
                        } else {
                            "not a string"
                        };
                        return Err(shard.format_error(
                            0,
                            None,
                            format!("column {KEY_COLUMN:?}: row {index} is {what}"),
                        ));
                    }
                },
                None => format!("{key_prefix}{}", key_first_row + index),
            };
            Ok(Sample {
                id: SampleId {
                    shard: shard.index,
                    index,
                },
                key,
                url: shard.url.clone(),
                fields: columns
                    .iter()
                    .enumerate()
                    .filter(|&(at, _)| Some(at) != key_column)
                    .map(|(_, (name, column))| ((*name).to_owned(), column.value(i)))
                    .collect(),
                offset: 0,
                length: 0,
            })
        })
        .collect()
}

/// The column whose strings are the rows' keys, when a file has one.
const KEY_COLUMN: &str = "__key__";

/// The columns to read for rows keyed as [`batch_to_samples`] keys them:
/// `columns` with the file's `__key__` column added, when the file has one
/// and `columns` leaves it out (its rows would be keyed by their numbers);
/// `None` when `columns` needs nothing added.
pub fn columns_with_key(meta: &ParquetMetaData, columns: &[String]) -> Option<Vec<String>> {
    let has_key = meta
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .iter()
        .any(|field| field.name() == KEY_COLUMN);
    (has_key && !columns.iter().any(|name| name == KEY_COLUMN)).then(|| {
        columns
            .iter()
            .cloned()
            .chain([KEY_COLUMN.to_owned()])
            .collect()
    })
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
