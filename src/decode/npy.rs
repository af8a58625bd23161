//! The `numpy` decoder: a `.npy` file (format version 1.0, 2.0 or 3.0)
//! into an [`Array`] in C order.
//!
//! The file is the magic `\x93NUMPY`, a version, a header length (2 bytes
//! in version 1, 4 in versions 2 and 3), a header that is the text of a
//! Python dict literal with exactly the keys `'descr'`, `'fortran_order'`
//! and `'shape'`, then the elements. Supported element types (`descr`):
//! `b1` (bool), `u1`, `i1`, `u2`, `i2`, `u4`, `i4`, `u8`, `i8`, `f4`,
//! `f8`, each with byte order `<` (little), `>` (big, byte-swapped here),
//! `=` (native) or `|` (not applicable, one-byte types only). Anything else
//! (float16, complex, strings, objects, datetimes, structured dtypes) is an
//! error naming the `descr`. Fortran-order files are transposed into C
//! order, so the array has the same shape and the same element at every
//! index as `numpy.load` gives. The element bytes must be exactly
//! `product(shape) * itemsize` long.

use std::fmt;

use crate::value::{Array, ArrayData};

const MAGIC: &[u8] = b"\x93NUMPY";

/// Nesting allowed in the header literal (shapes and dtypes need 3).
const MAX_DEPTH: usize = 32;

/// Decodes a `.npy` file; reuses the buffer for `uint8` arrays.
pub(super) fn decode(mut bytes: Vec<u8>) -> Result<Array, String> {
    let (header, data_start) = split_header(&bytes)?;
    let Header {
        dtype,
        fortran_order,
        shape,
    } = parse_header(&header)?;
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {} is too large", ShapeText(&shape)))?;
    let expected = count
        .checked_mul(dtype.itemsize())
        .ok_or_else(|| format!("shape {} is too large", ShapeText(&shape)))?;
    let found = bytes.len() - data_start;
    if found != expected {
        return Err(format!(
            "data is {found} bytes but shape {} of {} needs {expected}",
            ShapeText(&shape),
            dtype.name()
        ));
    }
    fn reorder<T: Copy>(data: Vec<T>, fortran_order: bool, shape: &[usize]) -> Vec<T> {
        if fortran_order {
            fortran_to_c(data, shape)
        } else {
            data
        }
    }
    macro_rules! order {
        ($data:expr) => {
            reorder($data, fortran_order, &shape)
        };
    }
    let raw = &bytes[data_start..];
    let big = dtype.big_endian;
    let data = match dtype.kind {
        Kind::Bool => ArrayData::Bool(order!(raw.iter().map(|&b| b != 0).collect())),
        Kind::I8 => ArrayData::I8(order!(raw.iter().map(|&b| b as i8).collect())),
        Kind::U16 => ArrayData::U16(order!(convert(raw, big))),
        Kind::I16 => ArrayData::I16(order!(convert(raw, big))),
        Kind::U32 => ArrayData::U32(order!(convert(raw, big))),
        Kind::I32 => ArrayData::I32(order!(convert(raw, big))),
        Kind::U64 => ArrayData::U64(order!(convert(raw, big))),
        Kind::I64 => ArrayData::I64(order!(convert(raw, big))),
        Kind::F32 => ArrayData::F32(order!(convert(raw, big))),
        Kind::F64 => ArrayData::F64(order!(convert(raw, big))),
        Kind::U8 => {
            bytes.drain(..data_start);
            ArrayData::U8(order!(bytes))
        }
    };
    Ok(Array::new(shape, data).expect("element count was checked against the shape"))
}

