//! Batching: samples collated into columns, so that Python receives one
//! object per batch instead of one per sample.

use std::sync::Arc;

use crate::error::Error;
use crate::format::Sample;
use crate::store::local::verify_view;
use crate::value::{Array, ArrayData, Value};

/// Samples collated into columns.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `__key__` of each sample.
    pub keys: Vec<String>,
    /// `__url__` of each sample.
    pub urls: Vec<Arc<str>>,
    /// Each field, in order of first appearance.
    pub fields: Vec<(String, Column)>,
}

/// One field of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Column {
    /// Arrays of one shape and element type (or numbers of one type),
    /// stacked along a new first axis.
    Stacked(Array),
    /// Anything else, one value per sample (`Null` where a sample lacks
    /// the field).
    Values(Vec<Value>),
    /// With `pack_bytes`, a field that every sample has as bytes: the
    /// members end to end in `data`, sample `i`'s at
    /// `data[offsets[i]..offsets[i + 1]]` (`offsets` has one more entry than
    /// the batch has samples, the first 0).
    Packed {
        /// Every member's bytes, in sample order.
        data: Vec<u8>,
        /// Where each member starts, then where the last one ends.
        offsets: Vec<i64>,
    },
}

/// The name of the column that holds a packed field's offsets.
pub fn offsets_field(field: &str) -> String {
    format!("{field}_offsets")
}

impl Batch {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Collates `samples`: a field whose values are all arrays of one shape
/// and element type, or all `int`, all `float` or all `bool`, becomes one
/// stacked array, and one whose values are all tuples of `n` ints (such as
/// `__id__`) an `int64` array of shape `(samples, n)`; with `pack_bytes`, a field whose values are all bytes
/// becomes one [`Column::Packed`]; other fields become lists.
///
/// Fails when a packed field's bytes are a view of a mapped local shard
/// that was cut short while they were copied, or when its offsets would
/// take the name of another field ([`offsets_field`]).
pub fn collate(samples: Vec<Sample>, pack_bytes: bool) -> Result<Batch, Error> {
    let n = samples.len();
    let mut keys = Vec::with_capacity(n);
    let mut urls = Vec::with_capacity(n);
    let mut columns: Vec<(String, Vec<Value>)> = Vec::new();
    for (row, sample) in samples.into_iter().enumerate() {
        keys.push(sample.key);
        urls.push(sample.url);
        for (field, value) in sample.fields {
            let at = match columns.iter().position(|(name, _)| *name == field) {
                Some(at) => at,
                None => {
                    columns.push((field, Vec::with_capacity(n)));
                    columns.len() - 1
                }
            };
            let values = &mut columns[at].1;
            values.resize(row, Value::Null);
            values.push(value);
        }
    }
    if pack_bytes {
        check_offsets_names(&columns, &keys, &urls)?;
    }
    let fields = columns
        .into_iter()
        .map(|(name, mut values)| {
            values.resize(n, Value::Null);
            let column = match pack_bytes {
                true => pack(values)?,
                false => stack(values),
            };
            Ok((name, column))
        })
        .collect::<Result<_, Error>>()?;
    Ok(Batch { keys, urls, fields })
}

/// Fails when a field of the batch is named as the offsets of a field that
/// every sample has as bytes (which would be packed), naming a sample that
/// has both.
fn check_offsets_names(
    columns: &[(String, Vec<Value>)],
    keys: &[String],
    urls: &[Arc<str>],
) -> Result<(), Error> {
    let n = keys.len();
    for (field, values) in columns {
        let packed = values.len() == n && values.iter().all(|v| v.as_bytes().is_some());
        if !packed {
            continue;
        }
        let offsets = offsets_field(field);
        if let Some((_, taken)) = columns.iter().find(|(name, _)| *name == offsets) {
            let row = taken
                .iter()
                .position(|v| !matches!(v, Value::Null))
                .unwrap_or(0);
            return Err(Error::Config {
                name: "pack_bytes",
                reason: format!(
                    "field {field:?} would be packed with its offsets in {offsets:?}, and sample {:?} of {} already has a field {offsets:?}",
                    keys[row], urls[row]
                ),
            });
        }
    }
    Ok(())
}

/// One [`Column::Packed`] when every value is bytes, else as [`stack`]
/// makes it. Each member is checked once copied: pages of a mapped local
/// shard lost to the file being cut short read as zeros.
fn pack(values: Vec<Value>) -> Result<Column, Error> {
    let Some(members) = values
        .iter()
        .map(Value::as_bytes)
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(stack(values));
    };
    let mut data = Vec::with_capacity(members.iter().map(|m| m.len()).sum());
    let mut offsets = Vec::with_capacity(members.len() + 1);
    offsets.push(0);
    for member in members {
        data.extend_from_slice(member);
        verify_view(member)?;
        // A Vec's length is at most isize::MAX.
        offsets.push(data.len() as i64);
    }
    Ok(Column::Packed { data, offsets })
}

