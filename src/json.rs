//! A JSON document into the [`Value`] that Python's `json.loads` gives,
//! type for type and value for value: the `json` field decoder's, and each
//! line of a JSON-lines shard's (`format::lines`).
//!
//! serde_json (built without `preserve_order` or `arbitrary_precision`)
//! checks the syntax and unescapes strings, and a [`Visitor`] builds the
//! [`Value`] directly, with no intermediate `serde_json::Value`:
//!
//! * objects become [`Value::Map`] in document order; a repeated key keeps
//!   its first position and its last value, as in a Python `dict`;
//! * arrays become [`Value::List`], `null` [`Value::Null`];
//! * numbers are re-read from their literal text, because serde_json's
//!   default float parsing may be off by one unit in the last place and it
//!   turns integers beyond 64 bits into floats: an integer literal (no `.`,
//!   `e` or `E`) becomes [`Value::Int`] when it fits `i64`, else
//!   [`Value::UInt`] when it fits `u64`, else an error (Python would give
//!   an arbitrary-precision `int`, which [`Value`] cannot hold); any other
//!   number becomes [`Value::Float`], correctly rounded as Python does.
//!
//! Differences from `json.loads`, all of which are errors here: the
//! non-standard `NaN`, `Infinity` and `-Infinity`; numbers too large for a
//! float (`1e400`, which Python reads as `inf`); strings holding an
//! unpaired surrogate escape (`"\ud800"`); nesting deeper than 128 levels;
//! UTF-16 or UTF-32 input. A UTF-8 byte-order mark is skipped, as
//! `json.loads` does for `bytes`.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::value::Value;

/// Decodes one JSON document (trailing whitespace allowed, nothing else).
pub fn decode(bytes: &[u8]) -> Result<Value, String> {
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let numbers = Numbers {
        source: bytes,
        spans: number_spans(bytes),
        next: Cell::new(0),
    };
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = JsonSeed(&numbers)
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value))
        .map_err(|e| format!("invalid JSON: {e}"))?;
    Ok(value)
}

/// The byte ranges of the number literals outside strings, in document
/// order: for valid JSON, the n-th number serde_json visits is the n-th
/// range.
fn number_spans(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                spans.push((start, i));
            }
            _ => i += 1,
        }
    }
    spans
}

/// The number literals of the document being decoded, and how many of
/// them have been visited.
struct Numbers<'a> {
    source: &'a [u8],
    spans: Vec<(usize, usize)>,
    next: Cell<usize>,
}

impl Numbers<'_> {
    /// The value of the next number literal, read as Python reads it.
    fn next<E: de::Error>(&self) -> Result<Value, E> {
        let index = self.next.get();
        self.next.set(index + 1);
        let &(start, end) = self
            .spans
            .get(index)
            .ok_or_else(|| E::custom("number literals out of step with the parser"))?;
        // The literal is ASCII: it matched the span scanner's byte set.
        let text = std::str::from_utf8(&self.source[start..end]).map_err(E::custom)?;
        if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
            return text
                .parse::<f64>()
                .map(Value::Float)
                .map_err(|_| E::custom(format_args!("invalid number {text}")));
        }
        if let Ok(int) = text.parse::<i64>() {
            Ok(Value::Int(int))
        } else if let Ok(uint) = text.parse::<u64>() {
            Ok(Value::UInt(uint))
        } else {
            Err(E::custom(format_args!(
                "integer {} does not fit in 64 bits",
                abbreviate(text)
            )))
        }
    }
}

/// A long literal cut to its first and last digits.
fn abbreviate(text: &str) -> String {
    if text.len() <= 50 {
        text.to_owned()
    } else {
        format!(
            "{}...{} ({} digits)",
            &text[..20],
            &text[text.len() - 20..],
            text.len()
        )
    }
}

/// Builds a [`Value`] from any JSON value; copied into nested arrays and
/// objects so they share the number literals.
#[derive(Clone, Copy)]
struct JsonSeed<'n, 'a>(&'n Numbers<'a>);

