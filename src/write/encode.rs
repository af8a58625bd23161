//! What may be written, and how: the checks that keep a sample's key and
//! field names reading back the same (with shardstream's reader and
//! webdataset's), and the encodings of non-bytes values, which follow
//! webdataset 1.0.2's `TarWriter` (its default encoder) wherever it accepts
//! a value. `docs/writing.md` states the rules.

use crate::error::Error;

/// Field extensions whose numbers webdataset writes as text (`str(x)`).
const NUMBER_EXTENSIONS: [&str; 7] = ["cls", "cls2", "class", "count", "index", "inx", "id"];
/// Field extensions whose values webdataset writes as JSON (`json.dumps(x)`).
const JSON_EXTENSIONS: [&str; 2] = ["json", "jsn"];
/// The longest member name (`key.field`) written: far below the 1 MiB the
/// reader takes in a long-name header.
pub const MAX_NAME_BYTES: usize = 4096;

/// A field's value as given, before it is encoded to bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    /// Bytes, written as they are.
    Bytes(Vec<u8>),
    /// Text, written as UTF-8.
    Text(String),
    /// A number (or bool), in the two forms webdataset may write it.
    Number {
        /// The type's name, for messages (`int`, `float`, `bool`).
        kind: String,
        /// As Python's `str(x)` writes it.
        text: String,
        /// As Python's `json.dumps(x)` writes it.
        json: String,
    },
    /// A dict or list, as Python's `json.dumps(x)` writes it.
    Json {
        /// The type's name, for messages (`dict`, `list`).
        kind: String,
        /// The JSON text.
        json: String,
    },
}

/// The error of a sample with the wrong key, field name or value.
pub(crate) fn invalid(key: Option<&str>, field: Option<&str>, reason: String) -> Error {
    Error::InvalidSample {
        key: key.map(str::to_owned),
        field: field.map(str::to_owned),
        reason,
        wrong_type: false,
    }
}

fn wrong_type(key: &str, field: &str, reason: String) -> Error {
    Error::InvalidSample {
        key: Some(key.to_owned()),
        field: Some(field.to_owned()),
        reason,
        wrong_type: true,
    }
}

/// Checks that `key` reads back as the same key: not empty, no `.` (the
/// readers cut the member name at its first dot), `/` only between
/// non-empty path segments, no control characters.
pub fn check_key(key: &str) -> Result<(), Error> {
    let refuse = |why: &str| Err(invalid(Some(key), None, format!("invalid __key__: {why}")));
    if key.is_empty() {
        return refuse("it is empty");
    }
    if key.contains('.') {
        return refuse("it contains '.', where readers end the key and start the field name");
    }
    if key.starts_with('/') || key.ends_with('/') || key.contains("//") {
        return refuse("'/' may only separate non-empty path segments");
    }
    if key.chars().any(char::is_control) {
        return refuse("it contains a control character");
    }
    if key.len() >= MAX_NAME_BYTES {
        return refuse(&format!(
            "it is {} bytes long (at most {})",
            key.len(),
            MAX_NAME_BYTES - 1
        ));
    }
    Ok(())
}

/// Checks that field `field` of sample `key` reads back under the same
/// name: not empty, lower case (readers lower-case field names), no `/`,
/// no leading `_` (webdataset's writer keeps those for metadata and leaves
/// them out), dots only between non-empty parts (`seg.png` is the field
/// `seg.png`), no control characters.
pub fn check_field(key: &str, field: &str) -> Result<(), Error> {
    let refuse = |why: String| {
        Err(invalid(
            Some(key),
            Some(field),
            format!("invalid field name: {why}"),
        ))
    };
    if field.is_empty() {
        return refuse("it is empty".into());
    }
    if field.contains('/') {
        return refuse("it contains '/', which would move it into another key".into());
    }
    if field.starts_with('_') {
        return refuse(
            "names starting with '_' are metadata (only __key__ is written; webdataset leaves the others out)"
                .into(),
        );
    }
    if field.starts_with('.') || field.ends_with('.') || field.contains("..") {
        return refuse("'.' may only separate non-empty parts (as in \"seg.png\")".into());
    }
    if field.chars().any(char::is_control) {
        return refuse("it contains a control character".into());
    }
    let lower = field.to_lowercase();
    if lower != field {
        return refuse(format!(
            "readers lower-case field names, so it would read back as {lower:?}; name it {lower:?}"
        ));
    }
    if key.len() + 1 + field.len() > MAX_NAME_BYTES {
        return refuse(format!(
            "the member name \"{key}.{field}\" would be longer than {MAX_NAME_BYTES} bytes"
        ));
    }
    Ok(())
}

/// The extension that picks a value's encoding: the field name after its
/// last dot.
fn extension(field: &str) -> &str {
    field.rsplit('.').next().unwrap_or(field)
}

