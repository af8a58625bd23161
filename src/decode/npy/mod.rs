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

mod header;

use self::header::{parse_header, split_header, Header, Kind, ShapeText};
use crate::value::{Array, ArrayData};

/// Decodes a `.npy` file; reuses the buffer for `uint8` arrays.
pub(super) fn decode(mut bytes: Vec<u8>) -> Result<Array, String> {
    let (header, data_start) = split_header(&bytes)?;
    let Header {
        dtype,
        fortran_order,
        shape,
    } = parse_header(&header)?;
    let expected = byte_size(&shape, dtype.itemsize())?;
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

/// The most dimensions of a numpy array (numpy 2, which the package
/// requires; `NPY_MAXDIMS`).
const NUMPY_MAX_DIMS: usize = 64;

/// The bytes of the elements of an array of `shape` with `itemsize`-byte
/// elements, when numpy can make such an array: at most
/// [`NUMPY_MAX_DIMS`] dimensions, and the product of the dimensions other
/// than 0, times `itemsize`, within `npy_intp` (`isize`). That is numpy's
/// own check, which leaves zero dimensions out: a shape such as
/// `(0, 2**63 - 1)` has no element, yet numpy makes no array of it.
fn byte_size(shape: &[usize], itemsize: usize) -> Result<usize, String> {
    if shape.len() > NUMPY_MAX_DIMS {
        return Err(format!(
            "shape {} has {} dimensions; numpy arrays have at most {NUMPY_MAX_DIMS}",
            ShapeText(shape),
            shape.len()
        ));
    }
    let limit = isize::MAX.unsigned_abs();
    let mut bytes = itemsize;
    for &extent in shape.iter().filter(|&&extent| extent != 0) {
        bytes = bytes
            .checked_mul(extent)
            .filter(|&b| b <= limit)
            .ok_or_else(|| {
                format!(
                    "shape {} is too large for numpy: its dimensions other than 0 times the \
                     {itemsize}-byte element exceed {limit} bytes",
                    ShapeText(shape)
                )
            })?;
    }
    Ok(if shape.contains(&0) { 0 } else { bytes })
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

    /// Shapes whose element count is 0 but that numpy cannot make (a
    /// dimension, or the product of those other than 0, past `npy_intp` in
    /// bytes; too many dimensions) are refused from the header; the largest
    /// numpy makes are taken.
    #[test]
    fn shapes_numpy_cannot_make_are_refused() {
        let header = |descr: &str, shape: &str| {
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
        };
        let max = i64::MAX;
        for (descr, shape) in [
            ("<f4", format!("(0, {max})")),
            ("<f8", format!("({}, 0)", max / 8 + 1)),
            ("|u1", format!("(0, {})", max as u64 + 1)),
            ("|u1", format!("(0, {}, 0)", u64::MAX)),
            ("<i2", format!("(0, {}, {})", 1u64 << 32, 1u64 << 32)),
        ] {
            let reason = npy_err(npy(&header(descr, &shape), &[]));
            assert!(reason.contains("too large for numpy"), "{shape}: {reason}");
        }
        let many = format!("({})", "0, ".repeat(NUMPY_MAX_DIMS + 1));
        let reason = npy_err(npy(&header("<f4", &many), &[]));
        assert!(reason.contains("numpy arrays have at most 64"), "{reason}");
        // numpy's own limits, reached but not passed: arrays with no element.
        for (descr, shape) in [
            ("|u1", format!("(0, {max})")),
            ("<f8", format!("({}, 0)", max / 8)),
            ("<f4", format!("({})", "0, ".repeat(NUMPY_MAX_DIMS))),
        ] {
            let array = array(npy(&header(descr, &shape), &[]));
            assert_eq!(array.data.len(), 0, "{shape}");
        }
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
}