/// The header text and the offset of the first element byte.
fn split_header(bytes: &[u8]) -> Result<(String, usize), String> {
    if !bytes.starts_with(MAGIC) {
        let head = &bytes[..bytes.len().min(MAGIC.len())];
        return Err(format!(
            "not a .npy file (expected magic \\x93NUMPY, found {})",
            escape_bytes(head)
        ));
    }
    let (major, minor) = match bytes.get(6..8) {
        Some(&[major, minor]) => (major, minor),
        _ => return Err("truncated .npy file (no version)".to_owned()),
    };
    let (header_len, header_start): (usize, usize) = match major {
        1 => match bytes.get(8..10) {
            Some(&[a, b]) => (usize::from(u16::from_le_bytes([a, b])), 10usize),
            _ => return Err("truncated .npy file (no header length)".to_owned()),
        },
        2 | 3 => match bytes.get(8..12) {
            Some(&[a, b, c, d]) => (u32::from_le_bytes([a, b, c, d]) as usize, 12),
            _ => return Err("truncated .npy file (no header length)".to_owned()),
        },
        _ => return Err(format!("unsupported .npy format version {major}.{minor}")),
    };
    let header_end = header_start.saturating_add(header_len);
    let Some(raw) = bytes.get(header_start..header_end) else {
        return Err(format!(
            "truncated .npy header (declares {header_len} bytes, {} present)",
            bytes.len() - header_start
        ));
    };
    let header = if major == 3 {
        String::from_utf8(raw.to_vec())
            .map_err(|e| format!("header is not UTF-8: {}", e.utf8_error()))?
    } else {
        // Versions 1 and 2 encode the header in latin-1.
        raw.iter().map(|&b| char::from(b)).collect()
    };
    Ok((header, header_end))
}

/// Bytes as Python would show them inside `b'...'`.
fn escape_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .flat_map(|&b| std::ascii::escape_default(b))
        .map(char::from)
        .collect()
}

/// The three header fields.
struct Header {
    dtype: Dtype,
    fortran_order: bool,
    shape: Vec<usize>,
}

fn parse_header(text: &str) -> Result<Header, String> {
    let literal =
        Parser::parse(text).map_err(|e| format!("malformed header {:?}: {e}", text.trim_end()))?;
    let Literal::Dict(entries) = literal else {
        return Err(format!("header is not a dict: {literal}"));
    };
    let mut descr = None;
    let mut fortran_order = None;
    let mut shape = None;
    for (key, value) in entries {
        let slot = match &key {
            Literal::Str(name) if name == "descr" => &mut descr,
            Literal::Str(name) if name == "fortran_order" => &mut fortran_order,
            Literal::Str(name) if name == "shape" => &mut shape,
            _ => return Err(format!("unexpected header key {key}")),
        };
        if slot.replace(value).is_some() {
            return Err(format!("header key {key} appears twice"));
        }
    }
    let missing = |key| format!("header has no {key:?} key");
    let descr = descr.ok_or_else(|| missing("descr"))?;
    let dtype = Dtype::parse(&descr)?;
    let fortran_order = match fortran_order.ok_or_else(|| missing("fortran_order"))? {
        Literal::Bool(value) => value,
        other => return Err(format!("'fortran_order' is {other}, not True or False")),
    };
    let shape = match shape.ok_or_else(|| missing("shape"))? {
        Literal::Tuple(items) => items
            .iter()
            .map(|item| match item {
                Literal::Int(n) => usize::try_from(*n).ok(),
                _ => None,
            })
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| {
                format!(
                    "'shape' {} is not a tuple of sizes",
                    Literal::Tuple(items.clone())
                )
            })?,
        other => return Err(format!("'shape' {other} is not a tuple")),
    };
    Ok(Header {
        dtype,
        fortran_order,
        shape,
    })
}

/// A supported element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F32,
    F64,
}

/// An element type and the byte order of the file's elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dtype {
    kind: Kind,
    big_endian: bool,
}

impl Dtype {
    fn parse(descr: &Literal) -> Result<Dtype, String> {
        let text = match descr {
            Literal::Str(text) => text,
            Literal::List(_) => {
                return Err(format!(
                    "unsupported dtype descr {descr} (structured dtypes are not supported)"
                ))
            }
            _ => return Err(format!("'descr' {descr} is not a string")),
        };
        let unsupported = || {
            format!(
                "unsupported dtype descr {descr} (supported: b1, u1, i1, u2, i2, u4, i4, u8, i8, \
                 f4, f8, little- or big-endian)"
            )
        };
        let (order, code) = match text.as_bytes().first() {
            Some(&c @ (b'<' | b'>' | b'|' | b'=')) => (c, &text[1..]),
            _ => (b'=', text.as_str()),
        };
        let kind = match code {
            "b1" => Kind::Bool,
            "u1" => Kind::U8,
            "i1" => Kind::I8,
            "u2" => Kind::U16,
            "i2" => Kind::I16,
            "u4" => Kind::U32,
            "i4" => Kind::I32,
            "u8" => Kind::U64,
            "i8" => Kind::I64,
            "f4" => Kind::F32,
            "f8" => Kind::F64,
            _ => return Err(unsupported()),
        };
        let big_endian = match order {
            b'<' => false,
            b'>' => true,
            b'=' => cfg!(target_endian = "big"),
            // '|' (byte order not applicable) is only valid for one byte.
            _ if matches!(kind, Kind::Bool | Kind::U8 | Kind::I8) => false,
            _ => return Err(unsupported()),
        };
        Ok(Dtype { kind, big_endian })
    }