/// One stacked array when every value allows it, else the values.
fn stack(values: Vec<Value>) -> Column {
    let Some(first) = values.first() else {
        return Column::Values(values);
    };
    let n = values.len();
    let stacked = match first {
        Value::Int(_) => numbers(&values, |v| match v {
            Value::Int(i) => Some(*i),
            _ => None,
        })
        .map(ArrayData::I64),
        Value::Float(_) => numbers(&values, |v| match v {
            Value::Float(f) => Some(*f),
            _ => None,
        })
        .map(ArrayData::F64),
        Value::Bool(_) => numbers(&values, |v| match v {
            Value::Bool(b) => Some(*b),
            _ => None,
        })
        .map(ArrayData::Bool),
        Value::Tuple(head) => {
            let width = head.len();
            if let Some(rows) = int_rows(&values, width) {
                let matrix = Array::new(vec![n, width], ArrayData::I64(rows));
                return Column::Stacked(matrix.expect("width ints per sample"));
            }
            None
        }
        Value::Array(head) => {
            let same = values.iter().all(|v| {
                matches!(v, Value::Array(a)
                    if a.shape == head.shape && a.data.dtype() == head.data.dtype())
            });
            if same {
                let mut shape = Vec::with_capacity(head.shape.len() + 1);
                shape.push(n);
                shape.extend_from_slice(&head.shape);
                let parts = values.into_iter().map(|v| match v {
                    Value::Array(a) => a.data,
                    _ => unreachable!("checked above"),
                });
                let data = concat(parts).expect("one element type");
                return Column::Stacked(Array::new(shape, data).expect("sizes agree"));
            }
            None
        }
        _ => None,
    };
    match stacked {
        Some(data) => Column::Stacked(Array::new(vec![n], data).expect("one per sample")),
        None => Column::Values(values),
    }
}

/// The ints of every value, row after row, when each is a tuple of
/// `width` ints (`i64`); else `None`.
fn int_rows(values: &[Value], width: usize) -> Option<Vec<i64>> {
    let mut rows = Vec::with_capacity(values.len() * width);
    for value in values {
        match value {
            Value::Tuple(items) if items.len() == width => {
                for item in items {
                    match item {
                        Value::Int(i) => rows.push(*i),
                        _ => return None,
                    }
                }
            }
            _ => return None,
        }
    }
    Some(rows)
}

fn numbers<T>(values: &[Value], get: impl Fn(&Value) -> Option<T>) -> Option<Vec<T>> {
    values.iter().map(get).collect()
}

/// Concatenates element vectors of one type; `None` when types differ.
fn concat(parts: impl Iterator<Item = ArrayData>) -> Option<ArrayData> {
    macro_rules! join {
        ($first:expr, $rest:expr, $($variant:ident),*) => {
            match $first {
                $(ArrayData::$variant(mut out) => {
                    for part in $rest {
                        match part {
                            ArrayData::$variant(v) => out.extend(v),
                            _ => return None,
                        }
                    }
                    Some(ArrayData::$variant(out))
                })*
            }
        };
    }
    let mut parts = parts;
    let first = parts.next()?;
    join!(first, parts, Bool, U8, I8, U16, I16, U32, I32, U64, I64, F32, F64)
}

