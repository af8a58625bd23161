//! The header of a `.npy` file: the magic, the version, the header length
//! and the header itself, the text of a Python dict literal, parsed with a
//! small parser of the literals it may hold (never evaluated).

use std::fmt;

/// The first bytes of every `.npy` file.
const MAGIC: &[u8] = b"\x93NUMPY";

/// Nesting allowed in the header literal (shapes and dtypes need 3).
const MAX_DEPTH: usize = 32;

/// The header text and the offset of the first element byte.
pub(super) fn split_header(bytes: &[u8]) -> Result<(String, usize), String> {
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
pub(super) struct Header {
    /// The element type.
    pub(super) dtype: Dtype,
    /// Whether the elements are stored in Fortran (column-major) order.
    pub(super) fortran_order: bool,
    /// The array's shape.
    pub(super) shape: Vec<usize>,
}

/// Parses the header text into its three fields.
pub(super) fn parse_header(text: &str) -> Result<Header, String> {
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
pub(super) enum Kind {
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
pub(super) struct Dtype {
    /// The element type.
    pub(super) kind: Kind,
    /// Whether the elements are big-endian.
    pub(super) big_endian: bool,
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

    /// Bytes per element.
    pub(super) fn itemsize(&self) -> usize {
        match self.kind {
            Kind::Bool | Kind::U8 | Kind::I8 => 1,
            Kind::U16 | Kind::I16 => 2,
            Kind::U32 | Kind::I32 | Kind::F32 => 4,
            Kind::U64 | Kind::I64 | Kind::F64 => 8,
        }
    }

    /// The numpy name of the element type.
    pub(super) fn name(&self) -> &'static str {
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

/// A shape shown as a Python tuple.
pub(super) struct ShapeText<'a>(pub(super) &'a [usize]);

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