    fn itemsize(&self) -> usize {
        match self.kind {
            Kind::Bool | Kind::U8 | Kind::I8 => 1,
            Kind::U16 | Kind::I16 => 2,
            Kind::U32 | Kind::I32 | Kind::F32 => 4,
            Kind::U64 | Kind::I64 | Kind::F64 => 8,
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Bool => "bool",
            Kind::U8 => "uint8",
            Kind::I8 => "int8",
            Kind::U16 => "uint16",
            Kind::I16 => "int16",
            Kind::U32 => "uint32",
            Kind::I32 => "int32",
            Kind::U64 => "uint64",
            Kind::I64 => "int64",
            Kind::F32 => "float32",
            Kind::F64 => "float64",
        }
    }
}

/// An element type read from `N` bytes in either byte order.
trait FromBytes<const N: usize> {
    fn from_le(bytes: [u8; N]) -> Self;
    fn from_be(bytes: [u8; N]) -> Self;
}

macro_rules! from_bytes {
    ($($t:ty),*) => {$(
        impl FromBytes<{ std::mem::size_of::<$t>() }> for $t {
            fn from_le(bytes: [u8; std::mem::size_of::<$t>()]) -> Self {
                <$t>::from_le_bytes(bytes)
            }
            fn from_be(bytes: [u8; std::mem::size_of::<$t>()]) -> Self {
                <$t>::from_be_bytes(bytes)
            }
        }
    )*};
}

from_bytes!(u16, i16, u32, i32, u64, i64, f32, f64);

/// The elements of `raw` (whose length is a multiple of `N`).
fn convert<T: FromBytes<N>, const N: usize>(raw: &[u8], big_endian: bool) -> Vec<T> {
    let (chunks, _) = raw.as_chunks::<N>();
    if big_endian {
        chunks.iter().map(|c| T::from_be(*c)).collect()
    } else {
        chunks.iter().map(|c| T::from_le(*c)).collect()
    }
}

/// The elements of a Fortran-order (column-major) array of `shape`,
/// reordered into C order (row-major).
fn fortran_to_c<T: Copy>(data: Vec<T>, shape: &[usize]) -> Vec<T> {
    let ndim = shape.len();
    if ndim < 2 || data.is_empty() {
        return data;
    }
    // Offset of each dimension's step in the Fortran-order data.
    let mut strides = Vec::with_capacity(ndim);
    let mut stride = 1;
    for &extent in shape {
        strides.push(stride);
        stride *= extent;
    }
    let mut out = Vec::with_capacity(data.len());
    let mut index = vec![0usize; ndim];
    let mut offset = 0;
    for _ in 0..data.len() {
        out.push(data[offset]);
        // Step the C-order index: last dimension fastest, carrying left.
        for axis in (0..ndim).rev() {
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < shape[axis] {
                break;
            }
            offset -= strides[axis] * shape[axis];
            index[axis] = 0;
        }
    }
    out
}

/// A shape shown as a Python tuple.
struct ShapeText<'a>(&'a [usize]);

impl fmt::Display for ShapeText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "({one},)"),
            dims => {
                let dims: Vec<String> = dims.iter().map(usize::to_string).collect();
                write!(f, "({})", dims.join(", "))
            }
        }
    }
}

/// The subset of Python literals that `.npy` headers use.
#[derive(Debug, Clone, PartialEq)]
enum Literal {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Literal>),
    List(Vec<Literal>),
    Dict(Vec<(Literal, Literal)>),
}