/// A batch's `field` of `int32` bounds within each row (such as packed
/// sequences' `cu_seqlens`: `0`, ..., `width`), made one array of bounds
/// within the batch's rows end to end (`rows * width` positions, the layout
/// of variable-length attention kernels): `0`, then each row's bounds after
/// its first, offset by the row's start. Other columns are left as they are.
pub fn flatten_bounds(batch: &mut Batch, field: &str, width: usize) {
    let Some((_, column)) = batch.fields.iter_mut().find(|(name, _)| name == field) else {
        return;
    };
    let rows: Vec<&[i32]> = match &*column {
        Column::Stacked(Array {
            shape,
            data: ArrayData::I32(v),
        }) if shape.len() == 2 && shape[1] > 0 => v.chunks(shape[1]).collect(),
        Column::Values(values) => values
            .iter()
            .filter_map(|v| match v {
                Value::Array(Array {
                    data: ArrayData::I32(v),
                    ..
                }) => Some(v.as_slice()),
                _ => None,
            })
            .collect(),
        _ => return,
    };
    let mut flat = vec![0i32];
    for (row, bounds) in rows.iter().enumerate() {
        let start = (row * width) as i32;
        flat.extend(bounds.iter().skip(1).map(|b| b + start));
    }
    *column = Column::Stacked(Array {
        shape: vec![flat.len()],
        data: ArrayData::I32(flat),
    });
}

