//! Field values: the raw bytes of a tar member or object, or a typed value
//! from a table column or a field decoder. The bindings turn each variant
//! into the matching Python object; nothing here knows Python.

use bytes::Bytes;

use crate::byte_size::ByteSize;

/// A field's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    Null,
    /// `bool`.
    Bool(bool),
    /// `int` (signed).
    Int(i64),
    /// `int` (unsigned, beyond `i64`).
    UInt(u64),
    /// `float`.
    Float(f64),
    /// `str`.
    Str(String),
    /// `bytes`: shared, so that a tar member read from a memory-mapped
    /// local shard reaches Python without being copied on the way.
    Bytes(Bytes),
    /// `list`.
    List(Vec<Value>),
    /// `tuple`.
    Tuple(Vec<Value>),
    /// `dict` with string keys, in order.
    Map(Vec<(String, Value)>),
    /// A numpy array.
    Array(Array),
}

impl Value {
    /// The raw bytes, when the value is [`Value::Bytes`].
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }
}

impl From<Vec<u8>> for Value {
    fn from(bytes: Vec<u8>) -> Self {
        Value::Bytes(bytes.into())
    }
}

impl ByteSize for Value {
    fn byte_size(&self) -> usize {
        match self {
            Value::Null | Value::Bool(_) => 1,
            Value::Int(_) | Value::UInt(_) | Value::Float(_) => 8,
            Value::Str(s) => s.len(),
            Value::Bytes(b) => b.len(),
            Value::List(items) | Value::Tuple(items) => items.iter().map(ByteSize::byte_size).sum(),
            Value::Map(entries) => entries.iter().map(|(k, v)| k.len() + v.byte_size()).sum(),
            Value::Array(array) => array.data.byte_size(),
        }
    }
}

/// An n-dimensional array in C order: the elements and the shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    /// Extent of each dimension; their product is the element count.
    pub shape: Vec<usize>,
    /// The elements.
    pub data: ArrayData,
}

impl Array {
    /// An array of `data` with `shape`, checking that the sizes agree.
    pub fn new(shape: Vec<usize>, data: ArrayData) -> Option<Array> {
        (shape.iter().product::<usize>() == data.len()).then_some(Array { shape, data })
    }
}

/// The elements of an [`Array`], by element type.
#[derive(Debug, Clone, PartialEq)]
pub enum ArrayData {
    /// `bool`.
    Bool(Vec<bool>),
    /// `uint8`.
    U8(Vec<u8>),
    /// `int8`.
    I8(Vec<i8>),
    /// `uint16`.
    U16(Vec<u16>),
    /// `int16`.
    I16(Vec<i16>),
    /// `uint32`.
    U32(Vec<u32>),
    /// `int32`.
    I32(Vec<i32>),
    /// `uint64`.
    U64(Vec<u64>),
    /// `int64`.
    I64(Vec<i64>),
    /// `float32`.
    F32(Vec<f32>),
    /// `float64`.
    F64(Vec<f64>),
}

/// Calls `$body` with `$v` bound to the typed vector of an [`ArrayData`].
#[macro_export]
#[doc(hidden)]
macro_rules! with_array_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::value::ArrayData::Bool($v) => $body,
            $crate::value::ArrayData::U8($v) => $body,
            $crate::value::ArrayData::I8($v) => $body,
            $crate::value::ArrayData::U16($v) => $body,
            $crate::value::ArrayData::I16($v) => $body,
            $crate::value::ArrayData::U32($v) => $body,
            $crate::value::ArrayData::I32($v) => $body,
            $crate::value::ArrayData::U64($v) => $body,
            $crate::value::ArrayData::I64($v) => $body,
            $crate::value::ArrayData::F32($v) => $body,
            $crate::value::ArrayData::F64($v) => $body,
        }
    };
}

impl ArrayData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        with_array_data!(self, v => v.len())
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The numpy name of the element type.
    pub fn dtype(&self) -> &'static str {
        match self {
            ArrayData::Bool(_) => "bool",
            ArrayData::U8(_) => "uint8",
            ArrayData::I8(_) => "int8",
            ArrayData::U16(_) => "uint16",
            ArrayData::I16(_) => "int16",
            ArrayData::U32(_) => "uint32",
            ArrayData::I32(_) => "int32",
            ArrayData::U64(_) => "uint64",
            ArrayData::I64(_) => "int64",
            ArrayData::F32(_) => "float32",
            ArrayData::F64(_) => "float64",
        }
    }
}

impl ByteSize for ArrayData {
    fn byte_size(&self) -> usize {
        with_array_data!(self, v => std::mem::size_of_val(v.as_slice()))
    }
}

#[cfg(test)]
impl PartialEq<Vec<u8>> for Value {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_bytes() == Some(other.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_checks_its_shape() {
        assert!(Array::new(vec![2, 3], ArrayData::F32(vec![0.0; 6])).is_some());
        assert!(Array::new(vec![2, 3], ArrayData::F32(vec![0.0; 5])).is_none());
        assert!(Array::new(vec![], ArrayData::I64(vec![7])).is_some());
    }

    #[test]
    fn byte_size_counts_elements_by_type() {
        let array = Array::new(vec![4], ArrayData::F64(vec![0.0; 4])).unwrap();
        assert_eq!(Value::Array(array).byte_size(), 32);
        let nested = Value::List(vec![Value::Str("abc".into()), Value::Int(1)]);
        assert_eq!(nested.byte_size(), 11);
    }
}