impl fmt::Display for Literal {
    /// Python's `repr`, near enough for error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn items(f: &mut fmt::Formatter<'_>, items: &[Literal]) -> fmt::Result {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{item}")?;
            }
            Ok(())
        }
        match self {
            Literal::Str(text) => {
                f.write_str("'")?;
                for c in text.chars() {
                    match c {
                        '\'' => f.write_str("\\'")?,
                        '\\' => f.write_str("\\\\")?,
                        c if c.is_control() => write!(f, "{}", c.escape_default())?,
                        c => write!(f, "{c}")?,
                    }
                }
                f.write_str("'")
            }
            Literal::Int(n) => write!(f, "{n}"),
            Literal::Bool(true) => f.write_str("True"),
            Literal::Bool(false) => f.write_str("False"),
            Literal::None => f.write_str("None"),
            Literal::Tuple(values) => {
                f.write_str("(")?;
                items(f, values)?;
                f.write_str(if values.len() == 1 { ",)" } else { ")" })
            }
            Literal::List(values) => {
                f.write_str("[")?;
                items(f, values)?;
                f.write_str("]")
            }
            Literal::Dict(entries) => {
                f.write_str("{")?;
                for (i, (key, value)) in entries.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{key}: {value}")?;
                }
                f.write_str("}")
            }
        }
    }
}