/// A batch's `field` whose rows are arrays of `(K, ...)` (such as packed
/// sequences' `__id__`: `(K, 3)`, K varying), joined along their first
/// axis into one array. Left as it is when the rows are not arrays of one
/// element type and trailing shape.
pub fn join_rows(batch: &mut Batch, field: &str) {
    let Some((_, column)) = batch.fields.iter_mut().find(|(name, _)| name == field) else {
        return;
    };
    let joined = match &*column {
        Column::Stacked(array) if array.shape.len() >= 2 => {
            let mut shape = vec![array.shape[0] * array.shape[1]];
            shape.extend_from_slice(&array.shape[2..]);
            Array::new(shape, array.data.clone())
        }
        Column::Values(values) => {
            let arrays: Option<Vec<&Array>> = values
                .iter()
                .map(|v| match v {
                    Value::Array(a) if !a.shape.is_empty() => Some(a),
                    _ => None,
                })
                .collect();
            arrays.and_then(|arrays| {
                let tail = arrays.first().map_or(&[][..], |a| &a.shape[1..]);
                if arrays.iter().any(|a| &a.shape[1..] != tail) {
                    return None;
                }
                let rows = arrays.iter().map(|a| a.shape[0]).sum();
                let mut shape = vec![rows];
                shape.extend_from_slice(tail);
                let data = concat(arrays.iter().map(|a| a.data.clone()))?;
                Array::new(shape, data)
            })
        }
        _ => None,
    };
    if let Some(array) = joined {
        *column = Column::Stacked(array);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::SampleId;

    #[test]
    fn a_batch_has_one_cu_seqlens_over_its_flattened_tokens() {
        let row = |bounds: Vec<i32>| Sample {
            id: SampleId { shard: 0, index: 0 },
            key: "k".into(),
            url: Arc::from("mem://x"),
            fields: vec![(
                "cu_seqlens".into(),
                Value::Array(Array {
                    shape: vec![bounds.len()],
                    data: ArrayData::I32(bounds),
                }),
            )],
            offset: 0,
            length: 0,
        };
        let mut batch = collate(vec![row(vec![0, 3, 5]), row(vec![0, 2, 3, 5])], false).unwrap();
        flatten_bounds(&mut batch, "cu_seqlens", 5);
        let bounds = batch
            .fields
            .iter()
            .find(|(n, _)| n == "cu_seqlens")
            .unwrap();
        match &bounds.1 {
            Column::Stacked(Array {
                data: ArrayData::I32(v),
                shape,
            }) => {
                assert_eq!(v, &[0, 3, 5, 7, 8, 10]);
                assert_eq!(shape, &[6]);
            }
            other => panic!("{other:?}"),
        }
        // Rows with as many bounds each are collated stacked: the same.
        let mut batch = collate(vec![row(vec![0, 3, 5]), row(vec![0, 2, 5])], false).unwrap();
        flatten_bounds(&mut batch, "cu_seqlens", 5);
        assert_eq!(
            batch.fields[0].1,
            Column::Stacked(Array {
                shape: vec![5],
                data: ArrayData::I32(vec![0, 3, 5, 7, 10]),
            })
        );
    }

    fn sample(index: u64, fields: Vec<(&str, Value)>) -> Sample {
        Sample {
            id: SampleId { shard: 0, index },
            key: format!("k{index}"),
            url: Arc::from("a.tar"),
            fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            offset: 0,
            length: 0,
        }
    }

    fn image(fill: u8) -> Value {
        Value::Array(Array::new(vec![2, 1, 3], ArrayData::U8(vec![fill; 6])).unwrap())
    }

    #[test]
    fn stacks_equal_arrays_and_numbers() {
        let batch = collate(
            vec![
                sample(0, vec![("jpg", image(1)), ("cls", Value::Int(3))]),
                sample(1, vec![("jpg", image(2)), ("cls", Value::Int(5))]),
            ],
            false,
        )
        .unwrap();
        assert_eq!(batch.keys, ["k0", "k1"]);
        let [(jpg, Column::Stacked(images)), (cls, Column::Stacked(labels))] = &batch.fields[..]
        else {
            panic!("expected two stacked columns: {:?}", batch.fields);
        };
        assert_eq!((jpg.as_str(), cls.as_str()), ("jpg", "cls"));
        assert_eq!(images.shape, [2, 2, 1, 3]);
        assert_eq!(
            images.data,
            ArrayData::U8([vec![1; 6], vec![2; 6]].concat())
        );
        assert_eq!(labels.data, ArrayData::I64(vec![3, 5]));
    }

    #[test]
    fn keeps_lists_for_mixed_shapes_bytes_and_missing_fields() {
        let short = Value::Array(Array::new(vec![1], ArrayData::F32(vec![0.5])).unwrap());
        let long = Value::Array(Array::new(vec![2], ArrayData::F32(vec![0.5, 1.0])).unwrap());
        let batch = collate(
            vec![
                sample(
                    0,
                    vec![("wav", short.clone()), ("txt", b"a".to_vec().into())],
                ),
                sample(1, vec![("wav", long.clone())]),
                sample(
                    2,
                    vec![("txt", b"c".to_vec().into()), ("cls", Value::Int(1))],
                ),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            batch.fields,
            vec![
                (
                    "wav".to_owned(),
                    Column::Values(vec![short, long, Value::Null])
                ),
                (
                    "txt".to_owned(),
                    Column::Values(vec![
                        b"a".to_vec().into(),
                        Value::Null,
                        b"c".to_vec().into()
                    ])
                ),
                (
                    "cls".to_owned(),
                    Column::Values(vec![Value::Null, Value::Null, Value::Int(1)])
                ),
            ]
        );
    }

    #[test]
    fn tuples_of_ints_of_one_length_stack_into_a_matrix() {
        let id = |e, s, i| Value::Tuple(vec![Value::Int(e), Value::Int(s), Value::Int(i)]);
        let batch = collate(
            vec![
                sample(0, vec![("__id__", id(1, 2, 3))]),
                sample(1, vec![("__id__", id(1, 4, 5))]),
            ],
            false,
        )
        .unwrap();
        let [(_, Column::Stacked(ids))] = &batch.fields[..] else {
            panic!("expected a stacked column: {:?}", batch.fields);
        };
        assert_eq!(ids.shape, [2, 3]);
        assert_eq!(ids.data, ArrayData::I64(vec![1, 2, 3, 1, 4, 5]));
        // Tuples of other lengths or of other values stay a list.
        for odd in [
            Value::Tuple(vec![Value::Int(1)]),
            Value::Tuple(vec![Value::Int(1), Value::UInt(u64::MAX), Value::Int(3)]),
        ] {
            let batch = collate(
                vec![
                    sample(0, vec![("t", id(1, 2, 3))]),
                    sample(1, vec![("t", odd.clone())]),
                ],
                false,
            )
            .unwrap();
            assert_eq!(
                batch.fields,
                vec![("t".to_owned(), Column::Values(vec![id(1, 2, 3), odd]))]
            );
        }
    }

    #[test]
    fn mixed_number_types_stay_a_list() {
        let batch = collate(
            vec![
                sample(0, vec![("x", Value::Int(1))]),
                sample(1, vec![("x", Value::Float(2.0))]),
            ],
            false,
        )
        .unwrap();
        assert!(matches!(batch.fields[0].1, Column::Values(_)));
    }

    #[test]
    fn packs_bytes_fields_with_offsets_and_keeps_the_rest() {
        let batch = collate(
            vec![
                sample(
                    0,
                    vec![("jpg", b"ab".to_vec().into()), ("cls", Value::Int(3))],
                ),
                sample(
                    1,
                    vec![("jpg", b"".to_vec().into()), ("cls", Value::Int(4))],
                ),
                sample(
                    2,
                    vec![("jpg", b"cde".to_vec().into()), ("cls", Value::Int(5))],
                ),
            ],
            true,
        )
        .unwrap();
        let [(jpg, Column::Packed { data, offsets }), (cls, Column::Stacked(labels))] =
            &batch.fields[..]
        else {
            panic!("expected a packed and a stacked column: {:?}", batch.fields);
        };
        assert_eq!((jpg.as_str(), cls.as_str()), ("jpg", "cls"));
        assert_eq!(data, b"abcde");
        assert_eq!(offsets, &[0, 2, 2, 5]);
        assert_eq!(labels.data, ArrayData::I64(vec![3, 4, 5]));
    }

    #[test]
    fn a_bytes_field_some_samples_lack_stays_a_list_when_packing() {
        let batch = collate(
            vec![
                sample(0, vec![("txt", b"a".to_vec().into())]),
                sample(1, vec![("cls", Value::Int(1))]),
            ],
            true,
        )
        .unwrap();
        assert_eq!(
            batch.fields[0].1,
            Column::Values(vec![b"a".to_vec().into(), Value::Null])
        );
    }

    #[test]
    fn offsets_that_would_take_a_fields_name_are_an_error() {
        let error = collate(
            vec![sample(
                0,
                vec![
                    ("jpg", b"ab".to_vec().into()),
                    ("jpg_offsets", Value::Int(1)),
                ],
            )],
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("invalid option pack_bytes:")
                && error.contains("\"jpg_offsets\"")
                && error.contains("\"k0\""),
            "{error}"
        );
        // Without packing the same sample collates.
        assert!(collate(
            vec![sample(
                0,
                vec![
                    ("jpg", b"ab".to_vec().into()),
                    ("jpg_offsets", Value::Int(1))
                ]
            )],
            false
        )
        .is_ok());
    }

    proptest::proptest! {
        /// Packed members are the listed ones, end to end, in order.
        #[test]
        fn packed_members_are_the_listed_ones(
            members in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..40), 1..20)
        ) {
            let samples = |_: ()| members
                .iter()
                .enumerate()
                .map(|(i, m)| sample(i as u64, vec![("bin", m.clone().into())]))
                .collect::<Vec<_>>();
            let packed = collate(samples(()), true).unwrap();
            let listed = collate(samples(()), false).unwrap();
            let Column::Packed { data, offsets } = &packed.fields[0].1 else {
                panic!("not packed");
            };
            let Column::Values(values) = &listed.fields[0].1 else {
                panic!("not a list");
            };
            proptest::prop_assert_eq!(offsets.len(), values.len() + 1);
            for (i, value) in values.iter().enumerate() {
                let (start, end) = (offsets[i] as usize, offsets[i + 1] as usize);
                proptest::prop_assert_eq!(&data[start..end], value.as_bytes().unwrap());
            }
            proptest::prop_assert_eq!(*offsets.last().unwrap() as usize, data.len());
        }
    }
}