impl<'de> DeserializeSeed<'de> for JsonSeed<'_, '_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonSeed<'_, '_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Value, E> {
        self.0.next()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Value, E> {
        self.0.next()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value, E> {
        self.0.next()
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Value, E> {
        Ok(Value::Str(value.to_owned()))
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Value, E> {
        Ok(Value::Str(value))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries: Vec<(String, Value)> =
            Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            entries.push((key, value));
        }
        Ok(Value::Map(dedup_keys(entries)))
    }
}

/// Entries with unique keys, as a Python `dict` built from them in order
/// would hold them: each key at its first position, with its last value.
fn dedup_keys(entries: Vec<(String, Value)>) -> Vec<(String, Value)> {
    let has_duplicates = if entries.len() <= 16 {
        entries
            .iter()
            .enumerate()
            .any(|(i, (key, _))| entries[..i].iter().any(|(k, _)| k == key))
    } else {
        let mut seen = std::collections::HashSet::with_capacity(entries.len());
        !entries.iter().all(|(key, _)| seen.insert(key.as_str()))
    };
    if !has_duplicates {
        return entries;
    }
    let mut position: HashMap<String, usize> = HashMap::with_capacity(entries.len());
    let mut unique: Vec<(String, Value)> = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        match position.get(&key) {
            Some(&at) => unique[at].1 = value,
            None => {
                position.insert(key.clone(), unique.len());
                unique.push((key, value));
            }
        }
    }
    unique
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Value {
        decode(text.as_bytes()).unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    fn json_err(bytes: &[u8]) -> String {
        decode(bytes).unwrap_err()
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(
            entries
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        )
    }

    #[test]
    fn scalars() {
        assert_eq!(json("null"), Value::Null);
        assert_eq!(json(" true "), Value::Bool(true));
        assert_eq!(json("false\n"), Value::Bool(false));
        assert_eq!(json("0"), Value::Int(0));
        assert_eq!(json("-0"), Value::Int(0));
        assert_eq!(json("-7"), Value::Int(-7));
        assert_eq!(json("\"x\""), Value::Str("x".into()));
    }

    #[test]
    fn nested_objects_keep_key_order() {
        let value = json(
            r#"{"zeta": 1, "alpha": [1, 2.5, "three", null, {"k": []}],
                "mid": {"b": true, "a": {"deep": [[], [{}]]}}, "empty": {}}"#,
        );
        let expected = map(vec![
            ("zeta", Value::Int(1)),
            (
                "alpha",
                Value::List(vec![
                    Value::Int(1),
                    Value::Float(2.5),
                    Value::Str("three".into()),
                    Value::Null,
                    map(vec![("k", Value::List(vec![]))]),
                ]),
            ),
            (
                "mid",
                map(vec![
                    ("b", Value::Bool(true)),
                    (
                        "a",
                        map(vec![(
                            "deep",
                            Value::List(vec![Value::List(vec![]), Value::List(vec![map(vec![])])]),
                        )]),
                    ),
                ]),
            ),
            ("empty", map(vec![])),
        ]);
        assert_eq!(value, expected);
    }

    #[test]
    fn repeated_keys_behave_like_a_python_dict() {
        // json.loads('{"a": 1, "b": 2, "a": 3}') == {'a': 3, 'b': 2}
        assert_eq!(
            json(r#"{"a": 1, "b": 2, "a": 3}"#),
            map(vec![("a", Value::Int(3)), ("b", Value::Int(2))])
        );
        let many: Vec<String> = (0..40).map(|i| format!("\"k{}\": {i}", i % 20)).collect();
        let value = json(&format!("{{{}}}", many.join(", ")));
        let Value::Map(entries) = value else {
            panic!("not a map")
        };
        assert_eq!(entries.len(), 20);
        for (i, (key, value)) in entries.iter().enumerate() {
            assert_eq!(key, &format!("k{i}"));
            assert_eq!(value, &Value::Int(i as i64 + 20));
        }
    }

    #[test]
    fn unicode_strings_and_escapes() {
        assert_eq!(
            json(r#"{"ключ": "héllo \u00e9 \ud83c\udf89 🎉 \n\t\"\\\/ 世界"}"#),
            map(vec![(
                "ключ",
                Value::Str("héllo é 🎉 🎉 \n\t\"\\/ 世界".into())
            )])
        );
        // Digits inside strings and keys are not numbers.
        assert_eq!(
            json(r#"{"1e5": "-2.5 \" 3", "x": [4, "5", 6.0]}"#),
            map(vec![
                ("1e5", Value::Str("-2.5 \" 3".into())),
                (
                    "x",
                    Value::List(vec![
                        Value::Int(4),
                        Value::Str("5".into()),
                        Value::Float(6.0)
                    ])
                ),
            ])
        );
        // A UTF-8 byte-order mark is skipped, as json.loads(bytes) does.
        assert_eq!(
            decode(b"\xef\xbb\xbf[1]"),
            Ok(Value::List(vec![Value::Int(1)]))
        );
    }

    #[test]
    fn integers_by_size() {
        assert_eq!(json("9223372036854775807"), Value::Int(i64::MAX));
        assert_eq!(json("-9223372036854775808"), Value::Int(i64::MIN));
        assert_eq!(json("9223372036854775808"), Value::UInt(1 << 63));
        assert_eq!(json("18446744073709551615"), Value::UInt(u64::MAX));
        assert_eq!(
            json_err(b"[18446744073709551616]"),
            "invalid JSON: integer 18446744073709551616 does not fit in 64 bits at line 1 column 21"
        );
        assert!(json_err(b"-9223372036854775809").contains("does not fit in 64 bits"));
        let long = format!("[{}]", "7".repeat(60));
        assert!(json_err(long.as_bytes()).contains(
            "integer 77777777777777777777...77777777777777777777 (60 digits) does not fit"
        ));
        // Beyond the float range serde_json itself refuses the literal.
        let huge = format!("[{}]", "7".repeat(400));
        assert!(json_err(huge.as_bytes()).contains("number out of range"));
    }

    #[test]
    fn floats_are_correctly_rounded() {
        let cases = [
            "0.1",
            "-0.0",
            "1.0",
            "1e5",
            "1E-5",
            "2.5e+3",
            "0.30000000000000004",
            "1.7976931348623157e308",
            "5e-324",
            "2.2250738585072011e-308",
            "9007199254740993.0",
            "123456789012345678901234567890.0",
            "0.1234567890123456789012345678901234567890",
            "3.141592653589793238462643383279",
            "1e23",
            "8.41e21",
            "4.9406564584124654e-324",
        ];
        for text in cases {
            let expected: f64 = text.parse().unwrap();
            match json(text) {
                Value::Float(x) => {
                    assert_eq!(x.to_bits(), expected.to_bits(), "{text}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        // Large floats that are integers stay floats, as in Python.
        assert_eq!(
            json("[1e20, 2.0]"),
            Value::List(vec![Value::Float(1e20), Value::Float(2.0)])
        );
    }

    #[test]
    fn invalid_documents_are_errors() {
        let cases: [&[u8]; 16] = [
            b"",
            b"   ",
            b"{",
            b"[1, 2",
            b"{\"a\" 1}",
            b"[1,]",
            b"01",
            b"1.",
            b"NaN",
            b"Infinity",
            b"[-Infinity]",
            b"1e400",
            b"\"\\ud800\"",
            b"{} {}",
            b"\"\xff\"",
            b"[\"unterminated]",
        ];
        for bytes in cases {
            let reason = json_err(bytes);
            assert!(reason.starts_with("invalid JSON: "), "{reason}");
        }
        assert_eq!(
            json_err(b"[1, 2"),
            "invalid JSON: EOF while parsing a list at line 1 column 5"
        );
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(json_err(deep.as_bytes()).contains("recursion limit"));
    }

    #[test]
    fn number_spans_skip_strings() {
        let text = br#"{"a\"1": [-1, 2.5e-3], "b": "x\\", "c": 3}"#;
        let spans: Vec<&[u8]> = number_spans(text)
            .into_iter()
            .map(|(s, e)| &text[s..e])
            .collect();
        assert_eq!(spans, vec![&b"-1"[..], b"2.5e-3", b"3"]);
    }
}