/// A recursive-descent parser for [`Literal`]s.
struct Parser<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> Parser<'a> {
    /// The single literal that `text` holds, with surrounding whitespace.
    fn parse(text: &'a str) -> Result<Literal, String> {
        let mut parser = Parser {
            text,
            pos: 0,
            depth: 0,
        };
        let value = parser.value()?;
        parser.skip_space();
        if parser.pos != text.len() {
            return Err(format!("unexpected text at offset {}", parser.pos));
        }
        Ok(value)
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }

    /// Consumes `byte` if it is next (after whitespace).
    fn eat(&mut self, byte: u8) -> bool {
        self.skip_space();
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<Literal, String> {
        self.skip_space();
        let at = self.pos;
        match self.peek() {
            None => Err("unexpected end".to_owned()),
            Some(quote @ (b'\'' | b'"')) => self.string(quote),
            Some(b'(') => {
                let (values, trailing_comma) = self.sequence(b')')?;
                // `(x)` is just `x` in Python; `(x,)` is a tuple.
                if values.len() == 1 && !trailing_comma {
                    Ok(values.into_iter().next().expect("one value"))
                } else {
                    Ok(Literal::Tuple(values))
                }
            }
            Some(b'[') => Ok(Literal::List(self.sequence(b']')?.0)),
            Some(b'{') => self.dict(),
            Some(b'-' | b'+' | b'0'..=b'9') => self.int(),
            Some(b) if b.is_ascii_alphabetic() => {
                let start = self.pos;
                while self
                    .peek()
                    .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
                {
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    "True" => Ok(Literal::Bool(true)),
                    "False" => Ok(Literal::Bool(false)),
                    "None" => Ok(Literal::None),
                    word => Err(format!("unexpected name {word:?} at offset {at}")),
                }
            }
            Some(_) => Err(format!("unexpected character at offset {at}")),
        }
    }

    fn enter(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err("nested too deeply".to_owned());
        }
        Ok(())
    }

    /// The values of a `(...)` or `[...]` (the opener is next), and
    /// whether the last one had a trailing comma.
    fn sequence(&mut self, close: u8) -> Result<(Vec<Literal>, bool), String> {
        self.enter()?;
        self.pos += 1;
        let mut values = Vec::new();
        let mut trailing_comma = false;
        while !self.eat(close) {
            values.push(self.value()?);
            trailing_comma = self.eat(b',');
            if !trailing_comma {
                if !self.eat(close) {
                    return Err(format!(
                        "expected ',' or '{}' at offset {}",
                        char::from(close),
                        self.pos
                    ));
                }
                break;
            }
        }
        self.depth -= 1;
        Ok((values, trailing_comma))
    }

    /// A `{key: value, ...}` (the `{` is next).
    fn dict(&mut self) -> Result<Literal, String> {
        self.enter()?;
        self.pos += 1;
        let mut entries = Vec::new();
        while !self.eat(b'}') {
            let key = self.value()?;
            if !self.eat(b':') {
                return Err(format!("expected ':' at offset {}", self.pos));
            }
            let value = self.value()?;
            entries.push((key, value));
            if !self.eat(b',') {
                if !self.eat(b'}') {
                    return Err(format!("expected ',' or '}}' at offset {}", self.pos));
                }
                break;
            }
        }
        self.depth -= 1;
        Ok(Literal::Dict(entries))
    }

    /// An integer, with the `L` suffix of Python 2 longs allowed.
    fn int(&mut self) -> Result<Literal, String> {
        let start = self.pos;
        if matches!(self.peek(), Some(b'-' | b'+')) {
            self.pos += 1;
        }
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
        let digits = &self.text[start..self.pos];
        if matches!(self.peek(), Some(b'L' | b'l')) {
            self.pos += 1;
        }
        digits
            .parse()
            .map(Literal::Int)
            .map_err(|_| format!("invalid integer {digits:?} at offset {start}"))
    }

    /// A quoted string (the quote is next), with backslash escapes of the
    /// quote and the backslash.
    fn string(&mut self, quote: u8) -> Result<Literal, String> {
        let start = self.pos;
        self.pos += 1;
        let mut text = String::new();
        loop {
            let rest = &self.text[self.pos..];
            let Some(end) = rest.find(|c| c == char::from(quote) || c == '\\') else {
                return Err(format!("unterminated string at offset {start}"));
            };
            text.push_str(&rest[..end]);
            self.pos += end;
            if self.peek() == Some(quote) {
                self.pos += 1;
                return Ok(Literal::Str(text));
            }
            // A backslash: keep the escaped character as is.
            self.pos += 1;
            let Some(c) = self.text[self.pos..].chars().next() else {
                return Err(format!("unterminated string at offset {start}"));
            };
            text.push(c);
            self.pos += c.len_utf8();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Decoder;
    use crate::value::Value;

    /// A version-1 `.npy` file, padded like numpy pads it.
    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        npy_version(1, header, data)
    }

    fn npy_version(major: u8, header: &str, data: &[u8]) -> Vec<u8> {
        let prefix: usize = if major == 1 { 10 } else { 12 };
        let mut header = header.to_owned();
        while !(prefix + header.len() + 1).is_multiple_of(64) {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = b"\x93NUMPY".to_vec();
        bytes.extend([major, 0]);
        if major == 1 {
            bytes.extend((header.len() as u16).to_le_bytes());
        } else {
            bytes.extend((header.len() as u32).to_le_bytes());
        }
        bytes.extend(header.as_bytes());
        bytes.extend(data);
        bytes
    }

    fn array(bytes: Vec<u8>) -> Array {
        match Decoder::Numpy.decode(bytes) {
            Ok(Value::Array(array)) => array,
            other => panic!("expected an array, got {other:?}"),
        }
    }

    fn npy_err(bytes: Vec<u8>) -> String {
        let error = Decoder::Numpy.decode(bytes).unwrap_err();
        assert_eq!(error.decoder, "numpy");
        error.reason
    }

    fn le<T: Copy, const N: usize>(values: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
        values.iter().flat_map(|&v| f(v)).collect()
    }

    #[test]
    fn float32_matrix() {
        let values = [1.5f32, -2.0, 0.25, 3.0e-8, f32::MAX, -0.0];
        let bytes = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &le(&values, f32::to_le_bytes),
        );
        assert_eq!(bytes.len() % 64, 24);
        let array = array(bytes);
        assert_eq!(array.shape, vec![2, 3]);
        assert_eq!(array.data, ArrayData::F32(values.to_vec()));
    }

    #[test]
    fn every_integer_and_float_type() {
        let header = |descr: &str| {
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (3,), }}")
        };
        let cases: Vec<(&str, Vec<u8>, ArrayData)> = vec![
            (
                "|b1",
                vec![1, 0, 1],
                ArrayData::Bool(vec![true, false, true]),
            ),
            ("|u1", vec![0, 128, 255], ArrayData::U8(vec![0, 128, 255])),
            ("|i1", vec![0, 128, 255], ArrayData::I8(vec![0, -128, -1])),
            ("<u1", vec![1, 2, 3], ArrayData::U8(vec![1, 2, 3])),
            (
                "b1",
                vec![0, 0, 1],
                ArrayData::Bool(vec![false, false, true]),
            ),
            (
                "<u2",
                le(&[0u16, 1, u16::MAX], u16::to_le_bytes),
                ArrayData::U16(vec![0, 1, u16::MAX]),
            ),
            (
                "<i2",
                le(&[i16::MIN, -1, i16::MAX], i16::to_le_bytes),
                ArrayData::I16(vec![i16::MIN, -1, i16::MAX]),
            ),
            (
                "<u4",
                le(&[7u32, 1 << 31, u32::MAX], u32::to_le_bytes),
                ArrayData::U32(vec![7, 1 << 31, u32::MAX]),
            ),
            (
                "<i4",
                le(&[i32::MIN, 0, 123456], i32::to_le_bytes),
                ArrayData::I32(vec![i32::MIN, 0, 123456]),
            ),
            (
                "<u8",
                le(&[u64::MAX, 0, 1 << 40], u64::to_le_bytes),
                ArrayData::U64(vec![u64::MAX, 0, 1 << 40]),
            ),
            (
                "<i8",
                le(&[i64::MIN, -5, i64::MAX], i64::to_le_bytes),
                ArrayData::I64(vec![i64::MIN, -5, i64::MAX]),
            ),
            (
                "<f8",
                le(&[0.1f64, -1e300, 5e-324], f64::to_le_bytes),
                ArrayData::F64(vec![0.1, -1e300, 5e-324]),
            ),
            (
                "=i4",
                le(&[1i32, 2, 3], i32::to_ne_bytes),
                ArrayData::I32(vec![1, 2, 3]),
            ),
        ];
        for (descr, data, expected) in cases {
            let array = array(npy(&header(descr), &data));
            assert_eq!(array.shape, vec![3], "{descr}");
            assert_eq!(array.data, expected, "{descr}");
        }
    }

    #[test]
    fn big_endian_is_swapped() {
        let header = |descr: &str| {
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (2,), }}")
        };
        let cases: Vec<(&str, Vec<u8>, ArrayData)> = vec![
            (
                ">u2",
                le(&[258u16, 1], u16::to_be_bytes),
                ArrayData::U16(vec![258, 1]),
            ),
            (
                ">i2",
                le(&[-2i16, 300], i16::to_be_bytes),
                ArrayData::I16(vec![-2, 300]),
            ),
            (
                ">i4",
                le(&[-70000i32, 1], i32::to_be_bytes),
                ArrayData::I32(vec![-70000, 1]),
            ),
            (
                ">u4",
                le(&[0xdeadbeefu32, 1], u32::to_be_bytes),
                ArrayData::U32(vec![0xdeadbeef, 1]),
            ),
            (
                ">i8",
                le(&[-1i64 << 40, 9], i64::to_be_bytes),
                ArrayData::I64(vec![-1 << 40, 9]),
            ),
            (
                ">u8",
                le(&[u64::MAX - 1, 2], u64::to_be_bytes),
                ArrayData::U64(vec![u64::MAX - 1, 2]),
            ),
            (
                ">f4",
                le(&[1.25f32, -3.5], f32::to_be_bytes),
                ArrayData::F32(vec![1.25, -3.5]),
            ),
            (
                ">f8",
                le(&[std::f64::consts::PI, 2.0], f64::to_be_bytes),
                ArrayData::F64(vec![std::f64::consts::PI, 2.0]),
            ),
            (">u1", vec![9, 10], ArrayData::U8(vec![9, 10])),
        ];
        for (descr, data, expected) in cases {
            assert_eq!(array(npy(&header(descr), &data)).data, expected, "{descr}");
        }
    }

    #[test]
    fn zero_dimensional_and_empty_arrays() {
        let scalar = array(npy(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (), }",
            &42i64.to_le_bytes(),
        ));
        assert_eq!(scalar.shape, Vec::<usize>::new());
        assert_eq!(scalar.data, ArrayData::I64(vec![42]));

        let empty = array(npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5), }",
            &[],
        ));
        assert_eq!(empty.shape, vec![0, 5]);
        assert_eq!(empty.data, ArrayData::F32(vec![]));

        let empty_fortran = array(npy(
            "{'descr': '<f8', 'fortran_order': True, 'shape': (3, 0), }",
            &[],
        ));
        assert_eq!(empty_fortran.shape, vec![3, 0]);
        assert_eq!(empty_fortran.data, ArrayData::F64(vec![]));
    }

    #[test]
    fn fortran_order_is_transposed_into_c_order() {
        // np.asfortranarray(np.arange(6, dtype='<i4').reshape(2, 3)) stores
        // its columns: 0 3 1 4 2 5.
        let stored = le(&[0i32, 3, 1, 4, 2, 5], i32::to_le_bytes);
        let matrix = array(npy(
            "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }",
            &stored,
        ));
        assert_eq!(matrix.shape, vec![2, 3]);
        assert_eq!(matrix.data, ArrayData::I32(vec![0, 1, 2, 3, 4, 5]));

        // A (2, 3, 4) array whose element at (i, j, k) is 100i + 10j + k,
        // stored in Fortran order (i fastest).
        let mut stored = Vec::new();
        for k in 0..4u16 {
            for j in 0..3u16 {
                for i in 0..2u16 {
                    stored.push(100 * i + 10 * j + k);
                }
            }
        }
        let cube = array(npy(
            "{'descr': '>u2', 'fortran_order': True, 'shape': (2, 3, 4), }",
            &le(&stored, u16::to_be_bytes),
        ));
        let mut expected = Vec::new();
        for i in 0..2u16 {
            for j in 0..3u16 {
                for k in 0..4u16 {
                    expected.push(100 * i + 10 * j + k);
                }
            }
        }
        assert_eq!(cube.shape, vec![2, 3, 4]);
        assert_eq!(cube.data, ArrayData::U16(expected));

        // Bytes and bools go through the same path.
        let bools = array(npy(
            "{'descr': '|b1', 'fortran_order': True, 'shape': (2, 2), }",
            &[1, 0, 1, 1],
        ));
        assert_eq!(bools.data, ArrayData::Bool(vec![true, true, false, true]));
        let bytes = array(npy(
            "{'descr': '|u1', 'fortran_order': True, 'shape': (3, 2), }",
            &[1, 2, 3, 4, 5, 6],
        ));
        assert_eq!(bytes.data, ArrayData::U8(vec![1, 4, 2, 5, 3, 6]));
        // One-dimensional Fortran order is the same as C order.
        let line = array(npy(
            "{'descr': '<f8', 'fortran_order': True, 'shape': (2,), }",
            &le(&[1.0f64, 2.0], f64::to_le_bytes),
        ));
        assert_eq!(line.data, ArrayData::F64(vec![1.0, 2.0]));
    }

    #[test]
    fn versions_two_and_three_and_header_spelling() {
        let data = le(&[1.0f32, 2.0], f32::to_le_bytes);
        for major in [2, 3] {
            let array = array(npy_version(
                major,
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                &data,
            ));
            assert_eq!(array.data, ArrayData::F32(vec![1.0, 2.0]));
        }
        // Key order, double quotes, no trailing comma, Python 2 longs.
        let array = array(npy(
            "{\"shape\": (1L, 2L), \"fortran_order\": False, \"descr\": \"<f4\"}",
            &data,
        ));
        assert_eq!(array.shape, vec![1, 2]);
    }

    #[test]
    fn bad_magic_version_and_truncation() {
        assert_eq!(
            npy_err(b"PK\x03\x04 not npy".to_vec()),
            "not a .npy file (expected magic \\x93NUMPY, found PK\\x03\\x04 n)"
        );
        assert!(npy_err(Vec::new()).starts_with("not a .npy file"));
        assert_eq!(
            npy_err(b"\x93NUMPY".to_vec()),
            "truncated .npy file (no version)"
        );
        assert_eq!(
            npy_err(b"\x93NUMPY\x01\x00\x10".to_vec()),
            "truncated .npy file (no header length)"
        );
        let mut future = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
            &[0; 4],
        );
        future[6] = 4;
        assert_eq!(npy_err(future), "unsupported .npy format version 4.0");
        let full = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
            &[0; 4],
        );
        assert_eq!(
            npy_err(full[..40].to_vec()),
            "truncated .npy header (declares 118 bytes, 30 present)"
        );
    }

    #[test]
    fn data_length_must_match_exactly() {
        let header = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }";
        assert_eq!(
            npy_err(npy(header, &[0; 15])),
            "data is 15 bytes but shape (2, 2) of int32 needs 16"
        );
        assert_eq!(
            npy_err(npy(header, &[0; 17])),
            "data is 17 bytes but shape (2, 2) of int32 needs 16"
        );
        assert!(npy_err(npy(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904, 4), }",
            &[]
        ))
        .contains("too large"));
        assert!(npy_err(npy(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904,), }",
            &[]
        ))
        .contains("too large"));
    }

    #[test]
    fn unsupported_descrs_are_named() {
        for descr in [
            "<f2", "<c8", "<U10", "|S4", "|O", "<M8[ns]", "|V8", "|u2", "<b2", "<f16",
        ] {
            let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (1,), }}");
            let reason = npy_err(npy(&header, &[0; 16]));
            assert!(
                reason.starts_with(&format!("unsupported dtype descr '{descr}'")),
                "{reason}"
            );
        }
        let structured = npy(
            "{'descr': [('x', '<f4'), ('y', '<f4')], 'fortran_order': False, 'shape': (1,), }",
            &[0; 8],
        );
        assert_eq!(
            npy_err(structured),
            "unsupported dtype descr [('x', '<f4'), ('y', '<f4')] (structured dtypes are not supported)"
        );
    }

    #[test]
    fn malformed_headers_are_errors() {
        let cases = [
            (
                "{'descr': '<f4', 'fortran_order': False}",
                "header has no \"shape\" key",
            ),
            (
                "{'descr': '<f4', 'shape': ()}",
                "header has no \"fortran_order\" key",
            ),
            (
                "{'fortran_order': False, 'shape': ()}",
                "header has no \"descr\" key",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}",
                "unexpected header key 'x'",
            ),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}",
                "header key 'descr' appears twice",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': ()}",
                "'fortran_order' is 0, not True or False",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': [1]}",
                "'shape' [1] is not a tuple",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1)}",
                "'shape' 1 is not a tuple",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
                "'shape' (-1,) is not a tuple of sizes",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': ('a', 2)}",
                "'shape' ('a', 2) is not a tuple of sizes",
            ),
            (
                "{'descr': 4, 'fortran_order': False, 'shape': ()}",
                "'descr' 4 is not a string",
            ),
            ("['descr', '<f4']", "header is not a dict: ['descr', '<f4']"),
        ];
        for (header, expected) in cases {
            assert_eq!(npy_err(npy(header, &[0; 4])), expected, "{header}");
        }
        for header in [
            "",
            "{",
            "{'descr': '<f4' 'shape': ()}",
            "{'descr': '<f4', 'fortran_order': false, 'shape': ()}",
            "{'descr: '<f4'}",
            "{'descr': '<f4'} trailing",
            "{'a': ((((((((((((((((((((((((((((((((((((1,),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),),)}",
            "{'shape': (99999999999999999999999999999999999999999,)}",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (1 2)}",
            "{'descr': '\\",
        ] {
            let reason = npy_err(npy(header, &[0; 4]));
            assert!(reason.starts_with("malformed header"), "{header}: {reason}");
        }
        // A version-3 header must be UTF-8.
        let mut bad = npy_version(
            3,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
            &[0; 4],
        );
        bad[14] = 0xff;
        assert!(npy_err(bad).starts_with("header is not UTF-8"));
    }

    #[test]
    fn fortran_to_c_matches_index_arithmetic() {
        let shape = [3usize, 4, 2, 5];
        let count: usize = shape.iter().product();
        // Fortran-order storage of the array whose value is its C-order
        // flat index.
        let mut stored = vec![0usize; count];
        for c_index in 0..count {
            let mut rest = c_index;
            let mut index = [0usize; 4];
            for axis in (0..4).rev() {
                index[axis] = rest % shape[axis];
                rest /= shape[axis];
            }
            let f_offset =
                index[0] + shape[0] * (index[1] + shape[1] * (index[2] + shape[2] * index[3]));
            stored[f_offset] = c_index;
        }
        assert_eq!(fortran_to_c(stored, &shape), (0..count).collect::<Vec<_>>());
    }

    #[test]
    fn literal_display_is_python_repr() {
        let literal =
            Parser::parse("{'a': (1,), 'b': [True, None, -3], 'c': ('x\\'y', 2)}").unwrap();
        assert_eq!(
            literal.to_string(),
            "{'a': (1,), 'b': [True, None, -3], 'c': ('x\\'y', 2)}"
        );
        assert_eq!(Parser::parse("()").unwrap(), Literal::Tuple(vec![]));
        assert_eq!(Parser::parse(" ( 7 ) ").unwrap(), Literal::Int(7));
    }
}