/// The bytes written for field `field` of sample `key`.
pub fn encode(key: &str, field: &str, value: FieldValue) -> Result<Vec<u8>, Error> {
    if field.ends_with(".gz") && !matches!(value, FieldValue::Bytes(_)) {
        return Err(wrong_type(
            key,
            field,
            "a field ending in .gz takes bytes already gzip-compressed (values are written as given, never compressed here)".into(),
        ));
    }
    let ext = extension(field);
    let numbers = NUMBER_EXTENSIONS.join(", .");
    match value {
        FieldValue::Bytes(bytes) => Ok(bytes),
        FieldValue::Text(text) => Ok(text.into_bytes()),
        FieldValue::Number { text, .. } if NUMBER_EXTENSIONS.contains(&ext) => Ok(text.into_bytes()),
        FieldValue::Number { json, .. } | FieldValue::Json { json, .. }
            if JSON_EXTENSIONS.contains(&ext) =>
        {
            Ok(json.into_bytes())
        }
        FieldValue::Number { kind, .. } => Err(wrong_type(
            key,
            field,
            format!(
                "{kind} values are written only to a field ending in .{numbers} (as text) or .json, .jsn (as JSON); give str or bytes for other fields"
            ),
        )),
        FieldValue::Json { kind, .. } => Err(wrong_type(
            key,
            field,
            format!(
                "{kind} values are written only to a field ending in .json or .jsn (as JSON); give str or bytes for other fields"
            ),
        )),
    }
}

/// `x` as Python's `repr(x)` (and `str(x)`) writes a float: the shortest
/// digits that read back as `x`, in positional notation for decimal
/// exponents from -4 to 15 (with at least one digit after the point), else
/// as `d.ddde±XX`.
pub fn python_float_text(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.25e-7".
    let shortest = format!("{x:e}");
    let (mantissa, exponent) = shortest.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} has an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1; // digits before the decimal point
        let text = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{text}")
    } else {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{first}{fraction}e{exp_sign}{:02}", exponent.abs())
    }
}

/// `x` as Python's `json.dumps(x)` writes a float (`NaN`, `Infinity` and
/// `-Infinity` for the values JSON lacks).
pub fn python_float_json(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        python_float_text(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        // Expected texts are Python 3.11's repr() of the same values.
        let cases: [(f64, &str); 16] = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789.125, "123456789.125"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (1e100, "1e+100"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (1.0 / 3.0, "0.3333333333333333"),
        ];
        for (x, expected) in cases {
            assert_eq!(python_float_text(x), expected, "{x}");
        }
        assert_eq!(python_float_text(f64::NAN), "nan");
        assert_eq!(python_float_json(f64::NEG_INFINITY), "-Infinity");
        assert_eq!(python_float_json(2.0), "2.0");
    }

    #[test]
    fn keys_and_fields_that_would_not_read_back_are_refused() {
        for key in ["a", "dir/a", "a b", "A-1_x"] {
            check_key(key).unwrap();
        }
        for key in ["", "a.b", "/a", "a/", "a//b", "a\nb", "./a"] {
            let err = check_key(key).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidSample {
                        wrong_type: false,
                        ..
                    }
                ),
                "{err}"
            );
        }
        for field in ["jpg", "seg.png", "json", "x-1"] {
            check_field("k", field).unwrap();
        }
        for (field, says) in [
            ("", "empty"),
            ("a/b", "'/'"),
            ("_meta", "'_'"),
            ("__url", "'_'"),
            (".jpg", "'.'"),
            ("jpg.", "'.'"),
            ("a..b", "'.'"),
            ("JPG", "\"jpg\""),
        ] {
            let err = check_field("k", field).unwrap_err().to_string();
            assert!(
                err.contains(says) && err.contains("\"k\""),
                "{field}: {err}"
            );
        }
    }

    #[test]
    fn values_are_encoded_by_the_field_extension_as_webdataset_does() {
        let number = || FieldValue::Number {
            kind: "int".into(),
            text: "3".into(),
            json: "3".into(),
        };
        let dict = || FieldValue::Json {
            kind: "dict".into(),
            json: "{\"a\": 1}".into(),
        };
        assert_eq!(encode("k", "cls", number()).unwrap(), b"3");
        assert_eq!(encode("k", "x.id", number()).unwrap(), b"3");
        assert_eq!(encode("k", "json", number()).unwrap(), b"3");
        assert_eq!(encode("k", "meta.json", dict()).unwrap(), b"{\"a\": 1}");
        assert_eq!(
            encode("k", "txt", FieldValue::Text("é".into())).unwrap(),
            "é".as_bytes()
        );
        assert_eq!(
            encode("k", "bin", FieldValue::Bytes(vec![0, 1])).unwrap(),
            [0, 1]
        );
        assert_eq!(
            encode("k", "txt.gz", FieldValue::Bytes(vec![7])).unwrap(),
            [7]
        );
        for (field, value) in [
            ("label", number()),
            ("cls", dict()),
            ("txt.gz", FieldValue::Text("a".into())),
        ] {
            let err = encode("k", field, value).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidSample {
                        wrong_type: true,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(
                err.to_string().contains(&format!("field {field:?}")),
                "{err}"
            );
        }
    }
}
